//! The kAL's own counters: every request, registration or listen it refused, by reason
//! (`krdma stat`; `STAT_DEVICE` with `KAL_COUNTERS`, with the kAL's other counters).

use crate::opener::Refusal;
use rnicpi::Counter;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Counters {
    /// Requests refused because of who made them, and contexts ended because their opener
    /// is gone or changed, indexed like [`Refusal::ALL`].
    opener: [AtomicU64; Refusal::ALL.len()],
    /// Registrations of memory that is not anonymous, shmem or hugetlb, or is
    /// registered with a userfaultfd (`EFAULT`).
    pub backing_refused: AtomicU64,
    /// LISTENs on a privileged port by a caller without `CAP_NET_BIND_SERVICE`.
    pub privileged_port_refused: AtomicU64,
    /// Calls into an embedded kAL from a fork child of its process.
    pub fork_child_refused: AtomicU64,
}

impl Counters {
    pub fn refused(&self, r: Refusal) {
        let i = Refusal::ALL.iter().position(|x| *x == r).unwrap_or(0);
        self.opener[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn list(&self) -> Vec<Counter> {
        let mut v: Vec<Counter> = Refusal::ALL
            .iter()
            .zip(&self.opener)
            .map(|(r, c)| (r.counter(), c.load(Ordering::Relaxed)))
            .collect();
        for (name, c) in [
            ("reg_mr_refused_backing", &self.backing_refused),
            (
                "listen_refused_privileged_port",
                &self.privileged_port_refused,
            ),
            ("call_refused_fork_child", &self.fork_child_refused),
        ] {
            v.push((name, c.load(Ordering::Relaxed)));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_fits_a_stat_row() {
        for (name, _) in Counters::default().list() {
            assert!(
                name.len() < crate::abi::Name::default().len(),
                "{name} is too long"
            );
        }
    }
}
