//! Requester and completer: send-queue work requests become request packets (segmented
//! at the path MTU, PSNs assigned, at most [`WINDOW`] packets unacknowledged), and
//! acknowledgements, NAKs, read responses and atomic acknowledgements become completions,
//! in order. Loss is repaired go-back-N: on a PSN sequence NAK, a gap in read responses,
//! or the ACK timer, transmission restarts at the oldest unacknowledged PSN; RNR NAKs wait
//! the peer's timer first. `retry_cnt` and `rnr_retry` (7 = forever) bound the attempts.

use super::{cqe_for, RxeQp, State, WINDOW};
use crate::wire::{
    self, psn_add, psn_diff, AethRepr, AtomicEthRepr, IethRepr, ImmDtRepr, NakCode, Opcode,
    RethRepr, RoceRepr, Syndrome,
};
use rnicpi::*;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

/// Request packets between two that ask for an acknowledgement.
const ACK_EVERY: u32 = 32;

/// One send-queue work request from the moment it is taken off the ring until it
/// completes.
pub(crate) struct SendWqe {
    pub wqe: Wqe,
    op: WrOpcode,
    first_psn: u32,
    /// PSNs the request occupies (packets of a Send/Write, responses of a Read, 1 for an
    /// atomic, 0 for local operations).
    npkts: u32,
    len: u64,
    /// Gather/scatter list, validated when the request was taken.
    regions: Vec<(Arc<Region>, Sge)>,
    pub done: bool,
    /// Set when the request failed.
    pub status: Option<WcStatus>,
    /// Read responses (or the atomic acknowledgement) received.
    rcvd: u32,
    /// Counted against `max_rd_atomic`.
    started: bool,
    /// Every packet has been transmitted at least once.
    sent_all: bool,
    atomic_orig: u64,
}

impl SendWqe {
    fn is_read_like(&self) -> bool {
        matches!(
            self.op,
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd
        )
    }
    fn is_local(&self) -> bool {
        matches!(self.op, WrOpcode::LocalInv | WrOpcode::BindMw)
    }
    fn last_psn(&self) -> u32 {
        psn_add(self.first_psn, self.npkts.max(1) - 1)
    }
    /// Whether `psn` falls inside this request's PSN range.
    fn covers(&self, psn: u32) -> bool {
        self.npkts > 0 && psn_diff(psn, self.first_psn) >= 0 && psn_diff(psn, self.last_psn()) <= 0
    }
}

pub(crate) struct Requester {
    /// PSN the next new request starts at.
    psn: u32,
    wqes: VecDeque<SendWqe>,
    /// Transmit position: request index in `wqes` and packet within it.
    cur: usize,
    cur_pkt: u32,
    /// Oldest PSN not yet acknowledged.
    comp_psn: u32,
    retry_cnt: u8,
    retry_left: u8,
    rnr_retry: u8,
    rnr_left: u8,
    /// Waiting out an RNR NAK's timer.
    rnr_wait: bool,
    /// A gap in read responses was seen and the read re-requested.
    read_retrying: bool,
    /// Reads and atomics outstanding.
    rd_atomic: u32,
}

impl Requester {
    pub fn new(psn: u32, retry_cnt: u8, rnr_retry: u8) -> Requester {
        Requester {
            psn,
            wqes: VecDeque::new(),
            cur: 0,
            cur_pkt: 0,
            comp_psn: psn,
            retry_cnt,
            retry_left: retry_cnt,
            rnr_retry,
            rnr_left: rnr_retry,
            rnr_wait: false,
            read_retrying: false,
            rd_atomic: 0,
        }
    }

    /// Take every request out (QP going to Error).
    pub fn drain(&mut self) -> Vec<SendWqe> {
        self.cur = 0;
        self.cur_pkt = 0;
        self.rd_atomic = 0;
        self.wqes.drain(..).collect()
    }

    /// PSN of the next packet to transmit.
    fn tx_psn(&self) -> u32 {
        match self.wqes.get(self.cur) {
            Some(w) if !w.is_local() => psn_add(w.first_psn, self.cur_pkt),
            _ => self.psn,
        }
    }

