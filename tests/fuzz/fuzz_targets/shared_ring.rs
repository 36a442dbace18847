//! The engine's ends of the shared rings against a hostile consumer: arbitrary slot
//! contents and arbitrary producer/consumer index writes between engine calls, into a
//! completion ring (`EngineCq::push`), a shared receive ring (`EngineSrq::take`, whose
//! receives are then placed through the key table as a provider does) and a send ring
//! (`Consumer` peek/advance/pop and `drain_queued`, what siw and rxe drain their send and
//! receive rings with).
//!
//! Oracles, besides "no panic":
//! * bounded work: one call consumes at most a ring's capacity of entries;
//! * the engine keeps its own index: what it writes is its private index (modelled here),
//!   never something read back from the consumer's scribbles;
//! * no write outside what it owns: an engine call changes only its own index word, the
//!   completion slot it fills and the arm word it clears — the rest of the shared memory,
//!   guard bytes included, is byte-for-byte unchanged;
//! * no write outside a registration: receives taken from the SRQ are placed through the
//!   key table and `Region` checks into memory that asserts every byte lands inside the
//!   registration it was given for.
//!
//! No capture carries ring contents, so the corpus (`corpus/shared_ring`) comes from
//! fuzzing runs of this target, minimised (`scripts/fuzz.sh long shared_ring`).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rnicpi::queue::{CONSUMER, NOTIFY, PRODUCER, RING_HEADER};
use rnicpi::{
    Access, Consumer, Cqe, EngineCq, EngineSrq, MemoryAccess, MrTable, NullSink, Ring, RingStats,
    SharedMem, SrqAttr, Wqe,
};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Which {
    Cq,
    Srq,
    Sq,
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// The consumer writes a slot.
    Slot {
        ring: Which,
        slot: u8,
        bytes: Vec<u8>,
    },
    /// The consumer writes an index word (either: it may write its peer's too).
    Index {
        ring: Which,
        producer: bool,
        value: u32,
    },
    /// The consumer moves an index word by `delta` (either: its own, or the engine's).
    Nudge {
        ring: Which,
        producer: bool,
        delta: i16,
    },
    /// The consumer puts `n` entries between the indices, relative to the engine's.
    Ahead { ring: Which, n: u16 },
    /// The consumer writes the arm word.
    Arm(u32),
    /// The engine appends a completion.
    Push { wr_id: u64, status: u8, flags: u8 },
    /// A QP takes a receive from the SRQ and places `len` bytes into it.
    Take { len: u16 },
    /// The engine takes one send-queue entry.
    Pop,
    /// The engine flushes the send queue.
    Flush,
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// Ring capacities, as log2 (0..=4).
    caps: [u8; 3],
    srq_max_sge: u8,
    /// Registrations the receives may name: (offset, length, access bits) in a buffer.
    regions: Vec<(u16, u16, u8)>,
    ops: Vec<Op>,
}

const GUARD: usize = 256;
const BUF: usize = 4096;

/// Consumer memory for one registration: a window of a shared buffer that asserts every
/// access lands inside `[base, base + len)`, the registration's range.
#[derive(Debug)]
struct Window {
    buf: Arc<Mutex<Vec<u8>>>,
    base: u64,
    len: u64,
}

impl Window {
    fn check(&self, addr: u64, n: usize) -> usize {
        let end = addr
            .checked_add(n as u64)
            .expect("no wrap past a registration");
        assert!(
            addr >= self.base && end <= self.base + self.len,
            "access [{addr:#x}, {end:#x}) outside the registration [{:#x}, {:#x})",
            self.base,
            self.base + self.len
        );
        (addr - BASE) as usize
    }
}

/// The consumer address of the buffer's first byte.
const BASE: u64 = 0x10_0000;

impl MemoryAccess for Window {
    fn read(&self, addr: u64, out: &mut [u8]) -> rnicpi::Result<()> {
        let at = self.check(addr, out.len());
        out.copy_from_slice(&self.buf.lock().unwrap()[at..at + out.len()]);
        Ok(())
    }
    fn write(&self, addr: u64, data: &[u8]) -> rnicpi::Result<()> {
        let at = self.check(addr, data.len());
        self.buf.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
}

struct Rings {
    mem: Arc<SharedMem>,
    off: [usize; 3],
}

impl Rings {
    fn slot_size(w: Which) -> usize {
        match w {
            Which::Cq => std::mem::size_of::<Cqe>(),
            Which::Srq | Which::Sq => std::mem::size_of::<Wqe>(),
        }
    }

