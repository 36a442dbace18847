//! The connection manager's machine on its own: no socket, thread, device or clock. Two
//! machines answer each other's MADs by hand (`carry`), and time is what the test says.
//!
//! Over 600 lines: tests only.

use super::*;
use crate::random::Seeded;
use crate::wire::cm::{msg_ref, rej_reason, CmMad, CmMessage};
use crate::wire::cma;
use std::collections::VecDeque;
use std::net::Ipv4Addr;

const A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
const B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
const EVE: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 66));
const PORT: u16 = 7471;

/// Values given one by one; none left is the generator failing.
struct Script(VecDeque<u32>);

impl Entropy for Script {
    fn u32(&mut self) -> Result<u32> {
        self.0.pop_front().ok_or(VerbsError::Io)
    }

    fn u64(&mut self) -> Result<u64> {
        self.u32().map(u64::from)
    }
}

fn machine_with(seed: u64, rng: Box<dyn Entropy>) -> Machine {
    let config = Config {
        node_guid: 0x0200_5eff_fe00_0000 | seed,
        max_ird: 16,
        max_ord: 16,
    };
    Machine::new(config, rng)
}

fn machine(seed: u64) -> Machine {
    machine_with(seed, Box::new(Seeded(seed)))
}

fn qp(qpn: u32) -> QpRef {
    QpRef {
        qpn,
        serial: u64::from(qpn) + 1000,
        service: QpType::Rc,
    }
}

fn param(pdata: &[u8]) -> ConnParam {
    ConnParam {
        private_data: pdata.to_vec(),
        ird: 4,
        ord: 4,
    }
}

/// A's consumer connecting `qp` to B's `port`.
fn connect_to(qp: QpRef, port: u16) -> Connect {
    Connect {
        qp,
        state: QpState::Reset,
        peer: SocketAddr::new(B, port),
        src: Ok(A),
        param: param(b"hello"),
        mtu: 4096,
    }
}

/// The MADs `actions` send: (from, to, MAD).
fn sent(actions: &[Action]) -> Vec<(IpAddr, IpAddr, CmMad)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { src, dst, mad } => {
                Some((*src, *dst, CmMad::parse(&mad[..]).expect("a MAD we sent")))
            }
            _ => None,
        })
        .collect()
}

/// The one message `actions` send.
fn one_sent(actions: &[Action]) -> CmMessage {
    match &sent(actions)[..] {
        [(_, _, mad)] => mad.message,
        other => panic!("one MAD expected: {other:?} in {actions:?}"),
    }
}

/// The REJ `actions` send.
fn rej_in(actions: &[Action]) -> cm::Rej {
    match one_sent(actions) {
        CmMessage::Rej(r) => r,
        other => panic!("a REJ expected: {other:?}"),
    }
}

fn counts(actions: &[Action]) -> Vec<Count> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Count(c) => Some(*c),
            _ => None,
        })
        .collect()
}

/// The generation of the (one) connection timer `actions` arm, and when it fires.
fn timer(actions: &[Action]) -> (u64, Instant) {
    let (_, gen, at) = timer_of(actions);
    (gen, at)
}

/// The (one) connection timer `actions` arm: the connection, its generation, when.
fn timer_of(actions: &[Action]) -> (u32, u64, Instant) {
    match &actions
        .iter()
        .filter_map(|a| match a {
            Action::Timer {
                target: Target::Cm(id),
                gen,
                at,
            } => Some((*id, *gen, *at)),
            _ => None,
        })
        .collect::<Vec<_>>()[..]
    {
        [t] => *t,
        other => panic!("one timer expected: {other:?} in {actions:?}"),
    }
}

/// Hand the MADs `actions` send to `to`, as the link would.
fn carry(actions: &[Action], to: &mut Machine, now: Instant) -> Vec<Action> {
    sent(actions)
        .into_iter()
        .flat_map(|(src, dst, mad)| to.on_mad(src, dst, mad, now))
        .collect()
}

/// Machine `a` on A, machine `b` on B listening on PORT.
struct Pair {
    a: Machine,
    b: Machine,
    listener: u64,
    now: Instant,
}

fn pair_with_backlog(backlog: u32) -> Pair {
    let mut b = machine(2);
    let (listener, port) = b
        .listen(Some(B), PORT, backlog, Arc::new(NullSink))
        .unwrap();
    assert_eq!(port, PORT);
    Pair {
        a: machine(1),
        b,
        listener,
        now: Instant::now(),
    }
}

fn pair() -> Pair {
    pair_with_backlog(8)
}

/// A connection set up: B's REP, and the communication IDs of A's and B's ends.
struct Setup {
    rep: Vec<Action>,
    a_id: u32,
    b_id: u32,
}

/// A connects `qa` and B takes the request to the point of accepting it.
fn request(p: &mut Pair, qa: QpRef) -> (Vec<Action>, u32) {
    let req = p.a.connect(connect_to(qa, PORT), p.now).unwrap();
    let offered = carry(&req, &mut p.b, p.now);
    let b_id = offered
        .iter()
        .find_map(|a| match a {
            Action::Offer { id, .. } => Some(*id),
            _ => None,
        })
        .unwrap_or_else(|| panic!("a request offered: {offered:?}"));
    (req, b_id)
}

