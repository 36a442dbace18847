//! [`SdpStream`] and [`SdpListener`]: SDP sockets in the shape of `std::net`'s TCP ones.
//!
//! Each has a real file descriptor ([`AsRawFd`]) that `poll`, `select`, `epoll`, mio and
//! tokio can wait on: a stream's is its readiness face (readable, writable, end of file
//! and hang-up as a TCP socket's would be; see [`crate::readiness`]), a listener's is
//! readable while connection requests wait.

use crate::conn::{local_ip_for, Conn, Options};
use crate::device::Device;
use krdma_itapi::{Evd, EvdFlags, Event, EventStream, Listener};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn itapi_err(e: krdma_itapi::Error) -> io::Error {
    io::Error::other(e.to_string())
}

/// Reservations [`SdpListener::bind_with`] tries past the first for a listener on any port
/// whose transport port (iWARP: the port plus the offset) another socket holds.
const ANY_PORT_TRIES: usize = 16;

/// Hold a port of the host's TCP port space for an SDP socket: a kernel TCP socket bound
/// to it (never listening), so TCP and SDP sockets never share a port by accident.
pub(crate) fn reserve_port(at: SocketAddr) -> io::Result<(OwnedFd, SocketAddr)> {
    use nix::sys::socket::{
        bind, getsockname, socket, AddressFamily, SockFlag, SockType, SockaddrStorage,
    };
    let family = if at.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(at))?;
    let got: SockaddrStorage = getsockname(fd.as_raw_fd())?;
    let addr = got
        .as_sockaddr_in()
        .map(|a| SocketAddr::from(std::net::SocketAddrV4::from(*a)))
        .or_else(|| {
            got.as_sockaddr_in6()
                .map(|a| SocketAddr::from(std::net::SocketAddrV6::from(*a)))
        })
        .ok_or_else(|| io::Error::other("getsockname gave no IP address"))?;
    Ok((fd, addr))
}

/// A connected SDP socket.
pub struct SdpStream {
    conn: Arc<Conn>,
    face: OwnedFd,
    _port: Option<OwnedFd>,
    nonblocking: AtomicBool,
    timeouts: Mutex<(Option<Duration>, Option<Duration>)>,
    linger: Mutex<Option<Duration>>,
    nodelay: AtomicBool,
}

impl std::fmt::Debug for SdpStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SdpStream")
            .field("local", &self.conn.local)
            .field("peer", &self.conn.peer)
            .field("fd", &self.face.as_raw_fd())
            .finish()
    }
}

impl SdpStream {
    /// Connect over SDP (the adapter `KRDMA_SDP_DEVICE` names, `siw0` by default).
    pub fn connect(addr: impl ToSocketAddrs) -> io::Result<SdpStream> {
        Self::connect_with(addr, &Options::default())
    }

    /// Connect over SDP with `opts`; tries each address `addr` resolves to.
    pub fn connect_with(addr: impl ToSocketAddrs, opts: &Options) -> io::Result<SdpStream> {
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address");
        for peer in addr.to_socket_addrs()? {
            match Self::connect_one(peer, opts) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn connect_one(peer: SocketAddr, opts: &Options) -> io::Result<SdpStream> {
        let dev = Device::get(opts.target.as_ref(), &opts.device).map_err(itapi_err)?;
        let ip = local_ip_for(&dev, peer.ip());
        let (port, local) = reserve_port(SocketAddr::new(ip, 0))?;
        let (conn, face) = Conn::connect(opts, local, peer)?;
        Ok(SdpStream::new(conn, face, Some(port)))
    }

    pub(crate) fn new(conn: Arc<Conn>, face: OwnedFd, port: Option<OwnedFd>) -> SdpStream {
        SdpStream {
            conn,
            face,
            _port: port,
            nonblocking: AtomicBool::new(false),
            timeouts: Mutex::new((None, None)),
            linger: Mutex::new(None),
            nodelay: AtomicBool::new(true),
        }
    }

    /// Hand the connection to the kernel: the returned socket carries its bytes, relayed
    /// by this process (see the `conn` module's relay), so it can go where an `SdpStream`
    /// cannot — to a child process across `fork` and `exec` (as its standard input, say),
    /// or to another process with `SCM_RIGHTS` — and be used there as an ordinary stream
    /// socket. The connection closes once every copy of the socket is closed, and ends
    /// with this process. Bytes already received come first; the peer's zero-copy
    /// adverts are declined from now on (its bytes come by buffered copy).
    pub fn into_relayed(self) -> io::Result<std::os::unix::net::UnixStream> {
        self.conn.relay(self.face.as_fd())?;
        let face = self.face.try_clone()?;
        Ok(std::os::unix::net::UnixStream::from(face))
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.conn.peer)
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.conn.local)
    }

