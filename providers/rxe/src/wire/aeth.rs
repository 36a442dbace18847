//! ACK Extended Transport Header (IBTA 9.3.5 / 9.7.5.1), 4 bytes: syndrome (8 bits) and
//! MSN (24 bits). Carried by ACKNOWLEDGE, ATOMIC ACKNOWLEDGE and the first, last and only
//! RDMA READ responses.
//!
//! Syndrome byte: bit 7 reserved (0); bits 6..5 the type — `00` ACK, `01` RNR NAK, `10`
//! reserved, `11` NAK; bits 4..0 the value — for an ACK the credit code (see
//! [`CREDIT_TABLE`]; 31 means "no credit information", which is what rxe always sends), for
//! an RNR NAK the timer code (see [`RNR_TIMER_MICROS`]), for a NAK the [`NakCode`].

use super::{Error, Result};
use rnicpi::wire::{rd24, wr24};

/// Size of the AETH.
pub const HEADER_LEN: usize = 4;

/// Credit code meaning "invalid / unlimited": the requester is not limited by credits.
pub const CREDITS_UNLIMITED: u8 = 0x1f;

/// Number of receive credits for each 5-bit credit code 0..=30 (IBTA table 45).
pub const CREDIT_TABLE: [u32; 31] = [
    0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768,
];

/// Minimum RNR NAK delay in microseconds for each 5-bit timer code (IBTA table 45, "RNR
/// timer field"). Code 0 is the longest, 655.36 ms. (Linux rxe's table has 61410 for
/// code 25, a typo of 61440; the wire value, the code, is what matters.)
pub const RNR_TIMER_MICROS: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
    5120, 7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122_880, 163_840, 245_760,
    327_680, 491_520,
];

/// Credits for a credit code; `None` for [`CREDITS_UNLIMITED`] (and anything wider than 5
/// bits).
pub fn credits(code: u8) -> Option<u32> {
    CREDIT_TABLE.get(code as usize).copied()
}

/// The largest credit code whose credit count does not exceed `n`.
pub fn credit_code_for(n: u32) -> u8 {
    CREDIT_TABLE.iter().rposition(|&c| c <= n).unwrap_or(0) as u8
}

/// RNR NAK delay for a timer code, in microseconds (low five bits of `code`).
pub fn rnr_timer_micros(code: u8) -> u32 {
    RNR_TIMER_MICROS[(code & 0x1f) as usize]
}

/// The timer code of the shortest delay that is at least `micros` (code 0, 655.36 ms, when
/// nothing shorter is long enough).
pub fn rnr_timer_code_for(micros: u32) -> u8 {
    (1..32u8)
        .find(|&c| RNR_TIMER_MICROS[c as usize] >= micros)
        .unwrap_or(0)
}

/// NAK codes (IBTA table 46).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum NakCode {
    PsnSequenceError = 0,
    InvalidRequest = 1,
    RemoteAccessError = 2,
    RemoteOperationalError = 3,
    InvalidRdRequest = 4,
}

impl NakCode {
    pub const ALL: [NakCode; 5] = [
        NakCode::PsnSequenceError,
        NakCode::InvalidRequest,
        NakCode::RemoteAccessError,
        NakCode::RemoteOperationalError,
        NakCode::InvalidRdRequest,
    ];
}

/// A decoded syndrome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Syndrome {
    /// Positive acknowledgement with a 5-bit credit code ([`credits`]).
    Ack { credit_code: u8 },
    /// Receiver not ready; retry after the 5-bit timer code's delay ([`rnr_timer_micros`]).
    RnrNak { timer: u8 },
    /// Negative acknowledgement.
    Nak(NakCode),
}

impl Syndrome {
    /// Decode the syndrome byte; reserved encodings are refused.
    pub fn from_u8(b: u8) -> Result<Syndrome> {
        let v = b & 0x1f;
        match b >> 5 {
            0 => Ok(Syndrome::Ack { credit_code: v }),
            1 => Ok(Syndrome::RnrNak { timer: v }),
            3 => match v {
                0..=4 => Ok(Syndrome::Nak(NakCode::ALL[v as usize])),
                _ => Err(Error::ReservedSyndrome(b)),
            },
            _ => Err(Error::ReservedSyndrome(b)),
        }
    }

    /// Encode (codes wider than five bits are truncated).
    pub fn to_u8(self) -> u8 {
        match self {
            Syndrome::Ack { credit_code } => credit_code & 0x1f,
            Syndrome::RnrNak { timer } => 0x20 | (timer & 0x1f),
            Syndrome::Nak(c) => 0x60 | c as u8,
        }
    }

    /// An ACK without credit information, as rxe sends.
    pub const ACK_UNLIMITED: Syndrome = Syndrome::Ack {
        credit_code: CREDITS_UNLIMITED,
    };

    pub fn is_ack(self) -> bool {
        matches!(self, Syndrome::Ack { .. })
    }
}

