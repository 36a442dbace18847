//! What this process's SDP sockets and switch are doing, for `krdma-sdp` (the tool):
//! every process that uses SDP answers on the abstract UNIX socket `@krdma-sdp.<pid>`
//! with a text report — the switch's counters, then one line per connection.

use crate::conn::{hot, Conn};
use crate::reactor::{self, Reactive, Registration};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, Weak};

static CONNS: Mutex<Vec<Weak<Conn>>> = Mutex::new(Vec::new());

/// Count `conn` in the reports.
pub fn track(conn: &Arc<Conn>) {
    let mut c = CONNS.lock().unwrap_or_else(|e| e.into_inner());
    c.retain(|w| w.strong_count() > 0);
    c.push(Arc::downgrade(conn));
}

/// The abstract socket name a process answers on.
pub fn socket_name(pid: u32) -> String {
    format!("krdma-sdp.{pid}")
}

/// This process's report.
pub fn report() -> String {
    let mut out = String::new();
    let program = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    out.push_str(&format!(
        "pid {} program {}\n",
        std::process::id(),
        program.trim()
    ));
    out.push_str("switch");
    for (k, v) in crate::switch::COUNTERS.rows() {
        out.push_str(&format!(" {k}={v}"));
    }
    out.push('\n');
    out.push_str(&format!(
        "waits polled={} slept={}\n",
        hot::WAITS_POLLED.load(Ordering::Relaxed),
        hot::WAITS_SLEPT.load(Ordering::Relaxed)
    ));
    let conns: Vec<Arc<Conn>> = CONNS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for c in conns {
        let (phase, counters, credits) = c.snapshot();
        out.push_str(&format!(
            "conn device={} local={} peer={} phase={:?} credits={} relayed={}",
            c.device_name(),
            c.local,
            c.peer,
            phase,
            credits,
            c.is_relayed()
        ));
        for (k, v) in counters.rows() {
            out.push_str(&format!(" {k}={v}"));
        }
        out.push('\n');
    }
    out
}

struct Server {
    listener: UnixListener,
    _reg: Mutex<Option<Registration>>,
}

impl Reactive for Server {
    fn on_ready(&self) {
        while let Ok((s, _)) = self.listener.accept() {
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(std::time::Duration::from_secs(1)));
            // MSG_NOSIGNAL: a reader that went away must not kill the program.
            let text = report();
            let mut off = 0;
            while off < text.len() {
                match nix::sys::socket::send(
                    std::os::fd::AsRawFd::as_raw_fd(&s),
                    &text.as_bytes()[off..],
                    nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
                ) {
                    Ok(n) if n > 0 => off += n,
                    _ => break,
                }
            }
        }
    }
}

/// Answer report requests from the progress thread (once per process; quietly nothing
/// when the socket cannot be made).
pub fn serve() {
    static SERVER: OnceLock<Option<Arc<Server>>> = OnceLock::new();
    SERVER.get_or_init(|| {
        let addr = UnixAddr::from_abstract_name(socket_name(std::process::id()).as_bytes()).ok()?;
        let listener = UnixListener::bind_addr(&addr).ok()?;
        listener.set_nonblocking(true).ok()?;
        let s = Arc::new(Server {
            listener,
            _reg: Mutex::new(None),
        });
        let me: Weak<dyn Reactive> = Arc::downgrade(&s) as Weak<dyn Reactive>;
        let reg = reactor::register(&[(s.listener.as_fd(), false)], me).ok()?;
        *s._reg.lock().unwrap_or_else(|e| e.into_inner()) = Some(reg);
        Some(s)
    });
}
