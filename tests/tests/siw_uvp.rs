//! siw's engine in the consumer's process, through krdmad (`FastPath::Either`, the
//! default of a context opened through the device file): the uAL starts the engine in
//! the process and mirrors its objects in the daemon. The daemon keeps the books (the
//! objects, limits, pinned bytes) and sees none of the traffic; the wire is the same, so
//! an engine in a consumer and the daemon's own talk to each other; sleepers are woken by
//! the engine through the ring, memory windows and shared receive queues work across the
//! two layers; and a consumer that dies takes its connections with it while the daemon
//! forgets its context.

use krdma_tests::{daemon_possible, device_counter, fill_endpoint, init_logging, Daemon};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tools::perf::{connect_pair, Endpoint};
use ual::send_flags::SIGNALED;
use ual::{Access, Context, Cqe, FastPathChoice, WcStatus, Wqe, WrOpcode};

const MIB: usize = 1 << 20;

/// What a context on the daemon's engine reports of an engine in its process.
fn k_none(d: &Daemon) -> Option<Vec<(String, u64)>> {
    let k = open(d, FastPathChoice::Kal);
    let dev = k.device("siw0").unwrap().index;
    let _pd = k.alloc_pd(dev).unwrap();
    k.stat_in_process(dev)
}

fn open(d: &Daemon, choice: FastPathChoice) -> Arc<Context> {
    Context::open_target_with(&d.target(), choice).expect("open a context through krdmad")
}

/// A daemon and two contexts through it running siw's engine themselves (`None` where no
/// daemon can run: not root, no FUSE).
fn two_consumers() -> Option<(Daemon, Arc<Context>, Arc<Context>)> {
    if !daemon_possible() {
        return None;
    }
    init_logging();
    let d = Daemon::start();
    let (a, b) = (
        open(&d, FastPathChoice::Consumer),
        open(&d, FastPathChoice::Consumer),
    );
    Some((d, a, b))
}

/// FPDUs the daemon's own siw engine sent and received.
fn daemon_fpdus(ctx: &Context) -> (u64, u64) {
    (
        device_counter(ctx, "siw0", "tx_fpdus"),
        device_counter(ctx, "siw0", "rx_fpdus"),
    )
}

/// The client's buffer written into the server's, a Send into a posted receive, and the
/// server's buffer read back into the client's upper half: byte-exact each way.
fn exchange(s: &Endpoint, c: &Endpoint, len: usize) {
    let half = len / 2;
    fill_endpoint(c, 7);
    let mut theirs = vec![0u8; len];
    c.write(1, 0, half as u32, 0, SIGNALED).unwrap();
    c.complete(1).unwrap();
    s.post_recv(2, half as u64, 65536).unwrap();
    c.send(3, half as u64, 65536, SIGNALED).unwrap();
    c.complete(1).unwrap();
    assert_eq!(s.complete(1).unwrap()[0].byte_len, 65536);
    s.buf.read(0, &mut theirs);
    let mut mine = vec![0u8; len];
    c.buf.read(0, &mut mine);
    assert_eq!(
        theirs[..half],
        mine[..half],
        "the Write landed byte for byte"
    );
    assert_eq!(
        theirs[half..half + 65536],
        mine[half..half + 65536],
        "the Send landed byte for byte"
    );
    // Read the server's lower half back over the client's upper half.
    c.read(4, half as u64, half as u32, 0).unwrap();
    c.complete(1).unwrap();
    c.buf.read(0, &mut mine);
    assert_eq!(
        mine[half..],
        mine[..half],
        "the Read brought the same bytes back"
    );
    assert_eq!(
        krdma_tests::crc(&mine[..half]),
        krdma_tests::crc(&theirs[..half])
    );
}

