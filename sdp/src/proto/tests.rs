//! The protocol's tests, over two connections joined in memory ([`super::sim`]).

use super::sim::{Pair, SLOT};
use super::*;
use crate::wire::Mid;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn bcopy_stream_with_random_sizes_arrives_intact() {
    let mut p = Pair::default();
    let data = pattern(3 << 20, 7);
    let (mut sent, mut got) = (0, Vec::new());
    let mut x = 12345u32;
    while got.len() < data.len() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let w = (x as usize % 70_000) + 1;
        let end = (sent + w).min(data.len());
        if sent < data.len() && end - sent < p.a.c.config().zcopy_threshold {
            sent += p.a.c.send(&data[sent..end]).unwrap();
        }
        p.settle();
        let r = (x as usize >> 7) % 90_000 + 1;
        let chunk = p.b.read(&p.a, r).unwrap();
        got.extend_from_slice(&chunk);
        p.settle();
        assert!(p.a.c.credits() >= 0 && p.b.c.credits() >= 0);
    }
    assert_eq!(got, data);
    assert_eq!(p.a.c.counters.violations + p.b.c.counters.violations, 0);
    // Large writes asked for larger receive buffers, and got them.
    assert!(p.a.sent.contains(&Mid::ChRcvBuf));
    assert!(p.b.sent.contains(&Mid::ChRcvBufAck));
    assert_eq!(p.a.c.peer_recv_size(), Config::default().max_recv_size);
}

#[test]
fn credit_exhaustion_and_recovery() {
    let cfg = Config {
        recv_bufs: 4,
        recv_size: 1024,
        max_recv_size: 1024,
        send_buffer: 64 * 1024,
        ..Config::default()
    };
    let mut p = Pair::new(cfg, cfg);
    let data = pattern(20_000, 3);
    assert_eq!(p.a.c.send(&data).unwrap(), data.len());
    p.settle();
    // The reader took nothing: the writer used all but the last credit.
    assert_eq!(p.a.c.credits(), 1);
    assert_eq!(p.a.c.unsent(), data.len() - 3 * (1024 - BSDH_LEN));
    assert_eq!(p.b.c.readable_bytes(), 3 * (1024 - BSDH_LEN));
    // A full queue takes no more.
    let more = vec![0u8; 64 * 1024];
    let room = p.a.c.send_room();
    assert_eq!(p.a.c.send(&more).unwrap(), room);
    assert_eq!(p.a.c.send(&more).unwrap(), 0);
    assert!(!p.a.c.writable());
    // Reading frees buffers; credit updates let the rest through.
    let mut got = Vec::new();
    while got.len() < data.len() {
        let chunk = p.b.read(&p.a, 4096).unwrap();
        assert!(
            !chunk.is_empty(),
            "stalled at {} of {}",
            got.len(),
            data.len()
        );
        got.extend_from_slice(&chunk);
        p.settle();
    }
    assert_eq!(&got[..data.len()], &data[..]);
    assert!(p.b.c.counters.credit_updates > 0);
}

