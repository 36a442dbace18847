//! Memory registrations and memory windows.

use super::*;

impl Context {
    /// Register the whole of `buf` (kept alive by the returned [`Mr`]): memory that stays
    /// mapped for as long as the registration exists and is only ever accessed through
    /// copies, as registered memory must be.
    pub fn reg_buf(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        buf: &Arc<RegBuf>,
        access: Access,
    ) -> Result<Arc<Mr>> {
        // SAFETY: `buf` is a mapping the Mr keeps alive until it is deregistered, and
        // RegBuf only ever reaches it through raw copies.
        unsafe { self.register(pd, buf.as_ptr(), buf.len(), access, Some(buf.clone())) }
    }

    /// Register `len` bytes at `addr` of this process. The pages are pinned until the
    /// returned [`Mr`] is dropped.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped for as long as the `Mr` exists, and must not be
    /// reached through Rust references meanwhile: the engine (for local work requests
    /// and for the peer's RDMA) reads and writes it at any time until the `Mr` is
    /// dropped (its deregistration waits for accesses in flight). Prefer
    /// [`Context::reg_buf`].
    pub unsafe fn reg_mr(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        addr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<Mr>> {
        // SAFETY: the caller's contract is ours.
        unsafe { self.register(pd, addr, len, access, None) }
    }

    /// # Safety
    ///
    /// As [`Context::reg_mr`]; `buf`, when given, is the memory and is kept alive.
    unsafe fn register(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        addr: *const u8,
        len: usize,
        access: Access,
        buf: Option<Arc<RegBuf>>,
    ) -> Result<Arc<Mr>> {
        self.here()?;
        if let Some((_, upd)) = &pd.user {
            let range = (addr as u64, len as u64);
            let (handle, mr) =
                self.mirrored(pd.dev, abi::MIRROR_MR, [pd.handle, 0, 0, 0], range, |_| {
                    // SAFETY: the caller's contract (memory mapped while the Mr lives) is the
                    // uVP's; `buf`, when given, is kept alive by the Mr.
                    unsafe { upd.reg_mr(addr as *mut u8, len, access) }
                })?;
            return Ok(Arc::new(Mr {
                ctx: self.clone(),
                handle,
                addr: range.0,
                len: range.1,
                lkey: mr.lkey(),
                rkey: mr.rkey(),
                device: Some(mr),
                _pd: pd.clone(),
                _buf: buf,
            }));
        }
        let (addr, len) = (addr as u64, len as u64);
        let mut a = abi::RegMr {
            pd: pd.handle,
            access: access.bits(),
            addr,
            length: len,
            ..Zeroable::zeroed()
        };
        // The kAL checks the memory first: pinning faults every page in, and memory it
        // refuses (a FUSE file, a userfaultfd range) could hold us there for ever.
        self.call(cmd::REG_MR, &mut a)?;
        if let Err(e) = pin::pin(addr, len) {
            self.destroy(cmd::DEREG_MR, a.handle);
            return Err(e);
        }
        Ok(Arc::new(Mr {
            ctx: self.clone(),
            handle: a.handle,
            addr,
            len,
            lkey: a.lkey,
            rkey: a.rkey,
            device: None,
            _pd: pd.clone(),
            _buf: buf,
        }))
    }

    /// Allocate a memory window in `pd` (bind it with [`Mw::bind_wqe`] on a QP of `pd`).
    /// On a device whose fast path is this process's, the uVP makes it (`Unsupported`
    /// where the device has no type-2 windows) after the kAL has recorded it.
    pub fn alloc_mw(self: &Arc<Self>, pd: &Arc<Pd>) -> Result<Arc<Mw>> {
        if let Some((_, upd)) = &pd.user {
            let (handle, mw) =
                self.mirrored(pd.dev, abi::MIRROR_MW, [pd.handle, 0, 0, 0], (0, 0), |_| {
                    upd.alloc_mw()
                })?;
            return Ok(Arc::new(Mw {
                ctx: self.clone(),
                handle,
                rkey: mw.rkey().into(),
                device: Some(mw),
                _pd: pd.clone(),
            }));
        }
        let mut a = abi::AllocMw {
            pd: pd.handle,
            ..Zeroable::zeroed()
        };
        self.call(cmd::ALLOC_MW, &mut a)?;
        Ok(Arc::new(Mw {
            ctx: self.clone(),
            handle: a.handle,
            rkey: a.rkey.into(),
            device: None,
            _pd: pd.clone(),
        }))
    }
}

/// A memory registration; unpinned and deregistered on drop.
pub struct Mr {
    ctx: Arc<Context>,
    pub handle: u32,
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    /// The uVP's registration, on a device whose fast path is the consumer's (its driver
    /// pins the pages); dropped — deregistered — before the memory.
    device: Option<Box<dyn user_half::UserMr>>,
    _pd: Arc<Pd>,
    /// The memory, when the registration owns it ([`Context::reg_buf`]); dropped after
    /// the deregistration.
    _buf: Option<Arc<RegBuf>>,
}

impl Mr {
    /// An SGE covering `[offset, offset+len)` of this registration.
    pub fn sge(&self, offset: u64, len: u32) -> rnicpi::Sge {
        rnicpi::Sge {
            addr: self.addr + offset,
            length: len,
            lkey: self.lkey,
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if self.ctx.here().is_err() {
            // The parent's registration and pins (and device registration).
            self.ctx.keep_in_fork_child(self.device.take());
            return;
        }
        self.ctx.destroy(cmd::DEREG_MR, self.handle);
        if self.device.take().is_none() {
            pin::unpin(self.addr, self.len);
        }
    }
}

/// A memory window (type 2): bound onto part of a registration by a send-queue request,
/// it gives a peer remote access to just that part, under a key that changes at each
/// bind and can be invalidated by the peer (Send with Invalidate) or locally.
pub struct Mw {
    ctx: Arc<Context>,
    pub handle: u32,
    rkey: std::sync::atomic::AtomicU32,
    /// The uVP's window, on a device whose fast path is the consumer's; deallocated after
    /// the kAL's record.
    device: Option<Box<dyn user_half::UserMw>>,
    _pd: Arc<Pd>,
}

impl Mw {
    /// The key of the latest bind (what to hand to the peer).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A `BindMw` request for `[offset, offset+len)` of `mr` with remote rights `access`
    /// (`len` 0 unbinds), under a fresh key that [`Mw::rkey`] reports from now on. Post
    /// it on a QP of the window's PD; the bind takes effect in send-queue order.
    pub fn bind_wqe(&self, wr_id: u64, mr: &Mr, offset: u64, len: u64, access: Access) -> Wqe {
        let old = self.rkey();
        let new = (old & !0xff) | (old.wrapping_add(1) & 0xff);
        self.rkey.store(new, std::sync::atomic::Ordering::Release);
        Wqe::bind_mw(wr_id, new, mr.lkey, mr.addr + offset, len, access)
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DEALLOC_MW, self.handle);
        self.ctx.keep_in_fork_child(self.device.take());
    }
}
