//! UC QPs of the rxe engine against each other on the simulated clock and link
//! (`rxe::sim`): no acknowledgements, a request complete once sent, and a receiver that
//! drops a message it cannot take whole — never a message stitched from two, never a
//! QP in Error for the peer's losses.

use rnicpi::*;
use rxe::sim::{Impairment, Sim, SimQp};
use rxe::RxeDevice;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

const A: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 2);
const SIG: u8 = send_flags::SIGNALED;
/// Every message below is three packets at this MTU.
const MTU: u32 = 1024;
const MSG: usize = 2 * MTU as usize + 100;

struct Pair {
    sim: Sim,
    b_dev: Arc<RxeDevice>,
    a: SimQp,
    b: SimQp,
}

/// Two UC QPs brought up as `ibv_uc_pingpong` brings them up: RTR with the address,
/// MTU, peer QP and receive PSN only, RTS with the send PSN only. B's QP grants
/// `b_rights`.
fn pair(seed: u64, link: Impairment, b_rights: Access) -> Pair {
    let mut sim = Sim::new(seed, link);
    let da = sim.add_device("rxe-a", A);
    let db = sim.add_device("rxe-b", B);
    let a = SimQp::with_type(&*da, 64 * MSG, 64, QpType::Uc);
    let b = SimQp::with_type(&*db, 64 * MSG, 64, QpType::Uc);
    for (me, peer, peer_addr, rights) in [(&a, &b, B, Access::REMOTE_WRITE), (&b, &a, A, b_rights)]
    {
        let q = &me.engine;
        let init = QpAttr {
            state: QpState::Init,
            access: rights,
            ..QpAttr::default()
        };
        q.modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)
            .expect("init");
        let rtr = QpAttr {
            state: QpState::Rtr,
            path_mtu: MTU,
            dest_qpn: peer.engine.qp_num(),
            rq_psn: 0xff_fffe, // the PSNs wrap in the first message
            dgid: ip_to_gid(peer_addr.into()),
            ..QpAttr::default()
        };
        q.modify(&rtr, QpAttrMask::UC_RTR).expect("rtr");
        let rts = QpAttr {
            state: QpState::Rts,
            sq_psn: 0xff_fffe,
            ..QpAttr::default()
        };
        q.modify(&rts, QpAttrMask::UC_RTS).expect("rts");
    }
    Pair {
        sim,
        b_dev: db,
        a,
        b,
    }
}

fn uc_dropped(dev: &RxeDevice) -> u64 {
    let rows = dev.counters();
    rows.iter()
        .find(|r| r.0 == "uc_dropped")
        .expect("counter")
        .1
}

/// Message `k`: its number in the first 8 bytes, then bytes derived from it.
fn message(k: u64) -> Vec<u8> {
    let mut m: Vec<u8> = (0..MSG as u64)
        .map(|i| i.wrapping_mul(k | 1).wrapping_add(k >> 1) as u8)
        .collect();
    m[..8].copy_from_slice(&k.to_le_bytes());
    m
}

fn drain(sim: &Sim, q: &SimQp, run: Duration) -> Vec<Cqe> {
    let mut got = Vec::new();
    sim.run_until(run, || {
        got.extend(q.poll());
        false
    });
    got.extend(q.poll());
    got
}

/// Sends, an RDMA Write and a Write with immediate, each three packets: placed
/// byte-exact, the sender's completions without a single packet coming back.
#[test]
fn messages_arrive_whole_and_nothing_answers() {
    let mut p = pair(1, Impairment::CLEAN, Access::REMOTE_WRITE);
    for k in 0..3u64 {
        let at = k as usize * MSG;
        p.a.buf[at..at + MSG].copy_from_slice(&message(k));
    }
    for k in 0..2u64 {
        let sge = p.b.sge(k * MSG as u64, MSG as u32);
        p.b.user.post_recv(&Wqe::recv(100 + k, &[sge])).unwrap();
    }
    let (b_addr, b_key) = p.b.remote();
    let sends = [
        Wqe::new(1, WrOpcode::Send, &[p.a.sge(0, MSG as u32)]),
        Wqe::new(2, WrOpcode::RdmaWrite, &[p.a.sge(MSG as u64, MSG as u32)])
            .with_remote(b_addr + 4 * MSG as u64, b_key),
        Wqe::new(
            3,
            WrOpcode::RdmaWriteWithImm,
            &[p.a.sge(2 * MSG as u64, MSG as u32)],
        )
        .with_remote(b_addr + 5 * MSG as u64, b_key)
        .with_imm(0x1234_5678),
    ];
    for w in &sends {
        p.a.user.post_send(&w.with_flags(SIG)).unwrap();
    }
    let ca = drain(&p.sim, &p.a, Duration::from_millis(5));
    let cb = drain(&p.sim, &p.b, Duration::from_millis(5));
    let ids: Vec<(u64, WcStatus)> = ca.iter().map(|c| (c.wr_id, c.status())).collect();
    assert_eq!(ids, [1, 2, 3].map(|i| (i, WcStatus::Success)));
    let got: Vec<(u64, WcStatus, u32)> = cb
        .iter()
        .map(|c| (c.wr_id, c.status(), c.byte_len))
        .collect();
    assert_eq!(
        got,
        [
            (100, WcStatus::Success, MSG as u32),
            (101, WcStatus::Success, MSG as u32)
        ]
    );
    assert_eq!(cb[1].opcode, WcOpcode::RecvRdmaWithImm as u8);
    assert_eq!(cb[1].imm_or_inv, 0x1234_5678);
    assert_eq!(p.b.buf[..MSG], message(0)[..], "Send");
    assert_eq!(p.b.buf[4 * MSG..5 * MSG], message(1)[..], "Write");
    assert_eq!(
        p.b.buf[5 * MSG..6 * MSG],
        message(2)[..],
        "Write with immediate"
    );
    assert_eq!(p.sim.sent_from(B), 0, "a UC responder sends nothing");
    assert_eq!(p.sim.sent_from(A), 9);
    assert_eq!(uc_dropped(&p.b_dev), 0);
}

