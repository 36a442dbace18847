//! A whole RoCEv2 packet: the UDP payload on port 4791.
//!
//! ```text
//! BTH (12) | extension headers per opcode | payload | pad (0..=3, zero) | ICRC (4)
//! ```
//!
//! [`Packet::new_checked`] validates everything that can be checked without the IP header:
//! a known opcode, TVer 0, room for the opcode's headers and the ICRC, and the pad count —
//! payload plus pad must be a multiple of four, the pad no larger than the payload area,
//! and opcodes without payload (ACK, Read Request, atomics) must have none. The ICRC covers
//! the IP and UDP headers too, so it is checked and filled by [`super::icrc`].
//!
//! Over 600 lines: the codec is the first 380 lines; the rest are its tests.

use super::opcode::{ExtHeader, Opcode};
use super::{aeth, atomic_ack_eth, atomic_eth, bth, deth, ieth, immdt, reth};
use super::{need, Error, Result};

/// Size of the ICRC trailer.
pub const ICRC_LEN: usize = 4;

/// Pad bytes that bring `payload_len` to a multiple of four.
pub const fn pad_for(payload_len: usize) -> u8 {
    ((4 - payload_len % 4) % 4) as u8
}

/// A checked view of a RoCEv2 UDP payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
    opcode: Opcode,
    pad: u8,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a UDP payload (exactly: its last four bytes are the ICRC) after validating its
    /// structure.
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        need(bth::HEADER_LEN + ICRC_LEN, b.len())?;
        let bth = bth::Packet::new_unchecked(b);
        let opcode = bth.opcode()?;
        if bth.tver() != 0 {
            return Err(Error::BadTransportVersion(bth.tver()));
        }
        let hlen = opcode.header_len();
        need(hlen + ICRC_LEN, b.len())?;
        let area = b.len() - hlen - ICRC_LEN;
        let pad = bth.pad_count();
        if !opcode.has_payload() {
            if area != 0 {
                return Err(Error::UnexpectedPayload {
                    opcode: opcode.as_u8(),
                    len: area,
                });
            }
            if pad != 0 {
                return Err(Error::BadPad { pad, area });
            }
        } else if pad as usize > area || area & 3 != 0 {
            return Err(Error::BadPad { pad, area });
        }
        Ok(Packet {
            buffer,
            opcode,
            pad,
        })
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The opcode (validated).
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The BTH.
    pub fn bth(&self) -> bth::Packet<&[u8]> {
        bth::Packet::new_unchecked(self.buffer.as_ref())
    }

    /// BTH plus extension headers: where the payload starts.
    pub fn header_len(&self) -> usize {
        self.opcode.header_len()
    }

    /// Pad count (as validated by `new_checked`).
    pub fn pad_count(&self) -> u8 {
        self.pad
    }

    /// Length of the payload without the pad.
    pub fn payload_len(&self) -> usize {
        self.buffer.as_ref().len() - self.header_len() - ICRC_LEN - self.pad as usize
    }

    /// The bytes of extension header `h`, if the opcode carries it.
    pub fn ext_header(&self, h: ExtHeader) -> Option<&[u8]> {
        let off = self.opcode.offset_of(h)?;
        Some(&self.buffer.as_ref()[off..off + h.wire_len()])
    }

    pub fn reth(&self) -> Option<reth::Packet<&[u8]>> {
        self.ext_header(ExtHeader::Reth)
            .map(reth::Packet::new_unchecked)
    }

    pub fn aeth(&self) -> Option<aeth::Packet<&[u8]>> {
        self.ext_header(ExtHeader::Aeth)
            .map(aeth::Packet::new_unchecked)
    }

    pub fn immdt(&self) -> Option<immdt::Packet<&[u8]>> {
        self.ext_header(ExtHeader::ImmDt)
            .map(immdt::Packet::new_unchecked)
    }

    pub fn ieth(&self) -> Option<ieth::Packet<&[u8]>> {
        self.ext_header(ExtHeader::Ieth)
            .map(ieth::Packet::new_unchecked)
    }

    pub fn atomic_eth(&self) -> Option<atomic_eth::Packet<&[u8]>> {
        self.ext_header(ExtHeader::AtomicEth)
            .map(atomic_eth::Packet::new_unchecked)
    }

    pub fn atomic_ack_eth(&self) -> Option<atomic_ack_eth::Packet<&[u8]>> {
        self.ext_header(ExtHeader::AtomicAckEth)
            .map(atomic_ack_eth::Packet::new_unchecked)
    }

    pub fn deth(&self) -> Option<deth::Packet<&[u8]>> {
        self.ext_header(ExtHeader::Deth)
            .map(deth::Packet::new_unchecked)
    }

    /// The payload, without the pad.
    pub fn payload(&self) -> &[u8] {
        let start = self.header_len();
        &self.buffer.as_ref()[start..start + self.payload_len()]
    }

    /// The pad bytes (rxe writes zeros; they are not checked).
    pub fn pad_bytes(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        let end = b.len() - ICRC_LEN;
        &b[end - self.pad as usize..end]
    }

    /// Everything but the ICRC.
    pub fn without_icrc(&self) -> &[u8] {
        let b = self.buffer.as_ref();
        &b[..b.len() - ICRC_LEN]
    }

    /// The ICRC as stored: the last four bytes, read little-endian (rxe's byte order).
    pub fn icrc(&self) -> u32 {
        let b = self.buffer.as_ref();
        let n = b.len();
        u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]])
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload with the lifetime of the underlying buffer.
    pub fn payload_ref(&self) -> &'a [u8] {
        let b: &'a [u8] = self.buffer.as_ref();
        let start = self.opcode.header_len();
        let len = b.len() - start - ICRC_LEN - self.pad as usize;
        &b[start..start + len]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// The BTH, writable. Changing the opcode or the pad count through it is not
    /// re-validated: wrap the buffer again afterwards.
    pub fn bth_mut(&mut self) -> bth::Packet<&mut [u8]> {
        bth::Packet::new_unchecked(self.buffer.as_mut())
    }

    /// The bytes of extension header `h`, writable (wrap them in that header's `Packet`).
    pub fn ext_header_mut(&mut self, h: ExtHeader) -> Option<&mut [u8]> {
        let off = self.opcode.offset_of(h)?;
        Some(&mut self.buffer.as_mut()[off..off + h.wire_len()])
    }

    /// The payload, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        let len = self.payload_len();
        &mut self.buffer.as_mut()[start..start + len]
    }

    /// Store the ICRC (little-endian, as rxe does).
    pub fn set_icrc(&mut self, v: u32) {
        let b = self.buffer.as_mut();
        let n = b.len();
        b[n - ICRC_LEN..].copy_from_slice(&v.to_le_bytes());
    }
}

