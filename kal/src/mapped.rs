//! Consumer memory the daemon maps for itself: when a registered range lies in a shared
//! mapping of a sealed memfd (what `ual::RegBuf` allocates), `krdmad` maps the same pages
//! through `/proc/PID/map_files` and the engine copies straight in and out of them, as in
//! embedded mode — one copy per byte instead of the two of reading and writing the
//! process's memory file plus the socket. Anything else (private anonymous memory,
//! `malloc`) is reached through the opener's memory file ([`crate::procmem`]).
//!
//! The file must carry `F_SEAL_SHRINK`: a consumer that could truncate it would make the
//! daemon's next access to the vanished pages a SIGBUS. With the seal the mapping stays
//! valid for as long as the daemon holds it, whatever the consumer does to its own.
//!
//! What is mapped is exactly what the caller could write at the moment of registration,
//! and no more: the `map_files` entry is opened as the caller's own user (DAC and the
//! ptrace check apply as to the caller), the opened file must be the very file the
//! `maps` line showed (device and inode), the line must still be there once the file is
//! open (so a mapping swapped in between is caught), and only the registered pages are
//! mapped, at their own file offset.

use crate::backing::Vma;
use crate::creds::{as_opener, cap, Creds};
use crate::procmem::open_at;
use rnicpi::{MemoryAccess, Result, VerbsError};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};

const PAGE: u64 = 4096;

/// The registered pages of one shared mapping of a consumer, mapped again in this process.
pub struct MappedMemory {
    map: memmap2::MmapRaw,
    /// The consumer's address of the first mapped byte.
    base: u64,
}

impl std::fmt::Debug for MappedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedMemory")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.map.len())
            .finish()
    }
}

/// `x` rounded up to a page boundary (`None` on overflow).
fn page_up(x: u64) -> Option<u64> {
    Some(x.checked_add(PAGE - 1)? & !(PAGE - 1))
}

/// The fields that say which file a mapping shows, and where.
fn same_mapping(a: &Vma, b: &Vma) -> bool {
    (a.lo, a.hi, a.perms, a.offset, a.dev, a.inode)
        == (b.lo, b.hi, b.perms, b.offset, b.dev, b.inode)
}

impl MappedMemory {
    /// Map the pages of `[addr, addr+len)` of the process whose `/proc/<pid>` directory is
    /// `dir`, when the range lies in `vma` (read from its maps just before), a writable
    /// shared mapping of a shrink-sealed file; `None` otherwise (the caller then uses the
    /// process's memory file). `now` asks the process's mapping at `addr` again.
    pub fn open(
        dir: BorrowedFd<'_>,
        creds: &Creds,
        vma: &Vma,
        (addr, len): (u64, u64),
        now: impl Fn() -> Option<Vma>,
    ) -> Option<MappedMemory> {
        let end = addr.checked_add(len)?;
        if !(vma.readable() && vma.writable() && vma.shared()) || addr < vma.lo || end > vma.hi {
            return None;
        }
        let entry = format!("map_files/{:x}-{:x}", vma.lo, vma.hi);
        // map_files is reached with CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE), the
        // daemon's own right; who may open what is still checked as the opener.
        let reach = 1 << cap::SYS_ADMIN | 1 << cap::CHECKPOINT_RESTORE;
        let file = as_opener(creds, reach, || open_at(dir, &entry, libc::O_RDWR))
            .ok()?
            .ok()?;
        let st = nix::sys::stat::fstat(&file).ok()?;
        let dev = (libc::major(st.st_dev), libc::minor(st.st_dev));
        if dev != vma.dev || st.st_ino != vma.inode {
            tracing::info!(
                entry,
                "the mapping changed under the registration: not mapped"
            );
            return None;
        }
        // SAFETY: F_GET_SEALS reads the seals of a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return None;
        }
        if !same_mapping(&now()?, vma) {
            tracing::info!(
                entry,
                "the mapping changed under the registration: not mapped"
            );
            return None;
        }
        let lo = addr & !(PAGE - 1);
        let hi = page_up(end)?;
        let offset = vma.offset.checked_add(lo - vma.lo)?;
        // Pages past the end of the file would fault; the page the end falls in does not
        // (its tail reads as zeros), so a file need not be a whole number of pages long.
        if offset.checked_add(hi - lo)? > page_up(st.st_size as u64)? {
            return None;
        }
        let map = memmap2::MmapOptions::new()
            .offset(offset)
            .len((hi - lo) as usize)
            .map_raw(&file)
            .ok()?;
        tracing::debug!(
            base = format_args!("{lo:#x}"),
            len = hi - lo,
            "consumer memory mapped directly"
        );
        Some(MappedMemory { map, base: lo })
    }

    /// Our pointer to consumer range `[addr, addr+len)`, if it lies in the mapping.
    fn at(&self, addr: u64, len: usize) -> Result<*mut u8> {
        let off = addr.checked_sub(self.base).ok_or(VerbsError::BadAddress)?;
        let end = off.checked_add(len as u64).ok_or(VerbsError::BadAddress)?;
        if end > self.map.len() as u64 {
            return Err(VerbsError::BadAddress);
        }
        // SAFETY: off + len lies inside the mapping (checked above).
        Ok(unsafe { self.map.as_mut_ptr().add(off as usize) })
    }
}

