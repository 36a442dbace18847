//! The rxe device: attributes, GID table, counters, the QP table, and the three device
//! threads — receive (demultiplex by destination QP), transmit (paced work of QPs that
//! have packets to send), and timers (retransmission, RNR back-off, CM retries).

use crate::ah::{Ah, AhTable, MAX_AH};
use crate::cm::Cm;
use crate::net::{Datagram, Net, Wire};
use crate::qp::RxeQp;
use crate::receive::{HeldAcks, Receiver};
use crate::timer::{Clock, Timers};
use crate::wire::{self, RocePacket, RoceRepr};
use parking_lot::RwLock;
use rnicpi::*;
use std::cell::Cell;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// How an rxe device is set up.
#[derive(Debug, Clone)]
pub struct RxeConfig {
    pub name: String,
    /// Address the device serves (its GID); `None` = every IPv4 address of the host.
    pub addr: Option<Ipv4Addr>,
    /// UDP port (4791, the RoCEv2 port; tests may pick another).
    pub port: u16,
    /// Use raw sockets when the process may (full ICRC over real headers, per-QP source
    /// ports); `false` forces the plain UDP mode (see `net`).
    pub raw: bool,
    /// In raw mode, send runs of packets to this host as one UDP segmentation-offload
    /// datagram each (`wire::gso`).
    pub gso: bool,
}

impl Default for RxeConfig {
    fn default() -> Self {
        RxeConfig {
            name: "rxe0".into(),
            addr: None,
            port: wire::ROCEV2_UDP_PORT,
            raw: true,
            gso: true,
        }
    }
}

rnicpi::counters!(
    /// Device-wide counters (`krdma stat`).
    pub(crate) struct Counters {
        tx_packets,
        rx_packets,
        /// Of those, received by a consumer polling a CQ in embedded mode
        /// (`rnicpi::progress`) rather than by the receive thread.
        rx_packets_polled,
        /// Of those, received by the kAL's doorbell thread right after it sent datagrams
        /// to this host (`receive.rs`, `Receiver::receive_here`).
        rx_packets_here,
        /// The receive thread woken from its sleep by a datagram on the socket (not
        /// while a doorbell thread that takes what it sends is hushing it: `net::watch`).
        rx_thread_wakeups,
        rx_not_ours,
        tx_bytes,
        rx_bytes,
        rx_bad_icrc,
        rx_malformed,
        rx_unknown_qp,
        rx_bad_pkey,
        rx_wrong_source,
        /// UD datagrams whose Q_Key is not the QP's.
        rx_bad_qkey,
        /// UD datagrams that found no receive posted.
        ud_dropped_no_recv,
        /// UC messages a responder noticed it dropped: from a packet out of sequence,
        /// with no receive posted, refused access or a malformed sequence, and
        /// messages missing whole before the PSN of a new one.
        uc_dropped,
        rx_dropped_state,
        retransmits,
        retry_timeouts,
        nak_seq_sent,
        nak_seq_rcvd,
        rnr_nak_sent,
        rnr_nak_rcvd,
        nak_other_sent,
        nak_other_rcvd,
        duplicate_requests,
        acks_sent,
        /// Positive acknowledgements a polling consumer's delivery left queued for its
        /// next call (sent with the QP's next datagrams, or when the receive side takes
        /// over: `receive.rs`).
        acks_held,
        /// Of those, the ones a later acknowledgement replaced before they were sent
        /// (each acknowledges all before it): made and counted in `acks_sent`, never sent.
        acks_coalesced,
        qp_access_refused,
        rd_atomic_refused,
        remote_inv_refused,
        cq_overflows,
        cm_sent,
        cm_rcvd,
        cm_retries,
        cm_unmatched,
        cm_req_evicted,
        cm_req_expired,
        cm_req_refused,
        qps_created,
    }
);

