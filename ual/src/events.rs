//! The uAL's event handling: one thread per context waits on the kAL for event records
//! and hands each to a worker of a small pool (seed 004 §4.3). Completion queues and
//! SRQs are spread over the pool by handle, so the events of one object are handled in
//! order; the events of QPs and listeners (connection events, QP errors) and the
//! unaffiliated ones all go to one worker, so they are handled in the order the kAL
//! queued them — across objects too, as one RDMA CM event channel delivers them (a
//! passive side's `Established` is never overtaken by another connection's end).

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use rnicpi::{Event, EventKind};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A registered event handler.
pub type Handler = Arc<dyn Fn(Event) + Send + Sync>;

const WORKERS: usize = 2;

pub struct Dispatcher {
    handlers: Mutex<HashMap<u32, Handler>>,
    workers: Vec<Sender<(Handler, Event)>>,
    /// The access layer died ([`Dispatcher::broadcast_dead`]).
    dead: AtomicBool,
}

impl Dispatcher {
    pub fn new() -> Arc<Dispatcher> {
        let workers = (0..WORKERS)
            .map(|i| {
                let (tx, rx) = crossbeam_channel::unbounded::<(Handler, Event)>();
                std::thread::Builder::new()
                    .name(format!("krdma-evw{i}"))
                    .spawn(move || {
                        for (h, ev) in rx {
                            h(ev);
                        }
                    })
                    .expect("spawn event worker");
                tx
            })
            .collect();
        Arc::new(Dispatcher {
            handlers: Mutex::new(HashMap::new()),
            workers,
            dead: AtomicBool::new(false),
        })
    }

    pub fn set(&self, handle: u32, h: Handler) {
        self.handlers.lock().insert(handle, h);
    }

    pub fn remove(&self, handle: u32) {
        self.handlers.lock().remove(&handle);
    }

    /// Route one event to its object's handler (unknown handles are dropped).
    pub fn dispatch(&self, ev: Event) {
        let h = self.handlers.lock().get(&ev.handle).cloned();
        match h {
            Some(h) => {
                let _ = self.workers[worker_for(&ev)].send((h, ev));
            }
            None => tracing::debug!(kind = ?ev.kind, handle = ev.handle, "event for no handler"),
        }
    }

    /// Whether the access layer died: for waits that no event reaches.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// The access layer died: every handler gets `AccessLayerDead`.
    pub fn broadcast_dead(&self) {
        self.dead.store(true, Ordering::Release);
        let hs: Vec<(u32, Handler)> = self
            .handlers
            .lock()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        for (handle, h) in hs {
            let mut ev = Event::new(EventKind::AccessLayerDead).with_status(libc::ENOTCONN);
            ev.handle = handle;
            let _ = self.workers[worker_for(&ev)].send((h, ev));
        }
    }
}

/// The worker that handles `ev`: by handle for the events of CQs and SRQs, the first
/// worker for everything else (see the module's notes).
fn worker_for(ev: &Event) -> usize {
    match ev.kind {
        EventKind::CqNotify
        | EventKind::CqError
        | EventKind::SrqError
        | EventKind::SrqLimitReached => ev.handle as usize % WORKERS,
        _ => 0,
    }
}

/// A handler that forwards into a channel, and the receiving end.
pub fn channel_handler() -> (Handler, Receiver<Event>) {
    let (tx, rx) = crossbeam_channel::unbounded();
    (Arc::new(move |ev| drop(tx.send(ev))), rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn event(kind: EventKind, handle: u32) -> Event {
        let mut ev = Event::new(kind);
        ev.handle = handle;
        ev
    }

    /// One QP's `Established` is handled before another's later `Disconnected`, even
    /// when the first handler is slow (a consumer counting connection events in the
    /// order they happened, as dtestcm does, relies on it).
    #[test]
    fn connection_events_keep_their_order_across_objects() {
        let d = Dispatcher::new();
        let (tx, rx) = crossbeam_channel::unbounded();
        for handle in [1u32, 2] {
            let tx = tx.clone();
            d.set(
                handle,
                Arc::new(move |ev: Event| {
                    if ev.kind == EventKind::Established {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let _ = tx.send((ev.handle, ev.kind));
                }),
            );
        }
        d.dispatch(event(EventKind::Established, 1));
        d.dispatch(event(EventKind::Disconnected, 2));
        let got: Vec<_> = (0..2)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(
            got,
            [(1, EventKind::Established), (2, EventKind::Disconnected)]
        );
    }

    #[test]
    fn completion_queues_spread_over_the_workers() {
        assert_ne!(
            worker_for(&event(EventKind::CqNotify, 1)),
            worker_for(&event(EventKind::CqNotify, 2))
        );
        assert_eq!(worker_for(&event(EventKind::Disconnected, 1)), 0);
    }
}
