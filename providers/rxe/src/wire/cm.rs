//! InfiniBand Communication Manager messages (IBTA chapter 12.6): the 232 bytes after the
//! MAD common header of a CM MAD (management class 0x07, class version 2, method Send).
//! Layouts as in Linux `include/rdma/ibta_vol1_c12.h`. Bit fields are listed from the most
//! significant bit of their byte; every multi-byte field is big-endian. Reserved bits are
//! written as zero and ignored on receive.
//!
//! Over 600 lines: the seven messages' codecs share the path record and field helpers
//! and are the first 630 lines; the rest are their tests.
//!
//! The [`cma`](super::cma) header that rdma_cm puts at the start of the REQ private data is
//! decoded separately ([`Req::cma_header`]).
//!
//! Over 600 lines: the seven CM messages are the first 630 lines; the rest are tests.

use super::cma::CmaHdr;
use super::mad::{self, DATA_LEN, MAD_LEN};
use super::{need, Error, Result};
use rnicpi::wire::{rd16, rd24, rd32, rd64, rdbits, wr16, wr24, wr32, wr64, wrbits};

/// Attribute IDs.
pub const ATTR_REQ: u16 = 0x0010;
pub const ATTR_MRA: u16 = 0x0011;
pub const ATTR_REJ: u16 = 0x0012;
pub const ATTR_REP: u16 = 0x0013;
pub const ATTR_RTU: u16 = 0x0014;
pub const ATTR_DREQ: u16 = 0x0015;
pub const ATTR_DREP: u16 = 0x0016;
pub const ATTR_SIDR_REQ: u16 = 0x0017;
pub const ATTR_SIDR_REP: u16 = 0x0018;

/// Private data sizes.
pub const REQ_PRIVATE_DATA_LEN: usize = 92;
pub const MRA_PRIVATE_DATA_LEN: usize = 222;
pub const REJ_PRIVATE_DATA_LEN: usize = 148;
pub const REJ_ARI_LEN: usize = 72;
pub const REP_PRIVATE_DATA_LEN: usize = 196;
pub const RTU_PRIVATE_DATA_LEN: usize = 224;
pub const DREQ_PRIVATE_DATA_LEN: usize = 220;
pub const DREP_PRIVATE_DATA_LEN: usize = 224;
pub const SIDR_REQ_PRIVATE_DATA_LEN: usize = 216;
pub const SIDR_REP_PRIVATE_DATA_LEN: usize = 136;
pub const SIDR_REP_INFO_LEN: usize = 72;

/// SIDR_REP status values (IBTA table 121).
pub mod sidr_status {
    pub const SUCCESS: u8 = 0;
    /// No service with that ID here.
    pub const UNSUPPORTED: u8 = 1;
    /// The consumer refused.
    pub const REJECT: u8 = 2;
    pub const NO_QP: u8 = 3;
    pub const REDIRECT: u8 = 4;
    pub const UNSUPPORTED_VERSION: u8 = 5;
}

/// Which message an MRA or REJ refers to (2-bit field).
pub mod msg_ref {
    pub const REQ: u8 = 0;
    pub const REP: u8 = 1;
    pub const OTHER: u8 = 2;
}

/// Some REJ reasons (IBTA table 112; Linux `enum ib_cm_rej_reason`).
pub mod rej_reason {
    pub const NO_QP: u16 = 1;
    pub const NO_RESOURCES: u16 = 3;
    pub const TIMEOUT: u16 = 4;
    pub const UNSUPPORTED: u16 = 5;
    pub const INVALID_COMM_ID: u16 = 6;
    pub const INVALID_SERVICE_ID: u16 = 8;
    pub const STALE_CONN: u16 = 10;
    pub const CONSUMER_DEFINED: u16 = 28;
}

/// Transport service types in the REQ.
pub mod transport_type {
    pub const RC: u8 = 0;
    pub const UC: u8 = 1;
    pub const RD: u8 = 2;
}

/// Path MTU codes (REQ `path_mtu`): 1 = 256 bytes … 5 = 4096 bytes.
pub fn mtu_bytes(code: u8) -> Option<usize> {
    match code {
        1..=5 => Some(128 << code),
        _ => None,
    }
}

fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

/// A path as described in the REQ (primary at byte 52, alternate at byte 96; 44 bytes).
/// Over RoCE the LIDs are 0xffff (permissive) and the GIDs are the IP addresses, IPv4
/// ones mapped as `::ffff:a.b.c.d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CmPath {
    pub local_lid: u16,
    pub remote_lid: u16,
    pub local_gid: [u8; 16],
    pub remote_gid: [u8; 16],
    /// 20 bits.
    pub flow_label: u32,
    /// 6 bits (IBTA static rate code).
    pub packet_rate: u8,
    pub traffic_class: u8,
    pub hop_limit: u8,
    /// 4 bits.
    pub sl: u8,
    pub subnet_local: bool,
    /// 5 bits (4.096 µs × 2^n).
    pub local_ack_timeout: u8,
}

/// Bytes of a path in a REQ.
pub const PATH_LEN: usize = 44;

