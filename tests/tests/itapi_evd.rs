//! IT-API event dispatchers: solicited events, thresholds, the pollable descriptor,
//! overflow, aggregate EVDs, waiting, callbacks. Every case runs over siw0 and rxe0
//! through both front doors.

#[macro_use]
mod itapi_common;

use itapi_common::*;
use krdma_itapi::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn software(ia: &Ia, flags: EvdFlags, queue: usize, threshold: usize, aevd: Option<&Aevd>) -> Evd {
    Evd::create(ia, EventStream::Software, flags, queue, threshold, aevd).unwrap()
}

fn data(ev: &Event) -> u64 {
    match ev {
        Event::Software(s) => s.data,
        other => panic!("not a software event: {other:?}"),
    }
}

/// The IA's affiliated async EVD.
fn affiliated(ia: &Ia) -> Evd {
    Evd::create(
        ia,
        EventStream::AsyncAffiliated,
        EvdFlags::empty(),
        8,
        1,
        None,
    )
    .unwrap()
}

/// The affiliated async EVD `aff` reports that `evd` overflowed. An endpoint failure may
/// come first: a completion lost to a full completion queue also moves its QP to Error
/// with an async event (on siw, as kernel siw does).
fn expect_overflow_report(aff: &Evd, evd: &Evd) {
    loop {
        match aff.wait(T).unwrap().0 {
            Event::Affiliated(a) if a.number == EventNumber::AsyncAffEpFailure => continue,
            Event::Affiliated(a) => {
                assert_eq!(a.number, EventNumber::AsyncAffSevdEnqueueFailure);
                assert!(matches!(a.cause, AffiliatedCause::Sevd(ref s) if s.id == evd.id()));
                return;
            }
            other => panic!("{other:?}"),
        }
    }
}

