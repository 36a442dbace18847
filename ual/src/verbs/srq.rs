//! Shared receive queues.

use super::*;

impl Context {
    /// Create a shared receive queue of `max_wr` receives with `max_sge` scatter entries.
    /// QPs created with [`QpConfig::srq`] take their receives from it.
    pub fn create_srq(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<Srq>> {
        if let Some((_, upd)) = &pd.user {
            let attr = SrqAttr {
                max_wr,
                max_sge,
                limit: 0,
            };
            let (handle, srq) =
                self.mirrored(pd.dev, abi::MIRROR_SRQ, [pd.handle, 0, 0, 0], (0, 0), |h| {
                    upd.create_srq(attr, self.sink(h))
                })?;
            return Ok(self.srq_object(handle, SrqPath::Device(srq), pd));
        }
        let cap = ring_capacity(max_wr).ok_or(VerbsError::Invalid)?;
        let mem = Arc::new(SharedMem::create("krdma-srq", ring_bytes::<Wqe>(cap))?);
        let mut a = abi::CreateSrq {
            pd: pd.handle,
            max_wr,
            max_sge,
            limit: 0,
            memfd: mem.fd().as_raw_fd(),
            handle: 0,
        };
        self.call(cmd::CREATE_SRQ, &mut a)?;
        let attr = SrqAttr {
            max_wr: a.max_wr,
            max_sge,
            limit: 0,
        };
        let ring = Ring::attach(mem, 0, a.max_wr)?.producer();
        let path = SrqPath::Ring(UserSrq::new(attr, ring));
        Ok(self.srq_object(a.handle, path, pd))
    }

    fn srq_object(self: &Arc<Self>, handle: u32, path: SrqPath, pd: &Arc<Pd>) -> Arc<Srq> {
        let events = self.subscribe(handle);
        Arc::new(Srq {
            ctx: self.clone(),
            handle,
            path,
            events,
            _pd: pd.clone(),
        })
    }
}

/// How receives are posted to an SRQ.
pub(super) enum SrqPath {
    /// A receive ring shared with the engine behind the kAL.
    Ring(UserSrq),
    /// The SRQ of the device's uVP in this process.
    Device(Arc<dyn user_half::UserSrq>),
}

/// A shared receive queue: receives posted here serve every QP attached to it.
pub struct Srq {
    ctx: Arc<Context>,
    pub handle: u32,
    pub(super) path: SrqPath,
    events: Receiver<Event>,
    _pd: Arc<Pd>,
}

impl Srq {
    /// The memory of the receive ring (see [`Qp::ring_memory`]); `None` on a device whose
    /// fast path is the consumer's.
    pub fn ring_memory(&self) -> Option<Arc<SharedMem>> {
        match &self.path {
            SrqPath::Ring(r) => Some(r.ring_memory()),
            SrqPath::Device(_) => None,
        }
    }

    /// Post one receive (no system call).
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        self.ctx.here()?;
        match &self.path {
            SrqPath::Ring(r) => r.post_recv(wqe),
            SrqPath::Device(d) => d.post_recv(std::slice::from_ref(wqe)),
        }
    }

    /// Receives posted and not yet taken by a QP; `None` where the device does not say
    /// (a device whose fast path is the consumer's).
    pub fn queued(&self) -> Option<u32> {
        match &self.path {
            SrqPath::Ring(r) => Some(r.len()),
            SrqPath::Device(_) => None,
        }
    }

    /// Arm the limit: one `SrqLimitReached` event once fewer than `limit` receives are
    /// left (0 disarms).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        if let SrqPath::Device(d) = &self.path {
            self.ctx.here()?;
            return d.arm(limit);
        }
        let mut a = abi::SrqAttrs {
            handle: self.handle,
            limit,
            ..Zeroable::zeroed()
        };
        self.ctx.call(cmd::MODIFY_SRQ, &mut a)
    }

    /// The SRQ's shape and current limit (0 once the limit event has fired).
    pub fn query(&self) -> Result<SrqAttr> {
        if let SrqPath::Device(d) = &self.path {
            return Ok(d.attr());
        }
        let mut a = abi::SrqAttrs {
            handle: self.handle,
            ..Zeroable::zeroed()
        };
        self.ctx.call(cmd::QUERY_SRQ, &mut a)?;
        Ok(SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            limit: a.limit,
        })
    }

    /// Events of this SRQ (`SrqLimitReached`, `SrqError`, `AccessLayerDead`).
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_SRQ, self.handle);
        if let SrqPath::Device(d) = &self.path {
            self.ctx.keep_in_fork_child(d.clone());
        }
    }
}
