//! iWARP connection management: TCP from the kAL's LLP services, then the MPA
//! Request/Reply exchange (RFC 5044 with the RFC 6581 IRD/ORD words), then the stream is
//! handed to the QP engine.
//!
//! Every handshake runs on one non-blocking reactor thread per device ([`reactor`]),
//! never on a thread of its own, with an absolute deadline for the whole exchange; a
//! listener holds at most its backlog of connections in handshake or waiting for the
//! consumer, the device a global cap, and unanswered requests expire. So a flood of
//! connections, or peers that send one byte every few seconds, cost a bounded number of
//! sockets and no threads (`docs/security.md`, H5).

mod mpa;
pub(crate) mod reactor;

use crate::device::Shared;
use crate::qp::{Attach, SiwQp};
use crate::wire::{self, MpaFrame};
use mpa::{mpa_frame, send_mpa, HandshakeError};
use parking_lot::Mutex;
use reactor::Command;
use rnicpi::*;
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The whole MPA exchange (TCP connect included, on the active side) must finish
/// within this.
pub(crate) const MPA_TIMEOUT: Duration = Duration::from_secs(10);
/// Connection requests the consumer leaves unanswered are dropped after this long.
pub(crate) const PENDING_TTL: Duration = Duration::from_secs(60);
/// The largest backlog a listener gets (requests in handshake plus those waiting for
/// the consumer), whatever it asks for.
pub(crate) const MAX_BACKLOG: u32 = 1024;

/// The peer's (IRD, ORD) from its RFC 6581 words, without the control bits.
fn peer_ird_ord(f: &MpaFrame) -> Option<(u32, u32)> {
    f.ird_ord.map(|(i, o)| {
        (
            (i & wire::mpa::IRD_ORD_MASK) as u32,
            (o & wire::mpa::IRD_ORD_MASK) as u32,
        )
    })
}

/// Start an active connect: the TCP connection is begun here without waiting, the rest
/// runs in the device's CM reactor, and the outcome arrives as an event on the QP.
pub(crate) fn connect(qp: Arc<SiwQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
    if param.private_data.len() > wire::mpa::MAX_CONSUMER_PRIVATE_DATA {
        return Err(VerbsError::Invalid);
    }
    qp.clone().connecting(|| start_connect(qp, peer, param))
}

fn start_connect(qp: Arc<SiwQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
    let dev = qp.shared().clone();
    let reactor = dev.cm()?;
    let (ird, ord) = qp.limits();
    let (ird, ord) = (param.ird.clamp(1, ird), param.ord.clamp(1, ord));
    let stream = match dev.services.tcp_connect_start(peer) {
        Ok(s) => s,
        Err(e) => {
            // Refused (nothing listens: a TCP reset) or not reachable: no consumer
            // answered, so not a reject of theirs (as the IB CM's "invalid service ID").
            let ev = Event::new(EventKind::Unreachable).with_status(e.errno());
            qp.connect_done(ev);
            return Ok(());
        }
    };
    let request = mpa_frame(
        false,
        dev.crc_required,
        false,
        2,
        ird,
        ord,
        &param.private_data,
    )
    .to_vec()
    .map_err(|_| VerbsError::Invalid)?;
    reactor.send(Command::Connect(reactor::Active {
        stream,
        qp,
        peer,
        request,
        ird,
        ord,
    }));
    Ok(())
}

