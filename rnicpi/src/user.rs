//! The non-privileged half of the RNIC-PI: a user verbs provider (uVP) whose fast path runs
//! in the consumer's own process.
//!
//! Seed 004 splits a verbs provider in two. The privileged half ([`Provider`](crate::Provider),
//! the kVP) is what the kAL calls; for siw and rxe it also runs the engine, and the
//! consumer's end of their fast path is the generic one in [`fastpath`](crate::fastpath)
//! (shared rings and a doorbell). A hardware RNIC is different: its queues live in memory
//! the device reads, mapped into the process that created them, and posting is a write to
//! that memory plus a doorbell register. Such a device's fast path must run where the
//! consumer runs, so its provider also has this half:
//!
//! * the kAL still sees the device ([`Provider::attr`](crate::Provider::attr) names the
//!   uVP in [`FastPath::Consumer`]) and still owns the consumer's resource tree: before
//!   creating an object here the uAL records it with the kAL (`MIRROR`), which checks the
//!   per-context limits, charges the user's quotas and pin allowance, shows it in
//!   `krdma stat`, and forgets it when the object or the whole context goes (process death
//!   included; the device's own kernel driver frees what the process held);
//! * the uAL opens the device through the [`UserProvider`] the kAL named and creates the
//!   real objects through the traits below; post, poll and arm go straight to them.
//!
//! Events of such a device are demultiplexed in the consumer's process: the uVP delivers
//! completion notifications and affiliated asynchronous events of each object to the
//! [`EventSink`] the uAL gave it when creating the object (the same [`Event`]s the kAL
//! queues for a software device), from a thread of its own.
//!
//! ## The contract
//!
//! * Every method may be called from any thread; objects are shared as `Arc`s.
//! * An object's `Drop` destroys it on the device. The uAL drops children before parents
//!   (QPs before CQs and SRQs, MRs before PDs); a uVP may rely on it.
//! * `post_send`/`post_recv` validate each work request against the QP's capabilities and
//!   return `Invalid` (or `Exhausted` for a full queue) without posting the rest; they
//!   never block.
//! * `poll` never blocks and never makes a system call the hardware does not need.
//! * `arm` requests one `CqNotify` for the next (solicited) completion, delivered to the
//!   CQ's sink. A uVP whose device reports errors asynchronously maps them to the event
//!   kinds of [`EventKind`](crate::EventKind) (`QpFatal`, `QpRequestError`, `QpAccessError`,
//!   `CommEstablished`, `SqDrained`, `LastWqeReached`, `CqError`, `SrqLimitReached`, ...).
//! * Objects passed in (the CQs of a QP, its SRQ) are the same uVP's: [`UserCq::as_any`]
//!   lets the provider find its own type; another provider's object is `Invalid`.
//!
//! ## Writing a uVP
//!
//! A hardware provider has both halves: a [`Provider`](crate::Provider) the kAL registers
//! (attributes, ports, counters, `FastPath::Consumer` naming the uVP; its resource verbs
//! answer `Unsupported`), and a [`UserProvider`] the uAL finds by its driver name. The
//! **skeleton** below compiles and shows the shape only — a device with PDs and nothing
//! else; `providers/mlx` is the real one (libibverbs).
//!
//! ```
//! use rnicpi::user::*;
//! use rnicpi::{ConnParam, EventSink, Result, VerbsError};
//! use std::{net::SocketAddr, sync::Arc};
//!
//! /// SKELETON ONLY: hands out PDs and refuses everything else.
//! struct SkelProvider;
//! struct SkelDevice;
//! struct SkelPd;
//!
//! impl UserProvider for SkelProvider {
//!     fn driver(&self) -> &'static str { "skeleton" }
//!     fn open(&self, _device: &str) -> Result<Arc<dyn UserDevice>> {
//!         Ok(Arc::new(SkelDevice)) // a real uVP opens the device and maps its queues here
//!     }
//! }
//!
//! impl UserDevice for SkelDevice {
//!     fn alloc_pd(&self) -> Result<Arc<dyn UserPd>> { Ok(Arc::new(SkelPd)) }
//!     fn create_cq(&self, _depth: u32, _sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserCq>> {
//!         Err(VerbsError::Unsupported)
//!     }
//!     fn connect(&self, _qp: &Arc<dyn UserQp>, _peer: SocketAddr, _p: ConnParam) -> Result<()> {
//!         Err(VerbsError::Unsupported)
//!     }
//!     fn listen(&self, _a: SocketAddr, _b: u32, _s: Arc<dyn EventSink>)
//!               -> Result<Arc<dyn UserListener>> {
//!         Err(VerbsError::Unsupported)
//!     }
//! }
//!
//! impl UserPd for SkelPd {
//!     unsafe fn reg_mr(&self, _addr: *mut u8, _len: usize, _access: rnicpi::Access)
//!                      -> Result<Box<dyn UserMr>> {
//!         Err(VerbsError::Unsupported)
//!     }
//!     fn create_qp(&self, _init: UserQpInit) -> Result<Arc<dyn UserQp>> {
//!         Err(VerbsError::Unsupported)
//!     }
//! }
//!
//! let dev = SkelProvider.open("skel0").unwrap();
//! assert!(dev.alloc_pd().is_ok());
//! ```

