//! perftest's parameters as its parser leaves them (`init_perftest_params`,
//! `force_dependecies`, `check_link`), and the buffer geometry both sides must agree on.

use super::timed::Timed;
use super::{AtomicType, Options, PerfError, Test, Verb};
use rnicpi::{QpType, Transport};

/// perftest's name of a connection type (`-c`, and its "Connection type" line).
pub fn connection_name(t: QpType) -> &'static str {
    match t {
        QpType::Rc => "RC",
        QpType::Uc => "UC",
        QpType::Ud => "UD",
    }
}

/// `MAX_SIZE`: `-a` runs 2, 4, ... up to 8 MiB, and sizes the buffers for it.
pub const MAX_SIZE: u64 = 8 << 20;
const DEF_SIZE_BW: u64 = 65536;
const DEF_SIZE_LAT: u64 = 2;
/// perftest's `DEF_QP_TIME`: 4.096 µs × 2^14 ≈ 67 ms.
pub const DEF_QP_TIMEOUT: u8 = 14;
/// The most bytes a data QP takes inline (`-I`): what its QPs are created with.
pub const MAX_INLINE: u32 = 64;
/// Atomic tests: one 8-byte word, the only size they take (`DEF_SIZE_ATOMIC`).
const SIZE_ATOMIC: u64 = 8;
const DEF_ITERS_BW: u64 = 5000;
const DEF_ITERS_LAT: u64 = 1000;
const DEF_TX_BW: u32 = 128;
const DEF_TX_LAT: u32 = 1;
const DEF_RX_SEND: u32 = 512;
/// `UC_MAX_RX`: a UC or UD receiver left at the default depth posts this many at most.
const UC_MAX_RX: u32 = 16000;
/// `UD_ADDITION`: the room before a UD message in its receive buffer, where the GRH lands.
pub const GRH_LEN: u64 = 40;
const DEF_RX_RDMA: u32 = 1;
const DEF_CQ_MOD: u32 = 100;
/// Above this size perftest turns CQ moderation off (unless `-Q` or `-a`).
const MSG_SIZE_CQ_MOD_LIMIT: u64 = 8192;
/// BW runs longer than this many iterations skip the peak computation.
const NO_PEAK_ITERS: u64 = 20000;
const MIN_ITER: u64 = 5;
pub const DEF_CACHE_LINE: u32 = 64;
pub const DEF_PORT: u16 = 18515;

/// Resolved parameters of one run.
#[derive(Debug, Clone)]
pub struct Params {
    pub test: Test,
    pub client: bool,
    /// `-R`: connections and exchanges over rdma_cm; else a TCP socket and Modify QP.
    pub rdma_cm: bool,
    /// The device speaks iWARP (else the IB transport: RoCE).
    pub iwarp: bool,
    /// Message sizes to run (one, or 2..8 MiB with `-a`).
    pub sizes: Vec<u64>,
    /// The size the buffers are laid out for (`MAX_SIZE` with `-a`).
    pub buf_size: u64,
    /// Iterations per QP (0 in a timed run, as perftest: there it counts the sample).
    pub iters: u64,
    /// `-D`: a timed run instead of `iters` iterations.
    pub timed: Option<Timed>,
    /// `-l`: requests posted at once, as one list.
    pub post_list: u32,
    /// `-l` without `-Q`: CQ moderation became the list's size (perftest says so).
    pub cq_mod_from_list: bool,
    /// `-b`: both sides send.
    pub duplex: bool,
    pub tx_depth: u32,
    pub rx_depth: u32,
    pub cq_mod: u32,
    pub out_reads: u32,
    pub num_qps: u32,
    pub gbits: bool,
    pub no_peak: bool,
    /// `-A`: the atomic tests' operation.
    pub atomic_type: AtomicType,
    /// `-u`: the local ACK timeout exponent of QPs connected by Modify QP.
    pub qp_timeout: u8,
    /// `-e`: completions waited for on notifications.
    pub use_event: bool,
    /// `-I`: inline threshold in bytes (0: none).
    pub inline: u32,
    /// Page size and cache line: local values, then the larger of both sides.
    pub cycle_buffer: u32,
    pub cache_line: u32,
    /// `enum ibv_mtu` in use (the smaller of both sides).
    pub mtu: u8,
    pub gid_index: usize,
    /// The GID at `gid_index` (informational over iWARP).
    pub gid: [u8; 16],
    /// `-c`: the data QPs' service type (UC: Send and Write tests, UD: Send tests).
    pub connection: QpType,
    /// `-s` was given (a UD size above the MTU is then an error, not a change).
    pub size_given: bool,
}

