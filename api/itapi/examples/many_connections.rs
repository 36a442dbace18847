//! Many connections on one aggregate EVD: a server thread serves every endpoint — their
//! connection requests, connection messages and completions — from one AEVD. Each
//! endpoint has its own DTO SEVD (its own completion queue) feeding the AEVD.
//!
//! ```sh
//! cargo run --release -p krdma-itapi --example many_connections -- --connections 1000
//! ```
//!
//! By default the clients run in a child process (this program with `--client`), so the
//! figures the server prints are its own: connection set-up rate, memory per endpoint,
//! an echo over every connection, teardown. `--server PORT` / `--client ADDR:PORT` run
//! one side only.
//!
//! Over rxe0 with the embedded front door each process has its own rxe0, which needs
//! an address of its own: `KRDMA_RXE_ADDR=127.0.0.2 … -- --device rxe0` (the client
//! process takes 127.0.0.3). Through `krdmad` both share the daemon's rxe0.

mod common;

use clap::Parser;
use krdma_itapi::*;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use ual::RegBuf;

/// IT-API many connections served from one aggregate EVD, with set-up rate and memory.
#[derive(Parser, Clone)]
struct Args {
    #[arg(long, default_value = "siw0")]
    device: String,
    /// Connections to make.
    #[arg(long, default_value_t = 200)]
    connections: usize,
    /// Client threads connecting at once.
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Serve on this port and wait for clients from elsewhere.
    #[arg(long, conflicts_with = "client")]
    server: Option<u16>,
    /// Be the clients: connect to a server at ADDR:PORT.
    #[arg(long)]
    client: Option<SocketAddr>,
}

/// Bytes of each connection's message slot in the shared LMR.
const SLOT: u64 = 64;

/// One served connection.
struct Conn {
    ep: Endpoint,
    /// Its DTO SEVD (kept alive with the endpoint).
    _dto: Evd,
    slot: u64,
}

/// The server: everything arrives on `aevd`.
struct Server {
    ia: Ia,
    pz: Pz,
    aevd: Aevd,
    cm: Evd,
    lmr: Lmr,
    conns: HashMap<u64, Conn>,
    next_slot: u64,
}

/// Resident memory and threads of this process (from /proc/self/status).
fn rss_and_threads() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:") * 1024, field("Threads:"))
}

impl Server {
    fn new(a: &Args) -> Result<Server> {
        let ia = Ia::open(&a.device)?;
        let pz = Pz::create(&ia)?;
        let aevd = Aevd::create(&ia, EvdFlags::empty(), 4 * a.connections + 64)?;
        let cm = Evd::create(
            &ia,
            EventStream::CmMessage,
            EvdFlags::empty(),
            2 * a.connections + 64,
            1,
            Some(&aevd),
        )?;
        let buf = RegBuf::new(a.connections * SLOT as usize).map_err(|_| Error::Resources)?;
        let lmr = Lmr::create(&pz, buf, MemPriv::LOCAL)?;
        Ok(Server {
            ia,
            pz,
            aevd,
            cm,
            lmr,
            conns: HashMap::new(),
            next_slot: 0,
        })
    }

    fn post_recv(&self, c: &Conn) -> Result<()> {
        c.ep.post_recv(
            &[self.lmr.segment(c.slot * SLOT, SLOT as u32)?],
            c.slot,
            DtoFlags::SIGNALED,
        )
    }

    /// A new endpoint (with its own DTO SEVD on the AEVD) accepting `r`.
    fn accept(&mut self, r: &ConnRequestEvent) -> Result<()> {
        let dto = Evd::create(
            &self.ia,
            EventStream::Dto,
            EvdFlags::empty(),
            8,
            1,
            Some(&self.aevd),
        )?;
        let attrs = EpAttributes {
            max_request_dtos: 4,
            max_recv_dtos: 4,
            max_send_segments: 1,
            max_recv_segments: 1,
            ..EpAttributes::default()
        };
        let ep = Endpoint::create_rc(&self.pz, &dto, &dto, &self.cm, attrs, None)?;
        let c = Conn {
            ep,
            _dto: dto,
            slot: self.next_slot % (self.lmr.len() / SLOT),
        };
        self.next_slot += 1;
        self.post_recv(&c)?;
        c.ep.accept(r.cn_est_id, b"")?;
        self.conns.insert(c.ep.id(), c);
        Ok(())
    }

    /// Send back what arrived in the connection's slot, and wait for the next message.
    fn echo(&self, ep: u64) -> Result<()> {
        let c = &self.conns[&ep];
        let mut msg = [0u8; 8];
        self.lmr
            .buffer()
            .expect("buffer")
            .read((c.slot * SLOT) as usize, &mut msg);
        self.post_recv(c)?;
        c.ep.post_send_inline(&msg, 0, DtoFlags::empty())
    }
}

/// The backlog the IT-API listener asks for (as `Listener::create` does).
const LISTEN_BACKLOG: i32 = 1024;

