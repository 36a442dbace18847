//! What the daemon lends and keeps of its own rights.
//!
//! * M8: a LISTEN on a privileged port needs the requester's `CAP_NET_BIND_SERVICE`,
//!   through both front doors and on both devices (as a bind, or kernel rdma_cm, would).
//! * L1: `STAT_CONTEXTS` shows a user only its own contexts (root sees all).
//! * L6: once serving, every thread of `krdmad` holds only the six capabilities it needs,
//!   nothing inheritable or ambient, and cannot regain more (bounding set, no_new_privs).
//! * Every thread of `krdmad`, those started on demand too, runs at its nice value
//!   (`kal::priority`, -10 unless `--nice` says otherwise), and so does its session's
//!   scheduling group where the kernel has one and the session is krdmad's own (never
//!   the group of the session it was started from): the engines get a CPU ahead of
//!   polling consumers, as a kernel's network work does.
//! * SIGTERM with clients still connected and moving data: `krdmad` ends promptly, the
//!   device is unmounted, the clients learn that the access layer is gone.
//! * L2: `krdmad` never follows a symbolic link to create or chmod its device file.
//! * A stopped `krdmad` removes the device file it created (one it found stays), and a
//!   client opening a path no daemon serves is told so (`NoDevice`), not given whatever
//!   the first command on a plain file fails with.