pub(crate) struct Shared {
    pub attr: DeviceAttr,
    /// PDs, CQs, SRQs and the key table (registrations, windows).
    pub res: soft::SoftResources,
    pub counters: Counters,
    /// Where transmitted datagrams go.
    pub wire: Arc<dyn Wire>,
    /// The socket's receive side, which polling consumers may drive (`None` in a
    /// simulation, which delivers datagrams itself).
    pub receiver: Option<Arc<Receiver>>,
    /// QPs holding acknowledgements back for a polling consumer's next call.
    pub held: HeldAcks,
    /// The receive side computes and checks ICRCs over real IP headers (raw sockets).
    raw: bool,
    /// The device's time: the host's, or a simulation's.
    pub clock: Clock,
    /// QP numbers: random, or one after the other in a simulation (reproducible runs).
    qpns: QpnSource,
    /// The serial of the next QP object (never reused, unlike QP numbers).
    qp_serials: AtomicU64,
    pub services: Arc<dyn KalServices>,
    pub config: RxeConfig,
    pub qps: RwLock<HashMap<u32, Weak<RxeQp>>>,
    /// Address handles, for UD Sends.
    pub ahs: AhTable,
    pub timers: Timers,
    pub cm: Cm,
    tx_queue: crossbeam_channel::Sender<Weak<RxeQp>>,
    stop: AtomicBool,
    ours: parking_lot::Mutex<Ours>,
}

thread_local! {
    /// [`Shared::sent_here`].
    static SENT_HERE: Cell<u64> = const { Cell::new(0) };
}

/// What a device on every address takes for its own ([`Shared::serves`]).
struct Ours {
    /// The host's addresses (its GID table), and when they were read.
    gids: Vec<IpAddr>,
    read_at: std::time::Instant,
    /// In raw mode, the addresses other devices of this host hold on the port.
    elsewhere: Option<crate::net::Elsewhere>,
}

impl Shared {
    /// Queue `qp` for the transmit thread (it has packets to send).
    pub fn schedule(&self, qp: &Arc<RxeQp>) {
        if qp.mark_scheduled() {
            let _ = self.tx_queue.send(Arc::downgrade(qp));
        }
    }

