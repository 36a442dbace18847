//! DAT events, as the EVDs deliver them: the common core's events read in DAT's terms.

use crate::ep::Ep;
use crate::mem::Rmr;
use crate::sp::Cr;
use krdma_itapi as it;

/// Which work request a completion reports (`DAT_DTOS`, and the IB extension's
/// operations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtoOp {
    Send,
    RdmaWrite,
    RdmaRead,
    Receive,
    BindMw,
    /// IB extension: compare and swap (`DAT_IB_CMP_AND_SWAP`).
    CmpAndSwap,
    /// IB extension: fetch and add (`DAT_IB_FETCH_AND_ADD`).
    FetchAndAdd,
    /// IB extension: RDMA Write with immediate data (`DAT_IB_RDMA_WRITE_IMMED`).
    RdmaWriteImmed,
}

impl DtoOp {
    pub(crate) fn of(kind: it::DtoKind) -> DtoOp {
        match kind {
            it::DtoKind::Send => DtoOp::Send,
            it::DtoKind::Recv => DtoOp::Receive,
            it::DtoKind::RdmaWrite => DtoOp::RdmaWrite,
            it::DtoKind::RdmaRead => DtoOp::RdmaRead,
            it::DtoKind::RmrLink => DtoOp::BindMw,
            it::DtoKind::FetchAdd => DtoOp::FetchAndAdd,
            it::DtoKind::CmpSwap => DtoOp::CmpAndSwap,
            it::DtoKind::RdmaWriteImm => DtoOp::RdmaWriteImmed,
        }
    }
}

/// Completion status (`DAT_DTO_COMPLETION_STATUS`, with its values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum DtoStatus {
    Success = 0,
    Flushed = 1,
    LocalLength = 2,
    LocalEp = 3,
    LocalProtection = 4,
    BadResponse = 5,
    RemoteAccess = 6,
    RemoteResponder = 7,
    Transport = 8,
    ReceiverNotReady = 9,
    PartialPacket = 10,
    RmrOperationFailed = 11,
    LocalMm = 12,
}

impl DtoStatus {
    pub(crate) fn of(s: it::DtoStatus) -> DtoStatus {
        use it::DtoStatus as S;
        match s {
            S::Success => DtoStatus::Success,
            S::Flushed => DtoStatus::Flushed,
            S::LocalLength => DtoStatus::LocalLength,
            S::LocalEp => DtoStatus::LocalEp,
            S::LocalProtection => DtoStatus::LocalProtection,
            S::BadResponse => DtoStatus::BadResponse,
            S::RemoteAccess => DtoStatus::RemoteAccess,
            S::RemoteResponder => DtoStatus::RemoteResponder,
            S::Transport => DtoStatus::Transport,
            S::ReceiverNotReady => DtoStatus::ReceiverNotReady,
            S::PartialPacket => DtoStatus::PartialPacket,
            S::RmrOperationFailed => DtoStatus::RmrOperationFailed,
            S::LocalMmOperation => DtoStatus::LocalMm,
        }
    }
}

/// A work request completed (`DAT_DTO_COMPLETION_EVENT`).
#[derive(Clone)]
pub struct DtoEvent {
    pub ep: Ep,
    pub cookie: u64,
    pub status: DtoStatus,
    /// Bytes received (receives) or posted (the rest).
    pub transferred_length: u32,
    pub op: DtoOp,
    /// A receive consumed by a message with immediate data (IB extension).
    pub immediate: Option<it::Immediate>,
}

/// An RMR bind (or unbind) completed (`DAT_RMR_BIND_COMPLETION_EVENT`).
#[derive(Clone)]
pub struct RmrBindEvent {
    /// The RMR, unless it was freed meanwhile.
    pub rmr: Option<Rmr>,
    pub cookie: u64,
    pub status: DtoStatus,
}

/// What happened to a connection (`DAT_CONNECTION_EVENT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnEvent {
    Established,
    PeerRejected,
    NonPeerRejected,
    Unreachable,
    TimedOut,
    Disconnected,
    Broken,
}

/// A connection message for an endpoint.
#[derive(Clone)]
pub struct ConnectionEvent {
    pub kind: ConnEvent,
    pub ep: Ep,
    /// The peer's private data: the accept's (established, active side) or the
    /// reject's. Over InfiniBand it is the CM message's whole field (the data, then
    /// zeros: the IB CM carries no length).
    pub private_data: Vec<u8>,
    /// A UD endpoint's resolution (IB extension): where its datagrams to the peer go.
    pub ud: Option<krdma_itapi::UdRemote>,
}

/// Asynchronous errors (`DAT_ASYNC_ERROR_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncKind {
    EvdOverflow,
    IaCatastrophic,
    EpBroken,
    ProviderInternal,
}

#[derive(Clone)]
pub struct AsyncEvent {
    pub kind: AsyncKind,
    /// The endpoint concerned, when there is one.
    pub ep: Option<Ep>,
}

/// One event of any kind (`DAT_EVENT`).
#[derive(Clone)]
pub enum Event {
    Dto(DtoEvent),
    RmrBind(RmrBindEvent),
    /// A connection request arrived at a PSP or RSP: query, accept or reject it.
    ConnRequest(Cr),
    Connection(ConnectionEvent),
    Async(AsyncEvent),
    /// A software event (`dat_evd_post_se`) and the pointer it carries.
    Software(u64),
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Dto(d) => write!(
                f,
                "Dto({:?} ep {} cookie {} {:?} len {})",
                d.op,
                d.ep.id(),
                d.cookie,
                d.status,
                d.transferred_length
            ),
            Event::RmrBind(b) => write!(f, "RmrBind(cookie {} {:?})", b.cookie, b.status),
            Event::ConnRequest(c) => write!(f, "ConnRequest(port {})", c.conn_qual()),
            Event::Connection(c) => write!(
                f,
                "Connection({:?} ep {} {} B)",
                c.kind,
                c.ep.id(),
                c.private_data.len()
            ),
            Event::Async(a) => write!(f, "Async({:?})", a.kind),
            Event::Software(p) => write!(f, "Software({p:#x})"),
        }
    }
}

impl ConnEvent {
    pub(crate) fn of(c: &it::ConnectionEvent) -> ConnEvent {
        match c.kind {
            it::ConnEventKind::Established => ConnEvent::Established,
            it::ConnEventKind::Disconnect => ConnEvent::Disconnected,
            it::ConnEventKind::PeerReject => ConnEvent::PeerRejected,
            it::ConnEventKind::Broken => ConnEvent::Broken,
            it::ConnEventKind::NonPeerReject => match c.reject_reason {
                it::RejectReason::Timeout => ConnEvent::TimedOut,
                it::RejectReason::BadPath => ConnEvent::Unreachable,
                _ => ConnEvent::NonPeerRejected,
            },
        }
    }
}
