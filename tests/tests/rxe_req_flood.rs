//! H5 on rxe, through both kAL front doors: thousands of spoofed CM REQs (distinct
//! communication IDs, from many addresses, valid ICRCs) to a listened port. The device
//! keeps at most the listener's backlog of them, pushes the oldest out for newer ones,
//! never lets them crowd the consumer's event queue; a bystander tenant on rxe0 (created
//! before the flood) keeps being served; and a genuine client that comes afterwards
//! connects.

use krdma_tests::roce::{raw_possible, RawPeer};
use krdma_tests::{device_counter, each_front_door, private_loopback, Bystander, FrontDoor};
use rxe::wire::cm::{self, CmMad, CmMessage, CmPath};
use rxe::wire::cma;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};
use tools::perf::{loopback_of, new_endpoint};
use ual::{send_flags, ConnParam, EventKind};

const T: Duration = Duration::from_secs(20);
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);
const FLOOD: u32 = 10_000;
const BACKLOG: u32 = 16;
/// REQs sent before waiting for the device to take them.
const BATCH: usize = 250;

/// Wait until `count()` reaches `want`, or until it stops growing for a second (what
/// UDP dropped never comes).
fn settle(count: impl Fn() -> u64, want: u64) {
    let mut last = count();
    let mut still = Instant::now();
    while last < want && still.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(5));
        let now = count();
        if now != last {
            last = now;
            still = Instant::now();
        }
    }
}

/// A spoofed REQ for `port` with communication ID `id`.
fn req(id: u32, port: u16, src: Ipv4Addr, dst: Ipv4Addr) -> CmMad {
    CmMad::new(
        id as u64,
        CmMessage::Req(cm::Req {
            local_comm_id: id,
            service_id: cma::service_id_tcp(port),
            local_ca_guid: 0x0200_5eff_fe00_0001,
            local_qkey: 0,
            local_qpn: 0x100 + id,
            responder_resources: 1,
            local_eecn: 0,
            initiator_depth: 1,
            remote_eecn: 0,
            remote_cm_response_timeout: 20,
            transport_service_type: cm::transport_type::RC,
            end_to_end_flow_control: false,
            starting_psn: id & 0xff_ffff,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xffff,
            path_mtu: 3,
            rdc_exists: false,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            extended_transport_type: 0,
            primary_path: CmPath {
                local_lid: 0xffff,
                remote_lid: 0xffff,
                local_gid: rnicpi::ip_to_gid(src.into()),
                remote_gid: rnicpi::ip_to_gid(dst.into()),
                hop_limit: 64,
                ..CmPath::default()
            },
            alternate_path: CmPath::default(),
            sap_supported: false,
            private_data: [0; cm::REQ_PRIVATE_DATA_LEN],
        }),
    )
}

#[test]
fn a_req_flood_is_bounded_and_a_genuine_client_still_connects() {
    if !raw_possible() {
        return;
    }
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let victim = door.open();
        let dev = victim.device("rxe0").unwrap().index;
        let ip = loopback_of(&victim, dev).unwrap();
        let IpAddr::V4(dst) = ip else {
            panic!("rxe0 on {ip}")
        };
        let l = victim.listen(dev, SocketAddr::new(ip, 0), BACKLOG).unwrap();
        let counter = |name| device_counter(&victim, "rxe0", name);
        let rcvd = counter("cm_rcvd");
        let pushed_out = counter("cm_req_evicted") + counter("cm_req_refused");

        let door_n = matches!(door, FrontDoor::Daemon(_)) as u8;
        let mut a = RawPeer::new(private_loopback(150 + door_n));
        // UDP may drop what the device's socket cannot take in time (a loaded host), so
        // the flood goes in batches, each given time to arrive; what arrived is what the
        // bounds below are checked against (thousands, far beyond every bound).
        let started = Instant::now();
        for batch in (0..FLOOD).collect::<Vec<_>>().chunks(BATCH) {
            for &k in batch {
                // From 256 addresses no test process uses (127.1.x.y).
                let src = Ipv4Addr::new(127, 1, door_n, k as u8);
                a.send_mad(src, dst, &req(0x5000_0000 + k, l.port, src, dst));
            }
            let want = rcvd + batch[batch.len() - 1] as u64 + 1;
            settle(|| counter("cm_rcvd"), want);
        }
        let received = (counter("cm_rcvd") - rcvd) as u32;
        eprintln!(
            "{received} of {FLOOD} REQs taken in {:?}",
            started.elapsed()
        );
        assert!(
            received >= FLOOD / 2,
            "only {received} of {FLOOD} REQs reached the device"
        );

        // Bounded: the listener's backlog is all that waits; the rest was pushed out
        // or refused, and the table holds little more than that.
        let waiting = counter("cm_requests_waiting");
        let conns = counter("cm_conns");
        eprintln!("waiting {waiting}, connections {conns}");
        assert!(waiting <= BACKLOG as u64, "{waiting} requests wait");
        assert!(
            conns <= BACKLOG as u64 + 8,
            "{conns} connections in the table"
        );
        assert!(
            counter("cm_req_evicted") + counter("cm_req_refused")
                >= pushed_out + (received - BACKLOG) as u64
        );

        // The consumer reads what reached it (at most its backlog is still answerable).
        let mut delivered = 0u32;
        while l.events().recv_timeout(Duration::from_millis(500)).is_ok() {
            delivered += 1;
        }
        eprintln!("{delivered} requests reached the consumer");

        // A genuine client connects afterwards.
        let client = door.open();
        let c = new_endpoint(&client, dev, 4096, 8).unwrap();
        let param = ConnParam {
            private_data: b"genuine".to_vec(),
            ird: 1,
            ord: 1,
        };
        c.qp.connect(SocketAddr::new(ip, l.port), &param).unwrap();
        let req = loop {
            let r = l.get_request(T).expect("the genuine request");
            if r.private_data.starts_with(b"genuine") {
                break r;
            }
        };
        let s = new_endpoint(&victim, dev, 4096, 8).unwrap();
        l.accept(req.conn_id, &s.qp, &param).unwrap();
        assert_eq!(c.qp.next_event(T).unwrap().kind, EventKind::Established);
        assert_eq!(s.qp.next_event(T).unwrap().kind, EventKind::Established);
        s.post_recv(1, 0, 64).unwrap();
        c.send(2, 0, 16, send_flags::SIGNALED).unwrap();
        s.complete(1).unwrap();
        c.complete(1).unwrap();

        bystander.more_round_trips(10, T);
        bystander.finish().assert_served(BYSTANDER_BOUND);
    });
}
