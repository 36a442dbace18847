//! Endpoints, listen points and the connection calls.

use crate::event::path_to;
use crate::ffi::{get, put, slice, status};
use crate::handles::{self, Obj};
use crate::types::*;
use bytemuck::Zeroable;
use krdma_itapi::{
    CnEstId, Endpoint, EpAttributes as RustAttrs, EpChange, Error, Listener, Result, Transport,
};
use std::net::{IpAddr, SocketAddr};

const IT_EP_SRQ: u32 = 0x02;
const IT_EP_KNOWN_FLAGS: u32 = 0x01 | IT_EP_SRQ;
const IT_CONNECT_FLAG_TWO_WAY: u32 = 0x1;
const IT_LISTEN_CONN_QUAL_INPUT: u32 = 0x1;
const IT_RC_SERVICE: u32 = 0x1;

const IT_EP_PARAM_RDMA_RD_ENABLE: u32 = 0x400;
const IT_EP_PARAM_RDMA_WR_ENABLE: u32 = 0x800;
const IT_EP_PARAM_MAX_IRD: u32 = 0x4000;
const IT_EP_PARAM_MAX_ORD: u32 = 0x8000;

/// The RDMA CM's service ids for TCP ports: `0x0000000001060000 | port`.
const RDMA_CM_TCP_SERVICE: u64 = 0x0000_0000_0106_0000;

fn rust_attrs(a: &EpAttributes) -> RustAttrs {
    RustAttrs {
        max_dto_payload_size: a.max_dto_payload_size,
        max_request_dtos: a.max_request_dtos,
        max_recv_dtos: a.max_recv_dtos,
        max_send_segments: a.max_send_segments,
        max_recv_segments: a.max_recv_segments,
        rdma_read_enable: a.rc.rdma_read_enable != IT_FALSE,
        rdma_write_enable: a.rc.rdma_write_enable != IT_FALSE,
        max_rdma_read_segments: a.rc.max_rdma_read_segments,
        max_rdma_write_segments: a.rc.max_rdma_write_segments,
        rdma_read_ird: a.rc.rdma_read_ird,
        rdma_read_ord: a.rc.rdma_read_ord,
    }
}

fn c_attrs(a: &RustAttrs, srq: Handle) -> EpAttributes {
    let mut c = EpAttributes::zeroed();
    c.max_dto_payload_size = a.max_dto_payload_size;
    c.max_request_dtos = a.max_request_dtos;
    c.max_recv_dtos = a.max_recv_dtos;
    c.max_send_segments = a.max_send_segments;
    c.max_recv_segments = a.max_recv_segments;
    c.rc.rdma_read_enable = a.rdma_read_enable as ItBool;
    c.rc.rdma_write_enable = a.rdma_write_enable as ItBool;
    c.rc.max_rdma_read_segments = a.max_rdma_read_segments;
    c.rc.max_rdma_write_segments = a.max_rdma_write_segments;
    c.rc.rdma_read_ird = a.rdma_read_ird;
    c.rc.rdma_read_ord = a.rdma_read_ord;
    c.rc.srq = srq;
    c
}