use krdma_tests::{
    as_user, child_test, connected_pair, context_row, daemon_possible, krdmad_bin, private_dir,
    say, Bystander, Daemon, FrontDoor, Role,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ual::{Context, Target, VerbsError};

const NOBODY: u32 = 65534;

/// A privileged port nobody listens on here (the test's own, from its pid).
fn privileged_port() -> u16 {
    600 + (std::process::id() % 300) as u16
}

fn listen_errno(ctx: &std::sync::Arc<Context>, device: &str, port: u16) -> i32 {
    let dev = ctx.device(device).unwrap().index;
    let ip = tools::perf::loopback_of(ctx, dev).unwrap();
    match ctx.listen(dev, SocketAddr::new(ip, port), 4) {
        Ok(_) => 0,
        Err(e) => e.errno(),
    }
}

/// Role: an unprivileged tenant asking for privileged and unprivileged ports.
#[test]
#[ignore = "a role of a_privileged_port_needs_cap_net_bind_service"]
fn role_listener() {
    let Ok(door) = std::env::var("KRDMA_TEST_DOOR") else {
        return;
    };
    let target = match door.as_str() {
        "embedded" => {
            krdma_tests::setup_embedded();
            Target::Embedded
        }
        path => Target::Device(path.into()),
    };
    let ctx = Context::open_target(&target).unwrap();
    let port = privileged_port();
    for device in ["siw0", "rxe0"] {
        say(
            &format!("{device}-PRIVILEGED"),
            listen_errno(&ctx, device, port),
        );
        say(&format!("{device}-ANY"), listen_errno(&ctx, device, 0));
    }
}

#[test]
fn a_privileged_port_needs_cap_net_bind_service() {
    let daemon = daemon_possible().then(|| FrontDoor::Daemon(Daemon::start()));
    let bystander = daemon.as_ref().map(|d| Bystander::start(d, "rxe0"));
    let mut doors = vec!["embedded".to_string()];
    if let Some(d) = &daemon {
        doors.push(d.env_value());
    }
    for door in &doors {
        let mut c = child_test("role_listener");
        c.env("KRDMA_TEST_DOOR", door);
        let mut tenant = Role::spawn(as_user(&c, NOBODY));
        for device in ["siw0", "rxe0"] {
            assert_eq!(
                tenant.expect(&format!("{device}-PRIVILEGED")),
                libc::EACCES.to_string(),
                "{door} {device}: a privileged port without the capability"
            );
            assert_eq!(
                tenant.expect(&format!("{device}-ANY")),
                "0",
                "{door} {device}"
            );
        }
        tenant.wait();
    }
    if let Some(d) = daemon.as_ref().and_then(FrontDoor::daemon) {
        // Root may (the daemon lends its right to a caller that has it too).
        let ctx = Context::open_target(&d.target()).unwrap();
        for device in ["siw0", "rxe0"] {
            let errno = listen_errno(&ctx, device, privileged_port());
            assert!(
                errno == 0 || errno == VerbsError::AddrInUse.errno(),
                "root refused: {errno}"
            );
        }
        // The tenant's rxe0 listen was the daemon's to refuse; its siw0 engine ran in the
        // tenant's own process (the default through krdmad), where the kernel refused
        // the unprivileged bind itself.
        let counters: HashMap<String, u64> = ctx.stat_kal().unwrap().into_iter().collect();
        assert!(counters["listen_refused_privileged_port"] >= 1);
    }
    if let Some(b) = bystander {
        b.finish().assert_served(Duration::from_secs(2));
    }
}

/// Role: a tenant of another user looking at the daemon's contexts.
#[test]
#[ignore = "a role of another_users_contexts_are_not_shown"]
fn role_onlooker() {
    let Ok(dev) = std::env::var("KRDMA_TEST_DEVICE") else {
        return;
    };
    let ctx = Context::open_target(&Target::Device(dev.into())).unwrap();
    let (head, rows) = ctx.stat_contexts().unwrap();
    say("MINE", ctx.id());
    for r in rows {
        say("ROW", format!("{} {}", r.id, r.uid));
    }
    say("TOTAL", format!("{} {}", head.total, head.pinned_total));
    let _ = krdma_tests::hear(); // keep the context until the test has looked
}

#[test]
fn another_users_contexts_are_not_shown() {
    if !daemon_possible() {
        return;
    }
    let d = Daemon::start();
    let root = Context::open_target(&d.target()).unwrap();
    let pd = root.alloc_pd(0).unwrap();
    let buf = ual::RegBuf::new(1 << 20).unwrap();
    let _mr = root.reg_buf(&pd, &buf, ual::Access::LOCAL_WRITE).unwrap();
    let mut c = child_test("role_onlooker");
    c.env("KRDMA_TEST_DEVICE", &d.path);
    let mut onlooker = Role::spawn(as_user(&c, NOBODY));
    let mine: u32 = onlooker.expect("MINE").parse().unwrap();
    let total = onlooker.expect("TOTAL");
    let rows: Vec<String> = onlooker
        .said(false)
        .into_iter()
        .filter_map(|l| l.strip_prefix("ROW ").map(String::from))
        .collect();
    assert_eq!(
        rows,
        vec![format!("{mine} {NOBODY}")],
        "only its own context"
    );
    assert_eq!(
        total, "1 0",
        "one context, nothing pinned: root's are not counted"
    );
    // Root sees both.
    assert!(context_row(&root, mine).is_some());
    assert!(context_row(&root, root.id()).is_some());
    onlooker.tell("done");
    onlooker.wait();
}

#[test]
fn krdmad_keeps_only_what_it_needs() {
    if !daemon_possible() {
        return;
    }
    let door = FrontDoor::Daemon(Daemon::start());
    // A connection, so that the threads started on demand exist too.
    let _pair = connected_pair(&door, "siw0", 64);
    let FrontDoor::Daemon(d) = &door else {
        unreachable!()
    };
    let keep: u64 = [7u32, 6, 19, 21, 13, 10].iter().map(|c| 1u64 << c).sum();
    let tasks = std::fs::read_dir(format!("/proc/{}/task", d.pid())).unwrap();
    let mut seen = 0;
    for t in tasks {
        // A short-lived thread (one acting as a tenant, say) may be gone already.
        let Ok(status) = std::fs::read_to_string(t.unwrap().path().join("status")) else {
            continue;
        };
        let field = |n: &str| -> u64 {
            let v = status.lines().find_map(|l| l.strip_prefix(n)).unwrap();
            u64::from_str_radix(v.trim(), 16).unwrap()
        };
        let name = status.lines().next().unwrap();
        for set in ["CapEff:", "CapPrm:", "CapBnd:"] {
            assert_eq!(field(set) & !keep, 0, "{name}: {set} {:#x}", field(set));
        }
        assert_eq!(field("CapInh:"), 0, "{name}");
        assert_eq!(field("CapAmb:"), 0, "{name}");
        assert!(
            status.lines().any(|l| l == "NoNewPrivs:\t1"),
            "{name}: no_new_privs"
        );
        seen += 1;
    }
    assert!(seen >= 5, "krdmad's threads: {seen}");
}

#[test]
fn krdmad_runs_its_threads_ahead_of_consumers() {
    if !daemon_possible() {
        return;
    }
    let group_before = std::fs::read_to_string("/proc/self/autogroup").ok();
    let door = FrontDoor::Daemon(Daemon::start());
    // rxe0's QPs live in krdmad: the connection starts its doorbell thread.
    let _pair = connected_pair(&door, "rxe0", 64);
    let d = door.daemon().unwrap();
    let mut names = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{}/task", d.pid())).unwrap() {
        let t = t.unwrap();
        let Ok(tid) = t.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A short-lived thread may be gone already.
        let (Ok(nice), Ok(name)) = (
            kal::priority::thread_nice(d.pid(), tid),
            std::fs::read_to_string(t.path().join("comm")),
        ) else {
            continue;
        };
        assert_eq!(nice, kal::priority::DEFAULT_NICE, "{}", name.trim());
        names.push(name.trim().to_string());
    }
    for started in ["rxe-rx", "rxe-tx", "fuser-0"] {
        assert!(
            names.iter().any(|n| n == started),
            "no {started}: {names:?}"
        );
    }
    assert!(
        names.iter().any(|n| n.starts_with("krdma-db")),
        "no doorbell thread: {names:?}"
    );
    // Started from the test's session, krdmad leaves that session's group alone.
    assert_eq!(
        std::fs::read_to_string("/proc/self/autogroup").ok(),
        group_before,
        "krdmad changed the nice of a session group it does not own"
    );
}