impl CmPath {
    fn parse(b: &[u8], at: usize) -> CmPath {
        CmPath {
            local_lid: rd16(b, at),
            remote_lid: rd16(b, at + 2),
            local_gid: arr(b, at + 4),
            remote_gid: arr(b, at + 20),
            flow_label: rd32(b, at + 36) >> 12,
            packet_rate: rdbits(b, at + 39, 0, 6),
            traffic_class: b[at + 40],
            hop_limit: b[at + 41],
            sl: rdbits(b, at + 42, 4, 4),
            subnet_local: rdbits(b, at + 42, 3, 1) != 0,
            local_ack_timeout: rdbits(b, at + 43, 3, 5),
        }
    }

    fn emit(&self, b: &mut [u8], at: usize) {
        wr16(b, at, self.local_lid);
        wr16(b, at + 2, self.remote_lid);
        b[at + 4..at + 20].copy_from_slice(&self.local_gid);
        b[at + 20..at + 36].copy_from_slice(&self.remote_gid);
        let w = rd32(b, at + 36) & 0xfff;
        wr32(b, at + 36, w | ((self.flow_label & 0xf_ffff) << 12));
        wrbits(b, at + 39, 0, 6, self.packet_rate);
        b[at + 40] = self.traffic_class;
        b[at + 41] = self.hop_limit;
        wrbits(b, at + 42, 4, 4, self.sl);
        wrbits(b, at + 42, 3, 1, self.subnet_local as u8);
        wrbits(b, at + 43, 3, 5, self.local_ack_timeout);
    }
}

/// Connection request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Req {
    pub local_comm_id: u32,
    pub service_id: u64,
    pub local_ca_guid: u64,
    pub local_qkey: u32,
    /// 24 bits.
    pub local_qpn: u32,
    pub responder_resources: u8,
    /// 24 bits.
    pub local_eecn: u32,
    pub initiator_depth: u8,
    /// 24 bits.
    pub remote_eecn: u32,
    /// 5 bits (4.096 µs × 2^n).
    pub remote_cm_response_timeout: u8,
    /// 2 bits ([`transport_type`]).
    pub transport_service_type: u8,
    pub end_to_end_flow_control: bool,
    /// 24 bits. Linux takes it as the PSN the passive side's requests start with (the
    /// active side's expected PSN); the kernel captures agree.
    pub starting_psn: u32,
    /// 5 bits.
    pub local_cm_response_timeout: u8,
    /// 3 bits.
    pub retry_count: u8,
    pub pkey: u16,
    /// 4 bits ([`mtu_bytes`]).
    pub path_mtu: u8,
    pub rdc_exists: bool,
    /// 3 bits (7 = infinite).
    pub rnr_retry_count: u8,
    /// 4 bits.
    pub max_cm_retries: u8,
    pub srq: bool,
    /// 3 bits.
    pub extended_transport_type: u8,
    pub primary_path: CmPath,
    pub alternate_path: CmPath,
    pub sap_supported: bool,
    pub private_data: [u8; REQ_PRIVATE_DATA_LEN],
}

impl Req {
    fn parse(b: &[u8]) -> Req {
        Req {
            local_comm_id: rd32(b, 0),
            service_id: rd64(b, 8),
            local_ca_guid: rd64(b, 16),
            local_qkey: rd32(b, 28),
            local_qpn: rd24(b, 32),
            responder_resources: b[35],
            local_eecn: rd24(b, 36),
            initiator_depth: b[39],
            remote_eecn: rd24(b, 40),
            remote_cm_response_timeout: rdbits(b, 43, 3, 5),
            transport_service_type: rdbits(b, 43, 1, 2),
            end_to_end_flow_control: rdbits(b, 43, 0, 1) != 0,
            starting_psn: rd24(b, 44),
            local_cm_response_timeout: rdbits(b, 47, 3, 5),
            retry_count: rdbits(b, 47, 0, 3),
            pkey: rd16(b, 48),
            path_mtu: rdbits(b, 50, 4, 4),
            rdc_exists: rdbits(b, 50, 3, 1) != 0,
            rnr_retry_count: rdbits(b, 50, 0, 3),
            max_cm_retries: rdbits(b, 51, 4, 4),
            srq: rdbits(b, 51, 3, 1) != 0,
            extended_transport_type: rdbits(b, 51, 0, 3),
            primary_path: CmPath::parse(b, 52),
            alternate_path: CmPath::parse(b, 96),
            sap_supported: rdbits(b, 139, 2, 1) != 0,
            private_data: arr(b, 140),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        wr32(b, 0, self.local_comm_id);
        wr64(b, 8, self.service_id);
        wr64(b, 16, self.local_ca_guid);
        wr32(b, 28, self.local_qkey);
        wr24(b, 32, self.local_qpn);
        b[35] = self.responder_resources;
        wr24(b, 36, self.local_eecn);
        b[39] = self.initiator_depth;
        wr24(b, 40, self.remote_eecn);
        wrbits(b, 43, 3, 5, self.remote_cm_response_timeout);
        wrbits(b, 43, 1, 2, self.transport_service_type);
        wrbits(b, 43, 0, 1, self.end_to_end_flow_control as u8);
        wr24(b, 44, self.starting_psn);
        wrbits(b, 47, 3, 5, self.local_cm_response_timeout);
        wrbits(b, 47, 0, 3, self.retry_count);
        wr16(b, 48, self.pkey);
        wrbits(b, 50, 4, 4, self.path_mtu);
        wrbits(b, 50, 3, 1, self.rdc_exists as u8);
        wrbits(b, 50, 0, 3, self.rnr_retry_count);
        wrbits(b, 51, 4, 4, self.max_cm_retries);
        wrbits(b, 51, 3, 1, self.srq as u8);
        wrbits(b, 51, 0, 3, self.extended_transport_type);
        self.primary_path.emit(b, 52);
        self.alternate_path.emit(b, 96);
        wrbits(b, 139, 2, 1, self.sap_supported as u8);
        b[140..].copy_from_slice(&self.private_data);
    }

    /// The rdma_cm header at the start of the private data (present when the REQ comes
    /// from rdma_cm with an IP address, as rping's does).
    pub fn cma_header(&self) -> Result<CmaHdr> {
        CmaHdr::parse(&self.private_data)
    }
}

/// Message receipt acknowledgement ("I need more time").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Mra {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    /// 2 bits ([`msg_ref`]).
    pub message_mraed: u8,
    /// 5 bits.
    pub service_timeout: u8,
    pub private_data: [u8; MRA_PRIVATE_DATA_LEN],
}

