//! The passive side: listeners, connection requests and their bounds, accept (REP, then
//! the RTU establishes) and reject.
//!
//! A connection request belongs to the listener it was delivered to: only that listener
//! may accept or reject it (another listener — another tenant — naming its ID gets
//! `NoSuchResource`, as for an ID that does not exist). Requests waiting for their
//! consumer are bounded: a listener holds at most its backlog, the device at most
//! [`MAX_PENDING`]; a request beyond either bound pushes out the oldest one waiting
//! (REJ, no resources), so a flood of spoofed REQs costs the flooded listener only its
//! backlog and a genuine client that comes after still gets in. A request expires after
//! the time its sender said it would wait for our answer (REJ, consumer-defined, what
//! Linux sends for a request nobody answered). A request reaches the consumer only if its
//! event queue has room for it under the share requests may take
//! ([`EventSink::offer_request`]); otherwise it is refused at once (REJ, no resources), so
//! requests never push the consumer's other events out.

use super::table::{Conn, Scope};
use super::{
    bring_up, mad_bytes, pad, send_mad, send_rej, Cm, Link, ListenEntry, Phase, MAD_RETRIES,
};
use crate::device::Shared;
use crate::net::{canonical, Datagram};
use crate::qp::RxeQp;
use crate::timer::Target;
use crate::wire::cm::{self, rej_reason, CmMessage};
use crate::wire::cma;
use rnicpi::*;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Connection requests the device holds for consumers at most, over all listeners.
pub const MAX_PENDING: usize = 4096;
/// The least and the most time a request waits for its consumer.
const REQUEST_TTL_MIN: Duration = Duration::from_secs(2);
const REQUEST_TTL_MAX: Duration = Duration::from_secs(60);
/// How often expired requests are looked for while any wait, and how many one look
/// refuses at most (the rest wait for the next look, [`SWEEP_AGAIN`] later).
const SWEEP_EVERY: Duration = Duration::from_secs(1);
const SWEEP_BUDGET: usize = 256;
const SWEEP_AGAIN: Duration = Duration::from_millis(10);

/// How long a request waits for its consumer: as long as its sender said it would wait
/// for our answer (its CM response timeout, 4.096 µs × 2^t, times its retries + 1), within
/// [`REQUEST_TTL_MIN`, `REQUEST_TTL_MAX`].
fn request_ttl(req: &cm::Req) -> Duration {
    let per_try = Duration::from_nanos(4096u64 << req.remote_cm_response_timeout.min(31));
    (per_try * (req.max_cm_retries as u32 + 1)).clamp(REQUEST_TTL_MIN, REQUEST_TTL_MAX)
}

/// A passive endpoint on an rdma_cm port.
pub struct RxeListener {
    shared: Weak<Shared>,
    addr: SocketAddr,
    id: u64,
}

pub fn listen(
    s: &Arc<Shared>,
    addr: SocketAddr,
    backlog: u32,
    sink: Arc<dyn EventSink>,
) -> Result<Arc<dyn ProviderListener>> {
    let ip = Some(canonical(addr.ip())).filter(|a| !a.is_unspecified());
    if let Some(a) = ip {
        if !s.addrs().contains(&a) {
            return Err(VerbsError::Unreachable);
        }
    }
    let mut i = s.cm.inner.lock();
    let port = if addr.port() == 0 {
        loop {
            let p = 0x8000 | (crate::random::u32()? as u16 & 0x3fff);
            if !i.listeners.contains_key(&p) {
                break p;
            }
        }
    } else {
        addr.port()
    };
    let entries = i.listeners.entry(port).or_default();
    if entries
        .iter()
        .any(|e| e.addr.is_none() || ip.is_none() || e.addr == ip)
    {
        return Err(VerbsError::AddrInUse);
    }
    let id =
        s.cm.next_listener
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let backlog = (backlog as usize).clamp(1, MAX_PENDING);
    entries.push(ListenEntry {
        addr: ip,
        sink,
        id,
        backlog,
    });
    tracing::info!(port, ?ip, backlog, "rxe CM: listening");
    Ok(Arc::new(RxeListener {
        shared: Arc::downgrade(s),
        addr: SocketAddr::new(ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), port),
        id,
    }))
}

