//! Reliable-connected endpoints: a QP with the SEVDs its completions and connection
//! messages go to, its attributes and connection state.
//!
//! * [`connect`](Endpoint::connect) / [`accept`](Endpoint::accept) /
//!   [`disconnect`](Endpoint::disconnect): `connect.rs`;
//! * the data transfer operations: `post.rs`.

mod connect;
pub(crate) mod post;
mod wr_table;

pub use post::{AtomicOp, DtoFlags};

use crate::evd::Evd;
use crate::event::{DtoKind, DtoStatus, EventStream};
use crate::object::{object_accessors, Common, UseGuard};
use crate::pz::Pz;
use crate::srq::Srq;
use crate::status::{Error, FromVerbs, Result};
use parking_lot::Mutex;
use rnicpi::{wc_flags, Cqe, QpCaps};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use wr_table::queue_of;
pub(crate) use wr_table::{Queue, WrTable};

pub use rnicpi::RDMA_UDP_QKEY;

/// Connection state of an RC endpoint (`it_ep_state_rc_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum EpState {
    Unconnected = 0,
    /// `connect` was called; waiting for the peer's answer.
    Active1ConnectionPending = 1,
    Active2ConnectionPending = 2,
    /// `accept` was called; waiting for the connection to come up.
    PassiveConnectionPending = 3,
    Connected = 4,
    /// Disconnected, rejected or broken: work completes flushed.
    NonOperational = 5,
    PassiveWaitRdmaTransReq = 6,
}

/// The attributes of an RC endpoint (`it_ep_attributes_t` with its RC part).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpAttributes {
    pub max_dto_payload_size: usize,
    /// Send-queue depth (sends, RDMA operations, RMR links).
    pub max_request_dtos: usize,
    /// Receive-queue depth (ignored on an SRQ).
    pub max_recv_dtos: usize,
    pub max_send_segments: usize,
    pub max_recv_segments: usize,
    pub rdma_read_enable: bool,
    pub rdma_write_enable: bool,
    pub max_rdma_read_segments: usize,
    pub max_rdma_write_segments: usize,
    /// Inbound RDMA Reads the endpoint serves at once.
    pub rdma_read_ird: u32,
    /// Outbound RDMA Reads it issues at once.
    pub rdma_read_ord: u32,
}

impl Default for EpAttributes {
    fn default() -> Self {
        EpAttributes {
            max_dto_payload_size: 1 << 30,
            max_request_dtos: 64,
            max_recv_dtos: 64,
            max_send_segments: 4,
            max_recv_segments: 4,
            rdma_read_enable: true,
            rdma_write_enable: true,
            max_rdma_read_segments: 4,
            max_rdma_write_segments: 4,
            rdma_read_ird: 8,
            rdma_read_ord: 8,
        }
    }
}

/// What [`Endpoint::query`] reports (`it_ep_param_t`).
#[derive(Debug, Clone)]
pub struct EpParams {
    pub ia: u64,
    pub spigot_id: usize,
    pub state: EpState,
    pub pz: u64,
    pub request_evd: u64,
    pub recv_evd: u64,
    pub connect_evd: u64,
    pub srq: Option<u64>,
    /// The peer, once connected.
    pub peer: Option<SocketAddr>,
    pub attributes: EpAttributes,
}

/// A change of endpoint attributes ([`Endpoint::modify`]); `None` leaves a field alone.
/// IRD and ORD can change only before the endpoint connects.
#[derive(Debug, Clone, Default)]
pub struct EpChange {
    pub rdma_read_enable: Option<bool>,
    pub rdma_write_enable: Option<bool>,
    pub rdma_read_ird: Option<u32>,
    pub rdma_read_ord: Option<u32>,
}

/// A reliable-connected endpoint.
///
/// ```no_run
/// use krdma_itapi::*;
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// let dto = Evd::create(&ia, EventStream::Dto, EvdFlags::empty(), 256, 1, None)?;
/// let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 16, 1, None)?;
/// let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, EpAttributes::default(), None)?;
/// ep.connect("127.0.0.1:7471".parse().unwrap(), b"hello")?;
/// match cm.wait(Some(std::time::Duration::from_secs(5)))?.0 {
///     Event::Connection(c) if c.kind == ConnEventKind::Established => {}
///     other => panic!("not connected: {other:?}"),
/// }
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Endpoint(pub(crate) Arc<EpInner>);

object_accessors!(Endpoint);

