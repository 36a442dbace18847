//! Traffic generators shared by `krdma perf`, the README's main job and the tests:
//! a connected pair of endpoints, bandwidth and ping-pong latency runs over RDMA, and
//! the raw-TCP baseline the same run is compared against.

use rnicpi::{
    send_flags, Access, ConnParam, Cqe, QpCaps, QpType, Result, VerbsError, WcStatus, Wqe, WrOpcode,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::RegBuf;
use ual::{Context, Cq, Listener, Mr, Pd, Qp, QpConfig};

const TIMEOUT: Duration = Duration::from_secs(30);
/// wr_id of the receiver's "all receives posted" message.
const READY: u64 = u64::MAX - 1;
/// wr_id of the receiver's credit messages in a Send bandwidth run.
const CREDIT: u64 = u64::MAX - 2;

/// One side of a connection with a registered buffer.
pub struct Endpoint {
    pub qp: Arc<Qp>,
    pub cq: Arc<Cq>,
    pub mr: Arc<Mr>,
    pub buf: Arc<RegBuf>,
    pub pd: Arc<Pd>,
    /// The peer's buffer: (address, rkey, length), exchanged in the private data.
    pub remote: (u64, u32, u64),
    /// Send/receive queue depth.
    pub depth: u32,
}

/// What an endpoint's buffer allows: local writes, and remote Writes and Reads.
pub const ENDPOINT_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

/// An endpoint's verbs objects (one CQ for both queues, `depth` slots in each queue and
/// twice that in the CQ); `remote` is filled in once the peer's offer arrives.
pub fn new_endpoint(ctx: &Arc<Context>, dev: u32, buf_len: usize, depth: u32) -> Result<Endpoint> {
    new_endpoint_with(ctx, dev, buf_len, depth, ENDPOINT_ACCESS, QpType::Rc)
}

/// [`new_endpoint`] with the buffer registered for `access` and a QP of `qp_type`.
pub fn new_endpoint_with(
    ctx: &Arc<Context>,
    dev: u32,
    buf_len: usize,
    depth: u32,
    access: Access,
    qp_type: QpType,
) -> Result<Endpoint> {
    let cq = ctx.create_cq(dev, depth * 2 + 8)?;
    endpoint_on(ctx, dev, cq, buf_len, depth, access, qp_type)
}

/// [`new_endpoint_with`] over a CQ the caller made (at least `2 * depth` deep), with a QP
/// of `qp_type`.
pub fn endpoint_on(
    ctx: &Arc<Context>,
    dev: u32,
    cq: Arc<Cq>,
    buf_len: usize,
    depth: u32,
    access: Access,
    qp_type: QpType,
) -> Result<Endpoint> {
    let pd = ctx.alloc_pd(dev)?;
    let caps = QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 2,
        max_recv_sge: 2,
        max_inline: 64,
    };
    let qp = ctx.create_qp(
        &pd,
        &cq,
        &cq,
        QpConfig {
            caps,
            qp_type,
            ..Default::default()
        },
    )?;
    let buf = RegBuf::new(buf_len.max(64))?;
    let mr = ctx.reg_buf(&pd, &buf, access)?;
    Ok(Endpoint {
        qp,
        cq,
        mr,
        buf,
        pd,
        remote: (0, 0, 0),
        depth,
    })
}

fn advertise(mr: &Mr) -> Vec<u8> {
    let mut v = Vec::with_capacity(20);
    v.extend_from_slice(&mr.addr.to_be_bytes());
    v.extend_from_slice(&mr.rkey.to_be_bytes());
    v.extend_from_slice(&mr.len.to_be_bytes());
    v
}

fn parse_advert(p: &[u8]) -> Result<(u64, u32, u64)> {
    if p.len() < 20 {
        return Err(VerbsError::Invalid);
    }
    let u64at = |i: usize| u64::from_be_bytes(p[i..i + 8].try_into().unwrap());
    Ok((
        u64at(0),
        u32::from_be_bytes(p[8..12].try_into().unwrap()),
        u64at(12),
    ))
}

/// Accept one connection on `listener` (server side of [`connect_pair`]).
pub fn accept_endpoint(
    ctx: &Arc<Context>,
    dev: u32,
    listener: &Listener,
    buf_len: usize,
    depth: u32,
) -> Result<Endpoint> {
    accept_into(listener, new_endpoint(ctx, dev, buf_len, depth)?)
}

