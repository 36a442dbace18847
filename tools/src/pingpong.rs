//! `krdma pingpong`: the message pattern and out-of-band handshake of rdma-core's
//! `ibv_rc_pingpong`, so either side can be a Linux host running it (over kernel rxe or a
//! RoCE/IB NIC).
//!
//! Handshake over TCP (port 18515): the client sends its address as the NUL-terminated
//! text `LLLL:QQQQQQ:PPPPPP:GGGG…` (LID, QPN, PSN in hex, the GID as 32 hex digits, 52
//! bytes with the NUL); the server moves its QP to RTR/RTS towards it and answers the same
//! way; the client moves its QP and sends `done\0`. Then the client posts a Send of
//! `size` bytes; each side, once its last Send and a Receive have completed, sends again,
//! `iters` times.
//!
//! With [`Options::qp_type`] UD it is rdma-core's `ibv_ud_pingpong` instead: the same
//! handshake and message pattern over UD QPs (Q_Key 0x11111111), each Send addressed
//! through an address handle made from the peer's GID, no larger than the port's MTU, and
//! each receive buffer 40 bytes longer for the GRH a datagram arrives behind. With UC it
//! is `ibv_uc_pingpong`: RC's exchange over UC QPs, brought up with only the attributes
//! UC has (no responder resources, RNR timer, timeout or retries).

use rnicpi::{send_flags, Access, Cqe, QpCaps, QpType, Result, VerbsError, Wqe, WrOpcode};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};
use ual::oob::{self, RcPath, RcPeer};
use ual::RegBuf;
use ual::{Ah, Context, Qp, QpConfig};

pub const DEFAULT_PORT: u16 = 18515;
const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// The Q_Key `ibv_ud_pingpong` gives its QPs and sends with.
const UD_QKEY: u32 = 0x1111_1111;
/// `sizeof "0000:000000:000000:00000000000000000000000000000000"`.
const MSG_LEN: usize = 52;

/// The options of `ibv_rc_pingpong` (and of `ibv_ud_pingpong`, which has no `mtu`).
#[derive(Debug, Clone)]
pub struct Options {
    /// RC: be `ibv_rc_pingpong`; UC: `ibv_uc_pingpong`; UD: `ibv_ud_pingpong`.
    pub qp_type: QpType,
    /// Connect to this host; `None` = server.
    pub server: Option<String>,
    pub port: u16,
    pub device: String,
    pub ib_port: u8,
    pub size: u32,
    pub mtu: u32,
    pub rx_depth: u32,
    pub iters: u32,
    pub gid_index: u8,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            qp_type: QpType::Rc,
            server: None,
            port: DEFAULT_PORT,
            device: "rxe0".into(),
            ib_port: 1,
            size: 4096,
            mtu: 1024,
            rx_depth: 500,
            iters: 1000,
            gid_index: 0,
        }
    }
}

/// One side's address as exchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    pub lid: u16,
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
}

impl Dest {
    /// The 52-byte wire form.
    pub fn to_wire(&self) -> [u8; MSG_LEN] {
        let gid: String = self.gid.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!("{:04x}:{:06x}:{:06x}:{gid}", self.lid, self.qpn, self.psn);
        let mut out = [0u8; MSG_LEN];
        out[..text.len()].copy_from_slice(text.as_bytes());
        out
    }

    /// Parse the wire form (as `sscanf("%x:%x:%x:%s")` would, the GID as 32 hex digits).
    pub fn from_wire(b: &[u8]) -> Option<Dest> {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        let text = std::str::from_utf8(&b[..end]).ok()?;
        let mut parts = text.splitn(4, ':');
        let hex = |s: &str| u32::from_str_radix(s, 16).ok();
        let lid = hex(parts.next()?)? as u16;
        let qpn = hex(parts.next()?)? & 0xff_ffff;
        let psn = hex(parts.next()?)? & 0xff_ffff;
        let g = parts.next()?;
        if g.len() != 32 {
            return None;
        }
        let mut gid = [0u8; 16];
        for (i, byte) in gid.iter_mut().enumerate() {
            *byte = u8::from_str_radix(g.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Dest { lid, qpn, psn, gid })
    }
}

fn gid_text(g: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*g).to_string()
}

fn io(e: std::io::Error) -> VerbsError {
    VerbsError::from(e)
}

