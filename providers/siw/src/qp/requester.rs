//! The requester: send-queue entries taken in order, segmented into FPDUs (Send, RDMA
//! Write, Read Request) or performed locally (Local Invalidate, Bind MW), and completed
//! in order once sent or answered.

use super::state::{Conn, Inflight};
use super::*;
use crate::orq::OutstandingRead;
use crate::wire::{Header, Model, Opcode, ReadRequest, ReadRequestPacket};
use std::time::Instant;

/// Room for a batch of FPDUs per socket write.
pub(super) const TX_BATCH: usize = 256 * 1024;
/// Largest request a doorbell transmits inline in the caller's thread.
const INLINE_TX: u64 = 16 * 1024;

impl SiwQp {
    /// The transmitter is finished with a request: its bytes are all out (`ok`) or the
    /// attempt failed. It is done now if `complete_now` (all but Reads, which wait for
    /// their response). A QP that went to Error meanwhile flushes what follows it now.
    pub(super) fn settle(&self, wqe: &Wqe, ok: bool, complete_now: bool) {
        let mut st = self.st.lock();
        if let Some(f) = st.inflight.iter_mut().find(|f| !f.sent && f.wqe == *wqe) {
            f.sent = true;
            f.done |= ok && complete_now;
        }
        if st.qp == QpState::Error {
            self.to_error(&mut st);
        } else {
            self.complete_in_order(&mut st);
        }
    }

    /// Decide the next transmission under the state lock (and reserve its resources).
    /// Send-queue entries spend `budget`; once it is spent the rest is left to the tx
    /// thread's next round.
    pub(super) fn take_work(&self, mode: Mode, budget: &mut u32) -> Work {
        let mut st = self.st.lock();
        if mode == Mode::Inline && (st.term.pending() || !st.responses.is_empty()) {
            st.kick = true; // Terminates and Read Responses go out from the tx thread
            self.cv.notify_one();
            return Work::Idle;
        }
        if let Some(t) = st.term.start_writing() {
            if let Conn::Up { .. } = st.conn {
                self.set_conn(&mut st, Conn::Closing { local: false });
            }
            return Work::Raw(t);
        }
        if st.qp != QpState::Rts {
            return if st.conn.winding_down() || st.qp == QpState::Error {
                let fin = st.conn.fin_written();
                self.set_conn(&mut st, fin);
                Work::Finish
            } else {
                Work::Idle
            };
        }
        if st.conn.hold().is_some_and(|t| Instant::now() < t) {
            return Work::Idle; // the tx thread sends it when the wait is over
        }
        let (crc, mtu) = (st.crc, st.max_ulpdu);
        if let Some(rr) = st.responses.pop_front() {
            st.responding += 1;
            return Work::Response { rr, crc, mtu };
        }
        let mut sq = self.base.sq.lock();
        // Requests taken off the ring and not yet complete (behind an outstanding Read)
        // never exceed the ring's size, however fast the consumer refills it.
        if st.inflight.len() >= sq.capacity() as usize {
            return Work::Idle; // the Read Response that completes the oldest kicks us
        }
        let wqe = match sq.peek() {
            Ok(Some(w)) => w,
            Ok(None) => {
                drop(sq);
                return if st.conn.winding_down() && st.inflight.is_empty() {
                    let fin = st.conn.fin_written();
                    self.set_conn(&mut st, fin);
                    Work::Finish
                } else {
                    Work::Idle
                };
            }
            Err(RingCorrupt) => {
                drop(sq);
                self.to_error(&mut st);
                drop(st);
                self.ring_corrupt("send");
                return Work::Idle;
            }
        };
        if *budget == 0 {
            RingStats::count(&self.base.stats.drain_budget_spent);
            st.kick = true;
            self.cv.notify_one();
            return Work::Idle;
        }
        let op = wqe.opcode();
        if op == Some(WrOpcode::RdmaRead) && st.orq.len() as u32 >= st.ord {
            return Work::Idle; // the Read Response that frees a slot kicks us again
        }
        if mode == Mode::Inline && wqe.total_len() > INLINE_TX {
            st.kick = true;
            self.cv.notify_one();
            return Work::Idle;
        }
        *budget -= 1;
        sq.advance();
        drop(sq);
        let msn = match op {
            Some(WrOpcode::RdmaRead) => {
                let m = st.tx_msn_read;
                st.tx_msn_read = m.wrapping_add(1);
                // Queued before the request leaves, so no response can come first.
                let (stag, to, size) = wqe
                    .sges()
                    .first()
                    .map_or((0, 0, 0), |s| (s.lkey, s.addr, s.length));
                st.orq.push(OutstandingRead::new(m, stag, to, size));
                m
            }
            Some(WrOpcode::Send | WrOpcode::SendWithInv) => {
                let m = st.tx_msn_send;
                st.tx_msn_send = m.wrapping_add(1);
                m
            }
            _ => 0,
        };
        st.inflight.push_back(Inflight {
            wqe,
            sent: false,
            done: false,
        });
        Work::Request { wqe, crc, mtu, msn }
    }

