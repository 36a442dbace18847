//! The resource half every software RNIC shares: protection domains, completion queues
//! and shared receive queues over the shared rings, and the key table of registrations
//! and windows. A software provider holds one [`SoftResources`], answers the resource
//! verbs of [`Provider`](crate::Provider) from it with [`soft_resources!`](crate::soft_resources),
//! builds each queue pair on a [`QpBase`] (its rings, CQs, SRQ, sink, and the receive
//! and flush handling that does not depend on the transport), and writes only what is
//! its own: the QPs' transport, connections and ports.

use crate::fastpath::{EngineCq, EngineSrq};
use crate::ids::IdAllocator;
use crate::memory::MrTable;
use crate::provider::{CqInit, ProviderCq, ProviderSrq, QpInit, SrqInit};
use crate::{Counter, QpType, Result, VerbsError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

mod qp;
pub use qp::QpBase;

/// Tells apart the instances of software devices on the host.
static INSTANCES: AtomicU64 = AtomicU64::new(1);

/// PDs, CQs, SRQs and the key table of one software device.
pub struct SoftResources {
    /// Registrations and windows: every local and remote memory access is checked here.
    pub mrs: MrTable,
    pds: IdAllocator,
    /// This device instance, stamped on its CQs and SRQs.
    owner: u64,
}

impl SoftResources {
    /// Resources for a device that allows `max_mr` registrations.
    pub fn new(max_mr: u32) -> SoftResources {
        SoftResources {
            mrs: MrTable::new(max_mr),
            pds: IdAllocator::default(),
            owner: INSTANCES.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A PD number that is not live (PDs keep tenants' registrations apart).
    pub fn alloc_pd(&self) -> Result<u32> {
        self.pds.alloc().ok_or(VerbsError::Exhausted)
    }

    /// Whether protection domain `pd` is allocated.
    pub fn pd_live(&self, pd: u32) -> bool {
        self.pds.contains(pd)
    }

    pub fn dealloc_pd(&self, pd: u32) {
        self.pds.free(pd);
    }

    pub fn create_cq(&self, init: CqInit) -> Arc<dyn ProviderCq> {
        Arc::new(SoftCq {
            owner: self.owner,
            engine: EngineCq::new(init.ring, init.sink, init.stats),
        })
    }

    pub fn create_srq(&self, init: SrqInit) -> Arc<dyn ProviderSrq> {
        Arc::new(SoftSrq {
            owner: self.owner,
            engine: EngineSrq::new(init.pd, init.attr, init.rq, init.sink, init.stats),
        })
    }

    /// A software device makes QPs of the service types its transport has (`types`):
    /// `Unsupported` for others. A QP may only use this device's own CQs, and an SRQ of
    /// its own PD.
    pub fn check_qp_init(&self, init: &QpInit, types: &[QpType]) -> Result<()> {
        if !types.contains(&init.qp_type) {
            return Err(VerbsError::Unsupported);
        }
        let ours_cq = |cq: &Arc<dyn ProviderCq>| {
            cq.as_any()
                .downcast_ref::<SoftCq>()
                .is_some_and(|c| c.owner == self.owner)
        };
        if !ours_cq(&init.send_cq) || !ours_cq(&init.recv_cq) {
            return Err(VerbsError::Invalid);
        }
        if let Some(srq) = &init.srq {
            let ours = srq
                .as_any()
                .downcast_ref::<SoftSrq>()
                .is_some_and(|s| s.owner == self.owner);
            if !ours || srq.engine().pd != init.pd {
                return Err(VerbsError::Invalid);
            }
        }
        Ok(())
    }

    /// The key table's gauges, for a provider's counter list.
    pub fn counters(&self) -> [Counter; 2] {
        [
            ("mrs_live", self.mrs.live() as u64),
            ("mws_live", self.mrs.windows() as u64),
        ]
    }
}

/// A completion queue of a software device.
pub struct SoftCq {
    owner: u64,
    engine: EngineCq,
}

impl ProviderCq for SoftCq {
    fn engine(&self) -> &EngineCq {
        &self.engine
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A shared receive queue of a software device.
pub struct SoftSrq {
    owner: u64,
    engine: EngineSrq,
}

impl ProviderSrq for SoftSrq {
    fn engine(&self) -> &EngineSrq {
        &self.engine
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Inside `impl Provider for ...`: the PD, CQ, SRQ, MR and MW verbs answered from the
/// [`SoftResources`] at `$res` (a path from `self`, e.g. `shared.res`).
#[macro_export]
macro_rules! soft_resources {
    ($($res:ident).+) => {
        fn alloc_pd(&self) -> $crate::Result<u32> {
            self.$($res).+.alloc_pd()
        }
        fn dealloc_pd(&self, pd: u32) {
            self.$($res).+.dealloc_pd(pd)
        }
        fn create_cq(
            &self,
            init: $crate::CqInit,
        ) -> $crate::Result<std::sync::Arc<dyn $crate::ProviderCq>> {
            Ok(self.$($res).+.create_cq(init))
        }
        fn create_srq(
            &self,
            init: $crate::SrqInit,
        ) -> $crate::Result<std::sync::Arc<dyn $crate::ProviderSrq>> {
            Ok(self.$($res).+.create_srq(init))
        }
        fn alloc_mw(&self, pd: u32) -> $crate::Result<u32> {
            self.$($res).+.mrs.alloc_window(pd)
        }
        fn dealloc_mw(&self, key: u32) -> $crate::Result<()> {
            self.$($res).+.mrs.dealloc_window(key)
        }
        fn reg_mr(
            &self,
            pd: u32,
            base: u64,
            len: u64,
            access: $crate::Access,
            mem: std::sync::Arc<dyn $crate::MemoryAccess>,
        ) -> $crate::Result<std::sync::Arc<$crate::Region>> {
            self.$($res).+.mrs.register(pd, base, len, access, mem)
        }
        fn dereg_mr(&self, stag: u32) -> $crate::Result<()> {
            self.$($res).+.mrs.deregister(stag)
        }
    };
}
