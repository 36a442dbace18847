//! Conversions between the RNIC-PI's types and libibverbs' structs, on plain values (no
//! device needed: the unit tests below run anywhere).
//!
//! Over 600 lines: the conversions are the first 390 lines; the rest are their tests.

use crate::sys::{self, ibv_qp_attr, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_wc};
use rdma_mummy_sys as ffi;
use rnicpi::{
    send_flags, wc_flags, Access, AhAttr, Cqe, QpAttr, QpAttrMask, QpCaps, QpState, Result,
    VerbsError, WcOpcode, WcStatus, Wqe, WrOpcode, MAX_SGE,
};

/// `Access` → `IBV_ACCESS_*`.
pub fn access_to_ibv(a: Access) -> u32 {
    use ffi::ibv_access_flags as f;
    let mut v = 0;
    for (ours, theirs) in [
        (Access::LOCAL_WRITE, f::IBV_ACCESS_LOCAL_WRITE),
        (Access::REMOTE_WRITE, f::IBV_ACCESS_REMOTE_WRITE),
        (Access::REMOTE_READ, f::IBV_ACCESS_REMOTE_READ),
        (Access::REMOTE_ATOMIC, f::IBV_ACCESS_REMOTE_ATOMIC),
        (Access::MW_BIND, f::IBV_ACCESS_MW_BIND),
    ] {
        if a.contains(ours) {
            v |= theirs.0;
        }
    }
    v
}

/// Path MTU in bytes → `IBV_MTU_*` (the largest IB MTU not above it).
pub fn mtu_to_ibv(bytes: u32) -> Result<u32> {
    use ffi::ibv_mtu::*;
    Ok(match bytes {
        4096.. => IBV_MTU_4096,
        2048.. => IBV_MTU_2048,
        1024.. => IBV_MTU_1024,
        512.. => IBV_MTU_512,
        256.. => IBV_MTU_256,
        _ => return Err(VerbsError::Invalid),
    })
}

/// `IBV_MTU_*` → bytes (0 for an unknown value).
pub fn mtu_from_ibv(mtu: u32) -> u32 {
    match mtu {
        1..=5 => 128 << mtu,
        _ => 0,
    }
}

pub fn state_to_ibv(s: QpState) -> u32 {
    use ffi::ibv_qp_state::*;
    match s {
        QpState::Reset => IBV_QPS_RESET,
        QpState::Init => IBV_QPS_INIT,
        QpState::Rtr => IBV_QPS_RTR,
        QpState::Rts => IBV_QPS_RTS,
        QpState::Sqd => IBV_QPS_SQD,
        QpState::Sqe => IBV_QPS_SQE,
        QpState::Error => IBV_QPS_ERR,
    }
}

pub fn state_from_ibv(s: u32) -> QpState {
    use ffi::ibv_qp_state::*;
    match s {
        IBV_QPS_RESET => QpState::Reset,
        IBV_QPS_INIT => QpState::Init,
        IBV_QPS_RTR => QpState::Rtr,
        IBV_QPS_RTS => QpState::Rts,
        IBV_QPS_SQD => QpState::Sqd,
        IBV_QPS_SQE => QpState::Sqe,
        _ => QpState::Error,
    }
}

/// The port every address vector and INIT transition names (the devices here have one).
pub const PORT: u8 = 1;

/// An address vector → `ibv_ah_attr`: always with a GRH (RoCE needs it; on native IB the
/// GID routes too), from port 1.
pub fn ah_attr_to_ibv(a: &AhAttr) -> ffi::ibv_ah_attr {
    let mut o: ffi::ibv_ah_attr = sys::zeroed();
    o.is_global = 1;
    o.grh.dgid = ffi::ibv_gid { raw: a.dgid };
    o.grh.sgid_index = a.sgid_index;
    o.grh.hop_limit = a.hop_limit;
    o.grh.traffic_class = a.traffic_class;
    o.grh.flow_label = a.flow_label;
    o.port_num = PORT;
    o
}

/// Address `wr` (a Send of a UD QP, converted from `w`) through address handle `ah`, to
/// the QP and with the Q_Key `w` names. `ah` must stay valid until the request is posted.
pub fn set_ud(wr: &mut ibv_send_wr, w: &Wqe, ah: *mut ffi::ibv_ah) {
    let d = w.ud_dest();
    wr.wr.ud = ffi::ud_t {
        ah,
        remote_qpn: d.qpn,
        remote_qkey: d.qkey,
    };
}