/// Accept one connection on `listener` into `ep` (an endpoint not yet connected).
pub fn accept_into(listener: &Listener, mut ep: Endpoint) -> Result<Endpoint> {
    let req = listener.get_request(TIMEOUT)?;
    let remote = parse_advert(&req.private_data)?;
    listener.accept(req.conn_id, &ep.qp, &ep.offer())?;
    let ev = ep.qp.next_event(TIMEOUT)?;
    if ev.kind != rnicpi::EventKind::Established {
        return Err(VerbsError::ConnectionReset);
    }
    ep.remote = remote;
    Ok(ep)
}

/// Connect to `peer` (client side).
pub fn connect_endpoint(
    ctx: &Arc<Context>,
    dev: u32,
    peer: SocketAddr,
    buf_len: usize,
    depth: u32,
) -> Result<Endpoint> {
    let mut ep = new_endpoint(ctx, dev, buf_len, depth)?;
    let ev = ep.qp.connect_wait(peer, &ep.offer(), TIMEOUT)?;
    ep.remote = parse_advert(&ev.private_data)?;
    Ok(ep)
}

/// A connected pair over device `dev` on loopback, each side on its own context.
pub fn connect_pair(
    server: &Arc<Context>,
    client: &Arc<Context>,
    dev_name: &str,
    buf_len: usize,
    depth: u32,
) -> Result<(Endpoint, Endpoint)> {
    let sdev = server.device(dev_name)?.index;
    let cdev = client.device(dev_name)?.index;
    let ip = loopback_of(server, sdev)?;
    let listener = server.listen(sdev, SocketAddr::new(ip, 0), 16)?;
    let addr = SocketAddr::new(ip, listener.port);
    let c2 = client.clone();
    let t = std::thread::spawn(move || connect_endpoint(&c2, cdev, addr, buf_len, depth));
    let s = accept_endpoint(server, sdev, &listener, buf_len, depth);
    let c = t.join().map_err(|_| VerbsError::Io)?;
    Ok((s?, c?))
}

/// The loopback address device `dev` serves (its first IPv4 loopback GID; 127.0.0.1
/// when it serves every address).
pub fn loopback_of(ctx: &Context, dev: u32) -> Result<std::net::IpAddr> {
    let gids = ctx.query_port(dev, 1)?.gids;
    Ok(gids
        .into_iter()
        .map(rnicpi::gid_to_ip)
        .find(|ip| ip.is_loopback() && ip.is_ipv4())
        .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1])))
}

fn expect_ok(c: &Cqe) -> Result<()> {
    if c.status() == WcStatus::Success {
        Ok(())
    } else {
        tracing::warn!(status = ?c.status(), wr_id = c.wr_id, "work request failed");
        Err(VerbsError::Io)
    }
}

impl Endpoint {
    /// Connection parameters offering this endpoint's buffer to the peer.
    pub fn offer(&self) -> ConnParam {
        ConnParam {
            private_data: advertise(&self.mr),
            ird: 16,
            ord: 16,
        }
    }

    /// Post a receive covering `len` bytes of the buffer at `offset`.
    pub fn post_recv(&self, wr_id: u64, offset: u64, len: u32) -> Result<()> {
        self.qp
            .post_recv(&Wqe::recv(wr_id, &[self.mr.sge(offset, len)]))
    }

    pub fn send(&self, wr_id: u64, offset: u64, len: u32, flags: u8) -> Result<()> {
        self.qp.post_send(
            &Wqe::new(wr_id, WrOpcode::Send, &[self.mr.sge(offset, len)]).with_flags(flags),
        )
    }

    pub fn write(
        &self,
        wr_id: u64,
        offset: u64,
        len: u32,
        remote_off: u64,
        flags: u8,
    ) -> Result<()> {
        let w = Wqe::new(wr_id, WrOpcode::RdmaWrite, &[self.mr.sge(offset, len)])
            .with_remote(self.remote.0 + remote_off, self.remote.1)
            .with_flags(flags);
        self.qp.post_send(&w)
    }

    pub fn read(&self, wr_id: u64, offset: u64, len: u32, remote_off: u64) -> Result<()> {
        self.read_with(wr_id, offset, len, remote_off, send_flags::SIGNALED)
    }

    /// An RDMA Read with explicit send flags (unsignaled for CQ moderation).
    pub fn read_with(
        &self,
        wr_id: u64,
        offset: u64,
        len: u32,
        remote_off: u64,
        flags: u8,
    ) -> Result<()> {
        let w = Wqe::new(wr_id, WrOpcode::RdmaRead, &[self.mr.sge(offset, len)])
            .with_remote(self.remote.0 + remote_off, self.remote.1)
            .with_flags(flags);
        self.qp.post_send(&w)
    }

