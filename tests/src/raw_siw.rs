//! A raw iWARP peer for tests: a TCP socket that speaks MPA itself and then sends and
//! reads FPDUs exactly as a test builds them (malformed ones included), or stops reading.

use siw::wire::{self, term, FpduPacket, Header, MpaFrame, ReadRequest, TermCode};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The peer's end of one connection to a krdma siw QP.
pub struct RawSiwPeer {
    pub sock: TcpStream,
    pub crc: bool,
    /// Bytes read from the krdma side and not yet taken as FPDUs.
    got: Vec<u8>,
}

/// The bytes of an MPA Request (revision 2 carries the RFC 6581 IRD/ORD words).
pub fn mpa_request(crc: bool, ird: u16, revision: u8) -> Vec<u8> {
    MpaFrame {
        reply: false,
        markers: false,
        crc,
        reject: false,
        revision,
        ird_ord: (revision == 2).then_some((1, ird)),
        private_data: vec![],
    }
    .to_vec()
    .unwrap()
}

impl RawSiwPeer {
    /// Connect to a krdma siw listener at `addr` and complete the MPA exchange as the
    /// initiator (the listener's consumer must accept).
    pub fn connect(addr: SocketAddr, crc: bool, ird: u16, revision: u8) -> RawSiwPeer {
        let mut sock = TcpStream::connect(addr).unwrap();
        sock.set_nodelay(true).unwrap();
        sock.write_all(&mpa_request(crc, ird, revision)).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut got = Vec::new();
        let mut b = [0u8; 256];
        let rep = loop {
            let n = sock.read(&mut b).unwrap();
            assert!(n > 0, "connection closed during MPA negotiation");
            got.extend_from_slice(&b[..n]);
            match MpaFrame::parse_bytes(&got) {
                Ok(f) => {
                    assert_eq!(
                        f.buffer_len(),
                        got.len(),
                        "no FPDU before the first message"
                    );
                    break f;
                }
                Err(wire::Error::Truncated(_)) => continue,
                Err(e) => panic!("MPA reply: {e}"),
            }
        };
        assert!(rep.reply && !rep.reject);
        assert_eq!(rep.crc, crc, "CRC as the initiator asked");
        assert_eq!(
            rep.revision, revision,
            "the reply answers in the initiator's revision"
        );
        assert_eq!(rep.ird_ord.is_some(), revision == 2);
        RawSiwPeer {
            sock,
            crc,
            got: Vec::new(),
        }
    }

    /// Frame `ulpdu` as an FPDU (CRC as negotiated, or deliberately wrong).
    pub fn fpdu(&self, ulpdu: &[u8], break_crc: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let start = wire::begin_fpdu(&mut out);
        out.extend_from_slice(ulpdu);
        wire::finish_fpdu(&mut out, start, self.crc).unwrap();
        if break_crc {
            let n = out.len();
            out[n - 1] ^= 0x5a;
        }
        out
    }

    pub fn ulpdu(h: Header, payload: &[u8]) -> Vec<u8> {
        let mut u = h.to_vec();
        u.extend_from_slice(payload);
        u
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).unwrap();
    }

    /// The next FPDU from the krdma side (its header and payload).
    pub fn next_fpdu(&mut self) -> (Header, Vec<u8>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut b = vec![0u8; 1 << 16];
        loop {
            if let Ok(f) = FpduPacket::new_checked(&self.got[..]) {
                let total = f.total_len();
                let u = wire::check_fpdu(&self.got[..total], self.crc)
                    .expect("krdma sends well-formed FPDUs")
                    .to_vec();
                self.got.drain(..total);
                let (h, p) = Header::parse_bytes(&u).expect("valid header");
                return (h, p.to_vec());
            }
            assert!(Instant::now() < deadline, "no FPDU within 10 s");
            match self.sock.read(&mut b) {
                Ok(0) => panic!("connection closed"),
                Ok(n) => self.got.extend_from_slice(&b[..n]),
                Err(e) => panic!("reading from krdma: {e}"),
            }
        }
    }

    /// Read FPDUs until a Terminate arrives; returns its control field.
    pub fn terminate(&mut self) -> TermCode {
        loop {
            let (h, p) = self.next_fpdu();
            if h.opcode == wire::Opcode::Terminate {
                let t = term::Packet::new_checked(&p[..]).expect("a Terminate control field");
                return term::Repr::parse(&t).unwrap().code;
            }
        }
    }

    /// Read FPDUs until a Read Request arrives.
    pub fn read_request(&mut self) -> ReadRequest {
        loop {
            let (h, p) = self.next_fpdu();
            if h.opcode == wire::Opcode::ReadRequest {
                return ReadRequest::parse_bytes(&p).expect("a well-formed Read Request");
            }
        }
    }
}
