//! # krdma-itapi — IT-API v2.1 over the krdma uAL
//!
//! The Interconnect Transport API (The Open Group, v2.1) in idiomatic Rust, keeping the
//! standard's object model and semantics so an IT-API programmer recognises every piece.
//! The same objects back `libitapi`, the standard's C interface (crate
//! `krdma-itapi-capi`, header `include/it_api.h`).
//!
//! | IT-API | here |
//! |---|---|
//! | interface adapter (`it_ia_*`, `it_interface_list`) | [`Ia`], [`interface_list`] |
//! | protection zone (`it_pz_*`) | [`Pz`] |
//! | simple / aggregate event dispatcher (`it_evd_*`) | [`Evd`] / [`Aevd`] |
//! | events (`it_event_t`) | [`Event`] |
//! | RC endpoint (`it_ep_rc_create`, `it_ep_*`) | [`Endpoint`] |
//! | listen point, connection request (`it_listen_*`, `it_reject`) | [`Listener`], [`CnEstId`] |
//! | LMR, segment (`it_lmr_*`, `it_lmr_triplet_t`) | [`Lmr`], [`Segment`] |
//! | RMR (`it_rmr_*`), RMR context | [`Rmr`], [`RdmaAddr`] |
//! | shared receive queue (`it_srq_*`) | [`Srq`] |
//! | `it_status_t` | [`Error`] |
//!
//! Objects are reference-counted handles: clone them freely; the resources go away when
//! the last handle is dropped, children before parents (an endpoint keeps its PZ and
//! EVDs alive, an LMR its PZ). Events never keep objects alive: they name them by id,
//! with a weak reference ([`EpRef::endpoint`]).
//!
//! Everything works on any device of the stack (iWARP `siw0`, RoCE `rxe0`, both tested
//! through both front doors). What the transport decides — private-data limits and how
//! received private data looks, how paths are spelled, atomics, what an abortive close
//! does — comes from the device ([`Ia::query`]); `docs/itapi.md` has the table.
//!
//! ## A connection, end to end
//!
//! ```no_run
//! use krdma_itapi::*;
//! use std::time::Duration;
//! use ual::RegBuf;
//!
//! let t = Some(Duration::from_secs(5));
//! let ia = Ia::open("siw0")?;
//! let pz = Pz::create(&ia)?;
//! let dto = Evd::create(&ia, EventStream::Dto, EvdFlags::empty(), 64, 1, None)?;
//! let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 8, 1, None)?;
//! let req = Evd::create(&ia, EventStream::CmRequest, EvdFlags::empty(), 8, 1, None)?;
//!
//! // Server side: listen, take the request, accept it on a fresh endpoint.
//! let listener = Listener::create(&ia, 0, &req, 0)?;
//! let server = Endpoint::create_rc(&pz, &dto, &dto, &cm, EpAttributes::default(), None)?;
//! // (the client connects to `listener.port()` from elsewhere)
//! let Event::ConnRequest(r) = req.wait(t)?.0 else { panic!() };
//! let buf = Lmr::create(&pz, RegBuf::new(4096).unwrap(), MemPriv::LOCAL)?;
//! server.post_recv(&[buf.segment(0, 4096)?], 1, DtoFlags::SIGNALED)?;
//! server.accept(r.cn_est_id, b"welcome")?;
//! let Event::Connection(c) = cm.wait(t)?.0 else { panic!() };
//! assert_eq!(c.kind, ConnEventKind::Established);
//!
//! // A message arrives: its completion carries the cookie we posted with.
//! let Event::Dto(d) = dto.wait(t)?.0 else { panic!() };
//! assert_eq!((d.kind, d.cookie, d.status), (DtoKind::Recv, 1, DtoStatus::Success));
//! server.disconnect()?;
//! # let _ = listener;
//! # Ok::<(), Error>(())
//! ```
//!
//! See `examples/` for complete client/server programs: `pingpong`, `rdma_rw` and
//! `many_connections` (one AEVD serving hundreds of endpoints).
//!
//! ## Front doors
//!
//! An [`Ia`] opens its own uAL context on the front door `KRDMA_DEVICE` selects (the
//! `krdmad` device file, or the embedded kAL); [`Ia::open_on`] picks one explicitly.

#![deny(unsafe_code)]

mod ep;
mod evd;
mod event;
mod ia;
mod listen;
mod lmr;
mod object;
mod pz;
mod rmr;
mod srq;
mod status;

pub use ep::{
    AtomicOp, DtoFlags, Endpoint, EpAttributes, EpChange, EpParams, EpState, RDMA_UDP_QKEY,
};
pub use evd::{Aevd, Callback, Evd, EvdFlags, EvdParams, MAX_QUEUE_SIZE};
pub use event::{
    AevdNotification, AffiliatedCause, AffiliatedEvent, ConnEventKind, ConnRequestEvent,
    ConnectionEvent, DtoEvent, DtoKind, DtoStatus, EpRef, EvdRef, Event, EventNumber, EventStream,
    Immediate, ObjRef, RejectReason, SoftwareEvent, UdRemote, UnaffiliatedEvent, EVENT_STREAM_MASK,
};
pub use ia::{
    interface_list, interface_list_on, Ia, IaInfo, Interface, Limits, SpigotInfo, Transport,
    API_MAJOR_VERSION, API_MINOR_VERSION,
};
pub use listen::{CnEstId, ListenParams, Listener};
pub use lmr::{Lmr, MemPriv, RdmaAddr, RmrContext, Segment};
pub use object::Watch;
pub use pz::Pz;
pub use rmr::{Rmr, RmrParams, RmrType};
pub use srq::{Srq, SrqParams};
pub use status::{Error, Result};

/// The most segments one work request carries (the device may allow fewer).
pub const MAX_SEGMENTS: usize = rnicpi::MAX_SGE;

/// The uAL front door selection, re-exported for [`Ia::open_on`].
pub use ual::Target;
