//! The data QPs: their buffers, connection, requests (one, or a `-l` list), completions,
//! credits and the `--validate` patterns. The runs over them are in `bandwidth` and
//! `latency`.
//!
//! Each data QP owns a buffer of two halves of `BUFF_SIZE` bytes plus a small credit area:
//! requests go out of (and RDMA Reads land in) the lower half; the upper half is what the
//! peer writes, reads or sends into; its address and rkey are what `pingpong_dest`
//! advertises (for send_bw over iWARP the credit word is advertised instead). A UD
//! receive in the upper half's last place runs 40 bytes (the GRH) past it: the credit
//! area starts after that room.
//!
//! Without rdma_cm (IB/RoCE) the QPs are connected by Modify QP with perftest's attributes
//! (`ctx_connect`): RTR towards the peer's record, and RTS for latency tests, the client
//! and both sides of a bidirectional run (a one-way bandwidth server only receives, so it
//! stays in RTR). A UD QP (`-c UD`) goes to RTS with perftest's Q_Key and sends through
//! an address handle of the peer's GID; its receives take the GRH before each message.

use super::control::{check, closed, next_raw, DATA_IDLE};
use super::params::{Cycle, Params, MAX_INLINE};
use super::timed::RunClock;
use super::wire::{self, Dest};
use super::{AtomicType, PerfError, Verb};
use crate::perf::{new_endpoint_with, Endpoint, ENDPOINT_ACCESS};
use rnicpi::{send_flags, Access, AhAttr, WcOpcode, WrOpcode, GRH_LEN, RDMA_UDP_QKEY};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use ual::oob::{self, RcPath, RcPeer};
use ual::{Ah, Context, Cqe};

/// Bytes after the two halves: the credit word the peer writes (offset 0) and the one this
/// side sends from (offset 8).
const CREDIT_AREA: u64 = 64;
const CREDIT_OUT: u64 = 8;
/// wr_id of credit writes (data requests carry their QP's index, like perftest).
pub(super) const CREDIT_ID: u64 = u64::MAX - 1;
/// perftest's `DEF_QKEY`: the Q_Key of UD data QPs and of their Sends.
const DEF_QKEY: u32 = 0x1111_1111;
/// perftest's `MIN_RNR_TIMER` (0.64 ms).
const MIN_RNR_TIMER: u8 = 12;
/// `ah_attr.grh.hop_limit` in `ctx_modify_qp_to_rtr`.
const HOP_LIMIT: u8 = 0xff;
/// Seeds of the fill patterns (`--validate`): what each side's buffers hold at the start.
pub const CLIENT_SEED: u32 = 0x6b72_646d;
pub const SERVER_SEED: u32 = 0x7065_7266;

/// How a wait for the peer's RDMA Write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Awaited {
    Landed,
    /// The timed run's clock ran out.
    Ended,
    /// The peer closed after the sample (a timed run it ended first).
    PeerGone,
}

/// One connected data QP.
pub struct DataQp {
    pub ep: Endpoint,
    /// `BUFF_SIZE`: bytes per half.
    pub(super) half: u64,
    /// Where the credit area starts: after both halves and the room a receive's GRH takes.
    credit_at: u64,
    /// `-e`: wait for completions on CQ notifications instead of polling.
    pub(super) events: bool,
    /// `-I`: requests of at most this many bytes carry their data inline.
    inline: u32,
    /// `-c UD`: the peer's address handle, QPN and Q_Key, once known ([`DataQp::connect`];
    /// with rdma_cm [`DataQp::ud_resolved`] or [`DataQp::ud_learn_peer`]).
    ud_peer: OnceLock<(Arc<Ah>, u32, u32)>,
}

