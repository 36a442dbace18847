//! Work and completion rings in memory shared by the consumer (uVP) and the engine.
//!
//! This is the fast path of the stack: the consumer writes [`Wqe`](crate::Wqe)s into
//! a send or receive ring and rings a doorbell; the engine writes
//! [`Cqe`](crate::Cqe)s into a completion ring that the consumer polls without a
//! system call. A ring is a single-producer / single-consumer queue of fixed-size
//! plain-old-data slots behind a small header of free-running 32-bit indices.
//!
//! The memory is a `memfd` mapping: in embedded mode both sides map it in one
//! process; in daemon mode the consumer creates it and the daemon takes a copy of
//! the descriptor (`pidfd_getfd`) and maps it too. The other side may be hostile:
//! every index read from the header is validated, capacities are kept privately,
//! and slots are copied out before they are looked at.

use crate::error::{Result, VerbsError};
use bytemuck::Pod;
use std::marker::PhantomData;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// A mapping of a memfd, shared between the consumer and the engine.
pub struct SharedMem {
    map: memmap2::MmapRaw,
    fd: OwnedFd,
}

impl std::fmt::Debug for SharedMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMem")
            .field("len", &self.len())
            .finish()
    }
}

impl SharedMem {
    /// Create a new zero-filled memfd of `len` bytes and map it.
    pub fn create(name: &str, len: usize) -> Result<Self> {
        let cname = std::ffi::CString::new(name).map_err(|_| VerbsError::Invalid)?;
        // SAFETY: memfd_create takes a valid NUL-terminated string and flags; it returns a new fd or -1.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let file = std::fs::File::from(fd);
        file.set_len(len as u64)?;
        Self::map(file.into(), len)
    }

