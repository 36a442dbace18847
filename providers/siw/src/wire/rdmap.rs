//! RDMAP over DDP (RFC 5040): the opcodes, the control byte RDMAP keeps in the DDP header,
//! a ULPDU's checked view ([`Packet`]) with its [`Header`], and the Read Request header.
//!
//! | byte of the DDP header | field |
//! |---|---|
//! | 1 | RDMAP control: RV version (7..6), reserved (5..4), opcode (3..0) |
//!
//! | opcode | name | model | queue |
//! |---|---|---|---|
//! | 0 | RDMA Write | tagged | – |
//! | 1 | Read Request | untagged | 1 |
//! | 2 | Read Response | tagged | – |
//! | 3 / 4 / 5 / 6 | Send / with Invalidate / with SE / with SE and Invalidate | untagged | 0 |
//! | 7 | Terminate | untagged | 2 |
//!
//! The Read Request header (RFC 5040 §4.4) is the whole payload of a Read Request:
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | data sink STag |
//! | 4..12 | data sink tagged offset |
//! | 12..16 | RDMA Read message size |
//! | 16..20 | data source STag |
//! | 20..28 | data source tagged offset |

use super::ddp::{self, Model, TaggedPacket, TaggedRepr, UntaggedPacket, UntaggedRepr};
use super::{Error, Result};
use rnicpi::wire::{check_len, rd32, rd64, rdbits, wr32, wr64};

/// The RDMAP version this implementation speaks (RFC 5040's).
pub const VERSION: u8 = 1;
/// The untagged queues RDMAP uses (RFC 5040 §5.1).
pub const QN_SEND: u32 = 0;
pub const QN_READ: u32 = 1;
pub const QN_TERMINATE: u32 = 2;

mod field {
    use rnicpi::wire::Field;

    /// RV (7..6), reserved (5..4), opcode (3..0); in the DDP header.
    pub const CONTROL: usize = super::ddp::field::ULP_CTRL;
    // The Read Request header, from the start of the ULPDU's payload.
    pub const SINK_STAG: Field = 0..4;
    pub const SINK_TO: Field = 4..12;
    pub const SIZE: Field = 12..16;
    pub const SRC_STAG: Field = 16..20;
    pub const SRC_TO: Field = 20..28;
}

const RV_SHIFT: u32 = 6;
const RV_WIDTH: u32 = 2;
const OPCODE_SHIFT: u32 = 0;
const OPCODE_WIDTH: u32 = 4;
/// The DDP control byte and RDMAP's: what is read before the header's length is known.
const CONTROL_LEN: usize = field::CONTROL + 1;

/// RDMAP opcodes (RFC 5040 §4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Opcode {
    Write = 0,
    ReadRequest = 1,
    ReadResponse = 2,
    Send = 3,
    SendInvalidate = 4,
    SendSe = 5,
    SendSeInvalidate = 6,
    Terminate = 7,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Result<Self> {
        use Opcode::*;
        Ok(match v {
            0 => Write,
            1 => ReadRequest,
            2 => ReadResponse,
            3 => Send,
            4 => SendInvalidate,
            5 => SendSe,
            6 => SendSeInvalidate,
            7 => Terminate,
            _ => return Err(Error::UnknownOpcode(v)),
        })
    }

    pub fn tagged(self) -> bool {
        matches!(self, Opcode::Write | Opcode::ReadResponse)
    }

    pub fn is_send(self) -> bool {
        matches!(
            self,
            Opcode::Send | Opcode::SendInvalidate | Opcode::SendSe | Opcode::SendSeInvalidate
        )
    }

    pub fn solicited(self) -> bool {
        matches!(self, Opcode::SendSe | Opcode::SendSeInvalidate)
    }

    pub fn invalidates(self) -> bool {
        matches!(self, Opcode::SendInvalidate | Opcode::SendSeInvalidate)
    }

    /// The untagged queue a message of this opcode uses.
    pub fn queue(self) -> u32 {
        match self {
            Opcode::ReadRequest => QN_READ,
            Opcode::Terminate => QN_TERMINATE,
            _ => QN_SEND,
        }
    }

    /// Size of the DDP/RDMAP header of this opcode's model.
    pub fn header_len(self) -> usize {
        if self.tagged() {
            ddp::TAGGED_HEADER_LEN
        } else {
            ddp::UNTAGGED_HEADER_LEN
        }
    }

    /// The RDMAP control byte for this opcode.
    pub fn control(self) -> u8 {
        VERSION << RV_SHIFT | self as u8
    }
}