    /// Packets sent and not yet acknowledged.
    fn in_flight(&self) -> u32 {
        psn_diff(self.tx_psn(), self.comp_psn).max(0) as u32
    }

    fn outstanding(&self) -> bool {
        self.wqes
            .iter()
            .any(|w| !w.done && !w.is_local() && (w.sent_all || w.started))
            || self.in_flight() > 0
    }

    /// Restart transmission at `psn` (go-back-N).
    fn rewind(&mut self, psn: u32) {
        for (i, w) in self.wqes.iter().enumerate() {
            if w.done || w.is_local() {
                continue;
            }
            let end = psn_add(w.first_psn, w.npkts);
            if psn_diff(psn, end) < 0 {
                self.cur = i;
                self.cur_pkt = if w.is_read_like() {
                    w.rcvd
                } else {
                    psn_diff(psn, w.first_psn).max(0) as u32
                };
                return;
            }
        }
    }
}

impl RxeQp {
    /// Transmit request packets while the window, ORD and budget allow; true when the
    /// budget ran out with work left.
    pub(super) fn pump(&self, st: &mut State, budget: &mut u32) -> bool {
        loop {
            if !matches!(st.qp, QpState::Rts | QpState::Sqd) || st.req.rnr_wait {
                return false;
            }
            if st.req.cur == st.req.wqes.len() && !self.fetch(st) {
                return false;
            }
            let i = st.req.cur;
            if st.req.wqes[i].is_local() || st.req.wqes[i].done {
                if !st.req.wqes[i].done {
                    self.execute_local(st, i);
                }
                st.req.cur += 1;
                st.req.cur_pkt = 0;
                self.complete_in_order(st);
                if st.qp == QpState::Error {
                    return false;
                }
                continue;
            }
            if st.req.in_flight() >= WINDOW {
                return false; // the next acknowledgement reopens the window
            }
            if *budget == 0 {
                return true;
            }
            *budget -= 1;
            self.send_request(st, i);
            if st.timer_at.is_none() {
                if let Some(t) = Self::ack_timeout(st) {
                    self.arm_timer(st, t);
                }
            }
        }
    }

    /// Take the next request off the consumer's ring; false when there is none (or it
    /// must wait for outstanding reads).
    fn fetch(&self, st: &mut State) -> bool {
        if st.qp != QpState::Rts {
            return false;
        }
        let sq = self.sq().lock();
        let wqe = match sq.peek() {
            Ok(Some(w)) => w,
            Ok(None) => return false,
            Err(_) => {
                drop(sq);
                self.fatal(st, EventKind::QpFatal, "send ring indices corrupt");
                return false;
            }
        };
        let Some(op) = wqe.opcode().filter(|o| *o != WrOpcode::Recv) else {
            sq.advance();
            drop(sq);
            return self.reject_local(st, wqe, WcStatus::LocQpOpErr);
        };
        let read_like = matches!(
            op,
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd
        );
        if read_like && st.req.rd_atomic >= st.attr.max_rd_atomic.max(1) as u32 {
            return false; // a response frees a slot and pumps again
        }
        if wqe.flags & send_flags::FENCE != 0 && st.req.rd_atomic > 0 {
            return false;
        }
        sq.advance();
        drop(sq);
        match self.prepare(st, wqe, op) {
            Ok(w) => {
                st.req.psn = psn_add(st.req.psn, w.npkts);
                st.req.wqes.push_back(w);
                true
            }
            Err(status) => self.reject_local(st, wqe, status),
        }
    }

    /// A request that fails local checks completes in error and the QP goes to Error.
    fn reject_local(&self, st: &mut State, wqe: Wqe, status: WcStatus) -> bool {
        tracing::debug!(
            qpn = self.qpn,
            wr_id = wqe.wr_id,
            ?status,
            "rxe request refused"
        );
        st.req.wqes.push_back(SendWqe {
            op: WrOpcode::LocalInv,
            first_psn: st.req.psn,
            npkts: 0,
            len: 0,
            regions: Vec::new(),
            done: true,
            status: Some(status),
            rcvd: 0,
            started: false,
            sent_all: true,
            atomic_orig: 0,
            wqe,
        });
        st.req.cur = st.req.wqes.len();
        self.complete_in_order(st);
        false
    }

