//! The QP engine on an in-memory LLP, for fuzzing (`tests/fuzz`, target `siw_qp`) and
//! deterministic tests: a real [`SiwDevice`], CQ and QP with real rings and key table, a
//! connection that carries the peer's FPDUs into the engine (the rx thread's own entry
//! point) and collects what the engine transmits, and registrations over guarded
//! buffers whose accessor refuses — by panicking, which a fuzzer reports — every write
//! that lands outside what the operation under way may touch.
//!
//! The peer is a list of [`Action`]s, decoded from arbitrary bytes: consumer requests
//! (post a receive, a Read, a Send), FPDUs built near the registrations (STags, tagged
//! offsets, MSNs and sizes close to the real ones), Read Responses aimed at the reads
//! outstanding, raw bytes, polls, access-flag changes and closes. Nothing here runs a
//! thread: the harness plays the tx thread by pumping after each action.
//!
//! Over 600 lines: the harness (guarded memory, in-memory LLP, the rig that plays the
//! actions) is the first 590 lines; the rest are its tests. The actions themselves, as
//! a fuzzer's bytes decode to them, are in `action`.

mod action;

use crate::llp::Llp;
use crate::qp::SiwQp;
use crate::wire::{self, Header, Model, Opcode, ReadRequest, ReadRequestPacket};
use crate::{SiwConfig, SiwDevice};
pub use action::{Action, Fpdu, StagSel};
use parking_lot::Mutex;
use rnicpi::sim::NoNetwork;
use rnicpi::*;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

/// Guard bytes on each side of every registered buffer.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xA5;
/// Bytes of each registration.
pub const MR_LEN: usize = 4096;
/// Largest payload an action builds.
const MAX_PAYLOAD: usize = 2048;
const CQ_DEPTH: u32 = 16;
const QP_DEPTH: u32 = 16;

/// The registrations of the harness, by index in [`Action`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Remote write and read, local write: a peer may write anywhere in it.
    Remote,
    /// Local write only: written only by receives and Read Responses into posted ranges.
    Local,
    /// Remote read only: never written.
    ReadOnly,
    /// Every right, in another protection domain: never written through this QP.
    Foreign,
}

const KINDS: [Kind; 4] = [Kind::Remote, Kind::Local, Kind::ReadOnly, Kind::Foreign];

/// A registered buffer with guard bytes around it, and the ranges the engine may write
/// into right now.
#[derive(Debug)]
struct Guarded {
    base: u64,
    bytes: Mutex<Vec<u8>>,
    /// (wr_id, start, end) of ranges a posted receive or Read may fill; the whole
    /// buffer for `Remote`.
    open: Mutex<Vec<(u64, u64, u64)>>,
}

impl Guarded {
    fn new(base: u64, kind: Kind) -> Guarded {
        let mut bytes = vec![GUARD_BYTE; GUARD + MR_LEN + GUARD];
        for (i, b) in bytes[GUARD..GUARD + MR_LEN].iter_mut().enumerate() {
            *b = i as u8;
        }
        let open = if kind == Kind::Remote {
            vec![(u64::MAX, base, base + MR_LEN as u64)]
        } else {
            Vec::new()
        };
        Guarded {
            base,
            bytes: Mutex::new(bytes),
            open: Mutex::new(open),
        }
    }

    /// Index of `addr..addr+len` in `bytes` (guards included); panics outside it.
    fn index(&self, addr: u64, len: usize) -> usize {
        let lo = self.base - GUARD as u64;
        let off = addr.checked_sub(lo).expect("access below the buffer") as usize;
        assert!(
            off + len <= GUARD + MR_LEN + GUARD,
            "access beyond the buffer"
        );
        off
    }

