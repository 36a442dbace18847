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
//! The socket calls themselves, and every `unsafe` block of the I/O, are in [`sys`].

mod sys;

use crate::wire::icrc;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;
pub use sys::bind_udp;
use sys::{
    as_bytes, attach_filter, bpf, grow_buffers, io_slice, open_raw, open_udp6, sendmmsg, sendmsg,
    setsockopt, sockaddr_in, sockaddr_in6, Cmsg, RawMsg,
};

/// Datagrams handed to the kernel in one `sendmmsg` at most.
const BATCH: usize = 64;

/// One received RoCEv2 datagram (ICRC already verified).
#[derive(Debug)]
pub struct Datagram<'a> {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    /// The UDP payload: BTH .. ICRC.
    pub roce: &'a [u8],
}

/// What an IPv4 receive call got into the buffer.
enum V4Got {
    /// From the raw socket: the whole IP datagram, `n` bytes.
    Raw(usize),
    /// From the UDP socket: `n` bytes of payload, their source and destination.
    Udp(usize, SocketAddr, Option<IpAddr>),
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
    /// Send several datagrams, in order, to the device port `dport` of their peers (a
    /// wire that can hands the kernel many at once). What cannot be sent is lost as on a
    /// wire; returns how many were sent.
    fn send_all(&self, dport: u16, packets: &mut [Packet<'_>]) -> usize {
        send_each(self, dport, packets)
    }
    /// Whether IPv6 peers are reachable.
    fn has_ipv6(&self) -> bool;
}

/// Send `packets` with one [`Wire::send`] each; how many were sent.
fn send_each<W: Wire + ?Sized>(w: &W, dport: u16, packets: &mut [Packet<'_>]) -> usize {
    packets
        .iter_mut()
        .map(|p| w.send(p.src, p.dst, p.sport, dport, p.roce).is_ok() as usize)
        .sum()
}

/// One datagram of a batch for [`Wire::send_all`].
#[derive(Debug)]
pub struct Packet<'a> {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    /// BTH .. ICRC slot (the wire fills the ICRC in).
    pub roce: &'a mut [u8],
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

    fn send_all(&self, dport: u16, packets: &mut [Packet<'_>]) -> usize {
        Net::send_all(self, dport, packets)
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

    /// Send `packets` in order: runs of IPv4 datagrams through the raw socket with one
    /// `sendmmsg` each (up to [`BATCH`] at a time), the others one by one.
    pub fn send_all(&self, dport: u16, packets: &mut [Packet<'_>]) -> usize {
        let Some(tx) = &self.raw_tx else {
            return send_each(self, dport, packets);
        };
        let mut sent = 0;
        let mut rest = packets;
        while !rest.is_empty() {
            let run = rest
                .iter()
                .take(BATCH)
                .take_while(|p| p.src.is_ipv4() && p.dst.is_ipv4())
                .count();
            let (batch, tail) = rest.split_at_mut(run.max(1));
            sent += match run {
                // An IPv6 datagram, or a single one: a plain `sendmsg`.
                0 | 1 => send_each(self, dport, batch),
                _ => self.send4_raw_batch(tx.as_raw_fd(), dport, batch),
            };
            rest = tail;
        }
        sent
    }

    /// IPv4 datagrams through the raw socket, headers built here, in one system call.
    fn send4_raw_batch(&self, fd: RawFd, dport: u16, batch: &mut [Packet<'_>]) -> usize {
        let mut heads = Vec::with_capacity(batch.len());
        for (i, p) in batch.iter_mut().enumerate() {
            let (IpAddr::V4(src), IpAddr::V4(dst)) = (p.src, p.dst) else {
                continue; // never: the caller passes a run of IPv4 datagrams
            };
            let udp_len = (icrc::UDP_HEADER_LEN + p.roce.len()) as u16;
            let ip = icrc::ipv4_header_for(src, dst, self.next_ip_id(), RAW_TX_TTL, 0, udp_len);
            let udp = set_dport(icrc::udp_header_for(p.sport, udp_len), dport);
            if fill(&ip, &udp, p.roce).is_ok() {
                heads.push((i, ip, udp, sockaddr_in(SocketAddrV4::new(dst, 0))));
            }
        }
        let msgs: Vec<RawMsg<'_>> = heads
            .iter()
            .map(|(i, ip, udp, sa)| RawMsg {
                name: as_bytes(sa),
                iov: [io_slice(ip), io_slice(udp), io_slice(&*batch[*i].roce)],
            })
            .collect();
        sendmmsg(fd, &msgs)
    }

    /// The next non-zero IPv4 identification (the kernel replaces a zero one).
    fn next_ip_id(&self) -> u16 {
        loop {
            let id = self.ip_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    fn send6(&self, src: Ipv6Addr, dst: Ipv6Addr, dport: u16, roce: &mut [u8]) -> io::Result<()> {
        let sock = self.udp6.as_ref().ok_or(io::ErrorKind::AddrNotAvailable)?;
        let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
        let ip = icrc::ipv6_header_for(src, dst, 0, 0, RAW_TX_TTL, udp_len);
        let udp = set_dport(icrc::udp_header_for(self.port, udp_len), dport);
        fill(&ip, &udp, roce)?;
        let sa = sockaddr_in6(SocketAddrV6::new(dst, dport, 0, 0));
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
                let ip = icrc::ipv4_header_for(src, dst, self.next_ip_id(), RAW_TX_TTL, 0, udp_len);
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

    /// The next datagram, waiting up to 200 ms for it (or, without `wait`, not at all);
    /// `Ok(None)` when there is none. Without waiting, a device that also serves IPv6
    /// looks at each socket in turn instead of polling both first: a busy receive path
    /// costs one system call per datagram.
    pub fn recv<'b>(
        &self,
        buf: &'b mut [u8],
        wait: bool,
    ) -> io::Result<Option<Result<Datagram<'b>, RxDrop>>> {
        let mut wait_v4 = wait;
        if let Some(u6) = &self.udp6 {
            if !wait {
                return match self.recv_v4(buf, false)? {
                    Some(got) => Ok(Some(self.v4_datagram(buf, got))),
                    None => self.recv_udp6(u6, buf),
                };
            }
            let v4 = self
                .raw_rx
                .as_ref()
                .map_or(self.udp.as_raw_fd(), |r| r.as_raw_fd());
            match sys::poll_readable([v4, u6.as_raw_fd()], 200) {
                None => return Ok(None),
                Some([false, true]) => return self.recv_udp6(u6, buf),
                Some(_) => wait_v4 = false,
            }
        }
        Ok(self
            .recv_v4(buf, wait_v4)?
            .map(|got| self.v4_datagram(buf, got)))
    }

    /// Receive one IPv4 datagram into `buf` (the raw socket's, with its IP header, or the
    /// UDP socket's payload).
    fn recv_v4(&self, buf: &mut [u8], wait: bool) -> io::Result<Option<V4Got>> {
        Ok(match &self.raw_rx {
            Some(rx) => sys::recv(rx.as_raw_fd(), buf, wait)?.map(V4Got::Raw),
            None => sys::recv_from(self.udp.as_raw_fd(), buf, wait)?
                .map(|(n, from, dst)| V4Got::Udp(n, from, dst)),
        })
    }

    fn v4_datagram<'b>(&self, buf: &'b [u8], got: V4Got) -> Result<Datagram<'b>, RxDrop> {
        match got {
            V4Got::Raw(n) => self.parse_raw(&buf[..n]),
            V4Got::Udp(n, from, dst) => self.udp4_datagram(&buf[..n], from, dst),
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

    /// A datagram the UDP socket received (no raw sockets): its ICRC is checked over the
    /// header Linux would have sent it with (identification 0, DF).
    fn udp4_datagram<'b>(
        &self,
        roce: &'b [u8],
        from: SocketAddr,
        dst: Option<IpAddr>,
    ) -> Result<Datagram<'b>, RxDrop> {
        let (SocketAddr::V4(from), Some(IpAddr::V4(dst))) = (from, dst) else {
            return Err(RxDrop::Malformed);
        };
        let (src, sport, n) = (*from.ip(), from.port(), roce.len());
        let udp_len = (icrc::UDP_HEADER_LEN + n) as u16;
        let ip = icrc::ipv4_header_for(src, dst, 0, RAW_TX_TTL, 0, udp_len);
        let udp = set_dport(icrc::udp_header_for(sport, udp_len), self.port);
        match icrc_of(&ip, &udp, roce) {
            Some(c) if n >= 4 && roce[n - 4..] == c.to_le_bytes() => {}
            Some(_) => return Err(RxDrop::BadIcrc),
            None => return Err(RxDrop::Malformed),
        }
        Ok(Datagram {
            src: src.into(),
            dst: dst.into(),
            sport,
            roce,
        })
    }

    fn recv_udp6<'b>(
        &self,
        sock: &UdpSocket,
        buf: &'b mut [u8],
    ) -> io::Result<Option<Result<Datagram<'b>, RxDrop>>> {
        let (n, from, dst) = match sys::recv_from(sock.as_raw_fd(), buf, false)? {
            Some(r) => r,
            None => return Ok(None),
        };
        let (SocketAddr::V6(from), Some(IpAddr::V6(dst))) = (from, dst) else {
            return Ok(Some(Err(RxDrop::Malformed)));
        };
        let (src, sport) = (*from.ip(), from.port());
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
            if let Some(d) = a.recv(&mut buf, true).unwrap() {
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
            if let Some(r) = a.recv(&mut buf, true).unwrap() {
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
            if let Some(d) = a.recv(&mut buf, true).unwrap() {
                break d.unwrap();
            }
        };
        assert_eq!((d.src, d.dst), (lo, lo));
        assert_eq!(d.roce, &pkt[..]);
    }

    /// No other process can bind the device's address and port beside it: not with
    /// `SO_REUSEADDR` (which for UDP would let anyone take its datagrams), nor another
    /// user with `SO_REUSEPORT`.
    #[test]
    fn nobody_else_binds_beside_the_device() {
        use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
        let addr = Ipv4Addr::new(127, 91, 17, 3);
        let dev = bind_udp(std::net::SocketAddrV4::new(addr, 0)).unwrap();
        let Ok(std::net::SocketAddr::V4(sa)) = dev.local_addr() else {
            panic!("an IPv4 socket");
        };
        let try_bind = move |port_too: bool| {
            let fd = socket::socket(
                AddressFamily::Inet,
                SockType::Datagram,
                SockFlag::SOCK_CLOEXEC,
                None,
            )
            .unwrap();
            if port_too {
                socket::setsockopt(&fd, sockopt::ReusePort, &true).unwrap();
            } else {
                socket::setsockopt(&fd, sockopt::ReuseAddr, &true).unwrap();
            }
            socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrIn::from(sa))
        };
        assert_eq!(try_bind(false), Err(nix::errno::Errno::EADDRINUSE));
        // Another user: a socket belongs to the file-system uid of the thread that
        // creates it (only root can take another's).
        if nix::unistd::geteuid().is_root() {
            let other = std::thread::spawn(move || {
                // setfsuid changes only this thread's file-system ids.
                nix::unistd::setfsuid(nix::unistd::Uid::from_raw(65534));
                try_bind(true)
            })
            .join()
            .unwrap();
            assert_eq!(other, Err(nix::errno::Errno::EADDRINUSE));
        } else {
            assert!(std::env::var_os("CI").is_none(), "CI runs this as root");
        }
        // The same user may (tests share the wildcard port with their own addresses).
        assert_eq!(try_bind(true), Ok(()));
    }
}