/// The active side's MPA exchange ended: turn the Reply (or the failure) into the QP's
/// connection event, attaching the stream on success.
fn active_done(
    qp: &Arc<SiwQp>,
    a: reactor::ActiveParams,
    outcome: std::result::Result<(MpaFrame, TcpStream), HandshakeError>,
) {
    let peer = a.peer;
    let ev = match outcome {
        Ok((rep, _)) if !rep.reply => {
            tracing::info!(%peer, "siw peer answered an MPA Request with a Request");
            Event::new(EventKind::Rejected).with_status(libc::ECONNREFUSED)
        }
        Ok((rep, _)) if rep.reject => {
            tracing::info!(%peer, "siw connection rejected by peer");
            Event::new(EventKind::Rejected)
                .with_status(libc::ECONNREFUSED)
                .with_param(&ConnParam {
                    private_data: rep.private_data,
                    ird: 0,
                    ord: 0,
                })
        }
        Ok((rep, _)) if rep.markers => Event::new(EventKind::Rejected).with_status(libc::EPROTO),
        Ok((rep, s)) => {
            let crc = rep.crc || qp.shared().crc_required;
            let (pird, pord) = peer_ird_ord(&rep).unwrap_or((a.ord, a.ird));
            let (my_ird, my_ord) = (a.ird.min(pord.max(1)), a.ord.min(pird.max(1)));
            let local = s.local_addr().ok();
            let established = Event::new(EventKind::Established)
                .with_addrs(local, Some(peer))
                .with_param(&ConnParam {
                    private_data: rep.private_data,
                    ird: my_ird,
                    ord: my_ord,
                });
            let conn = Attach {
                crc,
                ird: my_ird,
                ord: my_ord,
            };
            // `attach` reports the connection (and its end) itself.
            match qp.attach(s, conn, established, None) {
                Ok(()) => return,
                Err(e) => Event::new(EventKind::ConnectionBroken).with_status(e.errno()),
            }
        }
        Err(HandshakeError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            // Nothing listens there: no consumer rejected us.
            Event::new(EventKind::Unreachable).with_status(libc::ECONNREFUSED)
        }
        Err(HandshakeError::BadFrame(e)) => {
            tracing::info!(%peer, error = %e, "siw bad MPA reply");
            Event::new(EventKind::Rejected).with_status(libc::ECONNREFUSED)
        }
        Err(e) => {
            let errno = match &e {
                HandshakeError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => {
                    libc::ETIMEDOUT
                }
                HandshakeError::Io(io) => io.raw_os_error().unwrap_or(libc::EIO),
                _ => libc::ECONNRESET,
            };
            tracing::info!(%peer, error = %e, "siw connect failed");
            Event::new(EventKind::Unreachable).with_status(errno)
        }
    };
    qp.connect_done(ev);
}

/// A complete MPA Request waiting for the consumer's accept or reject.
pub(crate) struct Pending {
    stream: TcpStream,
    req: MpaFrame,
    peer: SocketAddr,
    expires: Instant,
}

/// A listening endpoint.
pub struct SiwListener {
    dev: Arc<Shared>,
    local: SocketAddr,
    /// The listening socket, until `close` (its CM reactor accepts from it).
    socket: Mutex<Option<TcpListener>>,
    /// Requests in handshake plus pending ones this listener may hold.
    backlog: u32,
    /// This listener's key in the CM reactor.
    token: u64,
    pending: Mutex<HashMap<u64, Pending>>,
    next: AtomicU64,
    closed: AtomicBool,
    sink: Arc<dyn EventSink>,
}

