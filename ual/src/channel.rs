//! The two front doors of the kAL, behind one type: the device file served by `krdmad`,
//! or an in-process kAL (embedded mode). Both carry the same command structs.

use crate::device::DeviceFile;
use kal::{abi, ContextId, EmbeddedPeer, Kal};
use parking_lot::{Condvar, Mutex};
use rnicpi::{Result, VerbsError};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Where a uAL context reaches the kAL.
pub enum Channel {
    Device {
        file: DeviceFile,
        path: PathBuf,
    },
    Embedded {
        kal: Arc<Kal>,
        ctx: ContextId,
        signal: Arc<(Mutex<bool>, Condvar)>,
        stopped: std::sync::atomic::AtomicBool,
    },
}

static EMBEDDED_OPTIONS: OnceLock<kal::stack::StackOptions> = OnceLock::new();

/// Provider options for this process's embedded kAL, instead of the environment's
/// (tests give each process its own rxe0 address). Must come before the first use;
/// returns false when the options were already fixed.
pub fn configure_embedded(opts: kal::stack::StackOptions) -> bool {
    EMBEDDED_OPTIONS.set(opts).is_ok()
}

/// The process-wide embedded kAL, started with the default providers on first use.
pub fn embedded_kal() -> Result<Arc<Kal>> {
    static KAL: OnceLock<Arc<Kal>> = OnceLock::new();
    static START: Mutex<()> = Mutex::new(());
    if let Some(k) = KAL.get() {
        return Ok(k.clone());
    }
    let _one_at_a_time = START.lock();
    if let Some(k) = KAL.get() {
        return Ok(k.clone());
    }
    let opts = EMBEDDED_OPTIONS.get_or_init(kal::stack::StackOptions::from_env);
    let kal = Kal::new(kal::Config::default());
    kal::stack::start_default(&kal, opts)?;
    Ok(KAL.get_or_init(|| kal).clone())
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
    /// embedded otherwise.
    pub fn from_env() -> Target {
        match std::env::var("KRDMA_DEVICE") {
            Ok(v) if v == "embedded" => Target::Embedded,
            Ok(v) if !v.is_empty() => Target::Device(v.into()),
            _ if is_served(Path::new(DEFAULT_DEVICE)) => Target::Device(DEFAULT_DEVICE.into()),
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

impl Channel {
    pub fn open(target: &Target) -> Result<Channel> {
        match target {
            Target::Device(path) => Ok(Channel::Device {
                file: DeviceFile::open(path)?,
                path: path.clone(),
            }),
            Target::Embedded => {
                let kal = embedded_kal()?;
                let me = kal::Caller {
                    pid: std::process::id(),
                    uid: nix::unistd::geteuid().as_raw(),
                    gid: nix::unistd::getegid().as_raw(),
                };
                let ctx = kal.open(me, Arc::new(EmbeddedPeer))?;
                let signal = Arc::new((Mutex::new(false), Condvar::new()));
                let s = signal.clone();
                kal.set_waker(
                    ctx,
                    Some(Arc::new(move || {
                        *s.0.lock() = true;
                        s.1.notify_all();
                    })),
                );
                Ok(Channel::Embedded {
                    kal,
                    ctx,
                    signal,
                    stopped: false.into(),
                })
            }
        }
    }

    pub fn is_embedded(&self) -> bool {
        matches!(self, Channel::Embedded { .. })
    }

    /// The device file, in daemon mode.
    pub fn device_file(&self) -> Option<&DeviceFile> {
        match self {
            Channel::Device { file, .. } => Some(file),
            Channel::Embedded { .. } => None,
        }
    }

    /// The embedded kAL and this context's id in it, in embedded mode.
    pub fn embedded(&self) -> Option<(&Arc<Kal>, ContextId)> {
        match self {
            Channel::Embedded { kal, ctx, .. } => Some((kal, *ctx)),
            Channel::Device { .. } => None,
        }
    }

    pub fn target(&self) -> Target {
        match self {
            Channel::Device { path, .. } => Target::Device(path.clone()),
            Channel::Embedded { .. } => Target::Embedded,
        }
    }

    /// Execute one command struct.
    pub fn call<T: bytemuck::Pod>(&self, cmd: u32, arg: &mut T) -> Result<()> {
        debug_assert_eq!(
            abi::decode(cmd).map(|d| d.2),
            Some(std::mem::size_of::<T>())
        );
        let bytes = bytemuck::bytes_of_mut(arg);
        match self {
            Channel::Device { file, .. } => file.ioctl(cmd, bytes),
            Channel::Embedded { kal, ctx, .. } => kal.ioctl(*ctx, cmd, bytes),
        }
    }

    /// Raw call with arbitrary bytes (tests of hostile input). Through the device file
    /// only krdma commands whose size is `arg.len()` leave the process (see
    /// [`DeviceFile::ioctl`]); the embedded kAL takes anything and checks it itself.
    pub fn call_raw(&self, cmd: u32, arg: &mut [u8]) -> Result<()> {
        match self {
            Channel::Device { file, .. } => file.ioctl(cmd, arg),
            Channel::Embedded { kal, ctx, .. } => kal.ioctl(*ctx, cmd, arg),
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
            Channel::Embedded {
                kal,
                ctx,
                signal,
                stopped,
            } => {
                let mut n = kal.read_events(*ctx, &mut buf)?;
                if n == 0 {
                    let mut ready = signal.0.lock();
                    if !*ready && !stopped.load(std::sync::atomic::Ordering::Acquire) {
                        signal.1.wait_for(&mut ready, timeout);
                    }
                    *ready = false;
                    drop(ready);
                    n = kal.read_events(*ctx, &mut buf)?;
                }
                n
            }
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
            Channel::Embedded {
                signal, stopped, ..
            } => {
                stopped.store(true, std::sync::atomic::Ordering::Release);
                *signal.0.lock() = true;
                signal.1.notify_all();
            }
        }
    }

    /// Whether [`Channel::stop_waiters`] was called.
    pub fn is_stopped(&self) -> bool {
        match self {
            Channel::Device { file, .. } => file.is_stopped(),
            Channel::Embedded { stopped, .. } => stopped.load(std::sync::atomic::Ordering::Acquire),
        }
    }

    /// Embedded mode: a doorbell straight into the provider.
    pub fn direct_doorbell(&self, qp: u32) -> Result<Arc<dyn rnicpi::Doorbell>> {
        match self {
            Channel::Embedded { kal, ctx, .. } => kal.doorbell_for(*ctx, qp),
            Channel::Device { .. } => Err(VerbsError::Unsupported),
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        if let Channel::Embedded { kal, ctx, .. } = self {
            kal.release(*ctx);
        }
    }
}
