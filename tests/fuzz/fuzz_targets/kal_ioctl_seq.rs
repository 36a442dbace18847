//! Sequences of ioctl commands into an embedded kAL with the real siw and rxe providers
//! (rxe on a loopback address of this process's own, plain UDP: no root needed).
//!
//! Each command's arguments come from earlier results — the handles created so far, the
//! connection requests seen in the event queue, buffers of this process to register —
//! or are wild, so deep states are reached: QPs on SRQs connected through listeners of
//! the same context, windows bound in PDs in use, address handles, destroys of parents
//! still in use.
//! Checked after every command: the kAL's own view of the context (STAT_CONTEXTS) counts
//! exactly the objects the model saw created and not destroyed. Checked at the end of
//! every input: once the context is released nothing of it is left (no context, no
//! registration, window, address handle or QP in either device, nothing pinned). And nothing panics.
#![no_main]

use arbitrary::Arbitrary;
use bytemuck::Zeroable;
use kal::abi::{self, cmd};
use kal::{Caller, EmbeddedPeer, Kal};
use libfuzzer_sys::fuzz_target;
use rnicpi::queue::{ring_bytes, ring_capacity};
use rnicpi::{Cqe, QpRingLayout, SharedMem, Wqe};
use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};

/// A number that names one of the objects created so far, or anything at all.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Pick {
    Made(u8),
    Wild(u32),
}

#[derive(Arbitrary, Debug)]
enum Op {
    AllocPd {
        dev: u8,
    },
    DeallocPd(Pick),
    CreateCq {
        dev: u8,
        cqe: u16,
        short_ring: bool,
        signal: Option<i8>,
    },
    DestroyCq(Pick),
    CreateQp {
        pd: Pick,
        scq: Pick,
        rcq: Pick,
        srq: Option<Pick>,
        sq: u8,
        rq: u8,
        ud: bool,
    },
    ModifyQp {
        qp: Pick,
        state: u8,
        mask: u32,
        mtu: u8,
        dest_qpn: u32,
        psn: u32,
    },
    QueryQp(Pick),
    DestroyQp(Pick),
    RegMr {
        pd: Pick,
        buf: u8,
        offset: u16,
        len: u32,
        access: u8,
    },
    DeregMr(Pick),
    Listen {
        dev: u8,
        backlog: u8,
    },
    DestroyListen(Pick),
    Connect {
        qp: Pick,
        to: Pick,
        rxe: bool,
        pdata: u8,
    },
    Accept {
        listener: Pick,
        qp: Pick,
        conn: Pick,
    },
    Reject {
        listener: Pick,
        conn: Pick,
    },
    Disconnect {
        qp: Pick,
        abortive: bool,
    },
    CreateSrq {
        pd: Pick,
        max_wr: u8,
        limit: u8,
    },
    ModifySrq {
        srq: Pick,
        limit: u8,
    },
    QuerySrq(Pick),
    DestroySrq(Pick),
    AllocMw(Pick),
    DeallocMw(Pick),
    CreateAh {
        pd: Pick,
        port: u8,
        sgid_index: u8,
        flow_label: u32,
        /// A loopback destination, or any GID.
        dgid: Option<[u8; 16]>,
    },
    DestroyAh(Pick),
    Stat {
        which: u8,
        start: u8,
    },
    ReadEvents,
    Raw {
        nr: u8,
        bytes: Vec<u8>,
    },
}

const DEVICES: u32 = 2;
const BUFS: usize = 4;
const BUF_LEN: usize = 64 << 10;

/// The embedded kAL and the memory this process lends its registrations (for the whole
/// run: providers start threads, buffers must outlive every registration).
struct World {
    kal: Arc<Kal>,
    bufs: Vec<memmap2::MmapMut>,
}

