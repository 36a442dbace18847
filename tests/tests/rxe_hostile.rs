//! Hostile RoCEv2 packets against an rxe QP, through both kAL front doors: a raw-socket
//! "peer" (root) sends crafted datagrams with valid or broken ICRCs. Each is dropped or
//! NAKed per the IBTA rules and counted; no byte outside the registration changes; the
//! engine never panics; a bystander connection keeps working.

use krdma_tests::{each_front_door, private_loopback, FrontDoor};
use rxe::wire::{
    icrc, AethRepr, BthRepr, NakCode, Opcode, RethRepr, RocePacket, RoceRepr, Syndrome,
};
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{
    Access, Context, EventKind, Mr, Pd, Qp, QpAttr, QpAttrMask, QpCaps, QpConfig, QpState, RegBuf,
    WcStatus, Wqe,
};

const T: Duration = Duration::from_secs(10);
const GUARD: u8 = 0xee;
const REG_OFF: usize = 4096;
const REG_LEN: usize = 1000;
const PEER_QPN: u32 = 0x77;
const FIRST_PSN: u32 = 100;

/// The victim: an RC QP at RTS towards the attacker, a registration with guard bytes
/// around it, and a posted receive.
struct Victim {
    ctx: Arc<Context>,
    qp: Arc<Qp>,
    cq: Arc<ual::Cq>,
    buf: Arc<RegBuf>,
    mr: Arc<Mr>,
    ip: Ipv4Addr,
    _pd: Arc<Pd>,
}

fn victim(door: &FrontDoor, attacker: Ipv4Addr) -> Victim {
    let ctx = door.open();
    let dev = ctx.device("rxe0").unwrap().index;
    let gid = ctx.query_port(dev, 1).unwrap().gids[0];
    let ip = match rnicpi::gid_to_ip(gid) {
        std::net::IpAddr::V4(v) => v,
        other => panic!("rxe0 on {other}"),
    };
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 64).unwrap();
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline: 0,
    };
    let qp = ctx
        .create_qp(
            &pd,
            &cq,
            &cq,
            QpConfig {
                caps,
                ..Default::default()
            },
        )
        .unwrap();
    let buf = RegBuf::new(3 * 4096).unwrap();
    buf.fill(GUARD);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let addr = buf.as_ptr() as u64 + REG_OFF as u64;
    // SAFETY: the range lies inside `buf`, which the returned side keeps with the MR.
    let mr = unsafe { ctx.reg_mr(&pd, addr as *const u8, REG_LEN, all) }.unwrap();
    let init = QpAttr {
        state: QpState::Init,
        access: all,
        ..QpAttr::default()
    };
    qp.modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)
        .unwrap();
    let rtr = QpAttr {
        state: QpState::Rtr,
        path_mtu: 1024,
        dest_qpn: PEER_QPN,
        rq_psn: FIRST_PSN,
        max_dest_rd_atomic: 1,
        dgid: rnicpi::ip_to_gid(attacker.into()),
        ..QpAttr::default()
    };
    qp.modify(
        &rtr,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC,
    )
    .unwrap();
    let rts = QpAttr {
        state: QpState::Rts,
        sq_psn: 1,
        ..QpAttr::default()
    };
    qp.modify(&rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN)
        .unwrap();
    qp.post_recv(&Wqe::recv(77, &[mr.sge(0, 64)])).unwrap();
    Victim {
        ctx,
        qp,
        cq,
        buf,
        mr,
        ip,
        _pd: pd,
    }
}

/// The attacker: a raw IPv4 socket (our own headers, so our own ICRC) and a UDP socket on
/// its address's port 4791 to hear the victim's answers.
struct Attacker {
    raw: OwnedFd,
    rx: UdpSocket,
    ip: Ipv4Addr,
    id: u16,
}

impl Attacker {
    fn new(ip: Ipv4Addr) -> Attacker {
        // SAFETY: plain socket(2); checked before it is owned.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_RAW,
            )
        };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        let raw = unsafe { OwnedFd::from_raw_fd(fd) };
        let rx = UdpSocket::bind((ip, rxe::wire::ROCEV2_UDP_PORT)).unwrap();
        rx.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        Attacker { raw, rx, ip, id: 1 }
    }

    /// Send `repr` to `dst` with a correct ICRC, or a broken one.
    fn send(&mut self, dst: Ipv4Addr, repr: &RoceRepr<'_>, break_icrc: bool) {
        let roce = repr.to_vec().unwrap();
        self.send_bytes(dst, roce, break_icrc);
    }

    fn send_bytes(&mut self, dst: Ipv4Addr, roce: Vec<u8>, break_icrc: bool) {
        let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
        self.id = self.id.wrapping_add(1).max(1);
        let ip = icrc::ipv4_header_for(self.ip, dst, self.id, 64, 0, udp_len);
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
        assert_eq!(r, pkt.len() as isize, "{}", std::io::Error::last_os_error());
    }

    /// The next answer from the victim: (opcode, PSN, AETH syndrome).
    fn answer(&self) -> Option<(Opcode, u32, Option<Syndrome>)> {
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
}

