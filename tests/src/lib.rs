//! Shared helpers for the end-to-end tests: the two kAL front doors (embedded, and a
//! private `krdmad` instance serving a FUSE device), and data checks.
//!
//! Over 600 lines: the helpers every end-to-end test file shares.

pub mod impair;
pub mod probe;
pub mod raw_siw;
pub mod roce;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{Context, Target};

/// A loopback address no other test process uses (from the pid), for an rxe0 instance:
/// every kAL in a test gets its own, as one wildcard rxe0 per network namespace would
/// receive every process's RoCEv2 traffic.
pub fn private_loopback(n: u8) -> std::net::Ipv4Addr {
    let pid = std::process::id();
    std::net::Ipv4Addr::new(127, 10 + n, (pid >> 8) as u8, pid as u8)
}

/// Log to stderr when `RUST_LOG` asks for it (child processes of the tests).
pub fn init_logging() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

/// Give this process's embedded kAL its own rxe0 address (idempotent).
pub fn setup_embedded() {
    ual::configure_embedded(stack::StackOptions {
        rxe_addr: Some(private_loopback(0)),
        ..stack::StackOptions::from_env()
    });
}

/// A private krdmad serving a device file in a temporary directory; stopped on drop.
pub struct Daemon {
    child: Child,
    pub path: PathBuf,
    dir: PathBuf,
    /// The address its rxe0 serves.
    pub rxe_addr: std::net::Ipv4Addr,
}

/// A fresh directory of our own under the temporary directory, made with `mkdtemp`
/// (an unpredictable name, created exclusively, so nobody can have planted a symbolic
/// link in it), then opened to others for reading and search only (mode 0755: an
/// unprivileged test child can reach a device in it, nobody else can add anything).
pub fn private_dir(tag: &str) -> PathBuf {
    let dir =
        nix::unistd::mkdtemp(&std::env::temp_dir().join(format!("{tag}-XXXXXX"))).expect("mkdtemp");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod the private directory");
    dir
}

/// A command that runs the ignored test `name` of this very test binary, alone, with
/// its output not captured (tests whose processes play parts: openers, probes…).
pub fn child_test(name: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("current exe"));
    c.args([name, "--exact", "--ignored", "--nocapture"]);
    c
}

/// `cmd` run as user and group `uid` with no supplementary groups and no capabilities
/// (through `setpriv`, util-linux).
pub fn as_user(cmd: &Command, uid: u32) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        format!("--reuid={uid}"),
        format!("--regid={uid}"),
        "--clear-groups".into(),
        "--inh-caps=-all".into(),
    ]);
    c.arg(cmd.get_program()).args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

/// The `krdmad` binary built alongside the tests (target/<profile>/krdmad), or the one
/// `KRDMA_TEST_KRDMAD` names (benchmarks comparing two builds).
pub fn krdmad_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KRDMA_TEST_KRDMAD") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = profile_dir.join("krdmad");
    assert!(
        bin.exists(),
        "{} not built (run the tests through cargo/nextest on the workspace)",
        bin.display()
    );
    bin
}

/// Whether this machine can run the daemon (root and /dev/fuse). Under `CI=true` a
/// missing capability is a test failure, never a silent skip.
pub fn daemon_possible() -> bool {
    if std::env::var_os("KRDMA_TEST_EMBEDDED_ONLY").is_some() && std::env::var_os("CI").is_none() {
        eprintln!("daemon front door skipped (KRDMA_TEST_EMBEDDED_ONLY)");
        return false;
    }
    let ok = nix::unistd::geteuid().is_root() && Path::new("/dev/fuse").exists();
    if !ok && std::env::var_os("CI").is_some() {
        panic!("CI must run the daemon tests: they need root and /dev/fuse");
    }
    if !ok {
        eprintln!("skipped daemon front door: needs root and /dev/fuse");
    }
    ok
}

impl Daemon {
    pub fn start() -> Daemon {
        Self::start_with(&[])
    }

