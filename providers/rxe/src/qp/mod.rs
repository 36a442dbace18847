//! The rxe queue pair: verbs state machine, address vector, and the three halves of the
//! RC transport, split as Linux's rxe splits them — requester ([`requester`]: send queue →
//! request packets), completer ([`completer`]: ACKs, NAKs, read responses and atomic ACKs →
//! completions, retransmission) and responder ([`responder`]: request packets → placements,
//! receive completions, ACKs, read responses, atomic results). Those three are the protocol
//! core ([`engine::Engine`]): fed a packet, posted work or a timer expiry with the time,
//! it returns what it wants done instead of doing it.
//!
//! This file is the core's driver. One mutex holds the protocol state; it is taken by the
//! receive thread (one packet at a time), the transmit thread (a paced burst of packets),
//! the timer thread and the consumer's verbs. Nothing the core produced is done under it:
//! datagrams, completions and events wait in the state's outputs and are applied once the
//! lock is released, in the order they were produced, and the timer heap is armed from
//! the deadline the call returned (see [`RxeQp::with_state`]).

mod completer;
mod datagram;
mod engine;
mod requester;
mod responder;

use crate::device::Shared;
use crate::net::{Datagram, Packet};
use crate::timer::Target;
use crate::wire::{self, RoceRepr};
use engine::{Effect, Engine, Outputs, TX_BUDGET};
use parking_lot::{Condvar, Mutex, MutexGuard};
use requester::Requester;
use responder::Responder;
use rnicpi::soft::QpBase;
use rnicpi::*;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// Where the QP's packets go: the address vector resolved at RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Av {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// UDP source port (entropy, from the flow label or the QP numbers).
    pub sport: u16,
}

/// The right to apply a QP's outputs ([`RxeQp::with_state`]), given back when dropped
/// (with the state locked again), even if a send panicked: else the QP would never send
/// again.
struct Sender<'a, 'b>(&'a mut MutexGuard<'b, State>);

impl<'a, 'b> Sender<'a, 'b> {
    fn take(st: &'a mut MutexGuard<'b, State>) -> Self {
        st.sending = true;
        Sender(st)
    }
}

impl Drop for Sender<'_, '_> {
    fn drop(&mut self) {
        self.0.sending = false;
    }
}

/// Who calls into the engine, which decides whether the call waits for completions and
/// events it produced while another thread holds the send token.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Caller {
    /// A device thread (receive, transmit, timer): never waits; the token's holder
    /// delivers what it produced.
    Device,
    /// A consumer polling a CQ in embedded mode, receiving for the device
    /// ([`crate::receive`]): as a device thread, except that positive acknowledgements it
    /// produced wait for that consumer's next call (see [`RxeQp::with_state`]).
    Polled,
    /// The consumer or the connection manager (Modify QP, a doorbell, destroy, a close):
    /// returns with its completions on the CQ and its events delivered, as a verb should.
    Verb,
    /// The connection manager moving the QP to Error before it sends a DREQ: as a verb,
    /// and it waits for a token holder at work even when it produced nothing itself, so
    /// every datagram the QP produced before (the ACK of a message whose completion the
    /// consumer may already have seen and answered by closing) is on the wire ahead of the
    /// DREQ. Without this the peer could take the DREQ first and flush a Send that was
    /// delivered (dapltest's performance client saw its last Send fail this way).
    Close,
}