/// rxe0's own loopback address (this process's).
fn rxe_addr() -> std::net::IpAddr {
    let pid = std::process::id();
    std::net::Ipv4Addr::new(127, 77, (pid >> 8) as u8, pid as u8).into()
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let std::net::IpAddr::V4(rxe) = rxe_addr() else {
            unreachable!()
        };
        let opts = stack::StackOptions {
            rxe_addr: Some(rxe),
            rxe_no_raw: true,
            ..Default::default()
        };
        let kal = Kal::new(kal::Config::default());
        stack::start_default(&kal, &opts).expect("providers");
        assert_eq!(kal.devices().len() as u32, DEVICES, "siw0 and rxe0");
        let bufs = (0..BUFS)
            .map(|_| memmap2::MmapMut::map_anon(BUF_LEN).unwrap())
            .collect();
        World { kal, bufs }
    })
}

/// What the model knows of the context: the handles of each kind alive now, and the
/// connection ids seen in connection requests.
#[derive(Default)]
struct Model {
    pds: Vec<u32>,
    cqs: Vec<u32>,
    qps: Vec<u32>,
    mrs: Vec<u32>,
    listeners: Vec<u32>,
    /// The port each listener got.
    ports: std::collections::HashMap<u32, u16>,
    srqs: Vec<u32>,
    mws: Vec<u32>,
    ahs: Vec<u32>,
    conns: Vec<u64>,
    /// Ring memory handed to the kAL (kept, as the consumer's own copy would be).
    rings: Vec<SharedMem>,
}

fn pick(list: &[u32], p: Pick) -> u32 {
    match p {
        Pick::Made(i) if !list.is_empty() => list[i as usize % list.len()],
        Pick::Made(i) => i as u32,
        Pick::Wild(v) => v,
    }
}

fn pick_conn(list: &[u64], p: Pick) -> u64 {
    match p {
        Pick::Made(i) if !list.is_empty() => list[i as usize % list.len()],
        Pick::Made(i) => i as u64,
        Pick::Wild(v) => v as u64,
    }
}

/// Run one command; `Ok` with the struct as the kAL left it.
fn call<T: bytemuck::Pod>(kal: &Kal, ctx: u32, c: u32, mut a: T) -> Result<T, rnicpi::VerbsError> {
    kal.ioctl(ctx, c, bytemuck::bytes_of_mut(&mut a))
        .map(|()| a)
}

fn destroy(kal: &Kal, ctx: u32, c: u32, list: &mut Vec<u32>, p: Pick) {
    let handle = pick(list, p);
    if call(kal, ctx, c, abi::Destroy { handle, _pad: 0 }).is_ok() {
        list.retain(|h| *h != handle);
    }
}