impl RxeListener {
    /// The request `conn_id` if it was delivered to this listener and still waits.
    fn request(&self, i: &super::Inner, conn_id: u64) -> Result<u32> {
        let id = u32::try_from(conn_id).map_err(|_| VerbsError::NoSuchResource)?;
        match i.conns.get(id) {
            Some(c) if c.listener() == Some(self.id) => match c.phase {
                Phase::ReqRcvd => Ok(id),
                _ => Err(VerbsError::BadState),
            },
            // Another listener's request, maybe another tenant's: it names nothing here.
            _ => Err(VerbsError::NoSuchResource),
        }
    }
}

impl ProviderListener for RxeListener {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, conn_id: u64, qp: &Arc<dyn ProviderQp>, param: ConnParam) -> Result<()> {
        let s = self.shared.upgrade().ok_or(VerbsError::BadState)?;
        let rqp = qp
            .as_any()
            .downcast_ref::<RxeQp>()
            .and_then(RxeQp::arc)
            .ok_or(VerbsError::Invalid)?;
        if param.private_data.len() > cm::REP_PRIVATE_DATA_LEN {
            return Err(VerbsError::Invalid);
        }
        let mut i = s.cm.inner.lock();
        let id = self.request(&i, conn_id)?;
        if i.conns.of_qp(&rqp).is_some() {
            return Err(VerbsError::BadState);
        }
        let rq_psn = crate::random::psn()?;
        let c = i.conns.get(id).ok_or(VerbsError::NoSuchResource)?;
        let req = c.req.ok_or(VerbsError::BadState)?;
        let mtu = cm::mtu_bytes(req.path_mtu)
            .map(|m| m as u32)
            .unwrap_or(1024)
            .min(s.active_mtu());
        let ird = param.ird.min(s.attr.max_ird);
        let link = Link {
            peer: c.peer,
            local: c.local,
            remote_qpn: req.local_qpn,
            rq_psn,
            sq_psn: req.starting_psn,
            mtu,
            ird,
            ord: param.ord.min(req.responder_resources as u32),
        };
        let rep = cm::Rep {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id(),
            local_qkey: 0,
            local_qpn: rqp.qpn,
            local_eecn: 0,
            starting_psn: rq_psn,
            responder_resources: ird as u8,
            initiator_depth: param.ord.clamp(1, s.attr.max_ord) as u8,
            target_ack_delay: 0,
            failover_accepted: 0,
            end_to_end_flow_control: false,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: s.attr.node_guid,
            private_data: pad(&param.private_data),
        };
        let mad = mad_bytes(CmMessage::Rep(rep))?;
        bring_up(&s, &rqp, &link)?;
        i.conns.accepted(id, &rqp);
        let Some(c) = i.conns.get_mut(id) else {
            return Err(VerbsError::NoSuchResource);
        };
        c.phase = Phase::RepSent;
        c.remote_qpn = req.local_qpn;
        c.rq_psn = rq_psn;
        c.retry = Some(mad);
        c.retries_left = MAD_RETRIES;
        super::arm(&s, c);
        let (src, dst) = (c.local, c.peer);
        drop(i);
        tracing::info!(qpn = rqp.qpn, conn = id, "rxe CM: REP");
        send_mad(&s, src, dst, &mad);
        Ok(())
    }

    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        let s = self.shared.upgrade().ok_or(VerbsError::BadState)?;
        let mut i = s.cm.inner.lock();
        let id = self.request(&i, conn_id)?;
        let c = i.conns.remove(id).ok_or(VerbsError::NoSuchResource)?;
        drop(i);
        let ids = (c.local_id, c.remote_id());
        let rej = super::rej_mad(
            ids.0,
            ids.1,
            cm::msg_ref::REQ,
            rej_reason::CONSUMER_DEFINED,
            private_data,
        )?;
        send_mad(&s, c.local, c.peer, &rej);
        Ok(())
    }

    fn close(&self) {
        let Some(s) = self.shared.upgrade() else {
            return;
        };
        let mut i = s.cm.inner.lock();
        for entries in i.listeners.values_mut() {
            entries.retain(|e| e.id != self.id);
        }
        i.listeners.retain(|_, v| !v.is_empty());
        // Refuse the requests nobody will answer now.
        let refused: Vec<Conn> = i
            .conns
            .pending_ids_of(self.id)
            .into_iter()
            .filter_map(|id| i.conns.remove(id))
            .collect();
        drop(i);
        for c in refused {
            send_rej(
                &s,
                (c.local, c.peer),
                (c.local_id, c.remote_id()),
                cm::msg_ref::REQ,
                rej_reason::CONSUMER_DEFINED,
                &[],
            );
        }
    }
}

