//! BTH opcodes: the RC, UC and UD opcodes Linux rxe implements, with the extension headers
//! each one carries (in wire order, as `rxe_opcode.c` lays them out), whether it carries
//! payload, its place in a message, and who sends it.
//!
//! The opcode's top three bits are the transport (RC `0x00`, UC `0x20`, UD `0x60`); the low
//! five the operation. RD (`0x40`), CNP (`0x81`), XRC (`0xa0`) and the newer FLUSH (`0x1c`)
//! and ATOMIC WRITE (`0x1d`) opcodes are not implemented and parse as
//! [`Error::UnknownOpcode`].

use super::{Error, Result};

/// Transport service of an opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Reliable Connected.
    Rc,
    /// Unreliable Connected.
    Uc,
    /// Unreliable Datagram.
    Ud,
}

/// An extension header after the BTH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtHeader {
    /// RDMA ETH (16 bytes): virtual address, R_Key, DMA length.
    Reth,
    /// ACK ETH (4 bytes): syndrome, MSN.
    Aeth,
    /// Immediate data (4 bytes).
    ImmDt,
    /// Invalidate ETH (4 bytes): R_Key to invalidate.
    Ieth,
    /// Atomic ETH (28 bytes): virtual address, R_Key, swap/add, compare.
    AtomicEth,
    /// Atomic ACK ETH (8 bytes): original remote value.
    AtomicAckEth,
    /// Datagram ETH (8 bytes): Q_Key, source QP.
    Deth,
}

impl ExtHeader {
    /// Size on the wire.
    pub const fn wire_len(self) -> usize {
        match self {
            ExtHeader::Reth => super::reth::HEADER_LEN,
            ExtHeader::Aeth => super::aeth::HEADER_LEN,
            ExtHeader::ImmDt => super::immdt::HEADER_LEN,
            ExtHeader::Ieth => super::ieth::HEADER_LEN,
            ExtHeader::AtomicEth => super::atomic_eth::HEADER_LEN,
            ExtHeader::AtomicAckEth => super::atomic_ack_eth::HEADER_LEN,
            ExtHeader::Deth => super::deth::HEADER_LEN,
        }
    }
}

/// Where a packet sits in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Position {
    /// First packet of a multi-packet message.
    First,
    /// Neither first nor last.
    Middle,
    /// Last packet of a multi-packet message.
    Last,
    /// The whole message in one packet (also ACKs, Read Requests and atomics).
    Only,
}

impl Position {
    /// Starts a message (first or only).
    pub const fn is_start(self) -> bool {
        matches!(self, Position::First | Position::Only)
    }

    /// Ends a message (last or only).
    pub const fn is_end(self) -> bool {
        matches!(self, Position::Last | Position::Only)
    }
}

/// Who sends a packet of this opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Requester to responder (sends, writes, read requests, atomics).
    Request,
    /// Responder to requester (ACKs, read responses, atomic ACKs).
    Response,
}

/// The operation an opcode belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Send,
    RdmaWrite,
    RdmaReadRequest,
    RdmaReadResponse,
    Acknowledge,
    AtomicAcknowledge,
    CompareSwap,
    FetchAdd,
}