    /// Emit the FPDUs of one send-queue request. Ok(true) when it is complete once sent.
    pub(super) fn emit_request(
        &self,
        out: &mut Vec<u8>,
        w: &Wqe,
        crc: bool,
        mtu: usize,
        msn: u32,
        flush: &mut dyn FnMut(&mut Vec<u8>),
    ) -> Result<bool, WcStatus> {
        let op = w.opcode().ok_or(WcStatus::LocQpOpErr)?;
        // The request came through memory the consumer can scribble on: hold it to the
        // QP's capabilities before using any of it.
        let max_inline = (self.base.caps.max_inline as usize).min(rnicpi::wr::MAX_INLINE);
        if u32::from(w.num_sge) > self.base.caps.max_send_sge
            || (w.is_inline() && w.inline_len as usize > max_inline)
        {
            return Err(WcStatus::LocLenErr);
        }
        match op {
            WrOpcode::Send | WrOpcode::SendWithInv => {
                let opcode = match (op == WrOpcode::SendWithInv, w.solicited()) {
                    (false, false) => Opcode::Send,
                    (false, true) => Opcode::SendSe,
                    (true, false) => Opcode::SendInvalidate,
                    (true, true) => Opcode::SendSeInvalidate,
                };
                let inv = if op == WrOpcode::SendWithInv {
                    w.imm_or_inv
                } else {
                    0
                };
                self.emit_message(
                    out,
                    w,
                    crc,
                    mtu,
                    |mo| Model::Untagged {
                        inv_stag: inv,
                        qn: wire::QN_SEND,
                        msn,
                        mo: mo as u32,
                    },
                    opcode,
                    flush,
                )?;
                Ok(true)
            }
            WrOpcode::RdmaWrite => {
                let (stag, base) = (w.rkey, w.remote_addr);
                self.emit_message(
                    out,
                    w,
                    crc,
                    mtu,
                    |off| Model::Tagged {
                        stag,
                        to: base.wrapping_add(off),
                    },
                    Opcode::Write,
                    flush,
                )?;
                Ok(true)
            }
            WrOpcode::RdmaRead => {
                if w.num_sge > 1 || w.is_inline() {
                    return Err(WcStatus::LocQpOpErr);
                }
                let (sink_stag, sink_to, size) = match w.sges().first() {
                    Some(s) => {
                        let r = self
                            .dev
                            .res
                            .mrs
                            .lookup(s.lkey)
                            .map_err(|_| WcStatus::LocProtErr)?;
                        r.check(self.base.pd, s.addr, s.length as u64, Access::LOCAL_WRITE)
                            .map_err(|_| WcStatus::LocProtErr)?;
                        (s.lkey, s.addr, s.length)
                    }
                    None => (0, 0, 0),
                };
                let rr = ReadRequest {
                    sink_stag,
                    sink_to,
                    size,
                    src_stag: w.rkey,
                    src_to: w.remote_addr,
                };
                let start = wire::begin_fpdu(out);
                let h = Header {
                    opcode: Opcode::ReadRequest,
                    last: true,
                    model: Model::Untagged {
                        inv_stag: 0,
                        qn: wire::QN_READ,
                        msn,
                        mo: 0,
                    },
                };
                h.emit(wire::grow(out, h.buffer_len()));
                let body = wire::grow(out, rr.buffer_len());
                rr.emit(&mut ReadRequestPacket::new_unchecked(body));
                wire::finish_fpdu(out, start, crc).map_err(|_| WcStatus::LocLenErr)?;
                self.dev.counters.tx_fpdus.fetch_add(1, Ordering::Relaxed);
                Ok(false)
            }
            WrOpcode::LocalInv => {
                self.dev
                    .res
                    .mrs
                    .invalidate(w.imm_or_inv, self.base.pd)
                    .map_err(|_| WcStatus::LocProtErr)?;
                Ok(true)
            }
            WrOpcode::BindMw => {
                let b = w.bind_args();
                let access = b.access.ok_or(WcStatus::MwBindErr)?;
                self.dev
                    .res
                    .mrs
                    .bind_window(self.base.pd, b.mw_rkey, b.mr_lkey, b.addr, b.len, access)
                    .map_err(|e| {
                        tracing::debug!(qpn = self.base.qpn, error = %e, "memory window bind refused");
                        WcStatus::MwBindErr
                    })?;
                Ok(true)
            }
            _ => Err(WcStatus::LocQpOpErr),
        }
    }

