//! Consumer-driven progress: a consumer polling an empty completion queue in embedded mode
//! lends its thread to the engine, which reads its sockets there instead of waking a
//! thread of its own for every message.
//!
//! A software engine receives on its own threads, which sleep in the kernel between
//! messages; a message then costs a wake-up (5–15 µs on a small VM) before the consumer's
//! poll can see its completion. When the consumer is polling anyway, the engine can do the
//! receive in the consumer's thread: one non-blocking read per empty poll, no hand-off. The
//! engine's own thread stays out of the way while a consumer drives (it would only be woken
//! to find the data gone) and takes over again when the consumer stops: when it arms the CQ
//! to sleep ([`Progress::release`]) or when it has not polled for a short while.
//!
//! * A QP that can be driven this way registers with its CQs' [`ProgressSources`]
//!   (the engine's end of each CQ holds one).
//! * The consumer's end of the CQ ([`UserCq`](crate::UserCq)) calls [`Progress::progress`]
//!   when a poll finds nothing, and [`Progress::release`] when it arms.
//! * Only in the process that runs the engine (embedded mode): through the daemon the
//!   consumer cannot read the engine's sockets, and its CQs have no progress handle.
//!
//! `progress` follows the doorbell's contract ([`ProviderQp::doorbell`](crate::ProviderQp)):
//! it never blocks on anything a peer or another tenant controls, and its work is bounded.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Work an engine can do in a polling consumer's thread.
pub trait Progress: Send + Sync {
    /// Do what can be done now without blocking (read what has arrived, place it, write
    /// its completions); whether anything was done.
    fn progress(&self) -> bool;
    /// The consumer stops polling (it is about to sleep on a notification): the engine's
    /// own threads take over at once.
    fn release(&self);
}

/// Sources a CQ's [`Progress`] visits per empty poll: a CQ shared by many QPs costs its
/// poller at most this many reads each time, the QPs visited in turn.
const VISIT: usize = 4;

/// The QPs that complete into one CQ and can be driven from its poller.
#[derive(Default)]
pub struct ProgressSources {
    inner: Mutex<Sources>,
}

#[derive(Default)]
struct Sources {
    list: Vec<Weak<dyn Progress>>,
    /// Where the next visit starts.
    next: usize,
}

impl std::fmt::Debug for ProgressSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgressSources")
            .field("len", &self.inner.lock().list.len())
            .finish()
    }
}

impl ProgressSources {
    /// Add a source (a QP, which stays registered until it is dropped).
    pub fn attach(&self, source: Weak<dyn Progress>) {
        let mut s = self.inner.lock();
        s.list.retain(|w| w.strong_count() > 0);
        if !s.list.iter().any(|w| w.ptr_eq(&source)) {
            s.list.push(source);
        }
    }

    /// The live sources to visit this time (at most [`VISIT`], in turn); no allocation,
    /// as this runs on every empty poll.
    fn visit(&self) -> [Option<Arc<dyn Progress>>; VISIT] {
        let mut picked = [const { None }; VISIT];
        let mut s = self.inner.lock();
        let n = s.list.len();
        if n > 0 {
            let start = s.next % n;
            s.next = (start + VISIT) % n;
            for (i, slot) in picked.iter_mut().take(n).enumerate() {
                *slot = s.list[(start + i) % n].upgrade();
            }
        }
        picked
    }
}

impl Progress for ProgressSources {
    fn progress(&self) -> bool {
        // The sources run without the list's lock: they write completions and must not
        // hold up a QP registering meanwhile.
        let mut any = false;
        for p in self.visit().into_iter().flatten() {
            any |= p.progress();
        }
        any
    }

    fn release(&self) {
        let all: Vec<_> = self
            .inner
            .lock()
            .list
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for p in all {
            p.release();
        }
    }
}

/// How long after a consumer's last poll an engine's own receive thread leaves its socket
/// to consumers. A consumer that stops polling without arming its CQ delays the thread
/// at least this long, at most [`PARK_MAX`] (it is what arming is for).
pub const DRIVE_WINDOW: Duration = Duration::from_micros(500);

/// The longest a parked thread sleeps before it looks whether consumers still drive.
/// It first sleeps out the window and doubles the nap each time it wakes to find them
/// still polling: a thread that looked every window woke 2,000 times a second beside a
/// polling ping-pong, taking a core the consumers use each time (docs/benchmarks.md,
/// "Parked threads that look less often").
pub const PARK_MAX: Duration = Duration::from_millis(4);

/// Whether polling consumers drive an engine's receiving now, and where the engine's own
/// receive thread sleeps while they do: the engine side of [`Progress`].
///
/// The thread calls [`Driven::park_if_driven`] before it waits on its socket; while a
/// consumer drives it parks instead, until [`Driven::release`] or [`Driven::wake`] calls
/// it back, or it finds the window passed without a poll.
#[derive(Debug, Default)]
pub struct Driven {
    /// Until when a consumer drives (ns after [`epoch`]); 0 when none does.
    until: AtomicU64,
    parking: Mutex<Parking>,
    cv: Condvar,
}

/// The parked thread's side of [`Driven`].
#[derive(Debug, Default)]
struct Parking {
    /// Called back (by `release` or `wake`) since it last parked.
    woken: bool,
    /// How long its next sleep lasts at least: grows while consumers keep driving.
    nap: Duration,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

impl Driven {
    /// A consumer polls: it drives for [`DRIVE_WINDOW`] more.
    pub fn touch(&self) {
        let until = now_ns() + DRIVE_WINDOW.as_nanos() as u64;
        self.until.store(until, Ordering::Release);
    }

