//! The way into Error: a Terminate for a locally detected protocol error (RFC 5040
//! §7), and the flush of both queues that every path into Error ends with.

use super::state::TermTx;
use super::*;
use crate::wire::{ddp, Header, Model, Opcode};

impl SiwQp {
    /// Move to Error: flush the send and receive queues with `WrFlushErr`. A request
    /// the transmitter is still writing, and everything behind it in the send queue,
    /// waits: the transmitter settles it (sent, or failed) and flushes again, so
    /// completions stay in order and nothing sent is reported as flushed.
    pub(super) fn to_error(&self, st: &mut State) {
        self.set_state(st, QpState::Error);
        self.cv.notify_all();
        st.orq.clear();
        st.responses.clear();
        let mut sq_flushed = true;
        while let Some(f) = st.inflight.front() {
            if !f.sent {
                sq_flushed = false;
                break;
            }
            let Some(f) = st.inflight.pop_front() else {
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
                self.post_cqe(st, true, self.base.cqe(&f.wqe, status, len));
            }
        }
        if sq_flushed {
            self.base.flush_send(|c| self.post_cqe(st, true, c));
        }
        let current = st.cur_recv.take().map(|r| r.wqe);
        self.base
            .flush_recv(current, |c| self.post_cqe(st, false, c));
    }

    /// A protocol error detected locally: queue a Terminate, go to Error, tell the consumer.
    pub(super) fn fail(&self, code: TermCode, hdr: Option<&[u8]>) {
        let mut st = self.st.lock();
        if st.qp == QpState::Error {
            return;
        }
        rnicpi::warn_limited!(
            qpn = self.base.qpn,
            layer = code.layer,
            etype = code.etype,
            ecode = code.ecode,
            "siw QP terminating"
        );
        self.terminate_locked(&mut st, code, hdr);
        drop(st);
        let kind = match code.etype {
            term::RDMAP_REMOTE_PROT if code.layer == term::LAYER_RDMAP => EventKind::QpAccessError,
            _ if code.layer == term::LAYER_DDP && code.etype == term::DDP_TAGGED_BUF => {
                EventKind::QpAccessError
            }
            _ => EventKind::QpFatal,
        };
        self.base
            .sink
            .deliver(Event::new(kind).with_status(libc::EPROTO));
        self.cv.notify_all();
    }

    /// Queue a Terminate with `code` (and the offending DDP header) for the tx thread to
    /// send as the connection's last FPDU, and move to Error.
    pub(super) fn terminate_locked(&self, st: &mut State, code: TermCode, hdr: Option<&[u8]>) {
        if st.conn.has_stream() {
            self.dev
                .counters
                .terminates_sent
                .fetch_add(1, Ordering::Relaxed);
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
            let _ = wire::finish_fpdu(&mut t, start, st.crc);
            st.term = TermTx::Queued(t);
        }
        self.to_error(st);
    }
}
