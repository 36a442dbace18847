//! Doorbells of daemon-mode QPs: each context has its own doorbell thread, which waits
//! on the eventfds the context's QPs were created with (taken from the consumer with
//! `pidfd_getfd`) and tells the provider's QP engine that its rings have new entries.
//! In embedded mode the uAL's doorbell calls the provider directly, unless the consumer
//! passed an eventfd, which then gets a doorbell thread of its own too.
//!
//! Nothing here can be stalled by a tenant for anyone else:
//!
//! * a doorbell must be an eventfd, non-blocking when it is handed over ([`verify`]), and
//!   it is only ever read with `RWF_NOWAIT` — whatever the consumer later does to the
//!   file's flags, or however many threads of its own drain it, the read never blocks;
//! * the epoll is edge-triggered, so a doorbell never needs reading to stop it firing
//!   (the read only keeps the counter from saturating);
//! * no lock is held across a read or a provider call;
//! * the provider work a doorbell starts (`ProviderQp::doorbell`) runs on the thread of
//!   the context the QP belongs to, never on a thread another tenant's QPs share: a
//!   provider that blocks there (a peer that stops reading, a fault on the tenant's
//!   memory) stalls only that tenant.

use crate::quota::Charge;
use parking_lot::Mutex;
use rnicpi::ProviderQp;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

/// Why a descriptor was refused as a doorbell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DoorbellError {
    #[error("doorbell is not an eventfd")]
    NotEventfd,
    #[error("doorbell eventfd is not non-blocking (EFD_NONBLOCK)")]
    Blocking,
    #[error("doorbell thread or epoll could not be set up (errno {0})")]
    Io(i32),
}

impl From<DoorbellError> for rnicpi::VerbsError {
    fn from(e: DoorbellError) -> Self {
        match e {
            DoorbellError::NotEventfd | DoorbellError::Blocking => rnicpi::VerbsError::Invalid,
            DoorbellError::Io(_) => rnicpi::VerbsError::Io,
        }
    }
}

/// Check that `fd` is a non-blocking eventfd: the only kind of file a doorbell may be (a
/// FUSE file, a pipe or a socket could block or fault whoever touches it).
pub fn verify(fd: BorrowedFd<'_>) -> Result<(), DoorbellError> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|_| DoorbellError::NotEventfd)?;
    if link.as_os_str() != "anon_inode:[eventfd]" {
        return Err(DoorbellError::NotEventfd);
    }
    let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)
        .map_err(|e| DoorbellError::Io(e as i32))?;
    if flags & libc::O_NONBLOCK == 0 {
        return Err(DoorbellError::Blocking);
    }
    Ok(())
}

/// Clear an eventfd's counter without ever waiting: `RWF_NOWAIT` makes the read fail with
/// `EAGAIN` instead of blocking, whatever the file's own flags say.
fn drain(fd: BorrowedFd<'_>) {
    let mut buf = [0u8; 8];
    let iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: one iovec describing our 8-byte buffer, valid for the call; offset -1 means
    // "current position", which eventfds ignore.
    let _ = unsafe { libc::preadv2(fd.as_raw_fd(), &iov, 1, -1, libc::RWF_NOWAIT) };
}

/// Token of the context's stop eventfd in its epoll.
const STOP: u64 = 0;

type Entries = HashMap<u64, (Arc<OwnedFd>, Weak<dyn ProviderQp>)>;

struct Shared {
    epoll: Epoll,
    entries: Mutex<Entries>,
    stop: OwnedFd,
    /// Doorbells served, over every context of the kAL (`krdma stat`).
    rung: Arc<AtomicU64>,
}

/// One context's doorbells, with the thread that serves them (started with the first).
pub struct Doorbells {
    ctx: u32,
    running: Mutex<Option<Running>>,
    next: AtomicU64,
    rung: Arc<AtomicU64>,
}

struct Running {
    shared: Arc<Shared>,
    /// The thread, charged to the opener's thread quota.
    _thread: Charge,
}

impl Doorbells {
    /// The doorbells of context `ctx`; each one served is counted in `rung`.
    pub fn new(ctx: u32, rung: Arc<AtomicU64>) -> Self {
        Doorbells {
            ctx,
            running: Mutex::new(None),
            next: AtomicU64::new(STOP + 1),
            rung,
        }
    }