super::fixed_header_view!(HEADER_LEN, "an AETH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The raw syndrome byte.
    pub fn syndrome_raw(&self) -> u8 {
        self.b()[0]
    }

    pub fn syndrome(&self) -> Result<Syndrome> {
        Syndrome::from_u8(self.syndrome_raw())
    }

    /// Message sequence number (24 bits).
    pub fn msn(&self) -> u32 {
        rd24(self.b(), 1)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_syndrome_raw(&mut self, v: u8) {
        self.bm()[0] = v;
    }

    pub fn set_syndrome(&mut self, v: Syndrome) {
        self.set_syndrome_raw(v.to_u8());
    }

    /// Low 24 bits of `v`.
    pub fn set_msn(&mut self, v: u32) {
        wr24(self.bm(), 1, v);
    }
}

/// A parsed AETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    pub syndrome: Syndrome,
    /// 24 bits.
    pub msn: u32,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        Ok(Repr {
            syndrome: p.syndrome()?,
            msn: p.msn(),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.set_syndrome(self.syndrome);
        p.set_msn(self.msn);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_syndrome() -> impl Strategy<Value = Syndrome> {
        prop_oneof![
            (0u8..32).prop_map(|credit_code| Syndrome::Ack { credit_code }),
            (0u8..32).prop_map(|timer| Syndrome::RnrNak { timer }),
            proptest::sample::select(&NakCode::ALL[..]).prop_map(Syndrome::Nak),
        ]
    }

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        (any_syndrome(), 0u32..=0xff_ffff).prop_map(|(syndrome, msn)| Repr { syndrome, msn })
    }

    super::super::header_proptests!(any_repr());

    #[test]
    fn every_syndrome_byte() {
        let mut ok = 0;
        for b in 0..=255u8 {
            match Syndrome::from_u8(b) {
                Ok(s) => {
                    ok += 1;
                    assert_eq!(s.to_u8(), b);
                }
                Err(e) => assert_eq!(e, Error::ReservedSyndrome(b)),
            }
        }
        assert_eq!(ok, 32 + 32 + 5);
        assert_eq!(Syndrome::from_u8(0x1f), Ok(Syndrome::ACK_UNLIMITED));
        assert_eq!(
            Syndrome::from_u8(0x60),
            Ok(Syndrome::Nak(NakCode::PsnSequenceError))
        );
        assert_eq!(
            Syndrome::from_u8(0x63),
            Ok(Syndrome::Nak(NakCode::RemoteOperationalError))
        );
        assert_eq!(Syndrome::from_u8(0x2e), Ok(Syndrome::RnrNak { timer: 14 }));
    }

    #[test]
    fn captured_ack() {
        // rping_rxe.pcap: ACK with syndrome 0x1f (unlimited credits), MSN 1.
        let b = [0x1f, 0x00, 0x00, 0x01];
        let r = Repr::parse(&Packet::new_checked(&b[..]).unwrap()).unwrap();
        assert_eq!(
            r,
            Repr {
                syndrome: Syndrome::ACK_UNLIMITED,
                msn: 1
            }
        );
        for msn in [0, 0xff_ffff] {
            for s in [
                Syndrome::Ack { credit_code: 0 },
                Syndrome::RnrNak { timer: 31 },
                Syndrome::Nak(NakCode::InvalidRdRequest),
            ] {
                let mut o = [0u8; 4];
                Repr { syndrome: s, msn }.emit(&mut Packet::new_checked(&mut o[..]).unwrap());
                assert_eq!(
                    Repr::parse(&Packet::new_checked(&o[..]).unwrap()),
                    Ok(Repr { syndrome: s, msn })
                );
            }
        }
    }

    #[test]
    fn tables() {
        assert_eq!(credits(0), Some(0));
        assert_eq!(credits(5), Some(6));
        assert_eq!(credits(30), Some(32768));
        assert_eq!(credits(CREDITS_UNLIMITED), None);
        assert_eq!(credit_code_for(0), 0);
        assert_eq!(credit_code_for(5), 4);
        assert_eq!(credit_code_for(6), 5);
        assert_eq!(credit_code_for(u32::MAX), 30);
        assert_eq!(rnr_timer_micros(0), 655_360);
        assert_eq!(rnr_timer_micros(1), 10);
        assert_eq!(rnr_timer_micros(14), 1280);
        assert_eq!(rnr_timer_micros(31), 491_520);
        assert_eq!(rnr_timer_code_for(0), 1);
        assert_eq!(rnr_timer_code_for(1280), 14);
        assert_eq!(rnr_timer_code_for(1281), 15);
        assert_eq!(rnr_timer_code_for(500_000), 0);
        // Codes 1..=31 are increasing, code 0 is the largest.
        assert!(RNR_TIMER_MICROS[1..].windows(2).all(|w| w[0] < w[1]));
        assert!(RNR_TIMER_MICROS[0] > RNR_TIMER_MICROS[31]);
        assert!(CREDIT_TABLE.windows(2).all(|w| w[0] < w[1]));
    }
}
