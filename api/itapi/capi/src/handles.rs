//! C handles. A handle is never a pointer to anything: it is the object's process-unique
//! id shifted left four bits, with its kind in the low bits, looked up in one table.
//! Ids are never reused, so a freed or made-up handle names nothing and every call gets
//! an error status instead of touching freed memory.

use crate::types::Handle;
use krdma_itapi::{Aevd, Endpoint, Error, Evd, Ia, Listener, Lmr, Pz, Result, Rmr, Srq, Watch};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::OnceLock;

/// What a handle names.
#[derive(Clone)]
pub enum Obj {
    Ia(Ia),
    Pz(Pz),
    Evd(Evd),
    Aevd(Aevd),
    Ep(Endpoint),
    Listen(Listener),
    Lmr(Lmr),
    Rmr(Rmr),
    Srq(Srq),
}

impl Obj {
    fn kind(&self) -> usize {
        match self {
            Obj::Ia(_) => 1,
            Obj::Pz(_) => 2,
            Obj::Evd(_) => 3,
            Obj::Aevd(_) => 4,
            Obj::Ep(_) => 5,
            Obj::Listen(_) => 6,
            Obj::Lmr(_) => 7,
            Obj::Rmr(_) => 8,
            Obj::Srq(_) => 9,
        }
    }

    /// Objects that depend on this one.
    pub fn users(&self) -> usize {
        match self {
            Obj::Ia(o) => o.users(),
            Obj::Pz(o) => o.users(),
            Obj::Evd(o) => o.users(),
            Obj::Aevd(o) => o.users(),
            Obj::Ep(o) => o.users(),
            Obj::Listen(o) => o.users(),
            Obj::Lmr(o) => o.users(),
            Obj::Rmr(o) => o.users(),
            Obj::Srq(o) => o.users(),
        }
    }

    fn watch(&self) -> Watch {
        match self {
            Obj::Ia(o) => o.watch(),
            Obj::Pz(o) => o.watch(),
            Obj::Evd(o) => o.watch(),
            Obj::Aevd(o) => o.watch(),
            Obj::Ep(o) => o.watch(),
            Obj::Listen(o) => o.watch(),
            Obj::Lmr(o) => o.watch(),
            Obj::Rmr(o) => o.watch(),
            Obj::Srq(o) => o.watch(),
        }
    }

    /// Drop the table's handle and return once the object is gone, so `it_*_free` is
    /// synchronous even when an event thread holds the object for a moment (bounded, in
    /// case the holder is the caller's own callback).
    fn free(self) {
        let (w, self_kind) = (self.watch(), self.kind());
        drop(self);
        if !w.wait_gone(std::time::Duration::from_secs(2)) {
            tracing::warn!(
                kind = self_kind,
                "object still in use 2 s after it was freed"
            );
        }
    }

    /// The order `it_ia_free` frees an IA's objects in: dependents first.
    fn free_rank(&self) -> u8 {
        match self {
            Obj::Listen(_) => 0,
            Obj::Ep(_) => 1,
            Obj::Rmr(_) => 2,
            Obj::Lmr(_) | Obj::Srq(_) => 3,
            Obj::Evd(_) => 4,
            Obj::Aevd(_) => 5,
            Obj::Pz(_) => 6,
            Obj::Ia(_) => 7,
        }
    }
}

struct Entry {
    obj: Obj,
    /// The IA the object belongs to (its own id for an IA).
    ia: u64,
    /// `it_set_consumer_context`
    context: Option<u64>,
}

fn table() -> &'static RwLock<HashMap<u64, Entry>> {
    static TABLE: OnceLock<RwLock<HashMap<u64, Entry>>> = OnceLock::new();
    TABLE.get_or_init(|| RwLock::new(HashMap::new()))
}

const KIND_BITS: u32 = 4;

/// The handle of object `id` of the given kind.
fn encode(id: u64, kind: usize) -> Handle {
    ((id << KIND_BITS) as usize | kind) as Handle
}

fn decode(h: Handle) -> (u64, usize) {
    let v = h as usize;
    ((v >> KIND_BITS) as u64, v & ((1 << KIND_BITS) - 1))
}

/// Register `obj` (of IA `ia`) and return its handle.
fn insert(obj: Obj, id: u64, ia: u64) -> Handle {
    let h = encode(id, obj.kind());
    table().write().insert(
        id,
        Entry {
            obj,
            ia,
            context: None,
        },
    );
    h
}