impl Mra {
    fn parse(b: &[u8]) -> Mra {
        Mra {
            local_comm_id: rd32(b, 0),
            remote_comm_id: rd32(b, 4),
            message_mraed: rdbits(b, 8, 6, 2),
            service_timeout: rdbits(b, 9, 3, 5),
            private_data: arr(b, 10),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        wr32(b, 0, self.local_comm_id);
        wr32(b, 4, self.remote_comm_id);
        wrbits(b, 8, 6, 2, self.message_mraed);
        wrbits(b, 9, 3, 5, self.service_timeout);
        b[10..].copy_from_slice(&self.private_data);
    }
}

/// Reject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rej {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    /// 2 bits ([`msg_ref`]).
    pub message_rejected: u8,
    /// 7 bits: how many ARI bytes are meaningful.
    pub rejected_info_length: u8,
    /// [`rej_reason`].
    pub reason: u16,
    /// Additional rejection information.
    pub ari: [u8; REJ_ARI_LEN],
    pub private_data: [u8; REJ_PRIVATE_DATA_LEN],
}

impl Rej {
    fn parse(b: &[u8]) -> Rej {
        Rej {
            local_comm_id: rd32(b, 0),
            remote_comm_id: rd32(b, 4),
            message_rejected: rdbits(b, 8, 6, 2),
            rejected_info_length: rdbits(b, 9, 1, 7),
            reason: rd16(b, 10),
            ari: arr(b, 12),
            private_data: arr(b, 84),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        wr32(b, 0, self.local_comm_id);
        wr32(b, 4, self.remote_comm_id);
        wrbits(b, 8, 6, 2, self.message_rejected);
        wrbits(b, 9, 1, 7, self.rejected_info_length);
        wr16(b, 10, self.reason);
        b[12..84].copy_from_slice(&self.ari);
        b[84..].copy_from_slice(&self.private_data);
    }
}

/// Reply to a REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rep {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub local_qkey: u32,
    /// 24 bits.
    pub local_qpn: u32,
    /// 24 bits.
    pub local_eecn: u32,
    /// 24 bits. The PSN the active side's requests start with (the passive side's
    /// expected PSN), as Linux and the kernel captures have it.
    pub starting_psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    /// 5 bits.
    pub target_ack_delay: u8,
    /// 2 bits.
    pub failover_accepted: u8,
    pub end_to_end_flow_control: bool,
    /// 3 bits.
    pub rnr_retry_count: u8,
    pub srq: bool,
    pub local_ca_guid: u64,
    pub private_data: [u8; REP_PRIVATE_DATA_LEN],
}

