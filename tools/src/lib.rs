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

pub mod datconf;
pub mod perf;
pub mod perftest;
pub mod pingpong;
pub mod rping;
pub mod udaddy;