/// `it_ep_rc_create`
///
/// # Safety
/// `ep_attr` is null or readable; `ep_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_ep_rc_create(
    pz_handle: Handle,
    request_sevd_handle: Handle,
    recv_sevd_handle: Handle,
    connect_sevd_handle: Handle,
    flags: u32,
    ep_attr: *const EpAttributes,
    ep_handle: *mut Handle,
) -> ItStatus {
    status(|| {
        let pz = handles::get_pz(pz_handle)?;
        let sevd = |h: Handle, bad: Error| match handles::get(h) {
            Some(Obj::Evd(e)) => Ok(e),
            Some(Obj::Aevd(_)) => Err(Error::AevdNotAllowed),
            _ => Err(bad),
        };
        let req = sevd(request_sevd_handle, Error::InvalidReqEvd)?;
        let recv = sevd(recv_sevd_handle, Error::InvalidRecvEvd)?;
        let conn = sevd(connect_sevd_handle, Error::InvalidConnEvd)?;
        if flags & !IT_EP_KNOWN_FLAGS != 0 {
            return Err(Error::InvalidFlags);
        }
        // SAFETY: caller's contract.
        let attr = unsafe { get(ep_attr) }.map_err(|_| Error::InvalidEpAttr)?;
        let srq = if flags & IT_EP_SRQ != 0 {
            Some(handles::get_srq(attr.rc.srq)?)
        } else {
            None
        };
        let ep = Endpoint::create_rc(&pz, &req, &recv, &conn, rust_attrs(&attr), srq.as_ref())?;
        let (id, ia) = (ep.id(), pz.ia().id());
        // SAFETY: caller's contract.
        unsafe { handles::publish(Obj::Ep(ep), id, ia, ep_handle) }
    })
}

/// `it_ep_free`: a connected endpoint is reset (abortive close); its outstanding work is
/// discarded.
#[no_mangle]
pub extern "C" fn it_ep_free(ep_handle: Handle) -> ItStatus {
    status(|| {
        handles::get_ep(ep_handle)?;
        handles::remove_if(ep_handle, |_| Ok(()))
    })
}

/// `it_ep_query`: every member is filled, whatever the mask.
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_ep_query(
    ep_handle: Handle,
    _mask: u32,
    params: *mut EpParam,
) -> ItStatus {
    status(|| {
        let ep = handles::get_ep(ep_handle)?;
        let q = ep.query();
        let ib = ep.ia().transport() == Transport::InfiniBand;
        let mut p = EpParam::zeroed();
        p.ia = handles::ia(q.ia);
        p.spigot_id = q.spigot_id;
        p.ep_state = q.state as u32;
        p.service_type = IT_RC_SERVICE;
        p.dst_path = path_to(q.peer, None, ib);
        p.pz = handles::pz(q.pz);
        p.request_sevd = handles::evd(q.request_evd);
        p.recv_sevd = handles::evd(q.recv_evd);
        p.connect_sevd = handles::evd(q.connect_evd);
        p.attr = c_attrs(
            &q.attributes,
            q.srq.map_or(std::ptr::null_mut(), handles::srq),
        );
        // Atomics are enabled wherever the device has them (rxe0; not siw0).
        p.attr.rc.atomics_enable = ep.ia().atomic_support() as ItBool;
        // SAFETY: caller's contract.
        unsafe { put(params, p) }
    })
}

/// `it_ep_modify`: the RDMA Read/Write enables, and (before connecting) IRD and ORD;
/// other members `IT_ERR_INVALID_MASK`.
///
/// # Safety
/// `ep_attr` is null or readable.
#[no_mangle]
pub unsafe extern "C" fn it_ep_modify(
    ep_handle: Handle,
    mask: u32,
    ep_attr: *const EpAttributes,
) -> ItStatus {
    status(|| {
        let ep = handles::get_ep(ep_handle)?;
        let known = IT_EP_PARAM_RDMA_RD_ENABLE
            | IT_EP_PARAM_RDMA_WR_ENABLE
            | IT_EP_PARAM_MAX_IRD
            | IT_EP_PARAM_MAX_ORD;
        if mask == 0 || mask & !known != 0 {
            return Err(Error::InvalidMask);
        }
        // SAFETY: caller's contract.
        let a = unsafe { get(ep_attr)? };
        let on = |bit: u32| mask & bit != 0;
        ep.modify(&EpChange {
            rdma_read_enable: on(IT_EP_PARAM_RDMA_RD_ENABLE).then_some(a.rc.rdma_read_enable != 0),
            rdma_write_enable: on(IT_EP_PARAM_RDMA_WR_ENABLE)
                .then_some(a.rc.rdma_write_enable != 0),
            rdma_read_ird: on(IT_EP_PARAM_MAX_IRD).then_some(a.rc.rdma_read_ird),
            rdma_read_ord: on(IT_EP_PARAM_MAX_ORD).then_some(a.rc.rdma_read_ord),
        })
    })
}

