//! The protocol core of a QP, held under its `st` lock: its state, what it takes from
//! the device for the length of one call ([`Env`]), and what it leaves for its driver
//! ([`Output`]).

use super::requester::TxCursor;
use crate::device::Counters;
use crate::orq::Orq;
use crate::wire::{term, ReadRequest, TermCode};
use rnicpi::soft::QpBase;
use rnicpi::{Cqe, Event, MrTable, QpAttr, QpState, Wqe};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What the core borrows from its device and QP for one call: the rings (posted work
/// in, flushed work out), the registrations it places into and gathers from, and the
/// counters. Never the CQs, the event sink or the stream: those are the driver's.
pub(super) struct Env<'a> {
    pub(super) base: &'a QpBase,
    pub(super) mrs: &'a MrTable,
    pub(super) counters: &'a Counters,
}

/// What the core leaves for its driver to do once the state lock is released, in order:
/// a completion to write to the send (`send`) or receive CQ, or an event for the
/// consumer.
#[derive(Debug)]
pub(super) enum Output {
    Cqe { send: bool, cqe: Cqe },
    Event(Event),
}

/// A send-queue request taken from the ring, until it completes.
pub(super) struct Inflight {
    pub(super) wqe: Wqe,
    /// Every byte of its request is with the LLP. A close never flushes such a request
    /// as if it had not been sent, and it flushes nothing behind one still being
    /// written: the transmitter settles it first.
    pub(super) sent: bool,
    /// Finished: sent (Send, Write, local operations) or answered in full (Read).
    pub(super) done: bool,
}

/// The inbound Send message being placed into a posted receive.
pub(super) struct RecvInProgress {
    pub(super) wqe: Wqe,
    pub(super) received: u32,
    pub(super) total: u64,
}

/// The next message offset after `len` more bytes of a Send at `mo`, checked against
/// the receive's size and the 32-bit message offsets and byte counts of the wire and
/// the completion (a message is at most `u32::MAX` bytes).
pub(super) fn next_offset(rip: &RecvInProgress, mo: u32, len: usize) -> Result<u32, TermCode> {
    let untagged = |ecode| TermCode {
        layer: term::LAYER_DDP,
        etype: term::DDP_UNTAGGED_BUF,
        ecode,
    };
    if mo != rip.received {
        return Err(untagged(term::DDP_UNTAGGED_INV_MO));
    }
    let end = (mo as u64).saturating_add(len as u64);
    if end > rip.total || end > u32::MAX as u64 {
        return Err(untagged(term::DDP_UNTAGGED_TOO_LONG));
    }
    Ok(end as u32)
}

pub(super) struct State {
    pub(super) qpn: u32,
    /// The verbs state the consumer sees.
    pub(super) qp: QpState,
    /// The life of the connection under it.
    pub(super) conn: Conn,
    pub(super) attr: QpAttr,
    pub(super) crc: bool,
    pub(super) ird: u32,
    pub(super) ord: u32,
    pub(super) max_ulpdu: usize,
    pub(super) inflight: VecDeque<Inflight>,
    pub(super) orq: Orq,
    pub(super) tx_msn_send: u32,
    pub(super) tx_msn_read: u32,
    pub(super) rx_msn_send: u32,
    pub(super) rx_msn_read: u32,
    pub(super) responses: VecDeque<ReadRequest>,
    /// Read Responses being transmitted: they hold their IRD slot until fully sent.
    pub(super) responding: u32,
    pub(super) cur_recv: Option<RecvInProgress>,
    pub(super) term: TermTx,
    /// The tx thread has work (the doorbell, a Read Request, a freed ORD slot).
    pub(super) kick: bool,
    /// The message being transmitted, as far as it has gone out.
    pub(super) tx_cur: Option<TxCursor>,
    /// Completions and events for the driver, oldest first.
    pub(super) out: VecDeque<Output>,
    /// The tx thread should look at the state again (its condition variable).
    pub(super) wake: bool,
}

