//! IT-API ping-pong: Send/Receive round trips between two RC endpoints, reporting the
//! one-way latency.
//!
//! ```sh
//! cargo run --release -p krdma-itapi --example pingpong                      # both ends, loopback
//! cargo run --release -p krdma-itapi --example pingpong -- --server 7471     # one end...
//! cargo run --release -p krdma-itapi --example pingpong -- --client 10.0.0.2:7471
//! ```
//!
//! Sends are posted unsignaled (no completion event unless they fail) and inline when
//! they fit; receives signal. By default each side sleeps in `Evd::wait`; `--spin`
//! polls `Evd::dequeue` instead.

mod common;

use clap::Parser;
use common::{percentile, Peer};
use krdma_itapi::{DtoFlags, Result};
use std::net::SocketAddr;
use std::time::Instant;

/// IT-API ping-pong: Send/Receive round trips over an RC connection.
#[derive(Parser, Clone)]
struct Args {
    #[command(flatten)]
    roles: common::Roles,
    /// Message size in bytes.
    #[arg(long, default_value_t = 64)]
    size: u32,
    /// Round trips.
    #[arg(long, default_value_t = 10_000)]
    iters: u32,
    /// Poll for completions instead of sleeping.
    #[arg(long)]
    spin: bool,
}

/// Post a receive for the next message.
fn post_recv(p: &Peer, size: u32) -> Result<()> {
    p.ep.post_recv(&[p.lmr.segment(0, size)?], 1, DtoFlags::SIGNALED)
}

/// Send the message in the buffer (inline when it fits), unsignaled.
fn send(p: &Peer, size: u32) -> Result<()> {
    if size <= p.ia.limits().max_inline {
        let mut data = vec![0u8; size as usize];
        p.buf().read(0, &mut data);
        p.ep.post_send_inline(&data, 2, DtoFlags::empty())
    } else {
        p.ep.post_send(&[p.lmr.segment(0, size)?], 2, DtoFlags::empty())
    }
}

fn serve(a: &Args, port: u16, on_listen: common::OnListen) -> Result<()> {
    let p = Peer::new(&a.roles.device, a.size as usize, 64)?;
    post_recv(&p, a.size)?;
    p.accept_one(port, b"", on_listen)?;
    for _ in 0..a.iters {
        p.next(a.spin)?;
        post_recv(&p, a.size)?;
        send(&p, a.size)?;
    }
    // The client disconnects.
    p.cm.wait(common::TIMEOUT).map(drop)
}

fn ping(a: &Args, server: SocketAddr) -> Result<()> {
    let p = Peer::new(&a.roles.device, a.size as usize, 64)?;
    p.buf().write(0, &common::pattern(1, a.size as usize));
    post_recv(&p, a.size)?;
    p.connect(server, b"")?;
    let mut lat = Vec::with_capacity(a.iters as usize);
    for _ in 0..a.iters {
        let t = Instant::now();
        send(&p, a.size)?;
        p.next(a.spin)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        post_recv(&p, a.size)?;
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "pingpong over {} ({:?}), {} B, {} round trips, {}: one-way latency median {:.1} µs, p99 {:.1} µs",
        a.roles.device,
        p.ia.transport(),
        a.size,
        a.iters,
        if a.spin { "polling" } else { "sleeping in Evd::wait" },
        percentile(&lat, 50.0),
        percentile(&lat, 99.0),
    );
    p.close()
}

fn main() -> Result<()> {
    common::init_logging();
    let a = Args::parse();
    common::run("pingpong", &a, &a.roles, serve, ping)
}
