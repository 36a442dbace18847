//! The two ends of the fast path for providers whose engine runs in software
//! (siw, rxe): the consumer's posting/polling end and the engine's completion end.
//!
//! The consumer end ([`UserQp`], [`UserCq`], [`UserSrq`]) is what a uVP does in the
//! consumer process: validate a work request against the QP's limits, write it into the
//! shared ring and ring the doorbell; poll and arm the shared completion ring. No system
//! call is made on this path in embedded mode; in daemon mode the doorbell is one
//! `write` to an eventfd.
//!
//! The engine end ([`EngineCq`], [`EngineSrq`]) is what a kVP does: append completions
//! (serialised between the engine's threads), take shared receives, count overflows,
//! drops and corrupt rings in [`RingStats`], and fire the armed notification. The
//! consumer may be hostile: every engine loop over a ring is bounded by the ring's
//! capacity, and a ring whose indices make no sense moves its object to an error state
//! (with an event and a counter) instead of being looped over.
//!
//! Over 600 lines: the two ends of the fast path are the first 500 lines; the rest are
//! tests.

use crate::error::{Result, VerbsError};
use crate::event::{Event, EventKind, EventSink};
use crate::progress::{Progress, ProgressSources};
use crate::provider::Counter;
use crate::queue::{Consumer, Producer, RingCorrupt, SharedMem, WakeWord};
use crate::types::{QpCaps, SrqAttr};
use crate::wr::{wc_flags, Cqe, WcStatus, Wqe, WrOpcode, MAX_SGE};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// Tells the engine that a QP's rings have new entries.
pub trait Doorbell: Send + Sync {
    fn ring(&self);
}

/// What the engines did about consumers' rings that they could not serve as asked: one
/// set per kAL, shared by every device (shown by `krdma stat` among the kAL's counters).
#[derive(Debug, Default)]
pub struct RingStats {
    /// Completions lost: the CQ was full, or in error.
    pub cqe_lost: AtomicU64,
    /// Completion rings moved to error because the consumer corrupted their index.
    pub cq_corrupt: AtomicU64,
    /// Send, receive and shared receive rings moved to error (with their QP or SRQ)
    /// because the consumer corrupted their index.
    pub wq_corrupt: AtomicU64,
    /// Shared-receive entries dropped for a scatter list beyond the SRQ's `max_sge`.
    pub srq_dropped: AtomicU64,
    /// Engine calls that stopped at their budget with ring entries left for later.
    pub drain_budget_spent: AtomicU64,
}

impl RingStats {
    pub fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn counters(&self) -> Vec<Counter> {
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("cqe_lost", v(&self.cqe_lost)),
            ("cq_ring_corrupt", v(&self.cq_corrupt)),
            ("wq_ring_corrupt", v(&self.wq_corrupt)),
            ("srq_entries_dropped", v(&self.srq_dropped)),
            ("drain_budget_spent", v(&self.drain_budget_spent)),
        ]
    }
}

/// The consumer's view of one QP's send and receive rings.
pub struct UserQp {
    pub qp_num: u32,
    pub caps: QpCaps,
    sq: Mutex<Producer<Wqe>>,
    rq: Mutex<Producer<Wqe>>,
    doorbell: Arc<dyn Doorbell>,
}

impl std::fmt::Debug for UserQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserQp")
            .field("qp_num", &self.qp_num)
            .finish()
    }
}

impl UserQp {
    pub fn new(
        qp_num: u32,
        caps: QpCaps,
        sq: Producer<Wqe>,
        rq: Producer<Wqe>,
        doorbell: Arc<dyn Doorbell>,
    ) -> Self {
        UserQp {
            qp_num,
            caps,
            sq: Mutex::new(sq),
            rq: Mutex::new(rq),
            doorbell,
        }
    }

    fn check(&self, wqe: &Wqe, max_sge: u32) -> Result<()> {
        if wqe.num_sge as u32 > max_sge.min(MAX_SGE as u32) {
            return Err(VerbsError::Invalid);
        }
        if wqe.is_inline()
            && wqe.inline_len > self.caps.max_inline.min(crate::wr::MAX_INLINE as u32)
        {
            return Err(VerbsError::Invalid);
        }
        if wqe.opcode().is_none() {
            return Err(VerbsError::Invalid);
        }
        Ok(())
    }

