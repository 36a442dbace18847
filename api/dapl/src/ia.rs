//! The interface adapter: a device opened by its DAT name, its attributes, and the
//! IA-wide tables DAT's addressing needs (LMRs by context, service points by port,
//! endpoints by the core's endpoint id).

use crate::error::{Error, Major, Minor, Result};
use crate::evd::{Evd, EvdFlags};
use crate::{ep::EpInner, mem::LmrInner, sp::SpRef};
use krdma_itapi as it;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

/// The prefix of krdma's names in the DAT registry: `krdma-siw0` is device `siw0`.
pub const NAME_PREFIX: &str = "krdma-";

/// DAT API version this provider implements (`u2.0` in `dat.conf`).
pub const DAT_VERSION: (u32, u32) = (2, 0);

/// The IB extension version reported with [`Extension::Ib`] (2.0.9, `dat_ib_extensions.h`).
pub const IB_EXTENSION_VERSION: i32 = 209;

/// Which DAT extension the IA offers (`DAT_EXTENSION`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Extension {
    None = 0,
    /// `dat_ib_extensions.h`: RDMA Write with immediate data, atomics.
    Ib = 1,
}

/// Unique ids of this crate's objects (the C provider maps them to handles).
pub(crate) fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What [`Ia::query`] reports (`DAT_IA_ATTR`).
#[derive(Debug, Clone)]
pub struct IaAttr {
    pub adapter_name: String,
    pub vendor_name: String,
    /// The address peers on this host connect to (`ia_address_ptr`).
    pub address: Option<IpAddr>,
    pub max_eps: u32,
    pub max_dto_per_ep: u32,
    pub max_rdma_read_per_ep_in: u32,
    pub max_rdma_read_per_ep_out: u32,
    pub max_evds: u32,
    pub max_evd_qlen: u32,
    pub max_iov_segments_per_dto: u32,
    pub max_lmrs: u32,
    pub max_lmr_block_size: u64,
    pub max_pzs: u32,
    pub max_message_size: u32,
    pub max_rdma_size: u32,
    pub max_rmrs: u32,
    pub max_srqs: u32,
    pub max_recv_per_srq: u32,
    pub extension: Extension,
    /// Private data a connect / accept / reject carries at most on this transport.
    pub max_private_data: (usize, usize, usize),
    pub transport: it::Transport,
}

/// What a provider reports about itself (`DAT_PROVIDER_ATTR`).
#[derive(Debug, Clone)]
pub struct ProviderAttr {
    pub provider_name: String,
    pub dapl_version: (u32, u32),
    pub max_private_data_size: usize,
    pub srq_supported: bool,
    /// Named attributes consumers look for: `DAT_IB_RDMA_READ` (`"TRUE"`: RDMA Read is
    /// there; dtest runs its read test then), `DAT_IB_TRANSPORT_MTU` (the port's MTU; dtestsrq sizes
    /// its messages by it), `DAT_IB_CMP_AND_SWAP` and `DAT_IB_FETCH_AND_ADD` where the
    /// device has atomics, and what the transport is.
    pub specific: Vec<(String, String)>,
}

/// An interface adapter (`dat_ia_open`): one device, in its own uAL context.
///
/// ```
/// use krdma_dapl::Ia;
///
/// let ia = Ia::open("krdma-siw0")?;           // or plain "siw0"
/// let attr = ia.query();
/// println!("{} at {:?}", attr.adapter_name, attr.address);
/// let provider = ia.provider_attr();
/// assert!(provider.specific.iter().any(|(n, v)| n == "DAT_IB_RDMA_READ" && v == "TRUE"));
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Ia(pub(crate) Arc<IaInner>);

pub struct IaInner {
    pub(crate) id: u64,
    pub(crate) it: it::Ia,
    name: String,
    async_evd: Mutex<Option<Evd>>,
    next_context: AtomicU32,
    pub(crate) lmrs: RwLock<HashMap<u32, Weak<LmrInner>>>,
    pub(crate) sps: Mutex<HashMap<u16, SpRef>>,
    pub(crate) eps: RwLock<HashMap<u64, Weak<EpInner>>>,
}

impl Ia {
    /// Open the IA `name` (`krdma-<device>` or the device name) on the front door
    /// `KRDMA_DEVICE` selects.
    pub fn open(name: &str) -> Result<Ia> {
        Self::open_on(&ual::Target::from_env(), name)
    }

