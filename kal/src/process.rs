//! The daemon-side [`Peer`]: a client process reached through its pidfd (descriptors,
//! with `pidfd_getfd`) and `process_vm_readv`/`process_vm_writev` (memory).

use crate::peer::Peer;
use rnicpi::{MemoryAccess, Result, VerbsError};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// A client process of the daemon.
#[derive(Debug)]
pub struct ProcessPeer {
    pub tgid: u32,
    uid: u32,
    pidfd: OwnedFd,
    memory: Arc<ProcessMemory>,
}

/// The thread group of thread `tid` (FUSE requests carry the calling thread's id).
pub fn tgid_of(tid: u32) -> Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status"))
        .map_err(|_| VerbsError::NoSuchResource)?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(VerbsError::NoSuchResource)
}

impl ProcessPeer {
    pub fn new(tid: u32, uid: u32) -> Result<ProcessPeer> {
        let tgid = tgid_of(tid)?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, tgid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(ProcessPeer {
            tgid,
            uid,
            pidfd,
            memory: Arc::new(ProcessMemory { pid: tgid }),
        })
    }
}

impl Peer for ProcessPeer {
    fn memory_for(&self, addr: u64, len: u64) -> Arc<dyn MemoryAccess> {
        match crate::mapped::MappedMemory::open(self.tgid, addr, len) {
            Some(m) => Arc::new(m),
            None => self.memory.clone(),
        }
    }

    fn take_fd(&self, fd: i32) -> Result<OwnedFd> {
        if fd < 0 {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: pidfd_getfd duplicates descriptor `fd` of the process behind our pidfd
        // into this process; it returns a new descriptor or -1.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.as_raw_fd(), fd, 0) };
        if r < 0 {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
    }

    fn memory(&self) -> Arc<dyn MemoryAccess> {
        self.memory.clone()
    }

    fn memlock_limit(&self) -> Option<u64> {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: prlimit with a null new-limit only reads the target's limit into `lim`.
        let r = unsafe {
            libc::prlimit(
                self.tgid as libc::pid_t,
                libc::RLIMIT_MEMLOCK,
                std::ptr::null(),
                &mut lim,
            )
        };
        if r == 0 {
            return crate::peer::rlimit_to_option(lim.rlim_cur);
        }
        // prlimit on another user's process needs CAP_SYS_RESOURCE, which containers often
        // withhold; /proc/PID/limits is world-readable and says the same.
        match memlock_from_proc(self.tgid) {
            Some(l) => l,
            None => Some(64 << 10), // the kernel's historical default, when nothing tells
        }
    }

    fn unlimited_pin(&self) -> bool {
        self.uid == 0
    }

    fn in_process(&self) -> bool {
        false
    }
}

/// The soft RLIMIT_MEMLOCK of `pid` from `/proc/PID/limits` (`Some(None)` = unlimited).
fn memlock_from_proc(pid: u32) -> Option<Option<u64>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    let soft = line["Max locked memory".len()..]
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        return Some(None);
    }
    soft.parse().ok().map(Some)
}

/// Another process's memory, copied with `process_vm_readv`/`process_vm_writev`.
#[derive(Debug)]
pub struct ProcessMemory {
    pub pid: u32,
}

/// Largest single transfer per system call (the kernel copies up to this much per call).
const CHUNK: usize = 1 << 30;

impl ProcessMemory {
    fn transfer(&self, addr: u64, local: *mut u8, len: usize, write: bool) -> Result<()> {
        let mut done = 0usize;
        while done < len {
            let n = (len - done).min(CHUNK);
            let l = libc::iovec {
                iov_base: local.wrapping_add(done) as *mut libc::c_void,
                iov_len: n,
            };
            let r = libc::iovec {
                iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
                iov_len: n,
            };
            // SAFETY: `l` describes `n` bytes of a live local buffer owned by the caller
            // (readable for writes, writable for reads); `r` describes the remote range,
            // which the kernel checks against the target's mappings (EFAULT otherwise).
            let got = unsafe {
                if write {
                    libc::process_vm_writev(self.pid as libc::pid_t, &l, 1, &r, 1, 0)
                } else {
                    libc::process_vm_readv(self.pid as libc::pid_t, &l, 1, &r, 1, 0)
                }
            };
            if got <= 0 {
                return Err(VerbsError::BadAddress);
            }
            done += got as usize;
        }
        Ok(())
    }
}

impl MemoryAccess for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.transfer(addr, buf.as_mut_ptr(), buf.len(), false)
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.transfer(addr, data.as_ptr() as *mut u8, data.len(), true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_limit_from_proc_matches_getrlimit() {
        let (soft, _) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK).unwrap();
        let want = crate::peer::rlimit_to_option(soft);
        assert_eq!(memlock_from_proc(std::process::id()), Some(want));
    }

    #[test]
    fn own_process_memory_round_trip() {
        let m = ProcessMemory {
            pid: std::process::id(),
        };
        let src = vec![7u8; 10000];
        let mut dst = vec![0u8; 10000];
        m.read(src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(src, dst);
        m.write(dst.as_ptr() as u64, &[1, 2, 3]).unwrap();
        assert_eq!(&dst[..3], &[1, 2, 3]);
        assert_eq!(m.read(8, &mut [0u8; 4]), Err(VerbsError::BadAddress));
    }

    #[test]
    fn tgid_of_a_thread() {
        let me = std::process::id();
        // SAFETY: gettid has no preconditions.
        let (tid, tgid) = std::thread::spawn(|| {
            let tid = unsafe { libc::gettid() } as u32;
            (tid, tgid_of(tid).unwrap())
        })
        .join()
        .unwrap();
        assert_ne!(tid, me);
        assert_eq!(tgid, me);
    }
}
