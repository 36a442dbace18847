//! Connection management: the IB Communication Manager over QP1 (GSI) MADs with the
//! rdma_cm conventions, so rdma_cm peers (rping, perftest `-R`) connect to krdma and
//! back.
//!
//! Active side: REQ (rdma_cm header + up to 56 bytes of private data, service ID of the
//! TCP port space) → REP → the QP goes to RTR and RTS → RTU, `Established`. Passive
//! side: a REQ for a listened port becomes a `ConnectRequest`; accept moves the QP to RTS
//! and sends REP (private data up to 196 bytes); RTU gives `Established`; reject sends REJ
//! (reason 28, consumer-defined). Disconnect: DREQ/DREP; either side's QP goes to Error
//! and reports `Disconnected`. MADs are datagrams: REQ, REP and DREQ are retried until
//! answered; duplicates are answered again (REP → RTU again; DREQ → DREP even when the
//! connection is already gone).

use crate::device::Shared;
use crate::net::{canonical, Datagram};
use crate::qp::RxeQp;
use crate::timer::Target;
use crate::wire::cm::{self, rej_reason, CmMad, CmMessage, CmPath};
use crate::wire::{cma, icrc, RoceRepr};
use parking_lot::Mutex;
use rnicpi::*;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Time between retries of an unanswered REQ, REP or DREQ.
const MAD_RETRY: Duration = Duration::from_millis(500);
/// Retries before giving up (then `Unreachable`, or the disconnect completes anyway).
const MAD_RETRIES: u32 = 15;
/// How often an orderly disconnect looks at the send queue, and for how long at most.
const DRAIN_POLL: Duration = Duration::from_millis(1);
const DRAIN_MAX: u32 = 5000;
/// Consumer private data a REQ can carry after the rdma_cm header.
pub const REQ_PDATA_MAX: usize = cm::REQ_PRIVATE_DATA_LEN - cma::HEADER_LEN;
/// Q_Key of the GSI.
const GSI_QKEY: u32 = crate::wire::deth::GSI_QKEY;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Active: REQ sent, waiting for REP.
    ReqSent,
    /// Passive: REQ delivered to the consumer, waiting for accept/reject.
    ReqRcvd,
    /// Passive: REP sent, waiting for RTU.
    RepSent,
    Established,
    /// Orderly disconnect: waiting for the send queue to drain before the DREQ.
    Draining,
    /// DREQ sent, waiting for DREP.
    DreqSent,
}

struct Conn {
    phase: Phase,
    local_id: u32,
    remote_id: u32,
    local: IpAddr,
    peer: IpAddr,
    qp: Weak<RxeQp>,
    /// The peer's QP number (from its REQ or REP).
    remote_qpn: u32,
    /// Passive side: the REQ, until accepted or rejected; and the listener's port.
    req: Option<cm::Req>,
    /// The message to retry while waiting, and how often it may still be sent.
    retry: Option<[u8; crate::wire::mad::MAD_LEN]>,
    retries_left: u32,
    gen: u64,
    /// Our receive PSN (sent in the REQ or REP).
    rq_psn: u32,
    /// Active side: what the consumer asked for.
    param: ConnParam,
}

struct ListenEntry {
    addr: Option<IpAddr>,
    sink: Arc<dyn EventSink>,
    id: u64,
}

#[derive(Default)]
struct Inner {
    conns: HashMap<u32, Conn>,
    listeners: HashMap<u16, Vec<ListenEntry>>,
    next_id: u32,
    gsi_psn: u32,
    rng: u64,
}

/// The device's connection manager (its QP1).
pub struct Cm {
    inner: Mutex<Inner>,
    next_listener: AtomicU64,
}

impl Default for Cm {
    fn default() -> Self {
        Self::new()
    }
}

impl Cm {
    pub fn new() -> Cm {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            ^ (std::process::id() as u64) << 32;
        let mut inner = Inner {
            rng: seed | 1,
            ..Inner::default()
        };
        inner.next_id = inner.random() as u32;
        Cm {
            inner: Mutex::new(inner),
            next_listener: AtomicU64::new(1),
        }
    }
}

