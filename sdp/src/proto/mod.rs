//! The SDP protocol state machine of one connection, without I/O.
//!
//! A [`Connection`] is plain state. Its driver (`crate::conn`, over IT-API endpoints; the
//! tests, over memory) feeds it what happened — a message in receive buffer `b`, a
//! receive buffer posted again, an RDMA Read done, the time — and asks it what to do:
//! [`poll_transmit`](Connection::poll_transmit) writes the next message to send into a send
//! slot, [`next_read`](Connection::next_read) says where the next bytes for the reader are
//! (a receive buffer to copy from, or the peer's advertised buffer to RDMA Read),
//! [`poll_event`](Connection::poll_event) reports the end of a zero-copy send.
//! Time is an argument ([`Instant`]), never read here.
//!
//! ## Flow control (buffered copy)
//!
//! Every message goes into one of the receiver's posted receive buffers. Each message
//! carries `bufs`, the sender's posted buffers, and `mseq_ack`, the last message it
//! received; the receiver of it may send `bufs - (messages it sent after mseq_ack)` more
//! messages (its credits). Every message but one kind needs two credits: the last credit
//! is kept for a credit update (an empty Data message), sent once it can give the peer at
//! least half our buffers more. A side thus spends its last credit only on handing the
//! peer many, and two peers are never both left without credits (DisConn too needs two).
//! A receive buffer holding data is posted again only once the reader has taken its
//! bytes (one copy, from the buffer into the reader's memory).
//! One extra buffer is posted and never advertised: a peer that sends beyond its credits
//! lands there and is refused ([`ConnError::Protocol`], `CreditViolation`).
//!
//! ## Zero copy (read based)
//!
//! A writer with at least `zcopy_threshold` bytes and nothing buffered before them sends
//! SrcAvail (its registered buffer); the reader RDMA Reads from it straight into its own
//! memory and answers RdmaRdCompl with the bytes read, as often as it takes. A sink that
//! does not want zero copy answers SendSm; a source that gives up (a timeout, a signal)
//! sends SrcAvailCancel and waits for the sink's SendSm. After SendSm the source sends
//! what was not read by buffered copy.
//!
//! ## Zero copy (write based)
//!
//! A reader that finds nothing to read, asking for at least `zcopy_threshold` bytes,
//! advertises its landing buffer (SinkAvail). A writer holding a sink advert and at least
//! that many bytes queued (or the advert's size) moves them with one RDMA Write into it
//! and sends RdmaWrCompl right after (the write lands before the message on the reliable
//! connection); the reader takes the bytes from its landing buffer in their place in the
//! stream. A sink that takes its advert back (SinkAvailCancel) is answered SinkCancelAck.
//! See `write_zcopy.rs`.
//!
//! Over 600 lines: one connection's protocol machine, whose buffered-copy, zero-copy,
//! credit and close paths share its state (tests are in `tests.rs`; write-based zero
//! copy is in `write_zcopy.rs`).

mod counters;
pub mod sim;
#[cfg(test)]
mod tests;
mod write_zcopy;

pub use write_zcopy::RdmaWrite;

pub use counters::Counters;

use crate::wire::{
    self, Advert, Body, Bsdh, Hello, HelloAck, Message, BSDH_LEN, FLAG_OOB_PEND, FLAG_OOB_PRES,
};
use std::collections::VecDeque;
use std::net::IpAddr;
use std::time::{Duration, Instant};
use thiserror::Error;

/// A receive buffer, named by the driver.
pub type BufId = u32;

/// Tunables of one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Receive buffers offered to the peer (credits). At least 4: a credit update goes
    /// out when half the buffers can be given back, and with fewer than 4 that is one
    /// buffer, so two idle peers would return to each other, for ever, the credit each
    /// update spends (found by the `sdp_connection` fuzz target).
    pub recv_bufs: u16,
    /// Size of each receive buffer (header included) at first.
    pub recv_size: u32,
    /// The size a peer's ChRcvBuf may grow them to.
    pub max_recv_size: u32,
    /// Writes of at least this many bytes go by zero copy (SrcAvail); 0 turns it off.
    pub zcopy_threshold: usize,
    /// Accept the peer's SrcAvail adverts (otherwise answer SendSm).
    pub zcopy_sink: bool,
    /// Advertise a landing buffer (SinkAvail) for large reads, and RDMA Write into the
    /// peer's (write-based zero copy; `zcopy_threshold` applies).
    pub zcopy_write: bool,
    /// Bytes the send queue holds (`SO_SNDBUF`).
    pub send_buffer: usize,
    /// Send a keep-alive after this much silence (`SO_KEEPALIVE`).
    pub keepalive: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            recv_bufs: 16,
            recv_size: 16 * 1024,
            max_recv_size: 64 * 1024,
            zcopy_threshold: 256 * 1024,
            zcopy_sink: true,
            zcopy_write: true,
            send_buffer: 256 * 1024,
            keepalive: None,
        }
    }
}

