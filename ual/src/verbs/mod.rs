//! Verbs objects over a kAL context. This file holds the [`Context`] (open, devices and
//! ports, statistics, the event thread); each object lives in its own file with the
//! context call that creates it, as libibverbs splits `device.c` from `verbs.c`: PDs
//! and address handles (`pd`), CQs (`cq`), QPs (`qp`), SRQs (`srq`), MRs and memory windows (`mr`), listeners
//! (`listener`).

mod cq;
mod listener;
mod mr;
mod pd;
mod qp;
mod srq;

use cq::CqPath;
pub use cq::{Armed, Cq, SPIN_BUDGET};
pub use listener::Listener;
pub use mr::{Mr, Mw};
pub use pd::{Ah, Pd};
pub use qp::{Qp, QpConfig};
pub use srq::Srq;
use srq::SrqPath;

use crate::buffer::RegBuf;
use crate::channel::{Channel, Target};
use crate::device::eventfd;
use crate::events::{channel_handler, Dispatcher, Handler};
use crate::pin;
use crate::uvp::{self, HandleSink};
use abi::cmd;
use bytemuck::Zeroable;
use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use rnicpi::fork::Lineage;
use rnicpi::queue::{ring_bytes, ring_capacity};
use rnicpi::user as user_half;
use rnicpi::{
    Access, ConnParam, Cqe, DeviceAttr, Doorbell, Event, QpAttr, QpAttrMask, QpCaps, QpRingLayout,
    QpState, QpType, Result, Ring, SharedMem, SrqAttr, Transport, UserCq, UserQp, UserSrq,
    VerbsError, Wqe,
};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// An open kAL context: the root of this process's resources on one front door.
///
/// It belongs to the process that opened it. In a `fork()` child (which has copies of
/// these objects but none of the threads behind them) every call fails with
/// `Permission` and nothing touches the parent's rings, kAL or event thread: the kAL
/// refuses the child too, through the device file as well as embedded.
pub struct Context {
    chan: Arc<Channel>,
    dispatcher: Arc<Dispatcher>,
    id: u32,
    /// The event thread; stopped and joined on drop so the device closes at once.
    events: Mutex<Option<std::thread::JoinHandle<()>>>,
    home: Lineage,
    /// Devices whose objects this process makes itself, through their uVP.
    opened: uvp::Opened,
}

/// Where a context runs the engine of a device that offers both fast paths
/// (`FastPath::Either`, siw through krdmad).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastPathChoice {
    /// In this process, through the device's uVP (objects mirrored in the kAL): post,
    /// poll and the engine's socket I/O never cross the daemon.
    Consumer,
    /// Shared rings to the engine behind the kAL, and its doorbell.
    Kal,
}

/// [`FastPathChoice::set_for_process`]'s choice: 0 none, 1 consumer, 2 kAL.
static PROCESS_CHOICE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

impl FastPathChoice {
    /// The choice of contexts opened without one ([`Context::open`],
    /// [`Context::open_target`]): what [`FastPathChoice::set_for_process`] set, else
    /// `KRDMA_FAST_PATH=kal` selects [`FastPathChoice::Kal`] and anything else (or nothing)
    /// [`FastPathChoice::Consumer`].
    pub fn from_env() -> FastPathChoice {
        match PROCESS_CHOICE.load(std::sync::atomic::Ordering::Acquire) {
            1 => return FastPathChoice::Consumer,
            2 => return FastPathChoice::Kal,
            _ => {}
        }
        match std::env::var("KRDMA_FAST_PATH") {
            Ok(v) if v == "kal" => FastPathChoice::Kal,
            _ => FastPathChoice::Consumer,
        }
    }

    /// Make `self` the choice of every context this process opens from now on without
    /// one (a program, or a test, that wants one path whatever the environment says).
    pub fn set_for_process(self) {
        let v = match self {
            FastPathChoice::Consumer => 1,
            FastPathChoice::Kal => 2,
        };
        PROCESS_CHOICE.store(v, std::sync::atomic::Ordering::Release);
    }
}

/// What `QUERY_DEVICE` reports, decoded (name, transport and GUID also at hand on top).
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub index: u32,
    pub name: String,
    pub transport: Transport,
    pub node_guid: u64,
    /// Everything `QUERY_DEVICE` reports.
    pub attr: DeviceAttr,
}

/// What `QUERY_PORT` reports.
pub type PortInfo = rnicpi::PortAttr;

impl Context {
    /// Open the front door `KRDMA_DEVICE` selects (see [`Target::from_env`]).
    pub fn open() -> Result<Arc<Context>> {
        Self::open_target(&Target::from_env())
    }

    pub fn open_target(target: &Target) -> Result<Arc<Context>> {
        Self::open_target_with(target, FastPathChoice::from_env())
    }

    /// [`Context::open_target`], choosing where the engine of a device that offers both
    /// fast paths (`FastPath::Either`: siw through krdmad) runs for this context.
    pub fn open_target_with(target: &Target, choice: FastPathChoice) -> Result<Arc<Context>> {
        Self::open_channel(Channel::open(target)?, choice)
    }

