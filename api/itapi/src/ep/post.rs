//! Data transfer: sends, receives, RDMA Writes and Reads, and the RMR link requests,
//! posted on an endpoint's queues with a cookie that comes back in the completion event.

use super::wr_table::{Queue, WrInfo, WrTable};
use super::{Endpoint, EpInner, EpState};
use crate::event::DtoKind;
use crate::lmr::{RdmaAddr, RmrContext, Segment};
use crate::status::{Error, Result};
use parking_lot::Mutex;
use rnicpi::{send_flags, Sge, Wqe, WrOpcode};

bitflags::bitflags! {
    /// Flags of a posted work request (`it_dto_flags_t`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct DtoFlags: u32 {
        /// Queue a completion event on success (failures always complete).
        /// Receives always complete.
        const COMPLETION = 0x01;
        /// The completion notifies (wakes waiters, readies the SEVD).
        const NOTIFY = 0x02;
        /// Send: ask the receiver for a solicited event. Receive: notify only when
        /// the message that lands here is solicited.
        const SOLICITED_WAIT = 0x04;
        /// Start only once earlier RDMA Reads have completed.
        const BARRIER_FENCE = 0x08;
        /// Start an RMR unlink only once earlier requests have completed.
        const UNLINK_FENCE = 0x10;
        /// Not supported (`InvalidDtoFlags`).
        const UNLINK_LOCAL_SINK = 0x20;
        /// A hint that more requests follow; accepted and ignored.
        const COALESCE = 0x40;
    }
}

/// An atomic operation (`it_atomic_op_t` with its operands).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Add `add` to the remote value.
    FetchAndAdd { add: u64 },
    /// Replace the remote value with `swap` if it equals `compare`.
    CompareAndSwap { compare: u64, swap: u64 },
}

impl DtoFlags {
    /// Completion event that notifies: what most consumers post with.
    pub const SIGNALED: DtoFlags = DtoFlags::COMPLETION.union(DtoFlags::NOTIFY);
    const SEND_SIDE: DtoFlags = DtoFlags::COMPLETION
        .union(DtoFlags::NOTIFY)
        .union(DtoFlags::SOLICITED_WAIT)
        .union(DtoFlags::BARRIER_FENCE)
        .union(DtoFlags::UNLINK_FENCE)
        .union(DtoFlags::COALESCE);
    const RECV_SIDE: DtoFlags = DtoFlags::COMPLETION
        .union(DtoFlags::NOTIFY)
        .union(DtoFlags::SOLICITED_WAIT)
        .union(DtoFlags::COALESCE);

    /// The verbs send flags; `signaled` when the engine is to write a completion.
    fn wire(self, signaled: bool) -> u8 {
        let mut f = if signaled { send_flags::SIGNALED } else { 0 };
        if self.contains(DtoFlags::SOLICITED_WAIT) {
            f |= send_flags::SOLICITED;
        }
        if self.intersects(DtoFlags::BARRIER_FENCE | DtoFlags::UNLINK_FENCE) {
            f |= send_flags::FENCE;
        }
        f
    }
}

fn check_flags(flags: DtoFlags, allowed: DtoFlags) -> Result<()> {
    if allowed.contains(flags) {
        Ok(())
    } else {
        Err(Error::InvalidDtoFlags)
    }
}

fn sges(segs: &[Segment], max: usize) -> Result<(Vec<Sge>, u32)> {
    if segs.len() > max.min(rnicpi::MAX_SGE) {
        return Err(Error::InvalidNumSegments);
    }
    let total = segs
        .iter()
        .try_fold(0u32, |acc, s| acc.checked_add(s.len()))
        .ok_or(Error::InvalidLength)?;
    Ok((segs.iter().map(|s| s.sge).collect(), total))
}

/// Put `info` in `table`, post `wqe` with the slot's `wr_id`, and give the slot back if
/// the post fails.
fn post_with(
    table: &Mutex<WrTable>,
    queue: Queue,
    mut wqe: Wqe,
    info: WrInfo,
    post: impl FnOnce(&Wqe) -> rnicpi::Result<()>,
) -> Result<()> {
    wqe.wr_id = table.lock().insert(queue, info);
    post(&wqe).map_err(|e| {
        table.lock().remove(wqe.wr_id);
        crate::status::from_verbs(e, Error::InvalidNumSegments)
    })
}

/// Post receive `segs` to a receive queue or SRQ.
pub(crate) fn post_receive(
    table: &Mutex<WrTable>,
    queue: Queue,
    segs: &[Segment],
    max_segs: usize,
    cookie: u64,
    flags: DtoFlags,
    post: impl FnOnce(&Wqe) -> rnicpi::Result<()>,
) -> Result<()> {
    check_flags(flags, DtoFlags::RECV_SIDE)?;
    let (list, total) = sges(segs, max_segs)?;
    let info = WrInfo {
        cookie,
        kind: DtoKind::Recv,
        flags,
        length: total,
        signaled: true,
    };
    post_with(table, queue, Wqe::recv(0, &list), info, post)
}

