//! Connection management through librdmacm, for QPs created with `ibv_create_qp` (not
//! `rdma_create_qp`): the rdma_cm id carries the QP number, and this module moves the QP
//! through its states with `rdma_init_qp_attr`, as librdmacm itself does for QPs it owns.
//!
//! * Active: `rdma_create_id` (RDMA_PS_TCP) → `rdma_resolve_addr` → ADDR_RESOLVED →
//!   `rdma_resolve_route` → ROUTE_RESOLVED → QP to INIT, `rdma_connect` (qp_num, IRD/ORD,
//!   private data) → IB: CONNECT_RESPONSE → QP to RTR and RTS, `rdma_establish` (the RTU);
//!   iWARP: ESTABLISHED (the kernel's iWARP CM moved the QP to RTS itself, on the MPA
//!   reply).
//! * Passive: `rdma_bind_addr` + `rdma_listen`; CONNECT_REQUEST carries a new id, kept
//!   under a `conn_id` until the consumer answers; accept = QP to INIT, RTR, RTS (with
//!   `rdma_init_qp_attr`, as librdmacm's `rdma_accept` does on both transports: on iWARP
//!   the RTR/RTS masks it returns are harmless, the kernel finishes the job) and
//!   `rdma_accept`; ESTABLISHED follows.
//! * Close: as librdmacm's `rdma_disconnect` on its own QPs: IB moves the QP to Error, iWARP
//!   to SQD (graceful: the kernel drains, then closes the stream); abortive moves it to
//!   Error on both. DISCONNECTED moves it to Error (flushing) and answers the peer.
//!
//! Over 600 lines: one connection life cycle, active and passive, kept together; the
//! last lines are tests.

use crate::sys::{CmEvent, CmId, CmParam};
use crate::user::{QpInner, Shared};
use rdma_mummy_sys as ffi;
use rnicpi::user::UserListener;
use rnicpi::{
    ConnParam, Event, EventKind, EventSink, PrivateDataLimits, QpState, Result, VerbsError,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// IB CM through rdma_cm (RDMA_PS_TCP): REQ private data is 92 bytes of which rdma_cm's
/// header takes 36; REP 196; REJ 148 (IBTA 12.6; kernel `cma_connect_ib`).
pub const IB_PRIVATE_DATA: PrivateDataLimits = PrivateDataLimits {
    connect: 56,
    accept: 196,
    reject: 148,
};

/// iWARP through rdma_cm: MPA allows 512 bytes (RFC 5044), the kernel's iWARP CM 256
/// (`MPA_MAX_PRIVDATA` = `RDMA_MAX_PRIVATE_DATA`), and librdmacm's `rdma_conn_param`
/// carries the length in a `u8`: 255 each way.
pub const IWARP_PRIVATE_DATA: PrivateDataLimits = PrivateDataLimits {
    connect: 255,
    accept: 255,
    reject: 255,
};

/// How long address and route resolution may take.
const RESOLVE_MS: i32 = 2000;
/// IB CM reject reason "consumer defined" (IBTA table 112): the peer's consumer said no.
const IB_REJ_CONSUMER_DEFINED: i32 = 28;

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Resolving,
    Connecting,
    Established,
    Closed,
}

struct Conn {
    id: CmId,
    qp: Weak<QpInner>,
    sink: Arc<dyn EventSink>,
    active: bool,
    param: ConnParam,
    phase: Phase,
    local_close: bool,
    abortive: bool,
}

struct Listening {
    id: CmId,
    sink: Arc<dyn EventSink>,
    pending: HashMap<u64, CmId>,
}

/// The device's connections and listeners, keyed by their rdma_cm id.
#[derive(Default)]
pub(crate) struct CmState {
    conns: HashMap<usize, Conn>,
    listeners: HashMap<usize, Listening>,
}

fn limits(s: &Shared) -> PrivateDataLimits {
    if s.iwarp {
        IWARP_PRIVATE_DATA
    } else {
        IB_PRIVATE_DATA
    }
}

fn clamp_u8(v: u32, max: u32) -> u8 {
    v.min(max).min(u8::MAX as u32) as u8
}

