//! Closing a connection: both kinds end with a DREQ (IB has no reset), answered by a DREP.
//! An orderly close first lets the send queue drain (for at most 5 s), so work posted
//! before it completes and arrives, as with siw's FIN; an abortive one flushes at once.

use super::{arm, Action, Machine, Phase, QpRef, MAD_RETRY};
use crate::wire::cm::{self, CmMad, CmMessage};
use rnicpi::*;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// How often an orderly disconnect looks at the send queue, and for how long at most.
const DRAIN_POLL: Duration = Duration::from_millis(1);
const DRAIN_MAX: u32 = 5000;
/// Retries of an unanswered DREQ before the close completes anyway.
const DREQ_RETRIES: u32 = 3;

impl Machine {
    /// Close `qp`'s connection; `send_busy`: whether its send queue still has work (an
    /// orderly close waits for it).
    pub fn disconnect(
        &mut self,
        qp: QpRef,
        abortive: bool,
        send_busy: bool,
        now: Instant,
    ) -> Result<Vec<Action>> {
        let id = self.conns.of_qp(qp).ok_or(VerbsError::BadState)?;
        let c = self.conns.get_mut(id).ok_or(VerbsError::BadState)?;
        match c.phase {
            Phase::Established | Phase::RepSent => {}
            Phase::Draining if abortive => {}
            Phase::ReqSent => {
                // Not connected yet: just forget the attempt.
                self.conns.remove(id);
                return Ok(Vec::new());
            }
            _ => return Err(VerbsError::BadState),
        }
        if !abortive && send_busy {
            tracing::debug!(
                qpn = qp.qpn,
                "rxe CM: draining the send queue before the DREQ"
            );
            c.phase = Phase::Draining;
            c.retry = None;
            c.retries_left = DRAIN_MAX;
            return Ok(vec![arm(c, DRAIN_POLL, now)]);
        }
        let mut out = Vec::new();
        self.send_dreq(&mut out, id, now);
        Ok(out)
    }

    /// The drain timer of an orderly close fired: look again, or send the DREQ.
    pub(super) fn drain_tick(
        &mut self,
        out: &mut Vec<Action>,
        id: u32,
        send_busy: bool,
        now: Instant,
    ) {
        let Some(c) = self.conns.get_mut(id) else {
            return;
        };
        if send_busy && c.retries_left > 0 {
            c.retries_left -= 1;
            out.push(arm(c, DRAIN_POLL, now));
            return;
        }
        self.send_dreq(out, id, now);
    }

    /// Send the DREQ of connection `id` and move its QP to Error (flushing what is left).
    fn send_dreq(&mut self, out: &mut Vec<Action>, id: u32, now: Instant) {
        let Some(c) = self.conns.get(id) else {
            return;
        };
        let dreq = self.mad(CmMessage::Dreq(cm::Dreq {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id(),
            remote_qpn: c.remote_qpn,
            private_data: [0; cm::DREQ_PRIVATE_DATA_LEN],
        }));
        let Some(c) = self.conns.get_mut(id) else {
            return;
        };
        tracing::info!(conn = id, "rxe CM: DREQ");
        c.phase = Phase::DreqSent;
        c.retry = dreq.as_deref().ok().copied();
        c.retries_left = DREQ_RETRIES;
        out.push(arm(c, MAD_RETRY, now));
        if let Some(qp) = c.qp() {
            out.push(Action::QpError(qp));
        }
        // Without a transaction ID the DREQ is not sent; the retries give up and the
        // connection ends as if the peer had not answered.
        if let Ok(mad) = dreq {
            out.push(Action::Send {
                src: c.local,
                dst: c.peer,
                mad,
            });
        }
    }

    /// A DREQ from `src` to our `dst`: the peer closes. Answered with a DREP in any case
    /// (the connection may be gone already and the DREP lost); it closes a connection
    /// only when it comes from that connection's peer with both IDs and our QP number
    /// right.
    pub(super) fn on_dreq(
        &mut self,
        out: &mut Vec<Action>,
        src: IpAddr,
        dst: IpAddr,
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
        let ours = self.conns.get(dreq.remote_comm_id).is_some_and(|c| {
            c.peer == src
                && c.remote_id() == dreq.local_comm_id
                && c.qp().map(|q| q.qpn) == Some(dreq.remote_qpn)
        });
        let c = if ours {
            self.conns.remove(dreq.remote_comm_id)
        } else {
            None
        };
        out.push(Action::Send {
            src: dst,
            dst: src,
            mad: Box::new(drep),
        });
        if let Some(qp) = c.and_then(|c| c.qp()) {
            tracing::info!(qpn = qp.qpn, "rxe CM: disconnected by the peer");
            out.push(Action::Closed {
                qp,
                kind: EventKind::Disconnected,
            });
        }
        ours
    }

    /// The DREP to our DREQ: the close is complete.
    pub(super) fn on_drep(&mut self, out: &mut Vec<Action>, src: IpAddr, drep: cm::Drep) -> bool {
        let ours = self
            .conns
            .get(drep.remote_comm_id)
            .is_some_and(|c| c.peer == src && c.remote_id() == drep.local_comm_id);
        let c = match self.conns.get(drep.remote_comm_id) {
            Some(c) if ours && c.phase == Phase::DreqSent => self.conns.remove(drep.remote_comm_id),
            _ => None,
        };
        if let Some(qp) = c.and_then(|c| c.qp()) {
            tracing::info!(qpn = qp.qpn, "rxe CM: disconnected");
            out.push(Action::Closed {
                qp,
                kind: EventKind::Disconnected,
            });
        }
        ours
    }
}
