//! The unreliable datagram service (IBTA 9.8), as Linux rxe gives it to UD QPs: each
//! Send is one `SEND Only` packet (with a DETH carrying the Q_Key and our QP number),
//! addressed through an address handle, no larger than the path MTU, never acknowledged
//! and complete once it is handed to the wire. A received one fills one receive with the
//! 40-byte GRH first (for IPv4 the IP header in its last 20 bytes, as the kernel lays it
//! out), then the payload; the completion names the sender's QP. Nothing the peer sends
//! can move a UD QP to Error: a datagram with the wrong Q_Key, or none posted to take it,
//! is dropped and counted.

use super::{byte_len, Av, Engine, State};
use crate::wire::{self, DethRepr, ImmDtRepr, Opcode, RoceRepr};
use rnicpi::*;
use std::net::IpAddr;

impl Engine<'_> {
    /// Send what the send ring holds, a packet per request; true when the budget ran
    /// out with requests left.
    pub(super) fn ud_pump(&self, st: &mut State, budget: &mut u32) -> bool {
        while st.qp == QpState::Rts {
            let wqe = {
                let mut sq = self.base.sq.lock();
                if sq.is_empty() {
                    return false;
                }
                if *budget == 0 {
                    return true;
                }
                match sq.pop() {
                    Ok(Some(w)) => w,
                    Ok(None) => return false,
                    Err(RingCorrupt) => {
                        drop(sq);
                        RingStats::count(&self.base.stats.wq_corrupt);
                        self.fatal(st, EventKind::QpFatal, "send ring indices corrupt");
                        return false;
                    }
                }
            };
            *budget -= 1;
            match self.ud_send(st, &wqe) {
                Ok(len) if wqe.signaled() => {
                    let cqe = self.base.cqe(&wqe, WcStatus::Success, len);
                    self.post_cqe(st, true, cqe);
                }
                Ok(_) => {}
                Err(status) => {
                    // A local error completes the request and moves the QP to Error
                    // (IBTA 10.8.3.1), which flushes what follows it.
                    tracing::debug!(
                        qpn = self.base.qpn,
                        wr_id = wqe.wr_id,
                        ?status,
                        "rxe UD send refused"
                    );
                    let cqe = self.base.cqe(&wqe, status, 0);
                    self.post_cqe(st, true, cqe);
                    self.to_error(st);
                }
            }
        }
        false
    }

    /// Make the packet of one UD Send; its length.
    fn ud_send(&self, st: &mut State, wqe: &Wqe) -> Result<u32, WcStatus> {
        let imm = match wqe.opcode() {
            Some(WrOpcode::Send) => false,
            Some(WrOpcode::SendWithImm) => true,
            _ => return Err(WcStatus::LocQpOpErr),
        };
        let dest = wqe.ud_dest();
        let ah = self
            .ahs
            .get(dest.ah, self.base.pd)
            .ok_or(WcStatus::LocQpOpErr)?;
        let max_inline = (self.base.caps.max_inline as usize).min(MAX_INLINE);
        if u32::from(wqe.num_sge) > self.base.caps.max_send_sge
            || (wqe.is_inline() && wqe.inline_len as usize > max_inline)
            || wqe.total_len() > u64::from(st.mtu)
        {
            return Err(WcStatus::LocLenErr);
        }
        let opcode = if imm {
            Opcode::UdSendOnlyImm
        } else {
            Opcode::UdSendOnly
        };
        let mut bth = wire::BthRepr::new(opcode, dest.qpn, st.req.psn);
        bth.solicited = wqe.solicited();
        let mut repr = RoceRepr::new(bth, &[]);
        repr.deth = Some(DethRepr {
            qkey: dest.qkey_or(st.attr.qkey),
            src_qp: self.base.qpn,
        });
        if imm {
            repr.immdt = Some(ImmDtRepr {
                imm: u32::from_be_bytes(wqe.imm_or_inv.to_ne_bytes()),
            });
        }
        // The payload goes from the request or the registration straight into the packet.
        let n = wqe.total_len() as usize;
        let roce = self.packet_with(&repr, n, |out| {
            if wqe.is_inline() {
                out.extend_from_slice(&wqe.inline_data[..n]);
                return Ok(());
            }
            self.mrs
                .resolve_sgl(self.base.pd, wqe.sges(), Access::empty())
                .and_then(|sgl| sgl.append_at(0, n, Access::empty(), out))
                .map_err(|_| WcStatus::LocProtErr)
        })?;
        st.req.psn = wire::psn_add(st.req.psn, 1);
        let sport = match ah.flow_label {
            0 => wire::icrc::rxe_qp_udp_sport(self.base.qpn),
            fl => wire::icrc::udp_sport_for_flow_label(fl),
        };
        let av = Av {
            src: ah.src,
            dst: ah.dst,
            sport,
        };
        if let Some(roce) = roce {
            Self::queue_packet_to(st, av, roce);
        }
        Ok(byte_len(n as u64))
    }

    /// One datagram from `src` to `dst` addressed to this UD QP.
    pub(super) fn ud_receive(&self, st: &mut State, src: IpAddr, dst: IpAddr, p: &RoceRepr<'_>) {
        let Some(deth) = p
            .deth
            .filter(|_| p.bth.opcode.transport() == wire::Transport::Ud)
        else {
            return self.count(&self.counters.rx_malformed);
        };
        let qpn = self.base.qpn;
        if !matches!(st.qp, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            tracing::debug!(qpn, state = ?st.qp, "rxe UD: datagram dropped (QP not ready)");
            return self.count(&self.counters.rx_dropped_state);
        }
        if deth.qkey != st.attr.qkey {
            tracing::debug!(qpn, qkey = deth.qkey, "rxe UD: datagram dropped (Q_Key)");
            return self.count(&self.counters.rx_bad_qkey);
        }
        let wqe = match self.take_recv() {
            Ok(Some(w)) => w,
            Ok(None) => {
                tracing::debug!(
                    qpn,
                    src_qp = deth.src_qp,
                    "rxe UD: datagram dropped (no receive)"
                );
                return self.count(&self.counters.ud_dropped_no_recv);
            }
            Err(RingCorrupt) => {
                return self.fatal(st, EventKind::QpFatal, "receive ring indices corrupt")
            }
        };
        let len = (GRH_LEN + p.payload.len()) as u64;
        let status = if len > wqe.total_len() {
            WcStatus::LocLenErr
        } else {
            let grh = grh(src, dst, p);
            let placed = self
                .mrs
                .scatter(self.base.pd, wqe.sges(), 0, &grh)
                .and_then(|()| {
                    self.mrs
                        .scatter(self.base.pd, wqe.sges(), GRH_LEN as u64, p.payload)
                });
            match placed {
                Ok(()) => WcStatus::Success,
                Err(_) => WcStatus::LocProtErr,
            }
        };
        let mut cqe = self.base.cqe(&wqe, status, 0);
        if status == WcStatus::Success {
            cqe.byte_len = byte_len(len);
            cqe.src_qp = deth.src_qp;
            cqe.flags |= wc_flags::GRH;
            if p.bth.solicited {
                cqe.flags |= wc_flags::SOLICITED;
            }
            if let Some(imm) = p.immdt {
                cqe.flags |= wc_flags::WITH_IMM;
                cqe.imm_or_inv = u32::from_ne_bytes(imm.imm.to_be_bytes());
            }
        }
        self.post_cqe(st, false, cqe);
    }
}