/// Move `qp` to `state` with the attributes rdma_cm gives for `id` (plus the consumer's
/// access rights, and our IRD/ORD where the mask has them).
fn cm_modify(
    s: &Shared,
    qp: &QpInner,
    id: &CmId,
    state: QpState,
    ird: Option<u8>,
    ord: Option<u8>,
) -> Result<()> {
    use ffi::ibv_qp_attr_mask as m;
    let (mut a, mut mask) = id.init_qp_attr(crate::conv::state_to_ibv(state))?;
    if mask & m::IBV_QP_ACCESS_FLAGS.0 != 0 {
        a.qp_access_flags |= qp.access.load(Ordering::Relaxed);
    }
    if state == QpState::Rtr && s.ib_link {
        // librdmacm's workaround for an rdma_ucm bug: bits 21-24 are RoCE-only.
        mask &= !0x00e0_0000;
    }
    if let (Some(ird), true) = (ird, mask & m::IBV_QP_MAX_DEST_RD_ATOMIC.0 != 0) {
        a.max_dest_rd_atomic = ird;
    }
    if let (Some(ord), true) = (ord, mask & m::IBV_QP_MAX_QP_RD_ATOMIC.0 != 0) {
        a.max_rd_atomic = ord;
    }
    if mask & m::IBV_QP_STATE.0 != 0 {
        qp.qp.modify(&mut a, mask)?;
        qp.note_state(state);
    } else if mask != 0 {
        qp.qp.modify(&mut a, mask)?;
    }
    Ok(())
}

/// Active connection setup of `qp` with `peer`.
pub(crate) fn connect(
    s: &Arc<Shared>,
    qp: Arc<QpInner>,
    peer: SocketAddr,
    param: ConnParam,
) -> Result<()> {
    let chan = s.cm_chan.as_ref().ok_or(VerbsError::Unsupported)?;
    if param.private_data.len() > limits(s).connect as usize {
        return Err(VerbsError::Invalid);
    }
    match qp.state()? {
        QpState::Reset | QpState::Init => {}
        _ => return Err(VerbsError::BadState),
    }
    let mut st = s.cm.lock();
    let mut key_slot = qp.cm_key.lock();
    if key_slot.is_some() {
        return Err(VerbsError::BadState);
    }
    let id = CmId::new(chan)?;
    let key = id.key();
    id.resolve_addr(peer, RESOLVE_MS)?;
    *key_slot = Some(key);
    st.conns.insert(
        key,
        Conn {
            id,
            qp: qp.weak(),
            sink: qp.sink.clone(),
            active: true,
            param,
            phase: Phase::Resolving,
            local_close: false,
            abortive: false,
        },
    );
    tracing::debug!(qpn = qp.qpn, %peer, "ibverbs CM: connecting");
    Ok(())
}

/// Listen on `addr`.
pub(crate) fn listen(
    s: &Arc<Shared>,
    addr: SocketAddr,
    backlog: u32,
    sink: Arc<dyn EventSink>,
) -> Result<Arc<dyn UserListener>> {
    let chan = s.cm_chan.as_ref().ok_or(VerbsError::Unsupported)?;
    let id = CmId::new(chan)?;
    id.bind_addr(addr)?;
    if let Some(dev) = id.device_name() {
        // A specific address belongs to one device: it must be this one.
        if dev != s.name() {
            return Err(VerbsError::Unreachable);
        }
    }
    id.listen(backlog.clamp(1, i32::MAX as u32) as i32)?;
    let local = id.local_addr().unwrap_or(addr);
    let key = id.key();
    s.cm.lock().listeners.insert(
        key,
        Listening {
            id,
            sink,
            pending: HashMap::new(),
        },
    );
    tracing::debug!(%local, "ibverbs CM: listening");
    Ok(Arc::new(IbvListener {
        dev: s.clone(),
        key,
        local,
    }))
}

/// A listening rdma_cm id.
pub struct IbvListener {
    dev: Arc<Shared>,
    key: usize,
    local: SocketAddr,
}

