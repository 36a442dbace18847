//! The conformance suite: what a verbs consumer may rely on from every device, whatever
//! its transport, through both kAL front doors — byte-exact Send, RDMA Write and Read
//! (zero bytes to 1 GiB), solicited events and CQ notification, context isolation,
//! hundreds of connections, disconnect flushing both sides. Each test runs once per device
//! in [`for_each_device!`]; a provider author adds the new device's name there. What only
//! one transport has (MPA, Terminate, the IB CM, RNR, atomics, PSN wrap) stays in that
//! transport's own files (`siw_*`, `rxe_*`).

use krdma_tests::{connected_pair, crc, each_front_door, fill_endpoint as fill, FrontDoor};
use std::sync::Arc;
use std::time::Duration;
use tools::perf::{connect_pair, Endpoint};
use ual::{
    send_flags, wc_flags, Context, EventKind, Sge, VerbsError, WcOpcode, WcStatus, Wqe, WrOpcode,
};

const SIG: u8 = send_flags::SIGNALED;

/// One test per (device, test): `conformance::siw0::zero_byte_operations`, ...
macro_rules! for_each_device {
    ($($dev:ident),+ => $tests:tt) => {
        $(for_each_device!(@one $dev $tests);)+
    };
    (@one $dev:ident [$($test:ident),* $(,)?]) => {
        mod $dev {
            $(
                #[test]
                fn $test() {
                    super::$test(stringify!($dev))
                }
            )*
        }
    };
}

for_each_device!(siw0, rxe0 => [
    send_write_read_are_byte_exact,
    zero_byte_operations,
    solicited_event_and_cq_notification,
    a_sleeper_is_woken_through_the_ring_not_the_event_queue,
    one_gib_write_is_byte_exact,
    foreign_handle_guesses_never_touch_another_context,
    many_concurrent_qps,
    disconnect_flushes_and_notifies_both_sides,
    a_delivered_send_survives_the_receivers_close,
    a_send_stream_longer_than_the_receive_queue,
]);

fn pair(
    door: &FrontDoor,
    dev: &str,
    len: usize,
) -> (Arc<Context>, Arc<Context>, Endpoint, Endpoint) {
    connected_pair(door, dev, len)
}

fn send_write_read_are_byte_exact(dev: &str) {
    each_front_door(|door| {
        let len = 1 << 20;
        let (_a, _b, s, c) = pair(door, dev, len);
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

fn zero_byte_operations(dev: &str) {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, dev, 4096);
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

fn solicited_event_and_cq_notification(dev: &str) {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, dev, 4096);
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

/// `Cq::arm_to_sleep` + `Cq::sleep`: the engine wakes the sleeper through the futex
/// word in the ring's header (counted there) and makes no `CqNotify` event; a
/// solicited-only arm lets an unsolicited completion by.
fn a_sleeper_is_woken_through_the_ring_not_the_event_queue(dev: &str) {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, dev, 4096);
        let mem = s.cq.ring_memory().expect("a device with shared rings");
        let wake = rnicpi::Ring::<ual::Cqe>::attach(mem, 0, 1)
            .unwrap()
            .consumer()
            .wake_word();
        let mut out = [ual::Cqe::default(); 4];
        // Sleep until a completion is there; the wake-up may trail it by a moment.
        let sleep_for_one = |armed| {
            let mut got = [ual::Cqe::default(); 4];
            loop {
                match s.cq.poll(&mut got) {
                    0 => s.cq.sleep(armed, Duration::from_secs(10)).unwrap(),
                    1 => return got[0],
                    n => panic!("{n} completions"),
                }
            }
        };
        let woken = |count| {
            let t = std::time::Instant::now();
            while wake.count() != count && t.elapsed() < Duration::from_secs(10) {
                std::thread::yield_now();
            }
            wake.count() == count
        };
        for i in 0..3 {
            s.post_recv(i, 0, 64).unwrap();
        }

        let before = wake.count();
        let armed = s.cq.arm_to_sleep(false);
        assert_eq!(s.cq.poll(&mut out), 0);
        c.send(10, 0, 8, SIG).unwrap();
        assert_eq!(sleep_for_one(armed).wr_id, 0);
        assert!(
            woken(before.wrapping_add(1)),
            "one wake-up for the completion"
        );

        // Solicited only: the unsolicited Send completes unannounced…
        let before = wake.count();
        let armed = s.cq.arm_to_sleep(true);
        c.send(11, 0, 8, SIG).unwrap();
        while s.cq.poll(&mut out) == 0 {
            std::thread::yield_now();
        }
        assert_eq!(
            wake.count(),
            before,
            "no wake-up for an unsolicited completion"
        );
        // …the solicited one wakes the sleeper.
        c.send(12, 0, 8, SIG | send_flags::SOLICITED).unwrap();
        assert_ne!(sleep_for_one(armed).flags & wc_flags::SOLICITED, 0);
        assert!(woken(before.wrapping_add(1)));

        assert!(
            s.cq.events().try_recv().is_err(),
            "a sleeper's notification is no CqNotify event"
        );
        c.complete(3).unwrap();
    });
}

