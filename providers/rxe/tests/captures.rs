//! Real RoCEv2 traffic, parsed packet by packet with the provider's own codecs.
//!
//! `tests/captures/` holds captures of Linux kernel rdma_rxe talking to kernel rdma_rxe
//! (ibv_rc_pingpong, rping, the librdmacm rdma_server/rdma_client examples, perftest
//! ib_send_lat and ib_write_bw; Debian 12, kernel 6.1, from the project's shared reference
//! set), of a guest's rping sending CM REQs to a host with no RDMA stack, and of a
//! guest's ibv_ud_pingpong over kernel rxe facing `krdma ud-pingpong` (UD datagrams both
//! ways), of librdmacm's udaddy facing `krdma udaddy` in both roles (SIDR, then
//! datagrams; `scripts/interop-rxe.sh`, 2026-11-27) and of ibv_uc_pingpong facing `krdma
//! uc-pingpong` (UC Sends both ways, 2026-12-03). Every frame
//! to UDP port 4791 is taken apart: Ethernet, IPv4/IPv6, UDP, then the RoCEv2 packet. Its
//! ICRC is verified, it is parsed, and its `Repr` is emitted again and must reproduce the
//! original bytes exactly, ICRC included. The opcode counts are those tshark 4.0 reports
//! for the same files. CM MADs on QP1 are decoded and checked against the data packets
//! (QPNs, starting PSNs) and the rdma_cm header. The packets found also seed a mutation
//! fuzz test.
//!
//! Over 600 lines: one test per set of captures, sharing the pcap reader and the frame
//! checks.

use proptest::prelude::*;
use rxe::wire::cm::{self, CmMad, CmMessage};
use rxe::wire::cma;
use rxe::wire::deth::{GSI_QKEY, GSI_QPN};
use rxe::wire::icrc;
use rxe::wire::{
    Direction, Error, Opcode, Operation, RocePacket, RoceRepr, Syndrome, Transport, ROCEV2_UDP_PORT,
};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

fn capture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/captures")
        .join(name)
}

/// One RoCEv2 packet as captured: the IP datagram (IP header to ICRC).
#[derive(Debug, Clone)]
struct Frame {
    /// 1-based frame number in the capture.
    number: usize,
    datagram: Vec<u8>,
}

impl Frame {
    fn split(&self) -> (&[u8], &[u8]) {
        let (ip, udp, _) = icrc::split_datagram(&self.datagram).expect("IP/UDP framing");
        (ip, udp)
    }

    fn src(&self) -> IpAddr {
        let d = &self.datagram;
        if d[0] >> 4 == 4 {
            IpAddr::from([d[12], d[13], d[14], d[15]])
        } else {
            let mut a = [0u8; 16];
            a.copy_from_slice(&d[8..24]);
            IpAddr::from(a)
        }
    }

    fn udp_sport(&self) -> u16 {
        let udp = self.split().1;
        u16::from_be_bytes([udp[0], udp[1]])
    }

    /// The UDP payload: the RoCEv2 packet.
    fn roce(&self) -> &[u8] {
        &self.split().1[8..]
    }
}

/// Every frame of an Ethernet capture addressed to UDP port 4791.
fn roce_frames(name: &str) -> Vec<Frame> {
    let f = std::fs::File::open(capture(name)).expect("capture present");
    let mut r = pcap_file::pcap::PcapReader::new(f).expect("pcap header");
    let mut out = Vec::new();
    let mut number = 0;
    while let Some(p) = r.next_packet() {
        let p = p.expect("pcap record");
        number += 1;
        assert_eq!(
            p.data.len() as u32,
            p.orig_len,
            "{name}: frame {number} cut short by the snap length"
        );
        let d = &p.data[..];
        if d.len() < 14 {
            continue;
        }
        let mut ethertype = u16::from_be_bytes([d[12], d[13]]);
        let mut off = 14;
        while (ethertype == 0x8100 || ethertype == 0x88a8) && d.len() >= off + 4 {
            ethertype = u16::from_be_bytes([d[off + 2], d[off + 3]]);
            off += 4;
        }
        let ip = &d[off..];
        let (udp_off, proto) = match ethertype {
            0x0800 if ip.len() >= 20 => (((ip[0] & 0x0f) as usize) * 4, ip[9]),
            0x86dd if ip.len() >= 40 => (40, ip[6]),
            _ => continue,
        };
        if proto != 17 || ip.len() < udp_off + 8 {
            continue;
        }
        let dport = u16::from_be_bytes([ip[udp_off + 2], ip[udp_off + 3]]);
        if dport != ROCEV2_UDP_PORT {
            continue;
        }
        let (iph, udp, _) = icrc::split_datagram(ip)
            .unwrap_or_else(|e| panic!("{name}: frame {number}: IP/UDP framing: {e}"));
        out.push(Frame {
            number,
            datagram: [iph, udp].concat(),
        });
    }
    out
}

