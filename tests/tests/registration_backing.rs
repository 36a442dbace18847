//! H2, M5: what may back a registration, and what the daemon maps of it.
//!
//! * Memory on a FUSE mount of the tenant's own, whose READ never answers, is refused at
//!   REG_MR (private and shared mappings, and a range running into one from anonymous
//!   memory), through both front doors, without a single READ reaching the file system,
//!   while a bystander on rxe0 keeps being served.
//! * Memory registered with a userfaultfd is refused where a userfaultfd could hold the
//!   daemon (an unprivileged tenant with `vm.unprivileged_userfaultfd` at 1).
//! * A registration of sealed shared memory is mapped by the daemon page for page, not
//!   the whole mapping it lies in.

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyEntry, ReplyOpen, Request,
    SessionACL,
};
use krdma_tests::{
    as_user, child_test, daemon_possible, each_front_door, kal_counter, private_dir, say,
    Anonymous, Bystander, Daemon, Role,
};
use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use ual::{Access, Context, Target};

const FILE_LEN: u64 = 1 << 20;
const FILE_INO: INodeNo = INodeNo(2);

/// A file system with one 1 MiB file, `f`, whose READs are never answered (the replies
/// are kept, and fail with EIO when the file system goes).
#[derive(Default)]
struct Stalling {
    reads: Arc<AtomicU32>,
    stalled: Mutex<Vec<ReplyData>>,
}

