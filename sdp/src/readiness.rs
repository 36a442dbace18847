//! A socket's readiness as a real kernel file descriptor.
//!
//! An SDP socket's data lives in RDMA buffers the kernel knows nothing of, yet programs
//! wait for sockets with `poll`, `select` and `epoll` — and fork, dup and pass them on.
//! So every SDP socket is given a "face": one end of a `AF_UNIX` stream socketpair whose
//! kernel readiness mirrors the SDP socket's, kept up to date by the stack:
//!
//! * **readable**: one token byte waits in the face's receive queue (written from the
//!   other end, the "back"); the reader takes it when the SDP socket has nothing left;
//! * **writable**: the face's send buffer is kept full (a small `SO_SNDBUF`, filled from
//!   the face) while the SDP socket cannot take bytes; the back reads the filler away
//!   when it can, which wakes the face's writers;
//! * **end of file / reset**: the back shuts down (`SHUT_WR`: the face reads EOF and
//!   polls `POLLIN|POLLRDHUP`; `SHUT_RDWR`: also `POLLHUP`).
//!
//! The kernel then answers every readiness question about the face itself — level and
//! edge triggered epoll, select, poll, across `dup` and `fork` — and a blocking wait on
//! the face honours `O_NONBLOCK`, `SO_RCVTIMEO`/`SO_SNDTIMEO`, signals and `SA_RESTART`
//! exactly as the kernel does for any socket. When every copy of the face is closed (in
//! every process) the back sees end of file: the SDP socket's last reference is gone.

use nix::sys::socket::{
    recv, send, setsockopt, shutdown, socketpair, sockopt, AddressFamily, MsgFlags, Shutdown,
    SockFlag, SockType,
};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

/// The face's send buffer: as small as the kernel allows, so a little filler blocks it.
const FACE_SNDBUF: usize = 4096;

/// Each direction's buffer once the face carries the data ([`Readiness::into_data_path`]).
const DATA_PATH_BUF: usize = 256 * 1024;

/// The back end of a face, and what the face currently shows.
#[derive(Debug)]
pub struct Readiness {
    back: OwnedFd,
    readable: bool,
    writable: bool,
    ended: Option<End>,
}

/// How the socket ended, as the face shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The peer will send no more: the face reads end of file.
    Eof,
    /// The connection failed: end of file and hang-up.
    Hangup,
}

