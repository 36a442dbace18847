//! Real iWARP traffic, parsed frame by frame with the provider's own codecs.
//!
//! `tests/captures/` holds captures of Linux kernel siw talking to kernel siw (rping,
//! rdma_server, perftest; from the project's shared reference set) and of krdma talking to
//! kernel siw (rping in both roles). Every TCP stream is reassembled, the MPA Request and
//! Reply are parsed, and then every FPDU: length, padding, CRC32c when negotiated, DDP/RDMAP
//! header and Read Request body. No error is allowed; a capture cut short may end inside one
//! FPDU. Every frame and FPDU parsed is emitted again from what was parsed, and must come
//! out byte for byte as captured (the CRC included). The FPDUs found also seed a fuzz test
//! of the parsers.

use proptest::prelude::*;
use siw::wire::{self, FpduPacket, Header, MpaFrame, Opcode, RdmapPacket, ReadRequest};
use std::collections::BTreeMap;
use std::net::SocketAddrV4;
use std::path::PathBuf;

type Flow = (SocketAddrV4, SocketAddrV4);

#[derive(Default)]
struct Stream {
    data: Vec<u8>,
    next_seq: Option<u32>,
    /// A hole in the sequence space (lost from the capture): parsing stops there.
    gap: bool,
}

fn capture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/captures")
        .join(name)
}

/// Reassemble every TCP stream of an Ethernet/IPv4 capture, in order of first appearance.
fn tcp_streams(name: &str) -> Vec<(Flow, Stream)> {
    let f = std::fs::File::open(capture(name)).expect("capture present");
    let mut r = pcap_file::pcap::PcapReader::new(f).expect("pcap header");
    let mut order = Vec::new();
    let mut streams: BTreeMap<Flow, Stream> = BTreeMap::new();
    while let Some(p) = r.next_packet() {
        let p = p.expect("pcap record");
        let d = &p.data[..];
        if d.len() < 14 + 20 || u16::from_be_bytes([d[12], d[13]]) != 0x0800 {
            continue;
        }
        let ip = &d[14..];
        let ihl = (ip[0] & 0x0f) as usize * 4;
        let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        if ip[9] != 6 || total > ip.len() {
            continue;
        }
        let tcp = &ip[ihl..total];
        let addr = |o: usize| std::net::Ipv4Addr::new(ip[o], ip[o + 1], ip[o + 2], ip[o + 3]);
        let port = |o: usize| u16::from_be_bytes([tcp[o], tcp[o + 1]]);
        let flow = (
            SocketAddrV4::new(addr(12), port(0)),
            SocketAddrV4::new(addr(16), port(2)),
        );
        let seq = u32::from_be_bytes(tcp[4..8].try_into().unwrap());
        let doff = (tcp[12] >> 4) as usize * 4;
        let syn = tcp[13] & 0x02 != 0;
        let payload = &tcp[doff..];
        if !streams.contains_key(&flow) {
            order.push(flow);
        }
        let s = streams.entry(flow).or_default();
        if syn {
            s.next_seq = Some(seq.wrapping_add(1));
            continue;
        }
        if payload.is_empty() || s.gap {
            continue;
        }
        let next = *s.next_seq.get_or_insert(seq);
        let ahead = seq.wrapping_sub(next) as i32;
        if ahead > 0 {
            s.gap = true;
        } else if (payload.len() as i64) > -(ahead as i64) {
            // New bytes (a retransmission may overlap what we have).
            s.data.extend_from_slice(&payload[(-ahead) as usize..]);
            s.next_seq = Some(seq.wrapping_add(payload.len() as u32));
        }
    }
    order
        .into_iter()
        .map(|f| {
            let s = streams.remove(&f).unwrap();
            (f, s)
        })
        .collect()
}

#[derive(Debug, Default)]
struct Tally {
    connections: usize,
    crc_connections: usize,
    fpdus: usize,
    by_opcode: BTreeMap<&'static str, usize>,
    cut_short: usize,
}

