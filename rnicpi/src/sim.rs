//! What a provider's engine needs to be stepped in a deterministic simulation, whatever
//! its transport: a seeded generator, an event log, and a QP together with what its
//! consumer holds (the posting ends of its rings, its CQ's polling end, one registered
//! buffer). siw's and rxe's simulations (`siw::sim`, `rxe::sim`) put their own link and
//! clock around these.

use crate::queue::ring_bytes;
use crate::*;
use parking_lot::Mutex;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};

/// A small seeded generator (SplitMix64): reproducible, no dependency.
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with a probability of `ppm` in a million.
    pub fn chance(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.next_u64() % 1_000_000 < u64::from(ppm)
    }

    /// A number in `0..=max`.
    pub fn upto(&mut self, max: u64) -> u64 {
        match max {
            u64::MAX => self.next_u64(),
            m => self.next_u64() % (m + 1),
        }
    }
}

/// Host services for a device that lives in a simulation or a test rig: no addresses to
/// list, no route to anything, no TCP; every link is `link_mtu` bytes (`None`: unknown).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoNetwork {
    pub link_mtu: Option<u32>,
}

impl KalServices for NoNetwork {
    fn addresses(&self) -> Vec<IfAddr> {
        Vec::new()
    }
    fn link_mtu(&self, _ifname: &str) -> Option<u32> {
        self.link_mtu
    }
    fn route(&self, _peer: IpAddr) -> Result<Route> {
        Err(VerbsError::Unreachable)
    }
    fn neighbour(&self, _ip: IpAddr) -> Option<[u8; 6]> {
        None
    }
    fn tcp_connect_start(&self, _peer: SocketAddr) -> Result<std::net::TcpStream> {
        Err(VerbsError::Unreachable)
    }
    fn tcp_listen(&self, _addr: SocketAddr, _backlog: u32) -> Result<std::net::TcpListener> {
        Err(VerbsError::Unsupported)
    }
}

/// The events delivered to a QP's or CQ's sink, in order.
#[derive(Debug, Default)]
pub struct Events(Mutex<Vec<Event>>);

impl Events {
    pub fn kinds(&self) -> Vec<EventKind> {
        self.0.lock().iter().map(|e| e.kind).collect()
    }

    /// The events delivered so far, oldest first.
    pub fn all(&self) -> Vec<Event> {
        self.0.lock().clone()
    }
}

impl EventSink for Events {
    fn deliver(&self, ev: Event) {
        self.0.lock().push(ev);
    }
}

/// The consumer's doorbell, as in embedded mode: the engine's doorbell runs in the
/// caller's (here: the simulation's) thread.
struct Bell(Weak<dyn ProviderQp>);

impl Doorbell for Bell {
    fn ring(&self) {
        if let Some(q) = self.0.upgrade() {
            q.doorbell();
        }
    }
}

/// A QP (RC unless made [`SimQp::with_type`]) of a provider with what its consumer
/// holds: the posting ends of its rings, its CQ's polling end, and one registered buffer
/// (local write, remote write and read).
pub struct SimQp {
    pub engine: Arc<dyn ProviderQp>,
    pub user: UserQp,
    pub cq: UserCq,
    pub events: Arc<Events>,
    pub mr: Arc<Region>,
    pub buf: Vec<u8>,
    _engine_cq: Arc<dyn ProviderCq>,
}

impl SimQp {
    /// A QP on `dev` (send and receive queues `depth` deep, one CQ for both) with a
    /// `len`-byte buffer registered in its own protection domain.
    pub fn new(dev: &dyn Provider, len: usize, depth: u32) -> SimQp {
        Self::with_type(dev, len, depth, QpType::Rc)
    }

    /// As [`SimQp::new`], a QP of service type `qp_type`.
    pub fn with_type(dev: &dyn Provider, len: usize, depth: u32, qp_type: QpType) -> SimQp {
        let pd = dev.alloc_pd().expect("pd");
        let cq_depth = (2 * depth).next_power_of_two();
        let cq_mem =
            Arc::new(SharedMem::create("sim-cq", ring_bytes::<Cqe>(cq_depth)).expect("cq"));
        let events = Arc::new(Events::default());
        let engine_cq = dev
            .create_cq(CqInit {
                depth: cq_depth,
                ring: Ring::attach(cq_mem.clone(), 0, cq_depth)
                    .expect("ring")
                    .producer(),
                sink: events.clone(),
                stats: Arc::new(RingStats::default()),
            })
            .expect("cq");
        let cq = UserCq::new(Ring::attach(cq_mem, 0, cq_depth).expect("ring").consumer());
        let layout = QpRingLayout::new(depth, depth).expect("layout");
        let mem = Arc::new(SharedMem::create("sim-qp", layout.total).expect("qp rings"));
        let ring = |off, cap| Ring::<Wqe>::attach(mem.clone(), off, cap).expect("ring");
        let caps = QpCaps {
            max_send_wr: depth,
            max_recv_wr: depth,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline: 64,
        };
        let engine = dev
            .create_qp(QpInit {
                qp_type,
                pd,
                send_cq: engine_cq.clone(),
                recv_cq: engine_cq.clone(),
                caps,
                sq: ring(layout.sq_offset, layout.sq_depth).consumer(),
                rq: ring(layout.rq_offset, layout.rq_depth).consumer(),
                srq: None,
                sink: events.clone(),
                stats: Arc::new(RingStats::default()),
            })
            .expect("qp");
        let user = UserQp::new(
            engine.qp_num(),
            caps,
            ring(layout.sq_offset, layout.sq_depth).producer(),
            ring(layout.rq_offset, layout.rq_depth).producer(),
            Arc::new(Bell(Arc::downgrade(&engine))),
        );
        let mut buf = vec![0u8; len];
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mr = dev
            .reg_mr(
                pd,
                buf.as_mut_ptr() as u64,
                len as u64,
                access,
                Arc::new(LocalMemory),
            )
            .expect("registration");
        SimQp {
            engine,
            user,
            cq,
            events,
            mr,
            buf,
            _engine_cq: engine_cq,
        }
    }

    /// `len` bytes of the buffer from `off`, as a gather/scatter element.
    pub fn sge(&self, off: u64, len: u32) -> Sge {
        Sge {
            addr: self.mr.base + off,
            length: len,
            lkey: self.mr.stag,
        }
    }

    /// Where a peer's RDMA reaches this buffer: (address, rkey).
    pub fn remote(&self) -> (u64, u32) {
        (self.mr.base, self.mr.stag)
    }

    /// Completions polled now.
    pub fn poll(&self) -> Vec<Cqe> {
        let mut out = vec![Cqe::default(); 64];
        let n = self.cq.poll(&mut out);
        out.truncate(n);
        out
    }
}
