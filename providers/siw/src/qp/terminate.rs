//! The way into Error: a Terminate for a locally detected protocol error (RFC 5040
//! §7), and the flush of both queues that every path into Error ends with.

use super::state::{Env, State, TermTx};
use super::*;
use crate::wire::{ddp, Header, Model, Opcode};

impl State {
    /// Move to Error: flush the send and receive queues with `WrFlushErr`. A request
    /// the transmitter is still writing, and everything behind it in the send queue,
    /// waits: the transmitter settles it (sent, or failed) and flushes again, so
    /// completions stay in order and nothing sent is reported as flushed.
    pub(super) fn enter_error(&mut self, env: &Env) {
        self.set_state(QpState::Error);
        self.wake = true;
        self.orq.clear();
        self.responses.clear();
        let mut sq_flushed = true;
        while let Some(f) = self.inflight.front() {
            if !f.sent {
                sq_flushed = false;
                break;
            }
            let Some(f) = self.inflight.pop_front() else {
                break;
            };
            let status = if f.done {
                WcStatus::Success
            } else {
                WcStatus::WrFlushErr
            };
            if f.wqe.signaled() || status != WcStatus::Success {
                let len = if f.done {
                    u32::try_from(f.wqe.total_len()).unwrap_or(u32::MAX)
                } else {
                    0
                };
                self.post_cqe(true, env.base.cqe(&f.wqe, status, len));
            }
        }
        if sq_flushed {
            env.base.flush_send(|c| self.post_cqe(true, c));
        }
        let current = self.cur_recv.take().map(|r| r.wqe);
        if let Some(ev) = env
            .base
            .flush_recv_deferred(current, |c| self.post_cqe(false, c))
        {
            self.event(ev);
        }
    }

    /// A protocol error detected locally: queue a Terminate, go to Error, tell the consumer.
    pub(super) fn fail(&mut self, env: &Env, code: TermCode, hdr: Option<&[u8]>) {
        if self.qp == QpState::Error {
            return;
        }
        rnicpi::warn_limited!(
            qpn = self.qpn,
            layer = code.layer,
            etype = code.etype,
            ecode = code.ecode,
            "siw QP terminating"
        );
        self.terminate(env, code, hdr);
        let kind = match code.etype {
            term::RDMAP_REMOTE_PROT if code.layer == term::LAYER_RDMAP => EventKind::QpAccessError,
            _ if code.layer == term::LAYER_DDP && code.etype == term::DDP_TAGGED_BUF => {
                EventKind::QpAccessError
            }
            _ => EventKind::QpFatal,
        };
        self.event(Event::new(kind).with_status(libc::EPROTO));
        self.wake = true;
    }

    /// The driver lost a completion of this QP (its CQ is full, or its ring corrupt):
    /// the QP can no longer report its work, so it goes to Error with a Terminate and
    /// `QpFatal` (as kernel siw does).
    pub(super) fn cq_lost(&mut self, env: &Env) {
        if self.qp != QpState::Error {
            rnicpi::warn_limited!(qpn = self.qpn, "siw QP lost a completion: CQ overflow");
            self.terminate(env, CQ_OVERFLOW, None);
            self.event(Event::new(EventKind::QpFatal).with_status(libc::EOVERFLOW));
        }
    }

    /// The consumer corrupted the index of one of the QP's rings: the QP is in Error
    /// already; count it and tell the consumer.
    pub(super) fn ring_corrupt(&mut self, env: &Env, which: &'static str) {
        RingStats::count(&env.base.stats.wq_corrupt);
        rnicpi::warn_limited!(
            qpn = self.qpn,
            which,
            "siw ring indices corrupt: QP in error"
        );
        self.event(Event::new(EventKind::QpFatal).with_status(libc::EIO));
    }

    /// Queue a Terminate with `code` (and the offending DDP header) for the tx thread to
    /// send as the connection's last FPDU, and move to Error.
    pub(super) fn terminate(&mut self, env: &Env, code: TermCode, hdr: Option<&[u8]>) {
        if self.conn.has_stream() {
            env.counters.terminates_sent.fetch_add(1, Ordering::Relaxed);
            let mut t = Vec::with_capacity(64);
            let start = wire::begin_fpdu(&mut t);
            let h = Header {
                opcode: Opcode::Terminate,
                last: true,
                model: Model::Untagged {
                    inv_stag: 0,
                    qn: wire::QN_TERMINATE,
                    msn: 1,
                    mo: 0,
                },
            };
            h.emit(wire::grow(&mut t, h.buffer_len()));
            let ctrl = term::Repr {
                code,
                ddp_hdr: hdr.is_some(),
                ..term::Repr::default()
            };
            ctrl.emit(&mut term::Packet::new_unchecked(wire::grow(
                &mut t,
                ctrl.buffer_len(),
            )));
            if let Some(h) = hdr {
                t.extend_from_slice(&h[..h.len().min(ddp::UNTAGGED_HEADER_LEN)]);
            }
            let _ = wire::finish_fpdu(&mut t, start, self.crc);
            self.term = TermTx::Queued(t);
        }
        self.enter_error(env);
    }
}
