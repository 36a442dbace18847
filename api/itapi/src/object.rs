//! What every IT-API object has: a process-unique id, a consumer context, and a count of
//! the objects that depend on it (an EVD used by endpoints, a PZ used by LMRs, ...).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// A process-unique object number; never reused, so a stale id names nothing.
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The fields every object carries. Declared as the last field of every object, so it
/// is dropped last: its `life` token ends only when the whole object is gone.
#[derive(Debug)]
pub(crate) struct Common {
    pub id: u64,
    /// The consumer context (`it_set_consumer_context`); 0 until set.
    pub context: AtomicU64,
    users: Arc<AtomicUsize>,
    life: Arc<()>,
}

impl Common {
    pub fn new() -> Common {
        Common {
            id: next_id(),
            context: AtomicU64::new(0),
            users: Arc::new(AtomicUsize::new(0)),
            life: Arc::new(()),
        }
    }

    /// A watch on the object this is part of.
    pub fn watch(&self) -> Watch {
        Watch(Arc::downgrade(&self.life))
    }

    /// Record a dependent object for as long as the returned guard lives.
    pub fn use_guard(&self) -> UseGuard {
        self.users.fetch_add(1, Ordering::AcqRel);
        UseGuard(self.users.clone())
    }

    /// Objects that depend on this one right now.
    pub fn users(&self) -> usize {
        self.users.load(Ordering::Acquire)
    }
}

/// One dependent object; dropping it ends the dependency.
#[derive(Debug)]
pub(crate) struct UseGuard(Arc<AtomicUsize>);

impl Drop for UseGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Tells whether an object still exists, without keeping it alive.
#[derive(Clone)]
pub struct Watch(std::sync::Weak<()>);

impl Watch {
    /// The object has not been freed yet (completely: its resources included).
    pub fn alive(&self) -> bool {
        self.0.strong_count() > 0
    }

    /// Wait (up to `limit`) until the object is freed; whether it was.
    pub fn wait_gone(&self, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while self.alive() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        true
    }
}

/// The accessors every public object type shares.
macro_rules! object_accessors {
    ($ty:ty) => {
        impl $ty {
            /// This object's process-unique id (also the key of its C handle).
            pub fn id(&self) -> u64 {
                self.0.common.id
            }

            /// The consumer context stored with [`set_context`](Self::set_context) (0 when unset).
            pub fn context(&self) -> u64 {
                self.0
                    .common
                    .context
                    .load(std::sync::atomic::Ordering::Acquire)
            }

            /// Store a consumer context with the object (`it_set_consumer_context`).
            pub fn set_context(&self, value: u64) {
                self.0
                    .common
                    .context
                    .store(value, std::sync::atomic::Ordering::Release)
            }

            /// How many objects depend on this one (the C interface refuses to free it while
            /// any do).
            pub fn users(&self) -> usize {
                self.0.common.users()
            }

            /// A watch that tells when the object is gone (an event thread may hold it for
            /// the moment it handles one of its events, after the consumer let go).
            pub fn watch(&self) -> $crate::Watch {
                self.0.common.watch()
            }
        }
    };
}
pub(crate) use object_accessors;
