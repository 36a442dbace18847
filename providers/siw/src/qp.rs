//! The siw queue pair: requester (send queue → FPDUs), responder (FPDUs → placements,
//! receive completions, Read Responses), Terminate, flush, and the two I/O threads.
//!
//! Locking: `st` (protocol state) is held only briefly and never across socket I/O;
//! `tx` serialises transmission (the tx thread, or a doorbell transmitting small requests
//! inline without ever waiting for the socket); the rx thread only reads the socket and
//! never writes to it, so two peers that both send large messages cannot deadlock on
//! full TCP buffers.

use crate::device::Shared;
use crate::llp::{self, Llp};
use crate::orq::{Orq, OutstandingRead, Placement};
use crate::wire::{self, term, Header, Model, MpaFrame, Opcode, ReadRequest, TermCode};
use parking_lot::{Condvar, Mutex};
use rnicpi::*;
use std::collections::VecDeque;
use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// A send-queue request taken from the ring, until it completes.
struct Inflight {
    wqe: Wqe,
    /// Every byte of its request is with the LLP. A close never flushes such a request
    /// as if it had not been sent, and it flushes nothing behind one still being
    /// written: the transmitter settles it first.
    sent: bool,
    /// Finished: sent (Send, Write, local operations) or answered in full (Read).
    done: bool,
}

/// The inbound Send message being placed into a posted receive.
struct RecvInProgress {
    wqe: Wqe,
    received: u32,
    total: u64,
}

/// The next message offset after `len` more bytes of a Send at `mo`, checked against
/// the receive's size and the 32-bit message offsets and byte counts of the wire and
/// the completion (a message is at most `u32::MAX` bytes).
fn next_offset(rip: &RecvInProgress, mo: u32, len: usize) -> Result<u32, TermCode> {
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

struct State {
    qp: QpState,
    attr: QpAttr,
    connected: bool,
    /// An active connect (TCP + MPA) is under way in the CM reactor.
    connecting: bool,
    crc: bool,
    ird: u32,
    ord: u32,
    max_ulpdu: usize,
    inflight: VecDeque<Inflight>,
    orq: Orq,
    tx_msn_send: u32,
    tx_msn_read: u32,
    rx_msn_send: u32,
    rx_msn_read: u32,
    responses: VecDeque<ReadRequest>,
    /// Read Responses being transmitted: they hold their IRD slot until fully sent.
    responding: u32,
    cur_recv: Option<RecvInProgress>,
    terminate: Option<Vec<u8>>,
    /// A Terminate was queued and has not been written to the socket yet.
    term_pending: bool,
    /// `LastWqeReached` was reported (QPs on an SRQ, once they enter Error).
    last_wqe_sent: bool,
    kick: bool,
    closing: bool,
    /// The orderly close's FIN has been sent.
    fin_sent: bool,
    /// Local side asked for the close (Disconnected rather than ConnectionBroken).
    local_close: bool,
    events_sent: bool,
    /// As MPA Responder: no FPDU goes out before the Initiator's first one has arrived
    /// (RFC 5044 §7.1.2) or, at the latest, this instant (see [`RESPONDER_WAIT`]).
    hold_until: Option<Instant>,
}

/// How long an MPA Responder holds its first FPDU for the Initiator's. RFC 5044 makes
/// the Responder wait for it; an Initiator whose consumer waits for the Responder to
/// speak first would then wait for ever unless both sides negotiate RFC 6581's
/// ready-to-receive message, which krdma does not yet: the wait is bounded instead.
/// Kernel siw as Initiator resets the connection when an FPDU is already in its socket
/// as it reads the Reply; it has read it well within this time.
const RESPONDER_WAIT: Duration = Duration::from_millis(50);

/// The transmit side of a connected QP, owned by whoever holds the `tx` lock.
struct Tx {
    llp: Arc<dyn Llp>,
    /// Bytes a doorbell could not write without waiting: the tx thread writes them
    /// before anything else.
    unsent: Vec<u8>,
    /// The request whose last bytes are in `unsent` (it is settled once they are out).
    owed: Option<(Wqe, bool)>,
}

/// Who is transmitting: the QP's own tx thread, which may wait for the socket, or a
/// doorbell in a caller's thread (the daemon's doorbell reactor, or a consumer in
/// embedded mode), which never waits: it sends small requests while the socket takes
/// them and leaves the rest to the tx thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Thread,
    Inline,
}

/// Writes out a pump's FPDUs in its [`Mode`].
struct Writer<'a> {
    tx: &'a mut Tx,
    mode: Mode,
    counters: &'a crate::device::Counters,
}

impl Writer<'_> {
    /// Hand `out` to the LLP and clear it. Inline, what the socket does not take now
    /// goes to `unsent` (and so does everything after it).
    fn put(&mut self, out: &mut Vec<u8>) -> std::io::Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        match self.mode {
            Mode::Thread => self.tx.llp.write_all(out)?,
            Mode::Inline if self.tx.unsent.is_empty() => {
                let n = self.tx.llp.write_now(out)?;
                self.tx.unsent.extend_from_slice(&out[n..]);
            }
            Mode::Inline => self.tx.unsent.extend_from_slice(out),
        }
        self.counters
            .tx_bytes
            .fetch_add(out.len() as u64, Ordering::Relaxed);
        out.clear();
        Ok(())
    }
}

pub struct SiwQp {
    pub qpn: u32,
    pd: u32,
    dev: Arc<Shared>,
    caps: QpCaps,
    sq: Mutex<Consumer<Wqe>>,
    rq: Mutex<Consumer<Wqe>>,
    /// When set, receives come from this SRQ and `rq` is unused.
    srq: Option<Arc<dyn ProviderSrq>>,
    scq: Arc<dyn ProviderCq>,
    rcq: Arc<dyn ProviderCq>,
    pub(crate) sink: Arc<dyn EventSink>,
    stats: Arc<RingStats>,
    st: Mutex<State>,
    cv: Condvar,
    tx: Mutex<Option<Tx>>,
    /// The same stream for closing it: never held across I/O, so an abortive close
    /// works while the tx thread is blocked writing to a stalled peer.
    ctl: Mutex<Option<Arc<dyn Llp>>>,
    me: Weak<SiwQp>,
}