/// A parsed RoCEv2 packet. Exactly the extension headers the opcode carries are `Some`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr<'a> {
    /// `bth.pad_count` is ignored by `emit`, which derives the pad from the payload.
    pub bth: bth::Repr,
    pub reth: Option<reth::Repr>,
    pub aeth: Option<aeth::Repr>,
    pub immdt: Option<immdt::Repr>,
    pub ieth: Option<ieth::Repr>,
    pub atomic_eth: Option<atomic_eth::Repr>,
    pub atomic_ack_eth: Option<atomic_ack_eth::Repr>,
    pub deth: Option<deth::Repr>,
    /// Without the pad.
    pub payload: &'a [u8],
}

impl<'a> Repr<'a> {
    /// A packet with `bth` and `payload` and no extension headers yet; set the ones the
    /// opcode needs before emitting.
    pub fn new(bth: bth::Repr, payload: &'a [u8]) -> Repr<'a> {
        Repr {
            bth,
            reth: None,
            aeth: None,
            immdt: None,
            ieth: None,
            atomic_eth: None,
            atomic_ack_eth: None,
            deth: None,
            payload,
        }
    }

    /// Parse a checked packet. Fails only on a reserved AETH syndrome (everything else was
    /// checked by [`Packet::new_checked`]).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(p: &Packet<&'a T>) -> Result<Repr<'a>> {
        let bth = bth::Repr::parse(&p.bth())?;
        let mut r = Repr::new(bth, p.payload_ref());
        if let Some(h) = p.reth() {
            r.reth = Some(reth::Repr::parse(&h)?);
        }
        if let Some(h) = p.aeth() {
            r.aeth = Some(aeth::Repr::parse(&h)?);
        }
        if let Some(h) = p.immdt() {
            r.immdt = Some(immdt::Repr::parse(&h)?);
        }
        if let Some(h) = p.ieth() {
            r.ieth = Some(ieth::Repr::parse(&h)?);
        }
        if let Some(h) = p.atomic_eth() {
            r.atomic_eth = Some(atomic_eth::Repr::parse(&h)?);
        }
        if let Some(h) = p.atomic_ack_eth() {
            r.atomic_ack_eth = Some(atomic_ack_eth::Repr::parse(&h)?);
        }
        if let Some(h) = p.deth() {
            r.deth = Some(deth::Repr::parse(&h)?);
        }
        Ok(r)
    }

