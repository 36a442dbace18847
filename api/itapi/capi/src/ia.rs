//! Interface adapters, paths and addresses, handle types and consumer contexts.

use crate::event::{net_addr, path_to};
use crate::ffi::{get, put, put_opt, status};
use crate::handles::{self, Obj};
use crate::types::*;
use bytemuck::Zeroable;
use krdma_itapi::{interface_list, Error, Ia, IaInfo as RustIaInfo, Result, Transport};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::net::IpAddr;
use std::sync::OnceLock;

const IT_HANDLE_TYPE_EP: u32 = 1;
const IT_HANDLE_TYPE_EVD: u32 = 2;
const IT_HANDLE_TYPE_IA: u32 = 3;
const IT_HANDLE_TYPE_LISTEN: u32 = 4;
const IT_HANDLE_TYPE_LMR: u32 = 5;
const IT_HANDLE_TYPE_PZ: u32 = 6;
const IT_HANDLE_TYPE_RMR: u32 = 7;
const IT_HANDLE_TYPE_SRQ: u32 = 9;

fn transport_code(t: Transport) -> u32 {
    t as u32
}

/// `it_interface_list`: the adapters of the front door `KRDMA_DEVICE` selects.
///
/// # Safety
/// `num_interfaces` and `total_interfaces` are null or valid; `interfaces` holds
/// `*num_interfaces` entries.
#[no_mangle]
pub unsafe extern "C" fn it_interface_list(
    interfaces: *mut Interface,
    num_interfaces: *mut usize,
    total_interfaces: *mut usize,
) {
    let _ = status(|| {
        let list = interface_list()?;
        // SAFETY: caller's contract: valid or null (null is refused).
        let room = unsafe { get(num_interfaces)? };
        let n = room.min(list.len());
        for (i, itf) in list.iter().take(n).enumerate() {
            let mut c = Interface::zeroed();
            c.major_version = itf.major_version;
            c.minor_version = itf.minor_version;
            c.transport_type = transport_code(itf.transport);
            copy_name(&mut c.name, &itf.name);
            // SAFETY: `interfaces` holds `room` (≥ n) entries by the caller's contract.
            unsafe { put(interfaces.wrapping_add(i), c)? };
        }
        // SAFETY: as above.
        unsafe {
            put(num_interfaces, n)?;
            put_opt(total_interfaces, list.len())
        }
    });
}

fn copy_name(dst: &mut [c_char], name: &str) {
    let room = dst.len() - 1;
    for (d, s) in dst.iter_mut().zip(name.bytes().take(room)) {
        *d = s as c_char;
    }
}

/// `it_ia_create`: open the adapter `name` — a device name (`siw0`, `rxe0`), or, as a
/// krdma extension, an IP address the adapter serves.
///
/// # Safety
/// `name` is null or a NUL-terminated string; `ia_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_ia_create(
    name: *const c_char,
    major_version: u32,
    minor_version: u32,
    ia_handle: *mut Handle,
) -> ItStatus {
    status(|| {
        match (major_version, minor_version) {
            (1, 0) | (2, 0) | (2, 1) => {}
            (1 | 2, _) => return Err(Error::InvalidMinorVersion),
            _ => return Err(Error::InvalidMajorVersion),
        }
        if name.is_null() {
            return Err(Error::InvalidName);
        }
        // SAFETY: non-null, NUL-terminated by the caller's contract.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| Error::InvalidName)?;
        let ia = match name.parse::<IpAddr>() {
            Ok(addr) => Ia::for_address(addr)?,
            Err(_) => Ia::open(name)?,
        };
        let id = ia.id();
        // SAFETY: caller's contract.
        unsafe { handles::publish(Obj::Ia(ia), id, id, ia_handle) }
    })
}

/// `it_ia_free`: free the adapter and every object created under it.
#[no_mangle]
pub extern "C" fn it_ia_free(ia_handle: Handle) -> ItStatus {
    status(|| {
        let id = handles::get_ia(ia_handle)?.id();
        handles::remove_ia(id);
        Ok(())
    })
}

/// What an `it_ia_info_t` handed out owns, kept until `it_ia_info_free`.
struct InfoAlloc {
    info: Box<IaInfo>,
    _name: CString,
    _spigots: Vec<SpigotInfo>,
    _addrs: Vec<Vec<NetAddr>>,
}

// SAFETY: the raw pointers inside point into the allocation itself, which moves between
// threads as a whole; nothing else aliases it.
unsafe impl Send for InfoAlloc {}

fn infos() -> &'static Mutex<HashMap<usize, InfoAlloc>> {
    static INFOS: OnceLock<Mutex<HashMap<usize, InfoAlloc>>> = OnceLock::new();
    INFOS.get_or_init(|| Mutex::new(HashMap::new()))
}

