//! FPDU framing (RFC 5044 §4): how MPA carries each DDP segment (ULPDU) over the TCP
//! stream, and [`FpduDecoder`], which finds the FPDUs in a stream read in chunks.
//!
//! | bytes | field |
//! |---|---|
//! | 0..2 | ULPDU length |
//! | 2..2+n | ULPDU: the DDP/RDMAP header and payload |
//! | | 0–3 pad bytes, to a multiple of 4 of 2 + n (zero from krdma; kernel siw's are not always) |
//! | last 4 | CRC32c over everything before it, **stored little-endian** (as kernel siw and tshark agree); zero when CRC is off |
//!
//! FPDUs are built in place in the batch the transmit side writes: [`begin_fpdu`] leaves
//! room for the length, the caller appends the ULPDU (its header emitted into room that
//! [`grow`] adds, the payload read straight from memory after it), and
//! [`finish_fpdu`] writes the length, the pad and the CRC through a [`Packet`] view. A
//! payload sent from consumer memory in place is not appended: [`finish_fpdu_lent`]
//! frames the FPDU around where it goes.

use super::{grow, Error, Result};
use rnicpi::wire::{check_len, rd16, wr16};

mod field {
    use rnicpi::wire::Field;

    pub const ULPDU_LENGTH: Field = 0..2;
    /// The ULPDU starts here.
    pub const ULPDU: usize = 2;
}

/// Size of the length field before the ULPDU.
pub const HEADER_LEN: usize = field::ULPDU;
/// Size of the CRC field, present whether or not CRC is in use.
pub const CRC_LEN: usize = 4;

/// Bytes on the wire of an FPDU carrying `ulpdu` bytes.
pub fn fpdu_len(ulpdu: usize) -> usize {
    (HEADER_LEN + ulpdu).div_ceil(4) * 4 + CRC_LEN
}

/// Largest ULPDU so that one FPDU fits an MSS (and the 16-bit length).
pub fn max_ulpdu_for_mss(mss: usize) -> usize {
    let fit = ((mss.saturating_sub(CRC_LEN) / 4) * 4).saturating_sub(HEADER_LEN);
    fit.clamp(64, 65532)
}

/// A view of one whole FPDU at the start of a buffer (which may go on past it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap `buffer`; `Truncated` unless it holds the length field and the whole FPDU that
    /// announces.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        check_len(HEADER_LEN, b.len())?;
        let p = Packet { buffer };
        check_len(p.total_len(), p.buffer.as_ref().len())?;
        Ok(p)
    }

    /// Crate-internal: the caller has checked the length.
    pub(crate) fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The ULPDU length, as announced.
    pub fn ulpdu_len(&self) -> usize {
        rd16(self.b(), field::ULPDU_LENGTH) as usize
    }

    /// Bytes of the whole FPDU: length, ULPDU, pad and CRC.
    pub fn total_len(&self) -> usize {
        fpdu_len(self.ulpdu_len())
    }

    /// The ULPDU.
    pub fn ulpdu(&self) -> &[u8] {
        &self.b()[field::ULPDU..field::ULPDU + self.ulpdu_len()]
    }

    /// The pad bytes: krdma writes zeros, kernel siw whatever its buffer held; not checked
    /// (the CRC covers them).
    pub fn pad(&self) -> &[u8] {
        &self.b()[field::ULPDU + self.ulpdu_len()..self.total_len() - CRC_LEN]
    }

    /// The CRC field as stored (little-endian): zero when CRC is off.
    pub fn crc(&self) -> u32 {
        let end = self.total_len();
        let mut c = [0u8; CRC_LEN];
        c.copy_from_slice(&self.b()[end - CRC_LEN..end]);
        u32::from_le_bytes(c)
    }

    /// The CRC32c of the FPDU as it is (length, ULPDU and pad).
    pub fn computed_crc(&self) -> u32 {
        crc32c::crc32c(&self.b()[..self.total_len() - CRC_LEN])
    }

    /// `BadCrc` unless the stored CRC is the one computed.
    pub fn check_crc(&self) -> Result<()> {
        if self.crc() == self.computed_crc() {
            Ok(())
        } else {
            Err(Error::BadCrc)
        }
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The ULPDU with the lifetime of the underlying buffer.
    pub fn ulpdu_ref(&self) -> &'a [u8] {
        let b: &'a [u8] = self.buffer.as_ref();
        let len = rd16(b, field::ULPDU_LENGTH) as usize;
        &b[field::ULPDU..field::ULPDU + len]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Announce a ULPDU of `v` bytes: the buffer must then hold `fpdu_len(v)` bytes before
    /// the pad and CRC are touched.
    pub fn set_ulpdu_len(&mut self, v: u16) {
        wr16(self.buffer.as_mut(), field::ULPDU_LENGTH, v);
    }

    /// The pad bytes, writable.
    pub fn pad_mut(&mut self) -> &mut [u8] {
        let (start, end) = (field::ULPDU + self.ulpdu_len(), self.total_len() - CRC_LEN);
        &mut self.buffer.as_mut()[start..end]
    }

    /// Store the CRC32c of the FPDU when `crc`, else zero.
    pub fn fill_crc(&mut self, crc: bool) {
        let c = if crc { self.computed_crc() } else { 0 };
        let end = self.total_len();
        self.buffer.as_mut()[end - CRC_LEN..end].copy_from_slice(&c.to_le_bytes());
    }
}

