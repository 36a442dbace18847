//! MPA Request and Reply (RFC 5044 §7.1), with the enhanced connection set-up of RFC 6581:
//! the frames the two sides exchange on a new TCP connection before any FPDU.
//!
//! | bytes | field |
//! |---|---|
//! | 0..16 | key: `MPA ID Req Frame` / `MPA ID Rep Frame` |
//! | 16 | flags: M markers (7), C CRC (6), R reject (5), enhanced (4; RFC 6581's, in bits RFC 5044 reserves, as kernel siw sets it), reserved (3..0) |
//! | 17 | revision: 1, or 2 for RFC 6581 |
//! | 18..20 | private data length (at most 512) |
//! | 20..22 | revision 2 with the enhanced flag: IRD word — peer-to-peer (15), zero-length Send RTR (14), IRD (13..0) |
//! | 22..24 | and ORD word — zero-length Write RTR (15), zero-length Read RTR (14), ORD (13..0) |
//! | 20.. or 24.. | the consumer's private data |
//!
//! [`Packet`] views the 20-byte header (and reaches the private data when the buffer holds
//! it), [`Repr`] is that header, and [`Frame`] a whole Request or Reply as the connection
//! manager sends and receives it. Reserved flag bits are written as zero and ignored on
//! receive.

use super::{Error, Result};
use rnicpi::wire::{check_len, rd16, wr16, wrflag};

/// The key of an MPA Request.
pub const KEY_REQ: &[u8; 16] = b"MPA ID Req Frame";
/// The key of an MPA Reply.
pub const KEY_REP: &[u8; 16] = b"MPA ID Rep Frame";
/// Flag: markers (kernel siw never negotiates them; krdma refuses them).
pub const MARKERS: u8 = 0x80;
/// Flag: CRC32c in every FPDU.
pub const CRC: u8 = 0x40;
/// Flag: the Reply rejects the connection.
pub const REJECT: u8 = 0x20;
/// Flag: Linux siw's "enhanced connection set-up" (the RFC 6581 IRD/ORD words are present).
pub const ENHANCED: u8 = 0x10;
/// The most private data a frame carries (the RFC 6581 words included).
pub const MAX_PRIVATE_DATA: usize = 512;
/// RFC 6581 control bits: in the IRD word, peer-to-peer and zero-length Send
/// ready-to-receive; in the ORD word, zero-length Write and Read ready-to-receive.
pub const IRD_P2P: u16 = 0x8000;
pub const IRD_RTR_SEND: u16 = 0x4000;
pub const ORD_RTR_WRITE: u16 = 0x8000;
pub const ORD_RTR_READ: u16 = 0x4000;
/// The private data a consumer may send: a revision 2 frame's, less the IRD/ORD words.
pub const MAX_CONSUMER_PRIVATE_DATA: usize = MAX_PRIVATE_DATA - IRD_ORD_LEN;
/// The IRD or ORD value in its word, without the control bits.
pub const IRD_ORD_MASK: u16 = 0x3fff;

mod field {
    use rnicpi::wire::Field;

    pub const KEY: Field = 0..16;
    pub const FLAGS: usize = 16;
    pub const REVISION: usize = 17;
    pub const PD_LENGTH: Field = 18..20;
    /// The private data starts here; with RFC 6581, with the IRD and ORD words.
    pub const PRIVATE_DATA: usize = 20;
    pub const IRD: Field = 20..22;
    pub const ORD: Field = 22..24;
}

/// Size of the fixed header.
pub const HEADER_LEN: usize = field::PRIVATE_DATA;
/// Size of the RFC 6581 IRD and ORD words.
pub const IRD_ORD_LEN: usize = field::ORD.end - field::IRD.start;

