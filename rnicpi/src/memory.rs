//! Consumer memory as the engine sees it: the access abstraction, registrations,
//! and the STag/key table a provider validates every remote access against.
//!
//! The kAL's memory manager decides *how* the engine reaches a consumer's memory
//! (directly in embedded mode, `process_vm_readv/writev` across processes) and hands
//! the provider an [`MemoryAccess`]; the provider never touches consumer memory any
//! other way. A [`Region`] adds the bounds and rights of one registration on top, so
//! "no byte outside a registration changes" is enforced in exactly one place, and holds
//! every access in flight against its invalidation, so once a deregistration returns no
//! access to the memory is under way or can start.
//!
//! Over 600 lines: the one place that enforces that nothing is written outside a
//! registration (the first 650 lines); the rest are tests.

use crate::error::{Result, VerbsError};
use crate::types::Access;
use crate::wr::Sge;
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

/// How the engine reads and writes one consumer's address space.
pub trait MemoryAccess: Send + Sync + std::fmt::Debug {
    /// Copy `buf.len()` bytes from consumer address `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()>;
    /// Copy `data` to consumer address `addr`.
    fn write(&self, addr: u64, data: &[u8]) -> Result<()>;
    /// Bytes of this process's address space the accessor maps (0 when it copies).
    fn mapped_bytes(&self) -> u64 {
        0
    }
    /// Where `[addr, addr+len)` of the consumer lies in this process's address space, when
    /// the accessor maps it there (so a system call may read or write the bytes in place,
    /// without a copy through a buffer of the engine's); `None` when it copies.
    /// Producing the pointer touches nothing; using it is for [`Region::lend`]'s callers
    /// and for [`read_append`](Self::read_append) inside a `Region` access.
    fn span(&self, _addr: u64, _len: usize) -> Option<*mut u8> {
        None
    }
    /// Append `len` bytes from consumer address `addr` to `out`. Where the accessor maps
    /// the range ([`span`](Self::span)) they are copied once into `out`'s spare room,
    /// which is never zeroed first; otherwise `out` grows by zeros that
    /// [`read`](Self::read) overwrites. On an error `out` is left as it was.
    fn read_append(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<()> {
        let at = out.len();
        let Some(src) = self.span(addr, len) else {
            out.resize(at + len, 0);
            return self
                .read(addr, &mut out[at..])
                .inspect_err(|_| out.truncate(at));
        };
        out.reserve(len);
        // SAFETY: `span` gave `[src, src+len)` as mapped in this process for as long as
        // the registration it belongs to is valid, and this runs inside a `Region`
        // access, which holds the registration against invalidation for the copy (the
        // same argument as `read`'s copy). The destination is `len` bytes of `out`'s
        // reserved spare room, which cannot overlap consumer memory. Bytes the consumer
        // writes concurrently only come out arbitrary, as with `read`. After the copy
        // the first `at + len` bytes of `out` are initialised.
        unsafe {
            std::ptr::copy_nonoverlapping(src.cast_const(), out.as_mut_ptr().add(at), len);
            out.set_len(at + len);
        }
        Ok(())
    }
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

    fn span(&self, addr: u64, len: usize) -> Option<*mut u8> {
        (addr != 0 && addr.checked_add(len as u64).is_some()).then_some(addr as *mut u8)
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

/// One memory registration (MR), or a memory window bound onto one, as the engine
/// sees it.
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
    /// Held shared by every access for the whole of its copy, and exclusively by
    /// [`invalidate`](Self::invalidate): when that returns, no access is in flight and
    /// every later one sees the region invalid (so a consumer may free the memory).
    in_flight: RwLock<()>,
    /// For a window: the registration it is bound onto (the window dies with it).
    parent: Option<Arc<Region>>,
}

impl Region {
    /// A registration (no `parent`), or a window bound onto `parent` (`None` with `valid`
    /// false: an unbound window).
    fn new(
        stag: u32,
        pd: u32,
        (base, len): (u64, u64),
        access: Access,
        mem: Arc<dyn MemoryAccess>,
        (parent, valid): (Option<Arc<Region>>, bool),
    ) -> Region {
        Region {
            stag,
            pd,
            base,
            len,
            access,
            mem,
            valid: AtomicBool::new(valid),
            in_flight: RwLock::new(()),
            parent,
        }
    }

    pub fn is_valid(&self) -> bool {
        self.valid.load(Ordering::Acquire) && self.parent.as_ref().is_none_or(|p| p.is_valid())
    }

    /// Whether this is a memory window rather than a registration.
    pub fn is_window(&self) -> bool {
        self.parent.is_some()
    }

    /// Mark invalid (local or remote invalidation, deregistration); later accesses fail.
    /// Waits for the accesses in flight to finish: they are copies, so this is short.
    pub fn invalidate(&self) {
        let _no_access = self.in_flight.write();
        self.valid.store(false, Ordering::Release);
    }

    /// Run `copy` against the memory if `[addr, addr+len)` passes [`check`](Self::check),
    /// holding off invalidation (of this region and, for a window, its registration)
    /// until it is done.
    fn access<T>(
        &self,
        pd: u32,
        (addr, len): (u64, u64),
        need: Access,
        copy: impl FnOnce(&dyn MemoryAccess) -> Result<T>,
    ) -> Result<T, AccessError> {
        let _mine = self.in_flight.read();
        let _parents = self.parent.as_ref().map(|p| p.in_flight.read());
        self.check(pd, addr, len, need)?;
        copy(self.mem.as_ref()).map_err(|_| AccessError::Fault)
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
        self.access(pd, (addr, buf.len() as u64), need, |m| {
            match buf.is_empty() {
                true => Ok(()),
                false => m.read(addr, buf),
            }
        })
    }

    /// [`read`](Self::read) onto the end of `out` (`len` bytes), with no zero fill where
    /// the accessor maps the range ([`MemoryAccess::read_append`]).
    pub fn read_append(
        &self,
        pd: u32,
        addr: u64,
        len: usize,
        need: Access,
        out: &mut Vec<u8>,
    ) -> Result<(), AccessError> {
        self.access(pd, (addr, len as u64), need, |m| match len {
            0 => Ok(()),
            _ => m.read_append(addr, len, out),
        })
    }

    /// Write `data` at `addr` if the registration allows `need` there.
    pub fn write(&self, pd: u32, addr: u64, data: &[u8], need: Access) -> Result<(), AccessError> {
        self.access(pd, (addr, data.len() as u64), need, |m| {
            match data.is_empty() {
                true => Ok(()),
                false => m.write(addr, data),
            }
        })
    }

    /// Whether [`lend`](Self::lend) can hand out `[addr, addr+len)` (the accessor maps
    /// it); rights and bounds are checked by `lend` itself.
    pub fn lendable(&self, addr: u64, len: usize) -> bool {
        self.mem.span(addr, len).is_some()
    }

    /// `[addr, addr+len)` for a system call to read or write in place (a socket send
    /// from it, a receive into it): checked as [`read`](Self::read) and
    /// [`write`](Self::write) check, and held against invalidation until the lease is
    /// dropped — so hold it only for calls that never wait. `Fault` when the accessor
    /// does not map the range (see [`lendable`](Self::lendable)).
    pub fn lend(
        &self,
        pd: u32,
        addr: u64,
        len: usize,
        need: Access,
    ) -> Result<Lease<'_>, AccessError> {
        // Recursive: one batch leases several pieces of one registration, and a plain
        // read behind a waiting `invalidate` would wait for the lease it already holds.
        let mine = self.in_flight.read_recursive();
        let parent = self.parent.as_ref().map(|p| p.in_flight.read_recursive());
        self.check(pd, addr, len as u64, need)?;
        let ptr = self.mem.span(addr, len).ok_or(AccessError::Fault)?;
        Ok(Lease {
            ptr,
            len,
            _held: (mine, parent),
        })
    }

    /// RDMA atomic on an aligned word inside the registration.
    pub fn atomic(
        &self,
        pd: u32,
        addr: u64,
        op: &mut dyn FnMut(u64) -> u64,
    ) -> Result<u64, AccessError> {
        if !addr.is_multiple_of(8) {
            self.check(pd, addr, 8, Access::REMOTE_ATOMIC)?;
            return Err(AccessError::OutOfBounds);
        }
        self.access(pd, (addr, 8), Access::REMOTE_ATOMIC, |m| m.atomic(addr, op))
    }
}

/// Consumer bytes lent out by [`Region::lend`]: a checked range of a registration,
/// mapped in this process, that cannot be invalidated while the lease lives.
pub struct Lease<'a> {
    ptr: *mut u8,
    len: usize,
    _held: (
        parking_lot::RwLockReadGuard<'a, ()>,
        Option<parking_lot::RwLockReadGuard<'a, ()>>,
    ),
}

