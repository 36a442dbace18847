//! siw connection setup under attack (audit H5 and L5), through both front doors: a flood
//! of connections that send half an MPA Request, peers that send one byte every two
//! seconds, and a listener whose `accept` keeps failing. The threads, descriptors and
//! handshake tables of the side serving the listener (this process, or `krdmad`) stay
//! bounded, slow handshakes end at the MPA deadline, failing accepts back off, a
//! legitimate client still connects, and a bystander tenant is served throughout.

use krdma_tests::{each_front_door, Bystander, FrontDoor};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tools::perf::{accept_endpoint, connect_endpoint};
use ual::{Context, Listener};

const BACKLOG: u32 = 16;
const BOUND: Duration = Duration::from_secs(2);
/// The first 18 bytes of an MPA Request: key, flags, revision — never the rest.
const HALF_REQUEST: &[u8] = b"MPA ID Req Frame\x00\x02";

/// The process that serves the listener: krdmad, or this one (embedded kAL).
fn server_pid(door: &FrontDoor) -> u32 {
    match door {
        FrontDoor::Daemon(d) => d.pid(),
        FrontDoor::Embedded => std::process::id(),
    }
}

fn count(dir: String) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn threads(pid: u32) -> usize {
    count(format!("/proc/{pid}/task"))
}

fn fds(pid: u32) -> usize {
    count(format!("/proc/{pid}/fd"))
}

fn counter(ctx: &Context, name: &str) -> u64 {
    let dev = ctx.device("siw0").unwrap().index;
    ctx.stat_device(dev)
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == name)
        .map(|(_, n)| n)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

/// Room for thousands of client sockets in this process.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

/// A victim context listening on siw0 with a small backlog.
fn listening(door: &FrontDoor) -> (Arc<Context>, Arc<Listener>, SocketAddr) {
    let ctx = door.open();
    let dev = ctx.device("siw0").unwrap().index;
    let l = ctx
        .listen(dev, "127.0.0.1:0".parse().unwrap(), BACKLOG)
        .unwrap();
    let at = SocketAddr::from(([127, 0, 0, 1], l.port));
    (ctx, l, at)
}

/// A legitimate client connects and is accepted, while whatever holds the listener's
/// backlog is still there.
fn legitimate_client_connects(door: &FrontDoor, ctx: &Arc<Context>, l: &Listener, at: SocketAddr) {
    let client = door.open();
    let dev = client.device("siw0").unwrap().index;
    let t0 = Instant::now();
    let c = std::thread::spawn(move || {
        connect_endpoint(&client, dev, at, 4096, 4).map(|ep| (ep, client))
    });
    let sdev = ctx.device("siw0").unwrap().index;
    let s = accept_endpoint(ctx, sdev, l, 4096, 4).expect("the server accepts");
    let (c, _client) = c.join().unwrap().expect("the client connects");
    eprintln!("legitimate client connected in {:?}", t0.elapsed());
    s.post_recv(1, 0, 8).unwrap();
    c.send(1, 0, 8, ual::send_flags::SIGNALED).unwrap();
    s.complete(1).unwrap();
}

#[test]
fn handshake_flood_is_bounded_and_a_client_still_connects() {
    raise_fd_limit();
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (ctx, l, at) = listening(door);
        let pid = server_pid(door);
        let (threads0, fds0) = (threads(pid), fds(pid));
        let own = |held: usize| if pid == std::process::id() { held } else { 0 };
        let mut held = Vec::new();
        let (mut max_threads, mut max_server_fds, mut max_active) = (0, 0, 0);
        let t0 = Instant::now();
        for i in 0..2000 {
            if let Ok(mut s) = TcpStream::connect_timeout(&at, Duration::from_secs(1)) {
                let _ = s.write_all(HALF_REQUEST);
                held.push(s);
            }
            if i % 100 == 99 {
                max_threads = max_threads.max(threads(pid));
                max_server_fds = max_server_fds.max(fds(pid).saturating_sub(own(held.len())));
                max_active = max_active.max(counter(&ctx, "handshakes_active"));
            }
        }
        eprintln!(
            "{}: {} connections in {:?}; server threads {threads0} -> max {max_threads}, \
             fds {fds0} -> max {max_server_fds}, handshakes at most {max_active}, evicted {}, refused {}",
            door.name(),
            held.len(),
            t0.elapsed(),
            counter(&ctx, "handshakes_evicted"),
            counter(&ctx, "connections_refused"),
        );
        assert!(
            held.len() > 1000,
            "the flood did not get through: {}",
            held.len()
        );
        assert!(max_threads <= threads0 + 2, "threads grew with the flood");
        assert!(
            max_server_fds <= fds0 + BACKLOG as usize + 8,
            "descriptors grew with the flood"
        );
        assert!(
            max_active <= BACKLOG as u64,
            "handshakes beyond the backlog"
        );
        assert!(counter(&ctx, "handshakes_evicted") > 0);
        // The flood's connections are all still open: a prompt client displaces one.
        legitimate_client_connects(door, &ctx, &l, at);
        drop(held);
        by.finish().assert_served(BOUND);
    });
}