impl Params {
    /// perftest's defaults and dependencies for `o`; `max_reads` is the device's
    /// `max_qp_rd_atom`, `mtu` the port's `enum ibv_mtu`.
    pub fn resolve(
        o: &Options,
        max_reads: u32,
        mtu: u8,
        transport: Transport,
    ) -> Result<Params, PerfError> {
        let iwarp = transport == Transport::Iwarp;
        if iwarp && !o.rdma_cm {
            return Err(PerfError::Options(format!(
                "{} is an iWARP device: its QPs connect only through rdma_cm, run with -R \
                 (and -R on the peer)",
                o.device
            )));
        }
        let lat = o.test.is_lat();
        let send = o.test.verb() == Verb::Send;
        let why = match o.connection {
            QpType::Rc => None,
            QpType::Ud if iwarp => Some("an iWARP device has no UD QPs"),
            QpType::Ud if !send => Some("UD connection only possible in SEND verb"),
            QpType::Uc if iwarp => Some("an iWARP device has no UC QPs"),
            QpType::Uc if matches!(o.test.verb(), Verb::Read | Verb::Atomic) => {
                Some("UC connection not possible in READ/ATOMIC verbs")
            }
            QpType::Uc if o.rdma_cm => Some("UC is not supported in librdmacm"),
            QpType::Uc | QpType::Ud => None,
        };
        if let Some(why) = why {
            let c = connection_name(o.connection);
            return Err(PerfError::Options(format!("-c {c}: {why}")));
        }
        if o.duplex && lat {
            return Err(PerfError::Options(
                "Bidirectional is only available in BW test".into(),
            ));
        }
        let timed = match o.duration {
            None => None,
            Some(_) if o.use_event => {
                return Err(PerfError::Options(
                    "Duration mode doesn't work with events.".into(),
                ))
            }
            Some(_) if o.all_sizes => {
                return Err(PerfError::Options(
                    "Duration mode currently doesn't support running on all sizes.".into(),
                ))
            }
            Some(_) if o.validate => {
                return Err(PerfError::Options(
                    "--validate checks a number of iterations: not with -D".into(),
                ))
            }
            Some(d) => Some(Timed::new(d, o.margin).map_err(|m| PerfError::Options(m.into()))?),
        };
        let iters = o
            .iters
            .unwrap_or(if lat { DEF_ITERS_LAT } else { DEF_ITERS_BW });
        if iters < MIN_ITER {
            return Err(PerfError::Options(format!(
                "iterations must be at least {MIN_ITER}"
            )));
        }
        if o.use_event && o.test.verb() == Verb::Write {
            return Err(PerfError::Options(
                "events feature not available on WRITE verb".into(),
            ));
        }
        let inline = o.inline_size.unwrap_or(0);
        if o.inline_size.is_some() && matches!(o.test.verb(), Verb::Read | Verb::Atomic) {
            return Err(PerfError::Options(
                "inline feature not available on READ/Atomic verbs".into(),
            ));
        }
        if inline > MAX_INLINE {
            return Err(PerfError::Options(format!(
                "max inline is {MAX_INLINE} bytes on krdma's data QPs"
            )));
        }
        let atomic = o.test.verb() == Verb::Atomic;
        if atomic && iwarp {
            return Err(PerfError::Options(format!(
                "{} is an iWARP device: iWARP has no atomic operations",
                o.device
            )));
        }
        if atomic && (o.all_sizes || o.size.is_some_and(|s| s != SIZE_ATOMIC)) {
            return Err(PerfError::Options(
                "message size cannot be changed for atomic tests".into(),
            ));
        }
        let size = o.size.unwrap_or(if atomic {
            SIZE_ATOMIC
        } else if lat {
            DEF_SIZE_LAT
        } else {
            DEF_SIZE_BW
        });
        if size == 0 || size > u32::MAX as u64 {
            return Err(PerfError::Options(format!("bad message size {size}")));
        }
        if o.num_qps == 0 {
            return Err(PerfError::Options("need at least one QP".into()));
        }
        let mut tx_depth = o
            .tx_depth
            .unwrap_or(if lat { DEF_TX_LAT } else { DEF_TX_BW });
        let mut rx_depth = o
            .rx_depth
            .unwrap_or(if send { DEF_RX_SEND } else { DEF_RX_RDMA });
        if timed.is_none() {
            if tx_depth as u64 > iters {
                tx_depth = iters as u32;
            }
            if send && rx_depth as u64 > iters {
                rx_depth = iters as u32;
            }
            if o.connection != QpType::Rc && rx_depth == DEF_RX_SEND {
                // A UD or UC message that finds no receive is lost: one receive per
                // message.
                rx_depth = iters.min(UC_MAX_RX as u64) as u32;
            }
        }
        let post_list = o.post_list.max(1);
        let mut cq_mod = o.cq_mod.unwrap_or(DEF_CQ_MOD);
        let mut cq_mod_from_list = false;
        if post_list > 1 {
            if lat {
                return Err(PerfError::Options(
                    "Post list is supported in BW tests only".into(),
                ));
            }
            if timed.is_none() && !iters.is_multiple_of(post_list as u64) {
                return Err(PerfError::Options(
                    "Number of iterations must be a multiple of post list size".into(),
                ));
            }
            match o.cq_mod {
                None => {
                    cq_mod = post_list;
                    cq_mod_from_list = true;
                }
                Some(m) if m == 0 || !post_list.is_multiple_of(m) => {
                    return Err(PerfError::Options(
                        "Post list size must be a multiple of CQ moderation".into(),
                    ))
                }
                Some(_) => {}
            }
            if o.validate && send && size <= page_size() as u64 / 2 {
                return Err(PerfError::Options(
                    "--validate cannot check small Sends posted as a list (their buffer \
                     places cycle with the list, the receives' with the messages): use a \
                     size above half a page"
                        .into(),
                ));
            }
            if post_list > tx_depth {
                return Err(PerfError::Options(format!(
                    "the post list ({post_list}) does not fit the TX depth ({tx_depth})"
                )));
            }
        }
        // (perftest decides this before the post list, which then sets its own.)
        if size > MSG_SIZE_CQ_MOD_LIMIT
            && o.connection != QpType::Ud
            && !o.all_sizes
            && o.cq_mod.is_none()
            && !o.use_event
            && !cq_mod_from_list
        {
            cq_mod = 1;
        }
        cq_mod = cq_mod.min(tx_depth).max(1);
        // perftest's work-around for an odd receive depth in SEND tests.
        if send && rx_depth % 2 == 1 && !o.all_sizes {
            rx_depth += 1;
        }
        let bw = !lat;
        let no_peak = o.no_peak
            || timed.is_some()
            || (bw && iters > NO_PEAK_ITERS)
            || (o.test == Test::SendBw && o.server.is_none() && !o.duplex);
        let out_reads = match (o.test.verb(), o.out_reads) {
            (Verb::Read | Verb::Atomic, Some(r)) if r > 0 => r.min(max_reads),
            (Verb::Read | Verb::Atomic, _) => max_reads,
            _ => 1,
        };
        let (sizes, buf_size) = if o.all_sizes {
            ((1..24).map(|i| 1u64 << i).collect(), MAX_SIZE)
        } else {
            (vec![size], size)
        };
        let mut p = Params {
            test: o.test,
            client: o.server.is_some(),
            rdma_cm: o.rdma_cm,
            iwarp,
            sizes,
            buf_size,
            iters: if timed.is_some() { 0 } else { iters },
            timed,
            post_list,
            cq_mod_from_list,
            duplex: o.duplex,
            tx_depth,
            rx_depth,
            cq_mod,
            out_reads,
            num_qps: o.num_qps,
            gbits: o.report_gbits,
            no_peak,
            atomic_type: o.atomic_type,
            qp_timeout: o.qp_timeout.min(31),
            use_event: o.use_event,
            inline,
            cycle_buffer: page_size(),
            cache_line: DEF_CACHE_LINE,
            mtu,
            gid_index: o.gid_index.unwrap_or(0),
            gid: [0; 16],
            connection: o.connection,
            size_given: o.size.is_some(),
        };
        p.fit_ud(false)?;
        Ok(p)
    }

