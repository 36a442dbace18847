//! A hostile iWARP peer: a raw TCP client that speaks MPA itself and then sends malformed
//! FPDUs to a krdma QP. Each attack must end with the Terminate message RFC 5040/5041/5044
//! (and Linux kernel siw) prescribe, the QP in Error with its posted receive flushed and an
//! async event, not one byte outside the registration changed, and a bystander tenant in
//! contexts of its own served throughout. Both kAL front doors.

use krdma_tests::raw_siw::RawSiwPeer as Attacker;
use krdma_tests::{each_front_door, Bystander, FrontDoor};
use siw::wire::{self, term, Header, Model, Opcode, ReadRequest, TermCode};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{
    Access, ConnParam, Context, EventKind, QpAttr, QpAttrMask, QpCaps, QpConfig, RegBuf, WcStatus,
    Wqe, WrOpcode,
};

const GUARD: u8 = 0xAA;
/// The registration sits inside a larger buffer: [REG_OFF, REG_OFF + REG_LEN).
const BUF_LEN: usize = 3 * 4096;
const REG_OFF: usize = 4096 + 100;
const REG_LEN: usize = 1000;
/// A second registration in the same buffer with local write only (receive buffers,
/// Read sinks): [LOCAL_OFF, LOCAL_OFF + REG_LEN). No attack may change a byte of it.
const LOCAL_OFF: usize = 2 * 4096 + 100;
/// How long a round trip of the bystander tenant may take while a peer attacks.
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);
/// A second, large registration for the IRD test.
/// Larger than a loopback TCP send buffer can grow (tcp_wmem max 4 MiB) plus the
/// attacker's unread receive buffer.
const BIG_LEN: usize = 6 << 20;

/// The krdma side of one attacked connection.
struct Victim {
    ctx: Arc<Context>,
    qp: Arc<ual::Qp>,
    cq: Arc<ual::Cq>,
    buf: Arc<RegBuf>,
    stag: u32,
    addr: u64,
    /// The local-write-only registration.
    local_stag: u32,
    local_addr: u64,
    big_stag: u32,
    big_addr: u64,
    _keep: Keep,
}

/// Objects the victim holds only to keep them alive.
type Keep = (
    Arc<ual::Pd>,
    [Arc<ual::Mr>; 3],
    Arc<RegBuf>,
    Arc<ual::Listener>,
);

fn setup(door: &FrontDoor, crc: bool, ird: u16) -> (Victim, Attacker) {
    setup_rev(door, crc, ird, 2)
}

fn setup_rev(door: &FrontDoor, crc: bool, ird: u16, revision: u8) -> (Victim, Attacker) {
    let ctx = door.open();
    let dev = ctx.device("siw0").unwrap().index;
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 64).unwrap();
    let qp = ctx
        .create_qp(
            &pd,
            &cq,
            &cq,
            QpConfig {
                caps: QpCaps {
                    max_send_wr: 16,
                    max_recv_wr: 16,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline: 0,
                },
                ..Default::default()
            },
        )
        .unwrap();
    let buf = RegBuf::new(BUF_LEN).unwrap();
    buf.fill(GUARD);
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let addr = buf.as_ptr() as u64 + REG_OFF as u64;
    // SAFETY: both ranges lie inside `buf`, which the returned victim keeps with the MRs.
    let mr = unsafe { ctx.reg_mr(&pd, addr as *const u8, REG_LEN, all) }.unwrap();
    let local_addr = buf.as_ptr() as u64 + LOCAL_OFF as u64;
    // SAFETY: as above.
    let local =
        unsafe { ctx.reg_mr(&pd, local_addr as *const u8, REG_LEN, Access::LOCAL_WRITE) }.unwrap();
    let big = RegBuf::new(BIG_LEN).unwrap();
    let big_mr = ctx.reg_buf(&pd, &big, all).unwrap();
    // A receive the attack must flush.
    qp.post_recv(&Wqe::recv(77, &[mr.sge(0, 16)])).unwrap();

    let listener = ctx.listen(dev, "127.0.0.1:0".parse().unwrap(), 4).unwrap();
    let port = listener.port;
    let peer = SocketAddr::from(([127, 0, 0, 1], port));
    let t = std::thread::spawn(move || Attacker::connect(peer, crc, ird, revision));
    let req = listener.get_request(Duration::from_secs(10)).unwrap();
    assert_eq!(req.kind, EventKind::ConnectRequest);
    listener
        .accept(
            req.conn_id,
            &qp,
            &ConnParam {
                private_data: vec![],
                ird: ird as u32,
                ord: 1,
            },
        )
        .unwrap();
    let ev = qp.next_event(Duration::from_secs(10)).unwrap();
    assert_eq!(ev.kind, EventKind::Established);
    let att = t.join().unwrap();
    let v = Victim {
        ctx,
        qp,
        cq,
        buf,
        stag: mr.rkey,
        addr,
        local_stag: local.rkey,
        local_addr,
        big_stag: big_mr.rkey,
        big_addr: big.as_ptr() as u64,
        _keep: (pd, [mr, local, big_mr], big, listener),
    };
    (v, att)
}

