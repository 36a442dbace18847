//! perftest's latency runs on the first data QP: `run_iter_lat_send`,
//! `run_iter_lat_write` and `run_iter_lat` (Reads and atomics), each by iterations or
//! (`-D`) by the clock.

use super::params::Params;
use super::report::{lat_result, LatReport, TimedLat};
use super::timed::RunClock;
use super::traffic::{Awaited, DataQp};
use super::PerfError;
use rnicpi::{send_flags, WcOpcode};
use std::time::{Duration, Instant};

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
                match next_is_recv(dq, clock.as_ref())? {
                    Some(recv) => arrived += recv as u64,
                    None => return Ok(timed_lat(clock.as_ref(), size, 2.0)),
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
            loop {
                match next_is_recv(dq, clock.as_ref())? {
                    Some(true) => arrived += 1,
                    Some(false) => break,
                    None => return Ok(timed_lat(clock.as_ref(), size, 2.0)),
                }
            }
        }
    }
    Ok(outcome(p, clock.as_ref(), &posted_at, size, 2.0))
}

/// A run's report: from the clock's sample in a timed run, else from the post times.
fn outcome(
    p: &Params,
    clock: Option<&RunClock>,
    posted_at: &[u64],
    size: u64,
    rtt_factor: f64,
) -> LatRun {
    match p.timed {
        Some(_) => timed_lat(clock, size, rtt_factor),
        None => LatRun::Iterations(lat_result(posted_at, size, rtt_factor)),
    }
}

fn timed_lat(clock: Option<&RunClock>, size: u64, rtt_factor: f64) -> LatRun {
    let (n, secs) = clock.map_or((0, 0.0), |c| (c.counted(), c.sample_secs()));
    LatRun::Timed(TimedLat::new(size, n, secs, rtt_factor))
}

/// `run_iter_lat_write`: ping-pong of RDMA Writes on the first QP. Each side's Write of
/// `size` bytes carries its count (mod 256) in its last byte; a side writes its next one
/// when the peer's last byte in its own memory shows the count it waits for. The server
/// writes first. Returns the report from the post times (half a round trip each); timed,
/// the clock starts with the loop and the Writes completed in the sample are counted.
///
/// A timed run does not simply stop at its end: perftest's wait for the peer's byte does
/// not read its clock again (its `state` is not `volatile`, so the compiler reads it
/// once), so a perftest peer whose clock runs later than ours would wait for our next
/// Write for ever. After the end we keep answering (see [`linger_write_lat`]).
pub fn run_lat_write(dq: &DataQp, p: &Params, size: u64) -> Result<LatRun, PerfError> {
    let iters = p.iters;
    let last = (size - 1) as usize;
    let mut posted_at = Vec::with_capacity(iters as usize);
    let (mut sent, mut seen, mut completed) = (0u64, 0u64, 0u64);
    let mut clock = p.timed.map(|t| t.start());
    let start = Instant::now();
    let ended = |clock: &Option<RunClock>| clock.as_ref().is_some_and(RunClock::ended);
    let more = |n: u64, clock: &Option<RunClock>| match clock {
        None => n < iters,
        Some(c) => !c.ended(),
    };
    while more(sent, &clock) || more(completed, &clock) || more(seen, &clock) {
        // The server writes first (perftest's `!(scnt < 1 && machine == SERVER)`).
        if (clock.is_some() || seen < iters) && (sent != 0 || p.client) {
            seen += 1;
            let at = dq.half as usize + last;
            match dq.await_byte(at, seen as u8, clock.as_ref())? {
                Awaited::Landed => {}
                // Not arrived yet: the linger below waits for it and answers it.
                Awaited::Ended => {
                    seen -= 1;
                    break;
                }
                Awaited::PeerGone => return Ok(timed_lat(clock.as_ref(), size, 2.0)),
            }
        }
        if clock.is_some() || sent < iters {
            posted_at.push(start.elapsed().as_nanos() as u64);
            sent += 1;
            dq.ep.buf.write(last, &[sent as u8]);
            dq.post(p, 0, 0, &p.cycle(size), send_flags::SIGNALED)?;
        }
        if ended(&clock) {
            break;
        }
        if more(completed, &clock) {
            if dq.next_until("write_lat Write", clock.as_ref())?.is_none() {
                break;
            }
            completed += 1;
            if let Some(c) = &mut clock {
                c.count(1);
            }
        }
    }
    if clock.is_some() {
        linger_write_lat(dq, p, size, seen, sent)?;
    }
    Ok(outcome(p, clock.as_ref(), &posted_at, size, 2.0))
}

/// How long a timed write_lat that has ended keeps answering a peer that goes on: until
/// the peer has been quiet this long, and no longer than [`LINGER_MAX`] in all.
const LINGER_QUIET: Duration = Duration::from_millis(500);
/// Two sides that both linger answer each other: this ends it.
const LINGER_MAX: Duration = Duration::from_secs(2);

/// After a timed write_lat: the peer's clock may run later than ours (it started its loop
/// later), and its loop does not look at its clock while it waits for our byte (see
/// [`run_lat_write`]), nor while it waits for its own Write's completion. So keep
/// answering each Write of the peer's (not counted) until it has been quiet for
/// [`LINGER_QUIET`] (it stopped at its own end) or for at most [`LINGER_MAX`] (a krdma
/// peer lingers too, and two lingering sides would answer each other for ever). Our QP stays up meanwhile,
/// so its last Write is acknowledged (a kernel rxe peer otherwise retransmits it to a
/// destroyed QP without end). `seen` and `sent` continue the run's counts.
fn linger_write_lat(
    dq: &DataQp,
    p: &Params,
    size: u64,
    mut seen: u64,
    mut sent: u64,
) -> Result<(), PerfError> {
    let last = (size - 1) as usize;
    let mut c = [ual::Cqe::default(); 8];
    let until = Instant::now() + LINGER_MAX;
    while Instant::now() < until {
        let landed = dq.await_byte_for(dq.half as usize + last, (seen + 1) as u8, LINGER_QUIET);
        // Our own Writes' completions, whatever their status (the peer may be gone).
        while dq.ep.cq.poll(&mut c) > 0 {}
        if !landed {
            return Ok(());
        }
        seen += 1;
        sent += 1;
        dq.ep.buf.write(last, &[sent as u8]);
        if dq
            .post(p, 0, 0, &p.cycle(size), send_flags::SIGNALED)
            .is_err()
        {
            return Ok(());
        }
    }
    Ok(())
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
    Ok(outcome(p, clock.as_ref(), &posted_at, size, 1.0))
}

/// Wait for the next completion of a ping-pong: `true` for a message received, `false`
/// for our own Send; `None` once a timed run is over (see [`DataQp::next_until`]).
fn next_is_recv(dq: &DataQp, clock: Option<&RunClock>) -> Result<Option<bool>, PerfError> {
    let c = dq.next_until("send_lat message", clock)?;
    Ok(c.map(|c| c.opcode() == Some(WcOpcode::Recv)))
}