/// Refuse a REQ we keep no state for.
fn refuse(s: &Shared, d: &Datagram<'_>, req: &cm::Req, reason: u16) {
    send_rej(
        s,
        (d.dst, d.src),
        (0, req.local_comm_id),
        cm::msg_ref::REQ,
        reason,
        &[],
    );
}

impl Cm {
    pub(super) fn on_req(&self, s: &Arc<Shared>, d: &Datagram<'_>, req: cm::Req) {
        let mut i = self.inner.lock();
        // A retry of a REQ we already know: answer again if we have answered.
        if let Some(id) = i.conns.by_remote(d.src, req.local_comm_id) {
            let again = i
                .conns
                .get(id)
                .filter(|c| matches!(c.phase, Phase::RepSent | Phase::Established))
                .and_then(|c| c.retry.map(|m| (c.local, c.peer, m)));
            drop(i);
            if let Some((src, dst, m)) = again {
                send_mad(s, src, dst, &m);
            }
            return;
        }
        let port = match cma::parse_service_id(req.service_id) {
            Some((cma::RDMA_PS_TCP, port)) => port,
            _ => {
                drop(i);
                return refuse(s, d, &req, rej_reason::INVALID_SERVICE_ID);
            }
        };
        let listener = i.listeners.get(&port).and_then(|v| {
            v.iter()
                .find(|e| e.addr.is_none() || e.addr == Some(d.dst))
                .map(|e| (e.id, e.backlog, e.sink.clone()))
        });
        let Some((listener, backlog, sink)) = listener else {
            drop(i);
            return refuse(s, d, &req, rej_reason::INVALID_SERVICE_ID);
        };
        let Ok(local_id) = i.new_id() else {
            drop(i);
            s.count(&s.counters.cm_req_refused);
            return refuse(s, d, &req, rej_reason::NO_RESOURCES);
        };
        // Room for it: push out the oldest request of this listener (its backlog is
        // full) or of the device (all listeners together are at the device's bound).
        let crowded = if i.conns.pending_of(listener) >= backlog {
            Some(Scope::Listener(listener))
        } else if i.conns.pending() >= MAX_PENDING {
            Some(Scope::Device)
        } else {
            None
        };
        let evicted = crowded
            .and_then(|scope| i.conns.oldest_pending(scope))
            .and_then(|old| i.conns.remove(old));
        let expires = s.clock.now() + request_ttl(&req);
        i.conns.insert(Conn::request(
            local_id, d.dst, d.src, req, listener, expires,
        ));
        if i.sweep.is_none() {
            arm_sweep(s, &mut i, SWEEP_EVERY);
        }
        drop(i);
        if let Some(old) = evicted {
            s.count(&s.counters.cm_req_evicted);
            tracing::debug!(conn = old.local_id, peer = %old.peer, "rxe CM: request pushed out");
            send_rej(
                s,
                (old.local, old.peer),
                (old.local_id, old.remote_id()),
                cm::msg_ref::REQ,
                rej_reason::NO_RESOURCES,
                &[],
            );
        }
        let hdr = req.cma_header().ok();
        let peer_port = hdr.map(|h| h.src_port).unwrap_or(0);
        let ev = Event::new(EventKind::ConnectRequest)
            .with_conn(local_id as u64)
            .with_addrs(
                Some(SocketAddr::new(d.dst, port)),
                Some(SocketAddr::new(d.src, peer_port)),
            )
            .with_param(&ConnParam {
                private_data: req.private_data[cma::HEADER_LEN..].to_vec(),
                ird: req.responder_resources as u32,
                ord: req.initiator_depth as u32,
            });
        tracing::info!(conn = local_id, peer = %d.src, sport = d.sport, port, "rxe CM: connect request");
        if !sink.offer_request(ev) {
            // The consumer's queue has no room for more requests.
            let refused = self.inner.lock().conns.remove(local_id);
            s.count(&s.counters.cm_req_refused);
            if refused.is_some() {
                refuse(s, d, &req, rej_reason::NO_RESOURCES);
            }
        }
    }

