//! `libkrdma_sdp_preload.so`: unmodified, dynamically linked socket programs over SDP.
//!
//! ```sh
//! LD_PRELOAD=libkrdma_sdp_preload.so iperf3 -s
//! ```
//!
//! Every `AF_INET`/`AF_INET6` stream socket a program makes starts as the kernel TCP
//! socket it asked for. At `connect` the offload protocol switch decides
//! ([`krdma_sdp::switch`]): over SDP, the descriptor is replaced in place (`dup3`) by the
//! SDP socket's readiness face, so the program keeps its descriptor number and the
//! kernel itself answers `poll`, `select` and `epoll` on it; over TCP (the policy, or the
//! peer has no SDP) the socket is left alone and nothing of this library stays in its
//! way. A listening socket stays the kernel's TCP listener and gets an SDP listener on
//! the same port beside it; an SDP connection arriving there rings a "doorbell" (a
//! loopback TCP connection to the listener, which `accept` recognises and drops), so the
//! program's `accept`, `poll` and `epoll` wake for either kind.
//!
//! The library's own sockets (the RDMA stack's, the progress thread's) are never taken
//! for the program's: every thread this library starts, and every call made while it
//! works, passes straight to the C library.
//!
//! Over 600 lines: every interposed libc call and its fall-back to the real one, kept
//! together so the interposition table is reviewed as a whole.

// The exported functions are the C library's own socket calls, with the C library's
// contracts (documented in its manual pages), not new unsafe interfaces of ours.
#![allow(clippy::missing_safety_doc)]

mod bridges;
mod listening;
mod real;
mod table;
mod waits;

use krdma_sdp::conn::{io_error, is_relayed, Conn};
use krdma_sdp::switch::{Role, Use, COUNTERS};
use libc::{c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};
use real::real;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use table::{global, inside, is_inside, Kind, Listening, Relayed, Sock, Stream};

fn set_errno(e: c_int) {
    // SAFETY: errno of the calling thread.
    unsafe { *libc::__errno_location() = e }
}

/// Return -1 with errno from `e`.
fn fail<T: From<i8>>(e: &io::Error) -> T {
    set_errno(e.raw_os_error().unwrap_or_else(|| match e.kind() {
        io::ErrorKind::WouldBlock => libc::EAGAIN,
        io::ErrorKind::Interrupted => libc::EINTR,
        io::ErrorKind::ConnectionReset => libc::ECONNRESET,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::BrokenPipe => libc::EPIPE,
        io::ErrorKind::ConnectionRefused => libc::ECONNREFUSED,
        io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        io::ErrorKind::AddrInUse => libc::EADDRINUSE,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        _ => libc::EIO,
    }));
    T::from(-1)
}