fn run(w: &World, ctx: u32, m: &mut Model, op: Op) {
    let kal = &w.kal;
    match op {
        Op::AllocPd { dev } => {
            let a = abi::AllocPd {
                dev: dev as u32 % (DEVICES + 1),
                handle: 0,
            };
            if let Ok(a) = call(kal, ctx, cmd::ALLOC_PD, a) {
                m.pds.push(a.handle);
            }
        }
        Op::DeallocPd(p) => destroy(kal, ctx, cmd::DEALLOC_PD, &mut m.pds, p),
        Op::CreateCq {
            dev,
            cqe,
            short_ring,
            signal,
        } => {
            let cap = ring_capacity((cqe as u32).max(1)).unwrap();
            let len = ring_bytes::<Cqe>(cap) - if short_ring { 64 } else { 0 };
            let mem = SharedMem::create("fuzz-cq", len).unwrap();
            let mut a = abi::CreateCq::zeroed();
            (a.dev, a.cqe, a.memfd) =
                (dev as u32 % (DEVICES + 1), cqe as u32, mem.fd().as_raw_fd());
            // None: no signal socket; Some(0): a real socket pair; else any number.
            let pair = std::os::unix::net::UnixStream::pair().unwrap();
            a.signal = match signal {
                None => -1,
                Some(0) => pair.0.as_raw_fd(),
                Some(n) => i32::from(n),
            };
            if let Ok(a) = call(kal, ctx, cmd::CREATE_CQ, a) {
                m.cqs.push(a.handle);
            }
            m.rings.push(mem);
        }
        Op::DestroyCq(p) => destroy(kal, ctx, cmd::DESTROY_CQ, &mut m.cqs, p),
        Op::CreateQp {
            pd,
            scq,
            rcq,
            srq,
            sq,
            rq,
            ud,
        } => {
            let (sq, rq) = (
                sq as u32 % 64 + 1,
                if srq.is_some() { 0 } else { rq as u32 % 64 + 1 },
            );
            let Some(layout) = QpRingLayout::new(sq, rq) else {
                return;
            };
            let mem = SharedMem::create("fuzz-qp", layout.total).unwrap();
            let mut a = abi::CreateQp::zeroed();
            (a.pd, a.send_cq, a.recv_cq) = (pick(&m.pds, pd), pick(&m.cqs, scq), pick(&m.cqs, rcq));
            a.qp_type = if ud { 4 } else { 2 };
            (a.max_send_wr, a.max_recv_wr, a.max_send_sge, a.max_recv_sge) = (sq, rq, 2, 2);
            (a.memfd, a.doorbell_fd) = (mem.fd().as_raw_fd(), -1);
            a.srq = srq.map_or(0, |s| pick(&m.srqs, s));
            if let Ok(a) = call(kal, ctx, cmd::CREATE_QP, a) {
                m.qps.push(a.handle);
            }
            m.rings.push(mem);
        }
        Op::ModifyQp {
            qp,
            state,
            mask,
            mtu,
            dest_qpn,
            psn,
        } => {
            let mut a = abi::QpAttrs::zeroed();
            (a.handle, a.mask, a.state) = (pick(&m.qps, qp), mask & 0x3fff, state % 8);
            a.path_mtu = 256 << (mtu % 5);
            (a.dest_qpn, a.rq_psn, a.sq_psn) = (dest_qpn, psn, psn);
            (
                a.max_rd_atomic,
                a.max_dest_rd_atomic,
                a.retry_cnt,
                a.timeout,
            ) = (1, 1, 1, 8);
            a.dgid = rnicpi::ip_to_gid(std::net::IpAddr::from([127, 0, 0, 1]));
            let _ = call(kal, ctx, cmd::MODIFY_QP, a);
        }
        Op::QueryQp(p) => {
            let mut a = abi::QpAttrs::zeroed();
            a.handle = pick(&m.qps, p);
            let _ = call(kal, ctx, cmd::QUERY_QP, a);
        }
        Op::DestroyQp(p) => destroy(kal, ctx, cmd::DESTROY_QP, &mut m.qps, p),
        Op::RegMr {
            pd,
            buf,
            offset,
            len,
            access,
        } => {
            let b = &w.bufs[buf as usize % BUFS];
            let mut a = abi::RegMr::zeroed();
            a.pd = pick(&m.pds, pd);
            a.access = access as u32;
            a.addr = b.as_ptr() as u64 + offset as u64;
            a.length = (len % (2 * BUF_LEN as u32)) as u64;
            if let Ok(a) = call(kal, ctx, cmd::REG_MR, a) {
                m.mrs.push(a.handle);
            }
        }
        Op::DeregMr(p) => destroy(kal, ctx, cmd::DEREG_MR, &mut m.mrs, p),
        Op::Listen { dev, backlog } => {
            let mut a = abi::Listen::zeroed();
            (a.dev, a.backlog) = (dev as u32 % (DEVICES + 1), backlog as u32);
            a.addr = rnicpi::ip_to_gid(std::net::IpAddr::from([127, 0, 0, 1]));
            if let Ok(a) = call(kal, ctx, cmd::LISTEN, a) {
                m.listeners.push(a.handle);
                m.ports.insert(a.handle, a.port);
            }
        }
        Op::DestroyListen(p) => destroy(kal, ctx, cmd::DESTROY_LISTEN, &mut m.listeners, p),
        Op::Connect { qp, to, rxe, pdata } => {
            // To a listener of ours (or a closed port), on loopback: never off this machine.
            let port = m.ports.get(&pick(&m.listeners, to)).copied().unwrap_or(9);
            let mut a = abi::Connect::zeroed();
            a.qp = pick(&m.qps, qp);
            (a.ird, a.ord, a.pdata_len, a.port) = (1, 1, pdata as u32 % 64, port);
            a.addr = rnicpi::ip_to_gid(if rxe {
                rxe_addr()
            } else {
                [127, 0, 0, 1].into()
            });
            let _ = call(kal, ctx, cmd::CONNECT, a);
        }
        Op::Accept { listener, qp, conn } => {
            let mut a = abi::Accept::zeroed();
            (a.listen, a.qp) = (pick(&m.listeners, listener), pick(&m.qps, qp));
            (a.conn_id, a.ird, a.ord) = (pick_conn(&m.conns, conn), 1, 1);
            let _ = call(kal, ctx, cmd::ACCEPT, a);
        }
        Op::Reject { listener, conn } => {
            let mut a = abi::Reject::zeroed();
            (a.listen, a.conn_id) = (pick(&m.listeners, listener), pick_conn(&m.conns, conn));
            let _ = call(kal, ctx, cmd::REJECT, a);
        }
        Op::Disconnect { qp, abortive } => {
            let a = abi::Disconnect {
                qp: pick(&m.qps, qp),
                abortive: abortive as u32,
            };
            let _ = call(kal, ctx, cmd::DISCONNECT, a);
        }
        Op::CreateSrq { pd, max_wr, limit } => {
            let cap = ring_capacity((max_wr as u32).max(1)).unwrap();
            let mem = SharedMem::create("fuzz-srq", ring_bytes::<Wqe>(cap)).unwrap();
            let mut a = abi::CreateSrq::zeroed();
            (a.pd, a.max_wr, a.max_sge, a.limit) =
                (pick(&m.pds, pd), max_wr as u32, 2, limit as u32);
            a.memfd = mem.fd().as_raw_fd();
            if let Ok(a) = call(kal, ctx, cmd::CREATE_SRQ, a) {
                m.srqs.push(a.handle);
            }
            m.rings.push(mem);
        }
        Op::ModifySrq { srq, limit } => {
            let mut a = abi::SrqAttrs::zeroed();
            (a.handle, a.limit) = (pick(&m.srqs, srq), limit as u32);
            let _ = call(kal, ctx, cmd::MODIFY_SRQ, a);
        }
        Op::QuerySrq(p) => {
            let mut a = abi::SrqAttrs::zeroed();
            a.handle = pick(&m.srqs, p);
            let _ = call(kal, ctx, cmd::QUERY_SRQ, a);
        }
        Op::DestroySrq(p) => destroy(kal, ctx, cmd::DESTROY_SRQ, &mut m.srqs, p),
        Op::AllocMw(p) => {
            let mut a = abi::AllocMw::zeroed();
            a.pd = pick(&m.pds, p);
            if let Ok(a) = call(kal, ctx, cmd::ALLOC_MW, a) {
                m.mws.push(a.handle);
            }
        }
        Op::DeallocMw(p) => destroy(kal, ctx, cmd::DEALLOC_MW, &mut m.mws, p),
        Op::CreateAh {
            pd,
            port,
            sgid_index,
            flow_label,
            dgid,
        } => {
            let attr = rnicpi::AhAttr {
                port: port % 3,
                sgid_index,
                flow_label,
                dgid: dgid.unwrap_or_else(|| rnicpi::ip_to_gid(rxe_addr())),
                ..Default::default()
            };
            let a = abi::CreateAh::encode(pick(&m.pds, pd), &attr);
            if let Ok(a) = call(kal, ctx, cmd::CREATE_AH, a) {
                m.ahs.push(a.handle);
            }
        }
        Op::DestroyAh(p) => destroy(kal, ctx, cmd::DESTROY_AH, &mut m.ahs, p),
        Op::Stat { which, start } => {
            // A device (or none), or the kAL's own counters.
            let mut a = abi::StatDevice::zeroed();
            a.dev = [0, 1, 2, abi::KAL_COUNTERS][which as usize % 4];
            a.start = start as u32;
            let _ = call(kal, ctx, cmd::STAT_DEVICE, a);
        }
        Op::ReadEvents => {
            let mut buf = vec![0u8; abi::EVENT_SIZE * 16];
            if let Ok(n) = kal.read_events(ctx, &mut buf) {
                for rec in buf[..n].chunks_exact(abi::EVENT_SIZE) {
                    let r: abi::EventRecord = bytemuck::pod_read_unaligned(rec);
                    if let Some(ev) = r.to_event() {
                        if ev.kind == rnicpi::EventKind::ConnectRequest {
                            m.conns.push(ev.conn_id);
                        }
                    }
                }
            }
        }
        Op::Raw { nr, mut bytes } => {
            // Any command, any bytes: the kAL checks the size and every field itself.
            let size = bytes.len().min(0x3fff);
            let _ = kal.ioctl(ctx, abi::iowr(nr, size), &mut bytes[..size]);
            let _ = kal.ioctl(ctx, abi::iowr(nr, size).wrapping_add(0x10000), &mut bytes);
        }
    }
}

