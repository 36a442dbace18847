//! The input format: a sequence of records, `tag:u8 len:u16le body[len]`.
//!
//! * tag 0, **capture**: a RoCEv2 packet (BTH .. ICRC) as captured from Linux rdma_rxe.
//!   The rig readdresses it to the fuzzed QP (or, a CM MAD, to QP1 and the listener's
//!   port), rebases its PSN onto the QP's and points its keys and addresses at the
//!   registrations. The seeds are such records (`providers/rxe/tests/captures.rs`,
//!   `scripts/fuzz.sh seed`).
//! * tag 1, **action**: the body, read by `arbitrary`, is one [`Action`]: a request or a
//!   response packet built from fields near the QP's state, a CM MAD with IDs the device
//!   used, or one of the consumer's own verbs.
//! * tag 2, **setup** (first record only): the body is a [`Setup`].
//!
//! Other tags count as actions; a record cut short takes what is there.

use arbitrary::{Arbitrary, Unstructured};

/// At most this many records of an input are played.
const MAX_RECORDS: usize = 64;

/// How the QP under test is set up.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Setup {
    /// Remote rights of the QP: bit 0 write, 1 read, 2 atomic.
    pub rights: u8,
    pub ird: u8,
    pub ord: u8,
    /// Path MTU code (1 = 256 … 5 = 4096).
    pub mtu: u8,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub backlog: u8,
    /// The QP under test is a UD QP (Q_Key 0x11111111, as ibv_ud_pingpong's).
    pub ud: bool,
    /// Else a UC QP (no acknowledgements either way) rather than RC.
    pub uc: bool,
    /// Datagrams are received as a polling consumer receives them: positive
    /// acknowledgements wait (coalesced) for the QP's next datagrams or for the
    /// consumer's next poll, taken before every action but a packet.
    pub polled: bool,
}

impl Setup {
    /// The service of the QP under test.
    pub fn qp_type(&self) -> rnicpi::QpType {
        match (self.ud, self.uc) {
            (true, _) => rnicpi::QpType::Ud,
            (false, true) => rnicpi::QpType::Uc,
            (false, false) => rnicpi::QpType::Rc,
        }
    }
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            rights: 0b111,
            ird: 2,
            ord: 2,
            mtu: 3,
            rq_psn: 100,
            sq_psn: 200,
            backlog: 4,
            ud: false,
            uc: false,
            polled: false,
        }
    }
}

/// A key a packet or a work request names.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Key {
    /// Registration `n % registrations`.
    Mr(u8),
    /// The memory window (bound or not).
    Window,
    /// Near a registration's key: other key byte or index.
    Near {
        mr: u8,
        delta: i16,
    },
    Any(u32),
}

/// A remote address: a key and an offset from the start of its registration.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Remote {
    pub key: Key,
    pub offset: i32,
}

/// An RETH's DMA length.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum DmaLen {
    /// What the packet (or the whole message, for a read) carries.
    Payload,
    Small(u16),
    Any(u32),
}

/// Request opcodes of the RC transport, and the UD sends.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOp {
    SendFirst,
    SendMiddle,
    SendLast,
    SendLastImm,
    SendLastInv,
    SendOnly,
    SendOnlyImm,
    SendOnlyInv,
    WriteFirst,
    WriteMiddle,
    WriteLast,
    WriteLastImm,
    WriteOnly,
    WriteOnlyImm,
    ReadRequest,
    CompareSwap,
    FetchAdd,
    /// UD datagrams (a DETH with the QP's Q_Key when `ack_req` is set, else `imm`).
    UdSendOnly,
    UdSendOnlyImm,
}

/// A request packet to the responder.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Request {
    pub op: RequestOp,
    /// Off the PSN the responder expects next.
    pub psn: i8,
    pub ack_req: bool,
    pub solicited: bool,
    /// Payload bytes (taken modulo the MTU + 16).
    pub payload: u16,
    pub fill: u8,
    pub remote: Remote,
    pub dma_len: DmaLen,
    pub imm: u32,
    pub inv: Key,
    pub compare: u64,
    pub swap_add: u64,
}

/// Response opcodes of the RC transport.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum ResponseOp {
    Ack,
    ReadFirst,
    ReadMiddle,
    ReadLast,
    ReadOnly,
    AtomicAck,
}

