//! DDP segment headers (RFC 5041 §4): the tagged buffer model's (14 bytes) and the
//! untagged one's (18 bytes), told apart by the control byte's T bit. RDMAP, the one ULP
//! here, keeps its control byte in the byte DDP reserves for the ULP, and an untagged
//! message's Invalidate STag in the 32 bits after it ([`super::rdmap`]).
//!
//! | bytes | tagged | untagged |
//! |---|---|---|
//! | 0 | control: T (7) = 1, L last (6), reserved (5..2), DV version (1..0) | control: T = 0, L, reserved, DV |
//! | 1 | reserved for the ULP (RDMAP control) | reserved for the ULP (RDMAP control) |
//! | 2..6 | STag | reserved for the ULP (RDMAP: Invalidate STag) |
//! | 6..10 | tagged offset (8 bytes, to 14) | queue number |
//! | 10..14 | | message sequence number |
//! | 14..18 | | message offset |
//!
//! Reserved bits are written as zero and ignored on receive.

use super::{Error, Result};
use rnicpi::wire::{rd32, rd64, rdbits, wr32, wr64, wrbits, wrflag};

/// The DDP version this implementation speaks (and the only one there is).
pub const VERSION: u8 = 1;

pub(crate) mod field {
    use rnicpi::wire::Field;

    /// T (7), L (6), reserved (5..2), DV (1..0).
    pub const CONTROL: usize = 0;
    /// The first byte reserved for the ULP: RDMAP's control byte.
    pub const ULP_CTRL: usize = 1;
    // Tagged buffer model.
    pub const STAG: Field = 2..6;
    pub const TO: Field = 6..14;
    // Untagged buffer model.
    /// The other 32 bits reserved for the ULP: RDMAP's Invalidate STag.
    pub const ULP_WORD: Field = 2..6;
    pub const QN: Field = 6..10;
    pub const MSN: Field = 10..14;
    pub const MO: Field = 14..18;
}

/// T: the tagged buffer model.
pub(crate) const TAGGED: u8 = 0x80;
/// L: the last segment of a message.
pub(crate) const LAST: u8 = 0x40;
/// DV: bits 1..0 of the control byte.
pub(crate) const DV_SHIFT: u32 = 0;
pub(crate) const DV_WIDTH: u32 = 2;

/// Size of a tagged DDP header.
pub const TAGGED_HEADER_LEN: usize = field::TO.end;
/// Size of an untagged DDP header.
pub const UNTAGGED_HEADER_LEN: usize = field::MO.end;

/// The DDP header length of the model the control byte `ctrl` announces.
pub const fn header_len(ctrl: u8) -> usize {
    if ctrl & TAGGED != 0 {
        TAGGED_HEADER_LEN
    } else {
        UNTAGGED_HEADER_LEN
    }
}

/// The buffer model of a segment and its fields, typed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Model {
    /// Placed at a tagged offset of the buffer an STag names (RDMA Write, Read Response).
    Tagged { stag: u32, to: u64 },
    /// Placed in the next buffer of a queue (Send, Read Request, Terminate), at message
    /// offset `mo` of message `msn`. `inv_stag` is RDMAP's (Send with Invalidate).
    Untagged {
        inv_stag: u32,
        qn: u32,
        msn: u32,
        mo: u32,
    },
}

impl Model {
    pub const fn is_tagged(&self) -> bool {
        matches!(self, Model::Tagged { .. })
    }

    /// Size of this model's DDP header.
    pub const fn header_len(&self) -> usize {
        match self {
            Model::Tagged { .. } => TAGGED_HEADER_LEN,
            Model::Untagged { .. } => UNTAGGED_HEADER_LEN,
        }
    }
}

super::fixed_header_view!(TaggedPacket, TAGGED_HEADER_LEN, "a tagged DDP header");
super::fixed_header_view!(
    UntaggedPacket,
    UNTAGGED_HEADER_LEN,
    "an untagged DDP header"
);

