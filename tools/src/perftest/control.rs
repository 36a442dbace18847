//! Connection setup and the control connection.
//!
//! perftest `-R` runs everything over rdma_cm: a first connection carries the parameter
//! exchange (`ctx_xchg_data`, `ctx_hand_shake`) as small Sends on an RC QP with one receive
//! posted; the data QPs connect afterwards to the same port. Without `-R` the same
//! exchange runs over a TCP socket (`sockets`). Every exchange is lock-step: the client
//! sends first and then waits for the server's answer; the server waits first.

use super::sockets::SocketControl;
use super::wire::Dest;
use super::PerfError;
use crate::perf::{new_endpoint, Endpoint};
use rnicpi::{send_flags, ConnParam, Event, EventKind, VerbsError, WcOpcode, WcStatus};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{Context, Cqe, Listener};

/// How long a peer may take to answer a control message (a server waits here while the
/// client runs the whole test, `-a` included, on an emulated guest).
pub const CONTROL_IDLE: Duration = Duration::from_secs(900);
/// How long a data-path wait may see no completion at all.
pub const DATA_IDLE: Duration = Duration::from_secs(60);
/// How long a client keeps retrying a refused connection (perftest: 10 tries, 100 ms apart;
/// a server under emulation can take longer to open its data listener).
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a wait for a completion busy-polls before it sleeps (perftest always polls;
/// latency runs stay in this phase).
const SPIN: Duration = Duration::from_millis(5);
/// How long one sleep on the CQ lasts before the connection and the deadline are checked.
const WAIT_SLICE: Duration = Duration::from_millis(200);
const RETRY_DELAY: Duration = Duration::from_millis(100);

/// Receive slots of the control QP (perftest posts one; more change nothing on the wire).
const RECV_SLOTS: u64 = 4;
/// Bytes per slot: at least `sizeof(struct pingpong_dest)`.
const SLOT: u64 = 64;
const SEND_OFF: u64 = RECV_SLOTS * SLOT;
const SEND_ID: u64 = u64::MAX;
const SEND_WHAT: &str = "control send";

/// Turn a completion into an error unless it succeeded; a flushed request means the
/// connection went away.
pub fn check(c: Cqe, what: &'static str) -> Result<Cqe, PerfError> {
    match c.status() {
        WcStatus::Success => Ok(c),
        WcStatus::WrFlushErr => Err(PerfError::PeerClosed(what)),
        status => Err(PerfError::Completion {
            what,
            status,
            vendor_err: c.vendor_err,
        }),
    }
}

/// The next completion of `ep`, successful or not. Polled (yielding the CPU between
/// polls, so the engine's threads run) for up to `SPIN`, then waited for on CQ
/// notifications; with `events` (`-e`) waited for from the start (arm, look again,
/// sleep). Fails when the connection is gone with nothing left in the CQ, or when `idle`
/// passes.
pub fn next_raw(
    ep: &Endpoint,
    idle: Duration,
    what: &'static str,
    events: bool,
) -> Result<Cqe, PerfError> {
    let mut one = [Cqe::default()];
    let spin_until = Instant::now() + if events { Duration::ZERO } else { SPIN };
    loop {
        if ep.cq.poll(&mut one) == 1 {
            return Ok(one[0]);
        }
        if Instant::now() > spin_until {
            break;
        }
        std::thread::yield_now();
    }
    let deadline = Instant::now() + idle;
    loop {
        let quiet = if events {
            let armed = ep.cq.arm_to_sleep(false);
            if ep.cq.poll(&mut one) == 1 {
                return Ok(one[0]);
            }
            ep.cq.sleep(armed, WAIT_SLICE)?;
            if ep.cq.poll(&mut one) == 1 {
                return Ok(one[0]);
            }
            true
        } else {
            match ep.cq.wait(1, WAIT_SLICE) {
                Ok(c) => return Ok(c[0]),
                Err(VerbsError::TimedOut) => true,
                Err(e) => return Err(e.into()),
            }
        };
        if quiet {
            if closed(ep) {
                // Whatever completed before the close is in the CQ by now.
                return match ep.cq.poll(&mut one) {
                    1 => Ok(one[0]),
                    _ => Err(PerfError::PeerClosed(what)),
                };
            }
            if Instant::now() > deadline {
                return Err(PerfError::Timeout(what));
            }
        }
    }
}

/// Events that end a connection.
fn ends_connection(kind: EventKind) -> bool {
    matches!(
        kind,
        EventKind::Disconnected | EventKind::ConnectionBroken | EventKind::AccessLayerDead
    )
}

/// Whether the QP's connection has been closed or broken (drains its event queue).
pub fn closed(ep: &Endpoint) -> bool {
    ep.qp.events().try_iter().any(|ev| ends_connection(ev.kind))
}

/// Wait up to `patience` for the QP's connection to report its close (our own orderly
/// close, or the peer's).
pub fn await_disconnect(ep: &Endpoint, patience: Duration) {
    let deadline = Instant::now() + patience;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match ep.qp.next_event(left) {
            Ok(ev) if !ends_connection(ev.kind) => {}
            _ => return,
        }
    }
}

