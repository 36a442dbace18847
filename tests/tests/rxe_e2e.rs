//! What is InfiniBand's own in rxe0, end to end on loopback through both kAL front doors
//! (real UDP datagrams with ICRCs, the IB CM over QP1): every opcode (atomics, immediate
//! data), windows ended by Send with Invalidate, out-of-band connection at every MTU and
//! across the PSN wrap, RNR NAKs, retry exhaustion, CM reject and disconnect with private
//! data. What every device does is in `conformance.rs`.

use krdma_tests::{
    connected_pair, each_front_door, fill_pattern, polling_consumers_drive, FrontDoor,
};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tools::perf::Endpoint;
use ual::{
    send_flags, wc_flags, Access, ConnParam, Context, Cq, EventKind, Mr, Pd, Qp, QpAttr,
    QpAttrMask, QpCaps, QpConfig, QpState, RegBuf, WcOpcode, WcStatus, Wqe, WrOpcode,
};

const SIG: u8 = send_flags::SIGNALED;
const T: Duration = Duration::from_secs(20);

fn pair(door: &FrontDoor, len: usize) -> (Arc<Context>, Arc<Context>, Endpoint, Endpoint) {
    connected_pair(door, "rxe0", len)
}

#[test]
fn rxe0_is_listed_beside_siw0() {
    each_front_door(|door| {
        let ctx = door.open();
        let d = ctx.device("rxe0").expect("rxe0 registered");
        assert_eq!(d.transport, ual::Transport::Ib);
        assert!(d.attr.atomics);
        ctx.device("siw0").expect("siw0 beside it");
        let p = ctx.query_port(d.index, 1).unwrap();
        assert_eq!(p.state, rnicpi::PortState::Active);
        assert_eq!(p.gids.len(), 1, "a private loopback address");
        assert_eq!(p.active_mtu, 4096, "loopback fits the largest IB MTU");
    });
}

#[test]
fn immediate_data_and_atomics_over_a_cm_connection() {
    // Send, RDMA Write and Read themselves are the conformance suite's; here what IB has
    // and iWARP does not.
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, 1 << 20);
        // Send and Write with immediate, Send with solicited event.
        s.post_recv(7, 0, 64).unwrap();
        s.post_recv(8, 0, 64).unwrap();
        let imm = Wqe::new(9, WrOpcode::SendWithImm, &[c.mr.sge(0, 16)])
            .with_imm(0x1234_5678)
            .with_flags(SIG | send_flags::SOLICITED);
        c.qp.post_send(&imm).unwrap();
        let wimm = Wqe::new(10, WrOpcode::RdmaWriteWithImm, &[c.mr.sge(0, 5000)])
            .with_remote(c.remote.0 + 4096, c.remote.1)
            .with_imm(0xabcd)
            .with_flags(SIG);
        c.qp.post_send(&wimm).unwrap();
        let rc = s.complete(2).unwrap();
        assert_eq!(rc[0].imm_or_inv, 0x1234_5678);
        assert_ne!(rc[0].flags & wc_flags::WITH_IMM, 0);
        assert_ne!(rc[0].flags & wc_flags::SOLICITED, 0);
        assert_eq!(rc[1].opcode(), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!((rc[1].byte_len, rc[1].imm_or_inv), (5000, 0xabcd));
        c.complete(2).unwrap();

        // Atomics on a word of a server registration that allows them.
        let word_buf = RegBuf::new(64).unwrap();
        word_buf.write(0, &40u64.to_ne_bytes());
        let atomic = Access::LOCAL_WRITE | Access::REMOTE_ATOMIC;
        let wmr = _a.reg_buf(&s.pd, &word_buf, atomic).unwrap();
        let at = |id, op, cmp: u64, swap: u64| {
            let mut w = Wqe::new(id, op, &[c.mr.sge(128, 8)])
                .with_remote(wmr.addr, wmr.rkey)
                .with_flags(SIG);
            w.compare_add = cmp;
            w.swap = swap;
            c.qp.post_send(&w).unwrap();
            let rc = c.complete(1).unwrap();
            assert_eq!(rc[0].byte_len, 8);
            let mut old = [0u8; 8];
            c.buf.read(128, &mut old);
            u64::from_ne_bytes(old)
        };
        assert_eq!(at(11, WrOpcode::AtomicFetchAdd, 2, 0), 40);
        assert_eq!(at(12, WrOpcode::AtomicCmpSwp, 42, 7), 42);
        assert_eq!(at(13, WrOpcode::AtomicCmpSwp, 42, 9), 7, "compare fails");
        let mut now = [0u8; 8];
        word_buf.read(0, &mut now);
        assert_eq!(u64::from_ne_bytes(now), 7);
    });
}

