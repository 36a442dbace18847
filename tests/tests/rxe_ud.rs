//! rxe0's unreliable datagram service end to end on loopback, through both kAL front
//! doors: address handles, UD Sends (with immediate data, inline, gathered), what a
//! receive holds (the GRH, then the payload; the sender's QP in the completion), and
//! what is dropped or refused — a wrong Q_Key, no receive posted, a Send over the MTU, a
//! receive too small, another PD's address handle — with the counters that say so.
//! `krdma ud-pingpong` (ibv_ud_pingpong's handshake and pattern) runs here too; against
//! the real ibv_ud_pingpong in `scripts/interop-rxe.sh`. So does the other unreliable
//! service, UC (`krdma uc-pingpong`; its engine is tested in `providers/rxe/tests/uc.rs`).

use krdma_tests::{each_front_door, FrontDoor};
use std::sync::Arc;
use std::time::Duration;
use ual::{
    send_flags, wc_flags, Access, Ah, Context, Cq, Mr, Pd, Qp, QpCaps, QpConfig, QpState, QpType,
    RegBuf, VerbsError, WcOpcode, WcStatus, Wqe, WrOpcode,
};

const T: Duration = Duration::from_secs(20);
const QKEY: u32 = 0x1111_1111;
const GRH: usize = 40;
const LEN: usize = 8192;

/// A UD QP in RTS with a registered buffer.
struct UdEnd {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    qp: Arc<Qp>,
    buf: Arc<RegBuf>,
    mr: Arc<Mr>,
}

impl UdEnd {
    fn new(ctx: &Arc<Context>, qkey: u32) -> UdEnd {
        let dev = ctx.device("rxe0").unwrap().index;
        let pd = ctx.alloc_pd(dev).unwrap();
        let cq = ctx.create_cq(dev, 64).unwrap();
        let caps = QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline: 64,
        };
        let qp = ctx
            .create_qp(
                &pd,
                &cq,
                &cq,
                QpConfig {
                    caps,
                    qp_type: QpType::Ud,
                    ..Default::default()
                },
            )
            .unwrap();
        ual::oob::ud_to_rts(&qp, qkey, 0xff_fffe).unwrap();
        assert_eq!(qp.state().unwrap(), QpState::Rts);
        let buf = RegBuf::new(LEN).unwrap();
        let mr = ctx.reg_buf(&pd, &buf, Access::LOCAL_WRITE).unwrap();
        UdEnd {
            ctx: ctx.clone(),
            pd,
            cq,
            qp,
            buf,
            mr,
        }
    }

    /// An address handle in this end's PD towards `peer`'s GID 0.
    fn ah_to(&self, peer: &UdEnd) -> Arc<Ah> {
        let dev = peer.ctx.device("rxe0").unwrap().index;
        let attr = rnicpi::AhAttr {
            dgid: peer.ctx.query_port(dev, 1).unwrap().gids[0],
            ..Default::default()
        };
        self.ctx.create_ah(&self.pd, &attr).unwrap()
    }

    fn counter(&self, name: &str) -> u64 {
        let dev = self.ctx.device("rxe0").unwrap().index;
        self.ctx
            .stat_device(dev)
            .unwrap()
            .into_iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("counter {name}"))
            .1
    }

    /// Nothing completes for `d`.
    fn quiet(&self, d: Duration) {
        std::thread::sleep(d);
        assert_eq!(self.cq.poll(&mut [Default::default()]), 0, "no completion");
    }
}

fn pair(door: &FrontDoor) -> (UdEnd, UdEnd) {
    let (a, b) = (door.open(), door.open());
    (UdEnd::new(&a, QKEY), UdEnd::new(&b, QKEY))
}

