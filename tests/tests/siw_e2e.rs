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

/// Large payloads go out from the registration in place (`siw::qp::batch`: no copy into
/// a buffer of the engine's before the socket's, even when the socket is full), byte for
/// byte, for RDMA Write, Send (into a receive of two elements) and RDMA Read Responses;
/// through krdmad too, where the buffers are the sealed memfds the daemon maps.
#[test]
fn large_payloads_go_out_in_place() {
    use krdma_tests::{device_counter, fill_pattern};
    const MSG: usize = 3 << 20;
    each_front_door(|door| {
        let (a, _b, s, c) = pair(door, 2 * MSG);
        let lent0 = device_counter(&a, "siw0", "tx_bytes_lent");
        let copied0 = device_counter(&a, "siw0", "tx_bytes_lent_copied");
        let mut pattern = vec![0u8; MSG];
        let check = |ep: &Endpoint, off: usize, seed: u32, what: &str| {
            let mut want = vec![0u8; MSG];
            fill_pattern(&mut want, seed);
            let mut got = vec![0u8; MSG];
            ep.buf.read(off, &mut got);
            assert!(got == want, "{what}: the payload arrived changed");
        };
        // RDMA Write, client -> server.
        fill_pattern(&mut pattern, 1);
        c.buf.write(0, &pattern);
        c.write(1, 0, MSG as u32, 0, SIG).unwrap();
        c.complete(1).unwrap();
        // A Send ordered behind the Write tells the server it has landed.
        fill_pattern(&mut pattern, 2);
        c.buf.write(MSG, &pattern);
        let part = (MSG / 3) as u32; // a piece boundary inside an FPDU
        let sges = [
            s.mr.sge(MSG as u64, part),
            s.mr.sge(MSG as u64 + part as u64, MSG as u32 - part),
        ];
        s.qp.post_recv(&Wqe::recv(2, &sges)).unwrap();
        c.send(3, MSG as u64, MSG as u32, SIG).unwrap();
        c.complete(1).unwrap();
        assert_eq!(s.complete(1).unwrap()[0].byte_len, MSG as u32);
        check(&s, 0, 1, "RDMA Write");
        check(&s, MSG, 2, "Send");
        // RDMA Read, server -> client, into the client's second half.
        fill_pattern(&mut pattern, 3);
        s.buf.write(0, &pattern);
        c.read(4, MSG as u64, MSG as u32, 0).unwrap();
        c.complete(1).unwrap();
        check(&c, MSG, 3, "RDMA Read");
        // The three messages went out in place but for FPDUs under 4 KiB (a message's
        // last).
        let lent = device_counter(&a, "siw0", "tx_bytes_lent") - lent0;
        assert!(
            lent >= 3 * MSG as u64 - 3 * 4096,
            "sent in place: {lent} of {}",
            3 * MSG
        );
        // A full socket is waited for, never a reason to copy a lent payload out.
        let copied = device_counter(&a, "siw0", "tx_bytes_lent_copied") - copied0;
        assert_eq!(copied, 0, "lent bytes copied out over a socket");
    });
}