impl UserListener for IbvListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(
        &self,
        conn_id: u64,
        qp: &Arc<dyn rnicpi::user::UserQp>,
        param: ConnParam,
    ) -> Result<()> {
        let s = &self.dev;
        let q = crate::user::own_qp(qp)?;
        if param.private_data.len() > limits(s).accept as usize {
            return Err(VerbsError::Invalid);
        }
        let mut st = s.cm.lock();
        let l = st
            .listeners
            .get_mut(&self.key)
            .ok_or(VerbsError::NoSuchResource)?;
        if q.cm_key.lock().is_some() {
            return Err(VerbsError::BadState);
        }
        let child = l
            .pending
            .remove(&conn_id)
            .ok_or(VerbsError::NoSuchResource)?;
        let ird = clamp_u8(param.ird, s.max_ird);
        let ord = clamp_u8(param.ord, s.max_ord);
        let up = cm_modify(s, &q, &child, QpState::Init, None, None)
            .and_then(|_| cm_modify(s, &q, &child, QpState::Rtr, Some(ird), None))
            .and_then(|_| cm_modify(s, &q, &child, QpState::Rts, None, Some(ord)))
            .and_then(|_| {
                child.accept(&CmParam {
                    qp_num: q.qpn,
                    private_data: &param.private_data,
                    responder_resources: ird,
                    initiator_depth: ord,
                    srq: q.has_srq,
                })
            });
        if let Err(e) = up {
            tracing::info!(qpn = q.qpn, error = %e, "ibverbs CM: accept failed");
            let _ = q.set_state(QpState::Error);
            let _ = child.reject(&[]);
            drop(st);
            drop(child);
            return Err(e);
        }
        let key = child.key();
        *q.cm_key.lock() = Some(key);
        st.conns.insert(
            key,
            Conn {
                id: child,
                qp: q.weak(),
                sink: q.sink.clone(),
                active: false,
                param,
                phase: Phase::Connecting,
                local_close: false,
                abortive: false,
            },
        );
        Ok(())
    }

    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        if private_data.len() > limits(&self.dev).reject as usize {
            return Err(VerbsError::Invalid);
        }
        let child = {
            let mut st = self.dev.cm.lock();
            let l = st
                .listeners
                .get_mut(&self.key)
                .ok_or(VerbsError::NoSuchResource)?;
            l.pending
                .remove(&conn_id)
                .ok_or(VerbsError::NoSuchResource)?
        };
        child.reject(private_data)
    }
}

impl Drop for IbvListener {
    fn drop(&mut self) {
        let l = self.dev.cm.lock().listeners.remove(&self.key);
        if let Some(l) = l {
            for (_, child) in l.pending {
                let _ = child.reject(&[]);
            }
            drop(l.id);
        }
    }
}

/// Close `qp`'s connection.
pub(crate) fn disconnect(qp: &QpInner, abortive: bool) -> Result<()> {
    let s = &qp.dev;
    let mut st = s.cm.lock();
    let key = (*qp.cm_key.lock()).ok_or(VerbsError::BadState)?;
    let conn = st.conns.get_mut(&key).ok_or(VerbsError::BadState)?;
    if conn.local_close || conn.phase == Phase::Closed {
        return Ok(());
    }
    conn.local_close = true;
    conn.abortive = abortive;
    let state = if abortive || !s.iwarp {
        QpState::Error
    } else {
        QpState::Sqd
    };
    if let Err(e) = qp.set_state(state) {
        tracing::debug!(qpn = qp.qpn, error = %e, "ibverbs CM: QP state before disconnect");
    }
    conn.id.disconnect()
}

/// The QP is going: forget (and destroy) its connection's id.
pub(crate) fn forget_qp(qp: &QpInner) {
    let conn = {
        let mut st = qp.dev.cm.lock();
        let key = qp.cm_key.lock().take();
        key.and_then(|k| st.conns.remove(&k))
    };
    drop(conn);
}

fn errno_of(status: i32, default: i32) -> i32 {
    match status {
        0 => default,
        s => s.abs(),
    }
}

