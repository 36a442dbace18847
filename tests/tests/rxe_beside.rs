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

/// The default stack of an embedded kAL (`rxe_this_host_if_taken`) whose rxe0 finds its
/// port on every address taken serves this host only, on a loopback address of its own;
/// krdmad's stack (without it) leaves rxe0 out.
#[test]
fn an_embedded_stack_falls_back_to_this_host_when_the_port_is_taken() {
    krdma_tests::init_logging();
    let wildcard = device(None, 0).expect("a device on every address");
    let rxe0 = |this_host: bool| {
        let kal = kal::Kal::new(kal::Config::default());
        let opts = stack::StackOptions {
            rxe_port: Some(wildcard.udp_port()),
            rxe_this_host_if_taken: this_host,
            siw_netdev: Some("lo".into()),
            ibverbs_off: true,
            ..stack::StackOptions::default()
        };
        stack::start_default(&kal, &opts).expect("the stack starts");
        let found = kal.devices().into_iter().find(|d| d.attr().name == "rxe0");
        found.map(|d| d.port(1).expect("port 1").gids)
    };
    assert_eq!(rxe0(false), None, "krdmad's stack leaves rxe0 out");
    let gids = rxe0(true).expect("an embedded stack's rxe0 serves this host");
    assert_eq!(gids.len(), 1, "{gids:?}");
    let ip = rnicpi::gid_to_ip(gids[0]);
    assert!(ip.is_loopback(), "{ip}");
}

/// Two programs on one host, each with its embedded kAL and nothing set: a `krdma perf`
/// server on rxe0 (every address) and its client (this host only, on a loopback address
/// of its own), over rdma_cm and over perftest's own exchange, where the server's QP is
/// on the host's first address and sends from it to the client's loopback one. (A port
/// of their own stands for 4791.)
#[test]
fn two_programs_reach_each_other_over_rxe0() {
    let krdma = krdma_tests::krdmad_bin().with_file_name("krdma");
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free port")
        .port();
    for (i, cm) in [(0u16, false), (1, true)] {
        let tcp = (10_000 + port % 20_000 + i).to_string();
        let run = |server: bool| {
            let mut c = std::process::Command::new(&krdma);
            c.args(["perf", "write-bw", "-d", "rxe0", "-n", "200", "-p", &tcp])
                .env("KRDMA_DEVICE", "embedded")
                .env("KRDMA_RXE_PORT", port.to_string())
                .env("KRDMA_IBVERBS", "off")
                .env_remove("KRDMA_RXE_ADDR")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            if cm {
                c.arg("-R");
            }
            if !server {
                c.arg("127.0.0.1");
            }
            c.spawn().expect("krdma perf")
        };
        let server = run(true);
        std::thread::sleep(Duration::from_millis(500));
        let client = within(run(false), Duration::from_secs(60));
        let server = within(server, Duration::from_secs(10));
        let text = |o: &std::process::Output| {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        };
        let (c, s) = (text(&client), text(&server));
        assert!(
            client.status.success(),
            "client (rdma_cm {cm}):\n{c}\nserver:\n{s}"
        );
        assert!(server.status.success(), "server (rdma_cm {cm}):\n{s}");
        assert!(c.contains("serves this host only"), "{c}");
        assert!(
            c.lines().any(|l| l.trim_start().starts_with("65536")),
            "{c}"
        );
    }
}

/// What `child` printed, once it has ended, killed if it has not by `limit`.
fn within(mut child: std::process::Child, limit: Duration) -> std::process::Output {
    let deadline = std::time::Instant::now() + limit;
    while child.try_wait().expect("wait").is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().expect("output")
}
