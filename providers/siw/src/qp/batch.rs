//! A transmit batch: the FPDUs one socket write sends.
//!
//! Lengths, headers, pads and CRCs are the batch's own bytes, and so is a payload that is
//! small, covered by a CRC, or in memory the engine cannot map (it is copied in, as
//! before). A larger payload in mapped memory (embedded mode, and the sealed memfd
//! registrations krdmad maps) is *lent*: the batch records where it goes and the socket
//! reads it in place through one `sendmsg` over an I/O vector, as an RNIC's DMA reads a
//! registration — no copy into a buffer of ours first.
//!
//! A lent payload is checked when it is emitted (so a bad gather list fails the request
//! there, as a copied one does) and leased again when it is written: the lease holds off
//! invalidation only for sends that never wait, and what the socket does not take at once
//! is either copied out while the lease is held or sent after waiting for room with no
//! lease held. A registration invalidated between the emit and the write (the consumer
//! deregistered memory under its own request in flight) fails the write, and so the
//! connection, counted as `tx_lend_refused`.

use crate::llp::Llp;
use crate::wire::{self, Header};
use rnicpi::{Access, AccessError, Lease, Region, Sgl};
use std::io;
use std::sync::Arc;

/// Payloads shorter than this are copied: for them an I/O vector entry and a lease cost
/// more than the copy.
const LEND_MIN: usize = 4096;
/// At most this many I/O vector entries per `sendmsg` (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Consumer bytes that go out in place, just before `bytes[at]`.
struct Lent {
    at: usize,
    region: Arc<Region>,
    pd: u32,
    addr: u64,
    len: usize,
    need: Access,
}

/// Whether a payload of `n` bytes is worth lending (and may be: no CRC covers it).
fn lends(crc: bool, n: usize) -> bool {
    !crc && n >= LEND_MIN
}

/// FPDUs to write: own bytes with lent payloads between them (see the module docs).
#[derive(Default)]
pub(crate) struct Batch {
    bytes: Vec<u8>,
    lent: Vec<Lent>,
}

impl Batch {
    pub(crate) fn with_capacity(n: usize) -> Batch {
        Batch {
            bytes: Vec::with_capacity(n),
            ..Batch::default()
        }
    }