/// Two peers whose readers lag, each down to its last credit, each with a control
/// message queued (here a request for larger buffers): neither spends its last credit on
/// it, so once the readers catch up the credit updates flow and so does the data, both
/// ways. (Spending it would leave both at zero credits and no message could ever move.)
#[test]
fn control_messages_never_take_the_last_credit() {
    let cfg = Config {
        recv_bufs: 4,
        recv_size: 1024,
        max_recv_size: 4096,
        send_buffer: 64 * 1024,
        ..Config::default()
    };
    let mut p = Pair::new(cfg, cfg);
    let (da, db) = (pattern(40_000, 1), pattern(40_000, 2));
    // Small writes (no resize asked) until both are down to their last credit; neither
    // reader reads yet.
    for at in [0, 2000] {
        assert_eq!(p.a.c.send(&da[at..at + 2000]).unwrap(), 2000);
        assert_eq!(p.b.c.send(&db[at..at + 2000]).unwrap(), 2000);
    }
    p.settle_crossing();
    assert_eq!((p.a.c.credits(), p.b.c.credits()), (1, 1));
    // Now a large write each: a request for larger buffers queued on both sides.
    assert_eq!(p.a.c.send(&da[4000..]).unwrap(), da.len() - 4000);
    assert_eq!(p.b.c.send(&db[4000..]).unwrap(), db.len() - 4000);
    p.settle_crossing();
    let (mut ga, mut gb) = (Vec::new(), Vec::new());
    for _ in 0..10_000 {
        if ga.len() == db.len() && gb.len() == da.len() {
            break;
        }
        gb.extend(p.b.read(&p.a, 8192).unwrap());
        ga.extend(p.a.read(&p.b, 8192).unwrap());
        p.settle_crossing();
    }
    assert_eq!(
        gb.len(),
        da.len(),
        "a to b stalled (credits a {} b {})",
        p.a.c.credits(),
        p.b.c.credits()
    );
    assert_eq!(
        ga.len(),
        db.len(),
        "b to a stalled (credits a {} b {})",
        p.a.c.credits(),
        p.b.c.credits()
    );
    assert_eq!((ga, gb), (db, da));
    assert!(p.a.sent.contains(&Mid::ChRcvBuf) && p.b.sent.contains(&Mid::ChRcvBufAck));
}

#[test]
fn zcopy_read_mode_and_switches_back_and_forth() {
    let mut p = Pair::default();
    let small = pattern(1000, 1);
    let big = pattern(1 << 20, 2);
    let tail = pattern(500, 3);
    p.a.c.send(&small).unwrap();
    p.settle();
    assert!(p.a.c.zcopy_fits(big.len()));
    p.a.regions.insert(77, (0x1000_0000, big.clone()));
    p.a.c
        .send_zcopy(Advert {
            size: big.len() as u32,
            rkey: 77,
            addr: 0x1000_0000,
        })
        .unwrap();
    p.settle();
    assert_eq!(p.b.c.readable_bytes(), small.len() + big.len());
    // The reader takes the buffered bytes, then reads the advert in pieces.
    let mut got = p.b.read(&p.a, 1000).unwrap();
    got.extend(p.b.read(&p.a, 300_000).unwrap());
    p.settle();
    assert_eq!(p.a.c.poll_event(), None, "not all read yet");
    got.extend(p.b.read(&p.a, 1 << 21).unwrap());
    p.settle();
    assert_eq!(
        p.a.c.poll_event(),
        Some(Event::ZcopyDone { read: big.len() })
    );
    p.a.c.send(&tail).unwrap();
    p.settle();
    got.extend(p.b.read(&p.a, 1 << 20).unwrap());
    let want: Vec<u8> = [small, big.clone(), tail].concat();
    assert_eq!(got, want);
    assert_eq!(p.b.c.counters.zcopy_rx_bytes, big.len() as u64);
    assert_eq!(p.a.c.counters.zcopy_tx_bytes, big.len() as u64);
    assert!(p.b.sent.iter().filter(|m| **m == Mid::RdmaRdCompl).count() >= 2);
}

#[test]
fn sink_without_zcopy_answers_sendsm_and_source_falls_back() {
    let mut p = Pair::new(
        Config::default(),
        Config {
            zcopy_sink: false,
            ..Config::default()
        },
    );
    let big = pattern(400_000, 9);
    p.a.regions.insert(5, (0, big.clone()));
    p.a.c
        .send_zcopy(Advert {
            size: big.len() as u32,
            rkey: 5,
            addr: 0,
        })
        .unwrap();
    p.settle();
    assert!(p.b.sent.contains(&Mid::SendSm));
    assert_eq!(p.a.c.poll_event(), Some(Event::ZcopyRevoked { read: 0 }));
    // The source sends it by buffered copy instead.
    let mut off = 0;
    let mut got = Vec::new();
    while got.len() < big.len() {
        off += p.a.c.send(&big[off..]).unwrap();
        p.settle();
        got.extend(p.b.read(&p.a, 1 << 20).unwrap());
        p.settle();
    }
    assert_eq!(got, big);
}

