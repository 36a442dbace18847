//! Local memory regions: consumer memory registered in a protection zone, the
//! segments (`it_lmr_triplet_t`) work requests name, and the RMR context a peer needs.

use crate::object::{object_accessors, Common, UseGuard};
use crate::pz::Pz;
use crate::status::{Error, FromVerbs, Result};
use rnicpi::{Access, Sge};
use std::sync::Arc;
use ual::RegBuf;

bitflags::bitflags! {
    /// Memory privileges (`it_mem_priv_t`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct MemPriv: u32 {
        const LOCAL_READ = 0x01;
        const LOCAL_WRITE = 0x02;
        const REMOTE_READ = 0x04;
        const REMOTE_WRITE = 0x08;
        const ATOMIC = 0x10;
        const LOCAL = 0x03;
        const REMOTE = 0x0c;
        const ALL = 0x1f;
    }
}

impl MemPriv {
    /// The verbs access rights of a registration with these privileges. Remote write and
    /// atomics imply local write (a verbs rule IT-API does not have); `mw_bind` lets RMRs
    /// be linked onto the region.
    pub(crate) fn lmr_access(self, mw_bind: bool) -> Access {
        let mut a = Access::empty();
        if self.intersects(MemPriv::LOCAL_WRITE | MemPriv::REMOTE_WRITE | MemPriv::ATOMIC) {
            a |= Access::LOCAL_WRITE;
        }
        if self.contains(MemPriv::REMOTE_READ) {
            a |= Access::REMOTE_READ;
        }
        if self.contains(MemPriv::REMOTE_WRITE) {
            a |= Access::REMOTE_WRITE;
        }
        if self.contains(MemPriv::ATOMIC) {
            a |= Access::REMOTE_ATOMIC;
        }
        if mw_bind {
            a |= Access::MW_BIND;
        }
        a
    }

    /// The remote rights an RMR with these privileges grants.
    pub(crate) fn rmr_access(self) -> Access {
        self.lmr_access(false) & Access::WINDOW
    }
}

/// What a peer needs to address memory remotely (`it_rmr_context_t`): the key in the
/// low 32 bits.
pub type RmrContext = u64;

/// A remote target of an RDMA Read or Write: an address (absolute) and the RMR context
/// covering it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaAddr {
    pub addr: u64,
    pub rmr_context: RmrContext,
}

impl RdmaAddr {
    /// 20 bytes, big-endian: address, context (low 32 bits), length — a convenient form to
    /// send in private data or a message.
    pub fn encode(&self, len: u64) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&(self.rmr_context as u32).to_be_bytes());
        b[12..].copy_from_slice(&len.to_be_bytes());
        b
    }

    /// The inverse of [`encode`](Self::encode): target and length.
    pub fn decode(b: &[u8]) -> Option<(RdmaAddr, u64)> {
        let b: &[u8; 20] = b.get(..20)?.try_into().ok()?;
        let addr = u64::from_be_bytes(b[..8].try_into().ok()?);
        let ctx = u32::from_be_bytes(b[8..12].try_into().ok()?);
        let len = u64::from_be_bytes(b[12..].try_into().ok()?);
        Some((
            RdmaAddr {
                addr,
                rmr_context: ctx.into(),
            },
            len,
        ))
    }

    /// The key the wire carries; `InvalidRmr` for a context no krdma region produced.
    pub(crate) fn rkey(&self) -> Result<u32> {
        u32::try_from(self.rmr_context).map_err(|_| Error::InvalidRmr)
    }
}

/// A piece of an LMR a work request reads or writes (`it_lmr_triplet_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub(crate) sge: Sge,
}

impl Segment {
    pub fn addr(&self) -> u64 {
        self.sge.addr
    }
    pub fn len(&self) -> u32 {
        self.sge.length
    }
    pub fn is_empty(&self) -> bool {
        self.sge.length == 0
    }
}

/// A local memory region.
///
/// ```
/// use krdma_itapi::{Ia, Lmr, MemPriv, Pz};
/// use ual::RegBuf;
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// let buf = RegBuf::new(1 << 20).unwrap();
/// let lmr = Lmr::create(&pz, buf, MemPriv::LOCAL | MemPriv::REMOTE_WRITE)?;
/// let first_kib = lmr.segment(0, 1024)?;     // for post_send / post_recv / ...
/// let for_the_peer = lmr.rdma_addr(0)?;      // address + RMR context
/// # let _ = (first_kib, for_the_peer);
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Lmr(pub(crate) Arc<LmrInner>);

object_accessors!(Lmr);

