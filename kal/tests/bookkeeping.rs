//! kAL bookkeeping through the embedded front door, with a small test provider (a test
//! double for resource accounting only: it moves no data).
//!
//! Over 600 lines: independent tests of the kAL's accounting (teardown, limits, quotas,
//! pins, keys, handles, the event queue), sharing the test provider and its set-up.

use bytemuck::Zeroable;
use kal::abi::{self, cmd};
use kal::{Caller, Config, EmbeddedPeer, Kal, Limits, Quota};
use parking_lot::Mutex;
use proptest::prelude::*;
use rnicpi::*;
use std::any::Any;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[derive(Default)]
struct Log {
    destroyed: Mutex<Vec<&'static str>>,
    pds: AtomicU32,
}

struct TestDev {
    attr: DeviceAttr,
    mrs: MrTable,
    log: Arc<Log>,
}

struct TestCq(EngineCq, Arc<Log>);
impl ProviderCq for TestCq {
    fn engine(&self) -> &EngineCq {
        &self.0
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn destroy(&self) {
        self.1.destroyed.lock().push("cq");
    }
}

struct TestQp(Arc<Log>, Arc<dyn EventSink>);
impl ProviderQp for TestQp {
    fn qp_num(&self) -> u32 {
        7
    }
    fn modify(&self, _a: &QpAttr, _m: QpAttrMask) -> Result<()> {
        Ok(())
    }
    fn query(&self) -> QpAttr {
        QpAttr::default()
    }
    fn doorbell(&self) {
        // Raise an event per doorbell, to exercise the event queue bound.
        self.1.deliver(Event::new(EventKind::SqDrained));
    }
    fn disconnect(&self, _a: bool) -> Result<()> {
        Ok(())
    }
    fn destroy(&self) {
        self.0.destroyed.lock().push("qp");
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Provider for TestDev {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }
    fn port(&self, _p: u8) -> Result<PortAttr> {
        Ok(PortAttr {
            state: PortState::Active,
            active_mtu: 1500,
            gids: vec![[0; 16]],
            netdev: "lo".into(),
        })
    }
    fn alloc_pd(&self) -> Result<u32> {
        Ok(self.log.pds.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn dealloc_pd(&self, _pd: u32) {
        self.log.destroyed.lock().push("pd");
    }
    fn create_cq(&self, init: CqInit) -> Result<Arc<dyn ProviderCq>> {
        Ok(Arc::new(TestCq(
            EngineCq::new(init.ring, init.sink, init.stats),
            self.log.clone(),
        )))
    }
    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn ProviderQp>> {
        Ok(Arc::new(TestQp(self.log.clone(), init.sink)))
    }
    fn connect(&self, _qp: &Arc<dyn ProviderQp>, _p: SocketAddr, _c: ConnParam) -> Result<()> {
        Err(VerbsError::Unsupported)
    }
    fn reg_mr(
        &self,
        pd: u32,
        base: u64,
        len: u64,
        access: Access,
        mem: Arc<dyn MemoryAccess>,
    ) -> Result<Arc<Region>> {
        self.mrs.register(pd, base, len, access, mem)
    }
    fn dereg_mr(&self, stag: u32) -> Result<()> {
        self.log.destroyed.lock().push("mr");
        self.mrs.deregister(stag)
    }
    fn listen(
        &self,
        _a: SocketAddr,
        _b: u32,
        _s: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn ProviderListener>> {
        Err(VerbsError::Unsupported)
    }
}

fn kal_with(config: Config) -> (Arc<Kal>, Arc<Log>) {
    let kal = Kal::new(config);
    let log = Arc::new(Log::default());
    let attr = DeviceAttr {
        name: "test0".into(),
        transport: Transport::Iwarp,
        node_guid: 1,
        vendor_id: 0,
        max_qp: 64,
        max_qp_wr: 64,
        max_sge: 4,
        max_inline: 64,
        max_cq: 64,
        max_cqe: 1024,
        max_mr: 64,
        max_mr_size: 1 << 30,
        max_pd: 64,
        max_srq: 0,
        max_srq_wr: 0,
        max_ird: 4,
        max_ord: 4,
        atomics: false,
        memory_windows: false,
        max_ah: 0,
        phys_port_cnt: 1,
        private_data: PrivateDataLimits {
            connect: 56,
            accept: 196,
            reject: 148,
        },
        fast_path: rnicpi::FastPath::Kal,
    };
    // Device 1: one whose fast path is the consumer's (its objects are only mirrored).
    let hw = DeviceAttr {
        name: "hw0".into(),
        memory_windows: true,
        max_ah: 16,
        fast_path: FastPath::Consumer {
            driver: "test".into(),
            device: "hw0".into(),
        },
        ..attr.clone()
    };
    for attr in [attr, hw] {
        kal.register(Arc::new(TestDev {
            attr,
            mrs: MrTable::new(64),
            log: log.clone(),
        }))
        .unwrap();
    }
    (kal, log)
}

fn mirror(
    kal: &Kal,
    ctx: u32,
    dev: u32,
    kind: u32,
    parents: [u32; 4],
    range: (u64, u64),
) -> Result<u32> {
    let mut a = abi::Mirror {
        dev,
        kind,
        parents,
        addr: range.0,
        length: range.1,
        ..Zeroable::zeroed()
    };
    call(kal, ctx, cmd::MIRROR, &mut a).map(|_| a.handle)
}

/// Objects a consumer makes through its own uVP are in the kAL's tree all the same:
/// limits, pin allowance, use counts of parents, `STAT_CONTEXTS`, teardown with the
/// context — and hostile records are refused.
#[test]
fn mirrored_objects_are_accounted_like_the_kals_own() {
    let limits = Limits {
        qps: 1,
        ..Limits::default()
    };
    let (kal, log) = kal_with(Config {
        limits,
        pin_limit: Some(64 << 10),
        ..Config::default()
    });
    let ctx = open(&kal);
    // Not on a device whose fast path is the kAL's, nor of an unknown kind.
    assert_eq!(
        mirror(&kal, ctx, 0, abi::MIRROR_PD, [0; 4], (0, 0)),
        Err(VerbsError::Invalid)
    );
    assert_eq!(
        mirror(&kal, ctx, 1, 99, [0; 4], (0, 0)),
        Err(VerbsError::Invalid)
    );
    let pd = mirror(&kal, ctx, 1, abi::MIRROR_PD, [0; 4], (0, 0)).unwrap();
    let cq = mirror(&kal, ctx, 1, abi::MIRROR_CQ, [0; 4], (0, 0)).unwrap();
    // Parents must be mirrors of the right kind on the same device, and all be given.
    let (kal_pd, (kal_cq, _m)) = (self::pd(&kal, ctx).unwrap(), self::cq(&kal, ctx));
    for bad in [
        [cq, cq, cq, 0],
        [pd, pd, cq, 0],
        [kal_pd, cq, cq, 0],
        [pd, kal_cq, cq, 0],
        [pd, cq, 0, 0],
        [pd, cq, cq, cq],
    ] {
        assert_eq!(
            mirror(&kal, ctx, 1, abi::MIRROR_QP, bad, (0, 0)),
            Err(VerbsError::NoSuchResource),
            "{bad:?}"
        );
    }
    assert_eq!(
        mirror(&kal, ctx, 1, abi::MIRROR_PD, [pd, 0, 0, 0], (0, 0)),
        Err(VerbsError::Invalid)
    );
    let qp = mirror(&kal, ctx, 1, abi::MIRROR_QP, [pd, cq, cq, 0], (0, 0)).unwrap();
    assert_eq!(
        mirror(&kal, ctx, 1, abi::MIRROR_QP, [pd, cq, cq, 0], (0, 0)),
        Err(VerbsError::Exhausted)
    );
    // An MR is charged to the pin allowance (64 KiB here), page-rounded.
    assert_eq!(
        mirror(&kal, ctx, 1, abi::MIRROR_MR, [pd, 0, 0, 0], (0x10000, 0)),
        Err(VerbsError::Invalid)
    );
    let _mr = mirror(
        &kal,
        ctx,
        1,
        abi::MIRROR_MR,
        [pd, 0, 0, 0],
        (0x10000, 48 << 10),
    )
    .unwrap();
    assert_eq!(kal.pinned_total(), 48 << 10);
    assert_eq!(
        mirror(
            &kal,
            ctx,
            1,
            abi::MIRROR_MR,
            [pd, 0, 0, 0],
            (0x40000, 32 << 10)
        ),
        Err(VerbsError::PinLimit)
    );
    // A memory window names its PD (a mirror on the same device), nothing else; not on a
    // device without windows.
    for bad in [[0; 4], [cq, 0, 0, 0], [kal_pd, 0, 0, 0], [pd, cq, 0, 0]] {
        assert!(
            mirror(&kal, ctx, 1, abi::MIRROR_MW, bad, (0, 0)).is_err(),
            "{bad:?}"
        );
    }
    assert_eq!(
        mirror(&kal, ctx, 0, abi::MIRROR_MW, [kal_pd, 0, 0, 0], (0, 0)),
        Err(VerbsError::Invalid)
    );
    let mw = mirror(&kal, ctx, 1, abi::MIRROR_MW, [pd, 0, 0, 0], (0, 0)).unwrap();
    let gone = mirror(&kal, ctx, 1, abi::MIRROR_MW, [pd, 0, 0, 0], (0, 0)).unwrap();
    let mut d = abi::Destroy {
        handle: gone,
        _pad: 0,
    };
    assert_eq!(
        call(&kal, ctx, cmd::DEREG_MR, &mut d),
        Err(VerbsError::NoSuchResource)
    );
    call(&kal, ctx, cmd::DEALLOC_MW, &mut d).unwrap();
    // An address handle names its PD, on a device with address handles; DESTROY_AH.
    assert!(mirror(&kal, ctx, 1, abi::MIRROR_AH, [cq, 0, 0, 0], (0, 0)).is_err());
    assert!(mirror(&kal, ctx, 0, abi::MIRROR_AH, [kal_pd, 0, 0, 0], (0, 0)).is_err());
    let ah = mirror(&kal, ctx, 1, abi::MIRROR_AH, [pd, 0, 0, 0], (0, 0)).unwrap();
    let mut d = abi::Destroy {
        handle: ah,
        _pad: 0,
    };
    call(&kal, ctx, cmd::DESTROY_AH, &mut d).unwrap();
    // The tree: the PD and CQ are busy while the QP, MR and window use them.
    let mut d = abi::Destroy {
        handle: pd,
        _pad: 0,
    };
    assert_eq!(
        call(&kal, ctx, cmd::DEALLOC_PD, &mut d),
        Err(VerbsError::Busy)
    );
    let mut d = abi::Destroy {
        handle: cq,
        _pad: 0,
    };
    assert_eq!(
        call(&kal, ctx, cmd::DESTROY_CQ, &mut d),
        Err(VerbsError::Busy)
    );
    // A mirror answers none of the kAL's own verbs, and is destroyed by its kind's command.
    let mut m = abi::QpAttrs {
        handle: qp,
        ..Zeroable::zeroed()
    };
    assert_eq!(
        call(&kal, ctx, cmd::QUERY_QP, &mut m),
        Err(VerbsError::NoSuchResource)
    );
    let mut d = abi::Destroy {
        handle: qp,
        _pad: 0,
    };
    assert_eq!(
        call(&kal, ctx, cmd::DESTROY_CQ, &mut d),
        Err(VerbsError::NoSuchResource)
    );
    call(&kal, ctx, cmd::DESTROY_QP, &mut d).unwrap();
    let mut st = Box::new(abi::StatContexts::zeroed());
    call(&kal, ctx, cmd::STAT_CONTEXTS, st.as_mut()).unwrap();
    let row = st.rows[..st.count as usize]
        .iter()
        .find(|r| r.id == ctx)
        .unwrap();
    assert_eq!(
        (
            row.pds,
            row.cqs,
            row.qps,
            row.mrs,
            row.mws,
            row.pinned_bytes
        ),
        (2, 2, 0, 1, 1, 48 << 10)
    );
    let _ = mw;
    // The context's end gives everything back; the kAL destroys only its own objects.
    kal.release(ctx);
    assert_eq!(kal.pinned_total(), 0);
    assert_eq!(*log.destroyed.lock(), vec!["cq", "pd"]);
}

fn open(kal: &Kal) -> u32 {
    kal.open(
        Caller {
            pid: std::process::id(),
            uid: 4242,
            gid: 0,
        },
        Arc::new(EmbeddedPeer),
    )
    .unwrap()
}

fn call<T: bytemuck::Pod>(kal: &Kal, ctx: u32, c: u32, a: &mut T) -> Result<()> {
    kal.ioctl(ctx, c, bytemuck::bytes_of_mut(a))
}

fn pd(kal: &Kal, ctx: u32) -> Result<u32> {
    let mut a = abi::AllocPd { dev: 0, handle: 0 };
    call(kal, ctx, cmd::ALLOC_PD, &mut a).map(|_| a.handle)
}

fn cq(kal: &Kal, ctx: u32) -> (u32, SharedMem) {
    let mem = SharedMem::create("t", queue::ring_bytes::<Cqe>(16)).unwrap();
    let mut a = abi::CreateCq {
        dev: 0,
        cqe: 16,
        memfd: mem.fd().as_raw_fd(),
        handle: 0,
        signal: -1,
    };
    call(kal, ctx, cmd::CREATE_CQ, &mut a).unwrap();
    (a.handle, mem)
}

fn qp(kal: &Kal, ctx: u32, pd: u32, cq: u32) -> Result<(u32, SharedMem)> {
    let layout = QpRingLayout::new(8, 8).unwrap();
    let mem = SharedMem::create("q", layout.total).unwrap();
    let mut a = abi::CreateQp {
        pd,
        send_cq: cq,
        recv_cq: cq,
        qp_type: QpType::Rc as u8,
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        memfd: mem.fd().as_raw_fd(),
        doorbell_fd: -1,
        ..Zeroable::zeroed()
    };
    call(kal, ctx, cmd::CREATE_QP, &mut a).map(|_| (a.handle, mem))
}

fn mr(kal: &Kal, ctx: u32, pd: u32, buf: &[u8]) -> Result<abi::RegMr> {
    let mut a = abi::RegMr {
        pd,
        access: Access::LOCAL_WRITE.bits(),
        addr: buf.as_ptr() as u64,
        length: buf.len() as u64,
        ..Zeroable::zeroed()
    };
    call(kal, ctx, cmd::REG_MR, &mut a).map(|_| a)
}

#[test]
fn teardown_is_children_first_and_returns_pins() {
    let (kal, log) = kal_with(Config::default());
    let ctx = open(&kal);
    let p = pd(&kal, ctx).unwrap();
    let (c, _m1) = cq(&kal, ctx);
    let (_q, _m2) = qp(&kal, ctx, p, c).unwrap();
    let buf = vec![0u8; 3 * 4096];
    mr(&kal, ctx, p, &buf).unwrap();
    assert_eq!(
        kal.pinned_total(),
        3 * 4096 + 4096 * !(buf.as_ptr() as usize).is_multiple_of(4096) as u64
    );
    // Parents in use cannot go.
    let mut d = abi::Destroy { handle: p, _pad: 0 };
    assert_eq!(
        call(&kal, ctx, cmd::DEALLOC_PD, &mut d),
        Err(VerbsError::Busy)
    );
    let mut d = abi::Destroy { handle: c, _pad: 0 };
    assert_eq!(
        call(&kal, ctx, cmd::DESTROY_CQ, &mut d),
        Err(VerbsError::Busy)
    );
    kal.release(ctx);
    assert_eq!(*log.destroyed.lock(), vec!["qp", "mr", "cq", "pd"]);
    assert_eq!(kal.pinned_total(), 0);
    assert_eq!(kal.context_count(), 0);
    kal.release(ctx); // idempotent
}

#[test]
fn limits_are_enforced_per_context() {
    let limits = Limits {
        pds: 2,
        ..Limits::default()
    };
    let (kal, _) = kal_with(Config {
        limits,
        ..Config::default()
    });
    let a = open(&kal);
    let b = open(&kal);
    pd(&kal, a).unwrap();
    pd(&kal, a).unwrap();
    assert_eq!(pd(&kal, a), Err(VerbsError::Exhausted));
    pd(&kal, b).unwrap();
}

fn open_as(kal: &Kal, uid: u32) -> Result<u32> {
    kal.open(
        Caller {
            pid: std::process::id(),
            uid,
            gid: uid,
        },
        Arc::new(EmbeddedPeer),
    )
}

fn try_cq(kal: &Kal, ctx: u32) -> Result<(u32, SharedMem)> {
    let mem = SharedMem::create("t", queue::ring_bytes::<Cqe>(16)).unwrap();
    let mut a = abi::CreateCq {
        dev: 0,
        cqe: 16,
        memfd: mem.fd().as_raw_fd(),
        handle: 0,
        signal: -1,
    };
    call(kal, ctx, cmd::CREATE_CQ, &mut a).map(|_| (a.handle, mem))
}

/// Audit H7 through the kAL's `Config` (embedded mode): one user who exhausts their
/// quotas of contexts, PDs and mappings leaves another user served; the device's own
/// limit (`max_pd` 64) holds over all users; what is given back can be taken again.
#[test]
fn quotas_per_user_leave_other_users_served() {
    let mut quota = Quota::PER_USER;
    quota.apply("contexts=2").unwrap();
    quota.apply("pds=3").unwrap();
    quota.apply("mappings=2").unwrap();
    let (kal, _) = kal_with(Config {
        quota,
        ..Config::default()
    });
    let (greedy, other) = (1000, 2000);
    let a = open_as(&kal, greedy).unwrap();
    let _a2 = open_as(&kal, greedy).unwrap();
    assert_eq!(open_as(&kal, greedy), Err(VerbsError::Quota));
    for _ in 0..3 {
        pd(&kal, a).unwrap();
    }
    assert_eq!(pd(&kal, a), Err(VerbsError::Quota));
    let (c1, _m1) = try_cq(&kal, a).unwrap();
    let _c2 = try_cq(&kal, a).unwrap();
    assert_eq!(try_cq(&kal, a).unwrap_err(), VerbsError::Quota);

    let b = open_as(&kal, other).unwrap();
    pd(&kal, b).unwrap();
    let _c3 = try_cq(&kal, b).unwrap();

    // Given back on destroy, and taken again.
    let mut d = abi::Destroy {
        handle: c1,
        _pad: 0,
    };
    call(&kal, a, cmd::DESTROY_CQ, &mut d).unwrap();
    let _c4 = try_cq(&kal, a).unwrap();
    kal.release(a);
    open_as(&kal, greedy).unwrap();

    // The device advertises max_pd 64: with the other user's one, 63 more from
    // users of their own (each within quota) fill it.
    for uid in 0..21 {
        let c = open_as(&kal, 3000 + uid).unwrap();
        for _ in 0..3 {
            pd(&kal, c).unwrap();
        }
    }
    assert_eq!(pd(&kal, b), Err(VerbsError::Exhausted), "device limit");
    let mut s = abi::StatDevice {
        dev: abi::KAL_COUNTERS,
        ..Zeroable::zeroed()
    };
    call(&kal, b, cmd::STAT_DEVICE, &mut s).unwrap();
    let counter = |name: &str| {
        s.rows[..s.count as usize]
            .iter()
            .find(|r| abi::name_to_str(&r.name) == name)
            .map(|r| r.value)
    };
    assert_eq!(counter("quota_refused_contexts"), Some(1));
    assert_eq!(counter("quota_refused_pds"), Some(1));
    assert_eq!(counter("quota_refused_mappings"), Some(1));
    assert_eq!(counter("device_limit_refused"), Some(1));
}

#[test]
fn pin_limit_per_user() {
    let (kal, _) = kal_with(Config {
        pin_limit: Some(8192),
        ..Config::default()
    });
    let ctx = open(&kal);
    let other = open(&kal); // same uid: shares the quota
    let p = pd(&kal, ctx).unwrap();
    let p2 = pd(&kal, other).unwrap();
    let buf = vec![0u8; 16384];
    let base = (buf.as_ptr() as usize).next_multiple_of(4096) - buf.as_ptr() as usize;
    let page = &buf[base..base + 4096];
    mr(&kal, ctx, p, page).unwrap();
    mr(&kal, other, p2, page).unwrap();
    assert_eq!(mr(&kal, ctx, p, page).unwrap_err(), VerbsError::PinLimit);
    kal.release(other);
    mr(&kal, ctx, p, page).unwrap();
}

#[test]
fn registration_checks_the_mapping_and_keys_rotate() {
    let (kal, _) = kal_with(Config::default());
    let ctx = open(&kal);
    let p = pd(&kal, ctx).unwrap();
    let mut a = abi::RegMr {
        pd: p,
        access: Access::LOCAL_WRITE.bits(),
        addr: 4096,
        length: 4096,
        ..Zeroable::zeroed()
    };
    assert_eq!(
        call(&kal, ctx, cmd::REG_MR, &mut a),
        Err(VerbsError::BadAddress)
    );
    a.access = Access::REMOTE_WRITE.bits(); // without LOCAL_WRITE
    assert_eq!(
        call(&kal, ctx, cmd::REG_MR, &mut a),
        Err(VerbsError::Invalid)
    );
    static RO: [u8; 4096] = [0; 4096];
    assert_eq!(
        mr(&kal, ctx, p, &RO).unwrap_err(),
        VerbsError::BadAddress,
        "read-only memory cannot be writable"
    );
    let buf = vec![0u8; 4096];
    let first = mr(&kal, ctx, p, &buf).unwrap();
    let mut d = abi::Destroy {
        handle: first.handle,
        _pad: 0,
    };
    call(&kal, ctx, cmd::DEREG_MR, &mut d).unwrap();
    let second = mr(&kal, ctx, p, &buf).unwrap();
    assert_ne!(first.lkey, second.lkey, "re-registration changes the key");
}

#[test]
fn handles_are_scoped_to_their_context() {
    let (kal, _) = kal_with(Config::default());
    let a = open(&kal);
    let b = open(&kal);
    let p = pd(&kal, a).unwrap();
    for h in 0..1000 {
        let mut d = abi::Destroy { handle: h, _pad: 0 };
        assert_eq!(
            call(&kal, b, cmd::DEALLOC_PD, &mut d),
            Err(VerbsError::NoSuchResource)
        );
    }
    let mut d = abi::Destroy { handle: p, _pad: 0 };
    call(&kal, a, cmd::DEALLOC_PD, &mut d).unwrap();
}

#[test]
fn event_queue_is_bounded_and_overflow_reported() {
    let (kal, _) = kal_with(Config {
        event_queue: 8,
        ..Config::default()
    });
    let ctx = open(&kal);
    let p = pd(&kal, ctx).unwrap();
    let (c, _m) = cq(&kal, ctx);
    let (q, _m2) = qp(&kal, ctx, p, c).unwrap();
    let bell = kal.doorbell_for(ctx, q).unwrap();
    for _ in 0..100 {
        bell.ring();
    }
    let mut buf = vec![0u8; abi::EVENT_SIZE * 64];
    let n = kal.read_events(ctx, &mut buf).unwrap() / abi::EVENT_SIZE;
    assert_eq!(n, 8);
    let last: abi::EventRecord =
        bytemuck::pod_read_unaligned(&buf[7 * abi::EVENT_SIZE..8 * abi::EVENT_SIZE]);
    assert_eq!(last.kind, EventKind::EventOverflow as u16);
    let mut s = abi::StatContexts::zeroed();
    call(&kal, ctx, cmd::STAT_CONTEXTS, &mut s).unwrap();
    assert_eq!(s.rows[0].events_dropped, 93);
    assert_eq!(kal.read_events(ctx, &mut buf).unwrap(), 0);
}

#[test]
fn wrong_sizes_and_unknown_commands_are_refused() {
    let (kal, _) = kal_with(Config::default());
    let ctx = open(&kal);
    let mut small = [0u8; 4];
    assert_eq!(
        kal.ioctl(ctx, cmd::QUERY_ABI, &mut small),
        Err(VerbsError::Invalid)
    );
    assert_eq!(
        kal.ioctl(ctx, 0xdead_beef, &mut small),
        Err(VerbsError::Invalid)
    );
    assert_eq!(
        kal.ioctl(ctx + 100, cmd::QUERY_ABI, &mut small),
        Err(VerbsError::NoSuchResource)
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn hostile_ioctls_never_panic(which in 0usize..cmd::ALL.len(), raw in any::<u32>(), use_raw in any::<bool>(),
                                  bytes in proptest::collection::vec(any::<u8>(), 0..1200)) {
        let (kal, _) = kal_with(Config::default());
        let ctx = open(&kal);
        let _ = pd(&kal, ctx);
        let c = if use_raw { raw } else { cmd::ALL[which].0 };
        let mut arg = bytes.clone();
        if let Some((_, _, size)) = abi::decode(c) {
            if !use_raw { arg.resize(size, 0); }
        }
        if c == cmd::CONNECT && arg.len() >= 32 {
            arg[16..32].copy_from_slice(&ip_to_gid("127.0.0.1".parse().unwrap()));
        }
        let _ = kal.ioctl(ctx, c, &mut arg);
        kal.release(ctx);
        prop_assert_eq!(kal.pinned_total(), 0);
    }
}
