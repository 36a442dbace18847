//! The kernel half: one [`Provider`] per libibverbs device, for the kAL to register. It
//! reports the device (attributes, ports, counters); the consumer's own process creates
//! the objects through the user half, and the kAL mirrors them.

use crate::cm::{IB_PRIVATE_DATA, IWARP_PRIVATE_DATA};
use crate::conv;
use crate::sys::{self, Context};
use crate::user::DRIVER;
use rnicpi::{
    Access, ConnParam, Counter, CqInit, DeviceAttr, EventSink, FastPath, MemoryAccess, PortAttr,
    PortState, Provider, ProviderCq, ProviderListener, ProviderQp, QpInit, Region, Result,
    Transport, VerbsError, MAX_INLINE, MAX_SGE,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The prefix of the names the kAL knows these devices by (`ibv-rxe0`, `ibv-mlx5_0`): they
/// cannot clash with krdma's own `siw0`/`rxe0`.
pub const NAME_PREFIX: &str = "ibv-";

/// Where the kernel publishes the devices' ports and counters.
const SYSFS: &str = "/sys/class/infiniband";

/// Every device libibverbs lists, as a kAL provider; empty (and no error) when libibverbs
/// is missing or lists nothing.
pub fn kernel_devices() -> Vec<Arc<dyn Provider>> {
    sys::list_devices()
        .into_iter()
        .filter_map(|d| match IbvKernelDevice::open(&d.name) {
            Ok(dev) => Some(Arc::new(dev) as Arc<dyn Provider>),
            Err(e) => {
                tracing::warn!(device = %d.name, error = %e, "ibverbs device skipped");
                None
            }
        })
        .collect()
}

/// A libibverbs device as the kAL sees it.
pub struct IbvKernelDevice {
    attr: DeviceAttr,
    ctx: Context,
}

impl IbvKernelDevice {
    pub fn open(name: &str) -> Result<IbvKernelDevice> {
        let ctx = Context::open(name)?;
        let a = ctx.query_device()?;
        let iwarp = ctx.info.iwarp;
        let pos = |v: i32| v.max(0) as u32;
        let attr = DeviceAttr {
            name: format!("{NAME_PREFIX}{name}"),
            transport: if iwarp {
                Transport::Iwarp
            } else {
                Transport::Ib
            },
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            max_qp: pos(a.max_qp),
            max_qp_wr: pos(a.max_qp_wr),
            // A Wqe carries at most MAX_SGE entries and MAX_INLINE inline bytes.
            max_sge: pos(a.max_sge).min(MAX_SGE as u32),
            max_inline: probe_inline(&ctx).unwrap_or(0),
            max_cq: pos(a.max_cq),
            max_cqe: pos(a.max_cqe),
            max_mr: pos(a.max_mr),
            max_mr_size: a.max_mr_size,
            max_pd: pos(a.max_pd),
            max_srq: pos(a.max_srq),
            max_srq_wr: pos(a.max_srq_wr),
            max_ird: pos(a.max_qp_rd_atom),
            max_ord: pos(a.max_qp_init_rd_atom),
            atomics: a.atomic_cap != rdma_mummy_sys::ibv_atomic_cap::IBV_ATOMIC_NONE,
            memory_windows: type2_windows(a.device_cap_flags, a.max_mw),
            max_ah: pos(a.max_ah),
            phys_port_cnt: a.phys_port_cnt,
            private_data: if iwarp {
                IWARP_PRIVATE_DATA
            } else {
                IB_PRIVATE_DATA
            },
            fast_path: FastPath::Consumer {
                driver: DRIVER.into(),
                device: name.into(),
            },
        };
        Ok(IbvKernelDevice { attr, ctx })
    }

    fn ibv_name(&self) -> &str {
        &self.ctx.info.name
    }
}

/// Whether `ibv_query_device` reports memory windows of type 2 (bound by a send-queue
/// request, as the RNIC-PI's `BindMw`): the capability flag of type 2A or 2B and a
/// non-zero `max_mw`. Linux rxe reports `IBV_DEVICE_MEM_WINDOW_TYPE_2B` and 4096
/// windows; siw reports neither.
pub(crate) fn type2_windows(cap_flags: u32, max_mw: i32) -> bool {
    use rdma_mummy_sys::ibv_device_cap_flags as f;
    let type2 = f::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0 | f::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0;
    cap_flags & type2 != 0 && max_mw > 0
}

/// The largest inline size (of those a Wqe can carry) the device grants an RC QP: the
/// verbs API reports it only when a QP is created.
fn probe_inline(ctx: &Context) -> Result<u32> {
    let pd = sys::Pd::new(ctx)?;
    let chan = sys::CompChannel::new(ctx)?;
    let cq = sys::Cq::new(ctx, 4, &chan, 0)?;
    for want in [MAX_INLINE as u32, 64, 32, 16, 0] {
        let caps = rnicpi::QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline: want,
        };
        let made = sys::Qp::new(
            &pd,
            sys::QpCreate {
                qp_type: rdma_mummy_sys::ibv_qp_type::IBV_QPT_RC,
                send_cq: &cq,
                recv_cq: &cq,
                srq: None,
                caps,
            },
        );
        if let Ok((_qp, granted)) = made {
            return Ok(granted.max_inline.min(MAX_INLINE as u32));
        }
    }
    Ok(0)
}