/// Handle one rdma_cm event (on the device's event thread).
pub(crate) fn handle_event(s: &Arc<Shared>, ev: CmEvent) {
    use ffi::rdma_cm_event_type::*;
    tracing::debug!(kind = ev.kind, status = ev.status, "ibverbs CM event");
    if ev.kind == RDMA_CM_EVENT_CONNECT_REQUEST {
        return on_request(s, ev);
    }
    // Declared before the lock guard: dropped after it (a QP's last reference may go
    // here, and its Drop takes the lock).
    let mut keep: Vec<Arc<QpInner>> = Vec::new();
    let mut out: Vec<(Arc<dyn EventSink>, Event)> = Vec::new();
    let mut gone: Option<Conn> = None;
    {
        let mut st = s.cm.lock();
        let Some(c) = st.conns.get_mut(&ev.id) else {
            return;
        };
        let qp = c.qp.upgrade();
        let fail = |c: &mut Conn,
                    qp: &Option<Arc<QpInner>>,
                    ev: Event|
         -> Option<(Arc<dyn EventSink>, Event)> {
            if let Some(q) = qp {
                let _ = q.set_state(QpState::Error);
                q.cm_key.lock().take();
            }
            c.phase = Phase::Closed;
            Some((c.sink.clone(), ev))
        };
        let mut remove = false;
        match ev.kind {
            RDMA_CM_EVENT_ADDR_RESOLVED => {
                let r = match c.id.device_name() {
                    Some(d) if d == s.name() => c.id.resolve_route(RESOLVE_MS),
                    other => {
                        tracing::info!(device = ?other, "ibverbs CM: the peer is reached through another device");
                        Err(VerbsError::Unreachable)
                    }
                };
                if let Err(e) = r {
                    out.extend(fail(
                        c,
                        &qp,
                        Event::new(EventKind::Unreachable).with_status(e.errno()),
                    ));
                    remove = true;
                }
            }
            RDMA_CM_EVENT_ROUTE_RESOLVED => {
                let r = match &qp {
                    None => Err(VerbsError::NoSuchResource),
                    Some(q) => cm_modify(s, q, &c.id, QpState::Init, None, None).and_then(|_| {
                        c.id.connect(&CmParam {
                            qp_num: q.qpn,
                            private_data: &c.param.private_data,
                            responder_resources: clamp_u8(c.param.ird, s.max_ird),
                            initiator_depth: clamp_u8(c.param.ord, s.max_ord),
                            srq: q.has_srq,
                        })
                    }),
                };
                match r {
                    Ok(()) => c.phase = Phase::Connecting,
                    Err(e) => {
                        out.extend(fail(
                            c,
                            &qp,
                            Event::new(EventKind::Unreachable).with_status(e.errno()),
                        ));
                        remove = true;
                    }
                }
            }
            RDMA_CM_EVENT_CONNECT_RESPONSE => {
                // IB only: the REP arrived; INIT again (now that the IB CM knows the
                // connection, rdma_init_qp_attr gives the remote access rights its IRD
                // allows: without them the peer's RDMA Reads fail — librdmacm does the
                // same INIT to INIT for its own QPs), RTR, RTS, then the RTU.
                let ird = clamp_u8(c.param.ird.min(ev.initiator_depth as u32), s.max_ird);
                let ord = clamp_u8(c.param.ord.min(ev.responder_resources as u32), s.max_ord);
                let r = match &qp {
                    None => Err(VerbsError::NoSuchResource),
                    Some(q) => cm_modify(s, q, &c.id, QpState::Init, None, None)
                        .and_then(|_| cm_modify(s, q, &c.id, QpState::Rtr, Some(ird), None))
                        .and_then(|_| cm_modify(s, q, &c.id, QpState::Rts, None, Some(ord)))
                        .and_then(|_| c.id.establish()),
                };
                match r {
                    Ok(()) => {
                        c.phase = Phase::Established;
                        let e = Event::new(EventKind::Established)
                            .with_addrs(c.id.local_addr(), c.id.peer_addr())
                            .with_param(&ConnParam {
                                private_data: ev.private_data.clone(),
                                ird: ird as u32,
                                ord: ord as u32,
                            });
                        out.push((c.sink.clone(), e));
                    }
                    Err(e) => {
                        tracing::info!(error = %e, "ibverbs CM: cannot bring the QP up on the reply");
                        out.extend(fail(
                            c,
                            &qp,
                            Event::new(EventKind::Unreachable).with_status(e.errno()),
                        ));
                        remove = true;
                    }
                }
            }
            RDMA_CM_EVENT_ESTABLISHED if c.phase != Phase::Established => {
                c.phase = Phase::Established;
                if let Some(q) = &qp {
                    // iWARP: the kernel's CM moved the QP to RTS.
                    q.note_state(QpState::Rts);
                }
                let (ird, ord) = if ev.responder_resources != 0 || ev.initiator_depth != 0 {
                    (
                        c.param.ird.min(ev.initiator_depth as u32),
                        c.param.ord.min(ev.responder_resources as u32),
                    )
                } else {
                    (c.param.ird, c.param.ord)
                };
                let e = Event::new(EventKind::Established)
                    .with_addrs(c.id.local_addr(), c.id.peer_addr())
                    .with_param(&ConnParam {
                        private_data: if c.active {
                            ev.private_data.clone()
                        } else {
                            Vec::new()
                        },
                        ird,
                        ord,
                    });
                out.push((c.sink.clone(), e));
            }
            RDMA_CM_EVENT_REJECTED => {
                let by_consumer = if s.iwarp {
                    // An MPA reject resets the stream; a refused TCP connect does not
                    // get this far on siw (rdma_connect fails).
                    ev.status == -libc::ECONNRESET || !ev.private_data.is_empty()
                } else {
                    ev.status == IB_REJ_CONSUMER_DEFINED
                };
                let kind = if by_consumer {
                    EventKind::Rejected
                } else {
                    EventKind::Unreachable
                };
                let e = Event::new(kind)
                    .with_status(libc::ECONNREFUSED)
                    .with_param(&ConnParam {
                        private_data: ev.private_data.clone(),
                        ird: 0,
                        ord: 0,
                    });
                out.extend(fail(c, &qp, e));
                remove = true;
            }
            RDMA_CM_EVENT_ADDR_ERROR
            | RDMA_CM_EVENT_ROUTE_ERROR
            | RDMA_CM_EVENT_CONNECT_ERROR
            | RDMA_CM_EVENT_UNREACHABLE => {
                let errno = errno_of(ev.status, libc::ETIMEDOUT);
                out.extend(fail(
                    c,
                    &qp,
                    Event::new(EventKind::Unreachable).with_status(errno),
                ));
                remove = true;
            }
            RDMA_CM_EVENT_DISCONNECTED | RDMA_CM_EVENT_DEVICE_REMOVAL => {
                if let Some(q) = &qp {
                    let _ = q.set_state(QpState::Error);
                }
                if !c.local_close {
                    // Answer the peer's close (IB: the DREP).
                    let _ = c.id.disconnect();
                    c.local_close = true;
                }
                if c.phase != Phase::Closed {
                    let was_up = c.phase == Phase::Established;
                    c.phase = Phase::Closed;
                    let e = if ev.kind == RDMA_CM_EVENT_DEVICE_REMOVAL {
                        Event::new(EventKind::ConnectionBroken).with_status(libc::ENODEV)
                    } else if c.abortive || ev.status != 0 {
                        Event::new(EventKind::ConnectionBroken)
                            .with_status(errno_of(ev.status, libc::ECONNRESET))
                    } else if was_up {
                        Event::new(EventKind::Disconnected)
                    } else {
                        Event::new(EventKind::Unreachable).with_status(libc::ECONNRESET)
                    };
                    out.push((c.sink.clone(), e));
                }
            }
            _ => {}
        }
        if remove {
            gone = st.conns.remove(&ev.id);
        }
        keep.extend(qp);
    }
    drop(gone);
    for (sink, e) in out {
        sink.deliver(e);
    }
    drop(keep);
}