/// The socket address at `addr` (IPv4, IPv6, or IPv4-mapped IPv6 made plain).
///
/// # Safety
/// `addr` points to `len` readable bytes, or is null.
pub(crate) unsafe fn read_addr(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    match c_int::from((*addr).sa_family) {
        libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            let a = &*(addr as *const libc::sockaddr_in);
            Some(SocketAddr::from((
                u32::from_be(a.sin_addr.s_addr).to_be_bytes(),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            let a = &*(addr as *const libc::sockaddr_in6);
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            let ip = ip
                .to_ipv4_mapped()
                .map(std::net::IpAddr::V4)
                .unwrap_or(ip.into());
            Some(SocketAddr::new(ip, u16::from_be(a.sin6_port)))
        }
        _ => None,
    }
}

/// Write `a` to a caller's address buffer in the socket's `family` (IPv4 addresses as
/// IPv4-mapped IPv6 for an `AF_INET6` socket), truncating as the kernel does.
///
/// # Safety
/// `out` is null or points to `*len` writable bytes; `len` is null or valid.
unsafe fn write_addr(a: SocketAddr, family: c_int, out: *mut sockaddr, len: *mut socklen_t) {
    if out.is_null() || len.is_null() {
        return;
    }
    let mut st: libc::sockaddr_storage = std::mem::zeroed();
    let n = if family == libc::AF_INET6 {
        let s = &mut *(&mut st as *mut _ as *mut libc::sockaddr_in6);
        s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        s.sin6_port = a.port().to_be();
        s.sin6_addr.s6_addr = match a.ip() {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(v6) => v6.octets(),
        };
        std::mem::size_of::<libc::sockaddr_in6>()
    } else {
        let s = &mut *(&mut st as *mut _ as *mut libc::sockaddr_in);
        s.sin_family = libc::AF_INET as libc::sa_family_t;
        s.sin_port = a.port().to_be();
        if let std::net::IpAddr::V4(v4) = a.ip() {
            s.sin_addr.s_addr = u32::from_be_bytes(v4.octets()).to_be();
        }
        std::mem::size_of::<libc::sockaddr_in>()
    };
    let room = (*len as usize).min(n);
    std::ptr::copy_nonoverlapping(&st as *const _ as *const u8, out as *mut u8, room);
    *len = n as socklen_t;
}

/// The face of a stream as a borrowed descriptor.
fn face(fd: c_int) -> BorrowedFd<'static> {
    // SAFETY: `fd` is the program's open descriptor of the face for the duration of the
    // call that passed it to us.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

fn nonblocking(fd: c_int) -> bool {
    // SAFETY: fcntl F_GETFL on a descriptor.
    let fl = unsafe { (real().fcntl)(fd, libc::F_GETFL, 0) };
    fl >= 0 && fl & libc::O_NONBLOCK != 0
}

/// `SO_RCVTIMEO` / `SO_SNDTIMEO` of the face, as a deadline from now.
fn deadline(fd: c_int, opt: c_int) -> Option<Instant> {
    let mut tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = std::mem::size_of::<libc::timeval>() as socklen_t;
    // SAFETY: getsockopt into a timeval of the right size.
    let r = unsafe {
        (real().getsockopt)(
            fd,
            libc::SOL_SOCKET,
            opt,
            &mut tv as *mut _ as *mut c_void,
            &mut len,
        )
    };
    if r != 0 || (tv.tv_sec == 0 && tv.tv_usec == 0) {
        return None;
    }
    Some(Instant::now() + Duration::new(tv.tv_sec as u64, tv.tv_usec as u32 * 1000))
}

// ---------------------------------------------------------------------------------------
// Socket creation, naming, connecting, listening, accepting.

// ---------------------------------------------------------------------------------------
// The library's own descriptors live high, out of the program's way: programs size tables
// by their descriptor numbers (an event loop of `10 + 3 × connections` slots, `select`'s
// 1024), and the RDMA stack opens several descriptors per connection.

/// Move a descriptor the library made to the upper half of the descriptor space (kept
/// where it is when there is no room).
fn relocate(fd: c_int) -> c_int {
    static FLOOR: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    let floor = *FLOOR.get_or_init(|| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit into a local.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
        (r.rlim_cur / 2).clamp(0, 1 << 20) as c_int
    });
    if fd < 0 || fd >= floor || floor < 64 {
        return fd;
    }
    // SAFETY: duplicating a descriptor we just made, then closing the original.
    unsafe {
        let cloexec = (real().fcntl)(fd, libc::F_GETFD, 0);
        let cmd = if cloexec >= 0 && cloexec & libc::FD_CLOEXEC != 0 {
            libc::F_DUPFD_CLOEXEC
        } else {
            libc::F_DUPFD
        };
        let high = (real().fcntl)(fd, cmd, floor as libc::c_ulong);
        if high < 0 {
            return fd;
        }
        (real().close)(fd);
        high
    }
}

#[no_mangle]
pub unsafe extern "C" fn socketpair(d: c_int, t: c_int, p: c_int, sv: *mut c_int) -> c_int {
    let r = (real().socketpair)(d, t, p, sv);
    if r == 0 && is_inside() {
        *sv = relocate(*sv);
        *sv.add(1) = relocate(*sv.add(1));
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn eventfd(init: libc::c_uint, flags: c_int) -> c_int {
    let fd = (real().eventfd)(init, flags);
    if is_inside() {
        relocate(fd)
    } else {
        fd
    }
}

#[no_mangle]
pub unsafe extern "C" fn memfd_create(name: *const libc::c_char, flags: libc::c_uint) -> c_int {
    let fd = (real().memfd_create)(name, flags);
    if is_inside() {
        relocate(fd)
    } else {
        fd
    }
}

#[no_mangle]
pub unsafe extern "C" fn epoll_create1(flags: c_int) -> c_int {
    let fd = (real().epoll_create1)(flags);
    if is_inside() {
        relocate(fd)
    } else {
        fd
    }
}

#[no_mangle]
pub unsafe extern "C" fn open64(
    path: *const libc::c_char,
    flags: c_int,
    mode: libc::mode_t,
) -> c_int {
    let fd = (real().open64)(path, flags, mode);
    if is_inside() {
        relocate(fd)
    } else {
        fd
    }
}

#[no_mangle]
pub unsafe extern "C" fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    let fd = (real().socket)(domain, ty, protocol);
    if fd < 0 {
        return fd;
    }
    if is_inside() {
        return relocate(fd);
    }
    let stream = ty & 0xf == libc::SOCK_STREAM;
    let inet = domain == libc::AF_INET || domain == libc::AF_INET6;
    let tcp = protocol == 0 || protocol == libc::IPPROTO_TCP;
    if stream && inet && tcp && global().offload_allowed() {
        table::insert(fd, Arc::new(Sock::new(domain)));
    }
    fd
}

#[no_mangle]
pub unsafe extern "C" fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let r = (real().bind)(fd, addr, len);
    if r == 0 && !is_inside() {
        if let Some(s) = table::get(fd) {
            if let Kind::Fresh { bound } = &mut *s.kind() {
                *bound = read_addr(addr, len);
            }
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let sock = if is_inside() { None } else { table::get(fd) };
    let (Some(sock), Some(peer)) = (sock, read_addr(addr, len)) else {
        return (real().connect)(fd, addr, len);
    };
    let bound = match &*sock.kind() {
        Kind::Fresh { bound } => *bound,
        _ => return (real().connect)(fd, addr, len),
    };
    let g = global();
    let decision = g.policy.decide(Role::Connect, &g.program, peer);
    let tcp = |why: &str| {
        tracing::debug!(fd, %peer, why, "connect over TCP");
        table::remove(fd);
        (real().connect)(fd, addr, len)
    };
    if decision == Use::Tcp || peer.ip().is_unspecified() {
        return tcp("policy");
    }
    if decision == Use::Both && g.known_without_sdp(peer) {
        COUNTERS.skipped_known_tcp.fetch_add(1, Ordering::Relaxed);
        return tcp("the peer had no SDP a moment ago");
    }
    let attempt = inside(|| connect_sdp(fd, &sock, bound, peer));
    match attempt {
        Ok(()) => {
            COUNTERS.connected_sdp.fetch_add(1, Ordering::Relaxed);
            0
        }
        Err(e) if decision == Use::Sdp => {
            COUNTERS.refused_sdp_only.fetch_add(1, Ordering::Relaxed);
            tracing::info!(fd, %peer, error = %e, "SDP connect failed (policy: SDP only)");
            fail(&io::Error::from(io::ErrorKind::ConnectionRefused))
        }
        Err(e) => {
            COUNTERS.fallback_tcp.fetch_add(1, Ordering::Relaxed);
            g.remember_without_sdp(peer);
            tracing::info!(fd, %peer, error = %e, "no SDP at the peer: TCP");
            tcp("fallback")
        }
    }
}

/// Connect `fd` over SDP and put the SDP socket's face in its place.
fn connect_sdp(
    fd: c_int,
    sock: &Arc<Sock>,
    bound: Option<SocketAddr>,
    peer: SocketAddr,
) -> io::Result<()> {
    let g = global();
    let dev = krdma_sdp::device::Device::get(None, &g.opts.device)
        .map_err(|e| io::Error::other(e.to_string()))?;
    // The socket's local port is the kernel socket's: bind it now if the program did not.
    let local = match bound {
        Some(b) if b.port() != 0 => b,
        _ => {
            let ip = krdma_sdp::conn::local_ip_for(&dev, peer.ip());
            let mut a: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
            let mut alen = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
            // SAFETY: writing a socket address into our own storage, then binding with it.
            unsafe {
                write_addr(
                    SocketAddr::new(ip, 0),
                    sock.family,
                    &mut a as *mut _ as *mut sockaddr,
                    &mut alen,
                );
                if (real().bind)(fd, &a as *const _ as *const sockaddr, alen) != 0 {
                    return Err(io::Error::last_os_error());
                }
                let mut alen = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
                (real().getsockname)(fd, &mut a as *mut _ as *mut sockaddr, &mut alen);
                let got = read_addr(&a as *const _ as *const sockaddr, alen)
                    .ok_or_else(|| io::Error::other("no local address"))?;
                *sock.kind() = Kind::Fresh { bound: Some(got) };
                got
            }
        }
    };
    let mut opts = g.opts.clone();
    opts.connect_timeout = g.policy.connect_timeout;
    let (conn, new_face) = Conn::connect(&opts, local, peer)?;
    install_face(fd, sock, conn, new_face)
}

/// Put `new_face` at descriptor `fd` (replacing the kernel TCP socket, whose port stays
/// held by a duplicate), keeping the program's descriptor flags and socket timeouts.
fn install_face(fd: c_int, sock: &Arc<Sock>, conn: Arc<Conn>, new_face: OwnedFd) -> io::Result<()> {
    let r = real();
    // SAFETY: descriptor calls on descriptors we own or the program passed us.
    unsafe {
        let fl = (r.fcntl)(fd, libc::F_GETFL, 0);
        let fdfl = (r.fcntl)(fd, libc::F_GETFD, 0);
        let guard = (r.fcntl)(fd, libc::F_DUPFD_CLOEXEC, 0);
        if guard < 0 {
            return Err(io::Error::last_os_error());
        }
        let guard = OwnedFd::from_raw_fd(guard);
        for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
            let mut tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            };
            let mut len = std::mem::size_of::<libc::timeval>() as socklen_t;
            if (r.getsockopt)(
                fd,
                libc::SOL_SOCKET,
                opt,
                &mut tv as *mut _ as *mut c_void,
                &mut len,
            ) == 0
            {
                (r.setsockopt)(
                    std::os::fd::AsRawFd::as_raw_fd(&new_face),
                    libc::SOL_SOCKET,
                    opt,
                    &tv as *const _ as *const c_void,
                    len,
                );
            }
        }
        let raw = new_face.into_raw_fd();
        let cloexec = if fdfl >= 0 && fdfl & libc::FD_CLOEXEC != 0 {
            libc::O_CLOEXEC
        } else {
            0
        };
        if (r.dup3)(raw, fd, cloexec) < 0 {
            let e = io::Error::last_os_error();
            (r.close)(raw);
            return Err(e);
        }
        (r.close)(raw);
        if fl >= 0 {
            (r.fcntl)(fd, libc::F_SETFL, (fl & libc::O_NONBLOCK) as libc::c_ulong);
        }
        conn.keep_until_face_closed();
        *sock.kind() = Kind::Stream(Arc::new(Stream::new(conn, Some(guard))));
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let r = (real().listen)(fd, backlog);
    if r != 0 || is_inside() {
        return r;
    }
    let Some(sock) = table::get(fd) else { return r };
    let mut kind = sock.kind();
    if !matches!(&*kind, Kind::Fresh { .. }) {
        return r;
    }
    // Where the kernel listener is (the program may have bound port 0).
    let mut a: libc::sockaddr_storage = std::mem::zeroed();
    let mut alen = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    (real().getsockname)(fd, &mut a as *mut _ as *mut sockaddr, &mut alen);
    let Some(at) = read_addr(&a as *const _ as *const sockaddr, alen) else {
        drop(kind);
        table::remove(fd);
        return r;
    };
    let g = global();
    let decision = g.policy.decide(Role::Listen, &g.program, at);
    if decision == Use::Tcp {
        drop(kind);
        table::remove(fd);
        return r;
    }
    match inside(|| Listening::start(fd, at, decision)) {
        Ok(l) => *kind = Kind::Listener(l),
        Err(e) => {
            COUNTERS.listen_sdp_failed.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%at, error = %e, "no SDP listener: TCP only");
            drop(kind);
            table::remove(fd);
        }
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    accept4(fd, addr, len, 0)
}

#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let sock = if is_inside() { None } else { table::get(fd) };
    let (l, family) = match sock.as_ref().map(|s| (s, s.kind())) {
        Some((s, k)) => match &*k {
            Kind::Listener(l) => (l.clone(), s.family),
            Kind::Shared(sl) => {
                // A fork child accepting on its parent's listener: the SDP connections
                // come as bridges the parent relays.
                sl.accepting();
                let family = s.family;
                drop(k);
                let (nfd, st, slen) = real_accept(fd, flags);
                if nfd >= 0 && !adopt_bridge(nfd, family, &st, slen, addr, len) {
                    copy_addr(&st, slen, addr, len);
                }
                return nfd;
            }
            _ => return (real().accept4)(fd, addr, len, flags),
        },
        None => {
            let n = (real().accept4)(fd, addr, len, flags);
            return if is_inside() { relocate(n) } else { n };
        }
    };
    loop {
        match l.take_ready() {
            Some(table::Accepted::Sdp(conn, new_face)) => {
                let peer = conn.peer;
                conn.keep_until_face_closed();
                // The face was made by the progress thread, high up: the program gets the
                // lowest free descriptor, as from accept.
                let high = new_face.into_raw_fd();
                let cmd = if flags & libc::SOCK_CLOEXEC != 0 {
                    libc::F_DUPFD_CLOEXEC
                } else {
                    libc::F_DUPFD
                };
                let nfd = (real().fcntl)(high, cmd, 0);
                (real().close)(high);
                if nfd < 0 {
                    return -1;
                }
                if flags & libc::SOCK_NONBLOCK != 0 {
                    (real().fcntl)(nfd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong);
                }
                let sock = Arc::new(Sock::new(family));
                *sock.kind() = Kind::Stream(Arc::new(Stream::new(conn, None)));
                table::insert(nfd, sock);
                write_addr(peer, family, addr, len);
                COUNTERS.accepted_sdp.fetch_add(1, Ordering::Relaxed);
                return nfd;
            }
            Some(table::Accepted::Tcp(own, st, slen)) => {
                let high = own.into_raw_fd();
                let cmd = if flags & libc::SOCK_CLOEXEC != 0 {
                    libc::F_DUPFD_CLOEXEC
                } else {
                    libc::F_DUPFD
                };
                let nfd = (real().fcntl)(high, cmd, 0);
                (real().close)(high);
                if nfd < 0 {
                    return -1;
                }
                if flags & libc::SOCK_NONBLOCK != 0 {
                    (real().fcntl)(nfd, libc::F_SETFL, libc::O_NONBLOCK as libc::c_ulong);
                }
                return tcp_accepted(&l, family, nfd, &st, slen, addr, len);
            }
            None => {}
        }
        let (nfd, st, slen) = real_accept(fd, flags);
        if nfd < 0 {
            return nfd;
        }
        if l.is_doorbell(&st, slen) {
            (real().close)(nfd);
            continue;
        }
        let r = tcp_accepted(&l, family, nfd, &st, slen, addr, len);
        if r >= 0 {
            return r;
        }
    }
}

/// The kernel's `accept4` on `fd`, with the peer's address kept here: the descriptor
/// (or -1), the address and its length.
pub(crate) unsafe fn real_accept(
    fd: c_int,
    flags: c_int,
) -> (c_int, libc::sockaddr_storage, socklen_t) {
    let mut st: libc::sockaddr_storage = std::mem::zeroed();
    let mut slen = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    let nfd = (real().accept4)(fd, &mut st as *mut _ as *mut sockaddr, &mut slen, flags);
    (nfd, st, slen)
}

/// A kernel TCP connection accepted on an offloaded listener: the program's, unless the
/// policy says SDP only (then it is closed, counted, and -1 returned to look further).
unsafe fn tcp_accepted(
    l: &Listening,
    family: c_int,
    nfd: c_int,
    st: &libc::sockaddr_storage,
    slen: socklen_t,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> c_int {
    if adopt_bridge(nfd, family, st, slen, addr, len) {
        return nfd;
    }
    if l.sdp_only() {
        COUNTERS
            .refused_tcp_on_sdp_listener
            .fetch_add(1, Ordering::Relaxed);
        (real().close)(nfd);
        return -1;
    }
    COUNTERS.accepted_tcp.fetch_add(1, Ordering::Relaxed);
    copy_addr(st, slen, addr, len);
    nfd
}

/// Copy an address `accept` gave into the program's buffer.
unsafe fn copy_addr(
    st: &libc::sockaddr_storage,
    slen: socklen_t,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) {
    if !addr.is_null() && !len.is_null() {
        let room = (*len as usize).min(slen as usize);
        std::ptr::copy_nonoverlapping(st as *const _ as *const u8, addr as *mut u8, room);
        *len = slen;
    }
}

/// If the connection `accept` gave (`nfd`, from `st`) is a bridge of a shared listener
/// (`bridges`), make it a relayed SDP socket with the SDP connection's addresses, which
/// go to the program's buffer. Returns whether it was one.
unsafe fn adopt_bridge(
    nfd: c_int,
    family: c_int,
    st: &libc::sockaddr_storage,
    slen: socklen_t,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> bool {
    let Some(from) = read_addr(st as *const _ as *const sockaddr, slen) else {
        return false;
    };
    if !from.ip().to_canonical().is_loopback() {
        return false;
    }
    let Some((local, peer)) = bridges::take(from.port()) else {
        return false;
    };
    let sock = Arc::new(Sock::new(family));
    *sock.kind() = Kind::Relayed(Arc::new(Relayed::bridged(local, peer)));
    table::insert(nfd, sock);
    write_addr(peer, family, addr, len);
    COUNTERS.accepted_sdp.fetch_add(1, Ordering::Relaxed);
    true
}

// ---------------------------------------------------------------------------------------
// Data.

/// The stream behind `fd`, if it is an SDP socket of this process whose bytes the library
/// moves (a relayed one is the kernel's to serve). An inherited SDP socket that is not
/// relayed (its connection lives in the parent) fails with `ENOTSUP`.
fn stream(fd: c_int) -> Option<Result<Arc<Stream>, ()>> {
    if is_inside() {
        return None;
    }
    let s = table::get(fd)?;
    let k = s.kind();
    match &*k {
        Kind::Stream(st) => Some(Ok(st.clone())),
        Kind::Foreign => Some(Err(())),
        _ => None,
    }
}

/// `recv` on the face itself.
fn real_recv(fd: c_int, buf: &mut [u8], flags: c_int) -> ssize_t {
    // SAFETY: recv into a buffer of the given length.
    unsafe {
        (real().recvfrom)(
            fd,
            buf.as_mut_ptr() as *mut c_void,
            buf.len(),
            flags,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    }
}

/// `send` on the face itself.
fn real_send(fd: c_int, buf: &[u8], flags: c_int) -> ssize_t {
    // SAFETY: send from a buffer of the given length.
    unsafe {
        (real().sendto)(
            fd,
            buf.as_ptr() as *const c_void,
            buf.len(),
            flags,
            std::ptr::null(),
            0,
        )
    }
}

fn foreign<T: From<i8>>() -> T {
    set_errno(libc::ENOTSUP);
    T::from(-1)
}

/// Read from an SDP stream as `recv(fd, buf, len, flags)` would.
fn sdp_recv(fd: c_int, s: &Stream, buf: &mut [u8], flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 {
        return match s.conn.recv_oob() {
            Some(b) if !buf.is_empty() => {
                buf[0] = b;
                1
            }
            _ => fail(&io::Error::from_raw_os_error(libc::EINVAL)),
        };
    }
    if s.read_shut.load(Ordering::Relaxed) {
        return 0;
    }
    let block = flags & libc::MSG_DONTWAIT == 0 && !nonblocking(fd);
    let dl = deadline(fd, libc::SO_RCVTIMEO);
    if flags & libc::MSG_PEEK != 0 {
        return match inside(|| s.conn.peek(face(fd), buf, block, dl)) {
            Ok(n) => n as ssize_t,
            Err(e) if is_relayed(&e) => real_recv(fd, buf, flags),
            Err(e) => fail(&e),
        };
    }
    let mut got = 0;
    loop {
        match inside(|| s.conn.read(face(fd), &mut buf[got..], block, dl)) {
            // Relayed since this call began (another thread forked): the face has the rest.
            Err(e) if is_relayed(&e) && got == 0 => return real_recv(fd, buf, flags),
            Ok(0) => return got as ssize_t,
            Ok(n) => {
                got += n;
                if flags & libc::MSG_WAITALL == 0 || got == buf.len() {
                    return got as ssize_t;
                }
            }
            Err(_) if got > 0 => return got as ssize_t,
            Err(e) => return fail(&e),
        }
    }
}

/// Write to an SDP stream as `send(fd, buf, len, flags)` would: a blocking socket takes
/// everything (or fails), a non-blocking one what fits.
fn sdp_send(fd: c_int, s: &Stream, buf: &[u8], flags: c_int) -> ssize_t {
    if flags & libc::MSG_OOB != 0 && !buf.is_empty() {
        let n = sdp_send(fd, s, &buf[..buf.len() - 1], flags & !libc::MSG_OOB);
        if n < 0 {
            return n;
        }
        return match inside(|| s.conn.send_oob(buf[buf.len() - 1])) {
            Ok(()) => n + 1,
            Err(e) => fail(&e),
        };
    }
    let block = flags & libc::MSG_DONTWAIT == 0 && !nonblocking(fd);
    let dl = deadline(fd, libc::SO_SNDTIMEO);
    let mut sent = 0;
    while sent < buf.len() {
        match inside(|| s.conn.write(face(fd), &buf[sent..], block, dl)) {
            Ok(n) => {
                sent += n;
                if !block {
                    break;
                }
            }
            Err(e) if is_relayed(&e) && sent == 0 => return real_send(fd, buf, flags),
            Err(_) if sent > 0 => break,
            Err(e) => {
                tracing::debug!(fd, error = %e, "SDP send failed");
                // Another thread closed the descriptor under this send: as with TCP, the
                // next call sees a bad descriptor, not a broken pipe.
                let same = matches!(stream(fd), Some(Ok(t)) if std::ptr::eq(&*t, s));
                if !same {
                    set_errno(libc::EBADF);
                    return -1;
                }
                if e.kind() == io::ErrorKind::BrokenPipe && flags & libc::MSG_NOSIGNAL == 0 {
                    // SAFETY: raising a signal in this thread, as the kernel would.
                    unsafe { libc::raise(libc::SIGPIPE) };
                }
                return fail(&e);
            }
        }
    }
    sent as ssize_t
}

/// # Safety
/// `iov` points to `n` iovecs (or `n` is 0).
unsafe fn iovecs<'a>(iov: *const libc::iovec, n: c_int) -> &'a [libc::iovec] {
    if iov.is_null() || n <= 0 {
        &[]
    } else {
        std::slice::from_raw_parts(iov, n as usize)
    }
}

/// Read into an iovec list (through one buffer).
unsafe fn sdp_recv_iov(fd: c_int, s: &Stream, iov: &[libc::iovec], flags: c_int) -> ssize_t {
    let total: usize = iov.iter().map(|v| v.iov_len).sum();
    let mut tmp = vec![0u8; total];
    let n = sdp_recv(fd, s, &mut tmp, flags);
    if n > 0 {
        let mut off = 0;
        for v in iov {
            let k = v.iov_len.min(n as usize - off);
            std::ptr::copy_nonoverlapping(tmp.as_ptr().add(off), v.iov_base as *mut u8, k);
            off += k;
            if off == n as usize {
                break;
            }
        }
    }
    n
}

/// Write an iovec list (gathered into one buffer).
unsafe fn sdp_send_iov(fd: c_int, s: &Stream, iov: &[libc::iovec], flags: c_int) -> ssize_t {
    let mut tmp = Vec::with_capacity(iov.iter().map(|v| v.iov_len).sum());
    for v in iov {
        if v.iov_len > 0 {
            tmp.extend_from_slice(std::slice::from_raw_parts(
                v.iov_base as *const u8,
                v.iov_len,
            ));
        }
    }
    sdp_send(fd, s, &tmp, flags)
}

unsafe fn buf_mut<'a>(p: *mut c_void, n: size_t) -> &'a mut [u8] {
    if p.is_null() || n == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(p as *mut u8, n)
    }
}

unsafe fn buf<'a>(p: *const c_void, n: size_t) -> &'a [u8] {
    if p.is_null() || n == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(p as *const u8, n)
    }
}

#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, b: *mut c_void, n: size_t) -> ssize_t {
    match stream(fd) {
        None => (real().read)(fd, b, n),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => sdp_recv(fd, &s, buf_mut(b, n), 0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    _buflen: size_t,
) -> ssize_t {
    read(fd, b, n)
}

#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, b: *const c_void, n: size_t) -> ssize_t {
    match stream(fd) {
        None => (real().write)(fd, b, n),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => sdp_send(fd, &s, buf(b, n), 0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    match stream(fd) {
        None => (real().readv)(fd, iov, n),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => sdp_recv_iov(fd, &s, iovecs(iov, n), 0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const libc::iovec, n: c_int) -> ssize_t {
    match stream(fd) {
        None => (real().writev)(fd, iov, n),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => sdp_send_iov(fd, &s, iovecs(iov, n), 0),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recv(fd: c_int, b: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    recvfrom(fd, b, n, flags, std::ptr::null_mut(), std::ptr::null_mut())
}

#[no_mangle]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    _buflen: size_t,
    flags: c_int,
) -> ssize_t {
    recv(fd, b, n, flags)
}

#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    match stream(fd) {
        None => (real().recvfrom)(fd, b, n, flags, addr, len),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => {
            let r = sdp_recv(fd, &s, buf_mut(b, n), flags);
            if r >= 0 && !len.is_null() {
                *len = 0;
            }
            r
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    b: *mut c_void,
    n: size_t,
    _buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
) -> ssize_t {
    recvfrom(fd, b, n, flags, addr, len)
}

#[no_mangle]
pub unsafe extern "C" fn send(fd: c_int, b: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    match stream(fd) {
        None => (real().sendto)(fd, b, n, flags, std::ptr::null(), 0),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => sdp_send(fd, &s, buf(b, n), flags),
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    b: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    match stream(fd) {
        None => (real().sendto)(fd, b, n, flags, addr, alen),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => sdp_send(fd, &s, buf(b, n), flags),
    }
}

#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut libc::msghdr, flags: c_int) -> ssize_t {
    match stream(fd) {
        None => (real().recvmsg)(fd, msg, flags),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => {
            let m = &mut *msg;
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            sdp_recv_iov(fd, &s, iovecs(m.msg_iov, m.msg_iovlen as c_int), flags)
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    match stream(fd) {
        None => (real().sendmsg)(fd, msg, flags),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => {
            let m = &*msg;
            sdp_send_iov(fd, &s, iovecs(m.msg_iov, m.msg_iovlen as c_int), flags)
        }
    }
}

/// `sendfile` to an SDP socket: the file's bytes are read and written (the kernel cannot
/// splice into RDMA buffers).
#[no_mangle]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    let s = match stream(out) {
        None => return (real().sendfile)(out, in_fd, offset, count),
        Some(Err(())) => return foreign(),
        Some(Ok(s)) => s,
    };
    let mut chunk = vec![0u8; count.min(256 * 1024)];
    let mut done = 0usize;
    while done < count {
        let want = chunk.len().min(count - done);
        let n = if offset.is_null() {
            (real().read)(in_fd, chunk.as_mut_ptr() as *mut c_void, want)
        } else {
            libc::pread(in_fd, chunk.as_mut_ptr() as *mut c_void, want, *offset)
        };
        if n <= 0 {
            if n < 0 && done == 0 {
                return -1;
            }
            break;
        }
        let w = sdp_send(out, &s, &chunk[..n as usize], libc::MSG_NOSIGNAL);
        if w < 0 {
            return if done > 0 { done as ssize_t } else { w };
        }
        done += w as usize;
        if !offset.is_null() {
            *offset += w as libc::off_t;
        }
        if (w as usize) < n as usize {
            // A non-blocking socket took part: give back what was not sent.
            if offset.is_null() {
                libc::lseek(in_fd, w as libc::off_t - n as libc::off_t, libc::SEEK_CUR);
            }
            break;
        }
    }
    done as ssize_t
}

#[no_mangle]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    sendfile(out, in_fd, offset, count)
}

// ---------------------------------------------------------------------------------------
// Descriptors: close, dup, fcntl, ioctl, shutdown, names and options.

#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if !is_inside() {
        table::remove(fd);
    }
    (real().close)(fd)
}

#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let n = (real().dup)(fd);
    if is_inside() {
        return relocate(n);
    }
    if n >= 0 {
        table::dup(fd, n);
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, to: c_int) -> c_int {
    if fd == to {
        return (real().dup2)(fd, to);
    }
    let n = (real().dup2)(fd, to);
    if n >= 0 && !is_inside() {
        table::remove(to);
        table::dup(fd, n);
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, to: c_int, flags: c_int) -> c_int {
    let n = (real().dup3)(fd, to, flags);
    if n >= 0 && !is_inside() {
        table::remove(to);
        table::dup(fd, n);
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    let dup = cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC;
    if dup && is_inside() {
        return relocate((real().fcntl)(fd, cmd, arg));
    }
    let n = (real().fcntl)(fd, cmd, arg);
    if n >= 0 && (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && !is_inside() {
        table::dup(fd, n);
    }
    n
}

#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: libc::c_ulong) -> c_int {
    fcntl(fd, cmd, arg)
}

#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: libc::c_ulong, arg: libc::c_ulong) -> c_int {
    if req == libc::FIONREAD as libc::c_ulong {
        if let Some(Ok(s)) = stream(fd) {
            let n = inside(|| s.conn.readable_bytes());
            *(arg as *mut c_int) = n.min(c_int::MAX as usize) as c_int;
            return 0;
        }
    }
    (real().ioctl)(fd, req, arg)
}

#[no_mangle]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    match stream(fd) {
        None => (real().shutdown)(fd, how),
        Some(Err(())) => foreign(),
        Some(Ok(s)) => {
            if how == libc::SHUT_RD || how == libc::SHUT_RDWR {
                s.read_shut.store(true, Ordering::Relaxed);
            }
            if how == libc::SHUT_WR || how == libc::SHUT_RDWR {
                inside(|| s.conn.shutdown_write());
            }
            0
        }
    }
}

/// The SDP socket's local and peer addresses and family, if `fd` is one.
fn sdp_names(fd: c_int) -> Option<(SocketAddr, SocketAddr, c_int)> {
    let sock = if is_inside() { None } else { table::get(fd) }?;
    let names = match &*sock.kind() {
        Kind::Stream(st) => (st.conn.local, st.conn.peer),
        Kind::Relayed(r) => (r.local, r.peer),
        _ => return None,
    };
    Some((names.0, names.1, sock.family))
}

#[no_mangle]
pub unsafe extern "C" fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    match sdp_names(fd) {
        Some((local, _, family)) => {
            write_addr(local, family, addr, len);
            0
        }
        None => (real().getsockname)(fd, addr, len),
    }
}

#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    match sdp_names(fd) {
        Some((_, peer, family)) => {
            write_addr(peer, family, addr, len);
            0
        }
        None => (real().getpeername)(fd, addr, len),
    }
}

