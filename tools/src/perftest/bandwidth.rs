//! perftest's bandwidth runs on the data QPs: `run_iter_bw` (the client, and both sides
//! of a bidirectional RDMA test), `run_iter_bw_server` (send_bw) and `run_iter_bi`
//! (bidirectional send_bw), each by iterations or (`-D`) by the clock.

use super::control::{check, closed, DATA_IDLE};
use super::params::{Cycle, Params};
use super::report::{bw_result, bw_timed, BwTimes};
use super::timed::RunClock;
use super::traffic::{DataQp, CREDIT_ID};
use super::wire::BwReport;
use super::PerfError;
use rnicpi::{send_flags, WcOpcode};
use std::time::{Duration, Instant};
use ual::Cqe;

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

    /// perftest's report of the run: from the clock's sample in a timed run, else from
    /// the post and completion times.
    fn report(&self, size: u64) -> BwReport {
        let p = self.p;
        if let Some(c) = &self.clock {
            return bw_timed(c.counted(), c.sample_secs(), size, p.gbits);
        }
        let n = p.iters * self.qps.len() as u64;
        bw_result(&self.times, n, size, p.cq_mod as u64, p.no_peak, p.gbits)
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
    Ok(run.report(size))
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
        if p.credit_due(received[q]) {
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
                credit_due[q] |= p.credit_due(received[q]);
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
    Ok(run.report(size))
}