/// Run one side; returns (bytes moved, elapsed).
pub fn run(ctx: &Arc<Context>, o: &Options, out: &mut dyn Write) -> Result<(u64, Duration)> {
    if o.size == 0 || o.rx_depth == 0 || ![256, 512, 1024, 2048, 4096].contains(&o.mtu) {
        return Err(VerbsError::Invalid);
    }
    let dev = ctx.device(&o.device)?.index;
    let port = ctx.query_port(dev, o.ib_port)?;
    let ud = o.qp_type == QpType::Ud;
    if ud && o.size > port.active_mtu {
        eprintln!("Requested size larger than port MTU ({})", port.active_mtu);
        return Err(VerbsError::Invalid);
    }
    // A UD receive starts with the GRH; the Send's bytes follow it in the buffer.
    let grh = if ud { rnicpi::GRH_LEN as u32 } else { 0 };
    let pd = ctx.alloc_pd(dev)?;
    let cq = ctx.create_cq(dev, o.rx_depth + 1)?;
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: o.rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline: 64,
    };
    let qp = ctx.create_qp(
        &pd,
        &cq,
        &cq,
        QpConfig {
            caps,
            qp_type: o.qp_type,
            ..Default::default()
        },
    )?;
    let buf = RegBuf::new((o.size + grh) as usize)?;
    buf.fill(0x7b);
    let mr = ctx.reg_buf(&pd, &buf, Access::LOCAL_WRITE)?;
    let psn = oob::random_psn(qp.qp_num);
    if ud {
        oob::ud_to_rts(&qp, UD_QKEY, psn)?;
    } else {
        oob::to_init(&qp, Access::empty())?;
    }
    let recv = Wqe::recv(RECV_WRID, &[mr.sge(0, o.size + grh)]);
    for _ in 0..o.rx_depth {
        qp.post_recv(&recv)?;
    }
    let gid = *port
        .gids
        .get(o.gid_index as usize)
        .ok_or(VerbsError::Invalid)?;
    let me = Dest {
        lid: 0,
        qpn: qp.qp_num,
        psn,
        gid,
    };
    writeln!(
        out,
        "  local address:  LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        me.lid,
        me.qpn,
        me.psn,
        gid_text(&me.gid)
    )
    .map_err(io)?;
    // The address handle of the peer (UD): made once its GID is known.
    let mut ah = None;
    let peer = match &o.server {
        Some(host) => client_exchange(host, o.port, &me)?,
        None => server_exchange(o.port, &me, |peer| {
            ah = connect_qp(ctx, &pd, &qp, o, &me, peer)?;
            Ok(())
        })?,
    };
    writeln!(
        out,
        "  remote address: LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        peer.lid,
        peer.qpn,
        peer.psn,
        gid_text(&peer.gid)
    )
    .map_err(io)?;
    if o.server.is_some() {
        ah = connect_qp(ctx, &pd, &qp, o, &me, &peer)?;
    }
    let mut send = Wqe::new(SEND_WRID, WrOpcode::Send, &[mr.sge(grh as u64, o.size)]);
    if let Some(ah) = &ah {
        send = send.with_ud(ah.num(), peer.qpn, UD_QKEY);
    }
    if o.size as usize <= caps.max_inline as usize {
        let mut data = vec![0u8; o.size as usize];
        buf.read(grh as usize, &mut data);
        send = send.with_inline(&data).ok_or(VerbsError::Invalid)?;
    }
    send.flags |= send_flags::SIGNALED;
    let started = Instant::now();
    exchange(&qp, &cq, &send, &recv, o, o.server.is_some())?;
    let elapsed = started.elapsed();
    let bytes = o.size as u64 * o.iters as u64 * 2;
    let usec = elapsed.as_secs_f64() * 1e6;
    writeln!(
        out,
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    )
    .map_err(io)?;
    writeln!(
        out,
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        o.iters,
        usec / 1e6,
        usec / o.iters as f64
    )
    .map_err(io)?;
    Ok((bytes, elapsed))
}

