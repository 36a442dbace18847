//! What every software RC queue pair is made of before its transport: the rings, CQs,
//! SRQ, event sink and ring counters it was created with, and what a QP does with them
//! alone — take the next receive, complete work, and flush both queues on the way into
//! Error as the provider contract asks ([`crate::provider`], "Who flushes").
//!
//! The transport's own state (sequence numbers, requests in flight, a receive being
//! placed) stays in the provider: the flush helpers get the completion the provider
//! wants written through a callback, so each provider keeps its own answer to a lost
//! completion (siw terminates the stream, rxe counts it).

use crate::event::{Event, EventKind, EventSink};
use crate::fastpath::RingStats;
use crate::provider::{ProviderCq, ProviderSrq, QpInit};
use crate::queue::{Consumer, RingCorrupt};
use crate::types::QpCaps;
use crate::wr::{Cqe, WcStatus, Wqe};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// The resources a software QP got at creation, and the work-queue handling that is the
/// same whatever the transport.
pub struct QpBase {
    pub qpn: u32,
    /// The provider's protection-domain number every local and remote access is checked in.
    pub pd: u32,
    /// Granted sizes.
    pub caps: QpCaps,
    /// The engine's end of the consumer's send ring.
    pub sq: Mutex<Consumer<Wqe>>,
    /// Receives the QP's affiliated and connection events.
    pub sink: Arc<dyn EventSink>,
    /// Where a corrupt ring and a spent drain budget are counted.
    pub stats: Arc<RingStats>,
    /// The engine's end of the consumer's receive ring; unused when `srq` is set.
    rq: Mutex<Consumer<Wqe>>,
    srq: Option<Arc<dyn ProviderSrq>>,
    send_cq: Arc<dyn ProviderCq>,
    recv_cq: Arc<dyn ProviderCq>,
    /// `LastWqeReached` was reported (a QP on an SRQ).
    last_wqe_sent: AtomicBool,
}

impl QpBase {
    /// The base of QP number `qpn`, holding what `init` granted.
    pub fn new(qpn: u32, init: QpInit) -> QpBase {
        QpBase {
            qpn,
            pd: init.pd,
            caps: init.caps,
            sq: Mutex::new(init.sq),
            sink: init.sink,
            stats: init.stats,
            rq: Mutex::new(init.rq),
            srq: init.srq,
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            last_wqe_sent: AtomicBool::new(false),
        }
    }

    /// Let consumers polling this QP's CQs drive `source` (the QP's engine) in their
    /// threads ([`crate::progress`]).
    pub fn drive_from_polls(&self, source: Weak<dyn crate::Progress>) {
        self.send_cq
            .engine()
            .progress_sources()
            .attach(source.clone());
        self.recv_cq.engine().progress_sources().attach(source);
    }

    /// A completion of this QP for the request `w`.
    pub fn cqe(&self, w: &Wqe, status: WcStatus, byte_len: u32) -> Cqe {
        Cqe {
            wr_id: w.wr_id,
            status: status as u8,
            opcode: w.opcode().map(|o| o.wc_opcode() as u8).unwrap_or(0),
            flags: 0,
            _reserved: 0,
            byte_len,
            qp_num: self.qpn,
            imm_or_inv: 0,
            src_qp: 0,
            vendor_err: 0,
        }
    }

    /// Append `cqe` to the send CQ (`send`) or the receive CQ; false when it was lost
    /// (the CQ is full or in error, and has counted and reported it).
    pub fn push_cqe(&self, send: bool, cqe: Cqe) -> bool {
        let cq = if send { &self.send_cq } else { &self.recv_cq };
        cq.engine().push(cqe)
    }

