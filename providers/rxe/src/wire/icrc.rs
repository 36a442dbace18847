//! The RoCEv2 invariant CRC (IBTA annex A17.3.3, as Linux `rxe_icrc.c` computes it).
//!
//! CRC-32 — the Ethernet/zlib one: reflected polynomial 0x04C11DB7, initial value all ones,
//! final complement (what `crc32fast` computes) — over:
//!
//! 1. eight bytes of `0xff`, standing in for the masked LRH of native InfiniBand (rxe starts
//!    from the CRC state after them, `0xdebb20e3`);
//! 2. the IP header with its variant fields set to all ones — IPv4: TOS (DSCP and ECN),
//!    TTL and header checksum; IPv6: traffic class, flow label and hop limit;
//! 3. the UDP header with its checksum set to all ones;
//! 4. the BTH with byte 4 (FECN, BECN, reserved bits) set to all ones;
//! 5. the rest of the UDP payload up to the ICRC: extension headers, payload, pad.
//!
//! The result is stored in the last four bytes of the UDP payload **little-endian** (rxe
//! writes the CPU-order CRC through a `__be32` pointer without swapping; x86 is little
//! endian, and every packet in the kernel captures agrees).
//!
//! Everything else is covered, including the IPv4 identification and total length and
//! the UDP source port. An engine that sends through an ordinary UDP socket does not know
//! the identification the kernel will pick, so it cannot produce a valid ICRC for IPv4;
//! it has to build the IP header itself ([`ipv4_header_for`]) and send through a raw
//! socket. The functions here take the real IP header bytes.

use super::bth;
use super::roce::ICRC_LEN;
use super::{need, Error, Result, ROCEV2_UDP_PORT};
use std::net::{Ipv4Addr, Ipv6Addr};

/// Size of an IPv4 header without options (the only kind rxe sends).
pub const IPV4_HEADER_LEN: usize = 20;
/// Size of an IPv6 header.
pub const IPV6_HEADER_LEN: usize = 40;
/// Size of a UDP header.
pub const UDP_HEADER_LEN: usize = 8;
const MASKED_LRH: [u8; 8] = [0xff; 8];

fn check_ipv4(ip: &[u8]) -> Result<()> {
    need(IPV4_HEADER_LEN, ip.len())?;
    if ip[0] >> 4 != 4 {
        return Err(Error::BadIpHeader("not IPv4"));
    }
    if ip[0] & 0x0f != 5 {
        return Err(Error::BadIpHeader("IPv4 options"));
    }
    if ip[9] != 17 {
        return Err(Error::BadIpHeader("not UDP"));
    }
    Ok(())
}

fn check_ipv6(ip: &[u8]) -> Result<()> {
    need(IPV6_HEADER_LEN, ip.len())?;
    if ip[0] >> 4 != 6 {
        return Err(Error::BadIpHeader("not IPv6"));
    }
    if ip[6] != 17 {
        return Err(Error::BadIpHeader("IPv6 extension headers or not UDP"));
    }
    Ok(())
}

/// An ICRC computed piece by piece, for packets whose payload lives elsewhere (a
/// scatter/gather list): start with the IP header and the UDP header plus BTH, feed the
/// extension headers, payload and pad with [`update`](Self::update), then
/// [`finish`](Self::finish). `icrc_ipv4(ip, udp)` equals
/// `Icrc::ipv4(ip, &udp[..20])?.update(&udp[20..]).finish()`.
#[derive(Clone)]
pub struct Icrc {
    h: crc32fast::Hasher,
}

