//! System call management: decode, validate and execute one ioctl command.
//!
//! Over 600 lines: one exhaustive match over every command, so each command's checks
//! stand in one place.

use crate::abi::{self, Command};
use crate::context::{ConnAccount, ConnWatch, Context, Kind, Object};
use crate::counters::Counters;
use crate::cq_signal::CqSignal;
use crate::creds::{cap, Requester};
use crate::events::ObjectSink;
use crate::quota::{Charges, Resource};
use crate::{peer, pin, Kal};
use rnicpi::queue::{ring_bytes, ring_capacity};
use rnicpi::{
    Access, ConnParam, CqInit, Cqe, FastPath, QpAttrMask, QpCaps, QpInit, QpRingLayout, QpType,
    Result, Ring, SharedMem, SrqAttr, SrqInit, VerbsError, Wqe,
};
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Charge each `(resource, amount)` to the caller (verbs objects to device `dev` too):
/// all or nothing.
fn charge(kal: &Kal, c: &Context, dev: Option<u32>, items: &[(Resource, u64)]) -> Result<Charges> {
    let mut charges = Charges::default();
    for &(r, n) in items {
        charges.push(kal.charge(c.caller.uid, dev, r, n)?);
    }
    Ok(charges)
}

/// What an object living in a ring costs: the object, and the daemon's mapping of it.
fn ring_object(kind: Resource, bytes: usize) -> [(Resource, u64); 3] {
    [
        (kind, 1),
        (Resource::Mapping, 1),
        (Resource::MappedBytes, bytes as u64),
    ]
}

/// The caller's descriptor `fd` as the memory of a ring of `len` bytes: a memfd sealed
/// against shrinking, growing and sealing, or nothing (counted).
fn ring_memory(kal: &Kal, c: &Context, fd: i32, len: usize) -> Result<Arc<SharedMem>> {
    match SharedMem::from_fd(c.peer.take_fd(fd)?, len) {
        Ok(m) => Ok(Arc::new(m)),
        Err(e) => {
            kal.refusals.ring_memory.fetch_add(1, Ordering::Relaxed);
            rnicpi::warn_limited!(ctx = c.id, error = %e, "ring memory refused");
            Err(e.into())
        }
    }
}

/// The caller's descriptor `fd` as a CQ's signal socket (-1: none).
fn cq_signal(kal: &Kal, c: &Context, fd: i32) -> Result<Option<CqSignal>> {
    if fd == -1 {
        return Ok(None);
    }
    let sock = c.peer.take_fd(fd)?;
    let uid = c
        .peer
        .creds()
        .map_or_else(|| nix::unistd::geteuid().as_raw(), |cr| cr.euid());
    match crate::cq_signal::verify(sock.as_fd(), uid) {
        Ok(()) => Ok(Some(CqSignal::new(sock, kal.signals.clone()))),
        Err(e) => {
            kal.refusals.cq_signal.fetch_add(1, Ordering::Relaxed);
            rnicpi::warn_limited!(ctx = c.id, error = %e, "CQ signal socket refused");
            Err(e.into())
        }
    }
}

/// What a connection costs the caller: the connection and the provider's threads for it.
fn connection(kal: &Kal, c: &Context, dev: u32) -> Result<Charges> {
    let threads = kal.device(dev)?.threads_per_connection();
    let mut items = vec![(Resource::Connection, 1)];
    if threads > 0 {
        items.push((Resource::Thread, u64::from(threads)));
    }
    charge(kal, c, Some(dev), &items)
}

fn pdata(buf: &[u8], len: u32) -> Result<Vec<u8>> {
    buf.get(..len as usize)
        .map(<[u8]>::to_vec)
        .ok_or(VerbsError::Invalid)
}

/// Decode command `nr` with argument `arg`, execute it, and write the argument struct back
/// (only on success).
pub fn ioctl(kal: &Kal, c: &Arc<Context>, who: &Requester, nr: u32, arg: &mut [u8]) -> Result<()> {
    let mut command = Command::decode(nr, arg).ok_or(VerbsError::Invalid)?;
    execute(kal, c, who, &mut command)?;
    arg.copy_from_slice(command.arg_bytes());
    Ok(())
}