    /// The device is gone: its threads end.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    pub fn qp(&self, qpn: u32) -> Option<Arc<RxeQp>> {
        self.qps.read().get(&qpn).and_then(Weak::upgrade)
    }

    pub fn count(&self, c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Send one packet (`roce` has room for the ICRC, which is filled in).
    pub fn send(&self, src: IpAddr, dst: IpAddr, sport: u16, roce: &mut [u8]) {
        match self.wire.send(src, dst, sport, self.config.port, roce) {
            Ok(()) => {
                self.counters.tx_packets.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .tx_bytes
                    .fetch_add(roce.len() as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(%dst, error = %e, "rxe send failed"),
        }
    }

    /// Send datagrams in order (the wire may hand them to the kernel at once). The
    /// byte counter takes the first `sent` sizes: exact unless one in the middle was lost.
    pub fn send_all(&self, packets: &mut [crate::net::Packet<'_>]) {
        let sent = self.wire.send_all(self.config.port, packets);
        let bytes: usize = packets.iter().take(sent).map(|p| p.roce.len()).sum();
        let c = &self.counters;
        c.tx_packets.fetch_add(sent as u64, Ordering::Relaxed);
        c.tx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let here = |p: &crate::net::Packet<'_>| {
            p.roce.len() < crate::receive::RX_SPIN_AFTER && crate::net::to_this_host(p.src, p.dst)
        };
        if packets.iter().take(sent).any(here) {
            SENT_HERE.with(|n| n.set(n.get() + 1));
        }
    }

    /// How many of this thread's sends so far put a small datagram (a message, not data
    /// of a transfer) on a socket of this host.
    pub fn sent_here() -> u64 {
        SENT_HERE.with(Cell::get)
    }

    /// The kAL's doorbell thread served a doorbell in which it sent small datagrams to
    /// this host itself ([`Shared::sent_here`] moved from `before`): take what they put on
    /// the device's socket ([`Receiver::receive_here`]). Only its own sends count: the
    /// acknowledgements other threads send meanwhile (a transfer's) are theirs to follow.
    /// Whether it sent any.
    pub fn after_doorbell(&self, before: u64) -> bool {
        let here = Self::sent_here() != before;
        if let (true, Some(r)) = (here, &self.receiver) {
            r.receive_here();
        }
        here
    }

    /// Run `f`, a doorbell that will take what it sends to this host off the device's
    /// socket itself ([`Shared::after_doorbell`]), without that datagram's arrival waking
    /// the receive thread (`net::Net::hushed`).
    pub fn hushed<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.receiver {
            Some(r) => r.hushed(f),
            None => f(),
        }
    }

    /// Emit `repr` into a fresh buffer and send it.
    pub fn send_repr(&self, src: IpAddr, dst: IpAddr, sport: u16, repr: &RoceRepr<'_>) {
        match repr.to_vec() {
            Ok(mut v) => self.send(src, dst, sport, &mut v),
            Err(e) => tracing::warn!(error = %e, "rxe: cannot emit packet"),
        }
    }

    /// The addresses this device serves: its GID table, in order.
    pub fn addrs(&self) -> Vec<IpAddr> {
        match self.config.addr {
            Some(a) => vec![a.into()],
            None => gid_table(self.services.addresses()),
        }
    }

    /// Whether a datagram to `dst` is ours (`cm`: a connection manager packet, to QP1).
    /// A raw socket sees every RoCEv2 datagram of the network namespace, also those for
    /// another rxe instance bound to one address: one the host does not list (tests use
    /// 127.x.y.z), or one it does, which the kernel would give that instance's socket
    /// rather than this wildcard one's (`net::Elsewhere`). Those are left alone, answered
    /// by nobody here. The host's list is cached for a second.
    fn serves(&self, dst: IpAddr, cm: bool) -> bool {
        if let Some(a) = self.config.addr {
            return IpAddr::V4(a) == dst;
        }
        let now = std::time::Instant::now();
        let mut ours = self.ours.lock();
        if now.duration_since(ours.read_at) > std::time::Duration::from_secs(1) {
            ours.gids = gid_table(self.services.addresses());
            ours.read_at = now;
        }
        if !ours.gids.contains(&dst) {
            return false;
        }
        match (dst, &mut ours.elsewhere) {
            (IpAddr::V4(d), Some(elsewhere)) => !elsewhere.serves(d, cm, now),
            _ => true,
        }
    }

    /// Path MTU the port offers (an IB MTU that fits the link with every header): that of
    /// the device's address, or of GID 0 (the host's first address that reaches other
    /// hosts) when it serves every address.
    pub fn active_mtu(&self) -> u32 {
        self.config
            .addr
            .map(IpAddr::V4)
            .or_else(|| self.addrs().first().copied())
            .map_or(rnicpi::ib_mtu_fitting(1500), |ip| self.mtu_from(ip))
    }

    /// The path MTU of traffic leaving from `src`: what its link carries. A device serving
    /// every address connects loopback peers over `lo` (4096) whatever GID 0's link is.
    pub fn mtu_from(&self, src: IpAddr) -> u32 {
        let link = self
            .ifname_of(src)
            .and_then(|n| self.services.link_mtu(&n))
            .unwrap_or(1500);
        rnicpi::ib_mtu_fitting(link)
    }

    /// The interface that holds `ip`.
    fn ifname_of(&self, ip: IpAddr) -> Option<String> {
        if ip.is_loopback() {
            return Some("lo".into()); // all of 127/8 is on lo, listed or not
        }
        self.services
            .addresses()
            .into_iter()
            .find_map(|a| (a.addr == ip).then_some(a.ifname))
    }

    /// The source address for traffic to `dst`: GID `sgid_index` when it is of `dst`'s
    /// family, else the host's route. Also toward 127/8 from another address of the host
    /// (a peer on a loopback address that learnt GID `sgid_index` out of band, as
    /// perftest's exchange tells it): Linux delivers those, and the peer takes packets of
    /// the connection only from the GID it was given.
    pub fn route(&self, sgid_index: u8, dst: IpAddr) -> Result<IpAddr> {
        match self.addrs().get(sgid_index as usize) {
            Some(a) if a.is_ipv4() == dst.is_ipv4() && !a.is_unspecified() => Ok(*a),
            _ => self.source_for(dst),
        }
    }

    /// Source address for traffic to `peer` (the host's route), if this device serves it.
    pub fn source_for(&self, peer: IpAddr) -> Result<IpAddr> {
        let src = match self.config.addr {
            Some(a) => IpAddr::V4(a),
            None => self.services.route(peer)?.source,
        };
        if src.is_ipv4() != peer.is_ipv4() || (peer.is_ipv6() && !self.wire.has_ipv6()) {
            return Err(VerbsError::Unreachable);
        }
        Ok(src)
    }
}

/// The host's addresses as a GID table: IPv4 that reaches other hosts first (so GID index
/// 0 is the address a peer elsewhere would use), then IPv6 (not link-local: it needs a
/// scope), loopback last.
fn gid_table(addrs: Vec<IfAddr>) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = addrs
        .into_iter()
        .map(|a| a.addr)
        .filter(|ip| !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80))
        .collect();
    v.sort_by_key(|a| (a.is_loopback(), a.is_ipv6()));
    v.dedup();
    v
}

