//! `krdma` — the command line of the krdma stack.
//!
//! Over 600 lines: one small function per subcommand over `tools` and the uAL, beside the
//! one table of commands they answer.

use clap::{Parser, Subcommand};
use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, Table};
use std::sync::Arc;
use tools::perf::{self, Op, ReaderWait};
use ual::{Context, Target};

#[derive(Parser)]
#[command(
    name = "krdma",
    version,
    about = "krdma: a user-space RDMA stack (iWARP and RoCEv2) with the OpenRDMA layering"
)]
struct Cli {
    /// kAL front door: a device path served by krdmad, or `embedded` (default: /dev/krdma
    /// when a daemon serves it, embedded otherwise).
    #[arg(long, global = true, env = "KRDMA_DEVICE")]
    kal: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// List devices with their transport, GUID, GIDs, port state and limits (like ibv_devinfo).
    Devices,
    /// Resources, pinned memory and counters per context and per device.
    Stat,
    /// Run RDMA traffic over loopback and compare it with raw TCP measured in the same run.
    Demo {
        /// Device to run on; `all` runs every device (siw0 against raw TCP, rxe0 against
        /// raw UDP with datagrams of its path MTU).
        #[arg(long, default_value = "all")]
        device: String,
        /// Bytes per bandwidth test.
        #[arg(long, default_value_t = 256 << 20)]
        bytes: u64,
        #[arg(long, default_value_t = 5000)]
        iters: u32,
        /// Print each device's table as Markdown, and nothing else (scripts/bench.sh).
        #[arg(long)]
        markdown: bool,
    },
    /// rdma_cm ping with RDMA Read/Write and data check, interoperable with rdma-core's rping.
    Rping(RpingArgs),
    /// RC ping-pong with the out-of-band handshake of rdma-core's ibv_rc_pingpong (IB/RoCE
    /// devices: an iWARP QP reaches RTS only through connection management).
    Pingpong(PingpongArgs),
    /// UC ping-pong, interoperable with rdma-core's ibv_uc_pingpong (IB/RoCE devices).
    UcPingpong(PingpongArgs),
    /// UD ping-pong, interoperable with rdma-core's ibv_ud_pingpong (IB/RoCE devices).
    UdPingpong(UdPingpongArgs),
    /// UD service resolution and datagrams, interoperable with librdmacm's udaddy (rdma_cm
    /// UDP port space over the IB CM's SIDR; IB/RoCE devices).
    Udaddy(UdaddyArgs),
    /// perftest, wire-compatible with `ib_write_bw` and friends (perftest 4.5): with -R over
    /// rdma_cm (siw0, rxe0), without it over a TCP socket and Modify QP (rxe0).
    #[command(subcommand)]
    Perf(PerfCmd),
    /// Print the dat.conf lines of krdma's uDAPL provider (one per device); with
    /// --install, put them into a dat.conf (idempotent; other providers' lines kept).
    DatConf {
        /// The provider library (default: libdaplkrdma.so beside this program).
        #[arg(long)]
        lib: Option<std::path::PathBuf>,
        /// Write the lines into the dat.conf.
        #[arg(long)]
        install: bool,
        /// The dat.conf to install into.
        #[arg(long, default_value = "/etc/dat.conf")]
        conf: std::path::PathBuf,
    },
}

/// What rdma-core's `ibv_rc_pingpong` and `ibv_ud_pingpong` share, same letters.
#[derive(clap::Args)]
struct PingpongCommon {
    /// Listen on / connect to this TCP port.
    #[arg(short = 'p', long = "port", default_value_t = tools::pingpong::DEFAULT_PORT)]
    port: u16,
    /// Device (default rxe0).
    #[arg(short = 'd', long = "ib-dev", default_value = "rxe0")]
    device: String,
    #[arg(short = 'i', long = "ib-port", default_value_t = 1)]
    ib_port: u8,
    /// Receives posted at a time.
    #[arg(short = 'r', long = "rx-depth", default_value_t = 500)]
    rx_depth: u32,
    /// Exchanges.
    #[arg(short = 'n', long = "iters", default_value_t = 1000)]
    iters: u32,
    /// Local GID index.
    #[arg(short = 'g', long = "gid-idx", default_value_t = 0)]
    gid_index: u8,
    /// Server to connect to (none: be the server).
    servername: Option<String>,
}