unsafe fn put_int(val: *mut c_void, len: *mut socklen_t, v: c_int) {
    if !val.is_null() && !len.is_null() && *len as usize >= std::mem::size_of::<c_int>() {
        *(val as *mut c_int) = v;
        *len = std::mem::size_of::<c_int>() as socklen_t;
    }
}

#[no_mangle]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let s = if is_inside() { None } else { table::get(fd) };
    let Some(sock) = s else {
        return (real().getsockopt)(fd, level, opt, val, len);
    };
    let st = match &*sock.kind() {
        Kind::Stream(st) => st.clone(),
        Kind::Relayed(r) => return relayed_getsockopt(fd, sock.family, r, level, opt, val, len),
        _ => return (real().getsockopt)(fd, level, opt, val, len),
    };
    match (level, opt) {
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO) => {
            (real().getsockopt)(fd, level, opt, val, len)
        }
        (libc::SOL_SOCKET, libc::SO_ERROR) => {
            let e = st
                .conn
                .lock()
                .proto
                .error()
                .map(|e| io_error(e).raw_os_error().unwrap_or(libc::ECONNRESET))
                .unwrap_or(0);
            let e = if e == 0 { 0 } else { libc::ECONNRESET };
            put_int(val, len, e);
            0
        }
        (libc::SOL_SOCKET, libc::SO_TYPE) => {
            put_int(val, len, libc::SOCK_STREAM);
            0
        }
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => {
            put_int(val, len, sock.family);
            0
        }
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => {
            put_int(val, len, libc::IPPROTO_TCP);
            0
        }
        (libc::SOL_SOCKET, libc::SO_ACCEPTCONN) => {
            put_int(val, len, 0);
            0
        }
        (libc::SOL_SOCKET, libc::SO_SNDBUF) => {
            put_int(val, len, st.conn.lock().proto.config().send_buffer as c_int);
            0
        }
        (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => {
            // The largest message payload the peer takes.
            put_int(
                val,
                len,
                st.conn.lock().proto.peer_recv_size().saturating_sub(16) as c_int,
            );
            0
        }
        (libc::SOL_SOCKET, libc::SO_RCVBUF) => {
            let c = *st.conn.lock().proto.config();
            put_int(val, len, (c.recv_bufs as u32 * c.recv_size) as c_int);
            0
        }
        _ => {
            // Other options read back what was set (or 0).
            put_int(val, len, remembered(&st.options, level, opt));
            0
        }
    }
}

