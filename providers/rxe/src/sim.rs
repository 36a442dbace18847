//! rxe devices on a simulated clock and a simulated link, in one thread: the engine's own
//! test bed (no socket, no thread, no root), in the manner of quinn-proto's test pairs.
//!
//! A [`Sim`] holds the clock, the link and the devices on it. The devices are the real
//! engine (QPs, requester, completer, responder, connection manager, timers, transmit
//! queue) assembled with the link as their [`Wire`], the simulation's [`Clock`] and
//! identifiers drawn from its seed; the simulation plays their three threads: [`Sim::step`]
//! delivers the datagrams that are due, fires the timers that are due and runs the QPs
//! queued for transmit, and [`Sim::run_until`] moves the clock to the next thing due when
//! nothing is left to do now. The link loses, duplicates and delays (so reorders) datagrams
//! as its [`Impairment`] says, drawing from one seeded generator in a fixed order, so a
//! seed replays exactly (the same datagrams at the same times: [`Sim::digest`]). Datagrams
//! carry no ICRC here: the engine is fed what the receive thread hands it after checking
//! one (the framing has its own tests and fuzz target).
//!
//! [`SimQp`] is a QP with the consumer's ends of its rings and a registered buffer, for
//! tests to post to and poll as a verbs consumer would.

use crate::device::RxeDevice;
use crate::net::Wire;
use crate::qp::RxeQp;
use crate::timer::Clock;
use crate::wire::{RocePacket, RoceRepr};
use crate::RxeConfig;
use parking_lot::Mutex;
pub use rnicpi::sim::{Events, SimQp};
use rnicpi::sim::{NoNetwork, SimRng};
use rnicpi::*;
use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// What the link does to datagrams (probabilities in parts per million).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Impairment {
    /// One-way delay of every datagram.
    pub latency: Duration,
    /// Extra delay drawn uniformly from `0..=jitter` per datagram (reorders them).
    pub jitter: Duration,
    pub loss_ppm: u32,
    pub duplicate_ppm: u32,
}

impl Impairment {
    /// A perfect link with 10 µs of delay.
    pub const CLEAN: Impairment = Impairment {
        latency: Duration::from_micros(10),
        jitter: Duration::ZERO,
        loss_ppm: 0,
        duplicate_ppm: 0,
    };
    /// A link that carries nothing.
    pub const CUT: Impairment = Impairment {
        loss_ppm: 1_000_000,
        ..Impairment::CLEAN
    };
}

/// What the link did, for tests to check they exercised what they meant to.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LinkStats {
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub delivered: u64,
}

/// A delay in `0..=d` drawn from `rng` (nothing drawn for a zero `d`).
fn jitter(rng: &mut SimRng, d: Duration) -> Duration {
    match d.as_nanos() as u64 {
        0 => Duration::ZERO,
        n => Duration::from_nanos(rng.upto(n)),
    }
}

struct Datagram {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    bytes: Vec<u8>,
}

struct LinkState {
    rng: SimRng,
    impairment: Impairment,
    /// In flight, by (delivery time, sequence number): delivered in that order.
    in_flight: BTreeMap<(Instant, u64), Datagram>,
    seq: u64,
    stats: LinkStats,
    /// Datagrams sent, by source address.
    sent_from: BTreeMap<IpAddr, u64>,
    /// A digest of every datagram sent, in order: when, between whom, and its bytes.
    digest: Fnv,
}

/// FNV-1a over the datagrams a link carries: two runs that send the same datagrams at the
/// same simulated times in the same order have the same digest.
struct Fnv(u64);

impl Fnv {
    const START: Fnv = Fnv(0xcbf2_9ce4_8422_2325);