    fn word(&self, w: Which, at: usize) -> &std::sync::atomic::AtomicU32 {
        // SAFETY: a header word of a ring inside the mapping (rings were attached there),
        // 4-aligned; only this thread touches the mapping.
        unsafe { &*(self.mem.as_ptr().add(self.off[w as usize] + at) as *const _) }
    }

    fn snapshot(&self) -> Vec<u8> {
        // SAFETY: the whole mapping is ours to read.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr(), self.mem.len()) }.to_vec()
    }

    /// Assert that only bytes inside `allowed` ranges changed.
    fn assert_only_changed(&self, before: &[u8], allowed: &[(usize, usize)], what: &str) {
        let after = self.snapshot();
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            if a != b && !allowed.iter().any(|&(lo, len)| (lo..lo + len).contains(&i)) {
                panic!("{what} wrote byte {i} of the shared memory, outside what it owns");
            }
        }
    }
}

fuzz_target!(|input: Input| {
    let cap = input.caps.map(|c| 1u32 << (c % 5));
    let mut off = [0usize; 3];
    let mut end = GUARD;
    for (i, w) in [Which::Cq, Which::Srq, Which::Sq].into_iter().enumerate() {
        off[i] = end;
        end = (end + RING_HEADER + cap[i] as usize * Rings::slot_size(w)).next_multiple_of(64)
            + GUARD;
    }
    let mem = Arc::new(SharedMem::create("fuzz", end).unwrap());
    // SAFETY: fill our own fresh mapping with a pattern, so any stray write shows.
    unsafe { std::ptr::write_bytes(mem.as_ptr(), 0xa5, mem.len()) };
    let rings = Rings {
        mem: mem.clone(),
        off,
    };
    for w in [Which::Cq, Which::Srq, Which::Sq] {
        rings.word(w, PRODUCER).store(0, Ordering::Relaxed);
        rings.word(w, CONSUMER).store(0, Ordering::Relaxed);
        rings.word(w, NOTIFY).store(0, Ordering::Relaxed);
    }
    let stats = Arc::new(RingStats::default());
    let cq_ring = Ring::<Cqe>::attach(mem.clone(), off[0], cap[0]).unwrap();
    let srq_ring = Ring::<Wqe>::attach(mem.clone(), off[1], cap[1]).unwrap();
    let sq_ring = Ring::<Wqe>::attach(mem.clone(), off[2], cap[2]).unwrap();
    let cq = EngineCq::new(cq_ring.producer(), Arc::new(NullSink), stats.clone());
    let attr = SrqAttr {
        max_wr: cap[1],
        max_sge: u32::from(input.srq_max_sge % 8),
        limit: 0,
    };
    let srq = EngineSrq::new(
        1,
        attr,
        srq_ring.consumer(),
        Arc::new(NullSink),
        stats.clone(),
    );
    let mut sq: Consumer<Wqe> = sq_ring.consumer();

    // Registrations in PD 1 over one buffer, each reached through its own window.
    let buf = Arc::new(Mutex::new(vec![0u8; BUF]));
    let table = MrTable::new(16);
    for &(o, l, a) in input.regions.iter().take(8) {
        let (o, l) = (u64::from(o) % BUF as u64, u64::from(l));
        let l = l.min(BUF as u64 - o).max(1);
        let access = Access::from_bits_truncate(u32::from(a)) | Access::LOCAL_WRITE;
        let window = Arc::new(Window {
            buf: buf.clone(),
            base: BASE + o,
            len: l,
        });
        let _ = table.register(1, BASE + o, l, access, window);
    }

    // The engine's private indices, modelled.
    let mut cq_head = 0u32;
    let mut srq_tail = 0u32;
    let mut sq_tail = 0u32;
    let word_range = |w: Which, at: usize| (off[w as usize] + at, 4);

    for op in input.ops.into_iter().take(256) {
        match op {
            Op::Slot { ring, slot, bytes } => {
                let size = Rings::slot_size(ring);
                let i = off[ring as usize]
                    + RING_HEADER
                    + (slot as usize % cap[ring as usize] as usize) * size;
                let n = bytes.len().min(size);
                // SAFETY: inside the ring's slots, inside the mapping.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), mem.as_ptr().add(i), n) };
            }
            Op::Index {
                ring,
                producer,
                value,
            } => {
                rings
                    .word(ring, if producer { PRODUCER } else { CONSUMER })
                    .store(value, Ordering::Relaxed);
            }
            Op::Nudge {
                ring,
                producer,
                delta,
            } => {
                let w = rings.word(ring, if producer { PRODUCER } else { CONSUMER });
                let v = w.load(Ordering::Relaxed);
                w.store(v.wrapping_add_signed(i32::from(delta)), Ordering::Relaxed);
            }
            Op::Ahead { ring, n } => match ring {
                Which::Cq => {
                    let p = rings.word(ring, PRODUCER).load(Ordering::Relaxed);
                    rings
                        .word(ring, CONSUMER)
                        .store(p.wrapping_sub(u32::from(n)), Ordering::Relaxed);
                }
                Which::Srq | Which::Sq => {
                    let c = rings.word(ring, CONSUMER).load(Ordering::Relaxed);
                    rings
                        .word(ring, PRODUCER)
                        .store(c.wrapping_add(u32::from(n)), Ordering::Relaxed);
                }
            },
            Op::Arm(v) => rings.word(Which::Cq, NOTIFY).store(v, Ordering::Relaxed),
            Op::Push {
                wr_id,
                status,
                flags,
            } => {
                let before = rings.snapshot();
                let slot = off[0]
                    + RING_HEADER
                    + (cq_head % cap[0]) as usize * Rings::slot_size(Which::Cq);
                let cqe = Cqe {
                    wr_id,
                    status,
                    flags,
                    ..Default::default()
                };
                let ok = cq.push(cqe);
                rings.assert_only_changed(
                    &before,
                    &[
                        word_range(Which::Cq, PRODUCER),
                        word_range(Which::Cq, NOTIFY),
                        (slot, Rings::slot_size(Which::Cq)),
                    ],
                    "EngineCq::push",
                );
                if ok {
                    cq_head = cq_head.wrapping_add(1);
                    assert_eq!(
                        rings.word(Which::Cq, PRODUCER).load(Ordering::Relaxed),
                        cq_head,
                        "the engine publishes its own index"
                    );
                }
            }
            Op::Take { len } => {
                let before = rings.snapshot();
                let dropped = stats.srq_dropped.load(Ordering::Relaxed);
                let taken = srq.take();
                rings.assert_only_changed(
                    &before,
                    &[word_range(Which::Srq, CONSUMER)],
                    "EngineSrq::take",
                );
                let dropped = stats.srq_dropped.load(Ordering::Relaxed) - dropped;
                let consumed = dropped + u64::from(matches!(taken, Ok(Some(_))));
                assert!(
                    consumed <= u64::from(cap[1]),
                    "one take examined {consumed} entries of a ring of {}",
                    cap[1]
                );
                srq_tail = srq_tail.wrapping_add(consumed as u32);
                if consumed > 0 {
                    assert_eq!(
                        rings.word(Which::Srq, CONSUMER).load(Ordering::Relaxed),
                        srq_tail
                    );
                }
                if let Ok(Some(w)) = taken {
                    assert!(
                        u32::from(w.num_sge) <= attr.max_sge,
                        "a receive beyond max_sge was handed out"
                    );
                    place(&table, &w, len);
                }
            }
            Op::Pop => {
                let before = rings.snapshot();
                let r = sq.pop();
                rings.assert_only_changed(
                    &before,
                    &[word_range(Which::Sq, CONSUMER)],
                    "Consumer::pop",
                );
                if let Ok(Some(_)) = r {
                    sq_tail = sq_tail.wrapping_add(1);
                    assert_eq!(
                        rings.word(Which::Sq, CONSUMER).load(Ordering::Relaxed),
                        sq_tail
                    );
                }
            }
            Op::Flush => {
                let before = rings.snapshot();
                let mut seen = 0u32;
                let r = sq.drain_queued(|_| seen += 1);
                rings.assert_only_changed(
                    &before,
                    &[word_range(Which::Sq, CONSUMER)],
                    "Consumer::drain_queued",
                );
                assert!(
                    seen <= cap[2],
                    "a flush took {seen} entries of a ring of {}",
                    cap[2]
                );
                if let Ok(n) = r {
                    assert_eq!(n, seen);
                    sq_tail = sq_tail.wrapping_add(n);
                    if n > 0 {
                        assert_eq!(
                            rings.word(Which::Sq, CONSUMER).load(Ordering::Relaxed),
                            sq_tail
                        );
                    }
                }
            }
        }
    }
});

/// Place `len` bytes of a message into receive `w` as a provider does: scatter over its
/// gather list, each piece through the key table and the registration's checks.
fn place(table: &MrTable, w: &Wqe, len: u16) {
    let data = vec![0x5au8; usize::from(len)];
    let mut left = &data[..];
    for s in w.sges() {
        if left.is_empty() {
            break;
        }
        let take = (s.length as usize).min(left.len());
        let Ok(r) = table.lookup(s.lkey) else { return };
        if r.write(1, s.addr, &left[..take], Access::LOCAL_WRITE)
            .is_err()
        {
            return;
        }
        left = &left[take..];
    }
}
