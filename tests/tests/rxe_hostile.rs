//! Hostile RoCEv2 packets against an rxe QP, through both kAL front doors: a raw-socket
//! peer (root) sends crafted datagrams with valid or broken ICRCs. Each is dropped or
//! NAKed per the IBTA rules and counted; no byte outside the registration changes (guard
//! bytes around it are checked after the attacks); the engine never panics; a bystander
//! tenant on rxe0, created before the attacks, keeps being served.

use krdma_tests::roce::{raw_possible, RawPeer};
use krdma_tests::{
    counted, device_counter, each_front_door, private_loopback, Bystander, FrontDoor,
};
use rxe::wire::{AtomicEthRepr, BthRepr, IethRepr, NakCode, Opcode, RethRepr, RoceRepr, Syndrome};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{
    Access, Context, EventKind, Mr, Pd, Qp, QpAttr, QpAttrMask, QpCaps, QpConfig, QpState, RegBuf,
    WcStatus, Wqe,
};

const T: Duration = Duration::from_secs(10);
/// A bystander's round trip never takes longer than this while the attacks go on.
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);
const GUARD: u8 = 0xee;
const REG_OFF: usize = 4096;
const PEER_QPN: u32 = 0x77;
const FIRST_PSN: u32 = 100;

/// What a victim QP and its registration allow.
#[derive(Clone, Copy)]
struct Spec {
    /// The QP's remote rights (Modify QP to Init).
    qp_access: Access,
    /// The registration's rights.
    mr_access: Access,
    reg_len: usize,
    /// Responder resources.
    ird: u8,
    mtu: u32,
}

impl Default for Spec {
    fn default() -> Spec {
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        Spec {
            qp_access: all,
            mr_access: all,
            reg_len: 1000,
            ird: 1,
            mtu: 1024,
        }
    }
}

/// The victim: a registration with guard bytes around it and an RC QP at RTS towards
/// the attacker (more QPs in the same PD on demand).
struct Victim {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    cq: Arc<ual::Cq>,
    buf: Arc<RegBuf>,
    mr: Arc<Mr>,
    qp: Arc<Qp>,
    ip: Ipv4Addr,
    spec: Spec,
}

fn victim(door: &FrontDoor, attacker: Ipv4Addr, spec: Spec) -> Victim {
    let ctx = door.open();
    let dev = ctx.device("rxe0").unwrap().index;
    let gid = ctx.query_port(dev, 1).unwrap().gids[0];
    let ip = match rnicpi::gid_to_ip(gid) {
        std::net::IpAddr::V4(v) => v,
        other => panic!("rxe0 on {other}"),
    };
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 64).unwrap();
    let buf = RegBuf::new(2 * REG_OFF + spec.reg_len).unwrap();
    buf.fill(GUARD);
    let addr = buf.as_ptr() as u64 + REG_OFF as u64;
    // SAFETY: the range lies inside `buf`, which the victim keeps with the MR.
    let mr = unsafe { ctx.reg_mr(&pd, addr as *const u8, spec.reg_len, spec.mr_access) }.unwrap();
    let qp = qp_towards(&ctx, &pd, &cq, attacker, spec);
    qp.post_recv(&Wqe::recv(77, &[mr.sge(0, 64)])).unwrap();
    Victim {
        ctx,
        pd,
        cq,
        buf,
        mr,
        qp,
        ip,
        spec,
    }
}

/// An RC QP at RTS towards the attacker's QP `PEER_QPN`, expecting `FIRST_PSN`.
fn qp_towards(
    ctx: &Arc<Context>,
    pd: &Arc<Pd>,
    cq: &Arc<ual::Cq>,
    attacker: Ipv4Addr,
    spec: Spec,
) -> Arc<Qp> {
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline: 0,
    };
    let qp = ctx
        .create_qp(
            pd,
            cq,
            cq,
            QpConfig {
                caps,
                ..Default::default()
            },
        )
        .unwrap();
    let init = QpAttr {
        state: QpState::Init,
        access: spec.qp_access,
        ..QpAttr::default()
    };
    qp.modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)
        .unwrap();
    let rtr = QpAttr {
        state: QpState::Rtr,
        path_mtu: spec.mtu,
        dest_qpn: PEER_QPN,
        rq_psn: FIRST_PSN,
        max_dest_rd_atomic: spec.ird,
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
    qp
}

