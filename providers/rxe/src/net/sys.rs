//! The socket calls under `net`, and every `unsafe` block of rxe's I/O: sockets opened
//! and bound, socket options, BPF filters, `sendmsg`/`sendmmsg`/`recvmmsg` with control
//! messages, and the libc address structures. `net` builds headers and ICRCs on top of
//! these and holds no `unsafe` itself.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

pub(super) fn setsockopt<T>(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    v: &T,
) -> io::Result<()> {
    // SAFETY: `v` points to a live value of the size passed.
    check(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            v as *const T as *const libc::c_void,
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// A new socket of `domain`, `kind` (close-on-exec) and `proto`.
fn socket(domain: libc::c_int, kind: libc::c_int, proto: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before it is owned.
    let fd = check(unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, proto) })?;
    // SAFETY: `fd` is a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Bind `fd` to `addr`.
fn bind<A: SockAddr>(fd: RawFd, addr: &A) -> io::Result<()> {
    // SAFETY: addr is a valid socket address (`SockAddr`) of the size passed.
    check(unsafe {
        libc::bind(
            fd,
            addr as *const A as *const libc::sockaddr,
            std::mem::size_of::<A>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// Attach a classic BPF program to a socket.
pub(super) fn attach_filter(fd: RawFd, prog: &[libc::sock_filter]) -> io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fprog)
}

pub(super) const fn bpf(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// For an `IPPROTO_UDP` raw socket (data starts at the IP header): keep datagrams to
/// UDP destination `port` (and to IPv4 destination `dst`, for a device bound to one
/// address, so instances on other addresses do not each get a copy), drop the rest.
pub(super) fn udp_port_filter(port: u16, dst: Option<Ipv4Addr>) -> Vec<libc::sock_filter> {
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const LDX_MSH: u16 = (libc::BPF_LDX | libc::BPF_B | libc::BPF_MSH) as u16;
    const LDH_IND: u16 = (libc::BPF_LD | libc::BPF_H | libc::BPF_IND) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let mut prog = Vec::new();
    if let Some(d) = dst {
        prog.push(bpf(LD_W_ABS, 0, 0, 16)); // A = IPv4 destination
        prog.push(bpf(JEQ, 0, 4, u32::from(d))); // else drop
    }
    prog.extend([
        bpf(LDX_MSH, 0, 0, 0), // X = IP header length
        bpf(LDH_IND, 0, 0, 2), // A = UDP destination port
        bpf(JEQ, 0, 1, port as u32),
        bpf(RET, 0, 0, 0xffff),
        bpf(RET, 0, 0, 0),
    ]);
    prog
}

/// A UDP socket on `sa` bound as rxe binds its own. `SO_REUSEPORT` lets instances of one
/// user bound to distinct addresses (127.0.0.x in tests) share the port with one bound to
/// the wildcard; unlike `SO_REUSEADDR`, which for UDP checks no user, it keeps any other
/// user's process from binding the device's address and port beside it and taking its
/// datagrams. Public for peers beside an rxe device (test and fuzz rigs).
pub fn bind_udp(sa: SocketAddrV4) -> io::Result<UdpSocket> {
    let sock = socket(libc::AF_INET, libc::SOCK_DGRAM, 0)?;
    let fd = sock.as_raw_fd();
    let on: libc::c_int = 1;
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEPORT, &on)?;
    bind(fd, &sockaddr_in(sa))?;
    Ok(UdpSocket::from(sock))
}

/// The IPv6 socket of a wildcard device: `[::]:port`, IPv6 only, with the destination of
/// each datagram reported.
pub(super) fn open_udp6(port: u16) -> io::Result<UdpSocket> {
    let owned = socket(libc::AF_INET6, libc::SOCK_DGRAM, 0)?;
    let fd = owned.as_raw_fd();
    let on: libc::c_int = 1;
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEPORT, &on)?; // as `bind_udp`
    setsockopt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &on)?;
    setsockopt(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, &on)?;
    bind(
        fd,
        &sockaddr_in6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0)),
    )?;
    grow_buffers(fd);
    let sock = UdpSocket::from(owned);
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    Ok(sock)
}

/// The inode of the socket (or file) `fd` names.
pub(super) fn inode(fd: RawFd) -> io::Result<u64> {
    // SAFETY: `stat` is plain data, for which all-zero is a valid value; fstat writes
    // at most one `stat` into it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; an invalid `fd` is reported as an error.
    check(unsafe { libc::fstat(fd, &mut st) })?;
    Ok(st.st_ino)
}