#[test]
fn datagrams_carry_the_grh_the_sender_and_immediate_data() {
    each_front_door(|door| {
        let (x, y) = pair(door);
        let ah = x.ah_to(&y);
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        x.buf.write(0, &payload);
        // A receive in two pieces: the GRH lands in the first, the payload runs on.
        y.qp.post_recv(&Wqe::recv(1, &[y.mr.sge(0, 100), y.mr.sge(100, 2000)]))
            .unwrap();
        let send = Wqe::new(2, WrOpcode::SendWithImm, &[x.mr.sge(0, 1000)])
            .with_imm(0x0102_0304)
            .with_flags(send_flags::SIGNALED | send_flags::SOLICITED)
            .with_ud(ah.num(), y.qp.qp_num, QKEY);
        x.qp.post_send(&send).unwrap();
        let sc = x.cq.wait(1, T).unwrap();
        assert!(sc[0].is_ok(), "{:?}", sc[0].status());
        assert_eq!(
            (sc[0].opcode(), sc[0].byte_len),
            (Some(WcOpcode::Send), 1000)
        );
        let rc = y.cq.wait(1, T).unwrap();
        let c = rc[0];
        assert!(c.is_ok(), "{:?}", c.status());
        assert_eq!(c.opcode(), Some(WcOpcode::Recv));
        assert_eq!(c.byte_len as usize, GRH + 1000);
        assert_eq!(c.src_qp, x.qp.qp_num, "the sender's QP");
        assert_eq!(c.imm_or_inv, 0x0102_0304);
        let want = wc_flags::GRH | wc_flags::WITH_IMM | wc_flags::SOLICITED;
        assert_eq!(c.flags & want, want);
        let got = y.buf.to_vec();
        // IPv4: 20 zero bytes, then the IP header with both addresses.
        assert_eq!(&got[..20], &[0; 20]);
        assert_eq!(got[20] >> 4, 4, "an IPv4 header");
        let gid = |e: &UdEnd| {
            let dev = e.ctx.device("rxe0").unwrap().index;
            e.ctx.query_port(dev, 1).unwrap().gids[0]
        };
        assert_eq!(&got[32..36], &gid(&x)[12..], "source address");
        assert_eq!(&got[36..40], &gid(&y)[12..], "destination address");
        assert_eq!(&got[GRH..GRH + 1000], &payload[..]);

        // Inline, and gathered from two pieces, both in one doorbell; unsignaled
        // Sends complete silently.
        for id in [3, 4] {
            y.qp.post_recv(&Wqe::recv(id, &[y.mr.sge(0, 4096)]))
                .unwrap();
        }
        let inline = Wqe::new(5, WrOpcode::Send, &[])
            .with_inline(b"datagram")
            .unwrap()
            .with_flags(send_flags::INLINE)
            .with_ud(ah.num(), y.qp.qp_num, QKEY);
        let gathered = Wqe::new(6, WrOpcode::Send, &[x.mr.sge(0, 10), x.mr.sge(500, 10)]).with_ud(
            ah.num(),
            y.qp.qp_num,
            QKEY,
        );
        x.qp.post_send_batch(&[inline, gathered]).unwrap();
        assert_eq!(x.cq.wait(1, T).unwrap()[0].wr_id, 6);
        let rc = y.cq.wait(2, T).unwrap();
        assert_eq!(rc.len(), 2);
        assert_eq!(rc[0].byte_len as usize, GRH + 8);
        assert_eq!(rc[1].byte_len as usize, GRH + 20);
        let mut tail = [0u8; 20];
        y.buf.read(GRH, &mut tail);
        assert_eq!(&tail[..10], &payload[..10]);
        assert_eq!(&tail[10..], &payload[500..510]);
    });
}

/// Datagrams posted unsignaled right before the QP is destroyed still go out (kernel rxe
/// sends them within the post; dtestx's UD test posts its last ones and frees at once):
/// through krdmad the doorbell's thread may not have served them when the destroy comes.
#[test]
fn datagrams_posted_before_a_destroy_go_out() {
    each_front_door(|door| {
        for round in 0..20u64 {
            let (x, y) = pair(door);
            let ah = x.ah_to(&y);
            for id in 0..8 {
                y.qp.post_recv(&Wqe::recv(id, &[y.mr.sge(id * 512, 512)]))
                    .unwrap();
            }
            let sends: Vec<Wqe> = (0..8)
                .map(|id| {
                    Wqe::new(100 + id, WrOpcode::Send, &[x.mr.sge(0, 64)]).with_ud(
                        ah.num(),
                        y.qp.qp_num,
                        QKEY,
                    )
                })
                .collect();
            x.qp.post_send_batch(&sends[..4]).unwrap();
            for w in &sends[4..] {
                x.qp.post_send(w).unwrap();
            }
            drop(x);
            drop(ah);
            let got =
                y.cq.wait(8, T)
                    .unwrap_or_else(|e| panic!("round {round}: {e:?}"));
            assert_eq!(got.len(), 8, "round {round}");
            assert!(got.iter().all(|c| c.is_ok()));
        }
    });
}

