//! Hostile ioctl input through both front doors: random command numbers and random
//! argument bytes never crash the kAL, and other contexts keep working.

use krdma_tests::each_front_door;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use ual::abi::{self, cmd};

#[test]
fn random_commands_and_bytes_are_refused_cleanly() {
    each_front_door(|door| {
        let victim = door.open();
        let dev = victim.device("siw0").unwrap().index;
        let pd = victim.alloc_pd(dev).unwrap();
        let attacker = door.open();
        let mut runner = TestRunner::new(Config {
            cases: 3000,
            failure_persistence: None,
            ..Config::default()
        });
        let valid: Vec<u32> = cmd::ALL.iter().map(|(c, _)| *c).collect();
        // Any number at all (the uAL refuses what is not a krdma command of the buffer's
        // size before the system call), krdma-type numbers of any size, and real ones.
        let krdma_type = (any::<u8>(), 0usize..4096).prop_map(|(nr, size)| abi::iowr(nr, size));
        let strategy = (
            prop_oneof![any::<u32>(), krdma_type, proptest::sample::select(valid)],
            proptest::collection::vec(any::<u8>(), 0..2048),
        );
        runner
            .run(&strategy, |(c, mut bytes)| {
                if let Some((_, _, size)) = abi::decode(c) {
                    bytes.resize(size.min(16383), 0);
                }
                if c == cmd::CONNECT {
                    // Random bytes must never make us send a SYN off this machine.
                    let lo = rnicpi::ip_to_gid("127.0.0.1".parse().unwrap());
                    bytes[16..32].copy_from_slice(&lo);
                }
                let _ = attacker.channel().call_raw(c, &mut bytes);
                Ok(())
            })
            .unwrap();
        // The victim's objects are intact and it can still work.
        let pd2 = victim.alloc_pd(dev).expect("victim still served");
        let (_, rows) = victim.stat_contexts().unwrap();
        assert!(rows.iter().any(|r| r.id == victim.id() && r.pds == 2));
        drop((pd, pd2));
    });
}