    /// A context over an open front door.
    pub(crate) fn open_channel(chan: Channel, choice: FastPathChoice) -> Result<Arc<Context>> {
        let mut q = abi::QueryAbi::zeroed();
        chan.call(cmd::QUERY_ABI, &mut q)?;
        if q.version != abi::ABI_VERSION || q.event_size as usize != abi::EVENT_SIZE {
            tracing::error!(
                kal = q.version,
                ual = abi::ABI_VERSION,
                "kAL ABI version mismatch"
            );
            return Err(VerbsError::Unsupported);
        }
        let chan_embedded = chan.is_embedded();
        let chan = Arc::new(chan);
        let dispatcher = Dispatcher::new();
        let events = start_event_thread(q.context, chan.clone(), dispatcher.clone());
        Ok(Arc::new(Context {
            chan,
            dispatcher,
            id: q.context,
            events: Mutex::new(Some(events)),
            home: Lineage::here(),
            // In embedded mode the engine is in this process already.
            opened: uvp::Opened::new(choice == FastPathChoice::Consumer && !chan_embedded),
        }))
    }

    /// `Permission` in a fork child of the process that opened the context.
    fn here(&self) -> Result<()> {
        match self.home.is_here() {
            true => Ok(()),
            false => Err(VerbsError::Permission),
        }
    }

    /// The kAL's id of this context (as `krdma stat` shows it).
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn channel(&self) -> &Channel {
        &self.chan
    }

    pub fn is_embedded(&self) -> bool {
        self.chan.is_embedded()
    }

    fn call<T: bytemuck::Pod>(&self, c: u32, arg: &mut T) -> Result<()> {
        self.here()?;
        self.chan.call(c, arg)
    }

    fn destroy(&self, c: u32, handle: u32) {
        if self.here().is_err() {
            return; // the parent's object, not ours to destroy
        }
        self.dispatcher.remove(handle);
        let mut d = abi::Destroy { handle, _pad: 0 };
        if let Err(e) = self.call(c, &mut d) {
            if e != VerbsError::Dead {
                tracing::warn!(handle, cmd = abi::cmd::name(c), error = %e, "destroy failed");
            }
        }
    }

    /// Device `dev`, opened in this process, when its fast path is the consumer's (its
    /// objects are then made here by its user verbs provider and mirrored in the kAL).
    fn user_device(&self, dev: u32) -> Result<Option<Arc<dyn user_half::UserDevice>>> {
        self.here()?;
        self.opened
            .get(dev, || Ok(self.query_device(dev)?.attr.fast_path))
    }

    /// Whether device `dev`'s objects are made in this process by its user verbs
    /// provider (a hardware device's uVP, or siw's engine through krdmad unless this
    /// context chose the daemon's) rather than by the kAL.
    pub fn device_in_process(&self, dev: u32) -> Result<bool> {
        Ok(self.user_device(dev)?.is_some())
    }

    /// Record in the kAL an object about to be made by a uVP, make it with `make` (given
    /// the object's handle), and take the record back if that fails.
    fn mirrored<T>(
        &self,
        dev: u32,
        kind: u32,
        parents: [u32; 4],
        range: (u64, u64),
        make: impl FnOnce(u32) -> Result<T>,
    ) -> Result<(u32, T)> {
        let mut a = abi::Mirror {
            dev,
            kind,
            parents,
            addr: range.0,
            length: range.1,
            ..Zeroable::zeroed()
        };
        self.call(cmd::MIRROR, &mut a)?;
        match make(a.handle) {
            Ok(t) => Ok((a.handle, t)),
            Err(e) => {
                self.destroy(mirror_destroy_cmd(kind), a.handle);
                Err(e)
            }
        }
    }

    /// Drop `extra`, a second reference to (or the owner of) an object of a device's uVP —
    /// except in a fork child, where the object is the parent's, made on a device file
    /// the child shares: destroying it there would destroy the parent's. The child leaks
    /// it instead, so the object outlives the child's copy of its owner.
    fn keep_in_fork_child<T>(&self, extra: T) {
        match self.home.is_here() {
            true => drop(extra),
            false => std::mem::forget(extra),
        }
    }

    /// Where a uVP delivers the events of object `handle`.
    fn sink(&self, handle: u32) -> Arc<dyn rnicpi::EventSink> {
        Arc::new(HandleSink {
            dispatcher: self.dispatcher.clone(),
            handle,
        })
    }

    /// Register `h` for the events of object `handle`.
    pub fn set_handler(&self, handle: u32, h: Handler) {
        self.dispatcher.set(handle, h);
    }

    /// Receive the events of object `handle` on a channel.
    pub fn subscribe(&self, handle: u32) -> Receiver<Event> {
        let (h, rx) = channel_handler();
        self.set_handler(handle, h);
        rx
    }

