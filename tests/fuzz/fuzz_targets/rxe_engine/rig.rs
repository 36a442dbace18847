//! The rig: one rxe device for the whole process (plain-UDP mode, on a loopback address
//! of its own), and per input a world on it — a PD, registrations in the checking arena,
//! a memory window, a CQ, the QP under test at RTS towards a fake peer, a listener — that
//! the records play against. Packets reach the device through `RxeDevice::receive`, the
//! receive thread's own hand-off; what the device sends goes to the fake peer's address,
//! where the rig reads it back to learn the IDs and PSNs a real peer would see.
//!
//! Over 600 lines: the fuzz rig and the decoder of its actions, which must change
//! together.

use crate::arena::Arena;
use crate::input::*;
use rnicpi::queue::ring_bytes;
use rnicpi::sim::NoNetwork;
use rnicpi::*;
use rxe::wire::cm::{self, CmMad, CmMessage, CmPath};
use rxe::wire::{
    cma, AethRepr, AtomicAckEthRepr, AtomicEthRepr, BthRepr, DethRepr, ExtHeader, IethRepr,
    ImmDtRepr, Opcode, RethRepr, RocePacket, RoceRepr, Syndrome,
};
use rxe::{RxeConfig, RxeDevice};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::{Arc, Mutex, OnceLock};

/// The fake peer's QP number.
const PEER_QPN: u32 = 0x4242;
/// The Q_Key of a UD QP under test.
const UD_QKEY: u32 = 0x1111_1111;
/// QPs a world may have besides the one under test (accepted or connecting).
const MAX_QPS: usize = 4;
/// Registrations: (length, writable, rights).
const MRS: [(u64, Access); 3] = [
    (
        4096,
        Access::LOCAL_WRITE
            .union(Access::REMOTE_WRITE)
            .union(Access::REMOTE_READ)
            .union(Access::REMOTE_ATOMIC)
            .union(Access::MW_BIND),
    ),
    (1024, Access::LOCAL_WRITE),
    (512, Access::REMOTE_READ),
];

/// What lives for the whole process.
pub struct Rig {
    dev: Arc<RxeDevice>,
    arena: Arc<Arena>,
    ip: Ipv4Addr,
    peer: Ipv4Addr,
    other: Ipv4Addr,
    /// The fake peer's port 4791: what the device sends it.
    wire: UdpSocket,
}

pub fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let pid = std::process::id();
        let addr = |a| Ipv4Addr::new(127, a, (pid >> 8) as u8, pid as u8);
        let (ip, peer, other) = (addr(99), addr(98), addr(97));
        let config = RxeConfig {
            name: "rxe0".into(),
            addr: Some(ip),
            port: rxe::wire::ROCEV2_UDP_PORT,
            raw: false,
            gso: false,
        };
        let dev = RxeDevice::new(
            config,
            // The device serves one address, so it never asks the host for a route,
            // and rxe has no TCP.
            Arc::new(NoNetwork::default()),
        )
        .expect("rxe device");
        // Bound as rxe binds its own (SO_REUSEADDR): beside a krdmad or an rxe0 holding
        // the RoCEv2 port's wildcard.
        let wire = rxe::bind_udp(std::net::SocketAddrV4::new(peer, rxe::wire::ROCEV2_UDP_PORT))
            .expect("peer port");
        wire.set_nonblocking(true).unwrap();
        let shape: Vec<(u64, bool)> = MRS
            .iter()
            .map(|(len, a)| {
                (
                    *len,
                    a.intersects(Access::LOCAL_WRITE | Access::REMOTE_WRITE),
                )
            })
            .collect();
        Rig {
            dev,
            arena: Arc::new(Arena::new(&shape)),
            ip,
            peer,
            other,
            wire,
        }
    })
}

/// A QP with both ends of its rings.
struct TestQp {
    engine: Arc<dyn ProviderQp>,
    user: UserQp,
}

struct Bell(Arc<dyn ProviderQp>);

impl Doorbell for Bell {
    fn ring(&self) {
        self.0.doorbell();
    }
}

/// Connection requests delivered to the listener.
#[derive(Default)]
struct Requests(Mutex<Vec<u64>>);