impl SiwListener {
    pub(crate) fn start(
        dev: Arc<Shared>,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<SiwListener>> {
        let reactor = dev.cm()?;
        let socket = dev.services.tcp_listen(addr, backlog)?;
        socket.set_nonblocking(true)?;
        let local = socket.local_addr()?;
        let l = Arc::new(SiwListener {
            dev,
            local,
            socket: Mutex::new(Some(socket)),
            backlog: backlog.clamp(1, MAX_BACKLOG),
            token: reactor.token(),
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            sink,
        });
        reactor.send(Command::Listen(l.clone()));
        tracing::info!(%local, backlog = l.backlog, "siw listening");
        Ok(l)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Requests waiting for the consumer.
    fn pending_len(&self) -> usize {
        self.pending.lock().len()
    }

    /// A complete MPA Request arrived: keep it for the consumer and tell it. Returns the
    /// request's id (for its expiry), or `None` when the listener closed meanwhile.
    fn add_request(&self, stream: TcpStream, req: MpaFrame, peer: SocketAddr) -> Option<u64> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (ird, ord) = peer_ird_ord(&req).unwrap_or((1, 1));
        let ev = Event::new(EventKind::ConnectRequest)
            .with_conn(id)
            .with_addrs(stream.local_addr().ok(), Some(peer))
            .with_param(&ConnParam {
                private_data: req.private_data.clone(),
                ird,
                ord,
            });
        {
            let mut p = self.pending.lock();
            if self.is_closed() {
                return None;
            }
            p.insert(
                id,
                Pending {
                    stream,
                    req,
                    peer,
                    expires: Instant::now() + PENDING_TTL,
                },
            );
        }
        let c = &self.dev.counters;
        c.connect_requests.fetch_add(1, Ordering::Relaxed);
        c.requests_pending.fetch_add(1, Ordering::Relaxed);
        self.sink.deliver(ev);
        Some(id)
    }

    /// Drop request `id` if it is still unanswered at `now`.
    fn expire(&self, id: u64, now: Instant) {
        let gone = {
            let mut p = self.pending.lock();
            match p.get(&id) {
                Some(r) if r.expires <= now => p.remove(&id),
                _ => None,
            }
        };
        if let Some(r) = gone {
            let c = &self.dev.counters;
            c.requests_pending.fetch_sub(1, Ordering::Relaxed);
            c.requests_expired.fetch_add(1, Ordering::Relaxed);
            tracing::info!(peer = %r.peer, id, "siw connection request expired unanswered");
        }
    }

    fn take(&self, conn_id: u64) -> Result<Pending> {
        let p = self
            .pending
            .lock()
            .remove(&conn_id)
            .ok_or(VerbsError::NoSuchResource)?;
        self.dev
            .counters
            .requests_pending
            .fetch_sub(1, Ordering::Relaxed);
        Ok(p)
    }
}

fn mpa_failed(e: HandshakeError) -> VerbsError {
    match e {
        HandshakeError::Io(e) => e.into(),
        HandshakeError::Closed => VerbsError::ConnectionReset,
        HandshakeError::BadFrame(_) => VerbsError::Invalid,
    }
}

impl ProviderListener for SiwListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(&self, conn_id: u64, qp: &Arc<dyn ProviderQp>, param: ConnParam) -> Result<()> {
        let qp = SiwQp::of(qp, &self.dev)?;
        let p = self.take(conn_id)?;
        let (ird, ord) = qp.limits();
        let (pird, pord) = peer_ird_ord(&p.req).unwrap_or((1, 1));
        let my_ird = param.ird.clamp(1, ird).min(pord.max(1));
        let my_ord = param.ord.clamp(1, ord).min(pird.max(1));
        let crc = p.req.crc || self.dev.crc_required;
        // Answer in the initiator's revision (a revision 1 peer gets no IRD/ORD words).
        let reply = mpa_frame(
            true,
            crc,
            false,
            p.req.revision,
            my_ird,
            my_ord,
            &param.private_data,
        );
        let bytes = reply
            .to_vec()
            .map_err(|e| mpa_failed(HandshakeError::BadFrame(e)))?;
        let local = p.stream.local_addr().ok();
        let established = Event::new(EventKind::Established)
            .with_addrs(local, Some(p.peer))
            .with_param(&ConnParam {
                private_data: p.req.private_data,
                ird: my_ird,
                ord: my_ord,
            });
        let conn = Attach {
            crc,
            ird: my_ird,
            ord: my_ord,
        };
        qp.attach(p.stream, conn, established, Some(&bytes))
    }

    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        let mut p = self.take(conn_id)?;
        send_mpa(
            &mut p.stream,
            &mpa_frame(true, false, true, p.req.revision, 0, 0, private_data),
        )
        .map_err(mpa_failed)?;
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        Ok(())
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Closing the socket frees the port at once and takes it out of the reactor's
        // epoll; the reactor drops the handshakes still under way.
        drop(self.socket.lock().take());
        if let Ok(r) = self.dev.cm() {
            r.send(Command::Closed(self.token));
        }
        let refused: Vec<Pending> = self.pending.lock().drain().map(|(_, p)| p).collect();
        self.dev
            .counters
            .requests_pending
            .fetch_sub(refused.len() as u64, Ordering::Relaxed);
        for mut p in refused {
            let _ = send_mpa(
                &mut p.stream,
                &mpa_frame(true, false, true, p.req.revision, 0, 0, &[]),
            );
        }
        tracing::info!(local = %self.local, "siw listener closed");
    }
}
