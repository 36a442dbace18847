//! The CM reactor of a siw device: one thread and one epoll for every listener and every
//! MPA handshake of the device, passive and active. Nothing in it ever blocks on a
//! peer: sockets are non-blocking, each handshake has an absolute deadline, and each
//! readiness event does a bounded amount of work.
//!
//! Admission (a new TCP connection on a listener): a listener holds at most its backlog
//! of connections in handshake plus requests waiting for the consumer. When it is full,
//! the oldest connection still in handshake makes room (a slow or silent peer cannot
//! keep a prompt one out); when all of them are complete requests, or the device holds
//! [`GLOBAL_CAP`] of them, the new connection is reset. `accept` errors other than a
//! vanished connection (out of descriptors, out of memory) take the listener out of the
//! epoll for a back-off that doubles up to a second, so they never spin.

use super::mpa::{mpa_frame, send_mpa, HandshakeError, MpaReader};
use super::{SiwListener, MPA_TIMEOUT, PENDING_TTL};
use crate::device::Shared;
use crate::llp::set_linger_zero;
use crate::qp::SiwQp;
use crate::wire::MpaFrame;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Connections in handshake plus pending requests the whole device holds at most.
pub(crate) const GLOBAL_CAP: usize = 4096;
/// Connections taken from one listener per readiness event.
const ACCEPT_BUDGET: usize = 64;
/// First and longest pause of a listener whose `accept` fails.
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Timers kept before those of finished handshakes and requests are dropped: live ones
/// are at most `GLOBAL_CAP` in all, so this bounds the heap.
const TIMERS_MAX: usize = 4 * GLOBAL_CAP;
/// The epoll token of the wake-up eventfd.
const WAKE: u64 = 0;

/// What other threads ask of the reactor.
pub(crate) enum Command {
    /// Accept connections on this listener.
    Listen(Arc<SiwListener>),
    /// The listener with this token closed: drop its handshakes.
    Closed(u64),
    /// Run an active connect's MPA exchange.
    Connect(Active),
}

/// An active connect handed to the reactor: TCP connection under way, MPA Request ready.
pub(crate) struct Active {
    pub stream: TcpStream,
    pub qp: Arc<SiwQp>,
    pub peer: SocketAddr,
    pub request: Vec<u8>,
    pub ird: u32,
    pub ord: u32,
}

/// What the end of an active exchange needs to know besides the Reply.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActiveParams {
    pub peer: SocketAddr,
    pub ird: u32,
    pub ord: u32,
}

pub(crate) struct CmReactor {
    epoll: Epoll,
    wake: EventFd,
    inbox: Mutex<Vec<Command>>,
    next: AtomicU64,
}

impl CmReactor {
    /// Start the reactor thread of `dev` (it ends once the device is gone).
    pub fn start(dev: &Arc<Shared>) -> io::Result<Arc<CmReactor>> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        let wake = EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        epoll.add(&wake, EpollEvent::new(EpollFlags::EPOLLIN, WAKE))?;
        let r = Arc::new(CmReactor {
            epoll,
            wake,
            inbox: Mutex::new(Vec::new()),
            next: AtomicU64::new(WAKE + 1),
        });
        let mut lp = Loop {
            r: r.clone(),
            dev: Arc::downgrade(dev),
            listeners: HashMap::new(),
            handshakes: HashMap::new(),
            timers: BinaryHeap::new(),
        };
        std::thread::Builder::new()
            .name("siw-cm".into())
            .stack_size(256 * 1024)
            .spawn(move || lp.run())?;
        Ok(r)
    }

    /// A fresh epoll token.
    pub fn token(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    pub fn send(&self, c: Command) {
        self.inbox.lock().push(c);
        let _ = self.wake.write(1);
    }
}

struct ListenEntry {
    l: Arc<SiwListener>,
    /// Its connections in handshake, oldest (smallest token) first.
    in_handshake: BTreeSet<u64>,
    armed: bool,
    backoff: Duration,
}

enum Phase {
    /// Passive: reading the peer's MPA Request for listener `listener`.
    Request { listener: u64, mpa: MpaReader },
    /// Active: TCP connect under way; then the Request goes out.
    Connecting {
        qp: Arc<SiwQp>,
        request: Vec<u8>,
        params: ActiveParams,
    },
    /// Active: Request sent, reading the Reply.
    Reply {
        qp: Arc<SiwQp>,
        mpa: MpaReader,
        params: ActiveParams,
    },
}