    /// The guards and, for buffers nothing may write, the contents are as made.
    fn check(&self, writable: bool) {
        let b = self.bytes.lock();
        assert!(
            b[..GUARD]
                .iter()
                .chain(&b[GUARD + MR_LEN..])
                .all(|&x| x == GUARD_BYTE),
            "a guard byte around the registration at {:#x} changed",
            self.base
        );
        if !writable {
            assert!(
                b[GUARD..GUARD + MR_LEN]
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == i as u8),
                "the registration at {:#x}, which nothing may write, changed",
                self.base
            );
        }
    }
}

impl MemoryAccess for Guarded {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        let i = self.index(addr, buf.len());
        buf.copy_from_slice(&self.bytes.lock()[i..i + buf.len()]);
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let i = self.index(addr, data.len());
        let end = addr + data.len() as u64;
        assert!(
            self.open
                .lock()
                .iter()
                .any(|&(_, lo, hi)| addr >= lo && end <= hi),
            "write of {} bytes at {addr:#x} outside every range the engine may fill",
            data.len()
        );
        self.bytes.lock()[i..i + data.len()].copy_from_slice(data);
        Ok(())
    }
}

/// The connection's far end in memory: what the engine transmits is kept; a write that
/// never waits takes at most `room` bytes, so the doorbell's hand-over to the tx thread
/// runs too.
#[derive(Default)]
struct MemoryLlp {
    sent: Mutex<Vec<u8>>,
    room: AtomicUsize,
    closed: AtomicBool,
    /// A doorbell is running: it may never wait for the socket (audit H1).
    in_doorbell: AtomicBool,
    /// Runs once, right after the next waiting write took its bytes and before the
    /// transmitter hears back (a test's stand-in for the peer acting at that moment).
    after_write: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Llp for MemoryLlp {
    fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        assert!(
            !self.in_doorbell.load(Ordering::Acquire),
            "a doorbell waited for the socket"
        );
        if self.closed.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        self.sent.lock().extend_from_slice(bytes);
        let after = self.after_write.lock().take();
        if let Some(f) = after {
            f();
        }
        Ok(())
    }

    fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
        if self.closed.load(Ordering::Acquire) {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let n = bytes.len().min(self.room.load(Ordering::Acquire));
        self.sent.lock().extend_from_slice(&bytes[..n]);
        Ok(n)
    }

    fn shutdown(&self, how: Shutdown) {
        if how != Shutdown::Read {
            self.closed.store(true, Ordering::Release);
        }
    }

