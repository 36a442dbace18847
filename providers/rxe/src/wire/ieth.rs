//! Invalidate Extended Transport Header (IBTA 9.3.5), 4 bytes: the R_Key that SEND with
//! Invalidate asks the responder to invalidate.

use super::Result;
use rnicpi::wire::{rd32, wr32};

/// Size of the IETH.
pub const HEADER_LEN: usize = 4;

super::fixed_header_view!(HEADER_LEN, "an IETH");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn rkey(&self) -> u32 {
        rd32(self.b(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_rkey(&mut self, v: u32) {
        wr32(self.bm(), 0, v);
    }
}

/// A parsed IETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Repr {
    pub rkey: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr { rkey: p.rkey() })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_rkey(self.rkey);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        any::<u32>().prop_map(|rkey| Repr { rkey })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn layout_and_boundaries() {
        for rkey in [0, 0x1234_5678, u32::MAX] {
            let mut b = [0u8; HEADER_LEN];
            Repr { rkey }.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
            assert_eq!(b, rkey.to_be_bytes());
            assert_eq!(
                Repr::parse(&Packet::new_checked(&b[..]).unwrap()),
                Ok(Repr { rkey })
            );
        }
    }
}