impl Lease<'_> {
    /// The first byte, for a system call's I/O vector. The bytes may change under the
    /// caller (the consumer's, and for RDMA that is allowed), so never make a Rust
    /// reference of them: hand them to the kernel, or [`copy_out`](Self::copy_out).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy the lent bytes from `off` into `out` (as many as both have).
    pub fn copy_out(&self, off: usize, out: &mut [u8]) -> usize {
        let n = self.len.saturating_sub(off).min(out.len());
        // SAFETY: `off + n <= len`, and `ptr..ptr+len` is a checked range of a
        // registration the accessor maps, valid while the lease holds off invalidation
        // (as for `MemoryAccess::read`); `out` is a distinct buffer of ours.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), n) };
        n
    }
}

const INDEX_BITS: u32 = 24;
const MAX_INDEX: u32 = (1 << INDEX_BITS) - 1;
/// Indices given back most recently, kept out of use so that a key of a registration
/// just deregistered cannot name the next one (on top of the random key byte).
const QUARANTINE: usize = 4096;

/// What one index of the key table holds.
#[derive(Debug)]
enum Slot {
    Mr(Arc<Region>),
    /// A memory window of `pd`: `bound` while bound (its key is the window's current key).
    Mw {
        pd: u32,
        key: u32,
        bound: Option<Arc<Region>>,
    },
    /// Given back recently; not handed out again while in quarantine.
    Retired,
}

