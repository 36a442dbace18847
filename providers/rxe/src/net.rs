//! The I/O layer under the rxe engine: RoCEv2 datagrams in and out of UDP port 4791.
//!
//! The ICRC covers most of the IPv4 header, including the identification field, so both
//! directions need to know the exact header:
//!
//! * **With `CAP_NET_RAW`** (the daemon, or a root process): packets are sent through an
//!   `IPPROTO_RAW` socket with a header we build (our own non-zero identification, the
//!   QP's UDP source port for entropy) and received through an `IPPROTO_UDP` raw socket
//!   that hands over the real IP header (a BPF filter keeps only our port). Every ICRC is
//!   computed and verified over the real headers. The UDP socket bound to the port only
//!   reserves it (a BPF filter drops everything queued on it).
//! * **Without it**: an ordinary UDP socket. Sent datagrams leave from the bound port with
//!   DF set, for which Linux uses identification 0 on unconnected sockets, so the ICRC
//!   is computed over that header. Received datagrams have their header reconstructed
//!   the same way (identification 0, DF): the ICRC of a peer that sends like this (krdma
//!   without raw sockets) verifies; a peer that uses other identifications (Linux
//!   rdma_rxe, krdma with raw sockets) fails it and is dropped and counted. Interop with
//!   kernel rxe therefore needs the raw mode.
//!
//! **IPv6** needs none of this: its header has no identification, and every field the
//! ICRC covers (addresses, payload length, next header) is known from `recvmsg` with
//! `IPV6_PKTINFO`, so a plain UDP socket computes and verifies every ICRC exactly. It
//! serves the host's IPv6 addresses when the device serves every address; datagrams leave
//! from the RoCEv2 port itself rather than from a per-QP source port. Link-local
//! addresses (which need a scope) are not used.
//!
//! Over 600 lines: the raw-socket and plain-UDP datagram paths and their FFI, kept in one
//! audited place; the last 75 lines are tests.

use crate::wire::icrc;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

/// One received RoCEv2 datagram (ICRC already verified).
#[derive(Debug)]
pub struct Datagram<'a> {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    /// The UDP payload: BTH .. ICRC.
    pub roce: &'a [u8],
}

/// Where a device's datagrams leave: the host's network ([`Net`]) or a simulated link
/// (`crate::sim`). The engine hands every packet it transmits to one of these.
pub trait Wire: Send + Sync {
    /// Send one RoCEv2 datagram from `src`:`sport` to `dst`:`dport` (`roce`: BTH .. ICRC
    /// slot; a wire that computes ICRCs fills the slot).
    fn send(
        &self,
        src: IpAddr,
        dst: IpAddr,
        sport: u16,
        dport: u16,
        roce: &mut [u8],
    ) -> io::Result<()>;
    /// Whether IPv6 peers are reachable.
    fn has_ipv6(&self) -> bool;
}

impl Wire for Net {
    fn send(
        &self,
        src: IpAddr,
        dst: IpAddr,
        sport: u16,
        dport: u16,
        roce: &mut [u8],
    ) -> io::Result<()> {
        Net::send(self, src, dst, sport, dport, roce)
    }

    fn has_ipv6(&self) -> bool {
        Net::has_ipv6(self)
    }
}

/// Why a datagram was dropped before the engine saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RxDrop {
    /// Not for us (other port or address) or not IPv4/UDP.
    NotOurs,
    /// Too short or malformed IP/UDP framing.
    Malformed,
    BadIcrc,
}

const RAW_TX_TTL: u8 = 64;

pub struct Net {
    udp: UdpSocket,
    /// IPv6 (wildcard devices only).
    udp6: Option<UdpSocket>,
    raw_rx: Option<OwnedFd>,
    raw_tx: Option<OwnedFd>,
    port: u16,
    bound: Option<Ipv4Addr>,
    ip_id: AtomicU16,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("port", &self.port)
            .field("raw", &self.raw_rx.is_some())
            .finish()
    }
}

