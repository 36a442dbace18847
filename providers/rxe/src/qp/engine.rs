//! The QP's protocol core without I/O: [`Engine`] is what one call into it borrows (the
//! time, the consumer's rings, the registrations, the counters), and [`Outputs`] is what
//! it leaves behind in the QP's state for its driver ([`super::RxeQp::with_state`]) to do
//! once the lock is released: datagrams to send, completions and events to deliver in
//! the order they were produced, and the deadline its timer wants. Its inputs are a
//! packet ([`Engine::on_packet`]), the consumer's posted work and the transmit budget
//! ([`Engine::transmit`]), and a timer entry coming due ([`Engine::on_timer`]); the
//! requester, completer and responder are further `impl Engine` blocks.

use super::{Av, State};
use crate::ah::AhTable;
use crate::device::Counters;
use crate::net::Datagram;
use crate::wire::{self, RoceRepr};
use rnicpi::soft::QpBase;
use rnicpi::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Packets a transmit step sends before yielding to other QPs; producers stop while this
/// many wait to be sent.
pub(super) const TX_BUDGET: u32 = 64;

/// A datagram the engine produced, waiting to be handed to the wire.
pub(crate) struct Outgoing {
    pub av: Av,
    /// BTH .. ICRC slot (the wire fills the ICRC in).
    pub roce: Vec<u8>,
    /// A positive acknowledgement and nothing else: it may wait for the consumer's next
    /// call when a polling consumer's thread made it, and a later one replaces it
    /// ([`super::RxeQp::with_state`]).
    pub plain_ack: bool,
}

/// A completion or an event for the consumer.
pub(crate) enum Effect {
    /// For the send CQ (`send`) or the receive CQ.
    Cqe {
        send: bool,
        cqe: Cqe,
    },
    Event(Event),
}

/// What the engine produced under the lock and its driver has not done yet.
#[derive(Default)]
pub(crate) struct Outputs {
    /// Datagrams, oldest first (the wire must see them in this order: PSN order).
    pub datagrams: Vec<Outgoing>,
    /// Completions and events, oldest first (a CQE never overtakes an earlier one).
    pub effects: Vec<Effect>,
    /// A timer-heap entry the QP needs: its earliest, when the call lowered it.
    pub deadline: Option<Instant>,
}

/// The engine of one QP for one call: everything it may touch besides its [`State`].
/// Posted work and receives come from the rings in `base` (the engine takes them; it
/// never writes a CQ or delivers an event itself), memory is placed and read through
/// the registrations in `mrs`, and `now` is the only clock it reads.
pub(crate) struct Engine<'a> {
    pub now: Instant,
    /// The QP's service: RC, UC or UD (which engine runs, and what it leaves out).
    pub service: QpType,
    pub base: &'a QpBase,
    pub mrs: &'a MrTable,
    /// Address handles, for UD Sends.
    pub ahs: &'a AhTable,
    pub counters: &'a Counters,
}

