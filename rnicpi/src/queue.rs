//! Work and completion rings in memory shared by the consumer (uVP) and the engine.
//!
//! This is the fast path of the stack: the consumer writes [`Wqe`](crate::Wqe)s into
//! a send or receive ring and rings a doorbell; the engine writes
//! [`Cqe`](crate::Cqe)s into a completion ring that the consumer polls without a
//! system call. A ring is a single-producer / single-consumer queue of fixed-size
//! plain-old-data slots behind a small header of free-running 32-bit indices.
//!
//! The memory is a sealed `memfd`: in embedded mode both sides map it in one process;
//! in daemon mode the consumer creates it and the daemon takes a copy of the descriptor
//! (`pidfd_getfd`) and maps it too. The other side may be hostile:
//!
//! * the file must be a memfd sealed against shrinking, growing and further sealing
//!   ([`SharedMem::from_fd`] refuses anything else), so the consumer can never truncate
//!   it under the daemon and turn the daemon's next ring access into a SIGBUS;
//! * each side is either the [`Producer`] or the [`Consumer`] of a ring and keeps **its
//!   own index privately**: it writes it to the header for the other side, and never
//!   reads it back. Only the other side's index is read from shared memory, and an
//!   index that puts more than `capacity` entries between the two is [`RingCorrupt`];
//! * slots are copied out once before they are looked at, and capacities are private.
//!
//! Over 600 lines: the ring code is the first 480 lines; the rest are its tests.

use crate::error::{Result, VerbsError};
use bytemuck::Pod;
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// The seals a ring's memfd must carry: its size can never change again, and nobody can
/// add a seal (such as `F_SEAL_WRITE`) that would make the daemon's mapping fault.
pub const RING_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Why a descriptor was refused as the memory of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RingMemError {
    /// Not a memfd (no seals can be read: a regular file, a socket, a FUSE file, ...).
    #[error("ring memory is not a memfd")]
    NotMemfd,
    /// A hugetlbfs memfd: a hole punched in it later faults in a huge page that the pool
    /// may not have, which is a SIGBUS in whoever touches it.
    #[error("ring memory is a hugetlbfs memfd")]
    Hugetlb,
    /// A memfd without the seals of [`RING_SEALS`].
    #[error("ring memfd is not sealed against shrinking, growing and sealing (seals {0:#x})")]
    NotSealed(i32),
    /// Smaller than the ring needs (or a zero-length ring).
    #[error("ring memfd holds {have} bytes, the ring needs {need}")]
    TooSmall { have: u64, need: u64 },
    /// The kernel refused to map it (for instance a write seal).
    #[error("ring memfd cannot be mapped shared and writable (errno {0})")]
    Map(i32),
}

impl From<RingMemError> for VerbsError {
    fn from(_: RingMemError) -> Self {
        VerbsError::Invalid
    }
}

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

/// The seals of `fd`, or `None` when it is not a memfd (nor another sealable shmem file).
fn seals_of(fd: BorrowedFd<'_>) -> Option<i32> {
    // SAFETY: F_GET_SEALS only reads the seals of the file behind a descriptor we hold;
    // on a file that is not shmem or hugetlbfs it fails with EINVAL and touches nothing
    // (it never reaches a FUSE server or any other file system's code).
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    (seals >= 0).then_some(seals)
}

/// Whether `fd` (known to be sealable: shmem or hugetlbfs) lives on shmem.
fn on_shmem(fd: BorrowedFd<'_>) -> bool {
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: fstatfs fills the struct we pass for a descriptor we hold; the file is a
    // memfd (its seals were read), so no other file system's code is reached.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so it initialised the struct.
    let st = unsafe { st.assume_init() };
    st.f_type == libc::TMPFS_MAGIC
}

impl SharedMem {
    /// Create a new zero-filled memfd of `len` bytes, sealed as [`RING_SEALS`], and map it.
    pub fn create(name: &str, len: usize) -> Result<Self> {
        let cname = std::ffi::CString::new(name).map_err(|_| VerbsError::Invalid)?;
        // SAFETY: memfd_create takes a valid NUL-terminated string and flags; it returns a new fd or -1.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        let file = std::fs::File::from(fd);
        file.set_len(len as u64)?;
        // SAFETY: F_ADD_SEALS on a memfd we own, with seal bits only.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, RING_SEALS) } < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Self::map(file.into(), len).map_err(VerbsError::from)
    }