/// `QpAttr` + mask → `ibv_qp_attr` + `IBV_QP_*` mask. Every field is filled in and the
/// mask says which ones count (libibverbs and the kernel read only those). The address
/// vector always carries a GRH (RoCE needs it; on native IB the GID routes too), from port
/// 1; a move to INIT also names the port (libibverbs requires it for RESET→INIT).
pub fn qp_attr_to_ibv(a: &QpAttr, mask: QpAttrMask) -> Result<(ibv_qp_attr, u32)> {
    use ffi::ibv_qp_attr_mask as m;
    let mut o: ibv_qp_attr = sys::zeroed();
    o.qp_state = state_to_ibv(a.state);
    o.port_num = PORT;
    o.qp_access_flags = access_to_ibv(a.access);
    if mask.contains(QpAttrMask::PATH_MTU) {
        o.path_mtu = mtu_to_ibv(a.path_mtu)?;
    }
    o.dest_qp_num = a.dest_qpn;
    o.rq_psn = a.rq_psn & 0xff_ffff;
    o.sq_psn = a.sq_psn & 0xff_ffff;
    o.max_rd_atomic = a.max_rd_atomic;
    o.max_dest_rd_atomic = a.max_dest_rd_atomic;
    o.timeout = a.timeout;
    o.retry_cnt = a.retry_cnt;
    o.rnr_retry = a.rnr_retry;
    o.min_rnr_timer = a.min_rnr_timer;
    o.pkey_index = a.pkey_index;
    o.qkey = a.qkey;
    o.ah_attr = ah_attr_to_ibv(&AhAttr {
        dgid: a.dgid,
        sgid_index: a.sgid_index,
        hop_limit: a.hop_limit,
        ..AhAttr::default()
    });
    let mut om = 0u32;
    for (ours, theirs) in [
        (QpAttrMask::STATE, m::IBV_QP_STATE),
        (QpAttrMask::ACCESS, m::IBV_QP_ACCESS_FLAGS),
        (QpAttrMask::PATH_MTU, m::IBV_QP_PATH_MTU),
        (QpAttrMask::DEST_QPN, m::IBV_QP_DEST_QPN),
        (QpAttrMask::RQ_PSN, m::IBV_QP_RQ_PSN),
        (QpAttrMask::SQ_PSN, m::IBV_QP_SQ_PSN),
        (QpAttrMask::MAX_RD_ATOMIC, m::IBV_QP_MAX_QP_RD_ATOMIC),
        (QpAttrMask::MAX_DEST_RD_ATOMIC, m::IBV_QP_MAX_DEST_RD_ATOMIC),
        (QpAttrMask::TIMEOUT, m::IBV_QP_TIMEOUT),
        (QpAttrMask::RETRY_CNT, m::IBV_QP_RETRY_CNT),
        (QpAttrMask::RNR_RETRY, m::IBV_QP_RNR_RETRY),
        (QpAttrMask::MIN_RNR_TIMER, m::IBV_QP_MIN_RNR_TIMER),
        (QpAttrMask::PKEY_INDEX, m::IBV_QP_PKEY_INDEX),
        (QpAttrMask::QKEY, m::IBV_QP_QKEY),
        (QpAttrMask::AV, m::IBV_QP_AV),
    ] {
        if mask.contains(ours) {
            om |= theirs.0;
        }
    }
    if mask.contains(QpAttrMask::STATE) && a.state == QpState::Init {
        om |= m::IBV_QP_PORT.0;
    }
    Ok((o, om))
}

/// `send_flags` → `IBV_SEND_*`.
pub fn send_flags_to_ibv(flags: u8) -> u32 {
    use ffi::ibv_send_flags as f;
    let mut v = 0;
    for (ours, theirs) in [
        (send_flags::FENCE, f::IBV_SEND_FENCE),
        (send_flags::SIGNALED, f::IBV_SEND_SIGNALED),
        (send_flags::SOLICITED, f::IBV_SEND_SOLICITED),
        (send_flags::INLINE, f::IBV_SEND_INLINE),
    ] {
        if flags & ours != 0 {
            v |= theirs.0;
        }
    }
    v
}

