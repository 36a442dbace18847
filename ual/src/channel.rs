//! The two front doors of the kAL, behind one type: the device file served by `krdmad`,
//! or an in-process kAL (embedded mode). Both carry the same command structs.

use crate::device::DeviceFile;
use rnicpi::{Result, VerbsError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Where a uAL context reaches the kAL.
pub enum Channel {
    Device {
        file: DeviceFile,
        path: PathBuf,
    },
    #[cfg(feature = "embedded")]
    Embedded(crate::embedded::Door),
}

/// Which front door `KRDMA_DEVICE` (or the default `/dev/krdma`) selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Embedded,
    Device(PathBuf),
}

pub const DEFAULT_DEVICE: &str = "/dev/krdma";

impl Target {
    /// `KRDMA_DEVICE=embedded` or a path; unset means `/dev/krdma` when a daemon serves it,
    /// embedded otherwise (a uAL built without the `embedded` feature always takes the
    /// device file).
    pub fn from_env() -> Target {
        match std::env::var("KRDMA_DEVICE") {
            Ok(v) if v == "embedded" => Target::Embedded,
            Ok(v) if !v.is_empty() => Target::Device(v.into()),
            _ if !cfg!(feature = "embedded") || is_served(Path::new(DEFAULT_DEVICE)) => {
                Target::Device(DEFAULT_DEVICE.into())
            }
            _ => Target::Embedded,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Target::Embedded => "embedded".into(),
            Target::Device(p) => p.display().to_string(),
        }
    }
}

/// Whether `path` is a mount served by krdmad (a FUSE mount whose fs name is krdma).
fn is_served(path: &Path) -> bool {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    let p = path.to_string_lossy();
    mounts.lines().any(|l| {
        let mut c = l.split_whitespace();
        c.next() == Some("krdma") && c.next() == Some(p.as_ref())
    })
}

/// Open the device file at `path`, refusing one no daemon serves: a missing path, or the
/// plain file a stopped `krdmad` leaves behind (its mount point), is `NoDevice` rather
/// than whatever the first command on it would fail with.
fn open_served(path: &Path) -> Result<DeviceFile> {
    let file = DeviceFile::open(path).map_err(|e| match e {
        VerbsError::NoSuchResource => VerbsError::NoDevice,
        e => e,
    })?;
    match nix::sys::statfs::fstatfs(file.fd()) {
        Ok(st) if st.filesystem_type() == nix::sys::statfs::FUSE_SUPER_MAGIC => Ok(file),
        Ok(_) => {
            tracing::warn!(path = %path.display(), "not a krdmad mount: is krdmad running?");
            Err(VerbsError::NoDevice)
        }
        Err(e) => Err(VerbsError::from_errno(e as i32)),
    }
}

impl Channel {
    pub fn open(target: &Target) -> Result<Channel> {
        match target {
            Target::Device(path) => Ok(Channel::Device {
                file: open_served(path)?,
                path: path.clone(),
            }),
            #[cfg(feature = "embedded")]
            Target::Embedded => Ok(Channel::Embedded(crate::embedded::Door::open()?)),
            #[cfg(not(feature = "embedded"))]
            Target::Embedded => {
                tracing::warn!(
                    "KRDMA_DEVICE=embedded, but this uAL was built without its embedded kAL"
                );
                Err(VerbsError::Unsupported)
            }
        }
    }

    pub fn is_embedded(&self) -> bool {
        !matches!(self, Channel::Device { .. })
    }

    /// The device file, in daemon mode.
    pub fn device_file(&self) -> Option<&DeviceFile> {
        match self {
            Channel::Device { file, .. } => Some(file),
            #[cfg(feature = "embedded")]
            Channel::Embedded(_) => None,
        }
    }

    /// The embedded kAL and this context's id in it, in embedded mode.
    #[cfg(feature = "embedded")]
    pub fn embedded(&self) -> Option<(&Arc<kal::Kal>, kal::ContextId)> {
        match self {
            Channel::Embedded(door) => Some(door.kal()),
            Channel::Device { .. } => None,
        }
    }

