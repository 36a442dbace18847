//! Remote memory regions: memory windows linked (bound) onto part of an LMR by a request
//! on an endpoint's send queue, each link under a fresh RMR context.

use crate::ep::{DtoFlags, Endpoint};
use crate::event::DtoKind;
use crate::lmr::{Lmr, MemPriv, RdmaAddr, RmrContext};
use crate::object::{object_accessors, Common, UseGuard};
use crate::pz::Pz;
use crate::status::{Error, FromVerbs, Result};
use parking_lot::Mutex;
use std::sync::Arc;

/// RMR types (`it_rmr_type_t`). krdma's windows are bound through an endpoint's send
/// queue: the narrow kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RmrType {
    Narrow = 1,
    /// Not supported (`InvalidRmrType`).
    Wide = 2,
}

/// A remote memory region (`it_rmr_create`), where the device has memory windows.
///
/// ```no_run
/// use krdma_itapi::*;
/// # fn connected_endpoint() -> Endpoint { unimplemented!() }
///
/// let ep: Endpoint = connected_endpoint();
/// let lmr = Lmr::create(ep.pz(), ual::RegBuf::new(1 << 16).unwrap(), MemPriv::LOCAL)?;
/// let rmr = Rmr::create(ep.pz(), RmrType::Narrow)?;
/// // Let the peer read the first 4 KiB only; IT_RMR_LINK_CMPL_EVENT (cookie 7) follows.
/// let target = rmr.link(&lmr, lmr.addr(), 4096, MemPriv::REMOTE_READ, &ep, 7, DtoFlags::SIGNALED)?;
/// // ... hand `target` to the peer, later:
/// rmr.unlink(&ep, 8, DtoFlags::SIGNALED)?;
/// # let _ = target;
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Rmr(pub(crate) Arc<RmrInner>);

object_accessors!(Rmr);

pub struct RmrInner {
    pz: Pz,
    mw: Arc<ual::Mw>,
    link: Mutex<Option<Link>>,
    _pz_use: UseGuard,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

/// The region an RMR is linked onto.
#[derive(Clone)]
struct Link {
    lmr: Lmr,
    addr: u64,
    len: u64,
    privs: MemPriv,
    context: RmrContext,
    _lmr_use: Arc<UseGuard>,
}

/// What [`Rmr::query`] reports (`it_rmr_param_t`).
#[derive(Debug, Clone)]
pub struct RmrParams {
    pub ia: u64,
    pub pz: u64,
    pub linked: bool,
    pub lmr: Option<u64>,
    pub addr: u64,
    pub length: u64,
    pub privs: MemPriv,
    pub rmr_context: RmrContext,
}

impl Rmr {
    pub fn create(pz: &Pz, kind: RmrType) -> Result<Rmr> {
        let ia = &pz.0.ia;
        ia.check_alive()?;
        if kind != RmrType::Narrow {
            return Err(Error::InvalidRmrType);
        }
        if !ia.rmr_support() {
            return Err(Error::OpNotSupported);
        }
        let mw = ia.0.ctx.alloc_mw(&pz.0.pd).it(Error::Resources)?;
        let inner = RmrInner {
            common: Common::new(),
            pz: pz.clone(),
            mw,
            link: Mutex::new(None),
            _pz_use: pz.0.common.use_guard(),
        };
        tracing::debug!(id = inner.common.id, "RMR created");
        Ok(Rmr(Arc::new(inner)))
    }

    /// Link the RMR onto `len` bytes at `addr` of `lmr` with the remote privileges
    /// `privs`, by a request on `ep`'s send queue (completion: `RmrLink`, with `cookie`).
    /// Returns the new target to hand to the peer; the previous context stops working.
    #[allow(clippy::too_many_arguments)]
    pub fn link(
        &self,
        lmr: &Lmr,
        addr: u64,
        len: u64,
        privs: MemPriv,
        ep: &Endpoint,
        cookie: u64,
        flags: DtoFlags,
    ) -> Result<RdmaAddr> {
        let ids = [lmr.pz().id(), ep.pz().id()];
        if ids.iter().any(|&i| i != self.0.pz.id()) {
            return Err(Error::InvalidPz);
        }
        if len == 0 {
            return Err(Error::InvalidLength);
        }
        let end = addr.checked_add(len).ok_or(Error::Range)?;
        if addr < lmr.addr() || end > lmr.addr() + lmr.len() {
            return Err(Error::Range);
        }
        let access = privs.rmr_access();
        if access.is_empty() || !access.can_bind_onto(lmr.0.access) {
            return Err(Error::InvalidPrivs);
        }
        let context = self.post(ep, lmr, addr - lmr.addr(), len, privs, cookie, flags)?;
        *self.0.link.lock() = Some(Link {
            lmr: lmr.clone(),
            addr,
            len,
            privs,
            context,
            _lmr_use: Arc::new(lmr.0.common.use_guard()),
        });
        Ok(RdmaAddr {
            addr,
            rmr_context: context,
        })
    }

    /// Unlink the RMR (its context stops working) by a request on `ep`'s send queue.
    pub fn unlink(&self, ep: &Endpoint, cookie: u64, flags: DtoFlags) -> Result<()> {
        let link = self.0.link.lock().clone().ok_or(Error::InvalidRmr)?;
        self.post(ep, &link.lmr, 0, 0, MemPriv::empty(), cookie, flags)?;
        *self.0.link.lock() = None;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        ep: &Endpoint,
        lmr: &Lmr,
        offset: u64,
        len: u64,
        privs: MemPriv,
        cookie: u64,
        flags: DtoFlags,
    ) -> Result<RmrContext> {
        let wqe = self
            .0
            .mw
            .bind_wqe(0, &lmr.0.mr, offset, len, privs.rmr_access());
        let bytes = u32::try_from(len).unwrap_or(u32::MAX);
        ep.0.post_sq(wqe, DtoKind::RmrLink, cookie, flags, bytes)?;
        tracing::debug!(rmr = self.id(), len, "RMR link posted");
        Ok(self.0.mw.rkey().into())
    }

    pub fn query(&self) -> RmrParams {
        let link = self.0.link.lock().clone();
        RmrParams {
            ia: self.0.pz.0.ia.id(),
            pz: self.0.pz.id(),
            linked: link.is_some(),
            lmr: link.as_ref().map(|l| l.lmr.id()),
            addr: link.as_ref().map_or(0, |l| l.addr),
            length: link.as_ref().map_or(0, |l| l.len),
            privs: link.as_ref().map_or(MemPriv::empty(), |l| l.privs),
            rmr_context: link.as_ref().map_or(0, |l| l.context),
        }
    }
}
