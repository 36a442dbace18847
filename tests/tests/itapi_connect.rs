//! IT-API connection management over siw0 and rxe0, both front doors: connect/accept/
//! reject with private data, endpoint states, graceful and abortive disconnect in both
//! directions.

#[macro_use]
mod itapi_common;

use itapi_common::*;
use krdma_itapi::*;

itapi_tests! {
    fn itapi_connect_accept_with_private_data(case) {
        let s = Side::new(case, EpAttributes::default(), 4096);
        let c = Side::new(case, EpAttributes::default(), 4096);
        let l = Listening::new(&s);
        assert_eq!(c.ep.state(), EpState::Unconnected);
        c.ep.connect(l.addr(), b"hello from the client").unwrap();
        assert!(matches!(
            c.ep.state(),
            EpState::Active1ConnectionPending | EpState::Connected
        ));
        assert_eq!(c.ep.connect(l.addr(), b""), Err(Error::InvalidEpState));

        let r = l.request();
        assert_eq!(
            r.private_data,
            as_received(&s.ia, b"hello from the client", Pdata::Connect)
        );
        assert_eq!(r.port, l.listener.port());
        // Both endpoints are on the same adapter: the request comes from its address.
        assert_eq!(r.source.unwrap().ip(), l.addr().ip());
        s.ep.accept(r.cn_est_id, b"welcome").unwrap();
        assert!(matches!(
            s.ep.state(),
            EpState::PassiveConnectionPending | EpState::Connected
        ));
        // A request is answered once.
        assert_eq!(r.cn_est_id.reject(b""), Err(Error::InvalidCnEstId));

        let se = s.conn_event();
        assert_eq!(se.kind, ConnEventKind::Established);
        assert!(
            se.private_data.is_empty(),
            "passive side gets no private data"
        );
        let ce = c.conn_event();
        assert_eq!(ce.kind, ConnEventKind::Established);
        assert_eq!(ce.private_data, as_received(&c.ia, b"welcome", Pdata::Accept));
        assert!(ce.ird >= 1 && ce.ord >= 1);
        assert_eq!(ce.ep.endpoint().unwrap().id(), c.ep.id());
        assert_eq!(
            (s.ep.state(), c.ep.state()),
            (EpState::Connected, EpState::Connected)
        );
        assert_eq!(c.ep.query().peer, Some(l.addr()));
        // Accepting on a connected endpoint is refused.
        assert_eq!(s.ep.accept(r.cn_est_id, b""), Err(Error::InvalidCnEstId));
    }

    fn itapi_reject_with_private_data(case) {
        let s = Side::new(case, EpAttributes::default(), 4096);
        let c = Side::new(case, EpAttributes::default(), 4096);
        let l = Listening::new(&s);
        c.ep.connect(l.addr(), b"may I?").unwrap();
        let r = l.request();
        assert_eq!(r.private_data, as_received(&s.ia, b"may I?", Pdata::Connect));
        r.cn_est_id.reject(b"no, sorry").unwrap();
        let ce = c.conn_event();
        assert_eq!(ce.kind, ConnEventKind::PeerReject);
        assert_eq!(ce.private_data, as_received(&c.ia, b"no, sorry", Pdata::Reject));
        assert_eq!(c.ep.state(), EpState::NonOperational);
        // The passive endpoint was never used and can still accept another request.
        assert_eq!(s.ep.accept(r.cn_est_id, b""), Err(Error::InvalidCnEstId));
        assert_eq!(s.ep.state(), EpState::Unconnected);
    }

    fn itapi_connect_without_listener_is_rejected(case) {
        let c = Side::new(case, EpAttributes::default(), 4096);
        // A port nobody listens on (bound and closed at once; on rxe0 the RDMA CM's
        // port space holds only this test's listeners, and there are none).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        c.ep.connect(addr_of(&c.ia, port), b"anyone?").unwrap();
        let ce = c.conn_event();
        // No consumer answered: a non-peer reject on both transports (siw: the TCP
        // connection is refused; rxe: the IB CM's REJ "invalid service ID").
        assert_eq!(ce.kind, ConnEventKind::NonPeerReject, "{ce:?}");
        assert!(ce.private_data.is_empty());
        assert_eq!(c.ep.state(), EpState::NonOperational);
        assert_eq!(
            c.ep.post_send(&[], 1, DtoFlags::SIGNALED),
            Ok(()),
            "posting after failure flushes"
        );
        assert_eq!(c.dto_event().status, DtoStatus::Flushed);
    }

    fn itapi_private_data_limits(case) {
        let s = Side::new(case, EpAttributes::default(), 4096);
        let c = Side::new(case, EpAttributes::default(), 4096);
        let (connect, accept, reject) = c.ia.private_data_limits();
        let want = if case.iwarp() {
            (508, 508, 508) // MPA: 512 less the enhanced request's IRD/ORD words
        } else {
            (56, 196, 148) // CM REQ less the RDMA CM header, REP, REJ
        };
        assert_eq!((connect, accept, reject), want);
        let info = c.ia.query();
        assert_eq!(
            (
                info.connect_private_data_len,
                info.accept_private_data_len,
                info.reject_private_data_len
            ),
            want
        );
        let l = Listening::new(&s);
        let too_long = vec![0u8; connect + 1];
        assert_eq!(
            c.ep.connect(l.addr(), &too_long),
            Err(Error::InvalidPdataLength)
        );
        assert_eq!(c.ep.state(), EpState::Unconnected);
        // The largest private data goes through whole, both ways.
        let offer: Vec<u8> = (0..connect).map(|i| i as u8 | 1).collect();
        c.ep.connect(l.addr(), &offer).unwrap();
        let r = l.request();
        assert_eq!(r.private_data, offer);
        assert_eq!(
            s.ep.accept(r.cn_est_id, &vec![1; accept + 1]),
            Err(Error::InvalidPdataLength),
            "checked before the request is taken"
        );
        let answer: Vec<u8> = (0..accept).map(|i| (i as u8).wrapping_mul(7) | 1).collect();
        s.ep.accept(r.cn_est_id, &answer).unwrap();
        assert_eq!(s.conn_event().kind, ConnEventKind::Established);
        let ce = c.conn_event();
        assert_eq!(ce.kind, ConnEventKind::Established);
        assert_eq!(ce.private_data, answer);
        // A reject's limit.
        let d = Side::new(case, EpAttributes::default(), 4096);
        d.ep.connect(l.addr(), b"").unwrap();
        let r = l.request();
        assert_eq!(
            r.cn_est_id.reject(&vec![2; reject + 1]),
            Err(Error::InvalidPdataLength)
        );
    }

    fn itapi_graceful_disconnect_by_client(case) {
        let (s, c) = pair(case, EpAttributes::default(), 4096);
        graceful(&c, &s);
    }

    fn itapi_graceful_disconnect_by_server(case) {
        let (s, c) = pair(case, EpAttributes::default(), 4096);
        graceful(&s, &c);
    }

    fn itapi_abortive_disconnect(case) {
        let (s, c) = pair(case, EpAttributes::default(), 4096);
        s.ep.post_recv(&[s.seg(0, 64)], 1, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_recv(&[c.seg(0, 64)], 2, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.abort().unwrap();
        // The peer sees the connection end at once, having lost no work of its own:
        // on InfiniBand as an ordinary disconnect (IB has no abortive close: a DREQ);
        // siw closes an aborted connection with a FIN too, but a reset would be as
        // right (Broken).
        let (peer, me) = (s.conn_event().kind, c.conn_event().kind);
        if case.iwarp() {
            let ended = [ConnEventKind::Disconnect, ConnEventKind::Broken];
            assert!(ended.contains(&peer) && ended.contains(&me), "{peer:?} {me:?}");
        } else {
            assert_eq!((peer, me), (ConnEventKind::Disconnect, ConnEventKind::Disconnect));
        }
        assert_eq!(s.dto_event().status, DtoStatus::Flushed);
        assert_eq!(c.dto_event().status, DtoStatus::Flushed);
    }

    fn itapi_free_connected_endpoint_ends_the_connection(case) {
        let (s, c) = pair(case, EpAttributes::default(), 4096);
        s.ep.post_recv(&[s.seg(0, 64)], 1, DtoFlags::SIGNALED)
            .unwrap();
        let Side { ep, lmr, .. } = c;
        drop((ep, lmr));
        let kind = s.conn_event().kind;
        if case.iwarp() {
            let ended = [ConnEventKind::Disconnect, ConnEventKind::Broken];
            assert!(ended.contains(&kind), "{kind:?}");
        } else {
            // A destroyed QP's CM sends a DREQ: an ordinary disconnect for the peer.
            assert_eq!(kind, ConnEventKind::Disconnect);
        }
        assert_eq!(s.dto_event().status, DtoStatus::Flushed);
    }
}

/// Disconnect from `closer`; both sides see Disconnect and their posted receives flush.
fn graceful(closer: &Side, other: &Side) {
    closer
        .ep
        .post_recv(&[closer.seg(0, 64)], 7, DtoFlags::SIGNALED)
        .unwrap();
    other
        .ep
        .post_recv(&[other.seg(0, 64)], 8, DtoFlags::SIGNALED)
        .unwrap();
    // A send queued before the disconnect still goes out.
    other
        .ep
        .post_recv(&[other.seg(64, 64)], 9, DtoFlags::SIGNALED)
        .unwrap();
    closer.buf().write(128, b"last words");
    closer
        .ep
        .post_send(&[closer.seg(128, 10)], 1, DtoFlags::SIGNALED)
        .unwrap();
    closer.ep.disconnect().unwrap();
    assert_eq!(other.conn_event().kind, ConnEventKind::Disconnect);
    assert_eq!(closer.conn_event().kind, ConnEventKind::Disconnect);
    let r = other.expect(DtoKind::Recv, 8);
    assert_eq!(r.transferred_length, 10);
    let flushed = other.dto_event();
    assert_eq!((flushed.cookie, flushed.status), (9, DtoStatus::Flushed));
    let mut events = [closer.dto_event(), closer.dto_event()];
    events.sort_by_key(|e| e.cookie);
    assert_eq!(
        (events[0].cookie, events[0].status),
        (1, DtoStatus::Success)
    );
    assert_eq!(
        (events[1].cookie, events[1].status),
        (7, DtoStatus::Flushed)
    );
    assert_eq!(closer.ep.state(), EpState::NonOperational);
    assert_eq!(other.ep.state(), EpState::NonOperational);
    // Disconnecting again is harmless.
    assert_eq!(closer.ep.disconnect(), Ok(()));
}
