//! Shared set-up of the IT-API tests: each test runs over every device (siw0, iWARP;
//! rxe0, RoCEv2) through both front doors ([`itapi_tests!`]); one side of a connection
//! (IA, PZ, EVDs, an LMR over a buffer, an RC endpoint) and a connected pair on loopback.
#![allow(dead_code)]

use krdma_itapi::*;
use krdma_tests::{each_front_door, FrontDoor};
use std::net::SocketAddr;
use std::time::Duration;
use ual::{RegBuf, Target};

pub const T: Option<Duration> = Some(Duration::from_secs(10));

/// Where one run of a test happens: a front door, and a device on it.
pub struct Case<'a> {
    pub door: &'a FrontDoor,
    pub dev: &'static str,
}

impl Case<'_> {
    pub fn target(&self) -> Target {
        self.door.target()
    }

    /// A fresh IA on the device.
    pub fn ia(&self) -> Ia {
        Ia::open_on(&self.target(), self.dev).expect("open IA")
    }

    /// The device is iWARP (siw0) rather than InfiniBand/RoCE (rxe0).
    pub fn iwarp(&self) -> bool {
        self.ia().transport() == Transport::IwarpTcp
    }

    /// `KRDMA_DEVICE` for a child process on the same front door.
    pub fn device_env(&self) -> String {
        match self.target() {
            Target::Embedded => "embedded".into(),
            Target::Device(p) => p.display().to_string(),
        }
    }
}

/// Run `f` over `dev` through each front door.
pub fn each_case(dev: &'static str, f: impl Fn(&Case)) {
    // Before this process's embedded kAL starts: its rxe0 serves an address of its own
    // (a wildcard rxe0 would take every test process's RoCEv2 traffic, and answer it).
    krdma_tests::setup_embedded();
    each_front_door(|door| {
        eprintln!("--- device: {dev}");
        f(&Case { door, dev })
    });
}

/// Test functions that run over every device (declare the module `#[macro_use]`): `fn name(case) { ... }` becomes a module
/// `name` with one test per device (`name::siw0`, `name::rxe0`), each through both
/// front doors.
macro_rules! itapi_tests {
    ($(fn $name:ident($case:ident) $body:block)*) => {
        $(
            mod $name {
                #[allow(unused_imports)]
                use super::*;

                fn run($case: &Case) $body

                #[test]
                fn siw0() {
                    each_case("siw0", run);
                }

                #[test]
                fn rxe0() {
                    each_case("rxe0", run);
                }
            }
        )*
    };
}

/// Which connection message private data travels in.
#[derive(Debug, Clone, Copy)]
pub enum Pdata {
    Connect,
    Accept,
    Reject,
}

/// The private data a peer receives for `sent`: exactly `sent` on iWARP (MPA carries
/// its length); on InfiniBand the CM message's whole private-data field (56 bytes of a
/// REQ after the RDMA CM header, 196 of a REP, 148 of a REJ): the IB CM carries no
/// length, so `sent` arrives followed by zeros, as rdma_cm reports it too.
pub fn as_received(ia: &Ia, sent: &[u8], msg: Pdata) -> Vec<u8> {
    if ia.transport() == Transport::IwarpTcp {
        return sent.to_vec();
    }
    let (connect, accept, reject) = ia.private_data_limits();
    let field = match msg {
        Pdata::Connect => connect,
        Pdata::Accept => accept,
        Pdata::Reject => reject,
    };
    let mut v = sent.to_vec();
    v.resize(field, 0);
    v
}

/// The address another endpoint on this host connects to `ia` at, with `port`.
pub fn addr_of(ia: &Ia, port: u16) -> SocketAddr {
    SocketAddr::new(ia.local_address().expect("adapter address"), port)
}

/// One side of a connection.
pub struct Side {
    pub ia: Ia,
    pub pz: Pz,
    pub dto: Evd,
    pub cm: Evd,
    pub ep: Endpoint,
    pub lmr: Lmr,
    /// The peer's buffer, from the connection's private data.
    pub remote: Option<RdmaAddr>,
}

/// How to build one side.
#[derive(Clone)]
pub struct Cfg {
    pub attrs: EpAttributes,
    pub buf_len: usize,
    pub dto_queue: usize,
    pub dto_flags: EvdFlags,
}

impl Default for Cfg {
    fn default() -> Self {
        Cfg {
            attrs: EpAttributes::default(),
            buf_len: 4096,
            dto_queue: 256,
            dto_flags: EvdFlags::empty(),
        }
    }
}

impl Side {
    pub fn new(case: &Case, attrs: EpAttributes, buf_len: usize) -> Side {
        Self::build(
            case,
            &Cfg {
                attrs,
                buf_len,
                ..Cfg::default()
            },
        )
    }

