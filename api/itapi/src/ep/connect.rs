//! The connection model of an RC endpoint: active connect with private data, passive
//! accept of a request a listener delivered, graceful and abortive disconnect, and the
//! translation of the QP's events into connection messages and affiliated async events.

use super::{Endpoint, EpAction, EpInner, EpState};
use crate::event::{
    AffiliatedCause, AffiliatedEvent, ConnEventKind, ConnectionEvent, EpRef, Event, EventNumber,
    RejectReason,
};
use crate::listen::{self, CnEstId};
use crate::status::{Error, FromVerbs, Result};
use rnicpi::{ConnParam, EventKind};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Endpoint {
    /// Connect to a listener at `peer` (address and port — the connection qualifier),
    /// offering `private_data`. The outcome arrives on the endpoint's connection SEVD:
    /// `Established` (with the accept's private data), `PeerReject` (with the reject's),
    /// or `NonPeerReject`.
    pub fn connect(&self, peer: SocketAddr, private_data: &[u8]) -> Result<()> {
        let ia = self.0.ia();
        ia.check_alive()?;
        if private_data.len() > ia.private_data_limits().0 {
            return Err(Error::InvalidPdataLength);
        }
        if self.0.ud {
            // A resolution of the peer's UD service; the endpoint stays as it is, and
            // may resolve others meanwhile.
            tracing::info!(ep = self.id(), %peer, "resolving a UD service");
            let param = self.0.conn_param(private_data);
            return self.0.qp.connect(peer, &param).it(Error::InvalidAddress);
        }
        self.0.begin(EpState::Active1ConnectionPending)?;
        self.0.conn.lock().peer = Some(peer);
        let param = self.0.conn_param(private_data);
        tracing::info!(ep = self.id(), %peer, "connecting");
        self.0
            .qp
            .connect(peer, &param)
            .it(Error::InvalidAddress)
            .inspect_err(|_| {
                self.0.set_state(EpState::Unconnected);
            })
    }

    /// Accept the connection request `cn_est_id` on this (unconnected) endpoint,
    /// answering with `private_data`. `Established` follows on the connection SEVD.
    pub fn accept(&self, cn_est_id: CnEstId, private_data: &[u8]) -> Result<()> {
        let ia = self.0.ia();
        ia.check_alive()?;
        if private_data.len() > ia.private_data_limits().1 {
            return Err(Error::InvalidPdataLength);
        }
        let pending = listen::take_for(cn_est_id, self.0.ud)?;
        if self.0.ud {
            return self.0.accept_ud(cn_est_id, pending, private_data);
        }
        self.0.begin(EpState::PassiveConnectionPending)?;
        self.0.conn.lock().peer = pending.peer;
        let param = self.0.conn_param(private_data);
        tracing::info!(ep = self.id(), cn_est_id = cn_est_id.0, "accepting");
        pending
            .listener
            .accept(pending.conn_id, &self.0.qp, &param)
            .it(Error::InvalidCnEstId)
            .inspect_err(|_| {
                self.0.set_state(EpState::NonOperational);
            })
    }

    /// Graceful disconnect: sends already posted complete, then the connection closes;
    /// `Disconnect` arrives on both sides and receives still posted complete flushed.
    /// While send-queue requests are outstanding the close waits for them (the request
    /// SEVD keeps taking completions meanwhile), on every transport: siw would drain
    /// its send queue before its FIN anyway, but an InfiniBand DREQ moves the QP to
    /// Error at once and would flush them. A request that never completes (a peer that
    /// never posts a receive) holds the close back; [`abort`](Self::abort) does not
    /// wait. Disconnect private data is not supported by the transports
    /// (`PdataNotSupported` from the C interface when some is given).
    pub fn disconnect(&self) -> Result<()> {
        self.close(false)
    }

    /// Abortive disconnect: the connection ends at once and everything outstanding
    /// completes flushed. On iWARP the connection is reset; InfiniBand has no abortive
    /// close, so the peer sees an ordinary disconnect there.
    pub fn abort(&self) -> Result<()> {
        self.close(true)
    }

    fn close(&self, abortive: bool) -> Result<()> {
        match self.state() {
            EpState::Connected => {}
            EpState::NonOperational => return Ok(()),
            _ => return Err(Error::InvalidEpState),
        }
        tracing::info!(ep = self.id(), abortive, "disconnecting");
        self.0.local_close.store(true, Ordering::Release);
        let ep = &self.0;
        if !abortive && ep.sends.lock().awaited() > 0 {
            if !ep.close_pending.swap(true, Ordering::AcqRel) {
                ep.request_evd.0.closing(1);
            }
            // Completions already in the ring may drain the queue now; if the last one
            // was taken before the mark was set, nobody else will close: do it here.
            ep.request_evd.0.on_completions();
            if ep.sends.lock().awaited() > 0 || !ep.close_pending.swap(false, Ordering::AcqRel) {
                return Ok(());
            }
            ep.request_evd.0.closing(-1);
        }
        ep.disconnect_now(abortive)
    }
}

