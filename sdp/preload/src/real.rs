//! The C library's own socket calls, found behind this library (`dlsym(RTLD_NEXT)`).

use libc::{c_char, c_int, c_void, size_t, sockaddr, socklen_t, ssize_t};
use std::sync::OnceLock;

macro_rules! real_fns {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The next definitions of the calls this library interposes.
        #[allow(non_snake_case)]
        pub struct Real {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        pub fn real() -> &'static Real {
            static REAL: OnceLock<Real> = OnceLock::new();
            REAL.get_or_init(|| Real {
                $($name: {
                    let name = concat!(stringify!($name), "\0");
                    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; the C library
                    // defines every one of these calls with exactly this signature (the
                    // variadic fcntl and ioctl take their one integer-or-pointer argument
                    // in the same register on every ABI Linux runs this on).
                    unsafe {
                        let p = libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char);
                        assert!(!p.is_null(), "krdma-sdp preload: no {} in the C library", stringify!($name));
                        std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> $ret>(p)
                    }
                },)*
            })
        }
    };
}

real_fns! {
    socket: fn(c_int, c_int, c_int) -> c_int;
    bind: fn(c_int, *const sockaddr, socklen_t) -> c_int;
    listen: fn(c_int, c_int) -> c_int;
    accept4: fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;
    connect: fn(c_int, *const sockaddr, socklen_t) -> c_int;
    read: fn(c_int, *mut c_void, size_t) -> ssize_t;
    write: fn(c_int, *const c_void, size_t) -> ssize_t;
    readv: fn(c_int, *const libc::iovec, c_int) -> ssize_t;
    writev: fn(c_int, *const libc::iovec, c_int) -> ssize_t;
    recvfrom: fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t;
    sendto: fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t;
    recvmsg: fn(c_int, *mut libc::msghdr, c_int) -> ssize_t;
    sendmsg: fn(c_int, *const libc::msghdr, c_int) -> ssize_t;
    close: fn(c_int) -> c_int;
    shutdown: fn(c_int, c_int) -> c_int;
    getsockopt: fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int;
    setsockopt: fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int;
    getsockname: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
    getpeername: fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
    fcntl: fn(c_int, c_int, libc::c_ulong) -> c_int;
    ioctl: fn(c_int, libc::c_ulong, libc::c_ulong) -> c_int;
    dup: fn(c_int) -> c_int;
    dup2: fn(c_int, c_int) -> c_int;
    dup3: fn(c_int, c_int, c_int) -> c_int;
    sendfile: fn(c_int, c_int, *mut libc::off_t, size_t) -> ssize_t;
    socketpair: fn(c_int, c_int, c_int, *mut c_int) -> c_int;
    eventfd: fn(libc::c_uint, c_int) -> c_int;
    memfd_create: fn(*const c_char, libc::c_uint) -> c_int;
    epoll_create1: fn(c_int) -> c_int;
    open64: fn(*const c_char, c_int, libc::mode_t) -> c_int;
    poll: fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;
    ppoll: fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int;
    select: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int;
    pselect: fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int;
    __poll_chk: fn(*mut libc::pollfd, libc::nfds_t, c_int, size_t) -> c_int;
    __ppoll_chk: fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t, size_t) -> c_int;
    epoll_wait: fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int;
    epoll_pwait: fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int;
    pthread_create: fn(*mut libc::pthread_t, *const libc::pthread_attr_t, extern "C" fn(*mut c_void) -> *mut c_void, *mut c_void) -> c_int;
}
