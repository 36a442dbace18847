//! What is iWARP's own in siw0, end to end on loopback through both kAL front doors (real
//! TCP, MPA/DDP/RDMAP, shared rings): its transport and port as listed, and Send with
//! Invalidate ending any STag. What every device does is in `conformance.rs`.

use krdma_tests::{connected_pair, each_front_door, polling_consumers_drive, FrontDoor};
use std::sync::Arc;
use std::time::Duration;
use tools::perf::Endpoint;
use ual::{send_flags, wc_flags, Access, Context, WcStatus, Wqe, WrOpcode};

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

/// Embedded, a consumer polling its CQ reads the QP's stream in its own thread; through
/// krdmad the engine's threads read; a consumer that stops polling is still served.
#[test]
fn polling_consumers_read_the_stream_in_their_own_thread() {
    each_front_door(|door| polling_consumers_drive(door, "siw0", "rx_reads_polled", "rx_fpdus"));
}