use crate::error::Result;
use crate::event::EventSink;
use crate::types::{
    Access, AhAttr, ConnParam, QpAttr, QpAttrMask, QpCaps, QpState, QpType, SrqAttr,
};
use crate::wr::{Cqe, Wqe};
use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;

/// Where a device's fast path runs, as the kAL reports it in the device's attributes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum FastPath {
    /// Shared rings and a doorbell to an engine behind the kAL (siw, rxe).
    #[default]
    Kal,
    /// In the consumer's process, through user verbs provider `driver`, which knows the
    /// device as `device` (e.g. driver `ibverbs`, device `mlx5_0`).
    Consumer { driver: String, device: String },
    /// Either: the kAL serves shared rings to its engine, and a consumer may instead run
    /// the same engine in its own process through user verbs provider `driver` (a
    /// software device whose wire is a socket the consumer can open itself: siw). The
    /// consumer chooses per context; objects it makes itself are mirrored as for
    /// [`FastPath::Consumer`].
    Either { driver: String, device: String },
}

impl FastPath {
    /// The uVP that can drive the device in the consumer's process, and its name for it.
    pub fn user_provider(&self) -> Option<(&str, &str)> {
        match self {
            FastPath::Kal => None,
            FastPath::Consumer { driver, device } | FastPath::Either { driver, device } => {
                Some((driver, device))
            }
        }
    }
}

/// A user verbs provider: how a consumer process opens the devices it drives.
pub trait UserProvider: Send + Sync {
    /// The driver name the kAL reports in [`FastPath::Consumer`].
    fn driver(&self) -> &'static str;
    /// Open `device` in this process.
    fn open(&self, device: &str) -> Result<Arc<dyn UserDevice>>;
}