fn ia_info(r: &RustIaInfo) -> InfoAlloc {
    let name = CString::new(r.name.clone()).unwrap_or_default();
    let mut addrs: Vec<Vec<NetAddr>> = r
        .spigots
        .iter()
        .map(|s| s.addresses.iter().map(|a| net_addr(*a)).collect())
        .collect();
    let mut spigots: Vec<SpigotInfo> = r
        .spigots
        .iter()
        .zip(addrs.iter_mut())
        .map(|(s, a)| SpigotInfo {
            spigot_id: s.id,
            max_rc_send_len: r.limits.max_lmr_length as usize,
            max_rc_rdma_len: r.limits.max_lmr_length as usize,
            max_ud_send_len: 0,
            spigot_online: s.online as ItBool,
            active_side_conn_qual: IT_IANA_PORT | IT_IANA_LR_PORT | IT_IB_SERVICEID,
            passive_side_conn_qual: IT_IANA_PORT | IT_IANA_LR_PORT | IT_IB_SERVICEID,
            num_net_addr: a.len(),
            net_addr: a.as_mut_ptr(),
        })
        .collect();
    let mut info = Box::new(IaInfo::zeroed());
    info.ia_name = name.as_ptr() as *mut c_char;
    info.api_major_version = r.api_major_version;
    info.api_minor_version = r.api_minor_version;
    info.sw_major_version = 0;
    info.sw_minor_version = 1;
    match r.transport {
        Transport::InfiniBand => {
            info.vendor.ib = VendorIb {
                vendor: r.vendor_id & 0xff_ffff,
                device: 0,
                revision: 0,
            }
        }
        Transport::IwarpTcp => {
            let mut v = VendorIwarp::zeroed();
            v.valid_vid = IT_TRUE;
            v.vid[..8].copy_from_slice(&r.node_guid.to_be_bytes());
            info.vendor.iwarp = v;
        }
    }
    info.dto_alignment_hint = 64;
    info.transport_type = transport_code(r.transport);
    info.supported_service_types = 0x1; // IT_RC_SERVICE
    info.private_data_support = IT_TRUE;
    info.ird_ord_ia_support = IT_TRUE;
    info.connect_private_data_len = r.connect_private_data_len.min(IT_MAX_PRIV_DATA);
    info.accept_private_data_len = r.accept_private_data_len.min(IT_MAX_PRIV_DATA);
    info.reject_private_data_len = r.reject_private_data_len.min(IT_MAX_PRIV_DATA);
    info.num_spigots = spigots.len();
    info.spigot_info = spigots.as_mut_ptr();
    info.affiliated_err_evd = r.affiliated_evd.map_or(std::ptr::null_mut(), handles::evd);
    info.unaffiliated_err_evd = r
        .unaffiliated_evd
        .map_or(std::ptr::null_mut(), handles::evd);
    info.srq_support = r.srq_support as ItBool;
    info.rdma_read_ird_modifiable = IT_TRUE;
    info.rdma_read_ord_increasable = IT_TRUE;
    info.rmr_types_supported = if r.rmr_support { 1 } else { 0 }; // IT_RMR_TYPE_NARROW
    info.ep_rdma_enables_modifiable = IT_TRUE;
    info.dto_evd_overflow_detection = IT_TRUE;
    info.atomic_support = r.atomic_support as ItBool;
    info.post_send_unlink_remote_support = IT_TRUE;
    info.narrow_rmr_unlink_support = r.rmr_support as ItBool;
    info.unlink_fence_support = IT_TRUE;
    InfoAlloc {
        info,
        _name: name,
        _spigots: spigots,
        _addrs: addrs,
    }
}

/// `it_ia_query`: a description of the adapter, freed with `it_ia_info_free`.
///
/// # Safety
/// `ia_info` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_ia_query(ia_handle: Handle, ia_info_out: *mut *mut IaInfo) -> ItStatus {
    status(|| {
        let ia = handles::get_ia(ia_handle)?;
        let mut alloc = ia_info(&ia.query());
        let p: *mut IaInfo = alloc.info.as_mut();
        // SAFETY: caller's contract.
        unsafe { put(ia_info_out, p)? };
        infos().lock().insert(p as usize, alloc);
        Ok(())
    })
}

/// `it_ia_info_free`: pointers that `it_ia_query` did not return are ignored.
#[no_mangle]
pub extern "C" fn it_ia_info_free(ia_info: *mut IaInfo) {
    infos().lock().remove(&(ia_info as usize));
}

