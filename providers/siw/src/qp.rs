//! The siw queue pair: requester (send queue → FPDUs), responder (FPDUs → placements,
//! receive completions, Read Responses), Terminate, flush, and the two I/O threads.
//!
//! Locking: `st` (protocol state) is held only briefly and never across socket I/O;
//! `tx` serialises transmission (the tx thread, or a doorbell transmitting small requests
//! inline); the rx thread only reads the socket and never writes to it, so two peers
//! that both send large messages cannot deadlock on full TCP buffers.

use crate::device::Shared;
use crate::wire::{self, term, Header, Model, MpaFrame, Opcode, ReadRequest, TermCode};
use parking_lot::{Condvar, Mutex};
use rnicpi::*;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

/// A completion queue of the siw device.
pub struct SiwCq(pub EngineCq);

impl ProviderCq for SiwCq {
    fn engine(&self) -> &EngineCq {
        &self.0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A shared receive queue of the siw device: QPs attached to it take their receives
/// from its ring when a Send arrives.
pub struct SiwSrq(pub EngineSrq);

impl ProviderSrq for SiwSrq {
    fn engine(&self) -> &EngineSrq {
        &self.0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct Inflight {
    wqe: Wqe,
    done: bool,
}

/// The inbound Send message being placed into a posted receive.
struct RecvInProgress {
    wqe: Wqe,
    received: u32,
    total: u64,
}

struct State {
    qp: QpState,
    attr: QpAttr,
    connected: bool,
    crc: bool,
    ird: u32,
    ord: u32,
    max_ulpdu: usize,
    inflight: VecDeque<Inflight>,
    reads_outstanding: u32,
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
    /// Local side asked for the close (Disconnected rather than ConnectionBroken).
    local_close: bool,
    events_sent: bool,
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
    tx: Mutex<Option<TcpStream>>,
    /// A handle on the same socket for shutting it down: never held across I/O, so an
    /// abortive close works while the tx thread is blocked writing to a stalled peer.
    ctl: Mutex<Option<TcpStream>>,
    me: Weak<SiwQp>,
}

/// Room for a batch of FPDUs per socket write.
const TX_BATCH: usize = 256 * 1024;
/// Largest request a doorbell transmits inline in the caller's thread.
const INLINE_TX: u64 = 16 * 1024;

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
                attr: QpAttr::default(),
                connected: false,
                crc: false,
                ird: 0,
                ord: 0,
                max_ulpdu: 1024,
                inflight: VecDeque::new(),
                reads_outstanding: 0,
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
                local_close: false,
                events_sent: false,
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

    /// Hand the connected stream to the engine: QP to RTS, start the I/O threads.
    pub(crate) fn attach(
        self: &Arc<Self>,
        stream: TcpStream,
        crc: bool,
        ird: u32,
        ord: u32,
    ) -> Result<()> {
        let _ = stream.set_nodelay(true);
        let mss = tcp_mss(&stream).unwrap_or(1460);
        let rx = stream.try_clone()?;
        let ctl = stream.try_clone()?;
        {
            let mut st = self.st.lock();
            if st.connected || matches!(st.qp, QpState::Error) {
                return Err(VerbsError::BadState);
            }
            st.connected = true;
            st.crc = crc;
            st.ird = ird.max(1);
            st.ord = ord.max(1);
            st.max_ulpdu = wire::max_ulpdu_for_mss(mss);
            self.set_state(&mut st, QpState::Rts);
        }
        *self.ctl.lock() = Some(ctl);
        *self.tx.lock() = Some(stream);
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
        )?;
        spawn(format!("siw-tx{}", self.qpn), Box::new(move || b.tx_loop()))?;
        self.dev
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(qpn = self.qpn, crc, ird, ord, mss, "siw QP connected");
        Ok(())
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
                while !st.kick
                    && st.terminate.is_none()
                    && st.responses.is_empty()
                    && !st.closing
                    && st.qp == QpState::Rts
                {
                    self.cv.wait(&mut st);
                }
                st.kick = false;
            }
            if !self.pump(u64::MAX) {
                return;
            }
        }
    }