    /// Validate a request against the QP's caps and its registrations.
    fn prepare(&self, st: &State, wqe: Wqe, op: WrOpcode) -> Result<SendWqe, WcStatus> {
        let max_inline = (self.caps.max_inline as usize).min(MAX_INLINE);
        if u32::from(wqe.num_sge) > self.caps.max_send_sge
            || (wqe.is_inline() && wqe.inline_len as usize > max_inline)
        {
            return Err(WcStatus::LocLenErr);
        }
        let len = wqe.total_len();
        if len > 1 << 31 {
            return Err(WcStatus::LocLenErr);
        }
        let mtu = st.mtu as u64;
        let mut regions = Vec::new();
        let (npkts, need) = match op {
            WrOpcode::Send | WrOpcode::SendWithImm | WrOpcode::SendWithInv => {
                (len.div_ceil(mtu).max(1) as u32, Access::empty())
            }
            WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm => {
                (len.div_ceil(mtu).max(1) as u32, Access::empty())
            }
            WrOpcode::RdmaRead => {
                if wqe.is_inline() {
                    return Err(WcStatus::LocQpOpErr);
                }
                (len.div_ceil(mtu).max(1) as u32, Access::LOCAL_WRITE)
            }
            WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd => {
                if wqe.is_inline() || wqe.num_sge != 1 || wqe.sge[0].length < 8 {
                    return Err(WcStatus::LocLenErr);
                }
                if !wqe.remote_addr.is_multiple_of(8) {
                    return Err(WcStatus::LocQpOpErr);
                }
                (1, Access::LOCAL_WRITE)
            }
            WrOpcode::LocalInv | WrOpcode::BindMw => (0, Access::empty()),
            WrOpcode::Recv => return Err(WcStatus::LocQpOpErr),
        };
        if !wqe.is_inline() && npkts > 0 {
            for s in wqe.sges() {
                if s.length == 0 {
                    continue;
                }
                let r = self
                    .dev
                    .mrs
                    .lookup(s.lkey)
                    .map_err(|_| WcStatus::LocProtErr)?;
                r.check(self.pd, s.addr, s.length as u64, need)
                    .map_err(|_| WcStatus::LocProtErr)?;
                regions.push((r, *s));
            }
        }
        Ok(SendWqe {
            wqe,
            op,
            first_psn: st.req.psn,
            npkts,
            len,
            regions,
            done: false,
            status: None,
            rcvd: 0,
            started: false,
            sent_all: false,
            atomic_orig: 0,
        })
    }

    /// Local operations (bind, invalidate) run in send-queue order and use no PSN.
    fn execute_local(&self, st: &mut State, i: usize) {
        let w = &mut st.req.wqes[i];
        let r = match w.op {
            WrOpcode::LocalInv => self
                .dev
                .mrs
                .invalidate(w.wqe.imm_or_inv, self.pd)
                .map_err(|_| WcStatus::LocProtErr),
            _ => {
                let b = w.wqe.bind_args();
                match b.access {
                    Some(a) => self
                        .dev
                        .mrs
                        .bind_window(self.pd, b.mw_rkey, b.mr_lkey, b.addr, b.len, a)
                        .map(|_| ())
                        .map_err(|_| WcStatus::MwBindErr),
                    None => Err(WcStatus::MwBindErr),
                }
            }
        };
        w.done = true;
        w.status = r.err();
    }

