//! perftest's result computation and its report lines, format string for format string
//! (`print_report_bw`, `print_full_bw_report`, `print_report_lat` in perftest 4.5).

use super::wire::BwReport;

pub const RESULT_LINE: &str =
    "---------------------------------------------------------------------------------------";
const RESULT_FMT: &str =
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
const RESULT_FMT_G: &str =
    " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]";
const RESULT_FMT_LAT: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] ";

/// perftest's "MB" is MiB (`0x100000`); `--report_gbits` divides by 125000000 (Gb = 10^9 bit).
/// A timed latency run's header and line (`RESULT_FMT_LAT_DUR`, `REPORT_FMT_LAT_DUR`).
const RESULT_FMT_LAT_DUR: &str = " #bytes        #iterations       t_avg[usec]    tps average";

fn format_factor(gbits: bool) -> f64 {
    if gbits {
        125_000_000.0
    } else {
        1_048_576.0
    }
}

pub fn bw_header(gbits: bool) -> &'static str {
    if gbits {
        RESULT_FMT_G
    } else {
        RESULT_FMT
    }
}

pub fn lat_header(timed: bool) -> &'static str {
    if timed {
        RESULT_FMT_LAT_DUR
    } else {
        RESULT_FMT_LAT
    }
}

/// Timestamps of a bandwidth run in nanoseconds since its start, indexed like perftest's
/// `tposted` / `tcompleted`: a completion covering `cq_mod` requests is stamped at the
/// index of the last request it covers. Without peak computation only the first post and
/// the last completion are kept (one slot each), as perftest does.
#[derive(Debug, Clone)]
pub struct BwTimes {
    posted: Vec<u64>,
    completed: Vec<u64>,
}

impl BwTimes {
    pub fn new(n: u64, no_peak: bool) -> BwTimes {
        let len = if no_peak { 1 } else { n.max(1) as usize };
        BwTimes {
            posted: vec![0; len],
            completed: vec![0; len],
        }
    }

    /// Record the post of request `i` (0-based, over all QPs).
    pub fn post(&mut self, i: u64, now: u64) {
        if let Some(t) = self.posted.get_mut(i as usize) {
            *t = now;
        }
    }

    /// Record a completion after `total_completed` (already incremented by `cq_mod`).
    pub fn complete(&mut self, total_completed: u64, now: u64) {
        let n = self.completed.len() as u64;
        let i = total_completed.min(n).saturating_sub(1);
        self.completed[i as usize] = now;
    }
}

/// `print_report_bw` for `n` messages of `size` bytes: average over the whole run, peak
/// over the best window between a post and a later moderated completion, message rate in
/// millions per second.
pub fn bw_result(
    t: &BwTimes,
    n: u64,
    size: u64,
    cq_mod: u64,
    no_peak: bool,
    gbits: bool,
) -> BwReport {
    let end = t.completed[t.completed.len() - 1];
    let secs = end.saturating_sub(t.posted[0]).max(1) as f64 / 1e9;
    let ff = format_factor(gbits);
    let bw_peak = if no_peak || t.posted.len() < 2 && n > 1 {
        0.0
    } else {
        let opt = best_delta(t, cq_mod.max(1) as usize).max(1) as f64 / 1e9;
        size as f64 / opt / ff
    };
    BwReport {
        size,
        iters: n,
        bw_peak,
        bw_avg: size as f64 * n as f64 / secs / ff,
        msg_rate: n as f64 / secs / 1e6,
    }
}

/// The smallest per-message time between post `i` and a moderated completion `j >= i`.
/// A timed bandwidth run (`print_report_bw` with `-D`): `counted` requests in a sample of
/// `secs` seconds; no peak.
pub fn bw_timed(counted: u64, secs: f64, size: u64, gbits: bool) -> BwReport {
    let secs = if secs > 0.0 { secs } else { 1.0 };
    BwReport {
        size,
        iters: counted,
        bw_peak: 0.0,
        bw_avg: size as f64 * counted as f64 / secs / format_factor(gbits),
        msg_rate: counted as f64 / secs / 1e6,
    }
}

fn best_delta(t: &BwTimes, cq_mod: usize) -> u64 {
    let n = t.posted.len();
    let per = |i: usize, j: usize| t.completed[j].saturating_sub(t.posted[i]) / (j - i + 1) as u64;
    let mut opt = u64::MAX;
    for i in 0..n {
        let mut j = (i + 1).div_ceil(cq_mod) * cq_mod - 1;
        while j < n {
            opt = opt.min(per(i, j));
            j += cq_mod;
        }
        if !n.is_multiple_of(cq_mod) {
            opt = opt.min(per(i, n - 1));
        }
    }
    opt
}

/// One line of the bandwidth table (`REPORT_FMT`, or `REPORT_FMT_EXT` for small Gb/s).
pub fn bw_line(r: &BwReport, gbits: bool) -> String {
    if gbits && r.bw_avg < 0.1 {
        format!(
            " {:<7}    {}           {:<7.6}            {:<7.6}            {:<7.6}",
            r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate
        )
    } else {
        format!(
            " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
            r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate
        )
    }
}