fn on_request(s: &Arc<Shared>, ev: CmEvent) {
    let Some(child) = ev.new_id else {
        return;
    };
    if child.device_name().as_deref() != Some(s.name()) {
        // A wildcard listener hears requests for every device; not ours to answer.
        let _ = child.reject(&[]);
        return;
    }
    let conn_id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
    let event = Event::new(EventKind::ConnectRequest)
        .with_conn(conn_id)
        .with_addrs(child.local_addr(), child.peer_addr())
        .with_param(&ConnParam {
            private_data: ev.private_data,
            // What the peer offers, from its side (the kernel swaps them into ours).
            ird: ev.initiator_depth as u32,
            ord: ev.responder_resources as u32,
        });
    let sink = {
        let mut st = s.cm.lock();
        let Some(l) = st.listeners.get_mut(&ev.listen_id) else {
            drop(st);
            let _ = child.reject(&[]);
            return;
        };
        l.pending.insert(conn_id, child);
        l.sink.clone()
    };
    tracing::debug!(conn_id, peer = ?event.peer, "ibverbs CM: connect request");
    if !sink.offer_request(event) {
        let child =
            s.cm.lock()
                .listeners
                .get_mut(&ev.listen_id)
                .and_then(|l| l.pending.remove(&conn_id));
        if let Some(c) = child {
            let _ = c.reject(&[]);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn private_data_limits_fit_the_wire() {
        use super::*;
        // rdma_cm's header (36 bytes) comes out of the IB CM REQ's 92.
        assert_eq!(IB_PRIVATE_DATA.connect, 92 - 36);
        assert!(IWARP_PRIVATE_DATA.connect as usize <= rnicpi::MAX_PRIVATE_DATA);
        assert_eq!(clamp_u8(300, 1000), 255);
        assert_eq!(clamp_u8(16, 4), 4);
        let _ = crate::sys::IBVERBS_SONAME;
    }
}