/// A connects `qa` to B, which accepts onto `qb`; REQ, REP, RTU.
fn establish(p: &mut Pair, qa: QpRef, qb: QpRef) -> Setup {
    let (req, b_id) = request(p, qa);
    let acc =
        p.b.accept(p.listener, b_id.into(), qb, &param(b""), |_| 4096);
    let rep = p.b.accepted(acc.unwrap(), p.now).unwrap();
    let rtu = carry(&rep, &mut p.a, p.now);
    let at_b = carry(&rtu, &mut p.b, p.now);
    assert!(
        matches!(&at_b[..], [Action::Deliver { qp, event }] if *qp == qb && event.kind == EventKind::Established),
        "{at_b:?}"
    );
    let CmMessage::Req(r) = one_sent(&req) else {
        panic!("a REQ")
    };
    Setup {
        rep,
        a_id: r.local_comm_id,
        b_id,
    }
}

/// A UC QP's REQ says UC, and only a UC QP accepts it (an RC QP's REQ only an RC QP):
/// the two ends of a connection must speak the same opcodes.
#[test]
fn a_uc_request_wants_a_uc_qp() {
    let mut p = pair();
    let uc = |qpn| QpRef {
        service: QpType::Uc,
        ..qp(qpn)
    };
    let (req, b_id) = request(&mut p, uc(10));
    let CmMessage::Req(r) = one_sent(&req) else {
        panic!("a REQ: {req:?}")
    };
    assert_eq!(r.transport_service_type, cm::transport_type::UC);
    for wrong in [
        qp(20),
        QpRef {
            service: QpType::Ud,
            ..qp(21)
        },
    ] {
        let refused =
            p.b.accept(p.listener, b_id.into(), wrong, &param(b""), |_| 4096);
        assert_eq!(refused.err(), Some(VerbsError::Invalid), "{wrong:?}");
    }
    let acc =
        p.b.accept(p.listener, b_id.into(), uc(22), &param(b""), |_| 4096);
    assert!(acc.is_ok(), "the request still waits for a UC QP");

    let (_, b_id) = request(&mut p, qp(11));
    let refused =
        p.b.accept(p.listener, b_id.into(), uc(23), &param(b""), |_| 4096);
    assert_eq!(refused.err(), Some(VerbsError::Invalid));
}

#[test]
fn req_rep_rtu_connects_both_sides() {
    let mut p = pair();
    let req = p.a.connect(connect_to(qp(10), PORT), p.now).unwrap();
    let (gen, at) = timer(&req);
    assert_eq!((gen, at), (1, p.now + MAD_RETRY), "the REQ is retried");
    let CmMessage::Req(r) = one_sent(&req) else {
        panic!("a REQ: {req:?}")
    };
    assert_eq!(sent(&req)[0].0, A);
    assert_eq!(sent(&req)[0].1, B);
    assert_eq!(r.local_qpn, 10);
    assert_eq!(r.service_id, cma::service_id_tcp(PORT));
    assert_eq!(r.path_mtu, 5);
    assert_eq!(r.transport_service_type, cm::transport_type::RC);
    assert_eq!(&r.private_data[cma::HEADER_LEN..][..5], b"hello");
    assert_eq!(r.cma_header().unwrap().dst, B);

    // B offers the request to its listener's consumer and looks for expired requests
    // from now on.
    let at_b = carry(&req, &mut p.b, p.now);
    let [Action::Timer {
        target: Target::CmSweep,
        ..
    }, Action::Offer { id, event, .. }] = &at_b[..]
    else {
        panic!("sweep and offer: {at_b:?}")
    };
    assert_eq!(event.kind, EventKind::ConnectRequest);
    assert_eq!(event.conn_id, u64::from(*id));
    assert_eq!(&event.private_data[..5], b"hello");
    assert_eq!((event.ird, event.ord), (4, 4));
    assert_eq!(event.local, Some(SocketAddr::new(B, PORT)));
    assert_eq!(event.peer.map(|a| a.ip()), Some(A));
    assert_eq!(p.b.sizes(), (1, 1));

    // B's consumer accepts onto QP 20: the QP is to come up towards A's QP 10, at the
    // smaller of the REQ's MTU (4096) and that of the link from B's address.
    let acc = p.b.accept(
        p.listener,
        u64::from(*id),
        qp(20),
        &param(b"welcome"),
        |from| if from == B { 1024 } else { 256 },
    );
    let acc = acc.unwrap();
    assert_eq!(acc.link.remote_qpn, 10);
    assert_eq!(acc.link.sq_psn, r.starting_psn);
    assert_eq!((acc.link.peer, acc.link.local), (A, B));
    assert_eq!((acc.link.mtu, acc.link.ird, acc.link.ord), (1024, 4, 4));
    let b_rq_psn = acc.link.rq_psn;
    assert_eq!(p.b.sizes(), (1, 1), "nothing changes before the QP is up");
    let rep = p.b.accepted(acc, p.now).unwrap();
    assert_eq!(p.b.sizes(), (1, 0));
    let CmMessage::Rep(rp) = one_sent(&rep) else {
        panic!("a REP: {rep:?}")
    };
    assert_eq!((rp.local_qpn, rp.remote_comm_id), (20, r.local_comm_id));
    assert_eq!(rp.starting_psn, b_rq_psn);
    assert_eq!(timer(&rep).1, p.now + MAD_RETRY, "the REP is retried");

    // A brings its QP up, sends the RTU and tells its consumer.
    let at_a = carry(&rep, &mut p.a, p.now);
    let [Action::BringUp(up), Action::Send { .. }, Action::Deliver { qp: q, event }] = &at_a[..]
    else {
        panic!("bring-up, RTU, Established: {at_a:?}")
    };
    assert_eq!(up.qp, qp(10));
    assert_eq!((up.id, up.remote_id), (r.local_comm_id, *id));
    let want = Link {
        peer: B,
        local: A,
        remote_qpn: 20,
        rq_psn: r.starting_psn,
        sq_psn: b_rq_psn,
        mtu: 4096,
        ird: 4,
        ord: 4,
    };
    assert_eq!(up.link, want);
    assert!(matches!(one_sent(&at_a), CmMessage::Rtu(_)));
    assert_eq!((*q, event.kind), (qp(10), EventKind::Established));
    assert_eq!(&event.private_data[..7], b"welcome");

    // The RTU establishes B.
    let at_b = carry(&at_a, &mut p.b, p.now);
    assert!(
        matches!(&at_b[..], [Action::Deliver { qp: q, event }] if *q == qp(20) && event.kind == EventKind::Established),
        "{at_b:?}"
    );
    assert_eq!((p.a.sizes(), p.b.sizes()), ((1, 0), (1, 0)));
}

