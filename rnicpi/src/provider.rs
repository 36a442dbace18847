//! The provider traits: the privileged side a kernel verbs provider (kVP) implements for
//! the kAL, and the services (upcalls) the kAL offers providers in return.
//!
//! The non-privileged side (post, poll, arm) of the software providers is the shared-ring
//! fast path in [`crate::fastpath`]; it needs no per-provider code because every soft
//! engine reads the same [`Wqe`](crate::Wqe) and writes the same [`Cqe`](crate::Cqe).
//!
//! # The provider contract
//!
//! **Events.** A provider reports through the [`EventSink`] it was given for each object
//! (`deliver` never blocks: the kAL queues, bounded per context). What a consumer of any
//! device may count on (the conformance suite, `tests/tests/conformance.rs`, checks it):
//!
//! | when | event, on whose sink | status | the QP |
//! |---|---|---|---|
//! | a connection request arrives | `ConnectRequest`, listener (with `conn_id`, IRD/ORD, private data) | 0 | — |
//! | active connect or accept completes | `Established`, QP (peer's private data) | 0 | RTS |
//! | the peer's consumer rejects | `Rejected`, QP (its private data) | `ECONNREFUSED` | Error |
//! | nobody listens, no route, no answer | `Unreachable`, QP | errno (`ECONNREFUSED`, `ETIMEDOUT`, ...) | Error |
//! | orderly close, by either side | `Disconnected`, QP, once | 0 | Error, flushed |
//! | abortive close, reset, Terminate, peer gone (retries exhausted) | `ConnectionBroken`, QP, once | errno (`ETIMEDOUT` for a dead peer) | Error, flushed |
//! | the peer broke a rule at our responder | `QpAccessError` / `QpRequestError`, QP | `EIO` | Error, flushed |
//! | a local fatal error (completion lost to a full CQ, corrupt ring) | `QpFatal`, QP | errno | Error, flushed |
//! | a QP on an SRQ reaches Error | `LastWqeReached`, QP | 0 | — |
//! | a completion on an armed CQ (solicited-only: a solicited or failed one) | `CqNotify`, CQ, once per arm | 0 | — |
//! | an SRQ falls below its armed limit | `SrqLimitReached`, SRQ, once per arm | 0 | — |
//!
//! **Who flushes.** The provider, when a QP enters Error for any reason: every send-queue
//! request completes, in posting order, with its own status or `WrFlushErr` (an
//! unsignaled request that succeeded stays silent); every posted receive completes with
//! `WrFlushErr`; receives on an SRQ stay on the SRQ (`LastWqeReached` says the QP is done
//! with it). Nothing completes twice, and nothing is placed in consumer memory after the
//! QP left RTS/RTR.
//!
//! **Concurrency.** Every method may be called from any thread, concurrently with the
//! others and with the provider's own threads: control calls come from the consumer's
//! thread (embedded) or the daemon's FUSE workers, `doorbell` from the consumer's thread or
//! the context's doorbell thread, events and completions leave from the provider's threads.
//! No method may block on what a tenant or a remote peer controls (see
//! [`ProviderQp::doorbell`]); `destroy` and `close` are idempotent and may race with
//! traffic and with the peer's own teardown.
//!
//! **Limits from the wire.** Private-data sizes ([`DeviceAttr::private_data`]), path MTU
//! ([`PortAttr::active_mtu`]) and the device limits are the provider's to report; no layer
//! above hard-codes a transport's numbers.

