//! The uAL's event handling: one thread per context waits on the kAL for event records
//! and hands each to a worker of a small pool, chosen by the object's handle so that the
//! events of one object are handled in order (seed 004 §4.3).

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use rnicpi::{Event, EventKind};
use std::collections::HashMap;
use std::sync::Arc;

/// A registered event handler.
pub type Handler = Arc<dyn Fn(Event) + Send + Sync>;

const WORKERS: usize = 2;

pub struct Dispatcher {
    handlers: Mutex<HashMap<u32, Handler>>,
    workers: Vec<Sender<(Handler, Event)>>,
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
                let _ = self.workers[ev.handle as usize % WORKERS].send((h, ev));
            }
            None => tracing::debug!(kind = ?ev.kind, handle = ev.handle, "event for no handler"),
        }
    }

    /// The access layer died: every handler gets `AccessLayerDead`.
    pub fn broadcast_dead(&self) {
        let hs: Vec<(u32, Handler)> = self
            .handlers
            .lock()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        for (handle, h) in hs {
            let mut ev = Event::new(EventKind::AccessLayerDead).with_status(libc::ENOTCONN);
            ev.handle = handle;
            let _ = self.workers[handle as usize % WORKERS].send((h, ev));
        }
    }
}

/// A handler that forwards into a channel, and the receiving end.
pub fn channel_handler() -> (Handler, Receiver<Event>) {
    let (tx, rx) = crossbeam_channel::unbounded();
    (Arc::new(move |ev| drop(tx.send(ev))), rx)
}
