//! The responder: each FPDU from the peer checked (framing, CRC, DDP/RDMAP header, the
//! QP's and the registration's rights), then placed (RDMA Write, Read Response), matched
//! to a posted receive (Send), or queued for an answer (Read Request).

use super::batch::Batch;
use super::requester::{After, ResponseTx, Transmit, TxCursor, TX_BATCH};
use super::state::{next_offset, Conn, Env, RecvInProgress, State};
use super::*;
use crate::orq::Placement;
use crate::wire::{ddp, Header, Model, Opcode, ReadRequest};

impl State {
    /// The next batch of a Read Response from offset `off`, emitted into `out`: up to
    /// [`TX_BATCH`] bytes, or the rest (the response then frees its IRD slot: the peer
    /// may send its next Read Request the moment it has the last FPDUs). None when the
    /// response was given up: the QP failed meanwhile (so the Terminate queued behind it
    /// goes out without waiting for the rest), or its source failed a check (this
    /// queues a Terminate).
    pub(super) fn emit_read_response(
        &mut self,
        env: &Env,
        out: &mut Batch,
        mut r: ResponseTx,
    ) -> Option<Transmit> {
        let (rr, crc) = (r.rr, r.crc);
        let chunk = (r.mtu - Opcode::ReadResponse.header_len()) as u64;
        let total = rr.size as u64;
        loop {
            let off = r.off;
            let n = (total - off).min(chunk);
            let start = out.begin_fpdu(&Header {
                opcode: Opcode::ReadResponse,
                last: off + n == total,
                model: Model::Tagged {
                    stag: rr.sink_stag,
                    to: rr.sink_to.wrapping_add(off),
                },
            });
            let read = match &r.region {
                Some(src) => out
                    .payload_of(
                        src,
                        env.base.pd,
                        (rr.src_to + off, n as usize),
                        Access::REMOTE_READ,
                        crc,
                    )
                    .map_err(access_term),
                None => Ok(()),
            };
            let framed = read.and_then(|_| {
                out.finish_fpdu(start, crc).map_err(|_| TermCode {
                    layer: term::LAYER_RDMAP,
                    etype: term::RDMAP_REMOTE_OP,
                    ecode: term::RDMAP_CATASTROPHIC_LOCAL,
                })
            });
            if let Err(code) = framed {
                out.clear();
                self.responding = self.responding.saturating_sub(1);
                self.fail(env, code, None);
                return None;
            }
            env.counters.tx_fpdus.fetch_add(1, Ordering::Relaxed);
            r.off += n;
            if r.off >= total {
                self.responding = self.responding.saturating_sub(1);
                return Some(Transmit::Write(After::Nothing));
            }
            if out.len() >= TX_BATCH {
                if self.qp != QpState::Rts {
                    out.clear();
                    self.responding = self.responding.saturating_sub(1);
                    return None;
                }
                self.tx_cur = Some(TxCursor::Response(r));
                return Some(Transmit::Write(After::Nothing));
            }
        }
    }

    /// Process one whole FPDU from the peer: check its framing and CRC, then place or
    /// queue what it carries; on any violation queue a Terminate and go to Error.
    /// Returns whether the QP still takes FPDUs.
    pub(super) fn on_fpdu(&mut self, env: &Env, fpdu: &[u8]) -> bool {
        env.counters.rx_fpdus.fetch_add(1, Ordering::Relaxed);
        env.counters
            .rx_bytes
            .fetch_add(fpdu.len() as u64, Ordering::Relaxed);
        let u = match wire::check_fpdu(fpdu, self.crc) {
            Ok(u) => u,
            Err(e) => {
                if e == wire::Error::BadCrc {
                    env.counters.crc_errors.fetch_add(1, Ordering::Relaxed);
                }
                let ecode = if e == wire::Error::BadCrc {
                    term::LLP_CRC
                } else {
                    term::LLP_BAD_FPDU
                };
                self.fail(
                    env,
                    TermCode {
                        layer: term::LAYER_LLP,
                        etype: 0,
                        ecode,
                    },
                    None,
                );
                return false;
            }
        };
        if let Err(code) = self.on_ulpdu(env, u) {
            env.counters.bad_fpdus.fetch_add(1, Ordering::Relaxed);
            self.fail(env, code, Some(&u[..u.len().min(ddp::UNTAGGED_HEADER_LEN)]));
            return false;
        }
        if let Conn::Up {
            hold_until: hold @ Some(_),
        } = &mut self.conn
        {
            *hold = None;
            // The Initiator's first FPDU: ours may follow now.
            self.kick();
        }
        self.qp != QpState::Error
    }