    /// Open `name` on a given front door.
    pub fn open_on(target: &ual::Target, name: &str) -> Result<Ia> {
        let dev = name.strip_prefix(NAME_PREFIX).unwrap_or(name);
        let it = it::Ia::open_on(target, dev).map_err(|e| match e {
            it::Error::InvalidName => Error::new(Major::ProviderNotFound, Minor::NameNotRegistered),
            other => other.into(),
        })?;
        let ia = Ia(Arc::new(IaInner {
            id: next_id(),
            it,
            name: name.to_string(),
            async_evd: Mutex::new(None),
            next_context: AtomicU32::new(1),
            lmrs: RwLock::new(HashMap::new()),
            sps: Mutex::new(HashMap::new()),
            eps: RwLock::new(HashMap::new()),
        }));
        tracing::info!(id = ia.id(), name, "DAT IA opened");
        Ok(ia)
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The name it was opened by.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The common core's adapter underneath.
    pub fn core(&self) -> &it::Ia {
        &self.0.it
    }

    /// The IA's asynchronous-error EVD, created at the first call (`qlen` events).
    /// `ia_open` makes one when the consumer passes none.
    pub fn async_evd(&self, qlen: usize) -> Result<Evd> {
        let mut slot = self.0.async_evd.lock();
        if let Some(e) = slot.as_ref() {
            return Ok(e.clone());
        }
        let evd = Evd::create(self, qlen.max(1), None, EvdFlags::ASYNC)?;
        *slot = Some(evd.clone());
        Ok(evd)
    }

    /// Raise an asynchronous event on the IA's async EVD (if it has one).
    pub(crate) fn post_async(&self, ev: crate::AsyncEvent) {
        if let Some(e) = self.current_async_evd() {
            e.0.raise(ev);
        }
    }

    /// The asynchronous EVD, if one exists.
    pub fn current_async_evd(&self) -> Option<Evd> {
        self.0.async_evd.lock().clone()
    }

    /// Forget the async EVD (the consumer frees it).
    pub fn release_async_evd(&self, evd: &Evd) {
        let mut slot = self.0.async_evd.lock();
        if slot.as_ref().is_some_and(|e| e.id() == evd.id()) {
            *slot = None;
        }
    }

    pub fn query(&self) -> IaAttr {
        let info = self.0.it.query();
        let l = &info.limits;
        let ib = info.transport == it::Transport::InfiniBand;
        IaAttr {
            adapter_name: info.name.clone(),
            vendor_name: "krdma".into(),
            address: self.0.it.local_address(),
            max_eps: l.max_endpoints,
            max_dto_per_ep: l.max_dtos,
            max_rdma_read_per_ep_in: l.max_ird,
            max_rdma_read_per_ep_out: l.max_ord,
            max_evds: l.max_evd_queue.min(65536),
            max_evd_qlen: l.max_evd_queue.min(crate::evd::MAX_QLEN as u32),
            max_iov_segments_per_dto: l.max_segments,
            max_lmrs: l.max_lmrs,
            max_lmr_block_size: l.max_lmr_length,
            max_pzs: 1 << 16,
            max_message_size: 1 << 30,
            max_rdma_size: 1 << 30,
            max_rmrs: if info.rmr_support { l.max_lmrs } else { 0 },
            max_srqs: l.max_srqs,
            max_recv_per_srq: l.max_srq_dtos,
            extension: if ib && info.atomic_support {
                Extension::Ib
            } else {
                Extension::None
            },
            max_private_data: (
                info.connect_private_data_len,
                info.accept_private_data_len,
                info.reject_private_data_len,
            ),
            transport: info.transport,
        }
    }

    pub fn provider_attr(&self) -> ProviderAttr {
        let info = self.0.it.query();
        let transport = match info.transport {
            it::Transport::IwarpTcp => "iWARP",
            it::Transport::InfiniBand => "RoCEv2",
        };
        let mtu = info.spigots.first().map_or(1024, |s| s.mtu);
        let mut specific: Vec<(String, String)> = [
            ("DAT_IB_RDMA_READ", "TRUE".to_string()),
            ("DAT_IB_TRANSPORT_MTU", mtu.to_string()),
            ("KRDMA_TRANSPORT", transport.to_string()),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
        if info.atomic_support {
            // dtestx runs its atomic tests only where these say so.
            for name in ["DAT_IB_CMP_AND_SWAP", "DAT_IB_FETCH_AND_ADD"] {
                specific.push((name.to_string(), "TRUE".to_string()));
            }
        }
        ProviderAttr {
            provider_name: format!("{NAME_PREFIX}{}", info.name),
            dapl_version: DAT_VERSION,
            max_private_data_size: info.connect_private_data_len,
            srq_supported: info.srq_support,
            specific,
        }
    }

    /// A fresh LMR context number (never 0).
    pub(crate) fn new_lmr_context(&self) -> u32 {
        loop {
            let c = self.0.next_context.fetch_add(1, Ordering::Relaxed);
            if c != 0 {
                return c;
            }
        }
    }

    pub(crate) fn register_lmr(&self, context: u32, lmr: &Arc<LmrInner>) {
        self.0.lmrs.write().insert(context, Arc::downgrade(lmr));
    }

    pub(crate) fn forget_lmr(&self, context: u32) {
        self.0.lmrs.write().remove(&context);
    }

    pub(crate) fn lmr_by_context(&self, context: u32) -> Option<Arc<LmrInner>> {
        self.0.lmrs.read().get(&context).and_then(Weak::upgrade)
    }

    pub(crate) fn ep_by_core_id(&self, id: u64) -> Option<Arc<EpInner>> {
        self.0.eps.read().get(&id).and_then(Weak::upgrade)
    }
}

impl Drop for IaInner {
    fn drop(&mut self) {
        tracing::info!(id = self.id, name = %self.name, "DAT IA closed");
    }
}
