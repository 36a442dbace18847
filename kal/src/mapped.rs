//! Consumer memory the daemon maps for itself: when a registered range lies in a shared
//! mapping of a sealed memfd (what `ual::RegBuf` allocates), `krdmad` maps the same pages
//! through `/proc/PID/map_files` and the engine copies straight in and out of them, as in
//! embedded mode — one copy per byte instead of the two of `process_vm_readv/writev` plus
//! the socket. Anything else (private anonymous memory, `malloc`) keeps the
//! `process_vm_*` path of [`crate::process`].
//!
//! The file must carry `F_SEAL_SHRINK`: a consumer that could truncate it would make the
//! daemon's next access to the vanished pages a SIGBUS. With the seal the mapping stays
//! valid for as long as the daemon holds it, whatever the consumer does to its own.

use rnicpi::{MemoryAccess, Result, VerbsError};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

/// One shared mapping of a consumer, mapped again in this process.
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

/// The line of `/proc/PID/maps` covering `[addr, addr+len)`: (lo, hi, perms, offset).
fn covering_mapping(pid: u32, addr: u64, len: u64) -> Option<(u64, u64, String, u64)> {
    let end = addr.checked_add(len)?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|line| {
        let mut cols = line.split_whitespace();
        let (lo, hi) = cols.next()?.split_once('-')?;
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).ok()?,
            u64::from_str_radix(hi, 16).ok()?,
        );
        let perms = cols.next()?.to_string();
        let offset = u64::from_str_radix(cols.next()?, 16).ok()?;
        (lo <= addr && end <= hi).then_some((lo, hi, perms, offset))
    })
}

impl MappedMemory {
    /// Map the consumer's shared, shrink-sealed mapping that holds the whole range, or
    /// `None` when there is none (the caller falls back to `process_vm_*`).
    pub fn open(pid: u32, addr: u64, len: u64) -> Option<MappedMemory> {
        let (lo, hi, perms, offset) = covering_mapping(pid, addr, len)?;
        if perms.as_bytes().get(3) != Some(&b's') {
            return None; // private: copy-on-write pages nobody else can see
        }
        if perms.as_bytes().get(1) != Some(&b'w') {
            return None;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/map_files/{lo:x}-{hi:x}"))
            .ok()?;
        // SAFETY: F_GET_SEALS reads the seals of a descriptor we own.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return None;
        }
        let size = file.metadata().ok()?.len();
        // Only the pages of the registration, not the whole VMA: what the daemon maps
        // is what the registration is charged for (a 1-byte registration inside a huge
        // sparse mapping costs one page of the daemon's address space, not the mapping).
        let first = addr & !(crate::pin::PAGE - 1);
        let span = crate::pin::pinned_span(addr, len)?;
        let file_off = offset.checked_add(first - lo)?;
        if first.checked_add(span)? > hi || file_off.checked_add(span)? > size {
            return None;
        }
        let map = memmap2::MmapOptions::new()
            .offset(file_off)
            .len(span as usize)
            .map_raw(&file)
            .ok()?;
        tracing::debug!(
            pid,
            base = format_args!("{first:#x}"),
            span,
            "consumer memory mapped directly"
        );
        Some(MappedMemory { map, base: first })
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
    use std::os::fd::FromRawFd;

    fn sealed_memfd(len: usize, seal: bool) -> memmap2::MmapRaw {
        let name = std::ffi::CString::new("t").unwrap();
        // SAFETY: memfd_create with a valid name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
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
        memmap2::MmapOptions::new().len(len).map_raw(&file).unwrap()
    }

    #[test]
    fn maps_sealed_shared_memory_and_refuses_the_rest() {
        if !nix::unistd::geteuid().is_root() {
            return; // /proc/PID/map_files needs CAP_SYS_ADMIN, as krdmad has
        }
        let me = std::process::id();
        let m = sealed_memfd(8192, true);
        let base = m.as_ptr() as u64;
        let mapped = MappedMemory::open(me, base + 100, 1000).expect("sealed memfd mapped");
        mapped.write(base + 100, b"abc").unwrap();
        // SAFETY: reading our own mapping.
        assert_eq!(
            unsafe { std::slice::from_raw_parts(m.as_ptr().add(100), 3) },
            b"abc"
        );
        assert_eq!(mapped.atomic(base + 8, &mut |v| v + 5).unwrap(), 0);
        assert_eq!(
            mapped.read(base + 8190, &mut [0u8; 4]),
            Err(VerbsError::BadAddress)
        );
        let unsealed = sealed_memfd(4096, false);
        assert!(MappedMemory::open(me, unsealed.as_ptr() as u64, 10).is_none());
        let private = vec![0u8; 100_000];
        assert!(MappedMemory::open(me, private.as_ptr() as u64, 10).is_none());
    }
}
