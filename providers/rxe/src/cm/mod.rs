//! Connection management: the IB Communication Manager over QP1 (GSI) MADs with the
//! rdma_cm conventions, so rdma_cm peers (rping, perftest `-R`) connect to krdma and
//! back.
//!
//! Active side ([`active`]): REQ (rdma_cm header + up to 56 bytes of private data, service
//! ID of the TCP port space) → REP → the QP goes to RTR and RTS → RTU, `Established`.
//! Passive side ([`passive`]): a REQ for a listened port becomes a `ConnectRequest` of
//! that listener; accept moves the QP to RTS and sends REP (private data up to 196
//! bytes); RTU gives `Established`; reject sends REJ (reason 28, consumer-defined).
//! UD resolution ([`sidr`]): SIDR_REQ → SIDR_REP with the serving QP's number and
//! Q_Key, for rdma_cm's UDP port space.
//! Disconnect ([`close`]): DREQ/DREP; either side's QP goes to Error and reports
//! `Disconnected`. MADs are datagrams: REQ, REP and DREQ are retried until answered;
//! duplicates are answered again (REP → RTU again; DREQ → DREP even when the connection
//! is already gone).
//!
//! The protocol is a [`Machine`] without I/O, locks or clocks: each message, timer or
//! local request goes in with the time, and what to do comes out as [`Action`]s — MADs
//! to send, timers to arm, QPs to bring up or fail, events to deliver, counters to count.
//! Its randomness is handed to it ([`Entropy`]). The [`driver`] holds the machine under a
//! mutex, feeds it and performs its actions once the mutex is released; the tests
//! (`tests`) play machines against each other with no socket, thread or device.
//!
//! Nothing here trusts the network: communication IDs, PSNs and transaction IDs are
//! random (`crate::random`); every message after the REQ must come from the connection's
//! peer address and name the IDs both sides agreed on, or it is dropped and counted
//! (`cm_unmatched`); connection requests are bounded per listener (its backlog) and per
//! device, expire when their consumer does not answer, and may fill only part of the
//! consumer's event queue ([`table`] holds the bookkeeping).

mod active;
mod close;
mod driver;
mod passive;
mod sidr;
mod table;
#[cfg(test)]
mod tests;

pub use driver::{connect, disconnect, listen, Cm};

use crate::random::Entropy;
use crate::timer::Target;
use crate::wire::cm::{self, CmMad, CmMessage};
use crate::wire::mad::MAD_LEN;
use rnicpi::*;
use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use table::{Conn, Conns};

pub(crate) use active::Connect;

/// Time between retries of an unanswered REQ, REP or DREQ.
const MAD_RETRY: Duration = Duration::from_millis(500);
/// Retries before giving up (then `Unreachable`, or the disconnect completes anyway).
const MAD_RETRIES: u32 = 15;
/// Consumer private data a REQ can carry after the rdma_cm header.
pub const REQ_PDATA_MAX: usize = cm::REQ_PRIVATE_DATA_LEN - crate::wire::cma::HEADER_LEN;

/// One CM MAD, as sent.
type Mad = [u8; MAD_LEN];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Active: REQ sent, waiting for REP.
    ReqSent,
    /// Passive: REQ delivered to the consumer, waiting for accept/reject.
    ReqRcvd,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    Established,
    /// Orderly disconnect: waiting for the send queue to drain before the DREQ.
    Draining,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// Active UD resolution: SIDR_REQ sent, waiting for the SIDR_REP.
    SidrSent,
    /// Passive UD resolution answered: the SIDR_REP is kept to answer a retry of the
    /// SIDR_REQ the same way, until the requester has stopped retrying.
    SidrAnswered,
}

/// A QP as the connection manager knows it: its number, and the serial the device gave
/// the QP object, so a later QP that gets the same number is never taken for it; and its
/// service (a REQ names RC or UC, and an accept must match it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpRef {
    pub qpn: u32,
    pub serial: u64,
    pub service: QpType,
}

impl QpRef {
    /// The REQ's transport service type of a connected QP's service.
    pub fn transport_type(&self) -> u8 {
        match self.service {
            QpType::Uc => crate::wire::cm::transport_type::UC,
            _ => crate::wire::cm::transport_type::RC,
        }
    }
}