/// Packets in flight a requester allows before waiting for an acknowledgement (Linux rxe
/// allows 128). 256 is sixteen 64 KiB messages at a 4096-byte MTU: with 128, Send of
/// 64 KiB messages on loopback, which waits for receive credits besides, ran at 10.3–11.3
/// Gbit/s, with 256 at 13.8–14.9 (RDMA Write and Read of 64 KiB 3–6 % lower, 1 MiB level;
/// docs/benchmarks.md, 2026-12-02). A loss halves it (`MIN_WINDOW` at least).
pub(crate) const WINDOW: u32 = 256;
/// Packets a transmit step makes under the lock before it sends them.
const TX_BATCH: u32 = 8;
/// Times the send token's holder takes the QP's outputs again (what others queued
/// meanwhile) before it leaves the rest to the transmit thread.
const DRAIN_ROUNDS: u32 = 4;
/// Packets a doorbell (or a received packet) sends inline in the caller's thread: a
/// 64 KiB message at a 4096-byte MTU. Handing the rest of a message to the transmit thread
/// costs a wake-up and the cache lines' trip to the other core: with 4 here, RDMA Write
/// of 64 KiB messages on loopback ran at 8–9 Gbit/s, with 16 at 12.8–13.3, for 5–10 % off
/// 1 MiB transfers (the thread that takes an ACK sends more of the window it reopens);
/// 32 cost Send of 1 MiB a quarter (docs/benchmarks.md, 2026-12-02).
const INLINE_BUDGET: u32 = 16;
/// A transmit step that made at least this many packets was part of a transfer: the
/// transmit thread then looks for more work a while before it sleeps.
pub(crate) const TX_BULK: u32 = TX_BATCH;
/// The largest message, as IBTA sets it (2^31 bytes): longer requests are refused both
/// ways, so a byte count always fits a completion and a Read never wraps the PSN space.
pub(crate) const MAX_MSG: u64 = 1 << 31;

/// A message's byte count as a completion carries it (messages are at most [`MAX_MSG`]).
pub(crate) fn byte_len(n: u64) -> u32 {
    u32::try_from(n.min(MAX_MSG)).unwrap_or(u32::MAX)
}

pub(crate) struct State {
    pub qp: QpState,
    pub attr: QpAttr,
    pub av: Option<Av>,
    pub mtu: u32,
    pub req: Requester,
    pub resp: Responder,
    /// When the QP's timer (retransmission or RNR back-off) is due, if it runs.
    pub timer_at: Option<Instant>,
    /// The earliest deadline this QP has in the device's timer heap (or asked for in
    /// `out.deadline`). Re-arming later than that (every acknowledgement does) asks for
    /// nothing: the queued entry finds the new deadline when it fires and queues itself
    /// again, so the timer thread wakes about once per timeout per QP, not once per
    /// message.
    pub timer_queued: Option<Instant>,
    /// The connection manager has told the consumer the connection ended.
    pub closed_reported: bool,
    /// What the engine produced and the driver has not done yet (datagrams, completions
    /// and events: empty while the lock is free, unless a token holder is at work).
    out: Outputs,
    /// A thread holds the send token: it applies the outputs, also those queued meanwhile.
    sending: bool,
    /// Production stopped for a full outbox: a transmit step is owed once it drains.
    resume: bool,
}

pub struct RxeQp {
    /// The rings, CQs, SRQ and sink the QP was created with.
    pub(crate) base: QpBase,
    /// The device's serial of this QP object: unlike its number, never reused.
    serial: u64,
    /// Its service type: reliable or unreliable connected, or unreliable datagram
    /// (`datagram`); the engine of each call is told it.
    service: QpType,
    pub(crate) dev: Arc<Shared>,
    st: Mutex<State>,
    /// Signalled when the send token is given back (a verb waits for it: [`Caller::Verb`]).
    token_free: Condvar,
    scheduled: AtomicBool,
    /// A doorbell the kAL's thread served sent to this host: the next ones are served
    /// with the receive thread hushed ([`RxeQp::doorbell_on_thread`]).
    peer_here: AtomicBool,
    me: Weak<RxeQp>,
}

