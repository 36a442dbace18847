//! `-D`: perftest's timed runs. perftest walks a run through four states on `SIGALRM`
//! (`catch_alarm`): a warm-up of `margin` seconds, the sample (`duration - 2 × margin`
//! seconds, the only part counted), a cool-down of `margin` seconds, and the end, when the
//! loops stop. Here the state is read off a clock instead of set by a signal handler:
//! the same boundaries, and no signal handler in a library.

use std::time::{Duration, Instant};

/// Where a timed run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Warmup,
    Sample,
    Cooldown,
    End,
}

/// A timed run's length and margins, in whole seconds as perftest takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timed {
    pub duration: u32,
    pub margin: u32,
}

impl Timed {
    /// perftest's rules: the margin defaults to a quarter of the duration, and the sample
    /// must be longer than nothing (`duration > 2 × margin`).
    pub fn new(duration: u32, margin: Option<u32>) -> Result<Timed, &'static str> {
        let margin = margin.unwrap_or(duration / 4);
        if duration <= margin.saturating_mul(2) {
            return Err("please check that DURATION > 2*MARGIN");
        }
        Ok(Timed { duration, margin })
    }

    /// The length of the measured part.
    pub fn sample(&self) -> Duration {
        Duration::from_secs((self.duration - 2 * self.margin) as u64)
    }

    /// A clock for a run starting now.
    pub fn start(&self) -> RunClock {
        RunClock {
            t: *self,
            start: Instant::now(),
            counted: 0,
        }
    }
}

/// One timed run: its phases, and the events counted in its sample.
#[derive(Debug, Clone)]
pub struct RunClock {
    t: Timed,
    start: Instant,
    counted: u64,
}

impl RunClock {
    pub fn phase(&self) -> Phase {
        let at = self.start.elapsed();
        let s = |secs: u32| Duration::from_secs(secs as u64);
        if at < s(self.t.margin) {
            Phase::Warmup
        } else if at < s(self.t.duration - self.t.margin) {
            Phase::Sample
        } else if at < s(self.t.duration) {
            Phase::Cooldown
        } else {
            Phase::End
        }
    }

    pub fn ended(&self) -> bool {
        self.phase() == Phase::End
    }

    /// In the last stretch of the run: the cool-down, or (without margins) its last
    /// second. A peer that closes now has simply finished first (the two clocks start a
    /// little apart), not failed.
    pub fn winding_down(&self) -> bool {
        let left = Duration::from_secs(self.t.duration as u64).saturating_sub(self.start.elapsed());
        left <= Duration::from_secs(self.t.margin.max(1) as u64)
    }

    /// Count `n` events (iterations, or completions worth `cq_mod` requests) if they
    /// happen in the sample.
    pub fn count(&mut self, n: u64) {
        if self.phase() == Phase::Sample {
            self.counted += n;
        }
    }

    /// Events counted in the sample.
    pub fn counted(&self) -> u64 {
        self.counted
    }

    /// The sample's length in seconds.
    pub fn sample_secs(&self) -> f64 {
        self.t.sample().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perftest_rules() {
        assert_eq!(
            Timed::new(5, None),
            Ok(Timed {
                duration: 5,
                margin: 1
            })
        );
        assert_eq!(Timed::new(3, None).unwrap().margin, 0);
        assert_eq!(
            Timed::new(4, Some(2)),
            Err("please check that DURATION > 2*MARGIN")
        );
        assert_eq!(
            Timed::new(5, Some(0)).unwrap().sample(),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn counts_only_the_sample() {
        // No margins: the whole run is the sample until it ends.
        let mut c = Timed::new(1, Some(0)).unwrap().start();
        assert_eq!(c.phase(), Phase::Sample);
        c.count(3);
        assert_eq!(c.counted(), 3);
        let mut w = Timed::new(5, Some(2)).unwrap().start();
        assert_eq!(w.phase(), Phase::Warmup);
        w.count(7);
        assert_eq!(w.counted(), 0);
    }
}
