//! Consumer memory as the engine sees it: the access abstraction, registrations,
//! and the STag/key table a provider validates every remote access against.
//!
//! The kAL's memory manager decides *how* the engine reaches a consumer's memory
//! (directly in embedded mode, `process_vm_readv/writev` across processes) and hands
//! the provider an [`MemoryAccess`]; the provider never touches consumer memory any
//! other way. A [`Region`] adds the bounds and rights of one registration on top, so
//! "no byte outside a registration changes" is enforced in exactly one place.

use crate::error::{Result, VerbsError};
use crate::types::Access;
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

/// How the engine reads and writes one consumer's address space.
pub trait MemoryAccess: Send + Sync + std::fmt::Debug {
    /// Copy `buf.len()` bytes from consumer address `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()>;
    /// Copy `data` to consumer address `addr`.
    fn write(&self, addr: u64, data: &[u8]) -> Result<()>;
    /// Read-modify-write of an aligned 64-bit word (RDMA atomics). Atomic with respect
    /// to other RDMA atomics through this accessor (verbs `ATOMIC_HCA` semantics).
    fn atomic(&self, addr: u64, op: &mut dyn FnMut(u64) -> u64) -> Result<u64> {
        static LOCK: Mutex<()> = Mutex::new(());
        let _g = LOCK.lock();
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        let old = u64::from_ne_bytes(b);
        self.write(addr, &op(old).to_ne_bytes())?;
        Ok(old)
    }
}

/// Direct access to memory of this very process (embedded mode, and the engine's own buffers).
#[derive(Debug, Default, Clone, Copy)]
pub struct LocalMemory;

impl MemoryAccess for LocalMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        if addr.checked_add(buf.len() as u64).is_none() || (addr == 0 && !buf.is_empty()) {
            return Err(VerbsError::BadAddress);
        }
        // SAFETY: callers reach this only through a `Region` whose range the kAL validated
        // at registration (mapped, owned by this process, pinned by the uAL) and whose
        // bounds `Region` checks on every access; the range stays mapped while registered.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        if addr.checked_add(data.len() as u64).is_none() || (addr == 0 && !data.is_empty()) {
            return Err(VerbsError::BadAddress);
        }
        // SAFETY: as for `read`; the registration granted write access to the range.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }

    fn atomic(&self, addr: u64, op: &mut dyn FnMut(u64) -> u64) -> Result<u64> {
        if !addr.is_multiple_of(8) || addr == 0 {
            return Err(VerbsError::BadAddress);
        }
        // SAFETY: the address is 8-aligned, inside a validated registration (see `read`),
        // and AtomicU64 has the layout of u64.
        let cell = unsafe { &*(addr as *const std::sync::atomic::AtomicU64) };
        let mut cur = cell.load(Ordering::Acquire);
        loop {
            match cell.compare_exchange_weak(cur, op(cur), Ordering::AcqRel, Ordering::Acquire) {
                Ok(old) => return Ok(old),
                Err(now) => cur = now,
            }
        }
    }
}

/// Why an access to a registration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("STag/key does not name a valid registration")]
    InvalidStag,
    #[error("registration belongs to another protection domain")]
    PdMismatch,
    #[error("access right not granted")]
    NoRight,
    #[error("range outside the registration")]
    OutOfBounds,
    #[error("registration has been invalidated")]
    Invalidated,
    #[error("consumer memory not accessible")]
    Fault,
}

/// One memory registration (MR) as the engine sees it.
#[derive(Debug)]
pub struct Region {
    /// STag (iWARP) = lkey = rkey (IB): 24-bit index and 8-bit key.
    pub stag: u32,
    pub pd: u32,
    pub base: u64,
    pub len: u64,
    pub access: Access,
    mem: Arc<dyn MemoryAccess>,
    valid: AtomicBool,
}

impl Region {
    pub fn is_valid(&self) -> bool {
        self.valid.load(Ordering::Acquire)
    }

    /// Mark invalid (local or remote invalidation); later accesses fail.
    pub fn invalidate(&self) {
        self.valid.store(false, Ordering::Release);
    }

