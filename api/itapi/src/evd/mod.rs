//! Event dispatchers.
//!
//! A **simple EVD** ([`Evd`]) queues the events of one [`EventStream`]: completions of the
//! endpoints that use it, connection requests of a listener, connection messages of
//! endpoints, the IA's asynchronous events, or software events. An **aggregate EVD**
//! ([`Aevd`]) fans in many simple EVDs so one thread (or one file descriptor) serves them
//! all.
//!
//! ## Notification
//!
//! Every event is queued; some also *notify*. An SEVD is **ready** when it holds at
//! least `threshold` events and one of them notified since it was last empty. Readiness
//! is what makes the file descriptor readable, calls the callback, and puts the SEVD on
//! its AEVD. Which events notify:
//!
//! * completions of sends, RDMA operations and RMR links posted with
//!   [`DtoFlags::NOTIFY`](crate::DtoFlags::NOTIFY);
//! * completions of receives posted with `NOTIFY`, or — posted with
//!   [`DtoFlags::SOLICITED_WAIT`](crate::DtoFlags::SOLICITED_WAIT) — only of messages the
//!   sender marked solicited;
//! * every failed completion, and every event of the other streams.
//!
//! A threshold of 0 (`IT_THRESHOLD_DISABLE`) turns readiness off.
//!
//! A thread in [`Evd::wait`] waits for **events**, not for notification: it returns as
//! soon as the SEVD holds `threshold` events (at least one), whether they arrived before
//! the call or while it slept, notifying or not. The one event that does not wake it is
//! an unsolicited message landing in a receive posted with `SOLICITED_WAIT` (the
//! consumer asked to sleep until a solicited one); it is returned with the next event
//! that does. Before sleeping the waiter leaves the completion queue armed and looks at
//! the ring once more, so a completion landing in between still reaches it.
//!
//! ## Overflow
//!
//! An SEVD holds `queue_size` events. An event that finds it full is lost: the SEVD is
//! marked overflowed ([`EvdParams::overflowed`]) and, once per overflow, an
//! `IT_ASYNC_AFF_SEVD_ENQUEUE_FAILURE` event naming it goes to the IA's affiliated async
//! EVD. A connection request that is lost this way is rejected. With
//! [`EvdFlags::OVERFLOW_AUTO_RESET`] the mark clears at the next dequeue, otherwise at
//! [`Evd::reset_overflow`]. A DTO SEVD keeps completions that do not fit in its
//! completion ring (as large again, rounded up to a power of two); only when that ring is
//! full too is a completion lost — and then the endpoint it belonged to is broken by the
//! device, as on any RDMA device whose CQ overflows.
//!
//! Over 600 lines: the queue, threshold and wake-up logic every kind of event dispatcher
//! shares; the kinds are in the submodules.

mod aevd;
mod dto;
mod signal;

pub use aevd::Aevd;
use dto::Arm;
pub(crate) use dto::DtoSource;

use crate::event::{
    AffiliatedCause, AffiliatedEvent, EvdRef, Event, EventNumber, EventStream, SoftwareEvent,
};
use crate::ia::Ia;
use crate::object::{object_accessors, Common, UseGuard};
use crate::status::{Error, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use signal::Signal;
use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

bitflags::bitflags! {
    /// Creation flags of an EVD (`it_evd_flags_t`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct EvdFlags: u32 {
        /// AEVD: dequeue and wait return notifications naming the ready SEVD instead of
        /// the SEVD's events.
        const DEQUEUE_NOTIFICATIONS = 0x01;
        /// Create a pollable file descriptor ([`Evd::fd`]).
        const CREATE_FD = 0x02;
        const OVERFLOW_DEFAULT = 0x04;
        /// Report an overflow with an affiliated async event (also the default).
        const OVERFLOW_NOTIFY = 0x08;
        /// Clear the overflowed mark at the next dequeue.
        const OVERFLOW_AUTO_RESET = 0x10;
        /// krdma's extension, DTO SEVDs with `CREATE_FD`: the descriptor reads readable
        /// as soon as a completion lands, before the SEVD has looked at it — it may then
        /// hold events that do not notify, or fewer than the threshold — and through
        /// krdmad the engine makes it so itself, without the event path. For consumers
        /// that dequeue whenever it reads readable (SDP's sockets).
        const FD_ON_COMPLETION = 0x1000;
    }
}