    /// The RTU to our REP: the passive side is established. True when it came from the
    /// peer of the connection it names, with that peer's ID.
    pub(super) fn on_rtu(&self, d: &Datagram<'_>, rtu: cm::Rtu) -> bool {
        let mut i = self.inner.lock();
        let Some(c) = i
            .conns
            .get_mut(rtu.remote_comm_id)
            .filter(|c| c.peer == d.src && c.remote_id() == rtu.local_comm_id)
        else {
            return false;
        };
        if c.phase != Phase::RepSent {
            return true; // a repeated RTU
        }
        c.phase = Phase::Established;
        c.gen += 1; // stop retrying the REP
        let (qp, local, peer) = (c.qp.upgrade(), c.local, c.peer);
        let port = c.req.map(|r| r.service_id as u16).unwrap_or(0);
        drop(i);
        if let Some(qp) = qp {
            tracing::info!(qpn = qp.qpn, "rxe CM: established (passive)");
            qp.sink
                .deliver(Event::new(EventKind::Established).with_addrs(
                    Some(SocketAddr::new(local, port)),
                    Some(SocketAddr::new(peer, 0)),
                ));
        }
        true
    }

    /// The expiry sweep fired: refuse the requests whose consumer did not answer in time.
    pub fn on_sweep(&self, s: &Arc<Shared>, gen: u64) {
        let mut i = self.inner.lock();
        if i.sweep != Some(gen) {
            return;
        }
        i.sweep = None;
        let expired: Vec<Conn> = i
            .conns
            .expired(s.clock.now(), SWEEP_BUDGET)
            .into_iter()
            .filter_map(|id| i.conns.remove(id))
            .collect();
        if i.conns.pending() > 0 {
            let again = if expired.len() == SWEEP_BUDGET {
                SWEEP_AGAIN
            } else {
                SWEEP_EVERY
            };
            arm_sweep(s, &mut i, again);
        }
        drop(i);
        for c in expired {
            s.count(&s.counters.cm_req_expired);
            tracing::debug!(conn = c.local_id, peer = %c.peer, "rxe CM: request expired unanswered");
            send_rej(
                s,
                (c.local, c.peer),
                (c.local_id, c.remote_id()),
                cm::msg_ref::REQ,
                rej_reason::CONSUMER_DEFINED,
                &[],
            );
        }
    }
}

/// Arm the expiry sweep `after` from now (one sweep entry in the timer heap at a time).
fn arm_sweep(s: &Shared, i: &mut super::Inner, after: Duration) {
    i.sweep_gen += 1;
    i.sweep = Some(i.sweep_gen);
    s.timers
        .arm(Target::CmSweep, i.sweep_gen, s.clock.now() + after);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ttl_follows_the_senders_patience_within_bounds() {
        let zeros = [0u8; crate::wire::mad::MAD_LEN - 24];
        let Ok(CmMessage::Req(mut r)) = CmMessage::parse(cm::ATTR_REQ, &zeros) else {
            panic!("an all-zero REQ parses");
        };
        assert_eq!(request_ttl(&r), REQUEST_TTL_MIN);
        // rdma_cm: 4.096 µs × 2^20 ≈ 4.3 s, 15 retries: 69 s, more than we keep it.
        (r.remote_cm_response_timeout, r.max_cm_retries) = (20, 15);
        assert_eq!(request_ttl(&r), REQUEST_TTL_MAX);
        (r.remote_cm_response_timeout, r.max_cm_retries) = (20, 1);
        assert_eq!(request_ttl(&r).as_millis(), 8589);
        (r.remote_cm_response_timeout, r.max_cm_retries) = (31, 15);
        assert_eq!(request_ttl(&r), REQUEST_TTL_MAX);
    }
}
