//! `#[repr(C)]` mirrors of the structures of `include/it_api.h` that libitapi reads or
//! writes, with the header's member names (in Rust case). Enums travel as `u32`,
//! `it_boolean_t` as `u32`, handles as `*mut c_void`. `tests/tests/itapi_c_abi.rs`
//! compares every size and offset here with what the C compiler makes of the header.
//!
//! Over 600 lines: one `#[repr(C)]` mirror per structure of `it_api.h`, kept together as
//! the header keeps them.

use bytemuck::Zeroable;
use std::ffi::{c_char, c_void};

pub type Handle = *mut c_void;
pub type ItStatus = u32;
pub type ItBool = u32;

pub const IT_SUCCESS: ItStatus = 0;
pub const IT_TRUE: ItBool = 1;
pub const IT_FALSE: ItBool = 0;
pub const IT_MAX_PRIV_DATA: usize = 256;
pub const IT_INTERFACE_NAME_SIZE: usize = 64;
pub const IT_TIMEOUT_INFINITE: u64 = u64::MAX;

/// `struct in_addr`: four bytes in network order.
#[repr(C, align(4))]
#[derive(Clone, Copy, Zeroable)]
pub struct InAddr(pub [u8; 4]);

/// `struct in6_addr` (and `it_ib_gid_t`).
#[repr(C, align(4))]
#[derive(Clone, Copy, Zeroable)]
pub struct In6Addr(pub [u8; 16]);

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct ViaNetAddr {
    pub len: u16,
    pub hostaddr: [u8; 64],
}

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub union NetAddrUnion {
    pub ipv4: InAddr,
    pub ipv6: In6Addr,
    pub gid: In6Addr,
    pub via: ViaNetAddr,
}

/// `it_net_addr_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct NetAddr {
    pub addr_type: u32,
    pub addr: NetAddrUnion,
}

pub const IT_IPV4: u32 = 1;
pub const IT_IPV6: u32 = 2;
pub const IT_IB_GID: u32 = 3;

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct LrPort {
    pub local: u16,
    pub remote: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub union ConnQualUnion {
    pub port: u16,
    pub serviceid: u64,
    pub discriminator: ViaNetAddr,
    pub lr_port: LrPort,
}

/// `it_conn_qual_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct ConnQual {
    pub type_: u32,
    pub conn_qual: ConnQualUnion,
}

pub const IT_IANA_PORT: u32 = 0x01;
pub const IT_IB_SERVICEID: u32 = 0x02;
pub const IT_IANA_LR_PORT: u32 = 0x08;

/// `it_ib_net_endpoint_t` (bit-fields are plain integers in krdma's header).
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct IbNetEndpoint {
    pub partition_key: u16,
    pub path_mtu: u8,
    pub packet_lifetime: u8,
    pub local_port_lid: u16,
    pub remote_port_lid: u16,
    pub local_port_gid: In6Addr,
    pub remote_port_gid: In6Addr,
    pub packet_rate: u8,
    pub sl: u8,
    pub subnet_local: u8,
    pub flow_label: u32,
    pub traffic_class: u8,
    pub hop_limit: u8,
}

/// `it_in_addr_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub union InAddrUnion {
    pub ipv4: InAddr,
    pub ipv6: In6Addr,
}

/// `it_iwarp_net_endpoint_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct IwarpNetEndpoint {
    pub ip_vers: u32,
    pub laddr: InAddrUnion,
    pub raddr: InAddrUnion,
}

pub const IT_IP_VERS_IPV4: u32 = 1;
pub const IT_IP_VERS_IPV6: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub union PathUnion {
    pub ib: IbNetEndpoint,
    pub via: ViaNetAddr,
    pub iwarp: IwarpNetEndpoint,
}

/// `it_path_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct Path {
    pub spigot_id: usize,
    pub timeout: u64,
    pub u: PathUnion,
}