impl Inner {
    fn random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    fn new_id(&mut self) -> u32 {
        loop {
            self.next_id = self.next_id.wrapping_add(1);
            if self.next_id != 0 && !self.conns.contains_key(&self.next_id) {
                return self.next_id;
            }
        }
    }
}

fn pad<const N: usize>(data: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    let n = data.len().min(N);
    a[..n].copy_from_slice(&data[..n]);
    a
}

fn gid(ip: IpAddr) -> [u8; 16] {
    ip_to_gid(ip)
}

/// The IB MTU code (1 = 256 … 5 = 4096) of a byte count.
fn mtu_code(bytes: u32) -> u8 {
    match bytes {
        4096.. => 5,
        2048.. => 4,
        1024.. => 3,
        512.. => 2,
        _ => 1,
    }
}

/// Send one MAD from our QP1 to `peer`'s.
fn send_mad(s: &Shared, src: IpAddr, peer: IpAddr, mad: &[u8; crate::wire::mad::MAD_LEN]) {
    let psn = {
        let mut i = s.cm.inner.lock();
        let p = i.gsi_psn;
        i.gsi_psn = (p + 1) & crate::wire::PSN_MASK;
        p
    };
    let repr: RoceRepr<'_> = cm::gsi_packet(mad, crate::wire::bth::DEFAULT_PKEY, psn);
    s.send_repr(src, peer, icrc::rxe_qp_udp_sport(1), &repr);
    s.count(&s.counters.cm_sent);
}

fn mad_bytes(tid: u64, msg: CmMessage) -> [u8; crate::wire::mad::MAD_LEN] {
    CmMad::new(tid, msg).to_bytes()
}

fn arm(s: &Shared, c: &mut Conn) {
    arm_after(s, c, MAD_RETRY);
}

fn arm_after(s: &Shared, c: &mut Conn, after: Duration) {
    c.gen += 1;
    s.timers
        .arm(Target::Cm(c.local_id), c.gen, Instant::now() + after);
}

/// What a connection fixes for its QP.
struct Link {
    peer: IpAddr,
    local: IpAddr,
    remote_qpn: u32,
    rq_psn: u32,
    sq_psn: u32,
    mtu: u32,
    ird: u32,
    ord: u32,
}

/// Move `qp` through Init → RTR → RTS for a connection.
fn bring_up(s: &Shared, qp: &RxeQp, l: &Link) -> Result<()> {
    if qp.state() == QpState::Reset {
        let init = QpAttr {
            state: QpState::Init,
            access: Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
            ..QpAttr::default()
        };
        qp.cm_modify(&init, QpAttrMask::STATE | QpAttrMask::ACCESS)?;
    }
    let sgid_index = s.addrs().iter().position(|a| *a == l.local).unwrap_or(0) as u8;
    let rtr = QpAttr {
        state: QpState::Rtr,
        path_mtu: l.mtu,
        dest_qpn: l.remote_qpn,
        rq_psn: l.rq_psn,
        max_dest_rd_atomic: l.ird.clamp(1, 255) as u8,
        min_rnr_timer: 12,
        dgid: gid(l.peer),
        sgid_index,
        hop_limit: 64,
        ..QpAttr::default()
    };
    qp.cm_modify(
        &rtr,
        QpAttrMask::STATE
            | QpAttrMask::AV
            | QpAttrMask::PATH_MTU
            | QpAttrMask::DEST_QPN
            | QpAttrMask::RQ_PSN
            | QpAttrMask::MAX_DEST_RD_ATOMIC
            | QpAttrMask::MIN_RNR_TIMER,
    )?;
    let rts = QpAttr {
        state: QpState::Rts,
        sq_psn: l.sq_psn,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: l.ord.clamp(1, 255) as u8,
        ..QpAttr::default()
    };
    qp.cm_modify(
        &rts,
        QpAttrMask::STATE
            | QpAttrMask::SQ_PSN
            | QpAttrMask::TIMEOUT
            | QpAttrMask::RETRY_CNT
            | QpAttrMask::RNR_RETRY
            | QpAttrMask::MAX_RD_ATOMIC,
    )
}

