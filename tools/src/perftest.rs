//! `krdma perf`: perftest's `ib_write_bw`, `ib_read_bw`, `ib_send_bw`, `ib_send_lat`,
//! `ib_write_lat`, `ib_read_lat`, `ib_atomic_bw` and `ib_atomic_lat` (IB/RoCE only: iWARP
//! has no atomics), message for message, so either side can be perftest 4.5 on a Linux host: in rdma_cm
//! mode (`-R`) over iWARP (kernel siw, an iWARP NIC) or RoCE (kernel rxe, a RoCE NIC),
//! and in perftest's default mode over RoCE (a TCP socket for the exchange, QPs connected
//! by Modify QP; iWARP cannot do that, so it is refused there).
//!
//! What goes over the wire with `-R` (perftest 4.5-0.18, version string "6.06"; checked
//! against captures of kernel siw and kernel rxe running perftest, `docs/interop.md`):
//!
//! 1. The client opens a **control connection** to the server's port (18515): an RC QP with
//!    IRD = ORD = 0 asked for (iWARP: in the MPA Request, where krdma's siw sends at least
//!    1; IB: the CM REQ's responder resources and initiator depth) and no private data.
//! 2. Lock-step exchanges on it, each one Send from the client answered by one Send from
//!    the server (`ctx_xchg_data`): the version string (16 bytes), the page size and the
//!    cache-line size (4-byte big-endian ints; both sides use the larger), the port MTU as
//!    `enum ibv_mtu` in decimal (2 bytes, `"3\0"` = 1024; both use the smaller).
//! 3. A `pingpong_dest` handshake (56 bytes, all zero), then the client opens the **data
//!    connection(s)** to the same port (IRD = ORD = `out_reads` for Read tests, else 0),
//!    retrying while refused: the server listens again only after answering, then another
//!    zero handshake.
//! 4. `pingpong_dest` handshakes with the real records (QPN, PSN, rkey, vaddr, GID;
//!    `out_reads`): three before the data for the bandwidth tests, the third "after RTR"
//!    (for the Send tests it is the second); write_lat and read_lat shake hands once more
//!    before them.
//! 5. The test (`perftest/traffic.rs`): RDMA Writes/Reads of `-s` bytes to/from the peer's
//!    advertised buffer, `-t` outstanding; send_bw additionally with receive credits
//!    over iWARP (the receiver RDMA-Writes its receive count into a word the sender
//!    advertised, every `rx_depth / 3` messages, because iWARP has no RNR retry; over IB
//!    the sender relies on RNR retry instead); send_lat a ping-pong. Send tests sync once
//!    more after posting receives (once per size).
//! 6. Write/Read: a handshake when the client is done, then its report (size, iterations,
//!    peak, average, message rate: five 8-byte big-endian Sends) which the server prints.
//!    write_lat: a ping-pong of RDMA Writes, each side polling the last byte of the peer's
//!    Write in its own memory; read_lat: the client's Reads, one at a time, while the
//!    server already waits in the closing handshake.
//! 7. A closing handshake (none for write_lat). The client disconnects the data QP(s) and waits for them to
//!    close; the server closes the control connection first.
//!
//! Without `-R` (`perftest/sockets.rs`): the client connects a TCP socket to the server's
//! port and the same exchanges 2.–7. run over it, minus the zero records and the data
//! connections: each side creates its QPs after the MTU exchange, the first real records
//! carry QPN, PSN and GID, both sides then move their QPs to RTR/RTS (`ctx_connect`), and
//! the closing handshake is followed by `"done\0"` both ways.
//!
//! Two things `krdma perf` does beyond the wire format, both to meet kernel siw 6.1 (see
//! `docs/interop.md`): the client pauses briefly between the control connection coming up
//! and its first Send, and it keeps perftest's close order.
//!
//! Over 600 lines: perftest's control exchange and report, which must match perftest 4.5
//! byte for byte; the traffic is in `perftest/`.

mod bandwidth;
mod control;
mod latency;
mod params;
mod report;
mod session;
mod sockets;
mod timed;
mod traffic;
pub mod wire;

pub use params::DEF_PORT;
pub use report::LatReport;
pub use wire::BwReport;

use control::{
    accept, conn_param, connect_retry, next_request, CmControl, Control, CONNECT_PATIENCE,
};
use params::Params;
use report::RESULT_LINE;
use rnicpi::{QpType, Transport, VerbsError, WcStatus};
use session::Session;
use sockets::SocketControl;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;
use traffic::DataQp;
use ual::{Context, Listener};

