//! RoCEv2 wire formats, as Linux `rdma_rxe` sends and expects them.
//!
//! Layout follows smoltcp's `wire` module: each header has a zero-copy view
//! `Packet<T: AsRef<[u8]>>` (built with `new_checked`, which refuses buffers that are too
//! short, so no accessor can index out of bounds; setters exist when `T: AsMut<[u8]>`) and a
//! high-level `Repr` with `parse`, `emit` and `buffer_len`. Nothing here panics on any input
//! and nothing here is `unsafe`.
//! The field helpers and the fixed-size view and property-test macros are shared with
//! `siw::wire` ([`rnicpi::wire`]).
//!
//! | module | what |
//! |---|---|
//! | [`bth`] | Base Transport Header (12 bytes) and 24-bit PSN arithmetic |
//! | [`reth`], [`aeth`], [`immdt`], [`ieth`], [`atomic_eth`], [`atomic_ack_eth`], [`deth`] | extension headers |
//! | [`opcode`] | every RC, UC and UD opcode with its header layout (as `rxe_opcode.c`) |
//! | [`roce`] | a whole RoCEv2 UDP payload: BTH, extension headers, payload, pad, ICRC |
//! | [`icrc`] | the RoCEv2 invariant CRC and the IP/UDP headers rxe would send |
//! | [`gso`] | a run of packets in one UDP segmentation-offload datagram (krdma on one host) |
//! | [`mad`] | the 24-byte MAD common header |
//! | [`cm`] | IB CM messages (REQ, MRA, REJ, REP, RTU, DREQ, DREP) |
//! | [`cma`] | the rdma_cm header at the start of REQ private data, and rdma_cm service IDs |
//!
//! Multi-byte fields are big-endian on the wire, except the ICRC, which rxe stores
//! little-endian (see [`icrc`]).
//!
//! Sending and receiving one packet:
//!
//! ```
//! use rxe::wire::{icrc, BthRepr, Opcode, RethRepr, RocePacket, RoceRepr};
//! use std::net::Ipv4Addr;
//!
//! // An RDMA WRITE Only of five bytes to QP 0x11 (from QP 0x12).
//! let mut tx = RoceRepr::new(BthRepr::new(Opcode::RcRdmaWriteOnly, 0x11, 100), b"hello");
//! tx.bth.ack_req = true;
//! tx.reth = Some(RethRepr { va: 0x1000, rkey: 0x1234, dma_len: 5 });
//! let roce = tx.to_vec()?; // BTH 12 + RETH 16 + payload 5 + pad 3 + ICRC 4
//! assert_eq!(roce.len(), 40);
//!
//! // Wrap it in UDP and IPv4 as rxe would, then fill the ICRC over the real headers.
//! let udp_len = (icrc::UDP_HEADER_LEN + roce.len()) as u16;
//! let (src, dst) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
//! let ip = icrc::ipv4_header_for(src, dst, 7, 64, 0, udp_len);
//! let mut udp = icrc::udp_header_for(icrc::udp_sport_for(0, 0x12, 0x11), udp_len).to_vec();
//! udp.extend_from_slice(&roce);
//! icrc::fill_ipv4(&ip, &mut udp)?;
//!
//! // The receiver checks the ICRC, then parses.
//! icrc::verify_ipv4(&ip, &udp)?;
//! let p = RocePacket::new_checked(&udp[icrc::UDP_HEADER_LEN..])?;
//! let rx = RoceRepr::parse(&p)?;
//! assert_eq!(rx.payload, b"hello");
//! assert_eq!(rx.reth.map(|r| r.rkey), Some(0x1234));
//! assert_eq!(p.pad_count(), 3);
//! # Ok::<(), rxe::wire::Error>(())
//! ```

use thiserror::Error;

pub mod aeth;
pub mod atomic_ack_eth;
pub mod atomic_eth;
pub mod bth;
pub mod cm;
pub mod cma;
pub mod deth;
pub mod gso;
pub mod icrc;
pub mod ieth;
pub mod immdt;
pub mod mad;
pub mod opcode;
pub mod reth;
pub mod roce;

pub use aeth::{NakCode, Packet as AethPacket, Repr as AethRepr, Syndrome};
pub use atomic_ack_eth::{Packet as AtomicAckEthPacket, Repr as AtomicAckEthRepr};
pub use atomic_eth::{Packet as AtomicEthPacket, Repr as AtomicEthRepr};
pub use bth::{psn_add, psn_diff, psn_lt, Packet as BthPacket, Repr as BthRepr, PSN_MASK};
pub use cm::{CmMad, CmMessage, CmPath};
pub use cma::CmaHdr;
pub use deth::{Packet as DethPacket, Repr as DethRepr};
pub use ieth::{Packet as IethPacket, Repr as IethRepr};
pub use immdt::{Packet as ImmDtPacket, Repr as ImmDtRepr};
pub use mad::{Packet as MadPacket, Repr as MadRepr};
pub use opcode::{Direction, ExtHeader, Opcode, Operation, Position, Transport};
pub use reth::{Packet as RethPacket, Repr as RethRepr};
pub use roce::{Packet as RocePacket, Repr as RoceRepr};