/// Start an FPDU in `out`: room for the length; returns the FPDU's offset, for
/// [`finish_fpdu`] once the ULPDU has been appended.
pub fn begin_fpdu(out: &mut Vec<u8>) -> usize {
    let start = out.len();
    grow(out, HEADER_LEN);
    start
}

/// Finish the FPDU begun at `start`: length, pad to 4 bytes, and CRC32c when `crc` (zero
/// otherwise). `BadLength` for a ULPDU over 65535 bytes.
pub fn finish_fpdu(out: &mut Vec<u8>, start: usize, crc: bool) -> Result<()> {
    let ulpdu = out.len() - start - HEADER_LEN;
    let len = u16::try_from(ulpdu).map_err(|_| Error::BadLength)?;
    out.resize(start + fpdu_len(ulpdu), 0); // the zero pad, and room for the CRC
    let mut p = Packet::new_unchecked(&mut out[start..]);
    p.set_ulpdu_len(len);
    p.fill_crc(crc);
    Ok(())
}

/// Finish the FPDU begun at `start` whose ULPDU ends with `lent` payload bytes that are
/// not in `out` (they go out from consumer memory between `out`'s bytes so far and the
/// pad): length, the zero pad, and a zero CRC — a lent payload is never under a CRC.
pub fn finish_fpdu_lent(out: &mut Vec<u8>, start: usize, lent: usize) -> Result<()> {
    let ulpdu = out.len() - start - HEADER_LEN + lent;
    let len = u16::try_from(ulpdu).map_err(|_| Error::BadLength)?;
    out.resize(start + fpdu_len(ulpdu) - lent, 0);
    wr16(&mut out[start..], field::ULPDU_LENGTH, len);
    Ok(())
}

/// Check a complete FPDU at the start of `fpdu` (its CRC when `crc`) and return its ULPDU.
pub fn check_fpdu(fpdu: &[u8], crc: bool) -> Result<&[u8]> {
    let p = Packet::new_checked(fpdu)?;
    if crc {
        p.check_crc()?;
    }
    Ok(p.ulpdu_ref())
}

/// The length of the FPDU whose length field starts `b`, once `b` holds that field.
fn announced_len(b: &[u8]) -> Option<usize> {
    (b.len() >= HEADER_LEN).then(|| fpdu_len(rd16(b, field::ULPDU_LENGTH).into()))
}

/// Splits an MPA stream, read in chunks of any size, into whole FPDUs (RFC 5044 §4).
///
/// The receive side as Linux siw frames it, minus its in-place placement: the two-byte
/// length first ([`Framing::Length`]), then the rest of the FPDU ([`Framing::Body`]).
/// FPDUs that lie wholly inside a chunk are handed out as slices of it; only one that
/// straddles chunks is gathered, so a large read costs no copy here. The decoder checks
/// nothing but the length: the CRC and the headers are the engine's to check.
#[derive(Debug, Default)]
pub struct FpduDecoder {
    /// The FPDU straddling chunk boundaries, as far as it has arrived.
    partial: Vec<u8>,
    state: Framing,
}

/// Where an [`FpduDecoder`] stands in the stream.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Between FPDUs, or inside the length field.
    #[default]
    Length,
    /// Inside an FPDU of `total` bytes.
    Body { total: usize },
}

impl FpduDecoder {
    pub fn new() -> FpduDecoder {
        FpduDecoder::default()
    }

