//! Base Transport Header (IBTA 9.2), 12 bytes, and 24-bit PSN arithmetic.
//!
//! | byte | bits |
//! |---|---|
//! | 0 | opcode |
//! | 1 | SE (7), MigReq (6), PadCnt (5..4), TVer (3..0) |
//! | 2..4 | P_Key |
//! | 4 | FECN (7), BECN (6), reserved (5..0) — RoCEv2 keeps the ECN bits here, as rxe does |
//! | 5..8 | destination QP |
//! | 8 | AckReq (7), reserved (6..0) |
//! | 9..12 | PSN |
//!
//! Reserved bits are written as zero and ignored on receive.

use super::opcode::Opcode;
use super::{Error, Result};
use rnicpi::wire::{rd16, rd24, wr16, wr24, wrflag};

/// Size of the BTH.
pub const HEADER_LEN: usize = 12;
/// PSNs, QPNs and MSNs are 24-bit.
pub const PSN_MASK: u32 = 0x00ff_ffff;
/// The default partition key (full member).
pub const DEFAULT_PKEY: u16 = 0xffff;

const SE: u8 = 0x80;
const MIG: u8 = 0x40;
const FECN: u8 = 0x80;
const BECN: u8 = 0x40;
const ACKREQ: u8 = 0x80;

/// `a + n` in PSN space (mod 2^24).
pub const fn psn_add(a: u32, n: u32) -> u32 {
    a.wrapping_add(n) & PSN_MASK
}

/// Signed distance `a - b` in PSN space, in `-2^23 .. 2^23`: positive when `a` is after `b`
/// (the comparison IBTA 9.7 and rxe's `psn_compare` use).
pub const fn psn_diff(a: u32, b: u32) -> i32 {
    // Shift the 24-bit difference into the top of an i32 and back, sign-extending.
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// `a` comes before `b` in PSN space.
pub const fn psn_lt(a: u32, b: u32) -> bool {
    psn_diff(a, b) < 0
}

super::fixed_header_view!(HEADER_LEN, "a BTH");

impl<T: AsRef<[u8]>> Packet<T> {
    /// The raw opcode byte (see [`Opcode::from_u8`]).
    pub fn opcode_raw(&self) -> u8 {
        self.b()[0]
    }

    /// The opcode, if rxe knows it.
    pub fn opcode(&self) -> Result<Opcode> {
        Opcode::from_u8(self.opcode_raw())
    }

    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.b()[1] & SE != 0
    }

    /// Migration request.
    pub fn mig_req(&self) -> bool {
        self.b()[1] & MIG != 0
    }

    /// Pad count: bytes added after the payload to reach a multiple of 4.
    pub fn pad_count(&self) -> u8 {
        (self.b()[1] >> 4) & 3
    }

    /// Transport header version (0 is the only one defined).
    pub fn tver(&self) -> u8 {
        self.b()[1] & 0x0f
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        rd16(self.b(), 2)
    }

    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.b()[4] & FECN != 0
    }

    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.b()[4] & BECN != 0
    }

    /// Destination QP number (24 bits).
    pub fn dest_qp(&self) -> u32 {
        rd24(self.b(), 5)
    }

    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.b()[8] & ACKREQ != 0
    }

    /// Packet sequence number (24 bits).
    pub fn psn(&self) -> u32 {
        rd24(self.b(), 9)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_opcode_raw(&mut self, v: u8) {
        self.bm()[0] = v;
    }

    pub fn set_opcode(&mut self, v: Opcode) {
        self.set_opcode_raw(v.as_u8());
    }

    pub fn set_solicited(&mut self, v: bool) {
        wrflag(self.bm(), 1, SE, v);
    }

    pub fn set_mig_req(&mut self, v: bool) {
        wrflag(self.bm(), 1, MIG, v);
    }

    /// Low two bits of `v`.
    pub fn set_pad_count(&mut self, v: u8) {
        let b = &mut self.bm()[1];
        *b = (*b & !0x30) | ((v & 3) << 4);
    }

    /// Low four bits of `v`.
    pub fn set_tver(&mut self, v: u8) {
        let b = &mut self.bm()[1];
        *b = (*b & !0x0f) | (v & 0x0f);
    }

    pub fn set_pkey(&mut self, v: u16) {
        wr16(self.bm(), 2, v);
    }

    pub fn set_fecn(&mut self, v: bool) {
        wrflag(self.bm(), 4, FECN, v);
    }

    pub fn set_becn(&mut self, v: bool) {
        wrflag(self.bm(), 4, BECN, v);
    }

    /// Low 24 bits of `v`.
    pub fn set_dest_qp(&mut self, v: u32) {
        wr24(self.bm(), 5, v);
    }

    pub fn set_ack_req(&mut self, v: bool) {
        wrflag(self.bm(), 8, ACKREQ, v);
    }

    /// Low 24 bits of `v`.
    pub fn set_psn(&mut self, v: u32) {
        wr24(self.bm(), 9, v);
    }
}