/// `it_lmr_triplet_t` (the address union is a pointer-sized value).
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct LmrTriplet {
    pub lmr: Handle,
    pub addr: u64,
    pub length: u64,
}

/// `it_interface_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct Interface {
    pub major_version: u32,
    pub minor_version: u32,
    pub transport_type: u32,
    pub name: [c_char; IT_INTERFACE_NAME_SIZE],
}

/// `it_spigot_info_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct SpigotInfo {
    pub spigot_id: usize,
    pub max_rc_send_len: usize,
    pub max_rc_rdma_len: usize,
    pub max_ud_send_len: usize,
    pub spigot_online: ItBool,
    pub active_side_conn_qual: u32,
    pub passive_side_conn_qual: u32,
    pub num_net_addr: usize,
    pub net_addr: *mut NetAddr,
}

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct VendorIb {
    pub vendor: u32,
    pub device: u16,
    pub revision: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct VendorIwarp {
    pub valid_vid: ItBool,
    pub vid: [u8; 64],
}

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub union Vendor {
    pub ib: VendorIb,
    /// `it_vendor_via_t`: 64 name bytes and two `unsigned long`s (not filled).
    pub via: [u64; 10],
    pub iwarp: VendorIwarp,
}

/// `it_ia_info_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct IaInfo {
    pub ia_name: *mut c_char,
    pub api_major_version: u32,
    pub api_minor_version: u32,
    pub sw_major_version: u32,
    pub sw_minor_version: u32,
    pub vendor: Vendor,
    pub dto_alignment_hint: u32,
    pub transport_type: u32,
    pub supported_service_types: u32,
    pub ep_work_queues_resizable: ItBool,
    pub three_way_handshake_support: ItBool,
    pub private_data_support: ItBool,
    pub max_message_size_support: ItBool,
    pub ird_ord_ia_support: ItBool,
    pub ird_ord_suppressible: ItBool,
    pub spigot_online_support: ItBool,
    pub spigot_offline_support: ItBool,
    pub connect_private_data_len: usize,
    pub accept_private_data_len: usize,
    pub reject_private_data_len: usize,
    pub disconnect_private_data_len: usize,
    pub ud_req_private_data_len: usize,
    pub ud_rep_private_data_len: usize,
    pub num_spigots: usize,
    pub spigot_info: *mut SpigotInfo,
    pub affiliated_err_evd: Handle,
    pub unaffiliated_err_evd: Handle,
    pub srq_support: ItBool,
    pub hard_hi_watermark_support: ItBool,
    pub soft_hi_watermark_support: ItBool,
    pub srq_resizable: ItBool,
    pub extended_iwarp_qp_states: ItBool,
    pub socket_conversion_support: ItBool,
    pub rdma_read_ord_increasable: ItBool,
    pub rdma_read_ird_modifiable: ItBool,
    pub rmr_types_supported: u32,
    pub addr_mode_relative_support: ItBool,
    pub rdma_read_requires_remote_write: ItBool,
    pub ep_rdma_enables_modifiable: ItBool,
    pub rdma_read_local_extensions: ItBool,
    pub dto_evd_overflow_detection: ItBool,
    pub atomic_support: ItBool,
    pub lmr_link_support: ItBool,
    pub direct_lmr_handle_support: ItBool,
    pub direct_lmr_handle: Handle,
    pub post_send_unlink_remote_support: ItBool,
    pub narrow_rmr_unlink_support: ItBool,
    pub wide_rmr_unlink_support: ItBool,
    pub unlink_fence_support: ItBool,
    pub iobl_types_supported: u32,
}

/// `it_rc_only_attributes_t` (the larger member of `it_service_attributes_t`).
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct RcOnlyAttributes {
    pub rdma_read_enable: ItBool,
    pub rdma_write_enable: ItBool,
    pub max_rdma_read_segments: usize,
    pub max_rdma_write_segments: usize,
    pub rdma_read_ird: u32,
    pub rdma_read_ord: u32,
    pub srq: Handle,
    pub soft_hi_watermark: usize,
    pub hard_hi_watermark: usize,
    pub atomics_enable: ItBool,
}

