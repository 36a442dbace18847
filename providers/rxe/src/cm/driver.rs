//! The connection manager's driver: the [`Machine`] under a mutex, fed from the receive
//! thread (MADs), the timer thread and the verbs (connect, disconnect, listen, accept,
//! reject), and the performer of what it answers — MADs onto the wire, timers into the
//! heap, QPs brought up or failed, events to consumers — once the mutex is released.
//!
//! Locks: the machine's mutex may be held while a QP's state lock is taken (an accept
//! brings its QP up under it, so no one else answers the request meanwhile; an orderly
//! close asks whether the send queue is busy), never the other way round.

use super::{Action, BringUp, Config, Connect, Count, Link, Machine, QpRef};
use crate::device::Shared;
use crate::net::{canonical, Datagram};
use crate::qp::RxeQp;
use crate::random::Entropy;
use crate::wire::cm::{self, CmMad};
use crate::wire::mad::MAD_LEN;
use crate::wire::{icrc, RoceRepr};
use parking_lot::Mutex;
use rnicpi::*;
use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

/// Q_Key of the GSI.
const GSI_QKEY: u32 = crate::wire::deth::GSI_QKEY;

/// The device's connection manager (its QP1).
pub struct Cm {
    machine: Mutex<Machine>,
    gsi_psn: AtomicU32,
}

impl Cm {
    pub(crate) fn new(config: Config, rng: Box<dyn Entropy>) -> Cm {
        Cm {
            machine: Mutex::new(Machine::new(config, rng)),
            gsi_psn: AtomicU32::new(0),
        }
    }

    /// Connections (in any phase) the device holds, and requests waiting for a consumer.
    pub fn sizes(&self) -> (usize, usize) {
        self.machine.lock().sizes()
    }

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
        let attr = mad.message.attribute_id();
        tracing::trace!(src = %d.src, sport = d.sport, attr, "rxe CM: MAD");
        let actions = self.machine.lock().on_mad(d.src, d.dst, mad, s.clock.now());
        perform(s, actions);
    }

    /// A retry (or drain) timer of connection `id` fired.
    pub fn on_timer(&self, s: &Arc<Shared>, id: u32, gen: u64) {
        let mut m = self.machine.lock();
        let busy = m
            .draining_qp(id)
            .and_then(|q| qp_of(s, q))
            .is_some_and(|qp| qp.send_busy());
        let actions = m.on_timer(id, gen, busy, s.clock.now());
        drop(m);
        perform(s, actions);
    }

    /// The expiry sweep of waiting requests fired.
    pub fn on_sweep(&self, s: &Arc<Shared>, gen: u64) {
        let actions = self.machine.lock().on_sweep(gen, s.clock.now());
        perform(s, actions);
    }
}

/// Active connect of `qp` to `peer` (its IP address and rdma_cm port): an RC QP's
/// connection (TCP port space), or a UD QP's resolution of the peer's UD service (UDP
/// port space, SIDR).
pub fn connect(s: &Arc<Shared>, qp: &Arc<RxeQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
    let peer = SocketAddr::new(canonical(peer.ip()), peer.port());
    let src = s.source_for(peer.ip());
    let request = Connect {
        qp: qp.cm_ref(),
        state: qp.state(),
        peer,
        mtu: src.as_ref().map_or(s.active_mtu(), |&ip| s.mtu_from(ip)),
        src,
        param,
    };
    let mut m = s.cm.machine.lock();
    let actions = if qp.is_ud() {
        m.resolve(request, s.clock.now())?
    } else {
        m.connect(request, s.clock.now())?
    };
    drop(m);
    perform(s, actions);
    Ok(())
}

/// Close `qp`'s connection.
pub fn disconnect(s: &Arc<Shared>, qp: &Arc<RxeQp>, abortive: bool) -> Result<()> {
    let busy = !abortive && qp.send_busy();
    let now = s.clock.now();
    let actions =
        s.cm.machine
            .lock()
            .disconnect(qp.cm_ref(), abortive, busy, now)?;
    perform(s, actions);
    Ok(())
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
    let (id, port) = s.cm.machine.lock().listen(ip, addr.port(), backlog, sink)?;
    Ok(Arc::new(RxeListener {
        shared: Arc::downgrade(s),
        addr: SocketAddr::new(ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), port),
        id,
    }))
}

/// A passive endpoint on an rdma_cm port.
pub struct RxeListener {
    shared: Weak<Shared>,
    addr: SocketAddr,
    id: u64,
}