impl RxeQp {
    pub(crate) fn new(dev: Arc<Shared>, qpn: u32, serial: u64, init: QpInit) -> Arc<RxeQp> {
        let attr = QpAttr {
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            ..QpAttr::default()
        };
        let service = init.qp_type;
        let qp = Arc::new_cyclic(|me| RxeQp {
            base: QpBase::new(qpn, init),
            serial,
            service,
            dev,
            st: Mutex::new(State {
                qp: QpState::Reset,
                attr,
                av: None,
                mtu: 1024,
                req: Requester::new(0, attr.retry_cnt, attr.rnr_retry),
                resp: Responder::new(0),
                timer_at: None,
                timer_queued: None,
                closed_reported: false,
                out: Outputs::default(),
                sending: false,
                resume: false,
            }),
            token_free: Condvar::new(),
            scheduled: AtomicBool::new(false),
            peer_here: AtomicBool::new(false),
            me: me.clone(),
        });
        // Consumers polling the QP's CQs in embedded mode may receive for the device.
        if let Some(r) = &qp.dev.receiver {
            let weak: Weak<crate::receive::Receiver> = Arc::downgrade(r);
            qp.base.drive_from_polls(weak);
        }
        qp
    }

    pub(crate) fn arc(&self) -> Option<Arc<RxeQp>> {
        self.me.upgrade()
    }

    /// `qp` as a QP of the device `dev` (the connection manager gets QPs as trait
    /// objects): `Invalid` for another provider's QP or another rxe device's.
    pub(crate) fn of(qp: &Arc<dyn ProviderQp>, dev: &Arc<Shared>) -> Result<Arc<RxeQp>> {
        qp.as_any()
            .downcast_ref::<RxeQp>()
            .and_then(RxeQp::arc)
            .filter(|q| Arc::ptr_eq(&q.dev, dev))
            .ok_or(VerbsError::Invalid)
    }

    /// This QP as the connection manager names it.
    pub(crate) fn cm_ref(&self) -> crate::cm::QpRef {
        crate::cm::QpRef {
            qpn: self.base.qpn,
            serial: self.serial,
            service: self.service,
        }
    }

    /// Claim the transmit-queue slot; false when the QP is already queued.
    pub(crate) fn mark_scheduled(&self) -> bool {
        !self.scheduled.swap(true, Ordering::AcqRel)
    }

    fn schedule(&self) {
        if let Some(me) = self.arc() {
            self.dev.schedule(&me);
        }
    }

    /// Run `f` on the QP's state with the engine of this call (the time now, the QP's
    /// rings, the device's registrations and counters), then apply what it produced,
    /// after the lock is released.
    ///
    /// Several threads produce for one QP (receive, transmit, timer, the consumer), and
    /// the wire must see the datagrams in the order they were produced (PSN order), a
    /// CQ the completions. One thread at a time applies the outputs (`State::sending`,
    /// the send token): it takes them all under the lock, applies them without the lock
    /// — completions and events first, then the datagrams — and looks again, so what
    /// others queued meanwhile follows in order; a device thread that finds the token
    /// taken leaves its outputs to the holder and goes on. No device thread ever waits
    /// for another's `sendmsg`, with or without the lock. A verb that produced
    /// completions or events waits for the token instead ([`Caller::Verb`]), so they are
    /// out when it returns. What one holder carries is bounded: producers stop while a
    /// transmit step's worth of datagrams waits ([`Engine::transmit`]), and after
    /// [`DRAIN_ROUNDS`] the holder hands the rest to the transmit thread.
    /// The timer deadline a call asks for is armed by the thread that made the call:
    /// the heap orders it by time, not by who arms it.
    ///
    /// (Two other designs keep the order: batches that take a ticket under the lock and
    /// wait for their turn, and a transmit mutex taken before the state lock is released.
    /// Both make a thread wait for another's `sendmsg`; on a 2-CPU host they made an
    /// 8-byte ping-pong mostly 17–18 µs one way instead of 5.)
    fn with_state<R>(&self, caller: Caller, f: impl FnOnce(&Engine, &mut State) -> R) -> R {
        let mut st = self.st.lock();
        let engine = Engine {
            now: self.dev.clock.now(),
            service: self.service,
            base: &self.base,
            mrs: &self.dev.res.mrs,
            ahs: &self.dev.ahs,
            counters: &self.dev.counters,
        };
        let r = f(&engine, &mut st);
        let deadline = st.out.deadline.take();
        let wait = match caller {
            Caller::Device | Caller::Polled => false,
            Caller::Verb => !st.out.effects.is_empty(),
            Caller::Close => true,
        };
        if wait {
            while st.sending {
                self.token_free.wait(&mut st);
            }
        }
        let hold = caller == Caller::Polled && !st.sending && self.hold_acks(&mut st);
        let owed = if st.sending || (st.out.datagrams.is_empty() && st.out.effects.is_empty()) {
            false
        } else {
            let held = self.apply(&mut st, hold);
            // What is still queued goes with the transmit step owed, or one started now.
            let left = st.out.datagrams.len() > held || !st.out.effects.is_empty();
            std::mem::take(&mut st.resume) || left
        };
        let held = hold && !st.out.datagrams.is_empty();
        drop(st);
        if let Some(at) = deadline {
            self.dev.timers.arm(Target::Qp(self.base.qpn), 0, at);
        }
        if held {
            self.hold_for_consumer();
        }
        if owed {
            self.schedule();
        }
        r
    }