/// Room for a batch of FPDUs per socket write.
const TX_BATCH: usize = 256 * 1024;
/// Largest request a doorbell transmits inline in the caller's thread.
const INLINE_TX: u64 = 16 * 1024;
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
        Arc::new_cyclic(|me| SiwQp {
            qpn,
            pd: init.pd,
            dev,
            caps: init.caps,
            sq: Mutex::new(init.sq),
            rq: Mutex::new(init.rq),
            srq: init.srq,
            scq: init.send_cq,
            rcq: init.recv_cq,
            sink: init.sink,
            stats: init.stats,
            st: Mutex::new(State {
                qp: QpState::Reset,
                attr: QpAttr {
                    access: DEFAULT_QP_ACCESS,
                    ..QpAttr::default()
                },
                connected: false,
                connecting: false,
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
                terminate: None,
                term_pending: false,
                last_wqe_sent: false,
                kick: false,
                closing: false,
                fin_sent: false,
                local_close: false,
                events_sent: false,
                hold_until: None,
            }),
            cv: Condvar::new(),
            tx: Mutex::new(None),
            ctl: Mutex::new(None),
            me: me.clone(),
        })
    }

    fn set_state(&self, st: &mut State, to: QpState) {
        if st.qp != to {
            tracing::debug!(qpn = self.qpn, from = ?st.qp, ?to, "siw QP state");
            st.qp = to;
        }
    }

    /// Hand the connected stream to the engine: QP to RTS, report `established`, send
    /// `reply` (the passive side's MPA Reply) and start the I/O threads — in that order,
    /// so the QP's `Established` is queued before the peer can learn of the connection
    /// and before the receive thread can report its end (a peer that closes at once is
    /// still seen to have connected first, as over the IB CM, where the RTU precedes
    /// any DREQ). A reply that cannot be sent ends the connection as broken.
    pub(crate) fn attach(
        self: &Arc<Self>,
        stream: TcpStream,
        conn: Attach,
        established: Event,
        reply: Option<&[u8]>,
    ) -> Result<()> {
        let _ = stream.set_nodelay(true);
        llp::set_linger_zero(&stream);
        let mss = llp::tcp_mss(&stream).unwrap_or(1460);
        let rx = stream.try_clone()?;
        self.enter_rts(Arc::new(stream), conn.crc, conn.ird, conn.ord, mss)?;
        if reply.is_some() {
            // We answer the MPA Request: the Initiator speaks first (RFC 5044 §7.1.2).
            self.st.lock().hold_until = Some(Instant::now() + RESPONDER_WAIT);
        }
        self.sink.deliver(established);
        // The reply goes out on the still non-blocking stream: a few hundred bytes into
        // a fresh connection's empty send buffer, never a wait on the peer.
        let sent = reply.map_or(Ok(()), |r| rx.write_all(r));
        let started = sent.and_then(|_| rx.set_nonblocking(false)).and_then(|_| {
            let (a, b) = (self.clone(), self.clone());
            let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new()
                    .name(name)
                    .stack_size(256 * 1024)
                    .spawn(f)
            };
            spawn(
                format!("siw-rx{}", self.qpn),
                Box::new(move || a.rx_loop(rx)),
            )
            .and_then(|_| spawn(format!("siw-tx{}", self.qpn), Box::new(move || b.tx_loop())))
        });
        if let Err(e) = started {
            // No reply sent or no threads to run the connection: it broke.
            tracing::info!(qpn = self.qpn, error = %e, "siw connection could not start");
            self.begin_close(true);
            self.connection_lost(false);
            return Ok(());
        }
        tracing::info!(
            qpn = self.qpn,
            crc = conn.crc,
            ird = conn.ird,
            ord = conn.ord,
            mss,
            "siw QP connected"
        );
        Ok(())
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
            if st.connected || matches!(st.qp, QpState::Error) {
                return Err(VerbsError::BadState);
            }
            st.connected = true;
            st.connecting = false;
            st.crc = crc;
            st.ird = ird.max(1);
            st.ord = ord.max(1);
            st.max_ulpdu = wire::max_ulpdu_for_mss(mss);
            self.set_state(&mut st, QpState::Rts);
        }
        *self.ctl.lock() = Some(llp.clone());
        *self.tx.lock() = Some(Tx {
            llp,
            unsent: Vec::new(),
            owed: None,
        });
        self.dev
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// An active connect ended without attaching a stream (or with `Established` after
    /// `attach`): report `ev` on the QP.
    pub(crate) fn connect_done(&self, ev: Event) {
        self.st.lock().connecting = false;
        self.sink.deliver(ev);
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.dev
    }

    /// A strong reference to this QP.
    pub(crate) fn arc(&self) -> Result<Arc<SiwQp>> {
        self.me.upgrade().ok_or(VerbsError::BadState)
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

    // ---- transmit -------------------------------------------------------------------

    fn tx_loop(self: Arc<Self>) {
        loop {
            {
                let mut st = self.st.lock();
                loop {
                    let busy = st.terminate.is_some() || st.closing || st.qp != QpState::Rts;
                    if let Some(t) = st.hold_until.filter(|_| !busy) {
                        // Holding our first FPDU: the first FPDU received (it kicks us)
                        // or the end of the wait lets it go.
                        if Instant::now() >= t {
                            st.hold_until = None;
                            tracing::debug!(qpn = self.qpn, "siw responder wait over");
                            break;
                        }
                        self.cv.wait_until(&mut st, t);
                        continue;
                    }
                    if st.kick || busy || !st.responses.is_empty() {
                        break;
                    }
                    self.cv.wait(&mut st);
                }
                st.kick = false;
            }
            if !self.pump(Mode::Thread) {
                return;
            }
        }
    }

    /// Transmit everything ready, waiting for the LLP as the tx thread does (the engine
    /// harness plays the tx thread with this).
    pub(crate) fn transmit(&self) -> bool {
        self.pump(Mode::Thread)
    }

    /// Wake the tx thread: there is work a doorbell left to it.
    fn kick_tx(&self) {
        self.st.lock().kick = true;
        self.cv.notify_one();
    }

    /// Transmit what is ready: a pending Terminate, Read Responses, then send-queue work
    /// (see [`Mode`]). At most one ring's worth of send-queue entries (local operations
    /// included) per call, the rest left to the tx thread's next round: however the
    /// consumer churns its ring, one call does bounded work. Returns false once the
    /// connection is finished. The protocol-state lock is never held while writing.
    fn pump(&self, mode: Mode) -> bool {
        let mut budget = self.sq.lock().capacity();
        let mut guard = match mode {
            Mode::Thread => self.tx.lock(),
            Mode::Inline => match self.tx.try_lock() {
                Some(g) => g,
                None => return true, // the tx thread is at it
            },
        };
        let Some(tx) = guard.as_mut() else {
            return false;
        };
        let mut w = Writer {
            tx,
            mode,
            counters: &self.dev.counters,
        };
        if !w.tx.unsent.is_empty() {
            if mode == Mode::Inline {
                return true;
            }
            let r = w.tx.llp.write_all(&w.tx.unsent);
            w.tx.unsent.clear();
            if let Some((wqe, complete_now)) = w.tx.owed.take() {
                self.settle(&wqe, r.is_ok(), complete_now);
            }
            if let Err(e) = r {
                tracing::debug!(qpn = self.qpn, error = %e, "siw transmit failed");
                drop(guard);
                self.connection_lost(false);
                return false;
            }
        }
        let mut out = Vec::with_capacity(64 * 1024);
        loop {
            let work = self.take_work(mode, &mut budget);
            let r = match work {
                Work::Idle => return true,
                Work::Finish => {
                    w.tx.llp.shutdown(Shutdown::Write);
                    return false;
                }
                Work::Raw(bytes) => {
                    out.extend_from_slice(&bytes);
                    let r = w.put(&mut out);
                    self.st.lock().term_pending = false;
                    r
                }
                Work::Response { rr, crc, mtu } => {
                    let sent = self.emit_read_response(&mut out, &rr, crc, mtu, &mut |o| w.put(o));
                    // The IRD slot frees before the last FPDUs leave: the peer may send its
                    // next Read Request the moment it has them.
                    {
                        let mut st = self.st.lock();
                        st.responding = st.responding.saturating_sub(1);
                    }
                    let sent = sent.map(|r| r.and_then(|_| w.put(&mut out)));
                    match sent {
                        Ok(r) => r,
                        Err(code) => {
                            out.clear();
                            self.fail(code, None);
                            continue;
                        }
                    }
                }
                Work::Request { wqe, crc, mtu, msn } => {
                    let mut io = Ok(());
                    let result =
                        self.emit_request(&mut out, &wqe, crc, mtu, msn, &mut |o: &mut Vec<u8>| {
                            if io.is_ok() {
                                io = w.put(o);
                            }
                            o.clear();
                        });
                    if io.is_ok() {
                        io = w.put(&mut out);
                    }
                    out.clear();
                    match result {
                        Ok(complete_now) if io.is_ok() && !w.tx.unsent.is_empty() => {
                            // The socket is full: the tx thread finishes this request.
                            w.tx.owed = Some((wqe, complete_now));
                            self.kick_tx();
                            return true;
                        }
                        Ok(complete_now) => self.settle(&wqe, io.is_ok(), complete_now),
                        Err(status) => {
                            let mut st = self.st.lock();
                            if let Some(i) =
                                st.inflight.iter().position(|f| !f.sent && f.wqe == wqe)
                            {
                                st.inflight.remove(i);
                            }
                            if wqe.opcode() == Some(WrOpcode::RdmaRead) {
                                st.orq.cancel(msn);
                            }
                            self.post_cqe(&mut st, &self.scq, cqe_for(&wqe, self.qpn, status, 0));
                            self.to_error(&mut st);
                        }
                    }
                    io
                }
            };
            if let Err(e) = r {
                tracing::debug!(qpn = self.qpn, error = %e, "siw transmit failed");
                drop(guard);
                self.connection_lost(false);
                return false;
            }
        }
    }

    /// The transmitter is finished with a request: its bytes are all out (`ok`) or the
    /// attempt failed. It is done now if `complete_now` (all but Reads, which wait for
    /// their response). A QP that went to Error meanwhile flushes what follows it now.
    fn settle(&self, wqe: &Wqe, ok: bool, complete_now: bool) {
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
    fn take_work(&self, mode: Mode, budget: &mut u32) -> Work {
        let mut st = self.st.lock();
        if mode == Mode::Inline && (st.terminate.is_some() || !st.responses.is_empty()) {
            st.kick = true; // Terminates and Read Responses go out from the tx thread
            self.cv.notify_one();
            return Work::Idle;
        }
        if let Some(t) = st.terminate.take() {
            st.closing = true;
            return Work::Raw(t);
        }
        if st.qp != QpState::Rts {
            return if st.closing || st.qp == QpState::Error {
                st.fin_sent = true;
                Work::Finish
            } else {
                Work::Idle
            };
        }
        if st.hold_until.is_some_and(|t| Instant::now() < t) && !st.closing {
            return Work::Idle; // the tx thread sends it when the wait is over
        }
        let (crc, mtu) = (st.crc, st.max_ulpdu);
        if let Some(rr) = st.responses.pop_front() {
            st.responding += 1;
            return Work::Response { rr, crc, mtu };
        }
        let mut sq = self.sq.lock();
        // Requests taken off the ring and not yet complete (behind an outstanding Read)
        // never exceed the ring's size, however fast the consumer refills it.
        if st.inflight.len() >= sq.capacity() as usize {
            return Work::Idle; // the Read Response that completes the oldest kicks us
        }
        let wqe = match sq.peek() {
            Ok(Some(w)) => w,
            Ok(None) => {
                drop(sq);
                return if st.closing && st.inflight.is_empty() {
                    st.fin_sent = true;
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
            RingStats::count(&self.stats.drain_budget_spent);
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
    fn emit_request(
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
        let max_inline = (self.caps.max_inline as usize).min(rnicpi::wr::MAX_INLINE);
        if u32::from(w.num_sge) > self.caps.max_send_sge
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
                        r.check(self.pd, s.addr, s.length as u64, Access::LOCAL_WRITE)
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
                Header {
                    opcode: Opcode::ReadRequest,
                    last: true,
                    model: Model::Untagged {
                        inv_stag: 0,
                        qn: wire::QN_READ,
                        msn,
                        mo: 0,
                    },
                }
                .emit(out);
                rr.emit(out);
                wire::finish_fpdu(out, start, crc).map_err(|_| WcStatus::LocLenErr)?;
                self.dev.counters.tx_fpdus.fetch_add(1, Ordering::Relaxed);
                Ok(false)
            }
            WrOpcode::LocalInv => {
                self.dev
                    .res
                    .mrs
                    .invalidate(w.imm_or_inv, self.pd)
                    .map_err(|_| WcStatus::LocProtErr)?;
                Ok(true)
            }
            WrOpcode::BindMw => {
                let b = w.bind_args();
                let access = b.access.ok_or(WcStatus::MwBindErr)?;
                self.dev
                    .res
                    .mrs
                    .bind_window(self.pd, b.mw_rkey, b.mr_lkey, b.addr, b.len, access)
                    .map_err(|e| {
                        tracing::debug!(qpn = self.qpn, error = %e, "memory window bind refused");
                        WcStatus::MwBindErr
                    })?;
                Ok(true)
            }
            _ => Err(WcStatus::LocQpOpErr),
        }
    }

    /// Segment one message (inline data or a gather list) into FPDUs.
    #[allow(clippy::too_many_arguments)]
    fn emit_message(
        &self,
        out: &mut Vec<u8>,
        w: &Wqe,
        crc: bool,
        max_ulpdu: usize,
        model: impl Fn(u64) -> Model,
        opcode: Opcode,
        flush: &mut dyn FnMut(&mut Vec<u8>),
    ) -> Result<(), WcStatus> {
        let hdr = if opcode.tagged() {
            wire::TAGGED_HDR
        } else {
            wire::UNTAGGED_HDR
        };
        let chunk = (max_ulpdu - hdr) as u64;
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
                .resolve_sgl(self.pd, w.sges(), Access::empty())
                .map_err(|_| WcStatus::LocProtErr)?,
        };
        let mut off = 0u64;
        loop {
            let n = (total - off).min(chunk);
            let start = wire::begin_fpdu(out);
            Header {
                opcode,
                last: off + n == total,
                model: model(off),
            }
            .emit(out);
            let p = out.len();
            out.resize(p + n as usize, 0);
            if w.is_inline() {
                out[p..].copy_from_slice(&w.inline_data[off as usize..(off + n) as usize]);
            } else {
                regions
                    .read_at(off, &mut out[p..], Access::empty())
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

    fn emit_read_response(
        &self,
        out: &mut Vec<u8>,
        rr: &ReadRequest,
        crc: bool,
        max_ulpdu: usize,
        flush: &mut dyn FnMut(&mut Vec<u8>) -> std::io::Result<()>,
    ) -> Result<std::io::Result<()>, TermCode> {
        let region = if rr.size > 0 {
            Some(
                self.dev
                    .res
                    .mrs
                    .lookup(rr.src_stag)
                    .map_err(|_| tagged_err(term::DDP_TAGGED_INV_STAG))?,
            )
        } else {
            None
        };
        let chunk = (max_ulpdu - wire::TAGGED_HDR) as u64;
        let total = rr.size as u64;
        let mut off = 0u64;
        loop {
            let n = (total - off).min(chunk);
            let start = wire::begin_fpdu(out);
            Header {
                opcode: Opcode::ReadResponse,
                last: off + n == total,
                model: Model::Tagged {
                    stag: rr.sink_stag,
                    to: rr.sink_to.wrapping_add(off),
                },
            }
            .emit(out);
            let p = out.len();
            out.resize(p + n as usize, 0);
            if let Some(r) = &region {
                r.read(self.pd, rr.src_to + off, &mut out[p..], Access::REMOTE_READ)
                    .map_err(access_term)?;
            }
            wire::finish_fpdu(out, start, crc).map_err(|_| TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_CATASTROPHIC_LOCAL,
            })?;
            self.dev.counters.tx_fpdus.fetch_add(1, Ordering::Relaxed);
            off += n;
            if off >= total {
                return Ok(Ok(()));
            }
            if out.len() >= TX_BATCH {
                if self.st.lock().qp != QpState::Rts {
                    // The QP failed meanwhile: abandon the response so the Terminate
                    // queued behind it goes out without waiting for the rest.
                    out.clear();
                    return Ok(Ok(()));
                }
                if let Err(e) = flush(out) {
                    return Ok(Err(e));
                }
            }
        }
    }

    // ---- completions ------------------------------------------------------------------

    /// Write a completion. A full CQ (or one whose ring the consumer corrupted) loses it:
    /// counted, the CQ reports `CqError`, and this QP, which can no longer report its
    /// work, goes to Error with a Terminate and `QpFatal` (as kernel siw does).
    fn post_cqe(&self, st: &mut State, cq: &Arc<dyn ProviderCq>, cqe: Cqe) {
        if cq.engine().push(cqe) {
            return;
        }
        self.dev
            .counters
            .cq_overflows
            .fetch_add(1, Ordering::Relaxed);
        if st.qp != QpState::Error {
            rnicpi::warn_limited!(qpn = self.qpn, "siw QP lost a completion: CQ overflow");
            self.terminate_locked(st, CQ_OVERFLOW, None);
            self.sink
                .deliver(Event::new(EventKind::QpFatal).with_status(libc::EOVERFLOW));
        }
    }

    /// Complete finished send-queue requests from the front, in order.
    fn complete_in_order(&self, st: &mut State) {
        while st.inflight.front().is_some_and(|f| f.sent && f.done) {
            let Some(f) = st.inflight.pop_front() else {
                break;
            };
            if f.wqe.signaled() {
                // Every request was held to at most u32::MAX bytes before it was sent.
                let len = u32::try_from(f.wqe.total_len()).unwrap_or(u32::MAX);
                self.post_cqe(
                    st,
                    &self.scq,
                    cqe_for(&f.wqe, self.qpn, WcStatus::Success, len),
                );
            }
        }
    }

    /// Move to Error: flush the send and receive queues with `WrFlushErr`. A request
    /// the transmitter is still writing, and everything behind it in the send queue,
    /// waits: the transmitter settles it (sent, or failed) and flushes again, so
    /// completions stay in order and nothing sent is reported as flushed.
    fn to_error(&self, st: &mut State) {
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
                self.post_cqe(st, &self.scq, cqe_for(&f.wqe, self.qpn, status, len));
            }
        }
        if sq_flushed {
            // Flush what is queued now, a fixed range: a consumer that keeps refilling
            // the ring gets the rest flushed at its next doorbell, never an endless loop.
            let flushed = self.sq.lock().drain_queued(|w| {
                self.post_cqe(
                    st,
                    &self.scq,
                    cqe_for(&w, self.qpn, WcStatus::WrFlushErr, 0),
                );
            });
            if flushed.is_err() {
                RingStats::count(&self.stats.wq_corrupt);
            }
        }
        if let Some(r) = st.cur_recv.take() {
            self.post_cqe(
                st,
                &self.rcq,
                cqe_for(&r.wqe, self.qpn, WcStatus::WrFlushErr, 0),
            );
        }
        if self.srq.is_some() {
            // The SRQ's receives belong to the other QPs; this one just stops taking them.
            if !st.last_wqe_sent {
                st.last_wqe_sent = true;
                self.sink.deliver(Event::new(EventKind::LastWqeReached));
            }
            return;
        }
        let flushed = self.rq.lock().drain_queued(|w| {
            self.post_cqe(
                st,
                &self.rcq,
                cqe_for(&w, self.qpn, WcStatus::WrFlushErr, 0),
            );
        });
        if flushed.is_err() {
            RingStats::count(&self.stats.wq_corrupt);
        }
    }

    /// The consumer corrupted the index of one of the QP's rings: the QP is in Error
    /// already; count it and tell the consumer.
    fn ring_corrupt(&self, which: &'static str) {
        RingStats::count(&self.stats.wq_corrupt);
        rnicpi::warn_limited!(
            qpn = self.qpn,
            which,
            "siw ring indices corrupt: QP in error"
        );
        self.sink
            .deliver(Event::new(EventKind::QpFatal).with_status(libc::EIO));
    }

    /// The next posted receive: from the SRQ when the QP has one, else its own queue.
    /// `None` when there is none, and when the ring is corrupt (counted; the missing
    /// buffer then terminates the connection and moves the QP to Error).
    fn take_recv(&self) -> Option<Wqe> {
        let taken = match &self.srq {
            Some(srq) => srq.engine().take(),
            None => {
                let r = self.rq.lock().pop();
                if r.is_err() {
                    RingStats::count(&self.stats.wq_corrupt);
                }
                r
            }
        };
        taken.ok().flatten()
    }

    /// A protocol error detected locally: queue a Terminate, go to Error, tell the consumer.
    fn fail(&self, code: TermCode, hdr: Option<&[u8]>) {
        let mut st = self.st.lock();
        if st.qp == QpState::Error {
            return;
        }
        rnicpi::warn_limited!(
            qpn = self.qpn,
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
        self.sink
            .deliver(Event::new(kind).with_status(libc::EPROTO));
        self.cv.notify_all();
    }

    /// Queue a Terminate with `code` (and the offending DDP header) for the tx thread to
    /// send as the connection's last FPDU, and move to Error.
    fn terminate_locked(&self, st: &mut State, code: TermCode, hdr: Option<&[u8]>) {
        if st.connected {
            self.dev
                .counters
                .terminates_sent
                .fetch_add(1, Ordering::Relaxed);
            let mut t = Vec::with_capacity(64);
            let start = wire::begin_fpdu(&mut t);
            Header {
                opcode: Opcode::Terminate,
                last: true,
                model: Model::Untagged {
                    inv_stag: 0,
                    qn: wire::QN_TERMINATE,
                    msn: 1,
                    mo: 0,
                },
            }
            .emit(&mut t);
            let mut ctrl = code.to_u32();
            if let Some(h) = hdr {
                ctrl |= 1 << 14; // D: the DDP segment header is included
                t.extend_from_slice(&ctrl.to_be_bytes());
                t.extend_from_slice(&h[..h.len().min(wire::UNTAGGED_HDR)]);
            } else {
                t.extend_from_slice(&ctrl.to_be_bytes());
            }
            let _ = wire::finish_fpdu(&mut t, start, st.crc);
            st.terminate = Some(t);
            st.term_pending = true;
        }
        self.to_error(st);
    }

    /// The connection ended (EOF, reset, or a write failure).
    pub(crate) fn connection_lost(&self, eof: bool) {
        let mut st = self.st.lock();
        let was_error = st.qp == QpState::Error;
        st.connected = false;
        st.term_pending = false;
        self.to_error(&mut st);
        let kind = if eof || st.local_close {
            EventKind::Disconnected
        } else {
            EventKind::ConnectionBroken
        };
        let first = !st.events_sent;
        st.events_sent = true;
        drop(st);
        if let Some(s) = self.ctl.lock().as_ref() {
            s.shutdown(Shutdown::Both);
        }
        if first {
            tracing::info!(qpn = self.qpn, ?kind, was_error, "siw connection closed");
            self.sink.deliver(Event::new(kind));
        }
    }

    // ---- receive ----------------------------------------------------------------------

    fn rx_loop(self: Arc<Self>, mut sock: TcpStream) {
        let mut buf = vec![0u8; 70 * 1024];
        loop {
            let mut len = [0u8; 2];
            match read_full(&mut sock, &mut len) {
                Ok(true) => {}
                Ok(false) => return self.connection_lost(true),
                Err(_) => return self.connection_lost(false),
            }
            let total = wire::fpdu_len(u16::from_be_bytes(len) as usize);
            buf[..2].copy_from_slice(&len);
            match read_full(&mut sock, &mut buf[2..total]) {
                Ok(true) => {}
                _ => return self.connection_lost(false),
            }
            if !self.receive_fpdu(&buf[..total]) {
                return self.finish_rx(sock);
            }
        }
    }

    /// Process one whole FPDU from the peer: check its framing and CRC, then place or
    /// queue what it carries; on any violation queue a Terminate and go to Error.
    /// Returns whether the QP still takes FPDUs.
    pub(crate) fn receive_fpdu(&self, fpdu: &[u8]) -> bool {
        let (crc, access) = {
            let st = self.st.lock();
            (st.crc, st.attr.access)
        };
        self.dev.counters.rx_fpdus.fetch_add(1, Ordering::Relaxed);
        self.dev
            .counters
            .rx_bytes
            .fetch_add(fpdu.len() as u64, Ordering::Relaxed);
        let u = match wire::check_fpdu(fpdu, crc) {
            Ok(u) => u,
            Err(e) => {
                if e == wire::WireError::BadCrc {
                    self.dev.counters.crc_errors.fetch_add(1, Ordering::Relaxed);
                }
                let ecode = if e == wire::WireError::BadCrc {
                    term::LLP_CRC
                } else {
                    term::LLP_BAD_FPDU
                };
                self.fail(
                    TermCode {
                        layer: term::LAYER_LLP,
                        etype: 0,
                        ecode,
                    },
                    None,
                );
                return false;
            }
        };
        if let Err(code) = self.on_ulpdu(u, access) {
            self.dev.counters.bad_fpdus.fetch_add(1, Ordering::Relaxed);
            self.fail(code, Some(&u[..u.len().min(wire::UNTAGGED_HDR)]));
            return false;
        }
        let mut st = self.st.lock();
        if st.hold_until.take().is_some() {
            // The Initiator's first FPDU: ours may follow now.
            st.kick = true;
            self.cv.notify_all();
        }
        st.qp != QpState::Error
    }

    /// After a local Terminate: keep reading (so the peer never stalls on a full window)
    /// until the tx side has written the Terminate, then half a second more so the peer
    /// can take it, then close. Bounded: a peer that reads nothing cannot hold us.
    fn finish_rx(&self, sock: TcpStream) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let _ = sock.set_read_timeout(Some(Duration::from_millis(50)));
        let mut sink = [0u8; 4096];
        let mut s = &sock;
        let mut linger_until = None;
        loop {
            let now = Instant::now();
            if linger_until.is_none() && !self.st.lock().term_pending {
                linger_until = Some(now + Duration::from_millis(500));
            }
            if now >= deadline || linger_until.is_some_and(|t| now >= t) {
                break;
            }
            match s.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(_) => break,
            }
        }
        self.connection_lost(false);
    }

    /// One ULPDU, under the QP's access flags `access`.
    fn on_ulpdu(&self, u: &[u8], access: Access) -> Result<(), TermCode> {
        let (h, payload) = Header::parse(u).map_err(|e| match e {
            wire::WireError::BadDdpVersion => TermCode {
                layer: term::LAYER_DDP,
                etype: term::DDP_CATASTROPHIC,
                ecode: term::DDP_INV_VERSION,
            },
            wire::WireError::BadRdmapVersion => TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_INV_VERSION,
            },
            wire::WireError::BadQueue(_) => TermCode {
                layer: term::LAYER_DDP,
                etype: term::DDP_UNTAGGED_BUF,
                ecode: term::DDP_UNTAGGED_INV_QN,
            },
            // The FPDU's length cannot hold the DDP header it announces.
            wire::WireError::Truncated => TermCode {
                layer: term::LAYER_LLP,
                etype: 0,
                ecode: term::LLP_BAD_FPDU,
            },
            _ => TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_UNEXPECTED_OP,
            },
        })?;
        match (h.opcode, h.model) {
            (Opcode::Write, Model::Tagged { stag, to }) => {
                require_qp_access(access, Access::REMOTE_WRITE)?;
                self.place_tagged(stag, to, payload, Access::REMOTE_WRITE)
            }
            (Opcode::ReadResponse, Model::Tagged { stag, to }) => {
                self.on_read_response(stag, to, h.last, payload)
            }
            (
                op,
                Model::Untagged {
                    inv_stag, msn, mo, ..
                },
            ) if op.is_send() => self.place_send(op, h.last, inv_stag, msn, mo, payload),
            (Opcode::ReadRequest, Model::Untagged { msn, mo, .. }) => {
                require_qp_access(access, Access::REMOTE_READ)?;
                self.on_read_request(h.last, msn, mo, payload)
            }
            (Opcode::Terminate, _) => {
                let code = payload
                    .get(..4)
                    .and_then(|b| b.try_into().ok())
                    .map(|b| TermCode::from_u32(u32::from_be_bytes(b)));
                rnicpi::warn_limited!(qpn = self.qpn, ?code, "siw peer terminated the connection");
                self.dev
                    .counters
                    .terminates_received
                    .fetch_add(1, Ordering::Relaxed);
                let mut st = self.st.lock();
                self.to_error(&mut st);
                drop(st);
                self.sink
                    .deliver(Event::new(EventKind::QpFatal).with_status(libc::ECONNABORTED));
                Ok(())
            }
            _ => Err(TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_UNEXPECTED_OP,
            }),
        }
    }

    fn place_tagged(&self, stag: u32, to: u64, data: &[u8], need: Access) -> Result<(), TermCode> {
        if data.is_empty() {
            return Ok(()); // zero-length: nothing is placed, no STag is checked
        }
        let r = self
            .dev
            .res
            .mrs
            .lookup(stag)
            .map_err(|_| tagged_err(term::DDP_TAGGED_INV_STAG))?;
        r.write(self.pd, to, data, need).map_err(access_term)
    }

    /// A Read Response segment: accepted only as the next bytes of the oldest
    /// outstanding read (checked by the ORQ before anything is placed), placed into that
    /// read's sink, and the read completed with its last segment.
    fn on_read_response(
        &self,
        stag: u32,
        to: u64,
        last: bool,
        data: &[u8],
    ) -> Result<(), TermCode> {
        let p: Placement = self.st.lock().orq.check(stag, to, data.len(), last)?;
        // Placed without the state lock: only this thread consumes the ORQ's front, and
        // a queue cleared meanwhile (QP to Error) ignores the placement below.
        self.place_tagged(p.stag, p.to, data, Access::LOCAL_WRITE)?;
        let mut st = self.st.lock();
        if st.orq.advance(&p).is_none() || st.qp != QpState::Rts {
            return Ok(());
        }
        if let Some(f) = st
            .inflight
            .iter_mut()
            .find(|f| !f.done && f.wqe.opcode() == Some(WrOpcode::RdmaRead))
        {
            f.done = true;
        }
        self.complete_in_order(&mut st);
        st.kick = true; // an ORD slot is free
        self.cv.notify_all();
        Ok(())
    }

    fn place_send(
        &self,
        op: Opcode,
        last: bool,
        inv_stag: u32,
        msn: u32,
        mo: u32,
        data: &[u8],
    ) -> Result<(), TermCode> {
        let untagged = |ecode| TermCode {
            layer: term::LAYER_DDP,
            etype: term::DDP_UNTAGGED_BUF,
            ecode,
        };
        let mut st = self.st.lock();
        if msn != st.rx_msn_send {
            return Err(untagged(term::DDP_UNTAGGED_INV_MSN));
        }
        if st.cur_recv.is_none() {
            if mo != 0 {
                return Err(untagged(term::DDP_UNTAGGED_INV_MO));
            }
            let Some(w) = self.take_recv() else {
                return Err(untagged(term::DDP_UNTAGGED_NO_BUF));
            };
            st.cur_recv = Some(RecvInProgress {
                total: w.total_len(),
                wqe: w,
                received: 0,
            });
        }
        let Some(rip) = st.cur_recv.as_mut() else {
            return Err(untagged(term::DDP_UNTAGGED_NO_BUF));
        };
        let end = next_offset(rip, mo, data.len())?;
        // Scatter into the receive's SGEs starting at message offset `mo`.
        self.dev
            .res
            .mrs
            .scatter(self.pd, rip.wqe.sges(), mo.into(), data)
            .map_err(|_| untagged(term::DDP_UNTAGGED_NO_BUF))?;
        rip.received = end;
        if !last {
            return Ok(());
        }
        let Some(rip) = st.cur_recv.take() else {
            return Ok(());
        };
        st.rx_msn_send = st.rx_msn_send.wrapping_add(1);
        let mut cqe = cqe_for(&rip.wqe, self.qpn, WcStatus::Success, rip.received);
        if op.solicited() {
            cqe.flags |= wc_flags::SOLICITED;
        }
        if op.invalidates() {
            if let Err(code) = self.remote_invalidate(inv_stag) {
                cqe.status = WcStatus::RemInvReqErr as u8;
                self.post_cqe(&mut st, &self.rcq, cqe);
                return Err(code);
            }
            cqe.flags |= wc_flags::WITH_INV;
            cqe.imm_or_inv = inv_stag;
        }
        self.post_cqe(&mut st, &self.rcq, cqe);
        Ok(())
    }

    /// Send with Invalidate: the peer may invalidate only what it was given remote
    /// access to — a memory window, or a registration with remote rights — of this
    /// QP's protection domain (`docs/security.md`, M6). A local-only buffer (a receive
    /// buffer, a Read sink) cannot be taken away from the consumer by a peer.
    fn remote_invalidate(&self, stag: u32) -> Result<(), TermCode> {
        let refused = TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_CANNOT_INVALIDATE,
        };
        let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        let r = self.dev.res.mrs.lookup(stag).map_err(|_| refused)?;
        if r.pd != self.pd || !(r.is_window() || r.access.intersects(remote)) {
            return Err(refused);
        }
        r.invalidate();
        Ok(())
    }

    fn on_read_request(
        &self,
        last: bool,
        msn: u32,
        mo: u32,
        payload: &[u8],
    ) -> Result<(), TermCode> {
        let untagged = |ecode| TermCode {
            layer: term::LAYER_DDP,
            etype: term::DDP_UNTAGGED_BUF,
            ecode,
        };
        let rr = ReadRequest::parse(payload).map_err(|_| untagged(term::DDP_UNTAGGED_TOO_LONG))?;
        let mut st = self.st.lock();
        if msn != st.rx_msn_read {
            return Err(untagged(term::DDP_UNTAGGED_INV_MSN));
        }
        if mo != 0 || !last {
            return Err(untagged(term::DDP_UNTAGGED_INV_MO));
        }
        if st.responses.len() as u32 + st.responding >= st.ird {
            return Err(TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_CATASTROPHIC_LOCAL,
            });
        }
        if rr.size > 0 {
            let r = self.dev.res.mrs.lookup(rr.src_stag).map_err(|_| TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_PROT,
                ecode: term::RDMAP_INV_STAG,
            })?;
            r.check(self.pd, rr.src_to, rr.size as u64, Access::REMOTE_READ)
                .map_err(access_term_rdmap)?;
        }
        st.rx_msn_read = st.rx_msn_read.wrapping_add(1);
        st.responses.push_back(rr);
        st.kick = true;
        self.cv.notify_all();
        Ok(())
    }

    /// Close locally: orderly (a FIN once the send queue has drained) or abortive (a TCP
    /// reset now, as for a destroyed QP or a dead process; outstanding work flushes).
    pub(crate) fn begin_close(&self, abortive: bool) {
        {
            let mut st = self.st.lock();
            st.local_close = true;
            if !abortive {
                st.closing = true;
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
        let mut st = self.st.lock();
        self.to_error(&mut st);
    }
}

// A WQE is moved once per request; boxing it would add an allocation to the data path.
#[allow(clippy::large_enum_variant)]
enum Work {
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

/// The negotiated parameters a connection starts with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attach {
    pub crc: bool,
    pub ird: u32,
    pub ord: u32,
}

/// The QP's own access flags must allow an incoming RDMA Write or Read at all, whatever
/// the registration it names would allow (RFC 5040: access violation).
fn require_qp_access(access: Access, need: Access) -> Result<(), TermCode> {
    if access.contains(need) {
        Ok(())
    } else {
        Err(TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_ACCESS,
        })
    }
}