#[test]
fn the_engine_runs_in_the_consumer_and_the_daemon_keeps_the_books() {
    let Some((d, a, b)) = two_consumers() else {
        return;
    };
    let before = daemon_fpdus(&a);
    let (s, c) = connect_pair(&a, &b, "siw0", 4 * MIB, 64).unwrap();
    assert!(
        s.qp.ring_memory().is_none() && s.cq.ring_memory().is_none(),
        "no rings shared with the daemon"
    );
    exchange(&s, &c, 4 * MIB);

    let (_, rows) = a.stat_contexts().unwrap();
    for ctx in [&a, &b] {
        let row = rows.iter().find(|r| r.id == ctx.id()).expect("listed");
        assert_eq!(
            (row.pds, row.cqs, row.qps, row.mrs),
            (1, 1, 1, 1),
            "the daemon holds the objects made in the process: {row:?}"
        );
    }
    assert_eq!(
        daemon_fpdus(&a),
        before,
        "no FPDU went through the daemon's engine"
    );
    let dev = a.device("siw0").unwrap().index;
    let here: std::collections::HashMap<_, _> = a
        .stat_in_process(dev)
        .expect("the engine in this process")
        .into_iter()
        .collect();
    assert!(
        here["tx_fpdus"] > 0 && here["rx_fpdus"] > 0,
        "the engine in this process carried them: {here:?}"
    );
    assert!(
        k_none(&d).is_none(),
        "a context on the daemon's engine has no engine here"
    );
    drop((s, c));
    let (_, rows) = a.stat_contexts().unwrap();
    let row = rows.iter().find(|r| r.id == a.id()).unwrap();
    assert_eq!(
        (row.qps, row.mrs, row.cqs, row.pds),
        (0, 0, 0, 0),
        "{row:?}"
    );
}

#[test]
fn an_engine_in_a_consumer_and_the_daemons_talk_both_ways() {
    let Some((d, _, u)) = two_consumers() else {
        return;
    };
    let k = open(&d, FastPathChoice::Kal);
    for (server, client, who) in [(&k, &u, "daemon serves"), (&u, &k, "consumer serves")] {
        let before = daemon_fpdus(&k);
        let (s, c) = connect_pair(server, client, "siw0", 2 * MIB, 16).unwrap();
        exchange(&s, &c, 2 * MIB);
        let after = daemon_fpdus(&k);
        assert!(
            after.0 > before.0 && after.1 > before.1,
            "{who}: the daemon's engine carried its side"
        );
    }
}

#[test]
fn a_sleeper_is_woken_by_the_engine_without_an_event() {
    let Some((_d, a, b)) = two_consumers() else {
        return;
    };
    let (s, c) = connect_pair(&a, &b, "siw0", 65536, 16).unwrap();
    assert!(s.cq.sleeps_on_ring(), "the engine wakes sleepers itself");
    for i in 0..3 {
        s.post_recv(i, 0, 64).unwrap();
        let armed = s.cq.arm_to_sleep(false);
        let mut got = [Cqe::default(); 2];
        assert_eq!(s.cq.poll(&mut got), 0);
        // Sent while the server sleeps.
        let sender = std::thread::spawn({
            let (qp, sge) = (c.qp.clone(), c.mr.sge(0, 8));
            move || {
                std::thread::sleep(Duration::from_millis(20));
                qp.post_send(&Wqe::new(10 + i, WrOpcode::Send, &[sge]).with_flags(SIGNALED))
            }
        });
        let t = Instant::now();
        let n = loop {
            match s.cq.poll(&mut got) {
                0 => s.cq.sleep(armed, Duration::from_secs(10)).unwrap(),
                n => break n,
            }
            assert!(t.elapsed() < Duration::from_secs(10), "never woken");
        };
        assert_eq!((n, got[0].wr_id), (1, i));
        sender.join().unwrap().unwrap();
        c.complete(1).unwrap();
    }
    assert!(
        s.cq.events().try_recv().is_err(),
        "no CqNotify event was made for a sleeper"
    );
}