#[test]
fn krdmad_leading_its_own_session_raises_that_group() {
    if !daemon_possible() || !std::path::Path::new("/proc/self/autogroup").exists() {
        return;
    }
    let dir = private_dir("krdma-session");
    let mut cmd = Command::new(krdmad_bin());
    cmd.arg("--device")
        .arg(dir.join("dev"))
        .arg("--rxe-addr")
        .arg(krdma_tests::private_loopback(231).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // SAFETY: setsid is async-signal-safe; the child has only this thread until exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            nix::unistd::setsid()
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(line.contains("ready"), "{line:?}");
    let group = std::fs::read_to_string(format!("/proc/{}/autogroup", child.id())).unwrap();
    let ours = std::fs::read_to_string("/proc/self/autogroup").unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
    assert_ne!(group, ours, "a session of its own is a group of its own");
    let want = format!("nice {}", kal::priority::DEFAULT_NICE);
    assert!(group.trim_end().ends_with(&want), "{group}");
}

#[test]
fn krdmad_stops_promptly_with_clients_still_connected() {
    if !daemon_possible() {
        return;
    }
    let door = FrontDoor::Daemon(Daemon::start());
    let pairs: Vec<_> = ["siw0", "rxe0"]
        .iter()
        .map(|dev| connected_pair(&door, dev, 64 << 10))
        .collect();
    let FrontDoor::Daemon(mut d) = door else {
        unreachable!()
    };
    // Traffic in flight while the daemon is told to stop.
    for (_, _, s, c) in &pairs {
        s.post_recv(1, 0, 64 << 10).unwrap();
        c.write(2, 0, 64 << 10, 0, 0).unwrap();
    }
    let (status, took) = d
        .terminate(Duration::from_secs(5))
        .expect("krdmad still running 5 s after SIGTERM");
    eprintln!("krdmad ended {took:?} after SIGTERM: {status}");
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(!d.mounted(), "the device is still mounted");
    // The clients learn the access layer is gone (not a hang, not a stale mount).
    let (a, _, s, _) = &pairs[0];
    let t0 = Instant::now();
    loop {
        match a.alloc_pd(s.pd.dev) {
            Err(VerbsError::Dead) => break,
            r => assert!(t0.elapsed() < Duration::from_secs(5), "still {:?}", r.err()),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn krdmad_never_follows_a_symlink_to_its_device() {
    if !daemon_possible() {
        return;
    }
    let dir = private_dir("krdma-link");
    let elsewhere = private_dir("krdma-target");
    let target = elsewhere.join("precious");
    std::fs::write(&target, b"keep").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = dir.join("krdma");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = Command::new(krdmad_bin())
        .arg("--device")
        .arg(&link)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success(), "krdmad served through a symlink");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("symbolic link"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta = std::fs::metadata(&target).unwrap();
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "the target's mode changed"
    );
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

/// `krdmad --device path`, ready; then SIGTERM and its exit.
fn serve_and_stop(path: &std::path::Path) {
    let mut child = Command::new(krdmad_bin())
        .arg("--device")
        .arg(path)
        .arg("--rxe-addr")
        .arg(krdma_tests::private_loopback(230).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert!(line.contains("ready"), "{line:?}");
    let ctx = Context::open_target(&Target::Device(path.into())).expect("served");
    assert!(!ctx.devices().unwrap().is_empty());
    drop(ctx);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_stopped_krdmad_leaves_no_device_file_and_clients_hear_why() {
    if !daemon_possible() {
        return;
    }
    let dir = private_dir("krdma-gone");
    let created = dir.join("made-by-krdmad");
    serve_and_stop(&created);
    assert!(
        !created.exists(),
        "the device file krdmad made is still there"
    );
    let found = dir.join("made-before");
    std::fs::write(&found, b"").unwrap();
    serve_and_stop(&found);
    assert!(found.exists(), "krdmad removed a file it did not make");
    for path in [&created, &found] {
        assert_eq!(
            Context::open_target(&Target::Device(path.clone())).err(),
            Some(VerbsError::NoDevice),
            "{}",
            path.display()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