impl State {
    pub(super) fn set_state(&mut self, to: QpState) {
        if self.qp != to {
            tracing::debug!(qpn = self.qpn, from = ?self.qp, ?to, "siw QP state");
            self.qp = to;
        }
    }

    pub(super) fn set_conn(&mut self, to: Conn) {
        if self.conn != to {
            tracing::debug!(qpn = self.qpn, from = ?self.conn, ?to, "siw connection state");
            self.conn = to;
        }
    }

    /// A completion for the driver to write.
    pub(super) fn post_cqe(&mut self, send: bool, cqe: Cqe) {
        self.out.push_back(Output::Cqe { send, cqe });
    }

    /// An event for the driver to deliver.
    pub(super) fn event(&mut self, ev: Event) {
        self.out.push_back(Output::Event(ev));
    }

    /// Work for the tx thread.
    pub(super) fn kick(&mut self) {
        self.kick = true;
        self.wake = true;
    }

    /// Nothing the tx thread does waits for the Responder's hold: a Terminate, a close
    /// or a QP out of RTS.
    fn tx_busy(&self) -> bool {
        self.term.pending() || self.conn.winding_down() || self.qp != QpState::Rts
    }

    /// The core's next deadline: the end of the hold on our first FPDU.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        self.conn.hold().filter(|_| !self.tx_busy())
    }

    /// The clock reached `now`: a hold whose time is up ends. True when it did (our
    /// first FPDU may go).
    pub(super) fn handle_timeout(&mut self, now: Instant) -> bool {
        if self.poll_timeout().is_some_and(|t| now >= t) {
            self.conn = Conn::Up { hold_until: None };
            tracing::debug!(qpn = self.qpn, "siw responder wait over");
            return true;
        }
        false
    }

    /// The tx thread has something to do now (no hold in the way).
    pub(super) fn tx_ready(&self) -> bool {
        self.poll_timeout().is_none() && (self.kick || self.tx_busy() || !self.responses.is_empty())
    }
}

/// The life of a QP's connection (its LLP stream), beside the verbs state: Linux siw's
/// `siw_qp_state` (IDLE, RTS, CLOSING, TERMINATE, ERROR) made explicit, with the facts
/// each state needs in it.
///
/// ```text
/// Idle ─connect→ Connecting ─(CM attaches a stream)→ Up ─disconnect──→ Closing{local}
///   │  ←─(connect failed)─┘                           │ ─our Terminate→ Closing{!local}
///   └────────────────(passive side: accept)──────────→┤ ─abort/destroy→ Aborted
///                                   Closing ─(send queue drained, FIN)→ FinSent
///               Up, Closing, FinSent, Aborted ─(stream ends or fails)→ Closed
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Conn {
    /// No stream yet.
    Idle,
    /// An active connect (TCP + MPA) is under way in the CM reactor.
    Connecting,
    /// Streaming. Our first FPDU waits until `hold_until` or an FPDU from the peer,
    /// whichever comes first (see [`RESPONDER_WAIT`] and [`INITIATOR_PAUSE`]).
    Up { hold_until: Option<Instant> },
    /// Going down in order: the FIN follows the last request (a local disconnect) or
    /// our Terminate. `local`: the consumer asked (it is told `Disconnected`, not
    /// `ConnectionBroken`).
    Closing { local: bool },
    /// The FIN is written; the stream's end is awaited.
    FinSent { local: bool },
    /// A local abortive close reset the stream; its threads are seeing it.
    Aborted,
    /// The stream is gone and the consumer was told (or destroyed the QP: nothing to tell).
    Closed,
}

impl Conn {
    /// A stream is attached and has not ended.
    pub(super) fn has_stream(self) -> bool {
        matches!(
            self,
            Conn::Up { .. } | Conn::Closing { .. } | Conn::FinSent { .. } | Conn::Aborted
        )
    }

    /// An orderly close is under way or done.
    pub(super) fn winding_down(self) -> bool {
        matches!(self, Conn::Closing { .. } | Conn::FinSent { .. })
    }

