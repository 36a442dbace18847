//! The DTO stream's source: a completion queue whose completions become [`DtoEvent`]s.
//!
//! Dequeue and wait poll the ring directly, so a consumer that polls never waits for the
//! event thread. The CQ is armed only when a notification can matter — a thread is
//! waiting, or the SEVD has a descriptor, an AEVD or a callback — and then each burst of
//! completions reaches the SEVD's event-thread handler ([`SevdInner::on_completions`]).

use super::SevdInner;
use crate::ep::{EpAction, EpInner};
use crate::event::{DtoEvent, EpRef, Event};
use crate::ia::Ia;
use crate::status::{FromVerbs, Result};
use parking_lot::{Mutex, RwLock};
use rnicpi::{Cqe, EventKind};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

pub(crate) struct DtoSource {
    pub(crate) cq: Arc<ual::Cq>,
    /// The endpoints completing here, by QP number.
    eps: RwLock<HashMap<u32, Weak<EpInner>>>,
    /// What endpoints must do once the SEVD is unlocked ([`run_deferred`](Self::run_deferred)).
    deferred: Mutex<Vec<(Arc<EpInner>, EpAction)>>,
    /// Endpoints whose graceful disconnect waits for completions taken here: the CQ
    /// stays armed meanwhile.
    pub(crate) closing: AtomicUsize,
}

const BATCH: usize = 16;

/// How [`DtoSource::take`] leaves the CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arm {
    /// Unarmed (a polling consumer).
    No,
    /// Armed for a `CqNotify` event, which reaches the SEVD through the event thread.
    Event,
    /// Armed for the engine to write the SEVD's completion-driven descriptor (the CQ
    /// was created with its socket).
    Signal,
}

impl DtoSource {
    /// `signal`: the socket the engine is to write to for a completion armed with
    /// [`Arm::Signal`].
    pub fn new(
        ia: &Ia,
        queue_size: usize,
        signal: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<DtoSource> {
        let depth = u32::try_from(queue_size).map_err(|_| crate::Error::InvalidQueueSize)?;
        let cq =
            ia.0.ctx
                .create_cq_signalled(ia.dev_index(), depth, signal)
                .it(crate::Error::ResourceQueueSize)?;
        Ok(DtoSource {
            cq,
            eps: RwLock::new(HashMap::new()),
            deferred: Mutex::new(Vec::new()),
            closing: AtomicUsize::new(0),
        })
    }

    /// Route the CQ's events to `sevd` and arm the CQ.
    pub fn listen(&self, sevd: &Arc<SevdInner>) {
        sevd.ia
            .route_events(self.cq.handle, sevd, |s, ev| match ev.kind {
                EventKind::CqNotify => s.on_completions(),
                EventKind::CqError => {
                    s.on_ring_overflow();
                    if let Some(d) = &s.dto {
                        d.break_endpoints();
                    }
                    s.on_completions();
                }
                EventKind::AccessLayerDead => super::Wakeable::wake_dead(s.as_ref()),
                _ => {}
            });
        self.cq.arm(false);
    }

    pub fn attach(&self, qp_num: u32, ep: Weak<EpInner>) {
        self.eps.write().insert(qp_num, ep);
    }

    /// The ring overflowed: completions were lost, so (the verbs rule for a CQ error)
    /// every endpoint completing here goes to Error, and its connection ends.
    fn break_endpoints(&self) {
        let eps: Vec<_> = self.eps.read().values().filter_map(Weak::upgrade).collect();
        for ep in eps {
            ep.break_connection("completion ring overflow");
        }
    }

    /// Whether endpoint actions wait for [`run_deferred`](Self::run_deferred).
    pub fn has_deferred(&self) -> bool {
        !self.deferred.lock().is_empty()
    }

    /// Carry out what completions asked of their endpoints (with no SEVD locked: a
    /// connection's end is queued on another SEVD, and closing calls the provider).
    pub fn run_deferred(&self) {
        let work = std::mem::take(&mut *self.deferred.lock());
        for (ep, action) in work {
            ep.run(action);
        }
    }

    /// Count an endpoint whose graceful close waits here (`+1`), or no longer (`-1`).
    pub fn closing(&self, delta: isize) {
        if delta > 0 {
            self.closing.fetch_add(1, Ordering::AcqRel);
        } else {
            let _ = self
                .closing
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }

    pub fn detach(&self, qp_num: u32) {
        self.eps.write().remove(&qp_num);
    }

    /// Take up to `room` events from the ring into `sink` (event, notifies, wakes a
    /// waiter). Unless `how` is [`Arm::No`] the CQ is left armed, so the next completion
    /// is told of (only worth it when someone may be waiting for a notification): armed,
    /// then looked at once more, until a look after the arm finds nothing (a completion
    /// taken after an arm may have fired it: `before_rearm` runs before the CQ is armed
    /// again, where a signal the fired arm gave is drained).
    pub fn take(
        &self,
        sevd: &SevdInner,
        room: usize,
        how: Arm,
        mut sink: impl FnMut(Event, bool, bool),
        mut before_rearm: impl FnMut(),
    ) {
        let arm = how != Arm::No;
        // (A CQ that cannot signal, a uVP's, is armed for the event after all.)
        let arm_cq = || {
            if how != Arm::Signal || !self.cq.arm_to_signal(false) {
                self.cq.arm(false)
            }
        };
        let mut buf = [Cqe::default(); BATCH];
        let mut left = room;
        // Armed, and nothing taken since.
        let mut armed = false;
        let mut arms = 0u32;
        while left > 0 {
            let n = self.cq.poll(&mut buf[..left.min(BATCH)]);
            if n == 0 {
                if armed || !arm {
                    return;
                }
                // Arm, then look once more: a completion may have landed before the arm.
                if arms > 0 {
                    before_rearm();
                }
                arm_cq();
                armed = true;
                arms += 1;
                continue;
            }
            armed = false;
            for c in &buf[..n] {
                if let Some((ev, notify, wakes)) = self.translate(sevd, c) {
                    sink(ev, notify, wakes);
                    left -= 1;
                }
            }
        }
        if arm {
            arm_cq();
        }
    }

    fn translate(&self, sevd: &SevdInner, c: &Cqe) -> Option<(Event, bool, bool)> {
        let ep = self.eps.read().get(&c.qp_num).and_then(Weak::upgrade);
        let Some(ep) = ep else {
            tracing::debug!(
                qpn = c.qp_num,
                wr_id = c.wr_id,
                "completion of a freed endpoint"
            );
            return None;
        };
        let (done, action) = ep.complete(c);
        if let Some(a) = action {
            self.deferred.lock().push((ep.clone(), a));
        }
        let done = done?;
        let ev = DtoEvent {
            kind: done.kind,
            evd: sevd.obj_ref(),
            ep: EpRef::new(ep.common.id, &ep),
            cookie: done.cookie,
            status: done.status,
            transferred_length: done.length,
            solicited: done.solicited,
            immediate: done.immediate,
        };
        Some((Event::Dto(ev), done.notify, done.wakes))
    }
}