#[test]
fn what_is_dropped_and_what_is_refused() {
    each_front_door(|door| {
        let (x, y) = pair(door);
        let ah = x.ah_to(&y);
        let to_y = |id, len: u32, qkey| {
            Wqe::new(id, WrOpcode::Send, &[x.mr.sge(0, len)]).with_ud(ah.num(), y.qp.qp_num, qkey)
        };

        // A wrong Q_Key: sent, and dropped by the receiver (counted).
        let bad_qkey = y.counter("rx_bad_qkey");
        y.qp.post_recv(&Wqe::recv(1, &[y.mr.sge(0, 4096)])).unwrap();
        x.qp.post_send(&to_y(2, 64, 0x2222_2222)).unwrap();
        assert!(x.cq.wait(1, T).unwrap()[0].is_ok(), "UD does not know");
        y.quiet(Duration::from_millis(200));
        assert!(y.counter("rx_bad_qkey") > bad_qkey);
        // The controlled Q_Key (top bit set) means the sender's own: accepted.
        x.qp.post_send(&to_y(3, 64, 0x8000_0000)).unwrap();
        assert!(y.cq.wait(1, T).unwrap()[0].is_ok());
        x.cq.wait(1, T).unwrap();

        // No receive posted: dropped (counted), the QP goes on.
        let no_recv = y.counter("ud_dropped_no_recv");
        x.qp.post_send(&to_y(4, 64, QKEY)).unwrap();
        x.cq.wait(1, T).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert!(y.counter("ud_dropped_no_recv") > no_recv);

        // A receive too small for GRH and payload: completed in error, QP still works.
        y.qp.post_recv(&Wqe::recv(5, &[y.mr.sge(0, 64)])).unwrap();
        x.qp.post_send(&to_y(6, 64, QKEY)).unwrap();
        assert_eq!(y.cq.wait(1, T).unwrap()[0].status(), WcStatus::LocLenErr);
        x.cq.wait(1, T).unwrap();
        y.qp.post_recv(&Wqe::recv(7, &[y.mr.sge(0, 4096)])).unwrap();
        x.qp.post_send(&to_y(8, 64, QKEY)).unwrap();
        assert!(y.cq.wait(1, T).unwrap()[0].is_ok());
        x.cq.wait(1, T).unwrap();

        // Another PD's address handle is no address: the Send fails, the QP is in Error.
        let z = UdEnd::new(&x.ctx, QKEY);
        let foreign = z.ah_to(&y);
        let w = Wqe::new(9, WrOpcode::Send, &[x.mr.sge(0, 8)]).with_ud(
            foreign.num(),
            y.qp.qp_num,
            QKEY,
        );
        x.qp.post_send(&w).unwrap();
        assert_eq!(x.cq.wait(1, T).unwrap()[0].status(), WcStatus::LocQpOpErr);
        assert_eq!(x.qp.state().unwrap(), QpState::Error);

        // A Send larger than the MTU: refused locally, QP to Error.
        let mtu = {
            let dev = z.ctx.device("rxe0").unwrap().index;
            z.ctx.query_port(dev, 1).unwrap().active_mtu
        };
        let zah = z.ah_to(&y);
        let w = Wqe::new(10, WrOpcode::Send, &[z.mr.sge(0, mtu + 1)]).with_ud(
            zah.num(),
            y.qp.qp_num,
            QKEY,
        );
        z.qp.post_send(&w).unwrap();
        assert_eq!(z.cq.wait(1, T).unwrap()[0].status(), WcStatus::LocLenErr);
        // And RDMA is not a datagram's.
        let w2 = UdEnd::new(&x.ctx, QKEY);
        let ah2 = w2.ah_to(&y);
        let write = Wqe::new(11, WrOpcode::RdmaWrite, &[w2.mr.sge(0, 8)])
            .with_remote(0x1000, 1)
            .with_ud(ah2.num(), y.qp.qp_num, QKEY);
        w2.qp.post_send(&write).unwrap();
        assert_eq!(w2.cq.wait(1, T).unwrap()[0].status(), WcStatus::LocQpOpErr);
        y.quiet(Duration::from_millis(100));
    });
}