fn check(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt<T>(fd: RawFd, level: libc::c_int, name: libc::c_int, v: &T) -> io::Result<()> {
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

fn raw_socket(proto: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before it is owned.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) })?;
    // SAFETY: `fd` is a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Attach a classic BPF program to a socket.
fn attach_filter(fd: RawFd, prog: &[libc::sock_filter]) -> io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &fprog)
}

const fn bpf(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// For an `IPPROTO_UDP` raw socket (data starts at the IP header): keep datagrams to
/// UDP destination `port` (and to IPv4 destination `dst`, for a device bound to one
/// address, so instances on other addresses do not each get a copy), drop the rest.
fn udp_port_filter(port: u16, dst: Option<Ipv4Addr>) -> Vec<libc::sock_filter> {
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

impl Net {
    /// Bind UDP `port` on `bind` (None = every address) and, where allowed, open the
    /// raw sockets.
    pub fn open(bind: Option<Ipv4Addr>, port: u16, use_raw: bool) -> io::Result<Net> {
        let sa = SocketAddrV4::new(bind.unwrap_or(Ipv4Addr::UNSPECIFIED), port);
        let udp = bind_udp(sa)?;
        let fd = udp.as_raw_fd();
        let pmtu: libc::c_int = libc::IP_PMTUDISC_DO;
        setsockopt(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, &pmtu)?;
        let on: libc::c_int = 1;
        setsockopt(fd, libc::IPPROTO_IP, libc::IP_PKTINFO, &on)?;
        grow_buffers(fd);
        let raw = if use_raw { open_raw(port, bind) } else { None };
        let (raw_rx, raw_tx) = match raw {
            Some((rx, tx)) => {
                // The UDP socket only holds the port: drop whatever is queued on it.
                attach_filter(fd, &[bpf((libc::BPF_RET | libc::BPF_K) as u16, 0, 0, 0)])?;
                (Some(rx), Some(tx))
            }
            None => (None, None),
        };
        udp.set_read_timeout(Some(Duration::from_millis(200)))?;
        if let Some(rx) = &raw_rx {
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 200_000,
            };
            setsockopt(rx.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv)?;
        }
        let port = udp.local_addr()?.port();
        let udp6 = match bind {
            None => open_udp6(port)
                .map_err(|e| tracing::info!(error = %e, "rxe: no IPv6"))
                .ok(),
            Some(_) => None,
        };
        tracing::info!(%sa, port, raw = raw_rx.is_some(), ipv6 = udp6.is_some(), "rxe network up");
        Ok(Net {
            udp,
            udp6,
            raw_rx,
            raw_tx,
            port,
            bound: bind,
            ip_id: AtomicU16::new(1),
        })
    }

    /// Whether IPv6 datagrams can be sent and received.
    pub fn has_ipv6(&self) -> bool {
        self.udp6.is_some()
    }

    /// Whether ICRCs are computed and verified over real IP headers.
    pub fn is_raw(&self) -> bool {
        self.raw_rx.is_some()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Send one RoCEv2 packet (`roce`: BTH .. ICRC slot; the ICRC is filled here).
    pub fn send(
        &self,
        src: IpAddr,
        dst: IpAddr,
        sport: u16,
        dport: u16,
        roce: &mut [u8],
    ) -> io::Result<()> {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => self.send4(s, d, sport, dport, roce),
            (IpAddr::V6(s), IpAddr::V6(d)) => self.send6(s, d, dport, roce),
            _ => Err(io::ErrorKind::InvalidInput.into()),
        }
    }

    fn send6(&self, src: Ipv6Addr, dst: Ipv6Addr, dport: u16, roce: &mut [u8]) -> io::Result<()> {
        let sock = self.udp6.as_ref().ok_or(io::ErrorKind::AddrNotAvailable)?;
        let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
        let ip = icrc::ipv6_header_for(src, dst, 0, 0, RAW_TX_TTL, udp_len);
        let udp = set_dport(icrc::udp_header_for(self.port, udp_len), dport);
        fill(&ip, &udp, roce)?;
        // SAFETY: sockaddr_in6 is plain data; all-zero is valid before the fields are set.
        let mut sa: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        sa.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        sa.sin6_port = dport.to_be();
        sa.sin6_addr.s6_addr = dst.octets();
        let info = libc::in6_pktinfo {
            ipi6_addr: libc::in6_addr {
                s6_addr: src.octets(),
            },
            ipi6_ifindex: 0,
        };
        let cmsg = Cmsg {
            level: libc::IPPROTO_IPV6,
            kind: libc::IPV6_PKTINFO,
            data: as_bytes(&info),
        };
        sendmsg(
            sock.as_raw_fd(),
            as_bytes(&sa),
            &[io_slice(roce)],
            Some(cmsg),
        )
    }

    fn send4(
        &self,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        sport: u16,
        dport: u16,
        roce: &mut [u8],
    ) -> io::Result<()> {
        let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
        match &self.raw_tx {
            Some(tx) => {
                let id = loop {
                    let id = self.ip_id.fetch_add(1, Ordering::Relaxed);
                    if id != 0 {
                        break id; // the kernel would replace a zero identification
                    }
                };
                let ip = icrc::ipv4_header_for(src, dst, id, RAW_TX_TTL, 0, udp_len);
                let udp = icrc::udp_header_for(sport, udp_len);
                let udp = set_dport(udp, dport);
                fill(&ip, &udp, roce)?;
                let dst_sa = sockaddr_in(SocketAddrV4::new(dst, 0));
                let iov = [io_slice(&ip), io_slice(&udp), io_slice(roce)];
                sendmsg(tx.as_raw_fd(), as_bytes(&dst_sa), &iov, None)
            }
            None => {
                let ip = icrc::ipv4_header_for(src, dst, 0, RAW_TX_TTL, 0, udp_len);
                let udp = set_dport(icrc::udp_header_for(self.port, udp_len), dport);
                fill(&ip, &udp, roce)?;
                let dst_sa = sockaddr_in(SocketAddrV4::new(dst, dport));
                let pktinfo = libc::in_pktinfo {
                    ipi_ifindex: 0,
                    ipi_spec_dst: libc::in_addr {
                        s_addr: u32::from(src).to_be(),
                    },
                    ipi_addr: libc::in_addr { s_addr: 0 },
                };
                let cmsg = Cmsg {
                    level: libc::IPPROTO_IP,
                    kind: libc::IP_PKTINFO,
                    data: as_bytes(&pktinfo),
                };
                sendmsg(
                    self.udp.as_raw_fd(),
                    as_bytes(&dst_sa),
                    &[io_slice(roce)],
                    Some(cmsg),
                )
            }
        }
    }

    /// Wait up to 200 ms for the next datagram; `Ok(None)` on timeout.
    pub fn recv<'b>(&self, buf: &'b mut [u8]) -> io::Result<Option<Result<Datagram<'b>, RxDrop>>> {
        let v4 = self
            .raw_rx
            .as_ref()
            .map_or(self.udp.as_raw_fd(), |r| r.as_raw_fd());
        if let Some(u6) = &self.udp6 {
            let mut fds = [
                libc::pollfd {
                    fd: v4,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: u6.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds for the duration of the call.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 200) };
            if n <= 0 {
                return Ok(None);
            }
            if fds[1].revents & libc::POLLIN != 0 && fds[0].revents & libc::POLLIN == 0 {
                return self.recv_udp6(u6, buf);
            }
        }
        match &self.raw_rx {
            Some(rx) => {
                // SAFETY: recv writes at most buf.len() bytes into buf.
                let n = unsafe {
                    libc::recv(
                        rx.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        0,
                    )
                };
                if n < 0 {
                    return timeout_or(io::Error::last_os_error());
                }
                Ok(Some(self.parse_raw(&buf[..n as usize])))
            }
            None => self.recv_udp(buf),
        }
    }

    fn parse_raw<'b>(&self, d: &'b [u8]) -> Result<Datagram<'b>, RxDrop> {
        let (ip, udp, v6) = icrc::split_datagram(d).map_err(|_| RxDrop::Malformed)?;
        if v6 || ip.len() != 20 || udp.len() < icrc::UDP_HEADER_LEN {
            return Err(RxDrop::NotOurs);
        }
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        if dport != self.port || self.bound.is_some_and(|b| b != dst) {
            return Err(RxDrop::NotOurs);
        }
        icrc::verify_ipv4(ip, udp).map_err(|_| RxDrop::BadIcrc)?;
        Ok(Datagram {
            src: IpAddr::V4(Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15])),
            dst: IpAddr::V4(dst),
            sport: u16::from_be_bytes([udp[0], udp[1]]),
            roce: &udp[icrc::UDP_HEADER_LEN..],
        })
    }

    fn recv_udp<'b>(&self, buf: &'b mut [u8]) -> io::Result<Option<Result<Datagram<'b>, RxDrop>>> {
        let mut from: libc::sockaddr_in = unsafe_zeroed();
        let (n, dst) = match recvmsg(self.udp.as_raw_fd(), &mut from, buf)? {
            Some(r) => r,
            None => return Ok(None),
        };
        let Some(IpAddr::V4(dst)) = dst else {
            return Ok(Some(Err(RxDrop::Malformed)));
        };
        let src = Ipv4Addr::from(u32::from_be(from.sin_addr.s_addr));
        let sport = u16::from_be(from.sin_port);
        let roce = &buf[..n];
        let udp_len = (icrc::UDP_HEADER_LEN + n) as u16;
        let ip = icrc::ipv4_header_for(src, dst, 0, RAW_TX_TTL, 0, udp_len);
        let udp = set_dport(icrc::udp_header_for(sport, udp_len), self.port);
        match icrc_of(&ip, &udp, roce) {
            Some(c) if roce.len() >= 4 && roce[n - 4..] == c.to_le_bytes() => {}
            Some(_) => return Ok(Some(Err(RxDrop::BadIcrc))),
            None => return Ok(Some(Err(RxDrop::Malformed))),
        }
        Ok(Some(Ok(Datagram {
            src: src.into(),
            dst: dst.into(),
            sport,
            roce,
        })))
    }

    fn recv_udp6<'b>(
        &self,
        sock: &UdpSocket,
        buf: &'b mut [u8],
    ) -> io::Result<Option<Result<Datagram<'b>, RxDrop>>> {
        // SAFETY: sockaddr_in6 is plain data; all-zero is valid.
        let mut from: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
        let (n, dst) = match recvmsg(sock.as_raw_fd(), &mut from, buf)? {
            Some(r) => r,
            None => return Ok(None),
        };
        let Some(IpAddr::V6(dst)) = dst else {
            return Ok(Some(Err(RxDrop::Malformed)));
        };
        let src = Ipv6Addr::from(from.sin6_addr.s6_addr);
        let sport = u16::from_be(from.sin6_port);
        let roce = &buf[..n];
        let udp_len = (icrc::UDP_HEADER_LEN + n) as u16;
        let ip = icrc::ipv6_header_for(src, dst, 0, 0, RAW_TX_TTL, udp_len);
        let udp = set_dport(icrc::udp_header_for(sport, udp_len), self.port);
        match icrc_of(&ip, &udp, roce) {
            Some(c) if roce[n - 4..] == c.to_le_bytes() => Ok(Some(Ok(Datagram {
                src: src.into(),
                dst: dst.into(),
                sport,
                roce,
            }))),
            Some(_) => Ok(Some(Err(RxDrop::BadIcrc))),
            None => Ok(Some(Err(RxDrop::Malformed))),
        }
    }
}

