//! One FPDU (or MPA frame) of untrusted bytes through siw's stateless codecs: nothing
//! panics, and whatever parses re-emits to bytes that parse the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use siw::wire::{self, Header, MpaFrame, Opcode, ReadRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok((frame, _)) = MpaFrame::parse(data) {
        let mut out = Vec::new();
        if frame.emit(&mut out).is_ok() {
            assert_eq!(MpaFrame::parse(&out).map(|(f, _)| f), Ok(frame));
        }
    }
    for crc in [false, true] {
        let Ok(ulpdu) = wire::check_fpdu(data, crc) else {
            continue;
        };
        let Ok((h, payload)) = Header::parse(ulpdu) else {
            continue;
        };
        let mut out = Vec::new();
        h.emit(&mut out);
        out.extend_from_slice(payload);
        let (again, p2) = Header::parse(&out).expect("an emitted header parses");
        assert_eq!((again, p2), (h, payload));
        if h.opcode == Opcode::ReadRequest {
            if let Ok(rr) = ReadRequest::parse(payload) {
                let mut b = Vec::new();
                rr.emit(&mut b);
                assert_eq!(ReadRequest::parse(&b), Ok(rr));
            }
        }
    }
});
