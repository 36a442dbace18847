//! iWARP wire formats, as Linux kernel siw sends and expects them: MPA (RFC 5044, with the
//! RFC 6581 enhanced connection set-up), DDP (RFC 5041) and RDMAP (RFC 5040).
//!
//! Layout follows smoltcp's `wire` module, as `rxe::wire` does: each header has a `mod
//! field` of byte ranges, a zero-copy view `Packet<T: AsRef<[u8]>>` (built with
//! `new_checked`, which refuses buffers too short for it, so no accessor can index out of
//! bounds; setters exist when `T: AsMut<[u8]>`) and a `Repr` with `parse`, `emit` and
//! `buffer_len`. Nothing here panics on any input and nothing here is `unsafe`. The field
//! helpers and the fixed-size view and property-test macros are [`rnicpi::wire`]'s.
//!
//! | module | what |
//! |---|---|
//! | [`mpa`] | MPA Request and Reply: the 20-byte header, the RFC 6581 IRD/ORD words, private data |
//! | [`fpdu`] | FPDU framing: ULPDU length, pad, CRC32c; the incremental [`FpduDecoder`] |
//! | [`ddp`] | DDP segment headers: tagged (14 bytes) and untagged (18 bytes), the typed [`Model`] |
//! | [`rdmap`] | RDMAP over DDP: opcodes, a ULPDU's checked view and its [`Header`]; the Read Request |
//! | [`term`] | Terminate: the control field, the layer / error type / error code values |
//!
//! Multi-byte fields are big-endian on the wire, except the FPDU's CRC, which kernel siw
//! stores little-endian (see [`fpdu`]).
//!
//! Building an FPDU into a batch, and taking it apart again:
//!
//! ```
//! use siw::wire::{self, FpduPacket, Header, Model, Opcode, RdmapPacket, QN_SEND};
//!
//! // A Send of five bytes, message 1, in an FPDU with CRC.
//! let mut batch = Vec::new();
//! let start = wire::begin_fpdu(&mut batch);
//! let h = Header {
//!     opcode: Opcode::Send,
//!     last: true,
//!     model: Model::Untagged { inv_stag: 0, qn: QN_SEND, msn: 1, mo: 0 },
//! };
//! h.emit(wire::grow(&mut batch, h.buffer_len()));
//! batch.extend_from_slice(b"hello");
//! wire::finish_fpdu(&mut batch, start, true)?;
//! assert_eq!(batch.len(), 32); // length 2 + header 18 + payload 5 + pad 3 + CRC 4
//!
//! // The receiver frames it, checks the CRC, then parses the ULPDU.
//! let f = FpduPacket::new_checked(&batch[..])?;
//! f.check_crc()?;
//! let u = RdmapPacket::new_checked(f.ulpdu())?;
//! assert_eq!(Header::parse(&u)?, h);
//! assert_eq!(u.payload(), b"hello");
//! # Ok::<(), siw::wire::Error>(())
//! ```

pub use rnicpi::wire::Truncated;
use thiserror::Error;

pub mod ddp;
pub mod fpdu;
pub mod mpa;
pub mod rdmap;
pub mod term;

pub use ddp::Model;
pub use fpdu::{
    begin_fpdu, check_fpdu, finish_fpdu, finish_fpdu_lent, fpdu_len, max_ulpdu_for_mss,
    FpduDecoder, Framing, Packet as FpduPacket,
};
pub use mpa::{Frame as MpaFrame, Packet as MpaPacket};
pub use rdmap::{
    Header, Opcode, Packet as RdmapPacket, ReadRequest, ReadRequestPacket, QN_READ, QN_SEND,
    QN_TERMINATE,
};
pub use term::TermCode;

/// Why bytes from the wire were refused, or why a `Repr` could not be emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the structure (or the length it announces) requires.
    #[error(transparent)]
    Truncated(#[from] Truncated),
    #[error("bad MPA key")]
    BadKey,
    #[error("unsupported MPA revision {0}")]
    BadRevision(u8),
    #[error("private data too long")]
    PrivateDataTooLong,
    /// A length that does not fit: a ULPDU over 65535 bytes, an RFC 6581 frame without
    /// room for its IRD/ORD words, a Read Request payload other than 28 bytes.
    #[error("bad length")]
    BadLength,
    #[error("CRC mismatch")]
    BadCrc,
    #[error("bad DDP version")]
    BadDdpVersion,
    #[error("bad RDMAP version")]
    BadRdmapVersion,
    #[error("unknown RDMAP opcode {0}")]
    UnknownOpcode(u8),
    #[error("opcode does not match the buffer model (tagged/untagged)")]
    ModelMismatch,
    #[error("invalid queue number {0}")]
    BadQueue(u32),
}

/// Result with this module's [`Error`](enum@Error).
pub type Result<T> = core::result::Result<T, Error>;

/// Append `len` zero bytes to `out` and return them: the room a header is emitted into
/// when FPDUs are built in a batch (no allocation once the batch has its capacity).
pub fn grow(out: &mut Vec<u8>, len: usize) -> &mut [u8] {
    let at = out.len();
    out.resize(at + len, 0);
    &mut out[at..]
}

/// [`rnicpi::fixed_header_view!`] with this module's [`Error`].
macro_rules! fixed_header_view {
    ($name:ident, $len:expr, $what:literal) => {
        rnicpi::fixed_header_view!($name, $len, $what, $crate::wire::Error);
    };
}
pub(crate) use fixed_header_view;

/// [`rnicpi::header_proptests!`] with this module's [`Error`].
#[cfg(test)]
macro_rules! header_proptests {
    ($packet:ident, $repr:ty, $len:expr, $strategy:expr) => {
        rnicpi::header_proptests!($packet, $repr, $len, $strategy, $crate::wire::Error);
    };
}
#[cfg(test)]
pub(crate) use header_proptests;
