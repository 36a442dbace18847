//! # krdma-sdp — the Sockets Direct Protocol over IT-API, and the offload protocol switch
//!
//! | module | holds |
//! |---|---|
//! | [`wire`] | the SDP wire format: BSDH, Hello/HelloAck, every message |
//! | [`proto`] | one connection's protocol state machine, without I/O (time passed in) |

pub mod conn;
pub mod device;
pub mod proto;
pub mod reactor;
pub mod readiness;
pub mod stream;
pub mod wire;

pub use conn::Options;
pub use stream::{SdpListener, SdpStream};
