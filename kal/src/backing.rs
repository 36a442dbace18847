//! What may back registered memory: only memory whose page faults the kernel alone
//! serves — anonymous private memory, shmem (memfd, shared anonymous memory, System V
//! shared memory, tmpfs files) and hugetlb. Not files of any other file system: a page
//! of a FUSE file is served by whoever runs that FUSE server, a tenant can mount one of
//! its own, and a daemon thread copying into it would wait for that tenant for ever (a
//! network file system can stall just as well). Not ranges registered with a
//! userfaultfd whose handler is a tenant's thread, for the same reason.
//!
//! The check asks the registering process's own `/proc/<pid>/maps` at `REG_MR` for the
//! mappings covering the range (the `PROCMAP_QUERY` ioctl: a few lookups, whatever the
//! number of mappings; the whole text on kernels before 6.11), and reads `smaps` for the
//! userfaultfd flags only where a userfaultfd could hold the daemon ([`uffd_possible`]).
//! It is a check of what is mapped at that moment: a tenant that later maps something
//! else over its registered range is the one case it cannot see (`docs/security.md`, H2).

use crate::creds::Creds;
use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

/// One mapping of `/proc/<pid>/maps` (with its `VmFlags` when read from `smaps`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    pub lo: u64,
    pub hi: u64,
    /// `rwxp` / `rw-s`…
    pub perms: [u8; 4],
    /// File offset of `lo`.
    pub offset: u64,
    /// Device (major, minor) of the backing file; (0, 0) for anonymous memory.
    pub dev: (u32, u32),
    pub inode: u64,
    pub path: String,
    /// Two-letter `VmFlags` codes (`smaps` only).
    pub flags: Option<Vec<String>>,
}

impl Vma {
    pub fn readable(&self) -> bool {
        self.perms[0] == b'r'
    }
    pub fn writable(&self) -> bool {
        self.perms[1] == b'w'
    }
    pub fn shared(&self) -> bool {
        self.perms[3] == b's'
    }

    /// Whether a userfaultfd is registered on it (missing, write-protect or minor faults).
    pub fn has_uffd(&self) -> bool {
        self.flags
            .as_ref()
            .is_some_and(|f| f.iter().any(|c| matches!(c.as_str(), "um" | "uw" | "ui")))
    }

    fn parse_header(line: &str) -> Option<Vma> {
        let mut cols = line.splitn(6, ' ');
        let (lo, hi) = cols.next()?.split_once('-')?;
        let perms: [u8; 4] = cols.next()?.as_bytes().try_into().ok()?;
        let offset = u64::from_str_radix(cols.next()?, 16).ok()?;
        let (maj, min) = cols.next()?.split_once(':')?;
        let inode = cols.next()?.parse().ok()?;
        Some(Vma {
            lo: u64::from_str_radix(lo, 16).ok()?,
            hi: u64::from_str_radix(hi, 16).ok()?,
            perms,
            offset,
            dev: (
                u32::from_str_radix(maj, 16).ok()?,
                u32::from_str_radix(min, 16).ok()?,
            ),
            inode,
            path: cols.next().unwrap_or("").trim_start().to_string(),
            flags: None,
        })
    }
}

/// Every mapping of a `maps` or `smaps` text.
pub fn parse(text: &str) -> Vec<Vma> {
    let mut out: Vec<Vma> = Vec::new();
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(last) = out.last_mut() {
                last.flags = Some(flags.split_whitespace().map(String::from).collect());
            }
        } else if let Some(v) = Vma::parse_header(line) {
            out.push(v);
        }
    }
    out
}

/// `struct procmap_query` of `linux/fs.h` (Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: u64 = 0xC068_6611;

/// The mapping covering `addr`, asked of an open `/proc/<pid>/maps` with `PROCMAP_QUERY`:
/// `Ok(None)` when nothing is mapped there, `ENOTTY` from kernels without the ioctl.
fn query(maps: &File, addr: u64) -> io::Result<Option<Vma>> {
    let mut name = vec![0u8; 4096];
    let mut q = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_addr: addr,
        vma_name_size: name.len() as u32,
        vma_name_addr: name.as_mut_ptr() as u64,
        ..ProcmapQuery::default()
    };
    // SAFETY: PROCMAP_QUERY reads and writes `q` (whose size it is told) and writes at
    // most `vma_name_size` bytes at `vma_name_addr`, our live buffer.
    let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &mut q) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) => Ok(None),
            _ => Err(e),
        };
    }
    let bit = |b: u64, c: u8| if q.vma_flags & b != 0 { c } else { b'-' };
    let path_len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
    Ok(Some(Vma {
        lo: q.vma_start,
        hi: q.vma_end,
        perms: [
            bit(1, b'r'),
            bit(2, b'w'),
            bit(4, b'x'),
            if q.vma_flags & 8 != 0 { b's' } else { b'p' },
        ],
        offset: q.vma_offset,
        dev: (q.dev_major, q.dev_minor),
        inode: q.inode,
        path: String::from_utf8_lossy(&name[..path_len]).into_owned(),
        flags: None,
    }))
}

