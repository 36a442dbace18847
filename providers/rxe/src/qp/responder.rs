//! Responder: request packets in PSN order become placements into registered memory,
//! receive completions, acknowledgements, read responses and atomic results.
//!
//! A packet ahead of the expected PSN draws one PSN-sequence NAK (until the expected
//! packet arrives); a packet behind it is a duplicate: Sends and Writes are acknowledged
//! again without being placed twice, Reads are answered again from the request's own
//! RETH (kept in the responder resources), atomics with their saved original value, never
//! executed twice. A Send with no receive posted draws an RNR NAK. Access violations and
//! malformed sequences draw a NAK and take the QP to Error (IBTA class B/C errors).
//!
//! What a peer may ask is bounded as kernel rxe bounds it: an RDMA Write, Read or atomic
//! needs the matching remote right in the QP's access flags (`check_op_valid`); a Read or
//! atomic that comes while `max_dest_rd_atomic` earlier ones still have responses queued
//! is an invalid request; answers to retried requests are bounded the same way (older
//! ones recycled), and acknowledgements behind them coalesce, so the output queue stays
//! within 4 × IRD + 1 entries; a message is at
//! most 2^31 bytes (so a Read never spans the PSN space back onto itself); and Send with
//! Invalidate invalidates memory windows only — a registration is the consumer's to end.
//!
//! Over 600 lines: one step per check of IBTA's responder (Linux's rxe_resp.c is twice
//! this), in the order the packet meets them.

use super::requester::ack_aeth;
use super::{byte_len, Engine, State, MAX_MSG};
use crate::wire::{
    self, psn_add, psn_diff, AethRepr, AtomicAckEthRepr, NakCode, Opcode, Operation, RoceRepr,
    Syndrome,
};
use rnicpi::*;
use std::collections::VecDeque;
use std::sync::Arc;

/// Out-of-sequence packets after which a lost sequence NAK is sent again.
const RENAK_AFTER: u32 = 8;

// The receive WQE is moved once per message; boxing it would allocate on the data path.
#[allow(clippy::large_enum_variant)]
enum InMsg {
    Send {
        wqe: Wqe,
        off: u64,
    },
    Write {
        region: Option<Arc<Region>>,
        va: u64,
        len: u64,
        off: u64,
    },
}

enum Resource {
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
enum Out {
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
struct ReadJob {
    psn: u32,
    va: u64,
    left: u64,
    first: bool,
    region: Option<Arc<Region>>,
    /// Answers a duplicate (a retried request) again.
    replay: bool,
}

pub(crate) struct Responder {
    /// The PSN expected next.
    psn: u32,
    msn: u32,
    nak_sent: bool,
    /// Packets ahead of the expected PSN since the last sequence NAK.
    ahead: u32,
    cur: Option<InMsg>,
    resources: VecDeque<Resource>,
    jobs: VecDeque<Out>,
}

/// What became of one request packet.
enum Verdict {
    /// Consumed `npkts` PSNs; acknowledge when the requester asked.
    Done { npkts: u32 },
    /// No receive posted: RNR NAK, the PSN is not consumed.
    Rnr,
    /// NAK; the QP goes to Error.
    Fatal(NakCode, EventKind),
}

impl Responder {
    pub fn new(psn: u32) -> Responder {
        Responder {
            psn,
            msn: 0,
            nak_sent: false,
            ahead: 0,
            cur: None,
            resources: VecDeque::new(),
            jobs: VecDeque::new(),
        }
    }

    pub fn clear(&mut self) {
        self.cur = None;
        self.jobs.clear();
        self.resources.clear();
    }