    /// Post one send-queue work request.
    pub fn post_send(&self, wqe: &Wqe) -> Result<()> {
        self.post_send_batch(std::slice::from_ref(wqe))
    }

    /// Post several send-queue work requests with one doorbell; all or none are queued.
    pub fn post_send_batch(&self, wqes: &[Wqe]) -> Result<()> {
        for w in wqes {
            self.check(w, self.caps.max_send_sge)?;
            if w.opcode() == Some(WrOpcode::Recv) {
                return Err(VerbsError::Invalid);
            }
        }
        {
            let mut sq = self.sq.lock();
            let used = sq.used().map_err(|_| VerbsError::BadState)?;
            if used as usize + wqes.len() > self.caps.max_send_wr as usize {
                return Err(VerbsError::QueueFull);
            }
            for w in wqes {
                if !sq.push(w).map_err(|_| VerbsError::BadState)? {
                    return Err(VerbsError::QueueFull);
                }
            }
        }
        self.doorbell.ring();
        Ok(())
    }

    /// Post one receive work request. The doorbell rings only when the engine asked
    /// for it (a QP in Error flushes each receive at once); otherwise the engine takes
    /// the receive when a message arrives, as kernel siw and rxe do — in daemon mode a
    /// doorbell per receive was a wake-up of the doorbell thread per message.
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        let mut w = *wqe;
        w.opcode = WrOpcode::Recv as u8;
        w.flags &= !crate::wr::send_flags::INLINE;
        self.check(&w, self.caps.max_recv_sge)?;
        let wanted = {
            let mut rq = self.rq.lock();
            let used = rq.used().map_err(|_| VerbsError::BadState)?;
            if used >= self.caps.max_recv_wr || !rq.push(&w).map_err(|_| VerbsError::BadState)? {
                return Err(VerbsError::QueueFull);
            }
            rq.wants_doorbell()
        };
        if wanted {
            self.doorbell.ring();
        }
        Ok(())
    }

    /// The memory both rings live in (a consumer may do with it what it likes: it is its
    /// own; tests use it to play a hostile consumer).
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.sq.lock().memory().clone()
    }

    /// Ring the doorbell without posting (after writing the rings some other way).
    pub fn ring_doorbell(&self) {
        self.doorbell.ring();
    }
}

/// The consumer's view of a shared receive queue's ring. Receives posted here are taken
/// by whichever QP attached to the SRQ gets a message first; no doorbell is needed (the
/// engine looks at the ring when a message arrives).
pub struct UserSrq {
    pub attr: SrqAttr,
    rq: Mutex<Producer<Wqe>>,
}

impl std::fmt::Debug for UserSrq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserSrq").field("attr", &self.attr).finish()
    }
}

impl UserSrq {
    pub fn new(attr: SrqAttr, rq: Producer<Wqe>) -> Self {
        UserSrq {
            attr,
            rq: Mutex::new(rq),
        }
    }

    /// Post one receive work request.
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        let mut w = *wqe;
        w.opcode = WrOpcode::Recv as u8;
        w.flags = 0;
        if u32::from(w.num_sge) > self.attr.max_sge.min(MAX_SGE as u32) {
            return Err(VerbsError::Invalid);
        }
        let mut rq = self.rq.lock();
        let used = rq.used().map_err(|_| VerbsError::BadState)?;
        if used >= self.attr.max_wr || !rq.push(&w).map_err(|_| VerbsError::BadState)? {
            return Err(VerbsError::QueueFull);
        }
        Ok(())
    }

    /// Receive requests queued and not yet taken by a QP.
    pub fn len(&self) -> u32 {
        self.rq.lock().used().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The memory of the ring (see [`UserQp::ring_memory`]).
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.rq.lock().memory().clone()
    }
}

/// The engine's end of a shared receive queue: QPs take receives from it (serialised
/// between their receive threads), and the armed limit fires `SrqLimitReached` once.
pub struct EngineSrq {
    pub pd: u32,
    max_wr: u32,
    max_sge: u32,
    rq: Mutex<Consumer<Wqe>>,
    limit: AtomicU32,
    /// The consumer corrupted the ring's index: no receive is taken from it any more.
    broken: AtomicBool,
    sink: Arc<dyn EventSink>,
    stats: Arc<RingStats>,
}

impl std::fmt::Debug for EngineSrq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSrq").field("pd", &self.pd).finish()
    }
}

