//! The process that opened a context, and the check that binds every request to it.
//!
//! A daemon-mode context belongs to one process incarnation with one set of credentials,
//! as a uverbs file does in the kernel (`ib_safe_file_access`: the file's credentials
//! must be the caller's, on every command). The open records the opener's thread group,
//! a pidfd and a `/proc/<pid>` directory descriptor (both bound to that incarnation, never
//! to a number that may be reused), its uids and gids, and its address space
//! ([`ProcMem`]). Every later request (ioctl, read, poll) is accepted only from a thread
//! of that same process with the same uids and gids ([`Opener::check`]), so a descriptor
//! passed to another process (`SCM_RIGHTS`) or inherited by a fork child acts for no one.
//! A context whose opener exited or changed credentials (a setuid exec, say) is refused
//! and, as the refusal says ([`Refusal::ends_context`]), torn down.
//!
//! An exec that keeps the credentials keeps the context (the same process, the same
//! user): its memory file belongs to the old address space, so every access to memory
//! registered before the exec fails, and nothing reaches the new program's memory but
//! what it registers itself. Nothing here takes the opener's `mmap` lock (a `/proc`
//! status is read without it), so a tenant that keeps its own lock busy cannot stall
//! the threads checking requests.

use crate::creds::{Creds, Status};
use crate::procmem::{open_at, ProcMem};
use rnicpi::VerbsError;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// Why a request was refused (`EACCES`; `EAGAIN` for [`Refusal::Unverified`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the request comes from another process than the opener")]
    Foreign,
    #[error("the requesting thread's credentials are not the opener's")]
    OtherCredentials,
    #[error("the opener has exited")]
    Exited,
    #[error("the opener changed credentials")]
    CredentialsChanged,
    /// The daemon could not read what it checks (out of descriptors, say): refused this
    /// once, and nothing is concluded about the opener.
    #[error("the request could not be checked now")]
    Unverified,
}

impl Refusal {
    /// Whether the context is over: its opener is gone or is no longer who opened it.
    pub fn ends_context(&self) -> bool {
        matches!(self, Refusal::Exited | Refusal::CredentialsChanged)
    }

    /// Every refusal, in the order of the counters.
    pub const ALL: [Refusal; 5] = [
        Refusal::Foreign,
        Refusal::OtherCredentials,
        Refusal::Exited,
        Refusal::CredentialsChanged,
        Refusal::Unverified,
    ];

    /// The name of its counter (`krdma stat`).
    pub fn counter(&self) -> &'static str {
        match self {
            Refusal::Foreign => "request_refused_foreign_process",
            Refusal::OtherCredentials => "request_refused_other_creds",
            Refusal::Exited => "context_ended_opener_exited",
            Refusal::CredentialsChanged => "context_ended_creds_changed",
            Refusal::Unverified => "request_refused_unverified",
        }
    }
}

/// The process behind a daemon-mode context.
#[derive(Debug)]
pub struct Opener {
    /// Its thread-group id (as the daemon's pid namespace numbers it).
    pub tgid: u32,
    /// Its uids, gids and (at open) capabilities.
    pub creds: Creds,
    pidfd: OwnedFd,
    /// `/proc/<tgid>`: entries opened through it are this incarnation's or nothing.
    dir: File,
    /// Its address space.
    pub mem: Arc<ProcMem>,
    /// `task/<tid>/status` of its threads that made requests, kept open: a read of an
    /// open one regenerates it, and fails once that thread is gone.
    threads: parking_lot::Mutex<HashMap<u32, File>>,
    /// Its own `status`, kept open, so that checking it needs no new descriptor.
    status: File,
}

/// Most threads whose status files an opener keeps open.
const KEPT_THREADS: usize = 64;

/// Field 22 of `/proc/<pid>/stat`: the start time in clock ticks since boot.
fn start_time(stat: &str) -> Option<u64> {
    crate::creds::stat_field(stat, 22)?.parse().ok()
}

fn read_entry(dir: BorrowedFd<'_>, entry: &str) -> io::Result<String> {
    let mut s = String::new();
    open_at(dir, entry, libc::O_RDONLY)?.read_to_string(&mut s)?;
    Ok(s)
}

/// Whether the process behind `pidfd` has exited (a pidfd polls readable then).
fn exited(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r != 0
}

