//! The SDP connections a listener shared by `fork` hands out as kernel TCP connections.
//!
//! After a `fork`, a listening socket is in several processes, and any of them may
//! `accept` on it (nginx's workers accept on their master's listener). The SDP listener
//! lives in the process that made it (the owner), so the owner's progress thread accepts
//! the SDP connections and hands each to the kernel listener as a loopback TCP connection
//! (the bridge), relaying its bytes ([`krdma_sdp::conn::Conn::relay_through`]). Whoever
//! accepts the bridge gets an ordinary TCP socket. So that it also gets the SDP
//! connection's addresses (from `accept` and `getpeername`, as a TCP socket would give
//! them), the owner files them here, under the bridge's port, before connecting; the map
//! is a shared anonymous mapping made before the first `fork` that shares a listener, so
//! every process forked after it sees the same one.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// Bridges waiting to be accepted, at most (a full map files no more: those bridges are
/// accepted with their loopback addresses).
const SLOTS: usize = 1024;
/// A slot's key: free, being written, or `FILED | port`.
const FREE: u32 = 0;
const WRITING: u32 = 1 << 31;
const FILED: u32 = 1 << 30;

/// One filed bridge: its key, then the SDP socket's local and peer addresses.
#[repr(C)]
struct Slot {
    key: AtomicU32,
    local: [AtomicU32; 5],
    peer: [AtomicU32; 5],
}

/// An address in five words: the IPv6 (or v4-mapped) address, then the port.
fn encode(a: SocketAddr, out: &[AtomicU32; 5]) {
    let ip = match a.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let o = ip.octets();
    for (i, w) in out[..4].iter().enumerate() {
        w.store(
            u32::from_be_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]),
            Ordering::Relaxed,
        );
    }
    out[4].store(u32::from(a.port()), Ordering::Relaxed);
}

fn decode(w: &[AtomicU32; 5]) -> SocketAddr {
    let mut o = [0u8; 16];
    for i in 0..4 {
        o[4 * i..4 * i + 4].copy_from_slice(&w[i].load(Ordering::Relaxed).to_be_bytes());
    }
    let v6 = Ipv6Addr::from(o);
    let ip = v6
        .to_ipv4_mapped()
        .map(IpAddr::V4)
        .unwrap_or(IpAddr::V6(v6));
    SocketAddr::new(ip, w[4].load(Ordering::Relaxed) as u16)
}

struct Map(&'static [Slot]);

static MAP: OnceLock<Option<Map>> = OnceLock::new();

/// The shared map; made on first call (call it before the `fork` that shares it).
fn map() -> Option<&'static [Slot]> {
    MAP.get_or_init(|| {
        let len = SLOTS * std::mem::size_of::<Slot>();
        // SAFETY: a fresh anonymous shared mapping, zero-filled by the kernel; it is never
        // unmapped, so the slice over it lives for the program. Zeroed `Slot`s are valid
        // (atomics of value 0, `FREE`), and every access goes through the atomics, so
        // processes sharing the pages never race on plain memory.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return None;
            }
            Some(Map(std::slice::from_raw_parts(p as *const Slot, SLOTS)))
        }
    })
    .as_ref()
    .map(|m| m.0)
}

/// Make the map now (before a `fork` that shares a listener).
pub fn prepare() {
    let _ = map();
}

/// File the addresses of an SDP connection about to be bridged from loopback port
/// `port`. Returns whether there was room.
pub fn file(port: u16, local: SocketAddr, peer: SocketAddr) -> bool {
    let Some(m) = map() else { return false };
    for s in m {
        if s.key
            .compare_exchange(FREE, WRITING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            encode(local, &s.local);
            encode(peer, &s.peer);
            s.key.store(FILED | u32::from(port), Ordering::Release);
            return true;
        }
    }
    false
}

/// Take the addresses filed for the bridge from loopback port `port`, if it is one.
pub fn take(port: u16) -> Option<(SocketAddr, SocketAddr)> {
    let m = MAP.get()?.as_ref()?.0;
    let want = FILED | u32::from(port);
    for s in m {
        if s.key.load(Ordering::Acquire) == want {
            let got = (decode(&s.local), decode(&s.peer));
            if s.key
                .compare_exchange(want, FREE, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return Some(got);
            }
        }
    }
    None
}

/// Forget what was filed for `port` (its bridge never connected).
pub fn withdraw(port: u16) {
    let _ = take(port);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filed_addresses_come_back_once() {
        let l: SocketAddr = "10.1.2.3:80".parse().unwrap();
        let p: SocketAddr = "[fe80::1]:4444".parse().unwrap();
        assert!(file(40000, l, p));
        assert!(file(40001, p, l));
        assert_eq!(take(40000), Some((l, p)));
        assert_eq!(take(40000), None);
        assert_eq!(take(40001), Some((p, l)));
        withdraw(40002);
    }
}
