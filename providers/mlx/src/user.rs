//! The user half: [`Ibverbs`], a [`UserProvider`] whose objects are libibverbs objects
//! created in the consumer's own process.
//!
//! Over 600 lines: every object of the user half is here (a window bind reaches from the
//! QP into its PD's tables of windows and registrations), with the tests at the end.

use crate::cm::{self, CmState};
use crate::conv;
use crate::sys::{self, AsyncElement, CompChannel, Context, EventChannel, Wake};
use parking_lot::Mutex;
use rnicpi::user::{
    UserAh, UserCq, UserDevice, UserListener, UserMr, UserMw, UserPd, UserProvider, UserQp,
    UserQpInit, UserSrq,
};
use rnicpi::{
    Access, AhAttr, ConnParam, Cqe, Event, EventKind, EventSink, QpAttr, QpAttrMask, QpCaps,
    QpState, QpType, Result, SrqAttr, VerbsError, Wqe, WrOpcode,
};
use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

/// The user verbs provider for devices libibverbs drives (driver name `ibverbs`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Ibverbs;

/// The driver name the kernel half reports in `FastPath::Consumer`.
pub const DRIVER: &str = "ibverbs";

static IBVERBS: Ibverbs = Ibverbs;

/// The user verbs provider, for the uAL's table of drivers.
pub fn user_provider() -> &'static dyn UserProvider {
    &IBVERBS
}

impl UserProvider for Ibverbs {
    fn driver(&self) -> &'static str {
        DRIVER
    }
    fn open(&self, device: &str) -> Result<Arc<dyn UserDevice>> {
        Ok(IbvDevice::open(device)?)
    }
}

/// Keys for `cq_context` / `srq_context` (never 0).
static NEXT_KEY: AtomicUsize = AtomicUsize::new(1);

type SinkMap<K> = Mutex<HashMap<K, Arc<dyn EventSink>>>;

/// What the device's objects and its event thread share. Field order is drop order: the
/// rdma_cm ids (in `cm`) before their channel, the channels before the context.
pub(crate) struct Shared {
    pub(crate) cm: Mutex<CmState>,
    pub(crate) cm_chan: Option<EventChannel>,
    pub(crate) chan: CompChannel,
    pub(crate) wake: Wake,
    pub(crate) stop: AtomicBool,
    pub(crate) cqs: SinkMap<usize>,
    pub(crate) srqs: SinkMap<usize>,
    pub(crate) qps: SinkMap<u32>,
    pub(crate) iwarp: bool,
    /// The device's responder resources / initiator depth limits (for rdma_cm).
    pub(crate) max_ird: u32,
    pub(crate) max_ord: u32,
    /// Port 1 is native InfiniBand (rdma_cm's RTR mask workaround applies).
    pub(crate) ib_link: bool,
    pub(crate) ctx: Context,
}

impl Shared {
    pub(crate) fn name(&self) -> &str {
        &self.ctx.info.name
    }
}

