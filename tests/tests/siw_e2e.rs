//! End-to-end over siw on loopback, through both kAL front doors: real TCP, real MPA/DDP/
//! RDMAP, real shared rings, byte-exact data.

use krdma_tests::{connected_pair, crc, each_front_door, fill_endpoint as fill, FrontDoor};
use std::sync::Arc;
use std::time::Duration;
use tools::perf::{connect_pair, Endpoint};
use ual::{
    send_flags, wc_flags, Access, Context, EventKind, Sge, VerbsError, WcOpcode, WcStatus, Wqe,
    WrOpcode,
};

const SIG: u8 = send_flags::SIGNALED;

fn pair(door: &FrontDoor, len: usize) -> (Arc<Context>, Arc<Context>, Endpoint, Endpoint) {
    connected_pair(door, "siw0", len)
}

#[test]
fn devices_are_listed() {
    each_front_door(|door| {
        let ctx = door.open();
        let d = ctx.device("siw0").expect("siw0 registered");
        assert_eq!(d.transport, ual::Transport::Iwarp);
        let p = ctx.query_port(d.index, 1).unwrap();
        assert_eq!(p.state, rnicpi::PortState::Active);
        assert!(!p.gids.is_empty());
    });
}

#[test]
fn send_write_read_are_byte_exact() {
    each_front_door(|door| {
        let len = 1 << 20;
        let (_a, _b, s, c) = pair(door, len);
        let want = fill(&c, 1);

        // Send / Recv with immediate placement into the posted buffer.
        s.post_recv(1, 0, len as u32).unwrap();
        c.send(2, 0, len as u32, SIG).unwrap();
        let rc = s.complete(1).unwrap();
        assert_eq!(rc[0].opcode(), Some(WcOpcode::Recv));
        assert_eq!(rc[0].byte_len, len as u32);
        assert_eq!(crc(&s.buf.to_vec()), want, "send payload");
        assert_eq!(c.complete(1).unwrap()[0].opcode(), Some(WcOpcode::Send));

        // RDMA Write into the server's buffer.
        s.buf.fill(0);
        let want = fill(&c, 2);
        c.write(3, 0, len as u32, 0, SIG).unwrap();
        c.complete(1).unwrap();
        // Ordering: a Send after the Write arrives after the Write is placed.
        s.post_recv(4, 0, 0).unwrap();
        c.send(5, 0, 0, SIG).unwrap();
        s.complete(1).unwrap();
        c.complete(1).unwrap();
        assert_eq!(crc(&s.buf.to_vec()), want, "write payload");

        // RDMA Read back from the server into a cleared client buffer.
        let want = fill(&s, 3);
        c.buf.fill(0);
        c.read(6, 0, len as u32, 0).unwrap();
        let rc = c.complete(1).unwrap();
        assert_eq!(rc[0].opcode(), Some(WcOpcode::RdmaRead));
        assert_eq!(crc(&c.buf.to_vec()), want, "read payload");
    });
}

#[test]
fn zero_byte_operations() {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, 4096);
        s.post_recv(1, 0, 0).unwrap();
        c.send(2, 0, 0, SIG).unwrap();
        assert_eq!(s.complete(1).unwrap()[0].byte_len, 0);
        c.complete(1).unwrap();
        c.write(3, 0, 0, 0, SIG).unwrap();
        c.complete(1).unwrap();
        c.read(4, 0, 0, 0).unwrap();
        c.complete(1).unwrap();
    });
}

#[test]
fn solicited_event_and_cq_notification() {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, 4096);
        s.post_recv(1, 0, 64).unwrap();
        s.post_recv(2, 0, 64).unwrap();
        s.cq.arm(true);
        // An unsolicited send must not fire a solicited-only arm…
        c.send(10, 0, 8, SIG).unwrap();
        c.complete(1).unwrap();
        let first = s.cq.wait(1, Duration::from_secs(10)).unwrap();
        assert_eq!(first[0].flags & wc_flags::SOLICITED, 0);
        assert!(
            s.cq.events()
                .recv_timeout(Duration::from_millis(300))
                .is_err(),
            "no notify for unsolicited"
        );
        // …a solicited one must.
        s.cq.arm(true);
        c.send(11, 0, 8, SIG | send_flags::SOLICITED).unwrap();
        let ev =
            s.cq.events()
                .recv_timeout(Duration::from_secs(10))
                .expect("CQ notification");
        assert_eq!(ev.kind, EventKind::CqNotify);
        let mut out = [ual::Cqe::default(); 4];
        assert_eq!(s.cq.poll(&mut out), 1);
        assert_ne!(out[0].flags & wc_flags::SOLICITED, 0);
    });
}