impl Rep {
    fn parse(b: &[u8]) -> Rep {
        Rep {
            local_comm_id: rd32(b, 0),
            remote_comm_id: rd32(b, 4),
            local_qkey: rd32(b, 8),
            local_qpn: rd24(b, 12),
            local_eecn: rd24(b, 16),
            starting_psn: rd24(b, 20),
            responder_resources: b[24],
            initiator_depth: b[25],
            target_ack_delay: rdbits(b, 26, 3, 5),
            failover_accepted: rdbits(b, 26, 1, 2),
            end_to_end_flow_control: rdbits(b, 26, 0, 1) != 0,
            rnr_retry_count: rdbits(b, 27, 5, 3),
            srq: rdbits(b, 27, 4, 1) != 0,
            local_ca_guid: rd64(b, 28),
            private_data: arr(b, 36),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        wr32(b, 0, self.local_comm_id);
        wr32(b, 4, self.remote_comm_id);
        wr32(b, 8, self.local_qkey);
        wr24(b, 12, self.local_qpn);
        wr24(b, 16, self.local_eecn);
        wr24(b, 20, self.starting_psn);
        b[24] = self.responder_resources;
        b[25] = self.initiator_depth;
        wrbits(b, 26, 3, 5, self.target_ack_delay);
        wrbits(b, 26, 1, 2, self.failover_accepted);
        wrbits(b, 26, 0, 1, self.end_to_end_flow_control as u8);
        wrbits(b, 27, 5, 3, self.rnr_retry_count);
        wrbits(b, 27, 4, 1, self.srq as u8);
        wr64(b, 28, self.local_ca_guid);
        b[36..].copy_from_slice(&self.private_data);
    }
}

/// Ready to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rtu {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub private_data: [u8; RTU_PRIVATE_DATA_LEN],
}

/// Disconnect request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dreq {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    /// The receiver's QPN (24 bits).
    pub remote_qpn: u32,
    pub private_data: [u8; DREQ_PRIVATE_DATA_LEN],
}

/// Disconnect reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Drep {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub private_data: [u8; DREP_PRIVATE_DATA_LEN],
}

/// Service ID Resolution Request (IBTA 12.11): which UD QP serves a service ID? The
/// UD "connection" of rdma_cm's UDP port space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SidrReq {
    /// The requester's ID for this resolution (echoed in the reply).
    pub request_id: u32,
    pub pkey: u16,
    pub service_id: u64,
    pub private_data: [u8; SIDR_REQ_PRIVATE_DATA_LEN],
}

impl SidrReq {
    fn parse(b: &[u8]) -> SidrReq {
        SidrReq {
            request_id: rd32(b, 0),
            pkey: rd16(b, 4),
            service_id: rd64(b, 8),
            private_data: arr(b, 16),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        wr32(b, 0, self.request_id);
        wr16(b, 4, self.pkey);
        wr64(b, 8, self.service_id);
        b[16..].copy_from_slice(&self.private_data);
    }

    /// The rdma_cm header rdma_cm puts at the start of the private data.
    pub fn cma_header(&self) -> Result<CmaHdr> {
        CmaHdr::parse(&self.private_data)
    }
}

/// Service ID Resolution Response: the QP and Q_Key that serve the service, or why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SidrRep {
    /// The requester's ID from the SIDR_REQ.
    pub request_id: u32,
    /// [`sidr_status`].
    pub status: u8,
    pub additional_info_length: u8,
    /// 24 bits.
    pub qpn: u32,
    pub service_id: u64,
    pub qkey: u32,
    pub additional_info: [u8; SIDR_REP_INFO_LEN],
    pub private_data: [u8; SIDR_REP_PRIVATE_DATA_LEN],
}

impl SidrRep {
    fn parse(b: &[u8]) -> SidrRep {
        SidrRep {
            request_id: rd32(b, 0),
            status: b[4],
            additional_info_length: b[5],
            qpn: rd24(b, 8),
            service_id: rd64(b, 12),
            qkey: rd32(b, 20),
            additional_info: arr(b, 24),
            private_data: arr(b, 96),
        }
    }

    fn emit(&self, b: &mut [u8]) {
        wr32(b, 0, self.request_id);
        b[4] = self.status;
        b[5] = self.additional_info_length;
        wr24(b, 8, self.qpn);
        wr64(b, 12, self.service_id);
        wr32(b, 20, self.qkey);
        b[24..96].copy_from_slice(&self.additional_info);
        b[96..].copy_from_slice(&self.private_data);
    }
}

/// One CM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmMessage {
    Req(Req),
    Mra(Mra),
    Rej(Rej),
    Rep(Rep),
    Rtu(Rtu),
    Dreq(Dreq),
    Drep(Drep),
    SidrReq(SidrReq),
    SidrRep(SidrRep),
}

impl CmMessage {
    /// The MAD attribute ID of this message.
    pub fn attribute_id(&self) -> u16 {
        match self {
            CmMessage::Req(_) => ATTR_REQ,
            CmMessage::Mra(_) => ATTR_MRA,
            CmMessage::Rej(_) => ATTR_REJ,
            CmMessage::Rep(_) => ATTR_REP,
            CmMessage::Rtu(_) => ATTR_RTU,
            CmMessage::Dreq(_) => ATTR_DREQ,
            CmMessage::Drep(_) => ATTR_DREP,
            CmMessage::SidrReq(_) => ATTR_SIDR_REQ,
            CmMessage::SidrRep(_) => ATTR_SIDR_REP,
        }
    }

    /// The sender's communication ID (every message has one; for the SIDR messages,
    /// the requester's request ID).
    pub fn local_comm_id(&self) -> u32 {
        match self {
            CmMessage::Req(m) => m.local_comm_id,
            CmMessage::Mra(m) => m.local_comm_id,
            CmMessage::Rej(m) => m.local_comm_id,
            CmMessage::Rep(m) => m.local_comm_id,
            CmMessage::Rtu(m) => m.local_comm_id,
            CmMessage::Dreq(m) => m.local_comm_id,
            CmMessage::Drep(m) => m.local_comm_id,
            CmMessage::SidrReq(m) => m.request_id,
            CmMessage::SidrRep(m) => m.request_id,
        }
    }