pub struct EpInner {
    pub(crate) pz: Pz,
    pub(crate) qp: Arc<ual::Qp>,
    request_evd: Evd,
    recv_evd: Evd,
    connect_evd: Evd,
    srq: Option<Srq>,
    attrs: Mutex<EpAttributes>,
    /// An unreliable-datagram endpoint: no connection, datagrams to what it resolved.
    pub(crate) ud: bool,
    conn: Mutex<ConnState>,
    sends: Mutex<WrTable>,
    recvs: Mutex<WrTable>,
    /// The consumer asked for the disconnect (or abort).
    local_close: AtomicBool,
    /// Send-queue requests that completed flushed: work the connection's end lost.
    lost_sends: AtomicU32,
    /// A graceful disconnect waits for the send queue to drain (see `connect.rs`).
    close_pending: AtomicBool,
    /// The connection's end (disconnect, reject, broken) has been reported: it is
    /// reported once, whichever of the provider and this layer notices first.
    ended: AtomicBool,
    _uses: Vec<UseGuard>,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

#[derive(Debug, Clone)]
struct ConnState {
    state: EpState,
    peer: Option<SocketAddr>,
    /// This side called `connect` (rather than `accept`).
    active: bool,
}

/// What the endpoint must do once the SEVD that took a completion is unlocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EpAction {
    /// A request failed (not flushed): the connection is broken.
    Break,
    /// The send queue drained under a pending graceful disconnect: close now.
    Disconnect,
}

/// What one completion reports, decoded against the request's slot.
pub(crate) struct Completion {
    pub kind: DtoKind,
    pub cookie: u64,
    pub status: DtoStatus,
    pub length: u32,
    pub notify: bool,
    /// The completion wakes a thread waiting on the SEVD (all but an unsolicited
    /// message landing in a receive posted with `SOLICITED_WAIT`).
    pub wakes: bool,
    pub solicited: bool,
    pub immediate: Option<crate::event::Immediate>,
}

impl Endpoint {
    /// Create an RC endpoint in `pz`: its send-side completions go to `request_evd`, its
    /// receive completions to `recv_evd` (both DTO SEVDs, possibly the same), its
    /// connection messages to `connect_evd` (a connection-message SEVD). With `srq`,
    /// receives come from the shared receive queue.
    pub fn create_rc(
        pz: &Pz,
        request_evd: &Evd,
        recv_evd: &Evd,
        connect_evd: &Evd,
        attrs: EpAttributes,
        srq: Option<&Srq>,
    ) -> Result<Endpoint> {
        Self::create(pz, (request_evd, recv_evd, connect_evd), attrs, srq, false)
    }

    /// Create an unreliable-datagram endpoint (devices with address handles: rxe0), as
    /// [`create_rc`](Self::create_rc) for its SEVDs. It is ready at once, with rdma_cm's
    /// Q_Key for UD services ([`RDMA_UDP_QKEY`]); [`connect`](Self::connect) resolves a
    /// peer's UD service (the resolution, with an address handle to it, arrives as
    /// `Established` on the connection SEVD, [`ConnectionEvent::ud`]), and
    /// [`post_sendto`](Self::post_sendto) sends datagrams to what it resolved. Each
    /// receive gets the 40-byte GRH before the message.
    ///
    /// [`ConnectionEvent::ud`]: crate::event::ConnectionEvent::ud
    pub fn create_ud(
        pz: &Pz,
        request_evd: &Evd,
        recv_evd: &Evd,
        connect_evd: &Evd,
        attrs: EpAttributes,
        srq: Option<&Srq>,
    ) -> Result<Endpoint> {
        Self::create(pz, (request_evd, recv_evd, connect_evd), attrs, srq, true)
    }

