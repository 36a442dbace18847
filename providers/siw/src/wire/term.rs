//! Terminate (RFC 5040 §4.8): the payload of the last FPDU a side sends before its QP
//! goes to Error, and the layer / error type / error code values it carries (RFC 5040
//! §7.4, RFC 5041 §7.2, RFC 5044 §8).
//!
//! | bytes | field |
//! |---|---|
//! | 0 | layer (7..4), error type (3..0) |
//! | 1 | error code |
//! | 2 | HdrCt: M (7) DDP segment length valid, D (6) DDP header included, R (5) RDMAP header included; reserved (4..0) |
//! | 3 | reserved |
//! | 4.. | with D: the header of the segment in error (krdma sends that ULPDU's first 18 bytes at most) |
//!
//! Reserved bits are written as zero and ignored on receive.

use super::Result;
use rnicpi::wire::{rdbits, wrbits, wrflag};

/// Terminate layers.
pub const LAYER_RDMAP: u8 = 0;
pub const LAYER_DDP: u8 = 1;
pub const LAYER_LLP: u8 = 2;
// RDMAP error types.
pub const RDMAP_REMOTE_PROT: u8 = 1;
pub const RDMAP_REMOTE_OP: u8 = 2;
// RDMAP error codes.
pub const RDMAP_INV_STAG: u8 = 0x00;
pub const RDMAP_BASE_BOUNDS: u8 = 0x01;
pub const RDMAP_ACCESS: u8 = 0x02;
pub const RDMAP_STAG_NOT_ASSOC: u8 = 0x03;
pub const RDMAP_INV_VERSION: u8 = 0x05;
pub const RDMAP_UNEXPECTED_OP: u8 = 0x06;
pub const RDMAP_CATASTROPHIC_LOCAL: u8 = 0x07;
pub const RDMAP_CANNOT_INVALIDATE: u8 = 0x09;
// DDP error types and codes (RFC 5041 §7.2).
pub const DDP_CATASTROPHIC: u8 = 0;
pub const DDP_TAGGED_BUF: u8 = 1;
pub const DDP_UNTAGGED_BUF: u8 = 2;
pub const DDP_TAGGED_INV_STAG: u8 = 0x00;
pub const DDP_TAGGED_BASE_BOUNDS: u8 = 0x01;
pub const DDP_UNTAGGED_INV_QN: u8 = 0x01;
pub const DDP_UNTAGGED_NO_BUF: u8 = 0x02;
pub const DDP_UNTAGGED_INV_MSN: u8 = 0x03;
pub const DDP_UNTAGGED_INV_MO: u8 = 0x04;
pub const DDP_UNTAGGED_TOO_LONG: u8 = 0x05;
pub const DDP_INV_VERSION: u8 = 0x06;
// LLP (MPA) error codes (RFC 5044 §8).
pub const LLP_CRC: u8 = 0x02;
pub const LLP_MARKER: u8 = 0x03;
pub const LLP_BAD_FPDU: u8 = 0x04;

mod field {
    /// Layer (7..4), error type (3..0).
    pub const LAYER_ETYPE: usize = 0;
    pub const ECODE: usize = 1;
    /// M (7), D (6), R (5), reserved (4..0).
    pub const HDRCT: usize = 2;
    pub const RESERVED: usize = 3;
    /// The carried header starts here.
    pub const CARRIED: usize = 4;
}

const LAYER_SHIFT: u32 = 4;
const ETYPE_SHIFT: u32 = 0;
const NIBBLE: u32 = 4;
/// M: the DDP segment length is valid.
const SEG_LEN: u8 = 0x80;
/// D: the DDP header of the segment in error follows.
const DDP_HDR: u8 = 0x40;
/// R: the RDMAP header of the message in error follows.
const RDMAP_HDR: u8 = 0x20;

/// Size of the Terminate control field.
pub const HEADER_LEN: usize = field::CARRIED;

/// The error a Terminate reports: layer, error type, error code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TermCode {
    /// 4 bits.
    pub layer: u8,
    /// 4 bits.
    pub etype: u8,
    pub ecode: u8,
}

