//! `dat_ia_*`, consumer contexts and handle types.

use crate::boundary::{c_name, call, put, put_opt};
use crate::handles::{self, Obj};
use crate::sys::*;
use krdma_dapl as dapl;
use krdma_dapl::{Error, Major, Minor};
use std::ffi::{c_char, CStr};
use std::net::IpAddr;

/// A `sockaddr` (IPv4 or IPv6) for an address, in storage the handle keeps.
pub fn sockaddr(ip: IpAddr, port: u16) -> Box<libc::sockaddr_storage> {
    // SAFETY: an all-zero sockaddr_storage is a valid value.
    let mut s: Box<libc::sockaddr_storage> = Box::new(unsafe { std::mem::zeroed() });
    match ip {
        IpAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: port.to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut *s as *mut _ as *mut libc::sockaddr_in, sin) };
        }
        IpAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: port.to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write(&mut *s as *mut _ as *mut libc::sockaddr_in6, sin6) };
        }
    }
    s
}

/// The address (and port) in a consumer's `sockaddr` (argument `arg`).
pub fn read_sockaddr(p: *const libc::sockaddr, arg: u32) -> dapl::Result<std::net::SocketAddr> {
    let family = crate::boundary::get(p as *const libc::sa_family_t, arg)?;
    match family as i32 {
        libc::AF_INET => {
            let sin = crate::boundary::get(p as *const libc::sockaddr_in, arg)?;
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Ok((ip, u16::from_be(sin.sin_port)).into())
        }
        libc::AF_INET6 => {
            let sin6 = crate::boundary::get(p as *const libc::sockaddr_in6, arg)?;
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Ok((ip, u16::from_be(sin6.sin6_port)).into())
        }
        _ => Err(Error::new(Major::InvalidAddress, Minor::AddressUnsupported)),
    }
}

pub unsafe extern "C" fn ia_open(
    name: *const c_char,
    qlen: DAT_COUNT,
    async_evd: *mut DAT_HANDLE,
    ia_out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("ia_open", || {
        if name.is_null() {
            return Err(crate::boundary::arg_error(1));
        }
        // SAFETY: the consumer's NUL-terminated IA name.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let (provider, device, _) = crate::registry::lookup(&name).ok_or(Error::new(
            Major::ProviderNotFound,
            Minor::NameNotRegistered,
        ))?;
        let given = crate::boundary::get(async_evd as *const DAT_HANDLE, 3)?;
        if ia_out.is_null() {
            return Err(crate::boundary::arg_error(4));
        }
        let ia = dapl::Ia::open(&device)?;
        let ia_handle = handles::insert(Obj::Ia(ia.clone()), ia.id(), provider);
        if let Some(ip) = crate::registry::address(&name) {
            handles::ia(ia_handle)?.0.keep.lock().ia_address = Some(ip);
        }
        let evd_handle = if given.is_null() {
            let evd = ia.async_evd(qlen.max(8) as usize)?;
            handles::insert(Obj::Evd(evd), ia.id(), provider)
        } else {
            given
        };
        put(async_evd, evd_handle, 3)?;
        put(ia_out, ia_handle, 4)?;
        tracing::info!(name, device, "ia_open");
        Ok(())
    })
}

/// Named attributes, as C strings the handle keeps.
fn named(keep: &mut handles::Keep, attrs: &[(String, String)]) -> *mut DAT_NAMED_ATTR {
    let cstr = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
    let strings: Vec<_> = attrs.iter().map(|(n, v)| (cstr(n), cstr(v))).collect();
    let v: Vec<DAT_NAMED_ATTR> = strings
        .iter()
        .map(|(n, v)| DAT_NAMED_ATTR {
            name: n.as_ptr(),
            value: v.as_ptr(),
        })
        .collect();
    keep.strings = strings;
    keep.named = Some(v.into_boxed_slice());
    keep.named
        .as_mut()
        .map_or(std::ptr::null_mut(), |n| n.as_mut_ptr())
}

