//! The receive side of a connected QP: the stream framed into FPDUs for the core, read by
//! the QP's rx thread — or, while a consumer polls one of the QP's CQs in embedded mode,
//! by that consumer's thread ([`rnicpi::progress`]).
//!
//! The stream, its read buffer and its framing live in [`RxSide`] behind one lock; whoever
//! holds it reads and hands the FPDUs to the core, so FPDUs reach the core in stream order
//! whoever reads. The rx thread holds it while it sleeps in `read`; a polling consumer only
//! tries it (never waits), and its attempt marks the stream driven ([`Driven`]). Once the
//! rx thread sees that, it leaves the lock and parks: woken for every message it would
//! only find the data gone, and on two cores it would take the CPU the consumers need. It
//! takes over again when the consumer arms its CQ to sleep (`release`), when the window
//! passes without a poll, or when the consumer's read found the end of the stream (only
//! the rx thread ends a connection: it lingers and closes).

use super::*;
use crate::llp;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Bytes one read asks the socket for: many FPDUs per system call.
const RX_CHUNK: usize = 128 * 1024;
/// How long the rx thread keeps looking for more after a large read before it sleeps.
const RX_SPIN: Duration = Duration::from_micros(50);
/// A read at least this large means a bulk transfer is under way: more follows at once,
/// and sleeping between reads would cost a wake-up for every chunk. After small reads
/// (ping-pong traffic) the thread sleeps at once: on two cores a spinning rx thread
/// delays the consumers more than a wake-up costs.
const RX_SPIN_AFTER: usize = 16 * 1024;
/// Reads a consumer's poll makes at most while the stream has data (1 MiB): a large
/// message without a round through the consumer's loop per chunk.
const POLL_READS: usize = 8;

/// The stream and its framing: whoever holds the lock reads.
pub(super) struct RxSide {
    sock: TcpStream,
    buf: Vec<u8>,
    framing: wire::FpduDecoder,
    /// The end a consumer's read found; the rx thread finishes the connection.
    end: Option<End>,
}

impl RxSide {
    /// `sock` in blocking mode: the rx thread sleeps in `read`.
    pub(super) fn new(sock: TcpStream) -> RxSide {
        RxSide {
            sock,
            buf: vec![0u8; RX_CHUNK],
            framing: wire::FpduDecoder::new(),
            end: None,
        }
    }
}

/// How the stream ended.
#[derive(Debug, Clone, Copy)]
enum End {
    /// End of stream (`fin`: an orderly close at an FPDU boundary) or a broken one.
    Closed { fin: bool },
    /// The QP stopped taking FPDUs (a Terminate, sent or received, or a lost completion).
    Terminated,
}

/// What one read came to.
enum Read {
    Data(usize),
    Empty,
    End(End),
}

/// The receive side's shared part (a field of the QP).
#[derive(Default)]
pub(super) struct Rx {
    side: Mutex<Option<RxSide>>,
    driven: Driven,
}

impl Rx {
    pub(super) fn install(&self, side: RxSide) {
        *self.side.lock() = Some(side);
    }
}