    fn abort(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// The consumer's doorbell, as in embedded mode: the engine's doorbell runs in the
/// caller's thread (and may not wait for the socket there).
struct Bell(Weak<SiwQp>, Arc<MemoryLlp>);

impl Doorbell for Bell {
    fn ring(&self) {
        if let Some(qp) = self.0.upgrade() {
            self.1.in_doorbell.store(true, Ordering::Release);
            qp.doorbell();
            self.1.in_doorbell.store(false, Ordering::Release);
        }
    }
}

/// A read the consumer posted, as the peer sees it: where its response goes.
#[derive(Debug, Clone, Copy)]
struct PeerRead {
    wr_id: u64,
    sink_stag: u32,
    sink_to: u64,
    answered: u32,
}

/// One siw QP connected over memory to a scripted peer.
pub struct Harness {
    _dev: Arc<SiwDevice>,
    qp: Arc<SiwQp>,
    user: UserQp,
    cq: UserCq,
    mrs: Vec<(Kind, Arc<Guarded>, u32)>,
    llp: Arc<MemoryLlp>,
    crc: bool,
    next_wr: u64,
    /// Next MSN the engine expects per untagged queue (Send, Read Request), as the
    /// peer keeps it.
    msn: [u32; 2],
    reads: Vec<PeerRead>,
    /// The QP's asynchronous and connection events.
    events: Arc<Mutex<Vec<EventKind>>>,
    _keep: Vec<Arc<dyn ProviderCq>>,
}

impl Harness {
    /// A QP in RTS (MPA CRC on or off), with a receive-capable CQ and four registrations.
    pub fn new(crc: bool) -> Harness {
        let dev = SiwDevice::new(SiwConfig::default(), Arc::new(NoNetwork::default()));
        let ring_mem = |n: usize| Arc::new(SharedMem::create("siw-harness", n).expect("memfd"));
        let cq_mem = ring_mem(queue::ring_bytes::<Cqe>(CQ_DEPTH));
        let stats = Arc::new(RingStats::default());
        let cq: Arc<dyn ProviderCq> = dev
            .create_cq(CqInit {
                depth: CQ_DEPTH,
                ring: Ring::attach(cq_mem.clone(), 0, CQ_DEPTH)
                    .expect("ring")
                    .producer(),
                sink: Arc::new(NullSink),
                stats: stats.clone(),
            })
            .expect("cq");
        let events = Arc::new(Mutex::new(Vec::new()));
        let log = events.clone();
        let layout = QpRingLayout::new(QP_DEPTH, QP_DEPTH).expect("layout");
        let qp_mem = ring_mem(layout.total);
        let ring = |off, depth| Ring::attach(qp_mem.clone(), off, depth).expect("ring");
        let caps = QpCaps {
            max_send_wr: QP_DEPTH,
            max_recv_wr: QP_DEPTH,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline: 0,
        };
        let pqp = dev
            .create_qp(QpInit {
                qp_type: QpType::Rc,
                pd: 1,
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                caps,
                sq: ring(layout.sq_offset, layout.sq_depth).consumer(),
                rq: ring(layout.rq_offset, layout.rq_depth).consumer(),
                srq: None,
                sink: Arc::new(move |ev: Event| log.lock().push(ev.kind)),
                stats,
            })
            .expect("qp");
        let qp = pqp
            .as_any()
            .downcast_ref::<SiwQp>()
            .and_then(|q| q.arc().ok())
            .expect("a siw QP");
        let llp = Arc::new(MemoryLlp {
            room: AtomicUsize::new(usize::MAX),
            ..MemoryLlp::default()
        });
        let user = UserQp::new(
            qp.base.qpn,
            caps,
            ring(layout.sq_offset, layout.sq_depth).producer(),
            ring(layout.rq_offset, layout.rq_depth).producer(),
            Arc::new(Bell(Arc::downgrade(&qp), llp.clone())),
        );
        let mrs = KINDS
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let base = 0x1_0000 * (i as u64 + 1);
                let mem = Arc::new(Guarded::new(base, kind));
                let (pd, access) = match kind {
                    Kind::Remote => (
                        1,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                    ),
                    Kind::Local => (1, Access::LOCAL_WRITE),
                    Kind::ReadOnly => (1, Access::REMOTE_READ),
                    Kind::Foreign => (
                        2,
                        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                    ),
                };
                let r = dev
                    .reg_mr(pd, base, MR_LEN as u64, access, mem.clone())
                    .expect("registration");
                (kind, mem, r.stag)
            })
            .collect();
        qp.enter_rts(llp.clone(), crc, 4, 4, 1460)
            .expect("QP to RTS");
        Harness {
            _dev: dev,
            qp,
            user,
            cq: UserCq::new(Ring::attach(cq_mem, 0, CQ_DEPTH).expect("ring").consumer()),
            mrs,
            llp,
            crc,
            next_wr: 1,
            msn: [1, 1],
            reads: Vec::new(),
            events,
            _keep: vec![cq],
        }
    }

    fn mr(&self, i: u8) -> &(Kind, Arc<Guarded>, u32) {
        &self.mrs[i as usize % self.mrs.len()]
    }

    /// A range inside registration `mr` (offset and length wrapped into it).
    fn range(&self, mr: u8, off: u16, len: u16) -> (u32, u64, u32, Arc<Guarded>) {
        let (_, g, stag) = self.mr(mr);
        let off = off as u64 % MR_LEN as u64;
        let len = (len as u64).min(MR_LEN as u64 - off) as u32;
        (*stag, g.base + off, len, g.clone())
    }

