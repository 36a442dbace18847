//! Memory: LMRs (registered local memory, named in work requests by their LMR context)
//! and RMRs (windows a peer reaches by RMR context, bound on an endpoint).

use crate::ep::Ep;
use crate::error::{Error, Major, Minor, Result};
use crate::ia::next_id;
use crate::pz::Pz;
use krdma_itapi as it;
use std::sync::Arc;

bitflags::bitflags! {
    /// Memory privileges (`DAT_MEM_PRIV_FLAGS`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct MemPriv: u32 {
        const LOCAL_READ = 0x01;
        const REMOTE_READ = 0x02;
        const LOCAL_WRITE = 0x10;
        const REMOTE_WRITE = 0x20;
        /// `DAT_IB_MEM_PRIV_REMOTE_ATOMIC` (IB extension).
        const REMOTE_ATOMIC = 0x40;
        const ALL = 0x33;
    }
}

impl MemPriv {
    /// The core's privileges: local access is always granted (the device must write
    /// received data into any LMR a receive names).
    fn core(self) -> it::MemPriv {
        let mut p = it::MemPriv::LOCAL;
        if self.contains(MemPriv::REMOTE_READ) {
            p |= it::MemPriv::REMOTE_READ;
        }
        if self.contains(MemPriv::REMOTE_WRITE) {
            p |= it::MemPriv::REMOTE_WRITE;
        }
        if self.contains(MemPriv::REMOTE_ATOMIC) {
            p |= it::MemPriv::ATOMIC;
        }
        p
    }

    /// The remote rights of a window bound with these privileges.
    fn remote(self) -> it::MemPriv {
        self.core() - it::MemPriv::LOCAL
    }
}

/// A piece of local memory for a work request (`DAT_LMR_TRIPLET`): the LMR context
/// names the LMR, the address is virtual.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LmrTriplet {
    pub lmr_context: u32,
    pub address: u64,
    pub length: u32,
}

/// A remote target (`DAT_RMR_TRIPLET`): what the peer handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RmrTriplet {
    pub rmr_context: u32,
    pub address: u64,
    pub length: u32,
}

/// A local memory region (`dat_lmr_create`).
///
/// ```
/// use krdma_dapl::{Ia, Lmr, MemPriv, Pz};
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// let lmr = Lmr::create(&pz, ual::RegBuf::new(4096).unwrap(), MemPriv::ALL)?;
/// let whole = lmr.triplet(0, 4096)?;          // for post_send / post_recv / RDMA
/// let for_peer = lmr.rmr_triplet(0, 4096)?;   // what a peer RDMA-reads or -writes
/// assert_eq!(whole.lmr_context, lmr.context());
/// # let _ = for_peer;
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Lmr(pub(crate) Arc<LmrInner>);

pub struct LmrInner {
    pub(crate) id: u64,
    pub(crate) pz: Pz,
    pub(crate) it: it::Lmr,
    context: u32,
    privs: MemPriv,
}

impl Lmr {
    /// Register the whole of `buf` (kept alive by the LMR).
    pub fn create(pz: &Pz, buf: Arc<ual::RegBuf>, privs: MemPriv) -> Result<Lmr> {
        let it = it::Lmr::create(&pz.0.it, buf, privs.core())?;
        Ok(Self::wrap(pz, it, privs))
    }

    /// Register `len` bytes of this process at `addr` (`DAT_MEM_TYPE_VIRTUAL`).
    ///
    /// # Safety
    ///
    /// The memory must stay mapped, and not be accessed through Rust references, for as
    /// long as the LMR (or an RMR bound onto it) exists: the device reads and writes it
    /// at any time, for local work requests and for the peer.
    #[allow(unsafe_code)] // the one registration of memory the crate cannot vouch for
    pub unsafe fn create_virtual(
        pz: &Pz,
        addr: *const u8,
        len: usize,
        privs: MemPriv,
    ) -> Result<Lmr> {
        if len == 0 {
            return Err(Error::of(Major::LengthError));
        }
        // SAFETY: the caller's promise is the one `create_raw` asks for.
        let it = unsafe { it::Lmr::create_raw(&pz.0.it, addr, len, privs.core()) }.map_err(
            |e| match e {
                it::Error::Fault | it::Error::Access | it::Error::Address => Error::arg(3),
                other => other.into(),
            },
        )?;
        Ok(Self::wrap(pz, it, privs))
    }