fn counter(ctx: &Context, name: &str) -> u64 {
    let dev = ctx.device("rxe0").unwrap().index;
    ctx.stat_device(dev)
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

/// Wait until `name` has grown past `before`.
fn counted(ctx: &Context, name: &str, before: u64) {
    let deadline = Instant::now() + T;
    while counter(ctx, name) <= before {
        assert!(Instant::now() < deadline, "{name} not counted");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn write(psn: u32, qpn: u32, va: u64, rkey: u32, data: &[u8]) -> RoceRepr<'_> {
    let mut bth = BthRepr::new(Opcode::RcRdmaWriteOnly, qpn, psn);
    bth.ack_req = true;
    let mut r = RoceRepr::new(bth, data);
    r.reth = Some(RethRepr {
        va,
        rkey,
        dma_len: data.len() as u32,
    });
    r
}

fn guards_intact(v: &Victim) -> bool {
    let all = v.buf.to_vec();
    all[..REG_OFF]
        .iter()
        .chain(&all[REG_OFF + REG_LEN..])
        .all(|&b| b == GUARD)
}

#[test]
fn hostile_packets_are_dropped_or_naked_and_counted() {
    if !nix::unistd::geteuid().is_root() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the hostile-packet test (root)"
        );
        eprintln!("skipped: needs root for raw sockets");
        return;
    }
    each_front_door(|door| {
        let attacker_ip = private_loopback(if matches!(door, FrontDoor::Embedded) {
            120
        } else {
            121
        });
        let mut a = Attacker::new(attacker_ip);
        let v = victim(door, attacker_ip);
        let qpn = v.qp.qp_num;
        let (va, rkey) = (v.mr.addr, v.mr.rkey);

        // A good write lands and is acknowledged.
        a.send(v.ip, &write(FIRST_PSN, qpn, va, rkey, b"hello"), false);
        let ack = a.answer().expect("ACK");
        assert_eq!(ack.0, Opcode::RcAcknowledge);
        assert!(matches!(ack.2, Some(Syndrome::Ack { .. })));
        let mut got = [0u8; 5];
        v.buf.read(REG_OFF, &mut got);
        assert_eq!(&got, b"hello");
        let mut psn = FIRST_PSN + 1;

        // Bad ICRC: dropped, counted, not placed.
        let before = counter(&v.ctx, "rx_bad_icrc");
        a.send(v.ip, &write(psn, qpn, va, rkey, b"XXXXX"), true);
        counted(&v.ctx, "rx_bad_icrc", before);

        // Wrong P_Key, unknown QP, garbage opcode: dropped and counted.
        let mut p = write(psn, qpn, va, rkey, b"XXXXX");
        p.bth.pkey = 0x1234;
        let before = counter(&v.ctx, "rx_bad_pkey");
        a.send(v.ip, &p, false);
        counted(&v.ctx, "rx_bad_pkey", before);
        let before = counter(&v.ctx, "rx_unknown_qp");
        a.send(v.ip, &write(psn, 0xabcdef, va, rkey, b"XXXXX"), false);
        counted(&v.ctx, "rx_unknown_qp", before);
        let mut junk = write(psn, qpn, va, rkey, b"XXXXX").to_vec().unwrap();
        junk[0] = 0x1f; // no such opcode
        let before = counter(&v.ctx, "rx_malformed");
        a.send_bytes(v.ip, junk, false);
        counted(&v.ctx, "rx_malformed", before);

        // A PSN far ahead: one sequence NAK naming the expected PSN, nothing placed.
        let before = counter(&v.ctx, "nak_seq_sent");
        a.send(v.ip, &write(psn + 0x1000, qpn, va, rkey, b"XXXXX"), false);
        let nak = a.answer().expect("sequence NAK");
        assert_eq!(
            (nak.1, nak.2),
            (psn, Some(Syndrome::Nak(NakCode::PsnSequenceError)))
        );
        counted(&v.ctx, "nak_seq_sent", before);

        // Random headers with valid ICRCs: never a panic, never a write outside.
        let mut x = 0x1234_5678_9abc_def0u64;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut raw = write(psn, qpn, va, rkey, &x.to_le_bytes())
                .to_vec()
                .unwrap();
            let n = raw.len() - 4;
            let i = (x as usize >> 8) % n;
            raw[i] ^= (x >> 32) as u8 | 1;
            a.send_bytes(v.ip, raw, false);
        }
        // The victim still answers (maybe in Error by now): drain and go on.
        while a.answer().is_some() {}

        // A fresh victim for the final blow: a write past the end of the registration
        // draws a remote access NAK, the QP goes to Error, no guard byte changes.
        drop(v);
        let v = victim(door, attacker_ip);
        let qpn = v.qp.qp_num;
        psn = FIRST_PSN;
        a.send(
            v.ip,
            &write(
                psn,
                qpn,
                v.mr.addr + REG_LEN as u64 - 2,
                v.mr.rkey,
                b"OVERFLOW",
            ),
            false,
        );
        let nak = a.answer().expect("access NAK");
        assert_eq!(
            (nak.1, nak.2),
            (psn, Some(Syndrome::Nak(NakCode::RemoteAccessError)))
        );
        let c = v.cq.wait(1, T).unwrap();
        assert_eq!((c[0].wr_id, c[0].status()), (77, WcStatus::WrFlushErr));
        let deadline = Instant::now() + T;
        loop {
            let ev =
                v.qp.next_event(deadline - Instant::now())
                    .expect("access event");
            if ev.kind == EventKind::QpAccessError {
                break;
            }
        }
        assert_eq!(v.qp.state().unwrap(), QpState::Error);
        assert!(guards_intact(&v), "a byte outside the registration changed");

        // A bystander pair on the same device is unaffected.
        let (s, c) = ual::perf::connect_pair(&door.open(), &door.open(), "rxe0", 4096, 8).unwrap();
        s.post_recv(1, 0, 64).unwrap();
        c.send(2, 0, 16, ual::send_flags::SIGNALED).unwrap();
        s.complete(1).unwrap();
        c.complete(1).unwrap();
    });
}
