//! The I/O shell of a connected QP, the core's driver: attaching the stream and starting
//! its two threads, the tx thread and the transmit pump that writes the batches the core
//! emits (the receive side is in `rx`).

use super::batch::{Batch, LendRefused};
use super::requester::{After, Transmit};
use super::rx::RxSide;
use super::state::{Conn, INITIATOR_PAUSE, RESPONDER_WAIT};
use super::*;
use crate::llp;
use std::net::{Shutdown, TcpStream};
use std::time::Instant;

/// The transmit side of a connected QP, owned by whoever holds the `tx` lock.
pub(super) struct Tx {
    llp: Arc<dyn Llp>,
    /// The batch a doorbell could not write without waiting, from stream offset
    /// `unsent_from` on (lent payloads still lent): the tx thread writes it before
    /// anything else, then tells the core how that went with `unsent_after` (`written`:
    /// a request settled, or a message part-way out given up).
    unsent: Batch,
    unsent_from: usize,
    unsent_after: Option<After>,
}

impl Tx {
    pub(super) fn new(llp: Arc<dyn Llp>) -> Tx {
        Tx {
            llp,
            unsent: Batch::default(),
            unsent_from: 0,
            unsent_after: None,
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
    /// Hand `out` to the LLP; `out` is left empty. Inline, what the socket does not take
    /// now stays in `unsent` as it is (the pump then stops: the tx thread writes it).
    fn put(&mut self, out: &mut Batch) -> std::io::Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        debug_assert!(
            self.tx.unsent.is_empty(),
            "a doorbell wrote past unsent bytes"
        );
        let (len, lent) = (out.len(), out.lent_len());
        let r = match self.mode {
            Mode::Thread => out.write_all_from(&*self.tx.llp, 0),
            Mode::Inline => out.write_now(&*self.tx.llp, 0).map(|n| {
                if n < len {
                    std::mem::swap(&mut self.tx.unsent, out);
                    self.tx.unsent_from = n;
                }
                0
            }),
        };
        out.clear();
        self.counted(r)?;
        self.counters
            .tx_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        self.counters
            .tx_bytes_lent
            .fetch_add(lent as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Count what a write returned: the lent bytes it had to copy out, or a lent
    /// payload's registration refused at write time.
    fn counted(&self, r: std::io::Result<usize>) -> std::io::Result<()> {
        match &r {
            Ok(copied) => {
                self.counters
                    .tx_bytes_lent_copied
                    .fetch_add(*copied as u64, Ordering::Relaxed);
            }
            Err(e) if e.get_ref().is_some_and(|e| e.is::<LendRefused>()) => {
                self.counters
                    .tx_lend_refused
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {}
        }
        r.map(drop)
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
        let sent = reply
            .map_or(Ok(()), |r| rx.write_all(r))
            .and_then(|_| rx.set_nonblocking(false));
        self.rx.install(RxSide::new(rx));
        let started = sent.and_then(|_| {
            let (a, b) = (self.clone(), self.clone());
            let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new()
                    .name(name)
                    .stack_size(256 * 1024)
                    .spawn(f)
            };
            spawn(
                format!("siw-rx{}", self.base.qpn),
                Box::new(move || a.rx_loop()),
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
                None => {
                    // The tx thread is at it: it takes one more round for this.
                    self.kick_tx();
                    return true;
                }
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
            let r = w.tx.unsent.write_all_from(&*w.tx.llp, w.tx.unsent_from);
            w.tx.unsent.clear();
            let r = w.counted(r);
            let after = w.tx.unsent_after.take().unwrap_or(After::Nothing);
            self.with_core(|st, env| st.written(after, r.is_ok(), env));
            if let Err(e) = r {
                tracing::debug!(qpn = self.base.qpn, error = %e, "siw transmit failed");
                drop(guard);
                self.connection_lost(false);
                return false;
            }
        }
        let mut out = Batch::with_capacity(64 * 1024);
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
            if r.is_ok() && !w.tx.unsent.is_empty() {
                // The socket was full for a doorbell: the tx thread writes the rest, tells
                // the core, then emits what follows.
                w.tx.unsent_after = Some(after);
                self.kick_tx();
                return true;
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
}