/// What a connection fixes for its QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    pub peer: IpAddr,
    pub local: IpAddr,
    pub remote_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub mtu: u32,
    /// Our responder resources (the peer's RDMA Reads and atomics we serve at once).
    pub ird: u32,
    pub ord: u32,
}

/// Bring connection `id`'s QP up (Init → RTR → RTS) over `link`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BringUp {
    pub id: u32,
    /// The peer's communication ID (for the REJ should the QP not come up).
    pub remote_id: u32,
    pub qp: QpRef,
    pub link: Link,
}

/// The device counters the connection manager counts in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Count {
    /// `cm_retries`: an unanswered MAD sent again.
    Retry,
    /// `cm_unmatched`: a message of no connection of its sender.
    Unmatched,
    /// `cm_req_evicted`: a waiting request pushed out by a newer one.
    ReqEvicted,
    /// `cm_req_expired`: a request its consumer did not answer in time.
    ReqExpired,
    /// `cm_req_refused`: a request refused for want of resources.
    ReqRefused,
}

/// A listener's event sink, carried in an [`Action::Offer`].
#[derive(Clone)]
pub(crate) struct Sink(pub Arc<dyn EventSink>);

impl fmt::Debug for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sink")
    }
}

/// What the machine asks its driver to do, in order.
#[derive(Debug)]
pub(crate) enum Action {
    /// Send a MAD from our QP1 at `src` to the peer's at `dst`.
    Send {
        src: IpAddr,
        dst: IpAddr,
        mad: Box<Mad>,
    },
    /// Fire `target` with `gen` at `at` (an entry of an older generation is ignored).
    Timer {
        target: Target,
        gen: u64,
        at: Instant,
    },
    /// Bring a QP up. If it does not come up, the actions after this one are dropped and
    /// [`Machine::bring_up_failed`] says what to do instead.
    BringUp(BringUp),
    /// Move a QP to Error (flushing what it holds).
    QpError(QpRef),
    /// A connection attempt failed: move the QP to Error and give its consumer `event`.
    Fail {
        qp: QpRef,
        event: Event,
    },
    /// The QP's connection ended: move it to Error and tell its consumer once.
    Closed {
        qp: QpRef,
        kind: EventKind,
    },
    /// Give a QP's consumer `event`.
    Deliver {
        qp: QpRef,
        event: Event,
    },
    /// Offer connection request `id` to a listener's consumer. If it has no room,
    /// [`Machine::offer_refused`] says what to do.
    Offer {
        sink: Sink,
        id: u32,
        event: Event,
    },
    Count(Count),
}

/// What the device tells its connection manager once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    pub node_guid: u64,
    pub max_ird: u32,
    pub max_ord: u32,
}

struct ListenEntry {
    addr: Option<IpAddr>,
    sink: Arc<dyn EventSink>,
    id: u64,
    /// Requests this listener may have waiting for its consumer.
    backlog: usize,
}

/// The connection manager of one device (its QP1) without I/O: connections and
/// listeners, driven by [`Machine::on_mad`], [`Machine::on_timer`], [`Machine::on_sweep`]
/// and the local requests, each of which returns the [`Action`]s that follow.
pub(crate) struct Machine {
    config: Config,
    rng: Box<dyn Entropy>,
    conns: Conns,
    listeners: HashMap<u16, Vec<ListenEntry>>,
    /// Generation of the armed expiry sweep of waiting requests, if one is armed.
    sweep: Option<u64>,
    sweep_gen: u64,
    next_listener: u64,
}

impl Machine {
    pub fn new(config: Config, rng: Box<dyn Entropy>) -> Machine {
        Machine {
            config,
            rng,
            conns: Conns::default(),
            listeners: HashMap::new(),
            sweep: None,
            sweep_gen: 0,
            next_listener: 1,
        }
    }

    /// Connections (in any phase) the device holds, and requests waiting for a consumer.
    pub fn sizes(&self) -> (usize, usize) {
        (self.conns.len(), self.conns.pending())
    }

    /// A communication ID no connection uses (never 0, which means "unknown" in a REJ).
    fn new_id(&mut self) -> Result<u32> {
        loop {
            let id = self.rng.u32()?;
            if id != 0 && !self.conns.contains(id) {
                return Ok(id);
            }
        }
    }