    fn wrap(pz: &Pz, it: it::Lmr, privs: MemPriv) -> Lmr {
        let ia = pz.ia();
        let context = ia.new_lmr_context();
        let inner = Arc::new(LmrInner {
            id: next_id(),
            pz: pz.clone(),
            it,
            context,
            privs,
        });
        ia.register_lmr(context, &inner);
        tracing::debug!(id = inner.id, context, len = inner.it.len(), "LMR created");
        Lmr(inner)
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    /// The LMR context local work requests name it by.
    pub fn context(&self) -> u32 {
        self.0.context
    }

    /// The RMR context a peer uses for the whole region (0 without remote privileges).
    pub fn rmr_context(&self) -> u32 {
        self.0.it.rmr_context().map_or(0, |c| c as u32)
    }

    pub fn address(&self) -> u64 {
        self.0.it.addr()
    }

    pub fn length(&self) -> u64 {
        self.0.it.len()
    }

    pub fn privileges(&self) -> MemPriv {
        self.0.privs
    }

    /// `len` bytes at `offset`, for a local work request.
    pub fn triplet(&self, offset: u64, len: u32) -> Result<LmrTriplet> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.length())
        {
            return Err(Error::new(Major::LengthError, Minor::None));
        }
        Ok(LmrTriplet {
            lmr_context: self.context(),
            address: self.address() + offset,
            length: len,
        })
    }

    /// `len` bytes at `offset`, for a peer's RDMA (needs remote privileges).
    pub fn rmr_triplet(&self, offset: u64, len: u32) -> Result<RmrTriplet> {
        let t = self.triplet(offset, len)?;
        if self.rmr_context() == 0 {
            return Err(Error::new(Major::PrivilegesViolation, Minor::None));
        }
        Ok(RmrTriplet {
            rmr_context: self.rmr_context(),
            address: t.address,
            length: t.length,
        })
    }

    /// RMRs bound onto this LMR now (it cannot be freed while there are any).
    pub fn bound_rmrs(&self) -> usize {
        self.0.it.users()
    }

    /// The registered buffer, when the LMR was created over one.
    pub fn buffer(&self) -> Option<&Arc<ual::RegBuf>> {
        self.0.it.buffer()
    }
}

impl Drop for LmrInner {
    fn drop(&mut self) {
        self.pz.ia().forget_lmr(self.context);
        tracing::debug!(id = self.id, context = self.context, "LMR freed");
    }
}

impl LmrInner {
    /// The core's segment for `t` (which must lie in this LMR).
    pub(crate) fn segment(&self, t: &LmrTriplet) -> Result<it::Segment> {
        self.it
            .segment_at(t.address, t.length as u64)
            .map_err(|_| Error::new(Major::ProtectionViolation, Minor::None))
    }
}

/// Turn a consumer's triplets into the core's segments (each must name a live LMR of
/// `pz`'s IA in `pz`).
pub(crate) fn segments(pz: &Pz, iov: &[LmrTriplet]) -> Result<Vec<it::Segment>> {
    iov.iter()
        .map(|t| {
            let lmr = pz
                .ia()
                .lmr_by_context(t.lmr_context)
                .ok_or(Error::new(Major::ProtectionViolation, Minor::None))?;
            if lmr.pz.id() != pz.id() {
                return Err(Error::new(Major::ProtectionViolation, Minor::None));
            }
            lmr.segment(t)
        })
        .collect()
}