/// IRD/ORD a connection asks for: perftest passes `out_reads` for Read tests, 0 otherwise
/// (krdma's siw raises 0 to 1 in the MPA words).
pub fn conn_param(out_reads: u32) -> ConnParam {
    ConnParam {
        private_data: vec![],
        ird: out_reads,
        ord: out_reads,
    }
}

/// The next connection request on `listener`.
pub fn next_request(listener: &Listener, timeout: Duration) -> Result<Event, PerfError> {
    let ev = listener.get_request(timeout)?;
    tracing::info!(peer = ?ev.peer, ird = ev.ird, ord = ev.ord, "perftest: connection request");
    Ok(ev)
}

/// Accept `req` on `ep`'s QP and wait until the connection is established. A request in
/// the other port space than `ep`'s QP (UD or connected) is refused.
pub fn accept(
    listener: &Listener,
    req: &Event,
    ep: &Endpoint,
    param: &ConnParam,
    ud: bool,
) -> Result<(), PerfError> {
    if req.ud.is_some() != ud {
        let _ = listener.reject(req.conn_id, &[]);
        return Err(PerfError::Protocol(
            "the peer connects the data QPs in the other port space (-c UD on one side only)",
        ));
    }
    listener.accept(req.conn_id, &ep.qp, param)?;
    if ud {
        // A SIDR reply is all there is: no connection to come up.
        tracing::info!(peer = ?req.peer, "perftest: UD service request answered");
        return Ok(());
    }
    let ev = ep.qp.next_event(CONNECT_TIMEOUT)?;
    if ev.kind != EventKind::Established {
        tracing::warn!(kind = ?ev.kind, "perftest: accepted connection did not come up");
        return Err(PerfError::PeerClosed("the accepted connection"));
    }
    tracing::info!(peer = ?ev.peer, ird = ev.ird, ord = ev.ord, "perftest: connection established");
    Ok(())
}

