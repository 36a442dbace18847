//! Verbs objects over a kAL context: devices, PDs, CQs, QPs, SRQs, MRs, memory windows
//! and listeners.

use crate::buffer::RegBuf;
use crate::channel::{Channel, Target};
use crate::device::eventfd;
use crate::events::{channel_handler, Dispatcher, Handler};
use crate::pin;
use abi::cmd;
use bytemuck::Zeroable;
use crossbeam_channel::Receiver;
use parking_lot::Mutex;
use rnicpi::fork::Lineage;
use rnicpi::queue::{ring_bytes, ring_capacity};
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
        let chan = Channel::open(target)?;
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
        let chan = Arc::new(chan);
        let dispatcher = Dispatcher::new();
        let events = start_event_thread(q.context, chan.clone(), dispatcher.clone());
        Ok(Arc::new(Context {
            chan,
            dispatcher,
            id: q.context,
            events: Mutex::new(Some(events)),
            home: Lineage::here(),
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

    pub fn alloc_pd(self: &Arc<Self>, dev: u32) -> Result<Arc<Pd>> {
        let mut a = abi::AllocPd { dev, handle: 0 };
        self.call(cmd::ALLOC_PD, &mut a)?;
        Ok(Arc::new(Pd {
            ctx: self.clone(),
            handle: a.handle,
            dev,
        }))
    }

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

    /// Create a QP on `pd` with its completion queues.
    pub fn create_qp(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        cfg: QpConfig,
    ) -> Result<Arc<Qp>> {
        let mut caps = cfg.caps;
        if cfg.srq.is_some() {
            // Receives come from the SRQ; the QP has no receive queue of its own.
            (caps.max_recv_wr, caps.max_recv_sge) = (0, 0);
        }
        let layout =
            QpRingLayout::new(caps.max_send_wr, caps.max_recv_wr).ok_or(VerbsError::Invalid)?;
        let mem = Arc::new(SharedMem::create("krdma-qp", layout.total)?);
        let doorbell_fd = if self.is_embedded() {
            None
        } else {
            Some(eventfd()?)
        };
        let mut a = abi::CreateQp {
            pd: pd.handle,
            send_cq: send_cq.handle,
            recv_cq: recv_cq.handle,
            qp_type: cfg.qp_type as u8,
            _pad: [0; 3],
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_send_sge,
            max_recv_sge: caps.max_recv_sge,
            max_inline: caps.max_inline,
            memfd: mem.fd().as_raw_fd(),
            doorbell_fd: doorbell_fd.as_ref().map_or(-1, |f| f.as_raw_fd()),
            handle: 0,
            qp_num: 0,
            srq: cfg.srq.as_ref().map_or(0, |s| s.handle),
            _pad2: 0,
        };
        self.call(cmd::CREATE_QP, &mut a)?;
        let sq = Ring::attach(mem.clone(), layout.sq_offset, layout.sq_depth)?.producer();
        let rq = Ring::attach(mem, layout.rq_offset, layout.rq_depth)?.producer();
        let doorbell: Arc<dyn Doorbell> = match doorbell_fd {
            Some(fd) => Arc::new(EventfdDoorbell(fd)),
            None => self.chan.direct_doorbell(a.handle)?,
        };
        let events = self.subscribe(a.handle);
        Ok(Arc::new(Qp {
            ctx: self.clone(),
            handle: a.handle,
            qp_num: a.qp_num,
            user: UserQp::new(a.qp_num, caps, sq, rq, doorbell),
            events,
            srq: cfg.srq.clone(),
            _parents: (pd.clone(), send_cq.clone(), recv_cq.clone()),
        }))
    }

    /// Create a shared receive queue of `max_wr` receives with `max_sge` scatter entries.
    /// QPs created with [`QpConfig::srq`] take their receives from it.
    pub fn create_srq(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<Arc<Srq>> {
        let cap = ring_capacity(max_wr).ok_or(VerbsError::Invalid)?;
        let mem = Arc::new(SharedMem::create("krdma-srq", ring_bytes::<Wqe>(cap))?);
        let mut a = abi::CreateSrq {
            pd: pd.handle,
            max_wr,
            max_sge,
            limit: 0,
            memfd: mem.fd().as_raw_fd(),
            handle: 0,
        };
        self.call(cmd::CREATE_SRQ, &mut a)?;
        let attr = SrqAttr {
            max_wr: a.max_wr,
            max_sge,
            limit: 0,
        };
        let ring = Ring::attach(mem, 0, a.max_wr)?.producer();
        let events = self.subscribe(a.handle);
        Ok(Arc::new(Srq {
            ctx: self.clone(),
            handle: a.handle,
            user: UserSrq::new(attr, ring),
            events,
            _pd: pd.clone(),
        }))
    }

    /// Allocate a memory window in `pd` (bind it with [`Mw::bind_wqe`] on a QP of `pd`).
    pub fn alloc_mw(self: &Arc<Self>, pd: &Arc<Pd>) -> Result<Arc<Mw>> {
        let mut a = abi::AllocMw {
            pd: pd.handle,
            ..Zeroable::zeroed()
        };
        self.call(cmd::ALLOC_MW, &mut a)?;
        Ok(Arc::new(Mw {
            ctx: self.clone(),
            handle: a.handle,
            rkey: a.rkey.into(),
            _pd: pd.clone(),
        }))
    }

    /// Register the whole of `buf` (kept alive by the returned [`Mr`]): memory that stays
    /// mapped for as long as the registration exists and is only ever accessed through
    /// copies, as registered memory must be.
    pub fn reg_buf(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        buf: &Arc<RegBuf>,
        access: Access,
    ) -> Result<Arc<Mr>> {
        // SAFETY: `buf` is a mapping the Mr keeps alive until it is deregistered, and
        // RegBuf only ever reaches it through raw copies.
        unsafe { self.register(pd, buf.as_ptr(), buf.len(), access, Some(buf.clone())) }
    }

    /// Register `len` bytes at `addr` of this process. The pages are pinned until the
    /// returned [`Mr`] is dropped.
    ///
    /// # Safety
    ///
    /// The memory must stay mapped for as long as the `Mr` exists, and must not be
    /// reached through Rust references meanwhile: the engine (for local work requests
    /// and for the peer's RDMA) reads and writes it at any time until the `Mr` is
    /// dropped (its deregistration waits for accesses in flight). Prefer
    /// [`Context::reg_buf`].
    pub unsafe fn reg_mr(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        addr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<Arc<Mr>> {
        // SAFETY: the caller's contract is ours.
        unsafe { self.register(pd, addr, len, access, None) }
    }

    /// # Safety
    ///
    /// As [`Context::reg_mr`]; `buf`, when given, is the memory and is kept alive.
    unsafe fn register(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        addr: *const u8,
        len: usize,
        access: Access,
        buf: Option<Arc<RegBuf>>,
    ) -> Result<Arc<Mr>> {
        self.here()?;
        let (addr, len) = (addr as u64, len as u64);
        let mut a = abi::RegMr {
            pd: pd.handle,
            access: access.bits(),
            addr,
            length: len,
            ..Zeroable::zeroed()
        };
        // The kAL checks the memory first: pinning faults every page in, and memory it
        // refuses (a FUSE file, a userfaultfd range) could hold us there for ever.
        self.call(cmd::REG_MR, &mut a)?;
        if let Err(e) = pin::pin(addr, len) {
            self.destroy(cmd::DEREG_MR, a.handle);
            return Err(e);
        }
        Ok(Arc::new(Mr {
            ctx: self.clone(),
            handle: a.handle,
            addr,
            len,
            lkey: a.lkey,
            rkey: a.rkey,
            _pd: pd.clone(),
            _buf: buf,
        }))
    }

    /// Listen on `addr` (port 0 picks one) of device `dev`.
    pub fn listen(
        self: &Arc<Self>,
        dev: u32,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<Arc<Listener>> {
        let (gid, port) = rnicpi::sockaddr_to_parts(addr);
        let gid = if addr.ip().is_unspecified() {
            [0; 16]
        } else {
            gid
        };
        let mut a = abi::Listen {
            dev,
            backlog,
            addr: gid,
            port,
            _pad: [0; 2],
            handle: 0,
        };
        self.call(cmd::LISTEN, &mut a)?;
        let events = self.subscribe(a.handle);
        Ok(Arc::new(Listener {
            ctx: self.clone(),
            handle: a.handle,
            port: a.port,
            events,
        }))
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
            // and the stop signal an eventfd shared with the parent. Touch neither.
            std::mem::forget(t);
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

/// Daemon mode: the doorbell is one write to an eventfd the kAL watches.
struct EventfdDoorbell(OwnedFd);

impl Doorbell for EventfdDoorbell {
    fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // An EAGAIN (counter saturated) still leaves the eventfd readable: the wake is not lost.
        let _ = nix::unistd::write(&self.0, &one);
    }
}

/// A protection domain.
pub struct Pd {
    ctx: Arc<Context>,
    pub handle: u32,
    pub dev: u32,
}

impl Drop for Pd {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DEALLOC_PD, self.handle);
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

/// Requested shape of a QP.
#[derive(Clone)]
pub struct QpConfig {
    pub qp_type: QpType,
    pub caps: QpCaps,
    /// Take receives from this shared receive queue (the receive caps are then ignored).
    pub srq: Option<Arc<Srq>>,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            qp_type: QpType::Rc,
            caps: QpCaps {
                max_send_wr: 256,
                max_recv_wr: 256,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline: 64,
            },
            srq: None,
        }
    }
}

/// A queue pair: posts go to shared rings, control goes through the kAL.
pub struct Qp {
    ctx: Arc<Context>,
    pub handle: u32,
    pub qp_num: u32,
    user: UserQp,
    events: Receiver<Event>,
    srq: Option<Arc<Srq>>,
    _parents: (Arc<Pd>, Arc<Cq>, Arc<Cq>),
}

impl Qp {
    /// The memory of the QP's send and receive rings (`QpRingLayout` says where each
    /// is). It is this process's own memory; tests write it to play a hostile consumer.
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.user.ring_memory()
    }

    /// Ring the doorbell without posting (after writing the rings through
    /// [`Qp::ring_memory`]).
    pub fn ring_doorbell(&self) {
        self.user.ring_doorbell()
    }

    pub fn post_send(&self, wqe: &Wqe) -> Result<()> {
        self.ctx.here()?;
        self.user.post_send(wqe)
    }
    pub fn post_send_batch(&self, wqes: &[Wqe]) -> Result<()> {
        self.ctx.here()?;
        self.user.post_send_batch(wqes)
    }
    /// Post a receive; `Invalid` for a QP on an SRQ (post to the SRQ instead).
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        self.ctx.here()?;
        if self.srq.is_some() {
            return Err(VerbsError::Invalid);
        }
        self.user.post_recv(wqe)
    }

    /// Connection and asynchronous events of this QP.
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Wait for the next event of this QP.
    pub fn next_event(&self, timeout: Duration) -> Result<Event> {
        self.events
            .recv_timeout(timeout)
            .map_err(|_| VerbsError::TimedOut)
    }

    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let mut a = abi::QpAttrs::encode(self.handle, attr, mask);
        self.ctx.call(cmd::MODIFY_QP, &mut a)
    }

    pub fn state(&self) -> Result<QpState> {
        let mut a = abi::QpAttrs {
            handle: self.handle,
            ..Zeroable::zeroed()
        };
        self.ctx.call(cmd::QUERY_QP, &mut a)?;
        QpState::from_u8(a.state).ok_or(VerbsError::Io)
    }

    /// Active connect with private data; completion arrives as an `Established`,
    /// `Rejected` or `Unreachable` event (see [`Qp::connect_wait`]).
    pub fn connect(&self, peer: SocketAddr, param: &ConnParam) -> Result<()> {
        let (addr, port) = rnicpi::sockaddr_to_parts(peer);
        let mut a = abi::Connect {
            qp: self.handle,
            ird: param.ird,
            ord: param.ord,
            addr,
            port,
            ..Zeroable::zeroed()
        };
        a.pdata_len = fill_pdata(&mut a.pdata, &param.private_data)?;
        self.ctx.call(cmd::CONNECT, &mut a)
    }

    /// Connect and wait for the outcome; returns the `Established` event.
    pub fn connect_wait(
        &self,
        peer: SocketAddr,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<Event> {
        self.connect(peer, param)?;
        let ev = self.next_event(timeout)?;
        match ev.kind {
            rnicpi::EventKind::Established => Ok(ev),
            rnicpi::EventKind::Rejected => Err(VerbsError::Refused),
            _ => Err(VerbsError::from_errno(ev.status).max_io()),
        }
    }

    pub fn disconnect(&self, abortive: bool) -> Result<()> {
        let mut a = abi::Disconnect {
            qp: self.handle,
            abortive: abortive as u32,
        };
        self.ctx.call(cmd::DISCONNECT, &mut a)
    }
}

trait OrUnreachable {
    fn max_io(self) -> VerbsError;
}
impl OrUnreachable for VerbsError {
    fn max_io(self) -> VerbsError {
        if self == VerbsError::Io {
            VerbsError::Unreachable
        } else {
            self
        }
    }
}

fn fill_pdata(buf: &mut [u8; abi::MAX_PDATA], data: &[u8]) -> Result<u32> {
    if data.len() > abi::MAX_PDATA {
        return Err(VerbsError::Invalid);
    }
    buf[..data.len()].copy_from_slice(data);
    Ok(data.len() as u32)
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_QP, self.handle);
    }
}