impl EpInner {
    /// Answer a UD resolution with this endpoint's QP; the requester's QP is not known
    /// (the SIDR_REQ does not say), so the passive `Established` names only its address.
    fn accept_ud(
        self: &Arc<Self>,
        cn_est_id: CnEstId,
        pending: listen::Taken,
        private_data: &[u8],
    ) -> Result<()> {
        tracing::info!(
            ep = self.common.id,
            cn_est_id = cn_est_id.0,
            "accepting a UD resolution"
        );
        let param = self.conn_param(private_data);
        pending
            .listener
            .accept(pending.conn_id, &self.qp, &param)
            .it(Error::InvalidCnEstId)?;
        let mut ev = rnicpi::Event::new(EventKind::Established).with_ud(rnicpi::UdPeer {
            qpn: 0,
            qkey: super::RDMA_UDP_QKEY,
        });
        ev.peer = pending.peer;
        self.post_ud_resolution(&ev, true);
        Ok(())
    }

    /// A UD endpoint's resolution ended: `Established` with an address handle to the
    /// peer (`passive`: this side accepted it), or the refusal. The endpoint's state
    /// never changes.
    fn post_ud_resolution(self: &Arc<Self>, ev: &rnicpi::Event, passive: bool) {
        let (kind, ud) = match (ev.kind, ev.ud, ev.peer) {
            (EventKind::Established, Some(u), Some(peer)) => {
                let attr = rnicpi::AhAttr {
                    dgid: rnicpi::ip_to_gid(peer.ip()),
                    ..Default::default()
                };
                match self.ia().0.ctx.create_ah(&self.pz.0.pd, &attr) {
                    Ok(ah) => {
                        let remote = crate::event::UdRemote {
                            qpn: u.qpn,
                            qkey: u.qkey,
                            ah,
                            peer: Some(peer),
                            passive,
                        };
                        (ConnEventKind::Established, Some(remote))
                    }
                    Err(e) => {
                        tracing::warn!(ep = self.common.id, error = %e, "no address handle");
                        (ConnEventKind::NonPeerReject, None)
                    }
                }
            }
            (EventKind::Rejected, ..) => (ConnEventKind::PeerReject, None),
            _ => (ConnEventKind::NonPeerReject, None),
        };
        tracing::info!(ep = self.common.id, ?kind, peer = ?ev.peer, "UD resolution");
        let private_data = if passive {
            Vec::new()
        } else {
            ev.private_data.clone()
        };
        let event = Event::Connection(ConnectionEvent {
            kind,
            evd: self.connect_evd.0.obj_ref(),
            ep: EpRef::new(self.common.id, self),
            ird: 0,
            ord: 0,
            peer: ev.peer,
            private_data,
            reject_reason: reject_reason(kind, ev.status),
            ud,
        });
        self.connect_evd.0.push(event, true);
    }

