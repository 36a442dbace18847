//! The rxe engine against itself on a simulated clock and link (`rxe::sim`): no socket,
//! no thread, no root. Each case is seeded; a failing seed is printed and replays
//! exactly (`RXE_SIM_SEED=n` runs one).

use rnicpi::*;
use rxe::sim::{connect, Events, Impairment, Sim, SimQp};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

const A: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 2);
const SIG: u8 = send_flags::SIGNALED;

/// A lossy, duplicating, reordering link: 5% loss, 1% duplicates, jitter of 10× the delay.
const LOSSY: Impairment = Impairment {
    latency: Duration::from_micros(10),
    jitter: Duration::from_micros(100),
    loss_ppm: 50_000,
    duplicate_ppm: 10_000,
};

/// Retry budgets of a patient QP: 4 ms ACK timeout (timeout 10), 7 retries, RNR forever.
fn patient() -> QpAttr {
    QpAttr {
        timeout: 10,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..QpAttr::default()
    }
}

struct Pair {
    sim: Sim,
    devs: [Arc<rxe::RxeDevice>; 2],
    a: SimQp,
    b: SimQp,
}

impl Pair {
    /// Counter `name` summed over both devices.
    fn counted(&self, name: &str) -> u64 {
        let of = |d: &rxe::RxeDevice| d.counters().into_iter().find(|c| c.0 == name).unwrap().1;
        self.devs.iter().map(|d| of(d)).sum()
    }
}

fn pair(
    seed: u64,
    link: Impairment,
    len: usize,
    mtu: u32,
    psns: (u32, u32),
    retry: QpAttr,
) -> Pair {
    let mut sim = Sim::new(seed, link);
    let da = sim.add_device("rxe-a", A);
    let db = sim.add_device("rxe-b", B);
    let a = SimQp::new(&*da, len, 64);
    let b = SimQp::new(&*db, len, 64);
    connect(&a, A, &b, B, mtu, psns, retry);
    Pair {
        sim,
        devs: [da, db],
        a,
        b,
    }
}

fn pattern(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(seed | 1).wrapping_add(seed >> 3) as u8;
    }
}

/// Run until `q` has `n` completions; them.
fn complete(sim: &Sim, q: &SimQp, n: usize, limit: Duration) -> Vec<Cqe> {
    let mut got = Vec::new();
    let ok = sim.run_until(limit, || {
        got.extend(q.poll());
        got.len() >= n
    });
    assert!(
        ok,
        "{} of {n} completions after {:?}: {got:?}",
        got.len(),
        sim.elapsed()
    );
    got
}

/// One seeded run: a multi-packet Send, RDMA Write and RDMA Read each way over `link`,
/// byte-exact, every completion successful and in order. Odd seeds receive as a polling
/// consumer does (acknowledgements held for its next call, coalesced).
fn transfer(seed: u64, link: Impairment, mtu: u32, psns: (u32, u32)) -> Pair {
    let len = 3 * 4096 + 123;
    let mut p = pair(seed, link, 4 * len, mtu, psns, patient());
    p.sim.set_polled(seed % 2 == 1);
    pattern(&mut p.a.buf[..len], seed);
    pattern(&mut p.b.buf[2 * len..3 * len], seed + 1);
    // Send a[0..len] -> b[0..len]
    p.b.user
        .post_recv(&Wqe::recv(1, &[p.b.sge(0, len as u32)]))
        .unwrap();
    p.a.user
        .post_send(&Wqe::new(10, WrOpcode::Send, &[p.a.sge(0, len as u32)]).with_flags(SIG))
        .unwrap();
    // Write a[0..len] -> b[len..2len]
    let (b_addr, b_key) = p.b.remote();
    p.a.user
        .post_send(
            &Wqe::new(11, WrOpcode::RdmaWrite, &[p.a.sge(0, len as u32)])
                .with_remote(b_addr + len as u64, b_key)
                .with_flags(SIG),
        )
        .unwrap();
    // Read b[2len..3len] -> a[3len..4len]
    p.a.user
        .post_send(
            &Wqe::new(
                12,
                WrOpcode::RdmaRead,
                &[p.a.sge(3 * len as u64, len as u32)],
            )
            .with_remote(b_addr + 2 * len as u64, b_key)
            .with_flags(SIG),
        )
        .unwrap();
    let limit = Duration::from_secs(30);
    let ca = complete(&p.sim, &p.a, 3, limit);
    let cb = complete(&p.sim, &p.b, 1, limit);
    let ids: Vec<u64> = ca.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [10, 11, 12], "seed {seed}: completions in order");
    for c in ca.iter().chain(&cb) {
        assert_eq!(c.status(), WcStatus::Success, "seed {seed}: {c:?}");
    }
    assert_eq!(cb[0].byte_len, len as u32);
    assert_eq!(p.b.buf[..len], p.a.buf[..len], "seed {seed}: Send payload");
    assert_eq!(
        p.b.buf[len..2 * len],
        p.a.buf[..len],
        "seed {seed}: Write payload"
    );
    assert_eq!(
        p.a.buf[3 * len..],
        p.b.buf[2 * len..3 * len],
        "seed {seed}: Read payload"
    );
    p
}

