//! Management datagram common header (IBTA 13.4.2), 24 bytes, at the start of every MAD.
//! A MAD is 256 bytes and travels as the payload of a UD SEND Only to QP1 (the GSI), with a
//! DETH carrying Q_Key [`GSI_QKEY`](super::deth::GSI_QKEY).
//!
//! | bytes | field |
//! |---|---|
//! | 0 | base version (1) |
//! | 1 | management class (0x07: communication management) |
//! | 2 | class version (2 for CM) |
//! | 3 | method (R bit 0x80 marks a response) |
//! | 4..6 | status |
//! | 6..8 | class specific |
//! | 8..16 | transaction ID |
//! | 16..18 | attribute ID |
//! | 18..20 | reserved |
//! | 20..24 | attribute modifier |

use super::{Error, Result};
use rnicpi::wire::{rd16, rd32, rd64, wr16, wr32, wr64};

/// Size of the common header.
pub const HEADER_LEN: usize = 24;
/// Size of a whole MAD.
pub const MAD_LEN: usize = 256;
/// Bytes after the common header.
pub const DATA_LEN: usize = MAD_LEN - HEADER_LEN;
/// The only base version.
pub const BASE_VERSION: u8 = 1;
/// Management class of the communication manager.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// CM class version.
pub const CM_CLASS_VERSION: u8 = 2;

/// Common MAD methods.
pub mod method {
    pub const GET: u8 = 0x01;
    pub const SET: u8 = 0x02;
    /// What the CM uses for all its messages.
    pub const SEND: u8 = 0x03;
    pub const GET_RESP: u8 = 0x81;
}

super::fixed_header_view!(HEADER_LEN, "a MAD common header");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn base_version(&self) -> u8 {
        self.b()[0]
    }

    pub fn mgmt_class(&self) -> u8 {
        self.b()[1]
    }

    pub fn class_version(&self) -> u8 {
        self.b()[2]
    }

    pub fn method(&self) -> u8 {
        self.b()[3]
    }

    pub fn status(&self) -> u16 {
        rd16(self.b(), 4)
    }

    pub fn class_specific(&self) -> u16 {
        rd16(self.b(), 6)
    }

    pub fn transaction_id(&self) -> u64 {
        rd64(self.b(), 8)
    }

    pub fn attribute_id(&self) -> u16 {
        rd16(self.b(), 16)
    }

    pub fn attribute_modifier(&self) -> u32 {
        rd32(self.b(), 20)
    }

    /// The bytes after the header (232 in a whole MAD).
    pub fn data(&self) -> &[u8] {
        &self.b()[HEADER_LEN..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_base_version(&mut self, v: u8) {
        self.bm()[0] = v;
    }

    pub fn set_mgmt_class(&mut self, v: u8) {
        self.bm()[1] = v;
    }

    pub fn set_class_version(&mut self, v: u8) {
        self.bm()[2] = v;
    }

    pub fn set_method(&mut self, v: u8) {
        self.bm()[3] = v;
    }

    pub fn set_status(&mut self, v: u16) {
        wr16(self.bm(), 4, v);
    }

    pub fn set_class_specific(&mut self, v: u16) {
        wr16(self.bm(), 6, v);
    }

    pub fn set_transaction_id(&mut self, v: u64) {
        wr64(self.bm(), 8, v);
    }

    pub fn set_attribute_id(&mut self, v: u16) {
        wr16(self.bm(), 16, v);
    }

    pub fn set_attribute_modifier(&mut self, v: u32) {
        wr32(self.bm(), 20, v);
    }

    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.bm()[HEADER_LEN..]
    }
}

/// A parsed MAD common header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    pub mgmt_class: u8,
    pub class_version: u8,
    pub method: u8,
    pub status: u16,
    pub class_specific: u16,
    pub transaction_id: u64,
    pub attribute_id: u16,
    pub attribute_modifier: u32,
}

impl Repr {
    /// Parse; refuses a base version other than 1.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        if p.base_version() != BASE_VERSION {
            return Err(Error::BadMadVersion(p.base_version()));
        }
        Ok(Repr {
            mgmt_class: p.mgmt_class(),
            class_version: p.class_version(),
            method: p.method(),
            status: p.status(),
            class_specific: p.class_specific(),
            transaction_id: p.transaction_id(),
            attribute_id: p.attribute_id(),
            attribute_modifier: p.attribute_modifier(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the 24 header bytes (base version 1, reserved zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_base_version(BASE_VERSION);
        p.set_mgmt_class(self.mgmt_class);
        p.set_class_version(self.class_version);
        p.set_method(self.method);
        p.set_status(self.status);
        p.set_class_specific(self.class_specific);
        p.set_transaction_id(self.transaction_id);
        p.set_attribute_id(self.attribute_id);
        wr16(p.bm(), 18, 0);
        p.set_attribute_modifier(self.attribute_modifier);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        (
            any::<(u8, u8, u8)>(),
            any::<(u16, u16)>(),
            any::<u64>(),
            any::<u16>(),
            any::<u32>(),
        )
            .prop_map(|((c, v, m), (s, cs), tid, id, modi)| Repr {
                mgmt_class: c,
                class_version: v,
                method: m,
                status: s,
                class_specific: cs,
                transaction_id: tid,
                attribute_id: id,
                attribute_modifier: modi,
            })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn captured_cm_req_header() {
        // rping_rxe.pcap, CM REQ.
        let b = super::super::icrc::tests::hex("010702030000000000000002affcd78b0010000000000000");
        let r = Repr::parse(&Packet::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            Repr {
                mgmt_class: MGMT_CLASS_CM,
                class_version: CM_CLASS_VERSION,
                method: method::SEND,
                status: 0,
                class_specific: 0,
                transaction_id: 0x0000_0002_affc_d78b,
                attribute_id: 0x0010,
                attribute_modifier: 0,
            }
        );
        let mut o = [0xffu8; HEADER_LEN];
        r.emit(&mut Packet::new_checked(&mut o[..]).unwrap());
        assert_eq!(&o[..], &b[..]);
        let mut bad = b.clone();
        bad[0] = 2;
        assert_eq!(
            Repr::parse(&Packet::new_checked(&bad[..]).unwrap()),
            Err(Error::BadMadVersion(2))
        );
    }
}
