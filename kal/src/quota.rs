//! Quotas: what one user, and all users together, may hold in the kAL.
//!
//! Modelled on the kernel's rdma cgroup (and the limits uverbs inherits from the
//! process): every resource a context takes in the daemon — the context itself, each
//! verbs object, each ring or registration the daemon maps into its own address space
//! (a VMA and its bytes), each thread the daemon runs for the user, each connection and
//! each connection being set up — is charged to the opener's uid, to the whole kAL, and
//! for verbs objects to the device (its advertised `max_qp`, `max_cq`, `max_pd`,
//! `max_srq`, `max_mr`). A charge over the user's quota is refused with
//! [`VerbsError::Quota`] (`EDQUOT`), one over the kAL's or the device's limit with
//! [`VerbsError::Exhausted`] (`ENOSPC`); each refusal is counted and shows in
//! `krdma stat`. Per-user quotas sit well below the global limits, so one user who
//! exhausts their own leaves room for everybody else.
//!
//! A [`Charge`] gives its amounts back when dropped: objects keep theirs for as long as
//! they live, so nothing is returned early or twice.

use parking_lot::Mutex;
use rnicpi::{Counter, DeviceAttr, Result, VerbsError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Resource {
    Context,
    Pd,
    Cq,
    Qp,
    Srq,
    Mr,
    Mw,
    /// An address handle (UD destinations).
    Ah,
    Listener,
    /// A mapping the daemon holds in its own address space (a ring, or a registration
    /// it maps directly): one VMA each, what `vm.max_map_count` limits.
    Mapping,
    /// The bytes of those mappings (the daemon's address space).
    MappedBytes,
    /// A thread the daemon runs for the user: a context's doorbell thread, and the
    /// provider's threads per connection.
    Thread,
    /// A connection (a QP given to CONNECT or ACCEPT), until the QP is destroyed or the
    /// connection ends.
    Connection,
    /// A CONNECT whose outcome (established, rejected, unreachable) has not arrived.
    HalfOpen,
}

const RESOURCES: usize = 14;

impl Resource {
    pub const ALL: [Resource; RESOURCES] = [
        Resource::Context,
        Resource::Pd,
        Resource::Cq,
        Resource::Qp,
        Resource::Srq,
        Resource::Mr,
        Resource::Mw,
        Resource::Ah,
        Resource::Listener,
        Resource::Mapping,
        Resource::MappedBytes,
        Resource::Thread,
        Resource::Connection,
        Resource::HalfOpen,
    ];

    fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Resource::Context => "contexts",
            Resource::Pd => "pds",
            Resource::Cq => "cqs",
            Resource::Qp => "qps",
            Resource::Srq => "srqs",
            Resource::Mr => "mrs",
            Resource::Mw => "mws",
            Resource::Ah => "ahs",
            Resource::Listener => "listeners",
            Resource::Mapping => "mappings",
            Resource::MappedBytes => "mapped_bytes",
            Resource::Thread => "threads",
            Resource::Connection => "connections",
            Resource::HalfOpen => "half_open",
        }
    }

    pub fn from_name(name: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.name() == name)
    }

    /// The device's advertised limit on this resource, if it has one. Registrations and
    /// windows share the device's key table, so they share `max_mr`.
    fn device_limit(self, attr: &DeviceAttr) -> Option<(u64, &'static [Resource])> {
        const MR_KEYS: &[Resource] = &[Resource::Mr, Resource::Mw];
        let one = |r: &'static [Resource], n: u32| Some((u64::from(n), r));
        match self {
            Resource::Pd => one(&[Resource::Pd], attr.max_pd),
            Resource::Cq => one(&[Resource::Cq], attr.max_cq),
            Resource::Qp => one(&[Resource::Qp], attr.max_qp),
            Resource::Srq => one(&[Resource::Srq], attr.max_srq),
            Resource::Mr | Resource::Mw => one(MR_KEYS, attr.max_mr),
            Resource::Ah => one(&[Resource::Ah], attr.max_ah),
            _ => None,
        }
    }
}

/// A limit per resource (`krdmad --quota-*` for users, `--limit-*` for the whole kAL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub contexts: u64,
    pub pds: u64,
    pub cqs: u64,
    pub qps: u64,
    pub srqs: u64,
    pub mrs: u64,
    pub mws: u64,
    pub ahs: u64,
    pub listeners: u64,
    pub mappings: u64,
    pub mapped_bytes: u64,
    pub threads: u64,
    pub connections: u64,
    pub half_open: u64,
}