    /// Start a daemon with `extra` arguments. Contexts this process then opens through it
    /// without a choice (`Context::open_target`, IT-API's `Ia::open_on`) reach its engine
    /// through shared rings (`FastPathChoice::Kal`): the tests written against a daemon
    /// read its engine's counters and rings. Tests of siw's engine in the consumer
    /// (`siw_uvp.rs`) and the programs the tests spawn (which take the default) open the
    /// consumer's path.
    pub fn start_with(extra: &[&str]) -> Daemon {
        ual::FastPathChoice::Kal.set_for_process();
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = private_dir("krdma-e2e");
        let path = dir.join("krdma");
        let rxe_addr = private_loopback(1 + (n % 100) as u8);
        let mut child = Command::new(krdmad_bin())
            .arg("--device")
            .arg(&path)
            .arg("--rxe-addr")
            .arg(rxe_addr.to_string())
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start krdmad");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if line.contains("ready") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(20))
            .expect("krdmad did not become ready");
        Daemon {
            child,
            path,
            dir,
            rxe_addr,
        }
    }

    pub fn target(&self) -> Target {
        Target::Device(self.path.clone())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Daemon {
    /// SIGTERM, and wait up to `patience` for the exit: its status and how long it took
    /// (`None`: still running).
    pub fn terminate(
        &mut self,
        patience: Duration,
    ) -> Option<(std::process::ExitStatus, Duration)> {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let t0 = Instant::now();
        while t0.elapsed() < patience {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some((st, t0.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// Whether the device is still mounted.
    pub fn mounted(&self) -> bool {
        let p = self.path.to_string_lossy();
        std::fs::read_to_string("/proc/self/mounts")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split_whitespace().nth(1) == Some(p.as_ref()))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.terminate(Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if self.mounted() {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.path)
                .stderr(Stdio::null())
                .status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One of the kAL's front doors, for tests that run against both.
pub enum FrontDoor {
    Embedded,
    Daemon(Daemon),
}

impl FrontDoor {
    pub fn target(&self) -> Target {
        match self {
            FrontDoor::Embedded => {
                setup_embedded(); // before anything reaches the embedded kAL
                Target::Embedded
            }
            FrontDoor::Daemon(d) => d.target(),
        }
    }

    pub fn open(&self) -> Arc<Context> {
        setup_embedded();
        Context::open_target(&self.target()).expect("open kAL context")
    }

    pub fn name(&self) -> &'static str {
        match self {
            FrontDoor::Embedded => "embedded",
            FrontDoor::Daemon(_) => "daemon",
        }
    }

    /// The daemon behind this door, if it is one.
    pub fn daemon(&self) -> Option<&Daemon> {
        match self {
            FrontDoor::Embedded => None,
            FrontDoor::Daemon(d) => Some(d),
        }
    }

    /// What a child process is told to open (`KRDMA_TEST_DOOR`): `embedded` or the
    /// daemon's device path.
    pub fn env_value(&self) -> String {
        match self {
            FrontDoor::Embedded => "embedded".into(),
            FrontDoor::Daemon(d) => d.path.to_string_lossy().into_owned(),
        }
    }
}

/// Run `f` once per available front door.
pub fn each_front_door(f: impl Fn(&FrontDoor)) {
    let mut doors = vec![FrontDoor::Embedded];
    if daemon_possible() {
        doors.push(FrontDoor::Daemon(Daemon::start()));
    }
    for d in &doors {
        eprintln!("--- front door: {}", d.name());
        f(d);
    }
}

/// The value of device `device`'s counter `name` (`krdma stat`).
pub fn device_counter(ctx: &Context, device: &str, name: &str) -> u64 {
    let dev = ctx.device(device).expect("device").index;
    ctx.stat_device(dev)
        .expect("device counters")
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("{device} has no counter {name}"))
}

/// Wait (at most 20 s) until `device`'s counter `name` has grown past `before`.
pub fn counted(ctx: &Context, device: &str, name: &str, before: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while device_counter(ctx, device, name) <= before {
        assert!(Instant::now() < deadline, "{name} not counted");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Consumer-driven progress (`rnicpi::progress`) on `device`, over a connected pair of
/// `door`: a consumer polling its CQ receives in its own thread in embedded mode (the
/// device's counter `polled` grows), never through krdmad (whose engine it cannot reach);
/// one armed to sleep is woken by a notification; and one that polled once and went quiet
/// without arming still gets its message from the engine's own thread (the device's
/// counter `received` grows while nobody polls).
pub fn polling_consumers_drive(door: &FrontDoor, device: &str, polled: &str, received: &str) {
    use ual::{send_flags::SIGNALED, Cqe, EventKind};
    let (a, _b, s, c) = connected_pair(door, device, 4096);
    let polled0 = device_counter(&a, device, polled);
    let mut none = [Cqe::default(); 1];
    // Messages sent while the receiver polls: an empty poll marks the receive side driven,
    // and the engine's thread leaves it to the poller once it has seen that (its window
    // may lapse on a loaded host, so go on until it shows; through krdmad, 200 rounds).
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0u64.. {
        s.post_recv(i, 0, 64).unwrap();
        assert_eq!(s.cq.poll(&mut none), 0);
        c.send(i, 0, 8, SIGNALED).unwrap();
        c.complete(1).unwrap();
        s.complete(1).unwrap();
        let driven = device_counter(&a, device, polled) - polled0;
        match door {
            FrontDoor::Embedded if driven > 0 => break,
            FrontDoor::Embedded => {
                assert!(
                    Instant::now() < deadline,
                    "nothing received by a polling thread"
                )
            }
            FrontDoor::Daemon(_) if i < 200 => assert_eq!(driven, 0, "only krdmad receives"),
            FrontDoor::Daemon(_) => break,
        }
    }

    // Armed to sleep: the engine's thread receives, the notification wakes us.
    s.post_recv(1_000_000, 0, 64).unwrap();
    s.cq.arm(false);
    c.send(1_000_000, 0, 8, SIGNALED).unwrap();
    let ev = s.cq.events().recv_timeout(Duration::from_secs(10));
    assert_eq!(ev.map(|e| e.kind).ok(), Some(EventKind::CqNotify));
    assert_eq!(s.complete(1).unwrap()[0].wr_id, 1_000_000);
    c.complete(1).unwrap();

    // Polled once (nothing there), then quiet without arming: still received.
    s.post_recv(1_000_001, 0, 64).unwrap();
    assert_eq!(s.cq.poll(&mut none), 0);
    let before = device_counter(&a, device, received);
    c.send(1_000_001, 0, 8, 0).unwrap();
    counted(&a, device, received, before);
    assert_eq!(s.complete(1).unwrap()[0].wr_id, 1_000_001);
}

/// Deterministic test pattern.
pub fn fill_pattern(buf: &mut [u8], seed: u32) {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    for chunk in buf.chunks_mut(4) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

pub fn crc(buf: &[u8]) -> u32 {
    crc32fast::hash(buf)
}

/// Fill an endpoint's buffer with [`fill_pattern`]; returns its checksum.
pub fn fill_endpoint(ep: &tools::perf::Endpoint, seed: u32) -> u32 {
    let mut v = vec![0u8; ep.buf.len()];
    fill_pattern(&mut v, seed);
    ep.buf.write(0, &v);
    crc(&v)
}

/// Two contexts opened through `door` and a connected server/client endpoint pair on
/// `device`, each with a `len`-byte buffer.
pub fn connected_pair(
    door: &FrontDoor,
    device: &str,
    len: usize,
) -> (
    Arc<Context>,
    Arc<Context>,
    tools::perf::Endpoint,
    tools::perf::Endpoint,
) {
    let (a, b) = (door.open(), door.open());
    let (s, c) = tools::perf::connect_pair(&a, &b, device, len, 64)
        .unwrap_or_else(|e| panic!("connect over {device}: {e:?}"));
    (a, b, s, c)
}

/// What a [`Bystander`] saw while it ran.
#[derive(Debug, Clone)]
pub struct BystanderReport {
    pub device: String,
    pub round_trips: u64,
    pub median: Duration,
    pub p99: Duration,
    pub max: Duration,
    /// The first error, if the bystander's traffic failed.
    pub error: Option<String>,
}

impl BystanderReport {
    /// Panic unless the bystander kept being served: no error, traffic moved, and no round
    /// trip took longer than `bound` (what "a slow tenant costs only itself" means in a test).
    pub fn assert_served(&self, bound: Duration) {
        eprintln!("bystander: {self:?}");
        assert!(self.error.is_none(), "bystander failed: {self:?}");
        assert!(self.round_trips > 0, "bystander moved no traffic: {self:?}");
        assert!(
            self.max <= bound,
            "bystander stalled beyond {bound:?}: {self:?}"
        );
    }
}

/// An innocent tenant: two contexts of their own, opened through `door`, with a connected
/// pair on `device` that keeps doing 8-byte Send ping-pongs on a thread of its own while a
/// test attacks something else. Create it before the attack, check it after.
pub struct Bystander {
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Round trips done so far.
    done: Arc<std::sync::atomic::AtomicU64>,
    thread: Option<std::thread::JoinHandle<BystanderReport>>,
}

impl Bystander {
    pub fn start(door: &FrontDoor, device: &str) -> Bystander {
        let (a, b, s, c) = connected_pair(door, device, 4096);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let halt = stop.clone();
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = done.clone();
        let device = device.to_string();
        let thread = std::thread::Builder::new()
            .name("bystander".into())
            .spawn(move || {
                let _keep = (a, b);
                let mut times = Vec::new();
                let mut error = None;
                let mut i = 0u64;
                // At least one round trip, however soon `finish` comes: a report always
                // says whether the tenant was served.
                loop {
                    let t0 = Instant::now();
                    let r = (|| -> rnicpi::Result<()> {
                        s.post_recv(i, 0, 8)?;
                        c.post_recv(i, 0, 8)?;
                        c.send(i, 0, 8, rnicpi::send_flags::SIGNALED)?;
                        s.complete(1)?;
                        s.send(i, 0, 8, rnicpi::send_flags::SIGNALED)?;
                        s.complete(1)?;
                        c.complete(2)?;
                        Ok(())
                    })();
                    if let Err(e) = r {
                        error = Some(format!("round trip {i}: {e:?}"));
                        break;
                    }
                    times.push(t0.elapsed());
                    i += 1;
                    counter.store(i, std::sync::atomic::Ordering::Relaxed);
                    if halt.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                times.sort();
                let at = |q: f64| {
                    times
                        .get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)))
                        .copied()
                        .unwrap_or_default()
                };
                BystanderReport {
                    device,
                    round_trips: times.len() as u64,
                    median: at(0.5),
                    p99: at(0.99),
                    max: times.last().copied().unwrap_or_default(),
                    error,
                }
            })
            .expect("spawn bystander");
        Bystander {
            stop,
            done,
            thread: Some(thread),
        }
    }

    /// Let the bystander do `n` more round trips (at most for `within`) before it is
    /// checked, so an attack that was over quickly is still measured against traffic.
    pub fn more_round_trips(&self, n: u64, within: Duration) {
        let target = self.done.load(std::sync::atomic::Ordering::Relaxed) + n;
        let deadline = Instant::now() + within;
        while self.done.load(std::sync::atomic::Ordering::Relaxed) < target
            && Instant::now() < deadline
            && self.thread.as_ref().is_some_and(|t| !t.is_finished())
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Stop the traffic and report.
    pub fn finish(mut self) -> BystanderReport {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("bystander thread panicked")
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One of the kAL's own counters (`krdma stat`: quota refusals, refused ring memory and
/// doorbells, what the engines could not do with consumers' rings), as `ctx` sees it.
pub fn kal_counter(ctx: &Context, name: &str) -> u64 {
    ctx.stat_kal()
        .expect("kAL counters")
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no kAL counter {name}"))
        .1
}

/// A child process playing a part in a test (an opener, a prober…), talking in lines: it
/// says `KEY value` on its stdout ([`say`]) and reads what the test tells it on its stdin
/// ([`hear`]). Killed when dropped.
pub struct Role {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
    stdin: Option<std::process::ChildStdin>,
}

impl Role {
    pub fn spawn(mut cmd: Command) -> Role {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn a role");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        Role {
            stdin: child.stdin.take(),
            child,
            lines,
            seen: Vec::new(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Wait (up to 60 s) for the child to say `key`; returns what it said with it.
    pub fn expect(&mut self, key: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if let Some(rest) = l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')) {
                        return rest.to_string();
                    }
                    if l == key {
                        return String::new();
                    }
                }
                Err(_) => panic!(
                    "the child never said {key}; it said:\n{}\n(status {:?})",
                    self.seen.join("\n"),
                    self.child.try_wait()
                ),
            }
        }
    }

    /// Every line the child said so far (and says until it exits, when `to_end`).
    pub fn said(&mut self, to_end: bool) -> Vec<String> {
        if to_end {
            let _ = self.stdin.take();
            while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(60)) {
                self.seen.push(l);
            }
        }
        self.seen.clone()
    }

    pub fn tell(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{line}").expect("tell the child");
    }

    /// Close its stdin and wait for it to exit.
    pub fn wait(&mut self) -> std::process::ExitStatus {
        let _ = self.stdin.take();
        self.child.wait().expect("wait for the child")
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In a role: say `key value` to the test.
pub fn say(key: &str, value: impl std::fmt::Display) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{key} {value}");
    let _ = out.flush();
}

/// In a role: the next line the test tells us (empty once it closed our stdin).
pub fn hear() -> String {
    let mut l = String::new();
    let _ = std::io::stdin().read_line(&mut l);
    l.trim().to_string()
}

/// The kAL context with id `ctx` as `observer` lists it, if it is there.
pub fn context_row(observer: &Context, ctx: u32) -> Option<ual::abi::ContextRow> {
    let (_, rows) = observer.stat_contexts().expect("STAT_CONTEXTS");
    rows.into_iter().find(|r| r.id == ctx)
}

/// Wait until context `ctx` is gone from `observer`'s view; how long that took (panics
/// after `bound`).
pub fn await_context_gone(observer: &Context, ctx: u32, bound: Duration) -> Duration {
    let t0 = Instant::now();
    while context_row(observer, ctx).is_some() {
        assert!(
            t0.elapsed() < bound,
            "context {ctx} still there after {bound:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    t0.elapsed()
}

/// Private anonymous memory of the test's own, reached only through raw, volatile
/// accesses (the engine may write it at any moment while it is registered).
pub struct Anonymous {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: only raw, volatile accesses go through the pointer, and the mapping lives as
// long as the value.
unsafe impl Send for Anonymous {}
// SAFETY: as above.
unsafe impl Sync for Anonymous {}

impl Anonymous {
    pub fn new(len: usize) -> Anonymous {
        // SAFETY: a fresh private anonymous mapping, unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        Anonymous { ptr: p.cast(), len }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn byte(&self, i: usize) -> u8 {
        assert!(i < self.len);
        // SAFETY: i < len, inside the mapping.
        unsafe { self.ptr.add(i).read_volatile() }
    }

    pub fn fill(&self, b: u8) {
        for i in 0..self.len {
            // SAFETY: i < len, inside the mapping.
            unsafe { self.ptr.add(i).write_volatile(b) }
        }
    }
}

impl Drop for Anonymous {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Whether a TCP socket of this network namespace listens on `port`, IPv4 or IPv6, as the
/// kernel's table shows it. Waiting for a server this way never connects to it: a probe
/// connection is a client to the program under test.
pub fn tcp_listening(port: u16) -> bool {
    tcp_listener(port).is_some()
}

/// The socket inode of the TCP socket listening on `port`, if one does
/// (`/proc/net/tcp{,6}`: local address `ADDR:PORT` in hex, state `0A` = LISTEN, the
/// inode in the tenth column). A server that closes its listening socket and opens a new
/// one shows a new inode.
pub fn tcp_listener(port: u16) -> Option<u64> {
    let suffix = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().find_map(|f| {
        let table = std::fs::read_to_string(f).ok()?;
        table.lines().skip(1).find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() > 9 && cols[1].ends_with(&suffix) && cols[3] == "0A")
                .then(|| cols[9].parse().ok())
                .flatten()
        })
    })
}

/// A TCP port for an SDP socket that nothing uses now: the kernel's pick for a socket
/// bound to port 0, and the port 10000 above it (where siw0's SDP listener for it
/// listens) free too. Numbers derived from the test's pid collided with other tests'
/// ephemeral ports.
pub fn free_sdp_port() -> u16 {
    for _ in 0..100 {
        let Ok(l) = std::net::TcpListener::bind("0.0.0.0:0") else {
            continue;
        };
        let p = l.local_addr().expect("a bound port").port();
        if p.checked_add(10000)
            .is_some_and(|q| std::net::TcpListener::bind(("0.0.0.0", q)).is_ok())
        {
            return p;
        }
    }
    panic!("no free TCP port pair for SDP");
}

/// Read `r` to its end in reads of up to `chunk` bytes (a reader asking for that much
/// each time, as SDP's write zero copy needs to see).
pub fn read_in_chunks(mut r: impl std::io::Read, chunk: usize) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; chunk];
    loop {
        let n = r.read(&mut buf).unwrap();
        if n == 0 {
            return got;
        }
        got.extend_from_slice(&buf[..n]);
    }
}
