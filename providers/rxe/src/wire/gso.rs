//! A run of RoCEv2 packets carried as one UDP segmentation-offload (GSO) datagram.
//!
//! With `UDP_SEGMENT` Linux takes a run of equal-sized UDP payloads (the last may be
//! shorter) in one `sendmsg` and carries it as one datagram that it cuts into datagrams of
//! the segment size only where something needs them cut: a device without the offload, or
//! a receiving UDP socket that did not ask for GRO. Over loopback nothing does, and a raw
//! socket receives the whole run behind one IP and one UDP header. Two rules let the
//! receiver cut such a run again and check every packet's ICRC, whoever cut it:
//!
//! * **The first packet implies the segment size.** A run starts with a packet carrying
//!   [`SEGMENT_PAYLOAD`] bytes, so every packet of the run but the last is
//!   [`segment_len`] bytes long (its opcode's headers, the payload, the ICRC). No single
//!   RoCEv2 packet is longer than that, so a longer UDP payload is a run.
//! * **Each packet's ICRC covers the header the kernel gives it when it cuts the run**
//!   (`inet_gso_segment`): the run's IPv4 header with the packet's own length and the
//!   identification of the run plus the packet's index, and the run's UDP header with the
//!   packet's length ([`segment_headers`]). Linux sends a DF datagram of an unconnected
//!   socket with identification 0, so the packet with index `k` is covered with `k`.
//!
//! A third shape carries an acknowledgement behind the packet it leaves with (a
//! ping-pong's reply, when the ACK was held back for the polling consumer who then
//! posted it): two segments, the packet first (the segment size is its length) and the
//! [`ACK_LEN`]-byte Acknowledge last. When the packet is a full segment the first rule
//! cuts the pair already; when it is shorter, the receiver cannot tell the segment size
//! from it, so a datagram that is no run and whose whole ICRC does not verify is tried
//! as such a pair ([`Segments::acked`]). The sender pairs only a packet that this rule
//! cannot misread ([`ack_rides_behind`]).
//!
//! Only IPv4 runs exist (the IPv6 header carries no identification, but nothing here has
//! needed IPv6 runs yet).

use super::icrc::{IPV4_HEADER_LEN, UDP_HEADER_LEN};
use super::Opcode;
use crate::wire::roce::ICRC_LEN;

/// Payload bytes of every packet of a run but the last: the largest IB MTU.
pub const SEGMENT_PAYLOAD: usize = 4096;

/// The most UDP payload one IPv4 datagram carries (65535 − IPv4 and UDP headers).
pub const MAX_RUN_BYTES: usize = 65535 - IPV4_HEADER_LEN - UDP_HEADER_LEN;

/// The length of every packet of a run that starts with `first` (a RoCEv2 UDP payload)
/// but its last: `None` when `first` has no valid opcode.
pub fn segment_len(first: &[u8]) -> Option<usize> {
    let opcode = Opcode::from_u8(*first.first()?).ok()?;
    Some(opcode.header_len() + SEGMENT_PAYLOAD + ICRC_LEN)
}

/// The length of an RC Acknowledge: BTH, AETH, ICRC.
pub const ACK_LEN: usize = super::bth::HEADER_LEN + super::aeth::HEADER_LEN + ICRC_LEN;

/// Whether `roce` (a RoCEv2 UDP payload) is an RC Acknowledge.
pub fn is_ack(roce: &[u8]) -> bool {
    roce.len() == ACK_LEN && roce[0] == Opcode::RcAcknowledge as u8
}

/// Whether an Acknowledge may ride behind `first` in one datagram: `first` is a full
/// segment (the first rule cuts the pair), or short enough that the pair is no longer
/// than one (so the receiver does not take it for a run), and no shorter than the ACK
/// (every segment but the last is the longest).
pub fn ack_rides_behind(first: &[u8]) -> bool {
    let Some(seg) = segment_len(first) else {
        return false;
    };
    let n = first.len();
    n >= ACK_LEN && (n == seg || n + ACK_LEN <= seg)
}

/// The most packets a run holds: as many of the shortest segments (a bare BTH, a full
/// payload, the ICRC) as fit one datagram.
pub const MAX_RUN: usize = MAX_RUN_BYTES / (super::bth::HEADER_LEN + SEGMENT_PAYLOAD + ICRC_LEN);

/// How many packets of a run of `seg`-byte segments one datagram holds.
pub fn max_run(seg: usize) -> usize {
    (MAX_RUN_BYTES / seg.max(1)).min(MAX_RUN)
}

