//! The siw device: attributes, ports, and the resources it hands the kAL.

use crate::cm::reactor::CmReactor;
use crate::cm::SiwListener;
use crate::qp::SiwQp;
use crate::wire::mpa;
use rnicpi::*;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// How the device is set up.
#[derive(Debug, Clone)]
pub struct SiwConfig {
    /// Device name, `siw0`.
    pub name: String,
    /// Interface to bind to (`None`: every host address).
    pub netdev: Option<String>,
    /// Require MPA CRC32c (otherwise negotiated off unless the peer requires it, as
    /// kernel siw does by default).
    pub crc_required: bool,
}

/// The driver name of siw's user verbs provider (the engine run in the consumer's own
/// process; the uAL holds it).
pub const UVP_DRIVER: &str = "siw";

impl SiwConfig {
    /// The device as its uVP is told of it (`QUERY_DEVICE`'s 31-byte `uvp_device`):
    /// `siw0`, then `,netdev=NAME` and `,crc` as configured; `None` when that does not fit.
    pub fn uvp_device(&self) -> Option<String> {
        let mut s = self.name.clone();
        if let Some(n) = &self.netdev {
            s += &format!(",netdev={n}");
        }
        if self.crc_required {
            s += ",crc";
        }
        (s.len() < 32 && !self.name.contains(',')).then_some(s)
    }

    /// The configuration [`SiwConfig::uvp_device`] described.
    pub fn from_uvp_device(s: &str) -> Option<SiwConfig> {
        let mut parts = s.split(',');
        let mut c = SiwConfig {
            name: parts.next().filter(|n| !n.is_empty())?.to_string(),
            ..SiwConfig::default()
        };
        for p in parts {
            match p.split_once('=') {
                None if p == "crc" => c.crc_required = true,
                Some(("netdev", n)) if !n.is_empty() => c.netdev = Some(n.to_string()),
                _ => return None,
            }
        }
        Some(c)
    }
}

impl Default for SiwConfig {
    fn default() -> Self {
        SiwConfig {
            name: "siw0".into(),
            netdev: None,
            crc_required: false,
        }
    }
}

rnicpi::counters!(
    /// Device-wide counters (`krdma stat`).
    pub(crate) struct Counters {
        tx_fpdus,
        rx_fpdus,
        tx_bytes,
        rx_bytes,
        /// Payload bytes sent from consumer memory in place (`qp::batch`).
        tx_bytes_lent,
        /// Lent payload bytes copied out after all: what an LLP with no room to wait for
        /// (one in memory, `harness`/`sim`) did not take at once. Zero over a socket.
        tx_bytes_lent_copied,
        /// Transmits failed because a payload's registration was invalidated between its
        /// emission and its write (the consumer deregistered memory under a request).
        tx_lend_refused,
        crc_errors,
        bad_fpdus,
        terminates_sent,
        terminates_received,
        connections,
        connect_requests,
        cq_overflows,
        qps_created,
        /// Reads of a stream that found data: by a QP's rx thread, and by a consumer
        /// polling one of its CQs in embedded mode (`rnicpi::progress`).
        rx_reads_thread,
        rx_reads_polled,
        // Connection setup (the CM reactor): what it holds now, and every refusal or drop.
        /// MPA handshakes under way (gauge).
        handshakes_active,
        /// Complete requests waiting for the consumer (gauge).
        requests_pending,
        handshake_timeouts,
        /// Handshakes dropped to make room for a newer connection (backlog full).
        handshakes_evicted,
        /// Connections reset at once: backlog full of pending requests, or the device cap.
        connections_refused,
        requests_expired,
        accept_errors,
        /// Malformed MPA frames, refused requests and failed exchanges.
        bad_mpa,
    }
);

/// State shared by the device and its objects.
pub(crate) struct Shared {
    pub attr: DeviceAttr,
    /// PDs, CQs, SRQs and the key table (registrations, windows).
    pub res: soft::SoftResources,
    pub services: Arc<dyn KalServices>,
    pub crc_required: bool,
    pub counters: Counters,
    netdev: Option<String>,
    /// The connection manager's reactor thread, started on first use.
    cm: parking_lot::Mutex<Option<Arc<CmReactor>>>,
}

impl Shared {
    /// The device's CM reactor (started on first use).
    pub(crate) fn cm(self: &Arc<Self>) -> Result<Arc<CmReactor>> {
        let mut cm = self.cm.lock();
        if let Some(r) = cm.as_ref() {
            return Ok(r.clone());
        }
        let r = CmReactor::start(self)?;
        *cm = Some(r.clone());
        Ok(r)
    }
}

/// Software iWARP device.
pub struct SiwDevice {
    pub(crate) shared: Arc<Shared>,
    next_qpn: AtomicU32,
}

