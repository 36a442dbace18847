//! Connection management: the IB Communication Manager over QP1 (GSI) MADs with the
//! rdma_cm conventions, so rdma_cm peers (rping, perftest `-R`) connect to krdma and
//! back.
//!
//! Active side ([`active`]): REQ (rdma_cm header + up to 56 bytes of private data, service
//! ID of the TCP port space) → REP → the QP goes to RTR and RTS → RTU, `Established`.
//! Passive side ([`passive`]): a REQ for a listened port becomes a `ConnectRequest` of
//! that listener; accept moves the QP to RTS and sends REP (private data up to 196
//! bytes); RTU gives `Established`; reject sends REJ (reason 28, consumer-defined).
//! Disconnect ([`close`]): DREQ/DREP; either side's QP goes to Error and reports
//! `Disconnected`. MADs are datagrams: REQ, REP and DREQ are retried until answered;
//! duplicates are answered again (REP → RTU again; DREQ → DREP even when the connection
//! is already gone).
//!
//! Nothing here trusts the network: communication IDs, PSNs and transaction IDs are
//! random (`crate::random`); every message after the REQ must come from the connection's
//! peer address and name the IDs both sides agreed on, or it is dropped and counted
//! (`cm_unmatched`); connection requests are bounded per listener (its backlog) and per
//! device, expire when their consumer does not answer, and may fill only part of the
//! consumer's event queue ([`table`] holds the bookkeeping).

mod active;
mod close;
mod passive;
mod table;

pub use active::connect;
pub use close::disconnect;
pub use passive::listen;

use crate::device::Shared;
use crate::net::Datagram;
use crate::qp::RxeQp;
use crate::timer::Target;
use crate::wire::cm::{self, rej_reason, CmMad, CmMessage};
use crate::wire::mad::MAD_LEN;
use crate::wire::{icrc, RoceRepr};
use parking_lot::Mutex;
use rnicpi::*;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use table::Conns;

/// Time between retries of an unanswered REQ, REP or DREQ.
const MAD_RETRY: Duration = Duration::from_millis(500);
/// Retries before giving up (then `Unreachable`, or the disconnect completes anyway).
const MAD_RETRIES: u32 = 15;
/// Consumer private data a REQ can carry after the rdma_cm header.
pub const REQ_PDATA_MAX: usize = cm::REQ_PRIVATE_DATA_LEN - crate::wire::cma::HEADER_LEN;
/// Q_Key of the GSI.
const GSI_QKEY: u32 = crate::wire::deth::GSI_QKEY;

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
}

struct ListenEntry {
    addr: Option<IpAddr>,
    sink: Arc<dyn EventSink>,
    id: u64,
    /// Requests this listener may have waiting for its consumer.
    backlog: usize,
}

#[derive(Default)]
struct Inner {
    conns: Conns,
    listeners: HashMap<u16, Vec<ListenEntry>>,
    /// Generation of the armed expiry sweep of waiting requests, if one is armed.
    sweep: Option<u64>,
    sweep_gen: u64,
}

/// The device's connection manager (its QP1).
#[derive(Default)]
pub struct Cm {
    inner: Mutex<Inner>,
    next_listener: AtomicU64,
    gsi_psn: AtomicU32,
}

impl Cm {
    pub fn new() -> Cm {
        Cm {
            next_listener: AtomicU64::new(1),
            ..Cm::default()
        }
    }

    /// Connections (in any phase) the device holds, and requests waiting for a consumer.
    pub fn sizes(&self) -> (usize, usize) {
        let i = self.inner.lock();
        (i.conns.len(), i.conns.pending())
    }
}