impl Opener {
    /// Identify the process of thread `tid` (the thread that opened the device).
    pub fn open(tid: u32) -> Result<Opener, VerbsError> {
        if tid == 0 {
            return Err(VerbsError::Permission);
        }
        let gone = |_| VerbsError::NoSuchResource;
        let status = Status::of(tid).map_err(gone)?;
        let started = std::fs::read_to_string(format!("/proc/{tid}/stat"))
            .ok()
            .and_then(|s| start_time(&s))
            .ok_or(VerbsError::NoSuchResource)?;
        let tgid = status.tgid;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, tgid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(VerbsError::NoSuchResource);
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let dir = File::open(format!("/proc/{tgid}")).map_err(gone)?;
        // The pidfd and the directory were taken by number: make sure they name the
        // process the thread belonged to, not one that got its pid since.
        let same = read_entry(dir.as_fd(), &format!("task/{tid}/stat"))
            .ok()
            .and_then(|s| start_time(&s));
        if same != Some(started) || exited(pidfd.as_fd()) {
            return Err(VerbsError::NoSuchResource);
        }
        let mem = ProcMem::open(dir.as_fd(), &status.creds).map_err(|e| {
            tracing::info!(pid = tgid, error = %e, "the opener's memory is not open to its own user");
            VerbsError::Permission
        })?;
        Ok(Opener {
            tgid,
            creds: status.creds,
            pidfd,
            status: open_at(dir.as_fd(), "status", libc::O_RDONLY).map_err(gone)?,
            dir,
            mem: Arc::new(mem),
            threads: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    /// Read the opener's `/proc/<pid>/<entry>` (`maps`, `smaps`, `limits`, `status`…).
    pub fn read(&self, entry: &str) -> io::Result<String> {
        read_entry(self.dir.as_fd(), entry)
    }

    /// Open the opener's `/proc/<pid>/<entry>` for reading.
    pub fn open_entry(&self, entry: &str) -> io::Result<File> {
        open_at(self.dir.as_fd(), entry, libc::O_RDONLY)
    }

    /// The opener's `/proc/<pid>` directory.
    pub fn dir(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Whether the opener has exited (its pidfd is readable).
    pub fn exited(&self) -> bool {
        exited(self.pidfd.as_fd())
    }

    /// Check a request made by thread `tid`: it must be a live thread of the opener, with
    /// the opener's uids and gids. Returns the requesting thread's credentials (its own
    /// capabilities count for what it asks).
    pub fn check(&self, tid: u32) -> Result<Creds, Refusal> {
        // `task/<tid>` under our directory exists only for a live thread of this very
        // process: a foreign thread's id, or any id once the opener is gone, is not there.
        let status = match self.thread_status(tid) {
            Ok(Some(status)) => status,
            Ok(None) => return Err(self.still_same().err().unwrap_or(Refusal::Foreign)),
            Err(e) => {
                tracing::warn!(pid = self.tgid, tid, error = %e, "cannot check a request");
                return Err(Refusal::Unverified);
            }
        };
        if !status.creds.same_identity(&self.creds) {
            return Err(self.still_same().err().unwrap_or(Refusal::OtherCredentials));
        }
        Ok(status.creds)
    }

    /// The status of thread `tid` of the opener: `None` unless it is one, alive; an error
    /// when it cannot be read for another reason (no descriptor left, say).
    fn thread_status(&self, tid: u32) -> io::Result<Option<Status>> {
        let not_ours = |e: &io::Error| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH));
        let mut buf = [0u8; 8192];
        let mut threads = self.threads.lock();
        for _ in 0..2 {
            let f = match threads.entry(tid) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    match open_at(
                        self.dir.as_fd(),
                        &format!("task/{tid}/status"),
                        libc::O_RDONLY,
                    ) {
                        Ok(f) => e.insert(f),
                        Err(e) if not_ours(&e) => return Ok(None),
                        Err(e) => return Err(e),
                    }
                }
            };
            // One read of the whole file (a status is far shorter than the buffer).
            match f.read_at(&mut buf, 0) {
                Ok(n) if n > 0 && n < buf.len() => {
                    let status = std::str::from_utf8(&buf[..n]).ok().and_then(Status::parse);
                    if threads.len() > KEPT_THREADS {
                        threads.retain(|t, _| *t == tid);
                    }
                    return Ok(status);
                }
                // That thread is gone (and its id may name a new one): look again.
                Ok(_) => {
                    threads.remove(&tid);
                }
                Err(e) if not_ours(&e) => {
                    threads.remove(&tid);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// Whether the opener, as a whole, is still what opened the context: alive, with the
    /// same credentials.
    /// Only the pidfd says the opener exited: a status that cannot be read now (no
    /// descriptor left, say) proves nothing.
    pub fn still_same(&self) -> Result<(), Refusal> {
        if self.exited() {
            return Err(Refusal::Exited);
        }
        let mut buf = [0u8; 8192];
        let status = match self.status.read_at(&mut buf, 0) {
            Ok(n) if n < buf.len() => std::str::from_utf8(&buf[..n]).ok().and_then(Status::parse),
            _ => None,
        };
        match status {
            Some(s) if !s.creds.same_identity(&self.creds) => Err(Refusal::CredentialsChanged),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};

    fn gettid() -> u32 {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() as u32 }
    }

    #[test]
    fn start_time_skips_the_command_name() {
        let stat = "42 (a (b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 12345 0";
        assert_eq!(start_time(stat), Some(12345));
        assert_eq!(start_time("42 (x) S 1"), None);
    }

    #[test]
    fn own_threads_pass_and_others_do_not() {
        let me = Opener::open(gettid()).unwrap();
        assert_eq!(me.tgid, std::process::id());
        assert!(!me.exited());
        assert_eq!(me.still_same(), Ok(()));
        let creds = me.check(gettid()).unwrap();
        assert!(creds.same_identity(&me.creds));
        let other_thread = std::thread::spawn(gettid).join().unwrap();
        // That thread has exited: its id is no thread of ours any more.
        assert_eq!(me.check(other_thread), Err(Refusal::Foreign));
        let live = std::thread::scope(|s| s.spawn(|| me.check(gettid())).join().unwrap());
        assert!(live.is_ok());
        assert_eq!(me.check(1), Err(Refusal::Foreign), "init is not us");
        assert_eq!(Opener::open(0).unwrap_err(), VerbsError::Permission);
    }

    /// A child that waits for a line on stdin and then execs `sleep`.
    fn child() -> std::process::Child {
        Command::new("sh")
            .args(["-c", "read x; exec sleep 30"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap()
    }

    #[test]
    fn an_exec_leaves_the_old_memory_behind_and_an_exit_ends_the_opener() {
        if !nix::unistd::geteuid().is_root() {
            return; // opening a child's memory as ourselves is fine, but keep it simple
        }
        let mut c = child();
        let pid = c.id();
        let o = Opener::open(pid).unwrap();
        assert_eq!(o.still_same(), Ok(()));
        assert!(o.check(pid).is_ok());
        let maps = o.read("maps").unwrap();
        let stack = maps.lines().find(|l| l.ends_with("[stack]")).unwrap();
        let stack = u64::from_str_radix(stack.split('-').next().unwrap(), 16).unwrap();
        let mut b = [0u8; 8];
        rnicpi::MemoryAccess::read(o.mem.as_ref(), stack, &mut b).unwrap();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
        c.stdin.take().unwrap().write_all(b"go\n").unwrap();
        while std::fs::read_link(format!("/proc/{pid}/exe")).ok().as_ref() == Some(&exe) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Same pid, same user, new program: still the opener, but the old address space
        // (and with it every registration made before) is unreachable.
        assert!(o.check(pid).is_ok());
        assert_eq!(o.still_same(), Ok(()));
        assert!(!o.mem.alive());
        assert!(rnicpi::MemoryAccess::read(o.mem.as_ref(), stack, &mut b).is_err());
        c.kill().unwrap();
        c.wait().unwrap();
        assert!(o.exited());
        assert_eq!(o.check(pid), Err(Refusal::Exited));
        assert_eq!(o.still_same(), Err(Refusal::Exited));
    }

    #[test]
    fn changed_credentials_end_the_opener() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        // A child that changes its uid once told to (setpriv would exec; `sh` cannot
        // change uid, so the child is a fork of this test that does it itself).
        let (r, w) = nix::unistd::pipe().unwrap();
        // SAFETY: the child only calls async-signal-safe functions before _exit.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                drop(w);
                let mut b = [0u8; 1];
                let _ = nix::unistd::read(&r, &mut b);
                // SAFETY: raw system calls in the forked child, then _exit.
                unsafe {
                    libc::syscall(libc::SYS_setresuid, 65534, 65534, 65534);
                    libc::sleep(30);
                    libc::_exit(0);
                }
            }
            nix::unistd::ForkResult::Parent { child } => {
                /// Kills the child however the test ends.
                struct Reap(nix::unistd::Pid);
                impl Drop for Reap {
                    fn drop(&mut self) {
                        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGKILL);
                        let _ = nix::sys::wait::waitpid(self.0, None);
                    }
                }
                let _reap = Reap(child);
                drop(r);
                let pid = child.as_raw() as u32;
                let o = Opener::open(pid).unwrap();
                assert_eq!(o.still_same(), Ok(()));
                nix::unistd::write(&w, b"x").unwrap();
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while o.still_same().is_ok() {
                    assert!(std::time::Instant::now() < deadline);
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                assert_eq!(o.still_same(), Err(Refusal::CredentialsChanged));
                assert_eq!(o.check(pid), Err(Refusal::CredentialsChanged));
            }
        }
    }
}
