//! Datagram Extended Transport Header (IBTA 9.3.2), 8 bytes: carried by UD sends.
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | Q_Key |
//! | 4 | reserved |
//! | 5..8 | source QP |
//!
//! A Q_Key with the top bit set is a controlled Q_Key; QP1 (GSI) uses [`GSI_QKEY`].

use super::Result;
use rnicpi::wire::{rd24, rd32, wr24, wr32};

/// Size of the DETH.
pub const HEADER_LEN: usize = 8;
/// The well-known Q_Key of QP1, the General Services Interface that carries CM MADs.
pub const GSI_QKEY: u32 = 0x8001_0000;
/// QP number of the GSI.
pub const GSI_QPN: u32 = 1;

super::fixed_header_view!(HEADER_LEN, "a DETH");

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn qkey(&self) -> u32 {
        rd32(self.b(), 0)
    }

    /// Source QP number (24 bits).
    pub fn src_qp(&self) -> u32 {
        rd24(self.b(), 5)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_qkey(&mut self, v: u32) {
        wr32(self.bm(), 0, v);
    }

    /// Low 24 bits of `v`.
    pub fn set_src_qp(&mut self, v: u32) {
        wr24(self.bm(), 5, v);
    }
}

/// A parsed DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Repr {
    pub qkey: u32,
    /// 24 bits.
    pub src_qp: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr {
            qkey: p.qkey(),
            src_qp: p.src_qp(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the reserved byte as zero.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_qkey(self.qkey);
        p.bm()[4] = 0;
        p.set_src_qp(self.src_qp);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        (any::<u32>(), 0u32..=0xff_ffff).prop_map(|(qkey, src_qp)| Repr { qkey, src_qp })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn captured_gsi_deth() {
        // rping_rxe.pcap, CM REQ: Q_Key 0x80010000 from QP1.
        let b = [0x80, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01];
        let r = Repr::parse(&Packet::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            Repr {
                qkey: GSI_QKEY,
                src_qp: GSI_QPN
            }
        );
        for (qkey, src_qp) in [(0, 0), (u32::MAX, 0xff_ffff)] {
            let mut o = [0xffu8; HEADER_LEN];
            Repr { qkey, src_qp }.emit(&mut Packet::new_checked(&mut o[..]).unwrap());
            assert_eq!(o[4], 0);
            assert_eq!(
                Repr::parse(&Packet::new_checked(&o[..]).unwrap()),
                Ok(Repr { qkey, src_qp })
            );
        }
    }
}