/// An option SDP has no use for, as it was set (0 if never).
fn remembered(
    options: &std::sync::Mutex<std::collections::HashMap<(c_int, c_int), c_int>>,
    level: c_int,
    opt: c_int,
) -> c_int {
    options
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&(level, opt))
        .copied()
        .unwrap_or(0)
}

/// `getsockopt` on a relayed socket: socket-level options are the face's (an `AF_UNIX`
/// stream answers them as a TCP socket would), except the family and protocol; the
/// others read back what was set.
unsafe fn relayed_getsockopt(
    fd: c_int,
    family: c_int,
    r: &Relayed,
    level: c_int,
    opt: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    match (level, opt) {
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => put_int(val, len, family),
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => put_int(val, len, libc::IPPROTO_TCP),
        (libc::SOL_SOCKET, _) => return (real().getsockopt)(fd, level, opt, val, len),
        _ => put_int(val, len, remembered(&r.options, level, opt)),
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    opt: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let s = if is_inside() { None } else { table::get(fd) };
    let Some(sock) = s else {
        return (real().setsockopt)(fd, level, opt, val, len);
    };
    let st = match &*sock.kind() {
        Kind::Stream(st) => st.clone(),
        Kind::Relayed(r) if level != libc::SOL_SOCKET => {
            let int = if !val.is_null() && len as usize >= std::mem::size_of::<c_int>() {
                *(val as *const c_int)
            } else {
                0
            };
            r.options
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert((level, opt), int);
            return 0;
        }
        _ => return (real().setsockopt)(fd, level, opt, val, len),
    };
    let int = if !val.is_null() && len as usize >= std::mem::size_of::<c_int>() {
        *(val as *const c_int)
    } else {
        0
    };
    match (level, opt) {
        (libc::SOL_SOCKET, libc::SO_RCVTIMEO | libc::SO_SNDTIMEO) => {
            return (real().setsockopt)(fd, level, opt, val, len)
        }
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => {
            let idle = (int != 0).then(|| Duration::from_secs(7200));
            st.conn.lock().proto.set_keepalive(idle);
        }
        (libc::SOL_SOCKET, libc::SO_LINGER)
            if len as usize >= std::mem::size_of::<libc::linger>() =>
        {
            let l = &*(val as *const libc::linger);
            st.linger_zero
                .store(l.l_onoff != 0 && l.l_linger == 0, Ordering::Relaxed);
        }
        _ => {}
    }
    st.options
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((level, opt), int);
    0
}
