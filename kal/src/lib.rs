//! # kal — the krdma kernel access layer
//!
//! One instance per host (the `krdmad` daemon, or in-process in embedded mode). It holds
//! the functional blocks of the OpenRDMA kAL:
//!
//! * interface adapter management — providers register at start-up ([`Kal::register`]);
//! * resource management — a [`context`] per open of the device, the root of its
//!   resource tree, torn down children-first on close or process death; per-user and
//!   global [`quota`]s on everything a context holds in the kAL;
//! * memory management — registration checks, pin accounting per user ([`pin`]), and the
//!   engine's access to consumer memory through the context's [`Peer`];
//! * event management — a bounded event queue per context ([`events`]);
//! * system call management — the ioctl ABI ([`abi`], dispatched in [`dispatch`]);
//! * LLP management — host routes, addresses and TCP sockets for providers ([`services`]).
//!
//! Front doors: [`fuse`] serves the kAL as `/dev/krdma`, where every request is checked
//! against the process that opened the context ([`opener`]); embedded mode calls
//! [`Kal::ioctl`] directly with an [`EmbeddedPeer`], refused in a fork child ([`rnicpi::fork`]).
//! Both pass the same command structs.
//!
//! The kAL names no provider: `krdma-stack` assembles it with siw0 and rxe0, for the
//! `krdmad` daemon and for the uAL's embedded mode alike.

pub use abi;
pub mod backing;
pub mod context;
pub mod counters;
pub mod cq_signal;
pub mod creds;
mod dispatch;
pub mod doorbell;
pub mod events;
pub mod fuse;
pub mod mapped;
pub mod opener;
pub mod peer;
pub mod pin;
pub mod priority;
pub mod process;
pub mod procmem;
pub mod quota;
pub mod services;
pub mod watch;

pub use context::Limits;
pub use creds::Requester;
pub use peer::{Caller, EmbeddedPeer, Peer};
pub use quota::{Quota, Resource};

use context::Context;
use parking_lot::{Mutex, RwLock};
use quota::{Charge, Ledger};
use rnicpi::{Counter, Doorbell, Progress, Provider, Result, RingStats, VerbsError};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

pub type ContextId = u32;

/// Settings of one kAL instance.
#[derive(Debug, Clone)]
pub struct Config {
    /// Per-context object limits.
    pub limits: Limits,
    /// Event records one context may have queued.
    pub event_queue: usize,
    /// What one user (uid) may hold over all their contexts.
    pub quota: Quota,
    /// What all users together may hold (within each device's own limits as well).
    pub limit: Quota,
    /// Pin limit per user in bytes, overriding each caller's RLIMIT_MEMLOCK.
    pub pin_limit: Option<u64>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            limits: Limits::default(),
            event_queue: 4096,
            quota: Quota::PER_USER,
            limit: Quota::GLOBAL,
            pin_limit: None,
        }
    }
}

/// What the kAL refused at its own level (besides quotas), for `krdma stat`.
#[derive(Debug, Default)]
struct Refusals {
    /// Ring memory that was not a sealed memfd of the right size.
    ring_memory: AtomicU64,
    /// Doorbells that were not non-blocking eventfds.
    doorbell: AtomicU64,
    /// CQ signal sockets that were not Unix stream socket pairs of the caller's user.
    cq_signal: AtomicU64,
}

impl Refusals {
    fn counters(&self) -> [Counter; 3] {
        [
            (
                "ring_memory_refused",
                self.ring_memory.load(Ordering::Relaxed),
            ),
            ("doorbell_refused", self.doorbell.load(Ordering::Relaxed)),
            ("cq_signal_refused", self.cq_signal.load(Ordering::Relaxed)),
        ]
    }
}

