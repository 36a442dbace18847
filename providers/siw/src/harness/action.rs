//! The harness's actions: what the scripted peer and the consumer do next, decoded from
//! (and encoded to) a fuzzer's bytes, or derived from a captured connection.

use super::{MAX_PAYLOAD, MR_LEN};
use crate::wire::{Header, Model, Opcode};

/// Actions taken from one input.
const MAX_ACTIONS: usize = 64;

/// What the peer or the consumer does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Post a receive into `len` bytes at `off` of registration `mr`.
    PostRecv { mr: u8, off: u16, len: u16 },
    /// Post an RDMA Read into registration `mr` from the peer's `(rkey, raddr)`.
    PostRead {
        mr: u8,
        off: u16,
        len: u16,
        rkey: u32,
        raddr: u64,
    },
    /// Post a Send of `len` bytes at `off` of registration `mr`.
    PostSend { mr: u8, off: u16, len: u16 },
    /// The peer sends one well-framed FPDU.
    Fpdu(Fpdu),
    /// The peer answers the `read`-th outstanding read (wrapping), `skew` bytes off the
    /// next expected offset.
    Respond {
        read: u8,
        skew: i16,
        len: u16,
        last: bool,
    },
    /// The peer sends these bytes as they are.
    Raw(Vec<u8>),
    /// The consumer polls the CQ.
    Poll,
    /// The socket takes at most this many bytes without waiting (0: full).
    Room(u16),
    /// The consumer sets the QP's access flags.
    QpAccess(u8),
    /// The consumer closes the connection.
    Close { abortive: bool },
}

/// An FPDU built near the harness's registrations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fpdu {
    /// RDMAP opcode (0..=7; the model follows it).
    pub opcode: u8,
    pub last: bool,
    /// Tagged: STag and offset. A registration's STag (by index), optionally with some
    /// bits flipped; the offset relative to its base.
    pub stag: StagSel,
    pub to: i32,
    /// Untagged: MSN relative to the next one the QP expects for the opcode's queue,
    /// message offset, and the STag a Send with Invalidate names.
    pub msn: i8,
    pub mo: u32,
    pub payload_len: u16,
    pub fill: u8,
}

/// A registration's STag, or a near miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagSel {
    pub mr: u8,
    pub flip: u32,
}

/// A cursor over fuzz input bytes; reads past the end give `None`.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (a, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|[b]| b)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
}

impl Action {
    /// Decode a list of actions (at most 64; a truncated last one is dropped).
    pub fn decode(data: &[u8]) -> Vec<Action> {
        let mut i = Input(data);
        let mut out = Vec::new();
        while out.len() < MAX_ACTIONS {
            match Self::decode_one(&mut i) {
                Some(a) => out.push(a),
                None => break,
            }
        }
        out
    }

    fn decode_one(i: &mut Input) -> Option<Action> {
        Some(match i.u8()? % 10 {
            0 => Action::PostRecv {
                mr: i.u8()?,
                off: i.u16()?,
                len: i.u16()?,
            },
            1 => Action::PostRead {
                mr: i.u8()?,
                off: i.u16()?,
                len: i.u16()?,
                rkey: i.u32()?,
                raddr: i.u64()?,
            },
            2 => Action::PostSend {
                mr: i.u8()?,
                off: i.u16()?,
                len: i.u16()?,
            },
            3 => Action::Fpdu(Fpdu {
                opcode: i.u8()?,
                last: i.u8()? & 1 != 0,
                stag: StagSel {
                    mr: i.u8()?,
                    flip: i.u32()?,
                },
                to: i.u32()? as i32,
                msn: i.u8()? as i8,
                mo: i.u32()?,
                payload_len: i.u16()?,
                fill: i.u8()?,
            }),
            4 => Action::Respond {
                read: i.u8()?,
                skew: i.u16()? as i16,
                len: i.u16()?,
                last: i.u8()? & 1 != 0,
            },
            5 => {
                let n = (i.u16()? as usize).min(i.0.len()).min(MAX_PAYLOAD + 64);
                let (raw, rest) = i.0.split_at(n);
                i.0 = rest;
                Action::Raw(raw.to_vec())
            }
            6 => Action::Poll,
            7 => Action::Room(i.u16()?),
            8 => Action::QpAccess(i.u8()?),
            _ => Action::Close {
                abortive: i.u8()? & 1 != 0,
            },
        })
    }

