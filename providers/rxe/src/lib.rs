//! The software RoCEv2 provider, `rxe0`: the InfiniBand RC transport over UDP port 4791,
//! wire-compatible with Linux `rdma_rxe`.
//!
//! * [`wire`]: parsers and emitters for everything rxe puts on the wire (the IB transport
//!   headers, the RoCEv2 ICRC, the CM MADs rdma_cm exchanges on QP1), checked against
//!   captures of the kernel driver.
//! * `net`: the datagram I/O layer (raw sockets where allowed, so every ICRC is computed
//!   and verified over the real IP header; a plain UDP socket otherwise); `receive`: who
//!   receives from it — the receive thread, or a polling consumer in embedded mode.
//! * `qp`: the queue pair: RC — requester, completer and responder — with PSNs, ACK
//!   coalescing, go-back-N retransmission, RNR handling, read and atomic responder
//!   resources; UD — datagrams addressed through address handles (`ah`).
//! * `cm`: the IB communication manager over QP1 with the rdma_cm conventions.
//! * [`RxeDevice`]: the RNIC-PI provider and its receive, transmit and timer threads.
//!
//! `unsafe` appears only in `net`, at the socket system calls.

mod ah;
mod cm;
mod device;
mod net;
mod qp;
mod random;
mod receive;
pub mod sim;
mod timer;
pub mod wire;

pub use device::{RxeConfig, RxeDevice};
pub use net::bind_udp;
pub use qp::RxeQp;
