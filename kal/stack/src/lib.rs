//! The default set of providers a kAL starts with (daemon and embedded mode alike).

use kal::services::HostServices;
use kal::Kal;
use rnicpi::Result;
use std::sync::Arc;

/// Provider options shared by `krdmad` and embedded mode (environment: `KRDMA_SIW_NETDEV`,
/// `KRDMA_SIW_CRC=required`, `KRDMA_RXE_ADDR`, `KRDMA_RXE_PORT`, `KRDMA_RXE_RAW=0`,
/// `KRDMA_RXE_GSO=off`, `KRDMA_RXE=off`, `KRDMA_IBVERBS=off`).
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    /// Interface siw0 binds to (`None` = every host address).
    pub siw_netdev: Option<String>,
    /// Require MPA CRC on siw connections.
    pub siw_crc_required: bool,
    /// Leave rxe0 out.
    pub rxe_off: bool,
    /// IPv4 address rxe0 serves (`None` = every address; one such instance per network
    /// namespace — others must bind distinct addresses).
    pub rxe_addr: Option<std::net::Ipv4Addr>,
    /// UDP port of rxe0 (`None` = 4791).
    pub rxe_port: Option<u16>,
    /// Never use raw sockets for rxe0 (see `rxe::net`).
    pub rxe_no_raw: bool,
    /// Send every rxe0 packet to this host as a datagram of its own, never runs of them as
    /// one GSO datagram (see `rxe::wire::gso`): what a capture on `lo` shows packet by
    /// packet.
    pub rxe_no_gso: bool,
    /// Leave out the host's libibverbs devices (the mlx provider's `ibv-*`).
    pub ibverbs_off: bool,
    /// Where another rxe device of this user already serves rxe0's port on every address
    /// (krdmad's, or another program's embedded one), serve this host only, on a loopback
    /// address of this process's own, rather than leave rxe0 out: what an embedded kAL
    /// does, so that two programs on one host (a perftest server and its client) reach
    /// each other without setting addresses. Never with `rxe_addr` set.
    pub rxe_this_host_if_taken: bool,
}

impl StackOptions {
    pub fn from_env() -> Self {
        StackOptions {
            siw_netdev: std::env::var("KRDMA_SIW_NETDEV")
                .ok()
                .filter(|s| !s.is_empty()),
            siw_crc_required: std::env::var("KRDMA_SIW_CRC")
                .map(|v| v == "required")
                .unwrap_or(false),
            rxe_off: std::env::var("KRDMA_RXE").is_ok_and(|v| v == "off"),
            rxe_addr: std::env::var("KRDMA_RXE_ADDR")
                .ok()
                .and_then(|v| v.parse().ok()),
            rxe_port: std::env::var("KRDMA_RXE_PORT")
                .ok()
                .and_then(|v| v.parse().ok()),
            rxe_no_raw: std::env::var("KRDMA_RXE_RAW").is_ok_and(|v| v == "0"),
            rxe_no_gso: std::env::var("KRDMA_RXE_GSO").is_ok_and(|v| v == "off"),
            ibverbs_off: std::env::var("KRDMA_IBVERBS").is_ok_and(|v| v == "off"),
            rxe_this_host_if_taken: false,
        }
    }
}

/// Register the default devices with `kal`: siw0 (iWARP) and rxe0 (RoCEv2), side by
/// side, then every verbs device libibverbs lists on the host (`ibv-mlx5_0`, `ibv-rxe0`,
/// ...; none where libibverbs is not installed). rxe0 is left out, with a warning, when
/// its UDP port cannot be bound (as where the kernel's own rxe holds it).
pub fn start_default(kal: &Kal, opts: &StackOptions) -> Result<()> {
    let services = Arc::new(HostServices);
    let siw = siw::SiwDevice::new(
        siw::SiwConfig {
            name: "siw0".into(),
            netdev: opts.siw_netdev.clone(),
            crc_required: opts.siw_crc_required,
        },
        services.clone(),
    );
    kal.register(siw)?;
    if !opts.rxe_off {
        let defaults = rxe::RxeConfig::default();
        let config = rxe::RxeConfig {
            addr: opts.rxe_addr,
            port: opts.rxe_port.unwrap_or(defaults.port),
            raw: !opts.rxe_no_raw,
            gso: !opts.rxe_no_gso,
            ..defaults
        };
        match start_rxe(config, opts, services) {
            Ok(dev) => {
                kal.register(dev)?;
            }
            Err(e) => tracing::warn!(error = %e, "rxe0 not started"),
        }
    }
    if !opts.ibverbs_off {
        for dev in mlx::kernel_devices() {
            let name = dev.attr().name.clone();
            if let Err(e) = kal.register(dev) {
                tracing::warn!(device = %name, error = %e, "libibverbs device not registered");
            }
        }
    }
    Ok(())
}

/// rxe0 as `config` asks, or, when another device holds its port on every address and
/// `opts` allows, on a loopback address of this process's own (one derived from the pid,
/// the next where another process's is bound).
fn start_rxe(
    config: rxe::RxeConfig,
    opts: &StackOptions,
    services: Arc<HostServices>,
) -> Result<Arc<rxe::RxeDevice>> {
    let first = rxe::RxeDevice::new(config.clone(), services.clone());
    let may_fall_back = opts.rxe_this_host_if_taken && config.addr.is_none();
    if !(may_fall_back && matches!(first, Err(rnicpi::VerbsError::AddrInUse))) {
        return first;
    }
    let pid = std::process::id();
    let mut last = rnicpi::VerbsError::AddrInUse;
    for high in (250..=253u8).rev() {
        let addr = std::net::Ipv4Addr::new(127, high, (pid >> 8) as u8, pid as u8);
        let here = rxe::RxeConfig {
            addr: Some(addr),
            ..config.clone()
        };
        match rxe::RxeDevice::new(here, services.clone()) {
            Ok(dev) => {
                tracing::warn!(
                    %addr,
                    port = config.port,
                    "rxe0 serves this host only, on {addr}: another rxe device (krdmad's, or \
                     another program's) serves the port on every address; reach that one \
                     through krdmad, or set KRDMA_RXE_ADDR"
                );
                return Ok(dev);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// The driver name under which siw offers its engine to consumers (`FastPath::Either`).
pub use siw::UVP_DRIVER as SIW_UVP_DRIVER;

/// Register in `kal` the one device a software provider's uVP names (`driver`, `device`
/// from the daemon's `FastPath::Either`): the engine a consumer runs in its own process
/// instead of reaching the daemon's. `Unsupported` for a driver that has no such engine.
pub fn start_uvp(kal: &Kal, driver: &str, device: &str) -> Result<()> {
    if driver != SIW_UVP_DRIVER {
        return Err(rnicpi::VerbsError::Unsupported);
    }
    let config = siw::SiwConfig::from_uvp_device(device).ok_or(rnicpi::VerbsError::Invalid)?;
    kal.register(siw::SiwDevice::new(config, Arc::new(HostServices)))?;
    Ok(())
}
