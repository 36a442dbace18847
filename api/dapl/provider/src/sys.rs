//! The C types of DAT 2.0 that cross the boundary with libdat2 and its consumers, laid
//! out as Debian's `<dat2/udat.h>` lays them out on LP64 (a test compiles the header
//! and compares every size and offset listed in [`layout`]).

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};

pub type DAT_RETURN = u32;
pub type DAT_HANDLE = *mut c_void;
pub type DAT_COUNT = c_int;
pub type DAT_BOOLEAN = u32;
pub type DAT_TIMEOUT = u32;
pub type DAT_VLEN = u64;
pub type DAT_VADDR = u64;
/// `DAT_CONTEXT`, `DAT_DTO_COOKIE`, `DAT_RMR_COOKIE`: an 8-byte union passed by value.
pub type DAT_CONTEXT = u64;
pub type SockAddr = *mut libc::sockaddr;

pub const DAT_SUCCESS: DAT_RETURN = 0;
pub const DAT_TRUE: DAT_BOOLEAN = 1;
pub const DAT_FALSE: DAT_BOOLEAN = 0;
pub const DAT_TIMEOUT_INFINITE: DAT_TIMEOUT = u32::MAX;
pub const DAT_NAME_MAX_LENGTH: usize = 256;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_NAMED_ATTR {
    pub name: *const c_char,
    pub value: *const c_char,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct DAT_LMR_TRIPLET {
    pub virtual_address: u64,
    pub segment_length: u32,
    pub lmr_context: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct DAT_RMR_TRIPLET {
    pub virtual_address: u64,
    pub segment_length: u32,
    pub rmr_context: u32,
}

#[repr(C)]
pub struct DAT_PROVIDER_INFO {
    pub ia_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub dapl_version_major: u32,
    pub dapl_version_minor: u32,
    pub is_thread_safe: DAT_BOOLEAN,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_EP_ATTR {
    pub service_type: u32,
    pub max_message_size: u32,
    pub max_rdma_size: u32,
    pub qos: u32,
    pub recv_completion_flags: u32,
    pub request_completion_flags: u32,
    pub max_recv_dtos: DAT_COUNT,
    pub max_request_dtos: DAT_COUNT,
    pub max_recv_iov: DAT_COUNT,
    pub max_request_iov: DAT_COUNT,
    pub max_rdma_read_in: DAT_COUNT,
    pub max_rdma_read_out: DAT_COUNT,
    pub srq_soft_hw: DAT_COUNT,
    pub max_rdma_read_iov: DAT_COUNT,
    pub max_rdma_write_iov: DAT_COUNT,
    pub ep_transport_specific_count: DAT_COUNT,
    pub ep_transport_specific: *mut DAT_NAMED_ATTR,
    pub ep_provider_specific_count: DAT_COUNT,
    pub ep_provider_specific: *mut DAT_NAMED_ATTR,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_COMM {
    pub domain: c_int,
    pub type_: c_int,
    pub protocol: c_int,
}

#[repr(C)]
pub struct DAT_EP_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub ep_state: u32,
    pub comm: DAT_COMM,
    pub local_ia_address_ptr: SockAddr,
    pub local_port_qual: u64,
    pub remote_ia_address_ptr: SockAddr,
    pub remote_port_qual: u64,
    pub pz_handle: DAT_HANDLE,
    pub recv_evd_handle: DAT_HANDLE,
    pub request_evd_handle: DAT_HANDLE,
    pub connect_evd_handle: DAT_HANDLE,
    pub srq_handle: DAT_HANDLE,
    pub ep_attr: DAT_EP_ATTR,
}

#[repr(C)]
pub struct DAT_EVD_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub evd_qlen: DAT_COUNT,
    pub evd_state: u32,
    pub cno_handle: DAT_HANDLE,
    pub evd_flags: u32,
}

/// `DAT_REGION_DESCRIPTION`: for virtual memory its first word is the address.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_REGION_DESCRIPTION {
    pub for_va: *mut c_void,
    pub shared_memory_id: *mut c_void,
}

#[repr(C)]
pub struct DAT_LMR_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub mem_type: u32,
    pub region_desc: DAT_REGION_DESCRIPTION,
    pub length: DAT_VLEN,
    pub pz_handle: DAT_HANDLE,
    pub mem_priv: u32,
    pub va_type: u32,
    pub lmr_context: u32,
    pub rmr_context: u32,
    pub registered_size: DAT_VLEN,
    pub registered_address: DAT_VADDR,
}

