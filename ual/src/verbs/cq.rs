//! Completion queues: polled in shared memory (or, on a device whose fast path is the
//! consumer's, through its uVP), armed for notification.

use super::*;
use std::os::fd::BorrowedFd;

impl Context {
    pub fn create_cq(self: &Arc<Self>, dev: u32, depth: u32) -> Result<Arc<Cq>> {
        self.create_cq_signalled(dev, depth, None)
    }

    /// [`create_cq`](Self::create_cq), with `signal` (one end of a Unix stream socket
    /// pair) as the CQ's signal socket: a completion armed with [`Cq::arm_to_signal`]
    /// makes the engine write a byte to it, so the pair's other end reads readable (no
    /// `CqNotify` event). A uVP's CQ uses it where the uVP can ([`Cq::can_signal`]
    /// says so).
    pub fn create_cq_signalled(
        self: &Arc<Self>,
        dev: u32,
        depth: u32,
        signal: Option<BorrowedFd<'_>>,
    ) -> Result<Arc<Cq>> {
        if let Some(udev) = self.user_device(dev)? {
            let (handle, user) = self.mirrored(dev, abi::MIRROR_CQ, [0; 4], (0, 0), |h| {
                udev.create_cq_signalled(depth, self.sink(h), signal)
            })?;
            return Ok(self.cq_object(handle, dev, CqPath::Device(user), signal.is_some()));
        }
        let cap = ring_capacity(depth).ok_or(VerbsError::Invalid)?;
        let mem = Arc::new(SharedMem::create("krdma-cq", ring_bytes::<Cqe>(cap))?);
        let mut a = abi::CreateCq {
            dev,
            cqe: depth,
            memfd: mem.fd().as_raw_fd(),
            handle: 0,
            signal: signal.map_or(-1, |f| f.as_raw_fd()),
        };
        self.call(cmd::CREATE_CQ, &mut a)?;
        let ring = Ring::attach(mem, 0, cap)?.consumer();
        let user = match self.chan.direct_progress(a.handle) {
            Some(p) => UserCq::with_progress(ring, p),
            None => UserCq::new(ring),
        };
        Ok(self.cq_object(a.handle, dev, CqPath::Ring(user), signal.is_some()))
    }

    fn cq_object(
        self: &Arc<Self>,
        handle: u32,
        dev: u32,
        path: CqPath,
        signalled: bool,
    ) -> Arc<Cq> {
        let events = self.subscribe(handle);
        Arc::new(Cq {
            ctx: self.clone(),
            handle,
            dev,
            path,
            signalled,
            events,
        })
    }
}

/// How a CQ is polled.
pub(super) enum CqPath {
    /// A completion ring shared with the engine behind the kAL.
    Ring(UserCq),
    /// The CQ of the device's uVP in this process.
    Device(Arc<dyn user_half::UserCq>),
}

/// A completion queue; polled without a system call.
pub struct Cq {
    ctx: Arc<Context>,
    pub handle: u32,
    pub dev: u32,
    pub(super) path: CqPath,
    /// Created with a signal socket ([`Context::create_cq_signalled`]).
    signalled: bool,
    events: Receiver<Event>,
}

impl Cq {
    /// The memory of the completion ring (see [`Qp::ring_memory`]); `None` on a device
    /// whose fast path is the consumer's.
    pub fn ring_memory(&self) -> Option<Arc<SharedMem>> {
        match &self.path {
            CqPath::Ring(r) => Some(r.ring_memory()),
            CqPath::Device(_) => None,
        }
    }

    /// Take up to `out.len()` completions without a system call (none in a fork child:
    /// the queue is the parent's).
    pub fn poll(&self, out: &mut [Cqe]) -> usize {
        if self.ctx.here().is_err() {
            return 0;
        }
        match &self.path {
            CqPath::Ring(r) => r.poll(out),
            CqPath::Device(d) => d.poll(out),
        }
    }