    /// [`Packet::new_checked`] then [`Repr::parse`].
    pub fn parse_bytes(udp_payload: &'a [u8]) -> Result<Repr<'a>> {
        Repr::parse(&Packet::new_checked(udp_payload)?)
    }

    /// Pad that `emit` will add.
    pub fn pad_count(&self) -> u8 {
        pad_for(self.payload.len())
    }

    /// Length of the UDP payload `emit` writes (headers, payload, pad, ICRC).
    pub fn buffer_len(&self) -> usize {
        self.buffer_len_for(self.payload.len())
    }

    /// Where a payload of `payload_len` bytes sits in the packet: behind the headers.
    pub fn payload_range(&self, payload_len: usize) -> std::ops::Range<usize> {
        let at = self.bth.opcode.header_len();
        at..at + payload_len
    }

    /// Length of the packet with a payload of `payload_len` bytes instead of `payload`.
    pub fn buffer_len_for(&self, payload_len: usize) -> usize {
        self.bth.opcode.header_len() + payload_len + pad_for(payload_len) as usize + ICRC_LEN
    }

    fn present(&self, h: ExtHeader) -> bool {
        match h {
            ExtHeader::Reth => self.reth.is_some(),
            ExtHeader::Aeth => self.aeth.is_some(),
            ExtHeader::ImmDt => self.immdt.is_some(),
            ExtHeader::Ieth => self.ieth.is_some(),
            ExtHeader::AtomicEth => self.atomic_eth.is_some(),
            ExtHeader::AtomicAckEth => self.atomic_ack_eth.is_some(),
            ExtHeader::Deth => self.deth.is_some(),
        }
    }

    /// Check that the extension headers and payload agree with the opcode.
    pub fn check(&self) -> Result<()> {
        self.check_for(self.payload.len())
    }

    /// [`check`](Self::check) with a payload of `payload_len` bytes.
    fn check_for(&self, payload_len: usize) -> Result<()> {
        let op = self.bth.opcode;
        for h in [
            ExtHeader::Reth,
            ExtHeader::Aeth,
            ExtHeader::ImmDt,
            ExtHeader::Ieth,
            ExtHeader::AtomicEth,
            ExtHeader::AtomicAckEth,
            ExtHeader::Deth,
        ] {
            if self.present(h) != op.has(h) {
                return Err(Error::HeaderMismatch {
                    opcode: op.as_u8(),
                    header: h,
                });
            }
        }
        if !op.has_payload() && payload_len > 0 {
            return Err(Error::UnexpectedPayload {
                opcode: op.as_u8(),
                len: payload_len,
            });
        }
        Ok(())
    }

    /// Write the packet to the start of `buf` (which must hold [`buffer_len`](Self::buffer_len)
    /// bytes): headers, payload, zero pad, and a zero ICRC to be filled by
    /// [`icrc`](super::icrc). Returns the length written.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
        let len = self.emit_around(buf, self.payload.len())?;
        buf[self.payload_range(self.payload.len())].copy_from_slice(self.payload);
        Ok(len)
    }