    /// Shut down the write half (DisConn once everything written has gone), the read
    /// half (further reads return end of file), or both.
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            self.conn.shutdown_write();
        }
        Ok(())
    }

    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
        Ok(())
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        self.timeouts.lock().unwrap_or_else(|e| e.into_inner()).0 = t;
        Ok(())
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        self.timeouts.lock().unwrap_or_else(|e| e.into_inner()).1 = t;
        Ok(())
    }

    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.timeouts.lock().unwrap_or_else(|e| e.into_inner()).0)
    }

    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.timeouts.lock().unwrap_or_else(|e| e.into_inner()).1)
    }

    /// `TCP_NODELAY`: SDP sends every write at once (there is no Nagle delay to turn
    /// off); the value is kept for `nodelay`.
    pub fn set_nodelay(&self, nodelay: bool) -> io::Result<()> {
        self.nodelay.store(nodelay, Ordering::Relaxed);
        Ok(())
    }

    pub fn nodelay(&self) -> io::Result<bool> {
        Ok(self.nodelay.load(Ordering::Relaxed))
    }

    /// `SO_LINGER`: `Some(ZERO)` makes dropping the stream abort the connection
    /// (AbortConn, as TCP sends a reset); otherwise the close is orderly.
    pub fn set_linger(&self, linger: Option<Duration>) -> io::Result<()> {
        *self.linger.lock().unwrap_or_else(|e| e.into_inner()) = linger;
        Ok(())
    }

    pub fn linger(&self) -> io::Result<Option<Duration>> {
        Ok(*self.linger.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// `SO_KEEPALIVE`: an empty message after `idle` of silence (the transport's retries
    /// then find a dead peer); `None` turns it off.
    pub fn set_keepalive(&self, idle: Option<Duration>) -> io::Result<()> {
        self.conn.lock().proto.set_keepalive(idle);
        Ok(())
    }

    /// Send one byte of out-of-band data (`MSG_OOB`).
    pub fn send_oob(&self, byte: u8) -> io::Result<()> {
        self.conn.send_oob(byte)
    }

    /// The out-of-band byte received, if any.
    pub fn recv_oob(&self) -> Option<u8> {
        self.conn.recv_oob()
    }

    /// Bytes that can be read now without waiting (`FIONREAD`).
    pub fn bytes_readable(&self) -> usize {
        self.conn.readable_bytes()
    }

    /// The connection's protocol phase, counters and credits.
    pub fn stats(&self) -> (crate::proto::Phase, crate::proto::Counters, i64) {
        self.conn.snapshot()
    }

    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        Ok(self.conn.lock().proto.error().map(crate::conn::io_error))
    }

    fn deadline(&self, read: bool) -> Option<Instant> {
        let t = self.timeouts.lock().unwrap_or_else(|e| e.into_inner());
        let d = if read { t.0 } else { t.1 };
        d.map(|d| Instant::now() + d)
    }

    fn block(&self) -> bool {
        !self.nonblocking.load(Ordering::Relaxed)
    }
}

impl Read for &SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.conn
            .read(self.face.as_fd(), buf, self.block(), self.deadline(true))
    }
}

impl Write for &SdpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.conn
            .write(self.face.as_fd(), buf, self.block(), self.deadline(false))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for SdpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for SdpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsFd for SdpStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.face.as_fd()
    }
}

impl AsRawFd for SdpStream {
    fn as_raw_fd(&self) -> RawFd {
        self.face.as_raw_fd()
    }
}

impl Drop for SdpStream {
    fn drop(&mut self) {
        if self.conn.is_relayed() {
            // Its face's holders own it now (`into_relayed`).
            return;
        }
        if *self.linger.lock().unwrap_or_else(|e| e.into_inner()) == Some(Duration::ZERO) {
            self.conn.abort();
        }
        self.conn.close();
    }
}

/// A listening SDP socket.
pub struct SdpListener {
    dev: Arc<crate::device::Device>,
    opts: Options,
    req: Evd,
    _listener: Listener,
    local: SocketAddr,
    _port: Option<OwnedFd>,
    nonblocking: AtomicBool,
}

