//! Events as the event dispatchers deliver them: one enum over the standard's event
//! streams, with the standard's event numbers ([`EventNumber`]).

use crate::ep::{Endpoint, EpInner};
use crate::evd::{Evd, SevdInner};
use crate::listen::CnEstId;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};

/// The event streams an EVD can serve (`it_event_type_t` stream values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum EventStream {
    /// Work request (DTO) completions.
    Dto = 0x00000,
    /// Connection requests arriving at a listener.
    CmRequest = 0x01000,
    /// Connection messages of an endpoint (established, rejected, disconnected, broken).
    CmMessage = 0x02000,
    /// Asynchronous events affiliated with an endpoint, SEVD or SRQ (one EVD per IA).
    AsyncAffiliated = 0x04000,
    /// Asynchronous events of the adapter itself (one EVD per IA).
    AsyncUnaffiliated = 0x08000,
    /// Events posted by the consumer ([`Evd::post_software`]).
    Software = 0x10000,
    /// Notifications an aggregate EVD produces.
    AevdNotification = 0x20000,
}

/// Mask selecting the stream bits of an event number (`IT_EVENT_STREAM_MASK`).
pub const EVENT_STREAM_MASK: u32 = 0xff000;

impl EventStream {
    /// The stream of an event or stream number.
    pub fn of(number: u32) -> Option<EventStream> {
        use EventStream::*;
        [
            Dto,
            CmRequest,
            CmMessage,
            AsyncAffiliated,
            AsyncUnaffiliated,
            Software,
            AevdNotification,
        ]
        .into_iter()
        .find(|s| *s as u32 == number & EVENT_STREAM_MASK)
    }
}

/// The standard's event numbers (`it_event_type_t`) of the events krdma generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum EventNumber {
    DtoSendCmpl = 0x00001,
    DtoRcRecvCmpl = 0x00002,
    DtoRdmaWriteCmpl = 0x00004,
    DtoRdmaReadCmpl = 0x00005,
    /// `IT_RMR_LINK_CMPL_EVENT` (= `IT_RMR_BIND_CMPL_EVENT`).
    RmrLinkCmpl = 0x00006,
    DtoFetchAddCmpl = 0x00007,
    DtoCmpSwapCmpl = 0x00008,
    CmReqConnRequest = 0x01001,
    CmMsgConnEstablished = 0x02002,
    CmMsgConnDisconnect = 0x02003,
    CmMsgConnPeerReject = 0x02004,
    CmMsgConnNonpeerReject = 0x02005,
    CmMsgConnBroken = 0x02006,
    AsyncAffSevdEnqueueFailure = 0x04001,
    AsyncAffEpFailure = 0x04002,
    AsyncAffEpLocalAccessViolation = 0x04020,
    AsyncAffEpLocalTransportError = 0x04023,
    AsyncAffEpSrqError = 0x04061,
    AsyncAffSrqLowWatermark = 0x04100,
    AsyncUnaffSpigotOnline = 0x08002,
    AsyncUnaffSpigotOffline = 0x08003,
    AsyncUnaffSevdEnqueueFailure = 0x08004,
    Software = 0x10001,
    AevdNotification = 0x20001,
}

/// A reference to the object an event concerns: its id always, the object itself while
/// it is alive (events never keep objects alive).
pub struct ObjRef<T> {
    pub id: u64,
    weak: Weak<T>,
}

impl<T> Clone for ObjRef<T> {
    fn clone(&self) -> Self {
        ObjRef {
            id: self.id,
            weak: self.weak.clone(),
        }
    }
}

impl<T> std::fmt::Debug for ObjRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.id)
    }
}

impl<T> ObjRef<T> {
    pub(crate) fn new(id: u64, obj: &Arc<T>) -> Self {
        ObjRef {
            id,
            weak: Arc::downgrade(obj),
        }
    }
    pub(crate) fn upgrade(&self) -> Option<Arc<T>> {
        self.weak.upgrade()
    }
}

impl ObjRef<EpInner> {
    /// The endpoint, unless it has been freed.
    pub fn endpoint(&self) -> Option<Endpoint> {
        self.upgrade().map(Endpoint)
    }
}

impl ObjRef<SevdInner> {
    /// The EVD, unless it has been freed.
    pub fn evd(&self) -> Option<Evd> {
        self.upgrade().map(Evd)
    }
}

/// A reference to an endpoint in an event.
pub type EpRef = ObjRef<EpInner>;
/// A reference to a simple EVD in an event.
pub type EvdRef = ObjRef<SevdInner>;

/// Which work request a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DtoKind {
    Send,
    Recv,
    RdmaWrite,
    RdmaRead,
    RmrLink,
    /// An atomic Fetch and Add ([`Endpoint::post_atomic`]).
    FetchAdd,
    /// An atomic Compare and Swap.
    CmpSwap,
    /// An RDMA Write with immediate data ([`Endpoint::post_rdma_write_imm`]): an
    /// extension of IT-API's DTOs for the InfiniBand transport.
    RdmaWriteImm,
}