pub struct LmrInner {
    pub(crate) pz: Pz,
    pub(crate) mr: Arc<ual::Mr>,
    pub(crate) privs: MemPriv,
    pub(crate) access: Access,
    buf: Option<Arc<RegBuf>>,
    _pz_use: UseGuard,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

impl Lmr {
    /// Register the whole of `buf` (kept alive by the LMR).
    pub fn create(pz: &Pz, buf: Arc<RegBuf>, privs: MemPriv) -> Result<Lmr> {
        let len = buf.len();
        let reg =
            |ctx: &Arc<ual::Context>, pd: &Arc<ual::Pd>, access| ctx.reg_buf(pd, &buf, access);
        Self::register(pz, len, privs, reg, Some(buf.clone()))
    }

    /// Register `len` bytes at `addr` of this process.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped, and not be accessed through Rust references, for as
    /// long as the LMR (or any RMR linked onto it) exists: the device reads and writes
    /// it at any time, on behalf of local work requests and of the peer.
    #[allow(unsafe_code)]
    pub unsafe fn create_raw(pz: &Pz, addr: *const u8, len: usize, privs: MemPriv) -> Result<Lmr> {
        let reg = |ctx: &Arc<ual::Context>, pd: &Arc<ual::Pd>, access| {
            // SAFETY: our caller's contract (above) is `reg_mr`'s.
            unsafe { ctx.reg_mr(pd, addr, len, access) }
        };
        Self::register(pz, len, privs, reg, None)
    }

    /// Check the request, then register with `reg`.
    fn register(
        pz: &Pz,
        len: usize,
        privs: MemPriv,
        reg: impl FnOnce(&Arc<ual::Context>, &Arc<ual::Pd>, Access) -> ual::Result<Arc<ual::Mr>>,
        buf: Option<Arc<RegBuf>>,
    ) -> Result<Lmr> {
        let ia = &pz.0.ia;
        ia.check_alive()?;
        if !MemPriv::ALL.contains(privs) {
            return Err(Error::InvalidPrivs);
        }
        if privs.contains(MemPriv::ATOMIC) && !ia.atomic_support() {
            return Err(Error::InvalidPrivs);
        }
        if len == 0 {
            return Err(Error::InvalidLength);
        }
        if len as u64 > ia.limits().max_lmr_length {
            return Err(Error::ResourceLmrLength);
        }
        let access = privs.lmr_access(ia.rmr_support());
        let mr = reg(&ia.0.ctx, &pz.0.pd, access).it(Error::InvalidLength)?;
        let inner = LmrInner {
            common: Common::new(),
            pz: pz.clone(),
            mr,
            privs,
            access,
            buf,
            _pz_use: pz.0.common.use_guard(),
        };
        tracing::debug!(
            id = inner.common.id,
            addr = inner.mr.addr,
            len,
            ?privs,
            "LMR created"
        );
        Ok(Lmr(Arc::new(inner)))
    }

    pub fn addr(&self) -> u64 {
        self.0.mr.addr
    }

    pub fn len(&self) -> u64 {
        self.0.mr.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn privs(&self) -> MemPriv {
        self.0.privs
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    /// The registered buffer, when the LMR was created over one.
    pub fn buffer(&self) -> Option<&Arc<RegBuf>> {
        self.0.buf.as_ref()
    }

    /// The RMR context of the region itself, when it has remote privileges.
    pub fn rmr_context(&self) -> Option<RmrContext> {
        self.0
            .privs
            .intersects(MemPriv::REMOTE | MemPriv::ATOMIC)
            .then_some(self.0.mr.rkey.into())
    }

    /// The remote target at `offset` in the region, for the peer (`InvalidPrivs` without
    /// remote privileges, `Range` past the end).
    pub fn rdma_addr(&self, offset: u64) -> Result<RdmaAddr> {
        if offset > self.len() {
            return Err(Error::Range);
        }
        Ok(RdmaAddr {
            addr: self.addr() + offset,
            rmr_context: self.rmr_context().ok_or(Error::InvalidPrivs)?,
        })
    }

    /// `len` bytes at `offset`.
    pub fn segment(&self, offset: u64, len: u32) -> Result<Segment> {
        self.segment_at(self.addr().saturating_add(offset), u64::from(len))
    }

    /// `len` bytes at the absolute address `addr`, which must lie in the region.
    pub fn segment_at(&self, addr: u64, len: u64) -> Result<Segment> {
        let end = addr.checked_add(len).ok_or(Error::Range)?;
        if addr < self.addr() || end > self.addr() + self.len() {
            return Err(Error::Range);
        }
        Ok(Segment {
            sge: Sge {
                addr,
                length: u32::try_from(len).map_err(|_| Error::InvalidLength)?,
                lkey: self.0.mr.lkey,
            },
        })
    }

    /// The whole region as one segment.
    pub fn whole(&self) -> Result<Segment> {
        self.segment_at(self.addr(), self.len())
    }
}

impl Drop for LmrInner {
    fn drop(&mut self) {
        tracing::debug!(id = self.common.id, "LMR freed");
    }
}