impl Victim {
    /// Another QP in the victim's PD (its registration reachable through it), at RTS.
    fn another_qp(&self, attacker: Ipv4Addr, qp_access: Access) -> Arc<Qp> {
        let spec = Spec {
            qp_access,
            ..self.spec
        };
        qp_towards(&self.ctx, &self.pd, &self.cq, attacker, spec)
    }

    fn guards_intact(&self) -> bool {
        let all = self.buf.to_vec();
        all[..REG_OFF]
            .iter()
            .chain(&all[REG_OFF + self.spec.reg_len..])
            .all(|&b| b == GUARD)
    }

    fn counter(&self, name: &str) -> u64 {
        device_counter(&self.ctx, "rxe0", name)
    }

    fn counted(&self, name: &str, before: u64) {
        counted(&self.ctx, "rxe0", name, before)
    }

    /// Wait for `qp`'s affiliated event `kind` (QP errors come one per QP).
    fn event(&self, qp: &Qp, kind: EventKind) {
        let deadline = Instant::now() + T;
        loop {
            let ev = qp.next_event(deadline - Instant::now()).expect("QP event");
            if ev.kind == kind {
                return;
            }
        }
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

fn read(psn: u32, qpn: u32, va: u64, rkey: u32, len: u32) -> RoceRepr<'static> {
    let mut r = RoceRepr::new(BthRepr::new(Opcode::RcRdmaReadRequest, qpn, psn), &[]);
    r.bth.ack_req = true;
    r.reth = Some(RethRepr {
        va,
        rkey,
        dma_len: len,
    });
    r
}

fn fetch_add(psn: u32, qpn: u32, va: u64, rkey: u32) -> RoceRepr<'static> {
    let mut r = RoceRepr::new(BthRepr::new(Opcode::RcFetchAdd, qpn, psn), &[]);
    r.bth.ack_req = true;
    r.atomic_eth = Some(AtomicEthRepr {
        va,
        rkey,
        swap_add: 1,
        compare: 0,
    });
    r
}

/// The bystander did a few more round trips after the attack, none slower than the bound.
fn served(bystander: Bystander) {
    bystander.more_round_trips(10, T);
    bystander.finish().assert_served(BYSTANDER_BOUND);
}

fn nak(code: NakCode) -> Option<Syndrome> {
    Some(Syndrome::Nak(code))
}

/// The attacker's address for test `n` through `door` (each test and door its own).
fn attacker_ip(door: &FrontDoor, n: u8) -> Ipv4Addr {
    private_loopback(120 + 2 * n + matches!(door, FrontDoor::Daemon(_)) as u8)
}

#[test]
fn hostile_packets_are_dropped_or_naked_and_counted() {
    if !raw_possible() {
        return;
    }
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let ip = attacker_ip(door, 0);
        let mut a = RawPeer::new(ip);
        let v = victim(door, ip, Spec::default());
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
        let before = v.counter("rx_bad_icrc");
        a.send(v.ip, &write(psn, qpn, va, rkey, b"XXXXX"), true);
        v.counted("rx_bad_icrc", before);

        // Wrong P_Key, unknown QP, garbage opcode: dropped and counted.
        let mut p = write(psn, qpn, va, rkey, b"XXXXX");
        p.bth.pkey = 0x1234;
        let before = v.counter("rx_bad_pkey");
        a.send(v.ip, &p, false);
        v.counted("rx_bad_pkey", before);
        let before = v.counter("rx_unknown_qp");
        a.send(v.ip, &write(psn, 0xabcdef, va, rkey, b"XXXXX"), false);
        v.counted("rx_unknown_qp", before);
        let mut junk = write(psn, qpn, va, rkey, b"XXXXX").to_vec().unwrap();
        junk[0] = 0x1f; // no such opcode
        let before = v.counter("rx_malformed");
        a.send_bytes(v.ip, junk, false);
        v.counted("rx_malformed", before);

        // A PSN far ahead: one sequence NAK naming the expected PSN, nothing placed.
        let before = v.counter("nak_seq_sent");
        a.send(v.ip, &write(psn + 0x1000, qpn, va, rkey, b"XXXXX"), false);
        let nak_seq = a.answer().expect("sequence NAK");
        assert_eq!(
            (nak_seq.1, nak_seq.2),
            (psn, nak(NakCode::PsnSequenceError))
        );
        v.counted("nak_seq_sent", before);

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
        // The victim still answers (maybe in Error by now): drain, then look at memory.
        while a.answer().is_some() {}
        assert!(
            v.guards_intact(),
            "a byte outside the registration changed under the mutated packets"
        );

        // A fresh victim for the final blow: a write past the end of the registration
        // draws a remote access NAK, the QP goes to Error, no guard byte changes.
        drop(v);
        let v = victim(door, ip, Spec::default());
        let qpn = v.qp.qp_num;
        psn = FIRST_PSN;
        let past = v.mr.addr + v.spec.reg_len as u64 - 2;
        a.send(v.ip, &write(psn, qpn, past, v.mr.rkey, b"OVERFLOW"), false);
        let nak_access = a.answer().expect("access NAK");
        assert_eq!(
            (nak_access.1, nak_access.2),
            (psn, nak(NakCode::RemoteAccessError))
        );
        let c = v.cq.wait(1, T).unwrap();
        assert_eq!((c[0].wr_id, c[0].status()), (77, WcStatus::WrFlushErr));
        v.event(&v.qp, EventKind::QpAccessError);
        assert_eq!(v.qp.state().unwrap(), QpState::Error);
        assert!(v.guards_intact(), "a byte outside the registration changed");
        served(bystander);
    });
}