fn opcode_name(o: Opcode) -> &'static str {
    match o {
        Opcode::Write => "write",
        Opcode::ReadRequest => "read-request",
        Opcode::ReadResponse => "read-response",
        Opcode::Send | Opcode::SendInvalidate | Opcode::SendSe | Opcode::SendSeInvalidate => "send",
        Opcode::Terminate => "terminate",
    }
}

/// Parse every FPDU of `b`; returns how many, and whether the data ended inside one.
fn parse_fpdus(
    b: &[u8],
    crc: bool,
    tally: &mut Tally,
    corpus: &mut Vec<Vec<u8>>,
) -> Result<(), String> {
    let mut off = 0;
    while off < b.len() {
        let f = match FpduPacket::new_checked(&b[off..]) {
            Ok(f) => f,
            Err(wire::Error::Truncated(_)) => {
                tally.cut_short += 1;
                return Ok(());
            }
            Err(e) => return Err(format!("FPDU at {off}: {e}")),
        };
        let total = f.total_len();
        let fpdu = &b[off..off + total];
        if crc {
            f.check_crc().map_err(|e| format!("FPDU at {off}: {e}"))?;
        }
        let u = RdmapPacket::new_checked(f.ulpdu()).map_err(|e| format!("ULPDU at {off}: {e}"))?;
        let h = Header::parse(&u).map_err(|e| format!("header at {off}: {e}"))?;
        let rr = match h.opcode {
            Opcode::ReadRequest => Some(
                ReadRequest::parse_bytes(u.payload())
                    .map_err(|e| format!("read request at {off}: {e}"))?,
            ),
            _ => None,
        };
        // Emitted again from what was parsed: the same bytes.
        let mut again = Vec::new();
        let start = wire::begin_fpdu(&mut again);
        h.emit(wire::grow(&mut again, h.buffer_len()));
        match rr {
            Some(rr) => again.extend_from_slice(&rr.to_vec()),
            None => again.extend_from_slice(u.payload()),
        }
        wire::finish_fpdu(&mut again, start, crc).unwrap();
        // Kernel siw's pad bytes are whatever its buffer held: keep them (under the CRC).
        let mut p = FpduPacket::new_checked(&mut again[start..]).unwrap();
        p.pad_mut().copy_from_slice(f.pad());
        p.fill_crc(crc);
        if again != fpdu {
            return Err(format!(
                "FPDU at {off} re-emitted differs:\n{fpdu:02x?}\n{again:02x?}"
            ));
        }
        *tally.by_opcode.entry(opcode_name(h.opcode)).or_default() += 1;
        tally.fpdus += 1;
        if corpus.len() < 2000 {
            corpus.push(fpdu.to_vec());
        }
        off += total;
    }
    Ok(())
}

/// Parse one capture completely; panics with the first error.
fn parse_capture(name: &str, corpus: &mut Vec<Vec<u8>>) -> Tally {
    let streams = tcp_streams(name);
    let mut tally = Tally::default();
    for (flow, s) in &streams {
        let Ok(req) = MpaFrame::parse_bytes(&s.data) else {
            continue; // not the initiator side of an MPA connection
        };
        let used = req.buffer_len();
        if req.reply {
            continue; // the responder's side, handled with its initiator
        }
        let back = streams
            .iter()
            .find(|(f, _)| f.0 == flow.1 && f.1 == flow.0)
            .map(|(_, s)| s)
            .unwrap_or_else(|| panic!("{name} {flow:?}: no reverse stream"));
        let rep = MpaFrame::parse_bytes(&back.data)
            .unwrap_or_else(|e| panic!("{name} {flow:?}: MPA Reply: {e}"));
        let rep_used = rep.buffer_len();
        for (f, bytes) in [(&req, &s.data[..used]), (&rep, &back.data[..rep_used])] {
            assert_eq!(
                f.to_vec().unwrap(),
                bytes,
                "{name} {flow:?}: MPA frame re-emitted"
            );
        }
        assert!(rep.reply && !rep.reject, "{name}: accepted Reply");
        assert_eq!((req.revision, rep.revision), (2, 2), "{name}: MPA v2");
        assert!(
            req.ird_ord.is_some() && rep.ird_ord.is_some(),
            "{name}: RFC 6581 IRD/ORD"
        );
        assert!(!rep.markers, "{name}: kernel siw never negotiates markers");
        let crc = rep.crc;
        tally.connections += 1;
        tally.crc_connections += crc as usize;
        for (data, from) in [
            (&s.data[used..], "initiator"),
            (&back.data[rep_used..], "responder"),
        ] {
            parse_fpdus(data, crc, &mut tally, corpus)
                .unwrap_or_else(|e| panic!("{name} {flow:?} {from}: {e}"));
        }
        if !name.contains("first400") {
            assert!(!s.gap && !back.gap, "{name}: capture lost segments");
        }
    }
    eprintln!("{name}: {tally:?}");
    assert!(
        tally.connections > 0 && tally.fpdus > 0,
        "{name}: no iWARP traffic found"
    );
    if !name.contains("first400") {
        assert_eq!(tally.cut_short, 0, "{name}: a stream ends inside an FPDU");
    }
    tally
}

