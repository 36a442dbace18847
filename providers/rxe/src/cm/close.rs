//! Closing a connection: both kinds end with a DREQ (IB has no reset), answered by a DREP.
//! An orderly close first lets the send queue drain (for at most 5 s), so work posted
//! before it completes and arrives, as with siw's FIN; an abortive one flushes at once.

use super::{arm, arm_after, mad_bytes, send_mad, Cm, Phase};
use crate::device::Shared;
use crate::net::Datagram;
use crate::qp::RxeQp;
use crate::wire::cm::{self, CmMad, CmMessage};
use rnicpi::*;
use std::sync::Arc;
use std::time::Duration;

/// How often an orderly disconnect looks at the send queue, and for how long at most.
const DRAIN_POLL: Duration = Duration::from_millis(1);
const DRAIN_MAX: u32 = 5000;

/// Close `qp`'s connection.
pub fn disconnect(s: &Arc<Shared>, qp: &Arc<RxeQp>, abortive: bool) -> Result<()> {
    let mut i = s.cm.inner.lock();
    let id = i.conns.of_qp(qp).ok_or(VerbsError::BadState)?;
    let Some(c) = i.conns.get_mut(id) else {
        return Err(VerbsError::BadState);
    };
    match c.phase {
        Phase::Established | Phase::RepSent => {}
        Phase::Draining if abortive => {}
        Phase::ReqSent => {
            // Not connected yet: just forget the attempt.
            i.conns.remove(id);
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
    drop(i);
    send_dreq(s, id);
    Ok(())
}

/// The drain timer of an orderly close fired: look again, or send the DREQ.
pub(super) fn drain_tick(s: &Arc<Shared>, id: u32) {
    let mut i = s.cm.inner.lock();
    let Some(c) = i.conns.get_mut(id) else {
        return;
    };
    let busy = c.qp.upgrade().is_some_and(|q| q.send_busy());
    if busy && c.retries_left > 0 {
        c.retries_left -= 1;
        arm_after(s, c, DRAIN_POLL);
        return;
    }
    drop(i);
    send_dreq(s, id);
}

/// Send the DREQ of connection `id` and move its QP to Error (flushing what is left).
fn send_dreq(s: &Arc<Shared>, id: u32) {
    let mut i = s.cm.inner.lock();
    let Some(c) = i.conns.get_mut(id) else {
        return;
    };
    let dreq = mad_bytes(CmMessage::Dreq(cm::Dreq {
        local_comm_id: c.local_id,
        remote_comm_id: c.remote_id(),
        remote_qpn: c.remote_qpn,
        private_data: [0; cm::DREQ_PRIVATE_DATA_LEN],
    }));
    c.phase = Phase::DreqSent;
    c.retry = dreq.as_ref().ok().copied();
    c.retries_left = 3;
    arm(s, c);
    let (src, dst, qp) = (c.local, c.peer, c.qp.upgrade());
    drop(i);
    if let Some(qp) = qp {
        let mut st = qp.st.lock();
        qp.to_error(&mut st);
    }
    // Without a transaction ID the DREQ is not sent; the retries give up and the
    // connection ends as if the peer had not answered.
    if let Ok(mad) = dreq {
        send_mad(s, src, dst, &mad);
    }
}

impl Cm {
    /// A DREQ: the peer closes. Answered with a DREP in any case (the connection may be
    /// gone already and the DREP lost); it closes a connection only when it comes from
    /// that connection's peer with both IDs and our QP number right.
    pub(super) fn on_dreq(
        &self,
        s: &Arc<Shared>,
        d: &Datagram<'_>,
        tid: u64,
        dreq: cm::Dreq,
    ) -> bool {
        let drep = CmMad::new(
            tid,
            CmMessage::Drep(cm::Drep {
                local_comm_id: dreq.remote_comm_id,
                remote_comm_id: dreq.local_comm_id,
                private_data: [0; cm::DREP_PRIVATE_DATA_LEN],
            }),
        )
        .to_bytes();
        let mut i = self.inner.lock();
        let ours = i.conns.get(dreq.remote_comm_id).is_some_and(|c| {
            c.peer == d.src
                && c.remote_id() == dreq.local_comm_id
                && c.qpn() == Some(dreq.remote_qpn)
        });
        let c = if ours {
            i.conns.remove(dreq.remote_comm_id)
        } else {
            None
        };
        drop(i);
        send_mad(s, d.dst, d.src, &drep);
        if let Some(qp) = c.and_then(|c| c.qp.upgrade()) {
            tracing::info!(qpn = qp.qpn, "rxe CM: disconnected by the peer");
            qp.cm_closed(EventKind::Disconnected);
        }
        ours
    }

    /// The DREP to our DREQ: the close is complete.
    pub(super) fn on_drep(&self, d: &Datagram<'_>, drep: cm::Drep) -> bool {
        let mut i = self.inner.lock();
        let ours = i
            .conns
            .get(drep.remote_comm_id)
            .is_some_and(|c| c.peer == d.src && c.remote_id() == drep.local_comm_id);
        let c = match i.conns.get(drep.remote_comm_id) {
            Some(c) if ours && c.phase == Phase::DreqSent => i.conns.remove(drep.remote_comm_id),
            _ => None,
        };
        drop(i);
        if let Some(qp) = c.and_then(|c| c.qp.upgrade()) {
            qp.cm_closed(EventKind::Disconnected);
        }
        ours
    }
}
