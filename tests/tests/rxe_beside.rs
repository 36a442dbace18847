//! rxe devices side by side in one network namespace, as krdmad's rxe0 on every address
//! and a program's embedded rxe0 are: a second device on an address and port one already
//! holds is refused (in raw mode it would see and answer the first one's packets, in UDP
//! mode take half of them), and a device on one address of the host works beside a
//! device on every address, which leaves that address's packets alone — as the kernel
//! would give them to the other device's socket.
//!
//! Its own test binary: the embedded kAL of this process serves rxe0 on 127.0.0.1 (a
//! host address, which a device on every address takes for its own) on a port of its
//! own, beside a device on every address on that port.

use kal::services::HostServices;
use krdma_tests::{connected_pair, FrontDoor};
use rnicpi::{Provider, VerbsError};
use rxe::{RxeConfig, RxeDevice};
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;
use ual::{send_flags, Wqe, WrOpcode};

fn device(addr: Option<Ipv4Addr>, port: u16) -> Result<Arc<RxeDevice>, VerbsError> {
    let config = RxeConfig {
        addr,
        port,
        ..RxeConfig::default()
    };
    RxeDevice::new(config, Arc::new(HostServices))
}

fn counter(dev: &RxeDevice, name: &str) -> u64 {
    let all = dev.counters();
    all.iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no counter {name} in {all:?}"))
        .1
}

#[test]
fn a_device_on_one_address_works_beside_one_on_every_address() {
    krdma_tests::init_logging();
    let wildcard = device(None, 0).expect("a device on every address");
    let port = wildcard.udp_port();
    let err = |r: Result<Arc<RxeDevice>, VerbsError>| r.err().map(|e| e.to_string());
    assert_eq!(
        err(device(None, port)),
        Some(VerbsError::AddrInUse.to_string()),
        "a second device on every address"
    );

    // This process's embedded rxe0 on 127.0.0.1 and the same port.
    ual::configure_embedded(stack::StackOptions {
        rxe_addr: Some(Ipv4Addr::LOCALHOST),
        rxe_port: Some(port),
        ..stack::StackOptions::from_env()
    });
    let door = FrontDoor::Embedded;
    let (_a, _b, s, c) = connected_pair(&door, "rxe0", 1 << 20);
    assert_eq!(
        err(device(Some(Ipv4Addr::LOCALHOST), port)),
        Some(VerbsError::AddrInUse.to_string()),
        "a second device on 127.0.0.1"
    );
    for round in 0..20u64 {
        let len = 64 << (round % 12);
        s.post_recv(round, 0, len).unwrap();
        let send =
            Wqe::new(round, WrOpcode::Send, &[c.mr.sge(0, len)]).with_flags(send_flags::SIGNALED);
        c.qp.post_send(&send).unwrap();
        let wc = s.complete(1).expect("the Send arrives");
        assert_eq!(wc[0].byte_len, len);
        c.complete(1).expect("and completes");
    }
    // The device on every address answered nothing it saw: no CM message, no NAK.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counter(&wildcard, "cm_sent"), 0);
    assert_eq!(counter(&wildcard, "cm_rcvd"), 0);
    assert_eq!(counter(&wildcard, "tx_packets"), 0);
    if krdma_tests::roce::raw_possible() {
        // Its raw socket saw every packet to 127.0.0.1 and left them to the other.
        assert!(
            counter(&wildcard, "rx_not_ours") > 0,
            "{:?}",
            wildcard.counters()
        );
    }
}
