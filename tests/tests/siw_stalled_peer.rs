//! A siw peer that completes MPA and then never reads (audit H1, trigger B): the victim
//! posts far more Sends than the socket buffers hold. The doorbell never waits for the
//! socket — a post returns at once in embedded mode (where the doorbell transmits in the
//! caller's thread), and in daemon mode the shared doorbell reactor keeps serving every
//! other QP — so the stalled peer costs only its own QP: a bystander tenant stays served
//! and the daemon's control path answers; and the Sends' payloads, which go out from the
//! registration in place (`siw::qp::batch`), never hold it while the socket is full: the
//! victim deregisters it at once. Both front doors.

use krdma_tests::raw_siw::RawSiwPeer;
use krdma_tests::{each_front_door, Bystander, FrontDoor};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{
    send_flags, Access, ConnParam, EventKind, Mr, QpCaps, QpConfig, RegBuf, VerbsError, Wqe,
    WrOpcode,
};

const MSG: usize = 16 * 1024;
/// 16 MiB in all: more than the loopback socket buffers of both ends can take.
const SENDS: usize = 1000;
/// The promise under test.
const BOUND: Duration = Duration::from_secs(2);

/// How long the slowest `post_send` took, and how many went in, posting `SENDS` Sends
/// to a peer that reads nothing (stopping once the send queue stays full); the Sends'
/// registration; and the victim's other objects and the peer, kept until the test is done.
fn flood(door: &FrontDoor) -> (Duration, usize, Arc<Mr>, impl Sized) {
    let ctx = door.open();
    let dev = ctx.device("siw0").unwrap().index;
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 2 * SENDS as u32).unwrap();
    let caps = QpCaps {
        max_send_wr: 256,
        max_recv_wr: 4,
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
    let buf = RegBuf::new(MSG).unwrap();
    let mr = ctx.reg_buf(&pd, &buf, Access::LOCAL_WRITE).unwrap();
    let listener = ctx.listen(dev, "127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let at = SocketAddr::from(([127, 0, 0, 1], listener.port));
    let t = std::thread::spawn(move || RawSiwPeer::connect(at, false, 4, 2));
    let req = listener.get_request(Duration::from_secs(10)).unwrap();
    let param = ConnParam {
        private_data: vec![],
        ird: 4,
        ord: 4,
    };
    listener.accept(req.conn_id, &qp, &param).unwrap();
    assert_eq!(
        qp.next_event(Duration::from_secs(10)).unwrap().kind,
        EventKind::Established
    );
    let peer = t.join().unwrap(); // from here on it reads nothing

    let mut slowest = Duration::ZERO;
    let mut posted = 0;
    let mut full_since: Option<Instant> = None;
    while posted < SENDS {
        let w = Wqe::new(posted as u64, WrOpcode::Send, &[mr.sge(0, MSG as u32)])
            .with_flags(send_flags::SIGNALED);
        let t0 = Instant::now();
        let r = qp.post_send(&w);
        slowest = slowest.max(t0.elapsed());
        match r {
            Ok(()) => {
                posted += 1;
                full_since = None;
            }
            Err(VerbsError::QueueFull) => {
                // The engine has stopped taking requests: the peer's window is shut.
                if full_since.get_or_insert_with(Instant::now).elapsed()
                    > Duration::from_millis(500)
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("post_send: {e:?}"),
        }
    }
    (slowest, posted, mr, (peer, qp, cq, buf, listener, pd, ctx))
}

#[test]
fn a_peer_that_stops_reading_costs_only_its_own_qp() {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (slowest, posted, mr, victim) = flood(door);
        eprintln!(
            "{}: {posted} Sends of 16 KiB posted, slowest post {slowest:?}",
            door.name()
        );
        assert!(slowest < BOUND, "a post waited {slowest:?} for the socket");
        assert!(
            posted < SENDS,
            "the peer's stall never stopped the send queue: nothing was tested"
        );
        // The control path answers meanwhile (in daemon mode, the same daemon).
        let t0 = Instant::now();
        let other = door.open();
        let dev = other.device("siw0").unwrap().index;
        other.alloc_pd(dev).unwrap();
        assert!(t0.elapsed() < BOUND, "control path took {:?}", t0.elapsed());
        // The transmitter waits for the socket with no lease on the payload's memory.
        let t0 = Instant::now();
        drop(mr);
        assert!(
            t0.elapsed() < BOUND,
            "deregistration took {:?}",
            t0.elapsed()
        );
        by.finish().assert_served(BOUND);
        drop(victim);
    });
}