/// M1: with one responder resource, a peer streaming RDMA Read Requests draws an
/// invalid-request NAK and the QP goes to Error instead of queueing responses without
/// bound; a Read or Write longer than 2^31 bytes is refused before any memory is looked
/// at (it could otherwise wrap the PSN space back onto itself).
#[test]
fn reads_beyond_the_responder_resources_are_refused() {
    if !raw_possible() {
        return;
    }
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let ip = attacker_ip(door, 1);
        let mut a = RawPeer::new(ip);
        let spec = Spec {
            reg_len: 1 << 20,
            ird: 1,
            mtu: 256,
            ..Spec::default()
        };
        let v = victim(door, ip, spec);
        let (qpn, va, rkey) = (v.qp.qp_num, v.mr.addr, v.mr.rkey);
        let len = spec.reg_len as u32;
        let per_read = len / spec.mtu; // responses (and PSNs) of one Read
        let before = v.counter("rd_atomic_refused");
        const READS: u32 = 64;
        for k in 0..READS {
            a.send(
                v.ip,
                &read(FIRST_PSN + k * per_read, qpn, va, rkey, len),
                false,
            );
        }
        let answers = a.answers(Duration::from_secs(1));
        let responses = answers
            .iter()
            .filter(|(op, ..)| op.operation() == rxe::wire::Operation::RdmaReadResponse)
            .count() as u32;
        let refused: Vec<_> = answers
            .iter()
            .filter(|a| a.2 == nak(NakCode::InvalidRequest))
            .collect();
        assert_eq!(refused.len(), 1, "one invalid-request NAK, then Error");
        // It names a Read that came while the responder resource was still in use: at
        // most the reads the scheduler let finish in between were answered.
        let k = (refused[0].1 - FIRST_PSN) / per_read;
        assert!((1..READS).contains(&k), "NAK for read {k}");
        assert!(
            responses <= k * per_read,
            "{responses} responses for {k} reads"
        );
        v.counted("rd_atomic_refused", before);
        v.event(&v.qp, EventKind::QpRequestError);

        // Longer than a message may be: refused as invalid, not looked up.
        for (i, too_long) in [read(FIRST_PSN, 0, va, rkey, (1 << 31) + 1), {
            let mut w = write(FIRST_PSN, 0, va, rkey, &[0; 256]);
            w.bth.opcode = Opcode::RcRdmaWriteFirst;
            w.reth.as_mut().unwrap().dma_len = u32::MAX;
            w
        }]
        .into_iter()
        .enumerate()
        {
            let qp = v.another_qp(ip, spec.qp_access);
            let mut p = too_long;
            p.bth.dest_qp = qp.qp_num;
            a.send(v.ip, &p, false);
            let ans = a.answer().expect("NAK");
            assert_eq!(
                (ans.1, ans.2),
                (FIRST_PSN, nak(NakCode::InvalidRequest)),
                "too long #{i}"
            );
        }
        assert!(v.guards_intact());
        served(bystander);
    });
}

