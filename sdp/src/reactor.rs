//! The progress thread: one per process, sleeping in `epoll` on the event descriptors of
//! every SDP socket and listener, so the protocol moves (credits go back, completions of
//! zero-copy reads are answered, readiness faces are updated, a last close is noticed)
//! while the program is busy elsewhere or waits in its own `poll`/`epoll` on the faces.

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use std::collections::HashMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// What the progress thread pokes when one of its descriptors is ready.
pub trait Reactive: Send + Sync {
    fn on_ready(&self);

    /// Called about once a second (timers: keep-alive).
    fn on_tick(&self) {}
}

/// How often [`Reactive::on_tick`] runs.
const TICK: std::time::Duration = std::time::Duration::from_secs(1);

struct Reactor {
    epoll: Epoll,
    table: Mutex<HashMap<u64, Weak<dyn Reactive>>>,
    next: AtomicU64,
}

static REACTOR: OnceLock<Arc<Reactor>> = OnceLock::new();

fn reactor() -> &'static Arc<Reactor> {
    REACTOR.get_or_init(|| {
        let r = Arc::new(Reactor {
            epoll: Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).expect("epoll_create"),
            table: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        });
        let run = r.clone();
        std::thread::Builder::new()
            .name("sdp-progress".into())
            .spawn(move || run.run())
            .expect("spawn the SDP progress thread");
        r
    })
}

impl Reactor {
    fn run(&self) {
        let mut events = vec![EpollEvent::empty(); 64];
        let mut next_tick = std::time::Instant::now() + TICK;
        loop {
            let now = std::time::Instant::now();
            if now >= next_tick {
                next_tick = now + TICK;
                let all: Vec<Arc<dyn Reactive>> = self
                    .table
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .filter_map(Weak::upgrade)
                    .collect();
                for w in all {
                    w.on_tick();
                }
            }
            let wait = EpollTimeout::try_from(next_tick.saturating_duration_since(now))
                .unwrap_or(EpollTimeout::NONE);
            let n = match self.epoll.wait(&mut events, wait) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "SDP progress thread: epoll_wait failed");
                    return;
                }
            };
            for ev in &events[..n] {
                let who = self
                    .table
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&ev.data())
                    .and_then(Weak::upgrade);
                if let Some(w) = who {
                    w.on_ready();
                }
            }
        }
    }
}

/// A registration; dropping it removes the descriptors. It holds its own duplicates of
/// them, so it can always take them out of the epoll set, whatever their owners did.
pub struct Registration {
    key: u64,
    fds: Vec<OwnedFd>,
}

/// Watch `fds` (readable, or for `rdhup` the peer's close) for `who`.
pub fn register(
    fds: &[(BorrowedFd<'_>, bool)],
    who: Weak<dyn Reactive>,
) -> std::io::Result<Registration> {
    let r = reactor();
    let key = r.next.fetch_add(1, Ordering::Relaxed);
    r.table
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, who);
    let mut reg = Registration {
        key,
        fds: Vec::new(),
    };
    for (fd, rdhup) in fds {
        // Event descriptors edge-triggered: one wake-up per new event, none while a
        // sleeping caller has the events to itself.
        let flags = if *rdhup {
            EpollFlags::EPOLLRDHUP
        } else {
            EpollFlags::EPOLLIN | EpollFlags::EPOLLET
        };
        let own = fd.try_clone_to_owned()?;
        r.epoll.add(&own, EpollEvent::new(flags, key))?;
        reg.fds.push(own);
    }
    Ok(reg)
}

impl Registration {
    /// Stop watching one descriptor of this registration (e.g. a closed face's back).
    pub fn remove(&mut self, fd: BorrowedFd<'_>) {
        if let Some(i) = self.fds.iter().position(|f| same_file(f.as_fd(), fd)) {
            let f = self.fds.swap_remove(i);
            let _ = reactor().epoll.delete(&f);
        }
    }
}

impl Registration {
    /// Stop (`true`) or go back to (`false`) watching the `index`th descriptor given to
    /// [`register`] (one never removed), readable edge-triggered: while a caller of the
    /// owner sleeps on it itself, a wake-up of this thread would find nothing to do.
    /// Going back reports it at once if it is readable meanwhile.
    pub fn mute(&self, index: usize, muted: bool) -> std::io::Result<()> {
        let fd = self
            .fds
            .get(index)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
        let flags = if muted {
            EpollFlags::empty()
        } else {
            EpollFlags::EPOLLIN | EpollFlags::EPOLLET
        };
        reactor()
            .epoll
            .modify(fd, &mut EpollEvent::new(flags, self.key))?;
        Ok(())
    }

    /// Watch `fd` (one of this registration's) edge-triggered for input, room for output
    /// and the peer's shutdown — a face that has become a data path.
    pub fn watch_data(&mut self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        let own = self
            .fds
            .iter()
            .find(|f| same_file(f.as_fd(), fd))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))?;
        reactor()
            .epoll
            .modify(own, &mut EpollEvent::new(DATA_PATH, self.key))?;
        Ok(())
    }

    /// Also watch `fd` as a data path ([`Registration::watch_data`]).
    pub fn add_data(&mut self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        self.add_with(fd, DATA_PATH)
    }

    /// Also watch `fd`, edge-triggered, for input.
    pub fn add_readable(&mut self, fd: BorrowedFd<'_>) -> std::io::Result<()> {
        self.add_with(fd, EpollFlags::EPOLLIN | EpollFlags::EPOLLET)
    }

    fn add_with(&mut self, fd: BorrowedFd<'_>, flags: EpollFlags) -> std::io::Result<()> {
        let own = fd.try_clone_to_owned()?;
        reactor()
            .epoll
            .add(&own, EpollEvent::new(flags, self.key))?;
        self.fds.push(own);
        Ok(())
    }
}

const DATA_PATH: EpollFlags = EpollFlags::EPOLLIN
    .union(EpollFlags::EPOLLOUT)
    .union(EpollFlags::EPOLLRDHUP)
    .union(EpollFlags::EPOLLET);

fn same_file(a: BorrowedFd<'_>, b: BorrowedFd<'_>) -> bool {
    let id = |f| nix::sys::stat::fstat(f).ok().map(|s| (s.st_dev, s.st_ino));
    id(a).is_some() && id(a) == id(b)
}

impl Drop for Registration {
    fn drop(&mut self) {
        let r = reactor();
        for fd in self.fds.drain(..) {
            let _ = r.epoll.delete(&fd);
        }
        r.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}