impl ProviderListener for RxeListener {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, conn_id: u64, qp: &Arc<dyn ProviderQp>, param: ConnParam) -> Result<()> {
        let s = self.shared.upgrade().ok_or(VerbsError::BadState)?;
        // A QP of this very device (the connection manager finds its QPs in its table).
        let rqp = RxeQp::of(qp, &s)?;
        if rqp.is_ud() {
            // A SIDR request: the reply names the QP and its Q_Key; the QP stays as it is.
            let us = (rqp.cm_ref(), rqp.query().qkey);
            let actions = s.cm.machine.lock().accept_ud(
                self.id,
                conn_id,
                us,
                &param.private_data,
                s.clock.now(),
            )?;
            perform(&s, actions);
            return Ok(());
        }
        let mut m = s.cm.machine.lock();
        let accept = m.accept(self.id, conn_id, rqp.cm_ref(), &param, |ip| s.mtu_from(ip))?;
        bring_up(&s, &rqp, &accept.link)?;
        let actions = m.accepted(accept, s.clock.now())?;
        drop(m);
        perform(&s, actions);
        Ok(())
    }

    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        let s = self.shared.upgrade().ok_or(VerbsError::BadState)?;
        let actions = s.cm.machine.lock().reject(self.id, conn_id, private_data)?;
        perform(&s, actions);
        Ok(())
    }

    fn close(&self) {
        let Some(s) = self.shared.upgrade() else {
            return;
        };
        let actions = s.cm.machine.lock().close_listener(self.id);
        perform(&s, actions);
    }
}

/// Do what the machine said, in order.
fn perform(s: &Arc<Shared>, actions: Vec<Action>) {
    let mut queue = VecDeque::from(actions);
    while let Some(action) = queue.pop_front() {
        match action {
            Action::Send { src, dst, mad } => send_mad(s, src, dst, &mad),
            Action::Timer { target, gen, at } => s.timers.arm(target, gen, at),
            Action::BringUp(b) => {
                if let Err(e) = bring_up_ref(s, &b) {
                    tracing::debug!(qpn = b.qp.qpn, error = %e, "rxe CM: QP not brought up");
                    queue = s.cm.machine.lock().bring_up_failed(&b).into();
                }
            }
            Action::QpError(q) => {
                if let Some(qp) = qp_of(s, q) {
                    qp.cm_failed(None);
                }
            }
            Action::Fail { qp, event } => {
                if let Some(qp) = qp_of(s, qp) {
                    qp.cm_failed(Some(event));
                }
            }
            Action::Closed { qp, kind } => {
                if let Some(qp) = qp_of(s, qp) {
                    qp.cm_closed(kind);
                }
            }
            Action::Deliver { qp, event } => {
                if let Some(qp) = qp_of(s, qp) {
                    qp.base.sink.deliver(event);
                }
            }
            Action::Offer { sink, id, event } => {
                if !sink.0.offer_request(event) {
                    // The consumer's queue has no room for more requests.
                    queue.extend(s.cm.machine.lock().offer_refused(id));
                }
            }
            Action::Count(c) => {
                let n = &s.counters;
                s.count(match c {
                    Count::Retry => &n.cm_retries,
                    Count::Unmatched => &n.cm_unmatched,
                    Count::ReqEvicted => &n.cm_req_evicted,
                    Count::ReqExpired => &n.cm_req_expired,
                    Count::ReqRefused => &n.cm_req_refused,
                })
            }
        }
    }
}

/// The QP the machine means by `r`, if it still exists.
fn qp_of(s: &Shared, r: QpRef) -> Option<Arc<RxeQp>> {
    s.qp(r.qpn).filter(|qp| qp.cm_ref() == r)
}

fn bring_up_ref(s: &Shared, b: &BringUp) -> Result<()> {
    let qp = qp_of(s, b.qp).ok_or(VerbsError::BadState)?;
    bring_up(s, &qp, &b.link)
}

/// Send one MAD from our QP1 to `peer`'s.
fn send_mad(s: &Shared, src: IpAddr, peer: IpAddr, mad: &[u8; MAD_LEN]) {
    let psn = s.cm.gsi_psn.fetch_add(1, Ordering::Relaxed) & crate::wire::PSN_MASK;
    let repr: RoceRepr<'_> = cm::gsi_packet(mad, crate::wire::bth::DEFAULT_PKEY, psn);
    s.send_repr(src, peer, icrc::rxe_qp_udp_sport(1), &repr);
    s.count(&s.counters.cm_sent);
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