impl Quota {
    /// What one user may hold by default: a few busy applications' worth, and at most a
    /// quarter of every global limit, so no single user can take a resource for all.
    pub const PER_USER: Quota = Quota {
        contexts: 256,
        pds: 4096,
        cqs: 8192,
        qps: 8192,
        srqs: 1024,
        mrs: 16384,
        mws: 16384,
        ahs: 16384,
        listeners: 1024,
        mappings: 12288,
        mapped_bytes: 16 << 30,
        threads: 8192,
        connections: 8192,
        half_open: 1024,
    };

    /// What all users together may hold by default. The mappings stay well under the
    /// kernel's default `vm.max_map_count` (65530), which the daemon also needs for its
    /// own stacks and heap.
    pub const GLOBAL: Quota = Quota {
        contexts: 4096,
        pds: 32768,
        cqs: 65536,
        qps: 65536,
        srqs: 8192,
        mrs: 131072,
        mws: 131072,
        ahs: 65536,
        listeners: 8192,
        mappings: 49152,
        mapped_bytes: 64 << 30,
        threads: 32768,
        connections: 32768,
        half_open: 4096,
    };

    pub fn of(&self, r: Resource) -> u64 {
        match r {
            Resource::Context => self.contexts,
            Resource::Pd => self.pds,
            Resource::Cq => self.cqs,
            Resource::Qp => self.qps,
            Resource::Srq => self.srqs,
            Resource::Mr => self.mrs,
            Resource::Mw => self.mws,
            Resource::Ah => self.ahs,
            Resource::Listener => self.listeners,
            Resource::Mapping => self.mappings,
            Resource::MappedBytes => self.mapped_bytes,
            Resource::Thread => self.threads,
            Resource::Connection => self.connections,
            Resource::HalfOpen => self.half_open,
        }
    }

    /// Apply one `NAME=VALUE` setting (`krdmad --quota mws=100`); names are those of
    /// [`Resource::name`].
    pub fn apply(&mut self, setting: &str) -> std::result::Result<(), String> {
        let (name, value) = setting
            .split_once('=')
            .ok_or_else(|| format!("{setting}: expected NAME=VALUE"))?;
        let r = Resource::from_name(name.trim()).ok_or_else(|| {
            let names: Vec<&str> = Resource::ALL.iter().map(|r| r.name()).collect();
            format!("{name}: not one of {}", names.join(", "))
        })?;
        let v = value
            .trim()
            .parse()
            .map_err(|e| format!("{setting}: {e}"))?;
        self.set(r, v);
        Ok(())
    }

    pub fn set(&mut self, r: Resource, v: u64) {
        let slot = match r {
            Resource::Context => &mut self.contexts,
            Resource::Pd => &mut self.pds,
            Resource::Cq => &mut self.cqs,
            Resource::Qp => &mut self.qps,
            Resource::Srq => &mut self.srqs,
            Resource::Mr => &mut self.mrs,
            Resource::Mw => &mut self.mws,
            Resource::Ah => &mut self.ahs,
            Resource::Listener => &mut self.listeners,
            Resource::Mapping => &mut self.mappings,
            Resource::MappedBytes => &mut self.mapped_bytes,
            Resource::Thread => &mut self.threads,
            Resource::Connection => &mut self.connections,
            Resource::HalfOpen => &mut self.half_open,
        };
        *slot = v;
    }
}

/// Amounts held, one per resource.
type Usage = [u64; RESOURCES];

/// Which limit refused a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the user's quota of {} is reached", .0.name())]
    User(Resource),
    #[error("the kAL's limit of {} is reached", .0.name())]
    Global(Resource),
    #[error("the device's limit of {} is reached", .0.name())]
    Device(Resource),
}

impl From<Refusal> for VerbsError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::User(_) => VerbsError::Quota,
            Refusal::Global(_) | Refusal::Device(_) => VerbsError::Exhausted,
        }
    }
}

struct Books {
    per_uid: HashMap<u32, Usage>,
    global: Usage,
    per_dev: HashMap<u32, Usage>,
}

/// The kAL's accounts: usage per user, per device and in total, and the refusals.
pub struct Ledger {
    per_user: Quota,
    global: Quota,
    books: Mutex<Books>,
    refused_user: [AtomicU64; RESOURCES],
    refused_global: AtomicU64,
    refused_device: AtomicU64,
}

