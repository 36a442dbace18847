//! # tools — krdma's programs over the uAL
//!
//! What rdma-core keeps apart from libibverbs (its examples, perftest, rping) lives here,
//! apart from the access layer: the `krdma` CLI and the libraries it runs.
//!
//! * [`perf`] — bandwidth and latency between two uAL endpoints, against raw TCP/UDP;
//! * [`perftest`] — `ib_write_bw`/`ib_send_lat`/... compatible with rdma-core's perftest,
//!   both roles, its TCP and rdma_cm control connections;
//! * [`rping`], [`pingpong`] and [`udaddy`] — rdma-core's `rping`, `ibv_rc_pingpong`
//!   (and `ibv_ud_pingpong`) and `udaddy` on the wire;
//! * [`datconf`] — the `dat.conf` lines that register krdma's DAT provider.

/// `println!` for the programs' reports: a reader that went away (`krdma stat | head`)
/// ends the program quietly, as it would a C tool killed by `SIGPIPE`, instead of the
/// panic `println!` makes of the broken pipe (Rust ignores `SIGPIPE`, so that the
/// out-of-band sockets report a vanished peer as an error).
#[macro_export]
macro_rules! outln {
    () => { $crate::write_out(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// What [`outln!`] writes with.
pub fn write_out(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_fmt(text).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("krdma: writing the report: {e}");
            std::process::exit(1);
        }
    }
}

pub mod datconf;
pub mod perf;
pub mod perftest;
pub mod pingpong;
pub mod rping;
pub mod udaddy;