/// How long a server waits for its client.
const ACCEPT_WAIT: Duration = Duration::from_secs(3600);
/// How long each step of the orderly close waits for the peer.
const CLOSE_WAIT: Duration = Duration::from_secs(2);
/// How long a Write server keeps checking data that may still be in flight.
const VALIDATE_PATIENCE: Duration = Duration::from_secs(5);
/// The client's pause between the control connection coming up and its first Send.
/// perftest's own clients leave milliseconds here (ib_write_bw sleeps a second); kernel
/// siw 6.1 as the passive side loses the wake-up of an FPDU that arrives before it has
/// handed the socket to the QP, which under emulation is a window of about a millisecond
/// (docs/interop.md). RFC 5044 allows sending at once; the pause only avoids that race.
const CONTROL_SETTLE: Duration = Duration::from_millis(100);

/// Which perftest program to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    WriteBw,
    ReadBw,
    SendBw,
    SendLat,
    WriteLat,
    ReadLat,
    AtomicBw,
    AtomicLat,
}

/// The operation a test measures (perftest's `VerbType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Send,
    Write,
    Read,
    Atomic,
}

/// The atomic operation of the atomic tests (`-A`; perftest's `atomicTypesStr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AtomicType {
    /// Compare 0, swap in 0.
    CmpAndSwap,
    /// Add 1.
    #[default]
    FetchAndAdd,
}

impl AtomicType {
    pub fn name(self) -> &'static str {
        match self {
            AtomicType::CmpAndSwap => "CMP_AND_SWAP",
            AtomicType::FetchAndAdd => "FETCH_AND_ADD",
        }
    }
}

impl Test {
    /// The perftest program this test speaks with.
    pub fn perftest_name(self) -> &'static str {
        match self {
            Test::WriteBw => "ib_write_bw",
            Test::ReadBw => "ib_read_bw",
            Test::SendBw => "ib_send_bw",
            Test::SendLat => "ib_send_lat",
            Test::WriteLat => "ib_write_lat",
            Test::ReadLat => "ib_read_lat",
            Test::AtomicBw => "ib_atomic_bw",
            Test::AtomicLat => "ib_atomic_lat",
        }
    }

    pub fn verb(self) -> Verb {
        match self {
            Test::SendBw | Test::SendLat => Verb::Send,
            Test::WriteBw | Test::WriteLat => Verb::Write,
            Test::ReadBw | Test::ReadLat => Verb::Read,
            Test::AtomicBw | Test::AtomicLat => Verb::Atomic,
        }
    }

    pub fn is_lat(self) -> bool {
        matches!(
            self,
            Test::SendLat | Test::WriteLat | Test::ReadLat | Test::AtomicLat
        )
    }

    /// Tests that take RDMA Read/atomic responder resources at the peer (IRD/ORD = `-o`).
    fn uses_reads(self) -> bool {
        matches!(self.verb(), Verb::Read | Verb::Atomic)
    }

    /// The server of these latency tests takes no part: it waits in the closing
    /// handshake while the client alone measures.
    fn server_idle(self) -> bool {
        matches!(self, Test::ReadLat | Test::AtomicLat)
    }

    fn is_send(self) -> bool {
        self.verb() == Verb::Send
    }

    /// perftest's `testsStr[verb]`.
    fn verb_name(self) -> &'static str {
        match self.verb() {
            Verb::Write => "RDMA_Write",
            Verb::Read => "RDMA_Read",
            Verb::Send => "Send",
            Verb::Atomic => "Atomic",
        }
    }
}

