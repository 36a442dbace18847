//! Two connections joined in memory with a simulated clock, for the protocol's tests and
//! fuzzing: every message goes into one of the receiver's posted buffers (none posted is
//! a failure: the credits must prevent it), zero-copy reads copy from the source's
//! "registered" memory ([`Side::regions`]), zero-copy writes land in the reader's landing
//! buffer ([`Side::landing`]), advertised whenever a read finds nothing.

use super::*;
use crate::wire::Mid;
use std::collections::HashMap;

pub const SLOT: usize = 1 << 17;
/// The landing buffer's key and address as a side advertises it.
pub const LANDING_RKEY: u32 = 0x5157;
pub const LANDING_ADDR: u64 = 0x7000_0000;
pub const LANDING_SIZE: usize = 256 * 1024;

pub struct Side {
    pub c: Connection,
    pub bufs: HashMap<BufId, Vec<u8>>,
    pub posted: Vec<BufId>,
    /// Zero-copy source memory, by rkey.
    pub regions: HashMap<u32, (u64, Vec<u8>)>,
    /// The landing buffer the peer RDMA Writes into.
    pub landing: Vec<u8>,
    pub sent: Vec<Mid>,
}

impl Side {
    pub fn new(c: Connection) -> Side {
        let n = c.config().recv_bufs as u32 + 1;
        Side {
            c,
            bufs: HashMap::new(),
            posted: (0..n).collect(),
            regions: HashMap::new(),
            landing: vec![0; LANDING_SIZE],
            sent: Vec::new(),
        }
    }

    /// Read up to `max` bytes as a reader would (copy, or RDMA Read from `peer`).
    pub fn read(&mut self, peer: &Side, max: usize) -> Result<Vec<u8>, ConnError> {
        let mut out = Vec::new();
        while out.len() < max {
            if let Some(e) = self.c.error() {
                if out.is_empty() {
                    return Err(e.clone());
                }
                break;
            }
            match self.c.next_read() {
                Some(ReadItem::Buffered { buf, offset, len }) => {
                    let n = len.min(max - out.len());
                    out.extend_from_slice(&self.bufs[&buf][offset..offset + n]);
                    if let Some(b) = self.c.consume(n) {
                        self.posted.push(b);
                        self.c.on_reposted();
                    }
                }
                Some(ReadItem::Remote { addr, rkey, len }) => {
                    let n = len.min(max - out.len());
                    self.c.rdma_read_started(n);
                    // The peer's device checks the key and the range: an advert naming
                    // memory the peer did not register (a forged SrcAvail) fails the
                    // read, as a remote access error would.
                    let source = peer.regions.get(&rkey).and_then(|(base, mem)| {
                        let at = usize::try_from(addr.checked_sub(*base)?).ok()?;
                        mem.get(at..at.checked_add(n)?)
                    });
                    match source {
                        Some(bytes) => {
                            out.extend_from_slice(bytes);
                            self.c.rdma_read_done(n);
                        }
                        None => {
                            self.c.rdma_read_failed();
                            break;
                        }
                    }
                }
                Some(ReadItem::Landed { offset, len }) => {
                    let n = len.min(max - out.len());
                    out.extend_from_slice(&self.landing[offset..offset + n]);
                    self.c.consume(n);
                }
                Some(ReadItem::Eof) => break,
                None => {
                    if out.is_empty() && self.c.sink_wanted(max) {
                        self.c.advertise_sink(Advert {
                            size: LANDING_SIZE as u32,
                            rkey: LANDING_RKEY,
                            addr: LANDING_ADDR,
                        });
                    }
                    break;
                }
            }
        }
        Ok(out)
    }
}

pub struct Pair {
    pub now: Instant,
    pub a: Side,
    pub b: Side,
}

fn addr() -> IpAddr {
    "127.0.0.1".parse().unwrap()
}

impl Pair {
    /// A connected pair (`a` active, `b` passive), the Hello cut to an IB CM REQ's room.
    pub fn new(ca: Config, cb: Config) -> Pair {
        let now = Instant::now();
        let (mut a, hello) = Connection::connect(ca, now, addr(), 40000, addr());
        let pd = wire::hello_private_data(
            hello.bsdh,
            &match hello.body {
                Body::Hello(h) => h,
                _ => unreachable!(),
            },
            56,
        );
        let mut padded = pd.clone();
        padded.resize(92, 0);
        let (b, h, ack) = Connection::accept(cb, now, &padded).unwrap();
        assert_eq!(h.port, 40000);
        a.on_hello_ack(&ack.to_vec()).unwrap();
        assert_eq!(a.phase(), Phase::Open);
        assert_eq!(a.credits(), i64::from(cb.recv_bufs));
        assert_eq!(b.credits(), i64::from(ca.recv_bufs));
        Pair {
            now,
            a: Side::new(a),
            b: Side::new(b),
        }
    }