/// `it_ep_attributes_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct EpAttributes {
    pub max_dto_payload_size: usize,
    pub max_request_dtos: usize,
    pub max_recv_dtos: usize,
    pub max_send_segments: usize,
    pub max_recv_segments: usize,
    pub rc: RcOnlyAttributes,
    pub priv_ops_enable: ItBool,
}

/// `it_ep_param_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct EpParam {
    pub ia: Handle,
    pub spigot_id: usize,
    pub ep_state: u32,
    pub service_type: u32,
    pub dst_path: Path,
    pub pz: Handle,
    pub request_sevd: Handle,
    pub recv_sevd: Handle,
    pub connect_sevd: Handle,
    pub attr: EpAttributes,
}

/// `it_evd_param_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct EvdParam {
    pub ia: Handle,
    pub event_number: u32,
    pub evd_flag: u32,
    pub sevd_queue_size: usize,
    pub sevd_threshold: usize,
    pub aevd: Handle,
    pub fd: i32,
    pub evd_bound: ItBool,
    pub evd_enabled: ItBool,
    pub evd_overflowed: ItBool,
    pub evd_callback: ItBool,
}

/// `it_listen_param_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct ListenParam {
    pub ia_handle: Handle,
    pub spigot_id: usize,
    pub connect_evd: Handle,
    pub connect_qual: ConnQual,
}

/// `it_lmr_param_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct LmrParam {
    pub ia: Handle,
    pub pz: Handle,
    pub addr: *mut c_void,
    pub length: u64,
    pub privs: u32,
    pub flags: u32,
    pub shared_id: u32,
    pub rmr_context: u64,
    pub actual_addr: *mut c_void,
    pub actual_length: u64,
    pub addr_mode: u32,
    pub linked: ItBool,
    pub iobl_num_elts: usize,
    pub iobl_type: u32,
}

/// `it_pz_param_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct PzParam {
    pub ia: Handle,
}

/// `it_rmr_param_t` (`bound` under the v1.0 bindings, `linked` otherwise).
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct RmrParam {
    pub ia: Handle,
    pub pz: Handle,
    pub linked: ItBool,
    pub lmr: Handle,
    pub addr: *mut c_void,
    pub length: u64,
    pub privs: u32,
    pub rmr_context: u64,
    pub type_: u32,
    pub addr_mode: u32,
}

/// `it_srq_param_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct SrqParam {
    pub ia: Handle,
    pub pz: Handle,
    pub max_recv_dtos: usize,
    pub max_recv_segs: usize,
    pub low_watermark: usize,
}

// ------------------------------------------------------------------------ events

#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct AnyEvent {
    pub event_number: u32,
    pub evd: Handle,
}

/// `it_dto_cmpl_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct DtoCmplEvent {
    pub event_number: u32,
    pub evd: Handle,
    pub ep: Handle,
    pub cookie: u64,
    pub dto_status: u32,
    pub transferred_length: u32,
    pub unlinked_mr_handle: Handle,
}

/// `it_conn_request_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct ConnRequestEvent {
    pub event_number: u32,
    pub evd: Handle,
    pub cn_est_id: u64,
    pub conn_qual: ConnQual,
    pub source_addr: NetAddr,
    pub spigot_id: usize,
    pub max_message_size: u32,
    pub rdma_read_ird: u32,
    pub rdma_read_ord: u32,
    pub private_data: [u8; IT_MAX_PRIV_DATA],
    pub private_data_present: ItBool,
}

/// `it_connection_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct ConnectionEvent {
    pub event_number: u32,
    pub evd: Handle,
    pub cn_est_id: u64,
    pub ep: Handle,
    pub rdma_read_ird: u32,
    pub rdma_read_ord: u32,
    pub dst_path: Path,
    pub reject_reason_code: u32,
    pub private_data: [u8; IT_MAX_PRIV_DATA],
    pub private_data_present: ItBool,
}

