//! `poll`, `select` and `epoll_wait`: the program is about to wait, maybe for its SDP
//! sockets' readiness faces. Its hot SDP connections — left unarmed by its last calls, so
//! that they receive in its own thread (`krdma_sdp::conn::hot`) — are armed first, so their
//! faces tell the truth while it sleeps, and while it sleeps every call of the program
//! arms its connection. A wait with a zero timeout does not sleep: it takes what arrived
//! on the hot connections (once, without arming them) and looks. The library's own waits
//! (the progress thread's `epoll_wait`, a blocked SDP call's `poll`) go straight on.
//!
//! (Polling the hot connections for a while before sleeping, as a blocking SDP call does,
//! was measured too: iperf3 gained a little, redis-benchmark lost almost half —
//! docs/benchmarks.md.)

use crate::real::real;
use crate::table::is_inside;
use krdma_sdp::conn::hot::{self, Waiting};
use libc::{c_int, epoll_event, fd_set, nfds_t, pollfd, sigset_t, size_t, timespec, timeval};

/// Make the program's wait (see the module's notes); `zero`: its timeout is zero.
fn wait(zero: bool, call: impl FnOnce() -> c_int) -> c_int {
    if is_inside() {
        return call();
    }
    if zero {
        hot::poll_hot();
        return call();
    }
    let _w = Waiting::enter();
    call()
}

/// # Safety
/// As `poll(2)`.
#[no_mangle]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    wait(timeout == 0, || (real().poll)(fds, n, timeout))
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
    wait(timeout == 0, || {
        (real().__poll_chk)(fds, n, timeout, fdslen)
    })
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
    // SAFETY: the program's own argument, null or a timespec.
    let zero = unsafe { is_zero_ts(timeout) };
    wait(zero, || (real().ppoll)(fds, n, timeout, mask))
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
    // SAFETY: as in ppoll.
    let zero = unsafe { is_zero_ts(timeout) };
    wait(zero, || (real().__ppoll_chk)(fds, n, timeout, mask, fdslen))
}

/// # Safety
/// `t` is null or points to a timespec.
unsafe fn is_zero_ts(t: *const timespec) -> bool {
    // SAFETY: as the caller promises.
    unsafe { t.as_ref() }.is_some_and(|t| t.tv_sec == 0 && t.tv_nsec == 0)
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
    // SAFETY: the program's own argument, null or a timeval.
    let zero = unsafe { timeout.as_ref() }.is_some_and(|t| t.tv_sec == 0 && t.tv_usec == 0);
    wait(zero, || (real().select)(n, r, w, e, timeout))
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
    // SAFETY: as in ppoll.
    let zero = unsafe { is_zero_ts(timeout) };
    wait(zero, || (real().pselect)(n, r, w, e, timeout, mask))
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
    wait(timeout == 0, || {
        (real().epoll_wait)(epfd, events, max, timeout)
    })
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
    wait(timeout == 0, || {
        (real().epoll_pwait)(epfd, events, max, timeout, mask)
    })
}
