//! The pollable file descriptor of an EVD: an eventfd that is readable exactly while the
//! EVD is ready (level-triggered, so it plugs into epoll, mio or tokio's `AsyncFd`).

use nix::sys::eventfd::{EfdFlags, EventFd};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

pub(crate) struct Signal {
    fd: EventFd,
}

impl Signal {
    pub fn new() -> std::io::Result<Signal> {
        let fd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        Ok(Signal { fd })
    }

    /// Make the descriptor readable iff `ready`; `is_set` is the owner's record of the
    /// current state (kept under the owner's lock, so no system call when nothing changes).
    pub fn sync(&self, is_set: &mut bool, ready: bool) {
        if ready == *is_set {
            return;
        }
        let r = if ready {
            self.fd.write(1).map(drop)
        } else {
            self.fd.read().map(drop)
        };
        match r {
            Ok(()) | Err(nix::errno::Errno::EAGAIN) => *is_set = ready,
            Err(e) => tracing::warn!(error = %e, "EVD eventfd update failed"),
        }
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl AsFd for Signal {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