    /// Wait for `n` successful completions.
    pub fn complete(&self, n: usize) -> Result<Vec<Cqe>> {
        let cs = self.cq.wait(n, TIMEOUT)?;
        cs.iter().try_for_each(expect_ok)?;
        Ok(cs)
    }

    /// Wait for one completion (polling, then sleeping: [`Cq::wait`]).
    fn next_one(&self) -> Result<Cqe> {
        let c = self.cq.wait(1, TIMEOUT)?[0];
        expect_ok(&c)?;
        Ok(c)
    }
}

/// Which RDMA operation a bandwidth run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Write,
    Send,
    Read,
}

/// Stream `total` bytes in `msg`-sized messages from `client` to `server` (or read them,
/// for `Op::Read`) with `window` in flight; returns bytes per second. The clock stops when
/// the server has seen the last byte (a final Send after the data orders behind it).
///
/// Sends need a receive posted before they land (iWARP has no RNR retry: one too early
/// ends the connection), so a Send run longer than the server's receive queue is credited:
/// the server posts a queue's worth, announces it (READY), and after every half queue it
/// posts again it sends a 1-byte credit message; the client sends no further than it has
/// been granted. Both ends count the credits the same way, so the client knows which of
/// its receives are credits and which is the server's final message.
pub fn bandwidth(
    server: &Endpoint,
    client: &Endpoint,
    op: Op,
    msg: u32,
    total: u64,
    window: u32,
) -> Result<f64> {
    let count = (total / msg as u64).max(1);
    let sig = send_flags::SIGNALED;
    let credits = Credits::new(op, count, server.depth);
    // Every receive a message may land in is posted before the peer can send it.
    if op != Op::Send {
        server.post_recv(u64::MAX, 0, 0)?;
    }
    std::thread::scope(|s| {
        let srv = s.spawn(move || -> Result<()> {
            if op == Op::Send {
                let mut posted = credits.first;
                for i in 0..posted {
                    server.post_recv(i, 0, msg)?;
                }
                server.send(READY, 0, 0, sig)?;
                let (mut done, mut fresh) = (0u64, 0u64);
                while done < count {
                    if server.next_one()?.opcode() != Some(rnicpi::WcOpcode::Recv) {
                        continue;
                    }
                    done += 1;
                    if posted < count {
                        server.post_recv(posted, 0, msg)?;
                        posted += 1;
                        fresh += 1;
                        if fresh == credits.batch || posted == count {
                            server.send(CREDIT, 0, 1, sig)?;
                            fresh = 0;
                        }
                    }
                }
            } else {
                server.next_one()?;
            }
            server.send(1, 0, 0, sig)?;
            // Our last Send's completion (credits' may come before it).
            while server.next_one()?.wr_id != 1 {}
            Ok(())
        });
        // Receives are consumed in posting order: the one for READY goes first.
        if op == Op::Send {
            client.post_recv(READY, 0, 0)?;
            while client.next_one()?.wr_id != READY {}
        }
        let mut inbox = Inbox::open(client, credits.messages + 1)?;
        let start = Instant::now();
        let mut posted = 0u64;
        let mut done = 0u64;
        while done < count {
            while posted < count.min(credits.granted(inbox.read)) && posted - done < window as u64 {
                match op {
                    Op::Write => client.write(posted, 0, msg, 0, sig)?,
                    Op::Send => client.send(posted, 0, msg, sig)?,
                    Op::Read => client.read(posted, 0, msg, 0)?,
                }
                posted += 1;
            }
            let c = client.next_one()?;
            if c.opcode() == Some(rnicpi::WcOpcode::Recv) {
                inbox.read_one()?;
            } else {
                done += 1;
            }
        }
        if op != Op::Send {
            client.send(2, 0, 0, sig)?;
        }
        // Wait for the server's final message (and our own last send completion).
        let mut got_send = op == Op::Send;
        while !(inbox.read > credits.messages && got_send) {
            let c = client.next_one()?;
            if c.opcode() == Some(rnicpi::WcOpcode::Recv) {
                inbox.read_one()?;
            } else {
                got_send = true;
            }
        }
        let secs = start.elapsed().as_secs_f64();
        srv.join().map_err(|_| VerbsError::Io)??;
        Ok(count as f64 * msg as f64 / secs)
    })
}