/// Over a link that loses packets (and, half the seeds, reorders them), every receive
/// that completes holds one whole message, the messages in the order sent, none twice;
/// a lost packet costs its own message only (in order, a message is lost only with a
/// packet of its own); drops are counted; both QPs stay up.
#[test]
fn loss_costs_whole_messages_and_nothing_else() {
    const N: u64 = 40;
    let (mut total_lost, mut total_dropped) = (0, 0);
    for seed in 0..40 {
        let reorders = seed % 2 == 1;
        let link = Impairment {
            latency: Duration::from_micros(10),
            jitter: Duration::from_micros(if reorders { 30 } else { 0 }),
            loss_ppm: 60_000,
            duplicate_ppm: 0,
        };
        let mut p = pair(seed, link, Access::REMOTE_WRITE);
        for k in 0..N {
            let at = k as usize * MSG;
            p.a.buf[at..at + MSG].copy_from_slice(&message(k));
            let sge = p.b.sge(k * MSG as u64, MSG as u32);
            p.b.user.post_recv(&Wqe::recv(k, &[sge])).unwrap();
        }
        for k in 0..N {
            let w = Wqe::new(k, WrOpcode::Send, &[p.a.sge(k * MSG as u64, MSG as u32)]);
            p.a.user.post_send(&w.with_flags(SIG)).unwrap();
            p.sim.run_for(Duration::from_micros(20));
        }
        let ca = drain(&p.sim, &p.a, Duration::from_millis(20));
        let cb = drain(&p.sim, &p.b, Duration::from_millis(20));
        assert_eq!(ca.len() as u64, N, "seed {seed}: every Send completes");
        assert!(
            ca.iter().all(|c| c.status() == WcStatus::Success),
            "seed {seed}"
        );
        let mut last = None;
        for (i, c) in cb.iter().enumerate() {
            assert_eq!(c.status(), WcStatus::Success, "seed {seed}: {c:?}");
            assert_eq!(c.wr_id, i as u64, "seed {seed}: receives complete in order");
            assert_eq!(c.byte_len, MSG as u32);
            let at = i * MSG;
            let k = u64::from_le_bytes(p.b.buf[at..at + 8].try_into().unwrap());
            assert!(
                last.is_none_or(|l| k > l),
                "seed {seed}: message {k} after {last:?}"
            );
            assert_eq!(
                p.b.buf[at..at + MSG],
                message(k)[..],
                "seed {seed}: message {k} whole"
            );
            last = Some(k);
        }
        let lost = p.sim.link_stats().lost;
        let missing = N - cb.len() as u64;
        // A loss in the last message goes unnoticed (nothing follows it); every other
        // is counted, in order at most once per message missing. (A late First of a
        // message already given up starts it again, as IBTA's UC responder must take
        // any First: reordering can count a message twice.)
        let dropped = uc_dropped(&p.b_dev);
        let noticed = missing - u64::from(last != Some(N - 1));
        assert!(
            noticed == 0 || dropped > 0,
            "seed {seed}: drops are counted"
        );
        if !reorders {
            assert!(
                missing <= lost,
                "seed {seed}: {missing} messages missing, {lost} packets lost"
            );
            assert!(
                dropped <= missing,
                "seed {seed}: {dropped} drops, {missing} missing"
            );
        }
        for q in [&p.a, &p.b] {
            assert_eq!(q.engine.query().state, QpState::Rts, "seed {seed}");
        }
        total_lost += lost;
        total_dropped += missing;
    }
    assert!(
        total_lost > 100 && total_dropped > 20,
        "lost {total_lost}, dropped {total_dropped}"
    );
}