fn execute(kal: &Kal, c: &Arc<Context>, who: &Requester, command: &mut Command) -> Result<()> {
    match command {
        Command::QueryAbi(a) => {
            a.version = abi::ABI_VERSION;
            a.event_size = abi::EVENT_SIZE as u32;
            a.context = c.id;
            Ok(())
        }
        Command::ListDevices(a) => {
            let devs = kal.devices();
            a.count = devs.len() as u32;
            for (slot, d) in a.names.iter_mut().zip(&devs) {
                *slot = abi::str_to_name(&d.attr().name);
            }
            Ok(())
        }
        Command::QueryDevice(a) => query_device(kal, a),
        Command::QueryPort(a) => query_port(kal, a),
        Command::AllocPd(a) => {
            let dev = kal.device(a.dev)?;
            let mut objs = c.objects.lock();
            objs.check_limit(Kind::Pd, &kal.config.limits)?;
            let charges = charge(kal, c, Some(a.dev), &[(Resource::Pd, 1)])?;
            let h = objs.next_handle()?;
            let pd = dev.alloc_pd()?;
            objs.insert(
                h,
                Object::Pd {
                    dev: a.dev,
                    pd,
                    users: 0,
                },
                charges,
            );
            a.handle = h;
            Ok(())
        }
        Command::CreateCq(a) => create_cq(kal, c, a),
        Command::CreateQp(a) => create_qp(kal, c, a),
        Command::ModifyQp(a) => {
            c.doorbells.serve_all();
            let (attr, mask) = a.decode().ok_or(VerbsError::Invalid)?;
            let (_, qp) = c.objects.lock().qp(a.handle)?;
            qp.modify(&attr, mask)
        }
        Command::QueryQp(a) => {
            let (_, qp) = c.objects.lock().qp(a.handle)?;
            *a = abi::QpAttrs::encode(a.handle, &qp.query(), QpAttrMask::empty());
            Ok(())
        }
        Command::RegMr(a) => reg_mr(kal, c, a),
        Command::CreateSrq(a) => create_srq(kal, c, a),
        Command::ModifySrq(a) => {
            let (_, _, srq) = c.objects.lock().srq(a.handle)?;
            srq.engine().arm(a.limit)
        }
        Command::QuerySrq(a) => {
            let (_, _, srq) = c.objects.lock().srq(a.handle)?;
            let at = srq.engine().attr();
            (a.max_wr, a.max_sge, a.limit) = (at.max_wr, at.max_sge, at.limit);
            Ok(())
        }
        Command::AllocMw(a) => {
            let pd = a.pd;
            (a.handle, a.rkey) = pd_child(kal, c, (pd, Kind::Mw, Resource::Mw), |d, n, p| {
                let key = d.alloc_mw(p)?;
                Ok((key, Object::Mw { dev: n, pd, key }))
            })?;
            Ok(())
        }
        Command::CreateAh(a) => {
            let (pd, attr) = (a.pd, a.decode());
            (a.handle, a.ah_num) = pd_child(kal, c, (pd, Kind::Ah, Resource::Ah), |d, n, p| {
                let ah = d.create_ah(p, &attr)?;
                Ok((ah, Object::Ah { dev: n, pd, ah }))
            })?;
            Ok(())
        }
        Command::DeallocPd(a) => destroy(kal, c, a.handle, Kind::Pd),
        Command::DestroyCq(a) => destroy(kal, c, a.handle, Kind::Cq),
        Command::DestroyQp(a) => destroy(kal, c, a.handle, Kind::Qp),
        Command::DeregMr(a) => destroy(kal, c, a.handle, Kind::Mr),
        Command::DestroyListen(a) => destroy(kal, c, a.handle, Kind::Listener),
        Command::DestroySrq(a) => destroy(kal, c, a.handle, Kind::Srq),
        Command::DeallocMw(a) => destroy(kal, c, a.handle, Kind::Mw),
        Command::DestroyAh(a) => destroy(kal, c, a.handle, Kind::Ah),
        Command::Listen(a) => {
            let dev = kal.device(a.dev)?;
            may_bind(kal, who, a.port)?;
            let mut objs = c.objects.lock();
            objs.check_limit(Kind::Listener, &kal.config.limits)?;
            let charges = charge(kal, c, Some(a.dev), &[(Resource::Listener, 1)])?;
            let h = objs.next_handle()?;
            let addr = rnicpi::sockaddr_from_parts(a.addr, a.port);
            let l = dev.listen(
                addr,
                a.backlog.clamp(1, 4096),
                ObjectSink::bound(&c.events, h),
            )?;
            a.port = l.local_addr().port();
            objs.insert(
                h,
                Object::Listener {
                    dev: a.dev,
                    listener: l,
                },
                charges,
            );
            a.handle = h;
            Ok(())
        }
        Command::Connect(a) => {
            let (dev, qp, conn) = c.objects.lock().qp_conn(a.qp)?;
            let param = ConnParam {
                private_data: pdata(&a.pdata, a.pdata_len)?,
                ird: a.ird,
                ord: a.ord,
            };
            let half_open = charge(kal, c, None, &[(Resource::HalfOpen, 1)])?;
            let peer = rnicpi::sockaddr_from_parts(a.addr, a.port);
            if conn.is_datagram() {
                conn.begin_resolution(half_open);
                return kal
                    .device(dev)?
                    .connect(&qp, peer, param)
                    .inspect_err(|_| conn.abandon_resolution());
            }
            conn.begin(connection(kal, c, dev)?, Some(half_open))?;
            kal.device(dev)?
                .connect(&qp, peer, param)
                .inspect_err(|_| conn.abandon())
        }
        Command::Accept(a) => {
            let (ldev, l, qdev, qp, conn) = {
                let objs = c.objects.lock();
                let (ldev, l) = objs.listener(a.listen)?;
                let (qdev, qp, conn) = objs.qp_conn(a.qp)?;
                (ldev, l, qdev, qp, conn)
            };
            if ldev != qdev {
                return Err(VerbsError::Invalid);
            }
            let param = ConnParam {
                private_data: pdata(&a.pdata, a.pdata_len)?,
                ird: a.ird,
                ord: a.ord,
            };
            if conn.is_datagram() {
                return l.accept(a.conn_id, &qp, param);
            }
            conn.begin(connection(kal, c, qdev)?, None)?;
            l.accept(a.conn_id, &qp, param)
                .inspect_err(|_| conn.abandon())
        }
        Command::Reject(a) => {
            let (_, l) = c.objects.lock().listener(a.listen)?;
            l.reject(a.conn_id, &pdata(&a.pdata, a.pdata_len)?)
        }
        Command::Disconnect(a) => {
            let (_, qp) = c.objects.lock().qp(a.qp)?;
            qp.disconnect(a.abortive != 0)
        }
        Command::StatContexts(a) => {
            stat_contexts(kal, who, a);
            Ok(())
        }
        Command::StatDevice(a) => stat_device(kal, a),
        Command::Mirror(a) => mirror(kal, c, a),
    }
}

