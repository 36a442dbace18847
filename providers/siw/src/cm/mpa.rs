//! The MPA Request/Reply exchange on a non-blocking stream: reading one frame without
//! ever taking a byte past its end, and writing one.

use crate::wire::{self, MpaFrame, MpaPacket};
use std::io::{self, Read, Write};
use std::net::TcpStream;

/// The longest MPA frame: 20 header bytes and 512 bytes of private data.
const MAX_FRAME: usize = wire::mpa::HEADER_LEN + wire::mpa::MAX_PRIVATE_DATA;

/// Why an MPA exchange ended without a frame.
#[derive(Debug, thiserror::Error)]
pub(crate) enum HandshakeError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("malformed MPA frame: {0}")]
    BadFrame(wire::Error),
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

/// One MPA Request or Reply being read from a non-blocking stream.
#[derive(Debug, Default)]
pub(crate) struct MpaReader {
    buf: Vec<u8>,
}

impl MpaReader {
    /// Read what has arrived: the frame once it is complete, `None` while more is
    /// needed. Only the frame's own bytes are taken (the first FPDU may follow at once
    /// and belongs to the QP engine), so it never holds more than one frame.
    pub fn read_from(&mut self, s: &mut TcpStream) -> Result<Option<MpaFrame>, HandshakeError> {
        loop {
            match MpaFrame::parse_bytes(&self.buf) {
                Ok(f) => return Ok(Some(f)),
                Err(wire::Error::Truncated(_)) => {}
                Err(e) => return Err(HandshakeError::BadFrame(e)),
            }
            let want = MpaPacket::new_checked(&self.buf[..])
                .map_or(wire::mpa::HEADER_LEN, |p| p.frame_len());
            let have = self.buf.len();
            debug_assert!(want > have && want <= MAX_FRAME);
            self.buf.resize(want, 0);
            let r = s.read(&mut self.buf[have..]);
            let n = match r {
                Ok(n) => n,
                Err(e) => {
                    self.buf.truncate(have);
                    return match e.kind() {
                        io::ErrorKind::WouldBlock => Ok(None),
                        io::ErrorKind::Interrupted => continue,
                        _ => Err(e.into()),
                    };
                }
            };
            self.buf.truncate(have + n);
            if n == 0 {
                return Err(HandshakeError::Closed);
            }
        }
    }
}

/// Write one MPA frame. The stream is fresh (nothing else was ever written to it), so
/// the at most 532 bytes always fit its send buffer: a non-blocking stream that cannot
/// take them at once is refused rather than waited for.
pub(crate) fn send_mpa(s: &mut TcpStream, f: &MpaFrame) -> Result<(), HandshakeError> {
    let out = f.to_vec().map_err(HandshakeError::BadFrame)?;
    s.write_all(&out)?;
    Ok(())
}

/// Build the MPA frame a side sends, from its negotiated or offered parameters.
/// An MPA frame of `revision` (2 carries the RFC 6581 IRD/ORD words, 1 does not).
pub(crate) fn mpa_frame(
    reply: bool,
    crc: bool,
    reject: bool,
    revision: u8,
    ird: u32,
    ord: u32,
    pdata: &[u8],
) -> MpaFrame {
    let word = |v: u32| v.min(wire::mpa::IRD_ORD_MASK as u32) as u16;
    MpaFrame {
        reply,
        markers: false,
        crc,
        reject,
        revision,
        ird_ord: (revision == 2).then(|| (word(ird), word(ord))),
        private_data: pdata.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn reads_exactly_one_frame_in_pieces() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        b.set_nonblocking(true).unwrap();
        let frame = MpaFrame {
            reply: false,
            markers: false,
            crc: true,
            reject: false,
            revision: 2,
            ird_ord: Some((4, 4)),
            private_data: b"hello".to_vec(),
        };
        let mut bytes = frame.to_vec().unwrap();
        bytes.extend_from_slice(b"FPDU");
        let mut r = MpaReader::default();
        assert!(r.read_from(&mut b).unwrap().is_none(), "nothing sent yet");
        for chunk in bytes[..bytes.len() - 4].chunks(7) {
            assert!(r.read_from(&mut b).unwrap().is_none());
            a.write_all(chunk).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        a.write_all(&bytes[bytes.len() - 4..]).unwrap();
        b.set_nonblocking(false).unwrap();
        let got = loop {
            if let Some(f) = r.read_from(&mut b).unwrap() {
                break f;
            }
        };
        assert_eq!(got, frame);
        let mut rest = [0u8; 4];
        b.read_exact(&mut rest).unwrap();
        assert_eq!(
            &rest, b"FPDU",
            "the bytes after the frame stay in the socket"
        );
    }

    #[test]
    fn garbage_and_eof_end_the_exchange() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        a.write_all(&[b'X'; 20]).unwrap();
        let mut r = MpaReader::default();
        assert!(matches!(
            r.read_from(&mut b),
            Err(HandshakeError::BadFrame(wire::Error::BadKey))
        ));
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut d, _) = l.accept().unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(matches!(
            MpaReader::default().read_from(&mut d),
            Err(HandshakeError::Closed)
        ));
    }
}
