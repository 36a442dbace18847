//! M7: a deregistration returns only once no access to the memory is in flight, so the
//! consumer may reuse or free the memory at once. A peer streams RDMA Writes into a
//! registration; the owner deregisters it in the middle and at once fills the memory
//! with a canary: no write may land after the deregistration returned. Through both
//! front doors, over siw0 and rxe0.

use krdma_tests::{connected_pair, each_front_door, Anonymous, Bystander};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{send_flags, Access, WcStatus, Wqe, WrOpcode};

const LEN: usize = 1 << 20;
const CHUNK: u32 = 64 << 10;
const CANARY: u8 = 0x5a;

#[test]
fn no_write_lands_after_the_deregistration_returned() {
    each_front_door(|door| {
        for device in ["siw0", "rxe0"] {
            let bystander = Bystander::start(door, "rxe0");
            let (a, _b, s, c) = connected_pair(door, device, CHUNK as usize);
            c.buf.fill(0xab);
            let target = Arc::new(Anonymous::new(LEN));
            // SAFETY: `target` outlives the registration (deregistered below, dropped
            // at the end) and is only accessed through raw volatile copies.
            let mr = unsafe {
                a.reg_mr(
                    &s.pd,
                    target.as_ptr(),
                    LEN,
                    Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                )
            }
            .unwrap();
            let (addr, rkey) = (mr.addr, mr.rkey);
            let stop = Arc::new(AtomicBool::new(false));
            let halt = stop.clone();
            let writer = std::thread::spawn(move || {
                // Writes back to back, a signalled one in every 8, until one fails (the
                // registration is gone) or we are told to stop.
                let mut i = 0u64;
                while !halt.load(Ordering::Relaxed) {
                    let off = (i % (LEN as u64 / CHUNK as u64)) * CHUNK as u64;
                    let flags = if i % 8 == 7 { send_flags::SIGNALED } else { 0 };
                    let w = Wqe::new(i, WrOpcode::RdmaWrite, &[c.mr.sge(0, CHUNK)])
                        .with_remote(addr + off, rkey)
                        .with_flags(flags);
                    if c.qp.post_send(&w).is_err() {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    if flags != 0 {
                        match c.cq.wait(1, Duration::from_secs(5)) {
                            Ok(done) if done[0].status() == WcStatus::Success => {}
                            _ => return i, // a write failed (the key is gone): done
                        }
                    }
                    i += 1;
                }
                i
            });
            // Let writes land, then deregister while they are still coming.
            let t0 = Instant::now();
            while target.byte(0) != 0xab {
                assert!(t0.elapsed() < Duration::from_secs(10), "no write landed");
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(Duration::from_millis(30)); // a stream, not a first write
            drop(mr);
            target.fill(CANARY);
            std::thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::Relaxed);
            let writes = writer.join().unwrap();
            let late = (0..LEN).filter(|i| target.byte(*i) != CANARY).count();
            eprintln!(
                "{} {device}: {writes} writes, {late} bytes written late",
                door.name()
            );
            assert_eq!(late, 0, "a write landed after DEREG_MR returned");
            bystander.finish().assert_served(Duration::from_secs(2));
        }
    });
}