/// The UDP destination port of RoCEv2 (IANA "roce").
pub const ROCEV2_UDP_PORT: u16 = 4791;

/// Why bytes were refused, or why a `Repr` could not be emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Error {
    /// The buffer is shorter than the structure (or the packet's headers) require.
    #[error("buffer too short: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    /// A buffer of fixed size (a MAD) has the wrong length.
    #[error("wrong length: expected {expected} bytes, have {have}")]
    BadLength { expected: usize, have: usize },
    /// The BTH opcode is not an RC, UC or UD opcode that rxe implements.
    #[error("unknown or unsupported BTH opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// BTH transport header version other than 0.
    #[error("unsupported BTH transport version {0}")]
    BadTransportVersion(u8),
    /// The pad count is larger than the payload, or payload + pad is not a multiple of 4.
    #[error("pad count {pad} does not fit a payload area of {area} bytes")]
    BadPad { pad: u8, area: usize },
    /// An opcode that carries no payload (ACK, Read Request, atomics) has payload bytes.
    #[error("opcode {opcode:#04x} carries no payload but {len} bytes follow its headers")]
    UnexpectedPayload { opcode: u8, len: usize },
    /// A `Repr` to emit has an extension header the opcode does not take, or lacks one it needs.
    #[error("extension headers do not match opcode {opcode:#04x} ({header:?})")]
    HeaderMismatch { opcode: u8, header: ExtHeader },
    /// The AETH syndrome uses a reserved encoding.
    #[error("reserved AETH syndrome {0:#04x}")]
    ReservedSyndrome(u8),
    /// The ICRC in the packet is not the one computed.
    #[error("ICRC mismatch: packet has {found:#010x}, computed {computed:#010x}")]
    BadIcrc { found: u32, computed: u32 },
    /// The IP header is not one the ICRC can be computed over (wrong version, options,
    /// IPv6 extension headers, not UDP, lengths disagree).
    #[error("unsupported IP header: {0}")]
    BadIpHeader(&'static str),
    /// MAD base version other than 1.
    #[error("unsupported MAD base version {0}")]
    BadMadVersion(u8),
    /// A MAD that is not a CM MAD (management class 0x07, class version 2).
    #[error("not a CM MAD: class {class:#04x} version {version}")]
    NotCm { class: u8, version: u8 },
    /// A CM attribute this module does not decode.
    #[error("unsupported CM attribute {0:#06x}")]
    UnknownCmAttribute(u16),
    /// rdma_cm header with a version other than 0.
    #[error("unsupported rdma_cm header version {0}")]
    BadCmaVersion(u8),
    /// rdma_cm header IP version nibble other than 4 or 6.
    #[error("unsupported rdma_cm IP version {0}")]
    BadCmaIpVersion(u8),
    /// A value does not fit its field (e.g. mixed IPv4/IPv6 addresses in an rdma_cm header).
    #[error("value out of range for {0}")]
    FieldRange(&'static str),
}

/// Result with this module's [`Error`](enum@Error).
pub type Result<T> = core::result::Result<T, Error>;

impl From<rnicpi::wire::Truncated> for Error {
    fn from(t: rnicpi::wire::Truncated) -> Error {
        Error::Truncated {
            need: t.need,
            have: t.have,
        }
    }
}

/// `Err(Truncated)` unless `have >= need`.
pub(crate) fn need(need: usize, have: usize) -> Result<()> {
    Ok(rnicpi::wire::check_len(need, have)?)
}

/// [`rnicpi::fixed_header_view!`] for a header module here: its `Packet`, with [`Error`].
macro_rules! fixed_header_view {
    ($len:expr, $what:literal) => {
        rnicpi::fixed_header_view!(Packet, $len, $what, $crate::wire::Error);
    };
}
pub(crate) use fixed_header_view;

/// [`rnicpi::header_proptests!`] for a header module's `Packet`, `Repr` and `HEADER_LEN`,
/// given a strategy for `Repr`.
#[cfg(test)]
macro_rules! header_proptests {
    ($strategy:expr) => {
        rnicpi::header_proptests!(Packet, Repr, HEADER_LEN, $strategy, $crate::wire::Error);
    };
}
#[cfg(test)]
pub(crate) use header_proptests;