    /// Map a memfd received from the other side, of at least `len` bytes. Refused unless
    /// it is a memfd sealed as [`RING_SEALS`]: then its size is fixed for good and the
    /// mapping can never lose its pages under us. The seals are checked before anything
    /// else touches the file.
    pub fn from_fd(fd: OwnedFd, len: usize) -> Result<Self, RingMemError> {
        let seals = seals_of(fd.as_fd()).ok_or(RingMemError::NotMemfd)?;
        if seals & RING_SEALS != RING_SEALS {
            return Err(RingMemError::NotSealed(seals));
        }
        if !on_shmem(fd.as_fd()) {
            return Err(RingMemError::Hugetlb);
        }
        let file = std::fs::File::from(fd);
        let have = file
            .metadata()
            .map_err(|e| RingMemError::Map(e.raw_os_error().unwrap_or(libc::EIO)))?
            .len();
        if have < len as u64 || len == 0 {
            return Err(RingMemError::TooSmall {
                have,
                need: len as u64,
            });
        }
        Self::map(file.into(), len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self, RingMemError> {
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&fd)
            .map_err(|e| RingMemError::Map(e.raw_os_error().unwrap_or(libc::EIO)))?;
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

/// Offsets of the ring header fields (part of the ABI); each index has its own cache
/// line. `NOTIFY` is the consumer's arm word on a completion ring ([`notify`]), and on a
/// receive ring the engine's word saying whether a post needs a doorbell
/// ([`Consumer::want_doorbells`]). `WAKE`, beside it, counts the notifications a
/// completion ring's engine gave by waking the futex on that word ([`notify::WAKE`]),
/// and `SIGNALS` the bytes it wrote to the CQ's signal socket ([`notify::SIGNAL`]).
pub const PRODUCER: usize = 0;
pub const CONSUMER: usize = 64;
pub const NOTIFY: usize = 128;
pub const WAKE: usize = 132;
pub const SIGNALS: usize = 136;
/// Bytes before the first slot.
pub const RING_HEADER: usize = 192;

/// Arm states of a completion ring (`notify` word).
pub mod notify {
    pub const NONE: u32 = 0;
    /// Signal on the next completion.
    pub const NEXT: u32 = 1;
    /// Signal on the next solicited or error completion.
    pub const SOLICITED: u32 = 2;
    /// With `NEXT` or `SOLICITED`: signal by bumping the ring's `WAKE` word and waking
    /// the futex on it (a thread of the consumer sleeps there), not by a `CqNotify` event.
    pub const WAKE: u32 = 4;
    /// With `NEXT` or `SOLICITED`: signal through the CQ's signal socket (a byte the
    /// consumer's descriptor reads), not by a `CqNotify` event. May go with `WAKE`.
    pub const SIGNAL: u32 = 8;
}

/// How an armed completion ring's notification is given ([`Producer::take_notify`]):
/// a `CqNotify` event, unless the arm asked for a wake-up, a signal, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notification {
    /// Wake the futex on the `WAKE` word ([`Producer::wake`]).
    pub wake: bool,
    /// Write to the CQ's signal socket.
    pub signal: bool,
}

impl Notification {
    /// Plain `CqNotify`: neither a wake-up nor a signal.
    pub const EVENT: Notification = Notification {
        wake: false,
        signal: false,
    };

    /// Given as a `CqNotify` event.
    pub fn is_event(self) -> bool {
        !self.wake && !self.signal
    }
}

/// The bytes a ring of `capacity` slots of `T` needs.
pub fn ring_bytes<T>(capacity: u32) -> usize {
    RING_HEADER + capacity as usize * std::mem::size_of::<T>()
}

/// Round a requested depth up to the power of two a ring uses (at least 1).
pub fn ring_capacity(requested: u32) -> Option<u32> {
    requested.max(1).checked_next_power_of_two()
}

/// An SPSC ring of `T` slots in shared memory, not yet given a side: turn it into the
/// [`Producer`] or the [`Consumer`] end, each of which keeps its own index privately.
pub struct Ring<T: Pod> {
    base: *mut u8,
    cap: u32,
    mem: std::sync::Arc<SharedMem>,
    _t: PhantomData<T>,
}

// SAFETY: the ring only touches the shared mapping through atomics and raw volatile
// copies, never through references into it, and the Arc keeps the mapping alive as long
// as the view. The mapping's pages cannot go away under it either: `SharedMem` maps only
// memfds sealed against shrinking (`RING_SEALS`).
unsafe impl<T: Pod> Send for Ring<T> {}
// SAFETY: as above; the ends that mutate (`Producer`, `Consumer`) need `&mut self` for
// it, and every `&self` method only reads or atomically updates the shared words.
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
            mem,
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

    /// The memory the ring lives in.
    pub fn memory(&self) -> &std::sync::Arc<SharedMem> {
        &self.mem
    }

    /// Become the producing end; its index starts where the header says now and is kept
    /// privately from here on.
    pub fn producer(self) -> Producer<T> {
        let head = self.word(PRODUCER).load(Ordering::Acquire);
        Producer { ring: self, head }
    }

    /// Become the consuming end; its index starts where the header says now and is kept
    /// privately from here on.
    pub fn consumer(self) -> Consumer<T> {
        let tail = self.word(CONSUMER).load(Ordering::Acquire);
        Consumer { ring: self, tail }
    }
}

/// The producing end of a ring: the consumer's index is read from shared memory, our own
/// is private (`head`) and only ever written there.
pub struct Producer<T: Pod> {
    ring: Ring<T>,
    head: u32,
}

impl<T: Pod> std::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("cap", &self.ring.cap)
            .field("head", &self.head)
            .finish()
    }
}