fn send_hdr(msn: u32) -> Header {
    Header {
        opcode: Opcode::Send,
        last: true,
        model: Model::Untagged {
            inv_stag: 0,
            qn: wire::QN_SEND,
            msn,
            mo: 0,
        },
    }
}

fn read_hdr(msn: u32) -> Header {
    Header {
        opcode: Opcode::ReadRequest,
        last: true,
        model: Model::Untagged {
            inv_stag: 0,
            qn: wire::QN_READ,
            msn,
            mo: 0,
        },
    }
}

fn write_hdr(stag: u32, to: u64) -> Header {
    Header {
        opcode: Opcode::Write,
        last: true,
        model: Model::Tagged { stag, to },
    }
}

fn read_response_hdr(stag: u32, to: u64, last: bool) -> Header {
    Header {
        opcode: Opcode::ReadResponse,
        last,
        model: Model::Tagged { stag, to },
    }
}

/// After the attack: the QP is in Error, the receive was flushed, an async event arrived,
/// no byte outside the registration changed, and the device counted the Terminate.
fn assert_contained(v: &Victim, terminates_before: u64, expect_event: &[EventKind]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let c =
            v.cq.wait(1, deadline.saturating_duration_since(Instant::now()))
                .expect("flushed receive");
        if c[0].wr_id == 77 {
            assert_eq!(c[0].status(), WcStatus::WrFlushErr);
            break;
        }
    }
    loop {
        let ev =
            v.qp.next_event(deadline.saturating_duration_since(Instant::now()))
                .expect("async event for the terminated QP");
        if expect_event.contains(&ev.kind) {
            break;
        }
    }
    assert_eq!(v.qp.state().unwrap(), ual::QpState::Error);
    let data = v.buf.to_vec();
    let outside = data[..REG_OFF]
        .iter()
        .chain(&data[REG_OFF + REG_LEN..])
        .all(|&b| b == GUARD);
    assert!(
        outside,
        "a byte outside the remotely writable registration changed"
    );
    assert_eq!(terminates(v), terminates_before + 1, "Terminate counted");
}

fn terminates(v: &Victim) -> u64 {
    let dev = v.ctx.device("siw0").unwrap().index;
    v.ctx
        .stat_device(dev)
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == "terminates_sent")
        .map(|(_, n)| n)
        .unwrap()
}