impl EngineSrq {
    pub fn new(
        pd: u32,
        attr: SrqAttr,
        rq: Consumer<Wqe>,
        sink: Arc<dyn EventSink>,
        stats: Arc<RingStats>,
    ) -> Self {
        EngineSrq {
            pd,
            max_wr: attr.max_wr,
            max_sge: attr.max_sge,
            rq: Mutex::new(rq),
            limit: attr.limit.into(),
            broken: AtomicBool::new(false),
            sink,
            stats,
        }
    }

    /// Take the oldest receive. A slot whose scatter list exceeds the SRQ's shape is
    /// dropped (the consumer wrote it past the uVP's checks, counted) and the next one
    /// is tried, at most a ring's worth per call. `Err(RingCorrupt)` when the consumer
    /// scribbled on the producer index: the SRQ is then in error for good (`SrqError`
    /// once), and every later take fails the same way.
    pub fn take(&self) -> Result<Option<Wqe>, RingCorrupt> {
        if self.broken.load(Ordering::Acquire) {
            return Err(RingCorrupt);
        }
        let mut rq = self.rq.lock();
        let mut taken = None;
        let mut result = Ok(());
        for _ in 0..rq.capacity() {
            match rq.pop() {
                Ok(Some(w)) if u32::from(w.num_sge) > self.max_sge => {
                    RingStats::count(&self.stats.srq_dropped);
                    crate::warn_limited!(wr_id = w.wr_id, "SRQ entry beyond max_sge dropped");
                }
                Ok(w) => {
                    taken = w;
                    break;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let left = match result.and_then(|()| rq.len()) {
            Ok(n) => n,
            Err(e) => {
                drop(rq);
                self.fail();
                return Err(e);
            }
        };
        drop(rq);
        let limit = self.limit.load(Ordering::Acquire);
        if taken.is_some()
            && limit > 0
            && left < limit
            && self
                .limit
                .compare_exchange(limit, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.sink.deliver(Event::new(EventKind::SrqLimitReached));
        }
        Ok(taken)
    }

    fn fail(&self) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            RingStats::count(&self.stats.wq_corrupt);
            crate::warn_limited!(pd = self.pd, "SRQ ring indices corrupt: SRQ in error");
            self.sink
                .deliver(Event::new(EventKind::SrqError).with_status(libc::EIO));
        }
    }

    /// Arm the limit event (0 disarms); `Invalid` when it exceeds the SRQ's size.
    pub fn arm(&self, limit: u32) -> Result<()> {
        if limit > self.max_wr {
            return Err(VerbsError::Invalid);
        }
        self.limit.store(limit, Ordering::Release);
        Ok(())
    }

    pub fn attr(&self) -> SrqAttr {
        SrqAttr {
            max_wr: self.max_wr,
            max_sge: self.max_sge,
            limit: self.limit.load(Ordering::Acquire),
        }
    }

    /// Receive requests queued now.
    pub fn len(&self) -> u32 {
        self.rq.lock().len().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The consumer's view of one completion ring.
pub struct UserCq {
    ring: Mutex<Consumer<Cqe>>,
    /// The engine's work this consumer's polls may do (embedded mode; see
    /// [`crate::progress`]).
    progress: Option<Arc<dyn Progress>>,
    /// Armed to sleep: polls leave the engine to its own threads until a completion
    /// comes (the one the consumer woke for).
    released: AtomicBool,
    /// Where [`UserCq::sleep`] sleeps.
    wake: WakeWord,
}

impl std::fmt::Debug for UserCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserCq").finish()
    }
}

impl UserCq {
    pub fn new(ring: Consumer<Cqe>) -> Self {
        UserCq {
            wake: ring.wake_word(),
            ring: Mutex::new(ring),
            progress: None,
            released: AtomicBool::new(false),
        }
    }

    /// A CQ whose empty polls drive the engine through `progress` (embedded mode).
    pub fn with_progress(ring: Consumer<Cqe>, progress: Arc<dyn Progress>) -> Self {
        UserCq {
            progress: Some(progress),
            ..UserCq::new(ring)
        }
    }