    pub fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let mut l = abi::ListDevices::zeroed();
        self.call(cmd::LIST_DEVICES, &mut l)?;
        (0..l.count.min(abi::MAX_DEVICES as u32))
            .map(|i| self.query_device(i))
            .collect()
    }

    pub fn query_device(&self, index: u32) -> Result<DeviceInfo> {
        let mut q = abi::QueryDevice {
            dev: index,
            ..Zeroable::zeroed()
        };
        self.call(cmd::QUERY_DEVICE, &mut q)?;
        let attr = q.decode().ok_or(VerbsError::Io)?;
        Ok(DeviceInfo {
            index,
            name: attr.name.clone(),
            transport: attr.transport,
            node_guid: attr.node_guid,
            attr,
        })
    }

    /// Find a device by name.
    pub fn device(&self, name: &str) -> Result<DeviceInfo> {
        self.devices()?
            .into_iter()
            .find(|d| d.name == name)
            .ok_or(VerbsError::NoSuchResource)
    }

    pub fn query_port(&self, dev: u32, port: u8) -> Result<PortInfo> {
        let mut q = abi::QueryPort {
            dev,
            port,
            ..Zeroable::zeroed()
        };
        self.call(cmd::QUERY_PORT, &mut q)?;
        q.decode().ok_or(VerbsError::Io)
    }

    pub fn stat_contexts(&self) -> Result<(abi::StatContexts, Vec<abi::ContextRow>)> {
        let mut rows = Vec::new();
        let mut head = Box::new(abi::StatContexts::zeroed());
        loop {
            head.start = rows.len() as u32;
            self.call(cmd::STAT_CONTEXTS, head.as_mut())?;
            rows.extend_from_slice(&head.rows[..head.count as usize]);
            if head.count == 0 || rows.len() as u32 >= head.total {
                return Ok((*head, rows));
            }
        }
    }

    /// The kAL's own counters: quota refusals, refused ring memory and doorbells, and
    /// what the engines could not do with consumers' rings.
    pub fn stat_kal(&self) -> Result<Vec<(String, u64)>> {
        self.stat_device(abi::KAL_COUNTERS)
    }

    /// The counters of device `dev`'s engine in this process, when this context has
    /// opened it here (siw0 through krdmad): what [`Context::stat_device`], the kAL's
    /// view, does not see.
    pub fn stat_in_process(&self, dev: u32) -> Option<Vec<(String, u64)>> {
        self.opened.opened(dev).map(|d| d.counters())
    }

    pub fn stat_device(&self, dev: u32) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        let mut s = Box::new(abi::StatDevice {
            dev,
            ..Zeroable::zeroed()
        });
        loop {
            s.start = out.len() as u32;
            self.call(cmd::STAT_DEVICE, s.as_mut())?;
            out.extend(
                s.rows[..s.count as usize]
                    .iter()
                    .map(|r| (abi::name_to_str(&r.name).to_string(), r.value)),
            );
            if s.count == 0 || out.len() as u32 >= s.total {
                return Ok(out);
            }
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let Some(t) = self.events.lock().take() else {
            return;
        };
        if !self.home.is_here() {
            // A fork child: the event thread is the parent's (it does not exist here)
            // and the stop signal an eventfd shared with the parent. Touch neither, nor
            // the devices opened through their uVP (their contexts are the parent's).
            std::mem::forget(t);
            self.opened.leak();
            return;
        }
        self.chan.stop_waiters();
        if t.thread().id() != std::thread::current().id() {
            let _ = t.join();
        }
    }
}

/// The context's event thread: waits on the kAL and dispatches records until the context
/// is dropped or the kAL dies.
fn start_event_thread(
    id: u32,
    chan: Arc<Channel>,
    disp: Arc<Dispatcher>,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name(format!("krdma-ev{id}"))
        .spawn(move || loop {
            if chan.is_stopped() {
                return; // the context is being dropped
            }
            match chan.wait_events(Duration::from_millis(500)) {
                Ok(recs) => {
                    for r in recs {
                        match r.to_event() {
                            Some(ev) => disp.dispatch(ev),
                            None => tracing::warn!(kind = r.kind, "unknown event record"),
                        }
                    }
                }
                Err(VerbsError::Dead) => {
                    tracing::error!("the kAL is gone (daemon died); all resources are dead");
                    disp.broadcast_dead();
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "event read failed");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })
        .expect("spawn event thread")
}

/// The command that destroys a mirrored object of `kind`.
fn mirror_destroy_cmd(kind: u32) -> u32 {
    match kind {
        abi::MIRROR_PD => cmd::DEALLOC_PD,
        abi::MIRROR_CQ => cmd::DESTROY_CQ,
        abi::MIRROR_QP => cmd::DESTROY_QP,
        abi::MIRROR_SRQ => cmd::DESTROY_SRQ,
        abi::MIRROR_MR => cmd::DEREG_MR,
        abi::MIRROR_MW => cmd::DEALLOC_MW,
        _ => cmd::DESTROY_LISTEN,
    }
}

fn fill_pdata(buf: &mut [u8; abi::MAX_PDATA], data: &[u8]) -> Result<u32> {
    if data.len() > abi::MAX_PDATA {
        return Err(VerbsError::Invalid);
    }
    buf[..data.len()].copy_from_slice(data);
    Ok(data.len() as u32)
}
