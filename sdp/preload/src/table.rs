//! What the preload library knows: the program's descriptors that are (or may become)
//! SDP sockets, the switch's policy, and which threads are the library's own.

pub use crate::listening::{Accepted, Listening};
use crate::real::real;
use krdma_sdp::conn::{Conn, Options};
use krdma_sdp::switch::Policy;
pub use krdma_sdp::switch::COUNTERS;
use libc::{c_int, c_void};
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread is working for the library (its calls are not the program's).
pub fn is_inside() -> bool {
    INSIDE.with(|i| i.get())
}

/// Run `f` as the library's own work.
pub fn inside<R>(f: impl FnOnce() -> R) -> R {
    let was = INSIDE.with(|i| i.replace(true));
    let r = f();
    INSIDE.with(|i| i.set(was));
    r
}

/// Process-wide state, made on first use.
pub struct Global {
    pub policy: Policy,
    pub program: String,
    pub opts: Options,
    no_sdp: Mutex<HashMap<SocketAddr, Instant>>,
}

/// How long a peer without SDP is remembered (its connects go straight to TCP).
const NO_SDP_MEMORY: Duration = Duration::from_secs(30);

static FORKED: AtomicBool = AtomicBool::new(false);

pub fn global() -> &'static Global {
    static G: OnceLock<Global> = OnceLock::new();
    G.get_or_init(|| {
        inside(|| {
            if std::env::var_os("KRDMA_SDP_LOG").is_some() {
                let _ = tracing_subscriber::fmt()
                    .with_env_filter(tracing_subscriber::EnvFilter::new(
                        std::env::var("KRDMA_SDP_LOG").unwrap_or_default(),
                    ))
                    .with_writer(std::io::stderr)
                    .try_init();
            }
            // SAFETY: registering plain functions as the fork handlers.
            unsafe { libc::pthread_atfork(Some(before_fork), None, Some(in_fork_child)) };
            // SAFETY: registering a plain function to run at exit.
            unsafe { libc::atexit(at_exit) };
            // This library sees the program's poll/select/epoll waits (`waits`).
            krdma_sdp::conn::hot::waits_are_seen();
            let policy = Policy::load();
            let program = std::fs::read_to_string("/proc/self/comm")
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            let mut opts = Options::default();
            if std::env::var_os("KRDMA_SDP_DEVICE").is_none() {
                if let Some(d) = &policy.device {
                    opts.device = d.clone();
                }
            }
            tracing::info!(%program, device = %opts.device, "krdma SDP preload active");
            #[cfg(feature = "embedded")]
            krdma_sdp::device::configure_embedded_for(&opts.device);
            krdma_sdp::stats::serve();
            Global {
                policy,
                program,
                opts,
                no_sdp: Mutex::new(HashMap::new()),
            }
        })
    })
}

impl Global {
    /// New sockets may be offloaded (not in a fork child, whose RDMA stack is the
    /// parent's and has no threads: there everything new stays TCP).
    pub fn offload_allowed(&self) -> bool {
        !FORKED.load(Ordering::Relaxed) && std::env::var_os("KRDMA_SDP_OFF").is_none()
    }

    pub fn known_without_sdp(&self, peer: SocketAddr) -> bool {
        let mut m = self.no_sdp.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, t| t.elapsed() < NO_SDP_MEMORY);
        m.contains_key(&peer)
    }

    pub fn remember_without_sdp(&self, peer: SocketAddr) {
        self.no_sdp
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer, Instant::now());
    }
}

/// At exit: the SDP connections' closes are finished before the RDMA stack ends with the
/// process (the kernel would finish a TCP socket's close after the exit; nothing finishes
/// an SDP socket's). A fork child has nothing of its own to finish.
extern "C" fn at_exit() {
    if FORKED.load(Ordering::Relaxed) {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        inside(|| krdma_sdp::conn::finish_at_exit(krdma_sdp::conn::EXIT_LINGER))
    });
}