impl EventSink for Requests {
    fn deliver(&self, ev: Event) {
        if ev.kind == EventKind::ConnectRequest {
            let mut v = self.0.lock().unwrap();
            if v.len() < 64 {
                v.push(ev.conn_id);
            }
        }
    }
}

/// One input's world.
pub struct World {
    rig: &'static Rig,
    setup: Setup,
    mtu: u32,
    pd: u32,
    mrs: Vec<Arc<Region>>,
    window: u32,
    cq: Arc<dyn ProviderCq>,
    user_cq: UserCq,
    qps: Vec<TestQp>,
    listener: Arc<dyn ProviderListener>,
    port: u16,
    requests: Arc<Requests>,
    /// The PSN the QP under test's responder expects next (as far as the rig can tell).
    rq_psn: u32,
    /// The PSN of the last request the device sent to the fake peer.
    sq_psn: u32,
    /// Captured packets' first request and response PSNs (to rebase the others on).
    capture_req: Option<u32>,
    capture_resp: Option<u32>,
    /// Communication IDs the device used in MADs to the fake peer, newest last.
    seen_ids: Vec<u32>,
    wr_id: u64,
    /// An address handle to the fake peer (UD Sends of a UD QP under test name it).
    ah: u32,
}

/// A request's private data filled with `fill`, with an rdma_cm header from `src` to
/// `dst` at its start when `fill` is even.
fn cma_private_data<const N: usize>(fill: u8, src: Ipv4Addr, dst: Ipv4Addr) -> [u8; N] {
    let mut pdata = [fill; N];
    let hdr = cma::CmaHdr {
        src_port: 0xc001,
        src: src.into(),
        dst: dst.into(),
    };
    if fill & 1 == 0 {
        let _ = hdr.emit(&mut pdata);
    }
    pdata
}

fn ring<T: bytemuck::Pod>(mem: &Arc<SharedMem>, offset: usize, cap: u32) -> Ring<T> {
    Ring::attach(mem.clone(), offset, cap).expect("ring")
}

impl World {
    pub fn new(setup: Setup) -> World {
        let rig = rig();
        rig.arena.reset();
        let dev = &rig.dev;
        let pd = dev.alloc_pd().expect("pd");
        let mrs: Vec<Arc<Region>> = rig
            .arena
            .slots()
            .iter()
            .zip(MRS)
            .map(|(s, (_, access))| {
                dev.reg_mr(pd, s.base, s.len, access, rig.arena.clone())
                    .expect("registration")
            })
            .collect();
        let window = dev.alloc_mw(pd).expect("window");
        let peer_av = AhAttr {
            dgid: ip_to_gid(rig.peer.into()),
            ..AhAttr::default()
        };
        let ah = dev.create_ah(pd, &peer_av).expect("address handle");
        let mem = Arc::new(SharedMem::create("cq", ring_bytes::<Cqe>(64)).unwrap());
        let cq = dev
            .create_cq(CqInit {
                depth: 64,
                ring: ring::<Cqe>(&mem, 0, 64).producer(),
                sink: Arc::new(NullSink),
                stats: Arc::new(RingStats::default()),
            })
            .expect("cq");
        let user_cq = UserCq::new(ring::<Cqe>(&mem, 0, 64).consumer());
        let requests = Arc::new(Requests::default());
        let listener = dev
            .listen(
                SocketAddr::new(rig.ip.into(), 0),
                setup.backlog.max(1) as u32,
                requests.clone(),
            )
            .expect("listener");
        let port = listener.local_addr().port();
        let mtu = 128u32 << setup.mtu.clamp(1, 5);
        let mut w = World {
            rig,
            setup,
            mtu,
            pd,
            mrs,
            window,
            cq,
            user_cq,
            qps: Vec::new(),
            listener,
            port,
            requests,
            rq_psn: setup.rq_psn & 0xff_ffff,
            sq_psn: setup.sq_psn & 0xff_ffff,
            capture_req: None,
            capture_resp: None,
            seen_ids: Vec::new(),
            wr_id: 0,
            ah,
        };
        let qp = w.new_qp(setup.qp_type());
        w.bring_up(&qp);
        w.qps.push(qp);
        w
    }