#[repr(C)]
pub struct DAT_RMR_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub pz_handle: DAT_HANDLE,
    pub lmr_triplet: DAT_LMR_TRIPLET,
    pub mem_priv: u32,
    pub rmr_context: u32,
    pub rmr_scope: u32,
    pub va_type: u32,
}

#[repr(C)]
pub struct DAT_PSP_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub conn_qual: u64,
    pub evd_handle: DAT_HANDLE,
    pub psp_flags: u32,
}

#[repr(C)]
pub struct DAT_RSP_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub conn_qual: u64,
    pub evd_handle: DAT_HANDLE,
    pub ep_handle: DAT_HANDLE,
}

#[repr(C)]
pub struct DAT_CR_PARAM {
    pub remote_ia_address_ptr: SockAddr,
    pub remote_port_qual: u64,
    pub private_data_size: DAT_COUNT,
    pub private_data: *mut c_void,
    pub local_ep_handle: DAT_HANDLE,
}

#[repr(C)]
pub struct DAT_PZ_PARAM {
    pub ia_handle: DAT_HANDLE,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_OS_WAIT_PROXY_AGENT {
    pub instance_data: *mut c_void,
    pub proxy_agent_func: Option<unsafe extern "C" fn(*mut c_void, DAT_HANDLE)>,
}

#[repr(C)]
pub struct DAT_CNO_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub proxy_type: u32,
    /// The union of agent / fd / none; an fd is its first 4 bytes.
    pub proxy: DAT_OS_WAIT_PROXY_AGENT,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_SRQ_ATTR {
    pub max_recv_dtos: DAT_COUNT,
    pub max_recv_iov: DAT_COUNT,
    pub low_watermark: DAT_COUNT,
}

#[repr(C)]
pub struct DAT_SRQ_PARAM {
    pub ia_handle: DAT_HANDLE,
    pub srq_state: u32,
    pub pz_handle: DAT_HANDLE,
    pub max_recv_dtos: DAT_COUNT,
    pub max_recv_iov: DAT_COUNT,
    pub low_watermark: DAT_COUNT,
    pub available_dto_count: DAT_COUNT,
    pub outstanding_dto_count: DAT_COUNT,
}

#[repr(C)]
pub struct DAT_IA_ATTR {
    pub adapter_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub vendor_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub hardware_version_major: u32,
    pub hardware_version_minor: u32,
    pub firmware_version_major: u32,
    pub firmware_version_minor: u32,
    pub ia_address_ptr: SockAddr,
    pub max_eps: DAT_COUNT,
    pub max_dto_per_ep: DAT_COUNT,
    pub max_rdma_read_per_ep_in: DAT_COUNT,
    pub max_rdma_read_per_ep_out: DAT_COUNT,
    pub max_evds: DAT_COUNT,
    pub max_evd_qlen: DAT_COUNT,
    pub max_iov_segments_per_dto: DAT_COUNT,
    pub max_lmrs: DAT_COUNT,
    pub max_lmr_block_size: u32,
    pub max_lmr_virtual_address: DAT_VADDR,
    pub max_pzs: DAT_COUNT,
    pub max_message_size: u32,
    pub max_rdma_size: u32,
    pub max_rmrs: DAT_COUNT,
    pub max_rmr_target_address: DAT_VADDR,
    pub max_srqs: DAT_COUNT,
    pub max_ep_per_srq: DAT_COUNT,
    pub max_recv_per_srq: DAT_COUNT,
    pub max_iov_segments_per_rdma_read: DAT_COUNT,
    pub max_iov_segments_per_rdma_write: DAT_COUNT,
    pub max_rdma_read_in: DAT_COUNT,
    pub max_rdma_read_out: DAT_COUNT,
    pub max_rdma_read_per_ep_in_guaranteed: DAT_BOOLEAN,
    pub max_rdma_read_per_ep_out_guaranteed: DAT_BOOLEAN,
    pub zb_supported: DAT_BOOLEAN,
    pub extension_supported: u32,
    pub extension_version: DAT_COUNT,
    pub num_transport_attr: DAT_COUNT,
    pub transport_attr: *mut DAT_NAMED_ATTR,
    pub num_vendor_attr: DAT_COUNT,
    pub vendor_attr: *mut DAT_NAMED_ATTR,
}

#[repr(C)]
pub struct DAT_PROVIDER_ATTR {
    pub provider_name: [c_char; DAT_NAME_MAX_LENGTH],
    pub provider_version_major: u32,
    pub provider_version_minor: u32,
    pub dapl_version_major: u32,
    pub dapl_version_minor: u32,
    pub lmr_mem_types_supported: u32,
    pub iov_ownership_on_return: u32,
    pub dat_qos_supported: u32,
    pub completion_flags_supported: u32,
    pub is_thread_safe: DAT_BOOLEAN,
    pub max_private_data_size: DAT_COUNT,
    pub supports_multipath: DAT_BOOLEAN,
    pub ep_creator: u32,
    pub pz_support: u32,
    pub optimal_buffer_alignment: u32,
    pub evd_stream_merging_supported: [[DAT_BOOLEAN; 6]; 6],
    pub srq_supported: DAT_BOOLEAN,
    pub srq_watermarks_supported: DAT_COUNT,
    pub srq_ep_pz_difference_supported: DAT_BOOLEAN,
    pub srq_info_supported: DAT_COUNT,
    pub ep_recv_info_supported: DAT_COUNT,
    pub lmr_sync_req: DAT_BOOLEAN,
    pub dto_async_return_guaranteed: DAT_BOOLEAN,
    pub rdma_write_for_rdma_read_req: DAT_BOOLEAN,
    pub rdma_read_lmr_rmr_context_exposure: DAT_BOOLEAN,
    pub rmr_scope_supported: u32,
    pub is_signal_safe: DAT_BOOLEAN,
    pub ha_supported: DAT_BOOLEAN,
    pub ha_loadbalancing: u32,
    pub num_provider_specific_attr: DAT_COUNT,
    pub provider_specific_attr: *mut DAT_NAMED_ATTR,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_DTO_COMPLETION_EVENT_DATA {
    pub ep_handle: DAT_HANDLE,
    pub user_cookie: DAT_CONTEXT,
    pub status: u32,
    pub transfered_length: u32,
    pub operation: u32,
    pub rmr_context: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_RMR_BIND_COMPLETION_EVENT_DATA {
    pub rmr_handle: DAT_HANDLE,
    pub user_cookie: DAT_CONTEXT,
    pub status: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_CR_ARRIVAL_EVENT_DATA {
    pub sp_handle: DAT_HANDLE,
    pub local_ia_address_ptr: SockAddr,
    pub conn_qual: u64,
    pub cr_handle: DAT_HANDLE,
    pub truncate_flag: DAT_BOOLEAN,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_CONNECTION_EVENT_DATA {
    pub ep_handle: DAT_HANDLE,
    pub private_data_size: DAT_COUNT,
    pub private_data: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_ASYNCH_ERROR_EVENT_DATA {
    pub dat_handle: DAT_HANDLE,
    pub reason: DAT_COUNT,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union DAT_EVENT_DATA {
    pub dto: DAT_DTO_COMPLETION_EVENT_DATA,
    pub rmr: DAT_RMR_BIND_COMPLETION_EVENT_DATA,
    pub cr: DAT_CR_ARRIVAL_EVENT_DATA,
    pub connect: DAT_CONNECTION_EVENT_DATA,
    pub asynch: DAT_ASYNCH_ERROR_EVENT_DATA,
    pub software: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_EVENT {
    pub event_number: u32,
    pub evd_handle: DAT_HANDLE,
    pub event_data: DAT_EVENT_DATA,
    pub event_extension_data: [u64; 8],
}

// Event numbers (`DAT_EVENT_NUMBER`).
pub const DAT_DTO_COMPLETION_EVENT: u32 = 0x00001;
pub const DAT_RMR_BIND_COMPLETION_EVENT: u32 = 0x01001;
pub const DAT_CONNECTION_REQUEST_EVENT: u32 = 0x02001;
pub const DAT_CONNECTION_EVENT_ESTABLISHED: u32 = 0x04001;
pub const DAT_CONNECTION_EVENT_PEER_REJECTED: u32 = 0x04002;
pub const DAT_CONNECTION_EVENT_NON_PEER_REJECTED: u32 = 0x04003;
pub const DAT_CONNECTION_EVENT_DISCONNECTED: u32 = 0x04005;
pub const DAT_CONNECTION_EVENT_BROKEN: u32 = 0x04006;
pub const DAT_CONNECTION_EVENT_TIMED_OUT: u32 = 0x04007;
pub const DAT_CONNECTION_EVENT_UNREACHABLE: u32 = 0x04008;
pub const DAT_ASYNC_ERROR_EVD_OVERFLOW: u32 = 0x08001;
pub const DAT_ASYNC_ERROR_IA_CATASTROPHIC: u32 = 0x08002;
pub const DAT_ASYNC_ERROR_EP_BROKEN: u32 = 0x08003;
pub const DAT_ASYNC_ERROR_PROVIDER_INTERNAL_ERROR: u32 = 0x08005;
pub const DAT_SOFTWARE_EVENT: u32 = 0x10001;
/// `DAT_IB_EXTENSION_RANGE_BASE`: the IB extension's events (`DAT_IB_DTO_EVENT` = base).
pub const DAT_IB_DTO_EVENT: u32 = 0x40000;
pub const DAT_IB_UD_CONNECTION_REQUEST_EVENT: u32 = 0x40001;
pub const DAT_IB_UD_CONNECTION_EVENT_ESTABLISHED: u32 = 0x40002;
pub const DAT_IB_UD_CONNECTION_REJECT_EVENT: u32 = 0x40003;
pub const DAT_IB_UD_CONNECTION_ERROR_EVENT: u32 = 0x40004;

// `DAT_SERVICE_TYPE` (with the IB extension's).
pub const DAT_SERVICE_TYPE_RC: u32 = 0;
/// `DAT_IB_SERVICE_TYPE_UD` = `DAT_SERVICE_TYPE_EXTENSION_BASE`.
pub const DAT_IB_SERVICE_TYPE_UD: u32 = 1;

// `DAT_DTOS`.
pub const DAT_DTO_SEND: u32 = 0;
pub const DAT_DTO_RDMA_WRITE: u32 = 1;
pub const DAT_DTO_RDMA_READ: u32 = 2;
pub const DAT_DTO_RECEIVE: u32 = 3;
pub const DAT_DTO_BIND_MW: u32 = 5;
/// `DAT_DTO_EXTENSION_BASE`.
pub const DAT_DTO_EXTENSION_BASE: u32 = 8;

// Handle types (`DAT_HANDLE_TYPE`).
pub const DAT_HANDLE_TYPE_CR: u32 = 0;
pub const DAT_HANDLE_TYPE_EP: u32 = 1;
pub const DAT_HANDLE_TYPE_EVD: u32 = 2;
pub const DAT_HANDLE_TYPE_IA: u32 = 3;
pub const DAT_HANDLE_TYPE_LMR: u32 = 4;
pub const DAT_HANDLE_TYPE_PSP: u32 = 5;
pub const DAT_HANDLE_TYPE_PZ: u32 = 6;
pub const DAT_HANDLE_TYPE_RMR: u32 = 7;
pub const DAT_HANDLE_TYPE_RSP: u32 = 8;
pub const DAT_HANDLE_TYPE_CNO: u32 = 9;
pub const DAT_HANDLE_TYPE_SRQ: u32 = 10;

pub const DAT_MEM_TYPE_VIRTUAL: u32 = 0;
pub const DAT_MEM_TYPE_LMR: u32 = 1;
pub const DAT_MEM_TYPE_SHARED_VIRTUAL: u32 = 2;

pub const DAT_EVD_STATE_ENABLED: u32 = 0x01;
pub const DAT_EVD_STATE_DISABLED: u32 = 0x02;
pub const DAT_EVD_STATE_WAITABLE: u32 = 0x04;

pub const DAT_PSP_PROVIDER_FLAG: u32 = 0x01;
pub const DAT_CLOSE_GRACEFUL_FLAG: u32 = 0x01;
pub const DAT_PROXY_TYPE_FD: u32 = 0x2;
pub const DAT_SRQ_STATE_OPERATIONAL: u32 = 1;

// IB extension operations (`DAT_IB_OP`) and what their events report.
pub const DAT_IB_FETCH_AND_ADD_OP: c_int = 0;
pub const DAT_IB_CMP_AND_SWAP_OP: c_int = 1;
pub const DAT_IB_RDMA_WRITE_IMMED_OP: c_int = 2;
pub const DAT_IB_UD_SEND_OP: c_int = 3;
pub const DAT_IB_UD_CM_FREE_OP: c_int = 28;
pub const DAT_IB_UD_AH_FREE_OP: c_int = 29;
// `DAT_IB_EXT_TYPE`: what an extension event's data holds.
pub const DAT_IB_FETCH_AND_ADD: u32 = 0;
pub const DAT_IB_CMP_AND_SWAP: u32 = 1;
pub const DAT_IB_RDMA_WRITE_IMMED: u32 = 2;
pub const DAT_IB_RDMA_WRITE_IMMED_DATA: u32 = 3;
pub const DAT_IB_RECV_IMMED_DATA: u32 = 4;
pub const DAT_IB_UD_CONNECT_REQUEST: u32 = 5;
pub const DAT_IB_UD_REMOTE_AH: u32 = 6;
pub const DAT_IB_UD_PASSIVE_REMOTE_AH: u32 = 7;
pub const DAT_IB_UD_CONNECT_REJECT: u32 = 10;
pub const DAT_IB_UD_CONNECT_ERROR: u32 = 11;

/// `DAT_IB_ADDR_HANDLE`: a UD destination as the extension events report it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DAT_IB_ADDR_HANDLE {
    /// `struct ibv_ah *` in OFA's provider; here the address of krdma's handle object.
    pub ah: *mut c_void,
    pub qpn: u32,
    /// `DAT_SOCK_ADDR6` (`struct sockaddr_in6`).
    pub ia_addr: [u8; 28],
}
// `DAT_IB_DTOS`: the operation of an extended DTO event.
pub const DAT_IB_DTO_RDMA_WRITE_IMMED: u32 = DAT_DTO_EXTENSION_BASE;
pub const DAT_IB_DTO_RECV_IMMED: u32 = DAT_DTO_EXTENSION_BASE + 1;
pub const DAT_IB_DTO_FETCH_ADD: u32 = DAT_DTO_EXTENSION_BASE + 2;
pub const DAT_IB_DTO_CMP_SWAP: u32 = DAT_DTO_EXTENSION_BASE + 3;
pub const DAT_IB_DTO_RECV_MSG_IMMED: u32 = DAT_DTO_EXTENSION_BASE + 4;

pub type DAT_IA_HANDLE = DAT_HANDLE;

/// One entry of the vtable: every function has its C signature.
macro_rules! vtable {
    ($($name:ident: fn($($arg:ty),*);)*) => {
        /// `struct dat_provider` (`<dat2/udat_redirection.h>`, with `DAT_EXTENSIONS`).
        #[repr(C)]
        pub struct DAT_PROVIDER {
            pub device_name: *const c_char,
            pub extension: *mut c_void,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> DAT_RETURN,)*
        }

        /// The vtable's member names in order, for the layout test.
        pub const VTABLE_MEMBERS: &[&str] = &[$(stringify!($name)),*];
    };
}

type H = DAT_HANDLE;
type P<T> = *mut T;
type C<T> = *const T;

vtable! {
    ia_open_func: fn(C<c_char>, DAT_COUNT, P<H>, P<H>);
    ia_query_func: fn(H, P<H>, u64, P<DAT_IA_ATTR>, u64, P<DAT_PROVIDER_ATTR>);
    ia_close_func: fn(H, u32);
    set_consumer_context_func: fn(H, DAT_CONTEXT);
    get_consumer_context_func: fn(H, P<DAT_CONTEXT>);
    get_handle_type_func: fn(H, P<u32>);
    cno_create_func: fn(H, DAT_OS_WAIT_PROXY_AGENT, P<H>);
    cno_modify_agent_func: fn(H, DAT_OS_WAIT_PROXY_AGENT);
    cno_query_func: fn(H, u32, P<DAT_CNO_PARAM>);
    cno_free_func: fn(H);
    cno_wait_func: fn(H, DAT_TIMEOUT, P<H>);
    cr_query_func: fn(H, u32, P<DAT_CR_PARAM>);
    cr_accept_func: fn(H, H, DAT_COUNT, C<c_void>);
    cr_reject_func: fn(H, DAT_COUNT, C<c_void>);
    cr_handoff_func: fn(H, u64);
    evd_create_func: fn(H, DAT_COUNT, H, u32, P<H>);
    evd_query_func: fn(H, u32, P<DAT_EVD_PARAM>);
    evd_modify_cno_func: fn(H, H);
    evd_enable_func: fn(H);
    evd_disable_func: fn(H);
    evd_wait_func: fn(H, DAT_TIMEOUT, DAT_COUNT, P<DAT_EVENT>, P<DAT_COUNT>);
    evd_resize_func: fn(H, DAT_COUNT);
    evd_post_se_func: fn(H, C<DAT_EVENT>);
    evd_dequeue_func: fn(H, P<DAT_EVENT>);
    evd_free_func: fn(H);
    ep_create_func: fn(H, H, H, H, H, C<DAT_EP_ATTR>, P<H>);
    ep_query_func: fn(H, u64, P<DAT_EP_PARAM>);
    ep_modify_func: fn(H, u64, C<DAT_EP_PARAM>);
    ep_connect_func: fn(H, SockAddr, u64, DAT_TIMEOUT, DAT_COUNT, C<c_void>, u32, u32);
    ep_dup_connect_func: fn(H, H, DAT_TIMEOUT, DAT_COUNT, C<c_void>, u32);
    ep_disconnect_func: fn(H, u32);
    ep_post_send_func: fn(H, DAT_COUNT, P<DAT_LMR_TRIPLET>, DAT_CONTEXT, u32);
    ep_post_recv_func: fn(H, DAT_COUNT, P<DAT_LMR_TRIPLET>, DAT_CONTEXT, u32);
    ep_post_rdma_read_func: fn(H, DAT_COUNT, P<DAT_LMR_TRIPLET>, DAT_CONTEXT, C<DAT_RMR_TRIPLET>, u32);
    ep_post_rdma_write_func: fn(H, DAT_COUNT, P<DAT_LMR_TRIPLET>, DAT_CONTEXT, C<DAT_RMR_TRIPLET>, u32);
    ep_get_status_func: fn(H, P<u32>, P<DAT_BOOLEAN>, P<DAT_BOOLEAN>);
    ep_free_func: fn(H);
    lmr_create_func: fn(H, u32, DAT_REGION_DESCRIPTION, DAT_VLEN, H, u32, u32, P<H>, P<u32>, P<u32>, P<DAT_VLEN>, P<DAT_VADDR>);
    lmr_query_func: fn(H, u32, P<DAT_LMR_PARAM>);
    lmr_free_func: fn(H);
    rmr_create_func: fn(H, P<H>);
    rmr_query_func: fn(H, u32, P<DAT_RMR_PARAM>);
    rmr_bind_func: fn(H, H, C<DAT_LMR_TRIPLET>, u32, u32, H, DAT_CONTEXT, u32, P<u32>);
    rmr_free_func: fn(H);
    psp_create_func: fn(H, u64, H, u32, P<H>);
    psp_query_func: fn(H, u32, P<DAT_PSP_PARAM>);
    psp_free_func: fn(H);
    rsp_create_func: fn(H, u64, H, H, P<H>);
    rsp_query_func: fn(H, u32, P<DAT_RSP_PARAM>);
    rsp_free_func: fn(H);
    pz_create_func: fn(H, P<H>);
    pz_query_func: fn(H, u32, P<DAT_PZ_PARAM>);
    pz_free_func: fn(H);
    psp_create_any_func: fn(H, P<u64>, H, u32, P<H>);
    ep_reset_func: fn(H);
    evd_set_unwaitable_func: fn(H);
    evd_clear_unwaitable_func: fn(H);
    lmr_sync_rdma_read_func: fn(H, C<DAT_LMR_TRIPLET>, DAT_VLEN);
    lmr_sync_rdma_write_func: fn(H, C<DAT_LMR_TRIPLET>, DAT_VLEN);
    ep_create_with_srq_func: fn(H, H, H, H, H, H, C<DAT_EP_ATTR>, P<H>);
    ep_recv_query_func: fn(H, P<DAT_COUNT>, P<DAT_COUNT>);
    ep_set_watermark_func: fn(H, DAT_COUNT, DAT_COUNT);
    srq_create_func: fn(H, H, P<DAT_SRQ_ATTR>, P<H>);
    srq_free_func: fn(H);
    srq_post_recv_func: fn(H, DAT_COUNT, P<DAT_LMR_TRIPLET>, DAT_CONTEXT);
    srq_query_func: fn(H, u32, P<DAT_SRQ_PARAM>);
    srq_resize_func: fn(H, DAT_COUNT);
    srq_set_lw_func: fn(H, DAT_COUNT);
    csp_create_func: fn(H, P<DAT_COMM>, SockAddr, H, P<H>);
    csp_query_func: fn(H, u32, P<c_void>);
    csp_free_func: fn(H);
    ep_common_connect_func: fn(H, SockAddr, DAT_TIMEOUT, DAT_COUNT, C<c_void>);
    rmr_create_for_ep_func: fn(H, P<H>);
    ep_post_send_with_invalidate_func: fn(H, DAT_COUNT, P<DAT_LMR_TRIPLET>, DAT_CONTEXT, u32, DAT_BOOLEAN, u32);
    ep_post_rdma_read_to_rmr_func: fn(H, C<DAT_RMR_TRIPLET>, DAT_CONTEXT, C<DAT_RMR_TRIPLET>, u32);
    cno_fd_create_func: fn(H, P<c_int>, P<H>);
    cno_trigger_func: fn(H, P<H>);
    ia_ha_related_func: fn(H, C<c_char>, P<DAT_BOOLEAN>);
    handle_extendedop_func: fn(H, c_int, *mut c_void);
}

// SAFETY: the table holds a name pointer to a leaked C string and function pointers; it
// is written once, before it is published, and only read afterwards.
unsafe impl Sync for DAT_PROVIDER {}
unsafe impl Send for DAT_PROVIDER {}

/// (name, Rust size or offset) rows for the layout test: `T` for `sizeof(T)`,
/// `T.member` for `offsetof(T, member)`.
pub fn layout() -> Vec<(String, usize)> {
    use std::mem::{offset_of, size_of};
    let mut rows: Vec<(String, usize)> = Vec::new();
    macro_rules! sizes { ($($t:ident),*) => { $(rows.push((stringify!($t).into(), size_of::<$t>()));)* } }
    macro_rules! offsets { ($t:ident: $($m:ident),*) => { $(rows.push((format!("{}.{}", stringify!($t), stringify!($m)), offset_of!($t, $m)));)* } }
    sizes!(
        DAT_NAMED_ATTR,
        DAT_LMR_TRIPLET,
        DAT_RMR_TRIPLET,
        DAT_PROVIDER_INFO,
        DAT_EP_ATTR,
        DAT_COMM,
        DAT_EP_PARAM,
        DAT_EVD_PARAM,
        DAT_REGION_DESCRIPTION,
        DAT_LMR_PARAM,
        DAT_RMR_PARAM,
        DAT_PSP_PARAM,
        DAT_RSP_PARAM,
        DAT_CR_PARAM,
        DAT_PZ_PARAM,
        DAT_OS_WAIT_PROXY_AGENT,
        DAT_CNO_PARAM,
        DAT_SRQ_ATTR,
        DAT_SRQ_PARAM,
        DAT_IA_ATTR,
        DAT_PROVIDER_ATTR,
        DAT_DTO_COMPLETION_EVENT_DATA,
        DAT_RMR_BIND_COMPLETION_EVENT_DATA,
        DAT_CR_ARRIVAL_EVENT_DATA,
        DAT_CONNECTION_EVENT_DATA,
        DAT_ASYNCH_ERROR_EVENT_DATA,
        DAT_EVENT_DATA,
        DAT_EVENT,
        DAT_PROVIDER
    );
    offsets!(DAT_EP_ATTR: max_recv_dtos, srq_soft_hw, ep_transport_specific, ep_provider_specific_count, ep_provider_specific);
    offsets!(DAT_EP_PARAM: ep_state, comm, local_ia_address_ptr, remote_port_qual, srq_handle, ep_attr);
    offsets!(DAT_EVD_PARAM: evd_qlen, evd_state, cno_handle, evd_flags);
    offsets!(DAT_LMR_PARAM: mem_type, region_desc, length, pz_handle, mem_priv, lmr_context, rmr_context, registered_size, registered_address);
    offsets!(DAT_RMR_PARAM: lmr_triplet, mem_priv, rmr_context, va_type);
    offsets!(DAT_CR_PARAM: remote_port_qual, private_data_size, private_data, local_ep_handle);
    offsets!(DAT_CNO_PARAM: proxy_type, proxy);
    offsets!(DAT_SRQ_PARAM: srq_state, pz_handle, max_recv_dtos, outstanding_dto_count);
    offsets!(DAT_IA_ATTR: ia_address_ptr, max_eps, max_lmr_block_size, max_lmr_virtual_address, max_pzs, max_rmr_target_address, max_srqs, extension_supported, extension_version, transport_attr, num_vendor_attr, vendor_attr);
    offsets!(DAT_PROVIDER_ATTR: dapl_version_major, is_thread_safe, max_private_data_size, optimal_buffer_alignment, evd_stream_merging_supported, srq_supported, rmr_scope_supported, num_provider_specific_attr, provider_specific_attr);
    offsets!(DAT_DTO_COMPLETION_EVENT_DATA: user_cookie, status, transfered_length, operation, rmr_context);
    offsets!(DAT_CR_ARRIVAL_EVENT_DATA: local_ia_address_ptr, conn_qual, cr_handle, truncate_flag);
    offsets!(DAT_CONNECTION_EVENT_DATA: private_data_size, private_data);
    offsets!(DAT_EVENT: evd_handle, event_data, event_extension_data);
    offsets!(DAT_PROVIDER: ia_open_func, ia_close_func, cno_create_func, evd_wait_func, ep_connect_func, lmr_create_func, psp_create_any_func, ep_create_with_srq_func, srq_set_lw_func, csp_create_func, cno_trigger_func, ia_ha_related_func, handle_extendedop_func);
    rows
}