/// A checked view of one ULPDU: its DDP/RDMAP header and payload.
///
/// [`new_checked`](Self::new_checked) reads the two control bytes before anything else, as
/// Linux siw does: the DDP version, the RDMAP version, a known opcode and a T bit that
/// agrees with it, and only then room for the header they announce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
    opcode: Opcode,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap a ULPDU after validating its header's structure (errors in that order:
    /// `Truncated` for less than the two control bytes, `BadDdpVersion`,
    /// `BadRdmapVersion`, `UnknownOpcode`, `ModelMismatch`, `Truncated`).
    pub fn new_checked(buffer: T) -> Result<Self> {
        let b = buffer.as_ref();
        check_len(CONTROL_LEN, b.len())?;
        if rdbits(b, ddp::field::CONTROL, ddp::DV_SHIFT, ddp::DV_WIDTH) != ddp::VERSION {
            return Err(Error::BadDdpVersion);
        }
        if rdbits(b, field::CONTROL, RV_SHIFT, RV_WIDTH) != VERSION {
            return Err(Error::BadRdmapVersion);
        }
        let opcode = Opcode::from_u8(rdbits(b, field::CONTROL, OPCODE_SHIFT, OPCODE_WIDTH))?;
        if (b[ddp::field::CONTROL] & ddp::TAGGED != 0) != opcode.tagged() {
            return Err(Error::ModelMismatch);
        }
        check_len(opcode.header_len(), b.len())?;
        Ok(Packet { buffer, opcode })
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The opcode (validated).
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// L: the last segment of its message.
    pub fn last(&self) -> bool {
        self.buffer.as_ref()[ddp::field::CONTROL] & ddp::LAST != 0
    }

    /// Where the payload starts.
    pub fn header_len(&self) -> usize {
        self.opcode.header_len()
    }

    /// The DDP header, if the opcode is tagged.
    pub fn tagged_header(&self) -> Option<TaggedPacket<&[u8]>> {
        self.opcode
            .tagged()
            .then(|| TaggedPacket::new_unchecked(self.buffer.as_ref()))
    }

    /// The DDP header, if the opcode is untagged.
    pub fn untagged_header(&self) -> Option<UntaggedPacket<&[u8]>> {
        (!self.opcode.tagged()).then(|| UntaggedPacket::new_unchecked(self.buffer.as_ref()))
    }

    /// The header's bytes.
    pub fn header_bytes(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.header_len()]
    }

    /// The payload: everything after the header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Packet<&'a T> {
    /// The payload with the lifetime of the underlying buffer.
    pub fn payload_ref(&self) -> &'a [u8] {
        let b: &'a [u8] = self.buffer.as_ref();
        &b[self.opcode.header_len()..]
    }
}

/// The DDP/RDMAP header of one ULPDU: the `Repr` of [`Packet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub opcode: Opcode,
    /// L: the last segment of its message.
    pub last: bool,
    pub model: Model,
}

impl Header {
    /// Parse a checked ULPDU; refuses only an untagged queue number other than the
    /// opcode's (everything else was checked by [`Packet::new_checked`]).
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Header> {
        let b = p.buffer.as_ref();
        let model = if p.opcode.tagged() {
            let r = TaggedRepr::parse(&TaggedPacket::new_unchecked(b))?;
            Model::Tagged {
                stag: r.stag,
                to: r.to,
            }
        } else {
            let r = UntaggedRepr::parse(&UntaggedPacket::new_unchecked(b))?;
            if r.qn != p.opcode.queue() {
                return Err(Error::BadQueue(r.qn));
            }
            Model::Untagged {
                inv_stag: r.ulp_word,
                qn: r.qn,
                msn: r.msn,
                mo: r.mo,
            }
        };
        Ok(Header {
            opcode: p.opcode(),
            last: p.last(),
            model,
        })
    }

    /// [`Packet::new_checked`] then [`Header::parse`]; with the payload.
    pub fn parse_bytes(ulpdu: &[u8]) -> Result<(Header, &[u8])> {
        let p = Packet::new_checked(ulpdu)?;
        Ok((Header::parse(&p)?, p.payload_ref()))
    }

    /// Bytes [`emit`](Self::emit) writes: 14 tagged, 18 untagged.
    pub const fn buffer_len(&self) -> usize {
        self.model.header_len()
    }

    /// Write the header to the start of `buf`, which must hold
    /// [`buffer_len`](Self::buffer_len) bytes (a shorter one panics; in a batch, emit into
    /// [`grow`](super::grow)). The T bit follows the model, whatever the opcode: a peer
    /// built to break the rules can say what it likes.
    pub fn emit(&self, buf: &mut [u8]) {
        let buf = &mut buf[..self.buffer_len()];
        let ulp_ctrl = self.opcode.control();
        match self.model {
            Model::Tagged { stag, to } => TaggedRepr {
                last: self.last,
                ulp_ctrl,
                stag,
                to,
            }
            .emit(&mut TaggedPacket::new_unchecked(buf)),
            Model::Untagged {
                inv_stag,
                qn,
                msn,
                mo,
            } => UntaggedRepr {
                last: self.last,
                ulp_ctrl,
                ulp_word: inv_stag,
                qn,
                msn,
                mo,
            }
            .emit(&mut UntaggedPacket::new_unchecked(buf)),
        }
    }

