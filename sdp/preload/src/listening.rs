//! A listening socket's SDP side: the SDP listener beside the kernel's, connections
//! waiting for the program's `accept` (with the doorbell that makes the kernel listener
//! show them), and its sharing with fork children (`crate::bridges`).

use crate::table::{global, inside, COUNTERS};
use krdma_sdp::conn::Conn;
use krdma_sdp::reactor::{self, Reactive, Registration};
use krdma_sdp::switch::Use;
use krdma_sdp::SdpListener;
use libc::{c_int, c_void};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// A connection waiting for the program's `accept`.
pub enum Accepted {
    /// Accepted over SDP by the progress thread.
    Sdp(Arc<Conn>, OwnedFd),
    /// A kernel TCP connection taken out of the backlog while looking for a doorbell.
    Tcp(OwnedFd, libc::sockaddr_storage, libc::socklen_t),
}

/// A listening socket's SDP side: the SDP listener, connections waiting for the
/// program's `accept`, and the doorbell: while any wait, one loopback connection to the
/// kernel listener keeps it readable (so `poll`, `select`, `epoll` and a blocking
/// `accept` wake), and `accept` drops it when it comes out of the backlog.
pub struct Listening {
    sdp: SdpListener,
    use_: Use,
    at: SocketAddr,
    fd: c_int,
    st: Mutex<ListenState>,
    reg: Mutex<Option<Registration>>,
    /// Made before a `fork`: a child that accepts on the listener writes it
    /// ([`SharedListener::accepting`]).
    wake: Mutex<Option<OwnedFd>>,
    /// SDP connections are bridged to the kernel listener (`crate::bridges`), for
    /// whichever process accepts, instead of waiting for this process's `accept`.
    shared: AtomicBool,
}

struct ListenState {
    ready: VecDeque<Accepted>,
    /// The doorbell's local address (as the listener sees its peer) and its socket.
    doorbell: Option<(SocketAddr, OwnedFd)>,
}

impl Listening {
    pub fn start(fd: c_int, at: SocketAddr, use_: Use) -> std::io::Result<Arc<Listening>> {
        let g = global();
        let sdp = SdpListener::listen_at(at, None, &g.opts)?;
        let l = Arc::new(Listening {
            sdp,
            use_,
            at,
            fd,
            st: Mutex::new(ListenState {
                ready: VecDeque::new(),
                doorbell: None,
            }),
            reg: Mutex::new(None),
            wake: Mutex::new(None),
            shared: AtomicBool::new(false),
        });
        let me: Weak<dyn Reactive> = Arc::downgrade(&l) as Weak<dyn Reactive>;
        let reg = reactor::register(&[(l.sdp.as_fd(), false)], me)?;
        *l.reg.lock().unwrap_or_else(|e| e.into_inner()) = Some(reg);
        Ok(l)
    }

    pub fn sdp_only(&self) -> bool {
        self.use_ == Use::Sdp
    }

