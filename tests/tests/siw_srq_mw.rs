//! Shared receive queues and memory windows over siw, through both kAL front doors.

use krdma_tests::{each_front_door, FrontDoor};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tools::perf::{connect_endpoint, Endpoint};
use ual::abi::{self, cmd};
use ual::{
    send_flags, wc_flags, Access, ConnParam, Context, Cq, EventKind, Listener, Mr, Pd, Qp, QpCaps,
    QpConfig, RegBuf, Srq, VerbsError, WcOpcode, WcStatus, Wqe, WrOpcode,
};

const T: Duration = Duration::from_secs(10);
const SIG: u8 = send_flags::SIGNALED;

/// The accepting side: one PD, one CQ, a buffer registered with `access`.
struct Server {
    ctx: Arc<Context>,
    dev: u32,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    buf: Arc<RegBuf>,
    mr: Arc<Mr>,
    listener: Arc<Listener>,
}

impl Server {
    fn new(door: &FrontDoor, len: usize, access: Access) -> Server {
        let ctx = door.open();
        let dev = ctx.device("siw0").unwrap().index;
        let pd = ctx.alloc_pd(dev).unwrap();
        let cq = ctx.create_cq(dev, 256).unwrap();
        let buf = RegBuf::new(len).unwrap();
        let mr = ctx.reg_buf(&pd, &buf, access).unwrap();
        let listener = ctx.listen(dev, "127.0.0.1:0".parse().unwrap(), 64).unwrap();
        Server {
            ctx,
            dev,
            pd,
            cq,
            buf,
            mr,
            listener,
        }
    }

    fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.listener.port))
    }

    /// Connect a client endpoint (its own context) and accept it onto a new QP.
    fn accept(&self, client: &Arc<Context>, srq: Option<&Arc<Srq>>) -> (Arc<Qp>, Endpoint) {
        let (c2, addr) = (client.clone(), self.addr());
        let cdev = client.device("siw0").unwrap().index;
        let t = std::thread::spawn(move || connect_endpoint(&c2, cdev, addr, 64 * 1024, 32));
        let req = self.listener.get_request(T).unwrap();
        let qp = self
            .ctx
            .create_qp(
                &self.pd,
                &self.cq,
                &self.cq,
                QpConfig {
                    caps: QpCaps {
                        max_send_wr: 32,
                        max_recv_wr: 32,
                        max_send_sge: 1,
                        max_recv_sge: 1,
                        max_inline: 0,
                    },
                    srq: srq.cloned(),
                    ..Default::default()
                },
            )
            .unwrap();
        // The client expects an advertisement of our buffer in the private data.
        let mut pdata = self.mr.addr.to_be_bytes().to_vec();
        pdata.extend_from_slice(&self.mr.rkey.to_be_bytes());
        pdata.extend_from_slice(&self.mr.len.to_be_bytes());
        let param = ConnParam {
            private_data: pdata,
            ird: 8,
            ord: 8,
        };
        self.listener.accept(req.conn_id, &qp, &param).unwrap();
        assert_eq!(qp.next_event(T).unwrap().kind, EventKind::Established);
        (qp, t.join().unwrap().unwrap())
    }

    fn event(&self, qp: &Qp, want: EventKind) {
        let deadline = std::time::Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let ev = qp.next_event(left).expect("event");
            if ev.kind == want {
                return;
            }
        }
    }
}