impl<T: Pod> Producer<T> {
    pub fn capacity(&self) -> u32 {
        self.ring.cap
    }

    /// The memory the ring lives in.
    pub fn memory(&self) -> &std::sync::Arc<SharedMem> {
        &self.ring.mem
    }

    /// Entries produced and not yet consumed, or `RingCorrupt` when the consumer's index
    /// is ahead of ours or more than a ring behind.
    pub fn used(&self) -> Result<u32, RingCorrupt> {
        let c = self.ring.word(CONSUMER).load(Ordering::Acquire);
        let n = self.head.wrapping_sub(c);
        if n > self.ring.cap {
            Err(RingCorrupt)
        } else {
            Ok(n)
        }
    }

    /// Append one entry; `Ok(false)` when the ring is full.
    pub fn push(&mut self, item: &T) -> Result<bool, RingCorrupt> {
        if self.used()? == self.ring.cap {
            return Ok(false);
        }
        // SAFETY: the slot is inside the ring; the consumer does not read it until the
        // producer index below is published; a volatile write tolerates a hostile reader.
        unsafe { std::ptr::write_volatile(self.ring.slot(self.head), *item) };
        self.head = self.head.wrapping_add(1);
        self.ring.word(PRODUCER).store(self.head, Ordering::Release);
        Ok(true)
    }

    /// Receive rings, consumer side (the uAL): whether the engine asked for a doorbell
    /// after each post ([`Consumer::want_doorbells`]). Called after the push: the same
    /// store-then-load pairing as [`Consumer::arm`], so either this load sees the
    /// engine's request or the engine's drain that follows it sees the entry.
    pub fn wants_doorbell(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.ring.word(NOTIFY).load(Ordering::Acquire) != 0
    }

