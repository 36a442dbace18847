//! The two ends of the fast path for providers whose engine runs in software
//! (siw, rxe): the consumer's posting/polling end and the engine's completion end.
//!
//! The consumer end ([`UserQp`], [`UserCq`]) is what a uVP does in the consumer
//! process: validate a work request against the QP's limits, write it into the shared
//! ring and ring the doorbell; poll and arm the shared completion ring. No system call
//! is made on this path in embedded mode; in daemon mode the doorbell is one `write`
//! to an eventfd.
//!
//! The engine end ([`EngineCq`]) is what a kVP does: append completions (serialised
//! between the engine's threads), count overflows, and fire the armed notification.

use crate::error::{Result, VerbsError};
use crate::event::{Event, EventKind, EventSink};
use crate::queue::Ring;
use crate::types::{QpCaps, SrqAttr};
use crate::wr::{wc_flags, Cqe, WcStatus, Wqe, WrOpcode, MAX_SGE};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Tells the engine that a QP's rings have new entries.
pub trait Doorbell: Send + Sync {
    fn ring(&self);
}

/// The consumer's view of one QP's send and receive rings.
pub struct UserQp {
    pub qp_num: u32,
    pub caps: QpCaps,
    sq: Mutex<Ring<Wqe>>,
    rq: Mutex<Ring<Wqe>>,
    doorbell: Arc<dyn Doorbell>,
}

impl std::fmt::Debug for UserQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserQp")
            .field("qp_num", &self.qp_num)
            .finish()
    }
}

impl UserQp {
    pub fn new(
        qp_num: u32,
        caps: QpCaps,
        sq: Ring<Wqe>,
        rq: Ring<Wqe>,
        doorbell: Arc<dyn Doorbell>,
    ) -> Self {
        UserQp {
            qp_num,
            caps,
            sq: Mutex::new(sq),
            rq: Mutex::new(rq),
            doorbell,
        }
    }

    fn check(&self, wqe: &Wqe, max_sge: u32) -> Result<()> {
        if wqe.num_sge as u32 > max_sge.min(MAX_SGE as u32) {
            return Err(VerbsError::Invalid);
        }
        if wqe.is_inline()
            && wqe.inline_len > self.caps.max_inline.min(crate::wr::MAX_INLINE as u32)
        {
            return Err(VerbsError::Invalid);
        }
        if wqe.opcode().is_none() {
            return Err(VerbsError::Invalid);
        }
        Ok(())
    }

    /// Post one send-queue work request.
    pub fn post_send(&self, wqe: &Wqe) -> Result<()> {
        self.post_send_batch(std::slice::from_ref(wqe))
    }

    /// Post several send-queue work requests with one doorbell; all or none are queued.
    pub fn post_send_batch(&self, wqes: &[Wqe]) -> Result<()> {
        for w in wqes {
            self.check(w, self.caps.max_send_sge)?;
            if w.opcode() == Some(WrOpcode::Recv) {
                return Err(VerbsError::Invalid);
            }
        }
        {
            let sq = self.sq.lock();
            let used = sq.len().map_err(|_| VerbsError::BadState)?;
            if used as usize + wqes.len() > self.caps.max_send_wr as usize {
                return Err(VerbsError::QueueFull);
            }
            for w in wqes {
                if !sq.push(w).map_err(|_| VerbsError::BadState)? {
                    return Err(VerbsError::QueueFull);
                }
            }
        }
        self.doorbell.ring();
        Ok(())
    }

    /// Post one receive work request.
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        let mut w = *wqe;
        w.opcode = WrOpcode::Recv as u8;
        w.flags &= !crate::wr::send_flags::INLINE;
        self.check(&w, self.caps.max_recv_sge)?;
        {
            let rq = self.rq.lock();
            let used = rq.len().map_err(|_| VerbsError::BadState)?;
            if used >= self.caps.max_recv_wr || !rq.push(&w).map_err(|_| VerbsError::BadState)? {
                return Err(VerbsError::QueueFull);
            }
        }
        self.doorbell.ring();
        Ok(())
    }
}