/// The peer a path and connection qualifier name, as the IA's transport spells them.
fn peer_of(ep: &Endpoint, path: &Path, qual: &ConnQual) -> Result<SocketAddr> {
    // SAFETY: the union members are plain bytes valid for any content; the transport
    // says which one the caller filled.
    let ip = unsafe {
        match ep.ia().transport() {
            Transport::InfiniBand => IpAddr::from(path.u.ib.remote_port_gid.0).to_canonical(),
            Transport::IwarpTcp => match path.u.iwarp.ip_vers {
                IT_IP_VERS_IPV4 => IpAddr::from(path.u.iwarp.raddr.ipv4.0),
                IT_IP_VERS_IPV6 => IpAddr::from(path.u.iwarp.raddr.ipv6.0).to_canonical(),
                _ => return Err(Error::InvalidAddress),
            },
        }
    };
    Ok(SocketAddr::new(ip, remote_port(qual)?))
}

/// The port of a connection qualifier (network byte order in the structure).
fn port_of(qual: &ConnQual, lr_remote: bool) -> Result<u16> {
    // SAFETY: as in `peer_of`, `type_` says which member is filled.
    unsafe {
        match qual.type_ {
            IT_IANA_PORT => Ok(u16::from_be(qual.conn_qual.port)),
            IT_IANA_LR_PORT if lr_remote => Ok(u16::from_be(qual.conn_qual.lr_port.remote)),
            IT_IANA_LR_PORT => Ok(u16::from_be(qual.conn_qual.lr_port.local)),
            IT_IB_SERVICEID => {
                let id = u64::from_be(qual.conn_qual.serviceid);
                if id & !0xffff == RDMA_CM_TCP_SERVICE {
                    Ok(id as u16)
                } else {
                    Err(Error::InvalidConnQual)
                }
            }
            _ => Err(Error::InvalidConnQual),
        }
    }
}

fn remote_port(qual: &ConnQual) -> Result<u16> {
    port_of(qual, true)
}

/// `it_ep_connect`: two-way handshake only (`IT_ERR_INVALID_CN_EST_FLAGS` otherwise).
/// The peer is the path's remote address (`u.iwarp.raddr`, or `u.ib.remote_port_gid` on
/// InfiniBand/RoCE) at the qualifier's port.
///
/// # Safety
/// Pointers are null or readable; `private_data` holds `private_data_length` bytes.
#[no_mangle]
pub unsafe extern "C" fn it_ep_connect(
    ep_handle: Handle,
    path: *const Path,
    _conn_attr: *const std::ffi::c_void,
    connect_qual: *const ConnQual,
    cn_est_flags: u32,
    private_data: *const u8,
    private_data_length: usize,
) -> ItStatus {
    status(|| {
        let ep = handles::get_ep(ep_handle)?;
        if cn_est_flags & !IT_CONNECT_FLAG_TWO_WAY != 0 {
            return Err(Error::InvalidCnEstFlags);
        }
        // SAFETY: caller's contract.
        let (path, qual, pdata) = unsafe {
            (
                get(path).map_err(|_| Error::InvalidAddress)?,
                get(connect_qual).map_err(|_| Error::InvalidConnQual)?,
                slice(private_data, private_data_length)?,
            )
        };
        ep.connect(peer_of(&ep, &path, &qual)?, pdata)
    })
}

/// `it_ep_accept`
///
/// # Safety
/// `private_data` holds `private_data_length` bytes.
#[no_mangle]
pub unsafe extern "C" fn it_ep_accept(
    ep_handle: Handle,
    cn_est_id: u64,
    private_data: *const u8,
    private_data_length: usize,
) -> ItStatus {
    status(|| {
        let ep = handles::get_ep(ep_handle)?;
        // SAFETY: caller's contract.
        let pdata = unsafe { slice(private_data, private_data_length)? };
        ep.accept(CnEstId(cn_est_id), pdata)
    })
}

