//! Work requests and work completions.
//!
//! A work request travels from the consumer to the engine as a [`Wqe`], a fixed-size
//! `#[repr(C)]` slot written into the QP's shared send or receive ring; a completion
//! travels back as a [`Cqe`] in the shared completion ring. Both are plain old data,
//! so the same bytes are valid in the consumer process and in the daemon.

use bytemuck::{Pod, Zeroable};

/// Most scatter/gather entries one work request carries.
pub const MAX_SGE: usize = 6;
/// Most bytes one work request carries inline (copied into the WQE at post time).
pub const MAX_INLINE: usize = 96;

/// One scatter/gather element: a piece of registered memory.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// What a send-queue work request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WrOpcode {
    Send = 1,
    SendWithImm = 2,
    SendWithInv = 3,
    RdmaWrite = 4,
    RdmaWriteWithImm = 5,
    RdmaRead = 6,
    AtomicCmpSwp = 7,
    AtomicFetchAdd = 8,
    LocalInv = 9,
    /// Receive-queue entry (only in receive rings).
    Recv = 10,
    /// Bind a memory window (type 2) onto a registration, in send-queue order
    /// (see [`Wqe::bind_mw`] for where the arguments travel).
    BindMw = 11,
}

impl WrOpcode {
    pub fn from_u8(v: u8) -> Option<Self> {
        use WrOpcode::*;
        Some(match v {
            1 => Send,
            2 => SendWithImm,
            3 => SendWithInv,
            4 => RdmaWrite,
            5 => RdmaWriteWithImm,
            6 => RdmaRead,
            7 => AtomicCmpSwp,
            8 => AtomicFetchAdd,
            9 => LocalInv,
            10 => Recv,
            11 => BindMw,
            _ => return None,
        })
    }

    /// The completion opcode reported for this request.
    pub fn wc_opcode(self) -> WcOpcode {
        use WrOpcode::*;
        match self {
            Send | SendWithImm | SendWithInv => WcOpcode::Send,
            RdmaWrite | RdmaWriteWithImm => WcOpcode::RdmaWrite,
            RdmaRead => WcOpcode::RdmaRead,
            AtomicCmpSwp => WcOpcode::CompSwap,
            AtomicFetchAdd => WcOpcode::FetchAdd,
            LocalInv => WcOpcode::LocalInv,
            Recv => WcOpcode::Recv,
            BindMw => WcOpcode::BindMw,
        }
    }
}

/// Flags of a send work request (verbs `IBV_SEND_*` values).
pub mod send_flags {
    pub const FENCE: u8 = 1;
    pub const SIGNALED: u8 = 1 << 1;
    pub const SOLICITED: u8 = 1 << 2;
    pub const INLINE: u8 = 1 << 3;
}

/// A work-queue entry as it sits in a shared ring (send or receive).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable)]
pub struct Wqe {
    pub wr_id: u64,
    /// A [`WrOpcode`] value.
    pub opcode: u8,
    /// [`send_flags`] bits.
    pub flags: u8,
    pub num_sge: u8,
    pub _reserved: u8,
    /// Immediate data (network order as the consumer gave it) or the STag/rkey to invalidate.
    pub imm_or_inv: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// Bytes of `inline_data` in use when the INLINE flag is set.
    pub inline_len: u32,
    pub compare_add: u64,
    pub swap: u64,
    pub sge: [Sge; MAX_SGE],
    pub inline_data: [u8; MAX_INLINE],
}

impl Default for Wqe {
    fn default() -> Self {
        Zeroable::zeroed()
    }
}

impl Wqe {
    pub fn opcode(&self) -> Option<WrOpcode> {
        WrOpcode::from_u8(self.opcode)
    }
    pub fn signaled(&self) -> bool {
        self.flags & send_flags::SIGNALED != 0
    }
    pub fn solicited(&self) -> bool {
        self.flags & send_flags::SOLICITED != 0
    }
    pub fn is_inline(&self) -> bool {
        self.flags & send_flags::INLINE != 0
    }
    /// The scatter/gather list in use, clamped to the slot's capacity.
    pub fn sges(&self) -> &[Sge] {
        &self.sge[..(self.num_sge as usize).min(MAX_SGE)]
    }
    /// Payload length: inline bytes, or the sum of the SGE lengths (saturating).
    pub fn total_len(&self) -> u64 {
        if self.is_inline() {
            self.inline_len as u64
        } else {
            self.sges().iter().map(|s| s.length as u64).sum()
        }
    }

