//! Event dispatchers: `it_evd_*`.

use crate::event::to_c;
use crate::ffi::{get, put, put_opt, status, usable};
use crate::handles::{self, Obj};
use crate::types::*;
use bytemuck::Zeroable;
use krdma_itapi::{Aevd, Error, Evd, EvdFlags, Event, EventStream, Result, Transport};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

const IT_EVD_PARAM_THRESHOLD: u32 = 0x20;
const IT_EVD_PARAM_ENABLED: u32 = 0x200;
const IT_EVD_PARAM_OVERFLOWED: u32 = 0x400;
const IT_EVD_PARAM_ALL: u32 = 0x1;

/// An EVD handle: simple or aggregate.
enum AnyEvd {
    Simple(Evd),
    Aggregate(Aevd),
}

fn any_evd(h: Handle) -> Result<AnyEvd> {
    match handles::get(h) {
        Some(Obj::Evd(e)) => Ok(AnyEvd::Simple(e)),
        Some(Obj::Aevd(a)) => Ok(AnyEvd::Aggregate(a)),
        _ => Err(Error::InvalidEvd),
    }
}

impl AnyEvd {
    fn infiniband(&self) -> bool {
        let ia = match self {
            AnyEvd::Simple(e) => e.ia(),
            AnyEvd::Aggregate(a) => a.ia(),
        };
        ia.transport() == Transport::InfiniBand
    }
}

/// `it_evd_create`: an SEVD for the stream `event_number`, or an AEVD for
/// `IT_AEVD_NOTIFICATION_EVENT_STREAM`. `fd` receives the pollable descriptor (with
/// `IT_EVD_CREATE_FD`) or -1.
///
/// # Safety
/// `evd_handle` and `fd` are null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_evd_create(
    ia_handle: Handle,
    event_number: u32,
    evd_flag: u32,
    sevd_queue_size: usize,
    sevd_threshold: usize,
    aevd_handle: Handle,
    evd_handle: *mut Handle,
    fd: *mut i32,
) -> ItStatus {
    status(|| {
        let ia = handles::get_ia(ia_handle)?;
        if !fd.is_null() {
            usable(fd)?;
        }
        let flags = EvdFlags::from_bits(evd_flag).ok_or(Error::InvalidFlags)?;
        let stream = EventStream::of(event_number)
            .filter(|s| *s as u32 == event_number)
            .ok_or(Error::InvalidEvdType)?;
        let (obj, id, raw_fd) = if stream == EventStream::AevdNotification {
            if !aevd_handle.is_null() {
                return Err(Error::InvalidAevd);
            }
            let a = Aevd::create(&ia, flags, sevd_queue_size)?;
            let raw = a.raw_fd();
            let id = a.id();
            (Obj::Aevd(a), id, raw)
        } else {
            let aevd = if aevd_handle.is_null() {
                None
            } else {
                Some(handles::get_aevd(aevd_handle)?)
            };
            let e = Evd::create(
                &ia,
                stream,
                flags,
                sevd_queue_size,
                sevd_threshold,
                aevd.as_ref(),
            )?;
            let raw = e.query().fd;
            let id = e.id();
            (Obj::Evd(e), id, raw)
        };
        // SAFETY: caller's contract (`fd` was checked first).
        unsafe {
            handles::publish(obj, id, ia.id(), evd_handle)?;
            put_opt(fd, raw_fd.unwrap_or(-1))
        }
    })
}

/// `it_evd_free`: `IT_ERR_EVD_BUSY` while endpoints, listeners or SEVDs use it,
/// `IT_ERR_EVD_WAIT` while a thread waits on it.
#[no_mangle]
pub extern "C" fn it_evd_free(evd_handle: Handle) -> ItStatus {
    status(|| {
        any_evd(evd_handle)?;
        handles::remove_if(evd_handle, |obj| {
            let (users, waiter) = match obj {
                Obj::Evd(e) => (e.users(), e.has_waiter()),
                Obj::Aevd(a) => (a.users(), a.has_waiter()),
                _ => return Err(Error::InvalidEvd),
            };
            tracing::debug!(users, waiter, "it_evd_free");
            if waiter {
                Err(Error::EvdWait)
            } else if users > 0 {
                Err(Error::EvdBusy)
            } else {
                Ok(())
            }
        })
    })
}

/// Write `ev` for the caller.
///
/// # Safety
/// `event` is null or writable for an `it_event_t`.
unsafe fn deliver(evd: &AnyEvd, ev: &Event, event: *mut ItEvent) -> Result<()> {
    let c = to_c(ev, evd.infiniband());
    // SAFETY: caller's contract.
    unsafe { put(event, c) }
}

/// `it_evd_dequeue`: the oldest event, without waiting (`IT_ERR_QUEUE_EMPTY`).
///
/// # Safety
/// `event` is null or writable for an `it_event_t`.
#[no_mangle]
pub unsafe extern "C" fn it_evd_dequeue(evd_handle: Handle, event: *mut ItEvent) -> ItStatus {
    status(|| {
        let evd = any_evd(evd_handle)?;
        usable(event)?;
        let ev = match &evd {
            AnyEvd::Simple(e) => e.dequeue()?,
            AnyEvd::Aggregate(a) => a.dequeue()?,
        };
        // SAFETY: caller's contract.
        unsafe { deliver(&evd, &ev, event) }
    })
}

