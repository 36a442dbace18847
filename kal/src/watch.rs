//! The daemon's watch over the processes that opened contexts.
//!
//! A context ends when its file is closed (FUSE `RELEASE`), but a descriptor inherited
//! by a fork child or passed to another process keeps the file open after its opener is
//! gone, and then no `RELEASE` comes. So one thread waits on every opener's pidfd (which
//! turns readable when the process exits) and, every [`SWEEP`], checks that each opener
//! is still the same program with the same credentials: an opener that exited, exec'd
//! or changed credentials has its context ended at once, whatever holds the file. The
//! thread only reads `/proc` and polls pidfds; ending a context is the owner's callback.

use crate::opener::{Opener, Refusal};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often every opener's program and credentials are checked.
pub const SWEEP: Duration = Duration::from_secs(2);

/// What the watch calls when the opener of `key` is gone or changed.
pub type OnGone = Box<dyn Fn(u64, Refusal) + Send + Sync>;

pub struct Watch {
    epoll: Epoll,
    openers: Mutex<HashMap<u64, Arc<Opener>>>,
    on_gone: OnGone,
}

impl Watch {
    /// A watch that reports to `on_gone` once [`started`](Self::start).
    pub fn new(on_gone: OnGone) -> std::io::Result<Arc<Watch>> {
        Ok(Arc::new(Watch {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?,
            openers: Mutex::new(HashMap::new()),
            on_gone,
        }))
    }

    /// Start the watch thread; it ends when the watch is dropped.
    pub fn start(self: &Arc<Self>) -> std::io::Result<()> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("krdma-watch".into())
            .spawn(move || run(&weak))?;
        Ok(())
    }

    /// Watch `opener` for the context `key`.
    pub fn add(&self, key: u64, opener: Arc<Opener>) -> std::io::Result<()> {
        let mut openers = self.openers.lock();
        self.epoll
            .add(opener.pidfd(), EpollEvent::new(EpollFlags::EPOLLIN, key))?;
        openers.insert(key, opener);
        Ok(())
    }

    pub fn remove(&self, key: u64) {
        if let Some(o) = self.openers.lock().remove(&key) {
            let _ = self.epoll.delete(o.pidfd());
        }
    }

    pub fn len(&self) -> usize {
        self.openers.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The openers that are gone or changed, taken out of the watch.
    fn take_gone(&self, exited: &[u64], sweep: bool) -> Vec<(u64, Refusal)> {
        let mut openers = self.openers.lock();
        let mut gone: Vec<(u64, Refusal)> = exited
            .iter()
            .filter(|k| openers.contains_key(k))
            .map(|k| (*k, Refusal::Exited))
            .collect();
        if sweep {
            gone.extend(
                openers
                    .iter()
                    .filter(|(k, _)| !exited.contains(k))
                    .filter_map(|(k, o)| o.still_same().err().map(|r| (*k, r))),
            );
        }
        for (k, _) in &gone {
            if let Some(o) = openers.remove(k) {
                let _ = self.epoll.delete(o.pidfd());
            }
        }
        gone
    }
}

fn run(watch: &Weak<Watch>) {
    let mut events = vec![EpollEvent::empty(); 64];
    let mut next_sweep = Instant::now() + SWEEP;
    loop {
        let Some(w) = watch.upgrade() else { return };
        // Wake at least every half second to notice the watch being dropped.
        let wait = next_sweep
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(500));
        let timeout = EpollTimeout::try_from(wait).unwrap_or(EpollTimeout::ZERO);
        let n = match w.epoll.wait(&mut events, timeout) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => 0,
            Err(e) => {
                tracing::error!("opener watch stopped: {e}");
                return;
            }
        };
        let exited: Vec<u64> = events[..n].iter().map(|e| e.data()).collect();
        let sweep = Instant::now() >= next_sweep;
        if sweep {
            next_sweep = Instant::now() + SWEEP;
        }
        for (key, why) in w.take_gone(&exited, sweep) {
            tracing::info!(context = key, reason = %why, "context's opener is gone or changed");
            (w.on_gone)(key, why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn an_exited_opener_is_reported_at_once() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = Mutex::new(tx);
        let w = Watch::new(Box::new(move |k, r| {
            let _ = tx.lock().send((k, r));
        }))
        .unwrap();
        w.start().unwrap();
        let mut c = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        w.add(7, Arc::new(Opener::open(c.id()).unwrap())).unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        let killed = Instant::now();
        c.kill().unwrap();
        c.wait().unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            (7, Refusal::Exited)
        );
        eprintln!("reported {:?} after the exit", killed.elapsed());
        assert!(w.is_empty());
    }
}