    /// One ULPDU, under the QP's access flags.
    fn on_ulpdu(&mut self, env: &Env, u: &[u8]) -> Result<(), TermCode> {
        let access = self.attr.access;
        let (h, payload) = Header::parse_bytes(u).map_err(|e| match e {
            wire::Error::BadDdpVersion => TermCode {
                layer: term::LAYER_DDP,
                etype: term::DDP_CATASTROPHIC,
                ecode: term::DDP_INV_VERSION,
            },
            wire::Error::BadRdmapVersion => TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_INV_VERSION,
            },
            wire::Error::BadQueue(_) => TermCode {
                layer: term::LAYER_DDP,
                etype: term::DDP_UNTAGGED_BUF,
                ecode: term::DDP_UNTAGGED_INV_QN,
            },
            // The FPDU's length cannot hold the DDP header it announces.
            wire::Error::Truncated(_) => TermCode {
                layer: term::LAYER_LLP,
                etype: 0,
                ecode: term::LLP_BAD_FPDU,
            },
            _ => TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_UNEXPECTED_OP,
            },
        })?;
        match (h.opcode, h.model) {
            (Opcode::Write, Model::Tagged { stag, to }) => {
                require_qp_access(access, Access::REMOTE_WRITE)?;
                place_tagged(env, stag, to, payload, Access::REMOTE_WRITE)
            }
            (Opcode::ReadResponse, Model::Tagged { stag, to }) => {
                self.on_read_response(env, stag, to, h.last, payload)
            }
            (
                op,
                Model::Untagged {
                    inv_stag, msn, mo, ..
                },
            ) if op.is_send() => self.place_send(env, op, h.last, inv_stag, msn, mo, payload),
            (Opcode::ReadRequest, Model::Untagged { msn, mo, .. }) => {
                require_qp_access(access, Access::REMOTE_READ)?;
                self.on_read_request(env, h.last, msn, mo, payload)
            }
            (Opcode::Terminate, _) => {
                let code = term::Packet::new_checked(payload)
                    .and_then(|p| term::Repr::parse(&p))
                    .map(|t| t.code)
                    .ok();
                rnicpi::warn_limited!(qpn = self.qpn, ?code, "siw peer terminated the connection");
                env.counters
                    .terminates_received
                    .fetch_add(1, Ordering::Relaxed);
                self.enter_error(env);
                self.event(Event::new(EventKind::QpFatal).with_status(libc::ECONNABORTED));
                Ok(())
            }
            _ => Err(TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_UNEXPECTED_OP,
            }),
        }
    }

    /// A Read Response segment: accepted only as the next bytes of the oldest
    /// outstanding read (checked by the ORQ before anything is placed), placed into that
    /// read's sink, and the read completed with its last segment.
    fn on_read_response(
        &mut self,
        env: &Env,
        stag: u32,
        to: u64,
        last: bool,
        data: &[u8],
    ) -> Result<(), TermCode> {
        let p: Placement = self.orq.check(stag, to, data.len(), last)?;
        place_tagged(env, p.stag, p.to, data, Access::LOCAL_WRITE)?;
        if self.orq.advance(&p).is_none() || self.qp != QpState::Rts {
            return Ok(());
        }
        if let Some(f) = self
            .inflight
            .iter_mut()
            .find(|f| !f.done && f.wqe.opcode() == Some(WrOpcode::RdmaRead))
        {
            f.done = true;
        }
        self.complete_in_order(env);
        self.kick(); // an ORD slot is free
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn place_send(
        &mut self,
        env: &Env,
        op: Opcode,
        last: bool,
        inv_stag: u32,
        msn: u32,
        mo: u32,
        data: &[u8],
    ) -> Result<(), TermCode> {
        let untagged = |ecode| TermCode {
            layer: term::LAYER_DDP,
            etype: term::DDP_UNTAGGED_BUF,
            ecode,
        };
        if msn != self.rx_msn_send {
            return Err(untagged(term::DDP_UNTAGGED_INV_MSN));
        }
        if self.cur_recv.is_none() {
            if mo != 0 {
                return Err(untagged(term::DDP_UNTAGGED_INV_MO));
            }
            // A corrupt receive ring (counted by the base) is a missing buffer too: the
            // Terminate moves the QP to Error.
            let Some(w) = env.base.take_recv().ok().flatten() else {
                return Err(untagged(term::DDP_UNTAGGED_NO_BUF));
            };
            self.cur_recv = Some(RecvInProgress {
                total: w.total_len(),
                wqe: w,
                received: 0,
            });
        }
        let Some(rip) = self.cur_recv.as_mut() else {
            return Err(untagged(term::DDP_UNTAGGED_NO_BUF));
        };
        let end = next_offset(rip, mo, data.len())?;
        // Scatter into the receive's SGEs starting at message offset `mo`.
        env.mrs
            .scatter(env.base.pd, rip.wqe.sges(), mo.into(), data)
            .map_err(|_| untagged(term::DDP_UNTAGGED_NO_BUF))?;
        rip.received = end;
        if !last {
            return Ok(());
        }
        let Some(rip) = self.cur_recv.take() else {
            return Ok(());
        };
        self.rx_msn_send = self.rx_msn_send.wrapping_add(1);
        let mut cqe = env.base.cqe(&rip.wqe, WcStatus::Success, rip.received);
        if op.solicited() {
            cqe.flags |= wc_flags::SOLICITED;
        }
        if op.invalidates() {
            if let Err(code) = remote_invalidate(env, inv_stag) {
                cqe.status = WcStatus::RemInvReqErr as u8;
                self.post_cqe(false, cqe);
                return Err(code);
            }
            cqe.flags |= wc_flags::WITH_INV;
            cqe.imm_or_inv = inv_stag;
        }
        self.post_cqe(false, cqe);
        Ok(())
    }

    fn on_read_request(
        &mut self,
        env: &Env,
        last: bool,
        msn: u32,
        mo: u32,
        payload: &[u8],
    ) -> Result<(), TermCode> {
        let untagged = |ecode| TermCode {
            layer: term::LAYER_DDP,
            etype: term::DDP_UNTAGGED_BUF,
            ecode,
        };
        let rr =
            ReadRequest::parse_bytes(payload).map_err(|_| untagged(term::DDP_UNTAGGED_TOO_LONG))?;
        if msn != self.rx_msn_read {
            return Err(untagged(term::DDP_UNTAGGED_INV_MSN));
        }
        if mo != 0 || !last {
            return Err(untagged(term::DDP_UNTAGGED_INV_MO));
        }
        if self.responses.len() as u32 + self.responding >= self.ird {
            return Err(TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_OP,
                ecode: term::RDMAP_CATASTROPHIC_LOCAL,
            });
        }
        if rr.size > 0 {
            let r = env.mrs.lookup(rr.src_stag).map_err(|_| TermCode {
                layer: term::LAYER_RDMAP,
                etype: term::RDMAP_REMOTE_PROT,
                ecode: term::RDMAP_INV_STAG,
            })?;
            r.check(env.base.pd, rr.src_to, rr.size as u64, Access::REMOTE_READ)
                .map_err(access_term_rdmap)?;
        }
        self.rx_msn_read = self.rx_msn_read.wrapping_add(1);
        self.responses.push_back(rr);
        self.kick();
        Ok(())
    }
}

