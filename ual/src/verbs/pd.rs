//! Protection domains.

use super::*;

impl Context {
    pub fn alloc_pd(self: &Arc<Self>, dev: u32) -> Result<Arc<Pd>> {
        if let Some(udev) = self.user_device(dev)? {
            let (handle, user) =
                self.mirrored(dev, abi::MIRROR_PD, [0; 4], (0, 0), |_| udev.alloc_pd())?;
            return Ok(Arc::new(Pd {
                ctx: self.clone(),
                handle,
                dev,
                user: Some((udev, user)),
            }));
        }
        let mut a = abi::AllocPd { dev, handle: 0 };
        self.call(cmd::ALLOC_PD, &mut a)?;
        Ok(Arc::new(Pd {
            ctx: self.clone(),
            handle: a.handle,
            dev,
            user: None,
        }))
    }
}

/// A protection domain.
pub struct Pd {
    ctx: Arc<Context>,
    pub handle: u32,
    pub dev: u32,
    /// On a device whose fast path is ours: the device and the PD its uVP made.
    pub(super) user: Option<(Arc<dyn user_half::UserDevice>, Arc<dyn user_half::UserPd>)>,
}

impl Drop for Pd {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DEALLOC_PD, self.handle);
        if let Some((dev, pd)) = &self.user {
            self.ctx.keep_in_fork_child((dev.clone(), pd.clone()));
        }
    }
}
