//! The IB extension (`dat_ib_extensions.h`) through `dat_extension_op`: libdat2 hands
//! the provider the operation and the rest of the caller's arguments as a `va_list`.
//!
//! Atomics (fetch-and-add, compare-and-swap), RDMA Write with immediate data and UD
//! datagrams (`ud`) where the device has them (rxe0). Counters answer
//! `DAT_NOT_IMPLEMENTED`.

use crate::boundary::call;
use crate::ep::{flags, triplets};
use crate::handles;
use crate::sys::*;
use krdma_dapl as dapl;
use krdma_dapl::Error;
use std::ffi::{c_int, c_void};

/// The x86-64 System V `va_list` element (`__va_list_tag`): a `va_list` parameter is a
/// pointer to it.
#[cfg(target_arch = "x86_64")]
#[repr(C)]
struct VaListTag {
    gp_offset: u32,
    fp_offset: u32,
    overflow_arg_area: *mut u8,
    reg_save_area: *mut u8,
}

/// Reads the integer-class arguments of a `va_list`, one 8-byte slot each (smaller
/// integers are promoted to a full slot; every argument of these operations is an
/// integer or a pointer).
struct Args(*mut c_void);

impl Args {
    #[cfg(target_arch = "x86_64")]
    fn next(&mut self) -> dapl::Result<u64> {
        if self.0.is_null() {
            return Err(crate::boundary::arg_error(3));
        }
        // SAFETY: libdat2 passes the `va_list` of the consumer's `dat_extension_op`
        // call; this follows the ABI's `va_arg` for an INTEGER-class 8-byte slot: from
        // the register save area while general-purpose slots remain (offset < 48),
        // then from the overflow area. The consumer supplied the arguments its
        // operation takes (as with any variadic C function).
        unsafe {
            let t = &mut *(self.0 as *mut VaListTag);
            if t.gp_offset < 48 {
                let v = (t.reg_save_area.add(t.gp_offset as usize) as *const u64).read_unaligned();
                t.gp_offset += 8;
                Ok(v)
            } else {
                let v = (t.overflow_arg_area as *const u64).read_unaligned();
                t.overflow_arg_area = t.overflow_arg_area.add(8);
                Ok(v)
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn next(&mut self) -> dapl::Result<u64> {
        Err(Error::not_implemented())
    }
}

/// One local triplet (an atomic's result buffer).
fn local(p: u64) -> dapl::Result<dapl::LmrTriplet> {
    Ok(triplets(p as usize as *const DAT_LMR_TRIPLET, 1, 4)?.remove(0))
}

fn remote(p: u64) -> dapl::Result<dapl::RmrTriplet> {
    crate::ep::remote(p as usize as *const DAT_RMR_TRIPLET)
}

pub unsafe extern "C" fn handle_extendedop(
    h: DAT_HANDLE,
    op: c_int,
    args: *mut c_void,
) -> DAT_RETURN {
    call("handle_extendedop", || {
        let mut a = Args(args);
        match op {
            DAT_IB_FETCH_AND_ADD_OP => {
                let (_, ep) = handles::ep(h)?;
                let add = a.next()?;
                let lbuf = local(a.next()?)?;
                let cookie = a.next()?;
                let rbuf = remote(a.next()?)?;
                let flags = dapl::Completion::from_bits_truncate(a.next()? as u32);
                ep.post_atomic(
                    dapl::AtomicOp::FetchAndAdd { add },
                    &lbuf,
                    cookie,
                    &rbuf,
                    flags,
                )
            }
            DAT_IB_CMP_AND_SWAP_OP => {
                let (_, ep) = handles::ep(h)?;
                let compare = a.next()?;
                let swap = a.next()?;
                let lbuf = local(a.next()?)?;
                let cookie = a.next()?;
                let rbuf = remote(a.next()?)?;
                let flags = dapl::Completion::from_bits_truncate(a.next()? as u32);
                ep.post_atomic(
                    dapl::AtomicOp::CompareAndSwap { compare, swap },
                    &lbuf,
                    cookie,
                    &rbuf,
                    flags,
                )
            }
            DAT_IB_RDMA_WRITE_IMMED_OP => {
                let (_, ep) = handles::ep(h)?;
                let n = a.next()? as DAT_COUNT;
                let iov = triplets(a.next()? as usize as *const DAT_LMR_TRIPLET, n, 4)?;
                let cookie = a.next()?;
                let rbuf = remote(a.next()?)?;
                let imm = a.next()? as u32;
                let flags = flags(a.next()? as u32)?;
                ep.post_rdma_write_immed(&iov, cookie, &rbuf, imm, flags)
            }
            DAT_IB_UD_SEND_OP => {
                let (_, ep) = handles::ep(h)?;
                let n = a.next()? as DAT_COUNT;
                let iov = triplets(a.next()? as usize as *const DAT_LMR_TRIPLET, n, 4)?;
                let to = crate::ud::lookup(a.next()? as usize as *const DAT_IB_ADDR_HANDLE)?;
                let cookie = a.next()?;
                let flags = flags(a.next()? as u32)?;
                ep.post_send_ud(&iov, &to, cookie, flags)
            }
            DAT_IB_UD_AH_FREE_OP => {
                handles::ep(h)?;
                crate::ud::free(a.next()? as usize as *const DAT_IB_ADDR_HANDLE)
            }
            // The connection manager's state of a resolution is gone once it answered.
            DAT_IB_UD_CM_FREE_OP => handles::ep(h).map(|_| ()),
            _ => {
                handles::get(h).ok_or(Error::of(dapl::Major::InvalidHandle))?;
                Err(Error::not_implemented())
            }
        }
    })
}