/// The kernel access layer.
pub struct Kal {
    config: Config,
    devices: RwLock<Vec<Arc<dyn Provider>>>,
    contexts: RwLock<BTreeMap<ContextId, Arc<Context>>>,
    /// The next context id to try (ids in use are skipped, so one never aliases).
    next_ctx: Mutex<u32>,
    pins: pin::PinAccounts,
    ledger: Arc<Ledger>,
    ring_stats: Arc<RingStats>,
    refusals: Refusals,
    /// What became of the engines' CQ signals.
    signals: Arc<cq_signal::SignalStats>,
    /// Doorbells served by the contexts' doorbell threads.
    doorbells_rung: Arc<AtomicU64>,
    /// The process the kAL was created in: a fork child's copy refuses every call.
    lineage: rnicpi::fork::Lineage,
    /// What the checks of who asks and of registered memory refused.
    checks: counters::Counters,
}

impl Kal {
    pub fn new(config: Config) -> Arc<Kal> {
        Arc::new(Kal {
            ledger: Ledger::new(config.quota, config.limit),
            config,
            devices: RwLock::new(Vec::new()),
            contexts: RwLock::new(BTreeMap::new()),
            next_ctx: Mutex::new(1),
            pins: pin::PinAccounts::default(),
            ring_stats: Arc::default(),
            refusals: Refusals::default(),
            signals: Default::default(),
            doorbells_rung: Arc::default(),
            lineage: rnicpi::fork::Lineage::here(),
            checks: counters::Counters::default(),
        })
    }

    /// Charge `n` of `r` to `uid` (to device `dev` too for verbs objects).
    fn charge(&self, uid: u32, dev: Option<u32>, r: Resource, n: u64) -> Result<Charge> {
        let provider = dev.map(|d| self.device(d)).transpose()?;
        let dev = dev.zip(provider.as_ref()).map(|(d, p)| (d, p.attr()));
        Ok(self.ledger.charge(uid, dev, r, n)?)
    }

    /// The kAL's own counters: refusals (quotas, ring memory, doorbells, requests not
    /// from a context's opener, registered memory, privileged ports, fork children) and
    /// what the engines could not do with consumers' rings.
    pub fn counters(&self) -> Vec<Counter> {
        let mut v = self.ledger.counters();
        v.extend(self.refusals.counters());
        v.extend(self.signals.counters());
        v.extend(self.checks.list());
        v.extend(self.ring_stats.counters());
        v.push((
            "doorbells_rung",
            self.doorbells_rung.load(Ordering::Relaxed),
        ));
        v
    }

    /// Count a request refused because of who made it (the daemon's front door).
    pub fn refused(&self, why: opener::Refusal) {
        self.checks.refused(why);
    }

    /// `Permission` in a fork child of the process this kAL lives in: its provider
    /// threads do not exist there and its locks may be held by threads that are gone.
    fn here(&self) -> Result<()> {
        if self.lineage.is_here() {
            return Ok(());
        }
        counters::Counters::bump(&self.checks.fork_child_refused);
        Err(VerbsError::Permission)
    }

    /// Register a provider's device; returns its device number.
    pub fn register(&self, dev: Arc<dyn Provider>) -> Result<u32> {
        let mut devs = self.devices.write();
        if devs.len() >= abi::MAX_DEVICES || devs.iter().any(|d| d.attr().name == dev.attr().name) {
            return Err(VerbsError::Invalid);
        }
        tracing::info!(name = %dev.attr().name, transport = dev.attr().transport.name(), "device registered");
        devs.push(dev);
        Ok(devs.len() as u32 - 1)
    }

    pub fn devices(&self) -> Vec<Arc<dyn Provider>> {
        self.devices.read().clone()
    }

    fn device(&self, dev: u32) -> Result<Arc<dyn Provider>> {
        self.devices
            .read()
            .get(dev as usize)
            .cloned()
            .ok_or(VerbsError::NoSuchResource)
    }

    fn context(&self, ctx: ContextId) -> Result<Arc<Context>> {
        self.contexts
            .read()
            .get(&ctx)
            .cloned()
            .ok_or(VerbsError::NoSuchResource)
    }