/// perftest's options (same meaning, same defaults when `None`).
#[derive(Debug, Clone)]
pub struct Options {
    pub test: Test,
    /// The server to connect to; `None` makes this side the server.
    pub server: Option<IpAddr>,
    /// `-p`: listen on / connect to this port (server: 0 picks one).
    pub port: u16,
    /// `-d`
    pub device: String,
    /// `-s`
    pub size: Option<u64>,
    /// `-n`
    pub iters: Option<u64>,
    /// `-a`: all sizes from 2 bytes to 8 MiB.
    pub all_sizes: bool,
    /// `-t`
    pub tx_depth: Option<u32>,
    /// `-r`
    pub rx_depth: Option<u32>,
    /// `-Q`
    pub cq_mod: Option<u32>,
    /// `-o`
    pub out_reads: Option<u32>,
    /// `-q`
    pub num_qps: u32,
    /// `--report_gbits`
    pub report_gbits: bool,
    /// `-N`
    pub no_peak: bool,
    /// `-A`: the operation of the atomic tests.
    pub atomic_type: AtomicType,
    /// `-m`: the path MTU in bytes (256 .. 4096; at most the port's active MTU). Default:
    /// the port's active MTU.
    pub mtu: Option<u32>,
    /// `-u`: the QP's local ACK timeout exponent (4.096 µs × 2^u) when QPs are connected
    /// by Modify QP (without `-R`).
    pub qp_timeout: u8,
    /// `-e`: wait for completions on CQ notifications instead of polling (not for Write
    /// tests, as perftest).
    pub use_event: bool,
    /// `-I`: Sends and Writes of at most this many bytes go inline (not for Read/atomic).
    pub inline_size: Option<u32>,
    /// `-x`: our GID (its index in the port's table): advertised in the records, and the
    /// source of the data QPs without rdma_cm. Default as perftest on Ethernet links: the
    /// first IPv4 GID. Informational over iWARP.
    pub gid_index: Option<usize>,
    /// `-R`: connect and exchange over rdma_cm (the only mode iWARP can run); else a TCP
    /// socket and Modify QP (IB/RoCE only).
    pub rdma_cm: bool,
    /// `-D`: run each side for this many seconds instead of `-n` iterations; only the
    /// middle part (after and before `-f` margin seconds) is measured.
    pub duration: Option<u32>,
    /// `-f`: the margin of a `-D` run (default: a quarter of the duration).
    pub margin: Option<u32>,
    /// `-l`: requests posted at once, as one list (bandwidth tests).
    pub post_list: u32,
    /// `-b`: bidirectional: both sides send (bandwidth tests).
    pub duplex: bool,
    /// krdma to krdma only: fill buffers with known patterns and check what arrives.
    pub validate: bool,
    /// `-c`: the data QPs' service type. RC; UC (Send and Write tests on IB/RoCE devices,
    /// without `-R`); UD (Send tests on IB/RoCE devices; with `-R` the control
    /// connection stays RC).
    pub connection: QpType,
}

