//! `krdmad` — the krdma kernel access layer as a daemon, serving `/dev/krdma`.

use clap::Parser;
use kal::creds::cap;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "krdmad",
    version,
    about = "The krdma kernel access layer: serves /dev/krdma (a FUSE mount) for every process"
)]
struct Args {
    /// Where to serve the device.
    #[arg(long, env = "KRDMA_DEVICE", default_value = "/dev/krdma")]
    device: PathBuf,
    /// Bind siw0 to this interface (default: every host address).
    #[arg(long, env = "KRDMA_SIW_NETDEV")]
    siw_netdev: Option<String>,
    /// Require MPA CRC32c on siw connections.
    #[arg(long)]
    siw_crc_required: bool,
    /// Serve rxe0 on this IPv4 address only (default: every address).
    #[arg(long, env = "KRDMA_RXE_ADDR")]
    rxe_addr: Option<std::net::Ipv4Addr>,
    /// Event records one context may have queued.
    #[arg(long, default_value_t = 4096)]
    event_queue: usize,
    /// A per-user quota, NAME=VALUE (repeatable): contexts, pds, cqs, qps, srqs, mrs,
    /// mws, listeners, mappings, mapped_bytes, threads, connections, half_open.
    #[arg(long = "quota", value_name = "NAME=VALUE")]
    quotas: Vec<String>,
    /// A limit over all users together, NAME=VALUE (repeatable; the same names).
    #[arg(long = "limit", value_name = "NAME=VALUE")]
    limits: Vec<String>,
    /// Nice value of krdmad's threads (and of its session's scheduling group when krdmad
    /// leads its session): below a consumer's, so that the engines, which do a kernel's
    /// network work, get a CPU ahead of consumers polling for their completions; 0 leaves
    /// it as started.
    #[arg(long, env = "KRDMAD_NICE", default_value_t = kal::priority::DEFAULT_NICE,
          allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    nice: i32,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("krdmad: {e}");
        std::process::exit(1);
    }
}

/// What krdmad keeps once the device is mounted (docs/security.md, L6): reaching its
/// clients' descriptors with `pidfd_getfd` and their `/proc` entries (`CAP_SYS_PTRACE`),
/// acting as a client to open its memory (`CAP_SETUID`, `CAP_SETGID`: the file-system
/// ids), `map_files` and unmounting at the end (`CAP_SYS_ADMIN`), rxe's raw sockets
/// (`CAP_NET_RAW`), and a client's LISTEN on a privileged port when the client itself may
/// (`CAP_NET_BIND_SERVICE`).
const KEEP: u64 = 1 << cap::SYS_PTRACE
    | 1 << cap::SETUID
    | 1 << cap::SETGID
    | 1 << cap::SYS_ADMIN
    | 1 << cap::NET_RAW
    | 1 << cap::NET_BIND_SERVICE;

fn run(args: Args) -> Result<(), String> {
    if !std::path::Path::new("/dev/fuse").exists() {
        return Err("/dev/fuse is missing: krdmad serves the device through FUSE (load the fuse module or create the node)".into());
    }
    if !nix::unistd::geteuid().is_root() {
        return Err("must run as root: mounting FUSE without fusermount needs CAP_SYS_ADMIN, and reaching client memory needs CAP_SYS_PTRACE".into());
    }
    // Before any thread exists (they inherit it) and while CAP_SYS_NICE is still held.
    if args.nice != 0 {
        let applied = kal::priority::run_ahead(args.nice);
        match (&applied.thread, &applied.autogroup) {
            (Ok(()), Ok(group)) => tracing::info!(
                nice = args.nice,
                session_group = group,
                "krdmad's threads run ahead of consumers"
            ),
            (thread, group) => tracing::warn!(
                nice = args.nice,
                ?thread,
                ?group,
                "cannot set krdmad's priority: its engines share the CPU with consumers as equals"
            ),
        }
    }
    if let Ok((_, hard)) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
    {
        let _ =
            nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard);
    }
    let mut signals = nix::sys::signal::SigSet::empty();
    signals.add(nix::sys::signal::Signal::SIGTERM);
    signals.add(nix::sys::signal::Signal::SIGINT);
    // Block the signals in every thread (spawned threads inherit the mask), then wait for them.
    signals
        .thread_block()
        .map_err(|e| format!("signal mask: {e}"))?;

    let mut config = kal::Config {
        event_queue: args.event_queue,
        ..kal::Config::default()
    };
    for q in &args.quotas {
        config.quota.apply(q).map_err(|e| format!("--quota {e}"))?;
    }
    for l in &args.limits {
        config.limit.apply(l).map_err(|e| format!("--limit {e}"))?;
    }
    let kal = kal::Kal::new(config);
    // Mount with full rights, then drop all but what serving needs before any thread
    // exists: every thread started from here on (providers, FUSE, watches) inherits it.
    let mounted = kal::fuse::mount(kal.clone(), &args.device)
        .map_err(|e| format!("mounting {}: {e}", args.device.display()))?;
    kal::creds::keep_only(KEEP).map_err(|e| format!("dropping capabilities: {e}"))?;
    let opts = stack::StackOptions {
        siw_netdev: args.siw_netdev,
        siw_crc_required: args.siw_crc_required || stack::StackOptions::from_env().siw_crc_required,
        rxe_addr: args.rxe_addr,
        ..stack::StackOptions::from_env()
    };
    stack::start_default(&kal, &opts).map_err(|e| format!("starting providers: {e}"))?;
    let handle = mounted
        .serve()
        .map_err(|e| format!("serving {}: {e}", args.device.display()))?;
    let names: Vec<String> = kal
        .devices()
        .iter()
        .map(|d| d.attr().name.clone())
        .collect();
    tracing::info!(device = %args.device.display(), devices = ?names, "krdmad serving");
    println!("krdmad: ready {}", args.device.display());
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let sig = signals
        .wait()
        .map_err(|e| format!("waiting for signals: {e}"))?;
    tracing::info!(?sig, "krdmad stopping");
    kal.shutdown();
    handle.shutdown().map_err(|e| format!("unmounting: {e}"))?;
    tracing::info!("krdmad stopped");
    Ok(())
}