/// A consumer callback run when an EVD becomes ready (`it_evd_callback_attach`).
pub type Callback = Arc<dyn Fn() + Send + Sync>;

/// What [`Evd::query`] reports (`it_evd_param_t`).
#[derive(Debug, Clone)]
pub struct EvdParams {
    pub ia: u64,
    pub stream: EventStream,
    pub flags: EvdFlags,
    pub queue_size: usize,
    pub threshold: usize,
    /// The AEVD this SEVD feeds.
    pub aevd: Option<u64>,
    pub fd: Option<RawFd>,
    pub enabled: bool,
    pub overflowed: bool,
    pub callback: bool,
}

/// A simple event dispatcher (SEVD) for one event stream.
///
/// ```
/// use krdma_itapi::{EventStream, Evd, EvdFlags, Ia};
/// use std::time::Duration;
///
/// let ia = Ia::open("siw0")?;
/// // A software-event SEVD with a pollable descriptor, woken by every event.
/// let evd = Evd::create(&ia, EventStream::Software, EvdFlags::CREATE_FD, 64, 1, None)?;
/// evd.post_software(42)?;
/// let (event, more) = evd.wait(Some(Duration::from_secs(1)))?;
/// assert_eq!(more, 0);
/// # let _ = event;
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Evd(pub(crate) Arc<SevdInner>);

object_accessors!(Evd);

pub struct SevdInner {
    pub(crate) ia: Ia,
    pub(crate) stream: EventStream,
    me: Weak<SevdInner>,
    flags: EvdFlags,
    st: Mutex<State>,
    cv: Condvar,
    signal: Option<Signal>,
    aevd: Option<(Aevd, UseGuard)>,
    pub(crate) dto: Option<DtoSource>,
    callback: Mutex<Option<Callback>>,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

struct State {
    queue: VecDeque<Event>,
    capacity: usize,
    threshold: usize,
    /// A notifying event arrived since the queue was last empty.
    notified: bool,
    /// An event that wakes waiters arrived since the queue was last empty.
    wakeable: bool,
    overflowed: bool,
    enabled: bool,
    waiters: usize,
    /// This SEVD is on its AEVD's ready list.
    in_aevd: bool,
    fd_set: bool,
    dead: bool,
    /// Dequeues in a row that found nothing (see [`POLL_YIELD_EVERY`]).
    empty_polls: u32,
    /// The consumer polls on: the CQ is left unarmed ([`Evd::dequeue_polling`]) until
    /// the next plain dequeue or wait.
    polling: bool,
    /// The engine's bytes read from the completion-driven descriptor so far: fewer than
    /// its count (`ual::Cq::signals_given`) means more are in the socket or about to be.
    signals_read: u32,
}

/// A consumer polling an empty SEVD gives up its CPU once in this many empty dequeues:
/// the threads that would fill it (the embedded engine's, the uAL's event thread) may be
/// waiting for that CPU — on a two-core host two polling processes otherwise keep them
/// off both cores until the scheduler preempts a poller.
const POLL_YIELD_EVERY: u32 = 16;

impl State {
    fn ready(&self) -> bool {
        self.enabled && self.notified && self.threshold > 0 && self.queue.len() >= self.threshold
    }

