//! Two siw QPs stepped against each other over a simulated byte stream: no socket, no
//! thread, no root, and every run decided by its seed.
//!
//! iWARP leaves loss, duplication and reordering to TCP, so what a siw engine must
//! survive from its link is how the stream is cut and paced: FPDUs split at any byte,
//! many FPDUs in one read, a send buffer that fills (the doorbell then hands the rest of
//! a request to the transmitter), bytes corrupted underneath the CRC, and the stream
//! ending in order (FIN) or abortively (reset) at any point. [`Sim`] plays both QPs' threads
//! in one thread as the real ones would run them — the receive thread's framing
//! ([`FpduDecoder`] into the responder, end of stream, the wind-down after a Terminate)
//! and the transmit thread's pump — and moves the bytes between them in chunks and at
//! moments the seed chooses.

use crate::llp::Llp;
use crate::qp::SiwQp;
use crate::wire::{FpduDecoder, Header, Model, Opcode, ReadRequest};
use crate::{SiwConfig, SiwDevice};
use parking_lot::Mutex;
use rnicpi::sim::{NoNetwork, SimQp, SimRng};
use std::collections::VecDeque;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io;
use std::net::Shutdown;
use std::sync::Arc;

/// How the simulated stream is cut and paced.
#[derive(Debug, Clone, Copy)]
pub struct StreamModel {
    /// Largest chunk a receive thread reads at once (each read takes 1..=this bytes).
    pub max_chunk: usize,
    /// Bytes a sender's socket buffer holds beyond what the peer has read: a write that
    /// never waits (the doorbell's) takes no more than that.
    pub window: usize,
    /// MSS the connection is set up with: the largest FPDU follows from it.
    pub mss: usize,
    /// MPA CRC negotiated.
    pub crc: bool,
}

impl Default for StreamModel {
    fn default() -> Self {
        StreamModel {
            max_chunk: 64 * 1024,
            window: 256 * 1024,
            mss: 1460,
            crc: true,
        }
    }
}

/// One direction of the connection: what a QP wrote that its peer has not read.
#[derive(Debug, Default)]
struct Pipe {
    state: Mutex<PipeState>,
    window: usize,
}

#[derive(Debug, Default)]
struct PipeState {
    bytes: VecDeque<u8>,
    /// The writer closed its side in order: the reader sees the end after the bytes.
    fin: bool,
    /// The writer reset the connection: the bytes in flight are gone.
    reset: bool,
}

impl Llp for Pipe {
    fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        let mut s = self.state.lock();
        if s.fin || s.reset {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        s.bytes.extend(bytes);
        Ok(())
    }

    fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
        let mut s = self.state.lock();
        if s.fin || s.reset {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let n = bytes.len().min(self.window.saturating_sub(s.bytes.len()));
        s.bytes.extend(&bytes[..n]);
        Ok(n)
    }

    fn shutdown(&self, how: Shutdown) {
        if how != Shutdown::Read {
            self.state.lock().fin = true;
        }
    }

    fn abort(&self) {
        let mut s = self.state.lock();
        s.reset = true;
        s.bytes.clear();
    }
}

/// One end: the QP, what it writes, and its receive thread's state.
struct End {
    qp: SimQp,
    engine: Arc<SiwQp>,
    out: Arc<Pipe>,
    framing: FpduDecoder,
    /// The responder stopped taking FPDUs (it sent a Terminate): what comes is dropped.
    rx_stopped: bool,
    /// The receive thread has ended (the connection is lost for this QP).
    rx_done: bool,
    /// The transmitter has ended (its pump said so), which the tx thread does on its own
    /// time: after the receive side's, when it still had bytes to write then.
    tx_done: bool,
}

impl End {
    /// A reset reached this end: its socket fails, for writes too, and the connection is
    /// lost for its QP.
    fn reset(&mut self) {
        self.out.state.lock().reset = true;
        self.rx_done = true;
        self.engine.connection_lost(false);
    }
}

