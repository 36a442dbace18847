//! The SDP wire format (InfiniBand Architecture Specification Vol. 1, Annex A4): the Base
//! Sockets Direct Header every message starts with, the extended headers of the messages
//! that have one, and the Hello / HelloAck carried in the connection's private data.
//!
//! Multi-byte fields are big-endian. [`Message::parse`] takes one received message (the
//! bytes of one receive completion) and checks it completely — length field against the
//! bytes received, extended header present, reserved MIDs refused — so nothing past this
//! module ever sees a malformed message. Nothing here panics on any input.
//!
//! | MID | message | extended header |
//! |---|---|---|
//! | 0x00 | Hello | HH (48 bytes) |
//! | 0x01 | HelloAck | HAH (48 bytes, 8 used) |
//! | 0x02 | DisConn | — |
//! | 0x03 | AbortConn | — |
//! | 0x04 | SendSm | — |
//! | 0x05 | RdmaWrCompl | RWCH: size (4) |
//! | 0x06 | RdmaRdCompl | RRCH: size (4) |
//! | 0x07 | ModeChange | MCH: flags (1) + 3 reserved |
//! | 0x08 | SrcAvailCancel | — |
//! | 0x09 | SinkAvailCancel | — |
//! | 0x0A | SinkCancelAck | — |
//! | 0x0B | ChRcvBuf | CRBH: size (4) |
//! | 0x0C | ChRcvBufAck | CRBAH: size (4) |
//! | 0x0D | SuspComm | SCH: service ID (8) |
//! | 0x0E | SuspCommAck | — |
//! | 0xFD | SinkAvail | SNKAH: size, rkey, addr, non-discarded (20) |
//! | 0xFE | SrcAvail | SRCAH: size, rkey, addr (16), then optional data |
//! | 0xFF | Data | — (data follows the BSDH) |
//!
//! Over 600 lines: every message of Annex A4 (the first 580 lines); the rest are tests.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use thiserror::Error;

/// Length of the Base Sockets Direct Header.
pub const BSDH_LEN: usize = 16;
/// Length of the Hello header (HH) and of the HelloAck header (HAH) as sent.
pub const HH_LEN: usize = 48;
/// The shortest Hello accepted: BSDH and the HH up to and including the source address
/// (the destination is the address the request arrived at; see [`Hello::parse`]).
pub const HELLO_MIN_LEN: usize = BSDH_LEN + 32;
/// The bytes [`Message::parse_head`] needs of any message (BSDH and the longest
/// extended header of a message sent over the connection, SinkAvail's).
pub const PREFIX_LEN: usize = BSDH_LEN + 20;
/// Protocol version sent in Hello and HelloAck: major 2, minor 2 (as OFED's SDP).
pub const VERSION: u8 = 0x22;
/// Hello capability bit: the sender accepts Send with Invalidate.
pub const CAP_INVALIDATE: u8 = 0x1;

/// BSDH flag: this message carries out-of-band data (its last data byte).
pub const FLAG_OOB_PRES: u8 = 0x1;
/// BSDH flag: out-of-band data is pending (the urgent mark is ahead).
pub const FLAG_OOB_PEND: u8 = 0x2;
/// BSDH flag (Annex A4 gen-1): request a change to pipelined mode. Never sent here.
pub const FLAG_REQ_PIPE: u8 = 0x4;

/// Why a message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Error {
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    #[error("length field {field} does not match the {have} bytes received")]
    LengthMismatch { field: u32, have: usize },
    #[error("reserved or unknown message id {0:#04x}")]
    UnknownMid(u8),
    #[error("reserved flag bits {0:#04x} set")]
    ReservedFlags(u8),
    #[error("unsupported protocol version {0:#04x}")]
    Version(u8),
    #[error("bad IP version nibble {0}")]
    IpVersion(u8),
    #[error("out-of-band flag on a message without data")]
    OobWithoutData,
}

pub type Result<T> = std::result::Result<T, Error>;