    /// Do one action, then play the tx thread.
    pub fn apply(&mut self, a: &Action) {
        match a {
            Action::PostRecv { mr, off, len } => {
                let (stag, addr, len, g) = self.range(*mr, *off, *len);
                let wr = self.wr();
                if self
                    .user
                    .post_recv(&Wqe::recv(
                        wr,
                        &[Sge {
                            addr,
                            length: len,
                            lkey: stag,
                        }],
                    ))
                    .is_ok()
                {
                    g.open.lock().push((wr, addr, addr + len as u64));
                }
            }
            Action::PostRead {
                mr,
                off,
                len,
                rkey,
                raddr,
            } => {
                let (stag, addr, len, g) = self.range(*mr, *off, *len);
                let wr = self.wr();
                let sge = Sge {
                    addr,
                    length: len,
                    lkey: stag,
                };
                let w = Wqe::new(wr, WrOpcode::RdmaRead, &[sge]).with_remote(*raddr, *rkey);
                g.open.lock().push((wr, addr, addr + len as u64));
                if self.user.post_send(&w).is_ok() {
                    self.reads.push(PeerRead {
                        wr_id: wr,
                        sink_stag: stag,
                        sink_to: addr,
                        answered: 0,
                    });
                }
            }
            Action::PostSend { mr, off, len } => {
                let (stag, addr, len, _) = self.range(*mr, *off, *len);
                let wr = self.wr();
                let sge = Sge {
                    addr,
                    length: len,
                    lkey: stag,
                };
                let _ = self.user.post_send(&Wqe::new(wr, WrOpcode::Send, &[sge]));
            }
            Action::Fpdu(f) => {
                let u = self.ulpdu(f);
                self.deliver(&u);
            }
            Action::Respond {
                read,
                skew,
                len,
                last,
            } => {
                if !self.reads.is_empty() {
                    let i = *read as usize % self.reads.len();
                    let r = self.reads[i];
                    let len = (*len as usize).min(MAX_PAYLOAD);
                    let to = r
                        .sink_to
                        .wrapping_add(r.answered as u64)
                        .wrapping_add(*skew as i64 as u64);
                    let mut u = Header {
                        opcode: Opcode::ReadResponse,
                        last: *last,
                        model: Model::Tagged {
                            stag: r.sink_stag,
                            to,
                        },
                    }
                    .to_vec();
                    u.extend(std::iter::repeat_n(0x5a, len));
                    if self.deliver(&u) && *skew == 0 {
                        self.reads[i].answered += len as u32;
                        if *last {
                            self.reads.remove(i);
                        }
                    }
                }
            }
            Action::Raw(b) => {
                self.qp.receive_fpdu(b);
            }
            Action::Poll => self.poll(),
            Action::Room(n) => self.llp.room.store(*n as usize, Ordering::Release),
            Action::QpAccess(bits) => {
                let access = Access::from_bits_truncate(*bits as u32);
                let _ = self.qp.modify(
                    &QpAttr {
                        access,
                        ..QpAttr::default()
                    },
                    QpAttrMask::ACCESS,
                );
            }
            Action::Close { abortive } => {
                let _ = self.qp.disconnect(*abortive);
            }
        }
        self.qp.transmit();
    }

    fn wr(&mut self) -> u64 {
        self.next_wr += 1;
        self.next_wr
    }