impl Icrc {
    fn start(masked_ip: &[u8], udp_and_bth: &[u8]) -> Result<Icrc> {
        need(UDP_HEADER_LEN + bth::HEADER_LEN, udp_and_bth.len())?;
        let mut h = crc32fast::Hasher::new();
        h.update(&MASKED_LRH);
        h.update(masked_ip);
        let mut hdr = [0u8; UDP_HEADER_LEN + bth::HEADER_LEN];
        hdr.copy_from_slice(&udp_and_bth[..UDP_HEADER_LEN + bth::HEADER_LEN]);
        hdr[6] = 0xff; // UDP checksum
        hdr[7] = 0xff;
        hdr[UDP_HEADER_LEN + 4] = 0xff; // BTH FECN, BECN, reserved
        h.update(&hdr);
        let mut me = Icrc { h };
        me.update(&udp_and_bth[UDP_HEADER_LEN + bth::HEADER_LEN..]);
        Ok(me)
    }

    /// Start over IPv4: the 20-byte IP header and (at least) the UDP header and BTH; bytes
    /// after those count as the next part of the packet.
    pub fn ipv4(ip_header: &[u8], udp_and_bth: &[u8]) -> Result<Icrc> {
        check_ipv4(ip_header)?;
        let mut ip = [0u8; IPV4_HEADER_LEN];
        ip.copy_from_slice(&ip_header[..IPV4_HEADER_LEN]);
        ip[1] = 0xff; // TOS: DSCP + ECN
        ip[8] = 0xff; // TTL
        ip[10] = 0xff; // header checksum
        ip[11] = 0xff;
        Icrc::start(&ip, udp_and_bth)
    }

    /// Start over IPv6 (40-byte header, no extension headers).
    pub fn ipv6(ip_header: &[u8], udp_and_bth: &[u8]) -> Result<Icrc> {
        check_ipv6(ip_header)?;
        let mut ip = [0u8; IPV6_HEADER_LEN];
        ip.copy_from_slice(&ip_header[..IPV6_HEADER_LEN]);
        ip[0] |= 0x0f; // traffic class, high nibble
        ip[1] = 0xff; // traffic class low nibble, flow label
        ip[2] = 0xff;
        ip[3] = 0xff;
        ip[7] = 0xff; // hop limit
        Icrc::start(&ip, udp_and_bth)
    }

    /// Feed the next bytes of the packet (never the ICRC itself).
    pub fn update(&mut self, bytes: &[u8]) -> &mut Icrc {
        self.h.update(bytes);
        self
    }

    /// The ICRC (store it with `to_le_bytes`).
    pub fn finish(&self) -> u32 {
        self.h.clone().finalize()
    }
}

/// ICRC of a packet sent over IPv4. `ip_header` is the 20-byte header as it goes on the
/// wire (longer slices are allowed; only the first 20 bytes are used; options are
/// refused); `udp_without_icrc` is the UDP header and payload without the trailing ICRC.
pub fn icrc_ipv4(ip_header: &[u8], udp_without_icrc: &[u8]) -> Result<u32> {
    Ok(Icrc::ipv4(ip_header, udp_without_icrc)?.finish())
}

/// ICRC of a packet sent over IPv6 (40-byte header, no extension headers).
pub fn icrc_ipv6(ip_header: &[u8], udp_without_icrc: &[u8]) -> Result<u32> {
    Ok(Icrc::ipv6(ip_header, udp_without_icrc)?.finish())
}

fn split_icrc(udp: &[u8]) -> Result<(&[u8], u32)> {
    need(UDP_HEADER_LEN + bth::HEADER_LEN + ICRC_LEN, udp.len())?;
    let (body, tail) = udp.split_at(udp.len() - ICRC_LEN);
    Ok((
        body,
        u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]),
    ))
}

fn compare(found: u32, computed: u32) -> Result<()> {
    if found == computed {
        Ok(())
    } else {
        Err(Error::BadIcrc { found, computed })
    }
}

/// Check the ICRC at the end of `udp` (UDP header + payload including the ICRC).
pub fn verify_ipv4(ip_header: &[u8], udp: &[u8]) -> Result<()> {
    let (body, found) = split_icrc(udp)?;
    compare(found, icrc_ipv4(ip_header, body)?)
}

