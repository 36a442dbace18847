//! Device, port, QP and memory attributes shared by every provider.

use bitflags::bitflags;
use std::net::{IpAddr, SocketAddr};

/// The wire transport a device speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Transport {
    /// iWARP: RDMAP/DDP/MPA over TCP.
    Iwarp = 1,
    /// InfiniBand transport (RoCEv2 over UDP, or native IB).
    Ib = 2,
}

impl Transport {
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Iwarp),
            2 => Some(Self::Ib),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Iwarp => "iWARP",
            Self::Ib => "InfiniBand",
        }
    }
}

/// Static capabilities of a device (the answer to Query RNIC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Short name, unique on the host (`siw0`, `rxe0`, `mlx5_0`).
    pub name: String,
    pub transport: Transport,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_inline: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_mr_size: u64,
    pub max_pd: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    /// Inbound RDMA Read (and atomic) requests a QP can have outstanding as responder.
    pub max_ird: u32,
    /// Outbound RDMA Read (and atomic) requests a QP can have outstanding as requester.
    pub max_ord: u32,
    pub atomics: bool,
    pub memory_windows: bool,
    /// Address handles a device can hold (0: no unreliable-datagram QPs).
    pub max_ah: u32,
    pub phys_port_cnt: u8,
    /// How much private data this device's connection messages carry.
    pub private_data: PrivateDataLimits,
    /// Where the device's fast path runs (shared rings to the kAL, or the consumer's own
    /// user verbs provider: see [`crate::user`]).
    pub fast_path: crate::user::FastPath,
}

/// The largest private data (bytes) a consumer may pass in a connect, an accept and a
/// reject: a fact of the device's wire (MPA frames for iWARP, IB CM messages for IB),
/// reported by the provider so no layer above has to know its transport's formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrivateDataLimits {
    pub connect: u16,
    pub accept: u16,
    pub reject: u16,
}

/// Logical state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PortState {
    Down = 1,
    Init = 2,
    Armed = 3,
    Active = 4,
}

impl PortState {
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(Self::Down),
            2 => Some(Self::Init),
            3 => Some(Self::Armed),
            4 => Some(Self::Active),
            _ => None,
        }
    }
}

/// Dynamic attributes of a port (the answer to Query Port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    pub state: PortState,
    /// Active path MTU in bytes (IB: 256..4096; iWARP: the link MTU).
    pub active_mtu: u32,
    /// GID table (IB) or the bound IP addresses as IPv4-mapped IPv6 (iWARP).
    pub gids: Vec<[u8; 16]>,
    /// Name of the network interface the device is bound to.
    pub netdev: String,
}

/// Queue pair service type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QpType {
    /// Reliable connected.
    Rc = 2,
    /// Unreliable connected (IB/RoCE only): one peer, no acknowledgements, a lost
    /// packet loses its message.
    Uc = 3,
    /// Unreliable datagram.
    Ud = 4,
}

impl QpType {
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            2 => Some(Self::Rc),
            3 => Some(Self::Uc),
            4 => Some(Self::Ud),
            _ => None,
        }
    }
}

/// Verbs QP states. iWARP's RDMAP states map onto these: Idle = Init/Rtr,
/// RTS = Rts, Closing = Sqd (draining), Terminate = Sqe, Error = Error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QpState {
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Sqd = 4,
    Sqe = 5,
    Error = 6,
}

impl QpState {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            4 => Self::Sqd,
            5 => Self::Sqe,
            6 => Self::Error,
            _ => return None,
        })
    }

    /// Whether the verbs state diagram allows a consumer-requested move `self -> to`.
    pub fn can_move_to(self, to: QpState) -> bool {
        use QpState::*;
        matches!(
            (self, to),
            (_, Reset)
                | (_, Error)
                | (Reset, Init)
                | (Init, Init)
                | (Init, Rtr)
                | (Rtr, Rts)
                | (Rts, Rts)
                | (Rts, Sqd)
                | (Sqd, Rts)
                | (Sqd, Sqd)
                | (Sqe, Rts)
        )
    }
}

/// Shape of a shared receive queue (Create/Query SRQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrqAttr {
    /// Receive requests the SRQ holds.
    pub max_wr: u32,
    /// Scatter entries per receive request.
    pub max_sge: u32,
    /// Limit: when armed (non-zero), `SrqLimitReached` fires once the SRQ holds fewer
    /// receive requests than this, and the limit disarms.
    pub limit: u32,
}