impl PingpongCommon {
    fn options(self, size: u32) -> tools::pingpong::Options {
        tools::pingpong::Options {
            server: self.servername,
            port: self.port,
            device: self.device,
            ib_port: self.ib_port,
            size,
            rx_depth: self.rx_depth,
            iters: self.iters,
            gid_index: self.gid_index,
            ..Default::default()
        }
    }
}

/// The options of `ibv_rc_pingpong`.
#[derive(clap::Args)]
struct PingpongArgs {
    #[command(flatten)]
    common: PingpongCommon,
    /// Message size.
    #[arg(short = 's', long = "size", default_value_t = 4096)]
    size: u32,
    /// Path MTU.
    #[arg(short = 'm', long = "mtu", default_value_t = 1024)]
    mtu: u32,
}

/// The options of `ibv_ud_pingpong` (no MTU: a datagram is at most the port's).
#[derive(clap::Args)]
struct UdPingpongArgs {
    #[command(flatten)]
    common: PingpongCommon,
    /// Message size (at most the port's MTU).
    #[arg(short = 's', long = "size", default_value_t = 1024)]
    size: u32,
}

/// The options of librdmacm's `udaddy`, same letters.
#[derive(clap::Args)]
struct UdaddyArgs {
    /// The server to connect to (none: be the server).
    #[arg(short = 's')]
    server: Option<std::net::IpAddr>,
    /// The server's address to listen on.
    #[arg(short = 'b')]
    bind: Option<std::net::IpAddr>,
    #[arg(short = 'p', default_value_t = tools::udaddy::DEFAULT_PORT)]
    port: u16,
    /// Messages each way.
    #[arg(short = 'C', default_value_t = 10)]
    count: u32,
    /// Message size.
    #[arg(short = 'S', default_value_t = 100)]
    size: u32,
    /// Device.
    #[arg(long, default_value = "rxe0")]
    device: String,
}

/// The perftest programs, each with perftest's option letters.
#[derive(Subcommand)]
enum PerfCmd {
    /// Like `ib_write_bw`: RDMA Write bandwidth.
    WriteBw(PerfArgs),
    /// Like `ib_read_bw`: RDMA Read bandwidth.
    ReadBw(PerfArgs),
    /// Like `ib_send_bw`: Send bandwidth (over iWARP with receive credits, as perftest).
    SendBw(PerfArgs),
    /// Like `ib_send_lat`: Send ping-pong latency.
    SendLat(PerfArgs),
    /// Like `ib_write_lat`: RDMA Write ping-pong latency.
    WriteLat(PerfArgs),
    /// Like `ib_read_lat`: RDMA Read latency (the client reads, the server waits).
    ReadLat(PerfArgs),
    /// Like `ib_atomic_bw`: atomic bandwidth (IB/RoCE: rxe0; iWARP has no atomics).
    AtomicBw(PerfArgs),
    /// Like `ib_atomic_lat`: atomic latency (the client runs them, the server waits).
    AtomicLat(PerfArgs),
}