#[test]
fn duplicates_are_answered_again() {
    let mut p = pair();
    let (req, b_id) = request(&mut p, qp(10));
    // The REQ again while the consumer thinks: nothing to say yet.
    assert!(carry(&req, &mut p.b, p.now).is_empty());
    assert_eq!(p.b.sizes(), (1, 1));
    let acc =
        p.b.accept(p.listener, b_id.into(), qp(20), &param(b""), |_| 4096);
    let rep = p.b.accepted(acc.unwrap(), p.now).unwrap();
    // The REQ again once answered: the same REP again.
    assert_eq!(sent(&carry(&req, &mut p.b, p.now)), sent(&rep));
    let rtu = carry(&rep, &mut p.a, p.now);
    // The REP again (our RTU was lost): the same RTU again, nothing else.
    let again = carry(&rep, &mut p.a, p.now);
    assert_eq!(again.len(), 1);
    assert_eq!(sent(&again), sent(&rtu));
    // The RTU twice: established once, and the second is no stranger's.
    assert_eq!(carry(&rtu, &mut p.b, p.now).len(), 1);
    assert!(carry(&rtu, &mut p.b, p.now).is_empty());
    // A DREQ twice: a DREP each time; the second names no connection any more.
    let dreq = p.a.disconnect(qp(10), true, false, p.now).unwrap();
    let first = carry(&dreq, &mut p.b, p.now);
    let second = carry(&dreq, &mut p.b, p.now);
    assert!(matches!(one_sent(&first), CmMessage::Drep(_)));
    assert_eq!(sent(&first), sent(&second));
    assert!(first
        .iter()
        .any(|a| matches!(a, Action::Closed { qp: q, .. } if *q == qp(20))));
    assert_eq!(counts(&second), [Count::Unmatched]);
}

#[test]
fn a_consumer_reject_reaches_the_active_side() {
    let mut p = pair();
    let (_, b_id) = request(&mut p, qp(10));
    let rej = p.b.reject(p.listener, b_id.into(), b"not now").unwrap();
    let r = rej_in(&rej);
    assert_eq!(r.reason, rej_reason::CONSUMER_DEFINED);
    assert_eq!(r.message_rejected, msg_ref::REQ);
    assert_eq!(&r.private_data[..7], b"not now");
    let at_a = carry(&rej, &mut p.a, p.now);
    let [Action::Fail { qp: q, event }] = &at_a[..] else {
        panic!("{at_a:?}")
    };
    assert_eq!(
        (*q, event.kind, event.status),
        (qp(10), EventKind::Rejected, libc::ECONNREFUSED)
    );
    assert_eq!(&event.private_data[..7], b"not now");
    assert_eq!((p.a.sizes(), p.b.sizes()), ((0, 0), (0, 0)));
}

#[test]
fn a_request_for_no_listener_is_refused() {
    let mut p = pair();
    let req = p.a.connect(connect_to(qp(10), PORT + 1), p.now).unwrap();
    let at_b = carry(&req, &mut p.b, p.now);
    let r = rej_in(&at_b);
    assert_eq!(r.reason, rej_reason::INVALID_SERVICE_ID);
    assert_eq!(p.b.sizes(), (0, 0), "no state kept for it");
    let at_a = carry(&at_b, &mut p.a, p.now);
    assert!(
        matches!(&at_a[..], [Action::Fail { qp: q, event }] if *q == qp(10) && event.kind == EventKind::Unreachable),
        "{at_a:?}"
    );
    assert_eq!(p.a.sizes(), (0, 0));
}