    /// A thread in [`Evd::wait`] may take an event: the queue holds `threshold` events
    /// (at least one) and one of them wakes waiters. The waiter checks this before it
    /// sleeps and every change that makes it true wakes the waiter: one predicate, so
    /// an event that arrives while the waiter goes to sleep is never lost.
    fn wait_satisfied(&self) -> bool {
        self.wakeable && self.queue.len() >= self.threshold.max(1)
    }
}

/// The largest queue an EVD may ask for.
pub const MAX_QUEUE_SIZE: usize = 1 << 20;

impl Evd {
    /// Create an SEVD for `stream` holding up to `queue_size` events, ready at
    /// `threshold` events (0 disables readiness), optionally feeding `aevd`.
    ///
    /// The affiliated and unaffiliated async streams take one SEVD per IA
    /// (`AsyncAffEvdExists` / `AsyncUnaffEvdExists` for a second).
    pub fn create(
        ia: &Ia,
        stream: EventStream,
        flags: EvdFlags,
        queue_size: usize,
        threshold: usize,
        aevd: Option<&Aevd>,
    ) -> Result<Evd> {
        ia.check_alive()?;
        if stream == EventStream::AevdNotification {
            return Err(Error::InvalidEvdType);
        }
        if flags.contains(EvdFlags::DEQUEUE_NOTIFICATIONS) {
            return Err(Error::InvalidFlags);
        }
        if queue_size == 0 || queue_size > MAX_QUEUE_SIZE {
            return Err(Error::InvalidQueueSize);
        }
        if threshold > queue_size {
            return Err(Error::InvalidThreshold);
        }
        if let Some(a) = aevd {
            if a.0.ia.id() != ia.id() {
                return Err(Error::InvalidAevd);
            }
        }
        let on_completion = flags.contains(EvdFlags::FD_ON_COMPLETION);
        if on_completion && (stream != EventStream::Dto || !flags.contains(EvdFlags::CREATE_FD)) {
            return Err(Error::InvalidFlags);
        }
        let signal = match (flags.contains(EvdFlags::CREATE_FD), on_completion) {
            (false, _) => None,
            (true, false) => Some(Signal::new().map_err(|_| Error::Resources)?),
            (true, true) => Some(Signal::on_completion().map_err(|_| Error::Resources)?),
        };
        let dto = if stream == EventStream::Dto {
            let engine_end = signal.as_ref().and_then(Signal::engine_end);
            Some(DtoSource::new(ia, queue_size, engine_end)?)
        } else {
            None
        };
        let inner = Arc::new_cyclic(|me| SevdInner {
            common: Common::new(),
            ia: ia.clone(),
            stream,
            me: me.clone(),
            flags,
            st: Mutex::new(State {
                queue: VecDeque::new(),
                capacity: queue_size,
                threshold,
                notified: false,
                wakeable: false,
                overflowed: false,
                enabled: true,
                waiters: 0,
                in_aevd: false,
                fd_set: false,
                dead: false,
                empty_polls: 0,
                polling: false,
                signals_read: 0,
            }),
            cv: Condvar::new(),
            signal,
            aevd: aevd.map(|a| (a.clone(), a.0.common.use_guard())),
            dto,
            callback: Mutex::new(None),
        });
        match stream {
            EventStream::AsyncAffiliated | EventStream::AsyncUnaffiliated => {
                ia.claim_async_evd(stream, &inner)?
            }
            _ => {}
        }
        if let Some(d) = &inner.dto {
            d.listen(&inner);
        }
        ia.watch_for_death(Arc::downgrade(&inner) as Weak<dyn Wakeable>);
        tracing::debug!(
            id = inner.common.id,
            ?stream,
            queue_size,
            threshold,
            "SEVD created"
        );
        Ok(Evd(inner))
    }

    pub fn stream(&self) -> EventStream {
        self.0.stream
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    /// Take the oldest event without waiting (`QueueEmpty` when there is none).
    pub fn dequeue(&self) -> Result<Event> {
        self.0.dequeue(true)
    }

    /// krdma's extension: [`dequeue`](Self::dequeue) for a caller that keeps polling. The
    /// completion queue is left unarmed until the next plain dequeue or wait, so an
    /// embedded engine goes on receiving in the caller's thread (consumer-driven
    /// progress) instead of waking its own and the event thread for each completion.
    /// Meanwhile completions may not make the descriptor readable or reach an AEVD or a
    /// callback: the caller dequeues plainly before it relies on them.
    pub fn dequeue_polling(&self) -> Result<Event> {
        self.0.dequeue(false)
    }

    /// krdma's extension: take every event there is — queued, and waiting in the
    /// completion ring — into `out`, oldest first; how many were taken (0: none, or the
    /// IA is gone: `IaCatastrophe`). Readiness is settled once, at the end, so an SEVD
    /// emptied this way never shows ready in between (its descriptor is not made readable
    /// only to be cleared). `polling` as in [`dequeue_polling`](Self::dequeue_polling).
    pub fn dequeue_all(&self, out: &mut Vec<Event>, polling: bool) -> Result<usize> {
        self.0.dequeue_all(out, !polling)
    }

    /// krdma's extension: whether a consumer waiting for this SEVD's completions does
    /// better to poll it for a while than to sleep at once — its polls drive the engine
    /// (an embedded software provider) or the device works by itself (a uVP's adapter).
    /// Through krdmad polling only takes the CPU the daemon needs. False for SEVDs of
    /// other streams.
    pub fn worth_spinning(&self) -> bool {
        self.0.dto.as_ref().is_some_and(|d| d.cq.worth_spinning())
    }

    /// Wait up to `timeout` (`None`: for ever) until the SEVD holds `threshold` events
    /// (at least one), and take the oldest; returns it with the number of events left.
    /// The thread sleeps until the events are there (see the module's notes on which
    /// events wake it). One waiter at a time
    /// (`WaiterLimit`).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(Event, usize)> {
        self.0.wait(timeout)
    }

