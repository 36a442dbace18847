//! Out-of-band connection of an RC QP (IB and RoCE devices): Modify QP through INIT, RTR
//! and RTS with the peer's QPN, PSN and GID learnt over some other channel, as rdma-core's
//! `ibv_rc_pingpong` and perftest without `-R` do. An iWARP QP cannot be connected this
//! way: it reaches RTS only through connection management, which creates its stream.
//! A UD QP has no peer: [`ud_to_rts`] readies it, and each Send names its destination.

use crate::verbs::Qp;
use rnicpi::{Access, QpAttr, QpAttrMask, QpState, QpType, Result};

/// What the peer told us about its QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcPeer {
    pub qpn: u32,
    /// The PSN the peer's requests start at (our RQ PSN).
    pub psn: u32,
    pub gid: [u8; 16],
}

/// The attributes a program picks for RTR and RTS (the rest of the address vector comes
/// from [`RcPeer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcPath {
    /// Path MTU in bytes.
    pub path_mtu: u32,
    /// Our GID index (the source address of the packets).
    pub sgid_index: u8,
    pub hop_limit: u8,
    /// IRD: the peer's RDMA Reads we serve at once.
    pub max_dest_rd_atomic: u8,
    /// ORD: our RDMA Reads outstanding at once.
    pub max_rd_atomic: u8,
    pub min_rnr_timer: u8,
    /// Local ACK timeout (4.096 µs × 2^timeout).
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
}

/// RESET → INIT with the remote access rights the QP grants.
pub fn to_init(qp: &Qp, access: Access) -> Result<()> {
    let init = QpAttr {
        state: QpState::Init,
        access,
        ..QpAttr::default()
    };
    qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::ACCESS,
    )
}

/// A UD QP from RESET to RTS with Q_Key `qkey`, its datagrams numbered from `sq_psn`
/// (as `ibv_ud_pingpong` moves its QP: a UD QP has no peer to learn).
pub fn ud_to_rts(qp: &Qp, qkey: u32, sq_psn: u32) -> Result<()> {
    let init = QpAttr {
        state: QpState::Init,
        qkey,
        ..QpAttr::default()
    };
    qp.modify(
        &init,
        QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::QKEY,
    )?;
    let rtr = QpAttr {
        state: QpState::Rtr,
        ..QpAttr::default()
    };
    qp.modify(&rtr, QpAttrMask::STATE)?;
    let rts = QpAttr {
        state: QpState::Rts,
        sq_psn,
        ..QpAttr::default()
    };
    qp.modify(&rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN)
}

/// INIT → RTR towards `peer`: from here the QP answers the peer's requests. A UC QP
/// takes only what UC has (no responder resources, no RNR timer: a verbs provider
/// refuses those for UC).
pub fn to_rtr(qp: &Qp, path: &RcPath, peer: &RcPeer) -> Result<()> {
    let rtr = QpAttr {
        state: QpState::Rtr,
        path_mtu: path.path_mtu,
        dest_qpn: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: path.max_dest_rd_atomic,
        min_rnr_timer: path.min_rnr_timer,
        dgid: peer.gid,
        sgid_index: path.sgid_index,
        hop_limit: path.hop_limit,
        ..QpAttr::default()
    };
    let mask = match qp.qp_type {
        QpType::Uc => QpAttrMask::UC_RTR,
        _ => QpAttrMask::RC_RTR,
    };
    qp.modify(&rtr, mask)
}

/// RTR → RTS: our requests start at `sq_psn` (the PSN we told the peer); a UC QP takes
/// nothing else (it has no timeouts, retries or reads).
pub fn to_rts(qp: &Qp, path: &RcPath, sq_psn: u32) -> Result<()> {
    let rts = QpAttr {
        state: QpState::Rts,
        timeout: path.timeout,
        retry_cnt: path.retry_cnt,
        rnr_retry: path.rnr_retry,
        sq_psn,
        max_rd_atomic: path.max_rd_atomic,
        ..QpAttr::default()
    };
    let mask = match qp.qp_type {
        QpType::Uc => QpAttrMask::UC_RTS,
        _ => QpAttrMask::RC_RTS,
    };
    qp.modify(&rts, mask)
}

/// A PSN for a new connection (24 bits; perftest and `ibv_rc_pingpong` draw
/// `lrand48() & 0xffffff`), mixed from the clock, the process and `salt`.
pub fn random_psn(salt: u32) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mixed = (t ^ std::process::id().rotate_left(13) ^ salt.wrapping_mul(0x9e37_79b9))
        .wrapping_mul(2654435761);
    (mixed >> 8) & 0xff_ffff
}

#[cfg(test)]
mod tests {
    #[test]
    fn psn_is_24_bits() {
        for salt in [0, 1, 0x11, u32::MAX] {
            assert!(super::random_psn(salt) <= 0xff_ffff);
        }
    }
}
