//! The I/O layer under the rxe engine: RoCEv2 datagrams in and out of UDP port 4791.
//!
//! The ICRC covers most of the IPv4 header, including the identification field, so both
//! directions need to know the exact header:
//!
//! * **With `CAP_NET_RAW`** (the daemon, or a root process): packets are received through
//!   an `IPPROTO_UDP` raw socket that hands over the real IP header (a BPF filter keeps
//!   only our port), and sent through the same socket with a UDP header we build (the
//!   QP's UDP source port for entropy) under the IP header the kernel adds: DF set,
//!   identification 0, as Linux gives a DF datagram of an unconnected socket. Every ICRC
//!   is computed over that header and verified over the real ones. The UDP socket bound
//!   to the port only reserves it (a BPF filter drops everything queued on it). Runs of
//!   packets to an address of this host leave from that socket as one GSO datagram
//!   each, which the raw socket receives whole and cuts back into its packets ([`gso`]).
//!   (Until 2026-12-03 sends went through an `IP_HDRINCL` socket with identifications
//!   of our own: Linux routes each datagram of such a socket anew and frees the route
//!   through RCU, which kept the softirq thread busy and made the latency tail.)
//! * **Without it**: an ordinary UDP socket. Sent datagrams leave from the bound port with
//!   DF set, for which Linux uses identification 0 on unconnected sockets, so the ICRC
//!   is computed over that header. Received datagrams have their header reconstructed
//!   the same way (identification 0, DF): the ICRC of a peer that sends like this (krdma,
//!   packet by packet) verifies; a peer that uses other identifications (Linux rdma_rxe;
//!   the packets after the first of a krdma GSO run) fails it and is dropped and
//!   counted. Interop with kernel rxe therefore needs the raw mode.
//!
//! **IPv6** needs none of this: its header has no identification, and every field the
//! ICRC covers (addresses, payload length, next header) is known from `recvmsg` with
//! `IPV6_PKTINFO`, so a plain UDP socket computes and verifies every ICRC exactly. It
//! serves the host's IPv6 addresses when the device serves every address; datagrams leave
//! from the RoCEv2 port itself rather than from a per-QP source port. Link-local
//! addresses (which need a scope) are not used.
//!
//! The socket calls themselves, and every `unsafe` block of the I/O, are in [`sys`].

mod bindings;
mod sys;
mod watch;

use crate::wire::{gso, icrc};
pub(crate) use bindings::Elsewhere;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// What the wire itself counts, for the device's counters.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
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

    fn counters(&self) -> Vec<(&'static str, u64)> {
        Net::counters(self)
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
    /// With `CAP_NET_RAW`: every IPv4 datagram is received and sent through this.
    raw: Option<OwnedFd>,
    port: u16,
    bound: Option<Ipv4Addr>,
    /// Runs to this host go out as one GSO datagram each ([`gso`]): raw mode, until the
    /// kernel refuses one.
    gso: AtomicBool,
    /// GSO runs sent, and the packets in them.
    gso_runs: AtomicU64,
    gso_packets: AtomicU64,
    /// Of those runs, an Acknowledge riding behind another packet ([`gso_head`]).
    gso_acks_riding: AtomicU64,
    /// What the receive thread sleeps on ([`Net::wait_readable`], [`Net::hushed`]).
    watch: watch::Watch,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("port", &self.port)
            .field("raw", &self.raw.is_some())
            .finish()
    }
}

impl Net {
    /// Bind UDP `port` on `bind` (None = every address) and, where allowed, open the
    /// raw sockets; with them, runs of packets to this host leave as GSO datagrams
    /// unless `use_gso` is false.
    pub fn open(
        bind: Option<Ipv4Addr>,
        port: u16,
        use_raw: bool,
        use_gso: bool,
    ) -> io::Result<Net> {
        let sa = SocketAddrV4::new(bind.unwrap_or(Ipv4Addr::UNSPECIFIED), port);
        let udp = bind_udp(sa)?;
        let fd = udp.as_raw_fd();
        let port = udp.local_addr()?.port(); // port 0 asks for any
        Self::refuse_beside(bind, port, fd)?;
        let pmtu: libc::c_int = libc::IP_PMTUDISC_DO;
        setsockopt(fd, libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, &pmtu)?;
        let on: libc::c_int = 1;
        setsockopt(fd, libc::IPPROTO_IP, libc::IP_PKTINFO, &on)?;
        grow_buffers(fd);
        let raw = if use_raw { open_raw(port, bind) } else { None };
        if raw.is_some() {
            // The UDP socket only holds the port: drop whatever is queued on it.
            attach_filter(fd, &[bpf((libc::BPF_RET | libc::BPF_K) as u16, 0, 0, 0)])?;
            // A socket without GRO has the kernel cut each GSO run that reaches it into
            // datagrams (only for the filter to drop them); with GRO it takes the run
            // whole. But GRO on a socket also makes receiving devices coalesce datagrams
            // for it, which would hide every IP header but the first from the raw
            // socket: only a device on a loopback address, which no device's traffic
            // reaches, turns it on.
            if bind.is_some_and(|a| a.is_loopback()) {
                let _ = setsockopt(fd, libc::IPPROTO_UDP, libc::UDP_GRO, &on);
            }
        }
        let gso = use_gso && raw.is_some();
        let udp6 = match bind {
            None => open_udp6(port)
                .map_err(|e| tracing::info!(error = %e, "rxe: no IPv6"))
                .ok(),
            Some(_) => None,
        };
        tracing::info!(%sa, port, raw = raw.is_some(), ipv6 = udp6.is_some(), "rxe network up");
        let v4 = raw.as_ref().map_or(udp.as_fd(), |r| r.as_fd());
        let watch = watch::Watch::new(v4, udp6.as_ref().map(|u| u.as_fd()))?;
        Ok(Net {
            watch,
            udp,
            udp6,
            raw,
            port,
            bound: bind,
            gso: AtomicBool::new(gso),
            gso_runs: AtomicU64::new(0),
            gso_packets: AtomicU64::new(0),
            gso_acks_riding: AtomicU64::new(0),
        })
    }