/// How a Send bandwidth run is credited (Writes and Reads need no receives: one grant of
/// everything, no credit messages).
#[derive(Debug, Clone, Copy)]
struct Credits {
    /// Sends granted before any credit message (the receives posted first).
    first: u64,
    /// Sends each credit message grants (the last may grant more than are left).
    batch: u64,
    /// Credit messages the server sends.
    messages: u64,
}

impl Credits {
    /// The server sends credit `k` once it has received `k * batch` Sends, and the client
    /// has sent at most `first + j * batch` when it has read `j` credits: so at most
    /// `first / batch <= 2` credits (and then the final message) are ever unread.
    fn new(op: Op, count: u64, depth: u32) -> Self {
        if op != Op::Send {
            return Credits {
                first: count,
                batch: count,
                messages: 0,
            };
        }
        let first = count.min(depth.max(1) as u64);
        let batch = (depth as u64).div_ceil(2).max(1);
        Credits {
            first,
            batch,
            messages: (count - first).div_ceil(batch),
        }
    }

    /// Sends granted once `read` of the client's receives have completed.
    fn granted(&self, read: u64) -> u64 {
        self.first + read.min(self.messages) * self.batch
    }
}

/// The client's receives in a bandwidth run: the credit messages, then the server's
/// final message (`expected` in all). At most three of them can be unread at once (see
/// [`Credits::new`]), so four are kept posted.
struct Inbox<'a> {
    ep: &'a Endpoint,
    /// Receives completed so far.
    read: u64,
    posted: u64,
    expected: u64,
}

impl<'a> Inbox<'a> {
    fn open(ep: &'a Endpoint, expected: u64) -> Result<Self> {
        let posted = expected.min(4).min(ep.depth as u64);
        for _ in 0..posted {
            ep.post_recv(u64::MAX, 0, 1)?;
        }
        Ok(Inbox {
            ep,
            read: 0,
            posted,
            expected,
        })
    }

    /// One of them completed: post the next, if one is still to come.
    fn read_one(&mut self) -> Result<()> {
        self.read += 1;
        if self.posted < self.expected {
            self.posted += 1;
            self.ep.post_recv(u64::MAX, 0, 1)?;
        }
        Ok(())
    }
}

/// Ping-pong `iters` Sends of `size` bytes; returns one-way latencies in microseconds
/// (half of each round trip), sorted.
pub fn pingpong(server: &Endpoint, client: &Endpoint, size: u32, iters: u32) -> Result<Vec<f64>> {
    let sig = send_flags::SIGNALED;
    let inline = if size <= 64 { send_flags::INLINE } else { 0 };
    let wqe = |ep: &Endpoint| {
        let w = Wqe::new(0, WrOpcode::Send, &[ep.mr.sge(0, size)]).with_flags(sig);
        if inline != 0 {
            let mut data = vec![0u8; size as usize];
            ep.buf.read(0, &mut data);
            w.with_inline(&data).unwrap().with_flags(sig | inline)
        } else {
            w
        }
    };
    server.post_recv(0, 0, size)?;
    client.post_recv(0, 0, size)?;
    std::thread::scope(|s| {
        let srv = s.spawn(move || -> Result<()> {
            let w = wqe(server);
            for _ in 0..iters {
                loop {
                    let c = server.next_one()?;
                    if c.opcode() == Some(rnicpi::WcOpcode::Recv) {
                        break;
                    }
                }
                server.post_recv(0, 0, size)?;
                server.qp.post_send(&w)?;
            }
            Ok(())
        });
        let w = wqe(client);
        let mut lat = Vec::with_capacity(iters as usize);
        for _ in 0..iters {
            let t = Instant::now();
            client.qp.post_send(&w)?;
            loop {
                let c = client.next_one()?;
                if c.opcode() == Some(rnicpi::WcOpcode::Recv) {
                    break;
                }
            }
            lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
            client.post_recv(0, 0, size)?;
        }
        srv.join().map_err(|_| VerbsError::Io)??;
        lat.sort_by(|a, b| a.total_cmp(b));
        Ok(lat)
    })
}

/// Raw TCP on loopback: bytes per second streaming `total` bytes in `msg` writes.
pub fn tcp_bandwidth(msg: usize, total: u64) -> std::io::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let srv = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = total;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = s.read(&mut buf[..want])?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            left -= n as u64;
        }
        s.write_all(&[1])
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let buf = vec![7u8; msg];
    let start = Instant::now();
    let mut left = total;
    while left > 0 {
        let n = left.min(msg as u64) as usize;
        c.write_all(&buf[..n])?;
        left -= n as u64;
    }
    let mut ack = [0u8];
    c.read_exact(&mut ack)?;
    let secs = start.elapsed().as_secs_f64();
    srv.join()
        .map_err(|_| std::io::Error::other("server panicked"))??;
    Ok(total as f64 / secs)
}

