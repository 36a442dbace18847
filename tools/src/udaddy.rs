//! `krdma udaddy`: rdma-core's `udaddy` (librdmacm's UD example), so either side can be a
//! Linux host running it over kernel rxe.
//!
//! The client resolves the server's UD service through the connection manager (IB SIDR in
//! rdma_cm's UDP port space: the reply names the serving QP and its Q_Key), then sends
//! `count` datagrams of `size` bytes, each with its own QP number as immediate data. The
//! server answers once all have arrived, addressing its replies from the first datagram:
//! the source address in its GRH, the QP number in its immediate data. Both QPs use
//! rdma_cm's Q_Key for the UDP port space, which a Linux peer insists on.

use rnicpi::{
    AhAttr, Cqe, QpCaps, QpType, Result, VerbsError, Wqe, WrOpcode, GRH_LEN, RDMA_UDP_QKEY,
};
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use ual::{Context, QpConfig, RegBuf};

/// udaddy's port.
pub const DEFAULT_PORT: u16 = 7174;
const TIMEOUT: Duration = Duration::from_secs(30);

/// The options of `udaddy` this tool takes.
#[derive(Debug, Clone)]
pub struct Options {
    /// The server to resolve; `None` = be the server.
    pub server: Option<IpAddr>,
    /// The server's address to listen on (`None`: every address of the device).
    pub bind: Option<IpAddr>,
    pub port: u16,
    pub device: String,
    pub count: u32,
    pub size: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            server: None,
            bind: None,
            port: DEFAULT_PORT,
            device: "rxe0".into(),
            count: 10,
            size: 100,
        }
    }
}

/// Run one side; the datagrams received.
pub fn run(ctx: &Arc<Context>, o: &Options, out: &mut dyn Write) -> Result<u32> {
    let dev = ctx.device(&o.device)?.index;
    let mtu = ctx.query_port(dev, 1)?.active_mtu;
    if o.size > mtu || o.count == 0 {
        let _ = writeln!(
            out,
            "udaddy: message_size {} is larger than active mtu {mtu}",
            o.size
        );
        return Err(VerbsError::Invalid);
    }
    let pd = ctx.alloc_pd(dev)?;
    let cq = ctx.create_cq(dev, o.count * 2)?;
    let caps = QpCaps {
        max_send_wr: o.count,
        max_recv_wr: o.count,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline: 0,
    };
    let cfg = QpConfig {
        caps,
        qp_type: QpType::Ud,
        ..Default::default()
    };
    let qp = ctx.create_qp(&pd, &cq, &cq, cfg)?;
    ual::oob::ud_to_rts(&qp, RDMA_UDP_QKEY, ual::oob::random_psn(qp.qp_num))?;
    let buf = RegBuf::new(o.size as usize + GRH_LEN)?;
    let mr = ctx.reg_buf(&pd, &buf, ual::Access::LOCAL_WRITE)?;
    let recv = Wqe::recv(1, &[mr.sge(0, o.size + GRH_LEN as u32)]);
    // Our QP number as immediate data, in network order as udaddy sends it.
    let imm = u32::from_ne_bytes(qp.qp_num.to_be_bytes());
    let send = |ah: &ual::Ah, qpn: u32, qkey: u32, flags: u8| {
        Wqe::new(2, WrOpcode::SendWithImm, &[mr.sge(GRH_LEN as u64, o.size)])
            .with_imm(imm)
            .with_flags(flags)
            .with_ud(ah.num(), qpn, qkey)
    };
    let ah_to = |ip: IpAddr| {
        let attr = AhAttr {
            dgid: rnicpi::ip_to_gid(ip),
            ..AhAttr::default()
        };
        ctx.create_ah(&pd, &attr)
    };
    let say = |out: &mut dyn Write, s: &str| writeln!(out, "{s}").map_err(VerbsError::from);
    match o.server {
        None => {
            say(out, "udaddy: starting server")?;
            let bind = SocketAddr::new(o.bind.unwrap_or(IpAddr::from([0, 0, 0, 0])), o.port);
            let listener = ctx.listen(dev, bind, 1)?;
            let req = listener.get_request(Duration::from_secs(600))?;
            if req.ud.is_none() {
                let _ = listener.reject(req.conn_id, &[]);
                return Err(VerbsError::Invalid);
            }
            for _ in 0..o.count {
                qp.post_recv(&recv)?;
            }
            listener.accept(req.conn_id, &qp, &Default::default())?;
            say(out, "receiving data transfers")?;
            let first = wait(&cq, o.count)?;
            // The reply goes where the first datagram came from.
            let mut grh = [0u8; GRH_LEN];
            buf.read(0, &mut grh);
            let src = grh_source(&grh).ok_or(VerbsError::Io)?;
            let remote_qpn = u32::from_be_bytes(first.imm_or_inv.to_ne_bytes());
            let ah = ah_to(src)?;
            say(out, "sending replies")?;
            let reply = send(&ah, remote_qpn, RDMA_UDP_QKEY, rnicpi::send_flags::SIGNALED);
            for _ in 0..o.count {
                qp.post_send(&reply)?;
            }
            wait(&cq, o.count)?;
        }
        Some(server) => {
            say(out, "udaddy: starting client")?;
            for _ in 0..o.count {
                qp.post_recv(&recv)?;
            }
            say(out, "udaddy: connecting")?;
            let ev = qp.connect_wait(
                SocketAddr::new(server, o.port),
                &Default::default(),
                TIMEOUT,
            )?;
            let peer = ev.ud.ok_or(VerbsError::Io)?;
            let ah = ah_to(server)?;
            say(out, "initiating data transfers")?;
            let msg = send(&ah, peer.qpn, peer.qkey, 0);
            for _ in 0..o.count {
                qp.post_send(&msg)?;
            }
            say(out, "receiving data transfers")?;
            wait(&cq, o.count)?;
        }
    }
    say(out, "data transfers complete")?;
    say(out, "test complete")?;
    Ok(o.count)
}

