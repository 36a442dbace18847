//! Completion signals: the socket a consumer hands over with `CREATE_CQ`, so the engine
//! can give a notification armed with `notify::SIGNAL` by writing one byte that the
//! consumer's own descriptor then reads. A thread asleep in `poll`/`epoll` on that
//! descriptor wakes without the event path (no event record, no `FUSE_NOTIFY_POLL`, no
//! event thread, no read through the device file).
//!
//! The engine writes from threads other tenants share, so nothing a tenant does with its
//! socket may stall them or make the daemon speak anywhere else:
//!
//! * only one end of a Unix stream socket pair is taken ([`verify`]): connected, neither
//!   end bound to a name, its peer made by a process of the caller's own user. A
//!   connected stream socket cannot be connected anew, so every byte goes to the
//!   tenant's other end and never to another program (which would see the daemon's
//!   credentials on it);
//! * every write is `send(MSG_DONTWAIT | MSG_NOSIGNAL)`: it never blocks, whatever the
//!   tenant does to the file's flags, and never raises `SIGPIPE`. A full socket already
//!   reads as readable, so a write refused for room loses nothing; a socket whose other
//!   end is gone makes the `CqNotify` event instead.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nix::sys::socket::{getpeername, getsockname, getsockopt, sockopt, SockType, UnixAddr};

/// Why a descriptor was refused as a CQ's signal socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SignalError {
    #[error("signal descriptor is not a Unix stream socket")]
    NotUnixStream,
    #[error("signal socket is not connected")]
    NotConnected,
    #[error("signal socket or its peer is bound to a name (only socket pairs are taken)")]
    Named,
    #[error("signal socket's peer was made by another user")]
    OtherUser,
}

impl From<SignalError> for rnicpi::VerbsError {
    fn from(_: SignalError) -> Self {
        rnicpi::VerbsError::Invalid
    }
}

/// Check that `fd` is one end of a Unix stream socket pair whose other end was made by
/// a process of user `uid` (see the module's notes).
pub fn verify(fd: BorrowedFd<'_>, uid: u32) -> Result<(), SignalError> {
    // (A socket of another family has no `UnixAddr` name: `getsockname` refuses it.)
    let stream = nix::sys::stat::fstat(fd)
        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
        && getsockopt(&fd, sockopt::SockType).ok() == Some(SockType::Stream);
    let me = getsockname::<UnixAddr>(fd.as_raw_fd())
        .ok()
        .filter(|_| stream)
        .ok_or(SignalError::NotUnixStream)?;
    let peer = getpeername::<UnixAddr>(fd.as_raw_fd()).map_err(|_| SignalError::NotConnected)?;
    let unnamed = |a: &UnixAddr| a.path_len() == 0;
    if !unnamed(&peer) || !unnamed(&me) {
        return Err(SignalError::Named);
    }
    let made_by =
        getsockopt(&fd, sockopt::PeerCredentials).map_err(|_| SignalError::NotConnected)?;
    if made_by.uid() != uid {
        return Err(SignalError::OtherUser);
    }
    Ok(())
}

/// What became of the engine's signals, for `krdma stat`.
#[derive(Debug, Default)]
pub struct SignalStats {
    /// Bytes written to consumers' signal sockets.
    sent: AtomicU64,
    /// Writes refused because the socket was full (the consumer has not read it: its
    /// descriptor is readable already, nothing is lost).
    full: AtomicU64,
    /// Signals given as `CqNotify` events instead: the consumer's end was gone.
    fell_back: AtomicU64,
}

impl SignalStats {
    pub fn counters(&self) -> [rnicpi::Counter; 3] {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("cq_signals_sent", get(&self.sent)),
            ("cq_signals_socket_full", get(&self.full)),
            ("cq_signals_as_events", get(&self.fell_back)),
        ]
    }
}