    /// Bytes `[off, off+n)` of a request's payload.
    fn gather(&self, w: &SendWqe, off: u64, n: usize, out: &mut Vec<u8>) -> Result<(), WcStatus> {
        out.clear();
        if w.wqe.is_inline() {
            let end = (off as usize + n).min(w.wqe.inline_len as usize);
            out.extend_from_slice(&w.wqe.inline_data[off as usize..end]);
            return Ok(());
        }
        out.resize(n, 0);
        let (mut skip, mut filled) = (off, 0usize);
        for (r, s) in &w.regions {
            if filled == n {
                break;
            }
            if skip >= s.length as u64 {
                skip -= s.length as u64;
                continue;
            }
            let take = ((s.length as u64 - skip) as usize).min(n - filled);
            r.read(
                self.pd,
                s.addr + skip,
                &mut out[filled..filled + take],
                Access::empty(),
            )
            .map_err(|_| WcStatus::LocProtErr)?;
            filled += take;
            skip = 0;
        }
        Ok(())
    }

    /// Write `data` at offset `off` of a request's scatter list (read responses).
    fn scatter(&self, w: &SendWqe, off: u64, data: &[u8]) -> Result<(), WcStatus> {
        if off + data.len() as u64 > w.len {
            return Err(WcStatus::LocLenErr);
        }
        let (mut skip, mut left) = (off, data);
        for (r, s) in &w.regions {
            if left.is_empty() {
                break;
            }
            if skip >= s.length as u64 {
                skip -= s.length as u64;
                continue;
            }
            let take = ((s.length as u64 - skip) as usize).min(left.len());
            r.write(self.pd, s.addr + skip, &left[..take], Access::LOCAL_WRITE)
                .map_err(|_| WcStatus::LocProtErr)?;
            left = &left[take..];
            skip = 0;
        }
        Ok(())
    }

    /// Transmit the packet at the transmit position of request `i`.
    fn send_request(&self, st: &mut State, i: usize) {
        let k = st.req.cur_pkt;
        let mtu = st.mtu;
        let w = &st.req.wqes[i];
        let psn = psn_add(w.first_psn, k);
        let mut payload = Vec::new();
        let mut bth = self.bth(st, Opcode::RcSendOnly, psn);
        let (mut reth, mut immdt, mut ieth, mut atomic) = (None, None, None, None);
        let imm = || ImmDtRepr {
            imm: u32::from_be_bytes(w.wqe.imm_or_inv.to_ne_bytes()),
        };
        let last;
        match w.op {
            WrOpcode::RdmaRead => {
                let off = k as u64 * mtu as u64;
                bth.opcode = Opcode::RcRdmaReadRequest;
                reth = Some(RethRepr {
                    va: w.wqe.remote_addr.wrapping_add(off),
                    rkey: w.wqe.rkey,
                    dma_len: (w.len - off.min(w.len)) as u32,
                });
                last = true;
            }
            WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd => {
                let cmp = w.op == WrOpcode::AtomicCmpSwp;
                bth.opcode = if cmp {
                    Opcode::RcCompareSwap
                } else {
                    Opcode::RcFetchAdd
                };
                atomic = Some(AtomicEthRepr {
                    va: w.wqe.remote_addr,
                    rkey: w.wqe.rkey,
                    swap_add: if cmp { w.wqe.swap } else { w.wqe.compare_add },
                    compare: if cmp { w.wqe.compare_add } else { 0 },
                });
                last = true;
            }
            op => {
                let off = k as u64 * mtu as u64;
                let n = (w.len - off).min(mtu as u64) as usize;
                if let Err(status) = self.gather(w, off, n, &mut payload) {
                    st.req.wqes[i].status = Some(status);
                    st.req.wqes[i].done = true;
                    self.complete_in_order(st);
                    return;
                }
                let (first, is_last) = (k == 0, k + 1 == w.npkts);
                last = is_last;
                let write = matches!(op, WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm);
                let with_imm = matches!(op, WrOpcode::SendWithImm | WrOpcode::RdmaWriteWithImm);
                bth.opcode =
                    segment_opcode(write, first, is_last, with_imm, op == WrOpcode::SendWithInv);
                if write && first {
                    reth = Some(RethRepr {
                        va: w.wqe.remote_addr,
                        rkey: w.wqe.rkey,
                        dma_len: w.len as u32,
                    });
                }
                if with_imm && is_last {
                    immdt = Some(imm());
                }
                if op == WrOpcode::SendWithInv && is_last {
                    ieth = Some(IethRepr {
                        rkey: w.wqe.imm_or_inv,
                    });
                }
                bth.solicited = is_last && w.wqe.solicited() && op != WrOpcode::RdmaWrite;
            }
        }
        bth.ack_req = last || psn.is_multiple_of(ACK_EVERY);
        let mut repr = RoceRepr::new(bth, &payload);
        repr.reth = reth;
        repr.immdt = immdt;
        repr.ieth = ieth;
        repr.atomic_eth = atomic;
        self.send_packet(st, &repr);
        let r = &mut st.req;
        let w = &mut r.wqes[i];
        if w.is_read_like() {
            if !w.started {
                w.started = true;
                r.rd_atomic += 1;
            }
            w.sent_all = true;
            r.cur += 1;
            r.cur_pkt = 0;
        } else if last {
            w.sent_all = true;
            r.cur += 1;
            r.cur_pkt = 0;
        } else {
            r.cur_pkt += 1;
        }
    }

