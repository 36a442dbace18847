//! A peer process killed mid-transfer, over siw0 and rxe0 through both front doors: the
//! survivor gets a broken-connection event and flushed completions for everything
//! outstanding, and never hangs. `krdmad` killed under an open IA.

#[macro_use]
mod itapi_common;

use itapi_common::*;
use krdma_itapi::*;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ual::{RegBuf, Target};

const CHILD_BUF: usize = 4 << 20;
const CHUNK: u32 = 256 * 1024;
const WINDOW: u64 = 8;

/// Child mode: connect to the survivor named by `ITAPI_PEER` over the device
/// `ITAPI_DEV`, offer a buffer, and wait to be killed.
#[test]
#[ignore = "run as a child process by itapi_peer_killed_mid_transfer"]
fn itapi_child_peer() {
    let Ok(peer) = std::env::var("ITAPI_PEER") else {
        return;
    };
    let peer: SocketAddr = peer.parse().unwrap();
    // In embedded mode this process has its own kAL: its rxe0 gets an address of its own.
    krdma_tests::setup_embedded();
    let dev = std::env::var("ITAPI_DEV").unwrap();
    let ia = Ia::open_on(&Target::from_env(), &dev).unwrap();
    let pz = Pz::create(&ia).unwrap();
    let dto = Evd::create(&ia, EventStream::Dto, EvdFlags::empty(), 64, 1, None).unwrap();
    let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 8, 1, None).unwrap();
    let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, EpAttributes::default(), None).unwrap();
    let lmr = Lmr::create(
        &pz,
        RegBuf::new(CHILD_BUF).unwrap(),
        MemPriv::LOCAL | MemPriv::REMOTE,
    )
    .unwrap();
    for i in 0..8 {
        ep.post_recv(&[lmr.segment(i * 64, 64).unwrap()], i, DtoFlags::SIGNALED)
            .unwrap();
    }
    let advert = lmr.rdma_addr(0).unwrap().encode(lmr.len());
    ep.connect(peer, &advert).unwrap();
    match cm.wait(T).unwrap().0 {
        Event::Connection(c) if c.kind == ConnEventKind::Established => {}
        other => panic!("child not connected: {other:?}"),
    }
    println!("CONNECTED");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