use crate::error::Result;
use crate::event::EventSink;
use crate::fastpath::{EngineCq, EngineSrq, RingStats};
use crate::memory::{MemoryAccess, Region};
use crate::queue::{Consumer, Producer};
use crate::types::{
    Access, AhAttr, ConnParam, DeviceAttr, PortAttr, QpAttr, QpAttrMask, QpCaps, QpType, SrqAttr,
};
use crate::wr::{Cqe, Wqe};
use std::any::Any;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// A named counter value, for `krdma stat`.
pub type Counter = (&'static str, u64);

/// A provider's counters: a struct of `AtomicU64` fields, each reported under its own
/// name by `rows()` (so a counter's name in `krdma stat` is its field's name).
///
/// ```
/// rnicpi::counters!(pub struct Counters {
///     /// Packets sent.
///     tx_packets,
///     rx_packets,
/// });
/// let c = Counters::default();
/// c.tx_packets.fetch_add(2, std::sync::atomic::Ordering::Relaxed);
/// assert_eq!(c.rows(), vec![("tx_packets", 2), ("rx_packets", 0)]);
/// ```
#[macro_export]
macro_rules! counters {
    ($(#[$sm:meta])* $vis:vis struct $name:ident { $($(#[$m:meta])* $field:ident),* $(,)? }) => {
        $(#[$sm])*
        #[derive(Debug, Default)]
        $vis struct $name {
            $($(#[$m])* pub $field: std::sync::atomic::AtomicU64,)*
        }

        impl $name {
            /// Every counter with its name.
            pub fn rows(&self) -> Vec<$crate::Counter> {
                vec![$((
                    stringify!($field),
                    self.$field.load(std::sync::atomic::Ordering::Relaxed),
                ),)*]
            }
        }
    };
}

/// What a provider needs to build a completion queue.
pub struct CqInit {
    /// Granted depth (a power of two).
    pub depth: u32,
    /// The engine's end of the shared completion ring.
    pub ring: Producer<Cqe>,
    /// Receives `CqNotify` and `CqError` for this CQ.
    pub sink: Arc<dyn EventSink>,
    /// Where lost completions and a corrupt ring are counted.
    pub stats: Arc<RingStats>,
}

/// What a provider needs to build a queue pair.
pub struct QpInit {
    pub qp_type: QpType,
    /// The provider's protection-domain number (from [`Provider::alloc_pd`]).
    pub pd: u32,
    pub send_cq: Arc<dyn ProviderCq>,
    pub recv_cq: Arc<dyn ProviderCq>,
    /// Granted sizes (the kAL has already clamped them to the device limits).
    pub caps: QpCaps,
    /// The engine's end of the shared send ring.
    pub sq: Consumer<Wqe>,
    /// The engine's end of the shared receive ring (unused when `srq` is set).
    pub rq: Consumer<Wqe>,
    /// The shared receive queue the QP takes its receives from, if any.
    pub srq: Option<Arc<dyn ProviderSrq>>,
    /// Receives affiliated asynchronous and connection events of this QP.
    pub sink: Arc<dyn EventSink>,
    /// Where a corrupt ring and a spent drain budget are counted.
    pub stats: Arc<RingStats>,
}

/// What a provider needs to build a shared receive queue.
pub struct SrqInit {
    /// The provider's protection-domain number.
    pub pd: u32,
    /// Granted shape (`max_wr` is the ring's capacity, a power of two).
    pub attr: SrqAttr,
    /// The engine's end of the shared receive ring.
    pub rq: Consumer<Wqe>,
    /// Receives `SrqLimitReached` and `SrqError` for this SRQ.
    pub sink: Arc<dyn EventSink>,
    /// Where dropped entries and a corrupt ring are counted.
    pub stats: Arc<RingStats>,
}

/// A verbs device as the kAL drives it (the privileged RNIC-PI).
pub trait Provider: Send + Sync + 'static {
    /// Static attributes (Query RNIC).
    fn attr(&self) -> &DeviceAttr;
    /// Port attributes (Query Port); ports are numbered from 1.
    fn port(&self, port: u8) -> Result<PortAttr>;
    /// Device-wide counters.
    fn counters(&self) -> Vec<Counter> {
        Vec::new()
    }

    /// Allocate a protection domain; returns the provider's PD number.
    fn alloc_pd(&self) -> Result<u32>;
    fn dealloc_pd(&self, pd: u32);

    fn create_cq(&self, init: CqInit) -> Result<Arc<dyn ProviderCq>>;
    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn ProviderQp>>;

    /// Create a shared receive queue (devices with `max_srq > 0`).
    fn create_srq(&self, _init: SrqInit) -> Result<Arc<dyn ProviderSrq>> {
        Err(crate::VerbsError::Unsupported)
    }

    /// Allocate a memory window (type 2: bound through a `BindMw` send-queue request) in
    /// protection domain `pd`; returns its initial key. Devices with `memory_windows`.
    fn alloc_mw(&self, _pd: u32) -> Result<u32> {
        Err(crate::VerbsError::Unsupported)
    }
    fn dealloc_mw(&self, _key: u32) -> Result<()> {
        Err(crate::VerbsError::Unsupported)
    }

    /// Create an address handle in protection domain `pd` (devices with `max_ah > 0`);
    /// returns its number, which UD Sends of QPs in `pd` name ([`Wqe::with_ud`]). The
    /// address is checked here (a source GID the port has, a destination it can reach).
    fn create_ah(&self, _pd: u32, _attr: &AhAttr) -> Result<u32> {
        Err(crate::VerbsError::Unsupported)
    }
    fn destroy_ah(&self, _ah: u32) -> Result<()> {
        Err(crate::VerbsError::Unsupported)
    }

    /// Register `[base, base+len)` of a consumer's memory, already pinned by the kAL and
    /// reachable through `mem`. Returns the registration with its STag/lkey/rkey.
    fn reg_mr(
        &self,
        pd: u32,
        base: u64,
        len: u64,
        access: Access,
        mem: Arc<dyn MemoryAccess>,
    ) -> Result<Arc<Region>>;
    fn dereg_mr(&self, stag: u32) -> Result<()>;

    /// Threads the provider runs for each connection (a connected QP, or one being set
    /// up): the kAL charges them to the user's thread quota.
    fn threads_per_connection(&self) -> u32 {
        0
    }

    /// Connect `qp`, one of this device's QPs, to a listener at `peer` (iWARP: TCP and
    /// MPA; IB: a CM REQ) with the consumer's parameters — the active half of what
    /// [`ProviderListener::accept`] is the passive half of; neither is the QP's business.
    /// The outcome arrives on the QP's sink as `Established`, `Rejected` or
    /// `Unreachable`. A QP of another device is refused (`Invalid`), and so is one
    /// already connected or connecting, or in a state it cannot connect from (`BadState`).
    fn connect(&self, qp: &Arc<dyn ProviderQp>, peer: SocketAddr, param: ConnParam) -> Result<()>;

    /// Listen for connection requests on `addr`. `ConnectRequest` events go to `sink`.
    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn ProviderListener>>;
}

/// A completion queue created by a provider.
pub trait ProviderCq: Send + Sync + 'static {
    /// The engine's end of the ring, for QPs of the same provider.
    fn engine(&self) -> &EngineCq;
    fn as_any(&self) -> &dyn Any;
    /// Tear down (idempotent).
    fn destroy(&self) {}
}

/// A shared receive queue created by a provider.
pub trait ProviderSrq: Send + Sync + 'static {
    /// The engine's end of the ring, for QPs of the same provider.
    fn engine(&self) -> &EngineSrq;
    fn as_any(&self) -> &dyn Any;
    /// Tear down (idempotent). QPs still attached have been destroyed by the kAL first.
    fn destroy(&self) {}
}

/// A queue pair created by a provider.
pub trait ProviderQp: Send + Sync + 'static {
    fn qp_num(&self) -> u32;
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()>;
    fn query(&self) -> QpAttr;
    /// The consumer added entries to the send or receive ring.
    ///
    /// Called in the consumer's own thread (embedded mode) or on the kAL's doorbell
    /// thread of the consumer's context (daemon mode). The contract:
    ///
    /// * it **must not block on anything a tenant or a remote peer controls**: no
    ///   blocking socket write (a peer that stops reading), no wait for another QP's
    ///   lock held across such I/O, no unbounded wait for consumer memory that another
    ///   tenant's thread may hold;
    /// * its work is **bounded** whatever the rings say: at most a ring's capacity of
    ///   entries taken (local operations such as `LocalInv` and `BindMw` included), the
    ///   rest handed to the provider's own engine thread;
    /// * a ring whose indices make no sense moves the QP to Error with an affiliated
    ///   event and a counter ([`RingStats`]), never a loop.
    ///
    /// A provider may transmit a little inline (lower latency) as long as that transmit
    /// cannot block: a non-blocking send that hands the rest to its engine thread on
    /// `EAGAIN`.
    fn doorbell(&self);
    /// [`ProviderQp::doorbell`], called by the kAL's doorbell thread of the QP's context,
    /// which holds no lock of the consumer's. There a provider may also do, bounded, the
    /// device work its post has just made ready — rxe takes what its datagrams to this
    /// host have already put on its own socket, as kernel rxe's receive runs in the
    /// sending context, instead of leaving a wake-up of its receive thread on the
    /// message's path. The same contract as `doorbell`; by default only that.
    fn doorbell_on_thread(&self) {
        self.doorbell();
    }
    /// Close the connection: orderly (flush, then `Disconnected`) or abortive.
    fn disconnect(&self, abortive: bool) -> Result<()>;
    /// Tear down: flush outstanding work, tell the peer, free everything (idempotent).
    fn destroy(&self);
    fn counters(&self) -> Vec<Counter> {
        Vec::new()
    }
    fn as_any(&self) -> &dyn Any;
}

/// A listening endpoint created by a provider.
pub trait ProviderListener: Send + Sync + 'static {
    fn local_addr(&self) -> SocketAddr;
    /// Accept connection request `conn_id` onto `qp` with our parameters.
    fn accept(&self, conn_id: u64, qp: &Arc<dyn ProviderQp>, param: ConnParam) -> Result<()>;
    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()>;
    /// Stop listening and refuse pending requests (idempotent).
    fn close(&self);
}

