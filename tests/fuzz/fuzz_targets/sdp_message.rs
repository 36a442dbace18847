//! The SDP message parser (`krdma_sdp::wire`): any bytes, whole or as a prefix of a longer
//! message (how a receiver parses a message in its receive buffer), never panic; what
//! parses re-emits to bytes that parse the same.
#![no_main]

use krdma_sdp::wire::{Message, Mid, PREFIX_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::parse(data) {
        let again = m.to_vec();
        let m2 = Message::parse(&again).expect("an emitted message parses");
        assert_eq!(m2.body, m.body);
        assert_eq!(m2.bsdh.mseq, m.bsdh.mseq);
    }
    // The receiver's view: the first bytes, and a total length from the buffer.
    if data.len() >= 2 {
        let total = usize::from(u16::from_be_bytes([data[0], data[1]]));
        let body = &data[2..];
        let prefix = &body[..body.len().min(PREFIX_LEN)];
        if let Ok(m) = Message::parse_head(prefix, total) {
            // What was parsed lies inside what arrived: a Hello or HelloAck (which may be
            // shorter than its full header) as long as its length field, any other
            // message its whole header.
            let parsed = match m.body.mid() {
                Mid::Hello | Mid::HelloAck => m.bsdh.len as usize,
                mid => Message::header_len(mid),
            };
            assert!(parsed <= total, "{m:?} parsed from {total} bytes");
        }
    }
});
