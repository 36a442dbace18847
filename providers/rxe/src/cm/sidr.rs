//! Service ID Resolution (IBTA 12.11): the UD "connection" of rdma_cm's UDP port space.
//! The active side sends a SIDR_REQ for a port (retried until answered); a listener's
//! consumer accepts it with one of its UD QPs, and the SIDR_REP tells the requester that
//! QP's number and Q_Key (`Established`, with [`Event::ud`]), or refuses it (`Rejected`,
//! or `Unreachable` when nobody listens). Neither QP changes state: a UD QP is ready
//! before it resolves anything, and one QP may resolve many services at once.
//!
//! A waiting SIDR request is a connection request like a REQ (phase `ReqRcvd`, the same
//! backlog, expiry and refusals), answered with a SIDR_REP where a REQ gets a REJ
//! ([`Machine::refuse_request`]).

use super::passive::Unoffered;
use super::table::Conn;
use super::{arm, pad, sockaddr, Action, Machine, Phase, QpRef, MAD_RETRY};
use crate::wire::cm::{self, sidr_status, CmMessage};
use crate::wire::cma;
use rnicpi::*;
use std::net::IpAddr;
use std::time::Instant;

/// How long a SIDR request waits for its consumer (a SIDR_REQ says nothing of its
/// sender's patience; rdma_cm retries one for about a minute).
const SIDR_REQUEST_TTL: std::time::Duration = std::time::Duration::from_secs(10);

/// How long an answered SIDR request is kept to answer its retries: as long as its
/// requester retries (rdma_cm: 15 retries about 4 s apart would outlive it; ours stop
/// after 15 × 500 ms).
const SIDR_ANSWER_KEPT: std::time::Duration = std::time::Duration::from_secs(10);

/// Consumer private data a SIDR_REQ carries after the rdma_cm header.
const SIDR_PDATA_MAX: usize = cm::SIDR_REQ_PRIVATE_DATA_LEN - cma::HEADER_LEN;

impl Machine {
    /// Resolve the UD QP that serves `r.peer`'s port, for UD QP `r.qp` (in RTS).
    pub fn resolve(&mut self, r: super::Connect, now: Instant) -> Result<Vec<Action>> {
        if r.param.private_data.len() > SIDR_PDATA_MAX {
            return Err(VerbsError::Invalid);
        }
        if r.state != QpState::Rts {
            return Err(VerbsError::BadState);
        }
        let (src, dst) = (r.src?, r.peer.ip());
        let request_id = self.new_id()?;
        let req = cm::SidrReq {
            request_id,
            pkey: crate::wire::bth::DEFAULT_PKEY,
            service_id: cma::service_id_udp(r.peer.port()),
            private_data: self.cma_private_data((src, dst), &r.param.private_data)?,
        };
        let mad = self.mad(CmMessage::SidrReq(req))?;
        let mut c = Conn::resolving(request_id, (src, dst), r.qp, r.peer.port(), *mad);
        let timer = arm(&mut c, MAD_RETRY, now);
        self.conns.insert(c);
        tracing::info!(qpn = r.qp.qpn, peer = %r.peer, request_id, "rxe CM: SIDR_REQ");
        Ok(vec![timer, Action::Send { src, dst, mad }])
    }

    /// A SIDR_REP: the answer to one of our resolutions. True when it answered one of
    /// its sender's.
    pub(super) fn on_sidr_rep(
        &mut self,
        out: &mut Vec<Action>,
        src: IpAddr,
        rep: cm::SidrRep,
    ) -> bool {
        let ours = self
            .conns
            .get(rep.request_id)
            .is_some_and(|c| c.phase == Phase::SidrSent && c.peer == src);
        if !ours {
            return false;
        }
        let Some(c) = self.conns.remove(rep.request_id) else {
            return false;
        };
        let Some(qp) = c.resolver else { return true };
        let addrs = (sockaddr(c.local, 0), sockaddr(c.peer, c.port));
        let event = match rep.status {
            sidr_status::SUCCESS => Event::new(EventKind::Established).with_ud(UdPeer {
                qpn: rep.qpn,
                qkey: rep.qkey,
            }),
            sidr_status::REJECT => Event::new(EventKind::Rejected).with_status(libc::ECONNREFUSED),
            _ => Event::new(EventKind::Unreachable).with_status(libc::ECONNREFUSED),
        };
        let event = Event {
            private_data: rep.private_data.to_vec(),
            ..event.with_addrs(addrs.0, addrs.1)
        };
        tracing::info!(
            qpn = qp.qpn,
            status = rep.status,
            peer_qpn = rep.qpn,
            "rxe CM: SIDR_REP"
        );
        out.push(Action::Deliver { qp, event });
        true
    }