    /// The consumer closed it (a local disconnect, abort or destroy).
    pub(super) fn closed_locally(self) -> bool {
        matches!(
            self,
            Conn::Closing { local: true } | Conn::FinSent { local: true } | Conn::Aborted
        )
    }

    /// The Responder's hold on its first FPDU, while it lasts.
    pub(super) fn hold(self) -> Option<Instant> {
        match self {
            Conn::Up { hold_until } => hold_until,
            _ => None,
        }
    }

    /// The orderly close's FIN has gone out.
    pub(super) fn fin_written(self) -> Conn {
        match self {
            Conn::Closing { local } | Conn::FinSent { local } => Conn::FinSent { local },
            Conn::Up { .. } => Conn::FinSent { local: false },
            other => other,
        }
    }
}

/// The Terminate of this connection on its way out.
#[derive(Debug, Default)]
pub(super) enum TermTx {
    #[default]
    None,
    /// Built, for the transmitter to send as the stream's last FPDU.
    Queued(Vec<u8>),
    /// Taken by the transmitter, being written.
    Writing,
}

impl TermTx {
    /// The queued Terminate, now being written.
    pub(super) fn start_writing(&mut self) -> Option<Vec<u8>> {
        match std::mem::take(self) {
            TermTx::Queued(t) => {
                *self = TermTx::Writing;
                Some(t)
            }
            other => {
                *self = other;
                None
            }
        }
    }

    /// A Terminate is queued or being written.
    pub(super) fn pending(&self) -> bool {
        !matches!(self, TermTx::None)
    }
}

/// How long an MPA Responder holds its first FPDU for the Initiator's. RFC 5044 makes
/// the Responder wait for it; an Initiator whose consumer waits for the Responder to
/// speak first would then wait for ever unless both sides negotiate RFC 6581's
/// ready-to-receive message, which krdma does not yet: the wait is bounded instead.
/// Kernel siw as Initiator resets the connection when an FPDU is already in its socket
/// as it reads the Reply; it has read it well within this time.
pub(super) const RESPONDER_WAIT: Duration = Duration::from_millis(50);

/// How long an MPA Initiator pauses after the Reply before its first FPDU. RFC 5044 lets
/// it send at once, but Linux siw as Responder sends its Reply before it hands the socket
/// from its connection manager to the QP, and an FPDU that arrives in between wakes
/// nobody: the peer's QP never sees it until more data comes (seen against kernel 6.1 in
/// an emulated guest, with the first FPDU 0.4 ms after the Reply). The pause costs each
/// active connect this much once.
pub(super) const INITIATOR_PAUSE: Duration = Duration::from_millis(3);

#[cfg(test)]
mod tests {
    use super::*;

    fn receiving(received: u32, total: u64) -> RecvInProgress {
        RecvInProgress {
            wqe: Wqe::default(),
            received,
            total,
        }
    }

    #[test]
    fn message_offsets_and_byte_counts_never_overflow() {
        // A receive larger than 4 GiB: the message still ends at u32::MAX bytes, what
        // the 32-bit message offset and the completion's byte count can say.
        let r = receiving(u32::MAX - 10, 8 << 30);
        assert_eq!(next_offset(&r, u32::MAX - 10, 10), Ok(u32::MAX));
        assert_eq!(
            next_offset(&r, u32::MAX - 10, 11).map_err(|c| c.ecode),
            Err(term::DDP_UNTAGGED_TOO_LONG)
        );
        assert_eq!(
            next_offset(&r, u32::MAX - 10, usize::MAX).map_err(|c| c.ecode),
            Err(term::DDP_UNTAGGED_TOO_LONG)
        );
        // The offset must be where the message stands, and the receive must hold it.
        assert_eq!(
            next_offset(&r, 0, 1).map_err(|c| c.ecode),
            Err(term::DDP_UNTAGGED_INV_MO)
        );
        let small = receiving(10, 16);
        assert_eq!(next_offset(&small, 10, 6), Ok(16));
        assert_eq!(
            next_offset(&small, 10, 7).map_err(|c| c.ecode),
            Err(term::DDP_UNTAGGED_TOO_LONG)
        );
    }
}