    /// Open a context for `caller`, reached through `peer`.
    pub fn open(&self, caller: Caller, peer: Arc<dyn Peer>) -> Result<ContextId> {
        self.here()?;
        let charge = self.charge(caller.uid, None, Resource::Context, 1)?;
        let mut ctxs = self.contexts.write();
        let id = rnicpi::ids::next_free(&mut self.next_ctx.lock(), ctxs.len(), |id| {
            ctxs.contains_key(&id)
        })
        .ok_or(VerbsError::Exhausted)?;
        ctxs.insert(
            id,
            Arc::new(Context::new(
                id,
                caller,
                peer,
                self.config.event_queue,
                charge,
                self.doorbells_rung.clone(),
            )),
        );
        tracing::info!(
            ctx = id,
            pid = caller.pid,
            uid = caller.uid,
            "context opened"
        );
        Ok(id)
    }

    /// Execute one command for the calling thread of this process (embedded mode); `arg`
    /// is the whole in/out struct.
    pub fn ioctl(&self, ctx: ContextId, cmd: u32, arg: &mut [u8]) -> Result<()> {
        self.ioctl_as(ctx, &Requester::ThisThread, cmd, arg)
    }

    /// Execute one command for `who` (the daemon's front door: a thread already checked
    /// against the context's opener).
    pub fn ioctl_as(
        &self,
        ctx: ContextId,
        who: &Requester,
        cmd: u32,
        arg: &mut [u8],
    ) -> Result<()> {
        self.here()?;
        let c = self.context(ctx)?;
        let r = dispatch::ioctl(self, &c, who, cmd, arg);
        if let Err(e) = r {
            tracing::debug!(ctx, cmd = abi::cmd::name(cmd), error = %e, "ioctl failed");
        }
        r
    }

    /// Move whole event records into `out`; `Ok(0)` when none are queued.
    pub fn read_events(&self, ctx: ContextId, out: &mut [u8]) -> Result<usize> {
        self.here()?;
        let c = self.context(ctx)?;
        let max = out.len() / abi::EVENT_SIZE;
        if max == 0 {
            return Err(VerbsError::Invalid);
        }
        let evs = c.events.pop(max);
        for (i, ev) in evs.iter().enumerate() {
            let rec = abi::EventRecord::from_event(ev);
            out[i * abi::EVENT_SIZE..(i + 1) * abi::EVENT_SIZE]
                .copy_from_slice(bytemuck::bytes_of(&rec));
        }
        Ok(evs.len() * abi::EVENT_SIZE)
    }

    /// Whether an event is queued for `ctx`.
    pub fn readable(&self, ctx: ContextId) -> bool {
        self.lineage.is_here()
            && self
                .context(ctx)
                .map(|c| !c.events.is_empty())
                .unwrap_or(false)
    }

    /// `waker` is called (from any thread) whenever an event is queued for `ctx`.
    pub fn set_waker(&self, ctx: ContextId, waker: Option<events::Waker>) {
        if self.here().is_err() {
            return;
        }
        if let Ok(c) = self.context(ctx) {
            c.events.set_waker(waker);
        }
    }

    /// Tear a context down, children first; idempotent. A no-op in a fork child (the
    /// context is the parent's).
    pub fn release(&self, ctx: ContextId) {
        if self.here().is_err() {
            return;
        }
        let Some(c) = self.contexts.write().remove(&ctx) else {
            return;
        };
        c.events.set_waker(None);
        // What the context posted goes out before its QPs go (`Doorbells::serve_all`).
        c.doorbells.serve_all();
        c.doorbells.stop();
        let mut objs = c.objects.lock();
        let order = objs.teardown_order();
        let n = order.len();
        for h in order {
            if let Some((obj, charges)) = objs.remove(h) {
                self.destroy(&c, &obj);
                drop(charges);
            }
        }
        tracing::info!(ctx, pid = c.caller.pid, objects = n, "context released");
    }

    /// Destroy an object already removed from its context's table.
    fn destroy(&self, c: &Context, obj: &context::Object) {
        if let context::Object::Qp {
            doorbell: Some(token),
            ..
        } = obj
        {
            c.doorbells.remove(*token);
        }
        if let Ok(dev) = self.device(context::object_dev(obj)) {
            context::destroy_object(dev.as_ref(), obj);
        }
        if obj.pinned() > 0 {
            self.pins.release(c.caller.uid, obj.pinned());
        }
    }