impl DtoKind {
    pub fn number(self) -> EventNumber {
        match self {
            DtoKind::Send => EventNumber::DtoSendCmpl,
            DtoKind::Recv => EventNumber::DtoRcRecvCmpl,
            DtoKind::RdmaWrite => EventNumber::DtoRdmaWriteCmpl,
            DtoKind::RdmaRead => EventNumber::DtoRdmaReadCmpl,
            DtoKind::RmrLink => EventNumber::RmrLinkCmpl,
            DtoKind::FetchAdd => EventNumber::DtoFetchAddCmpl,
            DtoKind::CmpSwap => EventNumber::DtoCmpSwapCmpl,
            DtoKind::RdmaWriteImm => EventNumber::DtoRdmaWriteCmpl,
        }
    }
}

/// Completion status of a work request (`it_dto_status_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum DtoStatus {
    Success = 0,
    LocalLength = 1,
    LocalEp = 2,
    LocalProtection = 3,
    Flushed = 4,
    /// `IT_RMR_OPERATION_FAILED`: a link (memory window bind) failed.
    RmrOperationFailed = 5,
    BadResponse = 6,
    RemoteAccess = 7,
    RemoteResponder = 8,
    Transport = 9,
    ReceiverNotReady = 10,
    PartialPacket = 11,
    LocalMmOperation = 12,
}

impl DtoStatus {
    pub(crate) fn from_wc(s: rnicpi::WcStatus) -> DtoStatus {
        use rnicpi::WcStatus as W;
        match s {
            W::Success => DtoStatus::Success,
            W::LocLenErr => DtoStatus::LocalLength,
            W::LocQpOpErr | W::LocEecOpErr => DtoStatus::LocalEp,
            W::LocProtErr | W::LocAccessErr => DtoStatus::LocalProtection,
            W::WrFlushErr => DtoStatus::Flushed,
            W::MwBindErr => DtoStatus::RmrOperationFailed,
            W::BadRespErr => DtoStatus::BadResponse,
            W::RemAccessErr => DtoStatus::RemoteAccess,
            W::RemInvReqErr | W::RemOpErr => DtoStatus::RemoteResponder,
            W::RnrRetryExcErr => DtoStatus::ReceiverNotReady,
            W::RetryExcErr | W::FatalErr | W::RespTimeoutErr | W::GeneralErr => {
                DtoStatus::Transport
            }
        }
    }
}

/// A work request completed (`it_dto_cmpl_event_t`).
#[derive(Debug, Clone)]
pub struct DtoEvent {
    pub kind: DtoKind,
    pub evd: EvdRef,
    pub ep: EpRef,
    /// The cookie given when the work request was posted.
    pub cookie: u64,
    pub status: DtoStatus,
    /// Bytes received (receives) or posted (other work requests).
    pub transferred_length: u32,
    /// The received message carried the solicited-event bit.
    pub solicited: bool,
    /// A receive consumed by a message with immediate data (InfiniBand transport).
    pub immediate: Option<Immediate>,
}

/// Immediate data a receive completed with, and what carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Immediate {
    /// An RDMA Write with immediate data: its bytes went to the peer's chosen memory,
    /// the receive holds none (its length is the write's).
    RdmaWrite(u32),
    /// A Send with immediate data.
    Send(u32),
}

/// A connection request arrived at a listener (`it_conn_request_event_t`).
#[derive(Debug, Clone)]
pub struct ConnRequestEvent {
    pub evd: EvdRef,
    /// Pass to [`Endpoint::accept`] or [`CnEstId::reject`].
    pub cn_est_id: CnEstId,
    /// The port the request arrived on (the connection qualifier).
    pub port: u16,
    pub source: Option<SocketAddr>,
    pub spigot_id: usize,
    pub ird: u32,
    pub ord: u32,
    pub private_data: Vec<u8>,
    /// A UD service resolution (accept it with a UD endpoint), not an RC connection.
    pub ud: bool,
}

/// What happened to a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnEventKind {
    Established,
    /// The peer disconnected, or the local side did.
    Disconnect,
    /// The peer's consumer rejected the request (with its private data).
    PeerReject,
    /// The connection could not be made (no listener, unreachable, protocol mismatch).
    NonPeerReject,
    /// The connection failed (reset, protocol error, peer gone).
    Broken,
}

impl ConnEventKind {
    pub fn number(self) -> EventNumber {
        match self {
            ConnEventKind::Established => EventNumber::CmMsgConnEstablished,
            ConnEventKind::Disconnect => EventNumber::CmMsgConnDisconnect,
            ConnEventKind::PeerReject => EventNumber::CmMsgConnPeerReject,
            ConnEventKind::NonPeerReject => EventNumber::CmMsgConnNonpeerReject,
            ConnEventKind::Broken => EventNumber::CmMsgConnBroken,
        }
    }
}