#[test]
fn source_cancel_is_acknowledged_with_sendsm() {
    let mut p = Pair::default();
    let big = pattern(600_000, 4);
    p.a.regions.insert(9, (0x10, big.clone()));
    p.a.c
        .send_zcopy(Advert {
            size: big.len() as u32,
            rkey: 9,
            addr: 0x10,
        })
        .unwrap();
    p.settle();
    let part = p.b.read(&p.a, 100_000).unwrap();
    p.settle();
    p.a.c.cancel_zcopy();
    p.settle();
    assert!(p.a.sent.contains(&Mid::SrcAvailCancel));
    assert!(p.b.sent.contains(&Mid::SendSm));
    assert_eq!(
        p.a.c.poll_event(),
        Some(Event::ZcopyRevoked { read: 100_000 })
    );
    assert_eq!(part, big[..100_000]);
    // Nothing of the cancelled advert is left for the reader.
    assert_eq!(p.b.c.readable_bytes(), 0);
    assert_eq!(p.b.c.next_read(), None);
}

#[test]
fn disconn_both_ways_closes_after_the_data() {
    let mut p = Pair::default();
    p.a.c.send(b"last words").unwrap();
    p.a.c.shutdown_write();
    p.settle();
    assert_eq!(p.b.read(&p.a, 100).unwrap(), b"last words");
    assert_eq!(p.b.c.next_read(), Some(ReadItem::Eof));
    assert_eq!(p.a.c.phase(), Phase::Open, "half closed");
    // The other direction still works.
    p.b.c.send(b"reply").unwrap();
    p.b.c.shutdown_write();
    p.settle();
    assert_eq!(p.a.read(&p.b, 100).unwrap(), b"reply");
    assert_eq!(p.a.c.phase(), Phase::Closed);
    assert_eq!(p.b.c.phase(), Phase::Closed);
    assert!(p.a.c.transport_done() && p.b.c.transport_done());
}

#[test]
fn abort_resets_the_peer() {
    let mut p = Pair::default();
    p.a.c.send(&pattern(5000, 1)).unwrap();
    p.settle();
    p.a.c.abort();
    p.settle();
    assert_eq!(p.a.sent.last(), Some(&Mid::AbortConn));
    assert_eq!(p.b.c.error(), Some(&ConnError::Reset));
    assert_eq!(p.b.read(&p.a, 10), Err(ConnError::Reset));
    assert_eq!(p.b.c.send(b"x"), Err(ConnError::Reset));
    assert!(p.a.c.transport_done() && p.b.c.transport_done());
}

#[test]
fn abort_during_zcopy_frees_the_source() {
    // The sink aborts while the source's advert is out.
    let mut p = Pair::default();
    let big = pattern(500_000, 5);
    p.a.regions.insert(1, (0, big.clone()));
    p.a.c
        .send_zcopy(Advert {
            size: big.len() as u32,
            rkey: 1,
            addr: 0,
        })
        .unwrap();
    p.settle();
    p.b.read(&p.a, 1000).unwrap();
    p.settle();
    p.b.c.abort();
    p.settle();
    assert_eq!(p.a.c.poll_event(), Some(Event::ZcopyRevoked { read: 1000 }));
    assert_eq!(p.a.c.error(), Some(&ConnError::Reset));
    // The source aborts while the sink has its advert queued.
    let mut p = Pair::default();
    p.a.regions.insert(1, (0, big.clone()));
    p.a.c
        .send_zcopy(Advert {
            size: big.len() as u32,
            rkey: 1,
            addr: 0,
        })
        .unwrap();
    p.settle();
    p.a.c.abort();
    assert_eq!(p.a.c.poll_event(), Some(Event::ZcopyRevoked { read: 0 }));
    p.settle();
    assert_eq!(
        p.b.read(&p.a, 10),
        Err(ConnError::Reset),
        "the sink must not read a dead advert"
    );
}