    /// The pollable descriptor (with [`EvdFlags::CREATE_FD`]): readable while the SEVD
    /// is ready.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.0.signal.as_ref().map(|s| s.as_fd())
    }

    /// Queue a software event carrying `data` (software-event SEVDs only).
    pub fn post_software(&self, data: u64) -> Result<()> {
        if self.0.stream != EventStream::Software {
            return Err(Error::InvalidEvdType);
        }
        let ev = Event::Software(SoftwareEvent {
            evd: self.0.obj_ref(),
            data,
        });
        if self.0.push(ev, true) {
            Ok(())
        } else {
            Err(Error::EvdQueueFull)
        }
    }

    pub fn query(&self) -> EvdParams {
        let st = self.0.st.lock();
        EvdParams {
            ia: self.0.ia.id(),
            stream: self.0.stream,
            flags: self.0.flags,
            queue_size: st.capacity,
            threshold: st.threshold,
            aevd: self.0.aevd.as_ref().map(|(a, _)| a.id()),
            fd: self.0.signal.as_ref().map(|s| s.raw()),
            enabled: st.enabled,
            overflowed: st.overflowed,
            callback: self.0.callback.lock().is_some(),
        }
    }

    /// Change the threshold (0 disables readiness).
    pub fn set_threshold(&self, threshold: usize) -> Result<()> {
        let mut st = self.0.st.lock();
        if threshold > st.capacity {
            return Err(Error::InvalidThreshold);
        }
        st.threshold = threshold;
        self.0.finish(st, false);
        Ok(())
    }

    /// Enable or disable notification.
    pub fn set_enabled(&self, enabled: bool) {
        let mut st = self.0.st.lock();
        st.enabled = enabled;
        self.0.finish(st, false);
    }

    /// Clear the overflowed mark.
    pub fn reset_overflow(&self) {
        self.0.st.lock().overflowed = false;
    }

    /// Run `callback` (on an event thread) whenever a notifying event makes the SEVD
    /// ready; `CallbackExists` if one is attached.
    pub fn attach_callback(&self, callback: Callback) -> Result<()> {
        attach(&self.0.callback, callback)?;
        // From now on the CQ (if any) must stay armed for the callback to run.
        self.0.on_completions();
        Ok(())
    }

    pub fn detach_callback(&self) -> Result<()> {
        detach(&self.0.callback)
    }

    /// A thread is blocked in [`Evd::wait`].
    pub fn has_waiter(&self) -> bool {
        self.0.st.lock().waiters > 0
    }
}

pub(crate) fn run(callbacks: Vec<Callback>) {
    for c in callbacks {
        c();
    }
}

pub(crate) fn attach(slot: &Mutex<Option<Callback>>, callback: Callback) -> Result<()> {
    let mut s = slot.lock();
    if s.is_some() {
        return Err(Error::CallbackExists);
    }
    *s = Some(callback);
    Ok(())
}

pub(crate) fn detach(slot: &Mutex<Option<Callback>>) -> Result<()> {
    slot.lock().take().map(drop).ok_or(Error::InvalidEvdState)
}

/// Objects the IA wakes when it dies (daemon gone, device fatal).
pub(crate) trait Wakeable: Send + Sync {
    fn wake_dead(&self);
}

impl Wakeable for SevdInner {
    fn wake_dead(&self) {
        self.st.lock().dead = true;
        self.cv.notify_all();
        self.wake_ring_sleeper();
    }
}

impl SevdInner {
    pub(crate) fn obj_ref(&self) -> EvdRef {
        EvdRef::new(self.common.id, &self.me.upgrade().expect("live SEVD"))
    }

