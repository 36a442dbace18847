//! RC endpoints: creation with DAT attributes (or the defaults), connection set-up and
//! tear-down on the common core, and every data transfer operation.

use crate::error::{Error, Major, Minor, Result};
use crate::evd::Evd;
use crate::event::ConnEvent;
use crate::ia::next_id;
use crate::mem::{segments, LmrTriplet, RmrInner, RmrTriplet};
use crate::pz::Pz;
use crate::srq::Srq;
use krdma_itapi as it;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

bitflags::bitflags! {
    /// Completion flags of a posted work request (`DAT_COMPLETION_FLAGS`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Completion: u32 {
        /// No completion event when it succeeds (failures always complete).
        const SUPPRESS = 0x01;
        /// Send: the receiver gets a solicited event. Receive: notify only for a
        /// solicited message.
        const SOLICITED_WAIT = 0x02;
        /// A completion event that does not notify (no CNO trigger).
        const UNSIGNALLED = 0x04;
        /// Start once earlier RDMA Reads have completed.
        const BARRIER_FENCE = 0x08;
    }
}

impl Completion {
    /// A completion event that notifies (`DAT_COMPLETION_DEFAULT_FLAG`).
    pub const DEFAULT: Completion = Completion::empty();

    fn core(self) -> it::DtoFlags {
        let mut f = it::DtoFlags::empty();
        if !self.contains(Completion::SUPPRESS) {
            f |= it::DtoFlags::COMPLETION;
            if !self.contains(Completion::UNSIGNALLED) {
                f |= it::DtoFlags::NOTIFY;
            }
        }
        if self.contains(Completion::SOLICITED_WAIT) {
            f |= it::DtoFlags::SOLICITED_WAIT;
        }
        if self.contains(Completion::BARRIER_FENCE) {
            f |= it::DtoFlags::BARRIER_FENCE;
        }
        f
    }
}

/// Endpoint attributes (`DAT_EP_ATTR`); [`Default`] is what an endpoint created
/// without attributes gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpAttr {
    pub max_message_size: u32,
    pub max_rdma_size: u32,
    pub max_recv_dtos: u32,
    pub max_request_dtos: u32,
    pub max_recv_iov: u32,
    pub max_request_iov: u32,
    /// Inbound RDMA Reads served at once (IRD).
    pub max_rdma_read_in: u32,
    /// Outbound RDMA Reads at once (ORD).
    pub max_rdma_read_out: u32,
    pub max_rdma_read_iov: u32,
    pub max_rdma_write_iov: u32,
    /// An unreliable-datagram endpoint (`DAT_IB_SERVICE_TYPE_UD`, devices with UD: rxe0)
    /// instead of a reliable-connected one.
    pub ud: bool,
}

impl Default for EpAttr {
    fn default() -> Self {
        EpAttr {
            max_message_size: 1 << 30,
            max_rdma_size: 1 << 30,
            max_recv_dtos: 64,
            max_request_dtos: 64,
            max_recv_iov: 4,
            max_request_iov: 4,
            max_rdma_read_in: 8,
            max_rdma_read_out: 8,
            max_rdma_read_iov: 4,
            max_rdma_write_iov: 4,
            ud: false,
        }
    }
}

impl EpAttr {
    fn core(&self) -> it::EpAttributes {
        let n = |v: u32| (v as usize).max(1);
        it::EpAttributes {
            max_dto_payload_size: self.max_message_size.max(self.max_rdma_size) as usize,
            max_request_dtos: n(self.max_request_dtos),
            max_recv_dtos: n(self.max_recv_dtos),
            max_send_segments: n(self.max_request_iov),
            max_recv_segments: n(self.max_recv_iov),
            rdma_read_enable: true,
            rdma_write_enable: true,
            max_rdma_read_segments: n(self.max_rdma_read_iov),
            max_rdma_write_segments: n(self.max_rdma_write_iov),
            rdma_read_ird: self.max_rdma_read_in,
            rdma_read_ord: self.max_rdma_read_out,
        }
    }
}

