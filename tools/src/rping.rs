//! `rping`: the connection-manager ping of rdma-core, message for message, so either side
//! can be rdma-core's `rping` on a Linux host.
//!
//! One ping, as rdma-core's tool does it:
//! 1. the client sends its source buffer's (address, rkey, size), 16 bytes big-endian;
//! 2. the server RDMA-Reads that buffer and sends a 16-byte "go ahead";
//! 3. the client sends its sink buffer's (address, rkey, size);
//! 4. the server RDMA-Writes the data it read into the sink and sends "go ahead" again;
//! 5. the client compares sink and source (`--validate`).
//!
//! The client disconnects after `count` pings; the server ends when the connection closes.
//! Both sides ask for IRD = ORD = 1, as rping does.

use rnicpi::{
    send_flags, Access, ConnParam, EventKind, Result, VerbsError, WcOpcode, WcStatus, Wqe, WrOpcode,
};
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::{Context, Cq, Mr, Qp, QpCaps, QpConfig, RegBuf};

pub const DEFAULT_PORT: u16 = 7174;
/// rping's bounds on `-S`: room for "rdma-ping-2147483647: " plus a NUL, and below 64 KiB.
pub const MIN_SIZE: usize = 26;
pub const MAX_SIZE: usize = 65535;
/// The advertisement / go-ahead message: buffer address, rkey, size (all big-endian).
const INFO_LEN: usize = 16;
const MSG_PREFIX: &str = "rdma-ping-";
/// How long either side waits for the peer's next step before giving up.
const IDLE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct Options {
    pub server: bool,
    pub addr: IpAddr,
    pub port: u16,
    /// Pings to run (client); 0 = until interrupted.
    pub count: u32,
    pub size: usize,
    pub verbose: bool,
    pub validate: bool,
    pub device: String,
}

/// The (address, rkey, size) triple one side advertises to the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    pub addr: u64,
    pub rkey: u32,
    pub size: u32,
}

impl Info {
    pub fn encode(&self) -> [u8; INFO_LEN] {
        let mut b = [0u8; INFO_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..].copy_from_slice(&self.size.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; INFO_LEN]) -> Info {
        Info {
            addr: u64::from_be_bytes(b[..8].try_into().unwrap()),
            rkey: u32::from_be_bytes(b[8..12].try_into().unwrap()),
            size: u32::from_be_bytes(b[12..].try_into().unwrap()),
        }
    }
}

/// rping's ping payload: "rdma-ping-N: " followed by a rolling run of 'A'..='z', NUL at
/// the end. `start` is the first letter of the run (rping advances it every ping).
pub fn ping_payload(ping: u32, start: u8, size: usize) -> Vec<u8> {
    let mut v = format!("{MSG_PREFIX}{ping}: ").into_bytes();
    v.truncate(size.saturating_sub(1));
    let mut c = start;
    while v.len() < size {
        v.push(c);
        c = if c >= b'z' { b'A' } else { c + 1 };
    }
    if let Some(last) = v.last_mut() {
        *last = 0;
    }
    v
}

/// The bytes of a C string in `b` (up to the first NUL), for printing.
fn c_str(b: &[u8]) -> String {
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..n]).into_owned()
}

/// One side's verbs objects: a QP with 16 send / 2 receive slots, a control buffer
/// (receive at 0, send at 16) and a data buffer (sink at 0, client's source at `size`).
struct Session {
    qp: Arc<Qp>,
    cq: Arc<Cq>,
    ctrl: Arc<RegBuf>,
    ctrl_mr: Arc<Mr>,
    data: Arc<RegBuf>,
    data_mr: Arc<Mr>,
    size: usize,
}

const RECV_OFF: u64 = 0;
const SEND_OFF: u64 = INFO_LEN as u64;

/// What the peer's next message turned out to be.
enum Next {
    Got,
    Closed,
}

impl Session {
    fn new(ctx: &Arc<Context>, dev: u32, size: usize, client: bool) -> Result<Session> {
        let pd = ctx.alloc_pd(dev)?;
        let cq = ctx.create_cq(dev, 32)?;
        let qp = ctx.create_qp(
            &pd,
            &cq,
            &cq,
            QpConfig {
                caps: QpCaps {
                    max_send_wr: 16,
                    max_recv_wr: 2,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline: 0,
                },
                ..Default::default()
            },
        )?;
        let ctrl = RegBuf::new(2 * INFO_LEN)?;
        let ctrl_mr = ctx.reg_buf(&pd, &ctrl, Access::LOCAL_WRITE)?;
        let data = RegBuf::new(if client { 2 * size } else { size })?;
        let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
        let data_mr = ctx.reg_buf(&pd, &data, all)?;
        let s = Session {
            qp,
            cq,
            ctrl,
            ctrl_mr,
            data,
            data_mr,
            size,
        };
        s.post_recv()?;
        Ok(s)
    }

