//! iWARP connection management: TCP from the kAL's LLP services, then the MPA
//! Request/Reply exchange (RFC 5044 with the RFC 6581 IRD/ORD words), then the stream is
//! handed to the QP engine.

use crate::device::Shared;
use crate::qp::{mpa_frame, SiwQp};
use crate::wire::{self, MpaFrame, WireError};
use parking_lot::Mutex;
use rnicpi::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MPA_TIMEOUT: Duration = Duration::from_secs(10);
/// Connection requests nobody answers are dropped after this long.
const PENDING_TTL: Duration = Duration::from_secs(60);

/// Read one MPA Request or Reply from a fresh stream (with a deadline).
fn read_mpa(s: &mut TcpStream) -> Result<MpaFrame, VerbsError> {
    s.set_read_timeout(Some(MPA_TIMEOUT))?;
    let mut buf = Vec::with_capacity(64);
    loop {
        match MpaFrame::parse(&buf) {
            Ok((f, used)) if used == buf.len() => {
                s.set_read_timeout(None)?;
                return Ok(f);
            }
            Ok(_) => return Err(VerbsError::Io),
            Err(WireError::Truncated) => {}
            Err(e) => {
                tracing::info!(error = %e, "bad MPA frame");
                return Err(VerbsError::Refused);
            }
        }
        // Byte by byte: the first FPDU may follow the frame immediately and must stay in
        // the socket for the engine.
        let want = if buf.len() < 20 {
            20 - buf.len()
        } else {
            20 + u16::from_be_bytes([buf[18], buf[19]]) as usize - buf.len()
        };
        let mut tmp = vec![0u8; want.max(1)];
        let n = s.read(&mut tmp).map_err(|e| {
            if e.kind() == std::io::ErrorKind::WouldBlock {
                VerbsError::TimedOut
            } else {
                e.into()
            }
        })?;
        if n == 0 {
            return Err(VerbsError::ConnectionReset);
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

fn send_mpa(s: &mut TcpStream, f: &MpaFrame) -> Result<(), VerbsError> {
    let mut out = Vec::with_capacity(64);
    f.emit(&mut out).map_err(|_| VerbsError::Invalid)?;
    s.write_all(&out)?;
    Ok(())
}

/// The active side: runs on its own thread; the outcome arrives as an event on the QP.
pub(crate) fn active_connect(qp: Arc<SiwQp>, peer: SocketAddr, param: ConnParam) {
    let (ird, ord) = qp.limits();
    let (ird, ord) = (param.ird.clamp(1, ird), param.ord.clamp(1, ord));
    let result = (|| -> Result<(MpaFrame, TcpStream), VerbsError> {
        let dev = qp.shared();
        let mut s = dev.services.tcp_connect(peer, MPA_TIMEOUT)?;
        send_mpa(
            &mut s,
            &mpa_frame(
                false,
                dev.crc_required,
                false,
                2,
                ird,
                ord,
                &param.private_data,
            ),
        )?;
        let rep = read_mpa(&mut s)?;
        if !rep.reply {
            return Err(VerbsError::Refused);
        }
        Ok((rep, s))
    })();
    let ev = match result {
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
        Ok((rep, s)) if rep.markers => {
            drop(s);
            Event::new(EventKind::Rejected).with_status(libc::EPROTO)
        }
        Ok((rep, s)) => {
            let crc = rep.crc || qp.shared().crc_required;
            let (pird, pord) = rep
                .ird_ord
                .map(|(i, o)| {
                    (
                        (i & wire::RFC6581_MASK) as u32,
                        (o & wire::RFC6581_MASK) as u32,
                    )
                })
                .unwrap_or((ord, ird));
            let (my_ird, my_ord) = (ird.min(pord.max(1)), ord.min(pird.max(1)));
            let local = s.local_addr().ok();
            match qp.attach(s, crc, my_ird, my_ord) {
                Ok(()) => Event::new(EventKind::Established)
                    .with_addrs(local, Some(peer))
                    .with_param(&ConnParam {
                        private_data: rep.private_data,
                        ird: my_ird,
                        ord: my_ord,
                    }),
                Err(e) => Event::new(EventKind::ConnectionBroken).with_status(e.errno()),
            }
        }
        Err(VerbsError::Refused) => Event::new(EventKind::Rejected).with_status(libc::ECONNREFUSED),
        Err(e) => Event::new(EventKind::Unreachable).with_status(e.errno()),
    };
    qp.sink.deliver(ev);
}

struct Pending {
    stream: TcpStream,
    req: MpaFrame,
    peer: SocketAddr,
    since: Instant,
}

/// A listening endpoint.
pub struct SiwListener {
    dev: Arc<Shared>,
    local: SocketAddr,
    listener: TcpListener,
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
        let listener = dev.services.tcp_listen(addr, backlog)?;
        let local = listener.local_addr()?;
        let l = Arc::new(SiwListener {
            dev,
            local,
            listener,
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            sink,
        });
        let me = l.clone();
        std::thread::Builder::new()
            .name(format!("siw-listen{}", local.port()))
            .stack_size(256 * 1024)
            .spawn(move || me.accept_loop())?;
        tracing::info!(%local, "siw listening");
        Ok(l)
    }

    fn accept_loop(self: Arc<Self>) {
        for conn in self.listener.incoming() {
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            let Ok(stream) = conn else { continue };
            let me = self.clone();
            let _ = std::thread::Builder::new()
                .name("siw-mpa".into())
                .stack_size(256 * 1024)
                .spawn(move || me.handshake(stream));
        }
    }

    fn handshake(&self, mut stream: TcpStream) {
        let peer = match stream.peer_addr() {
            Ok(p) => p,
            Err(_) => return,
        };
        let req = match read_mpa(&mut stream) {
            Ok(r) if !r.reply && !r.markers => r,
            Ok(r) => {
                tracing::info!(%peer, markers = r.markers, "siw refusing MPA request");
                let _ = send_mpa(
                    &mut stream,
                    &mpa_frame(true, false, true, r.revision, 0, 0, &[]),
                );
                return;
            }
            Err(e) => {
                tracing::info!(%peer, error = %e, "siw MPA request failed");
                return;
            }
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (ird, ord) = req
            .ird_ord
            .map(|(i, o)| {
                (
                    (i & wire::RFC6581_MASK) as u32,
                    (o & wire::RFC6581_MASK) as u32,
                )
            })
            .unwrap_or((1, 1));
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
            p.retain(|_, v| v.since.elapsed() < PENDING_TTL);
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            p.insert(
                id,
                Pending {
                    stream,
                    req,
                    peer,
                    since: Instant::now(),
                },
            );
        }
        self.dev
            .counters
            .conn_requests
            .fetch_add(1, Ordering::Relaxed);
        self.sink.deliver(ev);
    }

    fn take(&self, conn_id: u64) -> Result<Pending> {
        self.pending
            .lock()
            .remove(&conn_id)
            .ok_or(VerbsError::NoSuchResource)
    }
}

impl ProviderListener for SiwListener {
    fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn accept(&self, conn_id: u64, qp: &Arc<dyn ProviderQp>, param: ConnParam) -> Result<()> {
        let qp = qp
            .as_any()
            .downcast_ref::<SiwQp>()
            .ok_or(VerbsError::Invalid)?
            .arc()?;
        let mut p = self.take(conn_id)?;
        let (ird, ord) = qp.limits();
        let (pird, pord) = p
            .req
            .ird_ord
            .map(|(i, o)| {
                (
                    (i & wire::RFC6581_MASK) as u32,
                    (o & wire::RFC6581_MASK) as u32,
                )
            })
            .unwrap_or((1, 1));
        let my_ird = param.ird.clamp(1, ird).min(pord.max(1));
        let my_ord = param.ord.clamp(1, ord).min(pird.max(1));
        let crc = p.req.crc || self.dev.crc_required;
        // Answer in the initiator's revision (a revision 1 peer gets no IRD/ORD words).
        send_mpa(
            &mut p.stream,
            &mpa_frame(
                true,
                crc,
                false,
                p.req.revision,
                my_ird,
                my_ord,
                &param.private_data,
            ),
        )?;
        let local = p.stream.local_addr().ok();
        qp.attach(p.stream, crc, my_ird, my_ord)?;
        qp.sink.deliver(
            Event::new(EventKind::Established)
                .with_addrs(local, Some(p.peer))
                .with_param(&ConnParam {
                    private_data: p.req.private_data,
                    ird: my_ird,
                    ord: my_ord,
                }),
        );
        Ok(())
    }

    fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        let mut p = self.take(conn_id)?;
        send_mpa(
            &mut p.stream,
            &mpa_frame(true, false, true, p.req.revision, 0, 0, private_data),
        )?;
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        Ok(())
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the accept loop: shutting a listening socket down makes accept() fail.
        use std::os::fd::AsRawFd;
        // SAFETY: shutdown on our own listening descriptor; no memory is involved.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for (_, mut p) in self.pending.lock().drain() {
            let _ = send_mpa(
                &mut p.stream,
                &mpa_frame(true, false, true, p.req.revision, 0, 0, &[]),
            );
        }
        tracing::info!(local = %self.local, "siw listener closed");
    }
}
