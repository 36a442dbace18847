//! SDP sockets facing bad peers, over siw0 and rxe0: a malformed BSDH and a peer sending
//! beyond its credits (a raw IT-API endpoint speaking SDP badly) end the connection with
//! `ECONNRESET` and an AbortConn on the wire; a peer that stops reading blocks the writer
//! (non-blocking: `WouldBlock`; with a timeout: `WouldBlock` after it) without losing a
//! byte; a peer process killed in the middle of a zero-copy transfer fails the writer
//! (no hang). Each touches only its own buffers (the IT-API checks every access).

use krdma_itapi::{
    ConnEventKind, DtoFlags, Endpoint, EpAttributes, Evd, EvdFlags, Event, EventStream, Ia, Lmr,
    MemPriv, Pz, Target,
};
use krdma_sdp::wire::{self, Body, Bsdh, Hello, Message};
use krdma_sdp::{Options, SdpListener, SdpStream};
use krdma_tests::{each_front_door, fill_pattern, FrontDoor};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ual::RegBuf;

const T: Option<Duration> = Some(Duration::from_secs(10));

fn opts(target: Target, dev: &str) -> Options {
    Options {
        device: dev.into(),
        target: Some(target),
        ..Options::default()
    }
    .with_zcopy_threshold(128 * 1024)
}

fn adapter_ip(o: &Options) -> IpAddr {
    let d = krdma_sdp::device::Device::get(o.target.as_ref(), &o.device).unwrap();
    d.ia.local_address().unwrap_or(IpAddr::from([127, 0, 0, 1]))
}

fn each(dev: &'static str, f: impl Fn(&FrontDoor, &Options)) {
    krdma_tests::setup_embedded();
    each_front_door(|door| {
        eprintln!("--- device {dev}");
        f(door, &opts(door.target(), dev))
    });
}

/// A raw IT-API endpoint connected to the SDP listener `l` with a proper Hello: the
/// hostile peer. Returns the endpoint, its receive EVD (the server's answers land there)
/// and the credits the HelloAck gave.
fn hostile_peer(o: &Options, l: &SdpListener) -> (Endpoint, Evd, Lmr, u16, Ia) {
    let ia = Ia::open_on(o.target.as_ref().unwrap(), &o.device).unwrap();
    let pz = Pz::create(&ia).unwrap();
    let dto = Evd::create(&ia, EventStream::Dto, EvdFlags::empty(), 256, 1, None).unwrap();
    let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 8, 1, None).unwrap();
    let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, EpAttributes::default(), None).unwrap();
    let lmr = Lmr::create(&pz, RegBuf::new(64 * 65536).unwrap(), MemPriv::LOCAL).unwrap();
    for i in 0..32u64 {
        ep.post_recv(
            &[lmr.segment(i * 65536, 65536).unwrap()],
            i,
            DtoFlags::SIGNALED,
        )
        .unwrap();
    }
    let at = l.local_addr().unwrap();
    let hello = Hello {
        version: wire::VERSION,
        capabilities: 0,
        max_adverts: 1,
        des_rem_rcv_sz: 16384,
        local_rcv_sz: 65536,
        port: 4242,
        src: at.ip(),
        dst: Some(at.ip()),
    };
    let pd = wire::hello_private_data(
        Bsdh {
            bufs: 32,
            ..Bsdh::default()
        },
        &hello,
        ia.private_data_limits().0,
    );
    let dev = krdma_sdp::device::Device::get(o.target.as_ref(), &o.device).unwrap();
    let tport = o.transport_port(&dev, at.port());
    ep.connect(SocketAddr::new(at.ip(), tport), &pd).unwrap();
    let bufs = match cm.wait(T).unwrap().0 {
        Event::Connection(c) if c.kind == ConnEventKind::Established => {
            Message::parse(&c.private_data).unwrap().bsdh.bufs
        }
        other => panic!("hostile peer not connected: {other:?}"),
    };
    (ep, dto, lmr, bufs, ia)
}

/// The MIDs of the messages the server sent the hostile peer (until nothing more comes).
fn received_mids(dto: &Evd, lmr: &Lmr) -> Vec<u8> {
    let mut mids = Vec::new();
    while let Ok((Event::Dto(d), _)) = dto.wait(Some(Duration::from_secs(2))) {
        if d.status == krdma_itapi::DtoStatus::Success && d.kind == krdma_itapi::DtoKind::Recv {
            let mut b = [0u8; 1];
            lmr.buffer()
                .unwrap()
                .read(d.cookie as usize * 65536, &mut b);
            mids.push(b[0]);
        }
    }
    mids
}

