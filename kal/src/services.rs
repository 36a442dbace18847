//! LLP management and network-stack interface: the [`KalServices`] the kAL gives
//! providers, answered from the host's own tables (routing, addresses, ARP/ND).

use rnicpi::{IfAddr, KalServices, Result, Route, VerbsError};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;

/// Services backed by the host network stack.
#[derive(Debug, Default)]
pub struct HostServices;

/// Every IPv4/IPv6 address of every interface of the host (`getifaddrs`).
fn host_addresses() -> Vec<IfAddr> {
    let mut out = Vec::new();
    if let Ok(addrs) = nix::ifaddrs::getifaddrs() {
        for a in addrs {
            let Some(sa) = a.address else { continue };
            let ip = if let Some(v4) = sa.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else if let Some(v6) = sa.as_sockaddr_in6() {
                IpAddr::V6(v6.ip())
            } else {
                continue;
            };
            out.push(IfAddr {
                ifname: a.interface_name.clone(),
                addr: ip,
            });
        }
    }
    out
}

/// The link MTU of an interface, from sysfs.
fn interface_mtu(ifname: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl KalServices for HostServices {
    fn addresses(&self) -> Vec<IfAddr> {
        host_addresses()
    }

    fn link_mtu(&self, ifname: &str) -> Option<u32> {
        interface_mtu(ifname)
    }

    fn route(&self, peer: IpAddr) -> Result<Route> {
        // Asking the kernel to connect a UDP socket runs the routing lookup and picks the
        // source address without sending anything.
        let bind: SocketAddr = if peer.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let sock = UdpSocket::bind(bind)?;
        sock.connect(SocketAddr::new(peer, 9))
            .map_err(|_| VerbsError::Unreachable)?;
        let source = sock.local_addr()?.ip();
        let ifname = host_addresses()
            .into_iter()
            .find(|a| a.addr == source)
            .map(|a| a.ifname)
            .ok_or(VerbsError::Unreachable)?;
        let mtu = interface_mtu(&ifname).unwrap_or(1500);
        Ok(Route {
            source,
            ifname,
            mtu,
        })
    }

    fn neighbour(&self, ip: IpAddr) -> Option<[u8; 6]> {
        let IpAddr::V4(v4) = ip else { return None };
        let table = std::fs::read_to_string("/proc/net/arp").ok()?;
        let want = v4.to_string();
        table.lines().skip(1).find_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.first() != Some(&want.as_str()) {
                return None;
            }
            let mut mac = [0u8; 6];
            let parts: Vec<u8> = cols
                .get(3)?
                .split(':')
                .filter_map(|h| u8::from_str_radix(h, 16).ok())
                .collect();
            (parts.len() == 6 && parts.iter().any(|&b| b != 0)).then(|| {
                mac.copy_from_slice(&parts);
                mac
            })
        })
    }

    fn tcp_connect_start(&self, peer: SocketAddr) -> Result<TcpStream> {
        use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage};
        let family = if peer.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        };
        let fd = socket::socket(
            family,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(std::io::Error::from)?;
        match socket::connect(fd.as_raw_fd(), &SockaddrStorage::from(peer)) {
            Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => Ok(TcpStream::from(fd)),
            Err(nix::errno::Errno::ECONNREFUSED) => Err(VerbsError::Refused),
            Err(nix::errno::Errno::ENETUNREACH | nix::errno::Errno::EHOSTUNREACH) => {
                Err(VerbsError::Unreachable)
            }
            Err(e) => Err(std::io::Error::from(e).into()),
        }
    }

    fn tcp_listen(&self, addr: SocketAddr, _backlog: u32) -> Result<TcpListener> {
        TcpListener::bind(addr).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => VerbsError::AddrInUse,
            std::io::ErrorKind::AddrNotAvailable => VerbsError::Unreachable,
            _ => VerbsError::from(e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_route() {
        let r = HostServices.route("127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(r.source, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(r.ifname, "lo");
        assert!(r.mtu >= 1500);
    }

    #[test]
    fn addresses_include_loopback() {
        assert!(host_addresses().iter().any(|a| a.addr.is_loopback()));
    }
}