/// Requested and granted sizes of a QP's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
}

bitflags! {
    /// Memory access rights of a registration or window (verbs `IBV_ACCESS_*` values).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Access: u32 {
        const LOCAL_WRITE = 1;
        const REMOTE_WRITE = 1 << 1;
        const REMOTE_READ = 1 << 2;
        const REMOTE_ATOMIC = 1 << 3;
        const MW_BIND = 1 << 4;
    }
}

impl Access {
    /// Verbs rule: remote write or atomic access requires local write.
    pub fn is_consistent(self) -> bool {
        !self.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
            || self.contains(Access::LOCAL_WRITE)
    }

    /// The rights a memory window may grant: remote ones only.
    pub const WINDOW: Access = Access::REMOTE_READ
        .union(Access::REMOTE_WRITE)
        .union(Access::REMOTE_ATOMIC);

    /// Verbs rule for binding a window with `self` onto a registration with `mr`: the
    /// registration allows binding, the window grants only remote rights, and remote
    /// write or atomic rights need local write on the registration.
    pub fn can_bind_onto(self, mr: Access) -> bool {
        mr.contains(Access::MW_BIND)
            && Access::WINDOW.contains(self)
            && (!self.intersects(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC)
                || mr.contains(Access::LOCAL_WRITE))
    }
}

bitflags! {
    /// Which fields of [`QpAttr`] a Modify QP call sets.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct QpAttrMask: u32 {
        const STATE = 1;
        const ACCESS = 1 << 1;
        const PATH_MTU = 1 << 2;
        const DEST_QPN = 1 << 3;
        const RQ_PSN = 1 << 4;
        const SQ_PSN = 1 << 5;
        const MAX_RD_ATOMIC = 1 << 6;
        const MAX_DEST_RD_ATOMIC = 1 << 7;
        const TIMEOUT = 1 << 8;
        const RETRY_CNT = 1 << 9;
        const RNR_RETRY = 1 << 10;
        const MIN_RNR_TIMER = 1 << 11;
        const AV = 1 << 12;
        const PKEY_INDEX = 1 << 13;
        const QKEY = 1 << 14;
    }
}

impl QpAttrMask {
    /// What an RC QP's move from INIT to RTR sets (IBTA 11.2.4.2: the address vector,
    /// path MTU, destination QP, receive PSN, responder resources, RNR timer).
    pub const RC_RTR: QpAttrMask = QpAttrMask::STATE
        .union(QpAttrMask::AV)
        .union(QpAttrMask::PATH_MTU)
        .union(QpAttrMask::DEST_QPN)
        .union(QpAttrMask::RQ_PSN)
        .union(QpAttrMask::MAX_DEST_RD_ATOMIC)
        .union(QpAttrMask::MIN_RNR_TIMER);
    /// What an RC QP's move from RTR to RTS sets (send PSN, initiator depth, ACK timeout
    /// and the two retry counts).
    pub const RC_RTS: QpAttrMask = QpAttrMask::STATE
        .union(QpAttrMask::SQ_PSN)
        .union(QpAttrMask::MAX_RD_ATOMIC)
        .union(QpAttrMask::TIMEOUT)
        .union(QpAttrMask::RETRY_CNT)
        .union(QpAttrMask::RNR_RETRY);
    /// What a UC QP's move from INIT to RTR sets: an RC QP's less what only answers
    /// need (responder resources, RNR timer).
    pub const UC_RTR: QpAttrMask = QpAttrMask::STATE
        .union(QpAttrMask::AV)
        .union(QpAttrMask::PATH_MTU)
        .union(QpAttrMask::DEST_QPN)
        .union(QpAttrMask::RQ_PSN);
    /// What a UC QP's move from RTR to RTS sets: the send PSN.
    pub const UC_RTS: QpAttrMask = QpAttrMask::STATE.union(QpAttrMask::SQ_PSN);
}

/// Attributes of a QP for Modify/Query QP. Fields not named in the mask are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    pub state: QpState,
    pub access: Access,
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    /// ORD: outstanding RDMA Read/atomic requests as requester.
    pub max_rd_atomic: u8,
    /// IRD: outstanding RDMA Read/atomic requests as responder.
    pub max_dest_rd_atomic: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub pkey_index: u16,
    pub qkey: u32,
    /// Destination GID (IB address vector).
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
}

