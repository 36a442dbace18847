//! The user verbs provider of a software device whose engine a consumer can run itself
//! (siw: its wire is TCP connections any process can open). Through krdmad such a device
//! offers both fast paths (`FastPath::Either`); a context that takes this one gets the
//! same engine the daemon runs, started in this process, so post, poll, the engine's
//! socket I/O and its completions never cross the daemon — as in embedded mode, where a
//! polling consumer even does the receiving in its own thread. The kAL still holds the
//! resource tree, limits and quotas: the uAL mirrors every object made here.
//!
//! The engine lives in a kAL of this process's own (one per device description, shared
//! by the contexts of the process, holding only that device), reached through an
//! embedded front door; each uAL context that opens the device gets a context there.
//! Each object below is the inner context's object of the same kind; their events are
//! forwarded to the sink the outer uAL gave.

use crate::channel::Channel;
use crate::embedded::Door;
use crate::verbs::{Armed, Context, Cq, FastPathChoice, Listener, Mr, Mw, Pd, Qp, QpConfig, Srq};
use kal::Kal;
use parking_lot::Mutex;
use rnicpi::user::{
    UserCq, UserDevice, UserListener, UserMr, UserMw, UserPd, UserProvider, UserQp, UserQpInit,
    UserSrq,
};
use rnicpi::{
    Access, ConnParam, Cqe, Event, EventSink, QpAttr, QpAttrMask, QpCaps, QpState, Result, SrqAttr,
    VerbsError, Wqe,
};
use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::Duration;

/// The engine's device number in its kAL (the only device there).
const DEV: u32 = 0;

struct EngineProvider;

pub(super) fn user_provider() -> &'static dyn UserProvider {
    &EngineProvider
}

impl UserProvider for EngineProvider {
    fn driver(&self) -> &'static str {
        stack::SIW_UVP_DRIVER
    }

    fn open(&self, device: &str) -> Result<Arc<dyn UserDevice>> {
        let kal = engine_kal(self.driver(), device)?;
        let ctx =
            Context::open_channel(Channel::Embedded(Door::open_on(kal)?), FastPathChoice::Kal)?;
        Ok(Arc::new(EngineDevice { ctx }))
    }
}

/// This process's kAL holding the engine of `device`, started on first use. Keyed by
/// process too: a fork child has the parent's map but none of its engines' threads, so
/// it starts its own.
fn engine_kal(driver: &str, device: &str) -> Result<Arc<Kal>> {
    type ByProcessAndDevice = HashMap<(u32, String), Arc<Kal>>;
    static KALS: Mutex<Option<ByProcessAndDevice>> = Mutex::new(None);
    let key = (std::process::id(), device.to_string());
    let mut kals = KALS.lock();
    let kals = kals.get_or_insert_with(HashMap::new);
    if let Some(k) = kals.get(&key) {
        return Ok(k.clone());
    }
    let kal = Kal::new(kal::Config::default());
    stack::start_uvp(&kal, driver, device)?;
    tracing::info!(driver, device, "engine started in this process");
    kals.insert(key, kal.clone());
    Ok(kal)
}

/// Send the events of the inner object `handle` to `sink`, including any that reached
/// the object's own channel before (`early`).
fn forward(
    ctx: &Context,
    handle: u32,
    early: &crossbeam_channel::Receiver<Event>,
    sink: Arc<dyn EventSink>,
) {
    let s = sink.clone();
    ctx.set_handler(handle, Arc::new(move |ev| s.deliver(ev)));
    for ev in early.try_iter() {
        sink.deliver(ev);
    }
}

/// The same provider's object behind `obj`, or `Invalid`.
fn ours<T: 'static>(obj: &dyn Any) -> Result<&T> {
    obj.downcast_ref::<T>().ok_or(VerbsError::Invalid)
}

struct EngineDevice {
    ctx: Arc<Context>,
}

impl UserDevice for EngineDevice {
    fn alloc_pd(&self) -> Result<Arc<dyn UserPd>> {
        Ok(Arc::new(EnginePd {
            ctx: self.ctx.clone(),
            pd: self.ctx.alloc_pd(DEV)?,
        }))
    }