#[test]
fn address_handles_need_a_datagram_device_and_a_destination() {
    each_front_door(|door| {
        let ctx = door.open();
        let siw = ctx.device("siw0").unwrap();
        assert_eq!(siw.attr.max_ah, 0, "iWARP has no datagrams");
        let pd = ctx.alloc_pd(siw.index).unwrap();
        let attr = rnicpi::AhAttr {
            dgid: rnicpi::ip_to_gid("127.0.0.1".parse().unwrap()),
            ..Default::default()
        };
        assert_eq!(
            ctx.create_ah(&pd, &attr).err(),
            Some(VerbsError::Unsupported)
        );
        let cq = ctx.create_cq(siw.index, 4).unwrap();
        let ud = QpConfig {
            qp_type: QpType::Ud,
            ..Default::default()
        };
        assert_eq!(
            ctx.create_qp(&pd, &cq, &cq, ud.clone()).err(),
            Some(VerbsError::Unsupported)
        );

        let rxe = ctx.device("rxe0").unwrap();
        assert!(rxe.attr.max_ah > 0);
        let pd = ctx.alloc_pd(rxe.index).unwrap();
        let zero = rnicpi::AhAttr::default();
        assert_eq!(ctx.create_ah(&pd, &zero).err(), Some(VerbsError::Invalid));
        let port2 = rnicpi::AhAttr { port: 2, ..attr };
        assert_eq!(ctx.create_ah(&pd, &port2).err(), Some(VerbsError::Invalid));
        let ah = ctx.create_ah(&pd, &attr).unwrap();
        let live = |ctx: &Context| {
            ctx.stat_device(rxe.index)
                .unwrap()
                .into_iter()
                .find(|(k, _)| k == "ahs_live")
                .unwrap()
                .1
        };
        let before = live(&ctx);
        drop(ah);
        assert_eq!(live(&ctx), before - 1, "destroyed on drop");
        // A UD QP needs its Q_Key to leave Reset.
        let cq = ctx.create_cq(rxe.index, 4).unwrap();
        let qp = ctx.create_qp(&pd, &cq, &cq, ud).unwrap();
        let init = ual::QpAttr {
            state: QpState::Init,
            ..Default::default()
        };
        assert_eq!(
            qp.modify(&init, ual::QpAttrMask::STATE),
            Err(VerbsError::Invalid)
        );
    });
}

/// `krdma ud-pingpong` (UD) or `krdma uc-pingpong` (UC) against itself, both sides
/// through each front door, `size`-byte messages at a 1024-byte MTU.
fn pingpong_both_sides(qp_type: QpType, size: u32, port_base: u16) {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let port = port_base + std::process::id() as u16 % 1000;
        let opts = |server: Option<String>| tools::pingpong::Options {
            qp_type,
            server,
            port,
            size,
            iters: 200,
            rx_depth: 50,
            ..Default::default()
        };
        let so = opts(None);
        let srv =
            std::thread::spawn(move || tools::pingpong::run(&a, &so, &mut Vec::new()).map(|r| r.0));
        let mut out = Vec::new();
        let co = opts(Some("127.0.0.1".into()));
        let mut tries = 0;
        let moved = loop {
            match tools::pingpong::run(&b, &co, &mut out) {
                Err(VerbsError::Refused) if tries < 200 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => break r.expect("client"),
            }
        };
        let bytes = 2 * u64::from(size) * 200;
        assert_eq!(moved.0, bytes);
        assert_eq!(srv.join().unwrap().expect("server"), bytes);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("iters in"), "{text}");
    });
}

#[test]
fn ud_pingpong_runs_both_sides() {
    pingpong_both_sides(QpType::Ud, 1024, 18600);
}

/// UC (`ibv_uc_pingpong`), four packets a message: no acknowledgement, no loss on
/// loopback, so every exchange completes.
#[test]
fn uc_pingpong_runs_both_sides() {
    pingpong_both_sides(QpType::Uc, 4096, 17600);
}

