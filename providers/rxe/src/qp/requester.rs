//! Requester: send-queue work requests become request packets (segmented at the path MTU,
//! PSNs assigned, at most a window of packets unacknowledged), as Linux's `rxe_req.c`.
//! What comes back is the completer's (`completer`); both share the [`Requester`] state.
//!
//! A UC QP's requests are Sends and RDMA Writes only; nothing comes back, so a request
//! completes once its last packet is made (its payload is in the packet by then), with
//! no window, no acknowledgement asked for and no timer.

use super::{byte_len, Engine, State, MAX_MSG, WINDOW};
use crate::wire::{
    self, psn_add, psn_diff, AethRepr, AtomicEthRepr, IethRepr, ImmDtRepr, Opcode, RethRepr,
    RoceRepr, Syndrome,
};
use rnicpi::*;
use std::collections::VecDeque;

/// Request packets between two that ask for an acknowledgement.
const ACK_EVERY: u32 = 32;
/// Most responses one RDMA Read request asks for; a longer read is requested piece by
/// piece (each piece a request of its own, counted against ORD), so a loss costs at
/// most a piece and the window paces reads as it paces writes.
const READ_SEGMENT: u32 = 32;
/// The window never shrinks below this many packets.
pub(super) const MIN_WINDOW: u32 = 8;

/// One send-queue work request from the moment it is taken off the ring until it
/// completes.
pub(crate) struct SendWqe {
    pub wqe: Wqe,
    pub(super) op: WrOpcode,
    pub(super) first_psn: u32,
    /// PSNs the request occupies (packets of a Send/Write, responses of a Read, 1 for an
    /// atomic, 0 for local operations).
    pub(super) npkts: u32,
    pub(super) len: u64,
    /// Gather/scatter list, validated when the request was taken.
    pub(super) regions: Sgl,
    pub done: bool,
    /// Set when the request failed.
    pub status: Option<WcStatus>,
    /// Read responses (or the atomic acknowledgement) received.
    pub(super) rcvd: u32,
    /// Read responses (or the atomic) requested so far: a large read goes out as several
    /// requests of at most [`READ_SEGMENT`] responses each, as ORD and the window allow.
    pub(super) requested: u32,
    /// Every packet has been transmitted at least once.
    pub(super) sent_all: bool,
    pub(super) atomic_orig: u64,
}

impl SendWqe {
    pub(super) fn is_read_like(&self) -> bool {
        is_read_like(self.op)
    }
    pub(super) fn is_local(&self) -> bool {
        matches!(self.op, WrOpcode::LocalInv | WrOpcode::BindMw)
    }
    pub(super) fn last_psn(&self) -> u32 {
        psn_add(self.first_psn, self.npkts.max(1) - 1)
    }
    /// Whether `psn` falls inside this request's PSN range.
    pub(super) fn covers(&self, psn: u32) -> bool {
        self.npkts > 0 && psn_diff(psn, self.first_psn) >= 0 && psn_diff(psn, self.last_psn()) <= 0
    }
}

pub(crate) struct Requester {
    /// PSN the next new request starts at.
    pub(super) psn: u32,
    pub(super) wqes: VecDeque<SendWqe>,
    /// Transmit position: request index in `wqes` and packet within it.
    pub(super) cur: usize,
    pub(super) cur_pkt: u32,
    /// Oldest PSN not yet acknowledged.
    pub(super) comp_psn: u32,
    /// One past the highest PSN ever transmitted (a go-back-N rewind moves the transmit
    /// position back, not this): acknowledgements up to it are genuine.
    pub(super) sent_psn: u32,
    pub(super) retry_cnt: u8,
    pub(super) retry_left: u8,
    pub(super) rnr_retry: u8,
    pub(super) rnr_left: u8,
    /// Waiting out an RNR NAK's timer.
    pub(super) rnr_wait: bool,
    /// The acknowledged PSN at which the last retry went back: until it moves, further
    /// signs of the same loss (the peer's repeated NAKs, more gaps) are not new retries.
    pub(super) retrying: Option<u32>,
    /// Packets transmitted since the last retry went back.
    pub(super) since_retry: u32,
    /// Packets allowed in flight: halved at each retry, grown by every packet acknowledged,
    /// between [`MIN_WINDOW`] and [`WINDOW`].
    pub(super) cwnd: u32,
}

