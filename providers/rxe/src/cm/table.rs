//! The connection manager's table: every connection of the device, in any phase, by our
//! communication ID, with indexes by (peer address, the peer's communication ID) and by QP
//! number, so no CM message and no verb pays a scan; and the connection requests still
//! waiting for their consumer (phase `ReqRcvd`), in expiry order per listener and for the
//! whole device, so the caps and the expiry sweep find the oldest at once.
//!
//! Every insertion and removal goes through [`Conns`], which keeps the indexes true; the
//! fields they are built on (the peer's ID, the QP, the listener, the expiry) are private
//! and change only through its methods.

use super::{Mad, Phase, QpRef, MAD_RETRIES};
use crate::wire::cm;
use rnicpi::ConnParam;
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::time::Instant;

/// One connection (or connection attempt).
pub(super) struct Conn {
    pub phase: Phase,
    pub local_id: u32,
    /// The peer's communication ID; 0 until known (an active side learns it from the REP).
    remote_id: u32,
    pub local: IpAddr,
    pub peer: IpAddr,
    /// Our QP, once the connection has one.
    qp: Option<QpRef>,
    /// The peer's QP number (from its REQ or REP).
    pub remote_qpn: u32,
    /// Passive side: the REQ.
    pub req: Option<cm::Req>,
    /// Passive side of a UD resolution: the SIDR_REQ, and its transaction ID (the
    /// SIDR_REP carries it back).
    pub sidr: Option<cm::SidrReq>,
    pub tid: u64,
    /// Active side of a UD resolution: the UD QP that asked (not the connection's QP:
    /// a UD QP may resolve many services at once) and the port it asked for.
    pub resolver: Option<QpRef>,
    pub port: u16,
    /// Passive side: the listener the request was delivered to; only that listener may
    /// accept or reject it.
    listener: Option<u64>,
    /// Passive side, while the request waits for its consumer: when it expires.
    expires: Option<Instant>,
    /// The message to retry while waiting, and how often it may still be sent.
    pub retry: Option<Mad>,
    pub retries_left: u32,
    pub gen: u64,
    /// Our receive PSN (sent in the REQ or REP).
    pub rq_psn: u32,
    /// Active side: what the consumer asked for, and the path MTU the REQ offered.
    pub param: ConnParam,
    pub mtu: u32,
}

impl Conn {
    /// An active connection attempt of `qp` from `local` to `peer`, whose REQ `retry`
    /// is about to be sent.
    pub fn active(
        local_id: u32,
        (local, peer): (IpAddr, IpAddr),
        qp: QpRef,
        rq_psn: u32,
        param: ConnParam,
        mtu: u32,
        retry: Mad,
    ) -> Conn {
        Conn {
            phase: Phase::ReqSent,
            local_id,
            remote_id: 0,
            local,
            peer,
            qp: Some(qp),
            remote_qpn: 0,
            req: None,
            sidr: None,
            tid: 0,
            resolver: None,
            port: 0,
            listener: None,
            expires: None,
            retry: Some(retry),
            retries_left: MAD_RETRIES,
            gen: 0,
            rq_psn,
            param,
            mtu,
        }
    }

    /// A connection request from `peer` to our `local` delivered to `listener`, waiting
    /// until `expires`.
    pub fn request(
        local_id: u32,
        (local, peer): (IpAddr, IpAddr),
        req: cm::Req,
        listener: u64,
        expires: Instant,
    ) -> Conn {
        Conn {
            remote_qpn: req.local_qpn,
            req: Some(req),
            ..Conn::waiting(
                local_id,
                (local, peer),
                req.local_comm_id,
                listener,
                expires,
            )
        }
    }

    /// A UD resolution of `qp`'s: the SIDR_REQ `retry` for `port` from `local` to `peer`
    /// is about to be sent.
    pub fn resolving(
        request_id: u32,
        (local, peer): (IpAddr, IpAddr),
        qp: QpRef,
        port: u16,
        retry: Mad,
    ) -> Conn {
        Conn {
            phase: Phase::SidrSent,
            qp: None,
            resolver: Some(qp),
            port,
            ..Conn::active(
                request_id,
                (local, peer),
                qp,
                0,
                ConnParam::default(),
                0,
                retry,
            )
        }
    }

    /// A SIDR request (`req`, transaction `tid`) from `peer` to our `local` delivered to
    /// `listener`, waiting until `expires`.
    pub fn sidr_request(
        local_id: u32,
        (local, peer): (IpAddr, IpAddr),
        (tid, req): (u64, cm::SidrReq),
        listener: u64,
        expires: Instant,
    ) -> Conn {
        Conn {
            sidr: Some(req),
            tid,
            ..Conn::waiting(local_id, (local, peer), req.request_id, listener, expires)
        }
    }

