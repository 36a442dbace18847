//! The passive side: listeners, connection requests and their bounds, accept (REP, then
//! the RTU establishes) and reject.
//!
//! A connection request belongs to the listener it was delivered to: only that listener
//! may accept or reject it (another listener — another tenant — naming its ID gets
//! `NoSuchResource`, as for an ID that does not exist). Requests waiting for their
//! consumer are bounded: a listener holds at most its backlog, the device at most
//! [`MAX_PENDING`]; a request beyond either bound pushes out the oldest one waiting
//! (REJ, no resources), so a flood of spoofed REQs costs the flooded listener only its
//! backlog and a genuine client that comes after still gets in. A request expires after
//! the time its sender said it would wait for our answer (REJ, consumer-defined, what
//! Linux sends for a request nobody answered). A request reaches the consumer only if its
//! event queue has room for it under the share requests may take
//! ([`EventSink::offer_request`]); otherwise it is refused at once (REJ, no resources), so
//! requests never push the consumer's other events out.

use super::table::{Conn, Scope};
use super::{
    arm, pad, sockaddr, Action, Count, Link, ListenEntry, Machine, Mad, Phase, QpRef, Sink,
    MAD_RETRIES, MAD_RETRY,
};
use crate::timer::Target;
use crate::wire::cm::{self, msg_ref, rej_reason, CmMessage};
use crate::wire::cma;
use rnicpi::*;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connection requests the device holds for consumers at most, over all listeners.
pub const MAX_PENDING: usize = 4096;
/// The least and the most time a request waits for its consumer.
pub(super) const REQUEST_TTL_MIN: Duration = Duration::from_secs(2);
const REQUEST_TTL_MAX: Duration = Duration::from_secs(60);
/// How often expired requests are looked for while any wait, and how many one look
/// refuses at most (the rest wait for the next look, [`SWEEP_AGAIN`] later).
const SWEEP_EVERY: Duration = Duration::from_secs(1);
const SWEEP_BUDGET: usize = 256;
const SWEEP_AGAIN: Duration = Duration::from_millis(10);

/// How long a request waits for its consumer: as long as its sender said it would wait
/// for our answer (its CM response timeout, 4.096 µs × 2^t, times its retries + 1), within
/// [`REQUEST_TTL_MIN`, `REQUEST_TTL_MAX`].
fn request_ttl(req: &cm::Req) -> Duration {
    let per_try = Duration::from_nanos(4096u64 << req.remote_cm_response_timeout.min(31));
    (per_try * (req.max_cm_retries as u32 + 1)).clamp(REQUEST_TTL_MIN, REQUEST_TTL_MAX)
}

/// Why a connection request could not be offered to a consumer.
pub(super) enum Unoffered {
    /// Nobody listens on its port at that address.
    NoListener,
    /// No communication ID could be drawn.
    NoResources,
}

/// An accept the machine has checked: the QP comes up over `link`, then
/// [`Machine::accepted`] sends `rep`.
pub(crate) struct Accept {
    id: u32,
    qp: QpRef,
    pub link: Link,
    rep: Box<Mad>,
}

