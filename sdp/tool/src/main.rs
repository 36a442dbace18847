//! `krdma-sdp`: what the SDP stack of every process using it is doing — the offload
//! switch's decisions and counters, and each connection's transport, phase, credits and
//! counters. Each such process answers on the abstract UNIX socket `@krdma-sdp.<pid>`
//! (`krdma_sdp::stats`); this tool finds them in `/proc/net/unix` and asks.
//!
//! ```sh
//! krdma-sdp            # every process
//! krdma-sdp 4242       # one process
//! krdma-sdp --raw      # the reports as the processes send them
//! ```

use clap::Parser;
use comfy_table::Table;
use std::io::Read;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

/// Show the SDP offload switch's decisions and every SDP connection's state.
#[derive(Parser)]
#[command(name = "krdma-sdp")]
struct Args {
    /// Only these processes.
    pids: Vec<u32>,
    /// Print the reports as received.
    #[arg(long)]
    raw: bool,
}

/// Processes that answer SDP reports (from `/proc/net/unix`).
fn processes() -> Vec<u32> {
    let text = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    let mut pids: Vec<u32> = text
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter_map(|p| p.strip_prefix("@krdma-sdp."))
        .filter_map(|p| p.parse().ok())
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

fn ask(pid: u32) -> Option<String> {
    let a = SocketAddr::from_abstract_name(krdma_sdp::stats::socket_name(pid).as_bytes()).ok()?;
    let mut s = UnixStream::connect_addr(&a).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut t = String::new();
    s.read_to_string(&mut t).ok()?;
    Some(t)
}

/// `key=value` pairs of a report line.
fn pairs(line: &str) -> Vec<(&str, &str)> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .collect()
}

fn main() {
    let args = Args::parse();
    let pids = if args.pids.is_empty() {
        processes()
    } else {
        args.pids.clone()
    };
    if pids.is_empty() {
        println!("no process is using SDP");
        return;
    }
    for pid in pids {
        let Some(report) = ask(pid) else {
            eprintln!("{pid}: no answer");
            continue;
        };
        if args.raw {
            print!("{report}");
            continue;
        }
        let mut lines = report.lines();
        println!("{}", lines.next().unwrap_or(""));
        let mut conns = Table::new();
        conns.set_header([
            "device",
            "local",
            "peer",
            "phase",
            "credits",
            "bytes tx (bcopy/zcopy)",
            "bytes rx (bcopy/zcopy)",
            "msgs tx/rx",
            "violations",
        ]);
        let mut n = 0;
        for line in lines {
            if let Some(rest) = line.strip_prefix("switch ") {
                let p = pairs(rest);
                let shown: Vec<String> = p
                    .iter()
                    .filter(|(_, v)| *v != "0")
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                println!(
                    "  switch: {}",
                    if shown.is_empty() {
                        "no decisions yet".into()
                    } else {
                        shown.join(" ")
                    }
                );
            } else if let Some(rest) = line.strip_prefix("waits ") {
                let p = pairs(rest);
                let g = |k: &str| p.iter().find(|(x, _)| *x == k).map_or("-", |(_, v)| *v);
                println!(
                    "  blocking calls' waits: {} ended while polling, {} slept",
                    g("polled"),
                    g("slept")
                );
            } else if let Some(rest) = line.strip_prefix("conn ") {
                let p = pairs(rest);
                let g = |k: &str| {
                    p.iter()
                        .find(|(x, _)| *x == k)
                        .map(|(_, v)| *v)
                        .unwrap_or("-")
                };
                conns.add_row([
                    g("device").to_string(),
                    g("local").to_string(),
                    g("peer").to_string(),
                    g("phase").to_string(),
                    g("credits").to_string(),
                    format!("{}/{}", g("bcopy_tx_bytes"), g("zcopy_tx_bytes")),
                    format!("{}/{}", g("bcopy_rx_bytes"), g("zcopy_rx_bytes")),
                    format!("{}/{}", g("msgs_tx"), g("msgs_rx")),
                    g("violations").to_string(),
                ]);
                n += 1;
            }
        }
        if n > 0 {
            println!("{conns}");
        } else {
            println!("  no SDP connections");
        }
    }
}