/// Active connect of `qp` to `peer` (its IP address and rdma_cm TCP port).
pub fn connect(s: &Arc<Shared>, qp: &Arc<RxeQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
    if param.private_data.len() > REQ_PDATA_MAX {
        return Err(VerbsError::Invalid);
    }
    if !matches!(qp.state(), QpState::Reset | QpState::Init) {
        return Err(VerbsError::BadState);
    }
    let dst = canonical(peer.ip());
    let src = s.source_for(dst)?;
    let mut i = s.cm.inner.lock();
    if i.conns
        .values()
        .any(|c| c.qp.upgrade().is_some_and(|q| Arc::ptr_eq(&q, qp)))
    {
        return Err(VerbsError::BadState);
    }
    let local_id = i.new_id();
    let rq_psn = (i.random() as u32) & crate::wire::PSN_MASK;
    let src_port = 0xc000 | (i.random() as u16 & 0x3fff);
    let mut pdata = [0u8; cm::REQ_PRIVATE_DATA_LEN];
    let hdr = cma::CmaHdr { src_port, src, dst };
    hdr.emit(&mut pdata).map_err(|_| VerbsError::Invalid)?;
    pdata[cma::HEADER_LEN..cma::HEADER_LEN + param.private_data.len()]
        .copy_from_slice(&param.private_data);
    let req = cm::Req {
        local_comm_id: local_id,
        service_id: cma::service_id_tcp(peer.port()),
        local_ca_guid: s.attr.node_guid,
        local_qkey: 0,
        local_qpn: qp.qpn,
        responder_resources: param.ird.clamp(1, s.attr.max_ird) as u8,
        local_eecn: 0,
        initiator_depth: param.ord.clamp(1, s.attr.max_ord) as u8,
        remote_eecn: 0,
        remote_cm_response_timeout: 20,
        transport_service_type: cm::transport_type::RC,
        end_to_end_flow_control: false,
        starting_psn: rq_psn,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: crate::wire::bth::DEFAULT_PKEY,
        path_mtu: mtu_code(s.active_mtu()),
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        extended_transport_type: 0,
        primary_path: CmPath {
            local_lid: 0xffff,
            remote_lid: 0xffff,
            local_gid: gid(src),
            remote_gid: gid(dst),
            hop_limit: 64,
            local_ack_timeout: 18,
            ..CmPath::default()
        },
        alternate_path: CmPath::default(),
        sap_supported: false,
        private_data: pdata,
    };
    let tid = i.random();
    let mad = mad_bytes(tid, CmMessage::Req(req));
    let mut c = Conn {
        phase: Phase::ReqSent,
        local_id,
        remote_id: 0,
        local: src,
        peer: dst,
        qp: Arc::downgrade(qp),
        remote_qpn: 0,
        req: None,
        retry: Some(mad),
        retries_left: MAD_RETRIES,
        gen: 0,
        rq_psn,
        param,
    };
    arm(s, &mut c);
    i.conns.insert(local_id, c);
    drop(i);
    tracing::info!(qpn = qp.qpn, %peer, local_id, "rxe CM: REQ");
    send_mad(s, src, dst, &mad);
    Ok(())
}

/// Close a connection: both kinds end with a DREQ (IB has no reset). An orderly close
/// first lets the send queue drain (for at most 5 s), so work posted before it completes
/// and arrives, as with siw's FIN; an abortive one flushes at once.
pub fn disconnect(s: &Arc<Shared>, qp: &Arc<RxeQp>, abortive: bool) -> Result<()> {
    let mut i = s.cm.inner.lock();
    let Some(c) = i
        .conns
        .values_mut()
        .find(|c| c.qp.upgrade().is_some_and(|q| Arc::ptr_eq(&q, qp)))
    else {
        return Err(VerbsError::BadState);
    };
    match c.phase {
        Phase::Established | Phase::RepSent => {}
        Phase::Draining if abortive => {}
        Phase::ReqSent => {
            // Not connected yet: just forget the attempt.
            let id = c.local_id;
            i.conns.remove(&id);
            return Ok(());
        }
        _ => return Err(VerbsError::BadState),
    }
    if !abortive && qp.send_busy() {
        c.phase = Phase::Draining;
        c.retry = None;
        c.retries_left = DRAIN_MAX;
        arm_after(s, c, DRAIN_POLL);
        return Ok(());
    }
    let id = c.local_id;
    drop(i);
    send_dreq(s, id);
    Ok(())
}

