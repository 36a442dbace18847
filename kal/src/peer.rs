//! How the kAL reaches the process behind a context.

use rnicpi::{LocalMemory, MemoryAccess, Result, VerbsError};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

/// Who opened the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// Process id (thread-group id).
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// The kAL's way into the process behind a context.
pub trait Peer: Send + Sync + 'static {
    /// Duplicate the caller's own descriptor number `fd` into this process.
    fn take_fd(&self, fd: i32) -> Result<OwnedFd>;
    /// Access to the caller's memory (for registered memory regions).
    fn memory(&self) -> Arc<dyn MemoryAccess>;
    /// The best access to the caller's range `[addr, addr+len)` (a registration): by
    /// default [`memory`](Self::memory).
    fn memory_for(&self, _addr: u64, _len: u64) -> Arc<dyn MemoryAccess> {
        self.memory()
    }
    /// The caller's RLIMIT_MEMLOCK soft limit in bytes (`None` = unlimited).
    fn memlock_limit(&self) -> Option<u64>;
    /// Whether the caller may pin without limit (CAP_IPC_LOCK; uid 0 counts as having it).
    fn unlimited_pin(&self) -> bool;
    /// True in embedded mode (the caller is this very process).
    fn in_process(&self) -> bool;
}

/// The caller is this process (embedded mode).
#[derive(Debug, Default)]
pub struct EmbeddedPeer;

pub fn rlimit_to_option(cur: u64) -> Option<u64> {
    (cur != libc::RLIM_INFINITY).then_some(cur)
}

impl Peer for EmbeddedPeer {
    fn take_fd(&self, fd: i32) -> Result<OwnedFd> {
        if fd < 0 {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: we only borrow the number for the duration of the dup; if it is not an
        // open descriptor, try_clone_to_owned fails with EBADF and nothing is touched.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        borrowed
            .try_clone_to_owned()
            .map_err(|_| VerbsError::Invalid)
    }

    fn memory(&self) -> Arc<dyn MemoryAccess> {
        Arc::new(LocalMemory)
    }

    fn memlock_limit(&self) -> Option<u64> {
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK)
            .ok()
            .and_then(|(soft, _)| rlimit_to_option(soft))
    }

    fn unlimited_pin(&self) -> bool {
        nix::unistd::geteuid().is_root()
    }

    fn in_process(&self) -> bool {
        true
    }
}

/// Check that `[addr, addr+len)` of process `pid` is mapped, readable, and writable
/// when `write` is asked, by reading its `/proc/<pid>/maps`. This keeps a registration of
/// unmapped or read-only memory from ever reaching the engine (where, in embedded mode, a
/// direct write to it would fault).
pub fn check_mapping(pid: u32, addr: u64, len: u64, write: bool) -> Result<()> {
    let end = addr.checked_add(len).ok_or(VerbsError::Invalid)?;
    if len == 0 || addr == 0 {
        return Err(VerbsError::Invalid);
    }
    let maps =
        std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|_| VerbsError::BadAddress)?;
    let mut covered = addr;
    for line in maps.lines() {
        let mut cols = line.split_whitespace();
        let (Some(range), Some(perms)) = (cols.next(), cols.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= covered || lo > covered {
            continue;
        }
        let p = perms.as_bytes();
        if p.first() != Some(&b'r') || (write && p.get(1) != Some(&b'w')) {
            return Err(VerbsError::BadAddress);
        }
        covered = hi;
        if covered >= end {
            return Ok(());
        }
    }
    Err(VerbsError::BadAddress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_checks() {
        let me = std::process::id();
        let v = vec![0u8; 3 * 4096];
        check_mapping(me, v.as_ptr() as u64, v.len() as u64, true).unwrap();
        assert_eq!(check_mapping(me, 8, 16, false), Err(VerbsError::BadAddress));
        assert_eq!(check_mapping(me, 0, 16, false), Err(VerbsError::Invalid));
        static RO: [u8; 64] = [1; 64];
        check_mapping(me, RO.as_ptr() as u64, 64, false).unwrap();
        assert_eq!(
            check_mapping(me, RO.as_ptr() as u64, 64, true),
            Err(VerbsError::BadAddress)
        );
        assert_eq!(
            check_mapping(me, u64::MAX - 4, 16, false),
            Err(VerbsError::Invalid)
        );
    }
}
