//! One IP datagram or RoCEv2 UDP payload of untrusted bytes through rxe's stateless
//! codecs (ICRC, BTH and extension headers, IB CM MADs): nothing panics, and whatever
//! parses re-emits to bytes that parse the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rxe::wire::{icrc, CmMad, RocePacket, RoceRepr};

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

fuzz_target!(|data: &[u8]| {
    let _ = icrc::verify_datagram(data);
    if let Ok((_, udp, _)) = icrc::split_datagram(data) {
        roce(&udp[8..]);
    }
    roce(data);
});