    /// Take `chunk`, the next bytes of the stream, and hand every FPDU it completes to
    /// `on_fpdu`, in order. Stops when `on_fpdu` returns false (the bytes after that
    /// FPDU are dropped) and then returns false.
    pub fn feed(&mut self, mut chunk: &[u8], mut on_fpdu: impl FnMut(&[u8]) -> bool) -> bool {
        while !chunk.is_empty() {
            match self.state {
                Framing::Length if self.partial.is_empty() => {
                    // Whole FPDUs straight from the chunk.
                    while let Some(total) = announced_len(chunk) {
                        let Some((fpdu, rest)) = chunk.split_at_checked(total) else {
                            break;
                        };
                        if !on_fpdu(fpdu) {
                            return false;
                        }
                        chunk = rest;
                    }
                    self.gather(&mut chunk, HEADER_LEN);
                }
                Framing::Length => {
                    self.gather(&mut chunk, HEADER_LEN);
                }
                Framing::Body { total } => {
                    self.gather(&mut chunk, total);
                    if self.partial.len() == total {
                        let whole = on_fpdu(&self.partial);
                        self.partial.clear();
                        self.state = Framing::Length;
                        if !whole {
                            return false;
                        }
                    }
                }
            }
        }
        true
    }

    /// Move bytes from `chunk` into `partial` until it holds `want`; a completed length
    /// field moves on to the body.
    fn gather(&mut self, chunk: &mut &[u8], want: usize) {
        let n = want.saturating_sub(self.partial.len()).min(chunk.len());
        self.partial.extend_from_slice(&chunk[..n]);
        *chunk = &chunk[n..];
        if let (Framing::Length, Some(total)) = (self.state, announced_len(&self.partial)) {
            self.state = Framing::Body { total };
        }
    }

    /// Where the decoder stands.
    pub fn state(&self) -> Framing {
        self.state
    }