    /// Whether what a polling consumer's delivery left queued is positive
    /// acknowledgements only, which then wait for its next call: the completion it is
    /// polling for reaches it without a `sendmsg` first, and the acknowledgement leaves
    /// with whatever it posts next in one batch (a ping-pong's reply), or at its next poll
    /// or when it arms the CQ, or when the receive thread takes over from consumers that
    /// stopped polling ([`crate::receive::HeldAcks`]) — the bound that already holds for
    /// the datagrams they receive. A peer's Send over RC costs one `sendmsg` and one
    /// receive less per message this way. Every AETH acknowledges all before it, so of
    /// several only the last is kept.
    fn hold_acks(&self, st: &mut State) -> bool {
        let queue = &mut st.out.datagrams;
        if queue.is_empty() || !queue.iter().all(|d| d.plain_ack) {
            return false;
        }
        let c = &self.dev.counters;
        let older = queue.len() - 1;
        if older > 0 {
            queue.drain(..older);
            c.acks_coalesced.fetch_add(older as u64, Ordering::Relaxed);
        }
        self.dev.count(&c.acks_held);
        true
    }

    /// List this QP with the device's held acknowledgements, which the receive side
    /// sends at the consumer's next call or when its thread takes over.
    fn hold_for_consumer(&self) {
        if let Some(me) = self.arc() {
            self.dev.held.hold(&me);
        }
    }

    /// Send what is held back for a polling consumer (any queued output).
    pub(crate) fn release_held(&self) {
        self.with_state(Caller::Device, |_, _| ());
    }

    /// Apply the outputs as the send token's holder (see [`RxeQp::with_state`]), for at
    /// most [`DRAIN_ROUNDS`] rounds: what others keep queueing meanwhile is left to the
    /// transmit step the caller then asks for, so no thread is kept applying another's
    /// work (a consumer's doorbell behind a stream of receive completions).
    ///
    /// With `hold`, the datagrams queued now stay queued unless others queue more behind
    /// them meanwhile (then all go, in order); how many stay is returned.
    fn apply(&self, st: &mut MutexGuard<'_, State>, hold: bool) -> usize {
        let sender = Sender::take(st);
        let mut held = if hold {
            sender.0.out.datagrams.len()
        } else {
            0
        };
        for _ in 0..DRAIN_ROUNDS {
            let effects = std::mem::take(&mut sender.0.out.effects);
            let mut datagrams = if sender.0.out.datagrams.len() > held {
                held = 0;
                std::mem::take(&mut sender.0.out.datagrams)
            } else {
                Vec::new()
            };
            if effects.is_empty() && datagrams.is_empty() {
                break;
            }
            MutexGuard::unlocked(sender.0, || {
                for e in effects {
                    self.effect(e);
                }
                let mut packets: Vec<_> = datagrams
                    .iter_mut()
                    .map(|d| Packet {
                        src: d.av.src,
                        dst: d.av.dst,
                        sport: d.av.sport,
                        roce: &mut d.roce,
                    })
                    .collect();
                self.dev.send_all(&mut packets);
            });
        }
        drop(sender);
        self.token_free.notify_all();
        held
    }