impl Requester {
    pub fn new(psn: u32, retry_cnt: u8, rnr_retry: u8) -> Requester {
        Requester {
            psn,
            wqes: VecDeque::new(),
            cur: 0,
            cur_pkt: 0,
            comp_psn: psn,
            sent_psn: psn,
            retry_cnt,
            retry_left: retry_cnt,
            rnr_retry,
            rnr_left: rnr_retry,
            rnr_wait: false,
            retrying: None,
            since_retry: 0,
            cwnd: WINDOW,
        }
    }

    /// New retry budgets (a Modify QP in RTS): they count from now, full.
    pub fn set_retry_budgets(&mut self, retry_cnt: u8, rnr_retry: u8) {
        (self.retry_cnt, self.retry_left) = (retry_cnt, retry_cnt);
        (self.rnr_retry, self.rnr_left) = (rnr_retry, rnr_retry);
    }

    /// Requests taken off the ring and not yet completed.
    pub fn busy(&self) -> bool {
        !self.wqes.is_empty()
    }

    /// Take every request out (QP going to Error).
    pub fn drain(&mut self) -> Vec<SendWqe> {
        self.cur = 0;
        self.cur_pkt = 0;
        self.wqes.drain(..).collect()
    }

    /// PSN of the next packet to transmit.
    pub(super) fn tx_psn(&self) -> u32 {
        match self.wqes.get(self.cur) {
            Some(w) if !w.is_local() => psn_add(w.first_psn, self.cur_pkt),
            _ => self.psn,
        }
    }

    /// Packets sent and not yet acknowledged.
    fn in_flight(&self) -> u32 {
        psn_diff(self.tx_psn(), self.comp_psn).max(0) as u32
    }

    pub(super) fn outstanding(&self) -> bool {
        self.wqes
            .iter()
            .any(|w| !w.done && !w.is_local() && (w.sent_all || w.requested > 0))
            || self.in_flight() > 0
    }

    /// Read requests and atomics outstanding (what ORD bounds).
    fn rd_atomic(&self) -> u32 {
        self.wqes
            .iter()
            .filter(|w| !w.done && w.is_read_like())
            .map(|w| w.requested.div_ceil(READ_SEGMENT) - w.rcvd / READ_SEGMENT)
            .sum()
    }

