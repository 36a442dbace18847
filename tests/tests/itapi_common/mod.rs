//! Shared set-up of the IT-API tests: one side of a connection (IA, PZ, EVDs, an LMR over
//! a buffer, an RC endpoint) and a connected pair over siw0 on loopback.
#![allow(dead_code)]

use krdma_itapi::*;
use krdma_tests::FrontDoor;
use std::net::SocketAddr;
use std::time::Duration;
use ual::RegBuf;

pub const T: Option<Duration> = Some(Duration::from_secs(10));
pub const DEV: &str = "siw0";

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
    pub fn new(door: &FrontDoor, attrs: EpAttributes, buf_len: usize) -> Side {
        Self::build(
            door,
            &Cfg {
                attrs,
                buf_len,
                ..Cfg::default()
            },
        )
    }

    pub fn build(door: &FrontDoor, cfg: &Cfg) -> Side {
        let ia = Ia::open_on(&door.target(), DEV).expect("open IA");
        let pz = Pz::create(&ia).unwrap();
        let dto =
            Evd::create(&ia, EventStream::Dto, cfg.dto_flags, cfg.dto_queue, 1, None).unwrap();
        let cm = Evd::create(&ia, EventStream::CmMessage, EvdFlags::empty(), 16, 1, None).unwrap();
        let ep = Endpoint::create_rc(&pz, &dto, &dto, &cm, cfg.attrs.clone(), None).unwrap();
        let buf = RegBuf::new(cfg.buf_len).unwrap();
        let lmr = Lmr::create(&pz, buf, MemPriv::ALL & !MemPriv::ATOMIC).unwrap();
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

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.listener.port()))
    }

    pub fn request(&self) -> ConnRequestEvent {
        match self.req.wait(T).expect("connection request").0 {
            Event::ConnRequest(r) => r,
            other => panic!("expected a connection request, got {other:?}"),
        }
    }
}

/// A connected (server, client) pair; each knows the other's buffer.
pub fn pair(door: &FrontDoor, attrs: EpAttributes, buf_len: usize) -> (Side, Side) {
    let cfg = Cfg {
        attrs,
        buf_len,
        ..Cfg::default()
    };
    pair_cfg(door, &cfg, &cfg)
}

/// A connected pair built from a configuration for each side.
pub fn pair_cfg(door: &FrontDoor, server: &Cfg, client: &Cfg) -> (Side, Side) {
    let mut s = Side::build(door, server);
    let mut c = Side::build(door, client);
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