#[derive(Debug, Default)]
struct Tally {
    packets: usize,
    by_opcode: BTreeMap<u8, usize>,
    mads: Vec<(IpAddr, CmMad)>,
}

/// Parse, ICRC-check and re-emit every RoCEv2 packet of a capture; panics with the first
/// disagreement.
fn check_capture(name: &str) -> (Tally, Vec<Frame>) {
    let frames = roce_frames(name);
    let mut t = Tally::default();
    for f in &frames {
        let n = f.number;
        icrc::verify_datagram(&f.datagram)
            .unwrap_or_else(|e| panic!("{name}: frame {n}: ICRC: {e}"));
        let p =
            RocePacket::new_checked(f.roce()).unwrap_or_else(|e| panic!("{name}: frame {n}: {e}"));
        let r = RoceRepr::parse(&p).unwrap_or_else(|e| panic!("{name}: frame {n}: {e}"));
        assert!(
            p.pad_bytes().iter().all(|&b| b == 0),
            "{name}: frame {n}: rxe pads with zeros"
        );

        // Re-emit, fill the ICRC over the captured IP/UDP headers: identical bytes.
        let (ip, udp) = f.split();
        let mut again = udp[..8].to_vec();
        again.extend_from_slice(&r.to_vec().expect("emit"));
        let v6 = ip[0] >> 4 == 6;
        let c = if v6 {
            icrc::fill_ipv6(ip, &mut again)
        } else {
            icrc::fill_ipv4(ip, &mut again)
        }
        .expect("fill ICRC");
        assert_eq!(c, p.icrc(), "{name}: frame {n}: ICRC");
        assert_eq!(again, udp, "{name}: frame {n}: re-emitted bytes differ");

        // Facts every rxe packet obeys.
        assert!(
            !r.bth.mig_req,
            "{name}: frame {n}: rxe sets MigReq only with APM"
        );
        assert!(
            !r.bth.fecn && !r.bth.becn,
            "{name}: frame {n}: no ECN marks"
        );
        if let Some(a) = r.aeth {
            assert_eq!(
                a.syndrome,
                Syndrome::ACK_UNLIMITED,
                "{name}: frame {n}: rxe ACKs without credit information (no NAKs here)"
            );
        }

        if r.bth.opcode == Opcode::UdSendOnly && r.bth.dest_qp == GSI_QPN {
            let deth = r.deth.expect("UD has a DETH");
            assert_eq!(
                (deth.qkey, deth.src_qp),
                (GSI_QKEY, GSI_QPN),
                "{name}: frame {n}"
            );
            assert_eq!(r.bth.pkey, 0xffff);
            let m =
                CmMad::parse(r.payload).unwrap_or_else(|e| panic!("{name}: frame {n}: MAD: {e}"));
            assert_eq!(
                &m.to_bytes()[..],
                r.payload,
                "{name}: frame {n}: MAD re-emission"
            );
            assert_eq!(
                cm::gsi_packet(r.payload, r.bth.pkey, r.bth.psn),
                r,
                "{name}: frame {n}: the GSI packet rxe builds around a MAD"
            );
            assert_eq!(
                f.udp_sport(),
                icrc::rxe_qp_udp_sport(GSI_QPN),
                "{name}: frame {n}: QP1's UDP source port"
            );
            t.mads.push((f.src(), m));
        }
        t.packets += 1;
        *t.by_opcode.entry(r.bth.opcode.as_u8()).or_default() += 1;
    }
    check_source_ports(name, &t, &frames);
    eprintln!(
        "{name}: {} RoCEv2 packets, opcodes {:?}",
        t.packets, t.by_opcode
    );
    assert!(t.packets > 0, "{name}: no RoCEv2 traffic found");
    (t, frames)
}

