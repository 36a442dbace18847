//! # siw — software iWARP for krdma
//!
//! iWARP exactly as on the wire — MPA (RFC 5044) with the enhanced connection set-up of
//! RFC 6581, DDP (RFC 5041) and RDMAP (RFC 5040) over TCP — so a krdma host talks to a
//! Linux host running kernel siw. [`SiwDevice`] implements the RNIC-PI
//! [`Provider`](rnicpi::Provider): the kAL registers it at start-up as `siw0`.
//!
//! * [`wire`]: MPA frames, FPDU framing with CRC32c, DDP/RDMAP headers, Read Request and
//!   Terminate fields (`mpa`, `fpdu`, `ddp`, `rdmap`, `term`), as packet views and
//!   `Repr`s in the style of `rxe::wire`;
//! * `qp`: the QP engine — requester, responder, Terminate, flush — with one receive and
//!   one transmit thread per connected QP (small requests are transmitted inline by the
//!   doorbell, which never waits for the socket); `orq`: the RDMA Reads outstanding, which
//!   alone may be answered; `llp`: the TCP stream as the engine uses it;
//! * `cm`: connection management — active connect, listen, accept/reject with private
//!   data, over TCP sockets from the kAL's LLP services, on one non-blocking reactor
//!   thread per device;
//! * [`harness`]: the engine over memory against a scripted peer, for fuzzing;
//! * [`sim`]: two engines stepped against each other over a simulated stream, seeded.
//!
//! Not supported: MPA markers (refused, as kernel siw does), memory windows, SRQs.

mod cm;
mod device;
pub mod harness;
mod llp;
mod orq;
mod qp;
pub mod sim;
pub mod wire;

pub use device::{SiwConfig, SiwDevice, UVP_DRIVER};