    /// Move from Unconnected to `to` (`InvalidEpState` from any other state).
    fn begin(&self, to: EpState) -> Result<()> {
        let mut c = self.conn.lock();
        if c.state != EpState::Unconnected {
            return Err(Error::InvalidEpState);
        }
        c.state = to;
        c.active = to == EpState::Active1ConnectionPending;
        Ok(())
    }

    fn conn_param(&self, private_data: &[u8]) -> ConnParam {
        let a = self.attrs.lock();
        ConnParam {
            private_data: private_data.to_vec(),
            ird: a.rdma_read_ird,
            ord: a.rdma_read_ord,
        }
    }

    /// Ask the provider to close the connection (`BadState`: it ended on its own
    /// meanwhile, which is no error).
    fn disconnect_now(&self, abortive: bool) -> Result<()> {
        match self.qp.disconnect(abortive) {
            Err(rnicpi::VerbsError::BadState) => Ok(()),
            r => r.it(Error::InvalidEpState),
        }
    }

    /// What a completion asked for, now that no SEVD is locked.
    pub(crate) fn run(self: &Arc<Self>, action: EpAction) {
        match action {
            EpAction::Break => self.break_connection("a work request failed"),
            EpAction::Disconnect => {
                self.request_evd.0.closing(-1);
                tracing::debug!(ep = self.common.id, "send queue drained: disconnecting");
                if let Err(e) = self.disconnect_now(false) {
                    tracing::warn!(ep = self.common.id, error = ?e, "deferred disconnect failed");
                }
            }
        }
    }

    /// The connection is unusable (a failed request, a lost completion, an endpoint
    /// error): end it so both sides know — the provider's abortive close (an iWARP
    /// reset; on InfiniBand a DREQ, without which the peer's CM would never learn that
    /// this QP is in Error) — and report `Broken` here. An endpoint that is not
    /// connected just goes to Error.
    pub(crate) fn break_connection(self: &Arc<Self>, why: &str) {
        let was = self.set_state(EpState::NonOperational);
        if was != EpState::Connected {
            return self.to_error();
        }
        tracing::warn!(ep = self.common.id, why, "connection broken");
        if self.disconnect_now(true).is_err() {
            self.to_error();
        }
        self.post_connection(
            ConnEventKind::Broken,
            &rnicpi::Event::new(EventKind::ConnectionBroken),
        );
    }

    fn on_qp_event(self: &Arc<Self>, ev: rnicpi::Event) {
        let conn = |kind| self.post_connection(kind, &ev);
        if self.ud
            && matches!(
                ev.kind,
                EventKind::Established | EventKind::Rejected | EventKind::Unreachable
            )
        {
            return self.post_ud_resolution(&ev, false);
        }
        match ev.kind {
            EventKind::Established => {
                let mut c = self.conn.lock();
                c.state = EpState::Connected;
                // The address connected to (active) or the request came from (passive)
                // names the peer with its port; the event may not (rxe gives port 0).
                c.peer = c.peer.or(ev.peer);
                drop(c);
                conn(ConnEventKind::Established)
            }
            EventKind::Rejected if ev.status == libc::EPROTO => conn(ConnEventKind::NonPeerReject),
            EventKind::Rejected => conn(ConnEventKind::PeerReject),
            EventKind::Unreachable => conn(ConnEventKind::NonPeerReject),
            EventKind::Disconnected => conn(self.close_kind()),
            EventKind::ConnectionBroken | EventKind::AccessLayerDead => conn(ConnEventKind::Broken),
            EventKind::QpFatal => self.post_affiliated(EventNumber::AsyncAffEpFailure),
            EventKind::QpAccessError => {
                self.post_affiliated(EventNumber::AsyncAffEpLocalAccessViolation)
            }
            EventKind::QpRequestError => {
                self.post_affiliated(EventNumber::AsyncAffEpLocalTransportError)
            }
            _ => tracing::debug!(ep = self.common.id, kind = ?ev.kind, "QP event ignored"),
        }
    }

