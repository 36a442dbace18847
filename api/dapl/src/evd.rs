//! Event dispatchers and consumer notification objects.
//!
//! An [`Evd`] is one of the common core's simple event dispatchers, so it waits and
//! wakes exactly as IT-API's do: [`Evd::wait`] sleeps until `threshold` events are
//! queued (checked before sleeping and on every arrival — no lost wake-ups), and the
//! completion queue underneath is polled directly, so dequeuing never waits for an
//! event thread. A [`Cno`] aggregates EVDs: it wakes when one of them gets a
//! notification event, and can be a pollable file descriptor.

use crate::ep::Ep;
use crate::error::{Error, Major, Minor, Result};
use crate::event::*;
use crate::ia::{next_id, Ia};
use crate::mem::Rmr;
use crate::sp::Cr;
use krdma_itapi as it;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

bitflags::bitflags! {
    /// The event streams of an EVD (`DAT_EVD_FLAGS`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct EvdFlags: u32 {
        const SOFTWARE = 0x001;
        const CR = 0x010;
        const DTO = 0x020;
        const CONNECTION = 0x040;
        const RMR_BIND = 0x080;
        const ASYNC = 0x100;
    }
}

/// The largest queue an EVD may have.
pub const MAX_QLEN: usize = it::MAX_QUEUE_SIZE;

/// An event dispatcher (`dat_evd_create`) for one stream: work completions (with RMR
/// binds), connection requests, connection events, asynchronous errors, or software
/// events.
///
/// ```
/// use krdma_dapl::{Event, Evd, EvdFlags, Ia};
/// use std::time::Duration;
///
/// let ia = Ia::open("siw0")?;
/// let evd = Evd::create(&ia, 16, None, EvdFlags::SOFTWARE)?;
/// evd.post_software(0xfeed)?;
/// let (event, more) = evd.wait(Some(Duration::from_secs(1)), 1)?;
/// assert!(matches!(event, Event::Software(0xfeed)));
/// assert_eq!(more, 0);
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Evd(pub(crate) Arc<EvdInner>);

pub struct EvdInner {
    pub(crate) id: u64,
    pub(crate) ia: Ia,
    flags: EvdFlags,
    pub(crate) it: it::Evd,
    cno: Option<Cno>,
    /// The threshold the core SEVD holds now (changed by waits that ask another).
    threshold: Mutex<usize>,
    /// An EVD of several streams, or the async EVD: the other queues and what merges
    /// them (`None`: `it` is the whole EVD).
    merged: Option<Merged>,
}

/// An EVD of several streams: one core SEVD per stream, merged by an aggregate EVD;
/// an async EVD also has a software SEVD carrying tokens of the events this layer
/// raises itself (`Ia::post_async`).
struct Merged {
    aevd: it::Aevd,
    /// The other streams' SEVDs (the first stream's is `EvdInner::it`).
    members: Vec<it::Evd>,
    raised: Option<it::Evd>,
    pending: Mutex<HashMap<u64, AsyncEvent>>,
    next: std::sync::atomic::AtomicU64,
}

/// The core streams of a DAT EVD's flags (RMR binds complete on the DTO stream).
fn streams(flags: EvdFlags) -> Vec<it::EventStream> {
    use it::EventStream as S;
    [
        (EvdFlags::DTO | EvdFlags::RMR_BIND, S::Dto),
        (EvdFlags::CR, S::CmRequest),
        (EvdFlags::CONNECTION, S::CmMessage),
        (EvdFlags::ASYNC, S::AsyncAffiliated),
        (EvdFlags::SOFTWARE, S::Software),
    ]
    .into_iter()
    .filter(|(f, _)| flags.intersects(*f))
    .map(|(_, s)| s)
    .collect()
}

/// What [`Evd::query`] reports (`DAT_EVD_PARAM`).
#[derive(Debug, Clone)]
pub struct EvdParam {
    pub qlen: usize,
    pub flags: EvdFlags,
    pub cno: Option<u64>,
    pub enabled: bool,
}