/// Check `w` against the QP's granted capabilities (send side).
pub fn validate_send(w: &Wqe, caps: &QpCaps) -> Result<u32> {
    use ffi::ibv_wr_opcode::*;
    let op = match w.opcode().ok_or(VerbsError::Invalid)? {
        WrOpcode::Send => IBV_WR_SEND,
        WrOpcode::SendWithImm => IBV_WR_SEND_WITH_IMM,
        WrOpcode::SendWithInv => IBV_WR_SEND_WITH_INV,
        WrOpcode::RdmaWrite => IBV_WR_RDMA_WRITE,
        WrOpcode::RdmaWriteWithImm => IBV_WR_RDMA_WRITE_WITH_IMM,
        WrOpcode::RdmaRead => IBV_WR_RDMA_READ,
        WrOpcode::AtomicCmpSwp => IBV_WR_ATOMIC_CMP_AND_SWP,
        WrOpcode::AtomicFetchAdd => IBV_WR_ATOMIC_FETCH_AND_ADD,
        WrOpcode::LocalInv => IBV_WR_LOCAL_INV,
        WrOpcode::BindMw => {
            // A type-2 window is bound onto a non-empty range (IB o10-37.2.40: it is
            // unbound by invalidation, LocalInv of its key), with remote rights only.
            let b = w.bind_args();
            let access = b.access.ok_or(VerbsError::Invalid)?;
            let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
            if b.len == 0 || !remote.contains(access) || w.is_inline() || w.num_sge != 0 {
                return Err(VerbsError::Invalid);
            }
            return Ok(IBV_WR_BIND_MW);
        }
        WrOpcode::Recv => return Err(VerbsError::Invalid),
    };
    if w.num_sge as usize > MAX_SGE {
        return Err(VerbsError::Invalid);
    }
    if w.is_inline() {
        if w.inline_len as usize > w.inline_data.len() || w.inline_len > caps.max_inline {
            return Err(VerbsError::Invalid);
        }
        if matches!(
            op,
            IBV_WR_RDMA_READ | IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD
        ) {
            return Err(VerbsError::Invalid);
        }
    } else if w.num_sge as u32 > caps.max_send_sge {
        return Err(VerbsError::Invalid);
    }
    if matches!(op, IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD)
        && (w.num_sge != 1 || w.sge[0].length != 8)
    {
        return Err(VerbsError::Invalid);
    }
    Ok(op)
}

/// Work requests being converted for one post: the `ibv_send_wr`/`ibv_recv_wr` chain and
/// the SGE arrays it points into (boxed so the pointers stay put).
pub struct SendChain<'a> {
    pub wrs: Vec<ibv_send_wr>,
    _sges: Vec<[ibv_sge; MAX_SGE]>,
    _wqes: std::marker::PhantomData<&'a [Wqe]>,
}

/// Convert `wqes` (already validated, opcodes from [`validate_send`]) into a linked chain.
/// Inline requests point their one SGE at the Wqe's own inline bytes, which `wqes`
/// borrows for as long as the chain lives (libibverbs copies them while posting).
pub fn send_chain<'a>(wqes: &'a [Wqe], ops: &[u32]) -> SendChain<'a> {
    let mut sges: Vec<[ibv_sge; MAX_SGE]> = vec![[sys::zeroed(); MAX_SGE]; wqes.len()];
    let mut wrs: Vec<ibv_send_wr> = Vec::with_capacity(wqes.len());
    for (i, (w, &op)) in wqes.iter().zip(ops).enumerate() {
        let mut o: ibv_send_wr = sys::zeroed();
        o.wr_id = w.wr_id;
        o.opcode = op;
        o.send_flags = send_flags_to_ibv(w.flags);
        let list = &mut sges[i];
        if w.is_inline() {
            list[0] = ibv_sge {
                addr: w.inline_data.as_ptr() as u64,
                length: w.inline_len,
                lkey: 0,
            };
            o.num_sge = (w.inline_len > 0) as i32;
        } else {
            o.num_sge = copy_sges(w, list);
        }
        o.sg_list = list.as_mut_ptr();
        use ffi::ibv_wr_opcode::*;
        match op {
            IBV_WR_SEND_WITH_IMM
            | IBV_WR_RDMA_WRITE_WITH_IMM
            | IBV_WR_SEND_WITH_INV
            | IBV_WR_LOCAL_INV => {
                // Immediate data travels in network order as the consumer gave it; the
                // rkey to invalidate shares the word.
                o.imm_data_invalidated_rkey_union.imm_data = w.imm_or_inv;
            }
            _ => {}
        }
        match op {
            IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM | IBV_WR_RDMA_READ => {
                o.wr.rdma = ffi::rdma_t {
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                };
            }
            IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD => {
                o.wr.atomic = ffi::atomic_t {
                    remote_addr: w.remote_addr,
                    compare_add: w.compare_add,
                    swap: w.swap,
                    rkey: w.rkey,
                };
            }
            _ => {}
        }
        wrs.push(o);
    }
    link(&mut wrs, |wr| &mut wr.next);
    SendChain {
        wrs,
        _sges: sges,
        _wqes: std::marker::PhantomData,
    }
}

/// Fill in the bind of `wr` (an `IBV_WR_BIND_MW` request converted from `w`): window `mw`
/// gets `w`'s new key and the range of registration `mr` with `w`'s rights. The pointers
/// must stay valid until the request is posted.
pub fn set_bind(wr: &mut ibv_send_wr, w: &Wqe, mw: *mut ffi::ibv_mw, mr: *mut ffi::ibv_mr) {
    let b = w.bind_args();
    wr.num_sge = 0;
    wr.bind_mw_tso_union.bind_mw = ffi::bind_mw_t {
        mw,
        rkey: b.mw_rkey,
        bind_info: ffi::ibv_mw_bind_info {
            mr,
            addr: b.addr,
            length: b.len,
            mw_access_flags: access_to_ibv(b.access.unwrap_or(Access::empty())),
        },
    };
}

