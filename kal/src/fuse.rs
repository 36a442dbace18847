//! The daemon's front door: `/dev/krdma` as a FUSE mount of one regular file.
//!
//! `open` creates a kAL context keyed on the FUSE file handle (RELEASE carries no pid or
//! uid) and records who opened it ([`Opener`]); every later `ioctl`, `poll` and `read`
//! is served only for a thread of that same process with the same credentials, and a
//! context whose opener exited, exec'd or changed credentials is ended, whoever still
//! holds the file ([`crate::watch`] notices without a request). `ioctl` runs one
//! command, `poll` reports queued events and remembers the poll handle so the kAL's
//! waker can send `FUSE_NOTIFY_POLL`, `read` returns whole event records or `EAGAIN` —
//! never waits, because fuser cannot answer `FUSE_INTERRUPT` and a deferred read would
//! leave a killed client unkillable — and `release` tears the context down.

use crate::creds::{Creds, Requester};
use crate::opener::{Opener, Refusal};
use crate::process::ProcessPeer;
use crate::watch::Watch;
use crate::{abi, Caller, ContextId, Kal};
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, IoctlFlags,
    LockOwner, MountOption, OpenFlags, PollEvents, PollFlags, PollNotifier, ReplyAttr, ReplyData,
    ReplyEmpty, ReplyIoctl, ReplyOpen, ReplyPoll, Request, SessionACL,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

/// Where the last `poll` of an open file left its notifier.
type PollSlot = Arc<Mutex<Option<PollNotifier>>>;

/// One open of the device.
struct OpenFile {
    ctx: ContextId,
    poll: PollSlot,
    opener: Arc<Opener>,
    /// The context was ended because its opener is gone or changed; the file stays open
    /// (someone else holds it) and refuses everything.
    ended: AtomicBool,
}

/// The open files, shared with the opener watch.
struct Files {
    kal: Arc<Kal>,
    open: Mutex<HashMap<u64, Arc<OpenFile>>>,
}

impl Files {
    /// End the context of `fh` because its opener is gone or changed.
    fn end(&self, fh: u64, why: Refusal) {
        let Some(f) = self.open.lock().get(&fh).cloned() else {
            return;
        };
        if f.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        self.kal.refused(why);
        tracing::info!(ctx = f.ctx, pid = f.opener.tgid, reason = %why, "context ended");
        self.kal.release(f.ctx);
        // A poller still waiting learns at its next poll (which fails).
        let waiting = f.poll.lock().take();
        if let Some(ph) = waiting {
            let _ = ph.notify();
        }
    }
}

struct Device {
    files: Arc<Files>,
    watch: Arc<Watch>,
    uid: u32,
    gid: u32,
}

fn errno(e: rnicpi::VerbsError) -> Errno {
    Errno::from_i32(e.errno())
}

impl Device {
    /// The open file `fh`, if the request comes from its opener, with the requesting
    /// thread's credentials. Refusals are counted; one that means the opener is gone or
    /// changed ends the context.
    fn authorize(&self, req: &Request, fh: FileHandle) -> Result<(Arc<OpenFile>, Creds), Errno> {
        let f = self
            .files
            .open
            .lock()
            .get(&fh.0)
            .cloned()
            .ok_or(Errno::EBADF)?;
        if f.ended.load(Ordering::Acquire) {
            return Err(Errno::EACCES);
        }
        match f.opener.check(req.pid()) {
            Ok(creds) => Ok((f, creds)),
            Err(why) => {
                tracing::info!(ctx = f.ctx, pid = f.opener.tgid, tid = req.pid(), reason = %why, "request refused");
                if why.ends_context() {
                    self.watch.remove(fh.0);
                    self.files.end(fh.0, why);
                } else {
                    self.files.kal.refused(why);
                }
                Err(match why {
                    Refusal::Unverified => Errno::EAGAIN,
                    _ => Errno::EACCES,
                })
            }
        }
    }
}