impl Endpoint {
    /// Send the bytes of `segs` (gathered in order) to the peer's next posted receive.
    pub fn post_send(&self, segs: &[Segment], cookie: u64, flags: DtoFlags) -> Result<()> {
        let max = self.0.attrs.lock().max_send_segments;
        let (list, total) = sges(segs, max)?;
        let wqe = Wqe::new(0, WrOpcode::Send, &list);
        self.0.post_sq(wqe, DtoKind::Send, cookie, flags, total)
    }

    /// Send the bytes of `segs` as one datagram from this UD endpoint to `to` (what a
    /// resolution reported: its address handle, QP and Q_Key). At most the path MTU.
    pub fn post_sendto(
        &self,
        segs: &[Segment],
        cookie: u64,
        flags: DtoFlags,
        to: &crate::event::UdRemote,
    ) -> Result<()> {
        if !self.0.ud {
            return Err(Error::InvalidEpType);
        }
        let max = self.0.attrs.lock().max_send_segments;
        let (list, total) = sges(segs, max)?;
        let wqe = Wqe::new(0, WrOpcode::Send, &list).with_ud(to.ah.num(), to.qpn, to.qkey);
        self.0.post_sq(wqe, DtoKind::Send, cookie, flags, total)
    }

    /// Send `data`, copied into the work request now (the buffer is free again on
    /// return; no LMR needed). At most the IA's `max_inline` bytes (`PayloadSize`).
    pub fn post_send_inline(&self, data: &[u8], cookie: u64, flags: DtoFlags) -> Result<()> {
        let max = self.0.qp_caps_inline();
        if data.len() > max {
            return Err(Error::PayloadSize);
        }
        let wqe = Wqe::new(0, WrOpcode::Send, &[])
            .with_inline(data)
            .ok_or(Error::PayloadSize)?;
        self.0
            .post_sq(wqe, DtoKind::Send, cookie, flags, data.len() as u32)
    }

    /// Send `segs` and have the peer's device invalidate `rmr_context` when the message
    /// lands (`it_post_send_and_unlink`, iWARP Send with Invalidate).
    pub fn post_send_and_unlink(
        &self,
        segs: &[Segment],
        cookie: u64,
        flags: DtoFlags,
        rmr_context: RmrContext,
    ) -> Result<()> {
        let rkey = RdmaAddr {
            addr: 0,
            rmr_context,
        }
        .rkey()?;
        let max = self.0.attrs.lock().max_send_segments;
        let (list, total) = sges(segs, max)?;
        let wqe = Wqe::new(0, WrOpcode::SendWithInv, &list).with_imm(rkey);
        self.0.post_sq(wqe, DtoKind::Send, cookie, flags, total)
    }

    /// Post a receive scattering an incoming message over `segs`. Allowed before the
    /// endpoint connects. Not on an endpoint using an SRQ (post to the SRQ).
    pub fn post_recv(&self, segs: &[Segment], cookie: u64, flags: DtoFlags) -> Result<()> {
        if self.0.srq.is_some() {
            return Err(Error::InvalidRecvDto);
        }
        let max = self.0.attrs.lock().max_recv_segments;
        post_receive(&self.0.recvs, Queue::Recv, segs, max, cookie, flags, |w| {
            self.0.qp.post_recv(w)
        })
    }

    /// Write the bytes of `segs` to the peer's memory at `remote`.
    pub fn post_rdma_write(
        &self,
        segs: &[Segment],
        cookie: u64,
        flags: DtoFlags,
        remote: RdmaAddr,
    ) -> Result<()> {
        self.post_rdma(DtoKind::RdmaWrite, segs, cookie, flags, remote, None)
    }

    /// Write the bytes of `segs` to the peer's memory at `remote` and hand the peer
    /// `imm` (host order) with a completion of its next posted receive, as InfiniBand's
    /// RDMA Write with immediate data does (an extension: IT-API itself has no
    /// immediate data). `OpNotSupported` on iWARP (siw0), whose RDMAP has none.
    pub fn post_rdma_write_imm(
        &self,
        segs: &[Segment],
        cookie: u64,
        flags: DtoFlags,
        remote: RdmaAddr,
        imm: u32,
    ) -> Result<()> {
        if self.ia().transport() != crate::Transport::InfiniBand {
            return Err(Error::OpNotSupported);
        }
        self.post_rdma(
            DtoKind::RdmaWriteImm,
            segs,
            cookie,
            flags,
            remote,
            Some(imm),
        )
    }

    /// Read the peer's memory at `remote` into `segs`.
    pub fn post_rdma_read(
        &self,
        segs: &[Segment],
        cookie: u64,
        flags: DtoFlags,
        remote: RdmaAddr,
    ) -> Result<()> {
        self.post_rdma(DtoKind::RdmaRead, segs, cookie, flags, remote, None)
    }