impl SdpListener {
    /// Listen on `addr` over SDP (port 0 picks a free port of the host's port space).
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<SdpListener> {
        Self::bind_with(addr, &Options::default())
    }

    pub fn bind_with(addr: impl ToSocketAddrs, opts: &Options) -> io::Result<SdpListener> {
        let at = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address"))?;
        if at.port() != 0 {
            return Self::listen_at(at, None, opts);
        }
        // Any port: the kernel picks a free one for the reservation, but over iWARP the
        // listener sits at that port plus the offset, which another socket of the host may
        // hold. Then take another reservation (keeping the refused ones until done, so the
        // kernel does not hand the same port back).
        let mut refused = Vec::new();
        loop {
            let (guard, local) = reserve_port(at)?;
            match Self::listen_at(local, None, opts) {
                Err(e)
                    if e.kind() == io::ErrorKind::AddrInUse && refused.len() < ANY_PORT_TRIES =>
                {
                    tracing::debug!(%local, "SDP: transport port of a free port taken; another");
                    refused.push(guard);
                }
                Ok(mut l) => {
                    l._port = Some(guard);
                    return Ok(l);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Listen over SDP at `local` (its port already decided; `guard` holds it).
    pub fn listen_at(
        local: SocketAddr,
        guard: Option<OwnedFd>,
        opts: &Options,
    ) -> io::Result<SdpListener> {
        let dev = Device::get(opts.target.as_ref(), &opts.device).map_err(itapi_err)?;
        let req = Evd::create(
            &dev.ia,
            EventStream::CmRequest,
            EvdFlags::CREATE_FD,
            256,
            1,
            None,
        )
        .map_err(itapi_err)?;
        let port = opts.transport_port(&dev, local.port());
        let listener = Listener::create(&dev.ia, 0, &req, port).map_err(|e| match e {
            krdma_itapi::Error::ConnQualBusy => io::Error::from(io::ErrorKind::AddrInUse),
            e => itapi_err(e),
        })?;
        tracing::info!(%local, device = %opts.device, transport_port = port, "SDP listening");
        Ok(SdpListener {
            dev,
            opts: opts.clone(),
            req,
            _listener: listener,
            local,
            _port: guard,
            nonblocking: AtomicBool::new(false),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local)
    }

    pub fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
        Ok(())
    }

    /// Accept the next connection (its Hello checked; a bad one is refused and the next
    /// one waited for).
    pub fn accept(&self) -> io::Result<(SdpStream, SocketAddr)> {
        loop {
            match self.try_accept()? {
                Some(s) => return Ok(s),
                None if self.nonblocking.load(Ordering::Relaxed) => {
                    return Err(io::ErrorKind::WouldBlock.into())
                }
                None => {
                    let mut p = [PollFd::new(self.as_fd(), PollFlags::POLLIN)];
                    match poll(&mut p, PollTimeout::NONE) {
                        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }

    /// Accept a waiting connection, if there is one.
    pub(crate) fn try_accept(&self) -> io::Result<Option<(SdpStream, SocketAddr)>> {
        Ok(self.try_accept_conn()?.map(|(conn, face)| {
            let peer = conn.peer;
            (SdpStream::new(conn, face, None), peer)
        }))
    }

    /// Accept a waiting connection, if there is one: the connection and its face (for a
    /// socket layer of its own, as the preload library's).
    pub fn try_accept_conn(&self) -> io::Result<Option<(Arc<Conn>, OwnedFd)>> {
        while let Ok(ev) = self.req.dequeue() {
            let Event::ConnRequest(r) = ev else { continue };
            let local = SocketAddr::new(
                if self.local.ip().is_unspecified() {
                    local_ip_for(
                        &self.dev,
                        r.source.map(|s| s.ip()).unwrap_or(self.local.ip()),
                    )
                } else {
                    self.local.ip()
                },
                self.local.port(),
            );
            match Conn::accept(self.dev.clone(), &self.opts, local, &r) {
                Ok(c) => return Ok(Some(c)),
                Err(e) => tracing::info!(error = %e, "SDP connection not accepted"),
            }
        }
        Ok(None)
    }

    /// Connections as they come.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<SdpStream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(s, _)| s)))
    }
}

impl AsFd for SdpListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.req.fd().expect("the request EVD has a descriptor")
    }
}

impl AsRawFd for SdpListener {
    fn as_raw_fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }
}