/// An open device in the consumer's process.
pub trait UserDevice: Send + Sync {
    fn alloc_pd(&self) -> Result<Arc<dyn UserPd>>;
    /// A CQ of at least `depth` entries; notifications and CQ errors go to `sink`.
    fn create_cq(&self, depth: u32, sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserCq>>;
    /// [`UserDevice::create_cq`] with a signal socket (one end of a Unix stream socket
    /// pair) for [`UserCq::arm_to_signal`]; a device that cannot write one makes a plain
    /// CQ (its [`UserCq::can_signal`] says so).
    fn create_cq_signalled(
        &self,
        depth: u32,
        sink: Arc<dyn EventSink>,
        signal: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<Arc<dyn UserCq>> {
        let _ = signal;
        self.create_cq(depth, sink)
    }
    /// Active connection setup of `qp` (in state Reset or Init) with `peer`: the device's
    /// connection manager brings the QP to RTS and delivers `Established`, `Rejected` or
    /// `Unreachable` to the QP's sink, later `Disconnected` or `ConnectionBroken`.
    fn connect(&self, qp: &Arc<dyn UserQp>, peer: SocketAddr, param: ConnParam) -> Result<()>;
    /// The device's counters as this process's half counts them (name, value), as
    /// `krdma stat` shows a kAL device's; none where the device keeps its own.
    fn counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// Listen on `addr` (port 0 picks one); `ConnectRequest`s go to `sink`.
    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn UserListener>>;
}

/// A listening endpoint of a consumer-side connection manager; dropping it stops listening
/// (and rejects the requests not yet answered).
pub trait UserListener: Send + Sync {
    fn local_addr(&self) -> SocketAddr;
    /// Accept request `conn_id` (from its `ConnectRequest` event) on `qp`; `Established`
    /// follows on the QP's sink.
    fn accept(&self, conn_id: u64, qp: &Arc<dyn UserQp>, param: ConnParam) -> Result<()>;
    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()>;
}

/// A protection domain and what is created in it.
pub trait UserPd: Send + Sync {
    /// Register `len` bytes at `addr` of this process.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped while the returned registration exists; the device
    /// reads and writes it at any time until then.
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<Box<dyn UserMr>>;
    fn create_qp(&self, init: UserQpInit) -> Result<Arc<dyn UserQp>>;
    /// SRQ limit events go to `sink`.
    fn create_srq(&self, attr: SrqAttr, sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserSrq>> {
        let _ = (attr, sink);
        Err(crate::VerbsError::Unsupported)
    }
    /// A memory window (type 2) in this PD, for devices whose attributes report
    /// `memory_windows`. It is bound by posting a [`WrOpcode::BindMw`](crate::WrOpcode)
    /// request on a QP of this PD (its new key: the window's index with a fresh key
    /// byte, see [`Wqe::bind_mw`]) and invalidated by `LocalInv` of its key or by the
    /// peer's `SendWithInv`.
    fn alloc_mw(&self) -> Result<Box<dyn UserMw>> {
        Err(crate::VerbsError::Unsupported)
    }
    /// An address handle in this PD, for devices whose attributes report `max_ah > 0`;
    /// UD Sends of this PD's QPs name it by [`UserAh::num`] ([`Wqe::with_ud`]).
    fn create_ah(&self, attr: &AhAttr) -> Result<Box<dyn UserAh>> {
        let _ = attr;
        Err(crate::VerbsError::Unsupported)
    }
}

/// What a QP is created with.
pub struct UserQpInit {
    pub qp_type: QpType,
    pub caps: QpCaps,
    pub send_cq: Arc<dyn UserCq>,
    pub recv_cq: Arc<dyn UserCq>,
    pub srq: Option<Arc<dyn UserSrq>>,
    /// Affiliated asynchronous events of the QP.
    pub sink: Arc<dyn EventSink>,
}

/// A memory registration; dropping it deregisters.
pub trait UserMr: Send + Sync {
    fn lkey(&self) -> u32;
    fn rkey(&self) -> u32;
}

/// A memory window (type 2); dropping it deallocates it.
pub trait UserMw: Send + Sync {
    /// The window's key as of the latest bind posted through the uVP (at first the key
    /// the device gave it): its index in the upper 24 bits, the key byte in the lower 8.
    fn rkey(&self) -> u32;
}

/// An address handle; dropping it destroys it.
pub trait UserAh: Send + Sync {
    /// The number a UD Send names ([`Wqe::with_ud`]), unique in its PD.
    fn num(&self) -> u32;
}

pub trait UserCq: Send + Sync {
    /// Take up to `out.len()` completions.
    fn poll(&self, out: &mut [Cqe]) -> usize;
    /// Ask for one `CqNotify` on the next (solicited) completion.
    fn arm(&self, solicited_only: bool) -> Result<()>;
    /// Whether a thread polling an empty CQ moves the device's work on (a software
    /// engine run by its pollers) or only waits for it (hardware works by itself). Both
    /// make polling for a while before sleeping worth it (the uAL's `Cq::wait`).
    fn worth_spinning(&self) -> bool {
        true
    }
    /// Whether [`UserCq::arm_to_sleep`] and [`UserCq::sleep`] work: a completion wakes a
    /// sleeping thread without a `CqNotify` event. Otherwise sleepers wait for the event.
    fn can_sleep(&self) -> bool {
        false
    }
    /// Arm so that the next (solicited) completion wakes the threads in
    /// [`UserCq::sleep`]; returns the token `sleep` takes.
    fn arm_to_sleep(&self, solicited_only: bool) -> u32 {
        let _ = self.arm(solicited_only);
        0
    }
    /// Sleep until the completion armed for by [`UserCq::arm_to_sleep`] (which returned
    /// `armed`), [`UserCq::wake_sleepers`] or `timeout`.
    fn sleep(&self, armed: u32, timeout: std::time::Duration) {
        let _ = (armed, timeout);
    }
    /// End the sleep of the threads in [`UserCq::sleep`].
    fn wake_sleepers(&self) {}
    /// Whether the CQ has a signal socket it can write ([`UserDevice::create_cq_signalled`]).
    fn can_signal(&self) -> bool {
        false
    }
    /// Arm so that the next (solicited) completion writes a byte to the signal socket
    /// instead of making a `CqNotify` event (only where [`UserCq::can_signal`]).
    fn arm_to_signal(&self, solicited_only: bool) {
        let _ = self.arm(solicited_only);
    }
    /// How many bytes the CQ has written to its signal socket so far.
    fn signals_given(&self) -> u32 {
        0
    }
    fn as_any(&self) -> &dyn Any;
}

pub trait UserQp: Send + Sync {
    fn qp_num(&self) -> u32;
    /// The capabilities the device granted (at least those asked for).
    fn caps(&self) -> QpCaps;
    fn post_send(&self, wqes: &[Wqe]) -> Result<()>;
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()>;
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()>;
    fn state(&self) -> Result<QpState>;
    /// Close the connection set up by [`UserDevice::connect`] or [`UserListener::accept`].
    fn disconnect(&self, abortive: bool) -> Result<()>;
    fn as_any(&self) -> &dyn Any;
}

pub trait UserSrq: Send + Sync {
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()>;
    /// Arm the limit event (`SrqLimitReached` when fewer than `limit` receives are posted).
    fn arm(&self, limit: u32) -> Result<()>;
    fn attr(&self) -> SrqAttr;
    fn as_any(&self) -> &dyn Any;
}