#[test]
fn peer_death_fails_everything() {
    let mut p = Pair::default();
    let big = pattern(300_000, 5);
    p.a.regions.insert(1, (0, big.clone()));
    p.a.c
        .send_zcopy(Advert {
            size: big.len() as u32,
            rkey: 1,
            addr: 0,
        })
        .unwrap();
    p.settle();
    // The transport reports the peer gone.
    p.a.c.transport_failed();
    assert_eq!(p.a.c.poll_event(), Some(Event::ZcopyRevoked { read: 0 }));
    assert_eq!(p.a.c.send(b"x"), Err(ConnError::Reset));
    assert!(
        p.a.c.readable() && p.a.c.writable(),
        "a failed socket polls ready"
    );
    assert!(p.a.c.transport_done());
}

#[test]
fn out_of_band_byte_travels_out_of_line() {
    let mut p = Pair::default();
    p.a.c.send(b"before").unwrap();
    p.a.c.send_oob(b'!').unwrap();
    p.a.c.send(b"after").unwrap();
    p.settle();
    assert_eq!(p.b.c.take_oob(), Some(b'!'));
    assert_eq!(p.b.read(&p.a, 100).unwrap(), b"beforeafter");
    assert_eq!(p.a.c.counters.oob_tx, 1);
}

#[test]
fn keepalive_after_silence_on_the_simulated_clock() {
    let cfg = Config {
        keepalive: Some(Duration::from_secs(10)),
        ..Config::default()
    };
    let mut p = Pair::new(cfg, Config::default());
    p.settle();
    let deadline = p.a.c.poll_timeout().unwrap();
    p.advance(Duration::from_secs(9));
    p.settle();
    assert_eq!(p.a.c.counters.keepalives, 0);
    p.advance(deadline - p.now + Duration::from_millis(1));
    p.settle();
    assert_eq!(p.a.c.counters.keepalives, 1);
    assert!(p.a.c.poll_timeout().unwrap() > p.now);
    // Silence again: another one, one only.
    p.advance(Duration::from_secs(11));
    p.settle();
    assert_eq!(p.a.c.counters.keepalives, 2);
}

/// `body` as the next message `c`'s peer sends it (in sequence, acknowledging all of
/// `c`'s, 16 buffers posted).
fn next_from_peer(c: &Connection, body: Body<'_>) -> Vec<u8> {
    Message {
        bsdh: Bsdh {
            bufs: 16,
            mseq: c.last_rx_mseq + 1,
            mseq_ack: c.next_mseq - 1,
            ..Bsdh::default()
        },
        body,
    }
    .to_vec()
}

#[test]
fn mode_change_to_buffered_accepted_others_refused() {
    let mut p = Pair::default();
    let inject = |p: &mut Pair, body: Body<'_>| -> Result<bool, ConnError> {
        let v = next_from_peer(&p.b.c, body);
        p.b.c.on_receive(p.now, 0, Received::whole(&v))
    };
    assert_eq!(inject(&mut p, Body::ModeChange { flags: 0x80 }), Ok(true));
    let adv = Advert {
        size: 100,
        rkey: 1,
        addr: 2,
    };
    assert_eq!(
        inject(
            &mut p,
            Body::SinkAvail {
                advert: adv,
                non_discarded: 0
            }
        ),
        Ok(true)
    );
    assert_eq!(p.b.c.counters.sink_adverts_rx, 1);
    assert!(matches!(
        inject(&mut p, Body::ModeChange { flags: 0x20 }),
        Err(ConnError::Protocol(Violation::Unexpected(Mid::ModeChange)))
    ));
}

/// A message forged by a hostile peer, delivered to `b`.
fn forge(p: &mut Pair, mseq: u32, bytes: Vec<u8>) -> Result<bool, ConnError> {
    let _ = mseq;
    p.b.c.on_receive(p.now, 0, Received::whole(&bytes))
}