/// Connection state (`DAT_EP_STATE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum EpState {
    Unconnected = 0,
    PassiveConnectionPending = 4,
    ActiveConnectionPending = 6,
    Connected = 9,
    DisconnectPending = 10,
    Disconnected = 11,
}

/// What [`Ep::query`] reports (`DAT_EP_PARAM`).
#[derive(Debug, Clone)]
pub struct EpParam {
    pub state: EpState,
    pub local: Option<std::net::IpAddr>,
    pub remote: Option<SocketAddr>,
    pub attr: EpAttr,
}

/// A reliable-connected endpoint (`dat_ep_create`, `dat_ep_create_with_srq`).
///
/// ```no_run
/// use krdma_dapl::*;
/// use std::time::Duration;
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// let dto = Evd::create(&ia, 64, None, EvdFlags::DTO)?;
/// let conn = Evd::create(&ia, 4, None, EvdFlags::CONNECTION)?;
/// let ep = Ep::create(&pz, &dto, &dto, &conn, EpAttr::default(), None)?;
/// ep.connect("127.0.0.1:45248".parse().unwrap(), b"hello", )?;
/// match conn.wait(Some(Duration::from_secs(5)), 1)?.0 {
///     Event::Connection(c) if c.kind == ConnEvent::Established => {}
///     other => panic!("not connected: {other:?}"),
/// }
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Ep(pub(crate) Arc<EpInner>);

pub struct EpInner {
    pub(crate) id: u64,
    pz: Pz,
    recv_evd: Evd,
    request_evd: Evd,
    connect_evd: Evd,
    srq: Option<Srq>,
    attr: EpAttr,
    /// The core endpoint; replaced by [`Ep::reset`].
    it: Mutex<it::Endpoint>,
    /// Core endpoint ids this endpoint has had (their completions are still ours).
    core_ids: Mutex<Vec<u64>>,
    /// RMR binds in flight, by the token their core request carries.
    binds: Mutex<HashMap<u64, Bind>>,
    next_token: AtomicU64,
    /// A graceful disconnect was asked for and its event has not come.
    disconnecting: std::sync::atomic::AtomicBool,
}

struct Bind {
    rmr: Weak<RmrInner>,
    cookie: u64,
    report: bool,
}

impl Ep {
    /// Create an endpoint in `pz`: receive completions go to `recv_evd`, send-side ones
    /// to `request_evd` (DTO EVDs, possibly the same), connection events to
    /// `connect_evd`. With `srq`, receives come from the shared receive queue.
    pub fn create(
        pz: &Pz,
        recv_evd: &Evd,
        request_evd: &Evd,
        connect_evd: &Evd,
        attr: EpAttr,
        srq: Option<&Srq>,
    ) -> Result<Ep> {
        let ia = pz.ia();
        for (evd, minor) in [
            (recv_evd, Minor::HandleEvdRecv),
            (request_evd, Minor::HandleEvdRequest),
            (connect_evd, Minor::HandleEvdConn),
        ] {
            if evd.ia().id() != ia.id() {
                return Err(Error::handle(minor));
            }
        }
        if let Some(s) = srq {
            if s.pz().id() != pz.id() {
                return Err(Error::handle(Minor::HandleSrq));
            }
        }
        let core = Self::make_core(pz, recv_evd, request_evd, connect_evd, &attr, srq)?;
        let inner = Arc::new(EpInner {
            id: next_id(),
            pz: pz.clone(),
            recv_evd: recv_evd.clone(),
            request_evd: request_evd.clone(),
            connect_evd: connect_evd.clone(),
            srq: srq.cloned(),
            attr,
            core_ids: Mutex::new(vec![core.id()]),
            it: Mutex::new(core.clone()),
            binds: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            disconnecting: Default::default(),
        });
        ia.0.eps.write().insert(core.id(), Arc::downgrade(&inner));
        tracing::debug!(id = inner.id, core = core.id(), "DAT endpoint created");
        Ok(Ep(inner))
    }