#[test]
fn slow_loris_is_cut_off_at_the_mpa_deadline() {
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (ctx, l, at) = listening(door);
        let pid = server_pid(door);
        // The four peers below are threads of this process too.
        let own = if pid == std::process::id() { 4 } else { 0 };
        let threads0 = threads(pid) + own;
        let timeouts0 = counter(&ctx, "handshake_timeouts");
        // Four peers that each keep sending one byte of their Request every two seconds.
        let lorises: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut s = TcpStream::connect(at).unwrap();
                    let t0 = Instant::now();
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    for &b in HALF_REQUEST {
                        if s.write_all(&[b]).is_err() {
                            break;
                        }
                        // A read that ends (EOF or reset) rather than times out: cut off.
                        match s.read(&mut [0u8; 64]) {
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                            _ => break,
                        }
                    }
                    t0.elapsed()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(3));
        assert!(threads(pid) <= threads0 + 1, "a thread per slow handshake");
        let lived: Vec<Duration> = lorises.into_iter().map(|t| t.join().unwrap()).collect();
        eprintln!("{}: slow handshakes lived {lived:?}", door.name());
        for d in &lived {
            // The deadline is 10 s for the whole exchange; the Request would take 36 s.
            assert!(*d >= Duration::from_secs(8) && *d < Duration::from_secs(20));
        }
        assert!(counter(&ctx, "handshake_timeouts") >= timeouts0 + 4);
        legitimate_client_connects(door, &ctx, &l, at);
        by.finish().assert_served(BOUND);
    });
}

/// Set process `pid`'s soft descriptor limit (its hard limit stays).
fn set_fd_limit(pid: u32, soft: u64) -> u64 {
    let mut old: libc::rlimit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads nothing (null new limit) and fills `old`.
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: prlimit reads one rlimit struct from a live local and writes nothing.
    let r = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    old.rlim_cur
}

/// The lowest descriptor number `pid` has free: with its soft limit set there, every new
/// descriptor fails (EMFILE).
fn lowest_free_fd(pid: u32) -> u64 {
    (0..)
        .find(|n| !std::path::Path::new(&format!("/proc/{pid}/fd/{n}")).exists())
        .unwrap()
}

#[test]
fn failing_accepts_back_off() {
    use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    use std::os::fd::AsRawFd;
    each_front_door(|door| {
        let by = Bystander::start(door, "siw0");
        let (ctx, l, at) = listening(door);
        let pid = server_pid(door);
        let errors0 = counter(&ctx, "accept_errors");
        // Sockets for the clients first: in embedded mode the limit below is ours too.
        let clients: Vec<_> = (0..4)
            .map(|_| {
                socket(
                    AddressFamily::Inet,
                    SockType::Stream,
                    SockFlag::empty(),
                    None,
                )
                .unwrap()
            })
            .collect();
        let old = set_fd_limit(pid, lowest_free_fd(pid));
        let addr = SockaddrIn::from(match at {
            SocketAddr::V4(v4) => v4,
            SocketAddr::V6(_) => unreachable!("an IPv4 listener"),
        });
        for c in &clients {
            connect(c.as_raw_fd(), &addr).unwrap();
        }
        // The listener stays readable and every accept fails: a loop that retried at once
        // would count thousands of errors in these two seconds; the back-off (50 ms
        // doubling to 1 s) allows a handful.
        std::thread::sleep(Duration::from_secs(2));
        let errors = counter(&ctx, "accept_errors") - errors0;
        set_fd_limit(pid, old);
        eprintln!("{}: {errors} failed accepts in 2 s", door.name());
        assert!((1..=10).contains(&errors), "{errors} failed accepts in 2 s");
        // Descriptors again: the listener is back (within the longest pause).
        legitimate_client_connects(door, &ctx, &l, at);
        drop(clients);
        by.finish().assert_served(BOUND);
    });
}
