//! What the examples share: one side of a connection (adapter, protection zone, event
//! dispatchers, an RC endpoint and a registered buffer), connection set-up through a
//! listener, and waiting for completions.
#![allow(dead_code)]

use krdma_itapi::*;
use std::net::SocketAddr;
use std::time::Duration;
use ual::RegBuf;

pub const TIMEOUT: Option<Duration> = Some(Duration::from_secs(30));

/// Log to stderr as `RUST_LOG` says.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
}

/// One side of a connection.
pub struct Peer {
    pub ia: Ia,
    pub pz: Pz,
    pub dto: Evd,
    pub cm: Evd,
    pub ep: Endpoint,
    pub lmr: Lmr,
}

impl Peer {
    /// An unconnected endpoint on `device` with a `buf_len`-byte buffer, `depth` deep.
    pub fn new(device: &str, buf_len: usize, depth: usize) -> Result<Peer> {
        let ia = Ia::open(device)?;
        let pz = Pz::create(&ia)?;
        let dto = Evd::create(&ia, EventStream::Dto, EvdFlags::empty(), 4 * depth, 1, None)?;
        let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 8, 1, None)?;
        let attrs = EpAttributes {
            max_request_dtos: depth,
            max_recv_dtos: depth,
            ..EpAttributes::default()
        };
        let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, attrs, None)?;
        let buf = RegBuf::new(buf_len).map_err(|_| Error::Resources)?;
        let lmr = Lmr::create(&pz, buf, MemPriv::LOCAL | MemPriv::REMOTE)?;
        Ok(Peer {
            ia,
            pz,
            dto,
            cm,
            ep,
            lmr,
        })
    }

    pub fn buf(&self) -> &RegBuf {
        self.lmr.buffer().expect("buffer-backed LMR")
    }

    /// Listen on `port`, tell `on_listen` where (see [`reachable_at`]), accept the first
    /// request with `reply`; returns the requester's private data.
    pub fn accept_one(
        &self,
        port: u16,
        reply: &[u8],
        on_listen: impl FnOnce(SocketAddr),
    ) -> Result<Vec<u8>> {
        let req = Evd::create(
            &self.ia,
            EventStream::CmRequest,
            EvdFlags::empty(),
            4,
            1,
            None,
        )?;
        let listener = Listener::create(&self.ia, 0, &req, port)?;
        on_listen(reachable_at(&self.ia, listener.port()));
        let Event::ConnRequest(r) = req.wait(None)?.0 else {
            return Err(Error::InvalidEvdState);
        };
        self.ep.accept(r.cn_est_id, reply)?;
        self.established()?;
        Ok(r.private_data)
    }

    /// Connect to `server` offering `offer`; returns the accept's private data.
    pub fn connect(&self, server: SocketAddr, offer: &[u8]) -> Result<Vec<u8>> {
        self.ep.connect(server, offer)?;
        self.established()
    }

    fn established(&self) -> Result<Vec<u8>> {
        match self.cm.wait(TIMEOUT)?.0 {
            Event::Connection(c) if c.kind == ConnEventKind::Established => Ok(c.private_data),
            other => {
                eprintln!("connection failed: {other:?}");
                Err(Error::Abort)
            }
        }
    }

    /// The next completion: sleeping in `wait`, or (with `spin`) polling `dequeue`.
    /// A failed completion is an error (`InvalidEpState` when it was flushed because the
    /// connection ended).
    pub fn next(&self, spin: bool) -> Result<DtoEvent> {
        let ev = if spin {
            loop {
                match self.dto.dequeue() {
                    Err(Error::QueueEmpty) => std::hint::spin_loop(),
                    r => break r?,
                }
            }
        } else {
            self.dto.wait(TIMEOUT)?.0
        };
        match ev {
            Event::Dto(d) if d.status == DtoStatus::Success => Ok(d),
            // The connection ended.
            Event::Dto(d) if d.status == DtoStatus::Flushed => Err(Error::InvalidEpState),
            other => {
                eprintln!("work request failed: {other:?}");
                Err(Error::Abort)
            }
        }
    }

    /// Wait for the completion of the request posted with `cookie` (others are skipped).
    pub fn complete(&self, cookie: u64) -> Result<DtoEvent> {
        loop {
            let d = self.next(false)?;
            if d.cookie == cookie {
                return Ok(d);
            }
        }
    }

    /// Disconnect and wait until the connection is down.
    pub fn close(&self) -> Result<()> {
        self.ep.disconnect()?;
        self.cm.wait(TIMEOUT).map(drop)
    }
}

/// The options every example takes: the adapter, and which end(s) to run.
#[derive(clap::Args, Clone)]
pub struct Roles {
    /// Interface adapter (siw0, rxe0, ...).
    #[arg(long, default_value = "siw0")]
    pub device: String,
    /// Serve on this port (0 picks one).
    #[arg(long, conflicts_with = "client")]
    pub server: Option<u16>,
    /// Connect to a server at ADDR:PORT.
    #[arg(long)]
    pub client: Option<SocketAddr>,
}

/// Where a client on this host connects to a listener of `ia` on `port`: the adapter's
/// loopback address (127.0.0.1 for siw0 and for an rxe0 that serves every address; an
/// rxe0 bound to one address with `KRDMA_RXE_ADDR` or `krdmad --rxe-addr`, that one).
pub fn reachable_at(ia: &Ia, port: u16) -> SocketAddr {
    let ip = ia
        .local_address()
        .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
    SocketAddr::new(ip, port)
}

/// Told where a server listens.
pub type OnListen = Box<dyn FnOnce(SocketAddr) + Send>;

/// Run an example as it was asked: the server only (on `server`), the client only (to
/// `client`), or both ends in this process on loopback.
pub fn run<A: Clone + Send + 'static>(
    name: &'static str,
    args: &A,
    roles: &Roles,
    serve: fn(&A, u16, OnListen) -> Result<()>,
    connect: fn(&A, SocketAddr) -> Result<()>,
) -> Result<()> {
    match (roles.server, roles.client) {
        (Some(port), _) => serve(
            args,
            port,
            Box::new(move |at| println!("{name} server listening on {at}")),
        ),
        (None, Some(addr)) => connect(args, addr),
        (None, None) => {
            let a = args.clone();
            loopback(
                move |announce| serve(&a, 0, announce),
                |addr| connect(args, addr),
            )
        }
    }
}

/// Run `serve` on a thread (it reports where it listens through the callback it is
/// given) and `client` here against it on loopback.
fn loopback(
    serve: impl FnOnce(OnListen) -> Result<()> + Send + 'static,
    client: impl FnOnce(SocketAddr) -> Result<()>,
) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        serve(Box::new(move |at| {
            let _ = tx.send(at);
        }))
    });
    let client_result = rx.recv().map_err(|_| Error::Abort).and_then(client);
    let server_result = server.join().map_err(|_| Error::Abort)?;
    client_result.and(server_result)
}

/// Deterministic test data: `len` bytes for `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The value at percentile `p` of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((p / 100.0) * (sorted.len().saturating_sub(1)) as f64).round() as usize;
    sorted.get(i).copied().unwrap_or(f64::NAN)
}
