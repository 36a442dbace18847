//! Fork detection, for a kAL inside its consumer's process (embedded mode) and for the
//! uAL's objects.
//!
//! `fork()` copies the process's memory but none of its threads: a child holds a copy of
//! the embedded kAL whose provider threads (siw's, rxe's) and whose uAL event thread do
//! not exist there, and whose locks may have been held by one of them at the moment of
//! the fork. Driving that copy could hang or corrupt, so a forked child must be refused
//! cleanly instead. A `pthread_atfork` child handler counts forks; a [`Lineage`] taken
//! in a process is no longer "here" in its children. Checking is one atomic load.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORKS: AtomicU64 = AtomicU64::new(0);
static HANDLER: Once = Once::new();

extern "C" fn in_child() {
    // Async-signal-safe: one atomic add.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The process something was created in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lineage(u64);

impl Lineage {
    /// This process, as it is now.
    pub fn here() -> Lineage {
        HANDLER.call_once(|| {
            // SAFETY: registers a child handler that only does an atomic add; the
            // function lives for the whole program.
            let r = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
            assert_eq!(r, 0, "pthread_atfork");
        });
        Lineage(FORKS.load(Ordering::Relaxed))
    }

    /// Whether we are still in the process this lineage was taken in (not a fork child).
    pub fn is_here(&self) -> bool {
        FORKS.load(Ordering::Relaxed) == self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fork_child_is_not_here() {
        let home = Lineage::here();
        assert!(home.is_here());
        // SAFETY: the child only does an atomic load and _exit.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let code = if home.is_here() { 1 } else { 0 };
                // SAFETY: leaves the child without running the parent's destructors.
                unsafe { libc::_exit(code) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                let st = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(st, nix::sys::wait::WaitStatus::Exited(child, 0));
                assert!(home.is_here(), "the parent is still home");
            }
        }
    }
}