    /// A send-side request with a gather list.
    pub fn new(wr_id: u64, opcode: WrOpcode, sges: &[Sge]) -> Self {
        let mut w = Wqe {
            wr_id,
            opcode: opcode as u8,
            flags: send_flags::SIGNALED,
            ..Default::default()
        };
        let n = sges.len().min(MAX_SGE);
        w.sge[..n].copy_from_slice(&sges[..n]);
        w.num_sge = n as u8;
        w
    }
    /// A receive request with a scatter list.
    pub fn recv(wr_id: u64, sges: &[Sge]) -> Self {
        Self::new(wr_id, WrOpcode::Recv, sges)
    }
    /// Copy `data` inline; fails when it does not fit.
    pub fn with_inline(mut self, data: &[u8]) -> Option<Self> {
        if data.len() > MAX_INLINE {
            return None;
        }
        self.inline_data[..data.len()].copy_from_slice(data);
        self.inline_len = data.len() as u32;
        self.flags |= send_flags::INLINE;
        self.num_sge = 0;
        Some(self)
    }
    pub fn with_remote(mut self, remote_addr: u64, rkey: u32) -> Self {
        self.remote_addr = remote_addr;
        self.rkey = rkey;
        self
    }
    pub fn with_flags(mut self, flags: u8) -> Self {
        self.flags = flags;
        self
    }
    pub fn with_imm(mut self, imm_or_inv: u32) -> Self {
        self.imm_or_inv = imm_or_inv;
        self
    }

    /// Bind memory window `mw_rkey` (its new key: the window's index with a fresh key
    /// byte) onto `[addr, addr+len)` of the registration `mr_lkey` with the remote
    /// rights `access`; `len` 0 unbinds. The arguments travel in `imm_or_inv` (new
    /// window key), `rkey` (registration), `remote_addr`, `compare_add` (length) and
    /// `swap` (access bits).
    pub fn bind_mw(
        wr_id: u64,
        mw_rkey: u32,
        mr_lkey: u32,
        addr: u64,
        len: u64,
        access: crate::Access,
    ) -> Self {
        Wqe {
            wr_id,
            opcode: WrOpcode::BindMw as u8,
            flags: send_flags::SIGNALED,
            imm_or_inv: mw_rkey,
            rkey: mr_lkey,
            remote_addr: addr,
            compare_add: len,
            swap: access.bits() as u64,
            ..Default::default()
        }
    }

    /// Address a Send on a UD QP (as `ibv_send_wr.wr.ud`): to QP `remote_qpn` through
    /// address handle `ah` (the number [`crate::Provider::create_ah`] gave), with Q_Key
    /// `remote_qkey` — one with the top bit set means the QP's own Q_Key (IBTA 10.2.5).
    /// The three travel in `rkey` (AH), `remote_addr` (QPN) and `compare_add` (Q_Key),
    /// fields a Send does not otherwise use.
    pub fn with_ud(mut self, ah: u32, remote_qpn: u32, remote_qkey: u32) -> Self {
        self.rkey = ah;
        self.remote_addr = u64::from(remote_qpn & 0xff_ffff);
        self.compare_add = u64::from(remote_qkey);
        self
    }

    /// Where a UD Send goes, as [`Wqe::with_ud`] stored it.
    pub fn ud_dest(&self) -> UdDest {
        UdDest {
            ah: self.rkey,
            qpn: (self.remote_addr & 0xff_ffff) as u32,
            qkey: self.compare_add as u32,
        }
    }

    /// The arguments of a [`WrOpcode::BindMw`] request, as [`Wqe::bind_mw`] stored them.
    pub fn bind_args(&self) -> BindArgs {
        BindArgs {
            mw_rkey: self.imm_or_inv,
            mr_lkey: self.rkey,
            addr: self.remote_addr,
            len: self.compare_add,
            access: u32::try_from(self.swap)
                .ok()
                .and_then(crate::Access::from_bits),
        }
    }
}

/// The destination of a UD Send (decoded from a [`Wqe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest {
    pub ah: u32,
    pub qpn: u32,
    pub qkey: u32,
}

impl UdDest {
    /// The Q_Key to send with: the request's, or the QP's own for a controlled one.
    pub fn qkey_or(&self, own: u32) -> u32 {
        if self.qkey & 0x8000_0000 != 0 {
            own
        } else {
            self.qkey
        }
    }
}

/// What a memory-window bind asks for (decoded from a [`Wqe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindArgs {
    pub mw_rkey: u32,
    pub mr_lkey: u32,
    pub addr: u64,
    pub len: u64,
    /// `None` when the slot carries unknown access bits.
    pub access: Option<crate::Access>,
}

/// Completion status (verbs `IBV_WC_*` values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

