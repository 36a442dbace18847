//! Memory meant for registration: page-aligned, zero-filled, and accessed only through
//! copies, because a remote peer (through the engine) may write it at any time — exactly
//! like memory registered with a hardware RNIC.

use std::sync::Arc;

/// A page-aligned shared mapping (of a sealed memfd) to register with
/// [`Context::reg_mr`](crate::Context::reg_mr).
pub struct RegBuf {
    map: memmap2::MmapRaw,
}

impl std::fmt::Debug for RegBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegBuf").field("len", &self.len()).finish()
    }
}

impl RegBuf {
    /// Page-aligned memory of `len` bytes, zero-filled. It is a shared mapping of a
    /// memfd sealed against shrinking, so `krdmad` can map the same pages and move data
    /// with one copy instead of `process_vm_*` (the kAL's `mapped` module); any memory can be
    /// registered, this is only the fast kind.
    pub fn new(len: usize) -> std::io::Result<Arc<RegBuf>> {
        let len = len.max(1);
        let name = std::ffi::CString::new("krdma-buf").map_err(std::io::Error::other)?;
        // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on a descriptor we own.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let map = memmap2::MmapOptions::new().len(len).map_raw(&file)?;
        Ok(Arc::new(RegBuf { map }))
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.len()),
            "RegBuf access out of range"
        );
    }

    /// Copy `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) {
        self.check(offset, data.len());
        // SAFETY: the range is inside the live mapping (checked); the mapping is only ever
        // accessed through raw copies, never through references, so a concurrent write by
        // the engine can tear the data but never invalidates a Rust reference.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(offset),
                data.len(),
            )
        }
    }

    /// Copy `out.len()` bytes from the buffer at `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) {
        self.check(offset, out.len());
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        }
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v);
        v
    }

    /// Fill the whole buffer with `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole live mapping, raw write as in `write`.
        unsafe { std::ptr::write_bytes(self.map.as_mut_ptr(), byte, self.len()) }
    }
}