    /// Refuse to serve `port` on `bind` (every address: `None`) beside another socket
    /// bound to exactly that, which `SO_REUSEPORT` let ours join ([`bindings`]).
    fn refuse_beside(bind: Option<Ipv4Addr>, port: u16, ours: RawFd) -> io::Result<()> {
        let addr = bind.unwrap_or(Ipv4Addr::UNSPECIFIED);
        match bindings::holder_beside(addr, port, sys::inode(ours)?) {
            Ok(false) => Ok(()),
            Ok(true) => {
                let on = bind.map_or("every address".to_string(), |a| a.to_string());
                Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!(
                        "UDP port {port} on {on} is already served by another rxe device \
                         in this network namespace (krdmad's, or another program's embedded \
                         one): reach that one (through krdmad), or give this one an address \
                         of its own (KRDMA_RXE_ADDR)"
                    ),
                ))
            }
            Err(e) => {
                tracing::warn!(error = %e, "rxe: cannot tell who else holds the port");
                Ok(())
            }
        }
    }

    /// Whether IPv6 datagrams can be sent and received.
    pub fn has_ipv6(&self) -> bool {
        self.udp6.is_some()
    }

    /// Whether ICRCs are computed and verified over real IP headers.
    pub fn is_raw(&self) -> bool {
        self.raw.is_some()
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

    /// Send `packets` in order: runs to this host as one GSO datagram each
    /// ([`Net::send4_gso`]), an Acknowledge and a packet to this host it may ride behind
    /// as one such datagram of two (the ACK moved behind when it came first: it answers
    /// the peer's requests, the other packet is one of this side's, neither orders the
    /// other), other runs of IPv4 datagrams through the raw socket with one
    /// `sendmmsg` each (up to [`BATCH`] at a time), the others one by one.
    pub fn send_all(&self, dport: u16, packets: &mut [Packet<'_>]) -> usize {
        let Some(raw) = &self.raw else {
            return send_each(self, dport, packets);
        };
        let mut gso = self.gso.load(Ordering::Relaxed);
        let (mut sent, mut i) = (0, 0);
        while i < packets.len() {
            if let Some(head) = gso.then(|| gso_head(&packets[i..])).flatten() {
                let n = head.len();
                if head == GsoHead::AckFirst {
                    packets.swap(i, i + 1);
                }
                if let Some(k) = self.send4_gso(dport, &mut packets[i..i + n]) {
                    if !matches!(head, GsoHead::Run(_)) {
                        self.gso_acks_riding.fetch_add(1, Ordering::Relaxed);
                    }
                    sent += k;
                    i += n;
                    continue;
                }
                gso = self.gso.load(Ordering::Relaxed);
            }
            let rest = &packets[i..];
            let run = (0..rest.len().min(BATCH))
                .take_while(|&j| {
                    let p = &rest[j];
                    let starts_gso = j > 0 && gso && gso_head(&rest[j..]).is_some();
                    p.src.is_ipv4() && p.dst.is_ipv4() && !starts_gso
                })
                .count();
            let end = i + run.max(1);
            let batch = &mut packets[i..end];
            sent += match run {
                // An IPv6 datagram, or a single one: a plain `sendmsg`.
                0 | 1 => send_each(self, dport, batch),
                _ => self.send4_raw_batch(raw.as_raw_fd(), dport, batch),
            };
            i = end;
        }
        sent
    }

    /// A run of IPv4 packets to this host ([`gso_run`]) as one datagram the kernel
    /// carries whole over loopback: from the UDP socket, with `UDP_SEGMENT` (one system
    /// call, one trip through the IP stack and one raw-socket copy at the receiver for up
    /// to 15 packets of 4 KiB). How many were sent (all or none: the kernel takes or
    /// drops the datagram whole); `None` when the run cannot go this way and the caller
    /// sends it another: a packet too short to carry an ICRC (never, from the engine), or
    /// the kernel refusing GSO, which then stays off for the device.
    fn send4_gso(&self, dport: u16, run: &mut [Packet<'_>]) -> Option<usize> {
        let (IpAddr::V4(src), IpAddr::V4(dst)) = (run[0].src, run[0].dst) else {
            return None;
        };
        let seg = run[0].roce.len();
        let ip = icrc::ipv4_header_for(src, dst, 0, RAW_TX_TTL, 0, 0);
        let udp = set_dport(icrc::udp_header_for(self.port, 0), dport);
        let n = run.len();
        if n > gso::MAX_RUN {
            return None; // never: `gso_run` makes no longer run
        }
        for (k, p) in run.iter_mut().enumerate() {
            let (ip, udp) = gso::segment_headers(&ip, &udp, k, p.roce.len());
            fill(&ip, &udp, p.roce).ok()?;
        }
        let mut iov = [io_slice(&[]); gso::MAX_RUN];
        for (slot, p) in iov.iter_mut().zip(run.iter()) {
            *slot = io_slice(p.roce);
        }
        let info = pktinfo_from(src);
        let seg16 = seg as u16;
        let cmsgs = [
            pktinfo_cmsg(&info),
            Cmsg {
                level: libc::IPPROTO_UDP,
                kind: libc::UDP_SEGMENT,
                data: as_bytes(&seg16),
            },
        ];
        let dst_sa = sockaddr_in(SocketAddrV4::new(dst, dport));
        match sendmsg(self.udp.as_raw_fd(), as_bytes(&dst_sa), &iov[..n], &cmsgs) {
            Ok(()) => {
                self.gso_runs.fetch_add(1, Ordering::Relaxed);
                self.gso_packets.fetch_add(n as u64, Ordering::Relaxed);
                Some(n)
            }
            Err(e) => {
                tracing::info!(error = %e, "rxe: UDP segmentation offload refused; sending packet by packet");
                self.gso.store(false, Ordering::Relaxed);
                None
            }
        }
    }

    /// What the wire counted: GSO runs sent, the packets they carried, and of them the
    /// Acknowledges that rode behind another packet.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("tx_gso_runs", self.gso_runs.load(Ordering::Relaxed)),
            ("tx_gso_packets", self.gso_packets.load(Ordering::Relaxed)),
            (
                "tx_gso_acks_riding",
                self.gso_acks_riding.load(Ordering::Relaxed),
            ),
        ]
    }

    /// IPv4 datagrams through the raw socket (UDP headers built here, each with its QP's
    /// source port), in one system call.
    fn send4_raw_batch(&self, fd: RawFd, dport: u16, batch: &mut [Packet<'_>]) -> usize {
        let mut heads = Vec::with_capacity(batch.len());
        for (i, p) in batch.iter_mut().enumerate() {
            let (IpAddr::V4(src), IpAddr::V4(dst)) = (p.src, p.dst) else {
                continue; // never: the caller passes a run of IPv4 datagrams
            };
            if let Ok(udp) = udp4_header(src, dst, p.sport, dport, p.roce) {
                heads.push((
                    i,
                    udp,
                    sockaddr_in(SocketAddrV4::new(dst, 0)),
                    pktinfo_from(src),
                ));
            }
        }
        let msgs: Vec<RawMsg<'_>> = heads
            .iter()
            .map(|(i, udp, sa, info)| RawMsg {
                name: as_bytes(sa),
                iov: [io_slice(udp), io_slice(&*batch[*i].roce)],
                cmsgs: [pktinfo_cmsg(info)],
            })
            .collect();
        sendmmsg(fd, &msgs)
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
        sendmsg(sock.as_raw_fd(), as_bytes(&sa), &[io_slice(roce)], &[cmsg])
    }

    fn send4(
        &self,
        src: Ipv4Addr,
        dst: Ipv4Addr,
        sport: u16,
        dport: u16,
        roce: &mut [u8],
    ) -> io::Result<()> {
        let info = pktinfo_from(src);
        match &self.raw {
            Some(raw) => {
                let udp = udp4_header(src, dst, sport, dport, roce)?;
                let dst_sa = sockaddr_in(SocketAddrV4::new(dst, 0));
                let iov = [io_slice(&udp), io_slice(roce)];
                sendmsg(
                    raw.as_raw_fd(),
                    as_bytes(&dst_sa),
                    &iov,
                    &[pktinfo_cmsg(&info)],
                )
            }
            None => {
                // The socket writes the UDP header: only its ICRC is needed from ours.
                udp4_header(src, dst, self.port, dport, roce)?;
                let dst_sa = sockaddr_in(SocketAddrV4::new(dst, dport));
                let iov = [io_slice(roce)];
                sendmsg(
                    self.udp.as_raw_fd(),
                    as_bytes(&dst_sa),
                    &iov,
                    &[pktinfo_cmsg(&info)],
                )
            }
        }
    }

    /// Sleep until a datagram waits on one of the device's sockets, at most 200 ms (to
    /// notice the device's end): which hold one (`None`: neither did). The sockets are
    /// not read here, so whoever holds the receive slots meanwhile may take it.
    pub fn wait_readable(&self) -> Option<Readable> {
        self.watch.wait(200).map(|[v4, v6]| Readable { v4, v6 })
    }

    /// Run `f`, which sends datagrams to this host and takes them off the sockets itself,
    /// without their arrival waking the thread asleep in [`Net::wait_readable`]; when the
    /// last such `f` ends, what is still queued wakes it ([`watch`]).
    pub fn hushed<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Hush<'a>(&'a Net);
        impl Drop for Hush<'_> {
            fn drop(&mut self) {
                self.0.hush(false);
            }
        }
        self.hush(true);
        let _end = Hush(self);
        f()
    }

    fn hush(&self, on: bool) {
        let v6 = self.udp6.as_ref().map(|u| u.as_fd());
        self.watch.hush(on, self.v4(), v6);
    }

    fn v4(&self) -> BorrowedFd<'_> {
        self.raw.as_ref().map_or(self.udp.as_fd(), |r| r.as_fd())
    }

    fn v4_fd(&self) -> RawFd {
        self.v4().as_raw_fd()
    }

    /// Receive what the sockets hold now into `batch` (up to [`RX_BATCH`] datagrams, one
    /// system call per socket read, never waiting): those [`Net::wait_readable`] found
    /// `readable`, or (`None`: a poll, many per microsecond at times) the IPv4 socket and
    /// the IPv6 one only while IPv6 traffic is flowing and otherwise every
    /// [`V6_IDLE_EVERY`]th call — an empty read of a second socket on every poll cost a
    /// busy IPv4 receive path about a twentieth of its throughput. How many it got;
    /// [`Net::datagrams`] hands them over.
    pub fn recv_batch(&self, batch: &mut RxBatch, readable: Option<Readable>) -> io::Result<usize> {
        batch.got.clear();
        let (read_v4, read_v6) = match readable {
            Some(r) => (r.v4, r.v6),
            None => (true, self.udp6.is_some() && batch.v6_due()),
        };
        if read_v4 {
            let from = if self.raw.is_some() {
                Source::Raw
            } else {
                Source::Udp
            };
            batch.fill(self.v4_fd(), from)?;
        }
        if let (true, Some(u6)) = (read_v6, &self.udp6) {
            let before = batch.got.len();
            batch.fill(u6.as_raw_fd(), Source::Udp)?;
            batch.v6_hot = batch.got.len() > before;
        }
        Ok(batch.got.len())
    }

    /// The packets the last [`Net::recv_batch`] put in `batch`, in the order received,
    /// each verified (or why it was dropped); a GSO run ([`gso`]) is cut into its packets.
    pub fn datagrams<'b>(
        &'b self,
        batch: &'b RxBatch,
    ) -> impl Iterator<Item = Result<Datagram<'b>, RxDrop>> + 'b {
        batch
            .got
            .iter()
            .zip(batch.buf.chunks_exact(RX_SLOT))
            .flat_map(|((from, r), slot)| {
                if r.truncated {
                    return Unpacked::One(Some(Err(RxDrop::Malformed)));
                }
                let d = &slot[..r.len];
                match from {
                    Source::Raw => self.parse_raw(d),
                    Source::Udp => Unpacked::One(Some(self.udp_datagram(d, r.from, r.dst))),
                }
            })
    }

    fn parse_raw<'b>(&self, d: &'b [u8]) -> Unpacked<'b> {
        let one = |r| Unpacked::One(Some(r));
        let Ok((ip, udp, v6)) = icrc::split_datagram(d) else {
            return one(Err(RxDrop::Malformed));
        };
        if v6 || ip.len() != 20 || udp.len() < icrc::UDP_HEADER_LEN {
            return one(Err(RxDrop::NotOurs));
        }
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        if dport != self.port || self.bound.is_some_and(|b| b != dst) {
            return one(Err(RxDrop::NotOurs));
        }
        let src = IpAddr::V4(Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]));
        let dst = IpAddr::V4(dst);
        let sport = u16::from_be_bytes([udp[0], udp[1]]);
        let roce = &udp[icrc::UDP_HEADER_LEN..];
        let cut = |run| Unpacked::Run {
            run,
            src,
            dst,
            sport,
        };
        if let Some(run) = gso::Segments::of(ip, udp, roce) {
            return cut(run);
        }
        if icrc::verify_ipv4(ip, udp).is_ok() {
            return one(Ok(Datagram {
                src,
                dst,
                sport,
                roce,
            }));
        }
        // Not one packet: perhaps a packet with an Acknowledge riding behind it.
        gso::Segments::acked(ip, udp, roce).map_or(one(Err(RxDrop::BadIcrc)), cut)
    }

    /// A datagram a UDP socket received (IPv6, or IPv4 without raw sockets): its ICRC is
    /// checked over the header Linux would have sent it with (for IPv4 identification 0
    /// and DF; IPv6 has no field the socket does not report).
    fn udp_datagram<'b>(
        &self,
        roce: &'b [u8],
        from: Option<SocketAddr>,
        dst: Option<IpAddr>,
    ) -> Result<Datagram<'b>, RxDrop> {
        let (Some(from), Some(dst)) = (from, dst) else {
            return Err(RxDrop::Malformed);
        };
        let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
        let (v4, v6);
        let ip: &[u8] = match (from.ip(), dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                v4 = icrc::ipv4_header_for(s, d, 0, RAW_TX_TTL, 0, udp_len);
                &v4
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                v6 = icrc::ipv6_header_for(s, d, 0, 0, RAW_TX_TTL, udp_len);
                &v6
            }
            _ => return Err(RxDrop::Malformed),
        };
        let udp = set_dport(icrc::udp_header_for(from.port(), udp_len), self.port);
        let d = Datagram {
            src: from.ip(),
            dst,
            sport: from.port(),
            roce,
        };
        verified(ip, &udp, d)
    }
}