    fn post_recv(&self) -> Result<()> {
        let sge = self.ctrl_mr.sge(RECV_OFF, INFO_LEN as u32);
        self.qp.post_recv(&Wqe::recv(1, &[sge]))
    }

    /// Send the 16-byte control message currently in the send slot.
    fn send_ctrl(&self) -> Result<()> {
        let sge = self.ctrl_mr.sge(SEND_OFF, INFO_LEN as u32);
        let w = Wqe::new(2, WrOpcode::Send, &[sge]).with_flags(send_flags::SIGNALED);
        self.qp.post_send(&w)
    }

    /// Advertise `[offset, offset+size)` of the data buffer to the peer.
    fn advertise(&self, offset: u64) -> Result<()> {
        let info = Info {
            addr: self.data.as_ptr() as u64 + offset,
            rkey: self.data_mr.rkey,
            size: self.size as u32,
        };
        self.ctrl.write(SEND_OFF as usize, &info.encode());
        self.send_ctrl()
    }

    /// RDMA Read (`op` = RdmaRead) or Write of `len` bytes between the sink and `peer`.
    fn rdma(&self, op: WrOpcode, peer: Info, len: u32) -> Result<()> {
        let sge = self.data_mr.sge(0, len);
        let w = Wqe::new(3, op, &[sge])
            .with_remote(peer.addr, peer.rkey)
            .with_flags(send_flags::SIGNALED);
        self.qp.post_send(&w)
    }