/// Check the ICRC at the end of `udp` (UDP header + payload including the ICRC).
pub fn verify_ipv6(ip_header: &[u8], udp: &[u8]) -> Result<()> {
    let (body, found) = split_icrc(udp)?;
    compare(found, icrc_ipv6(ip_header, body)?)
}

/// Compute and store the ICRC in the last four bytes of `udp`; returns it.
pub fn fill_ipv4(ip_header: &[u8], udp: &mut [u8]) -> Result<u32> {
    let (body, _) = split_icrc(udp)?;
    let c = icrc_ipv4(ip_header, body)?;
    let n = udp.len();
    udp[n - ICRC_LEN..].copy_from_slice(&c.to_le_bytes());
    Ok(c)
}

/// Compute and store the ICRC in the last four bytes of `udp`; returns it.
pub fn fill_ipv6(ip_header: &[u8], udp: &mut [u8]) -> Result<u32> {
    let (body, _) = split_icrc(udp)?;
    let c = icrc_ipv6(ip_header, body)?;
    let n = udp.len();
    udp[n - ICRC_LEN..].copy_from_slice(&c.to_le_bytes());
    Ok(c)
}

/// Split an IP datagram (IPv4 or IPv6 header, UDP header, RoCEv2 payload) into header and
/// UDP segment, using the IP length field (trailing bytes, e.g. Ethernet padding, are
/// ignored). Returns `(ip_header, udp_segment, is_ipv6)`.
pub fn split_datagram(d: &[u8]) -> Result<(&[u8], &[u8], bool)> {
    need(1, d.len())?;
    let (hlen, total, v6) = match d[0] >> 4 {
        4 => {
            check_ipv4(d)?;
            (
                IPV4_HEADER_LEN,
                u16::from_be_bytes([d[2], d[3]]) as usize,
                false,
            )
        }
        6 => {
            check_ipv6(d)?;
            let plen = u16::from_be_bytes([d[4], d[5]]) as usize;
            (IPV6_HEADER_LEN, IPV6_HEADER_LEN + plen, true)
        }
        _ => return Err(Error::BadIpHeader("not IPv4 or IPv6")),
    };
    need(total, d.len())?;
    if total < hlen + UDP_HEADER_LEN {
        return Err(Error::BadIpHeader("length field shorter than the headers"));
    }
    let udp = &d[hlen..total];
    let ulen = u16::from_be_bytes([udp[4], udp[5]]) as usize;
    if ulen != udp.len() {
        return Err(Error::BadIpHeader("UDP length disagrees with IP length"));
    }
    Ok((&d[..hlen], udp, v6))
}

/// Check the ICRC of a whole IP datagram.
pub fn verify_datagram(d: &[u8]) -> Result<()> {
    let (ip, udp, v6) = split_datagram(d)?;
    if v6 {
        verify_ipv6(ip, udp)
    } else {
        verify_ipv4(ip, udp)
    }
}

/// Fill the ICRC of a whole IP datagram; returns it.
pub fn fill_datagram(d: &mut [u8]) -> Result<u32> {
    let (hlen, end, v6) = {
        let (ip, udp, v6) = split_datagram(d)?;
        (ip.len(), ip.len() + udp.len(), v6)
    };
    let (ip, rest) = d.split_at_mut(hlen);
    let udp = &mut rest[..end - hlen];
    if v6 {
        fill_ipv6(ip, udp)
    } else {
        fill_ipv4(ip, udp)
    }
}