#[test]
fn an_unanswered_req_is_retried_then_given_up() {
    let mut p = pair();
    let req = p.a.connect(connect_to(qp(10), PORT), p.now).unwrap();
    let CmMessage::Req(r) = one_sent(&req) else {
        panic!("a REQ")
    };
    let id = r.local_comm_id;
    let (mut gen, mut at) = timer(&req);
    let mut retries = 0;
    loop {
        let out = p.a.on_timer(id, gen, false, at);
        if counts(&out) != [Count::Retry] {
            // Given up: a REJ (timeout, our CA GUID) lets the passive side forget it.
            let rej = rej_in(&out);
            assert_eq!(rej.reason, rej_reason::TIMEOUT);
            assert_eq!(rej.local_comm_id, id);
            assert_eq!(rej.ari[..8], p.a.config.node_guid.to_be_bytes());
            let fail = out.iter().find_map(|a| match a {
                Action::Fail { qp: q, event } => Some((*q, event.kind, event.status)),
                _ => None,
            });
            assert_eq!(
                fail,
                Some((qp(10), EventKind::Unreachable, libc::ETIMEDOUT))
            );
            break;
        }
        assert_eq!(sent(&out), sent(&req), "the same REQ again");
        assert!(p.a.on_timer(id, gen, false, at).is_empty(), "a stale timer");
        retries += 1;
        if retries == 5 {
            // The peer asks for more time: the count starts again.
            let mra = CmMessage::Mra(cm::Mra {
                local_comm_id: 77,
                remote_comm_id: id,
                message_mraed: 0,
                service_timeout: 20,
                private_data: [0; cm::MRA_PRIVATE_DATA_LEN],
            });
            assert!(p.a.on_mad(B, A, CmMad::new(1, mra), at).is_empty());
        }
        (gen, at) = timer(&out);
    }
    assert_eq!(retries, MAD_RETRIES + 5);
    assert_eq!(p.a.sizes(), (0, 0));
}

#[test]
fn an_unanswered_rep_breaks_the_connection() {
    let mut p = pair();
    let (_, b_id) = request(&mut p, qp(10));
    let acc =
        p.b.accept(p.listener, b_id.into(), qp(20), &param(b""), |_| 4096);
    let rep = p.b.accepted(acc.unwrap(), p.now).unwrap();
    let (mut gen, mut at) = timer(&rep);
    for _ in 0..MAD_RETRIES {
        let out = p.b.on_timer(b_id, gen, false, at);
        assert_eq!(sent(&out), sent(&rep));
        (gen, at) = timer(&out);
    }
    let out = p.b.on_timer(b_id, gen, false, at);
    assert!(
        matches!(&out[..], [Action::Closed { qp: q, kind: EventKind::ConnectionBroken }] if *q == qp(20)),
        "{out:?}"
    );
    assert_eq!(p.b.sizes(), (0, 0));
}

#[test]
fn an_orderly_close_waits_for_the_send_queue() {
    let mut p = pair();
    let s = establish(&mut p, qp(10), qp(20));
    let out = p.a.disconnect(qp(10), false, true, p.now).unwrap();
    let (gen, at) = timer(&out);
    assert_eq!(out.len(), 1, "only a look at the send queue later: {out:?}");
    assert_eq!(p.a.draining_qp(s.a_id), Some(qp(10)));
    assert_eq!(
        p.a.disconnect(qp(10), false, true, p.now).err(),
        Some(VerbsError::BadState)
    );
    // Still busy: look again.
    let out = p.a.on_timer(s.a_id, gen, true, at);
    let (gen, at) = timer(&out);
    assert_eq!(out.len(), 1);
    // Drained: the QP goes to Error and the DREQ goes out.
    let dreq = p.a.on_timer(s.a_id, gen, false, at);
    assert!(
        matches!(dreq[1], Action::QpError(q) if q == qp(10)),
        "{dreq:?}"
    );
    let CmMessage::Dreq(d) = one_sent(&dreq) else {
        panic!("a DREQ: {dreq:?}")
    };
    assert_eq!(
        (d.local_comm_id, d.remote_comm_id, d.remote_qpn),
        (s.a_id, s.b_id, 20)
    );
    let at_b = carry(&dreq, &mut p.b, at);
    assert!(matches!(one_sent(&at_b), CmMessage::Drep(_)));
    assert!(
        matches!(at_b[1], Action::Closed { qp: q, kind: EventKind::Disconnected } if q == qp(20)),
        "{at_b:?}"
    );
    let at_a = carry(&at_b, &mut p.a, at);
    assert!(
        matches!(&at_a[..], [Action::Closed { qp: q, kind: EventKind::Disconnected }] if *q == qp(10)),
        "{at_a:?}"
    );
    assert_eq!((p.a.sizes(), p.b.sizes()), ((0, 0), (0, 0)));
}

#[test]
fn an_abortive_close_sends_the_dreq_at_once_and_ends_even_unanswered() {
    let mut p = pair();
    let s = establish(&mut p, qp(10), qp(20));
    // Busy or not, an abortive close does not wait.
    let dreq = p.a.disconnect(qp(10), true, true, p.now).unwrap();
    assert!(matches!(one_sent(&dreq), CmMessage::Dreq(_)));
    let (mut gen, mut at) = timer(&dreq);
    for _ in 0..3 {
        let out = p.a.on_timer(s.a_id, gen, false, at);
        assert_eq!(sent(&out), sent(&dreq));
        (gen, at) = timer(&out);
    }
    let out = p.a.on_timer(s.a_id, gen, false, at);
    assert!(
        matches!(&out[..], [Action::Closed { qp: q, kind: EventKind::Disconnected }] if *q == qp(10)),
        "{out:?}"
    );
    assert_eq!(p.a.sizes(), (0, 0));
}