/// RC packets leave from the UDP port Linux derives from the path's flow label: the one in
/// the CM REQ when rdma_cm set up the connection, else the one computed from the two QPNs.
fn check_source_ports(name: &str, t: &Tally, frames: &[Frame]) {
    let req_flow_label = t.mads.iter().find_map(|(_, m)| match m.message {
        CmMessage::Req(r) => Some(r.primary_path.flow_label),
        _ => None,
    });
    let parsed: Vec<(IpAddr, u16, RoceRepr)> = frames
        .iter()
        .map(|f| {
            (
                f.src(),
                f.udp_sport(),
                RoceRepr::parse_bytes(f.roce()).unwrap(),
            )
        })
        .filter(|(_, _, r)| r.bth.opcode.transport() == Transport::Rc)
        .collect();
    for (src, sport, r) in &parsed {
        let expect = match req_flow_label {
            Some(fl) => icrc::udp_sport_for_flow_label(fl),
            None => {
                // The peer's DestQP is our QPN.
                let lqpn = parsed
                    .iter()
                    .find(|(s, _, _)| s != src)
                    .map(|(_, _, p)| p.bth.dest_qp)
                    .expect("traffic both ways");
                icrc::udp_sport_for(0, lqpn, r.bth.dest_qp)
            }
        };
        assert_eq!(*sport, expect, "{name}: UDP source port from {src}");
    }
}

fn counts(pairs: &[(Opcode, usize)]) -> BTreeMap<u8, usize> {
    pairs.iter().map(|&(o, n)| (o.as_u8(), n)).collect()
}

/// The RoCEv2 packets sent by `from`, parsed, in capture order.
fn packets_from<'a>(frames: &'a [Frame], from: IpAddr) -> impl Iterator<Item = RoceRepr<'a>> {
    frames
        .iter()
        .filter(move |f| f.src() == from)
        .map(|f| RoceRepr::parse_bytes(f.roce()).unwrap())
}

const VM1: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 11));
const VM2: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 12));

#[test]
fn rc_pingpong() {
    let (t, frames) = check_capture("rc_pingpong_rxe_first400.pcap");
    use Opcode::*;
    assert_eq!(
        t.by_opcode,
        counts(&[
            (RcSendFirst, 75),
            (RcSendMiddle, 146),
            (RcSendLast, 73),
            (RcAcknowledge, 77)
        ])
    );
    // 4096-byte messages at MTU 1024: every packet carries a full MTU.
    for f in &frames {
        let r = RoceRepr::parse_bytes(f.roce()).unwrap();
        if r.bth.opcode.operation() == Operation::Send {
            assert_eq!(r.payload.len(), 1024, "frame {}", f.number);
            assert_eq!(r.bth.pad_count, 0);
            assert_eq!(r.bth.ack_req, r.bth.opcode.position().is_end());
        }
    }
}

/// ibv_ud_pingpong (kernel rxe, 10.77.0.11) and `krdma ud-pingpong` (10.77.0.1): UD
/// SEND Only packets both ways, each with a DETH naming the sender's QP and the
/// example's Q_Key, from the UDP port rxe derives from the sending QP (a UD QP has no
/// path flow label).
#[test]
fn ud_pingpong_kernel_and_krdma() {
    let (t, frames) = check_capture("ud_pingpong_rxe_krdma.pcap");
    assert_eq!(t.by_opcode, counts(&[(Opcode::UdSendOnly, 29)]));
    let host = IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 1));
    let first = |from| packets_from(&frames, from).next().unwrap();
    let (guest_qpn, host_qpn) = (first(host).bth.dest_qp, first(VM1).bth.dest_qp);
    for (from, src_qp, dest_qp) in [(VM1, guest_qpn, host_qpn), (host, host_qpn, guest_qpn)] {
        for f in frames.iter().filter(|f| f.src() == from) {
            let r = RoceRepr::parse_bytes(f.roce()).unwrap();
            let deth = r.deth.expect("a DETH");
            assert_eq!(
                (deth.qkey, deth.src_qp),
                (0x1111_1111, src_qp),
                "frame {}",
                f.number
            );
            assert_eq!(r.bth.dest_qp, dest_qp);
            assert_eq!(r.payload.len(), 1024, "the example's default size");
            assert!(!r.bth.ack_req, "a datagram asks for no acknowledgement");
            assert_eq!(
                f.udp_sport(),
                icrc::rxe_qp_udp_sport(src_qp),
                "frame {}",
                f.number
            );
        }
    }
}