/// Before a `fork`: every SDP socket of this process becomes relayed through its face
/// (`krdma_sdp::conn::Conn::relay`), so that parent and child — and whatever either
/// `exec`s — can use it as the kernel socket the face is.
extern "C" fn before_fork() {
    if FORKED.load(Ordering::Relaxed) {
        return;
    }
    let socks: Vec<(c_int, Arc<Sock>)> = table().iter().map(|(f, s)| (*f, s.clone())).collect();
    for (fd, sock) in socks {
        let mut k = sock.kind();
        if let Kind::Listener(l) = &*k {
            if let Err(e) = inside(|| l.prepare_sharing()) {
                tracing::warn!(fd, error = %e, "SDP listener not shared across fork");
            }
            continue;
        }
        let Kind::Stream(st) = &*k else { continue };
        // SAFETY: `fd` is in the table, so the program holds it open; the handler runs
        // in the thread that is forking, before any other code can close it.
        let face = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        match inside(|| st.conn.relay(face)) {
            Ok(()) => {
                let options = st.options.lock().unwrap_or_else(|e| e.into_inner()).clone();
                COUNTERS.relayed_at_fork.fetch_add(1, Ordering::Relaxed);
                *k = Kind::Relayed(Arc::new(Relayed {
                    local: st.conn.local,
                    peer: st.conn.peer,
                    options: Mutex::new(options),
                    owner: Mutex::new(Some(st.clone())),
                }));
            }
            Err(e) => {
                COUNTERS.relay_failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(fd, error = %e, "SDP socket not relayed across fork");
            }
        }
    }
}

/// In a fork child: the SDP sockets inherited belong to the parent's connections. Relayed
/// ones are kernel sockets here too; the others (a relay that could not be set up, and
/// listeners) are not ours to use.
extern "C" fn in_fork_child() {
    FORKED.store(true, Ordering::Relaxed);
    krdma_sdp::device::Device::forget_all();
    krdma_sdp::conn::hot::forget_all();
    if let Ok(t) = TABLE.try_lock() {
        for s in t.values() {
            if let Ok(mut k) = s.kind.try_lock() {
                if let Kind::Relayed(r) = &*k {
                    // The parent's hold on the socket must not be let go from here.
                    if let Ok(mut o) = r.owner.try_lock() {
                        std::mem::forget(o.take());
                    }
                    continue;
                }
                let wake = match &*k {
                    Kind::Listener(l) => l.wake_fd(),
                    _ => None,
                };
                if let Some(wake) = wake {
                    let old = std::mem::replace(
                        &mut *k,
                        Kind::Shared(Arc::new(SharedListener {
                            wake,
                            asked: AtomicBool::new(false),
                        })),
                    );
                    std::mem::forget(old);
                    continue;
                }
                let old = std::mem::replace(&mut *k, Kind::Foreign);
                // The parent's objects must not be torn down from here.
                std::mem::forget(old);
            }
        }
    }
}

/// What a tracked descriptor is.
pub enum Kind {
    /// A kernel TCP socket not yet connected or listening.
    Fresh { bound: Option<SocketAddr> },
    /// A kernel TCP listener with an SDP listener beside it.
    Listener(Arc<Listening>),
    /// An SDP connection's face.
    Stream(Arc<Stream>),
    /// An SDP connection whose face carries its bytes (it was shared by a `fork`): the
    /// kernel serves every call on it.
    Relayed(Arc<Relayed>),
    /// A listener inherited from the parent process, whose SDP connections the parent
    /// bridges to it (`crate::bridges`).
    Shared(Arc<SharedListener>),
    /// An SDP socket inherited from the parent process that is not relayed.
    Foreign,
}

/// A fork child's view of its parent's listener.
pub struct SharedListener {
    /// Written once to ask the parent to bridge its SDP connections to the listener.
    wake: c_int,
    asked: AtomicBool,
}

impl SharedListener {
    /// This process accepts on the listener: ask its owner, once, to hand the SDP
    /// connections over as bridges from now on.
    pub fn accepting(&self) {
        if !self.asked.swap(true, Ordering::Relaxed) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: an 8-byte write to the eventfd the owner made before the fork.
            unsafe { libc::write(self.wake, one.as_ptr() as *const c_void, 8) };
        }
    }
}

impl Relayed {
    /// A bridge accepted from a shared listener (`crate::bridges`): its relay runs in the
    /// listener's owner.
    pub fn bridged(local: SocketAddr, peer: SocketAddr) -> Relayed {
        Relayed {
            local,
            peer,
            options: Mutex::new(HashMap::new()),
            owner: Mutex::new(None),
        }
    }
}

/// What a relayed socket still needs from the library: its names, and the options the
/// face (an `AF_UNIX` socket) has no use for.
pub struct Relayed {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// Options of levels other than `SOL_SOCKET`, read back as set.
    pub options: Mutex<HashMap<(c_int, c_int), c_int>>,
    /// The connection's owner keeps the socket (and its port) until its last descriptor
    /// here is closed; `None` in fork children.
    owner: Mutex<Option<Arc<Stream>>>,
}