    /// No FPDU is partly received: the stream may end here cleanly.
    pub fn at_boundary(&self) -> bool {
        self.partial.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Truncated;
    use crate::wire::{Header, Model, Opcode, RdmapPacket};
    use proptest::prelude::*;

    #[test]
    fn fpdu_crc_sits_little_endian_after_the_pad() {
        let mut out = vec![0xee]; // an FPDU need not start a batch
        let s = begin_fpdu(&mut out);
        let h = Header {
            opcode: Opcode::Send,
            last: true,
            model: Model::Untagged {
                inv_stag: 0,
                qn: 0,
                msn: 1,
                mo: 0,
            },
        };
        h.emit(grow(&mut out, h.buffer_len()));
        out.extend_from_slice(b"hello");
        finish_fpdu(&mut out, s, true).unwrap();
        assert_eq!(out.len() - s, fpdu_len(18 + 5));
        let f = &out[s..];
        let p = Packet::new_checked(f).unwrap();
        assert_eq!(
            (p.ulpdu_len(), p.total_len(), p.pad()),
            (23, 32, &[0u8; 3][..])
        );
        let crc = crc32c::crc32c(&f[..28]);
        assert_eq!(f[28..], crc.to_le_bytes());
        assert_eq!(p.crc(), crc);
        let u = check_fpdu(f, true).unwrap();
        let r = RdmapPacket::new_checked(u).unwrap();
        assert_eq!(Header::parse(&r), Ok(h));
        assert_eq!(r.payload(), b"hello");
        let n = out.len();
        out[n - 1] ^= 1;
        assert_eq!(check_fpdu(&out[s..], true), Err(Error::BadCrc));
        assert!(
            check_fpdu(&out[s..], false).is_ok(),
            "CRC off: not looked at"
        );
    }

    #[test]
    fn without_crc_the_field_is_zero_and_a_huge_ulpdu_is_refused() {
        let mut out = Vec::new();
        let s = begin_fpdu(&mut out);
        out.extend_from_slice(b"abcd");
        finish_fpdu(&mut out, s, false).unwrap();
        assert_eq!(out, [0, 4, b'a', b'b', b'c', b'd', 0, 0, 0, 0, 0, 0]);
        let mut out = Vec::new();
        let s = begin_fpdu(&mut out);
        out.resize(HEADER_LEN + 65536, 0);
        assert_eq!(finish_fpdu(&mut out, s, true), Err(Error::BadLength));
        let mut out = Vec::new();
        let s = begin_fpdu(&mut out);
        assert_eq!(finish_fpdu_lent(&mut out, s, 65536), Err(Error::BadLength));
    }

    #[test]
    fn mss_sizing() {
        assert_eq!(fpdu_len(max_ulpdu_for_mss(1448)), 1448);
        assert_eq!(max_ulpdu_for_mss(1448), 1442);
        assert_eq!(max_ulpdu_for_mss(0), 64);
        assert_eq!(max_ulpdu_for_mss(usize::MAX), 65532);
    }

    #[test]
    fn the_decoder_stops_where_it_is_told_and_knows_a_torn_fpdu() {
        let mut stream = Vec::new();
        for u in [&b"one"[..], b"two", b"three"] {
            let s = begin_fpdu(&mut stream);
            stream.extend_from_slice(u);
            finish_fpdu(&mut stream, s, false).unwrap();
        }
        let mut d = FpduDecoder::new();
        let mut seen = 0;
        assert!(!d.feed(&stream, |_| {
            seen += 1;
            seen < 2
        }));
        assert_eq!(seen, 2);
        let mut d = FpduDecoder::new();
        assert!(d.feed(&stream[..1], |_| unreachable!()));
        assert_eq!(d.state(), Framing::Length);
        assert!(!d.at_boundary());
        assert!(d.feed(&stream[1..5], |_| unreachable!()));
        assert_eq!(d.state(), Framing::Body { total: fpdu_len(3) });
    }

    proptest! {
        #[test]
        fn build_and_check_round_trip(
            ulpdu in proptest::collection::vec(any::<u8>(), 0..600),
            crc: bool,
            tail in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let mut b = Vec::new();
            let s = begin_fpdu(&mut b);
            b.extend_from_slice(&ulpdu);
            finish_fpdu(&mut b, s, crc).unwrap();
            prop_assert_eq!(b.len(), fpdu_len(ulpdu.len()));
            prop_assert_eq!(b.len() % 4, 0);
            b.extend_from_slice(&tail);
            prop_assert_eq!(check_fpdu(&b, crc), Ok(&ulpdu[..]));
            let p = Packet::new_checked(&b[..]).unwrap();
            prop_assert_eq!(p.crc(), if crc { p.computed_crc() } else { 0 });
        }

        #[test]
        fn framed_around_a_lent_payload_as_around_a_copied_one(
            head in proptest::collection::vec(any::<u8>(), 0..40),
            payload in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let mut copied = Vec::new();
            let s = begin_fpdu(&mut copied);
            copied.extend_from_slice(&head);
            copied.extend_from_slice(&payload);
            finish_fpdu(&mut copied, s, false).unwrap();
            // Framed with a gap where the payload goes, then the payload spliced in: the
            // stream the socket sends from the two places.
            let mut lent = vec![0xee];
            let s = begin_fpdu(&mut lent);
            lent.extend_from_slice(&head);
            let gap = lent.len();
            finish_fpdu_lent(&mut lent, s, payload.len()).unwrap();
            lent.splice(gap..gap, payload.iter().copied());
            prop_assert_eq!(&lent[1..], &copied[..]);
        }

        #[test]
        fn truncated_at_every_length(ulpdu in proptest::collection::vec(any::<u8>(), 0..64), cut in any::<prop::sample::Index>()) {
            let mut b = Vec::new();
            let s = begin_fpdu(&mut b);
            b.extend_from_slice(&ulpdu);
            finish_fpdu(&mut b, s, true).unwrap();
            let len = cut.index(b.len());
            let need = if len < HEADER_LEN { HEADER_LEN } else { b.len() };
            prop_assert_eq!(Packet::new_checked(&b[..len]).err(), Some(Error::Truncated(Truncated { need, have: len })));
        }

        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            for crc in [false, true] {
                let _ = check_fpdu(&b, crc);
            }
            if let Ok(p) = Packet::new_checked(&b[..]) {
                prop_assert_eq!(p.ulpdu().len() + p.pad().len() + HEADER_LEN + CRC_LEN, p.total_len());
            }
        }

        #[test]
        fn fpdus_come_out_whole_however_the_stream_is_cut(
            ulpdus in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..12),
            cuts in proptest::collection::vec(0usize..2000, 0..20),
        ) {
            let mut stream = Vec::new();
            let mut want = Vec::new();
            for u in &ulpdus {
                let s = begin_fpdu(&mut stream);
                stream.extend_from_slice(u);
                finish_fpdu(&mut stream, s, true).unwrap();
                want.push(stream[s..].to_vec());
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (stream.len() + 1)).collect();
            cuts.push(stream.len());
            cuts.sort();
            let (mut d, mut got, mut at) = (FpduDecoder::new(), Vec::new(), 0);
            for c in cuts {
                let going = d.feed(&stream[at..c], |f| {
                    got.push(f.to_vec());
                    true
                });
                prop_assert!(going);
                at = c;
            }
            prop_assert!(d.at_boundary());
            prop_assert_eq!(d.state(), Framing::Length);
            for (g, w) in got.iter().zip(&want) {
                prop_assert_eq!(check_fpdu(g, true).unwrap(), check_fpdu(w, true).unwrap());
            }
            prop_assert_eq!(got, want);
        }
    }
}