fn query_device(kal: &Kal, a: &mut abi::QueryDevice) -> Result<()> {
    let dev = kal.device(a.dev)?;
    *a = abi::QueryDevice::encode(a.dev, dev.attr());
    Ok(())
}

fn query_port(kal: &Kal, a: &mut abi::QueryPort) -> Result<()> {
    let dev = kal.device(a.dev)?;
    if a.port == 0 || a.port > dev.attr().phys_port_cnt {
        return Err(VerbsError::Invalid);
    }
    a.set(&dev.port(a.port)?);
    Ok(())
}

fn create_cq(kal: &Kal, c: &Arc<Context>, a: &mut abi::CreateCq) -> Result<()> {
    let dev = kal.device(a.dev)?;
    if a.cqe == 0 || a.cqe > dev.attr().max_cqe {
        return Err(VerbsError::Invalid);
    }
    let cap = ring_capacity(a.cqe).ok_or(VerbsError::Invalid)?;
    let len = ring_bytes::<Cqe>(cap);
    let mut objs = c.objects.lock();
    objs.check_limit(Kind::Cq, &kal.config.limits)?;
    let charges = charge(kal, c, Some(a.dev), &ring_object(Resource::Cq, len))?;
    let mem = ring_memory(kal, c, a.memfd, len)?;
    let signal = cq_signal(kal, c, a.signal)?;
    let ring = Ring::attach(mem, 0, cap)?.producer();
    let h = objs.next_handle()?;
    let cq = dev.create_cq(CqInit {
        depth: cap,
        ring,
        sink: ObjectSink::with_signal(&c.events, h, signal),
        stats: kal.ring_stats.clone(),
    })?;
    objs.insert(
        h,
        Object::Cq {
            dev: a.dev,
            cq,
            users: 0,
        },
        charges,
    );
    a.cqe = cap;
    a.handle = h;
    Ok(())
}

