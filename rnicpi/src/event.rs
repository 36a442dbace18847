//! Event records: asynchronous (affiliated and unaffiliated), completion notification
//! and connection (LLP / CM) events, as the kAL demultiplexes them to consumers.

use std::net::SocketAddr;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum EventKind {
    // Affiliated asynchronous events (the handle names a QP).
    QpFatal = 1,
    QpRequestError = 2,
    QpAccessError = 3,
    CommEstablished = 4,
    SqDrained = 5,
    LastWqeReached = 6,
    // Affiliated with a CQ or SRQ.
    CqError = 10,
    SrqError = 11,
    SrqLimitReached = 12,
    // Unaffiliated.
    PortActive = 20,
    PortError = 21,
    DeviceFatal = 22,
    /// The access layer itself died (daemon gone): every resource is unusable.
    AccessLayerDead = 23,
    /// Events were dropped because the consumer's event queue was full.
    EventOverflow = 24,
    // Completion notification of an armed CQ (the handle names the CQ).
    CqNotify = 30,
    // Connection events (the handle names a listener or a QP).
    ConnectRequest = 40,
    Established = 41,
    Rejected = 42,
    Unreachable = 43,
    /// Orderly close by the peer or locally.
    Disconnected = 44,
    /// Abortive close: reset, terminate, or a dead peer.
    ConnectionBroken = 45,
}

impl EventKind {
    pub fn from_u16(v: u16) -> Option<Self> {
        use EventKind::*;
        Some(match v {
            1 => QpFatal,
            2 => QpRequestError,
            3 => QpAccessError,
            4 => CommEstablished,
            5 => SqDrained,
            6 => LastWqeReached,
            10 => CqError,
            11 => SrqError,
            12 => SrqLimitReached,
            20 => PortActive,
            21 => PortError,
            22 => DeviceFatal,
            23 => AccessLayerDead,
            24 => EventOverflow,
            30 => CqNotify,
            40 => ConnectRequest,
            41 => Established,
            42 => Rejected,
            43 => Unreachable,
            44 => Disconnected,
            45 => ConnectionBroken,
            _ => return None,
        })
    }

    pub fn is_connection(self) -> bool {
        (self as u16) >= 40
    }
}

/// One event record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    /// The consumer's handle of the affiliated object (filled in by the kAL's sink);
    /// 0 for unaffiliated events.
    pub handle: u32,
    /// Connection request identifier (ConnectRequest), to pass to accept/reject.
    pub conn_id: u64,
    /// errno-style detail (0 when none).
    pub status: i32,
    /// Negotiated or offered IRD/ORD (connection events).
    pub ird: u32,
    pub ord: u32,
    pub local: Option<SocketAddr>,
    pub peer: Option<SocketAddr>,
    pub private_data: Vec<u8>,
    /// A UD "connection" (IB SIDR, rdma_cm's UDP port space): on a `ConnectRequest`, the
    /// request wants a UD QP (the requester's QP is not known yet: 0); on `Established`,
    /// the QP and Q_Key the peer's service answers on — what rdma_cm's `param.ud` holds.
    pub ud: Option<UdPeer>,
}

/// The far end of a UD "connection".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UdPeer {
    pub qpn: u32,
    pub qkey: u32,
}

impl Event {
    pub fn new(kind: EventKind) -> Self {
        Event {
            kind,
            handle: 0,
            conn_id: 0,
            status: 0,
            ird: 0,
            ord: 0,
            local: None,
            peer: None,
            private_data: Vec::new(),
            ud: None,
        }
    }
    pub fn with_status(mut self, status: i32) -> Self {
        self.status = status;
        self
    }
    pub fn with_conn(mut self, conn_id: u64) -> Self {
        self.conn_id = conn_id;
        self
    }
    pub fn with_addrs(mut self, local: Option<SocketAddr>, peer: Option<SocketAddr>) -> Self {
        self.local = local;
        self.peer = peer;
        self
    }
    pub fn with_ud(mut self, ud: UdPeer) -> Self {
        self.ud = Some(ud);
        self
    }
    pub fn with_param(mut self, p: &crate::ConnParam) -> Self {
        self.ird = p.ird;
        self.ord = p.ord;
        self.private_data = p.private_data.clone();
        self
    }
}

/// Where a provider delivers the events of one object. The kAL hands one to the provider
/// for every object it creates, already bound to the owning context and handle.
pub trait EventSink: Send + Sync {
    fn deliver(&self, ev: Event);

    /// Offer a `ConnectRequest`: queued unless the consumer's queue already holds as
    /// many requests as it lets them take (a share of it), so requests from the network
    /// never push the consumer's other events out. False when refused; the provider then
    /// refuses the request itself (it keeps no state for it).
    fn offer_request(&self, ev: Event) -> bool {
        self.deliver(ev);
        true
    }

    /// Give a completion queue's notification through the socket bound to it when the
    /// consumer armed with [`notify::SIGNAL`](crate::queue::notify::SIGNAL); whether a
    /// byte was written. A sink with no socket (or whose socket's other end is gone)
    /// queues the `CqNotify` event instead: a notification is never lost.
    fn signal(&self) -> bool {
        self.deliver(Event::new(EventKind::CqNotify));
        false
    }
}

/// A sink that drops everything (objects nobody listens to, and tests).
#[derive(Debug, Default)]
pub struct NullSink;

impl EventSink for NullSink {
    fn deliver(&self, _ev: Event) {}
}

impl<F: Fn(Event) + Send + Sync> EventSink for F {
    fn deliver(&self, ev: Event) {
        self(ev)
    }
}