    /// The receive a multi-packet Send is being placed into (to flush it).
    pub fn take_current_recv(&mut self) -> Option<Wqe> {
        match self.cur.take() {
            Some(InMsg::Send { wqe, .. }) => Some(wqe),
            _ => None,
        }
    }

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

fn invalid() -> Verdict {
    Verdict::Fatal(NakCode::InvalidRequest, EventKind::QpRequestError)
}

fn access() -> Verdict {
    Verdict::Fatal(NakCode::RemoteAccessError, EventKind::QpAccessError)
}

/// Our consumer corrupted its receive ring: the peer's request cannot be served.
fn corrupt_ring() -> Verdict {
    Verdict::Fatal(NakCode::RemoteOperationalError, EventKind::QpFatal)
}

/// The remote right an operation needs in the QP's access flags (none for Sends).
fn right_for(op: Operation) -> Access {
    match op {
        Operation::RdmaWrite => Access::REMOTE_WRITE,
        Operation::RdmaReadRequest => Access::REMOTE_READ,
        Operation::CompareSwap | Operation::FetchAdd => Access::REMOTE_ATOMIC,
        _ => Access::empty(),
    }
}

impl Engine<'_> {
    /// A request packet. Returns whether the transmit side should run.
    pub(super) fn on_request(&self, st: &mut State, p: &RoceRepr<'_>) -> bool {
        let psn = p.bth.psn;
        let d = psn_diff(psn, st.resp.psn);
        tracing::trace!(
            qpn = self.base.qpn,
            psn,
            expected = st.resp.psn,
            ack_req = p.bth.ack_req,
            nak_sent = st.resp.nak_sent,
            queued = st.resp.jobs.len(),
            "rxe request"
        );
        if d > 0 {
            // One NAK per gap; again if the gap outlasts RENAK_AFTER packets (the NAK or
            // the retransmission was lost too).
            st.resp.ahead += 1;
            // A packet that asks for an acknowledgement gets the truth as well.
            if !st.resp.nak_sent || st.resp.ahead >= RENAK_AFTER || p.bth.ack_req {
                st.resp.nak_sent = true;
                st.resp.ahead = 0;
                self.count(&self.counters.nak_seq_sent);
                let exp = st.resp.psn;
                self.send_aeth(st, exp, Syndrome::Nak(NakCode::PsnSequenceError));
            }
            return false;
        }
        if d < 0 {
            return self.duplicate(st, p);
        }
        let op = p.bth.opcode.operation();
        let verdict = if !st.attr.access.contains(right_for(op)) {
            // The QP does not grant this operation (kernel rxe: check_op_valid).
            self.count(&self.counters.qp_access_refused);
            invalid()
        } else {
            self.execute(st, p, op)
        };
        self.conclude(st, p, verdict)
    }

    /// Carry out an in-sequence request the QP permits.
    fn execute(&self, st: &mut State, p: &RoceRepr<'_>, op: Operation) -> Verdict {
        match op {
            Operation::Send => self.recv_send(st, p),
            Operation::RdmaWrite => self.recv_write(st, p),
            Operation::RdmaReadRequest => self.recv_read(st, p),
            Operation::CompareSwap | Operation::FetchAdd => self.recv_atomic(st, p),
            _ => invalid(),
        }
    }

    /// Account for what became of an in-sequence request and answer it.
    fn conclude(&self, st: &mut State, p: &RoceRepr<'_>, verdict: Verdict) -> bool {
        let psn = p.bth.psn;
        match verdict {
            Verdict::Done { npkts } => {
                st.resp.psn = psn_add(psn, npkts);
                // The gap a NAK reported is filled: say so now rather than at the next
                // packet that asks for an acknowledgement.
                let gap_filled = std::mem::take(&mut st.resp.nak_sent);
                st.resp.ahead = 0;
                let read = p.bth.opcode == Opcode::RcRdmaReadRequest;
                let atomic = matches!(
                    p.bth.opcode.operation(),
                    Operation::CompareSwap | Operation::FetchAdd
                );
                if (p.bth.ack_req || gap_filled) && !read && !atomic {
                    self.count(&self.counters.acks_sent);
                    let msn = st.resp.msn;
                    self.send_ack(st, psn, ack_aeth(msn));
                }
                read
            }
            Verdict::Rnr => {
                self.count(&self.counters.rnr_nak_sent);
                let timer = st.attr.min_rnr_timer;
                self.send_aeth(st, psn, Syndrome::RnrNak { timer });
                false
            }
            Verdict::Fatal(code, kind) => {
                // The NAK goes out now, ahead of any read responses still queued: the QP
                // goes to Error, which discards them.
                self.count(&self.counters.nak_other_sent);
                let msn = st.resp.msn;
                let nak = AethRepr {
                    syndrome: Syndrome::Nak(code),
                    msn,
                };
                self.emit_ack(st, psn, nak);
                self.fatal(st, kind, "responder refused a request");
                false
            }
        }
    }

