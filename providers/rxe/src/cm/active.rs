//! The active side: REQ, then the REP brings the QP up and the RTU confirms; a REQ nobody
//! answers ends in `Unreachable` and a REJ (timeout) that lets the passive side forget it.

use super::table::Conn;
use super::{
    arm, bring_up, mad_bytes, mtu_code, send_mad, send_rej, Cm, Link, Phase, MAD_RETRIES,
    REQ_PDATA_MAX,
};
use crate::device::Shared;
use crate::net::{canonical, Datagram};
use crate::qp::RxeQp;
use crate::wire::cm::{self, rej_reason, CmMessage, CmPath};
use crate::wire::cma;
use rnicpi::*;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

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
    if i.conns.of_qp(qp).is_some() {
        return Err(VerbsError::BadState);
    }
    let local_id = i.new_id()?;
    let rq_psn = crate::random::psn()?;
    let src_port = 0xc000 | (crate::random::u32()? as u16 & 0x3fff);
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
        responder_resources: param.ird.min(s.attr.max_ird) as u8,
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
    let mad = mad_bytes(CmMessage::Req(req))?;
    let mut c = Conn::active(local_id, src, dst, qp, rq_psn, param, mad, MAD_RETRIES);
    arm(s, &mut c);
    i.conns.insert(c);
    drop(i);
    tracing::info!(qpn = qp.qpn, %peer, local_id, "rxe CM: REQ");
    send_mad(s, src, dst, &mad);
    Ok(())
}

/// Our REQ went unanswered through every retry: the attempt fails, and a REJ (timeout,
/// our CA GUID in the ARI, as Linux sends it) lets a passive side that did get the REQ
/// drop the request it holds for its consumer.
pub(super) fn gave_up(s: &Shared, c: &Conn, qp: Option<Arc<RxeQp>>) {
    let rej = mad_bytes(CmMessage::Rej(cm::Rej {
        local_comm_id: c.local_id,
        remote_comm_id: 0,
        message_rejected: cm::msg_ref::OTHER,
        rejected_info_length: 8,
        reason: rej_reason::TIMEOUT,
        ari: super::pad(&s.attr.node_guid.to_be_bytes()),
        private_data: [0; cm::REJ_PRIVATE_DATA_LEN],
    }));
    if let Ok(rej) = rej {
        send_mad(s, c.local, c.peer, &rej);
    }
    let Some(qp) = qp else { return };
    tracing::info!(qpn = qp.qpn, "rxe CM: no answer to REQ");
    {
        let mut st = qp.st.lock();
        qp.to_error(&mut st);
    }
    qp.sink
        .deliver(Event::new(EventKind::Unreachable).with_status(libc::ETIMEDOUT));
}

impl Cm {
    /// A REP to our REQ (or a repeated one, whose RTU was lost). True when it came from
    /// the peer of the connection it names.
    pub(super) fn on_rep(&self, s: &Arc<Shared>, d: &Datagram<'_>, tid: u64, rep: cm::Rep) -> bool {
        let id = rep.remote_comm_id;
        let mut i = self.inner.lock();
        let Some(c) = i.conns.get(id).filter(|c| c.peer == d.src) else {
            return false;
        };
        let rtu = crate::wire::cm::CmMad::new(
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
                let (src, dst) = (c.local, c.peer);
                drop(i);
                send_mad(s, src, dst, &rtu);
                return true;
            }
            Phase::ReqSent => {}
            _ => return c.remote_id() == rep.local_comm_id,
        }
        let qp = c.qp.upgrade();
        let (src, dst, rq_psn, param) = (c.local, c.peer, c.rq_psn, c.param.clone());
        let Some(qp) = qp else {
            i.conns.remove(id);
            return true;
        };
        if !i.conns.set_remote(id, rep.local_comm_id) {
            // The peer already names another of its connections with this ID.
            i.conns.remove(id);
            drop(i);
            tracing::warn!(qpn = qp.qpn, "rxe CM: REP with a communication ID in use");
            return fail(
                s,
                &qp,
                (src, dst),
                (id, rep.local_comm_id),
                rej_reason::STALE_CONN,
            );
        }
        if let Some(c) = i.conns.get_mut(id) {
            c.remote_qpn = rep.local_qpn;
            c.phase = Phase::Established;
            c.retry = Some(rtu);
            c.gen += 1; // stop retrying the REQ
        }
        drop(i);
        let ord = param.ord.min(rep.responder_resources as u32);
        let link = Link {
            peer: dst,
            local: src,
            remote_qpn: rep.local_qpn,
            rq_psn,
            sq_psn: rep.starting_psn,
            mtu: s.active_mtu(),
            ird: param.ird.min(s.attr.max_ird),
            ord,
        };
        if let Err(e) = bring_up(s, &qp, &link) {
            tracing::warn!(qpn = qp.qpn, error = %e, "rxe CM: cannot bring the QP up");
            self.inner.lock().conns.remove(id);
            return fail(
                s,
                &qp,
                (src, dst),
                (id, rep.local_comm_id),
                rej_reason::NO_RESOURCES,
            );
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
        true
    }
}

/// Refuse the peer's REP with `reason` and fail our connection attempt.
fn fail(s: &Shared, qp: &RxeQp, addrs: (IpAddr, IpAddr), ids: (u32, u32), reason: u16) -> bool {
    send_rej(s, addrs, ids, cm::msg_ref::REP, reason, &[]);
    {
        let mut st = qp.st.lock();
        qp.to_error(&mut st);
    }
    qp.sink
        .deliver(Event::new(EventKind::Unreachable).with_status(libc::ECONNREFUSED));
    true
}