/// The control byte and the ULP's byte, which both headers begin with.
macro_rules! control_accessors {
    ($view:ident, $tagged:expr) => {
        impl<T: AsRef<[u8]>> $view<T> {
            /// T: the header is of the tagged buffer model.
            pub fn tagged(&self) -> bool {
                self.b()[field::CONTROL] & TAGGED != 0
            }

            /// L: the last segment of its message.
            pub fn last(&self) -> bool {
                self.b()[field::CONTROL] & LAST != 0
            }

            /// DV: the DDP version.
            pub fn version(&self) -> u8 {
                rdbits(self.b(), field::CONTROL, DV_SHIFT, DV_WIDTH)
            }

            /// The byte reserved for the ULP (RDMAP's control byte).
            pub fn ulp_ctrl(&self) -> u8 {
                self.b()[field::ULP_CTRL]
            }
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $view<T> {
            /// Write the control byte: T as this view's model, L, version 1, reserved zero.
            fn set_control(&mut self, last: bool) {
                let b = self.bm();
                b[field::CONTROL] = 0;
                wrflag(b, field::CONTROL, TAGGED, $tagged);
                wrflag(b, field::CONTROL, LAST, last);
                wrbits(b, field::CONTROL, DV_SHIFT, DV_WIDTH, VERSION);
            }

            pub fn set_ulp_ctrl(&mut self, v: u8) {
                self.bm()[field::ULP_CTRL] = v;
            }
        }
    };
}

control_accessors!(TaggedPacket, true);
control_accessors!(UntaggedPacket, false);

impl<T: AsRef<[u8]>> TaggedPacket<T> {
    pub fn stag(&self) -> u32 {
        rd32(self.b(), field::STAG)
    }

    pub fn to(&self) -> u64 {
        rd64(self.b(), field::TO)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> TaggedPacket<T> {
    pub fn set_stag(&mut self, v: u32) {
        wr32(self.bm(), field::STAG, v);
    }

    pub fn set_to(&mut self, v: u64) {
        wr64(self.bm(), field::TO, v);
    }
}

impl<T: AsRef<[u8]>> UntaggedPacket<T> {
    /// The 32 bits reserved for the ULP (RDMAP's Invalidate STag).
    pub fn ulp_word(&self) -> u32 {
        rd32(self.b(), field::ULP_WORD)
    }

    pub fn qn(&self) -> u32 {
        rd32(self.b(), field::QN)
    }

    pub fn msn(&self) -> u32 {
        rd32(self.b(), field::MSN)
    }

    pub fn mo(&self) -> u32 {
        rd32(self.b(), field::MO)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> UntaggedPacket<T> {
    pub fn set_ulp_word(&mut self, v: u32) {
        wr32(self.bm(), field::ULP_WORD, v);
    }

    pub fn set_qn(&mut self, v: u32) {
        wr32(self.bm(), field::QN, v);
    }

    pub fn set_msn(&mut self, v: u32) {
        wr32(self.bm(), field::MSN, v);
    }

    pub fn set_mo(&mut self, v: u32) {
        wr32(self.bm(), field::MO, v);
    }
}

/// `BadDdpVersion` unless DV is 1, `ModelMismatch` unless T is `tagged`.
fn check_control(version: u8, t: bool, tagged: bool) -> Result<()> {
    if version != VERSION {
        Err(Error::BadDdpVersion)
    } else if t != tagged {
        Err(Error::ModelMismatch)
    } else {
        Ok(())
    }
}

/// A parsed tagged DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TaggedRepr {
    pub last: bool,
    pub ulp_ctrl: u8,
    pub stag: u32,
    pub to: u64,
}

impl TaggedRepr {
    /// Parse; refuses a DDP version other than 1 and a clear T bit.
    pub fn parse<T: AsRef<[u8]>>(p: &TaggedPacket<T>) -> Result<TaggedRepr> {
        check_control(p.version(), p.tagged(), true)?;
        Ok(TaggedRepr {
            last: p.last(),
            ulp_ctrl: p.ulp_ctrl(),
            stag: p.stag(),
            to: p.to(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        TAGGED_HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut TaggedPacket<T>) {
        p.set_control(self.last);
        p.set_ulp_ctrl(self.ulp_ctrl);
        p.set_stag(self.stag);
        p.set_to(self.to);
    }
}

/// A parsed untagged DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct UntaggedRepr {
    pub last: bool,
    pub ulp_ctrl: u8,
    pub ulp_word: u32,
    pub qn: u32,
    pub msn: u32,
    pub mo: u32,
}

impl UntaggedRepr {
    /// Parse; refuses a DDP version other than 1 and a set T bit.
    pub fn parse<T: AsRef<[u8]>>(p: &UntaggedPacket<T>) -> Result<UntaggedRepr> {
        check_control(p.version(), p.tagged(), false)?;
        Ok(UntaggedRepr {
            last: p.last(),
            ulp_ctrl: p.ulp_ctrl(),
            ulp_word: p.ulp_word(),
            qn: p.qn(),
            msn: p.msn(),
            mo: p.mo(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        UNTAGGED_HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut UntaggedPacket<T>) {
        p.set_control(self.last);
        p.set_ulp_ctrl(self.ulp_ctrl);
        p.set_ulp_word(self.ulp_word);
        p.set_qn(self.qn);
        p.set_msn(self.msn);
        p.set_mo(self.mo);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_tagged() -> impl Strategy<Value = TaggedRepr> {
        any::<(bool, u8, u32, u64)>().prop_map(|(last, ulp_ctrl, stag, to)| TaggedRepr {
            last,
            ulp_ctrl,
            stag,
            to,
        })
    }

    fn any_untagged() -> impl Strategy<Value = UntaggedRepr> {
        any::<(bool, u8, u32, u32, u32, u32)>().prop_map(
            |(last, ulp_ctrl, ulp_word, qn, msn, mo)| UntaggedRepr {
                last,
                ulp_ctrl,
                ulp_word,
                qn,
                msn,
                mo,
            },
        )
    }

    mod tagged {
        use super::*;
        crate::wire::header_proptests!(TaggedPacket, TaggedRepr, TAGGED_HEADER_LEN, any_tagged());
    }

    mod untagged {
        use super::*;
        crate::wire::header_proptests!(
            UntaggedPacket,
            UntaggedRepr,
            UNTAGGED_HEADER_LEN,
            any_untagged()
        );
    }

    #[test]
    fn layouts() {
        let mut b = [0u8; TAGGED_HEADER_LEN];
        TaggedRepr {
            last: true,
            ulp_ctrl: 0x42,
            stag: 0x0102_0304,
            to: 0x0506_0708_090a_0b0c,
        }
        .emit(&mut TaggedPacket::new_checked(&mut b[..]).unwrap());
        assert_eq!(b, [0xc1, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let mut b = [0xffu8; UNTAGGED_HEADER_LEN];
        UntaggedRepr {
            last: false,
            ulp_ctrl: 0x43,
            ulp_word: 0x0102_0304,
            qn: 0x0506_0708,
            msn: 0x090a_0b0c,
            mo: 0x0d0e_0f10,
        }
        .emit(&mut UntaggedPacket::new_checked(&mut b[..]).unwrap());
        assert_eq!(
            b,
            [0x01, 0x43, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
        );
        assert_eq!((header_len(0x81), header_len(0x01)), (14, 18));
    }

    #[test]
    fn version_and_model_are_checked() {
        let mut b = [0u8; UNTAGGED_HEADER_LEN];
        b[0] = 0x3d; // reserved bits set, version 1: accepted
        assert!(UntaggedRepr::parse(&UntaggedPacket::new_checked(&b[..]).unwrap()).is_ok());
        b[0] = 0x02;
        assert_eq!(
            UntaggedRepr::parse(&UntaggedPacket::new_checked(&b[..]).unwrap()),
            Err(Error::BadDdpVersion)
        );
        b[0] = 0x81;
        assert_eq!(
            UntaggedRepr::parse(&UntaggedPacket::new_checked(&b[..]).unwrap()),
            Err(Error::ModelMismatch)
        );
        assert!(TaggedRepr::parse(&TaggedPacket::new_checked(&b[..]).unwrap()).is_ok());
    }
}