    /// Queue one event; `false` when the SEVD was full and the event was lost.
    pub(crate) fn push(&self, ev: Event, notify: bool) -> bool {
        let mut st = self.st.lock();
        let ok = self.enqueue(&mut st, ev);
        let first_overflow = !ok && self.mark_overflow(&mut st);
        self.finish(st, notify && ok);
        if first_overflow {
            self.report_overflow();
        }
        ok
    }

    fn enqueue(&self, st: &mut State, ev: Event) -> bool {
        if st.queue.len() >= st.capacity {
            tracing::warn!(evd = self.common.id, number = ?ev.number(), "EVD overflow: event lost");
            return false;
        }
        st.queue.push_back(ev);
        st.wakeable = true;
        true
    }

    /// Mark the overflow; true the first time (until it is reset).
    fn mark_overflow(&self, st: &mut State) -> bool {
        !std::mem::replace(&mut st.overflowed, true)
    }

    /// Tell the IA's affiliated async EVD that this SEVD lost an event.
    fn report_overflow(&self) {
        if self.stream == EventStream::AsyncAffiliated {
            return;
        }
        let me = self.obj_ref();
        self.ia.post_affiliated(|evd| {
            Event::Affiliated(AffiliatedEvent {
                number: EventNumber::AsyncAffSevdEnqueueFailure,
                evd,
                cause: AffiliatedCause::Sevd(me),
            })
        });
    }

    /// After a change: wake a waiter whose wait is satisfied, then bring the descriptor
    /// and the AEVD entry in line with readiness. Returns the callbacks to run once
    /// unlocked.
    fn settle(&self, st: &mut State, notified: bool) -> Vec<Callback> {
        if notified {
            st.notified = true;
        }
        // A completion-driven descriptor still holding the SEVD's byte once it is no
        // longer ready: the refill drains it, then arms and looks at the ring again (the
        // drain may have taken a byte of the engine's too).
        if st.fd_set && !st.ready() && self.completion_driven() && self.refill(st, false) {
            st.notified = true;
        }
        if st.waiters > 0 && st.wait_satisfied() {
            self.cv.notify_all();
            self.wake_ring_sleeper();
        }
        let ready = st.ready();
        if let Some(s) = &self.signal {
            s.sync(&mut st.fd_set, ready);
        }
        let mut callbacks = Vec::new();
        if let Some((aevd, _)) = &self.aevd {
            if ready && !st.in_aevd {
                st.in_aevd = true;
                aevd.0
                    .mark_ready(self.common.id, self.me.clone(), &mut callbacks);
            } else if !ready && st.in_aevd {
                st.in_aevd = false;
                aevd.0.unmark(self.common.id);
            }
        }
        if ready && notified {
            callbacks.extend(self.callback.lock().clone());
        }
        callbacks
    }

    /// [`settle`](Self::settle), unlock, run the callbacks and the endpoint actions.
    fn finish(&self, mut st: MutexGuard<'_, State>, notified: bool) {
        let callbacks = self.settle(&mut st, notified);
        drop(st);
        run(callbacks);
        self.run_deferred();
    }

    fn pop(&self, st: &mut State) -> Option<Event> {
        let ev = st.queue.pop_front()?;
        if st.queue.is_empty() {
            st.notified = false;
            st.wakeable = false;
        }
        if self.flags.contains(EvdFlags::OVERFLOW_AUTO_RESET) {
            st.overflowed = false;
        }
        Some(ev)
    }

    /// Someone may be told of readiness without polling, or an endpoint's graceful
    /// close waits for its completions: keep the CQ armed.
    fn watched(&self, st: &State) -> bool {
        st.waiters > 0
            || self.signal.is_some()
            || self.aevd.is_some()
            || self.callback.lock().is_some()
            || self
                .dto
                .as_ref()
                .is_some_and(|d| d.closing.load(std::sync::atomic::Ordering::Acquire) > 0)
    }

    /// An endpoint's graceful close starts (`+1`) or stops (`-1`) waiting for this
    /// SEVD's completions.
    pub(crate) fn closing(&self, delta: isize) {
        if let Some(d) = &self.dto {
            d.closing(delta);
            if delta > 0 {
                d.cq.arm(false);
            }
        }
    }

    /// Endpoint actions the last refill asked for, run with the SEVD unlocked.
    fn run_deferred(&self) {
        if let Some(d) = &self.dto {
            d.run_deferred();
        }
    }

