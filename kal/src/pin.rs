//! Pinned-memory accounting per user, with the user's RLIMIT_MEMLOCK as the limit.
//!
//! The pages themselves are locked by the uAL in the owning process (`mlock`, reference
//! counted per page there, and `MADV_DONTFORK` so a fork cannot copy-on-write them under
//! a transfer); the kAL cannot lock another process's pages, but it keeps the books: a
//! registration is refused with `PinLimit` when the user's pinned total would exceed the
//! limit, and every byte is given back on deregistration or when the context dies.

use parking_lot::Mutex;
use rnicpi::{Result, VerbsError};
use std::collections::HashMap;

pub const PAGE: u64 = 4096;

/// Bytes of whole pages a registration of `[addr, addr+len)` pins.
pub fn pinned_span(addr: u64, len: u64) -> Option<u64> {
    let start = addr & !(PAGE - 1);
    let end = addr.checked_add(len)?.checked_add(PAGE - 1)? & !(PAGE - 1);
    Some(end - start)
}

#[derive(Default)]
pub struct PinAccounts {
    per_uid: Mutex<HashMap<u32, u64>>,
}

impl PinAccounts {
    /// Charge `bytes` to `uid` unless that passes `limit` (`None` = unlimited).
    pub fn charge(&self, uid: u32, bytes: u64, limit: Option<u64>) -> Result<()> {
        let mut m = self.per_uid.lock();
        let cur = m.entry(uid).or_insert(0);
        let new = cur.checked_add(bytes).ok_or(VerbsError::PinLimit)?;
        if let Some(l) = limit {
            if new > l {
                rnicpi::warn_limited!(uid, bytes, limit = l, pinned = *cur, "pin limit reached");
                return Err(VerbsError::PinLimit);
            }
        }
        *cur = new;
        Ok(())
    }

    pub fn release(&self, uid: u32, bytes: u64) {
        let mut m = self.per_uid.lock();
        if let Some(cur) = m.get_mut(&uid) {
            *cur = cur.saturating_sub(bytes);
            if *cur == 0 {
                m.remove(&uid);
            }
        }
    }

    pub fn total(&self) -> u64 {
        self.per_uid.lock().values().sum()
    }

    pub fn of(&self, uid: u32) -> u64 {
        self.per_uid.lock().get(&uid).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_rounds_to_pages() {
        assert_eq!(pinned_span(0, 1), Some(4096));
        assert_eq!(pinned_span(4095, 2), Some(8192));
        assert_eq!(pinned_span(4096, 4096), Some(4096));
        assert_eq!(pinned_span(u64::MAX - 10, 100), None);
    }

    #[test]
    fn limits_per_user() {
        let p = PinAccounts::default();
        p.charge(1, 4096, Some(8192)).unwrap();
        p.charge(1, 4096, Some(8192)).unwrap();
        assert_eq!(p.charge(1, 1, Some(8192)), Err(VerbsError::PinLimit));
        p.charge(2, 8192, Some(8192)).unwrap();
        p.release(1, 8192);
        assert_eq!(p.of(1), 0);
        assert_eq!(p.total(), 8192);
    }
}
