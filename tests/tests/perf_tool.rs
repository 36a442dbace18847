//! `krdma perf` (perftest compatible) server against client over loopback: siw0 with -R
//! (rdma_cm), rxe0 with -R and without (a TCP socket and Modify QP). Every test completes,
//! the numbers are sane, the Write/Read server prints exactly the report the client sent
//! over the control channel, and the data that arrived matches the sender's pattern
//! (`--validate`). No timing thresholds.
//!
//! Over 600 lines: every test program and option of the one tool, sharing its pair
//! runner and checks.

use krdma_tests::{each_front_door, FrontDoor};
use std::io::{Read, Write};
use std::time::Duration;
use tools::perftest::{self, AtomicType, BwReport, Options, PerfError, Summary, Test};
use ual::{send_flags, ConnParam, QpType};

/// One side's result and what it printed.
struct Side {
    summary: Summary,
    text: String,
}

/// Run `o` as server and client on two contexts of `door`.
fn run_pair(door: &FrontDoor, o: &Options) -> (Side, Side) {
    krdma_tests::init_logging();
    let (sctx, cctx) = (door.open(), door.open());
    let so = Options {
        server: None,
        port: 0,
        ..o.clone()
    };
    let server = perftest::Server::listen(&sctx, &so).expect("server listens");
    let port = server.port();
    let srv = std::thread::spawn(move || {
        let mut out = Vec::new();
        let r = server.run(&mut out);
        (r, out)
    });
    let dev = cctx.device(&o.device).expect("device").index;
    let co = Options {
        server: Some(tools::perf::loopback_of(&cctx, dev).expect("device address")),
        port,
        ..o.clone()
    };
    let mut out = Vec::new();
    let c = perftest::run(&cctx, &co, &mut out);
    let (s, sout) = srv.join().expect("server thread");
    let side = |r: Result<Summary, perftest::PerfError>, out: Vec<u8>, who: &str| {
        let text = String::from_utf8(out).expect("utf-8 report");
        let summary = r.unwrap_or_else(|e| panic!("{who} failed: {e}\n{text}"));
        Side { summary, text }
    };
    let server = side(s, sout, "server");
    let client = side(c, out, "client");
    (server, client)
}

/// siw0 with -R (the only mode iWARP runs).
fn opts(test: Test, iters: u64) -> Options {
    Options {
        iters: Some(iters),
        validate: true,
        rdma_cm: true,
        ..Options::new(test)
    }
}

/// The same over rxe0, with -R or without.
fn rxe(o: Options, rdma_cm: bool) -> Options {
    Options {
        device: "rxe0".into(),
        rdma_cm,
        ..o
    }
}

/// Both exchange methods of rxe0, named as perftest prints them.
const RXE_MODES: [(bool, &str); 2] = [(false, "Ethernet"), (true, "rdma_cm")];

/// What perftest prints about the transport and the exchange.
fn check_info(side: &Side, transport: &str, method: &str) {
    let t = &side.text;
    assert!(t.contains(&format!("Transport type : {transport}")), "{t}");
    assert!(t.contains(&format!("Data ex. method : {method}")), "{t}");
}

fn sane_bw(r: &BwReport, size: u64, iters: u64, peak: bool) {
    assert_eq!((r.size, r.iters), (size, iters), "{r:?}");
    assert!(r.bw_avg.is_finite() && r.bw_avg > 0.0, "{r:?}");
    assert!(r.msg_rate.is_finite() && r.msg_rate > 0.0, "{r:?}");
    if peak {
        assert!(r.bw_peak.is_finite() && r.bw_peak > 0.0, "{r:?}");
    } else {
        assert_eq!(r.bw_peak, 0.0, "no peak expected: {r:?}");
    }
}

const BW_HEADER: &str =
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";

/// Both sides print perftest's table; the server prints the client's exchanged report.
fn check_rdma_bw(s: &Side, c: &Side, size: u64, iters: u64) {
    assert_eq!(c.summary.bw.len(), 1);
    sane_bw(&c.summary.bw[0], size, iters, true);
    assert_eq!(
        s.summary.bw, c.summary.bw,
        "server prints the client's report"
    );
    for side in [s, c] {
        assert!(side.text.contains(BW_HEADER), "{}", side.text);
        assert_eq!(side.summary.peer_version, "6.06");
    }
    assert!(s.summary.validated || c.summary.validated);
}

