//! The siw engine against itself over a simulated byte stream (`siw::sim`): no socket,
//! no thread, no root. Each case is seeded; a failing seed is printed and replays
//! exactly (`SIW_SIM_SEED=n` runs one).

use rnicpi::sim::{SimQp, SimRng};
use rnicpi::*;
use siw::sim::{Sim, StreamModel};

const SIG: u8 = send_flags::SIGNALED;
/// Steps after which a run that has not settled is a livelock.
const STEP_LIMIT: usize = 2_000_000;

fn seeds(n: u64) -> Vec<u64> {
    match std::env::var("SIW_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("SIW_SIM_SEED is a number")],
        Err(_) => (0..n).collect(),
    }
}

fn pattern(buf: &mut [u8], seed: u64) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u64).wrapping_mul(seed | 1).wrapping_add(seed >> 3) as u8;
    }
}

/// A stream cut and paced as the seed says: reads of one byte to 64 KiB, a send buffer
/// from nothing to 256 KiB, MSS from 536 to 64 KiB, CRC on or off.
fn model(rng: &mut SimRng) -> StreamModel {
    let pick = |rng: &mut SimRng, v: &[usize]| v[rng.upto(v.len() as u64 - 1) as usize];
    StreamModel {
        max_chunk: pick(rng, &[1, 7, 100, 1500, 9000, 65536]),
        window: pick(rng, &[0, 100, 4096, 65536, 262144]),
        mss: pick(rng, &[536, 1460, 9000, 65535]),
        crc: rng.upto(1) == 1,
    }
}

fn send(q: &SimQp, id: u64, op: WrOpcode, local: (u64, u32), remote: Option<(u64, u32)>) {
    let mut w = Wqe::new(id, op, &[q.sge(local.0, local.1)]).with_flags(SIG);
    if let Some((addr, key)) = remote {
        w = w.with_remote(addr, key);
    }
    q.user.post_send(&w).expect("post send");
}

fn recv(q: &SimQp, id: u64, local: (u64, u32)) {
    q.user
        .post_recv(&Wqe::recv(id, &[q.sge(local.0, local.1)]))
        .expect("post recv");
}

/// Run to the end; every completion of both QPs.
fn settle(sim: &mut Sim, seed: u64) -> [Vec<Cqe>; 2] {
    let mut got = [Vec::new(), Vec::new()];
    let mut done = false;
    for _ in 0..STEP_LIMIT {
        let going = sim.step();
        for (i, g) in got.iter_mut().enumerate() {
            g.extend(sim.qp(i).poll());
        }
        if !going {
            done = true;
            break;
        }
    }
    assert!(done, "seed {seed}: no end after {STEP_LIMIT} steps");
    got
}

/// Step until end `i` has `n` completions; them.
fn complete(sim: &mut Sim, i: usize, n: usize, seed: u64) -> Vec<Cqe> {
    let mut got = Vec::new();
    for _ in 0..STEP_LIMIT {
        got.extend(sim.qp(i).poll());
        if got.len() >= n {
            return got;
        }
        if !sim.step() {
            got.extend(sim.qp(i).poll());
            break;
        }
    }
    panic!(
        "seed {seed}: {} of {n} completions on end {i}: {got:?}",
        got.len()
    );
}

fn ids(c: &[Cqe]) -> Vec<u64> {
    c.iter().map(|c| c.wr_id).collect()
}

/// One seeded transfer: Send, RDMA Write and RDMA Read from end 0 and a Send back, of a
/// seeded size, byte-exact, completions successful and in order.
fn transfer(seed: u64) -> (u64, u64, u64) {
    let mut rng = SimRng::new(seed);
    let m = model(&mut rng);
    let most = if m.max_chunk < 100 { 3000 } else { 40_000 };
    let len = rng.upto(most) as u32;
    let l = len as u64;
    let mut sim = Sim::new(seed, m, 4 * most as usize + 64, 16);
    pattern(&mut sim.qp_mut(0).buf[..len as usize], seed);
    pattern(
        &mut sim.qp_mut(1).buf[2 * len as usize..3 * len as usize],
        seed + 1,
    );
    let (a, b) = (sim.qp(0), sim.qp(1));
    let (b_addr, b_key) = b.remote();
    recv(b, 1, (0, len));
    recv(a, 2, (3 * l, len));
    send(a, 10, WrOpcode::Send, (0, len), None);
    send(
        a,
        11,
        WrOpcode::RdmaWrite,
        (0, len),
        Some((b_addr + l, b_key)),
    );
    send(
        a,
        12,
        WrOpcode::RdmaRead,
        (3 * l, len),
        Some((b_addr + 2 * l, b_key)),
    );
    let ca = complete(&mut sim, 0, 3, seed);
    send(sim.qp(1), 20, WrOpcode::Send, (2 * l, len), None);
    let cb = complete(&mut sim, 1, 2, seed);
    let ca2 = complete(&mut sim, 0, 1, seed);
    assert_eq!(
        ids(&ca),
        [10, 11, 12],
        "seed {seed} {m:?}: completions in order"
    );
    assert_eq!(ids(&cb), [1, 20], "seed {seed} {m:?}");
    assert_eq!(ids(&ca2), [2], "seed {seed} {m:?}");
    for c in ca.iter().chain(&cb).chain(&ca2) {
        assert_eq!(c.status(), WcStatus::Success, "seed {seed} {m:?}: {c:?}");
    }
    assert_eq!(cb[0].byte_len, len);
    let (a, b) = (&sim.qp(0).buf, &sim.qp(1).buf);
    let n = len as usize;
    assert_eq!(b[..n], a[..n], "seed {seed} {m:?}: Send payload");
    assert_eq!(b[n..2 * n], a[..n], "seed {seed} {m:?}: Write payload");
    assert_eq!(
        a[3 * n..4 * n],
        b[2 * n..3 * n],
        "seed {seed} {m:?}: Read payload"
    );
    (sim.moved_from(0), sim.moved_from(1), sim.digest())
}