/// A TCP listener on loopback with `backlog` (std's `bind` fixes it at 128, which makes
/// connection bursts wait for SYN retransmissions).
fn tcp_listener(backlog: i32) -> std::net::TcpListener {
    use nix::sys::socket::{
        bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, SockaddrIn,
    };
    use std::os::fd::AsRawFd;
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, 0)).expect("bind");
    listen(&fd, Backlog::new(backlog).expect("backlog")).expect("listen");
    std::net::TcpListener::from(fd)
}

/// The baseline, measured in the same run: `n` plain TCP connections on loopback
/// (connect and accept), made by `threads` threads one after the other, as the clients
/// make their IT-API connections. Returns connections per second.
fn tcp_setup_rate(n: usize, threads: usize) -> f64 {
    let listener = tcp_listener(LISTEN_BACKLOG);
    let addr = listener.local_addr().expect("address");
    let t = Instant::now();
    let acceptor = std::thread::spawn(move || {
        let conns: Vec<_> = (0..n).map_while(|_| listener.accept().ok()).collect();
        conns.len()
    });
    let clients: Vec<_> = (0..threads)
        .map(|k| {
            let share = n / threads + usize::from(k < n % threads);
            std::thread::spawn(move || {
                (0..share)
                    .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let accepted = acceptor.join().expect("acceptor");
    let secs = t.elapsed().as_secs_f64();
    for c in clients {
        drop(c.join());
    }
    assert_eq!(accepted, n);
    n as f64 / secs
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn serve(a: &Args, port: u16, on_listen: impl FnOnce(SocketAddr)) -> Result<()> {
    let n = a.connections;
    let tcp_rate = tcp_setup_rate(n, a.threads.clamp(1, n.max(1)));
    let mut s = Server::new(a)?;
    let req = Evd::create(
        &s.ia,
        EventStream::CmRequest,
        EvdFlags::empty(),
        n + 64,
        1,
        Some(&s.aevd),
    )?;
    let listener = Listener::create(&s.ia, 0, &req, port)?;
    let (rss0, threads0) = rss_and_threads();
    on_listen(common::reachable_at(&s.ia, listener.port()));
    let (mut established, mut echoed, mut closed) = (0, 0, 0);
    let mut first_request = None;
    let mut all_up = None;
    let mut first_echo = None;
    let mut up_figures = (0, 0);
    let mut all_echoed = None;
    while closed < n {
        let ev = s.aevd.wait(Some(Duration::from_secs(120)))?.0;
        match ev {
            Event::ConnRequest(r) => {
                first_request.get_or_insert_with(Instant::now);
                s.accept(&r)?;
            }
            Event::Connection(c) if c.kind == ConnEventKind::Established => {
                established += 1;
                if established == n {
                    all_up = Some(Instant::now());
                    up_figures = rss_and_threads();
                }
            }
            Event::Connection(c) => {
                s.conns.remove(&c.ep.id);
                closed += 1;
            }
            Event::Dto(d) if d.kind == DtoKind::Recv && d.status == DtoStatus::Success => {
                first_echo.get_or_insert_with(Instant::now);
                s.echo(d.ep.id)?;
                echoed += 1;
                if echoed == n {
                    all_echoed = Some(Instant::now());
                }
            }
            _ => {} // flushed receives of closed connections
        }
    }
    let done = Instant::now();
    let (t0, up) = (
        first_request.expect("requests"),
        all_up.expect("all established"),
    );
    let setup = up - t0;
    let (rss1, threads1) = up_figures;
    println!(
        "many_connections over {} ({:?}, front door {}): {n} endpoints on one AEVD",
        a.device,
        s.ia.transport(),
        ual::Target::from_env().describe()
    );
    let rate = n as f64 / setup.as_secs_f64();
    println!(
        "  set-up:   {n} connections in {:.3} s = {rate:.0} connections/s ({} client threads); \
         plain TCP connect+accept in the same run: {tcp_rate:.0}/s, ratio {:.2}x",
        setup.as_secs_f64(),
        a.threads,
        rate / tcp_rate
    );
    let per_ep = rss1.saturating_sub(rss0) / n as u64;
    println!(
        "  memory:   server RSS {:.1} -> {:.1} MiB: {:.1} KiB per endpoint; threads {threads0} -> {threads1}",
        mib(rss0),
        mib(rss1),
        per_ep as f64 / 1024.0
    );
    if let (Some(e0), Some(e1)) = (first_echo, all_echoed) {
        println!(
            "  echo:     one message on every endpoint, {n} echoes in {:.1} ms",
            (e1 - e0).as_secs_f64() * 1e3
        );
    }
    println!(
        "  teardown: {n} disconnects handled {:.3} s after the last echo",
        (done - all_echoed.unwrap_or(done)).as_secs_f64()
    );
    Ok(())
}

/// One client thread: connect `count` endpoints one after the other, then (once every
/// thread is connected) send each one message and check the echo, then disconnect all.
fn client_thread(
    ia: &Ia,
    server: SocketAddr,
    first: u64,
    count: usize,
    barrier: &Barrier,
) -> Result<()> {
    let pz = Pz::create(ia)?;
    let dto = Evd::create(
        ia,
        EventStream::Dto,
        EvdFlags::empty(),
        4 * count + 8,
        1,
        None,
    )?;
    let cm = Evd::create(
        ia,
        EventStream::CmMessage,
        EvdFlags::empty(),
        2 * count + 8,
        1,
        None,
    )?;
    let lmr = Lmr::create(
        &pz,
        RegBuf::new(count * SLOT as usize).map_err(|_| Error::Resources)?,
        MemPriv::LOCAL,
    )?;
    let attrs = EpAttributes {
        max_request_dtos: 4,
        max_recv_dtos: 4,
        ..EpAttributes::default()
    };
    let mut eps = Vec::with_capacity(count);
    for i in 0..count {
        let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, attrs.clone(), None)?;
        ep.post_recv(
            &[lmr.segment(i as u64 * SLOT, SLOT as u32)?],
            i as u64,
            DtoFlags::SIGNALED,
        )?;
        ep.connect(server, b"")?;
        match cm.wait(common::TIMEOUT)?.0 {
            Event::Connection(c) if c.kind == ConnEventKind::Established => {}
            other => {
                eprintln!("connection {} failed: {other:?}", first + i as u64);
                return Err(Error::Abort);
            }
        }
        eps.push(ep);
    }
    barrier.wait();
    for (i, ep) in eps.iter().enumerate() {
        ep.post_send_inline(&(first + i as u64).to_le_bytes(), 0, DtoFlags::empty())?;
    }
    for _ in 0..count {
        let Event::Dto(d) = dto.wait(common::TIMEOUT)?.0 else {
            continue;
        };
        let mut b = [0u8; 8];
        lmr.buffer()
            .expect("buffer")
            .read((d.cookie * SLOT) as usize, &mut b);
        if d.status != DtoStatus::Success || u64::from_le_bytes(b) != first + d.cookie {
            eprintln!("bad echo on connection {}: {d:?}", first + d.cookie);
            return Err(Error::Abort);
        }
    }
    barrier.wait();
    for ep in &eps {
        ep.disconnect()?;
    }
    for _ in 0..count {
        cm.wait(common::TIMEOUT)?;
    }
    Ok(())
}

fn clients(a: &Args, server: SocketAddr) -> Result<()> {
    let ia = Ia::open(&a.device)?;
    let threads = a.threads.clamp(1, a.connections.max(1));
    let barrier = Arc::new(Barrier::new(threads));
    let t = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|k| {
            let share = a.connections / threads + usize::from(k < a.connections % threads);
            let first = (k * (a.connections / threads) + k.min(a.connections % threads)) as u64;
            let (ia, barrier) = (ia.clone(), barrier.clone());
            std::thread::spawn(move || client_thread(&ia, server, first, share, &barrier))
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| Error::Abort)??;
    }
    eprintln!(
        "clients: {} connections made, echoed and closed in {:.2} s",
        a.connections,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The rxe0 address of the client process this one starts: with the embedded front
/// door each process has its own rxe0, and two cannot serve the same address. When this
/// process's is set (`KRDMA_RXE_ADDR`), the child takes the next one.
fn child_rxe_addr() -> Option<std::net::Ipv4Addr> {
    let mine: std::net::Ipv4Addr = std::env::var("KRDMA_RXE_ADDR").ok()?.parse().ok()?;
    Some(std::net::Ipv4Addr::from(u32::from(mine).wrapping_add(1)))
}

fn main() -> Result<()> {
    common::init_logging();
    let a = Args::parse();
    match (a.server, a.client) {
        (Some(port), _) => serve(&a, port, |at| {
            println!("many_connections server listening on {at}")
        }),
        (None, Some(server)) => clients(&a, server),
        (None, None) => {
            let exe = std::env::current_exe().map_err(|_| Error::Abort)?;
            let mut child = None;
            serve(&a, 0, |at| {
                let mut cmd = Command::new(&exe);
                if let Some(addr) = child_rxe_addr() {
                    cmd.env("KRDMA_RXE_ADDR", addr.to_string());
                }
                let c = cmd
                    .args(["--client", &at.to_string()])
                    .args(["--connections", &a.connections.to_string()])
                    .args(["--threads", &a.threads.to_string()])
                    .args(["--device", &a.device])
                    .stdout(Stdio::inherit())
                    .spawn()
                    .expect("start the client process");
                child = Some(c);
            })?;
            let status = child
                .expect("client started")
                .wait()
                .map_err(|_| Error::Abort)?;
            if status.success() {
                Ok(())
            } else {
                Err(Error::Abort)
            }
        }
    }
}
