//! The outstanding read queue (ORQ): the RDMA Reads this QP sent that the peer has not
//! fully answered yet, oldest first. A Read Response is accepted only as the next bytes
//! of the oldest of them — its STag is that read's sink, its tagged offset is where the
//! next byte goes, it does not run past the read's size and it ends exactly there when
//! it says it is the last — and all of that is checked before a byte is placed (kernel
//! siw's `siw_rresp_check_ntoh`). A response with no read outstanding is refused too.
//! So a peer can write only into the one range this QP asked it to fill.

use crate::wire::{term, TermCode};
use std::collections::VecDeque;

/// One RDMA Read Request sent and not fully answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutstandingRead {
    /// The read's message sequence number (queue 1), naming it while it is outstanding.
    pub msn: u32,
    /// Where the data goes: the local registration (sink STag) and address (sink TO).
    pub sink_stag: u32,
    pub sink_to: u64,
    pub size: u32,
    /// Bytes placed so far.
    received: u32,
}

impl OutstandingRead {
    pub fn new(msn: u32, sink_stag: u32, sink_to: u64, size: u32) -> Self {
        OutstandingRead {
            msn,
            sink_stag,
            sink_to,
            size,
            received: 0,
        }
    }
}

/// Where an accepted Read Response segment goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    /// The read it answers.
    pub msn: u32,
    pub stag: u32,
    pub to: u64,
    pub len: u32,
    /// The segment is the read's last: it completes once placed.
    pub completes: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Orq {
    reads: VecDeque<OutstandingRead>,
}

fn tagged(ecode: u8) -> TermCode {
    TermCode {
        layer: term::LAYER_DDP,
        etype: term::DDP_TAGGED_BUF,
        ecode,
    }
}

/// A Read Response with no read outstanding (kernel siw: DDP catastrophic).
pub(crate) const UNSOLICITED: TermCode = TermCode {
    layer: term::LAYER_DDP,
    etype: term::DDP_CATASTROPHIC,
    ecode: 0,
};

impl Orq {
    /// Reads outstanding (the QP's ORD is spent on them).
    pub fn len(&self) -> usize {
        self.reads.len()
    }

    /// A read about to be sent. It is queued before its request leaves, so the response
    /// can never arrive first.
    pub fn push(&mut self, r: OutstandingRead) {
        self.reads.push_back(r);
    }

    /// The read with `msn` never left (a local error while building its request).
    pub fn cancel(&mut self, msn: u32) {
        self.reads.retain(|r| r.msn != msn);
    }

    /// Forget every read (the QP went to Error; their requests complete flushed).
    pub fn clear(&mut self) {
        self.reads.clear();
    }

    /// Check one Read Response segment — its sink STag, tagged offset, payload length
    /// and last flag — against the oldest outstanding read, before anything is placed.
    pub fn check(&self, stag: u32, to: u64, len: usize, last: bool) -> Result<Placement, TermCode> {
        let r = self.reads.front().ok_or(UNSOLICITED)?;
        if stag != r.sink_stag {
            return Err(tagged(term::DDP_TAGGED_INV_STAG));
        }
        if to != r.sink_to.wrapping_add(r.received as u64) {
            return Err(tagged(term::DDP_TAGGED_BASE_BOUNDS));
        }
        let end = (r.received as u64).saturating_add(len as u64);
        if end > r.size as u64 || (last && end != r.size as u64) {
            return Err(tagged(term::DDP_TAGGED_BASE_BOUNDS));
        }
        Ok(Placement {
            msn: r.msn,
            stag,
            to,
            len: len as u32,
            completes: last,
        })
    }

    /// Account a segment `check` accepted and that has been placed. Returns the read it
    /// completed. A placement whose read is no longer at the front (the queue was
    /// cleared meanwhile) changes nothing.
    pub fn advance(&mut self, p: &Placement) -> Option<OutstandingRead> {
        let r = self.reads.front_mut().filter(|r| r.msn == p.msn)?;
        // `check` bounded received + len by the read's size (a u32).
        r.received += p.len;
        if p.completes {
            self.reads.pop_front()
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn orq_with(reads: &[(u32, u32, u64, u32)]) -> Orq {
        let mut q = Orq::default();
        for &(msn, stag, to, size) in reads {
            q.push(OutstandingRead::new(msn, stag, to, size));
        }
        q
    }

    #[test]
    fn unsolicited_responses_are_refused() {
        let q = Orq::default();
        assert_eq!(q.check(0x101, 0x1000, 5, false), Err(UNSOLICITED));
        assert_eq!(q.check(0x101, 0x1000, 0, true), Err(UNSOLICITED));
    }

    #[test]
    fn response_must_continue_the_oldest_read() {
        let mut q = orq_with(&[(1, 0x101, 0x1000, 100), (2, 0x202, 0x9000, 8)]);
        // The second read's sink is not where the next byte goes.
        assert_eq!(
            q.check(0x202, 0x9000, 8, true),
            Err(tagged(term::DDP_TAGGED_INV_STAG))
        );
        assert_eq!(
            q.check(0x101, 0x1001, 10, false),
            Err(tagged(term::DDP_TAGGED_BASE_BOUNDS))
        );
        let p = q.check(0x101, 0x1000, 60, false).unwrap();
        assert_eq!(q.advance(&p), None);
        // Replaying the first segment is refused: the next byte is at +60.
        assert!(q.check(0x101, 0x1000, 40, true).is_err());
        // Too short for the last segment, too long for any.
        assert!(q.check(0x101, 0x1000 + 60, 39, true).is_err());
        assert!(q.check(0x101, 0x1000 + 60, 41, false).is_err());
        let p = q.check(0x101, 0x1000 + 60, 40, true).unwrap();
        assert_eq!(q.advance(&p).map(|r| r.msn), Some(1));
        // Now the second read is the oldest.
        let p = q.check(0x202, 0x9000, 8, true).unwrap();
        assert_eq!(q.advance(&p).map(|r| r.msn), Some(2));
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn zero_length_read_takes_one_empty_last_segment() {
        let mut q = orq_with(&[(7, 0, 0, 0)]);
        assert!(q.check(0, 0, 1, true).is_err());
        let p = q.check(0, 0, 0, true).unwrap();
        assert_eq!(q.advance(&p).map(|r| r.msn), Some(7));
    }

    #[test]
    fn sizes_near_the_u32_limit_do_not_overflow() {
        let mut q = orq_with(&[(1, 0x101, u64::MAX - 10, u32::MAX)]);
        let p = q
            .check(0x101, u64::MAX - 10, u32::MAX as usize - 1, false)
            .unwrap();
        q.advance(&p);
        assert!(q
            .check(
                0x101,
                (u64::MAX - 10).wrapping_add(u32::MAX as u64 - 1),
                2,
                false
            )
            .is_err());
        let last = (u64::MAX - 10).wrapping_add(u32::MAX as u64 - 1);
        let p = q.check(0x101, last, 1, true).unwrap();
        assert!(q.advance(&p).is_some());
    }

    #[test]
    fn a_cleared_queue_ignores_a_late_placement() {
        let mut q = orq_with(&[(3, 0x101, 0, 10)]);
        let p = q.check(0x101, 0, 10, true).unwrap();
        q.clear();
        q.push(OutstandingRead::new(4, 0x101, 0, 10));
        assert_eq!(q.advance(&p), None);
        assert_eq!(q.len(), 1);
    }
}
