//! Two real processes, of two users, probing each other: the prober learns every number
//! of the victim's context — its handles of every kind, its lkey and rkey and the
//! address behind them, its QP number, a connection request it has not answered — and
//! tries each through its own contexts: every command naming the victim's handles, work
//! requests with the victim's keys (local SGE, RDMA Write and Read, Send with Invalidate),
//! a QP of its own aimed at the victim's QP number (rxe), ACCEPT and REJECT of the
//! victim's connection id, and a look at the daemon's contexts. Nothing of the victim's
//! may change or answer: the victim then finds its memory, its receives and its pending
//! request untouched, and its connection working. Through both front doors, on siw0 and
//! rxe0.

use krdma_tests::probe::{every_command, Known, Own, Victim};
use krdma_tests::{
    as_user, child_test, daemon_possible, hear, say, Bystander, Daemon, FrontDoor, Role,
};
use std::net::SocketAddr;
use std::time::Duration;
use tools::perf::connect_pair;
use ual::oob::{to_init, to_rtr, to_rts, RcPath, RcPeer};
use ual::{send_flags, Access, Context, QpConfig, Target, VerbsError, WcStatus, Wqe, WrOpcode};

const VICTIM: u32 = 65534;
const PROBER: u32 = 65533;

fn target() -> Option<Target> {
    Some(match std::env::var("KRDMA_TEST_DOOR").ok()?.as_str() {
        "embedded" => {
            krdma_tests::setup_embedded();
            Target::Embedded
        }
        p => Target::Device(p.into()),
    })
}

fn device() -> String {
    std::env::var("KRDMA_TEST_DEV").unwrap_or_else(|_| "siw0".into())
}

/// Role: a context with every kind of object, its numbers revealed.
#[test]
#[ignore = "a role of two_processes_probe_each_other"]
fn role_victim() {
    let Some(target) = target() else { return };
    let v = Victim::new(&target, &device());
    v.expose();
    say("ADDR", v.addr);
    say("KNOWN", v.known.to_line());
    assert_eq!(hear(), "check");
    say("UNTOUCHED", v.untouched());
    v.check();
}

/// The status of the next completion on `cq` (or a timeout, as "none").
fn next_status(cq: &ual::Cq) -> String {
    match cq.wait(1, Duration::from_secs(10)) {
        Ok(c) => format!("{:?}", c[0].status()),
        Err(VerbsError::TimedOut) => "none".into(),
        Err(e) => format!("{e:?}"),
    }
}

/// Role: another user's process, trying everything it knows of the victim.
#[test]
#[ignore = "a role of two_processes_probe_each_other"]
fn role_prober() {
    let (Some(target), Ok(line), Ok(addr)) = (
        target(),
        std::env::var("KRDMA_TEST_KNOWN"),
        std::env::var("KRDMA_TEST_ADDR"),
    ) else {
        return;
    };
    let k = Known::parse(&line);
    let device = device();
    // 1. Every command naming the victim's handles, in a context of our own.
    let fresh = Context::open_target(&target).unwrap();
    let own = Own::new();
    for mut a in every_command(&k, &own)
        .into_iter()
        .filter(|a| a.names_other)
    {
        let r = fresh.channel().call_raw(a.cmd, &mut a.arg);
        say(
            "HANDLE",
            format!("{} {}", a.name, r.err().map_or(0, |e| e.errno())),
        );
    }
    // 2. The victim's keys in work requests on a connection of our own.
    let (p, q) = (
        Context::open_target(&target).unwrap(),
        Context::open_target(&target).unwrap(),
    );
    let (s, c) = connect_pair(&p, &q, &device, 4096, 8).unwrap();
    let theirs = ual::Sge {
        addr: k.addr,
        length: 8,
        lkey: k.lkey,
    };
    let post = |w: Wqe| c.qp.post_send(&w.with_flags(send_flags::SIGNALED)).unwrap();
    post(Wqe::new(1, WrOpcode::Send, &[theirs]));
    say("KEY", format!("lkey {}", next_status(&c.cq)));
    // Each failed request ends the connection: a fresh pair for each.
    let tries: [(&str, Wqe); 3] = [
        (
            "rkey-write",
            Wqe::new(2, WrOpcode::RdmaWrite, &[c.mr.sge(0, 8)]).with_remote(k.addr, k.rkey),
        ),
        (
            "rkey-read",
            Wqe::new(3, WrOpcode::RdmaRead, &[c.mr.sge(0, 8)]).with_remote(k.addr, k.rkey),
        ),
        (
            "invalidate",
            Wqe::new(4, WrOpcode::SendWithInv, &[c.mr.sge(0, 8)]).with_imm(k.rkey),
        ),
    ];
    for (what, w) in tries {
        let (s, c) = connect_pair(&p, &q, &device, 4096, 8).unwrap();
        s.post_recv(9, 0, 64).unwrap();
        c.qp.post_send(&w.with_flags(send_flags::SIGNALED)).unwrap();
        say("KEY", format!("{what} {}", next_status(&c.cq)));
    }
    drop((s, c));
    // 3. A QP of our own aimed at the victim's QP number (RoCE; an iWARP QP has no
    //    number on the wire, it is a TCP stream).
    if device == "rxe0" {
        let dev = p.device(&device).unwrap().index;
        let pd = p.alloc_pd(dev).unwrap();
        let cq = p.create_cq(dev, 16).unwrap();
        let qp = p.create_qp(&pd, &cq, &cq, QpConfig::default()).unwrap();
        let buf = ual::RegBuf::new(4096).unwrap();
        let mr = p.reg_buf(&pd, &buf, Access::LOCAL_WRITE).unwrap();
        let path = RcPath {
            path_mtu: 1024,
            sgid_index: 0,
            hop_limit: 64,
            max_dest_rd_atomic: 1,
            max_rd_atomic: 1,
            min_rnr_timer: 1,
            timeout: 10,
            retry_cnt: 1,
            rnr_retry: 1,
        };
        let ip: std::net::IpAddr = addr.parse().unwrap();
        let peer = RcPeer {
            qpn: k.qpn,
            psn: 0,
            gid: rnicpi::ip_to_gid(ip),
        };
        to_init(&qp, Access::empty()).unwrap();
        to_rtr(&qp, &path, &peer).unwrap();
        to_rts(&qp, &path, 0).unwrap();
        for (i, w) in [
            Wqe::new(5, WrOpcode::Send, &[mr.sge(0, 8)]),
            Wqe::new(6, WrOpcode::RdmaWrite, &[mr.sge(0, 8)]).with_remote(k.addr, k.rkey),
        ]
        .into_iter()
        .enumerate()
        {
            qp.post_send(&w.with_flags(send_flags::SIGNALED)).unwrap();
            say("QPN", format!("{i} {}", next_status(&cq)));
        }
    }
    // 4. The victim's connection request, through a listener of our own.
    let dev = p.device(&device).unwrap().index;
    let ip = tools::perf::loopback_of(&p, dev).unwrap();
    let listener = p.listen(dev, SocketAddr::new(ip, 0), 4).unwrap();
    let ep = tools::perf::new_endpoint(&p, dev, 4096, 8).unwrap();
    let accept = listener.accept(k.conn_id, &ep.qp, &ep.offer());
    say(
        "CONN",
        format!("accept {}", accept.err().map_or(0, |e| e.errno())),
    );
    let reject = listener.reject(k.conn_id, &[]);
    say(
        "CONN",
        format!("reject {}", reject.err().map_or(0, |e| e.errno())),
    );
    // 5. The daemon's contexts, as we may see them (an embedded kAL has only ours,
    //    numbered on its own).
    if !p.is_embedded() {
        let (_, rows) = p.stat_contexts().unwrap();
        say("SEES", rows.iter().any(|r| r.id == k.ctx));
    }
    say("DONE", "");
}