/// A response packet to the requester.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Response {
    pub op: ResponseOp,
    /// Off the PSN of the last request the device sent.
    pub psn: i8,
    /// AETH syndrome byte (ACK, RNR NAK, NAK codes, reserved values).
    pub syndrome: u8,
    pub msn: u16,
    pub payload: u16,
    pub fill: u8,
    pub orig: u64,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum MadKind {
    Req,
    Mra,
    Rej,
    Rep,
    Rtu,
    Dreq,
    Drep,
    /// UD service resolution (the request's ID is `local_id`, the reply's `remote_id`).
    SidrReq,
    SidrRep,
}

/// A communication ID in a MAD.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum CommId {
    /// One the device used in a MAD it sent (the `n`-th most recent).
    Seen(u8),
    /// One of ours, the fake peer's (`n`-th of a few).
    Ours(u8),
    Any(u32),
}

/// A QP number in a MAD.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Qpn {
    /// A QP of the device's (the `n`-th).
    Device(u8),
    Peer,
    Any(u32),
}

/// A CM MAD to the device's QP1.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Mad {
    pub kind: MadKind,
    /// From the fake peer's address; else from another one.
    pub from_peer: bool,
    pub local_id: CommId,
    pub remote_id: CommId,
    pub qpn: Qpn,
    pub psn: u32,
    /// The listener's port, or any.
    pub port: Option<u16>,
    pub reason: u16,
    pub which: u8,
    pub timeout: u8,
    pub retries: u8,
    pub ird: u8,
    pub ord: u8,
    pub mtu: u8,
    pub pdata: u8,
}

/// A piece of registered memory (or near it) for a work request.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Buf {
    pub mr: u8,
    pub offset: i16,
    pub len: u16,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum SendOp {
    Send,
    SendWithImm,
    SendWithInv,
    RdmaWrite,
    RdmaWriteWithImm,
    RdmaRead,
    AtomicCmpSwp,
    AtomicFetchAdd,
    LocalInv,
    BindMw,
}

/// A send-queue work request of the consumer.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct PostSend {
    pub op: SendOp,
    pub qp: u8,
    pub buf: Buf,
    pub remote: Remote,
    pub key: Key,
    pub signaled: bool,
    pub fence: bool,
    pub inline: bool,
    pub compare: u64,
    pub swap: u64,
    /// Window rights for a bind: bits of remote write, read, atomic.
    pub rights: u8,
}

/// One step of the scenario.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Action {
    Request(Request),
    Response(Response),
    Mad(Mad),
    PostSend(PostSend),
    PostRecv {
        qp: u8,
        buf: Buf,
    },
    /// A fresh QP connects to the fake peer (the CM's active side).
    Connect {
        ird: u8,
        ord: u8,
    },
    /// Accept the `which`-th connection request onto a fresh QP.
    Accept {
        which: u8,
        ird: u8,
        ord: u8,
    },
    Reject {
        which: u8,
    },
    Disconnect {
        qp: u8,
        abortive: bool,
    },
}

/// One record.
#[derive(Debug, Clone)]
pub enum Record {
    Capture(Vec<u8>),
    Act(Action),
}

/// Split an input into its setup and records.
pub fn parse(data: &[u8]) -> (Setup, Vec<Record>) {
    let mut setup = Setup::default();
    let mut out = Vec::new();
    let mut rest = data;
    let mut first = true;
    while !rest.is_empty() && out.len() < MAX_RECORDS {
        let tag = rest[0];
        let len = match rest.get(1..3) {
            Some(l) => u16::from_le_bytes([l[0], l[1]]) as usize,
            None => rest.len(),
        };
        let body = rest.get(3..).unwrap_or(&[]);
        let body = &body[..len.min(body.len())];
        rest = &rest[(3 + body.len()).min(rest.len())..];
        match tag {
            0 => out.push(Record::Capture(body.to_vec())),
            2 if first => {
                if let Ok(s) = Setup::arbitrary(&mut Unstructured::new(body)) {
                    setup = s;
                }
            }
            _ => {
                if let Ok(a) = Action::arbitrary(&mut Unstructured::new(body)) {
                    out.push(Record::Act(a));
                }
            }
        }
        first = false;
    }
    (setup, out)
}