/// A Send that finds no receive, a Write to a key B never gave and a Write to a QP that
/// grants no remote write are dropped and counted: the sender's requests all succeed,
/// B's QP stays up, and the next Send is placed in the receive posted meanwhile.
#[test]
fn what_rc_would_nak_is_dropped() {
    for rights in [Access::REMOTE_WRITE, Access::empty()] {
        let mut p = pair(3, Impairment::CLEAN, rights);
        p.a.buf[..MSG].copy_from_slice(&message(7));
        let (b_addr, b_key) = p.b.remote();
        let write = |key| {
            Wqe::new(2, WrOpcode::RdmaWrite, &[p.a.sge(0, MSG as u32)]).with_remote(b_addr, key)
        };
        let send = Wqe::new(1, WrOpcode::Send, &[p.a.sge(0, MSG as u32)]);
        p.a.user.post_send(&send.with_flags(SIG)).unwrap();
        p.a.user
            .post_send(&write(b_key ^ 0x100).with_flags(SIG))
            .unwrap();
        if rights.is_empty() {
            p.a.user.post_send(&write(b_key).with_flags(SIG)).unwrap();
        }
        let before = drain(&p.sim, &p.a, Duration::from_millis(2));
        assert!(
            before.iter().all(|c| c.status() == WcStatus::Success),
            "{before:?}"
        );
        let dropped = uc_dropped(&p.b_dev);
        let messages = if rights.is_empty() { 3 } else { 2 };
        assert_eq!(dropped, messages, "every refused message");
        assert!(p.b.buf.iter().all(|&x| x == 0), "nothing placed");
        assert_eq!(p.b.engine.query().state, QpState::Rts);

        p.b.user
            .post_recv(&Wqe::recv(9, &[p.b.sge(0, MSG as u32)]))
            .unwrap();
        p.a.user.post_send(&send.with_flags(SIG)).unwrap();
        let cb = drain(&p.sim, &p.b, Duration::from_millis(2));
        assert_eq!(cb.len(), 1);
        assert_eq!((cb[0].wr_id, cb[0].status()), (9, WcStatus::Success));
        assert_eq!(p.b.buf[..MSG], message(7)[..]);
    }
}

/// A Send longer than its receive completes that receive with a length error, as a UD
/// datagram would, and the QP goes on: the next message lands in the next receive.
#[test]
fn a_send_too_long_fails_its_receive_only() {
    let mut p = pair(4, Impairment::CLEAN, Access::REMOTE_WRITE);
    p.a.buf[..MSG].copy_from_slice(&message(5));
    p.b.user
        .post_recv(&Wqe::recv(1, &[p.b.sge(0, MTU)]))
        .unwrap();
    p.b.user
        .post_recv(&Wqe::recv(2, &[p.b.sge(MSG as u64, MSG as u32)]))
        .unwrap();
    let send = Wqe::new(1, WrOpcode::Send, &[p.a.sge(0, MSG as u32)]).with_flags(SIG);
    p.a.user.post_send(&send).unwrap();
    p.a.user.post_send(&send).unwrap();
    let cb = drain(&p.sim, &p.b, Duration::from_millis(2));
    let got: Vec<(u64, WcStatus)> = cb.iter().map(|c| (c.wr_id, c.status())).collect();
    assert_eq!(got, [(1, WcStatus::LocLenErr), (2, WcStatus::Success)]);
    assert_eq!(p.b.buf[MSG..2 * MSG], message(5)[..]);
    assert_eq!(p.b.engine.query().state, QpState::Rts);
}

/// UC has no RDMA Read, atomics or Send with Invalidate: such a request completes with
/// a local QP operation error (and the QP goes to Error, as for any failed request).
#[test]
fn reads_and_atomics_are_refused() {
    let p = pair(5, Impairment::CLEAN, Access::REMOTE_WRITE);
    let (b_addr, b_key) = p.b.remote();
    let read = Wqe::new(1, WrOpcode::RdmaRead, &[p.a.sge(0, 64)]).with_remote(b_addr, b_key);
    p.a.user.post_send(&read.with_flags(SIG)).unwrap();
    let ca = drain(&p.sim, &p.a, Duration::from_millis(1));
    assert_eq!(ca[0].status(), WcStatus::LocQpOpErr);
    assert_eq!(p.a.engine.query().state, QpState::Error);
    assert_eq!(p.sim.sent_from(A), 0);
}