/// perftest's options (same letters and long names; defaults as perftest's).
#[derive(clap::Args)]
struct PerfArgs {
    /// Server to connect to; without it this side is the server.
    server: Option<std::net::IpAddr>,
    /// RDMA device.
    #[arg(short = 'd', long = "ib-dev", default_value = "siw0")]
    device: String,
    /// Port of the rdma_cm connections, or of the TCP socket without -R.
    #[arg(short = 'p', long = "port", default_value_t = tools::perftest::DEF_PORT)]
    port: u16,
    /// Message size (default 65536 for bandwidth tests, 2 for latency).
    #[arg(short = 's', long = "size")]
    size: Option<u64>,
    /// Iterations (default 5000 for bandwidth tests, 1000 for latency).
    #[arg(short = 'n', long = "iters")]
    iters: Option<u64>,
    /// Run all sizes from 2 bytes to 8 MiB.
    #[arg(short = 'a', long = "all")]
    all: bool,
    /// Send queue depth (default 128, latency 1).
    #[arg(short = 't', long = "tx-depth")]
    tx_depth: Option<u32>,
    /// Receive queue depth of Send tests (default 512).
    #[arg(short = 'r', long = "rx-depth")]
    rx_depth: Option<u32>,
    /// Completion every this many requests (default 100).
    #[arg(short = 'Q', long = "cq-mod")]
    cq_mod: Option<u32>,
    /// Outstanding RDMA Reads (default: the device's maximum).
    #[arg(short = 'o', long = "outs")]
    out_reads: Option<u32>,
    /// Number of data QPs (bandwidth tests).
    #[arg(short = 'q', long = "qp", default_value_t = 1)]
    qps: u32,
    /// Connect and exchange over rdma_cm (required on iWARP devices such as siw0); without
    /// it a TCP socket carries the exchange and the QPs connect by Modify QP (IB/RoCE).
    #[arg(short = 'R', long = "rdma_cm")]
    rdma_cm: bool,
    /// Accepted and ignored (perftest: do not fail on CPU frequency warnings).
    #[arg(short = 'F', long = "CPU-freq")]
    _cpu_freq: bool,
    /// GID index: advertised in the exchange and, without -R, the source of the data QPs
    /// (default: the first IPv4 GID; informational over iWARP).
    #[arg(short = 'x', long = "gid-index")]
    gid_index: Option<usize>,
    /// Skip the peak bandwidth computation.
    #[arg(short = 'N', long = "noPeak")]
    no_peak: bool,
    /// Report Gb/s instead of MB/s (MB = 2^20 bytes).
    #[arg(long = "report_gbits")]
    report_gbits: bool,
    /// krdma to krdma only: fill buffers with known patterns and check the data received.
    #[arg(long)]
    validate: bool,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (at most the port's active MTU; default it).
    #[arg(short = 'm', long = "mtu")]
    mtu: Option<u32>,
    /// QP local ACK timeout exponent (4.096 µs × 2^N) of QPs connected without -R.
    #[arg(short = 'u', long = "qp-timeout", default_value_t = 14)]
    qp_timeout: u8,
    /// Wait for completions on CQ events instead of polling (not for Write tests).
    #[arg(short = 'e', long = "events")]
    events: bool,
    /// Send and Write messages up to this many bytes go inline (not for Read/atomic).
    #[arg(short = 'I', long = "inline_size")]
    inline_size: Option<u32>,
    /// The atomic tests' operation: CMP_AND_SWAP or FETCH_AND_ADD (the default).
    #[arg(short = 'A', long = "atomic_type", value_parser = ["CMP_AND_SWAP", "FETCH_AND_ADD"])]
    atomic_type: Option<String>,
    /// Run for this many seconds instead of a number of iterations (both sides).
    #[arg(short = 'D', long = "duration", value_parser = clap::value_parser!(u32).range(1..))]
    duration: Option<u32>,
    /// Seconds at each end of a -D run left out of the measurement (default: a quarter).
    #[arg(short = 'f', long = "margin")]
    margin: Option<u32>,
    /// Post this many requests at once, as one list (bandwidth tests).
    #[arg(short = 'l', long = "post_list", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    post_list: u32,
    /// Bidirectional: both sides send (bandwidth tests; both sides give -b).
    #[arg(short = 'b', long = "bidirectional")]
    bidirectional: bool,
    /// Connection type: RC; UC for the Send and Write tests on IB/RoCE devices (without
    /// -R, as perftest); UD for send-bw and send-lat on IB/RoCE devices (with or without
    /// -R); the others are refused.
    #[arg(short = 'c', long = "connection", value_parser = ["RC", "UC", "UD", "XRC", "DC", "SRD"])]
    connection: Option<String>,
}

/// The options of rdma-core's `rping`, same letters.
#[derive(clap::Args)]
struct RpingArgs {
    /// Server side.
    #[arg(
        short = 's',
        conflicts_with = "client",
        required_unless_present = "client"
    )]
    server: bool,
    /// Client side.
    #[arg(short = 'c')]
    client: bool,
    /// Address to listen on (server; default any) or connect to (client).
    #[arg(short = 'a')]
    addr: Option<std::net::IpAddr>,
    #[arg(short = 'p', default_value_t = tools::rping::DEFAULT_PORT)]
    port: u16,
    /// Pings to run (client; 0 = until interrupted).
    #[arg(short = 'C', default_value_t = 0)]
    count: u32,
    /// Ping data size.
    #[arg(short = 'S', default_value_t = 64)]
    size: usize,
    /// Print the ping data.
    #[arg(short = 'v')]
    verbose: bool,
    /// Validate the ping data.
    #[arg(short = 'V')]
    validate: bool,
    #[arg(long, default_value = "siw0")]
    device: String,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let target = match cli.kal.as_deref() {
        Some("embedded") => Target::Embedded,
        Some(p) if !p.is_empty() => Target::Device(p.into()),
        _ => Target::from_env(),
    };
    if let Err(e) = run(cli.cmd, &target) {
        eprintln!("krdma: {e}");
        std::process::exit(1);
    }
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(header.iter().map(Cell::new));
    t
}

