//! One SDP connection driven over an IT-API RC endpoint: the receive buffers posted for
//! the peer's messages, the send slots, the zero-copy regions, and the loop that moves
//! completions into the protocol state machine ([`crate::proto`]) and its messages out.
//!
//! Everything mutable sits under one lock ([`State`]). Any thread may make progress —
//! the caller of a read or write, or the process's progress thread ([`crate::reactor`])
//! when the event descriptors fire — and each keeps the socket's readiness face
//! ([`crate::readiness`]) in step with the protocol.
//!
//! Over 600 lines: the driver of one connection (posting, completions, progress, close),
//! whose parts share the connection's lock discipline.

use crate::device::Device;
use crate::proto::{
    self, BufId, ConnError, Connection, Event as ProtoEvent, Phase, ReadItem, Received,
};
use crate::reactor::{self, Reactive, Registration};
use crate::readiness::{End, Readiness};
use crate::wire::{self, Advert, Body, PREFIX_LEN};
use krdma_itapi::{
    ConnEventKind, ConnRequestEvent, DtoFlags, DtoKind, DtoStatus, Endpoint, EpAttributes, Evd,
    EvdFlags, Event, EventStream, Lmr, MemPriv, RdmaAddr, Transport,
};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};
use ual::RegBuf;

pub mod hot;
mod relay;
pub use relay::{is_relayed, Relayed};

/// Send slots per connection (messages in flight).
const TX_SLOTS: u32 = 8;
/// Cookie kinds (high bits) of the work requests a connection posts.
const RECV: u64 = 1 << 32;
const SEND: u64 = 2 << 32;
const READ: u64 = 3 << 32;
const WRITE: u64 = 4 << 32;
/// Writes (and reads, for the landing buffer's advert) of at least this many bytes go by
/// zero copy: measured (docs/benchmarks.md), 128 KiB writes are faster by buffered copy
/// and 1 MiB writes a little faster by zero copy, on both devices.
const DEFAULT_ZCOPY_THRESHOLD: usize = 1024 * 1024;
/// How long a blocking call polls before it sleeps, by default ([`spin_time`]).
const SPIN: Duration = Duration::from_micros(50);

/// The completion descriptor's place in the connection's [`Registration`].
const DTO_FD: usize = 0;

/// How long a connection waits for its connect or accept to complete.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What an SDP socket is made with.
#[derive(Debug, Clone)]
pub struct Options {
    /// The adapter: `siw0` (iWARP) or `rxe0` (RoCEv2).
    pub device: String,
    /// The kAL front door (`None`: the one `KRDMA_DEVICE` selects).
    pub target: Option<ual::Target>,
    pub proto: proto::Config,
    /// Over iWARP the SDP listener of port P listens on TCP port P + this offset (the
    /// socket's own port P stays free for plain TCP: one port space, two transports).
    pub iwarp_port_offset: u16,
    /// How long a connect may take before it counts as failed.
    pub connect_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            device: std::env::var("KRDMA_SDP_DEVICE").unwrap_or_else(|_| "siw0".into()),
            target: None,
            proto: proto::Config {
                send_buffer: 1 << 20,
                // KRDMA_SDP_ZCOPY_THRESHOLD: bytes from which a write goes by zero copy
                // (0: never).
                zcopy_threshold: std::env::var("KRDMA_SDP_ZCOPY_THRESHOLD")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(DEFAULT_ZCOPY_THRESHOLD),
                ..proto::Config::default()
            },
            iwarp_port_offset: 10000,
            connect_timeout: CONNECT_TIMEOUT,
        }
    }
}

impl Options {
    /// These options with writes of `bytes` or more going by zero copy (0: never).
    pub fn with_zcopy_threshold(mut self, bytes: usize) -> Options {
        self.proto.zcopy_threshold = bytes;
        self
    }

    /// Where the transport connects for the SDP port `port` on `dev`.
    pub fn transport_port(&self, dev: &Device, port: u16) -> u16 {
        match dev.ia.transport() {
            Transport::IwarpTcp => offset_port(port, self.iwarp_port_offset),
            Transport::InfiniBand => port,
        }
    }
}

/// The first port an unprivileged program may bind.
const FIRST_UNPRIVILEGED: u32 = 1024;

/// `port` moved up by `offset`; past 65535 it wraps around into the unprivileged ports
/// (1024 and up), never to 0 (which would ask for any port) or a privileged port (which
/// only root may listen on). Both ends compute it, so they meet.
pub fn offset_port(port: u16, offset: u16) -> u16 {
    let sum = u32::from(port) + u32::from(offset);
    let span = 65536 - FIRST_UNPRIVILEGED;
    let wrapped = match sum {
        0..=65535 => sum,
        _ => FIRST_UNPRIVILEGED + (sum - 65536) % span,
    };
    wrapped as u16 // at most 65535 either way
}

/// An error of the SDP connection as the socket reports it.
pub fn io_error(e: &ConnError) -> io::Error {
    match e {
        ConnError::Reset | ConnError::Protocol(_) => {
            io::Error::new(io::ErrorKind::ConnectionReset, e.to_string())
        }
        ConnError::Aborted => io::Error::new(io::ErrorKind::ConnectionAborted, e.to_string()),
        ConnError::WriteShutdown => io::Error::new(io::ErrorKind::BrokenPipe, e.to_string()),
    }
}

fn itapi_err(e: krdma_itapi::Error) -> io::Error {
    io::Error::other(e.to_string())
}

/// The zero-copy regions, made on first use: the source's staging buffer (the peer RDMA
/// Reads from it) and the sink's landing buffer (our RDMA Reads go there).
struct Zcopy {
    src: Lmr,
    src_buf: Arc<RegBuf>,
    sink: Lmr,
    sink_buf: Arc<RegBuf>,
}

/// The write-based zero-copy regions, made on first use: the staging buffer our RDMA
/// Writes go from, and the landing buffer we advertise (the peer writes into it).
struct WriteZcopy {
    src: Lmr,
    src_buf: Arc<RegBuf>,
    /// Where the queued bytes are gathered before they go into `src_buf`.
    staged: Vec<u8>,
    sink: Lmr,
    sink_buf: Arc<RegBuf>,
}