/// Why a connection attempt was rejected by someone other than the peer's consumer
/// (`it_conn_reject_code_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RejectReason {
    Other = 0,
    Timeout = 1,
    BadPath = 2,
    StaleConn = 3,
    BadOrd = 4,
    Resources = 5,
    BadConnParms = 6,
}

/// A connection message for an endpoint (`it_connection_event_t`).
#[derive(Debug, Clone)]
pub struct ConnectionEvent {
    pub kind: ConnEventKind,
    pub evd: EvdRef,
    pub ep: EpRef,
    /// Negotiated inbound / outbound RDMA Read depth (established).
    pub ird: u32,
    pub ord: u32,
    pub peer: Option<SocketAddr>,
    /// The peer's private data (the accept data on the active side, the reject data on
    /// a peer reject); empty when none.
    pub private_data: Vec<u8>,
    pub reject_reason: RejectReason,
    /// A UD endpoint's resolution: where its datagrams to the peer's service go.
    pub ud: Option<UdRemote>,
}

/// The far end a UD endpoint resolved: the serving QP, its Q_Key, and an address handle
/// to its address in the endpoint's PZ (held by every copy of the event). On the passive
/// side (an accepted resolution) the requester's QP is not known: `qpn` is 0.
#[derive(Clone)]
pub struct UdRemote {
    pub qpn: u32,
    pub qkey: u32,
    pub ah: std::sync::Arc<ual::Ah>,
    /// The address `ah` points to.
    pub peer: Option<std::net::SocketAddr>,
    /// This side accepted the resolution (rather than asked for it).
    pub passive: bool,
}

impl std::fmt::Debug for UdRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdRemote")
            .field("qpn", &self.qpn)
            .field("qkey", &self.qkey)
            .field("ah", &self.ah.num())
            .field("peer", &self.peer)
            .field("passive", &self.passive)
            .finish()
    }
}

/// What an affiliated asynchronous event concerns.
#[derive(Debug, Clone)]
pub enum AffiliatedCause {
    Ep(EpRef),
    Sevd(EvdRef),
    Srq(u64),
}

/// An asynchronous event affiliated with an object (`it_affiliated_event_t`).
#[derive(Debug, Clone)]
pub struct AffiliatedEvent {
    pub number: EventNumber,
    pub evd: EvdRef,
    pub cause: AffiliatedCause,
}

/// An asynchronous event of the adapter (`it_unaffiliated_event_t`).
#[derive(Debug, Clone)]
pub struct UnaffiliatedEvent {
    pub number: EventNumber,
    pub evd: EvdRef,
    pub ia: u64,
    pub spigot_id: usize,
}

/// A consumer-posted event (`it_software_event_t`).
#[derive(Debug, Clone)]
pub struct SoftwareEvent {
    pub evd: EvdRef,
    pub data: u64,
}

/// An aggregate EVD's notice that one of its SEVDs has events
/// (`it_aevd_notification_event_t`).
#[derive(Debug, Clone)]
pub struct AevdNotification {
    pub aevd: u64,
    pub sevd: EvdRef,
}

/// One event, of any stream.
#[derive(Debug, Clone)]
pub enum Event {
    Dto(DtoEvent),
    ConnRequest(ConnRequestEvent),
    Connection(ConnectionEvent),
    Affiliated(AffiliatedEvent),
    Unaffiliated(UnaffiliatedEvent),
    Software(SoftwareEvent),
    AevdNotification(AevdNotification),
}

impl Event {
    /// The standard's event number.
    pub fn number(&self) -> EventNumber {
        match self {
            Event::Dto(e) => e.kind.number(),
            Event::ConnRequest(_) => EventNumber::CmReqConnRequest,
            Event::Connection(e) => e.kind.number(),
            Event::Affiliated(e) => e.number,
            Event::Unaffiliated(e) => e.number,
            Event::Software(_) => EventNumber::Software,
            Event::AevdNotification(_) => EventNumber::AevdNotification,
        }
    }

    /// The id of the EVD the event was queued on (the AEVD for notifications).
    pub fn evd_id(&self) -> u64 {
        match self {
            Event::Dto(e) => e.evd.id,
            Event::ConnRequest(e) => e.evd.id,
            Event::Connection(e) => e.evd.id,
            Event::Affiliated(e) => e.evd.id,
            Event::Unaffiliated(e) => e.evd.id,
            Event::Software(e) => e.evd.id,
            Event::AevdNotification(e) => e.aevd,
        }
    }

    /// A failed work request or a failed or ended connection.
    pub fn is_error(&self) -> bool {
        match self {
            Event::Dto(e) => e.status != DtoStatus::Success,
            Event::Connection(e) => e.kind != ConnEventKind::Established,
            Event::Affiliated(_) => true,
            _ => false,
        }
    }
}