/// The consumer's view of a shared receive queue's ring. Receives posted here are taken
/// by whichever QP attached to the SRQ gets a message first; no doorbell is needed (the
/// engine looks at the ring when a message arrives).
pub struct UserSrq {
    pub attr: SrqAttr,
    rq: Mutex<Ring<Wqe>>,
}

impl std::fmt::Debug for UserSrq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserSrq").field("attr", &self.attr).finish()
    }
}

impl UserSrq {
    pub fn new(attr: SrqAttr, rq: Ring<Wqe>) -> Self {
        UserSrq {
            attr,
            rq: Mutex::new(rq),
        }
    }

    /// Post one receive work request.
    pub fn post_recv(&self, wqe: &Wqe) -> Result<()> {
        let mut w = *wqe;
        w.opcode = WrOpcode::Recv as u8;
        w.flags = 0;
        if u32::from(w.num_sge) > self.attr.max_sge.min(MAX_SGE as u32) {
            return Err(VerbsError::Invalid);
        }
        let rq = self.rq.lock();
        let used = rq.len().map_err(|_| VerbsError::BadState)?;
        if used >= self.attr.max_wr || !rq.push(&w).map_err(|_| VerbsError::BadState)? {
            return Err(VerbsError::QueueFull);
        }
        Ok(())
    }

    /// Receive requests queued and not yet taken by a QP.
    pub fn len(&self) -> u32 {
        self.rq.lock().len().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The engine's end of a shared receive queue: QPs take receives from it (serialised
/// between their receive threads), and the armed limit fires `SrqLimitReached` once.
pub struct EngineSrq {
    pub pd: u32,
    max_wr: u32,
    max_sge: u32,
    rq: Mutex<Ring<Wqe>>,
    limit: std::sync::atomic::AtomicU32,
    sink: Arc<dyn EventSink>,
}

impl std::fmt::Debug for EngineSrq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSrq").field("pd", &self.pd).finish()
    }
}

impl EngineSrq {
    pub fn new(pd: u32, attr: SrqAttr, rq: Ring<Wqe>, sink: Arc<dyn EventSink>) -> Self {
        EngineSrq {
            pd,
            max_wr: attr.max_wr,
            max_sge: attr.max_sge,
            rq: Mutex::new(rq),
            limit: attr.limit.into(),
            sink,
        }
    }

    /// Take the oldest receive. A slot whose scatter list exceeds the SRQ's shape is
    /// dropped (the consumer wrote it past the uVP's checks) and the next one is tried;
    /// `Err(RingCorrupt)` when the consumer scribbled on the indices.
    pub fn take(&self) -> Result<Option<Wqe>, crate::queue::RingCorrupt> {
        let rq = self.rq.lock();
        let w = loop {
            match rq.pop()? {
                Some(w) if u32::from(w.num_sge) > self.max_sge => {
                    tracing::warn!(wr_id = w.wr_id, "SRQ entry beyond max_sge dropped");
                }
                other => break other,
            }
        };
        let left = rq.len()?;
        drop(rq);
        let limit = self.limit.load(Ordering::Acquire);
        if w.is_some()
            && limit > 0
            && left < limit
            && self
                .limit
                .compare_exchange(limit, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        {
            self.sink.deliver(Event::new(EventKind::SrqLimitReached));
        }
        Ok(w)
    }

    /// Arm the limit event (0 disarms); `Invalid` when it exceeds the SRQ's size.
    pub fn arm(&self, limit: u32) -> Result<()> {
        if limit > self.max_wr {
            return Err(VerbsError::Invalid);
        }
        self.limit.store(limit, Ordering::Release);
        Ok(())
    }

    pub fn attr(&self) -> SrqAttr {
        SrqAttr {
            max_wr: self.max_wr,
            max_sge: self.max_sge,
            limit: self.limit.load(Ordering::Acquire),
        }
    }

    /// Receive requests queued now.
    pub fn len(&self) -> u32 {
        self.rq.lock().len().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The consumer's view of one completion ring.
pub struct UserCq {
    ring: Mutex<Ring<Cqe>>,
}

impl std::fmt::Debug for UserCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserCq").finish()
    }
}

impl UserCq {
    pub fn new(ring: Ring<Cqe>) -> Self {
        UserCq {
            ring: Mutex::new(ring),
        }
    }

