//! `dat_evd_*` and `dat_cno_*`, and the conversion of events to `DAT_EVENT`.

use crate::boundary::{call, get, put, put_opt, timeout};
use crate::handles::{self, Entry, Obj};
use crate::sys::*;
use krdma_dapl as dapl;
use krdma_dapl::{Error, Major, Minor};
use std::ffi::{c_int, c_void};

/// How many private-data buffers an endpoint's handle keeps for connection events
/// already delivered (each event's pointer stays valid for the next few events).
const KEEP_PDATA: usize = 4;

/// Fill `out` with `ev`, dequeued from the EVD `evd_h` (entry `evd_e`).
fn to_c(
    evd_h: DAT_HANDLE,
    evd_e: &Entry,
    ev: dapl::Event,
    out: *mut DAT_EVENT,
) -> dapl::Result<()> {
    // SAFETY: an all-zero DAT_EVENT is valid (integers and null pointers).
    let mut c: DAT_EVENT = unsafe { std::mem::zeroed() };
    c.evd_handle = evd_h;
    match ev {
        dapl::Event::Dto(d) => {
            use dapl::{DtoOp as Op, Immediate as Imm};
            // IB extension events carry `DAT_IB_EXTENSION_EVENT_DATA` in the extension
            // data: its type (first 4 bytes), status (next 4, success), immediate data.
            let (number, operation, ext) = match (d.op, d.immediate) {
                (Op::CmpAndSwap, _) => (
                    DAT_IB_DTO_EVENT,
                    DAT_IB_DTO_CMP_SWAP,
                    Some((DAT_IB_CMP_AND_SWAP, 0)),
                ),
                (Op::FetchAndAdd, _) => (
                    DAT_IB_DTO_EVENT,
                    DAT_IB_DTO_FETCH_ADD,
                    Some((DAT_IB_FETCH_AND_ADD, 0)),
                ),
                (Op::RdmaWriteImmed, _) => (
                    DAT_IB_DTO_EVENT,
                    DAT_IB_DTO_RDMA_WRITE_IMMED,
                    Some((DAT_IB_RDMA_WRITE_IMMED, 0)),
                ),
                (Op::Receive, Some(Imm::RdmaWrite(v))) => (
                    DAT_IB_DTO_EVENT,
                    DAT_IB_DTO_RECV_IMMED,
                    Some((DAT_IB_RDMA_WRITE_IMMED_DATA, v)),
                ),
                (Op::Receive, Some(Imm::Send(v))) => (
                    DAT_IB_DTO_EVENT,
                    DAT_IB_DTO_RECV_MSG_IMMED,
                    Some((DAT_IB_RECV_IMMED_DATA, v)),
                ),
                (Op::Receive, None) => (DAT_DTO_COMPLETION_EVENT, DAT_DTO_RECEIVE, None),
                (Op::Send, _) => (DAT_DTO_COMPLETION_EVENT, DAT_DTO_SEND, None),
                (Op::RdmaWrite, _) => (DAT_DTO_COMPLETION_EVENT, DAT_DTO_RDMA_WRITE, None),
                (Op::RdmaRead, _) => (DAT_DTO_COMPLETION_EVENT, DAT_DTO_RDMA_READ, None),
                (Op::BindMw, _) => (DAT_DTO_COMPLETION_EVENT, DAT_DTO_BIND_MW, None),
            };
            c.event_number = number;
            c.event_data.dto = DAT_DTO_COMPLETION_EVENT_DATA {
                ep_handle: handles::handle_of(d.ep.id()),
                user_cookie: d.cookie,
                status: d.status as u32,
                transfered_length: d.transferred_length,
                operation,
                rmr_context: 0,
            };
            if let Some((kind, imm)) = ext {
                c.event_extension_data[0] = u64::from(kind);
                c.event_extension_data[1] = u64::from(imm);
            }
        }
        dapl::Event::RmrBind(b) => {
            c.event_number = DAT_RMR_BIND_COMPLETION_EVENT;
            c.event_data.rmr = DAT_RMR_BIND_COMPLETION_EVENT_DATA {
                rmr_handle: b
                    .rmr
                    .map_or(std::ptr::null_mut(), |r| handles::handle_of(r.id())),
                user_cookie: b.cookie,
                status: b.status as u32,
            };
        }
        dapl::Event::ConnRequest(cr) => {
            let (sp_id, _) = cr.service_point();
            let ia_addr = cr.ia().query().address;
            let cr_h = handles::insert(Obj::Cr(cr.clone()), evd_e.ia, evd_e.provider);
            let local = {
                let e = handles::get(cr_h).expect("just inserted");
                let mut keep = e.keep.lock();
                match ia_addr {
                    Some(ip) => {
                        let s = keep
                            .local_addr
                            .insert(crate::ia::sockaddr(ip, cr.conn_qual() as u16));
                        &mut **s as *mut libc::sockaddr_storage as SockAddr
                    }
                    None => std::ptr::null_mut(),
                }
            };
            c.event_number = if cr.is_ud() {
                c.event_extension_data[0] = u64::from(DAT_IB_UD_CONNECT_REQUEST);
                DAT_IB_UD_CONNECTION_REQUEST_EVENT
            } else {
                DAT_CONNECTION_REQUEST_EVENT
            };
            c.event_data.cr = DAT_CR_ARRIVAL_EVENT_DATA {
                sp_handle: handles::handle_of(sp_id),
                local_ia_address_ptr: local,
                conn_qual: cr.conn_qual(),
                cr_handle: cr_h,
                truncate_flag: DAT_FALSE,
            };
        }
        dapl::Event::Connection(ce) => {
            c.event_number = match ce.kind {
                dapl::ConnEvent::Established => DAT_CONNECTION_EVENT_ESTABLISHED,
                dapl::ConnEvent::PeerRejected => DAT_CONNECTION_EVENT_PEER_REJECTED,
                dapl::ConnEvent::NonPeerRejected => DAT_CONNECTION_EVENT_NON_PEER_REJECTED,
                dapl::ConnEvent::Unreachable => DAT_CONNECTION_EVENT_UNREACHABLE,
                dapl::ConnEvent::TimedOut => DAT_CONNECTION_EVENT_TIMED_OUT,
                dapl::ConnEvent::Disconnected => DAT_CONNECTION_EVENT_DISCONNECTED,
                dapl::ConnEvent::Broken => DAT_CONNECTION_EVENT_BROKEN,
            };
            let ep_h = handles::handle_of(ce.ep.id());
            let (size, data) = if ce.private_data.is_empty() {
                (0, std::ptr::null_mut())
            } else {
                let mut b = ce.private_data.clone().into_boxed_slice();
                let p = b.as_mut_ptr() as *mut c_void;
                let n = b.len();
                if let Some(e) = handles::get(ep_h) {
                    let mut keep = e.keep.lock();
                    keep.private_data.push(b);
                    let extra = keep.private_data.len().saturating_sub(KEEP_PDATA);
                    keep.private_data.drain(..extra);
                    (n as DAT_COUNT, p)
                } else {
                    (0, std::ptr::null_mut())
                }
            };
            c.event_data.connect = DAT_CONNECTION_EVENT_DATA {
                ep_handle: ep_h,
                private_data_size: size,
                private_data: data,
            };
            if ce.ep.is_ud() {
                // A UD endpoint's resolution: the IB extension's events, the address
                // handle in the extension data.
                let (number, kind, ah, qpn, peer) = match (ce.kind, &ce.ud) {
                    (dapl::ConnEvent::Established, Some(u)) => {
                        let kind = if u.passive {
                            DAT_IB_UD_PASSIVE_REMOTE_AH
                        } else {
                            DAT_IB_UD_REMOTE_AH
                        };
                        let ah = crate::ud::keep(ce.ep.id(), u);
                        (
                            DAT_IB_UD_CONNECTION_EVENT_ESTABLISHED,
                            kind,
                            ah,
                            u.qpn,
                            u.peer,
                        )
                    }
                    (dapl::ConnEvent::PeerRejected, _) => (
                        DAT_IB_UD_CONNECTION_REJECT_EVENT,
                        DAT_IB_UD_CONNECT_REJECT,
                        0,
                        0,
                        None,
                    ),
                    _ => (
                        DAT_IB_UD_CONNECTION_ERROR_EVENT,
                        DAT_IB_UD_CONNECT_ERROR,
                        0,
                        0,
                        None,
                    ),
                };
                c.event_number = number;
                c.event_extension_data = crate::ud::extension_data(kind, ah, qpn, peer);
            }
        }
        dapl::Event::Async(a) => {
            c.event_number = match a.kind {
                dapl::AsyncKind::EvdOverflow => DAT_ASYNC_ERROR_EVD_OVERFLOW,
                dapl::AsyncKind::IaCatastrophic => DAT_ASYNC_ERROR_IA_CATASTROPHIC,
                dapl::AsyncKind::EpBroken => DAT_ASYNC_ERROR_EP_BROKEN,
                dapl::AsyncKind::ProviderInternal => DAT_ASYNC_ERROR_PROVIDER_INTERNAL_ERROR,
            };
            c.event_data.asynch = DAT_ASYNCH_ERROR_EVENT_DATA {
                dat_handle: a
                    .ep
                    .map_or(std::ptr::null_mut(), |e| handles::handle_of(e.id())),
                reason: 0,
            };
        }
        dapl::Event::Software(p) => {
            c.event_number = DAT_SOFTWARE_EVENT;
            c.event_data.software = p as *mut c_void;
        }
    }
    put(out, c, 2)
}