/// Register `obj` (of IA `ia`) and store its handle through `out` (with a null or
/// misaligned `out`, `IT_ERR_FAULT` and the object is dropped).
///
/// # Safety
/// `out` is null or writable.
pub unsafe fn publish(obj: Obj, id: u64, ia: u64, out: *mut Handle) -> Result<()> {
    crate::ffi::usable(out)?;
    let h = insert(obj, id, ia);
    // SAFETY: non-null and aligned (checked); writable by the caller's contract.
    unsafe { out.write(h) };
    Ok(())
}

/// The object `h` names, if it names one.
pub fn get(h: Handle) -> Option<Obj> {
    let (id, kind) = decode(h);
    let t = table().read();
    let e = t.get(&id)?;
    (e.obj.kind() == kind).then(|| e.obj.clone())
}

/// The IA that object `h` belongs to.
pub fn ia_of(h: Handle) -> Option<u64> {
    let (id, _) = decode(h);
    get(h)?;
    table().read().get(&id).map(|e| e.ia)
}

/// Remove `h` from the table, if `check` allows; the object is dropped (freed, unless
/// the Rust side still holds it) after the table lock is released.
pub fn remove_if(h: Handle, check: impl FnOnce(&Obj) -> Result<()>) -> Result<()> {
    let (id, kind) = decode(h);
    let removed = {
        let mut t = table().write();
        match t.get(&id) {
            Some(e) if e.obj.kind() == kind => check(&e.obj)?,
            _ => return Err(Error::InvalidHandle),
        }
        t.remove(&id)
    };
    if let Some(e) = removed {
        e.obj.free();
    }
    Ok(())
}

/// Remove `h` unless objects still depend on it (`busy`).
pub fn remove_unused(h: Handle, busy: Error) -> Result<()> {
    remove_if(h, |obj| if obj.users() > 0 { Err(busy) } else { Ok(()) })
}

/// Remove every object of IA `ia` (including the IA), dependents first.
pub fn remove_ia(ia: u64) {
    let mut gone: Vec<Obj> = {
        let mut t = table().write();
        let ids: Vec<u64> = t
            .iter()
            .filter(|(_, e)| e.ia == ia)
            .map(|(k, _)| *k)
            .collect();
        ids.iter()
            .filter_map(|id| t.remove(id))
            .map(|e| e.obj)
            .collect()
    };
    gone.sort_by_key(Obj::free_rank);
    for obj in gone {
        obj.free();
    }
}

pub fn set_context(h: Handle, context: u64) -> Result<()> {
    let (id, kind) = decode(h);
    match table().write().get_mut(&id) {
        Some(e) if e.obj.kind() == kind => {
            e.context = Some(context);
            Ok(())
        }
        _ => Err(Error::InvalidHandle),
    }
}

pub fn context(h: Handle) -> Result<u64> {
    let (id, kind) = decode(h);
    match table().read().get(&id) {
        Some(e) if e.obj.kind() == kind => e.context.ok_or(Error::NoContext),
        _ => Err(Error::InvalidHandle),
    }
}

/// Handles of live objects, for events and query results.
pub fn ia(id: u64) -> Handle {
    encode(id, 1)
}
pub fn pz(id: u64) -> Handle {
    encode(id, 2)
}
pub fn evd(id: u64) -> Handle {
    encode(id, 3)
}
pub fn aevd(id: u64) -> Handle {
    encode(id, 4)
}
pub fn ep(id: u64) -> Handle {
    encode(id, 5)
}
pub fn lmr(id: u64) -> Handle {
    encode(id, 7)
}
pub fn srq(id: u64) -> Handle {
    encode(id, 9)
}

/// Typed lookups: each fails with the standard's status for a bad handle of its kind.
macro_rules! typed {
    ($($name:ident -> $ty:ty = $variant:ident, $err:ident;)*) => {
        $(
            pub fn $name(h: Handle) -> Result<$ty> {
                match get(h) {
                    Some(Obj::$variant(o)) => Ok(o),
                    _ => Err(Error::$err),
                }
            }
        )*
    };
}

typed! {
    get_ia -> Ia = Ia, InvalidIa;
    get_pz -> Pz = Pz, InvalidPz;
    get_sevd -> Evd = Evd, InvalidEvd;
    get_aevd -> Aevd = Aevd, InvalidAevd;
    get_ep -> Endpoint = Ep, InvalidEp;
    get_listen -> Listener = Listen, InvalidListen;
    get_lmr -> Lmr = Lmr, InvalidLmr;
    get_rmr -> Rmr = Rmr, InvalidRmr;
    get_srq -> Srq = Srq, InvalidSrq;
}