    /// Bytes the batch puts on the stream.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len() + self.lent_len()
    }

    /// Bytes of it that go out from consumer memory in place.
    pub(crate) fn lent_len(&self) -> usize {
        self.lent.iter().map(|l| l.len).sum()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.bytes.is_empty() && self.lent.is_empty()
    }

    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.lent.clear();
    }

    /// The batch's own bytes, for what is built with no payload to lend (a Terminate, a
    /// Read Request).
    pub(crate) fn bytes(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }

    /// Start an FPDU with ULPDU header `h`; returns its start for
    /// [`finish_fpdu`](Self::finish_fpdu).
    pub(crate) fn begin_fpdu(&mut self, h: &Header) -> usize {
        let start = wire::begin_fpdu(&mut self.bytes);
        h.emit(wire::grow(&mut self.bytes, h.buffer_len()));
        start
    }

    /// Room for `n` payload bytes the caller copies in.
    pub(crate) fn copied_payload(&mut self, n: usize) -> &mut [u8] {
        wire::grow(&mut self.bytes, n)
    }

    /// The payload: `n` bytes of the gather list `sgl` from message offset `off`, which
    /// must allow `need`. Lent where every piece can be (and no CRC covers it: that is
    /// computed over our own copy), copied otherwise.
    pub(crate) fn payload_from(
        &mut self,
        sgl: &Sgl,
        (off, n): (u64, usize),
        need: Access,
        crc: bool,
    ) -> Result<(), AccessError> {
        let lend = lends(crc, n)
            && sgl
                .pieces(off, n)
                .all(|(r, addr, len)| r.lendable(addr, len));
        if !lend {
            return sgl.read_at(off, self.copied_payload(n), need);
        }
        let mut covered = 0;
        for (region, addr, len) in sgl.pieces(off, n) {
            region.check(sgl.pd(), addr, len as u64, need)?;
            self.lend(region, sgl.pd(), (addr, len), need);
            covered += len;
        }
        (covered == n).then_some(()).ok_or(AccessError::OutOfBounds)
    }

    /// The payload: `n` bytes of `region` at `addr`, which must allow `need` (lent or
    /// copied as for [`payload_from`](Self::payload_from)).
    pub(crate) fn payload_of(
        &mut self,
        region: &Arc<Region>,
        pd: u32,
        (addr, n): (u64, usize),
        need: Access,
        crc: bool,
    ) -> Result<(), AccessError> {
        if !lends(crc, n) || !region.lendable(addr, n) {
            return region.read(pd, addr, self.copied_payload(n), need);
        }
        region.check(pd, addr, n as u64, need)?;
        self.lend(region, pd, (addr, n), need);
        Ok(())
    }

    fn lend(&mut self, region: &Arc<Region>, pd: u32, (addr, len): (u64, usize), need: Access) {
        self.lent.push(Lent {
            at: self.bytes.len(),
            region: region.clone(),
            pd,
            addr,
            len,
            need,
        });
    }

    /// Finish the FPDU begun at `start`: length, pad and CRC (a CRC only over a payload
    /// of our own: [`payload_from`](Self::payload_from) never lends one it covers).
    pub(crate) fn finish_fpdu(&mut self, start: usize, crc: bool) -> wire::Result<()> {
        let lent_here = self.lent.iter().rev().take_while(|l| l.at > start);
        match lent_here.map(|l| l.len).sum() {
            0 => wire::finish_fpdu(&mut self.bytes, start, crc),
            lent => wire::finish_fpdu_lent(&mut self.bytes, start, lent),
        }
    }

    /// The lent payloads leased for a write: each checked again and held against
    /// invalidation until the leases drop.
    fn leases(&self) -> io::Result<Vec<Lease<'_>>> {
        self.lent
            .iter()
            .map(|l| l.region.lend(l.pd, l.addr, l.len, l.need))
            .collect::<Result<_, _>>()
            .map_err(|e| io::Error::other(LendRefused(e)))
    }

    /// The stream's pieces in order, from stream offset `from`: (pointer, length).
    fn pieces<'a>(
        &'a self,
        leases: &'a [Lease<'a>],
        from: usize,
    ) -> impl Iterator<Item = (*const u8, usize)> + 'a {
        let mut own = 0; // bytes[own..] not yet handed out
        let lent = self.lent.iter().zip(leases).map(Some).chain([None]);
        let mut skip = from;
        lent.flat_map(move |l| {
            let upto = l.map_or(self.bytes.len(), |(l, _)| l.at);
            let own_piece = (self.bytes[own..upto].as_ptr(), upto - own);
            own = upto;
            let lent_piece = l.map(|(_, lease)| (lease.as_ptr() as *const u8, lease.len()));
            [Some(own_piece), lent_piece].into_iter().flatten()
        })
        .filter_map(move |(p, len)| {
            let cut = skip.min(len);
            skip -= cut;
            // SAFETY: `cut <= len`, so the pointer stays inside (or one past) its piece.
            (len > cut).then(|| (unsafe { p.add(cut) }, len - cut))
        })
    }

    /// Write from stream offset `from` as far as `llp` takes it without waiting;
    /// returns the bytes taken.
    pub(crate) fn write_now(&self, llp: &dyn Llp, from: usize) -> io::Result<usize> {
        if self.lent.is_empty() {
            return llp.write_now(&self.bytes[from..]);
        }
        let leases = self.leases()?;
        let iov: Vec<libc::iovec> = self
            .pieces(&leases, from)
            .map(|(p, len)| libc::iovec {
                iov_base: p as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        let mut taken = 0;
        for part in iov.chunks(IOV_MAX) {
            let want: usize = part.iter().map(|v| v.iov_len).sum();
            // SAFETY: every entry is a piece of our own bytes or of a lease held until
            // the end of this function (a checked range of a registration the accessor
            // maps, not invalidated meanwhile), each with its true length.
            let n = unsafe { llp.write_now_vectored(part)? };
            taken += n;
            if n < want {
                break;
            }
        }
        Ok(taken)
    }

    /// Write everything from stream offset `from` on: in place while the LLP takes bytes,
    /// waiting for room between sends with no lease held. An LLP with no room to wait for
    /// (one in memory) gets the rest copied out, through its waiting write. Returns the
    /// lent bytes so copied (none over a socket).
    pub(crate) fn write_all_from(&self, llp: &dyn Llp, from: usize) -> io::Result<usize> {
        if self.lent.is_empty() {
            llp.write_all(&self.bytes[from..])?;
            return Ok(0);
        }
        let total = self.len();
        let mut done = from;
        while done < total {
            let n = self.write_now(llp, done)?;
            done += n;
            if n == 0 && done < total && !llp.wait_writable()? {
                let mut rest = Vec::with_capacity(total - done);
                let copied = self.copy_rest(done, &mut rest)?;
                llp.write_all(&rest)?;
                return Ok(copied);
            }
        }
        Ok(0)
    }

    /// Append the bytes from stream offset `from` on to `to`, the lent ones copied out;
    /// returns how many of them were lent.
    fn copy_rest(&self, from: usize, to: &mut Vec<u8>) -> io::Result<usize> {
        if self.lent.is_empty() {
            to.extend_from_slice(&self.bytes[from..]);
            return Ok(0);
        }
        let leases = self.leases()?;
        let ours = self.bytes.as_ptr_range();
        let mut lent = 0;
        for (p, len) in self.pieces(&leases, from) {
            if !ours.contains(&p) {
                lent += len;
            }
            let at = to.len();
            to.resize(at + len, 0);
            // SAFETY: as in `write_now`, `p..p+len` is a piece of our bytes or of a held
            // lease; `to` is a distinct buffer of ours with room for `len` bytes at `at`.
            unsafe { std::ptr::copy_nonoverlapping(p, to[at..].as_mut_ptr(), len) };
        }
        Ok(lent)
    }
}

/// A lent payload's registration failed its check at write time.
#[derive(Debug, thiserror::Error)]
#[error("registration of a lent payload refused at write time: {0}")]
pub(crate) struct LendRefused(pub AccessError);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{FpduDecoder, FpduPacket, Model, Opcode, RdmapPacket, QN_SEND};
    use rnicpi::wr::Sge;
    use rnicpi::{LocalMemory, MrTable};
    use std::net::Shutdown;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An LLP that keeps what it is given, taking at most `room` bytes per write; with
    /// `waits` it is a socket whose wait for room ends with room for everything.
    #[derive(Default)]
    struct Sink {
        got: parking_lot::Mutex<Vec<u8>>,
        room: AtomicUsize,
        waits: Option<AtomicUsize>,
    }

    impl Llp for Sink {
        fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
            self.got.lock().extend_from_slice(bytes);
            Ok(())
        }
        fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
            let n = bytes.len().min(self.room.load(Ordering::Relaxed));
            self.got.lock().extend_from_slice(&bytes[..n]);
            Ok(n)
        }
        fn wait_writable(&self) -> io::Result<bool> {
            let Some(waits) = &self.waits else {
                return Ok(false);
            };
            waits.fetch_add(1, Ordering::Relaxed);
            self.room.store(usize::MAX, Ordering::Relaxed);
            Ok(true)
        }
        fn shutdown(&self, _: Shutdown) {}
        fn abort(&self) {}
    }

    fn send_header(off: u64, last: bool) -> Header {
        Header {
            opcode: Opcode::Send,
            last,
            model: Model::Untagged {
                inv_stag: 0,
                qn: QN_SEND,
                msn: 1,
                mo: off as u32,
            },
        }
    }

    /// A three-element gather list over `buf` (registered in `mrs`), and the batch of a
    /// Send of all of it in FPDUs of `chunk` payload bytes, built lent or copied.
    fn batch_of(mrs: &MrTable, buf: &[u8], chunk: usize, crc: bool) -> (Batch, usize) {
        let base = buf.as_ptr() as u64;
        let len = buf.len() as u64;
        let r = mrs
            .register(1, base, len, Access::LOCAL_WRITE, Arc::new(LocalMemory))
            .unwrap();
        let third = len / 3;
        let sge = |at: u64, n: u64| Sge {
            addr: base + at,
            length: n as u32,
            lkey: r.stag,
        };
        let sges = [
            sge(0, third),
            sge(third, third),
            sge(2 * third, len - 2 * third),
        ];
        let sgl = mrs.resolve_sgl(1, &sges, Access::empty()).unwrap();
        let mut b = Batch::default();
        let (mut off, mut fpdus) = (0, 0);
        while off < buf.len() {
            let n = (buf.len() - off).min(chunk);
            let start = b.begin_fpdu(&send_header(off as u64, off + n == buf.len()));
            b.payload_from(&sgl, (off as u64, n), Access::empty(), crc)
                .unwrap();
            b.finish_fpdu(start, crc).unwrap();
            off += n;
            fpdus += 1;
        }
        (b, fpdus)
    }

    /// Whole FPDUs of `stream`, each checked, payloads joined.
    fn payloads(stream: &[u8], crc: bool) -> (Vec<u8>, usize) {
        let mut d = FpduDecoder::new();
        let (mut out, mut n) = (Vec::new(), 0);
        let whole = d.feed(stream, |f| {
            let f = FpduPacket::new_checked(f).unwrap();
            if crc {
                f.check_crc().unwrap();
            } else {
                assert_eq!(f.crc(), 0);
            }
            out.extend_from_slice(RdmapPacket::new_checked(f.ulpdu()).unwrap().payload());
            n += 1;
            true
        });
        assert!(whole);
        (out, n)
    }

    #[test]
    fn lent_and_copied_batches_put_the_same_bytes_on_the_wire() {
        let buf: Vec<u8> = (0..200_003u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mrs = MrTable::new(16);
        let (lent, fpdus) = batch_of(&mrs, &buf, 65_000, false);
        assert!(
            !lent.lent.is_empty(),
            "big payloads in local memory are lent"
        );
        assert!(lent.bytes.len() < 200, "only the framing is ours");
        let (copied, _) = batch_of(&mrs, &buf, 65_000, true);
        assert!(copied.lent.is_empty(), "a payload under a CRC is copied");
        // Written at once, in pieces a socket takes a little at a time, and handed over
        // part-way: always the same stream, the same payload.
        let sink = Sink::default();
        sink.room.store(usize::MAX, Ordering::Relaxed);
        assert_eq!(lent.write_all_from(&sink, 0).unwrap(), 0, "nothing copied");
        let whole = sink.got.lock().clone();
        assert_eq!(whole.len(), lent.len());
        assert_eq!(payloads(&whole, false), (buf.clone(), fpdus));
        let slow = Sink::default();
        slow.room.store(7_777, Ordering::Relaxed);
        let mut at = 0;
        for _ in 0..3 {
            at += lent.write_now(&slow, at).unwrap();
        }
        let mut rest = slow.got.lock().clone();
        lent.copy_rest(at, &mut rest).unwrap();
        assert_eq!(rest, whole);
        // A full LLP in memory has no room to wait for: the rest is copied out.
        slow.room.store(0, Ordering::Relaxed);
        let copied_out = lent.write_all_from(&slow, at).unwrap();
        assert_eq!(*slow.got.lock(), whole);
        let left = lent.len() - at;
        assert!(
            copied_out <= left && copied_out + 200 > left,
            "{copied_out} of {left} copied"
        );
        // A full socket is waited for, and the rest still goes out in place.
        let socket = Sink {
            waits: Some(AtomicUsize::new(0)),
            ..Sink::default()
        };
        assert_eq!(
            lent.write_all_from(&socket, 0).unwrap(),
            0,
            "nothing copied"
        );
        assert_eq!(*socket.got.lock(), whole);
        assert_eq!(socket.waits.as_ref().unwrap().load(Ordering::Relaxed), 1);
        let (got, n) = payloads(&copied_stream(&copied), true);
        assert_eq!((got, n), (buf, fpdus));
    }

    fn copied_stream(b: &Batch) -> Vec<u8> {
        let mut v = Vec::new();
        b.copy_rest(0, &mut v).unwrap();
        v
    }

    #[test]
    fn small_payloads_are_copied() {
        let buf = vec![5u8; 3000];
        let mrs = MrTable::new(16);
        let (b, _) = batch_of(&mrs, &buf, 1000, false);
        assert!(b.lent.is_empty());
        assert_eq!(b.len(), b.bytes.len());
    }

    #[test]
    fn a_registration_invalidated_before_the_write_fails_it_without_reading() {
        let buf = vec![9u8; 100_000];
        let mrs = MrTable::new(16);
        let (b, _) = batch_of(&mrs, &buf, 65_000, false);
        b.lent[0].region.invalidate();
        let sink = Sink::default();
        sink.room.store(usize::MAX, Ordering::Relaxed);
        let e = b.write_now(&sink, 0).unwrap_err();
        assert!(e.get_ref().is_some_and(|e| e.is::<LendRefused>()), "{e}");
        assert!(sink.got.lock().is_empty(), "nothing of the batch went out");
        assert!(b.copy_rest(0, &mut Vec::new()).is_err());
    }
}