impl DataQp {
    /// A data QP's verbs objects, its buffer filled with this side's pattern; without
    /// rdma_cm the QP is in INIT with perftest's access rights (`ctx_modify_qp_to_init`).
    pub fn endpoint(ctx: &Arc<Context>, dev: u32, p: &Params) -> ual::Result<Endpoint> {
        let half = p.half();
        let depth = p.tx_depth.max(p.rx_depth) + 8;
        let mut access = ENDPOINT_ACCESS;
        if p.test.verb() == Verb::Atomic {
            access |= Access::REMOTE_ATOMIC;
        }
        let len = (credit_area(p) + CREDIT_AREA) as usize;
        let ep = new_endpoint_with(ctx, dev, len, depth, access, p.connection)?;
        let pat = pattern(seed(p.client), half as usize);
        ep.buf.write(0, &pat);
        ep.buf.write(half as usize, &pat);
        if p.ud() && p.rdma_cm {
            // rdma_cm's UDP port space: its Q_Key, as librdmacm readies the QP.
            oob::ud_to_rts(&ep.qp, RDMA_UDP_QKEY, oob::random_psn(ep.qp.qp_num))?;
        }
        if !p.rdma_cm && !p.ud() {
            let access = match p.test.verb() {
                Verb::Write => Access::REMOTE_WRITE,
                Verb::Read => Access::REMOTE_READ,
                Verb::Send => Access::REMOTE_WRITE | Access::LOCAL_WRITE,
                Verb::Atomic => Access::REMOTE_ATOMIC,
            };
            oob::to_init(&ep.qp, access)?;
        }
        Ok(ep)
    }

    /// `ctx_connect` (without rdma_cm): RTR towards the peer's record; RTS as well for a
    /// latency test or the client. IRD is our `out_reads`, ORD the peer's (the device
    /// lowers both to what it supports).
    pub fn connect(&self, p: &Params, my: &Dest, rem: &Dest) -> Result<(), PerfError> {
        if p.ud() {
            oob::ud_to_rts(&self.ep.qp, DEF_QKEY, my.psn)?;
            self.set_ud_peer(p, rem.gid, rem.qpn, DEF_QKEY)?;
            tracing::info!(
                qpn = self.ep.qp.qp_num,
                peer_qpn = rem.qpn,
                "perftest: UD QP ready"
            );
            return Ok(());
        }
        let path = RcPath {
            path_mtu: wire::mtu_bytes(p.mtu),
            sgid_index: sgid_index(p)?,
            hop_limit: HOP_LIMIT,
            max_dest_rd_atomic: my.out_reads.min(255) as u8,
            max_rd_atomic: rem.out_reads.min(255) as u8,
            min_rnr_timer: MIN_RNR_TIMER,
            timeout: p.qp_timeout,
            retry_cnt: 7,
            rnr_retry: 7,
        };
        let peer = RcPeer {
            qpn: rem.qpn,
            psn: rem.psn,
            gid: rem.gid,
        };
        oob::to_rtr(&self.ep.qp, &path, &peer)?;
        if p.test.is_lat() || p.client || p.duplex {
            oob::to_rts(&self.ep.qp, &path, my.psn)?;
        }
        tracing::info!(
            qpn = self.ep.qp.qp_num,
            peer_qpn = rem.qpn,
            "perftest: QP connected"
        );
        Ok(())
    }

    pub fn new(ep: Endpoint, p: &Params) -> DataQp {
        DataQp {
            ep,
            half: p.half(),
            credit_at: credit_area(p),
            events: p.use_event,
            inline: p.inline,
            ud_peer: OnceLock::new(),
        }
    }

    /// The next completion, which must have succeeded: polled, or with `-e` waited for.
    pub(super) fn next(&self, what: &'static str) -> Result<Cqe, PerfError> {
        let c = next_raw(&self.ep, DATA_IDLE, what, self.events)?;
        check(c, what)
    }