    /// Map an existing memfd (received from the other side) of at least `len` bytes.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Self> {
        let file = std::fs::File::from(fd);
        let actual = file.metadata()?.len();
        if actual < len as u64 || len == 0 {
            return Err(VerbsError::Invalid);
        }
        Self::map(file.into(), len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self> {
        let map = memmap2::MmapOptions::new().len(len).map_raw(&fd)?;
        Ok(SharedMem { map, fd })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Offsets of the ring header fields; each index has its own cache line.
const PRODUCER: usize = 0;
const CONSUMER: usize = 64;
const NOTIFY: usize = 128;
/// Bytes before the first slot.
pub const RING_HEADER: usize = 192;

/// Arm states of a completion ring (`notify` word).
pub mod notify {
    pub const NONE: u32 = 0;
    /// Signal on the next completion.
    pub const NEXT: u32 = 1;
    /// Signal on the next solicited or error completion.
    pub const SOLICITED: u32 = 2;
}

/// The bytes a ring of `capacity` slots of `T` needs.
pub fn ring_bytes<T>(capacity: u32) -> usize {
    RING_HEADER + capacity as usize * std::mem::size_of::<T>()
}

/// Round a requested depth up to the power of two a ring uses (at least 1).
pub fn ring_capacity(requested: u32) -> Option<u32> {
    requested.max(1).checked_next_power_of_two()
}

/// An SPSC ring of `T` slots in shared memory. Each side keeps its own `Ring` view;
/// callers serialise producers among themselves and consumers among themselves.
pub struct Ring<T: Pod> {
    base: *mut u8,
    cap: u32,
    _mem: std::sync::Arc<SharedMem>,
    _t: PhantomData<T>,
}

// SAFETY: the ring only touches the shared mapping through atomics and raw
// volatile copies, and the Arc keeps the mapping alive as long as the view.
unsafe impl<T: Pod> Send for Ring<T> {}
// SAFETY: as above; concurrent use from several threads is serialised by callers
// (documented contract), and no reference into the mapping is ever handed out.
unsafe impl<T: Pod> Sync for Ring<T> {}

impl<T: Pod> std::fmt::Debug for Ring<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("cap", &self.cap).finish()
    }
}

/// The ring's indices no longer make sense: the other side wrote garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("shared ring indices are corrupt")]
pub struct RingCorrupt;

impl<T: Pod> Ring<T> {
    /// View `capacity` slots at byte `offset` of `mem`. `capacity` must be a power of two
    /// and the ring must fit; the header is left as found (both sides attach to one ring).
    pub fn attach(mem: std::sync::Arc<SharedMem>, offset: usize, capacity: u32) -> Result<Self> {
        if !capacity.is_power_of_two() || !offset.is_multiple_of(64) {
            return Err(VerbsError::Invalid);
        }
        let end = offset
            .checked_add(ring_bytes::<T>(capacity))
            .ok_or(VerbsError::Invalid)?;
        if end > mem.len() {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: offset + ring size lies within the mapping (checked above).
        let base = unsafe { mem.as_ptr().add(offset) };
        Ok(Ring {
            base,
            cap: capacity,
            _mem: mem,
            _t: PhantomData,
        })
    }

    fn word(&self, off: usize) -> &AtomicU32 {
        // SAFETY: off is one of the header offsets, 4-byte aligned (mapping and offset
        // are 64-aligned) and inside the mapping; AtomicU32 tolerates concurrent writers.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn slot(&self, idx: u32) -> *mut T {
        let i = (idx & (self.cap - 1)) as usize;
        // SAFETY: i < cap, so the slot lies inside the ring checked at attach.
        unsafe { self.base.add(RING_HEADER + i * std::mem::size_of::<T>()) as *mut T }
    }

    pub fn capacity(&self) -> u32 {
        self.cap
    }

    /// Entries queued and not yet consumed, or `RingCorrupt` when the indices disagree.
    pub fn len(&self) -> Result<u32, RingCorrupt> {
        let p = self.word(PRODUCER).load(Ordering::Acquire);
        let c = self.word(CONSUMER).load(Ordering::Acquire);
        let n = p.wrapping_sub(c);
        if n > self.cap {
            Err(RingCorrupt)
        } else {
            Ok(n)
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self.len(), Ok(0))
    }

    /// Producer side: append one entry; `Ok(false)` when the ring is full.
    pub fn push(&self, item: &T) -> Result<bool, RingCorrupt> {
        let p = self.word(PRODUCER).load(Ordering::Relaxed);
        let c = self.word(CONSUMER).load(Ordering::Acquire);
        let used = p.wrapping_sub(c);
        if used > self.cap {
            return Err(RingCorrupt);
        }
        if used == self.cap {
            return Ok(false);
        }
        // SAFETY: the slot is inside the ring; the consumer does not read it until the
        // producer index below is published; a volatile write tolerates a hostile reader.
        unsafe { std::ptr::write_volatile(self.slot(p), *item) };
        self.word(PRODUCER)
            .store(p.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Consumer side: copy out the oldest entry without consuming it.
    pub fn peek(&self) -> Result<Option<T>, RingCorrupt> {
        if self.len()? == 0 {
            return Ok(None);
        }
        let c = self.word(CONSUMER).load(Ordering::Relaxed);
        // SAFETY: the slot is inside the ring and was published by the producer's
        // release store (acquired in len()); the copy is taken once and then validated
        // by the caller, so a hostile producer rewriting it cannot cause a TOCTOU.
        Ok(Some(unsafe { std::ptr::read_volatile(self.slot(c)) }))
    }

    /// Consumer side: drop the oldest entry (after `peek`).
    pub fn advance(&self) {
        let c = self.word(CONSUMER).load(Ordering::Relaxed);
        self.word(CONSUMER)
            .store(c.wrapping_add(1), Ordering::Release);
    }

    /// Consumer side: take the oldest entry.
    pub fn pop(&self) -> Result<Option<T>, RingCorrupt> {
        let item = self.peek()?;
        if item.is_some() {
            self.advance();
        }
        Ok(item)
    }

    /// Completion rings: the consumer's arm request ([`notify`] values).
    pub fn arm(&self, how: u32) {
        self.word(NOTIFY).store(how, Ordering::Release);
    }

    /// Completion rings, engine side: whether a completion with the given solicited
    /// (or error) property fires the armed notification; disarms when it does.
    pub fn take_notify(&self, solicited_or_error: bool) -> bool {
        let w = self.word(NOTIFY);
        let cur = w.load(Ordering::Acquire);
        let fire = cur == notify::NEXT || (cur == notify::SOLICITED && solicited_or_error);
        fire && w
            .compare_exchange(cur, notify::NONE, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Consumer side, for recovery: mark everything produced as consumed.
    pub fn clear(&self) {
        let p = self.word(PRODUCER).load(Ordering::Acquire);
        self.word(CONSUMER).store(p, Ordering::Release);
    }
}

/// Where each ring of a QP lives inside its one shared mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpRingLayout {
    pub sq_depth: u32,
    pub rq_depth: u32,
    pub sq_offset: usize,
    pub rq_offset: usize,
    pub total: usize,
}

impl QpRingLayout {
    pub fn new(sq_depth: u32, rq_depth: u32) -> Option<Self> {
        let sq_depth = ring_capacity(sq_depth)?;
        let rq_depth = ring_capacity(rq_depth)?;
        let sq_len = ring_bytes::<crate::Wqe>(sq_depth);
        let rq_offset = sq_len.div_ceil(4096) * 4096;
        let total = rq_offset + ring_bytes::<crate::Wqe>(rq_depth);
        Some(QpRingLayout {
            sq_depth,
            rq_depth,
            sq_offset: 0,
            rq_offset,
            total: total.div_ceil(4096) * 4096,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Cqe, Wqe, WrOpcode};
    use std::sync::Arc;

    fn ring<T: Pod>(cap: u32) -> (Ring<T>, Ring<T>) {
        let mem = Arc::new(SharedMem::create("t", ring_bytes::<T>(cap)).unwrap());
        (
            Ring::attach(mem.clone(), 0, cap).unwrap(),
            Ring::attach(mem, 0, cap).unwrap(),
        )
    }

    #[test]
    fn fifo_and_full() {
        let (p, c) = ring::<Cqe>(4);
        for i in 0..4 {
            assert!(p
                .push(&Cqe {
                    wr_id: i,
                    ..Default::default()
                })
                .unwrap());
        }
        assert!(!p.push(&Cqe::default()).unwrap());
        for i in 0..4 {
            assert_eq!(c.pop().unwrap().unwrap().wr_id, i);
        }
        assert!(c.pop().unwrap().is_none());
    }

    #[test]
    fn wraps_u32_indices() {
        let (p, c) = ring::<Wqe>(2);
        for i in 0..10_000u64 {
            assert!(p.push(&Wqe::new(i, WrOpcode::Send, &[])).unwrap());
            assert_eq!(c.pop().unwrap().unwrap().wr_id, i);
        }
    }

    #[test]
    fn corrupt_indices_detected() {
        let (p, c) = ring::<Cqe>(4);
        p.word(PRODUCER).store(1000, Ordering::Relaxed);
        assert_eq!(c.pop(), Err(RingCorrupt));
        assert_eq!(p.push(&Cqe::default()), Err(RingCorrupt));
    }

    #[test]
    fn arm_semantics() {
        let (p, c) = ring::<Cqe>(4);
        assert!(!p.take_notify(true));
        c.arm(notify::SOLICITED);
        assert!(!p.take_notify(false));
        assert!(p.take_notify(true));
        assert!(!p.take_notify(true), "fires once per arm");
        c.arm(notify::NEXT);
        assert!(p.take_notify(false));
    }

    #[test]
    fn attach_rejects_bad_geometry() {
        let mem = Arc::new(SharedMem::create("t", 4096).unwrap());
        assert!(Ring::<Cqe>::attach(mem.clone(), 0, 3).is_err());
        assert!(Ring::<Cqe>::attach(mem.clone(), 0, 1 << 20).is_err());
        assert!(Ring::<Cqe>::attach(mem, 8, 4).is_err());
    }
}
