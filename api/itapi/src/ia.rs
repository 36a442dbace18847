//! Interface adapters: an RDMA device opened through the uAL, with its spigots (ports),
//! transport and limits, and the IA's two asynchronous event streams.

use crate::evd::{SevdInner, Wakeable};
use crate::event::{EvdRef, Event, EventNumber, EventStream, UnaffiliatedEvent};
use crate::object::{object_accessors, Common};
use crate::status::{Error, FromVerbs, Result};
use parking_lot::Mutex;
use rnicpi::EventKind;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use ual::{Context, DeviceInfo, Target};

/// The IT-API version krdma implements.
pub const API_MAJOR_VERSION: u32 = 2;
pub const API_MINOR_VERSION: u32 = 1;

/// The transport of an IA (`it_transport_type_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Transport {
    /// InfiniBand transport (native IB or RoCE).
    InfiniBand = 1,
    /// iWARP over TCP.
    IwarpTcp = 4,
}

impl From<rnicpi::Transport> for Transport {
    fn from(t: rnicpi::Transport) -> Self {
        match t {
            rnicpi::Transport::Iwarp => Transport::IwarpTcp,
            rnicpi::Transport::Ib => Transport::InfiniBand,
        }
    }
}

/// One entry of [`interface_list`] (`it_interface_t`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub transport: Transport,
    pub major_version: u32,
    pub minor_version: u32,
}

/// A spigot: one port of the adapter (`it_spigot_info_t`).
#[derive(Debug, Clone)]
pub struct SpigotInfo {
    pub id: usize,
    pub online: bool,
    /// The network addresses the spigot serves.
    pub addresses: Vec<IpAddr>,
    pub mtu: u32,
    pub netdev: String,
}

impl SpigotInfo {
    /// The address of this spigot a connection to `peer` runs from: `peer` itself when
    /// the spigot serves it, one of its loopback addresses for a loopback peer, else its
    /// first address that is not loopback (its first address at all, failing that).
    /// `it_get_pathinfo` fills the path's local address with it.
    pub fn source_for(&self, peer: IpAddr) -> Option<IpAddr> {
        let find =
            |want: &dyn Fn(IpAddr) -> bool| self.addresses.iter().copied().find(|a| want(*a));
        find(&|a| same_ip(a, peer))
            .or_else(|| find(&|a| a.is_loopback() == peer.is_loopback()))
            .or_else(|| self.addresses.first().copied())
    }
}

/// Device limits, as far as IT-API consumers need them.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_endpoints: u32,
    /// Work requests per endpoint queue.
    pub max_dtos: u32,
    /// Scatter/gather entries per work request.
    pub max_segments: u32,
    pub max_inline: u32,
    pub max_evd_queue: u32,
    pub max_lmrs: u32,
    pub max_lmr_length: u64,
    pub max_ird: u32,
    pub max_ord: u32,
    pub max_srqs: u32,
    pub max_srq_dtos: u32,
}

/// What [`Ia::query`] reports (the fields of `it_ia_info_t` krdma fills).
#[derive(Debug, Clone)]
pub struct IaInfo {
    pub name: String,
    pub api_major_version: u32,
    pub api_minor_version: u32,
    pub vendor_id: u32,
    pub node_guid: u64,
    pub transport: Transport,
    pub limits: Limits,
    pub connect_private_data_len: usize,
    pub accept_private_data_len: usize,
    pub reject_private_data_len: usize,
    pub spigots: Vec<SpigotInfo>,
    pub srq_support: bool,
    pub rmr_support: bool,
    pub atomic_support: bool,
    pub affiliated_evd: Option<u64>,
    pub unaffiliated_evd: Option<u64>,
}

/// An interface adapter: one RDMA device (`siw0`, `rxe0`, …) opened in its own uAL
/// context. Every other object is created under an IA.
///
/// ```
/// use krdma_itapi::{interface_list, Ia, Transport};
///
/// for i in interface_list()? {
///     println!("{} ({:?})", i.name, i.transport);
/// }
/// let ia = Ia::open("siw0")?;
/// let info = ia.query();
/// assert_eq!(info.transport, Transport::IwarpTcp);
/// // or the adapter that serves an address:
/// let same = Ia::for_address("127.0.0.1".parse().unwrap())?;
/// # let _ = same;
/// # Ok::<(), krdma_itapi::Error>(())
/// ```
#[derive(Clone)]
pub struct Ia(pub(crate) Arc<IaInner>);

