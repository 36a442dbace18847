//! Audit H7 through the daemon: one unprivileged user (`nobody`) exhausts its quotas of
//! contexts, memory windows and mappings in the daemon's address space; root — another
//! user — keeps being served, a bystander of its own included, and the refusals show in
//! the kAL's counters. (The embedded front door's `Config` is tested in
//! `kal/tests/bookkeeping.rs`: there is one user per process there.)

use krdma_tests::{daemon_possible, kal_counter, Bystander, Daemon, FrontDoor};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ual::{Context, FastPathChoice, Target, VerbsError};

const NOBODY: u32 = 65534;
const CONTEXTS: usize = 4;
const MWS: usize = 16;
const MAPPINGS: usize = 12;

/// Take until refused; the refusal must be the per-user quota.
fn exhaust<T>(what: &str, mut take: impl FnMut() -> ual::Result<T>) -> Vec<T> {
    let mut held = Vec::new();
    loop {
        match take() {
            Ok(t) => held.push(t),
            Err(e) => {
                assert_eq!(e, VerbsError::Quota, "{what} refused with the quota error");
                return held;
            }
        }
        assert!(held.len() <= 100_000, "{what} never refused");
    }
}

/// Child mode: runs as `nobody` against the device named by KRDMA_TEST_QUOTA, takes
/// everything its quotas allow, says so, and holds it until its stdin closes.
#[test]
#[ignore = "run as an unprivileged child by one_user_over_quota_leaves_others_served"]
fn greedy_child() {
    let Ok(path) = std::env::var("KRDMA_TEST_QUOTA") else {
        return;
    };
    assert_eq!(nix::unistd::geteuid().as_raw(), NOBODY);
    let target = Target::Device(path.into());
    // The daemon's engine, whose rings are the mappings counted (siw's engine in this
    // process would make its rings here, mirroring only the CQs).
    let contexts = exhaust("contexts", || {
        Context::open_target_with(&target, FastPathChoice::Kal)
    });
    assert_eq!(contexts.len(), CONTEXTS);
    let ctx = &contexts[0];
    let dev = ctx.device("siw0").unwrap().index;
    let pd = ctx.alloc_pd(dev).unwrap();
    let mws = exhaust("memory windows", || ctx.alloc_mw(&pd));
    assert_eq!(mws.len(), MWS);
    let cqs = exhaust("mappings", || ctx.create_cq(dev, 16));
    assert_eq!(cqs.len(), MAPPINGS, "one mapping per completion ring");
    println!("EXHAUSTED");
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop((cqs, mws, pd, contexts));
}

#[test]
fn one_user_over_quota_leaves_others_served() {
    if !daemon_possible() {
        return;
    }
    let quota = |name: &str, n: usize| ["--quota".to_string(), format!("{name}={n}")];
    let args: Vec<String> = [
        quota("contexts", CONTEXTS),
        quota("mws", MWS),
        quota("mappings", MAPPINGS),
    ]
    .concat();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let door = FrontDoor::Daemon(Daemon::start_with(&args));
    let FrontDoor::Daemon(d) = &door else {
        unreachable!()
    };
    let bystander = Bystander::start(&door, "siw0");

    let mut child = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(std::env::current_exe().unwrap())
        .args(["greedy_child", "--exact", "--ignored", "--nocapture"])
        .env("KRDMA_TEST_QUOTA", &d.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run setpriv (util-linux)");
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let exhausted = (|| loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(l) if l.contains("EXHAUSTED") => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
    })();
    if !exhausted {
        let _ = child.kill();
        let status = child.wait().unwrap();
        panic!("the unprivileged child did not exhaust its quotas: {status}");
    }

    // While nobody holds everything it may, root (another user) is served in full.
    let root = door.open();
    let dev = root.device("siw0").unwrap().index;
    let pd = root.alloc_pd(dev).expect("root allocates a PD");
    let mw = root.alloc_mw(&pd).expect("root allocates a window");
    let cq = root.create_cq(dev, 16).expect("root maps a ring");
    for name in ["contexts", "mws", "mappings"] {
        assert!(
            kal_counter(&root, &format!("quota_refused_{name}")) >= 1,
            "refusals of {name} counted"
        );
    }
    drop((cq, mw, pd));

    drop(child.stdin.take()); // let the child go
    let status = child.wait().unwrap();
    assert!(status.success(), "unprivileged child failed: {status}");
    // The daemon ends a context when it sees its opener gone: soon, not at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, rows) = root.stat_contexts().unwrap();
        if rows.iter().all(|r| r.uid != NOBODY) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "nobody's contexts are gone with it"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    bystander.finish().assert_served(Duration::from_secs(2));
}

/// A TCP listener that accepts connections and never answers their MPA requests: every
/// siw CONNECT to it stays half-open for as long as the test needs.
fn silent_listener() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let halt = stop.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while !halt.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((s, _)) = l.accept() {
                held.push(s);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    (addr, stop)
}

fn siw_qp(ctx: &std::sync::Arc<Context>) -> std::sync::Arc<ual::Qp> {
    let dev = ctx.device("siw0").unwrap().index;
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 16).unwrap();
    ctx.create_qp(&pd, &cq, &cq, ual::QpConfig::default())
        .unwrap()
}

/// Audit H7 (threads): a second CONNECT on a QP whose first is under way is refused
/// (each used to cost the daemon a connect thread), through both front doors.
#[test]
fn a_qp_connects_once_at_a_time() {
    krdma_tests::each_front_door(|door| {
        let (addr, stop) = silent_listener();
        let ctx = door.open();
        let qp = siw_qp(&ctx);
        let param = ual::ConnParam::default();
        qp.connect(addr, &param).unwrap();
        for _ in 0..100 {
            assert_eq!(qp.connect(addr, &param), Err(VerbsError::Busy));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}

/// Audit H7 (half-open setups): CONNECTs awaiting their outcome are a per-user quota,
/// held until the outcome arrives (destroying the QP does not end a setup the provider
/// still runs); once the peer ends them, the quota can be taken again.
#[test]
fn half_open_connects_are_a_quota() {
    if !daemon_possible() {
        return;
    }
    let d = Daemon::start_with(&["--quota", "half_open=2"]);
    let (addr, stop) = silent_listener();
    let ctx = Context::open_target(&d.target()).unwrap();
    let param = ual::ConnParam::default();
    let (a, b, c) = (siw_qp(&ctx), siw_qp(&ctx), siw_qp(&ctx));
    a.connect(addr, &param).unwrap();
    b.connect(addr, &param).unwrap();
    assert_eq!(c.connect(addr, &param), Err(VerbsError::Quota));
    assert_eq!(kal_counter(&ctx, "quota_refused_half_open"), 1);
    drop(a);
    // The peer closes the setups it held: their outcome arrives and gives them back.
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match c.connect(addr, &param) {
            Ok(()) => break,
            Err(VerbsError::Quota) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("half-open setups never given back: {e:?}"),
        }
    }
    drop(b);
}