    /// Segment one message (inline data or a gather list) into FPDUs.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn emit_message(
        &self,
        out: &mut Vec<u8>,
        w: &Wqe,
        crc: bool,
        max_ulpdu: usize,
        model: impl Fn(u64) -> Model,
        opcode: Opcode,
        flush: &mut dyn FnMut(&mut Vec<u8>),
    ) -> Result<(), WcStatus> {
        let chunk = (max_ulpdu - opcode.header_len()) as u64;
        let total = w.total_len();
        if total > u32::MAX as u64 {
            return Err(WcStatus::LocLenErr);
        }
        // Validate the gather list once.
        let regions = match w.is_inline() {
            true => Sgl::default(),
            false => self
                .dev
                .res
                .mrs
                .resolve_sgl(self.base.pd, w.sges(), Access::empty())
                .map_err(|_| WcStatus::LocProtErr)?,
        };
        let mut off = 0u64;
        loop {
            let n = (total - off).min(chunk);
            let start = wire::begin_fpdu(out);
            let h = Header {
                opcode,
                last: off + n == total,
                model: model(off),
            };
            h.emit(wire::grow(out, h.buffer_len()));
            let payload = wire::grow(out, n as usize);
            if w.is_inline() {
                payload.copy_from_slice(&w.inline_data[off as usize..(off + n) as usize]);
            } else {
                regions
                    .read_at(off, payload, Access::empty())
                    .map_err(|_| WcStatus::LocProtErr)?;
            }
            wire::finish_fpdu(out, start, crc).map_err(|_| WcStatus::LocLenErr)?;
            self.dev.counters.tx_fpdus.fetch_add(1, Ordering::Relaxed);
            off += n;
            if off >= total {
                return Ok(());
            }
            if out.len() >= TX_BATCH {
                flush(out);
            }
        }
    }

    /// Complete finished send-queue requests from the front, in order.
    pub(super) fn complete_in_order(&self, st: &mut State) {
        while st.inflight.front().is_some_and(|f| f.sent && f.done) {
            let Some(f) = st.inflight.pop_front() else {
                break;
            };
            if f.wqe.signaled() {
                // Every request was held to at most u32::MAX bytes before it was sent.
                let len = u32::try_from(f.wqe.total_len()).unwrap_or(u32::MAX);
                self.post_cqe(st, true, self.base.cqe(&f.wqe, WcStatus::Success, len));
            }
        }
    }
}
// A WQE is moved once per request; boxing it would add an allocation to the data path.
#[allow(clippy::large_enum_variant)]
pub(super) enum Work {
    Idle,
    /// The orderly close: a FIN once everything before it is out.
    Finish,
    /// A Terminate.
    Raw(Vec<u8>),
    Response {
        rr: ReadRequest,
        crc: bool,
        mtu: usize,
    },
    Request {
        wqe: Wqe,
        crc: bool,
        mtu: usize,
        msn: u32,
    },
}
