//! `dat_ep_*`: endpoints, connections and data transfer.

use crate::boundary::{array, bytes, call, get, put, put_opt};
use crate::handles::{self, Obj};
use crate::ia::{read_sockaddr, sockaddr};
use crate::sys::*;
use krdma_dapl as dapl;
use krdma_dapl::{Error, Major, Minor};
use std::ffi::c_void;

fn attr_from_c(a: &DAT_EP_ATTR) -> dapl::Result<dapl::EpAttr> {
    let ud = match a.service_type {
        DAT_SERVICE_TYPE_RC => false,
        DAT_IB_SERVICE_TYPE_UD => true,
        _ => return Err(Error::of(Major::ModelNotSupported)),
    };
    let n = |v: DAT_COUNT, arg| u32::try_from(v).map_err(|_| crate::boundary::arg_error(arg));
    Ok(dapl::EpAttr {
        max_message_size: a.max_message_size,
        max_rdma_size: a.max_rdma_size,
        max_recv_dtos: n(a.max_recv_dtos, 6)?,
        max_request_dtos: n(a.max_request_dtos, 6)?,
        max_recv_iov: n(a.max_recv_iov, 6)?,
        max_request_iov: n(a.max_request_iov, 6)?,
        max_rdma_read_in: n(a.max_rdma_read_in, 6)?,
        max_rdma_read_out: n(a.max_rdma_read_out, 6)?,
        max_rdma_read_iov: n(a.max_rdma_read_iov, 6)?.max(1),
        max_rdma_write_iov: n(a.max_rdma_write_iov, 6)?.max(1),
        ud,
    })
}

fn attr_to_c(a: &dapl::EpAttr) -> DAT_EP_ATTR {
    DAT_EP_ATTR {
        service_type: if a.ud {
            DAT_IB_SERVICE_TYPE_UD
        } else {
            DAT_SERVICE_TYPE_RC
        },
        max_message_size: a.max_message_size,
        max_rdma_size: a.max_rdma_size,
        qos: 0,
        recv_completion_flags: 0,
        request_completion_flags: 0,
        max_recv_dtos: a.max_recv_dtos as DAT_COUNT,
        max_request_dtos: a.max_request_dtos as DAT_COUNT,
        max_recv_iov: a.max_recv_iov as DAT_COUNT,
        max_request_iov: a.max_request_iov as DAT_COUNT,
        max_rdma_read_in: a.max_rdma_read_in as DAT_COUNT,
        max_rdma_read_out: a.max_rdma_read_out as DAT_COUNT,
        srq_soft_hw: 0,
        max_rdma_read_iov: a.max_rdma_read_iov as DAT_COUNT,
        max_rdma_write_iov: a.max_rdma_write_iov as DAT_COUNT,
        ep_transport_specific_count: 0,
        ep_transport_specific: std::ptr::null_mut(),
        ep_provider_specific_count: 0,
        ep_provider_specific: std::ptr::null_mut(),
    }
}

/// An EVD handle given for an endpoint, or a private EVD of `flags` when the consumer
/// gives none (that queue then reports to nobody).
fn evd_or_private(
    h: DAT_HANDLE,
    ia: &dapl::Ia,
    flags: dapl::EvdFlags,
    qlen: u32,
    minor: Minor,
) -> dapl::Result<dapl::Evd> {
    if h.is_null() {
        return dapl::Evd::create(ia, qlen.max(8) as usize, None, flags);
    }
    handles::evd(h)
        .map(|(_, e)| e)
        .map_err(|_| Error::new(Major::InvalidHandle, minor))
}