impl Default for QpAttr {
    fn default() -> Self {
        QpAttr {
            state: QpState::Reset,
            access: Access::empty(),
            path_mtu: 1024,
            dest_qpn: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            pkey_index: 0,
            qkey: 0,
            dgid: [0; 16],
            sgid_index: 0,
            hop_limit: 64,
        }
    }
}

/// rdma_cm's Q_Key for UD services in its UDP port space (`RDMA_UDP_QKEY`): what a Linux
/// rdma_cm peer insists on in a SIDR reply, and what UD QPs serving it are given.
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

/// An address handle's address vector (verbs `ibv_ah_attr` with its GRH): where a UD
/// send goes. RoCEv2 always routes by GID (an IPv4 address in IPv4-mapped form), so
/// there is no LID; the source address is the GID at `sgid_index` in the port's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AhAttr {
    /// 1-based port.
    pub port: u8,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    /// 20 bits.
    pub flow_label: u32,
    /// Destination GID.
    pub dgid: [u8; 16],
}

impl Default for AhAttr {
    fn default() -> Self {
        AhAttr {
            port: 1,
            sgid_index: 0,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            dgid: [0; 16],
        }
    }
}

/// Connection parameters exchanged during connection set-up (iWARP MPA or IB CM).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnParam {
    pub private_data: Vec<u8>,
    /// Responder resources offered (inbound reads).
    pub ird: u32,
    /// Initiator depth requested (outbound reads).
    pub ord: u32,
}

/// The largest private data a connection message carries (MPA, RFC 5044 §7.1).
pub const MAX_PRIVATE_DATA: usize = 512;

/// Map an IP address onto the 16-byte GID form (IPv4-mapped IPv6 for IPv4).
pub fn ip_to_gid(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The largest IB MTU (256 … 4096 bytes) whose RoCEv2 packets, with every header, fit a
/// link of `link_mtu` bytes (what Linux's rxe takes from its netdev: 4096 over `lo`, 1024
/// over a 1500-byte Ethernet).
pub fn ib_mtu_fitting(link_mtu: u32) -> u32 {
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|m| m + 100 <= link_mtu)
        .unwrap_or(256)
}

/// Inverse of [`ip_to_gid`]: IPv4-mapped GIDs come back as IPv4.
pub fn gid_to_ip(gid: [u8; 16]) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from(gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// A socket address as carried in the ABI: 16-byte GID form plus port.
pub fn sockaddr_to_parts(sa: SocketAddr) -> ([u8; 16], u16) {
    (ip_to_gid(sa.ip()), sa.port())
}

pub fn sockaddr_from_parts(gid: [u8; 16], port: u16) -> SocketAddr {
    SocketAddr::new(gid_to_ip(gid), port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_diagram() {
        assert!(QpState::Reset.can_move_to(QpState::Init));
        assert!(!QpState::Reset.can_move_to(QpState::Rts));
        assert!(QpState::Rtr.can_move_to(QpState::Rts));
        assert!(QpState::Rts.can_move_to(QpState::Error));
        assert!(!QpState::Error.can_move_to(QpState::Rts));
    }

    #[test]
    fn gid_round_trip() {
        let sa: SocketAddr = "10.1.2.3:7174".parse().unwrap();
        let (g, p) = sockaddr_to_parts(sa);
        assert_eq!(&g[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        assert_eq!(sockaddr_from_parts(g, p), sa);
        let sa6: SocketAddr = "[fe80::1]:1".parse().unwrap();
        let (g, p) = sockaddr_to_parts(sa6);
        assert_eq!(sockaddr_from_parts(g, p), sa6);
    }

    #[test]
    fn window_rights() {
        let mr = Access::LOCAL_WRITE | Access::MW_BIND;
        assert!(Access::REMOTE_WRITE.can_bind_onto(mr));
        assert!(!Access::REMOTE_WRITE.can_bind_onto(Access::MW_BIND));
        assert!(Access::REMOTE_READ.can_bind_onto(Access::MW_BIND));
        assert!(!Access::REMOTE_READ.can_bind_onto(Access::LOCAL_WRITE));
        assert!(!(Access::LOCAL_WRITE | Access::REMOTE_READ).can_bind_onto(mr));
    }

    #[test]
    fn access_consistency() {
        assert!(!Access::REMOTE_WRITE.is_consistent());
        assert!((Access::REMOTE_WRITE | Access::LOCAL_WRITE).is_consistent());
        assert!(Access::REMOTE_READ.is_consistent());
    }
}