    /// Completion rings, engine side: whether a completion with the given solicited
    /// (or error) property fires the consumer's armed notification, and how it is to be
    /// given; disarms when it fires.
    pub fn take_notify(&self, solicited_or_error: bool) -> Option<Notification> {
        // The completion was published just before; see `Consumer::arm` for the fence.
        std::sync::atomic::fence(Ordering::SeqCst);
        let w = self.ring.word(NOTIFY);
        let cur = w.load(Ordering::Acquire);
        let fire = match cur & !(notify::WAKE | notify::SIGNAL) {
            notify::NEXT => true,
            notify::SOLICITED => solicited_or_error,
            _ => false, // unarmed, or a value the consumer made up
        };
        let taken = fire
            && w.compare_exchange(cur, notify::NONE, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok();
        taken.then_some(Notification {
            wake: cur & notify::WAKE != 0,
            signal: cur & notify::SIGNAL != 0,
        })
    }

    /// Completion rings, engine side: give a [`Notification::Wake`] — count it in the
    /// `WAKE` word and wake whoever sleeps on it. Never blocks, whatever the consumer
    /// wrote into the ring.
    pub fn wake(&self) {
        count_and_wake(self.ring.word(WAKE));
    }

    /// Completion rings, engine side: count a [`Notification::signal`] in the `SIGNALS`
    /// word (+1) before its byte is written, and take it back (-1) if none was.
    pub fn count_signal(&self, delta: i32) {
        self.ring
            .word(SIGNALS)
            .fetch_add(delta as u32, Ordering::AcqRel);
    }
}

/// The consuming end of a ring: the producer's index is read from shared memory, our own
/// is private (`tail`) and only ever written there.
pub struct Consumer<T: Pod> {
    ring: Ring<T>,
    tail: u32,
}

impl<T: Pod> std::fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("cap", &self.ring.cap)
            .field("tail", &self.tail)
            .finish()
    }
}

impl<T: Pod> Consumer<T> {
    pub fn capacity(&self) -> u32 {
        self.ring.cap
    }

    /// The memory the ring lives in.
    pub fn memory(&self) -> &std::sync::Arc<SharedMem> {
        &self.ring.mem
    }

    /// Entries queued and not yet consumed (at most `capacity`), or `RingCorrupt` when
    /// the producer's index is behind ours or more than a ring ahead.
    pub fn len(&self) -> Result<u32, RingCorrupt> {
        let p = self.ring.word(PRODUCER).load(Ordering::Acquire);
        let n = p.wrapping_sub(self.tail);
        if n > self.ring.cap {
            Err(RingCorrupt)
        } else {
            Ok(n)
        }
    }

    /// Whether nothing is queued (a corrupt ring counts as empty).
    pub fn is_empty(&self) -> bool {
        matches!(self.len(), Ok(0) | Err(_))
    }

    /// Copy out the oldest entry without consuming it.
    pub fn peek(&self) -> Result<Option<T>, RingCorrupt> {
        if self.len()? == 0 {
            return Ok(None);
        }
        // SAFETY: the slot is inside the ring and was published by the producer's
        // release store (acquired in len()); the copy is taken once and then validated
        // by the caller, so a hostile producer rewriting it cannot cause a TOCTOU.
        Ok(Some(unsafe {
            std::ptr::read_volatile(self.ring.slot(self.tail))
        }))
    }

    /// Drop the oldest entry (after a `peek` that returned one).
    pub fn advance(&mut self) {
        self.tail = self.tail.wrapping_add(1);
        self.ring.word(CONSUMER).store(self.tail, Ordering::Release);
    }

    /// Take the oldest entry.
    pub fn pop(&mut self) -> Result<Option<T>, RingCorrupt> {
        let item = self.peek()?;
        if item.is_some() {
            self.advance();
        }
        Ok(item)
    }

    /// Take exactly the entries queued now (never more than `capacity`, whatever the
    /// producer writes meanwhile) and hand each to `f`; returns how many. This is how an
    /// engine flushes a ring: over a range fixed at the start, never "until empty".
    pub fn drain_queued(&mut self, mut f: impl FnMut(T)) -> Result<u32, RingCorrupt> {
        let n = self.len()?;
        for _ in 0..n {
            // SAFETY: as in `peek`: the n slots from our index were published before the
            // producer index we read in len(), and each is copied out once.
            let item = unsafe { std::ptr::read_volatile(self.ring.slot(self.tail)) };
            self.advance();
            f(item);
        }
        Ok(n)
    }