super::fixed_header_view!(Packet, HEADER_LEN, "an MPA Request or Reply");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The 16-byte key.
    pub fn key(&self) -> &[u8] {
        &self.b()[field::KEY]
    }

    pub fn markers(&self) -> bool {
        self.b()[field::FLAGS] & MARKERS != 0
    }

    pub fn crc(&self) -> bool {
        self.b()[field::FLAGS] & CRC != 0
    }

    pub fn reject(&self) -> bool {
        self.b()[field::FLAGS] & REJECT != 0
    }

    /// The enhanced flag, whatever the revision (it means the IRD/ORD words in revision 2).
    pub fn enhanced(&self) -> bool {
        self.b()[field::FLAGS] & ENHANCED != 0
    }

    pub fn revision(&self) -> u8 {
        self.b()[field::REVISION]
    }

    /// Private data length, as announced.
    pub fn pd_length(&self) -> u16 {
        rd16(self.b(), field::PD_LENGTH)
    }

    /// Bytes of the whole frame: the header and the private data it announces.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.pd_length() as usize
    }

    /// The private data (the RFC 6581 words included); `Truncated` while the buffer ends
    /// before it does.
    pub fn private_data(&self) -> Result<&[u8]> {
        let end = self.frame_len();
        check_len(end, self.b().len())?;
        Ok(&self.b()[field::PRIVATE_DATA..end])
    }

    /// The RFC 6581 IRD and ORD words, control bits included; `BadLength` when the
    /// private data is too short to hold them.
    pub fn ird_ord(&self) -> Result<(u16, u16)> {
        if (self.pd_length() as usize) < IRD_ORD_LEN {
            return Err(Error::BadLength);
        }
        check_len(field::ORD.end, self.b().len())?;
        Ok((rd16(self.b(), field::IRD), rd16(self.b(), field::ORD)))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// The Reply's key if `reply`, else the Request's.
    pub fn set_key(&mut self, reply: bool) {
        self.bm()[field::KEY].copy_from_slice(if reply { KEY_REP } else { KEY_REQ });
    }

    pub fn set_markers(&mut self, v: bool) {
        wrflag(self.bm(), field::FLAGS, MARKERS, v);
    }

    pub fn set_crc(&mut self, v: bool) {
        wrflag(self.bm(), field::FLAGS, CRC, v);
    }

    pub fn set_reject(&mut self, v: bool) {
        wrflag(self.bm(), field::FLAGS, REJECT, v);
    }

    pub fn set_enhanced(&mut self, v: bool) {
        wrflag(self.bm(), field::FLAGS, ENHANCED, v);
    }

    pub fn set_revision(&mut self, v: u8) {
        self.bm()[field::REVISION] = v;
    }

    pub fn set_pd_length(&mut self, v: u16) {
        wr16(self.bm(), field::PD_LENGTH, v);
    }

    /// Store the RFC 6581 IRD and ORD words; `Truncated` when the buffer cannot hold them.
    pub fn set_ird_ord(&mut self, ird: u16, ord: u16) -> Result<()> {
        check_len(field::ORD.end, self.b().len())?;
        wr16(self.bm(), field::IRD, ird);
        wr16(self.bm(), field::ORD, ord);
        Ok(())
    }
}

/// The 20-byte header of an MPA Request or Reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    pub reply: bool,
    pub markers: bool,
    pub crc: bool,
    pub reject: bool,
    /// The enhanced flag as sent; [`Frame`] takes it to mean the IRD/ORD words in
    /// revision 2 only.
    pub enhanced: bool,
    pub revision: u8,
    /// At most [`MAX_PRIVATE_DATA`].
    pub pd_length: u16,
}

