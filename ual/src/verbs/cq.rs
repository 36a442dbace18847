//! Completion queues: polled in shared memory, armed for notification through the kAL.

use super::*;

impl Context {
    pub fn create_cq(self: &Arc<Self>, dev: u32, depth: u32) -> Result<Arc<Cq>> {
        let cap = ring_capacity(depth).ok_or(VerbsError::Invalid)?;
        let mem = Arc::new(SharedMem::create("krdma-cq", ring_bytes::<Cqe>(cap))?);
        let mut a = abi::CreateCq {
            dev,
            cqe: depth,
            memfd: mem.fd().as_raw_fd(),
            handle: 0,
        };
        self.call(cmd::CREATE_CQ, &mut a)?;
        let ring = Ring::attach(mem, 0, cap)?.consumer();
        let events = self.subscribe(a.handle);
        Ok(Arc::new(Cq {
            ctx: self.clone(),
            handle: a.handle,
            dev,
            user: UserCq::new(ring),
            events,
        }))
    }
}

/// A completion queue; polled in shared memory.
pub struct Cq {
    ctx: Arc<Context>,
    pub handle: u32,
    pub dev: u32,
    user: UserCq,
    events: Receiver<Event>,
}

impl Cq {
    /// The memory of the completion ring (see [`Qp::ring_memory`]).
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.user.ring_memory()
    }

    /// Take up to `out.len()` completions without a system call (none in a fork child:
    /// the ring is the parent's).
    pub fn poll(&self, out: &mut [Cqe]) -> usize {
        match self.ctx.here() {
            Ok(()) => self.user.poll(out),
            Err(_) => 0,
        }
    }

    /// Ask for a `CqNotify` event on the next (solicited) completion.
    pub fn arm(&self, solicited_only: bool) {
        if self.ctx.here().is_ok() {
            self.user.arm(solicited_only)
        }
    }

    /// Events of this CQ (`CqNotify`, `CqError`, `AccessLayerDead`).
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Wait for `n` completions, spinning briefly and then sleeping on CQ notifications.
    pub fn wait(&self, n: usize, timeout: Duration) -> Result<Vec<Cqe>> {
        let deadline = std::time::Instant::now() + timeout;
        let mut out = Vec::with_capacity(n);
        let mut buf = [Cqe::default(); 16];
        let mut spins = 0u32;
        while out.len() < n {
            let got = self.poll(&mut buf[..(n - out.len()).min(16)]);
            out.extend_from_slice(&buf[..got]);
            if got > 0 {
                spins = 0;
                continue;
            }
            spins += 1;
            if spins < 20_000 {
                std::hint::spin_loop();
                continue;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(VerbsError::TimedOut);
            }
            self.arm(false);
            // Re-check after arming: a completion may have landed before the arm.
            let got = self.poll(&mut buf[..(n - out.len()).min(16)]);
            out.extend_from_slice(&buf[..got]);
            if got == 0 {
                match self
                    .events
                    .recv_timeout((deadline - now).min(Duration::from_millis(50)))
                {
                    Ok(ev) if ev.kind == rnicpi::EventKind::AccessLayerDead => {
                        return Err(VerbsError::Dead)
                    }
                    _ => {}
                }
            }
        }
        Ok(out)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_CQ, self.handle);
    }
}
