//! Protection zones: the verbs protection domain under an IT-API name.

use crate::ia::Ia;
use crate::object::{object_accessors, Common};
use crate::status::{Error, FromVerbs, Result};
use std::sync::Arc;

/// A protection zone: endpoints, LMRs, RMRs and SRQs of one zone may work together;
/// those of different zones may not.
///
/// ```
/// use krdma_itapi::{Ia, Pz};
///
/// let ia = Ia::open("siw0")?;
/// let pz = Pz::create(&ia)?;
/// assert_eq!(pz.ia().id(), ia.id());
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Pz(pub(crate) Arc<PzInner>);

object_accessors!(Pz);

pub struct PzInner {
    pub(crate) ia: Ia,
    pub(crate) pd: Arc<ual::Pd>,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

impl Pz {
    pub fn create(ia: &Ia) -> Result<Pz> {
        ia.check_alive()?;
        let pd = ia.0.ctx.alloc_pd(ia.dev_index()).it(Error::Resources)?;
        let inner = PzInner {
            common: Common::new(),
            ia: ia.clone(),
            pd,
        };
        tracing::debug!(id = inner.common.id, ia = ia.id(), "PZ created");
        Ok(Pz(Arc::new(inner)))
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    pub(crate) fn same_ia(&self, ia: &Ia) -> bool {
        self.0.ia.id() == ia.id()
    }
}
