//! DAT handles as libdat2 needs them: pointers to memory whose first word is the
//! `DAT_PROVIDER*` libdat2 dispatches on.
//!
//! Each handle is a small block that is never freed, so its address is never reused:
//! a stale handle (double free, use after free) still points at one of our blocks and
//! finds no live object behind it — `DAT_INVALID_HANDLE`, never another object. The
//! table maps a block's address to its object; an address that is not one of ours is
//! refused before anything is read through it (libdat2 itself reads the first word of
//! any non-null handle to dispatch: a pointer to memory that is not there cannot be
//! caught, as in any C library).

use crate::sys::{DAT_HANDLE, DAT_PROVIDER};
use krdma_dapl as dapl;
use krdma_dapl::{Error, Minor};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// The block a handle points to.
#[repr(C)]
pub struct Block {
    /// Read by libdat2 (`DAT_HANDLE_TO_PROVIDER`).
    provider: *const DAT_PROVIDER,
}

/// The DAT object behind a handle.
#[derive(Clone)]
pub enum Obj {
    Ia(dapl::Ia),
    Pz(dapl::Pz),
    Evd(dapl::Evd),
    Cno(dapl::Cno),
    Ep(dapl::Ep),
    Lmr(dapl::Lmr),
    Rmr(dapl::Rmr),
    Psp(dapl::Psp),
    Rsp(dapl::Rsp),
    Cr(dapl::Cr),
    Srq(dapl::Srq),
}

impl Obj {
    /// `DAT_HANDLE_TYPE`.
    pub fn handle_type(&self) -> u32 {
        use crate::sys::*;
        match self {
            Obj::Cr(_) => DAT_HANDLE_TYPE_CR,
            Obj::Ep(_) => DAT_HANDLE_TYPE_EP,
            Obj::Evd(_) => DAT_HANDLE_TYPE_EVD,
            Obj::Ia(_) => DAT_HANDLE_TYPE_IA,
            Obj::Lmr(_) => DAT_HANDLE_TYPE_LMR,
            Obj::Psp(_) => DAT_HANDLE_TYPE_PSP,
            Obj::Pz(_) => DAT_HANDLE_TYPE_PZ,
            Obj::Rmr(_) => DAT_HANDLE_TYPE_RMR,
            Obj::Rsp(_) => DAT_HANDLE_TYPE_RSP,
            Obj::Cno(_) => DAT_HANDLE_TYPE_CNO,
            Obj::Srq(_) => DAT_HANDLE_TYPE_SRQ,
        }
    }

    /// The crate object's id (what events name objects by).
    fn id(&self) -> u64 {
        match self {
            Obj::Ia(o) => o.id(),
            Obj::Pz(o) => o.id(),
            Obj::Evd(o) => o.id(),
            Obj::Cno(o) => o.id(),
            Obj::Ep(o) => o.id(),
            Obj::Lmr(o) => o.id(),
            Obj::Rmr(o) => o.id(),
            Obj::Psp(o) => o.id(),
            Obj::Rsp(o) => o.id(),
            Obj::Cr(o) => o.id(),
            Obj::Srq(o) => o.id(),
        }
    }

    /// Freeing order within an IA: children before parents.
    fn rank(&self) -> u8 {
        match self {
            Obj::Cr(_) => 0,
            Obj::Rsp(_) | Obj::Psp(_) => 1,
            Obj::Ep(_) => 2,
            Obj::Rmr(_) => 3,
            Obj::Lmr(_) => 4,
            Obj::Srq(_) => 5,
            Obj::Evd(_) => 6,
            Obj::Cno(_) => 7,
            Obj::Pz(_) => 8,
            Obj::Ia(_) => 9,
        }
    }
}

/// What the provider keeps for one live handle.
pub struct Entry {
    pub obj: Obj,
    /// The IA the object belongs to (its own id for an IA).
    pub ia: u64,
    pub provider: *const DAT_PROVIDER,
    /// `dat_set_consumer_context`.
    pub context: AtomicU64,
    /// Memory handed to the consumer that must stay valid while the handle lives
    /// (addresses, private data, named-attribute arrays).
    pub keep: Mutex<Keep>,
}

// SAFETY: `provider` points to a leaked, immutable DAT_PROVIDER (see `registry`).
unsafe impl Send for Entry {}
unsafe impl Sync for Entry {}