    /// How much longer a consumer drives, if one does.
    pub fn left(&self) -> Option<Duration> {
        let until = self.until.load(Ordering::Acquire);
        let now = now_ns();
        (until > now).then(|| Duration::from_nanos(until - now))
    }

    /// The consumer stops driving (it is about to sleep): call the thread back now.
    pub fn release(&self) {
        if self.until.swap(0, Ordering::AcqRel) != 0 {
            self.wake();
        }
    }

    /// Call the parked thread back (a consumer found something only it may handle).
    pub fn wake(&self) {
        self.parking.lock().woken = true;
        self.cv.notify_one();
    }

    /// The engine's thread, before it waits on its socket: while a consumer drives, sleep
    /// until called back or until the consumer may have stopped, and return true (look
    /// again); false when no consumer drives (the thread does its own receiving).
    pub fn park_if_driven(&self) -> bool {
        let Some(left) = self.left() else {
            self.parking.lock().nap = Duration::ZERO;
            return false;
        };
        let mut p = self.parking.lock();
        if p.woken {
            p.nap = Duration::ZERO;
        } else {
            let nap = left.max(p.nap);
            let slept = self.cv.wait_for(&mut p, nap).timed_out();
            // Slept it out: if the consumer still drives when the thread looks, it
            // sleeps twice as long next time.
            p.nap = match slept {
                true => (nap * 2).min(PARK_MAX),
                false => Duration::ZERO,
            };
        }
        p.woken = false;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Counting {
        polls: AtomicUsize,
        releases: AtomicUsize,
    }
    impl Progress for Counting {
        fn progress(&self) -> bool {
            self.polls.fetch_add(1, Ordering::Relaxed);
            true
        }
        fn release(&self) {
            self.releases.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn many_sources_are_visited_in_turn_a_few_at_a_time() {
        let sources = ProgressSources::default();
        let qps: Vec<Arc<Counting>> = (0..10).map(|_| Arc::default()).collect();
        for q in &qps {
            let w: Weak<dyn Progress> = Arc::downgrade(&(q.clone() as Arc<dyn Progress>));
            sources.attach(w.clone());
            sources.attach(w); // twice: kept once
        }
        for _ in 0..5 {
            assert!(sources.progress());
        }
        // 5 visits of 4 over 10 sources: each visited exactly twice.
        assert!(qps.iter().all(|q| q.polls.load(Ordering::Relaxed) == 2));
        sources.release();
        assert!(qps.iter().all(|q| q.releases.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_driven_thread_parks_until_released() {
        let d = Arc::new(Driven::default());
        assert!(d.left().is_none());
        d.touch();
        assert!(d.left().is_some_and(|l| l <= DRIVE_WINDOW));
        // A long nap: however long the consumers keep driving, the release calls it back.
        d.parking.lock().nap = Duration::from_secs(3600);
        let parked = {
            let d = d.clone();
            std::thread::spawn(move || while d.park_if_driven() {})
        };
        d.release();
        parked.join().unwrap();
        assert!(d.left().is_none());
        // Called back, the thread's next nap starts from the window again.
        assert_eq!(d.parking.lock().nap, Duration::ZERO);
        // A wake-up given before the thread parks is not lost.
        d.touch();
        d.parking.lock().nap = Duration::from_secs(3600);
        d.wake();
        assert!(d.park_if_driven());
    }

    #[test]
    fn a_thread_parked_beside_a_steady_poller_looks_less_and_less_often() {
        let d = Arc::new(Driven::default());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        d.touch();
        let poller = {
            let (d, stop) = (d.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    d.touch();
                    std::thread::sleep(Duration::from_micros(50));
                }
            })
        };
        // Through 40 ms of polling, looking once per window would be 80 looks; doubling
        // naps (0.5, 1, 2, 4, 4, … ms) make at most 14. A poller held off the CPU for a
        // window (a loaded host) lets it lapse: the naps start again from the window.
        let start = Instant::now();
        let (mut looks, mut lapses, mut lapsed) = (0, 0, false);
        while start.elapsed() < Duration::from_millis(40) {
            if d.park_if_driven() {
                looks += 1;
                lapsed = false;
                assert!(d.parking.lock().nap <= PARK_MAX);
            } else {
                lapses += usize::from(!lapsed);
                lapsed = true;
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        poller.join().unwrap();
        assert!(looks <= 14 + 5 * lapses, "{looks} looks, {lapses} lapses");
        // Once the poller has stopped, the thread finds the window passed and reads.
        while d.park_if_driven() {}
        assert_eq!(d.parking.lock().nap, Duration::ZERO);
    }

    #[test]
    fn dropped_sources_are_skipped_and_forgotten() {
        let sources = ProgressSources::default();
        let gone: Arc<dyn Progress> = Arc::new(Counting::default());
        sources.attach(Arc::downgrade(&gone));
        drop(gone);
        assert!(!sources.progress());
        let kept: Arc<dyn Progress> = Arc::new(Counting::default());
        sources.attach(Arc::downgrade(&kept));
        assert_eq!(sources.inner.lock().list.len(), 1);
        assert!(sources.progress());
    }
}