#[test]
fn send_with_invalidate_ends_a_window_never_a_registration() {
    each_front_door(|door| {
        let (a, _b, s, c) = pair(door, 8192);
        // A window over the first KiB of the server's buffer, bound in its send queue.
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let bmr = a.reg_buf(&s.pd, &s.buf, all | Access::MW_BIND).unwrap();
        let mw = a.alloc_mw(&s.pd).unwrap();
        s.qp.post_send(&mw.bind_wqe(10, &bmr, 0, 1024, Access::REMOTE_WRITE))
            .unwrap();
        assert!(s.cq.wait(1, T).unwrap()[0].is_ok(), "bind");
        let key = mw.rkey();
        let write = |id| {
            Wqe::new(id, WrOpcode::RdmaWrite, &[c.mr.sge(0, 64)])
                .with_remote(bmr.addr, key)
                .with_flags(SIG)
        };
        c.qp.post_send(&write(1)).unwrap();
        c.complete(1).unwrap();

        // The peer invalidates the window with its Send.
        s.post_recv(2, 0, 64).unwrap();
        let inv = Wqe::new(3, WrOpcode::SendWithInv, &[c.mr.sge(0, 8)])
            .with_imm(key)
            .with_flags(SIG);
        c.qp.post_send(&inv).unwrap();
        let rc = s.complete(1).unwrap();
        assert_ne!(rc[0].flags & wc_flags::WITH_INV, 0);
        assert_eq!(rc[0].imm_or_inv, key);
        c.complete(1).unwrap();
        // A write with the invalidated key is refused: remote access error, QP to Error.
        c.qp.post_send(&write(4)).unwrap();
        let rc = c.cq.wait(1, T).unwrap();
        assert_eq!(rc[0].status(), WcStatus::RemAccessErr);

        // A registration's key is not the peer's to end (IBTA; kernel rxe refuses user
        // MRs): the Send is refused as an invalid request on both sides.
        let (_a, _b, s, c) = pair(door, 8192);
        s.post_recv(5, 0, 64).unwrap();
        let inv = Wqe::new(6, WrOpcode::SendWithInv, &[c.mr.sge(0, 8)])
            .with_imm(c.remote.1)
            .with_flags(SIG);
        c.qp.post_send(&inv).unwrap();
        assert_eq!(s.cq.wait(1, T).unwrap()[0].status(), WcStatus::RemInvReqErr);
        assert_eq!(c.cq.wait(1, T).unwrap()[0].status(), WcStatus::RemInvReqErr);
    });
}

/// A QP connected by hand, as `ibv_rc_pingpong` does: QPN, PSN and GID exchanged out of
/// band, then Modify QP to RTR and RTS.
struct Manual {
    qp: Arc<Qp>,
    cq: Arc<Cq>,
    mr: Arc<Mr>,
    buf: Arc<RegBuf>,
    _pd: Arc<Pd>,
}

fn manual(ctx: &Arc<Context>, len: usize) -> Manual {
    manual_of(ctx, len, ual::QpType::Rc)
}

fn manual_of(ctx: &Arc<Context>, len: usize, qp_type: ual::QpType) -> Manual {
    let dev = ctx.device("rxe0").unwrap().index;
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 256).unwrap();
    let qp = ctx
        .create_qp(
            &pd,
            &cq,
            &cq,
            QpConfig {
                caps: QpCaps {
                    max_send_wr: 64,
                    max_recv_wr: 64,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline: 0,
                },
                qp_type,
                ..Default::default()
            },
        )
        .unwrap();
    let buf = RegBuf::new(len).unwrap();
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mr = ctx.reg_buf(&pd, &buf, all).unwrap();
    Manual {
        qp,
        cq,
        mr,
        buf,
        _pd: pd,
    }
}

