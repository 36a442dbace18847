//! Hostile consumers of the shared rings (audit C2, H1, H6): ring memory that is not a
//! sealed memfd, doorbells that are not non-blocking eventfds, and ring indices that the
//! consumer churns or corrupts. Every attack runs through both front doors, with a
//! [`Bystander`] created before it whose round trips must stay under [`BOUND`], and the
//! kAL (the daemon's FUSE threads) must keep answering another context's calls.
//!
//! Over 600 lines: independent tests of one attack surface (the shared rings), sharing
//! their set-up.

use bytemuck::{Pod, Zeroable};
use krdma_tests::{connected_pair, each_front_door, kal_counter, Bystander, FrontDoor};
use rnicpi::queue::{ring_bytes, CONSUMER, PRODUCER, RING_HEADER};
use rnicpi::{Access, Cqe, EventKind, QpRingLayout, QpType, SharedMem, VerbsError, Wqe, WrOpcode};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::abi::{self, cmd};
use ual::Context;

/// The longest a bystander's round trip, or another context's control call, may take
/// while an attack runs: "a hostile tenant costs only itself".
const BOUND: Duration = Duration::from_secs(2);
/// How long a churning attack runs.
const ATTACK: Duration = Duration::from_secs(2);
const DEVICES: [&str; 2] = ["siw0", "rxe0"];
/// Queue depth of the endpoints `connected_pair` makes (send ring capacity).
const DEPTH: u32 = 64;

// ---- playing a hostile consumer ----------------------------------------------------

/// The producer and consumer words of the ring at byte `off` of `mem` (our own mapping
/// of our own ring memory: the consumer may write whatever it likes there).
fn indices(mem: &SharedMem, off: usize) -> (&AtomicU32, &AtomicU32) {
    assert!(off + RING_HEADER <= mem.len());
    // SAFETY: both words lie inside the mapping (checked above), are 4-byte aligned
    // (mapping and ring offsets are 64-aligned), and the engine only ever touches them
    // atomically too; `mem` outlives the references.
    unsafe {
        (
            &*(mem.as_ptr().add(off + PRODUCER) as *const AtomicU32),
            &*(mem.as_ptr().add(off + CONSUMER) as *const AtomicU32),
        )
    }
}

/// Write slot `i` of the ring of `T` at byte `off` of `mem`.
fn write_slot<T: Pod>(mem: &SharedMem, off: usize, cap: u32, i: u32, item: T) {
    let at = off + RING_HEADER + (i % cap) as usize * std::mem::size_of::<T>();
    assert!(at + std::mem::size_of::<T>() <= mem.len());
    // SAFETY: the slot lies inside the mapping (checked above); a volatile write of a
    // plain-old-data value, which the engine copies out before looking at it.
    unsafe { std::ptr::write_volatile(mem.as_ptr().add(at) as *mut T, item) };
}

fn memfd(flags: libc::c_uint, len: usize) -> OwnedFd {
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1 (checked).
    let fd = unsafe { libc::memfd_create(c"hostile".as_ptr(), libc::MFD_CLOEXEC | flags) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    std::fs::File::from(fd.try_clone().unwrap())
        .set_len(len as u64)
        .unwrap();
    fd
}

fn eventfd(flags: i32) -> OwnedFd {
    // SAFETY: eventfd returns a new descriptor or -1 (checked).
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | flags) };
    assert!(fd >= 0, "eventfd");
    // SAFETY: a fresh descriptor nobody else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn pipe_end() -> OwnedFd {
    nix::unistd::pipe().unwrap().0
}

/// An anonymous regular file of `len` bytes (`O_TMPFILE`: no name anyone could race).
fn regular_file(len: usize) -> OwnedFd {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .open(std::env::temp_dir())
        .unwrap();
    f.set_len(len as u64).unwrap();
    f.into()
}

