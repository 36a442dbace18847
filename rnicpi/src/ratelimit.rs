//! Rate-limited logging of what consumers and peers can cause at will.
//!
//! A CQ overflow, a dropped SRQ entry or a refused quota is the consumer's doing and can
//! happen millions of times a second; a `warn!` for each would let any tenant flood the
//! daemon's log (and its disk). Each such call site logs through [`warn_limited!`]: at
//! most [`BURST`] lines per [`WINDOW`], and the next line it lets through says how many
//! it suppressed meanwhile. The events themselves are always counted elsewhere (every
//! refusal or drop has a counter shown by `krdma stat`); the log is only a sample.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// Lines one call site may log per window.
pub const BURST: u32 = 5;
/// The window.
pub const WINDOW: Duration = Duration::from_secs(10);

/// The budget of one call site.
pub struct LogLimit(Mutex<Window>);

struct Window {
    start: Option<Instant>,
    used: u32,
    suppressed: u64,
}

impl Default for LogLimit {
    fn default() -> Self {
        Self::new()
    }
}

impl LogLimit {
    pub const fn new() -> Self {
        LogLimit(Mutex::new(Window {
            start: None,
            used: 0,
            suppressed: 0,
        }))
    }

    /// `Some(suppressed)` when a line may be logged now (with the number of lines held
    /// back since the last one that was), `None` when this one is to be suppressed.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut w = self.0.lock();
        if w.start.is_none_or(|s| now.duration_since(s) >= WINDOW) {
            w.start = Some(now);
            w.used = 0;
        }
        if w.used < BURST {
            w.used += 1;
            Some(std::mem::take(&mut w.suppressed))
        } else {
            w.suppressed += 1;
            None
        }
    }
}

/// `tracing::warn!` at most [`BURST`] times per [`WINDOW`] from this call site; the
/// lines let through carry `suppressed`, the number held back before them.
#[macro_export]
macro_rules! warn_limited {
    ($($arg:tt)+) => {{
        static LIMIT: $crate::ratelimit::LogLimit = $crate::ratelimit::LogLimit::new();
        if let Some(suppressed) = LIMIT.allow() {
            $crate::ratelimit::__tracing::warn!(suppressed, $($arg)+);
        }
    }};
}

#[doc(hidden)]
pub use tracing as __tracing;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_suppresses_then_reports_what_it_held_back() {
        let l = LogLimit::new();
        let t0 = Instant::now();
        for _ in 0..BURST {
            assert_eq!(l.allow_at(t0), Some(0));
        }
        for _ in 0..1000 {
            assert_eq!(l.allow_at(t0 + Duration::from_secs(1)), None);
        }
        assert_eq!(l.allow_at(t0 + WINDOW), Some(1000));
        assert_eq!(l.allow_at(t0 + WINDOW), Some(0));
    }

    #[test]
    fn the_macro_compiles_and_limits() {
        for i in 0..100 {
            warn_limited!(i, "consumer did something silly");
        }
    }
}