/// The IPv4 and UDP headers packet `k` of a run has once cut from it, `len` bytes long
/// (its UDP payload): the run's headers `ip` and `udp` with the packet's lengths and
/// identification. The IPv4 checksum is left as it was: the ICRC does not cover it.
pub fn segment_headers(
    ip: &[u8; IPV4_HEADER_LEN],
    udp: &[u8; UDP_HEADER_LEN],
    k: usize,
    len: usize,
) -> ([u8; IPV4_HEADER_LEN], [u8; UDP_HEADER_LEN]) {
    let udp_len = (UDP_HEADER_LEN + len) as u16;
    let mut ip = *ip;
    let id = u16::from_be_bytes([ip[4], ip[5]]).wrapping_add(k as u16);
    ip[2..4].copy_from_slice(&(IPV4_HEADER_LEN as u16).wrapping_add(udp_len).to_be_bytes());
    ip[4..6].copy_from_slice(&id.to_be_bytes());
    let mut udp = *udp;
    udp[4..6].copy_from_slice(&udp_len.to_be_bytes());
    (ip, udp)
}

/// One packet cut from a run, with the headers its ICRC covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment<'a> {
    pub ip: [u8; IPV4_HEADER_LEN],
    pub udp: [u8; UDP_HEADER_LEN],
    /// BTH .. ICRC.
    pub roce: &'a [u8],
}

/// The packets of a run, in order.
#[derive(Debug, Clone)]
pub struct Segments<'a> {
    ip: [u8; IPV4_HEADER_LEN],
    udp: [u8; UDP_HEADER_LEN],
    rest: &'a [u8],
    seg: usize,
    k: usize,
}