/// Two contexts through `door`, the first listening on rxe0's loopback address: them,
/// the listener and the address to connect to.
fn listening(door: &FrontDoor) -> (Arc<Context>, Arc<Context>, Arc<ual::Listener>, SocketAddr) {
    let (a, b) = (door.open(), door.open());
    let dev = a.device("rxe0").unwrap().index;
    let ip = tools::perf::loopback_of(&a, dev).unwrap();
    let l = a.listen(dev, SocketAddr::new(ip, 0), 4).unwrap();
    let peer = SocketAddr::new(ip, l.port);
    (a, b, l, peer)
}

/// Bring `m` to RTS towards `peer` (QPN, its first PSN, its GID).
fn bring_up(m: &Manual, peer_qpn: u32, peer_gid: [u8; 16], rq_psn: u32, sq_psn: u32, mtu: u32) {
    let init = QpAttr {
        state: QpState::Init,
        access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        ..QpAttr::default()
    };
    m.qp.modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)
        .unwrap();
    let rtr = QpAttr {
        state: QpState::Rtr,
        path_mtu: mtu,
        dest_qpn: peer_qpn,
        rq_psn,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
        dgid: peer_gid,
        ..QpAttr::default()
    };
    let m_rtr = QpAttrMask::RC_RTR;
    // RTR needs the address vector, MTU, destination QPN and receive PSN.
    assert_eq!(
        m.qp.modify(&rtr, QpAttrMask::STATE),
        Err(ual::VerbsError::Invalid)
    );
    m.qp.modify(&rtr, m_rtr).unwrap();
    let rts = QpAttr {
        state: QpState::Rts,
        sq_psn,
        timeout: 12,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
        ..QpAttr::default()
    };
    m.qp.modify(&rts, QpAttrMask::RC_RTS).unwrap();
    assert_eq!(m.qp.state().unwrap(), QpState::Rts);
}

fn gid_of(ctx: &Context) -> [u8; 16] {
    let dev = ctx.device("rxe0").unwrap().index;
    ctx.query_port(dev, 1).unwrap().gids[0]
}

fn manual_pair(
    a: &Arc<Context>,
    b: &Arc<Context>,
    len: usize,
    mtu: u32,
    psn: (u32, u32),
) -> (Manual, Manual) {
    let (x, y) = (manual(a, len), manual(b, len));
    bring_up(&x, y.qp.qp_num, gid_of(b), psn.1, psn.0, mtu);
    bring_up(&y, x.qp.qp_num, gid_of(a), psn.0, psn.1, mtu);
    (x, y)
}

#[test]
fn out_of_band_connection_every_mtu_and_psn_wrap() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        for mtu in [256, 1024, 4096] {
            // Both sides start 5 PSNs below the 24-bit wrap.
            let len = 64 * 1024;
            let (x, y) = manual_pair(&a, &b, len, mtu, (0xff_fffb, 0xff_fffa));
            let mut data = vec![0u8; len];
            fill_pattern(&mut data, mtu);
            x.buf.write(0, &data);
            for round in 0..4u64 {
                y.qp.post_recv(&Wqe::recv(round, &[y.mr.sge(0, len as u32)]))
                    .unwrap();
                x.qp.post_send(&Wqe::new(round, WrOpcode::Send, &[x.mr.sge(0, len as u32)]))
                    .unwrap();
                assert!(y.cq.wait(1, T).unwrap()[0].is_ok());
                assert!(x.cq.wait(1, T).unwrap()[0].is_ok());
            }
            assert_eq!(y.buf.to_vec(), data, "MTU {mtu}");
            // Reads back across the wrap too.
            x.buf.fill(0);
            let r = Wqe::new(9, WrOpcode::RdmaRead, &[x.mr.sge(0, len as u32)])
                .with_remote(y.mr.addr, y.mr.rkey);
            x.qp.post_send(&r).unwrap();
            assert!(x.cq.wait(1, T).unwrap()[0].is_ok());
            assert_eq!(x.buf.to_vec(), data, "read at MTU {mtu}");
        }
    });
}

