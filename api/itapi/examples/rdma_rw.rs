//! IT-API RDMA Write and Read with verification: the server exposes its buffer through
//! an RMR (a memory window linked onto its LMR) and sends the RMR context; the client
//! RDMA-Writes a pattern the server checks, then RDMA-Reads one the server wrote and
//! checks it, round after round, and reports the bandwidth.
//!
//! ```sh
//! cargo run --release -p krdma-itapi --example rdma_rw                       # both ends, loopback
//! cargo run --release -p krdma-itapi --example rdma_rw -- --server 7472      # one end...
//! cargo run --release -p krdma-itapi --example rdma_rw -- --client 10.0.0.2:7472
//! ```
//!
//! On a device without memory windows the server hands out its LMR's own context.

mod common;

use clap::Parser;
use common::{pattern, Peer};
use krdma_itapi::{DtoFlags, DtoKind, Error, MemPriv, RdmaAddr, Result, Rmr, RmrType};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// IT-API RDMA Write and Read through an RMR, verified round after round.
#[derive(Parser, Clone)]
struct Args {
    #[command(flatten)]
    roles: common::Roles,
    /// Bytes per RDMA operation.
    #[arg(long, default_value_t = 4 << 20)]
    size: usize,
    #[arg(long, default_value_t = 16)]
    rounds: u64,
}

/// Control messages (8 bytes at the start of the buffer's first page; data from 4 KiB).
const DATA: u64 = 4096;
const WRITTEN: u64 = 1 << 32;
const VERIFIED: u64 = 2 << 32;
const FAILED: u64 = 3 << 32;

fn send_word(p: &Peer, word: u64) -> Result<()> {
    p.ep.post_send_inline(&word.to_le_bytes(), 0, DtoFlags::empty())
}

fn post_recv(p: &Peer) -> Result<()> {
    p.ep.post_recv(&[p.lmr.segment(0, 64)?], 1, DtoFlags::SIGNALED)
}

/// Wait for the next message; returns its first 8 bytes.
fn recv_word(p: &Peer) -> Result<u64> {
    loop {
        let d = p.next(false)?;
        if d.kind == DtoKind::Recv {
            let mut b = [0u8; 8];
            p.buf().read(0, &mut b);
            post_recv(p)?;
            return Ok(u64::from_le_bytes(b));
        }
    }
}

fn check(p: &Peer, seed: u64, len: usize) -> bool {
    let mut got = vec![0u8; len];
    p.buf().read(DATA as usize, &mut got);
    got == pattern(seed, len)
}

fn serve(a: &Args, port: u16, on_listen: common::OnListen) -> Result<()> {
    let p = Peer::new(&a.roles.device, DATA as usize + a.size, 16)?;
    post_recv(&p)?;
    p.accept_one(port, b"", on_listen)?;
    // Expose just the data area, through an RMR when the device has memory windows.
    let data_at = p.lmr.addr() + DATA;
    let (target, rmr) = if p.ia.rmr_support() {
        let rmr = Rmr::create(&p.pz, RmrType::Narrow)?;
        let privs = MemPriv::REMOTE_READ | MemPriv::REMOTE_WRITE;
        let t = rmr.link(
            &p.lmr,
            data_at,
            a.size as u64,
            privs,
            &p.ep,
            9,
            DtoFlags::SIGNALED,
        )?;
        p.complete(9)?;
        (t, Some(rmr))
    } else {
        (p.lmr.rdma_addr(DATA)?, None)
    };
    p.ep.post_send_inline(&target.encode(a.size as u64), 0, DtoFlags::empty())?;
    // Until the client disconnects (which flushes our receive).
    while let Ok(w) = recv_word(&p) {
        if w & !0xffff_ffff != WRITTEN {
            break;
        }
        let round = w & 0xffff_ffff;
        let ok = check(&p, round, a.size);
        p.buf()
            .write(DATA as usize, &pattern(round + 1_000_000, a.size));
        send_word(&p, if ok { VERIFIED } else { FAILED } | round)?;
    }
    if let Some(rmr) = rmr {
        rmr.unlink(&p.ep, 10, DtoFlags::empty())?;
    }
    Ok(())
}

fn client(a: &Args, server: SocketAddr) -> Result<()> {
    let p = Peer::new(&a.roles.device, DATA as usize + a.size, 16)?;
    post_recv(&p)?;
    p.connect(server, b"")?;
    p.next(false)?;
    let mut msg = [0u8; 20];
    p.buf().read(0, &mut msg);
    post_recv(&p)?;
    let (target, len) = RdmaAddr::decode(&msg).ok_or(Error::Abort)?;
    assert_eq!(len, a.size as u64, "server buffer size");
    let area = [p.lmr.segment(DATA, a.size as u32)?];
    let (mut writing, mut reading) = (Duration::ZERO, Duration::ZERO);
    for round in 0..a.rounds {
        p.buf().write(DATA as usize, &pattern(round, a.size));
        let t = Instant::now();
        p.ep.post_rdma_write(&area, round, DtoFlags::SIGNALED, target)?;
        p.complete(round)?;
        writing += t.elapsed();
        // The Send after the Write arrives after the Write has landed.
        send_word(&p, WRITTEN | round)?;
        let answer = recv_word(&p)?;
        if answer != VERIFIED | round {
            eprintln!("round {round}: the server found the written data wrong");
            return Err(Error::Abort);
        }
        p.buf().fill(0);
        let t = Instant::now();
        p.ep.post_rdma_read(&area, round, DtoFlags::SIGNALED, target)?;
        p.complete(round)?;
        reading += t.elapsed();
        if !check(&p, round + 1_000_000, a.size) {
            eprintln!("round {round}: the data read back is wrong");
            return Err(Error::Abort);
        }
    }
    let gbps = |d: Duration| (a.rounds * a.size as u64) as f64 * 8.0 / d.as_secs_f64() / 1e9;
    println!(
        "rdma_rw over {} ({:?}): {} rounds of {} KiB verified; RDMA Write {:.2} Gbit/s, RDMA Read {:.2} Gbit/s",
        a.roles.device,
        p.ia.transport(),
        a.rounds,
        a.size / 1024,
        gbps(writing),
        gbps(reading)
    );
    p.close()
}

fn main() -> Result<()> {
    common::init_logging();
    let a = Args::parse();
    common::run("rdma_rw", &a, &a.roles, serve, client)
}
