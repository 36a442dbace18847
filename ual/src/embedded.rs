//! The embedded front door: a kAL with the default providers inside this process,
//! started on first use, reached by function call with the same command structs the
//! device file carries. Only with the `embedded` feature.

use kal::{ContextId, EmbeddedPeer, Kal};
use parking_lot::{Condvar, Mutex};
use rnicpi::Result;
pub use stack::StackOptions;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

static EMBEDDED_OPTIONS: OnceLock<StackOptions> = OnceLock::new();

/// Provider options for this process's embedded kAL, instead of the environment's
/// (tests give each process its own rxe0 address). Must come before the first use;
/// returns false when the options were already fixed.
pub fn configure_embedded(opts: StackOptions) -> bool {
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
    let opts = StackOptions {
        rxe_this_host_if_taken: true,
        ..EMBEDDED_OPTIONS.get_or_init(StackOptions::from_env).clone()
    };
    let kal = Kal::new(kal::Config::default());
    stack::start_default(&kal, &opts)?;
    Ok(KAL.get_or_init(|| kal).clone())
}

/// One context in the embedded kAL, and the wake-up its event waits sleep on.
pub struct Door {
    kal: Arc<Kal>,
    ctx: ContextId,
    signal: Arc<(Mutex<bool>, Condvar)>,
    stopped: AtomicBool,
}

impl Door {
    pub(crate) fn open() -> Result<Door> {
        Door::open_on(embedded_kal()?)
    }

    /// A context in `kal`, an in-process kAL of this process's own (a uVP's engine).
    pub(crate) fn open_on(kal: Arc<Kal>) -> Result<Door> {
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
        Ok(Door {
            kal,
            ctx,
            signal,
            stopped: false.into(),
        })
    }

    pub(crate) fn kal(&self) -> (&Arc<Kal>, ContextId) {
        (&self.kal, self.ctx)
    }

    pub(crate) fn ioctl(&self, cmd: u32, arg: &mut [u8]) -> Result<()> {
        self.kal.ioctl(self.ctx, cmd, arg)
    }

    /// Read event records into `buf`, sleeping up to `timeout` when there are none.
    pub(crate) fn wait_events(&self, buf: &mut [u8], timeout: Duration) -> Result<usize> {
        let n = self.kal.read_events(self.ctx, buf)?;
        if n > 0 {
            return Ok(n);
        }
        let mut ready = self.signal.0.lock();
        if !*ready && !self.stopped.load(Ordering::Acquire) {
            self.signal.1.wait_for(&mut ready, timeout);
        }
        *ready = false;
        drop(ready);
        self.kal.read_events(self.ctx, buf)
    }

    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        *self.signal.0.lock() = true;
        self.signal.1.notify_all();
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    pub(crate) fn doorbell(&self, qp: u32) -> Result<Arc<dyn rnicpi::Doorbell>> {
        self.kal.doorbell_for(self.ctx, qp)
    }

    pub(crate) fn progress(&self, cq: u32) -> Result<Arc<dyn rnicpi::Progress>> {
        self.kal.progress_for(self.ctx, cq)
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        self.kal.release(self.ctx);
    }
}