/// An unbind: a bind of length 0 (how krdma's consumers unbind a window).
pub fn is_unbind(w: &Wqe) -> bool {
    w.opcode() == Some(WrOpcode::BindMw) && w.bind_args().len == 0
}

/// The index part of a window key (what stays the same across its binds).
pub fn mw_index(rkey: u32) -> u32 {
    rkey & !0xff
}

/// Receive requests for one post.
pub struct RecvChain {
    pub wrs: Vec<ibv_recv_wr>,
    _sges: Vec<[ibv_sge; MAX_SGE]>,
}

/// Convert receive requests (scatter lists of at most `max_sge` entries) into a chain.
pub fn recv_chain(wqes: &[Wqe], max_sge: u32) -> Result<RecvChain> {
    let mut sges: Vec<[ibv_sge; MAX_SGE]> = vec![[sys::zeroed(); MAX_SGE]; wqes.len()];
    let mut wrs: Vec<ibv_recv_wr> = Vec::with_capacity(wqes.len());
    for (i, w) in wqes.iter().enumerate() {
        if w.num_sge as usize > MAX_SGE || w.num_sge as u32 > max_sge {
            return Err(VerbsError::Invalid);
        }
        if !matches!(w.opcode(), Some(WrOpcode::Recv) | None) && w.opcode != 0 {
            return Err(VerbsError::Invalid);
        }
        let list = &mut sges[i];
        let mut o: ibv_recv_wr = sys::zeroed();
        o.wr_id = w.wr_id;
        o.num_sge = copy_sges(w, list);
        o.sg_list = list.as_mut_ptr();
        wrs.push(o);
    }
    link(&mut wrs, |wr| &mut wr.next);
    Ok(RecvChain { wrs, _sges: sges })
}

/// Copy `w`'s gather/scatter list into `list`; the number of entries.
fn copy_sges(w: &Wqe, list: &mut [ibv_sge; MAX_SGE]) -> i32 {
    for (d, s) in list.iter_mut().zip(w.sges()) {
        *d = ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        };
    }
    w.sges().len() as i32
}

/// Link work requests into the chain libibverbs walks (`next`; the last one's is NULL).
/// The vector must not move or grow afterwards.
fn link<T>(wrs: &mut [T], next: impl Fn(&mut T) -> &mut *mut T) {
    let n = wrs.len();
    let base = wrs.as_mut_ptr();
    for (i, wr) in wrs.iter_mut().enumerate() {
        *next(wr) = if i + 1 < n {
            base.wrapping_add(i + 1)
        } else {
            std::ptr::null_mut()
        };
    }
}