impl Inner {
    /// A communication ID no connection uses (never 0, which means "unknown" in a REJ).
    fn new_id(&self) -> Result<u32> {
        loop {
            let id = crate::random::u32()?;
            if id != 0 && !self.conns.contains(id) {
                return Ok(id);
            }
        }
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

/// Send one MAD from our QP1 to `peer`'s.
fn send_mad(s: &Shared, src: IpAddr, peer: IpAddr, mad: &[u8; MAD_LEN]) {
    let psn = s.cm.gsi_psn.fetch_add(1, Ordering::Relaxed) & crate::wire::PSN_MASK;
    let repr: RoceRepr<'_> = cm::gsi_packet(mad, crate::wire::bth::DEFAULT_PKEY, psn);
    s.send_repr(src, peer, icrc::rxe_qp_udp_sport(1), &repr);
    s.count(&s.counters.cm_sent);
}

/// A MAD with a fresh random transaction ID.
fn mad_bytes(msg: CmMessage) -> Result<[u8; MAD_LEN]> {
    Ok(CmMad::new(crate::random::u64()?, msg).to_bytes())
}

/// The REJ of a connection (`local_id` ours, `remote_id` the peer's).
fn rej_mad(
    local_id: u32,
    remote_id: u32,
    which: u8,
    reason: u16,
    pdata: &[u8],
) -> Result<[u8; MAD_LEN]> {
    mad_bytes(CmMessage::Rej(cm::Rej {
        local_comm_id: local_id,
        remote_comm_id: remote_id,
        message_rejected: which,
        rejected_info_length: 0,
        reason,
        ari: [0; cm::REJ_ARI_LEN],
        private_data: pad(pdata),
    }))
}

/// Send a REJ, unless no transaction ID could be drawn (then the peer times out).
fn send_rej(
    s: &Shared,
    (src, dst): (IpAddr, IpAddr),
    (local_id, remote_id): (u32, u32),
    which: u8,
    reason: u16,
    pdata: &[u8],
) {
    if let Ok(rej) = rej_mad(local_id, remote_id, which, reason, pdata) {
        send_mad(s, src, dst, &rej);
    }
}

fn arm(s: &Shared, c: &mut table::Conn) {
    arm_after(s, c, MAD_RETRY);
}

fn arm_after(s: &Shared, c: &mut table::Conn, after: Duration) {
    c.gen += 1;
    s.timers
        .arm(Target::Cm(c.local_id), c.gen, s.clock.now() + after);
}

/// What a connection fixes for its QP.
struct Link {
    peer: IpAddr,
    local: IpAddr,
    remote_qpn: u32,
    rq_psn: u32,
    sq_psn: u32,
    mtu: u32,
    /// Our responder resources (the peer's RDMA Reads and atomics we serve at once).
    ird: u32,
    ord: u32,
}

/// The remote rights a connection gives a QP the consumer left in Reset: as the kernel's
/// IB CM does (`cm_init_qp_init_attr`), RDMA Write always, RDMA Read and atomics only when
/// the consumer offered responder resources. A QP the consumer moved to Init itself keeps
/// the rights it chose there.
fn default_access(ird: u32) -> Access {
    if ird > 0 {
        Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
    } else {
        Access::REMOTE_WRITE
    }
}

/// Move `qp` through Init → RTR → RTS for a connection.
fn bring_up(s: &Shared, qp: &RxeQp, l: &Link) -> Result<()> {
    if qp.state() == QpState::Reset {
        let init = QpAttr {
            state: QpState::Init,
            access: default_access(l.ird),
            ..QpAttr::default()
        };
        qp.cm_modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)?;
    }
    let sgid_index = s.addrs().iter().position(|a| *a == l.local).unwrap_or(0) as u8;
    let rtr = QpAttr {
        state: QpState::Rtr,
        path_mtu: l.mtu,
        dest_qpn: l.remote_qpn,
        rq_psn: l.rq_psn,
        max_dest_rd_atomic: l.ird.clamp(1, 255) as u8,
        min_rnr_timer: 12,
        dgid: ip_to_gid(l.peer),
        sgid_index,
        hop_limit: 64,
        ..QpAttr::default()
    };
    qp.cm_modify(&rtr, QpAttrMask::RC_RTR)?;
    let rts = QpAttr {
        state: QpState::Rts,
        sq_psn: l.sq_psn,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: l.ord.clamp(1, 255) as u8,
        ..QpAttr::default()
    };
    qp.cm_modify(&rts, QpAttrMask::RC_RTS)
}

impl Cm {
    /// A packet for QP1: a CM MAD from `d.src`.
    pub fn on_packet(&self, s: &Arc<Shared>, d: &Datagram<'_>, p: &RoceRepr<'_>) {
        if p.deth.map(|x| x.qkey) != Some(GSI_QKEY) {
            return s.count(&s.counters.rx_malformed);
        }
        let mad = match CmMad::parse(p.payload) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(src = %d.src, error = %e, "rxe CM: MAD dropped");
                return s.count(&s.counters.rx_malformed);
            }
        };
        s.count(&s.counters.cm_rcvd);
        let tid = mad.transaction_id;
        let matched = match mad.message {
            CmMessage::Req(req) => return self.on_req(s, d, req),
            CmMessage::Rep(rep) => self.on_rep(s, d, tid, rep),
            CmMessage::Rtu(rtu) => self.on_rtu(d, rtu),
            CmMessage::Rej(rej) => self.on_rej(d, rej),
            CmMessage::Dreq(dreq) => self.on_dreq(s, d, tid, dreq),
            CmMessage::Drep(drep) => self.on_drep(d, drep),
            CmMessage::Mra(mra) => self.on_mra(d, mra),
        };
        if !matched {
            tracing::debug!(src = %d.src, "rxe CM: message of no connection of that peer");
            s.count(&s.counters.cm_unmatched);
        }
    }

    /// The peer needs more time: keep our retries going. True when it named one of its
    /// connections.
    fn on_mra(&self, d: &Datagram<'_>, mra: cm::Mra) -> bool {
        let mut i = self.inner.lock();
        match i.conns.get_mut(mra.remote_comm_id) {
            Some(c) if c.is_from(d.src, mra.local_comm_id) && c.retry.is_some() => {
                c.retries_left = MAD_RETRIES;
                true
            }
            _ => false,
        }
    }

    /// A REJ: of our REQ or REP (the attempt fails), or the active side giving up on a
    /// request that waits for our consumer. True when it named a connection of its sender.
    fn on_rej(&self, d: &Datagram<'_>, rej: cm::Rej) -> bool {
        let mut i = self.inner.lock();
        // The connection this peer knows by the REJ's sender ID; or, for our REQ before
        // the peer told us its ID, ours by the REJ's remote ID.
        let known = i
            .conns
            .by_remote(d.src, rej.local_comm_id)
            .filter(|&id| rej.remote_comm_id == 0 || rej.remote_comm_id == id);
        let id = known.or_else(|| {
            i.conns
                .get(rej.remote_comm_id)
                .filter(|c| c.phase == Phase::ReqSent && c.is_from(d.src, rej.local_comm_id))
                .map(|c| c.local_id)
        });
        let Some(id) = id else { return false };
        let phase = i.conns.get(id).map(|c| c.phase);
        match phase {
            Some(Phase::ReqSent | Phase::RepSent) => {}
            Some(Phase::ReqRcvd) => {
                i.conns.remove(id);
                tracing::info!(conn = id, reason = rej.reason, "rxe CM: request withdrawn");
                return true;
            }
            _ => return true,
        }
        let Some(c) = i.conns.remove(id) else {
            return true;
        };
        drop(i);
        let Some(qp) = c.qp.upgrade() else {
            return true;
        };
        tracing::info!(qpn = qp.qpn, reason = rej.reason, "rxe CM: rejected");
        let kind = if rej.reason == rej_reason::CONSUMER_DEFINED {
            EventKind::Rejected
        } else {
            EventKind::Unreachable
        };
        {
            let mut st = qp.st.lock();
            qp.to_error(&mut st);
        }
        qp.sink.deliver(
            Event::new(kind)
                .with_status(libc::ECONNREFUSED)
                .with_param(&ConnParam {
                    private_data: rej.private_data.to_vec(),
                    ird: 0,
                    ord: 0,
                }),
        );
        true
    }

    /// A retry timer of connection `id` fired.
    pub fn on_timer(&self, s: &Arc<Shared>, id: u32, gen: u64) {
        let mut i = self.inner.lock();
        let Some(c) = i.conns.get_mut(id) else {
            return;
        };
        if c.gen != gen {
            return;
        }
        if c.phase == Phase::Draining {
            drop(i);
            return close::drain_tick(s, id);
        }
        let Some(mad) = c.retry else { return };
        if c.retries_left == 0 {
            let c = i.conns.remove(id);
            drop(i);
            let Some(c) = c else { return };
            let qp = c.qp.upgrade();
            match (c.phase, qp) {
                (Phase::ReqSent, qp) => active::gave_up(s, &c, qp),
                (Phase::DreqSent, Some(qp)) => qp.cm_closed(EventKind::Disconnected),
                (Phase::RepSent, Some(qp)) => qp.cm_closed(EventKind::ConnectionBroken),
                _ => {}
            }
            return;
        }
        c.retries_left -= 1;
        arm(s, c);
        let (src, dst) = (c.local, c.peer);
        drop(i);
        s.count(&s.counters.cm_retries);
        send_mad(s, src, dst, &mad);
    }
}