#[test]
fn write_bw_both_front_doors() {
    each_front_door(|door| {
        let (s, c) = run_pair(door, &opts(Test::WriteBw, 300));
        check_rdma_bw(&s, &c, 65536, 300);
        assert!(s.summary.validated, "the server checks what was written");
    });
}

#[test]
fn read_bw() {
    let (s, c) = run_pair(&FrontDoor::Embedded, &opts(Test::ReadBw, 300));
    check_rdma_bw(&s, &c, 65536, 300);
    assert!(c.summary.validated, "the client checks what it read");
    assert!(c.text.contains("Outstand reads  : 32"), "{}", c.text);
}

#[test]
fn send_bw_with_credits() {
    // 30 receives for 300 messages: the sender must wait for the receiver's credits.
    let o = Options {
        size: Some(1000),
        rx_depth: Some(30),
        ..opts(Test::SendBw, 300)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    sane_bw(&c.summary.bw[0], 1000, 300, true);
    sane_bw(&s.summary.bw[0], 1000, 300, false);
    assert!(s.summary.validated, "the server checks what it received");
    assert!(s.text.contains(" RX depth        : 30"), "{}", s.text);
}

#[test]
fn send_lat() {
    let (s, c) = run_pair(&FrontDoor::Embedded, &opts(Test::SendLat, 200));
    for side in [&s, &c] {
        let l = &side.summary.lat;
        assert_eq!(l.len(), 1);
        let r = l[0];
        assert_eq!((r.size, r.iters), (2, 200));
        assert!(
            r.t_min > 0.0 && r.t_min <= r.t_typical && r.t_typical <= r.t_max,
            "{r:?}"
        );
        assert!(
            r.t_avg > 0.0 && r.p99 >= r.t_typical && r.p99_9 >= r.p99,
            "{r:?}"
        );
        assert!(side.summary.validated);
        assert!(side.text.contains("t_typical[usec]"), "{}", side.text);
    }
}

/// One latency line of `size` and `iters` with sane numbers.
fn sane_lat(side: &Side, size: u64, iters: u64) {
    let l = &side.summary.lat;
    assert_eq!(l.len(), 1, "{}", side.text);
    let r = l[0];
    assert_eq!((r.size, r.iters), (size, iters));
    assert!(
        r.t_min > 0.0 && r.t_min <= r.t_typical && r.t_typical <= r.t_max,
        "{r:?}"
    );
    assert!(side.text.contains("t_typical[usec]"), "{}", side.text);
}

/// ib_write_lat: both sides ping-pong RDMA Writes and print their table, over siw0 and
/// both exchange methods of rxe0; -a runs every size.
#[test]
fn write_lat_every_device_and_mode() {
    let mut runs = vec![(opts(Test::WriteLat, 200), "IW", "rdma_cm")];
    for (cm, method) in RXE_MODES {
        runs.push((rxe(opts(Test::WriteLat, 200), cm), "IB", method));
    }
    for (o, transport, method) in runs {
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        for side in [&s, &c] {
            sane_lat(side, 2, 200);
            check_info(side, transport, method);
            assert!(
                side.text.contains("RDMA_Write Latency Test"),
                "{}",
                side.text
            );
        }
    }
    let o = Options {
        all_sizes: true,
        ..opts(Test::WriteLat, 5)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    assert_eq!((s.summary.lat.len(), c.summary.lat.len()), (23, 23));
}

/// ib_read_lat: the client reads (and checks the bytes against the server's pattern),
/// the server waits for its closing handshake and prints no table.
#[test]
fn read_lat_every_device_and_mode() {
    let mut runs = vec![(opts(Test::ReadLat, 200), "IW", "rdma_cm")];
    for (cm, method) in RXE_MODES {
        runs.push((rxe(opts(Test::ReadLat, 200), cm), "IB", method));
    }
    for (o, transport, method) in runs {
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        sane_lat(&c, 2, 200);
        assert!(c.summary.validated, "the client checks what it read");
        assert!(s.summary.lat.is_empty());
        assert!(!s.text.contains("t_typical"), "{}", s.text);
        for side in [&s, &c] {
            check_info(side, transport, method);
            assert!(
                side.text.contains("RDMA_Read Latency Test"),
                "{}",
                side.text
            );
            assert!(side.text.contains("Outstand reads"), "{}", side.text);
        }
    }
}

/// ib_atomic_bw and ib_atomic_lat over rxe0, both exchange methods and both operations:
/// the client runs them on the server's buffer and the server prints the client's
/// report; siw0 refuses them, as iWARP has no atomics.
#[test]
fn atomics_over_rxe_and_refused_over_siw() {
    for (cm, method) in RXE_MODES {
        let (s, c) = run_pair(&FrontDoor::Embedded, &rxe(opts(Test::AtomicBw, 300), cm));
        sane_bw(&c.summary.bw[0], 8, 300, true);
        assert_eq!(
            s.summary.bw, c.summary.bw,
            "server prints the client's report"
        );
        assert!(
            c.text.contains("Atomic FETCH_AND_ADD BW Test"),
            "{}",
            c.text
        );
        let o = Options {
            atomic_type: AtomicType::CmpAndSwap,
            ..rxe(opts(Test::AtomicLat, 200), cm)
        };
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        sane_lat(&c, 8, 200);
        assert!(s.summary.lat.is_empty());
        for side in [&s, &c] {
            check_info(side, "IB", method);
            assert!(
                side.text.contains("Atomic CMP_AND_SWAP Latency Test"),
                "{}",
                side.text
            );
            assert!(side.text.contains("Outstand reads"), "{}", side.text);
        }
    }
    let e = run_one(&FrontDoor::Embedded, &opts(Test::AtomicBw, 10));
    assert!(
        matches!(&e, PerfError::Options(m) if m.contains("no atomic")),
        "{e}"
    );
    let e = run_one(
        &FrontDoor::Embedded,
        &Options {
            size: Some(64),
            ..rxe(opts(Test::AtomicLat, 10), true)
        },
    );
    assert!(
        matches!(&e, PerfError::Options(m) if m.contains("size")),
        "{e}"
    );
}

/// The options users reach for: `-e` (completions by events), `-I` (inline), `-m` (a
/// smaller path MTU, which the QPs then use), `-u` (QP timeout), over rxe0 both ways and
/// siw0; `-e` on a Write test and `-I` on a Read test are refused as perftest does.
#[test]
fn events_inline_mtu_and_timeout_options() {
    let tune = |o: Options| Options {
        use_event: true,
        inline_size: Some(32),
        mtu: Some(1024),
        qp_timeout: 16,
        size: Some(16),
        ..o
    };
    let mut runs = vec![tune(opts(Test::SendLat, 200))];
    for (cm, _) in RXE_MODES {
        runs.push(tune(rxe(opts(Test::SendLat, 200), cm)));
        runs.push(tune(rxe(opts(Test::SendBw, 200), cm)));
    }
    for o in runs {
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        for side in [&s, &c] {
            let t = &side.text;
            assert!(t.contains(" Test with events. Using "), "{t}");
            assert!(t.contains(" Max inline data : 32[B]"), "{t}");
            assert!(t.contains(" Mtu             : 1024[B]"), "{t}");
        }
        assert!(s.summary.validated, "{}", s.text);
    }
    let e = run_one(
        &FrontDoor::Embedded,
        &Options {
            use_event: true,
            ..opts(Test::WriteBw, 10)
        },
    );
    assert!(
        matches!(&e, PerfError::Options(m) if m.contains("WRITE")),
        "{e}"
    );
    let e = run_one(
        &FrontDoor::Embedded,
        &Options {
            inline_size: Some(16),
            ..opts(Test::ReadLat, 10)
        },
    );
    assert!(
        matches!(&e, PerfError::Options(m) if m.contains("inline")),
        "{e}"
    );
}

/// A client run that must fail before it connects anywhere.
fn run_one(door: &FrontDoor, o: &Options) -> PerfError {
    let ctx = door.open();
    let o = Options {
        server: Some([127, 0, 0, 1].into()),
        ..o.clone()
    };
    perftest::run(&ctx, &o, &mut std::io::sink()).expect_err("refused")
}

#[test]
fn all_sizes_write_and_send_lat() {
    let o = Options {
        all_sizes: true,
        ..opts(Test::WriteBw, 10)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    let sizes: Vec<u64> = c.summary.bw.iter().map(|r| r.size).collect();
    assert_eq!(sizes, (1..24).map(|i| 1u64 << i).collect::<Vec<_>>());
    c.summary
        .bw
        .iter()
        .for_each(|r| sane_bw(r, r.size, 10, true));
    assert_eq!(
        s.summary.bw,
        vec![c.summary.bw[22]],
        "server prints the last report"
    );
    assert!(s.summary.validated);

    let o = Options {
        all_sizes: true,
        ..opts(Test::SendLat, 6)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    assert_eq!(s.summary.lat.len(), 23);
    assert_eq!(c.summary.lat.len(), 23);
    assert!(s.summary.validated && c.summary.validated);
}

#[test]
fn two_qps() {
    // 150 iterations with completions every 100: each QP's last completion covers 50.
    let o = Options {
        num_qps: 2,
        size: Some(4096),
        ..opts(Test::WriteBw, 150)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    check_rdma_bw(&s, &c, 4096, 300);
    let o = Options {
        num_qps: 2,
        size: Some(512),
        rx_depth: Some(40),
        ..opts(Test::SendBw, 200)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    sane_bw(&c.summary.bw[0], 512, 400, true);
    assert!(s.summary.validated);
}

/// A client that speaks something else: the server stops with a typed error instead of
/// reading past the message.
fn server_meets(first_message: &[u8]) -> PerfError {
    let door = FrontDoor::Embedded;
    let (sctx, cctx) = (door.open(), door.open());
    let so = Options {
        port: 0,
        rdma_cm: true,
        ..Options::new(Test::WriteBw)
    };
    let server = perftest::Server::listen(&sctx, &so).expect("server listens");
    let port = server.port();
    let srv = std::thread::spawn(move || server.run(&mut std::io::sink()));
    let dev = cctx.device("siw0").unwrap().index;
    let ep = tools::perf::new_endpoint(&cctx, dev, 128, 4).unwrap();
    ep.post_recv(2, 64, 64).unwrap(); // room for the server's answer
    let peer = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    ep.qp
        .connect_wait(peer, &ConnParam::default(), Duration::from_secs(10))
        .unwrap();
    ep.buf.write(0, first_message);
    ep.send(1, 0, first_message.len() as u32, send_flags::SIGNALED)
        .unwrap();
    let err = srv.join().unwrap().expect_err("the server must refuse");
    drop(ep);
    err
}

#[test]
fn server_refuses_bad_peers() {
    match server_meets(b"6.06") {
        PerfError::BadLength {
            want: 16, got: 4, ..
        } => {}
        e => panic!("short version message: {e}"),
    }
    let mut old = [0u8; 16];
    old[..4].copy_from_slice(b"5.60");
    match server_meets(&old) {
        PerfError::Version(v) => assert_eq!(v, "5.60"),
        e => panic!("old version: {e}"),
    }
}

#[test]
fn rxe_write_bw_both_modes_both_front_doors() {
    each_front_door(|door| {
        for (cm, method) in RXE_MODES {
            let (s, c) = run_pair(door, &rxe(opts(Test::WriteBw, 300), cm));
            check_rdma_bw(&s, &c, 65536, 300);
            assert!(s.summary.validated, "the server checks what was written");
            check_info(&c, "IB", method);
            if !cm {
                // Records printed with the test's verb: RKey and VAddr.
                assert!(c.text.contains(" RKey 0x"), "{}", c.text);
            }
        }
    });
}

#[test]
fn rxe_read_bw_both_modes() {
    for (cm, method) in RXE_MODES {
        let (s, c) = run_pair(&FrontDoor::Embedded, &rxe(opts(Test::ReadBw, 300), cm));
        check_rdma_bw(&s, &c, 65536, 300);
        assert!(c.summary.validated, "the client checks what it read");
        assert!(c.text.contains("Outstand reads  : 16"), "{}", c.text);
        check_info(&s, "IB", method);
    }
}

#[test]
fn rxe_send_bw_without_credits() {
    // 30 receives for 300 messages and no credits over IB: the sender meets RNR NAKs and
    // retries until the receiver has re-posted.
    for (cm, method) in RXE_MODES {
        let o = Options {
            size: Some(1000),
            rx_depth: Some(30),
            ..rxe(opts(Test::SendBw, 300), cm)
        };
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        sane_bw(&c.summary.bw[0], 1000, 300, true);
        sane_bw(&s.summary.bw[0], 1000, 300, false);
        assert!(s.summary.validated, "the server checks what it received");
        check_info(&s, "IB", method);
    }
}

#[test]
fn rxe_send_lat_both_modes() {
    for (cm, _) in RXE_MODES {
        let (s, c) = run_pair(&FrontDoor::Embedded, &rxe(opts(Test::SendLat, 200), cm));
        for side in [&s, &c] {
            let r = side.summary.lat[0];
            assert_eq!((r.size, r.iters), (2, 200));
            assert!(r.t_min > 0.0 && r.t_min <= r.t_max, "{r:?}");
            assert!(side.summary.validated);
        }
    }
}

#[test]
fn rxe_sockets_all_sizes_and_two_qps() {
    let o = Options {
        all_sizes: true,
        ..rxe(opts(Test::SendLat, 5), false)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    assert_eq!((s.summary.lat.len(), c.summary.lat.len()), (23, 23));
    assert!(s.summary.validated && c.summary.validated);
    let o = Options {
        num_qps: 2,
        size: Some(4096),
        ..rxe(opts(Test::WriteBw, 150), false)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    check_rdma_bw(&s, &c, 4096, 300);
}

/// `-c UD`: Send tests over UD QPs (rxe0), with and without -R, through both front
/// doors; the received messages sit behind the GRH and match the sender's pattern. `-a`
/// stops at the MTU. Other tests and iWARP are refused.
#[test]
fn rxe_ud_send_tests() {
    each_front_door(|door| {
        for (cm, method) in RXE_MODES {
            let ud = |o: Options| Options {
                connection: QpType::Ud,
                ..rxe(o, cm)
            };
            let (s, c) = run_pair(door, &ud(opts(Test::SendLat, 200)));
            for side in [&s, &c] {
                let r = side.summary.lat[0];
                assert_eq!((r.size, r.iters), (2, 200));
                assert!(side.summary.validated);
                assert!(side.text.contains("Connection type : UD"), "{}", side.text);
            }
            let o = Options {
                size: Some(4096),
                ..ud(opts(Test::SendBw, 400))
            };
            let (s, c) = run_pair(door, &o);
            sane_bw(&c.summary.bw[0], 4096, 400, true);
            sane_bw(&s.summary.bw[0], 4096, 400, false);
            assert!(s.summary.validated, "the server checks what it received");
            check_info(&s, "IB", method);
        }
    });
    let o = Options {
        all_sizes: true,
        ..Options {
            connection: QpType::Ud,
            ..rxe(opts(Test::SendLat, 5), false)
        }
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    let sizes: Vec<u64> = c.summary.lat.iter().map(|r| r.size).collect();
    assert_eq!(sizes, (1..=12).map(|i| 1u64 << i).collect::<Vec<_>>());
    assert!(s.summary.validated && c.summary.validated);

    let door = FrontDoor::Embedded;
    for (o, why) in [
        (opts(Test::SendBw, 10), "iWARP"),
        (rxe(opts(Test::WriteBw, 10), false), "SEND"),
    ] {
        match run_one(
            &door,
            &Options {
                connection: QpType::Ud,
                ..o
            },
        ) {
            PerfError::Options(m) => assert!(m.contains("-c UD") && m.contains(why), "{m}"),
            e => panic!("-c UD must be refused ({why}): {e}"),
        }
    }
}

/// `-c UC` (rxe0, without -R as perftest): the Send and Write tests over UC QPs
/// through both front doors, validated; the peer's Writes land unacknowledged. Reads,
/// atomics, rdma_cm and iWARP are refused with perftest's words.
///
/// Nothing paces a UC sender: a message whose packets find the receiving socket's
/// buffer full is lost, and a Send test's server then waits for it for ever (as
/// perftest's would). So send-bw moves 4 KiB messages here: 300 of 64 KiB (19 MB,
/// more than the 16 MB buffer) lost one under two busy loops when the receiving thread
/// was starved. write-bw's server waits for no message, and its check holds whichever
/// Write of a place lands last.
#[test]
fn rxe_uc_send_and_write_tests() {
    each_front_door(|door| {
        let uc = |test, iters| Options {
            connection: QpType::Uc,
            ..rxe(opts(test, iters), false)
        };
        for test in [Test::SendLat, Test::WriteLat] {
            let (s, c) = run_pair(door, &uc(test, 200));
            for side in [&s, &c] {
                sane_lat(side, 2, 200);
                assert!(side.text.contains("Connection type : UC"), "{}", side.text);
            }
        }
        for (test, size) in [(Test::WriteBw, 65536), (Test::SendBw, 4096)] {
            let o = Options {
                size: Some(size),
                ..uc(test, 300)
            };
            let (s, c) = run_pair(door, &o);
            sane_bw(&c.summary.bw[0], size, 300, true);
            assert!(s.summary.validated || c.summary.validated, "{test:?}");
            check_info(&s, "IB", "Ethernet");
        }
    });
    let door = FrontDoor::Embedded;
    let uc = |o: Options| Options {
        connection: QpType::Uc,
        ..o
    };
    for (o, why) in [
        (rxe(opts(Test::ReadBw, 10), false), "READ/ATOMIC"),
        (rxe(opts(Test::AtomicLat, 10), false), "READ/ATOMIC"),
        (rxe(opts(Test::WriteBw, 10), true), "librdmacm"),
        (opts(Test::WriteBw, 10), "iWARP"),
    ] {
        match run_one(&door, &uc(o)) {
            PerfError::Options(m) => assert!(m.contains("-c UC") && m.contains(why), "{m}"),
            e => panic!("-c UC must be refused ({why}): {e}"),
        }
    }
}

#[test]
fn siw_refuses_the_socket_exchange() {
    let door = FrontDoor::Embedded;
    let ctx = door.open();
    let o = Options {
        port: 0,
        rdma_cm: false,
        ..opts(Test::WriteBw, 10)
    };
    let server = perftest::Server::listen(&ctx, &o).expect("the socket listens");
    match server.run(&mut std::io::sink()) {
        Err(PerfError::Options(m)) => assert!(m.contains("iWARP") && m.contains("-R"), "{m}"),
        r => panic!("siw0 without -R must be refused: {:?}", r.map(|_| ())),
    }
}

/// A socket client that plays perftest's prologue by hand and then sends `record` as its
/// `pingpong_dest`: the rxe0 server must stop with a typed error.
fn socket_server_meets(version: &[u8; 16], record: &[u8]) -> PerfError {
    let door = FrontDoor::Embedded;
    let ctx = door.open();
    let o = Options {
        port: 0,
        ..rxe(Options::new(Test::WriteBw), false)
    };
    let server = perftest::Server::listen(&ctx, &o).expect("server listens");
    let port = server.port();
    let srv = std::thread::spawn(move || server.run(&mut std::io::sink()));
    let mut sock = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut answer = |mine: &[u8]| -> Option<Vec<u8>> {
        sock.write_all(mine).ok()?;
        let mut theirs = vec![0u8; mine.len()];
        sock.read_exact(&mut theirs).ok()?;
        Some(theirs)
    };
    let theirs = answer(version).expect("the server's version");
    assert!(theirs.starts_with(b"6.06"));
    if version.starts_with(b"6.06") {
        let page = answer(&4096i32.to_be_bytes()).expect("page size");
        assert!(i32::from_be_bytes(page[..4].try_into().unwrap()) >= 4096);
        assert_eq!(answer(&64i32.to_be_bytes()).unwrap(), 64i32.to_be_bytes());
        assert!(answer(b"3\0").is_some());
        sock.write_all(record).unwrap();
    }
    // Whatever comes next, the server reads to the end.
    let _ = sock.shutdown(std::net::Shutdown::Write);
    let err = srv
        .join()
        .unwrap()
        .map(|_| ())
        .expect_err("the server must refuse");
    drop(sock);
    err
}

#[test]
fn socket_server_refuses_bad_peers() {
    let mut v = [0u8; 16];
    v[..4].copy_from_slice(b"6.06");
    let mut garbage = [b'z'; 108];
    garbage[107] = 0;
    match socket_server_meets(&v, &garbage) {
        PerfError::Protocol(_) => {}
        e => panic!("garbage record: {e}"),
    }
    match socket_server_meets(&v, &[0xff; 108]) {
        PerfError::Protocol(_) => {}
        e => panic!("non-text record: {e}"),
    }
    // A record cut short, then the connection closed.
    match socket_server_meets(&v, b"0000:0001:000011") {
        PerfError::PeerClosed(_) => {}
        e => panic!("short record: {e}"),
    }
    let mut old = [0u8; 16];
    old[..4].copy_from_slice(b"5.60");
    match socket_server_meets(&old, &[]) {
        PerfError::Version(v) => assert_eq!(v, "5.60"),
        e => panic!("old version: {e}"),
    }
}

/// A timed run (`-D 1 -f 0`: the whole second is the sample) of `test` on `o`'s device.
fn timed(o: Options) -> Options {
    Options {
        duration: Some(1),
        margin: Some(0),
        validate: false,
        iters: None,
        ..o
    }
}

#[test]
fn timed_bandwidth_runs() {
    // Write (the server waits, then prints the client's report), send_bw over iWARP
    // (credits) and over rxe0 without rdma_cm, Read, two QPs.
    let runs = [
        timed(opts(Test::WriteBw, 0)),
        timed(opts(Test::SendBw, 0)),
        timed(rxe(opts(Test::SendBw, 0), false)),
        timed(rxe(opts(Test::ReadBw, 0), true)),
        Options {
            num_qps: 2,
            ..timed(rxe(opts(Test::WriteBw, 0), false))
        },
    ];
    for o in runs {
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        let r = c.summary.bw[0];
        assert!(r.iters > 0, "{}", c.text);
        sane_bw(&r, 65536, r.iters, false);
        if o.test == Test::SendBw {
            // The server's clock starts at its first message: its own sample.
            let got = s.summary.bw[0];
            assert!(got.iters > 0, "{}", s.text);
            sane_bw(&got, 65536, got.iters, false);
        } else {
            assert_eq!(
                s.summary.bw, c.summary.bw,
                "server prints the client's report"
            );
        }
    }
}

#[test]
fn timed_latency_runs() {
    let lat_dur = " #bytes        #iterations       t_avg[usec]    tps average";
    let runs = [
        timed(opts(Test::SendLat, 0)),
        timed(opts(Test::WriteLat, 0)),
        timed(rxe(opts(Test::SendLat, 0), false)),
        timed(rxe(opts(Test::ReadLat, 0), true)),
        timed(rxe(opts(Test::AtomicLat, 0), false)),
    ];
    for o in runs {
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        let measuring: &[&Side] = if o.test == Test::ReadLat || o.test == Test::AtomicLat {
            &[&c]
        } else {
            &[&s, &c]
        };
        for side in measuring {
            let t = &side.text;
            assert!(t.contains(lat_dur), "{t}");
            let r = side.summary.timed_lat[0];
            assert!(r.iters > 0, "{t}");
            assert!(r.t_avg.is_finite() && r.t_avg > 0.0, "{r:?}");
            // The sample is one second: tps counts its exchanges.
            assert!(
                (r.tps - r.iters as f64).abs() < 1e-6 * r.tps.max(1.0),
                "{r:?}"
            );
        }
    }
}

#[test]
fn post_list_runs() {
    let list = |o: Options, l: u32| Options { post_list: l, ..o };
    // -l 4: CQ moderation becomes 4 (said as perftest says it); over rxe0 with -Q 2.
    let (s, c) = run_pair(&FrontDoor::Embedded, &list(opts(Test::WriteBw, 300), 4));
    check_rdma_bw(&s, &c, 65536, 300);
    for t in [&s.text, &c.text] {
        assert!(
            t.contains("Post List requested - CQ moderation will be the size"),
            "{t}"
        );
        assert!(t.contains(" RDMA_Write Post List BW Test"), "{t}");
        assert!(t.contains(" Post List       : 4"), "{t}");
        assert!(t.contains(" CQ Moderation   : 4"), "{t}");
    }
    let o = Options {
        cq_mod: Some(2),
        size: Some(4096),
        ..list(rxe(opts(Test::SendBw, 300), false), 6)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &o);
    sane_bw(&c.summary.bw[0], 4096, 300, true);
    assert!(s.summary.validated, "{}", s.text);
    assert!(c.text.contains(" CQ Moderation   : 2"), "{}", c.text);
    // Send with credits over iWARP (messages above half a page: --validate can check
    // them), and a timed Read with a list.
    let credits = Options {
        rx_depth: Some(30),
        size: Some(3000),
        ..list(opts(Test::SendBw, 300), 5)
    };
    let (s, c) = run_pair(&FrontDoor::Embedded, &credits);
    sane_bw(&c.summary.bw[0], 3000, 300, true);
    assert!(s.summary.validated, "{}", s.text);
    let (_, c) = run_pair(
        &FrontDoor::Embedded,
        &list(timed(rxe(opts(Test::ReadBw, 0), true)), 8),
    );
    assert!(c.summary.bw[0].iters > 0, "{}", c.text);
}

#[test]
fn duration_and_post_list_refusals() {
    let refused = |o: Options, says: &str| {
        let e = run_one(&FrontDoor::Embedded, &o);
        assert!(
            matches!(&e, PerfError::Options(m) if m.contains(says)),
            "{says}: {e}"
        );
    };
    let d = |o: Options, d: u32, f: Option<u32>| Options {
        duration: Some(d),
        margin: f,
        validate: false,
        ..o
    };
    refused(
        d(opts(Test::WriteBw, 10), 2, Some(1)),
        "DURATION > 2*MARGIN",
    );
    refused(
        Options {
            use_event: true,
            ..d(opts(Test::SendLat, 10), 5, None)
        },
        "doesn't work with events",
    );
    refused(
        Options {
            all_sizes: true,
            ..d(opts(Test::SendBw, 10), 5, None)
        },
        "all sizes",
    );
    refused(
        Options {
            validate: true,
            ..d(opts(Test::SendBw, 10), 5, None)
        },
        "--validate",
    );
    let l = |o: Options, l: u32| Options { post_list: l, ..o };
    refused(l(opts(Test::SendLat, 10), 2), "BW tests only");
    refused(
        Options {
            size: Some(1000),
            ..l(opts(Test::SendBw, 10), 2)
        },
        "above half a page",
    );
    refused(l(opts(Test::WriteBw, 10), 4), "multiple of post list");
    refused(
        Options {
            cq_mod: Some(3),
            ..l(opts(Test::WriteBw, 12), 4)
        },
        "multiple of CQ moderation",
    );
}

#[test]
fn bidirectional_runs() {
    let both = |o: Options| Options { duplex: true, ..o };
    // Each side prints the sum of both reports; both check what the peer's requests left.
    let runs = [
        both(opts(Test::WriteBw, 300)),
        both(rxe(opts(Test::ReadBw, 300), false)),
        both(rxe(opts(Test::SendBw, 300), true)),
        both(rxe(opts(Test::AtomicBw, 300), false)),
        Options {
            rx_depth: Some(30),
            size: Some(3000),
            ..both(opts(Test::SendBw, 300))
        },
        Options {
            all_sizes: true,
            ..both(rxe(opts(Test::SendBw, 20), false))
        },
    ];
    for o in runs {
        let (s, c) = run_pair(&FrontDoor::Embedded, &o);
        let sizes = if o.all_sizes { 23 } else { 1 };
        assert_eq!((s.summary.bw.len(), c.summary.bw.len()), (sizes, sizes));
        for side in [&s, &c] {
            let t = &side.text;
            assert!(t.contains(" Bidirectional BW Test"), "{t}");
            assert!(t.contains(" TX depth        : "), "{t}");
            if o.test.verb() != perftest::Verb::Atomic {
                assert!(side.summary.validated, "{t}");
            }
        }
        for (a, b) in s.summary.bw.iter().zip(&c.summary.bw) {
            // The same sum on both sides (the peak is left out: a side's own peak is
            // computed from its own samples, exchanged as printed).
            assert_eq!((a.size, a.iters), (b.size, b.iters));
            assert!(
                (a.bw_avg - b.bw_avg).abs() <= 1e-9 * a.bw_avg.max(1.0),
                "{a:?} {b:?}"
            );
            assert!(a.bw_avg > 0.0 && a.msg_rate > 0.0, "{a:?}");
        }
    }
    // A timed bidirectional send_bw prints each side's own count.
    let (s, c) = run_pair(
        &FrontDoor::Embedded,
        &both(timed(rxe(opts(Test::SendBw, 0), false))),
    );
    assert!(s.summary.bw[0].iters > 0 && c.summary.bw[0].iters > 0);
    let e = run_one(&FrontDoor::Embedded, &both(opts(Test::SendLat, 10)));
    assert!(
        matches!(&e, PerfError::Options(m) if m.contains("only available in BW")),
        "{e}"
    );
}