impl Readiness {
    /// A new face (returned; it shows writable, not readable) and its back.
    pub fn new() -> std::io::Result<(OwnedFd, Readiness)> {
        let (face, back) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        setsockopt(&face, sockopt::SndBuf, &FACE_SNDBUF)?;
        // The back never blocks: every use of it is a non-blocking step.
        let fl = nix::fcntl::fcntl(&back, nix::fcntl::FcntlArg::F_GETFL)?;
        let fl = nix::fcntl::OFlag::from_bits_truncate(fl) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&back, nix::fcntl::FcntlArg::F_SETFL(fl))?;
        Ok((
            face,
            Readiness {
                back,
                readable: false,
                writable: true,
                ended: None,
            },
        ))
    }

    /// A readiness whose back is `back`, one end of a kernel stream connection that is
    /// a data path from the start (its face is the other end, held elsewhere).
    pub fn with_back(back: OwnedFd) -> std::io::Result<Readiness> {
        let fl = nix::fcntl::fcntl(&back, nix::fcntl::FcntlArg::F_GETFL)?;
        let fl = nix::fcntl::OFlag::from_bits_truncate(fl) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(&back, nix::fcntl::FcntlArg::F_SETFL(fl))?;
        Ok(Readiness {
            back,
            readable: false,
            writable: true,
            ended: None,
        })
    }

    /// The back's descriptor (the stack polls it for the face's last close).
    pub fn back(&self) -> BorrowedFd<'_> {
        self.back.as_fd()
    }

    /// Show readable (a token for the face's readers). Needs only the back.
    pub fn set_readable(&mut self) {
        if !self.readable && self.ended.is_none() {
            // MSG_NOSIGNAL: the face may be closed already (no SIGPIPE for the program).
            self.readable = send(
                self.back.as_raw_fd(),
                b"r",
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            )
            .is_ok();
        }
    }

    /// Show writable: read the filler away. Needs only the back.
    pub fn set_writable(&mut self) {
        if !self.writable {
            self.drain_back();
            self.writable = true;
        }
    }

    fn drain_back(&self) {
        let mut sink = [0u8; 4096];
        while matches!(recv(self.back.as_raw_fd(), &mut sink, MsgFlags::MSG_DONTWAIT), Ok(n) if n > 0)
        {
        }
    }

    /// Stop showing readable: take the token through the face (`face` must be a
    /// descriptor of this readiness's face).
    pub fn clear_readable(&mut self, face: BorrowedFd<'_>) {
        if self.readable && self.ended.is_none() {
            let mut b = [0u8; 1];
            let _ = recv(face.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT);
            self.readable = false;
        }
    }

    /// Stop showing writable: fill the face's send buffer (through `face`).
    pub fn clear_writable(&mut self, face: BorrowedFd<'_>) {
        if self.writable && self.ended.is_none() {
            let filler = [0u8; FACE_SNDBUF];
            while matches!(send(face.as_raw_fd(), &filler, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL), Ok(n) if n > 0)
            {
            }
            self.writable = false;
        }
    }

    /// Show the end for good: end of file, or hang-up (readable and writable too, so
    /// every waiter wakes and learns the error from its next call).
    pub fn end(&mut self, how: End) {
        if self.ended == Some(End::Hangup) || self.ended == Some(how) {
            return;
        }
        self.set_writable();
        let mode = match how {
            End::Eof => Shutdown::Write,
            End::Hangup => Shutdown::Both,
        };
        let _ = shutdown(self.back.as_raw_fd(), mode);
        self.ended = Some(how);
    }

    /// Make the face a plain byte stream (the connection is relayed through it from now
    /// on, `crate::conn` "shared across fork"): the readable token is taken back through
    /// `face`, the writable filler read away, and both ends get ordinary buffer sizes.
    /// Readiness is then the kernel's own, from the bytes that really wait.
    pub fn into_data_path(&mut self, face: BorrowedFd<'_>) -> std::io::Result<()> {
        if self.readable {
            let mut b = [0u8; 1];
            let _ = recv(face.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT);
            self.readable = false;
        }
        self.drain_back();
        self.writable = true;
        setsockopt(&face, sockopt::SndBuf, &DATA_PATH_BUF)?;
        setsockopt(&self.back, sockopt::SndBuf, &DATA_PATH_BUF)?;
        Ok(())
    }

    pub fn ended(&self) -> Option<End> {
        self.ended
    }

    /// Whether every descriptor of the face has been closed, in every process.
    /// Meaningless after [`End::Hangup`], which shuts
    /// the back's own receive side.
    pub fn face_closed(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        // The face's close shuts the back both ways: `POLLHUP`, whatever is queued.
        let mut p = [PollFd::new(self.back.as_fd(), PollFlags::empty())];
        // (A TCP back also says so with an error: the other end reset.)
        matches!(poll(&mut p, PollTimeout::ZERO), Ok(1))
            && p[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

    fn revents(fd: &OwnedFd) -> PollFlags {
        let mut p = [PollFd::new(
            fd.as_fd(),
            PollFlags::POLLIN | PollFlags::POLLOUT,
        )];
        poll(&mut p, PollTimeout::ZERO).unwrap();
        p[0].revents().unwrap()
    }

    #[test]
    fn face_mirrors_readiness() {
        let (face, mut r) = Readiness::new().unwrap();
        assert_eq!(revents(&face), PollFlags::POLLOUT);
        r.set_readable();
        assert_eq!(revents(&face), PollFlags::POLLIN | PollFlags::POLLOUT);
        r.clear_writable(face.as_fd());
        assert_eq!(revents(&face), PollFlags::POLLIN);
        r.clear_readable(face.as_fd());
        assert_eq!(revents(&face), PollFlags::empty());
        r.set_writable();
        assert_eq!(revents(&face), PollFlags::POLLOUT);
        r.end(End::Eof);
        assert!(revents(&face).contains(PollFlags::POLLIN));
        let mut b = [0u8; 1];
        assert_eq!(
            recv(face.as_raw_fd(), &mut b, MsgFlags::MSG_DONTWAIT),
            Ok(0),
            "end of file"
        );
        r.end(End::Hangup);
        let mut p = [PollFd::new(face.as_fd(), PollFlags::POLLIN)];
        poll(&mut p, PollTimeout::ZERO).unwrap();
        assert!(p[0].revents().unwrap().contains(PollFlags::POLLHUP));
    }

    #[test]
    fn last_close_of_the_face_is_seen_across_dup() {
        let (face, mut r) = Readiness::new().unwrap();
        r.clear_writable(face.as_fd());
        let dup = face.try_clone().unwrap();
        drop(face);
        assert!(!r.face_closed());
        drop(dup);
        assert!(r.face_closed(), "seen with the filler still queued");
    }
}