/// UC is IB's (and RoCE's): an iWARP device refuses a UC QP, rxe makes one, through
/// either front door.
#[test]
fn uc_qps_are_made_by_rxe_only() {
    each_front_door(|door| {
        let ctx = door.open();
        for (name, ok) in [("rxe0", true), ("siw0", false)] {
            let dev = ctx.device(name).unwrap().index;
            let pd = ctx.alloc_pd(dev).unwrap();
            let cq = ctx.create_cq(dev, 16).unwrap();
            let cfg = QpConfig {
                qp_type: QpType::Uc,
                ..Default::default()
            };
            match ctx.create_qp(&pd, &cq, &cq, cfg) {
                Ok(qp) => {
                    assert!(ok, "{name} made a UC QP");
                    assert_eq!(qp.qp_type, QpType::Uc);
                }
                Err(e) => {
                    assert!(!ok, "{name}: {e}");
                    assert_eq!(e, VerbsError::Unsupported);
                }
            }
        }
    });
}

/// rdma_cm's Q_Key for its UDP port space: what a UD service's QP answers on.
const RDMA_UDP_QKEY: u32 = 0x0123_4567;

#[test]
fn a_ud_service_is_resolved_through_sidr() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let (server, client) = (UdEnd::new(&a, RDMA_UDP_QKEY), UdEnd::new(&b, RDMA_UDP_QKEY));
        let dev = a.device("rxe0").unwrap().index;
        let ip = tools::perf::loopback_of(&a, dev).unwrap();
        let listener = a.listen(dev, std::net::SocketAddr::new(ip, 0), 4).unwrap();
        let service = std::net::SocketAddr::new(ip, listener.port);
        let param = |pd: &[u8]| ual::ConnParam {
            private_data: pd.to_vec(),
            ..Default::default()
        };

        // Accepted: the client learns the QP and Q_Key that serve the port.
        client.qp.connect(service, &param(b"who")).unwrap();
        let req = listener.get_request(T).unwrap();
        assert_eq!(req.ud, Some(ual::UdPeer::default()), "a UD request");
        assert_eq!(&req.private_data[..3], b"who");
        listener
            .accept(req.conn_id, &server.qp, &param(b"me"))
            .unwrap();
        let ev = client.qp.next_event(T).unwrap();
        assert_eq!(ev.kind, ual::EventKind::Established);
        let peer = ev.ud.expect("the serving QP");
        assert_eq!((peer.qpn, peer.qkey), (server.qp.qp_num, RDMA_UDP_QKEY));
        assert_eq!(&ev.private_data[..2], b"me");
        assert_eq!(ev.peer.map(|p| p.ip()), Some(ip));
        assert_eq!(client.qp.state().unwrap(), QpState::Rts, "no QP moves");
        assert_eq!(server.qp.state().unwrap(), QpState::Rts);

        // What it learnt addresses a datagram.
        let ah = client.ah_to(&server);
        server
            .qp
            .post_recv(&Wqe::recv(1, &[server.mr.sge(0, 4096)]))
            .unwrap();
        client.buf.write(0, b"datagram");
        let send = Wqe::new(2, WrOpcode::Send, &[client.mr.sge(0, 8)]).with_ud(
            ah.num(),
            peer.qpn,
            peer.qkey,
        );
        client.qp.post_send(&send).unwrap();
        let rc = server.cq.wait(1, T).unwrap();
        assert!(rc[0].is_ok());
        assert_eq!(rc[0].src_qp, client.qp.qp_num);
        client.cq.wait(1, T).unwrap();

        // One QP resolves several services at once; a reject carries private data;
        // a port nobody serves is unreachable. Every outcome leaves the QP as it was.
        client.qp.connect(service, &param(b"1")).unwrap();
        client.qp.connect(service, &param(b"2")).unwrap();
        let (r1, r2) = (
            listener.get_request(T).unwrap(),
            listener.get_request(T).unwrap(),
        );
        listener.reject(r1.conn_id, b"no").unwrap();
        listener
            .accept(r2.conn_id, &server.qp, &param(b""))
            .unwrap();
        let mut kinds = [
            client.qp.next_event(T).unwrap(),
            client.qp.next_event(T).unwrap(),
        ];
        kinds.sort_by_key(|e| e.kind as u16);
        assert_eq!(kinds[0].kind, ual::EventKind::Established);
        assert_eq!(kinds[1].kind, ual::EventKind::Rejected);
        assert_eq!(&kinds[1].private_data[..2], b"no");
        drop(listener);
        client.qp.connect(service, &param(b"")).unwrap();
        let ev = client.qp.next_event(T).unwrap();
        assert_eq!(ev.kind, ual::EventKind::Unreachable);
        assert_eq!(client.qp.state().unwrap(), QpState::Rts);
    });
}

