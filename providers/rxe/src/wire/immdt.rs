//! Immediate Data Extended Transport Header (IBTA 9.3.4), 4 bytes: carried by the "with
//! immediate" Send and RDMA WRITE opcodes.
//!
//! The 32 bits are opaque to the transport. [`Repr::imm`] reads them big-endian, so it is the
//! value verbs shows as `be32toh(wc.imm_data)`.

use super::Result;
use rnicpi::wire::{rd32, wr32};

/// Size of the ImmDt.
pub const HEADER_LEN: usize = 4;

super::fixed_header_view!(HEADER_LEN, "an ImmDt header");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn imm(&self) -> u32 {
        rd32(self.b(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_imm(&mut self, v: u32) {
        wr32(self.bm(), 0, v);
    }
}

/// A parsed ImmDt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Repr {
    pub imm: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr { imm: p.imm() })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_imm(self.imm);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        any::<u32>().prop_map(|imm| Repr { imm })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn layout_and_boundaries() {
        for imm in [0, 1, 0x1234_5678, u32::MAX] {
            let mut b = [0u8; HEADER_LEN];
            Repr { imm }.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
            assert_eq!(b, imm.to_be_bytes());
            assert_eq!(
                Repr::parse(&Packet::new_checked(&b[..]).unwrap()),
                Ok(Repr { imm })
            );
        }
    }
}
