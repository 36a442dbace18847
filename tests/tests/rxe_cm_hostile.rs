//! The rxe connection manager against other tenants and spoofing peers, through both kAL
//! front doors, each with a bystander tenant on rxe0 created before the attack:
//!
//! * H4: a connection request belongs to the listener it was delivered to; another
//!   context's listener cannot accept or reject it (`ENOENT`, as for an ID that does not
//!   exist), and communication IDs and QP numbers are not sequential;
//! * M3: a DREQ, REJ or MRA counts only when it comes from the connection's peer address
//!   with the IDs the two ends agreed on (a DREQ also naming our QP); anything else is
//!   dropped and counted, and the connection lives on.

use krdma_tests::roce::{raw_possible, CmWatch, RawPeer};
use krdma_tests::{device_counter, each_front_door, private_loopback, Bystander, FrontDoor};
use rxe::wire::cm::{self, CmMad, CmMessage};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tools::perf::{loopback_of, new_endpoint, Endpoint};
use ual::{send_flags, ConnParam, Context, EventKind, VerbsError};

const T: Duration = Duration::from_secs(10);
const BYSTANDER_BOUND: Duration = Duration::from_secs(2);

fn param(pdata: &[u8]) -> ConnParam {
    ConnParam {
        private_data: pdata.to_vec(),
        ird: 1,
        ord: 1,
    }
}

fn served(bystander: Bystander) {
    bystander.more_round_trips(10, T);
    bystander.finish().assert_served(BYSTANDER_BOUND);
}

/// rxe0's device number and loopback address, seen from `ctx`.
fn rxe0(ctx: &Context) -> (u32, IpAddr) {
    let dev = ctx.device("rxe0").unwrap().index;
    (dev, loopback_of(ctx, dev).unwrap())
}

fn endpoint(ctx: &Arc<Context>) -> Endpoint {
    new_endpoint(ctx, rxe0(ctx).0, 4096, 8).unwrap()
}

/// One Send from `from` to `to` arrives.
fn send_arrives(from: &Endpoint, to: &Endpoint) {
    to.post_recv(1, 0, 64).unwrap();
    from.send(2, 0, 16, send_flags::SIGNALED).unwrap();
    to.complete(1).unwrap();
    from.complete(1).unwrap();
}

fn not_consecutive(v: &[u64]) -> bool {
    v.windows(2).any(|w| w[1] != w[0].wrapping_add(1))
}

#[test]
fn a_request_is_answered_only_by_the_listener_it_came_to() {
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let (victim, attacker, client) = (door.open(), door.open(), door.open());
        let (dev, ip) = rxe0(&victim);
        let vl = victim.listen(dev, SocketAddr::new(ip, 0), 4).unwrap();
        let al = attacker.listen(dev, SocketAddr::new(ip, 0), 4).unwrap();
        let c = endpoint(&client);
        c.qp.connect(SocketAddr::new(ip, vl.port), &param(b"for the victim"))
            .unwrap();
        let req = vl.get_request(T).unwrap();
        assert_eq!(&req.private_data[..14], b"for the victim");

        // The attacker's listener names the victim's request, and IDs near it.
        let a = endpoint(&attacker);
        for id in [req.conn_id, req.conn_id + 1, req.conn_id.wrapping_sub(1)] {
            assert_eq!(
                al.accept(id, &a.qp, &param(b"hijacked")),
                Err(VerbsError::NoSuchResource),
                "accept of another context's request {id:#x}"
            );
            assert_eq!(
                al.reject(id, b"go away"),
                Err(VerbsError::NoSuchResource),
                "reject of another context's request {id:#x}"
            );
        }

        // The victim still has it: accept, and the connection works.
        let v = endpoint(&victim);
        vl.accept(req.conn_id, &v.qp, &param(b"welcome")).unwrap();
        let ev = c.qp.next_event(T).unwrap();
        assert_eq!(ev.kind, EventKind::Established);
        assert_eq!(&ev.private_data[..7], b"welcome");
        assert_eq!(v.qp.next_event(T).unwrap().kind, EventKind::Established);
        send_arrives(&c, &v);

        // Nothing to guess from: communication IDs and QP numbers are not sequential.
        let mut ids = vec![req.conn_id];
        let mut qpns = vec![c.qp.qp_num as u64];
        for _ in 0..3 {
            let x = endpoint(&client);
            x.qp.connect(SocketAddr::new(ip, vl.port), &param(b"again"))
                .unwrap();
            ids.push(vl.get_request(T).unwrap().conn_id);
            qpns.push(x.qp.qp_num as u64);
        }
        assert!(not_consecutive(&ids), "comm IDs {ids:x?}");
        assert!(not_consecutive(&qpns), "QPNs {qpns:x?}");
        served(bystander);
    });
}