fn read_u64(p: &Path) -> Option<u64> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

/// Counter names live as long as the process (a small, fixed set per device).
fn intern(name: String) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let mut m = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(s) = m.get(&name) {
        return s;
    }
    let s: &'static str = Box::leak(name.clone().into_boxed_str());
    m.insert(name, s);
    s
}

/// Every readable number in `dir`, named `prefix` + file name, sorted.
fn dir_counters(dir: &Path, prefix: &str) -> Vec<Counter> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<Counter> = rd
        .flatten()
        .filter_map(|e| {
            let v = read_u64(&e.path())?;
            Some((
                intern(format!("{prefix}{}", e.file_name().to_string_lossy())),
                v,
            ))
        })
        .collect();
    out.sort();
    out
}

/// The counters sysfs publishes for `dev`: the device's `hw_counters`, and each port's
/// `counters` and `hw_counters` (ports after the first prefixed `pN_`).
pub(crate) fn sysfs_counters(root: &Path, dev: &str, ports: u8) -> Vec<Counter> {
    let base = root.join(dev);
    let mut out = dir_counters(&base.join("hw_counters"), "");
    for p in 1..=ports.max(1) {
        let prefix = if p == 1 {
            String::new()
        } else {
            format!("p{p}_")
        };
        let pd = base.join("ports").join(p.to_string());
        out.extend(dir_counters(&pd.join("counters"), &prefix));
        out.extend(dir_counters(&pd.join("hw_counters"), &prefix));
    }
    out
}

