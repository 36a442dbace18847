//! Audit H7 through the daemon: one unprivileged user (`nobody`) exhausts its quotas of
//! contexts, memory windows and mappings in the daemon's address space; root — another
//! user — keeps being served, a bystander of its own included, and the refusals show in
//! the kAL's counters. (The embedded front door's `Config` is tested in
//! `kal/tests/bookkeeping.rs`: there is one user per process there.)

use krdma_tests::{daemon_possible, kal_counter, Bystander, Daemon, FrontDoor};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::Duration;
use ual::{Context, Target, VerbsError};

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
    let contexts = exhaust("contexts", || Context::open_target(&target));
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
    let (_, rows) = root.stat_contexts().unwrap();
    assert!(
        rows.iter().all(|r| r.uid != NOBODY),
        "nobody's contexts are gone with it"
    );
    bystander.finish().assert_served(Duration::from_secs(2));
}
