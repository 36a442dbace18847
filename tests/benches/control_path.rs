//! Control-call round trip through the kAL's two front doors, against a plain FUSE round
//! trip (`poll` with timeout 0 on the same mount: one FUSE_POLL request the daemon answers
//! without kAL work) measured in the same run. Needs root and /dev/fuse for the daemon.
//!
//! `cargo bench -p krdma-tests --bench control_path`

use krdma_tests::{daemon_possible, Daemon};
use std::os::fd::AsRawFd;
use std::time::Instant;
use ual::abi::{self, cmd};
use ual::{Context, Target};

const N: usize = 20_000;

fn median_us(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[v.len() * 99 / 100])
}

fn time(mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..N / 10 {
        f();
    }
    let mut v = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        f();
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    median_us(v)
}

fn query_abi(ctx: &Context) {
    let mut q = abi::QueryAbi {
        version: 0,
        event_size: 0,
        context: 0,
        _pad: 0,
    };
    ctx.channel().call(cmd::QUERY_ABI, &mut q).unwrap();
}

fn main() {
    let embedded = Context::open_target(&Target::Embedded).unwrap();
    let (emb, emb99) = time(|| query_abi(&embedded));
    println!("| path | median µs | p99 µs | ratio to plain FUSE |");
    println!("|---|---|---|---|");
    if !daemon_possible() {
        println!("| embedded QUERY_ABI | {emb:.3} | {emb99:.3} | – |");
        return;
    }
    let d = Daemon::start();
    let ctx = Context::open_target(&d.target()).unwrap();
    let file = std::fs::File::open(&d.path).unwrap();
    let fd = file.as_raw_fd();
    let (plain, plain99) = time(|| {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, timeout 0.
        unsafe { libc::poll(&mut p, 1, 0) };
    });
    let (dev, dev99) = time(|| query_abi(&ctx));
    let dev_id = ctx.device("siw0").unwrap().index;
    let (pd, pd99) = time(|| drop(ctx.alloc_pd(dev_id).unwrap()));
    println!("| plain FUSE round trip (poll, timeout 0) | {plain:.2} | {plain99:.2} | 1.00 |");
    println!(
        "| /dev/krdma ioctl QUERY_ABI | {dev:.2} | {dev99:.2} | {:.2} |",
        dev / plain
    );
    println!(
        "| /dev/krdma ALLOC_PD + DEALLOC_PD (2 ioctls) | {pd:.2} | {pd99:.2} | {:.2} |",
        pd / plain
    );
    println!(
        "| embedded QUERY_ABI (function call) | {emb:.3} | {emb99:.3} | {:.3} |",
        emb / plain
    );
}
