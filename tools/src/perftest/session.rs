//! One perftest run once the control connection is up (a [`Session`]): the prologue,
//! the exchange of the data QPs' records, each test's order of handshakes, runs and
//! reports, the orderly close, and what perftest prints along the way.

use super::control::{self, conn_param, Control};
use super::params::Params;
use super::report::{self, RESULT_LINE};
use super::traffic::{self, DataQp};
use super::wire::{self, BwReport, Dest};
use super::{
    bandwidth, is_ipv4_gid, latency, Options, PerfError, Summary, Test, Verb, CLOSE_WAIT,
    VALIDATE_PATIENCE,
};
use std::io::Write;
use std::time::Duration;

/// One run after the control connection is up.
pub(super) struct Session<'a> {
    pub(super) p: Params,
    ctrl: Control,
    out: &'a mut dyn Write,
    device: String,
    validate: bool,
    summary: Summary,
}

impl<'a> Session<'a> {
    pub(super) fn new(
        p: Params,
        ctrl: Control,
        o: &Options,
        out: &'a mut dyn Write,
    ) -> Session<'a> {
        tracing::info!(
            test = p.test.perftest_name(),
            client = p.client,
            "perftest: control connection up"
        );
        Session {
            p,
            ctrl,
            out,
            device: o.device.clone(),
            validate: o.validate,
            summary: Summary::default(),
        }
    }

    pub(super) fn data_param(&self) -> rnicpi::ConnParam {
        let reads = if self.p.test.uses_reads() {
            self.p.out_reads
        } else {
            0
        };
        conn_param(reads)
    }

    /// Versions, page and cache-line sizes, MTU, and (rdma_cm) the handshake before the
    /// data connections (`exchange_versions`, `check_sys_data`, `check_mtu`,
    /// `create_rdma_cm_connection`).
    pub(super) fn prologue(&mut self) -> Result<(), PerfError> {
        let theirs = self
            .ctrl
            .xchg(&wire::encode_version(wire::VERSION), "version")?;
        let (version, v) = wire::decode_version(&theirs);
        tracing::info!(peer_version = %version, "perftest: versions exchanged");
        if v < wire::MIN_PEER_VERSION {
            return Err(PerfError::Version(version));
        }
        self.summary.peer_version = version;
        let page = self.xchg_int(self.p.cycle_buffer, "page size")?;
        self.p.cycle_buffer = self.p.cycle_buffer.max(page);
        let line = self.xchg_int(self.p.cache_line, "cache line size")?;
        self.p.cache_line = self.p.cache_line.max(line);
        let theirs = self.ctrl.xchg(&wire::encode_mtu(self.p.mtu), "MTU")?;
        if let Some(m) = wire::decode_mtu(&theirs) {
            self.p.mtu = self.p.mtu.min(m);
        }
        self.p.fit_ud(true)?;
        if self.ctrl.is_cm() {
            self.ctrl.handshake(&Dest::default())?;
        }
        Ok(())
    }

    fn xchg_int(&mut self, mine: u32, what: &'static str) -> Result<u32, PerfError> {
        let b = self.ctrl.xchg(&wire::encode_int(mine as i32), what)?;
        Ok(wire::decode_int(&b, what)?.max(0) as u32)
    }

    /// Everything after the data connections are up (rdma_cm) or the data QPs created.
    pub(super) fn run(mut self, mut qps: Vec<DataQp>) -> Result<Summary, PerfError> {
        if self.ctrl.is_cm() {
            self.ctrl.handshake(&Dest::default())?;
        }
        let my: Vec<Dest> = qps.iter().map(|q| q.my_dest(&self.p)).collect();
        self.print_info()?;
        let rem = self.exchange_dests(&qps, &my)?;
        for (q, r) in qps.iter_mut().zip(&rem) {
            q.set_remote(r);
        }
        // An ib_read_lat server takes no part in the test: it waits for the client's
        // closing handshake and prints no table.
        if !self.p.test.server_idle() || self.p.client {
            let header = if self.p.test.is_lat() {
                report::lat_header(self.p.timed.is_some())
            } else {
                report::bw_header(self.p.gbits)
            };
            writeln!(self.out, "{RESULT_LINE}\n{header}")?;
        }
        let result = match self.p.test {
            _ if self.p.duplex => self.bw_duplex(&qps, &my[0]),
            Test::WriteBw | Test::ReadBw | Test::AtomicBw => self.rdma_bw(&qps, &my[0]),
            Test::SendBw => self.send_bw(&qps, &my[0]),
            Test::SendLat => self.send_lat(&qps, &my[0]),
            Test::WriteLat | Test::ReadLat | Test::AtomicLat => self.rdma_lat(&qps, &my[0]),
        };
        self.close(&qps);
        result?;
        tracing::info!(test = self.p.test.perftest_name(), "perftest: done");
        Ok(self.summary)
    }

    /// The `pingpong_dest` handshakes before the test, in perftest's order, printing
    /// both sides' records; without rdma_cm the QPs connect after the first. Returns the
    /// peer's records.
    fn exchange_dests(&mut self, qps: &[DataQp], my: &[Dest]) -> Result<Vec<Dest>, PerfError> {
        if self.p.test.is_lat() && !self.p.test.is_send() {
            // ib_write_lat and ib_read_lat shake hands once more before the records.
            self.ctrl.handshake(&my[0])?;
        }
        let mut rem = my
            .iter()
            .map(|d| self.ctrl.handshake(d))
            .collect::<Result<Vec<_>, _>>()?;
        if !self.ctrl.is_cm() {
            // `ctx_check_gid_compatibility`, then `ctx_connect`.
            if is_ipv4_gid(&my[0].gid) != is_ipv4_gid(&rem[0].gid) {
                return Err(PerfError::Protocol(
                    "GID types differ (IPv4 and IPv6): use another GID index",
                ));
            }
            for ((q, m), r) in qps.iter().zip(my).zip(&rem) {
                q.connect(&self.p, m, r)?;
            }
        }
        if self.p.test.is_send() {
            self.ctrl.handshake(&my[0])?;
        }
        for d in my {
            self.print_dest("local", d)?;
        }
        for (r, d) in rem.iter_mut().zip(my) {
            *r = self.ctrl.handshake(d)?;
            self.print_dest("remote", r)?;
        }
        if !self.p.test.is_send() {
            self.ctrl.handshake(&my[0])?;
        }
        tracing::info!(peer = ?rem, "perftest: destinations exchanged");
        Ok(rem)
    }

    /// ib_write_bw / ib_read_bw: the client runs every size and sends its last report;
    /// the server waits and prints the client's report.
    fn rdma_bw(&mut self, qps: &[DataQp], my: &Dest) -> Result<(), PerfError> {
        let mut last = BwReport::default();
        if self.p.client {
            for &size in &self.p.sizes.clone() {
                last = bandwidth::run_bw_client(qps, &self.p, size)?;
                self.bw_line(&last)?;
                if self.p.test == Test::ReadBw {
                    self.check(qps, size, Duration::ZERO)?;
                }
            }
            writeln!(self.out, "{RESULT_LINE}")?;
            self.ctrl.handshake(my)?;
            self.xchg_report(&last)?;
            self.ctrl.finish(my)?;
        } else {
            self.ctrl.handshake(my)?;
            let theirs = self.xchg_report(&last)?;
            self.bw_line(&theirs)?;
            self.ctrl.finish(my)?;
            writeln!(self.out, "{RESULT_LINE}")?;
            if self.p.test == Test::WriteBw {
                let size = self.p.sizes[self.p.sizes.len() - 1];
                self.check(qps, size, VALIDATE_PATIENCE)?;
            }
        }
        Ok(())
    }

    /// `-b`, every bandwidth test: both sides run. Per size both sync (send_bw: after
    /// posting their receives), run, and print the sum of both sides' reports, exchanged
    /// as the one-way client sends its own (a timed send_bw prints each side's own: perftest
    /// exchanges nothing then). send_bw syncs again after each size of `-a`; the others
    /// do too, as perftest from 4.6 on (the version both sides announce).
    fn bw_duplex(&mut self, qps: &[DataQp], my: &Dest) -> Result<(), PerfError> {
        let send = self.p.test.is_send();
        let all = self.p.sizes.len() > 1;
        for &size in &self.p.sizes.clone() {
            if send {
                let cyc = self.p.cycle(size);
                qps.iter()
                    .try_for_each(|q| q.post_recvs(self.p.initial_recvs(), &cyc))?;
            }
            self.ctrl.handshake(my)?;
            let mine = if send {
                traffic::reset_credits(qps);
                bandwidth::run_bw_bi(qps, &self.p, size)?
            } else {
                bandwidth::run_bw_client(qps, &self.p, size)?
            };
            if !send && all {
                self.ctrl.handshake(my)?;
            }
            if send && self.p.timed.is_some() {
                self.bw_line(&mine)?;
            } else {
                let theirs = self.xchg_report(&mine)?;
                self.bw_line(&BwReport {
                    bw_peak: mine.bw_peak + theirs.bw_peak,
                    bw_avg: mine.bw_avg + theirs.bw_avg,
                    msg_rate: mine.msg_rate + theirs.msg_rate,
                    ..mine
                })?;
            }
            if send && all {
                self.ctrl.handshake(my)?;
            }
            // What the peer's requests left here (atomics change it on purpose).
            match self.p.test.verb() {
                Verb::Write => self.check(qps, size, VALIDATE_PATIENCE)?,
                Verb::Read | Verb::Send => self.check(qps, size, Duration::ZERO)?,
                Verb::Atomic => {}
            }
        }
        writeln!(self.out, "{RESULT_LINE}")?;
        self.ctrl.finish(my)?;
        Ok(())
    }

    /// ib_send_bw: per size the server posts its receives and both sync; each side prints
    /// its own result.
    fn send_bw(&mut self, qps: &[DataQp], my: &Dest) -> Result<(), PerfError> {
        for &size in &self.p.sizes.clone() {
            if !self.p.client {
                let cyc = self.p.cycle(size);
                qps.iter()
                    .try_for_each(|q| q.post_recvs(self.p.initial_recvs(), &cyc))?;
            }
            self.ctrl.handshake(my)?;
            traffic::reset_credits(qps);
            let r = if self.p.client {
                bandwidth::run_bw_client(qps, &self.p, size)?
            } else {
                let r = bandwidth::run_send_bw_server(qps, &self.p, size)?;
                self.check(qps, size, Duration::ZERO)?;
                r
            };
            self.bw_line(&r)?;
            if self.p.sizes.len() > 1 {
                self.ctrl.handshake(my)?;
            }
        }
        writeln!(self.out, "{RESULT_LINE}")?;
        self.ctrl.finish(my)?;
        Ok(())
    }

    /// ib_send_lat: per size both post receives, sync, and ping-pong.
    fn send_lat(&mut self, qps: &[DataQp], my: &Dest) -> Result<(), PerfError> {
        for &size in &self.p.sizes.clone() {
            qps[0].post_recvs(self.p.initial_recvs(), &self.p.cycle(size))?;
            self.ctrl.handshake(my)?;
            let r = latency::run_lat_send(&qps[0], &self.p, size)?;
            self.check(qps, size, Duration::ZERO)?;
            self.lat_line(r)?;
        }
        writeln!(self.out, "{RESULT_LINE}")?;
        self.ctrl.finish(my)?;
        Ok(())
    }

    /// ib_write_lat: a ping-pong of RDMA Writes, each side polling the last byte of the
    /// peer's Write in its own memory (no closing handshake: perftest's has none).
    /// ib_read_lat and ib_atomic_lat: the client alone reads (or runs atomics), one at a
    /// time, and closes with a handshake the server has been waiting in since the records.
    fn rdma_lat(&mut self, qps: &[DataQp], my: &Dest) -> Result<(), PerfError> {
        if self.p.test.server_idle() && !self.p.client {
            self.ctrl.finish(my)?;
            writeln!(self.out, "{RESULT_LINE}")?;
            return Ok(());
        }
        for &size in &self.p.sizes.clone() {
            let r = match self.p.test {
                Test::WriteLat => latency::run_lat_write(&qps[0], &self.p, size)?,
                _ => latency::run_lat_one_at_a_time(&qps[0], &self.p, size)?,
            };
            if self.p.test == Test::ReadLat {
                self.check(qps, size, Duration::ZERO)?;
            }
            self.lat_line(r)?;
        }
        writeln!(self.out, "{RESULT_LINE}")?;
        if self.p.test.server_idle() {
            self.ctrl.finish(my)?;
        }
        Ok(())
    }

    /// `xchg_bw_reports`: five 8-byte exchanges.
    fn xchg_report(&mut self, mine: &BwReport) -> Result<BwReport, PerfError> {
        let mut theirs = [[0u8; 8]; 5];
        for (t, w) in theirs.iter_mut().zip(mine.words()) {
            *t = wire::word(&self.ctrl.xchg(&w, "bw report")?)?;
        }
        Ok(BwReport::from_words(&theirs))
    }

    /// `--validate`: check what arrived against the peer's pattern.
    fn check(&mut self, qps: &[DataQp], size: u64, patience: Duration) -> Result<(), PerfError> {
        if !self.validate {
            return Ok(());
        }
        if let Err(at) = traffic::validate(qps, &self.p, size, patience) {
            return Err(PerfError::DataMismatch(format!(
                "bytes differ from the peer's pattern ({at})"
            )));
        }
        tracing::debug!(size, "perftest: data validated");
        self.summary.validated = true;
        Ok(())
    }

    fn lat_line(&mut self, r: latency::LatRun) -> Result<(), PerfError> {
        match r {
            latency::LatRun::Iterations(r) => {
                writeln!(self.out, "{}", report::lat_line(&r))?;
                self.summary.lat.push(r);
            }
            latency::LatRun::Timed(r) => {
                writeln!(self.out, "{}", r.line())?;
                self.summary.timed_lat.push(r);
            }
        }
        Ok(())
    }

    fn bw_line(&mut self, r: &BwReport) -> Result<(), PerfError> {
        writeln!(self.out, "{}", report::bw_line(r, self.p.gbits))?;
        self.summary.bw.push(*r);
        Ok(())
    }

    /// Orderly close in perftest's order: the client disconnects its data QPs and waits
    /// for them to close, then lets the server close the control connection first (a
    /// Send whose completion is still pending in kernel siw fails when the connection
    /// closes under it); the server closes everything at once.
    /// Without rdma_cm there is nothing to disconnect: the socket closes, and the QPs are
    /// destroyed with the run (perftest's `destroy_ctx`).
    fn close(&mut self, qps: &[DataQp]) {
        let ctrl = match &mut self.ctrl {
            Control::Cm(c) => c,
            Control::Sockets(s) => {
                s.close();
                return;
            }
        };
        // (UD data QPs have no connection to close.)
        if !self.p.ud() {
            for q in qps {
                let _ = q.ep.qp.disconnect(false);
            }
            for q in qps {
                control::await_disconnect(&q.ep, CLOSE_WAIT);
            }
        }
        if self.p.client {
            ctrl.await_peer_close(CLOSE_WAIT);
        }
        ctrl.close();
        control::await_disconnect(&ctrl.ep, CLOSE_WAIT);
        tracing::info!("perftest: connections closed");
    }

    /// `ctx_print_test_info`.
    fn print_info(&mut self) -> Result<(), PerfError> {
        let p = &self.p;
        let o = &mut *self.out;
        let kind = if p.test.is_lat() { "Latency" } else { "BW" };
        let verb = match p.test.verb() {
            Verb::Atomic => format!("Atomic {}", p.atomic_type.name()),
            _ => p.test.verb_name().to_string(),
        };
        writeln!(o, "{RESULT_LINE}")?;
        let list = if p.post_list > 1 && !p.test.is_lat() {
            "Post List "
        } else {
            ""
        };
        let both = if p.duplex { "Bidirectional " } else { "" };
        writeln!(o, "                    {verb} {both}{list}{kind} Test")?;
        if p.use_event {
            writeln!(o, " Test with events. Using {}_comp0", self.device)?;
        }
        writeln!(
            o,
            " Dual-port       : OFF\t\tDevice         : {}",
            self.device
        )?;
        let transport = if p.iwarp { "IW" } else { "IB" };
        writeln!(
            o,
            " Number of qps   : {}\t\tTransport type : {transport}",
            p.num_qps
        )?;
        let conn = super::params::connection_name(p.connection);
        writeln!(o, " Connection type : {conn}\t\tUsing SRQ      : OFF")?;
        // As Debian's perftest 4.5 prints them: PCIe relaxed ordering is turned off only
        // by ib_write_lat (it polls for the last byte), and the ibv_wr_* API is not used.
        let relaxed = if p.test == Test::WriteLat {
            "OFF"
        } else {
            "ON"
        };
        writeln!(o, " PCIe relax order: {relaxed}")?;
        writeln!(o, " ibv_wr* API     : OFF")?;
        if p.client || p.duplex {
            writeln!(o, " TX depth        : {}", p.tx_depth)?;
        }
        if p.post_list > 1 {
            writeln!(o, " Post List       : {}", p.post_list)?;
        }
        if p.test.is_send() && (!p.client || p.duplex) {
            writeln!(o, " RX depth        : {}", p.rx_depth)?;
        }
        if !p.test.is_lat() {
            writeln!(o, " CQ Moderation   : {}", p.cq_mod)?;
        }
        writeln!(o, " Mtu             : {}[B]", wire::mtu_bytes(p.mtu))?;
        writeln!(o, " Link type       : Ethernet")?;
        writeln!(o, " GID index       : {}", p.gid_index)?;
        if p.test.uses_reads() {
            writeln!(o, " Outstand reads  : {}", p.out_reads)?;
        } else {
            writeln!(o, " Max inline data : {}[B]", p.inline)?;
        }
        let (cm_qps, method) = if p.rdma_cm {
            ("ON", "rdma_cm")
        } else {
            ("OFF", "Ethernet")
        };
        writeln!(o, " rdma_cm QPs\t : {cm_qps}")?;
        writeln!(o, " Data ex. method : {method}")?;
        writeln!(o, "{RESULT_LINE}")?;
        Ok(())
    }

    /// `ctx_print_pingpong_data`. The exchange's verb picks the columns: with -R that is
    /// the control connection's (Send: none), without it the test's (Read: OUT, RKey and
    /// VAddr; Write: RKey and VAddr).
    fn print_dest(&mut self, side: &str, d: &Dest) -> Result<(), PerfError> {
        let gid: Vec<String> = d.gid.iter().map(|b| format!("{b:02}")).collect();
        let mut line = format!(
            " {side} address: LID {} QPN {} PSN {}",
            c_alt_hex(d.lid as u64, 4),
            c_alt_hex(d.qpn as u64, 6),
            c_alt_hex(d.psn as u64, 6),
        );
        let verb = if self.p.rdma_cm {
            Verb::Send
        } else {
            self.p.test.verb()
        };
        if verb == Verb::Read {
            line.push_str(&format!(" OUT {}", c_alt_hex(d.out_reads as u64, 4)));
        }
        if matches!(verb, Verb::Read | Verb::Write) {
            line.push_str(&format!(
                " RKey {} VAddr {}",
                c_alt_hex(d.rkey as u64, 8),
                c_alt_hex(d.vaddr, 16)
            ));
        }
        writeln!(self.out, "{line}\n GID: {}", gid.join(":"))?;
        Ok(())
    }
}

/// C's `%#0Nx`: zero-padded to `width` characters, with `0x` unless the value is 0.
fn c_alt_hex(v: u64, width: usize) -> String {
    if v == 0 {
        format!("{:0width$}", 0)
    } else {
        format!("{v:#0width$x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_hex_like_printf() {
        assert_eq!(c_alt_hex(0, 4), "0000");
        assert_eq!(c_alt_hex(2, 6), "0x0002");
        assert_eq!(c_alt_hex(0x90f8ea, 6), "0x90f8ea");
        assert_eq!(c_alt_hex(0x7f6818ecf000, 16), "0x007f6818ecf000");
    }
}
