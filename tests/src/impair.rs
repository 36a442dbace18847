//! A lossy link in user space: a two-port Ethernet relay that forwards frames between two
//! interfaces with loss, duplication, delay with jitter, and reordering — what `tc netem`
//! does, for kernels built without it (this one: `CONFIG_NET_SCH_NETEM` is not set).
//!
//! Topology: host A (network namespace) ⇄ veth ⇄ relay port 1 · relay port 2 ⇄ veth ⇄
//! host B. The relay reads every frame arriving on one port with an `AF_PACKET` socket and
//! sends it out of the other after the impairments; ARP and everything else pass through
//! the same way, so the two hosts see one Ethernet segment.

use std::collections::BinaryHeap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the link does to each frame.
#[derive(Debug, Clone, Copy)]
pub struct Impairment {
    /// Probability a frame is dropped.
    pub loss: f64,
    /// Probability a frame is sent twice.
    pub duplicate: f64,
    /// Delay of a frame, plus up to `jitter` more.
    pub delay: Duration,
    pub jitter: Duration,
    /// Probability a frame skips the delay (and so overtakes the ones before it).
    pub reorder: f64,
}

impl std::fmt::Display for Impairment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "loss {:.0}%, duplicate {:.0}%, delay {:?} + up to {:?}, reorder {:.0}%",
            self.loss * 100.0,
            self.duplicate * 100.0,
            self.delay,
            self.jitter,
            self.reorder * 100.0
        )
    }
}

/// Frames the relay saw and what it did with them.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
    pub duplicated: AtomicU64,
    pub reordered: AtomicU64,
}

/// The running relay; stops (and joins its threads) on drop.
pub struct Relay {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub stats: Arc<RelayStats>,
}

const PACKET_IGNORE_OUTGOING: libc::c_int = 23;

/// An `AF_PACKET` socket bound to interface `ifname`, seeing every frame it receives.
fn packet_socket(ifname: &str) -> std::io::Result<OwnedFd> {
    let proto = (libc::ETH_P_ALL as u16).to_be() as libc::c_int;
    // SAFETY: plain socket(2); the result is checked before it is owned.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(ifname).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: sockaddr_ll is plain data; all-zero is valid before the fields are set.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
    sll.sll_ifindex = index as i32;
    // SAFETY: sll is a valid sockaddr_ll of the size passed.
    let r = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            &sll as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let one: libc::c_int = 1;
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 1000,
    };
    let size: libc::c_int = 8 << 20;
    // SAFETY: each option value is a live value of the size passed.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_PACKET,
            PACKET_IGNORE_OUTGOING,
            &one as *const _ as *const libc::c_void,
            4,
        );
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &size as *const _ as *const libc::c_void,
            4,
        );
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUFFORCE,
            &size as *const _ as *const libc::c_void,
            4,
        );
    }
    Ok(sock)
}

/// A small deterministic generator (xorshift), seeded per direction.
struct Rng(u64);

impl Rng {
    fn chance(&mut self, p: f64) -> bool {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// One direction: frames from `rx` leave through `tx`.
fn forward(
    rx: OwnedFd,
    tx: OwnedFd,
    imp: Impairment,
    seed: u64,
    stop: Arc<AtomicBool>,
    stats: Arc<RelayStats>,
) {
    let mut rng = Rng(seed | 1);
    // (due, sequence) → frame; Reverse ordering through negation of the key.
    let mut queue: BinaryHeap<std::cmp::Reverse<(Instant, u64, Vec<u8>)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        // Wait for a frame, but no longer than until the next queued one is due.
        let wait = queue
            .peek()
            .map(|std::cmp::Reverse((due, _, _))| due.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(5))
            .min(Duration::from_millis(5));
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: wait.as_nanos() as libc::c_long,
        };
        let mut pfd = libc::pollfd {
            fd: rx.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd and a valid timespec for the duration of the call.
        let ready = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        let n = if ready > 0 {
            // SAFETY: recv writes at most buf.len() bytes into buf; it does not block.
            unsafe {
                libc::recv(
                    rx.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            }
        } else {
            -1
        };
        let now = Instant::now();
        if n > 0 {
            let frame = buf[..n as usize].to_vec();
            if rng.chance(imp.loss) {
                stats.dropped.fetch_add(1, Ordering::Relaxed);
            } else {
                let copies = if rng.chance(imp.duplicate) {
                    stats.duplicated.fetch_add(1, Ordering::Relaxed);
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    let due = if rng.chance(imp.reorder) {
                        stats.reordered.fetch_add(1, Ordering::Relaxed);
                        now
                    } else {
                        let extra = imp
                            .jitter
                            .mul_f64(if rng.chance(0.5) { 0.75 } else { 0.25 });
                        now + imp.delay + extra
                    };
                    seq += 1;
                    queue.push(std::cmp::Reverse((due, seq, frame.clone())));
                }
            }
        }
        while let Some(std::cmp::Reverse((due, _, _))) = queue.peek() {
            if *due > Instant::now() {
                break;
            }
            let Some(std::cmp::Reverse((_, _, f))) = queue.pop() else {
                break;
            };
            // SAFETY: send reads f.len() bytes from f; the socket is bound to its port.
            unsafe {
                libc::send(
                    tx.as_raw_fd(),
                    f.as_ptr() as *const libc::c_void,
                    f.len(),
                    0,
                )
            };
            stats.forwarded.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Relay {
    /// Relay between interfaces `a` and `b` (both up, in this network namespace).
    pub fn start(a: &str, b: &str, imp: Impairment) -> std::io::Result<Relay> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(RelayStats::default());
        let mut threads = Vec::new();
        for (i, (from, to)) in [(a, b), (b, a)].into_iter().enumerate() {
            let (rx, tx) = (packet_socket(from)?, packet_socket(to)?);
            let (stop, stats) = (stop.clone(), stats.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("relay-{i}"))
                    .spawn(move || {
                        forward(rx, tx, imp, 0x9e37_79b9_7f4a_7c15 ^ i as u64, stop, stats)
                    })?,
            );
        }
        Ok(Relay {
            stop,
            threads,
            stats,
        })
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