impl MemoryAccess for MappedMemory {
    fn mapped_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    fn span(&self, addr: u64, len: usize) -> Option<*mut u8> {
        self.at(addr, len).ok()
    }

    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        let p = self.at(addr, buf.len())?;
        // SAFETY: `p..p+len` is inside our mapping, which stays valid while we hold it
        // (the file cannot shrink: F_SEAL_SHRINK was checked); the consumer may write the
        // same bytes concurrently, which only makes the copied bytes arbitrary.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let p = self.at(addr, data.len())?;
        // SAFETY: as for `read`; the mapping is shared and writable (`open` maps only
        // files it could open for writing: a read-only consumer mapping falls back to
        // `process_vm_*`).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    fn atomic(&self, addr: u64, op: &mut dyn FnMut(u64) -> u64) -> Result<u64> {
        if !addr.is_multiple_of(8) {
            return Err(VerbsError::BadAddress);
        }
        let p = self.at(addr, 8)?;
        // SAFETY: 8 aligned bytes inside the mapping; the consumer's CPU sees the same
        // physical page, so the compare-exchange is atomic against it too.
        let cell = unsafe { &*(p as *const AtomicU64) };
        let mut cur = cell.load(Ordering::Acquire);
        loop {
            match cell.compare_exchange_weak(cur, op(cur), Ordering::AcqRel, Ordering::Acquire) {
                Ok(old) => return Ok(old),
                Err(now) => cur = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backing::parse;
    use std::os::fd::{AsFd, FromRawFd};

    fn memfd(len: usize, seal: bool) -> std::fs::File {
        // SAFETY: memfd_create with a valid name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nobody else owns.
        let file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.set_len(len as u64).unwrap();
        if seal {
            // SAFETY: F_ADD_SEALS on a descriptor we own.
            assert_eq!(
                unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) },
                0
            );
        }
        file
    }

    fn vma_at(addr: u64) -> Vma {
        let maps = parse(&std::fs::read_to_string("/proc/self/maps").unwrap());
        maps.into_iter()
            .find(|v| v.lo <= addr && addr < v.hi)
            .unwrap()
    }

    struct Fixture {
        dir: std::fs::File,
        creds: Creds,
    }

    fn fixture() -> Option<Fixture> {
        if !nix::unistd::geteuid().is_root() {
            return None; // /proc/PID/map_files needs CAP_SYS_ADMIN, as krdmad has
        }
        Some(Fixture {
            dir: std::fs::File::open(format!("/proc/{}", std::process::id())).unwrap(),
            creds: crate::creds::Status::of(std::process::id()).unwrap().creds,
        })
    }