#[test]
fn transfers_are_byte_exact_however_the_stream_is_cut_and_paced() {
    for seed in seeds(2000) {
        transfer(seed);
    }
}

#[test]
fn a_seed_replays_exactly() {
    for seed in [3, 77, 1234] {
        assert_eq!(transfer(seed), transfer(seed), "seed {seed}");
    }
}

#[test]
fn reads_beyond_the_ord_wait_for_a_slot_and_complete_in_order() {
    let seed = 5;
    let mut sim = Sim::new(seed, StreamModel::default(), 64 * 1024, 32);
    pattern(&mut sim.qp_mut(1).buf, seed);
    let (b_addr, b_key) = sim.qp(1).remote();
    for i in 0..16u64 {
        send(
            sim.qp(0),
            i,
            WrOpcode::RdmaRead,
            (i * 1000, 1000),
            Some((b_addr + 32 * 1024 + i * 1000, b_key)),
        );
    }
    let c = complete(&mut sim, 0, 16, seed);
    assert_eq!(ids(&c), (0..16).collect::<Vec<_>>());
    assert!(c.iter().all(|c| c.is_ok()));
    assert_eq!(
        sim.qp(0).buf[..16_000],
        sim.qp(1).buf[32 * 1024..32 * 1024 + 16_000]
    );
}

#[test]
fn a_corrupted_byte_is_caught_by_the_crc_and_ends_both_sides() {
    for seed in seeds(50) {
        let m = StreamModel {
            crc: true,
            ..StreamModel::default()
        };
        let mut sim = Sim::new(seed, m, 64 * 1024, 16);
        sim.corrupt_from_0_at(20 + seed * 97 % 7000);
        recv(sim.qp(1), 1, (0, 8000));
        recv(sim.qp(1), 2, (8000, 8000));
        send(sim.qp(0), 10, WrOpcode::Send, (0, 8000), None);
        let [_, cb] = settle(&mut sim, seed);
        // The receiver lost the message and flushed both receives.
        assert_eq!(ids(&cb), [1, 2], "seed {seed}");
        assert!(
            cb.iter().all(|c| c.status() == WcStatus::WrFlushErr),
            "seed {seed}: {cb:?}"
        );
        // It terminated (LLP CRC error): a fatal error for it, and for the peer that
        // received its Terminate; both are in Error and their connections ended.
        let ea = sim.qp(0).events.kinds();
        let eb = sim.qp(1).events.kinds();
        assert_eq!(eb.first(), Some(&EventKind::QpFatal), "seed {seed}: {eb:?}");
        assert_eq!(ea.first(), Some(&EventKind::QpFatal), "seed {seed}: {ea:?}");
        assert_eq!(
            eb.last(),
            Some(&EventKind::ConnectionBroken),
            "seed {seed}: {eb:?}"
        );
        assert_eq!(
            ea.last(),
            Some(&EventKind::Disconnected),
            "seed {seed}: {ea:?}"
        );
        for i in 0..2 {
            assert_eq!(sim.qp(i).engine.query().state, QpState::Error);
        }
    }
}

#[test]
fn a_send_without_a_receive_terminates_the_connection() {
    let seed = 9;
    let mut sim = Sim::new(seed, StreamModel::default(), 64 * 1024, 16);
    send(sim.qp(0), 10, WrOpcode::Send, (0, 100), None);
    send(sim.qp(0), 11, WrOpcode::Send, (0, 100), None);
    let [ca, _] = settle(&mut sim, seed);
    // The first Send was written in full (complete, as iWARP completes a Send); the
    // second met the Terminate (sent or flushed, never lost).
    assert_eq!(ids(&ca), [10, 11]);
    assert_eq!(ca[0].status(), WcStatus::Success);
    assert_eq!(sim.qp(1).events.kinds().first(), Some(&EventKind::QpFatal));
    assert_eq!(sim.qp(0).events.kinds().first(), Some(&EventKind::QpFatal));
}

