//! A program written for it (`tests/c/sdp_mix.c`) under the SDP preload: sockets on SDP
//! (port A) and on TCP (port B, by the policy file) side by side, dup'ed, a fork whose
//! child closes its copies and writes on an inherited TCP socket, a fork whose child
//! exchanges data both ways over inherited SDP and TCP sockets, execs whose new programs
//! write on an inherited SDP and TCP socket, poll, select and epoll over both kinds at once,
//! an orderly close — every message checked, and the program's own SDP report saying
//! which sockets were SDP. Over siw0 and rxe0, embedded front door. And a program that
//! waits for an SDP socket with zero-timeout polls (`tests/c/sdp_poll_zero.c`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn preload() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let p = exe
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("libkrdma_sdp_preload.so");
    assert!(
        p.exists(),
        "{} not built (cargo build -p krdma-sdp-preload)",
        p.display()
    );
    p
}

fn counter(report: &str, name: &str) -> u64 {
    report
        .split_whitespace()
        .filter_map(|w| w.strip_prefix(&format!("{name}=")))
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

/// Compile `tests/c/<name>.c` into `dir`.
fn compile(name: &str, dir: &Path) -> PathBuf {
    let bin = dir.join(name);
    let o = Command::new("cc")
        .args(["-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg(repo().join(format!("tests/c/{name}.c")))
        .arg("-o")
        .arg(&bin)
        .output()
        .expect("run cc");
    assert!(
        o.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    bin
}

/// Build `tests/c/<name>.c` in `dir` and run it under the preload with the embedded kAL on
/// `device` (its rxe0 on an address of its own, `127.<net>.x.y`, as the test processes'
/// are): the peer address first (over rxe0 the address this process's rxe0 serves, else
/// 127.0.0.1), then `args`. It must end with "OK"; returns what it printed.
fn run_program(
    dir: &Path,
    name: &str,
    device: &str,
    net: u8,
    policy: &Path,
    args: &[String],
) -> String {
    let bin = compile(name, dir);
    let pid = std::process::id();
    let rxe_addr = format!("127.{net}.{}.{}", (pid >> 8) as u8, pid as u8);
    let peer = if device == "rxe0" {
        rxe_addr.clone()
    } else {
        "127.0.0.1".into()
    };
    let out = Command::new("timeout")
        .args(["-k", "5", "120"])
        .arg(&bin)
        .arg(peer)
        .args(args)
        .env("LD_PRELOAD", preload())
        .env("KRDMA_DEVICE", "embedded")
        .env("KRDMA_SDP_DEVICE", device)
        .env("KRDMA_RXE_ADDR", &rxe_addr)
        .env("KRDMA_SDP_CONFIG", policy)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.trim_end().ends_with("OK"),
        "{name} failed"
    );
    text
}

fn mix(device: &str) {
    let dir = std::env::temp_dir().join(format!("krdma-sdp-mix-{}-{device}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = krdma_tests::free_sdp_port();
    let b = std::iter::repeat_with(krdma_tests::free_sdp_port)
        .find(|&b| b != a)
        .unwrap();
    let policy = dir.join("sdp.conf");
    std::fs::write(
        &policy,
        format!("use tcp * sdp_mix *:{b}\nuse sdp * sdp_mix *:{a}\n"),
    )
    .unwrap();
    let text = run_program(
        &dir,
        "sdp_mix",
        device,
        40,
        &policy,
        &[a.to_string(), b.to_string()],
    );
    // One connection each way went over SDP, the other over TCP.
    assert_eq!(counter(&text, "connected_sdp"), 1, "{text}");
    assert_eq!(counter(&text, "accepted_sdp"), 1, "{text}");
    assert_eq!(counter(&text, "connect_tcp"), 1, "{text}");
    assert_eq!(counter(&text, "violations"), 0, "{text}");
    // Both SDP sockets were relayed at the first fork, and stayed usable everywhere.
    assert_eq!(counter(&text, "relayed_at_fork"), 2, "{text}");
    assert_eq!(counter(&text, "relay_failed"), 0, "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mix_siw0() {
    mix("siw0");
}

#[test]
fn mix_rxe0() {
    mix("rxe0");
}

/// `tests/c/sdp_poll_zero.c`: after a blocking read leaves its connection unarmed (hot),
/// a program that waits for the next message with zero-timeout polls sees it at once —
/// the poll takes what arrived on the hot connection (`krdma_sdp::conn::hot::poll_hot`);
/// without that only the stack's one-second backstop would show it.
fn poll_zero(device: &str) {
    let dir = std::env::temp_dir().join(format!("krdma-sdp-poll0-{}-{device}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A connect timeout far beyond the default: on a loaded machine a slow SDP connect
    // would fall back to TCP, where there is nothing to test; it is tried again then.
    let policy = dir.join("sdp.conf");
    std::fs::write(&policy, "connect_timeout 30000\n").unwrap();
    let sdp = (0..5).any(|_| {
        let port = krdma_tests::free_sdp_port().to_string();
        let text = run_program(&dir, "sdp_poll_zero", device, 41, &policy, &[port]);
        counter(&text, "connected_sdp") == 1
    });
    assert!(sdp, "every connection fell back to TCP");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn poll_zero_siw0() {
    poll_zero("siw0");
}

#[test]
fn poll_zero_rxe0() {
    poll_zero("rxe0");
}