fn run(cmd: Cmd, target: &Target) -> Result<(), Box<dyn std::error::Error>> {
    match cmd {
        Cmd::Devices => devices(&Context::open_target(target)?),
        Cmd::Stat => stat(&Context::open_target(target)?),
        Cmd::Demo {
            device,
            bytes,
            iters,
            markdown,
        } => demo(target, &device, bytes, iters, markdown),
        Cmd::Rping(a) => rping(target, a),
        Cmd::Pingpong(a) => pingpong(target, a, rnicpi::QpType::Rc),
        Cmd::UcPingpong(a) => pingpong(target, a, rnicpi::QpType::Uc),
        Cmd::UdPingpong(a) => {
            let o = tools::pingpong::Options {
                qp_type: rnicpi::QpType::Ud,
                ..a.common.options(a.size)
            };
            let ctx = Context::open_target(target)?;
            tools::pingpong::run(&ctx, &o, &mut std::io::stdout())?;
            Ok(())
        }
        Cmd::Udaddy(a) => {
            let o = tools::udaddy::Options {
                server: a.server,
                bind: a.bind,
                port: a.port,
                device: a.device,
                count: a.count,
                size: a.size,
            };
            let ctx = Context::open_target(target)?;
            tools::udaddy::run(&ctx, &o, &mut std::io::stdout())?;
            Ok(())
        }
        Cmd::Perf(t) => perftest(target, t),
        Cmd::DatConf { lib, install, conf } => dat_conf(target, lib, install, &conf),
    }
}