    /// Write a completion (one lost to a full CQ is counted: the CQ reports it) or
    /// deliver an event.
    fn effect(&self, e: Effect) {
        match e {
            Effect::Cqe { send, cqe } => {
                if !self.base.push_cqe(send, cqe) {
                    self.dev.count(&self.dev.counters.cq_overflows);
                }
            }
            Effect::Event(ev) => self.base.sink.deliver(ev),
        }
    }

    /// One transmit step from the device's transmit thread; how many packets it made.
    pub(crate) fn tx_step(&self) -> u32 {
        self.scheduled.store(false, Ordering::Release);
        // In batches: the first packets are on the wire (and the peer at work on them)
        // while the next are made, and what a batch gathered is still in the cache when
        // it is sent.
        let mut left = TX_BUDGET;
        let more = loop {
            let batch = TX_BATCH.min(left);
            let mut budget = batch;
            let more = self.with_state(Caller::Device, |e, st| e.transmit(st, &mut budget));
            left -= batch - budget;
            if !more || left == 0 {
                break more;
            }
        };
        tracing::trace!(
            qpn = self.base.qpn,
            sent = TX_BUDGET - left,
            more,
            "rxe tx step"
        );
        if more {
            self.schedule();
        }
        TX_BUDGET - left
    }

    /// A heap entry of this QP queued for `fired` came due.
    pub(crate) fn on_timer(&self, fired: Instant) {
        if self.with_state(Caller::Device, |e, st| e.on_timer(st, fired)) {
            self.schedule();
        }
    }

    /// One verified packet addressed to this QP, received by the device's thread or by a
    /// polling consumer (`polled`).
    pub(crate) fn on_packet(&self, d: &Datagram<'_>, p: &RoceRepr<'_>, polled: bool) {
        let caller = if polled {
            Caller::Polled
        } else {
            Caller::Device
        };
        if self.with_state(caller, |e, st| e.on_packet(st, d, p)) {
            self.schedule();
        }
    }

    // ---- connection manager hooks -----------------------------------------------------