/// rping with -C 10: per ping two advertisements and two go-aheads (Sends), one Read Request
/// with its single-FPDU response, and one Write.
fn assert_rping_shape(t: &Tally) {
    assert_eq!(t.by_opcode.get("send"), Some(&40));
    assert_eq!(t.by_opcode.get("read-request"), Some(&10));
    assert_eq!(t.by_opcode.get("read-response"), Some(&10));
    assert_eq!(t.by_opcode.get("write"), Some(&10));
}

#[test]
fn kernel_rping_without_crc() {
    let t = parse_capture("rping_siw.pcap", &mut vec![]);
    assert_eq!(t.crc_connections, 0);
    assert_rping_shape(&t);
}

#[test]
fn kernel_rping_with_crc() {
    let t = parse_capture("rping_siw_crc.pcap", &mut vec![]);
    assert_eq!(t.crc_connections, 1);
    assert_rping_shape(&t);
}

#[test]
fn krdma_client_against_kernel_rping_server() {
    let t = parse_capture("krdma_client_vs_kernel_rping.pcap", &mut vec![]);
    assert_eq!(t.crc_connections, 0);
    assert_rping_shape(&t);
}

#[test]
fn kernel_rping_client_with_crc_against_krdma_server() {
    let t = parse_capture("kernel_client_crc_vs_krdma_rping.pcap", &mut vec![]);
    assert_eq!(t.crc_connections, 1);
    assert_rping_shape(&t);
}

#[test]
fn kernel_rdma_server_example() {
    parse_capture("rdma_server_siw.pcap", &mut vec![]);
}

#[test]
fn kernel_perftest_send_lat() {
    let t = parse_capture("send_lat_siw.pcap", &mut vec![]);
    assert_eq!(
        t.connections, 2,
        "perftest -R: a control and a data connection"
    );
    assert!(t.by_opcode["send"] >= 2000, "1000 iterations of ping-pong");
}

#[test]
fn kernel_perftest_write_bw_first_frames() {
    let t = parse_capture("write_bw_siw_first400.pcap", &mut vec![]);
    assert!(t.by_opcode.get("write").copied().unwrap_or(0) > 100);
}

