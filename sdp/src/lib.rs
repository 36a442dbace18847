//! # krdma-sdp — the Sockets Direct Protocol over IT-API, and the offload protocol switch
//!
//! | module | holds |
//! |---|---|
//! | [`wire`] | the SDP wire format: BSDH, Hello/HelloAck, every message |
//! | [`proto`] | one connection's protocol state machine, without I/O (time passed in) |

pub mod proto;
pub mod wire;
