//! The rxe queue pair: verbs state machine, address vector, and the three halves of the
//! RC transport, split as Linux's rxe splits them — requester ([`requester`]: send queue →
//! request packets), completer ([`completer`]: ACKs, NAKs, read responses and atomic ACKs →
//! completions, retransmission) and responder ([`responder`]: request packets → placements, receive
//! completions, ACKs, read responses, atomic results).
//!
//! One mutex holds the protocol state; it is taken by the receive thread (one packet at
//! a time), the transmit thread (a paced burst of packets), the timer thread and the
//! consumer's doorbell. Nothing is sent under it: the engine queues the datagrams it
//! produces in an outbox, which is sent once the lock is released, in the order the
//! datagrams were produced (see [`RxeQp::with_state`]).
//!
//! Over 600 lines: the QP object, its verbs, flush and send path (outbox and send token);
//! the requester, completer and responder have their own files.

mod completer;
mod requester;
mod responder;

use crate::device::Shared;
use crate::net::Datagram;
use crate::timer::Target;
use crate::wire::{self, RoceRepr};
use parking_lot::{Mutex, MutexGuard};
use requester::Requester;
use responder::Responder;
use rnicpi::soft::QpBase;
use rnicpi::*;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Where the QP's packets go: the address vector resolved at RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Av {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// UDP source port (entropy, from the flow label or the QP numbers).
    pub sport: u16,
}

/// A datagram the engine produced, waiting to be handed to the wire.
pub(crate) struct Outgoing {
    av: Av,
    /// BTH .. ICRC slot (the wire fills the ICRC in).
    roce: Vec<u8>,
}

/// The right to send a QP's outbox ([`RxeQp::with_state`]), given back when dropped (with
/// the state locked again), even if a send panicked: else the QP would never send again.
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

/// Packets in flight a requester allows before waiting for an acknowledgement.
pub(crate) const WINDOW: u32 = 128;
/// Packets one transmit step sends before yielding to other QPs.
const TX_BUDGET: u32 = 64;
/// Packets a transmit step makes under the lock before it sends them.
const TX_BATCH: u32 = 8;
/// Times a thread sending a QP's outbox takes it again (what others queued meanwhile)
/// before it leaves the rest to the transmit thread.
const DRAIN_ROUNDS: u32 = 4;
/// Packets a doorbell sends inline in the caller's thread.
const INLINE_BUDGET: u32 = 4;
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
    /// The earliest deadline this QP has in the device's timer heap. Re-arming later than
    /// that (every acknowledgement does) pushes nothing: the queued entry finds the new
    /// deadline when it fires and queues itself again, so the timer thread wakes about
    /// once per timeout per QP, not once per message.
    pub timer_queued: Option<Instant>,
    /// The connection manager has told the consumer the connection ended.
    pub closed_reported: bool,
    /// Datagrams produced and not yet sent, oldest first (empty while the lock is free).
    out: Vec<Outgoing>,
    /// A thread is sending the outbox; it also sends what is queued meanwhile.
    sending: bool,
    /// Production stopped for a full outbox: a transmit step is owed once it drains.
    resume: bool,
}

pub struct RxeQp {
    /// The rings, CQs, SRQ and sink the QP was created with.
    pub(crate) base: QpBase,
    /// The device's serial of this QP object: unlike its number, never reused.
    serial: u64,
    pub(crate) dev: Arc<Shared>,
    pub(crate) st: Mutex<State>,
    scheduled: AtomicBool,
    me: Weak<RxeQp>,
}

