//! Page pinning on behalf of the kAL: `mlock` with a per-page reference count (so two
//! registrations sharing a page do not unlock each other) and `MADV_DONTFORK`, so a
//! child of `fork()` never gets a copy-on-write view of memory under a transfer.

use parking_lot::Mutex;
use rnicpi::{Result, VerbsError};
use std::collections::BTreeMap;

const PAGE: usize = 4096;

static PAGES: Mutex<BTreeMap<usize, u32>> = Mutex::new(BTreeMap::new());

fn span(addr: u64, len: u64) -> Option<(usize, usize)> {
    let start = (addr as usize) & !(PAGE - 1);
    let end = (addr as usize)
        .checked_add(len as usize)?
        .checked_add(PAGE - 1)?
        & !(PAGE - 1);
    Some((start, end))
}

/// Apply `f` to every maximal run of pages in `[start, end)` for which `pick` holds.
fn runs(
    start: usize,
    end: usize,
    pick: impl Fn(usize) -> bool,
    mut f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    let mut p = start;
    while p < end {
        if !pick(p) {
            p += PAGE;
            continue;
        }
        let s = p;
        while p < end && pick(p) {
            p += PAGE;
        }
        f(s, p - s)?;
    }
    Ok(())
}

/// Pin the pages of `[addr, addr+len)`.
pub fn pin(addr: u64, len: u64) -> Result<()> {
    let (start, end) = span(addr, len).ok_or(VerbsError::Invalid)?;
    let mut pages = PAGES.lock();
    let fresh = |p: usize| !pages.contains_key(&p);
    let r = runs(start, end, fresh, |s, n| {
        // SAFETY: mlock/madvise only change paging attributes of our own mapped range;
        // failure is reported, and an unmapped range fails with ENOMEM.
        unsafe {
            if libc::mlock(s as *const libc::c_void, n) != 0 {
                let e = std::io::Error::last_os_error();
                return Err(match e.raw_os_error() {
                    Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN) => {
                        VerbsError::PinLimit
                    }
                    _ => e.into(),
                });
            }
            libc::madvise(s as *mut libc::c_void, n, libc::MADV_DONTFORK);
        }
        Ok(())
    });
    if let Err(e) = r {
        // Undo the runs locked before the failure.
        let _ = runs(
            start,
            end,
            |p| !pages.contains_key(&p),
            |s, n| {
                // SAFETY: as above; unlocking pages we locked a moment ago.
                unsafe { libc::munlock(s as *const libc::c_void, n) };
                Ok(())
            },
        );
        return Err(e);
    }
    let mut p = start;
    while p < end {
        *pages.entry(p).or_insert(0) += 1;
        p += PAGE;
    }
    Ok(())
}

/// Undo one [`pin`] of the same range.
pub fn unpin(addr: u64, len: u64) {
    let Some((start, end)) = span(addr, len) else {
        return;
    };
    let mut pages = PAGES.lock();
    let mut p = start;
    while p < end {
        if let Some(c) = pages.get_mut(&p) {
            *c -= 1;
            if *c == 0 {
                pages.remove(&p);
                // SAFETY: the page is ours and no registration uses it any more.
                unsafe {
                    libc::munlock(p as *const libc::c_void, PAGE);
                    libc::madvise(p as *mut libc::c_void, PAGE, libc::MADV_DOFORK);
                }
            }
        }
        p += PAGE;
    }
}

/// Pages pinned by this process now.
pub fn pinned_pages() -> usize {
    PAGES.lock().len()
}
