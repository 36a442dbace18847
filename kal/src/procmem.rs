//! A client process's memory through `/proc/<pid>/mem`, opened once per context as the
//! client's own user.
//!
//! The open happens on a thread that acts as the opener: its file-system ids and its
//! capabilities, never the daemon's `CAP_SYS_PTRACE` ([`crate::creds::as_opener`]), so the kernel's ptrace access check
//! applies as if the opener opened its own memory: a process of another user, or one
//! that made itself undumpable, is refused. The file is bound to the address space (the
//! `mm`) it was opened on, not to the pid: after the process execs or exits every read
//! and write of it fails (`pread` returns 0 bytes), and it never reaches whatever
//! program later holds the same pid ([`ProcMem::alive`] tells).

use crate::creds::{as_opener, Creds};
use rnicpi::{MemoryAccess, Result, VerbsError};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};
use std::os::unix::fs::FileExt;

/// One process's address space.
#[derive(Debug)]
pub struct ProcMem {
    file: File,
}

/// Open `entry` under the `/proc/<pid>` directory `dir` with `flags`.
pub fn open_at(dir: BorrowedFd<'_>, entry: &str, flags: i32) -> io::Result<File> {
    let name = std::ffi::CString::new(entry).map_err(io::Error::other)?;
    // SAFETY: openat on a directory descriptor we hold, with a NUL-terminated name;
    // the result is checked.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

impl ProcMem {
    /// Open the memory of the process whose `/proc/<pid>` directory is `dir`, as `creds`'
    /// file-system user.
    pub fn open(dir: BorrowedFd<'_>, creds: &Creds) -> io::Result<ProcMem> {
        let file = as_opener(creds, 0, || open_at(dir, "mem", libc::O_RDWR))??;
        Ok(ProcMem { file })
    }

    /// Whether the address space is still the one opened: reading an address nothing
    /// can map (page 0) fails with `EIO` while it is, and returns 0 bytes once the
    /// process has exec'd or exited. (It takes the process's `mmap` lock.)
    pub fn alive(&self) -> bool {
        let mut b = [0u8; 1];
        !matches!(self.file.read_at(&mut b, 0), Ok(0))
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl MemoryAccess for ProcMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let at = addr
                .checked_add(done as u64)
                .ok_or(VerbsError::BadAddress)?;
            match self.file.read_at(&mut buf[done..], at) {
                Ok(0) | Err(_) => return Err(VerbsError::BadAddress),
                Ok(n) => done += n,
            }
        }
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let mut done = 0;
        while done < data.len() {
            let at = addr
                .checked_add(done as u64)
                .ok_or(VerbsError::BadAddress)?;
            match self.file.write_at(&data[done..], at) {
                Ok(0) | Err(_) => return Err(VerbsError::BadAddress),
                Ok(n) => done += n,
            }
        }
        Ok(())
    }
}

impl AsFd for ProcMem {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::creds::Status;

    fn own_dir() -> File {
        File::open(format!("/proc/{}", std::process::id())).unwrap()
    }

    #[test]
    fn reads_and_writes_own_memory() {
        let me = Status::of(std::process::id()).unwrap();
        let dir = own_dir();
        let m = ProcMem::open(dir.as_fd(), &me.creds).unwrap();
        assert!(m.alive());
        let src = vec![7u8; 10000];
        let mut dst = vec![0u8; 10000];
        m.read(src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(src, dst);
        m.write(dst.as_ptr() as u64, &[1, 2, 3]).unwrap();
        assert_eq!(&dst[..3], &[1, 2, 3]);
        assert_eq!(m.read(8, &mut [0u8; 4]), Err(VerbsError::BadAddress));
        assert_eq!(
            m.write(u64::MAX - 1, &[0u8; 4]),
            Err(VerbsError::BadAddress)
        );
    }

    #[test]
    fn another_users_process_is_refused() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        // We (root) pose as user nobody opening root's process: the kernel refuses.
        let as_nobody = Creds {
            uids: [65534; 4],
            gids: [65534; 4],
            cap_eff: 0,
        };
        let dir = own_dir();
        let err = ProcMem::open(dir.as_fd(), &as_nobody).unwrap_err();
        assert!(
            matches!(err.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM)),
            "{err}"
        );
    }
}