fn create_qp(kal: &Kal, c: &Arc<Context>, a: &mut abi::CreateQp) -> Result<()> {
    let mut objs = c.objects.lock();
    let (dev_no, pd) = objs.pd(a.pd)?;
    let (scq_dev, send_cq) = objs.cq(a.send_cq)?;
    let (rcq_dev, recv_cq) = objs.cq(a.recv_cq)?;
    if scq_dev != dev_no || rcq_dev != dev_no {
        return Err(VerbsError::Invalid);
    }
    let srq = match a.srq {
        0 => None,
        h => {
            let (srq_dev, srq_pd, srq) = objs.srq(h)?;
            if srq_dev != dev_no || srq_pd != a.pd {
                return Err(VerbsError::Invalid);
            }
            Some(srq)
        }
    };
    let dev = kal.device(dev_no)?;
    let attr = dev.attr();
    let qp_type = QpType::from_u8(a.qp_type).ok_or(VerbsError::Invalid)?;
    let caps = QpCaps {
        max_send_wr: a.max_send_wr,
        max_recv_wr: a.max_recv_wr,
        max_send_sge: a.max_send_sge,
        max_recv_sge: a.max_recv_sge,
        max_inline: a.max_inline,
    };
    // With an SRQ the QP has no receive queue of its own.
    let recv_ok = match srq {
        Some(_) => caps.max_recv_wr == 0 && caps.max_recv_sge == 0,
        None => (1..=attr.max_qp_wr).contains(&caps.max_recv_wr),
    };
    let ok = (1..=attr.max_qp_wr).contains(&caps.max_send_wr)
        && recv_ok
        && caps.max_send_sge <= attr.max_sge
        && caps.max_recv_sge <= attr.max_sge
        && caps.max_inline <= attr.max_inline;
    if !ok {
        return Err(VerbsError::Invalid);
    }
    objs.check_limit(Kind::Qp, &kal.config.limits)?;
    let layout =
        QpRingLayout::new(caps.max_send_wr, caps.max_recv_wr).ok_or(VerbsError::Invalid)?;
    let doorbell_fd = match (a.doorbell_fd, c.peer.in_process()) {
        (fd, _) if fd >= 0 => Some(doorbell(kal, c, fd)?),
        (_, true) => None,
        (_, false) => return Err(VerbsError::Invalid),
    };
    let charges = charge(
        kal,
        c,
        Some(dev_no),
        &ring_object(Resource::Qp, layout.total),
    )?;
    let mem = ring_memory(kal, c, a.memfd, layout.total)?;
    let sq = Ring::attach(mem.clone(), layout.sq_offset, layout.sq_depth)?.consumer();
    let rq = Ring::attach(mem, layout.rq_offset, layout.rq_depth)?.consumer();
    let h = objs.next_handle()?;
    let conn = Arc::new(match qp_type {
        QpType::Ud => ConnAccount::datagram(),
        QpType::Rc | QpType::Uc => ConnAccount::default(),
    });
    let init = QpInit {
        qp_type,
        pd,
        send_cq,
        recv_cq,
        caps,
        sq,
        rq,
        srq,
        sink: Arc::new(ConnWatch {
            inner: ObjectSink::bound(&c.events, h),
            conn: conn.clone(),
        }),
        stats: kal.ring_stats.clone(),
    };
    let qp = dev.create_qp(init)?;
    let doorbell = match doorbell_fd {
        Some(fd) => {
            let thread = || kal.charge(c.caller.uid, None, Resource::Thread, 1);
            match c.doorbells.add(fd, Arc::downgrade(&qp), thread) {
                Ok(t) => Some(t),
                Err(e) => {
                    qp.destroy();
                    return Err(e);
                }
            }
        }
        None => None,
    };
    a.qp_num = qp.qp_num();
    let obj = Object::Qp {
        dev: dev_no,
        pd: a.pd,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        qp,
        doorbell,
        conn,
    };
    objs.insert(h, obj, charges);
    a.handle = h;
    tracing::debug!(ctx = c.id, handle = h, qp_num = a.qp_num, "QP created");
    Ok(())
}

