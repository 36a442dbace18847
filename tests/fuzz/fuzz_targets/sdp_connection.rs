//! The SDP protocol state machine (`krdma_sdp::proto`) driven by arbitrary operations of
//! two honest peers — writes of any size (buffered or zero copy), reads, cancels, urgent
//! bytes, half closes, aborts, time passing, reads large enough to advertise a landing
//! buffer for the writer's RDMA Writes — interleaved with forged messages from a
//! hostile peer, messages delivered one way at a time or crossing on the wire. Never a
//! panic; between honest peers the reader gets exactly a prefix of what was written, no
//! message ever finds the receiver without a posted buffer (the simulated pair checks
//! that on every delivery), and once both readers keep reading everything written
//! arrives (liveness: no two sides ever sit without credits).
#![no_main]

use arbitrary::Arbitrary;
use krdma_sdp::proto::sim::Pair;
use krdma_sdp::proto::{Config, Event, Phase, Received};
use krdma_sdp::wire::Advert;
use libfuzzer_sys::fuzz_target;
use std::time::Duration;

#[derive(Arbitrary, Debug)]
enum Op {
    Write { a_to_b: bool, len: u16 },
    Zcopy { len: u32 },
    Read { a_reads: bool, max: u16 },
    Deliver { a_to_b: bool },
    Settle,
    /// One message each way, crossing on the wire.
    Cross,
    Cancel,
    Oob { byte: u8 },
    Shutdown { a: bool },
    Abort { a: bool },
    Time { ms: u16 },
    Forge { bytes: Vec<u8> },
}

#[derive(Arbitrary, Debug)]
struct Input {
    recv_bufs: u8,
    recv_size: u16,
    zcopy_sink: bool,
    zcopy_write: bool,
    keepalive: bool,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let cfg = Config {
        recv_bufs: u16::from(input.recv_bufs % 16) + 4,
        recv_size: u32::from(input.recv_size % 8192) + 64,
        max_recv_size: 16384,
        zcopy_threshold: 4096,
        zcopy_sink: input.zcopy_sink,
        zcopy_write: input.zcopy_write,
        send_buffer: 32768,
        keepalive: input.keepalive.then(|| Duration::from_secs(1)),
    };
    let mut p = Pair::new(cfg, cfg);
    let mut written: Vec<u8> = Vec::new();
    let mut read: Vec<u8> = Vec::new();
    let mut forged = false;
    // The zero-copy send under way: where its bytes start in `written`, and the bytes.
    let mut zcopy: Option<(usize, Vec<u8>)> = None;
    let mut counter = 0u8;
    let mut next = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                counter = counter.wrapping_add(1);
                counter
            })
            .collect()
    };
    for op in input.ops.into_iter().take(200) {
        match op {
            Op::Write { a_to_b: true, len } => {
                let d = next(usize::from(len));
                if let Ok(n) = p.a.c.send(&d) {
                    written.extend_from_slice(&d[..n]);
                }
            }
            Op::Write { a_to_b: false, len } => {
                let _ = p.b.c.send(&next(usize::from(len)));
            }
            Op::Zcopy { len } => {
                let len = (len % 100_000) as usize;
                if p.a.c.zcopy_fits(len) && p.a.regions.is_empty() {
                    let d = next(len);
                    p.a.regions.insert(7, (0x1000, d.clone()));
                    if p.a
                        .c
                        .send_zcopy(Advert {
                            size: len as u32,
                            rkey: 7,
                            addr: 0x1000,
                        })
                        .is_ok()
                    {
                        zcopy = Some((written.len(), d.clone()));
                        written.extend_from_slice(&d);
                    }
                }
            }
            Op::Read {
                a_reads: false,
                max,
            } => {
                if let Ok(d) = p.b.read(&p.a, usize::from(max)) {
                    read.extend_from_slice(&d);
                }
            }
            Op::Read { a_reads: true, max } => {
                let _ = p.a.read(&p.b, usize::from(max));
            }
            Op::Deliver { a_to_b: true } => {
                Pair::deliver(p.now, &mut p.a, &mut p.b);
            }
            Op::Deliver { a_to_b: false } => {
                Pair::deliver(p.now, &mut p.b, &mut p.a);
            }
            Op::Settle => p.settle(),
            Op::Cross => {
                p.cross();
            }
            Op::Cancel => p.a.c.cancel_zcopy(),
            Op::Oob { byte } => {
                let _ = p.a.c.send_oob(byte);
            }
            Op::Shutdown { a } => {
                if a {
                    p.a.c.shutdown_write()
                } else {
                    p.b.c.shutdown_write()
                }
            }
            Op::Abort { a } => {
                if a {
                    p.a.c.abort()
                } else {
                    p.b.c.abort()
                }
            }
            Op::Time { ms } => p.advance(Duration::from_millis(u64::from(ms))),
            Op::Forge { bytes } => {
                // A hostile message lands in one of b's posted buffers.
                if let Some(buf) = p.b.posted.pop() {
                    forged = true;
                    p.b.bufs.insert(buf, bytes.clone());
                    if let Ok(true) = p.b.c.on_receive(p.now, buf, Received::whole(&bytes)) {
                        p.b.posted.push(buf);
                        p.b.c.on_reposted();
                    }
                }
            }
        }
        zcopy_outcomes(&mut p, &mut zcopy, &mut written);
    }
    // Liveness: between honest peers still open, everything written arrives once both
    // readers keep reading (no pair of sides ever sits without credits).
    let open = |p: &Pair| p.a.c.phase() != Phase::Failed && p.b.c.phase() != Phase::Failed;
    if !forged && open(&p) {
        let mut rounds = 0;
        while open(&p) {
            p.settle_crossing();
            zcopy_outcomes(&mut p, &mut zcopy, &mut written);
            if let Ok(d) = p.b.read(&p.a, 1 << 16) {
                read.extend_from_slice(&d);
            }
            let _ = p.a.read(&p.b, 1 << 16);
            if read.len() >= written.len() && zcopy.is_none() && p.a.c.unsent() == 0 {
                break;
            }
            rounds += 1;
            assert!(rounds < 10_000, "the stream stalled");
        }
        if open(&p) {
            assert_eq!(read.len(), written.len(), "the stream stalled");
        }
    }
    if !forged {
        assert!(read.len() <= written.len(), "read more than was written");
        if let Some(at) = read.iter().zip(&written).position(|(r, w)| r != w) {
            panic!(
                "the reader got bytes nobody wrote: at {at} of {} read ({} written), {:?} where {:?}",
                read.len(),
                written.len(),
                &read[at..(at + 8).min(read.len())],
                &written[at..(at + 8).min(written.len())]
            );
        }
    }
});

/// A zero-copy source region is free again once the advert is over. A revoked advert's
/// unread rest goes by buffered copy, as `SdpStream` sends it (nothing else is queued
/// meanwhile: the connection takes no write during zero copy).
fn zcopy_outcomes(p: &mut Pair, zcopy: &mut Option<(usize, Vec<u8>)>, written: &mut Vec<u8>) {
    while let Some(e) = p.a.c.poll_event() {
        p.a.regions.clear();
        if let (Event::ZcopyRevoked { read }, Some((at, d))) = (e, zcopy.take()) {
            // After an abort or a failure nothing more goes: what the reader got is a
            // prefix of what was written, as with a reset TCP connection.
            if p.a.c.phase() == Phase::Open {
                let rest = &d[read.min(d.len())..];
                let sent = p.a.c.send_revoked_rest(rest).unwrap_or(0);
                written.truncate(at + read.min(d.len()) + sent);
            }
        } else {
            *zcopy = None;
        }
    }
}
