//! The calls of the standard that krdma does not support: each returns
//! `IT_ERR_OP_NOT_SUPPORTED` (see docs/itapi.md for why).
//!
//! * the unreliable-datagram service (address handles, UD endpoints and service
//!   requests): no krdma device offers UD yet;
//! * privileged memory operations (`it_mem_map`, I/O buffer lists, LMR linking);
//! * `it_post_rdma_read_to_rmr` (`rdma_read_local_extensions` is `IT_FALSE`);
//! * `it_ep_reset`: an endpoint is not reused after its connection ends;
//! * connection hand-off and socket conversion.

use crate::types::*;
use krdma_itapi::Error;
use std::ffi::c_void;

macro_rules! not_supported {
    ($($name:ident($($ty:ty),*);)*) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name($(_: $ty),*) -> ItStatus {
                tracing::debug!(call = stringify!($name), "not supported");
                Error::OpNotSupported.code()
            }
        )*
    };
}

not_supported! {
    it_address_handle_create(Handle, *const Path, u32, *mut Handle);
    it_address_handle_free(Handle);
    it_address_handle_modify(Handle, u32, *const c_void);
    it_address_handle_query(Handle, u32, *mut c_void);
    it_ep_ud_create(Handle, Handle, Handle, *const EpAttributes, usize, *mut Handle);
    it_ep_reset(Handle);
    it_handoff(*const ConnQual, usize, u64);
    it_socket_convert(i32, Handle, u32, *const u8, usize);
    it_lmr_create_unlinked(Handle, usize, u32, u32, *mut Handle);
    it_lmr_link(Handle, *const c_void, *const c_void, u64, u32, u32, Handle, u64, u32, *mut u64);
    it_lmr_unlink(Handle, Handle, u64, u32);
    it_lmr_modify(Handle, u32, *const LmrParam);
    it_mem_map(Handle, *mut c_void, u64, usize, *mut Handle, *mut usize);
    it_mem_unmap(Handle, Handle, usize);
    it_post_rdma_read_to_rmr(Handle, *const c_void, usize, u64, u32, u64, u64);
    it_post_sendto(Handle, *const LmrTriplet, usize, u64, u32, *const c_void);
    it_post_recvfrom(Handle, *const LmrTriplet, usize, u64, u32);
    it_ud_service_request_handle_create(*const ConnQual, Handle, *const Path, *const u8, usize, *mut Handle);
    it_ud_service_request_handle_free(Handle);
    it_ud_service_request_handle_query(Handle, u32, *mut c_void);
    it_ud_service_request(Handle);
    it_ud_service_reply(u64, u32, RemoteEpInfo, *const u8, usize);
}
