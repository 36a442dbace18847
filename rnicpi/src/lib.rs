//! # rnicpi — the RNIC Programming Interface of krdma
//!
//! The contract between the access layers (kAL, uAL) and the verbs providers that drive
//! RDMA devices, following the RDMA verbs semantics: devices and ports, protection
//! domains, completion queues, queue pairs, memory registrations and windows, work
//! requests and completions, asynchronous and connection events.
//!
//! * [`Provider`], [`ProviderCq`], [`ProviderQp`], [`ProviderSrq`], [`ProviderListener`]:
//!   the privileged side a kernel verbs provider (kVP) implements for the kAL (shared
//!   receive queues and memory windows are optional: the defaults answer `Unsupported`).
//! * [`fastpath`]: the non-privileged side of the software providers — the consumer posts
//!   [`Wqe`]s into shared rings and polls [`Cqe`]s without a system call.
//! * [`KalServices`], [`EventSink`], [`MemoryAccess`]: what the kAL gives providers
//!   (route and neighbour lookups, LLP sockets, event delivery, pinned-memory access).
//! * [`MrTable`]: the STag/key table every software provider validates remote access with.
//! * [`wire`]: what the software providers' wire modules share — big-endian field access,
//!   `mod field` ranges, and the macros for fixed-size header views and their property tests.
//!
//! ## Writing a provider
//!
//! A provider is registered with the kAL at start-up (`kal.register(Arc::new(dev))`).
//! The kAL owns the resource tree, handles and limits; the provider owns the engine.
//! The **skeleton** below compiles and shows the shape only: it accepts resources and
//! moves no data. A real provider (see `providers/siw`) runs an engine that consumes the
//! send ring on [`ProviderQp::doorbell`], validates every remote access against its
//! [`MrTable`], and appends completions through [`EngineCq::push`].
//!
//! ```
//! use rnicpi::*;
//! use std::{any::Any, net::SocketAddr, sync::Arc};
//!
//! /// SKELETON ONLY: a device that hands out objects but has no engine behind them.
//! struct Skeleton { attr: DeviceAttr, mrs: MrTable }
//!
//! struct SkelCq(EngineCq);
//! impl ProviderCq for SkelCq {
//!     fn engine(&self) -> &EngineCq { &self.0 }
//!     fn as_any(&self) -> &dyn Any { self }
//! }
//!
//! impl Provider for Skeleton {
//!     fn attr(&self) -> &DeviceAttr { &self.attr }
//!     fn port(&self, _port: u8) -> Result<PortAttr> {
//!         Ok(PortAttr { state: PortState::Down, active_mtu: 1024, gids: vec![], netdev: "none".into() })
//!     }
//!     fn alloc_pd(&self) -> Result<u32> { Ok(1) }
//!     fn dealloc_pd(&self, _pd: u32) {}
//!     fn create_cq(&self, init: CqInit) -> Result<Arc<dyn ProviderCq>> {
//!         Ok(Arc::new(SkelCq(EngineCq::new(init.ring, init.sink, init.stats))))
//!     }
//!     fn create_qp(&self, _init: QpInit) -> Result<Arc<dyn ProviderQp>> {
//!         Err(VerbsError::Unsupported) // a real provider starts its QP engine here
//!     }
//!     fn reg_mr(&self, pd: u32, base: u64, len: u64, access: Access,
//!               mem: Arc<dyn MemoryAccess>) -> Result<Arc<Region>> {
//!         self.mrs.register(pd, base, len, access, mem)
//!     }
//!     fn dereg_mr(&self, stag: u32) -> Result<()> { self.mrs.deregister(stag) }
//!     fn connect(&self, _qp: &Arc<dyn ProviderQp>, _peer: SocketAddr, _p: ConnParam)
//!                -> Result<()> {
//!         Err(VerbsError::Unsupported) // a real provider starts its connection manager here
//!     }
//!     fn listen(&self, _a: SocketAddr, _b: u32, _s: Arc<dyn EventSink>)
//!               -> Result<Arc<dyn ProviderListener>> {
//!         Err(VerbsError::Unsupported)
//!     }
//! }
//! # let _ = Skeleton { attr: DeviceAttr { name: "skel0".into(), transport: Transport::Iwarp,
//! #   node_guid: 0, vendor_id: 0, max_qp: 0, max_qp_wr: 0, max_sge: 0, max_inline: 0,
//! #   max_cq: 0, max_cqe: 0, max_mr: 0, max_mr_size: 0, max_pd: 0, max_srq: 0, max_srq_wr: 0,
//! #   max_ird: 0, max_ord: 0, atomics: false, memory_windows: false, max_ah: 0, phys_port_cnt: 1,
//! #   private_data: PrivateDataLimits { connect: 56, accept: 196, reject: 148 },
//! #   fast_path: FastPath::Kal },
//! #   mrs: MrTable::new(16) };
//! ```

pub mod error;
pub mod event;
pub mod fastpath;
pub mod fork;
pub mod ids;
pub mod memory;
pub mod progress;
pub mod provider;
pub mod queue;
pub mod ratelimit;
pub mod sim;
pub mod soft;
pub mod types;
pub mod user;
pub mod wire;
pub mod wr;

pub use error::{Result, VerbsError};
pub use event::{Event, EventKind, EventSink, NullSink, UdPeer};
pub use fastpath::{Doorbell, EngineCq, EngineSrq, RingStats, UserCq, UserQp, UserSrq};
pub use ids::IdAllocator;
pub use memory::{AccessError, BindError, Lease, LocalMemory, MemoryAccess, MrTable, Region, Sgl};
pub use progress::{Driven, Progress, ProgressSources};
pub use provider::{
    Counter, CqInit, IfAddr, KalServices, Provider, ProviderCq, ProviderListener, ProviderQp,
    ProviderSrq, QpInit, Route, SrqInit,
};
pub use queue::{Consumer, Producer, QpRingLayout, Ring, RingCorrupt, RingMemError, SharedMem};
pub use types::*;
pub use user::FastPath;
pub use wr::*;
