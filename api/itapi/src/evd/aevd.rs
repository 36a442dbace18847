//! Aggregate event dispatchers: one queue of ready SEVDs.

use super::signal::Signal;
use super::{attach, detach, Callback, EvdFlags, SevdInner, Wakeable};
use crate::event::{AevdNotification, Event};
use crate::ia::Ia;
use crate::object::{object_accessors, Common};
use crate::status::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// An aggregate event dispatcher (AEVD): fans in the SEVDs created with it, so one
/// thread or one file descriptor serves many endpoints.
///
/// Without [`EvdFlags::DEQUEUE_NOTIFICATIONS`], [`dequeue`](Aevd::dequeue) and
/// [`wait`](Aevd::wait) return the events of the ready SEVDs themselves, taking one at
/// a time from each ready SEVD in turn; with it they return
/// [`Event::AevdNotification`]s naming a ready SEVD, to be drained by the consumer.
///
/// ```
/// use krdma_itapi::{Aevd, EventStream, Evd, EvdFlags, Ia};
/// use std::time::Duration;
///
/// let ia = Ia::open("siw0")?;
/// let aevd = Aevd::create(&ia, EvdFlags::CREATE_FD, 1024)?;
/// let a = Evd::create(&ia, EventStream::Software, EvdFlags::empty(), 16, 1, Some(&aevd))?;
/// let b = Evd::create(&ia, EventStream::Software, EvdFlags::empty(), 16, 1, Some(&aevd))?;
/// a.post_software(1)?;
/// b.post_software(2)?;
/// let (first, _) = aevd.wait(Some(Duration::from_secs(1)))?;
/// let (second, _) = aevd.wait(Some(Duration::from_secs(1)))?;
/// # let _ = (first, second);
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Aevd(pub(crate) Arc<AevdInner>);

object_accessors!(Aevd);

pub struct AevdInner {
    pub(crate) ia: Ia,
    flags: EvdFlags,
    queue_size: usize,
    st: Mutex<State>,
    cv: Condvar,
    signal: Option<Signal>,
    callback: Mutex<Option<Callback>>,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

struct State {
    /// Ready SEVDs, oldest first, each at most once.
    ready: VecDeque<(u64, Weak<SevdInner>)>,
    waiters: usize,
    fd_set: bool,
    dead: bool,
}

impl Aevd {
    /// Create an AEVD. `queue_size` is recorded for queries; the AEVD holds one entry
    /// per ready SEVD, so it cannot overflow.
    pub fn create(ia: &Ia, flags: EvdFlags, queue_size: usize) -> Result<Aevd> {
        ia.check_alive()?;
        if queue_size == 0 || queue_size > super::MAX_QUEUE_SIZE {
            return Err(Error::InvalidQueueSize);
        }
        let signal = if flags.contains(EvdFlags::CREATE_FD) {
            Some(Signal::new().map_err(|_| Error::Resources)?)
        } else {
            None
        };
        let inner = Arc::new(AevdInner {
            common: Common::new(),
            ia: ia.clone(),
            flags,
            queue_size,
            st: Mutex::new(State {
                ready: VecDeque::new(),
                waiters: 0,
                fd_set: false,
                dead: false,
            }),
            cv: Condvar::new(),
            signal,
            callback: Mutex::new(None),
        });
        ia.watch_for_death(Arc::downgrade(&inner) as Weak<dyn Wakeable>);
        tracing::debug!(id = inner.common.id, ?flags, "AEVD created");
        Ok(Aevd(inner))
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    pub fn flags(&self) -> EvdFlags {
        self.0.flags
    }

    pub fn queue_size(&self) -> usize {
        self.0.queue_size
    }

    /// Take one event (or notification) without waiting (`QueueEmpty` when none).
    pub fn dequeue(&self) -> Result<Event> {
        self.0.dequeue()
    }

    /// Wait up to `timeout` (`None`: for ever) for an event; returns it with the number
    /// of SEVDs still ready. One waiter at a time (`WaiterLimit`).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(Event, usize)> {
        self.0.wait(timeout)
    }