    pub fn target(&self) -> Target {
        match self {
            Channel::Device { path, .. } => Target::Device(path.clone()),
            #[cfg(feature = "embedded")]
            Channel::Embedded(_) => Target::Embedded,
        }
    }

    /// Execute one command struct.
    pub fn call<T: bytemuck::Pod>(&self, cmd: u32, arg: &mut T) -> Result<()> {
        debug_assert_eq!(
            abi::decode(cmd).map(|d| d.2),
            Some(std::mem::size_of::<T>())
        );
        self.call_raw(cmd, bytemuck::bytes_of_mut(arg))
    }

    /// Raw call with arbitrary bytes (tests of hostile input). Through the device file
    /// only krdma commands whose size is `arg.len()` leave the process (see
    /// [`DeviceFile::ioctl`]); the embedded kAL takes anything and checks it itself.
    pub fn call_raw(&self, cmd: u32, arg: &mut [u8]) -> Result<()> {
        match self {
            Channel::Device { file, .. } => file.ioctl(cmd, arg),
            #[cfg(feature = "embedded")]
            Channel::Embedded(door) => door.ioctl(cmd, arg),
        }
    }

    /// Wait up to `timeout` for events and return the records read (possibly none).
    pub fn wait_events(&self, timeout: Duration) -> Result<Vec<abi::EventRecord>> {
        let mut buf = vec![0u8; abi::EVENT_SIZE * 32];
        let n = match self {
            Channel::Device { file, .. } => {
                let n = file.read_events(&mut buf)?;
                if n == 0 && file.wait_readable(Some(timeout))? {
                    file.read_events(&mut buf)?
                } else {
                    n
                }
            }
            #[cfg(feature = "embedded")]
            Channel::Embedded(door) => door.wait_events(&mut buf, timeout)?,
        };
        Ok(buf[..n]
            .chunks_exact(abi::EVENT_SIZE)
            .map(bytemuck::pod_read_unaligned)
            .collect())
    }

    /// Make every current and future [`Channel::wait_events`] return at once (teardown).
    pub fn stop_waiters(&self) {
        match self {
            Channel::Device { file, .. } => file.stop(),
            #[cfg(feature = "embedded")]
            Channel::Embedded(door) => door.stop(),
        }
    }

    /// Whether [`Channel::stop_waiters`] was called.
    pub fn is_stopped(&self) -> bool {
        match self {
            Channel::Device { file, .. } => file.is_stopped(),
            #[cfg(feature = "embedded")]
            Channel::Embedded(door) => door.is_stopped(),
        }
    }

    /// Embedded mode: a doorbell straight into the provider.
    pub fn direct_doorbell(&self, qp: u32) -> Result<Arc<dyn rnicpi::Doorbell>> {
        match self {
            #[cfg(feature = "embedded")]
            Channel::Embedded(door) => door.doorbell(qp),
            Channel::Device { .. } => {
                let _ = qp;
                Err(VerbsError::Unsupported)
            }
        }
    }

    /// Embedded mode: the handle through which empty polls of CQ `cq` drive the engine
    /// (`None` through the daemon, whose engine's sockets are not ours, and when
    /// `KRDMA_POLL_PROGRESS=off` leaves all receiving to the engine's threads).
    pub fn direct_progress(&self, cq: u32) -> Option<Arc<dyn rnicpi::Progress>> {
        match self {
            #[cfg(feature = "embedded")]
            Channel::Embedded(door) => {
                let off = std::env::var("KRDMA_POLL_PROGRESS").is_ok_and(|v| v == "off");
                (!off).then(|| door.progress(cq).ok()).flatten()
            }
            Channel::Device { .. } => {
                let _ = cq;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_no_daemon_serves_is_no_device() {
        let missing = std::env::temp_dir().join(format!("krdma-none-{}", std::process::id()));
        let plain = std::env::temp_dir().join(format!("krdma-plain-{}", std::process::id()));
        std::fs::write(&plain, b"").unwrap();
        for path in [&missing, &plain] {
            assert_eq!(
                Channel::open(&Target::Device(path.clone())).err(),
                Some(VerbsError::NoDevice),
                "{}",
                path.display()
            );
        }
        std::fs::remove_file(&plain).unwrap();
    }
}