    /// [`emit`](Self::emit) into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.buffer_len()];
        self.emit(&mut v);
        v
    }
}

/// Size of the Read Request header.
pub const READ_REQUEST_LEN: usize = field::SRC_TO.end;

super::fixed_header_view!(ReadRequestPacket, READ_REQUEST_LEN, "a Read Request header");

impl<T: AsRef<[u8]>> ReadRequestPacket<T> {
    pub fn sink_stag(&self) -> u32 {
        rd32(self.b(), field::SINK_STAG)
    }

    pub fn sink_to(&self) -> u64 {
        rd64(self.b(), field::SINK_TO)
    }

    pub fn size(&self) -> u32 {
        rd32(self.b(), field::SIZE)
    }

    pub fn src_stag(&self) -> u32 {
        rd32(self.b(), field::SRC_STAG)
    }

    pub fn src_to(&self) -> u64 {
        rd64(self.b(), field::SRC_TO)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ReadRequestPacket<T> {
    pub fn set_sink_stag(&mut self, v: u32) {
        wr32(self.bm(), field::SINK_STAG, v);
    }

    pub fn set_sink_to(&mut self, v: u64) {
        wr64(self.bm(), field::SINK_TO, v);
    }

    pub fn set_size(&mut self, v: u32) {
        wr32(self.bm(), field::SIZE, v);
    }

    pub fn set_src_stag(&mut self, v: u32) {
        wr32(self.bm(), field::SRC_STAG, v);
    }

    pub fn set_src_to(&mut self, v: u64) {
        wr64(self.bm(), field::SRC_TO, v);
    }
}

/// A parsed Read Request header (RFC 5040 §4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ReadRequest {
    pub sink_stag: u32,
    pub sink_to: u64,
    pub size: u32,
    pub src_stag: u32,
    pub src_to: u64,
}

impl ReadRequest {
    pub fn parse<T: AsRef<[u8]>>(p: &ReadRequestPacket<T>) -> Result<ReadRequest> {
        Ok(ReadRequest {
            sink_stag: p.sink_stag(),
            sink_to: p.sink_to(),
            size: p.size(),
            src_stag: p.src_stag(),
            src_to: p.src_to(),
        })
    }

    /// A Read Request ULPDU's payload, which is exactly the header: `BadLength` otherwise.
    pub fn parse_bytes(payload: &[u8]) -> Result<ReadRequest> {
        if payload.len() != READ_REQUEST_LEN {
            return Err(Error::BadLength);
        }
        ReadRequest::parse(&ReadRequestPacket::new_checked(payload)?)
    }

    pub const fn buffer_len(&self) -> usize {
        READ_REQUEST_LEN
    }

    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut ReadRequestPacket<T>) {
        p.set_sink_stag(self.sink_stag);
        p.set_sink_to(self.sink_to);
        p.set_size(self.size);
        p.set_src_stag(self.src_stag);
        p.set_src_to(self.src_to);
    }

    /// [`emit`](Self::emit) into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; READ_REQUEST_LEN];
        self.emit(&mut ReadRequestPacket::new_unchecked(&mut v[..]));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Truncated;
    use proptest::prelude::*;

    fn any_opcode() -> impl Strategy<Value = Opcode> {
        (0u8..8).prop_map(|v| Opcode::from_u8(v).unwrap())
    }

    fn any_header() -> impl Strategy<Value = Header> {
        (any_opcode(), any::<bool>(), any::<(u32, u32, u32, u64)>()).prop_map(
            |(opcode, last, (a, b, c, to))| Header {
                opcode,
                last,
                model: if opcode.tagged() {
                    Model::Tagged { stag: a, to }
                } else {
                    Model::Untagged {
                        inv_stag: a,
                        qn: opcode.queue(),
                        msn: b,
                        mo: c,
                    }
                },
            },
        )
    }

    fn any_read_request() -> impl Strategy<Value = ReadRequest> {
        any::<(u32, u64, u32, u32, u64)>().prop_map(
            |(sink_stag, sink_to, size, src_stag, src_to)| ReadRequest {
                sink_stag,
                sink_to,
                size,
                src_stag,
                src_to,
            },
        )
    }

    mod read_request {
        use super::*;
        crate::wire::header_proptests!(
            ReadRequestPacket,
            ReadRequest,
            READ_REQUEST_LEN,
            any_read_request()
        );
    }

