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
        let stop = eventfd()?;
        Ok(DeviceFile {
            fd,
            stop,
            stopped: false.into(),
        })
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
