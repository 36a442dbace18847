//! Data transfer: `it_post_*`.

use crate::ffi::{slice, status};
use crate::handles::{self, Obj};
use crate::types::*;
use krdma_itapi::{AtomicOp, DtoFlags, Endpoint, Error, RdmaAddr, Result, Segment};

/// krdma's `ITX_INLINE_FLAG`.
const ITX_INLINE_FLAG: u32 = 0x80;

/// The DTO flags of a C call (the inline extension flag excluded).
pub fn dto_flags(f: u32) -> Result<DtoFlags> {
    DtoFlags::from_bits(f & !ITX_INLINE_FLAG).ok_or(Error::InvalidDtoFlags)
}

/// Triplets as segments: each must lie inside its live LMR (`IT_ERR_INVALID_LMR` for a
/// bad handle, `IT_ERR_RANGE` outside the region).
pub fn segments(t: &[LmrTriplet]) -> Result<Vec<Segment>> {
    t.iter()
        .map(|t| handles::get_lmr(t.lmr)?.segment_at(t.addr, t.length))
        .collect()
}

/// The remote target of an RDMA call.
fn remote(rdma_addr: u64, rmr_context: u64) -> RdmaAddr {
    RdmaAddr {
        addr: rdma_addr,
        rmr_context,
    }
}

/// The bytes of validated segments, copied now (for inline sends).
fn gather(segs: &[Segment]) -> Vec<u8> {
    let total = segs.iter().map(|s| s.len() as usize).sum();
    let mut data = vec![0u8; total];
    let mut at = 0;
    for s in segs {
        let len = s.len() as usize;
        // SAFETY: `segments` checked that the bytes lie inside a live LMR; registration
        // checked they are mapped and readable in this process, and the consumer keeps
        // them so while the LMR lives (the contract of it_lmr_create). A raw copy: no
        // reference is made to memory the device may be writing. `data` has room for
        // `total` bytes, `at + len <= total`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                s.addr() as usize as *const u8,
                data.as_mut_ptr().add(at),
                len,
            )
        };
        at += len;
    }
    data
}

/// The endpoint and segments of a post call.
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
unsafe fn prepare(
    ep_handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
) -> Result<(Endpoint, Vec<Segment>)> {
    let ep = handles::get_ep(ep_handle)?;
    // SAFETY: caller's contract.
    let t = unsafe { slice(local_segments, num_segments)? };
    if t.len() > krdma_itapi::MAX_SEGMENTS {
        return Err(Error::InvalidNumSegments);
    }
    Ok((ep, segments(t)?))
}

/// `it_post_send`; with `ITX_INLINE_FLAG` the payload is copied at post time.
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_post_send(
    ep_handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
    cookie: u64,
    flags: u32,
) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let (ep, segs) = unsafe { prepare(ep_handle, local_segments, num_segments)? };
        let f = dto_flags(flags)?;
        if flags & ITX_INLINE_FLAG != 0 {
            ep.post_send_inline(&gather(&segs), cookie, f)
        } else {
            ep.post_send(&segs, cookie, f)
        }
    })
}

/// `it_post_send_and_unlink`: a send that invalidates `rmr_context` at the peer.
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_post_send_and_unlink(
    ep_handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
    cookie: u64,
    flags: u32,
    rmr_context: u64,
) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let (ep, segs) = unsafe { prepare(ep_handle, local_segments, num_segments)? };
        ep.post_send_and_unlink(&segs, cookie, dto_flags(flags)?, rmr_context)
    })
}

/// `it_post_recv`: to an endpoint or an SRQ.
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_post_recv(
    handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
    cookie: u64,
    flags: u32,
) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let t = unsafe { slice(local_segments, num_segments)? };
        let segs = segments(t)?;
        let f = dto_flags(flags)?;
        match handles::get(handle) {
            Some(Obj::Ep(ep)) => ep.post_recv(&segs, cookie, f),
            Some(Obj::Srq(srq)) => srq.post_recv(&segs, cookie, f),
            _ => Err(Error::InvalidHandle),
        }
    })
}

/// The calls on remote memory: `op` is the endpoint's read, write or atomic.
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[allow(clippy::too_many_arguments)]
unsafe fn rdma(
    op: impl FnOnce(&Endpoint, &[Segment], u64, DtoFlags, RdmaAddr) -> Result<()>,
    ep_handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
    cookie: u64,
    flags: u32,
    rdma_addr: u64,
    rmr_context: u64,
) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let (ep, segs) = unsafe { prepare(ep_handle, local_segments, num_segments)? };
        op(
            &ep,
            &segs,
            cookie,
            dto_flags(flags)?,
            remote(rdma_addr, rmr_context),
        )
    })
}

/// `it_post_rdma_read`
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_post_rdma_read(
    ep_handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
    cookie: u64,
    flags: u32,
    rdma_addr: u64,
    rmr_context: u64,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe {
        rdma(
            Endpoint::post_rdma_read,
            ep_handle,
            local_segments,
            num_segments,
            cookie,
            flags,
            rdma_addr,
            rmr_context,
        )
    }
}

/// `it_post_rdma_write`
///
/// # Safety
/// `local_segments` holds `num_segments` triplets.
#[no_mangle]
pub unsafe extern "C" fn it_post_rdma_write(
    ep_handle: Handle,
    local_segments: *const LmrTriplet,
    num_segments: usize,
    cookie: u64,
    flags: u32,
    rdma_addr: u64,
    rmr_context: u64,
) -> ItStatus {
    // SAFETY: passed on.
    unsafe {
        rdma(
            Endpoint::post_rdma_write,
            ep_handle,
            local_segments,
            num_segments,
            cookie,
            flags,
            rdma_addr,
            rmr_context,
        )
    }
}

const IT_COMPARE_AND_SWAP: u32 = 0;
const IT_FETCH_AND_ADD: u32 = 1;

/// `it_post_atomic`: where the adapter has atomics (`atomic_support`; rxe0 does);
/// `IT_ERR_OP_NOT_SUPPORTED` otherwise. `result` is one 8-byte triplet that receives the
/// remote value found before the operation.
///
/// # Safety
/// `result` is null or readable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn it_post_atomic(
    ep_handle: Handle,
    op: u32,
    swap_or_add: u64,
    compare: u64,
    result: *const LmrTriplet,
    cookie: u64,
    flags: u32,
    rdma_addr: u64,
    rmr_context: u64,
) -> ItStatus {
    let op = match op {
        IT_COMPARE_AND_SWAP => Ok(AtomicOp::CompareAndSwap {
            compare,
            swap: swap_or_add,
        }),
        IT_FETCH_AND_ADD => Ok(AtomicOp::FetchAndAdd { add: swap_or_add }),
        _ => Err(Error::InvalidAtomicOp),
    };
    let atomic = |ep: &Endpoint, segs: &[Segment], cookie, flags, at| {
        ep.post_atomic(op?, &segs[0], cookie, flags, at)
    };
    // SAFETY: passed on (`result` is one triplet).
    unsafe {
        rdma(
            atomic,
            ep_handle,
            result,
            1,
            cookie,
            flags,
            rdma_addr,
            rmr_context,
        )
    }
}
