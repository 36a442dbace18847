//! The kAL/uAL interface: ioctl command numbers, their fixed-size argument structs, and
//! the event record returned by `read()`. Documented in `docs/abi.md`.
//!
//! Every command is `_IOWR('k', nr, size_of::<Struct>())`: the caller passes the struct,
//! the kAL validates every field, and writes the results back into the same struct. All
//! structs are `#[repr(C)]` plain old data with explicit padding, so any byte pattern is
//! a valid value and the kAL can never be confused by the layout, only by the values.
//!
//! Over 600 lines: the whole ABI kept in one file, as a C header would be, so its version
//! and layouts are reviewed together; the last 50 lines are tests.

use bytemuck::{Pod, Zeroable};

mod convert;

/// Version of this ABI; bumped on any incompatible change.
pub const ABI_VERSION: u32 = 10;
/// The ioctl type letter (a private one: the VFS claims some generic numbers).
pub const IOC_TYPE: u8 = b'k';
/// Most devices `LIST_DEVICES` reports.
pub const MAX_DEVICES: usize = 16;
/// Largest private data in connection calls and events.
pub const MAX_PDATA: usize = rnicpi::MAX_PRIVATE_DATA;

const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOWR(IOC_TYPE, nr, size)` as Linux encodes it.
pub const fn iowr(nr: u8, size: usize) -> u32 {
    ((IOC_READ | IOC_WRITE) << 30)
        | ((size as u32 & 0x3fff) << 16)
        | ((IOC_TYPE as u32) << 8)
        | nr as u32
}

/// Split an ioctl number into (type, nr, size); `None` unless it is `_IOWR`.
pub const fn decode(cmd: u32) -> Option<(u8, u8, usize)> {
    if cmd >> 30 != (IOC_READ | IOC_WRITE) {
        return None;
    }
    Some((
        ((cmd >> 8) & 0xff) as u8,
        (cmd & 0xff) as u8,
        ((cmd >> 16) & 0x3fff) as usize,
    ))
}

/// A fixed-size NUL-padded name.
pub type Name = [u8; 32];

pub fn name_to_str(n: &[u8]) -> &str {
    let end = n.iter().position(|&b| b == 0).unwrap_or(n.len());
    std::str::from_utf8(&n[..end]).unwrap_or("?")
}

pub fn str_to_name<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let b = s.as_bytes();
    let n = b.len().min(N - 1);
    out[..n].copy_from_slice(&b[..n]);
    out
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct QueryAbi {
    /// out: [`ABI_VERSION`].
    pub version: u32,
    /// out: size of one [`EventRecord`].
    pub event_size: u32,
    /// out: this context's id (as `krdma stat` shows it).
    pub context: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct ListDevices {
    /// out: number of entries filled.
    pub count: u32,
    pub _pad: u32,
    /// out: device names; the index is the device number used by other commands.
    pub names: [Name; MAX_DEVICES],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct QueryDevice {
    /// in: device number.
    pub dev: u32,
    /// out: [`rnicpi::Transport`] value.
    pub transport: u8,
    pub atomics: u8,
    pub memory_windows: u8,
    pub phys_port_cnt: u8,
    pub node_guid: u64,
    pub vendor_id: u32,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_inline: u32,
    pub max_cq: u32,
    pub max_cqe: u32,
    pub max_mr: u32,
    pub max_pd: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    pub max_ird: u32,
    pub max_ord: u32,
    /// Largest private data of a connect, an accept and a reject on this device.
    pub pdata_connect: u16,
    pub pdata_accept: u16,
    pub pdata_reject: u16,
    /// out: where the fast path runs: [`FAST_PATH_KAL`], [`FAST_PATH_CONSUMER`] or
    /// [`FAST_PATH_EITHER`].
    pub fast_path: u8,
    pub _pad: u8,
    /// out: address handles the device holds (0: no UD QPs).
    pub max_ah: u32,
    pub max_mr_size: u64,
    pub name: Name,
    /// out, for [`FAST_PATH_CONSUMER`] and [`FAST_PATH_EITHER`]: the user verbs provider
    /// that drives the device in the consumer's process, and its name for the device.
    pub uvp_driver: Name,
    pub uvp_device: Name,
}

/// The device's fast path is shared rings and a doorbell to an engine behind the kAL.
pub const FAST_PATH_KAL: u8 = 0;
/// The device's fast path runs in the consumer's process (`rnicpi::user`); the consumer
/// records what it creates there with [`Mirror`].
pub const FAST_PATH_CONSUMER: u8 = 1;
/// Either: shared rings to the kAL's engine, or (the consumer's choice) the same engine in
/// the consumer's process through the named uVP, its objects recorded with [`Mirror`].
pub const FAST_PATH_EITHER: u8 = 2;

/// `MIRROR`: record an object the consumer created through a device's user verbs provider,
/// so the kAL keeps its resource tree, limits, quotas and pin allowance for it as for an
/// object it created itself. It is destroyed with the command of its kind (`DESTROY_QP`,
/// `DEREG_MR`, ...), and with the context.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Mirror {
    /// in: device number; its fast path must be [`FAST_PATH_CONSUMER`] or
    /// [`FAST_PATH_EITHER`].
    pub dev: u32,
    /// in: one of the `MIRROR_*` kinds.
    pub kind: u32,
    /// in: handles of the parents, 0 for none: an MR, SRQ, memory window or QP names its
    /// PD first; a QP then its send CQ, its receive CQ and its SRQ.
    pub parents: [u32; 4],
    /// in: an MR's first byte and length (charged to the pin allowance).
    pub addr: u64,
    pub length: u64,
    /// out: the handle.
    pub handle: u32,
    pub _pad: u32,
}

pub const MIRROR_PD: u32 = 1;
pub const MIRROR_CQ: u32 = 2;
pub const MIRROR_QP: u32 = 3;
pub const MIRROR_SRQ: u32 = 4;
pub const MIRROR_MR: u32 = 5;
pub const MIRROR_LISTENER: u32 = 6;
/// A memory window (type 2); destroyed with `DEALLOC_MW`.
pub const MIRROR_MW: u32 = 7;
/// An address handle; destroyed with `DESTROY_AH`.
pub const MIRROR_AH: u32 = 8;

pub const MAX_GIDS: usize = 8;

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct QueryPort {
    /// in: device number.
    pub dev: u32,
    /// in: port number (from 1).
    pub port: u8,
    /// out: [`rnicpi::PortState`] value.
    pub state: u8,
    pub _pad: [u8; 2],
    pub active_mtu: u32,
    pub gid_count: u32,
    pub gids: [[u8; 16]; MAX_GIDS],
    pub netdev: [u8; 16],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct AllocPd {
    /// in: device number.
    pub dev: u32,
    /// out: PD handle.
    pub handle: u32,
}

/// Destroy/deallocate/deregister one object by handle (PD, CQ, QP, MR, listener).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Destroy {
    pub handle: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct CreateCq {
    /// in: device number.
    pub dev: u32,
    /// in: requested entries; out: ring capacity (a power of two).
    pub cqe: u32,
    /// in: the caller's memfd (its own fd number) holding the completion ring,
    /// at least `ring_bytes::<Cqe>(capacity)` long.
    pub memfd: i32,
    /// out: CQ handle.
    pub handle: u32,
    /// in: the caller's own descriptor number of one end of a Unix stream socket pair
    /// (made by a process of the caller's user, neither end bound), or -1 for none. The
    /// engine writes a byte to it for a notification armed with `notify::SIGNAL`.
    pub signal: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct CreateQp {
    /// in: PD handle.
    pub pd: u32,
    pub send_cq: u32,
    pub recv_cq: u32,
    /// in: [`rnicpi::QpType`] value.
    pub qp_type: u8,
    pub _pad: [u8; 3],
    /// in/out: requested and granted caps.
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline: u32,
    /// in: memfd holding the send and receive rings, laid out as
    /// [`rnicpi::QpRingLayout::new`]`(max_send_wr, max_recv_wr)` says.
    pub memfd: i32,
    /// in: eventfd the caller writes to ring the doorbell (daemon mode); -1 in embedded mode.
    pub doorbell_fd: i32,
    /// out: QP handle.
    pub handle: u32,
    /// out: QP number on the wire.
    pub qp_num: u32,
    /// in: SRQ handle the QP takes its receives from, or 0 for its own receive queue
    /// (then `max_recv_wr` must be 0 and the receive ring is not used).
    pub srq: u32,
    pub _pad2: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct CreateSrq {
    /// in: PD handle.
    pub pd: u32,
    /// in: requested receive requests; out: ring capacity (a power of two).
    pub max_wr: u32,
    /// in: scatter entries per receive.
    pub max_sge: u32,
    /// in: initial limit (0 = not armed).
    pub limit: u32,
    /// in: the caller's memfd holding the receive ring, `ring_bytes::<Wqe>(capacity)` long.
    pub memfd: i32,
    /// out: SRQ handle.
    pub handle: u32,
}

/// Modify SRQ (in: `limit` arms the limit event, 0 disarms) and Query SRQ (out).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct SrqAttrs {
    pub handle: u32,
    pub max_wr: u32,
    pub max_sge: u32,
    pub limit: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct AllocMw {
    /// in: PD handle.
    pub pd: u32,
    /// out: MW handle.
    pub handle: u32,
    /// out: the window's initial key (index and key byte); bind with a new key byte.
    pub rkey: u32,
    pub _pad: u32,
}

/// `CREATE_AH`: an address handle in a PD, for UD Sends (`rnicpi::Wqe::with_ud` names it
/// by `ah_num`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct CreateAh {
    /// in: PD handle.
    pub pd: u32,
    /// in: the address vector (`rnicpi::AhAttr`).
    pub port: u8,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub flow_label: u32,
    pub dgid: [u8; 16],
    /// out: the handle (destroyed with `DESTROY_AH`).
    pub handle: u32,
    /// out: the provider's number for it, what a UD Send names.
    pub ah_num: u32,
}

impl CreateAh {
    pub fn encode(pd: u32, a: &rnicpi::AhAttr) -> CreateAh {
        CreateAh {
            pd,
            port: a.port,
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
            flow_label: a.flow_label,
            dgid: a.dgid,
            handle: 0,
            ah_num: 0,
        }
    }

    pub fn decode(&self) -> rnicpi::AhAttr {
        rnicpi::AhAttr {
            port: self.port,
            sgid_index: self.sgid_index,
            hop_limit: self.hop_limit,
            traffic_class: self.traffic_class,
            flow_label: self.flow_label,
            dgid: self.dgid,
        }
    }
}

/// Modify QP (in) and Query QP (out).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct QpAttrs {
    pub handle: u32,
    /// [`rnicpi::QpAttrMask`] bits (Modify only).
    pub mask: u32,
    pub state: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub sgid_index: u8,
    pub access: u32,
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub qkey: u32,
    pub pkey_index: u16,
    pub hop_limit: u8,
    pub _pad: u8,
    pub dgid: [u8; 16],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct RegMr {
    /// in: PD handle.
    pub pd: u32,
    /// in: [`rnicpi::Access`] bits.
    pub access: u32,
    /// in: start address in the caller's address space.
    pub addr: u64,
    pub length: u64,
    /// out.
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Listen {
    pub dev: u32,
    pub backlog: u32,
    /// in: address in GID form (IPv4-mapped for IPv4; all zero = any).
    pub addr: [u8; 16],
    /// in: port (0 = pick one); out: the bound port.
    pub port: u16,
    pub _pad: [u8; 2],
    /// out: listener handle.
    pub handle: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Connect {
    /// in: QP handle.
    pub qp: u32,
    pub ird: u32,
    pub ord: u32,
    pub pdata_len: u32,
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: [u8; 6],
    pub pdata: [u8; MAX_PDATA],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Accept {
    /// in: listener handle.
    pub listen: u32,
    /// in: QP handle to bind the connection to.
    pub qp: u32,
    /// in: from the ConnectRequest event.
    pub conn_id: u64,
    pub ird: u32,
    pub ord: u32,
    pub pdata_len: u32,
    pub _pad: u32,
    pub pdata: [u8; MAX_PDATA],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Reject {
    pub listen: u32,
    pub pdata_len: u32,
    pub conn_id: u64,
    pub pdata: [u8; MAX_PDATA],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct Disconnect {
    pub qp: u32,
    /// 0 = orderly, 1 = abortive.
    pub abortive: u32,
}

pub const STAT_ROWS: usize = 64;

/// One context as `krdma stat` shows it.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct ContextRow {
    pub id: u32,
    pub pid: u32,
    pub uid: u32,
    pub pds: u32,
    pub cqs: u32,
    pub qps: u32,
    pub mrs: u32,
    pub listeners: u32,
    pub srqs: u32,
    pub mws: u32,
    pub pinned_bytes: u64,
    pub events_queued: u32,
    pub events_dropped: u32,
    pub ahs: u32,
    pub _pad: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct StatContexts {
    /// in: first row wanted.
    pub start: u32,
    /// out: contexts in the kAL.
    pub total: u32,
    /// out: rows filled.
    pub count: u32,
    pub _pad: u32,
    /// out: pinned bytes over all contexts.
    pub pinned_total: u64,
    pub rows: [ContextRow; STAT_ROWS],
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct CounterRow {
    pub name: Name,
    pub value: u64,
}

/// `StatDevice::dev` asking for the kAL's own counters (quota refusals, refused ring
/// memory and doorbells, what the engines could not do with consumers' rings).
pub const KAL_COUNTERS: u32 = u32::MAX;

#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct StatDevice {
    /// in: device number, or [`KAL_COUNTERS`].
    pub dev: u32,
    /// in: first row wanted.
    pub start: u32,
    /// out.
    pub total: u32,
    pub count: u32,
    pub rows: [CounterRow; STAT_ROWS],
}

/// One event as `read()` returns it. Reads return whole records only.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable)]
pub struct EventRecord {
    /// [`rnicpi::EventKind`] value.
    pub kind: u16,
    /// [`EVENT_UD`]: a UD connection event, whose `ird` and `ord` carry the peer's QP
    /// and Q_Key instead (`rnicpi::Event::ud`, rdma_cm's `param.ud`).
    pub flags: u16,
    /// Handle of the affiliated object (0 when unaffiliated).
    pub handle: u32,
    pub conn_id: u64,
    pub status: i32,
    pub ird: u32,
    pub ord: u32,
    pub pdata_len: u32,
    pub local_addr: [u8; 16],
    pub peer_addr: [u8; 16],
    pub local_port: u16,
    pub peer_port: u16,
    pub _pad1: u32,
    pub pdata: [u8; MAX_PDATA],
}

/// [`EventRecord::flags`]: a UD connection event.
pub const EVENT_UD: u16 = 1;

impl EventRecord {
    pub fn from_event(ev: &rnicpi::Event) -> Self {
        let mut r = EventRecord::zeroed();
        r.kind = ev.kind as u16;
        r.handle = ev.handle;
        r.conn_id = ev.conn_id;
        r.status = ev.status;
        (r.ird, r.ord) = match ev.ud {
            Some(u) => {
                r.flags = EVENT_UD;
                (u.qpn, u.qkey)
            }
            None => (ev.ird, ev.ord),
        };
        if let Some(a) = ev.local {
            (r.local_addr, r.local_port) = rnicpi::sockaddr_to_parts(a);
        }
        if let Some(a) = ev.peer {
            (r.peer_addr, r.peer_port) = rnicpi::sockaddr_to_parts(a);
        }
        let n = ev.private_data.len().min(MAX_PDATA);
        r.pdata[..n].copy_from_slice(&ev.private_data[..n]);
        r.pdata_len = n as u32;
        r
    }

    /// Decode; `None` for an unknown kind.
    pub fn to_event(&self) -> Option<rnicpi::Event> {
        let kind = rnicpi::EventKind::from_u16(self.kind)?;
        let addr = |a: [u8; 16], p: u16| {
            (a != [0; 16] || p != 0).then(|| rnicpi::sockaddr_from_parts(a, p))
        };
        let ud = (self.flags & EVENT_UD != 0).then_some(rnicpi::UdPeer {
            qpn: self.ird,
            qkey: self.ord,
        });
        let (ird, ord) = if ud.is_some() {
            (0, 0)
        } else {
            (self.ird, self.ord)
        };
        Some(rnicpi::Event {
            kind,
            handle: self.handle,
            conn_id: self.conn_id,
            status: self.status,
            ird,
            ord,
            local: addr(self.local_addr, self.local_port),
            peer: addr(self.peer_addr, self.peer_port),
            private_data: self.pdata[..(self.pdata_len as usize).min(MAX_PDATA)].to_vec(),
            ud,
        })
    }
}

pub const EVENT_SIZE: usize = std::mem::size_of::<EventRecord>();

/// The commands. Each constant is the full ioctl number.
/// The command table: number, name, decoded variant and argument struct. Generates the
/// command numbers (`cmd`), their list, and [`Command`], a command decoded from its
/// number and argument bytes before anything executes it (fuser's `Operation` shape).
macro_rules! commands {
    ($($nr:literal $konst:ident $variant:ident($ty:ident);)*) => {
        /// The command numbers: `_IOWR('k', nr, size_of::<argument struct>())`.
        pub mod cmd {
            use super::*;
            use std::mem::size_of;
            $(pub const $konst: u32 = iowr($nr, size_of::<$ty>());)*

            /// Every command with its name, for docs, tracing and fuzzing.
            pub const ALL: &[(u32, &str)] = &[$(($konst, stringify!($konst)),)*];

            pub fn name(cmd: u32) -> &'static str {
                ALL.iter()
                    .find(|(c, _)| *c == cmd)
                    .map(|(_, n)| *n)
                    .unwrap_or("UNKNOWN")
            }
        }

        /// One command with its argument struct, copied out of the caller's bytes (which
        /// may be unaligned). Every byte pattern of the right size is a value; what the
        /// values mean is checked when the command executes.
        #[derive(Debug, Clone, Copy)]
        #[allow(
            clippy::large_enum_variant,
            reason = "a command lives on the stack for one call, as its struct always did"
        )]
        pub enum Command {
            $($variant($ty),)*
        }

        impl Command {
            /// Decode command number `nr` with argument `arg`: `None` for an unknown
            /// number or an argument of the wrong size.
            pub fn decode(nr: u32, arg: &[u8]) -> Option<Command> {
                $(
                    if nr == cmd::$konst {
                        return (arg.len() == std::mem::size_of::<$ty>())
                            .then(|| Command::$variant(bytemuck::pod_read_unaligned(arg)));
                    }
                )*
                None
            }

            /// The argument struct's bytes, as they go back to the caller.
            pub fn arg_bytes(&self) -> &[u8] {
                match self {
                    $(Command::$variant(a) => bytemuck::bytes_of(a),)*
                }
            }

            pub fn name(&self) -> &'static str {
                match self {
                    $(Command::$variant(_) => stringify!($konst),)*
                }
            }
        }
    };
}

commands! {
    0 QUERY_ABI QueryAbi(QueryAbi);
    1 LIST_DEVICES ListDevices(ListDevices);
    2 QUERY_DEVICE QueryDevice(QueryDevice);
    3 QUERY_PORT QueryPort(QueryPort);
    4 ALLOC_PD AllocPd(AllocPd);
    5 DEALLOC_PD DeallocPd(Destroy);
    6 CREATE_CQ CreateCq(CreateCq);
    7 DESTROY_CQ DestroyCq(Destroy);
    8 CREATE_QP CreateQp(CreateQp);
    9 MODIFY_QP ModifyQp(QpAttrs);
    10 QUERY_QP QueryQp(QpAttrs);
    11 DESTROY_QP DestroyQp(Destroy);
    12 REG_MR RegMr(RegMr);
    13 DEREG_MR DeregMr(Destroy);
    14 LISTEN Listen(Listen);
    15 DESTROY_LISTEN DestroyListen(Destroy);
    16 CONNECT Connect(Connect);
    17 ACCEPT Accept(Accept);
    18 REJECT Reject(Reject);
    19 DISCONNECT Disconnect(Disconnect);
    20 STAT_CONTEXTS StatContexts(StatContexts);
    21 STAT_DEVICE StatDevice(StatDevice);
    22 CREATE_SRQ CreateSrq(CreateSrq);
    23 MODIFY_SRQ ModifySrq(SrqAttrs);
    24 QUERY_SRQ QuerySrq(SrqAttrs);
    25 DESTROY_SRQ DestroySrq(Destroy);
    26 ALLOC_MW AllocMw(AllocMw);
    27 DEALLOC_MW DeallocMw(Destroy);
    28 MIRROR Mirror(Mirror);
    29 CREATE_AH CreateAh(CreateAh);
    30 DESTROY_AH DestroyAh(Destroy);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command decodes from an argument of its own size only, and gives back the
    /// same bytes; an unknown number decodes to nothing.
    #[test]
    fn commands_decode_by_number_and_size() {
        for &(nr, name) in cmd::ALL {
            let (_, _, size) = decode(nr).unwrap();
            let arg: Vec<u8> = (0..size).map(|i| i as u8).collect();
            let c = Command::decode(nr, &arg).expect(name);
            assert_eq!(c.name(), name);
            assert_eq!(c.arg_bytes(), &arg[..]);
            assert!(Command::decode(nr, &arg[..size - 1]).is_none(), "{name}");
            let mut longer = arg.clone();
            longer.push(0);
            assert!(Command::decode(nr, &longer).is_none(), "{name}");
        }
        assert!(Command::decode(iowr(200, 8), &[0; 8]).is_none());
    }

    #[test]
    fn every_struct_fits_an_ioctl_and_numbers_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for (c, n) in cmd::ALL {
            let (t, _, size) = decode(*c).unwrap();
            assert_eq!(t, IOC_TYPE);
            assert!(size > 0 && size < 16384, "{n} is {size} bytes");
            assert!(seen.insert(*c), "{n} duplicated");
        }
        assert_eq!(EVENT_SIZE % 8, 0);
    }

    #[test]
    fn ud_event_record_round_trip() {
        let ev = rnicpi::Event::new(rnicpi::EventKind::Established).with_ud(rnicpi::UdPeer {
            qpn: 0x12_3456,
            qkey: 0x0123_4567,
        });
        let r = EventRecord::from_event(&ev);
        assert_eq!((r.flags, r.ird, r.ord), (EVENT_UD, 0x12_3456, 0x0123_4567));
        assert_eq!(r.to_event().unwrap(), ev);
    }

    #[test]
    fn event_record_round_trip() {
        let ev = rnicpi::Event::new(rnicpi::EventKind::ConnectRequest)
            .with_conn(42)
            .with_addrs(
                Some("10.0.0.1:5".parse().unwrap()),
                Some("[::1]:6".parse().unwrap()),
            )
            .with_param(&rnicpi::ConnParam {
                private_data: vec![1, 2, 3],
                ird: 4,
                ord: 5,
            });
        let r = EventRecord::from_event(&ev);
        assert_eq!(r.to_event().unwrap(), ev);
    }
}