pub(super) fn grow_buffers(fd: RawFd) {
    let size: libc::c_int = 16 << 20;
    // Root may exceed rmem_max/wmem_max with the FORCE variants; others get the cap.
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if setsockopt(fd, libc::SOL_SOCKET, force, &size).is_err() {
            let _ = setsockopt(fd, libc::SOL_SOCKET, plain, &size);
        }
    }
}

/// The raw `IPPROTO_UDP` socket a device with `CAP_NET_RAW` receives and sends through:
/// it sees every UDP datagram of the host's stack that passes its filter (port `port`, to
/// `dst` if given), headers and all; what it sends, the kernel puts in an IP header of
/// its own (identification 0: the socket sends don't-fragment datagrams and is never
/// connected, as Linux does for such datagrams), while the UDP header is the sender's.
/// Not `IP_HDRINCL`: Linux routes every datagram of a header-including socket anew,
/// with a route it frees through RCU afterwards, which on loopback kept the softirq
/// thread busy (docs/benchmarks.md).
pub(super) fn open_raw(port: u16, dst: Option<Ipv4Addr>) -> Option<OwnedFd> {
    let raw = socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_UDP).ok()?;
    let fd = raw.as_raw_fd();
    attach_filter(fd, &udp_port_filter(port, dst)).ok()?;
    discard_queued(fd);
    let pmtu: libc::c_int = libc::IP_PMTUDISC_DO;
    setsockopt(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, &pmtu).ok()?;
    grow_buffers(fd);
    Some(raw)
}

/// Read and drop what `fd` queued before its filter was attached (a raw socket takes
/// every UDP datagram of the host until then). Bounded: traffic that passes the filter
/// is for a device with no QP yet, which would drop it anyway.
fn discard_queued(fd: RawFd) {
    use nix::sys::socket::{recv, MsgFlags};
    let mut sink = [0u8; 64];
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    for _ in 0..4096 {
        if recv(fd, &mut sink, flags).is_err() {
            break;
        }
    }
}

fn timeout_or<T>(e: io::Error) -> io::Result<Option<T>> {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted => {
            Ok(None)
        }
        _ => Err(e),
    }
}

fn unsafe_zeroed<T: SockAddr>() -> T {
    // SAFETY: T is a libc socket address (the sealed `SockAddr`): plain data, for which
    // all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// The libc socket addresses: plain data, all-zero valid ([`unsafe_zeroed`]), and what
/// `bind`/`sendmsg`/`recvmsg` take as a name.
trait SockAddr {}
impl SockAddr for libc::sockaddr_in {}
impl SockAddr for libc::sockaddr_in6 {}
impl SockAddr for libc::sockaddr_storage {}

pub(super) fn sockaddr_in(sa: SocketAddrV4) -> libc::sockaddr_in {
    let mut s: libc::sockaddr_in = unsafe_zeroed();
    s.sin_family = libc::AF_INET as libc::sa_family_t;
    s.sin_port = sa.port().to_be();
    s.sin_addr.s_addr = u32::from(*sa.ip()).to_be();
    s
}

pub(super) fn sockaddr_in6(sa: SocketAddrV6) -> libc::sockaddr_in6 {
    let mut s: libc::sockaddr_in6 = unsafe_zeroed();
    s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    s.sin6_port = sa.port().to_be();
    s.sin6_addr.s6_addr = sa.ip().octets();
    s
}

/// Datagrams one [`recv_many`] call takes at most.
pub(super) const RECV_MANY: usize = 16;

/// What one slot of a [`recv_many`] call holds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Received {
    /// Bytes in the slot.
    pub len: usize,
    /// The datagram was longer than its slot (the rest is lost).
    pub truncated: bool,
    /// The sender (a UDP socket's peer; a raw socket's is in the IP header).
    pub from: Option<SocketAddr>,
    /// The destination address (IP_PKTINFO / IPV6_PKTINFO), where the socket reports it.
    pub dst: Option<IpAddr>,
}