impl Ledger {
    pub fn new(per_user: Quota, global: Quota) -> Arc<Ledger> {
        Arc::new(Ledger {
            per_user,
            global,
            books: Mutex::new(Books {
                per_uid: HashMap::new(),
                global: [0; RESOURCES],
                per_dev: HashMap::new(),
            }),
            refused_user: Default::default(),
            refused_global: AtomicU64::new(0),
            refused_device: AtomicU64::new(0),
        })
    }

    /// Charge `n` of `r` to `uid` (and, for verbs objects, to device `dev` within its
    /// advertised limits), or refuse it without charging anything.
    pub fn charge(
        self: &Arc<Self>,
        uid: u32,
        dev: Option<(u32, &DeviceAttr)>,
        r: Resource,
        n: u64,
    ) -> Result<Charge, Refusal> {
        let i = r.index();
        let mut b = self.books.lock();
        let user = b.per_uid.get(&uid).map_or(0, |u| u[i]);
        let refusal = if user.saturating_add(n) > self.per_user.of(r) {
            Some(Refusal::User(r))
        } else if b.global[i].saturating_add(n) > self.global.of(r) {
            Some(Refusal::Global(r))
        } else {
            dev.and_then(|(d, attr)| {
                let (limit, shared) = r.device_limit(attr)?;
                let usage = b.per_dev.get(&d);
                let held: u64 = shared
                    .iter()
                    .map(|s| usage.map_or(0, |u| u[s.index()]))
                    .sum();
                (held.saturating_add(n) > limit).then_some(Refusal::Device(r))
            })
        };
        if let Some(refusal) = refusal {
            drop(b);
            let counter = match refusal {
                Refusal::User(_) => &self.refused_user[i],
                Refusal::Global(_) => &self.refused_global,
                Refusal::Device(_) => &self.refused_device,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            rnicpi::warn_limited!(uid, resource = r.name(), n, %refusal, "quota refused");
            return Err(refusal);
        }
        b.per_uid.entry(uid).or_insert([0; RESOURCES])[i] += n;
        b.global[i] += n;
        let dev = dev
            .filter(|(_, attr)| r.device_limit(attr).is_some())
            .map(|(d, _)| d);
        if let Some(d) = dev {
            b.per_dev.entry(d).or_insert([0; RESOURCES])[i] += n;
        }
        Ok(Charge {
            ledger: self.clone(),
            uid,
            dev,
            r,
            n,
        })
    }

    fn release(&self, c: &Charge) {
        let i = c.r.index();
        let mut b = self.books.lock();
        if let Some(u) = b.per_uid.get_mut(&c.uid) {
            u[i] = u[i].saturating_sub(c.n);
            if u.iter().all(|v| *v == 0) {
                b.per_uid.remove(&c.uid);
            }
        }
        b.global[i] = b.global[i].saturating_sub(c.n);
        if let Some(d) = c.dev {
            if let Some(u) = b.per_dev.get_mut(&d) {
                u[i] = u[i].saturating_sub(c.n);
            }
        }
    }

    /// What `uid` holds of `r` now.
    pub fn held(&self, uid: u32, r: Resource) -> u64 {
        self.books
            .lock()
            .per_uid
            .get(&uid)
            .map_or(0, |u| u[r.index()])
    }

    /// What everybody holds of `r` now.
    pub fn held_total(&self, r: Resource) -> u64 {
        self.books.lock().global[r.index()]
    }

    /// Refusal counters (for `krdma stat`).
    pub fn counters(&self) -> Vec<Counter> {
        const NAMES: [&str; RESOURCES] = [
            "quota_refused_contexts",
            "quota_refused_pds",
            "quota_refused_cqs",
            "quota_refused_qps",
            "quota_refused_srqs",
            "quota_refused_mrs",
            "quota_refused_mws",
            "quota_refused_ahs",
            "quota_refused_listeners",
            "quota_refused_mappings",
            "quota_refused_mapped_bytes",
            "quota_refused_threads",
            "quota_refused_connections",
            "quota_refused_half_open",
        ];
        let mut v: Vec<Counter> = NAMES
            .iter()
            .zip(&self.refused_user)
            .map(|(n, c)| (*n, c.load(Ordering::Relaxed)))
            .collect();
        v.push((
            "global_limit_refused",
            self.refused_global.load(Ordering::Relaxed),
        ));
        v.push((
            "device_limit_refused",
            self.refused_device.load(Ordering::Relaxed),
        ));
        v
    }
}

/// An amount held by a user; given back when dropped.
pub struct Charge {
    ledger: Arc<Ledger>,
    uid: u32,
    dev: Option<u32>,
    r: Resource,
    n: u64,
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Charge")
            .field("uid", &self.uid)
            .field("resource", &self.r)
            .field("n", &self.n)
            .finish()
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.ledger.release(self);
    }
}