/// A memory registration; unpinned and deregistered on drop.
pub struct Mr {
    ctx: Arc<Context>,
    pub handle: u32,
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    _pd: Arc<Pd>,
    /// The memory, when the registration owns it ([`Context::reg_buf`]); dropped after
    /// the deregistration.
    _buf: Option<Arc<RegBuf>>,
}

impl Mr {
    /// An SGE covering `[offset, offset+len)` of this registration.
    pub fn sge(&self, offset: u64, len: u32) -> rnicpi::Sge {
        rnicpi::Sge {
            addr: self.addr + offset,
            length: len,
            lkey: self.lkey,
        }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if self.ctx.here().is_err() {
            return; // the parent's registration and pins
        }
        self.ctx.destroy(cmd::DEREG_MR, self.handle);
        pin::unpin(self.addr, self.len);
    }
}

/// A listening endpoint; connection requests arrive as events.
pub struct Listener {
    ctx: Arc<Context>,
    pub handle: u32,
    pub port: u16,
    events: Receiver<Event>,
}

impl Listener {
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Wait for the next connection request.
    pub fn get_request(&self, timeout: Duration) -> Result<Event> {
        loop {
            let ev = self
                .events
                .recv_timeout(timeout)
                .map_err(|_| VerbsError::TimedOut)?;
            match ev.kind {
                rnicpi::EventKind::ConnectRequest => return Ok(ev),
                rnicpi::EventKind::AccessLayerDead => return Err(VerbsError::Dead),
                _ => continue,
            }
        }
    }

