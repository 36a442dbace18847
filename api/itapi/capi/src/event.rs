//! Events in their C form (`it_event_t`), and the C form of addresses and paths.

use crate::handles;
use crate::types::*;
use bytemuck::Zeroable;
use krdma_itapi::{AffiliatedCause, Event};
use std::cell::Cell;
use std::net::{IpAddr, SocketAddr};

thread_local! {
    /// Private data bytes of the last connection event this thread dequeued.
    static LAST_PDATA_LEN: Cell<usize> = const { Cell::new(0) };
}

pub fn last_private_data_len() -> usize {
    LAST_PDATA_LEN.with(Cell::get)
}

/// Copy private data into an event's fixed array; returns `private_data_present`.
fn private_data(dst: &mut [u8; IT_MAX_PRIV_DATA], src: &[u8]) -> ItBool {
    let n = src.len().min(IT_MAX_PRIV_DATA);
    dst[..n].copy_from_slice(&src[..n]);
    LAST_PDATA_LEN.with(|c| c.set(n));
    (n > 0) as ItBool
}

pub fn net_addr(ip: IpAddr) -> NetAddr {
    let mut a = NetAddr::zeroed();
    match ip {
        IpAddr::V4(v4) => {
            a.addr_type = IT_IPV4;
            a.addr.ipv4 = InAddr(v4.octets());
        }
        IpAddr::V6(v6) => {
            a.addr_type = IT_IPV6;
            a.addr.ipv6 = In6Addr(v6.octets());
        }
    }
    a
}

fn in_addr_union(ip: IpAddr) -> InAddrUnion {
    match ip {
        IpAddr::V4(v4) => InAddrUnion {
            ipv4: InAddr(v4.octets()),
        },
        IpAddr::V6(v6) => InAddrUnion {
            ipv6: In6Addr(v6.octets()),
        },
    }
}

/// The path to `peer` as the transport spells it: IP addresses for iWARP, GIDs (the
/// IPv4-mapped form) for InfiniBand/RoCE.
pub fn path_to(peer: Option<SocketAddr>, local: Option<IpAddr>, ib: bool) -> Path {
    let mut p = Path::zeroed();
    let Some(peer) = peer else { return p };
    let local = local.unwrap_or(match peer.ip() {
        IpAddr::V4(_) => IpAddr::from([0u8; 4]),
        IpAddr::V6(_) => IpAddr::from([0u8; 16]),
    });
    if ib {
        let mut e = IbNetEndpoint::zeroed();
        e.remote_port_gid = In6Addr(gid(peer.ip()));
        e.local_port_gid = In6Addr(gid(local));
        e.hop_limit = 64;
        p.u.ib = e;
    } else {
        p.u.iwarp = IwarpNetEndpoint {
            ip_vers: if peer.is_ipv4() {
                IT_IP_VERS_IPV4
            } else {
                IT_IP_VERS_IPV6
            },
            laddr: in_addr_union(local),
            raddr: in_addr_union(peer.ip()),
        };
    }
    p
}

fn gid(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The C form of `ev`; `ib` selects how paths are spelled.
pub fn to_c(ev: &Event, ib: bool) -> ItEvent {
    let mut c = ItEvent::zeroed();
    let number = ev.number() as u32;
    let evd = handles::evd(ev.evd_id());
    match ev {
        Event::Dto(d) => {
            c.dto_cmpl = DtoCmplEvent {
                event_number: number,
                evd,
                ep: handles::ep(d.ep.id),
                cookie: d.cookie,
                dto_status: d.status as u32,
                transferred_length: d.transferred_length,
                unlinked_mr_handle: std::ptr::null_mut(),
            }
        }
        Event::ConnRequest(r) => {
            let mut e = ConnRequestEvent::zeroed();
            e.event_number = number;
            e.evd = evd;
            e.cn_est_id = r.cn_est_id.0;
            e.conn_qual.type_ = IT_IANA_PORT;
            e.conn_qual.conn_qual.port = r.port.to_be();
            if let Some(src) = r.source {
                e.source_addr = net_addr(src.ip());
            }
            e.spigot_id = r.spigot_id;
            e.max_message_size = u32::MAX;
            e.rdma_read_ird = r.ird;
            e.rdma_read_ord = r.ord;
            e.private_data_present = private_data(&mut e.private_data, &r.private_data);
            c.conn_req = e;
        }
        Event::Connection(k) => {
            let mut e = ConnectionEvent::zeroed();
            e.event_number = number;
            e.evd = evd;
            e.ep = handles::ep(k.ep.id);
            e.rdma_read_ird = k.ird;
            e.rdma_read_ord = k.ord;
            e.dst_path = path_to(k.peer, None, ib);
            e.reject_reason_code = k.reject_reason as u32;
            e.private_data_present = private_data(&mut e.private_data, &k.private_data);
            c.conn = e;
        }
        Event::Affiliated(a) => {
            c.aff_async = AffiliatedEvent {
                event_number: number,
                evd,
                cause: match &a.cause {
                    AffiliatedCause::Ep(e) => handles::ep(e.id),
                    AffiliatedCause::Sevd(s) => handles::evd(s.id),
                    AffiliatedCause::Srq(id) => handles::srq(*id),
                },
            }
        }
        Event::Unaffiliated(u) => {
            c.unaff_async = UnaffiliatedEvent {
                event_number: number,
                evd,
                ia: handles::ia(u.ia),
                spigot_id: u.spigot_id,
            }
        }
        Event::Software(s) => {
            c.sw = SoftwareEvent {
                event_number: number,
                evd,
                data: s.data as usize as *mut std::ffi::c_void,
            }
        }
        Event::AevdNotification(n) => {
            c.aevd_notify = AevdNotificationEvent {
                event_number: number,
                aevd: handles::aevd(n.aevd),
                sevd: handles::evd(n.sevd.id),
            }
        }
    }
    c
}