    /// Move completions from the completion ring into the queue; true when one notified.
    /// `waiting`: the caller is about to sleep for a notification.
    /// A polling consumer's SEVD leaves its CQ unarmed ([`Evd::dequeue_polling`]).
    fn refill(&self, st: &mut State, waiting: bool) -> bool {
        let Some(dto) = &self.dto else { return false };
        let how = self.arm_for(st, waiting);
        // A completion-driven descriptor is drained before the ring is looked at and the
        // CQ armed, never after: a byte the engine writes later is for a completion this
        // look does not see. The engine counts its bytes just before writing them, so
        // while fewer were read than counted, every refill drains again — a byte never
        // outlives the look that follows it, however late it comes, and no drain costs
        // a system call for nothing.
        let signal = self.signal.as_ref().filter(|s| s.is_completion_driven());
        let read = std::cell::Cell::new(st.signals_read);
        let drained = std::cell::Cell::new(false);
        let drain = |s: &Signal| {
            read.set(read.get().wrapping_add(s.drain()));
            drained.set(true);
        };
        let drain_new = || {
            if let Some(s) = signal.filter(|_| dto.cq.signals_given() != read.get()) {
                drain(s);
            }
        };
        drain_new();
        if !drained.get() && st.fd_set && !st.ready() {
            // The SEVD's own byte, stale.
            if let Some(s) = signal {
                drain(s);
            }
        }
        let mut notified = false;
        let room = st.capacity.saturating_sub(st.queue.len());
        dto.take(
            self,
            room,
            how,
            |ev, notify, wakes| {
                notified |= notify;
                st.wakeable |= wakes;
                st.queue.push_back(ev);
            },
            drain_new,
        );
        st.signals_read = read.get();
        if drained.get() {
            st.fd_set = false;
        }
        notified
    }

    /// How a refill leaves the CQ: unarmed for a polling consumer or when nobody is to
    /// be told; for the engine to write the descriptor when that descriptor is all
    /// there is to tell ([`EvdFlags::FD_ON_COMPLETION`]); else for the event.
    fn arm_for(&self, st: &State, waiting: bool) -> Arm {
        if !waiting && (st.polling || !self.watched(st)) {
            return Arm::No;
        }
        let descriptor_only = !waiting
            && st.waiters == 0
            && self.completion_driven()
            && self.dto.as_ref().is_some_and(|d| d.cq.can_signal())
            && self.aevd.is_none()
            && self.callback.lock().is_none()
            && self
                .dto
                .as_ref()
                .is_some_and(|d| d.closing.load(std::sync::atomic::Ordering::Acquire) == 0);
        if descriptor_only {
            Arm::Signal
        } else {
            Arm::Event
        }
    }

    fn completion_driven(&self) -> bool {
        self.signal
            .as_ref()
            .is_some_and(Signal::is_completion_driven)
    }

    /// Event thread: the completion ring has news.
    pub(crate) fn on_completions(&self) {
        let mut st = self.st.lock();
        let notified = self.refill(&mut st, false);
        self.finish(st, notified);
    }

    /// Event thread: the completion ring overflowed (a completion was lost).
    pub(crate) fn on_ring_overflow(&self) {
        let first = self.mark_overflow(&mut self.st.lock());
        if first {
            self.report_overflow();
        }
    }

    /// `arm`: as [`refill`](Self::refill) decides; without it never, until the next plain
    /// dequeue or wait (the caller polls on).
    fn dequeue(&self, arm: bool) -> Result<Event> {
        let mut st = self.st.lock();
        st.polling = !arm;
        let notified = self.refill(&mut st, false);
        let ev = self.pop(&mut st);
        let dead = st.dead;
        let give_way = if ev.is_some() {
            st.empty_polls = 0;
            false
        } else {
            st.empty_polls = st.empty_polls.wrapping_add(1);
            st.empty_polls.is_multiple_of(POLL_YIELD_EVERY)
        };
        self.finish(st, notified);
        match ev {
            Some(ev) => Ok(ev),
            None if dead => Err(Error::IaCatastrophe),
            None => {
                if give_way {
                    std::thread::yield_now();
                }
                Err(Error::QueueEmpty)
            }
        }
    }