impl Filesystem for Device {
    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let now = SystemTime::now();
        let attr = FileAttr {
            ino,
            size: 0,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind: FileType::RegularFile,
            perm: 0o666,
            nlink: 1,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        };
        reply.attr(&Duration::from_secs(1), &attr);
    }

    fn open(&self, req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let opened = Opener::open(req.pid()).and_then(|opener| {
            let opener = Arc::new(opener);
            let caller = Caller {
                pid: opener.tgid,
                uid: opener.creds.euid(),
                gid: opener.creds.gids[1],
            };
            let peer = Arc::new(ProcessPeer::new(opener.clone()));
            Ok((self.files.kal.open(caller, peer)?, opener))
        });
        let (ctx, opener) = match opened {
            Ok(v) => v,
            Err(e) => return reply.error(errno(e)),
        };
        let fh = ctx as u64;
        let slot: PollSlot = Arc::default();
        let s2 = slot.clone();
        self.files.kal.set_waker(
            ctx,
            Some(Arc::new(move || {
                if let Some(ph) = s2.lock().take() {
                    let _ = ph.notify();
                }
            })),
        );
        let file = Arc::new(OpenFile {
            ctx,
            poll: slot,
            opener: opener.clone(),
            ended: AtomicBool::new(false),
        });
        self.files.open.lock().insert(fh, file);
        if let Err(e) = self.watch.add(fh, opener) {
            tracing::warn!(ctx, error = %e, "cannot watch the opener; refusing the open");
            self.files.open.lock().remove(&fh);
            self.files.kal.release(ctx);
            return reply.error(Errno::EIO);
        }
        reply.opened(
            FileHandle(fh),
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_NONSEEKABLE | FopenFlags::FOPEN_STREAM,
        );
    }

    fn ioctl(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        let (f, creds) = match self.authorize(req, fh) {
            Ok(v) => v,
            Err(e) => return reply.error(e),
        };
        let Some((t, _, size)) = abi::decode(cmd) else {
            return reply.error(Errno::ENOTTY);
        };
        if t != abi::IOC_TYPE {
            return reply.error(Errno::ENOTTY);
        }
        if in_data.len() != size || out_size as usize != size {
            return reply.error(Errno::EINVAL);
        }
        let mut arg = in_data.to_vec();
        match self
            .files
            .kal
            .ioctl_as(f.ctx, &Requester::Verified(creds), cmd, &mut arg)
        {
            Ok(()) => reply.ioctl(0, &arg),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn poll(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        let f = match self.authorize(req, fh) {
            Ok((f, _)) => f,
            // Not checkable now (the daemon is short of descriptors, say): nothing is
            // shown ready, and the handle is kept so the next event wakes the poller to
            // ask again. An error here would reach the client as POLLERR, which means
            // a dead daemon.
            Err(Errno::EAGAIN) => {
                if let Some(f) = self.files.open.lock().get(&fh.0).cloned() {
                    *f.poll.lock() = Some(ph);
                }
                return reply.poll(PollEvents::empty());
            }
            Err(e) => return reply.error(e),
        };
        *f.poll.lock() = Some(ph);
        // Check after storing the handle, so an event queued in between still wakes.
        if self.files.kal.readable(f.ctx) {
            reply.poll(PollEvents::POLLIN | PollEvents::POLLRDNORM);
        } else {
            reply.poll(PollEvents::empty());
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let f = match self.authorize(req, fh) {
            Ok((f, _)) => f,
            Err(e) => return reply.error(e),
        };
        let mut buf = vec![0u8; (size as usize).min(abi::EVENT_SIZE * 64)];
        match self.files.kal.read_events(f.ctx, &mut buf) {
            Ok(0) => reply.error(Errno::EAGAIN),
            Ok(n) => reply.data(&buf[..n]),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.watch.remove(fh.0);
        let entry = self.files.open.lock().remove(&fh.0);
        if let Some(f) = entry {
            self.files.kal.release(f.ctx);
        }
        reply.ok();
    }
}

/// A mounted device; unmounted by [`FuseHandle::shutdown`] or on drop. The mount point
/// goes too if mounting created it, so that a stopped daemon leaves no plain file behind
/// for clients to open.
pub struct FuseHandle {
    session: Option<fuser::BackgroundSession>,
    pub path: PathBuf,
    created: bool,
}

impl FuseHandle {
    /// Unmount. With no file open the session ends cleanly; with files still open (a
    /// client that has not exited yet) a plain unmount is refused (`EBUSY`), so the mount
    /// is detached instead: the path is free at once, and the clients' files fail
    /// (`ENOTCONN`) once this process exits and closes the FUSE connection. The session
    /// threads are then not joined: they serve those files until the exit.
    pub fn shutdown(mut self) -> std::io::Result<()> {
        let Some(s) = self.session.take() else {
            return Ok(());
        };
        match s.umount_and_join() {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                tracing::info!(path = %self.path.display(), "files still open: detaching the mount");
                nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(std::io::Error::from)?;
            }
            r => r?,
        }
        self.remove_mount_point();
        Ok(())
    }

    /// Remove the mount point if mounting created it (once unmounted: a path something is
    /// mounted on cannot be removed, so a daemon started on it since keeps it).
    fn remove_mount_point(&mut self) {
        if std::mem::take(&mut self.created) {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::debug!(path = %self.path.display(), error = %e, "mount point kept");
            }
        }
    }
}

impl Drop for FuseHandle {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if s.umount_and_join().is_ok() {
                self.remove_mount_point();
            }
        }
    }
}