/// A software RoCEv2 device.
pub struct RxeDevice {
    shared: Arc<Shared>,
}

impl RxeDevice {
    /// Bind the device's UDP port and start its threads.
    pub fn new(mut config: RxeConfig, services: Arc<dyn KalServices>) -> Result<Arc<RxeDevice>> {
        let net = Arc::new(
            Net::open(config.addr, config.port, config.raw, config.gso).map_err(|e| {
                tracing::warn!(port = config.port, error = %e, "rxe: cannot bind the RoCEv2 port");
                VerbsError::from(e)
            })?,
        );
        let receiver = Arc::new(Receiver::new(net.clone()));
        let io = Io {
            wire: net.clone(),
            receiver: Some(receiver.clone()),
            raw: net.is_raw(),
            clock: Clock::Host,
            qpns: QpnSource::Random,
            entropy: Box::new(crate::random::Os),
            elsewhere: (net.is_raw() && config.addr.is_none())
                .then(|| crate::net::Elsewhere::new(net.port())),
        };
        let port = net.port();
        config.port = port; // port 0 asked for any
        let (shared, rx) = Self::assemble(config, services, io);
        receiver.attach(&shared);
        spawn("rxe-rx", move || receiver.run())?;
        spawn("rxe-tx", {
            let s = Arc::downgrade(&shared);
            move || tx_loop(s, rx)
        })?;
        spawn("rxe-timer", {
            let s = Arc::downgrade(&shared);
            move || crate::timer::run(s)
        })?;
        tracing::info!(name = %shared.attr.name, port, raw = shared.raw, "rxe device created");
        Ok(Arc::new(RxeDevice { shared }))
    }

    /// The UDP port the device serves.
    pub fn udp_port(&self) -> u16 {
        self.shared.config.port
    }

    /// The device without threads or sockets: what it transmits goes to `wire`, time is
    /// `clock`'s, its connection manager draws its identifiers from `seed`, and the
    /// returned driver runs its timers and transmit queue (`crate::sim`).
    pub(crate) fn assemble_driven(
        config: RxeConfig,
        services: Arc<dyn KalServices>,
        wire: Arc<dyn Wire>,
        clock: Clock,
        seed: u64,
    ) -> (Arc<RxeDevice>, crossbeam_channel::Receiver<Weak<RxeQp>>) {
        let io = Io {
            wire,
            receiver: None,
            raw: false,
            clock,
            qpns: QpnSource::Sequential(AtomicU32::new(2)),
            entropy: Box::new(crate::random::Seeded(seed)),
            elsewhere: None,
        };
        let (shared, rx) = Self::assemble(config, services, io);
        (Arc::new(RxeDevice { shared }), rx)
    }