fn bind_udp(sa: SocketAddrV4) -> io::Result<UdpSocket> {
    // SO_REUSEADDR lets instances bound to distinct addresses (127.0.0.x in tests) share
    // the port with one bound to the wildcard.
    // SAFETY: plain socket(2) call; the result is checked before it is owned.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` is a new descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let on: libc::c_int = 1;
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, &on)?;
    let addr = sockaddr_in(sa);
    // SAFETY: addr is a valid sockaddr_in of the size passed.
    check(unsafe {
        libc::bind(
            fd,
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        )
    })?;
    Ok(UdpSocket::from(owned))
}

/// The IPv6 socket of a wildcard device: `[::]:port`, IPv6 only, with the destination of
/// each datagram reported.
fn open_udp6(port: u16) -> io::Result<UdpSocket> {
    // SAFETY: plain socket(2); checked before it is owned.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a fresh descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let on: libc::c_int = 1;
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, &on)?;
    setsockopt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, &on)?;
    setsockopt(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, &on)?;
    let sa = SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0);
    // SAFETY: sockaddr_in6 is plain data; all-zero is valid before the fields are set.
    let mut addr: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    addr.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    addr.sin6_port = sa.port().to_be();
    // SAFETY: addr is a valid sockaddr_in6 of the size passed.
    check(unsafe {
        libc::bind(
            fd,
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in6>() as u32,
        )
    })?;
    grow_buffers(fd);
    let sock = UdpSocket::from(owned);
    sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    Ok(sock)
}