/// Connect a fresh endpoint from `make` to `peer`, retrying while the peer refuses: the
/// perftest server opens its data listener only after answering the handshake before it.
/// Returns the endpoint and its `Established` event (for a UD QP it names the server's QP).
pub fn connect_retry(
    mut make: impl FnMut() -> ual::Result<Endpoint>,
    peer: SocketAddr,
    param: &ConnParam,
    patience: Duration,
) -> Result<(Endpoint, Event), PerfError> {
    let deadline = Instant::now() + patience;
    let mut tries = 0u32;
    loop {
        tries += 1;
        let ep = make()?;
        match ep.qp.connect_wait(peer, param, CONNECT_TIMEOUT) {
            Ok(ev) => {
                tracing::info!(%peer, tries, ird = ev.ird, ord = ev.ord, "perftest: connected");
                return Ok((ep, ev));
            }
            Err(e) if Instant::now() < deadline && retryable(e) => {
                tracing::debug!(%peer, tries, error = %e, "perftest: connect failed, retrying");
                drop(ep);
                std::thread::sleep(RETRY_DELAY);
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn retryable(e: VerbsError) -> bool {
    matches!(
        e,
        VerbsError::Refused
            | VerbsError::Unreachable
            | VerbsError::ConnectionReset
            | VerbsError::TimedOut
    )
}

/// perftest's control channel, either kind.
pub enum Control {
    /// `-R`: Sends on an rdma_cm connection, records in binary.
    Cm(CmControl),
    /// Default on IB/RoCE: a TCP socket, records as text.
    Sockets(SocketControl),
}

impl Control {
    /// `ctx_xchg_data`: send `mine`, receive the peer's message of the same length
    /// (client first).
    pub fn xchg(&mut self, mine: &[u8], what: &'static str) -> Result<Vec<u8>, PerfError> {
        match self {
            Control::Cm(c) => c.xchg(mine, what),
            Control::Sockets(s) => s.xchg(mine, what),
        }
    }

    /// `ctx_hand_shake`: exchange `pingpong_dest` records.
    pub fn handshake(&mut self, mine: &Dest) -> Result<Dest, PerfError> {
        match self {
            Control::Cm(c) => c.handshake(mine),
            Control::Sockets(s) => s.handshake(mine),
        }
    }

    /// The closing handshake (`ctx_close_connection`); over the socket followed by `done`.
    pub fn finish(&mut self, mine: &Dest) -> Result<(), PerfError> {
        match self {
            Control::Cm(c) => c.finish(mine),
            Control::Sockets(s) => {
                s.handshake(mine)?;
                s.done();
                Ok(())
            }
        }
    }

    /// Whether the data QPs were connected by rdma_cm (and close through it).
    pub fn is_cm(&self) -> bool {
        matches!(self, Control::Cm(_))
    }
}

/// perftest's rdma_cm control connection.
pub struct CmControl {
    pub ep: Endpoint,
    client: bool,
    /// Messages received and not yet read (one may arrive while we wait for our own
    /// Send's completion).
    received: VecDeque<Vec<u8>>,
    /// The peer closed: our receives came back flushed.
    closed: bool,
}

/// What one control completion was.
enum Ctl {
    /// Our Send completed (`false`: flushed because the connection closed).
    Sent(bool),
    Other,
}

impl CmControl {
    /// The control QP's verbs objects, with its receives posted.
    pub fn endpoint(ctx: &Arc<Context>, dev: u32) -> ual::Result<Endpoint> {
        let ep = new_endpoint(ctx, dev, (SEND_OFF + SLOT) as usize, 8)?;
        for slot in 0..RECV_SLOTS {
            ep.post_recv(slot, slot * SLOT, SLOT as u32)?;
        }
        Ok(ep)
    }

    pub fn new(ep: Endpoint, client: bool) -> CmControl {
        CmControl {
            ep,
            client,
            received: VecDeque::new(),
            closed: false,
        }
    }

    fn xchg(&mut self, mine: &[u8], what: &'static str) -> Result<Vec<u8>, PerfError> {
        if self.client {
            self.write(mine)?;
            self.read(mine.len(), what)
        } else {
            let theirs = self.read(mine.len(), what)?;
            self.write(mine)?;
            Ok(theirs)
        }
    }

    fn handshake(&mut self, mine: &Dest) -> Result<Dest, PerfError> {
        Dest::decode(&self.xchg(&mine.encode(), "pingpong_dest")?)
    }

    /// Orderly close of the control connection.
    pub fn close(&self) {
        let _ = self.ep.qp.disconnect(false);
    }

    /// Wait up to `patience` for the peer to close the control connection (perftest's
    /// server closes it first).
    pub fn await_peer_close(&mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        while !self.closed {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            match self.next_within(left, "the server's close") {
                Ok(_) => {}
                Err(PerfError::PeerClosed(_)) => self.closed = true,
                Err(_) => return,
            }
        }
        tracing::debug!("perftest: control connection closed by the server");
    }

    /// The closing handshake (`ctx_close_connection`). The client closes as soon as it
    /// has the server's answer, which can flush the server's Send before its completion
    /// is written: the client had it, so for the server that counts as done.
    fn finish(&mut self, mine: &Dest) -> Result<(), PerfError> {
        match self.handshake(mine) {
            Err(PerfError::PeerClosed(SEND_WHAT)) if !self.client => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Send `data` and wait for the Send's completion. A Send flushed by the peer's close
    /// still counts when the peer answered it.
    fn write(&mut self, data: &[u8]) -> Result<(), PerfError> {
        let answers_before = self.received.len();
        self.ep.buf.write(SEND_OFF as usize, data);
        self.ep
            .send(SEND_ID, SEND_OFF, data.len() as u32, send_flags::SIGNALED)?;
        loop {
            match self.next(SEND_WHAT)? {
                Ctl::Sent(true) => return Ok(()),
                Ctl::Sent(false) if self.received.len() > answers_before => return Ok(()),
                Ctl::Sent(false) => return Err(PerfError::PeerClosed(SEND_WHAT)),
                Ctl::Other => {}
            }
        }
    }

    /// The peer's next message, which must be `want` bytes long.
    fn read(&mut self, want: usize, what: &'static str) -> Result<Vec<u8>, PerfError> {
        let m = loop {
            if let Some(m) = self.received.pop_front() {
                break m;
            }
            if self.closed {
                return Err(PerfError::PeerClosed(what));
            }
            self.next(what)?;
        };
        if m.len() != want {
            return Err(PerfError::BadLength {
                what,
                want,
                got: m.len(),
            });
        }
        Ok(m)
    }

    /// Take one completion: a message is queued for [`Control::read`] and its slot posted
    /// again; a flushed receive means the peer has closed (messages before the close
    /// still count: the Send's completion may land after the flushes).
    fn next(&mut self, what: &'static str) -> Result<Ctl, PerfError> {
        self.next_within(CONTROL_IDLE, what)
    }

    fn next_within(&mut self, idle: Duration, what: &'static str) -> Result<Ctl, PerfError> {
        let c = next_raw(&self.ep, idle, what, false)?;
        if c.wr_id == SEND_ID {
            if c.status() == WcStatus::WrFlushErr {
                self.closed = true;
                return Ok(Ctl::Sent(false));
            }
            check(c, SEND_WHAT)?;
            return Ok(Ctl::Sent(true));
        }
        match c.status() {
            WcStatus::Success if c.opcode() == Some(WcOpcode::Recv) => {
                let m = self.take(&c)?;
                self.received.push_back(m);
            }
            WcStatus::WrFlushErr => {
                tracing::debug!("perftest: control connection closed by the peer");
                self.closed = true;
            }
            _ => {
                check(c, what)?;
            }
        }
        Ok(Ctl::Other)
    }

    /// Copy a received message out of its slot and post the slot again.
    fn take(&mut self, c: &Cqe) -> Result<Vec<u8>, PerfError> {
        let slot = c.wr_id;
        if slot >= RECV_SLOTS {
            return Err(PerfError::Protocol(
                "receive completion for an unknown slot",
            ));
        }
        let mut m = vec![0u8; (c.byte_len as u64).min(SLOT) as usize];
        self.ep.buf.read((slot * SLOT) as usize, &mut m);
        if self.ep.post_recv(slot, slot * SLOT, SLOT as u32).is_err() {
            // The QP is closing; the message itself is good.
            self.closed = true;
        }
        Ok(m)
    }
}