/// A route to a peer, from the host's own routing tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Source address the host would use.
    pub source: IpAddr,
    /// Outgoing interface name.
    pub ifname: String,
    /// Link MTU of that interface.
    pub mtu: u32,
}

/// One address of a host interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfAddr {
    pub ifname: String,
    pub addr: IpAddr,
}

/// Services the kAL offers providers (the RNIC-PI upcalls). Pinning is not here: the kAL
/// pins consumer memory before it calls [`Provider::reg_mr`] and hands the provider the
/// accessor, as the RNIC-PI separates registration from pinning.
pub trait KalServices: Send + Sync + 'static {
    /// Route lookup for `peer` through the host's tables.
    fn route(&self, peer: IpAddr) -> Result<Route>;
    /// Link-layer neighbour (ARP/ND) entry of `ip`, when the host knows it.
    fn neighbour(&self, ip: IpAddr) -> Option<[u8; 6]>;
    /// Every IPv4 and IPv6 address of every host interface (a device's GIDs, or the
    /// addresses it listens on, come from here).
    fn addresses(&self) -> Vec<IfAddr>;
    /// The link MTU of interface `ifname`.
    fn link_mtu(&self, ifname: &str) -> Option<u32>;
    /// Start an LLP (TCP) connection for an iWARP provider without waiting for it: the
    /// stream is non-blocking and its connect may still be under way (writable once it
    /// ends; `take_error` says how). A provider's connection manager never blocks on a
    /// peer.
    fn tcp_connect_start(&self, peer: SocketAddr) -> Result<std::net::TcpStream>;
    /// Listen on an LLP (TCP) address for an iWARP provider.
    fn tcp_listen(&self, addr: SocketAddr, backlog: u32) -> Result<std::net::TcpListener>;
}
