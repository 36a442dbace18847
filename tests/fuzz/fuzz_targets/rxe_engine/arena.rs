//! The memory checker: the consumer memory the engine reaches, as one arena of
//! registrations with guard bytes around each. Every access of the engine must lie inside
//! a registration, and every write inside one the consumer may have written to at all (a
//! local or remote write right); anything else panics on the spot, which libFuzzer
//! reports with the input. The guard bytes are checked after every step as well.

use rnicpi::{MemoryAccess, Result};
use std::sync::Mutex;

/// The guard byte, and the gap of guard bytes before, between and after registrations.
pub const GUARD: u8 = 0xa5;
const GAP: u64 = 256;
/// The (made-up) consumer address of the arena's first byte.
pub const BASE: u64 = 0x7f3a_0000_0000;

/// One registration's place in the arena.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    pub base: u64,
    pub len: u64,
    pub writable: bool,
}

#[derive(Debug)]
pub struct Arena {
    bytes: Mutex<Vec<u8>>,
    slots: Vec<Slot>,
}

impl Arena {
    /// Registrations of these lengths (and whether each may be written), in order.
    pub fn new(shape: &[(u64, bool)]) -> Arena {
        let mut slots = Vec::new();
        let mut at = BASE + GAP;
        for &(len, writable) in shape {
            slots.push(Slot {
                base: at,
                len,
                writable,
            });
            at += len + GAP;
        }
        let arena = Arena {
            bytes: Mutex::new(vec![GUARD; (at - BASE) as usize]),
            slots,
        };
        arena.reset();
        arena
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Registrations zeroed, guards restored (between inputs).
    pub fn reset(&self) {
        let mut b = self.bytes.lock().unwrap();
        b.fill(GUARD);
        for s in &self.slots {
            let at = (s.base - BASE) as usize;
            b[at..at + s.len as usize].fill(0);
        }
    }

    /// Whether every byte outside the registrations is still a guard byte.
    pub fn guards_intact(&self) -> bool {
        let b = self.bytes.lock().unwrap();
        let mut at = 0usize;
        for s in &self.slots {
            let start = (s.base - BASE) as usize;
            if b[at..start].iter().any(|&x| x != GUARD) {
                return false;
            }
            at = start + s.len as usize;
        }
        b[at..].iter().all(|&x| x == GUARD)
    }

    /// The arena offset of `[addr, addr+len)`, which must lie inside one registration
    /// (a writable one when `write`).
    fn at(&self, addr: u64, len: usize, write: bool) -> usize {
        let end = addr.checked_add(len as u64);
        let slot = self
            .slots
            .iter()
            .find(|s| addr >= s.base && end.is_some_and(|e| e <= s.base + s.len));
        let what = if write { "wrote" } else { "read" };
        let Some(slot) = slot else {
            panic!("the engine {what} {len} bytes at {addr:#x}, outside every registration");
        };
        assert!(
            !write || slot.writable,
            "the engine wrote {len} bytes at {addr:#x} into a registration without write rights"
        );
        (addr - BASE) as usize
    }
}

impl MemoryAccess for Arena {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let at = self.at(addr, buf.len(), false);
        buf.copy_from_slice(&self.bytes.lock().unwrap()[at..at + buf.len()]);
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let at = self.at(addr, data.len(), true);
        self.bytes.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
}