    #[allow(clippy::should_implement_trait)]
    pub fn default() -> Pair {
        Pair::new(Config::default(), Config::default())
    }

    /// Deliver one message from `from` to `to`; false when there was none.
    pub fn deliver(now: Instant, from: &mut Side, to: &mut Side) -> bool {
        match Self::transmit(now, from, to) {
            Some(msg) => {
                Self::receive(now, to, msg);
                true
            }
            None => false,
        }
    }

    /// One message from each side at once, each sent before the other's arrives (they
    /// cross on the wire); false when neither had one.
    pub fn cross(&mut self) -> bool {
        let to_b = Self::transmit(self.now, &mut self.a, &mut self.b);
        let to_a = Self::transmit(self.now, &mut self.b, &mut self.a);
        let any = to_b.is_some() || to_a.is_some();
        if let Some(m) = to_b {
            Self::receive(self.now, &mut self.b, m);
        }
        if let Some(m) = to_a {
            Self::receive(self.now, &mut self.a, m);
        }
        any
    }

    /// The next message `from` sends (its RDMA Write, if any, lands in `to` first).
    fn transmit(now: Instant, from: &mut Side, to: &mut Side) -> Option<Vec<u8>> {
        let mut staged = vec![0u8; LANDING_SIZE];
        if let Some(w) = from.c.poll_rdma_write(&mut staged) {
            // The reader's device checks the key and the range, as for reads (an honest
            // peer's advert always passes).
            let at = w.addr.checked_sub(LANDING_ADDR).map(|a| a as usize);
            match at {
                Some(at) if w.rkey == LANDING_RKEY && at + w.len <= to.landing.len() => {
                    to.landing[at..at + w.len].copy_from_slice(&staged[..w.len]);
                }
                // A forged advert: a remote access error ends the writer's transport.
                _ => from.c.transport_failed(),
            }
        }
        let mut slot = vec![0u8; SLOT];
        let t = from.c.poll_transmit(now, &mut slot)?;
        from.sent.push(t.mid);
        slot.truncate(t.len);
        Some(slot)
    }

    /// A message arrives in one of `to`'s posted buffers.
    fn receive(now: Instant, to: &mut Side, msg: Vec<u8>) {
        if to.c.phase() == Phase::Failed {
            return; // the transport is gone: dropped
        }
        let buf = to
            .posted
            .pop()
            .expect("a message arrived with no receive buffer posted: credits broken");
        let size = to.c.recv_size() as usize;
        assert!(msg.len() <= size.max(to.c.config().max_recv_size as usize));
        to.bufs.insert(buf, msg);
        let data = to.bufs[&buf].clone();
        if let Ok(true) = to.c.on_receive(now, buf, Received::whole(&data)) {
            to.posted.push(buf);
            to.c.on_reposted();
        }
    }

    /// Run until neither side has anything to send.
    pub fn settle(&mut self) {
        self.settle_by(|p| {
            let x = Self::deliver(p.now, &mut p.a, &mut p.b);
            let y = Self::deliver(p.now, &mut p.b, &mut p.a);
            x || y
        })
    }

    /// Run until neither side has anything to send, the two sides' messages crossing
    /// on the wire ([`cross`](Self::cross)).
    pub fn settle_crossing(&mut self) {
        self.settle_by(Self::cross)
    }

    fn settle_by(&mut self, mut step: impl FnMut(&mut Pair) -> bool) {
        for _ in 0..100_000 {
            if !step(self) {
                return;
            }
        }
        let tail = |s: &Side| s.sent[s.sent.len().saturating_sub(12)..].to_vec();
        panic!(
            "the pair never settled: a sent {:?} ({:?}), b sent {:?} ({:?})",
            tail(&self.a),
            self.a.c.phase(),
            tail(&self.b),
            self.b.c.phase()
        );
    }

    pub fn advance(&mut self, d: Duration) {
        self.now += d;
        self.a.c.handle_timeout(self.now);
        self.b.c.handle_timeout(self.now);
    }
}