#[test]
fn sidr_requests_want_ud_qps_and_rc_requests_rc_qps() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let server = UdEnd::new(&a, RDMA_UDP_QKEY);
        let client = UdEnd::new(&b, RDMA_UDP_QKEY);
        let dev = a.device("rxe0").unwrap().index;
        let ip = tools::perf::loopback_of(&a, dev).unwrap();
        let listener = a.listen(dev, std::net::SocketAddr::new(ip, 0), 4).unwrap();
        let service = std::net::SocketAddr::new(ip, listener.port);
        // An RC QP cannot answer a SIDR request; the request still waits for a UD QP.
        client.qp.connect(service, &Default::default()).unwrap();
        let req = listener.get_request(T).unwrap();
        let rc = tools::perf::new_endpoint(&a, dev, 4096, 4).unwrap();
        assert_eq!(
            listener.accept(req.conn_id, &rc.qp, &Default::default()),
            Err(VerbsError::Invalid)
        );
        listener
            .accept(req.conn_id, &server.qp, &Default::default())
            .unwrap();
        assert_eq!(
            client.qp.next_event(T).unwrap().kind,
            ual::EventKind::Established
        );
        // A UD QP resolves only once it is ready (RTS).
        let cq = b.create_cq(b.device("rxe0").unwrap().index, 4).unwrap();
        let fresh = b
            .create_qp(
                &client.pd,
                &cq,
                &cq,
                QpConfig {
                    qp_type: QpType::Ud,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(
            fresh.connect(service, &Default::default()),
            Err(VerbsError::BadState)
        );
    });
}

#[test]
fn udaddy_runs_both_sides() {
    each_front_door(|door| {
        let (a, b) = (door.open(), door.open());
        let dev = a.device("rxe0").unwrap().index;
        let ip = tools::perf::loopback_of(&a, dev).unwrap();
        let port = 17000 + std::process::id() as u16 % 1000;
        let opts = |server| tools::udaddy::Options {
            server,
            bind: Some(ip),
            port,
            count: 20,
            size: 200,
            ..Default::default()
        };
        let so = opts(None);
        let srv = std::thread::spawn(move || {
            let mut out = Vec::new();
            tools::udaddy::run(&a, &so, &mut out).map(|n| (n, out))
        });
        let mut out = Vec::new();
        let mut tries = 0;
        let got = loop {
            match tools::udaddy::run(&b, &opts(Some(ip)), &mut out) {
                // Resolved before the server listened: nobody served the port yet.
                Err(VerbsError::Refused) if tries < 200 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => break r.expect("client"),
            }
        };
        assert_eq!(got, 20);
        let (n, text) = srv.join().unwrap().expect("server");
        assert_eq!(n, 20);
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains("data transfers complete"), "{text}");
    });
}

/// An IT-API listener (whose endpoints are RC) refuses a UD resolution at once: the
/// requester hears `Rejected`, the listener's consumer nothing.
#[test]
fn an_rc_only_listener_rejects_ud_requests() {
    use krdma_itapi::{EvdFlags, EventStream};
    each_front_door(|door| {
        let ia = krdma_itapi::Ia::open_on(&door.target(), "rxe0").unwrap();
        let evd =
            krdma_itapi::Evd::create(&ia, EventStream::CmRequest, EvdFlags::empty(), 8, 0, None)
                .unwrap();
        let listener = krdma_itapi::Listener::create(&ia, 0, &evd, 0).unwrap();
        let b = door.open();
        let client = UdEnd::new(&b, RDMA_UDP_QKEY);
        let dev = b.device("rxe0").unwrap().index;
        let ip = tools::perf::loopback_of(&b, dev).unwrap();
        let at = std::net::SocketAddr::new(ip, listener.port());
        client.qp.connect(at, &Default::default()).unwrap();
        assert_eq!(
            client.qp.next_event(T).unwrap().kind,
            ual::EventKind::Rejected
        );
        assert!(
            evd.dequeue().is_err(),
            "no request reached the IT-API consumer"
        );
    });
}