/// Why a connection ended badly.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConnError {
    /// The peer aborted (AbortConn), or the transport broke.
    #[error("connection reset by peer")]
    Reset,
    /// The peer broke the protocol; the connection was aborted.
    #[error("protocol violation: {0}")]
    Protocol(Violation),
    /// Aborted locally.
    #[error("connection aborted")]
    Aborted,
    /// A write after `shutdown(SHUT_WR)` (the connection itself is fine).
    #[error("write after shutdown")]
    WriteShutdown,
}

/// What a peer did wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Violation {
    #[error("malformed message: {0}")]
    Malformed(wire::Error),
    #[error("message sequence {got} where {want} was due")]
    Sequence { got: u32, want: u32 },
    #[error("message {mseq} sent beyond the credits (limit {limit})")]
    CreditViolation { mseq: u32, limit: u32 },
    #[error("message of {len} bytes larger than the {size}-byte receive buffer")]
    TooLarge { len: usize, size: u32 },
    #[error("{0:?} not expected now")]
    Unexpected(wire::Mid),
    #[error("RdmaRdCompl for {got} bytes, {left} were advertised")]
    OverRead { got: u32, left: u32 },
    #[error("RdmaWrCompl for {got} bytes into a {size}-byte sink")]
    OverWrite { got: u32, size: u32 },
    #[error("data after DisConn")]
    DataAfterDisConn,
}

/// Where a connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The active side sent its Hello, waits for the HelloAck.
    HelloSent,
    /// Data moves (each direction may be half closed).
    Open,
    /// Both sides sent DisConn: the transport may close.
    Closed,
    /// Aborted or reset: every call fails with the error.
    Failed,
}

/// The next bytes for the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadItem {
    /// `len` bytes at `offset` in receive buffer `buf`.
    Buffered {
        buf: BufId,
        offset: usize,
        len: usize,
    },
    /// `len` bytes of the peer's advertised buffer, to RDMA Read at `addr` with `rkey`.
    Remote { addr: u64, rkey: u32, len: usize },
    /// `len` bytes at `offset` in our advertised landing buffer (the peer RDMA Wrote
    /// them there).
    Landed { offset: usize, len: usize },
    /// The peer will send no more (DisConn): end of file.
    Eof,
}

/// A message in a receive buffer, as [`Connection::on_receive`] takes it: its first
/// bytes (at least [`wire::PREFIX_LEN`], or all of it), its length, and its last byte
/// (the urgent byte when it carries one), so the payload never needs copying out.
#[derive(Debug, Clone, Copy)]
pub struct Received<'a> {
    pub prefix: &'a [u8],
    pub total: usize,
    pub last: u8,
}

impl<'a> Received<'a> {
    /// A whole message in memory.
    pub fn whole(bytes: &'a [u8]) -> Received<'a> {
        Received {
            prefix: bytes,
            total: bytes.len(),
            last: bytes.last().copied().unwrap_or(0),
        }
    }
}

/// What became of a zero-copy send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The sink read everything advertised.
    ZcopyDone { read: usize },
    /// The sink read `read` bytes and asked for the rest by buffered copy (SendSm), or
    /// acknowledged our cancel: the buffer is no longer accessed.
    ZcopyRevoked { read: usize },
}

/// A message [`Connection::poll_transmit`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transmit {
    pub len: usize,
    pub mid: wire::Mid,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Control {
    RdmaRdCompl(u32),
    RdmaWrCompl(u32),
    SinkAvail(Advert),
    SinkCancelAck,
    SendSm,
    SrcAvailCancel,
    ChRcvBuf(u32),
    ChRcvBufAck(u32),
}

/// The source side of a zero-copy send.
#[derive(Debug, Clone, Copy)]
struct Source {
    advert: Advert,
    sent: bool,
    read: u32,
    cancelled: bool,
}

#[derive(Debug, Clone, Copy)]
enum RxItem {
    Data {
        buf: BufId,
        offset: usize,
        len: usize,
    },
    Remote {
        advert: Advert,
        read: u32,
    },
    Landed {
        offset: usize,
        len: usize,
    },
}

/// One SDP connection's state.
#[derive(Debug)]
pub struct Connection {
    cfg: Config,
    phase: Phase,
    error: Option<ConnError>,
    // Sequence numbers.
    next_mseq: u32,
    last_rx_mseq: u32,
    // Credits: ours to spend, and the highest mseq the peer may send.
    tx_credits: i64,
    rx_limit: u32,
    posted: u16,
    spare_posted: bool,
    // Message sizes: the peer's receive buffers, ours (and a resize under way).
    peer_recv_size: u32,
    recv_size: u32,
    resize_pending: Option<u32>,
    old_size_posted: u16,
    resize_asked: bool,
    // Sending.
    tx: VecDeque<u8>,
    oob_out: Option<u8>,
    control: VecDeque<Control>,
    source: Option<Source>,
    fin_requested: bool,
    fin_sent: bool,
    abort_pending: bool,
    events: VecDeque<Event>,
    // Receiving.
    rx: VecDeque<RxItem>,
    rx_bytes: usize,
    reading_remote: Option<usize>,
    cancel_seen: bool,
    /// Our landing buffer, advertised (SinkAvail) and not yet written.
    sink: Option<Advert>,
    /// The peer's landing buffer we may RDMA Write into.
    peer_sink: Option<Advert>,
    peer_fin: bool,
    oob_in: Option<u8>,
    // Time.
    last_tx: Instant,
    pub counters: Counters,
}