/// ibv_uc_pingpong (kernel rxe, 10.77.0.11, the server) and `krdma uc-pingpong`
/// (10.77.0.1), 4096-byte Sends at a 1024-byte MTU (`scripts/interop-rxe.sh`,
/// 2026-12-03, the first 28 packets): each message UC SEND First, Middle, Middle, Last
/// with consecutive PSNs, full 1024-byte segments, and neither side asking for an
/// acknowledgement nor sending one.
#[test]
fn uc_pingpong_kernel_and_krdma() {
    use Opcode::*;
    let (t, frames) = check_capture("uc_pingpong_rxe_krdma.pcap");
    assert_eq!(
        t.by_opcode,
        counts(&[(UcSendFirst, 7), (UcSendMiddle, 14), (UcSendLast, 7)])
    );
    let host = IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 1));
    for from in [host, VM1] {
        let packets: Vec<RoceRepr> = packets_from(&frames, from).collect();
        assert!(packets.len() >= 12, "{from}: {} packets", packets.len());
        let message = [UcSendFirst, UcSendMiddle, UcSendMiddle, UcSendLast];
        for (i, p) in packets.iter().enumerate() {
            assert_eq!(p.bth.opcode, message[i % 4], "{from}: packet {i}");
            assert_eq!(p.bth.opcode.transport(), Transport::Uc);
            assert!(
                !p.bth.ack_req,
                "{from}: packet {i} asks for an acknowledgement"
            );
            assert_eq!(p.payload.len(), 1024);
            assert_eq!(p.bth.dest_qp, packets[0].bth.dest_qp);
            let psn = packets[0].bth.psn.wrapping_add(i as u32) & 0xff_ffff;
            assert_eq!(p.bth.psn, psn, "{from}: packet {i}: consecutive PSNs");
        }
    }
}

#[test]
fn rping_with_rdma_cm() {
    let (t, frames) = check_capture("rping_rxe.pcap");
    use Opcode::*;
    assert_eq!(
        t.by_opcode,
        counts(&[
            (RcSendOnly, 40),
            (RcRdmaWriteOnly, 10),
            (RcRdmaReadRequest, 10),
            (RcRdmaReadResponseOnly, 10),
            (RcAcknowledge, 50),
            (UdSendOnly, 5),
        ])
    );

    // The connection's CM exchange: REQ and RTU and DREQ from the client (vm2), REP and
    // DREP from the server (vm1).
    let kinds: Vec<(IpAddr, u16)> = t
        .mads
        .iter()
        .map(|(ip, m)| (*ip, m.message.attribute_id()))
        .collect();
    assert_eq!(
        kinds,
        [
            (VM2, cm::ATTR_REQ),
            (VM1, cm::ATTR_REP),
            (VM2, cm::ATTR_RTU),
            (VM2, cm::ATTR_DREQ),
            (VM1, cm::ATTR_DREP)
        ]
    );
    let msg = |i: usize| t.mads[i].1.message;
    let (
        CmMessage::Req(req),
        CmMessage::Rep(rep),
        CmMessage::Rtu(rtu),
        CmMessage::Dreq(dreq),
        CmMessage::Drep(drep),
    ) = (msg(0), msg(1), msg(2), msg(3), msg(4))
    else {
        panic!("unexpected CM messages")
    };

    // REQ: rdma_cm, TCP port space, port 7174, the right addresses.
    assert_eq!(req.service_id, cma::service_id_tcp(7174));
    assert_eq!(
        cma::parse_service_id(req.service_id),
        Some((cma::RDMA_PS_TCP, 7174))
    );
    let h = req.cma_header().unwrap();
    assert_eq!((h.src, h.dst), (VM2, VM1));
    assert_eq!(
        &req.primary_path.local_gid[10..],
        &[0xff, 0xff, 10, 77, 0, 12]
    );
    assert_eq!(
        &req.primary_path.remote_gid[10..],
        &[0xff, 0xff, 10, 77, 0, 11]
    );
    assert_eq!(req.transport_service_type, cm::transport_type::RC);
    assert_eq!(cm::mtu_bytes(req.path_mtu), Some(1024));

    // Communication IDs tie the messages together.
    assert_eq!(rep.remote_comm_id, req.local_comm_id);
    assert_eq!(
        (rtu.local_comm_id, rtu.remote_comm_id),
        (req.local_comm_id, rep.local_comm_id)
    );
    assert_eq!(
        (dreq.local_comm_id, dreq.remote_comm_id),
        (req.local_comm_id, rep.local_comm_id)
    );
    assert_eq!(
        (drep.local_comm_id, drep.remote_comm_id),
        (rep.local_comm_id, req.local_comm_id)
    );
    assert_eq!(dreq.remote_qpn, rep.local_qpn, "DREQ names the server's QP");
    // A response MAD keeps the request's transaction ID.
    assert_eq!(t.mads[1].1.transaction_id, t.mads[0].1.transaction_id);

    // QPNs and starting PSNs match the RC traffic. The client's packets go to the QP the
    // REP announced, the server's to the REQ's. The starting PSNs are crossed: Linux CM
    // takes a REQ's or REP's starting PSN as the PSN its *receiver* sends with (the
    // sender's expected receive PSN), so the server's requests start at the REQ's PSN and
    // the client's at the REP's. (ACKs and read responses carry the PSNs of the requests
    // they answer.)
    for (from, dest_qp, first_psn) in [
        (VM2, rep.local_qpn, rep.starting_psn),
        (VM1, req.local_qpn, req.starting_psn),
    ] {
        let rc: Vec<_> = packets_from(&frames, from)
            .filter(|r| r.bth.opcode.transport() == Transport::Rc)
            .collect();
        assert!(
            rc.iter().all(|r| r.bth.dest_qp == dest_qp),
            "DestQP from {from}"
        );
        let first = rc
            .iter()
            .find(|r| r.bth.opcode.direction() == Direction::Request)
            .expect("requests");
        assert_eq!(first.bth.psn, first_psn, "first request PSN from {from}");
    }

    // rping -C 10: the READ requests ask for as much as each response carries, with the
    // R_Key / VA the client advertised (not checked here: they live in the SEND payload).
    for f in &frames {
        let r = RoceRepr::parse_bytes(f.roce()).unwrap();
        if r.bth.opcode == RcRdmaReadRequest {
            assert!(r.reth.unwrap().dma_len > 0);
        }
    }
}