    /// Acknowledge (or NAK) `psn`, behind any read responses still going out. Every
    /// AETH acknowledges all that came before it, so one queued behind the same response
    /// is replaced rather than joined: the queue never grows with acknowledgements.
    fn send_ack(&self, st: &mut State, psn: u32, aeth: AethRepr) {
        match st.resp.jobs.back_mut() {
            None => self.emit_ack(st, psn, aeth),
            Some(Out::Ack { psn: p, aeth: a }) => (*p, *a) = (psn, aeth),
            Some(_) => st.resp.jobs.push_back(Out::Ack { psn, aeth }),
        }
    }

    fn emit_ack(&self, st: &mut State, psn: u32, aeth: AethRepr) {
        let mut r = RoceRepr::new(self.bth(st, Opcode::RcAcknowledge, psn), &[]);
        r.aeth = Some(aeth);
        self.send_packet(st, &r);
    }

    fn send_aeth(&self, st: &mut State, psn: u32, syndrome: Syndrome) {
        let msn = st.resp.msn;
        self.send_ack(st, psn, AethRepr { syndrome, msn });
    }

    /// Check the packet's place in its message against the one in progress.
    fn in_sequence(&self, st: &State, p: &RoceRepr<'_>) -> bool {
        let pos = p.bth.opcode.position();
        let full = pos.is_end() || p.payload.len() == st.mtu as usize;
        let ok = match (&st.resp.cur, p.bth.opcode.operation()) {
            (None, _) => pos.is_start(),
            (Some(InMsg::Send { .. }), Operation::Send)
            | (Some(InMsg::Write { .. }), Operation::RdmaWrite) => !pos.is_start(),
            _ => false,
        };
        ok && full && p.payload.len() <= st.mtu as usize
    }

    fn recv_send(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
        if !self.in_sequence(st, p) {
            return invalid();
        }
        let pos = p.bth.opcode.position();
        if pos.is_start() {
            let wqe = match self.take_recv() {
                Ok(Some(w)) => w,
                Ok(None) => return Verdict::Rnr,
                Err(RingCorrupt) => return corrupt_ring(),
            };
            st.resp.cur = Some(InMsg::Send { wqe, off: 0 });
        }
        let Some(InMsg::Send { wqe, off }) = st.resp.cur.as_mut() else {
            return invalid();
        };
        let (wqe_copy, at) = (*wqe, *off);
        let end = at + p.payload.len() as u64;
        if end > MAX_MSG {
            st.resp.cur = None;
            self.post_cqe(st, false, self.base.cqe(&wqe_copy, WcStatus::LocLenErr, 0));
            return invalid();
        }
        if end > wqe_copy.total_len() {
            st.resp.cur = None;
            self.post_cqe(st, false, self.base.cqe(&wqe_copy, WcStatus::LocLenErr, 0));
            return invalid();
        }
        if let Err(status) = self.place_recv(&wqe_copy, at, p.payload) {
            st.resp.cur = None;
            self.post_cqe(st, false, self.base.cqe(&wqe_copy, status, 0));
            return Verdict::Fatal(NakCode::RemoteOperationalError, EventKind::QpFatal);
        }
        if let Some(InMsg::Send { off, .. }) = st.resp.cur.as_mut() {
            *off += p.payload.len() as u64;
        }
        if !pos.is_end() {
            return Verdict::Done { npkts: 1 };
        }
        st.resp.cur = None;
        let mut cqe = self.base.cqe(&wqe_copy, WcStatus::Success, byte_len(end));
        cqe.src_qp = st.attr.dest_qpn;
        if p.bth.solicited {
            cqe.flags |= wc_flags::SOLICITED;
        }
        if let Some(imm) = p.immdt {
            cqe.flags |= wc_flags::WITH_IMM;
            cqe.imm_or_inv = u32::from_ne_bytes(imm.imm.to_be_bytes());
        }
        if let Some(ieth) = p.ieth {
            // Only a memory window may be invalidated remotely (IBTA; kernel rxe refuses
            // user MRs): a registration ends when its consumer deregisters it.
            let window = self.mrs.lookup(ieth.rkey).is_ok_and(|r| r.is_window());
            if !window || self.mrs.invalidate(ieth.rkey, self.base.pd).is_err() {
                self.count(&self.counters.remote_inv_refused);
                self.post_cqe(
                    st,
                    false,
                    self.base.cqe(&wqe_copy, WcStatus::RemInvReqErr, 0),
                );
                return invalid();
            }
            cqe.flags |= wc_flags::WITH_INV;
            cqe.imm_or_inv = ieth.rkey;
        }
        st.resp.msn = (st.resp.msn + 1) & wire::PSN_MASK;
        self.post_cqe(st, false, cqe);
        Verdict::Done { npkts: 1 }
    }

