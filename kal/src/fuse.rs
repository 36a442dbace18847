//! The daemon's front door: `/dev/krdma` as a FUSE mount of one regular file.
//!
//! `open` creates a kAL context keyed on the FUSE file handle (RELEASE carries no pid or
//! uid), `ioctl` runs one command, `poll` reports queued events and remembers the poll
//! handle so the kAL's waker can send `FUSE_NOTIFY_POLL`, `read` returns whole event
//! records or `EAGAIN` — never waits, because fuser cannot answer `FUSE_INTERRUPT` and a
//! deferred read would leave a killed client unkillable — and `release` tears the
//! context down.

use crate::process::ProcessPeer;
use crate::{abi, Caller, ContextId, Kal};
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, IoctlFlags,
    LockOwner, MountOption, OpenFlags, PollEvents, PollFlags, PollNotifier, ReplyAttr, ReplyData,
    ReplyEmpty, ReplyIoctl, ReplyOpen, ReplyPoll, Request, SessionACL,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Where the last `poll` of an open file left its notifier.
type PollSlot = Arc<Mutex<Option<PollNotifier>>>;

struct Device {
    kal: Arc<Kal>,
    /// fh → (context, last poll handle).
    open: Mutex<HashMap<u64, (ContextId, PollSlot)>>,
    uid: u32,
    gid: u32,
}

fn errno(e: rnicpi::VerbsError) -> Errno {
    Errno::from_i32(e.errno())
}

impl Device {
    fn ctx(&self, fh: FileHandle) -> Option<(ContextId, Arc<Mutex<Option<PollNotifier>>>)> {
        self.open.lock().get(&fh.0).cloned()
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
        let caller = match ProcessPeer::new(req.pid(), req.uid()) {
            Ok(peer) => {
                let c = Caller {
                    pid: peer.tgid,
                    uid: req.uid(),
                    gid: req.gid(),
                };
                self.kal.open(c, Arc::new(peer))
            }
            Err(e) => Err(e),
        };
        match caller {
            Ok(ctx) => {
                let fh = ctx as u64;
                let slot: Arc<Mutex<Option<PollNotifier>>> = Arc::default();
                let s2 = slot.clone();
                self.kal.set_waker(
                    ctx,
                    Some(Arc::new(move || {
                        if let Some(ph) = s2.lock().take() {
                            let _ = ph.notify();
                        }
                    })),
                );
                self.open.lock().insert(fh, (ctx, slot));
                reply.opened(
                    FileHandle(fh),
                    FopenFlags::FOPEN_DIRECT_IO
                        | FopenFlags::FOPEN_NONSEEKABLE
                        | FopenFlags::FOPEN_STREAM,
                );
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        let Some((ctx, _)) = self.ctx(fh) else {
            return reply.error(Errno::EBADF);
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
        match self.kal.ioctl(ctx, cmd, &mut arg) {
            Ok(()) => reply.ioctl(0, &arg),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        let Some((ctx, slot)) = self.ctx(fh) else {
            return reply.error(Errno::EBADF);
        };
        *slot.lock() = Some(ph);
        // Check after storing the handle, so an event queued in between still wakes.
        if self.kal.readable(ctx) {
            reply.poll(PollEvents::POLLIN | PollEvents::POLLRDNORM);
        } else {
            reply.poll(PollEvents::empty());
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some((ctx, _)) = self.ctx(fh) else {
            return reply.error(Errno::EBADF);
        };
        let mut buf = vec![0u8; (size as usize).min(abi::EVENT_SIZE * 64)];
        match self.kal.read_events(ctx, &mut buf) {
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
        let entry = self.open.lock().remove(&fh.0);
        if let Some((ctx, _)) = entry {
            self.kal.release(ctx);
        }
        reply.ok();
    }
}

/// A mounted device; unmounted by [`FuseHandle::shutdown`] or on drop.
pub struct FuseHandle {
    session: Option<fuser::BackgroundSession>,
    pub path: PathBuf,
}

impl FuseHandle {
    pub fn shutdown(mut self) -> std::io::Result<()> {
        match self.session.take() {
            Some(s) => s.umount_and_join(),
            None => Ok(()),
        }
    }
}

impl Drop for FuseHandle {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}

/// Serve `kal` as the file `path` (created as an empty 0666 regular file if missing).
pub fn serve(kal: Arc<Kal>, path: &Path) -> std::io::Result<FuseHandle> {
    if !path.exists() {
        std::fs::File::create(path)?;
    }
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other(format!(
            "{} exists and is not a regular file",
            path.display()
        )));
    }
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o666))?;
    let dev = Device {
        kal,
        open: Mutex::new(HashMap::new()),
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
    let session = fuser::Session::new(dev, path, &config)?.spawn()?;
    Ok(FuseHandle {
        session: Some(session),
        path: path.to_path_buf(),
    })
}