/// RC: RTR and RTS towards `peer`, with `ibv_rc_pingpong`'s attributes. UD: the
/// address handle of `peer` (`ibv_ud_pingpong`'s: hop limit 64, from our GID index).
fn connect_qp(
    ctx: &Arc<Context>,
    pd: &Arc<ual::Pd>,
    qp: &Qp,
    o: &Options,
    me: &Dest,
    peer: &Dest,
) -> Result<Option<Arc<Ah>>> {
    if o.qp_type == QpType::Ud {
        let attr = rnicpi::AhAttr {
            port: o.ib_port,
            sgid_index: o.gid_index,
            hop_limit: 64,
            dgid: peer.gid,
            ..Default::default()
        };
        return ctx.create_ah(pd, &attr).map(Some);
    }
    let path = RcPath {
        path_mtu: o.mtu,
        sgid_index: o.gid_index,
        hop_limit: 1,
        max_dest_rd_atomic: 1,
        max_rd_atomic: 1,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
    };
    let remote = RcPeer {
        qpn: peer.qpn,
        psn: peer.psn,
        gid: peer.gid,
    };
    oob::to_rtr(qp, &path, &remote)?;
    oob::to_rts(qp, &path, me.psn)?;
    Ok(None)
}

fn client_exchange(host: &str, port: u16, me: &Dest) -> Result<Dest> {
    let mut s = TcpStream::connect((host, port)).map_err(|e| {
        eprintln!("Couldn't connect to {host}:{port}");
        io(e)
    })?;
    s.write_all(&me.to_wire()).map_err(io)?;
    let mut msg = [0u8; MSG_LEN];
    s.read_exact(&mut msg).map_err(io)?;
    s.write_all(b"done\0").map_err(io)?;
    Dest::from_wire(&msg).ok_or(VerbsError::Invalid)
}

fn server_exchange(
    port: u16,
    me: &Dest,
    connect: impl FnOnce(&Dest) -> Result<()>,
) -> Result<Dest> {
    let l = TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], port))).map_err(io)?;
    let (mut s, _) = l.accept().map_err(io)?;
    drop(l);
    let mut msg = [0u8; MSG_LEN];
    s.read_exact(&mut msg).map_err(io)?;
    let peer = Dest::from_wire(&msg).ok_or(VerbsError::Invalid)?;
    connect(&peer)?;
    s.write_all(&me.to_wire()).map_err(io)?;
    // The client's "done" (a short read is fine: it is 5 bytes).
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = s.read(&mut msg);
    Ok(peer)
}

/// The ping-pong loop of `ibv_rc_pingpong` (polling).
fn exchange(
    qp: &Qp,
    cq: &ual::Cq,
    send: &Wqe,
    recv: &Wqe,
    o: &Options,
    client: bool,
) -> Result<()> {
    let (mut scnt, mut rcnt) = (0u32, 0u32);
    let mut routs = o.rx_depth;
    let mut pending = RECV_WRID;
    if client {
        qp.post_send(send)?;
        pending |= SEND_WRID;
    }
    let deadline = Instant::now() + Duration::from_secs(60 + o.iters as u64 / 100);
    let mut wc = [Cqe::default(); 2];
    let mut idle = 0u32;
    while rcnt < o.iters || scnt < o.iters {
        let n = cq.poll(&mut wc);
        if n == 0 {
            if Instant::now() > deadline {
                return Err(VerbsError::TimedOut);
            }
            // Poll like ibv_rc_pingpong, but let the engine's threads run: with a software
            // provider they may share this core.
            idle += 1;
            if idle > 64 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        idle = 0;
        for c in &wc[..n] {
            if !c.is_ok() {
                eprintln!("Failed status {:?} for wr_id {}", c.status(), c.wr_id);
                return Err(VerbsError::Io);
            }
            match c.wr_id {
                SEND_WRID => scnt += 1,
                RECV_WRID => {
                    routs -= 1;
                    if routs <= 1 {
                        while routs < o.rx_depth {
                            qp.post_recv(recv)?;
                            routs += 1;
                        }
                    }
                    rcnt += 1;
                }
                other => {
                    eprintln!("Completion for unknown wr_id {other}");
                    return Err(VerbsError::Io);
                }
            }
            pending &= !c.wr_id;
            if scnt < o.iters && pending == 0 {
                qp.post_send(send)?;
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_form_matches_rc_pingpong() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0x1a2b3c,
            gid: std::net::Ipv4Addr::new(10, 77, 0, 11)
                .to_ipv6_mapped()
                .octets(),
        };
        let w = d.to_wire();
        assert_eq!(
            &w[..51],
            b"0000:000011:1a2b3c:00000000000000000000ffff0a4d000b"
        );
        assert_eq!(w[51], 0);
        assert_eq!(Dest::from_wire(&w), Some(d));
        assert_eq!(Dest::from_wire(b"zz:1:2:00"), None);
        assert_eq!(Dest::from_wire(b"0000:000011:1a2b3c:0000"), None);
    }
}