    fn assemble(
        config: RxeConfig,
        services: Arc<dyn KalServices>,
        io: Io,
    ) -> (Arc<Shared>, crossbeam_channel::Receiver<Weak<RxeQp>>) {
        let guid_src = config
            .addr
            .or_else(|| {
                gid_table(services.addresses())
                    .into_iter()
                    .find_map(|a| match a {
                        IpAddr::V4(v4) if !v4.is_loopback() => Some(v4),
                        _ => None,
                    })
            })
            .unwrap_or(Ipv4Addr::LOCALHOST);
        let node_guid = 0x0200_5eff_fe00_0000u64 | u32::from(guid_src) as u64 & 0xff_ffff;
        let attr = DeviceAttr {
            name: config.name.clone(),
            transport: Transport::Ib,
            node_guid,
            vendor_id: 0xffffff, // as kernel rxe reports
            max_qp: 64 * 1024,
            max_qp_wr: 16 * 1024,
            max_sge: MAX_SGE as u32,
            max_inline: MAX_INLINE as u32,
            max_cq: 64 * 1024,
            max_cqe: 64 * 1024,
            max_mr: 256 * 1024,
            max_mr_size: 1 << 40,
            max_pd: 64 * 1024,
            max_srq: 16 * 1024,
            max_srq_wr: 16 * 1024,
            max_ird: 16,
            max_ord: 16,
            atomics: true,
            memory_windows: true,
            max_ah: MAX_AH,
            phys_port_cnt: 1,
            // REQ's private data less the RDMA CM header in it; REP's; REJ's.
            private_data: PrivateDataLimits {
                connect: crate::cm::REQ_PDATA_MAX as u16,
                accept: crate::wire::cm::REP_PRIVATE_DATA_LEN as u16,
                reject: crate::wire::cm::REJ_PRIVATE_DATA_LEN as u16,
            },
            fast_path: rnicpi::FastPath::Kal,
        };
        let cm_config = crate::cm::Config {
            node_guid: attr.node_guid,
            max_ird: attr.max_ird,
            max_ord: attr.max_ord,
        };
        let cm = Cm::new(cm_config, io.entropy);
        let (tx, rx) = crossbeam_channel::unbounded();
        let gids = gid_table(services.addresses());
        let shared = Arc::new(Shared {
            res: soft::SoftResources::new(attr.max_mr),
            attr,
            counters: Counters::default(),
            wire: io.wire,
            receiver: io.receiver,
            held: HeldAcks::default(),
            raw: io.raw,
            clock: io.clock,
            qpns: io.qpns,
            qp_serials: AtomicU64::new(1),
            services,
            config,
            qps: RwLock::new(HashMap::new()),
            ahs: AhTable::default(),
            timers: Timers::new(),
            cm,
            tx_queue: tx,
            stop: AtomicBool::new(false),
            ours: parking_lot::Mutex::new(Ours {
                gids,
                read_at: std::time::Instant::now(),
                elsewhere: io.elsewhere,
            }),
        });
        (shared, rx)
    }
}

/// What a device is assembled with besides its configuration.
struct Io {
    wire: Arc<dyn Wire>,
    receiver: Option<Arc<Receiver>>,
    raw: bool,
    clock: Clock,
    qpns: QpnSource,
    /// What the connection manager draws its identifiers from.
    entropy: Box<dyn crate::random::Entropy>,
    /// A raw-mode device on every address: the addresses others hold on its port.
    elsewhere: Option<crate::net::Elsewhere>,
}

/// Where QP numbers come from.
enum QpnSource {
    /// Unpredictable to an off-path attacker.
    Random,
    /// One after the other (a simulation, which must replay exactly).
    Sequential(AtomicU32),
}

