//! One IP datagram or RoCEv2 UDP payload of untrusted bytes through rxe's stateless
//! codecs (ICRC, BTH and extension headers, IB CM MADs, a GSO run or an acknowledged pair
//! cut into its packets): nothing panics, whatever parses re-emits to bytes that parse the
//! same, and a run's packets cover its payload exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rxe::wire::{gso, icrc, CmMad, RocePacket, RoceRepr};

fn roce(payload: &[u8]) {
    let Ok(p) = RocePacket::new_checked(payload) else {
        return;
    };
    let Ok(r) = RoceRepr::parse(&p) else { return };
    let out = r.to_vec().expect("a parsed packet emits");
    assert_eq!(out.len(), payload.len());
    assert_eq!(RoceRepr::parse_bytes(&out).unwrap(), r);
    if let Ok(m) = CmMad::parse(r.payload) {
        assert_eq!(CmMad::parse(&m.to_bytes()).unwrap(), m);
    }
}

/// Every packet of a run (or pair) verified and parsed; how many bytes they covered.
fn cut(run: gso::Segments<'_>) -> usize {
    let mut covered = 0;
    for s in run {
        let mut whole = s.udp.to_vec();
        whole.extend_from_slice(s.roce);
        let _ = icrc::verify_ipv4(&s.ip, &whole);
        roce(s.roce);
        covered += s.roce.len();
    }
    covered
}

fuzz_target!(|data: &[u8]| {
    let _ = icrc::verify_datagram(data);
    if let Ok((ip, udp, v6)) = icrc::split_datagram(data) {
        roce(&udp[8..]);
        if !v6 {
            if let Some(run) = gso::Segments::of(ip, udp, &udp[8..]) {
                assert_eq!(cut(run), udp.len() - 8);
            }
            if let Some(pair) = gso::Segments::acked(ip, udp, &udp[8..]) {
                let n = pair.clone().count();
                assert_eq!(n, 2, "a packet and the ACK behind it");
                assert_eq!(cut(pair), udp.len() - 8);
            }
        }
    }
    roce(data);
});