object_accessors!(Ia);

pub struct IaInner {
    pub(crate) ctx: Arc<Context>,
    pub(crate) dev: DeviceInfo,
    spigots: Vec<SpigotInfo>,
    async_evds: Mutex<AsyncEvds>,
    watched: Mutex<Vec<Weak<dyn Wakeable>>>,
    dead: AtomicBool,
    /// Last: dropped after everything else (see `Common`).
    pub(crate) common: Common,
}

#[derive(Default)]
struct AsyncEvds {
    affiliated: Option<Weak<SevdInner>>,
    unaffiliated: Option<Weak<SevdInner>>,
}

/// The adapters of the front door `KRDMA_DEVICE` selects.
pub fn interface_list() -> Result<Vec<Interface>> {
    interface_list_on(&Target::from_env())
}

/// The adapters of one front door.
pub fn interface_list_on(target: &Target) -> Result<Vec<Interface>> {
    let ctx = Context::open_target(target).it(Error::Resources)?;
    let devs = ctx.devices().it(Error::Resources)?;
    Ok(devs
        .into_iter()
        .map(|d| Interface {
            name: d.name,
            transport: d.transport.into(),
            major_version: API_MAJOR_VERSION,
            minor_version: API_MINOR_VERSION,
        })
        .collect())
}

impl Ia {
    /// Open the adapter `name` on the front door `KRDMA_DEVICE` selects.
    pub fn open(name: &str) -> Result<Ia> {
        Self::open_on(&Target::from_env(), name)
    }

    /// Open the adapter `name` on a given front door.
    pub fn open_on(target: &Target, name: &str) -> Result<Ia> {
        let ctx = Context::open_target(target).it(Error::Resources)?;
        let dev = ctx.device(name).map_err(|_| Error::InvalidName)?;
        Self::from_device(ctx, dev)
    }

    /// Open the adapter whose spigot serves `addr` (the first adapter for an unspecified
    /// address), on the front door `KRDMA_DEVICE` selects.
    pub fn for_address(addr: IpAddr) -> Result<Ia> {
        Self::for_address_on(&Target::from_env(), addr)
    }

    pub fn for_address_on(target: &Target, addr: IpAddr) -> Result<Ia> {
        let ctx = Context::open_target(target).it(Error::Resources)?;
        let devs = ctx.devices().it(Error::Resources)?;
        for dev in devs {
            let spigots = query_spigots(&ctx, &dev)?;
            let serves = addr.is_unspecified()
                || spigots
                    .iter()
                    .any(|s| s.addresses.iter().any(|a| same_ip(*a, addr)));
            if serves {
                return Self::from_device(ctx, dev);
            }
        }
        Err(Error::InvalidNetaddr)
    }

    fn from_device(ctx: Arc<Context>, dev: DeviceInfo) -> Result<Ia> {
        let spigots = query_spigots(&ctx, &dev)?;
        let inner = Arc::new(IaInner {
            common: Common::new(),
            ctx,
            dev,
            spigots,
            async_evds: Mutex::new(AsyncEvds::default()),
            watched: Mutex::new(Vec::new()),
            dead: AtomicBool::new(false),
        });
        let ia = Ia(inner);
        // Handle 0: the unaffiliated events of the context.
        ia.route_events(0, &ia.0, |ia, ev| Ia(ia.clone()).on_unaffiliated(ev.kind));
        tracing::info!(id = ia.id(), device = %ia.0.dev.name, "IA opened");
        Ok(ia)
    }

    pub fn name(&self) -> &str {
        &self.0.dev.name
    }

    pub fn transport(&self) -> Transport {
        self.0.dev.transport.into()
    }

    /// The uAL context the IA runs on.
    pub fn context_handle(&self) -> &Arc<Context> {
        &self.0.ctx
    }

    pub fn spigots(&self) -> &[SpigotInfo] {
        &self.0.spigots
    }