impl SiwQp {
    /// Read once — waiting for the stream (`wait`, the rx thread) or not — and hand every
    /// FPDU that completes to the core.
    fn read_once(&self, rx: &mut RxSide, wait: bool) -> Read {
        let got = if wait {
            match std::io::Read::read(&mut &rx.sock, &mut rx.buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                    ) =>
                {
                    Ok(None)
                }
                r => r.map(Some),
            }
        } else {
            llp::read_now(&rx.sock, &mut rx.buf)
        };
        match got {
            Ok(None) => Read::Empty,
            // An end of stream: the peer's FIN — or a reset whose error another call on
            // the socket took first (a dead peer is never an orderly close).
            Ok(Some(0)) => Read::End(End::Closed {
                fin: rx.framing.at_boundary() && !llp::was_reset(&rx.sock),
            }),
            Ok(Some(n)) => {
                let RxSide { buf, framing, .. } = rx;
                if framing.feed(&buf[..n], |fpdu| self.receive_fpdu(fpdu)) {
                    Read::Data(n)
                } else {
                    Read::End(End::Terminated)
                }
            }
            Err(_) => Read::End(End::Closed { fin: false }),
        }
    }

    /// The rx thread: sleep in `read` until the stream has something, hand it to the
    /// core, again — parked while a consumer drives the stream. After a large read it
    /// keeps looking for [`RX_SPIN`] (giving the CPU away between looks) before it
    /// sleeps again, so a bulk transfer costs no wake-up per chunk.
    pub(super) fn rx_loop(self: Arc<Self>) {
        let mut spin_until: Option<Instant> = None;
        loop {
            if self.rx.driven.park_if_driven() {
                spin_until = None;
                continue;
            }
            let mut g = self.rx.side.lock();
            let Some(side) = g.as_mut() else { return };
            let got = match side.end.take() {
                Some(end) => Read::End(end),
                None => self.read_once(side, spin_until.is_none()),
            };
            match got {
                Read::Data(n) => {
                    self.dev
                        .counters
                        .rx_reads_thread
                        .fetch_add(1, Ordering::Relaxed);
                    if n >= RX_SPIN_AFTER {
                        spin_until = Some(Instant::now() + RX_SPIN);
                    }
                }
                Read::Empty => {
                    drop(g);
                    match spin_until {
                        Some(until) if Instant::now() < until => std::thread::yield_now(),
                        _ => spin_until = None,
                    }
                }
                Read::End(end) => {
                    let side = g.take().expect("installed");
                    drop(g);
                    return match end {
                        End::Closed { fin } => self.connection_lost(fin),
                        End::Terminated => self.finish_rx(&side.sock),
                    };
                }
            }
        }
    }

    /// After a local Terminate: keep reading (so the peer never stalls on a full window)
    /// until the tx side has written the Terminate, then half a second more so the peer
    /// can take it, then close. Bounded: a peer that reads nothing cannot hold us.
    fn finish_rx(&self, sock: &TcpStream) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let _ = sock.set_read_timeout(Some(Duration::from_millis(50)));
        let mut sink = [0u8; 4096];
        let mut s = sock;
        let mut linger_until = None;
        loop {
            let now = Instant::now();
            if linger_until.is_none() && !self.st.lock().term.pending() {
                linger_until = Some(now + Duration::from_millis(500));
            }
            if now >= deadline || linger_until.is_some_and(|t| now >= t) {
                break;
            }
            match std::io::Read::read(&mut s, &mut sink) {
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

/// A consumer polling one of this QP's CQs lends its thread (see the module comment):
/// it reads while reads fill the buffer, at most [`POLL_READS`] times.
impl Progress for SiwQp {
    fn progress(&self) -> bool {
        self.rx.driven.touch();
        let Some(mut g) = self.rx.side.try_lock() else {
            return false; // the rx thread is reading (it parks once it is done)
        };
        let Some(side) = g.as_mut().filter(|s| s.end.is_none()) else {
            return false;
        };
        let mut any = false;
        for _ in 0..POLL_READS {
            match self.read_once(side, false) {
                Read::Data(n) => {
                    self.dev
                        .counters
                        .rx_reads_polled
                        .fetch_add(1, Ordering::Relaxed);
                    any = true;
                    if n < side.buf.len() {
                        // A short read took all the stream had: another now would only
                        // find it empty (a system call per ping-pong message).
                        break;
                    }
                }
                Read::Empty => break,
                Read::End(end) => {
                    side.end = Some(end);
                    drop(g);
                    self.rx.driven.release(); // calls the rx thread back to end it
                    break;
                }
            }
        }
        any
    }

    fn release(&self) {
        self.rx.driven.release();
    }
}
