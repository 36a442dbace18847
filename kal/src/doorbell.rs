//! The doorbell reactor of the daemon: one thread waits on every consumer's doorbell
//! eventfd (taken from the consumer with `pidfd_getfd`) and tells the provider's QP
//! engine that its rings have new entries. In embedded mode there is no reactor: the
//! uAL's doorbell calls the provider directly.

use parking_lot::Mutex;
use rnicpi::ProviderQp;
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

type Entries = Mutex<HashMap<u64, (OwnedFd, Weak<dyn ProviderQp>)>>;

pub struct Reactor {
    epoll: Arc<Epoll>,
    entries: Arc<Entries>,
    next: AtomicU64,
}

impl Reactor {
    pub fn start() -> std::io::Result<Reactor> {
        let epoll = Arc::new(Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?);
        let entries: Arc<Entries> = Arc::default();
        let (ep, ent) = (epoll.clone(), entries.clone());
        std::thread::Builder::new()
            .name("krdma-doorbell".into())
            .spawn(move || run(&ep, &ent))?;
        Ok(Reactor {
            epoll,
            entries,
            next: AtomicU64::new(1),
        })
    }

    /// Watch `fd`; each write to it rings `qp`'s doorbell. Returns a token for `remove`.
    pub fn add(&self, fd: OwnedFd, qp: Weak<dyn ProviderQp>) -> std::io::Result<u64> {
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.entries.lock();
        self.epoll
            .add(fd.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, token))?;
        entries.insert(token, (fd, qp));
        Ok(token)
    }

    pub fn remove(&self, token: u64) {
        if let Some((fd, _)) = self.entries.lock().remove(&token) {
            let _ = self.epoll.delete(fd.as_fd());
        }
    }
}

fn run(epoll: &Epoll, entries: &Entries) {
    let mut events = vec![EpollEvent::empty(); 64];
    loop {
        let n = match epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!("doorbell reactor stopped: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            let qp = {
                let entries = entries.lock();
                let Some((fd, qp)) = entries.get(&token) else {
                    continue;
                };
                let mut buf = [0u8; 8];
                // Clear the eventfd counter; a failed read only means another wake raced us.
                let _ = nix::unistd::read(fd.as_fd(), &mut buf);
                qp.upgrade()
            };
            if let Some(qp) = qp {
                qp.doorbell();
            }
        }
    }
}