/// Move the first `out.len()` bytes of `q` into `out` (the caller checked that `q` holds
/// them): two slice copies, not a loop over the bytes.
fn take_front(q: &mut VecDeque<u8>, out: &mut [u8]) {
    let (a, b) = q.as_slices();
    let from_a = a.len().min(out.len());
    out[..from_a].copy_from_slice(&a[..from_a]);
    let rest = out.len() - from_a;
    out[from_a..].copy_from_slice(&b[..rest]);
    q.drain(..out.len());
}

/// Sequence comparison modulo 2^32.
fn seq_le(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) >= 0
}

impl Connection {
    fn new(cfg: Config, now: Instant) -> Connection {
        Connection {
            cfg,
            phase: Phase::HelloSent,
            error: None,
            next_mseq: 1,
            last_rx_mseq: 0,
            tx_credits: 0,
            rx_limit: u32::from(cfg.recv_bufs),
            posted: cfg.recv_bufs,
            spare_posted: true,
            peer_recv_size: 0,
            recv_size: cfg.recv_size,
            resize_pending: None,
            old_size_posted: 0,
            resize_asked: false,
            tx: VecDeque::new(),
            oob_out: None,
            control: VecDeque::new(),
            source: None,
            fin_requested: false,
            fin_sent: false,
            abort_pending: false,
            events: VecDeque::new(),
            rx: VecDeque::new(),
            rx_bytes: 0,
            reading_remote: None,
            cancel_seen: false,
            sink: None,
            peer_sink: None,
            peer_fin: false,
            oob_in: None,
            last_tx: now,
            counters: Counters::default(),
        }
    }

    /// The active side: the Hello to send in the connection request (the driver posts
    /// `recv_bufs + 1` receive buffers of `recv_size` before connecting).
    pub fn connect(
        cfg: Config,
        now: Instant,
        src: IpAddr,
        src_port: u16,
        dst: IpAddr,
    ) -> (Connection, Message<'static>) {
        let c = Connection::new(cfg, now);
        let hello = Message {
            bsdh: Bsdh {
                bufs: cfg.recv_bufs,
                ..Bsdh::default()
            },
            body: Body::Hello(Hello {
                version: wire::VERSION,
                capabilities: 0,
                max_adverts: 1,
                des_rem_rcv_sz: cfg.recv_size,
                local_rcv_sz: cfg.recv_size,
                port: src_port,
                src,
                dst: Some(dst),
            }),
        };
        tracing::debug!(?src, src_port, ?dst, "SDP Hello");
        (c, hello)
    }

    /// The passive side, given the request's private data: the connection and the
    /// HelloAck to accept with, or why the request is refused.
    pub fn accept(
        cfg: Config,
        now: Instant,
        private_data: &[u8],
    ) -> Result<(Connection, Hello, Message<'static>), Violation> {
        let m = Message::parse(private_data).map_err(Violation::Malformed)?;
        let Body::Hello(h) = m.body else {
            return Err(Violation::Unexpected(m.body.mid()));
        };
        let mut c = Connection::new(cfg, now);
        c.peer_recv_size = h.local_rcv_sz.max(BSDH_LEN as u32 + 1);
        c.tx_credits = i64::from(m.bsdh.bufs);
        c.phase = Phase::Open;
        let ack = Message {
            bsdh: Bsdh {
                bufs: cfg.recv_bufs,
                ..Bsdh::default()
            },
            body: Body::HelloAck(HelloAck {
                version: wire::VERSION,
                ip_version: if h.src.is_ipv4() { 4 } else { 6 },
                capabilities: 0,
                ext_max_adverts: 1,
                act_rcv_sz: cfg.recv_size,
            }),
        };
        tracing::debug!(src = ?h.src, port = h.port, peer_rcv = h.local_rcv_sz, "SDP HelloAck");
        Ok((c, h, ack))
    }