/// Consumer-visible memory owned by a handle.
#[derive(Default)]
pub struct Keep {
    /// An IA's address as `dat.conf` gives it (reported instead of the device's own).
    pub ia_address: Option<std::net::IpAddr>,
    pub local_addr: Option<Box<libc::sockaddr_storage>>,
    pub remote_addr: Option<Box<libc::sockaddr_storage>>,
    pub private_data: Vec<Box<[u8]>>,
    pub named: Option<Box<[crate::sys::DAT_NAMED_ATTR]>>,
    /// The strings `named` points into.
    pub strings: Vec<(std::ffi::CString, std::ffi::CString)>,
}

/// Addresses (as `usize`) of live handles, and handles by object id.
#[derive(Default)]
struct Table {
    live: HashMap<usize, Arc<Entry>>,
    by_id: HashMap<u64, usize>,
}

fn table() -> &'static RwLock<Table> {
    static T: OnceLock<RwLock<Table>> = OnceLock::new();
    T.get_or_init(Default::default)
}

/// Counters of refusals at the boundary (`krdma stat`-style diagnostics in the log).
pub static BAD_HANDLES: AtomicU64 = AtomicU64::new(0);

/// A new handle for `obj` of IA `ia`, dispatching to `provider`.
pub fn insert(obj: Obj, ia: u64, provider: *const DAT_PROVIDER) -> DAT_HANDLE {
    let block = Box::into_raw(Box::new(Block { provider }));
    let addr = block as usize;
    let id = obj.id();
    let entry = Arc::new(Entry {
        obj,
        ia,
        provider,
        context: AtomicU64::new(0),
        keep: Mutex::new(Keep::default()),
    });
    let mut t = table().write();
    t.live.insert(addr, entry);
    t.by_id.insert(id, addr);
    block.cast()
}

/// The entry of a live handle.
pub fn get(h: DAT_HANDLE) -> Option<Arc<Entry>> {
    let e = table().read().live.get(&(h as usize)).cloned();
    if e.is_none() {
        BAD_HANDLES.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(handle = ?h, "not a live DAT handle");
    }
    e
}

/// The handle of a live object, by the crate's object id.
pub fn handle_of(id: u64) -> DAT_HANDLE {
    table()
        .read()
        .by_id
        .get(&id)
        .map_or(std::ptr::null_mut(), |&a| a as DAT_HANDLE)
}

/// Free a handle: its object is dropped (when nothing else holds it) and the handle
/// goes dead. `false` when it was not live.
pub fn remove(h: DAT_HANDLE) -> bool {
    let mut t = table().write();
    match t.live.remove(&(h as usize)) {
        Some(e) => {
            t.by_id.remove(&e.obj.id());
            drop(t);
            drop(e);
            true
        }
        None => false,
    }
}

/// Handles of IA `ia` other than the IA itself, children first.
pub fn of_ia(ia: u64) -> Vec<(DAT_HANDLE, Arc<Entry>)> {
    let mut v: Vec<_> = table()
        .read()
        .live
        .iter()
        .filter(|(_, e)| e.ia == ia && !matches!(e.obj, Obj::Ia(_)))
        .map(|(&a, e)| (a as DAT_HANDLE, e.clone()))
        .collect();
    v.sort_by_key(|(_, e)| e.obj.rank());
    v
}

macro_rules! typed {
    ($fn:ident, $variant:ident, $ty:ty, $minor:expr) => {
        /// The object of a live handle of this type (`DAT_INVALID_HANDLE` otherwise).
        pub fn $fn(h: DAT_HANDLE) -> Result<(Arc<Entry>, $ty), Error> {
            let e = get(h).ok_or(Error::new(dapl::Major::InvalidHandle, $minor))?;
            match &e.obj {
                Obj::$variant(o) => {
                    let o = o.clone();
                    Ok((e, o))
                }
                _ => {
                    BAD_HANDLES.fetch_add(1, Ordering::Relaxed);
                    Err(Error::new(dapl::Major::InvalidHandle, $minor))
                }
            }
        }
    };
}

typed!(ia, Ia, dapl::Ia, Minor::HandleIa);
typed!(pz, Pz, dapl::Pz, Minor::HandlePz);
typed!(evd, Evd, dapl::Evd, Minor::None);
typed!(cno, Cno, dapl::Cno, Minor::HandleCno);
typed!(ep, Ep, dapl::Ep, Minor::HandleEp);
typed!(lmr, Lmr, dapl::Lmr, Minor::HandleLmr);
typed!(rmr, Rmr, dapl::Rmr, Minor::HandleRmr);
typed!(psp, Psp, dapl::Psp, Minor::HandlePsp);
typed!(rsp, Rsp, dapl::Rsp, Minor::HandleRsp);
typed!(cr, Cr, dapl::Cr, Minor::HandleCr);
typed!(srq, Srq, dapl::Srq, Minor::HandleSrq);