super::fixed_header_view!(Packet, HEADER_LEN, "a Terminate control field");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn layer(&self) -> u8 {
        rdbits(self.b(), field::LAYER_ETYPE, LAYER_SHIFT, NIBBLE)
    }

    pub fn etype(&self) -> u8 {
        rdbits(self.b(), field::LAYER_ETYPE, ETYPE_SHIFT, NIBBLE)
    }

    pub fn ecode(&self) -> u8 {
        self.b()[field::ECODE]
    }

    /// M: the DDP segment length is valid.
    pub fn seg_len(&self) -> bool {
        self.b()[field::HDRCT] & SEG_LEN != 0
    }

    /// D: the DDP header of the segment in error follows.
    pub fn ddp_hdr(&self) -> bool {
        self.b()[field::HDRCT] & DDP_HDR != 0
    }

    /// R: the RDMAP header of the message in error follows.
    pub fn rdmap_hdr(&self) -> bool {
        self.b()[field::HDRCT] & RDMAP_HDR != 0
    }

    /// The bytes after the control field: the headers HdrCt says are there.
    pub fn carried(&self) -> &[u8] {
        &self.b()[field::CARRIED..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Low four bits of `v`.
    pub fn set_layer(&mut self, v: u8) {
        wrbits(self.bm(), field::LAYER_ETYPE, LAYER_SHIFT, NIBBLE, v);
    }

    /// Low four bits of `v`.
    pub fn set_etype(&mut self, v: u8) {
        wrbits(self.bm(), field::LAYER_ETYPE, ETYPE_SHIFT, NIBBLE, v);
    }

    pub fn set_ecode(&mut self, v: u8) {
        self.bm()[field::ECODE] = v;
    }

    pub fn set_seg_len(&mut self, v: bool) {
        wrflag(self.bm(), field::HDRCT, SEG_LEN, v);
    }

    pub fn set_ddp_hdr(&mut self, v: bool) {
        wrflag(self.bm(), field::HDRCT, DDP_HDR, v);
    }

    pub fn set_rdmap_hdr(&mut self, v: bool) {
        wrflag(self.bm(), field::HDRCT, RDMAP_HDR, v);
    }
}

/// A parsed Terminate control field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    pub code: TermCode,
    /// M: the DDP segment length is valid.
    pub seg_len: bool,
    /// D: the DDP header of the segment in error follows.
    pub ddp_hdr: bool,
    /// R: the RDMAP header of the message in error follows.
    pub rdmap_hdr: bool,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr {
            code: TermCode {
                layer: p.layer(),
                etype: p.etype(),
                ecode: p.ecode(),
            },
            seg_len: p.seg_len(),
            ddp_hdr: p.ddp_hdr(),
            rdmap_hdr: p.rdmap_hdr(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the four bytes (reserved bits zero; layer and error type truncated to four
    /// bits).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.bm()[field::HDRCT] = 0;
        p.bm()[field::RESERVED] = 0;
        p.set_layer(self.code.layer);
        p.set_etype(self.code.etype);
        p.set_ecode(self.code.ecode);
        p.set_seg_len(self.seg_len);
        p.set_ddp_hdr(self.ddp_hdr);
        p.set_rdmap_hdr(self.rdmap_hdr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_repr() -> impl Strategy<Value = Repr> {
        (0u8..16, 0u8..16, any::<u8>(), any::<(bool, bool, bool)>()).prop_map(
            |(layer, etype, ecode, (seg_len, ddp_hdr, rdmap_hdr))| Repr {
                code: TermCode {
                    layer,
                    etype,
                    ecode,
                },
                seg_len,
                ddp_hdr,
                rdmap_hdr,
            },
        )
    }

    crate::wire::header_proptests!(Packet, Repr, HEADER_LEN, any_repr());

    #[test]
    fn layout() {
        let mut b = [0xffu8; 6];
        let r = Repr {
            code: TermCode {
                layer: LAYER_DDP,
                etype: DDP_UNTAGGED_BUF,
                ecode: DDP_UNTAGGED_INV_QN,
            },
            ddp_hdr: true,
            ..Repr::default()
        };
        let mut p = Packet::new_checked(&mut b[..]).unwrap();
        r.emit(&mut p);
        assert_eq!(p.carried(), [0xff, 0xff]);
        assert_eq!(b, [0x12, 0x01, 0x40, 0x00, 0xff, 0xff]);
        b[2] = 0xbf; // M and R, and reserved bits
        let p = Packet::new_checked(&b[..]).unwrap();
        let back = Repr::parse(&p).unwrap();
        assert_eq!(back.code, r.code);
        assert!(back.seg_len && !back.ddp_hdr && back.rdmap_hdr);
    }
}