/// Send the DREQ of connection `id` and move its QP to Error (flushing what is left).
fn send_dreq(s: &Arc<Shared>, id: u32) {
    let mut i = s.cm.inner.lock();
    let tid = i.random();
    let Some(c) = i.conns.get_mut(&id) else {
        return;
    };
    let mad = mad_bytes(
        tid,
        CmMessage::Dreq(cm::Dreq {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            remote_qpn: c.remote_qpn,
            private_data: [0; cm::DREQ_PRIVATE_DATA_LEN],
        }),
    );
    c.phase = Phase::DreqSent;
    c.retry = Some(mad);
    c.retries_left = 3;
    arm(s, c);
    let (src, dst, qp) = (c.local, c.peer, c.qp.upgrade());
    drop(i);
    if let Some(qp) = qp {
        let mut st = qp.st.lock();
        qp.to_error(&mut st);
    }
    send_mad(s, src, dst, &mad);
}

/// A passive endpoint on an rdma_cm port.
pub struct RxeListener {
    shared: Weak<Shared>,
    addr: SocketAddr,
    id: u64,
}

pub fn listen(
    s: &Arc<Shared>,
    addr: SocketAddr,
    sink: Arc<dyn EventSink>,
) -> Result<Arc<dyn ProviderListener>> {
    let ip = Some(canonical(addr.ip())).filter(|a| !a.is_unspecified());
    if let Some(a) = ip {
        if !s.addrs().contains(&a) {
            return Err(VerbsError::Unreachable);
        }
    }
    let mut i = s.cm.inner.lock();
    let port = if addr.port() == 0 {
        loop {
            let p = 0x8000 | (i.random() as u16 & 0x3fff);
            if !i.listeners.contains_key(&p) {
                break p;
            }
        }
    } else {
        addr.port()
    };
    let entries = i.listeners.entry(port).or_default();
    if entries
        .iter()
        .any(|e| e.addr.is_none() || ip.is_none() || e.addr == ip)
    {
        return Err(VerbsError::AddrInUse);
    }
    let id = s.cm.next_listener.fetch_add(1, Ordering::Relaxed);
    entries.push(ListenEntry { addr: ip, sink, id });
    tracing::info!(port, ?ip, "rxe CM: listening");
    Ok(Arc::new(RxeListener {
        shared: Arc::downgrade(s),
        addr: SocketAddr::new(ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)), port),
        id,
    }))
}

