//! Protection zones, LMRs, RMRs and SRQs.

use crate::ffi::{get, put, put_opt, slice, status, usable};
use crate::handles::{self, Obj};
use crate::post::{dto_flags, segments};
use crate::types::*;
use bytemuck::Zeroable;
use krdma_itapi::{Error, Lmr, MemPriv, Pz, Result, Rmr, RmrType, Srq};
use std::ffi::c_void;

const IT_ADDR_MODE_ABSOLUTE: u32 = 0;
const IT_LMR_FLAG_SHARED: u32 = 0x2;
const IT_LMR_KNOWN_FLAGS: u32 = 0x1 | IT_LMR_FLAG_SHARED | 0x4 | 0x8;
const IT_RMR_TYPE_DEFAULT: u32 = 0;
const IT_RMR_TYPE_NARROW: u32 = 1;
const IT_SRQ_PARAM_LOW_WATERMARK: u32 = 0x20;

/// `it_pz_create`
///
/// # Safety
/// `pz_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_pz_create(ia_handle: Handle, pz_handle: *mut Handle) -> ItStatus {
    status(|| {
        let ia = handles::get_ia(ia_handle)?;
        let pz = Pz::create(&ia)?;
        let id = pz.id();
        // SAFETY: caller's contract.
        unsafe { handles::publish(Obj::Pz(pz), id, ia.id(), pz_handle) }
    })
}

/// `it_pz_free`: `IT_ERR_PZ_BUSY` while endpoints, LMRs, RMRs or SRQs use it.
#[no_mangle]
pub extern "C" fn it_pz_free(pz_handle: Handle) -> ItStatus {
    status(|| {
        handles::get_pz(pz_handle)?;
        handles::remove_unused(pz_handle, Error::PzBusy)
    })
}

/// `it_pz_query`
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_pz_query(
    pz_handle: Handle,
    _mask: u32,
    params: *mut PzParam,
) -> ItStatus {
    status(|| {
        let pz = handles::get_pz(pz_handle)?;
        // SAFETY: caller's contract.
        unsafe {
            put(
                params,
                PzParam {
                    ia: handles::ia(pz.ia().id()),
                },
            )
        }
    })
}

fn privs(p: u32) -> Result<MemPriv> {
    MemPriv::from_bits(p).ok_or(Error::InvalidPrivs)
}

/// The common body of the `it_lmr_create*` versions.
///
/// # Safety
/// `addr` is the consumer's memory of `length` bytes (checked mapped by the kAL);
/// `lmr_handle` and `rmr_context` are null or writable.
#[allow(clippy::too_many_arguments)]
unsafe fn lmr_create(
    pz_handle: Handle,
    addr: *mut c_void,
    length: u64,
    addr_mode: u32,
    privileges: u32,
    flags: u32,
    lmr_handle: *mut Handle,
    rmr_context: *mut u64,
) -> ItStatus {
    status(|| {
        let pz = handles::get_pz(pz_handle)?;
        if !rmr_context.is_null() {
            usable(rmr_context)?;
        }
        if addr_mode != IT_ADDR_MODE_ABSOLUTE {
            return Err(Error::InvalidAddrMode);
        }
        if flags & !IT_LMR_KNOWN_FLAGS != 0 {
            return Err(Error::InvalidFlags);
        }
        if flags & IT_LMR_FLAG_SHARED != 0 {
            return Err(Error::OpNotSupported);
        }
        let len = usize::try_from(length).map_err(|_| Error::InvalidLength)?;
        // SAFETY: the consumer's memory, registered on its behalf: the kAL refuses ranges
        // that are not mapped; the consumer keeps it mapped while the LMR lives (the
        // standard's contract for it_lmr_create).
        let lmr = unsafe { Lmr::create_raw(&pz, addr as *const u8, len, privs(privileges)?)? };
        let context = lmr.rmr_context().unwrap_or(0);
        let (id, ia) = (lmr.id(), pz.ia().id());
        // SAFETY: caller's contract (`rmr_context` was checked first).
        unsafe {
            handles::publish(Obj::Lmr(lmr), id, ia, lmr_handle)?;
            put_opt(rmr_context, context)
        }
    })
}