#[test]
fn closing_an_attempt_forgets_it() {
    let mut p = pair();
    p.a.connect(connect_to(qp(10), PORT), p.now).unwrap();
    assert!(p
        .a
        .disconnect(qp(10), false, false, p.now)
        .unwrap()
        .is_empty());
    assert_eq!(p.a.sizes(), (0, 0));
    assert_eq!(
        p.a.disconnect(qp(10), true, false, p.now).err(),
        Some(VerbsError::BadState)
    );
}

#[test]
fn messages_from_elsewhere_or_with_other_ids_are_dropped() {
    let mut p = pair();
    let s = establish(&mut p, qp(10), qp(20));
    let dreq = |local_comm_id, remote_comm_id, remote_qpn| {
        CmMad::new(
            9,
            CmMessage::Dreq(cm::Dreq {
                local_comm_id,
                remote_comm_id,
                remote_qpn,
                private_data: [0; cm::DREQ_PRIVATE_DATA_LEN],
            }),
        )
    };
    for (from, mad) in [
        (EVE, dreq(s.b_id, s.a_id, 10)),
        (B, dreq(s.b_id + 1, s.a_id, 10)),
        (B, dreq(s.b_id, s.a_id, 11)),
    ] {
        let out = p.a.on_mad(from, A, mad, p.now);
        // Answered (the DREP says nothing), counted, and the connection lives on.
        assert!(matches!(one_sent(&out), CmMessage::Drep(_)));
        assert_eq!(sent(&out)[0].1, from);
        assert_eq!(counts(&out), [Count::Unmatched], "{out:?}");
    }
    let rej = CmMessage::Rej(cm::Rej {
        local_comm_id: s.b_id,
        remote_comm_id: s.a_id,
        message_rejected: msg_ref::OTHER,
        rejected_info_length: 0,
        reason: rej_reason::CONSUMER_DEFINED,
        ari: [0; cm::REJ_ARI_LEN],
        private_data: [0; cm::REJ_PRIVATE_DATA_LEN],
    });
    let rtu = CmMessage::Rtu(cm::Rtu {
        local_comm_id: s.a_id + 1,
        remote_comm_id: s.b_id,
        private_data: [0; cm::RTU_PRIVATE_DATA_LEN],
    });
    let mra = CmMessage::Mra(cm::Mra {
        local_comm_id: s.b_id + 1,
        remote_comm_id: s.a_id,
        message_mraed: 0,
        service_timeout: 20,
        private_data: [0; cm::MRA_PRIVATE_DATA_LEN],
    });
    let CmMessage::Rep(rep) = one_sent(&s.rep) else {
        panic!("a REP")
    };
    for (to_b, from, msg) in [
        (false, EVE, rej),
        (true, A, rtu),
        (false, EVE, CmMessage::Rep(rep)),
        (false, B, mra),
    ] {
        let (to, dst) = if to_b { (&mut p.b, B) } else { (&mut p.a, A) };
        let out = to.on_mad(from, dst, CmMad::new(9, msg), p.now);
        assert_eq!(counts(&out), [Count::Unmatched], "{msg:?}: {out:?}");
        assert!(sent(&out).is_empty());
    }
    assert_eq!((p.a.sizes(), p.b.sizes()), ((1, 0), (1, 0)));
    // The real DREQ still closes.
    let out = p.a.on_mad(B, A, dreq(s.b_id, s.a_id, 10), p.now);
    assert!(out.iter().any(|a| matches!(a, Action::Closed { .. })));
    assert_eq!(p.a.sizes(), (0, 0));
}

#[test]
fn a_rep_naming_an_id_in_use_is_refused_as_stale() {
    let mut p = pair();
    let first = establish(&mut p, qp(10), qp(20));
    let (req, _) = request(&mut p, qp(11));
    let CmMessage::Req(r) = one_sent(&req) else {
        panic!("a REQ")
    };
    // A REP to the second attempt with the ID of B's first connection.
    let CmMessage::Rep(mut rep) = one_sent(&first.rep) else {
        panic!("a REP")
    };
    rep.remote_comm_id = r.local_comm_id;
    let out = p.a.on_mad(B, A, CmMad::new(5, CmMessage::Rep(rep)), p.now);
    let rej = rej_in(&out);
    assert_eq!(
        (rej.reason, rej.message_rejected),
        (rej_reason::STALE_CONN, msg_ref::REP)
    );
    assert_eq!(
        (rej.local_comm_id, rej.remote_comm_id),
        (r.local_comm_id, first.b_id)
    );
    assert!(
        out.iter()
            .any(|a| matches!(a, Action::Fail { qp: q, .. } if *q == qp(11))),
        "{out:?}"
    );
    assert_eq!(p.a.sizes(), (1, 0), "the first connection stays");
}

#[test]
fn a_qp_that_does_not_come_up_fails_the_attempt() {
    let mut p = pair();
    let (_, b_id) = request(&mut p, qp(10));
    let acc =
        p.b.accept(p.listener, b_id.into(), qp(20), &param(b""), |_| 4096);
    let rep = p.b.accepted(acc.unwrap(), p.now).unwrap();
    let at_a = carry(&rep, &mut p.a, p.now);
    let Action::BringUp(up) = at_a[0] else {
        panic!("{at_a:?}")
    };
    let out = p.a.bring_up_failed(&up);
    let rej = rej_in(&out);
    assert_eq!(
        (rej.reason, rej.message_rejected),
        (rej_reason::NO_RESOURCES, msg_ref::REP)
    );
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (up.id, b_id));
    assert!(matches!(
        &out[1],
        Action::Fail { qp: q, event } if *q == qp(10) && event.kind == EventKind::Unreachable
    ));
    assert_eq!(p.a.sizes(), (0, 0));
    // B's REP was refused: its attempt fails too.
    let at_b = carry(&out, &mut p.b, p.now);
    assert!(
        matches!(&at_b[..], [Action::Fail { qp: q, .. }] if *q == qp(20)),
        "{at_b:?}"
    );
    assert_eq!(p.b.sizes(), (0, 0));
}

