//! `kill -9` of a process holding QPs, CQs and MRs through `krdmad`: within one second its
//! context is gone and the pinned bytes are back to the baseline. And `kill -9` of a
//! process in the middle of traffic over siw0 and rxe0, through both front doors: the
//! peer's connection ends, everything it had outstanding completes, and through the
//! daemon the dead process's context and pins are gone within a second.

use krdma_tests::{daemon_possible, Daemon};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ual::{Access, Context, QpConfig, Target};

/// Child mode: hold resources on the device named by KRDMA_TEST_HOLD until killed.
#[test]
#[ignore = "run as a child process by killed_process_is_cleaned_up"]
fn hold_resources() {
    let Ok(path) = std::env::var("KRDMA_TEST_HOLD") else {
        return;
    };
    let ctx = Context::open_target(&Target::Device(path.into())).unwrap();
    let dev = ctx.device("siw0").unwrap().index;
    let pd = ctx.alloc_pd(dev).unwrap();
    let cq = ctx.create_cq(dev, 64).unwrap();
    let qps: Vec<_> = (0..4)
        .map(|_| ctx.create_qp(&pd, &cq, &cq, QpConfig::default()).unwrap())
        .collect();
    let buf = vec![1u8; 1 << 20];
    // SAFETY: `buf` outlives the registration (the process is killed holding both) and
    // is not touched while registered.
    let mr = unsafe {
        ctx.reg_mr(
            &pd,
            buf.as_ptr(),
            buf.len(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
    }
    .unwrap();
    println!("HOLDING ctx={}", ctx.id());
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let _ = (&qps, &mr);
    }
}

#[test]
fn killed_process_is_cleaned_up() {
    if !daemon_possible() {
        return;
    }
    let d = Daemon::start();
    let observer = Context::open_target(&d.target()).unwrap();
    let (base, _) = observer.stat_contexts().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["hold_resources", "--exact", "--ignored", "--nocapture"])
        .env("KRDMA_TEST_HOLD", &d.path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ctx_id: u32 = loop {
        let l = lines.next().expect("child output").unwrap();
        if let Some(rest) = l.strip_prefix("HOLDING ctx=") {
            break rest.trim().parse().unwrap();
        }
    };
    let (during, rows) = observer.stat_contexts().unwrap();
    let row = rows
        .iter()
        .find(|r| r.id == ctx_id)
        .expect("child's context visible");
    assert_eq!((row.qps, row.cqs, row.mrs), (4, 1, 1));
    assert!(during.pinned_total >= base.pinned_total + (1 << 20));

    let killed = Instant::now();
    child.kill().unwrap();
    child.wait().unwrap();
    loop {
        // The context leaves the table first, then its objects are torn down and their
        // pins given back: wait for both, within the second.
        let (now, rows) = observer.stat_contexts().unwrap();
        let gone = !rows.iter().any(|r| r.id == ctx_id);
        if gone && now.pinned_total == base.pinned_total {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "after 1 s: context gone = {gone}, pinned {} (baseline {})",
            now.pinned_total,
            base.pinned_total
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("context gone {:?} after SIGKILL", killed.elapsed());
}

/// Child mode: connect to the survivor named by KRDMA_TEST_PEER over KRDMA_TEST_DEV
/// (through the front door in KRDMA_DEVICE), offer a 1 MiB buffer, post receives, and
/// wait to be killed in the middle of the survivor's traffic.
#[test]
#[ignore = "run as a child process by killed_mid_traffic_*"]
fn hold_connected_traffic() {
    let Ok(peer) = std::env::var("KRDMA_TEST_PEER") else {
        return;
    };
    krdma_tests::setup_embedded();
    let ctx = Context::open_target(&Target::from_env()).unwrap();
    let dev_name = std::env::var("KRDMA_TEST_DEV").unwrap();
    let dev = ctx.device(&dev_name).unwrap().index;
    let ep = tools::perf::connect_endpoint(&ctx, dev, peer.parse().unwrap(), 1 << 20, 16).unwrap();
    for i in 0..8 {
        ep.post_recv(i, i * 64, 64).unwrap();
    }
    println!("CONNECTED ctx={}", ctx.id());
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let _ = &ep;
    }
}

/// What the survivor saw after its peer process was killed.
#[derive(Debug)]
struct Survivor {
    ended: Option<ual::EventKind>,
    ok: u64,
    flushed: u64,
    other: u64,
}

/// `kill -9` a peer process in the middle of RDMA Writes over `dev`, through `door`.
/// The survivor's connection ends and everything it had outstanding completes (flushed)
/// within 10 s; through the daemon, the dead process's context is gone and its pins are
/// back within 1 s.
fn killed_mid_traffic(door: &krdma_tests::FrontDoor, dev_name: &str) -> Survivor {
    use krdma_tests::FrontDoor;
    use ual::{send_flags, EventKind, WcStatus};
    let ctx = door.open();
    let dev = ctx.device(dev_name).unwrap().index;
    let ip = tools::perf::loopback_of(&ctx, dev).unwrap();
    let listener = ctx
        .listen(dev, std::net::SocketAddr::new(ip, 0), 4)
        .unwrap();
    let device_env = match door.target() {
        Target::Embedded => "embedded".to_string(),
        Target::Device(p) => p.display().to_string(),
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "hold_connected_traffic",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(
            "KRDMA_TEST_PEER",
            std::net::SocketAddr::new(ip, listener.port).to_string(),
        )
        .env("KRDMA_TEST_DEV", dev_name)
        .env("KRDMA_DEVICE", device_env)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let s = tools::perf::accept_endpoint(&ctx, dev, &listener, 1 << 20, 16).unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let child_ctx: u32 = loop {
        let l = lines.next().expect("child output").unwrap();
        if let Some(rest) = l.strip_prefix("CONNECTED ctx=") {
            break rest.trim().parse().unwrap();
        }
    };
    // Through the daemon: what stays pinned once the child's context is gone.
    let baseline = match door {
        FrontDoor::Daemon(_) => {
            let (now, rows) = ctx.stat_contexts().unwrap();
            let child = rows
                .iter()
                .find(|r| r.id == child_ctx)
                .expect("child's context");
            now.pinned_total - child.pinned_bytes
        }
        FrontDoor::Embedded => 0,
    };
    // Receives that will never be matched, and a window of 64 KiB Writes kept full.
    for i in 0..4 {
        s.post_recv(1000 + i, 0, 64).unwrap();
    }
    let write = |n: u64| s.write(n, 0, 64 << 10, (n % 16) * (64 << 10), send_flags::SIGNALED);
    let mut posted = 0u64;
    while posted < 8 {
        write(posted).unwrap();
        posted += 1;
    }
    let mut seen = Survivor {
        ended: None,
        ok: 0,
        flushed: 0,
        other: 0,
    };
    let mut killed_at = None;
    let mut outstanding = posted + 4;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut cqes = [ual::Cqe::default(); 16];
    while seen.ended.is_none() || outstanding > 0 {
        if let Some(k) = killed_at {
            let k: Instant = k;
            assert!(
                k.elapsed() < Duration::from_secs(10),
                "10 s after the kill: {seen:?}, {outstanding} outstanding"
            );
        }
        assert!(Instant::now() < deadline, "no kill: {seen:?}");
        if killed_at.is_none() && seen.ok >= 32 {
            child.kill().unwrap();
            killed_at = Some(Instant::now());
        }
        if let Ok(ev) = s.qp.events().try_recv() {
            if matches!(
                ev.kind,
                EventKind::Disconnected | EventKind::ConnectionBroken
            ) {
                seen.ended.get_or_insert(ev.kind);
            }
        }
        let n = s.cq.poll(&mut cqes);
        if n == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        for c in &cqes[..n] {
            outstanding -= 1;
            match c.status() {
                WcStatus::Success => {
                    seen.ok += 1;
                    if seen.ended.is_none() && write(posted).is_ok() {
                        posted += 1;
                        outstanding += 1;
                    }
                }
                WcStatus::WrFlushErr => seen.flushed += 1,
                _ => seen.other += 1,
            }
        }
    }
    let _ = child.wait();
    eprintln!(
        "{dev_name} {}: {seen:?} {:?} after the kill",
        door.name(),
        killed_at.map(|k| k.elapsed())
    );
    if let FrontDoor::Daemon(_) = door {
        let killed = killed_at.unwrap();
        loop {
            let (now, rows) = ctx.stat_contexts().unwrap();
            let gone = !rows.iter().any(|r| r.id == child_ctx);
            if gone && now.pinned_total == baseline {
                break;
            }
            assert!(
                killed.elapsed() < Duration::from_secs(1),
                "after 1 s: context gone = {gone}, pinned {} (baseline {baseline})",
                now.pinned_total
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert!(seen.flushed >= 4, "the receives posted flush: {seen:?}");
    seen
}

#[test]
fn killed_mid_traffic_siw0() {
    krdma_tests::setup_embedded();
    krdma_tests::each_front_door(|door| {
        let by = krdma_tests::Bystander::start(door, "siw0");
        let seen = killed_mid_traffic(door, "siw0");
        by.finish().assert_served(Duration::from_secs(2));
        // A dead process's siw connections end with a reset, never a FIN.
        assert_eq!(seen.ended, Some(ual::EventKind::ConnectionBroken));
    });
}

#[test]
fn killed_mid_traffic_rxe0() {
    krdma_tests::setup_embedded();
    krdma_tests::each_front_door(|door| {
        let by = krdma_tests::Bystander::start(door, "rxe0");
        let seen = killed_mid_traffic(door, "rxe0");
        by.finish().assert_served(Duration::from_secs(2));
        // The IB CM has no abort: through the daemon, which closes the dead process's
        // QPs, the peer gets their DREQ; a dead embedded process sends nothing, and the
        // peer's transport retries run out (a dead peer: a broken connection).
        let expect = match door {
            krdma_tests::FrontDoor::Daemon(_) => ual::EventKind::Disconnected,
            krdma_tests::FrontDoor::Embedded => ual::EventKind::ConnectionBroken,
        };
        assert_eq!(seen.ended, Some(expect));
    });
}