    /// The bytes [`decode`](Self::decode) turns back into these actions.
    pub fn encode(actions: &[Action]) -> Vec<u8> {
        let mut o = Vec::new();
        for a in actions {
            match a {
                Action::PostRecv { mr, off, len } => {
                    o.push(0);
                    o.push(*mr);
                    o.extend(off.to_le_bytes());
                    o.extend(len.to_le_bytes());
                }
                Action::PostRead {
                    mr,
                    off,
                    len,
                    rkey,
                    raddr,
                } => {
                    o.push(1);
                    o.push(*mr);
                    o.extend(off.to_le_bytes());
                    o.extend(len.to_le_bytes());
                    o.extend(rkey.to_le_bytes());
                    o.extend(raddr.to_le_bytes());
                }
                Action::PostSend { mr, off, len } => {
                    o.push(2);
                    o.push(*mr);
                    o.extend(off.to_le_bytes());
                    o.extend(len.to_le_bytes());
                }
                Action::Fpdu(f) => {
                    o.push(3);
                    o.push(f.opcode);
                    o.push(f.last as u8);
                    o.push(f.stag.mr);
                    o.extend(f.stag.flip.to_le_bytes());
                    o.extend((f.to as u32).to_le_bytes());
                    o.push(f.msn as u8);
                    o.extend(f.mo.to_le_bytes());
                    o.extend(f.payload_len.to_le_bytes());
                    o.push(f.fill);
                }
                Action::Respond {
                    read,
                    skew,
                    len,
                    last,
                } => {
                    o.push(4);
                    o.push(*read);
                    o.extend((*skew as u16).to_le_bytes());
                    o.extend(len.to_le_bytes());
                    o.push(*last as u8);
                }
                Action::Raw(b) => {
                    o.push(5);
                    o.extend((b.len() as u16).to_le_bytes());
                    o.extend(b);
                }
                Action::Poll => o.push(6),
                Action::Room(n) => {
                    o.push(7);
                    o.extend(n.to_le_bytes());
                }
                Action::QpAccess(a) => {
                    o.push(8);
                    o.push(*a);
                }
                Action::Close { abortive } => {
                    o.push(9);
                    o.push(*abortive as u8);
                }
            }
        }
        o
    }

    /// A captured connection direction (its ULPDUs, in order) as the peer's actions:
    /// receives posted for its Sends, its FPDUs aimed at the harness's registrations
    /// (each captured STag mapped to one, offsets kept relative to the first seen), a
    /// Read posted for each Read Response it carries. Seeds the `siw_qp` corpus.
    pub fn from_capture(ulpdus: &[Vec<u8>]) -> Vec<Action> {
        let mut out = Vec::new();
        let mut stags: Vec<(u32, u64)> = Vec::new();
        let mut reads = 0;
        for u in ulpdus {
            let Ok((h, payload)) = Header::parse_bytes(u) else {
                out.push(Action::Raw(u.clone()));
                continue;
            };
            let len = payload.len().min(MAX_PAYLOAD) as u16;
            let fill = payload.first().copied().unwrap_or(0);
            match (h.opcode, h.model) {
                (Opcode::ReadResponse, _) => {
                    if reads == 0 {
                        out.push(Action::PostRead {
                            mr: 1,
                            off: 0,
                            len: MR_LEN as u16,
                            rkey: 0x1234,
                            raddr: 0,
                        });
                        reads = 1;
                    }
                    out.push(Action::Respond {
                        read: 0,
                        skew: 0,
                        len,
                        last: h.last,
                    });
                    if h.last {
                        reads = 0;
                    }
                }
                (op, Model::Tagged { stag, to }) => {
                    let first = match stags.iter().find(|s| s.0 == stag) {
                        Some(&(_, t)) => t,
                        None => {
                            stags.push((stag, to));
                            to
                        }
                    };
                    out.push(Action::Fpdu(Fpdu {
                        opcode: op as u8,
                        last: h.last,
                        stag: StagSel { mr: 0, flip: 0 },
                        to: to.wrapping_sub(first).min(MR_LEN as u64) as i32,
                        msn: 0,
                        mo: 0,
                        payload_len: len,
                        fill,
                    }));
                }
                (op, Model::Untagged { mo, .. }) => {
                    if op.is_send() && mo == 0 {
                        out.push(Action::PostRecv {
                            mr: 1,
                            off: 0,
                            len: MR_LEN as u16,
                        });
                    }
                    out.push(Action::Fpdu(Fpdu {
                        opcode: op as u8,
                        last: h.last,
                        stag: StagSel { mr: 0, flip: 0 },
                        to: 0,
                        msn: 0,
                        mo,
                        payload_len: if op == Opcode::ReadRequest { 0 } else { len },
                        fill,
                    }));
                }
            }
            out.push(Action::Poll);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_then_decode_is_identity() {
        let actions = vec![
            Action::PostRecv {
                mr: 1,
                off: 10,
                len: 100,
            },
            Action::Fpdu(Fpdu {
                opcode: 3,
                last: true,
                stag: StagSel { mr: 0, flip: 0 },
                to: -5,
                msn: -1,
                mo: 7,
                payload_len: 12,
                fill: 9,
            }),
            Action::Respond {
                read: 2,
                skew: -3,
                len: 5,
                last: true,
            },
            Action::Raw(vec![1, 2, 3]),
            Action::Poll,
            Action::Room(4),
            Action::QpAccess(6),
            Action::Close { abortive: true },
        ];
        assert_eq!(Action::decode(&Action::encode(&actions)), actions);
    }
}
