//! The C boundary's common rules: every call is caught (a panic is
//! `DAT_INTERNAL_ERROR`, never an unwind into C), errors become `DAT_RETURN` codes and
//! are logged, and pointers from the consumer are checked for null and alignment
//! before they are read or written.

use crate::sys::DAT_RETURN;
use krdma_dapl::{Error, Major, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Run one provider call.
pub fn call(what: &'static str, f: impl FnOnce() -> Result<()>) -> DAT_RETURN {
    crate::log::init();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => crate::sys::DAT_SUCCESS,
        Ok(Err(e)) => {
            if !matches!(e.major, Major::QueueEmpty | Major::TimeoutExpired) {
                tracing::debug!(call = what, error = %e, "DAT call failed");
            }
            e.code()
        }
        Err(_) => {
            tracing::error!(call = what, "panic in the DAT provider");
            Error::of(Major::InternalError).code()
        }
    }
}

fn check_ptr<T>(p: *const T, arg: u32) -> Result<()> {
    if p.is_null() || !p.is_aligned() {
        return Err(arg_error(arg));
    }
    Ok(())
}

/// `DAT_INVALID_PARAMETER` naming argument `n`.
pub fn arg_error(n: u32) -> Error {
    use krdma_dapl::Minor::*;
    let minor = [Arg1, Arg2, Arg3, Arg4, Arg5, Arg6, Arg7, Arg8, Arg9, Arg10]
        [(n.clamp(1, 10) - 1) as usize];
    Error::new(Major::InvalidParameter, minor)
}

/// Store `v` through the consumer's pointer `p` (argument `arg`).
pub fn put<T>(p: *mut T, v: T, arg: u32) -> Result<()> {
    check_ptr(p, arg)?;
    // SAFETY: non-null and aligned (checked); the consumer passed it as an output
    // argument of this type — whether memory is behind it cannot be checked, as in any
    // C library.
    unsafe { p.write(v) };
    Ok(())
}

/// Store `v` when `p` is not null (optional outputs).
pub fn put_opt<T>(p: *mut T, v: T) {
    if !p.is_null() && p.is_aligned() {
        // SAFETY: as in `put`.
        unsafe { p.write(v) };
    }
}

/// Read the consumer's `*p` (argument `arg`).
pub fn get<T: Copy>(p: *const T, arg: u32) -> Result<T> {
    check_ptr(p, arg)?;
    // SAFETY: non-null and aligned; the consumer passed it as an input of this type.
    Ok(unsafe { p.read() })
}

/// The consumer's array of `n` `T` at `p` (argument `arg`); empty for `n == 0`.
pub fn array<'a, T>(p: *const T, n: i32, arg: u32) -> Result<&'a [T]> {
    if n < 0 {
        return Err(arg_error(arg - 1));
    }
    if n == 0 {
        return Ok(&[]);
    }
    check_ptr(p, arg)?;
    // SAFETY: non-null and aligned; the consumer says `n` elements are there, and the
    // slice does not outlive this call.
    Ok(unsafe { std::slice::from_raw_parts(p, n as usize) })
}

/// Private data: `n` bytes at `p` (argument `arg`).
pub fn bytes<'a>(p: *const std::ffi::c_void, n: i32, arg: u32) -> Result<&'a [u8]> {
    array(p as *const u8, n, arg)
}

/// Copy `s` into a fixed C string field (truncated, NUL-terminated).
pub fn c_name(dst: &mut [std::ffi::c_char], s: &str) {
    let n = s.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as std::ffi::c_char;
    }
    dst[n] = 0;
}

/// A DAT timeout (microseconds, `DAT_TIMEOUT_INFINITE`) as a duration.
pub fn timeout(t: u32) -> Option<std::time::Duration> {
    (t != crate::sys::DAT_TIMEOUT_INFINITE).then(|| std::time::Duration::from_micros(t as u64))
}