fn seeds(n: u64) -> Vec<u64> {
    match std::env::var("RXE_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("RXE_SIM_SEED is a number")],
        Err(_) => (0..n).collect(),
    }
}

#[test]
fn clean_link_transfer_is_byte_exact() {
    let p = transfer(1, Impairment::CLEAN, 1024, (100, 200));
    let s = p.sim.link_stats();
    assert_eq!((s.lost, s.duplicated), (0, 0));
    assert!(
        p.sim.elapsed() < Duration::from_millis(5),
        "{:?}",
        p.sim.elapsed()
    );
}

/// Go-back-N under loss, duplication and reordering, across many seeds and every MTU.
#[test]
fn lossy_link_seeds_all_recover() {
    let (mut lost, mut held, mut coalesced) = (0, 0, 0);
    for seed in seeds(1500) {
        let mtu = 256 << (seed % 5);
        let p = transfer(
            seed,
            LOSSY,
            mtu,
            (seed as u32 * 7919, seed as u32 * 104_729),
        );
        lost += p.sim.link_stats().lost;
        held += p.counted("acks_held");
        coalesced += p.counted("acks_coalesced");
    }
    assert!(
        lost > 1000,
        "the link lost {lost} datagrams: too few to mean anything"
    );
    // The odd seeds' receivers held acknowledgements back and coalesced some.
    if std::env::var_os("RXE_SIM_SEED").is_none() {
        assert!(
            held > 1000 && coalesced > 100,
            "{held} held, {coalesced} coalesced"
        );
    }
}

/// The PSN space wraps (24 bits) in the middle of messages, on a lossy link.
#[test]
fn psn_wrap_under_loss() {
    for seed in seeds(300) {
        transfer(seed, LOSSY, 256, (0xff_fff0, 0xff_fffa));
    }
}

/// The same seed replays the same run: the same datagrams at the same times, the same
/// link events, the same simulated duration.
#[test]
fn a_seed_replays_exactly() {
    let one = transfer(42, LOSSY, 512, (5, 6));
    let two = transfer(42, LOSSY, 512, (5, 6));
    assert_eq!(one.sim.digest(), two.sim.digest());
    assert_eq!(one.sim.link_stats(), two.sim.link_stats());
    assert_eq!(one.sim.elapsed(), two.sim.elapsed());
    let other = transfer(43, LOSSY, 512, (5, 6));
    assert_ne!(one.sim.digest(), other.sim.digest());
}

