//! The active side: REQ, then the REP brings the QP up and the RTU confirms; a REQ nobody
//! answers ends in `Unreachable` and a REJ (timeout) that lets the passive side forget it.

use super::table::Conn;
use super::{
    arm, mtu_code, pad, sockaddr, Action, BringUp, Link, Machine, Phase, QpRef, MAD_RETRY,
    REQ_PDATA_MAX,
};
use crate::wire::cm::{self, msg_ref, rej_reason, CmMad, CmMessage, CmPath};
use crate::wire::cma;
use rnicpi::*;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

/// A consumer's connect, with what the driver found out for it.
pub(crate) struct Connect {
    pub qp: QpRef,
    /// The QP's state now (only a QP in Reset or Init connects).
    pub state: QpState,
    /// The peer: its IP address (canonical) and rdma_cm TCP port.
    pub peer: SocketAddr,
    /// Our address towards the peer, or why there is none.
    pub src: Result<IpAddr>,
    pub param: ConnParam,
    /// The path MTU from `src` (what its link carries).
    pub mtu: u32,
}

impl Machine {
    /// Connect a QP: send a REQ, retried until answered.
    pub fn connect(&mut self, r: Connect, now: Instant) -> Result<Vec<Action>> {
        if r.param.private_data.len() > REQ_PDATA_MAX {
            return Err(VerbsError::Invalid);
        }
        if !matches!(r.state, QpState::Reset | QpState::Init) {
            return Err(VerbsError::BadState);
        }
        let dst = r.peer.ip();
        let src = r.src?;
        if self.conns.of_qp(r.qp).is_some() {
            return Err(VerbsError::BadState);
        }
        let local_id = self.new_id()?;
        let rq_psn = self.rng.psn()?;
        let pdata = self.cma_private_data((src, dst), &r.param.private_data)?;
        let config = self.config;
        let req = cm::Req {
            local_comm_id: local_id,
            service_id: cma::service_id_tcp(r.peer.port()),
            local_ca_guid: config.node_guid,
            local_qkey: 0,
            local_qpn: r.qp.qpn,
            responder_resources: r.param.ird.min(config.max_ird) as u8,
            local_eecn: 0,
            initiator_depth: r.param.ord.clamp(1, config.max_ord) as u8,
            remote_eecn: 0,
            remote_cm_response_timeout: 20,
            transport_service_type: r.qp.transport_type(),
            end_to_end_flow_control: false,
            starting_psn: rq_psn,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: crate::wire::bth::DEFAULT_PKEY,
            path_mtu: mtu_code(r.mtu),
            rdc_exists: false,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            extended_transport_type: 0,
            primary_path: CmPath {
                local_lid: 0xffff,
                remote_lid: 0xffff,
                local_gid: ip_to_gid(src),
                remote_gid: ip_to_gid(dst),
                hop_limit: 64,
                local_ack_timeout: 18,
                ..CmPath::default()
            },
            alternate_path: CmPath::default(),
            sap_supported: false,
            private_data: pdata,
        };
        let mad = self.mad(CmMessage::Req(req))?;
        let mut c = Conn::active(local_id, (src, dst), r.qp, rq_psn, r.param, r.mtu, *mad);
        let timer = arm(&mut c, MAD_RETRY, now);
        self.conns.insert(c);
        tracing::info!(qpn = r.qp.qpn, peer = %r.peer, local_id, "rxe CM: REQ");
        Ok(vec![timer, Action::Send { src, dst, mad }])
    }

    /// Our REQ went unanswered through every retry: the attempt fails, and a REJ (timeout,
    /// our CA GUID in the ARI, as Linux sends it) lets a passive side that did get the REQ
    /// drop the request it holds for its consumer.
    pub(super) fn gave_up(&mut self, out: &mut Vec<Action>, c: &Conn, qp: Option<QpRef>) {
        let rej = self.mad(CmMessage::Rej(cm::Rej {
            local_comm_id: c.local_id,
            remote_comm_id: 0,
            message_rejected: msg_ref::OTHER,
            rejected_info_length: 8,
            reason: rej_reason::TIMEOUT,
            ari: pad(&self.config.node_guid.to_be_bytes()),
            private_data: [0; cm::REJ_PRIVATE_DATA_LEN],
        }));
        if let Ok(mad) = rej {
            out.push(Action::Send {
                src: c.local,
                dst: c.peer,
                mad,
            });
        }
        let Some(qp) = qp else { return };
        tracing::info!(qpn = qp.qpn, "rxe CM: no answer to REQ");
        let event = Event::new(EventKind::Unreachable).with_status(libc::ETIMEDOUT);
        out.push(Action::Fail { qp, event });
    }