#[test]
fn an_orderly_close_delivers_everything_posted_before_it() {
    for seed in seeds(100) {
        let mut rng = SimRng::new(seed);
        let mut sim = Sim::new(seed, model(&mut rng), 64 * 1024, 32);
        pattern(&mut sim.qp_mut(0).buf[..32 * 1024], seed);
        for i in 0..10u64 {
            recv(sim.qp(1), i, (i * 3000, 3000));
            send(sim.qp(0), 100 + i, WrOpcode::Send, (i * 3000, 3000), None);
        }
        sim.qp(0).engine.disconnect(false).expect("disconnect");
        let [ca, cb] = settle(&mut sim, seed);
        assert_eq!(ids(&ca), (100..110).collect::<Vec<_>>(), "seed {seed}");
        assert_eq!(ids(&cb), (0..10).collect::<Vec<_>>(), "seed {seed}");
        assert!(ca.iter().chain(&cb).all(|c| c.is_ok()), "seed {seed}");
        assert_eq!(sim.qp(1).buf[..30_000], sim.qp(0).buf[..30_000]);
        for i in 0..2 {
            let ev = sim.qp(i).events.kinds();
            assert_eq!(ev, [EventKind::Disconnected], "seed {seed}: end {i}");
        }
    }
}

#[test]
fn an_abortive_close_mid_transfer_completes_every_request_once() {
    for seed in seeds(500) {
        let mut rng = SimRng::new(seed);
        let mut sim = Sim::new(seed, model(&mut rng), 256 * 1024, 32);
        let (b_addr, b_key) = sim.qp(1).remote();
        for i in 0..8u64 {
            recv(sim.qp(1), i, (i * 8192, 8192));
        }
        for i in 0..8u64 {
            send(sim.qp(0), 100 + i, WrOpcode::Send, (0, 8192), None);
            let remote = Some((b_addr + 65536 + i * 16384, b_key));
            send(sim.qp(0), 200 + i, WrOpcode::RdmaWrite, (0, 16384), remote);
        }
        for _ in 0..rng.upto(300) {
            sim.step();
        }
        sim.qp(0).engine.disconnect(true).expect("abort");
        let [ca, cb] = settle(&mut sim, seed);
        // Every request completes exactly once, in the order posted: done before the
        // reset, or flushed.
        let posted: Vec<u64> = (0..8).flat_map(|i| [100 + i, 200 + i]).collect();
        assert_eq!(ids(&ca), posted, "seed {seed}");
        assert_eq!(ids(&cb), (0..8).collect::<Vec<_>>(), "seed {seed}");
        let flushed = |c: &[Cqe]| c.iter().position(|c| !c.is_ok()).unwrap_or(c.len());
        for c in [&ca, &cb] {
            let f = flushed(c);
            assert!(
                c[f..].iter().all(|c| c.status() == WcStatus::WrFlushErr),
                "seed {seed}: {c:?}"
            );
        }
        assert_eq!(
            sim.qp(0).events.kinds(),
            [EventKind::Disconnected],
            "seed {seed}"
        );
        assert_eq!(
            sim.qp(1).events.kinds(),
            [EventKind::ConnectionBroken],
            "seed {seed}"
        );
    }
}

/// A doorbell that fills the socket part-way through a message larger than a batch
/// leaves the rest to the tx thread; a reset that comes before that thread writes it
/// still completes the request, and every one after it, exactly once (flushed).
#[test]
fn a_message_a_doorbell_left_part_way_completes_once_after_a_reset() {
    for seed in seeds(20) {
        let model = StreamModel {
            max_chunk: 65536,
            window: 65536,
            mss: 9000,
            crc: false,
        };
        let mut sim = Sim::new(seed, model, 2 << 20, 8);
        let (b_addr, b_key) = sim.qp(1).remote();
        let remote = Some((b_addr, b_key));
        send(sim.qp(0), 1, WrOpcode::RdmaWrite, (0, 1 << 20), remote);
        send(sim.qp(0), 2, WrOpcode::RdmaWrite, (0, 4096), remote);
        sim.reset_reaches(0);
        let [ca, _] = settle(&mut sim, seed);
        assert_eq!(ids(&ca), [1, 2], "seed {seed}");
        assert!(
            ca.iter().all(|c| c.status() == WcStatus::WrFlushErr),
            "seed {seed}: {ca:?}"
        );
        assert_eq!(
            sim.qp(0).events.kinds(),
            [EventKind::ConnectionBroken],
            "seed {seed}"
        );
    }
}
