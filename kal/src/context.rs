//! Resource management: the per-open-file context, the root of its resource tree.
//!
//! Handles are numbers private to one context: they index this context's own table and
//! nothing else, so no process can name another's objects, whatever number it guesses.
//! Objects hold use counts of their parents (PD ← QP/MR, CQ ← QP) and a parent in use
//! cannot be destroyed; tearing a context down destroys children first. Each object
//! holds its quota [`Charges`] (given back when it is gone), and so does the context.

use crate::doorbell::Doorbells;
use crate::events::EventQueue;
use crate::peer::{Caller, Peer};
use crate::quota::{Charge, Charges};
use parking_lot::Mutex;
use rnicpi::{
    Event, EventKind, EventSink, MemoryAccess, Provider, ProviderCq, ProviderListener, ProviderQp,
    ProviderSrq, Region, Result, VerbsError,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Most objects of each kind one context may hold (configurable, `Config::limits`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub pds: u32,
    pub cqs: u32,
    pub qps: u32,
    pub mrs: u32,
    pub listeners: u32,
    pub srqs: u32,
    pub mws: u32,
    pub ahs: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            pds: 1024,
            cqs: 8192,
            qps: 8192,
            mrs: 65536,
            listeners: 1024,
            srqs: 1024,
            mws: 65536,
            ahs: 65536,
        }
    }
}

pub enum Object {
    Pd {
        dev: u32,
        pd: u32,
        users: u32,
    },
    Cq {
        dev: u32,
        cq: Arc<dyn ProviderCq>,
        users: u32,
    },
    Qp {
        dev: u32,
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        /// SRQ handle, 0 for none.
        srq: u32,
        qp: Arc<dyn ProviderQp>,
        doorbell: Option<u64>,
        /// The QP's connection as the quotas see it.
        conn: Arc<ConnAccount>,
    },
    Srq {
        dev: u32,
        pd: u32,
        srq: Arc<dyn ProviderSrq>,
        users: u32,
    },
    Mw {
        dev: u32,
        pd: u32,
        key: u32,
    },
    /// An address handle: `ah` is the provider's number, which UD Sends name.
    Ah {
        dev: u32,
        pd: u32,
        ah: u32,
    },
    Mr {
        dev: u32,
        pd: u32,
        region: Arc<Region>,
        pinned: u64,
    },
    Listener {
        dev: u32,
        listener: Arc<dyn ProviderListener>,
    },
    /// An object the consumer created through its device's user verbs provider
    /// (`rnicpi::user`): the kAL holds its place in the tree, its charges and pinned
    /// bytes, never the object itself.
    Mirror {
        dev: u32,
        kind: Kind,
        /// Parent handles (PD first), 0 for none.
        parents: [u32; 4],
        pinned: u64,
        users: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Listener = 0,
    Qp = 1,
    Srq = 2,
    Mw = 3,
    Ah = 4,
    Mr = 5,
    Cq = 6,
    Pd = 7,
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Pd { .. } => Kind::Pd,
            Object::Cq { .. } => Kind::Cq,
            Object::Qp { .. } => Kind::Qp,
            Object::Mr { .. } => Kind::Mr,
            Object::Listener { .. } => Kind::Listener,
            Object::Srq { .. } => Kind::Srq,
            Object::Mw { .. } => Kind::Mw,
            Object::Ah { .. } => Kind::Ah,
            Object::Mirror { kind, .. } => *kind,
        }
    }

    /// Bytes of the user's pin allowance the object holds.
    pub fn pinned(&self) -> u64 {
        match self {
            Object::Mr { pinned, .. } | Object::Mirror { pinned, .. } => *pinned,
            _ => 0,
        }
    }
}

/// Counts per kind, for limits and `krdma stat`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub pds: u32,
    pub cqs: u32,
    pub qps: u32,
    pub mrs: u32,
    pub listeners: u32,
    pub srqs: u32,
    pub mws: u32,
    pub ahs: u32,
}

/// An object with what it is charged.
struct Entry {
    obj: Object,
    charges: Charges,
}

#[derive(Default)]
pub struct Objects {
    next: u32,
    map: BTreeMap<u32, Entry>,
    pub counts: Counts,
    pub pinned: u64,
}

impl Objects {
    fn slot(&mut self, kind: Kind) -> &mut u32 {
        match kind {
            Kind::Pd => &mut self.counts.pds,
            Kind::Cq => &mut self.counts.cqs,
            Kind::Qp => &mut self.counts.qps,
            Kind::Mr => &mut self.counts.mrs,
            Kind::Listener => &mut self.counts.listeners,
            Kind::Srq => &mut self.counts.srqs,
            Kind::Mw => &mut self.counts.mws,
            Kind::Ah => &mut self.counts.ahs,
        }
    }