    /// Take up to `out.len()` completions; returns how many were written.
    pub fn poll(&self, out: &mut [Cqe]) -> usize {
        let ring = self.ring.lock();
        let mut n = 0;
        while n < out.len() {
            match ring.pop() {
                Ok(Some(c)) => {
                    out[n] = c;
                    n += 1;
                }
                Ok(None) => break,
                Err(_) => {
                    // The engine never corrupts its own producer index; a bad index means
                    // our own consumer index was scribbled on. Resynchronise.
                    ring.clear();
                    break;
                }
            }
        }
        n
    }

    /// Request a notification (a `CqNotify` event) for the next completion, or for the
    /// next solicited/error completion.
    pub fn arm(&self, solicited_only: bool) {
        let how = if solicited_only {
            crate::queue::notify::SOLICITED
        } else {
            crate::queue::notify::NEXT
        };
        self.ring.lock().arm(how);
    }

    pub fn is_empty(&self) -> bool {
        self.ring.lock().is_empty()
    }
}

/// The engine's end of a completion ring.
pub struct EngineCq {
    ring: Mutex<Ring<Cqe>>,
    sink: Arc<dyn EventSink>,
    pushed: AtomicU64,
    overflows: AtomicU64,
}

impl std::fmt::Debug for EngineCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCq")
            .field("pushed", &self.pushed)
            .finish()
    }
}

impl EngineCq {
    pub fn new(ring: Ring<Cqe>, sink: Arc<dyn EventSink>) -> Self {
        EngineCq {
            ring: Mutex::new(ring),
            sink,
            pushed: AtomicU64::new(0),
            overflows: AtomicU64::new(0),
        }
    }

    /// Append a completion. On overflow (or a consumer that corrupted the ring) the
    /// completion is lost, the overflow counted, a `CqError` event raised, and `false`
    /// returned so the caller can move the QP to the error state.
    pub fn push(&self, cqe: Cqe) -> bool {
        let ring = self.ring.lock();
        let ok = matches!(ring.push(&cqe), Ok(true));
        if !ok {
            drop(ring);
            self.overflows.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(wr_id = cqe.wr_id, "completion queue overflow");
            self.sink
                .deliver(Event::new(EventKind::CqError).with_status(libc::EOVERFLOW));
            return false;
        }
        self.pushed.fetch_add(1, Ordering::Relaxed);
        let special = cqe.flags & wc_flags::SOLICITED != 0 || cqe.status != WcStatus::Success as u8;
        if ring.take_notify(special) {
            drop(ring);
            self.sink.deliver(Event::new(EventKind::CqNotify));
        }
        true
    }