fn need(need: usize, have: usize) -> Result<()> {
    if have < need {
        Err(Error::Truncated { need, have })
    } else {
        Ok(())
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

/// Message identifiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Mid {
    Hello = 0x00,
    HelloAck = 0x01,
    DisConn = 0x02,
    AbortConn = 0x03,
    SendSm = 0x04,
    RdmaWrCompl = 0x05,
    RdmaRdCompl = 0x06,
    ModeChange = 0x07,
    SrcAvailCancel = 0x08,
    SinkAvailCancel = 0x09,
    SinkCancelAck = 0x0A,
    ChRcvBuf = 0x0B,
    ChRcvBufAck = 0x0C,
    SuspComm = 0x0D,
    SuspCommAck = 0x0E,
    SinkAvail = 0xFD,
    SrcAvail = 0xFE,
    Data = 0xFF,
}

impl Mid {
    pub fn from_u8(v: u8) -> Option<Mid> {
        use Mid::*;
        Some(match v {
            0x00 => Hello,
            0x01 => HelloAck,
            0x02 => DisConn,
            0x03 => AbortConn,
            0x04 => SendSm,
            0x05 => RdmaWrCompl,
            0x06 => RdmaRdCompl,
            0x07 => ModeChange,
            0x08 => SrcAvailCancel,
            0x09 => SinkAvailCancel,
            0x0A => SinkCancelAck,
            0x0B => ChRcvBuf,
            0x0C => ChRcvBufAck,
            0x0D => SuspComm,
            0x0E => SuspCommAck,
            0xFD => SinkAvail,
            0xFE => SrcAvail,
            0xFF => Data,
            _ => return None,
        })
    }

    /// Length of this message's extended header (after the BSDH).
    pub fn ext_len(self) -> usize {
        match self {
            Mid::Hello | Mid::HelloAck => HH_LEN,
            Mid::RdmaWrCompl | Mid::RdmaRdCompl | Mid::ChRcvBuf | Mid::ChRcvBufAck => 4,
            Mid::ModeChange => 4,
            Mid::SuspComm => 8,
            Mid::SinkAvail => 20,
            Mid::SrcAvail => 16,
            _ => 0,
        }
    }
}

/// The Base Sockets Direct Header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bsdh {
    pub mid: u8,
    pub flags: u8,
    /// Receive buffers the sender has posted (its credit advertisement).
    pub bufs: u16,
    /// Total message length, this header included.
    pub len: u32,
    /// The sender's sequence number of this message.
    pub mseq: u32,
    /// The last sequence number the sender received from its peer.
    pub mseq_ack: u32,
}

impl Bsdh {
    pub fn parse(b: &[u8]) -> Result<Bsdh> {
        need(BSDH_LEN, b.len())?;
        Ok(Bsdh {
            mid: b[0],
            flags: b[1],
            bufs: be16(b, 2),
            len: be32(b, 4),
            mseq: be32(b, 8),
            mseq_ack: be32(b, 12),
        })
    }

    /// Write the header into the first 16 bytes of `out` (which must hold them).
    pub fn emit(&self, out: &mut [u8]) {
        out[0] = self.mid;
        out[1] = self.flags;
        out[2..4].copy_from_slice(&self.bufs.to_be_bytes());
        out[4..8].copy_from_slice(&self.len.to_be_bytes());
        out[8..12].copy_from_slice(&self.mseq.to_be_bytes());
        out[12..16].copy_from_slice(&self.mseq_ack.to_be_bytes());
    }
}

/// A zero-copy advertisement: `size` bytes at `addr` under `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Advert {
    pub size: u32,
    pub rkey: u32,
    pub addr: u64,
}

