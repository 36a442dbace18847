//! Unmodified Debian programs through the SDP preload library
//! (`libkrdma_sdp_preload.so`), over siw0 and rxe0: iperf3 (several streams, both
//! directions), sockperf (ping-pong and throughput), redis-server with redis-benchmark and
//! a BGSAVE (redis forks; the child must work and the parent's sockets stay up), nginx
//! serving a file to curl and to wrk — in one process, and as a master whose two worker
//! processes accept on its listener (the SDP connections bridged to them). Each with both ends offloaded, and with one end
//! plain TCP (the other end's switch falls back, or accepts TCP beside SDP). The bytes
//! received are checked, and the switch's own report (`krdma-sdp`'s socket) says which
//! transport carried them.
//!
//! Every program runs through the embedded front door (each process its own kAL; rxe0
//! bound to a loopback address of the process's own), and iperf3 also through a
//! `krdmad`. The programs come from Debian (`scripts/test.sh` installs them); without them
//! the test fails under `CI=true` and is skipped with a note otherwise.
//!
//! Over 600 lines: independent tests of the unmodified programs, sharing their process,
//! port and report helpers.

use krdma_tests::{daemon_possible, fill_pattern, private_loopback, Daemon};
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The preload library built with the tests (target/<profile>/).
fn preload() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let p = dir.join("libkrdma_sdp_preload.so");
    assert!(
        p.exists(),
        "{} not built (build the workspace: cargo build -p krdma-sdp-preload)",
        p.display()
    );
    p
}

fn have(program: &str) -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(program).exists()))
        .unwrap_or(false)
        || Path::new("/usr/sbin").join(program).exists();
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "{program} missing: scripts/test.sh installs it"
        );
        eprintln!("skipped: {program} not installed (scripts/test.sh installs it)");
    }
    found
}

/// How one end runs: offloaded or not, on which adapter, through which front door.
#[derive(Clone)]
struct End {
    offload: bool,
    device: &'static str,
    /// `embedded`, or a krdmad device path.
    front: String,
    /// This end's rxe0 address (embedded front door).
    rxe_addr: IpAddr,
    /// Both ends are offloaded: every connect must go over SDP, however slow the machine.
    both: bool,
}

/// The policy of cases with both ends offloaded: the default rules, and a connect timeout
/// far beyond the default 2 s, so a machine loaded by other work (CI runs the suite next
/// to anything) does not turn a slow SDP connect into a TCP fallback the test would count.
fn patient_policy() -> &'static Path {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let p = std::env::temp_dir().join(format!("krdma-sdp-patient-{}.conf", std::process::id()));
        std::fs::write(&p, "connect_timeout 30000\n").unwrap();
        p
    })
}

impl End {
    /// A client `program` run as this end, killed after two minutes (a hang fails the
    /// test, it does not stall the suite).
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new("timeout");
        c.args(["-k", "5", "120", program]);
        self.env(c)
    }

    /// A server `program` run as this end (its pid is the program's: the test asks it for
    /// its SDP report; it is killed when the test is done with it).
    fn server(&self, program: &str) -> Command {
        use std::os::unix::process::CommandExt;
        let mut c = self.env(Command::new(program));
        c.process_group(0);
        c
    }

    fn env(&self, mut c: Command) -> Command {
        c.env_remove("LD_PRELOAD");
        if self.offload {
            c.env("LD_PRELOAD", preload())
                .env("KRDMA_DEVICE", &self.front)
                .env("KRDMA_SDP_DEVICE", self.device)
                .env("KRDMA_RXE_ADDR", self.rxe_addr.to_string())
                .env(
                    "KRDMA_SDP_CONFIG",
                    if self.both {
                        patient_policy()
                    } else {
                        Path::new("/nonexistent")
                    },
                );
        }
        c.stdin(Stdio::null());
        c
    }
}