pub unsafe extern "C" fn evd_create(
    ia_h: DAT_HANDLE,
    qlen: DAT_COUNT,
    cno_h: DAT_HANDLE,
    flags: u32,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("evd_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        if qlen <= 0 {
            return Err(crate::boundary::arg_error(2));
        }
        let cno = if cno_h.is_null() {
            None
        } else {
            Some(handles::cno(cno_h)?.1)
        };
        let flags = dapl::EvdFlags::from_bits(flags).ok_or(crate::boundary::arg_error(4))?;
        if out.is_null() {
            return Err(crate::boundary::arg_error(5));
        }
        let evd = dapl::Evd::create(&ia, qlen as usize, cno.as_ref(), flags)?;
        put(
            out,
            handles::insert(Obj::Evd(evd), ia.id(), ia_e.provider),
            5,
        )
    })
}

pub unsafe extern "C" fn evd_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_EVD_PARAM,
) -> DAT_RETURN {
    call("evd_query", || {
        let (e, evd) = handles::evd(h)?;
        let q = evd.query();
        let param = DAT_EVD_PARAM {
            ia_handle: handles::handle_of(e.ia),
            evd_qlen: q.qlen.min(i32::MAX as usize) as DAT_COUNT,
            evd_state: (if q.enabled {
                DAT_EVD_STATE_ENABLED
            } else {
                DAT_EVD_STATE_DISABLED
            }) | DAT_EVD_STATE_WAITABLE,
            cno_handle: q.cno.map_or(std::ptr::null_mut(), handles::handle_of),
            evd_flags: q.flags.bits(),
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn evd_modify_cno(h: DAT_HANDLE, cno_h: DAT_HANDLE) -> DAT_RETURN {
    call("evd_modify_cno", || {
        let (_, evd) = handles::evd(h)?;
        let current = evd.cno().map(|c| c.id());
        let wanted = if cno_h.is_null() {
            None
        } else {
            Some(handles::cno(cno_h)?.1.id())
        };
        if current == wanted {
            Ok(())
        } else {
            // The core attaches an EVD to its aggregate once, at creation.
            Err(Error::not_implemented())
        }
    })
}

pub unsafe extern "C" fn evd_enable(h: DAT_HANDLE) -> DAT_RETURN {
    call("evd_enable", || {
        handles::evd(h).map(|(_, e)| e.set_enabled(true))
    })
}

pub unsafe extern "C" fn evd_disable(h: DAT_HANDLE) -> DAT_RETURN {
    call("evd_disable", || {
        handles::evd(h).map(|(_, e)| e.set_enabled(false))
    })
}

pub unsafe extern "C" fn evd_set_unwaitable(h: DAT_HANDLE) -> DAT_RETURN {
    call("evd_set_unwaitable", || {
        handles::evd(h).map(drop).and(Err(Error::not_implemented()))
    })
}

pub unsafe extern "C" fn evd_clear_unwaitable(h: DAT_HANDLE) -> DAT_RETURN {
    call("evd_clear_unwaitable", || handles::evd(h).map(drop))
}

pub unsafe extern "C" fn evd_wait(
    h: DAT_HANDLE,
    t: DAT_TIMEOUT,
    threshold: DAT_COUNT,
    event: *mut DAT_EVENT,
    nmore: *mut DAT_COUNT,
) -> DAT_RETURN {
    call("evd_wait", || {
        let (e, evd) = handles::evd(h)?;
        if event.is_null() {
            return Err(crate::boundary::arg_error(4));
        }
        if threshold <= 0 {
            return Err(crate::boundary::arg_error(3));
        }
        let (ev, more) = evd.wait(timeout(t), threshold as usize)?;
        to_c(h, &e, ev, event)?;
        put_opt(nmore, more.min(i32::MAX as usize) as DAT_COUNT);
        Ok(())
    })
}

pub unsafe extern "C" fn evd_dequeue(h: DAT_HANDLE, event: *mut DAT_EVENT) -> DAT_RETURN {
    call("evd_dequeue", || {
        let (e, evd) = handles::evd(h)?;
        if event.is_null() {
            return Err(crate::boundary::arg_error(2));
        }
        let ev = evd.dequeue()?;
        to_c(h, &e, ev, event)
    })
}

pub unsafe extern "C" fn evd_post_se(h: DAT_HANDLE, event: *const DAT_EVENT) -> DAT_RETURN {
    call("evd_post_se", || {
        let (_, evd) = handles::evd(h)?;
        let ev = get(event, 2)?;
        if ev.event_number != DAT_SOFTWARE_EVENT {
            return Err(crate::boundary::arg_error(2));
        }
        // SAFETY: a software event's data is its pointer (the consumer said which).
        let p = unsafe { ev.event_data.software } as u64;
        evd.post_software(p)
    })
}

pub unsafe extern "C" fn evd_resize(h: DAT_HANDLE, qlen: DAT_COUNT) -> DAT_RETURN {
    call("evd_resize", || {
        let (_, evd) = handles::evd(h)?;
        if qlen <= 0 {
            return Err(crate::boundary::arg_error(2));
        }
        if qlen as usize <= evd.query().qlen {
            Ok(())
        } else {
            Err(Error::not_implemented())
        }
    })
}

pub unsafe extern "C" fn evd_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("evd_free", || {
        let (_, evd) = handles::evd(h)?;
        let ia = evd.ia().clone();
        let is_async = ia.current_async_evd().is_some_and(|a| a.id() == evd.id());
        // Besides the handle's clone and ours: the IA's async slot, endpoints, PSPs.
        if evd.users() > 1 + is_async as usize {
            return Err(Error::new(Major::InvalidState, Minor::EvdInUse));
        }
        ia.release_async_evd(&evd);
        drop(evd);
        handles::remove(h);
        Ok(())
    })
}

pub unsafe extern "C" fn cno_create(
    ia_h: DAT_HANDLE,
    _agent: DAT_OS_WAIT_PROXY_AGENT,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("cno_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        if out.is_null() {
            return Err(crate::boundary::arg_error(3));
        }
        let cno = dapl::Cno::create(&ia, false)?;
        put(
            out,
            handles::insert(Obj::Cno(cno), ia.id(), ia_e.provider),
            3,
        )
    })
}

pub unsafe extern "C" fn cno_fd_create(
    ia_h: DAT_HANDLE,
    fd: *mut c_int,
    out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("cno_fd_create", || {
        let (ia_e, ia) = handles::ia(ia_h)?;
        if fd.is_null() || out.is_null() {
            return Err(crate::boundary::arg_error(if fd.is_null() { 2 } else { 3 }));
        }
        let cno = dapl::Cno::create(&ia, true)?;
        put(fd, cno.fd().unwrap_or(-1), 2)?;
        put(
            out,
            handles::insert(Obj::Cno(cno), ia.id(), ia_e.provider),
            3,
        )
    })
}

pub unsafe extern "C" fn cno_modify_agent(
    h: DAT_HANDLE,
    _agent: DAT_OS_WAIT_PROXY_AGENT,
) -> DAT_RETURN {
    call("cno_modify_agent", || handles::cno(h).map(drop))
}

pub unsafe extern "C" fn cno_query(
    h: DAT_HANDLE,
    _mask: u32,
    out: *mut DAT_CNO_PARAM,
) -> DAT_RETURN {
    call("cno_query", || {
        let (e, cno) = handles::cno(h)?;
        let fd = cno.fd();
        let mut proxy = DAT_OS_WAIT_PROXY_AGENT {
            instance_data: std::ptr::null_mut(),
            proxy_agent_func: None,
        };
        if let Some(fd) = fd {
            // The union's fd member is its first int.
            proxy.instance_data = fd as u32 as usize as *mut c_void;
        }
        let param = DAT_CNO_PARAM {
            ia_handle: handles::handle_of(e.ia),
            proxy_type: if fd.is_some() { DAT_PROXY_TYPE_FD } else { 0 },
            proxy,
        };
        put(out, param, 3)
    })
}

pub unsafe extern "C" fn cno_wait(
    h: DAT_HANDLE,
    t: DAT_TIMEOUT,
    evd_out: *mut DAT_HANDLE,
) -> DAT_RETURN {
    call("cno_wait", || {
        let (_, cno) = handles::cno(h)?;
        if evd_out.is_null() {
            return Err(crate::boundary::arg_error(3));
        }
        let evd = cno.wait(timeout(t))?;
        put(evd_out, handles::handle_of(evd.id()), 3)
    })
}

pub unsafe extern "C" fn cno_trigger(h: DAT_HANDLE, evd_out: *mut DAT_HANDLE) -> DAT_RETURN {
    call("cno_trigger", || {
        let (_, cno) = handles::cno(h)?;
        let evd = cno.trigger()?;
        put(evd_out, handles::handle_of(evd.id()), 2)
    })
}

pub unsafe extern "C" fn cno_free(h: DAT_HANDLE) -> DAT_RETURN {
    call("cno_free", || {
        let (_, cno) = handles::cno(h)?;
        if cno.users() > 0 {
            return Err(Error::new(Major::InvalidState, Minor::CnoInUse));
        }
        handles::remove(h);
        Ok(())
    })
}