/// `it_lmr_create10` (v1.0 signature; `it_lmr_create` by default)
///
/// # Safety
/// See `it_lmr_create21`.
#[no_mangle]
pub unsafe extern "C" fn it_lmr_create10(
    pz_handle: Handle,
    addr: *mut c_void,
    length: u64,
    privs: u32,
    flags: u32,
    _shared_id: u32,
    lmr_handle: *mut Handle,
    rmr_context: *mut u64,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe {
        lmr_create(
            pz_handle,
            addr,
            length,
            IT_ADDR_MODE_ABSOLUTE,
            privs,
            flags,
            lmr_handle,
            rmr_context,
        )
    }
}

/// `it_lmr_create20`
///
/// # Safety
/// See `it_lmr_create21`.
#[no_mangle]
pub unsafe extern "C" fn it_lmr_create20(
    pz_handle: Handle,
    addr: *mut c_void,
    length: u64,
    addr_mode: u32,
    privs: u32,
    flags: u32,
    _shared_id: u32,
    lmr_handle: *mut Handle,
    rmr_context: *mut u64,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe {
        lmr_create(
            pz_handle,
            addr,
            length,
            addr_mode,
            privs,
            flags,
            lmr_handle,
            rmr_context,
        )
    }
}

/// `it_lmr_create21`: virtual addresses only (an I/O buffer list is
/// `IT_ERR_OP_NOT_SUPPORTED`), absolute addressing only.
///
/// # Safety
/// `addr` is `length` bytes of this process that stay mapped while the LMR lives;
/// `lmr_handle` and `rmr_context` are null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_lmr_create21(
    pz_handle: Handle,
    addr: *mut c_void,
    iobl: *const c_void,
    length: u64,
    addr_mode: u32,
    privs: u32,
    flags: u32,
    _shared_id: u32,
    lmr_handle: *mut Handle,
    rmr_context: *mut u64,
) -> ItStatus {
    if !iobl.is_null() {
        return Error::OpNotSupported.code();
    }
    // SAFETY: passed on.
    unsafe {
        lmr_create(
            pz_handle,
            addr,
            length,
            addr_mode,
            privs,
            flags,
            lmr_handle,
            rmr_context,
        )
    }
}

/// `it_lmr_free`: `IT_ERR_LMR_BUSY` while an RMR is linked onto it.
#[no_mangle]
pub extern "C" fn it_lmr_free(lmr_handle: Handle) -> ItStatus {
    status(|| {
        handles::get_lmr(lmr_handle)?;
        handles::remove_unused(lmr_handle, Error::LmrBusy)
    })
}

/// `it_lmr_query`
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_lmr_query(
    lmr_handle: Handle,
    _mask: u32,
    params: *mut LmrParam,
) -> ItStatus {
    status(|| {
        let lmr = handles::get_lmr(lmr_handle)?;
        let mut p = LmrParam::zeroed();
        p.ia = handles::ia(lmr.pz().ia().id());
        p.pz = handles::pz(lmr.pz().id());
        p.addr = lmr.addr() as usize as *mut c_void;
        p.length = lmr.len();
        p.privs = lmr.privs().bits();
        p.flags = 0x1; // IT_LMR_FLAG_NONE
        p.rmr_context = lmr.rmr_context().unwrap_or(0);
        p.actual_addr = p.addr;
        p.actual_length = p.length;
        p.addr_mode = IT_ADDR_MODE_ABSOLUTE;
        p.linked = IT_TRUE;
        // SAFETY: caller's contract.
        unsafe { put(params, p) }
    })
}

