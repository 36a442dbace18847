//! One FPDU (or MPA frame) of untrusted bytes through siw's stateless codecs: nothing
//! panics, and whatever parses re-emits to bytes that parse the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use siw::wire::{term, FpduPacket, Header, MpaFrame, Opcode, RdmapPacket, ReadRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(frame) = MpaFrame::parse_bytes(data) {
        if let Ok(out) = frame.to_vec() {
            assert_eq!(MpaFrame::parse_bytes(&out), Ok(frame));
        }
    }
    let Ok(f) = FpduPacket::new_checked(data) else {
        return;
    };
    let _ = f.check_crc();
    let Ok(u) = RdmapPacket::new_checked(f.ulpdu()) else {
        return;
    };
    let Ok(h) = Header::parse(&u) else {
        return;
    };
    let mut out = h.to_vec();
    out.extend_from_slice(u.payload());
    let again = Header::parse_bytes(&out).expect("an emitted header parses");
    assert_eq!(again, (h, u.payload()));
    match h.opcode {
        Opcode::ReadRequest => {
            if let Ok(rr) = ReadRequest::parse_bytes(u.payload()) {
                assert_eq!(ReadRequest::parse_bytes(&rr.to_vec()), Ok(rr));
            }
        }
        Opcode::Terminate => {
            if let Ok(t) = term::Packet::new_checked(u.payload()) {
                let r = term::Repr::parse(&t).expect("any control field parses");
                let mut b = [0u8; term::HEADER_LEN];
                r.emit(&mut term::Packet::new_checked(&mut b[..]).unwrap());
                assert_eq!(term::Repr::parse(&term::Packet::new_checked(&b[..]).unwrap()), Ok(r));
            }
        }
        _ => {}
    }
});