    /// Restart transmission at `psn` (go-back-N), or earlier at a read whose responses
    /// are missing: the responder answers in PSN order, so a NAK or timeout past a read
    /// that is still incomplete means its responses were lost.
    pub(super) fn rewind(&mut self, psn: u32) {
        for (i, w) in self.wqes.iter().enumerate() {
            if w.done || w.is_local() {
                continue;
            }
            let end = psn_add(w.first_psn, w.npkts);
            if psn_diff(psn, end) < 0 || (w.is_read_like() && w.rcvd < w.requested) {
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

impl Engine<'_> {
    /// Transmit request packets while the window, ORD and budget allow; true when the
    /// budget ran out with work left. Local operations (bind, invalidate) spend the
    /// budget as packets do: a consumer replaying them from a churned ring costs one
    /// budget per call, never an endless loop on a shared thread.
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
                if *budget == 0 {
                    RingStats::count(&self.base.stats.drain_budget_spent);
                    return true;
                }
                *budget -= 1;
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
            if st.req.in_flight() >= st.req.cwnd {
                return false; // the next acknowledgement reopens the window
            }
            let w = &st.req.wqes[i];
            let ord = st.attr.max_rd_atomic.max(1) as u32;
            if w.is_read_like() && st.req.cur_pkt >= w.requested && st.req.rd_atomic() >= ord {
                return false; // a response frees a slot and pumps again
            }
            if *budget == 0 {
                return true;
            }
            *budget -= 1;
            self.send_request(st, i);
            if st.timer_at.is_none() && !self.uc() {
                if let Some(t) = Self::ack_timeout(st) {
                    self.arm_timer(st, t);
                }
            }
        }
    }

    /// Take the next request off the consumer's ring; false when there is none, when
    /// it must wait for outstanding reads, or when a ring's worth of requests is taken
    /// and not yet complete (the completion that frees one pumps again).
    fn fetch(&self, st: &mut State) -> bool {
        if st.qp != QpState::Rts {
            return false;
        }
        let mut sq = self.base.sq.lock();
        if st.req.wqes.len() >= sq.capacity() as usize {
            return false;
        }
        let wqe = match sq.peek() {
            Ok(Some(w)) => w,
            Ok(None) => return false,
            Err(RingCorrupt) => {
                drop(sq);
                RingStats::count(&self.base.stats.wq_corrupt);
                self.fatal(st, EventKind::QpFatal, "send ring indices corrupt");
                return false;
            }
        };
        let Some(op) = wqe.opcode().filter(|o| *o != WrOpcode::Recv) else {
            sq.advance();
            drop(sq);
            return self.reject_local(st, wqe, WcStatus::LocQpOpErr);
        };
        if is_read_like(op) && st.req.rd_atomic() >= st.attr.max_rd_atomic.max(1) as u32 {
            return false; // a response frees a slot and pumps again
        }
        if wqe.flags & send_flags::FENCE != 0 && st.req.rd_atomic() > 0 {
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
            qpn = self.base.qpn,
            wr_id = wqe.wr_id,
            ?status,
            "rxe request refused"
        );
        st.req.wqes.push_back(SendWqe {
            op: WrOpcode::LocalInv,
            first_psn: st.req.psn,
            npkts: 0,
            len: 0,
            regions: Sgl::default(),
            done: true,
            status: Some(status),
            rcvd: 0,
            requested: 0,
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
        if self.uc() && (op == WrOpcode::SendWithInv || is_read_like(op)) {
            return Err(WcStatus::LocQpOpErr); // UC has no such operation
        }
        let max_inline = (self.base.caps.max_inline as usize).min(MAX_INLINE);
        if u32::from(wqe.num_sge) > self.base.caps.max_send_sge
            || (wqe.is_inline() && wqe.inline_len as usize > max_inline)
        {
            return Err(WcStatus::LocLenErr);
        }
        let len = wqe.total_len();
        if len > MAX_MSG {
            return Err(WcStatus::LocLenErr);
        }
        let mtu = st.mtu as u64;
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
        let regions = if !wqe.is_inline() && npkts > 0 {
            self.mrs
                .resolve_sgl(self.base.pd, wqe.sges(), need)
                .map_err(|_| WcStatus::LocProtErr)?
        } else {
            Sgl::default()
        };
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
            requested: 0,
            sent_all: false,
            atomic_orig: 0,
        })
    }

    /// Local operations (bind, invalidate) run in send-queue order and use no PSN.
    fn execute_local(&self, st: &mut State, i: usize) {
        let w = &mut st.req.wqes[i];
        let r = match w.op {
            WrOpcode::LocalInv => self
                .mrs
                .invalidate(w.wqe.imm_or_inv, self.base.pd)
                .map_err(|_| WcStatus::LocProtErr),
            _ => {
                let b = w.wqe.bind_args();
                match b.access {
                    Some(a) => self
                        .mrs
                        .bind_window(self.base.pd, b.mw_rkey, b.mr_lkey, b.addr, b.len, a)
                        .map(|_| ())
                        .map_err(|_| WcStatus::MwBindErr),
                    None => Err(WcStatus::MwBindErr),
                }
            }
        };
        w.done = true;
        w.status = r.err();
    }

    /// Bytes `[off, off + n)` of a request's payload, appended to `out`.
    fn gather(w: &SendWqe, off: u64, n: usize, out: &mut Vec<u8>) -> Result<(), WcStatus> {
        if w.wqe.is_inline() {
            let inline = w.wqe.inline_data.get(..w.wqe.inline_len as usize);
            let data = inline.and_then(|d| d.get(off as usize..off as usize + n));
            out.extend_from_slice(data.ok_or(WcStatus::LocLenErr)?);
            return Ok(());
        }
        w.regions
            .append_at(off, n, Access::empty(), out)
            .map_err(|_| WcStatus::LocProtErr)
    }

    /// Write `data` at offset `off` of a request's scatter list (read responses).
    pub(super) fn scatter(&self, w: &SendWqe, off: u64, data: &[u8]) -> Result<(), WcStatus> {
        if off + data.len() as u64 > w.len {
            return Err(WcStatus::LocLenErr);
        }
        w.regions
            .write_at(off, data, Access::LOCAL_WRITE)
            .map_err(|_| WcStatus::LocProtErr)
    }

    /// Request `i` failed with `status`: it completes so (in order), and the QP goes to
    /// Error.
    fn fail_request(&self, st: &mut State, i: usize, status: WcStatus) {
        st.req.wqes[i].status = Some(status);
        st.req.wqes[i].done = true;
        self.complete_in_order(st);
    }

    /// Transmit the packet at the transmit position of request `i`.
    fn send_request(&self, st: &mut State, i: usize) {
        let k = st.req.cur_pkt;
        let mtu = st.mtu;
        let w = &st.req.wqes[i];
        let psn = psn_add(w.first_psn, k);
        // Where the payload comes from: `(offset, length)` in the request.
        let mut data = None;
        let mut bth = self.bth(st, Opcode::RcSendOnly, psn);
        let (mut reth, mut immdt, mut ieth, mut atomic) = (None, None, None, None);
        let imm = || ImmDtRepr {
            imm: u32::from_be_bytes(w.wqe.imm_or_inv.to_ne_bytes()),
        };
        let last;
        match w.op {
            WrOpcode::RdmaRead => {
                // Up to the end of the piece `k` falls in.
                let end = ((k / READ_SEGMENT + 1) * READ_SEGMENT).min(w.npkts);
                let off = (k as u64 * mtu as u64).min(w.len);
                let stop = (end as u64 * mtu as u64).min(w.len);
                bth.opcode = Opcode::RcRdmaReadRequest;
                reth = Some(RethRepr {
                    va: w.wqe.remote_addr.wrapping_add(off),
                    rkey: w.wqe.rkey,
                    dma_len: (stop - off) as u32,
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
                data = Some((off, (w.len - off).min(mtu as u64) as usize));
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
                        dma_len: byte_len(w.len),
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
        // Ask for an acknowledgement at the end of a message, every ACK_EVERY packets,
        // and on the packet that fills the window (else a full window waits for the timer).
        let fills = st.req.in_flight() + 1 >= st.req.cwnd;
        bth.ack_req = last || fills || psn.is_multiple_of(ACK_EVERY);
        if self.uc() {
            // Only Sends and Writes get here (`prepare`), and UC has all of theirs.
            let Some(op) = bth.opcode.in_transport(wire::Transport::Uc) else {
                return self.fail_request(st, i, WcStatus::LocQpOpErr);
            };
            bth.opcode = op;
            bth.ack_req = false;
        }
        let mut repr = RoceRepr::new(bth, &[]);
        repr.reth = reth;
        repr.immdt = immdt;
        repr.ieth = ieth;
        repr.atomic_eth = atomic;
        let (off, n) = data.unwrap_or((0, 0));
        let w = &st.req.wqes[i];
        let roce = match self.packet_with(&repr, n, |out| Self::gather(w, off, n, out)) {
            Ok(Some(roce)) => roce,
            Ok(None) => return,
            Err(status) => return self.fail_request(st, i, status),
        };
        self.queue_packet(st, roce);
        let r = &mut st.req;
        r.since_retry = r.since_retry.saturating_add(1);
        let w = &mut r.wqes[i];
        let next = if w.is_read_like() {
            psn_add(
                w.first_psn,
                w.npkts.min(((k / READ_SEGMENT + 1) * READ_SEGMENT).max(1)),
            )
        } else {
            psn_add(psn, 1)
        };
        if psn_diff(next, r.sent_psn) > 0 {
            r.sent_psn = next;
        }
        if w.is_read_like() {
            let end = if w.op == WrOpcode::RdmaRead {
                ((k / READ_SEGMENT + 1) * READ_SEGMENT).min(w.npkts)
            } else {
                1
            };
            w.requested = w.requested.max(end);
            if end >= w.npkts {
                w.sent_all = true;
                r.cur += 1;
                r.cur_pkt = 0;
            } else {
                r.cur_pkt = end;
            }
        } else if last {
            w.sent_all = true;
            r.cur += 1;
            r.cur_pkt = 0;
        } else {
            r.cur_pkt += 1;
        }
        if self.uc() {
            // Nothing will acknowledge it: what is made is done.
            st.req.comp_psn = psn_add(psn, 1);
            if last {
                st.req.wqes[i].done = true;
                self.complete_in_order(st);
            }
        }
    }
}

/// An operation answered with data (a Read's responses, an atomic's original value).
fn is_read_like(op: WrOpcode) -> bool {
    matches!(
        op,
        WrOpcode::RdmaRead | WrOpcode::AtomicCmpSwp | WrOpcode::AtomicFetchAdd
    )
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