    /// Transmit what is ready: a pending Terminate, Read Responses, then send-queue work.
    /// Requests larger than `limit` are left for the tx thread, and so is everything past
    /// one ring's worth of send-queue entries (local operations included): however the
    /// consumer churns its ring, one call does bounded work. Returns false once the
    /// connection is finished. The protocol-state lock is never held while writing.
    fn pump(&self, limit: u64) -> bool {
        let mut budget = self.sq.lock().capacity();
        let guard = self.tx.lock();
        let Some(sock) = guard.as_ref() else {
            return false;
        };
        let mut out = Vec::with_capacity(64 * 1024);
        let counters = &self.dev.counters;
        let mut flush = |out: &mut Vec<u8>| -> std::io::Result<()> {
            if !out.is_empty() {
                (&*sock).write_all(out)?;
                counters
                    .tx_bytes
                    .fetch_add(out.len() as u64, Ordering::Relaxed);
                out.clear();
            }
            Ok(())
        };
        loop {
            let work = self.take_work(limit, &mut budget);
            let r = match work {
                Work::Idle => return true,
                Work::Close { abortive } => {
                    if abortive {
                        set_linger_zero(sock);
                        let _ = sock.shutdown(Shutdown::Both);
                    } else {
                        let _ = sock.shutdown(Shutdown::Write);
                    }
                    return false;
                }
                Work::Raw(bytes) => {
                    out.extend_from_slice(&bytes);
                    let r = flush(&mut out);
                    self.st.lock().term_pending = false;
                    r
                }
                Work::Response { rr, crc, mtu } => {
                    let sent = self.emit_read_response(&mut out, &rr, crc, mtu, &mut flush);
                    // The IRD slot frees before the last FPDUs leave: the peer may send its
                    // next Read Request the moment it has them.
                    {
                        let mut st = self.st.lock();
                        st.responding = st.responding.saturating_sub(1);
                    }
                    let sent = sent.map(|r| r.and_then(|_| flush(&mut out)));
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
                                io = flush(o);
                            }
                            o.clear();
                        });
                    if io.is_ok() {
                        io = flush(&mut out);
                    }
                    out.clear();
                    let mut st = self.st.lock();
                    match result {
                        Ok(complete_now) => {
                            if complete_now {
                                if let Some(f) = st
                                    .inflight
                                    .iter_mut()
                                    .find(|f| !f.done && f.wqe.wr_id == wqe.wr_id && f.wqe == wqe)
                                {
                                    f.done = true;
                                }
                                self.complete_in_order(&mut st);
                            }
                        }
                        Err(status) => {
                            if let Some(i) =
                                st.inflight.iter().position(|f| !f.done && f.wqe == wqe)
                            {
                                st.inflight.remove(i);
                            }
                            self.post_cqe(&self.scq, cqe_for(&wqe, self.qpn, status, 0));
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

    /// Decide the next transmission under the state lock (and reserve its resources).
    /// Send-queue entries spend `budget`; once it is spent the rest is left to the tx
    /// thread's next round.
    fn take_work(&self, limit: u64, budget: &mut u32) -> Work {
        let mut st = self.st.lock();
        if let Some(t) = st.terminate.take() {
            st.closing = true;
            return Work::Raw(t);
        }
        if st.qp != QpState::Rts {
            return if st.closing || st.qp == QpState::Error {
                Work::Close { abortive: false }
            } else {
                Work::Idle
            };
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
                    Work::Close { abortive: false }
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
        if op == Some(WrOpcode::RdmaRead) && st.reads_outstanding >= st.ord {
            return Work::Idle; // the Read Response that frees a slot kicks us again
        }
        if wqe.total_len() > limit {
            st.kick = true;
            self.cv.notify_one();
            return Work::Idle;
        }
        *budget -= 1;
        sq.advance();
        drop(sq);
        let msn = match op {
            Some(WrOpcode::RdmaRead) => {
                st.reads_outstanding += 1;
                let m = st.tx_msn_read;
                st.tx_msn_read = m.wrapping_add(1);
                m
            }
            Some(WrOpcode::Send | WrOpcode::SendWithInv) => {
                let m = st.tx_msn_send;
                st.tx_msn_send = m.wrapping_add(1);
                m
            }
            _ => 0,
        };
        st.inflight.push_back(Inflight { wqe, done: false });
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
                    .mrs
                    .invalidate(w.imm_or_inv, self.pd)
                    .map_err(|_| WcStatus::LocProtErr)?;
                Ok(true)
            }
            WrOpcode::BindMw => {
                let b = w.bind_args();
                let access = b.access.ok_or(WcStatus::MwBindErr)?;
                self.dev
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
        let mut regions = Vec::with_capacity(w.sges().len());
        if !w.is_inline() {
            for s in w.sges() {
                if s.length == 0 {
                    continue;
                }
                let r = self
                    .dev
                    .mrs
                    .lookup(s.lkey)
                    .map_err(|_| WcStatus::LocProtErr)?;
                r.check(self.pd, s.addr, s.length as u64, Access::empty())
                    .map_err(|_| WcStatus::LocProtErr)?;
                regions.push((r, *s));
            }
        }
        let mut off = 0u64;
        let (mut sge_i, mut sge_off) = (0usize, 0u64);
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
                let mut filled = 0usize;
                while filled < n as usize {
                    let (r, s) = &regions[sge_i];
                    let take = ((s.length as u64 - sge_off) as usize).min(n as usize - filled);
                    r.read(
                        self.pd,
                        s.addr + sge_off,
                        &mut out[p + filled..p + filled + take],
                        Access::empty(),
                    )
                    .map_err(|_| WcStatus::LocProtErr)?;
                    filled += take;
                    sge_off += take as u64;
                    if sge_off == s.length as u64 {
                        sge_i += 1;
                        sge_off = 0;
                    }
                }
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

    fn post_cqe(&self, cq: &Arc<dyn ProviderCq>, cqe: Cqe) {
        if !cq.engine().push(cqe) {
            self.dev
                .counters
                .cq_overflows
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Complete finished send-queue requests from the front, in order.
    fn complete_in_order(&self, st: &mut State) {
        while st.inflight.front().is_some_and(|f| f.done) {
            let f = st.inflight.pop_front().unwrap();
            if f.wqe.signaled() {
                self.post_cqe(
                    &self.scq,
                    cqe_for(
                        &f.wqe,
                        self.qpn,
                        WcStatus::Success,
                        f.wqe.total_len() as u32,
                    ),
                );
            }
        }
    }

    /// Move to Error: flush the send and receive queues with `WrFlushErr`.
    fn to_error(&self, st: &mut State) {
        self.set_state(st, QpState::Error);
        self.cv.notify_all();
        for f in st.inflight.drain(..).collect::<Vec<_>>() {
            let status = if f.done {
                WcStatus::Success
            } else {
                WcStatus::WrFlushErr
            };
            if f.wqe.signaled() || status != WcStatus::Success {
                self.post_cqe(&self.scq, cqe_for(&f.wqe, self.qpn, status, 0));
            }
        }
        st.reads_outstanding = 0;
        st.responses.clear();
        // Flush what is queued now, a fixed range: a consumer that keeps refilling the
        // ring gets the rest flushed at its next doorbell, never an endless loop here.
        let flushed = self.sq.lock().drain_queued(|w| {
            self.post_cqe(&self.scq, cqe_for(&w, self.qpn, WcStatus::WrFlushErr, 0));
        });
        if flushed.is_err() {
            RingStats::count(&self.stats.wq_corrupt);
        }
        if let Some(r) = st.cur_recv.take() {
            self.post_cqe(
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
            self.post_cqe(&self.rcq, cqe_for(&w, self.qpn, WcStatus::WrFlushErr, 0));
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
        tracing::warn!(
            qpn = self.qpn,
            layer = code.layer,
            etype = code.etype,
            ecode = code.ecode,
            "siw QP terminating"
        );
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
        self.to_error(&mut st);
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

    /// The connection ended (EOF, reset, or a write failure).
    fn connection_lost(&self, eof: bool) {
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
            let _ = s.shutdown(Shutdown::Both);
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
            let crc = self.st.lock().crc;
            let mut len = [0u8; 2];
            match read_full(&mut sock, &mut len) {
                Ok(true) => {}
                Ok(false) => return self.connection_lost(true),
                Err(_) => return self.connection_lost(false),
            }
            let ulpdu = u16::from_be_bytes(len) as usize;
            let total = wire::fpdu_len(ulpdu);
            buf[..2].copy_from_slice(&len);
            match read_full(&mut sock, &mut buf[2..total]) {
                Ok(true) => {}
                _ => return self.connection_lost(false),
            }
            self.dev.counters.rx_fpdus.fetch_add(1, Ordering::Relaxed);
            self.dev
                .counters
                .rx_bytes
                .fetch_add(total as u64, Ordering::Relaxed);
            let u = match wire::check_fpdu(&buf[..total], crc) {
                Ok(u) => u,
                Err(wire::WireError::BadCrc) => {
                    self.dev.counters.crc_errors.fetch_add(1, Ordering::Relaxed);
                    self.fail(
                        TermCode {
                            layer: term::LAYER_LLP,
                            etype: 0,
                            ecode: term::LLP_CRC,
                        },
                        None,
                    );
                    return self.finish_rx(sock);
                }
                Err(_) => {
                    self.fail(
                        TermCode {
                            layer: term::LAYER_LLP,
                            etype: 0,
                            ecode: term::LLP_BAD_FPDU,
                        },
                        None,
                    );
                    return self.finish_rx(sock);
                }
            };
            if let Err(code) = self.on_ulpdu(u) {
                self.dev.counters.bad_fpdus.fetch_add(1, Ordering::Relaxed);
                let hdr = u[..u.len().min(wire::UNTAGGED_HDR)].to_vec();
                self.fail(code, Some(&hdr));
                return self.finish_rx(sock);
            }
            if self.st.lock().qp == QpState::Error {
                return self.finish_rx(sock);
            }
        }
    }

    /// After a local Terminate: keep reading (so the peer never stalls on a full window)
    /// until the tx side has written the Terminate, then half a second more so the peer
    /// can take it, then close. Bounded: a peer that reads nothing cannot hold us.
    fn finish_rx(&self, sock: TcpStream) {
        use std::time::{Duration, Instant};
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

    fn on_ulpdu(&self, u: &[u8]) -> Result<(), TermCode> {
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
                self.place_tagged(stag, to, payload, Access::REMOTE_WRITE)
            }
            (Opcode::ReadResponse, Model::Tagged { stag, to }) => {
                self.place_tagged(stag, to, payload, Access::LOCAL_WRITE)?;
                if h.last {
                    self.read_response_done()?;
                }
                Ok(())
            }
            (
                op,
                Model::Untagged {
                    inv_stag, msn, mo, ..
                },
            ) if op.is_send() => self.place_send(op, h.last, inv_stag, msn, mo, payload),
            (Opcode::ReadRequest, Model::Untagged { msn, mo, .. }) => {
                self.on_read_request(h.last, msn, mo, payload)
            }
            (Opcode::Terminate, _) => {
                let code = payload
                    .get(..4)
                    .map(|b| TermCode::from_u32(u32::from_be_bytes(b.try_into().unwrap())));
                tracing::warn!(qpn = self.qpn, ?code, "siw peer terminated the connection");
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
        if data.is_empty() && need == Access::REMOTE_WRITE {
            return Ok(()); // zero-length write: nothing is placed, no STag is checked
        }
        let r = self
            .dev
            .mrs
            .lookup(stag)
            .map_err(|_| tagged_err(term::DDP_TAGGED_INV_STAG))?;
        r.write(self.pd, to, data, need).map_err(access_term)
    }

    fn read_response_done(&self) -> Result<(), TermCode> {
        let mut st = self.st.lock();
        let Some(f) = st
            .inflight
            .iter_mut()
            .find(|f| !f.done && f.wqe.opcode() == Some(WrOpcode::RdmaRead))
        else {
            return Err(TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_UNEXPECTED_OP,
            });
        };
        f.done = true;
        st.reads_outstanding = st.reads_outstanding.saturating_sub(1);
        self.complete_in_order(&mut st);
        st.kick = true;
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
        let rip = st.cur_recv.as_mut().unwrap();
        if mo != rip.received {
            return Err(untagged(term::DDP_UNTAGGED_INV_MO));
        }
        if mo as u64 + data.len() as u64 > rip.total {
            return Err(untagged(term::DDP_UNTAGGED_TOO_LONG));
        }
        // Scatter into the receive's SGEs starting at message offset `mo`.
        let mut skip = mo as u64;
        let mut left = data;
        for s in rip.wqe.sges() {
            if left.is_empty() {
                break;
            }
            if skip >= s.length as u64 {
                skip -= s.length as u64;
                continue;
            }
            let take = ((s.length as u64 - skip) as usize).min(left.len());
            let r = self
                .dev
                .mrs
                .lookup(s.lkey)
                .map_err(|_| untagged(term::DDP_UNTAGGED_NO_BUF))?;
            r.write(self.pd, s.addr + skip, &left[..take], Access::LOCAL_WRITE)
                .map_err(|_| untagged(term::DDP_UNTAGGED_NO_BUF))?;
            left = &left[take..];
            skip = 0;
        }
        rip.received += data.len() as u32;
        if !last {
            return Ok(());
        }
        let rip = st.cur_recv.take().unwrap();
        st.rx_msn_send = st.rx_msn_send.wrapping_add(1);
        let mut cqe = cqe_for(&rip.wqe, self.qpn, WcStatus::Success, rip.received);
        if op.solicited() {
            cqe.flags |= wc_flags::SOLICITED;
        }
        if op.invalidates() {
            if self.dev.mrs.invalidate(inv_stag, self.pd).is_err() {
                return Err(TermCode {
                    layer: term::LAYER_RDMAP,
                    etype: term::RDMAP_REMOTE_PROT,
                    ecode: term::RDMAP_CANNOT_INVALIDATE,
                });
            }
            cqe.flags |= wc_flags::WITH_INV;
            cqe.imm_or_inv = inv_stag;
        }
        drop(st);
        self.post_cqe(&self.rcq, cqe);
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
            let r = self.dev.mrs.lookup(rr.src_stag).map_err(|_| TermCode {
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

    pub(crate) fn begin_close(&self, abortive: bool) {
        let mut st = self.st.lock();
        st.local_close = true;
        if abortive {
            self.to_error(&mut st);
        } else {
            st.closing = true;
        }
        self.cv.notify_all();
        drop(st);
        // Lock order: the tx thread holds `tx` and then takes `st`; the socket is shut
        // down here through `ctl`, taken without `st` held.
        if abortive {
            if let Some(s) = self.ctl.lock().as_ref() {
                set_linger_zero(s);
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

// A WQE is moved once per request; boxing it would add an allocation to the data path.
#[allow(clippy::large_enum_variant)]
enum Work {
    Idle,
    Close {
        abortive: bool,
    },
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

fn tcp_mss(s: &TcpStream) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes one c_int into `v` and its size into `l`.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            &mut v as *mut _ as *mut libc::c_void,
            &mut l,
        )
    };
    (r == 0 && v > 0).then_some(v as usize)
}

pub(crate) fn set_linger_zero(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads one linger struct of the given size.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
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
                    self.to_error(&mut st);
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
        // Small requests go out inline in the caller's thread when nobody is transmitting.
        let inline_ok = self.tx.try_lock().is_some_and(|g| g.is_some());
        if inline_ok {
            self.pump(INLINE_TX);
        }
        self.cv.notify_one();
    }

    fn connect(&self, peer: std::net::SocketAddr, param: ConnParam) -> Result<()> {
        let me = self.me.upgrade().ok_or(VerbsError::BadState)?;
        {
            let st = self.st.lock();
            if st.connected || !matches!(st.qp, QpState::Reset | QpState::Init | QpState::Rtr) {
                return Err(VerbsError::BadState);
            }
        }
        if param.private_data.len() + 4 > wire::MPA_MAX_PDATA {
            return Err(VerbsError::Invalid);
        }
        std::thread::Builder::new()
            .name("siw-connect".into())
            .spawn(move || crate::cm::active_connect(me, peer, param))?;
        Ok(())
    }

    fn disconnect(&self, abortive: bool) -> Result<()> {
        if !self.st.lock().connected {
            return Err(VerbsError::BadState);
        }
        self.begin_close(abortive);
        Ok(())
    }

    fn destroy(&self) {
        let connected = self.st.lock().connected;
        if connected {
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