fn probe(front: &FrontDoor, device: &str) {
    // Through the daemon the two share a kAL with a bystander of a third user (root).
    let bystander = front.daemon().map(|_| Bystander::start(front, "rxe0"));
    let door = &front.env_value();
    let role = |name: &str, uid: u32, env: &[(&str, &str)]| {
        let mut c = child_test(name);
        c.env("KRDMA_TEST_DOOR", door).env("KRDMA_TEST_DEV", device);
        for (k, v) in env {
            c.env(k, v);
        }
        Role::spawn(as_user(&c, uid))
    };
    let mut victim = role("role_victim", VICTIM, &[]);
    let addr = victim.expect("ADDR");
    let known = victim.expect("KNOWN");
    let mut prober = role(
        "role_prober",
        PROBER,
        &[("KRDMA_TEST_KNOWN", &known), ("KRDMA_TEST_ADDR", &addr)],
    );
    prober.expect("DONE");
    let said = prober.said(false);
    let value = |l: &str| l.rsplit(' ').next().unwrap().to_string();
    let mut checks = 0;
    for l in &said {
        if l.starts_with("HANDLE ") || l.starts_with("CONN ") {
            assert_ne!(value(l), "0", "{door} {device}: reached the victim: {l}");
        } else if l.starts_with("KEY ") || l.starts_with("QPN ") {
            assert_ne!(
                value(l),
                format!("{:?}", WcStatus::Success),
                "{door} {device}: the victim's key or QP worked for us: {l}"
            );
        } else if l.starts_with("SEES ") {
            assert_eq!(
                value(l),
                "false",
                "{door}: another user's context is listed"
            );
        } else {
            continue;
        }
        checks += 1;
    }
    eprintln!("{door} {device}: {checks} probes, none reached the victim");
    victim.tell("check");
    assert_eq!(
        victim.expect("UNTOUCHED"),
        "true",
        "{door} {device}: {:?}",
        said
    );
    victim.expect("INTACT");
    victim.expect("ACCEPTED");
    assert!(victim.wait().success());
    assert!(prober.wait().success());
    if let Some(b) = bystander {
        b.finish().assert_served(Duration::from_secs(2));
    }
}

#[test]
fn two_processes_probe_each_other() {
    for device in ["siw0", "rxe0"] {
        probe(&FrontDoor::Embedded, device);
    }
    if daemon_possible() {
        let d = FrontDoor::Daemon(Daemon::start());
        for device in ["siw0", "rxe0"] {
            probe(&d, device);
        }
    }
}
