//! The data QPs and perftest's message patterns on them (`run_iter_bw`,
//! `run_iter_bw_server`, `run_iter_lat_send`, `run_iter_lat_write`, `run_iter_lat`).
//!
//! Each data QP owns a buffer of two halves of `BUFF_SIZE` bytes plus a small credit area:
//! requests go out of (and RDMA Reads land in) the lower half; the upper half is what the
//! peer writes, reads or sends into; its address and rkey are what `pingpong_dest`
//! advertises (for send_bw over iWARP the credit word is advertised instead).
//!
//! Without rdma_cm (IB/RoCE) the QPs are connected by Modify QP with perftest's attributes
//! (`ctx_connect`): RTR towards the peer's record, and RTS for latency tests, the client
//! and both sides of a bidirectional run (a one-way bandwidth server only receives, so it
//! stays in RTR).

use super::control::{check, closed, next_raw, DATA_IDLE};
use super::params::{Cycle, Params, MAX_INLINE};
use super::report::{bw_result, bw_timed, lat_result, BwTimes, LatReport, TimedLat};
use super::timed::{Phase, RunClock};
use super::wire::{self, BwReport, Dest};
use super::{AtomicType, PerfError, Verb};
use crate::perf::{new_endpoint_with, Endpoint, ENDPOINT_ACCESS};
use rnicpi::{send_flags, Access, WcOpcode, WrOpcode};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::oob::{self, RcPath, RcPeer};
use ual::{Context, Cqe};

/// Bytes after the two halves: the credit word the peer writes (offset 0) and the one this
/// side sends from (offset 8).
const CREDIT_AREA: u64 = 64;
const CREDIT_OUT: u64 = 8;
/// wr_id of credit writes (data requests carry their QP's index, like perftest).
const CREDIT_ID: u64 = u64::MAX - 1;
/// perftest's `MIN_RNR_TIMER` (0.64 ms).
const MIN_RNR_TIMER: u8 = 12;
/// `ah_attr.grh.hop_limit` in `ctx_modify_qp_to_rtr`.
const HOP_LIMIT: u8 = 0xff;
/// Seeds of the fill patterns (`--validate`): what each side's buffers hold at the start.
pub const CLIENT_SEED: u32 = 0x6b72_646d;
pub const SERVER_SEED: u32 = 0x7065_7266;

/// One connected data QP.
pub struct DataQp {
    pub ep: Endpoint,
    /// `BUFF_SIZE`: bytes per half.
    half: u64,
    /// `-e`: wait for completions on CQ notifications instead of polling.
    events: bool,
    /// `-I`: requests of at most this many bytes carry their data inline.
    inline: u32,
}

impl DataQp {
    /// A data QP's verbs objects, its buffer filled with this side's pattern; without
    /// rdma_cm the QP is in INIT with perftest's access rights (`ctx_modify_qp_to_init`).
    pub fn endpoint(ctx: &Arc<Context>, dev: u32, p: &Params) -> ual::Result<Endpoint> {
        let half = p.half();
        let depth = p.tx_depth.max(p.rx_depth) + 8;
        let mut access = ENDPOINT_ACCESS;
        if p.test.verb() == Verb::Atomic {
            access |= Access::REMOTE_ATOMIC;
        }
        let ep = new_endpoint_with(ctx, dev, (2 * half + CREDIT_AREA) as usize, depth, access)?;
        let pat = pattern(seed(p.client), half as usize);
        ep.buf.write(0, &pat);
        ep.buf.write(half as usize, &pat);
        if !p.rdma_cm {
            let access = match p.test.verb() {
                Verb::Write => Access::REMOTE_WRITE,
                Verb::Read => Access::REMOTE_READ,
                Verb::Send => Access::REMOTE_WRITE | Access::LOCAL_WRITE,
                Verb::Atomic => Access::REMOTE_ATOMIC,
            };
            oob::to_init(&ep.qp, access)?;
        }
        Ok(ep)
    }