    pub fn pushed(&self) -> u64 {
        self.pushed.load(Ordering::Relaxed)
    }
    pub fn overflows(&self) -> u64 {
        self.overflows.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::{ring_bytes, SharedMem};
    use std::sync::atomic::AtomicUsize;

    struct CountBell(AtomicUsize);
    impl Doorbell for CountBell {
        fn ring(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn post_respects_caps() {
        let mem = Arc::new(SharedMem::create("q", 2 * ring_bytes::<Wqe>(4)).unwrap());
        let sq = Ring::attach(mem.clone(), 0, 4).unwrap();
        let rq = Ring::attach(mem.clone(), ring_bytes::<Wqe>(4).div_ceil(64) * 64, 4).unwrap();
        let bell = Arc::new(CountBell(AtomicUsize::new(0)));
        let caps = QpCaps {
            max_send_wr: 2,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline: 16,
        };
        let qp = UserQp::new(7, caps, sq, rq, bell.clone());
        let sge = crate::Sge {
            addr: 1,
            length: 1,
            lkey: 1,
        };
        qp.post_send(&Wqe::new(1, WrOpcode::Send, &[sge])).unwrap();
        assert_eq!(
            qp.post_send(&Wqe::new(2, WrOpcode::Send, &[sge, sge])),
            Err(VerbsError::Invalid)
        );
        qp.post_send(&Wqe::new(3, WrOpcode::Send, &[sge])).unwrap();
        assert_eq!(
            qp.post_send(&Wqe::new(4, WrOpcode::Send, &[sge])),
            Err(VerbsError::QueueFull)
        );
        let big = Wqe::new(5, WrOpcode::Send, &[])
            .with_inline(&[0; 32])
            .unwrap();
        assert_eq!(qp.post_send(&big), Err(VerbsError::Invalid));
        assert_eq!(bell.0.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn srq_shares_receives_and_fires_its_limit_once() {
        let mem = Arc::new(SharedMem::create("s", ring_bytes::<Wqe>(8)).unwrap());
        let events = Arc::new(Mutex::new(Vec::new()));
        let ev2 = events.clone();
        let sink: Arc<dyn EventSink> = Arc::new(move |e: Event| ev2.lock().push(e.kind));
        let attr = SrqAttr {
            max_wr: 8,
            max_sge: 1,
            limit: 0,
        };
        let eng = EngineSrq::new(1, attr, Ring::attach(mem.clone(), 0, 8).unwrap(), sink);
        let user = UserSrq::new(attr, Ring::attach(mem, 0, 8).unwrap());
        let sge = crate::Sge {
            addr: 1,
            length: 1,
            lkey: 1,
        };
        for i in 0..4 {
            user.post_recv(&Wqe::recv(i, &[sge])).unwrap();
        }
        assert_eq!(
            user.post_recv(&Wqe::recv(9, &[sge, sge])),
            Err(VerbsError::Invalid)
        );
        assert_eq!(eng.arm(9), Err(VerbsError::Invalid));
        eng.arm(3).unwrap();
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 0); // 3 left: not below 3
        assert!(events.lock().is_empty());
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 1); // 2 left: fires
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 2);
        assert_eq!(*events.lock(), vec![EventKind::SrqLimitReached]);
        assert_eq!(eng.attr().limit, 0, "disarmed");
        assert_eq!(eng.take().unwrap().unwrap().wr_id, 3);
        assert!(eng.take().unwrap().is_none());
    }

    #[test]
    fn cq_overflow_is_reported() {
        let mem = Arc::new(SharedMem::create("c", ring_bytes::<Cqe>(2)).unwrap());
        let events = Arc::new(Mutex::new(Vec::new()));
        let ev2 = events.clone();
        let sink: Arc<dyn EventSink> = Arc::new(move |e: Event| ev2.lock().push(e.kind));
        let eng = EngineCq::new(Ring::attach(mem.clone(), 0, 2).unwrap(), sink);
        let user = UserCq::new(Ring::attach(mem, 0, 2).unwrap());
        user.arm(false);
        assert!(eng.push(Cqe {
            wr_id: 1,
            ..Default::default()
        }));
        assert!(eng.push(Cqe {
            wr_id: 2,
            ..Default::default()
        }));
        assert!(!eng.push(Cqe {
            wr_id: 3,
            ..Default::default()
        }));
        assert_eq!(
            *events.lock(),
            vec![EventKind::CqNotify, EventKind::CqError]
        );
        let mut out = [Cqe::default(); 4];
        assert_eq!(user.poll(&mut out), 2);
        assert_eq!(eng.overflows(), 1);
    }
}