/// Receive up to [`RECV_MANY`] datagrams with one `recvmmsg`, each into its own
/// `slot`-byte piece of `buf`, handing what each got to `got` in order: only what is
/// queued, never waiting (nothing queued is not an error). Everything the call needs is
/// on the stack: a consumer's poll makes it many times.
pub(super) fn recv_many(
    fd: RawFd,
    buf: &mut [u8],
    slot: usize,
    mut got: impl FnMut(Received),
) -> io::Result<()> {
    let mut names: [libc::sockaddr_storage; RECV_MANY] = [unsafe_zeroed(); RECV_MANY];
    let mut controls = [[0u64; 8]; RECV_MANY];
    // SAFETY: iovec and mmsghdr are plain data, for which all-zero is a valid value.
    let mut iovs: [libc::iovec; RECV_MANY] = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut hdrs: [libc::mmsghdr; RECV_MANY] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    for (piece, iov) in buf.chunks_exact_mut(slot.max(1)).zip(&mut iovs) {
        iov.iov_base = piece.as_mut_ptr() as *mut libc::c_void;
        iov.iov_len = piece.len();
        let h = &mut hdrs[n].msg_hdr;
        h.msg_name = &mut names[n] as *mut _ as *mut libc::c_void;
        h.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
        h.msg_iov = iov;
        h.msg_iovlen = 1;
        h.msg_control = controls[n].as_mut_ptr() as *mut libc::c_void;
        h.msg_controllen = std::mem::size_of_val(&controls[n]);
        n += 1;
    }
    if n == 0 {
        return Ok(());
    }
    // SAFETY: each of the first `n` headers points at its own name, control buffer and
    // iovec, and each iovec at a distinct `slot`-byte piece of `buf`; all of them outlive
    // the call, and the kernel writes only within the lengths they give.
    let r = unsafe {
        libc::recvmmsg(
            fd,
            hdrs.as_mut_ptr(),
            n as libc::c_uint,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    if r < 0 {
        return timeout_or(io::Error::last_os_error()).map(|_: Option<()>| ());
    }
    for (h, name) in hdrs.iter().zip(&names).take(r as usize) {
        got(Received {
            len: (h.msg_len as usize).min(slot),
            truncated: h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0,
            from: socket_addr(name),
            dst: pktinfo_dst(&h.msg_hdr),
        });
    }
    Ok(())
}

/// The address a receive call wrote into `name`, if it is an IPv4 or IPv6 one.
fn socket_addr(name: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match name.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in (its family says so) at the start of
            // the storage, which is larger and aligned for it.
            let a = unsafe { &*(name as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, a sockaddr_in6.
            let a = unsafe { &*(name as *const _ as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::from((ip, u16::from_be(a.sin6_port))))
        }
        _ => None,
    }
}

pub(super) fn io_slice(b: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: b.as_ptr() as *mut libc::c_void,
        iov_len: b.len(),
    }
}

/// One control message to send along.
pub(super) struct Cmsg<'a> {
    pub level: libc::c_int,
    pub kind: libc::c_int,
    pub data: &'a [u8],
}

/// The bytes of a plain-data C struct.
pub(super) fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a `Copy` libc struct (plain data, no padding the kernel would read as
    // meaningful); the slice covers exactly its bytes and lives as long as the borrow.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

pub(super) fn sendmsg(
    fd: RawFd,
    name: &[u8],
    iov: &[libc::iovec],
    cmsgs: &[Cmsg<'_>],
) -> io::Result<()> {
    let mut control = Control::default();
    // SAFETY: msghdr is plain data; every pointer set below outlives the call, and the
    // iovecs point at slices the caller keeps alive.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = name.as_ptr() as *mut libc::c_void;
    msg.msg_namelen = name.len() as u32;
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    put_cmsgs(&mut msg, &mut control, cmsgs)?;
    loop {
        // SAFETY: msg is fully initialised above.
        let r = unsafe { libc::sendmsg(fd, &msg, 0) };
        if r >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            // A full socket buffer: the packet is lost like on a wire; retransmission
            // recovers it. Never block the engine on it.
            Some(libc::ENOBUFS) | Some(libc::EAGAIN) => return Ok(()),
            _ => return Err(e),
        }
    }
}

/// Room for a message's control messages.
#[derive(Default, Clone, Copy)]
pub(super) struct Control([u64; 8]);

/// Write `cmsgs` into `control` and point `msg` at them (no control data when none).
fn put_cmsgs(msg: &mut libc::msghdr, control: &mut Control, cmsgs: &[Cmsg<'_>]) -> io::Result<()> {
    let space: usize = cmsgs.iter().map(|c| unsafe_cmsg_space(c.data.len())).sum();
    if space > std::mem::size_of_val(control) {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    if space == 0 {
        return Ok(());
    }
    msg.msg_control = control.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space;
    // SAFETY: the control buffer holds every cmsg header with its data (their spaces sum
    // to at most its size, checked above); CMSG_FIRSTHDR/CMSG_NXTHDR step through it by
    // the lengths written here and return null rather than point past it.
    unsafe {
        let mut h = libc::CMSG_FIRSTHDR(msg);
        for c in cmsgs {
            if h.is_null() {
                return Err(io::ErrorKind::InvalidInput.into());
            }
            (*h).cmsg_level = c.level;
            (*h).cmsg_type = c.kind;
            (*h).cmsg_len = libc::CMSG_LEN(c.data.len() as u32) as _;
            std::ptr::copy_nonoverlapping(c.data.as_ptr(), libc::CMSG_DATA(h), c.data.len());
            h = libc::CMSG_NXTHDR(msg, h);
        }
    }
    Ok(())
}

/// One message of a [`sendmmsg`]: its destination, its two pieces (UDP header, RoCEv2
/// packet) and its control messages (the source address).
pub(super) struct RawMsg<'a> {
    pub name: &'a [u8],
    pub iov: [libc::iovec; 2],
    pub cmsgs: [Cmsg<'a>; 1],
}

/// Send `msgs` in order with as few `sendmmsg` calls as the kernel takes. A message the
/// kernel refuses is skipped: a full buffer loses it as a wire would (retransmission
/// recovers it), any other error is logged. Returns how many were sent.
pub(super) fn sendmmsg(fd: RawFd, msgs: &[RawMsg<'_>]) -> usize {
    // Every header points into `controls`, which is never resized after this.
    let mut controls = vec![Control::default(); msgs.len()];
    let mut hdrs: Vec<libc::mmsghdr> = Vec::with_capacity(msgs.len());
    for (m, control) in msgs.iter().zip(controls.iter_mut()) {
        // SAFETY: mmsghdr is plain data, for which all-zero is a valid value.
        let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
        h.msg_hdr.msg_name = m.name.as_ptr() as *mut libc::c_void;
        h.msg_hdr.msg_namelen = m.name.len() as u32;
        h.msg_hdr.msg_iov = m.iov.as_ptr() as *mut libc::iovec;
        h.msg_hdr.msg_iovlen = m.iov.len();
        if let Err(e) = put_cmsgs(&mut h.msg_hdr, control, &m.cmsgs) {
            tracing::debug!(error = %e, "rxe: control message does not fit");
            continue;
        }
        hdrs.push(h);
    }
    let (mut done, mut sent) = (0, 0);
    while done < hdrs.len() {
        let left = &mut hdrs[done..];
        // SAFETY: each header points at a name and iovecs in `msgs` and at its control
        // data in `controls`, which all outlive the call, and those iovecs at buffers the
        // caller keeps alive; the kernel writes only the headers' `msg_len`.
        let r = unsafe { libc::sendmmsg(fd, left.as_mut_ptr(), left.len() as u32, 0) };
        if r > 0 {
            done += r as usize;
            sent += r as usize;
            continue;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ENOBUFS) | Some(libc::EAGAIN) => {}
            _ => tracing::debug!(error = %e, "rxe sendmmsg failed"),
        }
        done += 1; // this one is lost; go on with the rest
    }
    sent
}

fn unsafe_cmsg_space(len: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure arithmetic macro.
    unsafe { libc::CMSG_SPACE(len as u32) as usize }
}

fn pktinfo_dst(msg: &libc::msghdr) -> Option<IpAddr> {
    // SAFETY: the kernel filled msg's control buffer; CMSG_* walk it within its length.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            match ((*c).cmsg_level, (*c).cmsg_type) {
                (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                    let info =
                        std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::in_pktinfo);
                    return Some(Ipv4Addr::from(u32::from_be(info.ipi_addr.s_addr)).into());
                }
                (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                    let info =
                        std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::in6_pktinfo);
                    return Some(Ipv6Addr::from(info.ipi6_addr.s6_addr).into());
                }
                _ => {}
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_program_shape() {
        let f = udp_port_filter(4791, None);
        assert_eq!((f.len(), f[2].k, f[3].k), (5, 4791, 0xffff));
        let f = udp_port_filter(4791, Some(Ipv4Addr::new(127, 10, 0, 1)));
        assert_eq!((f.len(), f[1].k, f[1].jf as usize), (7, 0x7f0a_0001, 4));
        assert_eq!(
            f[1 + 1 + 4].k,
            0,
            "the false branch lands on the final drop"
        );
    }
}