#[test]
fn rnr_nak_waits_for_the_receive() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let (x, y) = manual_pair(&a, &b, 4096, 1024, (1, 2));
        x.qp.post_send(&Wqe::new(1, WrOpcode::Send, &[x.mr.sge(0, 100)]))
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(x.cq.poll(&mut [Default::default()]) == 0, "no receive yet");
        y.qp.post_recv(&Wqe::recv(2, &[y.mr.sge(0, 4096)])).unwrap();
        assert_eq!(y.cq.wait(1, T).unwrap()[0].byte_len, 100);
        assert!(x.cq.wait(1, T).unwrap()[0].is_ok());
        let dev = a.device("rxe0").unwrap().index;
        let rnr = a
            .stat_device(dev)
            .unwrap()
            .into_iter()
            .find(|(k, _)| k == "rnr_nak_rcvd")
            .unwrap()
            .1;
        assert!(rnr > 0, "RNR NAKs counted");
    });
}

#[test]
fn vanished_peer_yields_retry_exceeded() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let (x, y) = manual_pair(&a, &b, 4096, 1024, (1, 2));
        // Short timeout (4.096 µs × 2^12 ≈ 17 ms) and 3 retries.
        let attr = QpAttr {
            timeout: 12,
            retry_cnt: 3,
            ..QpAttr::default()
        };
        x.qp.modify(&attr, QpAttrMask::TIMEOUT | QpAttrMask::RETRY_CNT)
            .unwrap();
        drop(y);
        drop(b);
        let started = Instant::now();
        x.qp.post_send(&Wqe::new(1, WrOpcode::Send, &[x.mr.sge(0, 10)]).with_flags(SIG))
            .unwrap();
        let c = x.cq.wait(1, T).unwrap();
        assert_eq!(c[0].status(), WcStatus::RetryExcErr);
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "retry exceeded after {took:?}"
        );
        assert_eq!(x.qp.state().unwrap(), QpState::Error);
    });
}

#[test]
fn reject_and_disconnect_with_private_data() {
    each_front_door(|door| {
        let (a, b, l, peer) = listening(door);
        let m = manual(&b, 64);
        let param = ConnParam {
            private_data: b"hello".to_vec(),
            ird: 1,
            ord: 1,
        };
        m.qp.connect(peer, &param).unwrap();
        let req = l.get_request(T).unwrap();
        assert_eq!(&req.private_data[..5], b"hello");
        l.reject(req.conn_id, b"go away").unwrap();
        let ev = m.qp.next_event(T).unwrap();
        assert_eq!(ev.kind, EventKind::Rejected);
        assert_eq!(&ev.private_data[..7], b"go away");

        // Accept, then disconnect from either side: both see Disconnected.
        for active_closes in [true, false] {
            let x = manual(&b, 64);
            x.qp.connect(peer, &param).unwrap();
            let req = l.get_request(T).unwrap();
            let y = manual(&a, 64);
            l.accept(
                req.conn_id,
                &y.qp,
                &ConnParam {
                    private_data: b"welcome".to_vec(),
                    ird: 1,
                    ord: 1,
                },
            )
            .unwrap();
            let ev = x.qp.next_event(T).unwrap();
            assert_eq!(ev.kind, EventKind::Established);
            assert_eq!(&ev.private_data[..7], b"welcome");
            assert_eq!(y.qp.next_event(T).unwrap().kind, EventKind::Established);
            let (closer, other) = if active_closes { (&x, &y) } else { (&y, &x) };
            closer.qp.disconnect(false).unwrap();
            assert_eq!(
                other.qp.next_event(T).unwrap().kind,
                EventKind::Disconnected
            );
            assert_eq!(
                closer.qp.next_event(T).unwrap().kind,
                EventKind::Disconnected
            );
            assert_eq!(other.qp.state().unwrap(), QpState::Error);
        }
    });
}

