//! Exercise a real verbs device through the mlx provider's user half.
//!
//! ```text
//! loopback [--device NAME] [--addr IP] [--port N] [--cm-only] [--no-cm]
//! ```
//!
//! * Modify-QP part (IB/RoCE devices, e.g. kernel rxe0): two RC QPs on the device connected
//!   to each other by Modify QP (INIT/RTR/RTS with the device's own RoCEv2 GID), then Send,
//!   Send with immediate, inline Send, RDMA Write (with immediate), RDMA Read, and the two
//!   atomics when the device has them — every byte checked, every completion checked, and
//!   one completion notification through an armed CQ.
//! * rdma_cm part (any device, iWARP included): listen on `--addr` (default: the address
//!   of the device's IPv4 GID), connect a second QP to it from the same process, accept
//!   with private data both ways, Send + RDMA Write + RDMA Read over the connection, an
//!   orderly disconnect seen on both sides.
//!
//! Prints `PASS ...` per step and `ALL PASS` at the end; exits non-zero on the first failure.

mod common;

use common::{fail, pattern, sink, Buf, Res};
use mlx::{kernel_devices, user_provider, IbvDevice};
use rnicpi::user::{UserCq, UserDevice, UserPd, UserQp, UserQpInit};
use rnicpi::{
    send_flags, Access, ConnParam, Cqe, Event, EventKind, QpAttr, QpAttrMask, QpCaps, QpState,
    QpType, WcOpcode, WcStatus, Wqe, WrOpcode,
};
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn wait_event(rx: &Receiver<Event>, kind: EventKind, what: &str) -> Res<Event> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(ev) if ev.kind == kind => return Ok(ev),
            Ok(ev)
                if matches!(
                    ev.kind,
                    EventKind::Rejected
                        | EventKind::Unreachable
                        | EventKind::ConnectionBroken
                        | EventKind::QpFatal
                        | EventKind::QpAccessError
                        | EventKind::QpRequestError
                ) =>
            {
                return fail(format!(
                    "{what}: got {:?} (status {}) instead of {kind:?}",
                    ev.kind, ev.status
                ))
            }
            Ok(ev) => println!("  (event {:?} status {})", ev.kind, ev.status),
            Err(_) => return fail(format!("{what}: no {kind:?} within 30 s")),
        }
    }
}