/// Why a memory-window bind failed (reported as `MwBindErr` / `LocProtErr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BindError {
    #[error("the key does not name a memory window of this protection domain")]
    NotAWindow,
    #[error("the registration is unknown, invalid or in another protection domain")]
    BadRegion,
    #[error("the requested rights cannot be granted on this registration")]
    Rights,
    #[error("the range lies outside the registration")]
    OutOfBounds,
}

/// Random bits from the kernel's CSPRNG (`getrandom(2)`, which never fails once the
/// pool is seeded; a short or failed read is retried).
fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: getrandom writes at most `len - got` bytes into the rest of `b`.
        let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if r > 0 {
            got += r as usize;
        }
    }
    u32::from_ne_bytes(b)
}

/// The STag / key table of one device: allocates keys and looks registrations up.
///
/// A key is `index << 8 | key byte`, and both parts are random (as kernel siw draws the
/// index and kernel rxe the key byte), so a peer that learns some keys cannot predict
/// another tenant's: it has to guess 32 bits. An index given back stays in quarantine
/// for the next 4096 deregistrations, so a key just deregistered never names
/// a new registration. Windows: the consumer picks the key byte at each bind (verbs
/// type 2 windows), so the keys handed out for earlier binds stop matching. Index 0 is
/// never used, so STag 0 (and the iWARP reserved STag range below 256) is always invalid.
#[derive(Debug)]
pub struct MrTable {
    slots: RwLock<HashMap<u32, Slot>>,
    /// Retired indices, oldest first.
    retired: Mutex<VecDeque<u32>>,
    limit: u32,
    live: AtomicU32,
    windows: AtomicU32,
}

/// A work request's scatter/gather list with each element's registration looked up and
/// checked once (when the request is taken), for the engine to read or write at message
/// offsets as the transfer proceeds. Empty elements are left out.
#[derive(Clone, Default)]
pub struct Sgl {
    pd: u32,
    parts: Vec<(Arc<Region>, Sge)>,
}