fn data_msg(mseq: u32, payload: &[u8]) -> Vec<u8> {
    Message {
        bsdh: Bsdh {
            bufs: 32,
            mseq,
            mseq_ack: 0,
            ..Bsdh::default()
        },
        body: Body::Data(payload),
    }
    .to_vec()
}

fn malformed_bsdh(_door: &FrontDoor, o: &Options) {
    let l = SdpListener::bind_with(SocketAddr::new(adapter_ip(o), 0), o).unwrap();
    let accepted = std::thread::scope(|sc| {
        let a = sc.spawn(|| l.accept().unwrap());
        let (ep, dto, lmr, _bufs, _ia) = hostile_peer(o, &l);
        let (s, _) = a.join().unwrap();
        // A good message, then one whose length field lies.
        ep.post_send_inline(&data_msg(1, b"fine"), 1, DtoFlags::empty())
            .unwrap();
        let mut bad = data_msg(2, b"lies");
        bad[4..8].copy_from_slice(&4000u32.to_be_bytes());
        ep.post_send_inline(&bad, 2, DtoFlags::empty()).unwrap();
        let mids = received_mids(&dto, &lmr);
        (s, mids)
    });
    let (mut s, mids) = accepted;
    let mut b = [0u8; 16];
    // The good bytes are there; then the reset.
    assert_eq!(s.read(&mut b).unwrap(), 4);
    assert_eq!(&b[..4], b"fine");
    let e = s.read(&mut b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
    assert_eq!(s.stats().1.violations, 1);
    assert!(
        mids.contains(&(wire::Mid::AbortConn as u8)),
        "AbortConn went to the peer: {mids:x?}"
    );
    // Writes fail too: the reset once, then a broken pipe.
    assert_eq!(
        s.write(b"x").unwrap_err().kind(),
        ErrorKind::ConnectionReset
    );
    assert_eq!(s.write(b"x").unwrap_err().kind(), ErrorKind::BrokenPipe);
}

#[test]
fn malformed_bsdh_resets_siw0() {
    each("siw0", malformed_bsdh);
}

#[test]
fn malformed_bsdh_resets_rxe0() {
    each("rxe0", malformed_bsdh);
}

fn credit_violation(_door: &FrontDoor, o: &Options) {
    let l = SdpListener::bind_with(SocketAddr::new(adapter_ip(o), 0), o).unwrap();
    let (mut s, mids) = std::thread::scope(|sc| {
        let a = sc.spawn(|| l.accept().unwrap());
        let (ep, dto, lmr, bufs, _ia) = hostile_peer(o, &l);
        let (s, _) = a.join().unwrap();
        // One message more than the HelloAck's credits, none read by the server.
        for m in 1..=u32::from(bufs) + 1 {
            ep.post_send_inline(&data_msg(m, b"flood"), u64::from(m), DtoFlags::empty())
                .unwrap();
        }
        (s, received_mids(&dto, &lmr))
    });
    let mut all = Vec::new();
    let e = loop {
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(n) => all.extend_from_slice(&b[..n]),
            Err(e) => break e,
        }
    };
    assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
    assert!(all.len() <= 16 * 5, "only credited messages were taken");
    assert!(mids.contains(&(wire::Mid::AbortConn as u8)), "{mids:x?}");
    let stats = s.stats().1;
    assert_eq!(stats.violations, 1, "{stats:?}");
}

#[test]
fn credit_violation_resets_siw0() {
    each("siw0", credit_violation);
}

#[test]
fn credit_violation_resets_rxe0() {
    each("rxe0", credit_violation);
}

fn pair(o: &Options) -> (SdpStream, SdpStream) {
    let l = SdpListener::bind_with(SocketAddr::new(adapter_ip(o), 0), o).unwrap();
    let at = l.local_addr().unwrap();
    let o2 = o.clone();
    let c = std::thread::spawn(move || SdpStream::connect_with(at, &o2).unwrap());
    let (s, _) = l.accept().unwrap();
    (c.join().unwrap(), s)
}