macro_rules! opcodes {
    ($( $(#[$doc:meta])* $name:ident = $val:literal, $op:ident, $pos:ident, [$($h:ident),*], $payload:literal; )*) => {
        /// A BTH opcode rxe implements.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum Opcode {
            $( $(#[$doc])* $name = $val, )*
        }

        impl Opcode {
            /// Every opcode, in numeric order.
            pub const ALL: &'static [Opcode] = &[$(Opcode::$name),*];

            /// Decode a BTH opcode byte.
            pub const fn from_u8(v: u8) -> Result<Opcode> {
                match v {
                    $( $val => Ok(Opcode::$name), )*
                    _ => Err(Error::UnknownOpcode(v)),
                }
            }

            /// The operation.
            pub const fn operation(self) -> Operation {
                match self { $( Opcode::$name => Operation::$op, )* }
            }

            /// Place in the message.
            pub const fn position(self) -> Position {
                match self { $( Opcode::$name => Position::$pos, )* }
            }

            /// Extension headers after the BTH, in wire order.
            pub const fn ext_headers(self) -> &'static [ExtHeader] {
                match self { $( Opcode::$name => &[$(ExtHeader::$h),*], )* }
            }

            /// Whether packets of this opcode carry payload (possibly zero bytes of it).
            pub const fn has_payload(self) -> bool {
                match self { $( Opcode::$name => $payload, )* }
            }
        }
    };
}

opcodes! {
    RcSendFirst = 0x00, Send, First, [], true;
    RcSendMiddle = 0x01, Send, Middle, [], true;
    RcSendLast = 0x02, Send, Last, [], true;
    RcSendLastImm = 0x03, Send, Last, [ImmDt], true;
    RcSendOnly = 0x04, Send, Only, [], true;
    RcSendOnlyImm = 0x05, Send, Only, [ImmDt], true;
    RcRdmaWriteFirst = 0x06, RdmaWrite, First, [Reth], true;
    RcRdmaWriteMiddle = 0x07, RdmaWrite, Middle, [], true;
    RcRdmaWriteLast = 0x08, RdmaWrite, Last, [], true;
    RcRdmaWriteLastImm = 0x09, RdmaWrite, Last, [ImmDt], true;
    RcRdmaWriteOnly = 0x0a, RdmaWrite, Only, [Reth], true;
    RcRdmaWriteOnlyImm = 0x0b, RdmaWrite, Only, [Reth, ImmDt], true;
    RcRdmaReadRequest = 0x0c, RdmaReadRequest, Only, [Reth], false;
    RcRdmaReadResponseFirst = 0x0d, RdmaReadResponse, First, [Aeth], true;
    RcRdmaReadResponseMiddle = 0x0e, RdmaReadResponse, Middle, [], true;
    RcRdmaReadResponseLast = 0x0f, RdmaReadResponse, Last, [Aeth], true;
    RcRdmaReadResponseOnly = 0x10, RdmaReadResponse, Only, [Aeth], true;
    RcAcknowledge = 0x11, Acknowledge, Only, [Aeth], false;
    /// The AETH comes before the AtomicAckETH (IBTA 9.2; rxe agrees).
    RcAtomicAcknowledge = 0x12, AtomicAcknowledge, Only, [Aeth, AtomicAckEth], false;
    RcCompareSwap = 0x13, CompareSwap, Only, [AtomicEth], false;
    RcFetchAdd = 0x14, FetchAdd, Only, [AtomicEth], false;
    RcSendLastInv = 0x16, Send, Last, [Ieth], true;
    RcSendOnlyInv = 0x17, Send, Only, [Ieth], true;
    UcSendFirst = 0x20, Send, First, [], true;
    UcSendMiddle = 0x21, Send, Middle, [], true;
    UcSendLast = 0x22, Send, Last, [], true;
    UcSendLastImm = 0x23, Send, Last, [ImmDt], true;
    UcSendOnly = 0x24, Send, Only, [], true;
    UcSendOnlyImm = 0x25, Send, Only, [ImmDt], true;
    UcRdmaWriteFirst = 0x26, RdmaWrite, First, [Reth], true;
    UcRdmaWriteMiddle = 0x27, RdmaWrite, Middle, [], true;
    UcRdmaWriteLast = 0x28, RdmaWrite, Last, [], true;
    UcRdmaWriteLastImm = 0x29, RdmaWrite, Last, [ImmDt], true;
    UcRdmaWriteOnly = 0x2a, RdmaWrite, Only, [Reth], true;
    UcRdmaWriteOnlyImm = 0x2b, RdmaWrite, Only, [Reth, ImmDt], true;
    /// The DETH comes before the ImmDt.
    UdSendOnly = 0x64, Send, Only, [Deth], true;
    UdSendOnlyImm = 0x65, Send, Only, [Deth, ImmDt], true;
}

impl Opcode {
    /// The raw opcode byte.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The opcode of the same operation and place in `transport`'s set, if it has one
    /// (UC has Sends and RDMA Writes, without Invalidate; UD only Send Only).
    pub const fn in_transport(self, transport: Transport) -> Option<Opcode> {
        let top = match transport {
            Transport::Rc => 0x00,
            Transport::Uc => 0x20,
            Transport::Ud => 0x60,
        };
        match Opcode::from_u8(top | (self as u8 & 0x1f)) {
            Ok(op) => Some(op),
            Err(_) => None,
        }
    }

    /// Transport service (the top three bits).
    pub const fn transport(self) -> Transport {
        match (self as u8) >> 5 {
            0 => Transport::Rc,
            1 => Transport::Uc,
            _ => Transport::Ud,
        }
    }

    /// Who sends it.
    pub const fn direction(self) -> Direction {
        match self.operation() {
            Operation::RdmaReadResponse | Operation::Acknowledge | Operation::AtomicAcknowledge => {
                Direction::Response
            }
            _ => Direction::Request,
        }
    }

    /// BTH plus extension headers, in bytes: where the payload starts.
    pub const fn header_len(self) -> usize {
        let hs = self.ext_headers();
        let mut n = super::bth::HEADER_LEN;
        let mut i = 0;
        while i < hs.len() {
            n += hs[i].wire_len();
            i += 1;
        }
        n
    }

    /// Whether `h` follows the BTH of this opcode.
    pub fn has(self, h: ExtHeader) -> bool {
        self.ext_headers().contains(&h)
    }

    /// Offset of `h` from the start of the BTH, if this opcode carries it.
    pub fn offset_of(self, h: ExtHeader) -> Option<usize> {
        let mut off = super::bth::HEADER_LEN;
        for &x in self.ext_headers() {
            if x == h {
                return Some(off);
            }
            off += x.wire_len();
        }
        None
    }

    /// Carries immediate data.
    pub fn has_immediate(self) -> bool {
        self.has(ExtHeader::ImmDt)
    }

    /// Carries an R_Key to invalidate.
    pub fn has_invalidate(self) -> bool {
        self.has(ExtHeader::Ieth)
    }

    /// Consumes a receive WQE at the responder (first or only packet of a Send, or a
    /// Write with immediate).
    pub fn consumes_recv_wqe(self) -> bool {
        match self.operation() {
            Operation::Send => self.position().is_start(),
            Operation::RdmaWrite => self.has_immediate(),
            _ => false,
        }
    }
}

impl TryFrom<u8> for Opcode {
    type Error = Error;

    fn try_from(v: u8) -> Result<Opcode> {
        Opcode::from_u8(v)
    }
}

impl From<Opcode> for u8 {
    fn from(o: Opcode) -> u8 {
        o as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_decodes_or_is_rejected() {
        let mut known = 0;
        for v in 0..=255u8 {
            match Opcode::from_u8(v) {
                Ok(o) => {
                    known += 1;
                    assert_eq!(o.as_u8(), v);
                    assert_eq!(Opcode::try_from(v), Ok(o));
                }
                Err(e) => assert_eq!(e, Error::UnknownOpcode(v)),
            }
        }
        assert_eq!(known, Opcode::ALL.len());
        assert_eq!(known, 23 + 12 + 2);
    }

    #[test]
    fn uc_has_the_sends_and_writes_of_rc() {
        for &op in Opcode::ALL
            .iter()
            .filter(|o| o.transport() != Transport::Ud)
        {
            let Some(uc) = op.in_transport(Transport::Uc) else {
                continue;
            };
            assert_eq!(uc.transport(), Transport::Uc);
            assert_eq!(uc.operation(), op.operation());
            assert_eq!(uc.position(), op.position());
            assert_eq!(uc.ext_headers(), op.ext_headers());
            let rc = uc
                .in_transport(Transport::Rc)
                .expect("every UC opcode has an RC twin");
            assert_eq!(rc.in_transport(Transport::Uc), Some(uc));
        }
        let rc_with_uc = Opcode::ALL
            .iter()
            .filter(|o| o.transport() == Transport::Rc)
            .filter_map(|o| o.in_transport(Transport::Uc))
            .count();
        assert_eq!(rc_with_uc, 12, "UC: 6 Send and 6 RDMA Write opcodes");
        assert_eq!(Opcode::RcSendOnlyInv.in_transport(Transport::Uc), None);
        assert_eq!(Opcode::RcRdmaReadRequest.in_transport(Transport::Uc), None);
        assert_eq!(
            Opcode::RcSendOnly.in_transport(Transport::Ud),
            Some(Opcode::UdSendOnly)
        );
    }

    #[test]
    fn header_lengths_match_rxe() {
        use Opcode::*;
        // rxe_opcode[].length for each opcode
        let expect = [
            (RcSendFirst, 12),
            (RcSendLastImm, 16),
            (RcRdmaWriteFirst, 28),
            (RcRdmaWriteOnlyImm, 32),
            (RcRdmaReadRequest, 28),
            (RcRdmaReadResponseFirst, 16),
            (RcRdmaReadResponseMiddle, 12),
            (RcAcknowledge, 16),
            (RcAtomicAcknowledge, 24),
            (RcCompareSwap, 40),
            (RcFetchAdd, 40),
            (RcSendOnlyInv, 16),
            (UcRdmaWriteOnlyImm, 32),
            (UdSendOnly, 20),
            (UdSendOnlyImm, 24),
        ];
        for (o, n) in expect {
            assert_eq!(o.header_len(), n, "{o:?}");
        }
        assert_eq!(
            RcAtomicAcknowledge.offset_of(ExtHeader::AtomicAckEth),
            Some(16)
        );
        assert_eq!(UdSendOnlyImm.offset_of(ExtHeader::ImmDt), Some(20));
        assert_eq!(RcRdmaWriteOnlyImm.offset_of(ExtHeader::ImmDt), Some(28));
        assert_eq!(RcSendOnly.offset_of(ExtHeader::Reth), None);
    }

    #[test]
    fn uc_mirrors_rc_and_directions() {
        for &o in Opcode::ALL {
            if o.transport() == Transport::Uc {
                let rc = Opcode::from_u8(o.as_u8() & 0x1f).unwrap();
                assert_eq!(rc.ext_headers(), o.ext_headers());
                assert_eq!(rc.position(), o.position());
                assert_eq!(o.direction(), Direction::Request);
            }
            let resp = matches!(
                o,
                Opcode::RcRdmaReadResponseFirst
                    | Opcode::RcRdmaReadResponseMiddle
                    | Opcode::RcRdmaReadResponseLast
                    | Opcode::RcRdmaReadResponseOnly
                    | Opcode::RcAcknowledge
                    | Opcode::RcAtomicAcknowledge
            );
            assert_eq!(o.direction() == Direction::Response, resp, "{o:?}");
        }
        assert!(Opcode::RcSendFirst.consumes_recv_wqe());
        assert!(!Opcode::RcSendMiddle.consumes_recv_wqe());
        assert!(Opcode::RcRdmaWriteLastImm.consumes_recv_wqe());
        assert!(!Opcode::RcRdmaWriteOnly.consumes_recv_wqe());
    }
}
