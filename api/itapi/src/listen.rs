//! Listening on a connection qualifier (a port), and the connection requests that
//! arrive there until an endpoint accepts them or the consumer rejects them.
//!
//! A request is named by a [`CnEstId`], unique in the process; like the standard's
//! `it_cn_est_identifier_t` it is all [`Endpoint::accept`](crate::Endpoint::accept) and
//! [`CnEstId::reject`] need. Unanswered requests expire after a minute (the provider
//! drops them then).

use crate::evd::Evd;
use crate::event::{ConnRequestEvent, Event, EventStream};
use crate::ia::Ia;
use crate::object::{object_accessors, Common, UseGuard};
use crate::status::{Error, FromVerbs, Result};
use parking_lot::Mutex;
use rnicpi::EventKind;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How long a request waits for an answer.
const PENDING_TTL: Duration = Duration::from_secs(60);

/// A connection request identifier (`it_cn_est_identifier_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CnEstId(pub u64);

impl CnEstId {
    /// Refuse the request, sending `private_data` to the requester (`it_reject`).
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        let p = take(self)?;
        let ia = &p.listener_ia;
        if private_data.len() > ia.private_data_limits().2 {
            return Err(Error::InvalidPdataLength);
        }
        tracing::info!(cn_est_id = self.0, "rejecting connection request");
        p.listener
            .reject(p.conn_id, private_data)
            .it(Error::InvalidCnEstId)
    }
}

/// A request waiting for an answer.
struct Pending {
    listener: Weak<ListenInner>,
    listener_id: u64,
    conn_id: u64,
    peer: Option<SocketAddr>,
    since: Instant,
    ud: bool,
}

/// A taken request: what accept and reject need.
pub(crate) struct Taken {
    pub listener: Arc<ual::Listener>,
    pub listener_ia: Ia,
    pub conn_id: u64,
    pub peer: Option<SocketAddr>,
}