/// Two connected siw QPs and the stream between them.
pub struct Sim {
    _dev: Arc<SiwDevice>,
    ends: [End; 2],
    rng: SimRng,
    model: StreamModel,
    /// Bytes moved from each end to the other.
    moved: [u64; 2],
    /// Corrupt the byte at this offset of the stream from end 0 (once).
    corrupt_at: Option<u64>,
    seed: u64,
    /// What the streams carried, in order: see [`Sim::digest`].
    trace: DefaultHasher,
    /// Each stream framed again for the digest.
    trace_framing: [FpduDecoder; 2],
}

impl Sim {
    /// Two QPs on one siw device, each with a `buf_len`-byte registered buffer and
    /// queues `depth` deep, connected (RTS, IRD = ORD = 4) over a simulated stream.
    pub fn new(seed: u64, model: StreamModel, buf_len: usize, depth: u32) -> Sim {
        let dev = SiwDevice::new(SiwConfig::default(), Arc::new(NoNetwork::default()));
        let end = || {
            let qp = SimQp::new(&*dev, buf_len, depth);
            let engine = qp
                .engine
                .as_any()
                .downcast_ref::<SiwQp>()
                .and_then(|q| q.arc().ok())
                .expect("a siw QP");
            let out = Arc::new(Pipe {
                window: model.window,
                ..Pipe::default()
            });
            engine
                .enter_rts(out.clone(), model.crc, 4, 4, model.mss)
                .expect("QP to RTS");
            End {
                qp,
                engine,
                out,
                framing: FpduDecoder::new(),
                rx_stopped: false,
                rx_done: false,
                tx_done: false,
            }
        };
        let ends = [end(), end()];
        Sim {
            _dev: dev,
            ends,
            rng: SimRng::new(seed),
            model,
            moved: [0; 2],
            corrupt_at: None,
            seed,
            trace: DefaultHasher::new(),
            trace_framing: [FpduDecoder::new(), FpduDecoder::new()],
        }
    }

    /// The QP of end `i` (0 or 1) as its consumer holds it.
    pub fn qp(&self, i: usize) -> &SimQp {
        &self.ends[i].qp
    }

    /// The QP of end `i`, to fill its buffer.
    pub fn qp_mut(&mut self, i: usize) -> &mut SimQp {
        &mut self.ends[i].qp
    }

    /// Flip a bit of the byte at `offset` of the stream end 0 sends.
    pub fn corrupt_from_0_at(&mut self, offset: u64) {
        self.corrupt_at = Some(offset);
    }

    /// A reset reaches end `i` now, before its transmitter runs again (its receive
    /// thread sees it first): its socket fails, reads and writes, and the connection is
    /// lost for it; the other end sees the reset on its stream.
    pub fn reset_reaches(&mut self, i: usize) {
        self.ends[i].reset();
    }

    /// Bytes moved so far from end `i` to the other.
    pub fn moved_from(&self, i: usize) -> u64 {
        self.moved[i]
    }

    /// A digest of what the streams carried so far (how each was cut into reads, where it
    /// ended, and every FPDU but for its memory keys and addresses, which are random or
    /// wherever the heap put a buffer) and of each QP's events: two runs of one seed, or
    /// two builds of the engine, must agree on it.
    pub fn digest(&self) -> u64 {
        let mut h = self.trace.clone();
        for e in &self.ends {
            for ev in e.qp.events.all() {
                (format!("{:?}", ev.kind), ev.status).hash(&mut h);
            }
        }
        h.finish()
    }

    /// One step: both transmitters run, then one direction chosen by the seed moves a
    /// chunk (or delivers the end of its stream). False when nothing is left to do.
    pub fn step(&mut self) -> bool {
        for e in &mut self.ends {
            if !e.tx_done {
                e.tx_done = !e.engine.transmit();
            }
        }
        let ready: Vec<usize> = (0..2).filter(|&i| self.has_news(i)).collect();
        if ready.is_empty() {
            return false;
        }
        let from = ready[self.rng.upto(ready.len() as u64 - 1) as usize];
        self.deliver(from);
        true
    }