    /// The next posted receive: from the SRQ when the QP has one, else its own ring.
    /// `Err` when the QP's own ring is corrupt (counted here; failing the QP is the
    /// caller's part). A corrupt SRQ is the SRQ's error, which it reports itself: for
    /// this QP there is just no receive.
    pub fn take_recv(&self) -> Result<Option<Wqe>, RingCorrupt> {
        match &self.srq {
            Some(srq) => Ok(srq.engine().take().ok().flatten()),
            None => self
                .rq
                .lock()
                .pop()
                .inspect_err(|_| RingStats::count(&self.stats.wq_corrupt)),
        }
    }

    /// Hand every request queued on the send ring now to `post` as a `WrFlushErr`
    /// completion. A fixed range: a consumer that keeps refilling the ring gets the rest
    /// flushed at its next doorbell, never an endless loop here.
    pub fn flush_send(&self, mut post: impl FnMut(Cqe)) {
        self.flush_ring(&self.sq, &mut post);
    }

    /// Flush the receive side of a QP in Error: `current` (a receive the responder had
    /// begun to fill) and then every receive queued on the QP's own ring go to `post` as
    /// `WrFlushErr` completions. A QP on an SRQ leaves the SRQ's receives to the other
    /// QPs and reports `LastWqeReached` instead, once.
    pub fn flush_recv(&self, current: Option<Wqe>, post: impl FnMut(Cqe)) {
        if let Some(e) = self.flush_recv_deferred(current, post) {
            self.sink.deliver(e);
        }
    }

    /// [`QpBase::flush_recv`] for a provider that delivers its events itself (after its
    /// lock is released): `LastWqeReached` is returned rather than delivered. It comes
    /// after every completion the flush posted.
    pub fn flush_recv_deferred(
        &self,
        current: Option<Wqe>,
        mut post: impl FnMut(Cqe),
    ) -> Option<Event> {
        if let Some(w) = current {
            post(self.cqe(&w, WcStatus::WrFlushErr, 0));
        }
        if self.srq.is_some() {
            let first = !self.last_wqe_sent.swap(true, Ordering::AcqRel);
            return first.then(|| Event::new(EventKind::LastWqeReached));
        }
        // From now on each receive posted needs a doorbell to be flushed (before, the
        // engine took receives when messages arrived); asked before the drain.
        self.rq.lock().want_doorbells();
        self.flush_ring(&self.rq, &mut post);
        None
    }

    /// `WrFlushErr` for every request queued on `ring` now; a corrupt ring is counted.
    fn flush_ring(&self, ring: &Mutex<Consumer<Wqe>>, post: &mut impl FnMut(Cqe)) {
        let flushed = ring
            .lock()
            .drain_queued(|w| post(self.cqe(&w, WcStatus::WrFlushErr, 0)));
        if flushed.is_err() {
            RingStats::count(&self.stats.wq_corrupt);
        }
    }