/// Embedded, a consumer polling a CQ receives the device's datagrams in its own thread;
/// through krdmad the device's receive thread does; a consumer that stops polling is
/// still served.
#[test]
fn polling_consumers_receive_in_their_own_thread() {
    each_front_door(|door| {
        polling_consumers_drive(door, "rxe0", "rx_packets_polled", "rx_packets")
    });
}

/// Embedded, the positive acknowledgement a polling consumer's delivery makes waits for
/// that consumer's next call, so the completion it polls for costs no `sendmsg` first:
/// it leaves with the reply the consumer posts next; if the consumer neither polls nor
/// posts again, the device's receive thread sends it once the consumer's drive window has
/// passed; with raw sockets (root) the two leave as one datagram. (Both QPs are on the
/// one embedded rxe0 here: its `tx_packets` counts both.)
#[test]
fn a_polling_receivers_acknowledgement_waits_for_its_next_call() {
    use krdma_tests::{counted, device_counter};
    let door = FrontDoor::Embedded;
    let (a, _b, s, c) = connected_pair(&door, "rxe0", 4096);
    let count = |name| device_counter(&a, "rxe0", name);
    let mut none = [ual::Cqe::default(); 1];
    // One round: a Send the server's poll receives. Whether its ACK is still held when
    // the poll returns (an empty poll marks the device driven, but the receive thread
    // may still be the one that took the datagram, or a lapsed window may have let it
    // send the ACK already): then only the client's Send was sent.
    let mut round = |i: u64| -> bool {
        let (tx, held) = (count("tx_packets"), count("acks_held"));
        s.post_recv(i, 0, 64).unwrap();
        assert_eq!(s.cq.poll(&mut none), 0);
        c.send(i, 0, 8, SIG).unwrap();
        assert_eq!(s.complete(1).unwrap()[0].wr_id, i);
        count("acks_held") > held && count("tx_packets") == tx + 1
    };
    let deadline = Instant::now() + T;
    let mut i = 0;
    // Nobody calls: the receive thread sends it, and the client's Send completes.
    while !round(i) {
        c.complete(1).unwrap();
        assert!(Instant::now() < deadline, "no acknowledgement held back");
        i += 1;
    }
    let tx = count("tx_packets");
    counted(&a, "rxe0", "tx_packets", tx);
    assert_eq!(c.complete(1).unwrap()[0].wr_id, i);
    // The server replies: its held ACK leaves with the reply, in the same call.
    c.post_recv(u64::MAX, 0, 64).unwrap();
    loop {
        i += 1;
        if round(i) {
            break;
        }
        c.complete(1).unwrap();
        assert!(Instant::now() < deadline, "no acknowledgement held back");
    }
    let (tx, riding) = (count("tx_packets"), count("tx_gso_acks_riding"));
    s.send(i, 0, 8, SIG).unwrap();
    assert_eq!(count("tx_packets"), tx + 2, "the ACK went with the reply");
    if nix::unistd::geteuid().is_root() {
        // With raw sockets, in one datagram: the reply, and the ACK riding behind.
        assert_eq!(count("tx_gso_acks_riding"), riding + 1, "one datagram");
    } else {
        assert!(std::env::var_os("CI").is_none(), "CI runs this as root");
    }
    let mut got: Vec<_> = c.complete(2).unwrap().iter().map(|e| e.wr_id).collect();
    got.sort();
    assert_eq!(got, [i, u64::MAX]);
    assert_eq!(s.complete(1).unwrap()[0].wr_id, i);
}

