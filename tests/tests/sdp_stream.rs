//! SDP sockets (`krdma_sdp::SdpStream` / `SdpListener`) over siw0 and rxe0, through both
//! front doors: a stream that mixes buffered-copy and zero-copy writes arrives intact,
//! both halves close in order, readiness shows on the socket's descriptor, non-blocking
//! calls and timeouts behave as TCP's.

use krdma_sdp::{proto::Phase, Options, SdpListener, SdpStream};
use krdma_tests::{crc, each_front_door, fill_pattern, FrontDoor};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

fn opts(door: &FrontDoor, dev: &str) -> Options {
    Options {
        device: dev.into(),
        target: Some(door.target()),
        ..Options::default()
    }
    .with_zcopy_threshold(128 * 1024)
}

/// Where this process's adapter `dev` is reachable.
fn adapter_ip(o: &Options) -> IpAddr {
    let d = krdma_sdp::device::Device::get(o.target.as_ref(), &o.device).unwrap();
    d.ia.local_address().unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

fn each(dev: &'static str, f: impl Fn(&Options)) {
    krdma_tests::setup_embedded();
    each_front_door(|door| {
        eprintln!("--- device {dev}");
        f(&opts(door, dev))
    });
}

fn pair(o: &Options) -> (SdpStream, SdpStream) {
    let l = SdpListener::bind_with(SocketAddr::new(adapter_ip(o), 0), o).unwrap();
    let at = l.local_addr().unwrap();
    let o2 = o.clone();
    let client = std::thread::spawn(move || SdpStream::connect_with(at, &o2).unwrap());
    let (server, peer) = l.accept().unwrap();
    let client = client.join().unwrap();
    assert_eq!(peer, client.local_addr().unwrap());
    assert_eq!(client.peer_addr().unwrap(), at);
    (client, server)
}

fn stream_mixed_sizes(o: &Options) {
    let (mut c, mut s) = pair(o);
    let mut data = vec![0u8; 6 << 20];
    fill_pattern(&mut data, 42);
    let want = crc(&data);
    let writer = std::thread::spawn(move || {
        // Small writes (buffered copy), a big one (zero copy), small again.
        let mut off = 0;
        for (i, size) in [100usize, 1, 4000, 70_000, 3 << 20, 5, 900_000, 1]
            .iter()
            .cycle()
            .enumerate()
        {
            if off == data.len() {
                break;
            }
            let end = (off + size).min(data.len());
            c.write_all(&data[off..end]).unwrap();
            off = end;
            let _ = i;
        }
        c.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        c.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"thanks");
        c.stats()
    });
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert_eq!(got.len(), 6 << 20);
    assert_eq!(crc(&got), want, "bytes differ");
    s.write_all(b"thanks").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let (phase, counters, _) = writer.join().unwrap();
    eprintln!("client: {phase:?} {counters:?}");
    assert!(
        counters.zcopy_tx_bytes > 0,
        "large writes went by zero copy"
    );
    assert!(counters.bcopy_tx_bytes > 0, "small writes by buffered copy");
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.stats().0 != Phase::Closed {
        assert!(
            Instant::now() < deadline,
            "orderly close never finished: {:?}",
            s.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn stream_mixed_sizes_siw0() {
    each("siw0", stream_mixed_sizes);
}

#[test]
fn stream_mixed_sizes_rxe0() {
    each("rxe0", stream_mixed_sizes);
}

/// A listener on any port retries when its transport port is taken, and gives up with
/// `AddrInUse` after a bounded number of reservations when every one is: over iWARP with
/// offset 0 the transport port is the reservation's own, which the reservation holds.
fn any_port_with_every_transport_port_taken(o: &Options) {
    let mut no_offset = o.clone();
    no_offset.iwarp_port_offset = 0;
    let at = SocketAddr::new(adapter_ip(o), 0);
    let e = SdpListener::bind_with(at, &no_offset)
        .err()
        .expect("no transport port is free");
    assert_eq!(e.kind(), ErrorKind::AddrInUse, "{e}");
    // With the offset back, the same call finds a port.
    let l = SdpListener::bind_with(at, o).unwrap();
    assert_ne!(l.local_addr().unwrap().port(), 0);
}

#[test]
fn any_port_with_every_transport_port_taken_siw0() {
    each("siw0", any_port_with_every_transport_port_taken);
}

/// A listener at the top of the port range: over iWARP its transport port (port + offset)
/// wraps into the unprivileged ports, and a connection reaches it there. A plain
/// wrapping add made 55536 port 0 (any port: nobody could connect) and 55537..=56559
/// privileged ports (refused to everyone but root).
fn listener_at_the_top_of_the_port_range(o: &Options) {
    let ip = adapter_ip(o);
    let (l, at) = (55536..=65535)
        .find_map(|port| {
            let at = SocketAddr::new(ip, port);
            match SdpListener::bind_with(at, o) {
                Ok(l) => Some((l, at)),
                Err(e) if e.kind() == ErrorKind::AddrInUse => None,
                Err(e) => panic!("{at}: {e}"),
            }
        })
        .expect("a free port at the top of the range");
    let dev = krdma_sdp::device::Device::get(o.target.as_ref(), &o.device).unwrap();
    let tport = o.transport_port(&dev, at.port());
    assert!(tport >= 1024, "{at}: transport port {tport}");
    let o2 = o.clone();
    let client = std::thread::spawn(move || {
        let mut c = SdpStream::connect_with(at, &o2)?;
        c.write_all(b"top")?;
        Ok::<_, std::io::Error>(c)
    });
    l.set_nonblocking(true).unwrap();
    let mut s = loop {
        match l.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == ErrorKind::WouldBlock && !client.is_finished() => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                panic!(
                    "{at}: the client gave up: {:?}",
                    client.join().unwrap().err()
                )
            }
            Err(e) => panic!("{at}: {e}"),
        }
    };
    s.set_nonblocking(false).unwrap();
    let mut got = [0u8; 3];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"top");
    drop(client.join().unwrap().unwrap());
}

