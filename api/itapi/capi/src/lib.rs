//! # libitapi — the IT-API v2.1 C interface of krdma
//!
//! `include/it_api.h` declares the interface; this crate builds `libitapi.so` (and an
//! rlib for tests) over the Rust objects of `krdma-itapi`. Every function of the
//! standard is exported: the supported ones map onto the Rust API one to one, the rest
//! return `IT_ERR_OP_NOT_SUPPORTED` (`unsupported`).
//!
//! This is the only place in the IT-API with `unsafe` code: reading and writing the
//! caller's structures. Handles are table keys, never pointers (`handles`); pointers
//! are checked for null and alignment before use (`ffi`); panics become `IT_ERR_ABORT`.
//!
//! Logging: set `RUST_LOG` (e.g. `RUST_LOG=krdma_itapi=debug`) to have libitapi install
//! a `tracing` subscriber writing to stderr on first use.

mod ep;
mod evd;
mod event;
mod ffi;
mod handles;
mod ia;
mod mem;
mod post;
pub mod types;
mod unsupported;

/// The structure sizes and member offsets libitapi was built with (for the layout test).
pub use types::layout;