/// `it_lmr_flush_to_mem` / `it_lmr_refresh_from_mem`: memory is coherent; the
/// segments are checked and nothing else is done.
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
unsafe fn lmr_sync(local_segments: *const LmrTriplet, num_segments: usize) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let t = unsafe { slice(local_segments, num_segments)? };
        segments(t).map(drop)
    })
}

/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_lmr_flush_to_mem(
    local_segments: *const LmrTriplet,
    num_segments: usize,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe { lmr_sync(local_segments, num_segments) }
}

/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_lmr_refresh_from_mem(
    local_segments: *const LmrTriplet,
    num_segments: usize,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe { lmr_sync(local_segments, num_segments) }
}

#[no_mangle]
pub extern "C" fn it_make_rdma_addr_absolute(addr: *mut c_void) -> u64 {
    addr as usize as u64
}

#[no_mangle]
pub extern "C" fn it_make_rdma_addr_relative(offset: u64) -> u64 {
    offset
}

/// # Safety
/// `rmr_handle` is null or writable.
unsafe fn rmr_create(pz_handle: Handle, kind: u32, rmr_handle: *mut Handle) -> ItStatus {
    status(|| {
        let pz = handles::get_pz(pz_handle)?;
        let kind = match kind {
            IT_RMR_TYPE_DEFAULT | IT_RMR_TYPE_NARROW => RmrType::Narrow,
            _ => return Err(Error::InvalidRmrType),
        };
        let rmr = Rmr::create(&pz, kind)?;
        let (id, ia) = (rmr.id(), pz.ia().id());
        // SAFETY: caller's contract.
        unsafe { handles::publish(Obj::Rmr(rmr), id, ia, rmr_handle) }
    })
}

/// `it_rmr_create10`
///
/// # Safety
/// `rmr_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_rmr_create10(pz_handle: Handle, rmr_handle: *mut Handle) -> ItStatus {
    // SAFETY: passed on.
    unsafe { rmr_create(pz_handle, IT_RMR_TYPE_DEFAULT, rmr_handle) }
}

/// `it_rmr_create20`: narrow RMRs (memory windows bound through an endpoint).
///
/// # Safety
/// `rmr_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_rmr_create20(
    pz_handle: Handle,
    rmr_type: u32,
    rmr_handle: *mut Handle,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe { rmr_create(pz_handle, rmr_type, rmr_handle) }
}

#[no_mangle]
pub extern "C" fn it_rmr_free(rmr_handle: Handle) -> ItStatus {
    status(|| {
        handles::get_rmr(rmr_handle)?;
        handles::remove_if(rmr_handle, |_| Ok(()))
    })
}

/// `it_rmr_link` (and the v1.0 `it_rmr_bind10`): absolute addressing only.
///
/// # Safety
/// `rmr_context` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_rmr_link(
    rmr_handle: Handle,
    lmr_handle: Handle,
    addr: *mut c_void,
    length: u64,
    addr_mode: u32,
    privileges: u32,
    ep_handle: Handle,
    cookie: u64,
    flags: u32,
    rmr_context: *mut u64,
) -> ItStatus {
    status(|| {
        let rmr = handles::get_rmr(rmr_handle)?;
        let lmr = handles::get_lmr(lmr_handle)?;
        let ep = handles::get_ep(ep_handle)?;
        if addr_mode != IT_ADDR_MODE_ABSOLUTE {
            return Err(Error::InvalidAddrMode);
        }
        let target = rmr.link(
            &lmr,
            addr as usize as u64,
            length,
            privs(privileges)?,
            &ep,
            cookie,
            dto_flags(flags)?,
        )?;
        // SAFETY: caller's contract.
        unsafe { put_opt(rmr_context, target.rmr_context) }
    })
}