    /// Scatter `data` at message offset `off` of receive `w`.
    fn place_recv(&self, w: &Wqe, off: u64, data: &[u8]) -> Result<(), WcStatus> {
        self.mrs
            .scatter(self.base.pd, w.sges(), off, data)
            .map_err(|_| WcStatus::LocProtErr)
    }

    fn recv_write(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
        if !self.in_sequence(st, p) {
            return invalid();
        }
        let pos = p.bth.opcode.position();
        if pos.is_start() {
            let Some(reth) = p.reth else {
                return invalid();
            };
            let len = reth.dma_len as u64;
            if len > MAX_MSG {
                return invalid();
            }
            let region = if len > 0 {
                match self.mrs.lookup(reth.rkey) {
                    Ok(r)
                        if r.check(self.base.pd, reth.va, len, Access::REMOTE_WRITE)
                            .is_ok() =>
                    {
                        Some(r)
                    }
                    _ => return access(),
                }
            } else {
                None
            };
            st.resp.cur = Some(InMsg::Write {
                region,
                va: reth.va,
                len,
                off: 0,
            });
        }
        let Some(InMsg::Write {
            region,
            va,
            len,
            off,
        }) = st.resp.cur.as_ref()
        else {
            return invalid();
        };
        let (region, va, len, off) = (region.clone(), *va, *len, *off);
        let end = off + p.payload.len() as u64;
        if end > len || (pos.is_end() && end != len) {
            st.resp.cur = None;
            return invalid();
        }
        // A Write with immediate consumes a receive: without one, nothing is placed.
        let recv = if p.immdt.is_some() {
            match self.take_recv() {
                Ok(Some(w)) => Some(w),
                Ok(None) => return Verdict::Rnr,
                Err(RingCorrupt) => return corrupt_ring(),
            }
        } else {
            None
        };
        if !p.payload.is_empty() {
            let placed = region
                .as_ref()
                .map(|r| r.write(self.base.pd, va + off, p.payload, Access::REMOTE_WRITE));
            if !matches!(placed, Some(Ok(()))) {
                st.resp.cur = None;
                return access();
            }
        }
        if let Some(InMsg::Write { off, .. }) = st.resp.cur.as_mut() {
            *off = end;
        }
        if pos.is_end() {
            st.resp.cur = None;
            st.resp.msn = (st.resp.msn + 1) & wire::PSN_MASK;
            if let (Some(w), Some(imm)) = (recv, p.immdt) {
                let mut cqe = self.base.cqe(&w, WcStatus::Success, byte_len(len));
                cqe.opcode = WcOpcode::RecvRdmaWithImm as u8;
                cqe.flags |= wc_flags::WITH_IMM;
                cqe.imm_or_inv = u32::from_ne_bytes(imm.imm.to_be_bytes());
                cqe.src_qp = st.attr.dest_qpn;
                if p.bth.solicited {
                    cqe.flags |= wc_flags::SOLICITED;
                }
                self.post_cqe(st, false, cqe);
            }
        }
        Verdict::Done { npkts: 1 }
    }

    fn recv_read(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
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

    fn recv_atomic(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
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
    fn duplicate(&self, st: &mut State, p: &RoceRepr<'_>) -> bool {
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
    pub(super) fn send_read_responses(&self, st: &mut State, budget: &mut u32) -> bool {
        let mtu = st.mtu as u64;
        let mut buf = Vec::new();
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
            buf.clear();
            buf.resize(n as usize, 0);
            if let Some(r) = &job.region {
                if r.read(self.base.pd, job.va, &mut buf, Access::REMOTE_READ)
                    .is_err()
                {
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
            }
            let mut r = RoceRepr::new(self.bth(st, opcode, job.psn), &buf);
            if opcode != Opcode::RcRdmaReadResponseMiddle {
                r.aeth = Some(ack_aeth(st.resp.msn));
            }
            self.send_packet(st, &r);
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