    /// Completion rings, consumer side: request a notification ([`notify`] values).
    ///
    /// The consumer arms and then looks at the producer index once more; the engine
    /// publishes a completion and then looks at the arm word (`Producer::take_notify`).
    /// Each side stores one word and loads the other, so each needs a full fence between
    /// the two (release/acquire does not order a store before a later load — x86 itself
    /// reorders them): with the fences at least one side sees the other's store, and no
    /// completion lands unseen by both the consumer's second look and the notification.
    pub fn arm(&self, how: u32) {
        self.ring.word(NOTIFY).store(how, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Completion rings, consumer side: how many bytes the engine has written to the
    /// signal socket (the `SIGNALS` word; each counted just before it is written, so a
    /// consumer that has read fewer knows more are in the socket or about to be).
    pub fn signals_given(&self) -> u32 {
        self.ring.word(SIGNALS).load(Ordering::Acquire)
    }

    /// Completion rings, consumer side: the ring's `WAKE` word, to sleep on without
    /// holding the consumer end.
    pub fn wake_word(&self) -> WakeWord {
        WakeWord {
            mem: self.ring.mem.clone(),
            off: self.ring.base as usize - self.ring.mem.as_ptr() as usize + WAKE,
        }
    }

    /// Receive rings, engine side: from now on every post needs a doorbell. The engine
    /// takes receives when messages arrive and needs no doorbell for them — until the
    /// QP is in Error, where each receive posted must complete flushed at once. Call it
    /// before draining the ring (see [`Producer::wants_doorbell`] for the fence).
    pub fn want_doorbells(&self) {
        self.ring.word(NOTIFY).store(1, Ordering::Release);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Recovery after a corrupt producer index: mark everything produced as consumed.
    pub fn resync(&mut self) {
        self.tail = self.ring.word(PRODUCER).load(Ordering::Acquire);
        self.ring.word(CONSUMER).store(self.tail, Ordering::Release);
    }
}

/// A completion ring's `WAKE` word, consumer side: where a thread sleeps until the engine
/// gives a [`Notification::Wake`].
#[derive(Debug, Clone)]
pub struct WakeWord {
    mem: std::sync::Arc<SharedMem>,
    /// Offset of the word in the mapping (4-byte aligned, inside it: taken from an
    /// attached ring's header).
    off: usize,
}

/// Count a wake-up in a ring's `WAKE` word and wake whoever sleeps on it.
fn count_and_wake(w: &AtomicU32) {
    w.fetch_add(1, Ordering::AcqRel);
    // SAFETY: FUTEX_WAKE only looks up waiters keyed by the word's address, which lies
    // inside a live ring mapping (the callers' `word`); it reads and writes no memory.
    // Shared (not FUTEX_PRIVATE): the sleeper may be another process mapping the file.
    unsafe {
        libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

impl WakeWord {
    /// Wake the ring's sleepers from the consumer's side (something other than a
    /// completion ends their sleep).
    pub fn wake(&self) {
        count_and_wake(self.word());
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: `off` is a ring header word of a ring checked at attach, so it is
        // aligned and inside the mapping, which the Arc keeps alive.
        unsafe { &*(self.mem.as_ptr().add(self.off) as *const AtomicU32) }
    }

    /// The count of wake-ups given so far: read it before arming with
    /// [`notify::WAKE`], then hand it to [`WakeWord::sleep`].
    pub fn count(&self) -> u32 {
        self.word().load(Ordering::Acquire)
    }

    /// Sleep until the engine gives a wake-up after `seen` was read, or `timeout`
    /// passes (or a signal comes). A wake-up given between the read and the sleep
    /// returns at once: the kernel compares the word with `seen` under its own lock.
    pub fn sleep(&self, seen: u32, timeout: std::time::Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: the word lies inside our live mapping (`word`); FUTEX_WAIT only reads
        // it, and `ts` outlives the call.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word().as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
            );
        }
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
    use std::time::Duration;

    fn ring<T: Pod>(cap: u32) -> (Producer<T>, Consumer<T>) {
        let mem = Arc::new(SharedMem::create("t", ring_bytes::<T>(cap)).unwrap());
        (
            Ring::attach(mem.clone(), 0, cap).unwrap().producer(),
            Ring::attach(mem, 0, cap).unwrap().consumer(),
        )
    }

    /// Another view of the same ring, to write its header as a hostile side would.
    fn raw<T: Pod>(p: &Producer<T>) -> &Ring<T> {
        &p.ring
    }

    #[test]
    fn fifo_and_full() {
        let (mut p, mut c) = ring::<Cqe>(4);
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
        let (mut p, mut c) = ring::<Wqe>(2);
        for i in 0..10_000u64 {
            assert!(p.push(&Wqe::new(i, WrOpcode::Send, &[])).unwrap());
            assert_eq!(c.pop().unwrap().unwrap().wr_id, i);
        }
    }

    #[test]
    fn corrupt_indices_detected() {
        let (mut p, mut c) = ring::<Cqe>(4);
        raw(&p).word(PRODUCER).store(1000, Ordering::Relaxed);
        assert_eq!(c.pop(), Err(RingCorrupt));
        raw(&p).word(CONSUMER).store(1000, Ordering::Relaxed);
        assert_eq!(p.push(&Cqe::default()), Err(RingCorrupt));
    }

    #[test]
    fn own_index_is_never_read_back() {
        let (mut p, mut c) = ring::<Cqe>(4);
        assert!(p.push(&Cqe::default()).unwrap());
        // The consumer rewinds the producer index it does not own: the producer keeps
        // its own view and sees the consumer's index as ahead of it, i.e. corrupt.
        raw(&p).word(PRODUCER).store(0, Ordering::Relaxed);
        assert_eq!(c.len(), Ok(0));
        assert!(
            p.push(&Cqe::default()).unwrap(),
            "producer keeps its own index"
        );
        assert_eq!(raw(&p).word(PRODUCER).load(Ordering::Relaxed), 2);
        // The producer rewinds the consumer index: the consumer keeps its own view.
        assert_eq!(c.pop().unwrap().map(|_| ()), Some(()));
        raw(&p).word(CONSUMER).store(0, Ordering::Relaxed);
        assert_eq!(c.len(), Ok(1));
    }

    #[test]
    fn drain_queued_takes_a_fixed_range() {
        let (mut p, mut c) = ring::<Cqe>(4);
        for i in 0..3 {
            assert!(p
                .push(&Cqe {
                    wr_id: i,
                    ..Default::default()
                })
                .unwrap());
        }
        let mut seen = Vec::new();
        let producer = raw(&p);
        let n = c
            .drain_queued(|e| {
                seen.push(e.wr_id);
                // A hostile producer keeps the ring looking full while we flush.
                let cons = producer.word(CONSUMER).load(Ordering::Relaxed);
                producer.word(PRODUCER).store(cons + 4, Ordering::Relaxed);
            })
            .unwrap();
        assert_eq!((n, seen), (3, vec![0, 1, 2]));
    }

    #[test]
    fn arm_semantics() {
        let (p, c) = ring::<Cqe>(4);
        assert_eq!(p.take_notify(true), None);
        c.arm(notify::SOLICITED);
        assert_eq!(p.take_notify(false), None);
        assert_eq!(p.take_notify(true), Some(Notification::EVENT));
        assert_eq!(p.take_notify(true), None, "fires once per arm");
        c.arm(notify::NEXT);
        assert_eq!(p.take_notify(false), Some(Notification::EVENT));
        c.arm(notify::SOLICITED | notify::WAKE);
        assert_eq!(p.take_notify(false), None);
        let wake = Notification {
            wake: true,
            signal: false,
        };
        assert_eq!(p.take_notify(true), Some(wake));
        c.arm(notify::NEXT | notify::SIGNAL);
        let signal = Notification {
            wake: false,
            signal: true,
        };
        assert_eq!(p.take_notify(false), Some(signal));
        assert_eq!(p.take_notify(false), None, "a notification given disarms");
        assert_eq!(c.signals_given(), 0);
        p.count_signal(1);
        p.count_signal(1);
        p.count_signal(-1);
        assert_eq!(c.signals_given(), 1);
        c.arm(notify::NEXT | notify::SIGNAL | notify::WAKE);
        let both = Some(Notification {
            wake: true,
            signal: true,
        });
        assert_eq!(p.take_notify(false), both);
        // Whatever else the consumer writes there arms nothing.
        for junk in [notify::WAKE, notify::SIGNAL, 3, 7, 11, u32::MAX] {
            c.arm(junk);
            assert_eq!(p.take_notify(true), None, "{junk:#x}");
        }
    }

    #[test]
    fn a_sleeper_is_woken_by_the_engine_and_never_misses_a_wake_up() {
        let (p, c) = ring::<Cqe>(4);
        let w = c.wake_word();
        // A wake-up given after the count was read and before the sleep: no sleep at all.
        let seen = w.count();
        p.wake();
        let t = std::time::Instant::now();
        w.sleep(seen, Duration::from_secs(3600));
        assert!(t.elapsed() < Duration::from_secs(600));
        // A sleeper on another thread is woken.
        let seen = w.count();
        let sleeper = {
            let w = w.clone();
            std::thread::spawn(move || {
                while w.count() == seen {
                    w.sleep(seen, Duration::from_secs(3600));
                }
            })
        };
        std::thread::sleep(Duration::from_millis(10));
        p.wake();
        sleeper.join().unwrap();
        assert_eq!(w.count(), seen.wrapping_add(1));
    }

    #[test]
    fn attach_rejects_bad_geometry() {
        let mem = Arc::new(SharedMem::create("t", 4096).unwrap());
        assert!(Ring::<Cqe>::attach(mem.clone(), 0, 3).is_err());
        assert!(Ring::<Cqe>::attach(mem.clone(), 0, 1 << 20).is_err());
        assert!(Ring::<Cqe>::attach(mem, 8, 4).is_err());
    }

    fn memfd(flags: libc::c_uint, len: i64) -> OwnedFd {
        // SAFETY: a valid NUL-terminated name; returns a new fd or -1 (checked).
        let fd = unsafe { libc::memfd_create(c"t".as_ptr(), flags) };
        assert!(fd >= 0);
        // SAFETY: fresh descriptor; ftruncate on it.
        unsafe {
            assert_eq!(libc::ftruncate(fd, len), 0);
            <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd)
        }
    }

    fn seal(fd: &OwnedFd, seals: i32) {
        // SAFETY: F_ADD_SEALS on a memfd we own.
        assert_eq!(
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) },
            0
        );
    }

    #[test]
    fn only_sealed_memfds_back_a_ring() {
        let ok = memfd(libc::MFD_ALLOW_SEALING, 8192);
        seal(&ok, RING_SEALS);
        SharedMem::from_fd(ok, 8192).unwrap();

        let unsealed = memfd(0, 8192);
        assert_eq!(
            SharedMem::from_fd(unsealed, 8192).unwrap_err(),
            RingMemError::NotSealed(libc::F_SEAL_SEAL)
        );
        let shrink_only = memfd(libc::MFD_ALLOW_SEALING, 8192);
        seal(&shrink_only, libc::F_SEAL_SHRINK);
        assert!(matches!(
            SharedMem::from_fd(shrink_only, 8192),
            Err(RingMemError::NotSealed(_))
        ));
        let small = memfd(libc::MFD_ALLOW_SEALING, 4096);
        seal(&small, RING_SEALS);
        assert!(matches!(
            SharedMem::from_fd(small, 8192),
            Err(RingMemError::TooSmall { .. })
        ));
        let huge = memfd(libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB, 2 << 20);
        seal(&huge, RING_SEALS);
        assert_eq!(
            SharedMem::from_fd(huge, 8192).unwrap_err(),
            RingMemError::Hugetlb
        );
        let write_sealed = memfd(libc::MFD_ALLOW_SEALING, 8192);
        seal(&write_sealed, libc::F_SEAL_WRITE | RING_SEALS);
        assert!(matches!(
            SharedMem::from_fd(write_sealed, 8192),
            Err(RingMemError::Map(_))
        ));
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(
            SharedMem::from_fd(file.into(), 8192).unwrap_err(),
            RingMemError::NotMemfd
        );
        let mut fds = [0; 2];
        // SAFETY: pipe writes two new descriptors into the array; we own both.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fresh descriptors nobody else owns.
        let (r, _w) = unsafe {
            use std::os::fd::FromRawFd;
            (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))
        };
        assert_eq!(
            SharedMem::from_fd(r, 8192).unwrap_err(),
            RingMemError::NotMemfd
        );
    }

    #[test]
    fn created_rings_are_sealed() {
        let m = SharedMem::create("t", 4096).unwrap();
        assert_eq!(seals_of(m.fd()).unwrap() & RING_SEALS, RING_SEALS);
        // SAFETY: ftruncate on a descriptor we hold; it must fail (sealed).
        assert_ne!(unsafe { libc::ftruncate(m.fd().as_raw_fd(), 0) }, 0);
    }
}