    #[test]
    fn maps_only_the_registered_pages_of_sealed_shared_memory() {
        let Some(f) = fixture() else { return };
        let file = memfd(64 << 10, true);
        let m = memmap2::MmapOptions::new()
            .len(64 << 10)
            .map_raw(&file)
            .unwrap();
        let base = m.as_ptr() as u64;
        let vma = vma_at(base);
        let reg = (base + 5000, 1000);
        let now = || Some(vma_at(base));
        let mapped = MappedMemory::open(f.dir.as_fd(), &f.creds, &vma, reg, now).expect("mapped");
        assert_eq!(mapped.map.len(), 4096, "one page, not the whole 64 KiB");
        assert_eq!(mapped.base, base + 4096);
        mapped.write(base + 5000, b"abc").unwrap();
        // SAFETY: reading our own mapping.
        assert_eq!(
            unsafe { std::slice::from_raw_parts(m.as_ptr().add(5000), 3) },
            b"abc"
        );
        assert_eq!(mapped.atomic(base + 4104, &mut |v| v + 5).unwrap(), 0);
        assert_eq!(
            mapped.read(base + 8190, &mut [0u8; 4]),
            Err(VerbsError::BadAddress)
        );
        assert_eq!(
            mapped.read(base, &mut [0u8; 4]),
            Err(VerbsError::BadAddress)
        );
        // Unsealed, private or read-only mappings are not mapped.
        let unsealed = memfd(4096, false);
        let u = memmap2::MmapOptions::new()
            .len(4096)
            .map_raw(&unsealed)
            .unwrap();
        let uv = vma_at(u.as_ptr() as u64);
        let now = || Some(vma_at(uv.lo));
        assert!(MappedMemory::open(f.dir.as_fd(), &f.creds, &uv, (uv.lo, 10), now).is_none());
        let private = vec![0u8; 100_000];
        let pv = vma_at(private.as_ptr() as u64);
        let range = (private.as_ptr() as u64, 10);
        let now = || Some(vma_at(range.0));
        assert!(MappedMemory::open(f.dir.as_fd(), &f.creds, &pv, range, now).is_none());
    }

    #[test]
    fn a_file_that_ends_inside_a_page_is_mapped_up_to_that_page() {
        let Some(f) = fixture() else { return };
        // What `ual::RegBuf::new(5000)` makes: a 5000-byte file in a two-page mapping.
        let file = memfd(5000, true);
        let m = memmap2::MmapOptions::new()
            .len(8192)
            .map_raw(&file)
            .unwrap();
        let base = m.as_ptr() as u64;
        let vma = vma_at(base);
        let now = || Some(vma_at(base));
        let mapped = MappedMemory::open(f.dir.as_fd(), &f.creds, &vma, (base, 5000), now)
            .expect("the whole file is mapped");
        assert_eq!(mapped.map.len(), 8192);
        mapped.write(base + 4990, b"0123456789").unwrap();
        // SAFETY: reading our own mapping, inside the file.
        assert_eq!(
            unsafe { std::slice::from_raw_parts(m.as_ptr().add(4990), 10) },
            b"0123456789"
        );
        // A registration reaching a page wholly past the end is not mapped (touching it
        // would fault); the memory file serves it, and fails there as the consumer would.
        let big = memmap2::MmapOptions::new()
            .len(16384)
            .map_raw(&file)
            .unwrap();
        let bv = vma_at(big.as_ptr() as u64);
        let now = || Some(vma_at(bv.lo));
        assert!(MappedMemory::open(f.dir.as_fd(), &f.creds, &bv, (bv.lo, 9000), now).is_none());
    }

    #[test]
    fn a_mapping_swapped_after_the_maps_read_is_not_mapped() {
        let Some(f) = fixture() else { return };
        let a = memfd(8192, true);
        let m = memmap2::MmapOptions::new().len(8192).map_raw(&a).unwrap();
        let base = m.as_ptr() as u64;
        let seen = vma_at(base);
        // Between the daemon's read of the maps and its open, the caller maps another
        // sealed memfd (one it could only read, say) over the same range.
        let b = memfd(8192, true);
        // SAFETY: replaces our own mapping `m` in place with one of `b` (same range).
        let r = unsafe {
            libc::mmap(
                base as *mut _,
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                b.as_raw_fd(),
                0,
            )
        };
        assert_eq!(r as u64, base);
        let now = || Some(vma_at(base));
        assert!(MappedMemory::open(f.dir.as_fd(), &f.creds, &seen, (base, 100), now).is_none());
        // And a mapping that is another one once the file is open is refused as well.
        let current = vma_at(base);
        let changed = || {
            Some(Vma {
                inode: current.inode + 1,
                ..current.clone()
            })
        };
        assert!(
            MappedMemory::open(f.dir.as_fd(), &f.creds, &current, (base, 100), changed).is_none()
        );
        assert!(MappedMemory::open(f.dir.as_fd(), &f.creds, &current, (base, 100), now).is_some());
    }
}