/// The caller's descriptor `fd` as a doorbell: a non-blocking eventfd, or nothing
/// (counted).
fn doorbell(kal: &Kal, c: &Context, fd: i32) -> Result<std::os::fd::OwnedFd> {
    let fd = c.peer.take_fd(fd)?;
    if let Err(e) = crate::doorbell::verify(fd.as_fd()) {
        kal.refusals.doorbell.fetch_add(1, Ordering::Relaxed);
        rnicpi::warn_limited!(ctx = c.id, error = %e, "doorbell refused");
        return Err(e.into());
    }
    Ok(fd)
}

fn create_srq(kal: &Kal, c: &Arc<Context>, a: &mut abi::CreateSrq) -> Result<()> {
    let mut objs = c.objects.lock();
    let (dev_no, pd) = objs.pd(a.pd)?;
    let dev = kal.device(dev_no)?;
    let d = dev.attr();
    if a.max_wr == 0 || a.max_wr > d.max_srq_wr || a.max_sge > d.max_sge || a.limit > a.max_wr {
        return Err(if d.max_srq == 0 {
            VerbsError::Unsupported
        } else {
            VerbsError::Invalid
        });
    }
    let cap = ring_capacity(a.max_wr).ok_or(VerbsError::Invalid)?;
    let len = ring_bytes::<Wqe>(cap);
    objs.check_limit(Kind::Srq, &kal.config.limits)?;
    let charges = charge(kal, c, Some(dev_no), &ring_object(Resource::Srq, len))?;
    let mem = ring_memory(kal, c, a.memfd, len)?;
    let rq = Ring::attach(mem, 0, cap)?.consumer();
    let h = objs.next_handle()?;
    let srq = dev.create_srq(SrqInit {
        pd,
        attr: SrqAttr {
            max_wr: cap,
            max_sge: a.max_sge,
            limit: a.limit,
        },
        rq,
        sink: ObjectSink::bound(&c.events, h),
        stats: kal.ring_stats.clone(),
    })?;
    let obj = Object::Srq {
        dev: dev_no,
        pd: a.pd,
        srq,
        users: 0,
    };
    objs.insert(h, obj, charges);
    (a.max_wr, a.handle) = (cap, h);
    Ok(())
}

/// How many bytes the caller's user may have pinned: the kAL's configured limit, else
/// the caller's own `RLIMIT_MEMLOCK` (none with `CAP_IPC_LOCK`).
fn pin_limit(kal: &Kal, c: &Context) -> Option<u64> {
    match (kal.config.pin_limit, c.peer.unlimited_pin()) {
        (Some(l), _) => Some(l),
        (None, true) => None,
        (None, false) => c.peer.memlock_limit(),
    }
}

