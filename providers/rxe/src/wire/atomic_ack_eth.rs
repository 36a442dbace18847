//! Atomic Acknowledge Extended Transport Header (IBTA 9.3.7), 8 bytes: the value the
//! target held before the atomic operation. Follows the AETH in ATOMIC ACKNOWLEDGE.

use super::Result;
use rnicpi::wire::{rd64, wr64};

/// Size of the AtomicAckETH.
pub const HEADER_LEN: usize = 8;

super::fixed_header_view!(HEADER_LEN, "an AtomicAckETH");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn orig(&self) -> u64 {
        rd64(self.b(), 0)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_orig(&mut self, v: u64) {
        wr64(self.bm(), 0, v);
    }
}

/// A parsed AtomicAckETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Repr {
    /// Original remote value.
    pub orig: u64,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr { orig: p.orig() })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_orig(self.orig);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        any::<u64>().prop_map(|orig| Repr { orig })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn layout_and_boundaries() {
        for orig in [0, 0x0102_0304_0506_0708, u64::MAX] {
            let mut b = [0u8; HEADER_LEN];
            Repr { orig }.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
            assert_eq!(b, orig.to_be_bytes());
            assert_eq!(
                Repr::parse(&Packet::new_checked(&b[..]).unwrap()),
                Ok(Repr { orig })
            );
        }
    }
}
