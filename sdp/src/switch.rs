//! The offload protocol switch: which transport a socket gets, by a policy file, and a
//! count of every decision.
//!
//! ## Policy file
//!
//! `KRDMA_SDP_CONFIG` names it (default `/etc/krdma/sdp.conf`; none there: the defaults).
//! One rule a line, `#` starts a comment; the first rule that matches decides:
//!
//! ```text
//! use <sdp|tcp|both> <listen|connect|*> <program> <address>[/<prefix>]:<port>[-<port>]
//! device <siw0|rxe0>             # the adapter SDP runs over (KRDMA_SDP_DEVICE wins)
//! connect_timeout <milliseconds> # how long an SDP connect may take before TCP is tried
//! ```
//!
//! `program` is the program's name (`/proc/self/comm`, e.g. `iperf3`) or a glob with `*`;
//! address and port may be `*`. `sdp`: SDP only (a connect fails if the peer has no SDP;
//! a listener takes SDP connections only). `tcp`: leave the socket to the kernel. `both`:
//! a listener takes connections of both kinds on its one port; a connect tries SDP and
//! falls back to TCP when the peer has no SDP — never after a byte has moved. Without a
//! matching rule a socket gets `both`.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What a rule says to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Sdp,
    Tcp,
    Both,
}

/// What the socket is doing when the switch decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Listen,
    Connect,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    use_: Use,
    role: Option<Role>,
    program: String,
    net: Option<(IpAddr, u8)>,
    ports: Option<(u16, u16)>,
}

/// A parsed policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    rules: Vec<Rule>,
    pub device: Option<String>,
    pub connect_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            rules: Vec::new(),
            device: None,
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// A line of the policy file that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy line {line}: {what}")]
pub struct PolicyError {
    pub line: usize,
    pub what: String,
}

fn glob(pattern: &str, s: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == s,
        Some((head, rest)) => {
            if !s.starts_with(head) {
                return false;
            }
            let s = &s[head.len()..];
            (0..=s.len()).any(|i| s.is_char_boundary(i) && glob(rest, &s[i..]))
        }
    }
}

fn in_net(addr: IpAddr, (net, prefix): (IpAddr, u8)) -> bool {
    let addr = match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(addr),
        a => a,
    };
    match (addr, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - prefix.min(32))
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - prefix.min(128))
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