    /// The next completion (which must have succeeded). In a timed run (`clock`) it is
    /// polled until the run ends (`None` then), and a peer that closes (or whose close
    /// flushes our work) while the run winds down has simply finished first (`None`).
    pub(super) fn next_until(
        &self,
        what: &'static str,
        clock: Option<&RunClock>,
    ) -> Result<Option<Cqe>, PerfError> {
        let Some(clock) = clock else {
            return self.next(what).map(Some);
        };
        let mut one = [Cqe::default()];
        let deadline = Instant::now() + DATA_IDLE;
        loop {
            if self.ep.cq.poll(&mut one) == 1 {
                // A request that failed while the run winds down: the peer finished
                // first and left (flushed by its close, or unanswered once its QP went).
                return match check(one[0], what) {
                    Err(PerfError::PeerClosed(_) | PerfError::Completion { .. })
                        if clock.winding_down() =>
                    {
                        Ok(None)
                    }
                    r => r.map(Some),
                };
            }
            if clock.ended() {
                return Ok(None);
            }
            if closed(&self.ep) {
                return if clock.winding_down() {
                    Ok(None)
                } else {
                    Err(PerfError::PeerClosed(what))
                };
            }
            if Instant::now() > deadline {
                return Err(PerfError::Timeout(what));
            }
            std::thread::yield_now();
        }
    }

    /// Without rdma_cm: the run's data QPs, in INIT until [`DataQp::connect`].
    pub fn unconnected(ctx: &Arc<Context>, dev: u32, p: &Params) -> Result<Vec<DataQp>, PerfError> {
        (0..p.num_qps)
            .map(|_| Ok(DataQp::new(Self::endpoint(ctx, dev, p)?, p)))
            .collect()
    }

    /// What this side advertises for the QP (`set_up_connection`, `ctx_alloc_credit`).
    pub fn my_dest(&self, p: &Params) -> Dest {
        let base = self.ep.mr.addr;
        let vaddr = if p.credits() {
            base + self.credit_at
        } else {
            base + self.half
        };
        Dest {
            lid: 0,
            out_reads: p.out_reads,
            qpn: self.ep.qp.qp_num,
            psn: oob::random_psn(self.ep.qp.qp_num),
            rkey: self.ep.mr.rkey,
            vaddr,
            gid: p.gid,
            srqn: 0,
            gid_index: p.gid_index as i32,
        }
    }

    /// `-c UD -R`, client: the server's QP as SIDR resolved it (`qpn`, `qkey`), reached at
    /// `server`. Where the server must answer (latency, bidirectional), tell it our QP
    /// number as perftest does (`send_qp_num_for_ah`): a Send with it as immediate data.
    pub fn ud_resolved(
        &self,
        p: &Params,
        server: std::net::IpAddr,
        qpn: u32,
        qkey: u32,
    ) -> Result<(), PerfError> {
        let ah = self.set_ud_peer(p, rnicpi::ip_to_gid(server), qpn, qkey)?;
        if p.server_answers() {
            // From the credit area (unused over IB), leaving the pattern in the halves.
            let me = self.ep.qp.qp_num;
            let at = self.credit_at + CREDIT_OUT;
            self.ep.buf.write(at as usize, &me.to_ne_bytes());
            let w = ual::Wqe::new(0, WrOpcode::SendWithImm, &[self.ep.mr.sge(at, 4)])
                .with_imm(u32::from_ne_bytes(me.to_be_bytes()))
                .with_flags(send_flags::SIGNALED)
                .with_ud(ah, qpn, qkey);
            self.ep.qp.post_send(&w)?;
            self.next("our QP number")?;
        }
        tracing::info!(
            qpn = self.ep.qp.qp_num,
            peer_qpn = qpn,
            "perftest: UD service resolved"
        );
        Ok(())
    }

    /// `-c UD -R`, server, before accepting: where the server answers (latency,
    /// bidirectional), a receive for the client's QP number (`post_recv_to_get_ah`).
    pub fn ud_await_peer(&self, p: &Params) -> Result<(), PerfError> {
        if p.server_answers() {
            self.ep.post_recv(0, self.half, GRH_LEN as u32 + 4)?;
        }
        Ok(())
    }

