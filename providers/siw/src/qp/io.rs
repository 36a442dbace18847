//! The I/O shell of a connected QP, the core's driver: its two threads, the transmit
//! pump that writes the batches the core emits, and the receive loop that frames the
//! stream into FPDUs for the core.

use super::requester::{After, Transmit};
use super::state::{Conn, INITIATOR_PAUSE, RESPONDER_WAIT};
use super::*;
use crate::llp;
use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

/// Bytes the rx thread asks the socket for at once: many FPDUs per system call.
const RX_CHUNK: usize = 128 * 1024;
/// How long the rx thread keeps looking for more after a large read before it sleeps.
const RX_SPIN: Duration = Duration::from_micros(50);
/// A read at least this large means a bulk transfer is under way: more follows at once,
/// and sleeping between reads would cost a wake-up for every chunk. After small reads
/// (ping-pong traffic) the thread sleeps at once: on two cores a spinning rx thread
/// delays the consumers more than a wake-up costs.
const RX_SPIN_AFTER: usize = 16 * 1024;

/// The transmit side of a connected QP, owned by whoever holds the `tx` lock.
pub(super) struct Tx {
    llp: Arc<dyn Llp>,
    /// Bytes a doorbell could not write without waiting: the tx thread writes them
    /// before anything else.
    unsent: Vec<u8>,
    /// The request whose last bytes are in `unsent` (it is settled once they are out).
    owed: Option<(Wqe, bool)>,
}

impl Tx {
    pub(super) fn new(llp: Arc<dyn Llp>) -> Tx {
        Tx {
            llp,
            unsent: Vec::new(),
            owed: None,
        }
    }
}

/// Who is transmitting: the QP's own tx thread, which may wait for the socket, or a
/// doorbell in a caller's thread (the daemon's doorbell reactor, or a consumer in
/// embedded mode), which never waits: it sends small requests while the socket takes
/// them and leaves the rest to the tx thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Thread,
    Inline,
}

/// Writes out a pump's FPDUs in its [`Mode`].
pub(super) struct Writer<'a> {
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

