//! A connection shared across `fork`: its face becomes the data path.
//!
//! An SDP connection lives in the process that made it (its RDMA resources and the threads
//! that move them do not survive `fork`), yet after a `fork` parent and child both hold the
//! socket, and either may read, write or hand it to a program it `exec`s — as they could a
//! TCP socket. So just before a `fork` the owner turns each of its SDP sockets into a
//! relayed one: the face (a kernel `AF_UNIX` stream, see [`crate::readiness`]) stops
//! mirroring readiness and carries the bytes themselves, and the owner's progress thread
//! moves them between the face's other end (the back) and the SDP connection:
//!
//! * peer → face: buffered bytes are copied into the back as fast as the face's readers
//!   take them; the peer's zero-copy adverts are declined (SendSm), so its bytes come by
//!   buffered copy; the peer's DisConn shows as end of file once every byte before it is in;
//! * face → peer: what the face's writers write is taken from the back while the send queue
//!   has room (the peer's credits pace the writers through the back's buffer); a
//!   `shutdown(SHUT_WR)` on the face sends DisConn after it;
//! * the last close of the face, in every process, closes the connection (as before).
//!
//! Every holder then uses the face as the kernel socket it is: blocking, `O_NONBLOCK`,
//! timeouts, `poll`/`epoll`, `dup`, further forks and `exec` need nothing from the library.
//! The price is a copy through the kernel each way, for the rest of the connection's life.
//! The relay runs in the owner: if the owner exits while another process still holds the
//! socket, the holder reads end of file (its writes fail with `EPIPE`).

use super::{Conn, State};
use crate::proto::{Phase, ReadItem};
use crate::readiness::Readiness;
use nix::errno::Errno;
use nix::sys::socket::{recv, send, shutdown, MsgFlags, Shutdown};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, MutexGuard};

/// The most bytes moved in one step each way.
const CHUNK: usize = 64 * 1024;

/// The relay's part of a connection's state.
#[derive(Debug, Default)]
pub(super) struct Relay {
    /// The peer's bytes taken from the connection, and how many the back has taken.
    to_face: Vec<u8>,
    to_face_sent: usize,
    /// The face reads end of file (the back's write side is shut).
    eof_shown: bool,
    /// The face's writers are done (`shutdown(SHUT_WR)` or every copy closed) and every
    /// byte they wrote is in the send queue.
    pub(super) face_done: bool,
    /// Bytes read from the back on their way to the send queue.
    from_face: Vec<u8>,
}

/// The error a read or write on a relayed connection gets: the caller should use the
/// face as a plain socket instead.
#[derive(Debug)]
pub struct Relayed;

impl std::fmt::Display for Relayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the SDP socket is relayed through its face")
    }
}

impl std::error::Error for Relayed {}

/// Whether `e` says the socket is relayed ([`Conn::relay`]).
pub fn is_relayed(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<Relayed>())
}

pub(super) fn relayed_error() -> io::Error {
    io::Error::other(Relayed)
}