impl Sgl {
    /// Bytes the list covers.
    pub fn len(&self) -> u64 {
        self.parts.iter().map(|(_, s)| u64::from(s.length)).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The elements, in order.
    pub fn parts(&self) -> impl Iterator<Item = (&Arc<Region>, &Sge)> {
        self.parts.iter().map(|(r, s)| (r, s))
    }

    /// The protection domain the list was checked in.
    pub fn pd(&self) -> u32 {
        self.pd
    }

    /// The pieces `n` bytes from message offset `off` span: each touched element's
    /// registration, the address in it and the byte count.
    pub fn pieces(&self, off: u64, n: usize) -> impl Iterator<Item = (&Arc<Region>, u64, usize)> {
        walk(self.parts(), off, n).map(|(r, _, addr, take)| (r, addr, take))
    }

    /// Fill `out` from message offset `off` (`need`: the right the read requires).
    pub fn read_at(&self, off: u64, out: &mut [u8], need: Access) -> Result<(), AccessError> {
        let mut filled = 0;
        for (r, _, addr, take) in walk(self.parts(), off, out.len()) {
            r.read(self.pd, addr, &mut out[filled..filled + take], need)?;
            filled += take;
        }
        (filled == out.len())
            .then_some(())
            .ok_or(AccessError::OutOfBounds)
    }

    /// Append `n` bytes from message offset `off` to `out` (`need`: the right the read
    /// requires), with no zero fill first where the memory is mapped
    /// ([`Region::read_append`]). On an error `out` is left as it was.
    pub fn append_at(
        &self,
        off: u64,
        n: usize,
        need: Access,
        out: &mut Vec<u8>,
    ) -> Result<(), AccessError> {
        let at = out.len();
        let mut done = 0;
        for (r, _, addr, take) in walk(self.parts(), off, n) {
            if let Err(e) = r.read_append(self.pd, addr, take, need, out) {
                out.truncate(at);
                return Err(e);
            }
            done += take;
        }
        if done != n {
            out.truncate(at);
            return Err(AccessError::OutOfBounds);
        }
        Ok(())
    }

    /// Write `data` at message offset `off` (`need`: the right the write requires).
    pub fn write_at(&self, off: u64, data: &[u8], need: Access) -> Result<(), AccessError> {
        let mut done = 0;
        for (r, _, addr, take) in walk(self.parts(), off, data.len()) {
            r.write(self.pd, addr, &data[done..done + take], need)?;
            done += take;
        }
        (done == data.len())
            .then_some(())
            .ok_or(AccessError::OutOfBounds)
    }
}

/// The pieces of `n` bytes from message offset `off` over a list of elements: for each
/// element touched, its registration, the element, the address in it and the byte count.
fn walk<'a, R: 'a>(
    parts: impl Iterator<Item = (R, &'a Sge)>,
    off: u64,
    n: usize,
) -> impl Iterator<Item = (R, &'a Sge, u64, usize)> {
    let (mut skip, mut left) = (off, n);
    parts.filter_map(move |(r, s)| {
        let len = u64::from(s.length);
        if left == 0 {
            return None;
        }
        if skip >= len {
            skip -= len;
            return None;
        }
        let take = ((len - skip) as usize).min(left);
        let addr = s.addr + skip;
        skip = 0;
        left -= take;
        Some((r, s, addr, take))
    })
}

impl MrTable {
    pub fn new(limit: u32) -> Self {
        MrTable {
            slots: RwLock::new(HashMap::new()),
            retired: Mutex::new(VecDeque::new()),
            // At most half the index space is ever live, so a random draw finds a free
            // index with probability at least one half.
            limit: limit.min(MAX_INDEX / 2),
            live: AtomicU32::new(0),
            windows: AtomicU32::new(0),
        }
    }

    /// Registrations alive now.
    pub fn live(&self) -> u32 {
        self.live.load(Ordering::Relaxed)
    }

    /// Memory windows allocated now.
    pub fn windows(&self) -> u32 {
        self.windows.load(Ordering::Relaxed)
    }

    /// Take a random free index and give it a random key byte; returns the key. The
    /// caller fills the slot before releasing `slots`.
    fn allocate(&self, slots: &mut HashMap<u32, Slot>) -> Result<u32> {
        if self.live() + self.windows() >= self.limit {
            return Err(VerbsError::Exhausted);
        }
        // Each draw is free with probability > 1/2 (see `new`): 64 draws all failing
        // would take a broken random source.
        for _ in 0..64 {
            let r = random_u32();
            let index = r >> 8;
            if index != 0 && !slots.contains_key(&index) {
                return Ok(r);
            }
        }
        Err(VerbsError::Exhausted)
    }

    /// Give an index back: it stays retired (and its keys invalid) until it leaves the
    /// quarantine.
    fn retire(&self, slots: &mut HashMap<u32, Slot>, index: u32) {
        slots.insert(index, Slot::Retired);
        let mut q = self.retired.lock();
        q.push_back(index);
        while q.len() > QUARANTINE {
            if let Some(old) = q.pop_front() {
                if matches!(slots.get(&old), Some(Slot::Retired)) {
                    slots.remove(&old);
                }
            }
        }
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
        let stag = self.allocate(&mut slots)?;
        let region = Arc::new(Region::new(
            stag,
            pd,
            (base, len),
            access,
            mem,
            (None, true),
        ));
        slots.insert(stag >> 8, Slot::Mr(region.clone()));
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

    /// Find the registration or bound window a key names; stale, unbound or unknown keys
    /// give `InvalidStag`.
    /// Look up every non-empty element of `sges` and check it for `need` in PD `pd`
    /// (the local-key checks of a work request, done once when it is taken).
    pub fn resolve_sgl(&self, pd: u32, sges: &[Sge], need: Access) -> Result<Sgl, AccessError> {
        let mut parts = Vec::with_capacity(sges.len());
        for s in sges.iter().filter(|s| s.length > 0) {
            let r = self.lookup(s.lkey)?;
            r.check(pd, s.addr, u64::from(s.length), need)?;
            parts.push((r, *s));
        }
        Ok(Sgl { pd, parts })
    }

    /// Write `data` at message offset `off` of a receive's scatter list, looking up only
    /// the elements it reaches (an incoming Send needs local write on each).
    pub fn scatter(&self, pd: u32, sges: &[Sge], off: u64, data: &[u8]) -> Result<(), AccessError> {
        let mut done = 0;
        for (_, s, addr, take) in walk(sges.iter().map(|s| ((), s)), off, data.len()) {
            self.lookup(s.lkey)?
                .write(pd, addr, &data[done..done + take], Access::LOCAL_WRITE)?;
            done += take;
        }
        (done == data.len())
            .then_some(())
            .ok_or(AccessError::OutOfBounds)
    }

    pub fn lookup(&self, stag: u32) -> Result<Arc<Region>, AccessError> {
        let slots = self.slots.read();
        match slots.get(&(stag >> 8)) {
            Some(Slot::Mr(r)) if r.stag == stag => Ok(r.clone()),
            Some(Slot::Mw { bound: Some(r), .. }) if r.stag == stag => Ok(r.clone()),
            _ => Err(AccessError::InvalidStag),
        }
    }

    /// Remove a registration. It is invalidated first, so an engine holding a reference
    /// stops, and so do the windows bound onto it; this returns once no access to its
    /// memory is in flight (the table itself stays available meanwhile).
    pub fn deregister(&self, stag: u32) -> Result<()> {
        let index = stag >> 8;
        let region = {
            let mut slots = self.slots.write();
            match slots.get(&index) {
                Some(Slot::Mr(r)) if r.stag == stag => {}
                _ => return Err(VerbsError::NoSuchResource),
            }
            let Some(Slot::Mr(r)) = slots.remove(&index) else {
                unreachable!("checked above");
            };
            self.retire(&mut slots, index);
            self.live.fetch_sub(1, Ordering::Relaxed);
            r
        };
        region.invalidate();
        Ok(())
    }

    /// Allocate an unbound memory window in `pd`; returns its initial key.
    pub fn alloc_window(&self, pd: u32) -> Result<u32> {
        let mut slots = self.slots.write();
        let key = self.allocate(&mut slots)?;
        slots.insert(
            key >> 8,
            Slot::Mw {
                pd,
                key,
                bound: None,
            },
        );
        self.windows.fetch_add(1, Ordering::Relaxed);
        Ok(key)
    }

    /// Free a window (any of its keys names it); a bound window stops working at once.
    pub fn dealloc_window(&self, key: u32) -> Result<()> {
        let index = key >> 8;
        let bound = {
            let mut slots = self.slots.write();
            if !matches!(slots.get(&index), Some(Slot::Mw { .. })) {
                return Err(VerbsError::NoSuchResource);
            }
            let Some(Slot::Mw { bound, .. }) = slots.remove(&index) else {
                unreachable!("checked above");
            };
            self.retire(&mut slots, index);
            self.windows.fetch_sub(1, Ordering::Relaxed);
            bound
        };
        if let Some(r) = bound {
            r.invalidate();
        }
        Ok(())
    }

    /// Bind (or with `len` 0 unbind) the window whose index `new_key` names, for a QP of
    /// `pd`, onto `[addr, addr+len)` of registration `mr_lkey`. The window's key becomes
    /// `new_key`: every key handed out for an earlier bind stops matching.
    pub fn bind_window(
        &self,
        pd: u32,
        new_key: u32,
        mr_lkey: u32,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<Arc<Region>, BindError> {
        let parent = if len > 0 {
            let mr = match self.lookup(mr_lkey) {
                Ok(r) if !r.is_window() && r.pd == pd && r.is_valid() => r,
                _ => return Err(BindError::BadRegion),
            };
            if !access.can_bind_onto(mr.access) {
                return Err(BindError::Rights);
            }
            let end = addr.checked_add(len).ok_or(BindError::OutOfBounds)?;
            if addr < mr.base || end > mr.base + mr.len {
                return Err(BindError::OutOfBounds);
            }
            Some(mr)
        } else {
            None
        };
        let mem = parent.as_ref().map_or_else(
            || Arc::new(LocalMemory) as Arc<dyn MemoryAccess>,
            |p| p.mem.clone(),
        );
        let region = Arc::new(Region::new(
            new_key,
            pd,
            (addr, len),
            access,
            mem,
            (parent.clone(), len > 0),
        ));
        let old = {
            let mut slots = self.slots.write();
            let Some(Slot::Mw {
                pd: mw_pd,
                key,
                bound,
            }) = slots.get_mut(&(new_key >> 8))
            else {
                return Err(BindError::NotAWindow);
            };
            if *mw_pd != pd {
                return Err(BindError::NotAWindow);
            }
            *key = new_key;
            std::mem::replace(bound, parent.is_some().then(|| region.clone()))
        };
        if let Some(old) = old {
            old.invalidate();
        }
        tracing::debug!(
            key = format_args!("{new_key:#x}"),
            mr = format_args!("{mr_lkey:#x}"),
            addr,
            len,
            "memory window bound"
        );
        Ok(region)
    }

    /// Invalidate (local or remote invalidate): the key stays allocated but stops working.
    /// Only a registration or window of `pd` may be invalidated.
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

    /// A list of three elements (one empty) over two registrations, written and read
    /// back at every offset and length; the checks made when it is resolved.
    #[test]
    fn scatter_gather_lists() {
        let t = MrTable::new(16);
        let mut a = vec![0u8; 8];
        let mut b = vec![0u8; 8];
        let ra = buf_region(&t, &mut a, Access::LOCAL_WRITE);
        let rb = buf_region(&t, &mut b, Access::LOCAL_WRITE);
        let sge = |r: &Region, off: u64, length: u32| Sge {
            addr: r.base + off,
            length,
            lkey: r.stag,
        };
        let sges = [sge(&ra, 2, 5), sge(&rb, 0, 0), sge(&rb, 1, 6)];
        let sgl = t.resolve_sgl(1, &sges, Access::LOCAL_WRITE).unwrap();
        assert_eq!(sgl.len(), 11);
        let msg: Vec<u8> = (1..=11).collect();
        for off in 0..11u64 {
            for n in 0..=(11 - off as usize) {
                t.scatter(1, &sges, off, &msg[off as usize..off as usize + n])
                    .unwrap();
                let mut back = vec![0u8; n];
                sgl.read_at(off, &mut back, Access::empty()).unwrap();
                assert_eq!(back, &msg[off as usize..off as usize + n]);
            }
        }
        assert_eq!(&a[2..7], &msg[..5]);
        assert_eq!(&b[1..7], &msg[5..]);
        assert_eq!(
            sgl.write_at(10, &[0, 0], Access::LOCAL_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.scatter(1, &sges, 0, &[0; 12]),
            Err(AccessError::OutOfBounds)
        );
        // Resolving checks each element's key, PD, right and bounds.
        assert_eq!(
            t.resolve_sgl(2, &sges, Access::empty()).err(),
            Some(AccessError::PdMismatch)
        );
        assert_eq!(
            t.resolve_sgl(1, &sges, Access::REMOTE_READ).err(),
            Some(AccessError::NoRight)
        );
        let long = [sge(&rb, 4, 5)];
        assert_eq!(
            t.resolve_sgl(1, &long, Access::empty()).err(),
            Some(AccessError::OutOfBounds)
        );
        let bad = [Sge {
            lkey: 0xdead_be00,
            ..sges[0]
        }];
        assert_eq!(
            t.resolve_sgl(1, &bad, Access::empty()).err(),
            Some(AccessError::InvalidStag)
        );
    }

    /// Local memory, copied through `read` only (as an accessor that maps nothing).
    #[derive(Debug)]
    struct CopiedOnly;

    impl MemoryAccess for CopiedOnly {
        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
            LocalMemory.read(addr, buf)
        }
        fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
            LocalMemory.write(addr, data)
        }
    }

    /// Appending from a list gives the bytes `read_at` gives, after what the vector
    /// held, whether the memory is mapped (no zero fill) or copied; a refused append
    /// leaves the vector as it was.
    #[test]
    fn appends_match_reads() {
        let t = MrTable::new(16);
        let mut a: Vec<u8> = (1..=8).collect();
        let mut b: Vec<u8> = (9..=16).collect();
        let ra = buf_region(&t, &mut a, Access::LOCAL_WRITE);
        let rb = t
            .register(
                1,
                b.as_mut_ptr() as u64,
                8,
                Access::LOCAL_WRITE,
                Arc::new(CopiedOnly),
            )
            .unwrap();
        let sge = |r: &Region, off: u64, length: u32| Sge {
            addr: r.base + off,
            length,
            lkey: r.stag,
        };
        let sges = [sge(&ra, 2, 5), sge(&rb, 1, 6)];
        let sgl = t.resolve_sgl(1, &sges, Access::empty()).unwrap();
        for off in 0..11u64 {
            for n in 0..=(11 - off as usize) {
                let mut want = vec![0u8; n];
                sgl.read_at(off, &mut want, Access::empty()).unwrap();
                let mut out = vec![0xee; 3];
                sgl.append_at(off, n, Access::empty(), &mut out).unwrap();
                assert_eq!(&out[..3], &[0xee; 3]);
                assert_eq!(&out[3..], &want[..]);
            }
        }
        let mut out = vec![7u8; 2];
        assert_eq!(
            sgl.append_at(4, 8, Access::empty(), &mut out),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            sgl.append_at(0, 3, Access::REMOTE_READ, &mut out),
            Err(AccessError::NoRight)
        );
        assert_eq!(out, [7, 7]);
        let mut one = Vec::new();
        ra.read_append(1, ra.base + 7, 1, Access::empty(), &mut one)
            .unwrap();
        rb.read_append(1, rb.base, 2, Access::empty(), &mut one)
            .unwrap();
        assert_eq!(one, [8, 9, 10]);
        ra.invalidate();
        assert_eq!(
            ra.read_append(1, ra.base, 1, Access::empty(), &mut one),
            Err(AccessError::Invalidated)
        );
        assert_eq!(one, [8, 9, 10]);
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
        let mut stale = Vec::new();
        for _ in 0..QUARANTINE {
            let k = buf_region(&t, &mut b, Access::LOCAL_WRITE).stag;
            t.deregister(k).unwrap();
            stale.push(k);
        }
        let live = buf_region(&t, &mut b, Access::LOCAL_WRITE).stag;
        assert!(t.lookup(live).is_ok());
        for k in &stale {
            assert_eq!(t.lookup(*k).unwrap_err(), AccessError::InvalidStag);
            assert_ne!(
                k >> 8,
                live >> 8,
                "a quarantined index was handed out again"
            );
        }
        assert!(t.lookup(0).is_err());
        assert_eq!(t.deregister(stale[0]), Err(VerbsError::NoSuchResource));
    }

    #[test]
    fn keys_are_unpredictable() {
        let t = MrTable::new(4096);
        let mut b = vec![0u8; 8];
        let keys: Vec<u32> = (0..1000)
            .map(|_| buf_region(&t, &mut b, Access::LOCAL_WRITE).stag)
            .collect();
        // Neither part counts: consecutive registrations share no index neighbourhood,
        // and the key bytes spread over the whole byte.
        let neighbours = keys
            .windows(2)
            .filter(|w| (w[1] >> 8).abs_diff(w[0] >> 8) <= 16)
            .count();
        assert!(neighbours < 5, "{neighbours} near-sequential indices");
        let bytes: std::collections::HashSet<u8> = keys.iter().map(|k| *k as u8).collect();
        assert!(bytes.len() > 200, "only {} distinct key bytes", bytes.len());
        let distinct: std::collections::HashSet<u32> = keys.iter().map(|k| k >> 8).collect();
        assert_eq!(
            distinct.len(),
            keys.len(),
            "an index named two registrations"
        );
    }

    /// A memory whose writes wait at a gate, to hold an access in flight.
    #[derive(Debug, Default)]
    struct Gated {
        entered: std::sync::Mutex<bool>,
        open: std::sync::Mutex<bool>,
        cv: std::sync::Condvar,
    }

    impl MemoryAccess for Gated {
        fn read(&self, _addr: u64, _buf: &mut [u8]) -> Result<()> {
            Ok(())
        }
        fn write(&self, _addr: u64, _data: &[u8]) -> Result<()> {
            *self.entered.lock().unwrap() = true;
            self.cv.notify_all();
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.cv.wait(open).unwrap();
            }
            Ok(())
        }
    }

    #[test]
    fn deregistration_waits_for_accesses_in_flight() {
        let t = Arc::new(MrTable::new(16));
        let gate = Arc::new(Gated::default());
        let r = t
            .register(1, 4096, 4096, Access::LOCAL_WRITE, gate.clone())
            .unwrap();
        let stag = r.stag;
        let writer = std::thread::spawn(move || r.write(1, 4096, &[1], Access::LOCAL_WRITE));
        let mut entered = gate.entered.lock().unwrap();
        while !*entered {
            entered = gate.cv.wait(entered).unwrap();
        }
        drop(entered);
        let (tx, rx) = std::sync::mpsc::channel();
        let t2 = t.clone();
        let dereg = std::thread::spawn(move || {
            t2.deregister(stag).unwrap();
            tx.send(()).unwrap();
        });
        // The key is gone from the table at once (lookups never wait), but the
        // deregistration does not return while the write is inside the memory.
        while t.lookup(stag).is_ok() {
            std::thread::yield_now();
        }
        assert!(rx
            .recv_timeout(std::time::Duration::from_millis(200))
            .is_err());
        *gate.open.lock().unwrap() = true;
        gate.cv.notify_all();
        assert_eq!(writer.join().unwrap(), Ok(()));
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("deregistration returns once the write is done");
        dereg.join().unwrap();
    }

    /// Leases check as accesses do, hold off invalidation while they live, and a second
    /// lease of the same registration never waits behind a waiting invalidation.
    #[test]
    fn leases_hold_off_invalidation_and_nest() {
        let t = MrTable::new(4);
        let mut b = vec![3u8; 64];
        let r = buf_region(&t, &mut b, Access::LOCAL_WRITE);
        assert_eq!(
            r.lend(2, r.base, 8, Access::empty()).err(),
            Some(AccessError::PdMismatch)
        );
        assert_eq!(
            r.lend(1, r.base + 60, 8, Access::empty()).err(),
            Some(AccessError::OutOfBounds)
        );
        assert_eq!(
            r.lend(1, r.base, 8, Access::REMOTE_READ).err(),
            Some(AccessError::NoRight)
        );
        assert!(r.lendable(r.base, 8));
        let first = r.lend(1, r.base + 4, 8, Access::empty()).unwrap();
        let mut got = [0u8; 8];
        assert_eq!(first.copy_out(2, &mut got), 6);
        assert_eq!(got, [3, 3, 3, 3, 3, 3, 0, 0]);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let r2 = r.clone();
            s.spawn(move || {
                r2.invalidate();
                tx.send(()).unwrap();
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(rx.try_recv().is_err(), "invalidation waits for the lease");
            let second = r.lend(1, r.base, 8, Access::empty()).unwrap();
            drop((first, second));
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .expect("invalidation returns once the leases are gone");
        });
        assert_eq!(
            r.lend(1, r.base, 8, Access::empty()).err(),
            Some(AccessError::Invalidated)
        );
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
    fn windows_bind_narrow_and_die_with_their_registration() {
        let t = MrTable::new(16);
        let mut b = vec![0u8; 64];
        let mr = buf_region(&t, &mut b, Access::LOCAL_WRITE | Access::MW_BIND);
        let mw = t.alloc_window(1).unwrap();
        assert_eq!(
            t.lookup(mw).unwrap_err(),
            AccessError::InvalidStag,
            "unbound"
        );
        let key1 = (mw & !0xff) | 0x10;
        let w = t
            .bind_window(1, key1, mr.stag, mr.base + 8, 16, Access::REMOTE_WRITE)
            .unwrap();
        assert!(w.is_window());
        let w = t.lookup(key1).unwrap();
        w.write(1, mr.base + 8, &[7; 16], Access::REMOTE_WRITE)
            .unwrap();
        assert_eq!(
            w.write(1, mr.base + 20, &[7; 8], Access::REMOTE_WRITE),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            w.read(1, mr.base + 8, &mut [0; 4], Access::REMOTE_READ),
            Err(AccessError::NoRight)
        );
        // Rebind with a new key: the old key stops matching.
        let key2 = (mw & !0xff) | 0x11;
        t.bind_window(1, key2, mr.stag, mr.base, 64, Access::REMOTE_READ)
            .unwrap();
        assert!(t.lookup(key1).is_err());
        assert!(!w.is_valid(), "the old binding is dead");
        let w2 = t.lookup(key2).unwrap();
        // Wrong PD, rights the registration cannot back, out of bounds: refused.
        assert_eq!(
            t.bind_window(2, key2, mr.stag, mr.base, 8, Access::REMOTE_READ)
                .unwrap_err(),
            BindError::BadRegion
        );
        assert_eq!(
            t.bind_window(1, key2, mr.stag, mr.base, 65, Access::REMOTE_READ)
                .unwrap_err(),
            BindError::OutOfBounds
        );
        assert_eq!(
            t.bind_window(1, mr.stag, mr.stag, mr.base, 8, Access::REMOTE_READ)
                .unwrap_err(),
            BindError::NotAWindow
        );
        // Deregistering the registration kills the window bound onto it.
        t.deregister(mr.stag).unwrap();
        assert!(!w2.is_valid());
        t.dealloc_window(key2).unwrap();
        assert_eq!(t.windows(), 0);
        drop((w, w2, mr));
        assert_eq!(&b[8..24], &[7; 16]);
    }

    #[test]
    fn windows_need_bind_rights() {
        let t = MrTable::new(16);
        let mut b = vec![0u8; 64];
        let mr = buf_region(&t, &mut b, Access::LOCAL_WRITE);
        let mw = t.alloc_window(1).unwrap();
        assert_eq!(
            t.bind_window(1, mw, mr.stag, mr.base, 8, Access::REMOTE_READ)
                .unwrap_err(),
            BindError::Rights
        );
        // Unbind of an unbound window is fine.
        t.bind_window(1, mw, 0, 0, 0, Access::empty()).unwrap();
        assert!(t.lookup(mw).is_err());
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
