//! The siw queue pair. The engine is split as Linux siw splits it: the protocol state
//! (`state`), the requester (send queue → FPDUs, `requester`), the responder (FPDUs →
//! placements, receive completions, Read Responses, `responder`), Terminate and flush
//! (`terminate`), and the I/O shell with the two threads (`io`); this module holds the
//! QP object, its life cycle and the verbs the RNIC-PI calls.
//!
//! The protocol core (`state::State` with the requester, responder and terminate
//! methods on it) does no I/O: it is fed FPDUs, posted work (through the rings it
//! borrows) and the clock, and it leaves what to write (a batch in a buffer the caller
//! passes), completions and events (`state::Output`) and its next deadline for its
//! driver. The driver is `SiwQp` here and the threads in `io` (or `crate::sim`, or
//! `crate::harness`).
//!
//! Locking: `st` (the core) is held only for one call into it, never across socket I/O
//! nor while completions and events go out; `tx` is the send token, held by whoever
//! writes (the tx thread, or a doorbell transmitting small requests inline without
//! ever waiting for the socket), so one QP's writes never interleave mid-FPDU; `out` is
//! the output token, held by whoever writes the core's completions and events, so they
//! reach the CQs and the consumer in the order the core produced them whichever thread
//! drains them. The rx thread only reads the socket and never writes to it, so two
//! peers that both send large messages cannot deadlock on full TCP buffers.

mod batch;
mod io;
mod requester;
mod responder;
mod rx;
mod state;
mod terminate;

use crate::device::Shared;
use crate::llp::Llp;
use crate::orq::Orq;
use crate::wire::{self, term, TermCode};
use io::{Mode, Tx};
use parking_lot::{Condvar, Mutex};
use rnicpi::soft::QpBase;
use rnicpi::*;
use state::{Conn, Env, Output, State, TermTx};
use std::collections::VecDeque;
use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

pub struct SiwQp {
    /// The rings, CQs, SRQ and sink the QP was created with.
    pub(crate) base: QpBase,
    dev: Arc<Shared>,
    st: Mutex<State>,
    cv: Condvar,
    tx: Mutex<Option<Tx>>,
    /// The output token: held while the core's completions and events are written.
    out: Mutex<()>,
    /// The same stream for closing it: never held across I/O, so an abortive close
    /// works while the tx thread is blocked writing to a stalled peer.
    ctl: Mutex<Option<Arc<dyn Llp>>>,
    /// The receive side: the stream as the rx thread and polling consumers read it.
    rx: rx::Rx,
    me: Weak<SiwQp>,
}

/// What a QP accepts from its peer until the consumer sets its access flags: what the
/// iWARP connection manager gives every QP (kernel `iw_cm_init_qp_attr`).
const DEFAULT_QP_ACCESS: Access = Access::REMOTE_WRITE.union(Access::REMOTE_READ);

/// The Terminate of a QP that lost a completion (CQ overflow): a catastrophic error of
/// this stream (RFC 5040 §7.2).
const CQ_OVERFLOW: TermCode = TermCode {
    layer: term::LAYER_RDMAP,
    etype: term::RDMAP_REMOTE_OP,
    ecode: term::RDMAP_CATASTROPHIC_LOCAL,
};

impl SiwQp {
    pub(crate) fn new(dev: Arc<Shared>, qpn: u32, init: QpInit) -> Arc<SiwQp> {
        let qp = Arc::new_cyclic(|me| SiwQp {
            base: QpBase::new(qpn, init),
            dev,
            st: Mutex::new(State {
                qpn,
                qp: QpState::Reset,
                attr: QpAttr {
                    access: DEFAULT_QP_ACCESS,
                    ..QpAttr::default()
                },
                conn: Conn::Idle,
                crc: false,
                ird: 0,
                ord: 0,
                max_ulpdu: 1024,
                inflight: VecDeque::new(),
                orq: Orq::default(),
                tx_msn_send: 1,
                tx_msn_read: 1,
                rx_msn_send: 1,
                rx_msn_read: 1,
                responses: VecDeque::new(),
                responding: 0,
                cur_recv: None,
                term: TermTx::None,
                kick: false,
                tx_cur: None,
                out: VecDeque::new(),
                wake: false,
            }),
            cv: Condvar::new(),
            tx: Mutex::new(None),
            out: Mutex::new(()),
            ctl: Mutex::new(None),
            rx: rx::Rx::default(),
            me: me.clone(),
        });
        // Consumers polling the QP's CQs in embedded mode may read its stream.
        let weak: Weak<dyn Progress> = qp.me.clone();
        qp.base.drive_from_polls(weak);
        qp
    }

