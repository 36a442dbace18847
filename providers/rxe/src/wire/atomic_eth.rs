//! Atomic Extended Transport Header (IBTA 9.3.6), 28 bytes: carried by CmpSwap and
//! FetchAdd.
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | virtual address (8-byte aligned) |
//! | 8..12 | R_Key |
//! | 12..20 | swap value (CmpSwap) or add value (FetchAdd) |
//! | 20..28 | compare value (CmpSwap; ignored by FetchAdd) |

use super::Result;
use rnicpi::wire::{rd32, rd64, wr32, wr64};

/// Size of the AtomicETH.
pub const HEADER_LEN: usize = 28;

super::fixed_header_view!(HEADER_LEN, "an AtomicETH");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn va(&self) -> u64 {
        rd64(self.b(), 0)
    }

    pub fn rkey(&self) -> u32 {
        rd32(self.b(), 8)
    }

    pub fn swap_add(&self) -> u64 {
        rd64(self.b(), 12)
    }

    pub fn compare(&self) -> u64 {
        rd64(self.b(), 20)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_va(&mut self, v: u64) {
        wr64(self.bm(), 0, v);
    }

    pub fn set_rkey(&mut self, v: u32) {
        wr32(self.bm(), 8, v);
    }

    pub fn set_swap_add(&mut self, v: u64) {
        wr64(self.bm(), 12, v);
    }

    pub fn set_compare(&mut self, v: u64) {
        wr64(self.bm(), 20, v);
    }
}

/// A parsed AtomicETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Repr {
    pub va: u64,
    pub rkey: u32,
    pub swap_add: u64,
    pub compare: u64,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr {
            va: p.va(),
            rkey: p.rkey(),
            swap_add: p.swap_add(),
            compare: p.compare(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_va(self.va);
        p.set_rkey(self.rkey);
        p.set_swap_add(self.swap_add);
        p.set_compare(self.compare);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        any::<(u64, u32, u64, u64)>().prop_map(|(va, rkey, swap_add, compare)| Repr {
            va,
            rkey,
            swap_add,
            compare,
        })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn layout_and_boundaries() {
        let r = Repr {
            va: 0x0102_0304_0506_0708,
            rkey: 0x090a_0b0c,
            swap_add: 0x0d0e_0f10_1112_1314,
            compare: 0x1516_1718_191a_1b1c,
        };
        let mut b = [0u8; HEADER_LEN];
        r.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
        assert_eq!(b, core::array::from_fn(|i| i as u8 + 1));
        for v in [0, u64::MAX] {
            let r = Repr {
                va: v,
                rkey: v as u32,
                swap_add: v,
                compare: v,
            };
            let mut b = [0u8; HEADER_LEN];
            r.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
            assert_eq!(Repr::parse(&Packet::new_checked(&b[..]).unwrap()), Ok(r));
        }
    }
}