fn one_gib_write_is_byte_exact(dev: &str) {
    each_front_door(|door| {
        let len = 1usize << 30;
        let (_a, _b, s, c) = pair(door, dev, len);
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

/// The bandwidth run `krdma demo` makes, with eight times more Sends than the receive
/// queue holds: the receiver keeps its queue topped up as Sends land (it used to post
/// every receive first, failed past the queue's depth, and left the sender waiting).
fn a_send_stream_longer_than_the_receive_queue(dev: &str) {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let (s, c) = connect_pair(&a, &b, dev, 4096, 8).expect("connect");
        let rate = tools::perf::bandwidth(&s, &c, tools::perf::Op::Send, 4096, 64 * 4096, 4)
            .expect("64 Sends through an 8-deep receive queue");
        assert!(rate > 0.0);
    });
}

fn foreign_handle_guesses_never_touch_another_context(dev: &str) {
    each_front_door(|door| {
        let a = door.open();
        let b = door.open();
        let dev = a.device(dev).unwrap().index;
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

fn many_concurrent_qps(dev: &str) {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let n = 500; // 500 connections = 1,000 QPs in one kAL
        let mut pairs = Vec::new();
        for _ in 0..n {
            pairs.push(connect_pair(&a, &b, dev, 64, 4).expect("connect"));
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

/// A receiver that closes abruptly the moment its receive completes (dapltest's
/// performance server does) must not make the sender's Send fail: the message arrived,
/// so what acknowledges it goes out ahead of the close. The two ends are on separate
/// instances of the device (this process's embedded one and the daemon's), each with its
/// own threads, as two processes are; the race is run many times, since its window is
/// one `sendmsg` wide.
fn a_delivered_send_survives_the_receivers_close(dev: &str) {
    if !krdma_tests::daemon_possible() {
        return;
    }
    let daemon = FrontDoor::Daemon(krdma_tests::Daemon::start());
    let (d, e) = (daemon.open(), FrontDoor::Embedded.open());
    for (receiver, sender, how) in [
        (&d, &e, "daemon <- embedded"),
        (&e, &d, "embedded <- daemon"),
    ] {
        for round in 0..100u32 {
            let (s, c) = connect_pair(receiver, sender, dev, 4096, 16)
                .unwrap_or_else(|e| panic!("{how}: connect over {dev}: {e:?}"));
            s.post_recv(1, 0, 64).unwrap();
            c.send(2, 0, 64, SIG).unwrap();
            let got = s.cq.wait(1, Duration::from_secs(10)).unwrap();
            assert_eq!(got[0].status(), WcStatus::Success);
            s.qp.disconnect(true).unwrap();
            let sent = c.cq.wait(1, Duration::from_secs(10)).unwrap();
            assert_eq!(
                sent[0].status(),
                WcStatus::Success,
                "{how}, round {round}: the delivered Send completed as {:?}",
                sent[0].status()
            );
        }
    }
}

fn disconnect_flushes_and_notifies_both_sides(dev: &str) {
    each_front_door(|door| {
        let (_a, _b, s, c) = pair(door, dev, 4096);
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
        // Receives posted now complete flushed at once: in Error the engine asks for a
        // doorbell per receive, which it otherwise does without.
        for (ep, id) in [(&s, 3), (&c, 4)] {
            ep.post_recv(id, 0, 64).unwrap();
            let done = ep.cq.wait(1, Duration::from_secs(10)).unwrap();
            assert_eq!(
                (done[0].wr_id, done[0].status()),
                (id, WcStatus::WrFlushErr)
            );
        }
    });
}
