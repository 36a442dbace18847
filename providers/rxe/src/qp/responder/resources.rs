//! The responder resources (IBTA 9.7.5; Linux rxe_resp.c's `resp_res`): RDMA Reads and
//! atomics, what is kept of them to answer their duplicates, and the responder's output
//! queue in PSN order.
//!
//! A duplicate Send or Write is acknowledged again without being placed twice; a
//! duplicate Read is answered again from the request's own RETH (kept here), an atomic
//! with its saved original value, never executed twice. A Read or atomic that comes while
//! `max_dest_rd_atomic` earlier ones still have responses queued is an invalid request;
//! answers to retried requests are bounded the same way (older ones recycled), and
//! acknowledgements behind them coalesce, so the output queue stays within 4 × IRD + 1
//! entries.

use super::super::requester::ack_aeth;
use super::super::{Engine, State, MAX_MSG};
use super::{access, invalid, Responder, Verdict};
use crate::wire::{
    self, psn_add, psn_diff, AethRepr, AtomicAckEthRepr, NakCode, Opcode, Operation, RoceRepr,
    Syndrome,
};
use rnicpi::*;
use std::sync::Arc;

pub(super) enum Resource {
    Read {
        psn: u32,
        npkts: u32,
        va: u64,
        rkey: u32,
        len: u64,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

/// Responder output not yet sent. Responses leave in PSN order (IBTA 9.7.5): while read
/// responses are going out, the acknowledgements of later requests wait behind them.
pub(super) enum Out {
    Read(ReadJob),
    Ack {
        psn: u32,
        aeth: AethRepr,
    },
    AtomicAck {
        psn: u32,
        orig: u64,
        msn: u32,
        replay: bool,
    },
}

impl Out {
    /// A read response or atomic acknowledgement (a responder resource), and whether it
    /// answers a duplicate again.
    fn resource(&self) -> Option<bool> {
        match self {
            Out::Read(j) => Some(j.replay),
            Out::AtomicAck { replay, .. } => Some(*replay),
            Out::Ack { .. } => None,
        }
    }
}

/// Read responses still to transmit.
pub(super) struct ReadJob {
    psn: u32,
    va: u64,
    left: u64,
    first: bool,
    region: Option<Arc<Region>>,
    /// Answers a duplicate (a retried request) again.
    replay: bool,
}

impl Responder {
    /// Read responses and atomic acknowledgements queued that answer a request for the
    /// first time: the responder resources in use. While one is queued its requester has
    /// not had all of it, so one more than IRD of them means the requester exceeded IRD.
    fn originals(&self) -> usize {
        self.jobs
            .iter()
            .filter(|j| j.resource() == Some(false))
            .count()
    }

    /// Responder output queued: at most `ird` originals, `ird` replays and one coalesced
    /// acknowledgement before each and at the end (a bound the fuzz target checks).
    pub fn queued(&self) -> usize {
        self.jobs.len()
    }

    /// Queue a replay (the answer to a retried request); with `ird` of them queued
    /// already, the oldest is recycled first, as kernel rxe recycles its responder
    /// resources: the retry asks again for what the older replays were still sending.
    fn push_replay(&mut self, out: Out, ird: usize) {
        let replays = self.jobs.iter().filter(|j| j.resource() == Some(true));
        if replays.count() >= ird {
            if let Some(i) = self.jobs.iter().position(|j| j.resource() == Some(true)) {
                self.jobs.remove(i);
            }
        }
        self.jobs.push_back(out);
    }

    /// Remember a read or atomic for its duplicates: the last `ird` of them, as kernel
    /// rxe keeps `max_dest_rd_atomic` resources (a requester retries only what it has
    /// outstanding, at most ORD ≤ IRD requests).
    fn remember(&mut self, r: Resource, ird: usize) {
        while self.resources.len() >= ird {
            self.resources.pop_front();
        }
        self.resources.push_back(r);
    }
}

/// The QP's responder resources (`max_dest_rd_atomic`, at least 1).
fn ird(st: &State) -> usize {
    st.attr.max_dest_rd_atomic.max(1) as usize
}

impl Engine<'_> {
    pub(super) fn recv_read(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
        if st.resp.cur.is_some() {
            return invalid();
        }
        let Some(reth) = p.reth else {
            return invalid();
        };
        if !self.resources_left(st) {
            return invalid();
        }
        let len = reth.dma_len as u64;
        if len > MAX_MSG {
            return invalid();
        }
        let region = match self.read_region(reth.rkey, reth.va, len) {
            Ok(r) => r,
            Err(v) => return v,
        };
        let npkts = len.div_ceil(st.mtu as u64).max(1) as u32;
        let psn = p.bth.psn;
        st.resp.remember(
            Resource::Read {
                psn,
                npkts,
                va: reth.va,
                rkey: reth.rkey,
                len,
            },
            ird(st),
        );
        st.resp.msn = (st.resp.msn + 1) & wire::PSN_MASK;
        st.resp.jobs.push_back(Out::Read(ReadJob {
            psn,
            va: reth.va,
            left: len,
            first: true,
            region,
            replay: false,
        }));
        Verdict::Done { npkts }
    }

    /// Whether a new Read or atomic fits the responder resources (`max_dest_rd_atomic`);
    /// counted when it does not (the requester exceeded what was negotiated).
    fn resources_left(&self, st: &State) -> bool {
        let left = st.resp.originals() < ird(st);
        if !left {
            self.count(&self.counters.rd_atomic_refused);
        }
        left
    }

    fn read_region(&self, rkey: u32, va: u64, len: u64) -> Result<Option<Arc<Region>>, Verdict> {
        if len == 0 {
            return Ok(None);
        }
        match self.mrs.lookup(rkey) {
            Ok(r) if r.check(self.base.pd, va, len, Access::REMOTE_READ).is_ok() => Ok(Some(r)),
            _ => Err(access()),
        }
    }

    pub(super) fn recv_atomic(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
        if st.resp.cur.is_some() {
            return invalid();
        }
        let Some(a) = p.atomic_eth else {
            return invalid();
        };
        if !self.resources_left(st) {
            return invalid();
        }
        if !a.va.is_multiple_of(8) {
            return invalid();
        }
        let Ok(region) = self.mrs.lookup(a.rkey) else {
            return access();
        };
        let cmp = p.bth.opcode == Opcode::RcCompareSwap;
        let mut op = |v: u64| {
            if cmp {
                if v == a.compare {
                    a.swap_add
                } else {
                    v
                }
            } else {
                v.wrapping_add(a.swap_add)
            }
        };
        let orig = match region.atomic(self.base.pd, a.va, &mut op) {
            Ok(v) => v,
            Err(_) => return access(),
        };
        let psn = p.bth.psn;
        st.resp.remember(Resource::Atomic { psn, orig }, ird(st));
        st.resp.msn = (st.resp.msn + 1) & wire::PSN_MASK;
        let msn = st.resp.msn;
        if st.resp.jobs.is_empty() {
            self.emit_atomic_ack(st, psn, orig, msn);
        } else {
            st.resp.jobs.push_back(Out::AtomicAck {
                psn,
                orig,
                msn,
                replay: false,
            });
        }
        Verdict::Done { npkts: 1 }
    }

    fn emit_atomic_ack(&self, st: &mut State, psn: u32, orig: u64, msn: u32) {
        let mut r = RoceRepr::new(self.bth(st, Opcode::RcAtomicAcknowledge, psn), &[]);
        r.aeth = Some(ack_aeth(msn));
        r.atomic_ack_eth = Some(AtomicAckEthRepr { orig });
        self.send_packet(st, &r);
    }

    /// A request behind the expected PSN.
    pub(super) fn duplicate(&self, st: &mut State, p: &RoceRepr<'_>) -> bool {
        self.count(&self.counters.duplicate_requests);
        let psn = p.bth.psn;
        match p.bth.opcode.operation() {
            Operation::Send | Operation::RdmaWrite => {
                // Acknowledge everything received so far: the requester went back further
                // than it had to (its ACK or our NAK was lost, or packets were reordered).
                let last = psn_add(st.resp.psn, wire::PSN_MASK);
                let msn = st.resp.msn;
                self.send_ack(st, last, ack_aeth(msn));
                false
            }
            Operation::RdmaReadRequest => {
                let Some(reth) = p.reth else { return false };
                let known = st.resp.resources.iter().find_map(|r| match *r {
                    Resource::Read {
                        psn: start,
                        npkts,
                        va,
                        rkey,
                        len,
                    } if psn_diff(psn, start) >= 0
                        && psn_diff(psn, psn_add(start, npkts)) < 0
                        && rkey == reth.rkey =>
                    {
                        Some((start, npkts, va, len))
                    }
                    _ => None,
                });
                let Some((start, npkts, va, len)) = known else {
                    tracing::trace!(
                        qpn = self.base.qpn,
                        psn,
                        "rxe duplicate read of no known request"
                    );
                    return false;
                };
                // The retried request must ask for a tail of the original one.
                let (lo, hi) = (reth.va, reth.va.saturating_add(reth.dma_len as u64));
                if lo < va || hi > va + len {
                    tracing::trace!(
                        qpn = self.base.qpn,
                        psn,
                        lo,
                        hi,
                        va,
                        len,
                        "rxe duplicate read out of range"
                    );
                    return false;
                }
                let region = match self.read_region(reth.rkey, lo, hi - lo) {
                    Ok(r) => r,
                    Err(_) => return false,
                };
                let end = psn_add(start, npkts);
                st.resp.jobs.retain(|j| match j {
                    Out::Read(j) => !(psn_diff(j.psn, start) >= 0 && psn_diff(j.psn, end) < 0),
                    _ => true,
                });
                let replay = Out::Read(ReadJob {
                    psn,
                    va: lo,
                    left: hi - lo,
                    first: true,
                    region,
                    replay: true,
                });
                let ird = ird(st);
                st.resp.push_replay(replay, ird);
                true
            }
            Operation::CompareSwap | Operation::FetchAdd => {
                let orig = st.resp.resources.iter().find_map(|r| match *r {
                    Resource::Atomic { psn: at, orig } if at == psn => Some(orig),
                    _ => None,
                });
                let queued = st
                    .resp
                    .jobs
                    .iter()
                    .any(|j| matches!(j, Out::AtomicAck { psn: at, .. } if *at == psn));
                let msn = st.resp.msn;
                match orig {
                    // Its acknowledgement is still on its way: nothing to add.
                    Some(_) if queued => {}
                    Some(orig) if st.resp.jobs.is_empty() => {
                        self.emit_atomic_ack(st, psn, orig, msn)
                    }
                    Some(orig) => {
                        let replay = Out::AtomicAck {
                            psn,
                            orig,
                            msn,
                            replay: true,
                        };
                        let ird = ird(st);
                        st.resp.push_replay(replay, ird);
                    }
                    None => {}
                }
                false
            }
            _ => false,
        }
    }

    /// Transmit queued responder output in order; true when some is left.
    pub(in crate::qp) fn send_read_responses(&self, st: &mut State, budget: &mut u32) -> bool {
        let mtu = st.mtu as u64;
        while *budget > 0 {
            let job = match st.resp.jobs.front() {
                None => return false,
                Some(Out::Ack { psn, aeth }) => {
                    let (psn, aeth) = (*psn, *aeth);
                    st.resp.jobs.pop_front();
                    self.emit_ack(st, psn, aeth);
                    continue;
                }
                Some(Out::AtomicAck { psn, orig, msn, .. }) => {
                    let (psn, orig, msn) = (*psn, *orig, *msn);
                    st.resp.jobs.pop_front();
                    self.emit_atomic_ack(st, psn, orig, msn);
                    continue;
                }
                Some(Out::Read(job)) => job,
            };
            let n = job.left.min(mtu);
            let last = job.left <= mtu;
            let opcode = match (job.first, last) {
                (true, true) => Opcode::RcRdmaReadResponseOnly,
                (true, false) => Opcode::RcRdmaReadResponseFirst,
                (false, true) => Opcode::RcRdmaReadResponseLast,
                (false, false) => Opcode::RcRdmaReadResponseMiddle,
            };
            let mut r = RoceRepr::new(self.bth(st, opcode, job.psn), &[]);
            if opcode != Opcode::RcRdmaReadResponseMiddle {
                r.aeth = Some(ack_aeth(st.resp.msn));
            }
            let (pd, va) = (self.base.pd, job.va);
            let read = self.packet_with(&r, n as usize, |out| match &job.region {
                Some(region) => region.read_append(pd, va, n as usize, Access::REMOTE_READ, out),
                None => {
                    out.resize(out.len() + n as usize, 0);
                    Ok(())
                }
            });
            let roce = match read {
                Ok(Some(roce)) => roce,
                Ok(None) => return false,
                Err(_) => {
                    // Deregistered under the response: the read fails remotely.
                    let psn = job.psn;
                    st.resp.jobs.clear();
                    let msn = st.resp.msn;
                    let nak = AethRepr {
                        syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
                        msn,
                    };
                    self.emit_ack(st, psn, nak);
                    self.fatal(st, EventKind::QpAccessError, "read source vanished");
                    return false;
                }
            };
            self.queue_packet(st, roce);
            *budget -= 1;
            let Some(Out::Read(job)) = st.resp.jobs.front_mut() else {
                return false;
            };
            job.psn = psn_add(job.psn, 1);
            job.va += n;
            job.left -= n;
            job.first = false;
            if last {
                st.resp.jobs.pop_front();
            }
        }
        !st.resp.jobs.is_empty()
    }
}