    /// `-c UD -R`, server, after accepting: the client's address from the GRH of its
    /// first datagram and its QP number from the immediate data (`create_ah_from_wc_recv`).
    pub fn ud_learn_peer(&self, p: &Params) -> Result<(), PerfError> {
        if !p.server_answers() {
            return Ok(());
        }
        let c = self.next("the client's QP number")?;
        if c.opcode() != Some(WcOpcode::Recv) {
            return Err(PerfError::Protocol("expected the client's QP number"));
        }
        let mut grh = [0u8; GRH_LEN];
        self.ep.buf.read(self.half as usize, &mut grh);
        let src = crate::udaddy::grh_source(&grh)
            .ok_or(PerfError::Protocol("no source address in the GRH"))?;
        let qpn = u32::from_be_bytes(c.imm_or_inv.to_ne_bytes());
        self.set_ud_peer(p, rnicpi::ip_to_gid(src), qpn, RDMA_UDP_QKEY)?;
        tracing::info!(qpn = self.ep.qp.qp_num, peer_qpn = qpn, %src, "perftest: UD client known");
        Ok(())
    }

    /// `-c UD`: Sends go to QP `qpn` (Q_Key `qkey`) at `gid`, through an address handle
    /// from our GID; the handle's number.
    fn set_ud_peer(
        &self,
        p: &Params,
        gid: [u8; 16],
        qpn: u32,
        qkey: u32,
    ) -> Result<u32, PerfError> {
        let attr = AhAttr {
            port: 1,
            sgid_index: sgid_index(p)?,
            hop_limit: HOP_LIMIT,
            dgid: gid,
            ..Default::default()
        };
        let ah = self.ep.pd.context().create_ah(&self.ep.pd, &attr)?;
        let num = ah.num();
        let _ = self.ud_peer.set((ah, qpn, qkey));
        Ok(num)
    }

    /// Aim RDMA requests (and send_bw credits) at what the peer advertised.
    pub fn set_remote(&mut self, rem: &Dest) {
        self.ep.remote = (rem.vaddr, rem.rkey, self.half);
    }

    /// The receive the `j`-th message of a run lands in.
    pub(super) fn post_recv(&self, j: u64, cyc: &Cycle) -> Result<(), PerfError> {
        let len = (cyc.lead + cyc.size) as u32;
        self.ep.post_recv(0, self.half + cyc.offset(j), len)?;
        Ok(())
    }

    /// `ctx_set_recv_wqes`: the first `count` receives of a run.
    pub fn post_recvs(&self, count: u64, cyc: &Cycle) -> Result<(), PerfError> {
        (0..count).try_for_each(|j| self.post_recv(j, cyc))
    }

    /// Post request `k` of a run (RDMA Write, RDMA Read, Send or atomic).
    pub(super) fn post(
        &self,
        p: &Params,
        q: u64,
        k: u64,
        cyc: &Cycle,
        flags: u8,
    ) -> Result<(), PerfError> {
        let w = self.request(p, q, k, cyc, flags)?;
        self.ep.qp.post_send(&w)?;
        Ok(())
    }

    /// Request `k` of a run: `size` bytes at the `k`-th place of the cycle, here and (RDMA)
    /// at the peer; Sends and Writes up to the inline size carry their bytes inline.
    fn request(
        &self,
        p: &Params,
        q: u64,
        k: u64,
        cyc: &Cycle,
        flags: u8,
    ) -> Result<ual::Wqe, PerfError> {
        let (off, len) = (cyc.offset(k), cyc.size as u32);
        let remote = (self.ep.remote.0 + off, self.ep.remote.1);
        let (op, sge) = match p.test.verb() {
            Verb::Write => (WrOpcode::RdmaWrite, self.ep.mr.sge(off, len)),
            Verb::Read => (WrOpcode::RdmaRead, self.ep.mr.sge(off, len)),
            Verb::Send => (WrOpcode::Send, self.ep.mr.sge(off, len)),
            Verb::Atomic => {
                // perftest's operands: add 1, or compare with 0 and swap in 0.
                let (op, add) = match p.atomic_type {
                    AtomicType::FetchAndAdd => (WrOpcode::AtomicFetchAdd, 1),
                    AtomicType::CmpAndSwap => (WrOpcode::AtomicCmpSwp, 0),
                };
                let mut w = ual::Wqe::new(q, op, &[self.ep.mr.sge(off, len)])
                    .with_remote(remote.0, remote.1)
                    .with_flags(flags);
                w.compare_add = add;
                w.swap = 0;
                return Ok(w);
            }
        };
        if matches!(op, WrOpcode::RdmaWrite | WrOpcode::Send) && len <= self.inline {
            // Inline: the bytes travel in the request itself, copied from the buffer now.
            let mut bytes = [0u8; MAX_INLINE as usize];
            let bytes = &mut bytes[..len as usize];
            self.ep.buf.read(off as usize, bytes);
            let w = ual::Wqe::new(q, op, &[])
                .with_inline(bytes)
                .ok_or_else(|| PerfError::Options("inline size above the device's".into()))?
                .with_flags(flags | send_flags::INLINE);
            return Ok(self.addressed(w, op, remote));
        }
        let w = ual::Wqe::new(q, op, &[sge]).with_flags(flags);
        Ok(self.addressed(w, op, remote))
    }