/// The Internet checksum of an IPv4 header (with its checksum field zeroed).
pub fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for (i, pair) in h.chunks(2).enumerate() {
        if i == 5 {
            continue; // the checksum field itself
        }
        let hi = pair[0] as u32;
        let lo = pair.get(1).copied().unwrap_or(0) as u32;
        sum += (hi << 8) | lo;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// The 20-byte IPv4 header rxe sends (`rxe_net.c`): version 4, IHL 5, `tos`, total length
/// `20 + udp_len`, identification `id`, Don't Fragment, `ttl`, protocol UDP, a valid
/// header checksum, `src`, `dst`. `udp_len` includes the UDP header.
pub fn ipv4_header_for(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    id: u16,
    ttl: u8,
    tos: u8,
    udp_len: u16,
) -> [u8; IPV4_HEADER_LEN] {
    let mut h = [0u8; IPV4_HEADER_LEN];
    h[0] = 0x45;
    h[1] = tos;
    h[2..4].copy_from_slice(&(IPV4_HEADER_LEN as u16).wrapping_add(udp_len).to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6] = 0x40; // DF
    h[8] = ttl;
    h[9] = 17;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let c = ipv4_checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

/// The 40-byte IPv6 header rxe sends: `traffic_class`, 20-bit `flow_label`, payload length
/// `udp_len`, next header UDP, `hop_limit`.
pub fn ipv6_header_for(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    traffic_class: u8,
    flow_label: u32,
    hop_limit: u8,
    udp_len: u16,
) -> [u8; IPV6_HEADER_LEN] {
    let mut h = [0u8; IPV6_HEADER_LEN];
    let word = (6u32 << 28) | ((traffic_class as u32) << 20) | (flow_label & 0xf_ffff);
    h[0..4].copy_from_slice(&word.to_be_bytes());
    h[4..6].copy_from_slice(&udp_len.to_be_bytes());
    h[6] = 17;
    h[7] = hop_limit;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h
}

/// The UDP header rxe sends: destination port 4791, length `udp_len` (header included),
/// checksum 0 (rxe leaves it zero over IPv4; the ICRC protects the payload).
pub fn udp_header_for(src_port: u16, udp_len: u16) -> [u8; UDP_HEADER_LEN] {
    let mut h = [0u8; UDP_HEADER_LEN];
    h[0..2].copy_from_slice(&src_port.to_be_bytes());
    h[2..4].copy_from_slice(&ROCEV2_UDP_PORT.to_be_bytes());
    h[4..6].copy_from_slice(&udp_len.to_be_bytes());
    h
}

/// Lowest UDP source port RoCEv2 uses (`IB_ROCE_UDP_ENCAP_VALID_PORT_MIN`): source ports
/// are 0xc000..=0xffff, 14 bits of entropy for ECMP.
pub const UDP_SPORT_MIN: u16 = 0xc000;

/// The UDP source port Linux derives from a flow label (`rdma_flow_label_to_udp_sport`):
/// the low 14 bits XOR the high 6, in the 0xc000 range.
pub const fn udp_sport_for_flow_label(flow_label: u32) -> u16 {
    let low = flow_label & 0x3fff;
    let high = (flow_label & 0xf_c000) >> 14;
    ((low ^ high) as u16) | UDP_SPORT_MIN
}

/// The symmetric flow label Linux computes for a connection whose path has none
/// (`rdma_calc_flow_label`): both ends get the same value.
pub const fn flow_label_for_qpns(lqpn: u32, rqpn: u32) -> u32 {
    let mut v = lqpn as u64 * rqpn as u64;
    v ^= v >> 20;
    v ^= v >> 40;
    (v & 0xf_ffff) as u32
}

/// UDP source port of a connected QP's packets (`rdma_get_udp_sport`): from the path's
/// flow label (rdma_cm puts one in the REQ), or from the QP numbers when it is zero (as
/// with `ibv_rc_pingpong` and perftest without rdma_cm).
pub const fn udp_sport_for(flow_label: u32, lqpn: u32, rqpn: u32) -> u16 {
    let fl = if flow_label == 0 {
        flow_label_for_qpns(lqpn, rqpn)
    } else {
        flow_label
    };
    udp_sport_for_flow_label(fl)
}

/// UDP source port rxe gives a QP that has no path flow label of its own, such as QP1
/// (the GSI, which carries the CM MADs): 0xc000 plus a 14-bit multiplicative hash of the
/// QP number (`hash_32(qpn, 14)`).
pub const fn rxe_qp_udp_sport(qpn: u32) -> u16 {
    UDP_SPORT_MIN + (qpn.wrapping_mul(0x61c8_8647) >> 18) as u16
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// rping_rxe.pcap frame 19 (CM REQ, UD SEND Only to QP1), IP header onwards, as hex.
    pub(crate) const CM_REQ_DATAGRAM: &str = concat!(
        "45000134f2c84000401132400a4d000c0a4d000bd87212b7012000006400ffff",
        "00000001800000008001000000000001010702030000000000000002affcd78b",
        "00100000000000008bd7fcaf000000000000000001061c06505400fffe77000c",
        "00000000000000000000110100000001000000a01ece27a7ffff37f0ffffffff",
        "00000000000000000000ffff0a4d000c00000000000000000000ffff0a4d000b",
        "fd22700000400098000000000000000000000000000000000000000000000000",
        "0000000000000000000000000000000000000000004081bf0000000000000000",
        "000000000a4d000c0000000000000000000000000a4d000b0000000000000000",
        "0000000000000000000000000000000000000000000000000000000000000000",
        "0000000000000000000000000000000090853917",
    );

    pub(crate) fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn captured_cm_req_icrc() {
        let d = hex(CM_REQ_DATAGRAM);
        assert_eq!(d.len(), 308);
        verify_datagram(&d).unwrap();
        let (ip, udp, v6) = split_datagram(&d).unwrap();
        assert!(!v6);
        let c = icrc_ipv4(ip, &udp[..udp.len() - 4]).unwrap();
        assert_eq!(c, 0x1739_8590, "stored little-endian: 90 85 39 17");
        // Piece by piece, split anywhere after the BTH.
        for cut in [20, 21, 100, udp.len() - 4] {
            let mut i = Icrc::ipv4(ip, &udp[..cut]).unwrap();
            i.update(&udp[cut..udp.len() - 4]);
            assert_eq!(i.finish(), c);
        }
        let mut e = d.clone();
        let n = e.len();
        e[n - 4..].fill(0);
        assert_eq!(fill_datagram(&mut e).unwrap(), c);
        assert_eq!(e, d);
        // Variant fields do not matter ...
        let mut v = d.clone();
        v[1] = 0x2e; // DSCP/ECN
        v[8] = 1; // TTL
        v[10] = 0x12; // checksum
        v[26] = 0xab; // UDP checksum
        v[28 + 4] = 0xc0; // FECN/BECN
        verify_datagram(&v).unwrap();
        // ... but the IP identification does.
        let mut w = d.clone();
        w[5] ^= 1;
        assert!(matches!(verify_datagram(&w), Err(Error::BadIcrc { .. })));
    }

    #[test]
    fn built_headers_match_the_kernel() {
        let d = hex(CM_REQ_DATAGRAM);
        let h = ipv4_header_for(
            Ipv4Addr::new(10, 77, 0, 12),
            Ipv4Addr::new(10, 77, 0, 11),
            0xf2c8,
            64,
            0,
            288,
        );
        assert_eq!(&h[..], &d[..20]);
        assert_eq!(&udp_header_for(55410, 288)[..], &d[20..28]);
        assert_eq!(rxe_qp_udp_sport(1), 55410, "QP1's source port");
    }

    #[test]
    fn source_ports_seen_in_the_captures() {
        // rping: the REQ's flow label 0xfd227 gives port 53784 both ways.
        assert_eq!(udp_sport_for(0xfd227, 0x11, 0x11), 53784);
        // ibv_rc_pingpong / perftest: no flow label, QPN 0x11 on both sides.
        assert_eq!(flow_label_for_qpns(0x11, 0x11), 0x121);
        assert_eq!(udp_sport_for(0, 0x11, 0x11), 49441);
        assert_eq!(
            flow_label_for_qpns(0x1234, 0x5678),
            flow_label_for_qpns(0x5678, 0x1234)
        );
        for fl in [0, 0x3fff, 0xf_ffff] {
            assert!(udp_sport_for_flow_label(fl) >= UDP_SPORT_MIN);
        }
    }

    #[test]
    fn ipv6_masking() {
        // Build an IPv6 datagram, fill, then vary the masked fields.
        let mut payload = vec![0u8; 12 + 4 + 4];
        payload[0] = 0x04; // RC SEND Only
        payload[2] = 0xff;
        payload[3] = 0xff;
        let udp_len = (8 + payload.len()) as u16;
        let ip = ipv6_header_for(
            "fe80::1".parse().unwrap(),
            "fe80::2".parse().unwrap(),
            0,
            0x12345,
            64,
            udp_len,
        );
        let mut d = ip.to_vec();
        d.extend_from_slice(&udp_header_for(0xc000, udp_len));
        d.extend_from_slice(&payload);
        fill_datagram(&mut d).unwrap();
        verify_datagram(&d).unwrap();
        let mut v = d.clone();
        v[0] = 0x6f;
        v[1] = 0x00;
        v[2] = 0x00;
        v[3] = 0x01;
        v[7] = 1;
        verify_datagram(&v).unwrap();
        v[8] ^= 1; // source address
        assert!(verify_datagram(&v).is_err());
    }

    #[test]
    fn bad_headers() {
        let d = hex(CM_REQ_DATAGRAM);
        let mut o = d.clone();
        o[0] = 0x46;
        assert_eq!(verify_datagram(&o), Err(Error::BadIpHeader("IPv4 options")));
        o[0] = 0x55;
        assert_eq!(
            verify_datagram(&o),
            Err(Error::BadIpHeader("not IPv4 or IPv6"))
        );
        let mut o = d.clone();
        o[9] = 6;
        assert_eq!(verify_datagram(&o), Err(Error::BadIpHeader("not UDP")));
        assert!(matches!(
            verify_datagram(&d[..100]),
            Err(Error::Truncated { .. })
        ));
        assert!(icrc_ipv4(&d[..19], &d[20..]).is_err());
        assert!(icrc_ipv4(&d[..20], &d[20..30]).is_err());
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(mut b in proptest::collection::vec(any::<u8>(), 0..120)) {
            let _ = verify_datagram(&b);
            let _ = fill_datagram(&mut b);
            let _ = split_datagram(&b);
            if b.len() > 40 {
                let (ip, udp) = b.split_at(40);
                let _ = icrc_ipv4(ip, udp);
                let _ = icrc_ipv6(ip, udp);
                let _ = verify_ipv4(ip, udp);
                let _ = verify_ipv6(ip, udp);
            }
        }

        #[test]
        fn any_single_byte_change_is_caught(i in 0usize..308, x in 1u8..=255) {
            let d = hex(CM_REQ_DATAGRAM);
            let mut m = d.clone();
            m[i] ^= x;
            let masked = matches!(i, 1 | 8 | 10 | 11 | 26 | 27 | 32);
            let res = verify_datagram(&m);
            if masked {
                prop_assert!(res.is_ok());
            } else {
                prop_assert!(res.is_err(), "byte {} changed, ICRC still ok", i);
            }
        }

        #[test]
        fn checksum_is_valid(src in any::<u32>(), dst in any::<u32>(), id in any::<u16>(), ttl in any::<u8>(), tos in any::<u8>(), len in any::<u16>()) {
            let h = ipv4_header_for(src.into(), dst.into(), id, ttl, tos, len);
            // Summing a header including its checksum gives 0xffff.
            let mut sum: u32 = h.chunks(2).map(|p| u16::from_be_bytes([p[0], p[1]]) as u32).sum();
            while sum > 0xffff { sum = (sum & 0xffff) + (sum >> 16); }
            prop_assert_eq!(sum, 0xffff);
        }
    }
}