pub unsafe extern "C" fn ia_query(
    ia_h: DAT_HANDLE,
    async_evd: *mut DAT_HANDLE,
    _ia_mask: u64,
    ia_attr: *mut DAT_IA_ATTR,
    _pr_mask: u64,
    pr_attr: *mut DAT_PROVIDER_ATTR,
) -> DAT_RETURN {
    call("ia_query", || {
        let (entry, ia) = handles::ia(ia_h)?;
        if let Some(evd) = ia.current_async_evd() {
            put_opt(async_evd, handles::handle_of(evd.id()));
        }
        let a = ia.query();
        let p = ia.provider_attr();
        let mut keep = entry.keep.lock();
        if !ia_attr.is_null() {
            let addr_ptr = match keep.ia_address.or(a.address) {
                Some(ip) => {
                    let s = keep.local_addr.insert(sockaddr(ip, 0));
                    &mut **s as *mut libc::sockaddr_storage as SockAddr
                }
                None => std::ptr::null_mut(),
            };
            let c = |v: u32| v.min(i32::MAX as u32) as DAT_COUNT;
            // SAFETY: an all-zero DAT_IA_ATTR is valid (integers and null pointers).
            let mut out: DAT_IA_ATTR = unsafe { std::mem::zeroed() };
            c_name(&mut out.adapter_name, &a.adapter_name);
            c_name(&mut out.vendor_name, &a.vendor_name);
            out.hardware_version_major = 1;
            out.ia_address_ptr = addr_ptr;
            out.max_eps = c(a.max_eps);
            out.max_dto_per_ep = c(a.max_dto_per_ep);
            out.max_rdma_read_per_ep_in = c(a.max_rdma_read_per_ep_in);
            out.max_rdma_read_per_ep_out = c(a.max_rdma_read_per_ep_out);
            out.max_evds = c(a.max_evds);
            out.max_evd_qlen = c(a.max_evd_qlen);
            out.max_iov_segments_per_dto = c(a.max_iov_segments_per_dto);
            out.max_lmrs = c(a.max_lmrs);
            out.max_lmr_block_size = a.max_lmr_block_size.min(u32::MAX as u64) as u32;
            out.max_lmr_virtual_address = u64::MAX;
            out.max_pzs = c(a.max_pzs);
            out.max_message_size = a.max_message_size;
            out.max_rdma_size = a.max_rdma_size;
            out.max_rmrs = c(a.max_rmrs);
            out.max_rmr_target_address = u64::MAX;
            out.max_srqs = c(a.max_srqs);
            out.max_ep_per_srq = c(a.max_eps);
            out.max_recv_per_srq = c(a.max_recv_per_srq);
            out.max_iov_segments_per_rdma_read = c(a.max_iov_segments_per_dto);
            out.max_iov_segments_per_rdma_write = c(a.max_iov_segments_per_dto);
            out.max_rdma_read_in = c(a.max_rdma_read_per_ep_in);
            out.max_rdma_read_out = c(a.max_rdma_read_per_ep_out);
            out.max_rdma_read_per_ep_in_guaranteed = DAT_TRUE;
            out.max_rdma_read_per_ep_out_guaranteed = DAT_TRUE;
            out.zb_supported = DAT_FALSE;
            out.extension_supported = a.extension as u32;
            out.extension_version = match a.extension {
                dapl::Extension::Ib => dapl::IB_EXTENSION_VERSION,
                dapl::Extension::None => 0,
            };
            put(ia_attr, out, 4)?;
        }
        if !pr_attr.is_null() {
            let thread_safe = crate::registry::lookup(ia.name()).is_some_and(|(_, _, t)| t);
            // SAFETY: an all-zero DAT_PROVIDER_ATTR is valid.
            let mut out: DAT_PROVIDER_ATTR = unsafe { std::mem::zeroed() };
            c_name(&mut out.provider_name, ia.name());
            out.provider_version_major = 1;
            out.dapl_version_major = p.dapl_version.0;
            out.dapl_version_minor = p.dapl_version.1;
            out.lmr_mem_types_supported = 0x3; // virtual, LMR
            out.iov_ownership_on_return = 0; // DAT_IOV_CONSUMER
            out.completion_flags_supported = 0x0f;
            out.is_thread_safe = thread_safe as DAT_BOOLEAN;
            out.max_private_data_size = p.max_private_data_size as DAT_COUNT;
            out.ep_creator = 0; // DAT_PSP_CREATES_EP_NEVER
            out.optimal_buffer_alignment = 64;
            for i in 0..6 {
                out.evd_stream_merging_supported[i][i] = DAT_TRUE;
            }
            out.srq_supported = p.srq_supported as DAT_BOOLEAN;
            out.dto_async_return_guaranteed = DAT_TRUE;
            out.rmr_scope_supported = 0; // DAT_RMR_SCOPE_EP
            out.num_provider_specific_attr = p.specific.len() as DAT_COUNT;
            out.provider_specific_attr = named(&mut keep, &p.specific);
            put(pr_attr, out, 6)?;
        }
        Ok(())
    })
}

pub unsafe extern "C" fn ia_close(ia_h: DAT_HANDLE, flags: u32) -> DAT_RETURN {
    call("ia_close", || {
        let (_, ia) = handles::ia(ia_h)?;
        let children = handles::of_ia(ia.id());
        if flags & DAT_CLOSE_GRACEFUL_FLAG != 0 {
            let own_async = ia.current_async_evd().map(|e| e.id());
            let busy = children.iter().any(|(_, e)| match &e.obj {
                Obj::Evd(evd) => Some(evd.id()) != own_async,
                _ => true,
            });
            if busy {
                return Err(Error::new(Major::InvalidState, Minor::IaInUse));
            }
        }
        for (h, _) in children {
            handles::remove(h);
        }
        handles::remove(ia_h);
        tracing::info!(
            ia = ia.id(),
            graceful = flags & DAT_CLOSE_GRACEFUL_FLAG != 0,
            "ia_close"
        );
        Ok(())
    })
}

pub unsafe extern "C" fn set_consumer_context(h: DAT_HANDLE, context: DAT_CONTEXT) -> DAT_RETURN {
    call("set_consumer_context", || {
        let e = handles::get(h).ok_or(Error::of(Major::InvalidHandle))?;
        e.context
            .store(context, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })
}

pub unsafe extern "C" fn get_consumer_context(
    h: DAT_HANDLE,
    context: *mut DAT_CONTEXT,
) -> DAT_RETURN {
    call("get_consumer_context", || {
        let e = handles::get(h).ok_or(Error::of(Major::InvalidHandle))?;
        put(
            context,
            e.context.load(std::sync::atomic::Ordering::Relaxed),
            2,
        )
    })
}

pub unsafe extern "C" fn get_handle_type(h: DAT_HANDLE, t: *mut u32) -> DAT_RETURN {
    call("get_handle_type", || {
        let e = handles::get(h).ok_or(Error::of(Major::InvalidHandle))?;
        put(t, e.obj.handle_type(), 2)
    })
}

pub unsafe extern "C" fn ia_ha_related(
    ia_h: DAT_HANDLE,
    _name: *const c_char,
    answer: *mut DAT_BOOLEAN,
) -> DAT_RETURN {
    call("ia_ha_related", || {
        handles::ia(ia_h)?;
        put(answer, DAT_FALSE, 3)
    })
}