#[test]
fn rdma_server_example() {
    let (t, _) = check_capture("rdma_server_rxe.pcap");
    use Opcode::*;
    assert_eq!(
        t.by_opcode,
        counts(&[(RcSendOnly, 2), (RcAcknowledge, 2), (UdSendOnly, 7)])
    );
    let kinds: Vec<(IpAddr, u16)> = t
        .mads
        .iter()
        .map(|(ip, m)| (*ip, m.message.attribute_id()))
        .collect();
    // Both sides disconnect at once: two DREQs crossing, each answered by a DREP.
    assert_eq!(
        kinds,
        [
            (VM2, cm::ATTR_REQ),
            (VM1, cm::ATTR_REP),
            (VM2, cm::ATTR_RTU),
            (VM2, cm::ATTR_DREQ),
            (VM1, cm::ATTR_DREQ),
            (VM2, cm::ATTR_DREP),
            (VM1, cm::ATTR_DREP)
        ]
    );
    let req = t
        .mads
        .iter()
        .find_map(|(_, m)| match m.message {
            CmMessage::Req(r) => Some(r),
            _ => None,
        })
        .expect("a REQ");
    assert_eq!(
        cma::parse_service_id(req.service_id),
        Some((cma::RDMA_PS_TCP, 7471))
    );
    let h = req.cma_header().unwrap();
    assert_eq!((h.src, h.dst), (VM2, VM1));
}

#[test]
fn perftest_send_lat() {
    let (t, frames) = check_capture("send_lat_rxe.pcap");
    use Opcode::*;
    assert_eq!(
        t.by_opcode,
        counts(&[(RcSendOnly, 2012), (RcAcknowledge, 2012)])
    );
    // 2-byte sends: two bytes of pad.
    for f in &frames {
        let p = RocePacket::new_checked(f.roce()).unwrap();
        if p.opcode() == RcSendOnly {
            assert_eq!(
                (p.payload().len(), p.pad_count()),
                (2, 2),
                "frame {}",
                f.number
            );
        }
    }
}