#[test]
fn listener_at_the_top_of_the_port_range_siw0() {
    each("siw0", listener_at_the_top_of_the_port_range);
}

/// Wait up to `ms` for the descriptor to become readable; what it shows then.
fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> PollFlags {
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut p, PollTimeout::from(ms)).unwrap();
    let r = p[0].revents().unwrap();
    r | now_shows(fd)
}

/// What the descriptor shows now.
fn now_shows(fd: std::os::fd::BorrowedFd<'_>) -> PollFlags {
    let mut p = [PollFd::new(fd, PollFlags::POLLIN | PollFlags::POLLOUT)];
    poll(&mut p, PollTimeout::ZERO).unwrap();
    p[0].revents().unwrap()
}

fn readiness_nonblocking_timeouts(o: &Options) {
    let (mut c, mut s) = pair(o);
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 16];
    assert_eq!(s.read(&mut b).unwrap_err().kind(), ErrorKind::WouldBlock);
    assert_eq!(now_shows(s.as_fd()), PollFlags::POLLOUT);
    c.write_all(b"ping").unwrap();
    // The progress thread shows it on the descriptor while nobody calls in.
    let r = readable(s.as_fd(), 5000);
    assert!(r.contains(PollFlags::POLLIN), "{r:?}");
    assert_eq!(s.read(&mut b).unwrap(), 4);
    assert_eq!(&b[..4], b"ping");
    assert_eq!(now_shows(s.as_fd()), PollFlags::POLLOUT);
    // A read timeout.
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let t = Instant::now();
    assert_eq!(s.read(&mut b).unwrap_err().kind(), ErrorKind::WouldBlock);
    assert!(t.elapsed() >= Duration::from_millis(150));
    // End of file shows as readable, reads 0.
    drop(c);
    let r = readable(s.as_fd(), 5000);
    assert!(r.contains(PollFlags::POLLIN), "{r:?}");
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

#[test]
fn readiness_nonblocking_timeouts_siw0() {
    each("siw0", readiness_nonblocking_timeouts);
}

#[test]
fn readiness_nonblocking_timeouts_rxe0() {
    each("rxe0", readiness_nonblocking_timeouts);
}