    fn add(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// A datagram, but for the memory keys and addresses its headers may carry: those are
    /// random (keys) or wherever the heap put the buffer (addresses), so they differ from
    /// run to run.
    fn add_packet(&mut self, roce: &[u8]) {
        self.add(&(roce.len() as u64).to_le_bytes());
        let Ok(r) = RocePacket::new_checked(roce).and_then(|p| RoceRepr::parse(&p)) else {
            return self.add(roce);
        };
        let fields = format!(
            "{:?} {:?} {:?} {:?} {:?} {:?}",
            r.bth,
            r.aeth,
            r.immdt,
            r.atomic_ack_eth,
            r.reth.map(|h| h.dma_len),
            r.atomic_eth.map(|h| (h.swap_add, h.compare)),
        );
        self.add(fields.as_bytes());
        self.add(r.payload);
    }
}

/// The simulated link every device of a [`Sim`] transmits on.
pub struct SimLink {
    clock: Arc<Mutex<Instant>>,
    start: Instant,
    state: Mutex<LinkState>,
    /// Host time each send spends before it reaches the link, as a `sendmsg` would (0
    /// but in tests of threads sending at once; simulated time does not move).
    send_cost_ns: std::sync::atomic::AtomicU64,
}

impl Wire for SimLink {
    fn send(
        &self,
        src: IpAddr,
        dst: IpAddr,
        sport: u16,
        _dport: u16,
        roce: &mut [u8],
    ) -> io::Result<()> {
        let cost = self.send_cost_ns.load(std::sync::atomic::Ordering::Relaxed);
        let t = Instant::now();
        while t.elapsed().as_nanos() < u128::from(cost) {
            std::hint::spin_loop();
        }
        let now = *self.clock.lock();
        let mut st = self.state.lock();
        st.stats.sent += 1;
        *st.sent_from.entry(src).or_default() += 1;
        let d = &mut st.digest;
        d.add(&(now - self.start).as_nanos().to_le_bytes());
        d.add(&ip_bytes(src));
        d.add(&ip_bytes(dst));
        d.add(&sport.to_le_bytes());
        d.add_packet(roce);
        let imp = st.impairment;
        if st.rng.chance(imp.loss_ppm) {
            st.stats.lost += 1;
            return Ok(());
        }
        let copies = if st.rng.chance(imp.duplicate_ppm) {
            st.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = now + imp.latency + jitter(&mut st.rng, imp.jitter);
            st.seq += 1;
            let key = (at, st.seq);
            st.in_flight.insert(
                key,
                Datagram {
                    src,
                    dst,
                    sport,
                    bytes: roce.to_vec(),
                },
            );
        }
        Ok(())
    }

    fn has_ipv6(&self) -> bool {
        false
    }
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

struct Node {
    addr: IpAddr,
    dev: Arc<RxeDevice>,
    tx: crossbeam_channel::Receiver<Weak<RxeQp>>,
}

/// A simulated clock, a link and the devices on it.
pub struct Sim {
    seed: u64,
    clock: Arc<Mutex<Instant>>,
    link: Arc<SimLink>,
    nodes: Vec<Node>,
    start: Instant,
    /// Datagrams are received as a polling consumer receives them ([`Sim::set_polled`]).
    polled: bool,
}

impl Sim {
    /// A simulation whose link draws from `seed`.
    pub fn new(seed: u64, impairment: Impairment) -> Sim {
        let start = Instant::now();
        let clock = Arc::new(Mutex::new(start));
        let link = Arc::new(SimLink {
            clock: clock.clone(),
            start,
            state: Mutex::new(LinkState {
                rng: SimRng::new(seed),
                impairment,
                in_flight: BTreeMap::new(),
                seq: 0,
                stats: LinkStats::default(),
                sent_from: BTreeMap::new(),
                digest: Fnv::START,
            }),
            send_cost_ns: Default::default(),
        });
        Sim {
            seed,
            clock,
            link,
            nodes: Vec::new(),
            start,
            polled: false,
        }
    }

    /// Receive datagrams as a polling consumer's thread does in embedded mode: the
    /// positive acknowledgements they draw wait for the QP's next datagrams or for the
    /// consumers' next poll, which the simulation takes before its clock moves on.
    pub fn set_polled(&mut self, polled: bool) {
        self.polled = polled;
    }

    /// A device serving `addr` on the link.
    pub fn add_device(&mut self, name: &str, addr: Ipv4Addr) -> Arc<RxeDevice> {
        let config = RxeConfig {
            name: name.into(),
            addr: Some(addr),
            raw: false,
            gso: false,
            ..RxeConfig::default()
        };
        let (dev, tx) = RxeDevice::assemble_driven(
            config,
            // The devices serve fixed loopback addresses, so they ask for no route;
            // links are loopback-sized.
            Arc::new(NoNetwork {
                link_mtu: Some(65536),
            }),
            self.link.clone(),
            Clock::Sim(self.clock.clone()),
            // Each device's connection manager its own sequence, the same in every replay.
            self.seed ^ (self.nodes.len() as u64 + 1).wrapping_mul(0x5851_f42d_4c95_7f2d),
        );
        self.nodes.push(Node {
            addr: addr.into(),
            dev: dev.clone(),
            tx,
        });
        dev
    }