    /// A request's private data as rdma_cm lays it out: its header (a random source port,
    /// our `src`, the peer's `dst`), then the consumer's bytes (which the caller checked
    /// fit).
    fn cma_private_data<const N: usize>(
        &mut self,
        (src, dst): (IpAddr, IpAddr),
        consumer: &[u8],
    ) -> Result<[u8; N]> {
        let src_port = 0xc000 | (self.rng.u32()? as u16 & 0x3fff);
        let mut pdata = [0u8; N];
        let hdr = crate::wire::cma::CmaHdr { src_port, src, dst };
        hdr.emit(&mut pdata).map_err(|_| VerbsError::Invalid)?;
        let end = crate::wire::cma::HEADER_LEN + consumer.len();
        pdata
            .get_mut(crate::wire::cma::HEADER_LEN..end)
            .ok_or(VerbsError::Invalid)?
            .copy_from_slice(consumer);
        Ok(pdata)
    }

    /// A MAD with a fresh random transaction ID.
    fn mad(&mut self, msg: CmMessage) -> Result<Box<Mad>> {
        Ok(Box::new(CmMad::new(self.rng.u64()?, msg).to_bytes()))
    }

    /// The REJ of a connection (`local_id` ours, `remote_id` the peer's).
    fn rej(
        &mut self,
        (local_id, remote_id): (u32, u32),
        which: u8,
        reason: u16,
        pdata: &[u8],
    ) -> Result<Box<Mad>> {
        self.mad(CmMessage::Rej(cm::Rej {
            local_comm_id: local_id,
            remote_comm_id: remote_id,
            message_rejected: which,
            rejected_info_length: 0,
            reason,
            ari: [0; cm::REJ_ARI_LEN],
            private_data: pad(pdata),
        }))
    }

    /// Send a REJ from `src` to `dst`, unless no transaction ID could be drawn (then the
    /// peer times out).
    fn send_rej(
        &mut self,
        out: &mut Vec<Action>,
        (src, dst): (IpAddr, IpAddr),
        ids: (u32, u32),
        which: u8,
        reason: u16,
    ) {
        if let Ok(mad) = self.rej(ids, which, reason, &[]) {
            out.push(Action::Send { src, dst, mad });
        }
    }

    /// A CM MAD from `src` to our address `dst`.
    pub fn on_mad(&mut self, src: IpAddr, dst: IpAddr, mad: CmMad, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        let tid = mad.transaction_id;
        let matched = match mad.message {
            CmMessage::Req(req) => {
                self.on_req(&mut out, src, dst, req, now);
                true
            }
            CmMessage::Rep(rep) => self.on_rep(&mut out, src, tid, rep),
            CmMessage::Rtu(rtu) => self.on_rtu(&mut out, src, rtu),
            CmMessage::Rej(rej) => self.on_rej(&mut out, src, rej),
            CmMessage::Dreq(dreq) => self.on_dreq(&mut out, src, dst, tid, dreq),
            CmMessage::Drep(drep) => self.on_drep(&mut out, src, drep),
            CmMessage::Mra(mra) => self.on_mra(src, mra),
            CmMessage::SidrReq(req) => {
                self.on_sidr_req(&mut out, (src, dst), tid, req, now);
                true
            }
            CmMessage::SidrRep(rep) => self.on_sidr_rep(&mut out, src, rep),
        };
        if !matched {
            tracing::debug!(%src, "rxe CM: message of no connection of that peer");
            out.push(Action::Count(Count::Unmatched));
        }
        out
    }

    /// The peer needs more time: keep our retries going. True when it named one of its
    /// connections.
    fn on_mra(&mut self, src: IpAddr, mra: cm::Mra) -> bool {
        match self.conns.get_mut(mra.remote_comm_id) {
            Some(c) if c.is_from(src, mra.local_comm_id) && c.retry.is_some() => {
                c.retries_left = MAD_RETRIES;
                true
            }
            _ => false,
        }
    }