    fn create_cq(&self, depth: u32, sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserCq>> {
        self.create_cq_signalled(depth, sink, None)
    }

    fn create_cq_signalled(
        &self,
        depth: u32,
        sink: Arc<dyn EventSink>,
        signal: Option<BorrowedFd<'_>>,
    ) -> Result<Arc<dyn UserCq>> {
        let cq = self.ctx.create_cq_signalled(DEV, depth, signal)?;
        forward(&self.ctx, cq.handle, cq.events(), sink);
        Ok(Arc::new(EngineCq(cq)))
    }

    fn connect(&self, qp: &Arc<dyn UserQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
        ours::<EngineQp>(qp.as_any())?.qp.connect(peer, &param)
    }

    fn counters(&self) -> Vec<(String, u64)> {
        self.ctx.stat_device(DEV).unwrap_or_default()
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn UserListener>> {
        let l = self.ctx.listen(DEV, addr, backlog)?;
        forward(&self.ctx, l.handle, l.events(), sink);
        let mut local = addr;
        local.set_port(l.port);
        Ok(Arc::new(EngineListener { l, local }))
    }
}

struct EnginePd {
    ctx: Arc<Context>,
    pd: Arc<Pd>,
}

impl UserPd for EnginePd {
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<Box<dyn UserMr>> {
        // SAFETY: the caller's contract (memory mapped while the registration exists) is
        // the inner registration's.
        let mr = unsafe { self.ctx.reg_mr(&self.pd, addr, len, access)? };
        Ok(Box::new(EngineMr(mr)))
    }

    fn create_qp(&self, init: UserQpInit) -> Result<Arc<dyn UserQp>> {
        let send_cq = &ours::<EngineCq>(init.send_cq.as_any())?.0;
        let recv_cq = &ours::<EngineCq>(init.recv_cq.as_any())?.0;
        let srq = match &init.srq {
            Some(s) => Some(ours::<EngineSrq>(s.as_any())?.srq.clone()),
            None => None,
        };
        let cfg = QpConfig {
            qp_type: init.qp_type,
            caps: init.caps,
            srq,
        };
        let qp = self.ctx.create_qp(&self.pd, send_cq, recv_cq, cfg)?;
        forward(&self.ctx, qp.handle, qp.events(), init.sink);
        Ok(Arc::new(EngineQp {
            qp,
            caps: init.caps,
        }))
    }

    fn create_srq(&self, attr: SrqAttr, sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserSrq>> {
        let srq = self.ctx.create_srq(&self.pd, attr.max_wr, attr.max_sge)?;
        forward(&self.ctx, srq.handle, srq.events(), sink);
        Ok(Arc::new(EngineSrq { srq, attr }))
    }

    fn alloc_mw(&self) -> Result<Box<dyn UserMw>> {
        Ok(Box::new(EngineMw(self.ctx.alloc_mw(&self.pd)?)))
    }
}

struct EngineMr(Arc<Mr>);

impl UserMr for EngineMr {
    fn lkey(&self) -> u32 {
        self.0.lkey
    }
    fn rkey(&self) -> u32 {
        self.0.rkey
    }
}

struct EngineMw(Arc<Mw>);

impl UserMw for EngineMw {
    fn rkey(&self) -> u32 {
        self.0.rkey()
    }
}

struct EngineCq(Arc<Cq>);

impl UserCq for EngineCq {
    fn poll(&self, out: &mut [Cqe]) -> usize {
        self.0.poll(out)
    }
    fn arm(&self, solicited_only: bool) -> Result<()> {
        self.0.arm(solicited_only);
        Ok(())
    }
    fn worth_spinning(&self) -> bool {
        self.0.worth_spinning()
    }
    fn can_sleep(&self) -> bool {
        self.0.sleeps_on_ring()
    }
    fn arm_to_sleep(&self, solicited_only: bool) -> u32 {
        self.0.arm_to_sleep(solicited_only).0
    }
    fn sleep(&self, armed: u32, timeout: Duration) {
        let _ = self.0.sleep(Armed(armed), timeout);
    }
    fn wake_sleepers(&self) {
        self.0.wake_sleepers()
    }
    fn can_signal(&self) -> bool {
        self.0.can_signal()
    }
    fn arm_to_signal(&self, solicited_only: bool) {
        self.0.arm_to_signal(solicited_only);
    }
    fn signals_given(&self) -> u32 {
        self.0.signals_given()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct EngineQp {
    qp: Arc<Qp>,
    caps: QpCaps,
}

impl UserQp for EngineQp {
    fn qp_num(&self) -> u32 {
        self.qp.qp_num
    }
    fn caps(&self) -> QpCaps {
        self.caps
    }
    fn post_send(&self, wqes: &[Wqe]) -> Result<()> {
        self.qp.post_send_batch(wqes)
    }
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()> {
        wqes.iter().try_for_each(|w| self.qp.post_recv(w))
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.qp.modify(attr, mask)
    }
    fn state(&self) -> Result<QpState> {
        self.qp.state()
    }
    fn disconnect(&self, abortive: bool) -> Result<()> {
        self.qp.disconnect(abortive)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct EngineSrq {
    srq: Arc<Srq>,
    attr: SrqAttr,
}

impl UserSrq for EngineSrq {
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()> {
        wqes.iter().try_for_each(|w| self.srq.post_recv(w))
    }
    fn arm(&self, limit: u32) -> Result<()> {
        self.srq.arm_limit(limit)
    }
    fn attr(&self) -> SrqAttr {
        self.srq.query().unwrap_or(self.attr)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct EngineListener {
    l: Arc<Listener>,
    local: SocketAddr,
}

impl UserListener for EngineListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }
    fn accept(&self, conn_id: u64, qp: &Arc<dyn UserQp>, param: ConnParam) -> Result<()> {
        self.l
            .accept(conn_id, &ours::<EngineQp>(qp.as_any())?.qp, &param)
    }
    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        self.l.reject(conn_id, private_data)
    }
}