/// Descriptors that must never be taken for the memory of a ring of `len` bytes: each
/// right-sized, so only what the file is can refuse it.
fn bad_ring_memory(door: &FrontDoor, len: usize) -> Vec<(&'static str, OwnedFd)> {
    let shrink_only = memfd(libc::MFD_ALLOW_SEALING, len);
    // SAFETY: F_ADD_SEALS on a memfd we own.
    let r = unsafe {
        libc::fcntl(
            shrink_only.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK,
        )
    };
    assert_eq!(r, 0);
    // Sealed as asked, but on hugetlbfs: a hole punched later faults in a huge page the
    // pool may not have, a SIGBUS in whoever touches it.
    let huge = memfd(
        libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB,
        len.next_multiple_of(2 << 20),
    );
    // SAFETY: F_ADD_SEALS on a memfd we own.
    let r = unsafe {
        libc::fcntl(
            huge.as_raw_fd(),
            libc::F_ADD_SEALS,
            rnicpi::queue::RING_SEALS,
        )
    };
    assert_eq!(r, 0);
    let mut v = vec![
        ("unsealed memfd", memfd(0, len)),
        ("memfd sealed against shrinking only", shrink_only),
        ("sealed hugetlbfs memfd", huge),
        ("regular file", regular_file(len)),
        ("pipe", pipe_end()),
    ];
    v.extend(device_file(door));
    v
}

/// Through the daemon, its own device file: a FUSE file that the daemon itself serves.
fn device_file(door: &FrontDoor) -> Option<(&'static str, OwnedFd)> {
    let FrontDoor::Daemon(d) = door else {
        return None;
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&d.path)
        .unwrap();
    Some(("the device file itself (FUSE)", f.into()))
}

fn raw_cq(ctx: &Context, dev: u32, memfd: i32, cqe: u32) -> rnicpi::Result<u32> {
    raw_cq_signalled(ctx, dev, memfd, cqe, -1)
}

fn raw_cq_signalled(
    ctx: &Context,
    dev: u32,
    memfd: i32,
    cqe: u32,
    signal: i32,
) -> rnicpi::Result<u32> {
    let mut a = abi::CreateCq {
        dev,
        cqe,
        memfd,
        handle: 0,
        signal,
    };
    ctx.channel().call(cmd::CREATE_CQ, &mut a).map(|_| a.handle)
}

fn raw_qp(ctx: &Context, pd: u32, cq: u32, memfd: i32, doorbell: i32) -> rnicpi::Result<u32> {
    let mut a = abi::CreateQp {
        pd,
        send_cq: cq,
        recv_cq: cq,
        qp_type: QpType::Rc as u8,
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        memfd,
        doorbell_fd: doorbell,
        ..Zeroable::zeroed()
    };
    ctx.channel().call(cmd::CREATE_QP, &mut a).map(|_| a.handle)
}

fn raw_srq(ctx: &Context, pd: u32, memfd: i32) -> rnicpi::Result<u32> {
    let mut a = abi::CreateSrq {
        pd,
        max_wr: 8,
        max_sge: 1,
        limit: 0,
        memfd,
        handle: 0,
    };
    ctx.channel()
        .call(cmd::CREATE_SRQ, &mut a)
        .map(|_| a.handle)
}

fn raw_destroy(ctx: &Context, command: u32, handle: u32) {
    let mut d = abi::Destroy { handle, _pad: 0 };
    ctx.channel().call(command, &mut d).unwrap();
}

fn qp_layout() -> QpRingLayout {
    QpRingLayout::new(8, 8).unwrap()
}

/// Another context's control calls while `attack` runs: their longest round trip.
fn control_latency_during(door: &FrontDoor, attack: impl FnOnce()) -> Duration {
    let prober = door.open();
    let dev = prober.device("siw0").unwrap().index;
    let stop = Arc::new(AtomicBool::new(false));
    let halt = stop.clone();
    let t = std::thread::spawn(move || {
        let mut worst = Duration::ZERO;
        while !halt.load(Ordering::Relaxed) {
            let t0 = Instant::now();
            drop(prober.alloc_pd(dev).expect("the kAL keeps answering"));
            worst = worst.max(t0.elapsed());
            std::thread::sleep(Duration::from_millis(5));
        }
        worst
    });
    attack();
    stop.store(true, Ordering::Relaxed);
    t.join().unwrap()
}

// ---- C2 ------------------------------------------------------------------------------