/// What one received datagram holds: a packet (or why it was dropped), or a GSO run of
/// packets from this host, each verified as it is taken.
enum Unpacked<'b> {
    One(Option<Result<Datagram<'b>, RxDrop>>),
    Run {
        run: gso::Segments<'b>,
        src: IpAddr,
        dst: IpAddr,
        sport: u16,
    },
}

impl<'b> Iterator for Unpacked<'b> {
    type Item = Result<Datagram<'b>, RxDrop>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Unpacked::One(d) => d.take(),
            Unpacked::Run {
                run,
                src,
                dst,
                sport,
            } => {
                let s = run.next()?;
                let d = Datagram {
                    src: *src,
                    dst: *dst,
                    sport: *sport,
                    roce: s.roce,
                };
                Some(verified(&s.ip, &s.udp, d))
            }
        }
    }
}

/// Datagrams one [`Net::recv_batch`] takes at most.
pub const RX_BATCH: usize = sys::RECV_MANY;
/// Room for one datagram: the largest IPv4 datagram (a GSO run from this host, [`gso`]),
/// which also holds any IPv6 UDP payload a RoCEv2 peer sends. A longer one (an IPv6
/// jumbogram) arrives cut short and is dropped as malformed.
const RX_SLOT: usize = 65536;
/// Non-waiting receives between two looks at an idle IPv6 socket ([`Net::recv_batch`]).
const V6_IDLE_EVERY: u32 = 8;