impl Conn {
    /// Turn this connection's face (`face` is one of its descriptors) into its data path,
    /// relayed by this process from now on (module docs). Idempotent.
    pub fn relay(self: &Arc<Self>, face: BorrowedFd<'_>) -> io::Result<()> {
        let mut st = self.lock();
        if st.relay.is_some() {
            return Ok(());
        }
        self.progress(&mut st);
        st.readiness.into_data_path(face)?;
        let eof_shown = st.readiness.ended().is_some();
        if let Some(r) = self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            r.watch_data(st.readiness.back())?;
        }
        self.start_relay(st, eof_shown);
        Ok(())
    }

    /// Relay this connection, just accepted and its face never handed out, through
    /// `back` instead: one end of a kernel stream connection whose other end someone else
    /// holds (a listener shared by `fork` hands its SDP connections out this way).
    pub fn relay_through(self: &Arc<Self>, back: OwnedFd) -> io::Result<()> {
        let mut st = self.lock();
        if st.relay.is_some() {
            return Err(io::ErrorKind::AlreadyExists.into());
        }
        self.progress(&mut st);
        let old = std::mem::replace(&mut st.readiness, Readiness::with_back(back)?);
        if let Some(r) = self.reg.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            r.remove(old.back());
            r.add_data(st.readiness.back())?;
        }
        self.start_relay(st, false);
        Ok(())
    }

    fn start_relay(self: &Arc<Self>, mut st: MutexGuard<'_, State>, eof_shown: bool) {
        st.proto.decline_zcopy();
        st.relay = Some(Relay {
            eof_shown,
            ..Relay::default()
        });
        tracing::debug!(peer = %self.peer, "SDP socket relayed");
        self.flush(&mut st);
        let detached = st.detached;
        drop(st);
        if !detached {
            self.keep_until_face_closed();
        }
    }

    /// Whether the face is the data path ([`Conn::relay`]).
    pub fn is_relayed(&self) -> bool {
        self.lock().relay.is_some()
    }

    /// Move what can move between the back and the connection (part of every flush).
    pub(super) fn pump(&self, st: &mut State) {
        if st.relay.is_none() || st.face_gone {
            return;
        }
        self.pump_to_face(st);
        self.pump_to_peer(st);
    }

    fn pump_to_face(&self, st: &mut State) {
        let back = st.readiness.back().as_raw_fd();
        loop {
            let r = st.relay.as_mut().expect("relayed");
            if r.eof_shown {
                return;
            }
            while r.to_face_sent < r.to_face.len() {
                let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
                match send(back, &r.to_face[r.to_face_sent..], flags) {
                    Ok(n) => r.to_face_sent += n,
                    Err(Errno::EINTR) => {}
                    Err(Errno::EAGAIN) => return,
                    // Nobody reads the face any more (shut for reading): the bytes go.
                    Err(_) => r.to_face_sent = r.to_face.len(),
                }
            }
            r.to_face.clear();
            r.to_face_sent = 0;
            match st.proto.next_read() {
                Some(item @ (ReadItem::Buffered { .. } | ReadItem::Landed { .. })) => {
                    let mut chunk = std::mem::take(&mut r.to_face);
                    chunk.resize(CHUNK, 0);
                    let n = self.copy_item(st, item, &mut chunk).unwrap_or(0);
                    chunk.truncate(n);
                    st.relay.as_mut().expect("relayed").to_face = chunk;
                    if let Some(b) = st.proto.consume(n) {
                        self.repost(st, b);
                    }
                    if n == 0 {
                        return;
                    }
                }
                Some(ReadItem::Eof) => {
                    let _ = shutdown(back, Shutdown::Write);
                    r.eof_shown = true;
                    return;
                }
                // An advert being declined (its bytes follow by buffered copy), or nothing.
                Some(ReadItem::Remote { .. }) | None => return,
            }
        }
    }

    fn pump_to_peer(&self, st: &mut State) {
        let back = st.readiness.back().as_raw_fd();
        loop {
            let State { proto, relay, .. } = &mut *st;
            let r = relay.as_mut().expect("relayed");
            if r.face_done || proto.phase() != Phase::Open {
                return;
            }
            let room = proto.send_room().min(CHUNK);
            if room == 0 {
                return;
            }
            r.from_face.resize(room, 0);
            match recv(back, &mut r.from_face, MsgFlags::MSG_DONTWAIT) {
                Ok(0) => {
                    r.face_done = true;
                    proto.shutdown_write();
                    return;
                }
                Ok(n) => {
                    // `n` is within the room: the queue takes all of it.
                    if let Err(e) = proto.send(&r.from_face[..n]) {
                        tracing::debug!(error = %e, "relayed bytes not sent");
                        return;
                    }
                }
                Err(Errno::EINTR) => {}
                Err(_) => return,
            }
        }
    }
}