#[test]
fn perftest_write_bw() {
    let (t, frames) = check_capture("write_bw_rxe_first400.pcap");
    use Opcode::*;
    assert_eq!(
        t.by_opcode,
        counts(&[
            (RcRdmaWriteFirst, 6),
            (RcRdmaWriteMiddle, 344),
            (RcRdmaWriteLast, 5),
            (RcAcknowledge, 5)
        ])
    );
    for f in &frames {
        let r = RoceRepr::parse_bytes(f.roce()).unwrap();
        if r.bth.opcode == RcRdmaWriteFirst {
            assert_eq!(r.reth.unwrap().dma_len, 65536, "64 KiB writes");
        }
        if r.bth.opcode.operation() == Operation::RdmaWrite {
            assert_eq!(r.payload.len(), 1024);
        }
    }
}

#[test]
fn guest_rping_to_a_host_without_rdma() {
    let (t, _) = check_capture("host_peer.pcap");
    assert_eq!(t.by_opcode, counts(&[(Opcode::UdSendOnly, 5)]));
    let kinds: Vec<u16> = t
        .mads
        .iter()
        .map(|(_, m)| m.message.attribute_id())
        .collect();
    assert_eq!(
        kinds,
        [
            cm::ATTR_REQ,
            cm::ATTR_REQ,
            cm::ATTR_REQ,
            cm::ATTR_REQ,
            cm::ATTR_REJ
        ]
    );
    // The REQ retries are the same message: same TID, same comm ID.
    let first = t.mads[0].1;
    for (_, m) in &t.mads[1..4] {
        assert_eq!(*m, first);
    }
    let CmMessage::Req(req) = first.message else {
        unreachable!()
    };
    let h = req.cma_header().unwrap();
    assert_eq!(h.dst, IpAddr::from([10, 77, 0, 1]));
    assert_eq!(
        cma::parse_service_id(req.service_id),
        Some((cma::RDMA_PS_TCP, 7174))
    );
    // After the last retry the client's CM gives up with a REJ (timeout).
    let CmMessage::Rej(rej) = t.mads[4].1.message else {
        unreachable!()
    };
    assert_eq!(rej.local_comm_id, req.local_comm_id);
    assert_eq!(rej.remote_comm_id, 0, "no REP ever came");
    assert_eq!(rej.reason, cm::rej_reason::TIMEOUT);
    // Linux marks a timed-out REQ's REJ as "other" and puts its CA GUID in the ARI.
    assert_eq!(rej.message_rejected, cm::msg_ref::OTHER);
    assert_eq!(rej.rejected_info_length, 8);
    assert_eq!(&rej.ari[..8], &req.local_ca_guid.to_be_bytes());
}

/// Every prefix of every rping packet (and of each MAD) is refused, or — since a RoCEv2
/// packet's extent is the UDP payload — read as a shorter packet of the same kind; the
/// ICRC then fails it.
#[test]
fn every_prefix_of_every_rping_packet() {
    for f in roce_frames("rping_rxe.pcap") {
        let b = f.roce();
        let full = RoceRepr::parse_bytes(b).unwrap();
        for n in 0..b.len() {
            match RocePacket::new_checked(&b[..n]) {
                Err(_) => {}
                Ok(p) => {
                    assert_eq!(p.opcode(), full.bth.opcode);
                    assert!(
                        p.payload_len() < full.payload.len(),
                        "frame {} cut at {n}",
                        f.number
                    );
                    let (ip, udp) = f.split();
                    let cut = &udp[..8 + n];
                    assert!(
                        icrc::verify_ipv4(ip, cut).is_err(),
                        "frame {} cut at {n}",
                        f.number
                    );
                }
            }
        }
        if full.bth.opcode == Opcode::UdSendOnly {
            for n in 0..full.payload.len() {
                assert_eq!(
                    CmMad::parse(&full.payload[..n]),
                    Err(Error::Truncated { need: 256, have: n })
                );
            }
        }
    }
}

/// Every captured RoCEv2 datagram, for the fuzz test.
fn corpus() -> &'static Vec<Vec<u8>> {
    static C: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    C.get_or_init(|| {
        let mut c = Vec::new();
        for name in [
            "rc_pingpong_rxe_first400.pcap",
            "rping_rxe.pcap",
            "rdma_server_rxe.pcap",
            "send_lat_rxe.pcap",
            "write_bw_rxe_first400.pcap",
            "host_peer.pcap",
            "ud_pingpong_rxe_krdma.pcap",
            "uc_pingpong_rxe_krdma.pcap",
            "udaddy_guest_server.pcap",
            "udaddy_host_server.pcap",
        ] {
            let frames = roce_frames(name);
            // Keep the corpus varied: every packet of the small captures, a sample of the
            // large ones.
            let step = (frames.len() / 400).max(1);
            c.extend(frames.into_iter().step_by(step).map(|f| f.datagram));
        }
        c
    })
}