    /// `-c UD`: a datagram is one packet, so no message is longer than the path MTU. `-a`
    /// stops at it and a default size drops to it, with the message perftest 4.5 prints;
    /// a size given with `-s` drops to the local MTU silently, but is refused once both
    /// sides have agreed on a smaller one (`exchanged`, as `check_mtu`).
    pub fn fit_ud(&mut self, exchanged: bool) -> Result<(), PerfError> {
        let most = super::wire::mtu_bytes(self.mtu) as u64;
        if !self.ud() || self.sizes.iter().all(|&s| s <= most) {
            return Ok(());
        }
        let all = self.sizes.len() > 1;
        if exchanged && self.size_given && !all {
            return Err(PerfError::Options(
                "Max message size in UD cannot be greater than MTU".into(),
            ));
        }
        if all || !self.size_given {
            eprintln!(" Max msg size in UD is MTU {most}");
            eprintln!(" Changing to this MTU");
        }
        self.sizes.retain(|&s| s <= most);
        if self.sizes.is_empty() {
            self.sizes.push(most);
        }
        self.buf_size = self.buf_size.min(most);
        Ok(())
    }

    /// `BUFF_SIZE(size, cycle_buffer)`: one half of a QP's buffer.
    pub fn half(&self) -> u64 {
        self.buf_size.max(self.cycle_buffer as u64)
    }

