//! Shared receive queues.

use crate::error::{Error, Result};
use crate::ia::next_id;
use crate::mem::{segments, LmrTriplet};
use crate::pz::Pz;
use krdma_itapi as it;
use std::sync::Arc;

/// A shared receive queue (`dat_srq_create`): endpoints created with it
/// ([`Ep::create`](crate::Ep::create) with `Some(srq)`) take their receives from it;
/// each endpoint's receive completions still go to its own receive EVD.
///
/// ```
/// use krdma_dapl::*;
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// let srq = Srq::create(&pz, 64, 1)?;
/// let lmr = Lmr::create(&pz, ual::RegBuf::new(4096).unwrap(), MemPriv::LOCAL_WRITE)?;
/// srq.post_recv(&[lmr.triplet(0, 4096)?], 1)?;
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Srq(pub(crate) Arc<SrqInner>);

pub struct SrqInner {
    pub(crate) id: u64,
    pz: Pz,
    pub(crate) it: it::Srq,
    max_recv_dtos: usize,
    max_recv_iov: usize,
}

impl Srq {
    pub fn create(pz: &Pz, max_recv_dtos: usize, max_recv_iov: usize) -> Result<Srq> {
        let it =
            it::Srq::create(&pz.0.it, max_recv_iov.max(1), max_recv_dtos.max(1)).map_err(|e| {
                match e {
                    it::Error::SrqNotSupported | it::Error::OpNotSupported => {
                        Error::not_implemented()
                    }
                    other => other.into(),
                }
            })?;
        Ok(Srq(Arc::new(SrqInner {
            id: next_id(),
            pz: pz.clone(),
            it,
            max_recv_dtos,
            max_recv_iov,
        })))
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn pz(&self) -> &Pz {
        &self.0.pz
    }

    /// (max_recv_dtos, max_recv_iov) as created.
    pub fn limits(&self) -> (usize, usize) {
        (self.0.max_recv_dtos, self.0.max_recv_iov)
    }

    pub fn post_recv(&self, iov: &[LmrTriplet], cookie: u64) -> Result<()> {
        let segs = segments(&self.0.pz, iov)?;
        self.0
            .it
            .post_recv(&segs, cookie, it::DtoFlags::SIGNALED)
            .map_err(Error::from)
    }

    /// Arm the low-watermark event.
    pub fn set_low_watermark(&self, n: usize) -> Result<()> {
        self.0.it.set_low_watermark(n).map_err(|e| match e {
            it::Error::InvalidWatermark => Error::arg(2),
            other => other.into(),
        })
    }

    /// Endpoints using the SRQ.
    pub fn users(&self) -> usize {
        Arc::strong_count(&self.0) - 1
    }
}
