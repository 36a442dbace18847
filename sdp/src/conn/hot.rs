//! Connections left unarmed while their program calls them ("hot").
//!
//! With the embedded kAL a thread that polls a completion queue receives in its own thread
//! (consumer-driven progress, `rnicpi::progress`) as long as the queue is not armed:
//! arming is the signal to sleep. It gives receiving back to the engine's own threads and
//! turns every completion into a notification — the uAL's event thread, the progress
//! thread, the sleeper: a wake-up each, which on a small host is most of a message's cost.
//!
//! So a call on an SDP socket takes its completions without arming and leaves the
//! connection hot. A hot connection is armed again ("cooled") as soon as anything may wait
//! for a notification from it:
//!
//! * a caller about to sleep in the connection's own blocking call (after polling for a
//!   while);
//! * a thread of the program entering `poll`, `select` or `epoll_wait` (through the
//!   preload library, which calls [`Waiting::enter`]): the socket's readiness face needs
//!   the progress thread, and so notifications;
//! * any call made while such a thread waits (the connection is then never left hot);
//! * the progress thread's tick, for a connection hot and not called for a whole tick: a
//!   program that waits anywhere else (a pipe, a condition variable) needs nothing from
//!   the socket until it calls it again, but keep-alives and the peer's close are still
//!   taken within seconds.
//!
//! Leaving a connection hot needs the second rule, so only the preload library, which
//! sees the program's waits, turns it on ([`waits_are_seen`]); a program on the Rust API
//! (whose faces mio or tokio may be polling) has every call arm, and only its blocking
//! calls poll before they sleep. Through krdmad polling drives nothing (the daemon's
//! sockets are not the consumer's), so blocking calls do not poll there, but connections
//! are left hot all the same: an armed connection's every completion — a send's too —
//! wakes whoever watches its descriptor, most often the progress thread for nothing.

use super::Conn;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Blocking calls' waits ended by polling (something arrived while the caller polled),
/// and those that slept (process-wide; in the `krdma-sdp` report).
pub static WAITS_POLLED: AtomicU64 = AtomicU64::new(0);
pub static WAITS_SLEPT: AtomicU64 = AtomicU64::new(0);

/// The program's waits are seen ([`waits_are_seen`]).
static SEEN: AtomicBool = AtomicBool::new(false);
/// Threads of the program inside `poll`, `select` or `epoll_wait`.
static WAITING: AtomicUsize = AtomicUsize::new(0);
/// Connections that may be hot (checked under their lock when cooled), and how many.
static HOT: Mutex<Vec<Weak<Conn>>> = Mutex::new(Vec::new());
static HOT_LEN: AtomicUsize = AtomicUsize::new(0);

/// The caller (the preload library) sees every `poll`, `select` and `epoll_wait` of the
/// program and brackets it with [`Waiting`]: calls may leave connections hot.
pub fn waits_are_seen() {
    SEEN.store(true, Ordering::SeqCst);
}

/// Whether a call may leave its connection unarmed now.
pub(super) fn may_stay_hot() -> bool {
    SEEN.load(Ordering::Relaxed) && !waiting()
}

/// Whether a thread of the program waits in `poll`, `select` or `epoll_wait` now.
pub(super) fn waiting() -> bool {
    WAITING.load(Ordering::SeqCst) > 0
}

/// The connection has just gone hot: list it (once) for [`cool_all`] — where that can
/// run (the preload library's processes).
pub(super) fn add(conn: &Conn) {
    if !SEEN.load(Ordering::Relaxed) || conn.listed.swap(true, Ordering::AcqRel) {
        return;
    }
    let mut hot = HOT.lock().unwrap_or_else(|e| e.into_inner());
    hot.retain(|w| w.strong_count() > 0);
    hot.push(conn.me.clone());
    HOT_LEN.store(hot.len(), Ordering::Release);
}

/// Whether any connection may be hot.
pub fn any() -> bool {
    HOT_LEN.load(Ordering::Acquire) > 0
}

/// A thread of the program waits with a zero timeout (the preload library's `poll`,
/// `select`, `epoll_wait`): take what arrived on the hot connections, once, without arming
/// them, so their faces are true for the look.
pub fn poll_hot() {
    if !any() {
        return;
    }
    let conns: Vec<Arc<Conn>> = HOT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for c in conns {
        c.poll_hot();
    }
}

/// Arm every hot connection (and take what arrived meanwhile, so their faces are true).
pub fn cool_all() {
    if HOT_LEN.load(Ordering::Acquire) == 0 {
        return;
    }
    let conns = {
        let mut hot = HOT.lock().unwrap_or_else(|e| e.into_inner());
        HOT_LEN.store(0, Ordering::Release);
        std::mem::take(&mut *hot)
    };
    for c in conns.iter().filter_map(Weak::upgrade) {
        c.listed.store(false, Ordering::Release);
        c.cool();
    }
}

/// In a fork child: the connections are the parent's (never touched from here).
pub fn forget_all() {
    if let Ok(mut hot) = HOT.try_lock() {
        hot.clear();
    }
    HOT_LEN.store(0, Ordering::Release);
}

/// A thread of the program waiting in `poll`, `select` or `epoll_wait` (for as long as
/// this lives).
#[must_use]
pub struct Waiting(());

impl Waiting {
    /// The thread is about to wait: from now on every call arms, and every hot connection
    /// is armed now.
    pub fn enter() -> Waiting {
        WAITING.fetch_add(1, Ordering::SeqCst);
        cool_all();
        Waiting(())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::SeqCst);
    }
}