    pub fn now(&self) -> Instant {
        *self.clock.lock()
    }

    /// Simulated time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now() - self.start
    }

    pub fn set_impairment(&self, impairment: Impairment) {
        self.link.state.lock().impairment = impairment;
    }

    pub fn link_stats(&self) -> LinkStats {
        self.link.state.lock().stats
    }

    /// A digest of the datagrams sent so far (their times, addresses and bytes, in
    /// order): equal for two runs only if they put the same sequence on the link.
    pub fn digest(&self) -> u64 {
        self.link.state.lock().digest.0
    }

    /// Datagrams the device serving `addr` has sent.
    pub fn sent_from(&self, addr: Ipv4Addr) -> u64 {
        let st = self.link.state.lock();
        st.sent_from.get(&IpAddr::V4(addr)).copied().unwrap_or(0)
    }

    /// Do everything due now; false when nothing was.
    pub fn step(&self) -> bool {
        let now = self.now();
        let mut progress = false;
        // Datagrams that arrived.
        loop {
            let next = {
                let mut st = self.link.state.lock();
                match st.in_flight.first_key_value() {
                    Some((&(at, _), _)) if at <= now => st.in_flight.pop_first(),
                    _ => None,
                }
            };
            let Some((_, d)) = next else { break };
            progress = true;
            match self.nodes.iter().find(|n| n.addr == d.dst) {
                Some(n) => {
                    self.link.state.lock().stats.delivered += 1;
                    if self.polled {
                        n.dev.receive_polled(d.src, d.dst, d.sport, &d.bytes);
                    } else {
                        n.dev.receive(d.src, d.dst, d.sport, &d.bytes);
                    }
                }
                None => self.link.state.lock().stats.lost += 1,
            }
        }
        for n in &self.nodes {
            // Timers that came due.
            while let Some((target, gen, at)) = n.dev.shared().timers.pop_due(now) {
                progress = true;
                crate::timer::fire(n.dev.shared(), target, gen, at);
            }
            // QPs queued for transmit (each step sends a paced burst and may queue again).
            while let Ok(w) = n.tx.try_recv() {
                progress = true;
                if let Some(qp) = w.upgrade() {
                    qp.tx_step();
                }
            }
        }
        progress
    }

    /// The next time anything is due: a datagram's arrival or a timer.
    fn next_event(&self) -> Option<Instant> {
        let arrival = self
            .link
            .state
            .lock()
            .in_flight
            .first_key_value()
            .map(|(&(at, _), _)| at);
        self.nodes
            .iter()
            .filter_map(|n| n.dev.shared().timers.next_deadline())
            .chain(arrival)
            .min()
    }

    /// Run until `done` holds, moving the clock from one thing due to the next, for at
    /// most `limit` of simulated time; whether `done` held.
    pub fn run_until(&self, limit: Duration, mut done: impl FnMut() -> bool) -> bool {
        let end = self.now() + limit;
        loop {
            while self.step() {}
            if done() {
                return true;
            }
            // The consumers poll again before any time passes: what their last delivery
            // held back goes now.
            for n in &self.nodes {
                n.dev.send_held();
            }
            match self.next_event() {
                Some(at) if at <= end => {
                    let mut t = self.clock.lock();
                    *t = (*t).max(at);
                }
                _ => return done(),
            }
        }
    }