#[test]
fn a_full_backlog_pushes_out_the_oldest_request() {
    let mut p = pair_with_backlog(2);
    let ms = Duration::from_millis(1);
    let (first, first_b) = request(&mut p, qp(10));
    p.now += ms;
    request(&mut p, qp(11));
    p.now += ms;
    let req = p.a.connect(connect_to(qp(12), PORT), p.now).unwrap();
    let at_b = carry(&req, &mut p.b, p.now);
    assert_eq!(counts(&at_b), [Count::ReqEvicted]);
    let CmMessage::Req(r) = one_sent(&first) else {
        panic!("a REQ")
    };
    let rej = rej_in(&at_b);
    assert_eq!(
        (rej.reason, rej.remote_comm_id),
        (rej_reason::NO_RESOURCES, r.local_comm_id)
    );
    assert!(at_b.iter().any(|a| matches!(a, Action::Offer { .. })));
    assert_eq!(p.b.sizes(), (2, 2));
    assert_eq!(
        p.b.accept(p.listener, first_b.into(), qp(20), &param(b""), |_| 4096)
            .err(),
        Some(VerbsError::NoSuchResource)
    );
    // The evicted client hears of it.
    let at_a = carry(&at_b, &mut p.a, p.now);
    assert!(
        matches!(&at_a[..], [Action::Fail { qp: q, .. }] if *q == qp(10)),
        "{at_a:?}"
    );
}

#[test]
fn unanswered_requests_expire() {
    let mut p = pair();
    let req = p.a.connect(connect_to(qp(10), PORT), p.now).unwrap();
    let at_b = carry(&req, &mut p.b, p.now);
    let Action::Timer {
        target: Target::CmSweep,
        gen,
        at,
    } = at_b[0]
    else {
        panic!("{at_b:?}")
    };
    // Not yet: looked at again a second later.
    let out = p.b.on_sweep(gen, at);
    assert!(
        matches!(&out[..], [Action::Timer { target: Target::CmSweep, gen: g, .. }] if *g == gen + 1),
        "{out:?}"
    );
    assert!(p.b.on_sweep(gen, at).is_empty(), "a stale sweep");
    // rdma_cm's patience is more than a minute: we keep a request 60 s at most.
    let late = p.now + Duration::from_secs(61);
    let out = p.b.on_sweep(gen + 1, late);
    assert_eq!(counts(&out), [Count::ReqExpired]);
    assert_eq!(rej_in(&out).reason, rej_reason::CONSUMER_DEFINED);
    assert_eq!(out.len(), 2, "no sweep while nothing waits: {out:?}");
    assert_eq!(p.b.sizes(), (0, 0));
}

#[test]
fn a_request_belongs_to_the_listener_it_came_to() {
    let mut p = pair();
    let (other, _) = p.b.listen(None, PORT + 1, 8, Arc::new(NullSink)).unwrap();
    let (_, id) = request(&mut p, qp(10));
    let id = u64::from(id);
    let none = Some(VerbsError::NoSuchResource);
    assert_eq!(
        p.b.accept(other, id, qp(20), &param(b""), |_| 4096).err(),
        none
    );
    assert_eq!(p.b.reject(other, id, b"").err(), none);
    assert_eq!(
        p.b.accept(p.listener, id + (1 << 32), qp(20), &param(b""), |_| 4096)
            .err(),
        none
    );
    let long = param(&[0; cm::REP_PRIVATE_DATA_LEN + 1]);
    assert_eq!(
        p.b.accept(p.listener, id, qp(20), &long, |_| 4096).err(),
        Some(VerbsError::Invalid)
    );
    let acc = p.b.accept(p.listener, id, qp(20), &param(b""), |_| 4096);
    p.b.accepted(acc.unwrap(), p.now).unwrap();
    let bad = Some(VerbsError::BadState);
    assert_eq!(
        p.b.accept(p.listener, id, qp(21), &param(b""), |_| 4096)
            .err(),
        bad
    );
    assert_eq!(p.b.reject(p.listener, id, b"").err(), bad);
    // A QP that has a connection takes no second one.
    let (_, id2) = request(&mut p, qp(11));
    assert_eq!(
        p.b.accept(p.listener, id2.into(), qp(20), &param(b""), |_| 4096)
            .err(),
        bad
    );
}

#[test]
fn a_request_the_consumer_has_no_room_for_is_refused() {
    let mut p = pair();
    let (req, id) = request(&mut p, qp(10));
    let CmMessage::Req(r) = one_sent(&req) else {
        panic!("a REQ")
    };
    let out = p.b.offer_refused(id);
    assert_eq!(counts(&out), [Count::ReqRefused]);
    let rej = rej_in(&out);
    assert_eq!(
        (rej.reason, rej.local_comm_id, rej.remote_comm_id),
        (rej_reason::NO_RESOURCES, 0, r.local_comm_id)
    );
    assert_eq!(p.b.sizes(), (0, 0));
}

