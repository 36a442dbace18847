//! Protection domains and the address handles made in them.

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

impl Pd {
    /// The context the PD belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Context {
    /// An address handle in `pd` for UD Sends to `attr`'s destination: name it in each
    /// Send with [`Ah::num`] and [`rnicpi::Wqe::with_ud`]. `Unsupported` on devices
    /// without UD QPs (`max_ah` 0). On a device whose fast path is this process's, the uVP
    /// makes it after the kAL has recorded it.
    pub fn create_ah(self: &Arc<Self>, pd: &Arc<Pd>, attr: &rnicpi::AhAttr) -> Result<Arc<Ah>> {
        if let Some((_, upd)) = &pd.user {
            let (handle, ah) =
                self.mirrored(pd.dev, abi::MIRROR_AH, [pd.handle, 0, 0, 0], (0, 0), |_| {
                    upd.create_ah(attr)
                })?;
            return Ok(Arc::new(Ah {
                ctx: self.clone(),
                handle,
                num: ah.num(),
                device: Some(ah),
                _pd: pd.clone(),
            }));
        }
        let mut a = abi::CreateAh::encode(pd.handle, attr);
        self.call(cmd::CREATE_AH, &mut a)?;
        Ok(Arc::new(Ah {
            ctx: self.clone(),
            handle: a.handle,
            num: a.ah_num,
            device: None,
            _pd: pd.clone(),
        }))
    }
}

/// An address handle: where UD Sends go. Destroyed on drop.
pub struct Ah {
    ctx: Arc<Context>,
    pub handle: u32,
    num: u32,
    /// The uVP's handle, on a device whose fast path is the consumer's; destroyed after
    /// the kAL's record.
    device: Option<Box<dyn user_half::UserAh>>,
    _pd: Arc<Pd>,
}

impl Ah {
    /// The number a UD Send names ([`rnicpi::Wqe::with_ud`]).
    pub fn num(&self) -> u32 {
        self.num
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_AH, self.handle);
        self.ctx.keep_in_fork_child(self.device.take());
    }
}