    /// The pollable descriptor (with [`EvdFlags::CREATE_FD`]): readable while an SEVD
    /// of this AEVD is ready.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.0.signal.as_ref().map(|s| s.as_fd())
    }

    pub fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        self.0.signal.as_ref().map(|s| s.raw())
    }

    /// SEVDs ready now.
    pub fn ready_count(&self) -> usize {
        self.0.st.lock().ready.len()
    }

    pub fn attach_callback(&self, callback: Callback) -> Result<()> {
        attach(&self.0.callback, callback)
    }

    pub fn detach_callback(&self) -> Result<()> {
        detach(&self.0.callback)
    }

    pub fn has_callback(&self) -> bool {
        self.0.callback.lock().is_some()
    }

    pub fn has_waiter(&self) -> bool {
        self.0.st.lock().waiters > 0
    }
}

impl Wakeable for AevdInner {
    fn wake_dead(&self) {
        self.st.lock().dead = true;
        self.cv.notify_all();
    }
}

impl AevdInner {
    /// An SEVD became ready (called with the SEVD's lock held: SEVD before AEVD).
    pub(crate) fn mark_ready(&self, id: u64, sevd: Weak<SevdInner>, callbacks: &mut Vec<Callback>) {
        let mut st = self.st.lock();
        st.ready.push_back((id, sevd));
        self.sync(&mut st);
        if st.waiters > 0 {
            self.cv.notify_all();
        }
        callbacks.extend(self.callback.lock().clone());
    }

    /// An SEVD is no longer ready (or is gone).
    pub(crate) fn unmark(&self, id: u64) {
        let mut st = self.st.lock();
        st.ready.retain(|(i, _)| *i != id);
        self.sync(&mut st);
    }

    fn sync(&self, st: &mut State) {
        if let Some(s) = &self.signal {
            let ready = !st.ready.is_empty();
            s.sync(&mut st.fd_set, ready);
        }
    }

    fn pop_ready(&self) -> Result<Option<(u64, Weak<SevdInner>)>> {
        let mut st = self.st.lock();
        let next = st.ready.pop_front();
        self.sync(&mut st);
        match next {
            None if st.dead => Err(Error::IaCatastrophe),
            next => Ok(next),
        }
    }

    fn dequeue(&self) -> Result<Event> {
        while let Some((id, weak)) = self.pop_ready()? {
            let Some(sevd) = weak.upgrade() else { continue };
            if self.flags.contains(EvdFlags::DEQUEUE_NOTIFICATIONS) {
                let note = Event::AevdNotification(AevdNotification {
                    aevd: self.common.id,
                    sevd: crate::event::EvdRef::new(id, &sevd),
                });
                sevd.notification_taken();
                return Ok(note);
            }
            if let Some(ev) = sevd.take_for_aevd() {
                return Ok(ev);
            }
        }
        Err(Error::QueueEmpty)
    }

    fn wait(&self, timeout: Option<Duration>) -> Result<(Event, usize)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        {
            let mut st = self.st.lock();
            if st.waiters > 0 {
                return Err(Error::WaiterLimit);
            }
            st.waiters += 1;
        }
        let r = self.wait_loop(deadline);
        self.st.lock().waiters -= 1;
        r
    }

    fn wait_loop(&self, deadline: Option<Instant>) -> Result<(Event, usize)> {
        loop {
            match self.dequeue() {
                Ok(ev) => return Ok((ev, self.st.lock().ready.len())),
                Err(Error::QueueEmpty) => {}
                Err(e) => return Err(e),
            }
            let mut st = self.st.lock();
            if !st.ready.is_empty() {
                continue;
            }
            if st.dead {
                return Err(Error::IaCatastrophe);
            }
            let timed_out = match deadline {
                Some(d) => self.cv.wait_until(&mut st, d).timed_out(),
                None => {
                    self.cv.wait(&mut st);
                    false
                }
            };
            if timed_out && st.ready.is_empty() {
                return Err(Error::TimeoutExpired);
            }
        }
    }
}

impl Drop for AevdInner {
    fn drop(&mut self) {
        tracing::debug!(id = self.common.id, "AEVD freed");
    }
}