/// Run one attack through each front door, with a bystander tenant served throughout.
/// Every attack is refused before anything is placed: not a byte of the victim's buffer
/// may change.
fn attack(
    crc: bool,
    ird: u16,
    want: TermCode,
    events: &[EventKind],
    run: impl Fn(&Victim, &mut Attacker),
) {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (v, mut a) = setup(door, crc, ird);
        let before = terminates(&v);
        let image = v.buf.to_vec();
        run(&v, &mut a);
        assert_eq!(a.terminate(), want, "Terminate control field");
        assert_contained(&v, before, events);
        assert_eq!(v.buf.to_vec(), image, "nothing was placed");
        by.finish().assert_served(BYSTANDER_BOUND);
    });
}

const fn tc(layer: u8, etype: u8, ecode: u8) -> TermCode {
    TermCode {
        layer,
        etype,
        ecode,
    }
}

const FATAL: &[EventKind] = &[EventKind::QpFatal];
const ACCESS: &[EventKind] = &[EventKind::QpAccessError];

#[test]
fn bad_crc_is_terminated_at_the_llp_layer() {
    attack(
        true,
        4,
        tc(term::LAYER_LLP, 0, term::LLP_CRC),
        FATAL,
        |_, a| {
            let f = a.fpdu(&Attacker::ulpdu(send_hdr(1), b"hello"), true);
            a.send(&f);
        },
    );
}

#[test]
fn bad_length_is_terminated() {
    attack(
        false,
        4,
        tc(term::LAYER_LLP, 0, term::LLP_BAD_FPDU),
        FATAL,
        |_, a| {
            // An FPDU whose ULPDU is too short to hold any DDP header.
            let f = a.fpdu(&[0x41, 0x43, 0, 0], false);
            a.send(&f);
        },
    );
}

#[test]
fn unknown_opcode_is_terminated() {
    attack(
        false,
        4,
        tc(
            term::LAYER_RDMAP,
            term::RDMAP_REMOTE_OP,
            term::RDMAP_UNEXPECTED_OP,
        ),
        FATAL,
        |_, a| {
            let mut u = Attacker::ulpdu(send_hdr(1), b"x");
            u[1] = (u[1] & 0xf0) | 0x0d; // RDMAP opcode 13 is not assigned
            let f = a.fpdu(&u, false);
            a.send(&f);
        },
    );
}

#[test]
fn write_to_an_invalid_stag_is_terminated() {
    attack(
        false,
        4,
        tc(
            term::LAYER_DDP,
            term::DDP_TAGGED_BUF,
            term::DDP_TAGGED_INV_STAG,
        ),
        ACCESS,
        |v, a| {
            let bogus = v.stag ^ 0x00ff_ff00;
            let f = a.fpdu(&Attacker::ulpdu(write_hdr(bogus, v.addr), &[1; 64]), false);
            a.send(&f);
        },
    );
}

#[test]
fn write_past_the_registration_changes_nothing() {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (v, mut a) = setup(door, false, 4);
        let before = terminates(&v);
        let image = v.buf.to_vec();
        // Starts inside, runs 200 bytes past the end: nothing may be placed at all.
        let to = v.addr + REG_LEN as u64 - 100;
        let f = a.fpdu(&Attacker::ulpdu(write_hdr(v.stag, to), &[0x55; 300]), false);
        a.send(&f);
        assert_eq!(
            a.terminate(),
            TermCode {
                layer: term::LAYER_DDP,
                etype: term::DDP_TAGGED_BUF,
                ecode: term::DDP_TAGGED_BASE_BOUNDS,
            }
        );
        assert_contained(&v, before, ACCESS);
        assert_eq!(v.buf.to_vec(), image, "not even the part inside was placed");
        // And below the start.
        let (v, mut a) = setup(door, false, 4);
        let before = terminates(&v);
        let f = a.fpdu(
            &Attacker::ulpdu(write_hdr(v.stag, v.addr - 8), &[0x55; 16]),
            false,
        );
        a.send(&f);
        assert_eq!(a.terminate().ecode, term::DDP_TAGGED_BASE_BOUNDS);
        assert_contained(&v, before, ACCESS);
        by.finish().assert_served(BYSTANDER_BOUND);
    });
}