impl Repr {
    /// Parse; refuses an unknown key, a revision other than 1 or 2, and private data over
    /// 512 bytes (in that order, before any private data need have arrived).
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        let reply = match p.key() {
            k if k == KEY_REQ => false,
            k if k == KEY_REP => true,
            _ => return Err(Error::BadKey),
        };
        let revision = p.revision();
        if !(1..=2).contains(&revision) {
            return Err(Error::BadRevision(revision));
        }
        if p.pd_length() as usize > MAX_PRIVATE_DATA {
            return Err(Error::PrivateDataTooLong);
        }
        Ok(Repr {
            reply,
            markers: p.markers(),
            crc: p.crc(),
            reject: p.reject(),
            enhanced: p.enhanced(),
            revision,
            pd_length: p.pd_length(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the 20 bytes (reserved flag bits zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_key(self.reply);
        p.bm()[field::FLAGS] = 0;
        p.set_markers(self.markers);
        p.set_crc(self.crc);
        p.set_reject(self.reject);
        p.set_enhanced(self.enhanced);
        p.set_revision(self.revision);
        p.set_pd_length(self.pd_length);
    }
}

/// A whole MPA Request or Reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub reply: bool,
    pub markers: bool,
    pub crc: bool,
    pub reject: bool,
    pub revision: u8,
    /// RFC 6581 IRD/ORD (with control bits) when the enhanced flag is set.
    pub ird_ord: Option<(u16, u16)>,
    /// Consumer private data (without the RFC 6581 words).
    pub private_data: Vec<u8>,
}

impl Frame {
    /// Parse a whole frame: the header's checks, then `Truncated` until all the private
    /// data is there, then the IRD/ORD words of an enhanced revision 2 frame. The frame
    /// is [`buffer_len`](Self::buffer_len) bytes long.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Frame> {
        let h = Repr::parse(p)?;
        let pd = p.private_data()?;
        let (ird_ord, private_data) = if h.revision == 2 && h.enhanced {
            (Some(p.ird_ord()?), pd[IRD_ORD_LEN..].to_vec())
        } else {
            (None, pd.to_vec())
        };
        Ok(Frame {
            reply: h.reply,
            markers: h.markers,
            crc: h.crc,
            reject: h.reject,
            revision: h.revision,
            ird_ord,
            private_data,
        })
    }

    /// [`Packet::new_checked`] then [`Frame::parse`].
    pub fn parse_bytes(b: &[u8]) -> Result<Frame> {
        Frame::parse(&Packet::new_checked(b)?)
    }

    /// Private data length on the wire: the RFC 6581 words and the consumer's bytes.
    fn pd_length(&self) -> usize {
        self.ird_ord.map_or(0, |_| IRD_ORD_LEN) + self.private_data.len()
    }

    /// The frame's header.
    pub fn header(&self) -> Repr {
        Repr {
            reply: self.reply,
            markers: self.markers,
            crc: self.crc,
            reject: self.reject,
            enhanced: self.ird_ord.is_some(),
            revision: self.revision,
            pd_length: self.pd_length().min(u16::MAX as usize) as u16,
        }
    }

    /// Bytes [`emit`](Self::emit) writes (and a parsed frame took).
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + self.pd_length()
    }