/// Place tagged data at `(stag, to)` with the right `need`.
fn place_tagged(env: &Env, stag: u32, to: u64, data: &[u8], need: Access) -> Result<(), TermCode> {
    if data.is_empty() {
        return Ok(()); // zero-length: nothing is placed, no STag is checked
    }
    let r = env
        .mrs
        .lookup(stag)
        .map_err(|_| tagged_err(term::DDP_TAGGED_INV_STAG))?;
    r.write(env.base.pd, to, data, need).map_err(access_term)
}

/// Send with Invalidate: the peer may invalidate only what it was given remote
/// access to — a memory window, or a registration with remote rights — of this
/// QP's protection domain (`docs/security.md`, M6). A local-only buffer (a receive
/// buffer, a Read sink) cannot be taken away from the consumer by a peer.
fn remote_invalidate(env: &Env, stag: u32) -> Result<(), TermCode> {
    let refused = TermCode {
        layer: term::LAYER_RDMAP,
        etype: term::RDMAP_REMOTE_PROT,
        ecode: term::RDMAP_CANNOT_INVALIDATE,
    };
    let remote = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let r = env.mrs.lookup(stag).map_err(|_| refused)?;
    if r.pd != env.base.pd || !(r.is_window() || r.access.intersects(remote)) {
        return Err(refused);
    }
    r.invalidate();
    Ok(())
}

/// The QP's own access flags must allow an incoming RDMA Write or Read at all, whatever
/// the registration it names would allow (RFC 5040: access violation).
fn require_qp_access(access: Access, need: Access) -> Result<(), TermCode> {
    if access.contains(need) {
        Ok(())
    } else {
        Err(TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_ACCESS,
        })
    }
}

pub(super) fn tagged_err(ecode: u8) -> TermCode {
    TermCode {
        layer: term::LAYER_DDP,
        etype: term::DDP_TAGGED_BUF,
        ecode,
    }
}

fn access_term(e: AccessError) -> TermCode {
    match e {
        AccessError::InvalidStag | AccessError::Invalidated => {
            tagged_err(term::DDP_TAGGED_INV_STAG)
        }
        AccessError::OutOfBounds => tagged_err(term::DDP_TAGGED_BASE_BOUNDS),
        AccessError::PdMismatch => TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_STAG_NOT_ASSOC,
        },
        AccessError::NoRight => TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_PROT,
            ecode: term::RDMAP_ACCESS,
        },
        AccessError::Fault => TermCode {
            layer: term::LAYER_RDMAP,
            etype: term::RDMAP_REMOTE_OP,
            ecode: term::RDMAP_CATASTROPHIC_LOCAL,
        },
    }
}

fn access_term_rdmap(e: AccessError) -> TermCode {
    let ecode = match e {
        AccessError::InvalidStag | AccessError::Invalidated => term::RDMAP_INV_STAG,
        AccessError::OutOfBounds => term::RDMAP_BASE_BOUNDS,
        AccessError::PdMismatch => term::RDMAP_STAG_NOT_ASSOC,
        AccessError::NoRight | AccessError::Fault => term::RDMAP_ACCESS,
    };
    TermCode {
        layer: term::LAYER_RDMAP,
        etype: term::RDMAP_REMOTE_PROT,
        ecode,
    }
}