    /// The buffer geometry for messages of `size` bytes (latency tests always use the
    /// start of each half).
    pub fn cycle(&self, size: u64) -> Cycle {
        let page = if self.test.is_lat() {
            0
        } else {
            self.cycle_buffer as u64
        };
        Cycle::with_lead(size, self.grh(), page, self.cache_line as u64)
    }

    /// A UD server sends too (latency, bidirectional): with rdma_cm it must first learn
    /// the client's QP from a datagram.
    pub fn server_answers(&self) -> bool {
        self.test.is_lat() || self.duplex
    }

    /// `-c UD`: unreliable datagram data QPs.
    pub fn ud(&self) -> bool {
        self.connection == QpType::Ud
    }

    /// The room before each message in its receive buffer: a UD receive takes the GRH
    /// there.
    pub fn grh(&self) -> u64 {
        if self.ud() {
            GRH_LEN
        } else {
            0
        }
    }

    /// Receives posted before a send run (`ctx_set_recv_wqes`; never more than messages).
    pub fn initial_recvs(&self) -> u64 {
        match self.timed {
            Some(_) => self.rx_depth as u64,
            None => (self.rx_depth as u64).min(self.iters),
        }
    }

    /// Whether request `k` (0-based) of a QP is one more than the run has: never in a
    /// timed run, which ends by the clock.
    pub fn beyond(&self, k: u64) -> bool {
        self.timed.is_none() && k >= self.iters
    }

    /// Whether send_bw runs with receive credits: over iWARP only (no RNR retry there),
    /// whatever the exchange method (`ctx.send_rcredit`).
    pub fn credits(&self) -> bool {
        self.iwarp && self.test == Test::SendBw
    }

    /// Credits every this many receives (send_bw over iWARP; `rx_depth / 3`).
    pub fn credit_every(&self) -> u64 {
        (self.rx_depth as u64 / 3).max(1)
    }

    /// Whether a receiver that has taken `received` messages writes its count back now
    /// (perftest's `rcnt % rx_depth % credit_cnt == 0`).
    pub fn credit_due(&self, received: u64) -> bool {
        self.credits() && (received % self.rx_depth as u64).is_multiple_of(self.credit_every())
    }
}

fn page_size() -> u32 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u32
    } else {
        4096
    }
}

/// Where the k-th message of a run goes within a buffer half: messages up to half a page
/// step through the page in cache-line-rounded strides (`increase_loc_addr` /
/// `increase_rem_addr`), larger ones all use offset 0.
#[derive(Debug, Clone, Copy)]
pub struct Cycle {
    pub size: u64,
    /// Bytes a receive takes before each message (UD: the GRH), within its place.
    pub lead: u64,
    stride: u64,
    slots: u64,
}

impl Cycle {
    /// Places of `lead + size` bytes (a receive's), messages of `size`.
    pub fn with_lead(size: u64, lead: u64, cycle_buffer: u64, cache_line: u64) -> Cycle {
        let c = Self::places(size + lead, cycle_buffer, cache_line);
        Cycle { size, lead, ..c }
    }

    fn places(size: u64, cycle_buffer: u64, cache_line: u64) -> Cycle {
        if size <= cycle_buffer / 2 {
            let stride = if size > cache_line {
                size.div_ceil(cache_line) * cache_line
            } else {
                cache_line
            };
            Cycle {
                size,
                lead: 0,
                stride,
                slots: (cycle_buffer / stride).max(1),
            }
        } else {
            Cycle {
                size,
                lead: 0,
                stride: 0,
                slots: 1,
            }
        }
    }

    pub fn offset(&self, k: u64) -> u64 {
        (k % self.slots) * self.stride
    }