/// A Send with no receive posted draws RNR NAKs; the requester backs off and succeeds
/// once the receive is posted.
#[test]
fn rnr_backs_off_until_a_receive_is_posted() {
    let p = pair(7, Impairment::CLEAN, 4096, 1024, (1, 2), patient());
    p.a.user
        .post_send(&Wqe::new(1, WrOpcode::Send, &[p.a.sge(0, 64)]).with_flags(SIG))
        .unwrap();
    p.sim.run_for(Duration::from_millis(50));
    assert!(
        p.a.poll().is_empty(),
        "no completion while the peer has no receive"
    );
    let sent = p.sim.link_stats().sent;
    assert!(
        sent > 4,
        "the Send was retried after RNR NAKs: {sent} datagrams"
    );
    p.b.user
        .post_recv(&Wqe::recv(2, &[p.b.sge(0, 64)]))
        .unwrap();
    let c = complete(&p.sim, &p.a, 1, Duration::from_secs(5));
    assert_eq!(c[0].status(), WcStatus::Success);
    assert_eq!(
        complete(&p.sim, &p.b, 1, Duration::from_secs(1))[0].byte_len,
        64
    );
}

/// RNR retries exhausted (rnr_retry 2): the Send fails with RnrRetryExcErr.
#[test]
fn rnr_retries_run_out() {
    let retry = QpAttr {
        rnr_retry: 2,
        ..patient()
    };
    let p = pair(8, Impairment::CLEAN, 4096, 1024, (1, 2), retry);
    p.a.user
        .post_send(&Wqe::new(1, WrOpcode::Send, &[p.a.sge(0, 64)]).with_flags(SIG))
        .unwrap();
    let c = complete(&p.sim, &p.a, 1, Duration::from_secs(5));
    assert_eq!(c[0].status(), WcStatus::RnrRetryExcErr);
}

/// A peer that stops answering: the requester retries with a doubling timer and fails
/// the request with RetryExcErr, the QP goes to Error, the rest is flushed, and the
/// consumer hears of a broken connection — all on the simulated clock.
#[test]
fn dead_link_exhausts_the_retries() {
    let p = pair(9, Impairment::CLEAN, 1 << 16, 1024, (1, 2), patient());
    p.sim.set_impairment(Impairment::CUT);
    for i in 0..3 {
        p.a.user
            .post_send(
                &Wqe::new(i, WrOpcode::RdmaWrite, &[p.a.sge(0, 8192)])
                    .with_remote(p.b.remote().0, p.b.remote().1)
                    .with_flags(SIG),
            )
            .unwrap();
    }
    let c = complete(&p.sim, &p.a, 3, Duration::from_secs(60));
    assert_eq!(c[0].status(), WcStatus::RetryExcErr, "{c:?}");
    assert!(
        c[1..].iter().all(|c| c.status() == WcStatus::WrFlushErr),
        "{c:?}"
    );
    assert_eq!(p.a.engine.query().state, QpState::Error);
    // 8 tries of a 4 ms timer that doubles up to 8x: 4+8+16+32+32+32+32+32 ms.
    let took = p.sim.elapsed();
    assert!(
        (Duration::from_millis(150)..Duration::from_millis(400)).contains(&took),
        "{took:?}"
    );
    assert!(p.a.events.kinds().contains(&EventKind::ConnectionBroken));
}

/// The requester's QP is moved to Error in the middle of a large transfer on a lossy
/// link: everything outstanding completes flushed, nothing is placed afterwards, and the
/// peer is left consistent.
#[test]
fn abort_mid_transfer_flushes() {
    for seed in seeds(50) {
        let len = 1 << 18;
        let p = pair(seed, LOSSY, len, 1024, (3, 4), patient());
        for i in 0..4 {
            p.a.user
                .post_send(
                    &Wqe::new(i, WrOpcode::RdmaWrite, &[p.a.sge(0, len as u32)])
                        .with_remote(p.b.remote().0, p.b.remote().1)
                        .with_flags(SIG),
                )
                .unwrap();
        }
        p.sim.run_for(Duration::from_micros(200 + seed * 37));
        let error = QpAttr {
            state: QpState::Error,
            ..QpAttr::default()
        };
        p.a.engine.modify(&error, QpAttrMask::STATE).unwrap();
        let c = complete(&p.sim, &p.a, 4, Duration::from_secs(1));
        let ok = c
            .iter()
            .take_while(|c| c.status() == WcStatus::Success)
            .count();
        assert!(
            c[ok..].iter().all(|c| c.status() == WcStatus::WrFlushErr),
            "seed {seed}: {c:?}"
        );
        let sent = p.sim.sent_from(A);
        p.sim.run_for(Duration::from_secs(1));
        assert_eq!(
            p.sim.sent_from(A),
            sent,
            "seed {seed}: nothing sent after Error"
        );
    }
}