    /// Whether the stream from `from` has something for its reader: bytes, its end, or
    /// (for a reader that stopped after its Terminate) the moment to give up.
    fn has_news(&self, from: usize) -> bool {
        let to = &self.ends[1 - from];
        if to.rx_done {
            return false;
        }
        let s = self.ends[from].out.state.lock();
        let own = to.out.state.lock();
        !s.bytes.is_empty() || s.fin || s.reset || own.reset || (to.rx_stopped && own.fin)
    }

    /// Give the reader of the stream from `from` what its receive thread would get next.
    fn deliver(&mut self, from: usize) {
        let max = self.model.max_chunk.max(1) as u64;
        let n = 1 + self.rng.upto(max - 1) as usize;
        let (chunk, fin, reset) = {
            let mut s = self.ends[from].out.state.lock();
            let n = n.min(s.bytes.len());
            let chunk: Vec<u8> = s.bytes.drain(..n).collect();
            (chunk, s.fin && s.bytes.is_empty(), s.reset)
        };
        let mut chunk = chunk;
        if from == 0 {
            if let Some(at) = self.corrupt_at {
                let start = self.moved[0];
                if at >= start && at < start + chunk.len() as u64 {
                    chunk[(at - start) as usize] ^= 0x10;
                    self.corrupt_at = None;
                }
            }
        }
        self.moved[from] += chunk.len() as u64;
        (from, chunk.len(), fin, reset).hash(&mut self.trace);
        let (trace, crc) = (&mut self.trace, self.model.crc);
        self.trace_framing[from].feed(&chunk, |f| {
            trace_fpdu(trace, f, crc);
            true
        });
        let to = &mut self.ends[1 - from];
        if reset || to.out.state.lock().reset {
            // A reset, from the peer or our own abortive close.
            to.reset();
            return;
        }
        if !to.rx_stopped && !chunk.is_empty() {
            let engine = &to.engine;
            to.rx_stopped = !to.framing.feed(&chunk, |f| engine.receive_fpdu(f));
        }
        let own_end_sent = {
            let own = to.out.state.lock();
            own.fin || own.reset
        };
        if to.rx_stopped && own_end_sent {
            // After its Terminate the receive thread drains until the Terminate is out
            // (and the FIN behind it), then ends the connection.
            to.rx_done = true;
            to.engine.connection_lost(false);
        } else if fin {
            to.rx_done = true;
            let clean = to.framing.at_boundary();
            to.engine.connection_lost(clean);
        }
    }
}

/// One FPDU into the digest, without its STags and tagged offsets (and so without its
/// CRC, which covers them).
fn trace_fpdu(h: &mut DefaultHasher, fpdu: &[u8], crc: bool) {
    fpdu.len().hash(h);
    let Ok((hdr, payload)) = crate::wire::check_fpdu(fpdu, crc).and_then(Header::parse_bytes)
    else {
        return fpdu.hash(h); // corrupted: no key in it to hide (the tests corrupt Sends)
    };
    (hdr.opcode as u8, hdr.last).hash(h);
    match hdr.model {
        Model::Tagged { .. } => {}
        Model::Untagged { qn, msn, mo, .. } => (qn, msn, mo).hash(h),
    }
    match ReadRequest::parse_bytes(payload) {
        Ok(rr) if hdr.opcode == Opcode::ReadRequest => rr.size.hash(h),
        _ => payload.hash(h),
    }
}

impl Drop for Sim {
    /// With `SIW_SIM_DIGEST=<file>`, append this run's seed and digest to the file: the
    /// record two builds of the engine are compared by.
    fn drop(&mut self) {
        if let Some(path) = std::env::var_os("SIW_SIM_DIGEST") {
            use std::io::Write;
            let line = format!(
                "{} {} {} {:016x}\n",
                std::thread::current().name().unwrap_or("-"),
                self.seed,
                self.moved[0] + self.moved[1],
                self.digest()
            );
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
            {
                let _ = f.write_all(line.as_bytes());
            }
        }
    }
}