    /// Fail with `Exhausted` when one more object of `kind` would pass `limits`.
    pub fn check_limit(&mut self, kind: Kind, limits: &Limits) -> Result<()> {
        let max = match kind {
            Kind::Pd => limits.pds,
            Kind::Cq => limits.cqs,
            Kind::Qp => limits.qps,
            Kind::Mr => limits.mrs,
            Kind::Listener => limits.listeners,
            Kind::Srq => limits.srqs,
            Kind::Mw => limits.mws,
            Kind::Ah => limits.ahs,
        };
        if *self.slot(kind) >= max {
            rnicpi::warn_limited!(?kind, max, "per-context limit reached");
            return Err(VerbsError::Exhausted);
        }
        Ok(())
    }

    /// Reserve the handle the next inserted object will get (needed by event sinks).
    pub fn next_handle(&mut self) -> Result<u32> {
        let map = &self.map;
        rnicpi::ids::next_free(&mut self.next, map.len(), |h| map.contains_key(&h))
            .ok_or(VerbsError::Exhausted)
    }

    /// Put an object in the table; its parents count it as a user until it is removed.
    pub fn insert(&mut self, handle: u32, obj: Object, charges: Charges) {
        for p in Self::parents(&obj) {
            self.use_parent(p, 1);
        }
        *self.slot(obj.kind()) += 1;
        self.pinned += obj.pinned();
        self.map.insert(handle, Entry { obj, charges });
    }

    pub fn get(&self, handle: u32) -> Result<&Object> {
        self.map
            .get(&handle)
            .map(|e| &e.obj)
            .ok_or(VerbsError::NoSuchResource)
    }

    pub fn get_mut(&mut self, handle: u32) -> Result<&mut Object> {
        self.map
            .get_mut(&handle)
            .map(|e| &mut e.obj)
            .ok_or(VerbsError::NoSuchResource)
    }

    /// Take an object out of the table; its charges are given back when the caller
    /// drops them, after destroying it.
    pub fn remove(&mut self, handle: u32) -> Option<(Object, Charges)> {
        let Entry { obj, charges } = self.map.remove(&handle)?;
        for p in Self::parents(&obj) {
            self.use_parent(p, -1);
        }
        *self.slot(obj.kind()) -= 1;
        self.pinned -= obj.pinned();
        Some((obj, charges))
    }