/// One SDP message after the BSDH, as [`Message::parse`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body<'a> {
    Hello(Hello),
    HelloAck(HelloAck),
    DisConn,
    AbortConn,
    SendSm,
    RdmaWrCompl {
        size: u32,
    },
    RdmaRdCompl {
        size: u32,
    },
    /// `flags`: bits 4–6 the mode (0 buffered, 1 combined, 2 pipelined), bit 7 set for the
    /// send side.
    ModeChange {
        flags: u8,
    },
    SrcAvailCancel,
    SinkAvailCancel,
    SinkCancelAck,
    ChRcvBuf {
        size: u32,
    },
    ChRcvBufAck {
        size: u32,
    },
    SuspComm {
        service_id: u64,
    },
    SuspCommAck,
    SinkAvail {
        advert: Advert,
        non_discarded: u32,
    },
    /// The source's buffer, and the first bytes of it sent along (may be empty).
    SrcAvail {
        advert: Advert,
        data: &'a [u8],
    },
    Data(&'a [u8]),
}

impl Body<'_> {
    pub fn mid(&self) -> Mid {
        match self {
            Body::Hello(_) => Mid::Hello,
            Body::HelloAck(_) => Mid::HelloAck,
            Body::DisConn => Mid::DisConn,
            Body::AbortConn => Mid::AbortConn,
            Body::SendSm => Mid::SendSm,
            Body::RdmaWrCompl { .. } => Mid::RdmaWrCompl,
            Body::RdmaRdCompl { .. } => Mid::RdmaRdCompl,
            Body::ModeChange { .. } => Mid::ModeChange,
            Body::SrcAvailCancel => Mid::SrcAvailCancel,
            Body::SinkAvailCancel => Mid::SinkAvailCancel,
            Body::SinkCancelAck => Mid::SinkCancelAck,
            Body::ChRcvBuf { .. } => Mid::ChRcvBuf,
            Body::ChRcvBufAck { .. } => Mid::ChRcvBufAck,
            Body::SuspComm { .. } => Mid::SuspComm,
            Body::SuspCommAck => Mid::SuspCommAck,
            Body::SinkAvail { .. } => Mid::SinkAvail,
            Body::SrcAvail { .. } => Mid::SrcAvail,
            Body::Data(_) => Mid::Data,
        }
    }

    /// The data bytes the message carries.
    pub fn data(&self) -> &[u8] {
        match self {
            Body::Data(d) | Body::SrcAvail { data: d, .. } => d,
            _ => &[],
        }
    }
}

/// A whole message: header and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    pub bsdh: Bsdh,
    pub body: Body<'a>,
}