    /// Apply attributes from the connection manager (as a consumer's Modify QP would).
    pub(crate) fn cm_modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.modify(attr, mask)
    }

    /// The connection failed: flush, and deliver `event` if there is one.
    pub(crate) fn cm_failed(&self, event: Option<Event>) {
        self.with_state(Caller::Close, |e, st| {
            e.to_error(st);
            if let Some(ev) = event {
                e.deliver(st, ev);
            }
        });
    }

    /// The connection ended: flush, and tell the consumer once.
    pub(crate) fn cm_closed(&self, kind: EventKind) {
        self.with_state(Caller::Verb, |e, st| {
            e.to_error(st);
            if !std::mem::replace(&mut st.closed_reported, true) {
                e.deliver(st, Event::new(kind));
            }
        });
    }

    pub(crate) fn state(&self) -> QpState {
        self.st.lock().qp
    }

    /// An unreliable-datagram QP.
    pub(crate) fn is_ud(&self) -> bool {
        self.service == QpType::Ud
    }

    /// Send-queue work is posted or in flight, or responder output (Read responses, an
    /// acknowledgement) is still queued: an orderly close waits for both. (Datagrams
    /// already produced go out ahead of the DREQ anyway: [`Caller::Close`].)
    pub(crate) fn send_busy(&self) -> bool {
        let st = self.st.lock();
        st.qp != QpState::Error
            && (st.req.busy() || st.resp.queued() > 0 || !self.base.sq.lock().is_empty())
    }

    /// Resolve the address vector from the QP attributes (destination GID, source GID
    /// index) and the device's GID table.
    fn resolve_av(&self, st: &State) -> Result<Av> {
        let dst = gid_to_ip(st.attr.dgid);
        let src = self.dev.route(st.attr.sgid_index, dst)?;
        let sport = wire::icrc::udp_sport_for(0, self.base.qpn, st.attr.dest_qpn);
        Ok(Av { src, dst, sport })
    }

    /// Modify QP under the lock, with the engine for what the move does (a flush).
    fn modify_state(
        &self,
        e: &Engine,
        st: &mut State,
        attr: &QpAttr,
        mask: QpAttrMask,
    ) -> Result<()> {
        let to = if mask.contains(QpAttrMask::STATE) {
            attr.state
        } else {
            st.qp
        };
        if mask.contains(QpAttrMask::STATE) && !st.qp.can_move_to(to) {
            return Err(VerbsError::BadState);
        }
        // Attribute rules of the verbs (IBTA 11.2.4.2, as rdma-core checks them).
        let need = |m: QpAttrMask| mask.contains(m);
        match (st.qp, to) {
            // A UD QP takes its Q_Key as it enters Init; it has no peer to learn.
            (QpState::Reset, QpState::Init) if self.is_ud() && !need(QpAttrMask::QKEY) => {
                return Err(VerbsError::Invalid)
            }
            (QpState::Init, QpState::Rtr)
                if !self.is_ud()
                    && !need(
                        QpAttrMask::AV
                            | QpAttrMask::PATH_MTU
                            | QpAttrMask::DEST_QPN
                            | QpAttrMask::RQ_PSN,
                    ) =>
            {
                return Err(VerbsError::Invalid)
            }
            (QpState::Rtr, QpState::Rts) if !need(QpAttrMask::SQ_PSN) => {
                return Err(VerbsError::Invalid)
            }
            _ => {}
        }
        let a = &mut st.attr;
        if need(QpAttrMask::ACCESS) {
            a.access = attr.access;
        }
        if need(QpAttrMask::QKEY) {
            a.qkey = attr.qkey;
        }
        if need(QpAttrMask::PATH_MTU) {
            a.path_mtu = attr.path_mtu;
        }
        if need(QpAttrMask::DEST_QPN) {
            a.dest_qpn = attr.dest_qpn & 0xff_ffff;
        }
        if need(QpAttrMask::RQ_PSN) {
            a.rq_psn = attr.rq_psn & wire::PSN_MASK;
        }
        if need(QpAttrMask::SQ_PSN) {
            a.sq_psn = attr.sq_psn & wire::PSN_MASK;
        }
        if need(QpAttrMask::MAX_RD_ATOMIC) {
            a.max_rd_atomic = attr.max_rd_atomic.clamp(1, self.dev.attr.max_ord as u8);
        }
        if need(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            a.max_dest_rd_atomic = attr
                .max_dest_rd_atomic
                .clamp(1, self.dev.attr.max_ird as u8);
        }
        if need(QpAttrMask::TIMEOUT) {
            a.timeout = attr.timeout.min(31);
        }
        if need(QpAttrMask::RETRY_CNT) {
            a.retry_cnt = attr.retry_cnt.min(7);
        }
        if need(QpAttrMask::RNR_RETRY) {
            a.rnr_retry = attr.rnr_retry.min(7);
        }
        if need(QpAttrMask::MIN_RNR_TIMER) {
            a.min_rnr_timer = attr.min_rnr_timer & 0x1f;
        }
        if need(QpAttrMask::PKEY_INDEX) {
            if attr.pkey_index != 0 {
                return Err(VerbsError::Invalid);
            }
            a.pkey_index = 0;
        }
        if need(QpAttrMask::AV) {
            a.dgid = attr.dgid;
            a.sgid_index = attr.sgid_index;
            a.hop_limit = attr.hop_limit;
        }
        if need(QpAttrMask::RETRY_CNT) || need(QpAttrMask::RNR_RETRY) {
            // A QP already sending takes new budgets at once, not at its next RTR→RTS.
            let a = st.attr;
            st.req.set_retry_budgets(a.retry_cnt, a.rnr_retry);
        }
        if mask.contains(QpAttrMask::STATE) {
            match to {
                QpState::Reset => {
                    e.to_error(st);
                    let attr = st.attr;
                    st.req = Requester::new(attr.sq_psn, attr.retry_cnt, attr.rnr_retry);
                    st.resp = Responder::new(attr.rq_psn);
                    st.av = None;
                    self.base.rearm_last_wqe();
                    e.set_state(st, QpState::Reset);
                }
                QpState::Rtr if self.is_ud() => {
                    // Every datagram carries its own address; the port's MTU bounds it.
                    st.mtu = self.dev.active_mtu();
                    e.set_state(st, QpState::Rtr);
                }
                QpState::Rtr => {
                    // The path's MTU is what the link from our address carries (a device
                    // on every address reaches a loopback peer over `lo`).
                    let av = self.resolve_av(st)?;
                    st.mtu = st.attr.path_mtu.min(self.dev.mtu_from(av.src));
                    st.av = Some(av);
                    st.resp = Responder::new(st.attr.rq_psn);
                    e.set_state(st, QpState::Rtr);
                }
                QpState::Rts if st.qp == QpState::Rtr => {
                    let a = st.attr;
                    st.req = Requester::new(a.sq_psn, a.retry_cnt, a.rnr_retry);
                    e.set_state(st, QpState::Rts);
                }
                QpState::Error => {
                    e.to_error(st);
                }
                other => e.set_state(st, other),
            }
        }
        Ok(())
    }
}