/// The mutable part of a connection.
pub struct State {
    pub proto: Connection,
    slots: Vec<u32>,
    scratch: Vec<u8>,
    zc: Option<Zcopy>,
    wz: Option<WriteZcopy>,
    /// Our RDMA Write from the staging buffer is under way.
    write_busy: bool,
    /// An RDMA Read of ours finished (true: successfully).
    read_done: Option<bool>,
    /// Bytes staged for the zero-copy send outstanding.
    staged: usize,
    /// The outcome of connecting or accepting, once known.
    established: Option<Result<(), io::ErrorKind>>,
    /// The transport ended (its disconnect or failure event came).
    transport_closed: bool,
    /// This end asked the transport to close (gracefully; it has closed once its event
    /// comes: until then the endpoint lives, or aborting it would reset the peer before
    /// it has read our last messages).
    transport_closing: bool,
    pub readiness: Readiness,
    face_gone: bool,
    /// Kept alive until the face is closed ([`Conn::keep_until_face_closed`]).
    detached: bool,
    /// Messages (receive buffer, length) that completed before the connection event
    /// that opens the protocol: handed to it after that event ([`Conn::on_dto`]).
    early: Vec<(BufId, usize)>,
    /// Callers asleep in [`Conn::sleep`], by their threads' wake-up descriptors (the
    /// progress thread leaves events to them).
    sleepers: Vec<Arc<EventFd>>,
    /// Callers polling in [`Conn::sleep`] before they sleep (the progress thread leaves
    /// events to them too).
    spinning: usize,
    /// Left unarmed by a call ([`hot`]).
    hot: bool,
    /// Called since the progress thread's last tick.
    touched: bool,
    /// The reset was reported once; later writes say EPIPE as TCP's do.
    reset_reported: bool,
    /// The face carries the data ([`Conn::relay`]).
    relay: Option<relay::Relay>,
    /// Scratch for [`Conn::take_completions`].
    events: Vec<Event>,
}

/// One SDP connection.
pub struct Conn {
    me: Weak<Conn>,
    /// On the list of hot connections ([`hot`]).
    listed: std::sync::atomic::AtomicBool,
    /// How long a blocking call polls before it sleeps; zero where polling drives
    /// nothing (through krdmad): then every call arms ([`hot`]).
    spin: Duration,
    pub dev: Arc<Device>,
    ep: Endpoint,
    dto: Evd,
    cm: Evd,
    rx_buf: Arc<RegBuf>,
    rx: Lmr,
    rx_slot: usize,
    tx_buf: Arc<RegBuf>,
    tx: Lmr,
    tx_slot: usize,
    pub(crate) st: Mutex<State>,
    reg: Mutex<Option<Registration>>,
    pub local: SocketAddr,
    pub peer: SocketAddr,
}

impl Conn {
    /// A connection's resources, receive buffers posted; `face` is returned to the
    /// caller (the socket's descriptor).
    fn create(
        dev: Arc<Device>,
        proto: Connection,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> io::Result<(Arc<Conn>, OwnedFd)> {
        let cfg = *proto.config();
        let ia = &dev.ia;
        let nrx = u32::from(cfg.recv_bufs) + 1;
        let depth = (TX_SLOTS + 4 + nrx) as usize;
        // The engine makes the descriptor readable itself (through krdmad, without the
        // event path): every wake-up here dequeues until empty.
        let dto = Evd::create(
            ia,
            EventStream::Dto,
            EvdFlags::CREATE_FD | EvdFlags::FD_ON_COMPLETION,
            4 * depth,
            1,
            None,
        )
        .map_err(itapi_err)?;
        let cm = Evd::create(ia, EventStream::CmMessage, EvdFlags::CREATE_FD, 16, 1, None)
            .map_err(itapi_err)?;
        let attrs = EpAttributes {
            max_request_dtos: (TX_SLOTS + 4) as usize,
            max_recv_dtos: nrx as usize,
            max_send_segments: 1,
            max_recv_segments: 1,
            rdma_read_ird: 4,
            rdma_read_ord: 4,
            ..EpAttributes::default()
        };
        let ep = Endpoint::create_rc(&dev.pz, &dto, &dto, &cm, attrs, None).map_err(itapi_err)?;
        let rx_slot = cfg.max_recv_size.max(cfg.recv_size) as usize;
        let rx_buf = RegBuf::new(rx_slot * nrx as usize)?;
        let rx = Lmr::create(&dev.pz, rx_buf.clone(), MemPriv::LOCAL).map_err(itapi_err)?;
        let tx_slot = rx_slot;
        let tx_buf = RegBuf::new(tx_slot * TX_SLOTS as usize)?;
        let tx = Lmr::create(&dev.pz, tx_buf.clone(), MemPriv::LOCAL).map_err(itapi_err)?;
        let (face, readiness) = Readiness::new()?;
        let spin = if dto.worth_spinning() {
            spin_time()
        } else {
            Duration::ZERO
        };
        let conn = Arc::new_cyclic(|me| Conn {
            me: me.clone(),
            listed: Default::default(),
            spin,
            dev,
            ep,
            dto,
            cm,
            rx_buf,
            rx,
            rx_slot,
            tx_buf,
            tx,
            tx_slot,
            st: Mutex::new(State {
                proto,
                slots: (0..TX_SLOTS).rev().collect(),
                scratch: vec![0; tx_slot],
                zc: None,
                wz: None,
                write_busy: false,
                read_done: None,
                staged: 0,
                established: None,
                transport_closed: false,
                transport_closing: false,
                readiness,
                face_gone: false,
                detached: false,
                early: Vec::new(),
                sleepers: Vec::new(),
                spinning: 0,
                hot: false,
                touched: false,
                reset_reported: false,
                relay: None,
                events: Vec::new(),
            }),
            reg: Mutex::new(None),
            local,
            peer,
        });
        for b in 0..nrx {
            conn.post_recv(b, cfg.recv_size)?;
        }
        let me: Weak<dyn Reactive> = Arc::downgrade(&conn) as Weak<dyn Reactive>;
        // The completion descriptor first: `DTO_FD`.
        let reg = {
            let st = conn.lock();
            reactor::register(
                &[
                    (
                        conn.dto.fd().expect("DTO EVD made with a descriptor"),
                        false,
                    ),
                    (conn.cm.fd().expect("CM EVD made with a descriptor"), false),
                    (st.readiness.back(), true),
                ],
                me,
            )?
        };
        *conn.reg.lock().unwrap_or_else(|e| e.into_inner()) = Some(reg);
        crate::stats::track(&conn);
        Ok((conn, face))
    }

    /// Connect to the SDP socket at `peer` (whose port is the socket's, not the
    /// transport's), offering the Hello; returns once established (or refused).
    pub fn connect(
        opts: &Options,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> io::Result<(Arc<Conn>, OwnedFd)> {
        let dev = Device::get(opts.target.as_ref(), &opts.device).map_err(itapi_err)?;
        let (proto, hello) = Connection::connect(
            opts.proto,
            Instant::now(),
            local.ip(),
            local.port(),
            peer.ip(),
        );
        let Body::Hello(h) = hello.body else {
            unreachable!("connect makes a Hello")
        };
        let limit = dev.ia.private_data_limits().0;
        let pd = wire::hello_private_data(hello.bsdh, &h, limit);
        let tport = opts.transport_port(&dev, peer.port());
        let (conn, face) = Conn::create(dev, proto, local, peer)?;
        conn.ep
            .connect(SocketAddr::new(peer.ip(), tport), &pd)
            .map_err(itapi_err)?;
        conn.wait_established(opts.connect_timeout)?;
        Ok((conn, face))
    }

    /// Accept the connection request `r` (a Hello) that arrived at a listener of ours.
    pub fn accept(
        dev: Arc<Device>,
        opts: &Options,
        local: SocketAddr,
        r: &ConnRequestEvent,
    ) -> io::Result<(Arc<Conn>, OwnedFd)> {
        let (proto, hello, ack) =
            match Connection::accept(opts.proto, Instant::now(), &r.private_data) {
                Ok(x) => x,
                Err(v) => {
                    tracing::warn!(violation = %v, "SDP connection request refused");
                    let _ = r.cn_est_id.reject(&[]);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, v.to_string()));
                }
            };
        let peer = SocketAddr::new(hello.src, hello.port);
        let (conn, face) = Conn::create(dev, proto, local, peer)?;
        conn.ep
            .accept(r.cn_est_id, &ack.to_vec())
            .map_err(itapi_err)?;
        conn.wait_established(CONNECT_TIMEOUT)?;
        Ok((conn, face))
    }

