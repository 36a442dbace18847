//! Exercise on a real verbs device what `loopback` does not: memory windows, an SRQ shared
//! by two QPs, a rejected connection request and an abortive disconnect.
//!
//! ```text
//! features [--device NAME] [--addr IP] [--port N] [--no-mw]
//! ```
//!
//! Every part connects QPs of one process to each other through rdma_cm (so it runs on IB,
//! RoCE and iWARP devices alike), listening on `--addr` (default: the address of the
//! device's IPv4 GID):
//!
//! * **memory windows** (devices whose kernel half reports `memory_windows`, e.g. Linux
//!   rxe; skipped on siw): a type-2 window bound onto 4 KiB of a registration by a `BindMw`
//!   request; the peer's RDMA Write and Read through the window's key land in (come from)
//!   exactly that range; after a `LocalInv` of the key the peer's Write completes with a
//!   remote access error. Then on a second connection the window is bound again under a
//!   fresh key, used, invalidated by the peer's Send with Invalidate, and refused again.
//! * **SRQ**: two server QPs share one SRQ holding 6 receives with the limit armed at 4;
//!   two clients send 1 and 2 messages; each completion names the QP it arrived on, and
//!   `SrqLimitReached` comes once 3 receives are left.
//! * **reject**: the listener rejects a request with private data; the active side sees
//!   `Rejected` carrying it.
//! * **abortive disconnect**: with receives pending on both sides, the client disconnects
//!   abortively; the server sees `ConnectionBroken` or `Disconnected`, and every pending
//!   receive of both sides completes flushed.
//!
//! Prints `PASS ...` per step and `ALL PASS` at the end; exits non-zero on the first failure.

mod common;

use common::{fail, pattern, sink, Buf, Res};
use mlx::{kernel_devices, user_provider, IbvDevice};
use rnicpi::user::{UserCq, UserDevice, UserListener, UserPd, UserQp, UserQpInit, UserSrq};
use rnicpi::{
    wc_flags, Access, ConnParam, Cqe, Event, EventKind, QpAttr, QpAttrMask, QpCaps, QpState,
    QpType, SrqAttr, WcOpcode, WcStatus, Wqe, WrOpcode,
};
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The first event of one of `kinds` (others are printed and skipped).
fn wait_any(rx: &Receiver<Event>, kinds: &[EventKind], what: &str) -> Res<Event> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(ev) if kinds.contains(&ev.kind) => return Ok(ev),
            Ok(ev) => println!("  ({what}: event {:?} status {})", ev.kind, ev.status),
            Err(_) => return fail(format!("{what}: none of {kinds:?} within 20 s")),
        }
    }
}