    /// Decode the 232 data bytes of a CM MAD with attribute `attr`.
    pub fn parse(attr: u16, data: &[u8]) -> Result<CmMessage> {
        need(DATA_LEN, data.len())?;
        let b = &data[..DATA_LEN];
        Ok(match attr {
            ATTR_REQ => CmMessage::Req(Req::parse(b)),
            ATTR_MRA => CmMessage::Mra(Mra::parse(b)),
            ATTR_REJ => CmMessage::Rej(Rej::parse(b)),
            ATTR_REP => CmMessage::Rep(Rep::parse(b)),
            ATTR_RTU => CmMessage::Rtu(Rtu {
                local_comm_id: rd32(b, 0),
                remote_comm_id: rd32(b, 4),
                private_data: arr(b, 8),
            }),
            ATTR_DREQ => CmMessage::Dreq(Dreq {
                local_comm_id: rd32(b, 0),
                remote_comm_id: rd32(b, 4),
                remote_qpn: rd24(b, 8),
                private_data: arr(b, 12),
            }),
            ATTR_DREP => CmMessage::Drep(Drep {
                local_comm_id: rd32(b, 0),
                remote_comm_id: rd32(b, 4),
                private_data: arr(b, 8),
            }),
            ATTR_SIDR_REQ => CmMessage::SidrReq(SidrReq::parse(b)),
            ATTR_SIDR_REP => CmMessage::SidrRep(SidrRep::parse(b)),
            other => return Err(Error::UnknownCmAttribute(other)),
        })
    }

    /// Write the 232 data bytes (all of them: reserved bits zero).
    pub fn emit(&self, data: &mut [u8]) -> Result<()> {
        need(DATA_LEN, data.len())?;
        let b = &mut data[..DATA_LEN];
        b.fill(0);
        match self {
            CmMessage::Req(m) => m.emit(b),
            CmMessage::Mra(m) => m.emit(b),
            CmMessage::Rej(m) => m.emit(b),
            CmMessage::Rep(m) => m.emit(b),
            CmMessage::Rtu(m) => {
                wr32(b, 0, m.local_comm_id);
                wr32(b, 4, m.remote_comm_id);
                b[8..].copy_from_slice(&m.private_data);
            }
            CmMessage::Dreq(m) => {
                wr32(b, 0, m.local_comm_id);
                wr32(b, 4, m.remote_comm_id);
                wr24(b, 8, m.remote_qpn);
                b[12..].copy_from_slice(&m.private_data);
            }
            CmMessage::Drep(m) => {
                wr32(b, 0, m.local_comm_id);
                wr32(b, 4, m.remote_comm_id);
                b[8..].copy_from_slice(&m.private_data);
            }
            CmMessage::SidrReq(m) => m.emit(b),
            CmMessage::SidrRep(m) => m.emit(b),
        }
        Ok(())
    }
}

/// A whole CM MAD: the common header fields that vary plus the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmMad {
    /// [`mad::method::SEND`] for every CM message.
    pub method: u8,
    pub status: u16,
    pub class_specific: u16,
    /// Kept across retries of the same message; rdma_cm puts its own counter in the low
    /// 32 bits.
    pub transaction_id: u64,
    pub attribute_modifier: u32,
    pub message: CmMessage,
}

impl CmMad {
    /// A CM MAD with method Send and zero status.
    pub fn new(transaction_id: u64, message: CmMessage) -> CmMad {
        CmMad {
            method: mad::method::SEND,
            status: 0,
            class_specific: 0,
            transaction_id,
            attribute_modifier: 0,
            message,
        }
    }

    /// Decode a 256-byte MAD (a UD SEND payload to QP1). Refuses other lengths, other
    /// base versions, other management classes and class versions, and CM attributes
    /// other than the seven above.
    pub fn parse(b: &[u8]) -> Result<CmMad> {
        need(MAD_LEN, b.len())?;
        if b.len() != MAD_LEN {
            return Err(Error::BadLength {
                expected: MAD_LEN,
                have: b.len(),
            });
        }
        let p = mad::Packet::new_checked(b)?;
        let h = mad::Repr::parse(&p)?;
        if h.mgmt_class != mad::MGMT_CLASS_CM || h.class_version != mad::CM_CLASS_VERSION {
            return Err(Error::NotCm {
                class: h.mgmt_class,
                version: h.class_version,
            });
        }
        Ok(CmMad {
            method: h.method,
            status: h.status,
            class_specific: h.class_specific,
            transaction_id: h.transaction_id,
            attribute_modifier: h.attribute_modifier,
            message: CmMessage::parse(h.attribute_id, p.data())?,
        })
    }