    /// What the core borrows for a call.
    fn env(&self) -> Env<'_> {
        Env {
            base: &self.base,
            mrs: &self.dev.res.mrs,
            counters: &self.dev.counters,
        }
    }

    /// One call into the core under its lock; then its completions and events go out.
    fn with_core<R>(&self, f: impl FnOnce(&mut State, &Env) -> R) -> R {
        let r = f(&mut self.st.lock(), &self.env());
        self.drain();
        r
    }

    /// Write what the core left (completions to the CQs, events to the consumer) in its
    /// order, and wake the tx thread if the core asked. A completion a CQ cannot take
    /// (full, or its ring corrupt) is lost: counted, the CQ reports `CqError`, and the
    /// core hears of it. Returns whether that moved the QP to Error.
    fn drain(&self) -> bool {
        let _token = self.out.lock();
        let mut fatal = false;
        loop {
            let (batch, wake) = {
                let mut st = self.st.lock();
                (std::mem::take(&mut st.out), std::mem::take(&mut st.wake))
            };
            if wake {
                self.cv.notify_all();
            }
            if batch.is_empty() {
                return fatal;
            }
            for o in batch {
                match o {
                    Output::Cqe { send, cqe } => {
                        if !self.base.push_cqe(send, cqe) {
                            self.dev
                                .counters
                                .cq_overflows
                                .fetch_add(1, Ordering::Relaxed);
                            let mut st = self.st.lock();
                            let live = st.qp != QpState::Error;
                            st.cq_lost(&self.env());
                            fatal |= live;
                        }
                    }
                    Output::Event(ev) => self.base.sink.deliver(ev),
                }
            }
        }
    }

    /// Connected over `llp`: negotiated parameters in, QP to RTS. The caller reads the
    /// stream and runs a transmitter (the I/O threads, or the engine harness).
    pub(crate) fn enter_rts(
        &self,
        llp: Arc<dyn Llp>,
        crc: bool,
        ird: u32,
        ord: u32,
        mss: usize,
    ) -> Result<()> {
        {
            let mut st = self.st.lock();
            if st.conn.has_stream() || matches!(st.qp, QpState::Error) {
                return Err(VerbsError::BadState);
            }
            st.set_conn(Conn::Up { hold_until: None });
            st.crc = crc;
            st.ird = ird.max(1);
            st.ord = ord.max(1);
            st.max_ulpdu = wire::max_ulpdu_for_mss(mss);
            st.set_state(QpState::Rts);
        }
        *self.ctl.lock() = Some(llp.clone());
        *self.tx.lock() = Some(Tx::new(llp));
        self.dev
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// An active connect ended without attaching a stream (or with `Established` after
    /// `attach`): report `ev` on the QP.
    pub(crate) fn connect_done(&self, ev: Event) {
        self.with_core(|st, _| {
            if st.conn == Conn::Connecting {
                st.set_conn(Conn::Idle);
            }
            st.event(ev);
        });
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.dev
    }

    /// A strong reference to this QP.
    pub(crate) fn arc(&self) -> Result<Arc<SiwQp>> {
        self.me.upgrade().ok_or(VerbsError::BadState)
    }

    /// `qp` as a QP of the device `dev` (the connection manager's QPs come as trait
    /// objects): `Invalid` for another provider's QP or another siw device's.
    pub(crate) fn of(qp: &Arc<dyn ProviderQp>, dev: &Arc<Shared>) -> Result<Arc<SiwQp>> {
        let qp = qp
            .as_any()
            .downcast_ref::<SiwQp>()
            .ok_or(VerbsError::Invalid)?
            .arc()?;
        if !Arc::ptr_eq(&qp.dev, dev) {
            return Err(VerbsError::Invalid);
        }
        Ok(qp)
    }

    /// Run `start`, an active connect's first steps, with the QP marked as connecting;
    /// if they fail the QP is as it was. Refused unless the QP is unconnected and in
    /// Reset, Init or RTR.
    pub(crate) fn connecting(&self, start: impl FnOnce() -> Result<()>) -> Result<()> {
        let before = {
            let mut st = self.st.lock();
            if !matches!(st.conn, Conn::Idle | Conn::Closed)
                || !matches!(st.qp, QpState::Reset | QpState::Init | QpState::Rtr)
            {
                return Err(VerbsError::BadState);
            }
            let before = st.conn;
            st.set_conn(Conn::Connecting);
            before
        };
        let started = start();
        if started.is_err() {
            let mut st = self.st.lock();
            if st.conn == Conn::Connecting {
                st.set_conn(before);
            }
        }
        started
    }

    pub(crate) fn limits(&self) -> (u32, u32) {
        let st = self.st.lock();
        let ird = if st.attr.max_dest_rd_atomic > 0 {
            st.attr.max_dest_rd_atomic as u32
        } else {
            self.dev.attr.max_ird
        };
        let ord = if st.attr.max_rd_atomic > 0 {
            st.attr.max_rd_atomic as u32
        } else {
            self.dev.attr.max_ord
        };
        (ird, ord)
    }

    /// The connection ended (EOF, reset, or a write failure).
    pub(crate) fn connection_lost(&self, eof: bool) {
        {
            let mut st = self.st.lock();
            let was_error = st.qp == QpState::Error;
            let kind = if eof || st.conn.closed_locally() {
                EventKind::Disconnected
            } else {
                EventKind::ConnectionBroken
            };
            let first = st.conn != Conn::Closed;
            st.set_conn(Conn::Closed);
            st.term = TermTx::None;
            st.enter_error(&self.env());
            if first {
                tracing::info!(
                    qpn = self.base.qpn,
                    ?kind,
                    was_error,
                    "siw connection closed"
                );
                st.event(Event::new(kind));
            }
        }
        if let Some(s) = self.ctl.lock().as_ref() {
            s.shutdown(Shutdown::Both);
        }
        self.drain();
    }

    /// Close locally: orderly (a FIN once the send queue has drained) or abortive (a TCP
    /// reset now, as for a destroyed QP or a dead process; outstanding work flushes).
    pub(crate) fn begin_close(&self, abortive: bool) {
        {
            let mut st = self.st.lock();
            let to = match st.conn {
                Conn::FinSent { .. } if !abortive => Conn::FinSent { local: true },
                c if c.has_stream() && !abortive => Conn::Closing { local: true },
                c if c.has_stream() => Conn::Aborted,
                c => c,
            };
            st.set_conn(to);
            if !abortive {
                self.cv.notify_all();
                return;
            }
        }
        // Reset first: once the QP is in Error its tx thread closes the stream in order,
        // and that FIN must not reach the peer before the reset. Lock order: the tx
        // thread holds `tx` and then takes `st`; `ctl` is taken alone.
        if let Some(s) = self.ctl.lock().as_ref() {
            s.abort();
        }
        self.with_core(|st, env| st.enter_error(env));
    }
}