fn poll_one(cq: &Arc<dyn UserCq>, what: &str) -> Res<Cqe> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = [Cqe::default(); 1];
    loop {
        if cq.poll(&mut c) == 1 {
            if !c[0].is_ok() {
                return fail(format!(
                    "{what}: completion status {:?} vendor_err {:#x}",
                    c[0].status(),
                    c[0].vendor_err
                ));
            }
            return Ok(c[0]);
        }
        if Instant::now() > deadline {
            return fail(format!("{what}: no completion within 10 s"));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn expect_cqe(c: &Cqe, wr_id: u64, op: WcOpcode, what: &str) -> Res<()> {
    if c.wr_id != wr_id || c.opcode() != Some(op) || c.status() != WcStatus::Success {
        return fail(format!(
            "{what}: unexpected completion {c:?} (want wr_id {wr_id} {op:?})"
        ));
    }
    Ok(())
}

struct Side {
    qp: Arc<dyn UserQp>,
    cq: Arc<dyn UserCq>,
    events: Receiver<Event>,
    cq_events: Receiver<Event>,
    buf: Buf,
}

fn make_side(dev: &Arc<dyn UserDevice>, pd: &Arc<dyn UserPd>) -> Res<Side> {
    let (cq_sink, cq_events) = sink();
    let cq = dev
        .create_cq(64, cq_sink)
        .map_err(|e| format!("create_cq: {e}"))?;
    let (qp_sink, events) = sink();
    let qp = pd
        .create_qp(UserQpInit {
            qp_type: QpType::Rc,
            caps: QpCaps {
                max_send_wr: 32,
                max_recv_wr: 32,
                max_send_sge: 2,
                max_recv_sge: 2,
                max_inline: 0,
            },
            send_cq: cq.clone(),
            recv_cq: cq.clone(),
            srq: None,
            sink: qp_sink,
        })
        .map_err(|e| format!("create_qp: {e}"))?;
    let access =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let buf = Buf::new(pd, 1 << 16, access)?;
    Ok(Side {
        qp,
        cq,
        events,
        cq_events,
        buf,
    })
}

/// The GID index of the device's IPv4 (RoCEv2) GID, and that address.
fn ipv4_gid(dev: &IbvDevice) -> Option<(u8, [u8; 16], IpAddr)> {
    (0..16).find_map(|i| {
        let g = dev.gid(i).ok()?;
        match rnicpi::gid_to_ip(g) {
            ip @ IpAddr::V4(_) if g != [0; 16] => Some((i as u8, g, ip)),
            _ => None,
        }
    })
}

fn modify_connect(a: &Side, b: &Side, gidx: u8, gid: [u8; 16], mtu: u32) -> Res<()> {
    let access =
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    for (me, peer, psn) in [(a, b, 0x100u32), (b, a, 0x200u32)] {
        me.qp
            .modify(
                &QpAttr {
                    state: QpState::Init,
                    access,
                    ..QpAttr::default()
                },
                QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::ACCESS,
            )
            .map_err(|e| format!("INIT: {e}"))?;
        let peer_psn = if psn == 0x100 { 0x200 } else { 0x100 };
        me.qp
            .modify(
                &QpAttr {
                    state: QpState::Rtr,
                    path_mtu: mtu,
                    dest_qpn: peer.qp.qp_num(),
                    rq_psn: peer_psn,
                    max_dest_rd_atomic: 4,
                    min_rnr_timer: 12,
                    dgid: gid,
                    sgid_index: gidx,
                    hop_limit: 64,
                    ..QpAttr::default()
                },
                QpAttrMask::RC_RTR,
            )
            .map_err(|e| format!("RTR: {e}"))?;
        me.qp
            .modify(
                &QpAttr {
                    state: QpState::Rts,
                    sq_psn: psn,
                    timeout: 14,
                    retry_cnt: 7,
                    rnr_retry: 7,
                    max_rd_atomic: 4,
                    ..QpAttr::default()
                },
                QpAttrMask::RC_RTS,
            )
            .map_err(|e| format!("RTS: {e}"))?;
        if me.qp.state().map_err(|e| e.to_string())? != QpState::Rts {
            return fail("QP is not in RTS after Modify QP");
        }
    }
    Ok(())
}

/// Send, RDMA Write, RDMA Read between `a` and `b` (connected), byte-exact.
fn traffic(a: &mut Side, b: &mut Side, tag: &str) -> Res<()> {
    let len = 3000; // more than one MTU
                    // Send.
    let data = pattern(1, len);
    a.buf.write(0, &data);
    b.qp.post_recv(&[Wqe::recv(10, &[b.buf.sge(0, len)])])
        .map_err(|e| format!("post_recv: {e}"))?;
    a.qp.post_send(&[Wqe::new(11, WrOpcode::Send, &[a.buf.sge(0, len)])])
        .map_err(|e| format!("post_send: {e}"))?;
    expect_cqe(&poll_one(&a.cq, "send")?, 11, WcOpcode::Send, "send")?;
    let r = poll_one(&b.cq, "recv")?;
    expect_cqe(&r, 10, WcOpcode::Recv, "recv")?;
    if r.byte_len != len as u32 || b.buf.read(0, len) != data {
        return fail("send: received bytes differ");
    }
    println!("PASS {tag} send {len} bytes");

    // RDMA Write.
    let data = pattern(2, len);
    a.buf.write(4096, &data);
    a.qp.post_send(&[Wqe::new(12, WrOpcode::RdmaWrite, &[a.buf.sge(4096, len)])
        .with_remote(b.buf.addr(8192), b.buf.mr.rkey())])
        .map_err(|e| format!("write: {e}"))?;
    expect_cqe(&poll_one(&a.cq, "write")?, 12, WcOpcode::RdmaWrite, "write")?;
    if b.buf.read(8192, len) != data {
        return fail("rdma write: target bytes differ");
    }
    println!("PASS {tag} rdma write {len} bytes");

    // RDMA Read.
    let data = pattern(3, len);
    b.buf.write(16384, &data);
    a.qp.post_send(&[Wqe::new(13, WrOpcode::RdmaRead, &[a.buf.sge(20480, len)])
        .with_remote(b.buf.addr(16384), b.buf.mr.rkey())])
        .map_err(|e| format!("read: {e}"))?;
    let c = poll_one(&a.cq, "read")?;
    expect_cqe(&c, 13, WcOpcode::RdmaRead, "read")?;
    if a.buf.read(20480, len) != data {
        return fail("rdma read: fetched bytes differ");
    }
    println!("PASS {tag} rdma read {len} bytes");
    Ok(())
}

fn extended(a: &mut Side, b: &mut Side, atomics: bool) -> Res<()> {
    // Send with immediate.
    b.qp.post_recv(&[Wqe::recv(20, &[b.buf.sge(0, 64)])])
        .map_err(|e| e.to_string())?;
    a.qp.post_send(&[
        Wqe::new(21, WrOpcode::SendWithImm, &[a.buf.sge(0, 64)]).with_imm(0x1234_5678u32.to_be())
    ])
    .map_err(|e| e.to_string())?;
    expect_cqe(
        &poll_one(&a.cq, "send imm")?,
        21,
        WcOpcode::Send,
        "send imm",
    )?;
    let r = poll_one(&b.cq, "recv imm")?;
    if r.flags & rnicpi::wc_flags::WITH_IMM == 0 || u32::from_be(r.imm_or_inv) != 0x1234_5678 {
        return fail(format!("send with imm: {r:?}"));
    }
    println!("PASS send with immediate");

    // RDMA Write with immediate (consumes a receive).
    let data = pattern(4, 512);
    a.buf.write(0, &data);
    b.qp.post_recv(&[Wqe::recv(22, &[])])
        .map_err(|e| e.to_string())?;
    a.qp.post_send(&[
        Wqe::new(23, WrOpcode::RdmaWriteWithImm, &[a.buf.sge(0, 512)])
            .with_remote(b.buf.addr(32768), b.buf.mr.rkey())
            .with_imm(0xcafe_f00du32.to_be()),
    ])
    .map_err(|e| e.to_string())?;
    expect_cqe(
        &poll_one(&a.cq, "write imm")?,
        23,
        WcOpcode::RdmaWrite,
        "write imm",
    )?;
    let r = poll_one(&b.cq, "write imm recv")?;
    expect_cqe(&r, 22, WcOpcode::RecvRdmaWithImm, "write imm recv")?;
    if u32::from_be(r.imm_or_inv) != 0xcafe_f00d || b.buf.read(32768, 512) != data {
        return fail(format!("write with imm: {r:?}"));
    }
    println!("PASS rdma write with immediate");

    // Inline send, where the QP grants inline room.
    let inl = a.qp.caps().max_inline.min(rnicpi::MAX_INLINE as u32) as usize;
    if inl > 0 {
        let data = pattern(5, inl);
        b.qp.post_recv(&[Wqe::recv(24, &[b.buf.sge(40960, inl)])])
            .map_err(|e| e.to_string())?;
        let w = Wqe::new(25, WrOpcode::Send, &[])
            .with_inline(&data)
            .unwrap();
        a.qp.post_send(&[w]).map_err(|e| format!("inline: {e}"))?;
        expect_cqe(&poll_one(&a.cq, "inline")?, 25, WcOpcode::Send, "inline")?;
        poll_one(&b.cq, "inline recv")?;
        if b.buf.read(40960, inl) != data {
            return fail("inline send: bytes differ");
        }
        println!("PASS inline send {inl} bytes");
    } else {
        println!("SKIP inline send (QP granted no inline room)");
    }

    if atomics {
        b.buf.write(49152, &100u64.to_ne_bytes());
        let faa = Wqe {
            compare_add: 5,
            ..Wqe::new(26, WrOpcode::AtomicFetchAdd, &[a.buf.sge(0, 8)])
        }
        .with_remote(b.buf.addr(49152), b.buf.mr.rkey());
        a.qp.post_send(&[faa]).map_err(|e| e.to_string())?;
        expect_cqe(
            &poll_one(&a.cq, "fetch-add")?,
            26,
            WcOpcode::FetchAdd,
            "fetch-add",
        )?;
        let old = u64::from_ne_bytes(a.buf.read(0, 8).try_into().unwrap());
        let new = u64::from_ne_bytes(b.buf.read(49152, 8).try_into().unwrap());
        if (old, new) != (100, 105) {
            return fail(format!("fetch-add: old {old} new {new}"));
        }
        let cas = Wqe {
            compare_add: 105,
            swap: 7,
            ..Wqe::new(27, WrOpcode::AtomicCmpSwp, &[a.buf.sge(8, 8)])
        }
        .with_remote(b.buf.addr(49152), b.buf.mr.rkey());
        a.qp.post_send(&[cas]).map_err(|e| e.to_string())?;
        expect_cqe(
            &poll_one(&a.cq, "cmp-swap")?,
            27,
            WcOpcode::CompSwap,
            "cmp-swap",
        )?;
        let old = u64::from_ne_bytes(a.buf.read(8, 8).try_into().unwrap());
        let new = u64::from_ne_bytes(b.buf.read(49152, 8).try_into().unwrap());
        if (old, new) != (105, 7) {
            return fail(format!("cmp-swap: old {old} new {new}"));
        }
        println!("PASS atomics fetch-add and compare-swap");
    } else {
        println!("SKIP atomics (device reports none)");
    }

    // A completion notification through an armed CQ.
    b.cq.arm(false).map_err(|e| e.to_string())?;
    b.qp.post_recv(&[Wqe::recv(28, &[b.buf.sge(0, 64)])])
        .map_err(|e| e.to_string())?;
    a.qp.post_send(&[Wqe::new(29, WrOpcode::Send, &[a.buf.sge(0, 64)])
        .with_flags(send_flags::SIGNALED | send_flags::SOLICITED)])
        .map_err(|e| e.to_string())?;
    wait_event(&b.cq_events, EventKind::CqNotify, "cq notify")?;
    poll_one(&a.cq, "notify send")?;
    expect_cqe(
        &poll_one(&b.cq, "notify recv")?,
        28,
        WcOpcode::Recv,
        "notify recv",
    )?;
    println!("PASS completion notification (CqNotify)");
    Ok(())
}

fn cm_part(dev: &Arc<dyn UserDevice>, pd: &Arc<dyn UserPd>, addr: SocketAddr) -> Res<()> {
    let mut server = make_side(dev, pd)?;
    let mut client = make_side(dev, pd)?;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    // The consumer's access rights: INIT before connecting (rdma_cm keeps them).
    for s in [&server, &client] {
        s.qp.modify(
            &QpAttr {
                state: QpState::Init,
                access,
                ..QpAttr::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::ACCESS,
        )
        .map_err(|e| format!("INIT: {e}"))?;
    }
    let (lsink, requests) = sink();
    let listener = dev
        .listen(addr, 8, lsink)
        .map_err(|e| format!("listen {addr}: {e}"))?;
    let target = listener.local_addr();
    println!("  listening on {target}");
    // The server's receive for the client's first send.
    server
        .qp
        .post_recv(&[Wqe::recv(30, &[server.buf.sge(0, 4096)])])
        .map_err(|e| e.to_string())?;
    dev.connect(
        &client.qp,
        target,
        ConnParam {
            private_data: b"hello from client".to_vec(),
            ird: 4,
            ord: 4,
        },
    )
    .map_err(|e| format!("connect: {e}"))?;
    let req = wait_event(&requests, EventKind::ConnectRequest, "connect request")?;
    if !req.private_data.starts_with(b"hello from client") {
        return fail(format!("request private data: {:?}", req.private_data));
    }
    println!(
        "PASS cm connect request (conn_id {}, peer {:?}, {} bytes of private data)",
        req.conn_id,
        req.peer,
        req.private_data.len()
    );
    listener
        .accept(
            req.conn_id,
            &server.qp,
            ConnParam {
                private_data: b"welcome".to_vec(),
                ird: 4,
                ord: 4,
            },
        )
        .map_err(|e| format!("accept: {e}"))?;
    let est = wait_event(&client.events, EventKind::Established, "client established")?;
    if !est.private_data.starts_with(b"welcome") {
        return fail(format!("reply private data: {:?}", est.private_data));
    }
    wait_event(&server.events, EventKind::Established, "server established")?;
    for (n, s) in [("client", &client), ("server", &server)] {
        let st = s.qp.state().map_err(|e| e.to_string())?;
        if st != QpState::Rts {
            return fail(format!("{n} QP in {st:?} after Established"));
        }
    }
    println!(
        "PASS cm established both ways (client {:?} -> server {:?})",
        est.local, est.peer
    );
    // The receive was posted before the connection: take it in traffic()'s send.
    let len = 3000;
    let data = pattern(9, len);
    client.buf.write(0, &data);
    client
        .qp
        .post_send(&[Wqe::new(31, WrOpcode::Send, &[client.buf.sge(0, len)])])
        .map_err(|e| e.to_string())?;
    expect_cqe(
        &poll_one(&client.cq, "cm send")?,
        31,
        WcOpcode::Send,
        "cm send",
    )?;
    expect_cqe(
        &poll_one(&server.cq, "cm recv")?,
        30,
        WcOpcode::Recv,
        "cm recv",
    )?;
    if server.buf.read(0, len) != data {
        return fail("cm send: bytes differ");
    }
    println!("PASS cm send {len} bytes into a receive posted before connecting");
    traffic(&mut client, &mut server, "cm")?;
    client
        .qp
        .disconnect(false)
        .map_err(|e| format!("disconnect: {e}"))?;
    wait_event(
        &client.events,
        EventKind::Disconnected,
        "client disconnected",
    )?;
    wait_event(
        &server.events,
        EventKind::Disconnected,
        "server disconnected",
    )?;
    for (n, s) in [("client", &client), ("server", &server)] {
        let st = s.qp.state().map_err(|e| e.to_string())?;
        if st != QpState::Error {
            return fail(format!("{n} QP in {st:?} after Disconnected"));
        }
    }
    println!("PASS cm orderly disconnect seen on both sides");
    drop(listener);
    Ok(())
}

fn run() -> Res<()> {
    let mut device = None;
    let mut addr: Option<IpAddr> = None;
    let mut port = 7471u16;
    let (mut modify_part, mut cm) = (true, true);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => device = args.next(),
            "--addr" => {
                addr = Some(
                    args.next()
                        .ok_or("--addr IP")?
                        .parse()
                        .map_err(|e| format!("--addr: {e}"))?,
                )
            }
            "--port" => {
                port = args
                    .next()
                    .ok_or("--port N")?
                    .parse()
                    .map_err(|e| format!("--port: {e}"))?
            }
            "--cm-only" => modify_part = false,
            "--no-cm" => cm = false,
            other => return fail(format!("unknown argument {other}")),
        }
    }
    // The kernel half: what the kAL would register.
    let kdevs = kernel_devices();
    for d in &kdevs {
        let a = d.attr();
        let p = d.port(1).map_err(|e| format!("port: {e}"))?;
        println!(
            "device {} transport {} max_qp {} max_sge {} max_inline {} atomics {} ird/ord {}/{} private data {:?} fast path {:?}; port 1 {:?} mtu {} netdev {} gids {}; {} counters",
            a.name, a.transport.name(), a.max_qp, a.max_sge, a.max_inline, a.atomics, a.max_ird, a.max_ord,
            a.private_data, a.fast_path, p.state, p.active_mtu, p.netdev, p.gids.len(), d.counters().len()
        );
    }
    let name = match device {
        Some(d) => d,
        None => mlx::ibv_device_names()
            .into_iter()
            .next()
            .ok_or("no RDMA device")?,
    };
    let kattr = kdevs
        .iter()
        .map(|d| d.attr().clone())
        .find(|a| a.name == format!("ibv-{name}"))
        .ok_or("device not among kernel_devices()")?;

    let ibv = IbvDevice::open(&name).map_err(|e| format!("open {name}: {e}"))?;
    let g = ipv4_gid(&ibv);
    let mtu = ibv.active_mtu().map_err(|e| e.to_string())?;
    println!(
        "opened {name} (iwarp {}), IPv4 GID {:?}, active MTU {mtu}",
        ibv.is_iwarp(),
        g.map(|g| (g.0, g.2))
    );
    let iwarp = ibv.is_iwarp();
    drop(ibv);
    let dev: Arc<dyn UserDevice> = user_provider()
        .open(&name)
        .map_err(|e| format!("open {name}: {e}"))?;
    let pd = dev.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;

    if modify_part && !iwarp {
        let mut a = make_side(&dev, &pd)?;
        let mut b = make_side(&dev, &pd)?;
        let (gidx, gid, _) = g.ok_or("no IPv4 GID on port 1")?;
        modify_connect(&a, &b, gidx, gid, mtu)?;
        println!(
            "PASS modify qp loopback: QP {} <-> QP {} in RTS",
            a.qp.qp_num(),
            b.qp.qp_num()
        );
        traffic(&mut a, &mut b, "loopback")?;
        extended(&mut a, &mut b, kattr.atomics)?;
    } else if modify_part {
        println!("SKIP modify qp loopback (iWARP: a QP reaches RTS only through the CM)");
    }
    if cm {
        let ip = addr.or(g.map(|g| g.2)).ok_or("no IPv4 GID: give --addr")?;
        cm_part(&dev, &pd, SocketAddr::new(ip, port))?;
    }
    Ok(())
}

fn main() {
    match run() {
        Ok(()) => println!("ALL PASS"),
        Err(e) => {
            println!("FAIL {e}");
            std::process::exit(1);
        }
    }
}
