//! Shared receive queues: receives posted once, taken by whichever endpoint on the SRQ
//! gets a message first.

use crate::ep::post::post_receive;
use crate::ep::{DtoFlags, Queue, WrTable};
use crate::event::{AffiliatedCause, AffiliatedEvent, Event, EventNumber};
use crate::lmr::Segment;
use crate::object::{object_accessors, Common, UseGuard};
use crate::pz::Pz;
use crate::status::{Error, FromVerbs, Result};
use parking_lot::Mutex;
use rnicpi::EventKind;
use std::sync::Arc;

/// A shared receive queue (`it_srq_create`). Endpoints created with it take their
/// receives from it; completions still go to each endpoint's receive SEVD.
///
/// ```
/// use krdma_itapi::*;
/// use ual::RegBuf;
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// let srq = Srq::create(&pz, 1, 256)?;
/// let lmr = Lmr::create(&pz, RegBuf::new(256 * 4096).unwrap(), MemPriv::LOCAL)?;
/// for i in 0..256u64 {
///     srq.post_recv(&[lmr.segment(i * 4096, 4096)?], i, DtoFlags::SIGNALED)?;
/// }
/// srq.set_low_watermark(16)?; // IT_ASYNC_AFF_SRQ_LOW_WATERMARK below 16
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Srq(pub(crate) Arc<SrqInner>);

object_accessors!(Srq);

pub struct SrqInner {
    pz: Pz,
    pub(crate) srq: Arc<ual::Srq>,
    pub(crate) wrs: Mutex<WrTable>,
    max_recv_segments: usize,
    _pz_use: UseGuard,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

/// What [`Srq::query`] reports (`it_srq_param_t`).
#[derive(Debug, Clone)]
pub struct SrqParams {
    pub ia: u64,
    pub pz: u64,
    pub max_recv_dtos: usize,
    pub max_recv_segments: usize,
    /// 0 when not armed (or once the event fired).
    pub low_watermark: usize,
}

impl Srq {
    pub fn create(pz: &Pz, max_recv_segments: usize, max_recv_dtos: usize) -> Result<Srq> {
        let ia = &pz.0.ia;
        ia.check_alive()?;
        let l = ia.limits();
        if l.max_srqs == 0 {
            return Err(Error::SrqNotSupported);
        }
        if max_recv_dtos == 0 || max_recv_dtos > l.max_srq_dtos as usize {
            return Err(Error::InvalidSrqSize);
        }
        if max_recv_segments == 0 || max_recv_segments > l.max_segments as usize {
            return Err(Error::ResourceRseg);
        }
        let srq =
            ia.0.ctx
                .create_srq(&pz.0.pd, max_recv_dtos as u32, max_recv_segments as u32)
                .it(Error::InvalidSrqSize)?;
        let inner = Arc::new(SrqInner {
            common: Common::new(),
            pz: pz.clone(),
            srq,
            wrs: Mutex::new(WrTable::default()),
            max_recv_segments,
            _pz_use: pz.0.common.use_guard(),
        });
        ia.route_events(inner.srq.handle, &inner, |s, ev| s.on_event(ev.kind));
        tracing::debug!(id = inner.common.id, max_recv_dtos, "SRQ created");
        Ok(Srq(inner))
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    /// Post a receive (see [`Endpoint::post_recv`](crate::Endpoint::post_recv)).
    pub fn post_recv(&self, segs: &[Segment], cookie: u64, flags: DtoFlags) -> Result<()> {
        post_receive(
            &self.0.wrs,
            Queue::Srq,
            segs,
            self.0.max_recv_segments,
            cookie,
            flags,
            |w| self.0.srq.post_recv(w),
        )
    }

    /// Arm the low watermark: one `IT_ASYNC_AFF_SRQ_LOW_WATERMARK` event once fewer
    /// than `n` receives are left (0 disarms).
    pub fn set_low_watermark(&self, n: usize) -> Result<()> {
        let n = u32::try_from(n).map_err(|_| Error::InvalidWatermark)?;
        self.0.srq.arm_limit(n).it(Error::InvalidWatermark)
    }

    pub fn query(&self) -> Result<SrqParams> {
        let a = self.0.srq.query().it(Error::InvalidSrq)?;
        Ok(SrqParams {
            ia: self.0.pz.0.ia.id(),
            pz: self.0.pz.id(),
            max_recv_dtos: a.max_wr as usize,
            max_recv_segments: a.max_sge as usize,
            low_watermark: a.limit as usize,
        })
    }
}

impl SrqInner {
    fn on_event(self: &Arc<Self>, kind: EventKind) {
        let number = match kind {
            EventKind::SrqLimitReached => EventNumber::AsyncAffSrqLowWatermark,
            EventKind::SrqError => EventNumber::AsyncAffEpSrqError,
            _ => return,
        };
        let id = self.common.id;
        self.pz.0.ia.post_affiliated(|evd| {
            Event::Affiliated(AffiliatedEvent {
                number,
                evd,
                cause: AffiliatedCause::Srq(id),
            })
        });
    }
}