/// `it_evd_wait`: wait up to `timeout` microseconds (`IT_TIMEOUT_INFINITE`: for ever);
/// `nmore` receives the events (SEVD) or ready SEVDs (AEVD) left.
///
/// # Safety
/// `event` is null or writable for an `it_event_t`; `nmore` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_evd_wait(
    evd_handle: Handle,
    timeout: u64,
    event: *mut ItEvent,
    nmore: *mut usize,
) -> ItStatus {
    status(|| {
        let evd = any_evd(evd_handle)?;
        usable(event)?;
        let t = (timeout != IT_TIMEOUT_INFINITE).then(|| Duration::from_micros(timeout));
        let (ev, more) = match &evd {
            AnyEvd::Simple(e) => e.wait(t)?,
            AnyEvd::Aggregate(a) => a.wait(t)?,
        };
        // SAFETY: caller's contract.
        unsafe {
            deliver(&evd, &ev, event)?;
            put_opt(nmore, more)
        }
    })
}

/// `it_evd_post_se`: a software event whose `data` is the `event` pointer given.
#[no_mangle]
pub extern "C" fn it_evd_post_se(evd_handle: Handle, event: *const c_void) -> ItStatus {
    status(|| {
        if matches!(any_evd(evd_handle)?, AnyEvd::Aggregate(_)) {
            return Err(Error::AevdNotAllowed);
        }
        handles::get_sevd(evd_handle)?.post_software(event as usize as u64)
    })
}

/// `it_evd_query`: every member is filled, whatever the mask.
///
/// # Safety
/// `params` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_evd_query(
    evd_handle: Handle,
    _mask: u32,
    params: *mut EvdParam,
) -> ItStatus {
    status(|| {
        let ia_id = handles::ia_of(evd_handle).ok_or(Error::InvalidEvd)?;
        let mut p = EvdParam::zeroed();
        p.ia = handles::ia(ia_id);
        match any_evd(evd_handle)? {
            AnyEvd::Simple(e) => {
                let q = e.query();
                p.event_number = q.stream as u32;
                p.evd_flag = q.flags.bits();
                p.sevd_queue_size = q.queue_size;
                p.sevd_threshold = q.threshold;
                p.aevd = q.aevd.map_or(std::ptr::null_mut(), handles::aevd);
                p.fd = q.fd.unwrap_or(-1);
                p.evd_bound = q.aevd.is_some() as ItBool;
                p.evd_enabled = q.enabled as ItBool;
                p.evd_overflowed = q.overflowed as ItBool;
                p.evd_callback = q.callback as ItBool;
            }
            AnyEvd::Aggregate(a) => {
                p.event_number = EventStream::AevdNotification as u32;
                p.evd_flag = a.flags().bits();
                p.sevd_queue_size = a.queue_size();
                p.fd = a.raw_fd().unwrap_or(-1);
                p.evd_enabled = IT_TRUE;
                p.evd_callback = a.has_callback() as ItBool;
            }
        }
        // SAFETY: caller's contract.
        unsafe { put(params, p) }
    })
}

/// `it_evd_modify`: the threshold, the enabled state, and clearing the overflowed state
/// (`evd_overflowed = IT_FALSE`) of an SEVD; other members `IT_ERR_INVALID_MASK`.
///
/// # Safety
/// `params` is null or readable.
#[no_mangle]
pub unsafe extern "C" fn it_evd_modify(
    evd_handle: Handle,
    mask: u32,
    params: *const EvdParam,
) -> ItStatus {
    status(|| {
        let evd = handles::get_sevd(evd_handle)?;
        let known = IT_EVD_PARAM_THRESHOLD | IT_EVD_PARAM_ENABLED | IT_EVD_PARAM_OVERFLOWED;
        if mask & !known != 0 || mask & IT_EVD_PARAM_ALL != 0 {
            return Err(Error::InvalidMask);
        }
        // SAFETY: caller's contract.
        let p = unsafe { get(params)? };
        if mask & IT_EVD_PARAM_THRESHOLD != 0 {
            evd.set_threshold(p.sevd_threshold)?;
        }
        if mask & IT_EVD_PARAM_ENABLED != 0 {
            evd.set_enabled(p.evd_enabled != IT_FALSE);
        }
        if mask & IT_EVD_PARAM_OVERFLOWED != 0 {
            if p.evd_overflowed != IT_FALSE {
                return Err(Error::InvalidEvdState);
            }
            evd.reset_overflow();
        }
        Ok(())
    })
}

pub type EvdCallback = extern "C" fn(evd: Handle, arg: *mut c_void);

/// `it_evd_callback_attach`: `callback(evd, arg)` runs on an event thread each time a
/// notifying event makes the EVD ready.
#[no_mangle]
pub extern "C" fn it_evd_callback_attach(
    evd_handle: Handle,
    callback: Option<EvdCallback>,
    arg: *mut c_void,
) -> ItStatus {
    status(|| {
        let callback = callback.ok_or(Error::Fault)?;
        // Handle and argument travel as integers: they are the consumer's to share
        // between threads.
        let (h, arg) = (evd_handle as usize, arg as usize);
        let run: krdma_itapi::Callback =
            Arc::new(move || callback(h as Handle, arg as *mut c_void));
        match any_evd(evd_handle)? {
            AnyEvd::Simple(e) => e.attach_callback(run),
            AnyEvd::Aggregate(a) => a.attach_callback(run),
        }
    })
}

#[no_mangle]
pub extern "C" fn it_evd_callback_detach(evd_handle: Handle) -> ItStatus {
    status(|| match any_evd(evd_handle)? {
        AnyEvd::Simple(e) => e.detach_callback(),
        AnyEvd::Aggregate(a) => a.detach_callback(),
    })
}