    /// Check that `[addr, addr+len)` lies inside the registration, in `pd`, with `need`.
    /// `need` empty means local read, which every registration allows.
    pub fn check(&self, pd: u32, addr: u64, len: u64, need: Access) -> Result<(), AccessError> {
        if !self.is_valid() {
            return Err(AccessError::Invalidated);
        }
        if self.pd != pd {
            return Err(AccessError::PdMismatch);
        }
        if !self.access.contains(need) {
            return Err(AccessError::NoRight);
        }
        let end = addr.checked_add(len).ok_or(AccessError::OutOfBounds)?;
        if addr < self.base || end > self.base + self.len {
            return Err(AccessError::OutOfBounds);
        }
        Ok(())
    }

    /// Read after a successful [`check`](Self::check) of the same range.
    pub fn read(
        &self,
        pd: u32,
        addr: u64,
        buf: &mut [u8],
        need: Access,
    ) -> Result<(), AccessError> {
        self.check(pd, addr, buf.len() as u64, need)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.mem.read(addr, buf).map_err(|_| AccessError::Fault)
    }

    /// Write `data` at `addr` if the registration allows `need` there.
    pub fn write(&self, pd: u32, addr: u64, data: &[u8], need: Access) -> Result<(), AccessError> {
        self.check(pd, addr, data.len() as u64, need)?;
        if data.is_empty() {
            return Ok(());
        }
        self.mem.write(addr, data).map_err(|_| AccessError::Fault)
    }

    /// RDMA atomic on an aligned word inside the registration.
    pub fn atomic(
        &self,
        pd: u32,
        addr: u64,
        op: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, AccessError> {
        self.check(pd, addr, 8, Access::REMOTE_ATOMIC)?;
        if !addr.is_multiple_of(8) {
            return Err(AccessError::OutOfBounds);
        }
        self.mem.atomic(addr, op).map_err(|_| AccessError::Fault)
    }
}

const INDEX_BITS: u32 = 24;
const MAX_INDEX: u32 = (1 << INDEX_BITS) - 1;

/// The STag / key table of one device: allocates keys and looks registrations up.
///
/// A key is `index << 8 | generation`; each reuse of an index bumps the generation, so a
/// key from an earlier registration of the same slot does not match. Index 0 is never
/// used, so STag 0 (and the iWARP reserved STag range below 256) is always invalid.
#[derive(Debug)]
pub struct MrTable {
    slots: RwLock<Vec<Option<Arc<Region>>>>,
    free: Mutex<Vec<u32>>,
    generation: Mutex<Vec<u8>>,
    limit: u32,
    live: AtomicU32,
}

impl MrTable {
    pub fn new(limit: u32) -> Self {
        MrTable {
            slots: RwLock::new(vec![None]),
            free: Mutex::new(Vec::new()),
            generation: Mutex::new(vec![0]),
            limit: limit.min(MAX_INDEX),
            live: AtomicU32::new(0),
        }
    }

    /// Registrations alive now.
    pub fn live(&self) -> u32 {
        self.live.load(Ordering::Relaxed)
    }

    /// Register `[base, base+len)` of the memory behind `mem` in `pd` with `access`.
    pub fn register(
        &self,
        pd: u32,
        base: u64,
        len: u64,
        access: Access,
        mem: Arc<dyn MemoryAccess>,
    ) -> Result<Arc<Region>> {
        if !access.is_consistent() || base.checked_add(len).is_none() {
            return Err(VerbsError::Invalid);
        }
        let mut slots = self.slots.write();
        let mut gens = self.generation.lock();
        let index = match self.free.lock().pop() {
            Some(i) => i,
            None => {
                if slots.len() as u32 > self.limit {
                    return Err(VerbsError::Exhausted);
                }
                slots.push(None);
                gens.push(0);
                slots.len() as u32 - 1
            }
        };
        let g = &mut gens[index as usize];
        *g = g.wrapping_add(1);
        let stag = (index << 8) | *g as u32;
        let region = Arc::new(Region {
            stag,
            pd,
            base,
            len,
            access,
            mem,
            valid: AtomicBool::new(true),
        });
        slots[index as usize] = Some(region.clone());
        self.live.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            stag = format_args!("{stag:#x}"),
            pd,
            base,
            len,
            "memory registered"
        );
        Ok(region)
    }