    /// The ULPDU of an [`Fpdu`] action.
    fn ulpdu(&mut self, f: &Fpdu) -> Vec<u8> {
        let opcode = Opcode::from_u8(f.opcode % 8).unwrap_or(Opcode::Send);
        let (_, g, stag) = self.mr(f.stag.mr);
        let stag = stag ^ f.stag.flip;
        let model = if opcode.tagged() {
            Model::Tagged {
                stag,
                to: g.base.wrapping_add(f.to as i64 as u64),
            }
        } else {
            let q = usize::from(opcode == Opcode::ReadRequest);
            let msn = self.msn[q].wrapping_add(f.msn as i32 as u32);
            Model::Untagged {
                inv_stag: stag,
                qn: opcode.queue(),
                msn,
                mo: f.mo,
            }
        };
        let mut u = Header {
            opcode,
            last: f.last,
            model,
        }
        .to_vec();
        if opcode == Opcode::ReadRequest {
            // The body names a source near a registration, and a sink at the peer.
            let rr = ReadRequest {
                sink_stag: 0x4242,
                sink_to: 0,
                size: f.payload_len as u32,
                src_stag: stag,
                src_to: g.base.wrapping_add(f.to as i64 as u64),
            };
            rr.emit(&mut ReadRequestPacket::new_unchecked(wire::grow(
                &mut u,
                rr.buffer_len(),
            )));
        } else {
            let n = (f.payload_len as usize).min(MAX_PAYLOAD);
            u.extend(std::iter::repeat_n(f.fill, n));
        }
        if !opcode.tagged() && f.last && f.msn == 0 {
            let q = usize::from(opcode == Opcode::ReadRequest);
            self.msn[q] = self.msn[q].wrapping_add(1);
        }
        u
    }

    /// Frame a ULPDU as the peer would and hand it to the engine. Returns whether the
    /// QP still takes FPDUs.
    fn deliver(&mut self, ulpdu: &[u8]) -> bool {
        let mut f = Vec::new();
        let start = wire::begin_fpdu(&mut f);
        f.extend_from_slice(ulpdu);
        if wire::finish_fpdu(&mut f, start, self.crc).is_err() {
            return true;
        }
        self.qp.receive_fpdu(&f)
    }

    /// Take every completion: the ranges of finished requests close.
    pub fn poll(&mut self) {
        let mut out = [Cqe::default(); CQ_DEPTH as usize];
        loop {
            let n = self.cq.poll(&mut out);
            for c in &out[..n] {
                for (_, g, _) in &self.mrs {
                    g.open.lock().retain(|&(wr, _, _)| wr != c.wr_id);
                }
                self.reads.retain(|r| r.wr_id != c.wr_id);
            }
            if n == 0 {
                return;
            }
        }
    }

    /// The oracle after each action: no guard byte changed, and nothing changed in
    /// registrations the engine may never write. (Each write was checked as it
    /// happened against the ranges open at that moment.)
    pub fn check(&self) {
        for (kind, g, _) in &self.mrs {
            g.check(matches!(kind, Kind::Remote | Kind::Local));
        }
    }

    /// The QP's asynchronous and connection events so far.
    pub fn events(&self) -> Vec<EventKind> {
        self.events.lock().clone()
    }

    /// Bytes the engine transmitted so far.
    pub fn transmitted(&self) -> Vec<u8> {
        self.llp.sent.lock().clone()
    }

    /// Tear the QP down as the kAL does, and check once more.
    pub fn finish(mut self) {
        self.qp.destroy();
        self.poll();
        self.check();
    }
}