/// What became of one signal ([`CqSignal::give`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Given {
    /// Its byte is in the socket.
    Written,
    /// The socket is full: no byte written, none needed (it reads as readable).
    Full,
    /// The consumer's end is gone (or the socket broke): give the event instead.
    Failed,
}

/// A CQ's signal socket, daemon side.
#[derive(Debug)]
pub struct CqSignal {
    sock: OwnedFd,
    stats: Arc<SignalStats>,
}

impl CqSignal {
    /// A socket [`verify`] accepted.
    pub fn new(sock: OwnedFd, stats: Arc<SignalStats>) -> CqSignal {
        CqSignal { sock, stats }
    }

    /// Write the signal's byte.
    pub fn give(&self) -> Given {
        let flags =
            nix::sys::socket::MsgFlags::MSG_DONTWAIT | nix::sys::socket::MsgFlags::MSG_NOSIGNAL;
        match nix::sys::socket::send(self.sock.as_fd().as_raw_fd(), &[1], flags) {
            Ok(_) => {
                self.stats.sent.fetch_add(1, Ordering::Relaxed);
                Given::Written
            }
            Err(nix::errno::Errno::EAGAIN) => {
                self.stats.full.fetch_add(1, Ordering::Relaxed);
                Given::Full
            }
            Err(e) => {
                self.stats.fell_back.fetch_add(1, Ordering::Relaxed);
                rnicpi::warn_limited!(error = %e, "CQ signal socket failed: signalling by event");
                Given::Failed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};

    fn uid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn only_an_unnamed_stream_pair_of_the_callers_user_is_a_signal_socket() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(verify(a.as_fd(), uid()), Ok(()));
        assert_eq!(verify(a.as_fd(), uid() + 1), Err(SignalError::OtherUser));

        let (d, _e) = UnixDatagram::pair().unwrap();
        assert_eq!(verify(d.as_fd(), uid()), Err(SignalError::NotUnixStream));
        let efd = nix::sys::eventfd::EventFd::new().unwrap();
        assert_eq!(verify(efd.as_fd(), uid()), Err(SignalError::NotUnixStream));
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(verify(tcp.as_fd(), uid()), Err(SignalError::NotUnixStream));
        let file = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(verify(file.as_fd(), uid()), Err(SignalError::NotUnixStream));

        // A socket connected to another program's named socket, and that program's end.
        let dir = std::env::temp_dir().join(format!("krdma-sig-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let listener = UnixListener::bind(&dir).unwrap();
        let client = UnixStream::connect(&dir).unwrap();
        let (served, _) = listener.accept().unwrap();
        assert_eq!(verify(client.as_fd(), uid()), Err(SignalError::Named));
        assert_eq!(verify(served.as_fd(), uid()), Err(SignalError::Named));
        assert_eq!(
            verify(listener.as_fd(), uid()),
            Err(SignalError::NotConnected)
        );
        let _ = std::fs::remove_file(&dir);
    }

    #[test]
    fn a_signal_never_blocks_and_falls_back_once_the_consumer_is_gone() {
        let (a, mut b) = UnixStream::pair().unwrap();
        // The tenant makes the daemon's end blocking and never reads.
        a.set_nonblocking(false).unwrap();
        let stats = Arc::new(SignalStats::default());
        let sig = CqSignal::new(OwnedFd::from(a), stats.clone());
        let start = std::time::Instant::now();
        for _ in 0..1_000_000 {
            match sig.give() {
                Given::Written => {}
                Given::Full => break,
                Given::Failed => panic!("the consumer's end is there"),
            }
        }
        assert!(
            stats.full.load(Ordering::Relaxed) > 0,
            "the socket filled up"
        );
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
        let mut buf = [0u8; 64];
        assert!(b.read(&mut buf).unwrap() > 0);
        drop(b);
        assert_eq!(
            sig.give(),
            Given::Failed,
            "the consumer's end is gone: the event instead"
        );
        assert_eq!(stats.fell_back.load(Ordering::Relaxed), 1);
    }
}
