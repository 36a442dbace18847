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
    /// Written to stop a waiter in [`DeviceFile::wait_readable`] (context teardown).
    stop: OwnedFd,
    stopped: std::sync::atomic::AtomicBool,
}

fn map_err(e: nix::errno::Errno) -> VerbsError {
    match e {
        nix::errno::Errno::ENOTCONN | nix::errno::Errno::ECONNABORTED => VerbsError::Dead,
        e => VerbsError::from_errno(e as i32),
    }
}

/// A non-blocking, close-on-exec eventfd (doorbells and the event thread's stop signal).
pub(crate) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: eventfd takes an initial value and flags and returns a new fd or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
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
        Self::from_fd(fd)
    }

    /// Use an open descriptor of the device (one received from another process, say:
    /// the daemon serves it only for the process that opened it).
    pub fn from_fd(fd: OwnedFd) -> Result<DeviceFile> {
        let stop = eventfd()?;
        Ok(DeviceFile {
            fd,
            stop,
            stopped: false.into(),
        })
    }

    /// One command of the krdma ABI: `cmd` must be a krdma `_IOWR` number whose encoded
    /// size is `arg.len()` (the whole in/out struct), anything else is refused with
    /// `Invalid` before any system call. The kernel copies `_IOC_SIZE(cmd)` bytes in and
    /// out of `arg`, and claims some numbers for itself (`FIOQSIZE` writes 8 bytes), so
    /// any other command could write past `arg`.
    pub fn ioctl(&self, cmd: u32, arg: &mut [u8]) -> Result<()> {
        match abi::decode(cmd) {
            Some((t, _, size)) if t == abi::IOC_TYPE && size == arg.len() => {}
            _ => return Err(VerbsError::Invalid),
        }
        // SAFETY: `arg` is a live, writable buffer of exactly the size encoded in `cmd`
        // (checked above), which is what the kernel copies in and out for a `_IOWR`
        // command of a type the VFS does not claim.
        let r = unsafe { libc::ioctl(self.fd.as_raw_fd(), cmd as libc::c_ulong, arg.as_mut_ptr()) };
        if r < 0 {
            return Err(map_err(nix::errno::Errno::last()));
        }
        Ok(())
    }

    /// The open file (to pass it on, or to poll it).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }

    /// Read whole event records without blocking; 0 when none are queued.
    pub fn read_events(&self, out: &mut [u8]) -> Result<usize> {
        match nix::unistd::read(&self.fd, out) {
            Ok(n) => Ok(n),
            Err(nix::errno::Errno::EAGAIN) => Ok(0),
            Err(e) => Err(map_err(e)),
        }
    }

    /// Wake a thread blocked in [`DeviceFile::wait_readable`] for good.
    pub fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
        let _ = nix::unistd::write(&self.stop, &1u64.to_ne_bytes());
    }

    pub fn is_stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Wait until an event is readable, `timeout` passes, or [`DeviceFile::stop`] is
    /// called (then `Ok(false)` at once, now and later).
    pub fn wait_readable(&self, timeout: Option<Duration>) -> Result<bool> {
        let ms = timeout
            .map(|t| t.as_millis().min(i32::MAX as u128) as i32)
            .unwrap_or(-1);
        let mut p = [
            libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds for the duration of the call.
        let r = unsafe { libc::poll(p.as_mut_ptr(), 2, ms) };
        if r < 0 {
            let e = nix::errno::Errno::last();
            return if e == nix::errno::Errno::EINTR {
                Ok(false)
            } else {
                Err(map_err(e))
            };
        }
        if p[1].revents != 0 {
            return Ok(false);
        }
        let ev = p[0].revents;
        if ev & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 && ev & libc::POLLIN == 0 {
            return Err(VerbsError::Dead);
        }
        Ok(r > 0 && ev & libc::POLLIN != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_krdma_commands_of_the_buffer_size_leave_the_process() {
        let f = DeviceFile::open(Path::new("/dev/null")).unwrap();
        // FIOQSIZE would have the kernel write 8 bytes into a 1-byte buffer.
        let mut one = [0u8; 1];
        assert_eq!(
            f.ioctl(libc::FIOQSIZE as u32, &mut one),
            Err(VerbsError::Invalid)
        );
        let mut small = [0u8; 8];
        assert_eq!(
            f.ioctl(abi::iowr(0, 16), &mut small),
            Err(VerbsError::Invalid)
        );
        assert_eq!(
            f.ioctl(abi::cmd::QUERY_ABI & !(1 << 31), &mut [0u8; 16]),
            Err(VerbsError::Invalid)
        );
        // The right size and type reaches the kernel (which says /dev/null has no ioctls).
        let mut q = [0u8; 16];
        assert_ne!(
            f.ioctl(abi::cmd::QUERY_ABI, &mut q),
            Err(VerbsError::Invalid)
        );
    }
}