    /// Take up to `out.len()` completions; returns how many were written. A poll that
    /// finds none lends the thread to the engine once (when the CQ has a progress
    /// handle and is not armed to sleep) and looks again.
    pub fn poll(&self, out: &mut [Cqe]) -> usize {
        let n = self.pop(out);
        if n > 0 {
            self.released.store(false, Ordering::Relaxed);
            return n;
        }
        match self.drive() {
            true => self.pop(out),
            false => 0,
        }
    }

    /// Lend the thread to the engine once, as an empty poll does, without taking a
    /// completion: for a consumer that waits on memory (the last byte of a peer's RDMA
    /// Write) instead of on the CQ. Its earlier polls told the engine's own receive
    /// thread to leave receiving to it ([`crate::Driven`]), so it must go on driving
    /// while it waits. Whether anything moved.
    pub fn drive(&self) -> bool {
        match &self.progress {
            Some(p) if !self.released.load(Ordering::Relaxed) => p.progress(),
            _ => false,
        }
    }

    /// Whether empty polls drive the engine (a progress handle, see [`crate::progress`]).
    pub fn drives_progress(&self) -> bool {
        self.progress.is_some()
    }

    fn pop(&self, out: &mut [Cqe]) -> usize {
        let mut ring = self.ring.lock();
        let mut n = 0;
        while n < out.len() {
            match ring.pop() {
                Ok(Some(c)) => {
                    out[n] = c;
                    n += 1;
                }
                Ok(None) => break,
                Err(_) => {
                    // The engine never corrupts its producer index; something else in
                    // this process scribbled on the ring. Resynchronise.
                    ring.resync();
                    break;
                }
            }
        }
        n
    }

    /// Request a notification (a `CqNotify` event) for the next completion, or for the
    /// next solicited/error completion.
    pub fn arm(&self, solicited_only: bool) {
        self.arm_as(solicited_only, 0);
    }

    fn arm_as(&self, solicited_only: bool, how: u32) {
        if let Some(p) = &self.progress {
            if !self.released.swap(true, Ordering::Relaxed) {
                p.release();
            }
        }
        let when = if solicited_only {
            crate::queue::notify::SOLICITED
        } else {
            crate::queue::notify::NEXT
        };
        self.ring.lock().arm(when | how);
    }

    /// Arm to be told of the next completion (or the next solicited/error one) through
    /// the CQ's signal socket: a byte its consumer end reads, no `CqNotify` event (see
    /// `EventSink::signal`; a CQ created without a socket gets the event after all).
    pub fn arm_to_signal(&self, solicited_only: bool) {
        self.arm_as(solicited_only, crate::queue::notify::SIGNAL);
    }

    /// How many notifications the engine has given through the signal socket (see
    /// `Consumer::signals_given`).
    pub fn signals_given(&self) -> u32 {
        self.ring.lock().signals_given()
    }

    /// Arm to be woken directly by the next completion (or the next solicited/error
    /// one): no `CqNotify` event, so no event queue, event thread or (through krdmad)
    /// device-file round trip on the way. Look at the ring again, then
    /// [`UserCq::sleep`] with what this returns.
    pub fn arm_to_sleep(&self, solicited_only: bool) -> u32 {
        let seen = self.wake.count();
        self.arm_as(solicited_only, crate::queue::notify::WAKE);
        seen
    }

    /// Sleep until the completion armed for ([`UserCq::arm_to_sleep`], which returned
    /// `seen`) comes, or `timeout` passes, or a signal, or [`UserCq::wake_sleepers`].
    pub fn sleep(&self, seen: u32, timeout: std::time::Duration) {
        self.wake.sleep(seen, timeout);
    }

    /// End the sleep of this process's threads in [`UserCq::sleep`] (for something other
    /// than a completion).
    pub fn wake_sleepers(&self) {
        self.wake.wake();
    }

    pub fn is_empty(&self) -> bool {
        self.ring.lock().is_empty()
    }

    /// The memory of the ring (see [`UserQp::ring_memory`]).
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.ring.lock().memory().clone()
    }
}

/// The engine's end of a completion ring.
pub struct EngineCq {
    ring: Mutex<Producer<Cqe>>,
    sink: Arc<dyn EventSink>,
    stats: Arc<RingStats>,
    pushed: AtomicU64,
    overflows: AtomicU64,
    /// A `CqError` for the current overflow was raised (cleared by the next completion
    /// that fits), so a consumer that never polls raises one event, not one per loss.
    overflow_reported: AtomicBool,
    /// The consumer corrupted the ring's index: nothing is written to it any more.
    broken: AtomicBool,
    /// The QPs completing here that a polling consumer can drive.
    sources: ProgressSources,
}