/// `it_affiliated_event_t` (the cause union is one handle).
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct AffiliatedEvent {
    pub event_number: u32,
    pub evd: Handle,
    pub cause: Handle,
}

/// `it_unaffiliated_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct UnaffiliatedEvent {
    pub event_number: u32,
    pub evd: Handle,
    pub ia: Handle,
    pub spigot_id: usize,
}

/// `it_software_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct SoftwareEvent {
    pub event_number: u32,
    pub evd: Handle,
    pub data: *mut c_void,
}

/// `it_aevd_notification_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct AevdNotificationEvent {
    pub event_number: u32,
    pub aevd: Handle,
    pub sevd: Handle,
}

/// Bytes of `it_event_t` (its largest member is `it_conn_request_event_t`).
pub const EVENT_SIZE: usize = 456;

/// `it_event_t`
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub union ItEvent {
    pub event_number: u32,
    pub any: AnyEvent,
    pub dto_cmpl: DtoCmplEvent,
    pub conn_req: ConnRequestEvent,
    pub conn: ConnectionEvent,
    pub aff_async: AffiliatedEvent,
    pub unaff_async: UnaffiliatedEvent,
    pub sw: SoftwareEvent,
    pub aevd_notify: AevdNotificationEvent,
    size: [u64; EVENT_SIZE / 8],
}