impl ProviderQp for RxeQp {
    fn qp_num(&self) -> u32 {
        self.base.qpn
    }

    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.with_state(Caller::Verb, |e, st| self.modify_state(e, st, attr, mask))
    }

    fn query(&self) -> QpAttr {
        let st = self.st.lock();
        QpAttr {
            state: st.qp,
            path_mtu: st.mtu,
            ..st.attr
        }
    }

    fn doorbell(&self) {
        let more = self.with_state(Caller::Verb, |e, st| {
            if st.qp == QpState::Error {
                // Work posted to a QP in Error completes flushed at once.
                e.flush_rings(st);
                return false;
            }
            // A UD QP sends everything posted: one datagram per request, no window, and
            // the kAL counts on a doorbell it serves before a destructive call
            // (kal::doorbell::Doorbells::serve_all) leaving nothing behind.
            let mut budget = if self.is_ud() {
                u32::MAX
            } else {
                INLINE_BUDGET
            };
            e.transmit(st, &mut budget)
        });
        if more {
            self.schedule();
        }
    }

    /// A message to a QP of this host is on the device's socket when the doorbell's send
    /// returns: the doorbell thread delivers it at once instead of waking the receive
    /// thread (`Receiver::receive_here`).
    ///
    /// Once such a doorbell has sent here, the QP's doorbells are served hushed: what they
    /// send does not also wake the receive thread, which would find it taken
    /// (`net::watch`). Once and for all: a doorbell whose datagrams another thread sent
    /// (it held the QP's send token) says nothing about where they went, and a hush
    /// that finds nothing of its own to take costs two `epoll_ctl` calls.
    fn doorbell_on_thread(&self) {
        let serve = || {
            let before = crate::device::Shared::sent_here();
            self.doorbell();
            self.dev.after_doorbell(before)
        };
        if self.peer_here.load(Ordering::Relaxed) {
            self.dev.hushed(serve);
        } else if serve() {
            self.peer_here.store(true, Ordering::Relaxed);
        }
    }

    fn disconnect(&self, abortive: bool) -> Result<()> {
        let me = self.arc().ok_or(VerbsError::BadState)?;
        crate::cm::disconnect(&self.dev, &me, abortive)
    }

    fn destroy(&self) {
        if let Some(me) = self.arc() {
            let _ = crate::cm::disconnect(&self.dev, &me, true);
        }
        self.with_state(Caller::Verb, |e, st| {
            st.closed_reported = true;
            e.to_error(st);
        });
        self.dev.qps.write().remove(&self.base.qpn);
    }

    /// `resp_queued`: responder output waiting to be sent (read responses, atomic and
    /// plain acknowledgements); at most `4 × max_dest_rd_atomic + 1`.
    fn counters(&self) -> Vec<Counter> {
        vec![("resp_queued", self.st.lock().resp.queued() as u64)]
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