impl std::fmt::Debug for EngineCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCq")
            .field("pushed", &self.pushed)
            .finish()
    }
}

impl EngineCq {
    pub fn new(ring: Producer<Cqe>, sink: Arc<dyn EventSink>, stats: Arc<RingStats>) -> Self {
        EngineCq {
            ring: Mutex::new(ring),
            sink,
            stats,
            pushed: AtomicU64::new(0),
            overflows: AtomicU64::new(0),
            overflow_reported: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            sources: ProgressSources::default(),
        }
    }

    /// The QPs completing here that a polling consumer can drive ([`crate::progress`]).
    pub fn progress_sources(&self) -> &ProgressSources {
        &self.sources
    }

    /// Append a completion. When it does not fit — the CQ is full, or in error because
    /// the consumer corrupted its index — the completion is lost and counted, a
    /// `CqError` event raised (once per overflow, once for good on corruption), and
    /// `false` returned so the caller can move the QP to the error state.
    pub fn push(&self, cqe: Cqe) -> bool {
        if self.broken.load(Ordering::Acquire) {
            RingStats::count(&self.stats.cqe_lost);
            return false;
        }
        let mut ring = self.ring.lock();
        match ring.push(&cqe) {
            Ok(true) => {}
            Ok(false) => {
                drop(ring);
                self.overflows.fetch_add(1, Ordering::Relaxed);
                RingStats::count(&self.stats.cqe_lost);
                if !self.overflow_reported.swap(true, Ordering::AcqRel) {
                    crate::warn_limited!(wr_id = cqe.wr_id, "completion queue overflow");
                    self.sink
                        .deliver(Event::new(EventKind::CqError).with_status(libc::EOVERFLOW));
                }
                return false;
            }
            Err(RingCorrupt) => {
                drop(ring);
                RingStats::count(&self.stats.cqe_lost);
                if !self.broken.swap(true, Ordering::AcqRel) {
                    RingStats::count(&self.stats.cq_corrupt);
                    crate::warn_limited!("completion ring index corrupt: CQ in error");
                    self.sink
                        .deliver(Event::new(EventKind::CqError).with_status(libc::EIO));
                }
                return false;
            }
        }
        self.overflow_reported.store(false, Ordering::Release);
        self.pushed.fetch_add(1, Ordering::Relaxed);
        let special = cqe.flags & wc_flags::SOLICITED != 0 || cqe.status != WcStatus::Success as u8;
        if let Some(n) = ring.take_notify(special) {
            if n.wake {
                ring.wake();
            }
            if n.signal {
                // Counted before the byte is written, taken back if none was
                // (`Consumer::signals_given`); one non-blocking system call under the
                // ring's lock.
                ring.count_signal(1);
                if !self.sink.signal() {
                    ring.count_signal(-1);
                }
            }
            drop(ring);
            if n.is_event() {
                self.sink.deliver(Event::new(EventKind::CqNotify));
            }
        }
        true
    }