#[test]
fn reads_beyond_ird_are_terminated() {
    attack(
        false,
        1,
        tc(
            term::LAYER_RDMAP,
            term::RDMAP_REMOTE_OP,
            term::RDMAP_CATASTROPHIC_LOCAL,
        ),
        FATAL,
        |v, a| {
            // Two Read Requests in one segment against IRD 1, each for more than the
            // victim's send buffer and our unread receive buffer can hold (4 MiB +
            // 128 KiB here): the first response is still going out, holding the one IRD
            // slot, when the second request is parsed.
            let mut burst = Vec::new();
            for msn in 1..=2u32 {
                let h = read_hdr(msn);
                let body = ReadRequest {
                    sink_stag: 0x1234_5600,
                    sink_to: 0,
                    size: BIG_LEN as u32,
                    src_stag: v.big_stag,
                    src_to: v.big_addr,
                }
                .to_vec();
                burst.extend(a.fpdu(&Attacker::ulpdu(h, &body), false));
            }
            a.send(&burst);
            // Read nothing until the victim has seen the violation, so the first
            // response stays stuck in the socket buffers meanwhile (the QP state is
            // queried, not an event, so the checks after the attack still see them).
            let deadline = Instant::now() + Duration::from_secs(10);
            while v.qp.state().unwrap() != ual::QpState::Error {
                assert!(
                    Instant::now() < deadline,
                    "the second Read Request was accepted"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        },
    );
}

#[test]
fn read_request_for_an_invalid_stag_is_terminated() {
    attack(
        false,
        4,
        tc(
            term::LAYER_RDMAP,
            term::RDMAP_REMOTE_PROT,
            term::RDMAP_INV_STAG,
        ),
        ACCESS,
        |v, a| {
            let h = read_hdr(1);
            let body = ReadRequest {
                sink_stag: 1,
                sink_to: 0,
                size: 64,
                src_stag: v.stag ^ 0x00ff_ff00,
                src_to: v.addr,
            }
            .to_vec();
            let f = a.fpdu(&Attacker::ulpdu(h, &body), false);
            a.send(&f);
        },
    );
}

#[test]
fn revision_1_initiator_is_served() {
    each_front_door(|door| {
        let (v, mut a) = setup_rev(door, false, 4, 1);
        let f = a.fpdu(&Attacker::ulpdu(send_hdr(1), b"rfc 5044 peer"), false);
        a.send(&f);
        let c = v.cq.wait(1, Duration::from_secs(10)).unwrap();
        assert_eq!(
            (c[0].wr_id, c[0].status(), c[0].byte_len),
            (77, WcStatus::Success, 13)
        );
        let mut got = [0u8; 13];
        v.buf.read(REG_OFF, &mut got);
        assert_eq!(&got, b"rfc 5044 peer");
    });
}

/// The victim posts an RDMA Read of 64 bytes into its local-write-only registration.
fn post_read(v: &Victim) {
    let sink = ual::Sge {
        addr: v.local_addr,
        length: 64,
        lkey: v.local_stag,
    };
    v.qp.post_send(&Wqe::new(5, WrOpcode::RdmaRead, &[sink]).with_remote(0x5000, 0x1234))
        .unwrap();
}

fn ddp_catastrophic() -> TermCode {
    tc(term::LAYER_DDP, term::DDP_CATASTROPHIC, 0)
}

#[test]
fn unsolicited_read_responses_place_nothing() {
    // With no read outstanding, a Read Response aimed at a local-write-only registration
    // (a receive buffer, say) is refused, middle segment or last (kernel siw: DDP
    // catastrophic error); the last one completes nothing either.
    for last in [false, true] {
        attack(false, 4, ddp_catastrophic(), FATAL, |v, a| {
            let h = read_response_hdr(v.local_stag, v.local_addr, last);
            a.send(&a.fpdu(&Attacker::ulpdu(h, b"PWNED"), false));
        });
    }
}

#[test]
fn read_response_for_another_stag_places_nothing() {
    attack(
        false,
        4,
        tc(
            term::LAYER_DDP,
            term::DDP_TAGGED_BUF,
            term::DDP_TAGGED_INV_STAG,
        ),
        ACCESS,
        |v, a| {
            post_read(v);
            let rr = a.read_request();
            assert_eq!((rr.sink_stag, rr.sink_to), (v.local_stag, v.local_addr));
            // A real, remotely writable STag of the same PD — but not the read's sink.
            let h = read_response_hdr(v.stag, v.addr, true);
            a.send(&a.fpdu(&Attacker::ulpdu(h, &[0x55; 64]), false));
        },
    );
}

#[test]
fn read_response_at_another_offset_places_nothing() {
    attack(
        false,
        4,
        tc(
            term::LAYER_DDP,
            term::DDP_TAGGED_BUF,
            term::DDP_TAGGED_BASE_BOUNDS,
        ),
        ACCESS,
        |v, a| {
            post_read(v);
            let rr = a.read_request();
            // The sink's STag, but 8 bytes past where the response must start.
            let h = read_response_hdr(rr.sink_stag, rr.sink_to + 8, false);
            a.send(&a.fpdu(&Attacker::ulpdu(h, &[0x55; 32]), false));
        },
    );
}

/// The victim's QP takes only `access` from its peer from now on.
fn restrict_qp(v: &Victim, access: Access) {
    let attr = QpAttr {
        access,
        ..QpAttr::default()
    };
    v.qp.modify(&attr, QpAttrMask::ACCESS).unwrap();
}

fn access_violation() -> TermCode {
    tc(
        term::LAYER_RDMAP,
        term::RDMAP_REMOTE_PROT,
        term::RDMAP_ACCESS,
    )
}

#[test]
fn qp_access_flags_refuse_remote_writes() {
    // The registration allows remote writes; the QP does not.
    attack(false, 4, access_violation(), ACCESS, |v, a| {
        restrict_qp(v, Access::REMOTE_READ);
        let f = a.fpdu(&Attacker::ulpdu(write_hdr(v.stag, v.addr), &[1; 64]), false);
        a.send(&f);
    });
}

#[test]
fn qp_access_flags_refuse_remote_reads() {
    attack(false, 4, access_violation(), ACCESS, |v, a| {
        restrict_qp(v, Access::REMOTE_WRITE);
        let body = ReadRequest {
            sink_stag: 1,
            sink_to: 0,
            size: 64,
            src_stag: v.stag,
            src_to: v.addr,
        }
        .to_vec();
        a.send(&a.fpdu(&Attacker::ulpdu(read_hdr(1), &body), false));
    });
}

#[test]
fn remote_invalidation_of_a_local_buffer_is_refused() {
    // A Send with Invalidate naming the local-write-only registration (which the peer was
    // never given): refused with "STag cannot be invalidated", the receive completes in
    // error, and the consumer keeps its buffer.
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (v, mut a) = setup(door, false, 4);
        let before = terminates(&v);
        let h = Header {
            opcode: Opcode::SendInvalidate,
            last: true,
            model: Model::Untagged {
                inv_stag: v.local_stag,
                qn: wire::QN_SEND,
                msn: 1,
                mo: 0,
            },
        };
        a.send(&a.fpdu(&Attacker::ulpdu(h, b"inv"), false));
        assert_eq!(
            a.terminate(),
            tc(
                term::LAYER_RDMAP,
                term::RDMAP_REMOTE_PROT,
                term::RDMAP_CANNOT_INVALIDATE
            )
        );
        let c = v.cq.wait(1, Duration::from_secs(10)).unwrap();
        assert_eq!((c[0].wr_id, c[0].status()), (77, WcStatus::RemInvReqErr));
        assert_eq!(terminates(&v), before + 1);
        by.finish().assert_served(BYSTANDER_BOUND);
    });
}