/// How a raw baseline's ping-pong waits for the next message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReaderWait {
    /// Asleep in `read`/`recv`: a wake-up per message.
    Sleep,
    /// As a krdma consumer waits on its CQ ([`ual::Cq::wait`]): non-blocking reads,
    /// yielding the CPU between them, for up to [`ual::SPIN_BUDGET`], then asleep in
    /// `poll`. The like-for-like baseline for [`pingpong`].
    Poll,
}

impl ReaderWait {
    /// Whether the sockets are non-blocking for this wait.
    fn nonblocking(self) -> bool {
        self == ReaderWait::Poll
    }

    /// Run `io` on `sock`: asleep, once (the socket blocks); polling, until it does not
    /// find the socket empty (or full), yielding between tries for up to
    /// [`ual::SPIN_BUDGET`], then asleep in `poll` (giving up after 5 s).
    fn run<T>(
        self,
        sock: &impl AsFd,
        ready: nix::poll::PollFlags,
        mut io: impl FnMut() -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        if self == ReaderWait::Sleep {
            return io();
        }
        let start = Instant::now();
        loop {
            match io() {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            if start.elapsed() < ual::SPIN_BUDGET {
                std::thread::yield_now();
                continue;
            }
            let mut fds = [nix::poll::PollFd::new(sock.as_fd(), ready)];
            if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(5000u16))? == 0 {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
        }
    }
}

/// `buf.len()` bytes from a TCP stream, waiting as `wait` says.
fn tcp_read_exact(s: &TcpStream, buf: &mut [u8], wait: ReaderWait) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let n = wait.run(s, nix::poll::PollFlags::POLLIN, || {
            (&*s).read(&mut buf[got..])
        })?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(())
}

/// All of `buf` onto a TCP stream, waiting for room as `wait` says.
fn tcp_write_all(s: &TcpStream, buf: &[u8], wait: ReaderWait) -> std::io::Result<()> {
    let mut put = 0;
    while put < buf.len() {
        put += wait.run(s, nix::poll::PollFlags::POLLOUT, || {
            (&*s).write(&buf[put..])
        })?;
    }
    Ok(())
}

/// Raw TCP ping-pong on loopback, both ends waiting as `wait` says; one-way latencies in
/// microseconds, sorted.
pub fn tcp_pingpong(size: usize, iters: u32, wait: ReaderWait) -> std::io::Result<Vec<f64>> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let srv = std::thread::spawn(move || -> std::io::Result<()> {
        let (s, _) = l.accept()?;
        s.set_nodelay(true)?;
        s.set_nonblocking(wait.nonblocking())?;
        let mut b = vec![0u8; size];
        for _ in 0..iters {
            tcp_read_exact(&s, &mut b, wait)?;
            tcp_write_all(&s, &b, wait)?;
        }
        Ok(())
    });
    let c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    c.set_nonblocking(wait.nonblocking())?;
    let mut b = vec![0u8; size];
    let mut lat = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let t = Instant::now();
        tcp_write_all(&c, &b, wait)?;
        tcp_read_exact(&c, &mut b, wait)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    srv.join()
        .map_err(|_| std::io::Error::other("server panicked"))??;
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(lat)
}

/// The path MTU of a RoCEv2 connection over loopback: the largest IB MTU `lo` carries
/// (rxe takes a path's MTU from its link, as Linux's rxe does from its netdev).
pub fn loopback_path_mtu() -> u32 {
    let lo = std::fs::read_to_string("/sys/class/net/lo/mtu").ok();
    rnicpi::ib_mtu_fitting(lo.and_then(|m| m.trim().parse().ok()).unwrap_or(65536))
}

/// A thread receiving datagrams on `rx` (into `buf_len` bytes) until `total` bytes came
/// or none came for its read timeout (UDP has no flow control: the rest was dropped):
/// bytes per second received, from the call (made just before the sender starts) to the
/// last datagram. Not from the first datagram: a receiver that fell behind would drain
/// what queued up at copy speed and count that as the link's rate (a run with the GSO
/// baseline on a loaded machine showed 230 Gbit/s that way).
fn receive_rate(
    rx: std::net::UdpSocket,
    total: u64,
    buf_len: usize,
) -> std::thread::JoinHandle<std::io::Result<f64>> {
    let start = Instant::now();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; buf_len.max(1)];
        let (mut got, mut last) = (0u64, start);
        while got < total {
            match rx.recv(&mut buf) {
                Ok(n) => {
                    last = Instant::now();
                    got += n as u64;
                }
                Err(_) => break,
            }
        }
        let secs = last.duration_since(start).as_secs_f64();
        Ok(if secs > 0.0 { got as f64 / secs } else { 0.0 })
    })
}