/// `it_reject`
///
/// # Safety
/// `private_data` holds `private_data_length` bytes.
#[no_mangle]
pub unsafe extern "C" fn it_reject(
    cn_est_id: u64,
    private_data: *const u8,
    private_data_length: usize,
) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let pdata = unsafe { slice(private_data, private_data_length)? };
        CnEstId(cn_est_id).reject(pdata)
    })
}

/// `it_ep_disconnect`: graceful (outstanding sends complete first); disconnect private
/// data is `IT_ERR_PDATA_NOT_SUPPORTED`.
#[no_mangle]
pub extern "C" fn it_ep_disconnect(
    ep_handle: Handle,
    _private_data: *const u8,
    private_data_length: usize,
) -> ItStatus {
    status(|| {
        let ep = handles::get_ep(ep_handle)?;
        if private_data_length > 0 {
            return Err(Error::PdataNotSupported);
        }
        ep.disconnect()
    })
}

/// krdma extension: abortive disconnect.
#[no_mangle]
pub extern "C" fn itx_ep_disconnect_abort(ep_handle: Handle) -> ItStatus {
    status(|| handles::get_ep(ep_handle)?.abort())
}

/// krdma extension: the private data length of the last connection event this thread
/// took.
#[no_mangle]
pub extern "C" fn itx_last_private_data_length() -> usize {
    crate::event::last_private_data_len()
}

/// `it_listen_create`: with `IT_LISTEN_CONN_QUAL_INPUT`, listen on the qualifier's port;
/// otherwise pick a port and return it in `conn_qual` (as `IT_IANA_PORT`).
///
/// # Safety
/// `conn_qual` is null or readable and writable; `listen_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_listen_create(
    ia_handle: Handle,
    spigot_id: usize,
    connect_evd: Handle,
    flags: u32,
    conn_qual: *mut ConnQual,
    listen_handle: *mut Handle,
) -> ItStatus {
    status(|| {
        let ia = handles::get_ia(ia_handle)?;
        let evd = match handles::get(connect_evd) {
            Some(Obj::Evd(e)) => e,
            Some(Obj::Aevd(_)) => return Err(Error::AevdNotAllowed),
            _ => return Err(Error::InvalidConnEvd),
        };
        let port = if flags & IT_LISTEN_CONN_QUAL_INPUT != 0 {
            // SAFETY: caller's contract.
            port_of(&unsafe { get(conn_qual)? }, false)?
        } else {
            0
        };
        let l = Listener::create(&ia, spigot_id, &evd, port)?;
        let id = l.id();
        let mut q = ConnQual::zeroed();
        q.type_ = IT_IANA_PORT;
        q.conn_qual.port = l.port().to_be();
        // SAFETY: caller's contract.
        unsafe {
            if flags & IT_LISTEN_CONN_QUAL_INPUT == 0 {
                put(conn_qual, q)?;
            }
        }
        // SAFETY: caller's contract.
        unsafe { handles::publish(Obj::Listen(l), id, ia.id(), listen_handle) }
    })
}

#[no_mangle]
pub extern "C" fn it_listen_free(listen_handle: Handle) -> ItStatus {
    status(|| {
        handles::get_listen(listen_handle)?;
        handles::remove_if(listen_handle, |_| Ok(()))
    })
}

/// `it_listen_query`
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_listen_query(
    listen_handle: Handle,
    _mask: u32,
    params: *mut ListenParam,
) -> ItStatus {
    status(|| {
        let q = handles::get_listen(listen_handle)?.query();
        let mut p = ListenParam::zeroed();
        p.ia_handle = handles::ia(q.ia);
        p.spigot_id = q.spigot_id;
        p.connect_evd = handles::evd(q.connect_evd);
        p.connect_qual.type_ = IT_IANA_PORT;
        p.connect_qual.conn_qual.port = q.port.to_be();
        // SAFETY: caller's contract.
        unsafe { put(params, p) }
    })
}