#[test]
fn one_srq_serves_many_qps() {
    each_front_door(|door| {
        const QPS: usize = 4;
        const SLOT: usize = 4096;
        let s = Server::new(door, 16 * SLOT, Access::LOCAL_WRITE);
        let srq = s.ctx.create_srq(&s.pd, 16, 1).unwrap();
        assert_eq!(srq.query().unwrap().max_wr, 16);
        let clients: Vec<_> = (0..QPS).map(|_| door.open()).collect();
        let conns: Vec<_> = clients.iter().map(|c| s.accept(c, Some(&srq))).collect();

        // A QP on an SRQ has no receive queue of its own.
        assert_eq!(
            conns[0].0.post_recv(&Wqe::recv(1, &[s.mr.sge(0, 8)])),
            Err(VerbsError::Invalid)
        );
        // An SRQ in use cannot be destroyed.
        let mut d = abi::Destroy {
            handle: srq.handle,
            _pad: 0,
        };
        assert_eq!(
            s.ctx.channel().call(cmd::DESTROY_SRQ, &mut d),
            Err(VerbsError::Busy)
        );

        for i in 0..2 * QPS {
            let sge = s.mr.sge((i * SLOT) as u64, SLOT as u32);
            srq.post_recv(&Wqe::recv(i as u64, &[sge])).unwrap();
        }
        assert_eq!(srq.queued(), Some(2 * QPS as u32));
        srq.arm_limit(3).unwrap();
        assert_eq!(srq.query().unwrap().limit, 3);

        // Every client sends two messages naming itself; they land wherever the SRQ says.
        for (n, (_, ep)) in conns.iter().enumerate() {
            for m in 0..2u8 {
                let msg = [n as u8, m, 0xa5, 0x5a];
                ep.buf.write(m as usize * 8, &msg);
                ep.send(m as u64, m as u64 * 8, 4, SIG).unwrap();
            }
        }
        let got = s.cq.wait(2 * QPS, T).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for c in &got {
            assert_eq!(c.status(), WcStatus::Success);
            assert_eq!(c.opcode(), Some(WcOpcode::Recv));
            assert_eq!(c.byte_len, 4);
            let mut msg = [0u8; 4];
            s.buf.read(c.wr_id as usize * SLOT, &mut msg);
            assert_eq!(&msg[2..], &[0xa5, 0x5a]);
            let sender = &conns[msg[0] as usize].0;
            assert_eq!(c.qp_num, sender.qp_num, "completion names the receiving QP");
            assert!(seen.insert((msg[0], msg[1])), "each message once");
        }
        assert_eq!(seen.len(), 2 * QPS);
        assert_eq!(srq.queued(), Some(0));
        let ev = srq.events().recv_timeout(T).expect("SRQ limit event");
        assert_eq!(ev.kind, EventKind::SrqLimitReached);
        assert_eq!(
            srq.query().unwrap().limit,
            0,
            "the limit disarms when it fires"
        );
        for (_, ep) in &conns {
            ep.complete(2).unwrap();
        }

        // One client goes away: its QP reports its last WQE, the SRQ's receives stay
        // for the others (nothing is flushed out of the SRQ).
        srq.post_recv(&Wqe::recv(100, &[s.mr.sge(0, SLOT as u32)]))
            .unwrap();
        conns[0].1.qp.disconnect(true).unwrap();
        s.event(&conns[0].0, EventKind::LastWqeReached);
        assert_eq!(srq.queued(), Some(1));
        conns[1].1.send(9, 0, 4, SIG).unwrap();
        let c = s.cq.wait(1, T).unwrap();
        assert_eq!((c[0].wr_id, c[0].status()), (100, WcStatus::Success));
        assert_eq!(c[0].qp_num, conns[1].0.qp_num);
    });
}

/// Guard byte everywhere the window does not reach.
const GUARD: u8 = 0xee;