    /// Watch `fd` (already [`verify`]-ed); each write to it rings `qp`'s doorbell. The
    /// context's thread is started by the first call, with `thread`, a charge taken
    /// only then. Returns a token for [`Doorbells::remove`].
    pub fn add(
        &self,
        fd: OwnedFd,
        qp: Weak<dyn ProviderQp>,
        thread: impl FnOnce() -> rnicpi::Result<Charge>,
    ) -> rnicpi::Result<u64> {
        let mut running = self.running.lock();
        if running.is_none() {
            *running = Some(self.start(thread()?)?);
        }
        let shared = &running.as_ref().expect("started above").shared;
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let fd = Arc::new(fd);
        shared.entries.lock().insert(token, (fd.clone(), qp));
        let ev = EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, token);
        if let Err(e) = shared.epoll.add(fd.as_fd(), ev) {
            shared.entries.lock().remove(&token);
            return Err(DoorbellError::Io(e as i32).into());
        }
        Ok(token)
    }

    /// Serve every doorbell of the context now, on the caller's thread. Called before a
    /// call that takes something away (a QP's state, the QP, an address handle, a
    /// registration, a PD): work the consumer posted before it reaches the engine
    /// first, whether or not the doorbell thread has got to it. Kernel rxe runs a user
    /// QP's work within the posting call, and programs count on it: dtestx posts its
    /// last datagrams unsignaled, then frees their address handles and the QP at once.
    pub fn serve_all(&self) {
        let qps: Vec<_> = match self.running.lock().as_ref() {
            Some(r) => r
                .shared
                .entries
                .lock()
                .values()
                .map(|(_, q)| q.clone())
                .collect(),
            None => return,
        };
        for qp in qps.iter().filter_map(Weak::upgrade) {
            qp.doorbell();
        }
    }

    pub fn remove(&self, token: u64) {
        if let Some(r) = self.running.lock().as_ref() {
            if let Some((fd, _)) = r.shared.entries.lock().remove(&token) {
                let _ = r.shared.epoll.delete(fd.as_fd());
            }
        }
    }

    /// Stop the thread (context released). It is not waited for: it may be inside a
    /// provider call of this very context, which must not hold up the caller.
    pub fn stop(&self) {
        if let Some(r) = self.running.lock().take() {
            r.shared.entries.lock().clear();
            let _ = nix::unistd::write(&r.shared.stop, &1u64.to_ne_bytes());
        }
    }

    fn start(&self, thread: Charge) -> rnicpi::Result<Running> {
        let io = |e: nix::errno::Errno| rnicpi::VerbsError::from(DoorbellError::Io(e as i32));
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(io)?;
        // SAFETY: eventfd takes an initial value and flags and returns a new fd or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io(nix::errno::Errno::last()));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let stop = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
        epoll
            .add(stop.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, STOP))
            .map_err(io)?;
        let shared = Arc::new(Shared {
            epoll,
            entries: Mutex::new(HashMap::new()),
            stop,
            rung: self.rung.clone(),
        });
        let s = shared.clone();
        let ctx = self.ctx;
        std::thread::Builder::new()
            .name(format!("krdma-db{ctx}"))
            .stack_size(256 * 1024)
            .spawn(move || run(ctx, &s))
            .map_err(rnicpi::VerbsError::from)?;
        tracing::debug!(ctx, "doorbell thread started");
        Ok(Running {
            shared,
            _thread: thread,
        })
    }
}

impl Drop for Doorbells {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(ctx: u32, shared: &Shared) {
    let mut events = vec![EpollEvent::empty(); 64];
    loop {
        let n = match shared.epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!(ctx, "doorbell thread stopped: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == STOP {
                tracing::debug!(ctx, "doorbell thread stopped");
                return;
            }
            // Take what the token names and let go of the lock before any I/O.
            let Some((fd, qp)) = shared.entries.lock().get(&token).cloned() else {
                continue;
            };
            drain(fd.as_fd());
            if let Some(qp) = qp.upgrade() {
                shared.rung.fetch_add(1, Ordering::Relaxed);
                qp.doorbell_on_thread();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eventfd(flags: i32) -> OwnedFd {
        // SAFETY: eventfd returns a new fd or -1 (checked).
        let raw = unsafe { libc::eventfd(0, flags) };
        assert!(raw >= 0);
        // SAFETY: fresh descriptor.
        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) }
    }

    #[test]
    fn only_non_blocking_eventfds_are_doorbells() {
        verify(eventfd(libc::EFD_NONBLOCK).as_fd()).unwrap();
        assert_eq!(verify(eventfd(0).as_fd()), Err(DoorbellError::Blocking));
        let (r, _w) = nix::unistd::pipe().unwrap();
        assert_eq!(verify(r.as_fd()), Err(DoorbellError::NotEventfd));
        let f = std::fs::File::open("/proc/self/status").unwrap();
        assert_eq!(verify(f.as_fd()), Err(DoorbellError::NotEventfd));
    }

    #[test]
    fn draining_a_blocking_eventfd_never_waits() {
        let fd = eventfd(0); // blocking: a plain read of it at 0 would wait forever
        drain(fd.as_fd());
        nix::unistd::write(&fd, &5u64.to_ne_bytes()).unwrap();
        drain(fd.as_fd());
        drain(fd.as_fd());
    }
}