    /// SIDR request `c`, answered with `rep`: kept (waiting for nobody) to answer its
    /// retries the same way.
    pub fn answered(c: Conn, rep: Mad) -> Conn {
        Conn {
            phase: Phase::SidrAnswered,
            listener: None,
            expires: None,
            retry: Some(rep),
            ..c
        }
    }

    /// A request of the peer's (its ID `remote_id`) waiting for `listener`'s consumer.
    fn waiting(
        local_id: u32,
        (local, peer): (IpAddr, IpAddr),
        remote_id: u32,
        listener: u64,
        expires: Instant,
    ) -> Conn {
        Conn {
            phase: Phase::ReqRcvd,
            local_id,
            remote_id,
            local,
            peer,
            qp: None,
            remote_qpn: 0,
            req: None,
            sidr: None,
            tid: 0,
            resolver: None,
            port: 0,
            listener: Some(listener),
            expires: Some(expires),
            retry: None,
            retries_left: 0,
            gen: 0,
            rq_psn: 0,
            param: ConnParam::default(),
            mtu: 0,
        }
    }

    pub fn remote_id(&self) -> u32 {
        self.remote_id
    }

    pub fn qp(&self) -> Option<QpRef> {
        self.qp
    }

    pub fn listener(&self) -> Option<u64> {
        self.listener
    }

    /// Whether a CM message from `src` naming `remote_id` as the sender's ID belongs to
    /// this connection (a peer's ID of 0 means the peer has not told us its ID yet).
    pub fn is_from(&self, src: IpAddr, remote_id: u32) -> bool {
        self.peer == src && (self.remote_id == remote_id || self.remote_id == 0)
    }
}

/// Where to look for waiting requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    /// Those delivered to one listener.
    Listener(u64),
    /// All of the device's.
    Device,
}

/// Every connection of a device.
#[derive(Default)]
pub(super) struct Conns {
    by_id: HashMap<u32, Conn>,
    by_remote: HashMap<(IpAddr, u32), u32>,
    by_qp: HashMap<u32, u32>,
    /// Requests waiting for their consumer, by expiry: all of them, and per listener.
    pending: BTreeSet<(Instant, u32)>,
    pending_of: HashMap<u64, BTreeSet<(Instant, u32)>>,
}

impl Conns {
    /// Connections (and attempts) in the table.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Requests waiting for their consumer.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Requests delivered to `listener` and not yet answered.
    pub fn pending_of(&self, listener: u64) -> usize {
        self.pending_of.get(&listener).map_or(0, BTreeSet::len)
    }

    pub fn contains(&self, id: u32) -> bool {
        self.by_id.contains_key(&id)
    }