    /// The address other processes on this host reach this adapter at: a loopback
    /// address its first spigot serves — 127.0.0.1 for siw0 (every host address), the
    /// device's own address for an rxe0 bound to one (`--rxe-addr`, `KRDMA_RXE_ADDR`)
    /// — else the spigot's first address. Listeners listen on every address of their
    /// spigot; connect to this one from the same host.
    pub fn local_address(&self) -> Option<IpAddr> {
        self.0
            .spigots
            .first()?
            .source_for(IpAddr::from([127, 0, 0, 1]))
    }

    pub(crate) fn dev_index(&self) -> u32 {
        self.0.dev.index
    }

    /// The device has memory windows (RMRs).
    pub fn rmr_support(&self) -> bool {
        self.0.dev.attr.memory_windows
    }

    /// The device implements atomics (rxe0 does; iWARP, and so siw0, has none).
    pub fn atomic_support(&self) -> bool {
        self.0.dev.attr.atomics
    }

    pub fn limits(&self) -> Limits {
        let r = &self.0.dev.attr;
        Limits {
            max_endpoints: r.max_qp,
            max_dtos: r.max_qp_wr,
            max_segments: r.max_sge.min(rnicpi::MAX_SGE as u32),
            max_inline: r.max_inline.min(rnicpi::MAX_INLINE as u32),
            max_evd_queue: r.max_cqe,
            max_lmrs: r.max_mr,
            max_lmr_length: r.max_mr_size,
            max_ird: r.max_ird,
            max_ord: r.max_ord,
            max_srqs: r.max_srq,
            max_srq_dtos: r.max_srq_wr,
        }
    }

    /// The largest private data of a connect, accept and reject on this transport.
    /// The provider reports them (`rnicpi::PrivateDataLimits`): a fact of its wire.
    pub fn private_data_limits(&self) -> (usize, usize, usize) {
        let l = self.0.dev.attr.private_data;
        (l.connect.into(), l.accept.into(), l.reject.into())
    }

    pub fn query(&self) -> IaInfo {
        let r = &self.0.dev.attr;
        let (connect, accept, reject) = self.private_data_limits();
        let evds = self.0.async_evds.lock();
        let live =
            |w: &Option<Weak<SevdInner>>| w.as_ref().and_then(Weak::upgrade).map(|e| e.common.id);
        IaInfo {
            name: self.0.dev.name.clone(),
            api_major_version: API_MAJOR_VERSION,
            api_minor_version: API_MINOR_VERSION,
            vendor_id: r.vendor_id,
            node_guid: self.0.dev.node_guid,
            transport: self.transport(),
            limits: self.limits(),
            connect_private_data_len: connect,
            accept_private_data_len: accept,
            reject_private_data_len: reject,
            spigots: self.0.spigots.clone(),
            srq_support: r.max_srq > 0,
            rmr_support: self.rmr_support(),
            atomic_support: self.atomic_support(),
            affiliated_evd: live(&evds.affiliated),
            unaffiliated_evd: live(&evds.unaffiliated),
        }
    }

    pub fn is_dead(&self) -> bool {
        self.0.dead.load(Ordering::Acquire)
    }

    pub(crate) fn check_alive(&self) -> Result<()> {
        if self.is_dead() {
            Err(Error::IaCatastrophe)
        } else {
            Ok(())
        }
    }

    pub(crate) fn check_spigot(&self, spigot_id: usize) -> Result<()> {
        if spigot_id < self.0.spigots.len() {
            Ok(())
        } else {
            Err(Error::InvalidSpigot)
        }
    }

    /// Register the IA's one SEVD for an async stream.
    pub(crate) fn claim_async_evd(&self, stream: EventStream, evd: &Arc<SevdInner>) -> Result<()> {
        let mut evds = self.0.async_evds.lock();
        let (slot, busy) = match stream {
            EventStream::AsyncAffiliated => (&mut evds.affiliated, Error::AsyncAffEvdExists),
            _ => (&mut evds.unaffiliated, Error::AsyncUnaffEvdExists),
        };
        if slot.as_ref().and_then(Weak::upgrade).is_some() {
            return Err(busy);
        }
        *slot = Some(Arc::downgrade(evd));
        Ok(())
    }