fn tagged_err(ecode: u8) -> TermCode {
    TermCode {
        layer: term::LAYER_DDP,
        etype: term::DDP_TAGGED_BUF,
        ecode,
    }
}

fn access_term(e: AccessError) -> TermCode {
    match e {
        AccessError::InvalidStag | AccessError::Invalidated => {
            tagged_err(term::DDP_TAGGED_INV_STAG)
        }
        AccessError::OutOfBounds => tagged_err(term::DDP_TAGGED_BASE_BOUNDS),
        AccessError::PdMismatch => TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_STAG_NOT_ASSOC,
        },
        AccessError::NoRight => TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_ACCESS,
        },
        AccessError::Fault => TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_OP,
            ecode: term::RDMAP_CATASTROPHIC_LOCAL,
        },
    }
}

fn access_term_rdmap(e: AccessError) -> TermCode {
    let ecode = match e {
        AccessError::InvalidStag | AccessError::Invalidated => term::RDMAP_INV_STAG,
        AccessError::OutOfBounds => term::RDMAP_BASE_BOUNDS,
        AccessError::PdMismatch => term::RDMAP_STAG_NOT_ASSOC,
        AccessError::NoRight | AccessError::Fault => term::RDMAP_ACCESS,
    };
    TermCode {
        layer: term::LAYER_RDMAP,
        etype: term::RDMAP_REMOTE_PROT,
        ecode,
    }
}

