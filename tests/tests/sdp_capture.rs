//! SDP over rxe0 captured on the wire and decoded by tshark's InfiniBand SDP dissector:
//! every Send that starts a message decodes as an SDP message with a known MID, the
//! messages the exchange must have produced are there (Data, SrcAvail and RdmaRdCompl of
//! a read-based zero-copy write, SinkAvail and RdmaWrCompl of a write-based one, DisConn
//! both ways), and no frame is malformed.
//!
//! Capturing needs root (`CI=true` fails without it; elsewhere the test is skipped).
//! Wireshark finds SDP by the Annex A4 service ID of the connection, which the IT-API's
//! RDMA CM port space does not use (docs/sdp.md), so the capture is decoded with
//! *Decode As* (the dissector's own recommendation): every InfiniBand payload as SDP,
//! with the heuristic dissectors after it.
//!
//! One kind of frame the dissector (Wireshark 4.0) calls malformed is allowed, and
//! counted: a Data message without data (16 bytes: a credit update or keep-alive, as OFED
//! SDP sends them). The dissector adds a data item "to the end" of the message, which for
//! an empty one lies past its last byte and raises the exception that marks the frame.
//! Any other malformed frame fails the test.
//!
//! rxe0 sends packet by packet here (`rxe_no_gso`): over loopback a GSO run would reach
//! the capture as one datagram, its packets after the first hidden in what the dissector
//! takes for the first one's payload.

use krdma_sdp::{Options, SdpListener, SdpStream};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::process::{Command, Stdio};
use std::time::Duration;

fn can_capture() -> bool {
    let ok = nix::unistd::geteuid().is_root()
        && Command::new("tshark").arg("--version").output().is_ok();
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must capture: root and tshark"
        );
        eprintln!("skipped: capturing needs root and tshark");
    }
    ok
}

#[test]
fn sdp_over_rxe_decodes_in_tshark() {
    if !can_capture() {
        return;
    }
    ual::configure_embedded(stack::StackOptions {
        rxe_addr: Some(krdma_tests::private_loopback(0)),
        rxe_no_gso: true,
        ..stack::StackOptions::from_env()
    });
    let addr = krdma_tests::private_loopback(0);
    let dir = std::env::temp_dir().join(format!("krdma-sdp-capture-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("wireshark")).unwrap();
    let pcap = dir.join("sdp.pcap");
    let mut tshark = Command::new("tshark")
        .args([
            "-i",
            "lo",
            // A large capture buffer: the zero-copy bursts must not overflow it on a
            // loaded machine.
            "-B",
            "64",
            "-f",
            &format!("udp port 4791 and host {addr}"),
            "-w",
        ])
        .arg(&pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = tshark.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if line.contains("Capturing on") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("tshark did not start capturing");
    std::thread::sleep(Duration::from_millis(300));

    // The exchange: small writes, an urgent byte, a zero-copy write pulled by the reader
    // (SrcAvail), one pushed into the blocked reader's landing buffer (SinkAvail),
    // orderly close.
    let o = Options {
        device: "rxe0".into(),
        target: Some(ual::Target::Embedded),
        ..Options::default()
    }
    .with_zcopy_threshold(128 * 1024);
    let l = SdpListener::bind_with(SocketAddr::from((addr, 0)), &o).unwrap();
    let at = l.local_addr().unwrap();
    let o2 = o.clone();
    let client = std::thread::spawn(move || {
        let mut c = SdpStream::connect_with(at, &o2).unwrap();
        for i in 0..5u8 {
            c.write_all(&[i; 100]).unwrap();
        }
        c.send_oob(b'!').unwrap();
        c.write_all(&vec![7u8; 512 * 1024]).unwrap();
        c.write_all(b"tail").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while c.stats().1.sink_adverts_rx == 0 {
            assert!(std::time::Instant::now() < deadline, "no SinkAvail came");
            std::thread::sleep(Duration::from_millis(1));
        }
        c.write_all(&vec![9u8; 512 * 1024]).unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        c.read_to_end(&mut rest).unwrap();
        rest
    });
    let (mut s, _) = l.accept().unwrap();
    let got = krdma_tests::read_in_chunks(&mut s, 1 << 20);
    assert_eq!(got.len(), 500 + 512 * 1024 + 4 + 512 * 1024);
    s.write_all(b"bye").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    assert_eq!(client.join().unwrap(), b"bye");
    // Time for the capture to take in the last frames before it stops.
    std::thread::sleep(Duration::from_millis(1500));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(tshark.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    tshark.wait().unwrap();

    std::fs::write(
        dir.join("wireshark/decode_as_entries"),
        "decode_as_entry: infiniband,0,(none),Infiniband SDP\n",
    )
    .unwrap();
    let out = Command::new("tshark")
        .env("XDG_CONFIG_HOME", &dir)
        .args(["-o", "infiniband.try_heuristic_first:FALSE", "-r"])
        .arg(&pcap)
        .args([
            "-T",
            "fields",
            "-e",
            "frame.number",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband_sdp.bsdh.mid",
            "-e",
            "_ws.malformed",
            "-e",
            "infiniband_sdp.bsdh.len",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut mids = std::collections::HashMap::new();
    let mut frames = 0;
    let mut empty_data = 0;
    for line in text.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        frames += 1;
        if f.get(3).is_some_and(|m| !m.is_empty()) {
            let empty = f.get(2) == Some(&"0xff") && f.get(4) == Some(&"16");
            assert!(empty, "malformed frame: {line}");
            empty_data += 1;
        }
        // Send First (0) and Send Only (4) begin an SDP message.
        if matches!(f.get(1).copied(), Some("0") | Some("4")) {
            let mid = f.get(2).copied().unwrap_or("");
            let known = [
                "0xff", "0xfe", "0xfd", "0x02", "0x03", "0x04", "0x05", "0x06", "0x08", "0x0a",
                "0x0b", "0x0c",
            ];
            assert!(
                known.contains(&mid),
                "frame {} is not a known SDP message: {line}",
                f[0]
            );
            *mids.entry(mid.to_string()).or_insert(0) += 1;
        }
    }
    eprintln!("{frames} frames; SDP messages by MID: {mids:?}; empty Data messages the dissector calls malformed: {empty_data}");
    for (mid, what) in [
        ("0xff", "Data"),
        ("0xfe", "SrcAvail"),
        ("0x06", "RdmaRdCompl"),
        ("0xfd", "SinkAvail"),
        ("0x05", "RdmaWrCompl"),
        ("0x02", "DisConn"),
    ] {
        assert!(mids.contains_key(mid), "no {what} in the capture: {mids:?}");
    }
    assert!(mids["0x02"] >= 2, "DisConn both ways");
    let _ = std::fs::remove_dir_all(&dir);
}