    pub fn pd(&self, handle: u32) -> Result<(u32, u32)> {
        match self.get(handle)? {
            Object::Pd { dev, pd, .. } => Ok((*dev, *pd)),
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    pub fn cq(&self, handle: u32) -> Result<(u32, Arc<dyn ProviderCq>)> {
        match self.get(handle)? {
            Object::Cq { dev, cq, .. } => Ok((*dev, cq.clone())),
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    pub fn qp(&self, handle: u32) -> Result<(u32, Arc<dyn ProviderQp>)> {
        self.qp_conn(handle).map(|(dev, qp, _)| (dev, qp))
    }

    /// A QP with its connection account.
    pub fn qp_conn(&self, handle: u32) -> Result<(u32, Arc<dyn ProviderQp>, Arc<ConnAccount>)> {
        match self.get(handle)? {
            Object::Qp { dev, qp, conn, .. } => Ok((*dev, qp.clone(), conn.clone())),
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    pub fn srq(&self, handle: u32) -> Result<(u32, u32, Arc<dyn ProviderSrq>)> {
        match self.get(handle)? {
            Object::Srq { dev, pd, srq, .. } => Ok((*dev, *pd, srq.clone())),
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    pub fn listener(&self, handle: u32) -> Result<(u32, Arc<dyn ProviderListener>)> {
        match self.get(handle)? {
            Object::Listener { dev, listener } => Ok((*dev, listener.clone())),
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    /// A mirrored object of `kind` on device `dev` (the parent of another mirror).
    pub fn mirror(&self, handle: u32, dev: u32, kind: Kind) -> Result<()> {
        match self.get(handle)? {
            Object::Mirror {
                dev: d, kind: k, ..
            } if *d == dev && *k == kind => Ok(()),
            _ => Err(VerbsError::NoSuchResource),
        }
    }

    /// Adjust the use count of a PD, CQ or SRQ.
    fn use_parent(&mut self, handle: u32, delta: i32) {
        if let Ok(
            Object::Pd { users, .. }
            | Object::Cq { users, .. }
            | Object::Srq { users, .. }
            | Object::Mirror { users, .. },
        ) = self.get_mut(handle)
        {
            *users = users.saturating_add_signed(delta);
        }
    }

    /// The parents whose use counts an object holds.
    pub fn parents(obj: &Object) -> Vec<u32> {
        match obj {
            Object::Qp {
                pd,
                send_cq,
                recv_cq,
                srq,
                ..
            } => {
                let mut v = vec![*pd, *send_cq, *recv_cq];
                if *srq != 0 {
                    v.push(*srq);
                }
                v
            }
            Object::Mr { pd, .. }
            | Object::Srq { pd, .. }
            | Object::Mw { pd, .. }
            | Object::Ah { pd, .. } => vec![*pd],
            Object::Mirror { parents, .. } => parents.iter().copied().filter(|&h| h != 0).collect(),
            _ => Vec::new(),
        }
    }

    /// Handles in teardown order: listeners, QPs, SRQs, MWs, AHs, MRs, CQs, PDs.
    pub fn teardown_order(&self) -> Vec<u32> {
        let mut v: Vec<(Kind, u32)> = self.map.iter().map(|(h, e)| (e.obj.kind(), *h)).collect();
        v.sort();
        v.into_iter().map(|(_, h)| h).collect()
    }
}

/// One open of the device: a process's root of resources.
pub struct Context {
    pub id: u32,
    pub caller: Caller,
    pub peer: Arc<dyn Peer>,
    pub memory: Arc<dyn MemoryAccess>,
    pub objects: parking_lot::Mutex<Objects>,
    pub events: Arc<EventQueue>,
    /// The doorbells of the context's daemon-mode QPs, on a thread of the context's own.
    pub doorbells: Doorbells,
    /// The context's own place in the opener's quota.
    _charge: Charge,
}

impl Context {
    pub fn new(
        id: u32,
        caller: Caller,
        peer: Arc<dyn Peer>,
        event_queue: usize,
        charge: Charge,
        doorbells_rung: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        let memory = peer.memory();
        Context {
            id,
            caller,
            peer,
            memory,
            objects: parking_lot::Mutex::new(Objects::default()),
            events: Arc::new(EventQueue::new(event_queue)),
            doorbells: Doorbells::new(id, doorbells_rung),
            _charge: charge,
        }
    }
}

/// A QP's connection as the quotas see it: the connection (and the provider's threads
/// for it) from CONNECT or ACCEPT until it ends, and a CONNECT's half-open state until
/// its outcome arrives. The QP's event sink holds it too, so what a provider still runs
/// for a destroyed QP (a connect thread waiting for its peer) stays charged until the
/// provider lets go of the QP.
///
/// A UD QP has no connection: each CONNECT is a resolution of a peer's service (SIDR),
/// many may be under way at once, and each holds a half-open charge until its outcome
/// (`Established`, `Rejected`, `Unreachable`) arrives; an ACCEPT answers at once and
/// holds nothing.
#[derive(Debug, Default)]
pub struct ConnAccount(Mutex<ConnCharges>);

#[derive(Debug, Default)]
struct ConnCharges {
    half_open: Option<Charges>,
    connection: Option<Charges>,
    /// A UD QP's: the half-open charges of its resolutions under way.
    resolving: Option<Vec<Charges>>,
}

impl ConnAccount {
    /// The account of a UD QP.
    pub fn datagram() -> ConnAccount {
        ConnAccount(Mutex::new(ConnCharges {
            resolving: Some(Vec::new()),
            ..ConnCharges::default()
        }))
    }

    /// Whether the QP is a UD QP (its CONNECTs are resolutions).
    pub fn is_datagram(&self) -> bool {
        self.0.lock().resolving.is_some()
    }

    /// A UD QP starts one more resolution, holding `half_open` until its outcome.
    pub fn begin_resolution(&self, half_open: Charges) {
        if let Some(r) = self.0.lock().resolving.as_mut() {
            r.push(half_open);
        }
    }

    /// The resolution started last never started (the provider refused it).
    pub fn abandon_resolution(&self) {
        if let Some(r) = self.0.lock().resolving.as_mut() {
            r.pop();
        }
    }

    /// Hold a new connection's charges; `Busy` while the QP already has one (a second
    /// CONNECT on a QP would otherwise cost the provider another thread each time).
    pub fn begin(&self, connection: Charges, half_open: Option<Charges>) -> Result<()> {
        let mut c = self.0.lock();
        if c.connection.is_some() || c.half_open.is_some() {
            return Err(VerbsError::Busy);
        }
        (c.connection, c.half_open) = (Some(connection), half_open);
        Ok(())
    }

    /// The connection never formed (the provider refused to start it).
    pub fn abandon(&self) {
        let mut c = self.0.lock();
        (c.connection, c.half_open) = (None, None);
    }

    /// What a connection event means for the charges.
    fn on_event(&self, kind: EventKind) {
        let mut c = self.0.lock();
        if let Some(r) = c.resolving.as_mut() {
            if matches!(
                kind,
                EventKind::Established | EventKind::Rejected | EventKind::Unreachable
            ) {
                r.pop();
            }
            return;
        }
        match kind {
            EventKind::Established => c.half_open = None,
            EventKind::Rejected
            | EventKind::Unreachable
            | EventKind::Disconnected
            | EventKind::ConnectionBroken => (c.connection, c.half_open) = (None, None),
            _ => {}
        }
    }
}

/// A QP's event sink that also keeps its [`ConnAccount`] up to date.
pub struct ConnWatch {
    pub inner: Arc<dyn EventSink>,
    pub conn: Arc<ConnAccount>,
}

impl EventSink for ConnWatch {
    fn deliver(&self, ev: Event) {
        self.conn.on_event(ev.kind);
        self.inner.deliver(ev);
    }
}

/// Destroy one object through its provider (the caller already removed it from the table).
pub fn destroy_object(dev: &dyn Provider, obj: &Object) {
    match obj {
        Object::Listener { listener, .. } => listener.close(),
        Object::Qp { qp, .. } => qp.destroy(),
        Object::Mr { region, .. } => {
            let _ = dev.dereg_mr(region.stag);
        }
        Object::Cq { cq, .. } => cq.destroy(),
        Object::Pd { pd, .. } => dev.dealloc_pd(*pd),
        Object::Srq { srq, .. } => srq.destroy(),
        Object::Mw { key, .. } => {
            let _ = dev.dealloc_mw(*key);
        }
        Object::Ah { ah, .. } => {
            let _ = dev.destroy_ah(*ah);
        }
        // The consumer destroys the object itself; its device's driver frees what a dead
        // process held.
        Object::Mirror { .. } => {}
    }
}

pub fn object_dev(obj: &Object) -> u32 {
    match obj {
        Object::Pd { dev, .. }
        | Object::Cq { dev, .. }
        | Object::Qp { dev, .. }
        | Object::Mr { dev, .. }
        | Object::Srq { dev, .. }
        | Object::Mw { dev, .. }
        | Object::Ah { dev, .. }
        | Object::Mirror { dev, .. }
        | Object::Listener { dev, .. } => *dev,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::{Ledger, Quota, Resource};

    #[test]
    fn a_connection_is_held_once_and_released_by_its_outcome() {
        let ledger = Ledger::new(Quota::PER_USER, Quota::GLOBAL);
        let charge = |r| Charges::from(ledger.charge(7, None, r, 1).unwrap());
        let conn = ConnAccount::default();
        conn.begin(
            charge(Resource::Connection),
            Some(charge(Resource::HalfOpen)),
        )
        .unwrap();
        // A second CONNECT on the same QP while one is under way: refused, charges kept.
        assert_eq!(
            conn.begin(
                charge(Resource::Connection),
                Some(charge(Resource::HalfOpen))
            ),
            Err(VerbsError::Busy)
        );
        assert_eq!(ledger.held(7, Resource::Connection), 1);
        conn.on_event(EventKind::Established);
        assert_eq!(ledger.held(7, Resource::HalfOpen), 0);
        assert_eq!(ledger.held(7, Resource::Connection), 1);
        conn.on_event(EventKind::Disconnected);
        assert_eq!(ledger.held(7, Resource::Connection), 0);
        // A refused connect gives everything back and may be tried again.
        conn.begin(
            charge(Resource::Connection),
            Some(charge(Resource::HalfOpen)),
        )
        .unwrap();
        conn.on_event(EventKind::Unreachable);
        assert_eq!(ledger.held_total(Resource::HalfOpen), 0);
        assert_eq!(ledger.held_total(Resource::Connection), 0);
        conn.begin(charge(Resource::Connection), None).unwrap();
        conn.abandon();
        assert_eq!(ledger.held_total(Resource::Connection), 0);
    }
}