impl ProviderListener for RxeListener {
    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn accept(&self, conn_id: u64, qp: &Arc<dyn ProviderQp>, param: ConnParam) -> Result<()> {
        let s = self.shared.upgrade().ok_or(VerbsError::BadState)?;
        let rqp = qp
            .as_any()
            .downcast_ref::<RxeQp>()
            .and_then(RxeQp::arc)
            .ok_or(VerbsError::Invalid)?;
        if param.private_data.len() > cm::REP_PRIVATE_DATA_LEN {
            return Err(VerbsError::Invalid);
        }
        let mut i = s.cm.inner.lock();
        let id = u32::try_from(conn_id).map_err(|_| VerbsError::NoSuchResource)?;
        let rq_psn = (i.random() as u32) & crate::wire::PSN_MASK;
        let tid = i.random();
        let c = i.conns.get_mut(&id).ok_or(VerbsError::NoSuchResource)?;
        if c.phase != Phase::ReqRcvd {
            return Err(VerbsError::BadState);
        }
        let req = c.req.ok_or(VerbsError::BadState)?;
        let mtu = cm::mtu_bytes(req.path_mtu)
            .map(|m| m as u32)
            .unwrap_or(1024)
            .min(s.active_mtu());
        let link = Link {
            peer: c.peer,
            local: c.local,
            remote_qpn: req.local_qpn,
            rq_psn,
            sq_psn: req.starting_psn,
            mtu,
            ird: param.ird,
            ord: param.ord.min(req.responder_resources as u32),
        };
        bring_up(&s, &rqp, &link)?;
        let rep = cm::Rep {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            local_qkey: 0,
            local_qpn: rqp.qpn,
            local_eecn: 0,
            starting_psn: rq_psn,
            responder_resources: param.ird.clamp(1, s.attr.max_ird) as u8,
            initiator_depth: param.ord.clamp(1, s.attr.max_ord) as u8,
            target_ack_delay: 0,
            failover_accepted: 0,
            end_to_end_flow_control: false,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: s.attr.node_guid,
            private_data: pad(&param.private_data),
        };
        let mad = mad_bytes(tid, CmMessage::Rep(rep));
        c.phase = Phase::RepSent;
        c.qp = Arc::downgrade(&rqp);
        c.remote_qpn = req.local_qpn;
        c.rq_psn = rq_psn;
        c.retry = Some(mad);
        c.retries_left = MAD_RETRIES;
        arm(&s, c);
        let (src, dst) = (c.local, c.peer);
        drop(i);
        tracing::info!(qpn = rqp.qpn, conn = id, "rxe CM: REP");
        send_mad(&s, src, dst, &mad);
        Ok(())
    }

    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        let s = self.shared.upgrade().ok_or(VerbsError::BadState)?;
        let id = u32::try_from(conn_id).map_err(|_| VerbsError::NoSuchResource)?;
        let mut i = s.cm.inner.lock();
        let tid = i.random();
        let c = match i.conns.get(&id) {
            Some(c) if c.phase == Phase::ReqRcvd => i.conns.remove(&id),
            Some(_) => return Err(VerbsError::BadState),
            None => return Err(VerbsError::NoSuchResource),
        }
        .ok_or(VerbsError::NoSuchResource)?;
        drop(i);
        let rej = rej_mad(
            tid,
            c.local_id,
            c.remote_id,
            cm::msg_ref::REQ,
            rej_reason::CONSUMER_DEFINED,
            private_data,
        );
        send_mad(&s, c.local, c.peer, &rej);
        Ok(())
    }

    fn close(&self) {
        let Some(s) = self.shared.upgrade() else {
            return;
        };
        let mut i = s.cm.inner.lock();
        for entries in i.listeners.values_mut() {
            entries.retain(|e| e.id != self.id);
        }
        i.listeners.retain(|_, v| !v.is_empty());
        // Refuse requests nobody will answer now.
        let pending: Vec<u32> = i
            .conns
            .values()
            .filter(|c| {
                c.phase == Phase::ReqRcvd
                    && c.req
                        .is_some_and(|r| r.service_id & 0xffff == self.addr.port() as u64)
            })
            .map(|c| c.local_id)
            .collect();
        let tid = i.random();
        let refused: Vec<Conn> = pending.iter().filter_map(|id| i.conns.remove(id)).collect();
        drop(i);
        for c in refused {
            let rej = rej_mad(
                tid,
                c.local_id,
                c.remote_id,
                cm::msg_ref::REQ,
                rej_reason::CONSUMER_DEFINED,
                &[],
            );
            send_mad(&s, c.local, c.peer, &rej);
        }
    }
}

fn rej_mad(
    tid: u64,
    local_id: u32,
    remote_id: u32,
    which: u8,
    reason: u16,
    pdata: &[u8],
) -> [u8; crate::wire::mad::MAD_LEN] {
    mad_bytes(
        tid,
        CmMessage::Rej(cm::Rej {
            local_comm_id: local_id,
            remote_comm_id: remote_id,
            message_rejected: which,
            rejected_info_length: 0,
            reason,
            ari: [0; cm::REJ_ARI_LEN],
            private_data: pad(pdata),
        }),
    )
}

