//! The device's timer thread: one heap of deadlines for every QP (retransmission and RNR
//! back-off), every CM exchange (MAD retries) and the CM's expiry sweep of connection
//! requests. Nothing is ever removed from the heap:
//! a CM exchange re-arms with a new generation and a fired entry of an old one is
//! ignored; a QP keeps its own current deadline and an entry that fires early queues
//! itself again for it (`RxeQp::on_timer`).

use crate::device::Shared;
use parking_lot::{Condvar, Mutex};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Where a device's time comes from: the host's monotonic clock, or a simulated one that
/// moves only when its driver says so (`crate::sim`). Nothing in the engine reads the
/// wall clock but through this.
#[derive(Clone, Default)]
pub enum Clock {
    #[default]
    Host,
    Sim(Arc<Mutex<Instant>>),
}

impl Clock {
    pub fn now(&self) -> Instant {
        match self {
            Clock::Host => Instant::now(),
            Clock::Sim(t) => *t.lock(),
        }
    }
}

/// What a deadline belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Qp(u32),
    Cm(u32),
    /// The CM's sweep for connection requests that expired unanswered.
    CmSweep,
}

#[derive(Default)]
struct Heap {
    entries: BinaryHeap<Reverse<(Instant, Target, u64)>>,
    stopped: bool,
}

#[derive(Default)]
pub struct Timers {
    heap: Mutex<Heap>,
    cv: Condvar,
}

impl Timers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Fire `target` with `gen` at `at`.
    pub fn arm(&self, target: Target, gen: u64, at: Instant) {
        let mut h = self.heap.lock();
        let earliest = h.entries.peek().is_none_or(|Reverse((t, ..))| at < *t);
        h.entries.push(Reverse((at, target, gen)));
        if earliest {
            self.cv.notify_one();
        }
    }

    pub fn stop(&self) {
        self.heap.lock().stopped = true;
        self.cv.notify_all();
    }

    /// The entry due at `now`, if any, taken off the heap (the simulated driver's step).
    pub fn pop_due(&self, now: Instant) -> Option<(Target, u64, Instant)> {
        let mut h = self.heap.lock();
        match h.entries.peek() {
            Some(Reverse((at, ..))) if *at <= now => {
                let Reverse((at, t, g)) = h.entries.pop()?;
                Some((t, g, at))
            }
            _ => None,
        }
    }

    /// The earliest deadline queued.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.heap.lock().entries.peek().map(|Reverse((at, ..))| *at)
    }

    /// Wait for the next due entry: (target, generation, deadline), or `None` when stopped.
    fn next(&self) -> Option<(Target, u64, Instant)> {
        let mut h = self.heap.lock();
        loop {
            if h.stopped {
                return None;
            }
            let now = Instant::now();
            match h.entries.peek() {
                Some(Reverse((at, ..))) if *at <= now => {
                    let Reverse((at, t, g)) = h.entries.pop()?;
                    return Some((t, g, at));
                }
                Some(Reverse((at, ..))) => {
                    let at = *at;
                    self.cv.wait_until(&mut h, at);
                }
                None => {
                    self.cv.wait_for(&mut h, Duration::from_millis(200));
                }
            }
        }
    }
}

/// The timer thread of a device; ends when the device stops its timers.
pub fn run(shared: Weak<Shared>) {
    loop {
        let Some(s) = shared.upgrade() else { return };
        let Some((target, gen, at)) = s.timers.next() else {
            return;
        };
        fire(&s, target, gen, at);
    }
}

/// Run one entry that came due.
pub fn fire(s: &Arc<Shared>, target: Target, gen: u64, at: Instant) {
    match target {
        Target::Qp(qpn) => {
            if let Some(qp) = s.qp(qpn) {
                qp.on_timer(at);
            }
        }
        Target::Cm(id) => s.cm.on_timer(s, id, gen),
        Target::CmSweep => s.cm.on_sweep(s, gen),
    }
}