/// Which socket a datagram came from, which says how to verify it.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// The raw socket: the whole IP datagram, real headers included.
    Raw,
    /// A UDP socket: the payload, with its sender and destination.
    Udp,
}

/// Which of a device's sockets hold datagrams ([`Net::wait_readable`]).
#[derive(Debug, Clone, Copy)]
pub struct Readable {
    v4: bool,
    v6: bool,
}

/// Datagrams received by one [`Net::recv_batch`], each in its own slot.
pub struct RxBatch {
    buf: Vec<u8>,
    got: Vec<(Source, sys::Received)>,
    /// The IPv6 socket had something the last time it was read.
    v6_hot: bool,
    /// Non-waiting receives since the idle IPv6 socket was last read.
    v6_skipped: u32,
}

impl Default for RxBatch {
    fn default() -> RxBatch {
        RxBatch {
            buf: vec![0; RX_BATCH * RX_SLOT],
            got: Vec::with_capacity(RX_BATCH),
            v6_hot: false,
            v6_skipped: 0,
        }
    }
}

impl RxBatch {
    /// Read what `fd` holds into the free slots.
    fn fill(&mut self, fd: RawFd, from: Source) -> io::Result<()> {
        let free = &mut self.buf[self.got.len() * RX_SLOT..];
        let got = &mut self.got;
        sys::recv_many(fd, free, RX_SLOT, |r| got.push((from, r)))
    }