    fn create(
        pz: &Pz,
        (request_evd, recv_evd, connect_evd): (&Evd, &Evd, &Evd),
        attrs: EpAttributes,
        srq: Option<&Srq>,
        ud: bool,
    ) -> Result<Endpoint> {
        let ia = &pz.0.ia;
        ia.check_alive()?;
        check_evd(pz, request_evd, EventStream::Dto, Error::InvalidReqEvd)?;
        check_evd(pz, recv_evd, EventStream::Dto, Error::InvalidRecvEvd)?;
        check_evd(
            pz,
            connect_evd,
            EventStream::CmMessage,
            Error::InvalidConnEvd,
        )?;
        if let Some(s) = srq {
            if s.pz().id() != pz.id() {
                return Err(Error::InvalidSrq);
            }
        }
        let caps = check_attrs(ia, &attrs, srq.is_some())?;
        let dto_cq = |e: &Evd| e.0.dto.as_ref().expect("DTO SEVD").cq.clone();
        let qp =
            ia.0.ctx
                .create_qp(
                    &pz.0.pd,
                    &dto_cq(request_evd),
                    &dto_cq(recv_evd),
                    ual::QpConfig {
                        qp_type: if ud {
                            rnicpi::QpType::Ud
                        } else {
                            rnicpi::QpType::Rc
                        },
                        caps,
                        srq: srq.map(|s| s.0.srq.clone()),
                    },
                )
                .it(if ud {
                    Error::InvalidEpType
                } else {
                    Error::InvalidEpAttr
                })?;
        if ud {
            let psn = ual::oob::random_psn(qp.qp_num);
            ual::oob::ud_to_rts(&qp, RDMA_UDP_QKEY, psn).it(Error::InvalidEpType)?;
        }
        let mut uses = vec![
            pz.0.common.use_guard(),
            request_evd.0.common.use_guard(),
            recv_evd.0.common.use_guard(),
            connect_evd.0.common.use_guard(),
        ];
        uses.extend(srq.map(|s| s.0.common.use_guard()));
        let inner = Arc::new(EpInner {
            common: Common::new(),
            pz: pz.clone(),
            qp,
            request_evd: request_evd.clone(),
            recv_evd: recv_evd.clone(),
            connect_evd: connect_evd.clone(),
            srq: srq.cloned(),
            attrs: Mutex::new(attrs),
            ud,
            conn: Mutex::new(ConnState {
                state: EpState::Unconnected,
                peer: None,
                active: false,
            }),
            sends: Mutex::new(WrTable::default()),
            recvs: Mutex::new(WrTable::default()),
            local_close: AtomicBool::new(false),
            lost_sends: AtomicU32::new(0),
            close_pending: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            _uses: uses,
        });
        for evd in [request_evd, recv_evd] {
            if let Some(d) = &evd.0.dto {
                d.attach(inner.qp.qp_num, Arc::downgrade(&inner));
            }
        }
        connect::listen(&inner);
        tracing::debug!(
            id = inner.common.id,
            qpn = inner.qp.qp_num,
            ud,
            "endpoint created"
        );
        Ok(Endpoint(inner))
    }

    pub fn state(&self) -> EpState {
        self.0.conn.lock().state
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    pub fn ia(&self) -> &crate::Ia {
        self.0.ia()
    }

    pub fn attributes(&self) -> EpAttributes {
        self.0.attrs.lock().clone()
    }

    pub fn query(&self) -> EpParams {
        let conn = self.0.conn.lock().clone();
        EpParams {
            ia: self.0.pz.0.ia.id(),
            spigot_id: 0,
            state: conn.state,
            pz: self.0.pz.id(),
            request_evd: self.0.request_evd.id(),
            recv_evd: self.0.recv_evd.id(),
            connect_evd: self.0.connect_evd.id(),
            srq: self.0.srq.as_ref().map(Srq::id),
            peer: conn.peer,
            attributes: self.attributes(),
        }
    }

    /// Change the RDMA enables, or (before connecting) IRD and ORD.
    pub fn modify(&self, change: &EpChange) -> Result<()> {
        let ia = &self.0.pz.0.ia;
        let limits = ia.limits();
        let depths = change.rdma_read_ird.is_some() || change.rdma_read_ord.is_some();
        if depths && self.state() != EpState::Unconnected {
            return Err(Error::InvalidEpState);
        }
        if change.rdma_read_ird.is_some_and(|v| v > limits.max_ird) {
            return Err(Error::ResourceIrd);
        }
        if change.rdma_read_ord.is_some_and(|v| v > limits.max_ord) {
            return Err(Error::ResourceOrd);
        }
        let mut a = self.0.attrs.lock();
        a.rdma_read_enable = change.rdma_read_enable.unwrap_or(a.rdma_read_enable);
        a.rdma_write_enable = change.rdma_write_enable.unwrap_or(a.rdma_write_enable);
        a.rdma_read_ird = change.rdma_read_ird.unwrap_or(a.rdma_read_ird);
        a.rdma_read_ord = change.rdma_read_ord.unwrap_or(a.rdma_read_ord);
        Ok(())
    }

    /// The QP number (for diagnostics).
    pub fn qp_num(&self) -> u32 {
        self.0.qp.qp_num
    }
}

fn check_evd(pz: &Pz, evd: &Evd, stream: EventStream, wrong: Error) -> Result<()> {
    if evd.stream() != stream || !pz.same_ia(&evd.0.ia) {
        return Err(wrong);
    }
    Ok(())
}

/// Validate attributes against the device; the QP capabilities they ask for.
fn check_attrs(ia: &crate::Ia, a: &EpAttributes, on_srq: bool) -> Result<QpCaps> {
    let l = ia.limits();
    let within = |v: usize, max: u32, err: Error| {
        if v == 0 {
            Err(Error::InvalidEpAttr)
        } else if v > max as usize {
            Err(err)
        } else {
            Ok(v as u32)
        }
    };
    let send = within(a.max_request_dtos, l.max_dtos, Error::ResourceReqDto)?;
    let send_sge = within(a.max_send_segments, l.max_segments, Error::ResourceSseg)?;
    within(
        a.max_rdma_read_segments,
        l.max_segments,
        Error::ResourceRrseg,
    )?;
    within(
        a.max_rdma_write_segments,
        l.max_segments,
        Error::ResourceRwseg,
    )?;
    let (recv, recv_sge) = if on_srq {
        (0, 0)
    } else {
        (
            within(a.max_recv_dtos, l.max_dtos, Error::ResourceRecvDto)?,
            within(a.max_recv_segments, l.max_segments, Error::ResourceRseg)?,
        )
    };
    if a.rdma_read_ird > l.max_ird {
        return Err(Error::ResourceIrd);
    }
    if a.rdma_read_ord > l.max_ord {
        return Err(Error::ResourceOrd);
    }
    Ok(QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: send_sge,
        max_recv_sge: recv_sge,
        max_inline: l.max_inline,
    })
}