    fn wait_established(self: &Arc<Self>, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut st = self.lock();
                self.progress(&mut st);
                if let Some(r) = st.established {
                    return r.map_err(io::Error::from);
                }
            }
            if Instant::now() >= deadline {
                let _ = self.ep.abort();
                return Err(io::ErrorKind::TimedOut.into());
            }
            let st = self.lock();
            let face = st.readiness.back().try_clone_to_owned()?;
            let _ = self.sleep(
                st,
                Some(face.as_fd()),
                PollFlags::empty(),
                Some(Instant::now() + Duration::from_millis(100)),
            );
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state for a socket call, with the events so far taken in; a relayed socket
    /// refuses (its face is the data path: [`Relayed`]).
    fn lock_for_call(&self) -> io::Result<MutexGuard<'_, State>> {
        let mut st = self.lock();
        if st.relay.is_some() {
            return Err(relay::relayed_error());
        }
        self.progress_with(&mut st, !hot::may_stay_hot());
        Ok(st)
    }

    fn post_recv(&self, b: BufId, size: u32) -> io::Result<()> {
        let seg = self
            .rx
            .segment(b as u64 * self.rx_slot as u64, size)
            .map_err(itapi_err)?;
        self.ep
            .post_recv(&[seg], RECV | u64::from(b), DtoFlags::SIGNALED)
            .map_err(itapi_err)
    }

    fn repost(&self, st: &mut State, b: BufId) {
        if st.proto.phase() == Phase::Failed {
            return;
        }
        match self.post_recv(b, st.proto.recv_size()) {
            Ok(()) => st.proto.on_reposted(),
            Err(e) => {
                tracing::debug!(error = %e, "SDP receive buffer not reposted");
                st.proto.transport_failed();
            }
        }
    }

    /// Take every completion and connection event, then send what the protocol has.
    pub(crate) fn progress(&self, st: &mut State) -> bool {
        self.progress_with(st, true)
    }

    /// [`progress`](Self::progress); without `arm` the completion queue is left unarmed
    /// (the caller polls on: see [`Evd::dequeue_polling`]).
    fn progress_with(&self, st: &mut State, arm: bool) -> bool {
        let mut took = self.take_completions(st, arm);
        while let Ok(ev) = self.cm.dequeue() {
            took = true;
            // The transport queues a message's completion before the connection event that
            // follows it on the wire (the peer's DisConn, then its transport's close): take
            // the completions that arrived since the queue was last emptied first, or an
            // orderly close would read as a reset.
            self.take_completions(st, arm);
            if let Event::Connection(c) = ev {
                self.on_cm(st, c.kind, &c.private_data);
            }
        }
        self.flush(st);
        if took {
            // Callers asleep were waiting on these very events (a reader and a writer of
            // one socket sleep on the same queues): wake each to look again.
            for s in &st.sleepers {
                let _ = s.write(1);
            }
        }
        if arm {
            st.hot = false;
        } else {
            st.touched = true;
            if !st.hot {
                st.hot = true;
                hot::add(self);
                // A thread that began to wait meanwhile may have cooled every hot
                // connection already (`hot::Waiting::enter`): do it for it. (Without the
                // preload only a blocking call's polls leave it unarmed, until it sleeps.)
                if !hot::may_stay_hot() && st.spinning == 0 {
                    return self.progress_with(st, true) || took;
                }
            }
        }
        took
    }

    /// A thread of the program looks at the faces without waiting: take what arrived on
    /// this connection if it is hot, leaving it so ([`hot::poll_hot`]).
    fn poll_hot(&self) {
        let mut st = self.lock();
        if st.hot && st.relay.is_none() && st.spinning == 0 && st.sleepers.is_empty() {
            self.progress_with(&mut st, false);
        }
    }

    /// Arm a hot connection ([`hot`]).
    fn cool(&self) {
        let mut st = self.lock();
        if st.hot && st.relay.is_none() {
            self.progress(&mut st);
        }
    }

    /// Handle every completion queued; whether there was any.
    fn take_completions(&self, st: &mut State, arm: bool) -> bool {
        let mut took = false;
        let mut events = std::mem::take(&mut st.events);
        // All at once: the SEVD then never shows ready halfway (its descriptor's
        // wake-up would only rouse the progress thread).
        while matches!(self.dto.dequeue_all(&mut events, !arm), Ok(n) if n > 0) {
            took = true;
            for ev in events.drain(..) {
                if let Event::Dto(d) = ev {
                    self.on_dto(st, d.kind, d.cookie, d.status, d.transferred_length)
                }
            }
        }
        st.events = events;
        took
    }

    fn on_dto(&self, st: &mut State, kind: DtoKind, cookie: u64, status: DtoStatus, len: u32) {
        if status != DtoStatus::Success {
            if kind == DtoKind::RdmaRead {
                st.read_done = Some(false);
            }
            // A send slot is free once its send completed, however it ended (an exit
            // waits for every slot: `wait_last_message`).
            if cookie & !0xffff_ffff == SEND {
                st.slots.push((cookie & 0xffff_ffff) as u32);
            }
            if cookie == WRITE {
                st.write_busy = false;
            }
            if status != DtoStatus::Flushed {
                tracing::debug!(?kind, ?status, "SDP work request failed");
            }
            st.proto.transport_failed();
            return;
        }
        let id = (cookie & 0xffff_ffff) as u32;
        match cookie & !0xffff_ffff {
            // The peer may send as soon as it has accepted: its first message can complete
            // here before our connection event (whose HelloAck opens the protocol) is
            // taken — they come through different queues. It waits for that event.
            RECV if st.proto.phase() == Phase::HelloSent => st.early.push((id, len as usize)),
            RECV => self.receive(st, id, len as usize),
            SEND => st.slots.push(id),
            READ => st.read_done = Some(true),
            WRITE => st.write_busy = false,
            _ => {}
        }
    }

    /// Hand the message in receive buffer `id` (`total` bytes) to the protocol.
    fn receive(&self, st: &mut State, id: BufId, total: usize) {
        let base = id as usize * self.rx_slot;
        let mut prefix = [0u8; PREFIX_LEN];
        let n = total.min(PREFIX_LEN);
        self.rx_buf.read(base, &mut prefix[..n]);
        let mut last = [0u8; 1];
        if total > 0 {
            self.rx_buf.read(base + total - 1, &mut last);
        }
        let msg = Received {
            prefix: &prefix[..n],
            total,
            last: last[0],
        };
        match st.proto.on_receive(Instant::now(), id, msg) {
            Ok(true) => self.repost(st, id),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, peer = %self.peer, "SDP connection aborted")
            }
        }
    }

    fn on_cm(&self, st: &mut State, kind: ConnEventKind, private_data: &[u8]) {
        tracing::debug!(?kind, phase = ?st.proto.phase(), peer = %self.peer, "SDP transport event");
        match kind {
            ConnEventKind::Established => {
                // The active side learns the peer's buffers from the HelloAck.
                if st.proto.phase() == Phase::HelloSent {
                    if let Err(v) = st.proto.on_hello_ack(private_data) {
                        tracing::warn!(violation = %v, "bad HelloAck; aborting");
                        st.proto.abort();
                        st.established = Some(Err(io::ErrorKind::ConnectionRefused));
                        let _ = self.ep.abort();
                        return;
                    }
                }
                tracing::debug!(peer = %self.peer, "SDP connection established");
                st.established = Some(Ok(()));
                for (id, total) in std::mem::take(&mut st.early) {
                    self.receive(st, id, total);
                }
            }
            ConnEventKind::PeerReject | ConnEventKind::NonPeerReject => {
                st.established = Some(Err(io::ErrorKind::ConnectionRefused));
                st.proto.transport_failed();
                st.transport_closed = true;
            }
            ConnEventKind::Disconnect | ConnEventKind::Broken => {
                if st.established.is_none() {
                    st.established = Some(Err(io::ErrorKind::ConnectionRefused));
                }
                if st.proto.phase() != Phase::Closed {
                    st.proto.transport_failed();
                }
                st.transport_closed = true;
            }
        }
    }

    /// Send what the protocol has to send while send slots last; close the transport
    /// once the protocol is done with it; bring the face up to date.
    fn flush(&self, st: &mut State) {
        // Zero-copy outcomes first: a revoked advert's remainder goes by buffered copy,
        // ahead of anything that may follow it (a DisConn waits for the zero-copy send).
        while let Some(ev) = st.proto.poll_event() {
            if let ProtoEvent::ZcopyRevoked { read } = ev {
                if st.proto.phase() == Phase::Open && read < st.staged {
                    let mut rest = vec![0u8; st.staged - read];
                    if let Some(z) = &st.zc {
                        z.src_buf.read(read, &mut rest);
                    }
                    let _ = st.proto.send_revoked_rest(&rest);
                }
            }
            st.staged = 0;
        }
        self.pump(st);
        if !st.slots.is_empty() {
            self.write_to_peer_sink(st);
        }
        while let Some(&slot) = st.slots.last() {
            let State { proto, scratch, .. } = &mut *st;
            let Some(t) = proto.poll_transmit(Instant::now(), scratch) else {
                break;
            };
            st.slots.pop();
            let off = slot as usize * self.tx_slot;
            self.tx_buf.write(off, &st.scratch[..t.len]);
            let seg = match self.tx.segment(off as u64, t.len as u32) {
                Ok(s) => s,
                Err(_) => break,
            };
            if let Err(e) = self
                .ep
                .post_send(&[seg], SEND | u64::from(slot), DtoFlags::SIGNALED)
            {
                tracing::debug!(error = %e, "SDP send not posted");
                st.slots.push(slot);
                st.proto.transport_failed();
                break;
            }
        }
        if st.proto.transport_done()
            && !st.transport_closed
            && !st.transport_closing
            && st.established.is_some()
        {
            st.transport_closing = true;
            let _ = self.ep.disconnect();
        }
        self.show(st);
    }

    /// RDMA Write queued bytes into the peer's landing buffer when it advertised one and
    /// enough are queued (its RdmaWrCompl is then the next message sent).
    fn write_to_peer_sink(&self, st: &mut State) {
        if st.write_busy || !st.proto.peer_sink_open() || self.ensure_write_zcopy(st).is_err() {
            return;
        }
        let State { proto, wz, .. } = &mut *st;
        let wz = wz.as_mut().expect("made above");
        let Some(w) = proto.poll_rdma_write(&mut wz.staged) else {
            return;
        };
        wz.src_buf.write(0, &wz.staged[..w.len]);
        let posted = wz
            .src
            .segment(0, w.len as u32)
            .map_err(itapi_err)
            .and_then(|seg| {
                self.ep
                    .post_rdma_write(
                        &[seg],
                        WRITE,
                        DtoFlags::SIGNALED,
                        RdmaAddr {
                            addr: w.addr,
                            rmr_context: u64::from(w.rkey),
                        },
                    )
                    .map_err(itapi_err)
            });
        match posted {
            Ok(()) => st.write_busy = true,
            Err(e) => {
                tracing::debug!(error = %e, "SDP RDMA Write not posted");
                st.proto.transport_failed();
            }
        }
    }

    fn ensure_write_zcopy(&self, st: &mut State) -> io::Result<()> {
        if st.wz.is_none() {
            let size = st.proto.config().send_buffer.max(64 * 1024);
            let src_buf = RegBuf::new(size)?;
            let src =
                Lmr::create(&self.dev.pz, src_buf.clone(), MemPriv::LOCAL).map_err(itapi_err)?;
            let sink_buf = RegBuf::new(size)?;
            let sink = Lmr::create(
                &self.dev.pz,
                sink_buf.clone(),
                MemPriv::LOCAL | MemPriv::REMOTE_WRITE,
            )
            .map_err(itapi_err)?;
            st.wz = Some(WriteZcopy {
                staged: vec![0; src_buf.len()],
                src,
                src_buf,
                sink,
                sink_buf,
            });
        }
        Ok(())
    }

    /// A reader asking for `want` bytes found none: advertise the landing buffer, so the
    /// peer may RDMA Write the next bytes straight there.
    fn offer_sink(&self, st: &mut State, want: usize) {
        if !st.proto.sink_wanted(want) || self.ensure_write_zcopy(st).is_err() {
            return;
        }
        let wz = st.wz.as_ref().expect("made above");
        let advert = Advert {
            size: wz.sink_buf.len() as u32,
            rkey: wz.sink.rmr_context().unwrap_or(0) as u32,
            addr: wz.sink.addr(),
        };
        st.proto.advertise_sink(advert);
        self.flush(st);
    }

    /// Copy the bytes of a local read item (a receive buffer's, or the landing buffer's)
    /// into `out`; returns how many, or `None` for items not held here.
    fn copy_item(&self, st: &State, item: ReadItem, out: &mut [u8]) -> Option<usize> {
        match item {
            ReadItem::Buffered { buf, offset, len } => {
                let n = len.min(out.len());
                self.rx_buf
                    .read(buf as usize * self.rx_slot + offset, &mut out[..n]);
                Some(n)
            }
            ReadItem::Landed { offset, len } => {
                let n = len.min(out.len());
                st.wz.as_ref()?.sink_buf.read(offset, &mut out[..n]);
                Some(n)
            }
            ReadItem::Remote { .. } | ReadItem::Eof => None,
        }
    }

    /// Bring the face up to date (the parts only the back can change).
    fn show(&self, st: &mut State) {
        let p = &st.proto;
        if p.phase() == Phase::Failed {
            st.readiness.end(End::Hangup);
            return;
        }
        if st.relay.is_some() {
            // The face shows the bytes themselves; the relay shows the end of file.
            return;
        }
        if p.readable() {
            st.readiness.set_readable();
        }
        if p.writable() {
            st.readiness.set_writable();
        }
        if p.next_read() == Some(ReadItem::Eof) {
            st.readiness.end(End::Eof);
        }
    }

    /// Sleep until something may have changed: the face shows `want`, or an event
    /// arrived. While a caller sleeps here the progress thread leaves the events to it
    /// (`sleepers`), so an event can never be taken by the one and missed by the other;
    /// the caller makes progress itself when it wakes. Two callers of one socket (a
    /// reader and a writer thread) sleep on the same event queues: the one that takes
    /// the events wakes the other through its thread's own descriptor ([`waker`]), which
    /// would otherwise sleep on with its condition met. (A wake-up shared by all sleepers
    /// could be taken twice by one of them, going back to sleep, and leave the other
    /// asleep for ever: seen as a writer waiting, its queue long empty.)
    fn sleep<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        face: Option<BorrowedFd<'_>>,
        want: PollFlags,
        deadline: Option<Instant>,
    ) -> io::Result<()> {
        // Wake for the protocol's timers too (keep-alive) while asleep.
        let deadline_or_timer = match (deadline, st.proto.poll_timeout()) {
            (Some(d), Some(t)) => Some(d.min(t.max(Instant::now() + Duration::from_millis(1)))),
            (d, None) => d,
            (None, Some(t)) => Some(t.max(Instant::now() + Duration::from_millis(1))),
        };
        let timeout = match deadline_or_timer {
            None => PollTimeout::NONE,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                PollTimeout::try_from(left.as_millis().min(i32::MAX as u128) as i32 + 1)
                    .unwrap_or(PollTimeout::MAX)
            }
        };
        // Poll a while first: in embedded mode the polls receive in this thread, and a
        // sleep costs wake-ups ([`hot`]). A thread of the program waiting elsewhere needs
        // the notifications: then arm at once.
        if !self.spin.is_zero() && !hot::waiting() {
            let until = Instant::now() + self.spin;
            st.spinning += 1;
            let took = loop {
                if self.progress_with(&mut st, false) {
                    break true;
                }
                let now = Instant::now();
                if now >= until || deadline.is_some_and(|d| now >= d) || hot::waiting() {
                    break false;
                }
                drop(st);
                std::hint::spin_loop();
                st = self.lock();
            };
            st.spinning -= 1;
            if took {
                hot::WAITS_POLLED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !hot::may_stay_hot() {
                    self.progress(&mut st);
                }
                return Ok(());
            }
        }
        // Armed before the sleep, and a last look.
        if self.progress(&mut st) {
            return Ok(());
        }
        let me = waker()?;
        st.sleepers.push(me.clone());
        if st.sleepers.len() == 1 && st.relay.is_none() {
            // The progress thread leaves the events to sleepers: spare it the wake-ups.
            self.mute_progress_thread(true);
        }
        drop(st);
        let dto = self.dto.fd().expect("DTO EVD has a descriptor");
        let mut p = [
            PollFd::new(me.as_fd(), PollFlags::POLLIN),
            PollFd::new(dto, PollFlags::POLLIN),
            PollFd::new(
                self.cm.fd().expect("CM EVD has a descriptor"),
                PollFlags::POLLIN,
            ),
            PollFd::new(face.unwrap_or(dto), want),
        ];
        let n = if face.is_some() { 4 } else { 3 };
        let r = poll(&mut p[..n], timeout);
        hot::WAITS_SLEPT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut st = self.lock();
        st.sleepers.retain(|s| !Arc::ptr_eq(s, &me));
        // No kick can come any more: take the one that may have (the next sleep, on
        // whatever socket, starts clean).
        let _ = me.read();
        // Take what woke us; the connection stays hot if it may ([`hot`]: a call that
        // sleeps again arms first).
        self.progress_with(&mut st, !hot::may_stay_hot());
        if st.sleepers.is_empty() {
            // After the progress drained the descriptor: the progress thread is told
            // only of what comes later.
            self.mute_progress_thread(false);
        }
        match r {
            Ok(_) => Ok(()),
            Err(nix::errno::Errno::EINTR) => Err(io::ErrorKind::Interrupted.into()),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the progress thread watches the completion descriptor ([`reactor`]): not
    /// while callers sleep on it themselves (it would wake for every completion only to
    /// leave it to them, [`Reactive::on_ready`]). Called under the state lock.
    fn mute_progress_thread(&self, muted: bool) {
        if let Some(r) = self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            if let Err(e) = r.mute(DTO_FD, muted) {
                tracing::debug!(error = %e, muted, "SDP progress thread watch not changed");
            }
        }
    }

    /// Read into `out`: buffered bytes by copy, the peer's zero-copy advert by RDMA Read.
    /// `Ok(0)` is end of file. Without `block`, `WouldBlock` when nothing is there.
    pub fn read(
        &self,
        face: BorrowedFd<'_>,
        out: &mut [u8],
        block: bool,
        deadline: Option<Instant>,
    ) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            let mut st = self.lock_for_call()?;
            let mut got = 0;
            while got < out.len() {
                match st.proto.next_read() {
                    Some(item @ (ReadItem::Buffered { .. } | ReadItem::Landed { .. })) => {
                        let n = self.copy_item(&st, item, &mut out[got..]).unwrap_or(0);
                        got += n;
                        if let Some(b) = st.proto.consume(n) {
                            self.repost(&mut st, b);
                        }
                        if n == 0 {
                            break;
                        }
                    }
                    Some(ReadItem::Remote { addr, rkey, len }) => {
                        if got > 0 {
                            break;
                        }
                        drop(st);
                        return self.read_remote(face, out, addr, rkey, len);
                    }
                    Some(ReadItem::Eof) | None => break,
                }
            }
            if got > 0 {
                self.flush(&mut st);
                if !st.proto.readable() {
                    st.readiness.clear_readable(face);
                }
                return Ok(got);
            }
            if st.proto.next_read() == Some(ReadItem::Eof) {
                return Ok(0);
            }
            if let Some(e) = st.proto.error() {
                return Err(io_error(e));
            }
            self.offer_sink(&mut st, out.len());
            st.readiness.clear_readable(face);
            if !block {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.sleep(st, Some(face), PollFlags::POLLIN, deadline)?;
        }
    }

    /// Copy buffered bytes without taking them (`MSG_PEEK`); a zero-copy advert at the
    /// head is read in first (its bytes then wait, buffered, in the landing region).
    pub fn peek(
        &self,
        face: BorrowedFd<'_>,
        out: &mut [u8],
        block: bool,
        deadline: Option<Instant>,
    ) -> io::Result<usize> {
        loop {
            let st = self.lock_for_call()?;
            match st.proto.next_read() {
                Some(item @ (ReadItem::Buffered { .. } | ReadItem::Landed { .. })) => {
                    return Ok(self.copy_item(&st, item, out).unwrap_or(0));
                }
                Some(ReadItem::Eof) => return Ok(0),
                Some(ReadItem::Remote { .. }) => {
                    // Peeking into a remote buffer would need it read: say nothing yet.
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                None => {
                    if let Some(e) = st.proto.error() {
                        return Err(io_error(e));
                    }
                    if !block {
                        return Err(io::ErrorKind::WouldBlock.into());
                    }
                    self.sleep(st, Some(face), PollFlags::POLLIN, deadline)?;
                }
            }
        }
    }

    /// The adapter's name.
    pub fn device_name(&self) -> &str {
        self.dev.ia.name()
    }

    /// RDMA Read up to `out.len()` bytes of the peer's advert into our landing buffer,
    /// then copy them out.
    fn read_remote(
        &self,
        face: BorrowedFd<'_>,
        out: &mut [u8],
        addr: u64,
        rkey: u32,
        len: usize,
    ) -> io::Result<usize> {
        let mut st = self.lock();
        self.ensure_zcopy(&mut st)?;
        let z = st.zc.as_ref().expect("made above");
        let n = len.min(out.len()).min(z.sink_buf.len());
        let seg = z.sink.segment(0, n as u32).map_err(itapi_err)?;
        st.read_done = None;
        self.ep
            .post_rdma_read(
                &[seg],
                READ,
                DtoFlags::SIGNALED,
                RdmaAddr {
                    addr,
                    rmr_context: u64::from(rkey),
                },
            )
            .map_err(itapi_err)?;
        st.proto.rdma_read_started(n);
        loop {
            self.progress(&mut st);
            match st.read_done.take() {
                Some(true) => break,
                Some(false) => {
                    st.proto.rdma_read_failed();
                    self.flush(&mut st);
                    return Err(io_error(st.proto.error().unwrap_or(&ConnError::Reset)));
                }
                None => {}
            }
            // Not interruptible: the read lands in our buffer and must be accounted.
            match self.sleep(st, Some(face), PollFlags::empty(), None) {
                Ok(()) | Err(_) => {}
            }
            st = self.lock();
        }
        st.zc
            .as_ref()
            .expect("made above")
            .sink_buf
            .read(0, &mut out[..n]);
        st.proto.rdma_read_done(n);
        self.flush(&mut st);
        if !st.proto.readable() {
            st.readiness.clear_readable(face);
        }
        Ok(n)
    }

    fn ensure_zcopy(&self, st: &mut State) -> io::Result<()> {
        if st.zc.is_none() {
            let size = st.proto.config().send_buffer.max(64 * 1024);
            let src_buf = RegBuf::new(size)?;
            let src = Lmr::create(
                &self.dev.pz,
                src_buf.clone(),
                MemPriv::LOCAL | MemPriv::REMOTE_READ,
            )
            .map_err(itapi_err)?;
            let sink_buf = RegBuf::new(size)?;
            let sink =
                Lmr::create(&self.dev.pz, sink_buf.clone(), MemPriv::LOCAL).map_err(itapi_err)?;
            st.zc = Some(Zcopy {
                src,
                src_buf,
                sink,
                sink_buf,
            });
        }
        Ok(())
    }

    /// Write from `data`: large writes by zero copy (staged in the registered source
    /// buffer the peer reads from), the rest queued for buffered copy. Returns the bytes
    /// taken (at least one, unless `WouldBlock`).
    pub fn write(
        &self,
        face: BorrowedFd<'_>,
        data: &[u8],
        block: bool,
        deadline: Option<Instant>,
    ) -> io::Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        loop {
            let mut st = self.lock_for_call()?;
            if let Some(e) = st.proto.error().cloned() {
                let first = !st.reset_reported;
                st.reset_reported = true;
                return Err(if first {
                    io_error(&e)
                } else {
                    io::ErrorKind::BrokenPipe.into()
                });
            }
            if st.transport_closed || st.proto.phase() != Phase::Open {
                tracing::debug!(phase = ?st.proto.phase(), transport_closed = st.transport_closed, "write on a closed SDP socket");
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            // A large write waits for the queue to drain, then goes by zero copy.
            if block && st.proto.zcopy_wanted(data.len()) && !st.proto.zcopy_fits(data.len()) {
                self.sleep(st, Some(face), PollFlags::empty(), deadline)?;
                continue;
            }
            let n = if st.proto.zcopy_fits(data.len()) {
                self.ensure_zcopy(&mut st)?;
                let z = st.zc.as_ref().expect("made above");
                let n = data.len().min(z.src_buf.len());
                z.src_buf.write(0, &data[..n]);
                let advert = Advert {
                    size: n as u32,
                    rkey: z.src.rmr_context().unwrap_or(0) as u32,
                    addr: z.src.addr(),
                };
                st.staged = n;
                st.proto.send_zcopy(advert).map_err(|e| io_error(&e))?;
                n
            } else {
                st.proto.send(data).map_err(|e| io_error(&e))?
            };
            if n > 0 {
                self.flush(&mut st);
                if !st.proto.writable() {
                    st.readiness.clear_writable(face);
                    self.show(&mut st);
                }
                return Ok(n);
            }
            st.readiness.clear_writable(face);
            if !block {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.sleep(st, Some(face), PollFlags::POLLOUT, deadline)?;
        }
    }

    /// `shutdown(SHUT_WR)`: DisConn once everything written has gone.
    pub fn shutdown_write(&self) {
        let mut st = self.lock();
        st.proto.shutdown_write();
        self.flush(&mut st);
    }

    /// The last reference is gone (`close`): an orderly close, or an abort when unread
    /// data would be lost (as TCP resets then). The connection lingers, driven by the
    /// progress thread, until the peer's DisConn (or its end) arrives.
    pub fn close(self: &Arc<Self>) {
        let mut st = self.lock();
        if st.proto.readable_bytes() > 0 {
            st.proto.abort();
        } else {
            st.proto.shutdown_write();
        }
        self.flush(&mut st);
        let done = st.transport_closed || st.established.is_none();
        drop(st);
        if !done {
            lingering()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.clone());
        }
    }

    /// The face is gone (or going): no more watching its back, which polls as hung up
    /// from now on.
    fn forget_face(&self, st: &mut State) {
        st.face_gone = true;
        let back = st.readiness.back().try_clone_to_owned();
        if let (Ok(b), Some(r)) = (
            back,
            self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_mut(),
        ) {
            r.remove(b.as_fd());
        }
    }

    /// The socket's last reference is gone: an orderly close (DisConn once everything
    /// queued has gone), or an abort when unread data would be lost (as TCP resets then).
    fn last_close(&self, st: &mut State) {
        tracing::debug!(unread = st.proto.readable_bytes(), peer = %self.peer, "SDP last close");
        if st.proto.readable_bytes() > 0 {
            st.proto.abort();
        } else {
            st.proto.shutdown_write();
        }
        self.flush(st);
    }

    /// The process is exiting: close the socket if its program did not (the kernel closes
    /// every descriptor at exit), or carry out the close the progress thread has not yet
    /// seen (a program that closes and exits at once).
    fn close_for_exit(&self) {
        let mut st = self.lock();
        self.progress(&mut st);
        if st.detached && !st.face_gone {
            // Whether or not its descriptors are closed yet, they are at exit.
            self.forget_face(&mut st);
            self.last_close(&mut st);
        }
    }

    /// Wait, until `deadline`, for the last message this end sends — DisConn, or
    /// AbortConn — to be acknowledged by the peer's adapter (every send completed; the
    /// transport's own end, which this end may have started already, is not waited for:
    /// the peer closes its side once it has the message). Returns whether it was, or the
    /// connection had ended.
    fn wait_last_message(&self, deadline: Instant) -> bool {
        loop {
            let mut st = self.lock();
            self.progress(&mut st);
            // Every send completed: acknowledged by the peer's adapter, or flushed when
            // the transport ended (then nothing more can reach the peer either).
            let sends_done = st.slots.len() == TX_SLOTS as usize;
            if st.established.is_none() || (st.proto.last_message_sent() && sends_done) {
                return true;
            }
            // No face: a closed face's back polls as hung up, for ever.
            if self
                .sleep(st, None, PollFlags::empty(), Some(deadline))
                .is_err()
                && Instant::now() >= deadline
            {
                return false;
            }
        }
    }

    /// Keep the connection alive, whoever holds it, until every descriptor of its face is
    /// closed (in every process) and the close that follows has finished: how sockets
    /// handed to unmodified programs live, as TCP's do in the kernel.
    pub fn keep_until_face_closed(self: &Arc<Self>) {
        self.lock().detached = true;
        lingering()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(self.clone());
    }

    /// Abort the connection (`SO_LINGER` with a zero timeout, then close).
    pub fn abort(&self) {
        let mut st = self.lock();
        st.proto.abort();
        self.flush(&mut st);
    }

    /// Queue the urgent byte (`MSG_OOB`).
    pub fn send_oob(&self, byte: u8) -> io::Result<()> {
        let mut st = self.lock();
        st.proto.send_oob(byte).map_err(|e| io_error(&e))?;
        self.flush(&mut st);
        Ok(())
    }

    /// Take the urgent byte received (`recv(MSG_OOB)`).
    pub fn recv_oob(&self) -> Option<u8> {
        self.lock().proto.take_oob()
    }

    /// Bytes readable now (`FIONREAD`).
    pub fn readable_bytes(&self) -> usize {
        let mut st = self.lock();
        self.progress(&mut st);
        st.proto.readable_bytes()
    }

    /// A copy of the protocol counters and the phase.
    pub fn snapshot(&self) -> (Phase, proto::Counters, i64) {
        let st = self.lock();
        (st.proto.phase(), st.proto.counters, st.proto.credits())
    }
}