/// M2: the QP's access flags bound what a peer may do, whatever the registration allows
/// (kernel rxe's check_op_valid): an operation the QP does not grant draws an
/// invalid-request NAK, nothing is placed, and the QP goes to Error.
#[test]
fn qp_access_flags_refuse_what_the_qp_does_not_grant() {
    if !raw_possible() {
        return;
    }
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let ip = attacker_ip(door, 2);
        let mut a = RawPeer::new(ip);
        let everything = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC;
        let spec = Spec {
            qp_access: Access::empty(),
            mr_access: everything,
            reg_len: 64,
            ..Spec::default()
        };
        let v = victim(door, ip, spec);
        let (va, rkey) = (v.mr.addr, v.mr.rkey);
        let before = v.counter("qp_access_refused");
        // A QP granting nothing, then one granting everything but the right needed.
        let refused = |qp: &Qp, mut p: RoceRepr<'_>, a: &mut RawPeer| {
            p.bth.dest_qp = qp.qp_num;
            let op = p.bth.opcode;
            a.send(v.ip, &p, false);
            let ans = a.answer().expect("NAK");
            assert_eq!(
                (ans.1, ans.2),
                (FIRST_PSN, nak(NakCode::InvalidRequest)),
                "{op:?}"
            );
            v.event(qp, EventKind::QpRequestError);
        };
        refused(&v.qp, write(FIRST_PSN, 0, va, rkey, b"PWNED"), &mut a);
        let cases = [
            (
                Access::REMOTE_READ | Access::REMOTE_ATOMIC,
                write(FIRST_PSN, 0, va, rkey, b"PWNED"),
            ),
            (
                Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
                read(FIRST_PSN, 0, va, rkey, 8),
            ),
            (
                Access::REMOTE_WRITE | Access::REMOTE_READ,
                fetch_add(FIRST_PSN, 0, va, rkey),
            ),
        ];
        for (grants, p) in cases {
            refused(&v.another_qp(ip, grants), p, &mut a);
        }
        assert!(v.counter("qp_access_refused") >= before + 4);
        let mut word = [0u8; 8];
        v.buf.read(REG_OFF, &mut word);
        assert_eq!(word, [GUARD; 8], "nothing placed, nothing added");

        // A QP that grants the right lets the same Write through.
        let qp = v.another_qp(ip, Access::REMOTE_WRITE);
        a.send(v.ip, &write(FIRST_PSN, qp.qp_num, va, rkey, b"fine"), false);
        assert!(matches!(
            a.answer().expect("ACK").2,
            Some(Syndrome::Ack { .. })
        ));
        v.buf.read(REG_OFF, &mut word[..4]);
        assert_eq!(&word[..4], b"fine");
        assert!(v.guards_intact());
        served(bystander);
    });
}

/// M6: a peer may invalidate only memory windows with Send with Invalidate; naming a
/// registration's key is an invalid request, and the registration keeps working.
#[test]
fn remote_invalidation_of_a_registration_is_refused() {
    if !raw_possible() {
        return;
    }
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let ip = attacker_ip(door, 3);
        let mut a = RawPeer::new(ip);
        let v = victim(door, ip, Spec::default());
        let before = v.counter("remote_inv_refused");
        let mut bth = BthRepr::new(Opcode::RcSendOnlyInv, v.qp.qp_num, FIRST_PSN);
        bth.ack_req = true;
        let mut inv = RoceRepr::new(bth, b"bye!");
        inv.ieth = Some(IethRepr { rkey: v.mr.rkey });
        a.send(v.ip, &inv, false);
        let ans = a.answer().expect("NAK");
        assert_eq!((ans.1, ans.2), (FIRST_PSN, nak(NakCode::InvalidRequest)));
        let c = v.cq.wait(1, T).unwrap();
        assert_eq!((c[0].wr_id, c[0].status()), (77, WcStatus::RemInvReqErr));
        v.counted("remote_inv_refused", before);

        // The registration still works, through another QP of its PD.
        let qp = v.another_qp(ip, Spec::default().qp_access);
        a.send(
            v.ip,
            &write(FIRST_PSN, qp.qp_num, v.mr.addr, v.mr.rkey, b"alive"),
            false,
        );
        assert!(matches!(
            a.answer().expect("ACK").2,
            Some(Syndrome::Ack { .. })
        ));
        let mut got = [0u8; 5];
        v.buf.read(REG_OFF, &mut got);
        assert_eq!(&got, b"alive");
        assert!(v.guards_intact());
        served(bystander);
    });
}