    fn async_evd(&self, stream: EventStream) -> Option<Arc<SevdInner>> {
        let evds = self.0.async_evds.lock();
        let slot = match stream {
            EventStream::AsyncAffiliated => &evds.affiliated,
            _ => &evds.unaffiliated,
        };
        slot.as_ref().and_then(Weak::upgrade)
    }

    /// Queue an affiliated async event (built for the EVD it lands on), if the IA has an
    /// affiliated EVD; dropped (and logged) otherwise.
    pub(crate) fn post_affiliated(&self, make: impl FnOnce(EvdRef) -> Event) {
        self.post_async(EventStream::AsyncAffiliated, make)
    }

    fn post_async(&self, stream: EventStream, make: impl FnOnce(EvdRef) -> Event) {
        match self.async_evd(stream) {
            Some(evd) => {
                let ev = make(evd.obj_ref());
                evd.push(ev, true);
            }
            None => tracing::info!(
                ia = self.id(),
                ?stream,
                "async event with no EVD to take it"
            ),
        }
    }

    /// Hand the events of the uAL object `handle` to `obj` (held weakly: events never
    /// keep an object alive) through `f`, on the context's event threads.
    pub(crate) fn route_events<T: Send + Sync + 'static>(
        &self,
        handle: u32,
        obj: &Arc<T>,
        f: fn(&Arc<T>, rnicpi::Event),
    ) {
        let weak = Arc::downgrade(obj);
        self.0.ctx.set_handler(
            handle,
            Arc::new(move |ev| {
                if let Some(o) = weak.upgrade() {
                    f(&o, ev)
                }
            }),
        );
    }

    /// Wake `obj` (EVDs) when the IA dies.
    pub(crate) fn watch_for_death(&self, obj: Weak<dyn Wakeable>) {
        let mut w = self.0.watched.lock();
        w.retain(|o| o.strong_count() > 0);
        w.push(obj);
    }

    fn on_unaffiliated(&self, kind: EventKind) {
        let number = match kind {
            EventKind::PortActive => EventNumber::AsyncUnaffSpigotOnline,
            EventKind::PortError => EventNumber::AsyncUnaffSpigotOffline,
            EventKind::EventOverflow => EventNumber::AsyncUnaffSevdEnqueueFailure,
            EventKind::DeviceFatal | EventKind::AccessLayerDead => {
                self.die();
                EventNumber::AsyncUnaffSpigotOffline
            }
            _ => return,
        };
        tracing::warn!(ia = self.id(), ?kind, "unaffiliated event");
        let ia = self.id();
        self.post_async(EventStream::AsyncUnaffiliated, |evd| {
            Event::Unaffiliated(UnaffiliatedEvent {
                number,
                evd,
                ia,
                spigot_id: 0,
            })
        });
    }

    /// The access layer or the device is gone: every call fails from now on and every
    /// waiter wakes.
    pub(crate) fn die(&self) {
        if self.0.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::error!(ia = self.id(), "interface adapter failed");
        let watched: Vec<_> = self.0.watched.lock().drain(..).collect();
        for w in watched.iter().filter_map(Weak::upgrade) {
            w.wake_dead();
        }
    }
}

impl Drop for IaInner {
    fn drop(&mut self) {
        tracing::info!(id = self.common.id, device = %self.dev.name, "IA freed");
    }
}

fn query_spigots(ctx: &Context, dev: &DeviceInfo) -> Result<Vec<SpigotInfo>> {
    (1..=dev.attr.phys_port_cnt.max(1))
        .map(|port| {
            let p = ctx.query_port(dev.index, port).it(Error::InvalidSpigot)?;
            Ok(SpigotInfo {
                id: usize::from(port - 1),
                online: p.state == rnicpi::PortState::Active,
                addresses: p.gids.iter().map(|g| rnicpi::gid_to_ip(*g)).collect(),
                mtu: p.active_mtu,
                netdev: p.netdev,
            })
        })
        .collect()
}

/// Equal addresses, treating IPv4 and its IPv4-mapped IPv6 form alike.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    rnicpi::ip_to_gid(a) == rnicpi::ip_to_gid(b)
}
