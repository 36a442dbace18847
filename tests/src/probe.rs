//! What one process can try against another's context once it knows its handle numbers,
//! keys, QP number and a pending connection id: every command of the ABI, filled in with
//! those numbers (and with memory, ring memory and a doorbell of its own where a
//! command needs them).

use crate::say;
use bytemuck::Zeroable;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;
use tools::perf::{connect_endpoint, connect_pair, new_endpoint};
use ual::abi::{self, cmd};
use ual::{Access, Context, RegBuf, Target};

/// Another context's numbers, as its owner reveals them (one line of text).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Known {
    pub ctx: u32,
    pub dev: u32,
    pub pd: u32,
    pub cq: u32,
    pub qp: u32,
    pub qpn: u32,
    pub mr: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
    pub listener: u32,
    pub conn_id: u64,
    pub srq: u32,
    pub mw: u32,
}

impl Known {
    pub fn to_line(&self) -> String {
        let k = self;
        format!(
            "{} {} {} {} {} {} {} {} {} {} {} {} {} {} {}",
            k.ctx,
            k.dev,
            k.pd,
            k.cq,
            k.qp,
            k.qpn,
            k.mr,
            k.lkey,
            k.rkey,
            k.addr,
            k.len,
            k.listener,
            k.conn_id,
            k.srq,
            k.mw
        )
    }

    pub fn parse(line: &str) -> Known {
        let v: Vec<u64> = line
            .split_whitespace()
            .map(|x| x.parse().expect("a number"))
            .collect();
        assert_eq!(v.len(), 15, "a Known line has 15 numbers: {line}");
        let u = |i: usize| v[i] as u32;
        Known {
            ctx: u(0),
            dev: u(1),
            pd: u(2),
            cq: u(3),
            qp: u(4),
            qpn: u(5),
            mr: u(6),
            lkey: u(7),
            rkey: u(8),
            addr: v[9],
            len: v[10],
            listener: u(11),
            conn_id: v[12],
            srq: u(13),
            mw: u(14),
        }
    }
}

/// What the prober brings of its own: ring memory, a doorbell, memory to register.
pub struct Own {
    ring: OwnedFd,
    doorbell: OwnedFd,
    buf: Arc<RegBuf>,
}

impl Own {
    pub fn new() -> Own {
        // SAFETY: memfd_create and eventfd with valid arguments; results checked.
        let (ring, doorbell) = unsafe {
            let m = libc::memfd_create(c"probe".as_ptr(), libc::MFD_CLOEXEC);
            let e = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            assert!(m >= 0 && e >= 0);
            assert_eq!(libc::ftruncate(m, 1 << 20), 0);
            (
                <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(m),
                <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(e),
            )
        };
        Own {
            ring,
            doorbell,
            buf: RegBuf::new(4096).unwrap(),
        }
    }
}

impl Default for Own {
    fn default() -> Self {
        Own::new()
    }
}

/// One command as a prober sends it.
pub struct Attempt {
    pub name: &'static str,
    pub cmd: u32,
    pub arg: Vec<u8>,
    /// Whether it names one of the other's objects (or its pending connection).
    pub names_other: bool,
}

fn bytes<T: bytemuck::Pod>(v: &T) -> Vec<u8> {
    bytemuck::bytes_of(v).to_vec()
}

fn destroy(handle: u32) -> Vec<u8> {
    bytes(&abi::Destroy { handle, _pad: 0 })
}

