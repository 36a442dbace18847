//! RDMA Extended Transport Header (IBTA 9.3.3), 16 bytes: carried by RDMA WRITE First/Only
//! and RDMA READ Request.
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | virtual address |
//! | 8..12 | R_Key |
//! | 12..16 | DMA length (of the whole message) |

use super::Result;
use rnicpi::wire::{rd32, rd64, wr32, wr64};

/// Size of the RETH.
pub const HEADER_LEN: usize = 16;

super::fixed_header_view!(HEADER_LEN, "a RETH");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn va(&self) -> u64 {
        rd64(self.b(), 0)
    }

    pub fn rkey(&self) -> u32 {
        rd32(self.b(), 8)
    }

    pub fn dma_len(&self) -> u32 {
        rd32(self.b(), 12)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_va(&mut self, v: u64) {
        wr64(self.bm(), 0, v);
    }

    pub fn set_rkey(&mut self, v: u32) {
        wr32(self.bm(), 8, v);
    }

    pub fn set_dma_len(&mut self, v: u32) {
        wr32(self.bm(), 12, v);
    }
}

/// A parsed RETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Repr {
    pub va: u64,
    pub rkey: u32,
    pub dma_len: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr {
            va: p.va(),
            rkey: p.rkey(),
            dma_len: p.dma_len(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_va(self.va);
        p.set_rkey(self.rkey);
        p.set_dma_len(self.dma_len);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        any::<(u64, u32, u32)>().prop_map(|(va, rkey, dma_len)| Repr { va, rkey, dma_len })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn layout_and_boundaries() {
        let r = Repr {
            va: 0x0102_0304_0506_0708,
            rkey: 0x090a_0b0c,
            dma_len: 0x0d0e_0f10,
        };
        let mut b = [0u8; HEADER_LEN];
        r.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
        assert_eq!(b, core::array::from_fn(|i| i as u8 + 1));
        for v in [0, u64::MAX] {
            let r = Repr {
                va: v,
                rkey: v as u32,
                dma_len: v as u32,
            };
            let mut b = [0u8; HEADER_LEN];
            r.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
            assert_eq!(Repr::parse(&Packet::new_checked(&b[..]).unwrap()), Ok(r));
        }
    }
}