    /// Embedded mode: a doorbell that calls the QP's provider directly.
    pub fn doorbell_for(&self, ctx: ContextId, qp: u32) -> Result<Arc<dyn Doorbell>> {
        let (_, qp) = self.in_process(ctx)?.objects.lock().qp(qp)?;
        Ok(Arc::new(DirectDoorbell(Arc::downgrade(&qp), self.lineage)))
    }

    /// Embedded mode: the progress handle of a CQ, through which the consumer's empty
    /// polls drive the engine ([`rnicpi::progress`]).
    pub fn progress_for(&self, ctx: ContextId, cq: u32) -> Result<Arc<dyn Progress>> {
        let (_, cq) = self.in_process(ctx)?.objects.lock().cq(cq)?;
        Ok(Arc::new(DirectProgress(Arc::downgrade(&cq), self.lineage)))
    }

    /// A context whose consumer is this process (the direct calls of embedded mode are
    /// refused to any other, and in a fork child).
    fn in_process(&self, ctx: ContextId) -> Result<Arc<Context>> {
        self.here()?;
        let c = self.context(ctx)?;
        if !c.peer.in_process() {
            return Err(VerbsError::Permission);
        }
        Ok(c)
    }

    /// Contexts open now.
    pub fn context_count(&self) -> usize {
        self.contexts.read().len()
    }

    /// Pinned bytes over all users.
    pub fn pinned_total(&self) -> u64 {
        self.pins.total()
    }

    /// Release every context (daemon shutdown).
    pub fn shutdown(&self) {
        let ids: Vec<ContextId> = self.contexts.read().keys().copied().collect();
        for id in ids {
            self.release(id);
        }
    }
}

/// Embedded mode's doorbell: a call into the provider, never from a fork child (the
/// provider's threads are not there).
struct DirectDoorbell(Weak<dyn rnicpi::ProviderQp>, rnicpi::fork::Lineage);

impl Doorbell for DirectDoorbell {
    fn ring(&self) {
        if !self.1.is_here() {
            return;
        }
        if let Some(qp) = self.0.upgrade() {
            qp.doorbell();
        }
    }
}

/// Embedded mode's progress handle of a CQ: its engine's sources, never driven from a
/// fork child (the provider's threads and sockets are the parent's).
struct DirectProgress(Weak<dyn rnicpi::ProviderCq>, rnicpi::fork::Lineage);

impl Progress for DirectProgress {
    fn progress(&self) -> bool {
        self.1.is_here()
            && self
                .0
                .upgrade()
                .is_some_and(|cq| cq.engine().progress_sources().progress())
    }

    fn release(&self) {
        if let (true, Some(cq)) = (self.1.is_here(), self.0.upgrade()) {
            cq.engine().progress_sources().release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(kal: &Kal) -> ContextId {
        let me = Caller {
            pid: std::process::id(),
            uid: 77,
            gid: 77,
        };
        kal.open(me, Arc::new(EmbeddedPeer)).unwrap()
    }

    #[test]
    fn context_ids_never_alias_a_live_one_after_wrapping() {
        let kal = Kal::new(Config::default());
        let long_lived = open(&kal);
        assert_eq!(long_lived, 1);
        // Seed the counter near the wrap, as 2^32 opens would leave it.
        *kal.next_ctx.lock() = u32::MAX - 1;
        let mut seen = vec![long_lived];
        for _ in 0..4 {
            let id = open(&kal);
            assert!(id != 0 && !seen.contains(&id), "context id {id} aliases");
            seen.push(id);
        }
        assert_eq!(seen[1..], [u32::MAX - 1, u32::MAX, 2, 3]);
        // The long-lived context is still the one it was: its own objects and events.
        assert_eq!(kal.context_count(), 5);
        assert_eq!(kal.context(long_lived).unwrap().id, long_lived);
        for id in &seen[1..] {
            kal.release(*id);
        }
        *kal.next_ctx.lock() = 1;
        assert_eq!(open(&kal), 2, "a free id is reused, the live one skipped");
    }
}