    /// Whether a non-waiting receive reads the IPv6 socket this time.
    fn v6_due(&mut self) -> bool {
        self.v6_skipped += 1;
        if self.v6_hot || self.v6_skipped >= V6_IDLE_EVERY {
            self.v6_skipped = 0;
            return true;
        }
        false
    }
}

/// The UDP header of an IPv4 datagram from `src` to `dst`, with `roce`'s ICRC filled in
/// over the IP header the kernel gives it: every IPv4 datagram leaves a socket that is
/// never connected with don't-fragment set ([`sys::open_raw`], [`Net::open`]), so
/// identification 0; the fields the ICRC masks aside.
fn udp4_header(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    sport: u16,
    dport: u16,
    roce: &mut [u8],
) -> io::Result<[u8; icrc::UDP_HEADER_LEN]> {
    let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
    let ip = icrc::ipv4_header_for(src, dst, 0, RAW_TX_TTL, 0, udp_len);
    let udp = set_dport(icrc::udp_header_for(sport, udp_len), dport);
    fill(&ip, &udp, roce)?;
    Ok(udp)
}

/// The `IP_PKTINFO` that makes an IPv4 datagram leave from `src`.
fn pktinfo_from(src: Ipv4Addr) -> libc::in_pktinfo {
    libc::in_pktinfo {
        ipi_ifindex: 0,
        ipi_spec_dst: libc::in_addr {
            s_addr: u32::from(src).to_be(),
        },
        ipi_addr: libc::in_addr { s_addr: 0 },
    }
}

fn pktinfo_cmsg(info: &libc::in_pktinfo) -> Cmsg<'_> {
    Cmsg {
        level: libc::IPPROTO_IP,
        kind: libc::IP_PKTINFO,
        data: as_bytes(info),
    }
}

/// Whether a datagram from `src` to `dst` stays on this host (a loopback address, or the
/// sender's own), where the kernel delivers it to the receiving socket within the send.
pub(crate) fn to_this_host(src: IpAddr, dst: IpAddr) -> bool {
    dst.is_loopback() || dst == src
}

/// What the head of `packets` sends as one GSO datagram ([`gso`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GsoHead {
    /// A run of this many packets ([`gso_run`]).
    Run(usize),
    /// A packet and the Acknowledge that rides behind it.
    AckBehind,
    /// An Acknowledge and the packet it rides behind (the two swap places).
    AckFirst,
}

impl GsoHead {
    fn len(self) -> usize {
        match self {
            GsoHead::Run(n) => n,
            GsoHead::AckBehind | GsoHead::AckFirst => 2,
        }
    }
}