/// Through krdmad, a message to a QP of this host is on the device's socket when the
/// sending doorbell thread's `sendmsg` returns, and that thread delivers it
/// (`rx_packets_here`) instead of leaving it for the receive thread's wake-up; every
/// message and acknowledgement still arrives, in order. Once a QP's doorbell has sent
/// here, its doorbells hush the receive thread's sleep on the socket, so those datagrams
/// do not also wake it (`rx_thread_wakeups`: a few at most, for the first message, not
/// one per datagram). Embedded, a consumer's post never receives (it may hold locks of
/// its own): its poll does.
#[test]
fn a_doorbell_thread_delivers_what_it_sent_to_this_host() {
    use krdma_tests::device_counter;
    each_front_door(|door| {
        let (a, _b, s, c) = connected_pair(door, "rxe0", 4096);
        let here = || device_counter(&a, "rxe0", "rx_packets_here");
        let wakeups = || device_counter(&a, "rxe0", "rx_thread_wakeups");
        let before = here();
        let woken_before = wakeups();
        for i in 0..200u64 {
            s.post_recv(i, 0, 64).unwrap();
            c.send(i, 0, 8, SIG).unwrap();
            assert_eq!(s.complete(1).unwrap()[0].wr_id, i);
            assert_eq!(c.complete(1).unwrap()[0].wr_id, i);
        }
        let got = here() - before;
        match door {
            FrontDoor::Embedded => assert_eq!(got, 0, "a post received"),
            FrontDoor::Daemon(_) => {
                assert!(got > 0, "no doorbell thread delivered");
                let woken = wakeups() - woken_before;
                assert!(
                    woken < 20,
                    "the receive thread was woken {woken} times for 400 datagrams"
                );
            }
        }
    });
}

/// UC through the connection manager, end to end: a UC QP's REQ (transport type UC) is
/// refused onto an RC QP and accepted onto a UC one, and the connection then carries a
/// multi-packet Send and an RDMA Write with immediate, byte-exact, with no
/// acknowledgement coming back (`acks_sent` stays put); a disconnect ends it both ways.
#[test]
fn uc_qps_connect_through_the_cm() {
    use krdma_tests::device_counter;
    each_front_door(|door| {
        let (a, b, l, peer) = listening(door);
        let param = ConnParam {
            private_data: b"uc".to_vec(),
            ird: 0,
            ord: 0,
        };
        let len = 16 * 1024;
        let x = manual_of(&b, len, ual::QpType::Uc);
        x.qp.connect(peer, &param).unwrap();
        let req = l.get_request(T).unwrap();
        let rc = manual(&a, 64);
        assert!(l.accept(req.conn_id, &rc.qp, &param).is_err(), "an RC QP");
        let y = manual_of(&a, len, ual::QpType::Uc);
        l.accept(req.conn_id, &y.qp, &param).unwrap();
        assert_eq!(x.qp.next_event(T).unwrap().kind, EventKind::Established);
        assert_eq!(y.qp.next_event(T).unwrap().kind, EventKind::Established);

        let acks = device_counter(&a, "rxe0", "acks_sent");
        let mut data = vec![0u8; len];
        fill_pattern(&mut data, 7);
        x.buf.write(0, &data);
        let half = (len / 2) as u32;
        y.qp.post_recv(&Wqe::recv(1, &[y.mr.sge(0, half)])).unwrap();
        y.qp.post_recv(&Wqe::recv(2, &[y.mr.sge(0, 0)])).unwrap();
        x.qp.post_send(&Wqe::new(10, WrOpcode::Send, &[x.mr.sge(0, half)]).with_flags(SIG))
            .unwrap();
        let w = Wqe::new(
            11,
            WrOpcode::RdmaWriteWithImm,
            &[x.mr.sge(half as u64, half)],
        )
        .with_remote(y.mr.addr + half as u64, y.mr.rkey)
        .with_imm(0x1234)
        .with_flags(SIG);
        x.qp.post_send(&w).unwrap();
        let sent: Vec<u64> = x.cq.wait(2, T).unwrap().iter().map(|c| c.wr_id).collect();
        assert_eq!(sent, [10, 11]);
        let got = y.cq.wait(2, T).unwrap();
        assert_eq!((got[0].wr_id, got[0].byte_len), (1, half));
        assert_eq!((got[1].wr_id, got[1].imm_or_inv), (2, 0x1234));
        assert_eq!(y.buf.to_vec(), data, "Send and Write placed");
        assert_eq!(
            device_counter(&a, "rxe0", "acks_sent"),
            acks,
            "UC acknowledges nothing"
        );

        x.qp.disconnect(false).unwrap();
        assert_eq!(y.qp.next_event(T).unwrap().kind, EventKind::Disconnected);
        assert_eq!(x.qp.next_event(T).unwrap().kind, EventKind::Disconnected);
    });
}