pub struct Sock {
    pub family: c_int,
    kind: Mutex<Kind>,
}

impl Sock {
    pub fn new(family: c_int) -> Sock {
        Sock {
            family,
            kind: Mutex::new(Kind::Fresh { bound: None }),
        }
    }

    pub fn kind(&self) -> MutexGuard<'_, Kind> {
        self.kind.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An SDP connection as the program's socket.
pub struct Stream {
    pub conn: Arc<Conn>,
    /// Holds the socket's port in the kernel's port space.
    _port: Option<OwnedFd>,
    pub read_shut: AtomicBool,
    pub linger_zero: AtomicBool,
    /// Options set that SDP has no use for, read back as set.
    pub options: Mutex<HashMap<(c_int, c_int), c_int>>,
}

impl Stream {
    pub fn new(conn: Arc<Conn>, port: Option<OwnedFd>) -> Stream {
        Stream {
            conn,
            _port: port,
            read_shut: AtomicBool::new(false),
            linger_zero: AtomicBool::new(false),
            options: Mutex::new(HashMap::new()),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The descriptor table.

const FAST: usize = 1 << 16;
static TRACKED: [AtomicBool; FAST] = [const { AtomicBool::new(false) }; FAST];
static TABLE: Mutex<BTreeMap<c_int, Arc<Sock>>> = Mutex::new(BTreeMap::new());

fn table() -> MutexGuard<'static, BTreeMap<c_int, Arc<Sock>>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn insert(fd: c_int, s: Arc<Sock>) {
    if (fd as usize) < FAST {
        TRACKED[fd as usize].store(true, Ordering::Relaxed);
    }
    table().insert(fd, s);
}

pub fn get(fd: c_int) -> Option<Arc<Sock>> {
    if fd < 0 || ((fd as usize) < FAST && !TRACKED[fd as usize].load(Ordering::Relaxed)) {
        return None;
    }
    table().get(&fd).cloned()
}

/// Forget `fd` (closed, or left to the kernel). The last descriptor of a socket in
/// this process lets its objects go (a stream's connection lives on until its face is
/// closed everywhere; one with `SO_LINGER` zero aborts).
pub fn remove(fd: c_int) {
    if fd < 0 || ((fd as usize) < FAST && !TRACKED[fd as usize].load(Ordering::Relaxed)) {
        return;
    }
    if (fd as usize) < FAST {
        TRACKED[fd as usize].store(false, Ordering::Relaxed);
    }
    let gone = table().remove(&fd);
    if let Some(s) = gone {
        if Arc::strong_count(&s) == 1 {
            let k = std::mem::replace(&mut *s.kind(), Kind::Foreign);
            match k {
                Kind::Stream(st) if st.linger_zero.load(Ordering::Relaxed) => {
                    inside(|| st.conn.abort())
                }
                // A fork child never tears down what belongs to the parent.
                other if FORKED.load(Ordering::Relaxed) => std::mem::forget(other),
                other => inside(|| drop(other)),
            }
        }
    }
}

/// `to` is now a duplicate of `from`.
pub fn dup(from: c_int, to: c_int) {
    if let Some(s) = get(from) {
        insert(to, s);
    }
}

// ---------------------------------------------------------------------------------------
// Threads the library starts are the library's.

struct Start {
    f: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
}

extern "C" fn start_inside(p: *mut c_void) -> *mut c_void {
    // SAFETY: `p` is the Box made in pthread_create below, handed over once.
    let s = unsafe { Box::from_raw(p as *mut Start) };
    INSIDE.with(|i| i.set(true));
    (s.f)(s.arg)
}

/// `pthread_create`: a thread started while the library works belongs to it (its socket
/// calls go straight to the C library).
///
/// # Safety
/// As `pthread_create(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    t: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    f: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
) -> c_int {
    if !is_inside() {
        return (real().pthread_create)(t, attr, f, arg);
    }
    let p = Box::into_raw(Box::new(Start { f, arg })) as *mut c_void;
    let r = (real().pthread_create)(t, attr, start_inside, p);
    if r != 0 {
        drop(Box::from_raw(p as *mut Start));
    }
    r
}

#[allow(dead_code)]
fn raw(fd: &OwnedFd) -> c_int {
    fd.as_raw_fd()
}
