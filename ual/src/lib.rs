//! # ual — the krdma user access layer
//!
//! A process opens the kAL through a [`Context`]: the device file `/dev/krdma` served by
//! `krdmad`, or — where no daemon serves it, or with `KRDMA_DEVICE=embedded` — an
//! in-process kAL that receives the very same command structs by function call.
//!
//! Control operations (create/destroy, modify, connect/listen/accept, query) are ioctls.
//! The fast path is not: a [`Qp`] posts work requests into rings shared with the
//! provider's engine and rings a doorbell (a direct call in embedded mode, one eventfd
//! write in daemon mode), and a [`Cq`] is polled in shared memory without a system call.
//!
//! Events (connection, asynchronous, CQ notification) are read by one event thread per
//! context and handed to a small worker pool that runs the handler registered for the
//! object's handle ([`Context::subscribe`]); events of one object stay in order.
//!
//! Every object frees itself on drop, children before parents (a QP holds its PD and CQs).
//!
//! The uAL needs only the ABI crate to reach a daemon; the embedded kAL (and with it the
//! providers, through `krdma-stack`) comes with the default `embedded` feature. Programs
//! built on the uAL (the `krdma` CLI, perftest, rping) live in `krdma-tools`.

mod buffer;
pub mod channel;
mod device;
#[cfg(feature = "embedded")]
pub mod embedded;
mod events;
pub mod oob;
pub mod pin;
mod uvp;
mod verbs;

pub use buffer::RegBuf;
pub use channel::{Channel, Target};
pub use device::DeviceFile;
#[cfg(feature = "embedded")]
pub use embedded::{configure_embedded, embedded_kal};
pub use events::Handler;
pub use verbs::{
    Ah, Armed, Context, Cq, DeviceInfo, FastPathChoice, Listener, Mr, Mw, Pd, PortInfo, Qp,
    QpConfig, Srq, SPIN_BUDGET,
};

pub use abi;
pub use rnicpi::{
    send_flags, wc_flags, Access, ConnParam, Cqe, Event, EventKind, QpAttr, QpAttrMask, QpCaps,
    QpState, QpType, Result, Sge, Transport, UdPeer, VerbsError, WcOpcode, WcStatus, Wqe, WrOpcode,
};
