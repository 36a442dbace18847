//! rdma_cm's header at the start of the CM REQ private data, and rdma_cm service IDs
//! (IBTA annex A11 "RDMA IP CM Service"; Linux `drivers/infiniband/core/cma.c`,
//! `struct cma_hdr`).
//!
//! | bytes | field |
//! |---|---|
//! | 0 | version, 0 |
//! | 1 | IP version in the high nibble: `0x40` or `0x60` |
//! | 2..4 | the initiator's source port |
//! | 4..20 | source address: IPv6, or IPv4 in the last four bytes (the first twelve zero) |
//! | 20..36 | destination address, likewise |
//!
//! The consumer's own private data follows, so rdma_cm consumers get 92 − 36 = 56 bytes in
//! a REQ. The destination port is not in this header: it is the low 16 bits of the
//! service ID.

use super::{need, Error, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Size of the header.
pub const HEADER_LEN: usize = 36;
/// The only version.
pub const CMA_VERSION: u8 = 0;

/// rdma_cm port spaces (`enum rdma_ucm_port_space`).
pub const RDMA_PS_IPOIB: u16 = 0x0002;
pub const RDMA_PS_IB: u16 = 0x013f;
pub const RDMA_PS_TCP: u16 = 0x0106;
pub const RDMA_PS_UDP: u16 = 0x0111;

/// Service ID rdma_cm uses for `port` in port space `ps`: `ps << 16 | port`.
pub const fn service_id(ps: u16, port: u16) -> u64 {
    ((ps as u64) << 16) | port as u64
}

/// Service ID of a TCP port-space listener (what `rdma_listen` on an RC id uses):
/// `0x0000_0000_0106_xxxx`.
pub const fn service_id_tcp(port: u16) -> u64 {
    service_id(RDMA_PS_TCP, port)
}

/// The service ID of `port` in rdma_cm's UDP port space (SIDR: UD QPs).
pub const fn service_id_udp(port: u16) -> u64 {
    service_id(RDMA_PS_UDP, port)
}

/// Split an rdma_cm IP service ID into (port space, port); `None` if the top 32 bits are
/// not zero or the port space is not one rdma_cm uses.
pub fn parse_service_id(sid: u64) -> Option<(u16, u16)> {
    if sid >> 32 != 0 {
        return None;
    }
    let ps = (sid >> 16) as u16;
    matches!(ps, RDMA_PS_IPOIB | RDMA_PS_IB | RDMA_PS_TCP | RDMA_PS_UDP).then_some((ps, sid as u16))
}

/// The rdma_cm header. `src` and `dst` are of the same family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHdr {
    /// The initiator's port (its rdma_cm id's source port).
    pub src_port: u16,
    pub src: IpAddr,
    pub dst: IpAddr,
}

fn addr(b: &[u8], at: usize, v6: bool) -> IpAddr {
    if v6 {
        let mut a = [0u8; 16];
        a.copy_from_slice(&b[at..at + 16]);
        IpAddr::V6(Ipv6Addr::from(a))
    } else {
        IpAddr::V4(Ipv4Addr::new(
            b[at + 12],
            b[at + 13],
            b[at + 14],
            b[at + 15],
        ))
    }
}