impl RxeQp {
    pub(crate) fn new(dev: Arc<Shared>, qpn: u32, serial: u64, init: QpInit) -> Arc<RxeQp> {
        let attr = QpAttr {
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            ..QpAttr::default()
        };
        Arc::new_cyclic(|me| RxeQp {
            base: QpBase::new(qpn, init),
            serial,
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
                out: Vec::new(),
                sending: false,
                resume: false,
            }),
            scheduled: AtomicBool::new(false),
            me: me.clone(),
        })
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

    fn set_state(&self, st: &mut State, to: QpState) {
        if st.qp != to {
            tracing::debug!(qpn = self.base.qpn, from = ?st.qp, ?to, "rxe QP state");
            st.qp = to;
        }
    }

    /// Run `f` on the QP's state, then send what it queued, after the lock is released.
    ///
    /// Several threads produce for one QP (receive, transmit, timer, a doorbell), and the
    /// wire must see the datagrams in the order they were produced (PSN order). One
    /// thread at a time sends the outbox (`State::sending`): it takes the whole outbox
    /// under the lock, sends it without the lock, and looks again, so what others queued
    /// meanwhile follows in order; a thread that finds the outbox being sent leaves its
    /// datagrams to the sender and goes on. No thread ever waits for another's `sendmsg`,
    /// with or without the lock. What one sender carries is bounded: producers stop while
    /// a transmit step's worth waits ([`RxeQp::transmit`]), and after [`DRAIN_ROUNDS`] the
    /// sender hands what is left to the transmit thread.
    ///
    /// (Two other designs keep the order: batches that take a ticket under the lock and
    /// wait for their turn, and a transmit mutex taken before the state lock is released.
    /// Both make a thread wait for another's `sendmsg`; on a 2-CPU host they made an
    /// 8-byte ping-pong mostly 17–18 µs one way instead of 5.)
    fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut st = self.st.lock();
        let r = f(&mut st);
        if st.out.is_empty() || st.sending {
            return r;
        }
        let sender = Sender::take(&mut st);
        for _ in 0..DRAIN_ROUNDS {
            let batch = std::mem::take(&mut sender.0.out);
            MutexGuard::unlocked(sender.0, || {
                for mut d in batch {
                    self.dev.send(d.av.src, d.av.dst, d.av.sport, &mut d.roce);
                }
            });
            if sender.0.out.is_empty() {
                break;
            }
        }
        drop(sender);
        // What is still queued goes with the transmit step owed, or with one started now.
        let owed = std::mem::take(&mut st.resume) || !st.out.is_empty();
        drop(st);
        if owed {
            self.schedule();
        }
        r
    }

    /// One transmit step from the device's transmit thread.
    pub(crate) fn tx_step(&self) {
        self.scheduled.store(false, Ordering::Release);
        // In batches: the first packets are on the wire (and the peer at work on them)
        // while the next are made, and what a batch gathered is still in the cache when
        // it is sent.
        let mut left = TX_BUDGET;
        let more = loop {
            let batch = TX_BATCH.min(left);
            let mut budget = batch;
            let more = self.with_state(|st| self.transmit(st, &mut budget));
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
    }

    /// Send what is ready, responder output first; true when work is left over. Nothing
    /// while a transmit step's worth of datagrams waits in the outbox: its sender asks
    /// for a transmit step once it has sent them.
    fn transmit(&self, st: &mut State, budget: &mut u32) -> bool {
        if st.out.len() >= TX_BUDGET as usize {
            st.resume = true;
            return false;
        }
        let more = self.send_read_responses(st, budget);
        more | self.pump(st, budget)
    }

    // ---- timers -----------------------------------------------------------------------

    pub(crate) fn arm_timer(&self, st: &mut State, after: Duration) {
        let at = self.dev.clock.now() + after;
        st.timer_at = Some(at);
        self.queue_timer(st, at);
    }

    fn queue_timer(&self, st: &mut State, at: Instant) {
        if st.timer_queued.is_none_or(|q| at < q) {
            st.timer_queued = Some(at);
            self.dev.timers.arm(Target::Qp(self.base.qpn), 0, at);
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

    /// A heap entry of this QP queued for `fired` came due.
    pub(crate) fn on_timer(&self, fired: Instant) {
        let more = self.with_state(|st| {
            if st.timer_queued == Some(fired) {
                st.timer_queued = None;
            }
            match st.timer_at {
                None => return false,
                Some(at) if at > self.dev.clock.now() => {
                    self.queue_timer(st, at);
                    return false;
                }
                Some(_) => {}
            }
            st.timer_at = None;
            self.requester_timeout(st);
            true
        });
        if more {
            self.schedule();
        }
    }

    // ---- receive ----------------------------------------------------------------------

    /// One verified packet addressed to this QP.
    pub(crate) fn on_packet(&self, d: &Datagram<'_>, p: &RoceRepr<'_>) {
        let schedule = self.with_state(|st| {
            if st.av.is_some_and(|av| av.dst != d.src) {
                self.dev.count(&self.dev.counters.rx_wrong_source);
                return false;
            }
            if p.bth.opcode.transport() != wire::opcode::Transport::Rc {
                self.dev.count(&self.dev.counters.rx_malformed);
                return false;
            }
            let ready = match p.bth.opcode.direction() {
                wire::Direction::Request => {
                    if !matches!(st.qp, QpState::Rtr | QpState::Rts | QpState::Sqd) {
                        self.dev.count(&self.dev.counters.rx_dropped_state);
                        return false;
                    }
                    self.on_request(st, p)
                }
                wire::Direction::Response => {
                    if !matches!(st.qp, QpState::Rts | QpState::Sqd) {
                        self.dev.count(&self.dev.counters.rx_dropped_state);
                        return false;
                    }
                    self.on_response(st, p)
                }
            };
            // What the packet made ready (an ACK, a Read response, the next window of
            // requests) goes out from this thread once it leaves the lock; only a
            // remainder waits for the transmit thread, which saves a thread wake-up per
            // message.
            let mut budget = INLINE_BUDGET;
            ready && self.transmit(st, &mut budget)
        });
        if schedule {
            self.schedule();
        }
    }

    // ---- output helpers ---------------------------------------------------------------

    /// Queue one packet to the QP's peer; it is sent when the lock is released.
    pub(crate) fn send_packet(&self, st: &mut State, repr: &RoceRepr<'_>) {
        let Some(av) = st.av else { return };
        match repr.to_vec() {
            Ok(roce) => st.out.push(Outgoing { av, roce }),
            Err(e) => tracing::warn!(qpn = self.base.qpn, error = %e, "rxe: cannot emit packet"),
        }
    }

    pub(crate) fn bth(&self, st: &State, opcode: wire::Opcode, psn: u32) -> wire::BthRepr {
        wire::BthRepr::new(opcode, st.attr.dest_qpn, psn)
    }

    // ---- completions and errors -------------------------------------------------------

    /// Write a completion; one lost to a full CQ is counted (the CQ reports it).
    pub(crate) fn post_cqe(&self, send: bool, cqe: Cqe) {
        if !self.base.push_cqe(send, cqe) {
            self.dev.count(&self.dev.counters.cq_overflows);
        }
    }

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
                self.post_cqe(true, self.base.cqe(&w.wqe, status, 0));
            }
        }
        self.flush_rings(st);
        st.resp.clear();
    }

    /// Complete everything queued in the consumer's rings now as flushed (QP in Error):
    /// a fixed range, so a consumer that keeps refilling a ring gets the rest flushed at
    /// its next doorbell, never an endless loop here.
    fn flush_rings(&self, st: &mut State) {
        self.base.flush_send(|c| self.post_cqe(true, c));
        self.base
            .flush_recv(st.resp.take_current_recv(), |c| self.post_cqe(false, c));
    }

    /// A fatal transport error: report it and go to Error.
    pub(crate) fn fatal(&self, st: &mut State, kind: EventKind, why: &str) {
        if st.qp == QpState::Error {
            return;
        }
        tracing::warn!(qpn = self.base.qpn, ?kind, why, "rxe QP error");
        self.to_error(st);
        self.base
            .sink
            .deliver(Event::new(kind).with_status(libc::EIO));
    }

    /// The next posted receive ([`QpBase::take_recv`]); a corrupt receive ring is also
    /// logged here (the caller fails the QP).
    pub(crate) fn take_recv(&self) -> Result<Option<Wqe>, RingCorrupt> {
        self.base.take_recv().inspect_err(|_| {
            rnicpi::warn_limited!(qpn = self.base.qpn, "rxe receive ring indices corrupt");
        })
    }

    // ---- connection manager hooks -----------------------------------------------------

    /// Apply attributes from the connection manager (as a consumer's Modify QP would).
    pub(crate) fn cm_modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.modify(attr, mask)
    }

    /// The connection ended: flush, and tell the consumer once.
    pub(crate) fn cm_closed(&self, kind: EventKind) {
        let mut st = self.st.lock();
        self.to_error(&mut st);
        let first = !st.closed_reported;
        st.closed_reported = true;
        drop(st);
        if first {
            self.base.sink.deliver(Event::new(kind));
        }
    }

    /// The peer stopped answering (transport retries exhausted): a dead peer, which a
    /// connected consumer hears of as a broken connection (once, as for a close).
    pub(crate) fn peer_lost(&self, st: &mut State) {
        if !std::mem::replace(&mut st.closed_reported, true) {
            self.base
                .sink
                .deliver(Event::new(EventKind::ConnectionBroken).with_status(libc::ETIMEDOUT));
        }
    }

    pub(crate) fn state(&self) -> QpState {
        self.st.lock().qp
    }

    /// Send-queue work is posted or in flight (an orderly close waits for it).
    pub(crate) fn send_busy(&self) -> bool {
        let st = self.st.lock();
        st.qp != QpState::Error && (st.req.busy() || !self.base.sq.lock().is_empty())
    }

    /// Resolve the address vector from the QP attributes (destination GID, source GID
    /// index) and the device's GID table.
    fn resolve_av(&self, st: &State) -> Result<Av> {
        let dst = gid_to_ip(st.attr.dgid);
        let gids = self.dev.addrs();
        let src = match gids.get(st.attr.sgid_index as usize) {
            Some(a) if a.is_ipv4() == dst.is_ipv4() && !a.is_unspecified() => *a,
            _ => self.dev.source_for(dst)?,
        };
        let src = if dst.is_loopback() && !src.is_loopback() {
            self.dev.source_for(dst).unwrap_or(src)
        } else {
            src
        };
        let sport = wire::icrc::udp_sport_for(0, self.base.qpn, st.attr.dest_qpn);
        Ok(Av { src, dst, sport })
    }
}