    /// The byte ranges `count` messages cover.
    pub fn covered(&self, count: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..count.min(self.slots)).map(|k| (self.offset(k), self.size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(test: Test, client: bool) -> Options {
        Options {
            test,
            server: client.then(|| "10.0.0.1".parse().unwrap()),
            rdma_cm: true,
            ..Options::new(test)
        }
    }

    const IW: Transport = Transport::Iwarp;

    #[test]
    fn defaults_like_perftest() {
        let p = Params::resolve(&opts(Test::WriteBw, true), 32, 3, IW).unwrap();
        assert_eq!(
            (p.sizes.clone(), p.iters, p.tx_depth),
            (vec![65536], 5000, 128)
        );
        assert_eq!(p.cq_mod, 1, "64 KiB messages turn CQ moderation off");
        let p = Params::resolve(&opts(Test::SendLat, false), 32, 3, IW).unwrap();
        assert_eq!(
            (p.sizes[0], p.iters, p.tx_depth, p.rx_depth),
            (2, 1000, 1, 512)
        );
        let mut o = opts(Test::SendBw, false);
        o.iters = Some(101);
        o.size = Some(4096);
        let p = Params::resolve(&o, 32, 3, IW).unwrap();
        assert_eq!((p.tx_depth, p.rx_depth, p.cq_mod), (101, 102, 100));
        assert!(p.no_peak, "send_bw server reports no peak");
        let mut o = opts(Test::ReadBw, true);
        o.all_sizes = true;
        let p = Params::resolve(&o, 32, 3, IW).unwrap();
        assert_eq!(p.out_reads, 32);
        assert_eq!((p.sizes.len(), p.sizes[0], p.buf_size), (23, 2, MAX_SIZE));
    }

    #[test]
    fn exchange_method_and_credits() {
        let mut o = opts(Test::SendBw, true);
        assert!(Params::resolve(&o, 32, 3, IW).unwrap().credits());
        let p = Params::resolve(&o, 16, 3, Transport::Ib).unwrap();
        assert!(!p.credits(), "no credits over the IB transport");
        o.rdma_cm = false;
        assert!(!Params::resolve(&o, 16, 3, Transport::Ib).unwrap().rdma_cm);
        match Params::resolve(&o, 32, 3, IW) {
            Err(PerfError::Options(m)) => assert!(m.contains("-R"), "{m}"),
            r => panic!("iWARP without rdma_cm must be refused: {r:?}"),
        }
    }

    #[test]
    fn cycle_offsets() {
        let c = Cycle::with_lead(2, 0, 4096, 64);
        assert_eq!((c.offset(0), c.offset(1), c.offset(64)), (0, 64, 0));
        let c = Cycle::with_lead(100, 0, 4096, 64);
        assert_eq!(
            (c.offset(1), c.offset(31), c.offset(32)),
            (128, 31 * 128, 0)
        );
        let c = Cycle::with_lead(65536, 0, 4096, 64);
        assert_eq!(c.offset(7), 0);
        assert_eq!(c.covered(5).count(), 1);
        // UD receives: each place holds the GRH and the message.
        let c = Cycle::with_lead(64, GRH_LEN, 4096, 64);
        assert_eq!((c.size, c.lead, c.offset(1)), (64, 40, 128));
        let c = Cycle::with_lead(2048, GRH_LEN, 4096, 64);
        assert_eq!((c.offset(1), c.covered(9).count()), (0, 1));
    }

    fn ud(test: Test, size: Option<u64>, all: bool) -> Options {
        Options {
            connection: QpType::Ud,
            rdma_cm: false,
            size,
            all_sizes: all,
            ..opts(test, true)
        }
    }

    #[test]
    fn ud_sizes_stop_at_the_mtu() {
        const IB: Transport = Transport::Ib;
        // (enum ibv_mtu 5 = 4096 bytes, 3 = 1024.)
        let mut p = Params::resolve(&ud(Test::SendBw, None, false), 16, 5, IB).unwrap();
        assert_eq!(
            (p.sizes.clone(), p.buf_size, p.grh()),
            (vec![4096], 4096, 40)
        );
        assert_eq!(p.rx_depth, 5000, "a receive per message, as perftest's UD");
        assert_eq!(p.cq_mod, 100, "UD keeps CQ moderation whatever -s asked");
        // The peer's MTU is smaller: a default size follows it.
        p.mtu = 3;
        p.fit_ud(true).unwrap();
        assert_eq!(p.sizes, vec![1024]);
        // A size given with -s drops to the local MTU, but not to the exchanged one.
        let mut p = Params::resolve(&ud(Test::SendLat, Some(8192), false), 16, 5, IB).unwrap();
        assert_eq!(p.sizes, vec![4096]);
        p.mtu = 3;
        assert!(matches!(p.fit_ud(true), Err(PerfError::Options(_))));
        let p = Params::resolve(&ud(Test::SendLat, None, true), 16, 3, IB).unwrap();
        assert_eq!(p.sizes, (1..=10).map(|i| 1u64 << i).collect::<Vec<_>>());
        // RC is unchanged by all this.
        let p = Params::resolve(&opts(Test::SendBw, true), 16, 3, IB).unwrap();
        assert_eq!((p.sizes.clone(), p.grh()), (vec![65536], 0));
    }
}
