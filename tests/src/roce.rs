//! A hostile RoCEv2 peer for the rxe tests (root: raw sockets). It builds its own IPv4
//! and UDP headers, so it sends from any source address with a correct ICRC (or a broken
//! one on purpose), hears the victim's answers on its own address's port 4791, and can
//! watch the CM exchanges of others on loopback to learn the IDs an on-path attacker
//! would see.

use rxe::wire::{icrc, AethRepr, CmMad, Opcode, RocePacket, RoceRepr, Syndrome};
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// Whether raw sockets can be opened (root). Under `CI=true` their absence is a test
/// failure, never a silent skip.
pub fn raw_possible() -> bool {
    let ok = nix::unistd::geteuid().is_root();
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the hostile-peer tests (they need root for raw sockets)"
        );
        eprintln!("skipped: needs root for raw sockets");
    }
    ok
}

fn raw_socket(proto: libc::c_int) -> OwnedFd {
    // SAFETY: plain socket(2); checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The raw peer.
pub struct RawPeer {
    raw: OwnedFd,
    rx: UdpSocket,
    pub ip: Ipv4Addr,
    id: u16,
}

impl RawPeer {
    /// A peer at `ip` (a loopback address of the test's own).
    pub fn new(ip: Ipv4Addr) -> RawPeer {
        use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
        // SO_REUSEPORT: an rxe0 elsewhere on the host (of this user) may hold the wildcard
        // port 4791 (with it too); the datagrams to our own address still come here.
        let fd = socket::socket(
            AddressFamily::Inet,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        socket::setsockopt(&fd, sockopt::ReusePort, &true).unwrap();
        // Room for every answer a test provokes before it reads them (a stream of Read
        // responses ahead of the one NAK a test looks for): a full buffer would drop the
        // NAK when the host is loaded and the reads are slow to be answered.
        let room = 64 << 20;
        if socket::setsockopt(&fd, sockopt::RcvBufForce, &room).is_err() {
            let _ = socket::setsockopt(&fd, sockopt::RcvBuf, &room);
        }
        let sa = SockaddrIn::from(std::net::SocketAddrV4::new(ip, rxe::wire::ROCEV2_UDP_PORT));
        socket::bind(fd.as_raw_fd(), &sa).unwrap();
        let rx = UdpSocket::from(fd);
        rx.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        RawPeer {
            raw: raw_socket(libc::IPPROTO_RAW),
            rx,
            ip,
            id: 1,
        }
    }

    /// Send `repr` to `dst` with a correct ICRC, or a broken one.
    pub fn send(&mut self, dst: Ipv4Addr, repr: &RoceRepr<'_>, break_icrc: bool) {
        let roce = repr.to_vec().unwrap();
        self.send_bytes(dst, roce, break_icrc);
    }

    /// Send the RoCEv2 payload `roce` (BTH .. ICRC slot) to `dst`.
    pub fn send_bytes(&mut self, dst: Ipv4Addr, roce: Vec<u8>, break_icrc: bool) {
        self.send_as(self.ip, dst, roce, break_icrc);
    }

    /// Send `roce` to `dst` claiming to come from `src`.
    pub fn send_as(&mut self, src: Ipv4Addr, dst: Ipv4Addr, roce: Vec<u8>, break_icrc: bool) {
        let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
        self.id = self.id.wrapping_add(1).max(1);
        let ip = icrc::ipv4_header_for(src, dst, self.id, 64, 0, udp_len);
        let mut udp = icrc::udp_header_for(0xc123, udp_len).to_vec();
        udp.extend_from_slice(&roce);
        icrc::fill_ipv4(&ip, &mut udp).unwrap();
        if break_icrc {
            let n = udp.len();
            udp[n - 1] ^= 0x5a;
        }
        let mut pkt = ip.to_vec();
        pkt.extend_from_slice(&udp);
        // SAFETY: sockaddr_in is plain data; all-zero is valid before the fields are set.
        let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_addr.s_addr = u32::from(dst).to_be();
        loop {
            // SAFETY: pkt and sa are valid for the sizes passed.
            let r = unsafe {
                libc::sendto(
                    self.raw.as_raw_fd(),
                    pkt.as_ptr() as *const libc::c_void,
                    pkt.len(),
                    0,
                    &sa as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_in>() as u32,
                )
            };
            if r == pkt.len() as isize {
                return;
            }
            let e = std::io::Error::last_os_error();
            // A flood can fill the raw socket's buffer: wait for room, never drop.
            assert_eq!(e.raw_os_error(), Some(libc::ENOBUFS), "raw send: {e}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Send a CM MAD from `src` (claimed) to `dst`'s QP1.
    pub fn send_mad(&mut self, src: Ipv4Addr, dst: Ipv4Addr, mad: &CmMad) {
        let bytes = mad.to_bytes();
        let repr = rxe::wire::cm::gsi_packet(&bytes, rxe::wire::bth::DEFAULT_PKEY, 0);
        self.send_as(src, dst, repr.to_vec().unwrap(), false);
    }

    /// The next answer to this peer: (opcode, PSN, AETH syndrome); `None` after 2 s.
    pub fn answer(&self) -> Option<(Opcode, u32, Option<Syndrome>)> {
        let mut b = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            if let Ok(n) = self.rx.recv(&mut b) {
                let p = RocePacket::new_checked(&b[..n]).ok()?;
                let r = RoceRepr::parse(&p).ok()?;
                return Some((
                    r.bth.opcode,
                    r.bth.psn,
                    r.aeth.map(|a: AethRepr| a.syndrome),
                ));
            }
        }
        None
    }

    /// Every answer until none comes for `quiet`, in order.
    pub fn answers(&self, quiet: Duration) -> Vec<(Opcode, u32, Option<Syndrome>)> {
        let mut out = Vec::new();
        let mut b = [0u8; 9000];
        let mut last = Instant::now();
        while last.elapsed() < quiet {
            if let Ok(n) = self.rx.recv(&mut b) {
                last = Instant::now();
                let Ok(p) = RocePacket::new_checked(&b[..n]) else {
                    continue;
                };
                if let Ok(r) = RoceRepr::parse(&p) {
                    out.push((r.bth.opcode, r.bth.psn, r.aeth.map(|a| a.syndrome)));
                }
            }
        }
        out
    }
}

/// One CM MAD seen on the wire: its source and destination addresses and the MAD.
#[derive(Debug, Clone)]
pub struct SeenMad {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub mad: CmMad,
}

/// Watches the CM MADs to and from `addr` (a raw UDP socket sees every datagram of the
/// network namespace; the rest is left alone).
pub struct CmWatch {
    raw: OwnedFd,
    addr: Ipv4Addr,
}

/// A classic BPF program for an `IPPROTO_UDP` raw socket: keep the datagrams to UDP port
/// 4791 from or to `addr`, drop the rest (a raw socket otherwise queues every datagram of
/// the host, and other tests' RoCE streams overflowed its queue: a watched REQ was lost).
fn cm_watch_filter(addr: Ipv4Addr) -> [libc::sock_filter; 9] {
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const LDX_MSH: u16 = (libc::BPF_LDX | libc::BPF_B | libc::BPF_MSH) as u16;
    const LDH_IND: u16 = (libc::BPF_LD | libc::BPF_H | libc::BPF_IND) as u16;
    const JEQ: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const RET: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let a = u32::from(addr);
    [
        f(LD_W_ABS, 0, 0, 12), // A = IPv4 source
        f(JEQ, 2, 0, a),       // ours: check the port
        f(LD_W_ABS, 0, 0, 16), // A = IPv4 destination
        f(JEQ, 0, 4, a),       // not ours either: drop
        f(LDX_MSH, 0, 0, 0),   // X = IP header length
        f(LDH_IND, 0, 0, 2),   // A = UDP destination port
        f(JEQ, 0, 1, u32::from(rxe::wire::ROCEV2_UDP_PORT)),
        f(RET, 0, 0, 0xffff),
        f(RET, 0, 0, 0),
    ]
}

impl CmWatch {
    pub fn new(addr: Ipv4Addr) -> CmWatch {
        let raw = raw_socket(libc::IPPROTO_UDP);
        let prog = cm_watch_filter(addr);
        let fprog = libc::sock_fprog {
            len: prog.len() as u16,
            filter: prog.as_ptr() as *mut libc::sock_filter,
        };
        // SAFETY: the program outlives the call, which copies it into the kernel.
        let r = unsafe {
            libc::setsockopt(
                raw.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                &fprog as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::sock_fprog>() as u32,
            )
        };
        assert_eq!(r, 0, "attach the CM watch filter");
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: tv is a valid timeval of the size passed.
        let r = unsafe {
            libc::setsockopt(
                raw.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(r, 0);
        CmWatch { raw, addr }
    }

    /// The CM MADs seen within `within` until `enough` says the list is complete.
    pub fn until(&self, within: Duration, enough: impl Fn(&[SeenMad]) -> bool) -> Vec<SeenMad> {
        let deadline = Instant::now() + within;
        let mut seen = Vec::new();
        let mut b = [0u8; 2048];
        while !enough(&seen) {
            assert!(Instant::now() < deadline, "CM exchange not seen: {seen:?}");
            // SAFETY: recv writes at most b.len() bytes into b.
            let n = unsafe {
                libc::recv(
                    self.raw.as_raw_fd(),
                    b.as_mut_ptr() as *mut libc::c_void,
                    b.len(),
                    0,
                )
            };
            if n <= 0 {
                continue;
            }
            if let Some(m) = self.parse(&b[..n as usize]) {
                seen.push(m);
            }
        }
        seen
    }

    fn parse(&self, d: &[u8]) -> Option<SeenMad> {
        let (ip, udp, v6) = icrc::split_datagram(d).ok()?;
        if v6 || ip.len() != 20 {
            return None;
        }
        let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        let dport = u16::from_be_bytes([udp[2], udp[3]]);
        if dport != rxe::wire::ROCEV2_UDP_PORT || (src != self.addr && dst != self.addr) {
            return None;
        }
        let p = RocePacket::new_checked(&udp[icrc::UDP_HEADER_LEN..]).ok()?;
        let r = RoceRepr::parse(&p).ok()?;
        if r.bth.dest_qp != rxe::wire::deth::GSI_QPN {
            return None;
        }
        let mad = CmMad::parse(r.payload).ok()?;
        Some(SeenMad { src, dst, mad })
    }
}