/// `ibv_wc` → `Cqe`.
pub fn wc_to_cqe(wc: &ibv_wc) -> Cqe {
    use ffi::ibv_wc_opcode::*;
    let status = if wc.status <= u8::MAX as u32 {
        WcStatus::from_u8(wc.status as u8)
    } else {
        WcStatus::GeneralErr
    };
    let opcode = match wc.opcode {
        IBV_WC_SEND => WcOpcode::Send,
        IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        IBV_WC_COMP_SWAP => WcOpcode::CompSwap,
        IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
        IBV_WC_BIND_MW => WcOpcode::BindMw,
        IBV_WC_LOCAL_INV => WcOpcode::LocalInv,
        IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        // Error completions leave the opcode undefined; receives report IBV_WC_RECV.
        _ => WcOpcode::Recv,
    };
    let mut flags = 0;
    if wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
        flags |= wc_flags::WITH_IMM;
    }
    if wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_INV.0 != 0 {
        flags |= wc_flags::WITH_INV;
    }
    let carries_word = flags != 0;
    if wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0 {
        flags |= wc_flags::GRH;
    }
    Cqe {
        wr_id: wc.wr_id,
        status: status as u8,
        opcode: opcode as u8,
        flags,
        _reserved: 0,
        byte_len: wc.byte_len,
        qp_num: wc.qp_num,
        imm_or_inv: if carries_word { sys::wc_imm(wc) } else { 0 },
        src_qp: wc.src_qp,
        vendor_err: wc.vendor_err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rnicpi::Sge;

    fn caps() -> QpCaps {
        QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline: 64,
        }
    }

    #[test]
    fn access_bits() {
        use ffi::ibv_access_flags as f;
        assert_eq!(access_to_ibv(Access::empty()), 0);
        let all = Access::LOCAL_WRITE
            | Access::REMOTE_WRITE
            | Access::REMOTE_READ
            | Access::REMOTE_ATOMIC
            | Access::MW_BIND;
        let want = f::IBV_ACCESS_LOCAL_WRITE.0
            | f::IBV_ACCESS_REMOTE_WRITE.0
            | f::IBV_ACCESS_REMOTE_READ.0
            | f::IBV_ACCESS_REMOTE_ATOMIC.0
            | f::IBV_ACCESS_MW_BIND.0;
        assert_eq!(access_to_ibv(all), want);
        assert_eq!(
            access_to_ibv(Access::REMOTE_READ),
            f::IBV_ACCESS_REMOTE_READ.0
        );
    }

    #[test]
    fn mtu() {
        assert_eq!(mtu_to_ibv(1024).unwrap(), ffi::ibv_mtu::IBV_MTU_1024);
        assert_eq!(mtu_to_ibv(1500).unwrap(), ffi::ibv_mtu::IBV_MTU_1024);
        assert_eq!(mtu_to_ibv(4096).unwrap(), ffi::ibv_mtu::IBV_MTU_4096);
        assert_eq!(mtu_to_ibv(9000).unwrap(), ffi::ibv_mtu::IBV_MTU_4096);
        assert_eq!(mtu_to_ibv(256).unwrap(), ffi::ibv_mtu::IBV_MTU_256);
        assert_eq!(mtu_to_ibv(100), Err(VerbsError::Invalid));
        for b in [256, 512, 1024, 2048, 4096] {
            assert_eq!(mtu_from_ibv(mtu_to_ibv(b).unwrap()), b);
        }
    }

    #[test]
    fn qp_attr_init_rtr_rts() {
        use ffi::ibv_qp_attr_mask as m;
        // INIT as ual::oob::to_init asks it: the port is added.
        let init = QpAttr {
            state: QpState::Init,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::LOCAL_WRITE,
            ..QpAttr::default()
        };
        let (a, mask) = qp_attr_to_ibv(
            &init,
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::ACCESS,
        )
        .unwrap();
        assert_eq!(
            mask,
            m::IBV_QP_STATE.0
                | m::IBV_QP_PORT.0
                | m::IBV_QP_PKEY_INDEX.0
                | m::IBV_QP_ACCESS_FLAGS.0
        );
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(a.port_num, 1);
        assert_eq!(a.pkey_index, 0);
        assert_eq!(a.qp_access_flags, 7);

        // RTR with the address vector.
        let gid = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 11];
        let rtr = QpAttr {
            state: QpState::Rtr,
            path_mtu: 1024,
            dest_qpn: 0x11,
            rq_psn: 0x1234567, // only 24 bits travel
            max_dest_rd_atomic: 4,
            min_rnr_timer: 12,
            dgid: gid,
            sgid_index: 1,
            hop_limit: 64,
            ..QpAttr::default()
        };
        let (a, mask) = qp_attr_to_ibv(&rtr, QpAttrMask::RC_RTR).unwrap();
        assert_eq!(
            mask,
            m::IBV_QP_STATE.0
                | m::IBV_QP_AV.0
                | m::IBV_QP_PATH_MTU.0
                | m::IBV_QP_DEST_QPN.0
                | m::IBV_QP_RQ_PSN.0
                | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | m::IBV_QP_MIN_RNR_TIMER.0
        );
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(a.path_mtu, ffi::ibv_mtu::IBV_MTU_1024);
        assert_eq!(a.dest_qp_num, 0x11);
        assert_eq!(a.rq_psn, 0x234567);
        assert_eq!(a.max_dest_rd_atomic, 4);
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.port_num, 1);
        assert_eq!(a.ah_attr.grh.sgid_index, 1);
        assert_eq!(a.ah_attr.grh.hop_limit, 64);
        // SAFETY (test): the union holds the raw bytes we wrote.
        assert_eq!(unsafe { a.ah_attr.grh.dgid.raw }, gid);

        let rts = QpAttr {
            state: QpState::Rts,
            sq_psn: 77,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 2,
            ..QpAttr::default()
        };
        let (a, mask) = qp_attr_to_ibv(&rts, QpAttrMask::RC_RTS).unwrap();
        assert_eq!(
            mask,
            m::IBV_QP_STATE.0
                | m::IBV_QP_SQ_PSN.0
                | m::IBV_QP_MAX_QP_RD_ATOMIC.0
                | m::IBV_QP_TIMEOUT.0
                | m::IBV_QP_RETRY_CNT.0
                | m::IBV_QP_RNR_RETRY.0
        );
        assert_eq!(
            (
                a.sq_psn,
                a.timeout,
                a.retry_cnt,
                a.rnr_retry,
                a.max_rd_atomic
            ),
            (77, 14, 7, 7, 2)
        );

        let (a, mask) = qp_attr_to_ibv(
            &QpAttr {
                state: QpState::Error,
                ..QpAttr::default()
            },
            QpAttrMask::STATE,
        )
        .unwrap();
        assert_eq!(
            (a.qp_state, mask),
            (ffi::ibv_qp_state::IBV_QPS_ERR, m::IBV_QP_STATE.0)
        );
        for s in [
            QpState::Reset,
            QpState::Init,
            QpState::Rtr,
            QpState::Rts,
            QpState::Sqd,
            QpState::Sqe,
            QpState::Error,
        ] {
            assert_eq!(state_from_ibv(state_to_ibv(s)), s);
        }
    }

    #[test]
    fn datagram_sends_and_receives() {
        let gid = std::net::Ipv4Addr::new(10, 77, 0, 1)
            .to_ipv6_mapped()
            .octets();
        let a = ah_attr_to_ibv(&AhAttr {
            dgid: gid,
            sgid_index: 1,
            flow_label: 0x1234,
            ..AhAttr::default()
        });
        assert_eq!((a.is_global, a.port_num), (1, 1));
        assert_eq!(
            (a.grh.sgid_index, a.grh.hop_limit, a.grh.flow_label),
            (1, 64, 0x1234)
        );
        // SAFETY: the GID union's byte view.
        assert_eq!(unsafe { a.grh.dgid.raw }, gid);

        let sge = Sge {
            addr: 0x1000,
            length: 64,
            lkey: 0x55,
        };
        let w = Wqe::new(1, WrOpcode::SendWithImm, &[sge])
            .with_imm(7)
            .with_ud(3, 0x12_3456, 0x1111_1111);
        let op = validate_send(&w, &caps()).unwrap();
        let mut chain = send_chain(std::slice::from_ref(&w), &[op]);
        let ah = 0x5000 as *mut ffi::ibv_ah;
        set_ud(&mut chain.wrs[0], &w, ah);
        // SAFETY: the union member `set_ud` wrote.
        let ud = unsafe { chain.wrs[0].wr.ud };
        assert_eq!(
            (ud.ah, ud.remote_qpn, ud.remote_qkey),
            (ah, 0x12_3456, 0x1111_1111)
        );

        let mut wc: ibv_wc = sys::zeroed();
        wc.opcode = ffi::ibv_wc_opcode::IBV_WC_RECV;
        wc.byte_len = 40 + 64;
        wc.src_qp = 0x12_3456;
        wc.wc_flags = ffi::ibv_wc_flags::IBV_WC_GRH.0;
        let c = wc_to_cqe(&wc);
        assert_eq!(c.flags, wc_flags::GRH);
        assert_eq!((c.byte_len, c.src_qp, c.imm_or_inv), (104, 0x12_3456, 0));
    }

    #[test]
    fn send_requests() {
        use ffi::ibv_send_flags as f;
        use ffi::ibv_wr_opcode::*;
        let sge = Sge {
            addr: 0x1000,
            length: 64,
            lkey: 0x55,
        };
        let wqes = [
            Wqe::new(1, WrOpcode::Send, &[sge, sge])
                .with_flags(send_flags::SIGNALED | send_flags::SOLICITED),
            Wqe::new(2, WrOpcode::RdmaWriteWithImm, &[sge])
                .with_remote(0xdead_0000, 0x77)
                .with_imm(0x0102_0304),
            Wqe::new(3, WrOpcode::RdmaRead, &[sge])
                .with_remote(0xbeef_0000, 0x78)
                .with_flags(send_flags::SIGNALED | send_flags::FENCE),
            Wqe {
                compare_add: 5,
                swap: 9,
                ..Wqe::new(4, WrOpcode::AtomicCmpSwp, &[Sge { length: 8, ..sge }])
                    .with_remote(0x8000, 0x79)
            },
            Wqe::new(5, WrOpcode::Send, &[])
                .with_inline(b"hello")
                .unwrap(),
        ];
        let ops: Vec<u32> = wqes
            .iter()
            .map(|w| validate_send(w, &caps()).unwrap())
            .collect();
        assert_eq!(
            ops,
            [
                IBV_WR_SEND,
                IBV_WR_RDMA_WRITE_WITH_IMM,
                IBV_WR_RDMA_READ,
                IBV_WR_ATOMIC_CMP_AND_SWP,
                IBV_WR_SEND
            ]
        );
        let chain = send_chain(&wqes, &ops);
        let w = &chain.wrs;
        assert_eq!(w.len(), 5);
        for i in 0..4 {
            assert_eq!(w[i].next, &w[i + 1] as *const _ as *mut _);
        }
        assert!(w[4].next.is_null());
        assert_eq!(
            w[0].send_flags,
            f::IBV_SEND_SIGNALED.0 | f::IBV_SEND_SOLICITED.0
        );
        assert_eq!(w[0].num_sge, 2);
        // SAFETY (test): the SGE list points into the chain's own arrays.
        let s0 = unsafe { *w[0].sg_list.add(1) };
        assert_eq!((s0.addr, s0.length, s0.lkey), (0x1000, 64, 0x55));
        // SAFETY (test): reading the union members we wrote.
        unsafe {
            assert_eq!(w[1].imm_data_invalidated_rkey_union.imm_data, 0x0102_0304);
            assert_eq!(
                (w[1].wr.rdma.remote_addr, w[1].wr.rdma.rkey),
                (0xdead_0000, 0x77)
            );
            assert_eq!(
                (w[2].wr.rdma.remote_addr, w[2].wr.rdma.rkey),
                (0xbeef_0000, 0x78)
            );
            let at = w[3].wr.atomic;
            assert_eq!(
                (at.remote_addr, at.compare_add, at.swap, at.rkey),
                (0x8000, 5, 9, 0x79)
            );
        }
        assert_eq!(
            w[2].send_flags,
            f::IBV_SEND_SIGNALED.0 | f::IBV_SEND_FENCE.0
        );
        // Inline: the SGE points at the Wqe's own bytes.
        assert_eq!(w[4].send_flags & f::IBV_SEND_INLINE.0, f::IBV_SEND_INLINE.0);
        assert_eq!(w[4].num_sge, 1);
        // SAFETY (test): as above.
        let s = unsafe { *w[4].sg_list };
        assert_eq!(s.addr, wqes[4].inline_data.as_ptr() as u64);
        assert_eq!(s.length, 5);
    }

    #[test]
    fn send_validation() {
        let sge = Sge {
            addr: 0x1000,
            length: 8,
            lkey: 1,
        };
        let c = caps();
        assert_eq!(
            validate_send(&Wqe::new(1, WrOpcode::Send, &[sge; 5]), &c),
            Err(VerbsError::Invalid)
        );
        let big = Wqe::new(1, WrOpcode::Send, &[])
            .with_inline(&[0; 80])
            .unwrap();
        assert_eq!(validate_send(&big, &c), Err(VerbsError::Invalid));
        let bad_atomic = Wqe::new(1, WrOpcode::AtomicFetchAdd, &[Sge { length: 4, ..sge }]);
        assert_eq!(validate_send(&bad_atomic, &c), Err(VerbsError::Invalid));
        assert_eq!(
            validate_send(
                &Wqe {
                    opcode: 99,
                    ..Wqe::default()
                },
                &c
            ),
            Err(VerbsError::Invalid)
        );
        let bind = Wqe::bind_mw(1, 2, 3, 4, 5, Access::REMOTE_READ);
        assert_eq!(
            validate_send(&bind, &c),
            Ok(ffi::ibv_wr_opcode::IBV_WR_BIND_MW)
        );
        // Type 2: no empty range (unbinding is invalidation), remote rights only, no data.
        for bad in [
            Wqe::bind_mw(1, 2, 3, 4, 0, Access::REMOTE_READ),
            Wqe::bind_mw(1, 2, 3, 4, 5, Access::REMOTE_READ | Access::LOCAL_WRITE),
            Wqe::bind_mw(1, 2, 3, 4, 5, Access::REMOTE_READ | Access::MW_BIND),
            Wqe {
                swap: 1 << 40,
                ..bind
            },
            Wqe { num_sge: 1, ..bind },
        ] {
            assert_eq!(validate_send(&bad, &c), Err(VerbsError::Invalid), "{bad:?}");
        }
        let recv = recv_chain(&[Wqe::recv(7, &[sge; 5])], 4);
        assert!(recv.is_err());
        let recv = recv_chain(&[Wqe::recv(7, &[sge, sge]), Wqe::recv(8, &[sge])], 4).unwrap();
        assert_eq!(recv.wrs[0].num_sge, 2);
        assert_eq!(recv.wrs[0].next, &recv.wrs[1] as *const _ as *mut _);
        assert_eq!(recv.wrs[1].wr_id, 8);
    }

    #[test]
    fn window_binds_and_invalidations() {
        use ffi::ibv_access_flags as f;
        use ffi::ibv_wr_opcode::*;
        let sge = Sge {
            addr: 0x1000,
            length: 64,
            lkey: 0x55,
        };
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let wqes = [
            Wqe::new(1, WrOpcode::Send, &[sge]),
            Wqe::bind_mw(2, 0x0012_3402, 0x0000_7701, 0x2000, 256, rw)
                .with_flags(send_flags::SIGNALED | send_flags::FENCE),
            Wqe::new(3, WrOpcode::LocalInv, &[]).with_imm(0x0012_3402),
            Wqe::new(4, WrOpcode::SendWithInv, &[sge]).with_imm(0x0045_6709),
        ];
        let ops: Vec<u32> = wqes
            .iter()
            .map(|w| validate_send(w, &caps()).unwrap())
            .collect();
        assert_eq!(
            ops,
            [
                IBV_WR_SEND,
                IBV_WR_BIND_MW,
                IBV_WR_LOCAL_INV,
                IBV_WR_SEND_WITH_INV
            ]
        );
        let mut chain = send_chain(&wqes, &ops);
        // Stand-ins for the libibverbs objects (only their addresses travel).
        let (mut mw, mut mr) = (0u64, 0u64);
        let (mwp, mrp) = (
            (&mut mw as *mut u64).cast::<ffi::ibv_mw>(),
            (&mut mr as *mut u64).cast::<ffi::ibv_mr>(),
        );
        set_bind(&mut chain.wrs[1], &wqes[1], mwp, mrp);
        let w = &chain.wrs;
        assert_eq!(w[1].opcode, IBV_WR_BIND_MW);
        assert_eq!(w[1].num_sge, 0);
        assert_eq!(
            w[1].send_flags,
            ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 | ffi::ibv_send_flags::IBV_SEND_FENCE.0
        );
        // SAFETY (test): reading the union members we wrote.
        unsafe {
            let b = w[1].bind_mw_tso_union.bind_mw;
            assert_eq!((b.mw, b.rkey), (mwp, 0x0012_3402));
            assert_eq!(
                (b.bind_info.mr, b.bind_info.addr, b.bind_info.length),
                (mrp, 0x2000, 256)
            );
            assert_eq!(
                b.bind_info.mw_access_flags,
                f::IBV_ACCESS_REMOTE_READ.0 | f::IBV_ACCESS_REMOTE_WRITE.0
            );
            // The key to invalidate travels in the immediate/invalidate word.
            assert_eq!(
                w[2].imm_data_invalidated_rkey_union.invalidated_rkey,
                0x0012_3402
            );
            assert_eq!(
                w[3].imm_data_invalidated_rkey_union.invalidated_rkey,
                0x0045_6709
            );
        }
        assert_eq!(w[3].num_sge, 1);
        assert_eq!(mw_index(0x0012_3402), 0x0012_3400);
        assert_eq!(mw_index(0x0012_34ff), mw_index(0x0012_3400));
    }

    #[test]
    fn completions() {
        use ffi::ibv_wc_opcode::*;
        let mut wc: ibv_wc = sys::zeroed();
        wc.wr_id = 42;
        wc.status = ffi::ibv_wc_status::IBV_WC_SUCCESS;
        wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
        wc.byte_len = 100;
        wc.qp_num = 0x11;
        wc.src_qp = 0x12;
        wc.wc_flags = ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0;
        wc.imm_data_invalidated_rkey_union.imm_data = 0xaabb_ccdd;
        let c = wc_to_cqe(&wc);
        assert_eq!(c.wr_id, 42);
        assert!(c.is_ok());
        assert_eq!(c.opcode(), Some(WcOpcode::RecvRdmaWithImm));
        assert_eq!(c.flags, wc_flags::WITH_IMM);
        assert_eq!(c.imm_or_inv, 0xaabb_ccdd);
        assert_eq!((c.byte_len, c.qp_num, c.src_qp), (100, 0x11, 0x12));

        let mut wc: ibv_wc = sys::zeroed();
        wc.status = ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
        wc.opcode = IBV_WC_RDMA_WRITE;
        wc.vendor_err = 0x81;
        let c = wc_to_cqe(&wc);
        assert_eq!(c.status(), WcStatus::RemAccessErr);
        assert_eq!(c.opcode(), Some(WcOpcode::RdmaWrite));
        assert_eq!(c.vendor_err, 0x81);
        assert_eq!(c.imm_or_inv, 0);
        wc.status = ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
        assert_eq!(wc_to_cqe(&wc).status(), WcStatus::WrFlushErr);
        wc.status = 999;
        assert_eq!(wc_to_cqe(&wc).status(), WcStatus::GeneralErr);
        for (o, want) in [
            (IBV_WC_SEND, WcOpcode::Send),
            (IBV_WC_RDMA_READ, WcOpcode::RdmaRead),
            (IBV_WC_COMP_SWAP, WcOpcode::CompSwap),
            (IBV_WC_FETCH_ADD, WcOpcode::FetchAdd),
            (IBV_WC_RECV, WcOpcode::Recv),
        ] {
            wc.opcode = o;
            assert_eq!(wc_to_cqe(&wc).opcode(), Some(want));
        }
    }
}