    /// Move the QP to Error: outstanding and later work completes flushed, a connection
    /// is closed.
    pub(crate) fn to_error(&self) {
        self.set_state(EpState::NonOperational);
        let to_error = rnicpi::QpAttr {
            state: rnicpi::QpState::Error,
            ..Default::default()
        };
        if let Err(e) = self.qp.modify(&to_error, rnicpi::QpAttrMask::STATE) {
            tracing::warn!(ep = self.common.id, error = %e, "QP to Error failed");
        }
    }

    /// How to report the peer's close (a TCP FIN). A close this side did not ask for
    /// that flushed send-queue work is `Broken`: the transport cannot tell a peer's
    /// graceful close from a peer that died, and a graceful close presumes the traffic
    /// has completed. Completions already in the ring are taken first so they count.
    fn close_kind(&self) -> ConnEventKind {
        if self.local_close.load(Ordering::Acquire) {
            return ConnEventKind::Disconnect;
        }
        self.request_evd.0.on_completions();
        if self.lost_sends.load(Ordering::Relaxed) > 0 {
            ConnEventKind::Broken
        } else {
            ConnEventKind::Disconnect
        }
    }

    fn post_connection(self: &Arc<Self>, kind: ConnEventKind, ev: &rnicpi::Event) {
        if kind != ConnEventKind::Established {
            self.set_state(EpState::NonOperational);
            if self.ended.swap(true, Ordering::AcqRel) {
                tracing::debug!(
                    ep = self.common.id,
                    ?kind,
                    "connection end already reported"
                );
                return;
            }
        }
        if matches!(
            kind,
            ConnEventKind::PeerReject | ConnEventKind::NonPeerReject
        ) {
            // Never connected: work posted from now on must flush.
            self.to_error();
        }
        tracing::info!(
            ep = self.common.id,
            ?kind,
            status = ev.status,
            "connection event"
        );
        // The passive side's Established carries the request's data, which the consumer
        // already had in the request event; the standard reports none.
        let passive_established = kind == ConnEventKind::Established && !self.conn.lock().active;
        let private_data = match kind {
            ConnEventKind::Established | ConnEventKind::PeerReject if !passive_established => {
                ev.private_data.clone()
            }
            _ => Vec::new(),
        };
        let event = Event::Connection(ConnectionEvent {
            kind,
            evd: self.connect_evd.0.obj_ref(),
            ep: EpRef::new(self.common.id, self),
            ird: ev.ird,
            ord: ev.ord,
            peer: self.conn.lock().peer.or(ev.peer),
            private_data,
            reject_reason: reject_reason(kind, ev.status),
            ud: None,
        });
        self.connect_evd.0.push(event, true);
    }

    /// An endpoint error: the affiliated async event, and the connection ends.
    fn post_affiliated(self: &Arc<Self>, number: EventNumber) {
        tracing::warn!(ep = self.common.id, ?number, "endpoint failure");
        let cause = AffiliatedCause::Ep(EpRef::new(self.common.id, self));
        self.ia()
            .post_affiliated(|evd| Event::Affiliated(AffiliatedEvent { number, evd, cause }));
        self.break_connection("endpoint error");
    }
}

fn reject_reason(kind: ConnEventKind, status: i32) -> RejectReason {
    if kind != ConnEventKind::NonPeerReject {
        return RejectReason::Other;
    }
    match status {
        libc::ETIMEDOUT => RejectReason::Timeout,
        libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL => RejectReason::BadPath,
        libc::EPROTO => RejectReason::BadConnParms,
        _ => RejectReason::Other,
    }
}

/// Route the QP's events to the endpoint.
pub(super) fn listen(ep: &Arc<EpInner>) {
    ep.ia().route_events(ep.qp.handle, ep, EpInner::on_qp_event);
}