impl RxeDevice {
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Hand one RoCEv2 datagram (the UDP payload: BTH .. ICRC) from `src` to `dst` to the
    /// device exactly as its receive thread does once the ICRC has been verified:
    /// demultiplexed by destination QP, to the QP's engine or to the CM. This is the seam
    /// the `rxe_engine` fuzz target drives the engine through without raw sockets (the
    /// ICRC and datagram framing have their own target, `rxe_packet`).
    pub fn receive(&self, src: IpAddr, dst: IpAddr, sport: u16, roce: &[u8]) {
        self.receive_by(src, dst, sport, roce, false);
    }

    /// [`RxeDevice::receive`] as a polling consumer's thread receives in embedded mode
    /// (`rnicpi::progress`): the positive acknowledgements it makes wait for the QP's
    /// next datagrams or for [`RxeDevice::send_held`] (the consumer's next poll). The
    /// simulation delivers this way to run that path under loss.
    pub fn receive_polled(&self, src: IpAddr, dst: IpAddr, sport: u16, roce: &[u8]) {
        self.receive_by(src, dst, sport, roce, true);
    }

    fn receive_by(&self, src: IpAddr, dst: IpAddr, sport: u16, roce: &[u8], polled: bool) {
        let d = Datagram {
            src,
            dst,
            sport,
            roce,
        };
        deliver(&self.shared, &d, polled);
    }

    /// Send the acknowledgements held back for a polling consumer; whether there were any.
    pub fn send_held(&self) -> bool {
        self.shared.held.send()
    }
}

impl Drop for RxeDevice {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.timers.stop();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|_| ())
        .map_err(|_| VerbsError::Exhausted)
}

/// Hand one verified datagram to its QP (or the CM for QP1), received by the device's
/// thread or by a polling consumer (`polled`).
pub(crate) fn deliver(s: &Arc<Shared>, d: &Datagram<'_>, polled: bool) {
    let c = &s.counters;
    // BTH's destination QP: bytes 5..8.
    let dest_qp = d
        .roce
        .get(5..8)
        .map(|q| u32::from_be_bytes([0, q[0], q[1], q[2]]));
    let to_gsi = dest_qp == Some(wire::deth::GSI_QPN);
    if !s.serves(d.dst, to_gsi) {
        return s.count(&c.rx_not_ours);
    }
    c.rx_packets.fetch_add(1, Ordering::Relaxed);
    c.rx_bytes.fetch_add(d.roce.len() as u64, Ordering::Relaxed);
    let repr = match RocePacket::new_checked(d.roce).and_then(|p| RoceRepr::parse(&p)) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(src = %d.src, error = %e, "rxe: malformed packet dropped");
            return s.count(&c.rx_malformed);
        }
    };
    if repr.bth.pkey & 0x7fff != 0x7fff {
        return s.count(&c.rx_bad_pkey);
    }
    if repr.bth.dest_qp == wire::deth::GSI_QPN {
        return s.cm.on_packet(s, d, &repr);
    }
    match s.qp(repr.bth.dest_qp) {
        Some(qp) => qp.on_packet(d, &repr, polled),
        None => s.count(&c.rx_unknown_qp),
    }
}

/// How long the transmit thread keeps looking for work after a step of a transfer
/// before it sleeps: the acknowledgement that opens the window again then finds it
/// awake, instead of paying a wake-up (a futex call in the receiving thread, and the
/// thread's scheduling delay) per acknowledgement. It yields the CPU while it looks.
const TX_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