impl Cm {
    /// A packet for QP1: a CM MAD from `d.src`.
    pub fn on_packet(&self, s: &Arc<Shared>, d: &Datagram<'_>, p: &RoceRepr<'_>) {
        if p.deth.map(|x| x.qkey) != Some(GSI_QKEY) {
            return s.count(&s.counters.rx_malformed);
        }
        let mad = match CmMad::parse(p.payload) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(src = %d.src, error = %e, "rxe CM: MAD dropped");
                return s.count(&s.counters.rx_malformed);
            }
        };
        s.count(&s.counters.cm_rcvd);
        match mad.message {
            CmMessage::Req(req) => self.on_req(s, d, mad.transaction_id, req),
            CmMessage::Rep(rep) => self.on_rep(s, d, mad.transaction_id, rep),
            CmMessage::Rtu(rtu) => self.on_rtu(rtu),
            CmMessage::Rej(rej) => self.on_rej(rej),
            CmMessage::Dreq(dreq) => self.on_dreq(s, d, mad.transaction_id, dreq),
            CmMessage::Drep(drep) => self.on_drep(drep),
            CmMessage::Mra(mra) => {
                // The peer needs more time: keep our retries going.
                let mut i = self.inner.lock();
                if let Some(c) = i.conns.get_mut(&mra.remote_comm_id) {
                    c.retries_left = MAD_RETRIES;
                }
            }
        }
    }

    fn on_req(&self, s: &Arc<Shared>, d: &Datagram<'_>, tid: u64, req: cm::Req) {
        let mut i = self.inner.lock();
        // A retry of a REQ we already know: answer again if we have answered.
        if let Some(c) = i
            .conns
            .values()
            .find(|c| c.remote_id == req.local_comm_id && c.peer == d.src)
        {
            if let (Phase::RepSent | Phase::Established, Some(m)) = (c.phase, c.retry) {
                let (src, dst) = (c.local, c.peer);
                drop(i);
                send_mad(s, src, dst, &m);
            }
            return;
        }
        let port = match cma::parse_service_id(req.service_id) {
            Some((cma::RDMA_PS_TCP, port)) => port,
            _ => {
                drop(i);
                let rej = rej_mad(
                    tid,
                    0,
                    req.local_comm_id,
                    cm::msg_ref::REQ,
                    rej_reason::INVALID_SERVICE_ID,
                    &[],
                );
                return send_mad(s, d.dst, d.src, &rej);
            }
        };
        let hdr = req.cma_header().ok();
        let sink = i.listeners.get(&port).and_then(|v| {
            v.iter()
                .find(|e| e.addr.is_none() || e.addr == Some(d.dst))
                .map(|e| e.sink.clone())
        });
        let Some(sink) = sink else {
            drop(i);
            let rej = rej_mad(
                tid,
                0,
                req.local_comm_id,
                cm::msg_ref::REQ,
                rej_reason::INVALID_SERVICE_ID,
                &[],
            );
            return send_mad(s, d.dst, d.src, &rej);
        };
        let local_id = i.new_id();
        i.conns.insert(
            local_id,
            Conn {
                phase: Phase::ReqRcvd,
                local_id,
                remote_id: req.local_comm_id,
                local: d.dst,
                peer: d.src,
                qp: Weak::new(),
                remote_qpn: req.local_qpn,
                req: Some(req),
                retry: None,
                retries_left: 0,
                gen: 0,
                rq_psn: 0,
                param: ConnParam::default(),
            },
        );
        drop(i);
        let peer_port = hdr.map(|h| h.src_port).unwrap_or(0);
        let ev = Event::new(EventKind::ConnectRequest)
            .with_conn(local_id as u64)
            .with_addrs(
                Some(SocketAddr::new(d.dst, port)),
                Some(SocketAddr::new(d.src, peer_port)),
            )
            .with_param(&ConnParam {
                private_data: req.private_data[cma::HEADER_LEN..].to_vec(),
                ird: req.responder_resources as u32,
                ord: req.initiator_depth as u32,
            });
        tracing::info!(conn = local_id, peer = %d.src, sport = d.sport, port, "rxe CM: connect request");
        sink.deliver(ev);
    }

    fn on_rep(&self, s: &Arc<Shared>, d: &Datagram<'_>, tid: u64, rep: cm::Rep) {
        let mut i = self.inner.lock();
        let Some(c) = i.conns.get_mut(&rep.remote_comm_id) else {
            return;
        };
        let rtu = mad_bytes(
            tid,
            CmMessage::Rtu(cm::Rtu {
                local_comm_id: c.local_id,
                remote_comm_id: rep.local_comm_id,
                private_data: [0; cm::RTU_PRIVATE_DATA_LEN],
            }),
        );
        if c.phase == Phase::Established && c.remote_id == rep.local_comm_id {
            // Our RTU was lost: send it again.
            let (src, dst) = (c.local, c.peer);
            drop(i);
            return send_mad(s, src, dst, &rtu);
        }
        if c.phase != Phase::ReqSent || c.peer != d.src {
            return;
        }
        let Some(qp) = c.qp.upgrade() else {
            i.conns.remove(&rep.remote_comm_id);
            return;
        };
        c.remote_id = rep.local_comm_id;
        c.remote_qpn = rep.local_qpn;
        c.phase = Phase::Established;
        c.retry = Some(rtu);
        c.gen += 1; // stop retrying the REQ
        let (src, dst, rq_psn, param) = (c.local, c.peer, c.rq_psn, c.param.clone());
        drop(i);
        let mtu = s.active_mtu();
        let ord = param.ord.min(rep.responder_resources as u32);
        let link = Link {
            peer: dst,
            local: src,
            remote_qpn: rep.local_qpn,
            rq_psn,
            sq_psn: rep.starting_psn,
            mtu,
            ird: param.ird,
            ord,
        };
        let up = bring_up(s, &qp, &link);
        if let Err(e) = up {
            tracing::warn!(qpn = qp.qpn, error = %e, "rxe CM: cannot bring the QP up");
            let rej = rej_mad(
                tid,
                rep.remote_comm_id,
                rep.local_comm_id,
                cm::msg_ref::REP,
                rej_reason::NO_RESOURCES,
                &[],
            );
            send_mad(s, src, dst, &rej);
            self.inner.lock().conns.remove(&rep.remote_comm_id);
            qp.sink
                .deliver(Event::new(EventKind::Unreachable).with_status(e.errno()));
            return;
        }
        send_mad(s, src, dst, &rtu);
        tracing::info!(qpn = qp.qpn, "rxe CM: established (active)");
        let ev = Event::new(EventKind::Established)
            .with_addrs(Some(SocketAddr::new(src, 0)), Some(SocketAddr::new(dst, 0)))
            .with_param(&ConnParam {
                private_data: rep.private_data.to_vec(),
                ird: param.ird,
                ord,
            });
        qp.sink.deliver(ev);
    }

    fn on_rtu(&self, rtu: cm::Rtu) {
        let mut i = self.inner.lock();
        let Some(c) = i.conns.get_mut(&rtu.remote_comm_id) else {
            return;
        };
        if c.phase != Phase::RepSent || c.remote_id != rtu.local_comm_id {
            return;
        }
        c.phase = Phase::Established;
        c.gen += 1; // stop retrying the REP
        let (qp, local, peer) = (c.qp.upgrade(), c.local, c.peer);
        let port = c.req.map(|r| r.service_id as u16).unwrap_or(0);
        drop(i);
        if let Some(qp) = qp {
            tracing::info!(qpn = qp.qpn, "rxe CM: established (passive)");
            qp.sink
                .deliver(Event::new(EventKind::Established).with_addrs(
                    Some(SocketAddr::new(local, port)),
                    Some(SocketAddr::new(peer, 0)),
                ));
        }
    }

    fn on_rej(&self, rej: cm::Rej) {
        let mut i = self.inner.lock();
        let Some(c) = i.conns.get(&rej.remote_comm_id) else {
            return;
        };
        if !matches!(c.phase, Phase::ReqSent | Phase::RepSent) {
            return;
        }
        let Some(c) = i.conns.remove(&rej.remote_comm_id) else {
            return;
        };
        drop(i);
        let Some(qp) = c.qp.upgrade() else { return };
        tracing::info!(qpn = qp.qpn, reason = rej.reason, "rxe CM: rejected");
        let kind = if rej.reason == rej_reason::CONSUMER_DEFINED {
            EventKind::Rejected
        } else {
            EventKind::Unreachable
        };
        {
            let mut st = qp.st.lock();
            qp.to_error(&mut st);
        }
        qp.sink.deliver(
            Event::new(kind)
                .with_status(libc::ECONNREFUSED)
                .with_param(&ConnParam {
                    private_data: rej.private_data.to_vec(),
                    ird: 0,
                    ord: 0,
                }),
        );
    }

    fn on_dreq(&self, s: &Arc<Shared>, d: &Datagram<'_>, tid: u64, dreq: cm::Dreq) {
        let drep = mad_bytes(
            tid,
            CmMessage::Drep(cm::Drep {
                local_comm_id: dreq.remote_comm_id,
                remote_comm_id: dreq.local_comm_id,
                private_data: [0; cm::DREP_PRIVATE_DATA_LEN],
            }),
        );
        let mut i = self.inner.lock();
        let c = i
            .conns
            .get(&dreq.remote_comm_id)
            .filter(|c| c.remote_id == dreq.local_comm_id)
            .map(|c| c.local_id)
            .and_then(|id| i.conns.remove(&id));
        drop(i);
        send_mad(s, d.dst, d.src, &drep);
        if let Some(qp) = c.and_then(|c| c.qp.upgrade()) {
            tracing::info!(qpn = qp.qpn, "rxe CM: disconnected by the peer");
            qp.cm_closed(EventKind::Disconnected);
        }
    }

    fn on_drep(&self, drep: cm::Drep) {
        let mut i = self.inner.lock();
        let c = match i.conns.get(&drep.remote_comm_id) {
            Some(c) if c.phase == Phase::DreqSent => i.conns.remove(&drep.remote_comm_id),
            _ => None,
        };
        drop(i);
        if let Some(qp) = c.and_then(|c| c.qp.upgrade()) {
            qp.cm_closed(EventKind::Disconnected);
        }
    }

    /// A retry timer of connection `id` fired.
    pub fn on_timer(&self, s: &Arc<Shared>, id: u32, gen: u64) {
        let mut i = self.inner.lock();
        let Some(c) = i.conns.get_mut(&id) else {
            return;
        };
        if c.gen != gen {
            return;
        }
        if c.phase == Phase::Draining {
            let busy = c.qp.upgrade().is_some_and(|q| q.send_busy());
            if busy && c.retries_left > 0 {
                c.retries_left -= 1;
                arm_after(s, c, DRAIN_POLL);
                return;
            }
            drop(i);
            return send_dreq(s, id);
        }
        let Some(mad) = c.retry else { return };
        if c.retries_left == 0 {
            let c = i.conns.remove(&id);
            drop(i);
            let Some(c) = c else { return };
            let qp = c.qp.upgrade();
            match (c.phase, qp) {
                (Phase::ReqSent, Some(qp)) => {
                    tracing::info!(qpn = qp.qpn, "rxe CM: no answer to REQ");
                    {
                        let mut st = qp.st.lock();
                        qp.to_error(&mut st);
                    }
                    qp.sink
                        .deliver(Event::new(EventKind::Unreachable).with_status(libc::ETIMEDOUT));
                }
                (Phase::DreqSent, Some(qp)) => qp.cm_closed(EventKind::Disconnected),
                (Phase::RepSent, Some(qp)) => qp.cm_closed(EventKind::ConnectionBroken),
                _ => {}
            }
            return;
        }
        c.retries_left -= 1;
        arm(s, c);
        let (src, dst) = (c.local, c.peer);
        drop(i);
        s.count(&s.counters.cm_retries);
        send_mad(s, src, dst, &mad);
    }
}