/// An open device: its context, one completion channel, the rdma_cm event channel and the
/// thread that demultiplexes their events.
pub struct IbvDevice {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl IbvDevice {
    pub fn open(name: &str) -> Result<Arc<IbvDevice>> {
        let ctx = Context::open(name)?;
        let dattr = ctx.query_device()?;
        let ib_link = ctx
            .query_port(conv::PORT)
            .map(|p| p.link_layer == sys::LINK_LAYER_INFINIBAND)
            .unwrap_or(false);
        let chan = CompChannel::new(&ctx)?;
        let async_fd = ctx.async_fd()?;
        // rdma_cm is optional: without librdmacm (or its kernel module) the device still
        // works through Modify QP.
        let cm_chan = match EventChannel::new() {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::info!(device = name, error = %e, "no rdma_cm event channel; connect/listen unsupported");
                None
            }
        };
        let shared = Arc::new(Shared {
            cm: Mutex::new(CmState::default()),
            cm_chan,
            chan,
            wake: Wake::new()?,
            stop: AtomicBool::new(false),
            cqs: Mutex::new(HashMap::new()),
            srqs: Mutex::new(HashMap::new()),
            qps: Mutex::new(HashMap::new()),
            iwarp: ctx.info.iwarp,
            max_ird: dattr.max_qp_rd_atom.max(0) as u32,
            max_ord: dattr.max_qp_init_rd_atom.max(0) as u32,
            ib_link,
            ctx,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ibv-{name}-events"))
            .spawn(move || event_loop(s, async_fd))
            .map_err(|_| VerbsError::Exhausted)?;
        tracing::info!(device = name, iwarp = shared.iwarp, "ibverbs device opened");
        Ok(Arc::new(IbvDevice {
            shared,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// The libibverbs name of the device.
    pub fn name(&self) -> &str {
        self.shared.name()
    }
    /// Whether the device speaks iWARP (no Modify-QP connection path).
    pub fn is_iwarp(&self) -> bool {
        self.shared.iwarp
    }
    /// Port attributes of port 1 (for tools and tests: GIDs, MTU).
    pub fn gid(&self, index: i32) -> Result<[u8; 16]> {
        self.shared.ctx.query_gid(conv::PORT, index)
    }
    pub fn active_mtu(&self) -> Result<u32> {
        Ok(conv::mtu_from_ibv(
            self.shared.ctx.query_port(conv::PORT)?.active_mtu,
        ))
    }
}

impl Drop for IbvDevice {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.wake();
        if let Some(t) = self.thread.lock().take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn event_loop(s: Arc<Shared>, async_fd: i32) {
    let mut fds = vec![s.wake.fd(), s.chan.fd(), async_fd];
    if let Some(c) = &s.cm_chan {
        fds.push(c.fd());
    }
    while !s.stop.load(Ordering::SeqCst) {
        let ready = sys::poll_in(&fds, 1000);
        if s.stop.load(Ordering::SeqCst) {
            break;
        }
        if ready[1] {
            while let Some(key) = s.chan.get_cq_event() {
                let sink = s.cqs.lock().get(&key).cloned();
                if let Some(sink) = sink {
                    sink.deliver(Event::new(EventKind::CqNotify));
                }
            }
        }
        if ready[2] {
            while let Some(ev) = s.ctx.get_async_event() {
                dispatch_async(&s, ev);
            }
        }
        if ready.get(3).copied().unwrap_or(false) {
            if let Some(chan) = &s.cm_chan {
                while let Some(ev) = chan.get_event() {
                    cm::handle_event(&s, ev);
                }
            }
        }
    }
}

/// `IBV_EVENT_*` → the RNIC-PI's kind (`None`: not reported).
pub(crate) fn async_kind(kind: u32) -> Option<(EventKind, i32)> {
    Some(match kind {
        0 => (EventKind::CqError, libc::EIO),
        1 => (EventKind::QpFatal, libc::EIO),
        2 => (EventKind::QpRequestError, libc::EIO),
        3 => (EventKind::QpAccessError, libc::EIO),
        4 => (EventKind::CommEstablished, 0),
        5 => (EventKind::SqDrained, 0),
        8 => (EventKind::DeviceFatal, libc::EIO),
        9 => (EventKind::PortActive, 0),
        10 => (EventKind::PortError, 0),
        14 => (EventKind::SrqError, libc::EIO),
        15 => (EventKind::SrqLimitReached, 0),
        16 => (EventKind::LastWqeReached, 0),
        _ => return None,
    })
}

fn dispatch_async(s: &Shared, ev: sys::AsyncEvent) {
    let Some((kind, status)) = async_kind(ev.kind) else {
        tracing::debug!(kind = ev.kind, "ibverbs async event ignored");
        return;
    };
    let event = Event::new(kind).with_status(status);
    let sinks: Vec<Arc<dyn EventSink>> = match ev.element {
        AsyncElement::Cq(k) => s.cqs.lock().get(&k).cloned().into_iter().collect(),
        AsyncElement::Srq(k) => s.srqs.lock().get(&k).cloned().into_iter().collect(),
        AsyncElement::Qp(n) => s.qps.lock().get(&n).cloned().into_iter().collect(),
        // Unaffiliated (port, device): every QP of the device hears it (they all use
        // port 1); there is no device-wide sink in the user half.
        AsyncElement::Port(_) | AsyncElement::None => s.qps.lock().values().cloned().collect(),
    };
    tracing::debug!(?kind, element = ?ev.element, "ibverbs async event");
    for sink in sinks {
        sink.deliver(event.clone());
    }
}

impl UserDevice for IbvDevice {
    fn alloc_pd(&self) -> Result<Arc<dyn UserPd>> {
        let pd = sys::Pd::new(&self.shared.ctx)?;
        Ok(Arc::new(IbvPd(Arc::new(PdInner {
            pd,
            mrs: Mutex::new(HashMap::new()),
            mws: Mutex::new(HashMap::new()),
            ahs: Mutex::new((1, HashMap::new())),
            dev: self.shared.clone(),
        }))))
    }

    fn create_cq(&self, depth: u32, sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserCq>> {
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        let cq = sys::Cq::new(&self.shared.ctx, depth.max(1), &self.shared.chan, key)?;
        self.shared.cqs.lock().insert(key, sink);
        Ok(Arc::new(IbvCq {
            cq,
            key,
            dev: self.shared.clone(),
        }))
    }

    fn connect(&self, qp: &Arc<dyn UserQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
        let q = own_qp(qp)?;
        cm::connect(&self.shared, q, peer, param)
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn UserListener>> {
        cm::listen(&self.shared, addr, backlog, sink)
    }
}

/// The QP behind a `dyn UserQp` of this provider.
pub(crate) fn own_qp(qp: &Arc<dyn UserQp>) -> Result<Arc<QpInner>> {
    qp.as_any()
        .downcast_ref::<IbvQp>()
        .map(|q| q.0.clone())
        .ok_or(VerbsError::Invalid)
}

pub(crate) struct PdInner {
    pd: sys::Pd,
    /// Its registrations by lkey and its windows by index (`conv::mw_index` of the key):
    /// a bind names both by key, libibverbs wants the objects.
    mrs: Mutex<HashMap<u32, Weak<sys::Mr>>>,
    mws: Mutex<HashMap<u32, Weak<MwInner>>>,
    /// Its address handles by the number UD Sends name them with, and the next number.
    ahs: Mutex<(u32, HashMap<u32, Weak<sys::Ah>>)>,
    dev: Arc<Shared>,
}

impl PdInner {
    /// The window and registration a bind names (`Invalid` when either is not this PD's).
    fn bind_objects(&self, w: &Wqe) -> Result<Bound> {
        let b = w.bind_args();
        let mw = self
            .mws
            .lock()
            .get(&conv::mw_index(b.mw_rkey))
            .and_then(Weak::upgrade);
        let mr = self.mrs.lock().get(&b.mr_lkey).and_then(Weak::upgrade);
        match (mw, mr) {
            (Some(mw), Some(mr)) => Ok(Bound { mw, mr }),
            _ => Err(VerbsError::Invalid),
        }
    }
}

impl PdInner {
    /// The address handles the UD Sends `wqes` name, held while they are posted
    /// (`Invalid` for a number that is not this PD's).
    fn address_handles(&self, wqes: &[Wqe]) -> Result<Vec<Arc<sys::Ah>>> {
        let ahs = self.ahs.lock();
        wqes.iter()
            .map(|w| {
                ahs.1
                    .get(&w.ud_dest().ah)
                    .and_then(Weak::upgrade)
                    .ok_or(VerbsError::Invalid)
            })
            .collect()
    }

    /// `wqes` with each unbind (a bind of length 0, how krdma's consumers unbind a window
    /// — IT-API's RMR unlink) turned into what unbinds a type-2 window on a verbs device:
    /// a Local Invalidate of the window's current key (IB o10-37.2.40). The window must be
    /// bound; one the peer invalidated (Send with Invalidate) is not, and the device then
    /// fails the request.
    fn unbinds_as_invalidates(&self, wqes: &[Wqe]) -> Result<Vec<Wqe>> {
        wqes.iter()
            .map(|w| {
                if !conv::is_unbind(w) {
                    return Ok(*w);
                }
                let index = conv::mw_index(w.bind_args().mw_rkey);
                let mw = self.mws.lock().get(&index).and_then(Weak::upgrade);
                let mw = mw.ok_or(VerbsError::Invalid)?;
                let key = {
                    let _g = mw.posting.lock();
                    mw.mw.rkey()
                };
                Ok(Wqe {
                    opcode: WrOpcode::LocalInv as u8,
                    imm_or_inv: key,
                    compare_add: 0,
                    swap: 0,
                    rkey: 0,
                    remote_addr: 0,
                    ..*w
                })
            })
            .collect()
    }
}

/// The objects of one bind, held while it is posted.
struct Bound {
    mw: Arc<MwInner>,
    mr: Arc<sys::Mr>,
}

/// A protection domain.
pub struct IbvPd(Arc<PdInner>);

impl UserPd for IbvPd {
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<Box<dyn UserMr>> {
        if !access.is_consistent() {
            return Err(VerbsError::Invalid);
        }
        // SAFETY: the caller keeps the memory mapped while the registration exists.
        let mr = Arc::new(unsafe { self.0.pd.reg_mr(addr, len, conv::access_to_ibv(access))? });
        self.0.mrs.lock().insert(mr.lkey(), Arc::downgrade(&mr));
        Ok(Box::new(IbvMr {
            mr,
            pd: self.0.clone(),
        }))
    }

    fn alloc_mw(&self) -> Result<Box<dyn UserMw>> {
        let mw = Arc::new(MwInner {
            mw: self.0.pd.alloc_mw()?,
            posting: Mutex::new(()),
        });
        let index = conv::mw_index(mw.mw.rkey());
        self.0.mws.lock().insert(index, Arc::downgrade(&mw));
        Ok(Box::new(IbvMw {
            inner: mw,
            index,
            pd: self.0.clone(),
        }))
    }

    fn create_ah(&self, attr: &AhAttr) -> Result<Box<dyn UserAh>> {
        if attr.port != 1 {
            return Err(VerbsError::Invalid);
        }
        let ah = Arc::new(self.0.pd.create_ah(&mut conv::ah_attr_to_ibv(attr))?);
        let mut ahs = self.0.ahs.lock();
        let (next, map) = &mut *ahs;
        let num = rnicpi::ids::next_free(next, map.len(), |n| map.contains_key(&n))
            .ok_or(VerbsError::Exhausted)?;
        map.insert(num, Arc::downgrade(&ah));
        Ok(Box::new(IbvAh {
            _ah: ah,
            num,
            pd: self.0.clone(),
        }))
    }

    fn create_qp(&self, init: UserQpInit) -> Result<Arc<dyn UserQp>> {
        let send = init
            .send_cq
            .as_any()
            .downcast_ref::<IbvCq>()
            .ok_or(VerbsError::Invalid)?;
        let recv = init
            .recv_cq
            .as_any()
            .downcast_ref::<IbvCq>()
            .ok_or(VerbsError::Invalid)?;
        let srq = match &init.srq {
            Some(s) => Some(
                s.as_any()
                    .downcast_ref::<IbvSrq>()
                    .ok_or(VerbsError::Invalid)?,
            ),
            None => None,
        };
        let qp_type = match init.qp_type {
            QpType::Rc => rdma_mummy_sys::ibv_qp_type::IBV_QPT_RC,
            QpType::Uc => rdma_mummy_sys::ibv_qp_type::IBV_QPT_UC,
            QpType::Ud => rdma_mummy_sys::ibv_qp_type::IBV_QPT_UD,
        };
        let (qp, caps) = sys::Qp::new(
            &self.0.pd,
            sys::QpCreate {
                qp_type,
                send_cq: &send.cq,
                recv_cq: &recv.cq,
                srq: srq.map(|s| &s.srq),
                caps: init.caps,
            },
        )?;
        let qpn = qp.qp_num();
        self.0.dev.qps.lock().insert(qpn, init.sink.clone());
        Ok(Arc::new(IbvQp(Arc::new(QpInner {
            qp,
            qpn,
            qp_type: init.qp_type,
            caps,
            has_srq: srq.is_some(),
            sink: init.sink,
            access: AtomicU32::new(0),
            last_state: AtomicU8::new(QpState::Reset as u8),
            cm_key: Mutex::new(None),
            held_recv: Mutex::new(Vec::new()),
            dev: self.0.dev.clone(),
            pd: self.0.clone(),
            _keep: (init.send_cq, init.recv_cq, init.srq),
        }))))
    }

    fn create_srq(&self, attr: SrqAttr, sink: Arc<dyn EventSink>) -> Result<Arc<dyn UserSrq>> {
        let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        let (srq, max_wr, max_sge) =
            sys::Srq::new(&self.0.pd, attr.max_wr, attr.max_sge, attr.limit, key)?;
        self.0.dev.srqs.lock().insert(key, sink);
        Ok(Arc::new(IbvSrq {
            srq,
            key,
            attr: Mutex::new(SrqAttr {
                max_wr,
                max_sge,
                limit: attr.limit,
            }),
            dev: self.0.dev.clone(),
            _pd: self.0.clone(),
        }))
    }
}

/// A memory registration.
pub struct IbvMr {
    /// Shared with a bind being posted (which names it by lkey).
    mr: Arc<sys::Mr>,
    pd: Arc<PdInner>,
}

impl Drop for IbvMr {
    fn drop(&mut self) {
        self.pd.mrs.lock().remove(&self.mr.lkey());
    }
}

/// An address handle.
pub struct IbvAh {
    /// Shared with a UD Send being posted (which names it by number).
    _ah: Arc<sys::Ah>,
    num: u32,
    pd: Arc<PdInner>,
}

impl UserAh for IbvAh {
    fn num(&self) -> u32 {
        self.num
    }
}

impl Drop for IbvAh {
    fn drop(&mut self) {
        self.pd.ahs.lock().1.remove(&self.num);
    }
}

/// A memory window (type 2).
pub struct IbvMw {
    inner: Arc<MwInner>,
    index: u32,
    pd: Arc<PdInner>,
}

struct MwInner {
    mw: sys::Mw,
    /// Held while a bind of the window is posted: its key in `ibv_mw` must be the current
    /// one then, and becomes the bind's once it is posted.
    posting: Mutex<()>,
}

impl UserMw for IbvMw {
    fn rkey(&self) -> u32 {
        let _g = self.inner.posting.lock();
        self.inner.mw.rkey()
    }
}

impl Drop for IbvMw {
    fn drop(&mut self) {
        self.pd.mws.lock().remove(&self.index);
    }
}

impl UserMr for IbvMr {
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

/// A completion queue on the device's completion channel.
pub struct IbvCq {
    cq: sys::Cq,
    key: usize,
    dev: Arc<Shared>,
}

impl IbvCq {
    /// The depth the device granted.
    pub fn depth(&self) -> u32 {
        self.cq.depth()
    }
}

impl UserCq for IbvCq {
    fn poll(&self, out: &mut [Cqe]) -> usize {
        let mut wc: [sys::ibv_wc; 16] = [sys::zeroed(); 16];
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(wc.len());
            let n = self.cq.poll(&mut wc[..want]);
            for (o, w) in out[done..done + n].iter_mut().zip(&wc[..n]) {
                *o = conv::wc_to_cqe(w);
            }
            done += n;
            if n < want {
                break;
            }
        }
        done
    }
    fn arm(&self, solicited_only: bool) -> Result<()> {
        self.cq.req_notify(solicited_only)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for IbvCq {
    fn drop(&mut self) {
        self.dev.cqs.lock().remove(&self.key);
    }
}

/// A shared receive queue.
pub struct IbvSrq {
    srq: sys::Srq,
    key: usize,
    attr: Mutex<SrqAttr>,
    dev: Arc<Shared>,
    _pd: Arc<PdInner>,
}

impl UserSrq for IbvSrq {
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()> {
        if wqes.is_empty() {
            return Ok(());
        }
        let max_sge = self.attr.lock().max_sge;
        let mut chain = conv::recv_chain(wqes, max_sge)?;
        self.srq.post_recv(&mut chain.wrs[0])
    }
    fn arm(&self, limit: u32) -> Result<()> {
        self.srq.arm(limit)?;
        self.attr.lock().limit = limit;
        Ok(())
    }
    fn attr(&self) -> SrqAttr {
        *self.attr.lock()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for IbvSrq {
    fn drop(&mut self) {
        self.dev.srqs.lock().remove(&self.key);
    }
}

/// A queue pair.
pub struct IbvQp(pub(crate) Arc<QpInner>);

pub(crate) struct QpInner {
    pub(crate) qp: sys::Qp,
    pub(crate) qpn: u32,
    qp_type: QpType,
    caps: QpCaps,
    pub(crate) has_srq: bool,
    pub(crate) sink: Arc<dyn EventSink>,
    /// The access rights the consumer last gave (`IBV_ACCESS_*`): added to what rdma_cm
    /// sets when it moves the QP to INIT.
    pub(crate) access: AtomicU32,
    /// The last state this provider moved the QP to (or the CM reported): what
    /// [`UserQp::state`] answers on an iWARP device whose kernel does not report the state
    /// (Debian 12's 6.1 `siw_query_qp` leaves it 0, Reset).
    pub(crate) last_state: AtomicU8,
    /// The rdma_cm id of its connection, if any (a key of the device's CM table).
    pub(crate) cm_key: Mutex<Option<usize>>,
    /// Receives posted while the QP is in Reset, posted to the device when it leaves it.
    /// krdma's consumers may post receives to a new QP before connecting it (IT-API,
    /// uDAPL and rping do, as iWARP allows); a verbs device refuses them before INIT
    /// (Linux rxe: `EINVAL`), and rdma_cm only hides that for QPs it creates itself.
    held_recv: Mutex<Vec<Wqe>>,
    pub(crate) dev: Arc<Shared>,
    /// Its PD: the windows and registrations its binds name.
    pd: Arc<PdInner>,
    #[allow(clippy::type_complexity)]
    _keep: (Arc<dyn UserCq>, Arc<dyn UserCq>, Option<Arc<dyn UserSrq>>),
}

impl QpInner {
    pub(crate) fn set_state(&self, state: QpState) -> Result<()> {
        let (mut a, m) = conv::qp_attr_to_ibv(
            &QpAttr {
                state,
                ..QpAttr::default()
            },
            QpAttrMask::STATE,
        )?;
        // Only the state (a move to Error or SQD needs nothing else).
        let m = m & rdma_mummy_sys::ibv_qp_attr_mask::IBV_QP_STATE.0;
        self.qp.modify(&mut a, m)?;
        self.note_state(state);
        Ok(())
    }

    pub(crate) fn note_state(&self, state: QpState) {
        let mut held = self.held_recv.lock();
        self.last_state.store(state as u8, Ordering::Relaxed);
        if state == QpState::Reset || held.is_empty() {
            return;
        }
        let wqes = std::mem::take(&mut *held);
        if let Err(e) = self.post_recv_now(&wqes) {
            tracing::warn!(qpn = self.qpn, n = wqes.len(), error = %e, "receives held in Reset could not be posted");
        }
    }

    /// Post receives, or hold them while the QP is in Reset (see `held_recv`).
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()> {
        let mut held = self.held_recv.lock();
        if self.last_state.load(Ordering::Relaxed) != QpState::Reset as u8 {
            drop(held);
            return self.post_recv_now(wqes);
        }
        conv::recv_chain(wqes, self.caps.max_recv_sge)?; // refuse now what the device would
        if held.len() + wqes.len() > self.caps.max_recv_wr as usize {
            return Err(VerbsError::Exhausted);
        }
        held.extend_from_slice(wqes);
        Ok(())
    }

    fn post_recv_now(&self, wqes: &[Wqe]) -> Result<()> {
        let mut chain = conv::recv_chain(wqes, self.caps.max_recv_sge)?;
        self.qp.post_recv(&mut chain.wrs[0])
    }

    pub(crate) fn state(&self) -> Result<QpState> {
        let q = conv::state_from_ibv(self.qp.query_state()?);
        if q == QpState::Reset && self.dev.iwarp {
            return Ok(QpState::from_u8(self.last_state.load(Ordering::Relaxed)).unwrap_or(q));
        }
        Ok(q)
    }

    /// Post requests some of which bind windows: every window and registration is found
    /// first (`Invalid` before anything is posted), then the requests go in pieces that
    /// each end with a bind, so that the window's key in `ibv_mw` is the current one when
    /// its bind is posted (rxe gives the kernel that key, which checks it) and the bind's
    /// new key after. A later piece the device refuses leaves the earlier ones posted.
    fn post_binding(&self, wqes: &[Wqe], ops: &[u32]) -> Result<()> {
        let bound = wqes
            .iter()
            .map(|w| match w.opcode() {
                Some(WrOpcode::BindMw) => self.pd.bind_objects(w).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<Option<Bound>>>>()?;
        let mut start = 0;
        while start < wqes.len() {
            let end = bound[start..]
                .iter()
                .position(Option::is_some)
                .map_or(wqes.len(), |i| start + i + 1);
            let mut chain = conv::send_chain(&wqes[start..end], &ops[start..end]);
            match &bound[end - 1] {
                Some(b) => {
                    let last = end - 1 - start;
                    conv::set_bind(
                        &mut chain.wrs[last],
                        &wqes[end - 1],
                        b.mw.mw.raw(),
                        b.mr.raw(),
                    );
                    let _g = b.mw.posting.lock();
                    self.qp.post_send(&mut chain.wrs[0])?;
                    b.mw.mw.set_rkey(wqes[end - 1].bind_args().mw_rkey);
                }
                None => self.qp.post_send(&mut chain.wrs[0])?,
            }
            start = end;
        }
        Ok(())
    }

    /// Post the Sends of a UD QP, each through the address handle it names.
    fn post_datagrams(&self, wqes: &[Wqe]) -> Result<()> {
        let ops = wqes
            .iter()
            .map(|w| match w.opcode() {
                Some(WrOpcode::Send | WrOpcode::SendWithImm) => conv::validate_send(w, &self.caps),
                _ => Err(VerbsError::Invalid),
            })
            .collect::<Result<Vec<u32>>>()?;
        let ahs = self.pd.address_handles(wqes)?;
        let mut chain = conv::send_chain(wqes, &ops);
        for ((wr, w), ah) in chain.wrs.iter_mut().zip(wqes).zip(&ahs) {
            conv::set_ud(wr, w, ah.as_ptr());
        }
        self.qp.post_send(&mut chain.wrs[0])
    }

    pub(crate) fn weak(self: &Arc<Self>) -> Weak<QpInner> {
        Arc::downgrade(self)
    }
}

impl UserQp for IbvQp {
    fn qp_num(&self) -> u32 {
        self.0.qpn
    }
    fn caps(&self) -> QpCaps {
        self.0.caps
    }
    fn post_send(&self, wqes: &[Wqe]) -> Result<()> {
        if wqes.is_empty() {
            return Ok(());
        }
        if self.0.qp_type == QpType::Ud {
            return self.0.post_datagrams(wqes);
        }
        let unbinding;
        let wqes = match wqes.iter().any(conv::is_unbind) {
            false => wqes,
            true => {
                unbinding = self.0.pd.unbinds_as_invalidates(wqes)?;
                &unbinding[..]
            }
        };
        let ops = wqes
            .iter()
            .map(|w| conv::validate_send(w, &self.0.caps))
            .collect::<Result<Vec<u32>>>()?;
        if !wqes.iter().any(|w| w.opcode() == Some(WrOpcode::BindMw)) {
            let mut chain = conv::send_chain(wqes, &ops);
            return self.0.qp.post_send(&mut chain.wrs[0]);
        }
        self.0.post_binding(wqes, &ops)
    }
    fn post_recv(&self, wqes: &[Wqe]) -> Result<()> {
        if wqes.is_empty() {
            return Ok(());
        }
        if self.0.has_srq {
            return Err(VerbsError::Invalid);
        }
        self.0.post_recv(wqes)
    }
    fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let (mut a, m) = conv::qp_attr_to_ibv(attr, mask)?;
        self.0.qp.modify(&mut a, m)?;
        if mask.contains(QpAttrMask::STATE) {
            self.0.note_state(attr.state);
        }
        if mask.contains(QpAttrMask::ACCESS) {
            self.0.access.store(a.qp_access_flags, Ordering::Relaxed);
        }
        Ok(())
    }
    fn state(&self) -> Result<QpState> {
        self.0.state()
    }
    fn disconnect(&self, abortive: bool) -> Result<()> {
        cm::disconnect(&self.0, abortive)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        // The connection's rdma_cm id goes first (it names the QP number), then the QP.
        cm::forget_qp(self);
        self.dev.qps.lock().remove(&self.qpn);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn async_event_kinds() {
        assert_eq!(async_kind(1), Some((EventKind::QpFatal, libc::EIO)));
        assert_eq!(async_kind(4), Some((EventKind::CommEstablished, 0)));
        assert_eq!(async_kind(15), Some((EventKind::SrqLimitReached, 0)));
        assert_eq!(async_kind(16), Some((EventKind::LastWqeReached, 0)));
        assert_eq!(async_kind(9), Some((EventKind::PortActive, 0)));
        assert_eq!(async_kind(8).map(|k| k.0), Some(EventKind::DeviceFatal));
        assert_eq!(async_kind(11), None); // LID change
        assert_eq!(async_kind(1000), None);
    }

    #[test]
    fn opening_a_missing_device_fails_cleanly() {
        assert!(Ibverbs.open("no-such-device0").is_err());
        assert_eq!(user_provider().driver(), "ibverbs");
    }
}