    /// Complete finished requests from the front, in order; a failed one takes the QP
    /// to Error (which flushes the rest).
    pub(super) fn complete_in_order(&self, st: &mut State) {
        while st.req.wqes.front().is_some_and(|w| w.done) {
            let Some(w) = st.req.wqes.pop_front() else {
                break;
            };
            st.req.cur = st.req.cur.saturating_sub(1);
            if let Some(status) = w.status {
                self.post_cqe(true, cqe_for(&w.wqe, self.qpn, status, 0));
                self.to_error(st);
                return;
            }
            if w.wqe.signaled() {
                let len = match w.op {
                    WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd => 8,
                    _ => w.len as u32,
                };
                self.post_cqe(true, cqe_for(&w.wqe, self.qpn, WcStatus::Success, len));
            }
        }
    }

    /// Mark acknowledged everything up to and including `psn`.
    fn ack_through(&self, st: &mut State, psn: u32) {
        let r = &mut st.req;
        // Ignore acknowledgements of PSNs never sent, or older than what is acknowledged.
        if psn_diff(psn, r.tx_psn()) >= 0 || psn_diff(psn, r.comp_psn) < -1 {
            return;
        }
        let mut progress = false;
        let mut gap = None;
        for w in r.wqes.iter_mut() {
            if w.done || w.is_local() {
                continue;
            }
            if w.is_read_like() {
                // An acknowledgement beyond a read's responses means they were lost.
                if psn_diff(psn, w.first_psn) >= 0 && w.sent_all {
                    gap = Some(psn_add(w.first_psn, w.rcvd));
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
            .find(|w| !w.done && w.is_read_like() && w.sent_all)
            .map(|w| psn_add(w.first_psn, w.rcvd));
        let new_comp = match limit {
            Some(l) if psn_diff(l, acked) < 0 => l,
            _ => acked,
        };
        if psn_diff(new_comp, r.comp_psn) > 0 {
            r.comp_psn = new_comp;
            progress = true;
        }
        if progress {
            r.retry_left = r.retry_cnt;
            r.rnr_left = r.rnr_retry;
        }
        if let Some(g) = gap {
            self.retry_read(st, g);
        }
    }

    /// Re-request a read from the first response not received.
    fn retry_read(&self, st: &mut State, psn: u32) {
        if st.req.read_retrying {
            return;
        }
        if !self.use_retry(st) {
            return;
        }
        st.req.read_retrying = true;
        st.req.rewind(psn);
    }

    /// Spend one retry; false (and the QP in Error) when none are left.
    fn use_retry(&self, st: &mut State) -> bool {
        if st.req.retry_left == 0 {
            self.fail_front(st, WcStatus::RetryExcErr);
            return false;
        }
        st.req.retry_left -= 1;
        self.dev.count(&self.dev.counters.retransmits);
        true
    }

    /// Fail the oldest outstanding request with `status` (the QP goes to Error).
    fn fail_front(&self, st: &mut State, status: WcStatus) {
        tracing::warn!(qpn = self.qpn, ?status, "rxe request failed");
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
        let c = &self.dev.counters;
        match p.bth.opcode {
            Opcode::RcAcknowledge => match p.aeth.map(|a| a.syndrome) {
                Some(Syndrome::Ack { .. }) => self.ack_through(st, psn),
                Some(Syndrome::RnrNak { timer }) => {
                    self.dev.count(&c.rnr_nak_rcvd);
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
                    self.dev.count(&c.nak_seq_rcvd);
                    self.ack_through(st, psn_add(psn, wire::PSN_MASK));
                    if self.use_retry(st) {
                        st.req.read_retrying = false;
                        st.req.rewind(psn);
                    }
                }
                Some(Syndrome::Nak(code)) => {
                    self.dev.count(&c.nak_other_rcvd);
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
                if w.op == WrOpcode::RdmaRead || w.first_psn != psn || !w.sent_all {
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
        if w.op != WrOpcode::RdmaRead || !w.covers(psn) || !w.sent_all {
            return; // stale (a response to an earlier attempt) or not ours
        }
        let expected = psn_add(w.first_psn, w.rcvd);
        match psn_diff(psn, expected) {
            0 => {}
            d if d > 0 => return self.retry_read(st, expected),
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
        st.req.read_retrying = false;
        let res = self.scatter(&st.req.wqes[i], off, p.payload);
        if let Err(status) = res {
            return self.finish_read_like(st, i, Some(status));
        }
        let w = &mut st.req.wqes[i];
        w.rcvd += 1;
        if psn_diff(psn_add(psn, 1), st.req.comp_psn) > 0 {
            st.req.comp_psn = psn_add(psn, 1);
            st.req.retry_left = st.req.retry_cnt;
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
        st.req.rd_atomic = st.req.rd_atomic.saturating_sub(1);
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

    /// The QP timer fired: the RNR wait is over, or nothing was acknowledged in time.
    pub(super) fn requester_timeout(&self, st: &mut State) {
        if st.qp == QpState::Error {
            return;
        }
        if st.req.rnr_wait {
            st.req.rnr_wait = false;
            if let Some(t) = Self::ack_timeout(st) {
                self.arm_timer(st, t);
            }
            return;
        }
        if !st.req.outstanding() {
            return;
        }
        self.dev.count(&self.dev.counters.retry_timeouts);
        if !self.use_retry(st) {
            return;
        }
        tracing::debug!(
            qpn = self.qpn,
            psn = st.req.comp_psn,
            "rxe retransmission timeout"
        );
        st.req.read_retrying = false;
        let from = st.req.comp_psn;
        st.req.rewind(from);
        if let Some(t) = Self::ack_timeout(st) {
            self.arm_timer(st, t);
        }
    }
}

/// The opcode of one segment of a Send or RDMA Write.
fn segment_opcode(write: bool, first: bool, last: bool, imm: bool, inv: bool) -> Opcode {
    use Opcode::*;
    match (write, first, last) {
        (false, true, true) if imm => RcSendOnlyImm,
        (false, true, true) if inv => RcSendOnlyInv,
        (false, true, true) => RcSendOnly,
        (false, true, false) => RcSendFirst,
        (false, false, false) => RcSendMiddle,
        (false, false, true) if imm => RcSendLastImm,
        (false, false, true) if inv => RcSendLastInv,
        (false, false, true) => RcSendLast,
        (true, true, true) if imm => RcRdmaWriteOnlyImm,
        (true, true, true) => RcRdmaWriteOnly,
        (true, true, false) => RcRdmaWriteFirst,
        (true, false, false) => RcRdmaWriteMiddle,
        (true, false, true) if imm => RcRdmaWriteLastImm,
        (true, false, true) => RcRdmaWriteLast,
    }
}

/// AETH of a plain acknowledgement.
pub(crate) fn ack_aeth(msn: u32) -> AethRepr {
    AethRepr {
        syndrome: Syndrome::Ack {
            credit_code: wire::aeth::CREDITS_UNLIMITED,
        },
        msn,
    }
}