    /// A resolution went unanswered through every retry: `Unreachable` (the QP stays as
    /// it is).
    pub(super) fn resolve_gave_up(&mut self, out: &mut Vec<Action>, c: &Conn) {
        if let Some(qp) = c.resolver {
            tracing::info!(qpn = qp.qpn, "rxe CM: no answer to SIDR_REQ");
            let event = Event::new(EventKind::Unreachable)
                .with_status(libc::ETIMEDOUT)
                .with_addrs(sockaddr(c.local, 0), sockaddr(c.peer, c.port));
            out.push(Action::Deliver { qp, event });
        }
    }

    /// `listener`'s consumer accepts SIDR request `conn_id` with UD QP `qp`, whose Q_Key
    /// is `qkey`: the SIDR_REP names them. The answer is kept a while: a retry of the
    /// SIDR_REQ that crossed it gets the same answer, not a second request.
    pub fn accept_ud(
        &mut self,
        listener: u64,
        conn_id: u64,
        (qp, qkey): (QpRef, u32),
        private_data: &[u8],
        now: Instant,
    ) -> Result<Vec<Action>> {
        if private_data.len() > cm::SIDR_REP_PRIVATE_DATA_LEN {
            return Err(VerbsError::Invalid);
        }
        let id = self.request(listener, conn_id)?;
        if self.conns.get(id).is_some_and(|c| c.sidr.is_none()) {
            return Err(VerbsError::Invalid); // a REQ wants an RC QP
        }
        let c = self.conns.remove(id).ok_or(VerbsError::NoSuchResource)?;
        tracing::info!(qpn = qp.qpn, conn = id, "rxe CM: SIDR_REP (accepted)");
        let mut out = Vec::new();
        self.sidr_rep(
            &mut out,
            &c,
            sidr_status::SUCCESS,
            (qp.qpn, qkey),
            private_data,
        );
        if let Some(Action::Send { mad, .. }) = out.first() {
            let mut kept = Conn::answered(c, **mad);
            out.push(arm(&mut kept, SIDR_ANSWER_KEPT, now));
            self.conns.insert(kept);
        }
        Ok(out)
    }

    /// Answer SIDR request `c` with `status` (and, accepted, the QP and Q_Key).
    pub(super) fn sidr_rep(
        &mut self,
        out: &mut Vec<Action>,
        c: &Conn,
        status: u8,
        (qpn, qkey): (u32, u32),
        private_data: &[u8],
    ) {
        let Some(req) = c.sidr else { return };
        let rep = cm::SidrRep {
            request_id: req.request_id,
            status,
            additional_info_length: 0,
            qpn,
            service_id: req.service_id,
            qkey,
            additional_info: [0; cm::SIDR_REP_INFO_LEN],
            private_data: pad(private_data),
        };
        // The reply carries the request's transaction ID, as the kernel's CM answers.
        let mad = Box::new(cm::CmMad::new(c.tid, CmMessage::SidrRep(rep)).to_bytes());
        out.push(Action::Send {
            src: c.local,
            dst: c.peer,
            mad,
        });
    }

    /// A SIDR_REQ from `src` to our `dst`: offered to the listener of its port, or
    /// answered at once (no such service, or no room).
    pub(super) fn on_sidr_req(
        &mut self,
        out: &mut Vec<Action>,
        (src, dst): (IpAddr, IpAddr),
        tid: u64,
        req: cm::SidrReq,
        now: Instant,
    ) {
        if let Some(id) = self.conns.by_remote(src, req.request_id) {
            // A retry of a request answered (the same answer again) or waiting.
            return self.answer_again(out, id, &[Phase::SidrAnswered]);
        }
        let request = |id, listener, expires| {
            Conn::sidr_request(id, (dst, src), (tid, req), listener, expires)
        };
        let answer = |m: &mut Machine, out: &mut Vec<Action>, status| {
            m.sidr_rep(out, &request(0, 0, now), status, (0, 0), &[]);
        };
        let port = match cma::parse_service_id(req.service_id) {
            Some((cma::RDMA_PS_UDP, port)) => port,
            _ => return answer(self, out, sidr_status::UNSUPPORTED),
        };
        let peer_port = req.cma_header().map(|h| h.src_port).unwrap_or(0);
        let event = Event {
            private_data: req.private_data[cma::HEADER_LEN..].to_vec(),
            ..Event::new(EventKind::ConnectRequest)
                .with_addrs(sockaddr(dst, port), sockaddr(src, peer_port))
                .with_ud(UdPeer::default())
        };
        match self.offer(out, (dst, port), SIDR_REQUEST_TTL, now, request, event) {
            Ok(()) => {}
            Err(Unoffered::NoListener) => answer(self, out, sidr_status::UNSUPPORTED),
            Err(Unoffered::NoResources) => {
                out.push(Action::Count(super::Count::ReqRefused));
                answer(self, out, sidr_status::REJECT)
            }
        }
    }
}
