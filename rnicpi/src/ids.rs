//! Identifiers that never alias a live one.
//!
//! A free-running counter wraps: after 2^32 allocations a plain `fetch_add` hands out a
//! number that may still be in use, and whatever is keyed on it (a protection domain
//! that isolates one tenant's memory from another's, a kAL context) then names two
//! things at once. [`IdAllocator`] keeps the set of live numbers and skips them.

use parking_lot::Mutex;
use std::collections::HashSet;

/// Hands out non-zero `u32` identifiers, each unique among those not yet freed.
#[derive(Debug)]
pub struct IdAllocator {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    next: u32,
    live: HashSet<u32>,
}

impl Default for IdAllocator {
    fn default() -> Self {
        Self::starting_at(1)
    }
}

impl IdAllocator {
    /// An allocator whose first candidate is `next` (0 is never handed out).
    pub fn starting_at(next: u32) -> Self {
        IdAllocator {
            inner: Mutex::new(Inner {
                next,
                live: HashSet::new(),
            }),
        }
    }

    /// The next free identifier, or `None` when every non-zero `u32` is live.
    pub fn alloc(&self) -> Option<u32> {
        let mut guard = self.inner.lock();
        let i = &mut *guard;
        let id = next_free(&mut i.next, i.live.len(), |id| i.live.contains(&id))?;
        i.live.insert(id);
        Some(id)
    }

    /// Give `id` back; later allocations may hand it out again.
    pub fn free(&self, id: u32) {
        self.inner.lock().live.remove(&id);
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: u32) -> bool {
        self.inner.lock().live.contains(&id)
    }

    /// Identifiers live now.
    pub fn live(&self) -> usize {
        self.inner.lock().live.len()
    }
}

/// The first candidate from `*next` on that is non-zero and not `taken`, with `*next`
/// moved past it; `live` is how many identifiers are taken, so at most `live + 2`
/// candidates are visited (the live ones, zero, and the free one: a wrapped counter
/// skips every live identifier, and the search is bounded). `None` only when every
/// non-zero `u32` is taken.
pub fn next_free(next: &mut u32, live: usize, taken: impl Fn(u32) -> bool) -> Option<u32> {
    for _ in 0..live.saturating_add(2) {
        let id = *next;
        *next = next.wrapping_add(1);
        if id != 0 && !taken(id) {
            return Some(id);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_never_aliases_a_live_id() {
        let ids = IdAllocator::starting_at(u32::MAX - 2);
        let long_lived = ids.alloc().unwrap();
        assert_eq!(long_lived, u32::MAX - 2);
        let mut seen = vec![long_lived];
        for _ in 0..6 {
            let id = ids.alloc().unwrap();
            assert!(id != 0 && !seen.contains(&id), "{id} handed out twice");
            seen.push(id);
        }
        // Free everything but the first; a full lap later it is still skipped.
        for id in &seen[1..] {
            ids.free(*id);
        }
        for _ in 0..20 {
            let id = ids.alloc().unwrap();
            assert_ne!(id, long_lived);
            ids.free(id);
        }
        ids.free(long_lived);
        assert_eq!(ids.live(), 0);
    }

    #[test]
    fn consecutive_live_ids_are_skipped_in_one_call() {
        let ids = IdAllocator::starting_at(1);
        let first: Vec<u32> = (0..100).map(|_| ids.alloc().unwrap()).collect();
        ids.free(first[50]);
        // Rewind the counter as a wrap would: the next free one is 51.
        ids.inner.lock().next = 1;
        assert_eq!(ids.alloc(), Some(51));
        assert_eq!(ids.alloc(), Some(101));
    }
}