    pub fn get(&self, id: u32) -> Option<&Conn> {
        self.by_id.get(&id)
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut Conn> {
        self.by_id.get_mut(&id)
    }

    /// Our ID of the connection whose peer `peer` calls it `remote_id`.
    pub fn by_remote(&self, peer: IpAddr, remote_id: u32) -> Option<u32> {
        self.by_remote.get(&(peer, remote_id)).copied()
    }

    /// Our ID of the connection of `qp` (not of an earlier QP that had its number).
    pub fn of_qp(&self, qp: QpRef) -> Option<u32> {
        let id = *self.by_qp.get(&qp.qpn)?;
        (self.by_id.get(&id)?.qp == Some(qp)).then_some(id)
    }

    /// Add a connection. Its peer's ID and its QP must not name another connection
    /// already (callers look them up first).
    pub fn insert(&mut self, c: Conn) {
        let id = c.local_id;
        if c.remote_id != 0 {
            self.by_remote.insert((c.peer, c.remote_id), id);
        }
        if let Some(qp) = c.qp {
            self.by_qp.insert(qp.qpn, id);
        }
        if let (Some(at), Some(l)) = (c.expires, c.listener) {
            self.pending.insert((at, id));
            self.pending_of.entry(l).or_default().insert((at, id));
        }
        self.by_id.insert(id, c);
    }

    pub fn remove(&mut self, id: u32) -> Option<Conn> {
        let c = self.by_id.remove(&id)?;
        if c.remote_id != 0 && self.by_remote.get(&(c.peer, c.remote_id)) == Some(&id) {
            self.by_remote.remove(&(c.peer, c.remote_id));
        }
        if let Some(qp) = c.qp {
            if self.by_qp.get(&qp.qpn) == Some(&id) {
                self.by_qp.remove(&qp.qpn);
            }
        }
        self.unpend(&c);
        Some(c)
    }

    /// The peer told us its ID (a REP); false when that ID already names another of
    /// this peer's connections (a stale or hostile REP).
    pub fn set_remote(&mut self, id: u32, remote_id: u32) -> bool {
        let Some(c) = self.by_id.get_mut(&id) else {
            return false;
        };
        match self.by_remote.get(&(c.peer, remote_id)) {
            Some(other) if *other != id => return false,
            _ => {}
        }
        if c.remote_id != 0 {
            self.by_remote.remove(&(c.peer, c.remote_id));
        }
        c.remote_id = remote_id;
        self.by_remote.insert((c.peer, remote_id), id);
        true
    }

    /// The consumer answered request `id` by accepting it onto `qp`: it stops waiting.
    pub fn accepted(&mut self, id: u32, qp: QpRef) {
        let Some(c) = self.by_id.get_mut(&id) else {
            return;
        };
        c.qp = Some(qp);
        self.by_qp.insert(qp.qpn, id);
        let at = c.expires.take();
        if let (Some(at), Some(l)) = (at, c.listener) {
            self.drop_pending(l, at, id);
        }
    }

    fn unpend(&mut self, c: &Conn) {
        if let (Some(at), Some(l)) = (c.expires, c.listener) {
            self.drop_pending(l, at, c.local_id);
        }
    }

    fn drop_pending(&mut self, listener: u64, at: Instant, id: u32) {
        self.pending.remove(&(at, id));
        if let Some(set) = self.pending_of.get_mut(&listener) {
            set.remove(&(at, id));
            if set.is_empty() {
                self.pending_of.remove(&listener);
            }
        }
    }

    /// The waiting request that expires first in `scope`.
    pub fn oldest_pending(&self, scope: Scope) -> Option<u32> {
        let set = match scope {
            Scope::Listener(l) => self.pending_of.get(&l)?,
            Scope::Device => &self.pending,
        };
        set.first().map(|&(_, id)| id)
    }

    /// Up to `max` waiting requests expired at `now`, oldest first.
    pub fn expired(&self, now: Instant, max: usize) -> Vec<u32> {
        self.pending
            .iter()
            .take_while(|(at, _)| *at <= now)
            .take(max)
            .map(|&(_, id)| id)
            .collect()
    }

    /// The requests waiting for `listener`.
    pub fn pending_ids_of(&self, listener: u64) -> Vec<u32> {
        self.pending_of
            .get(&listener)
            .map(|s| s.iter().map(|&(_, id)| id).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn req(remote_id: u32) -> cm::Req {
        let zeros = [0u8; crate::wire::mad::MAD_LEN - 24];
        let Ok(cm::CmMessage::Req(mut r)) = cm::CmMessage::parse(cm::ATTR_REQ, &zeros) else {
            panic!("an all-zero REQ parses");
        };
        r.local_comm_id = remote_id;
        r
    }

    #[test]
    fn indexes_follow_insert_and_remove() {
        let mut t = Conns::default();
        let peer: IpAddr = [10, 0, 0, 1].into();
        let local: IpAddr = [10, 0, 0, 2].into();
        let now = Instant::now();
        for i in 1..=3u32 {
            let at = now + Duration::from_secs(i as u64);
            t.insert(Conn::request(i, (local, peer), req(100 + i), 7, at));
        }
        assert_eq!((t.len(), t.pending(), t.pending_of(7)), (3, 3, 3));
        assert_eq!(t.by_remote(peer, 102), Some(2));
        assert_eq!(
            t.by_remote(local, 102),
            None,
            "another peer's ID names nothing"
        );
        assert_eq!(t.oldest_pending(Scope::Listener(7)), Some(1));
        assert_eq!(t.oldest_pending(Scope::Listener(8)), None);
        assert_eq!(t.oldest_pending(Scope::Device), Some(1));
        assert_eq!(t.expired(now + Duration::from_millis(2500), 10), vec![1, 2]);
        assert_eq!(t.expired(now + Duration::from_secs(9), 1), vec![1]);
        t.remove(1);
        assert_eq!((t.len(), t.pending(), t.by_remote(peer, 101)), (2, 2, None));
        assert_eq!(t.pending_ids_of(7), vec![2, 3]);
    }

    #[test]
    fn set_remote_refuses_an_id_in_use() {
        let mut t = Conns::default();
        let peer: IpAddr = [10, 0, 0, 1].into();
        let at = Instant::now();
        t.insert(Conn::request(1, (peer, peer), req(55), 1, at));
        t.insert(Conn::request(2, (peer, peer), req(56), 1, at));
        assert!(!t.set_remote(2, 55), "55 names connection 1");
        assert!(t.set_remote(2, 57));
        assert_eq!(
            (t.by_remote(peer, 56), t.by_remote(peer, 57)),
            (None, Some(2))
        );
    }
}