/// How the head of `packets` leaves as one GSO datagram, if it does: a run, or else
/// ([`ack_pair`]) an Acknowledge and the packet beside it.
fn gso_head(packets: &[Packet<'_>]) -> Option<GsoHead> {
    match gso_run(packets) {
        0 => ack_pair(packets),
        n => Some(GsoHead::Run(n)),
    }
}

/// Whether the first two of `packets` are an Acknowledge and a packet it may ride behind
/// ([`gso::ack_rides_behind`]) in one datagram from one address to the same address on
/// this host, and which comes first.
fn ack_pair(packets: &[Packet<'_>]) -> Option<GsoHead> {
    let [a, b, ..] = packets else {
        return None;
    };
    if !v4_to_this_host(a) || (b.src, b.dst) != (a.src, a.dst) {
        return None;
    }
    if gso::is_ack(b.roce) && gso::ack_rides_behind(a.roce) {
        Some(GsoHead::AckBehind)
    } else if gso::is_ack(a.roce) && gso::ack_rides_behind(b.roce) {
        Some(GsoHead::AckFirst)
    } else {
        None
    }
}

/// Whether `p` is an IPv4 datagram to this host.
fn v4_to_this_host(p: &Packet<'_>) -> bool {
    p.src.is_ipv4() && p.dst.is_ipv4() && to_this_host(p.src, p.dst)
}

/// How many packets at the head of `packets` leave as one GSO run ([`gso`]): at least two
/// IPv4 packets from one address to the same address on this host (loopback, or the
/// sender's own), the first a full segment, the rest no longer and all but the last as
/// long; 0 when the head starts no run.
fn gso_run(packets: &[Packet<'_>]) -> usize {
    let Some(first) = packets.first() else {
        return 0;
    };
    if !v4_to_this_host(first) {
        return 0;
    }
    let seg = first.roce.len();
    if gso::segment_len(first.roce) != Some(seg) {
        return 0;
    }
    let mut n = 1;
    for p in packets.iter().take(gso::max_run(seg)).skip(1) {
        if p.src != first.src || p.dst != first.dst || p.roce.len() > seg {
            break;
        }
        n += 1;
        if p.roce.len() < seg {
            break;
        }
    }
    if n >= 2 {
        n
    } else {
        0
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
    let mut head = [0u8; icrc::UDP_HEADER_LEN + 12];
    head[..icrc::UDP_HEADER_LEN].copy_from_slice(udp);
    head[icrc::UDP_HEADER_LEN..].copy_from_slice(&roce[..12]);
    let mut c = match ip.len() {
        20 => icrc::Icrc::ipv4(ip, &head).ok()?,
        _ => icrc::Icrc::ipv6(ip, &head).ok()?,
    };
    c.update(&roce[12..n - 4]);
    Some(c.finish())
}

/// `d` when the ICRC at the end of its packet is the one over `ip` and `udp` (the headers
/// it came behind, or would have).
fn verified<'b>(
    ip: &[u8],
    udp: &[u8; icrc::UDP_HEADER_LEN],
    d: Datagram<'b>,
) -> Result<Datagram<'b>, RxDrop> {
    let n = d.roce.len();
    match icrc_of(ip, udp, d.roce) {
        Some(c) if d.roce[n - 4..] == c.to_le_bytes() => Ok(d),
        Some(_) => Err(RxDrop::BadIcrc),
        None => Err(RxDrop::Malformed),
    }
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

    /// What a datagram carried, owned (a `Datagram` borrows its batch).
    type Got = Result<(IpAddr, IpAddr, u16, Vec<u8>), RxDrop>;

    /// Every datagram the next batch that gets any holds (waiting for one).
    fn next_batch(a: &Net, batch: &mut RxBatch) -> Vec<Got> {
        while a.recv_batch(batch, a.wait_readable()).unwrap() == 0 {}
        a.datagrams(batch)
            .map(|d| d.map(|d| (d.src, d.dst, d.sport, d.roce.to_vec())))
            .collect()
    }

    fn send_only(psn: u32, payload: &[u8]) -> Vec<u8> {
        crate::wire::RoceRepr::new(
            crate::wire::BthRepr::new(crate::wire::Opcode::RcSendOnly, 0x11, psn),
            payload,
        )
        .to_vec()
        .unwrap()
    }

    #[test]
    fn udp_mode_round_trip_verifies_icrc() {
        let a = Net::open(Some(Ipv4Addr::new(127, 0, 0, 1)), 0, false, false).unwrap();
        let mut batch = RxBatch::default();
        let mut pkt = send_only(5, b"hello");
        let lo = Ipv4Addr::LOCALHOST;
        a.send(lo.into(), lo.into(), 0, a.port(), &mut pkt).unwrap();
        let got = next_batch(&a, &mut batch);
        let (_, _, sport, roce) = got[0].clone().unwrap();
        assert_eq!((roce, sport), (pkt.clone(), a.port()));
        // Bytes that did not come from a RoCEv2 sender fail the ICRC.
        let plain = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        plain
            .send_to(&pkt[..pkt.len() - 1], ("127.0.0.1", a.port()))
            .unwrap();
        assert_eq!(next_batch(&a, &mut batch), vec![Err(RxDrop::BadIcrc)]);
    }

    /// One call takes what is queued, up to a batch, in the order sent; a datagram longer
    /// than any RoCEv2 packet is dropped whole (no run is cut from what a UDP socket
    /// receives), not handed over in part.
    #[test]
    fn batches_keep_order_and_drop_oversized_datagrams() {
        let a = Net::open(Some(Ipv4Addr::new(127, 0, 0, 1)), 0, false, false).unwrap();
        let lo = Ipv4Addr::LOCALHOST;
        let sent: Vec<Vec<u8>> = (0..RX_BATCH as u32 + 4)
            .map(|psn| {
                let mut p = send_only(psn, &[psn as u8; 1000]);
                a.send(lo.into(), lo.into(), 0, a.port(), &mut p).unwrap();
                p
            })
            .collect();
        let plain = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        plain
            .send_to(
                &vec![0u8; 3 * gso::SEGMENT_PAYLOAD],
                ("127.0.0.1", a.port()),
            )
            .unwrap();
        let mut batch = RxBatch::default();
        let first = next_batch(&a, &mut batch);
        assert_eq!(first.len(), RX_BATCH, "a full batch in one call");
        let mut got = first;
        while got.len() < sent.len() + 1 {
            got.extend(next_batch(&a, &mut batch));
        }
        let roces: Vec<Vec<u8>> = got[..sent.len()]
            .iter()
            .map(|g| g.clone().unwrap().3)
            .collect();
        assert_eq!(roces, sent);
        assert_eq!(got[sent.len()..], [Err(RxDrop::BadIcrc)]);
    }

    /// A device with raw sockets on 127.0.0.1 at a free port (`None` without
    /// `CAP_NET_RAW`, which CI has).
    fn raw_net() -> Option<(Net, u16)> {
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let a = Net::open(Some(Ipv4Addr::LOCALHOST), port, true, true).unwrap();
        if !a.is_raw() {
            assert!(std::env::var_os("CI").is_none(), "CI runs this as root");
            return None;
        }
        Some((a, port))
    }

    /// A full packet (a Send Middle of 4096 bytes, each `psn as u8`).
    fn full(psn: u32) -> Vec<u8> {
        use crate::wire::{BthRepr, Opcode, RoceRepr};
        RoceRepr::new(
            BthRepr::new(Opcode::RcSendMiddle, 0x11, psn),
            &[psn as u8; gso::SEGMENT_PAYLOAD],
        )
        .to_vec()
        .unwrap()
    }

    /// Send `sent` from and to loopback with [`Net::send_all`] (which fills the ICRCs
    /// in), then receive as many packets: what they carried, in order.
    fn send_and_receive(a: &Net, port: u16, sent: &mut [Vec<u8>]) -> Vec<Vec<u8>> {
        let lo = IpAddr::from(Ipv4Addr::LOCALHOST);
        let mut packets: Vec<Packet> = sent
            .iter_mut()
            .map(|roce| Packet {
                src: lo,
                dst: lo,
                sport: 0xc001,
                roce,
            })
            .collect();
        let n = packets.len();
        assert_eq!(a.send_all(port, &mut packets), n);
        let mut batch = RxBatch::default();
        let mut got = Vec::new();
        while got.len() < n {
            got.extend(next_batch(a, &mut batch));
        }
        got.into_iter().map(|g| g.unwrap().3).collect()
    }

    /// With raw sockets, a run of full packets to this host leaves as one GSO datagram
    /// and arrives cut back into its packets, each verified, in order with the packets
    /// sent before and after it one by one.
    #[test]
    fn a_run_to_this_host_arrives_as_its_packets() {
        let Some((a, port)) = raw_net() else { return };
        use crate::wire::{BthRepr, Opcode, RoceRepr};
        let mut sent = vec![send_only(1, b"alone")];
        sent.extend((2..7).map(full));
        sent.push(
            RoceRepr::new(BthRepr::new(Opcode::RcSendLast, 0x11, 7), &[7; 100])
                .to_vec()
                .unwrap(),
        );
        sent.push(send_only(8, b"after"));
        let got = send_and_receive(&a, port, &mut sent);
        assert_eq!(
            a.counters(),
            vec![
                ("tx_gso_runs", 1),
                ("tx_gso_packets", 6),
                ("tx_gso_acks_riding", 0)
            ]
        );
        assert_eq!(got, sent);
    }

    /// An RC Acknowledge of `psn`.
    fn ack(psn: u32) -> Vec<u8> {
        use crate::wire::{AethRepr, BthRepr, Opcode, RoceRepr, Syndrome};
        let mut r = RoceRepr::new(BthRepr::new(Opcode::RcAcknowledge, 0x11, psn), &[]);
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Ack { credit_code: 31 },
            msn: psn,
        });
        r.to_vec().unwrap()
    }

    /// Packets to send of (source, destination, bytes).
    fn packets(bufs: &mut [(IpAddr, IpAddr, Vec<u8>)]) -> Vec<Packet<'_>> {
        bufs.iter_mut()
            .map(|(src, dst, roce)| Packet {
                src: *src,
                dst: *dst,
                sport: 0xc001,
                roce,
            })
            .collect()
    }

    /// With raw sockets, an Acknowledge and a short packet to this host leave as one
    /// datagram, the ACK behind (moved there when it came first), and arrive as the two
    /// packets, each verified; an ACK behind a full packet makes a run.
    #[test]
    fn an_ack_rides_behind_the_reply_to_this_host() {
        let Some((a, port)) = raw_net() else { return };
        let mut sent = vec![
            ack(10),
            send_only(1, b"reply"),
            send_only(2, b"another reply"),
            ack(11),
            full(3),
            ack(12),
        ];
        let got = send_and_receive(&a, port, &mut sent);
        assert_eq!(
            a.counters(),
            vec![
                ("tx_gso_runs", 3),
                ("tx_gso_packets", 6),
                ("tx_gso_acks_riding", 2)
            ]
        );
        let order = [1, 0, 2, 3, 4, 5];
        assert_eq!(got, order.map(|k| sent[k].clone()));
    }

    /// What an Acknowledge rides behind: a short packet beside it (either side), from
    /// the same address to the same address on this host; not a packet the receiver
    /// would cut as a run, not another destination, not two packets that are no ACK.
    #[test]
    fn what_pairs_with_an_ack() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        let lo2: IpAddr = Ipv4Addr::new(127, 0, 0, 2).into();
        let far: IpAddr = Ipv4Addr::new(192, 0, 2, 1).into();
        let pair = |bufs: &mut [(IpAddr, IpAddr, Vec<u8>)]| gso_head(&packets(bufs));
        let reply = || send_only(1, b"reply");
        assert_eq!(
            pair(&mut [(lo, lo, ack(1)), (lo, lo, reply())]),
            Some(GsoHead::AckFirst)
        );
        assert_eq!(
            pair(&mut [(lo, lo, reply()), (lo, lo, ack(1))]),
            Some(GsoHead::AckBehind)
        );
        assert_eq!(
            pair(&mut [(lo, lo, full(1)), (lo, lo, ack(1))]),
            Some(GsoHead::Run(2))
        );
        assert_eq!(pair(&mut [(lo, lo, ack(1))]), None);
        assert_eq!(pair(&mut [(lo, lo, reply()), (lo, lo, reply())]), None);
        assert_eq!(pair(&mut [(lo, lo, ack(1)), (lo, lo2, reply())]), None);
        assert_eq!(pair(&mut [(lo, lo, ack(1)), (lo2, lo, reply())]), None);
        assert_eq!(pair(&mut [(lo, far, ack(1)), (lo, far, reply())]), None);
        let almost_full = send_only(1, &[0; gso::SEGMENT_PAYLOAD - 8]);
        assert_eq!(pair(&mut [(lo, lo, ack(1)), (lo, lo, almost_full)]), None);
    }

    /// A kernel that refuses a run (here: UDP checksums turned off, which GSO needs)
    /// turns runs off for the device; the run and everything after it go packet by
    /// packet through the raw socket, nothing lost.
    #[test]
    fn a_refused_run_goes_packet_by_packet() {
        let Some((a, port)) = raw_net() else { return };
        let on: libc::c_int = 1;
        setsockopt(a.udp.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NO_CHECK, &on).unwrap();
        let mut sent: Vec<Vec<u8>> = (1..5).map(full).collect();
        let got = send_and_receive(&a, port, &mut sent);
        assert_eq!(
            a.counters(),
            vec![
                ("tx_gso_runs", 0),
                ("tx_gso_packets", 0),
                ("tx_gso_acks_riding", 0)
            ]
        );
        assert!(!a.gso.load(Ordering::Relaxed), "runs are off");
        assert_eq!(got, sent);
    }

    /// What starts no run: a first packet that is not a full segment, a different
    /// destination, a destination on another host, a longer packet after the first.
    #[test]
    fn only_full_packets_to_this_host_start_a_run() {
        let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
        let far: IpAddr = Ipv4Addr::new(192, 0, 2, 1).into();
        let run = |bufs: &mut [(IpAddr, IpAddr, Vec<u8>)]| gso_run(&packets(bufs));
        assert_eq!(run(&mut [(lo, lo, full(1)), (lo, lo, full(2))]), 2);
        assert_eq!(
            run(&mut [(lo, lo, send_only(1, b"x")), (lo, lo, full(2))]),
            0
        );
        assert_eq!(run(&mut [(lo, lo, full(1)), (lo, far, full(2))]), 0);
        let here: IpAddr = Ipv4Addr::new(192, 0, 2, 7).into();
        assert_eq!(run(&mut [(here, far, full(1)), (here, far, full(2))]), 0);
        assert_eq!(run(&mut [(here, here, full(1)), (here, here, full(2))]), 2);
        let mut longer = full(2);
        longer.extend([0; 4]);
        assert_eq!(run(&mut [(lo, lo, full(1)), (lo, lo, longer)]), 0);
        let mut many: Vec<_> = (0..40).map(|k| (lo, lo, full(k))).collect();
        assert_eq!(run(&mut many), gso::MAX_RUN);
    }

    #[test]
    fn ipv6_round_trip_verifies_icrc() {
        let Ok(a) = Net::open(None, 0, false, false) else {
            return;
        };
        if !a.has_ipv6() {
            return; // no IPv6 on this host
        }
        let mut batch = RxBatch::default();
        let mut pkt = send_only(5, b"hello6");
        let lo: IpAddr = Ipv6Addr::LOCALHOST.into();
        a.send(lo, lo, 0, a.port(), &mut pkt).unwrap();
        let got = next_batch(&a, &mut batch);
        assert_eq!(got, vec![Ok((lo, lo, a.port(), pkt.clone()))]);
        // Without waiting (a consumer's poll) an idle IPv6 socket is still read, within
        // a few calls.
        a.send(lo, lo, 0, a.port(), &mut pkt).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let calls = (1..=V6_IDLE_EVERY * 2)
            .find(|_| a.recv_batch(&mut batch, None).unwrap() > 0)
            .expect("the IPv6 datagram");
        assert!(calls <= V6_IDLE_EVERY, "read after {calls} calls");
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