impl Reactive for Conn {
    fn on_tick(&self) {
        let mut st = self.lock();
        if st.hot && !std::mem::take(&mut st.touched) {
            // Not called for a whole tick: arm it ([`hot`]).
            self.progress(&mut st);
        }
        if st.sleepers.is_empty() && st.proto.poll_timeout().is_some_and(|t| t <= Instant::now()) {
            self.progress(&mut st);
        }
    }

    fn on_ready(&self) {
        let mut st = self.lock();
        // A relayed face's events are the relay's alone (a caller asleep does not poll the
        // back).
        if (!st.sleepers.is_empty() || st.spinning > 0) && st.relay.is_none() {
            return;
        }
        // A hot connection stays so (its caller polls it; see [`hot`]).
        let arm = !st.hot || !hot::may_stay_hot();
        self.progress_with(&mut st, arm);
        // (A relayed face's last bytes are taken from the back before its close counts.)
        let drained = st.relay.as_ref().is_none_or(|r| r.face_done);
        if !st.face_gone
            && st.readiness.ended() != Some(End::Hangup)
            && drained
            && st.readiness.face_closed()
        {
            // Every descriptor of the socket is closed, in every process.
            self.forget_face(&mut st);
            if st.detached {
                tracing::debug!(peer = %self.peer, "SDP socket closed by its last holder");
                self.last_close(&mut st);
            }
        }
        let failed_face = st.readiness.ended() == Some(End::Hangup);
        // Let go only once every send has completed: dropping the connection aborts its
        // endpoint, which would throw away a DisConn posted just before.
        let sends_done = st.slots.len() == TX_SLOTS as usize;
        let finished =
            st.transport_closed && sends_done && (!st.detached || st.face_gone || failed_face);
        if finished {
            drop(st);
            let mut l = lingering().lock().unwrap_or_else(|e| e.into_inner());
            l.retain(|c| !std::ptr::eq(Arc::as_ptr(c), self));
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Out of the epoll set before the descriptors close.
        self.reg.lock().unwrap_or_else(|e| e.into_inner()).take();
        let _ = self.ep.abort();
    }
}

/// How long a blocking call polls before it sleeps, where polling drives the engine
/// (`KRDMA_SDP_SPIN_US`, default [`SPIN`]; 0 turns polling off: every call arms).
fn spin_time() -> Duration {
    static TIME: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *TIME.get_or_init(|| {
        std::env::var("KRDMA_SDP_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}

/// Connections closed by their sockets and still finishing their orderly close, and the
/// detached ones (sockets of unmodified programs) until their face is closed.
fn lingering() -> &'static Mutex<Vec<Arc<Conn>>> {
    static L: Mutex<Vec<Arc<Conn>>> = Mutex::new(Vec::new());
    &L
}

/// How long [`finish_at_exit`] waits, at most, for the peers' adapters to acknowledge.
pub const EXIT_LINGER: Duration = Duration::from_secs(5);

/// The process is exiting (called once, from an exit handler, while the stack's threads
/// still run): every connection still lingering — closed by its socket, or a detached
/// socket whose descriptors the exit is about to close — sends its last message (DisConn,
/// or AbortConn when unread data is lost), and the exit waits until the peer's adapter
/// has acknowledged it, at most `limit` in all.
///
/// The kernel finishes a TCP socket's close after its process has gone; the RDMA stack
/// of an SDP socket (the embedded kAL's engines, or the process's context in `krdmad`)
/// ends with the process, so a close the progress thread had not yet carried out, or a
/// DisConn posted but not yet on the wire, would be lost — and the peer, never told,
/// would wait for the connection's end for ever.
pub fn finish_at_exit(limit: Duration) {
    let deadline = Instant::now() + limit;
    let conns: Vec<Arc<Conn>> = lingering()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for c in &conns {
        c.close_for_exit();
    }
    for c in &conns {
        if !c.wait_last_message(deadline) {
            tracing::warn!(peer = %c.peer, "SDP close not acknowledged by the peer before exit");
        }
    }
}

/// The address this host uses towards `peer` on `dev`.
pub fn local_ip_for(dev: &Device, peer: IpAddr) -> IpAddr {
    dev.ia
        .spigots()
        .first()
        .and_then(|s| s.source_for(peer))
        .unwrap_or(if peer.is_ipv4() {
            IpAddr::from([127, 0, 0, 1])
        } else {
            IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
        })
}

/// This thread's wake-up descriptor for [`Conn::sleep`] (an eventfd: written by whoever
/// takes the events a sleeper waits for, read by the sleeper alone).
fn waker() -> io::Result<Arc<EventFd>> {
    thread_local! {
        static WAKER: std::cell::OnceCell<Arc<EventFd>> = const { std::cell::OnceCell::new() };
    }
    let new = || -> io::Result<Arc<EventFd>> {
        Ok(Arc::new(EventFd::from_flags(
            EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
        )?))
    };
    // At exit (the C library's exit handlers, `finish_at_exit`) the thread's locals are
    // gone already: a descriptor for this one sleep.
    WAKER
        .try_with(|w| {
            if let Some(e) = w.get() {
                return Ok(e.clone());
            }
            let e = new()?;
            Ok(w.get_or_init(|| e).clone())
        })
        .unwrap_or_else(|_| new())
}

#[cfg(test)]
mod tests {
    use super::offset_port;
    use proptest::prelude::*;

    #[test]
    fn offsets_below_the_top_add() {
        assert_eq!(offset_port(5000, 10000), 15000);
        assert_eq!(offset_port(55535, 10000), 65535);
        assert_eq!(offset_port(80, 10000), 10080);
        assert_eq!(offset_port(4242, 0), 4242);
    }

    #[test]
    fn offsets_past_the_top_wrap_into_unprivileged_ports() {
        // A plain wrap made 55536 port 0 (any port) and 55537..=56559 privileged ones.
        assert_eq!(offset_port(55536, 10000), 1024);
        assert_eq!(offset_port(55537, 10000), 1025);
        assert_eq!(offset_port(65535, 10000), 11023);
        assert_eq!(offset_port(65535, 65535), 1024 + 65534 % 64512);
    }

    proptest! {
        #[test]
        fn an_unprivileged_port_always_maps_to_an_unprivileged_one(
            port in 1024u16.., offset in any::<u16>()
        ) {
            prop_assert!(offset_port(port, offset) >= 1024);
        }

        #[test]
        fn unprivileged_ports_map_one_to_one(a in 1024u16.., b in 1024u16..) {
            // Only a port below 1024 (root's) can meet a wrapped one.
            prop_assume!(a != b);
            prop_assert_ne!(offset_port(a, 10000), offset_port(b, 10000));
        }
    }
}