fn data_msg(mseq: u32, ack: u32, d: &[u8]) -> Vec<u8> {
    Message {
        bsdh: Bsdh {
            bufs: 16,
            mseq,
            mseq_ack: ack,
            ..Bsdh::default()
        },
        body: Body::Data(d),
    }
    .to_vec()
}

#[test]
fn malformed_bsdh_aborts_with_a_protocol_error() {
    let mut p = Pair::default();
    let mut m = data_msg(1, 0, b"hello");
    m[4..8].copy_from_slice(&999u32.to_be_bytes()); // length lies
    let r = forge(&mut p, 1, m);
    assert!(matches!(
        r,
        Err(ConnError::Protocol(Violation::Malformed(
            wire::Error::LengthMismatch { .. }
        )))
    ));
    assert_eq!(p.b.c.counters.violations, 1);
    let mut slot = vec![0u8; SLOT];
    assert_eq!(
        p.b.c.poll_transmit(p.now, &mut slot).map(|t| t.mid),
        Some(Mid::AbortConn)
    );
    assert!(p.b.c.transport_done());
}

#[test]
fn credit_violation_and_sequence_gap_abort() {
    let cfg = Config {
        recv_bufs: 2,
        ..Config::default()
    };
    let mut p = Pair::new(Config::default(), cfg);
    assert!(forge(&mut p, 1, data_msg(1, 0, b"a")).is_ok());
    assert!(forge(&mut p, 2, data_msg(2, 0, b"b")).is_ok());
    // A third message: b advertised two buffers and sent nothing since.
    let r = forge(&mut p, 3, data_msg(3, 0, b"c"));
    assert_eq!(
        r,
        Err(ConnError::Protocol(Violation::CreditViolation {
            mseq: 3,
            limit: 2
        }))
    );

    let mut p = Pair::default();
    let r = forge(&mut p, 5, data_msg(5, 0, b"gap"));
    assert_eq!(
        r,
        Err(ConnError::Protocol(Violation::Sequence { got: 5, want: 1 }))
    );
}

#[test]
fn unsolicited_rdma_rd_compl_and_over_read_abort() {
    let mut p = Pair::default();
    let m = Message {
        bsdh: Bsdh {
            bufs: 16,
            mseq: 1,
            ..Bsdh::default()
        },
        body: Body::RdmaRdCompl { size: 10 },
    }
    .to_vec();
    assert!(matches!(
        forge(&mut p, 1, m),
        Err(ConnError::Protocol(Violation::Unexpected(Mid::RdmaRdCompl)))
    ));
}

#[test]
fn sequence_numbers_wrap() {
    let mut p = Pair::default();
    // Start both sides just before the wrap.
    for s in [&mut p.a.c, &mut p.b.c] {
        s.next_mseq = u32::MAX - 3;
        s.last_rx_mseq = u32::MAX - 4;
        s.rx_limit = s.last_rx_mseq.wrapping_add(u32::from(s.posted));
    }
    let data = pattern(300_000, 8);
    let mut off = 0;
    let mut got = Vec::new();
    while got.len() < data.len() {
        off += p.a.c.send(&data[off..]).unwrap();
        p.settle();
        got.extend(p.b.read(&p.a, 50_000).unwrap());
        p.settle();
    }
    assert_eq!(got, data);
    assert!(p.a.c.next_mseq < 1000);
}