/// The mappings covering `[addr, addr+len)` in order, as far as they cover it without a
/// hole (a hole ends the list early), from an open `/proc/<pid>/maps`.
pub fn covering(maps: &mut File, addr: u64, len: u64) -> io::Result<Vec<Vma>> {
    let end = addr.saturating_add(len);
    let mut out: Vec<Vma> = Vec::new();
    let mut at = addr;
    while at < end {
        match query(maps, at) {
            Ok(Some(v)) => {
                at = v.hi;
                out.push(v);
            }
            Ok(None) => break,
            Err(e) if e.raw_os_error() == Some(libc::ENOTTY) => {
                // Before Linux 6.11: read the whole text.
                let mut text = String::new();
                io::Read::read_to_string(maps, &mut text)?;
                return Ok(parse(&text)
                    .into_iter()
                    .filter(|v| v.hi > addr && v.lo < end)
                    .collect());
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Why memory was refused for registration (`EFAULT`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("part of the range is not mapped")]
    Unmapped,
    #[error("part of the range is not readable")]
    NotReadable,
    #[error("part of the range is not writable and write access was asked")]
    NotWritable,
    #[error("part of the range is a file ({0}) whose pages another process may serve")]
    File(String),
    #[error("part of the range is a special mapping ({0})")]
    Special(String),
    #[error("part of the range is registered with a userfaultfd")]
    Userfaultfd,
}

/// The devices whose pages only the kernel serves: the internal shmem and hugetlb mounts
/// (memfds, shared anonymous and System V memory) and the tmpfs and hugetlbfs mounts
/// the registering process sees (its `mountinfo`: the file-system type there is the
/// kernel's, a FUSE file system cannot claim to be tmpfs).
#[derive(Debug, Default)]
pub struct KernelServed(HashSet<(u32, u32)>);

/// The device of a fresh memfd made with `flags` (one internal mount for all of them).
fn memfd_dev(flags: libc::c_uint) -> Option<(u32, u32)> {
    let name = c"krdma-probe";
    // SAFETY: memfd_create with a valid name; the result is checked and closed below.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags | libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor nobody else owns; closed when dropped.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let st = nix::sys::stat::fstat(&file).ok()?;
    Some((libc::major(st.st_dev), libc::minor(st.st_dev)))
}

impl KernelServed {
    /// The devices of the internal mounts and of the tmpfs and hugetlbfs mounts in
    /// `mountinfo` (the registering process's).
    pub fn new(mountinfo: &str) -> KernelServed {
        let mut devs: HashSet<(u32, u32)> = internal_devs().iter().copied().collect();
        for line in mountinfo.lines() {
            let Some((head, tail)) = line.split_once(" - ") else {
                continue;
            };
            let fstype = tail.split_whitespace().next();
            if !matches!(fstype, Some("tmpfs" | "hugetlbfs")) {
                continue;
            }
            let dev = head.split_whitespace().nth(2).and_then(|d| {
                let (maj, min) = d.split_once(':')?;
                Some((maj.parse().ok()?, min.parse().ok()?))
            });
            devs.extend(dev);
        }
        KernelServed(devs)
    }

    fn contains(&self, dev: (u32, u32)) -> bool {
        self.0.contains(&dev)
    }
}

/// The internal shmem and hugetlb devices (memfds, shared anonymous and System V memory).
fn internal_devs() -> &'static [(u32, u32)] {
    static INTERNAL: OnceLock<Vec<(u32, u32)>> = OnceLock::new();
    INTERNAL.get_or_init(|| {
        [0, libc::MFD_HUGETLB]
            .into_iter()
            .filter_map(memfd_dev)
            .collect()
    })
}

/// Whether a mapping's pages are served by the kernel alone; `mounts` gives the tmpfs
/// and hugetlbfs devices (asked only for a file outside the internal mounts).
fn kernel_served(v: &Vma, mounts: &dyn Fn() -> KernelServed) -> Result<(), Refused> {
    if v.dev == (0, 0) && v.inode == 0 {
        let p = v.path.as_str();
        let anonymous =
            p.is_empty() || p == "[heap]" || p.starts_with("[stack") || p.starts_with("[anon:");
        return match anonymous {
            true => Ok(()),
            false => Err(Refused::Special(p.to_string())),
        };
    }
    if internal_devs().contains(&v.dev) || mounts().contains(v.dev) {
        return Ok(());
    }
    Err(Refused::File(v.path.clone()))
}

/// The mappings covering `[addr, addr+len)`, if all of them may back a registration
/// (`write`: with a write right); `mounts` gives the registering process's tmpfs and
/// hugetlbfs devices. `addr + len` must not overflow (checked by the caller).
pub fn check(
    vmas: &[Vma],
    addr: u64,
    len: u64,
    write: bool,
    mounts: &dyn Fn() -> KernelServed,
) -> Result<Vec<Vma>, Refused> {
    let end = addr.saturating_add(len);
    let mut covered = addr;
    let mut out = Vec::new();
    for v in vmas {
        if v.hi <= covered || v.lo > covered {
            continue;
        }
        if !v.readable() {
            return Err(Refused::NotReadable);
        }
        if write && !v.writable() {
            return Err(Refused::NotWritable);
        }
        kernel_served(v, mounts)?;
        if v.has_uffd() {
            return Err(Refused::Userfaultfd);
        }
        out.push(v.clone());
        covered = v.hi;
        if covered >= end {
            return Ok(out);
        }
    }
    Err(Refused::Unmapped)
}

/// Whether a userfaultfd of the process with `creds` could hold the daemon's copy into
/// its memory waiting on one of its threads, so that its `smaps` must be read for the
/// userfaultfd flags. With `vm.unprivileged_userfaultfd` at 0 (the kernel default) an
/// unprivileged process's userfaultfd handles only faults taken in user mode: a kernel
/// access to such a range (the daemon's, through the process's memory file) fails at
/// once, nothing waits. So it takes the sysctl at 1, or `/dev/userfaultfd` open to the
/// process. A process with `CAP_SYS_PTRACE` could stop the daemon with ptrace anyway: it
/// is trusted (docs/security.md, threat model). `None` is the embedded kAL, whose
/// copies are the process's own accesses: its userfaultfd can stall only itself.
pub fn uffd_possible(creds: Option<&Creds>) -> bool {
    let Some(c) = creds else { return false };
    if c.has(crate::creds::cap::SYS_PTRACE) {
        return false;
    }
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .map(|s| s.trim() == "1")
        .unwrap_or(true);
    sysctl || dev_userfaultfd_open_to(c)
}

/// Whether `/dev/userfaultfd` (full userfaultfds, by permission) is open to `c`.
fn dev_userfaultfd_open_to(c: &Creds) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::metadata("/dev/userfaultfd") else {
        return false;
    };
    let mode = m.mode();
    let rw = |shift: u32| (mode >> shift) & 0o6 == 0o6;
    rw(0) || (m.gid() == c.gids[1] && rw(3)) || (m.uid() == c.euid() && rw(6))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/dbus-daemon
00e03000-00e24000 rw-p 00000000 00:00 0           [heap]
7f0000000000-7f0000100000 rw-s 00000000 00:01 1234 /memfd:krdma-buf (deleted)
7f0000100000-7f0000200000 rw-p 00000000 00:00 0 
7f0000200000-7f0000300000 rw-p 00000000 00:2a 99 /home/u/fuse/file
7f0000300000-7f0000400000 r--p 00000000 00:00 0 
7ffe00000000-7ffe00021000 rw-p 00000000 00:00 0 [stack]
7ffe00100000-7ffe00102000 r-xp 00000000 00:00 0 [vdso]
";

    fn served() -> KernelServed {
        KernelServed(HashSet::from([(0, 1)]))
    }

    fn check(vmas: &[Vma], addr: u64, len: u64, write: bool, _: &()) -> Result<Vec<Vma>, Refused> {
        super::check(vmas, addr, len, write, &served)
    }

    #[test]
    fn parses_maps_and_smaps() {
        let v = parse(MAPS);
        assert_eq!(v.len(), 8);
        assert_eq!(v[2].dev, (0, 1));
        assert_eq!(v[2].path, "/memfd:krdma-buf (deleted)");
        assert!(v[2].shared() && v[2].writable());
        assert_eq!(v[3].path, "");
        let smaps = "7f0000100000-7f0000200000 rw-p 00000000 00:00 0 \nSize: 1024 kB\n\
                     VmFlags: rd wr mr mw me ac um \n";
        let s = parse(smaps);
        assert_eq!(s.len(), 1);
        assert!(s[0].has_uffd());
        assert!(!v[3].has_uffd());
    }

    #[test]
    fn only_kernel_served_memory_passes() {
        let v = parse(MAPS);
        let s = ();
        // Heap, a memfd, anonymous memory and the stack.
        check(&v, 0xe03000, 0x100, true, &s).unwrap();
        check(&v, 0x7f0000000000, 0x200000, true, &s).unwrap();
        check(&v, 0x7ffe00000000, 0x1000, true, &s).unwrap();
        assert_eq!(
            check(&v, 0x7f0000200000, 0x10, false, &s),
            Err(Refused::File("/home/u/fuse/file".into()))
        );
        // A range running from anonymous memory into the file is refused too.
        assert!(matches!(
            check(&v, 0x7f00001ff000, 0x2000, false, &s),
            Err(Refused::File(_))
        ));
        assert_eq!(
            check(&v, 0x400000, 0x10, false, &s),
            Err(Refused::File("/usr/bin/dbus-daemon".into()))
        );
        assert_eq!(
            check(&v, 0x7f0000300000, 0x10, true, &s),
            Err(Refused::NotWritable)
        );
        check(&v, 0x7f0000300000, 0x10, false, &s).unwrap();
        assert_eq!(
            check(&v, 0x7ffe00100000, 0x10, false, &s),
            Err(Refused::Special("[vdso]".into()))
        );
        assert_eq!(check(&v, 0x1000, 0x10, false, &s), Err(Refused::Unmapped));
        assert_eq!(
            check(&v, 0xe23000, 0x2000, false, &s),
            Err(Refused::Unmapped),
            "runs past the heap"
        );
    }

    fn mounts() -> KernelServed {
        KernelServed::new(&std::fs::read_to_string("/proc/self/mountinfo").unwrap())
    }

    #[test]
    fn the_ioctl_and_the_text_agree() {
        let buf = vec![0u8; 3 << 20];
        let mut f = File::open("/proc/self/maps").unwrap();
        let (a, l) = (buf.as_ptr() as u64 + 5000, 2 << 20);
        let asked = covering(&mut f, a, l).unwrap();
        assert!(!asked.is_empty() && asked[0].lo <= a && asked.last().unwrap().hi >= a + l);
        let text = parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        for v in &asked {
            assert!(text.contains(v), "{v:?} not in the maps text");
        }
        assert!(
            covering(&mut f, 4096, 10).unwrap().is_empty(),
            "nothing at page 1"
        );
    }

    #[test]
    fn this_process_memfds_and_tmpfs_are_kernel_served() {
        let s = mounts();
        let buf = vec![0u8; 8192];
        let fd = memfd_dev(0).unwrap();
        assert!(s.contains(fd) || internal_devs().contains(&fd));
        let maps = parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        let c = |a, l, w| super::check(&maps, a, l, w, &mounts);
        c(buf.as_ptr() as u64, buf.len() as u64, true).unwrap();
        static RO: [u8; 64] = [1; 64];
        assert!(matches!(
            c(RO.as_ptr() as u64, 64, false),
            Err(Refused::File(_))
        ));
        let shared = memmap2::MmapMut::map_anon(4096).unwrap();
        // A shared anonymous mapping is shmem: served by the kernel.
        let shared_anon = unsafe {
            // SAFETY: a fresh shared anonymous mapping of one page, unmapped below.
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(shared_anon, libc::MAP_FAILED);
        let maps = parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        let c = |a, l, w| super::check(&maps, a, l, w, &mounts);
        c(shared_anon as u64, 4096, true).unwrap();
        c(shared.as_ptr() as u64, 4096, true).unwrap();
        // SAFETY: unmaps the page mapped above, which nothing else uses.
        unsafe { libc::munmap(shared_anon, 4096) };
    }
}