/// A parsed BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Repr {
    pub opcode: Opcode,
    pub solicited: bool,
    pub mig_req: bool,
    /// 0..=3. [`roce::Repr::emit`](super::roce::Repr::emit) computes it from the payload.
    pub pad_count: u8,
    pub pkey: u16,
    pub fecn: bool,
    pub becn: bool,
    /// 24 bits.
    pub dest_qp: u32,
    pub ack_req: bool,
    /// 24 bits.
    pub psn: u32,
}

impl Repr {
    /// A BTH with the default P_Key (0xffff) and every flag clear.
    pub fn new(opcode: Opcode, dest_qp: u32, psn: u32) -> Repr {
        Repr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: dest_qp & PSN_MASK,
            ack_req: false,
            psn: psn & PSN_MASK,
        }
    }

    /// Parse; refuses unknown opcodes and a transport version other than 0.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr> {
        let opcode = p.opcode()?;
        if p.tver() != 0 {
            return Err(Error::BadTransportVersion(p.tver()));
        }
        Ok(Repr {
            opcode,
            solicited: p.solicited(),
            mig_req: p.mig_req(),
            pad_count: p.pad_count(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qp: p.dest_qp(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    /// Bytes [`emit`](Self::emit) writes.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write all 12 bytes (reserved bits zero, TVer 0). Values wider than their field are
    /// truncated to it.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        p.bm()[..HEADER_LEN].fill(0);
        p.set_opcode(self.opcode);
        p.set_solicited(self.solicited);
        p.set_mig_req(self.mig_req);
        p.set_pad_count(self.pad_count);
        p.set_pkey(self.pkey);
        p.set_fecn(self.fecn);
        p.set_becn(self.becn);
        p.set_dest_qp(self.dest_qp);
        p.set_ack_req(self.ack_req);
        p.set_psn(self.psn);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn any_opcode() -> impl Strategy<Value = Opcode> {
        proptest::sample::select(Opcode::ALL)
    }

    pub(crate) fn any_repr() -> impl Strategy<Value = Repr> {
        (
            any_opcode(),
            any::<(bool, bool, bool, bool, bool)>(),
            0u8..4,
            any::<u16>(),
            0..=PSN_MASK,
            0..=PSN_MASK,
        )
            .prop_map(
                |(opcode, (se, mig, fecn, becn, ack), pad, pkey, qp, psn)| Repr {
                    opcode,
                    solicited: se,
                    mig_req: mig,
                    pad_count: pad,
                    pkey,
                    fecn,
                    becn,
                    dest_qp: qp,
                    ack_req: ack,
                    psn,
                },
            )
    }

    #[test]
    fn captured_rc_send_only() {
        // rping_rxe.pcap: RC SEND Only to QP 0x11, PSN 0x1ece27, AckReq set.
        let b = [
            0x04, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x1e, 0xce, 0x27,
        ];
        let p = Packet::new_checked(&b[..]).unwrap();
        let r = Repr::parse(&p).unwrap();
        assert_eq!(r.opcode, Opcode::RcSendOnly);
        assert_eq!((r.pkey, r.dest_qp, r.psn), (0xffff, 0x11, 0x1ece27));
        assert!(r.ack_req && !r.fecn && !r.becn && !r.solicited);
        let mut out = [0u8; 12];
        r.emit(&mut Packet::new_checked(&mut out[..]).unwrap());
        assert_eq!(out, b);
    }

    #[test]
    fn ecn_bits_sit_where_rxe_puts_them() {
        let mut b = [0u8; 12];
        let mut p = Packet::new_checked(&mut b[..]).unwrap();
        p.set_fecn(true);
        assert_eq!(p.header_bytes()[4], 0x80);
        p.set_fecn(false);
        p.set_becn(true);
        assert_eq!(p.header_bytes()[4], 0x40);
        p.set_dest_qp(0xffff_ffff);
        assert_eq!(
            p.header_bytes()[4],
            0x40,
            "QPN does not spill into the ECN byte"
        );
    }

    #[test]
    fn psn_arithmetic_wraps() {
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_add(5, PSN_MASK), 4);
        assert_eq!(psn_diff(0, PSN_MASK), 1);
        assert_eq!(psn_diff(PSN_MASK, 0), -1);
        assert_eq!(psn_diff(10, 3), 7);
        assert_eq!(psn_diff(0x80_0000, 0), -0x80_0000);
        assert_eq!(psn_diff(0x7f_ffff, 0), 0x7f_ffff);
        assert!(psn_lt(PSN_MASK, 0));
        assert!(!psn_lt(0, 0));
    }

    proptest! {
        #[test]
        fn round_trip(r in any_repr()) {
            let mut b = [0xa5u8; HEADER_LEN];
            r.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
            let p = Packet::new_checked(&b[..]).unwrap();
            prop_assert_eq!(Repr::parse(&p).unwrap(), r);
            prop_assert_eq!(b[4] & 0x3f, 0, "reserved bits zero");
            prop_assert_eq!(b[8] & 0x7f, 0, "reserved bits zero");
        }

        #[test]
        fn truncated_rejected(len in 0usize..HEADER_LEN) {
            let b = vec![0u8; len];
            prop_assert_eq!(
                Packet::new_checked(&b[..]),
                Err(Error::Truncated { need: HEADER_LEN, have: len })
            );
        }

        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..32)) {
            if let Ok(p) = Packet::new_checked(&b[..]) {
                if let Ok(r) = Repr::parse(&p) {
                    let mut out = [0u8; HEADER_LEN];
                    r.emit(&mut Packet::new_checked(&mut out[..]).unwrap());
                    // Only reserved bits may differ.
                    let mut masked = b[..HEADER_LEN].to_vec();
                    masked[4] &= 0xc0;
                    masked[8] &= 0x80;
                    prop_assert_eq!(&out[..], &masked[..]);
                }
            }
        }

        #[test]
        fn psn_add_diff_inverse(a in 0..=PSN_MASK, n in 0u32..0x80_0000) {
            let b = psn_add(a, n);
            prop_assert_eq!(psn_diff(b, a), n as i32);
            prop_assert_eq!(psn_diff(a, b), -(n as i32));
            prop_assert!(b <= PSN_MASK);
        }
    }

    #[test]
    fn field_boundaries() {
        for (qp, psn, pkey) in [
            (0, 0, 0),
            (PSN_MASK, PSN_MASK, 0xffff),
            (1, 0x80_0000, 0x8000),
        ] {
            for pad in 0..4 {
                let r = Repr {
                    opcode: Opcode::UdSendOnlyImm,
                    solicited: true,
                    mig_req: true,
                    pad_count: pad,
                    pkey,
                    fecn: true,
                    becn: true,
                    dest_qp: qp,
                    ack_req: true,
                    psn,
                };
                let mut b = [0u8; HEADER_LEN];
                r.emit(&mut Packet::new_checked(&mut b[..]).unwrap());
                assert_eq!(Repr::parse(&Packet::new_checked(&b[..]).unwrap()), Ok(r));
            }
        }
        let mut b = [0u8; HEADER_LEN];
        b[1] = 0x01;
        assert_eq!(
            Repr::parse(&Packet::new_checked(&b[..]).unwrap()),
            Err(Error::BadTransportVersion(1))
        );
        b[1] = 0;
        b[0] = 0x15;
        assert_eq!(
            Repr::parse(&Packet::new_checked(&b[..]).unwrap()),
            Err(Error::UnknownOpcode(0x15))
        );
    }
}