#[test]
fn windows_and_shared_receive_queues_work_through_the_consumer_engine() {
    let Some((_d, a, b)) = two_consumers() else {
        return;
    };
    let dev = a.device("siw0").unwrap().index;
    let ip = tools::perf::loopback_of(&a, dev).unwrap();
    let listener = a.listen(dev, std::net::SocketAddr::new(ip, 0), 8).unwrap();
    let at = std::net::SocketAddr::new(ip, listener.port);
    let access = Access::LOCAL_WRITE | Access::MW_BIND;
    // The server's QP takes its receives from an SRQ; its buffer is reached through a
    // window bound by a send-queue request of the uVP's QP.
    let pd = a.alloc_pd(dev).unwrap();
    let cq = a.create_cq(dev, 64).unwrap();
    let srq = a.create_srq(&pd, 16, 1).unwrap();
    let qp = a
        .create_qp(
            &pd,
            &cq,
            &cq,
            ual::QpConfig {
                srq: Some(srq.clone()),
                ..Default::default()
            },
        )
        .unwrap();
    let buf = ual::RegBuf::new(65536).unwrap();
    let mr = a.reg_buf(&pd, &buf, access).unwrap();
    let c = tools::perf::new_endpoint(&b, dev, 65536, 16).unwrap();
    let connecting = std::thread::spawn({
        let qp = c.qp.clone();
        move || qp.connect_wait(at, &Default::default(), Duration::from_secs(10))
    });
    let req = listener.get_request(Duration::from_secs(10)).unwrap();
    listener
        .accept(req.conn_id, &qp, &Default::default())
        .unwrap();
    connecting.join().unwrap().unwrap();
    let wait = |n: usize| cq.wait(n, Duration::from_secs(10)).unwrap();

    for i in 0..4u64 {
        srq.post_recv(&Wqe::recv(100 + i, &[mr.sge(i * 1024, 1024)]))
            .unwrap();
    }
    c.buf.write(0, b"through the shared receive queue");
    c.send(1, 0, 32, SIGNALED).unwrap();
    c.complete(1).unwrap();
    let got = wait(1);
    assert_eq!((got[0].wr_id, got[0].byte_len), (100, 32));
    let mut seen = [0u8; 32];
    buf.read(0, &mut seen);
    assert_eq!(&seen, b"through the shared receive queue");

    let mw = a.alloc_mw(&pd).unwrap();
    let rights = Access::REMOTE_WRITE | Access::REMOTE_READ;
    qp.post_send(&mw.bind_wqe(7, &mr, 8192, 4096, rights).with_flags(SIGNALED))
        .unwrap();
    assert_eq!(wait(1)[0].wr_id, 7);
    c.buf.write(0, b"into the window");
    let w = Wqe::new(2, WrOpcode::RdmaWrite, &[c.mr.sge(0, 15)])
        .with_remote(mr.addr + 8192 + 100, mw.rkey())
        .with_flags(SIGNALED);
    c.qp.post_send(&w).unwrap();
    // Read it back (a Read follows the Write on the wire, so it finds it placed).
    let r = Wqe::new(3, WrOpcode::RdmaRead, &[c.mr.sge(1024, 15)])
        .with_remote(mr.addr + 8192 + 100, mw.rkey())
        .with_flags(SIGNALED);
    c.qp.post_send(&r).unwrap();
    c.complete(2).unwrap();
    let mut seen = [0u8; 15];
    buf.read(8192 + 100, &mut seen);
    assert_eq!(&seen, b"into the window");
    c.buf.read(1024, &mut seen);
    assert_eq!(&seen, b"into the window");

    // Past the window's end: refused by the engine in the server's process.
    let r = Wqe::new(4, WrOpcode::RdmaRead, &[c.mr.sge(2048, 64)])
        .with_remote(mr.addr + 8192 + 4096 - 8, mw.rkey())
        .with_flags(SIGNALED);
    c.qp.post_send(&r).unwrap();
    let done = c.cq.wait(1, Duration::from_secs(10)).unwrap();
    assert_ne!(
        done[0].status(),
        WcStatus::Success,
        "a read past the window"
    );
}