    /// Run for `d` of simulated time.
    pub fn run_for(&self, d: Duration) {
        let end = self.now() + d;
        self.run_until(d, || false);
        let mut t = self.clock.lock();
        *t = (*t).max(end);
    }
}

/// Connect `a` (on `a_addr`) and `b` (on `b_addr`) out of band, as `ibv_rc_pingpong`
/// does: INIT, RTR towards the other's QP number and GID, RTS, with the PSNs given.
pub fn connect(
    a: &SimQp,
    a_addr: Ipv4Addr,
    b: &SimQp,
    b_addr: Ipv4Addr,
    mtu: u32,
    (a_psn, b_psn): (u32, u32),
    retry: QpAttr,
) {
    for (me, peer, peer_addr, rq_psn, sq_psn) in
        [(a, b, b_addr, b_psn, a_psn), (b, a, a_addr, a_psn, b_psn)]
    {
        let q = &me.engine;
        let rights = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        q.modify(
            &QpAttr {
                state: QpState::Init,
                access: rights,
                ..QpAttr::default()
            },
            QpAttrMask::STATE | QpAttrMask::ACCESS,
        )
        .expect("init");
        let rtr = QpAttr {
            state: QpState::Rtr,
            path_mtu: mtu,
            dest_qpn: peer.engine.qp_num(),
            rq_psn,
            max_dest_rd_atomic: 4,
            min_rnr_timer: retry.min_rnr_timer,
            dgid: ip_to_gid(peer_addr.into()),
            ..QpAttr::default()
        };
        q.modify(&rtr, QpAttrMask::RC_RTR).expect("rtr");
        let rts = QpAttr {
            state: QpState::Rts,
            sq_psn,
            max_rd_atomic: 4,
            timeout: retry.timeout,
            retry_cnt: retry.retry_cnt,
            rnr_retry: retry.rnr_retry,
            ..QpAttr::default()
        };
        q.modify(&rts, QpAttrMask::RC_RTS).expect("rts");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 1);
    const B: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 2);

    /// The PSNs of the datagrams on their way from `src`, in the order they were sent.
    fn psns_from(sim: &Sim, src: Ipv4Addr) -> Vec<u32> {
        let st = sim.link.state.lock();
        st.in_flight
            .values()
            .filter(|d| d.src == IpAddr::V4(src))
            .map(|d| u32::from_be_bytes([0, d.bytes[9], d.bytes[10], d.bytes[11]]))
            .collect()
    }

    /// A connected pair (A's first PSN 7, B's 9, MTU 1024, QPs 128 deep with 4 KiB
    /// buffers) on a clean link whose every send takes 2 µs, so that threads sending for
    /// one QP overlap.
    fn slow_pair(seed: u64) -> (Sim, SimQp, SimQp) {
        let mut sim = Sim::new(seed, Impairment::CLEAN);
        sim.link
            .send_cost_ns
            .store(2_000, std::sync::atomic::Ordering::Relaxed);
        let da = sim.add_device("rxe-a", A);
        let db = sim.add_device("rxe-b", B);
        let (a, b) = (SimQp::new(&*da, 4096, 128), SimQp::new(&*db, 4096, 128));
        let retry = QpAttr {
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            ..QpAttr::default()
        };
        connect(&a, A, &b, B, 1024, (7, 9), retry);
        (sim, a, b)
    }

    /// Doorbells rung from two threads and transmit steps run from a third all make
    /// requests of one QP at once, each sending from its own thread, with sends slow
    /// enough to overlap: the link still sees every PSN once, in order.
    #[test]
    fn threads_sending_for_one_qp_keep_psn_order() {
        let (sim, a, b) = slow_pair(1);
        let qp = a.engine.as_any().downcast_ref::<RxeQp>().unwrap();
        let sends: u32 = 100;
        for round in 0..50u32 {
            for i in 0..sends {
                b.user
                    .post_recv(&Wqe::recv(i.into(), &[b.sge(0, 64)]))
                    .unwrap();
            }
            let first = sim.sent_from(A);
            let done = || sim.sent_from(A) >= first + u64::from(sends);
            std::thread::scope(|s| {
                s.spawn(|| {
                    while !done() {
                        qp.tx_step();
                    }
                });
                s.spawn(|| {
                    while !done() {
                        a.engine.doorbell();
                    }
                });
                let batch: Vec<Wqe> = (0..sends)
                    .map(|i| Wqe::new(i.into(), WrOpcode::Send, &[a.sge(0, 64)]))
                    .collect();
                a.user.post_send_batch(&batch).unwrap();
                while !done() {
                    a.engine.doorbell();
                }
            });
            let psns = psns_from(&sim, A);
            let start = 7 + round * sends;
            let want: Vec<u32> = (start..start + sends).collect();
            assert_eq!(psns, want, "round {round}");
            // Deliver them; the acknowledgements open the window for the next round.
            let mut got = 0;
            assert!(sim.run_until(Duration::from_secs(1), || {
                got += b.poll().len();
                got == sends as usize
            }));
        }
    }