    fn make_core(
        pz: &Pz,
        recv_evd: &Evd,
        request_evd: &Evd,
        connect_evd: &Evd,
        attr: &EpAttr,
        srq: Option<&Srq>,
    ) -> Result<it::Endpoint> {
        let create = if attr.ud {
            it::Endpoint::create_ud
        } else {
            it::Endpoint::create_rc
        };
        create(
            &pz.0.it,
            dto_core(request_evd, Minor::HandleEvdRequest)?,
            dto_core(recv_evd, Minor::HandleEvdRecv)?,
            connect_evd
                .core_for(it::EventStream::CmMessage)
                .ok_or(Error::handle(Minor::HandleEvdConn))?,
            attr.core(),
            srq.map(|s| &s.0.it),
        )
        .map_err(|e| match e {
            it::Error::InvalidEpAttr
            | it::Error::ResourceRecvDto
            | it::Error::ResourceReqDto
            | it::Error::ResourceRseg
            | it::Error::ResourceSseg
            | it::Error::ResourceRrseg
            | it::Error::ResourceRwseg
            | it::Error::ResourceIrd
            | it::Error::ResourceOrd => Error::new(Major::InvalidParameter, Minor::Arg6),
            other => other.into(),
        })
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    /// An unreliable-datagram endpoint.
    pub fn is_ud(&self) -> bool {
        self.0.attr.ud
    }

    pub fn recv_evd(&self) -> &Evd {
        &self.0.recv_evd
    }

    pub fn request_evd(&self) -> &Evd {
        &self.0.request_evd
    }

    pub fn connect_evd(&self) -> &Evd {
        &self.0.connect_evd
    }

    pub fn srq(&self) -> Option<&Srq> {
        self.0.srq.as_ref()
    }

    pub fn attr(&self) -> &EpAttr {
        &self.0.attr
    }

    /// The core endpoint (as of now: [`reset`](Self::reset) replaces it).
    pub fn core(&self) -> it::Endpoint {
        self.0.it.lock().clone()
    }

    pub fn state(&self) -> EpState {
        let s = self.core().state();
        match s {
            it::EpState::Unconnected => EpState::Unconnected,
            it::EpState::Active1ConnectionPending | it::EpState::Active2ConnectionPending => {
                EpState::ActiveConnectionPending
            }
            it::EpState::PassiveConnectionPending | it::EpState::PassiveWaitRdmaTransReq => {
                EpState::PassiveConnectionPending
            }
            it::EpState::Connected if self.0.disconnecting.load(Ordering::Acquire) => {
                EpState::DisconnectPending
            }
            it::EpState::Connected => EpState::Connected,
            it::EpState::NonOperational => EpState::Disconnected,
        }
    }

    pub fn query(&self) -> EpParam {
        let q = self.core().query();
        EpParam {
            state: self.state(),
            local: self.0.pz.ia().core().local_address(),
            remote: q.peer,
            attr: self.0.attr.clone(),
        }
    }

    /// Whether the receive queue and the request queue are idle.
    pub fn idle(&self) -> (bool, bool) {
        let (sends, recvs) = self.core().outstanding();
        (recvs == 0, sends == 0)
    }

    /// Connect to the PSP or RSP at `peer` (its IA address, and the connection
    /// qualifier as port), offering `private_data`. The outcome arrives on the
    /// connection EVD.
    pub fn connect(&self, peer: SocketAddr, private_data: &[u8]) -> Result<()> {
        if self.state() != EpState::Unconnected {
            return Err(Error::state(Minor::EpNotReady));
        }
        self.core()
            .connect(peer, private_data)
            .map_err(|e| match e {
                it::Error::InvalidEpState => Error::state(Minor::EpNotReady),
                it::Error::InvalidAddress => {
                    Error::new(Major::InvalidAddress, Minor::AddressUnreachable)
                }
                other => other.into(),
            })
    }

    /// Graceful (`abrupt == false`: posted sends complete first) or abrupt disconnect.
    /// `Disconnected` follows on the connection EVD of both sides; receives still
    /// posted complete flushed. An abrupt disconnect with sends still outstanding
    /// resets the connection (they flush; an iWARP peer sees it `Broken`); with none, it
    /// is an orderly close on the wire, as DAT providers over the RDMA CM make every
    /// disconnect, and the peer sees `Disconnected`. Abruptly disconnecting an endpoint
    /// that is not connected is allowed and does nothing but abandon a pending
    /// connection.
    pub fn disconnect(&self, abrupt: bool) -> Result<()> {
        match self.state() {
            EpState::Connected | EpState::DisconnectPending => {
                let core = self.core();
                if abrupt && core.outstanding().0 > 0 {
                    core.abort()?;
                } else if abrupt {
                    core.disconnect()?;
                } else {
                    self.0.disconnecting.store(true, Ordering::Release);
                    core.disconnect()?;
                }
                Ok(())
            }
            EpState::ActiveConnectionPending | EpState::PassiveConnectionPending if abrupt => {
                self.replace_core()
            }
            EpState::Unconnected | EpState::Disconnected if abrupt => Ok(()),
            _ => Err(Error::state(Minor::EpUnconnected)),
        }
    }

    /// Make a disconnected endpoint usable again (`dat_ep_reset`): a fresh transport
    /// endpoint with the same attributes and EVDs.
    pub fn reset(&self) -> Result<()> {
        match self.state() {
            EpState::Unconnected => Ok(()),
            EpState::Disconnected => self.replace_core(),
            _ => Err(Error::state(Minor::EpConnected)),
        }
    }

    fn replace_core(&self) -> Result<()> {
        let i = &self.0;
        let core = Self::make_core(
            &i.pz,
            &i.recv_evd,
            &i.request_evd,
            &i.connect_evd,
            &i.attr,
            i.srq.as_ref(),
        )?;
        i.pz.ia()
            .0
            .eps
            .write()
            .insert(core.id(), Arc::downgrade(&self.0));
        i.core_ids.lock().push(core.id());
        let old = std::mem::replace(&mut *i.it.lock(), core);
        i.disconnecting.store(false, Ordering::Release);
        tracing::debug!(id = i.id, old = old.id(), "DAT endpoint reset");
        Ok(())
    }

    /// Send the bytes of `iov` to the peer's next receive.
    pub fn post_send(&self, iov: &[LmrTriplet], cookie: u64, flags: Completion) -> Result<()> {
        let segs = segments(&self.0.pz, iov)?;
        self.core()
            .post_send(&segs, cookie, flags.core())
            .map_err(post_error)
    }

    /// Send the bytes of `iov` as one datagram from this UD endpoint to `to`, what a
    /// resolution reported (IB extension `dat_ib_post_send_ud`).
    pub fn post_send_ud(
        &self,
        iov: &[LmrTriplet],
        to: &it::UdRemote,
        cookie: u64,
        flags: Completion,
    ) -> Result<()> {
        let segs = segments(&self.0.pz, iov)?;
        self.core()
            .post_sendto(&segs, cookie, flags.core(), to)
            .map_err(post_error)
    }

    /// Post a receive scattering the next message over `iov`.
    pub fn post_recv(&self, iov: &[LmrTriplet], cookie: u64, flags: Completion) -> Result<()> {
        if self.0.srq.is_some() {
            return Err(Error::state(Minor::EpNotReady));
        }
        let segs = segments(&self.0.pz, iov)?;
        self.core()
            .post_recv(&segs, cookie, flags.core() | it::DtoFlags::COMPLETION)
            .map_err(post_error)
    }

    /// Write `iov` to the peer's memory at `remote`.
    pub fn post_rdma_write(
        &self,
        iov: &[LmrTriplet],
        cookie: u64,
        remote: &RmrTriplet,
        flags: Completion,
    ) -> Result<()> {
        let segs = segments(&self.0.pz, iov)?;
        self.core()
            .post_rdma_write(&segs, cookie, flags.core(), rdma_addr(remote))
            .map_err(post_error)
    }

    /// Write `iov` to the peer's memory at `remote`, with `imm` for the completion of
    /// the peer's next receive (IB extension `dat_ib_post_rdma_write_immed`; where the
    /// transport has it: rxe0, not siw0).
    pub fn post_rdma_write_immed(
        &self,
        iov: &[LmrTriplet],
        cookie: u64,
        remote: &RmrTriplet,
        imm: u32,
        flags: Completion,
    ) -> Result<()> {
        let segs = segments(&self.0.pz, iov)?;
        self.core()
            .post_rdma_write_imm(&segs, cookie, flags.core(), rdma_addr(remote), imm)
            .map_err(post_error)
    }

    /// Read the peer's memory at `remote` into `iov`.
    pub fn post_rdma_read(
        &self,
        iov: &[LmrTriplet],
        cookie: u64,
        remote: &RmrTriplet,
        flags: Completion,
    ) -> Result<()> {
        let segs = segments(&self.0.pz, iov)?;
        self.core()
            .post_rdma_read(&segs, cookie, flags.core(), rdma_addr(remote))
            .map_err(post_error)
    }

    /// IB extension: an atomic on the peer's 8 aligned bytes at `remote`; the value
    /// found there lands in `result` (8 bytes). Where the device has atomics (rxe0).
    pub fn post_atomic(
        &self,
        op: it::AtomicOp,
        result: &LmrTriplet,
        cookie: u64,
        remote: &RmrTriplet,
        flags: Completion,
    ) -> Result<()> {
        let segs = segments(&self.0.pz, std::slice::from_ref(result))?;
        self.core()
            .post_atomic(op, &segs[0], cookie, flags.core(), rdma_addr(remote))
            .map_err(post_error)
    }
}

/// The DTO SEVD of an EVD given for an endpoint's completions.
fn dto_core(evd: &Evd, minor: Minor) -> Result<&it::Evd> {
    evd.core_for(it::EventStream::Dto)
        .ok_or(Error::handle(minor))
}

fn rdma_addr(r: &RmrTriplet) -> it::RdmaAddr {
    it::RdmaAddr {
        addr: r.address,
        rmr_context: r.rmr_context as u64,
    }
}

fn post_error(e: it::Error) -> Error {
    match e {
        it::Error::InvalidEpState => Error::state(Minor::EpNotReady),
        it::Error::TooManyPosts => Error::new(Major::InsufficientResources, Minor::ResourceTep),
        it::Error::InvalidLmr | it::Error::Range => {
            Error::new(Major::ProtectionViolation, Minor::None)
        }
        other => other.into(),
    }
}

impl EpInner {
    /// A token for an RMR bind posted on this endpoint.
    pub(crate) fn bind_token(&self, rmr: &Arc<RmrInner>, cookie: u64, flags: Completion) -> u64 {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let report = !flags.contains(Completion::SUPPRESS);
        self.binds.lock().insert(
            token,
            Bind {
                rmr: Arc::downgrade(rmr),
                cookie,
                report,
            },
        );
        token
    }

    pub(crate) fn forget_bind(&self, token: u64) {
        self.binds.lock().remove(&token);
    }

    /// The bind a completed token belonged to: the RMR, its cookie, and whether to
    /// report success.
    pub(crate) fn complete_bind(&self, token: u64) -> Option<(Weak<RmrInner>, u64, bool)> {
        self.binds
            .lock()
            .remove(&token)
            .map(|b| (b.rmr, b.cookie, b.report))
    }

    pub(crate) fn on_connection_event(&self, kind: ConnEvent) {
        if kind != ConnEvent::Established {
            self.disconnecting.store(false, Ordering::Release);
        }
    }
}

impl Drop for EpInner {
    fn drop(&mut self) {
        let ia = self.pz.ia();
        let mut eps = ia.0.eps.write();
        for id in self.core_ids.lock().iter() {
            eps.remove(id);
        }
        tracing::debug!(id = self.id, "DAT endpoint freed");
    }
}