impl Policy {
    /// Read the policy from `text`.
    pub fn parse(text: &str) -> Result<Policy, PolicyError> {
        let mut p = Policy::default();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let err = |what: &str| PolicyError {
                line: i + 1,
                what: format!("{what}: {raw:?}"),
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["device", d] => p.device = Some(d.to_string()),
                ["connect_timeout", ms] => {
                    p.connect_timeout =
                        Duration::from_millis(ms.parse().map_err(|_| err("bad milliseconds"))?)
                }
                ["use", u, role, program, at] => {
                    let use_ = match *u {
                        "sdp" => Use::Sdp,
                        "tcp" => Use::Tcp,
                        "both" => Use::Both,
                        _ => return Err(err("expected sdp, tcp or both")),
                    };
                    let role = match *role {
                        "listen" | "server" => Some(Role::Listen),
                        "connect" | "client" => Some(Role::Connect),
                        "*" => None,
                        _ => return Err(err("expected listen, connect or *")),
                    };
                    let (addr, port) = at
                        .rsplit_once(':')
                        .ok_or_else(|| err("expected address:port"))?;
                    let net = match addr.trim_start_matches('[').trim_end_matches(']') {
                        "*" => None,
                        a => {
                            let (ip, prefix) = match a.split_once('/') {
                                Some((ip, pre)) => (ip, Some(pre)),
                                None => (a, None),
                            };
                            let ip: IpAddr = ip.parse().map_err(|_| err("bad address"))?;
                            let max = if ip.is_ipv4() { 32 } else { 128 };
                            let prefix = match prefix {
                                Some(pre) => pre
                                    .parse()
                                    .ok()
                                    .filter(|n| *n <= max)
                                    .ok_or_else(|| err("bad prefix"))?,
                                None => max,
                            };
                            Some((ip, prefix))
                        }
                    };
                    let ports = match port {
                        "*" => None,
                        ps => {
                            let (lo, hi) = ps.split_once('-').unwrap_or((ps, ps));
                            let lo: u16 = lo.parse().map_err(|_| err("bad port"))?;
                            let hi: u16 = hi.parse().map_err(|_| err("bad port"))?;
                            if lo > hi {
                                return Err(err("empty port range"));
                            }
                            Some((lo, hi))
                        }
                    };
                    p.rules.push(Rule {
                        use_,
                        role,
                        program: program.to_string(),
                        net,
                        ports,
                    });
                }
                _ => return Err(err("unknown line")),
            }
        }
        Ok(p)
    }

    /// The policy of this process: the file `KRDMA_SDP_CONFIG` names, or the default one
    /// if it exists; an unreadable file is reported and the defaults are used.
    pub fn load() -> Policy {
        let path =
            std::env::var("KRDMA_SDP_CONFIG").unwrap_or_else(|_| "/etc/krdma/sdp.conf".into());
        match std::fs::read_to_string(&path) {
            Ok(t) => Policy::parse(&t).unwrap_or_else(|e| {
                tracing::error!(%path, error = %e, "SDP policy unreadable; using the defaults");
                COUNTERS.policy_errors.fetch_add(1, Ordering::Relaxed);
                Policy::default()
            }),
            Err(_) => Policy::default(),
        }
    }

    /// What `program` doing `role` at `addr` gets (for a listener, `addr` is the address
    /// it binds).
    pub fn decide(&self, role: Role, program: &str, addr: SocketAddr) -> Use {
        let d = self
            .rules
            .iter()
            .find(|r| {
                r.role.is_none_or(|x| x == role)
                    && glob(&r.program, program)
                    && r.net
                        .is_none_or(|n| addr.ip().is_unspecified() || in_net(addr.ip(), n))
                    && r.ports
                        .is_none_or(|(lo, hi)| (lo..=hi).contains(&addr.port()))
            })
            .map(|r| r.use_)
            .unwrap_or(Use::Both);
        let c = &COUNTERS;
        match (role, d) {
            (Role::Listen, Use::Sdp) => &c.listen_sdp,
            (Role::Listen, Use::Tcp) => &c.listen_tcp,
            (Role::Listen, Use::Both) => &c.listen_both,
            (Role::Connect, Use::Sdp) => &c.connect_sdp,
            (Role::Connect, Use::Tcp) => &c.connect_tcp,
            (Role::Connect, Use::Both) => &c.connect_both,
        }
        .fetch_add(1, Ordering::Relaxed);
        tracing::debug!(?role, program, %addr, decision = ?d, "offload switch");
        d
    }
}

/// The switch's counters (process-wide).
#[derive(Debug, Default)]
pub struct Counters {
    pub listen_sdp: AtomicU64,
    pub listen_tcp: AtomicU64,
    pub listen_both: AtomicU64,
    pub connect_sdp: AtomicU64,
    pub connect_tcp: AtomicU64,
    pub connect_both: AtomicU64,
    /// Connects that went over SDP.
    pub connected_sdp: AtomicU64,
    /// Connects that tried SDP, found no SDP at the peer and went over TCP.
    pub fallback_tcp: AtomicU64,
    /// Connects refused because the policy said SDP only and the peer had none.
    pub refused_sdp_only: AtomicU64,
    /// Connects that skipped SDP: the peer had none a moment ago (remembered).
    pub skipped_known_tcp: AtomicU64,
    pub accepted_sdp: AtomicU64,
    pub accepted_tcp: AtomicU64,
    /// TCP connections a listener of policy `sdp` turned away.
    pub refused_tcp_on_sdp_listener: AtomicU64,
    /// SDP listeners that could not be made (the socket stayed TCP only).
    pub listen_sdp_failed: AtomicU64,
    pub policy_errors: AtomicU64,
    /// SDP sockets relayed through their faces because the process forked.
    pub relayed_at_fork: AtomicU64,
    /// SDP sockets a fork found that could not be relayed (unusable in the child).
    pub relay_failed: AtomicU64,
    /// SDP connections handed to a listener shared with fork children (as loopback TCP
    /// connections this process relays).
    pub bridged: AtomicU64,
}

