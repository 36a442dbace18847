//! IT-API data transfer over siw0 and rxe0, both front doors: every DTO type, cookies,
//! ordering, RMRs, remote access errors, atomics.

#[macro_use]
mod itapi_common;

use itapi_common::*;
use krdma_itapi::*;
use krdma_tests::{crc, fill_pattern};

itapi_tests! {
    fn itapi_send_write_read(case) {
        let (s, c) = pair(case, EpAttributes::default(), 1 << 20);
        let mut v = vec![0u8; 1 << 20];
        fill_pattern(&mut v, 1);
        c.buf().write(0, &v);
        s.ep.post_recv(&[s.seg(0, 1 << 20)], 11, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_send(&[c.seg(0, 1 << 20)], 22, DtoFlags::SIGNALED)
            .unwrap();
        assert_eq!(s.expect(DtoKind::Recv, 11).transferred_length, 1 << 20);
        c.expect(DtoKind::Send, 22);
        assert_eq!(crc(&s.buf().to_vec()), crc(&v));

        fill_pattern(&mut v, 2);
        c.buf().write(0, &v);
        c.ep.post_rdma_write(&[c.seg(0, 1 << 20)], 33, DtoFlags::SIGNALED, c.remote(0))
            .unwrap();
        c.expect(DtoKind::RdmaWrite, 33);
        s.ep.post_recv(&[s.seg(0, 0)], 44, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_send(&[], 55, DtoFlags::SIGNALED).unwrap();
        s.expect(DtoKind::Recv, 44);
        c.expect(DtoKind::Send, 55);
        assert_eq!(crc(&s.buf().to_vec()), crc(&v));

        fill_pattern(&mut v, 3);
        s.buf().write(0, &v);
        c.buf().fill(0);
        c.ep.post_rdma_read(&[c.seg(0, 1 << 20)], 66, DtoFlags::SIGNALED, c.remote(0))
            .unwrap();
        c.expect(DtoKind::RdmaRead, 66);
        assert_eq!(crc(&c.buf().to_vec()), crc(&v));
    }

    fn itapi_scatter_gather_inline_and_empty(case) {
        let (s, c) = pair(case, EpAttributes::default(), 8192);
        // Gather three pieces of the client's buffer, scatter into two of the server's.
        c.buf().write(0, b"abc");
        c.buf().write(100, b"defgh");
        c.buf().write(200, b"ij");
        s.ep.post_recv(&[s.seg(1000, 4), s.seg(2000, 100)], 1, DtoFlags::SIGNALED)
            .unwrap();
        let gather = [c.seg(0, 3), c.seg(100, 5), c.seg(200, 2)];
        c.ep.post_send(&gather, 2, DtoFlags::SIGNALED).unwrap();
        assert_eq!(s.expect(DtoKind::Recv, 1).transferred_length, 10);
        assert_eq!(c.expect(DtoKind::Send, 2).transferred_length, 10);
        let (mut a, mut b) = ([0u8; 4], [0u8; 6]);
        s.buf().read(1000, &mut a);
        s.buf().read(2000, &mut b);
        assert_eq!((&a, &b), (b"abcd", b"efghij"));

        // Inline: the bytes are copied at post time, no LMR involved.
        s.ep.post_recv(&[s.seg(0, 64)], 3, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_send_inline(b"inline payload", 4, DtoFlags::SIGNALED)
            .unwrap();
        assert_eq!(s.expect(DtoKind::Recv, 3).transferred_length, 14);
        c.expect(DtoKind::Send, 4);
        let mut got = [0u8; 14];
        s.buf().read(0, &mut got);
        assert_eq!(&got, b"inline payload");
        let max = c.ia.limits().max_inline as usize;
        assert_eq!(
            c.ep.post_send_inline(&vec![0; max + 1], 5, DtoFlags::SIGNALED),
            Err(Error::PayloadSize)
        );

        // Empty messages and empty RDMA operations.
        s.ep.post_recv(&[], 6, DtoFlags::SIGNALED).unwrap();
        c.ep.post_send(&[], 7, DtoFlags::SIGNALED).unwrap();
        assert_eq!(s.expect(DtoKind::Recv, 6).transferred_length, 0);
        c.expect(DtoKind::Send, 7);
        c.ep.post_rdma_write(&[], 8, DtoFlags::SIGNALED, c.remote(0))
            .unwrap();
        c.expect(DtoKind::RdmaWrite, 8);

        // Limits checked at post time.
        let too_many: Vec<_> = (0..5).map(|i| c.seg(i * 8, 8)).collect();
        assert_eq!(
            c.ep.post_send(&too_many, 9, DtoFlags::SIGNALED),
            Err(Error::InvalidNumSegments)
        );
        assert_eq!(c.lmr.segment(8190, 4), Err(Error::Range));
        assert_eq!(
            c.ep.post_send(&[], 9, DtoFlags::UNLINK_LOCAL_SINK),
            Err(Error::InvalidDtoFlags)
        );
    }

    fn itapi_completions_in_order_with_cookies(case) {
        let (s, c) = pair(case, EpAttributes::default(), 64 * 1024);
        const N: u64 = 48;
        for i in 0..N {
            s.ep.post_recv(&[s.seg(i * 64, 64)], 1000 + i, DtoFlags::SIGNALED)
                .unwrap();
        }
        // Every third send is unsignaled: it completes without an event.
        for i in 0..N {
            c.buf().write((i * 64) as usize, &i.to_le_bytes());
            let flags = if i % 3 == 1 {
                DtoFlags::empty()
            } else {
                DtoFlags::SIGNALED
            };
            let op = if i % 4 == 0 {
                c.ep.post_rdma_write(&[c.seg(i * 64, 8)], i, flags, c.remote(32 * 1024 + i * 64))
            } else {
                c.ep.post_send(&[c.seg(i * 64, 8)], i, flags)
            };
            op.unwrap();
        }
        let sends = (0..N).filter(|i| i % 4 != 0).count() as u64;
        // The receiver sees each message, in order, each cookie once.
        for k in 0..sends {
            let d = s.expect(DtoKind::Recv, 1000 + k);
            assert_eq!(d.transferred_length, 8);
        }
        // The sender sees exactly the signaled requests, in posting order.
        let want: Vec<u64> = (0..N).filter(|i| i % 3 != 1).collect();
        let got: Vec<u64> = want.iter().map(|_| c.dto_event().cookie).collect();
        assert_eq!(got, want);
        assert!(c.dto.dequeue().is_err(), "nothing else");
        // The messages carry the data in the order it was sent.
        for (k, i) in (0..N).filter(|i| i % 4 != 0).enumerate() {
            let mut b = [0u8; 8];
            s.buf().read(k * 64, &mut b);
            assert_eq!(u64::from_le_bytes(b), i);
        }
        assert_eq!(c.ep.outstanding(), (0, 0));
    }

    fn itapi_suppressed_completions_take_no_room(case) {
        // A request EVD of 8 events, never looked at while 400 requests without a
        // completion go out: they must not fill it (verbs writes no completion for them),
        // and the one signaled request after them is the only event.
        let cfg = Cfg { dto_queue: 8, buf_len: 8192, ..Cfg::default() };
        let (s, c) = pair_cfg(case, &cfg, &cfg);
        const N: u64 = 400;
        // A full send queue (the engine behind on a loaded host) takes the post later.
        let post = |seg, i, flags, remote| loop {
            match c.ep.post_rdma_write(&[seg], i, flags, remote) {
                Err(Error::TooManyPosts) => std::thread::sleep(std::time::Duration::from_millis(1)),
                other => break other.unwrap(),
            }
        };
        for i in 0..N {
            c.buf().write((i % 512) as usize * 8, &i.to_le_bytes());
            post(c.seg((i % 512) * 8, 8), i, DtoFlags::empty(), c.remote(4096 + (i % 512) * 8));
        }
        post(c.seg(0, 8), N, DtoFlags::SIGNALED, c.remote(0));
        c.expect(DtoKind::RdmaWrite, N);
        assert!(c.dto.dequeue().is_err(), "nothing else");
        assert_eq!(c.ep.outstanding(), (0, 0));
        // Read back what the last silent write put there (a read completes after the
        // writes before it are placed, on both transports).
        let last = 4096 + (N - 1) % 512 * 8;
        c.ep.post_rdma_read(&[c.seg(6000, 8)], N + 1, DtoFlags::SIGNALED, c.remote(last)).unwrap();
        c.expect(DtoKind::RdmaRead, N + 1);
        let mut b = [0u8; 8];
        c.buf().read(6000, &mut b);
        assert_eq!(u64::from_le_bytes(b), N - 1, "the last silent write landed");
        drop(s);
    }

    fn itapi_rdma_write_with_immediate(case) {
        let (s, c) = pair(case, EpAttributes::default(), 8192);
        if case.iwarp() {
            assert_eq!(
                c.ep.post_rdma_write_imm(&[c.seg(0, 8)], 1, DtoFlags::SIGNALED, c.remote(0), 7),
                Err(Error::OpNotSupported),
                "RDMAP has no immediate data"
            );
            return;
        }
        let mut v = vec![0u8; 5000];
        fill_pattern(&mut v, 9);
        c.buf().write(0, &v);
        // The write consumes the peer's next receive, which holds none of its bytes.
        s.ep.post_recv(&[s.seg(0, 16)], 10, DtoFlags::SIGNALED).unwrap();
        c.ep.post_rdma_write_imm(&[c.seg(0, 5000)], 11, DtoFlags::SIGNALED, c.remote(3000), 0xfeed_0001)
            .unwrap();
        let d = s.expect(DtoKind::Recv, 10);
        assert_eq!(d.immediate, Some(Immediate::RdmaWrite(0xfeed_0001)));
        assert_eq!(d.transferred_length, 5000, "the write's length");
        let w = c.expect(DtoKind::RdmaWriteImm, 11);
        assert_eq!((w.transferred_length, w.immediate), (5000, None));
        let mut got = vec![0u8; 5000];
        s.buf().read(3000, &mut got);
        assert_eq!(crc(&got), crc(&v));
        let mut first = [0u8; 16];
        s.buf().read(0, &mut first);
        assert_eq!(first, [0u8; 16], "nothing lands in the receive");
        // A plain Send reports no immediate data.
        s.ep.post_recv(&[s.seg(0, 16)], 12, DtoFlags::SIGNALED).unwrap();
        c.ep.post_send(&[c.seg(0, 4)], 13, DtoFlags::SIGNALED).unwrap();
        assert_eq!(s.expect(DtoKind::Recv, 12).immediate, None);
        c.expect(DtoKind::Send, 13);
    }

    fn itapi_atomics_where_the_device_has_them(case) {
        let (s, c) = pair(case, EpAttributes::default(), 4096);
        let info = c.ia.query();
        // iWARP (RDMAP) has no atomics; RoCE does, and rxe0 implements them.
        assert_eq!(info.atomic_support, !case.iwarp());
        let target = c.remote(64);
        let add = AtomicOp::FetchAndAdd { add: 5 };
        if !info.atomic_support {
            assert_eq!(
                c.ep.post_atomic(add, &c.seg(0, 8), 1, DtoFlags::SIGNALED, target),
                Err(Error::OpNotSupported)
            );
            let buf = ual::RegBuf::new(4096).unwrap();
            assert_eq!(
                Lmr::create(&c.pz, buf, MemPriv::LOCAL | MemPriv::ATOMIC).err(),
                Some(Error::InvalidPrivs)
            );
            return;
        }
        s.buf().write(64, &40u64.to_ne_bytes());
        c.ep.post_atomic(add, &c.seg(0, 8), 1, DtoFlags::SIGNALED, target)
            .unwrap();
        assert_eq!(c.expect(DtoKind::FetchAdd, 1).transferred_length, 8);
        let mut b = [0u8; 8];
        c.buf().read(0, &mut b);
        assert_eq!(u64::from_ne_bytes(b), 40, "the value before the add");
        s.buf().read(64, &mut b);
        assert_eq!(u64::from_ne_bytes(b), 45);
        // Compare and swap: a wrong guess leaves the value, the right one swaps it.
        for (cookie, compare, was, now) in [(2, 7, 45, 45), (3, 45, 45, 99)] {
            let op = AtomicOp::CompareAndSwap { compare, swap: 99 };
            c.ep.post_atomic(op, &c.seg(8, 8), cookie, DtoFlags::SIGNALED, target)
                .unwrap();
            c.expect(DtoKind::CmpSwap, cookie);
            c.buf().read(8, &mut b);
            assert_eq!(u64::from_ne_bytes(b), was);
            s.buf().read(64, &mut b);
            assert_eq!(u64::from_ne_bytes(b), now);
        }
        // Checked at post time: an 8-byte result, an 8-byte aligned target.
        assert_eq!(
            c.ep.post_atomic(add, &c.seg(0, 4), 4, DtoFlags::SIGNALED, target),
            Err(Error::InvalidLength)
        );
        let odd = RdmaAddr {
            addr: target.addr + 4,
            ..target
        };
        assert_eq!(
            c.ep.post_atomic(add, &c.seg(0, 8), 5, DtoFlags::SIGNALED, odd),
            Err(Error::InvalidAtomicOp)
        );
    }

    fn itapi_rmr_link_unlink_and_send_and_unlink(case) {
        let (s, c) = pair(case, EpAttributes::default(), 64 * 1024);
        // Both devices have memory windows (siw0 and rxe0 alike).
        assert!(s.ia.query().rmr_support);
        // The server exposes only 4 KiB at offset 8 KiB through an RMR.
        let rmr = Rmr::create(&s.pz, RmrType::Narrow).unwrap();
        assert_eq!(
            Rmr::create(&s.pz, RmrType::Wide).err(),
            Some(Error::InvalidRmrType)
        );
        let at = s.lmr.addr() + 8192;
        let target = rmr
            .link(
                &s.lmr,
                at,
                4096,
                MemPriv::REMOTE_WRITE | MemPriv::REMOTE_READ,
                &s.ep,
                50,
                DtoFlags::SIGNALED,
            )
            .unwrap();
        s.expect(DtoKind::RmrLink, 50);
        assert!(rmr.query().linked);
        assert_eq!(s.lmr.users(), 1, "the linked LMR is in use");

        // The client writes through the RMR context, and reads it back.
        c.buf().write(0, b"through the window");
        c.ep.post_rdma_write(&[c.seg(0, 18)], 1, DtoFlags::SIGNALED, target)
            .unwrap();
        c.expect(DtoKind::RdmaWrite, 1);
        c.ep.post_rdma_read(&[c.seg(100, 18)], 2, DtoFlags::SIGNALED, target)
            .unwrap();
        c.expect(DtoKind::RdmaRead, 2);
        let mut b = [0u8; 18];
        c.buf().read(100, &mut b);
        assert_eq!(&b, b"through the window");
        s.buf().read(8192, &mut b);
        assert_eq!(&b, b"through the window");

        // Send-and-unlink: the message invalidates the RMR context at the server.
        s.ep.post_recv(&[s.seg(0, 64)], 3, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_send_and_unlink(&[c.seg(0, 4)], 4, DtoFlags::SIGNALED, target.rmr_context)
            .unwrap();
        s.expect(DtoKind::Recv, 3);
        c.expect(DtoKind::Send, 4);
        // Access through the invalidated context fails and breaks the connection.
        c.ep.post_rdma_write(&[c.seg(0, 4)], 5, DtoFlags::SIGNALED, target)
            .unwrap();
        c.ep.post_recv(&[c.seg(0, 4)], 6, DtoFlags::SIGNALED)
            .unwrap();
        let failed: Vec<DtoEvent> = (0..2).map(|_| c.dto_event()).collect();
        assert!(
            failed.iter().any(|d| d.status != DtoStatus::Success),
            "invalidated context must not work: {failed:?}"
        );
        let ended = c.conn_event();
        assert!(matches!(
            ended.kind,
            ConnEventKind::Broken | ConnEventKind::Disconnect
        ));
        rmr.unlink(&s.ep, 60, DtoFlags::SIGNALED).unwrap();
        assert!(!rmr.query().linked);
    }

    fn itapi_remote_access_error_is_reported(case) {
        let (s, c) = pair(case, EpAttributes::default(), 4096);
        let aff = Evd::create(
            &c.ia,
            EventStream::AsyncAffiliated,
            EvdFlags::empty(),
            16,
            1,
            None,
        )
        .unwrap();
        // A key nobody registered.
        let bogus = RdmaAddr {
            addr: s.lmr.addr(),
            rmr_context: 0x00ff_ff01,
        };
        c.ep.post_rdma_write(&[c.seg(0, 16)], 1, DtoFlags::SIGNALED, bogus)
            .unwrap();
        c.ep.post_recv(&[c.seg(0, 16)], 2, DtoFlags::SIGNALED)
            .unwrap();
        // An iWARP RDMA Write completes when it is sent (it is not acknowledged): the
        // error comes back as the peer's Terminate, which ends the connection and
        // flushes what is outstanding. An InfiniBand Write is acknowledged: it
        // completes with the peer's NAK (remote access error), and the IT-API layer
        // ends the connection (the IB CM would not).
        let events: Vec<DtoEvent> = (0..2).map(|_| c.dto_event()).collect();
        let recv = events.iter().find(|d| d.kind == DtoKind::Recv).unwrap();
        assert_eq!(recv.status, DtoStatus::Flushed, "{events:?}");
        let write = events.iter().find(|d| d.cookie == 1).unwrap();
        if !case.iwarp() {
            assert_eq!(write.status, DtoStatus::RemoteAccess, "{events:?}");
        }
        let ended = c.conn_event();
        assert!(matches!(
            ended.kind,
            ConnEventKind::Broken | ConnEventKind::Disconnect
        ));
        assert_eq!(c.ep.state(), EpState::NonOperational);
        // The server's side detected the violation: its endpoint failed too.
        let se = s.conn_event();
        assert!(matches!(
            se.kind,
            ConnEventKind::Broken | ConnEventKind::Disconnect
        ));
        drop(aff);
        // An RMR context that is not 32 bits never leaves the host.
        let wide = RdmaAddr {
            addr: 0,
            rmr_context: 1 << 40,
        };
        assert_eq!(
            c.ep.post_rdma_read(&[], 3, DtoFlags::SIGNALED, wide),
            Err(Error::InvalidRmr)
        );
    }
}