    /// A REJ: of our REQ or REP (the attempt fails), or the active side giving up on a
    /// request that waits for our consumer. True when it named a connection of its sender.
    fn on_rej(&mut self, out: &mut Vec<Action>, src: IpAddr, rej: cm::Rej) -> bool {
        // The connection this peer knows by the REJ's sender ID; or, for our REQ before
        // the peer told us its ID, ours by the REJ's remote ID.
        let known = self
            .conns
            .by_remote(src, rej.local_comm_id)
            .filter(|&id| rej.remote_comm_id == 0 || rej.remote_comm_id == id);
        let id = known.or_else(|| {
            self.conns
                .get(rej.remote_comm_id)
                .filter(|c| c.phase == Phase::ReqSent && c.is_from(src, rej.local_comm_id))
                .map(|c| c.local_id)
        });
        let Some(id) = id else { return false };
        match self.conns.get(id).map(|c| c.phase) {
            Some(Phase::ReqSent | Phase::RepSent) => {}
            Some(Phase::ReqRcvd) => {
                self.conns.remove(id);
                tracing::info!(conn = id, reason = rej.reason, "rxe CM: request withdrawn");
                return true;
            }
            _ => return true,
        }
        let Some(qp) = self.conns.remove(id).and_then(|c| c.qp()) else {
            return true;
        };
        tracing::info!(qpn = qp.qpn, reason = rej.reason, "rxe CM: rejected");
        let kind = if rej.reason == cm::rej_reason::CONSUMER_DEFINED {
            EventKind::Rejected
        } else {
            EventKind::Unreachable
        };
        let event = Event::new(kind)
            .with_status(libc::ECONNREFUSED)
            .with_param(&ConnParam {
                private_data: rej.private_data.to_vec(),
                ird: 0,
                ord: 0,
            });
        out.push(Action::Fail { qp, event });
        true
    }

    /// The QP of connection `id` if the connection drains its send queue before closing
    /// (the driver then tells [`Machine::on_timer`] whether the queue is still busy).
    pub fn draining_qp(&self, id: u32) -> Option<QpRef> {
        self.conns
            .get(id)
            .filter(|c| c.phase == Phase::Draining)
            .and_then(Conn::qp)
    }

    /// Connection `id`'s timer of generation `gen` fired; `send_busy`: whether its QP
    /// still has send work (what an orderly close waits for, see
    /// [`Machine::draining_qp`]).
    pub fn on_timer(&mut self, id: u32, gen: u64, send_busy: bool, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        let Some(c) = self.conns.get_mut(id) else {
            return out;
        };
        if c.gen != gen {
            return out;
        }
        if c.phase == Phase::Draining {
            self.drain_tick(&mut out, id, send_busy, now);
            return out;
        }
        if c.phase == Phase::SidrAnswered {
            self.conns.remove(id);
            return out;
        }
        let Some(mad) = c.retry else { return out };
        if c.retries_left > 0 {
            c.retries_left -= 1;
            out.push(arm(c, MAD_RETRY, now));
            out.push(Action::Count(Count::Retry));
            out.push(Action::Send {
                src: c.local,
                dst: c.peer,
                mad: Box::new(mad),
            });
            return out;
        }
        let Some(c) = self.conns.remove(id) else {
            return out;
        };
        tracing::debug!(conn = id, phase = ?c.phase, "rxe CM: no answer, giving up");
        match (c.phase, c.qp()) {
            (Phase::ReqSent, qp) => self.gave_up(&mut out, &c, qp),
            (Phase::SidrSent, _) => self.resolve_gave_up(&mut out, &c),
            (Phase::DreqSent, Some(qp)) => out.push(Action::Closed {
                qp,
                kind: EventKind::Disconnected,
            }),
            (Phase::RepSent, Some(qp)) => out.push(Action::Closed {
                qp,
                kind: EventKind::ConnectionBroken,
            }),
            _ => {}
        }
        out
    }
}

/// Arm connection `c`'s timer `after` from `now`, in a new generation (the entry armed
/// before, if any, is ignored when it fires).
fn arm(c: &mut Conn, after: Duration, now: Instant) -> Action {
    c.gen += 1;
    Action::Timer {
        target: Target::Cm(c.local_id),
        gen: c.gen,
        at: now + after,
    }
}

fn pad<const N: usize>(data: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    let n = data.len().min(N);
    a[..n].copy_from_slice(&data[..n]);
    a
}

/// The IB MTU code (1 = 256 … 5 = 4096) of a byte count.
fn mtu_code(bytes: u32) -> u8 {
    match bytes {
        4096.. => 5,
        2048.. => 4,
        1024.. => 3,
        512.. => 2,
        _ => 1,
    }
}

/// The address of a connection event: `ip` and `port`.
fn sockaddr(ip: IpAddr, port: u16) -> Option<SocketAddr> {
    Some(SocketAddr::new(ip, port))
}