/// Every command of the ABI, filled in with `k`'s numbers (and `own` resources).
pub fn every_command(k: &Known, own: &Own) -> Vec<Attempt> {
    let mut cq = abi::CreateCq::zeroed();
    (cq.dev, cq.cqe, cq.memfd) = (k.dev, 16, own.ring.as_raw_fd());
    let mut qp = abi::CreateQp::zeroed();
    (qp.pd, qp.send_cq, qp.recv_cq, qp.qp_type) = (k.pd, k.cq, k.cq, 2);
    (
        qp.max_send_wr,
        qp.max_recv_wr,
        qp.max_send_sge,
        qp.max_recv_sge,
    ) = (4, 4, 1, 1);
    (qp.memfd, qp.doorbell_fd) = (own.ring.as_raw_fd(), own.doorbell.as_raw_fd());
    let mut to_error = abi::QpAttrs::zeroed();
    (to_error.handle, to_error.mask) = (k.qp, ual::QpAttrMask::STATE.bits());
    to_error.state = ual::QpState::Error as u8;
    let mut query_qp = abi::QpAttrs::zeroed();
    query_qp.handle = k.qp;
    let mut mr = abi::RegMr::zeroed();
    (mr.pd, mr.access, mr.addr, mr.length) = (
        k.pd,
        Access::LOCAL_WRITE.bits(),
        own.buf.as_ptr() as u64,
        own.buf.len() as u64,
    );
    let mut listen = abi::Listen::zeroed();
    (listen.dev, listen.backlog) = (k.dev, 4);
    let mut connect = abi::Connect::zeroed();
    connect.qp = k.qp;
    connect.addr = rnicpi::ip_to_gid("127.0.0.1".parse().unwrap());
    connect.port = 9;
    let mut accept = abi::Accept::zeroed();
    (
        accept.listen,
        accept.qp,
        accept.conn_id,
        accept.ird,
        accept.ord,
    ) = (k.listener, k.qp, k.conn_id, 1, 1);
    let mut reject = abi::Reject::zeroed();
    (reject.listen, reject.conn_id) = (k.listener, k.conn_id);
    let disconnect = abi::Disconnect {
        qp: k.qp,
        abortive: 1,
    };
    let mut srq = abi::CreateSrq::zeroed();
    (srq.pd, srq.max_wr, srq.max_sge, srq.memfd) = (k.pd, 4, 1, own.ring.as_raw_fd());
    let mut srq_attrs = abi::SrqAttrs::zeroed();
    (srq_attrs.handle, srq_attrs.limit) = (k.srq, 1);
    let mut mw = abi::AllocMw::zeroed();
    mw.pd = k.pd;
    let to_victim = rnicpi::AhAttr {
        dgid: rnicpi::ip_to_gid(std::net::Ipv4Addr::LOCALHOST.into()),
        ..Default::default()
    };
    let ah = abi::CreateAh::encode(k.pd, &to_victim);
    // A record naming the victim's PD and CQ as parents (on a device whose fast path is
    // the kAL's it is refused anyway; from another process it must never be looked at).
    let mut mirror = abi::Mirror::zeroed();
    (mirror.dev, mirror.kind, mirror.parents) = (k.dev, abi::MIRROR_QP, [k.pd, k.cq, k.cq, 0]);
    let mut port = abi::QueryPort::zeroed();
    (port.dev, port.port) = (k.dev, 1);
    let mut dev = abi::QueryDevice::zeroed();
    dev.dev = k.dev;
    let mut stat_dev = abi::StatDevice::zeroed();
    stat_dev.dev = k.dev;
    let mut pd = abi::AllocPd::zeroed();
    pd.dev = k.dev;
    let a = |name, cmd, arg, names_other| Attempt {
        name,
        cmd,
        arg,
        names_other,
    };
    let v = vec![
        a(
            "QUERY_ABI",
            cmd::QUERY_ABI,
            bytes(&abi::QueryAbi::zeroed()),
            false,
        ),
        a(
            "LIST_DEVICES",
            cmd::LIST_DEVICES,
            bytes(&abi::ListDevices::zeroed()),
            false,
        ),
        a("QUERY_DEVICE", cmd::QUERY_DEVICE, bytes(&dev), false),
        a("QUERY_PORT", cmd::QUERY_PORT, bytes(&port), false),
        a("ALLOC_PD", cmd::ALLOC_PD, bytes(&pd), false),
        a("DEALLOC_PD", cmd::DEALLOC_PD, destroy(k.pd), true),
        a("CREATE_CQ", cmd::CREATE_CQ, bytes(&cq), false),
        a("DESTROY_CQ", cmd::DESTROY_CQ, destroy(k.cq), true),
        a("CREATE_QP", cmd::CREATE_QP, bytes(&qp), true),
        a("MODIFY_QP", cmd::MODIFY_QP, bytes(&to_error), true),
        a("QUERY_QP", cmd::QUERY_QP, bytes(&query_qp), true),
        a("DESTROY_QP", cmd::DESTROY_QP, destroy(k.qp), true),
        a("REG_MR", cmd::REG_MR, bytes(&mr), true),
        a("DEREG_MR", cmd::DEREG_MR, destroy(k.mr), true),
        a("LISTEN", cmd::LISTEN, bytes(&listen), false),
        a(
            "DESTROY_LISTEN",
            cmd::DESTROY_LISTEN,
            destroy(k.listener),
            true,
        ),
        a("CONNECT", cmd::CONNECT, bytes(&connect), true),
        a("ACCEPT", cmd::ACCEPT, bytes(&accept), true),
        a("REJECT", cmd::REJECT, bytes(&reject), true),
        a("DISCONNECT", cmd::DISCONNECT, bytes(&disconnect), true),
        a(
            "STAT_CONTEXTS",
            cmd::STAT_CONTEXTS,
            bytes(&abi::StatContexts::zeroed()),
            false,
        ),
        a("STAT_DEVICE", cmd::STAT_DEVICE, bytes(&stat_dev), false),
        a("CREATE_SRQ", cmd::CREATE_SRQ, bytes(&srq), true),
        a("MODIFY_SRQ", cmd::MODIFY_SRQ, bytes(&srq_attrs), true),
        a("QUERY_SRQ", cmd::QUERY_SRQ, bytes(&srq_attrs), true),
        a("DESTROY_SRQ", cmd::DESTROY_SRQ, destroy(k.srq), true),
        a("ALLOC_MW", cmd::ALLOC_MW, bytes(&mw), true),
        a("DEALLOC_MW", cmd::DEALLOC_MW, destroy(k.mw), true),
        a("MIRROR", cmd::MIRROR, bytes(&mirror), true),
        a("CREATE_AH", cmd::CREATE_AH, bytes(&ah), true),
        // The victim holds no AH: the handle of another of its objects.
        a("DESTROY_AH", cmd::DESTROY_AH, destroy(k.mw), true),
    ];
    assert_eq!(v.len(), cmd::ALL.len(), "every command of the ABI is tried");
    v
}