/// Audit C2: a ring is only ever a memfd sealed against shrinking, growing and sealing,
/// so no consumer can truncate it under the engine (a SIGBUS that used to kill krdmad).
#[test]
fn ring_memory_must_be_a_sealed_memfd() {
    each_front_door(|door| {
        let bystander = Bystander::start(door, "siw0");
        let ctx = door.open();
        let dev = ctx.device("siw0").unwrap().index;
        let pd = ctx.alloc_pd(dev).unwrap();
        let good_cq = ctx.create_cq(dev, 16).unwrap();
        let before = kal_counter(&ctx, "ring_memory_refused");
        let mut refused = 0;
        for (what, fd) in bad_ring_memory(door, ring_bytes::<Cqe>(16)) {
            let r = raw_cq(&ctx, dev, fd.as_raw_fd(), 16);
            assert_eq!(r, Err(VerbsError::Invalid), "CQ ring in {what}");
            refused += 1;
        }
        for (what, fd) in bad_ring_memory(door, qp_layout().total) {
            let bell = eventfd(libc::EFD_NONBLOCK);
            let r = raw_qp(
                &ctx,
                pd.handle,
                good_cq.handle,
                fd.as_raw_fd(),
                bell.as_raw_fd(),
            );
            assert_eq!(r, Err(VerbsError::Invalid), "QP rings in {what}");
            refused += 1;
        }
        for (what, fd) in bad_ring_memory(door, ring_bytes::<Wqe>(8)) {
            let r = raw_srq(&ctx, pd.handle, fd.as_raw_fd());
            assert_eq!(r, Err(VerbsError::Invalid), "SRQ ring in {what}");
            refused += 1;
        }
        assert_eq!(kal_counter(&ctx, "ring_memory_refused"), before + refused);

        // Sealed rings are taken; truncating them afterwards is what the seals forbid,
        // and the engine keeps using them: a doorbell, then DESTROY_QP flushes the
        // queued request into the CQ's ring.
        let cq_mem = SharedMem::create("cq", ring_bytes::<Cqe>(16)).unwrap();
        let qp_mem = SharedMem::create("qp", qp_layout().total).unwrap();
        let srq_mem = SharedMem::create("srq", ring_bytes::<Wqe>(8)).unwrap();
        let cq = raw_cq(&ctx, dev, cq_mem.fd().as_raw_fd(), 16).unwrap();
        let bell = eventfd(libc::EFD_NONBLOCK);
        let qp = raw_qp(
            &ctx,
            pd.handle,
            cq,
            qp_mem.fd().as_raw_fd(),
            bell.as_raw_fd(),
        )
        .unwrap();
        let srq = raw_srq(&ctx, pd.handle, srq_mem.fd().as_raw_fd()).unwrap();
        for (what, m) in [("CQ", &cq_mem), ("QP", &qp_mem), ("SRQ", &srq_mem)] {
            for len in [0, 4096, 1 << 20] {
                let r = nix::unistd::ftruncate(m.fd(), len);
                assert_eq!(r, Err(nix::errno::Errno::EPERM), "{what} ring resized");
            }
            // SAFETY: F_ADD_SEALS on a descriptor we own; it must be refused (F_SEAL_SEAL).
            let r =
                unsafe { libc::fcntl(m.fd().as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) };
            assert_eq!(r, -1, "{what} ring write-sealed");
        }
        let layout = qp_layout();
        let (sq_prod, _) = indices(&qp_mem, layout.sq_offset);
        write_slot(
            &qp_mem,
            layout.sq_offset,
            layout.sq_depth,
            0,
            Wqe::new(7, WrOpcode::Send, &[]),
        );
        sq_prod.store(1, Ordering::Release);
        nix::unistd::write(&bell, &1u64.to_ne_bytes()).unwrap();
        raw_destroy(&ctx, cmd::DESTROY_QP, qp);
        let (cq_prod, _) = indices(&cq_mem, 0);
        assert_eq!(
            cq_prod.load(Ordering::Acquire),
            1,
            "the flushed request completed"
        );
        raw_destroy(&ctx, cmd::DESTROY_SRQ, srq);
        raw_destroy(&ctx, cmd::DESTROY_CQ, cq);

        // The kAL is alive and serves a new context.
        door.open()
            .alloc_pd(dev)
            .expect("kAL alive after the attack");
        bystander.finish().assert_served(BOUND);
    });
}

// ---- H1 ------------------------------------------------------------------------------