impl<'a> Message<'a> {
    /// Parse one received message. The BSDH's length must equal the bytes received
    /// (a Hello may be shorter than its full 64 bytes, down to [`HELLO_MIN_LEN`]: the
    /// private data of an InfiniBand CM REQ has room for no more after the RDMA CM header).
    pub fn parse(b: &'a [u8]) -> Result<Message<'a>> {
        Self::parse_head(b, b.len())
    }

    /// Parse a message of `total` bytes from its first bytes, `prefix` (at least the
    /// header and extended header, [`PREFIX_LEN`] bytes or all of a shorter message):
    /// everything is checked as in [`parse`](Self::parse), and the body's data is the
    /// part of the payload inside `prefix` (the payload is `total` less
    /// [`header_len`](Self::header_len)), so a receiver need not copy a payload out of
    /// its receive buffer to learn what the message is.
    pub fn parse_head(prefix: &'a [u8], total: usize) -> Result<Message<'a>> {
        let b = prefix;
        let bsdh = Bsdh::parse(b)?;
        let mid = Mid::from_u8(bsdh.mid).ok_or(Error::UnknownMid(bsdh.mid))?;
        if bsdh.flags & !(FLAG_OOB_PRES | FLAG_OOB_PEND | FLAG_REQ_PIPE) != 0 {
            return Err(Error::ReservedFlags(bsdh.flags));
        }
        // Private data arrives padded (the IB CM has no length field): a Hello or
        // HelloAck is as long as its length field says, the rest is padding.
        let msg = if matches!(mid, Mid::Hello | Mid::HelloAck) {
            let len = bsdh.len as usize;
            need(len.max(BSDH_LEN), total)?;
            need(len.max(BSDH_LEN), b.len())?;
            &b[..len.max(BSDH_LEN)]
        } else {
            if bsdh.len as usize != total {
                return Err(Error::LengthMismatch {
                    field: bsdh.len,
                    have: total,
                });
            }
            need(BSDH_LEN + mid.ext_len(), total)?;
            need((BSDH_LEN + mid.ext_len()).min(total), b.len())?;
            b
        };
        let ext = &msg[BSDH_LEN..];
        if mid == Mid::HelloAck {
            need(BSDH_LEN + 8, msg.len())?;
        }
        let advert = |e: &[u8]| Advert {
            size: be32(e, 0),
            rkey: be32(e, 4),
            addr: be64(e, 8),
        };
        let body = match mid {
            Mid::Hello => Body::Hello(Hello::parse_ext(ext)?),
            Mid::HelloAck => Body::HelloAck(HelloAck::parse_ext(ext)?),
            Mid::DisConn => Body::DisConn,
            Mid::AbortConn => Body::AbortConn,
            Mid::SendSm => Body::SendSm,
            Mid::RdmaWrCompl => Body::RdmaWrCompl { size: be32(ext, 0) },
            Mid::RdmaRdCompl => Body::RdmaRdCompl { size: be32(ext, 0) },
            Mid::ModeChange => Body::ModeChange { flags: ext[0] },
            Mid::SrcAvailCancel => Body::SrcAvailCancel,
            Mid::SinkAvailCancel => Body::SinkAvailCancel,
            Mid::SinkCancelAck => Body::SinkCancelAck,
            Mid::ChRcvBuf => Body::ChRcvBuf { size: be32(ext, 0) },
            Mid::ChRcvBufAck => Body::ChRcvBufAck { size: be32(ext, 0) },
            Mid::SuspComm => Body::SuspComm {
                service_id: be64(ext, 0),
            },
            Mid::SuspCommAck => Body::SuspCommAck,
            Mid::SinkAvail => Body::SinkAvail {
                advert: advert(ext),
                non_discarded: be32(ext, 16),
            },
            Mid::SrcAvail => Body::SrcAvail {
                advert: advert(ext),
                data: &ext[16..],
            },
            Mid::Data => Body::Data(ext),
        };
        let has_payload = matches!(mid, Mid::Data | Mid::SrcAvail) && total > Self::header_len(mid);
        if bsdh.flags & FLAG_OOB_PRES != 0 && !has_payload {
            return Err(Error::OobWithoutData);
        }
        Ok(Message { bsdh, body })
    }

    /// Length of the header and extended header of a message with this id.
    pub fn header_len(mid: Mid) -> usize {
        BSDH_LEN + mid.ext_len()
    }

    /// Bytes [`emit`](Self::emit) writes.
    pub fn buffer_len(&self) -> usize {
        let ext = match &self.body {
            Body::Hello(h) if h.dst.is_none() => HELLO_MIN_LEN - BSDH_LEN,
            b => b.mid().ext_len(),
        };
        BSDH_LEN + ext + self.body.data().len()
    }

    /// Write the message into `out` (at least [`buffer_len`](Self::buffer_len) bytes);
    /// the BSDH's `mid` and `len` are set from the body. Returns the length written.
    pub fn emit(&self, out: &mut [u8]) -> usize {
        let len = self.buffer_len();
        let mut h = self.bsdh;
        h.mid = self.body.mid() as u8;
        h.len = len as u32;
        h.emit(out);
        let e = &mut out[BSDH_LEN..len];
        let put_advert = |e: &mut [u8], a: &Advert| {
            e[0..4].copy_from_slice(&a.size.to_be_bytes());
            e[4..8].copy_from_slice(&a.rkey.to_be_bytes());
            e[8..16].copy_from_slice(&a.addr.to_be_bytes());
        };
        match &self.body {
            Body::Hello(hh) => hh.emit_ext(e),
            Body::HelloAck(hah) => hah.emit_ext(e),
            Body::RdmaWrCompl { size }
            | Body::RdmaRdCompl { size }
            | Body::ChRcvBuf { size }
            | Body::ChRcvBufAck { size } => e.copy_from_slice(&size.to_be_bytes()),
            Body::ModeChange { flags } => e.copy_from_slice(&[*flags, 0, 0, 0]),
            Body::SuspComm { service_id } => e.copy_from_slice(&service_id.to_be_bytes()),
            Body::SinkAvail {
                advert,
                non_discarded,
            } => {
                put_advert(e, advert);
                e[16..20].copy_from_slice(&non_discarded.to_be_bytes());
            }
            Body::SrcAvail { advert, data } => {
                put_advert(e, advert);
                e[16..].copy_from_slice(data);
            }
            Body::Data(d) => e.copy_from_slice(d),
            Body::DisConn
            | Body::AbortConn
            | Body::SendSm
            | Body::SrcAvailCancel
            | Body::SinkAvailCancel
            | Body::SinkCancelAck
            | Body::SuspCommAck => {}
        }
        len
    }

    /// The message as a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0; self.buffer_len()];
        self.emit(&mut v);
        v
    }
}

fn ip_version(addr: &IpAddr) -> u8 {
    if addr.is_ipv4() {
        4
    } else {
        6
    }
}

/// An address in the HH's 16-byte form: IPv4 in the last four bytes.
fn addr_bytes(addr: &IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[12..].copy_from_slice(&a.octets());
            b
        }
        IpAddr::V6(a) => a.octets(),
    }
}