    /// `ctx_connect` (without rdma_cm): RTR towards the peer's record; RTS as well for a
    /// latency test or the client. IRD is our `out_reads`, ORD the peer's (the device
    /// lowers both to what it supports).
    pub fn connect(&self, p: &Params, my: &Dest, rem: &Dest) -> Result<(), PerfError> {
        let path = RcPath {
            path_mtu: wire::mtu_bytes(p.mtu),
            sgid_index: u8::try_from(p.gid_index)
                .map_err(|_| PerfError::Options("GID index above 255".into()))?,
            hop_limit: HOP_LIMIT,
            max_dest_rd_atomic: my.out_reads.min(255) as u8,
            max_rd_atomic: rem.out_reads.min(255) as u8,
            min_rnr_timer: MIN_RNR_TIMER,
            timeout: p.qp_timeout,
            retry_cnt: 7,
            rnr_retry: 7,
        };
        let peer = RcPeer {
            qpn: rem.qpn,
            psn: rem.psn,
            gid: rem.gid,
        };
        oob::to_rtr(&self.ep.qp, &path, &peer)?;
        if p.test.is_lat() || p.client || p.duplex {
            oob::to_rts(&self.ep.qp, &path, my.psn)?;
        }
        tracing::info!(
            qpn = self.ep.qp.qp_num,
            peer_qpn = rem.qpn,
            "perftest: QP connected"
        );
        Ok(())
    }

    pub fn new(ep: Endpoint, p: &Params) -> DataQp {
        DataQp {
            ep,
            half: p.half(),
            events: p.use_event,
            inline: p.inline,
        }
    }

    /// The next completion, which must have succeeded: polled, or with `-e` waited for.
    fn next(&self, what: &'static str) -> Result<Cqe, PerfError> {
        let c = next_raw(&self.ep, DATA_IDLE, what, self.events)?;
        check(c, what)
    }

    /// The next completion (which must have succeeded), polled until the timed run's
    /// `clock` ends (`None` then; also when the peer closed once the sample was over).
    fn next_until(
        &self,
        what: &'static str,
        clock: Option<&RunClock>,
    ) -> Result<Option<Cqe>, PerfError> {
        let mut one = [Cqe::default()];
        let deadline = Instant::now() + DATA_IDLE;
        loop {
            if self.ep.cq.poll(&mut one) == 1 {
                return check(one[0], what).map(Some);
            }
            if Instant::now() > deadline {
                return Err(PerfError::Timeout(what));
            }
            match clock.map(RunClock::phase) {
                Some(Phase::End) => return Ok(None),
                phase if closed(&self.ep) => {
                    return match phase {
                        Some(Phase::Cooldown) => Ok(None),
                        _ => Err(PerfError::PeerClosed(what)),
                    }
                }
                _ => std::thread::yield_now(),
            }
        }
    }

    /// Without rdma_cm: the run's data QPs, in INIT until [`DataQp::connect`].
    pub fn unconnected(ctx: &Arc<Context>, dev: u32, p: &Params) -> Result<Vec<DataQp>, PerfError> {
        (0..p.num_qps)
            .map(|_| Ok(DataQp::new(Self::endpoint(ctx, dev, p)?, p)))
            .collect()
    }

    /// What this side advertises for the QP (`set_up_connection`, `ctx_alloc_credit`).
    pub fn my_dest(&self, p: &Params) -> Dest {
        let base = self.ep.mr.addr;
        let vaddr = if p.credits() {
            base + 2 * self.half
        } else {
            base + self.half
        };
        Dest {
            lid: 0,
            out_reads: p.out_reads,
            qpn: self.ep.qp.qp_num,
            psn: oob::random_psn(self.ep.qp.qp_num),
            rkey: self.ep.mr.rkey,
            vaddr,
            gid: p.gid,
            srqn: 0,
            gid_index: p.gid_index as i32,
        }
    }

    /// Aim RDMA requests (and send_bw credits) at what the peer advertised.
    pub fn set_remote(&mut self, rem: &Dest) {
        self.ep.remote = (rem.vaddr, rem.rkey, self.half);
    }

    /// The receive the `j`-th message of a run lands in.
    fn post_recv(&self, j: u64, cyc: &Cycle) -> Result<(), PerfError> {
        self.ep
            .post_recv(0, self.half + cyc.offset(j), cyc.size as u32)?;
        Ok(())
    }

    /// `ctx_set_recv_wqes`: the first `count` receives of a run.
    pub fn post_recvs(&self, count: u64, cyc: &Cycle) -> Result<(), PerfError> {
        (0..count).try_for_each(|j| self.post_recv(j, cyc))
    }

    /// Post request `k` of a run (RDMA Write, RDMA Read, Send or atomic).
    fn post(&self, p: &Params, q: u64, k: u64, cyc: &Cycle, flags: u8) -> Result<(), PerfError> {
        let w = self.request(p, q, k, cyc, flags)?;
        self.ep.qp.post_send(&w)?;
        Ok(())
    }