/// Receive one datagram with its destination address (IP_PKTINFO / IPV6_PKTINFO);
/// `None` on timeout.
fn recvmsg<A>(
    fd: RawFd,
    from: &mut A,
    buf: &mut [u8],
) -> io::Result<Option<(usize, Option<IpAddr>)>> {
    let mut control = [0u64; 8];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = from as *mut A as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<A>() as u32;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: msg describes valid buffers for the kernel to fill.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n < 0 {
        return timeout_or(io::Error::last_os_error());
    }
    Ok(Some((n as usize, pktinfo_dst(&msg))))
}

fn grow_buffers(fd: RawFd) {
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

fn open_raw(port: u16, dst: Option<Ipv4Addr>) -> Option<(OwnedFd, OwnedFd)> {
    let rx = raw_socket(libc::IPPROTO_UDP).ok()?;
    let tx = raw_socket(libc::IPPROTO_RAW).ok()?;
    attach_filter(rx.as_raw_fd(), &udp_port_filter(port, dst)).ok()?;
    grow_buffers(rx.as_raw_fd());
    grow_buffers(tx.as_raw_fd());
    Some((rx, tx))
}

fn set_dport(mut udp: [u8; icrc::UDP_HEADER_LEN], dport: u16) -> [u8; icrc::UDP_HEADER_LEN] {
    udp[2..4].copy_from_slice(&dport.to_be_bytes());
    udp
}

/// The ICRC of `roce` (BTH .. ICRC slot) as carried behind `ip` and `udp`; `None` when
/// the packet is too short to hold a BTH and an ICRC.
fn icrc_of(ip: &[u8], udp: &[u8; icrc::UDP_HEADER_LEN], roce: &[u8]) -> Option<u32> {
    let n = roce.len();
    if n < 12 + 4 {
        return None;
    }
    let head = [&udp[..], &roce[..12]].concat();
    let mut c = match ip.len() {
        20 => icrc::Icrc::ipv4(ip, &head).ok()?,
        _ => icrc::Icrc::ipv6(ip, &head).ok()?,
    };
    c.update(&roce[12..n - 4]);
    Some(c.finish())
}

/// Fill the ICRC of `roce` as carried behind `ip` and `udp`.
fn fill(ip: &[u8], udp: &[u8; icrc::UDP_HEADER_LEN], roce: &mut [u8]) -> io::Result<()> {
    let c = icrc_of(ip, udp, roce).ok_or(io::ErrorKind::InvalidInput)?;
    let n = roce.len();
    roce[n - 4..].copy_from_slice(&c.to_le_bytes());
    Ok(())
}

fn timeout_or<T>(e: io::Error) -> io::Result<Option<T>> {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted => {
            Ok(None)
        }
        _ => Err(e),
    }
}