/// The IDs of a connection as the wire showed them: (client's comm ID, server's comm ID,
/// server's QPN).
fn ids_on_the_wire(seen: &[krdma_tests::roce::SeenMad]) -> (u32, u32, u32) {
    seen.iter()
        .find_map(|m| match m.mad.message {
            CmMessage::Rep(rep) => Some((rep.remote_comm_id, rep.local_comm_id, rep.local_qpn)),
            _ => None,
        })
        .expect("a REP")
}

fn has(seen: &[krdma_tests::roce::SeenMad], attr: u16) -> bool {
    seen.iter().any(|m| m.mad.message.attribute_id() == attr)
}

#[test]
fn cm_messages_count_only_from_the_peer_with_its_ids() {
    if !raw_possible() {
        return;
    }
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let (server, client) = (door.open(), door.open());
        let (dev, ip) = rxe0(&server);
        let IpAddr::V4(dev_ip) = ip else {
            panic!("rxe0 on {ip}")
        };
        let spoofer = private_loopback(140 + matches!(door, FrontDoor::Daemon(_)) as u8);
        let mut a = RawPeer::new(spoofer);
        let watch = CmWatch::new(dev_ip);
        let unmatched = || device_counter(&server, "rxe0", "cm_unmatched");

        // A connection waits for its server: the client is in REQ Sent.
        let l = server.listen(dev, SocketAddr::new(ip, 0), 4).unwrap();
        let c = endpoint(&client);
        c.qp.connect(SocketAddr::new(ip, l.port), &param(b"hello"))
            .unwrap();
        let req = l.get_request(T).unwrap();
        let seen = watch.until(T, |s| has(s, cm::ATTR_REQ));
        let client_id = seen
            .iter()
            .find_map(|m| match m.mad.message {
                CmMessage::Req(r) => Some(r.local_comm_id),
                _ => None,
            })
            .unwrap();
        // A REJ and an MRA of the client's REQ from another address: dropped.
        let before = unmatched();
        let rej = CmMad::new(
            7,
            CmMessage::Rej(cm::Rej {
                local_comm_id: 0x1234,
                remote_comm_id: client_id,
                message_rejected: cm::msg_ref::REQ,
                rejected_info_length: 0,
                reason: cm::rej_reason::CONSUMER_DEFINED,
                ari: [0; cm::REJ_ARI_LEN],
                private_data: [0; cm::REJ_PRIVATE_DATA_LEN],
            }),
        );
        a.send_mad(spoofer, dev_ip, &rej);
        let mra = CmMad::new(
            8,
            CmMessage::Mra(cm::Mra {
                local_comm_id: 0x1234,
                remote_comm_id: client_id,
                message_mraed: cm::msg_ref::REQ,
                service_timeout: 31,
                private_data: [0; cm::MRA_PRIVATE_DATA_LEN],
            }),
        );
        a.send_mad(spoofer, dev_ip, &mra);
        wait_for(|| unmatched() >= before + 2, "spoofed REJ and MRA counted");

        // The server accepts; the connection comes up all the same.
        let s = endpoint(&server);
        l.accept(req.conn_id, &s.qp, &param(b"welcome")).unwrap();
        assert_eq!(c.qp.next_event(T).unwrap().kind, EventKind::Established);
        assert_eq!(s.qp.next_event(T).unwrap().kind, EventKind::Established);
        let seen = watch.until(T, |s| has(s, cm::ATTR_REP));
        let (client_id, server_id, server_qpn) = ids_on_the_wire(&seen);

        // DREQs that name the server's side of it, each wrong in one thing.
        let dreq = |local, remote, qpn| {
            CmMad::new(
                9,
                CmMessage::Dreq(cm::Dreq {
                    local_comm_id: local,
                    remote_comm_id: remote,
                    remote_qpn: qpn,
                    private_data: [0; cm::DREQ_PRIVATE_DATA_LEN],
                }),
            )
        };
        let before = unmatched();
        let wrong: [(Ipv4Addr, CmMad); 3] = [
            (spoofer, dreq(client_id, server_id, server_qpn)),
            (dev_ip, dreq(client_id ^ 0x8000_0000, server_id, server_qpn)),
            (dev_ip, dreq(client_id, server_id, server_qpn ^ 1)),
        ];
        for (src, m) in &wrong {
            a.send_mad(*src, dev_ip, m);
        }
        wait_for(
            || unmatched() >= before + wrong.len() as u64,
            "spoofed DREQs counted",
        );
        send_arrives(&c, &s);
        send_arrives(&s, &c);
        assert!(
            s.qp.events().try_recv().is_err(),
            "no event on the server QP"
        );

        // The genuine article closes it: the checks are not blanket refusals.
        a.send_mad(dev_ip, dev_ip, &dreq(client_id, server_id, server_qpn));
        assert_eq!(s.qp.next_event(T).unwrap().kind, EventKind::Disconnected);
        served(bystander);
    });
}

fn wait_for(cond: impl Fn() -> bool, what: &str) {
    let deadline = std::time::Instant::now() + T;
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "{what}: timed out");
        std::thread::sleep(Duration::from_millis(5));
    }
}