/// A server process, killed on drop.
/// A server program, in a process group of its own ([`End::server`]); dropping it kills
/// the group — the program and whatever it forked (nginx's workers outlive a killed
/// master, and held their sockets and rxe0 addresses until the machine was cleaned).
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let group = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait until a socket listens on TCP port `at` (every listener of ours listens on TCP
/// too), as the kernel's table shows it. Never by connecting: a probe is a client to the
/// server — iperf3 takes it for a test that failed, closes its listening socket and opens
/// a new one, and a real client that came in between is reset.
fn wait_listening(at: SocketAddr, server: &mut Server) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = server.0.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(e) = server.0.stderr.as_mut() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("server exited early ({st}): {err}");
        }
        if krdma_tests::tcp_listening(at.port()) {
            return;
        }
        assert!(Instant::now() < deadline, "nothing listens at {at}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The inode of the socket listening on `port`, once it is not `previous`.
fn next_listener(port: u16, previous: Option<u64>, server: &mut Server) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match krdma_tests::tcp_listener(port) {
            Some(inode) if Some(inode) != previous => return inode,
            _ => {}
        }
        if let Some(st) = server.0.try_wait().unwrap() {
            panic!("server exited ({st})");
        }
        assert!(
            Instant::now() < deadline,
            "no new listening socket on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(mut c: Command, what: &str) -> Output {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// The SDP report of a running offloaded process (its `krdma-sdp` socket).
fn report(pid: u32) -> String {
    use std::os::linux::net::SocketAddrExt;
    let a = std::os::unix::net::SocketAddr::from_abstract_name(format!("krdma-sdp.{pid}")).unwrap();
    let mut s = match std::os::unix::net::UnixStream::connect_addr(&a) {
        Ok(s) => s,
        Err(_) => return String::new(),
    };
    let mut t = String::new();
    let _ = s.read_to_string(&mut t);
    t
}

fn counter(report: &str, name: &str) -> u64 {
    report
        .split_whitespace()
        .filter_map(|w| w.strip_prefix(&format!("{name}=")))
        .filter_map(|v| v.parse::<u64>().ok())
        .sum()
}

/// The cases: (server offloaded, client offloaded).
const CASES: [(bool, bool); 3] = [(true, true), (true, false), (false, true)];

/// The two ends of case `n`; `daemon`: both through this krdmad (whose rxe0 serves one
/// address for every process), else each end with an embedded kAL and an rxe0 address of
/// its own.
fn ends(
    device: &'static str,
    daemon: Option<&Daemon>,
    server_off: bool,
    client_off: bool,
    n: u8,
) -> (End, End) {
    let (front, s_addr, c_addr) = match daemon {
        Some(d) => (d.path.display().to_string(), d.rxe_addr, d.rxe_addr),
        None => (
            "embedded".to_string(),
            private_loopback(20 + 2 * n),
            private_loopback(21 + 2 * n),
        ),
    };
    let s = End {
        offload: server_off,
        device,
        front,
        rxe_addr: IpAddr::V4(s_addr),
        both: server_off && client_off,
    };
    let c = End {
        offload: client_off,
        rxe_addr: IpAddr::V4(c_addr),
        ..s.clone()
    };
    (s, c)
}

/// Where the client reaches the server: over rxe0 the address the server's rxe0 serves
/// (its TCP listener, on every address, serves it too).
fn server_ip(s: &End) -> IpAddr {
    if s.device == "rxe0" {
        s.rxe_addr
    } else {
        IpAddr::from([127, 0, 0, 1])
    }
}

fn free_port() -> u16 {
    krdma_tests::free_sdp_port()
}

// ---------------------------------------------------------------------------------------

fn iperf3_case(device: &'static str, daemon: Option<&Daemon>, (so, co): (bool, bool), n: u8) {
    let (s, c) = ends(device, daemon, so, co, n);
    let front = &s.front;
    let p = free_port();
    let ip = server_ip(&s);
    let mut server = Server(
        s.server("iperf3")
            .args(["-s", "-p", &p.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_listening(SocketAddr::new(ip, p), &mut server);
    let mut listener = None;
    for args in [&["-P", "4"][..], &["-R"][..]] {
        // iperf3 closes its listening socket after every test and opens a new one; a
        // client that comes in between is reset (iperf3's own race, with TCP as well).
        // The next test starts once the new socket listens.
        listener = Some(next_listener(p, listener, &mut server));
        let out = run(
            {
                let mut cmd = c.command("iperf3");
                cmd.args(["-c", &ip.to_string(), "-p", &p.to_string(), "-t", "2", "-J"])
                    .args(args);
                cmd
            },
            "iperf3 client",
        );
        let json = String::from_utf8_lossy(&out.stdout);
        // Bytes sent and received over the whole run, as the two ends counted them.
        let sent = json_number_after(&json, "\"sum_sent\"", "\"bytes\"");
        let received = json_number_after(&json, "\"sum_received\"", "\"bytes\"");
        eprintln!("iperf3 {device} {front} server_sdp={so} client_sdp={co} {args:?}: sent {sent} received {received}");
        assert!(received > 1_000_000, "almost nothing moved: {json}");
        // What the sender counted but the receiver had not read when the clock stopped is
        // at most a socket buffer or so (as with TCP); never more arrives than was sent.
        assert!(
            received <= sent && sent - received <= 64 << 20,
            "sent {sent}, received {received}"
        );
    }
    if so {
        let r = report(server.0.id());
        let (sdp, tcp) = (counter(&r, "accepted_sdp"), counter(&r, "accepted_tcp"));
        eprintln!("server switch: accepted_sdp={sdp} accepted_tcp={tcp}");
        if co {
            assert!(sdp >= 5 && tcp <= 1, "both ends offloaded: {r}");
        } else {
            assert_eq!(sdp, 0, "{r}");
            assert!(tcp >= 5, "{r}");
        }
    }
}

fn json_number_after(json: &str, section: &str, key: &str) -> u64 {
    let at = json
        .rfind(section)
        .unwrap_or_else(|| panic!("no {section} in {json}"));
    let rest = &json[at..];
    let k = rest.find(key).unwrap() + key.len();
    rest[k..]
        .trim_start_matches([':', ' ', '\t'])
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect::<String>()
        .parse::<f64>()
        .unwrap() as u64
}

fn iperf3(device: &'static str) {
    if !have("iperf3") {
        return;
    }
    krdma_tests::init_logging();
    for (i, case) in CASES.iter().enumerate() {
        iperf3_case(device, None, *case, i as u8);
    }
    if daemon_possible() {
        let d = Daemon::start();
        iperf3_case(device, Some(&d), (true, true), 5);
    }
}

#[test]
fn iperf3_siw0() {
    iperf3("siw0");
}

#[test]
fn iperf3_rxe0() {
    iperf3("rxe0");
}

/// The local ports of the UDP sockets process `pid` holds, and how many raw sockets.
fn udp_ports_and_raw(pid: u32) -> (Vec<u16>, usize) {
    let inodes: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect();
    let (mut ports, mut raw) = (Vec::new(), 0);
    for (table, is_raw) in [
        ("udp", false),
        ("udp6", false),
        ("raw", true),
        ("raw6", true),
    ] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for f in text
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
        {
            let Some(inode) = f.get(9).and_then(|i| i.parse::<u64>().ok()) else {
                continue;
            };
            if !inodes.contains(&inode) {
                continue;
            }
            if is_raw {
                raw += 1;
            } else if let Some(port) = f[1].rsplit(':').next() {
                ports.push(u16::from_str_radix(port, 16).unwrap());
            }
        }
    }
    (ports, raw)
}

/// A program moved onto SDP over siw0 through the embedded front door holds no RoCE port:
/// the preload library starts its kAL without rxe0, which would serve UDP 4791 (of every
/// address, unless told one) beside krdmad, the kernel's rxe and every other such
/// program. Over rxe0 the same program does hold it (what the check looks for is there).
#[test]
fn programs_on_siw0_leave_the_roce_port_alone() {
    if !have("iperf3") {
        return;
    }
    for (device, n) in [("siw0", 40), ("rxe0", 41)] {
        let p = free_port();
        let mut server = Server(
            Command::new("iperf3")
                .args(["-s", "-p", &p.to_string()])
                .env("LD_PRELOAD", preload())
                .env("KRDMA_DEVICE", "embedded")
                .env("KRDMA_SDP_DEVICE", device)
                .env("KRDMA_RXE_ADDR", private_loopback(n).to_string())
                .env("KRDMA_SDP_CONFIG", "/nonexistent")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        wait_listening(
            SocketAddr::new(IpAddr::from([127, 0, 0, 1]), p),
            &mut server,
        );
        let pid = server.0.id();
        let deadline = Instant::now() + Duration::from_secs(20);
        // The SDP listener opens the adapter (and so starts the kAL) when the program
        // listens: over siw0 it listens on the transport's port (the SDP port + 10000)
        // once the kAL is up; over rxe0 the device's socket appears.
        loop {
            let (ports, raw) = udp_ports_and_raw(pid);
            let up = if device == "siw0" {
                krdma_tests::tcp_listening(p + 10000)
            } else {
                ports.contains(&4791)
            };
            if up {
                if device == "siw0" {
                    assert!(!ports.contains(&4791), "siw0: UDP ports {ports:?}");
                    assert_eq!(raw, 0, "siw0: raw sockets");
                }
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{device}: the adapter never came up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

// ---------------------------------------------------------------------------------------

fn sockperf(device: &'static str) {
    if !have("sockperf") {
        return;
    }
    for (i, &(so, co)) in CASES.iter().enumerate() {
        let (s, c) = ends(device, None, so, co, i as u8);
        let p = free_port();
        let ip = server_ip(&s);
        let mut server = Server(
            s.server("sockperf")
                .args(["sr", "--tcp", "-i", "0.0.0.0", "-p", &p.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        wait_listening(SocketAddr::new(ip, p), &mut server);
        let pp = run(
            {
                let mut cmd = c.command("sockperf");
                cmd.args([
                    "pp",
                    "--tcp",
                    "-i",
                    &ip.to_string(),
                    "-p",
                    &p.to_string(),
                    "-t",
                    "1",
                    "-m",
                    "64",
                ]);
                cmd
            },
            "sockperf ping-pong",
        );
        let text =
            String::from_utf8_lossy(&pp.stdout).to_string() + &String::from_utf8_lossy(&pp.stderr);
        assert!(text.contains("Summary: Latency is"), "{text}");
        // sockperf checks every reply's sequence number and size; it reports mismatches.
        assert!(!text.contains("ERROR"), "{text}");
        let tp = run(
            {
                let mut cmd = c.command("sockperf");
                cmd.args([
                    "tp",
                    "--tcp",
                    "-i",
                    &ip.to_string(),
                    "-p",
                    &p.to_string(),
                    "-t",
                    "1",
                    "-m",
                    "16384",
                ]);
                cmd
            },
            "sockperf throughput",
        );
        let text =
            String::from_utf8_lossy(&tp.stdout).to_string() + &String::from_utf8_lossy(&tp.stderr);
        assert!(text.contains("BandWidth is"), "{text}");
        eprintln!("sockperf {device} server_sdp={so} client_sdp={co} ok");
    }
}

#[test]
fn sockperf_siw0() {
    sockperf("siw0");
}

/// sockperf's ping-pong blocks in `recv` (no poll, select or epoll). With the embedded kAL
/// the waits of its blocking calls end while the caller polls — the engine receives in
/// the caller's thread, no wake-up in between (`krdma_sdp::conn::hot`). Through krdmad
/// the same holds for siw0, whose engine the programs run themselves (`FastPath::Either`);
/// rxe0's engine is the daemon's, where polls drive nothing. With polling turned off
/// (`KRDMA_SDP_SPIN_US=0`) and on rxe0 through krdmad every wait sleeps. The server's SDP
/// report counts both.
fn blocking_calls_poll(device: &'static str) {
    if !have("sockperf") {
        return;
    }
    let daemon = daemon_possible().then(Daemon::start);
    let mut runs = vec![(None, None, true), (None, Some("0"), false)];
    if let Some(d) = &daemon {
        runs.push((Some(d), None, device == "siw0"));
    }
    for (n, (d, spin, polls)) in runs.into_iter().enumerate() {
        let (s, c) = ends(device, d, true, true, 10 + n as u8);
        let p = free_port();
        let ip = server_ip(&s);
        let mut sv = s.server("sockperf");
        if let Some(v) = spin {
            sv.env("KRDMA_SDP_SPIN_US", v);
        }
        let mut server = Server(
            sv.args(["sr", "--tcp", "-i", "0.0.0.0", "-p", &p.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        wait_listening(SocketAddr::new(ip, p), &mut server);
        // A loaded machine may turn a connect into a TCP fallback, or keep the two
        // processes from running together for a whole second: ping-pong again, a few
        // times, until an SDP connection shows what is asked.
        let mut last = String::new();
        let shown = (0..5).any(|_| {
            let mut cl = c.command("sockperf");
            if let Some(v) = spin {
                cl.env("KRDMA_SDP_SPIN_US", v);
            }
            cl.args(["pp", "--tcp", "-i", &ip.to_string(), "-p", &p.to_string()])
                .args(["-t", "1", "-m", "64"]);
            let out = run(cl, "sockperf ping-pong");
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(text.contains("Summary: Latency is"), "{text}");
            last = report(server.0.id());
            let (polled, slept) = (counter(&last, "polled"), counter(&last, "slept"));
            eprintln!(
                "{device} {} spin {spin:?}: waits polled {polled}, slept {slept}",
                s.front
            );
            if counter(&last, "accepted_sdp") == 0 {
                return false;
            }
            if polls {
                polled > 0
            } else {
                assert_eq!(polled, 0, "{last}");
                slept > 0
            }
        });
        assert!(shown, "{last}");
    }
}

#[test]
fn blocking_calls_poll_siw0() {
    blocking_calls_poll("siw0");
}

#[test]
fn blocking_calls_poll_rxe0() {
    blocking_calls_poll("rxe0");
}

#[test]
fn sockperf_rxe0() {
    sockperf("rxe0");
}

// ---------------------------------------------------------------------------------------

fn redis(device: &'static str) {
    if !have("redis-server") || !have("redis-benchmark") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("krdma-sdp-redis-{}-{device}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (i, &(so, co)) in CASES.iter().enumerate() {
        let (s, c) = ends(device, None, so, co, i as u8);
        let p = free_port();
        let ip = server_ip(&s);
        let mut server = Server(
            s.server("redis-server")
                .args([
                    "--port",
                    &p.to_string(),
                    "--bind",
                    "0.0.0.0",
                    "--protected-mode",
                    "no",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ])
                .arg("--dir")
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        wait_listening(SocketAddr::new(ip, p), &mut server);
        let cli = |args: &[&str]| {
            let mut cmd = c.command("redis-cli");
            cmd.args(["-h", &ip.to_string(), "-p", &p.to_string()])
                .args(args);
            String::from_utf8_lossy(&run(cmd, "redis-cli").stdout)
                .trim()
                .to_string()
        };
        // A value of 300 KB through SET and GET, byte for byte.
        let mut v = vec![0u8; 300_000];
        fill_pattern(&mut v, 7);
        let value: String = v.iter().map(|b| (b'a' + b % 26) as char).collect();
        let set = {
            use std::io::Write;
            let mut cmd = c.command("redis-cli");
            cmd.args([
                "-h",
                &ip.to_string(),
                "-p",
                &p.to_string(),
                "-x",
                "SET",
                "k",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            let mut ch = cmd.spawn().unwrap();
            ch.stdin
                .take()
                .unwrap()
                .write_all(value.as_bytes())
                .unwrap();
            ch.wait_with_output().unwrap()
        };
        assert_eq!(
            String::from_utf8_lossy(&set.stdout).trim(),
            "OK",
            "{}",
            String::from_utf8_lossy(&set.stderr)
        );
        assert_eq!(cli(&["GET", "k"]), value, "the value came back changed");
        let bench = run(
            {
                let mut cmd = c.command("redis-benchmark");
                cmd.args([
                    "-h",
                    &ip.to_string(),
                    "-p",
                    &p.to_string(),
                    "-n",
                    "3000",
                    "-c",
                    "4",
                    "-t",
                    "set,get,lpush",
                    "-q",
                ]);
                cmd
            },
            "redis-benchmark",
        );
        let text = String::from_utf8_lossy(&bench.stdout);
        assert!(text.matches("requests per second").count() >= 3, "{text}");
        // BGSAVE: redis forks a child that writes the dump; the parent's sockets go on.
        let saves_before = cli(&["INFO", "persistence"]);
        assert!(
            saves_before.contains("rdb_bgsave_in_progress"),
            "{saves_before}"
        );
        assert!(cli(&["BGSAVE"]).contains("Background saving started"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let info = cli(&["INFO", "persistence"]);
            if info.contains("rdb_bgsave_in_progress:0")
                && info.contains("rdb_last_bgsave_status:ok")
                && dir.join("dump.rdb").exists()
            {
                break;
            }
            assert!(Instant::now() < deadline, "BGSAVE did not finish: {info}");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(cli(&["GET", "k"]), value, "after the fork");
        if so {
            let r = report(server.0.id());
            eprintln!(
                "redis {device} server_sdp={so} client_sdp={co}: accepted_sdp={} accepted_tcp={}",
                counter(&r, "accepted_sdp"),
                counter(&r, "accepted_tcp")
            );
            if co {
                assert!(counter(&r, "accepted_sdp") >= 6, "{r}");
            } else {
                assert_eq!(counter(&r, "accepted_sdp"), 0, "{r}");
            }
        }
        let _ = std::fs::remove_file(dir.join("dump.rdb"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn redis_siw0() {
    redis("siw0");
}

#[test]
fn redis_rxe0() {
    redis("rxe0");
}

// ---------------------------------------------------------------------------------------

/// nginx serving a file to curl and to wrk; with `master`, two worker processes forked by
/// the master accept on its listener.
fn nginx(device: &'static str, master: bool) {
    if !have("nginx") || !have("curl") || !have("wrk") {
        return;
    }
    let dir = std::env::temp_dir().join(format!(
        "krdma-sdp-nginx-{}-{device}-{master}",
        std::process::id()
    ));
    let processes = if master {
        "master_process on; worker_processes 2;"
    } else {
        "master_process off; worker_processes 1;"
    };
    std::fs::create_dir_all(dir.join("www")).unwrap();
    let mut file = vec![0u8; 3 << 20];
    fill_pattern(&mut file, 99);
    std::fs::write(dir.join("www/blob"), &file).unwrap();
    std::fs::write(dir.join("www/small"), b"hello over SDP\n").unwrap();
    for (i, &(so, co)) in CASES.iter().enumerate() {
        let (s, c) = ends(device, None, so, co, i as u8);
        let p = free_port();
        let ip = server_ip(&s);
        let conf = dir.join(format!("nginx-{i}.conf"));
        std::fs::write(
            &conf,
            format!(
                "daemon off; {processes} pid {d}/nginx-{i}.pid; error_log stderr warn;
                 events {{ worker_connections 256; }}
                 http {{ access_log off; sendfile on; keepalive_requests 100000;
                   client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};
                   server {{ listen {p}; root {d}/www; }} }}\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let mut server = Server(
            s.server("nginx")
                .arg("-c")
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        wait_listening(SocketAddr::new(ip, p), &mut server);
        let got = run(
            {
                let mut cmd = c.command("curl");
                cmd.args(["-sS", "--fail", &format!("http://{ip}:{p}/blob")]);
                cmd
            },
            "curl",
        );
        assert_eq!(got.stdout.len(), file.len());
        assert!(got.stdout == file, "the file arrived changed");
        let w = run(
            {
                let mut cmd = c.command("wrk");
                cmd.args([
                    "-t",
                    "1",
                    "-c",
                    "4",
                    "-d",
                    "1s",
                    &format!("http://{ip}:{p}/small"),
                ]);
                cmd
            },
            "wrk",
        );
        let text = String::from_utf8_lossy(&w.stdout);
        assert!(text.contains("Requests/sec"), "{text}");
        assert!(!text.contains("Non-2xx"), "{text}");
        assert!(!text.contains("Socket errors"), "{text}");
        if so {
            let r = report(server.0.id());
            eprintln!(
                "nginx {device} master={master} server_sdp={so} client_sdp={co}: accepted_sdp={} accepted_tcp={} bridged={}",
                counter(&r, "accepted_sdp"),
                counter(&r, "accepted_tcp"),
                counter(&r, "bridged")
            );
            // The master's report: with workers, the connections it bridged to them (the
            // workers, fork children, answer no reports).
            let sdp = if master { "bridged" } else { "accepted_sdp" };
            if co {
                assert!(counter(&r, sdp) >= 5, "{r}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn nginx_curl_wrk_siw0() {
    nginx("siw0", false);
}

#[test]
fn nginx_curl_wrk_rxe0() {
    nginx("rxe0", false);
}

#[test]
fn nginx_workers_siw0() {
    nginx("siw0", true);
}

#[test]
fn nginx_workers_rxe0() {
    nginx("rxe0", true);
}