pub static COUNTERS: Counters = Counters {
    listen_sdp: AtomicU64::new(0),
    listen_tcp: AtomicU64::new(0),
    listen_both: AtomicU64::new(0),
    connect_sdp: AtomicU64::new(0),
    connect_tcp: AtomicU64::new(0),
    connect_both: AtomicU64::new(0),
    connected_sdp: AtomicU64::new(0),
    fallback_tcp: AtomicU64::new(0),
    refused_sdp_only: AtomicU64::new(0),
    skipped_known_tcp: AtomicU64::new(0),
    accepted_sdp: AtomicU64::new(0),
    accepted_tcp: AtomicU64::new(0),
    refused_tcp_on_sdp_listener: AtomicU64::new(0),
    listen_sdp_failed: AtomicU64::new(0),
    policy_errors: AtomicU64::new(0),
    relayed_at_fork: AtomicU64::new(0),
    relay_failed: AtomicU64::new(0),
    bridged: AtomicU64::new(0),
};

impl Counters {
    pub fn rows(&self) -> Vec<(&'static str, u64)> {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("listen_sdp", g(&self.listen_sdp)),
            ("listen_tcp", g(&self.listen_tcp)),
            ("listen_both", g(&self.listen_both)),
            ("connect_sdp", g(&self.connect_sdp)),
            ("connect_tcp", g(&self.connect_tcp)),
            ("connect_both", g(&self.connect_both)),
            ("connected_sdp", g(&self.connected_sdp)),
            ("fallback_tcp", g(&self.fallback_tcp)),
            ("refused_sdp_only", g(&self.refused_sdp_only)),
            ("skipped_known_tcp", g(&self.skipped_known_tcp)),
            ("accepted_sdp", g(&self.accepted_sdp)),
            ("accepted_tcp", g(&self.accepted_tcp)),
            (
                "refused_tcp_on_sdp_listener",
                g(&self.refused_tcp_on_sdp_listener),
            ),
            ("listen_sdp_failed", g(&self.listen_sdp_failed)),
            ("policy_errors", g(&self.policy_errors)),
            ("relayed_at_fork", g(&self.relayed_at_fork)),
            ("relay_failed", g(&self.relay_failed)),
            ("bridged", g(&self.bridged)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "
        # iperf3 servers take SDP only on 5201; redis clients never offload
        device rxe0
        connect_timeout 500
        use sdp listen iperf3 *:5201
        use tcp connect redis-* *:*
        use tcp * * 10.1.0.0/16:*
        use both connect * [::1]:80-90
    ";

    #[test]
    fn rules_match_in_order() {
        let p = Policy::parse(FILE).unwrap();
        assert_eq!(p.device.as_deref(), Some("rxe0"));
        assert_eq!(p.connect_timeout, Duration::from_millis(500));
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(
            p.decide(Role::Listen, "iperf3", a("0.0.0.0:5201")),
            Use::Sdp
        );
        assert_eq!(
            p.decide(Role::Connect, "iperf3", a("127.0.0.1:5201")),
            Use::Both
        );
        assert_eq!(
            p.decide(Role::Connect, "redis-benchmark", a("127.0.0.1:6379")),
            Use::Tcp
        );
        assert_eq!(p.decide(Role::Connect, "curl", a("10.1.2.3:443")), Use::Tcp);
        assert_eq!(
            p.decide(Role::Connect, "curl", a("[::ffff:10.1.2.3]:443")),
            Use::Tcp
        );
        assert_eq!(
            p.decide(Role::Connect, "curl", a("10.2.2.3:443")),
            Use::Both
        );
        assert_eq!(p.decide(Role::Connect, "curl", a("[::1]:85")), Use::Both);
        assert!(COUNTERS.listen_sdp.load(Ordering::Relaxed) >= 1);
    }

    #[test]
    fn bad_lines_are_reported_with_their_number() {
        let e = Policy::parse("use sdp listen x *:1\nuse maybe * * *:*").unwrap_err();
        assert_eq!(e.line, 2);
        assert!(Policy::parse("use sdp listen x 1.2.3.4/33:1").is_err());
        assert!(Policy::parse("use sdp listen x *:9-3").is_err());
        assert!(Policy::parse("bogus").is_err());
        assert_eq!(Policy::parse("").unwrap(), Policy::default());
    }

    #[test]
    fn globs() {
        assert!(glob("*", "anything"));
        assert!(glob("redis-*", "redis-server"));
        assert!(glob("*perf*", "sockperf"));
        assert!(!glob("nginx", "nginx2"));
    }
}