    /// A REP to our REQ (or a repeated one, whose RTU was lost). True when it came from
    /// the peer of the connection it names.
    pub(super) fn on_rep(
        &mut self,
        out: &mut Vec<Action>,
        src: IpAddr,
        tid: u64,
        rep: cm::Rep,
    ) -> bool {
        let id = rep.remote_comm_id;
        let Some(c) = self.conns.get(id).filter(|c| c.peer == src) else {
            return false;
        };
        let rtu = CmMad::new(
            tid,
            CmMessage::Rtu(cm::Rtu {
                local_comm_id: c.local_id,
                remote_comm_id: rep.local_comm_id,
                private_data: [0; cm::RTU_PRIVATE_DATA_LEN],
            }),
        )
        .to_bytes();
        match c.phase {
            Phase::Established if c.remote_id() == rep.local_comm_id => {
                // Our RTU was lost: send it again.
                out.push(Action::Send {
                    src: c.local,
                    dst: c.peer,
                    mad: Box::new(rtu),
                });
                return true;
            }
            Phase::ReqSent => {}
            _ => return c.remote_id() == rep.local_comm_id,
        }
        let (local, peer, rq_psn, mtu) = (c.local, c.peer, c.rq_psn, c.mtu);
        let param = c.param.clone();
        let Some(qp) = c.qp() else {
            self.conns.remove(id);
            return true;
        };
        if !self.conns.set_remote(id, rep.local_comm_id) {
            // The peer already names another of its connections with this ID.
            self.conns.remove(id);
            tracing::warn!(qpn = qp.qpn, "rxe CM: REP with a communication ID in use");
            let ids = (id, rep.local_comm_id);
            self.refuse_rep(out, qp, (local, peer), ids, rej_reason::STALE_CONN);
            return true;
        }
        if let Some(c) = self.conns.get_mut(id) {
            c.remote_qpn = rep.local_qpn;
            c.phase = Phase::Established;
            c.retry = Some(rtu);
            c.gen += 1; // stop retrying the REQ
        }
        let ord = param.ord.min(rep.responder_resources as u32);
        let link = Link {
            peer,
            local,
            remote_qpn: rep.local_qpn,
            rq_psn,
            sq_psn: rep.starting_psn,
            mtu,
            ird: param.ird.min(self.config.max_ird),
            ord,
        };
        out.push(Action::BringUp(BringUp {
            id,
            remote_id: rep.local_comm_id,
            qp,
            link,
        }));
        out.push(Action::Send {
            src: local,
            dst: peer,
            mad: Box::new(rtu),
        });
        tracing::info!(qpn = qp.qpn, "rxe CM: established (active)");
        let event = Event::new(EventKind::Established)
            .with_addrs(sockaddr(local, 0), sockaddr(peer, 0))
            .with_param(&ConnParam {
                private_data: rep.private_data.to_vec(),
                ird: param.ird,
                ord,
            });
        out.push(Action::Deliver { qp, event });
        true
    }

    /// The QP of an active connection did not come up on the peer's REP: the attempt
    /// fails, and the peer hears why.
    pub fn bring_up_failed(&mut self, b: &BringUp) -> Vec<Action> {
        tracing::warn!(qpn = b.qp.qpn, "rxe CM: cannot bring the QP up");
        self.conns.remove(b.id);
        let mut out = Vec::new();
        let addrs = (b.link.local, b.link.peer);
        let ids = (b.id, b.remote_id);
        self.refuse_rep(&mut out, b.qp, addrs, ids, rej_reason::NO_RESOURCES);
        out
    }

    /// Refuse the peer's REP with `reason` and fail our connection attempt.
    fn refuse_rep(
        &mut self,
        out: &mut Vec<Action>,
        qp: QpRef,
        addrs: (IpAddr, IpAddr),
        ids: (u32, u32),
        reason: u16,
    ) {
        self.send_rej(out, addrs, ids, msg_ref::REP, reason);
        let event = Event::new(EventKind::Unreachable).with_status(libc::ECONNREFUSED);
        out.push(Action::Fail { qp, event });
    }
}
