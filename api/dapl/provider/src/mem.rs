//! `dat_pz_*`, `dat_lmr_*`, `dat_rmr_*` and `dat_srq_*`.

use crate::boundary::{array, call, get, put, put_opt};
use crate::handles::{self, Obj};
use crate::sys::*;
use krdma_dapl as dapl;
use krdma_dapl::{Error, Major, Minor};

pub unsafe extern "C" fn pz_create(ia_h: DAT_HANDLE, out: *mut DAT_HANDLE) -> DAT_RETURN {
    call("pz_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        if out.is_null() {
            return Err(crate::boundary::arg_error(2));
        }
        let pz = dapl::Pz::create(&ia)?;
        put(out, handles::insert(Obj::Pz(pz), ia.id(), ia_e.provider), 2)
    })
}

pub unsafe extern "C" fn pz_query(h: DAT_HANDLE, _mask: u32, out: *mut DAT_PZ_PARAM) -> DAT_RETURN {
    call("pz_query", || {
        let (e, _) = handles::pz(h)?;
        put(
            out,
            DAT_PZ_PARAM {
                ia_handle: handles::handle_of(e.ia),
            },
            3,
        )
    })
}

pub unsafe extern "C" fn pz_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("pz_free", || {
        let (_, pz) = handles::pz(h)?;
        // The handle's clone and ours; anything more is an LMR, RMR, EP or SRQ.
        if pz.users() > 1 {
            return Err(Error::new(Major::InvalidState, Minor::PzInUse));
        }
        handles::remove(h);
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn lmr_create(
    ia_h: DAT_HANDLE,
    mem_type: u32,
    region: DAT_REGION_DESCRIPTION,
    length: DAT_VLEN,
    pz_h: DAT_HANDLE,
    privs: u32,
    _va_type: u32,
    out: *mut DAT_HANDLE,
    lmr_context: *mut u32,
    rmr_context: *mut u32,
    reg_len: *mut DAT_VLEN,
    reg_addr: *mut DAT_VADDR,
) -> DAT_RETURN {
    call("lmr_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        let (_, pz) = handles::pz(pz_h)?;
        if pz.ia().id() != ia.id() {
            return Err(Error::handle(Minor::HandlePz));
        }
        let privs = dapl::MemPriv::from_bits(privs).ok_or(crate::boundary::arg_error(6))?;
        let addr = match mem_type {
            DAT_MEM_TYPE_VIRTUAL | DAT_MEM_TYPE_SHARED_VIRTUAL => region.for_va as *const u8,
            DAT_MEM_TYPE_LMR => {
                let (_, other) = handles::lmr(region.for_va)?;
                other.address() as *const u8
            }
            _ => return Err(crate::boundary::arg_error(2)),
        };
        if addr.is_null() {
            return Err(crate::boundary::arg_error(3));
        }
        let len = usize::try_from(length).map_err(|_| crate::boundary::arg_error(4))?;
        if out.is_null() {
            return Err(crate::boundary::arg_error(8));
        }
        // SAFETY: DAT's contract: the consumer keeps the memory it registers mapped
        // until it frees the LMR; the kAL checks the range is mapped before the device
        // may touch it, and nothing in Rust references it.
        let lmr = unsafe { dapl::Lmr::create_virtual(&pz, addr, len, privs) }?;
        put_opt(lmr_context, lmr.context());
        put_opt(rmr_context, lmr.rmr_context());
        put_opt(reg_len, lmr.length());
        put_opt(reg_addr, lmr.address());
        put(
            out,
            handles::insert(Obj::Lmr(lmr), ia.id(), ia_e.provider),
            8,
        )
    })
}

pub unsafe extern "C" fn lmr_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_LMR_PARAM,
) -> DAT_RETURN {
    call("lmr_query", || {
        let (e, lmr) = handles::lmr(h)?;
        let param = DAT_LMR_PARAM {
            ia_handle: handles::handle_of(e.ia),
            mem_type: DAT_MEM_TYPE_VIRTUAL,
            region_desc: DAT_REGION_DESCRIPTION {
                for_va: lmr.address() as *mut _,
                shared_memory_id: std::ptr::null_mut(),
            },
            length: lmr.length(),
            pz_handle: handles::handle_of(lmr.pz().id()),
            mem_priv: lmr.privileges().bits(),
            va_type: 0,
            lmr_context: lmr.context(),
            rmr_context: lmr.rmr_context(),
            registered_size: lmr.length(),
            registered_address: lmr.address(),
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn lmr_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("lmr_free", || {
        let (_, lmr) = handles::lmr(h)?;
        if lmr.bound_rmrs() > 0 {
            return Err(Error::new(Major::InvalidState, Minor::LmrInUse));
        }
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn lmr_sync_rdma(
    ia_h: DAT_HANDLE,
    iov: *const DAT_LMR_TRIPLET,
    n: DAT_VLEN,
) -> DAT_RETURN {
    call("lmr_sync_rdma", || {
        handles::ia(ia_h)?;
        let n = i32::try_from(n).map_err(|_| crate::boundary::arg_error(3))?;
        // Memory is coherent: the segments are checked, nothing else is needed.
        array(iov, n, 2).map(drop)
    })
}

pub unsafe extern "C" fn rmr_create(pz_h: DAT_HANDLE, out: *mut DAT_HANDLE) -> DAT_RETURN {
    call("rmr_create", || {
        let (pz_e, pz) = handles::pz(pz_h)?;
        if out.is_null() {
            return Err(crate::boundary::arg_error(2));
        }
        let rmr = dapl::Rmr::create(&pz)?;
        put(
            out,
            handles::insert(Obj::Rmr(rmr), pz_e.ia, pz_e.provider),
            2,
        )
    })
}

pub unsafe extern "C" fn rmr_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_RMR_PARAM,
) -> DAT_RETURN {
    call("rmr_query", || {
        let (e, rmr) = handles::rmr(h)?;
        let q = rmr.query();
        let param = DAT_RMR_PARAM {
            ia_handle: handles::handle_of(e.ia),
            pz_handle: handles::handle_of(rmr.pz().id()),
            lmr_triplet: DAT_LMR_TRIPLET {
                virtual_address: q.lmr_triplet.address,
                segment_length: q.lmr_triplet.length,
                lmr_context: q.lmr_triplet.lmr_context,
            },
            mem_priv: q.privileges.bits(),
            rmr_context: q.rmr_context,
            rmr_scope: 0,
            va_type: 0,
        };
        put(out, param, 3)
    })
}

#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn rmr_bind(
    h: DAT_HANDLE,
    lmr_h: DAT_HANDLE,
    triplet: *const DAT_LMR_TRIPLET,
    privs: u32,
    _va_type: u32,
    ep_h: DAT_HANDLE,
    cookie: DAT_CONTEXT,
    flags: u32,
    context: *mut u32,
) -> DAT_RETURN {
    call("rmr_bind", || {
        let (_, rmr) = handles::rmr(h)?;
        let (_, ep) = handles::ep(ep_h)?;
        let t = get(triplet, 3)?;
        let privs = dapl::MemPriv::from_bits(privs).ok_or(crate::boundary::arg_error(4))?;
        let flags = dapl::Completion::from_bits(flags).ok_or(crate::boundary::arg_error(8))?;
        if t.segment_length == 0 {
            rmr.unbind(&ep, cookie, flags)?;
            put_opt(context, 0);
            return Ok(());
        }
        let (_, lmr) = handles::lmr(lmr_h)?;
        let range = dapl::LmrTriplet {
            lmr_context: t.lmr_context,
            address: t.virtual_address,
            length: t.segment_length,
        };
        let ctx = rmr.bind(&lmr, range, privs, &ep, cookie, flags)?;
        put(context, ctx, 9)
    })
}

pub unsafe extern "C" fn rmr_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("rmr_free", || {
        handles::rmr(h)?;
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn srq_create(
    ia_h: DAT_HANDLE,
    pz_h: DAT_HANDLE,
    attr: *mut DAT_SRQ_ATTR,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("srq_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        let (_, pz) = handles::pz(pz_h)?;
        let a = get(attr as *const DAT_SRQ_ATTR, 3)?;
        if a.max_recv_dtos <= 0 || a.max_recv_iov < 0 {
            return Err(crate::boundary::arg_error(3));
        }
        if out.is_null() {
            return Err(crate::boundary::arg_error(4));
        }
        let srq = dapl::Srq::create(
            &pz,
            a.max_recv_dtos as usize,
            a.max_recv_iov.max(1) as usize,
        )?;
        if a.low_watermark > 0 {
            srq.set_low_watermark(a.low_watermark as usize)?;
        }
        put(
            out,
            handles::insert(Obj::Srq(srq), ia.id(), ia_e.provider),
            4,
        )
    })
}

pub unsafe extern "C" fn srq_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("srq_free", || {
        let (_, srq) = handles::srq(h)?;
        if srq.users() > 1 {
            return Err(Error::new(Major::InvalidState, Minor::SrqInUse));
        }
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn srq_post_recv(
    h: DAT_HANDLE,
    n: DAT_COUNT,
    iov: *mut DAT_LMR_TRIPLET,
    cookie: DAT_CONTEXT,
) -> DAT_RETURN {
    call("srq_post_recv", || {
        let (_, srq) = handles::srq(h)?;
        let iov: Vec<_> = array(iov, n, 3)?
            .iter()
            .map(|t| dapl::LmrTriplet {
                lmr_context: t.lmr_context,
                address: t.virtual_address,
                length: t.segment_length,
            })
            .collect();
        srq.post_recv(&iov, cookie)
    })
}

pub unsafe extern "C" fn srq_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_SRQ_PARAM,
) -> DAT_RETURN {
    call("srq_query", || {
        let (e, srq) = handles::srq(h)?;
        let (dtos, iov) = srq.limits();
        let param = DAT_SRQ_PARAM {
            ia_handle: handles::handle_of(e.ia),
            srq_state: DAT_SRQ_STATE_OPERATIONAL,
            pz_handle: handles::handle_of(srq.pz().id()),
            max_recv_dtos: dtos as DAT_COUNT,
            max_recv_iov: iov as DAT_COUNT,
            low_watermark: 0,
            available_dto_count: -2, // DAT_VALUE_UNKNOWN
            outstanding_dto_count: -2,
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn srq_resize(h: DAT_HANDLE, n: DAT_COUNT) -> DAT_RETURN {
    call("srq_resize", || {
        let (_, srq) = handles::srq(h)?;
        if n > 0 && n as usize <= srq.limits().0 {
            Ok(())
        } else {
            Err(Error::not_implemented())
        }
    })
}

pub unsafe extern "C" fn srq_set_lw(h: DAT_HANDLE, lw: DAT_COUNT) -> DAT_RETURN {
    call("srq_set_lw", || {
        let (_, srq) = handles::srq(h)?;
        let lw = usize::try_from(lw).map_err(|_| crate::boundary::arg_error(2))?;
        srq.set_low_watermark(lw)
    })
}