/// A stream handed to the kernel (`into_relayed`): bytes received before come first, a
/// child program (`cat`, its standard input and output the relayed socket) echoes 3 MiB
/// written in buffered and zero-copy sizes, the child's exit closes the last copy and the
/// peer reads end of file after the echo.
fn relayed_to_a_child_program(o: &Options) {
    let (c, s) = pair(o);
    let c = std::sync::Arc::new(c);
    (&*c).write_all(b"early").unwrap();
    // Wait until the early bytes are in the server's buffers.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.bytes_readable() < 5 {
        assert!(Instant::now() < deadline, "early bytes never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut sock = s.into_relayed().unwrap();
    let mut early = [0u8; 5];
    sock.read_exact(&mut early).unwrap();
    assert_eq!(&early, b"early");
    let child = std::process::Command::new("cat")
        .stdin(std::os::fd::OwnedFd::from(sock.try_clone().unwrap()))
        .stdout(std::os::fd::OwnedFd::from(sock.try_clone().unwrap()))
        .spawn()
        .unwrap();
    drop(sock);
    let mut data = vec![0u8; 3 << 20];
    fill_pattern(&mut data, 7);
    let want = crc(&data);
    let w = c.clone();
    let writer = std::thread::spawn(move || {
        let mut off = 0;
        for size in [1000usize, 300_000, 17, 1 << 20].iter().cycle() {
            if off == data.len() {
                break;
            }
            let end = (off + size).min(data.len());
            (&*w).write_all(&data[off..end]).unwrap();
            off = end;
        }
        w.shutdown(Shutdown::Write).unwrap();
    });
    let mut echo = Vec::new();
    (&*c).read_to_end(&mut echo).unwrap();
    writer.join().unwrap();
    assert_eq!(echo.len(), 3 << 20);
    assert_eq!(crc(&echo), want, "echo differs");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
}

#[test]
fn relayed_to_a_child_program_siw0() {
    each("siw0", relayed_to_a_child_program);
}

#[test]
fn relayed_to_a_child_program_rxe0() {
    each("rxe0", relayed_to_a_child_program);
}

/// Write-based zero copy: a reader blocked on a large read advertises its landing buffer
/// (SinkAvail), and the writer's large writes are RDMA Written into it (RdmaWrCompl);
/// 4 MiB arrive intact, in order, partly that way.
fn write_zero_copy(o: &Options) {
    let (c, mut s) = pair(o);
    let mut data = vec![0u8; 4 << 20];
    fill_pattern(&mut data, 5);
    let want = crc(&data);
    let reader = std::thread::spawn(move || {
        let got = krdma_tests::read_in_chunks(&mut s, 1 << 20);
        (got, s.stats().1)
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.stats().1.sink_adverts_rx == 0 {
        assert!(
            Instant::now() < deadline,
            "no SinkAvail from the blocked reader"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    for chunk in data.chunks(512 * 1024) {
        (&c).write_all(chunk).unwrap();
    }
    c.shutdown(Shutdown::Write).unwrap();
    let (got, rx) = reader.join().unwrap();
    let tx = c.stats().1;
    eprintln!("writer {tx:?}\nreader {rx:?}");
    assert_eq!(got.len(), data.len());
    assert_eq!(crc(&got), want, "bytes differ");
    assert!(tx.zcopy_write_tx_bytes > 0, "no RDMA Write into the sink");
    assert_eq!(tx.zcopy_write_tx_bytes, rx.zcopy_write_rx_bytes);
    assert_eq!(tx.violations + rx.violations, 0);
}

#[test]
fn write_zero_copy_siw0() {
    each("siw0", write_zero_copy);
}

#[test]
fn write_zero_copy_rxe0() {
    each("rxe0", write_zero_copy);
}

/// A server that writes the moment it has accepted: its first message can complete at
/// the client before the client has taken the connection event that opens the protocol
/// (the two come through different queues). That message must wait for it, not count as
/// a violation. Many rounds: the order varies from one to the next.
fn first_message_right_after_accept(o: &Options) {
    let l = SdpListener::bind_with(SocketAddr::new(adapter_ip(o), 0), o).unwrap();
    let at = l.local_addr().unwrap();
    for round in 0..60u32 {
        let server = std::thread::scope(|s| {
            let server = s.spawn(|| {
                let (mut s, _) = l.accept().unwrap();
                s.write_all(&round.to_be_bytes()).unwrap();
                s
            });
            let mut c = SdpStream::connect_with(at, o).unwrap();
            let mut got = [0u8; 4];
            c.read_exact(&mut got)
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert_eq!(u32::from_be_bytes(got), round);
            assert_eq!(c.stats().1.violations, 0, "round {round}");
            server.join().unwrap()
        });
        drop(server);
    }
}

#[test]
fn first_message_right_after_accept_siw0() {
    each("siw0", first_message_right_after_accept);
}

#[test]
fn first_message_right_after_accept_rxe0() {
    each("rxe0", first_message_right_after_accept);
}
