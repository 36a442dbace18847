//! A non-root process opens a private `/dev/krdma` served by a root `krdmad`, creates PD, CQ,
//! QPs and MRs through ioctl, connects two QPs (connection events arrive through poll/read
//! on the device) and moves data over siw.

use krdma_tests::{crc, daemon_possible, fill_pattern, Daemon};
use std::process::Command;
use tools::perf::connect_pair;
use ual::{send_flags, Context, Target};

const NOBODY: u32 = 65534;

/// Child mode: runs as uid 65534 against the device named by KRDMA_TEST_NONROOT.
#[test]
#[ignore = "run as an unprivileged child by unprivileged_process_uses_the_device"]
fn unprivileged_child() {
    let Ok(path) = std::env::var("KRDMA_TEST_NONROOT") else {
        return;
    };
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        NOBODY,
        "child runs unprivileged"
    );
    let target = Target::Device(path.into());
    let (a, b) = (
        Context::open_target(&target).unwrap(),
        Context::open_target(&target).unwrap(),
    );
    // connect_pair allocates PD, CQ, QP and MR in both contexts, listens, and waits for the
    // connection request and established events, which come from the device's read().
    let len = 64 << 10;
    let (s, c) = connect_pair(&a, &b, "siw0", len, 16).expect("connect over siw0");
    let mut data = vec![0u8; len];
    fill_pattern(&mut data, 7);
    c.buf.write(0, &data);
    s.post_recv(1, 0, len as u32).unwrap();
    c.send(2, 0, len as u32, send_flags::SIGNALED).unwrap();
    s.complete(1).unwrap();
    c.complete(1).unwrap();
    assert_eq!(crc(&s.buf.to_vec()), crc(&data));

    let (_, rows) = a.stat_contexts().unwrap();
    let mine = rows.iter().find(|r| r.id == a.id()).expect("own context");
    assert_eq!(mine.uid, NOBODY, "the daemon saw the caller's uid");
    assert!(mine.pinned_bytes >= len as u64);
    println!("UNPRIVILEGED OK");
}

#[test]
fn unprivileged_process_uses_the_device() {
    if !daemon_possible() {
        return;
    }
    let d = Daemon::start();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(std::env::current_exe().unwrap())
        .args(["unprivileged_child", "--exact", "--ignored", "--nocapture"])
        .env("KRDMA_TEST_NONROOT", &d.path)
        .output()
        .expect("run setpriv (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("UNPRIVILEGED OK"),
        "unprivileged child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