fn reg_mr(kal: &Kal, c: &Arc<Context>, a: &mut abi::RegMr) -> Result<()> {
    let access = Access::from_bits(a.access).ok_or(VerbsError::Invalid)?;
    if !access.is_consistent() {
        return Err(VerbsError::Invalid);
    }
    let mut objs = c.objects.lock();
    let (dev_no, pd) = objs.pd(a.pd)?;
    let dev = kal.device(dev_no)?;
    if a.length == 0 || a.length > dev.attr().max_mr_size {
        return Err(VerbsError::Invalid);
    }
    let span = pin::pinned_span(a.addr, a.length).ok_or(VerbsError::Invalid)?;
    objs.check_limit(Kind::Mr, &kal.config.limits)?;
    let mut charges = charge(kal, c, Some(dev_no), &[(Resource::Mr, 1)])?;
    let h = objs.next_handle()?;
    let writable =
        access.intersects(Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
    let vmas = peer::check_registration(c.peer.as_ref(), a.addr, a.length, writable).map_err(
        |why| {
            if !matches!(why, crate::backing::Refused::Unmapped) {
                Counters::bump(&kal.checks.backing_refused);
            }
            tracing::info!(ctx = c.id, addr = format_args!("{:#x}", a.addr), len = a.length, %why, "registration refused");
            VerbsError::BadAddress
        },
    )?;
    kal.pins.charge(c.caller.uid, span, pin_limit(kal, c))?;
    let mut memory = c.peer.memory_for(&vmas, a.addr, a.length);
    if memory.mapped_bytes() > 0 {
        // Mapped directly into the daemon: charged as a mapping, or, past the quota,
        // reached by copies instead (drops the mapping).
        match charge(
            kal,
            c,
            None,
            &[
                (Resource::Mapping, 1),
                (Resource::MappedBytes, memory.mapped_bytes()),
            ],
        ) {
            Ok(m) => charges.append(m),
            Err(_) => memory = c.peer.memory(),
        }
    }
    let region = match dev.reg_mr(pd, a.addr, a.length, access, memory) {
        Ok(r) => r,
        Err(e) => {
            kal.pins.release(c.caller.uid, span);
            return Err(e);
        }
    };
    a.lkey = region.stag;
    a.rkey = region.stag;
    let obj = Object::Mr {
        dev: dev_no,
        pd: a.pd,
        region,
        pinned: span,
    };
    objs.insert(h, obj, charges);
    a.handle = h;
    Ok(())
}

/// Whether a device has objects of `kind` at all (windows, address handles are optional).
fn offers(attr: &rnicpi::DeviceAttr, kind: Kind) -> bool {
    match kind {
        Kind::Mw => attr.memory_windows,
        Kind::Ah => attr.max_ah > 0,
        _ => true,
    }
}

/// Make a child of PD handle `pd` that its provider names by a number (a window's key,
/// an address handle's number): `Unsupported` where the device has no such objects, the
/// context's limit and the quotas checked, then `make` — given the device, its number
/// and the provider's PD number — gives the number and the object. The new handle and
/// the number.
fn pd_child(
    kal: &Kal,
    c: &Context,
    (pd, kind, resource): (u32, Kind, Resource),
    make: impl FnOnce(&dyn rnicpi::Provider, u32, u32) -> Result<(u32, Object)>,
) -> Result<(u32, u32)> {
    let mut objs = c.objects.lock();
    let (dev_no, provider_pd) = objs.pd(pd)?;
    let dev = kal.device(dev_no)?;
    if !offers(dev.attr(), kind) {
        return Err(VerbsError::Unsupported);
    }
    objs.check_limit(kind, &kal.config.limits)?;
    let charges = charge(kal, c, Some(dev_no), &[(resource, 1)])?;
    let h = objs.next_handle()?;
    let (num, obj) = make(&*dev, dev_no, provider_pd)?;
    objs.insert(h, obj, charges);
    Ok((h, num))
}

/// Record an object the consumer created on a device whose fast path is its own: the same
/// limits, quotas and pin allowance as for an object the kAL creates, and a place in the
/// tree (children before parents on teardown).
fn mirror(kal: &Kal, c: &Arc<Context>, a: &mut abi::Mirror) -> Result<()> {
    let dev = kal.device(a.dev)?;
    if dev.attr().fast_path == FastPath::Kal {
        return Err(VerbsError::Invalid); // its objects are made by CREATE_*, not mirrored
    }
    // What each kind is, its quota, and the kinds of its parents in order.
    let (kind, resource, parents): (Kind, Resource, &[Kind]) = match a.kind {
        abi::MIRROR_PD => (Kind::Pd, Resource::Pd, &[]),
        abi::MIRROR_CQ => (Kind::Cq, Resource::Cq, &[]),
        abi::MIRROR_MR => (Kind::Mr, Resource::Mr, &[Kind::Pd]),
        abi::MIRROR_SRQ => (Kind::Srq, Resource::Srq, &[Kind::Pd]),
        abi::MIRROR_MW => (Kind::Mw, Resource::Mw, &[Kind::Pd]),
        abi::MIRROR_AH => (Kind::Ah, Resource::Ah, &[Kind::Pd]),
        abi::MIRROR_QP => (
            Kind::Qp,
            Resource::Qp,
            &[Kind::Pd, Kind::Cq, Kind::Cq, Kind::Srq],
        ),
        abi::MIRROR_LISTENER => (Kind::Listener, Resource::Listener, &[]),
        _ => return Err(VerbsError::Invalid),
    };
    let mut objs = c.objects.lock();
    for (i, &h) in a.parents.iter().enumerate() {
        match parents.get(i) {
            // A QP's SRQ is optional; every other parent is required.
            Some(Kind::Srq) if kind == Kind::Qp && h == 0 => {}
            Some(&k) => objs.mirror(h, a.dev, k)?,
            None if h == 0 => {}
            None => return Err(VerbsError::Invalid),
        }
    }
    if !offers(dev.attr(), kind) {
        return Err(VerbsError::Unsupported);
    }
    objs.check_limit(kind, &kal.config.limits)?;
    let mut pinned = 0;
    if kind == Kind::Mr {
        if a.length == 0 || a.length > dev.attr().max_mr_size {
            return Err(VerbsError::Invalid);
        }
        pinned = pin::pinned_span(a.addr, a.length).ok_or(VerbsError::Invalid)?;
    }
    let charges = charge(kal, c, Some(a.dev), &[(resource, 1)])?;
    let h = objs.next_handle()?;
    if pinned > 0 {
        kal.pins.charge(c.caller.uid, pinned, pin_limit(kal, c))?;
    }
    let obj = Object::Mirror {
        dev: a.dev,
        kind,
        parents: a.parents,
        pinned,
        users: 0,
    };
    objs.insert(h, obj, charges);
    a.handle = h;
    Ok(())
}

fn destroy(kal: &Kal, c: &Arc<Context>, handle: u32, want: Kind) -> Result<()> {
    // What was posted before goes first (see `Doorbells::serve_all`).
    c.doorbells.serve_all();
    let (obj, charges) = {
        let mut objs = c.objects.lock();
        let o = objs.get(handle)?;
        if o.kind() != want {
            return Err(VerbsError::NoSuchResource);
        }
        if let Object::Pd { users, .. }
        | Object::Cq { users, .. }
        | Object::Srq { users, .. }
        | Object::Mirror { users, .. } = o
        {
            if *users > 0 {
                return Err(VerbsError::Busy);
            }
        }
        objs.remove(handle).ok_or(VerbsError::NoSuchResource)?
    };
    kal.destroy(c, &obj);
    drop(charges); // given back once the object is really gone
    Ok(())
}

/// A LISTEN on a privileged port needs the requester's `CAP_NET_BIND_SERVICE`, as a bind
/// or kernel rdma_cm would (ports below `net.ipv4.ip_unprivileged_port_start`, 1024 by
/// default); the daemon's own right to bind there must not be lent out.
fn may_bind(kal: &Kal, who: &Requester, port: u16) -> Result<()> {
    let start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(1024);
    if port == 0 || u32::from(port) >= start || who.has(cap::NET_BIND_SERVICE) {
        return Ok(());
    }
    Counters::bump(&kal.checks.privileged_port_refused);
    tracing::info!(
        port,
        "LISTEN on a privileged port refused: no CAP_NET_BIND_SERVICE"
    );
    Err(VerbsError::Permission)
}

/// Contexts as `STAT_CONTEXTS` lists them: all of them for root, else only the
/// requester's own user's (other tenants' pids, uids and usage are theirs).
fn stat_contexts(kal: &Kal, who: &Requester, a: &mut abi::StatContexts) {
    let euid = who.euid();
    let ctxs: Vec<Arc<Context>> = kal
        .contexts
        .read()
        .values()
        .filter(|c| euid == 0 || c.caller.uid == euid)
        .cloned()
        .collect();
    a.total = ctxs.len() as u32;
    a.pinned_total = match euid {
        0 => kal.pins.total(),
        uid => kal.pins.of(uid),
    };
    a.count = 0;
    for (row, c) in a.rows.iter_mut().zip(ctxs.iter().skip(a.start as usize)) {
        let objs = c.objects.lock();
        *row = abi::ContextRow {
            id: c.id,
            pid: c.caller.pid,
            uid: c.caller.uid,
            pds: objs.counts.pds,
            cqs: objs.counts.cqs,
            qps: objs.counts.qps,
            mrs: objs.counts.mrs,
            listeners: objs.counts.listeners,
            srqs: objs.counts.srqs,
            mws: objs.counts.mws,
            ahs: objs.counts.ahs,
            _pad: 0,
            pinned_bytes: objs.pinned,
            events_queued: c.events.len() as u32,
            events_dropped: c.events.dropped() as u32,
        };
        a.count += 1;
    }
}

fn stat_device(kal: &Kal, a: &mut abi::StatDevice) -> Result<()> {
    let counters = match a.dev {
        abi::KAL_COUNTERS => kal.counters(),
        dev => kal.device(dev)?.counters(),
    };
    a.total = counters.len() as u32;
    a.count = 0;
    for (row, (name, value)) in a
        .rows
        .iter_mut()
        .zip(counters.iter().skip(a.start as usize))
    {
        *row = abi::CounterRow {
            name: abi::str_to_name(name),
            value: *value,
        };
        a.count += 1;
    }
    Ok(())
}
