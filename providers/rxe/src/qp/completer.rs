//! Completer: acknowledgements, NAKs, read responses and atomic acknowledgements become
//! completions, in order, as Linux's `rxe_comp.c`. Loss is repaired go-back-N: on a PSN
//! sequence NAK, a gap in read responses, or the ACK timer, transmission restarts at the
//! oldest unacknowledged PSN; RNR NAKs wait the peer's timer first. `retry_cnt` and
//! `rnr_retry` (7 = forever) bound the attempts.

use super::requester::MIN_WINDOW;
use super::{byte_len, Engine, State, WINDOW};
use crate::wire::{self, psn_add, psn_diff, NakCode, Opcode, RoceRepr, Syndrome};
use rnicpi::*;
use std::time::Duration;

/// Why a retry happened, when it is a timeout.
const TIMEOUT: &str = "timeout";

impl Engine<'_> {
    /// Complete finished requests from the front, in order; a failed one takes the QP
    /// to Error (which flushes the rest).
    pub(super) fn complete_in_order(&self, st: &mut State) {
        while st.req.wqes.front().is_some_and(|w| w.done) {
            let Some(w) = st.req.wqes.pop_front() else {
                break;
            };
            // The transmit position moves with the queue; when the request completed was
            // the one being (re)transmitted, the next starts at its first packet.
            match st.req.cur {
                0 => st.req.cur_pkt = 0,
                _ => st.req.cur -= 1,
            }
            if let Some(status) = w.status {
                self.post_cqe(st, true, self.base.cqe(&w.wqe, status, 0));
                self.to_error(st);
                return;
            }
            if w.wqe.signaled() {
                let len = match w.op {
                    WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd => 8,
                    _ => byte_len(w.len),
                };
                self.post_cqe(st, true, self.base.cqe(&w.wqe, WcStatus::Success, len));
            }
        }
    }

    /// Mark acknowledged everything up to and including `psn`.
    fn ack_through(&self, st: &mut State, psn: u32) {
        let r = &mut st.req;
        // Ignore acknowledgements of PSNs never sent, or older than what is acknowledged.
        if psn_diff(psn, r.sent_psn) >= 0 || psn_diff(psn, r.comp_psn) < -1 {
            return;
        }
        let mut progress = false;
        let mut gap = None;
        for w in r.wqes.iter_mut() {
            if w.done || w.is_local() {
                continue;
            }
            if w.is_read_like() {
                // The responder answers in PSN order: an acknowledgement past a requested
                // response we do not have means it was lost.
                let missing = psn_add(w.first_psn, w.rcvd);
                if w.rcvd < w.requested && psn_diff(psn, missing) >= 0 {
                    gap = Some(missing);
                }
                break;
            }
            if w.sent_all && psn_diff(w.last_psn(), psn) <= 0 {
                w.done = true;
                progress = true;
            } else {
                break;
            }
        }
        let acked = psn_add(psn, 1);
        let limit = r
            .wqes
            .iter()
            .find(|w| !w.done && w.is_read_like() && w.requested > 0)
            .map(|w| psn_add(w.first_psn, w.rcvd));
        let new_comp = match limit {
            Some(l) if psn_diff(l, acked) < 0 => l,
            _ => acked,
        };
        let mut acked_pkts = 0;
        if psn_diff(new_comp, r.comp_psn) > 0 {
            acked_pkts = psn_diff(new_comp, r.comp_psn) as u32;
            r.comp_psn = new_comp;
            progress = true;
        }
        if progress {
            r.retry_left = r.retry_cnt;
            r.rnr_left = r.rnr_retry;
            // Grow by what was acknowledged (doubling per round trip) back to the full
            // window after a loss halved it.
            r.cwnd = (r.cwnd + acked_pkts.max(1)).min(WINDOW);
        }
        if gap.is_some() {
            self.retry(st, "acknowledged past missing read responses");
        } else if psn_diff(st.req.comp_psn, st.req.tx_psn()) > 0 {
            // The peer had more than we were about to send again: skip ahead.
            let to = st.req.comp_psn;
            st.req.rewind(to);
        }
    }

    /// Go back to the oldest unacknowledged PSN (a read's first missing response) and
    /// transmit again from there, once per loss.
    fn retry(&self, st: &mut State, why: &'static str) {
        // Once per loss: unless a whole window went out since going back and the peer
        // still misses the same packet (the retransmission was lost too).
        if st.req.retrying == Some(st.req.comp_psn) && st.req.since_retry < st.req.cwnd {
            return;
        }
        // Only timeouts spend `retry_cnt`: a NAK or a response proves the peer alive (and
        // duplicated or late NAKs must not wear the budget down), while silence for
        // `retry_cnt + 1` timeouts without progress is what "retry exceeded" means.
        if why == TIMEOUT {
            if !self.use_retry(st, why) {
                return;
            }
        } else {
            self.count(&self.counters.retransmits);
            tracing::trace!(
                qpn = self.base.qpn,
                comp = st.req.comp_psn,
                why,
                "rxe retry"
            );
        }
        let from = st.req.comp_psn;
        st.req.retrying = Some(from);
        st.req.since_retry = 0;
        st.req.cwnd = (st.req.cwnd / 2).max(MIN_WINDOW);
        st.req.rewind(from);
        if let Some(w) = st.req.wqes.get(st.req.cur) {
            tracing::trace!(
                qpn = self.base.qpn,
                from,
                cur = st.req.cur,
                pkt = st.req.cur_pkt,
                op = ?w.op,
                first = w.first_psn,
                npkts = w.npkts,
                rcvd = w.rcvd,
                requested = w.requested,
                "rxe rewound"
            );
        }
    }

    /// Spend one retry; false (and the QP in Error) when none are left.
    fn use_retry(&self, st: &mut State, why: &'static str) -> bool {
        tracing::trace!(
            qpn = self.base.qpn,
            left = st.req.retry_left,
            comp = st.req.comp_psn,
            why,
            "rxe retry"
        );
        if st.req.retry_left == 0 {
            self.fail_front(st, WcStatus::RetryExcErr);
            self.peer_lost(st);
            return false;
        }
        st.req.retry_left -= 1;
        self.count(&self.counters.retransmits);
        true
    }

    /// Fail the oldest outstanding request with `status` (the QP goes to Error).
    fn fail_front(&self, st: &mut State, status: WcStatus) {
        tracing::warn!(qpn = self.base.qpn, ?status, "rxe request failed");
        if let Some(w) = st.req.wqes.iter_mut().find(|w| !w.done) {
            w.done = true;
            w.status = Some(status);
        }
        self.complete_in_order(st);
        self.to_error(st);
    }

    /// A response packet (ACK, NAK, read response, atomic ACK). Returns whether the
    /// transmit side should run.
    pub(super) fn on_response(&self, st: &mut State, p: &RoceRepr<'_>) -> bool {
        let psn = p.bth.psn;
        tracing::trace!(
            qpn = self.base.qpn,
            psn,
            op = ?p.bth.opcode,
            aeth = ?p.aeth.map(|a| a.syndrome),
            comp = st.req.comp_psn,
            sent = st.req.sent_psn,
            tx = st.req.tx_psn(),
            "rxe response"
        );
        let c = &self.counters;
        match p.bth.opcode {
            Opcode::RcAcknowledge => match p.aeth.map(|a| a.syndrome) {
                Some(Syndrome::Ack { .. }) => self.ack_through(st, psn),
                Some(Syndrome::RnrNak { timer }) => {
                    self.count(&c.rnr_nak_rcvd);
                    self.ack_through(st, psn_add(psn, wire::PSN_MASK));
                    if st.req.rnr_retry != 7 {
                        if st.req.rnr_left == 0 {
                            self.fail_front(st, WcStatus::RnrRetryExcErr);
                            return false;
                        }
                        st.req.rnr_left -= 1;
                    }
                    st.req.rewind(psn);
                    st.req.rnr_wait = true;
                    let wait = wire::aeth::rnr_timer_micros(timer) as u64;
                    self.arm_timer(st, Duration::from_micros(wait));
                    return false;
                }
                Some(Syndrome::Nak(NakCode::PsnSequenceError)) => {
                    self.count(&c.nak_seq_rcvd);
                    self.ack_through(st, psn_add(psn, wire::PSN_MASK));
                    self.retry(st, "sequence NAK");
                }
                Some(Syndrome::Nak(code)) => {
                    self.count(&c.nak_other_rcvd);
                    self.ack_through(st, psn_add(psn, wire::PSN_MASK));
                    let status = match code {
                        NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                        NakCode::RemoteOperationalError => WcStatus::RemOpErr,
                        _ => WcStatus::RemInvReqErr,
                    };
                    self.fail_front(st, status);
                    return false;
                }
                None => {}
            },
            Opcode::RcAtomicAcknowledge => {
                let Some(i) = st.req.wqes.iter().position(|w| !w.done && w.is_read_like()) else {
                    return false;
                };
                let w = &st.req.wqes[i];
                if w.op == WrOpcode::RdmaRead || w.first_psn != psn || w.requested == 0 {
                    return false;
                }
                let orig = p.atomic_ack_eth.map(|a| a.orig).unwrap_or(0);
                self.ack_through(st, psn_add(psn, wire::PSN_MASK));
                st.req.wqes[i].atomic_orig = orig;
                let res = self.scatter(&st.req.wqes[i], 0, &orig.to_ne_bytes());
                self.finish_read_like(st, i, res.err());
            }
            op if op.operation() == wire::Operation::RdmaReadResponse => {
                self.on_read_response(st, p);
            }
            _ => {}
        }
        self.after_progress(st);
        true
    }

    fn on_read_response(&self, st: &mut State, p: &RoceRepr<'_>) {
        let psn = p.bth.psn;
        let Some(i) = st.req.wqes.iter().position(|w| !w.done && w.is_read_like()) else {
            return;
        };
        let w = &st.req.wqes[i];
        let requested_end = psn_add(w.first_psn, w.requested);
        if w.op != WrOpcode::RdmaRead || !w.covers(psn) || psn_diff(psn, requested_end) >= 0 {
            return; // stale (a response to an earlier attempt) or not ours
        }
        let expected = psn_add(w.first_psn, w.rcvd);
        match psn_diff(psn, expected) {
            0 => {}
            d if d > 0 => return self.retry(st, "read response gap"),
            _ => return, // duplicate
        }
        let mtu = st.mtu as u64;
        let off = w.rcvd as u64 * mtu;
        let end_of_msg = w.rcvd + 1 == w.npkts;
        let want = (w.len.saturating_sub(off)).min(mtu) as usize;
        if p.payload.len() != want {
            self.fail_front(st, WcStatus::BadRespErr);
            return;
        }
        // A read response acknowledges everything before the read.
        self.ack_through(st, psn_add(w.first_psn, wire::PSN_MASK));
        let res = self.scatter(&st.req.wqes[i], off, p.payload);
        if let Err(status) = res {
            return self.finish_read_like(st, i, Some(status));
        }
        let w = &mut st.req.wqes[i];
        w.rcvd += 1;
        if psn_diff(psn_add(psn, 1), st.req.comp_psn) > 0 {
            st.req.comp_psn = psn_add(psn, 1);
            st.req.retry_left = st.req.retry_cnt;
            st.req.cwnd = (st.req.cwnd + 1).min(WINDOW);
        }
        if end_of_msg {
            self.finish_read_like(st, i, None);
        }
    }

    fn finish_read_like(&self, st: &mut State, i: usize, err: Option<WcStatus>) {
        let w = &mut st.req.wqes[i];
        let next = psn_add(w.first_psn, w.npkts);
        w.done = true;
        w.status = err;
        if psn_diff(next, st.req.comp_psn) > 0 {
            st.req.comp_psn = next;
        }
        st.req.retry_left = st.req.retry_cnt;
        self.complete_in_order(st);
    }

    /// After acknowledgements: complete, and keep the timer running only while
    /// something is outstanding.
    fn after_progress(&self, st: &mut State) {
        self.complete_in_order(st);
        if st.qp == QpState::Error || st.req.rnr_wait {
            return;
        }
        if st.req.outstanding() {
            if let Some(t) = Self::ack_timeout(st) {
                self.arm_timer(st, t);
            }
        } else {
            self.stop_timer(st);
        }
    }

    /// The retransmission timer: the QP's ACK timeout, doubled for each timeout in a row
    /// without progress (up to 8×). A peer that is only slow, on a loaded host or behind a
    /// lossy link, gets time to answer before `retry_cnt` runs out; progress resets it.
    fn retry_timeout(st: &State) -> Option<Duration> {
        let in_a_row = st.req.retry_cnt.saturating_sub(st.req.retry_left).min(3);
        Self::ack_timeout(st).map(|t| t * (1u32 << in_a_row))
    }

    /// The QP timer fired: the RNR wait is over, or nothing was acknowledged in time.
    pub(super) fn requester_timeout(&self, st: &mut State) {
        if st.qp == QpState::Error {
            return;
        }
        if st.req.rnr_wait {
            st.req.rnr_wait = false;
            if let Some(t) = Self::retry_timeout(st) {
                self.arm_timer(st, t);
            }
            return;
        }
        if !st.req.outstanding() {
            return;
        }
        self.count(&self.counters.retry_timeouts);
        tracing::debug!(
            qpn = self.base.qpn,
            psn = st.req.comp_psn,
            "rxe retransmission timeout"
        );
        st.req.retrying = None;
        self.retry(st, TIMEOUT);
        if st.qp == QpState::Error {
            return;
        }
        if let Some(t) = Self::retry_timeout(st) {
            self.arm_timer(st, t);
        }
    }
}