fn put_addr(b: &mut [u8], at: usize, a: IpAddr) {
    let dst = &mut b[at..at + 16];
    match a {
        IpAddr::V4(v4) => {
            dst.fill(0);
            dst[12..].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => dst.copy_from_slice(&v6.octets()),
    }
}

impl CmaHdr {
    /// Parse the header at the start of `b` (REQ private data). The twelve bytes before
    /// an IPv4 address are not checked.
    pub fn parse(b: &[u8]) -> Result<CmaHdr> {
        need(HEADER_LEN, b.len())?;
        if b[0] != CMA_VERSION {
            return Err(Error::BadCmaVersion(b[0]));
        }
        let v6 = match b[1] >> 4 {
            4 => false,
            6 => true,
            v => return Err(Error::BadCmaIpVersion(v)),
        };
        Ok(CmaHdr {
            src_port: u16::from_be_bytes([b[2], b[3]]),
            src: addr(b, 4, v6),
            dst: addr(b, 20, v6),
        })
    }

    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Write the 36 bytes at the start of `b`; refuses mixed address families.
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        need(HEADER_LEN, b.len())?;
        let v = match (self.src, self.dst) {
            (IpAddr::V4(_), IpAddr::V4(_)) => 4u8,
            (IpAddr::V6(_), IpAddr::V6(_)) => 6,
            _ => {
                return Err(Error::FieldRange(
                    "rdma_cm header: mixed IPv4/IPv6 addresses",
                ))
            }
        };
        b[0] = CMA_VERSION;
        b[1] = v << 4;
        b[2..4].copy_from_slice(&self.src_port.to_be_bytes());
        put_addr(b, 4, self.src);
        put_addr(b, 20, self.dst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_hdr() -> impl Strategy<Value = CmaHdr> {
        prop_oneof![
            (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(|(p, s, d)| CmaHdr {
                src_port: p,
                src: IpAddr::V4(s.into()),
                dst: IpAddr::V4(d.into()),
            }),
            (any::<u16>(), any::<u128>(), any::<u128>()).prop_map(|(p, s, d)| CmaHdr {
                src_port: p,
                src: IpAddr::V6(s.into()),
                dst: IpAddr::V6(d.into()),
            }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(h in any_hdr()) {
            let mut b = [0xaau8; HEADER_LEN + 4];
            h.emit(&mut b).unwrap();
            prop_assert_eq!(&b[HEADER_LEN..], &[0xaa; 4]);
            prop_assert_eq!(CmaHdr::parse(&b), Ok(h));
        }

        #[test]
        fn truncated_rejected(h in any_hdr(), len in 0usize..HEADER_LEN) {
            let mut b = [0u8; HEADER_LEN];
            h.emit(&mut b).unwrap();
            prop_assert_eq!(CmaHdr::parse(&b[..len]), Err(Error::Truncated { need: HEADER_LEN, have: len }));
            prop_assert!(h.emit(&mut [0u8; HEADER_LEN][..len]).is_err());
        }

        #[test]
        fn random_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(h) = CmaHdr::parse(&b) {
                let mut o = [0u8; HEADER_LEN];
                h.emit(&mut o).unwrap();
                prop_assert_eq!(CmaHdr::parse(&o), Ok(h));
            }
        }

        #[test]
        fn service_ids(port in any::<u16>()) {
            prop_assert_eq!(service_id_tcp(port), 0x0106_0000 | port as u64);
            prop_assert_eq!(parse_service_id(service_id_tcp(port)), Some((RDMA_PS_TCP, port)));
            prop_assert_eq!(parse_service_id(service_id(RDMA_PS_UDP, port)), Some((RDMA_PS_UDP, port)));
        }
    }

    #[test]
    fn captured_and_errors() {
        // rping_rxe.pcap CM REQ private data.
        let mut b = [0u8; HEADER_LEN];
        b[1] = 0x40;
        b[2] = 0x81;
        b[3] = 0xbf;
        b[16..20].copy_from_slice(&[10, 77, 0, 12]);
        b[32..36].copy_from_slice(&[10, 77, 0, 11]);
        let h = CmaHdr::parse(&b).unwrap();
        assert_eq!(h.src_port, 0x81bf);
        assert_eq!(h.src, IpAddr::from([10, 77, 0, 12]));
        assert_eq!(h.dst, IpAddr::from([10, 77, 0, 11]));
        assert_eq!(service_id_tcp(7174), 0x0000_0000_0106_1c06);
        assert_eq!(parse_service_id(0x0000_0001_0106_1c06), None);
        assert_eq!(parse_service_id(0x0000_0000_0107_1c06), None);
        b[0] = 1;
        assert_eq!(CmaHdr::parse(&b), Err(Error::BadCmaVersion(1)));
        b[0] = 0;
        b[1] = 0x50;
        assert_eq!(CmaHdr::parse(&b), Err(Error::BadCmaIpVersion(5)));
        let mixed = CmaHdr {
            src_port: 1,
            src: IpAddr::from([1, 2, 3, 4]),
            dst: IpAddr::V6(Ipv6Addr::LOCALHOST),
        };
        assert!(matches!(mixed.emit(&mut b), Err(Error::FieldRange(_))));
    }
}
