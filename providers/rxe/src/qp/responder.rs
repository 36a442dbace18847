//! Responder: request packets in PSN order become placements into registered memory,
//! receive completions, acknowledgements, read responses and atomic results.
//!
//! A packet ahead of the expected PSN draws one PSN-sequence NAK (until the expected
//! packet arrives); a packet behind it is a duplicate ([`resources`]). A Send with no
//! receive posted draws an RNR NAK. Access violations and malformed sequences draw a NAK
//! and take the QP to Error (IBTA class B/C errors). An RDMA Write, Read or atomic needs
//! the matching remote right in the QP's access flags (kernel rxe's `check_op_valid`); a
//! message is at most 2^31 bytes (so a Read never spans the PSN space back onto itself);
//! and Send with Invalidate invalidates memory windows only — a registration is the
//! consumer's to end.
//!
//! This file checks each packet in the order IBTA's responder does and places Sends and
//! Writes; Reads, atomics, duplicates and the output queue are in [`resources`]; a UC
//! QP's responder, which never answers, is in [`unreliable`].

mod resources;
mod unreliable;

use super::requester::ack_aeth;
use super::{byte_len, Engine, State, MAX_MSG};
use crate::wire::{
    self, psn_add, psn_diff, AethRepr, NakCode, Opcode, Operation, RoceRepr, Syndrome,
};
use resources::{Out, Resource};
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
    /// UC: the rest of a message is being dropped (until a First or Only packet).
    drop_msg: bool,
    /// A receive taken for a message that was then refused or dropped: the next message
    /// that needs one (UC) takes it before the ring's, so receives still complete in
    /// order; a QP going to Error flushes it.
    spare: Option<Wqe>,
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
            drop_msg: false,
            spare: None,
        }
    }

    pub fn clear(&mut self) {
        self.cur = None;
        self.jobs.clear();
        self.resources.clear();
    }

    /// The receive a multi-packet Send is being placed into, or the spare one (to flush
    /// it; there is never both).
    pub fn take_current_recv(&mut self) -> Option<Wqe> {
        match self.cur.take() {
            Some(InMsg::Send { wqe, .. }) => Some(wqe),
            _ => self.spare.take(),
        }
    }
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
        let verdict = self.execute(st, p);
        self.conclude(st, p, verdict)
    }

    /// Carry out an in-sequence request, if the QP grants its operation (kernel rxe:
    /// `check_op_valid`).
    fn execute(&self, st: &mut State, p: &RoceRepr<'_>) -> Verdict {
        let op = p.bth.opcode.operation();
        if !st.attr.access.contains(right_for(op)) {
            self.count(&self.counters.qp_access_refused);
            return invalid();
        }
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
        let plain = matches!(aeth.syndrome, Syndrome::Ack { .. });
        self.send_ack_packet(st, &r, plain);
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
            let wqe = match self.next_recv(st) {
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

    /// The receive the next message that needs one takes: the spare one, else the ring's
    /// next.
    fn next_recv(&self, st: &mut State) -> Result<Option<Wqe>, RingCorrupt> {
        match st.resp.spare.take() {
            Some(w) => Ok(Some(w)),
            None => self.take_recv(),
        }
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
            match self.next_recv(st) {
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
                // The receive taken stays the consumer's: flushed when the QP goes to
                // Error, or (UC) taken by the next message.
                if recv.is_some() {
                    st.resp.spare = recv;
                }
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
}