fn attr(ino: INodeNo) -> FileAttr {
    let now = SystemTime::now();
    let (kind, perm, size) = match ino {
        INodeNo::ROOT => (FileType::Directory, 0o755, 0),
        _ => (FileType::RegularFile, 0o666, FILE_LEN),
    };
    FileAttr {
        ino,
        size,
        blocks: size / 512,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm,
        nlink: 1,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl Filesystem for Stalling {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == INodeNo::ROOT && name == "f" {
            reply.entry(&Duration::from_secs(60), &attr(FILE_INO), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        reply.attr(&Duration::from_secs(60), &attr(ino));
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::empty());
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.stalled.lock().unwrap().push(reply);
    }
}

/// The stalling file system mounted on a directory of its own.
struct StallingMount {
    file: PathBuf,
    reads: Arc<AtomicU32>,
    session: Option<fuser::BackgroundSession>,
    dir: PathBuf,
}

impl StallingMount {
    fn new() -> StallingMount {
        let dir = private_dir("krdma-stall");
        let fs = Stalling::default();
        let reads = fs.reads.clone();
        let mut config = Config::default();
        config.mount_options = vec![MountOption::FSName("stall".into())];
        config.acl = SessionACL::All;
        let session = fuser::Session::new(fs, &dir, &config)
            .expect("mount the stalling file system")
            .spawn()
            .unwrap();
        StallingMount {
            file: dir.join("f"),
            reads,
            session: Some(session),
            dir,
        }
    }
}

impl Drop for StallingMount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A mapping of a file (nothing in it is ever touched by the test).
struct Mapping(*mut libc::c_void, usize);

impl Mapping {
    fn of_file(path: &Path, flags: i32, fixed_at: Option<usize>) -> Mapping {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let (hint, fixed) = match fixed_at {
            Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED),
            None => (std::ptr::null_mut(), 0),
        };
        // SAFETY: maps the file (or, with MAP_FIXED, over a reservation of our own);
        // never dereferenced by the test.
        let p = unsafe {
            libc::mmap(
                hint,
                FILE_LEN as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags | fixed,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Mapping(p, FILE_LEN as usize)
    }

    fn addr(&self) -> usize {
        self.0 as usize
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `of_file`/`anonymous` mapped.
        unsafe { libc::munmap(self.0, self.1) };
    }
}

/// REG_MR as the kAL sees it; the errno, 0 for success (the registration then stays:
/// the context's end takes it).
fn reg_mr(ctx: &Context, pd: &ual::Pd, addr: usize, len: usize, access: Access) -> i32 {
    let mut a = <ual::abi::RegMr as bytemuck::Zeroable>::zeroed();
    (a.pd, a.access, a.addr, a.length) = (pd.handle, access.bits(), addr as u64, len as u64);
    match ctx.channel().call(ual::abi::cmd::REG_MR, &mut a) {
        Ok(()) => 0,
        Err(e) => e.errno(),
    }
}

#[test]
fn memory_on_a_tenants_own_fuse_mount_is_refused() {
    let mount = StallingMount::new();
    each_front_door(|door| {
        let bystander = Bystander::start(door, "rxe0");
        let ctx = door.open();
        let dev = ctx.device("rxe0").unwrap().index;
        let pd = ctx.alloc_pd(dev).unwrap();
        let before = kal_counter(&ctx, "reg_mr_refused_backing");
        let private = Mapping::of_file(&mount.file, libc::MAP_PRIVATE, None);
        let shared = Mapping::of_file(&mount.file, libc::MAP_SHARED, None);
        // Anonymous memory, the second half of which is then the file.
        let straddle = Anonymous::new(2 * FILE_LEN as usize);
        let _over = Mapping::of_file(
            &mount.file,
            libc::MAP_PRIVATE,
            Some(straddle.addr() + FILE_LEN as usize),
        );
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let tries = [
            ("private", private.addr(), 64 << 10, all),
            (
                "private, read only",
                private.addr(),
                64 << 10,
                Access::empty(),
            ),
            ("shared", shared.addr(), 64 << 10, all),
            (
                "into the file",
                straddle.addr() + FILE_LEN as usize - 4096,
                8192,
                all,
            ),
        ];
        // Keep trying for a while: the bystander must be served all along.
        let t0 = std::time::Instant::now();
        let mut rounds = 0;
        while rounds == 0 || t0.elapsed() < Duration::from_millis(500) {
            for (what, addr, len, access) in tries {
                let errno = reg_mr(&ctx, &pd, addr, len, access);
                assert_eq!(errno, libc::EFAULT, "{what}: registered");
            }
            rounds += 1;
        }
        // The anonymous half alone is fine.
        assert_eq!(reg_mr(&ctx, &pd, straddle.addr(), 4096, all), 0);
        assert_eq!(
            mount.reads.load(Ordering::SeqCst),
            0,
            "the kAL read from the file system"
        );
        assert_eq!(
            kal_counter(&ctx, "reg_mr_refused_backing") - before,
            rounds * tries.len() as u64
        );
        bystander.finish().assert_served(Duration::from_secs(2));
        drop((pd, ctx));
    });
}

// ---- userfaultfd ----------------------------------------------------------------------

/// `_IOWR(0xAA, 0x3F, struct uffdio_api)` and `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_API: u64 = 0xc018_aa3f;
const UFFDIO_REGISTER: u64 = 0xc020_aa00;

/// Register `[addr, addr+len)` for missing-page faults with a new userfaultfd.
fn userfaultfd_on(addr: usize, len: usize) -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: the userfaultfd system call and two ioctls on its result with structs of
    // the sizes they encode; the result is checked.
    unsafe {
        let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) as i32;
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let owned = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut api = [0xAAu64, 0, 0];
        let mut reg = [addr as u64, len as u64, 1, 0];
        if libc::ioctl(fd, UFFDIO_API as _, api.as_mut_ptr()) != 0
            || libc::ioctl(fd, UFFDIO_REGISTER as _, reg.as_mut_ptr()) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(owned)
    }
}

/// Role: an unprivileged tenant registering memory it handed to a userfaultfd.
#[test]
#[ignore = "a role of memory_registered_with_a_userfaultfd_is_refused"]
fn role_uffd_tenant() {
    let Ok(dev) = std::env::var("KRDMA_TEST_DEVICE") else {
        return;
    };
    // The daemon's engine: siw's engine in this process would register the memory in
    // this process's own kAL, where a userfaultfd can stall only its owner (as embedded).
    let target = Target::Device(dev.into());
    let ctx = Context::open_target_with(&target, ual::FastPathChoice::Kal).unwrap();
    let pd = ctx.alloc_pd(ctx.device("siw0").unwrap().index).unwrap();
    let m = Anonymous::new(1 << 20);
    let _uffd = userfaultfd_on(m.addr(), 1 << 20).expect("userfaultfd");
    // SAFETY: refused, or else dropped before `m`.
    let r = unsafe { ctx.reg_mr(&pd, m.addr() as *const u8, 8192, Access::LOCAL_WRITE) };
    say("UFFD", r.err().map_or(0, |e| e.errno()));
    let plain = Anonymous::new(8192);
    // SAFETY: `plain` outlives the MR, dropped right away.
    let r = unsafe { ctx.reg_mr(&pd, plain.addr() as *const u8, 8192, Access::LOCAL_WRITE) };
    say("PLAIN", r.err().map_or(0, |e| e.errno()));
}

/// Sets a sysctl for the test's duration.
struct Sysctl(&'static str, String);

impl Sysctl {
    fn set(path: &'static str, value: &str) -> Sysctl {
        let old = std::fs::read_to_string(path).unwrap();
        std::fs::write(path, value).unwrap();
        Sysctl(path, old)
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0, self.1.trim());
    }
}

#[test]
fn memory_registered_with_a_userfaultfd_is_refused() {
    if !daemon_possible() {
        return;
    }
    let door = krdma_tests::FrontDoor::Daemon(Daemon::start());
    let d = door.daemon().unwrap();
    let bystander = Bystander::start(&door, "rxe0");
    // With the sysctl at 1 an unprivileged userfaultfd can hold kernel-mode accesses:
    // that is when the daemon must look (at 0, the default, its copy would fail at once).
    let _at_one = Sysctl::set("/proc/sys/vm/unprivileged_userfaultfd", "1");
    let mut c = child_test("role_uffd_tenant");
    c.env("KRDMA_TEST_DEVICE", &d.path);
    let mut tenant = Role::spawn(as_user(&c, 65534));
    assert_eq!(tenant.expect("UFFD"), libc::EFAULT.to_string());
    assert_eq!(tenant.expect("PLAIN"), "0");
    tenant.wait();
    bystander.finish().assert_served(Duration::from_secs(2));
}

// ---- what the daemon maps --------------------------------------------------------------

#[test]
fn the_daemon_maps_only_the_registered_pages() {
    if !daemon_possible() {
        return;
    }
    let d = Daemon::start();
    let ctx = Context::open_target(&d.target()).unwrap();
    let pd = ctx.alloc_pd(ctx.device("siw0").unwrap().index).unwrap();
    let buf = ual::RegBuf::new(16 << 20).unwrap();
    // SAFETY: two pages inside `buf`, which outlives the MR.
    let mr =
        unsafe { ctx.reg_mr(&pd, buf.as_ptr().add(5 << 20), 8192, Access::LOCAL_WRITE) }.unwrap();
    assert_eq!(
        buffer_mappings(&d),
        [8192],
        "krdmad maps the two registered pages, not 16 MiB"
    );
    drop(mr);
}

/// The lengths of krdmad's mappings of `RegBuf`s.
fn buffer_mappings(d: &Daemon) -> Vec<u64> {
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", d.pid())).unwrap();
    maps.lines()
        .filter(|l| l.contains("/memfd:krdma-buf"))
        .filter_map(|l| {
            let (lo, hi) = l.split_whitespace().next()?.split_once('-')?;
            Some(u64::from_str_radix(hi, 16).ok()? - u64::from_str_radix(lo, 16).ok()?)
        })
        .collect()
}

#[test]
fn a_buffer_that_is_not_a_whole_number_of_pages_is_mapped_too() {
    if !daemon_possible() {
        return;
    }
    let d = Daemon::start();
    let ctx = Context::open_target(&d.target()).unwrap();
    let pd = ctx.alloc_pd(ctx.device("siw0").unwrap().index).unwrap();
    // perftest-style buffers: twice the message and a little more (krdma perf's).
    let buf = ual::RegBuf::new((2 << 20) + 64).unwrap();
    let mr = ctx.reg_buf(&pd, &buf, Access::LOCAL_WRITE).unwrap();
    let spans = buffer_mappings(&d);
    assert_eq!(
        spans,
        [(2 << 20) + 4096],
        "krdmad maps the whole buffer, the page its end falls in included \
         (not reached through the memory file): {spans:?}"
    );
    drop(mr);
}