/// A remote memory region: a window onto part of an LMR that a peer reaches by its RMR
/// context, bound and unbound by requests on an endpoint (`dat_rmr_bind`).
///
/// ```no_run
/// use krdma_dapl::*;
/// # fn connected() -> (Ep, Lmr) { unimplemented!() }
/// let (ep, lmr) = connected();
/// let rmr = Rmr::create(ep.pz())?;
/// // Let the peer read the first 4 KiB: an RMR bind completion (cookie 7) follows.
/// let ctx = rmr.bind(&lmr, lmr.triplet(0, 4096)?, MemPriv::REMOTE_READ, &ep, 7, Completion::DEFAULT)?;
/// // ... hand (ctx, address, 4096) to the peer; later, unbind:
/// rmr.unbind(&ep, 8, Completion::DEFAULT)?;
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Rmr(pub(crate) Arc<RmrInner>);

pub struct RmrInner {
    pub(crate) id: u64,
    pub(crate) pz: Pz,
    pub(crate) it: it::Rmr,
}

/// What [`Rmr::query`] reports.
#[derive(Debug, Clone)]
pub struct RmrParam {
    pub pz: u64,
    pub lmr_triplet: LmrTriplet,
    pub privileges: MemPriv,
    pub rmr_context: u32,
}

impl Rmr {
    pub fn create(pz: &Pz) -> Result<Rmr> {
        let it = it::Rmr::create(&pz.0.it, it::RmrType::Narrow).map_err(|e| match e {
            it::Error::OpNotSupported => Error::not_implemented(),
            other => other.into(),
        })?;
        Ok(Rmr(Arc::new(RmrInner {
            id: next_id(),
            pz: pz.clone(),
            it,
        })))
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    /// Bind onto `range` of `lmr` with the remote `privs`, by a request on `ep`'s send
    /// queue; returns the new RMR context (valid once the bind completes: an
    /// [`Event::RmrBind`](crate::Event::RmrBind) with `cookie`, unless suppressed).
    pub fn bind(
        &self,
        lmr: &Lmr,
        range: LmrTriplet,
        privs: MemPriv,
        ep: &Ep,
        cookie: u64,
        flags: crate::Completion,
    ) -> Result<u32> {
        if range.lmr_context != lmr.context() {
            return Err(Error::arg(3));
        }
        if range.length == 0 {
            self.unbind(ep, cookie, flags)?;
            return Ok(0);
        }
        let token = ep.0.bind_token(&self.0, cookie, flags);
        let core = ep.core();
        let r = self.0.it.link(
            &lmr.0.it,
            range.address,
            range.length as u64,
            privs.remote(),
            &core,
            token,
            it::DtoFlags::SIGNALED,
        );
        match r {
            Ok(addr) => Ok(addr.rmr_context as u32),
            Err(e) => {
                ep.0.forget_bind(token);
                Err(e.into())
            }
        }
    }

    /// Unbind (the context stops working) by a request on `ep`'s send queue.
    pub fn unbind(&self, ep: &Ep, cookie: u64, flags: crate::Completion) -> Result<()> {
        let token = ep.0.bind_token(&self.0, cookie, flags);
        self.0
            .it
            .unlink(&ep.core(), token, it::DtoFlags::SIGNALED)
            .inspect_err(|_| ep.0.forget_bind(token))
            .map_err(|e| match e {
                it::Error::InvalidRmr => Error::state(Minor::None),
                other => other.into(),
            })
    }

    pub fn query(&self) -> RmrParam {
        let q = self.0.it.query();
        RmrParam {
            pz: self.0.pz.id(),
            lmr_triplet: LmrTriplet {
                lmr_context: 0,
                address: q.addr,
                length: q.length as u32,
            },
            privileges: MemPriv::empty(),
            rmr_context: q.rmr_context as u32,
        }
    }
}