    pub fn pushed(&self) -> u64 {
        self.pushed.load(Ordering::Relaxed)
    }
    pub fn overflows(&self) -> u64 {
        self.overflows.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{ring_bytes, Ring, SharedMem};
    use std::sync::atomic::AtomicUsize;

    struct CountBell(AtomicUsize);
    impl Doorbell for CountBell {
        fn ring(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn recorder() -> (Arc<Mutex<Vec<EventKind>>>, Arc<dyn EventSink>) {
        let events = Arc::new(Mutex::new(Vec::new()));
        let ev2 = events.clone();
        (events, Arc::new(move |e: Event| ev2.lock().push(e.kind)))
    }

    /// A QP of 4-slot rings with `max_send_wr` sends, and the engine's end of its
    /// receive ring.
    fn user_qp(max_send_wr: u32) -> (UserQp, Arc<CountBell>, Consumer<Wqe>) {
        let mem = Arc::new(SharedMem::create("q", 2 * ring_bytes::<Wqe>(4)).unwrap());
        let sq = Ring::attach(mem.clone(), 0, 4).unwrap().producer();
        let at = ring_bytes::<Wqe>(4).div_ceil(64) * 64;
        let rq = Ring::attach(mem.clone(), at, 4).unwrap().producer();
        let engine_rq = Ring::<Wqe>::attach(mem, at, 4).unwrap().consumer();
        let bell = Arc::new(CountBell(AtomicUsize::new(0)));
        let caps = QpCaps {
            max_send_wr,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline: 16,
        };
        (UserQp::new(7, caps, sq, rq, bell.clone()), bell, engine_rq)
    }

    #[test]
    fn post_respects_caps() {
        let (qp, bell, _) = user_qp(2);
        let sge = SGE;
        qp.post_send(&Wqe::new(1, WrOpcode::Send, &[sge])).unwrap();
        assert_eq!(
            qp.post_send(&Wqe::new(2, WrOpcode::Send, &[sge, sge])),
            Err(VerbsError::Invalid)
        );
        qp.post_send(&Wqe::new(3, WrOpcode::Send, &[sge])).unwrap();
        assert_eq!(
            qp.post_send(&Wqe::new(4, WrOpcode::Send, &[sge])),
            Err(VerbsError::QueueFull)
        );
        let big = Wqe::new(5, WrOpcode::Send, &[])
            .with_inline(&[0; 32])
            .unwrap();
        assert_eq!(qp.post_send(&big), Err(VerbsError::Invalid));
        assert_eq!(bell.0.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn receives_ring_the_doorbell_only_once_the_engine_asks() {
        let (qp, bell, mut engine_rq) = user_qp(4);
        let sge = SGE;
        qp.post_recv(&Wqe::recv(1, &[sge])).unwrap();
        qp.post_recv(&Wqe::recv(2, &[sge])).unwrap();
        assert_eq!(
            bell.0.load(Ordering::Relaxed),
            0,
            "the engine takes them itself"
        );
        qp.post_send(&Wqe::new(3, WrOpcode::Send, &[sge])).unwrap();
        assert_eq!(bell.0.load(Ordering::Relaxed), 1, "a send always rings");
        // The QP went to Error: the engine asks, then flushes what is queued.
        engine_rq.want_doorbells();
        assert_eq!(engine_rq.drain_queued(|_| {}), Ok(2));
        qp.post_recv(&Wqe::recv(4, &[sge])).unwrap();
        assert_eq!(bell.0.load(Ordering::Relaxed), 2, "now each receive rings");
    }

    fn srq(
        cap: u32,
        max_sge: u32,
    ) -> (
        EngineSrq,
        UserSrq,
        Arc<RingStats>,
        Arc<Mutex<Vec<EventKind>>>,
    ) {
        let mem = Arc::new(SharedMem::create("s", ring_bytes::<Wqe>(cap)).unwrap());
        let (events, sink) = recorder();
        let attr = SrqAttr {
            max_wr: cap,
            max_sge,
            limit: 0,
        };
        let stats = Arc::new(RingStats::default());
        let eng = EngineSrq::new(
            1,
            attr,
            Ring::attach(mem.clone(), 0, cap).unwrap().consumer(),
            sink,
            stats.clone(),
        );
        let user = UserSrq::new(attr, Ring::attach(mem, 0, cap).unwrap().producer());
        (eng, user, stats, events)
    }

    const SGE: crate::Sge = crate::Sge {
        addr: 1,
        length: 1,
        lkey: 1,
    };

    #[test]
    fn srq_shares_receives_and_fires_its_limit_once() {
        let (eng, user, _, events) = srq(8, 1);
        for i in 0..4 {
            user.post_recv(&Wqe::recv(i, &[SGE])).unwrap();
        }
        assert_eq!(
            user.post_recv(&Wqe::recv(9, &[SGE, SGE])),
            Err(VerbsError::Invalid)
        );
        assert_eq!(eng.arm(9), Err(VerbsError::Invalid));
        eng.arm(3).unwrap();
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 0); // 3 left: not below 3
        assert!(events.lock().is_empty());
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 1); // 2 left: fires
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 2);
        assert_eq!(*events.lock(), vec![EventKind::SrqLimitReached]);
        assert_eq!(eng.attr().limit, 0, "disarmed");
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 3);
        assert!(eng.take().unwrap().is_none());
    }

    /// The consumer's own view of a ring's header words, to play a hostile consumer.
    fn header(mem: &SharedMem) -> (&AtomicU32, &AtomicU32) {
        // SAFETY: the producer and consumer words are 4-aligned u32s at offsets 0 and 64
        // of a mapping at least a ring header long; atomics tolerate the other side.
        unsafe {
            (
                &*(mem.as_ptr() as *const AtomicU32),
                &*(mem.as_ptr().add(64) as *const AtomicU32),
            )
        }
    }

    #[test]
    fn srq_take_is_bounded_and_a_corrupt_ring_is_an_error() {
        let (eng, user, stats, events) = srq(4, 1);
        let mem = user.ring_memory();
        let (prod, cons) = header(&mem);
        // Four entries beyond max_sge, and the consumer keeps the ring full of them.
        for i in 0..4 {
            let mut w = Wqe::recv(i, &[SGE]);
            w.num_sge = 3;
            // SAFETY: slot i of the ring, inside the mapping; no other writer.
            unsafe {
                std::ptr::write_volatile(
                    mem.as_ptr()
                        .add(crate::queue::RING_HEADER + i as usize * std::mem::size_of::<Wqe>())
                        as *mut Wqe,
                    w,
                )
            };
        }
        prod.store(4, Ordering::Release);
        assert!(eng.take().unwrap().is_none(), "nothing usable");
        prod.store(cons.load(Ordering::Acquire) + 4, Ordering::Release);
        assert!(eng.take().unwrap().is_none(), "one ring's worth per call");
        assert_eq!(stats.srq_dropped.load(Ordering::Relaxed), 8);
        prod.store(cons.load(Ordering::Acquire) + 5, Ordering::Release);
        assert_eq!(eng.take(), Err(RingCorrupt));
        prod.store(cons.load(Ordering::Acquire), Ordering::Release);
        assert_eq!(eng.take(), Err(RingCorrupt), "stays in error");
        assert_eq!(*events.lock(), vec![EventKind::SrqError]);
        assert_eq!(stats.wq_corrupt.load(Ordering::Relaxed), 1);
    }

    fn cq(cap: u32) -> (EngineCq, UserCq, Arc<RingStats>, Arc<Mutex<Vec<EventKind>>>) {
        let mem = Arc::new(SharedMem::create("c", ring_bytes::<Cqe>(cap)).unwrap());
        let (events, sink) = recorder();
        let stats = Arc::new(RingStats::default());
        let eng = EngineCq::new(
            Ring::attach(mem.clone(), 0, cap).unwrap().producer(),
            sink,
            stats.clone(),
        );
        let user = UserCq::new(Ring::attach(mem, 0, cap).unwrap().consumer());
        (eng, user, stats, events)
    }

    fn cqe(wr_id: u64) -> Cqe {
        Cqe {
            wr_id,
            ..Default::default()
        }
    }

    #[test]
    fn cq_overflow_is_reported_once_per_overflow() {
        let (eng, user, stats, events) = cq(2);
        user.arm(false);
        assert!(eng.push(cqe(1)));
        assert!(eng.push(cqe(2)));
        for i in 3..100 {
            assert!(!eng.push(cqe(i)));
        }
        assert_eq!(
            *events.lock(),
            vec![EventKind::CqNotify, EventKind::CqError]
        );
        let mut out = [Cqe::default(); 4];
        assert_eq!(user.poll(&mut out), 2);
        assert_eq!(eng.overflows(), 97);
        assert_eq!(stats.cqe_lost.load(Ordering::Relaxed), 97);
        assert!(eng.push(cqe(100)), "recovers once polled");
        assert!(eng.push(cqe(101)));
        assert!(!eng.push(cqe(102)));
        assert_eq!(events.lock().len(), 3, "a new overflow, a new event");
    }

    #[test]
    fn cq_with_a_corrupt_index_goes_to_error_for_good() {
        let (eng, user, stats, events) = cq(4);
        assert!(eng.push(cqe(1)));
        let mem = user.ring_memory();
        let (_, cons) = header(&mem);
        cons.store(77, Ordering::Release);
        assert!(!eng.push(cqe(2)));
        cons.store(1, Ordering::Release);
        assert!(!eng.push(cqe(3)), "stays in error");
        assert_eq!(*events.lock(), vec![EventKind::CqError]);
        assert_eq!(stats.cq_corrupt.load(Ordering::Relaxed), 1);
        assert_eq!(stats.cqe_lost.load(Ordering::Relaxed), 2);
    }
}
