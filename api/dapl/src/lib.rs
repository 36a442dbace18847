//! # krdma-dapl — uDAPL (DAT 2.0) over the krdma uAL
//!
//! The Direct Access Transport's object model in idiomatic Rust, for new code; the same
//! objects back `libdaplkrdma.so`, the DAT provider unmodified uDAPL programs load
//! through the system's `libdat2` (crate `krdma-dapl-provider`, `docs/dapl.md`).
//!
//! | DAT 2.0 | here |
//! |---|---|
//! | interface adapter (`dat_ia_open`, `dat_ia_query`) | [`Ia`], [`IaAttr`], [`ProviderAttr`] |
//! | protection zone | [`Pz`] |
//! | event dispatcher, events (`dat_evd_*`, `DAT_EVENT`) | [`Evd`], [`Event`] |
//! | consumer notification object (`dat_cno_*`) | [`Cno`] |
//! | endpoint (`dat_ep_*`), completion flags | [`Ep`], [`EpAttr`], [`Completion`] |
//! | public / reserved service point, connection request | [`Psp`], [`Rsp`], [`Cr`] |
//! | LMR, RMR, triplets | [`Lmr`], [`Rmr`], [`LmrTriplet`], [`RmrTriplet`] |
//! | shared receive queue | [`Srq`] |
//! | IB extensions (`dat_ib_extensions.h`): atomics, UD | [`Ep::post_atomic`], [`EpAttr::ud`], [`Ep::post_send_ud`] |
//! | `DAT_RETURN` | [`Error`] ([`Major`], [`Minor`]) |
//!
//! ## One core under two APIs
//!
//! uDAPL and IT-API are two spellings of one model, so this crate is built on the
//! objects of `krdma-itapi` rather than on a second copy of them: an [`Evd`] is one of
//! its event dispatchers (the same queue, thresholds and wake-ups — a waiter is never
//! left asleep with its events there), an [`Ep`] one of its endpoints (the same
//! connection set-up with private data, graceful and abortive close, and mapping of
//! completions to events, flushed ones included), an [`Lmr`] and [`Rmr`] its
//! registrations and windows. What is DAT's own lives here: the naming of LMRs by
//! context, service points and connection-request objects, CNOs, endpoint reset,
//! RMR-bind events, and the DAT error codes.
//!
//! Objects are reference-counted handles: clone them freely; a resource goes away when
//! its last handle is dropped, and a child keeps its parents alive (an endpoint its PZ
//! and EVDs, an LMR its PZ), so they are freed children first.
//!
//! ## A connection with an RDMA Write, end to end
//!
//! ```
//! use krdma_dapl::*;
//! use std::time::Duration;
//!
//! let t = Some(Duration::from_secs(10));
//! let ia = Ia::open("krdma-siw0")?;
//! let pz = Pz::create(&ia)?;
//! let evd = |flags| Evd::create(&ia, 16, None, flags);
//! let (cr_evd, s_conn, s_dto, c_conn, c_dto) = (
//!     evd(EvdFlags::CR)?, evd(EvdFlags::CONNECTION)?, evd(EvdFlags::DTO)?,
//!     evd(EvdFlags::CONNECTION)?, evd(EvdFlags::DTO)?,
//! );
//! let server = Ep::create(&pz, &s_dto, &s_dto, &s_conn, EpAttr::default(), None)?;
//! let client = Ep::create(&pz, &c_dto, &c_dto, &c_conn, EpAttr::default(), None)?;
//! let target = Lmr::create(&pz, ual::RegBuf::new(4096).unwrap(), MemPriv::ALL)?;
//! let source = Lmr::create(&pz, ual::RegBuf::new(4096).unwrap(), MemPriv::ALL)?;
//! source.buffer().unwrap().write(0, b"hello, DAT");
//!
//! // The server listens; the client connects and offers private data.
//! let psp = Psp::create_any(&ia, &cr_evd)?;
//! let at = std::net::SocketAddr::new(ia.query().address.unwrap(), psp.conn_qual() as u16);
//! client.connect(at, b"hi")?;
//! let Event::ConnRequest(cr) = cr_evd.wait(t, 1)?.0 else { panic!() };
//! assert_eq!(&cr.private_data()[..2], b"hi");
//! cr.accept(Some(&server), b"welcome")?;
//! for conn in [&s_conn, &c_conn] {
//!     let Event::Connection(c) = conn.wait(t, 1)?.0 else { panic!() };
//!     assert_eq!(c.kind, ConnEvent::Established);
//! }
//!
//! // RDMA Write into the server's LMR, through the RMR triplet it would hand out.
//! let remote = target.rmr_triplet(0, 10)?;
//! client.post_rdma_write(&[source.triplet(0, 10)?], 7, &remote, Completion::DEFAULT)?;
//! let Event::Dto(d) = c_dto.wait(t, 1)?.0 else { panic!() };
//! assert_eq!((d.cookie, d.status, d.op), (7, DtoStatus::Success, DtoOp::RdmaWrite));
//!
//! // (On iWARP a Write completes once sent: what follows it on the connection — here
//! // the close — arrives after it.)
//! client.disconnect(false)?;
//! let Event::Connection(c) = s_conn.wait(t, 1)?.0 else { panic!() };
//! assert_eq!(c.kind, ConnEvent::Disconnected);
//! let mut got = [0u8; 10];
//! target.buffer().unwrap().read(0, &mut got);
//! assert_eq!(&got, b"hello, DAT");
//! # drop(psp);
//! # Ok::<(), Error>(())
//! ```
//!
//! `examples/rdma_write.rs` is the same as a client/server program.
//!
//! ## Front doors and devices
//!
//! An [`Ia`] opens its own uAL context on the front door `KRDMA_DEVICE` selects (the
//! `krdmad` device file, or the embedded kAL); [`Ia::open_on`] picks one. Devices:
//! `siw0` (iWARP) and `rxe0` (RoCEv2; the IB extension's atomics).

#![deny(unsafe_code)]

mod ep;
mod error;
mod evd;
mod event;
mod ia;
mod mem;
mod pz;
mod sp;
mod srq;

pub use ep::{Completion, Ep, EpAttr, EpParam, EpState};
pub use error::{Error, Major, Minor, Result, CLASS_ERROR};
pub use evd::{Cno, Evd, EvdFlags, EvdParam, MAX_QLEN};
pub use event::{
    AsyncEvent, AsyncKind, ConnEvent, ConnectionEvent, DtoEvent, DtoOp, DtoStatus, Event,
    RmrBindEvent,
};
pub use ia::{Extension, Ia, IaAttr, ProviderAttr, DAT_VERSION, IB_EXTENSION_VERSION, NAME_PREFIX};
pub use krdma_itapi::{AtomicOp, Immediate};
pub use mem::{Lmr, LmrTriplet, MemPriv, Rmr, RmrParam, RmrTriplet};
pub use pz::Pz;
pub use sp::{Cr, Psp, Rsp};
pub use srq::Srq;

/// The port a connection qualifier names: its low 16 bits (the RDMA CM's rule for
/// service IDs, which DAT providers over it follow; the transports have 16-bit ports).
pub fn port_of(conn_qual: u64) -> u16 {
    conn_qual as u16
}