    /// Before a `fork`: make the descriptor a child writes when it accepts here, and the
    /// map bridges are filed in.
    pub fn prepare_sharing(&self) -> std::io::Result<()> {
        let mut w = self.wake.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_some() {
            return Ok(());
        }
        crate::bridges::prepare();
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the descriptor eventfd just made.
        let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        if let Some(r) = self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            r.add_readable(fd.as_fd())?;
        }
        *w = Some(fd);
        Ok(())
    }

    pub(crate) fn wake_fd(&self) -> Option<c_int> {
        self.wake.try_lock().ok()?.as_ref().map(|f| f.as_raw_fd())
    }

    /// A child asked for the SDP connections: from now on they are bridged, those
    /// waiting too (the doorbell goes: nothing waits for this process's `accept` now).
    fn start_sharing(&self) {
        if self.shared.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::info!(at = %self.at, "SDP listener shared with a fork child: connections bridged");
        let mut st = self.state();
        let waiting: Vec<Accepted> = st.ready.drain(..).collect();
        st.doorbell = None;
        for a in waiting {
            match a {
                Accepted::Sdp(c, f) => self.bridge(c, f),
                tcp => st.ready.push_back(tcp),
            }
        }
        self.ensure_doorbell(&mut st);
    }

    /// Hand the SDP connection `c` to the kernel listener as a loopback TCP connection
    /// whose bytes this process relays (`crate::bridges`).
    fn bridge(&self, c: Arc<Conn>, face: OwnedFd) {
        drop(face);
        let target = self.loopback();
        let r = inside(|| -> std::io::Result<()> {
            use nix::sys::socket::{self as ns, SockFlag, SockType, SockaddrStorage};
            let family = if target.is_ipv4() {
                ns::AddressFamily::Inet
            } else {
                ns::AddressFamily::Inet6
            };
            let s = ns::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
            ns::bind(
                s.as_raw_fd(),
                &SockaddrStorage::from(SocketAddr::new(target.ip(), 0)),
            )?;
            let me: SockaddrStorage = ns::getsockname(s.as_raw_fd())?;
            let port = me
                .as_sockaddr_in()
                .map(|a| a.port())
                .or_else(|| me.as_sockaddr_in6().map(|a| a.port()))
                .unwrap_or(0);
            let filed = crate::bridges::file(port, c.local, c.peer);
            if let Err(e) = ns::connect(s.as_raw_fd(), &SockaddrStorage::from(target)) {
                crate::bridges::withdraw(port);
                return Err(e.into());
            }
            let _ = ns::setsockopt(&s, ns::sockopt::TcpNoDelay, &true);
            c.relay_through(s)?;
            COUNTERS.bridged.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(port, filed, peer = %c.peer, "SDP connection bridged to the shared listener");
            Ok(())
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, peer = %c.peer, "SDP connection not bridged; aborted");
            inside(|| c.abort());
        }
    }

    /// Where a loopback connection reaches the kernel listener.
    fn loopback(&self) -> SocketAddr {
        if !self.at.ip().is_unspecified() {
            self.at
        } else if self.at.is_ipv4() {
            SocketAddr::from(([127, 0, 0, 1], self.at.port()))
        } else {
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, self.at.port()))
        }
    }

    fn state(&self) -> MutexGuard<'_, ListenState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next connection waiting, if any. When none is left the doorbell is taken out
    /// of the backlog (kernel connections found ahead of it wait here, with a new
    /// doorbell rung for them).
    pub fn take_ready(&self) -> Option<Accepted> {
        let mut st = self.state();
        let a = st.ready.pop_front()?;
        if st.ready.is_empty() && st.doorbell.is_some() {
            self.drain_doorbell(&mut st);
        }
        Some(a)
    }

    fn drain_doorbell(&self, st: &mut ListenState) {
        while st.doorbell.is_some() {
            let mut p = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one pollfd, the program's listener.
            if unsafe { libc::poll(&mut p, 1, 0) } != 1 {
                break;
            }
            // SAFETY: accept on the program's listener, into storage of our own.
            let (nfd, a, alen) = unsafe { crate::real_accept(self.fd, libc::SOCK_CLOEXEC) };
            if nfd < 0 {
                break;
            }
            // SAFETY: a descriptor accept just gave us.
            let own = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(nfd) };
            if self.is_doorbell_locked(st, &a, alen) {
                continue;
            }
            st.ready.push_back(Accepted::Tcp(own, a, alen));
        }
        self.ensure_doorbell(st);
    }

    fn is_doorbell_locked(
        &self,
        st: &mut ListenState,
        a: &libc::sockaddr_storage,
        alen: libc::socklen_t,
    ) -> bool {
        // SAFETY: the storage accept filled.
        let peer = unsafe { crate::read_addr(a as *const _ as *const libc::sockaddr, alen) };
        if peer.is_some() && st.doorbell.as_ref().map(|d| d.0) == peer {
            st.doorbell = None;
            return true;
        }
        false
    }

    /// Whether a connection `accept` took out of the backlog is our doorbell (it is then
    /// dropped, and a new one rung if connections still wait).
    pub fn is_doorbell(&self, a: &libc::sockaddr_storage, alen: libc::socklen_t) -> bool {
        let mut st = self.state();
        let yes = self.is_doorbell_locked(&mut st, a, alen);
        if yes {
            self.ensure_doorbell(&mut st);
        }
        yes
    }

    /// Ring the doorbell if connections wait and none is rung.
    fn ensure_doorbell(&self, st: &mut ListenState) {
        if st.ready.is_empty() || st.doorbell.is_some() {
            return;
        }
        let target = self.loopback();
        let r = inside(|| std::net::TcpStream::connect_timeout(&target, Duration::from_secs(1)));
        match r {
            Ok(s) => {
                if let Ok(local) = s.local_addr() {
                    st.doorbell = Some((local, s.into()));
                }
            }
            Err(e) => tracing::warn!(error = %e, "SDP listener: doorbell not rung"),
        }
    }
}

impl Reactive for Listening {
    fn on_ready(&self) {
        if let Some(w) = self.wake.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let mut b = [0u8; 8];
            // SAFETY: an 8-byte read from our non-blocking eventfd.
            if unsafe { libc::read(w.as_raw_fd(), b.as_mut_ptr() as *mut c_void, 8) } == 8 {
                self.start_sharing();
            }
        }
        loop {
            match self.sdp.try_accept_conn() {
                Ok(Some((c, f))) if self.shared.load(Ordering::Relaxed) => self.bridge(c, f),
                Ok(Some((c, f))) => {
                    let mut st = self.state();
                    st.ready.push_back(Accepted::Sdp(c, f));
                    self.ensure_doorbell(&mut st);
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "SDP accept failed");
                    break;
                }
            }
        }
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.reg.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