#[allow(clippy::too_many_arguments)]
fn create(
    ia_h: DAT_HANDLE,
    pz_h: DAT_HANDLE,
    recv_h: DAT_HANDLE,
    req_h: DAT_HANDLE,
    conn_h: DAT_HANDLE,
    srq_h: DAT_HANDLE,
    attr: *const DAT_EP_ATTR,
    out: *mut DAT_HANDLE,
) -> dapl::Result<()> {
    let (ia_e, ia) = handles::ia(ia_h)?;
    let (_, pz) = handles::pz(pz_h)?;
    if pz.ia().id() != ia.id() {
        return Err(Error::handle(Minor::HandlePz));
    }
    let attr = if attr.is_null() {
        dapl::EpAttr::default()
    } else {
        attr_from_c(&get(attr, 6)?)?
    };
    let recv = evd_or_private(
        recv_h,
        &ia,
        dapl::EvdFlags::DTO,
        attr.max_recv_dtos,
        Minor::HandleEvdRecv,
    )?;
    let req = evd_or_private(
        req_h,
        &ia,
        dapl::EvdFlags::DTO,
        attr.max_request_dtos,
        Minor::HandleEvdRequest,
    )?;
    let conn = evd_or_private(
        conn_h,
        &ia,
        dapl::EvdFlags::CONNECTION,
        8,
        Minor::HandleEvdConn,
    )?;
    let srq = if srq_h.is_null() {
        None
    } else {
        Some(handles::srq(srq_h)?.1)
    };
    if out.is_null() {
        return Err(crate::boundary::arg_error(if srq.is_some() {
            8
        } else {
            7
        }));
    }
    let ep = dapl::Ep::create(&pz, &recv, &req, &conn, attr, srq.as_ref())?;
    put(out, handles::insert(Obj::Ep(ep), ia.id(), ia_e.provider), 7)
}