fn tx_loop(shared: Weak<Shared>, rx: crossbeam_channel::Receiver<Weak<RxeQp>>) {
    let mut spin_until: Option<std::time::Instant> = None;
    loop {
        let Some(s) = shared.upgrade() else { return };
        if s.stopped() {
            return;
        }
        drop(s);
        let next = match spin_until {
            Some(t) if std::time::Instant::now() < t => match rx.try_recv() {
                Ok(w) => Ok(w),
                Err(crossbeam_channel::TryRecvError::Empty) => {
                    std::thread::yield_now();
                    continue;
                }
                Err(crossbeam_channel::TryRecvError::Disconnected) => return,
            },
            _ => rx
                .recv_timeout(std::time::Duration::from_millis(200))
                .map_err(|e| e.is_disconnected()),
        };
        match next {
            Ok(w) => {
                let sent = w.upgrade().map_or(0, |qp| qp.tx_step());
                if sent >= crate::qp::TX_BULK {
                    spin_until = Some(std::time::Instant::now() + TX_SPIN);
                }
            }
            Err(false) => spin_until = None, // timed out
            Err(true) => return,
        }
    }
}

impl Provider for RxeDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.shared.attr
    }

    fn port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(VerbsError::Invalid);
        }
        let addrs = self.shared.addrs();
        let netdev = self
            .shared
            .config
            .addr
            .and_then(|a| self.shared.ifname_of(IpAddr::V4(a)))
            .unwrap_or_else(|| "*".into());
        Ok(PortAttr {
            state: if addrs.is_empty() {
                PortState::Down
            } else {
                PortState::Active
            },
            active_mtu: self.shared.active_mtu(),
            gids: addrs.into_iter().map(ip_to_gid).collect(),
            netdev,
        })
    }

    fn counters(&self) -> Vec<Counter> {
        let mut v = self.shared.counters.rows();
        v.extend(self.shared.res.counters());
        v.push(("qps_live", self.shared.qps.read().len() as u64));
        v.push(("ahs_live", self.shared.ahs.live() as u64));
        let (conns, pending) = self.shared.cm.sizes();
        v.push(("cm_conns", conns as u64));
        v.push(("cm_requests_waiting", pending as u64));
        v.push(("icrc_over_real_headers", self.shared.raw as u64));
        v.extend(self.shared.wire.counters());
        v
    }

    rnicpi::soft_resources!(shared.res);

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn ProviderQp>> {
        self.shared
            .res
            .check_qp_init(&init, &[QpType::Rc, QpType::Uc, QpType::Ud])?;
        // A random QP number (unpredictable to an off-path attacker), never 0 or 1 (the
        // special QPs) nor one in use; picked and taken under one lock.
        let mut qps = self.shared.qps.write();
        let qpn = loop {
            let n = match &self.shared.qpns {
                QpnSource::Random => crate::random::u32()?,
                QpnSource::Sequential(next) => next.fetch_add(1, Ordering::Relaxed),
            } & 0xff_ffff;
            if n > 1 && !qps.contains_key(&n) {
                break n;
            }
        };
        let serial = self.shared.qp_serials.fetch_add(1, Ordering::Relaxed);
        let qp = RxeQp::new(self.shared.clone(), qpn, serial, init);
        qps.insert(qpn, Arc::downgrade(&qp));
        drop(qps);
        self.shared.count(&self.shared.counters.qps_created);
        Ok(qp)
    }

    fn create_ah(&self, pd: u32, attr: &AhAttr) -> Result<u32> {
        crate::ah::check(attr)?;
        if !self.shared.res.pd_live(pd) {
            return Err(VerbsError::NoSuchResource);
        }
        let dst = gid_to_ip(attr.dgid);
        if dst.is_unspecified() || dst.is_multicast() {
            return Err(VerbsError::Invalid);
        }
        let src = self.shared.route(attr.sgid_index, dst)?;
        self.shared.ahs.insert(Ah {
            pd,
            src,
            dst,
            flow_label: attr.flow_label,
        })
    }

    fn destroy_ah(&self, ah: u32) -> Result<()> {
        self.shared.ahs.remove(ah)
    }

    fn connect(&self, qp: &Arc<dyn ProviderQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
        let qp = RxeQp::of(qp, &self.shared)?;
        crate::cm::connect(&self.shared, &qp, peer, param)
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn ProviderListener>> {
        crate::cm::listen(&self.shared, addr, backlog, sink)
    }
}