fn perftest(target: &Target, cmd: PerfCmd) -> Result<(), Box<dyn std::error::Error>> {
    use tools::perftest::{AtomicType, Options, Test, Verb};
    let (test, a) = match cmd {
        PerfCmd::WriteBw(a) => (Test::WriteBw, a),
        PerfCmd::ReadBw(a) => (Test::ReadBw, a),
        PerfCmd::SendBw(a) => (Test::SendBw, a),
        PerfCmd::SendLat(a) => (Test::SendLat, a),
        PerfCmd::WriteLat(a) => (Test::WriteLat, a),
        PerfCmd::ReadLat(a) => (Test::ReadLat, a),
        PerfCmd::AtomicBw(a) => (Test::AtomicBw, a),
        PerfCmd::AtomicLat(a) => (Test::AtomicLat, a),
    };
    let atomic_type = match a.atomic_type.as_deref() {
        None => AtomicType::FetchAndAdd,
        Some(_) if test.verb() != Verb::Atomic => {
            return Err("-A: the atomic type applies to atomic-bw and atomic-lat only".into())
        }
        Some("CMP_AND_SWAP") => AtomicType::CmpAndSwap,
        Some(_) => AtomicType::FetchAndAdd,
    };
    let connection = match a.connection.as_deref() {
        None | Some("RC") => rnicpi::QpType::Rc,
        Some("UC") => rnicpi::QpType::Uc,
        Some("UD") => rnicpi::QpType::Ud,
        Some(c) => {
            return Err(format!(
                "-c {c}: krdma's perftest runs RC, UC and UD (as the test and device allow); \
                 {c} is not supported"
            )
            .into())
        }
    };
    let opts = Options {
        server: a.server,
        port: a.port,
        device: a.device,
        size: a.size,
        iters: a.iters,
        all_sizes: a.all,
        tx_depth: a.tx_depth,
        rx_depth: a.rx_depth,
        cq_mod: a.cq_mod,
        out_reads: a.out_reads,
        num_qps: a.qps,
        report_gbits: a.report_gbits,
        no_peak: a.no_peak,
        gid_index: a.gid_index,
        rdma_cm: a.rdma_cm,
        validate: a.validate,
        atomic_type,
        mtu: a.mtu,
        qp_timeout: a.qp_timeout,
        use_event: a.events,
        inline_size: a.inline_size,
        duration: a.duration,
        margin: a.margin,
        post_list: a.post_list,
        duplex: a.bidirectional,
        connection,
        ..Options::new(test)
    };
    let ctx = Context::open_target(target)?;
    let mut out = std::io::stdout();
    tools::perftest::run(&ctx, &opts, &mut out)?;
    Ok(())
}

/// `ibv_rc_pingpong` or `ibv_uc_pingpong` (`qp_type`).
fn pingpong(
    target: &Target,
    a: PingpongArgs,
    qp_type: rnicpi::QpType,
) -> Result<(), Box<dyn std::error::Error>> {
    let o = tools::pingpong::Options {
        mtu: a.mtu,
        qp_type,
        ..a.common.options(a.size)
    };
    let ctx = Context::open_target(target)?;
    tools::pingpong::run(&ctx, &o, &mut std::io::stdout())?;
    Ok(())
}

fn rping(target: &Target, a: RpingArgs) -> Result<(), Box<dyn std::error::Error>> {
    let addr = match (a.addr, a.server) {
        (Some(ip), _) => ip,
        (None, true) => std::net::Ipv4Addr::UNSPECIFIED.into(),
        (None, false) => return Err("rping: the client needs -a ADDR".into()),
    };
    let opts = tools::rping::Options {
        server: a.server,
        addr,
        port: a.port,
        count: a.count,
        size: a.size,
        verbose: a.verbose,
        validate: a.validate,
        device: a.device,
    };
    let ctx = Context::open_target(target)?;
    let pings = tools::rping::run(&ctx, &opts, &mut std::io::stdout())?;
    eprintln!("krdma rping: {pings} pings done");
    Ok(())
}