/// The network device of GID `index` of `port`, or the first one any GID names.
pub(crate) fn sysfs_netdev(root: &Path, dev: &str, port: u8, index: Option<usize>) -> String {
    let ndevs: PathBuf = root
        .join(dev)
        .join("ports")
        .join(port.to_string())
        .join("gid_attrs/ndevs");
    let read = |i: usize| {
        std::fs::read_to_string(ndevs.join(i.to_string()))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    if let Some(n) = index.and_then(read) {
        return n;
    }
    (0..256).find_map(read).unwrap_or_default()
}

/// The interface whose MAC address a GID carries (bytes 0..6, the rest zero: siw's GIDs).
pub(crate) fn netdev_by_mac(net: &Path, gids: &[[u8; 16]]) -> String {
    let Ok(rd) = std::fs::read_dir(net) else {
        return String::new();
    };
    let macs: Vec<[u8; 6]> = gids
        .iter()
        .filter(|g| g[6..] == [0; 10] && g[..6] != [0; 6])
        .map(|g| g[..6].try_into().unwrap())
        .collect();
    let mut names: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .find(|n| {
            let Ok(a) = std::fs::read_to_string(net.join(n).join("address")) else {
                return false;
            };
            let b: Vec<u8> = a
                .trim()
                .split(':')
                .filter_map(|x| u8::from_str_radix(x, 16).ok())
                .collect();
            b.len() == 6 && macs.iter().any(|m| m[..] == b[..])
        })
        .unwrap_or_default()
}

impl Provider for IbvKernelDevice {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn port(&self, port: u8) -> Result<PortAttr> {
        if port == 0 || port > self.attr.phys_port_cnt {
            return Err(VerbsError::Invalid);
        }
        let p = self.ctx.query_port(port)?;
        use rdma_mummy_sys::ibv_port_state::*;
        let state = match p.state {
            IBV_PORT_ACTIVE | IBV_PORT_ACTIVE_DEFER => PortState::Active,
            IBV_PORT_ARMED => PortState::Armed,
            IBV_PORT_INIT => PortState::Init,
            _ => PortState::Down,
        };
        let mut gids = Vec::new();
        let mut first = None;
        for i in 0..p.gid_tbl_len.max(0) {
            if let Ok(g) = self.ctx.query_gid(port, i) {
                if g != [0; 16] {
                    first.get_or_insert(i as usize);
                    gids.push(g);
                }
            }
        }
        let mut netdev = sysfs_netdev(Path::new(SYSFS), self.ibv_name(), port, first);
        if netdev.is_empty() {
            // iWARP (siw) publishes no gid_attrs; its GID is the interface's MAC.
            netdev = netdev_by_mac(Path::new("/sys/class/net"), &gids);
        }
        Ok(PortAttr {
            state,
            active_mtu: conv::mtu_from_ibv(p.active_mtu),
            gids,
            netdev,
        })
    }

    fn counters(&self) -> Vec<Counter> {
        sysfs_counters(Path::new(SYSFS), self.ibv_name(), self.attr.phys_port_cnt)
    }

    // The consumer's process creates every object through the user half (the kAL mirrors
    // them): nothing is created here.
    fn alloc_pd(&self) -> Result<u32> {
        Err(VerbsError::Unsupported)
    }
    fn dealloc_pd(&self, _pd: u32) {}
    fn create_cq(&self, _init: CqInit) -> Result<Arc<dyn ProviderCq>> {
        Err(VerbsError::Unsupported)
    }
    fn create_qp(&self, _init: QpInit) -> Result<Arc<dyn ProviderQp>> {
        Err(VerbsError::Unsupported)
    }
    fn reg_mr(
        &self,
        _pd: u32,
        _base: u64,
        _len: u64,
        _access: Access,
        _mem: Arc<dyn MemoryAccess>,
    ) -> Result<Arc<Region>> {
        Err(VerbsError::Unsupported)
    }
    fn dereg_mr(&self, _stag: u32) -> Result<()> {
        Err(VerbsError::Unsupported)
    }
    fn connect(
        &self,
        _qp: &Arc<dyn ProviderQp>,
        _peer: SocketAddr,
        _param: ConnParam,
    ) -> Result<()> {
        Err(VerbsError::Unsupported)
    }
    fn listen(
        &self,
        _addr: SocketAddr,
        _backlog: u32,
        _sink: Arc<dyn EventSink>,
    ) -> Result<Arc<dyn ProviderListener>> {
        Err(VerbsError::Unsupported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_windows_of_type_2() {
        use rdma_mummy_sys::ibv_device_cap_flags as f;
        // Linux rxe: MEM_WINDOW | MEM_WINDOW_TYPE_2B (and others), max_mw 4096.
        let rxe = f::IBV_DEVICE_MEM_WINDOW.0
            | f::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0
            | f::IBV_DEVICE_MEM_MGT_EXTENSIONS.0;
        assert!(type2_windows(rxe, 4096));
        assert!(type2_windows(f::IBV_DEVICE_MEM_WINDOW_TYPE_2A.0, 16));
        // siw: no windows; type 1 only is not enough; a flag without windows neither.
        assert!(!type2_windows(f::IBV_DEVICE_MEM_MGT_EXTENSIONS.0, 0));
        assert!(!type2_windows(f::IBV_DEVICE_MEM_WINDOW.0, 4096));
        assert!(!type2_windows(rxe, 0));
    }

    #[test]
    fn sysfs_counters_and_netdev() {
        let root = std::env::temp_dir().join(format!("krdma-mlx-sysfs-{}", std::process::id()));
        let p1 = root.join("mlx5_0/ports/1");
        std::fs::create_dir_all(p1.join("counters")).unwrap();
        std::fs::create_dir_all(p1.join("hw_counters")).unwrap();
        std::fs::create_dir_all(p1.join("gid_attrs/ndevs")).unwrap();
        std::fs::create_dir_all(root.join("mlx5_0/ports/2/counters")).unwrap();
        std::fs::write(p1.join("counters/port_xmit_data"), "1234\n").unwrap();
        std::fs::write(p1.join("hw_counters/out_of_sequence"), "7\n").unwrap();
        std::fs::write(p1.join("counters/not_a_number"), "N/A\n").unwrap();
        std::fs::write(root.join("mlx5_0/ports/2/counters/port_rcv_data"), "9").unwrap();
        std::fs::write(p1.join("gid_attrs/ndevs/1"), "eth0\n").unwrap();
        let c = sysfs_counters(&root, "mlx5_0", 2);
        assert!(c.contains(&("port_xmit_data", 1234)));
        assert!(c.contains(&("out_of_sequence", 7)));
        assert!(c.contains(&("p2_port_rcv_data", 9)));
        assert_eq!(c.len(), 3);
        assert_eq!(sysfs_netdev(&root, "mlx5_0", 1, Some(1)), "eth0");
        assert_eq!(sysfs_netdev(&root, "mlx5_0", 1, Some(0)), "eth0");
        assert_eq!(sysfs_netdev(&root, "mlx5_0", 2, None), "");
        let net = root.join("net");
        std::fs::create_dir_all(net.join("eth0")).unwrap();
        std::fs::create_dir_all(net.join("lo")).unwrap();
        std::fs::write(net.join("eth0/address"), "52:54:00:77:00:0b\n").unwrap();
        std::fs::write(net.join("lo/address"), "00:00:00:00:00:00\n").unwrap();
        let mut gid = [0u8; 16];
        gid[..6].copy_from_slice(&[0x52, 0x54, 0, 0x77, 0, 0x0b]);
        assert_eq!(netdev_by_mac(&net, &[gid]), "eth0");
        assert_eq!(netdev_by_mac(&net, &[[0; 16]]), "");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
