//! Registration with libdat2: `dat_provider_init` / `dat_provider_fini`, one
//! `DAT_PROVIDER` table per `dat.conf` entry (the IA name), and which device each name
//! opens.
//!
//! libdat2 calls `dat_provider_init` after every `dlopen` and `dat_provider_fini`
//! before every `dlclose` of this library. The library is linked "nodelete", so it
//! stays mapped and keeps its state across those cycles: the tables made at the first
//! init are registered again by later ones.

use crate::boundary::call;
use crate::sys::{DAT_PROVIDER, DAT_PROVIDER_INFO, DAT_RETURN};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::net::IpAddr;
use std::sync::OnceLock;

/// A registered name: its table and the device it opens.
struct Registered {
    provider: &'static DAT_PROVIDER,
    device: String,
    thread_safe: bool,
    /// The IA address `dat.conf` gives (see [`address_for`]).
    address: Option<IpAddr>,
}

fn names() -> &'static Mutex<HashMap<String, Registered>> {
    static N: OnceLock<Mutex<HashMap<String, Registered>>> = OnceLock::new();
    N.get_or_init(Default::default)
}

/// The device an IA name opens and the table its handles dispatch to.
pub fn lookup(name: &str) -> Option<(&'static DAT_PROVIDER, String, bool)> {
    names()
        .lock()
        .get(name)
        .map(|r| (r.provider, r.device.clone(), r.thread_safe))
}

/// The IA address `dat.conf` gives the entry `name` (its IA parameters' second word),
/// if any.
pub fn address(name: &str) -> Option<IpAddr> {
    names().lock().get(name).and_then(|r| r.address)
}

/// The address named by `dat.conf`'s IA parameters' second word: an IP address, or an
/// interface whose first address (IPv4 first) is taken — as OFA's `"eth0 0"` names the
/// netdev whose address is the IA's. Without it the IA reports the address other
/// processes on this host reach it at (see `krdma_itapi::Ia::local_address`); a
/// consumer that passes its IA address to a peer on another host (dtest does) needs it.
fn address_for(ia_params: Option<&str>) -> Option<IpAddr> {
    let word = ia_params?.split_whitespace().nth(1)?;
    if let Ok(ip) = word.parse() {
        return Some(ip);
    }
    let mut found: Vec<IpAddr> = nix::ifaddrs::getifaddrs()
        .ok()?
        .filter(|a| a.interface_name == word)
        .filter_map(|a| {
            let a = a.address?;
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect();
    found.sort_by_key(|ip| ip.is_ipv6());
    let ip = found.first().copied();
    if ip.is_none() {
        tracing::warn!(
            interface = word,
            "dat.conf names an interface with no address"
        );
    }
    ip
}

/// The device named by `dat.conf`'s IA parameters (`"siw0"`, `"rxe0 1"`: the first
/// word), else by the IA name (`krdma-siw0` → `siw0`).
fn device_for(name: &str, ia_params: Option<&str>) -> String {
    ia_params
        .and_then(|p| p.split_whitespace().next())
        .map(str::to_string)
        .unwrap_or_else(|| {
            name.strip_prefix(krdma_dapl::NAME_PREFIX)
                .unwrap_or(name)
                .to_string()
        })
}

type RegistryFn = unsafe extern "C" fn(*const DAT_PROVIDER, *const DAT_PROVIDER_INFO) -> DAT_RETURN;

/// libdat2's `dat_registry_add_provider` / `_remove_provider`, found at run time (the
/// consumer loaded libdat2; this library does not link it, so it builds and loads
/// where libdat2 is not installed).
fn registry_fn(name: &CStr) -> Option<RegistryFn> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks a symbol up.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if sym.is_null() {
        tracing::error!(symbol = ?name, "libdat2 is not loaded: cannot register");
        return None;
    }
    // SAFETY: the symbol is libdat2's function of this signature (`dat_registry.h`).
    Some(unsafe { std::mem::transmute::<*mut libc::c_void, RegistryFn>(sym) })
}

/// Called by libdat2 after it loads this library for the `dat.conf` entry `info`.
///
/// # Safety
///
/// `info` is libdat2's entry, `instance_data` its IA parameters (NUL-terminated or
/// null).
#[no_mangle]
pub unsafe extern "C" fn dat_provider_init(
    info: *const DAT_PROVIDER_INFO,
    instance_data: *const c_char,
) {
    let _ = call("dat_provider_init", || {
        if info.is_null() || !info.is_aligned() {
            return Err(crate::boundary::arg_error(1));
        }
        // SAFETY: libdat2 passes its entry, valid for the call; the name is a
        // NUL-terminated array of DAT_NAME_MAX_LENGTH.
        let (name, thread_safe) = unsafe {
            let i = &*info;
            let name = CStr::from_ptr(i.ia_name.as_ptr())
                .to_string_lossy()
                .into_owned();
            (name, i.is_thread_safe != 0)
        };
        let params = (!instance_data.is_null())
            // SAFETY: libdat2's IA-parameter string, NUL-terminated.
            .then(|| {
                unsafe { CStr::from_ptr(instance_data) }
                    .to_string_lossy()
                    .into_owned()
            });
        let device = device_for(&name, params.as_deref());
        let address = address_for(params.as_deref());
        let provider = {
            let mut n = names().lock();
            let r = n.entry(name.clone()).or_insert_with(|| Registered {
                provider: Box::leak(Box::new(crate::vtable::table(
                    CString::new(name.clone()).unwrap_or_default().into_raw(),
                ))),
                device: device.clone(),
                thread_safe,
                address,
            });
            r.device = device.clone();
            r.thread_safe = thread_safe;
            r.address = address;
            r.provider
        };
        if let Some(add) = registry_fn(c"dat_registry_add_provider") {
            // SAFETY: libdat2's function with its own entry and our leaked table.
            let r = unsafe { add(provider, info) };
            tracing::info!(name, device, status = r, "DAT provider registered");
        }
        Ok(())
    });
}

/// Called by libdat2 before it unloads this library.
///
/// # Safety
///
/// `info` is the entry `dat_provider_init` was called with.
#[no_mangle]
pub unsafe extern "C" fn dat_provider_fini(info: *const DAT_PROVIDER_INFO) {
    let _ = call("dat_provider_fini", || {
        if info.is_null() || !info.is_aligned() {
            return Err(crate::boundary::arg_error(1));
        }
        // SAFETY: libdat2's entry, valid for the call.
        let name = unsafe { CStr::from_ptr((*info).ia_name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let provider = names().lock().get(&name).map(|r| r.provider);
        if let (Some(p), Some(remove)) = (provider, registry_fn(c"dat_registry_remove_provider")) {
            // SAFETY: as for registration.
            let r = unsafe { remove(p, info) };
            tracing::info!(name, status = r, "DAT provider unregistered");
        }
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ia_parameters_name_the_device_and_optionally_the_address() {
        assert_eq!(device_for("krdma-siw0", None), "siw0");
        assert_eq!(device_for("ofa-v2-eth0", Some("rxe0 10.77.0.1")), "rxe0");
        assert_eq!(address_for(Some("rxe0")), None);
        assert_eq!(
            address_for(Some("rxe0 10.77.0.1")),
            Some("10.77.0.1".parse().unwrap())
        );
        assert_eq!(
            address_for(Some("siw0 lo")),
            Some("127.0.0.1".parse().unwrap())
        );
        assert_eq!(address_for(Some("siw0 no-such-interface0")), None);
    }
}