/// A latency result in microseconds, as `print_report_lat` computes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatReport {
    pub size: u64,
    pub iters: u64,
    pub t_min: f64,
    pub t_max: f64,
    pub t_typical: f64,
    pub t_avg: f64,
    pub t_stdev: f64,
    pub p99: f64,
    pub p99_9: f64,
}

/// Samples tail perftest drops (`LAT_MEASURE_TAIL`).
const LAT_MEASURE_TAIL: usize = 2;

/// From the send timestamps (ns) of a ping-pong run: each sample is the time between two
/// consecutive sends (a round trip) divided by `rtt_factor` (2 for Send, 1 for Read).
/// Keeps perftest's quirks: the two largest samples are dropped, `t_max` is the largest of
/// the rest, the standard deviation sums squared differences truncated to integers.
pub fn lat_result(posted: &[u64], size: u64, rtt_factor: f64) -> LatReport {
    let mut d: Vec<f64> = posted
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]) as f64 / 1000.0 / rtt_factor)
        .collect();
    d.sort_by(|a, b| a.total_cmp(b));
    let m = d.len().saturating_sub(LAT_MEASURE_TAIL).max(1);
    let d = if d.is_empty() { vec![0.0] } else { d };
    let median = if (m - 1) % 2 == 1 {
        (d[m / 2] + d[m / 2 - 1]) / 2.0
    } else {
        d[m / 2]
    };
    let avg = d[..m].iter().sum::<f64>() / m as f64;
    let var: f64 = d[..m]
        .iter()
        .map(|x| {
            let t = (avg - x) as i32 as f64;
            t.powi(2) as i32 as f64
        })
        .sum();
    let at = |q: f64| d[((m as f64 * q).ceil() as usize).min(d.len() - 1)];
    LatReport {
        size,
        iters: posted.len() as u64,
        t_min: d[0],
        t_max: d[m.min(d.len() - 1)],
        t_typical: median,
        t_avg: avg,
        t_stdev: (var / m as f64).sqrt(),
        p99: at(0.99),
        p99_9: at(0.999),
    }
}

/// One line of the latency table (`REPORT_FMT_LAT`).
pub fn lat_line(r: &LatReport) -> String {
    format!(
        " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        r.size, r.iters, r.t_min, r.t_max, r.t_typical, r.t_avg, r.t_stdev, r.p99, r.p99_9
    )
}

/// A timed latency run (`print_report_lat_duration`): the average over the sample, and
/// transactions per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedLat {
    pub size: u64,
    pub iters: u64,
    pub t_avg: f64,
    pub tps: f64,
}

impl TimedLat {
    /// `iters` exchanges in `secs` seconds; `rtt_factor` 2 when each is a round trip
    /// measured as two one-way latencies (send and write), 1 for reads and atomics.
    pub fn new(size: u64, iters: u64, secs: f64, rtt_factor: f64) -> TimedLat {
        let n = iters.max(1) as f64;
        TimedLat {
            size,
            iters,
            t_avg: secs * 1e6 / rtt_factor / n,
            tps: if secs > 0.0 { iters as f64 / secs } else { 0.0 },
        }
    }

    pub fn line(&self) -> String {
        format!(
            " {:<7}       {}            {:<7.2}        {:<7.2}",
            self.size, self.iters, self.t_avg, self.tps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bw_numbers() {
        // 10 messages of 1 MiB, one every millisecond, completions every 5 (cq_mod 5).
        let mut t = BwTimes::new(10, false);
        for i in 0..10 {
            t.post(i, i * 1_000_000);
        }
        t.complete(5, 5_000_000);
        t.complete(10, 10_000_000);
        let r = bw_result(&t, 10, 1 << 20, 5, false, false);
        assert!((r.bw_avg - 1000.0).abs() < 1e-9, "{}", r.bw_avg);
        assert!((r.msg_rate - 0.001).abs() < 1e-12);
        assert!((r.bw_peak - 1000.0).abs() < 1e-6, "{}", r.bw_peak);
        let mut q = BwTimes::new(10, true);
        (0..10).for_each(|i| q.post(i, i * 1_000_000));
        q.complete(10, 10_000_000);
        let g = bw_result(&q, 10, 1 << 20, 5, true, true);
        assert_eq!(g.bw_peak, 0.0);
        assert!((g.bw_avg - 8.388608).abs() < 1e-9, "{}", g.bw_avg);
        assert_eq!(
            bw_line(&r, false),
            " 1048576    10               1000.00            1000.00\t\t   0.001000"
        );
    }

    #[test]
    fn lat_numbers() {
        // Round trips of 10, 12, 14, ... us: one-way samples 5, 6, 7, ...
        let mut posted = vec![0u64];
        for i in 0..10u64 {
            let last = *posted.last().unwrap();
            posted.push(last + 10_000 + 2_000 * i);
        }
        let r = lat_result(&posted, 2, 2.0);
        assert_eq!(r.iters, 11);
        assert_eq!(r.t_min, 5.0);
        // 10 samples, the two largest (13, 14) dropped: t_max is the 9th smallest.
        assert_eq!(r.t_max, 13.0);
        assert_eq!(r.t_typical, 8.5);
        assert_eq!(r.t_avg, 8.5);
        assert!(lat_line(&r).starts_with(" 2       11          5.00 "));
    }
}