itapi_tests! {
    fn itapi_peer_killed_mid_transfer(case) {
        let attrs = EpAttributes {
            max_request_dtos: 32,
            ..EpAttributes::default()
        };
        let s = Side::new(case, attrs, CHUNK as usize);
        let l = Listening::new(&s);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["itapi_child_peer", "--exact", "--ignored", "--nocapture"])
            .env("ITAPI_PEER", l.addr().to_string())
            .env("ITAPI_DEV", case.dev)
            .env("KRDMA_DEVICE", case.device_env())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let r = l.request();
        let (target, len) = RdmaAddr::decode(&r.private_data).unwrap();
        assert_eq!(len, CHILD_BUF as u64);
        s.ep.accept(r.cn_est_id, b"").unwrap();
        assert_eq!(s.conn_event().kind, ConnEventKind::Established);
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        assert!(
            out.any(|l| l.is_ok_and(|l| l == "CONNECTED")),
            "child did not connect"
        );

        // Receives that will never be matched, and a window of RDMA Writes kept full.
        for i in 0..4 {
            s.ep.post_recv(&[s.seg(0, 64)], 1000 + i, DtoFlags::SIGNALED)
                .unwrap();
        }
        let slots = CHILD_BUF as u64 / CHUNK as u64;
        let write = |n: u64| {
            let at = RdmaAddr {
                addr: target.addr + (n % slots) * CHUNK as u64,
                ..target
            };
            s.ep.post_rdma_write(&[s.seg(0, CHUNK)], n, DtoFlags::SIGNALED, at)
        };
        let mut posted = 0u64;
        while posted < WINDOW {
            write(posted).unwrap();
            posted += 1;
        }
        let (mut ok, mut flushed, mut failed) = (0u64, 0u64, 0u64);
        let mut killed = false;
        let mut ended = None;
        let deadline = Instant::now() + Duration::from_secs(20);
        // Stream until the connection ends and every request has completed (a request
        // leaves `outstanding` when its completion is queued on the SEVD, so the queue is
        // drained to the end).
        loop {
            assert!(
                Instant::now() < deadline,
                "survivor hung: ok {ok} flushed {flushed}"
            );
            if !killed && ok >= 64 {
                child.kill().unwrap();
                killed = true;
            }
            if let Ok(Event::Connection(c)) = s.cm.dequeue() {
                ended = Some(c.kind);
            }
            let d = match s.dto.wait(Some(Duration::from_millis(100))) {
                Ok((Event::Dto(d), _)) => d,
                _ if ended.is_some() && s.ep.outstanding() == (0, 0) => break,
                _ => continue,
            };
            match d.status {
                DtoStatus::Success => {
                    ok += 1;
                    if ended.is_none() && write(posted).is_ok() {
                        posted += 1;
                    }
                }
                DtoStatus::Flushed => flushed += 1,
                _ => failed += 1,
            }
        }
        let _ = child.kill();
        child.wait().unwrap();
        eprintln!(
            "{}: {ok} writes done, {flushed} flushed, {failed} failed, {ended:?}",
            case.door.name()
        );
        assert!(killed, "the child was killed mid-transfer");
        // The four posted receives always flush. Embedded, the child's whole stack died
        // with it: nothing answers, the connection is Broken. rxe learns of it only from
        // a write that goes unanswered, so writes fail or flush; siw completes a Write
        // once TCP has taken it and learns of the death from TCP itself, so every write
        // may be complete by then (seen once under load: 72 done, the 4 receives
        // flushed). Through krdmad rxe's access layer outlives the child and closes its
        // connection (a DREQ, as the kernel does for a killed process): Broken when that
        // close flushed writes of ours, an orderly Disconnect when every write had been
        // answered first (the survivor had not yet posted the next ones). siw's engine
        // runs in the child through krdmad too, and dies with it.
        match (case.door, ended) {
            (_, Some(ConnEventKind::Broken)) => {
                assert!(flushed >= 4, "the receives flushed");
                if case.dev == "rxe0" {
                    assert!(flushed + failed > 4, "writes in flight failed or flushed")
                }
            }
            (krdma_tests::FrontDoor::Daemon(_), Some(ConnEventKind::Disconnect)) => {
                assert_eq!((flushed, failed), (4, 0), "an orderly close lost no write")
            }
            (_, other) => panic!("{}: the connection ended {other:?}", case.door.name()),
        }
        assert_eq!(s.ep.state(), EpState::NonOperational);
    }
}

#[test]
fn itapi_daemon_death_wakes_every_waiter_siw0() {
    daemon_death("siw0");
}

#[test]
fn itapi_daemon_death_wakes_every_waiter_rxe0() {
    daemon_death("rxe0");
}

fn daemon_death(dev: &'static str) {
    if !krdma_tests::daemon_possible() {
        return;
    }
    let d = krdma_tests::Daemon::start();
    let door = krdma_tests::FrontDoor::Daemon(d);
    let (s, c) = pair(&Case { door: &door, dev }, EpAttributes::default(), 4096);
    let sw = Evd::create(&s.ia, EventStream::Software, EvdFlags::empty(), 8, 1, None).unwrap();
    s.ep.post_recv(&[s.seg(0, 64)], 1, DtoFlags::SIGNALED)
        .unwrap();
    let (sw2, dto) = (sw.clone(), s.dto.clone());
    let waiters = [
        std::thread::spawn(move || sw2.wait(None).err()),
        std::thread::spawn(move || dto.wait(None).err()),
    ];
    std::thread::sleep(Duration::from_millis(200));
    let krdma_tests::FrontDoor::Daemon(d) = &door else {
        unreachable!()
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.pid() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let t = Instant::now();
    for w in waiters {
        assert_eq!(w.join().unwrap(), Some(Error::IaCatastrophe));
    }
    eprintln!("waiters woken {:?} after the daemon died", t.elapsed());
    assert!(s.ia.is_dead());
    assert_eq!(
        s.ep.post_send(&[], 2, DtoFlags::SIGNALED),
        Err(Error::IaCatastrophe)
    );
    assert_eq!(Pz::create(&s.ia).err(), Some(Error::IaCatastrophe));
    drop((s, c));
}