impl Engine<'_> {
    /// An unreliable-datagram QP.
    pub(crate) fn ud(&self) -> bool {
        self.service == QpType::Ud
    }

    /// An unreliable-connected QP: no acknowledgements either way.
    pub(crate) fn uc(&self) -> bool {
        self.service == QpType::Uc
    }

    pub(crate) fn count(&self, c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn set_state(&self, st: &mut State, to: QpState) {
        if st.qp != to {
            tracing::debug!(qpn = self.base.qpn, from = ?st.qp, ?to, "rxe QP state");
            st.qp = to;
        }
    }

    // ---- inputs -----------------------------------------------------------------------

    /// One verified packet from `src` addressed to this QP; whether transmission should
    /// go on past the inline budget (the transmit thread's part).
    pub(super) fn on_packet(&self, st: &mut State, d: &Datagram<'_>, p: &RoceRepr<'_>) -> bool {
        if self.ud() {
            self.ud_receive(st, d.src, d.dst, p);
            return false;
        }
        let src = d.src;
        if st.av.is_some_and(|av| av.dst != src) {
            self.count(&self.counters.rx_wrong_source);
            return false;
        }
        let transport = match self.uc() {
            true => wire::Transport::Uc,
            false => wire::Transport::Rc,
        };
        if p.bth.opcode.transport() != transport {
            self.count(&self.counters.rx_malformed);
            return false;
        }
        let ready = match p.bth.opcode.direction() {
            wire::Direction::Request => {
                if !matches!(st.qp, QpState::Rtr | QpState::Rts | QpState::Sqd) {
                    self.count(&self.counters.rx_dropped_state);
                    return false;
                }
                if self.uc() {
                    self.on_uc_request(st, p);
                    return false;
                }
                self.on_request(st, p)
            }
            wire::Direction::Response => {
                if !matches!(st.qp, QpState::Rts | QpState::Sqd) {
                    self.count(&self.counters.rx_dropped_state);
                    return false;
                }
                self.on_response(st, p)
            }
        };
        // What the packet made ready (an ACK, a Read response, the next window of
        // requests) goes out from this thread once it leaves the lock; only a remainder
        // waits for the transmit thread, which saves a thread wake-up per message.
        let mut budget = super::INLINE_BUDGET;
        ready && self.transmit(st, &mut budget)
    }

    /// Send what is ready, responder output first; true when work is left over. Nothing
    /// while a transmit step's worth of datagrams waits to be sent: its sender asks for a
    /// transmit step once it has sent them.
    pub(super) fn transmit(&self, st: &mut State, budget: &mut u32) -> bool {
        if st.out.datagrams.len() >= TX_BUDGET as usize {
            st.resume = true;
            return false;
        }
        if self.ud() {
            return self.ud_pump(st, budget);
        }
        let more = self.send_read_responses(st, budget);
        more | self.pump(st, budget)
    }

    /// A heap entry of this QP queued for `fired` came due; whether the transmit side
    /// should run (a timeout rewound the requester).
    pub(super) fn on_timer(&self, st: &mut State, fired: Instant) -> bool {
        if st.timer_queued == Some(fired) {
            st.timer_queued = None;
        }
        match st.timer_at {
            None => return false,
            Some(at) if at > self.now => {
                self.queue_timer(st, at);
                return false;
            }
            Some(_) => {}
        }
        st.timer_at = None;
        self.requester_timeout(st);
        true
    }

    // ---- timers -----------------------------------------------------------------------

    pub(crate) fn arm_timer(&self, st: &mut State, after: Duration) {
        let at = self.now + after;
        st.timer_at = Some(at);
        self.queue_timer(st, at);
    }

    /// Ask for a heap entry at `at` unless one at or before it is queued: each request
    /// lowers the deadline, so the last one a call makes is its earliest.
    fn queue_timer(&self, st: &mut State, at: Instant) {
        if st.timer_queued.is_none_or(|q| at < q) {
            st.timer_queued = Some(at);
            st.out.deadline = Some(at);
        }
    }

    pub(crate) fn stop_timer(&self, st: &mut State) {
        st.timer_at = None;
    }

    /// The local ACK timeout of the QP: 4.096 µs × 2^timeout (0 = wait forever).
    pub(crate) fn ack_timeout(st: &State) -> Option<Duration> {
        match st.attr.timeout {
            0 => None,
            t => Some(Duration::from_nanos(4096u64 << t.min(31)).max(Duration::from_millis(1))),
        }
    }

    // ---- outputs ----------------------------------------------------------------------

    /// Queue one packet to the QP's peer; it is sent when the lock is released.
    pub(crate) fn send_packet(&self, st: &mut State, repr: &RoceRepr<'_>) {
        if let Some(av) = st.av {
            self.send_packet_to(st, av, repr);
        }
    }

    /// Queue an acknowledgement packet; a positive one (`plain`) is marked so its driver
    /// may hold it back for a polling consumer's next call ([`Outgoing::plain_ack`]).
    pub(crate) fn send_ack_packet(&self, st: &mut State, repr: &RoceRepr<'_>, plain: bool) {
        let queued = st.out.datagrams.len();
        self.send_packet(st, repr);
        if st.out.datagrams.len() > queued {
            if let Some(d) = st.out.datagrams.last_mut() {
                d.plain_ack = plain;
            }
        }
    }

    /// Queue one packet to `av`.
    pub(crate) fn send_packet_to(&self, st: &mut State, av: Av, repr: &RoceRepr<'_>) {
        match repr.to_vec() {
            Ok(roce) => Self::queue_packet_to(st, av, roce),
            Err(e) => tracing::warn!(qpn = self.base.qpn, error = %e, "rxe: cannot emit packet"),
        }
    }

    /// Queue a packet made by [`Engine::packet_with`] to `av`.
    pub(crate) fn queue_packet_to(st: &mut State, av: Av, roce: Vec<u8>) {
        st.out.datagrams.push(Outgoing {
            av,
            roce,
            plain_ack: false,
        });
    }

    /// A packet of `repr`'s headers around the `n` payload bytes `payload` appends to
    /// the buffer it is handed (which then holds the headers' room): the sender gathers
    /// the payload from memory straight into the packet, with no copy between and no
    /// zero fill before, then queues it ([`Engine::queue_packet`]). `Ok(None)` (logged)
    /// when the headers do not fit the opcode; `Err` is `payload`'s own.
    pub(crate) fn packet_with<E>(
        &self,
        repr: &RoceRepr<'_>,
        n: usize,
        payload: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
    ) -> Result<Option<Vec<u8>>, E> {
        let len = repr.buffer_len_for(n);
        let at = repr.payload_range(n).start;
        let mut roce = Vec::with_capacity(len);
        roce.resize(at, 0);
        payload(&mut roce)?;
        debug_assert_eq!(roce.len(), at + n, "the payload appended is n bytes");
        roce.resize(len, 0);
        match repr.emit_around(&mut roce, n) {
            Ok(_) => Ok(Some(roce)),
            Err(e) => {
                tracing::warn!(qpn = self.base.qpn, error = %e, "rxe: cannot emit packet");
                Ok(None)
            }
        }
    }

    /// Queue a packet made by [`Engine::packet_with`] to the QP's peer.
    pub(crate) fn queue_packet(&self, st: &mut State, roce: Vec<u8>) {
        if let Some(av) = st.av {
            Self::queue_packet_to(st, av, roce);
        }
    }

    pub(crate) fn bth(&self, st: &State, opcode: wire::Opcode, psn: u32) -> wire::BthRepr {
        wire::BthRepr::new(opcode, st.attr.dest_qpn, psn)
    }

    /// Queue a completion for the send CQ (`send`) or the receive CQ.
    pub(crate) fn post_cqe(&self, st: &mut State, send: bool, cqe: Cqe) {
        st.out.effects.push(Effect::Cqe { send, cqe });
    }

    /// Queue an event for the consumer.
    pub(crate) fn deliver(&self, st: &mut State, event: Event) {
        st.out.effects.push(Effect::Event(event));
    }

    // ---- errors -----------------------------------------------------------------------

    /// Move to Error: flush both queues with `WrFlushErr` (an SRQ's receives stay).
    pub(crate) fn to_error(&self, st: &mut State) {
        if st.qp == QpState::Error {
            return;
        }
        self.set_state(st, QpState::Error);
        self.stop_timer(st);
        for w in st.req.drain() {
            let status = match w.status {
                Some(s) => s,
                None if w.done => WcStatus::Success,
                None => WcStatus::WrFlushErr,
            };
            if w.wqe.signaled() || status != WcStatus::Success {
                let cqe = self.base.cqe(&w.wqe, status, 0);
                self.post_cqe(st, true, cqe);
            }
        }
        self.flush_rings(st);
        st.resp.clear();
    }

    /// Complete everything queued in the consumer's rings now as flushed (QP in Error):
    /// a fixed range, so a consumer that keeps refilling a ring gets the rest flushed at
    /// its next doorbell, never an endless loop here.
    pub(super) fn flush_rings(&self, st: &mut State) {
        let out = &mut st.out.effects;
        self.base
            .flush_send(|cqe| out.push(Effect::Cqe { send: true, cqe }));
        let current = st.resp.take_current_recv();
        let last = self
            .base
            .flush_recv_deferred(current, |cqe| out.push(Effect::Cqe { send: false, cqe }));
        out.extend(last.map(Effect::Event));
    }

    /// A fatal transport error: report it and go to Error.
    pub(crate) fn fatal(&self, st: &mut State, kind: EventKind, why: &str) {
        if st.qp == QpState::Error {
            return;
        }
        tracing::warn!(qpn = self.base.qpn, ?kind, why, "rxe QP error");
        self.to_error(st);
        self.deliver(st, Event::new(kind).with_status(libc::EIO));
    }

    /// The peer stopped answering (transport retries exhausted): a dead peer, which a
    /// connected consumer hears of as a broken connection (once, as for a close).
    pub(crate) fn peer_lost(&self, st: &mut State) {
        if !std::mem::replace(&mut st.closed_reported, true) {
            let e = Event::new(EventKind::ConnectionBroken).with_status(libc::ETIMEDOUT);
            self.deliver(st, e);
        }
    }

    /// The next posted receive ([`QpBase::take_recv`]); a corrupt receive ring is also
    /// logged here (the caller fails the QP).
    pub(crate) fn take_recv(&self) -> Result<Option<Wqe>, RingCorrupt> {
        self.base.take_recv().inspect_err(|_| {
            rnicpi::warn_limited!(qpn = self.base.qpn, "rxe receive ring indices corrupt");
        })
    }
}
