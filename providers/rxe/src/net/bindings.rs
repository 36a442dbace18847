//! Which addresses other UDP sockets of this network namespace hold on the device's port.
//!
//! rxe's sockets share their port with `SO_REUSEPORT` (devices on distinct addresses,
//! 127.0.0.x in tests, beside one on every address), which also lets a second socket of
//! the same user bind the very address and port a device holds: krdmad's rxe0 and a
//! program's embedded one, both on every address. Nothing would stop the two then: in raw
//! mode each sees the other's packets and answers them (a REJ for a REQ it has no listener
//! for, a NAK for a PSN it did not expect), in UDP mode the kernel deals the datagrams out
//! between them. So a device refuses to start beside a socket bound to its own address
//! and port ([`holder_beside`]).
//!
//! A device on every address in raw mode also sees the packets to an address another
//! device serves (its raw socket takes every datagram to the port), which the kernel would
//! deliver to that device's socket, not to the wildcard one: those it leaves alone
//! ([`Elsewhere`]). Only a socket of the same user can bind an address on a port a
//! wildcard socket holds, so no other user can take a device's traffic away this way.
//!
//! What sockets are bound comes from `/proc/net/udp`, which lists the UDP sockets of the
//! reading thread's network namespace.

use std::io;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// One IPv4 UDP socket not connected to a peer: the address and port it is bound to and
/// its inode (which tells one's own socket apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Binding {
    pub addr: Ipv4Addr,
    pub port: u16,
    pub inode: u64,
}

/// The unconnected IPv4 UDP sockets of this network namespace.
pub(crate) fn udp4_bindings() -> io::Result<Vec<Binding>> {
    Ok(parse(&std::fs::read_to_string("/proc/net/udp")?))
}

/// The lines of `/proc/net/udp` (`sl local_address rem_address st … uid timeout inode
/// …`, addresses as the kernel's 32-bit value in hex, ports in hex) that are bound and not
/// connected; a line that does not parse is skipped.
fn parse(text: &str) -> Vec<Binding> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, remote, inode) = (f.get(1)?, f.get(2)?, f.get(9)?);
            if *remote != "00000000:0000" {
                return None;
            }
            let (addr, port) = local.split_once(':')?;
            Some(Binding {
                // The address is printed as the in-memory (network order) word read in
                // this host's byte order.
                addr: Ipv4Addr::from(u32::from_str_radix(addr, 16).ok()?.to_ne_bytes()),
                port: u16::from_str_radix(port, 16).ok()?,
                inode: inode.parse().ok()?,
            })
        })
        .collect()
}

/// Another socket bound to exactly `addr` and `port` beside ours (`own_inode`).
pub(crate) fn holder_beside(addr: Ipv4Addr, port: u16, own_inode: u64) -> io::Result<bool> {
    Ok(udp4_bindings()?
        .iter()
        .any(|b| b.addr == addr && b.port == port && b.inode != own_inode))
}

/// How long a reading of the bound addresses is trusted for data packets.
const TRUSTED: Duration = Duration::from_millis(100);
/// For a packet of the connection manager (QP 1) the reading is taken again unless it is
/// this fresh: a device that starts on an address and is connected to at once is seen.
const TRUSTED_FOR_CM: Duration = Duration::from_millis(2);

/// The addresses of this host that UDP sockets hold on one port (devices bound to one
/// address), as a device on every address last read them.
#[derive(Debug)]
pub(crate) struct Elsewhere {
    port: u16,
    addrs: Vec<Ipv4Addr>,
    read_at: Option<Instant>,
}

impl Elsewhere {
    pub(crate) fn new(port: u16) -> Elsewhere {
        Elsewhere {
            port,
            addrs: Vec::new(),
            read_at: None,
        }
    }