    /// The active side got the accept's private data.
    pub fn on_hello_ack(&mut self, private_data: &[u8]) -> Result<(), Violation> {
        let m = Message::parse(private_data).map_err(Violation::Malformed)?;
        let Body::HelloAck(a) = m.body else {
            return Err(Violation::Unexpected(m.body.mid()));
        };
        if self.phase != Phase::HelloSent {
            return Err(Violation::Unexpected(wire::Mid::HelloAck));
        }
        self.peer_recv_size = a.act_rcv_sz.max(BSDH_LEN as u32 + 1);
        self.tx_credits = i64::from(m.bsdh.bufs);
        self.phase = Phase::Open;
        tracing::debug!(peer_rcv = a.act_rcv_sz, credits = m.bsdh.bufs, "SDP open");
        Ok(())
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn error(&self) -> Option<&ConnError> {
        self.error.as_ref()
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Change the keep-alive idle time (`SO_KEEPALIVE`).
    pub fn set_keepalive(&mut self, idle: Option<Duration>) {
        self.cfg.keepalive = idle;
    }

    /// Credits we hold (messages we may still send).
    pub fn credits(&self) -> i64 {
        self.tx_credits
    }

    /// The size each receive buffer should be posted with now.
    pub fn recv_size(&self) -> u32 {
        self.resize_pending.unwrap_or(self.recv_size)
    }

    /// The largest message the peer accepts.
    pub fn peer_recv_size(&self) -> u32 {
        self.peer_recv_size
    }

    /// Bytes waiting for the reader (buffered, and advertised by the peer).
    pub fn readable_bytes(&self) -> usize {
        self.rx_bytes
    }

    /// Whether a read would return something now (data, end of file or an error).
    pub fn readable(&self) -> bool {
        !self.rx.is_empty() || self.peer_fin || self.phase == Phase::Failed
    }

    /// Free room in the send queue.
    pub fn send_room(&self) -> usize {
        if self.source.is_some() {
            return 0;
        }
        self.cfg.send_buffer.saturating_sub(self.tx.len())
    }

    /// Whether a write would take bytes (or fail) now.
    pub fn writable(&self) -> bool {
        self.phase == Phase::Failed || (self.phase == Phase::Open && self.send_room() > 0)
    }

    /// Bytes queued and not yet sent.
    pub fn unsent(&self) -> usize {
        self.tx.len()
    }

    /// Everything written has left (queue empty, no zero-copy send outstanding, no
    /// revoked one's rest still to be queued again).
    pub fn send_idle(&self) -> bool {
        self.tx.is_empty()
            && self.source.is_none()
            && self.oob_out.is_none()
            && !self
                .events
                .iter()
                .any(|e| matches!(e, Event::ZcopyRevoked { .. }))
    }

    fn check_open(&self) -> Result<(), ConnError> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn check_writable(&self) -> Result<(), ConnError> {
        self.check_open()?;
        if self.fin_requested {
            return Err(ConnError::WriteShutdown);
        }
        Ok(())
    }

    /// Queue up to [`send_room`](Self::send_room) bytes of `data` for buffered copy;
    /// returns how many were taken.
    pub fn send(&mut self, data: &[u8]) -> Result<usize, ConnError> {
        self.check_writable()?;
        Ok(self.queue(data))
    }

    /// Queue the rest of a zero-copy send the peer declined or cancelled
    /// ([`Event::ZcopyRevoked`]): written before any shutdown, it goes before the DisConn.
    pub fn send_revoked_rest(&mut self, data: &[u8]) -> Result<usize, ConnError> {
        self.check_open()?;
        Ok(self.queue(data))
    }

    fn queue(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(self.send_room());
        self.tx.extend(&data[..n]);
        // Writes larger than the peer's buffers: ask it for larger ones (once).
        if !self.resize_asked
            && data.len() >= 2 * self.peer_recv_size as usize
            && self.peer_recv_size < self.cfg.max_recv_size
        {
            self.resize_asked = true;
            self.control
                .push_back(Control::ChRcvBuf(self.cfg.max_recv_size));
        }
        n
    }

    /// Send one byte of out-of-band data (`MSG_OOB`), after what is queued.
    pub fn send_oob(&mut self, byte: u8) -> Result<(), ConnError> {
        self.check_writable()?;
        self.oob_out = Some(byte);
        Ok(())
    }

    /// The out-of-band byte received, if any (taken).
    pub fn take_oob(&mut self) -> Option<u8> {
        self.oob_in.take()
    }

    /// Whether a write of `len` bytes is large enough for zero copy (it fits once the
    /// queue ahead of it has gone: [`zcopy_fits`](Self::zcopy_fits)).
    pub fn zcopy_wanted(&self, len: usize) -> bool {
        self.cfg.zcopy_threshold > 0
            && len >= self.cfg.zcopy_threshold
            && self.phase == Phase::Open
            && self.peer_sink.is_none()
    }

    /// Whether zero copy fits a write of `len` bytes now: the threshold is met, the
    /// queue is empty and no other zero-copy send is outstanding.
    pub fn zcopy_fits(&self, len: usize) -> bool {
        self.cfg.zcopy_threshold > 0
            && len >= self.cfg.zcopy_threshold
            && self.phase == Phase::Open
            && self.tx.is_empty()
            && self.oob_out.is_none()
            && self.source.is_none()
            && self.peer_sink.is_none()
            && !self.fin_requested
    }

    /// Start a zero-copy send of the registered buffer `advert`; the result comes as an
    /// [`Event`].
    pub fn send_zcopy(&mut self, advert: Advert) -> Result<(), ConnError> {
        self.check_writable()?;
        debug_assert!(self.zcopy_fits(advert.size as usize));
        self.source = Some(Source {
            advert,
            sent: false,
            read: 0,
            cancelled: false,
        });
        Ok(())
    }

    /// Give up the zero-copy send (a timeout or a signal): SrcAvailCancel; the buffer is
    /// free once [`Event::ZcopyRevoked`] or [`Event::ZcopyDone`] comes.
    pub fn cancel_zcopy(&mut self) {
        if let Some(s) = &mut self.source {
            if !s.sent {
                // Never left: nothing to cancel on the wire.
                let read = s.read as usize;
                self.source = None;
                self.events.push_back(Event::ZcopyRevoked { read });
            } else if !s.cancelled {
                s.cancelled = true;
                self.control.push_back(Control::SrcAvailCancel);
            }
        }
    }

    /// The next zero-copy outcome.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// No more writes (`shutdown(SHUT_WR)`): DisConn once everything queued has gone.
    pub fn shutdown_write(&mut self) {
        self.fin_requested = true;
    }

    /// Abort: AbortConn goes out first (if a credit allows), every call fails from now.
    pub fn abort(&mut self) {
        if self.phase != Phase::Failed {
            tracing::debug!("SDP abort");
            self.abort_pending = self.phase == Phase::Open || self.phase == Phase::Closed;
            self.fail(ConnError::Aborted);
        }
    }

    /// The transport broke (peer death, a failed work request): every call fails.
    pub fn transport_failed(&mut self) {
        if self.phase != Phase::Failed && self.phase != Phase::Closed {
            self.fail(ConnError::Reset);
        }
    }

    fn fail(&mut self, e: ConnError) {
        tracing::debug!(error = %e, "SDP connection failed");
        self.phase = Phase::Failed;
        self.error = Some(e);
        if let Some(s) = self.source.take() {
            self.events.push_back(Event::ZcopyRevoked {
                read: s.read as usize,
            });
        }
    }

    fn violation(&mut self, v: Violation) -> ConnError {
        self.counters.violations += 1;
        tracing::warn!(violation = %v, "SDP peer broke the protocol; aborting");
        self.abort_pending = true;
        self.fail(ConnError::Protocol(v));
        self.error.clone().unwrap()
    }

    /// Whether this end has sent the last message it will send the peer: its DisConn
    /// went out, or the connection is over (closed, or failed with any AbortConn gone).
    pub fn last_message_sent(&self) -> bool {
        self.fin_sent || self.transport_done()
    }

    /// Whether the driver should close the transport now (both sides sent DisConn, or the
    /// connection failed and any AbortConn has gone out).
    pub fn transport_done(&self) -> bool {
        self.phase == Phase::Closed || (self.phase == Phase::Failed && !self.abort_pending)
    }

    /// A message arrived in receive buffer `buf`. Returns whether the buffer is free to
    /// post again now (`true`) or holds data for the reader (`false`). On a violation the
    /// connection aborts and the error says why.
    pub fn on_receive(
        &mut self,
        now: Instant,
        buf: BufId,
        msg: Received<'_>,
    ) -> Result<bool, ConnError> {
        let _ = now;
        if self.phase == Phase::Failed {
            return Ok(true);
        }
        self.take_posted();
        let total = msg.total;
        let m = match Message::parse_head(msg.prefix, total) {
            Ok(m) => m,
            Err(e) => return Err(self.violation(Violation::Malformed(e))),
        };
        let want = self.last_rx_mseq.wrapping_add(1);
        if m.bsdh.mseq != want {
            return Err(self.violation(Violation::Sequence {
                got: m.bsdh.mseq,
                want,
            }));
        }
        if !seq_le(m.bsdh.mseq, self.rx_limit) {
            return Err(self.violation(Violation::CreditViolation {
                mseq: m.bsdh.mseq,
                limit: self.rx_limit,
            }));
        }
        let size = self.recv_size.max(self.resize_pending.unwrap_or(0));
        if total > size as usize {
            return Err(self.violation(Violation::TooLarge { len: total, size }));
        }
        self.last_rx_mseq = m.bsdh.mseq;
        // Credits: what the peer posted, less what we sent that it had not yet seen.
        let unseen = self.next_mseq.wrapping_sub(1).wrapping_sub(m.bsdh.mseq_ack) as i32;
        self.tx_credits = i64::from(m.bsdh.bufs) - i64::from(unseen);
        self.counters.count_rx(m.body.mid());
        if self.phase == Phase::HelloSent {
            return Err(self.violation(Violation::Unexpected(m.body.mid())));
        }
        let offset = Message::header_len(m.body.mid());
        let payload = total - offset;
        let hold = match m.body {
            Body::Data(_) | Body::SrcAvail { .. } if payload > 0 => {
                if self.peer_fin {
                    return Err(self.violation(Violation::DataAfterDisConn));
                }
                let mut len = payload;
                if m.bsdh.flags & FLAG_OOB_PRES != 0 {
                    // The last byte is the urgent byte: out of line.
                    len -= 1;
                    self.oob_in = Some(msg.last);
                    self.counters.oob_rx += 1;
                }
                if len > 0 {
                    self.rx.push_back(RxItem::Data { buf, offset, len });
                    self.rx_bytes += len;
                    self.counters.bcopy_rx_bytes += len as u64;
                }
                if let Body::SrcAvail { advert, .. } = m.body {
                    self.on_src_avail(advert)?;
                }
                len > 0
            }
            Body::Data(_) => false,
            Body::SrcAvail { advert, .. } => {
                self.on_src_avail(advert)?;
                false
            }
            Body::DisConn => {
                self.peer_fin = true;
                self.maybe_closed();
                false
            }
            Body::AbortConn => {
                self.fail(ConnError::Reset);
                false
            }
            Body::RdmaRdCompl { size } => {
                self.on_rdma_rd_compl(size)?;
                false
            }
            Body::SendSm => {
                match self.source.take() {
                    Some(s) => {
                        self.counters.zcopy_revoked += 1;
                        self.events.push_back(Event::ZcopyRevoked {
                            read: s.read as usize,
                        });
                    }
                    // A late answer to an advert already fully read: harmless.
                    None => self.counters.late_sendsm += 1,
                }
                false
            }
            Body::SrcAvailCancel => {
                self.on_src_cancel();
                false
            }
            Body::ChRcvBuf { size } => {
                let to = size.clamp(self.recv_size, self.cfg.max_recv_size);
                if to > self.recv_size && self.resize_pending.is_none() {
                    self.resize_pending = Some(to);
                    // Every buffer posted now is of the old size.
                    self.old_size_posted = self.posted + u16::from(self.spare_posted);
                    self.maybe_resized();
                } else {
                    self.control.push_back(Control::ChRcvBufAck(self.recv_size));
                }
                false
            }
            Body::ChRcvBufAck { size } => {
                if size > self.peer_recv_size && size <= (1 << 24) {
                    self.peer_recv_size = size;
                }
                false
            }
            Body::SinkAvail { advert, .. } => {
                self.on_sink_avail(advert);
                false
            }
            Body::RdmaWrCompl { size } => {
                self.on_rdma_wr_compl(size)?;
                false
            }
            Body::SinkAvailCancel => {
                self.peer_sink = None;
                self.control.push_back(Control::SinkCancelAck);
                false
            }
            Body::ModeChange { flags } if (flags >> 4) & 0x7 == 0 => false,
            b => return Err(self.violation(Violation::Unexpected(b.mid()))),
        };
        Ok(!hold)
    }

    fn on_src_avail(&mut self, advert: Advert) -> Result<(), ConnError> {
        if self.peer_fin {
            return Err(self.violation(Violation::DataAfterDisConn));
        }
        self.counters.zcopy_adverts_rx += 1;
        self.cancel_seen = false;
        if !self.cfg.zcopy_sink || advert.size == 0 {
            self.control.push_back(Control::SendSm);
            return Ok(());
        }
        self.rx.push_back(RxItem::Remote { advert, read: 0 });
        self.rx_bytes += advert.size as usize;
        Ok(())
    }

    fn on_src_cancel(&mut self) {
        self.cancel_seen = true;
        if self.reading_remote.is_some() {
            // Answered once the read under way is done.
            return;
        }
        self.drop_remote();
    }

    /// Take no more zero-copy adverts: the peer's waiting ones, and every later one, are
    /// answered SendSm (their bytes then come by buffered copy). An RDMA Read under way
    /// finishes first; its advert is declined after it.
    pub fn decline_zcopy(&mut self) {
        self.cfg.zcopy_sink = false;
        if !self.rx.iter().any(|i| matches!(i, RxItem::Remote { .. })) {
            return;
        }
        if self.reading_remote.is_some() {
            self.cancel_seen = true;
        } else {
            self.drop_remote();
        }
    }

    /// Forget the peer's advert (cancelled) and tell it so (SendSm).
    fn drop_remote(&mut self) {
        let before = self.rx.len();
        self.rx.retain(|i| !matches!(i, RxItem::Remote { .. }));
        if self.rx.len() != before {
            self.rx_bytes = self.rx.iter().map(rx_item_len).sum();
        }
        self.control.push_back(Control::SendSm);
        self.cancel_seen = false;
    }

    fn on_rdma_rd_compl(&mut self, size: u32) -> Result<(), ConnError> {
        let Some(s) = self.source.as_mut().filter(|s| s.sent) else {
            return Err(self.violation(Violation::Unexpected(wire::Mid::RdmaRdCompl)));
        };
        let left = s.advert.size - s.read;
        if size > left {
            return Err(self.violation(Violation::OverRead { got: size, left }));
        }
        s.read += size;
        self.counters.zcopy_tx_bytes += u64::from(size);
        if s.read == s.advert.size {
            let read = s.read as usize;
            self.source = None;
            self.events.push_back(Event::ZcopyDone { read });
        }
        Ok(())
    }

    fn maybe_closed(&mut self) {
        if self.peer_fin && self.fin_sent && self.phase == Phase::Open {
            tracing::debug!("SDP closed (DisConn both ways)");
            self.phase = Phase::Closed;
        }
    }

    fn maybe_resized(&mut self) {
        if let Some(to) = self.resize_pending {
            if self.old_size_posted == 0 {
                self.recv_size = to;
                self.resize_pending = None;
                self.control.push_back(Control::ChRcvBufAck(to));
                tracing::debug!(size = to, "SDP receive buffers resized");
            }
        }
    }

    fn take_posted(&mut self) {
        // A message consumed a posted buffer: an advertised one, or the spare.
        if self.posted > 0 {
            self.posted -= 1;
        } else {
            self.spare_posted = false;
        }
        self.old_size_posted = self.old_size_posted.saturating_sub(1);
    }

    /// A receive buffer was posted again (after [`on_receive`](Self::on_receive) returned
    /// `true`, or after the reader emptied it).
    pub fn on_reposted(&mut self) {
        if !self.spare_posted {
            self.spare_posted = true;
        } else {
            self.posted += 1;
        }
        self.maybe_resized();
    }

    /// Where the reader's next bytes are, if anywhere yet.
    pub fn next_read(&self) -> Option<ReadItem> {
        match self.rx.front() {
            Some(RxItem::Data { buf, offset, len }) => Some(ReadItem::Buffered {
                buf: *buf,
                offset: *offset,
                len: *len,
            }),
            Some(RxItem::Remote { advert, read }) => Some(ReadItem::Remote {
                addr: advert.addr + u64::from(*read),
                rkey: advert.rkey,
                len: (advert.size - read) as usize,
            }),
            Some(RxItem::Landed { offset, len }) => Some(ReadItem::Landed {
                offset: *offset,
                len: *len,
            }),
            None if self.peer_fin => Some(ReadItem::Eof),
            None => None,
        }
    }

    /// The reader took `n` bytes of the buffered item [`next_read`](Self::next_read)
    /// named; returns the buffer when it is empty now (post it again, then call
    /// [`on_reposted`](Self::on_reposted)).
    pub fn consume(&mut self, n: usize) -> Option<BufId> {
        if let Some(RxItem::Landed { offset, len }) = self.rx.front_mut() {
            let n = n.min(*len);
            *offset += n;
            *len -= n;
            self.rx_bytes -= n;
            if *len == 0 {
                self.rx.pop_front();
            }
            return None;
        }
        let Some(RxItem::Data { buf, offset, len }) = self.rx.front_mut() else {
            return None;
        };
        let n = n.min(*len);
        *offset += n;
        *len -= n;
        self.rx_bytes -= n;
        if *len == 0 {
            let b = *buf;
            self.rx.pop_front();
            return Some(b);
        }
        None
    }

    /// The reader starts an RDMA Read of `n` bytes of the remote item.
    pub fn rdma_read_started(&mut self, n: usize) {
        self.reading_remote = Some(n);
    }

    /// The RDMA Read of `n` bytes landed: RdmaRdCompl goes out.
    pub fn rdma_read_done(&mut self, n: usize) {
        self.reading_remote = None;
        if let Some(RxItem::Remote { advert, read }) = self.rx.front_mut() {
            let n = (n as u32).min(advert.size - *read);
            *read += n;
            self.rx_bytes -= n as usize;
            self.counters.zcopy_rx_bytes += u64::from(n);
            if *read == advert.size {
                self.rx.pop_front();
            }
            self.control.push_back(Control::RdmaRdCompl(n));
        }
        if self.cancel_seen {
            self.drop_remote();
        }
    }

    /// The RDMA Read failed (the transport ends the connection).
    pub fn rdma_read_failed(&mut self) {
        self.reading_remote = None;
        self.transport_failed();
    }

    /// The next message to send, written into `out` (a send slot of at least
    /// [`peer_recv_size`](Self::peer_recv_size) bytes), or `None` when there is nothing
    /// to send or no credit for it.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut [u8]) -> Option<Transmit> {
        let max = (self.peer_recv_size as usize).min(out.len());
        if self.abort_pending {
            self.abort_pending = false;
            if self.tx_credits >= 1 {
                return Some(self.emit(now, 0, Body::AbortConn, out));
            }
            return None;
        }
        if self.phase != Phase::Open {
            return None;
        }
        // Control messages first. Every message but a credit update leaves the last
        // credit for one (see the module's notes on flow control).
        if self.tx_credits >= 2 {
            if let Some(c) = self.control.pop_front() {
                let body = match c {
                    Control::RdmaRdCompl(size) => Body::RdmaRdCompl { size },
                    Control::RdmaWrCompl(size) => Body::RdmaWrCompl { size },
                    Control::SinkAvail(advert) => Body::SinkAvail {
                        advert,
                        non_discarded: 0,
                    },
                    Control::SinkCancelAck => Body::SinkCancelAck,
                    Control::SendSm => Body::SendSm,
                    Control::SrcAvailCancel => Body::SrcAvailCancel,
                    Control::ChRcvBuf(size) => Body::ChRcvBuf { size },
                    Control::ChRcvBufAck(size) => Body::ChRcvBufAck { size },
                };
                return Some(self.emit(now, 0, body, out));
            }
        }
        // Data: the queue, then the urgent byte; two credits (one stays for updates).
        if self.tx_credits >= 2 && (!self.tx.is_empty() || self.oob_out.is_some()) {
            let room = max - BSDH_LEN;
            let n = self.tx.len().min(room);
            let oob = self.oob_out.filter(|_| n == self.tx.len() && n < room);
            let payload = &mut out[BSDH_LEN..BSDH_LEN + n + usize::from(oob.is_some())];
            take_front(&mut self.tx, &mut payload[..n]);
            let mut flags = 0;
            if let Some(b) = oob {
                payload[n] = b;
                flags = FLAG_OOB_PRES | FLAG_OOB_PEND;
                self.oob_out = None;
                self.counters.oob_tx += 1;
            } else if self.oob_out.is_some() {
                flags = FLAG_OOB_PEND;
            }
            let len = payload.len();
            self.counters.bcopy_tx_bytes += len as u64;
            return Some(self.emit_data_header(now, flags, len, out));
        }
        // A zero-copy advert.
        if self.tx_credits >= 2 {
            if let Some(s) = self.source.as_mut().filter(|s| !s.sent) {
                s.sent = true;
                let advert = s.advert;
                self.counters.zcopy_adverts_tx += 1;
                return Some(self.emit(now, 0, Body::SrcAvail { advert, data: &[] }, out));
            }
        }
        // DisConn once everything has gone.
        if self.fin_requested && !self.fin_sent && self.send_idle() && self.tx_credits >= 2 {
            self.fin_sent = true;
            let t = self.emit(now, 0, Body::DisConn, out);
            self.maybe_closed();
            return Some(t);
        }
        // A credit update: the peer can be given at least half our buffers more (never
        // for less: two sides at their last credit would trade updates for ever).
        let new_limit = self.last_rx_mseq.wrapping_add(u32::from(self.posted));
        let gain = new_limit.wrapping_sub(self.rx_limit) as i32;
        let threshold = i32::from(self.cfg.recv_bufs / 2).max(1);
        if self.tx_credits >= 1 && gain >= threshold {
            self.counters.credit_updates += 1;
            return Some(self.emit(now, 0, Body::Data(&[]), out));
        }
        // Keep-alive after silence.
        if let Some(k) = self.cfg.keepalive {
            if self.tx_credits >= 2 && now.saturating_duration_since(self.last_tx) >= k {
                self.counters.keepalives += 1;
                return Some(self.emit(now, 0, Body::Data(&[]), out));
            }
        }
        None
    }

    /// The header of the next message we send; the sequence, credit and limit books
    /// move on as it goes.
    fn next_header(&mut self, now: Instant, flags: u8, mid: wire::Mid) -> Bsdh {
        let bsdh = Bsdh {
            mid: mid as u8,
            flags,
            bufs: self.posted,
            mseq: self.next_mseq,
            mseq_ack: self.last_rx_mseq,
            len: 0,
        };
        self.next_mseq = self.next_mseq.wrapping_add(1);
        self.tx_credits -= 1;
        let limit = self.last_rx_mseq.wrapping_add(u32::from(self.posted));
        if seq_le(self.rx_limit, limit) {
            self.rx_limit = limit;
        }
        self.last_tx = now;
        self.counters.count_tx(mid);
        bsdh
    }

    fn emit(&mut self, now: Instant, flags: u8, body: Body<'_>, out: &mut [u8]) -> Transmit {
        let mid = body.mid();
        let bsdh = self.next_header(now, flags, mid);
        let len = Message { bsdh, body }.emit(out);
        Transmit { len, mid }
    }

    /// A Data message whose `len` payload bytes are already in place after the header.
    fn emit_data_header(
        &mut self,
        now: Instant,
        flags: u8,
        len: usize,
        out: &mut [u8],
    ) -> Transmit {
        let mut bsdh = self.next_header(now, flags, wire::Mid::Data);
        bsdh.len = (BSDH_LEN + len) as u32;
        bsdh.emit(out);
        Transmit {
            len: BSDH_LEN + len,
            mid: wire::Mid::Data,
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) wants to run (keep-alive).
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase != Phase::Open {
            return None;
        }
        self.cfg.keepalive.map(|k| self.last_tx + k)
    }

    /// Time passed; [`poll_transmit`](Self::poll_transmit) then sends what is due.
    pub fn handle_timeout(&mut self, _now: Instant) {}
}

fn rx_item_len(i: &RxItem) -> usize {
    match i {
        RxItem::Data { len, .. } => *len,
        RxItem::Remote { advert, read } => (advert.size - read) as usize,
        RxItem::Landed { len, .. } => *len,
    }
}