/// Create (or reuse) the regular file `path` to mount on, with mode 0666, never following
/// a symbolic link and never changing anything but a regular file: `O_NOFOLLOW` on the
/// open, and the mode set through the descriptor (`fchmod`), not the path. Says whether
/// it created the file (then unmounting removes it again).
fn mount_point(path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    let open = |create_new: bool| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(create_new)
            .mode(0o666)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
    };
    let refuse_link = |e: std::io::Error| match e.raw_os_error() {
        Some(libc::ELOOP) => std::io::Error::other(format!(
            "{} is a symbolic link: refusing to follow it",
            path.display()
        )),
        _ => e,
    };
    // An existing path (a symbolic link too: `O_EXCL` never follows one) is opened as is.
    let (f, created) = match open(true) {
        Ok(f) => (f, true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            (open(false).map_err(refuse_link)?, false)
        }
        Err(e) => return Err(refuse_link(e)),
    };
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{} exists and is not a regular file",
            path.display()
        )));
    }
    f.set_permissions(std::fs::Permissions::from_mode(0o666))?;
    Ok(created)
}

/// The device mounted but not served yet: no thread of its own exists, so the threads
/// [`Mounted::serve`] starts inherit whatever rights the caller kept after mounting
/// (`krdmad` drops its capabilities in between).
pub struct Mounted {
    session: fuser::Session<Device>,
    watch: Arc<Watch>,
    path: PathBuf,
    created: bool,
}

/// Mount `kal` on the file `path` (created as an empty 0666 regular file if missing).
pub fn mount(kal: Arc<Kal>, path: &Path) -> std::io::Result<Mounted> {
    let created = mount_point(path)?;
    let files = Arc::new(Files {
        kal,
        open: Mutex::new(HashMap::new()),
    });
    let weak: Weak<Files> = Arc::downgrade(&files);
    let watch = Watch::new(Box::new(move |fh, why| {
        if let Some(files) = weak.upgrade() {
            files.end(fh, why);
        }
    }))?;
    let dev = Device {
        files,
        watch: watch.clone(),
        uid: 0,
        gid: 0,
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName("krdma".into()),
        MountOption::Subtype("krdma".into()),
        MountOption::DefaultPermissions,
        MountOption::NoSuid,
        MountOption::NoDev,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(4);
    config.clone_fd = true;
    let session = fuser::Session::new(dev, path, &config)?;
    Ok(Mounted {
        session,
        watch,
        path: path.to_path_buf(),
        created,
    })
}

impl Mounted {
    /// Start serving: the FUSE threads and the opener watch.
    pub fn serve(self) -> std::io::Result<FuseHandle> {
        self.watch.start()?;
        Ok(FuseHandle {
            session: Some(self.session.spawn()?),
            path: self.path,
            created: self.created,
        })
    }
}

/// Serve `kal` as the file `path` (created as an empty 0666 regular file if missing).
pub fn serve(kal: Arc<Kal>, path: &Path) -> std::io::Result<FuseHandle> {
    mount(kal, path)?.serve()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mount_point_is_never_reached_through_a_symlink() {
        let dir = std::env::temp_dir().join(format!("krdma-mp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("target");
        std::fs::write(&target, b"keep").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        let link = dir.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = mount_point(&link).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        let meta = std::fs::metadata(&target).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "target untouched");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        // A directory is refused; a fresh path becomes an empty 0666 file.
        assert!(mount_point(&dir).is_err());
        let fresh = dir.join("dev");
        mount_point(&fresh).unwrap();
        assert_eq!(
            std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777,
            0o666
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