    /// Whether a datagram to `dst` belongs to another socket bound to that address on
    /// the port; `cm`: it is a connection manager packet, which must see a fresh reading;
    /// `now`: the time.
    pub(crate) fn serves(&mut self, dst: Ipv4Addr, cm: bool, now: Instant) -> bool {
        let trusted = if cm { TRUSTED_FOR_CM } else { TRUSTED };
        if self
            .read_at
            .is_none_or(|t| now.duration_since(t) >= trusted)
        {
            self.read_at = Some(now);
            match udp4_bindings() {
                Ok(all) => {
                    self.addrs = all
                        .into_iter()
                        .filter(|b| b.port == self.port && !b.addr.is_unspecified())
                        .map(|b| b.addr)
                        .collect();
                }
                Err(e) => tracing::warn!(error = %e, "rxe: cannot read /proc/net/udp"),
            }
        }
        self.addrs.contains(&dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as a little-endian host prints them.
    #[test]
    #[cfg(target_endian = "little")]
    fn proc_net_udp_lines_parse() {
        let text = "   sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n\
            \x20 12: 00000000:12B7 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 4242 2 0000000000000000 0\n\
            \x20 13: 0500007F:12B7 00000000:0000 07 00000000:00000000 00:00000000 00000000  1000        0 4243 2 0000000000000000 0\n\
            \x20 14: 0100007F:9C40 0100007F:12B7 01 00000000:00000000 00:00000000 00000000     0        0 4244 2 0000000000000000 0\n\
            garbage\n";
        let got = parse(text);
        let lo5 = Ipv4Addr::new(127, 0, 0, 5);
        assert_eq!(
            got,
            vec![
                Binding {
                    addr: Ipv4Addr::UNSPECIFIED,
                    port: 4791,
                    inode: 4242
                },
                Binding {
                    addr: lo5,
                    port: 4791,
                    inode: 4243
                },
            ]
        );
    }

    proptest::proptest! {
        /// Lines the kernel would print (bound, some connected) among lines of any text:
        /// exactly the unconnected ones are read, with their address, port and inode,
        /// and nothing panics.
        #[test]
        fn the_unconnected_sockets_are_read_out_of_any_lines(
            lines in proptest::collection::vec(
                (proptest::num::u32::ANY, proptest::num::u16::ANY, proptest::num::u64::ANY,
                 proptest::bool::ANY, "\\PC{0,60}"),
                0..8,
            )
        ) {
            let mut text = String::from("  sl  local_address rem_address   st ...\n");
            let mut want = Vec::new();
            for (i, (addr, port, inode, connected, junk)) in lines.iter().enumerate() {
                let remote = if *connected { "0100007F:12B7" } else { "00000000:0000" };
                text += &format!("{i:4}: {addr:08X}:{port:04X} {remote} 07 00000000:00000000 \
                    00:00000000 00000000 0 0 {inode} 2 0000000000000000 0\n{junk}\n");
                if !connected {
                    want.push(Binding {
                        addr: Ipv4Addr::from(addr.to_ne_bytes()),
                        port: *port,
                        inode: *inode,
                    });
                }
            }
            let got = parse(&text);
            // A junk line may happen to parse too; every real line is there, in order.
            let mut rest = got.iter();
            for w in &want {
                proptest::prop_assert!(rest.any(|g| g == w), "{w:?} missing from {got:?}");
            }
        }
    }

    /// A socket of this test bound to an address is found in this namespace's list, by
    /// address, port and inode.
    #[test]
    fn a_bound_socket_is_listed() {
        use std::os::fd::AsRawFd;
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = sock.local_addr().unwrap().port();
        let inode = super::super::sys::inode(sock.as_raw_fd()).unwrap();
        let all = udp4_bindings().unwrap();
        assert!(all.contains(&Binding {
            addr: Ipv4Addr::LOCALHOST,
            port,
            inode
        }));
        assert!(!holder_beside(Ipv4Addr::LOCALHOST, port, inode).unwrap());
        assert!(holder_beside(Ipv4Addr::LOCALHOST, port, inode + 1).unwrap());
        let mut elsewhere = Elsewhere::new(port);
        assert!(elsewhere.serves(Ipv4Addr::LOCALHOST, false, Instant::now()));
        assert!(!elsewhere.serves(Ipv4Addr::new(127, 0, 0, 2), true, Instant::now()));
    }
}