impl WcStatus {
    pub fn from_u8(v: u8) -> Self {
        use WcStatus::*;
        match v {
            0 => Success,
            1 => LocLenErr,
            2 => LocQpOpErr,
            3 => LocEecOpErr,
            4 => LocProtErr,
            5 => WrFlushErr,
            6 => MwBindErr,
            7 => BadRespErr,
            8 => LocAccessErr,
            9 => RemInvReqErr,
            10 => RemAccessErr,
            11 => RemOpErr,
            12 => RetryExcErr,
            13 => RnrRetryExcErr,
            19 => FatalErr,
            20 => RespTimeoutErr,
            _ => GeneralErr,
        }
    }
}

/// The operation a completion reports (verbs `IBV_WC_*` opcode values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindMw = 5,
    LocalInv = 6,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    pub fn from_u8(v: u8) -> Option<Self> {
        use WcOpcode::*;
        Some(match v {
            0 => Send,
            1 => RdmaWrite,
            2 => RdmaRead,
            3 => CompSwap,
            4 => FetchAdd,
            5 => BindMw,
            6 => LocalInv,
            128 => Recv,
            129 => RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// Bytes of the global route header a UD receive starts with ([`wc_flags::GRH`]), ahead
/// of the message.
pub const GRH_LEN: usize = 40;

/// Completion flags.
pub mod wc_flags {
    /// `imm_or_inv` holds immediate data.
    pub const WITH_IMM: u8 = 1;
    /// `imm_or_inv` holds the STag the peer invalidated.
    pub const WITH_INV: u8 = 2;
    /// The message carried the solicited-event bit.
    pub const SOLICITED: u8 = 4;
    /// A UD receive: the buffer starts with the 40-byte GRH ([`super::GRH_LEN`], as
    /// `IBV_WC_GRH`), and `src_qp` names the sender's QP.
    pub const GRH: u8 = 8;
}

/// A completion-queue entry as it sits in the shared completion ring.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct Cqe {
    pub wr_id: u64,
    /// A [`WcStatus`] value.
    pub status: u8,
    /// A [`WcOpcode`] value.
    pub opcode: u8,
    /// [`wc_flags`] bits.
    pub flags: u8,
    pub _reserved: u8,
    pub byte_len: u32,
    pub qp_num: u32,
    pub imm_or_inv: u32,
    pub src_qp: u32,
    /// Provider-specific detail for error statuses (e.g. the iWARP Terminate code).
    pub vendor_err: u32,
}

impl Cqe {
    pub fn status(&self) -> WcStatus {
        WcStatus::from_u8(self.status)
    }
    pub fn opcode(&self) -> Option<WcOpcode> {
        WcOpcode::from_u8(self.opcode)
    }
    pub fn is_ok(&self) -> bool {
        self.status == WcStatus::Success as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_sizes_are_stable() {
        assert_eq!(std::mem::size_of::<Sge>(), 16);
        assert_eq!(std::mem::size_of::<Wqe>(), 240);
        assert_eq!(std::mem::size_of::<Cqe>(), 32);
    }

    #[test]
    fn inline_limits() {
        let w = Wqe::new(1, WrOpcode::Send, &[]);
        assert!(w.with_inline(&[0u8; MAX_INLINE]).is_some());
        assert!(w.with_inline(&[0u8; MAX_INLINE + 1]).is_none());
    }

    #[test]
    fn bind_args_round_trip() {
        let a = crate::Access::REMOTE_READ | crate::Access::REMOTE_WRITE;
        let w = Wqe::bind_mw(9, 0x1234_5602, 0x0007_7701, 0x1000, 64, a);
        assert_eq!(w.opcode(), Some(WrOpcode::BindMw));
        assert_eq!(
            w.bind_args(),
            BindArgs {
                mw_rkey: 0x1234_5602,
                mr_lkey: 0x0007_7701,
                addr: 0x1000,
                len: 64,
                access: Some(a)
            }
        );
        let bad = Wqe { swap: 1 << 40, ..w };
        assert_eq!(bad.bind_args().access, None);
    }

    #[test]
    fn ud_dest_round_trip() {
        let w = Wqe::new(1, WrOpcode::Send, &[]).with_ud(7, 0x12_3456, 0x1111_1111);
        let d = w.ud_dest();
        assert_eq!((d.ah, d.qpn, d.qkey), (7, 0x12_3456, 0x1111_1111));
        assert_eq!(d.qkey_or(5), 0x1111_1111);
        let controlled = w.with_ud(7, 0xff12_3456, 0x8000_0001).ud_dest();
        assert_eq!((controlled.qpn, controlled.qkey_or(5)), (0x12_3456, 5));
    }

    #[test]
    fn hostile_num_sge_is_clamped() {
        let w = Wqe {
            num_sge: 200,
            ..Wqe::default()
        };
        assert_eq!(w.sges().len(), MAX_SGE);
    }
}