    /// The QP went back to Reset: its next entry into Error reports `LastWqeReached` again.
    pub fn rearm_last_wqe(&self) {
        self.last_wqe_sent.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::{CqInit, SrqInit};
    use crate::queue::{ring_bytes, Producer, QpRingLayout, Ring, SharedMem};
    use crate::sim::Events;
    use crate::soft::SoftResources;
    use crate::types::{QpType, SrqAttr};
    use crate::{Sge, UserCq, WrOpcode};

    const SGE: Sge = Sge {
        addr: 1,
        length: 1,
        lkey: 1,
    };

    /// A QP base on a fresh device with one CQ for both queues (and an SRQ when `srq`),
    /// with the consumer's ends: send ring, receive ring (or the SRQ's), CQ, events.
    struct Rig {
        base: QpBase,
        sq: Producer<Wqe>,
        rq: Producer<Wqe>,
        cq: UserCq,
        events: Arc<Events>,
    }

    fn rig(srq: bool) -> Rig {
        let res = SoftResources::new(4);
        let events = Arc::new(Events::default());
        let stats = Arc::new(RingStats::default());
        let cq_mem = Arc::new(SharedMem::create("qpb-cq", ring_bytes::<Cqe>(16)).unwrap());
        let cq = res.create_cq(CqInit {
            depth: 16,
            ring: Ring::attach(cq_mem.clone(), 0, 16).unwrap().producer(),
            sink: events.clone(),
            stats: stats.clone(),
        });
        let layout = QpRingLayout::new(4, 4).unwrap();
        let mem = Arc::new(SharedMem::create("qpb", layout.total).unwrap());
        let ring = |off, cap| Ring::<Wqe>::attach(mem.clone(), off, cap).unwrap();
        let srq_mem = Arc::new(SharedMem::create("qpb-srq", ring_bytes::<Wqe>(4)).unwrap());
        let (srq, rq) = if srq {
            let attr = SrqAttr {
                max_wr: 4,
                max_sge: 1,
                limit: 0,
            };
            let s = res.create_srq(SrqInit {
                pd: 1,
                attr,
                rq: Ring::attach(srq_mem.clone(), 0, 4).unwrap().consumer(),
                sink: events.clone(),
                stats: stats.clone(),
            });
            (Some(s), Ring::attach(srq_mem, 0, 4).unwrap().producer())
        } else {
            (None, ring(layout.rq_offset, 4).producer())
        };
        let init = QpInit {
            qp_type: QpType::Rc,
            pd: 1,
            send_cq: cq.clone(),
            recv_cq: cq,
            caps: QpCaps::default(),
            sq: ring(layout.sq_offset, 4).consumer(),
            rq: ring(layout.rq_offset, 4).consumer(),
            srq,
            sink: events.clone(),
            stats,
        };
        Rig {
            base: QpBase::new(9, init),
            sq: ring(layout.sq_offset, 4).producer(),
            rq,
            cq: UserCq::new(Ring::attach(cq_mem, 0, 16).unwrap().consumer()),
            events,
        }
    }

    impl Rig {
        /// (wr_id, status) of the completions polled now.
        fn poll(&self) -> Vec<(u64, u8)> {
            let mut out = [Cqe::default(); 16];
            let n = self.cq.poll(&mut out);
            out[..n].iter().map(|c| (c.wr_id, c.status)).collect()
        }
    }

    #[test]
    fn flush_completes_the_current_receive_then_the_queued_ones() {
        let mut r = rig(false);
        for id in 1..=3 {
            r.rq.push(&Wqe::recv(id, &[SGE])).unwrap();
        }
        r.sq.push(&Wqe::new(7, WrOpcode::Send, &[SGE])).unwrap();
        let current = r.base.take_recv().unwrap();
        assert_eq!(current.map(|w| w.wr_id), Some(1));
        let post = |send, c| assert!(r.base.push_cqe(send, c));
        r.base.flush_send(|c| post(true, c));
        r.base.flush_recv(current, |c| post(false, c));
        let flush = WcStatus::WrFlushErr as u8;
        assert_eq!(r.poll(), [(7, flush), (1, flush), (2, flush), (3, flush)]);
        assert!(r.events.kinds().is_empty());
        assert_eq!(r.base.take_recv().unwrap().map(|w| w.wr_id), None);
    }

    #[test]
    fn a_qp_on_an_srq_leaves_its_receives_and_says_so_once() {
        let mut r = rig(true);
        r.rq.push(&Wqe::recv(1, &[SGE])).unwrap();
        r.rq.push(&Wqe::recv(2, &[SGE])).unwrap();
        let current = r.base.take_recv().unwrap();
        assert_eq!(current.map(|w| w.wr_id), Some(1));
        let post = |c| assert!(r.base.push_cqe(false, c));
        r.base.flush_recv(current, post);
        r.base.flush_recv(None, post);
        assert_eq!(r.poll(), [(1, WcStatus::WrFlushErr as u8)]);
        assert_eq!(r.events.kinds(), [EventKind::LastWqeReached]);
        r.base.rearm_last_wqe();
        r.base.flush_recv(None, post);
        assert_eq!(r.events.kinds(), [EventKind::LastWqeReached; 2]);
        assert_eq!(r.base.take_recv().unwrap().map(|w| w.wr_id), Some(2));
    }
}