    /// Request `k` of a run: `size` bytes at the `k`-th place of the cycle, here and (RDMA)
    /// at the peer; Sends and Writes up to the inline size carry their bytes inline.
    fn request(
        &self,
        p: &Params,
        q: u64,
        k: u64,
        cyc: &Cycle,
        flags: u8,
    ) -> Result<ual::Wqe, PerfError> {
        let (off, len) = (cyc.offset(k), cyc.size as u32);
        let remote = (self.ep.remote.0 + off, self.ep.remote.1);
        let (op, sge) = match p.test.verb() {
            Verb::Write => (WrOpcode::RdmaWrite, self.ep.mr.sge(off, len)),
            Verb::Read => (WrOpcode::RdmaRead, self.ep.mr.sge(off, len)),
            Verb::Send => (WrOpcode::Send, self.ep.mr.sge(off, len)),
            Verb::Atomic => {
                // perftest's operands: add 1, or compare with 0 and swap in 0.
                let (op, add) = match p.atomic_type {
                    AtomicType::FetchAndAdd => (WrOpcode::AtomicFetchAdd, 1),
                    AtomicType::CmpAndSwap => (WrOpcode::AtomicCmpSwp, 0),
                };
                let mut w = ual::Wqe::new(q, op, &[self.ep.mr.sge(off, len)])
                    .with_remote(remote.0, remote.1)
                    .with_flags(flags);
                w.compare_add = add;
                w.swap = 0;
                return Ok(w);
            }
        };
        if matches!(op, WrOpcode::RdmaWrite | WrOpcode::Send) && len <= self.inline {
            // Inline: the bytes travel in the request itself, copied from the buffer now.
            let mut bytes = [0u8; MAX_INLINE as usize];
            let bytes = &mut bytes[..len as usize];
            self.ep.buf.read(off as usize, bytes);
            return Ok(ual::Wqe::new(q, op, &[])
                .with_inline(bytes)
                .ok_or_else(|| PerfError::Options("inline size above the device's".into()))?
                .with_remote(remote.0, remote.1)
                .with_flags(flags | send_flags::INLINE));
        }
        let w = ual::Wqe::new(q, op, &[sge]).with_flags(flags);
        Ok(if op == WrOpcode::Send {
            w
        } else {
            w.with_remote(remote.0, remote.1)
        })
    }