/// Several charges held together (an object's).
#[derive(Debug, Default)]
pub struct Charges(Vec<Charge>);

impl Charges {
    pub fn push(&mut self, c: Charge) {
        self.0.push(c);
    }

    pub fn with(mut self, c: Charge) -> Self {
        self.0.push(c);
        self
    }

    pub fn append(&mut self, other: Charges) {
        self.0.extend(other.0);
    }
}

impl From<Charge> for Charges {
    fn from(c: Charge) -> Self {
        Charges(vec![c])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr() -> DeviceAttr {
        DeviceAttr {
            name: "t".into(),
            transport: rnicpi::Transport::Iwarp,
            node_guid: 0,
            vendor_id: 0,
            max_qp: 8,
            max_qp_wr: 8,
            max_sge: 1,
            max_inline: 0,
            max_cq: 8,
            max_cqe: 8,
            max_mr: 3,
            max_mr_size: 1,
            max_pd: 8,
            max_srq: 0,
            max_srq_wr: 0,
            max_ird: 1,
            max_ord: 1,
            atomics: false,
            memory_windows: true,
            max_ah: 0,
            phys_port_cnt: 1,
            private_data: rnicpi::PrivateDataLimits {
                connect: 56,
                accept: 196,
                reject: 148,
            },
            fast_path: rnicpi::FastPath::Kal,
        }
    }

    #[test]
    fn a_user_over_quota_leaves_the_others_served() {
        let mut user = Quota::PER_USER;
        user.set(Resource::Context, 2);
        let l = Ledger::new(user, Quota::GLOBAL);
        let a = l.charge(1000, None, Resource::Context, 1).unwrap();
        let _b = l.charge(1000, None, Resource::Context, 1).unwrap();
        assert_eq!(
            l.charge(1000, None, Resource::Context, 1).unwrap_err(),
            Refusal::User(Resource::Context)
        );
        let _other = l.charge(2000, None, Resource::Context, 1).unwrap();
        assert_eq!(l.held_total(Resource::Context), 3);
        drop(a);
        l.charge(1000, None, Resource::Context, 1).unwrap();
        let c = l.counters();
        assert!(c.contains(&("quota_refused_contexts", 1)));
    }

    #[test]
    fn global_and_device_limits() {
        let mut global = Quota::GLOBAL;
        global.set(Resource::Thread, 3);
        let l = Ledger::new(Quota::PER_USER, global);
        let held: Vec<Charge> = (0..3)
            .map(|uid| l.charge(uid, None, Resource::Thread, 1).unwrap())
            .collect();
        assert_eq!(
            l.charge(9, None, Resource::Thread, 1).unwrap_err(),
            Refusal::Global(Resource::Thread)
        );
        drop(held);
        // Registrations and windows share the device's key table (max_mr = 3).
        let a = attr();
        let _m = l.charge(1, Some((0, &a)), Resource::Mr, 1).unwrap();
        let _w = l.charge(2, Some((0, &a)), Resource::Mw, 2).unwrap();
        assert_eq!(
            l.charge(3, Some((0, &a)), Resource::Mw, 1).unwrap_err(),
            Refusal::Device(Resource::Mw)
        );
        l.charge(3, Some((1, &a)), Resource::Mw, 1).unwrap();
        assert!(l.counters().contains(&("device_limit_refused", 1)));
        assert!(l.counters().contains(&("global_limit_refused", 1)));
    }

    #[test]
    fn settings_parse() {
        let mut q = Quota::PER_USER;
        q.apply("mws=7").unwrap();
        q.apply(" mapped_bytes = 4096").unwrap();
        assert_eq!((q.mws, q.mapped_bytes), (7, 4096));
        assert!(q.apply("bogus=1").is_err());
        assert!(q.apply("mws").is_err());
        assert!(q.apply("mws=-1").is_err());
    }

    #[test]
    fn charges_are_returned_once_when_dropped() {
        let l = Ledger::new(Quota::PER_USER, Quota::GLOBAL);
        let c = Charges::from(l.charge(5, None, Resource::MappedBytes, 4096).unwrap())
            .with(l.charge(5, None, Resource::Mapping, 1).unwrap());
        assert_eq!(l.held(5, Resource::MappedBytes), 4096);
        drop(c);
        assert_eq!(l.held(5, Resource::MappedBytes), 0);
        assert_eq!(l.held_total(Resource::Mapping), 0);
    }
}