struct Handshake {
    stream: TcpStream,
    peer: SocketAddr,
    deadline: Instant,
    phase: Phase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    /// A handshake's deadline.
    Handshake(u64),
    /// A pending request of a listener (token, request id) may have expired.
    Pending(u64, u64),
    /// A listener's accept back-off is over.
    Rearm(u64),
}

struct Loop {
    r: Arc<CmReactor>,
    dev: Weak<Shared>,
    listeners: HashMap<u64, ListenEntry>,
    handshakes: HashMap<u64, Handshake>,
    timers: BinaryHeap<Reverse<(Instant, Timer)>>,
}

impl Loop {
    fn run(&mut self) {
        let mut events = vec![EpollEvent::empty(); 64];
        loop {
            // Wake at least once a second, to notice a device that is gone.
            let wait = self
                .timers
                .peek()
                .map(|Reverse((t, _))| t.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::MAX)
                .min(Duration::from_secs(1));
            let ms = u16::try_from(wait.as_millis() + 1).unwrap_or(u16::MAX);
            let n = match self.r.epoll.wait(&mut events, EpollTimeout::from(ms)) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => 0,
                Err(e) => {
                    tracing::error!("siw CM reactor stopped: {e}");
                    return;
                }
            };
            let Some(dev) = self.dev.upgrade() else {
                return;
            };
            for ev in &events[..n] {
                match ev.data() {
                    WAKE => self.commands(&dev),
                    t if self.listeners.contains_key(&t) => self.accept_ready(&dev, t),
                    t => self.handshake_ready(&dev, t),
                }
            }
            self.fire_timers(&dev);
        }
    }

    fn commands(&mut self, dev: &Shared) {
        let _ = self.r.wake.read();
        let cmds = std::mem::take(&mut *self.r.inbox.lock());
        for c in cmds {
            match c {
                Command::Listen(l) => {
                    let token = l.token;
                    self.listeners.insert(
                        token,
                        ListenEntry {
                            l,
                            in_handshake: BTreeSet::new(),
                            armed: false,
                            backoff: BACKOFF_MIN,
                        },
                    );
                    self.arm(token);
                }
                Command::Closed(token) => {
                    if let Some(e) = self.listeners.remove(&token) {
                        for t in e.in_handshake {
                            self.drop_handshake(dev, t);
                        }
                    }
                }
                Command::Connect(a) => self.start_active(dev, a),
            }
        }
    }

    /// Watch a listener's socket again (after `Listen` or a back-off).
    fn arm(&mut self, token: u64) {
        let Some(e) = self.listeners.get_mut(&token) else {
            return;
        };
        let sock = e.l.socket.lock();
        let Some(s) = sock.as_ref() else {
            return; // closed: `Closed` follows
        };
        match self
            .r
            .epoll
            .add(s, EpollEvent::new(EpollFlags::EPOLLIN, token))
        {
            Ok(()) => e.armed = true,
            Err(err) => tracing::warn!(token, "siw listener not watched: {err}"),
        }
    }

    fn accept_ready(&mut self, dev: &Shared, token: u64) {
        for _ in 0..ACCEPT_BUDGET {
            let Some(e) = self.listeners.get_mut(&token) else {
                return;
            };
            let accepted = {
                let sock = e.l.socket.lock();
                let Some(s) = sock.as_ref() else {
                    return;
                };
                s.accept()
            };
            match accepted {
                Ok((stream, peer)) => {
                    e.backoff = BACKOFF_MIN;
                    self.admit(dev, token, stream, peer);
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return,
                // The connection went away before we took it: nothing to do.
                Err(err)
                    if matches!(
                        err.raw_os_error(),
                        Some(libc::ECONNABORTED | libc::EINTR | libc::EPROTO | libc::EPERM)
                    ) => {}
                Err(err) => {
                    // Out of descriptors or memory: retrying at once would spin.
                    dev.counters.accept_errors.fetch_add(1, Ordering::Relaxed);
                    let pause = e.backoff;
                    e.backoff = (e.backoff * 2).min(BACKOFF_MAX);
                    if let Some(s) = e.l.socket.lock().as_ref() {
                        let _ = self.r.epoll.delete(s);
                    }
                    e.armed = false;
                    tracing::warn!(token, ?pause, "siw accept failed: {err}");
                    self.timers
                        .push(Reverse((Instant::now() + pause, Timer::Rearm(token))));
                    return;
                }
            }
        }
    }

    /// A new connection on listener `token`: make room within its backlog and the
    /// device's cap, or reset it.
    fn admit(&mut self, dev: &Shared, token: u64, stream: TcpStream, peer: SocketAddr) {
        let Some(e) = self.listeners.get(&token) else {
            return;
        };
        if e.l.is_closed() {
            return;
        }
        let backlog = e.l.backlog as usize;
        if e.in_handshake.len() + e.l.pending_len() >= backlog {
            match e.in_handshake.first().copied() {
                Some(oldest) => {
                    dev.counters
                        .handshakes_evicted
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(token, "siw backlog full: oldest handshake dropped");
                    self.drop_handshake(dev, oldest);
                }
                None => return refuse(dev, stream, "backlog of pending requests full"),
            }
        }
        let pending_total = dev.counters.requests_pending.load(Ordering::Relaxed) as usize;
        if self.handshakes.len() + pending_total >= GLOBAL_CAP {
            return refuse(dev, stream, "device cap of connections in setup reached");
        }
        let t = self.r.token();
        if let Err(err) = stream.set_nonblocking(true).and_then(|_| {
            self.r
                .epoll
                .add(&stream, EpollEvent::new(EpollFlags::EPOLLIN, t))
                .map_err(io::Error::from)
        }) {
            rnicpi::warn_limited!(%peer, "siw handshake not started: {err}");
            return;
        }
        if let Some(e) = self.listeners.get_mut(&token) {
            e.in_handshake.insert(t);
        }
        self.insert(
            dev,
            t,
            Handshake {
                stream,
                peer,
                deadline: Instant::now() + MPA_TIMEOUT,
                phase: Phase::Request {
                    listener: token,
                    mpa: MpaReader::default(),
                },
            },
        );
    }

    fn insert(&mut self, dev: &Shared, t: u64, h: Handshake) {
        if self.timers.len() >= TIMERS_MAX {
            // Deadlines of handshakes and requests already gone (a flood evicts them by
            // the thousand) would otherwise pile up until they come due.
            let (live, listeners) = (&self.handshakes, &self.listeners);
            self.timers.retain(|Reverse((_, timer))| match timer {
                Timer::Handshake(t) => live.contains_key(t),
                Timer::Pending(l, id) => listeners
                    .get(l)
                    .is_some_and(|e| e.l.pending.lock().contains_key(id)),
                Timer::Rearm(_) => true,
            });
        }
        self.timers.push(Reverse((h.deadline, Timer::Handshake(t))));
        self.handshakes.insert(t, h);
        dev.counters
            .handshakes_active
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Take a handshake out of the reactor (finished, failed, evicted or timed out).
    fn remove(&mut self, dev: &Shared, t: u64) -> Option<Handshake> {
        let h = self.handshakes.remove(&t)?;
        let _ = self.r.epoll.delete(&h.stream);
        dev.counters
            .handshakes_active
            .fetch_sub(1, Ordering::Relaxed);
        if let Phase::Request { listener, .. } = &h.phase {
            if let Some(e) = self.listeners.get_mut(listener) {
                e.in_handshake.remove(&t);
            }
        }
        Some(h)
    }

    /// End a handshake unfinished: a passive one is reset, an active one reports why.
    fn drop_handshake(&mut self, dev: &Shared, t: u64) {
        if let Some(h) = self.remove(dev, t) {
            self.fail(
                h,
                HandshakeError::Io(io::ErrorKind::ConnectionAborted.into()),
            );
        }
    }

    fn fail(&mut self, h: Handshake, why: HandshakeError) {
        match h.phase {
            Phase::Request { .. } => {
                tracing::debug!(peer = %h.peer, "siw MPA request failed: {why}");
                set_linger_zero(&h.stream);
            }
            Phase::Connecting { qp, params, .. } | Phase::Reply { qp, params, .. } => {
                set_linger_zero(&h.stream);
                super::active_done(&qp, params, Err(why));
            }
        }
    }

    fn start_active(&mut self, dev: &Shared, a: Active) {
        let t = self.r.token();
        let interest = EpollFlags::EPOLLOUT;
        if let Err(err) = self.r.epoll.add(&a.stream, EpollEvent::new(interest, t)) {
            let params = ActiveParams {
                peer: a.peer,
                ird: a.ird,
                ord: a.ord,
            };
            return super::active_done(&a.qp, params, Err(io::Error::from(err).into()));
        }
        self.insert(
            dev,
            t,
            Handshake {
                stream: a.stream,
                peer: a.peer,
                deadline: Instant::now() + MPA_TIMEOUT,
                phase: Phase::Connecting {
                    qp: a.qp,
                    request: a.request,
                    params: ActiveParams {
                        peer: a.peer,
                        ird: a.ird,
                        ord: a.ord,
                    },
                },
            },
        );
    }

    fn handshake_ready(&mut self, dev: &Shared, t: u64) {
        let Some(h) = self.handshakes.get_mut(&t) else {
            return;
        };
        match progress(&self.r.epoll, t, h) {
            Ok(None) => {}
            Ok(Some(frame)) => {
                if let Some(h) = self.remove(dev, t) {
                    self.complete(dev, h, frame);
                }
            }
            Err(why) => {
                if let Some(h) = self.remove(dev, t) {
                    dev.counters.bad_mpa.fetch_add(1, Ordering::Relaxed);
                    self.fail(h, why);
                }
            }
        }
    }

    /// A handshake whose frame is in: a passive Request goes to its listener, an
    /// active Reply ends the connect.
    fn complete(&mut self, dev: &Shared, h: Handshake, frame: MpaFrame) {
        let Handshake {
            mut stream,
            peer,
            phase,
            ..
        } = h;
        match phase {
            Phase::Request { listener, .. } => {
                if frame.reply || frame.markers {
                    // Markers are not supported (kernel siw refuses them too); a Reply
                    // here is not a connection request.
                    tracing::debug!(%peer, markers = frame.markers, "siw refusing MPA request");
                    dev.counters.bad_mpa.fetch_add(1, Ordering::Relaxed);
                    let reject = mpa_frame(true, false, true, frame.revision, 0, 0, &[]);
                    let _ = send_mpa(&mut stream, &reject);
                    return;
                }
                let Some(e) = self.listeners.get(&listener) else {
                    return;
                };
                if let Some(id) = e.l.add_request(stream, frame, peer) {
                    let expires = Instant::now() + PENDING_TTL;
                    self.timers
                        .push(Reverse((expires, Timer::Pending(listener, id))));
                }
            }
            Phase::Reply { qp, params, .. } => super::active_done(&qp, params, Ok((frame, stream))),
            Phase::Connecting { .. } => {}
        }
    }

    fn fire_timers(&mut self, dev: &Shared) {
        let now = Instant::now();
        while let Some(Reverse((at, timer))) = self.timers.peek().copied() {
            if at > now {
                return;
            }
            self.timers.pop();
            match timer {
                Timer::Handshake(t) => {
                    if self.handshakes.get(&t).is_some_and(|h| h.deadline <= now) {
                        dev.counters
                            .handshake_timeouts
                            .fetch_add(1, Ordering::Relaxed);
                        if let Some(h) = self.remove(dev, t) {
                            self.fail(h, HandshakeError::Io(io::ErrorKind::TimedOut.into()));
                        }
                    }
                }
                Timer::Pending(listener, id) => {
                    if let Some(e) = self.listeners.get(&listener) {
                        e.l.expire(id, now);
                    }
                }
                Timer::Rearm(token) => {
                    if self.listeners.get(&token).is_some_and(|e| !e.armed) {
                        self.arm(token);
                    }
                }
            }
        }
    }
}

/// Read or write what a handshake is waiting for: its frame once complete.
fn progress(epoll: &Epoll, t: u64, h: &mut Handshake) -> Result<Option<MpaFrame>, HandshakeError> {
    match &mut h.phase {
        Phase::Request { mpa, .. } | Phase::Reply { mpa, .. } => mpa.read_from(&mut h.stream),
        Phase::Connecting {
            qp,
            request,
            params,
        } => {
            if let Some(e) = h.stream.take_error()? {
                return Err(e.into());
            }
            h.stream.peer_addr()?; // connected, not merely woken
            h.stream.write_all(request)?;
            epoll
                .modify(&h.stream, &mut EpollEvent::new(EpollFlags::EPOLLIN, t))
                .map_err(io::Error::from)?;
            h.phase = Phase::Reply {
                qp: qp.clone(),
                mpa: MpaReader::default(),
                params: *params,
            };
            Ok(None)
        }
    }
}

/// Reset a connection the listener has no room for.
fn refuse(dev: &Shared, stream: TcpStream, why: &str) {
    dev.counters
        .connections_refused
        .fetch_add(1, Ordering::Relaxed);
    tracing::debug!(peer = ?stream.peer_addr().ok(), why, "siw connection refused");
    set_linger_zero(&stream);
}
