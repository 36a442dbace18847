//! The pointer checks every entry point shares, and the conversion of results and
//! panics into `it_status_t`. A null or misaligned pointer the caller passes is an
//! `IT_ERR_FAULT`; a non-null pointer to memory that is not there cannot be detected
//! (as in any C library).

use crate::types::{ItStatus, IT_SUCCESS};
use krdma_itapi::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// With `RUST_LOG` set, log to stderr (once, on the first call into the library).
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

/// Run an entry point's body: its result as a status; a panic becomes `IT_ERR_ABORT`
/// (it never unwinds into C).
pub fn status(body: impl FnOnce() -> Result<()>) -> ItStatus {
    init_logging();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => IT_SUCCESS,
        Ok(Err(e)) => {
            tracing::debug!(status = %e, "libitapi call failed");
            e.code()
        }
        Err(_) => {
            tracing::error!("libitapi: internal panic");
            Error::Abort.code()
        }
    }
}

/// Check a pointer before doing work whose result goes there (null or misaligned:
/// `IT_ERR_FAULT`).
pub fn usable<T>(p: *const T) -> Result<()> {
    if p.is_null() || !p.is_aligned() {
        Err(Error::Fault)
    } else {
        Ok(())
    }
}

/// Store `v` through an out-parameter.
///
/// # Safety
/// `p` is null or points to writable memory for a `T`.
pub unsafe fn put<T>(p: *mut T, v: T) -> Result<()> {
    usable(p)?;
    // SAFETY: non-null and aligned (checked); writable by the caller's contract. `write`
    // does not read or drop the old (possibly uninitialised) value.
    unsafe { p.write(v) };
    Ok(())
}

/// Store `v` through an optional out-parameter (null: not wanted).
///
/// # Safety
/// As [`put`].
pub unsafe fn put_opt<T>(p: *mut T, v: T) -> Result<()> {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { put(p, v) }
}

/// Read an in-parameter.
///
/// # Safety
/// `p` is null or points to an initialised `T`.
pub unsafe fn get<T: Copy>(p: *const T) -> Result<T> {
    usable(p)?;
    // SAFETY: non-null and aligned (checked); initialised by the caller's contract. The
    // types read this way are plain C data valid for any bit pattern of their members.
    Ok(unsafe { p.read() })
}

/// Borrow `len` elements at `p` (none when `len` is 0, whatever `p` is).
///
/// # Safety
/// When `len > 0`, `p` points to `len` initialised `T`s that stay valid and unchanged
/// for the returned lifetime.
pub unsafe fn slice<'a, T>(p: *const T, len: usize) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    usable(p)?;
    if len
        .checked_mul(std::mem::size_of::<T>())
        .is_none_or(|b| b > isize::MAX as usize)
    {
        return Err(Error::InvalidLength);
    }
    // SAFETY: non-null, aligned, size within isize (checked); valid for `len` elements
    // by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}