    /// Find the registration a key names; stale or unknown keys give `InvalidStag`.
    pub fn lookup(&self, stag: u32) -> Result<Arc<Region>, AccessError> {
        let index = (stag >> 8) as usize;
        let slots = self.slots.read();
        match slots.get(index).and_then(|s| s.as_ref()) {
            Some(r) if r.stag == stag => Ok(r.clone()),
            _ => Err(AccessError::InvalidStag),
        }
    }

    /// Remove a registration (it is invalidated first, so an engine holding a reference stops).
    pub fn deregister(&self, stag: u32) -> Result<()> {
        let index = (stag >> 8) as usize;
        let mut slots = self.slots.write();
        match slots.get_mut(index) {
            Some(slot @ Some(_)) if slot.as_ref().map(|r| r.stag) == Some(stag) => {
                if let Some(r) = slot.take() {
                    r.invalidate();
                }
                self.free.lock().push(index as u32);
                self.live.fetch_sub(1, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    /// Invalidate (local or remote invalidate): the key stays allocated but stops working.
    /// Only a registration of `pd` may be invalidated.
    pub fn invalidate(&self, stag: u32, pd: u32) -> Result<(), AccessError> {
        let r = self.lookup(stag)?;
        if r.pd != pd {
            return Err(AccessError::PdMismatch);
        }
        r.invalidate();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf_region(table: &MrTable, buf: &mut [u8], access: Access) -> Arc<Region> {
        table
            .register(
                1,
                buf.as_mut_ptr() as u64,
                buf.len() as u64,
                access,
                Arc::new(LocalMemory),
            )
            .unwrap()
    }

    #[test]
    fn bounds_and_rights() {
        let t = MrTable::new(16);
        let mut b = vec![0u8; 64];
        let r = buf_region(&t, &mut b, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
        let base = r.base;
        r.write(1, base + 60, &[1, 2, 3, 4], Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(
            r.write(1, base + 61, &[1, 2, 3, 4], Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            r.write(1, base - 1, &[1], Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            r.write(1, u64::MAX, &[1, 2], Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            r.write(2, base, &[1], Access::REMOTE_WRITE),
            Err(AccessError::PdMismatch)
        );
        let mut out = [0u8; 4];
        assert_eq!(
            r.read(1, base, &mut out, Access::REMOTE_READ),
            Err(AccessError::NoRight)
        );
        drop(r);
        assert_eq!(&b[60..], &[1, 2, 3, 4]);
    }

    #[test]
    fn stale_keys_never_match() {
        let t = MrTable::new(16);
        let mut b = vec![0u8; 8];
        let old = buf_region(&t, &mut b, Access::LOCAL_WRITE).stag;
        t.deregister(old).unwrap();
        let new = buf_region(&t, &mut b, Access::LOCAL_WRITE).stag;
        assert_ne!(old, new);
        assert_eq!(old >> 8, new >> 8, "slot reused");
        assert_eq!(t.lookup(old).unwrap_err(), AccessError::InvalidStag);
        assert!(t.lookup(new).is_ok());
        assert!(t.lookup(0).is_err());
    }

    #[test]
    fn limit_and_invalidate() {
        let t = MrTable::new(2);
        let mut b = vec![0u8; 8];
        let a = buf_region(&t, &mut b, Access::LOCAL_WRITE);
        let _b2 = buf_region(&t, &mut b, Access::LOCAL_WRITE);
        assert!(t
            .register(1, 1, 1, Access::empty(), Arc::new(LocalMemory))
            .is_err());
        t.invalidate(a.stag, 1).unwrap();
        assert_eq!(
            a.check(1, a.base, 1, Access::empty()),
            Err(AccessError::Invalidated)
        );
    }

    #[test]
    fn atomics() {
        let t = MrTable::new(4);
        let mut b = vec![0u64; 2];
        let r = t
            .register(
                1,
                b.as_mut_ptr() as u64,
                16,
                Access::LOCAL_WRITE | Access::REMOTE_ATOMIC,
                Arc::new(LocalMemory),
            )
            .unwrap();
        assert_eq!(r.atomic(1, r.base + 8, &mut |v| v + 5).unwrap(), 0);
        assert_eq!(r.atomic(1, r.base + 8, &mut |v| v + 5).unwrap(), 5);
        assert!(r.atomic(1, r.base + 4, &mut |v| v).is_err());
        drop(r);
        assert_eq!(b[1], 10);
    }
}