    fn new_qp(&self, qp_type: QpType) -> TestQp {
        let caps = QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline: 64,
        };
        let layout = QpRingLayout::new(16, 16).unwrap();
        let mem = Arc::new(SharedMem::create("qp", layout.total).unwrap());
        let (sq, rq) = (layout.sq_offset, layout.rq_offset);
        let engine = self
            .rig
            .dev
            .create_qp(QpInit {
                qp_type,
                pd: self.pd,
                send_cq: self.cq.clone(),
                recv_cq: self.cq.clone(),
                caps,
                sq: ring::<Wqe>(&mem, sq, layout.sq_depth).consumer(),
                rq: ring::<Wqe>(&mem, rq, layout.rq_depth).consumer(),
                srq: None,
                sink: Arc::new(NullSink),
                stats: Arc::new(RingStats::default()),
            })
            .expect("qp");
        let user = UserQp::new(
            engine.qp_num(),
            caps,
            ring::<Wqe>(&mem, sq, layout.sq_depth).producer(),
            ring::<Wqe>(&mem, rq, layout.rq_depth).producer(),
            Arc::new(Bell(engine.clone())),
        );
        TestQp { engine, user }
    }

    /// The QP under test: Init with the setup's rights, RTR and RTS towards the fake peer
    /// (no ACK timeout, so no timer fires behind the input's back).
    fn bring_up(&self, qp: &TestQp) {
        let s = self.setup;
        if s.ud {
            let q = &qp.engine;
            let init = QpAttr {
                state: QpState::Init,
                qkey: UD_QKEY,
                ..QpAttr::default()
            };
            q.modify(&init, QpAttrMask::STATE | QpAttrMask::QKEY)
                .unwrap();
            let rtr = QpAttr {
                state: QpState::Rtr,
                ..QpAttr::default()
            };
            q.modify(&rtr, QpAttrMask::STATE).unwrap();
            let rts = QpAttr {
                state: QpState::Rts,
                sq_psn: self.sq_psn,
                ..QpAttr::default()
            };
            q.modify(&rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN)
                .unwrap();
            return;
        }
        let mut rights = Access::empty();
        for (bit, r) in [
            Access::REMOTE_WRITE,
            Access::REMOTE_READ,
            Access::REMOTE_ATOMIC,
        ]
        .into_iter()
        .enumerate()
        {
            if s.rights & (1 << bit) != 0 {
                rights |= r;
            }
        }
        let q = &qp.engine;
        let init = QpAttr {
            state: QpState::Init,
            access: rights,
            ..QpAttr::default()
        };
        q.modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)
            .unwrap();
        let rtr = QpAttr {
            state: QpState::Rtr,
            path_mtu: self.mtu,
            dest_qpn: PEER_QPN,
            rq_psn: self.rq_psn,
            max_dest_rd_atomic: s.ird,
            min_rnr_timer: 1,
            dgid: ip_to_gid(self.rig.peer.into()),
            ..QpAttr::default()
        };
        let uc = s.qp_type() == QpType::Uc;
        let masks = match uc {
            true => (QpAttrMask::UC_RTR, QpAttrMask::UC_RTS),
            false => (QpAttrMask::RC_RTR, QpAttrMask::RC_RTS),
        };
        q.modify(&rtr, masks.0).unwrap();
        let rts = QpAttr {
            state: QpState::Rts,
            sq_psn: self.sq_psn,
            timeout: 0,
            retry_cnt: 7,
            rnr_retry: 0,
            max_rd_atomic: s.ord,
            ..QpAttr::default()
        };
        q.modify(&rts, masks.1).unwrap();
    }

    fn qpn(&self) -> u32 {
        self.qps[0].engine.qp_num()
    }

    /// The key `k` names.
    fn key(&self, k: Key) -> u32 {
        let n = self.mrs.len();
        match k {
            Key::Mr(i) => self.mrs[i as usize % n].stag,
            Key::Window => self.window,
            Key::Near { mr, delta } => self.mrs[mr as usize % n]
                .stag
                .wrapping_add(delta as i32 as u32),
            Key::Any(v) => v,
        }
    }

    /// The address `r` names: its key's registration's start plus the offset.
    fn remote(&self, r: Remote) -> (u64, u32) {
        let mr = match r.key {
            Key::Mr(i) | Key::Near { mr: i, .. } => &self.mrs[i as usize % self.mrs.len()],
            _ => &self.mrs[0],
        };
        (
            mr.base.wrapping_add(r.offset as i64 as u64),
            self.key(r.key),
        )
    }

    fn sge(&self, b: Buf) -> Sge {
        let mr = &self.mrs[b.mr as usize % self.mrs.len()];
        Sge {
            addr: mr.base.wrapping_add(b.offset as i64 as u64),
            length: b.len as u32 % (2 * mr.len as u32 + 1),
            lkey: mr.stag,
        }
    }

    fn send(&self, src: Ipv4Addr, repr: &RoceRepr<'_>) {
        if let Ok(bytes) = repr.to_vec() {
            let (dev, dst) = (&self.rig.dev, self.rig.ip.into());
            if self.setup.polled {
                dev.receive_polled(src.into(), dst, 0xc000, &bytes);
            } else {
                dev.receive(src.into(), dst, 0xc000, &bytes);
            }
        }
    }

    /// Play one record.
    pub fn play(&mut self, r: &Record) {
        match r {
            Record::Capture(bytes) => self.capture(bytes),
            Record::Act(a) => self.act(*a),
        }
        self.observe();
    }

    /// A captured packet, readdressed to this world.
    fn capture(&mut self, bytes: &[u8]) {
        let Ok(p) = RocePacket::new_checked(bytes) else {
            return;
        };
        let Ok(mut r) = RoceRepr::parse(&p) else {
            return;
        };
        let mad;
        if r.bth.dest_qp == rxe::wire::deth::GSI_QPN {
            let Ok(mut m) = CmMad::parse(r.payload) else {
                return;
            };
            if let CmMessage::Req(req) = &mut m.message {
                req.service_id = cma::service_id_tcp(self.port);
            }
            mad = m.to_bytes();
            r.payload = &mad;
            return self.send(self.rig.peer, &r);
        }
        r.bth.dest_qp = self.qpn();
        let (base, ours) = match r.bth.opcode.direction() {
            rxe::wire::Direction::Request => (&mut self.capture_req, self.rq_psn),
            rxe::wire::Direction::Response => (&mut self.capture_resp, self.sq_psn),
        };
        let first = *base.get_or_insert(r.bth.psn);
        r.bth.psn = ours.wrapping_add(r.bth.psn.wrapping_sub(first)) & 0xff_ffff;
        let n = self.mrs.len();
        if let Some(reth) = r.reth.as_mut() {
            let mr = &self.mrs[reth.rkey as usize % n];
            reth.va = mr.base + reth.va % mr.len;
            reth.rkey = mr.stag;
        }
        if let Some(a) = r.atomic_eth.as_mut() {
            let mr = &self.mrs[a.rkey as usize % n];
            a.va = mr.base + ((a.va % mr.len) & !7);
            a.rkey = mr.stag;
        }
        if let Some(i) = r.ieth.as_mut() {
            i.rkey = self.window;
        }
        let is_request = r.bth.opcode.direction() == rxe::wire::Direction::Request;
        let psn = r.bth.psn;
        self.send(self.rig.peer, &r);
        if is_request && psn == self.rq_psn {
            self.rq_psn = (psn + 1) & 0xff_ffff;
        }
    }

    fn act(&mut self, a: Action) {
        if !matches!(a, Action::Request(_) | Action::Response(_)) {
            self.rig.dev.send_held(); // the consumer polls
        }
        match a {
            Action::Request(q) => self.request(q),
            Action::Response(r) => self.response(r),
            Action::Mad(m) => self.mad(m),
            Action::PostSend(p) => self.post_send(p),
            Action::PostRecv { qp, buf } => {
                let q = &self.qps[qp as usize % self.qps.len()];
                self.wr_id += 1;
                let _ = q.user.post_recv(&Wqe::recv(self.wr_id, &[self.sge(buf)]));
            }
            Action::Connect { ird, ord } => {
                if self.qps.len() <= MAX_QPS {
                    let qp = self.new_qp(QpType::Rc);
                    let param = ConnParam {
                        private_data: b"fuzz".to_vec(),
                        ird: ird as u32 % 20,
                        ord: ord as u32 % 20,
                    };
                    let to = SocketAddr::new(self.rig.peer.into(), 7000);
                    let _ = self.rig.dev.connect(&qp.engine, to, param);
                    self.qps.push(qp);
                }
            }
            Action::Accept { which, ird, ord } => {
                let id = self.request_id(which);
                if self.qps.len() <= MAX_QPS {
                    let qp = self.new_qp(QpType::Rc);
                    let param = ConnParam {
                        private_data: b"welcome".to_vec(),
                        ird: ird as u32 % 20,
                        ord: ord as u32 % 20,
                    };
                    let _ = self.listener.accept(id, &qp.engine, param);
                    self.qps.push(qp);
                }
            }
            Action::Reject { which } => {
                let id = self.request_id(which);
                let _ = self.listener.reject(id, b"no");
            }
            Action::Disconnect { qp, abortive } => {
                let _ = self.qps[qp as usize % self.qps.len()]
                    .engine
                    .disconnect(abortive);
            }
        }
    }

    fn request_id(&self, which: u8) -> u64 {
        let v = self.requests.0.lock().unwrap();
        match v.len() {
            0 => which as u64,
            n => v[which as usize % n],
        }
    }

    fn request(&mut self, q: Request) {
        use RequestOp::*;
        let op = match q.op {
            SendFirst => Opcode::RcSendFirst,
            SendMiddle => Opcode::RcSendMiddle,
            SendLast => Opcode::RcSendLast,
            SendLastImm => Opcode::RcSendLastImm,
            SendLastInv => Opcode::RcSendLastInv,
            SendOnly => Opcode::RcSendOnly,
            SendOnlyImm => Opcode::RcSendOnlyImm,
            SendOnlyInv => Opcode::RcSendOnlyInv,
            WriteFirst => Opcode::RcRdmaWriteFirst,
            WriteMiddle => Opcode::RcRdmaWriteMiddle,
            WriteLast => Opcode::RcRdmaWriteLast,
            WriteLastImm => Opcode::RcRdmaWriteLastImm,
            WriteOnly => Opcode::RcRdmaWriteOnly,
            WriteOnlyImm => Opcode::RcRdmaWriteOnlyImm,
            ReadRequest => Opcode::RcRdmaReadRequest,
            CompareSwap => Opcode::RcCompareSwap,
            FetchAdd => Opcode::RcFetchAdd,
            UdSendOnly => Opcode::UdSendOnly,
            UdSendOnlyImm => Opcode::UdSendOnlyImm,
        };
        let psn = self.rq_psn.wrapping_add(q.psn as i32 as u32) & 0xff_ffff;
        let mut bth = BthRepr::new(op, self.qpn(), psn);
        bth.ack_req = q.ack_req;
        bth.solicited = q.solicited;
        let carries = !matches!(q.op, ReadRequest | CompareSwap | FetchAdd);
        let len = if carries {
            q.payload as usize % (self.mtu as usize + 17)
        } else {
            0
        };
        let payload = vec![q.fill; len];
        let mut r = RoceRepr::new(bth, &payload);
        let (va, rkey) = self.remote(q.remote);
        if op.has(ExtHeader::Reth) {
            let dma_len = match q.dma_len {
                DmaLen::Payload if q.op == ReadRequest => q.payload as u32 * 8,
                DmaLen::Payload => len as u32,
                DmaLen::Small(n) => n as u32,
                DmaLen::Any(n) => n,
            };
            r.reth = Some(RethRepr { va, rkey, dma_len });
        }
        if op.has(ExtHeader::AtomicEth) {
            r.atomic_eth = Some(AtomicEthRepr {
                va,
                rkey,
                swap_add: q.swap_add,
                compare: q.compare,
            });
        }
        if op.has(ExtHeader::ImmDt) {
            r.immdt = Some(ImmDtRepr { imm: q.imm });
        }
        if op.has(ExtHeader::Ieth) {
            r.ieth = Some(IethRepr {
                rkey: self.key(q.inv),
            });
        }
        if op.has(ExtHeader::Deth) {
            r.deth = Some(DethRepr {
                qkey: if q.ack_req { UD_QKEY } else { q.imm },
                src_qp: PEER_QPN,
            });
        }
        self.send(self.rig.peer, &r);
        if psn == self.rq_psn {
            let n = match (q.op, r.reth) {
                (ReadRequest, Some(reth)) => (reth.dma_len as u64).div_ceil(self.mtu as u64).max(1),
                _ => 1,
            };
            self.rq_psn = (psn as u64 + n.min(1 << 23)) as u32 & 0xff_ffff;
        }
    }

    fn response(&mut self, s: Response) {
        use ResponseOp::*;
        let op = match s.op {
            Ack => Opcode::RcAcknowledge,
            ReadFirst => Opcode::RcRdmaReadResponseFirst,
            ReadMiddle => Opcode::RcRdmaReadResponseMiddle,
            ReadLast => Opcode::RcRdmaReadResponseLast,
            ReadOnly => Opcode::RcRdmaReadResponseOnly,
            AtomicAck => Opcode::RcAtomicAcknowledge,
        };
        let psn = self.sq_psn.wrapping_add(s.psn as i32 as u32) & 0xff_ffff;
        let len = if matches!(s.op, Ack | AtomicAck) {
            0
        } else {
            s.payload as usize % (self.mtu as usize + 17)
        };
        let payload = vec![s.fill; len];
        let mut r = RoceRepr::new(BthRepr::new(op, self.qpn(), psn), &payload);
        if op.has(ExtHeader::Aeth) {
            let Ok(syndrome) = Syndrome::from_u8(s.syndrome) else {
                return;
            };
            r.aeth = Some(AethRepr {
                syndrome,
                msn: s.msn as u32,
            });
        }
        if op.has(ExtHeader::AtomicAckEth) {
            r.atomic_ack_eth = Some(AtomicAckEthRepr { orig: s.orig });
        }
        self.send(self.rig.peer, &r);
    }

    fn comm_id(&self, c: CommId) -> u32 {
        match c {
            CommId::Seen(n) if !self.seen_ids.is_empty() => {
                let v = &self.seen_ids;
                v[v.len() - 1 - n as usize % v.len()]
            }
            CommId::Seen(n) | CommId::Ours(n) => 0x5eed_0000 + (n % 4) as u32,
            CommId::Any(v) => v,
        }
    }

    fn mad(&mut self, m: Mad) {
        let local = self.comm_id(m.local_id);
        let remote = self.comm_id(m.remote_id);
        let qpn = match m.qpn {
            Qpn::Device(n) => self.qps[n as usize % self.qps.len()].engine.qp_num(),
            Qpn::Peer => PEER_QPN,
            Qpn::Any(v) => v & 0xff_ffff,
        };
        let (src, dst) = (self.rig.peer, self.rig.ip);
        let message = match m.kind {
            MadKind::Req => {
                let private_data = cma_private_data(m.pdata, src, dst);
                CmMessage::Req(cm::Req {
                    local_comm_id: local,
                    service_id: cma::service_id_tcp(m.port.unwrap_or(self.port)),
                    local_ca_guid: 0x0200_5eff_fe00_4242,
                    local_qkey: 0,
                    local_qpn: qpn,
                    responder_resources: m.ird,
                    local_eecn: 0,
                    initiator_depth: m.ord,
                    remote_eecn: 0,
                    remote_cm_response_timeout: m.timeout & 0x1f,
                    transport_service_type: cm::transport_type::RC,
                    end_to_end_flow_control: false,
                    starting_psn: m.psn & 0xff_ffff,
                    local_cm_response_timeout: m.timeout & 0x1f,
                    retry_count: 7,
                    pkey: 0xffff,
                    path_mtu: m.mtu & 0xf,
                    rdc_exists: false,
                    rnr_retry_count: 7,
                    max_cm_retries: m.retries & 0xf,
                    srq: false,
                    extended_transport_type: 0,
                    primary_path: CmPath {
                        local_lid: 0xffff,
                        remote_lid: 0xffff,
                        local_gid: ip_to_gid(src.into()),
                        remote_gid: ip_to_gid(dst.into()),
                        hop_limit: 64,
                        ..CmPath::default()
                    },
                    alternate_path: CmPath::default(),
                    sap_supported: false,
                    private_data,
                })
            }
            MadKind::Mra => CmMessage::Mra(cm::Mra {
                local_comm_id: local,
                remote_comm_id: remote,
                message_mraed: m.which & 3,
                service_timeout: m.timeout & 0x1f,
                private_data: [m.pdata; cm::MRA_PRIVATE_DATA_LEN],
            }),
            MadKind::Rej => CmMessage::Rej(cm::Rej {
                local_comm_id: local,
                remote_comm_id: remote,
                message_rejected: m.which & 3,
                rejected_info_length: 0,
                reason: m.reason,
                ari: [0; cm::REJ_ARI_LEN],
                private_data: [m.pdata; cm::REJ_PRIVATE_DATA_LEN],
            }),
            MadKind::Rep => CmMessage::Rep(cm::Rep {
                local_comm_id: local,
                remote_comm_id: remote,
                local_qkey: 0,
                local_qpn: qpn,
                local_eecn: 0,
                starting_psn: m.psn & 0xff_ffff,
                responder_resources: m.ird,
                initiator_depth: m.ord,
                target_ack_delay: 0,
                failover_accepted: 0,
                end_to_end_flow_control: false,
                rnr_retry_count: 7,
                srq: false,
                local_ca_guid: 0x0200_5eff_fe00_4242,
                private_data: [m.pdata; cm::REP_PRIVATE_DATA_LEN],
            }),
            MadKind::Rtu => CmMessage::Rtu(cm::Rtu {
                local_comm_id: local,
                remote_comm_id: remote,
                private_data: [m.pdata; cm::RTU_PRIVATE_DATA_LEN],
            }),
            MadKind::Dreq => CmMessage::Dreq(cm::Dreq {
                local_comm_id: local,
                remote_comm_id: remote,
                remote_qpn: qpn,
                private_data: [m.pdata; cm::DREQ_PRIVATE_DATA_LEN],
            }),
            MadKind::Drep => CmMessage::Drep(cm::Drep {
                local_comm_id: local,
                remote_comm_id: remote,
                private_data: [m.pdata; cm::DREP_PRIVATE_DATA_LEN],
            }),
            MadKind::SidrReq => CmMessage::SidrReq(cm::SidrReq {
                request_id: local,
                pkey: 0xffff,
                service_id: cma::service_id_udp(m.port.unwrap_or(self.port)),
                private_data: cma_private_data(m.pdata, src, dst),
            }),
            MadKind::SidrRep => CmMessage::SidrRep(cm::SidrRep {
                request_id: remote,
                status: m.which,
                additional_info_length: 0,
                qpn,
                service_id: cma::service_id_udp(m.port.unwrap_or(self.port)),
                qkey: UD_QKEY,
                additional_info: [0; cm::SIDR_REP_INFO_LEN],
                private_data: [m.pdata; cm::SIDR_REP_PRIVATE_DATA_LEN],
            }),
        };
        let bytes = CmMad::new(m.psn as u64, message).to_bytes();
        let repr = cm::gsi_packet(&bytes, 0xffff, 0);
        let from = if m.from_peer {
            self.rig.peer
        } else {
            self.rig.other
        };
        self.send(from, &repr);
    }

    fn post_send(&mut self, p: PostSend) {
        let op = match p.op {
            SendOp::Send => WrOpcode::Send,
            SendOp::SendWithImm => WrOpcode::SendWithImm,
            SendOp::SendWithInv => WrOpcode::SendWithInv,
            SendOp::RdmaWrite => WrOpcode::RdmaWrite,
            SendOp::RdmaWriteWithImm => WrOpcode::RdmaWriteWithImm,
            SendOp::RdmaRead => WrOpcode::RdmaRead,
            SendOp::AtomicCmpSwp => WrOpcode::AtomicCmpSwp,
            SendOp::AtomicFetchAdd => WrOpcode::AtomicFetchAdd,
            SendOp::LocalInv => WrOpcode::LocalInv,
            SendOp::BindMw => WrOpcode::BindMw,
        };
        self.wr_id += 1;
        let (va, rkey) = self.remote(p.remote);
        let mut flags = 0;
        if p.signaled {
            flags |= send_flags::SIGNALED;
        }
        if p.fence {
            flags |= send_flags::FENCE;
        }
        let wqe = if op == WrOpcode::BindMw {
            let mut rights = Access::empty();
            for (bit, r) in [
                Access::REMOTE_WRITE,
                Access::REMOTE_READ,
                Access::REMOTE_ATOMIC,
            ]
            .into_iter()
            .enumerate()
            {
                if p.rights & (1 << bit) != 0 {
                    rights |= r;
                }
            }
            let sge = self.sge(p.buf);
            // A new key byte for the window on each bind, as verbs consumers do.
            self.window = (self.window & !0xff) | (self.window.wrapping_add(1) & 0xff);
            Wqe::bind_mw(
                self.wr_id,
                self.window,
                self.key(p.key),
                sge.addr,
                sge.length as u64,
                rights,
            )
        } else {
            let sge = self.sge(p.buf);
            let mut w = Wqe::new(self.wr_id, op, &[sge])
                .with_remote(va, rkey)
                .with_imm(self.key(p.key))
                .with_flags(flags);
            w.compare_add = p.compare;
            w.swap = p.swap;
            if p.inline {
                let data = vec![0x5a; (sge.length as usize).min(64)];
                w = w.with_inline(&data).unwrap_or(w);
            }
            w
        };
        let i = p.qp as usize % self.qps.len();
        // The UD QP under test addresses every request (the controlled Q_Key on fenced
        // ones); an RC QP's fields are its own.
        let wqe = if i == 0 && self.setup.ud {
            let qkey = if p.fence { 0x8000_0000 } else { UD_QKEY };
            wqe.with_ud(self.ah, PEER_QPN, qkey)
        } else {
            wqe
        };
        let _ = self.qps[i].user.post_send(&wqe);
    }

    /// What the device sent the fake peer: CM IDs and the PSNs of its requests.
    fn observe(&mut self) {
        let mut b = [0u8; 9000];
        while let Ok(n) = self.rig.wire.recv(&mut b) {
            let Ok(p) = RocePacket::new_checked(&b[..n]) else {
                continue;
            };
            let Ok(r) = RoceRepr::parse(&p) else {
                continue;
            };
            if r.bth.dest_qp == rxe::wire::deth::GSI_QPN {
                if let Ok(m) = CmMad::parse(r.payload) {
                    let id = match m.message {
                        CmMessage::Req(x) => x.local_comm_id,
                        CmMessage::Rep(x) => x.local_comm_id,
                        CmMessage::Rej(x) => x.local_comm_id,
                        CmMessage::Mra(x) => x.local_comm_id,
                        CmMessage::Rtu(x) => x.local_comm_id,
                        CmMessage::Dreq(x) => x.local_comm_id,
                        CmMessage::Drep(x) => x.local_comm_id,
                        CmMessage::SidrReq(x) => x.request_id,
                        CmMessage::SidrRep(x) => x.request_id,
                    };
                    if id != 0 && !self.seen_ids.contains(&id) {
                        if self.seen_ids.len() == 16 {
                            self.seen_ids.remove(0);
                        }
                        self.seen_ids.push(id);
                    }
                }
            } else if r.bth.opcode.direction() == rxe::wire::Direction::Request {
                self.sq_psn = r.bth.psn;
            }
        }
    }

    /// The bounds that must hold after every step.
    pub fn check(&self) {
        let mut cqes = [Cqe::default(); 64];
        while self.user_cq.poll(&mut cqes) > 0 {}
        for q in &self.qps {
            let ird = q.engine.query().max_dest_rd_atomic.max(1) as u64;
            for (name, v) in q.engine.counters() {
                if name == "resp_queued" {
                    assert!(v <= 4 * ird + 1, "responder queue {v} with IRD {ird}");
                }
            }
        }
        let backlog = self.setup.backlog.max(1) as u64;
        for (name, v) in self.rig.dev.counters() {
            if name == "cm_requests_waiting" {
                assert!(v <= backlog, "{v} requests wait, backlog {backlog}");
            }
        }
        assert!(
            self.rig.arena.guards_intact(),
            "a guard byte around a registration changed"
        );
    }

    /// Tear the world down (the device stays).
    pub fn finish(self) {
        for q in &self.qps {
            q.engine.destroy();
        }
        self.listener.close();
        let dev = &self.rig.dev;
        let _ = dev.destroy_ah(self.ah);
        let _ = dev.dealloc_mw(self.window);
        for mr in &self.mrs {
            let _ = dev.dereg_mr(mr.stag);
        }
        self.cq.destroy();
        dev.dealloc_pd(self.pd);
        self.check();
    }
}
