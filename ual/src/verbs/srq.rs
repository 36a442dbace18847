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
        let events = self.subscribe(a.handle);
        Ok(Arc::new(Srq {
            ctx: self.clone(),
            handle: a.handle,
            user: UserSrq::new(attr, ring),
            events,
            _pd: pd.clone(),
        }))
    }
}

/// A shared receive queue: receives posted here serve every QP attached to it.
pub struct Srq {
    ctx: Arc<Context>,
    pub handle: u32,
    user: UserSrq,
    events: Receiver<Event>,
    _pd: Arc<Pd>,
}

impl Srq {
    /// The memory of the receive ring (see [`Qp::ring_memory`]).
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.user.ring_memory()
    }

    /// Post one receive (no system call).
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        self.ctx.here()?;
        self.user.post_recv(wqe)
    }

    /// Receives posted and not yet taken by a QP.
    pub fn len(&self) -> u32 {
        self.user.len()
    }

    pub fn is_empty(&self) -> bool {
        self.user.is_empty()
    }

    /// Arm the limit: one `SrqLimitReached` event once fewer than `limit` receives are
    /// left (0 disarms).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        let mut a = abi::SrqAttrs {
            handle: self.handle,
            limit,
            ..Zeroable::zeroed()
        };
        self.ctx.call(cmd::MODIFY_SRQ, &mut a)
    }

    /// The SRQ's shape and current limit (0 once the limit event has fired).
    pub fn query(&self) -> Result<SrqAttr> {
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
    }
}
