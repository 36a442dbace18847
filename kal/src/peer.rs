//! How the kAL reaches the process behind a context.

use crate::backing::Vma;
use crate::creds::Creds;
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
    /// The best access to the caller's range `[addr, addr+len)` (a registration), which
    /// lies in `vmas` (its mappings, just checked): by default [`memory`](Self::memory).
    fn memory_for(&self, _vmas: &[Vma], _addr: u64, _len: u64) -> Arc<dyn MemoryAccess> {
        self.memory()
    }
    /// Open the caller's `/proc/<pid>/<entry>` (`maps`, `smaps`, `mountinfo`, `limits`…),
    /// of the very process that opened the context.
    fn proc_open(&self, entry: &str) -> std::io::Result<std::fs::File>;
    /// Read the caller's `/proc/<pid>/<entry>`.
    fn proc_read(&self, entry: &str) -> std::io::Result<String> {
        std::io::read_to_string(self.proc_open(entry)?)
    }
    /// The opener's credentials; `None` for this very process (embedded mode).
    fn creds(&self) -> Option<Creds> {
        None
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

    fn proc_open(&self, entry: &str) -> std::io::Result<std::fs::File> {
        std::fs::File::open(format!("/proc/self/{entry}"))
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

/// The soft RLIMIT_MEMLOCK in a `/proc/<pid>/limits` text (`Some(None)` = unlimited).
pub fn memlock_from_limits(text: &str) -> Option<Option<u64>> {
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    let soft = line["Max locked memory".len()..]
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

/// Check that the caller's `[addr, addr+len)` may be registered (`write`: with a write
/// right) and return its mappings: mapped, readable, writable if asked, and backed only
/// by memory whose faults the kernel serves ([`crate::backing`]).
pub fn check_registration(
    peer: &dyn Peer,
    addr: u64,
    len: u64,
    write: bool,
) -> std::result::Result<Vec<Vma>, crate::backing::Refused> {
    use crate::backing::{self, KernelServed, Refused};
    let end = addr.checked_add(len).ok_or(Refused::Unmapped)?;
    if len == 0 || addr == 0 || end == 0 {
        return Err(Refused::Unmapped);
    }
    let unmapped = |_| Refused::Unmapped;
    let mut vmas = backing::covering(&mut peer.proc_open("maps").map_err(unmapped)?, addr, len)
        .map_err(unmapped)?;
    if backing::uffd_possible(peer.creds().as_ref()) {
        let smaps = backing::parse(&peer.proc_read("smaps").map_err(unmapped)?);
        for v in &mut vmas {
            let flags = smaps.iter().find(|s| (s.lo, s.hi) == (v.lo, v.hi));
            // A mapping that changed in between has no flags to trust: refuse it.
            v.flags = Some(
                flags
                    .and_then(|s| s.flags.clone())
                    .unwrap_or(vec!["um".into()]),
            );
        }
    }
    let mounts = || KernelServed::new(&peer.proc_read("mountinfo").unwrap_or_default());
    backing::check(&vmas, addr, len, write, &mounts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::Refused;

    #[test]
    fn registration_checks() {
        let me = EmbeddedPeer;
        let v = vec![0u8; 3 * 4096];
        let vmas = check_registration(&me, v.as_ptr() as u64, v.len() as u64, true).unwrap();
        assert!(!vmas.is_empty());
        assert_eq!(
            check_registration(&me, 8, 16, false),
            Err(Refused::Unmapped)
        );
        assert_eq!(
            check_registration(&me, 0, 16, false),
            Err(Refused::Unmapped)
        );
        assert_eq!(
            check_registration(&me, u64::MAX - 4, 16, false),
            Err(Refused::Unmapped)
        );
        // Read-only data of the test binary is a file mapping: refused whatever is asked.
        static RO: [u8; 64] = [1; 64];
        assert!(matches!(
            check_registration(&me, RO.as_ptr() as u64, 64, false),
            Err(Refused::File(_))
        ));
        let ro = memmap2::MmapOptions::new()
            .len(4096)
            .map_anon()
            .unwrap()
            .make_read_only()
            .unwrap();
        check_registration(&me, ro.as_ptr() as u64, 64, false).unwrap();
        assert_eq!(
            check_registration(&me, ro.as_ptr() as u64, 64, true),
            Err(Refused::NotWritable)
        );
    }

    #[test]
    fn memlock_limit_from_proc_matches_getrlimit() {
        let (soft, _) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK).unwrap();
        let text = std::fs::read_to_string("/proc/self/limits").unwrap();
        assert_eq!(memlock_from_limits(&text), Some(rlimit_to_option(soft)));
    }
}
