//! # krdma-sdp — the Sockets Direct Protocol over IT-API, and the offload protocol switch
//!
//! | module | holds |
//! |---|---|
//! | [`wire`] | the SDP wire format: BSDH, Hello/HelloAck, every message |
//! | [`proto`] | one connection's protocol state machine, without I/O (time passed in) |
//! | [`conn`] | one connection driven over an IT-API endpoint |
//! | [`stream`] | [`SdpStream`], [`SdpListener`]: sockets in `std::net`'s shape |
//! | [`readiness`] | the socket's readiness face, a real descriptor for poll/select/epoll |
//! | [`reactor`] | the progress thread |
//! | [`device`] | the adapters, opened once per process |
//! | [`switch`] | the offload protocol switch: policy file and decision counters |
//! | [`stats`] | the per-process report `krdma-sdp` reads |

#[cfg(feature = "stack")]
pub mod conn;
#[cfg(feature = "stack")]
pub mod device;
pub mod proto;
#[cfg(feature = "stack")]
pub mod reactor;
#[cfg(feature = "stack")]
pub mod readiness;
#[cfg(feature = "stack")]
pub mod stats;
#[cfg(feature = "stack")]
pub mod stream;
pub mod switch;
pub mod wire;

#[cfg(feature = "stack")]
pub use conn::Options;
#[cfg(feature = "stack")]
pub use stream::{SdpListener, SdpStream};