#[test]
fn a_closed_listener_refuses_what_waits_and_what_comes() {
    let mut p = pair();
    request(&mut p, qp(10));
    let out = p.b.close_listener(p.listener);
    assert_eq!(rej_in(&out).reason, rej_reason::CONSUMER_DEFINED);
    assert_eq!(p.b.sizes(), (0, 0));
    let req = p.a.connect(connect_to(qp(11), PORT), p.now).unwrap();
    let at_b = carry(&req, &mut p.b, p.now);
    assert_eq!(rej_in(&at_b).reason, rej_reason::INVALID_SERVICE_ID);
}

#[test]
fn connect_checks_before_it_sends() {
    let mut p = pair();
    let mut r = connect_to(qp(10), PORT);
    r.param.private_data = vec![0; REQ_PDATA_MAX + 1];
    assert_eq!(p.a.connect(r, p.now).err(), Some(VerbsError::Invalid));
    let mut r = connect_to(qp(10), PORT);
    r.state = QpState::Rts;
    assert_eq!(p.a.connect(r, p.now).err(), Some(VerbsError::BadState));
    let mut r = connect_to(qp(10), PORT);
    r.src = Err(VerbsError::Unreachable);
    assert_eq!(p.a.connect(r, p.now).err(), Some(VerbsError::Unreachable));
    p.a.connect(connect_to(qp(10), PORT), p.now).unwrap();
    assert_eq!(
        p.a.connect(connect_to(qp(10), PORT), p.now).err(),
        Some(VerbsError::BadState),
        "one connection per QP"
    );
    // A later QP that got the same number is another QP.
    let reused = QpRef {
        serial: 1,
        ..qp(10)
    };
    assert!(p.a.connect(connect_to(reused, PORT), p.now).is_ok());
    // No randomness, no connection (never a predictable ID instead).
    let mut broken = machine_with(3, Box::new(Script(VecDeque::new())));
    let r = connect_to(qp(10), PORT);
    assert_eq!(broken.connect(r, p.now).err(), Some(VerbsError::Io));
    assert_eq!(broken.sizes(), (0, 0));
}

#[test]
fn communication_ids_are_drawn_never_zero_never_in_use() {
    // Per connect: the ID (drawn until usable), the PSN, the rdma_cm port, the TID.
    let draws = [0, 7, 1, 2, 3, 7, 9, 4, 5, 6];
    let mut m = machine_with(4, Box::new(Script(draws.into())));
    let now = Instant::now();
    let mut ids = Vec::new();
    for n in [10, 11] {
        let out = m.connect(connect_to(qp(n), PORT), now).unwrap();
        let CmMessage::Req(r) = one_sent(&out) else {
            panic!("a REQ")
        };
        ids.push(r.local_comm_id);
    }
    assert_eq!(ids, [7, 9]);
}

#[test]
fn listeners_share_no_address() {
    let mut m = machine(5);
    let sink = || -> Arc<dyn EventSink> { Arc::new(NullSink) };
    m.listen(Some(A), PORT, 1, sink()).unwrap();
    m.listen(Some(B), PORT, 1, sink()).unwrap();
    let in_use = Some(VerbsError::AddrInUse);
    assert_eq!(m.listen(Some(A), PORT, 1, sink()).err(), in_use);
    assert_eq!(m.listen(None, PORT, 1, sink()).err(), in_use);
    m.listen(None, PORT + 1, 1, sink()).unwrap();
    assert_eq!(m.listen(Some(B), PORT + 1, 1, sink()).err(), in_use);
    let (_, picked) = m.listen(None, 0, 1, sink()).unwrap();
    assert!(picked & 0xc000 == 0x8000, "{picked:#x}");
}

/// A's UD QP `qa` (in RTS) resolving B's UD service on `port`.
fn resolve_at(qa: QpRef, port: u16) -> Connect {
    Connect {
        state: QpState::Rts,
        param: param(b"ud"),
        ..connect_to(qa, port)
    }
}

/// The one event `actions` deliver to a QP.
fn delivered(actions: &[Action]) -> (QpRef, Event) {
    match &actions
        .iter()
        .filter_map(|a| match a {
            Action::Deliver { qp, event } => Some((*qp, event.clone())),
            _ => None,
        })
        .collect::<Vec<_>>()[..]
    {
        [d] => d.clone(),
        other => panic!("one event expected: {other:?} in {actions:?}"),
    }
}