#[test]
fn zcopy_write_mode_lands_large_writes_in_the_readers_buffer() {
    let mut p = Pair::default();
    let threshold = p.a.c.config().zcopy_threshold;
    let data = pattern(3 << 20, 9);
    let mut sent = 0;
    let mut got = Vec::new();
    // The reader asks for a lot with nothing there: it advertises its landing buffer.
    assert!(p.b.read(&p.a, 1 << 20).unwrap().is_empty());
    p.settle();
    assert_eq!(p.b.sent.last(), Some(&Mid::SinkAvail));
    // A little at a time goes by buffered copy, the advert waiting.
    sent += p.a.c.send(&data[..100]).unwrap();
    p.settle();
    got.extend(p.b.read(&p.a, 1 << 20).unwrap());
    assert_eq!(got.len(), 100);
    assert_eq!(p.a.c.counters.zcopy_write_tx_bytes, 0);
    while got.len() < data.len() {
        // Writes of every size; those of the threshold or more leave by RDMA Write
        // whenever an advert is there.
        for w in [threshold, 100, threshold * 3 / 2, 1] {
            let end = (sent + w).min(data.len());
            sent += p.a.c.send(&data[sent..end]).unwrap();
        }
        p.settle();
        loop {
            let chunk = p.b.read(&p.a, 1 << 20).unwrap();
            p.settle();
            if chunk.is_empty() {
                break;
            }
            got.extend_from_slice(&chunk);
        }
    }
    assert_eq!(got, data, "bytes out of order or changed");
    let (a, b) = (&p.a.c.counters, &p.b.c.counters);
    assert!(a.zcopy_write_tx_bytes > 0, "{a:?}");
    assert_eq!(a.zcopy_write_tx_bytes, b.zcopy_write_rx_bytes);
    assert!(a.bcopy_tx_bytes > 0, "small writes by buffered copy: {a:?}");
    assert!(b.sink_adverts_tx >= 2 && a.sink_adverts_rx >= 2);
    assert_eq!(a.violations + b.violations, 0);
}

#[test]
fn sink_cancel_is_acknowledged_and_unsolicited_write_completions_abort() {
    let mut p = Pair::default();
    assert!(p.b.read(&p.a, 1 << 20).unwrap().is_empty());
    p.settle();
    assert!(p.a.c.counters.sink_adverts_rx == 1);
    // The sink takes the advert back: the source forgets it and acknowledges.
    let cancel = next_from_peer(&p.a.c, Body::SinkAvailCancel);
    assert_eq!(
        p.a.c.on_receive(p.now, 0, Received::whole(&cancel)),
        Ok(true)
    );
    assert!(p.a.c.peer_sink.is_none());
    let mut slot = vec![0u8; SLOT];
    let t = p.a.c.poll_transmit(p.now, &mut slot).unwrap();
    assert_eq!(t.mid, Mid::SinkCancelAck);
    // A write completion for more than the advert, or without one, aborts.
    let mut q = Pair::default();
    assert!(q.b.read(&q.a, 1 << 20).unwrap().is_empty());
    q.settle();
    let over = next_from_peer(
        &q.b.c,
        Body::RdmaWrCompl {
            size: super::sim::LANDING_SIZE as u32 + 1,
        },
    );
    assert!(matches!(
        q.b.c.on_receive(q.now, 0, Received::whole(&over)),
        Err(ConnError::Protocol(Violation::OverWrite { .. }))
    ));
    let mut r = Pair::default();
    let unsolicited = next_from_peer(&r.b.c, Body::RdmaWrCompl { size: 10 });
    assert!(matches!(
        r.b.c.on_receive(r.now, 0, Received::whole(&unsolicited)),
        Err(ConnError::Protocol(Violation::Unexpected(Mid::RdmaWrCompl)))
    ));
}

#[test]
fn bytes_leave_the_send_queue_in_order_across_its_wrap() {
    let data = pattern(7, 1);
    let mut q: VecDeque<u8> = VecDeque::with_capacity(8);
    let cap = q.capacity(); // at least 8
    q.extend(std::iter::repeat_n(0, cap - 2));
    q.extend(&data[..2]);
    q.drain(..cap - 2);
    q.extend(&data[2..]); // wraps: the ring's last two slots, then its first five
    assert!(!q.as_slices().1.is_empty());
    let mut out = [0u8; 5];
    take_front(&mut q, &mut out);
    assert_eq!(out[..], data[..5]);
    assert_eq!(q.iter().copied().collect::<Vec<_>>(), data[5..]);
    take_front(&mut q, &mut []);
    assert_eq!(q.len(), 2);
}