/// Wait for `n` completions, every one a success; the first.
fn wait(cq: &ual::Cq, n: u32) -> Result<Cqe> {
    let got = cq.wait(n as usize, TIMEOUT)?;
    if let Some(c) = got.iter().find(|c| !c.is_ok()) {
        eprintln!("udaddy: completion failed: {:?}", c.status());
        return Err(VerbsError::Io);
    }
    got.first().copied().ok_or(VerbsError::TimedOut)
}

/// The source address of a datagram from its GRH: RoCEv2 over IPv4 puts the IPv4 header
/// in the last 20 bytes (version nibble 4); otherwise the GRH's source GID.
pub(crate) fn grh_source(grh: &[u8; GRH_LEN]) -> Option<IpAddr> {
    let ip = &grh[20..];
    if ip[0] >> 4 == 4 {
        return Some(IpAddr::from([ip[12], ip[13], ip[14], ip[15]]));
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&grh[8..24]);
    (grh[0] >> 4 == 6).then(|| rnicpi::gid_to_ip(gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_of_a_datagram_is_read_from_its_grh() {
        let mut v4 = [0u8; GRH_LEN];
        v4[20] = 0x45;
        v4[32..36].copy_from_slice(&[10, 77, 0, 11]);
        assert_eq!(grh_source(&v4), Some(IpAddr::from([10, 77, 0, 11])));
        let mut v6 = [0u8; GRH_LEN];
        v6[0] = 0x60;
        let a: std::net::Ipv6Addr = "fd00::1".parse().unwrap();
        v6[8..24].copy_from_slice(&a.octets());
        assert_eq!(grh_source(&v6), Some(IpAddr::V6(a)));
        assert_eq!(grh_source(&[0; GRH_LEN]), None);
    }
}