#[test]
fn send_with_invalidate_invalidates_the_stag() {
    each_front_door(|door| {
        let (a, _b, s, c) = pair(door, 4096);
        // A second registration on the server that the client will invalidate.
        let extra = ual::RegBuf::new(4096).unwrap();
        let mr = a
            .reg_buf(&s.pd, &extra, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        s.post_recv(1, 0, 64).unwrap();
        let w = Wqe::new(2, WrOpcode::SendWithInv, &[c.mr.sge(0, 16)])
            .with_imm(mr.rkey)
            .with_flags(SIG);
        c.qp.post_send(&w).unwrap();
        c.complete(1).unwrap();
        let rc = s.complete(1).unwrap();
        assert_ne!(rc[0].flags & wc_flags::WITH_INV, 0);
        assert_eq!(rc[0].imm_or_inv, mr.rkey);
        // A write to the invalidated STag now fails: the client's QP gets an error.
        let w = Wqe::new(3, WrOpcode::RdmaWrite, &[c.mr.sge(0, 16)])
            .with_remote(mr.addr, mr.rkey)
            .with_flags(SIG);
        c.qp.post_send(&w).unwrap();
        // The write itself is handed to TCP; the peer answers with a Terminate that moves
        // our QP to Error: a later receive completes flushed or in error.
        c.post_recv(4, 0, 16).unwrap();
        let cs = c.cq.wait(2, Duration::from_secs(10)).unwrap();
        assert!(
            cs.iter().any(|x| x.status() != WcStatus::Success),
            "access to an invalidated STag must fail: {cs:?}"
        );
    });
}

#[test]
fn one_gib_write_is_byte_exact() {
    each_front_door(|door| {
        let len = 1usize << 30;
        let (_a, _b, s, c) = pair(door, len);
        let want = fill(&c, 7);
        let w = Wqe::new(
            1,
            WrOpcode::RdmaWrite,
            &[Sge {
                addr: c.mr.addr,
                length: len as u32,
                lkey: c.mr.lkey,
            }],
        )
        .with_remote(c.remote.0, c.remote.1)
        .with_flags(SIG);
        c.qp.post_send(&w).unwrap();
        c.complete(1).unwrap();
        s.post_recv(2, 0, 0).unwrap();
        c.send(3, 0, 0, SIG).unwrap();
        s.complete(1).unwrap();
        assert_eq!(crc(&s.buf.to_vec()), want);
    });
}

#[test]
fn foreign_handle_guesses_never_touch_another_context() {
    each_front_door(|door| {
        let a = door.open();
        let b = door.open();
        let dev = a.device("siw0").unwrap().index;
        let pd = a.alloc_pd(dev).unwrap();
        let cq = a.create_cq(dev, 16).unwrap();
        // b owns nothing: every guess must fail with NoSuchResource.
        for h in 0..512u32 {
            let mut d = ual::abi::Destroy { handle: h, _pad: 0 };
            assert_eq!(
                b.channel().call(ual::abi::cmd::DEALLOC_PD, &mut d),
                Err(VerbsError::NoSuchResource)
            );
            assert_eq!(
                b.channel().call(ual::abi::cmd::DESTROY_CQ, &mut d),
                Err(VerbsError::NoSuchResource)
            );
        }
        let (_, rows) = a.stat_contexts().unwrap();
        let mine = rows.iter().find(|r| r.id == a.id()).unwrap();
        assert_eq!(
            (mine.pds, mine.cqs),
            (1, 1),
            "a's objects survive b's guesses"
        );
        drop((cq, pd));
    });
}

#[test]
fn many_concurrent_qps() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let n = 500; // 500 connections = 1,000 QPs in one kAL
        let mut pairs = Vec::new();
        for _ in 0..n {
            pairs.push(connect_pair(&a, &b, "siw0", 64, 4).expect("connect"));
        }
        for (i, (s, c)) in pairs.iter().enumerate() {
            s.post_recv(i as u64, 0, 8).unwrap();
            c.buf.write(0, &(i as u64).to_le_bytes());
            c.send(i as u64, 0, 8, SIG).unwrap();
        }
        for (i, (s, c)) in pairs.iter().enumerate() {
            s.complete(1).unwrap();
            c.complete(1).unwrap();
            let mut got = [0u8; 8];
            s.buf.read(0, &mut got);
            assert_eq!(got, (i as u64).to_le_bytes());
        }
        let (_, rows) = a.stat_contexts().unwrap();
        let qps: u32 = rows
            .iter()
            .filter(|r| r.id == a.id() || r.id == b.id())
            .map(|r| r.qps)
            .sum();
        assert_eq!(qps, 2 * n as u32);
    });
}

#[test]
fn disconnect_flushes_and_notifies_both_sides() {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, 4096);
        s.post_recv(1, 0, 64).unwrap();
        c.post_recv(2, 0, 64).unwrap();
        c.qp.disconnect(false).unwrap();
        let ev = s.qp.next_event(Duration::from_secs(10)).unwrap();
        assert!(
            matches!(
                ev.kind,
                EventKind::Disconnected | EventKind::ConnectionBroken
            ),
            "{ev:?}"
        );
        let sc = s.cq.wait(1, Duration::from_secs(10)).unwrap();
        assert_eq!(sc[0].status(), WcStatus::WrFlushErr);
        let cc = c.cq.wait(1, Duration::from_secs(10)).unwrap();
        assert_eq!(cc[0].status(), WcStatus::WrFlushErr);
    });
}