    /// `-l`: post `p.post_list` requests as one list, as perftest lays it out once
    /// (`ctx_set_send_reg_wqes`): the list's `j`-th request at the cycle's `j`-th place,
    /// every `cq_mod`-th one signaled.
    fn post_list(&self, p: &Params, q: u64, cyc: &Cycle) -> Result<(), PerfError> {
        let cq_mod = p.cq_mod as u64;
        let list = (0..p.post_list as u64)
            .map(|j| {
                let flags = if (j + 1) % cq_mod == 0 {
                    send_flags::SIGNALED
                } else {
                    0
                };
                self.request(p, q, j, cyc, flags)
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.ep.qp.post_send_batch(&list)?;
        Ok(())
    }

    /// Spin until the byte at `off` of our buffer reads `want` (the peer's RDMA Write has
    /// landed), yielding the CPU between looks: on a small host the engine that places
    /// the Write may need it. Fails once the connection closes or nothing changes for
    /// [`DATA_IDLE`]. In a timed run (`clock`) the end of the run ends the wait (`false`),
    /// and so does the peer's close once the sample is over (its clock ran out first).
    fn await_byte(
        &self,
        off: usize,
        want: u8,
        clock: Option<&RunClock>,
    ) -> Result<bool, PerfError> {
        let deadline = Instant::now() + DATA_IDLE;
        let mut b = [0u8];
        loop {
            self.ep.buf.read(off, &mut b);
            if b[0] == want {
                return Ok(true);
            }
            if clock.is_some_and(RunClock::ended) {
                return Ok(false);
            }
            if closed(&self.ep) {
                return match clock.map(RunClock::phase) {
                    Some(Phase::Cooldown | Phase::End) => Ok(false),
                    _ => Err(PerfError::PeerClosed("the peer's RDMA Write")),
                };
            }
            if Instant::now() > deadline {
                return Err(PerfError::Timeout("the peer's RDMA Write"));
            }
            std::thread::yield_now();
        }
    }

    /// The receive count the peer last wrote into our credit word.
    fn credit(&self) -> u64 {
        let mut b = [0u8; 4];
        self.ep.buf.read((2 * self.half) as usize, &mut b);
        u32::from_le_bytes(b) as u64
    }

    fn reset_credit(&self) {
        self.ep.buf.write((2 * self.half) as usize, &[0; 4]);
    }

    /// RDMA-Write our receive count into the peer's credit word (host order, as perftest).
    fn send_credit(&self, received: u64) -> Result<(), PerfError> {
        let off = 2 * self.half + CREDIT_OUT;
        self.ep
            .buf
            .write(off as usize, &(received as u32).to_le_bytes());
        self.ep.write(CREDIT_ID, off, 4, 0, send_flags::SIGNALED)?;
        Ok(())
    }

    /// Check that the `count` messages of `cyc` left the peer's pattern in the upper half
    /// (`upper`) or the lower half.
    fn verify(&self, cyc: &Cycle, count: u64, peer_seed: u32, upper: bool) -> bool {
        let expect = pattern(peer_seed, self.half as usize);
        let base = if upper { self.half } else { 0 };
        cyc.covered(count).all(|(off, len)| {
            let mut got = vec![0u8; len as usize];
            self.ep.buf.read((base + off) as usize, &mut got);
            got[..] == expect[off as usize..(off + len) as usize]
        })
    }
}

/// Per-QP counters of a bandwidth run.
#[derive(Default, Clone, Copy)]
struct Flow {
    posted: u64,
    /// Requests accounted complete (`cq_mod` per completion, as perftest counts).
    completed: u64,
    signaled_out: u64,
    /// Credit writes outstanding (a bidirectional send_bw over iWARP): they take room in
    /// the `tx_depth` window, as perftest's `scredit_for_qp`.
    credit_writes: u64,
}

/// The state of one `run_iter_bw`.
struct BwRun<'a> {
    qps: &'a [DataQp],
    p: &'a Params,
    cyc: Cycle,
    flows: Vec<Flow>,
    times: BwTimes,
    /// A timed run's clock (`-D`), from the start of the run.
    clock: Option<RunClock>,
    total_posted: u64,
    total_done: u64,
    start: Instant,
}

impl<'a> BwRun<'a> {
    fn new(qps: &'a [DataQp], p: &'a Params, size: u64) -> BwRun<'a> {
        BwRun {
            qps,
            p,
            cyc: p.cycle(size),
            flows: vec![Flow::default(); qps.len()],
            times: BwTimes::new(p.iters * qps.len() as u64, p.no_peak),
            clock: p.timed.map(|t| t.start()),
            total_posted: 0,
            total_done: 0,
            start: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Whether QP `q` may post its next request (or list of `-l` requests): requests
    /// left (or time, in a timed run), room in the `tx_depth` window, and (send_bw over
    /// iWARP) receives the peer has credited.
    fn may_post(&self, q: usize) -> bool {
        let (f, p) = (&self.flows[q], self.p);
        let n = p.post_list as u64;
        !p.beyond(f.posted + n - 1)
            && f.posted + f.credit_writes + n <= f.completed + p.tx_depth as u64
            && (!p.credits() || f.posted + n < self.qps[q].credit() + p.rx_depth as u64)
            && !self.clock.as_ref().is_some_and(RunClock::ended)
    }

    /// Fill every QP's window; a completion is asked for every `cq_mod` requests and (in
    /// a run of `iters`) on the last one.
    fn post_ready(&mut self) -> Result<(), PerfError> {
        let (p, cq_mod) = (self.p, self.p.cq_mod as u64);
        for q in 0..self.qps.len() {
            while self.may_post(q) {
                let k = self.flows[q].posted;
                let t = self.now();
                self.times.post(self.total_posted, t);
                let (n, signaled) = if p.post_list > 1 {
                    self.qps[q].post_list(p, q as u64, &self.cyc)?;
                    (p.post_list as u64, p.post_list as u64 / cq_mod)
                } else {
                    let last = p.timed.is_none() && k == p.iters - 1;
                    let signaled = k % cq_mod == cq_mod - 1 || last;
                    let flags = if signaled { send_flags::SIGNALED } else { 0 };
                    self.qps[q].post(p, q as u64, k, &self.cyc, flags)?;
                    (1, signaled as u64)
                };
                let f = &mut self.flows[q];
                f.posted += n;
                f.signaled_out += signaled;
                self.total_posted += n;
            }
        }
        Ok(())
    }

    fn complete(&mut self, q: usize) {
        let cq_mod = self.p.cq_mod as u64;
        let f = &mut self.flows[q];
        f.completed += cq_mod;
        f.signaled_out = f.signaled_out.saturating_sub(1);
        self.total_done += cq_mod;
        let t = self.now();
        self.times.complete(self.total_done, t);
        if let Some(c) = &mut self.clock {
            c.count(cq_mod);
        }
    }

    /// Every request posted and every requested completion seen; a timed run ends by
    /// its clock, with requests still out (as perftest's).
    fn finished(&self) -> bool {
        match &self.clock {
            Some(c) => c.ended(),
            None => self
                .flows
                .iter()
                .all(|f| f.posted == self.p.iters && f.signaled_out == 0),
        }
    }
}

/// `run_iter_bw`: post `iters` requests per QP (or, timed, until the clock ends the run)
/// with at most `tx_depth` outstanding, asking for a completion every `cq_mod` requests;
/// send_bw over iWARP also waits for receive credits. Returns perftest's report of the
/// run.
pub fn run_bw_client(qps: &[DataQp], p: &Params, size: u64) -> Result<BwReport, PerfError> {
    let mut run = BwRun::new(qps, p, size);
    let mut idle_since = Instant::now();
    while !run.finished() {
        run.post_ready()?;
        let over = || run.clock.as_ref().is_some_and(RunClock::ended);
        let timed: Option<&dyn Fn() -> bool> = run.clock.as_ref().map(|_| &over as _);
        match next_completion(qps, &run.flows, timed)? {
            Some((q, _)) => {
                run.complete(q);
                idle_since = Instant::now();
            }
            None if run.finished() => {}
            None if idle_since.elapsed() > DATA_IDLE => {
                return Err(PerfError::Timeout("send_bw credits"));
            }
            // Waiting for credits, which arrive without a completion.
            None => std::thread::sleep(Duration::from_micros(20)),
        }
    }
    if let Some(c) = &run.clock {
        return Ok(bw_timed(c.counted(), c.sample_secs(), size, p.gbits));
    }
    let n = p.iters * qps.len() as u64;
    Ok(bw_result(
        &run.times,
        n,
        size,
        p.cq_mod as u64,
        p.no_peak,
        p.gbits,
    ))
}

/// The next completion of any QP that has a signaled request outstanding; `None` when none
/// has (a send_bw client waiting for credits, which arrive without a completion) or when
/// a timed run's `over` says it has ended.
fn next_completion(
    qps: &[DataQp],
    flows: &[Flow],
    timed: Option<&dyn Fn() -> bool>,
) -> Result<Option<(usize, Cqe)>, PerfError> {
    let waiting: Vec<usize> = (0..qps.len())
        .filter(|&q| flows[q].signaled_out > 0)
        .collect();
    match (&waiting[..], timed) {
        ([], _) => Ok(None),
        ([q], None) => qps[*q].next("data request").map(|c| Some((*q, c))),
        (_, over) => poll_any(qps, &waiting, over.unwrap_or(&|| false)),
    }
}

/// Poll several CQs in turn (yielding the CPU between rounds) until one has a
/// completion. `None` once `over()` says so (a timed run has ended, or there is other
/// work); a connection closed then ends the wait quietly too (the peer's clock ran out
/// first). Otherwise a closed connection, or nothing for [`DATA_IDLE`], is an error.
fn poll_any(
    qps: &[DataQp],
    which: &[usize],
    over: &dyn Fn() -> bool,
) -> Result<Option<(usize, Cqe)>, PerfError> {
    let deadline = Instant::now() + DATA_IDLE;
    let mut one = [Cqe::default()];
    loop {
        for &q in which {
            if qps[q].ep.cq.poll(&mut one) == 1 {
                return Ok(Some((q, check(one[0], "data request")?)));
            }
        }
        if over() {
            return Ok(None);
        }
        if Instant::now() > deadline || which.iter().any(|&q| closed(&qps[q].ep)) {
            return Err(PerfError::Timeout("data request"));
        }
        std::thread::yield_now();
    }
}

/// `run_iter_bw_server` (send_bw): take `iters` messages per QP (or, timed, messages until
/// the clock started by the first one ends the run), re-posting receives and (over
/// iWARP) writing credits back every `rx_depth / 3` messages. The clock runs from the
/// first message to the last; no peak.
pub fn run_send_bw_server(qps: &[DataQp], p: &Params, size: u64) -> Result<BwReport, PerfError> {
    let cyc = p.cycle(size);
    let n = p.iters * qps.len() as u64;
    let mut received = vec![0u64; qps.len()];
    let mut posted = vec![p.initial_recvs(); qps.len()];
    let mut credits_out = vec![0u64; qps.len()];
    let mut times = BwTimes::new(n, true);
    let mut first: Option<Instant> = None;
    let mut clock: Option<RunClock> = None;
    let mut total = 0u64;
    let all: Vec<usize> = (0..qps.len()).collect();
    loop {
        match &clock {
            Some(c) if c.ended() => break,
            None if p.timed.is_none() && total >= n => break,
            _ => {}
        }
        let (q, c) = match (qps, p.timed) {
            ([one], None) => (0, one.next("send_bw receive")?),
            _ => {
                let over = || clock.as_ref().is_some_and(RunClock::ended);
                match poll_any(qps, &all, &over)? {
                    Some(got) => got,
                    None => break,
                }
            }
        };
        if c.opcode() != Some(WcOpcode::Recv) {
            credits_out[q] = credits_out[q].saturating_sub(1);
            continue;
        }
        let start = *first.get_or_insert_with(Instant::now);
        if let Some(t) = p.timed {
            clock.get_or_insert_with(|| t.start()).count(1);
        }
        received[q] += 1;
        total += 1;
        if !p.beyond(posted[q]) {
            qps[q].post_recv(posted[q], &cyc)?;
            posted[q] += 1;
        }
        if p.credits() && (received[q] % p.rx_depth as u64).is_multiple_of(p.credit_every()) {
            while credits_out[q] >= p.tx_depth as u64 {
                let c = qps[q].next("credit write")?;
                if c.opcode() != Some(WcOpcode::Recv) {
                    credits_out[q] = credits_out[q].saturating_sub(1);
                }
            }
            qps[q].send_credit(received[q])?;
            credits_out[q] += 1;
        }
        times.complete(total, start.elapsed().as_nanos() as u64);
    }
    for (q, dq) in qps.iter().enumerate() {
        while credits_out[q] > 0 {
            if dq.next("credit write")?.opcode() != Some(WcOpcode::Recv) {
                credits_out[q] -= 1;
            }
        }
    }
    if let Some(c) = &clock {
        return Ok(bw_timed(c.counted(), c.sample_secs(), size, p.gbits));
    }
    Ok(bw_result(&times, n, size, 1, true, p.gbits))
}

/// `run_iter_bi` (send_bw `-b`): both sides send and receive at once over the same QPs.
/// The client starts sending at once; the server only once the client's first message
/// has arrived (so it never sends before the client runs). Receives are re-posted as
/// they complete; over iWARP each side writes receive credits back to the other. The
/// report is made from this side's sends; a timed run counts sends and receives in its
/// sample, by a clock the server starts at its first message.
pub fn run_bw_bi(qps: &[DataQp], p: &Params, size: u64) -> Result<BwReport, PerfError> {
    let mut run = BwRun::new(qps, p, size);
    if !p.client {
        run.clock = None;
    }
    let mut sending = p.client;
    let mut received = vec![0u64; qps.len()];
    let mut posted = vec![p.initial_recvs(); qps.len()];
    // Credits due but not yet written (no room in the window).
    let mut credit_due = vec![false; qps.len()];
    let all: Vec<usize> = (0..qps.len()).collect();
    let done = |run: &BwRun, received: &[u64]| match &run.clock {
        Some(c) => c.ended(),
        None if p.timed.is_some() => false,
        None => run.finished() && received.iter().all(|&r| r >= p.iters),
    };
    while !done(&run, &received) {
        if sending {
            run.post_ready()?;
        }
        for q in 0..qps.len() {
            let f = &run.flows[q];
            if credit_due[q] && f.posted + f.credit_writes < f.completed + p.tx_depth as u64 {
                qps[q].send_credit(received[q])?;
                run.flows[q].credit_writes += 1;
                credit_due[q] = false;
            }
        }
        // Credits arrive as RDMA Writes, without a completion: the wait also ends when
        // they let a QP post again.
        let wake = || {
            run.clock.as_ref().is_some_and(RunClock::ended)
                || (sending && p.credits() && (0..qps.len()).any(|q| run.may_post(q)))
        };
        let Some((q, c)) = poll_any(qps, &all, &wake)? else {
            continue;
        };
        match c.opcode() {
            Some(WcOpcode::Recv) => {
                if !sending {
                    sending = true;
                    run.clock = p.timed.map(|t| t.start());
                }
                if let Some(c) = &mut run.clock {
                    c.count(1);
                }
                received[q] += 1;
                if !p.beyond(posted[q]) {
                    qps[q].post_recv(posted[q], &run.cyc)?;
                    posted[q] += 1;
                }
                if p.credits() && (received[q] % p.rx_depth as u64).is_multiple_of(p.credit_every())
                {
                    credit_due[q] = true;
                }
            }
            _ if c.wr_id == CREDIT_ID => {
                run.flows[q].credit_writes = run.flows[q].credit_writes.saturating_sub(1);
            }
            _ => run.complete(q),
        }
    }
    // Credit writes still out complete before the next size (or the close).
    for (q, dq) in qps.iter().enumerate() {
        while run.flows[q].credit_writes > 0 && p.timed.is_none() {
            if dq.next("credit write")?.wr_id == CREDIT_ID {
                run.flows[q].credit_writes -= 1;
            }
        }
    }
    if let Some(c) = &run.clock {
        return Ok(bw_timed(c.counted(), c.sample_secs(), size, p.gbits));
    }
    let n = p.iters * qps.len() as u64;
    Ok(bw_result(
        &run.times,
        n,
        size,
        p.cq_mod as u64,
        p.no_peak,
        p.gbits,
    ))
}

/// The outcome of a latency run: perftest's table line of either kind.
pub enum LatRun {
    Iterations(LatReport),
    Timed(TimedLat),
}

/// `run_iter_lat_send`: ping-pong on the first QP. The client sends first; each side sends
/// its next message when the peer's has arrived. Returns the report from the send times;
/// timed, each side's clock starts with the first message it receives and the messages
/// received in the sample are counted.
pub fn run_lat_send(dq: &DataQp, p: &Params, size: u64) -> Result<LatRun, PerfError> {
    let cyc = p.cycle(size);
    let iters = p.iters;
    let mut posted_at = Vec::with_capacity(iters as usize);
    let (mut sent, mut received) = (0u64, 0u64);
    let mut arrived = 0u64;
    let mut recvs_posted = p.initial_recvs();
    let mut clock: Option<RunClock> = None;
    let start = Instant::now();
    let more = |n: u64, clock: &Option<RunClock>| match p.timed {
        None => n < iters,
        Some(_) => !clock.as_ref().is_some_and(RunClock::ended),
    };
    while more(sent, &clock) || more(received, &clock) {
        if more(received, &clock) && !(sent == 0 && p.client) {
            while arrived == 0 {
                match p.timed {
                    None => arrived += next_is_recv(dq)? as u64,
                    Some(_) => match dq.next_until("send_lat message", clock.as_ref())? {
                        Some(c) => arrived += (c.opcode() == Some(WcOpcode::Recv)) as u64,
                        None => return Ok(timed_lat(clock.as_ref(), size, 2.0)),
                    },
                }
            }
            arrived -= 1;
            received += 1;
            if let Some(t) = p.timed {
                clock.get_or_insert_with(|| t.start()).count(1);
            }
            if !p.beyond(recvs_posted) {
                dq.post_recv(recvs_posted, &cyc)?;
                recvs_posted += 1;
            }
        }
        if more(sent, &clock) {
            posted_at.push(start.elapsed().as_nanos() as u64);
            sent += 1;
            dq.post(p, 0, 0, &cyc, send_flags::SIGNALED)?;
            // Our Send's completion; the peer's answer may complete before it.
            while next_is_recv(dq)? {
                arrived += 1;
            }
        }
    }
    Ok(match p.timed {
        Some(_) => timed_lat(clock.as_ref(), size, 2.0),
        None => LatRun::Iterations(lat_result(&posted_at, size, 2.0)),
    })
}

fn timed_lat(clock: Option<&RunClock>, size: u64, rtt_factor: f64) -> LatRun {
    let (n, secs) = clock.map_or((0, 0.0), |c| (c.counted(), c.sample_secs()));
    LatRun::Timed(TimedLat::new(size, n, secs, rtt_factor))
}

/// `run_iter_lat_write`: ping-pong of RDMA Writes on the first QP. Each side's Write of
/// `size` bytes carries its count (mod 256) in its last byte; a side writes its next one
/// when the peer's last byte in its own memory shows the count it waits for. The client
/// writes first. Returns the report from the post times (half a round trip each); timed,
/// the clock starts with the loop and the Writes completed in the sample are counted.
pub fn run_lat_write(dq: &DataQp, p: &Params, size: u64) -> Result<LatRun, PerfError> {
    let iters = p.iters;
    let last = (size - 1) as usize;
    let mut posted_at = Vec::with_capacity(iters as usize);
    let (mut sent, mut seen, mut completed) = (0u64, 0u64, 0u64);
    let mut clock = p.timed.map(|t| t.start());
    let start = Instant::now();
    let more = |n: u64, clock: &Option<RunClock>| match clock {
        None => n < iters,
        Some(c) => !c.ended(),
    };
    while more(sent, &clock) || more(completed, &clock) || more(seen, &clock) {
        if more(seen, &clock) && !(sent == 0 && !p.client) {
            seen += 1;
            if !dq.await_byte(dq.half as usize + last, seen as u8, clock.as_ref())? {
                break;
            }
        }
        if more(sent, &clock) {
            posted_at.push(start.elapsed().as_nanos() as u64);
            sent += 1;
            dq.ep.buf.write(last, &[sent as u8]);
            dq.post(p, 0, 0, &p.cycle(size), send_flags::SIGNALED)?;
        }
        if more(completed, &clock) {
            dq.next("write_lat Write")?;
            completed += 1;
            if let Some(c) = &mut clock {
                c.count(1);
            }
        }
    }
    Ok(match clock {
        Some(c) => timed_lat(Some(&c), size, 2.0),
        None => LatRun::Iterations(lat_result(&posted_at, size, 2.0)),
    })
}

/// `run_iter_lat` for ib_read_lat and ib_atomic_lat (client only): one RDMA Read of
/// `size` bytes (or one atomic) at a time on the peer's buffer, each waited for. Returns
/// the report from the post times (a whole round trip each); timed, the requests
/// completed in the sample are counted.
pub fn run_lat_one_at_a_time(dq: &DataQp, p: &Params, size: u64) -> Result<LatRun, PerfError> {
    let cyc = p.cycle(size);
    let mut posted_at = Vec::with_capacity(p.iters as usize);
    let mut clock = p.timed.map(|t| t.start());
    let start = Instant::now();
    let mut k = 0u64;
    loop {
        match &clock {
            Some(c) if c.ended() => break,
            None if k >= p.iters => break,
            _ => {}
        }
        k += 1;
        posted_at.push(start.elapsed().as_nanos() as u64);
        dq.post(p, 0, 0, &cyc, send_flags::SIGNALED)?;
        dq.next("latency request")?;
        if let Some(c) = &mut clock {
            c.count(1);
        }
    }
    Ok(match clock {
        Some(c) => timed_lat(Some(&c), size, 1.0),
        None => LatRun::Iterations(lat_result(&posted_at, size, 1.0)),
    })
}

/// Wait for the next completion of a ping-pong: `true` for a message received, `false`
/// for our own Send.
fn next_is_recv(dq: &DataQp) -> Result<bool, PerfError> {
    let c = dq.next("send_lat message")?;
    Ok(c.opcode() == Some(WcOpcode::Recv))
}

/// Reset the credit words before a send_bw run (perftest zeroes `credit_buf`).
pub fn reset_credits(qps: &[DataQp]) {
    qps.iter().for_each(DataQp::reset_credit);
}

/// `--validate` (krdma to krdma only): the bytes `p.iters` messages of `size` put into
/// this side's buffers match the peer's fill pattern. Where they land: the upper half
/// for Writes and Sends received, the lower half for Reads. A server checking Writes
/// waits up to `patience` for data still in flight on the data connection.
pub fn validate(qps: &[DataQp], p: &Params, size: u64, patience: Duration) -> bool {
    let cyc = p.cycle(size);
    let peer = seed(!p.client);
    let upper = p.test.verb() != Verb::Read;
    let deadline = Instant::now() + patience;
    loop {
        if qps.iter().all(|dq| dq.verify(&cyc, p.iters, peer, upper)) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn seed(client: bool) -> u32 {
    if client {
        CLIENT_SEED
    } else {
        SERVER_SEED
    }
}

/// The deterministic fill pattern (xorshift32 words).
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 4);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_deterministic() {
        assert_eq!(pattern(CLIENT_SEED, 10), pattern(CLIENT_SEED, 12)[..10]);
        assert_ne!(pattern(CLIENT_SEED, 8), pattern(SERVER_SEED, 8));
    }
}