fn stops_reading(_door: &FrontDoor, o: &Options) {
    let (mut c, mut s) = pair(o);
    c.set_nonblocking(true).unwrap();
    let mut data = vec![0u8; 64 << 20];
    fill_pattern(&mut data, 5);
    let mut off = 0;
    let t0 = Instant::now();
    // Write until the writer stays blocked (buffers and credits all used: a few refusals
    // in a row, some time apart, with the protocol settled in between).
    let mut refused = 0;
    while refused < 3 {
        match c.write(&data[off..(off + 100_000).min(data.len())]) {
            Ok(n) => {
                off += n;
                refused = 0;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                refused += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("{e}"),
        }
        assert!(off < data.len(), "a reader that reads nothing took 64 MiB");
        assert!(t0.elapsed() < Duration::from_secs(30));
    }
    eprintln!("writer blocked after {off} bytes");
    // A blocking write with a timeout waits that long, then gives up.
    c.set_nonblocking(false).unwrap();
    c.set_write_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let t = Instant::now();
    assert_eq!(
        c.write(&data[off..off + 1000]).unwrap_err().kind(),
        ErrorKind::WouldBlock
    );
    assert!(t.elapsed() >= Duration::from_millis(250));
    // The reader comes back: everything arrives, in order.
    c.set_write_timeout(None).unwrap();
    let writer = std::thread::spawn(move || {
        c.write_all(&data[off..off + (1 << 20)]).unwrap();
        drop(c);
        data
    });
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    let data = writer.join().unwrap();
    assert_eq!(got.len(), off + (1 << 20));
    assert!(got[..] == data[..got.len()], "bytes differ");
}

#[test]
fn peer_stops_reading_siw0() {
    each("siw0", stops_reading);
}

#[test]
fn peer_stops_reading_rxe0() {
    each("rxe0", stops_reading);
}

/// Child mode: connect to `SDP_PEER`, read a little, then sleep until killed.
#[test]
#[ignore = "run as a child process by peer_killed_mid_zcopy_*"]
fn sdp_child_sink() {
    let Ok(peer) = std::env::var("SDP_PEER") else {
        return;
    };
    krdma_tests::setup_embedded();
    let o = opts(Target::from_env(), &std::env::var("SDP_DEV").unwrap());
    let mut c = SdpStream::connect_with(peer.parse::<SocketAddr>().unwrap(), &o).unwrap();
    let mut b = vec![0u8; 64 * 1024];
    let mut n = 0;
    while n < 200_000 {
        n += c.read(&mut b).unwrap();
    }
    println!("READING");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn killed_mid_zcopy(door: &FrontDoor, o: &Options) {
    let l = SdpListener::bind_with(SocketAddr::new(adapter_ip(o), 0), o).unwrap();
    let device_env = match door.target() {
        Target::Embedded => "embedded".to_string(),
        Target::Device(p) => p.display().to_string(),
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["sdp_child_sink", "--exact", "--ignored", "--nocapture"])
        .env("SDP_PEER", l.local_addr().unwrap().to_string())
        .env("SDP_DEV", &o.device)
        .env("KRDMA_DEVICE", device_env)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut s, _) = l.accept().unwrap();
    // Without keep-alive a peer that vanishes without a word (an embedded rxe0 dies with
    // its process: nobody sends a DREQ) would never be noticed while we only wait.
    s.set_keepalive(Some(Duration::from_secs(1))).unwrap();
    let killer = {
        let out = child.stdout.take().unwrap();
        let pid = child.id();
        std::thread::spawn(move || {
            let mut r = std::io::BufReader::new(out);
            let mut line = String::new();
            while std::io::BufRead::read_line(&mut r, &mut line).unwrap_or(0) > 0 {
                if line.contains("READING") {
                    break;
                }
                line.clear();
            }
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            )
            .unwrap();
        })
    };
    let big = vec![9u8; 4 << 20];
    let t = Instant::now();
    let err = loop {
        match s.write(&big) {
            Ok(n) => assert!(
                n > 0 && t.elapsed() < Duration::from_secs(90),
                "writes never failed"
            ),
            Err(e) => break e,
        }
    };
    killer.join().unwrap();
    let _ = child.wait();
    eprintln!("writer failed after {:?}: {err}", t.elapsed());
    assert!(
        matches!(
            err.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe
        ),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(90));
}

#[test]
fn peer_killed_mid_zcopy_siw0() {
    each("siw0", killed_mid_zcopy);
}

#[test]
fn peer_killed_mid_zcopy_rxe0() {
    each("rxe0", killed_mid_zcopy);
}