/// The IP address a C network address names.
pub fn ip_of(a: &NetAddr) -> Result<IpAddr> {
    // SAFETY: every member of the address union is plain bytes, valid for any content;
    // `addr_type` says which one the caller filled.
    unsafe {
        match a.addr_type {
            IT_IPV4 => Ok(IpAddr::from(a.addr.ipv4.0)),
            IT_IPV6 => Ok(IpAddr::from(a.addr.ipv6.0).to_canonical()),
            IT_IB_GID => Ok(IpAddr::from(a.addr.gid.0).to_canonical()),
            _ => Err(Error::InvalidNetaddr),
        }
    }
}

/// `it_get_pathinfo`: one path, to `net_addr` from spigot `spigot_id`.
///
/// # Safety
/// Pointers are null or valid; `paths` holds `*num_paths` entries.
#[no_mangle]
pub unsafe extern "C" fn it_get_pathinfo(
    ia_handle: Handle,
    spigot_id: usize,
    net_addr_in: *const NetAddr,
    num_paths: *mut usize,
    total_paths: *mut usize,
    paths: *mut Path,
) -> ItStatus {
    status(|| {
        let ia = handles::get_ia(ia_handle)?;
        if spigot_id >= ia.spigots().len() {
            return Err(Error::InvalidSpigot);
        }
        // SAFETY: caller's contract.
        let peer = ip_of(&unsafe { get(net_addr_in)? })?;
        // SAFETY: caller's contract.
        let room = unsafe { get(num_paths)? };
        let ib = ia.transport() == Transport::InfiniBand;
        let local = ia.spigots()[spigot_id].source_for(peer);
        let mut p = path_to(Some((peer, 0).into()), local, ib);
        p.spigot_id = spigot_id;
        p.timeout = 10_000_000;
        // SAFETY: caller's contract (`paths` holds `room` entries).
        unsafe {
            if room >= 1 {
                put(paths, p)?;
            }
            put(num_paths, room.min(1))?;
            put_opt(total_paths, 1)
        }
    })
}

/// `it_convert_net_addr`: between IPv4, IPv4-mapped IPv6 and IB GID forms.
///
/// # Safety
/// Pointers are null or valid.
#[no_mangle]
pub unsafe extern "C" fn it_convert_net_addr(
    source_addr: *const NetAddr,
    addr_type: u32,
    destination_addr: *mut NetAddr,
) -> ItStatus {
    status(|| {
        // SAFETY: caller's contract.
        let ip = ip_of(&unsafe { get(source_addr)? })?;
        let mut out = NetAddr::zeroed();
        out.addr_type = addr_type;
        match (addr_type, ip) {
            (IT_IPV4, IpAddr::V4(v4)) => out.addr.ipv4 = InAddr(v4.octets()),
            (IT_IPV6 | IT_IB_GID, ip) => {
                let v6 = match ip {
                    IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                    IpAddr::V6(v6) => v6,
                };
                out.addr.ipv6 = In6Addr(v6.octets());
            }
            _ => return Err(Error::InvalidConversion),
        }
        // SAFETY: caller's contract.
        unsafe { put(destination_addr, out) }
    })
}

/// `it_get_handle_type`
///
/// # Safety
/// `type_of_handle` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_get_handle_type(handle: Handle, type_of_handle: *mut u32) -> ItStatus {
    status(|| {
        let t = match handles::get(handle).ok_or(Error::InvalidHandle)? {
            Obj::Ia(_) => IT_HANDLE_TYPE_IA,
            Obj::Pz(_) => IT_HANDLE_TYPE_PZ,
            Obj::Evd(_) | Obj::Aevd(_) => IT_HANDLE_TYPE_EVD,
            Obj::Ep(_) => IT_HANDLE_TYPE_EP,
            Obj::Listen(_) => IT_HANDLE_TYPE_LISTEN,
            Obj::Lmr(_) => IT_HANDLE_TYPE_LMR,
            Obj::Rmr(_) => IT_HANDLE_TYPE_RMR,
            Obj::Srq(_) => IT_HANDLE_TYPE_SRQ,
        };
        // SAFETY: caller's contract.
        unsafe { put(type_of_handle, t) }
    })
}

/// `it_set_consumer_context` (the context is the union's 64 bits).
#[no_mangle]
pub extern "C" fn it_set_consumer_context(handle: Handle, context: u64) -> ItStatus {
    status(|| handles::set_context(handle, context))
}

/// `it_get_consumer_context`: `IT_ERR_NO_CONTEXT` until one is set.
///
/// # Safety
/// `context` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn it_get_consumer_context(handle: Handle, context: *mut u64) -> ItStatus {
    status(|| {
        let c = handles::context(handle)?;
        // SAFETY: caller's contract.
        unsafe { put(context, c) }
    })
}

#[no_mangle]
pub extern "C" fn it_hton64(hostint: u64) -> u64 {
    hostint.to_be()
}

#[no_mangle]
pub extern "C" fn it_ntoh64(netint: u64) -> u64 {
    u64::from_be(netint)
}