#[test]
fn memory_windows_grant_exactly_their_range() {
    each_front_door(|door| {
        let len = 16 * 1024;
        let s = Server::new(door, len, Access::LOCAL_WRITE | Access::MW_BIND);
        s.buf.fill(GUARD);
        let client = door.open();
        let (qp, c) = s.accept(&client, None);
        let mw = s.ctx.alloc_mw(&s.pd).unwrap();

        // Bind [4096, 5120) for remote read and write, in send-queue order.
        let first = mw.rkey();
        qp.post_send(&mw.bind_wqe(
            1,
            &s.mr,
            4096,
            1024,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        ))
        .unwrap();
        let b = s.cq.wait(1, T).unwrap();
        assert_eq!(
            (b[0].status(), b[0].opcode()),
            (WcStatus::Success, Some(WcOpcode::BindMw))
        );
        let key_a = mw.rkey();
        assert_ne!(key_a, first, "each bind hands out a fresh key");
        let base = s.mr.addr + 4096;

        // The peer writes the whole window and reads it back.
        let data: Vec<u8> = (0..1024u32).map(|i| (i * 7) as u8).collect();
        c.buf.write(0, &data);
        let w = Wqe::new(2, WrOpcode::RdmaWrite, &[c.mr.sge(0, 1024)])
            .with_remote(base, key_a)
            .with_flags(SIG);
        c.qp.post_send(&w).unwrap();
        c.complete(1).unwrap();
        let r = Wqe::new(3, WrOpcode::RdmaRead, &[c.mr.sge(2048, 1024)])
            .with_remote(base, key_a)
            .with_flags(SIG);
        c.qp.post_send(&r).unwrap();
        c.complete(1).unwrap();
        let mut back = vec![0u8; 1024];
        c.buf.read(2048, &mut back);
        assert_eq!(back, data);

        // The peer invalidates the window with Send with Invalidate.
        let recv_buf = ual::RegBuf::new(64).unwrap();
        let recv_mr = s
            .ctx
            .reg_buf(&s.pd, &recv_buf, Access::LOCAL_WRITE)
            .unwrap();
        qp.post_recv(&Wqe::recv(4, &[recv_mr.sge(0, 64)])).unwrap();
        let inv = Wqe::new(5, WrOpcode::SendWithInv, &[c.mr.sge(0, 8)])
            .with_imm(key_a)
            .with_flags(SIG);
        c.qp.post_send(&inv).unwrap();
        c.complete(1).unwrap();
        let rc = s.cq.wait(1, T).unwrap();
        assert_eq!(rc[0].status(), WcStatus::Success);
        assert_ne!(rc[0].flags & wc_flags::WITH_INV, 0);
        assert_eq!(rc[0].imm_or_inv, key_a);

        // Rebind elsewhere, read-only, under a new key.
        qp.post_send(&mw.bind_wqe(6, &s.mr, 8192, 512, Access::REMOTE_READ))
            .unwrap();
        assert!(s.cq.wait(1, T).unwrap()[0].is_ok());
        let key_b = mw.rkey();
        let r = Wqe::new(7, WrOpcode::RdmaRead, &[c.mr.sge(0, 512)])
            .with_remote(s.mr.addr + 8192, key_b)
            .with_flags(SIG);
        c.qp.post_send(&r).unwrap();
        c.complete(1).unwrap();
        let mut got = vec![0u8; 512];
        c.buf.read(0, &mut got);
        assert!(got.iter().all(|&b| b == GUARD));

        // A write through the stale key A is refused: the QP is terminated with an
        // access error and no byte outside what the first bind allowed has changed.
        let w = Wqe::new(8, WrOpcode::RdmaWrite, &[c.mr.sge(0, 64)])
            .with_remote(base, key_a)
            .with_flags(SIG);
        c.qp.post_send(&w).unwrap();
        s.event(&qp, EventKind::QpAccessError);
        let all = s.buf.to_vec();
        assert_eq!(&all[4096..5120], &data[..]);
        assert!(all[..4096].iter().chain(&all[5120..]).all(|&b| b == GUARD));
        drop(recv_mr);
    });
}

#[test]
fn windows_bind_only_in_their_own_protection_domain() {
    each_front_door(|door| {
        let s = Server::new(door, 8192, Access::LOCAL_WRITE | Access::MW_BIND);
        let client = door.open();
        let (qp, _c) = s.accept(&client, None);
        // A window of another PD (and another context's, which has other PD numbers
        // too) cannot be bound through this QP.
        let other_pd = s.ctx.alloc_pd(s.dev).unwrap();
        let foreign = s.ctx.alloc_mw(&other_pd).unwrap();
        qp.post_send(&foreign.bind_wqe(1, &s.mr, 0, 64, Access::REMOTE_READ))
            .unwrap();
        let c = s.cq.wait(1, T).unwrap();
        assert_eq!(c[0].status(), WcStatus::MwBindErr);
        // Windows show up in the context's counts.
        let (_, rows) = s.ctx.stat_contexts().unwrap();
        let me = rows.iter().find(|r| r.id == s.ctx.id()).unwrap();
        assert_eq!(me.mws, 1);
    });
}