fn gid_str(g: &[u8; 16]) -> String {
    g.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

fn dat_conf(
    target: &Target,
    lib: Option<std::path::PathBuf>,
    install: bool,
    conf: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let lib = match lib {
        Some(l) => l,
        None => std::env::current_exe()?
            .parent()
            .ok_or("no directory for this program")?
            .join("libdaplkrdma.so"),
    };
    let lib = std::fs::canonicalize(&lib).map_err(|e| {
        format!(
            "{}: {e} (build it: cargo build --release -p krdma-dapl-provider)",
            lib.display()
        )
    })?;
    let names: Vec<String> = Context::open_target(target)?
        .devices()?
        .into_iter()
        .map(|d| d.name)
        .collect();
    let lines = tools::datconf::lines(&names, &lib);
    if install {
        let changed = tools::datconf::install(conf, &lines)?;
        let what = if changed {
            "installed into"
        } else {
            "already in"
        };
        eprintln!("{} entries {what} {}", names.len(), conf.display());
    }
    tools::write_out(format_args!("{lines}"));
    Ok(())
}

fn devices(ctx: &Arc<Context>) -> Result<(), Box<dyn std::error::Error>> {
    let devs = ctx.devices()?;
    if devs.is_empty() {
        tools::outln!("no devices");
    }
    for d in devs {
        let q = &d.attr;
        tools::outln!("hca_id: {}", d.name);
        tools::outln!(
            "\ttransport:\t\t{} ({})",
            d.transport.name(),
            d.transport as u8
        );
        tools::outln!(
            "\tnode_guid:\t\t{:04x}:{:04x}:{:04x}:{:04x}",
            d.node_guid >> 48,
            (d.node_guid >> 32) & 0xffff,
            (d.node_guid >> 16) & 0xffff,
            d.node_guid & 0xffff
        );
        tools::outln!("\tvendor_id:\t\t{:#06x}", q.vendor_id);
        tools::outln!(
            "\tmax_qp:\t\t\t{}\n\tmax_qp_wr:\t\t{}\n\tmax_sge:\t\t{}\n\tmax_inline:\t\t{}",
            q.max_qp,
            q.max_qp_wr,
            q.max_sge,
            q.max_inline
        );
        tools::outln!(
            "\tmax_cq:\t\t\t{}\n\tmax_cqe:\t\t{}\n\tmax_mr:\t\t\t{}\n\tmax_mr_size:\t\t{:#x}",
            q.max_cq,
            q.max_cqe,
            q.max_mr,
            q.max_mr_size
        );
        tools::outln!(
            "\tmax_pd:\t\t\t{}\n\tmax_ird/ord:\t\t{}/{}\n\tatomics:\t\t{}",
            q.max_pd,
            q.max_ird,
            q.max_ord,
            if q.atomics { "yes" } else { "no" }
        );
        tools::outln!(
            "\tmax_srq:\t\t{}\n\tmax_srq_wr:\t\t{}\n\tmemory_windows:\t\t{}\n\tmax_ah:\t\t\t{}",
            q.max_srq,
            q.max_srq_wr,
            if q.memory_windows { "yes" } else { "no" },
            q.max_ah
        );
        tools::outln!(
            "\tprivate data:\t\tconnect {} / accept {} / reject {} bytes",
            q.private_data.connect,
            q.private_data.accept,
            q.private_data.reject
        );
        match &q.fast_path {
            rnicpi::FastPath::Kal => {
                tools::outln!("\tfast path:\t\tshared rings to the kAL's engine")
            }
            rnicpi::FastPath::Consumer { driver, device } => {
                tools::outln!("\tfast path:\t\tin the consumer, through {driver} ({device})")
            }
            rnicpi::FastPath::Either { driver, device } => tools::outln!(
                "\tfast path:\t\tin the consumer, through {driver} ({device}), \
                 or shared rings to the kAL's engine (KRDMA_FAST_PATH=kal)"
            ),
        }
        tools::outln!("\tphys_port_cnt:\t\t{}", q.phys_port_cnt);
        for port in 1..=q.phys_port_cnt {
            let p = ctx.query_port(d.index, port)?;
            tools::outln!("\t\tport:\t{port}");
            tools::outln!("\t\t\tstate:\t\t{:?}", p.state);
            tools::outln!("\t\t\tactive_mtu:\t{}", p.active_mtu);
            tools::outln!("\t\t\tnetdev:\t\t{}", p.netdev);
            for (i, g) in p.gids.iter().enumerate() {
                tools::outln!(
                    "\t\t\tGID[{i:2}]:\t{}  ({})",
                    gid_str(g),
                    rnicpi::gid_to_ip(*g)
                );
            }
        }
    }
    Ok(())
}

fn stat(ctx: &Arc<Context>) -> Result<(), Box<dyn std::error::Error>> {
    let (head, rows) = ctx.stat_contexts()?;
    tools::outln!(
        "kAL: {} context(s), {} pinned bytes in all (this one is context {})",
        head.total,
        head.pinned_total,
        ctx.id()
    );
    let mut t = table(&[
        "ctx",
        "pid",
        "uid",
        "PDs",
        "CQs",
        "QPs",
        "SRQs",
        "MRs",
        "MWs",
        "AHs",
        "listeners",
        "pinned",
        "events queued",
        "events dropped",
    ]);
    for r in rows {
        t.add_row(vec![
            r.id.to_string(),
            r.pid.to_string(),
            r.uid.to_string(),
            r.pds.to_string(),
            r.cqs.to_string(),
            r.qps.to_string(),
            r.srqs.to_string(),
            r.mrs.to_string(),
            r.mws.to_string(),
            r.ahs.to_string(),
            r.listeners.to_string(),
            r.pinned_bytes.to_string(),
            r.events_queued.to_string(),
            r.events_dropped.to_string(),
        ]);
    }
    tools::outln!("{t}");
    for d in ctx.devices()? {
        tools::outln!("{}:\n{}", d.name, counter_table(ctx.stat_device(d.index)?));
        if let Some(counters) = ctx.stat_in_process(d.index) {
            let t = counter_table(counters);
            tools::outln!("{}, the engine in this process:\n{t}", d.name);
        }
    }
    let t = counter_table(ctx.stat_kal()?);
    tools::outln!(
        "kAL (quotas, refused rings and doorbells, requests not from a context's opener, \
         refused registrations and ports, consumers' rings):\n{t}"
    );
    Ok(())
}

/// A two-column table of named counters.
fn counter_table(counters: Vec<(String, u64)>) -> Table {
    let mut t = table(&["counter", "value"]);
    for (n, v) in counters {
        t.add_row(vec![n, v.to_string()]);
    }
    t
}

fn gbits(bps: f64) -> String {
    format!("{:.2} Gbit/s", bps * 8.0 / 1e9)
}

fn demo(
    target: &Target,
    device: &str,
    bytes: u64,
    iters: u32,
    markdown: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let server = Context::open_target(target)?;
    let client = Context::open_target(target)?;
    let devices: Vec<ual::DeviceInfo> = match device {
        "all" => server.devices()?,
        name => vec![server.device(name).map_err(|e| {
            let there: Vec<String> = server
                .devices()
                .map(|d| d.into_iter().map(|d| d.name).collect())
                .unwrap_or_default();
            format!("{name}: {e} (devices here: {})", there.join(", "))
        })?],
    };
    for dev in &devices {
        demo_device(target, &server, &client, dev, bytes, iters, markdown)?;
    }
    if !markdown {
        stat(&server)?;
    }
    Ok(())
}

/// The baseline a device's figures are measured against, in the same run.
enum Baseline {
    /// iWARP runs over TCP.
    Tcp,
    /// RoCEv2 runs over UDP: datagrams of the path MTU (the demo's QPs connect over
    /// loopback, so `lo`'s).
    Udp { datagram: usize },
}

impl Baseline {
    fn name(&self) -> &'static str {
        match self {
            Baseline::Tcp => "raw TCP (same run)",
            Baseline::Udp { .. } => "raw UDP (same run)",
        }
    }
    fn bandwidth(&self, msg: usize, total: u64) -> std::io::Result<f64> {
        match self {
            Baseline::Tcp => perf::tcp_bandwidth(msg, total),
            Baseline::Udp { datagram } => perf::udp_bandwidth(*datagram, total),
        }
    }
    /// UDP also has a batched baseline: the same datagrams with the kernel's segmentation
    /// offload and GRO, which rxe0 uses to this host.
    fn batched_name(&self) -> Option<&'static str> {
        match self {
            Baseline::Tcp => None,
            Baseline::Udp { .. } => Some("raw UDP, GSO/GRO (same run)"),
        }
    }
    fn batched_bandwidth(&self, total: u64) -> Option<std::io::Result<f64>> {
        match self {
            Baseline::Tcp => None,
            Baseline::Udp { datagram } => Some(perf::udp_gso_bandwidth(*datagram, total)),
        }
    }
    fn pingpong(&self, size: usize, iters: u32, wait: ReaderWait) -> std::io::Result<Vec<f64>> {
        match self {
            Baseline::Tcp => perf::tcp_pingpong(size, iters, wait),
            Baseline::Udp { .. } => perf::udp_pingpong(size, iters, wait),
        }
    }
}