    /// For a consumer that waits on memory rather than on this CQ (spinning on the last
    /// byte of a peer's RDMA Write, as `ib_write_lat` does): lend the thread to the engine
    /// once, as an empty poll does, without taking a completion. In embedded mode the
    /// consumer's polls receive for the device, and its receive thread stays away while
    /// they go on; a consumer that polled, then waits on memory without this, waits for
    /// that thread (hundreds of µs). Elsewhere (through krdmad, or a device that works by
    /// itself) it does nothing. Whether anything moved.
    pub fn drive(&self) -> bool {
        if self.ctx.here().is_err() {
            return false;
        }
        match &self.path {
            CqPath::Ring(r) => r.drive(),
            CqPath::Device(_) => false,
        }
    }

    /// Whether a consumer waiting for completions does better to poll for a while than to
    /// sleep at once: its polls drive the engine (embedded mode, see `rnicpi::progress`) or
    /// the device works by itself (a uVP's adapter). Through krdmad a poller only takes the
    /// CPU the daemon needs.
    pub fn worth_spinning(&self) -> bool {
        match &self.path {
            CqPath::Ring(r) => r.drives_progress(),
            CqPath::Device(d) => d.worth_spinning(),
        }
    }

    /// Ask for a `CqNotify` event on the next (solicited) completion.
    pub fn arm(&self, solicited_only: bool) {
        if self.ctx.here().is_err() {
            return;
        }
        match &self.path {
            CqPath::Ring(r) => r.arm(solicited_only),
            CqPath::Device(d) => {
                if let Err(e) = d.arm(solicited_only) {
                    tracing::warn!(cq = self.handle, error = %e, "arming the CQ failed");
                }
            }
        }
    }

    /// Arm to be told of the next completion (or the next solicited/error one) through
    /// the CQ's signal socket ([`Context::create_cq_signalled`]) instead of a `CqNotify`
    /// event: through krdmad the engine writes to the socket itself, and a thread asleep
    /// in `poll` on the pair's other end wakes without the event path. As with
    /// [`Cq::arm`], look at the ring once more after arming. False (and nothing armed)
    /// when the CQ has no socket or no engine to write it ([`Cq::can_signal`]): use
    /// [`Cq::arm`].
    pub fn arm_to_signal(&self, solicited_only: bool) -> bool {
        if !self.can_signal() || self.ctx.here().is_err() {
            return false;
        }
        match &self.path {
            CqPath::Ring(r) => r.arm_to_signal(solicited_only),
            CqPath::Device(d) => d.arm_to_signal(solicited_only),
        }
        true
    }

    /// Whether [`Cq::arm_to_signal`] can arm: a signal socket, and an engine to write it.
    pub fn can_signal(&self) -> bool {
        self.signalled
            && match &self.path {
                CqPath::Ring(_) => true,
                CqPath::Device(d) => d.can_signal(),
            }
    }

    /// How many notifications the engine has given through the signal socket so far
    /// (a count in the ring's header, bumped after each byte is written): a consumer that
    /// read it before draining the socket knows whether a byte came since.
    pub fn signals_given(&self) -> u32 {
        match &self.path {
            CqPath::Ring(r) => r.signals_given(),
            CqPath::Device(d) => d.signals_given(),
        }
    }