    /// Write the frame to the start of `p`'s buffer, which must hold
    /// [`buffer_len`](Self::buffer_len) bytes. Sets the enhanced flag when there are
    /// IRD/ORD words.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        if self.pd_length() > MAX_PRIVATE_DATA {
            return Err(Error::PrivateDataTooLong);
        }
        check_len(self.buffer_len(), p.b().len())?;
        self.header().emit(p);
        let mut at = field::PRIVATE_DATA;
        if let Some((ird, ord)) = self.ird_ord {
            p.set_ird_ord(ird, ord)?;
            at = field::ORD.end;
        }
        p.bm()[at..self.buffer_len()].copy_from_slice(&self.private_data);
        Ok(())
    }

    /// [`emit`](Self::emit) into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut Packet::new_unchecked(&mut v[..]))?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Truncated;
    use proptest::prelude::*;

    fn any_repr() -> impl Strategy<Value = Repr> {
        (any::<(bool, bool, bool, bool, bool)>(), 1u8..=2, 0..=512u16).prop_map(
            |((reply, markers, crc, reject, enhanced), revision, pd_length)| Repr {
                reply,
                markers,
                crc,
                reject,
                enhanced,
                revision,
                pd_length,
            },
        )
    }

    fn any_frame() -> impl Strategy<Value = Frame> {
        (
            any::<(bool, bool, bool, bool)>(),
            1u8..=2,
            proptest::option::of(any::<(u16, u16)>()),
            proptest::collection::vec(any::<u8>(), 0..=MAX_PRIVATE_DATA - IRD_ORD_LEN),
        )
            .prop_map(
                |((reply, markers, crc, reject), revision, ird_ord, private_data)| Frame {
                    reply,
                    markers,
                    crc,
                    reject,
                    revision,
                    // Revision 1 has no IRD/ORD words.
                    ird_ord: ird_ord.filter(|_| revision == 2),
                    private_data,
                },
            )
    }

    mod header {
        use super::*;
        crate::wire::header_proptests!(Packet, Repr, HEADER_LEN, any_repr());
    }

    #[test]
    fn kernel_siw_request_bytes() {
        // The MPA Request kernel siw sent in rping_siw_crc.pcap (flags 0x50, rev 2, IRD/ORD 1/1).
        let f = Frame {
            reply: false,
            markers: false,
            crc: true,
            reject: false,
            revision: 2,
            ird_ord: Some((1, 1)),
            private_data: vec![],
        };
        let out = f.to_vec().unwrap();
        assert_eq!(&out[..16], KEY_REQ);
        assert_eq!(
            &out[16..],
            &[0x50, 0x02, 0x00, 0x04, 0x00, 0x01, 0x00, 0x01]
        );
        let p = Packet::new_checked(&out[..]).unwrap();
        assert_eq!((p.frame_len(), p.ird_ord()), (24, Ok((1, 1))));
        assert_eq!(Frame::parse(&p).unwrap(), f);
        assert_eq!(f.buffer_len(), 24);
        assert_eq!(
            Frame::parse_bytes(&out[..23]),
            Err(Error::Truncated(Truncated { need: 24, have: 23 }))
        );
    }

    #[test]
    fn the_header_is_judged_before_the_private_data_arrives() {
        let mut b = Frame {
            reply: true,
            markers: false,
            crc: false,
            reject: false,
            revision: 2,
            ird_ord: None,
            private_data: vec![7; 10],
        }
        .to_vec()
        .unwrap();
        b[17] = 3;
        assert_eq!(Frame::parse_bytes(&b[..20]), Err(Error::BadRevision(3)));
        b[17] = 2;
        b[18..20].copy_from_slice(&513u16.to_be_bytes());
        assert_eq!(Frame::parse_bytes(&b[..20]), Err(Error::PrivateDataTooLong));
        b[0] = b'X';
        assert_eq!(Frame::parse_bytes(&b[..20]), Err(Error::BadKey));
        // Enhanced revision 2 with private data too short for the IRD/ORD words.
        let mut short = Repr {
            enhanced: true,
            revision: 2,
            pd_length: 3,
            ..Repr::default()
        };
        let mut b = vec![0u8; 23];
        short.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
        assert_eq!(Frame::parse_bytes(&b), Err(Error::BadLength));
        short.revision = 1;
        short.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
        assert_eq!(Frame::parse_bytes(&b).unwrap().private_data, [0; 3]);
    }

    #[test]
    fn too_much_private_data_is_not_emitted() {
        let f = Frame {
            reply: false,
            markers: false,
            crc: false,
            reject: false,
            revision: 2,
            ird_ord: Some((1, 1)),
            private_data: vec![0; MAX_PRIVATE_DATA - IRD_ORD_LEN + 1],
        };
        assert_eq!(f.to_vec(), Err(Error::PrivateDataTooLong));
    }

    proptest! {
        #[test]
        fn frame_round_trip(f in any_frame(), tail in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut b = f.to_vec().unwrap();
            prop_assert_eq!(b.len(), f.buffer_len());
            b.extend_from_slice(&tail);
            let p = Packet::new_checked(&b[..]).unwrap();
            prop_assert_eq!(p.frame_len(), f.buffer_len());
            prop_assert_eq!(Frame::parse(&p).unwrap(), f);
        }

        #[test]
        fn a_frame_cut_short_is_truncated(f in any_frame(), cut in any::<prop::sample::Index>()) {
            let b = f.to_vec().unwrap();
            let len = cut.index(b.len());
            prop_assert_eq!(
                Frame::parse_bytes(&b[..len]),
                Err(Error::Truncated(Truncated { need: if len < HEADER_LEN { HEADER_LEN } else { b.len() }, have: len }))
            );
        }

        #[test]
        fn random_frames_never_panic(b in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(f) = Frame::parse_bytes(&b) {
                let out = f.to_vec().unwrap();
                prop_assert_eq!(Frame::parse_bytes(&out).unwrap(), f);
            }
        }
    }
}