/// The next completion, whatever its status.
fn poll_any(cq: &Arc<dyn UserCq>, what: &str) -> Res<Cqe> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = [Cqe::default(); 1];
    loop {
        if cq.poll(&mut c) == 1 {
            return Ok(c[0]);
        }
        if Instant::now() > deadline {
            return fail(format!("{what}: no completion within 10 s"));
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn expect(cq: &Arc<dyn UserCq>, wr_id: u64, op: WcOpcode, what: &str) -> Res<Cqe> {
    let c = poll_any(cq, what)?;
    if c.wr_id != wr_id || c.opcode() != Some(op) || c.status() != WcStatus::Success {
        return fail(format!(
            "{what}: completion {:?} {:?} wr_id {} vendor_err {:#x} (want wr_id {wr_id} {op:?})",
            c.status(),
            c.opcode(),
            c.wr_id,
            c.vendor_err
        ));
    }
    Ok(c)
}

struct Side {
    qp: Arc<dyn UserQp>,
    cq: Arc<dyn UserCq>,
    events: Receiver<Event>,
    buf: Buf,
}

struct Env {
    dev: Arc<dyn UserDevice>,
    pd: Arc<dyn UserPd>,
    listener: Arc<dyn UserListener>,
    requests: Receiver<Event>,
    target: SocketAddr,
    bind: bool,
}

impl Env {
    fn side(&self, srq: Option<&Arc<dyn UserSrq>>) -> Res<Side> {
        let (cq_sink, _cq_events) = sink();
        let cq = self
            .dev
            .create_cq(64, cq_sink)
            .map_err(|e| format!("create_cq: {e}"))?;
        let (qp_sink, events) = sink();
        let qp = self
            .pd
            .create_qp(UserQpInit {
                qp_type: QpType::Rc,
                caps: QpCaps {
                    max_send_wr: 16,
                    max_recv_wr: if srq.is_some() { 0 } else { 16 },
                    max_send_sge: 1,
                    max_recv_sge: if srq.is_some() { 0 } else { 1 },
                    max_inline: 0,
                },
                send_cq: cq.clone(),
                recv_cq: cq.clone(),
                srq: srq.cloned(),
                sink: qp_sink,
            })
            .map_err(|e| format!("create_qp: {e}"))?;
        qp.modify(
            &QpAttr {
                state: QpState::Init,
                access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                ..QpAttr::default()
            },
            QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::ACCESS,
        )
        .map_err(|e| format!("INIT: {e}"))?;
        let mut access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        if self.bind {
            access |= Access::MW_BIND;
        }
        let buf = Buf::new(&self.pd, 1 << 15, access)?;
        Ok(Side {
            qp,
            cq,
            events,
            buf,
        })
    }

    /// Connect `client` to the listener and accept onto `server`.
    fn connect(&self, client: &Side, server: &Side) -> Res<()> {
        let p = ConnParam {
            private_data: b"features".to_vec(),
            ird: 4,
            ord: 4,
        };
        self.dev
            .connect(&client.qp, self.target, p.clone())
            .map_err(|e| format!("connect: {e}"))?;
        let req = wait_any(&self.requests, &[EventKind::ConnectRequest], "request")?;
        self.listener
            .accept(req.conn_id, &server.qp, p)
            .map_err(|e| format!("accept: {e}"))?;
        wait_any(
            &client.events,
            &[EventKind::Established],
            "client established",
        )?;
        wait_any(
            &server.events,
            &[EventKind::Established],
            "server established",
        )?;
        Ok(())
    }
}

/// The next key of a window: its index, the key byte bumped (as `ual::Mw::bind_wqe` does).
fn next_key(k: u32) -> u32 {
    (k & !0xff) | (k.wrapping_add(1) & 0xff)
}

const WIN: usize = 8192; // offset of the window in the owner's buffer
const WIN_LEN: u64 = 4096;

/// The peer's RDMA Write and Read through window key `key`, byte-exact.
fn through_window(owner: &Side, peer: &mut Side, key: u32, seed: u8) -> Res<()> {
    let data = pattern(seed, 1000);
    peer.buf.write(0, &data);
    peer.qp
        .post_send(
            &[Wqe::new(110, WrOpcode::RdmaWrite, &[peer.buf.sge(0, 1000)])
                .with_remote(owner.buf.addr(WIN + 100), key)],
        )
        .map_err(|e| format!("write: {e}"))?;
    expect(&peer.cq, 110, WcOpcode::RdmaWrite, "write through window")?;
    if owner.buf.read(WIN + 100, 1000) != data {
        return fail("write through window: bytes differ");
    }
    peer.qp
        .post_send(&[
            Wqe::new(111, WrOpcode::RdmaRead, &[peer.buf.sge(4096, 1000)])
                .with_remote(owner.buf.addr(WIN + 100), key),
        ])
        .map_err(|e| format!("read: {e}"))?;
    expect(&peer.cq, 111, WcOpcode::RdmaRead, "read through window")?;
    if peer.buf.read(4096, 1000) != data {
        return fail("read through window: bytes differ");
    }
    Ok(())
}

/// The peer's RDMA Write through `key` must complete with a remote access error.
fn refused(peer: &Side, owner: &Side, key: u32, what: &str) -> Res<()> {
    peer.qp
        .post_send(&[Wqe::new(120, WrOpcode::RdmaWrite, &[peer.buf.sge(0, 64)])
            .with_remote(owner.buf.addr(WIN), key)])
        .map_err(|e| format!("write: {e}"))?;
    let c = poll_any(&peer.cq, what)?;
    if c.wr_id != 120 || c.status() != WcStatus::RemAccessErr {
        return fail(format!(
            "{what}: completion {:?} wr_id {} (want RemAccessErr)",
            c.status(),
            c.wr_id
        ));
    }
    Ok(())
}

fn bind(owner: &Side, mw_key: u32, wr_id: u64) -> Res<()> {
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let w = Wqe::bind_mw(
        wr_id,
        mw_key,
        owner.buf.mr.lkey(),
        owner.buf.addr(WIN),
        WIN_LEN,
        rw,
    );
    owner.qp.post_send(&[w]).map_err(|e| format!("bind: {e}"))?;
    expect(&owner.cq, wr_id, WcOpcode::BindMw, "bind")?;
    Ok(())
}

/// Tear down a connection whose QPs may already be in error (events not checked).
fn close(client: Side, server: Side) {
    let _ = client.qp.disconnect(true);
    std::thread::sleep(Duration::from_millis(200));
    drop((client, server));
}

fn mw_part(env: &Env) -> Res<()> {
    let mw = env.pd.alloc_mw().map_err(|e| format!("alloc_mw: {e}"))?;
    let k0 = mw.rkey();
    // Connection 1: bind, use, invalidate locally, refused.
    let owner = env.side(None)?;
    let mut peer = env.side(None)?;
    env.connect(&peer, &owner)?;
    let k1 = next_key(k0);
    bind(&owner, k1, 100)?;
    if mw.rkey() != k1 {
        return fail(format!(
            "window key {:#x} after bind, want {k1:#x}",
            mw.rkey()
        ));
    }
    println!("PASS mw bound: key {k0:#x} -> {k1:#x}, 4096 bytes of the registration");
    through_window(&owner, &mut peer, k1, 1)?;
    println!("PASS mw peer's rdma write + read through the window key, byte-exact");
    owner
        .qp
        .post_send(&[Wqe::new(101, WrOpcode::LocalInv, &[]).with_imm(k1)])
        .map_err(|e| format!("local inv: {e}"))?;
    expect(&owner.cq, 101, WcOpcode::LocalInv, "local invalidate")?;
    refused(&peer, &owner, k1, "write after local invalidate")?;
    println!("PASS mw local invalidate, then the peer's write is refused (RemAccessErr)");
    close(peer, owner);

    // Connection 2: bound again under a fresh key, invalidated by the peer.
    let owner = env.side(None)?;
    let mut peer = env.side(None)?;
    owner
        .qp
        .post_recv(&[Wqe::recv(102, &[owner.buf.sge(0, 256)])])
        .map_err(|e| format!("post_recv: {e}"))?;
    env.connect(&peer, &owner)?;
    let k2 = next_key(k1);
    bind(&owner, k2, 103)?;
    through_window(&owner, &mut peer, k2, 2)?;
    println!("PASS mw bound again on a second connection under key {k2:#x}, used by the peer");
    peer.qp
        .post_send(&[Wqe::new(104, WrOpcode::SendWithInv, &[peer.buf.sge(0, 16)]).with_imm(k2)])
        .map_err(|e| format!("send with inv: {e}"))?;
    expect(&peer.cq, 104, WcOpcode::Send, "send with invalidate")?;
    let r = expect(
        &owner.cq,
        102,
        WcOpcode::Recv,
        "receive of send with invalidate",
    )?;
    let inv = if r.flags & wc_flags::WITH_INV != 0 {
        format!("WITH_INV {:#x}", r.imm_or_inv)
    } else {
        format!("flags {:#x}", r.flags)
    };
    refused(&peer, &owner, k2, "write after remote invalidate")?;
    println!("PASS mw invalidated by the peer's send with invalidate ({inv}), then refused");
    close(peer, owner);
    drop(mw);
    Ok(())
}

fn srq_part(env: &Env) -> Res<()> {
    let (ssink, srq_events) = sink();
    let srq = env
        .pd
        .create_srq(
            SrqAttr {
                max_wr: 16,
                max_sge: 1,
                limit: 0,
            },
            ssink,
        )
        .map_err(|e| format!("create_srq: {e}"))?;
    let (s1, s2) = (env.side(Some(&srq))?, env.side(Some(&srq))?);
    let (mut c1, mut c2) = (env.side(None)?, env.side(None)?);
    let recvs: Vec<Wqe> = (0..6)
        .map(|i| Wqe::recv(200 + i, &[s1.buf.sge(i as usize * 256, 256)]))
        .collect();
    srq.post_recv(&recvs)
        .map_err(|e| format!("srq post: {e}"))?;
    srq.arm(4).map_err(|e| format!("srq arm: {e}"))?;
    env.connect(&c1, &s1)?;
    env.connect(&c2, &s2)?;
    println!(
        "PASS srq shared by QPs {} and {}, 6 receives, limit 4",
        s1.qp.qp_num(),
        s2.qp.qp_num()
    );
    let mut sent = Vec::new();
    for (c, n, seed) in [(&mut c1, 1u64, 10u8), (&mut c2, 2, 20)] {
        for k in 0..n {
            let data = pattern(seed + k as u8, 200);
            c.buf.write(0, &data);
            c.qp.post_send(&[Wqe::new(210 + k, WrOpcode::Send, &[c.buf.sge(0, 200)])])
                .map_err(|e| format!("send: {e}"))?;
            expect(&c.cq, 210 + k, WcOpcode::Send, "send to srq")?;
            sent.push(data);
        }
    }
    let mut got = Vec::new();
    for (s, n) in [(&s1, 1), (&s2, 2)] {
        for _ in 0..n {
            let r = poll_any(&s.cq, "srq receive")?;
            if !r.is_ok() || r.opcode() != Some(WcOpcode::Recv) || r.qp_num != s.qp.qp_num() {
                return fail(format!(
                    "srq receive: {r:?} (want a receive on QP {})",
                    s.qp.qp_num()
                ));
            }
            got.push(s1.buf.read((r.wr_id - 200) as usize * 256, 200));
        }
    }
    if got != sent {
        return fail("srq receives: bytes differ");
    }
    println!("PASS srq 3 messages from 2 clients, each completion on its own QP, byte-exact");
    wait_any(&srq_events, &[EventKind::SrqLimitReached], "srq limit")?;
    println!("PASS srq limit event (SrqLimitReached) with 3 receives left");
    close(c1, s1);
    close(c2, s2);
    Ok(())
}

fn reject_part(env: &Env) -> Res<()> {
    let client = env.side(None)?;
    let p = ConnParam {
        private_data: b"may I".to_vec(),
        ird: 4,
        ord: 4,
    };
    env.dev
        .connect(&client.qp, env.target, p)
        .map_err(|e| format!("connect: {e}"))?;
    let req = wait_any(&env.requests, &[EventKind::ConnectRequest], "request")?;
    env.listener
        .reject(req.conn_id, b"not today")
        .map_err(|e| format!("reject: {e}"))?;
    let ev = wait_any(
        &client.events,
        &[EventKind::Rejected, EventKind::Unreachable],
        "rejected",
    )?;
    if ev.kind != EventKind::Rejected || !ev.private_data.starts_with(b"not today") {
        return fail(format!(
            "active side saw {:?} status {} private data {:?}",
            ev.kind,
            ev.status,
            String::from_utf8_lossy(&ev.private_data)
        ));
    }
    println!(
        "PASS reject: the active side sees Rejected with the private data {:?}",
        String::from_utf8_lossy(&ev.private_data[..9])
    );
    Ok(())
}

fn abort_part(env: &Env) -> Res<()> {
    let (client, server) = (env.side(None)?, env.side(None)?);
    env.connect(&client, &server)?;
    let post = |s: &Side, base: u64, n: u64| {
        let w: Vec<Wqe> = (0..n)
            .map(|i| Wqe::recv(base + i, &[s.buf.sge(0, 64)]))
            .collect();
        s.qp.post_recv(&w).map_err(|e| format!("post_recv: {e}"))
    };
    post(&server, 300, 3)?;
    post(&client, 310, 2)?;
    client
        .qp
        .disconnect(true)
        .map_err(|e| format!("abortive disconnect: {e}"))?;
    let ev = wait_any(
        &server.events,
        &[EventKind::ConnectionBroken, EventKind::Disconnected],
        "peer of the abort",
    )?;
    println!(
        "PASS abortive disconnect: the peer sees {:?} (status {})",
        ev.kind, ev.status
    );
    for (name, s, base, n) in [("server", &server, 300, 3), ("client", &client, 310, 2)] {
        for i in 0..n {
            let c = poll_any(&s.cq, "flushed receive")?;
            if c.status() != WcStatus::WrFlushErr || c.wr_id != base + i {
                return fail(format!(
                    "{name}: {:?} wr_id {} (want flushed {})",
                    c.status(),
                    c.wr_id,
                    base + i
                ));
            }
        }
    }
    println!("PASS abortive disconnect: 3 + 2 pending receives flushed (WrFlushErr) on both sides");
    Ok(())
}

fn run() -> Res<()> {
    let (mut device, mut addr, mut port, mut mw) = (None, None::<IpAddr>, 7472u16, true);
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
            "--no-mw" => mw = false,
            other => return fail(format!("unknown argument {other}")),
        }
    }
    let name = match device {
        Some(d) => d,
        None => mlx::ibv_device_names()
            .into_iter()
            .next()
            .ok_or("no RDMA device")?,
    };
    let kattr = kernel_devices()
        .iter()
        .map(|d| d.attr().clone())
        .find(|a| a.name == format!("ibv-{name}"))
        .ok_or("device not among kernel_devices()")?;
    let ip = match addr {
        Some(ip) => ip,
        None => {
            let ibv = IbvDevice::open(&name).map_err(|e| format!("open {name}: {e}"))?;
            (0..16)
                .filter_map(|i| ibv.gid(i).ok())
                .filter(|g| *g != [0; 16])
                .map(rnicpi::gid_to_ip)
                .find(IpAddr::is_ipv4)
                .ok_or("no IPv4 GID: give --addr")?
        }
    };
    println!(
        "device {name}: transport {} memory_windows {}",
        kattr.transport.name(),
        kattr.memory_windows
    );
    let dev = user_provider()
        .open(&name)
        .map_err(|e| format!("open {name}: {e}"))?;
    let pd = dev.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
    let (lsink, requests) = sink();
    let listener = dev
        .listen(SocketAddr::new(ip, port), 8, lsink)
        .map_err(|e| format!("listen: {e}"))?;
    let env = Env {
        target: listener.local_addr(),
        dev: dev.clone(),
        pd: pd.clone(),
        listener,
        requests,
        bind: kattr.memory_windows,
    };
    if mw && kattr.memory_windows {
        mw_part(&env)?;
    } else {
        match pd.alloc_mw() {
            Err(e) if !kattr.memory_windows => {
                println!("PASS mw: device reports no memory windows; alloc_mw answers {e}")
            }
            _ if !mw => println!("SKIP mw (--no-mw)"),
            Ok(_) => return fail("alloc_mw succeeded on a device without memory windows"),
            Err(e) => return fail(format!("alloc_mw: {e}")),
        }
    }
    srq_part(&env)?;
    reject_part(&env)?;
    abort_part(&env)?;
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