/// Sizes and member offsets, for the layout test against the C compiler: one line per
/// structure (`name size`) or member (`name.member offset`).
pub fn layout() -> Vec<(String, usize)> {
    use std::mem::{offset_of, size_of};
    let mut v: Vec<(String, usize)> = Vec::new();
    macro_rules! size {
        ($($c:literal = $t:ty),* $(,)?) => { $(v.push(($c.into(), size_of::<$t>()));)* };
    }
    macro_rules! off {
        ($c:literal, $t:ty, $($m:ident = $f:ident),* $(,)?) => {
            $(v.push((format!("{}.{}", $c, stringify!($m)), offset_of!($t, $f)));)*
        };
    }
    size!(
        "it_event_t" = ItEvent,
        "it_dto_cmpl_event_t" = DtoCmplEvent,
        "it_conn_request_event_t" = ConnRequestEvent,
        "it_connection_event_t" = ConnectionEvent,
        "it_affiliated_event_t" = AffiliatedEvent,
        "it_unaffiliated_event_t" = UnaffiliatedEvent,
        "it_software_event_t" = SoftwareEvent,
        "it_aevd_notification_event_t" = AevdNotificationEvent,
        "it_path_t" = Path,
        "it_conn_qual_t" = ConnQual,
        "it_net_addr_t" = NetAddr,
        "it_ia_info_t" = IaInfo,
        "it_spigot_info_t" = SpigotInfo,
        "it_interface_t" = Interface,
        "it_ep_attributes_t" = EpAttributes,
        "it_ep_param_t" = EpParam,
        "it_evd_param_t" = EvdParam,
        "it_listen_param_t" = ListenParam,
        "it_lmr_param_t" = LmrParam,
        "it_pz_param_t" = PzParam,
        "it_rmr_param_t" = RmrParam,
        "it_srq_param_t" = SrqParam,
        "it_lmr_triplet_t" = LmrTriplet,
    );
    off!(
        "it_dto_cmpl_event_t",
        DtoCmplEvent,
        evd = evd,
        ep = ep,
        cookie = cookie,
        dto_status = dto_status,
        transferred_length = transferred_length
    );
    off!(
        "it_conn_request_event_t",
        ConnRequestEvent,
        cn_est_id = cn_est_id,
        conn_qual = conn_qual,
        source_addr = source_addr,
        spigot_id = spigot_id,
        rdma_read_ird = rdma_read_ird,
        private_data = private_data,
        private_data_present = private_data_present
    );
    off!(
        "it_connection_event_t",
        ConnectionEvent,
        cn_est_id = cn_est_id,
        ep = ep,
        rdma_read_ird = rdma_read_ird,
        dst_path = dst_path,
        reject_reason_code = reject_reason_code,
        private_data = private_data,
        private_data_present = private_data_present
    );
    off!("it_affiliated_event_t", AffiliatedEvent, cause = cause);
    off!(
        "it_unaffiliated_event_t",
        UnaffiliatedEvent,
        ia = ia,
        spigot_id = spigot_id
    );
    off!("it_path_t", Path, timeout = timeout, u = u);
    off!(
        "it_iwarp_net_endpoint_t",
        IwarpNetEndpoint,
        laddr = laddr,
        raddr = raddr
    );
    off!(
        "it_ib_net_endpoint_t",
        IbNetEndpoint,
        remote_port_gid = remote_port_gid,
        flow_label = flow_label,
        hop_limit = hop_limit
    );
    off!(
        "it_ia_info_t",
        IaInfo,
        vendor = vendor,
        dto_alignment_hint = dto_alignment_hint,
        transport_type = transport_type,
        connect_private_data_len = connect_private_data_len,
        num_spigots = num_spigots,
        spigot_info = spigot_info,
        affiliated_err_evd = affiliated_err_evd,
        srq_support = srq_support,
        rmr_types_supported = rmr_types_supported,
        atomic_support = atomic_support,
        direct_lmr_handle = direct_lmr_handle,
        iobl_types_supported = iobl_types_supported
    );
    off!(
        "it_spigot_info_t",
        SpigotInfo,
        spigot_online = spigot_online,
        num_net_addr = num_net_addr,
        net_addr = net_addr
    );
    off!(
        "it_interface_t",
        Interface,
        transport_type = transport_type,
        name = name
    );
    off!(
        "it_ep_attributes_t",
        EpAttributes,
        max_recv_segments = max_recv_segments,
        srv = rc,
        priv_ops_enable = priv_ops_enable
    );
    off!(
        "it_rc_only_attributes_t",
        RcOnlyAttributes,
        max_rdma_read_segments = max_rdma_read_segments,
        rdma_read_ird = rdma_read_ird,
        rdma_read_ord = rdma_read_ord,
        srq = srq,
        atomics_enable = atomics_enable
    );
    off!(
        "it_ep_param_t",
        EpParam,
        ep_state = ep_state,
        dst_path = dst_path,
        pz = pz,
        connect_sevd = connect_sevd,
        attr = attr
    );
    off!(
        "it_evd_param_t",
        EvdParam,
        event_number = event_number,
        sevd_queue_size = sevd_queue_size,
        aevd = aevd,
        fd = fd,
        evd_callback = evd_callback
    );
    off!(
        "it_listen_param_t",
        ListenParam,
        connect_evd = connect_evd,
        connect_qual = connect_qual
    );
    off!(
        "it_lmr_param_t",
        LmrParam,
        length = length,
        privs = privs,
        rmr_context = rmr_context,
        actual_length = actual_length,
        iobl_type = iobl_type
    );
    off!(
        "it_rmr_param_t",
        RmrParam,
        lmr = lmr,
        privs = privs,
        rmr_context = rmr_context,
        addr_mode = addr_mode
    );
    off!("it_srq_param_t", SrqParam, low_watermark = low_watermark);
    off!("it_lmr_triplet_t", LmrTriplet, addr = addr, length = length);
    off!("it_conn_qual_t", ConnQual, conn_qual = conn_qual);
    off!("it_net_addr_t", NetAddr, addr = addr);
    v
}

/// `it_remote_ep_info_t` (passed by value to `it_ud_service_reply`).
#[repr(C)]
#[derive(Clone, Copy, Zeroable)]
pub struct RemoteEpInfo {
    pub ud_ep_id: u32,
    pub ud_ep_key: u32,
}