impl ProviderQp for RxeQp {
    fn qp_num(&self) -> u32 {
        self.base.qpn
    }

    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let mut st = self.st.lock();
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
            (QpState::Init, QpState::Rtr)
                if !(need(QpAttrMask::AV)
                    && need(QpAttrMask::PATH_MTU)
                    && need(QpAttrMask::DEST_QPN)
                    && need(QpAttrMask::RQ_PSN)) =>
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
                    self.to_error(&mut st);
                    let attr = st.attr;
                    st.req = Requester::new(attr.sq_psn, attr.retry_cnt, attr.rnr_retry);
                    st.resp = Responder::new(attr.rq_psn);
                    st.av = None;
                    self.base.rearm_last_wqe();
                    self.set_state(&mut st, QpState::Reset);
                }
                QpState::Rtr => {
                    let mtu = st.attr.path_mtu.min(self.dev.active_mtu());
                    st.mtu = mtu;
                    st.av = Some(self.resolve_av(&st)?);
                    st.resp = Responder::new(st.attr.rq_psn);
                    self.set_state(&mut st, QpState::Rtr);
                }
                QpState::Rts if st.qp == QpState::Rtr => {
                    let a = st.attr;
                    st.req = Requester::new(a.sq_psn, a.retry_cnt, a.rnr_retry);
                    self.set_state(&mut st, QpState::Rts);
                }
                QpState::Error => {
                    self.to_error(&mut st);
                }
                other => self.set_state(&mut st, other),
            }
        }
        Ok(())
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
        let more = self.with_state(|st| {
            if st.qp == QpState::Error {
                // Work posted to a QP in Error completes flushed at once.
                self.flush_rings(st);
                return false;
            }
            let mut budget = INLINE_BUDGET;
            self.transmit(st, &mut budget)
        });
        if more {
            self.schedule();
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
        let mut st = self.st.lock();
        st.closed_reported = true;
        self.to_error(&mut st);
        drop(st);
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
