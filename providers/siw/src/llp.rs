//! The lower-layer protocol stream of a connected QP (TCP), as the engine uses it:
//! writes that wait for room and writes that never wait, an orderly close (FIN) and an
//! abortive one (TCP reset), and the socket options siw sets.
//!
//! The transmit path reaches the stream only through [`Llp`], so the engine can also be
//! driven over memory (`crate::harness`, for fuzzing) without a socket.

use nix::sys::socket::{self, sockopt, MsgFlags};
use std::io::{self, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd};

/// Read what the stream holds now without waiting: `None` when it holds nothing.
pub(crate) fn read_now(s: &TcpStream, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match socket::recv(s.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
            Ok(n) => return Ok(Some(n)),
            Err(nix::errno::Errno::EAGAIN) => return Ok(None),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Where a connected QP's FPDUs go.
pub(crate) trait Llp: Send + Sync {
    /// Write all of `bytes`, waiting for room (only the QP's own transmit thread waits).
    fn write_all(&self, bytes: &[u8]) -> io::Result<()>;
    /// Write what fits now without waiting; returns how many bytes were taken.
    fn write_now(&self, bytes: &[u8]) -> io::Result<usize>;
    /// [`write_now`](Self::write_now) of the bytes an I/O vector names, in order.
    ///
    /// # Safety
    /// Every entry must name `iov_len` readable bytes that stay mapped for the call.
    unsafe fn write_now_vectored(&self, iov: &[libc::iovec]) -> io::Result<usize> {
        let mut flat = Vec::new();
        for v in iov {
            // SAFETY: the caller's promise: `iov_len` readable bytes at `iov_base`.
            let part = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
            flat.extend_from_slice(part);
        }
        self.write_now(&flat)
    }
    /// Wait until a write can take bytes again (or the stream failed). `false`: this LLP
    /// has no room to wait for (one in memory), so the caller copies out what is left and
    /// hands it to [`write_all`](Self::write_all).
    fn wait_writable(&self) -> io::Result<bool> {
        Ok(false)
    }
    /// Close one or both directions in order (a FIN after what was written).
    fn shutdown(&self, how: Shutdown);
    /// Abortive close: a TCP reset now, unsent data discarded; readers and writers
    /// blocked on the stream return with an error.
    fn abort(&self);
}

impl Llp for TcpStream {
    fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        Write::write_all(&mut &*self, bytes)
    }

    fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
        let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
        loop {
            match socket::send(self.as_raw_fd(), bytes, flags) {
                Ok(n) => return Ok(n),
                Err(nix::errno::Errno::EAGAIN) => return Ok(0),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    unsafe fn write_now_vectored(&self, iov: &[libc::iovec]) -> io::Result<usize> {
        // SAFETY: an all-zero msghdr is a valid value of the plain C struct.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        loop {
            // SAFETY: the kernel reads the caller's I/O vector (valid, per this method's
            // contract) and the msghdr, both live for the call; it writes nothing.
            let n = unsafe { libc::sendmsg(self.as_raw_fd(), &msg, flags) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => return Ok(0),
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        }
    }

    fn wait_writable(&self) -> io::Result<bool> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let mut fds = [PollFd::new(self.as_fd(), PollFlags::POLLOUT)];
        loop {
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => return Ok(true),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn shutdown(&self, how: Shutdown) {
        if how != Shutdown::Read {
            // An orderly close: what was written before the FIN is delivered even if the
            // descriptors close at once (no reset from `set_linger_zero` any more).
            let _ = socket::setsockopt(self, sockopt::Linger, &LINGER_OFF);
        }
        let _ = TcpStream::shutdown(self, how);
    }

    fn abort(&self) {
        set_linger_zero(self);
        if disconnect(self).is_err() {
            // No reset possible (not connected any more): at least wake every waiter.
            let _ = TcpStream::shutdown(self, Shutdown::Both);
        }
    }
}

/// `connect(AF_UNSPEC)`: Linux's `tcp_disconnect`, which sends a reset on a
/// synchronized connection whatever other descriptors of the socket are still open
/// (closing one of several never would), fails pending reads and writes, and leaves the
/// socket unconnected.
fn disconnect(s: &TcpStream) -> io::Result<()> {
    // SAFETY: an all-zero sockaddr is a valid value of the plain C struct.
    let mut unspec: libc::sockaddr = unsafe { std::mem::zeroed() };
    unspec.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: connect reads `size_of::<sockaddr>()` bytes from a live local struct; the
    // descriptor is the stream's own.
    let r = unsafe {
        libc::connect(
            s.as_raw_fd(),
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Make the last close of the socket a reset rather than a FIN. Set on every connected
/// stream, so a process that dies with connected QPs (its descriptors closed by the
/// kernel) reaches its peers as an abort; an orderly close turns it off again when it
/// sends its FIN ([`Llp::shutdown`]).
pub(crate) fn set_linger_zero(s: &TcpStream) {
    let zero = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = socket::setsockopt(s, sockopt::Linger, &zero);
}

/// Whether the connection ended with a reset rather than the peer's FIN. After a reset
/// only the first call on the socket reports it (`ECONNRESET`) and every later read sees
/// an end of stream, so when the tx thread's write took the error, the rx thread's read
/// returns 0 as for a FIN: it asks the socket's TCP state instead — `CLOSE` after a
/// reset, `CLOSE_WAIT` (or a closing state of our own) after a FIN.
pub(crate) fn was_reset(s: &TcpStream) -> bool {
    const TCP_CLOSE: u8 = 7; // include/net/tcp_states.h
                             // SAFETY: an all-zero tcp_info is a valid value of the plain C struct.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into the live local struct; the
    // descriptor is the stream's own.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    r == 0 && info.tcpi_state == TCP_CLOSE
}

/// The default: a close sends a FIN after what is queued.
const LINGER_OFF: libc::linger = libc::linger {
    l_onoff: 0,
    l_linger: 0,
};

/// The connected stream's maximum segment size (`TCP_MAXSEG`).
pub(crate) fn tcp_mss(s: &TcpStream) -> Option<usize> {
    socket::getsockopt(s, sockopt::TcpMaxSeg)
        .ok()
        .filter(|&v| v > 0)
        .map(|v| v as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn abort_resets_the_peer_even_with_other_descriptors_open() {
        let (a, mut b) = pair();
        let _clone = a.try_clone().unwrap();
        Llp::abort(&a);
        let mut buf = [0u8; 8];
        let e = b.read(&mut buf).expect_err("a reset, not an orderly EOF");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    }

    #[test]
    fn a_reset_is_told_from_a_fin_after_its_error_was_taken() {
        let (a, mut b) = pair();
        assert!(!was_reset(&b));
        Llp::abort(&a);
        // Another call takes the error (as the tx thread's write would)...
        let _ = (&b).write(&[1]);
        let _ = (&b).write(&[1]);
        // ...and the read sees an end of stream; the state still says reset.
        let mut buf = [0u8; 8];
        let _ = b.read(&mut buf);
        assert!(was_reset(&b));
        let (c, d) = pair();
        Llp::shutdown(&c, Shutdown::Write);
        let mut d2 = &d;
        assert_eq!(d2.read(&mut buf).unwrap(), 0);
        assert!(!was_reset(&d), "a FIN is not a reset");
    }

    #[test]
    fn an_orderly_close_delivers_everything_even_when_closed_at_once() {
        let (a, mut b) = pair();
        set_linger_zero(&a);
        Write::write_all(&mut &a, &[7u8; 100_000]).unwrap();
        Llp::shutdown(&a, Shutdown::Write);
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).expect("a FIN, not a reset");
        assert_eq!(got.len(), 100_000);
    }

    #[test]
    fn write_now_never_waits() {
        let (a, _b) = pair();
        let chunk = vec![0u8; 1 << 20];
        // The peer reads nothing: the buffers fill and write_now starts taking nothing.
        let mut total = 0usize;
        loop {
            let n = a.write_now(&chunk).unwrap();
            if n == 0 {
                break;
            }
            total += n;
            assert!(total < 1 << 30, "socket buffers never filled");
        }
        assert!(total > 0);
    }

    #[test]
    fn abort_wakes_a_blocked_reader() {
        let (a, _b) = pair();
        let mut reader = a.try_clone().unwrap();
        let t = std::thread::spawn(move || reader.read(&mut [0u8; 8]));
        std::thread::sleep(std::time::Duration::from_millis(50));
        Llp::abort(&a);
        assert!(t.join().unwrap().is_err(), "the blocked read fails");
    }
}