fn addr_from(ipv: u8, b: &[u8]) -> IpAddr {
    if ipv == 4 {
        IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15]))
    } else {
        let mut o = [0u8; 16];
        o.copy_from_slice(&b[..16]);
        IpAddr::V6(Ipv6Addr::from(o))
    }
}

/// The Hello header: the active side's socket and its buffer offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub version: u8,
    pub capabilities: u8,
    /// Zero-copy adverts the sender will have outstanding at once.
    pub max_adverts: u8,
    /// The receive-buffer size the sender would like its peer to use.
    pub des_rem_rcv_sz: u32,
    /// The size of the sender's own receive buffers (what the peer may send in one message).
    pub local_rcv_sz: u32,
    /// The sender's (source) port.
    pub port: u16,
    pub src: IpAddr,
    /// `None` when the message was cut before it (the receiver knows where the request
    /// arrived).
    pub dst: Option<IpAddr>,
}

impl Hello {
    fn parse_ext(e: &[u8]) -> Result<Hello> {
        need(32, e.len())?;
        if e[0] >> 4 != VERSION >> 4 {
            return Err(Error::Version(e[0]));
        }
        let ipv = e[1] >> 4;
        if ipv != 4 && ipv != 6 {
            return Err(Error::IpVersion(ipv));
        }
        Ok(Hello {
            version: e[0],
            capabilities: e[1] & 0xf,
            max_adverts: e[3],
            des_rem_rcv_sz: be32(e, 4),
            local_rcv_sz: be32(e, 8),
            port: be16(e, 12),
            src: addr_from(ipv, &e[16..32]),
            dst: (e.len() >= 48).then(|| addr_from(ipv, &e[32..48])),
        })
    }

    fn emit_ext(&self, e: &mut [u8]) {
        e.fill(0);
        e[0] = self.version;
        e[1] = (ip_version(&self.src) << 4) | (self.capabilities & 0xf);
        e[3] = self.max_adverts;
        e[4..8].copy_from_slice(&self.des_rem_rcv_sz.to_be_bytes());
        e[8..12].copy_from_slice(&self.local_rcv_sz.to_be_bytes());
        e[12..14].copy_from_slice(&self.port.to_be_bytes());
        e[16..32].copy_from_slice(&addr_bytes(&self.src));
        if let Some(d) = &self.dst {
            e[32..48].copy_from_slice(&addr_bytes(d));
        }
    }
}