    /// Wait for the next completion of kind `want`, skipping Send completions. A received
    /// message must be exactly 16 bytes (as rping insists); the receive is re-posted.
    fn wait(&self, want: WcOpcode) -> Result<Next> {
        let deadline = Instant::now() + IDLE;
        loop {
            match self.cq.wait(1, Duration::from_millis(100)) {
                Ok(c) => {
                    let c = c[0];
                    match c.status() {
                        WcStatus::Success => {}
                        WcStatus::WrFlushErr => return Ok(Next::Closed),
                        s => {
                            tracing::warn!(status = ?s, "rping: completion failed");
                            return Err(VerbsError::Io);
                        }
                    }
                    let op = c.opcode();
                    if op == Some(WcOpcode::Recv) {
                        if c.byte_len as usize != INFO_LEN {
                            tracing::warn!(len = c.byte_len, "rping: received bogus data");
                            return Err(VerbsError::Invalid);
                        }
                        if want != WcOpcode::Recv {
                            tracing::warn!("rping: message out of turn");
                            return Err(VerbsError::Invalid);
                        }
                        self.post_recv()?;
                        return Ok(Next::Got);
                    }
                    if op == Some(want) {
                        return Ok(Next::Got);
                    }
                }
                Err(VerbsError::TimedOut) => {
                    if let Ok(ev) = self.qp.events().try_recv() {
                        if matches!(
                            ev.kind,
                            EventKind::Disconnected | EventKind::ConnectionBroken
                        ) {
                            return Ok(Next::Closed);
                        }
                    }
                    if Instant::now() > deadline {
                        return Err(VerbsError::TimedOut);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn received_info(&self) -> Info {
        let mut b = [0u8; INFO_LEN];
        self.ctrl.read(RECV_OFF as usize, &mut b);
        Info::decode(&b)
    }
}

/// Run rping with `o` on context `ctx`; returns the pings completed.
pub fn run(ctx: &Arc<Context>, o: &Options, out: &mut dyn Write) -> Result<u32> {
    if !(MIN_SIZE..=MAX_SIZE).contains(&o.size) {
        return Err(VerbsError::Invalid);
    }
    let dev = ctx.device(&o.device)?.index;
    if o.server {
        server(ctx, dev, o, out)
    } else {
        client(ctx, dev, o, out)
    }
}

fn server(ctx: &Arc<Context>, dev: u32, o: &Options, out: &mut dyn Write) -> Result<u32> {
    let listener = ctx.listen(dev, SocketAddr::new(o.addr, o.port), 3)?;
    eprintln!("krdma rping: listening on {}:{}", o.addr, listener.port);
    let req = loop {
        match listener.get_request(Duration::from_secs(3600)) {
            Ok(ev) if ev.kind == EventKind::ConnectRequest => break ev,
            Ok(_) => continue,
            Err(e) => return Err(e),
        }
    };
    let s = Session::new(ctx, dev, o.size, false)?;
    let param = ConnParam {
        private_data: vec![],
        ird: 1,
        ord: 1,
    };
    listener.accept(req.conn_id, &s.qp, &param)?;
    let ev = s.qp.next_event(IDLE)?;
    if ev.kind != EventKind::Established {
        return Err(VerbsError::ConnectionReset);
    }
    drop(listener);
    let mut pings = 0;
    let r = (|| -> Result<()> {
        loop {
            if let Next::Closed = s.wait(WcOpcode::Recv)? {
                return Ok(());
            }
            let src = s.received_info();
            let len = src.size.min(s.size as u32);
            s.rdma(WrOpcode::RdmaRead, src, len)?;
            if let Next::Closed = s.wait(WcOpcode::RdmaRead)? {
                return Ok(());
            }
            let data = s.data.to_vec();
            if o.verbose {
                let _ = writeln!(out, "server ping data: {}", c_str(&data));
            }
            s.send_ctrl()?;
            if let Next::Closed = s.wait(WcOpcode::Recv)? {
                return Ok(());
            }
            let sink = s.received_info();
            let n = data.iter().position(|&c| c == 0).unwrap_or(data.len());
            let len = ((n + 1).min(s.size) as u32).min(sink.size);
            s.rdma(WrOpcode::RdmaWrite, sink, len)?;
            if let Next::Closed = s.wait(WcOpcode::RdmaWrite)? {
                return Ok(());
            }
            s.send_ctrl()?;
            pings += 1;
        }
    })();
    let _ = s.qp.disconnect(false);
    r.map(|_| pings)
}

fn client(ctx: &Arc<Context>, dev: u32, o: &Options, out: &mut dyn Write) -> Result<u32> {
    let s = Session::new(ctx, dev, o.size, true)?;
    let param = ConnParam {
        private_data: vec![],
        ird: 1,
        ord: 1,
    };
    s.qp.connect_wait(
        SocketAddr::new(o.addr, o.port),
        &param,
        Duration::from_secs(10),
    )?;
    let src_off = o.size;
    let mut start = b'A';
    let mut pings = 0;
    let r = (|| -> Result<()> {
        while o.count == 0 || pings < o.count {
            let payload = ping_payload(pings, start, o.size);
            start = if start >= b'z' { b'A' } else { start + 1 };
            s.data.write(src_off, &payload);
            s.advertise(src_off as u64)?;
            if let Next::Closed = s.wait(WcOpcode::Recv)? {
                return Ok(());
            }
            s.advertise(0)?;
            if let Next::Closed = s.wait(WcOpcode::Recv)? {
                return Ok(());
            }
            let mut sink = vec![0u8; o.size];
            s.data.read(0, &mut sink);
            if o.validate && sink != payload {
                let _ = writeln!(out, "data mismatch!");
                return Err(VerbsError::Io);
            }
            if o.verbose {
                let _ = writeln!(out, "ping data: {}", c_str(&sink));
            }
            pings += 1;
        }
        Ok(())
    })();
    let _ = s.qp.disconnect(false);
    // Let the close reach the peer before the QP is destroyed.
    let _ = s.qp.next_event(Duration::from_secs(2));
    r.map(|_| pings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_is_big_endian() {
        let i = Info {
            addr: 0x0102030405060708,
            rkey: 0x0a0b0c0d,
            size: 64,
        };
        let b = i.encode();
        assert_eq!(&b[..4], &[1, 2, 3, 4]);
        assert_eq!(&b[8..12], &[0xa, 0xb, 0xc, 0xd]);
        assert_eq!(&b[12..], &[0, 0, 0, 64]);
        assert_eq!(Info::decode(&b), i);
    }

    #[test]
    fn payload_matches_rping() {
        let p = ping_payload(0, b'A', 64);
        assert_eq!(p.len(), 64);
        assert!(p.starts_with(b"rdma-ping-0: ABCDEFG"));
        assert_eq!(p[63], 0);
        // The run wraps from 'z' to 'A'.
        let p = ping_payload(3, b'y', 20);
        assert_eq!(&p[..19], b"rdma-ping-3: yzABCD");
    }
}
