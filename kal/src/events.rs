//! Event management: one bounded event queue per context.
//!
//! Providers deliver events through a per-object [`ObjectSink`] that stamps the
//! consumer's handle and queues the record on the owning context. The queue never grows
//! past its bound: when one slot is left, an `EventOverflow` record is queued in it and
//! later events are dropped and counted until the consumer drains the queue. Connection
//! requests — which remote peers cause, as many as they like — may take at most half of
//! it ([`EventQueue::offer_request`]): beyond that a request is refused (the provider
//! rejects it) rather than queued, so a flood of them never costs the consumer its other
//! events.

use crate::cq_signal::{CqSignal, Given};
use parking_lot::Mutex;
use rnicpi::{Event, EventKind, EventSink};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

pub type Waker = Arc<dyn Fn() + Send + Sync>;

pub struct EventQueue {
    inner: Mutex<Inner>,
    dropped: AtomicU64,
    delivered: AtomicU64,
}

struct Inner {
    queue: VecDeque<Event>,
    cap: usize,
    /// `ConnectRequest` records in `queue`.
    requests: usize,
    overflowed: bool,
    waker: Option<Waker>,
}

impl EventQueue {
    pub fn new(cap: usize) -> Self {
        EventQueue {
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                cap: cap.max(2),
                requests: 0,
                overflowed: false,
                waker: None,
            }),
            dropped: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
        }
    }

    pub fn push(&self, ev: Event) {
        let waker = {
            let mut q = self.inner.lock();
            if q.queue.len() + 1 < q.cap {
                q.requests += (ev.kind == EventKind::ConnectRequest) as usize;
                q.queue.push_back(ev);
            } else if !q.overflowed {
                q.overflowed = true;
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(kind = ?ev.kind, "event queue full; events are being dropped");
                q.queue.push_back(Event::new(EventKind::EventOverflow));
            } else {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.waker.clone()
        };
        if let Some(w) = waker {
            w();
        }
    }

    /// Queue a connection request if requests take less than half of the queue; false
    /// (nothing queued, nothing counted as dropped) when they already do.
    pub fn offer_request(&self, ev: Event) -> bool {
        {
            let q = self.inner.lock();
            if q.requests >= q.cap / 2 {
                return false;
            }
        }
        self.push(ev);
        true
    }

    /// Pop up to `max` events.
    pub fn pop(&self, max: usize) -> Vec<Event> {
        let mut q = self.inner.lock();
        let n = max.min(q.queue.len());
        let out: Vec<Event> = q.queue.drain(..n).collect();
        let requests = out
            .iter()
            .filter(|e| e.kind == EventKind::ConnectRequest)
            .count();
        q.requests -= requests;
        if q.queue.is_empty() {
            q.overflowed = false;
        }
        self.delivered
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out
    }

    pub fn len(&self) -> usize {
        self.inner.lock().queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub fn set_waker(&self, waker: Option<Waker>) {
        let has_events = {
            let mut q = self.inner.lock();
            q.waker = waker.clone();
            !q.queue.is_empty()
        };
        if let (true, Some(w)) = (has_events, waker) {
            w();
        }
    }
}

/// The sink the kAL hands a provider for one object: stamps the handle and queues.
pub struct ObjectSink {
    queue: Weak<EventQueue>,
    handle: u32,
    /// A CQ's signal socket (`EventSink::signal`).
    signal: Option<CqSignal>,
}

impl ObjectSink {
    pub fn bound(queue: &Arc<EventQueue>, handle: u32) -> Arc<dyn EventSink> {
        Self::with_signal(queue, handle, None)
    }

    /// A CQ's sink, which gives signals through `signal` when there is one.
    pub fn with_signal(
        queue: &Arc<EventQueue>,
        handle: u32,
        signal: Option<CqSignal>,
    ) -> Arc<dyn EventSink> {
        Arc::new(ObjectSink {
            queue: Arc::downgrade(queue),
            handle,
            signal,
        })
    }
}

impl EventSink for ObjectSink {
    fn deliver(&self, mut ev: Event) {
        if let Some(q) = self.queue.upgrade() {
            ev.handle = self.handle;
            tracing::debug!(kind = ?ev.kind, handle = self.handle, "event queued");
            q.push(ev);
        }
    }

    fn signal(&self) -> bool {
        match self.signal.as_ref().map(CqSignal::give) {
            Some(Given::Written) => true,
            Some(Given::Full) => false,
            Some(Given::Failed) | None => {
                self.deliver(Event::new(EventKind::CqNotify));
                false
            }
        }
    }

    fn offer_request(&self, mut ev: Event) -> bool {
        let Some(q) = self.queue.upgrade() else {
            return false;
        };
        ev.handle = self.handle;
        let queued = q.offer_request(ev);
        tracing::debug!(handle = self.handle, queued, "connection request offered");
        queued
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_with_overflow_marker() {
        let q = Arc::new(EventQueue::new(4));
        let sink = ObjectSink::bound(&q, 9);
        for _ in 0..10 {
            sink.deliver(Event::new(EventKind::CqNotify));
        }
        let evs = q.pop(100);
        assert_eq!(evs.len(), 4);
        assert!(evs[..3]
            .iter()
            .all(|e| e.kind == EventKind::CqNotify && e.handle == 9));
        assert_eq!(evs[3].kind, EventKind::EventOverflow);
        assert_eq!(q.dropped(), 7);
        sink.deliver(Event::new(EventKind::CqNotify));
        assert_eq!(q.pop(100).len(), 1, "queue usable again after draining");
    }

    #[test]
    fn requests_take_at_most_half_and_never_push_other_events_out() {
        let q = Arc::new(EventQueue::new(8));
        let listener = ObjectSink::bound(&q, 1);
        let qp = ObjectSink::bound(&q, 2);
        let offered: Vec<bool> = (0..10)
            .map(|_| listener.offer_request(Event::new(EventKind::ConnectRequest)))
            .collect();
        assert_eq!(offered.iter().filter(|&&b| b).count(), 4, "{offered:?}");
        assert_eq!(q.dropped(), 0, "a refused request is not a dropped event");
        for _ in 0..3 {
            qp.deliver(Event::new(EventKind::Established));
        }
        let evs = q.pop(100);
        assert_eq!(evs.len(), 7);
        assert!(evs.iter().all(|e| e.kind != EventKind::EventOverflow));
        assert_eq!(
            evs.iter()
                .filter(|e| e.kind == EventKind::Established && e.handle == 2)
                .count(),
            3
        );
        assert!(
            listener.offer_request(Event::new(EventKind::ConnectRequest)),
            "room again once the consumer read them"
        );
    }

    #[test]
    fn waker_fires() {
        let q = Arc::new(EventQueue::new(8));
        let hits = Arc::new(AtomicU64::new(0));
        let h = hits.clone();
        q.set_waker(Some(Arc::new(move || {
            h.fetch_add(1, Ordering::Relaxed);
        })));
        q.push(Event::new(EventKind::PortActive));
        assert_eq!(hits.load(Ordering::Relaxed), 1);
    }
}