itapi_tests! {
    fn itapi_solicited_events(case) {
        let fd_cfg = Cfg {
            dto_flags: EvdFlags::CREATE_FD,
            ..Cfg::default()
        };
        let (s, c) = pair_cfg(case, &fd_cfg, &Cfg::default());
        let fd = s.dto.fd().unwrap();
        for i in 0..4 {
            s.ep.post_recv(&[s.seg(i * 64, 64)], i, DtoFlags::SOLICITED_WAIT)
                .unwrap();
        }
        // An unsolicited message is queued but does not make the SEVD ready.
        c.ep.post_send(&[c.seg(0, 8)], 10, DtoFlags::SIGNALED)
            .unwrap();
        c.expect(DtoKind::Send, 10);
        assert!(!readable(fd, 300), "unsolicited message must not notify");
        match s.dto.dequeue().unwrap() {
            Event::Dto(d) => assert_eq!((d.cookie, d.solicited), (0, false)),
            other => panic!("{other:?}"),
        }
        // A solicited one does.
        c.ep.post_send(
            &[c.seg(0, 8)],
            11,
            DtoFlags::SIGNALED | DtoFlags::SOLICITED_WAIT,
        )
        .unwrap();
        assert!(readable(fd, 5000), "solicited message notifies");
        match s.dto.dequeue().unwrap() {
            Event::Dto(d) => assert_eq!((d.cookie, d.solicited), (1, true)),
            other => panic!("{other:?}"),
        }
        assert!(!readable(fd, 0), "drained: not ready");

        // A sleeping waiter is not woken by an unsolicited message...
        let dto = s.dto.clone();
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            (dto.wait(Some(Duration::from_millis(800))), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        c.ep.post_send(&[c.seg(0, 8)], 12, DtoFlags::SIGNALED)
            .unwrap();
        let (r, waited) = waiter.join().unwrap();
        assert_eq!(r.err(), Some(Error::TimeoutExpired));
        assert!(
            waited >= Duration::from_millis(750),
            "woken early: {waited:?}"
        );
        assert!(matches!(s.dto.dequeue().unwrap(), Event::Dto(d) if d.cookie == 2));
        // ...and is woken at once by a solicited one.
        let dto = s.dto.clone();
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            (dto.wait(Some(Duration::from_secs(10))), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(100));
        c.ep.post_send(
            &[c.seg(0, 8)],
            13,
            DtoFlags::SIGNALED | DtoFlags::SOLICITED_WAIT,
        )
        .unwrap();
        let (r, waited) = waiter.join().unwrap();
        assert!(matches!(r.unwrap().0, Event::Dto(d) if d.cookie == 3 && d.solicited));
        assert!(waited < Duration::from_secs(5));
    }

    // krdma's `dequeue_polling`: the CQ is not armed again until a plain dequeue, so
    // completions meanwhile notify nobody (a poller takes them); a plain dequeue arms it
    // and the descriptor works again.
    fn itapi_dequeue_polling_leaves_the_cq_unarmed(case) {
        let fd_cfg = Cfg {
            dto_flags: EvdFlags::CREATE_FD,
            ..Cfg::default()
        };
        let (s, c) = pair_cfg(case, &fd_cfg, &Cfg::default());
        let fd = s.dto.fd().unwrap();
        for i in 0..4 {
            s.ep.post_recv(&[s.seg(i * 64, 64)], i, DtoFlags::NOTIFY).unwrap();
        }
        let poll_for = |cookie: u64| {
            let until = Instant::now() + Duration::from_secs(10);
            loop {
                match s.dto.dequeue_polling() {
                    Ok(Event::Dto(d)) => return assert_eq!(d.cookie, cookie),
                    Ok(other) => panic!("{other:?}"),
                    Err(Error::QueueEmpty) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_micros(200))
                    }
                    Err(e) => panic!("no completion {cookie}: {e:?}"),
                }
            }
        };
        // Armed since the SEVD was made: the first message notifies.
        c.ep.post_send(&[c.seg(0, 8)], 10, DtoFlags::SIGNALED).unwrap();
        c.expect(DtoKind::Send, 10);
        assert!(readable(fd, 5000), "armed: the first message notifies");
        poll_for(0);
        assert!(!readable(fd, 0), "drained: not ready");
        // The event thread armed the CQ again when it took that one (nobody polled yet):
        // that arm fires once more, for the next message.
        c.ep.post_send(&[c.seg(0, 8)], 11, DtoFlags::SIGNALED).unwrap();
        c.expect(DtoKind::Send, 11);
        poll_for(1);
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(s.dto.dequeue_polling().err(), Some(Error::QueueEmpty));
        // Polled: the next one is there to take, but nobody is told.
        c.ep.post_send(&[c.seg(0, 8)], 12, DtoFlags::SIGNALED).unwrap();
        c.expect(DtoKind::Send, 12);
        assert!(!readable(fd, 300), "left unarmed: no notification");
        poll_for(2);
        // A plain dequeue arms again.
        assert_eq!(s.dto.dequeue().err(), Some(Error::QueueEmpty));
        c.ep.post_send(&[c.seg(0, 8)], 13, DtoFlags::SIGNALED).unwrap();
        assert!(readable(fd, 5000), "armed again: the message notifies");
        assert!(matches!(s.dto.dequeue().unwrap(), Event::Dto(d) if d.cookie == 3));
    }

    // krdma's `FD_ON_COMPLETION`: the engine itself makes the descriptor readable for a
    // completion (a byte on the CQ's signal socket, counted by the kAL), not the event
    // thread; it reads readable even for a completion that does not notify, and a
    // dequeue that empties the SEVD clears it and arms again.
    fn itapi_descriptor_readable_on_completion(case) {
        let flags = EvdFlags::CREATE_FD | EvdFlags::FD_ON_COMPLETION;
        let cfg = Cfg {
            dto_flags: flags,
            ..Cfg::default()
        };
        let (s, c) = pair_cfg(case, &cfg, &Cfg::default());
        let fd = s.dto.fd().unwrap();
        let ctx = s.ia.context_handle().clone();
        let signals = || krdma_tests::kal_counter(&ctx, "cq_signals_sent");
        let as_events = krdma_tests::kal_counter(&ctx, "cq_signals_as_events");
        for i in 0..4 {
            s.ep.post_recv(&[s.seg(i * 64, 64)], i, DtoFlags::empty()).unwrap();
        }
        assert_eq!(s.dto.dequeue().err(), Some(Error::QueueEmpty));
        assert!(!readable(fd, 0), "nothing there");
        for (cookie, sent) in [(0u64, 10u64), (1, 11)] {
            let before = signals();
            c.ep.post_send(&[c.seg(0, 8)], sent, DtoFlags::SIGNALED).unwrap();
            c.expect(DtoKind::Send, sent);
            assert!(readable(fd, 5000), "the engine's byte makes it readable");
            // (Counted just after the byte is written.)
            let t = Instant::now();
            while signals() == before && t.elapsed() < Duration::from_secs(5) {
                std::thread::yield_now();
            }
            assert_eq!(signals(), before + 1, "one signal per armed completion");
            match s.dto.dequeue().unwrap() {
                Event::Dto(d) => assert_eq!(d.cookie, cookie),
                other => panic!("{other:?}"),
            }
            assert_eq!(s.dto.dequeue().err(), Some(Error::QueueEmpty));
            assert!(!readable(fd, 0), "emptied: drained, and armed again");
        }
        assert_eq!(
            krdma_tests::kal_counter(&ctx, "cq_signals_as_events"),
            as_events,
            "every signal went through the socket"
        );
        // `dequeue_all` takes both at once, and the SEVD never showed ready on the way.
        for sent in [12, 13] {
            c.ep.post_send(&[c.seg(0, 8)], sent, DtoFlags::SIGNALED).unwrap();
            c.expect(DtoKind::Send, sent);
        }
        assert!(readable(fd, 5000));
        let mut all = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        while all.len() < 2 && Instant::now() < until {
            s.dto.dequeue_all(&mut all, false).unwrap();
        }
        let cookies: Vec<u64> = all
            .iter()
            .map(|e| match e {
                Event::Dto(d) => d.cookie,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(cookies, [2, 3]);
        // A byte of an arm that fired for one of them may come after they were taken
        // (its completion was seen first, the engine's thread was slow to write it): a
        // dequeue drains it. The descriptor settles unreadable — it is never left
        // readable with nothing to take.
        let t = Instant::now();
        let mut quiet_since: Option<Instant> = None;
        while quiet_since.is_none_or(|q| q.elapsed() < Duration::from_millis(300)) {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "the descriptor keeps reading readable with nothing to take"
            );
            if readable(fd, 0) {
                assert_eq!(s.dto.dequeue_all(&mut all, false), Ok(0));
                quiet_since = None;
            } else {
                quiet_since.get_or_insert_with(Instant::now);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // A waiter still wakes (its wait arms for the event).
        s.ep.post_recv(&[s.seg(0, 64)], 4, DtoFlags::empty()).unwrap();
        let dto = s.dto.clone();
        let waiter = std::thread::spawn(move || dto.wait(Some(Duration::from_secs(10))));
        std::thread::sleep(Duration::from_millis(100));
        c.ep.post_send(&[c.seg(0, 8)], 14, DtoFlags::SIGNALED).unwrap();
        assert!(matches!(waiter.join().unwrap().unwrap().0, Event::Dto(d) if d.cookie == 4));
        // Only for a DTO SEVD with a descriptor.
        for (stream, flags) in [
            (EventStream::Dto, EvdFlags::FD_ON_COMPLETION),
            (EventStream::Software, flags),
        ] {
            let r = Evd::create(&s.ia, stream, flags, 16, 1, None);
            assert_eq!(r.err(), Some(Error::InvalidFlags), "{stream:?} {flags:?}");
        }
    }

    fn itapi_threshold_and_descriptor(case) {
        let ia = case.ia();
        let evd = software(&ia, EvdFlags::CREATE_FD, 16, 3, None);
        let fd = evd.fd().unwrap();
        evd.post_software(1).unwrap();
        evd.post_software(2).unwrap();
        assert!(!readable(fd, 50), "below the threshold");
        assert_eq!(
            evd.wait(Some(Duration::from_millis(100))).err(),
            Some(Error::TimeoutExpired)
        );
        evd.post_software(3).unwrap();
        assert!(readable(fd, 0));
        let (ev, more) = evd.wait(Some(Duration::ZERO)).unwrap();
        assert_eq!((data(&ev), more), (1, 2));
        assert!(!readable(fd, 0), "two left: below the threshold again");
        assert_eq!(
            data(&evd.dequeue().unwrap()),
            2,
            "dequeue ignores the threshold"
        );
        assert_eq!(data(&evd.dequeue().unwrap()), 3);
        assert_eq!(evd.dequeue().err(), Some(Error::QueueEmpty));
        evd.set_threshold(1).unwrap();
        evd.post_software(4).unwrap();
        assert!(readable(fd, 0));
        evd.set_enabled(false);
        assert!(!readable(fd, 0), "disabled: not ready");
        assert_eq!(evd.set_threshold(17), Err(Error::InvalidThreshold));
        assert_eq!(
            Evd::create(&ia, EventStream::Software, EvdFlags::empty(), 0, 0, None).err(),
            Some(Error::InvalidQueueSize)
        );
    }

    fn itapi_wait_timeout_waiter_limit_and_wakeup(case) {
        let ia = case.ia();
        let evd = software(&ia, EvdFlags::empty(), 16, 1, None);
        let t = Instant::now();
        assert_eq!(
            evd.wait(Some(Duration::from_millis(200))).err(),
            Some(Error::TimeoutExpired)
        );
        assert!(t.elapsed() >= Duration::from_millis(190));
        let e2 = evd.clone();
        let waiter = std::thread::spawn(move || e2.wait(None));
        while !evd.has_waiter() {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            evd.wait(Some(Duration::ZERO)).err(),
            Some(Error::WaiterLimit)
        );
        evd.post_software(42).unwrap();
        assert_eq!(data(&waiter.join().unwrap().unwrap().0), 42);
    }

    fn itapi_callback_runs_when_ready(case) {
        let ia = case.ia();
        let evd = software(&ia, EvdFlags::empty(), 16, 1, None);
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        evd.attach_callback(Arc::new(move || {
            h.fetch_add(1, Ordering::SeqCst);
        }))
        .unwrap();
        assert_eq!(
            evd.attach_callback(Arc::new(|| {})),
            Err(Error::CallbackExists)
        );
        evd.post_software(1).unwrap();
        evd.post_software(2).unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), 2);
        assert!(evd.query().callback);
        evd.detach_callback().unwrap();
        evd.post_software(3).unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), 2);
    }

    fn itapi_async_evds_one_per_ia(case) {
        let ia = case.ia();
        let aff = affiliated(&ia);
        assert_eq!(
            Evd::create(
                &ia,
                EventStream::AsyncAffiliated,
                EvdFlags::empty(),
                8,
                1,
                None
            )
            .err(),
            Some(Error::AsyncAffEvdExists)
        );
        let unaff = Evd::create(
            &ia,
            EventStream::AsyncUnaffiliated,
            EvdFlags::empty(),
            8,
            1,
            None,
        )
        .unwrap();
        assert_eq!(
            Evd::create(
                &ia,
                EventStream::AsyncUnaffiliated,
                EvdFlags::empty(),
                8,
                1,
                None
            )
            .err(),
            Some(Error::AsyncUnaffEvdExists)
        );
        let info = ia.query();
        assert_eq!(
            (info.affiliated_evd, info.unaffiliated_evd),
            (Some(aff.id()), Some(unaff.id()))
        );
        drop(aff);
        assert!(Evd::create(
            &ia,
            EventStream::AsyncAffiliated,
            EvdFlags::empty(),
            8,
            1,
            None
        )
        .is_ok());
        assert_eq!(
            software(&ia, EvdFlags::empty(), 8, 1, None).post_software(1),
            Ok(())
        );
        assert_eq!(unaff.post_software(1), Err(Error::InvalidEvdType));
    }

    fn itapi_evd_overflow(case) {
        let ia = case.ia();
        let aff = affiliated(&ia);
        let evd = software(&ia, EvdFlags::empty(), 4, 1, None);
        for i in 0..4 {
            evd.post_software(i).unwrap();
        }
        assert_eq!(evd.post_software(4), Err(Error::EvdQueueFull));
        assert_eq!(evd.post_software(5), Err(Error::EvdQueueFull));
        assert!(evd.query().overflowed);
        // One async event per overflow, naming the SEVD.
        expect_overflow_report(&aff, &evd);
        assert_eq!(aff.dequeue().err(), Some(Error::QueueEmpty));
        // The events that fit are intact; the mark stays until reset.
        let got: Vec<u64> = (0..4).map(|_| data(&evd.dequeue().unwrap())).collect();
        assert_eq!(got, vec![0, 1, 2, 3]);
        assert!(evd.query().overflowed);
        evd.reset_overflow();
        assert!(!evd.query().overflowed);

        // With auto-reset the mark clears at the next dequeue.
        let auto = software(&ia, EvdFlags::OVERFLOW_AUTO_RESET, 1, 1, None);
        auto.post_software(1).unwrap();
        assert_eq!(auto.post_software(2), Err(Error::EvdQueueFull));
        assert!(auto.query().overflowed);
        auto.dequeue().unwrap();
        assert!(!auto.query().overflowed);
    }

    fn itapi_connection_request_overflow_rejects(case) {
        let s = Side::new(case, EpAttributes::default(), 4096);
        let req = Evd::create(
            &s.ia,
            EventStream::CmRequest,
            EvdFlags::CREATE_FD,
            1,
            1,
            None,
        )
        .unwrap();
        let l = Listener::create(&s.ia, 0, &req, 0).unwrap();
        let addr = addr_of(&s.ia, l.port());
        let a = Side::new(case, EpAttributes::default(), 4096);
        let b = Side::new(case, EpAttributes::default(), 4096);
        a.ep.connect(addr, b"first").unwrap();
        assert!(readable(req.fd().unwrap(), 5000), "first request queued");
        // The SEVD holds one request: the second is lost, and refused rather than left
        // waiting.
        b.ep.connect(addr, b"second").unwrap();
        let refused = b.conn_event();
        assert!(matches!(
            refused.kind,
            ConnEventKind::PeerReject | ConnEventKind::NonPeerReject
        ));
        assert!(req.query().overflowed);
        match req.dequeue().unwrap() {
            Event::ConnRequest(r) => {
                assert_eq!(r.private_data, as_received(&s.ia, b"first", Pdata::Connect));
                s.ep.accept(r.cn_est_id, b"").unwrap();
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(a.conn_event().kind, ConnEventKind::Established);
    }

    fn itapi_dto_evd_overflow_never_hangs(case) {
        let attrs = EpAttributes {
            max_request_dtos: 32,
            ..EpAttributes::default()
        };
        let small = Cfg {
            attrs: attrs.clone(),
            dto_queue: 4,
            ..Cfg::default()
        };
        let (s, c) = pair_cfg(
            case,
            &Cfg {
                attrs,
                ..Cfg::default()
            },
            &small,
        );
        let aff = Evd::create(
            &c.ia,
            EventStream::AsyncAffiliated,
            EvdFlags::empty(),
            8,
            1,
            None,
        )
        .unwrap();
        // The SEVD holds 4 events and its completion ring 4 more; 24 do not fit.
        for i in 0..24 {
            s.ep.post_recv(&[s.seg(0, 64)], i, DtoFlags::SIGNALED)
                .unwrap();
        }
        for i in 0..24 {
            c.ep.post_send(&[c.seg(0, 8)], i, DtoFlags::SIGNALED)
                .unwrap();
        }
        expect_overflow_report(&aff, &c.dto);
        assert!(c.dto.query().overflowed);
        let mut got = Vec::new();
        while let Ok(Event::Dto(d)) = c.dto.dequeue() {
            got.push(d.cookie);
        }
        // What fitted is kept in order; what found the ring full was lost.
        assert!((4..24).contains(&got.len()), "{got:?}");
        assert!(got.windows(2).all(|w| w[0] < w[1]), "in order: {got:?}");
        // The endpoint whose completion was lost is broken, like on any device.
        let ended = c.conn_event();
        assert!(matches!(
            ended.kind,
            ConnEventKind::Broken | ConnEventKind::Disconnect
        ));
    }

    fn itapi_aevd_fans_in_simple_evds(case) {
        let ia = case.ia();
        let aevd = Aevd::create(&ia, EvdFlags::CREATE_FD, 64).unwrap();
        let fd = aevd.fd().unwrap();
        let a = software(&ia, EvdFlags::empty(), 8, 1, Some(&aevd));
        let b = software(&ia, EvdFlags::empty(), 8, 1, Some(&aevd));
        let quiet = software(&ia, EvdFlags::empty(), 8, 1, Some(&aevd));
        assert_eq!(aevd.users(), 3);
        assert!(!readable(fd, 0));
        a.post_software(1).unwrap();
        a.post_software(2).unwrap();
        b.post_software(3).unwrap();
        assert!(readable(fd, 0));
        assert_eq!(aevd.ready_count(), 2);
        // Direct mode: the SEVDs' own events, one ready SEVD after the other.
        let got: Vec<(u64, u64)> = (0..3)
            .map(|_| {
                let ev = aevd.wait(Some(Duration::from_secs(1))).unwrap().0;
                (ev.evd_id(), data(&ev))
            })
            .collect();
        assert_eq!(got, vec![(a.id(), 1), (b.id(), 3), (a.id(), 2)]);
        assert!(!readable(fd, 0), "all drained");
        assert_eq!(aevd.dequeue().err(), Some(Error::QueueEmpty));
        assert_eq!(
            aevd.wait(Some(Duration::from_millis(50))).err(),
            Some(Error::TimeoutExpired)
        );

        // A waiter on the AEVD wakes when any of its SEVDs gets an event.
        let a2 = aevd.clone();
        let waiter = std::thread::spawn(move || a2.wait(Some(Duration::from_secs(10))));
        std::thread::sleep(Duration::from_millis(50));
        quiet.post_software(9).unwrap();
        let (ev, _) = waiter.join().unwrap().unwrap();
        assert_eq!((ev.evd_id(), data(&ev)), (quiet.id(), 9));

        // Notification mode: the AEVD names the ready SEVD; the consumer drains it.
        let notes = Aevd::create(&ia, EvdFlags::DEQUEUE_NOTIFICATIONS, 8).unwrap();
        let c = software(&ia, EvdFlags::empty(), 8, 1, Some(&notes));
        c.post_software(5).unwrap();
        c.post_software(6).unwrap();
        match notes.wait(Some(Duration::from_secs(1))).unwrap().0 {
            Event::AevdNotification(n) => {
                assert_eq!((n.aevd, n.sevd.id), (notes.id(), c.id()));
                let sevd = n.sevd.evd().unwrap();
                assert_eq!(data(&sevd.dequeue().unwrap()), 5);
                assert_eq!(data(&sevd.dequeue().unwrap()), 6);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            notes.dequeue().err(),
            Some(Error::QueueEmpty),
            "drained: no notification left"
        );
    }
}