/// A context with every kind of object and a connection request left unanswered,
/// through `door`: the numbers another process could try, the objects to check after.
pub struct Victim {
    pub ctx: Arc<Context>,
    _partner: Arc<Context>,
    pub known: Known,
    /// The address of the victim's device.
    pub addr: std::net::IpAddr,
    pub ends: (tools::perf::Endpoint, tools::perf::Endpoint),
    listener: Arc<ual::Listener>,
    /// The partner's connect to `listener`, waiting for its answer.
    pending: std::thread::JoinHandle<ual::Result<tools::perf::Endpoint>>,
    _extra: (Arc<ual::Srq>, Arc<ual::Mw>),
}

impl Victim {
    pub fn new(target: &Target, device: &str) -> Victim {
        let ctx = Context::open_target(target).unwrap();
        let partner = Context::open_target(target).unwrap();
        let (s, c) = connect_pair(&ctx, &partner, device, 4096, 8).unwrap();
        let dev = ctx.device(device).unwrap().index;
        let ip = tools::perf::loopback_of(&ctx, dev).unwrap();
        let listener = ctx
            .listen(dev, std::net::SocketAddr::new(ip, 0), 4)
            .unwrap();
        let to = std::net::SocketAddr::new(ip, listener.port);
        let p2 = partner.clone();
        let pdev = partner.device(device).unwrap().index;
        let pending = std::thread::spawn(move || connect_endpoint(&p2, pdev, to, 4096, 8));
        let req = listener.get_request(Duration::from_secs(20)).unwrap();
        let srq = ctx.create_srq(&s.pd, 16, 1).unwrap();
        let mw = ctx.alloc_mw(&s.pd).unwrap();
        let known = Known {
            ctx: ctx.id(),
            dev,
            pd: s.pd.handle,
            cq: s.cq.handle,
            qp: s.qp.handle,
            qpn: s.qp.qp_num,
            mr: s.mr.handle,
            lkey: s.mr.lkey,
            rkey: s.mr.rkey,
            addr: s.mr.addr,
            len: s.mr.len,
            listener: listener.handle,
            conn_id: req.conn_id,
            srq: srq.handle,
            mw: mw.handle,
        };
        Victim {
            ctx,
            _partner: partner,
            known,
            addr: ip,
            ends: (s, c),
            listener,
            pending,
            _extra: (srq, mw),
        }
    }

    /// Lay bait for a prober: receives posted on the victim's end of the connection and
    /// a pattern in its registration, which nothing of the prober's may complete or change.
    pub fn expose(&self) {
        let (s, _) = &self.ends;
        for i in 0..4 {
            s.post_recv(100 + i, 0, 64).unwrap();
        }
        s.buf.fill(0x3c);
    }

    /// Whether nothing completed on the victim's end and its registration still holds
    /// the pattern of [`expose`](Self::expose).
    pub fn untouched(&self) -> bool {
        let (s, _) = &self.ends;
        let mut c = [ual::Cqe::default(); 4];
        s.cq.poll(&mut c) == 0 && s.buf.to_vec().iter().all(|b| *b == 0x3c)
    }

    /// Everything still works: a round trip on the connection, and the pending request
    /// can still be accepted by us.
    pub fn check(self) {
        let (s, c) = &self.ends;
        s.post_recv(1, 0, 8).unwrap();
        c.send(2, 0, 8, ual::send_flags::SIGNALED).unwrap();
        s.complete(1).unwrap();
        c.complete(1).unwrap();
        say("INTACT", "round trip");
        let dev = self.known.dev;
        let ep = new_endpoint(&self.ctx, dev, 4096, 8).unwrap();
        self.listener
            .accept(self.known.conn_id, &ep.qp, &ep.offer())
            .unwrap();
        self.pending.join().unwrap().unwrap();
        say("ACCEPTED", self.known.conn_id);
    }
}