/// Raw UDP on loopback: bytes per second received when `total` bytes are sent as
/// datagrams of `size` bytes, one `sendto` each ([`receive_rate`]: what got through,
/// from the start to the last datagram).
pub fn udp_bandwidth(size: usize, total: u64) -> std::io::Result<f64> {
    let rx = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let addr = rx.local_addr()?;
    rx.set_read_timeout(Some(Duration::from_millis(200)))?;
    let count = total.div_ceil(size as u64);
    let srv = receive_rate(rx, total, size);
    let tx = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let buf = vec![7u8; size];
    for _ in 0..count {
        tx.send_to(&buf, addr)?;
    }
    srv.join()
        .map_err(|_| std::io::Error::other("receiver panicked"))?
}

/// Raw UDP on loopback with the batching the kernel offers, as rxe uses it to this host
/// (`rxe::wire::gso`): `total` bytes sent as runs of `size`-byte datagrams, as many as
/// fit 64 KiB per `sendmsg` (`UDP_SEGMENT`), taken by a receiver with `UDP_GRO` on (one
/// `recv` per run). Bytes per second received, as [`udp_bandwidth`].
pub fn udp_gso_bandwidth(size: usize, total: u64) -> std::io::Result<f64> {
    use nix::sys::socket::{self, sockopt, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    const MAX_UDP_PAYLOAD: usize = 65507;
    let size = size.clamp(1, MAX_UDP_PAYLOAD);
    let per_call = MAX_UDP_PAYLOAD / size;
    let rx = std::net::UdpSocket::bind("127.0.0.1:0")?;
    socket::setsockopt(&rx, sockopt::UdpGroSegment, &true)?;
    let addr = rx.local_addr()?;
    rx.set_read_timeout(Some(Duration::from_millis(200)))?;
    let srv = receive_rate(rx, total, 1 << 16);
    let tx = std::net::UdpSocket::bind("127.0.0.1:0")?;
    tx.connect(addr)?;
    let buf = vec![7u8; size * per_call];
    let seg = size as u16;
    let mut left = total.div_ceil(size as u64);
    while left > 0 {
        let n = (left as usize).min(per_call);
        let iov = [std::io::IoSlice::new(&buf[..n * size])];
        let cmsg = [ControlMessage::UdpGsoSegments(&seg)];
        socket::sendmsg::<()>(tx.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)?;
        left -= n as u64;
    }
    srv.join()
        .map_err(|_| std::io::Error::other("receiver panicked"))?
}

/// Raw UDP ping-pong on loopback, both ends waiting as `wait` says; one-way latencies in
/// microseconds, sorted.
pub fn udp_pingpong(size: usize, iters: u32, wait: ReaderWait) -> std::io::Result<Vec<f64>> {
    let a = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let b = std::net::UdpSocket::bind("127.0.0.1:0")?;
    a.connect(b.local_addr()?)?;
    b.connect(a.local_addr()?)?;
    b.set_read_timeout(Some(Duration::from_secs(5)))?;
    a.set_read_timeout(Some(Duration::from_secs(5)))?;
    a.set_nonblocking(wait.nonblocking())?;
    b.set_nonblocking(wait.nonblocking())?;
    use nix::poll::PollFlags;
    let srv = std::thread::spawn(move || -> std::io::Result<()> {
        let mut m = vec![0u8; size];
        for _ in 0..iters {
            let n = wait.run(&b, PollFlags::POLLIN, || b.recv(&mut m))?;
            wait.run(&b, PollFlags::POLLOUT, || b.send(&m[..n]))?;
        }
        Ok(())
    });
    let mut m = vec![0u8; size];
    let mut lat = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let t = Instant::now();
        wait.run(&a, PollFlags::POLLOUT, || a.send(&m))?;
        wait.run(&a, PollFlags::POLLIN, || a.recv(&mut m))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    srv.join()
        .map_err(|_| std::io::Error::other("server panicked"))??;
    lat.sort_by(|a, b| a.total_cmp(b));
    Ok(lat)
}

/// The value at percentile `p` (0..=100) of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