    fn dequeue_all(&self, out: &mut Vec<Event>, arm: bool) -> Result<usize> {
        let mut st = self.st.lock();
        st.polling = !arm;
        let start = out.len();
        loop {
            self.refill(&mut st, false);
            let before = out.len();
            while let Some(ev) = self.pop(&mut st) {
                out.push(ev);
            }
            if out.len() == before {
                break;
            }
        }
        let dead = st.dead;
        // Everything is taken: no readiness to show for what notified meanwhile.
        self.finish(st, false);
        match out.len() - start {
            0 if dead => Err(Error::IaCatastrophe),
            n => Ok(n),
        }
    }

    /// The completion queue a waiter sleeps on directly (`Cq::sleep`: the engine wakes
    /// it, no `CqNotify` event is made): a DTO SEVD's whose CQ has a ring, when nothing
    /// but the waiter needs the notification (no descriptor, AEVD, callback or closing
    /// endpoint: see [`watched`](Self::watched)). Through krdmad this saves the event
    /// path's wake-ups (`docs/architecture.md`, "Events").
    fn ring_to_sleep_on(&self) -> Option<&ual::Cq> {
        let d = self.dto.as_ref()?;
        let alone = self.signal.is_none()
            && self.aevd.is_none()
            && self.callback.lock().is_none()
            && d.closing.load(std::sync::atomic::Ordering::Acquire) == 0;
        (alone && d.cq.sleeps_on_ring()).then_some(&*d.cq)
    }

    /// A waiter sleeping on the ring: whatever satisfied its wait was not (only) a
    /// completion.
    fn wake_ring_sleeper(&self) {
        if let Some(d) = &self.dto {
            d.cq.wake_sleepers();
        }
    }

    fn wait(&self, timeout: Option<Duration>) -> Result<(Event, usize)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = self.st.lock();
        if st.waiters > 0 {
            return Err(Error::WaiterLimit);
        }
        st.polling = false;
        loop {
            // Armed before the refill's look at the ring: a completion after the look
            // ends the sleep below.
            let ring = self
                .ring_to_sleep_on()
                .map(|cq| (cq, cq.arm_to_sleep(false)));
            let notified = self.refill(&mut st, ring.is_none());
            if st.wait_satisfied() {
                let ev = self.pop(&mut st).expect("queue holds events");
                let more = st.queue.len();
                self.finish(st, notified);
                return Ok((ev, more));
            }
            if notified {
                let callbacks = self.settle(&mut st, true);
                if !callbacks.is_empty() {
                    MutexGuard::unlocked(&mut st, || run(callbacks));
                    continue;
                }
            }
            if st.dead {
                return Err(Error::IaCatastrophe);
            }
            if self.dto.as_ref().is_some_and(DtoSource::has_deferred) {
                MutexGuard::unlocked(&mut st, || self.run_deferred());
                continue;
            }
            st.waiters += 1;
            let timed_out = match (ring, deadline) {
                (Some((cq, armed)), _) => {
                    let left = deadline.map_or(Duration::MAX, |d| {
                        d.saturating_duration_since(Instant::now())
                    });
                    let slept = MutexGuard::unlocked(&mut st, || cq.sleep(armed, left));
                    if slept.is_err() {
                        st.waiters -= 1;
                        return Err(Error::IaCatastrophe);
                    }
                    deadline.is_some_and(|d| Instant::now() >= d)
                }
                (None, Some(d)) => self.cv.wait_until(&mut st, d).timed_out(),
                (None, None) => {
                    self.cv.wait(&mut st);
                    false
                }
            };
            st.waiters -= 1;
            if timed_out {
                return Err(Error::TimeoutExpired);
            }
        }
    }

    /// An AEVD in direct mode takes one event from this SEVD (`None` when empty).
    pub(crate) fn take_for_aevd(&self) -> Option<Event> {
        let mut st = self.st.lock();
        st.in_aevd = false;
        let notified = self.refill(&mut st, false);
        let ev = self.pop(&mut st);
        self.finish(st, notified);
        ev
    }

    /// An AEVD handed out a notification for this SEVD: it may notify again.
    pub(crate) fn notification_taken(&self) {
        let mut st = self.st.lock();
        st.in_aevd = false;
        self.finish(st, false);
    }
}

impl Drop for SevdInner {
    fn drop(&mut self) {
        if let Some((aevd, _)) = &self.aevd {
            aevd.0.unmark(self.common.id);
        }
        tracing::debug!(id = self.common.id, stream = ?self.stream, "SEVD freed");
    }
}