/// Every FPDU of every capture, for the fuzz test.
fn corpus() -> &'static Vec<Vec<u8>> {
    static C: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    C.get_or_init(|| {
        let mut c = Vec::new();
        for name in [
            "rping_siw.pcap",
            "rping_siw_crc.pcap",
            "rdma_server_siw.pcap",
            "send_lat_siw.pcap",
            "write_bw_siw_first400.pcap",
        ] {
            parse_capture(name, &mut c);
        }
        c
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5000, ..ProptestConfig::default() })]

    /// Captured FPDUs with random bytes changed, or cut, never make the parsers panic, and a
    /// changed byte under CRC is always caught.
    #[test]
    fn mutated_captured_fpdus_are_rejected_or_parsed(
        pick in any::<prop::sample::Index>(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let c = corpus();
        let mut f = c[pick.index(c.len())].clone();
        let orig = f.clone();
        for (i, v) in &edits {
            let i = i.index(f.len());
            f[i] = *v;
        }
        if do_cut {
            f.truncate(cut.index(f.len() + 1));
        }
        for crc in [false, true] {
            if let Ok(u) = wire::check_fpdu(&f, crc) {
                if let Ok((h, p)) = Header::parse_bytes(u) {
                    if h.opcode == Opcode::ReadRequest {
                        let _ = ReadRequest::parse_bytes(p);
                    }
                }
            }
        }
        let _ = MpaFrame::parse_bytes(&f);
        // Under CRC one changed byte is always detected (CRC32c catches every error burst
        // of up to 32 bits).
        if !do_cut
            && edits.len() == 1
            && f != orig
            && wire::check_fpdu(&orig, true).is_ok()
            && FpduPacket::new_checked(&f[..]).is_ok_and(|p| p.total_len() == orig.len())
        {
            prop_assert!(wire::check_fpdu(&f, true).is_err());
        }
    }
}

/// `scripts/fuzz.sh seed`: the captured FPDUs become the `siw_fpdu` fuzz corpus, and
/// each captured connection direction a `siw_qp` input (its first FPDUs, as the peer's
/// actions against the engine harness).
#[test]
fn write_fuzz_seeds() {
    let Some(dir) = std::env::var_os("KRDMA_FUZZ_SEEDS") else {
        return;
    };
    let fpdus = PathBuf::from(&dir).join("siw_fpdu");
    std::fs::create_dir_all(&fpdus).unwrap();
    for (i, f) in corpus().iter().enumerate() {
        std::fs::write(fpdus.join(format!("capture-{i:04}")), f).unwrap();
    }
    let sessions = PathBuf::from(&dir).join("siw_qp");
    std::fs::create_dir_all(&sessions).unwrap();
    for name in [
        "rping_siw.pcap",
        "rping_siw_crc.pcap",
        "rdma_server_siw.pcap",
        "send_lat_siw.pcap",
    ] {
        for (i, (crc, ulpdus)) in directions(name).into_iter().enumerate() {
            let actions = siw::harness::Action::from_capture(&ulpdus[..ulpdus.len().min(20)]);
            let mut input = vec![crc as u8];
            input.extend(siw::harness::Action::encode(&actions));
            let stem = name.trim_end_matches(".pcap");
            std::fs::write(sessions.join(format!("{stem}-{i}")), input).unwrap();
        }
    }
}

/// Every direction of every MPA connection of a capture: its CRC setting and ULPDUs.
fn directions(name: &str) -> Vec<(bool, Vec<Vec<u8>>)> {
    let streams = tcp_streams(name);
    let mut out = Vec::new();
    for (flow, s) in &streams {
        let Ok(req) = MpaFrame::parse_bytes(&s.data) else {
            continue;
        };
        let used = req.buffer_len();
        if req.reply {
            continue;
        }
        let Some((_, back)) = streams.iter().find(|(f, _)| f.0 == flow.1 && f.1 == flow.0) else {
            continue;
        };
        let Ok(rep) = MpaFrame::parse_bytes(&back.data) else {
            continue;
        };
        let rep_used = rep.buffer_len();
        for data in [&s.data[used..], &back.data[rep_used..]] {
            let mut ulpdus = Vec::new();
            let mut off = 0;
            while let Ok(f) = FpduPacket::new_checked(&data[off..]) {
                if rep.crc && f.check_crc().is_err() {
                    break;
                }
                ulpdus.push(f.ulpdu().to_vec());
                off += f.total_len();
            }
            if !ulpdus.is_empty() {
                out.push((rep.crc, ulpdus));
            }
        }
    }
    out
}
