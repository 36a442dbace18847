//! Unpredictable identifiers: QPNs, starting PSNs, CM communication IDs, transaction IDs
//! and picked listener ports come from the kernel's CSPRNG (`getrandom(2)`), one call per
//! value and no generator state of our own, so nothing an observer sees on the wire (a
//! TID, a PSN, a comm ID) tells it anything about the next one. Off-path injection (the
//! ReDMArk class) needs the QPN, a PSN inside the window and a key; none of them can be
//! predicted.
//!
//! `getrandom(2)` blocks until the kernel's pool is seeded and then never fails; should it
//! (no syscall, no `/dev/urandom`), the operation that needed the value fails with `Io`
//! rather than go on with something predictable.

use rnicpi::{Result, VerbsError};

fn failed(e: getrandom::Error) -> VerbsError {
    tracing::error!(error = %e, "rxe: the kernel's random number generator failed");
    VerbsError::Io
}

/// A random 32-bit value.
pub(crate) fn u32() -> Result<u32> {
    getrandom::u32().map_err(failed)
}

/// A random 64-bit value.
pub(crate) fn u64() -> Result<u64> {
    getrandom::u64().map_err(failed)
}

/// A random 24-bit PSN.
pub(crate) fn psn() -> Result<u32> {
    Ok(u32()? & crate::wire::PSN_MASK)
}
