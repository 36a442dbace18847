//! The uAL's client of the device file served by `krdmad`.
//!
//! Every failure that means "the daemon is gone" (`ENOTCONN`, `ECONNABORTED`) becomes
//! `VerbsError::Dead`, which the uAL turns into a fatal `AccessLayerDead` event.

use rnicpi::{Result, VerbsError};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

pub struct DeviceFile {
    fd: OwnedFd,
}

fn map_err(e: nix::errno::Errno) -> VerbsError {
    match e {
        nix::errno::Errno::ENOTCONN | nix::errno::Errno::ECONNABORTED => VerbsError::Dead,
        e => VerbsError::from_errno(e as i32),
    }
}

impl DeviceFile {
    pub fn open(path: &Path) -> Result<DeviceFile> {
        let fd = nix::fcntl::open(
            path,
            nix::fcntl::OFlag::O_RDWR
                | nix::fcntl::OFlag::O_CLOEXEC
                | nix::fcntl::OFlag::O_NONBLOCK,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(map_err)?;
        Ok(DeviceFile { fd })
    }

    /// One `_IOWR` command; `arg` is the whole in/out struct.
    pub fn ioctl(&self, cmd: u32, arg: &mut [u8]) -> Result<()> {
        // SAFETY: `arg` is a live, writable buffer; the kernel copies exactly the size
        // encoded in `cmd` in and out, and the uAL only passes structs of that size.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), cmd as libc::c_ulong, arg.as_mut_ptr()) };
        if r < 0 {
            return Err(map_err(nix::errno::Errno::last()));
        }
        Ok(())
    }

    /// Read whole event records without blocking; 0 when none are queued.
    pub fn read_events(&self, out: &mut [u8]) -> Result<usize> {
        match nix::unistd::read(&self.fd, out) {
            Ok(n) => Ok(n),
            Err(nix::errno::Errno::EAGAIN) => Ok(0),
            Err(e) => Err(map_err(e)),
        }
    }

    /// Wait until an event is readable or `timeout` passes.
    pub fn wait_readable(&self, timeout: Option<Duration>) -> Result<bool> {
        let ms = timeout
            .map(|t| t.as_millis().min(i32::MAX as u128) as i32)
            .unwrap_or(-1);
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = nix::errno::Errno::last();
            return if e == nix::errno::Errno::EINTR {
                Ok(false)
            } else {
                Err(map_err(e))
            };
        }
        if p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
            && p.revents & libc::POLLIN == 0
        {
            return Err(VerbsError::Dead);
        }
        Ok(r > 0 && p.revents & libc::POLLIN != 0)
    }
}