    #[test]
    fn read_request_layout_and_exact_length() {
        let r = ReadRequest {
            sink_stag: 0x0102_0304,
            sink_to: 0x0506_0708_090a_0b0c,
            size: 0x0d0e_0f10,
            src_stag: 0x1112_1314,
            src_to: 0x1516_1718_191a_1b1c,
        };
        let b = r.to_vec();
        assert_eq!(b, (1..=28).collect::<Vec<u8>>());
        assert_eq!(ReadRequest::parse_bytes(&b), Ok(r));
        assert_eq!(ReadRequest::parse_bytes(&b[..27]), Err(Error::BadLength));
        assert_eq!(
            ReadRequest::parse_bytes(&[&b[..], &[0]].concat()),
            Err(Error::BadLength)
        );
    }

    #[test]
    fn header_layout() {
        let h = Header {
            opcode: Opcode::ReadResponse,
            last: true,
            model: Model::Tagged {
                stag: 0x1234,
                to: 0x10,
            },
        };
        assert_eq!(
            h.to_vec(),
            [0xc1, 0x42, 0, 0, 0x12, 0x34, 0, 0, 0, 0, 0, 0, 0, 0x10]
        );
        let h = Header {
            opcode: Opcode::Terminate,
            last: true,
            model: Model::Untagged {
                inv_stag: 0,
                qn: QN_TERMINATE,
                msn: 1,
                mo: 0,
            },
        };
        assert_eq!(
            h.to_vec(),
            [0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0]
        );
    }

    /// The order of the checks decides which Terminate a malformed ULPDU draws; it is the
    /// order Linux siw checks in.
    #[test]
    fn control_bytes_are_judged_before_the_length() {
        let err = |b: &[u8]| Packet::new_checked(b).err();
        assert_eq!(
            err(&[0x41]),
            Some(Error::Truncated(Truncated { need: 2, have: 1 }))
        );
        assert_eq!(err(&[0x42, 0x43]), Some(Error::BadDdpVersion));
        assert_eq!(err(&[0x41, 0x83]), Some(Error::BadRdmapVersion));
        assert_eq!(err(&[0x41, 0x48]), Some(Error::UnknownOpcode(8)));
        assert_eq!(err(&[0x41, 0x40]), Some(Error::ModelMismatch)); // a Write, untagged
        assert_eq!(err(&[0xc1, 0x43]), Some(Error::ModelMismatch)); // a Send, tagged
        assert_eq!(
            err(&[0x41, 0x43, 0, 0]),
            Some(Error::Truncated(Truncated { need: 18, have: 4 }))
        );
        let mut send = Header {
            opcode: Opcode::Send,
            last: false,
            model: Model::Untagged {
                inv_stag: 0,
                qn: QN_READ,
                msn: 1,
                mo: 0,
            },
        }
        .to_vec();
        assert_eq!(Header::parse_bytes(&send), Err(Error::BadQueue(QN_READ)));
        send[9] = QN_SEND as u8;
        send[1] |= 0x30; // reserved bits are ignored
        let (h, payload) = Header::parse_bytes(&send).unwrap();
        assert_eq!((h.opcode, h.last, payload.len()), (Opcode::Send, false, 0));
    }

    /// The DDP/RDMAP header is not of one fixed size, so these are `header_proptests!`'s
    /// three properties written out for it.
    mod header {
        use super::*;

        proptest! {
            #[test]
            fn round_trip(h in any_header(), payload in proptest::collection::vec(any::<u8>(), 0..8)) {
                let mut b = vec![0x5au8; h.buffer_len() + 3];
                h.emit(&mut b);
                prop_assert_eq!(&b[h.buffer_len()..], &[0x5a, 0x5a, 0x5a][..], "writes only its own bytes");
                b.truncate(h.buffer_len());
                b.extend_from_slice(&payload);
                let p = Packet::new_checked(&b[..]).unwrap();
                prop_assert_eq!(Header::parse(&p).unwrap(), h);
                prop_assert_eq!(p.header_len(), h.buffer_len());
                prop_assert_eq!(p.payload(), &payload[..]);
            }

            #[test]
            fn truncated_rejected_at_every_length(h in any_header(), cut in any::<prop::sample::Index>()) {
                let b = h.to_vec();
                let len = cut.index(b.len());
                let need = if len < CONTROL_LEN { CONTROL_LEN } else { b.len() };
                prop_assert_eq!(Packet::new_checked(&b[..len]).err(), Some(Error::Truncated(Truncated { need, have: len })));
            }

            #[test]
            fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..40)) {
                if let Ok((h, payload)) = Header::parse_bytes(&b) {
                    let mut out = h.to_vec();
                    out.extend_from_slice(payload);
                    prop_assert_eq!(Header::parse_bytes(&out).unwrap(), (h, payload));
                    if h.opcode == Opcode::ReadRequest {
                        let _ = ReadRequest::parse_bytes(payload);
                    }
                }
            }
        }
    }
}