/// Run one fuzz input: decode it, apply every action with the oracle after each.
pub fn run(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let mut h = Harness::new(first & 1 != 0);
    for a in Action::decode(rest) {
        h.apply(&a);
        h.check();
    }
    h.finish();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_send_lands_in_the_posted_receive_only() {
        let mut h = Harness::new(false);
        h.apply(&Action::PostRecv {
            mr: 1,
            off: 100,
            len: 50,
        });
        h.apply(&Action::Fpdu(Fpdu {
            opcode: Opcode::Send as u8,
            last: true,
            stag: StagSel { mr: 0, flip: 0 },
            to: 0,
            msn: 0,
            mo: 0,
            payload_len: 50,
            fill: 0xEE,
        }));
        h.check();
        let b = h.mrs[1].1.bytes.lock().clone();
        assert!(b[GUARD + 100..GUARD + 150].iter().all(|&x| x == 0xEE));
        h.finish();
    }

    #[test]
    fn read_responses_fill_only_the_read_posted() {
        let mut h = Harness::new(true);
        h.apply(&Action::PostRead {
            mr: 1,
            off: 0,
            len: 64,
            rkey: 0x777,
            raddr: 0x9000,
        });
        assert!(!h.transmitted().is_empty(), "the Read Request went out");
        // An unsolicited-looking response aimed elsewhere is refused before placement.
        h.apply(&Action::Respond {
            read: 0,
            skew: 8,
            len: 8,
            last: false,
        });
        h.check();
        assert_eq!(h.qp.query().state, QpState::Error);
        h.finish();
    }

    fn send(h: &mut Harness, len: u16) {
        h.apply(&Action::Fpdu(Fpdu {
            opcode: Opcode::Send as u8,
            last: true,
            stag: StagSel { mr: 0, flip: 0 },
            to: 0,
            msn: 0,
            mo: 0,
            payload_len: len,
            fill: 1,
        }));
    }

    fn cqes(h: &Harness) -> Vec<Cqe> {
        let mut out = [Cqe::default(); CQ_DEPTH as usize];
        let n = h.cq.poll(&mut out);
        out[..n].to_vec()
    }

    /// The last FPDU the engine sent is a Terminate with this code.
    fn last_terminate(h: &Harness) -> wire::TermCode {
        let sent = h.transmitted();
        let mut off = 0;
        let mut last = None;
        while off + 2 <= sent.len() {
            let total = wire::FpduPacket::new_checked(&sent[off..])
                .unwrap()
                .total_len();
            let u = wire::check_fpdu(&sent[off..off + total], h.crc).unwrap();
            let (hdr, p) = Header::parse_bytes(u).unwrap();
            if hdr.opcode == Opcode::Terminate {
                let t = wire::term::Packet::new_checked(p).unwrap();
                last = Some(wire::term::Repr::parse(&t).unwrap().code);
            }
            off += total;
        }
        last.expect("a Terminate was sent")
    }

    #[test]
    fn a_close_never_flushes_a_send_already_written() {
        let mut h = Harness::new(false);
        h.apply(&Action::PostRecv {
            mr: 1,
            off: 0,
            len: 8,
        });
        // The doorbell finds the socket full and leaves the Send to the tx thread; the
        // peer, having read the Send, closes at the very moment its bytes are written,
        // before the transmitter records them.
        h.apply(&Action::Room(0));
        let qp = h.qp.clone();
        *h.llp.after_write.lock() = Some(Box::new(move || qp.connection_lost(true)));
        h.apply(&Action::PostSend {
            mr: 0,
            off: 0,
            len: 100,
        });
        assert_eq!(h.qp.query().state, QpState::Error);
        let c = cqes(&h);
        let send = c.iter().find(|c| c.opcode == WcOpcode::Send as u8).unwrap();
        assert_eq!((send.status(), send.byte_len), (WcStatus::Success, 100));
        let recv = c.iter().find(|c| c.opcode == WcOpcode::Recv as u8).unwrap();
        assert_eq!(recv.status(), WcStatus::WrFlushErr);
        h.finish();
    }

    #[test]
    fn a_doorbell_never_waits_for_the_socket() {
        // The socket takes 100 bytes and then nothing: the doorbell sends what fits and
        // leaves the rest to the tx thread (the Bell asserts it never waits), which
        // finishes the request and completes it.
        let mut h = Harness::new(false);
        h.apply(&Action::Room(100));
        for _ in 0..3 {
            h.apply(&Action::PostSend {
                mr: 0,
                off: 0,
                len: 1000,
            });
        }
        let c = cqes(&h);
        assert_eq!(c.len(), 3);
        assert!(c.iter().all(|c| c.status() == WcStatus::Success));
        assert_eq!(
            h.transmitted().len(),
            3 * wire::fpdu_len(wire::ddp::UNTAGGED_HEADER_LEN + 1000)
        );
        h.finish();
    }

    #[test]
    fn cq_overflow_moves_the_qp_to_error_with_a_terminate_and_an_event() {
        let mut h = Harness::new(true);
        for _ in 0..QP_DEPTH {
            h.apply(&Action::PostRecv {
                mr: 1,
                off: 0,
                len: 8,
            });
        }
        for _ in 0..CQ_DEPTH {
            send(&mut h, 8);
        }
        assert_eq!(
            h.qp.query().state,
            QpState::Rts,
            "the CQ is full, nothing lost yet"
        );
        // One more completion has no room.
        h.apply(&Action::PostSend {
            mr: 0,
            off: 0,
            len: 8,
        });
        assert_eq!(h.qp.query().state, QpState::Error);
        assert!(h.events().contains(&EventKind::QpFatal));
        assert_eq!(
            last_terminate(&h),
            wire::TermCode {
                layer: wire::term::LAYER_RDMAP,
                etype: wire::term::RDMAP_REMOTE_OP,
                ecode: wire::term::RDMAP_CATASTROPHIC_LOCAL,
            }
        );
        assert_eq!(cqes(&h).len(), CQ_DEPTH as usize);
        h.finish();
    }

    fn valid(h: &Harness, mr: usize) -> bool {
        h._dev
            .shared
            .res
            .mrs
            .lookup(h.mrs[mr].2)
            .is_ok_and(|r| r.is_valid())
    }

    fn send_invalidating(h: &mut Harness, mr: u8) {
        h.apply(&Action::PostRecv {
            mr: 1,
            off: 0,
            len: 8,
        });
        h.apply(&Action::Fpdu(Fpdu {
            opcode: Opcode::SendInvalidate as u8,
            last: true,
            stag: StagSel { mr, flip: 0 },
            to: 0,
            msn: 0,
            mo: 0,
            payload_len: 4,
            fill: 1,
        }));
    }

    #[test]
    fn a_peer_invalidates_only_what_it_was_given_remote_access_to() {
        let mut h = Harness::new(false);
        send_invalidating(&mut h, 1); // local write only
        assert_eq!(h.qp.query().state, QpState::Error);
        assert_eq!(
            last_terminate(&h).ecode,
            wire::term::RDMAP_CANNOT_INVALIDATE
        );
        assert!(valid(&h, 1), "the consumer keeps its local buffer");
        let c = cqes(&h);
        assert_eq!(c[0].status(), WcStatus::RemInvReqErr);
        h.finish();

        let mut h = Harness::new(false);
        send_invalidating(&mut h, 0); // remotely writable: the peer may
        assert_eq!(h.qp.query().state, QpState::Rts);
        assert!(!valid(&h, 0));
        let c = cqes(&h);
        assert_eq!(c[0].status(), WcStatus::Success);
        assert_ne!(c[0].flags & wc_flags::WITH_INV, 0);
        h.finish();
    }

    #[test]
    fn a_read_completes_in_two_segments() {
        let mut h = Harness::new(false);
        h.apply(&Action::PostRead {
            mr: 1,
            off: 0,
            len: 64,
            rkey: 0x777,
            raddr: 0x9000,
        });
        for last in [false, true] {
            h.apply(&Action::Respond {
                read: 0,
                skew: 0,
                len: 32,
                last,
            });
        }
        assert_eq!(h.qp.query().state, QpState::Rts);
        let mut out = [Cqe::default(); 4];
        assert_eq!(h.cq.poll(&mut out), 1);
        assert_eq!((out[0].status(), out[0].byte_len), (WcStatus::Success, 64));
        h.finish();
    }
}