/// IT-API UD endpoints: a listener that takes UD requests, a resolution accepted by a UD
/// endpoint (an RC endpoint cannot, and the request still waits), datagrams through what
/// the client resolved, each received behind the GRH.
#[test]
fn itapi_ud_endpoints_resolve_and_send() {
    use krdma_itapi::{
        ConnEventKind, DtoFlags, Endpoint, EpAttributes, EvdFlags, Event, EventStream, Ia,
        Listener, Lmr, MemPriv, Pz,
    };
    each_front_door(|door| {
        let side = || {
            let ia = Ia::open_on(&door.target(), "rxe0").unwrap();
            let pz = Pz::create(&ia).unwrap();
            let evd = |s| krdma_itapi::Evd::create(&ia, s, EvdFlags::empty(), 64, 1, None).unwrap();
            let (dto, cm) = (evd(EventStream::Dto), evd(EventStream::CmMessage));
            let ep =
                Endpoint::create_ud(&pz, &dto, &dto, &cm, EpAttributes::default(), None).unwrap();
            let lmr = Lmr::create(&pz, RegBuf::new(4096).unwrap(), MemPriv::LOCAL_WRITE).unwrap();
            (ia, pz, dto, cm, ep, lmr)
        };
        let (sia, spz, sdto, scm, sep, slmr) = side();
        let (_cia, _cpz, cdto, ccm, cep, clmr) = side();
        let requests =
            krdma_itapi::Evd::create(&sia, EventStream::CmRequest, EvdFlags::empty(), 8, 1, None)
                .unwrap();
        let listener = Listener::create(&sia, 0, &requests, 0).unwrap();
        listener.take_ud_requests();
        let dev = door.open();
        let ip = tools::perf::loopback_of(&dev, dev.device("rxe0").unwrap().index).unwrap();
        let at = std::net::SocketAddr::new(ip, listener.port());
        let t = Some(T);

        cep.connect(at, b"hi").unwrap();
        let (Event::ConnRequest(req), _) = requests.wait(t).unwrap() else {
            panic!("a request")
        };
        assert!(req.ud);
        let rc_dto =
            krdma_itapi::Evd::create(&sia, EventStream::Dto, EvdFlags::empty(), 8, 1, None)
                .unwrap();
        let rc_cm =
            krdma_itapi::Evd::create(&sia, EventStream::CmMessage, EvdFlags::empty(), 8, 1, None)
                .unwrap();
        let rc = Endpoint::create_rc(
            &spz,
            &rc_dto,
            &rc_dto,
            &rc_cm,
            EpAttributes::default(),
            None,
        )
        .unwrap();
        assert_eq!(
            rc.accept(req.cn_est_id, b"").err(),
            Some(krdma_itapi::Error::InvalidEpType)
        );
        sep.post_recv(&[slmr.segment(0, 4096).unwrap()], 7, DtoFlags::COMPLETION)
            .unwrap();
        sep.accept(req.cn_est_id, b"yo").unwrap();
        let (Event::Connection(passive), _) = scm.wait(t).unwrap() else {
            panic!("the passive resolution")
        };
        assert_eq!(passive.kind, ConnEventKind::Established);
        assert!(passive.ud.as_ref().unwrap().passive);
        let (Event::Connection(active), _) = ccm.wait(t).unwrap() else {
            panic!("the resolution")
        };
        assert_eq!(active.kind, ConnEventKind::Established);
        assert_eq!(&active.private_data[..2], b"yo");
        let remote = active.ud.expect("resolved");
        assert_eq!((remote.qpn, remote.qkey), (sep.qp_num(), 0x0123_4567));

        clmr.buffer().unwrap().write(0, b"datagram");
        assert_eq!(
            cep.post_send(&[clmr.segment(0, 8).unwrap()], 1, DtoFlags::COMPLETION)
                .err(),
            Some(krdma_itapi::Error::InvalidEpType),
            "a datagram needs a destination"
        );
        cep.post_sendto(
            &[clmr.segment(0, 8).unwrap()],
            2,
            DtoFlags::COMPLETION,
            &remote,
        )
        .unwrap();
        let (Event::Dto(sent), _) = cdto.wait(t).unwrap() else {
            panic!("the send")
        };
        assert_eq!(sent.cookie, 2);
        let (Event::Dto(got), _) = sdto.wait(t).unwrap() else {
            panic!("the receive")
        };
        assert_eq!((got.cookie, got.transferred_length), (7, 40 + 8));
        let mut b = [0u8; 8];
        slmr.buffer().unwrap().read(40, &mut b);
        assert_eq!(&b, b"datagram");
    });
}