impl Options {
    pub fn new(test: Test) -> Options {
        Options {
            test,
            server: None,
            port: DEF_PORT,
            device: "siw0".into(),
            size: None,
            iters: None,
            all_sizes: false,
            tx_depth: None,
            rx_depth: None,
            cq_mod: None,
            out_reads: None,
            num_qps: 1,
            report_gbits: false,
            no_peak: false,
            atomic_type: AtomicType::FetchAndAdd,
            mtu: None,
            qp_timeout: params::DEF_QP_TIMEOUT,
            use_event: false,
            inline_size: None,
            gid_index: None,
            rdma_cm: false,
            duration: None,
            margin: None,
            post_list: 1,
            duplex: false,
            validate: false,
            connection: QpType::Rc,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error("writing the report: {0}")]
    Output(#[from] std::io::Error),
    #[error("control socket: {0}")]
    Socket(std::io::Error),
    #[error("invalid options: {0}")]
    Options(String),
    #[error("peer sent {got} bytes for {what}, perftest sends {want}")]
    BadLength {
        what: &'static str,
        want: usize,
        got: usize,
    },
    #[error("protocol error: {0}")]
    Protocol(&'static str),
    #[error("peer's perftest version {0:?} is older than 5.70 (not compatible)")]
    Version(String),
    #[error("{what}: work request failed ({status:?}, vendor error {vendor_err:#x})")]
    Completion {
        what: &'static str,
        status: WcStatus,
        vendor_err: u32,
    },
    #[error("the connection closed while waiting for {0}")]
    PeerClosed(&'static str),
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    #[error("data check failed: {0}")]
    DataMismatch(String),
}

/// What a run reported (the lines it printed).
#[derive(Debug, Clone, Default)]
pub struct Summary {
    pub peer_version: String,
    /// Bandwidth lines: this side's, or (Write/Read server) the client's it printed.
    pub bw: Vec<BwReport>,
    pub lat: Vec<LatReport>,
    /// Timed latency lines (`-D`).
    pub timed_lat: Vec<report::TimedLat>,
    /// Data checked against the peer's pattern (`--validate`).
    pub validated: bool,
}

/// Run `o`: as the server when `o.server` is `None`, else as the client.
pub fn run(ctx: &Arc<Context>, o: &Options, out: &mut dyn Write) -> Result<Summary, PerfError> {
    match o.server {
        None => Server::listen(ctx, o)?.run(out),
        Some(ip) => client(ctx, o, SocketAddr::new(ip, o.port), out),
    }
}

/// A perftest server: listening (on all addresses) from [`Server::listen`] on.
pub struct Server {
    ctx: Arc<Context>,
    dev: u32,
    opts: Options,
    door: Door,
}

/// Where a server waits for its client.
enum Door {
    /// `-R`: rdma_cm connection requests (the control connection, then the data QPs).
    Cm(Arc<Listener>),
    /// A TCP socket for the exchange.
    Socket(TcpListener),
}

impl Server {
    pub fn listen(ctx: &Arc<Context>, o: &Options) -> Result<Server, PerfError> {
        let dev = ctx.device(&o.device)?.index;
        let any = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), o.port);
        let door = if o.rdma_cm {
            Door::Cm(ctx.listen(dev, any, o.num_qps + 1)?)
        } else {
            Door::Socket(TcpListener::bind(any).map_err(PerfError::Socket)?)
        };
        let server = Server {
            ctx: ctx.clone(),
            dev,
            opts: o.clone(),
            door,
        };
        tracing::info!(
            port = server.port(),
            rdma_cm = o.rdma_cm,
            test = o.test.perftest_name(),
            "perftest server listening"
        );
        Ok(server)
    }

    pub fn port(&self) -> u16 {
        match &self.door {
            Door::Cm(l) => l.port,
            Door::Socket(l) => l.local_addr().map_or(0, |a| a.port()),
        }
    }

    /// Serve one client, then return.
    pub fn run(self, out: &mut dyn Write) -> Result<Summary, PerfError> {
        let Server {
            ctx,
            dev,
            opts,
            door,
        } = self;
        let p = resolve(&ctx, dev, &opts, out)?;
        writeln!(out, "\n************************************")?;
        writeln!(out, "* Waiting for client to connect... *")?;
        writeln!(out, "************************************")?;
        let listener = match door {
            Door::Socket(l) => {
                let ctrl = SocketControl::accept(&l)?;
                drop(l);
                return over_socket(&ctx, dev, p, ctrl, &opts, out);
            }
            Door::Cm(l) => l,
        };
        let req = next_request(&listener, ACCEPT_WAIT)?;
        let ep = CmControl::endpoint(&ctx, dev)?;
        accept(&listener, &req, &ep, &conn_param(0), false)?;
        let ctrl = Control::Cm(CmControl::new(ep, false));
        let mut s = Session::new(p, ctrl, &opts, out);
        s.prologue()?;
        let mut qps = Vec::new();
        for _ in 0..s.p.num_qps {
            let req = next_request(&listener, CONNECT_PATIENCE)?;
            let dq = DataQp::new(DataQp::endpoint(&ctx, dev, &s.p)?, &s.p);
            if s.p.ud() {
                dq.ud_await_peer(&s.p)?;
            }
            accept(&listener, &req, &dq.ep, &s.data_param(), s.p.ud())?;
            if s.p.ud() {
                dq.ud_learn_peer(&s.p)?;
            }
            qps.push(dq);
        }
        drop(listener);
        s.run(qps)
    }
}

fn client(
    ctx: &Arc<Context>,
    o: &Options,
    peer: SocketAddr,
    out: &mut dyn Write,
) -> Result<Summary, PerfError> {
    let dev = ctx.device(&o.device)?.index;
    let p = resolve(ctx, dev, o, out)?;
    if !o.rdma_cm {
        let ctrl = SocketControl::connect(peer, CONNECT_PATIENCE)?;
        return over_socket(ctx, dev, p, ctrl, o, out);
    }
    let make = || CmControl::endpoint(ctx, dev);
    let (ep, _) = connect_retry(make, peer, &conn_param(0), CONNECT_PATIENCE)?;
    std::thread::sleep(CONTROL_SETTLE);
    let mut s = Session::new(p, Control::Cm(CmControl::new(ep, true)), o, out);
    s.prologue()?;
    let mut qps = Vec::new();
    for _ in 0..s.p.num_qps {
        let make = || DataQp::endpoint(ctx, dev, &s.p);
        let (ep, ev) = connect_retry(make, peer, &s.data_param(), CONNECT_PATIENCE)?;
        let dq = DataQp::new(ep, &s.p);
        if s.p.ud() {
            let server = ev.ud.ok_or(PerfError::Protocol(
                "the server answered -c UD with a connection",
            ))?;
            dq.ud_resolved(&s.p, peer.ip(), server.qpn, server.qkey)?;
        }
        qps.push(dq);
    }
    s.run(qps)
}

/// Without rdma_cm, either side: the exchange on `ctrl`; the data QPs are created after the
/// MTU exchange, as perftest does, and connected by Modify QP during the handshakes.
fn over_socket(
    ctx: &Arc<Context>,
    dev: u32,
    p: Params,
    ctrl: SocketControl,
    o: &Options,
    out: &mut dyn Write,
) -> Result<Summary, PerfError> {
    let mut s = Session::new(p, Control::Sockets(ctrl), o, out);
    s.prologue()?;
    let qps = DataQp::unconnected(ctx, dev, &s.p)?;
    s.run(qps)
}

/// Parameters from the options and the device (`check_link`, `set_up_connection`).
fn resolve(
    ctx: &Arc<Context>,
    dev: u32,
    o: &Options,
    out: &mut dyn Write,
) -> Result<Params, PerfError> {
    if o.test.is_lat() && o.num_qps != 1 {
        return Err(PerfError::Options("latency tests use one QP".into()));
    }
    let info = ctx.query_device(dev)?;
    let port = ctx.query_port(dev, 1)?;
    let mtu = path_mtu(o.mtu, port.active_mtu, out)?;
    let mut p = Params::resolve(o, info.attr.max_ord, wire::mtu_enum(mtu), info.transport)?;
    if p.cq_mod_from_list {
        writeln!(out, "{RESULT_LINE}")?;
        writeln!(
            out,
            "Post List requested - CQ moderation will be the size of the post list"
        )?;
    }
    p.gid_index = o.gid_index.unwrap_or_else(|| best_gid_index(&port.gids));
    p.gid = match port.gids.get(p.gid_index) {
        Some(g) => *g,
        // Informational over iWARP; the source address of every packet over IB.
        None if info.transport == Transport::Iwarp => [0; 16],
        None => {
            return Err(PerfError::Options(format!(
                "{} has no GID index {} ({} GIDs)",
                o.device,
                p.gid_index,
                port.gids.len()
            )))
        }
    };
    Ok(p)
}

/// perftest's `set_mtu`: the port's active MTU, or the one `-m` asks for (one of the IB
/// MTUs, and no larger than the active one: both corrected with perftest's messages).
fn path_mtu(asked: Option<u32>, active: u32, out: &mut dyn Write) -> Result<u32, PerfError> {
    let Some(m) = asked else {
        return Ok(active);
    };
    if ![256, 512, 1024, 2048, 4096].contains(&m) {
        eprintln!(" Invalid MTU - {m} ");
        eprintln!(" Please choose mtu from {{256,512,1024,2048,4096}}");
        eprintln!(" Will run with the port active mtu - {active}");
        return Ok(active);
    }
    if m > active {
        writeln!(out, "Requested mtu is higher than active mtu ")?;
        writeln!(out, "Changing to active mtu - {active}")?;
        return Ok(active);
    }
    Ok(m)
}

/// perftest's `get_best_gid_index` without `-x` on an Ethernet link: the first IPv4 GID
/// (`::ffff:a.b.c.d`), else index 0.
fn best_gid_index(gids: &[[u8; 16]]) -> usize {
    gids.iter().position(is_ipv4_gid).unwrap_or(0)
}

fn is_ipv4_gid(g: &[u8; 16]) -> bool {
    std::net::Ipv6Addr::from(*g).to_ipv4_mapped().is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_as_perftest_sets_it() {
        let mut out = Vec::new();
        assert_eq!(path_mtu(None, 4096, &mut out).unwrap(), 4096);
        assert_eq!(path_mtu(Some(1024), 4096, &mut out).unwrap(), 1024);
        assert_eq!(path_mtu(Some(3000), 2048, &mut out).unwrap(), 2048);
        assert!(out.is_empty());
        assert_eq!(path_mtu(Some(4096), 1024, &mut out).unwrap(), 1024);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "Requested mtu is higher than active mtu \nChanging to active mtu - 1024\n"
        );
    }
}