impl<'a> Segments<'a> {
    /// The packets of `payload`, a UDP payload that came behind the IPv4 header `ip` and
    /// the UDP header `udp`, when it is a run (longer than its first packet's segment
    /// length); `None` when it is a single packet (or too short to tell).
    pub fn of(ip: &[u8], udp: &[u8], payload: &'a [u8]) -> Option<Segments<'a>> {
        let seg = segment_len(payload)?;
        if payload.len() <= seg {
            return None;
        }
        Self::cut(ip, udp, payload, seg)
    }

    /// The two packets of `payload` when it is a packet with an Acknowledge riding
    /// behind ([`ack_rides_behind`]): its last [`ACK_LEN`] bytes are an Acknowledge and
    /// what comes before is no shorter. `None` otherwise. Only for a datagram that is no
    /// run by the first rule ([`Segments::of`]) and fails its ICRC as one packet.
    pub fn acked(ip: &[u8], udp: &[u8], payload: &'a [u8]) -> Option<Segments<'a>> {
        let seg = payload.len().checked_sub(ACK_LEN)?;
        if seg < ACK_LEN || !is_ack(&payload[seg..]) {
            return None;
        }
        Self::cut(ip, udp, payload, seg)
    }

    /// `payload` cut into `seg`-byte packets (the last may be shorter).
    fn cut(ip: &[u8], udp: &[u8], payload: &'a [u8], seg: usize) -> Option<Segments<'a>> {
        Some(Segments {
            ip: ip.get(..IPV4_HEADER_LEN)?.try_into().ok()?,
            udp: udp.get(..UDP_HEADER_LEN)?.try_into().ok()?,
            rest: payload,
            seg,
            k: 0,
        })
    }
}

impl<'a> Iterator for Segments<'a> {
    type Item = Segment<'a>;

    fn next(&mut self) -> Option<Segment<'a>> {
        if self.rest.is_empty() {
            return None;
        }
        let (roce, rest) = self.rest.split_at(self.seg.min(self.rest.len()));
        self.rest = rest;
        let (ip, udp) = segment_headers(&self.ip, &self.udp, self.k, roce.len());
        self.k += 1;
        Some(Segment { ip, udp, roce })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{icrc, BthRepr, RethRepr, RoceRepr};
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    /// The headers of a run from and to loopback, as the kernel sends it.
    fn run_headers() -> ([u8; IPV4_HEADER_LEN], [u8; UDP_HEADER_LEN]) {
        let lo = Ipv4Addr::LOCALHOST;
        (
            icrc::ipv4_header_for(lo, lo, 0, 64, 0, 0),
            icrc::udp_header_for(4791, 0),
        )
    }

    /// The packets of an RDMA Write of `len` bytes (the first carries a RETH).
    fn write_packets(len: usize) -> Vec<Vec<u8>> {
        let data: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
        let n = data.len().div_ceil(SEGMENT_PAYLOAD);
        data.chunks(SEGMENT_PAYLOAD)
            .enumerate()
            .map(|(k, c)| {
                let op = match (k == 0, k + 1 == n) {
                    (true, true) => Opcode::RcRdmaWriteOnly,
                    (true, false) => Opcode::RcRdmaWriteFirst,
                    (false, true) => Opcode::RcRdmaWriteLast,
                    (false, false) => Opcode::RcRdmaWriteMiddle,
                };
                let mut r = RoceRepr::new(BthRepr::new(op, 0x11, k as u32), c);
                if k == 0 {
                    r.reth = Some(RethRepr {
                        va: 0x1000,
                        rkey: 7,
                        dma_len: len as u32,
                    });
                }
                r.to_vec().unwrap()
            })
            .collect()
    }

    /// Fill the ICRCs of `run` as its sender does: packet `k` over the headers it has
    /// once cut from the run.
    fn fill_as_run(run: &mut [Vec<u8>]) {
        let (ip, udp) = run_headers();
        for (k, p) in run.iter_mut().enumerate() {
            let (ip, udp) = segment_headers(&ip, &udp, k, p.len());
            let mut whole = udp.to_vec();
            whole.extend_from_slice(p);
            icrc::fill_ipv4(&ip, &mut whole).unwrap();
            p.copy_from_slice(&whole[UDP_HEADER_LEN..]);
        }
    }

    fn verifies(s: &Segment<'_>) -> bool {
        let mut whole = s.udp.to_vec();
        whole.extend_from_slice(s.roce);
        icrc::verify_ipv4(&s.ip, &whole).is_ok()
    }

    /// A Write's first packet (with its RETH) is longer than the rest and leaves alone;
    /// the middles and the shorter last make a run, which cuts back into exactly those
    /// packets, each numbered from the run and verifying over its own headers.
    #[test]
    fn a_run_cuts_back_into_its_packets() {
        let mut pkts = write_packets(5 * SEGMENT_PAYLOAD + 100);
        assert_eq!(segment_len(&pkts[0]), Some(pkts[0].len()));
        assert_eq!(segment_len(&pkts[1]), Some(pkts[1].len()));
        assert!(pkts[0].len() > pkts[1].len());
        fill_as_run(&mut pkts[1..]);
        let (ip, udp) = run_headers();
        assert!(
            Segments::of(&ip, &udp, &pkts[0]).is_none(),
            "a single packet"
        );
        assert!(
            Segments::of(&ip, &udp, &pkts[5]).is_none(),
            "the short last alone"
        );
        let bytes = pkts[1..].concat();
        let cut: Vec<Segment> = Segments::of(&ip, &udp, &bytes).expect("a run").collect();
        assert_eq!(cut.len(), 5);
        for (k, (s, p)) in cut.iter().zip(&pkts[1..]).enumerate() {
            assert_eq!(s.roce, &p[..]);
            assert_eq!(u16::from_be_bytes([s.ip[4], s.ip[5]]), k as u16);
            assert_eq!(
                u16::from_be_bytes([s.udp[4], s.udp[5]]) as usize,
                UDP_HEADER_LEN + p.len()
            );
            assert!(verifies(s), "packet {k}");
        }
        assert!(max_run(pkts[1].len()) * pkts[1].len() <= MAX_RUN_BYTES);
    }

    /// One damaged packet of a run fails its ICRC alone; the others still verify.
    #[test]
    fn a_damaged_packet_fails_alone() {
        let mut pkts = write_packets(6 * SEGMENT_PAYLOAD);
        fill_as_run(&mut pkts[1..]);
        let seg = pkts[1].len();
        let mut bytes = pkts[1..].concat();
        bytes[2 * seg + 40] ^= 1;
        let (ip, udp) = run_headers();
        let verdicts: Vec<bool> = Segments::of(&ip, &udp, &bytes)
            .unwrap()
            .map(|s| verifies(&s))
            .collect();
        assert_eq!(verdicts, vec![true, true, false, true, true]);
    }

    /// An RC Acknowledge of `psn`.
    fn ack(psn: u32) -> Vec<u8> {
        use crate::wire::{AethRepr, Syndrome};
        let mut r = RoceRepr::new(BthRepr::new(Opcode::RcAcknowledge, 0x11, psn), &[]);
        r.aeth = Some(AethRepr {
            syndrome: Syndrome::Ack { credit_code: 31 },
            msn: 3,
        });
        r.to_vec().unwrap()
    }

    /// A Send Only of `len` payload bytes.
    fn send_only(len: usize) -> Vec<u8> {
        RoceRepr::new(BthRepr::new(Opcode::RcSendOnly, 0x11, 9), &vec![5; len])
            .to_vec()
            .unwrap()
    }

    /// `pkts` as one datagram, each filled as packet `k` of a run, and cut again by `cut`.
    fn as_one_datagram<'a>(
        pkts: &mut [Vec<u8>],
        bytes: &'a mut Vec<u8>,
        cut: impl Fn(&[u8], &[u8], &'a [u8]) -> Option<Segments<'a>>,
    ) -> Option<Vec<Segment<'a>>> {
        fill_as_run(pkts);
        *bytes = pkts.concat();
        let (ip, udp) = run_headers();
        cut(&ip, &udp, bytes).map(|s| s.collect())
    }

    /// An Acknowledge behind a short packet: no run by the first rule, but the pair cuts
    /// back into the two packets, each verifying over its own headers; behind a full
    /// segment the first rule cuts it already.
    #[test]
    fn an_ack_rides_behind_a_packet() {
        assert_eq!(ack(1).len(), ACK_LEN);
        assert!(is_ack(&ack(1)));
        for len in [8, 1000, SEGMENT_PAYLOAD] {
            let mut pkts = vec![send_only(len), ack(7)];
            assert!(ack_rides_behind(&pkts[0]), "{len}");
            let mut bytes = Vec::new();
            let cut = if len == SEGMENT_PAYLOAD {
                as_one_datagram(&mut pkts, &mut bytes, Segments::of)
            } else {
                let (ip, udp) = run_headers();
                let whole = pkts.concat();
                assert!(Segments::of(&ip, &udp, &whole).is_none(), "no run: {len}");
                as_one_datagram(&mut pkts, &mut bytes, Segments::acked)
            }
            .expect("the pair");
            assert_eq!(cut.len(), 2);
            for (s, p) in cut.iter().zip(&pkts) {
                assert_eq!(s.roce, &p[..]);
                assert!(verifies(s));
            }
        }
    }

    /// What an Acknowledge may not ride behind: a packet so long that the pair would be
    /// taken for a run of its segment length, one shorter than the ACK, or no packet.
    #[test]
    fn what_an_ack_rides_behind() {
        let seg = segment_len(&send_only(8)).unwrap();
        let short = seg - ACK_LEN - ICRC_LEN - super::super::bth::HEADER_LEN;
        assert!(ack_rides_behind(&send_only(short)));
        assert!(!ack_rides_behind(&send_only(short + 4)));
        assert!(ack_rides_behind(&ack(1)));
        let mut tiny = send_only(0);
        assert!(tiny.len() < ACK_LEN);
        assert!(!ack_rides_behind(&tiny));
        tiny[0] = 0xff;
        assert!(!ack_rides_behind(&tiny), "no opcode");
        // No Acknowledge at the end, or too little before it: no pair.
        let (ip, udp) = run_headers();
        assert!(Segments::acked(&ip, &udp, &send_only(100)).is_none());
        assert!(Segments::acked(&ip, &udp, &[send_only(0), ack(1)].concat()).is_none());
    }

    proptest! {
        /// Any bytes taken for an acknowledged pair: never a panic, and when they are one,
        /// exactly two pieces, the second an Acknowledge, covering the bytes.
        #[test]
        fn a_pair_of_any_bytes_is_two_packets(payload in proptest::collection::vec(any::<u8>(), 0..5000), ack_at_end in any::<bool>()) {
            let mut payload = payload;
            if ack_at_end {
                payload.extend(ack(3));
            }
            let (ip, udp) = run_headers();
            if let Some(s) = Segments::acked(&ip, &udp, &payload) {
                let pieces: Vec<Segment> = s.collect();
                prop_assert_eq!(pieces.len(), 2);
                prop_assert!(is_ack(pieces[1].roce));
                prop_assert!(pieces[0].roce.len() >= ACK_LEN);
                prop_assert_eq!([pieces[0].roce, pieces[1].roce].concat(), payload.clone());
            }
        }

        /// Any bytes: cutting never panics, the pieces cover the payload exactly and in
        /// order, and every piece but the last is one segment long.
        #[test]
        fn cutting_any_bytes_covers_them(payload in proptest::collection::vec(any::<u8>(), 0..20_000)) {
            let (ip, udp) = run_headers();
            if let Some(s) = Segments::of(&ip, &udp, &payload) {
                let seg = segment_len(&payload).unwrap();
                let pieces: Vec<Segment> = s.collect();
                prop_assert!(pieces.len() >= 2);
                prop_assert_eq!(pieces.iter().map(|p| p.roce).collect::<Vec<_>>().concat(), payload.clone());
                for p in &pieces[..pieces.len() - 1] {
                    prop_assert_eq!(p.roce.len(), seg);
                }
            }
        }
    }
}
