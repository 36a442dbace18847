//! `kill -9` of a process holding QPs, CQs and MRs through `krdmad`: within one second its
//! context is gone and the pinned bytes are back to the baseline.

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
    let mr = ctx
        .reg_mr(
            &pd,
            buf.as_ptr(),
            buf.len(),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
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