#[test]
fn sidr_resolves_a_ud_service() {
    let mut p = pair();
    let (qa, qb) = (qp(0x11), qp(0x22));
    // Only a QP in RTS resolves; the REQ carries the UDP port space's service ID.
    let not_ready = Connect {
        state: QpState::Init,
        ..resolve_at(qa, PORT)
    };
    assert_eq!(
        p.a.resolve(not_ready, p.now).err(),
        Some(VerbsError::BadState)
    );
    let req = p.a.resolve(resolve_at(qa, PORT), p.now).unwrap();
    let (_, _, mad) = sent(&req)[0];
    let CmMessage::SidrReq(r) = mad.message else {
        panic!("a SIDR_REQ")
    };
    assert_eq!(r.service_id, cma::service_id_udp(PORT));
    assert_eq!(&r.private_data[cma::HEADER_LEN..cma::HEADER_LEN + 2], b"ud");
    // B offers it as a UD request; a retry meanwhile is not offered twice.
    let offered = carry(&req, &mut p.b, p.now);
    let Some((id, event)) = offered.iter().find_map(|a| match a {
        Action::Offer { id, event, .. } => Some((*id, event.clone())),
        _ => None,
    }) else {
        panic!("offered: {offered:?}")
    };
    assert_eq!(event.ud, Some(UdPeer::default()));
    assert_eq!(&event.private_data[..2], b"ud");
    assert!(carry(&req, &mut p.b, p.now).is_empty());
    // An RC accept is refused; the UD accept answers with the QP and Q_Key, in the
    // request's transaction.
    assert!(p
        .b
        .accept(p.listener, id.into(), qb, &param(b""), |_| 4096)
        .is_err());
    let rep =
        p.b.accept_ud(p.listener, id.into(), (qb, 0x0123_4567), b"ok", p.now)
            .unwrap();
    let (_, _, rep_mad) = sent(&rep)[0];
    assert_eq!(rep_mad.transaction_id, mad.transaction_id);
    let at_a = carry(&rep, &mut p.a, p.now);
    let (to, ev) = delivered(&at_a);
    assert_eq!(to, qa);
    assert_eq!(ev.kind, EventKind::Established);
    assert_eq!(
        ev.ud,
        Some(UdPeer {
            qpn: 0x22,
            qkey: 0x0123_4567
        })
    );
    assert_eq!(&ev.private_data[..2], b"ok");
    // The answer ended the requester's state: a repeated SIDR_REP is of nothing.
    assert!(counts(&carry(&rep, &mut p.a, p.now)).contains(&Count::Unmatched));
    assert_eq!(p.a.sizes(), (0, 0));
    // A retry of the SIDR_REQ that crossed the answer gets the same answer, not a
    // second request; the kept answer goes after a while.
    let again = carry(&req, &mut p.b, p.now);
    assert_eq!(sent(&again)[0].2, rep_mad, "the same SIDR_REP");
    assert!(!again.iter().any(|a| matches!(a, Action::Offer { .. })));
    assert_eq!(p.b.sizes(), (1, 0), "kept, waiting for nobody");
    let (kept, gen, at) = timer_of(&rep);
    assert!(p.b.on_timer(kept, gen, false, at).is_empty());
    assert_eq!(p.b.sizes(), (0, 0));
}

#[test]
fn sidr_refusals() {
    let mut p = pair();
    let qa = qp(0x11);
    // Nobody serves the port: answered at once, Unreachable.
    let req = p.a.resolve(resolve_at(qa, PORT + 1), p.now).unwrap();
    let rep = carry(&req, &mut p.b, p.now);
    let CmMessage::SidrRep(r) = one_sent(&rep) else {
        panic!("a SIDR_REP")
    };
    assert_eq!(r.status, cm::sidr_status::UNSUPPORTED);
    let (_, ev) = delivered(&carry(&rep, &mut p.a, p.now));
    assert_eq!(ev.kind, EventKind::Unreachable);
    // The consumer rejects, with private data.
    let req = p.a.resolve(resolve_at(qa, PORT), p.now).unwrap();
    let id = carry(&req, &mut p.b, p.now)
        .iter()
        .find_map(|a| match a {
            Action::Offer { id, .. } => Some(*id),
            _ => None,
        })
        .unwrap();
    let rej = p.b.reject(p.listener, id.into(), b"busy").unwrap();
    let (_, ev) = delivered(&carry(&rej, &mut p.a, p.now));
    assert_eq!(ev.kind, EventKind::Rejected);
    assert_eq!(&ev.private_data[..4], b"busy");
    // Nobody answers: retried, then Unreachable (ETIMEDOUT); the QP is not failed.
    let mut out = p.a.resolve(resolve_at(qa, PORT), p.now).unwrap();
    let mut sends = 0;
    loop {
        sends += sent(&out).len();
        if out.iter().any(|a| matches!(a, Action::Deliver { .. })) {
            break;
        }
        let (id, gen, now) = timer_of(&out);
        out = p.a.on_timer(id, gen, false, now);
    }
    assert_eq!(sends as u32, MAD_RETRIES + 1);
    let (to, ev) = delivered(&out);
    assert_eq!(
        (to, ev.kind, ev.status),
        (qa, EventKind::Unreachable, libc::ETIMEDOUT)
    );
    assert!(!out
        .iter()
        .any(|a| matches!(a, Action::Fail { .. } | Action::QpError(_))));
}

#[test]
fn a_waiting_sidr_request_expires_with_a_reject() {
    let mut p = pair();
    let req = p.a.resolve(resolve_at(qp(0x11), PORT), p.now).unwrap();
    let offered = carry(&req, &mut p.b, p.now);
    let Some(Action::Timer {
        target: Target::CmSweep,
        gen,
        ..
    }) = offered.iter().find(|a| {
        matches!(
            a,
            Action::Timer {
                target: Target::CmSweep,
                ..
            }
        )
    })
    else {
        panic!("a sweep armed: {offered:?}")
    };
    let later = p.now + Duration::from_secs(11);
    let swept = p.b.on_sweep(*gen, later);
    assert!(counts(&swept).contains(&Count::ReqExpired));
    let CmMessage::SidrRep(r) = one_sent(&swept) else {
        panic!("a SIDR_REP")
    };
    assert_eq!(r.status, cm::sidr_status::REJECT);
}