    /// Modify QP to Error from one thread while another delivers Sends (4 packets each) to
    /// the QP and so holds its send token (writing receive completions, sending
    /// acknowledgements, each send slow): the flush waits for the token, so when Modify QP returns every receive
    /// is complete, each after the one posted before it — the successes, then the flushed.
    #[test]
    fn a_flush_while_another_thread_completes_is_in_order_on_return() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (sim, a, b) = slow_pair(2);
        let n: u64 = 120;
        for i in 0..n {
            b.user.post_recv(&Wqe::recv(i, &[b.sge(0, 4096)])).unwrap();
        }
        let sends: Vec<Wqe> = (0..n)
            .map(|i| Wqe::new(i, WrOpcode::Send, &[a.sge(0, 4096)]))
            .collect();
        a.user.post_send_batch(&sends).unwrap();
        a.engine.doorbell();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| sim.run_until(Duration::from_secs(5), || stop.load(Ordering::Acquire)));
            while sim.link_stats().delivered < 20 {
                std::thread::yield_now();
            }
            let error = QpAttr {
                state: QpState::Error,
                ..QpAttr::default()
            };
            b.engine.modify(&error, QpAttrMask::STATE).unwrap();
            let mut got: Vec<(u64, WcStatus)> = Vec::new();
            loop {
                let cqes = b.poll();
                if cqes.is_empty() {
                    break;
                }
                got.extend(cqes.iter().map(|c| (c.wr_id, c.status())));
            }
            stop.store(true, Ordering::Release);
            let ids: Vec<u64> = got.iter().map(|c| c.0).collect();
            assert_eq!(ids, (0..n).collect::<Vec<_>>(), "{got:?}");
            // How many succeeded depends on the threads' timing; either part may be empty.
            let ok = got.iter().take_while(|c| c.1 == WcStatus::Success).count();
            assert!(
                got[ok..].iter().all(|c| c.1 == WcStatus::WrFlushErr),
                "{got:?}"
            );
        });
    }

    /// A host whose Ethernet carries 1500 bytes (address 10.9.0.1) and whose `lo` 65536.
    struct EthernetAndLoopback;

    impl KalServices for EthernetAndLoopback {
        fn addresses(&self) -> Vec<IfAddr> {
            vec![IfAddr {
                ifname: "eth0".into(),
                addr: Ipv4Addr::new(10, 9, 0, 1).into(),
            }]
        }
        fn link_mtu(&self, ifname: &str) -> Option<u32> {
            Some(if ifname == "lo" { 65536 } else { 1500 })
        }
        fn route(&self, peer: IpAddr) -> Result<Route> {
            let (source, ifname, mtu) = if peer.is_loopback() {
                (peer, "lo", 65536)
            } else {
                (Ipv4Addr::new(10, 9, 0, 1).into(), "eth0", 1500)
            };
            Ok(Route {
                source,
                ifname: ifname.into(),
                mtu,
            })
        }
        fn neighbour(&self, _ip: IpAddr) -> Option<[u8; 6]> {
            None
        }
        fn tcp_connect_start(&self, _peer: std::net::SocketAddr) -> Result<std::net::TcpStream> {
            Err(VerbsError::Unreachable)
        }
        fn tcp_listen(
            &self,
            _addr: std::net::SocketAddr,
            _backlog: u32,
        ) -> Result<std::net::TcpListener> {
            Err(VerbsError::Unsupported)
        }
    }

    /// A device on every address reports its port's MTU from GID 0's link (the Ethernet),
    /// but a path takes the MTU of the link it leaves by: 4096 to a loopback peer over
    /// `lo`, as Linux's rxe on `lo` would (it used to be the Ethernet's 1024 for both).
    #[test]
    fn a_device_on_every_address_takes_each_paths_mtu_from_its_link() {
        let sim = Sim::new(1, Impairment::CLEAN);
        let config = RxeConfig {
            name: "rxe-any".into(),
            addr: None,
            raw: false,
            gso: false,
            ..RxeConfig::default()
        };
        let (dev, _tx) = RxeDevice::assemble_driven(
            config,
            Arc::new(EthernetAndLoopback),
            sim.link.clone(),
            Clock::Sim(sim.clock.clone()),
            1,
        );
        let s = dev.shared();
        assert_eq!(s.active_mtu(), 1024, "the port: GID 0's Ethernet");
        let to_loopback = s.source_for(Ipv4Addr::new(127, 0, 0, 1).into()).unwrap();
        assert_eq!(s.mtu_from(to_loopback), 4096);
        let to_ethernet = s.source_for(Ipv4Addr::new(10, 9, 0, 2).into()).unwrap();
        assert_eq!(s.mtu_from(to_ethernet), 1024);
    }
}