/// Whatever the codecs make of `d` (an IP datagram), they do without panicking, and what
/// parses re-emits to something that parses the same.
fn exercise(d: &[u8]) {
    let _ = icrc::verify_datagram(d);
    let Ok((_, udp, _)) = icrc::split_datagram(d) else {
        return;
    };
    let payload = &udp[8..];
    let Ok(p) = RocePacket::new_checked(payload) else {
        return;
    };
    let _ = (
        p.payload(),
        p.pad_bytes(),
        p.icrc(),
        p.reth(),
        p.aeth(),
        p.deth(),
    );
    let Ok(r) = RoceRepr::parse(&p) else { return };
    let out = r.to_vec().expect("a parsed packet emits");
    assert_eq!(out.len(), payload.len());
    assert_eq!(RoceRepr::parse_bytes(&out).unwrap(), r);
    if let Ok(m) = CmMad::parse(r.payload) {
        assert_eq!(CmMad::parse(&m.to_bytes()).unwrap(), m);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// Captured packets with random bytes changed, or cut, never make the codecs panic,
    /// re-emit consistently, and a changed byte outside the ICRC's masked fields is always
    /// caught by the ICRC.
    #[test]
    fn mutated_captured_packets(
        pick in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let c = corpus();
        let orig = &c[pick.index(c.len())];
        let mut d = orig.clone();
        for (i, v) in &edits {
            let i = i.index(d.len());
            d[i] = *v;
        }
        if do_cut {
            d.truncate(cut.index(d.len() + 1));
        }
        exercise(&d);
        if !do_cut && edits.len() == 1 && d != *orig {
            let i = edits[0].0.index(d.len());
            // Bytes the ICRC does not cover: IPv4 TOS, TTL, checksum; UDP checksum; BTH
            // byte 4. (Length fields are covered, and framing catches them first.)
            let masked = matches!(i, 1 | 8 | 10 | 11 | 26 | 27 | 32);
            let res = icrc::verify_datagram(&d);
            if masked {
                prop_assert!(res.is_ok());
            } else {
                prop_assert!(res.is_err(), "byte {} changed undetected", i);
            }
        }
    }

    /// The RoCEv2 parser alone, on mutated UDP payloads (no ICRC check in the way).
    #[test]
    fn mutated_captured_payloads(
        pick in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let c = corpus();
        let (_, udp, _) = icrc::split_datagram(&c[pick.index(c.len())]).unwrap();
        let mut b = udp[8..].to_vec();
        for (i, v) in &edits {
            let i = i.index(b.len());
            b[i] = *v;
        }
        b.truncate(cut.index(b.len() + 1).max(b.len() / 2));
        match RocePacket::new_checked(&b[..]) {
            Ok(p) => {
                if let Ok(r) = RoceRepr::parse(&p) {
                    let out = r.to_vec().unwrap();
                    prop_assert_eq!(out.len(), b.len());
                    prop_assert_eq!(RoceRepr::parse_bytes(&out).unwrap(), r);
                    if let Ok(m) = CmMad::parse(r.payload) {
                        prop_assert_eq!(CmMad::parse(&m.to_bytes()).unwrap(), m);
                    }
                }
            }
            Err(e) => {
                let emit_only = matches!(e, Error::HeaderMismatch { .. });
                prop_assert!(!emit_only, "parse reported an emit error: {}", e);
            }
        }
    }
}

/// `scripts/fuzz.sh seed`: the captured datagrams become the `rxe_packet` fuzz corpus,
/// and what each host of a capture received becomes an `rxe_engine` input: its packets
/// as capture records (`tag 0, length u16 little-endian, the RoCEv2 packet`, see
/// `tests/fuzz/fuzz_targets/rxe_engine/input.rs`), a few KiB of them.
#[test]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("KRDMA_FUZZ_SEEDS") else {
        return;
    };
    let packets = PathBuf::from(&dir).join("rxe_packet");
    std::fs::create_dir_all(&packets).unwrap();
    for (i, d) in corpus().iter().enumerate() {
        std::fs::write(packets.join(format!("capture-{i:04}")), d).unwrap();
    }
    let engine = PathBuf::from(&dir).join("rxe_engine");
    std::fs::create_dir_all(&engine).unwrap();
    for name in [
        "rping_rxe.pcap",
        "rdma_server_rxe.pcap",
        "send_lat_rxe.pcap",
        "rc_pingpong_rxe_first400.pcap",
        "write_bw_rxe_first400.pcap",
        "ud_pingpong_rxe_krdma.pcap",
    ] {
        let frames = roce_frames(name);
        for to in [VM1, VM2] {
            let mut seed = Vec::new();
            if name.starts_with("ud_") {
                // A setup record first: the QP under test is a UD QP (the last byte).
                let setup = [7u8, 2, 2, 3, 100, 0, 0, 0, 200, 0, 0, 0, 4, 1];
                seed.extend_from_slice(&[2, setup.len() as u8, 0]);
                seed.extend_from_slice(&setup);
            }
            for f in frames.iter().filter(|f| f.src() != to) {
                let roce = f.roce();
                if seed.len() + 3 + roce.len() > 3000 {
                    break;
                }
                seed.push(0u8);
                seed.extend_from_slice(&(roce.len() as u16).to_le_bytes());
                seed.extend_from_slice(roce);
            }
            let stem = name.trim_end_matches(".pcap");
            std::fs::write(engine.join(format!("{stem}-to-{to}")), seed).unwrap();
        }
    }
}