impl SiwQp {
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
        // The Responder's first FPDU waits for the Initiator's (RFC 5044 §7.1.2); the
        // Initiator's pauses briefly after the Reply (see `INITIATOR_PAUSE`). Either
        // hold ends early when an FPDU arrives from the peer.
        let hold = if reply.is_some() {
            RESPONDER_WAIT
        } else {
            INITIATOR_PAUSE
        };
        if let Conn::Up { hold_until } = &mut self.st.lock().conn {
            *hold_until = Some(Instant::now() + hold);
        }
        self.with_core(|st, _| st.event(established));
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
                format!("siw-rx{}", self.base.qpn),
                Box::new(move || a.rx_loop(rx)),
            )
            .and_then(|_| {
                spawn(
                    format!("siw-tx{}", self.base.qpn),
                    Box::new(move || b.tx_loop()),
                )
            })
        });
        if let Err(e) = started {
            // No reply sent or no threads to run the connection: it broke.
            tracing::info!(qpn = self.base.qpn, error = %e, "siw connection could not start");
            self.begin_close(true);
            self.connection_lost(false);
            return Ok(());
        }
        tracing::info!(
            qpn = self.base.qpn,
            crc = conn.crc,
            ird = conn.ird,
            ord = conn.ord,
            mss,
            "siw QP connected"
        );
        Ok(())
    }

    pub(super) fn tx_loop(self: Arc<Self>) {
        loop {
            {
                let mut st = self.st.lock();
                loop {
                    // Holding our first FPDU: the first FPDU received (it kicks us) or
                    // the end of the wait lets it go.
                    if st.handle_timeout(Instant::now()) {
                        break;
                    }
                    if let Some(t) = st.poll_timeout() {
                        self.cv.wait_until(&mut st, t);
                        continue;
                    }
                    if st.tx_ready() {
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
    pub(super) fn kick_tx(&self) {
        self.st.lock().kick = true;
        self.cv.notify_one();
    }

    /// Transmit what is ready (see [`Mode`] and `State::poll_transmit`): the core emits
    /// each batch under the state lock, and it is written without it. Returns false
    /// once the connection is finished.
    pub(super) fn pump(&self, mode: Mode) -> bool {
        let mut budget = self.base.sq.lock().capacity();
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
                self.with_core(|st, env| st.settle(env, &wqe, r.is_ok(), complete_now));
            }
            if let Err(e) = r {
                tracing::debug!(qpn = self.base.qpn, error = %e, "siw transmit failed");
                drop(guard);
                self.connection_lost(false);
                return false;
            }
        }
        let mut out = Vec::with_capacity(64 * 1024);
        loop {
            let now = Instant::now();
            let after = match self
                .with_core(|st, env| st.poll_transmit(now, mode, &mut budget, env, &mut out))
            {
                Transmit::Idle => return true,
                Transmit::Finish => {
                    w.tx.llp.shutdown(Shutdown::Write);
                    return false;
                }
                Transmit::Write(after) => after,
            };
            let r = w.put(&mut out);
            out.clear();
            if let (After::Settle { wqe, complete_now }, Ok(())) = (&after, &r) {
                if !w.tx.unsent.is_empty() {
                    // The socket is full: the tx thread finishes this request.
                    w.tx.owed = Some((*wqe, *complete_now));
                    self.kick_tx();
                    return true;
                }
            }
            self.with_core(|st, env| st.written(after, r.is_ok(), env));
            if let Err(e) = r {
                tracing::debug!(qpn = self.base.qpn, error = %e, "siw transmit failed");
                drop(guard);
                self.connection_lost(false);
                return false;
            }
        }
    }

    /// Hand one whole FPDU from the peer to the core. Returns whether the QP still takes
    /// FPDUs (not after a Terminate, sent or received, nor after a completion of this
    /// FPDU was lost).
    pub(crate) fn receive_fpdu(&self, fpdu: &[u8]) -> bool {
        let taken = {
            let mut st = self.st.lock();
            st.on_fpdu(&self.env(), fpdu)
        };
        let lost = self.drain();
        taken && !lost
    }

    /// The rx thread: read the stream in large chunks and hand each FPDU to the
    /// responder, until the stream ends or the QP stops taking FPDUs. After a large read
    /// it keeps looking for [`RX_SPIN`] (giving the CPU away between looks) before it
    /// sleeps in `read` again, so a bulk transfer costs no wake-up per chunk.
    pub(super) fn rx_loop(self: Arc<Self>, mut sock: TcpStream) {
        let mut buf = vec![0u8; RX_CHUNK];
        let mut framing = wire::FpduDecoder::new();
        let mut spin_until: Option<Instant> = None;
        loop {
            let got = match spin_until {
                Some(until) => match llp::read_now(&sock, &mut buf) {
                    Ok(Some(n)) => Ok(n),
                    Ok(None) => {
                        if Instant::now() < until {
                            std::thread::yield_now();
                        } else {
                            spin_until = None;
                        }
                        continue;
                    }
                    Err(e) => Err(e),
                },
                None => sock.read(&mut buf),
            };
            let n = match got {
                // An end of stream: the peer's FIN — or a reset whose error another
                // call on the socket took first (a dead peer is never an orderly close).
                Ok(0) => {
                    let fin = framing.at_boundary() && !llp::was_reset(&sock);
                    return self.connection_lost(fin);
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return self.connection_lost(false),
            };
            if !framing.feed(&buf[..n], |fpdu| self.receive_fpdu(fpdu)) {
                return self.finish_rx(sock);
            }
            if n >= RX_SPIN_AFTER {
                spin_until = Some(Instant::now() + RX_SPIN);
            }
        }
    }

    /// After a local Terminate: keep reading (so the peer never stalls on a full window)
    /// until the tx side has written the Terminate, then half a second more so the peer
    /// can take it, then close. Bounded: a peer that reads nothing cannot hold us.
    pub(super) fn finish_rx(&self, sock: TcpStream) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let _ = sock.set_read_timeout(Some(Duration::from_millis(50)));
        let mut sink = [0u8; 4096];
        let mut s = &sock;
        let mut linger_until = None;
        loop {
            let now = Instant::now();
            if linger_until.is_none() && !self.st.lock().term.pending() {
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
}