pub unsafe extern "C" fn ep_create(
    ia_h: DAT_HANDLE,
    pz_h: DAT_HANDLE,
    recv_h: DAT_HANDLE,
    req_h: DAT_HANDLE,
    conn_h: DAT_HANDLE,
    attr: *const DAT_EP_ATTR,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("ep_create", || {
        create(
            ia_h,
            pz_h,
            recv_h,
            req_h,
            conn_h,
            std::ptr::null_mut(),
            attr,
            out,
        )
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ep_create_with_srq(
    ia_h: DAT_HANDLE,
    pz_h: DAT_HANDLE,
    recv_h: DAT_HANDLE,
    req_h: DAT_HANDLE,
    conn_h: DAT_HANDLE,
    srq_h: DAT_HANDLE,
    attr: *const DAT_EP_ATTR,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("ep_create_with_srq", || {
        if srq_h.is_null() {
            return Err(Error::handle(Minor::HandleSrq));
        }
        create(ia_h, pz_h, recv_h, req_h, conn_h, srq_h, attr, out)
    })
}

pub unsafe extern "C" fn ep_query(h: DAT_HANDLE, _mask: u64, out: *mut DAT_EP_PARAM) -> DAT_RETURN {
    call("ep_query", || {
        let (e, ep) = handles::ep(h)?;
        let q = ep.query();
        let mut keep = e.keep.lock();
        let local = match q.local {
            Some(ip) => &mut **keep.local_addr.insert(sockaddr(ip, 0)) as *mut _ as SockAddr,
            None => std::ptr::null_mut(),
        };
        let (remote, remote_port) = match q.remote {
            Some(a) => (
                &mut **keep.remote_addr.insert(sockaddr(a.ip(), a.port())) as *mut _ as SockAddr,
                a.port() as u64,
            ),
            None => (std::ptr::null_mut(), 0),
        };
        let param = DAT_EP_PARAM {
            ia_handle: handles::handle_of(e.ia),
            ep_state: q.state as u32,
            comm: DAT_COMM {
                domain: 0,
                type_: 0,
                protocol: 0,
            },
            local_ia_address_ptr: local,
            local_port_qual: 0,
            remote_ia_address_ptr: remote,
            remote_port_qual: remote_port,
            pz_handle: handles::handle_of(ep.pz().id()),
            recv_evd_handle: handles::handle_of(ep.recv_evd().id()),
            request_evd_handle: handles::handle_of(ep.request_evd().id()),
            connect_evd_handle: handles::handle_of(ep.connect_evd().id()),
            srq_handle: ep
                .srq()
                .map_or(std::ptr::null_mut(), |s| handles::handle_of(s.id())),
            ep_attr: attr_to_c(&q.attr),
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn ep_modify(
    h: DAT_HANDLE,
    mask: u64,
    param: *const DAT_EP_PARAM,
) -> DAT_RETURN {
    call("ep_modify", || {
        handles::ep(h)?;
        if mask == 0 {
            return Ok(());
        }
        get(param as *const u8, 3)?;
        // Endpoints keep the EVDs and attributes they were created with.
        Err(Error::not_implemented())
    })
}

fn connect(
    h: DAT_HANDLE,
    addr: SockAddr,
    port: u64,
    n: DAT_COUNT,
    pdata: *const c_void,
) -> dapl::Result<()> {
    let (_, ep) = handles::ep(h)?;
    let peer = read_sockaddr(addr, 2)?;
    let port = dapl::port_of(port);
    if port == 0 {
        return Err(crate::boundary::arg_error(3));
    }
    let data = bytes(pdata, n, 6)?;
    if data.len() > ep.pz().ia().query().max_private_data.0 {
        return Err(crate::boundary::arg_error(5));
    }
    ep.connect(std::net::SocketAddr::new(peer.ip(), port), data)
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ep_connect(
    h: DAT_HANDLE,
    addr: SockAddr,
    conn_qual: u64,
    _timeout: DAT_TIMEOUT,
    n: DAT_COUNT,
    pdata: *const c_void,
    _qos: u32,
    _flags: u32,
) -> DAT_RETURN {
    call("ep_connect", || connect(h, addr, conn_qual, n, pdata))
}

pub unsafe extern "C" fn ep_common_connect(
    h: DAT_HANDLE,
    addr: SockAddr,
    _timeout: DAT_TIMEOUT,
    n: DAT_COUNT,
    pdata: *const c_void,
) -> DAT_RETURN {
    call("ep_common_connect", || {
        let peer = read_sockaddr(addr, 2)?;
        connect(h, addr, peer.port() as u64, n, pdata)
    })
}

pub unsafe extern "C" fn ep_dup_connect(
    h: DAT_HANDLE,
    dup: DAT_HANDLE,
    _timeout: DAT_TIMEOUT,
    n: DAT_COUNT,
    pdata: *const c_void,
    _qos: u32,
) -> DAT_RETURN {
    call("ep_dup_connect", || {
        let (_, other) = handles::ep(dup)?;
        let remote = other
            .query()
            .remote
            .ok_or(Error::state(Minor::EpUnconnected))?;
        let (_, ep) = handles::ep(h)?;
        let data = bytes(pdata, n, 5)?;
        ep.connect(remote, data)
    })
}

pub unsafe extern "C" fn ep_disconnect(h: DAT_HANDLE, flags: u32) -> DAT_RETURN {
    call("ep_disconnect", || {
        let (_, ep) = handles::ep(h)?;
        ep.disconnect(flags & DAT_CLOSE_GRACEFUL_FLAG == 0)
    })
}

pub(crate) fn triplets(
    p: *const DAT_LMR_TRIPLET,
    n: DAT_COUNT,
    arg: u32,
) -> dapl::Result<Vec<dapl::LmrTriplet>> {
    Ok(array(p, n, arg)?
        .iter()
        .map(|t| dapl::LmrTriplet {
            lmr_context: t.lmr_context,
            address: t.virtual_address,
            length: t.segment_length,
        })
        .collect())
}

pub(crate) fn flags(f: u32) -> dapl::Result<dapl::Completion> {
    dapl::Completion::from_bits(f).ok_or(crate::boundary::arg_error(5))
}

pub unsafe extern "C" fn ep_post_send(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    iov: *mut DAT_LMR_TRIPLET,
    cookie: DAT_CONTEXT,
    f: u32,
) -> DAT_RETURN {
    call("ep_post_send", || {
        let (_, ep) = handles::ep(h)?;
        ep.post_send(&triplets(iov, n, 3)?, cookie, flags(f)?)
    })
}

pub unsafe extern "C" fn ep_post_recv(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    iov: *mut DAT_LMR_TRIPLET,
    cookie: DAT_CONTEXT,
    f: u32,
) -> DAT_RETURN {
    call("ep_post_recv", || {
        let (_, ep) = handles::ep(h)?;
        ep.post_recv(&triplets(iov, n, 3)?, cookie, flags(f)?)
    })
}

pub(crate) fn remote(r: *const DAT_RMR_TRIPLET) -> dapl::Result<dapl::RmrTriplet> {
    let r = get(r, 5)?;
    Ok(dapl::RmrTriplet {
        rmr_context: r.rmr_context,
        address: r.virtual_address,
        length: r.segment_length,
    })
}

pub unsafe extern "C" fn ep_post_rdma_read(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    iov: *mut DAT_LMR_TRIPLET,
    cookie: DAT_CONTEXT,
    r: *const DAT_RMR_TRIPLET,
    f: u32,
) -> DAT_RETURN {
    call("ep_post_rdma_read", || {
        let (_, ep) = handles::ep(h)?;
        ep.post_rdma_read(&triplets(iov, n, 3)?, cookie, &remote(r)?, flags(f)?)
    })
}

pub unsafe extern "C" fn ep_post_rdma_write(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    iov: *mut DAT_LMR_TRIPLET,
    cookie: DAT_CONTEXT,
    r: *const DAT_RMR_TRIPLET,
    f: u32,
) -> DAT_RETURN {
    call("ep_post_rdma_write", || {
        let (_, ep) = handles::ep(h)?;
        ep.post_rdma_write(&triplets(iov, n, 3)?, cookie, &remote(r)?, flags(f)?)
    })
}

pub unsafe extern "C" fn ep_post_send_with_invalidate(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    iov: *mut DAT_LMR_TRIPLET,
    cookie: DAT_CONTEXT,
    f: u32,
    invalidate: DAT_BOOLEAN,
    _rmr_context: u32,
) -> DAT_RETURN {
    call("ep_post_send_with_invalidate", || {
        let (_, ep) = handles::ep(h)?;
        if invalidate != DAT_FALSE {
            return Err(Error::not_implemented());
        }
        ep.post_send(&triplets(iov, n, 3)?, cookie, flags(f)?)
    })
}

pub unsafe extern "C" fn ep_post_rdma_read_to_rmr(
    h: DAT_HANDLE,
    _local: *const DAT_RMR_TRIPLET,
    _cookie: DAT_CONTEXT,
    _remote: *const DAT_RMR_TRIPLET,
    _f: u32,
) -> DAT_RETURN {
    call("ep_post_rdma_read_to_rmr", || {
        handles::ep(h)?;
        Err(Error::not_implemented())
    })
}

pub unsafe extern "C" fn ep_get_status(
    h: DAT_HANDLE,
    state: *mut u32,
    recv_idle: *mut DAT_BOOLEAN,
    request_idle: *mut DAT_BOOLEAN,
) -> DAT_RETURN {
    call("ep_get_status", || {
        let (_, ep) = handles::ep(h)?;
        // Each output is optional (dtestx asks for the idle flags only, as OFA's provider
        // allows).
        put_opt(state, ep.state() as u32);
        let (r, q) = ep.idle();
        put_opt(recv_idle, r as DAT_BOOLEAN);
        put_opt(request_idle, q as DAT_BOOLEAN);
        Ok(())
    })
}

pub unsafe extern "C" fn ep_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("ep_free", || {
        let (_, ep) = handles::ep(h)?;
        crate::ud::forget_ep(ep.id());
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn ep_reset(h: DAT_HANDLE) -> DAT_RETURN {
    call("ep_reset", || handles::ep(h)?.1.reset())
}

pub unsafe extern "C" fn ep_recv_query(
    h: DAT_HANDLE,
    nbufs: *mut DAT_COUNT,
    span: *mut DAT_COUNT,
) -> DAT_RETURN {
    call("ep_recv_query", || {
        let (_, ep) = handles::ep(h)?;
        let outstanding = ep.core().outstanding().1;
        put_opt(nbufs, outstanding as DAT_COUNT);
        put_opt(span, 0);
        Ok(())
    })
}

pub unsafe extern "C" fn ep_set_watermark(
    h: DAT_HANDLE,
    _soft: DAT_COUNT,
    _hard: DAT_COUNT,
) -> DAT_RETURN {
    call("ep_set_watermark", || {
        handles::ep(h)?;
        Err(Error::not_implemented())
    })
}
