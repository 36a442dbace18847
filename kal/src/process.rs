//! The daemon-side [`Peer`]: a client process reached only through what was bound to
//! its incarnation when it opened the device ([`Opener`]): its pidfd (descriptors, with
//! `pidfd_getfd`), its `/proc/<pid>` directory (maps, limits) and its memory file
//! ([`crate::procmem`]), or for sealed shared memory a mapping of the same pages
//! ([`crate::mapped`]). Never a raw pid with the daemon's own rights.

use crate::backing::{covering, Vma};
use crate::creds::Creds;
use crate::mapped::MappedMemory;
use crate::opener::Opener;
use crate::peer::{memlock_from_limits, Peer};
use rnicpi::{MemoryAccess, Result, VerbsError};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// A client process of the daemon.
#[derive(Debug)]
pub struct ProcessPeer {
    opener: Arc<Opener>,
}

impl ProcessPeer {
    pub fn new(opener: Arc<Opener>) -> ProcessPeer {
        ProcessPeer { opener }
    }
}

impl Peer for ProcessPeer {
    fn memory_for(&self, vmas: &[Vma], addr: u64, len: u64) -> Arc<dyn MemoryAccess> {
        let o = &self.opener;
        let now = || {
            covering(&mut o.open_entry("maps").ok()?, addr, 1)
                .ok()?
                .pop()
        };
        match vmas {
            [vma] => match MappedMemory::open(o.dir(), &o.creds, vma, (addr, len), now) {
                Some(m) => Arc::new(m),
                None => o.mem.clone(),
            },
            _ => o.mem.clone(),
        }
    }

    fn take_fd(&self, fd: i32) -> Result<OwnedFd> {
        if fd < 0 {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: pidfd_getfd duplicates descriptor `fd` of the process behind our pidfd
        // into this process; it returns a new descriptor or -1.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_getfd,
                self.opener.pidfd().as_raw_fd(),
                fd,
                0,
            )
        };
        if r < 0 {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
    }

    fn memory(&self) -> Arc<dyn MemoryAccess> {
        self.opener.mem.clone()
    }

    fn proc_open(&self, entry: &str) -> std::io::Result<std::fs::File> {
        self.opener.open_entry(entry)
    }

    fn creds(&self) -> Option<Creds> {
        Some(self.opener.creds)
    }

    fn memlock_limit(&self) -> Option<u64> {
        match self
            .opener
            .read("limits")
            .ok()
            .and_then(|t| memlock_from_limits(&t))
        {
            Some(l) => l,
            None => Some(64 << 10), // the kernel's historical default, when nothing tells
        }
    }

    fn unlimited_pin(&self) -> bool {
        self.opener.creds.euid() == 0
    }

    fn in_process(&self) -> bool {
        false
    }
}