impl Machine {
    /// Listen on `port` (0: pick a free one) of `ip` (`None`: every address); the
    /// listener's ID and its port.
    pub fn listen(
        &mut self,
        ip: Option<IpAddr>,
        port: u16,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<(u64, u16)> {
        let port = if port == 0 {
            loop {
                let p = 0x8000 | (self.rng.u32()? as u16 & 0x3fff);
                if !self.listeners.contains_key(&p) {
                    break p;
                }
            }
        } else {
            port
        };
        let entries = self.listeners.entry(port).or_default();
        if entries
            .iter()
            .any(|e| e.addr.is_none() || ip.is_none() || e.addr == ip)
        {
            return Err(VerbsError::AddrInUse);
        }
        let id = self.next_listener;
        self.next_listener += 1;
        let backlog = (backlog as usize).clamp(1, MAX_PENDING);
        entries.push(ListenEntry {
            addr: ip,
            sink,
            id,
            backlog,
        });
        tracing::info!(port, ?ip, backlog, "rxe CM: listening");
        Ok((id, port))
    }

    /// The request `conn_id` if it was delivered to `listener` and still waits.
    pub(super) fn request(&self, listener: u64, conn_id: u64) -> Result<u32> {
        let id = u32::try_from(conn_id).map_err(|_| VerbsError::NoSuchResource)?;
        match self.conns.get(id) {
            Some(c) if c.listener() == Some(listener) => match c.phase {
                Phase::ReqRcvd => Ok(id),
                _ => Err(VerbsError::BadState),
            },
            // Another listener's request, maybe another tenant's: it names nothing here.
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    /// Check `listener`'s consumer accepting request `conn_id` onto `qp`. Nothing changes
    /// until [`Machine::accepted`]: the driver brings the QP up in between, and if it
    /// does not come up, the request still waits.
    pub fn accept(
        &mut self,
        listener: u64,
        conn_id: u64,
        qp: QpRef,
        param: &ConnParam,
        mtu_from: impl Fn(IpAddr) -> u32,
    ) -> Result<Accept> {
        if param.private_data.len() > cm::REP_PRIVATE_DATA_LEN {
            return Err(VerbsError::Invalid);
        }
        let id = self.request(listener, conn_id)?;
        if self.conns.of_qp(qp).is_some() {
            return Err(VerbsError::BadState);
        }
        let rq_psn = self.rng.psn()?;
        let c = self.conns.get(id).ok_or(VerbsError::NoSuchResource)?;
        // A SIDR request wants a UD QP (`accept_ud`), a REQ a QP of the service it names.
        let req = c.req.ok_or(VerbsError::Invalid)?;
        if req.transport_service_type != qp.transport_type() || qp.service == QpType::Ud {
            return Err(VerbsError::Invalid);
        }
        let mtu = cm::mtu_bytes(req.path_mtu)
            .map(|m| m as u32)
            .unwrap_or(1024)
            .min(mtu_from(c.local));
        let ird = param.ird.min(self.config.max_ird);
        let link = Link {
            peer: c.peer,
            local: c.local,
            remote_qpn: req.local_qpn,
            rq_psn,
            sq_psn: req.starting_psn,
            mtu,
            ird,
            ord: param.ord.min(req.responder_resources as u32),
        };
        let rep = cm::Rep {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id(),
            local_qkey: 0,
            local_qpn: qp.qpn,
            local_eecn: 0,
            starting_psn: rq_psn,
            responder_resources: ird as u8,
            initiator_depth: param.ord.clamp(1, self.config.max_ord) as u8,
            target_ack_delay: 0,
            failover_accepted: 0,
            end_to_end_flow_control: false,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: self.config.node_guid,
            private_data: pad(&param.private_data),
        };
        let rep = self.mad(CmMessage::Rep(rep))?;
        Ok(Accept { id, qp, link, rep })
    }

    /// The QP of a checked accept is up: send the REP, retried until the RTU comes.
    pub fn accepted(&mut self, a: Accept, now: Instant) -> Result<Vec<Action>> {
        self.conns.accepted(a.id, a.qp);
        let c = self.conns.get_mut(a.id).ok_or(VerbsError::NoSuchResource)?;
        c.phase = Phase::RepSent;
        c.remote_qpn = a.link.remote_qpn;
        c.rq_psn = a.link.rq_psn;
        c.retry = Some(*a.rep);
        c.retries_left = MAD_RETRIES;
        let timer = arm(c, MAD_RETRY, now);
        tracing::info!(qpn = a.qp.qpn, conn = a.id, "rxe CM: REP");
        let send = Action::Send {
            src: c.local,
            dst: c.peer,
            mad: a.rep,
        };
        Ok(vec![timer, send])
    }

    /// `listener`'s consumer rejects request `conn_id` (REJ, consumer-defined, with
    /// `private_data`).
    pub fn reject(
        &mut self,
        listener: u64,
        conn_id: u64,
        private_data: &[u8],
    ) -> Result<Vec<Action>> {
        let id = self.request(listener, conn_id)?;
        let c = self.conns.remove(id).ok_or(VerbsError::NoSuchResource)?;
        let mut out = Vec::new();
        if c.sidr.is_some() {
            self.sidr_rep(&mut out, &c, cm::sidr_status::REJECT, (0, 0), private_data);
            return Ok(out);
        }
        let ids = (c.local_id, c.remote_id());
        let mad = self.rej(
            ids,
            msg_ref::REQ,
            rej_reason::CONSUMER_DEFINED,
            private_data,
        )?;
        out.push(Action::Send {
            src: c.local,
            dst: c.peer,
            mad,
        });
        Ok(out)
    }

    /// Refuse waiting request `c` (out of time, pushed out, its listener gone): a REJ
    /// with `reason`, or a SIDR_REP that rejects it.
    fn refuse_request(&mut self, out: &mut Vec<Action>, c: &Conn, reason: u16) {
        if c.sidr.is_some() {
            return self.sidr_rep(out, c, cm::sidr_status::REJECT, (0, 0), &[]);
        }
        let ids = (c.local_id, c.remote_id());
        self.send_rej(out, (c.local, c.peer), ids, msg_ref::REQ, reason);
    }

    /// `listener` closes: the requests nobody will answer now are refused.
    pub fn close_listener(&mut self, listener: u64) -> Vec<Action> {
        for entries in self.listeners.values_mut() {
            entries.retain(|e| e.id != listener);
        }
        self.listeners.retain(|_, v| !v.is_empty());
        let refused: Vec<Conn> = self
            .conns
            .pending_ids_of(listener)
            .into_iter()
            .filter_map(|id| self.conns.remove(id))
            .collect();
        let mut out = Vec::new();
        for c in refused {
            self.refuse_request(&mut out, &c, rej_reason::CONSUMER_DEFINED);
        }
        out
    }

    /// Refuse a REQ from `src` to `dst` we keep no state for.
    fn refuse(&mut self, out: &mut Vec<Action>, src: IpAddr, dst: IpAddr, req: &cm::Req, why: u16) {
        let ids = (0, req.local_comm_id);
        self.send_rej(out, (dst, src), ids, msg_ref::REQ, why);
    }

    pub(super) fn on_req(
        &mut self,
        out: &mut Vec<Action>,
        src: IpAddr,
        dst: IpAddr,
        req: cm::Req,
        now: Instant,
    ) {
        // A retry of a REQ we already know: answer again if we have answered.
        if let Some(id) = self.conns.by_remote(src, req.local_comm_id) {
            return self.answer_again(out, id, &[Phase::RepSent, Phase::Established]);
        }
        let port = match cma::parse_service_id(req.service_id) {
            Some((cma::RDMA_PS_TCP, port)) => port,
            _ => return self.refuse(out, src, dst, &req, rej_reason::INVALID_SERVICE_ID),
        };
        let peer_port = req.cma_header().map(|h| h.src_port).unwrap_or(0);
        let event = Event::new(EventKind::ConnectRequest)
            .with_addrs(sockaddr(dst, port), sockaddr(src, peer_port))
            .with_param(&ConnParam {
                private_data: req.private_data[cma::HEADER_LEN..].to_vec(),
                ird: req.responder_resources as u32,
                ord: req.initiator_depth as u32,
            });
        let request = |id, listener, expires| Conn::request(id, (dst, src), req, listener, expires);
        match self.offer(out, (dst, port), request_ttl(&req), now, request, event) {
            Ok(()) => {}
            Err(Unoffered::NoListener) => {
                self.refuse(out, src, dst, &req, rej_reason::INVALID_SERVICE_ID)
            }
            Err(Unoffered::NoResources) => {
                out.push(Action::Count(Count::ReqRefused));
                self.refuse(out, src, dst, &req, rej_reason::NO_RESOURCES)
            }
        }
    }

    /// Offer a connection request for `port` at our `dst` to the listener there: a new
    /// ID, room among the waiting requests (the oldest pushed out when the listener's
    /// backlog or the device's bound is full), the request `make` builds (from the ID,
    /// the listener and when it expires, `ttl` from now) kept until its consumer
    /// answers, and `event` (its `conn_id` filled in) offered to the consumer.
    pub(super) fn offer(
        &mut self,
        out: &mut Vec<Action>,
        (dst, port): (IpAddr, u16),
        ttl: Duration,
        now: Instant,
        make: impl FnOnce(u32, u64, Instant) -> Conn,
        event: Event,
    ) -> Result<(), Unoffered> {
        let listener = self.listeners.get(&port).and_then(|v| {
            v.iter()
                .find(|e| e.addr.is_none() || e.addr == Some(dst))
                .map(|e| (e.id, e.backlog, e.sink.clone()))
        });
        let Some((listener, backlog, sink)) = listener else {
            return Err(Unoffered::NoListener);
        };
        let local_id = self.new_id().map_err(|_| Unoffered::NoResources)?;
        let crowded = if self.conns.pending_of(listener) >= backlog {
            Some(Scope::Listener(listener))
        } else if self.conns.pending() >= MAX_PENDING {
            Some(Scope::Device)
        } else {
            None
        };
        let evicted = crowded
            .and_then(|scope| self.conns.oldest_pending(scope))
            .and_then(|old| self.conns.remove(old));
        self.conns.insert(make(local_id, listener, now + ttl));
        if self.sweep.is_none() {
            out.push(self.arm_sweep(SWEEP_EVERY, now));
        }
        if let Some(old) = evicted {
            out.push(Action::Count(Count::ReqEvicted));
            tracing::debug!(conn = old.local_id, peer = %old.peer, "rxe CM: request pushed out");
            self.refuse_request(out, &old, rej_reason::NO_RESOURCES);
        }
        tracing::info!(conn = local_id, peer = ?event.peer, port, "rxe CM: connect request");
        out.push(Action::Offer {
            sink: Sink(sink),
            id: local_id,
            event: event.with_conn(local_id as u64),
        });
        Ok(())
    }

    /// A retry of the request of connection `id`: send the answer kept for it again if
    /// the connection is in one of `answered` (else it still waits: nothing yet).
    pub(super) fn answer_again(&self, out: &mut Vec<Action>, id: u32, answered: &[Phase]) {
        let kept = self.conns.get(id).filter(|c| answered.contains(&c.phase));
        if let Some((c, mad)) = kept.and_then(|c| Some((c, c.retry?))) {
            out.push(Action::Send {
                src: c.local,
                dst: c.peer,
                mad: Box::new(mad),
            });
        }
    }

    /// The consumer's event queue had no room for request `id`: refuse it.
    pub fn offer_refused(&mut self, id: u32) -> Vec<Action> {
        let mut out = vec![Action::Count(Count::ReqRefused)];
        if let Some(c) = self.conns.remove(id) {
            if c.sidr.is_some() {
                self.sidr_rep(&mut out, &c, cm::sidr_status::REJECT, (0, 0), &[]);
                return out;
            }
            let ids = (0, c.remote_id());
            let reason = rej_reason::NO_RESOURCES;
            self.send_rej(&mut out, (c.local, c.peer), ids, msg_ref::REQ, reason);
        }
        out
    }

    /// The RTU to our REP: the passive side is established. True when it came from the
    /// peer of the connection it names, with that peer's ID.
    pub(super) fn on_rtu(&mut self, out: &mut Vec<Action>, src: IpAddr, rtu: cm::Rtu) -> bool {
        let Some(c) = self
            .conns
            .get_mut(rtu.remote_comm_id)
            .filter(|c| c.peer == src && c.remote_id() == rtu.local_comm_id)
        else {
            return false;
        };
        if c.phase != Phase::RepSent {
            return true; // a repeated RTU
        }
        c.phase = Phase::Established;
        c.gen += 1; // stop retrying the REP
        let port = c.req.map(|r| r.service_id as u16).unwrap_or(0);
        if let Some(qp) = c.qp() {
            tracing::info!(qpn = qp.qpn, "rxe CM: established (passive)");
            let event = Event::new(EventKind::Established)
                .with_addrs(sockaddr(c.local, port), sockaddr(c.peer, 0));
            out.push(Action::Deliver { qp, event });
        }
        true
    }

    /// The expiry sweep of generation `gen` fired: refuse the requests whose consumer
    /// did not answer in time.
    pub fn on_sweep(&mut self, gen: u64, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        if self.sweep != Some(gen) {
            return out;
        }
        self.sweep = None;
        let expired: Vec<Conn> = self
            .conns
            .expired(now, SWEEP_BUDGET)
            .into_iter()
            .filter_map(|id| self.conns.remove(id))
            .collect();
        if self.conns.pending() > 0 {
            let again = if expired.len() == SWEEP_BUDGET {
                SWEEP_AGAIN
            } else {
                SWEEP_EVERY
            };
            out.push(self.arm_sweep(again, now));
        }
        for c in expired {
            out.push(Action::Count(Count::ReqExpired));
            tracing::debug!(conn = c.local_id, peer = %c.peer, "rxe CM: request expired unanswered");
            self.refuse_request(&mut out, &c, rej_reason::CONSUMER_DEFINED);
        }
        out
    }

    /// Arm the expiry sweep `after` from `now` (one sweep entry in the timer heap at a
    /// time).
    fn arm_sweep(&mut self, after: Duration, now: Instant) -> Action {
        self.sweep_gen += 1;
        self.sweep = Some(self.sweep_gen);
        Action::Timer {
            target: Target::CmSweep,
            gen: self.sweep_gen,
            at: now + after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ttl_follows_the_senders_patience_within_bounds() {
        let zeros = [0u8; crate::wire::mad::MAD_LEN - 24];
        let Ok(CmMessage::Req(mut r)) = CmMessage::parse(cm::ATTR_REQ, &zeros) else {
            panic!("an all-zero REQ parses");
        };
        assert_eq!(request_ttl(&r), REQUEST_TTL_MIN);
        // rdma_cm: 4.096 µs × 2^20 ≈ 4.3 s, 15 retries: 69 s, more than we keep it.
        (r.remote_cm_response_timeout, r.max_cm_retries) = (20, 15);
        assert_eq!(request_ttl(&r), REQUEST_TTL_MAX);
        (r.remote_cm_response_timeout, r.max_cm_retries) = (20, 1);
        assert_eq!(request_ttl(&r).as_millis(), 8589);
        (r.remote_cm_response_timeout, r.max_cm_retries) = (31, 15);
        assert_eq!(request_ttl(&r), REQUEST_TTL_MAX);
    }
}
