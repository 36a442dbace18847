//! `dat_psp_*`, `dat_rsp_*`, `dat_cr_*` (and `dat_csp_*`, not supported).

use crate::boundary::{bytes, call, put};
use crate::handles::{self, Obj};
use crate::sys::*;
use krdma_dapl as dapl;
use krdma_dapl::{Error, Major, Minor};
use std::ffi::c_void;

fn cr_evd(h: DAT_HANDLE) -> dapl::Result<dapl::Evd> {
    handles::evd(h)
        .map(|(_, e)| e)
        .map_err(|_| Error::handle(Minor::HandleEvdCr))
}

pub unsafe extern "C" fn psp_create(
    ia_h: DAT_HANDLE,
    conn_qual: u64,
    evd_h: DAT_HANDLE,
    flags: u32,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("psp_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        let evd = cr_evd(evd_h)?;
        if flags & DAT_PSP_PROVIDER_FLAG != 0 {
            return Err(Error::of(Major::ModelNotSupported));
        }
        if out.is_null() {
            return Err(crate::boundary::arg_error(5));
        }
        let psp = dapl::Psp::create(&ia, conn_qual, &evd)?;
        put(
            out,
            handles::insert(Obj::Psp(psp), ia.id(), ia_e.provider),
            5,
        )
    })
}

pub unsafe extern "C" fn psp_create_any(
    ia_h: DAT_HANDLE,
    conn_qual: *mut u64,
    evd_h: DAT_HANDLE,
    flags: u32,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("psp_create_any", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        let evd = cr_evd(evd_h)?;
        if flags & DAT_PSP_PROVIDER_FLAG != 0 {
            return Err(Error::of(Major::ModelNotSupported));
        }
        if conn_qual.is_null() || out.is_null() {
            return Err(crate::boundary::arg_error(if conn_qual.is_null() {
                2
            } else {
                5
            }));
        }
        let psp = dapl::Psp::create_any(&ia, &evd)?;
        put(conn_qual, psp.conn_qual(), 2)?;
        put(
            out,
            handles::insert(Obj::Psp(psp), ia.id(), ia_e.provider),
            5,
        )
    })
}

pub unsafe extern "C" fn psp_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_PSP_PARAM,
) -> DAT_RETURN {
    call("psp_query", || {
        let (e, psp) = handles::psp(h)?;
        let param = DAT_PSP_PARAM {
            ia_handle: handles::handle_of(e.ia),
            conn_qual: psp.conn_qual(),
            evd_handle: handles::handle_of(psp.evd().id()),
            psp_flags: 0,
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn psp_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("psp_free", || {
        handles::psp(h)?;
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn rsp_create(
    ia_h: DAT_HANDLE,
    conn_qual: u64,
    ep_h: DAT_HANDLE,
    evd_h: DAT_HANDLE,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("rsp_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        let (_, ep) = handles::ep(ep_h)?;
        let evd = cr_evd(evd_h)?;
        if out.is_null() {
            return Err(crate::boundary::arg_error(5));
        }
        let rsp = dapl::Rsp::create(&ia, conn_qual, &ep, &evd)?;
        put(
            out,
            handles::insert(Obj::Rsp(rsp), ia.id(), ia_e.provider),
            5,
        )
    })
}

pub unsafe extern "C" fn rsp_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_RSP_PARAM,
) -> DAT_RETURN {
    call("rsp_query", || {
        let (e, rsp) = handles::rsp(h)?;
        let param = DAT_RSP_PARAM {
            ia_handle: handles::handle_of(e.ia),
            conn_qual: rsp.conn_qual(),
            evd_handle: handles::handle_of(rsp.evd().id()),
            ep_handle: handles::handle_of(rsp.ep().id()),
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn rsp_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("rsp_free", || {
        handles::rsp(h)?;
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn cr_query(h: DAT_HANDLE, _mask: u32, out: *mut DAT_CR_PARAM) -> DAT_RETURN {
    call("cr_query", || {
        let (e, cr) = handles::cr(h)?;
        let mut keep = e.keep.lock();
        let remote = match cr.remote() {
            Some(a) => &mut **keep
                .remote_addr
                .insert(crate::ia::sockaddr(a.ip(), a.port())) as *mut _
                as SockAddr,
            None => std::ptr::null_mut(),
        };
        let param = DAT_CR_PARAM {
            remote_ia_address_ptr: remote,
            remote_port_qual: cr.remote().map_or(0, |a| a.port() as u64),
            private_data_size: cr.private_data().len() as DAT_COUNT,
            // The Cr object owns the bytes for as long as the handle lives.
            private_data: cr.private_data().as_ptr() as *mut c_void,
            local_ep_handle: cr
                .local_ep()
                .map_or(std::ptr::null_mut(), |ep| handles::handle_of(ep.id())),
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn cr_accept(
    h: DAT_HANDLE,
    ep_h: DAT_HANDLE,
    n: DAT_COUNT,
    pdata: *const c_void,
) -> DAT_RETURN {
    call("cr_accept", || {
        let (_, cr) = handles::cr(h)?;
        let ep = if ep_h.is_null() {
            None
        } else {
            Some(handles::ep(ep_h)?.1)
        };
        let data = bytes(pdata, n, 4)?;
        cr.accept(ep.as_ref(), data)?;
        // An answered request's handle is gone (DAT: accept destroys the CR).
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn cr_reject(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    pdata: *const c_void,
) -> DAT_RETURN {
    call("cr_reject", || {
        let (_, cr) = handles::cr(h)?;
        let data = bytes(pdata, n, 3)?;
        cr.reject(data)?;
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn cr_handoff(h: DAT_HANDLE, _qual: u64) -> DAT_RETURN {
    call("cr_handoff", || {
        handles::cr(h)?;
        Err(Error::not_implemented())
    })
}

pub unsafe extern "C" fn csp_create(
    ia_h: DAT_HANDLE,
    _comm: *mut DAT_COMM,
    _addr: SockAddr,
    _evd: DAT_HANDLE,
    _out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("csp_create", || {
        handles::ia(ia_h)?;
        Err(Error::of(Major::CommNotSupported))
    })
}

pub unsafe extern "C" fn csp_query(_h: DAT_HANDLE, _mask: u32, _out: *mut c_void) -> DAT_RETURN {
    call("csp_query", || Err(Error::handle(Minor::HandleCsp)))
}

pub unsafe extern "C" fn csp_free(_h: DAT_HANDLE) -> DAT_RETURN {
    call("csp_free", || Err(Error::handle(Minor::HandleCsp)))
}