    /// [`emit`](Self::emit) around a payload of `payload_len` bytes that is already in
    /// place (at [`payload_range`](Self::payload_range)) instead of `payload`:
    /// the headers, pad and zero ICRC are written, the payload left as it is. A sender
    /// gathers the payload straight into the packet this way, with no copy between.
    pub fn emit_around(&self, buf: &mut [u8], payload_len: usize) -> Result<usize> {
        self.check_for(payload_len)?;
        let len = self.buffer_len_for(payload_len);
        need(len, buf.len())?;
        let buf = &mut buf[..len];
        let op = self.bth.opcode;
        let mut bth = self.bth;
        bth.pad_count = pad_for(payload_len);
        bth.emit(&mut bth::Packet::new_unchecked(&mut buf[..]));
        for &h in op.ext_headers() {
            let off = op.offset_of(h).unwrap_or(0);
            let dst = &mut buf[off..off + h.wire_len()];
            match h {
                ExtHeader::Reth => emit_into(self.reth, dst, |r, d| {
                    r.emit(&mut reth::Packet::new_unchecked(d))
                }),
                ExtHeader::Aeth => emit_into(self.aeth, dst, |r, d| {
                    r.emit(&mut aeth::Packet::new_unchecked(d))
                }),
                ExtHeader::ImmDt => emit_into(self.immdt, dst, |r, d| {
                    r.emit(&mut immdt::Packet::new_unchecked(d))
                }),
                ExtHeader::Ieth => emit_into(self.ieth, dst, |r, d| {
                    r.emit(&mut ieth::Packet::new_unchecked(d))
                }),
                ExtHeader::AtomicEth => emit_into(self.atomic_eth, dst, |r, d| {
                    r.emit(&mut atomic_eth::Packet::new_unchecked(d))
                }),
                ExtHeader::AtomicAckEth => emit_into(self.atomic_ack_eth, dst, |r, d| {
                    r.emit(&mut atomic_ack_eth::Packet::new_unchecked(d))
                }),
                ExtHeader::Deth => emit_into(self.deth, dst, |r, d| {
                    r.emit(&mut deth::Packet::new_unchecked(d))
                }),
            }
        }
        buf[self.payload_range(payload_len).end..].fill(0);
        Ok(len)
    }

    /// [`emit`](Self::emit) into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v)?;
        Ok(v)
    }
}