impl SiwDevice {
    pub fn new(config: SiwConfig, services: Arc<dyn KalServices>) -> Arc<SiwDevice> {
        let guid_src = services
            .addresses()
            .into_iter()
            .find(|a| Some(&a.ifname) == config.netdev.as_ref() || config.netdev.is_none());
        let mut guid = 0x0200_5e00_0000_0000u64;
        if let Some(a) = guid_src {
            guid |= crc32c::crc32c(a.addr.to_string().as_bytes()) as u64;
        }
        let attr = DeviceAttr {
            name: config.name.clone(),
            transport: Transport::Iwarp,
            node_guid: guid,
            vendor_id: 0x626d74, // "bmt", as kernel siw reports
            max_qp: 16 * 1024,
            max_qp_wr: 16 * 1024,
            max_sge: MAX_SGE as u32,
            max_inline: MAX_INLINE as u32,
            max_cq: 32 * 1024,
            max_cqe: 64 * 1024,
            max_mr: 128 * 1024,
            max_mr_size: 1 << 40,
            max_pd: 32 * 1024,
            max_srq: 8 * 1024,
            max_srq_wr: 16 * 1024,
            max_ird: 32,
            max_ord: 32,
            atomics: false,
            memory_windows: true,
            max_ah: 0,
            phys_port_cnt: 1,
            private_data: PrivateDataLimits {
                connect: mpa::MAX_CONSUMER_PRIVATE_DATA as u16,
                accept: mpa::MAX_CONSUMER_PRIVATE_DATA as u16,
                reject: mpa::MAX_CONSUMER_PRIVATE_DATA as u16,
            },
            // The consumer may run this engine itself: its wire is TCP sockets it can open.
            fast_path: match config.uvp_device() {
                Some(device) => rnicpi::FastPath::Either {
                    driver: UVP_DRIVER.into(),
                    device,
                },
                None => rnicpi::FastPath::Kal,
            },
        };
        let shared = Arc::new(Shared {
            res: soft::SoftResources::new(attr.max_mr),
            attr,
            services,
            crc_required: config.crc_required,
            counters: Counters::default(),
            netdev: config.netdev,
            cm: parking_lot::Mutex::new(None),
        });
        tracing::info!(name = %config.name, crc_required = config.crc_required, "siw device created");
        Arc::new(SiwDevice {
            shared,
            next_qpn: AtomicU32::new(1),
        })
    }

    fn addrs(&self) -> Vec<IfAddr> {
        self.shared
            .services
            .addresses()
            .into_iter()
            .filter(|a| self.shared.netdev.as_ref().is_none_or(|n| *n == a.ifname))
            .collect()
    }
}

impl Provider for SiwDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.shared.attr
    }

    fn port(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(VerbsError::Invalid);
        }
        let addrs = self.addrs();
        let netdev = self.shared.netdev.clone().unwrap_or_else(|| "*".into());
        let mtu = match &self.shared.netdev {
            Some(n) => std::fs::read_to_string(format!("/sys/class/net/{n}/mtu"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(1500),
            None => 1500,
        };
        let state = if addrs.is_empty() {
            PortState::Down
        } else {
            PortState::Active
        };
        Ok(PortAttr {
            state,
            active_mtu: mtu,
            gids: addrs.iter().map(|a| ip_to_gid(a.addr)).collect(),
            netdev,
        })
    }

    fn counters(&self) -> Vec<Counter> {
        let mut v = self.shared.counters.rows();
        v.extend(self.shared.res.counters());
        v
    }

    fn threads_per_connection(&self) -> u32 {
        2 // a receive and a transmit thread per connected QP (setup runs on the CM reactor)
    }

    rnicpi::soft_resources!(shared.res);

    fn create_qp(&self, init: QpInit) -> Result<Arc<dyn ProviderQp>> {
        self.shared.res.check_qp_init(&init, &[QpType::Rc])?;
        let qpn = self.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xff_ffff;
        self.shared
            .counters
            .qps_created
            .fetch_add(1, Ordering::Relaxed);
        Ok(SiwQp::new(self.shared.clone(), qpn, init))
    }

    fn connect(&self, qp: &Arc<dyn ProviderQp>, peer: SocketAddr, param: ConnParam) -> Result<()> {
        crate::cm::connect(SiwQp::of(qp, &self.shared)?, peer, param)
    }

    fn listen(
        &self,
        addr: SocketAddr,
        backlog: u32,
        sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn ProviderListener>> {
        Ok(SiwListener::start(
            self.shared.clone(),
            addr,
            backlog,
            sink,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What krdmad tells a consumer of the device (`FastPath::Either`'s `device`) brings
    /// back the same configuration, and a description that would not fit the ABI's
    /// 31 bytes keeps the device on the kAL's rings.
    #[test]
    fn the_uvp_description_round_trips() {
        for (netdev, crc) in [
            (None, false),
            (Some("veth-krdma0"), true),
            (Some("lo"), false),
        ] {
            let c = SiwConfig {
                name: "siw0".into(),
                netdev: netdev.map(String::from),
                crc_required: crc,
            };
            let s = c.uvp_device().unwrap();
            let back = SiwConfig::from_uvp_device(&s).unwrap();
            assert_eq!(
                (back.name, back.netdev, back.crc_required),
                (c.name, c.netdev, crc)
            );
        }
        let long = SiwConfig {
            netdev: Some("an-interface-name-far-too-long".into()),
            ..SiwConfig::default()
        };
        assert_eq!(long.uvp_device(), None);
        for bad in ["", ",crc", "siw0,mtu=9000", "siw0,netdev="] {
            assert!(SiwConfig::from_uvp_device(bad).is_none(), "{bad}");
        }
    }
}