    fn post_rdma(
        &self,
        kind: DtoKind,
        segs: &[Segment],
        cookie: u64,
        flags: DtoFlags,
        remote: RdmaAddr,
        imm: Option<u32>,
    ) -> Result<()> {
        let a = self.attributes();
        let (enabled, max, opcode) = match kind {
            DtoKind::RdmaRead => (
                a.rdma_read_enable,
                a.max_rdma_read_segments,
                WrOpcode::RdmaRead,
            ),
            DtoKind::RdmaWriteImm => (
                a.rdma_write_enable,
                a.max_rdma_write_segments,
                WrOpcode::RdmaWriteWithImm,
            ),
            _ => (
                a.rdma_write_enable,
                a.max_rdma_write_segments,
                WrOpcode::RdmaWrite,
            ),
        };
        if !enabled {
            return Err(Error::InvalidEpState);
        }
        let (list, total) = sges(segs, max)?;
        let mut wqe = Wqe::new(0, opcode, &list).with_remote(remote.addr, remote.rkey()?);
        if let Some(imm) = imm {
            wqe = wqe.with_imm(imm.to_be()); // immediate data travels in network order
        }
        self.0.post_sq(wqe, kind, cookie, flags, total)
    }

    /// An atomic operation on the 8 bytes (8-byte aligned) of the peer's memory at
    /// `remote` (`it_post_atomic`); the value found there before the operation lands in
    /// `result`, an 8-byte segment. The remote memory needs [`MemPriv::ATOMIC`]
    /// (`crate::MemPriv`). Only where the device implements atomics
    /// ([`Ia::atomic_support`](crate::Ia::atomic_support): rxe0 does, siw0 does not —
    /// iWARP has no atomics): `OpNotSupported` otherwise.
    pub fn post_atomic(
        &self,
        op: AtomicOp,
        result: &Segment,
        cookie: u64,
        flags: DtoFlags,
        remote: RdmaAddr,
    ) -> Result<()> {
        if !self.ia().atomic_support() {
            return Err(Error::OpNotSupported);
        }
        if result.len() != 8 {
            return Err(Error::InvalidLength);
        }
        if !remote.addr.is_multiple_of(8) {
            return Err(Error::InvalidAtomicOp);
        }
        let (opcode, kind, compare_add, swap) = match op {
            AtomicOp::FetchAndAdd { add } => (WrOpcode::AtomicFetchAdd, DtoKind::FetchAdd, add, 0),
            AtomicOp::CompareAndSwap { compare, swap } => {
                (WrOpcode::AtomicCmpSwp, DtoKind::CmpSwap, compare, swap)
            }
        };
        let mut wqe = Wqe::new(0, opcode, &[result.sge]).with_remote(remote.addr, remote.rkey()?);
        wqe.compare_add = compare_add;
        wqe.swap = swap;
        self.0.post_sq(wqe, kind, cookie, flags, 8)
    }

    /// Work requests posted and not yet completed (send queue, receive queue). Sends
    /// posted without a completion are not counted: the engine says nothing when they
    /// are done (the engine's own orderly close still waits for them).
    pub fn outstanding(&self) -> (usize, usize) {
        (self.0.sends.lock().awaited(), self.0.recvs.lock().len())
    }
}

impl EpInner {
    fn qp_caps_inline(&self) -> usize {
        self.ia().limits().max_inline as usize
    }

    /// Post on the send queue: allowed once connected (and after, when work completes
    /// flushed), not before.
    pub(crate) fn post_sq(
        &self,
        wqe: Wqe,
        kind: DtoKind,
        cookie: u64,
        flags: DtoFlags,
        length: u32,
    ) -> Result<()> {
        check_flags(flags, DtoFlags::SEND_SIDE)?;
        self.ia().check_alive()?;
        let state = self.conn.lock().state;
        // A UD endpoint is ready from its creation; only datagrams go on its queue.
        let ready = match self.ud {
            true => wqe.ud_dest().ah != 0 && kind == DtoKind::Send,
            false => matches!(state, EpState::Connected | EpState::NonOperational),
        };
        if !ready {
            return Err(if self.ud {
                Error::InvalidEpType
            } else {
                Error::InvalidEpState
            });
        }
        // Unsignaled on the wire when the consumer wants no completion, except one in
        // every `max_request_dtos` (see `WrTable::must_signal`); its completion is
        // dropped here.
        let limit = self.attrs.lock().max_request_dtos;
        let signaled = flags.contains(DtoFlags::COMPLETION) || self.sends.lock().must_signal(limit);
        let info = WrInfo {
            cookie,
            kind,
            flags,
            length,
            signaled,
        };
        let wqe = wqe.with_flags(flags.wire(signaled) | (wqe.flags & send_flags::INLINE));
        post_with(&self.sends, Queue::Send, wqe, info, |w| {
            self.qp.post_send(w)
        })
    }
}