fn emit_into<R>(r: Option<R>, dst: &mut [u8], f: impl FnOnce(R, &mut [u8])) {
    // `check` guarantees presence; a missing header would leave zeros.
    match r {
        Some(r) => f(r, dst),
        None => dst.fill(0),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::wire::opcode::Opcode;
    use proptest::prelude::*;

    /// Owned parts of a random, valid packet.
    #[derive(Debug, Clone)]
    pub(crate) struct Parts {
        pub bth: bth::Repr,
        pub reth: reth::Repr,
        pub aeth: aeth::Repr,
        pub immdt: immdt::Repr,
        pub ieth: ieth::Repr,
        pub atomic_eth: atomic_eth::Repr,
        pub atomic_ack_eth: atomic_ack_eth::Repr,
        pub deth: deth::Repr,
        pub payload: Vec<u8>,
    }

    impl Parts {
        pub(crate) fn repr(&self) -> Repr<'_> {
            let op = self.bth.opcode;
            let mut r = Repr::new(self.bth, if op.has_payload() { &self.payload } else { &[] });
            r.bth.pad_count = r.pad_count();
            let has = |h| op.has(h);
            r.reth = has(ExtHeader::Reth).then_some(self.reth);
            r.aeth = has(ExtHeader::Aeth).then_some(self.aeth);
            r.immdt = has(ExtHeader::ImmDt).then_some(self.immdt);
            r.ieth = has(ExtHeader::Ieth).then_some(self.ieth);
            r.atomic_eth = has(ExtHeader::AtomicEth).then_some(self.atomic_eth);
            r.atomic_ack_eth = has(ExtHeader::AtomicAckEth).then_some(self.atomic_ack_eth);
            r.deth = has(ExtHeader::Deth).then_some(self.deth);
            r
        }
    }

    pub(crate) fn any_parts() -> impl Strategy<Value = Parts> {
        (
            bth::tests::any_repr(),
            reth::tests::any_repr(),
            aeth::tests::any_repr(),
            immdt::tests::any_repr(),
            ieth::tests::any_repr(),
            atomic_eth::tests::any_repr(),
            atomic_ack_eth::tests::any_repr(),
            deth::tests::any_repr(),
            proptest::collection::vec(any::<u8>(), 0..80),
        )
            .prop_map(
                |(bth, reth, aeth, immdt, ieth, atomic_eth, atomic_ack_eth, deth, payload)| Parts {
                    bth,
                    reth,
                    aeth,
                    immdt,
                    ieth,
                    atomic_eth,
                    atomic_ack_eth,
                    deth,
                    payload,
                },
            )
    }

    proptest! {
        #[test]
        fn round_trip(parts in any_parts(), icrc in any::<u32>()) {
            let r = parts.repr();
            let mut b = r.to_vec().unwrap();
            prop_assert_eq!(b.len(), r.buffer_len());
            prop_assert_eq!(b.len() % 4, 0);
            let mut p = Packet::new_checked(&mut b[..]).unwrap();
            prop_assert_eq!(p.icrc(), 0);
            p.set_icrc(icrc);
            prop_assert_eq!(p.icrc(), icrc);
            let p = Packet::new_checked(&b[..]).unwrap();
            prop_assert_eq!(p.payload(), r.payload);
            prop_assert!(p.pad_bytes().iter().all(|&x| x == 0));
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
        }

        /// Headers emitted around a payload already in place (and whatever was in the
        /// buffer's pad and ICRC before) make the same packet as `emit`.
        #[test]
        fn emit_around_matches_emit(parts in any_parts(), junk in any::<u8>()) {
            let r = parts.repr();
            let n = r.payload.len();
            let mut b = vec![junk; r.buffer_len_for(n)];
            b[r.payload_range(n)].copy_from_slice(r.payload);
            let mut headers_only = r;
            headers_only.payload = &[];
            prop_assert_eq!(headers_only.emit_around(&mut b, n).unwrap(), b.len());
            prop_assert_eq!(b, r.to_vec().unwrap());
        }

        #[test]
        fn truncated_rejected(parts in any_parts(), cut in any::<prop::sample::Index>()) {
            let r = parts.repr();
            let b = r.to_vec().unwrap();
            let n = cut.index(b.len());
            let res = Packet::new_checked(&b[..n]);
            if n < r.bth.opcode.header_len() + ICRC_LEN {
                let truncated = matches!(res, Err(Error::Truncated { .. }));
                prop_assert!(truncated);
            } else if let Ok(p) = res {
                // A shorter prefix can only be read as a shorter packet of the same kind.
                prop_assert!(p.payload_len() < r.payload.len());
                prop_assert_eq!(n % 4, 0);
            }
        }

        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..96), op in bth::tests::any_opcode()) {
            // As they come, and with a valid opcode and TVer so that more of them get past the
            // first checks.
            let mut fixed = b.clone();
            if let Some(x) = fixed.get_mut(0) {
                *x = op.as_u8();
            }
            if let Some(x) = fixed.get_mut(1) {
                *x &= 0xf0;
            }
            for bytes in [b.clone(), fixed] {
                if let Ok(p) = Packet::new_checked(&bytes[..]) {
                    let _ = (p.payload(), p.pad_bytes(), p.icrc(), p.without_icrc());
                    if let Ok(r) = Repr::parse(&p) {
                        let out = r.to_vec().unwrap();
                        prop_assert_eq!(out.len(), bytes.len());
                        prop_assert_eq!(Repr::parse_bytes(&out).unwrap(), r);
                    }
                }
            }
        }
    }

    #[test]
    fn header_presence_is_enforced() {
        let bth = bth::Repr {
            opcode: Opcode::RcRdmaWriteOnly,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: 0xffff,
            fecn: false,
            becn: false,
            dest_qp: 0x11,
            ack_req: true,
            psn: 5,
        };
        let r = Repr::new(bth, b"abc");
        assert_eq!(
            r.to_vec(),
            Err(Error::HeaderMismatch {
                opcode: 0x0a,
                header: ExtHeader::Reth
            })
        );
        let mut r = r;
        r.reth = Some(reth::Repr {
            va: 1,
            rkey: 2,
            dma_len: 3,
        });
        r.immdt = Some(immdt::Repr { imm: 4 });
        assert_eq!(
            r.to_vec(),
            Err(Error::HeaderMismatch {
                opcode: 0x0a,
                header: ExtHeader::ImmDt
            })
        );
        r.immdt = None;
        let v = r.to_vec().unwrap();
        assert_eq!(v.len(), 12 + 16 + 3 + 1 + 4);
        assert_eq!(v[1] & 0x30, 0x10, "pad count 1");
        let mut small = [0u8; 35];
        assert_eq!(
            r.emit(&mut small),
            Err(Error::Truncated { need: 36, have: 35 })
        );

        let mut ack = Repr::new(
            bth::Repr {
                opcode: Opcode::RcAcknowledge,
                ..bth
            },
            b"x",
        );
        ack.aeth = Some(aeth::Repr {
            syndrome: aeth::Syndrome::ACK_UNLIMITED,
            msn: 0,
        });
        assert_eq!(
            ack.to_vec(),
            Err(Error::UnexpectedPayload {
                opcode: 0x11,
                len: 1
            })
        );
    }

    #[test]
    fn structural_checks() {
        // An ACK with payload bytes, and with a pad count.
        let mut b = vec![
            0x11, 0, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 1, 0x1f, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert!(Packet::new_checked(&b[..]).is_ok());
        b.extend_from_slice(&[0; 4]);
        assert_eq!(
            Packet::new_checked(&b[..]).err(),
            Some(Error::UnexpectedPayload {
                opcode: 0x11,
                len: 4
            })
        );
        b.truncate(20);
        b[1] = 0x10;
        assert_eq!(
            Packet::new_checked(&b[..]).err(),
            Some(Error::BadPad { pad: 1, area: 0 })
        );
        // A SEND whose payload area is not a multiple of four, or smaller than the pad.
        let mut s = vec![
            0x04, 0x30, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 1, 0xaa, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(
            Packet::new_checked(&s[..]).err(),
            Some(Error::BadPad { pad: 3, area: 3 })
        );
        s.push(0);
        let p = Packet::new_checked(&s[..]).unwrap();
        assert_eq!(p.payload(), &[0xaa]);
        assert_eq!(p.pad_bytes(), &[0, 0, 0]);
        s.truncate(16);
        assert_eq!(
            Packet::new_checked(&s[..]).err(),
            Some(Error::BadPad { pad: 3, area: 0 })
        );
        // Empty SEND Only: legal.
        s[1] = 0;
        assert_eq!(Packet::new_checked(&s[..]).unwrap().payload(), &[] as &[u8]);
        // TVer, unknown opcode.
        s[1] = 0x01;
        assert_eq!(
            Packet::new_checked(&s[..]).err(),
            Some(Error::BadTransportVersion(1))
        );
        s[1] = 0;
        s[0] = 0x40;
        assert_eq!(
            Packet::new_checked(&s[..]).err(),
            Some(Error::UnknownOpcode(0x40))
        );
    }
}