    /// The MAD header this message goes with.
    pub fn header(&self) -> mad::Repr {
        mad::Repr {
            mgmt_class: mad::MGMT_CLASS_CM,
            class_version: mad::CM_CLASS_VERSION,
            method: self.method,
            status: self.status,
            class_specific: self.class_specific,
            transaction_id: self.transaction_id,
            attribute_id: self.message.attribute_id(),
            attribute_modifier: self.attribute_modifier,
        }
    }

    /// Size of the MAD.
    pub const fn buffer_len(&self) -> usize {
        MAD_LEN
    }

    /// Write the 256-byte MAD to the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        need(MAD_LEN, buf.len())?;
        let mut p = mad::Packet::new_checked(&mut buf[..MAD_LEN])?;
        self.header().emit(&mut p);
        self.message.emit(p.data_mut())
    }

    /// The 256-byte MAD.
    pub fn to_bytes(&self) -> [u8; MAD_LEN] {
        let mut b = [0u8; MAD_LEN];
        // Cannot fail: the buffer is exactly MAD_LEN.
        let _ = self.emit(&mut b);
        b
    }
}

/// The RoCEv2 packet that carries a MAD between GSIs, as rxe sends it: UD SEND Only from
/// QP1 to QP1, AckReq set, Q_Key [`GSI_QKEY`](super::deth::GSI_QKEY). `psn` is the sending
/// QP1's next PSN (rxe starts at 0 and counts every MAD it sends).
pub fn gsi_packet(mad: &[u8], pkey: u16, psn: u32) -> super::roce::Repr<'_> {
    use super::{bth, deth, opcode::Opcode};
    let mut r = super::roce::Repr::new(
        bth::Repr {
            opcode: Opcode::UdSendOnly,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey,
            fecn: false,
            becn: false,
            dest_qp: deth::GSI_QPN,
            ack_req: true,
            psn: psn & bth::PSN_MASK,
        },
        mad,
    );
    r.deth = Some(deth::Repr {
        qkey: deth::GSI_QKEY,
        src_qp: deth::GSI_QPN,
    });
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::icrc::tests::{hex, CM_REQ_DATAGRAM};
    use proptest::prelude::*;

    fn bytes<const N: usize>() -> impl Strategy<Value = [u8; N]> {
        proptest::collection::vec(any::<u8>(), N).prop_map(|v| {
            let mut a = [0u8; N];
            a.copy_from_slice(&v);
            a
        })
    }

    fn any_path() -> impl Strategy<Value = CmPath> {
        (
            any::<(u16, u16)>(),
            bytes::<16>(),
            bytes::<16>(),
            0u32..=0xf_ffff,
            0u8..64,
            any::<(u8, u8)>(),
            0u8..16,
            any::<bool>(),
            0u8..32,
        )
            .prop_map(
                |((ll, rl), lg, rg, fl, rate, (tc, hl), sl, snl, to)| CmPath {
                    local_lid: ll,
                    remote_lid: rl,
                    local_gid: lg,
                    remote_gid: rg,
                    flow_label: fl,
                    packet_rate: rate,
                    traffic_class: tc,
                    hop_limit: hl,
                    sl,
                    subnet_local: snl,
                    local_ack_timeout: to,
                },
            )
    }

    const Q24: std::ops::RangeInclusive<u32> = 0..=0xff_ffff;

    fn any_req() -> impl Strategy<Value = Req> {
        (
            (
                any::<(u32, u64, u64, u32)>(),
                Q24,
                any::<u8>(),
                Q24,
                any::<u8>(),
                Q24,
            ),
            (
                0u8..32,
                0u8..4,
                any::<bool>(),
                Q24,
                0u8..32,
                0u8..8,
                any::<u16>(),
            ),
            (
                0u8..16,
                any::<bool>(),
                0u8..8,
                0u8..16,
                any::<bool>(),
                0u8..8,
            ),
            (
                any_path(),
                any_path(),
                any::<bool>(),
                bytes::<REQ_PRIVATE_DATA_LEN>(),
            ),
        )
            .prop_map(|(a, b, c, d)| Req {
                local_comm_id: a.0 .0,
                service_id: a.0 .1,
                local_ca_guid: a.0 .2,
                local_qkey: a.0 .3,
                local_qpn: a.1,
                responder_resources: a.2,
                local_eecn: a.3,
                initiator_depth: a.4,
                remote_eecn: a.5,
                remote_cm_response_timeout: b.0,
                transport_service_type: b.1,
                end_to_end_flow_control: b.2,
                starting_psn: b.3,
                local_cm_response_timeout: b.4,
                retry_count: b.5,
                pkey: b.6,
                path_mtu: c.0,
                rdc_exists: c.1,
                rnr_retry_count: c.2,
                max_cm_retries: c.3,
                srq: c.4,
                extended_transport_type: c.5,
                primary_path: d.0,
                alternate_path: d.1,
                sap_supported: d.2,
                private_data: d.3,
            })
    }

    fn any_rep() -> impl Strategy<Value = Rep> {
        (
            any::<(u32, u32, u32)>(),
            (Q24, Q24, Q24, any::<(u8, u8)>()),
            (
                0u8..32,
                0u8..4,
                any::<bool>(),
                0u8..8,
                any::<bool>(),
                any::<u64>(),
            ),
            bytes::<REP_PRIVATE_DATA_LEN>(),
        )
            .prop_map(|(a, b, c, pd)| Rep {
                local_comm_id: a.0,
                remote_comm_id: a.1,
                local_qkey: a.2,
                local_qpn: b.0,
                local_eecn: b.1,
                starting_psn: b.2,
                responder_resources: b.3 .0,
                initiator_depth: b.3 .1,
                target_ack_delay: c.0,
                failover_accepted: c.1,
                end_to_end_flow_control: c.2,
                rnr_retry_count: c.3,
                srq: c.4,
                local_ca_guid: c.5,
                private_data: pd,
            })
    }

    pub(crate) fn any_message() -> impl Strategy<Value = CmMessage> {
        prop_oneof![
            any_req().prop_map(CmMessage::Req),
            (
                any::<(u32, u32)>(),
                0u8..4,
                0u8..32,
                bytes::<MRA_PRIVATE_DATA_LEN>()
            )
                .prop_map(|((l, r), m, t, pd)| CmMessage::Mra(Mra {
                    local_comm_id: l,
                    remote_comm_id: r,
                    message_mraed: m,
                    service_timeout: t,
                    private_data: pd,
                })),
            (
                any::<(u32, u32, u16)>(),
                0u8..4,
                0u8..128,
                bytes::<REJ_ARI_LEN>(),
                bytes::<REJ_PRIVATE_DATA_LEN>()
            )
                .prop_map(|((l, r, reason), m, n, ari, pd)| CmMessage::Rej(Rej {
                    local_comm_id: l,
                    remote_comm_id: r,
                    message_rejected: m,
                    rejected_info_length: n,
                    reason,
                    ari,
                    private_data: pd,
                })),
            any_rep().prop_map(CmMessage::Rep),
            (any::<(u32, u32)>(), bytes::<RTU_PRIVATE_DATA_LEN>()).prop_map(|((l, r), pd)| {
                CmMessage::Rtu(Rtu {
                    local_comm_id: l,
                    remote_comm_id: r,
                    private_data: pd,
                })
            }),
            (any::<(u32, u32)>(), Q24, bytes::<DREQ_PRIVATE_DATA_LEN>()).prop_map(
                |((l, r), q, pd)| CmMessage::Dreq(Dreq {
                    local_comm_id: l,
                    remote_comm_id: r,
                    remote_qpn: q,
                    private_data: pd,
                })
            ),
            (any::<(u32, u32)>(), bytes::<DREP_PRIVATE_DATA_LEN>()).prop_map(|((l, r), pd)| {
                CmMessage::Drep(Drep {
                    local_comm_id: l,
                    remote_comm_id: r,
                    private_data: pd,
                })
            }),
            (
                any::<(u32, u16, u64)>(),
                bytes::<SIDR_REQ_PRIVATE_DATA_LEN>()
            )
                .prop_map(|((id, pkey, sid), pd)| CmMessage::SidrReq(SidrReq {
                    request_id: id,
                    pkey,
                    service_id: sid,
                    private_data: pd,
                })),
            (
                any::<(u32, u8, u8, u64, u32)>(),
                Q24,
                bytes::<SIDR_REP_INFO_LEN>(),
                bytes::<SIDR_REP_PRIVATE_DATA_LEN>()
            )
                .prop_map(|((id, st, n, sid, qkey), qpn, info, pd)| {
                    CmMessage::SidrRep(SidrRep {
                        request_id: id,
                        status: st,
                        additional_info_length: n,
                        qpn,
                        service_id: sid,
                        qkey,
                        additional_info: info,
                        private_data: pd,
                    })
                }),
        ]
    }

    fn any_mad() -> impl Strategy<Value = CmMad> {
        (any::<(u8, u16, u16, u64, u32)>(), any_message()).prop_map(
            |((method, status, cs, tid, modi), message)| CmMad {
                method,
                status,
                class_specific: cs,
                transaction_id: tid,
                attribute_modifier: modi,
                message,
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn round_trip(m in any_mad()) {
            let b = m.to_bytes();
            prop_assert_eq!(CmMad::parse(&b).unwrap(), m);
            prop_assert_eq!(rd16(&b, 16), m.message.attribute_id());
        }

        #[test]
        fn wrong_lengths_rejected(m in any_mad(), len in 0usize..300) {
            let b = m.to_bytes();
            let mut v = b.to_vec();
            v.resize(len, 0);
            let r = CmMad::parse(&v);
            if len < MAD_LEN {
                prop_assert_eq!(r, Err(Error::Truncated { need: MAD_LEN, have: len }));
            } else if len > MAD_LEN {
                prop_assert_eq!(r, Err(Error::BadLength { expected: MAD_LEN, have: len }));
            } else {
                prop_assert!(r.is_ok());
            }
        }

        #[test]
        fn random_bytes_never_panic(v in proptest::collection::vec(any::<u8>(), MAD_LEN), attr in 0x0010u16..0x0018) {
            let mut v = v;
            v[0] = 1;
            v[1] = mad::MGMT_CLASS_CM;
            v[2] = mad::CM_CLASS_VERSION;
            v[16..18].copy_from_slice(&attr.to_be_bytes());
            if let Ok(m) = CmMad::parse(&v) {
                // Re-emitting clears only reserved bits: the result parses the same.
                prop_assert_eq!(CmMad::parse(&m.to_bytes()).unwrap(), m);
            }
        }
    }

    #[test]
    fn field_boundaries() {
        // Every field at its maximum, then at zero: each must survive on its own.
        let mut req = Req::parse(&[0xffu8; DATA_LEN]);
        assert_eq!(req.local_qpn, 0xff_ffff);
        assert_eq!(req.primary_path.flow_label, 0xf_ffff);
        assert_eq!(req.primary_path.packet_rate, 63);
        assert_eq!(req.alternate_path.local_ack_timeout, 31);
        assert!(req.sap_supported);
        let m = CmMad::new(u64::MAX, CmMessage::Req(req));
        assert_eq!(CmMad::parse(&m.to_bytes()).unwrap(), m);
        req = Req::parse(&[0u8; DATA_LEN]);
        let m = CmMad::new(0, CmMessage::Req(req));
        assert_eq!(CmMad::parse(&m.to_bytes()).unwrap(), m);
        let all = CmMessage::parse(ATTR_REP, &[0xffu8; DATA_LEN]).unwrap();
        let CmMessage::Rep(rep) = all else { panic!() };
        assert_eq!(
            (
                rep.target_ack_delay,
                rep.failover_accepted,
                rep.rnr_retry_count
            ),
            (31, 3, 7)
        );
        assert_eq!(
            CmMessage::parse(0x0019, &[0u8; DATA_LEN]),
            Err(Error::UnknownCmAttribute(0x0019))
        );
        let mut v = m.to_bytes();
        v[1] = 0x03;
        assert_eq!(
            CmMad::parse(&v),
            Err(Error::NotCm {
                class: 3,
                version: 2
            })
        );
    }

    #[test]
    fn captured_rping_req() {
        // rping_rxe.pcap frame 19: the MAD starts after IP(20) + UDP(8) + BTH(12) + DETH(8).
        let d = hex(CM_REQ_DATAGRAM);
        let mad_bytes = &d[48..48 + MAD_LEN];
        let m = CmMad::parse(mad_bytes).unwrap();
        assert_eq!(m.transaction_id, 0x0000_0002_affc_d78b);
        let CmMessage::Req(r) = m.message else {
            panic!("not a REQ")
        };
        assert_eq!(r.local_comm_id, 0x8bd7_fcaf);
        assert_eq!(
            r.service_id, 0x0000_0000_0106_1c06,
            "RDMA_PS_TCP, port 7174"
        );
        assert_eq!(r.local_ca_guid, 0x5054_00ff_fe77_000c);
        assert_eq!((r.local_qpn, r.starting_psn), (0x11, 0x1ece27));
        assert_eq!((r.responder_resources, r.initiator_depth), (1, 1));
        assert_eq!(
            (r.remote_cm_response_timeout, r.local_cm_response_timeout),
            (20, 20)
        );
        assert_eq!(
            (r.retry_count, r.rnr_retry_count, r.max_cm_retries),
            (7, 7, 15)
        );
        assert_eq!(
            (r.pkey, r.path_mtu, mtu_bytes(r.path_mtu)),
            (0xffff, 3, Some(1024))
        );
        assert_eq!(r.transport_service_type, transport_type::RC);
        let p = r.primary_path;
        assert_eq!((p.local_lid, p.remote_lid), (0xffff, 0xffff));
        assert_eq!(&p.local_gid[10..], &[0xff, 0xff, 10, 77, 0, 12]);
        assert_eq!(&p.remote_gid[10..], &[0xff, 0xff, 10, 77, 0, 11]);
        assert_eq!((p.flow_label, p.packet_rate), (0xfd227, 0));
        assert_eq!((p.traffic_class, p.hop_limit, p.sl), (0, 64, 0));
        assert_eq!(p.local_ack_timeout, 19);
        assert_eq!(r.alternate_path, CmPath::default());
        let h = r.cma_header().unwrap();
        assert_eq!(h.src_port, 0x81bf);
        assert_eq!(h.src, std::net::IpAddr::from([10, 77, 0, 12]));
        assert_eq!(h.dst, std::net::IpAddr::from([10, 77, 0, 11]));
        assert_eq!(&m.to_bytes()[..], mad_bytes, "byte-exact re-emission");
        // The whole UDP payload, rebuilt around the MAD, ICRC filled over the real headers.
        let bytes = m.to_bytes();
        let mut udp = d[20..28].to_vec();
        udp.extend_from_slice(&gsi_packet(&bytes, 0xffff, 0).to_vec().unwrap());
        crate::wire::icrc::fill_ipv4(&d[..20], &mut udp).unwrap();
        assert_eq!(&udp[..], &d[20..]);
    }
}
