//! `poll`, `select` and `epoll_wait`: a thread of the program about to wait arms the SDP
//! connections its calls left unarmed (`krdma_sdp::conn::hot`), so the readiness faces
//! it may be waiting on tell the truth while it sleeps. Every call then goes on to the
//! C library's own. The library's threads (the progress thread's `epoll_wait`, a blocked
//! SDP call's `poll`) pass straight through.

use crate::real::real;
use crate::table::is_inside;
use krdma_sdp::conn::hot::Waiting;
use libc::{c_int, epoll_event, fd_set, nfds_t, pollfd, sigset_t, size_t, timespec, timeval};

fn waiting() -> Option<Waiting> {
    (!is_inside()).then(Waiting::enter)
}

/// # Safety
/// As `poll(2)`.
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let _w = waiting();
    (real().poll)(fds, n, timeout)
}

/// # Safety
/// As `poll(2)` (the fortified entry point).
#[no_mangle]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    let _w = waiting();
    (real().__poll_chk)(fds, n, timeout, fdslen)
}

/// # Safety
/// As `ppoll(2)`.
#[no_mangle]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    let _w = waiting();
    (real().ppoll)(fds, n, timeout, mask)
}

/// # Safety
/// As `ppoll(2)` (the fortified entry point).
#[no_mangle]
pub unsafe extern "C" fn __ppoll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: *const timespec,
    mask: *const sigset_t,
    fdslen: size_t,
) -> c_int {
    let _w = waiting();
    (real().__ppoll_chk)(fds, n, timeout, mask, fdslen)
}

/// # Safety
/// As `select(2)`.
#[no_mangle]
pub unsafe extern "C" fn select(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    timeout: *mut timeval,
) -> c_int {
    let _w = waiting();
    (real().select)(n, r, w, e, timeout)
}

/// # Safety
/// As `pselect(2)`.
#[no_mangle]
pub unsafe extern "C" fn pselect(
    n: c_int,
    r: *mut fd_set,
    w: *mut fd_set,
    e: *mut fd_set,
    timeout: *const timespec,
    mask: *const sigset_t,
) -> c_int {
    let _w = waiting();
    (real().pselect)(n, r, w, e, timeout, mask)
}

/// # Safety
/// As `epoll_wait(2)`.
#[no_mangle]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
) -> c_int {
    let _w = waiting();
    (real().epoll_wait)(epfd, events, max, timeout)
}

/// # Safety
/// As `epoll_pwait(2)`.
#[no_mangle]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut epoll_event,
    max: c_int,
    timeout: c_int,
    mask: *const sigset_t,
) -> c_int {
    let _w = waiting();
    (real().epoll_pwait)(epfd, events, max, timeout, mask)
}