    /// Where a Send or Write goes beyond its QP: a Write to the peer's buffer, a UD Send
    /// to the peer's QP through its address handle.
    fn addressed(&self, w: ual::Wqe, op: WrOpcode, remote: (u64, u32)) -> ual::Wqe {
        match (op, self.ud_peer.get()) {
            (WrOpcode::Send, Some((ah, qpn, qkey))) => w.with_ud(ah.num(), *qpn, *qkey),
            (WrOpcode::Send, None) => w,
            _ => w.with_remote(remote.0, remote.1),
        }
    }

    /// `-l`: post `p.post_list` requests as one list, as perftest lays it out once
    /// (`ctx_set_send_reg_wqes`): the list's `j`-th request at the cycle's `j`-th place,
    /// every `cq_mod`-th one signaled.
    pub(super) fn post_list(&self, p: &Params, q: u64, cyc: &Cycle) -> Result<(), PerfError> {
        let cq_mod = p.cq_mod as u64;
        let list = (0..p.post_list as u64)
            .map(|j| {
                let flags = if (j + 1) % cq_mod == 0 {
                    send_flags::SIGNALED
                } else {
                    0
                };
                self.request(p, q, j, cyc, flags)
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.ep.qp.post_send_batch(&list)?;
        Ok(())
    }

    /// Spin until the byte at `off` of our buffer reads `want` (the peer's RDMA Write has
    /// landed), yielding the CPU between looks: on a small host the engine that places
    /// the Write may need it. Fails once the connection closes or nothing changes for
    /// [`DATA_IDLE`]. In a timed run (`clock`) the end of the run ends the wait, and so
    /// does the peer's close once the sample is over (its clock ran out first).
    pub(super) fn await_byte(
        &self,
        off: usize,
        want: u8,
        clock: Option<&RunClock>,
    ) -> Result<Awaited, PerfError> {
        let deadline = Instant::now() + DATA_IDLE;
        let gave_up = self.spin_on_byte(off, want, || {
            if clock.is_some_and(RunClock::ended) {
                return Some(Ok(Awaited::Ended));
            }
            if closed(&self.ep) {
                return Some(match clock {
                    Some(c) if c.winding_down() => Ok(Awaited::PeerGone),
                    _ => Err(PerfError::PeerClosed("the peer's RDMA Write")),
                });
            }
            (Instant::now() > deadline).then_some(Err(PerfError::Timeout("the peer's RDMA Write")))
        });
        gave_up.unwrap_or(Ok(Awaited::Landed))
    }

    /// Whether the byte at `off` reads `want` within `quiet` (no error: a closed
    /// connection simply never shows it).
    pub(super) fn await_byte_for(&self, off: usize, want: u8, quiet: Duration) -> bool {
        let deadline = Instant::now() + quiet;
        self.spin_on_byte(off, want, || (Instant::now() > deadline).then_some(()))
            .is_none()
    }

    /// Look at the byte at `off` until it reads `want` (`None`), driving the engine (in
    /// embedded mode: [`ual::Cq::drive`]) or else yielding the CPU between looks, or until
    /// `stop` gives an answer (`Some` of it).
    fn spin_on_byte<R>(
        &self,
        off: usize,
        want: u8,
        mut stop: impl FnMut() -> Option<R>,
    ) -> Option<R> {
        let mut b = [0u8];
        loop {
            self.ep.buf.read(off, &mut b);
            if b[0] == want {
                return None;
            }
            if let Some(r) = stop() {
                return Some(r);
            }
            if !self.ep.cq.drive() {
                std::thread::yield_now();
            }
        }
    }

    /// The receive count the peer last wrote into our credit word.
    pub(super) fn credit(&self) -> u64 {
        let mut b = [0u8; 4];
        self.ep.buf.read(self.credit_at as usize, &mut b);
        u32::from_le_bytes(b) as u64
    }

    pub(super) fn reset_credit(&self) {
        self.ep.buf.write(self.credit_at as usize, &[0; 4]);
    }

    /// RDMA-Write our receive count into the peer's credit word (host order, as perftest).
    pub(super) fn send_credit(&self, received: u64) -> Result<(), PerfError> {
        let off = self.credit_at + CREDIT_OUT;
        self.ep
            .buf
            .write(off as usize, &(received as u32).to_le_bytes());
        self.ep.write(CREDIT_ID, off, 4, 0, send_flags::SIGNALED)?;
        Ok(())
    }

    /// Check that the `count` messages of `cyc` left the peer's pattern in the upper half
    /// (`upper`) or the lower half; `Err` says where the first difference is.
    fn verify(&self, cyc: &Cycle, count: u64, peer_seed: u32, upper: bool) -> Result<(), String> {
        let expect = pattern(peer_seed, self.half as usize);
        let base = if upper { self.half } else { 0 };
        let lead = if upper { cyc.lead } else { 0 };
        for (off, len) in cyc.covered(count) {
            let mut got = vec![0u8; len as usize];
            self.ep.buf.read((base + off + lead) as usize, &mut got);
            let want = &expect[off as usize..(off + len) as usize];
            if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                let end = (i + 8).min(got.len());
                return Err(format!(
                    "message place {off}, byte {i} of {len}: {:02x?}, expected {:02x?}",
                    &got[i..end],
                    &want[i..end]
                ));
            }
        }
        Ok(())
    }
}

/// Our GID index as the address vector takes it.
fn sgid_index(p: &Params) -> Result<u8, PerfError> {
    u8::try_from(p.gid_index).map_err(|_| PerfError::Options("GID index above 255".into()))
}

/// Where a data QP's credit area starts (see the module comment).
fn credit_area(p: &Params) -> u64 {
    2 * p.half() + p.grh()
}

/// Reset the credit words before a send_bw run (perftest zeroes `credit_buf`).
pub fn reset_credits(qps: &[DataQp]) {
    qps.iter().for_each(DataQp::reset_credit);
}

/// `--validate` (krdma to krdma only): the bytes `p.iters` messages of `size` put into
/// this side's buffers match the peer's fill pattern. Where they land: the upper half
/// for Writes and Sends received, the lower half for Reads. A server checking Writes
/// waits up to `patience` for data still in flight on the data connection. `Err` says
/// where the first difference is.
pub fn validate(qps: &[DataQp], p: &Params, size: u64, patience: Duration) -> Result<(), String> {
    let cyc = p.cycle(size);
    let peer = seed(!p.client);
    let upper = p.test.verb() != Verb::Read;
    let deadline = Instant::now() + patience;
    loop {
        let checked = qps.iter().enumerate().try_for_each(|(q, dq)| {
            dq.verify(&cyc, p.iters, peer, upper)
                .map_err(|e| format!("QP {q}, {e}"))
        });
        if checked.is_ok() || Instant::now() >= deadline {
            return checked;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn seed(client: bool) -> u32 {
    if client {
        CLIENT_SEED
    } else {
        SERVER_SEED
    }
}

/// The deterministic fill pattern (xorshift32 words).
pub fn pattern(seed: u32, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 4);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_deterministic() {
        assert_eq!(pattern(CLIENT_SEED, 10), pattern(CLIENT_SEED, 12)[..10]);
        assert_ne!(pattern(CLIENT_SEED, 8), pattern(SERVER_SEED, 8));
    }
}