    /// Events of this CQ (`CqNotify`, `CqError`, `AccessLayerDead`).
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Arm the CQ for [`Cq::sleep`]: the next completion (with `solicited_only`, the
    /// next solicited or error completion) ends the sleep. As with [`Cq::arm`], a
    /// completion that landed before the arm ends nothing: poll once more, then sleep.
    ///
    /// On a completion ring shared with the engine the engine wakes the sleeper itself
    /// (a futex in the ring's header): no `CqNotify` event is made (none reaches
    /// [`Cq::events`]), so through krdmad the wake-up skips the event queue, the
    /// device-file round trips and the uAL's event threads. On a uVP's CQ the uVP does
    /// the same where it can ([`Cq::sleeps_on_ring`]); elsewhere this is [`Cq::arm`] and
    /// the sleep waits for the `CqNotify` event.
    pub fn arm_to_sleep(&self, solicited_only: bool) -> Armed {
        if self.ctx.here().is_err() {
            return Armed(0);
        }
        match &self.path {
            CqPath::Ring(r) => Armed(r.arm_to_sleep(solicited_only)),
            CqPath::Device(d) if d.can_sleep() => Armed(d.arm_to_sleep(solicited_only)),
            CqPath::Device(_) => {
                self.arm(solicited_only);
                Armed(0)
            }
        }
    }

    /// Whether [`Cq::sleep`] sleeps on the completion ring (woken by the engine itself,
    /// no `CqNotify` event made) rather than waiting for a `CqNotify` event.
    pub fn sleeps_on_ring(&self) -> bool {
        match &self.path {
            CqPath::Ring(_) => true,
            CqPath::Device(d) => d.can_sleep(),
        }
    }

    /// End the sleep of this process's threads in [`Cq::sleep`] on the ring, for
    /// something other than a completion (a layer above waits for more than the CQ).
    pub fn wake_sleepers(&self) {
        match &self.path {
            CqPath::Ring(r) => r.wake_sleepers(),
            CqPath::Device(d) => d.wake_sleepers(),
        }
    }

    /// Sleep until the completion armed for comes, or `timeout` passes (or a signal, or
    /// [`Cq::wake_sleepers`]); `Dead` once the access layer is gone. Nothing is taken
    /// from the CQ.
    pub fn sleep(&self, armed: Armed, timeout: Duration) -> Result<()> {
        self.ctx.here()?;
        let slice = timeout.min(DEATH_CHECK);
        match &self.path {
            CqPath::Ring(r) => r.sleep(armed.0, slice),
            CqPath::Device(d) if d.can_sleep() => d.sleep(armed.0, slice),
            CqPath::Device(_) => {
                return match self.events.recv_timeout(slice) {
                    Ok(ev) if ev.kind == rnicpi::EventKind::AccessLayerDead => {
                        Err(VerbsError::Dead)
                    }
                    _ => Ok(()),
                }
            }
        }
        // The daemon's death wakes no futex: look for it every slice.
        if self.ctx.dispatcher.is_dead() {
            return Err(VerbsError::Dead);
        }
        Ok(())
    }

    /// Wait for `n` completions: poll for up to [`SPIN_BUDGET`], giving the CPU away
    /// between polls, then sleep on CQ notifications. A consumer that only spins would hold
    /// a core the engine needs to make its completions (on a two-core host it can stall
    /// it for a whole scheduler slice); one that sleeps at once pays a wake-up per
    /// completion.
    pub fn wait(&self, n: usize, timeout: Duration) -> Result<Vec<Cqe>> {
        let start = std::time::Instant::now();
        let deadline = start + timeout;
        let mut out = Vec::with_capacity(n);
        let mut buf = [Cqe::default(); 16];
        let mut spin_from = start;
        while out.len() < n {
            let got = self.poll(&mut buf[..(n - out.len()).min(16)]);
            out.extend_from_slice(&buf[..got]);
            if got > 0 {
                spin_from = std::time::Instant::now();
                continue;
            }
            let now = std::time::Instant::now();
            if now < spin_from + SPIN_BUDGET {
                std::thread::yield_now();
                continue;
            }
            if now >= deadline {
                return Err(VerbsError::TimedOut);
            }
            let armed = self.arm_to_sleep(false);
            // Re-check after arming: a completion may have landed before the arm.
            let got = self.poll(&mut buf[..(n - out.len()).min(16)]);
            out.extend_from_slice(&buf[..got]);
            if got == 0 {
                self.sleep(armed, deadline - now)?;
            }
            spin_from = std::time::Instant::now();
        }
        Ok(out)
    }
}

/// What [`Cq::arm_to_sleep`] hands [`Cq::sleep`]: the count of the ring's wake-ups
/// before the arm.
#[derive(Debug, Clone, Copy)]
pub struct Armed(pub(crate) u32);

/// The longest [`Cq::sleep`] sleeps at a time (on a completion ring it then looks
/// whether the access layer died).
const DEATH_CHECK: Duration = Duration::from_millis(50);

/// How long [`Cq::wait`] polls before it sleeps on a notification. Through krdmad a
/// wake-up costs more than a round trip (50 µs here put the ping-pong's p99 at 100–200 µs).
pub const SPIN_BUDGET: Duration = Duration::from_millis(1);

impl Drop for Cq {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_CQ, self.handle);
        if let CqPath::Device(d) = &self.path {
            self.ctx.keep_in_fork_child(d.clone());
        }
    }
}
