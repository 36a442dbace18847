//! Protection zones.

use crate::error::Result;
use crate::ia::{next_id, Ia};
use krdma_itapi as it;
use std::sync::Arc;

/// A protection zone (`dat_pz_create`): LMRs, RMRs, endpoints and SRQs in one PZ may
/// work together; nothing crosses PZs.
///
/// ```
/// use krdma_dapl::{Ia, Pz};
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// assert_eq!(pz.ia().id(), ia.id());
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Pz(pub(crate) Arc<PzInner>);

pub struct PzInner {
    pub(crate) id: u64,
    pub(crate) ia: Ia,
    pub(crate) it: it::Pz,
}

impl Pz {
    pub fn create(ia: &Ia) -> Result<Pz> {
        let it = it::Pz::create(ia.core())?;
        Ok(Pz(Arc::new(PzInner {
            id: next_id(),
            ia: ia.clone(),
            it,
        })))
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    /// Objects other than this handle that use the PZ (endpoints, LMRs, RMRs, SRQs).
    pub fn users(&self) -> usize {
        Arc::strong_count(&self.0) - 1
    }
}