/// `it_rmr_bind10`
///
/// # Safety
/// As `it_rmr_link`.
#[no_mangle]
pub unsafe extern "C" fn it_rmr_bind10(
    rmr_handle: Handle,
    lmr_handle: Handle,
    addr: *mut c_void,
    length: u64,
    privileges: u32,
    ep_handle: Handle,
    cookie: u64,
    flags: u32,
    rmr_context: *mut u64,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe {
        it_rmr_link(
            rmr_handle,
            lmr_handle,
            addr,
            length,
            IT_ADDR_MODE_ABSOLUTE,
            privileges,
            ep_handle,
            cookie,
            flags,
            rmr_context,
        )
    }
}

#[no_mangle]
pub extern "C" fn it_rmr_unlink(
    rmr_handle: Handle,
    ep_handle: Handle,
    cookie: u64,
    flags: u32,
) -> ItStatus {
    status(|| {
        let rmr = handles::get_rmr(rmr_handle)?;
        let ep = handles::get_ep(ep_handle)?;
        rmr.unlink(&ep, cookie, dto_flags(flags)?)
    })
}

/// `it_rmr_query`
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_rmr_query(
    rmr_handle: Handle,
    _mask: u32,
    params: *mut RmrParam,
) -> ItStatus {
    status(|| {
        let q = handles::get_rmr(rmr_handle)?.query();
        let mut p = RmrParam::zeroed();
        p.ia = handles::ia(q.ia);
        p.pz = handles::pz(q.pz);
        p.linked = q.linked as ItBool;
        p.lmr = q.lmr.map_or(std::ptr::null_mut(), handles::lmr);
        p.addr = q.addr as usize as *mut c_void;
        p.length = q.length;
        p.privs = q.privs.bits();
        p.rmr_context = q.rmr_context;
        p.type_ = IT_RMR_TYPE_NARROW;
        p.addr_mode = IT_ADDR_MODE_ABSOLUTE;
        // SAFETY: caller's contract.
        unsafe { put(params, p) }
    })
}

/// `it_srq_create`
///
/// # Safety
/// `srq_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_srq_create(
    pz_handle: Handle,
    max_recv_segments: usize,
    max_recv_dtos: usize,
    srq_handle: *mut Handle,
) -> ItStatus {
    status(|| {
        let pz = handles::get_pz(pz_handle)?;
        let srq = Srq::create(&pz, max_recv_segments, max_recv_dtos)?;
        let (id, ia) = (srq.id(), pz.ia().id());
        // SAFETY: caller's contract.
        unsafe { handles::publish(Obj::Srq(srq), id, ia, srq_handle) }
    })
}

/// `it_srq_free`: `IT_ERR_SRQ_BUSY` while endpoints use it.
#[no_mangle]
pub extern "C" fn it_srq_free(srq_handle: Handle) -> ItStatus {
    status(|| {
        handles::get_srq(srq_handle)?;
        handles::remove_unused(srq_handle, Error::SrqBusy)
    })
}

/// `it_srq_query`
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_srq_query(
    srq_handle: Handle,
    _mask: u32,
    params: *mut SrqParam,
) -> ItStatus {
    status(|| {
        let q = handles::get_srq(srq_handle)?.query()?;
        let p = SrqParam {
            ia: handles::ia(q.ia),
            pz: handles::pz(q.pz),
            max_recv_dtos: q.max_recv_dtos,
            max_recv_segs: q.max_recv_segments,
            low_watermark: q.low_watermark,
        };
        // SAFETY: caller's contract.
        unsafe { put(params, p) }
    })
}

/// `it_srq_modify`: the low watermark only (the SRQ cannot be resized).
///
/// # Safety
/// `params` is null or readable.
#[no_mangle]
pub unsafe extern "C" fn it_srq_modify(
    srq_handle: Handle,
    mask: u32,
    params: *const SrqParam,
) -> ItStatus {
    status(|| {
        let srq = handles::get_srq(srq_handle)?;
        if mask != IT_SRQ_PARAM_LOW_WATERMARK {
            return Err(Error::InvalidMask);
        }
        // SAFETY: caller's contract.
        let p = unsafe { get(params)? };
        srq.set_low_watermark(p.low_watermark)
    })
}