pub(crate) fn cqe_for(w: &Wqe, qpn: u32, status: WcStatus, byte_len: u32) -> Cqe {
    Cqe {
        wr_id: w.wr_id,
        status: status as u8,
        opcode: w.opcode().map(|o| o.wc_opcode() as u8).unwrap_or(0),
        flags: 0,
        _reserved: 0,
        byte_len,
        qp_num: qpn,
        imm_or_inv: 0,
        src_qp: 0,
        vendor_err: 0,
    }
}

/// Read exactly `buf.len()` bytes; Ok(false) on a clean EOF before the first byte.
fn read_full(s: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

impl ProviderQp for SiwQp {
    fn qp_num(&self) -> u32 {
        self.qpn
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
                QpState::Rts | QpState::Sqd if !st.connected => return Err(VerbsError::BadState),
                QpState::Error => {
                    drop(st);
                    self.begin_close(true);
                    return Ok(());
                }
                QpState::Reset if st.connected => return Err(VerbsError::BadState),
                _ => self.set_state(&mut st, to),
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
        {
            let mut st = self.st.lock();
            if st.qp == QpState::Error {
                // Work posted to a QP in Error completes flushed right away.
                self.to_error(&mut st);
                return;
            }
            st.kick = true;
        }
        // Small requests go out inline in the caller's thread while the socket takes
        // them; nothing here ever waits for the socket or for the tx thread.
        self.pump(Mode::Inline);
        self.cv.notify_one();
    }

    fn connect(&self, peer: std::net::SocketAddr, param: ConnParam) -> Result<()> {
        let me = self.me.upgrade().ok_or(VerbsError::BadState)?;
        if param.private_data.len() + 4 > wire::MPA_MAX_PDATA {
            return Err(VerbsError::Invalid);
        }
        {
            let mut st = self.st.lock();
            if st.connected
                || st.connecting
                || !matches!(st.qp, QpState::Reset | QpState::Init | QpState::Rtr)
            {
                return Err(VerbsError::BadState);
            }
            st.connecting = true;
        }
        let started = crate::cm::connect(me, peer, param);
        if started.is_err() {
            self.st.lock().connecting = false;
        }
        started
    }

    fn disconnect(&self, abortive: bool) -> Result<()> {
        if !self.st.lock().connected {
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
            st.connected && !st.fin_sent
        };
        if abort {
            self.begin_close(true);
        }
        let mut st = self.st.lock();
        st.local_close = true;
        st.events_sent = true;
        self.to_error(&mut st);
        drop(st);
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

/// Build the MPA frame a side sends, from its negotiated or offered parameters.
/// An MPA frame of `revision` (2 carries the RFC 6581 IRD/ORD words, 1 does not).
pub(crate) fn mpa_frame(
    reply: bool,
    crc: bool,
    reject: bool,
    revision: u8,
    ird: u32,
    ord: u32,
    pdata: &[u8],
) -> MpaFrame {
    let word = |v: u32| v.min(wire::RFC6581_MASK as u32) as u16;
    MpaFrame {
        reply,
        markers: false,
        crc,
        reject,
        revision,
        ird_ord: (revision == 2).then(|| (word(ird), word(ord))),
        private_data: pdata.to_vec(),
    }
}

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
