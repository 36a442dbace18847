//! Stateful fuzzing of the rxe engine and its connection manager: sequences of RoCEv2
//! packets — requests to a QP's responder with PSNs near the expected one and keys and
//! addresses near its registrations, responses to its requester (ACKs, NAKs, read
//! responses, atomic acknowledgements), CM MADs to QP1 with IDs the device used —
//! mixed with the consumer's own verbs, played against a real rxe device through the
//! receive thread's hand-off (`RxeDevice::receive`). Input format: `input.rs`; the rig:
//! `rig.rs`.
//!
//! Oracles: nothing panics, in this thread or the device's (libFuzzer's panic hook aborts
//! the process); every read and write of consumer memory lies inside a registration,
//! writes only inside writable ones (`arena.rs` checks each access); the guard bytes
//! around the registrations stay intact; a QP's responder queue stays within
//! 4 × IRD + 1 and the requests waiting within the listener's backlog — after every
//! record and after teardown.
#![no_main]

mod arena;
mod input;
mod rig;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (setup, records) = input::parse(data);
    let mut world = rig::World::new(setup);
    for r in &records {
        world.play(r);
        world.check();
    }
    world.finish();
});