fn unsafe_zeroed() -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

fn sockaddr_in(sa: SocketAddrV4) -> libc::sockaddr_in {
    let mut s = unsafe_zeroed();
    s.sin_family = libc::AF_INET as libc::sa_family_t;
    s.sin_port = sa.port().to_be();
    s.sin_addr.s_addr = u32::from(*sa.ip()).to_be();
    s
}

fn io_slice(b: &[u8]) -> libc::iovec {
    libc::iovec {
        iov_base: b.as_ptr() as *mut libc::c_void,
        iov_len: b.len(),
    }
}

/// One control message to send along.
struct Cmsg<'a> {
    level: libc::c_int,
    kind: libc::c_int,
    data: &'a [u8],
}

/// The bytes of a plain-data C struct.
fn as_bytes<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a `Copy` libc struct (plain data, no padding the kernel would read as
    // meaningful); the slice covers exactly its bytes and lives as long as the borrow.
    unsafe { std::slice::from_raw_parts(v as *const T as *const u8, std::mem::size_of::<T>()) }
}

fn sendmsg(fd: RawFd, name: &[u8], iov: &[libc::iovec], cmsg: Option<Cmsg<'_>>) -> io::Result<()> {
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call, and the
    // iovecs point at slices the caller keeps alive.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = name.as_ptr() as *mut libc::c_void;
    msg.msg_namelen = name.len() as u32;
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    if let Some(c) = cmsg {
        let space = unsafe_cmsg_space(c.data.len());
        if space > std::mem::size_of_val(&control) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        // SAFETY: the control buffer holds one cmsg header plus the data (checked above),
        // and CMSG_FIRSTHDR/CMSG_DATA point into it.
        unsafe {
            let h = libc::CMSG_FIRSTHDR(&msg);
            (*h).cmsg_level = c.level;
            (*h).cmsg_type = c.kind;
            (*h).cmsg_len = libc::CMSG_LEN(c.data.len() as u32) as _;
            std::ptr::copy_nonoverlapping(c.data.as_ptr(), libc::CMSG_DATA(h), c.data.len());
        }
    }
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

/// An address in its canonical form: IPv4-mapped IPv6 addresses become IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    rnicpi::gid_to_ip(rnicpi::ip_to_gid(ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_mode_round_trip_verifies_icrc() {
        let a = Net::open(Some(Ipv4Addr::new(127, 0, 0, 1)), 0, false).unwrap();
        let mut pkt = crate::wire::RoceRepr::new(
            crate::wire::BthRepr::new(crate::wire::Opcode::RcSendOnly, 0x11, 5),
            b"hello",
        )
        .to_vec()
        .unwrap();
        let lo = Ipv4Addr::LOCALHOST;
        a.send(lo.into(), lo.into(), 0, a.port(), &mut pkt).unwrap();
        let mut buf = vec![0u8; 9000];
        let d = loop {
            if let Some(d) = a.recv(&mut buf).unwrap() {
                break d.unwrap();
            }
        };
        assert_eq!(d.roce, &pkt[..]);
        assert_eq!(d.sport, a.port());
        // Bytes that did not come from a RoCEv2 sender fail the ICRC.
        let plain = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        plain
            .send_to(&pkt[..pkt.len() - 1], ("127.0.0.1", a.port()))
            .unwrap();
        let r = loop {
            if let Some(r) = a.recv(&mut buf).unwrap() {
                break r;
            }
        };
        assert_eq!(r.unwrap_err(), RxDrop::BadIcrc);
    }

    #[test]
    fn ipv6_round_trip_verifies_icrc() {
        let Ok(a) = Net::open(None, 0, false) else {
            return;
        };
        if !a.has_ipv6() {
            return; // no IPv6 on this host
        }
        let mut pkt = crate::wire::RoceRepr::new(
            crate::wire::BthRepr::new(crate::wire::Opcode::RcSendOnly, 0x11, 5),
            b"hello6",
        )
        .to_vec()
        .unwrap();
        let lo: IpAddr = Ipv6Addr::LOCALHOST.into();
        a.send(lo, lo, 0, a.port(), &mut pkt).unwrap();
        let mut buf = vec![0u8; 9000];
        let d = loop {
            if let Some(d) = a.recv(&mut buf).unwrap() {
                break d.unwrap();
            }
        };
        assert_eq!((d.src, d.dst), (lo, lo));
        assert_eq!(d.roce, &pkt[..]);
    }

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