    pub fn build(case: &Case, cfg: &Cfg) -> Side {
        let ia = case.ia();
        let pz = Pz::create(&ia).unwrap();
        let dto =
            Evd::create(&ia, EventStream::Dto, cfg.dto_flags, cfg.dto_queue, 1, None).unwrap();
        let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 16, 1, None).unwrap();
        let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, cfg.attrs.clone(), None).unwrap();
        let buf = RegBuf::new(cfg.buf_len).unwrap();
        let privs = if ia.atomic_support() {
            MemPriv::ALL
        } else {
            MemPriv::ALL & !MemPriv::ATOMIC
        };
        let lmr = Lmr::create(&pz, buf, privs).unwrap();
        Side {
            ia,
            pz,
            dto,
            cm,
            ep,
            lmr,
            remote: None,
        }
    }

    pub fn buf(&self) -> &RegBuf {
        self.lmr.buffer().unwrap()
    }

    pub fn seg(&self, offset: u64, len: u32) -> Segment {
        self.lmr.segment(offset, len).unwrap()
    }

    pub fn advert(&self) -> Vec<u8> {
        self.lmr
            .rdma_addr(0)
            .unwrap()
            .encode(self.lmr.len())
            .to_vec()
    }

    pub fn remote(&self, offset: u64) -> RdmaAddr {
        let r = self.remote.expect("peer buffer");
        RdmaAddr {
            addr: r.addr + offset,
            ..r
        }
    }

    /// The next DTO completion (panics on anything else).
    pub fn dto_event(&self) -> DtoEvent {
        match self.dto.wait(T).expect("DTO event").0 {
            Event::Dto(d) => d,
            other => panic!("expected a DTO completion, got {other:?}"),
        }
    }

    /// The next successful completion of `kind`, skipping others of ours.
    pub fn expect(&self, kind: DtoKind, cookie: u64) -> DtoEvent {
        let d = self.dto_event();
        assert_eq!(
            (d.kind, d.cookie, d.status),
            (kind, cookie, DtoStatus::Success),
            "{d:?}"
        );
        d
    }

    pub fn conn_event(&self) -> ConnectionEvent {
        match self.cm.wait(T).expect("connection event").0 {
            Event::Connection(c) => c,
            other => panic!("expected a connection event, got {other:?}"),
        }
    }
}

/// A listening server: its IA's request SEVD and listener.
pub struct Listening {
    pub req: Evd,
    pub listener: Listener,
}

impl Listening {
    pub fn new(side: &Side) -> Listening {
        let req = Evd::create(
            &side.ia,
            EventStream::CmRequest,
            EvdFlags::empty(),
            64,
            1,
            None,
        )
        .unwrap();
        let listener = Listener::create(&side.ia, 0, &req, 0).unwrap();
        Listening { req, listener }
    }

    /// Where to connect to the listener from this host.
    pub fn addr(&self) -> SocketAddr {
        addr_of(self.listener.ia(), self.listener.port())
    }

    pub fn request(&self) -> ConnRequestEvent {
        match self.req.wait(T).expect("connection request").0 {
            Event::ConnRequest(r) => r,
            other => panic!("expected a connection request, got {other:?}"),
        }
    }
}

/// A connected (server, client) pair; each knows the other's buffer.
pub fn pair(case: &Case, attrs: EpAttributes, buf_len: usize) -> (Side, Side) {
    let cfg = Cfg {
        attrs,
        buf_len,
        ..Cfg::default()
    };
    pair_cfg(case, &cfg, &cfg)
}

/// A connected pair built from a configuration for each side.
pub fn pair_cfg(case: &Case, server: &Cfg, client: &Cfg) -> (Side, Side) {
    let mut s = Side::build(case, server);
    let mut c = Side::build(case, client);
    let l = Listening::new(&s);
    c.ep.connect(l.addr(), &c.advert()).unwrap();
    let r = l.request();
    s.remote = RdmaAddr::decode(&r.private_data).map(|x| x.0);
    s.ep.accept(r.cn_est_id, &s.advert()).unwrap();
    assert_eq!(s.conn_event().kind, ConnEventKind::Established);
    let ce = c.conn_event();
    assert_eq!(ce.kind, ConnEventKind::Established);
    c.remote = RdmaAddr::decode(&ce.private_data).map(|x| x.0);
    (s, c)
}

/// Whether `fd` becomes readable within `ms` milliseconds.
pub fn readable(fd: std::os::fd::BorrowedFd<'_>, ms: u16) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut p, PollTimeout::from(ms)).unwrap() == 1
}