impl EpInner {
    pub(crate) fn ia(&self) -> &crate::Ia {
        &self.pz.0.ia
    }

    fn set_state(&self, state: EpState) -> EpState {
        let old = std::mem::replace(&mut self.conn.lock().state, state);
        if old != state {
            tracing::debug!(ep = self.common.id, ?old, new = ?state, "endpoint state");
        }
        old
    }

    /// Decode a completion of this endpoint: the event it makes (`None` for a
    /// successful unsignaled request — posted without [`DtoFlags::COMPLETION`] — or one
    /// that names no request), and what the endpoint must do next.
    pub(crate) fn complete(&self, c: &Cqe) -> (Option<Completion>, Option<EpAction>) {
        let Some(queue) = queue_of(c.wr_id) else {
            return (None, None);
        };
        let (info, sends_left) = match queue {
            Queue::Send => {
                let mut t = self.sends.lock();
                (t.retire_through(c.wr_id), t.awaited())
            }
            Queue::Recv => (self.recvs.lock().remove(c.wr_id), usize::MAX),
            Queue::Srq => match &self.srq {
                Some(s) => (s.0.wrs.lock().remove(c.wr_id), usize::MAX),
                None => (None, usize::MAX),
            },
        };
        let Some(info) = info else {
            tracing::warn!(
                ep = self.common.id,
                wr_id = c.wr_id,
                "completion names no request"
            );
            return (None, None);
        };
        let status = DtoStatus::from_wc(c.status());
        let ok = status == DtoStatus::Success;
        let recv = info.kind == DtoKind::Recv;
        // A failed request ends the connection on every transport (iWARP: the
        // Terminate; InfiniBand: the QP is in Error, which the CM does not tell the
        // peer). A drained send queue lets a pending graceful disconnect go ahead.
        let action = if !ok && status != DtoStatus::Flushed {
            Some(EpAction::Break)
        } else if sends_left == 0 && self.close_pending.swap(false, Ordering::AcqRel) {
            Some(EpAction::Disconnect)
        } else {
            None
        };
        if ok && !recv && !info.flags.contains(DtoFlags::COMPLETION) {
            return (None, action);
        }
        if !ok && status != DtoStatus::Flushed {
            tracing::info!(ep = self.common.id, ?status, kind = ?info.kind, "work request failed");
        }
        if status == DtoStatus::Flushed && !recv {
            self.lost_sends.fetch_add(1, Ordering::Relaxed);
        }
        let solicited = c.flags & wc_flags::SOLICITED != 0;
        let solicited_wait = recv && info.flags.contains(DtoFlags::SOLICITED_WAIT);
        let notify = !ok
            || if solicited_wait {
                solicited
            } else {
                info.flags.contains(DtoFlags::NOTIFY)
            };
        let wakes = !ok || !solicited_wait || solicited;
        let done = Completion {
            kind: info.kind,
            cookie: info.cookie,
            status,
            length: if recv { c.byte_len } else { info.length },
            notify,
            wakes,
            solicited,
            immediate: immediate_of(c),
        };
        (Some(done), action)
    }
}

/// The immediate data of a receive's completion (carried in network byte order).
fn immediate_of(c: &Cqe) -> Option<crate::event::Immediate> {
    use crate::event::Immediate;
    if c.flags & wc_flags::WITH_IMM == 0 {
        return None;
    }
    let data = u32::from_be(c.imm_or_inv);
    Some(match c.opcode() {
        Some(rnicpi::WcOpcode::RecvRdmaWithImm) => Immediate::RdmaWrite(data),
        _ => Immediate::Send(data),
    })
}

impl Drop for EpInner {
    fn drop(&mut self) {
        if self.close_pending.swap(false, Ordering::AcqRel) {
            self.request_evd.0.closing(-1);
        }
        for evd in [&self.request_evd, &self.recv_evd] {
            if let Some(d) = &evd.0.dto {
                d.detach(self.qp.qp_num);
            }
        }
        tracing::debug!(
            id = self.common.id,
            qpn = self.qp.qp_num,
            "RC endpoint freed"
        );
    }
}