/// The negotiated parameters a connection starts with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attach {
    pub crc: bool,
    pub ird: u32,
    pub ord: u32,
}

impl ProviderQp for SiwQp {
    fn qp_num(&self) -> u32 {
        self.base.qpn
    }

    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let mut st = self.st.lock();
        if mask.contains(QpAttrMask::MAX_RD_ATOMIC) {
            st.attr.max_rd_atomic = attr.max_rd_atomic.min(self.dev.attr.max_ord as u8);
        }
        if mask.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            st.attr.max_dest_rd_atomic = attr.max_dest_rd_atomic.min(self.dev.attr.max_ird as u8);
        }
        if mask.contains(QpAttrMask::ACCESS) {
            st.attr.access = attr.access;
        }
        if mask.contains(QpAttrMask::STATE) {
            let to = attr.state;
            if !st.qp.can_move_to(to) {
                return Err(VerbsError::BadState);
            }
            match to {
                QpState::Rts | QpState::Sqd if !st.conn.has_stream() => {
                    return Err(VerbsError::BadState)
                }
                QpState::Error => {
                    drop(st);
                    self.begin_close(true);
                    return Ok(());
                }
                QpState::Reset if st.conn.has_stream() => return Err(VerbsError::BadState),
                _ => st.set_state(to),
            }
        }
        Ok(())
    }

    fn query(&self) -> QpAttr {
        let st = self.st.lock();
        QpAttr {
            state: st.qp,
            ..st.attr
        }
    }

    fn doorbell(&self) {
        let in_error = self.with_core(|st, env| {
            if st.qp == QpState::Error {
                // Work posted to a QP in Error completes flushed right away.
                st.enter_error(env);
                return true;
            }
            false
        });
        if in_error {
            return;
        }
        // Requests up to 1 MiB go out inline in the caller's thread while the socket takes
        // them; nothing here ever waits for the socket or for the tx thread. What the
        // inline pump leaves (large requests, Read Responses, a busy send token) it
        // hands to the tx thread itself: a post that went out whole wakes no thread.
        if !self.pump(Mode::Inline) {
            self.kick_tx(); // no stream yet: the tx thread looks once it starts
        }
    }

    fn disconnect(&self, abortive: bool) -> Result<()> {
        if !self.st.lock().conn.has_stream() {
            return Err(VerbsError::BadState);
        }
        self.begin_close(abortive);
        Ok(())
    }

    fn destroy(&self) {
        // Destroying a connected QP is an abortive close, unless an orderly one already
        // sent its FIN: then what was sent before it is still delivered.
        let abort = {
            let st = self.st.lock();
            st.conn.has_stream() && !matches!(st.conn, Conn::FinSent { .. })
        };
        if abort {
            self.begin_close(true);
        }
        // Destroyed: no event about the connection any more.
        self.with_core(|st, env| {
            st.set_conn(Conn::Closed);
            st.enter_error(env);
        });
        *self.tx.lock() = None;
        *self.ctl.lock() = None;
    }

    fn counters(&self) -> Vec<Counter> {
        Vec::new()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