/// What a connection through the connection manager went through.
struct CmRun {
    sim: Sim,
    a: SimQp,
    b: SimQp,
}

/// A connects to B's listener through the connection manager (REQ, REP, RTU, every MAD
/// as exposed to `link` as any packet), sends one message over the connection and closes
/// it in order; both sides hear of the connection and of its end.
fn cm_run(seed: u64, link: Impairment) -> CmRun {
    let limit = Duration::from_secs(30);
    let mut sim = Sim::new(seed, link);
    let da = sim.add_device("rxe-a", A);
    let db = sim.add_device("rxe-b", B);
    let a = SimQp::new(&*da, 4096, 16);
    let b = SimQp::new(&*db, 4096, 16);
    let service = SocketAddr::new(B.into(), 7471);
    let requests = Arc::new(Events::default());
    let listener = db.listen(service, 8, requests.clone()).unwrap();
    let param = |pdata: &[u8]| ConnParam {
        private_data: pdata.to_vec(),
        ird: 1,
        ord: 1,
    };
    da.connect(&a.engine, service, param(b"hello")).unwrap();
    let request = || {
        let all = requests.all();
        all.into_iter()
            .find(|e| e.kind == EventKind::ConnectRequest)
    };
    assert!(
        sim.run_until(limit, || request().is_some()),
        "seed {seed}: no request"
    );
    let req = request().unwrap();
    assert_eq!(&req.private_data[..5], b"hello");
    listener
        .accept(req.conn_id, &b.engine, param(b"welcome"))
        .unwrap();
    let has = |q: &SimQp, k: EventKind| q.events.kinds().contains(&k);
    let up = sim.run_until(limit, || {
        has(&a, EventKind::Established) && has(&b, EventKind::Established)
    });
    assert!(
        up,
        "seed {seed}: {:?} / {:?}",
        a.events.kinds(),
        b.events.kinds()
    );
    let est = a.events.all();
    assert_eq!(&est[0].private_data[..7], b"welcome");
    b.user.post_recv(&Wqe::recv(1, &[b.sge(0, 64)])).unwrap();
    a.user
        .post_send(&Wqe::new(2, WrOpcode::Send, &[a.sge(0, 64)]).with_flags(SIG))
        .unwrap();
    assert_eq!(complete(&sim, &a, 1, limit)[0].status(), WcStatus::Success);
    assert_eq!(complete(&sim, &b, 1, limit)[0].byte_len, 64);
    a.engine.disconnect(false).unwrap();
    let down = sim.run_until(limit, || {
        has(&a, EventKind::Disconnected) && has(&b, EventKind::Disconnected)
    });
    assert!(
        down,
        "seed {seed}: {:?} / {:?}",
        a.events.kinds(),
        b.events.kinds()
    );
    assert_eq!(a.engine.query().state, QpState::Error);
    assert_eq!(b.engine.query().state, QpState::Error);
    listener.close();
    CmRun { sim, a, b }
}

/// The connection manager on a lossy link: lost, duplicated and late MADs are retried and
/// answered again until both sides agree, across many seeds.
#[test]
fn cm_connects_and_closes_over_a_lossy_link() {
    let mut lost = 0;
    for seed in seeds(200) {
        lost += cm_run(seed, LOSSY).sim.link_stats().lost;
    }
    assert!(
        lost > 20,
        "the link lost {lost} datagrams: too few to mean anything"
    );
}

/// A connection's seed replays exactly too: the connection manager's identifiers come
/// from the simulation's seed.
#[test]
fn a_cm_seed_replays_exactly() {
    let one = cm_run(7, LOSSY);
    let two = cm_run(7, LOSSY);
    assert_eq!(one.sim.digest(), two.sim.digest());
    assert_eq!(one.sim.elapsed(), two.sim.elapsed());
    assert_eq!(one.a.events.kinds(), two.a.events.kinds());
    assert_eq!(one.b.events.kinds(), two.b.events.kinds());
}