/// librdmacm's udaddy between kernel rdma_cm (10.77.0.11) and `krdma udaddy` (10.77.0.1),
/// each as the server once: the SIDR_REQ for port 7174 in rdma_cm's UDP port space and
/// its SIDR_REP (kernel-made in one capture, krdma-made in the other) re-emit byte for
/// byte; the REP names the QP the datagrams then go to and rdma_cm's UDP Q_Key, and each
/// datagram carries its sender's QP number as immediate data.
#[test]
fn udaddy_sidr_kernel_and_krdma() {
    let host = IpAddr::V4(std::net::Ipv4Addr::new(10, 77, 0, 1));
    for (name, server) in [
        ("udaddy_guest_server.pcap", VM1),
        ("udaddy_host_server.pcap", host),
    ] {
        let (t, frames) = check_capture(name);
        let client = if server == VM1 { host } else { VM1 };
        let (mut req, mut rep) = (None, None);
        for (src, m) in &t.mads {
            match m.message {
                CmMessage::SidrReq(r) if *src == client => req = Some(r),
                CmMessage::SidrRep(r) if *src == server => rep = Some(r),
                ref other => panic!("{name}: unexpected {other:?}"),
            }
        }
        let (req, rep) = (req.expect("a SIDR_REQ"), rep.expect("a SIDR_REP"));
        assert_eq!(
            cma::parse_service_id(req.service_id),
            Some((cma::RDMA_PS_UDP, 7174))
        );
        let hdr = req.cma_header().expect("an rdma_cm header");
        assert_eq!((hdr.src, hdr.dst), (client, server), "{name}");
        assert_eq!(rep.request_id, req.request_id);
        assert_eq!(
            (rep.status, rep.qkey),
            (cm::sidr_status::SUCCESS, 0x0123_4567)
        );
        assert_eq!(rep.service_id, req.service_id);
        let mut data = 0;
        for f in frames.iter().filter(|f| f.src() == client) {
            let r = RoceRepr::parse_bytes(f.roce()).unwrap();
            if r.bth.dest_qp == GSI_QPN {
                continue;
            }
            assert_eq!(
                r.bth.opcode,
                Opcode::UdSendOnlyImm,
                "{name}: frame {}",
                f.number
            );
            assert_eq!(
                r.bth.dest_qp, rep.qpn,
                "{name}: to the QP the SIDR_REP named"
            );
            let deth = r.deth.unwrap();
            assert_eq!(deth.qkey, 0x0123_4567);
            let imm = r.immdt.unwrap().imm;
            assert_eq!(
                imm, deth.src_qp,
                "{name}: the sender's QPN as immediate data"
            );
            data += 1;
        }
        assert_eq!(data, 10, "{name}: udaddy's 10 messages");
    }
}