/// The HelloAck header: the passive side's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloAck {
    pub version: u8,
    pub ip_version: u8,
    pub capabilities: u8,
    pub ext_max_adverts: u8,
    /// The size of the passive side's receive buffers.
    pub act_rcv_sz: u32,
}

impl HelloAck {
    fn parse_ext(e: &[u8]) -> Result<HelloAck> {
        need(8, e.len())?;
        if e[0] >> 4 != VERSION >> 4 {
            return Err(Error::Version(e[0]));
        }
        Ok(HelloAck {
            version: e[0],
            ip_version: e[1] >> 4,
            capabilities: e[1] & 0xf,
            ext_max_adverts: e[3],
            act_rcv_sz: be32(e, 4),
        })
    }

    fn emit_ext(&self, e: &mut [u8]) {
        e.fill(0);
        e[0] = self.version;
        e[1] = (self.ip_version << 4) | (self.capabilities & 0xf);
        e[3] = self.ext_max_adverts;
        e[4..8].copy_from_slice(&self.act_rcv_sz.to_be_bytes());
    }
}

/// The Hello as the private data of a connection request, cut to `limit` bytes when the
/// transport carries fewer than 64 (InfiniBand CM REQ after the RDMA CM header: 56): the
/// length field then says how much was sent.
pub fn hello_private_data(bsdh: Bsdh, hello: &Hello, limit: usize) -> Vec<u8> {
    let mut v = Message {
        bsdh,
        body: Body::Hello(*hello),
    }
    .to_vec();
    let len = v.len().min(limit.max(HELLO_MIN_LEN));
    v.truncate(len);
    v[4..8].copy_from_slice(&(len as u32).to_be_bytes());
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_hello() -> Hello {
        Hello {
            version: VERSION,
            capabilities: CAP_INVALIDATE,
            max_adverts: 1,
            des_rem_rcv_sz: 65536,
            local_rcv_sz: 8192,
            port: 40000,
            src: "10.0.0.1".parse().unwrap(),
            dst: Some("10.0.0.2".parse().unwrap()),
        }
    }

    #[test]
    fn bsdh_layout() {
        let h = Bsdh {
            mid: 0xff,
            flags: 1,
            bufs: 0x0102,
            len: 0x0304_0506,
            mseq: 0x0708_090a,
            mseq_ack: 0x0b0c_0d0e,
        };
        let mut b = [0u8; 16];
        h.emit(&mut b);
        assert_eq!(b, [0xff, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
        assert_eq!(Bsdh::parse(&b).unwrap(), h);
    }

    #[test]
    fn every_message_round_trips() {
        let a = Advert {
            size: 1 << 20,
            rkey: 0xdead_beef,
            addr: 0x7f00_1234_5678,
        };
        let bodies = [
            Body::Hello(sample_hello()),
            Body::HelloAck(HelloAck {
                version: VERSION,
                ip_version: 4,
                capabilities: 0,
                ext_max_adverts: 0,
                act_rcv_sz: 16384,
            }),
            Body::DisConn,
            Body::AbortConn,
            Body::SendSm,
            Body::RdmaWrCompl { size: 77 },
            Body::RdmaRdCompl { size: 78 },
            Body::ModeChange { flags: 0x90 },
            Body::SrcAvailCancel,
            Body::SinkAvailCancel,
            Body::SinkCancelAck,
            Body::ChRcvBuf { size: 65536 },
            Body::ChRcvBufAck { size: 32768 },
            Body::SuspComm {
                service_id: 0x10000 | 5001,
            },
            Body::SuspCommAck,
            Body::SinkAvail {
                advert: a,
                non_discarded: 3,
            },
            Body::SrcAvail {
                advert: a,
                data: b"head",
            },
            Body::Data(b"hello, world"),
        ];
        for (i, body) in bodies.into_iter().enumerate() {
            let m = Message {
                bsdh: Bsdh {
                    bufs: 7,
                    mseq: i as u32,
                    mseq_ack: 100 + i as u32,
                    ..Bsdh::default()
                },
                body,
            };
            let v = m.to_vec();
            let back = Message::parse(&v).unwrap();
            assert_eq!(back.body, m.body, "mid {:?}", m.body.mid());
            assert_eq!(back.bsdh.mid, m.body.mid() as u8);
            assert_eq!(back.bsdh.len as usize, v.len());
        }
    }

    #[test]
    fn hello_cut_for_ib_cm_keeps_the_source() {
        let pd = hello_private_data(Bsdh::default(), &sample_hello(), 56);
        assert_eq!(pd.len(), 56);
        let mut padded = pd.clone();
        padded.resize(92, 0); // what arrives: the whole field, zero padded
        let m = Message::parse(&padded).unwrap();
        let Body::Hello(h) = m.body else { panic!() };
        assert_eq!(h.src, sample_hello().src);
        assert_eq!(h.dst, None);
        assert_eq!(h.local_rcv_sz, 8192);
        // Full length where the transport carries it.
        let full = hello_private_data(Bsdh::default(), &sample_hello(), 508);
        assert_eq!(full.len(), 64);
        let Body::Hello(h) = Message::parse(&full).unwrap().body else {
            panic!()
        };
        assert_eq!(h, sample_hello());
    }

    #[test]
    fn malformed_refused() {
        let data = Message {
            bsdh: Bsdh::default(),
            body: Body::Data(b"abc"),
        }
        .to_vec();
        // Length field says more or less than arrived.
        assert!(matches!(
            Message::parse(&data[..data.len() - 1]),
            Err(Error::LengthMismatch { .. })
        ));
        let mut longer = data.clone();
        longer.push(0);
        assert!(matches!(
            Message::parse(&longer),
            Err(Error::LengthMismatch { .. })
        ));
        // Reserved MID, reserved flags.
        let mut bad = data.clone();
        bad[0] = 0xf0;
        assert_eq!(Message::parse(&bad), Err(Error::UnknownMid(0xf0)));
        let mut bad = data.clone();
        bad[1] = 0x80;
        assert_eq!(Message::parse(&bad), Err(Error::ReservedFlags(0x80)));
        // A SrcAvail without its header.
        let mut short = Message {
            bsdh: Bsdh::default(),
            body: Body::SendSm,
        }
        .to_vec();
        short[0] = Mid::SrcAvail as u8;
        assert!(matches!(
            Message::parse(&short),
            Err(Error::Truncated { .. })
        ));
        // OOB on an empty message.
        let mut oob = Message {
            bsdh: Bsdh::default(),
            body: Body::Data(b""),
        }
        .to_vec();
        oob[1] = FLAG_OOB_PRES;
        assert_eq!(Message::parse(&oob), Err(Error::OobWithoutData));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..128)) {
            if let Ok(m) = Message::parse(&b) {
                // Whatever parses re-emits to something that parses the same.
                let again = m.to_vec();
                let m2 = Message::parse(&again).unwrap();
                prop_assert_eq!(m2.body, m.body);
            }
        }

        #[test]
        fn data_round_trips(d in proptest::collection::vec(any::<u8>(), 0..300), bufs: u16, mseq: u32, ack: u32) {
            let m = Message { bsdh: Bsdh { bufs, mseq, mseq_ack: ack, ..Bsdh::default() }, body: Body::Data(&d) };
            let v = m.to_vec();
            let back = Message::parse(&v).unwrap();
            prop_assert_eq!(back.body, Body::Data(&d));
            prop_assert_eq!((back.bsdh.bufs, back.bsdh.mseq, back.bsdh.mseq_ack), (bufs, mseq, ack));
        }
    }
}