impl Evd {
    /// Create an EVD holding at least `qlen` events of the streams in `flags` (any
    /// combination: `DTO`, `RMR_BIND`, `CR`, `CONNECTION`, `ASYNC`, `SOFTWARE`). With
    /// `cno` (single-stream EVDs), its notification events trigger the CNO.
    ///
    /// An EVD of several streams merges one queue per stream; it wakes a waiter for
    /// notification events only (completions posted `UNSIGNALLED` are taken by the
    /// next dequeue or wake-up) and waits with a threshold of one. The IA has one
    /// async queue: a merged EVD asking for `ASYNC` when the IA's async EVD exists
    /// leaves that stream to it.
    pub fn create(ia: &Ia, qlen: usize, cno: Option<&Cno>, flags: EvdFlags) -> Result<Evd> {
        if qlen == 0 || qlen > MAX_QLEN {
            return Err(Error::arg(2));
        }
        if flags.is_empty() || flags.bits() & !0x1f1 != 0 {
            return Err(Error::arg(4));
        }
        if let Some(c) = cno {
            if c.0.ia.id() != ia.id() {
                return Err(Error::handle(Minor::HandleCno));
            }
        }
        let mut wanted = streams(flags);
        let is_async = flags.contains(EvdFlags::ASYNC);
        if wanted.len() > 1 && is_async && ia.current_async_evd().is_some() {
            wanted.retain(|s| *s != it::EventStream::AsyncAffiliated);
        }
        let merge = wanted.len() > 1 || wanted == [it::EventStream::AsyncAffiliated];
        if merge && cno.is_some() {
            return Err(Error::of(Major::ModelNotSupported));
        }
        let aevd = if merge {
            Some(it::Aevd::create(ia.core(), it::EvdFlags::empty(), qlen)?)
        } else {
            None
        };
        let aggregate = aevd.clone().or(cno.map(|c| c.0.aevd.clone()));
        let aggregate = aggregate.as_ref();
        let sevd = |stream| {
            it::Evd::create(ia.core(), stream, it::EvdFlags::empty(), qlen, 1, aggregate).map_err(
                |e| match e {
                    it::Error::AsyncAffEvdExists => Error::state(Minor::EvdAsync),
                    other => other.into(),
                },
            )
        };
        let mut sevds = wanted
            .iter()
            .map(|s| sevd(*s))
            .collect::<Result<Vec<_>>>()?;
        let first = sevds.remove(0);
        let merged = match aevd {
            Some(aevd) => Some(Merged {
                raised: if wanted.contains(&it::EventStream::AsyncAffiliated) {
                    Some(sevd(it::EventStream::Software)?)
                } else {
                    None
                },
                aevd,
                members: sevds,
                pending: Mutex::new(HashMap::new()),
                next: std::sync::atomic::AtomicU64::new(1),
            }),
            None => None,
        };
        let inner = Arc::new(EvdInner {
            id: next_id(),
            ia: ia.clone(),
            flags,
            it: first,
            cno: if merged.is_some() { None } else { cno.cloned() },
            threshold: Mutex::new(1),
            merged,
        });
        if let Some(c) = cno {
            c.0.evds
                .lock()
                .insert(inner.it.id(), Arc::downgrade(&inner));
        }
        tracing::debug!(id = inner.id, ?flags, qlen, "EVD created");
        Ok(Evd(inner))
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    pub fn flags(&self) -> EvdFlags {
        self.0.flags
    }

    /// The core SEVD of `stream` in this EVD (`None` when it does not carry it).
    pub(crate) fn core_for(&self, stream: it::EventStream) -> Option<&it::Evd> {
        std::iter::once(&self.0.it)
            .chain(self.0.merged.iter().flat_map(|m| m.members.iter()))
            .find(|e| e.stream() == stream)
    }

    /// Take the oldest event without waiting (`QueueEmpty` when there is none).
    pub fn dequeue(&self) -> Result<Event> {
        loop {
            let ev = match &self.0.merged {
                Some(m) => m.aevd.dequeue()?,
                None => self.0.it.dequeue()?,
            };
            if let Some(ev) = self.0.translate(ev) {
                return Ok(ev);
            }
        }
    }

    /// Wait up to `timeout` (`None`: for ever) until `threshold` events are queued, and
    /// take the oldest; returns it with the number left. One waiter at a time.
    pub fn wait(&self, timeout: Option<Duration>, threshold: usize) -> Result<(Event, usize)> {
        let cap = self.0.it.query().queue_size;
        if threshold == 0 || threshold > cap {
            return Err(Error::arg(3));
        }
        if let Some(m) = &self.0.merged {
            // Two sources: a threshold of one (each arrival is an event to take).
            if threshold > 1 {
                return Err(Error::arg(3));
            }
            let deadline = timeout.map(|t| Instant::now() + t);
            loop {
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                let (ev, more) = m.aevd.wait(left)?;
                if let Some(ev) = self.0.translate(ev) {
                    return Ok((ev, more));
                }
            }
        }
        {
            let mut t = self.0.threshold.lock();
            if *t != threshold {
                self.0.it.set_threshold(threshold)?;
                *t = threshold;
            }
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let (ev, more) = self.0.it.wait(left)?;
            if let Some(ev) = self.0.translate(ev) {
                return Ok((ev, more));
            }
        }
    }

    /// Queue a software event carrying `pointer` (EVDs of the `SOFTWARE` stream).
    pub fn post_software(&self, pointer: u64) -> Result<()> {
        let sevd = self
            .core_for(it::EventStream::Software)
            .ok_or(Error::of(Major::ModelNotSupported))?;
        sevd.post_software(pointer).map_err(Error::from)
    }

    pub fn query(&self) -> EvdParam {
        let q = self.0.it.query();
        EvdParam {
            qlen: q.queue_size,
            flags: self.0.flags,
            cno: self.0.cno.as_ref().map(Cno::id),
            enabled: q.enabled,
        }
    }

    /// Enable or disable notification (a disabled EVD triggers no CNO).
    pub fn set_enabled(&self, enabled: bool) {
        self.0.it.set_enabled(enabled);
        for m in self.0.merged.iter().flat_map(|m| m.members.iter()) {
            m.set_enabled(enabled);
        }
    }

    /// The CNO the EVD triggers.
    pub fn cno(&self) -> Option<&Cno> {
        self.0.cno.as_ref()
    }

    /// Other handles of this EVD: endpoints and service points using it, the IA's
    /// async slot, and clones the caller holds.
    pub fn users(&self) -> usize {
        Arc::strong_count(&self.0) - 1
    }
}

impl EvdInner {
    /// The DAT event for a core event; `None` for one with nothing to report (a
    /// suppressed bind, a completion of an endpoint already freed).
    fn translate(&self, ev: it::Event) -> Option<Event> {
        match ev {
            it::Event::Dto(d) => {
                let ep = self.ia.ep_by_core_id(d.ep.id)?;
                let ep = Ep(ep);
                let status = DtoStatus::of(d.status);
                if d.kind == it::DtoKind::RmrLink {
                    let (rmr, cookie, report) = ep.0.complete_bind(d.cookie)?;
                    if !report && status == DtoStatus::Success {
                        return None;
                    }
                    return Some(Event::RmrBind(RmrBindEvent {
                        rmr: rmr.upgrade().map(Rmr),
                        cookie,
                        status,
                    }));
                }
                Some(Event::Dto(DtoEvent {
                    ep,
                    cookie: d.cookie,
                    status,
                    transferred_length: d.transferred_length,
                    op: DtoOp::of(d.kind),
                    immediate: d.immediate,
                }))
            }
            it::Event::ConnRequest(r) => Cr::arrived(&self.ia, r).map(Event::ConnRequest),
            it::Event::Connection(c) => {
                let ep = Ep(self.ia.ep_by_core_id(c.ep.id)?);
                let kind = ConnEvent::of(&c);
                ep.0.on_connection_event(kind);
                // An endpoint on an SRQ reports its end on the async EVD too (as verbs'
                // last-WQE-reached reaches DAT consumers: dtestsrq waits for it).
                if matches!(kind, ConnEvent::Disconnected | ConnEvent::Broken) && ep.srq().is_some()
                {
                    self.ia.post_async(AsyncEvent {
                        kind: AsyncKind::EpBroken,
                        ep: Some(ep.clone()),
                    });
                }
                Some(Event::Connection(ConnectionEvent {
                    kind,
                    ep,
                    private_data: c.private_data,
                    ud: c.ud,
                }))
            }
            it::Event::Affiliated(a) => {
                let (kind, ep) = match a.cause {
                    it::AffiliatedCause::Ep(e) => {
                        (AsyncKind::EpBroken, self.ia.ep_by_core_id(e.id).map(Ep))
                    }
                    it::AffiliatedCause::Sevd(_) => (AsyncKind::EvdOverflow, None),
                    it::AffiliatedCause::Srq(_) => (AsyncKind::ProviderInternal, None),
                };
                Some(Event::Async(AsyncEvent { kind, ep }))
            }
            it::Event::Unaffiliated(_) => Some(Event::Async(AsyncEvent {
                kind: AsyncKind::IaCatastrophic,
                ep: None,
            })),
            it::Event::Software(s) => match self
                .merged
                .as_ref()
                .and_then(|m| m.raised.as_ref().map(|r| (m, r)))
            {
                Some((m, raised)) if s.evd.id == raised.id() => {
                    m.pending.lock().remove(&s.data).map(Event::Async)
                }
                _ => Some(Event::Software(s.data)),
            },
            it::Event::AevdNotification(_) => None,
        }
    }
}

impl EvdInner {
    /// Raise `ev` on this (async) EVD.
    pub(crate) fn raise(&self, ev: AsyncEvent) {
        let Some((m, raised)) = self
            .merged
            .as_ref()
            .and_then(|m| m.raised.as_ref().map(|r| (m, r)))
        else {
            return;
        };
        let token = m.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        m.pending.lock().insert(token, ev.clone());
        if raised.post_software(token).is_err() {
            m.pending.lock().remove(&token);
            tracing::warn!(evd = self.id, kind = ?ev.kind, "async EVD full: event lost");
        }
    }
}

impl Drop for EvdInner {
    fn drop(&mut self) {
        if let Some(c) = &self.cno {
            c.0.evds.lock().remove(&self.it.id());
        }
        tracing::debug!(id = self.id, "EVD freed");
    }
}

/// A consumer notification object (`dat_cno_create`, `dat_cno_fd_create`): wakes
/// when an attached EVD gets a notification event, and says which.
///
/// ```
/// use krdma_dapl::{Cno, Evd, EvdFlags, Ia};
/// use std::time::Duration;
///
/// let ia = Ia::open("siw0")?;
/// let cno = Cno::create(&ia, true)?;               // with a pollable descriptor
/// let evd = Evd::create(&ia, 8, Some(&cno), EvdFlags::SOFTWARE)?;
/// evd.post_software(1)?;
/// let ready = cno.wait(Some(Duration::from_secs(1)))?;
/// assert_eq!(ready.id(), evd.id());
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Cno(pub(crate) Arc<CnoInner>);

pub struct CnoInner {
    id: u64,
    ia: Ia,
    aevd: it::Aevd,
    /// Attached EVDs by their core SEVD id.
    evds: Mutex<HashMap<u64, Weak<EvdInner>>>,
}

impl Cno {
    /// A CNO; `with_fd` gives it a descriptor readable while an attached EVD has a
    /// notification pending.
    pub fn create(ia: &Ia, with_fd: bool) -> Result<Cno> {
        let mut flags = it::EvdFlags::DEQUEUE_NOTIFICATIONS;
        if with_fd {
            flags |= it::EvdFlags::CREATE_FD;
        }
        let aevd = it::Aevd::create(ia.core(), flags, 1024)?;
        Ok(Cno(Arc::new(CnoInner {
            id: next_id(),
            ia: ia.clone(),
            aevd,
            evds: Mutex::new(HashMap::new()),
        })))
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    /// The descriptor (CNOs made with one).
    pub fn fd(&self) -> Option<RawFd> {
        self.0.aevd.raw_fd()
    }

    /// Wait up to `timeout` for a notification; returns the EVD it came from.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Evd> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let (ev, _) = self.0.aevd.wait(left)?;
            if let it::Event::AevdNotification(n) = ev {
                if let Some(e) = self.0.evds.lock().get(&n.sevd.id).and_then(Weak::upgrade) {
                    return Ok(Evd(e));
                }
            }
        }
    }

    /// The EVD that has a notification pending now, without waiting.
    pub fn trigger(&self) -> Result<Evd> {
        self.wait(Some(Duration::ZERO))
    }

    /// EVDs attached.
    pub fn users(&self) -> usize {
        self.0
            .evds
            .lock()
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}
