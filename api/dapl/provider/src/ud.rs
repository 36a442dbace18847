//! The IB extension's unreliable datagrams (`dat_ib_extensions.h`): a UD endpoint's
//! resolutions reach the consumer as `DAT_IB_UD_CONNECTION_EVENT_ESTABLISHED` with a
//! `DAT_IB_ADDR_HANDLE` in the event's extension data, and the consumer hands that
//! handle back to `dat_ib_post_send_ud`. Its `ah` is the address of our address handle
//! object, kept here (with the Q_Key the resolution reported) until the consumer frees it
//! (`dat_ib_ud_ah_free`) or its endpoint goes.

use crate::sys::*;
use krdma_dapl as dapl;
use krdma_itapi::UdRemote;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

/// Resolutions handed to consumers: by the `ah` value they were given, with the id of
/// the endpoint that made them.
fn table() -> &'static Mutex<HashMap<usize, (u64, UdRemote)>> {
    static T: OnceLock<Mutex<HashMap<usize, (u64, UdRemote)>>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Keep `remote` for endpoint `ep`; the `ah` value the consumer names it by.
pub fn keep(ep: u64, remote: &UdRemote) -> usize {
    let key = Arc::as_ptr(&remote.ah) as usize;
    table().lock().insert(key, (ep, remote.clone()));
    key
}

/// The consumer's `DAT_IB_ADDR_HANDLE` (argument `arg` of its call).
fn read(h: *const DAT_IB_ADDR_HANDLE, arg: u32) -> dapl::Result<DAT_IB_ADDR_HANDLE> {
    if h.is_null() {
        return Err(crate::boundary::arg_error(arg));
    }
    // SAFETY: the consumer passes the address handle of an extension event it got (or a
    // copy of one); it is read, never kept.
    Ok(unsafe { h.read_unaligned() })
}

/// The resolution the consumer's `DAT_IB_ADDR_HANDLE` names.
pub fn lookup(h: *const DAT_IB_ADDR_HANDLE) -> dapl::Result<UdRemote> {
    let h = read(h, 5)?;
    let (_, remote) = table()
        .lock()
        .get(&(h.ah as usize))
        .cloned()
        .ok_or_else(|| crate::boundary::arg_error(5))?;
    // The consumer names the QP (the passive side's resolution knows none).
    Ok(UdRemote {
        qpn: h.qpn,
        ..remote
    })
}

/// The consumer is done with the address handle `h` names.
pub fn free(h: *const DAT_IB_ADDR_HANDLE) -> dapl::Result<()> {
    let h = read(h, 3)?;
    table().lock().remove(&(h.ah as usize));
    Ok(())
}

/// Endpoint `ep` is freed: its resolutions go with it.
pub fn forget_ep(ep: u64) {
    table().lock().retain(|_, (owner, _)| *owner != ep);
}

/// `DAT_IB_EXTENSION_EVENT_DATA` of a resolution, as the extension data of its event:
/// type, status, (immediate), then the address handle (`ah`, QP number, the peer's
/// socket address in a `sockaddr_in6`-sized field), then the context.
pub fn extension_data(kind: u32, ah: usize, qpn: u32, peer: Option<SocketAddr>) -> [u64; 8] {
    let mut b = [0u8; 64];
    b[0..4].copy_from_slice(&kind.to_ne_bytes());
    b[16..24].copy_from_slice(&(ah as u64).to_ne_bytes());
    b[24..28].copy_from_slice(&qpn.to_ne_bytes());
    if let Some(a) = peer {
        let sa = crate::ia::sockaddr(a.ip(), a.port());
        // SAFETY: a `sockaddr_storage` is plain bytes; its first 28 cover a
        // `sockaddr_in6` (and a `sockaddr_in`).
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&*sa as *const libc::sockaddr_storage).cast::<u8>(),
                std::mem::size_of::<libc::sockaddr_in6>(),
            )
        };
        b[28..56].copy_from_slice(bytes);
    }
    let mut out = [0u64; 8];
    for (o, c) in out.iter_mut().zip(b.chunks_exact(8)) {
        *o = u64::from_ne_bytes(c.try_into().expect("8 bytes"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extension_data_has_the_headers_layout() {
        let peer: SocketAddr = "10.77.0.11:7174".parse().unwrap();
        let d = extension_data(DAT_IB_UD_REMOTE_AH, 0x1234_5678, 0x11, Some(peer));
        let b: Vec<u8> = d.iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(u32::from_ne_bytes(b[0..4].try_into().unwrap()), 6);
        assert_eq!(
            u64::from_ne_bytes(b[16..24].try_into().unwrap()),
            0x1234_5678
        );
        assert_eq!(u32::from_ne_bytes(b[24..28].try_into().unwrap()), 0x11);
        // sockaddr_in: family, port (network order), address.
        assert_eq!(
            u16::from_ne_bytes(b[28..30].try_into().unwrap()),
            libc::AF_INET as u16
        );
        assert_eq!(&b[30..32], &7174u16.to_be_bytes());
        assert_eq!(&b[32..36], &[10, 77, 0, 11]);
    }
}
