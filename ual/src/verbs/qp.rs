//! Queue pairs: created with their shared rings and doorbell, modified, connected, posted to.

use super::*;

impl Context {
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
        if let Some((udev, upd)) = &pd.user {
            return self.create_device_qp(pd, (udev, upd), send_cq, recv_cq, cfg, caps);
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
        let path = QpPath::Ring(UserQp::new(a.qp_num, caps, sq, rq, doorbell));
        Ok(self.qp_object(a.handle, a.qp_num, path, pd, send_cq, recv_cq, cfg))
    }

    /// A QP made by the device's uVP in this process (its CQs and SRQ must be too).
    fn create_device_qp(
        self: &Arc<Self>,
        pd: &Arc<Pd>,
        (udev, upd): (&Arc<dyn user_half::UserDevice>, &Arc<dyn user_half::UserPd>),
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        cfg: QpConfig,
        caps: QpCaps,
    ) -> Result<Arc<Qp>> {
        let device_cq = |cq: &Cq| match &cq.path {
            CqPath::Device(c) => Ok(c.clone()),
            CqPath::Ring(_) => Err(VerbsError::Invalid),
        };
        let srq = match &cfg.srq {
            Some(s) => match &s.path {
                SrqPath::Device(d) => Some(d.clone()),
                SrqPath::Ring(_) => return Err(VerbsError::Invalid),
            },
            None => None,
        };
        let (scq, rcq) = (device_cq(send_cq)?, device_cq(recv_cq)?);
        let init = |h| user_half::UserQpInit {
            qp_type: cfg.qp_type,
            caps,
            send_cq: scq,
            recv_cq: rcq,
            srq,
            sink: self.sink(h),
        };
        let parents = [
            pd.handle,
            send_cq.handle,
            recv_cq.handle,
            cfg.srq.as_ref().map_or(0, |s| s.handle),
        ];
        let (handle, qp) = self.mirrored(pd.dev, abi::MIRROR_QP, parents, (0, 0), |h| {
            upd.create_qp(init(h))
        })?;
        let qp_num = qp.qp_num();
        let path = QpPath::Device(udev.clone(), qp);
        Ok(self.qp_object(handle, qp_num, path, pd, send_cq, recv_cq, cfg))
    }

    #[allow(clippy::too_many_arguments)]
    fn qp_object(
        self: &Arc<Self>,
        handle: u32,
        qp_num: u32,
        path: QpPath,
        pd: &Arc<Pd>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        cfg: QpConfig,
    ) -> Arc<Qp> {
        let events = self.subscribe(handle);
        Arc::new(Qp {
            ctx: self.clone(),
            handle,
            qp_num,
            qp_type: cfg.qp_type,
            path,
            events,
            srq: cfg.srq,
            _parents: (pd.clone(), send_cq.clone(), recv_cq.clone()),
        })
    }
}

/// How work is posted to a QP.
enum QpPath {
    /// Rings shared with the engine behind the kAL, and its doorbell.
    Ring(UserQp),
    /// The QP of the device's uVP in this process (with the device, for its connection
    /// manager).
    Device(Arc<dyn user_half::UserDevice>, Arc<dyn user_half::UserQp>),
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
    /// The service type it was created with.
    pub qp_type: QpType,
    path: QpPath,
    events: Receiver<Event>,
    srq: Option<Arc<Srq>>,
    _parents: (Arc<Pd>, Arc<Cq>, Arc<Cq>),
}

impl Qp {
    /// The memory of the QP's send and receive rings (`QpRingLayout` says where each
    /// is). It is this process's own memory; tests write it to play a hostile consumer.
    /// `None` on a device whose fast path is the consumer's (its queues are the device's).
    pub fn ring_memory(&self) -> Option<Arc<SharedMem>> {
        match &self.path {
            QpPath::Ring(r) => Some(r.ring_memory()),
            QpPath::Device(..) => None,
        }
    }

    /// Ring the doorbell without posting (after writing the rings through
    /// [`Qp::ring_memory`]).
    pub fn ring_doorbell(&self) {
        if let QpPath::Ring(r) = &self.path {
            r.ring_doorbell()
        }
    }

    pub fn post_send(&self, wqe: &Wqe) -> Result<()> {
        self.post_send_batch(std::slice::from_ref(wqe))
    }
    pub fn post_send_batch(&self, wqes: &[Wqe]) -> Result<()> {
        self.ctx.here()?;
        match &self.path {
            QpPath::Ring(r) => r.post_send_batch(wqes),
            QpPath::Device(_, q) => q.post_send(wqes),
        }
    }
    /// Post a receive; `Invalid` for a QP on an SRQ (post to the SRQ instead).
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        self.ctx.here()?;
        if self.srq.is_some() {
            return Err(VerbsError::Invalid);
        }
        match &self.path {
            QpPath::Ring(r) => r.post_recv(wqe),
            QpPath::Device(_, q) => q.post_recv(std::slice::from_ref(wqe)),
        }
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
        if let QpPath::Device(_, q) = &self.path {
            self.ctx.here()?;
            return q.modify(attr, mask);
        }
        let mut a = abi::QpAttrs::encode(self.handle, attr, mask);
        self.ctx.call(cmd::MODIFY_QP, &mut a)
    }

    pub fn state(&self) -> Result<QpState> {
        if let QpPath::Device(_, q) = &self.path {
            self.ctx.here()?;
            return q.state();
        }
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
        if let QpPath::Device(dev, q) = &self.path {
            self.ctx.here()?;
            return dev.connect(q, peer, param.clone());
        }
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
        if let QpPath::Device(_, q) = &self.path {
            self.ctx.here()?;
            return q.disconnect(abortive);
        }
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

impl Qp {
    /// The uVP's QP, on a device whose fast path is the consumer's.
    pub(super) fn device_qp(&self) -> Option<&Arc<dyn user_half::UserQp>> {
        match &self.path {
            QpPath::Device(_, q) => Some(q),
            QpPath::Ring(_) => None,
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_QP, self.handle);
        if let QpPath::Device(dev, qp) = &self.path {
            self.ctx.keep_in_fork_child((dev.clone(), qp.clone()));
        }
    }
}