fn pending() -> &'static Mutex<HashMap<u64, Pending>> {
    static PENDING: OnceLock<Mutex<HashMap<u64, Pending>>> = OnceLock::new();
    PENDING.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Take the request `id` (`InvalidCnEstId` when unknown, answered, expired, or its
/// listener is gone).
pub(crate) fn take(id: CnEstId) -> Result<Taken> {
    take_if(id, |_| true)
}

/// Take the request `id` if it is a UD resolution (`ud`) or an RC connection request
/// (`!ud`); else `InvalidEpType`, and it still waits.
pub(crate) fn take_for(id: CnEstId, ud: bool) -> Result<Taken> {
    take_if(id, |p| p.ud == ud)
}

fn take_if(id: CnEstId, fits: impl FnOnce(&Pending) -> bool) -> Result<Taken> {
    let p = {
        let mut all = pending().lock();
        let p = all.get(&id.0).ok_or(Error::InvalidCnEstId)?;
        if !fits(p) {
            return Err(Error::InvalidEpType);
        }
        all.remove(&id.0).ok_or(Error::InvalidCnEstId)?
    };
    let l = p.listener.upgrade().ok_or(Error::InvalidCnEstId)?;
    if p.since.elapsed() > PENDING_TTL {
        return Err(Error::InvalidCnEstId);
    }
    Ok(Taken {
        listener: l.listener.clone(),
        listener_ia: l.ia.clone(),
        conn_id: p.conn_id,
        peer: p.peer,
    })
}

/// A listener (`it_listen_create`): connection requests for its port arrive on a
/// connection-request SEVD.
///
/// ```no_run
/// use krdma_itapi::*;
///
/// let ia = Ia::open("siw0")?;
/// let requests = Evd::create(&ia, EventStream::CmRequest, EvdFlags::empty(), 64, 1, None)?;
/// let listener = Listener::create(&ia, 0, &requests, 0)?; // port 0: pick one
/// println!("listening on port {}", listener.port());
/// if let (Event::ConnRequest(req), _) = requests.wait(None)? {
///     req.cn_est_id.reject(b"not today")?;
/// }
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Listener(pub(crate) Arc<ListenInner>);

object_accessors!(Listener);

pub struct ListenInner {
    ia: Ia,
    evd: Evd,
    listener: Arc<ual::Listener>,
    spigot_id: usize,
    /// Its consumer takes UD service resolutions too ([`Listener::take_ud_requests`]).
    takes_ud: std::sync::atomic::AtomicBool,
    _evd_use: UseGuard,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

/// What [`Listener::query`] reports (`it_listen_param_t`).
#[derive(Debug, Clone)]
pub struct ListenParams {
    pub ia: u64,
    pub spigot_id: usize,
    pub connect_evd: u64,
    pub port: u16,
}

impl Listener {
    /// Listen on `port` (0 picks a free one; see [`port`](Self::port)) of spigot
    /// `spigot_id`, on every address the spigot serves. Requests go to `evd`, a
    /// connection-request SEVD.
    pub fn create(ia: &Ia, spigot_id: usize, evd: &Evd, port: u16) -> Result<Listener> {
        ia.check_alive()?;
        ia.check_spigot(spigot_id)?;
        if evd.stream() != EventStream::CmRequest || evd.0.ia.id() != ia.id() {
            return Err(Error::InvalidConnEvd);
        }
        let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
        let listener =
            ia.0.ctx
                .listen(ia.dev_index(), addr, 1024)
                .it(Error::InvalidConnQual)?;
        let inner = Arc::new(ListenInner {
            common: Common::new(),
            ia: ia.clone(),
            evd: evd.clone(),
            listener,
            spigot_id,
            takes_ud: std::sync::atomic::AtomicBool::new(false),
            _evd_use: evd.0.common.use_guard(),
        });
        ia.route_events(inner.listener.handle, &inner, ListenInner::on_event);
        tracing::info!(
            id = inner.common.id,
            port = inner.listener.port,
            "listening"
        );
        Ok(Listener(inner))
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    /// From now on, hand UD service resolutions to the consumer too (marked
    /// [`ConnRequestEvent::ud`](crate::event::ConnRequestEvent::ud); accepted with a UD
    /// endpoint). Until then they are refused at once: an RC-only consumer never sees them.
    pub fn take_ud_requests(&self) {
        self.0.takes_ud.store(true, Ordering::Relaxed);
    }

    /// The port listened on.
    pub fn port(&self) -> u16 {
        self.0.listener.port
    }

    pub fn query(&self) -> ListenParams {
        ListenParams {
            ia: self.0.ia.id(),
            spigot_id: self.0.spigot_id,
            connect_evd: self.0.evd.id(),
            port: self.port(),
        }
    }
}

impl ListenInner {
    fn on_event(self: &Arc<Self>, ev: rnicpi::Event) {
        if ev.kind != EventKind::ConnectRequest {
            return;
        }
        let ud = ev.ud.is_some();
        if ud && !self.takes_ud.load(Ordering::Relaxed) {
            // A UD service resolution (SIDR) at a listener whose consumer takes RC
            // connections only: the requester hears "rejected" at once rather than
            // waiting out its retries.
            tracing::debug!(listener = self.common.id, peer = ?ev.peer, "UD request refused");
            let _ = self.listener.reject(ev.conn_id, &[]);
            return;
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = CnEstId(NEXT.fetch_add(1, Ordering::Relaxed));
        {
            let mut p = pending().lock();
            p.retain(|_, v| v.since.elapsed() < PENDING_TTL);
            p.insert(
                id.0,
                Pending {
                    listener: Arc::downgrade(self),
                    listener_id: self.common.id,
                    conn_id: ev.conn_id,
                    peer: ev.peer,
                    since: Instant::now(),
                    ud,
                },
            );
        }
        tracing::info!(listener = self.common.id, cn_est_id = id.0, peer = ?ev.peer, "connection request");
        let request = Event::ConnRequest(ConnRequestEvent {
            evd: self.evd.0.obj_ref(),
            cn_est_id: id,
            port: self.listener.port,
            source: ev.peer,
            spigot_id: self.spigot_id,
            ird: ev.ird,
            ord: ev.ord,
            private_data: ev.private_data,
            ud,
        });
        if !self.evd.0.push(request, true) {
            // Nobody will ever see it: refuse it rather than leave the peer waiting.
            let _ = id.reject(&[]);
        }
    }
}

impl Drop for ListenInner {
    fn drop(&mut self) {
        let me = self.common.id;
        pending().lock().retain(|_, v| v.listener_id != me);
        tracing::info!(id = me, "listener freed");
    }
}