/// The GRH a UD receive starts with. RoCEv2 has none on the wire: over IPv4, as Linux
/// fills it, 20 zero bytes and the IPv4 header (rebuilt here from what the datagram
/// had: addresses and length; TTL 64, no options); over IPv6, an IB GRH of the same
/// fields, whose layout is the IPv6 header's.
fn grh(src: IpAddr, dst: IpAddr, p: &RoceRepr<'_>) -> [u8; GRH_LEN] {
    const UDP_HLEN: usize = 8;
    let roce = p.buffer_len();
    let mut g = [0u8; GRH_LEN];
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let ip = &mut g[20..];
            ip[0] = 0x45;
            let total = (20 + UDP_HLEN + roce) as u16;
            ip[2..4].copy_from_slice(&total.to_be_bytes());
            ip[6] = 0x40; // don't fragment
            ip[8] = 64;
            ip[9] = libc::IPPROTO_UDP as u8;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let sum = ipv4_checksum(ip);
            ip[10..12].copy_from_slice(&sum.to_be_bytes());
        }
        _ => {
            g[0] = 0x60;
            g[4..6].copy_from_slice(&((UDP_HLEN + roce) as u16).to_be_bytes());
            g[6] = libc::IPPROTO_UDP as u8;
            g[7] = 64;
            g[8..24].copy_from_slice(&ip_to_gid(src));
            g[24..40].copy_from_slice(&ip_to_gid(dst));
        }
    }
    g
}

/// The IPv4 header checksum (RFC 791) of `h` with its checksum field zero.
fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_grh_is_a_valid_ip_header() {
        let bth = wire::BthRepr::new(Opcode::UdSendOnly, 5, 0);
        let mut p = RoceRepr::new(bth, &[1, 2, 3, 4]);
        p.deth = Some(DethRepr::default());
        let g = grh("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap(), &p);
        assert_eq!(&g[..20], &[0; 20]);
        let ip = &g[20..];
        assert_eq!(ip[0], 0x45);
        assert_eq!(&ip[12..16], &[10, 0, 0, 1]);
        assert_eq!(&ip[16..20], &[10, 0, 0, 2]);
        // BTH 12 + DETH 8 + payload 4 + ICRC 4, UDP 8, IP 20.
        assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 56);
        assert_eq!(
            ipv4_checksum(ip),
            0,
            "a header with its checksum sums to zero"
        );
    }
}
