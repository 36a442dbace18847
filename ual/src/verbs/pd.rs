//! Protection domains.

use super::*;

impl Context {
    pub fn alloc_pd(self: &Arc<Self>, dev: u32) -> Result<Arc<Pd>> {
        let mut a = abi::AllocPd { dev, handle: 0 };
        self.call(cmd::ALLOC_PD, &mut a)?;
        Ok(Arc::new(Pd {
            ctx: self.clone(),
            handle: a.handle,
            dev,
        }))
    }
}

/// A protection domain.
pub struct Pd {
    ctx: Arc<Context>,
    pub handle: u32,
    pub dev: u32,
}

impl Drop for Pd {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DEALLOC_PD, self.handle);
    }
}
