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
//!
//! The connection manager takes its randomness as an [`Entropy`]: the kernel's ([`Os`]) on
//! every device on a network; a seeded sequence ([`Seeded`]) only in a simulation, which
//! must replay exactly, and in tests.

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

/// Where the connection manager draws its identifiers from: the kernel's CSPRNG ([`Os`]),
/// or, in its tests, a fixed sequence.
pub(crate) trait Entropy: Send {
    fn u32(&mut self) -> Result<u32>;
    fn u64(&mut self) -> Result<u64>;

    /// A 24-bit PSN.
    fn psn(&mut self) -> Result<u32> {
        Ok(self.u32()? & crate::wire::PSN_MASK)
    }
}

/// The kernel's CSPRNG.
pub(crate) struct Os;

/// A fixed sequence drawn from a seed (SplitMix64): for a simulation, which must replay
/// exactly, and tests; never for a device on a network.
pub(crate) struct Seeded(pub u64);

impl Entropy for Seeded {
    fn u32(&mut self) -> Result<u32> {
        Ok(self.u64()? as u32)
    }

    fn u64(&mut self) -> Result<u64> {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Ok(z ^ (z >> 31))
    }
}

impl Entropy for Os {
    fn u32(&mut self) -> Result<u32> {
        u32()
    }

    fn u64(&mut self) -> Result<u64> {
        u64()
    }
}
