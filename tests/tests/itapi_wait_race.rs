//! Issue 10's lost wake-up: a thread in `Evd::wait` must be woken by a completion that is
//! already queued, that is still in the completion ring, or that lands while the thread
//! goes to sleep — whatever flags the request was posted with, with or without the
//! SEVD's descriptor, and while the machine is busy. (`tests/c/itapi_wait_dto.c`, run by
//! `itapi_c_abi.rs`, is the issue's own C program.)
//!
//! The rounds vary what comes first: small writes often complete inside the post (the
//! completion is in the ring before the wait), large ones while the waiter sleeps, and
//! a second thread posting after a varying spin lands completions at every point of the
//! waiter's way to sleep. Spinning threads compete for both cores throughout. A lost
//! wake-up shows as a wait that reaches its (generous) timeout.

#[macro_use]
mod itapi_common;

use itapi_common::*;
use krdma_itapi::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const ROUNDS: u64 = 300;
/// Far beyond any round's duration: reaching it means the waiter was never woken.
const WAIT: Option<Duration> = Some(Duration::from_secs(20));

/// Threads that keep every core busy until dropped.
struct CpuLoad {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuLoad {
    fn start(n: usize) -> CpuLoad {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 1u64;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..10_000 {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                    }
                })
            })
            .collect();
        CpuLoad { stop, threads }
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Round `i`'s size and flags: 8 B, 4 KiB, 64 KiB in turn; every other one without
/// `NOTIFY` (a completion the consumer did not ask to be notified of still ends a wait).
fn round(i: u64) -> (u32, DtoFlags) {
    let len = [8, 4096, 65536][(i % 3) as usize];
    let flags = if i.is_multiple_of(2) {
        DtoFlags::COMPLETION
    } else {
        DtoFlags::SIGNALED
    };
    (len, flags)
}

fn expect_write(ev: Result<(Event, usize)>, cookie: u64, what: &str) {
    match ev {
        Ok((Event::Dto(d), 0)) => assert_eq!(
            (d.kind, d.cookie, d.status),
            (DtoKind::RdmaWrite, cookie, DtoStatus::Success),
            "{what}"
        ),
        other => panic!("{what}: round {cookie}: {other:?}"),
    }
}

itapi_tests! {
    fn itapi_wait_races_completions_under_load(case) {
        let _load = CpuLoad::start(2);
        for dto_flags in [EvdFlags::empty(), EvdFlags::CREATE_FD] {
            let client = Cfg {
                buf_len: 1 << 17,
                dto_flags,
                ..Cfg::default()
            };
            let server = Cfg { buf_len: 1 << 17, ..Cfg::default() };
            let (_s, c) = pair_cfg(case, &server, &client);
            // One SEVD for both queues, with a receive that stays posted throughout.
            c.ep.post_recv(&[c.seg(0, 64)], u64::MAX, DtoFlags::SIGNALED).unwrap();

            // Post, then wait in the same thread.
            for i in 0..ROUNDS {
                let (len, flags) = round(i);
                c.ep.post_rdma_write(&[c.seg(0, len)], i, flags, c.remote(0)).unwrap();
                if i % 5 == 4 {
                    std::thread::yield_now();
                }
                expect_write(c.dto.wait(WAIT), i, "post then wait");
            }

            // Wait in one thread while another posts, a varying spin after the waiter
            // took the previous event: the completion lands before the wait, while the
            // waiter looks at the ring, or while it sleeps.
            let taken = Arc::new(AtomicU64::new(ROUNDS));
            let waiter = {
                let dto = c.dto.clone();
                let taken = taken.clone();
                std::thread::spawn(move || {
                    for i in ROUNDS..2 * ROUNDS {
                        expect_write(dto.wait(WAIT), i, "wait while another thread posts");
                        taken.store(i + 1, Ordering::Release);
                    }
                })
            };
            for i in ROUNDS..2 * ROUNDS {
                // One request at a time, so each wait is for exactly one completion.
                while taken.load(Ordering::Acquire) < i {
                    assert!(!waiter.is_finished(), "waiter gave up");
                    std::thread::yield_now();
                }
                for _ in 0..(i % 7) * 500 {
                    std::hint::spin_loop();
                }
                let (len, flags) = round(i);
                c.ep.post_rdma_write(&[c.seg(0, len)], i, flags, c.remote(0)).unwrap();
            }
            waiter.join().expect("waiter");
            eprintln!(
                "{} waits over {} ({}) all woken",
                2 * ROUNDS,
                case.dev,
                if dto_flags.is_empty() { "no descriptor" } else { "descriptor" }
            );
        }
    }
}