    pub fn accept(&self, conn_id: u64, qp: &Qp, param: &ConnParam) -> Result<()> {
        let mut a = abi::Accept {
            listen: self.handle,
            qp: qp.handle,
            conn_id,
            ird: param.ird,
            ord: param.ord,
            ..Zeroable::zeroed()
        };
        a.pdata_len = fill_pdata(&mut a.pdata, &param.private_data)?;
        self.ctx.call(cmd::ACCEPT, &mut a)
    }

    pub fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        let mut a = abi::Reject {
            listen: self.handle,
            conn_id,
            ..Zeroable::zeroed()
        };
        a.pdata_len = fill_pdata(&mut a.pdata, private_data)?;
        self.ctx.call(cmd::REJECT, &mut a)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_LISTEN, self.handle);
    }
}

/// A shared receive queue: receives posted here serve every QP attached to it.
pub struct Srq {
    ctx: Arc<Context>,
    pub handle: u32,
    user: UserSrq,
    events: Receiver<Event>,
    _pd: Arc<Pd>,
}

impl Srq {
    /// The memory of the receive ring (see [`Qp::ring_memory`]).
    pub fn ring_memory(&self) -> Arc<SharedMem> {
        self.user.ring_memory()
    }

    /// Post one receive (no system call).
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        self.ctx.here()?;
        self.user.post_recv(wqe)
    }

    /// Receives posted and not yet taken by a QP.
    pub fn len(&self) -> u32 {
        self.user.len()
    }

    pub fn is_empty(&self) -> bool {
        self.user.is_empty()
    }

    /// Arm the limit: one `SrqLimitReached` event once fewer than `limit` receives are
    /// left (0 disarms).
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        let mut a = abi::SrqAttrs {
            handle: self.handle,
            limit,
            ..Zeroable::zeroed()
        };
        self.ctx.call(cmd::MODIFY_SRQ, &mut a)
    }

    /// The SRQ's shape and current limit (0 once the limit event has fired).
    pub fn query(&self) -> Result<SrqAttr> {
        let mut a = abi::SrqAttrs {
            handle: self.handle,
            ..Zeroable::zeroed()
        };
        self.ctx.call(cmd::QUERY_SRQ, &mut a)?;
        Ok(SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            limit: a.limit,
        })
    }

    /// Events of this SRQ (`SrqLimitReached`, `SrqError`, `AccessLayerDead`).
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_SRQ, self.handle);
    }
}

/// A memory window (type 2): bound onto part of a registration by a send-queue request,
/// it gives a peer remote access to just that part, under a key that changes at each
/// bind and can be invalidated by the peer (Send with Invalidate) or locally.
pub struct Mw {
    ctx: Arc<Context>,
    pub handle: u32,
    rkey: std::sync::atomic::AtomicU32,
    _pd: Arc<Pd>,
}

impl Mw {
    /// The key of the latest bind (what to hand to the peer).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(std::sync::atomic::Ordering::Acquire)
    }

    /// A `BindMw` request for `[offset, offset+len)` of `mr` with remote rights `access`
    /// (`len` 0 unbinds), under a fresh key that [`Mw::rkey`] reports from now on. Post
    /// it on a QP of the window's PD; the bind takes effect in send-queue order.
    pub fn bind_wqe(&self, wr_id: u64, mr: &Mr, offset: u64, len: u64, access: Access) -> Wqe {
        let old = self.rkey();
        let new = (old & !0xff) | (old.wrapping_add(1) & 0xff);
        self.rkey.store(new, std::sync::atomic::Ordering::Release);
        Wqe::bind_mw(wr_id, new, mr.lkey, mr.addr + offset, len, access)
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DEALLOC_MW, self.handle);
    }
}
