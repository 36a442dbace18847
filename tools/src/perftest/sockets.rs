//! perftest's default exchange on IB and RoCE ("Data ex. method : Ethernet"): the same
//! lock-step messages as over rdma_cm, carried by one TCP connection to the server's port
//! (`ethernet_client_connect` / `ethernet_server_connect`). Every message is one
//! `write(2)` of a fixed size that the peer takes with one `read(2)` of that size; the
//! `pingpong_dest` records travel as text (`wire::Dest::to_text`), and the closing
//! handshake is followed by `"done\0"` from both sides.

use super::control::CONTROL_IDLE;
use super::wire::Dest;
use super::PerfError;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// What `ctx_close_connection` writes after the closing handshake (`sizeof "done"`).
pub const DONE: &[u8; 5] = b"done\0";
const RETRY_DELAY: Duration = Duration::from_millis(100);
/// How long a side waits for the peer's `done` before closing.
const DONE_WAIT: Duration = Duration::from_secs(2);

/// The TCP control connection.
pub struct SocketControl {
    stream: TcpStream,
    client: bool,
}

fn socket_error(what: &'static str, e: std::io::Error) -> PerfError {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            PerfError::PeerClosed(what)
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => PerfError::Timeout(what),
        _ => PerfError::Socket(e),
    }
}

impl SocketControl {
    /// Connect to the server, retrying while it refuses for up to `patience` (perftest's
    /// client tries once; a server booting under emulation may listen late).
    pub fn connect(peer: SocketAddr, patience: Duration) -> Result<SocketControl, PerfError> {
        let deadline = Instant::now() + patience;
        let stream = loop {
            match TcpStream::connect(peer) {
                Ok(s) => break s,
                Err(e) if e.kind() == ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                    tracing::debug!(%peer, "perftest: server not listening yet, retrying");
                    std::thread::sleep(RETRY_DELAY);
                }
                Err(e) => return Err(PerfError::Socket(e)),
            }
        };
        tracing::info!(%peer, "perftest: control socket connected");
        Self::new(stream, true)
    }

    /// Take one client from `listener`.
    pub fn accept(listener: &TcpListener) -> Result<SocketControl, PerfError> {
        let (stream, peer) = listener.accept().map_err(PerfError::Socket)?;
        tracing::info!(%peer, "perftest: control socket accepted");
        Self::new(stream, false)
    }

    fn new(stream: TcpStream, client: bool) -> Result<SocketControl, PerfError> {
        // One message per segment, sent at once (perftest leaves Nagle on; lock-step
        // messages never wait behind unacknowledged data anyway).
        stream.set_nodelay(true).map_err(PerfError::Socket)?;
        stream
            .set_read_timeout(Some(CONTROL_IDLE))
            .map_err(PerfError::Socket)?;
        Ok(SocketControl { stream, client })
    }

    /// `ctx_xchg_data_ethernet`: the client writes first, the server reads first.
    pub fn xchg(&mut self, mine: &[u8], what: &'static str) -> Result<Vec<u8>, PerfError> {
        let mut theirs = vec![0u8; mine.len()];
        if self.client {
            self.write(mine, what)?;
            self.read(&mut theirs, what)?;
        } else {
            self.read(&mut theirs, what)?;
            self.write(mine, what)?;
        }
        Ok(theirs)
    }

    /// `ctx_hand_shake` over the socket: the records as text.
    pub fn handshake(&mut self, mine: &Dest) -> Result<Dest, PerfError> {
        Dest::from_text(&self.xchg(&mine.to_text(), "pingpong_dest")?)
    }

    fn write(&mut self, data: &[u8], what: &'static str) -> Result<(), PerfError> {
        self.stream
            .write_all(data)
            .map_err(|e| socket_error(what, e))
    }

    fn read(&mut self, buf: &mut [u8], what: &'static str) -> Result<(), PerfError> {
        self.stream
            .read_exact(buf)
            .map_err(|e| socket_error(what, e))
    }

    /// After the closing handshake: write `done`, take the peer's (so our close does not
    /// reset the connection under it), close. Both sides have finished by then, so a peer
    /// that is already gone is no error (perftest closes with our `done` unread, which
    /// resets the connection).
    pub fn done(&mut self) {
        if let Err(e) = self.stream.write_all(DONE) {
            tracing::debug!(error = %e, "perftest: could not write done");
        }
        let _ = self.stream.set_read_timeout(Some(DONE_WAIT));
        let mut theirs = [0u8; DONE.len()];
        if let Err(e) = self.stream.read_exact(&mut theirs) {
            tracing::debug!(error = %e, "perftest: no done from the peer");
        }
        self.close();
    }

    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
