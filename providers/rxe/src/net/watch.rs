//! The receive thread's sleep on the device's sockets, which a thread about to take its
//! own datagrams off them can hush.
//!
//! Over loopback the kernel queues a datagram on the receiving socket within the
//! sender's `sendmsg`, and wakes whoever sleeps on that socket. When the sender is the
//! kAL's doorbell thread, which takes what it sent to this host itself
//! (`Receiver::receive_here`), that wake-up finds nothing to do, yet on two cores it costs
//! the consumers a CPU for a while: through krdmad it was most of the difference between
//! an 8-byte rxe ping-pong and the embedded one (docs/benchmarks.md). So the thread sleeps
//! in `epoll_wait`, and a hush takes the sockets' readiness out of its epoll set
//! (`EPOLL_CTL_MOD` with no events: the kernel then wakes no one) until the last hush
//! ends, when the sockets are watched again — and the kernel, looking at them anew, wakes
//! the sleeper at once if something is still queued. Nothing is lost; what arrives during
//! a hush is received at its end at the latest.

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use parking_lot::Mutex;
use std::io;
use std::os::fd::BorrowedFd;

const V4: u64 = 0;
const V6: u64 = 1;

/// The epoll set the receive thread sleeps on, and the hushes holding it quiet.
pub(super) struct Watch {
    epoll: Epoll,
    /// Threads inside a hush: the sockets wake the sleeper only at zero.
    hushes: Mutex<u32>,
}

impl Watch {
    /// Watch `v4` and, if any, `v6` for datagrams.
    pub(super) fn new(v4: BorrowedFd<'_>, v6: Option<BorrowedFd<'_>>) -> io::Result<Watch> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(v4, EpollEvent::new(EpollFlags::EPOLLIN, V4))?;
        if let Some(v6) = v6 {
            epoll.add(v6, EpollEvent::new(EpollFlags::EPOLLIN, V6))?;
        }
        Ok(Watch {
            epoll,
            hushes: Mutex::new(0),
        })
    }

    /// Sleep until a socket has a datagram, at most `ms`: which do (`[v4, v6]`), or
    /// `None` when the time ran out (or a hush kept the sockets quiet throughout).
    pub(super) fn wait(&self, ms: u16) -> Option<[bool; 2]> {
        let mut events = [EpollEvent::empty(); 2];
        let n = self.epoll.wait(&mut events, EpollTimeout::from(ms)).ok()?;
        (n > 0).then(|| {
            let has = |token| events[..n].iter().any(|e| e.data() == token);
            [has(V4), has(V6)]
        })
    }

    /// Begin (`on`) or end a hush of the sockets `v4` and `v6`; only the first to begin
    /// and the last to end change the epoll set.
    pub(super) fn hush(&self, on: bool, v4: BorrowedFd<'_>, v6: Option<BorrowedFd<'_>>) {
        let mut hushes = self.hushes.lock();
        let was = *hushes;
        *hushes = if on { was + 1 } else { was.saturating_sub(1) };
        if (was == 0) == (*hushes == 0) {
            return;
        }
        let flags = if on {
            EpollFlags::empty()
        } else {
            EpollFlags::EPOLLIN
        };
        let sockets = [(Some(v4), V4), (v6, V6)];
        for (fd, token) in sockets.into_iter().filter_map(|(fd, t)| Some((fd?, t))) {
            if let Err(e) = self.epoll.modify(fd, &mut EpollEvent::new(flags, token)) {
                // Not watched again, the sockets are still read every wait's 200 ms.
                tracing::warn!(error = %e, hush = on, "rxe: cannot change the receive thread's watch");
            }
        }
        tracing::trace!(hush = on, "rxe receive watch");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsFd;

    fn pair() -> (UdpSocket, UdpSocket) {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        tx.connect(rx.local_addr().unwrap()).unwrap();
        (rx, tx)
    }

    #[test]
    fn a_hush_keeps_the_sleeper_asleep_and_its_end_wakes_it_for_what_came() {
        let (rx, tx) = pair();
        let w = Watch::new(rx.as_fd(), None).unwrap();
        assert_eq!(w.wait(0), None);
        w.hush(true, rx.as_fd(), None);
        w.hush(true, rx.as_fd(), None); // a second thread
        tx.send(b"x").unwrap();
        assert_eq!(w.wait(20), None, "hushed: the datagram wakes no one");
        w.hush(false, rx.as_fd(), None);
        assert_eq!(w.wait(20), None, "one hush still holds");
        w.hush(false, rx.as_fd(), None);
        assert_eq!(
            w.wait(0),
            Some([true, false]),
            "queued during the hush: ready at its end"
        );
        let mut b = [0u8; 4];
        rx.recv(&mut b).unwrap();
        assert_eq!(w.wait(0), None);
    }

    #[test]
    fn both_sockets_are_watched_and_told_apart() {
        let (a, ta) = pair();
        let (b, tb) = pair();
        let w = Watch::new(a.as_fd(), Some(b.as_fd())).unwrap();
        tb.send(b"6").unwrap();
        assert_eq!(w.wait(1000), Some([false, true]));
        ta.send(b"4").unwrap();
        assert_eq!(w.wait(1000), Some([true, true]));
        w.hush(true, a.as_fd(), Some(b.as_fd()));
        assert_eq!(w.wait(0), None);
        w.hush(false, a.as_fd(), Some(b.as_fd()));
        assert_eq!(w.wait(0), Some([true, true]));
    }
}