/// The kAL's row of `ctx` must count what the model holds (a `Raw` command may have
/// created objects the model cannot see: then the model adopts the kAL's counts).
fn consistent(kal: &Kal, ctx: u32, m: &Model, raw_seen: bool) {
    let mut s = abi::StatContexts::zeroed();
    kal.ioctl(ctx, cmd::STAT_CONTEXTS, bytemuck::bytes_of_mut(&mut s))
        .unwrap();
    let row = s.rows[..s.count as usize]
        .iter()
        .find(|r| r.id == ctx)
        .expect("own row");
    let model = [
        m.pds.len(),
        m.cqs.len(),
        m.qps.len(),
        m.mrs.len(),
        m.listeners.len(),
        m.srqs.len(),
        m.mws.len(),
        m.ahs.len(),
    ];
    let kal_view = [
        row.pds,
        row.cqs,
        row.qps,
        row.mrs,
        row.listeners,
        row.srqs,
        row.mws,
        row.ahs,
    ]
    .map(|v| v as usize);
    if !raw_seen {
        assert_eq!(
            model, kal_view,
            "the kAL counts other objects than were made"
        );
    }
}

fn live(kal: &Kal) -> u64 {
    kal.devices()
        .iter()
        .flat_map(|d| d.counters())
        .filter(|(n, _)| n.ends_with("_live"))
        .map(|(_, v)| v)
        .sum()
}

fuzz_target!(|ops: Vec<Op>| {
    let w = world();
    let me = Caller {
        pid: std::process::id(),
        uid: 0,
        gid: 0,
    };
    let ctx = w.kal.open(me, Arc::new(EmbeddedPeer)).unwrap();
    let mut m = Model::default();
    let mut raw_seen = false;
    for op in ops.into_iter().take(64) {
        raw_seen |= matches!(op, Op::Raw { .. });
        run(w, ctx, &mut m, op);
        consistent(&w.kal, ctx, &m, raw_seen);
    }
    w.kal.release(ctx);
    assert_eq!(w.kal.context_count(), 0, "a context outlived its release");
    assert_eq!(
        live(&w.kal),
        0,
        "registrations, windows or QPs outlived their context"
    );
    assert_eq!(w.kal.pinned_total(), 0, "pins outlived their context");
});
