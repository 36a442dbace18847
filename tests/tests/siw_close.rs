//! How a siw connection ends, as the peer sees it, through both front doors: an abortive
//! close (DISCONNECT abortive, or destroying a connected QP) reaches the peer as a reset
//! (`ConnectionBroken`, its outstanding work flushed), an orderly one as a FIN
//! (`Disconnected`); a QP whose CQ overflows goes to Error with `QpFatal` and a
//! Terminate. A bystander tenant is served throughout.

use krdma_tests::{connected_pair, each_front_door, Bystander};
use std::time::{Duration, Instant};
use tools::perf::Endpoint;
use ual::{send_flags, EventKind, QpState, VerbsError, WcStatus};

const BYSTANDER_BOUND: Duration = Duration::from_secs(2);

/// The first event that ends `ep`'s connection.
fn connection_end(ep: &Endpoint) -> EventKind {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = ep
            .qp
            .next_event(left)
            .expect("the connection ends within 10 s");
        if matches!(
            ev.kind,
            EventKind::Disconnected | EventKind::ConnectionBroken
        ) {
            return ev.kind;
        }
    }
}

/// The receive `ep` posted completes flushed.
fn flushed(ep: &Endpoint) {
    let c = ep
        .cq
        .wait(1, Duration::from_secs(10))
        .expect("a flushed receive");
    assert_eq!((c[0].wr_id, c[0].status()), (9, WcStatus::WrFlushErr));
}

#[test]
fn abortive_disconnect_reaches_the_peer_as_a_reset() {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (_a, _b, s, c) = connected_pair(door, "siw0", 4096);
        s.post_recv(9, 0, 64).unwrap();
        c.qp.disconnect(true).unwrap();
        assert_eq!(connection_end(&s), EventKind::ConnectionBroken);
        flushed(&s);
        assert_eq!(
            connection_end(&c),
            EventKind::Disconnected,
            "it asked for it"
        );
        by.finish().assert_served(BYSTANDER_BOUND);
    });
}

#[test]
fn destroying_a_connected_qp_reaches_the_peer_as_a_reset() {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (_a, _b, s, c) = connected_pair(door, "siw0", 4096);
        s.post_recv(9, 0, 64).unwrap();
        drop(c); // DESTROY_QP (and the rest of the endpoint)
        assert_eq!(connection_end(&s), EventKind::ConnectionBroken);
        flushed(&s);
        by.finish().assert_served(BYSTANDER_BOUND);
    });
}

#[test]
fn orderly_disconnect_reaches_the_peer_as_a_fin() {
    each_front_door(|door| {
        let (_a, _b, s, c) = connected_pair(door, "siw0", 4096);
        s.post_recv(9, 0, 64).unwrap();
        c.qp.disconnect(false).unwrap();
        assert_eq!(connection_end(&s), EventKind::Disconnected);
        flushed(&s);
        assert_eq!(connection_end(&c), EventKind::Disconnected);
    });
}

fn cq_overflows(ctx: &ual::Context) -> u64 {
    let dev = ctx.device("siw0").unwrap().index;
    ctx.stat_device(dev)
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == "cq_overflows")
        .map(|(_, n)| n)
        .unwrap()
}

#[test]
fn cq_overflow_moves_the_qp_to_error() {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        // Send and receive queues of 8, a CQ of 8 * 2 + 8 = 24 (32 slots in the ring).
        let (a, b) = (door.open(), door.open());
        let (s, c) = tools::perf::connect_pair(&a, &b, "siw0", 4096, 8).expect("connect");
        let before = cq_overflows(&a);
        // Signaled RDMA Writes, never polled: the 33rd completion finds no room.
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut posted = 0;
        while s.qp.state().unwrap() != QpState::Error {
            assert!(
                Instant::now() < deadline,
                "no overflow after {posted} writes"
            );
            match s.write(posted, 0, 8, 0, send_flags::SIGNALED) {
                Ok(()) => posted += 1,
                Err(VerbsError::QueueFull) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => panic!("post: {e:?}"),
            }
        }
        assert!(posted >= 32, "error after only {posted} writes");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if s.qp.next_event(left).expect("QpFatal").kind == EventKind::QpFatal {
                break;
            }
        }
        assert!(cq_overflows(&a) > before, "the lost completion is counted");
        // The peer hears of it: a Terminate, then the end of the connection.
        assert_eq!(connection_end(&c), EventKind::ConnectionBroken);
        by.finish().assert_served(BYSTANDER_BOUND);
    });
}
