//! The pollable file descriptor of an EVD. Two kinds:
//!
//! * **exact** (every EVD by default): an eventfd that is readable exactly while the EVD
//!   is ready (level-triggered, so it plugs into epoll, mio or tokio's `AsyncFd`);
//! * **completion-driven** (a DTO SEVD created with
//!   [`EvdFlags::FD_ON_COMPLETION`](super::EvdFlags::FD_ON_COMPLETION)): one end of a
//!   Unix stream socket pair, whose other end both the SEVD (when it becomes ready) and
//!   the CQ's engine (a completion armed with `notify::SIGNAL`) write a byte to. Through
//!   krdmad the engine makes it readable itself, skipping the event path. It may read
//!   readable before the SEVD is ready (a completion it has not looked at yet); the SEVD
//!   drains it only where it then arms the CQ and looks at the ring again, so a byte
//!   the engine wrote is never drained unseen.

use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::MsgFlags;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The byte the SEVD writes itself (the engine's are any other value).
const OWN_BYTE: u8 = b'R';

pub(crate) enum Signal {
    Exact(EventFd),
    /// `read` is the descriptor handed out; `write` the end the SEVD and the engine (its
    /// own duplicate) write to.
    OnCompletion {
        read: UnixStream,
        write: UnixStream,
    },
}

impl Signal {
    pub fn new() -> std::io::Result<Signal> {
        let fd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        Ok(Signal::Exact(fd))
    }

    pub fn on_completion() -> std::io::Result<Signal> {
        let (read, write) = UnixStream::pair()?;
        read.set_nonblocking(true)?;
        write.set_nonblocking(true)?;
        Ok(Signal::OnCompletion { read, write })
    }

    /// The end the CQ's engine is to write to (completion-driven descriptors).
    pub fn engine_end(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Signal::Exact(_) => None,
            Signal::OnCompletion { write, .. } => Some(write.as_fd()),
        }
    }

    /// Make the descriptor readable when `ready`; `is_set` is the owner's record of the
    /// SEVD's own byte (kept under the owner's lock, so no system call when nothing
    /// changes). An exact descriptor is also cleared when not `ready`; a completion-driven
    /// one only by [`Signal::drain`].
    pub fn sync(&self, is_set: &mut bool, ready: bool) {
        if ready == *is_set {
            return;
        }
        let r = match (self, ready) {
            (Signal::Exact(fd), true) => fd.write(1).map(drop),
            (Signal::Exact(fd), false) => fd.read().map(drop),
            (Signal::OnCompletion { write, .. }, true) => {
                let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
                nix::sys::socket::send(write.as_raw_fd(), &[OWN_BYTE], flags).map(drop)
            }
            (Signal::OnCompletion { .. }, false) => return,
        };
        match r {
            Ok(()) | Err(nix::errno::Errno::EAGAIN) => *is_set = ready,
            Err(e) => tracing::warn!(error = %e, "EVD descriptor update failed"),
        }
    }

    /// Completion-driven descriptors: empty the socket (the SEVD's byte and the
    /// engine's); how many of the engine's bytes were read. The caller arms the CQ and
    /// looks at the ring afterwards.
    pub fn drain(&self) -> u32 {
        let mut engine = 0u32;
        if let Signal::OnCompletion { read, .. } = self {
            let mut buf = [0u8; 64];
            while let Ok(n) =
                nix::sys::socket::recv(read.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT)
            {
                let ours = buf[..n].iter().filter(|&&b| b == OWN_BYTE).count();
                engine = engine.wrapping_add((n - ours) as u32);
                if n < buf.len() {
                    break;
                }
            }
        }
        engine
    }

    pub fn is_completion_driven(&self) -> bool {
        matches!(self, Signal::OnCompletion { .. })
    }

    pub fn raw(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}

impl AsFd for Signal {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Signal::Exact(fd) => fd.as_fd(),
            Signal::OnCompletion { read, .. } => read.as_fd(),
        }
    }
}