/// Audit H1: a doorbell is only ever a non-blocking eventfd, read without waiting; a
/// consumer that makes its eventfd blocking afterwards and drains it itself cannot make
/// the doorbell thread wait, and the kAL keeps answering everyone else.
#[test]
fn doorbell_must_be_a_non_blocking_eventfd() {
    each_front_door(|door| {
        let bystander = Bystander::start(door, "siw0");
        let ctx = door.open();
        let dev = ctx.device("siw0").unwrap().index;
        let pd = ctx.alloc_pd(dev).unwrap();
        let cq = ctx.create_cq(dev, 16).unwrap();
        let before = kal_counter(&ctx, "doorbell_refused");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut bad: Vec<(&str, OwnedFd)> = vec![
            ("blocking eventfd", eventfd(0)),
            ("pipe", pipe_end()),
            ("regular file", regular_file(8)),
            ("socket", udp.into()),
        ];
        bad.extend(device_file(door));
        let n = bad.len() as u64;
        for (what, fd) in bad {
            let mem = SharedMem::create("qp", qp_layout().total).unwrap();
            let r = raw_qp(
                &ctx,
                pd.handle,
                cq.handle,
                mem.fd().as_raw_fd(),
                fd.as_raw_fd(),
            );
            assert_eq!(r, Err(VerbsError::Invalid), "doorbell {what}");
        }
        assert_eq!(kal_counter(&ctx, "doorbell_refused"), before + n);

        // Accepted non-blocking, then made blocking and raced by the consumer's own
        // reads (the old reactor blocked in read() forever, holding its global lock).
        // A second QP of the same context must keep being served afterwards: the
        // doorbell thread never waits on the first one's counter.
        let mem = SharedMem::create("qp", qp_layout().total).unwrap();
        let bell = Arc::new(eventfd(libc::EFD_NONBLOCK));
        let qp = raw_qp(
            &ctx,
            pd.handle,
            cq.handle,
            mem.fd().as_raw_fd(),
            bell.as_raw_fd(),
        )
        .unwrap();
        let mem2 = SharedMem::create("qp", qp_layout().total).unwrap();
        let bell2 = eventfd(libc::EFD_NONBLOCK);
        let qp2 = raw_qp(
            &ctx,
            pd.handle,
            cq.handle,
            mem2.fd().as_raw_fd(),
            bell2.as_raw_fd(),
        )
        .unwrap();
        nix::fcntl::fcntl(
            bell.as_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
        )
        .unwrap();
        let worst = control_latency_during(door, || {
            let deadline = Instant::now() + ATTACK;
            while Instant::now() < deadline {
                nix::unistd::write(&*bell, &1u64.to_ne_bytes()).unwrap();
                let mut buf = [0u8; 8];
                let iov = libc::iovec {
                    iov_base: buf.as_mut_ptr().cast(),
                    iov_len: 8,
                };
                // SAFETY: one iovec of our 8-byte buffer; RWF_NOWAIT so this thread never
                // waits either, whoever drains the counter first.
                unsafe { libc::preadv2(bell.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
            }
        });
        assert!(worst <= BOUND, "kAL stalled {worst:?} by a doorbell");
        let rung = kal_counter(&ctx, "doorbells_rung");
        nix::unistd::write(&bell2, &1u64.to_ne_bytes()).unwrap();
        let t0 = Instant::now();
        while kal_counter(&ctx, "doorbells_rung") == rung {
            assert!(
                t0.elapsed() <= BOUND,
                "the other QP's doorbell was not served"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        raw_destroy(&ctx, cmd::DESTROY_QP, qp2);
        raw_destroy(&ctx, cmd::DESTROY_QP, qp);
        bystander.finish().assert_served(BOUND);
    });
}

/// A CQ's signal socket (ABI 9): only one end of a Unix stream socket pair of the
/// caller's user is taken. One that the tenant then makes blocking and fills never stalls
/// the engine that writes it (its writes never wait: counted as finding the socket
/// full), and the completions still come.
#[test]
fn cq_signal_socket_must_be_a_stream_pair_and_never_stalls_the_engine() {
    use std::io::Write;
    use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
    each_front_door(|door| {
        let bystander = Bystander::start(door, "siw0");
        let ctx = door.open();
        let dev = ctx.device("siw0").unwrap().index;
        let before = kal_counter(&ctx, "cq_signal_refused");
        let path = std::env::temp_dir().join(format!("krdma-sig-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let named = UnixListener::bind(&path).unwrap();
        let client = UnixStream::connect(&path).unwrap();
        let (dgram, _other) = UnixDatagram::pair().unwrap();
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut bad: Vec<(&str, OwnedFd)> = vec![
            ("eventfd", eventfd(libc::EFD_NONBLOCK)),
            ("pipe", pipe_end()),
            ("regular file", regular_file(8)),
            ("datagram socket pair", dgram.into()),
            ("socket connected to a named one", client.into()),
            ("listening socket", named.into()),
            ("TCP socket", tcp.into()),
        ];
        bad.extend(device_file(door));
        let n = bad.len() as u64;
        for (what, fd) in bad {
            let mem = SharedMem::create("cq", ring_bytes::<Cqe>(16)).unwrap();
            let r = raw_cq_signalled(&ctx, dev, mem.fd().as_raw_fd(), 16, fd.as_raw_fd());
            assert_eq!(r, Err(VerbsError::Invalid), "signal socket {what}");
        }
        let _ = std::fs::remove_file(&path);
        assert_eq!(kal_counter(&ctx, "cq_signal_refused"), before + n);

        // Accepted; then filled by the tenant and made blocking (the description is
        // the engine's too).
        let (mut mine, _theirs) = UnixStream::pair().unwrap();
        let cq = ctx
            .create_cq_signalled(dev, 64, Some(mine.as_fd()))
            .unwrap();
        let access = tools::perf::ENDPOINT_ACCESS;
        let ep =
            tools::perf::endpoint_on(&ctx, dev, cq, 4096, 16, access, ual::QpType::Rc).unwrap();
        mine.set_nonblocking(true).unwrap();
        while mine.write(&[0; 4096]).is_ok() {}
        mine.set_nonblocking(false).unwrap();
        let ip = tools::perf::loopback_of(&ctx, dev).unwrap();
        let listener = ctx
            .listen(dev, std::net::SocketAddr::new(ip, 0), 4)
            .unwrap();
        let addr = std::net::SocketAddr::new(ip, listener.port);
        let peer_ctx = door.open();
        let peer = std::thread::spawn(move || {
            let ep = tools::perf::connect_endpoint(&peer_ctx, dev, addr, 4096, 16).unwrap();
            (peer_ctx, ep)
        });
        let ep = tools::perf::accept_into(&listener, ep).unwrap();
        let (_peer_ctx, peer) = peer.join().unwrap();
        let full = kal_counter(&ctx, "cq_signals_socket_full");
        let rounds = 20;
        for i in 0..rounds {
            ep.post_recv(i, 0, 64).unwrap();
            assert!(ep.cq.arm_to_signal(false));
            peer.send(i, 0, 8, rnicpi::send_flags::SIGNALED).unwrap();
            let deadline = Instant::now() + BOUND;
            let mut got = [Cqe::default(); 1];
            while ep.cq.poll(&mut got) == 0 {
                assert!(Instant::now() < deadline, "completion {i} never came");
                std::thread::yield_now();
            }
            assert_eq!(got[0].wr_id, i);
            peer.complete(1).unwrap();
        }
        let t0 = Instant::now();
        while kal_counter(&ctx, "cq_signals_socket_full") < full + rounds {
            assert!(t0.elapsed() <= BOUND, "signals not given (or not counted)");
            std::thread::sleep(Duration::from_millis(1));
        }
        bystander.finish().assert_served(BOUND);
    });
}

// ---- H6 ------------------------------------------------------------------------------

/// A thread that keeps the ring at byte `off` of `mem` holding `ahead` entries, whatever
/// the engine consumes, until `stop`.
fn churner(
    stop: &Arc<AtomicBool>,
    mem: &Arc<SharedMem>,
    off: usize,
    ahead: u32,
) -> std::thread::JoinHandle<()> {
    let (stop, mem) = (stop.clone(), mem.clone());
    std::thread::spawn(move || {
        let (prod, cons) = indices(&mem, off);
        while !stop.load(Ordering::Relaxed) {
            let c = cons.load(Ordering::Acquire);
            prod.store(c.wrapping_add(ahead), Ordering::Release);
        }
    })
}

/// Audit H6: a consumer that keeps its send ring looking full of local operations
/// (memory-window unbinds, which always succeed and complete at once) by rewriting the
/// producer index after every drain makes the engine replay them forever unless every
/// drain has a budget. The same consumer keeping one entry queued while its QP is
/// destroyed made the flush loop forever. Both must cost only the attacker.
#[test]
fn churned_send_ring_costs_only_its_owner() {
    each_front_door(|door| {
        for device in DEVICES {
            eprintln!("--- {device}");
            let bystander = Bystander::start(door, device);
            let (_a, b, _server, attacker) = connected_pair(door, device, 4096);
            let mw = b.alloc_mw(&attacker.pd).unwrap();
            let mem = attacker
                .qp
                .ring_memory()
                .expect("a device with shared rings");
            let layout = QpRingLayout::new(DEPTH, DEPTH).unwrap();
            let cap = layout.sq_depth;
            for i in 0..cap {
                let mut w = Wqe::bind_mw(i as u64, mw.rkey(), 0, 0, 0, Access::empty());
                w.flags = 0; // unsignaled: no completion, nothing to overflow
                write_slot(&mem, layout.sq_offset, cap, i, w);
            }
            let spent_before = kal_counter(&b, "drain_budget_spent");

            // Replay: a helper thread keeps producer = consumer + capacity, whatever the
            // engine consumed; another rings the doorbell now and then.
            let stop = Arc::new(AtomicBool::new(false));
            let churn = churner(&stop, &mem, layout.sq_offset, cap);
            let ringer = {
                let (stop, qp) = (stop.clone(), attacker.qp.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        qp.ring_doorbell();
                        std::thread::sleep(Duration::from_millis(10));
                    }
                })
            };
            let worst = control_latency_during(door, || std::thread::sleep(ATTACK));
            stop.store(true, Ordering::Relaxed);
            ringer.join().unwrap();
            churn.join().unwrap();
            assert!(worst <= BOUND, "kAL stalled {worst:?} by a churned ring");
            if device == "rxe0" {
                // rxe's doorbell sends at most 4 packets' worth inline and its first one
                // finds the whole ring queued: the budget is hit, whatever the timing.
                // (siw spends a ring's worth per call: it hits its budget only when the
                // churner refills during a call, which a loaded machine may never let
                // happen; there a missing budget costs only the QP's own threads.)
                assert!(
                    kal_counter(&b, "drain_budget_spent") > spent_before,
                    "the engine's drain budget was what stopped the replay"
                );
            }

            // Flush: one entry always queued (consumer = producer - 1) while destroyed.
            let stop = Arc::new(AtomicBool::new(false));
            let churn = churner(&stop, &mem, layout.sq_offset, 1);
            std::thread::sleep(Duration::from_millis(100));
            let t0 = Instant::now();
            drop(attacker); // DESTROY_QP: flushes the send ring
            let destroy = t0.elapsed();
            stop.store(true, Ordering::Relaxed);
            churn.join().unwrap();
            assert!(
                destroy <= BOUND,
                "DESTROY_QP took {destroy:?} on a churned ring"
            );
            let dev = b.device(device).unwrap().index;
            b.alloc_pd(dev)
                .expect("the attacker's own context still works");
            bystander.finish().assert_served(BOUND);
        }
    });
}

/// Audit H6: a ring index that makes no sense (more than a ring between producer and
/// consumer) moves the ring's object to error with an event and a counter.
#[test]
fn corrupt_ring_indices_move_the_object_to_error() {
    each_front_door(|door| {
        for device in DEVICES {
            eprintln!("--- {device}");
            let bystander = Bystander::start(door, device);
            let (a, _b, server, client) = connected_pair(door, device, 4096);
            let wait_for = |events: &crossbeam_channel::Receiver<rnicpi::Event>, kind| {
                let deadline = Instant::now() + Duration::from_secs(10);
                while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                    match events.recv_timeout(left) {
                        Ok(ev) if ev.kind == kind => return,
                        Ok(_) => {}
                        Err(_) => break,
                    }
                }
                panic!("no {kind:?} event");
            };

            // The server's completion ring: its consumer index far ahead of the engine.
            let cq_before = kal_counter(&a, "cq_ring_corrupt");
            let cq_mem = server.cq.ring_memory().expect("a device with shared rings");
            let (prod, cons) = indices(&cq_mem, 0);
            cons.store(
                prod.load(Ordering::Acquire).wrapping_add(1000),
                Ordering::Release,
            );
            server.post_recv(1, 0, 8).unwrap();
            client.send(2, 0, 8, rnicpi::send_flags::SIGNALED).unwrap();
            wait_for(server.cq.events(), EventKind::CqError);
            assert_eq!(kal_counter(&a, "cq_ring_corrupt"), cq_before + 1);
            // A QP that cannot complete its work goes to Error, and on siw its peer hears
            // of it (a Terminate: `QpFatal` there too): the send ring is tried on a fresh pair.
            drop((server, client));
            let (_a, b, _server, client) = connected_pair(door, device, 4096);

            // The client's send ring: a producer index more than a ring ahead.
            let wq_before = kal_counter(&b, "wq_ring_corrupt");
            let layout = QpRingLayout::new(DEPTH, DEPTH).unwrap();
            let qp_mem = client.qp.ring_memory().expect("a device with shared rings");
            let (prod, cons) = indices(&qp_mem, layout.sq_offset);
            prod.store(
                cons.load(Ordering::Acquire)
                    .wrapping_add(layout.sq_depth + 7),
                Ordering::Release,
            );
            client.qp.ring_doorbell();
            wait_for(client.qp.events(), EventKind::QpFatal);
            assert!(kal_counter(&b, "wq_ring_corrupt") > wq_before);
            drop(client);
            bystander.finish().assert_served(BOUND);
        }
    });
}

/// Audit H1, trigger B: a siw peer that completes MPA and then never reads. The tenant's
/// sends fill the socket, and a provider doorbell that transmits inline may then block;
/// it runs on the tenant's own doorbell thread (daemon) or its own posting thread
/// (embedded), so the Bystander and every other context are served meanwhile.
#[test]
fn a_peer_that_stops_reading_stalls_only_its_tenant() {
    each_front_door(|door| {
        let bystander = Bystander::start(door, "siw0");
        let tenant = door.open();
        let dev = tenant.device("siw0").unwrap().index;
        let ip = tools::perf::loopback_of(&tenant, dev).unwrap();
        let listener = tenant
            .listen(dev, std::net::SocketAddr::new(ip, 0), 4)
            .unwrap();
        let peer_addr = std::net::SocketAddr::new(ip, listener.port);
        let peer = std::thread::spawn(move || mpa_peer_that_never_reads(peer_addr));
        let ep = tools::perf::accept_endpoint(&tenant, dev, &listener, 16 << 10, DEPTH).unwrap();
        let peer = peer.join().unwrap();

        // Keep posting 16 KiB sends from a thread of the tenant's own: once the socket is
        // full, its doorbell (or, embedded, this very thread) may block for good.
        let stop = Arc::new(AtomicBool::new(false));
        let posted = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let ep = Arc::new(ep);
        let poster = {
            let (stop, posted, ep) = (stop.clone(), posted.clone(), ep.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match ep.send(posted.load(Ordering::Relaxed), 0, 16 << 10, 0) {
                        Ok(()) => posted.fetch_add(1, Ordering::Relaxed),
                        Err(_) => {
                            std::thread::sleep(Duration::from_millis(1));
                            0
                        }
                    };
                }
            })
        };
        let worst = control_latency_during(door, || std::thread::sleep(ATTACK));
        assert!(
            worst <= BOUND,
            "kAL stalled {worst:?} by a peer that stops reading"
        );
        // The premise: the tenant's sends did stall behind the full socket (a few MiB of
        // socket buffers, where 2 s of loopback would have moved gigabytes).
        let n = posted.load(Ordering::Relaxed);
        eprintln!("{n} sends of 16 KiB posted against a peer that never reads");
        assert!(
            n < 4096,
            "{n} sends of 16 KiB went out: the peer was read after all"
        );
        bystander.finish().assert_served(BOUND);
        // The peer goes away: whatever was blocked on it fails and returns.
        drop(peer);
        stop.store(true, Ordering::Relaxed);
        poster.join().unwrap();
    });
}

/// Connect to `addr` as an iWARP initiator, complete MPA (with the 20 bytes of private
/// data `tools::perf` endpoints exchange), and return the stream without ever reading it.
fn mpa_peer_that_never_reads(addr: std::net::SocketAddr) -> std::net::TcpStream {
    use siw::wire::MpaFrame;
    use std::io::{Read, Write};
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    let req = MpaFrame {
        reply: false,
        markers: false,
        crc: false,
        reject: false,
        revision: 2,
        ird_ord: Some((16, 16)),
        private_data: vec![0; 20],
    }
    .to_vec()
    .unwrap();
    sock.write_all(&req).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    loop {
        // Byte by byte: nothing after the reply may be taken off the socket.
        assert_eq!(sock.read(&mut b).unwrap(), 1, "closed during MPA");
        got.push(b[0]);
        match MpaFrame::parse_bytes(&got) {
            Ok(f) if f.buffer_len() == got.len() => {
                assert!(f.reply && !f.reject, "MPA reply");
                return sock;
            }
            Ok(_) => panic!("MPA reply longer than announced"),
            Err(siw::wire::Error::Truncated(_)) => {}
            Err(e) => panic!("MPA reply: {e}"),
        }
    }
}