fn demo_device(
    target: &Target,
    server: &Arc<Context>,
    client: &Arc<Context>,
    dev: &ual::DeviceInfo,
    bytes: u64,
    iters: u32,
    markdown: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let device = dev.name.as_str();
    let base = match dev.transport {
        ual::Transport::Iwarp => Baseline::Tcp,
        ual::Transport::Ib => Baseline::Udp {
            datagram: perf::loopback_path_mtu() as usize,
        },
    };
    // Through krdmad, where the engine runs: the daemon's, or this process's (siw0).
    let engine = match (server.is_embedded(), server.device_in_process(dev.index)?) {
        (true, _) => "",
        (false, true) => ", engine in this process",
        (false, false) => ", engine in krdmad",
    };
    let heading = format!(
        "krdma demo: {device} ({}) over loopback, kAL front door: {}{engine}",
        dev.transport.name(),
        target.describe()
    );
    let mut columns = vec!["test", "krdma", base.name(), "ratio"];
    if let Some(batched) = base.batched_name() {
        columns.extend([batched, "ratio"]);
    }
    let mut t = table(&columns);
    if markdown {
        t.load_preset(comfy_table::presets::ASCII_MARKDOWN);
        tools::outln!("#### {heading}\n");
    } else {
        tools::outln!("{heading}");
    }
    for msg in [64u32 << 10, 1 << 20] {
        let (s, c) = perf::connect_pair(server, client, device, msg as usize, 4096)?;
        for (op, name) in [
            (Op::Write, "RDMA Write"),
            (Op::Send, "Send"),
            (Op::Read, "RDMA Read"),
        ] {
            let rdma = perf::bandwidth(&s, &c, op, msg, bytes, 16)?;
            let raw = base.bandwidth(msg as usize, bytes)?;
            let mut row = vec![
                format!("{name} BW, {} KiB", msg >> 10),
                gbits(rdma),
                gbits(raw),
                format!("{:.2}x", rdma / raw),
            ];
            match base.batched_bandwidth(bytes) {
                Some(Ok(b)) => row.extend([gbits(b), format!("{:.2}x", rdma / b)]),
                // A kernel without UDP GSO/GRO (before Linux 5.0): that baseline only.
                Some(Err(e)) => {
                    eprintln!("krdma demo: no raw UDP GSO/GRO baseline: {e}");
                    row.extend(["—".to_string(), "—".to_string()]);
                }
                None => {}
            }
            t.add_row(row);
        }
    }
    let (s, c) = perf::connect_pair(server, client, device, 4096, 32)?;
    let lat = perf::pingpong(&s, &c, 8, iters)?;
    // The baseline waits as krdma's consumer does (polling, then asleep) for the
    // like-for-like figure; the one asleep in every read is what a plain socket program
    // pays.
    let polled = base.pingpong(8, iters, ReaderWait::Poll)?;
    let asleep = base.pingpong(8, iters, ReaderWait::Sleep)?;
    for (label, raw, p) in [
        ("median", &polled, 50.0),
        ("p99", &polled, 99.0),
        ("median; baseline asleep in read", &asleep, 50.0),
        ("p99; baseline asleep in read", &asleep, 99.0),
    ] {
        let (l, r) = (perf::percentile(&lat, p), perf::percentile(raw, p));
        let mut row = vec![
            format!("8 B Send ping-pong, one-way ({label})"),
            format!("{l:.2} µs"),
            format!("{r:.2} µs"),
            format!("{:+.2} µs", l - r),
        ];
        if base.batched_name().is_some() {
            row.extend([String::new(), String::new()]);
        }
        t.add_row(row);
    }
    tools::outln!("{t}");
    if markdown {
        tools::outln!();
    }
    Ok(())
}
