//! Every call into libibverbs and librdmacm, and every `unsafe` block of the crate.
//!
//! The functions come from `rdma-mummy-sys`: static stubs whose constructors
//! `dlopen("libibverbs.so.1")` / `dlopen("librdmacm.so.1")` when the process starts and whose
//! calls fail (`EOPNOTSUPP`, NULL) when a library is absent; the inline verbs of
//! `<infiniband/verbs.h>` (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`, ...) are
//! Rust functions there that call through the context's ops table, as the C header does.
//!
//! Each wrapper owns one rdma-core object and destroys it on `Drop`; the rest of the crate
//! sees only safe methods. The objects are `Send + Sync`: libibverbs and librdmacm calls
//! are thread-safe on distinct objects and on the same object (each provider locks its
//! queues), which is what rdma-core documents for the verbs API.
//!
//! Over 600 lines: every `unsafe` block of the crate is here, so that the safety arguments
//! of one FFI boundary are read together; verbs objects, then rdma_cm, then the tests.

use rdma_mummy_sys as ffi;
use rnicpi::{Result, VerbsError};
use std::ffi::{c_int, c_void, CStr};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};

pub(crate) use ffi::{ibv_qp_attr, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_wc};

/// Every libibverbs symbol the provider resolves (the inline verbs go through the
/// context's ops table and need none: `ibv_post_send`, `ibv_poll_cq`, `ibv_alloc_mw`,
/// `ibv_dealloc_mw`, ...). The symbol test dlopens the installed library and looks each
/// one up.
pub const IBVERBS_SYMBOLS: &[&str] = &[
    "ibv_get_device_list",
    "ibv_free_device_list",
    "ibv_get_device_name",
    "ibv_open_device",
    "ibv_close_device",
    "ibv_query_device",
    "ibv_query_port",
    "ibv_query_gid",
    "ibv_alloc_pd",
    "ibv_dealloc_pd",
    "ibv_reg_mr",
    "ibv_dereg_mr",
    "ibv_create_comp_channel",
    "ibv_destroy_comp_channel",
    "ibv_create_cq",
    "ibv_destroy_cq",
    "ibv_get_cq_event",
    "ibv_ack_cq_events",
    "ibv_create_qp",
    "ibv_modify_qp",
    "ibv_query_qp",
    "ibv_destroy_qp",
    "ibv_create_srq",
    "ibv_modify_srq",
    "ibv_destroy_srq",
    "ibv_get_async_event",
    "ibv_ack_async_event",
];

/// Every librdmacm symbol the provider resolves.
pub const RDMACM_SYMBOLS: &[&str] = &[
    "rdma_create_event_channel",
    "rdma_destroy_event_channel",
    "rdma_create_id",
    "rdma_destroy_id",
    "rdma_bind_addr",
    "rdma_resolve_addr",
    "rdma_resolve_route",
    "rdma_listen",
    "rdma_connect",
    "rdma_establish",
    "rdma_accept",
    "rdma_reject",
    "rdma_disconnect",
    "rdma_get_cm_event",
    "rdma_ack_cm_event",
    "rdma_init_qp_attr",
];

/// The sonames the stubs load.
pub const IBVERBS_SONAME: &str = "libibverbs.so.1";
pub const RDMACM_SONAME: &str = "librdmacm.so.1";

/// `IBV_LINK_LAYER_INFINIBAND` (an anonymous enum in verbs.h, absent from the bindings).
pub const LINK_LAYER_INFINIBAND: u8 = 1;

/// C structs of rdma-core for which all-zero bytes are a valid value (integers, raw
/// pointers, unions of those).
///
/// # Safety
///
/// Implement only for such types.
pub(crate) unsafe trait Zeroed: Sized {}
// SAFETY: plain C structs of integers, raw pointers and unions of those.
unsafe impl Zeroed for ffi::ibv_qp_attr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_send_wr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_recv_wr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_sge {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_wc {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_ah_attr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_device_attr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_port_attr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_qp_init_attr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::ibv_srq_init_attr {}
// SAFETY: as above.
unsafe impl Zeroed for ffi::rdma_conn_param {}
// SAFETY: as above.
unsafe impl Zeroed for libc::sockaddr_storage {}

/// An all-zero value of a C struct.
pub(crate) fn zeroed<T: Zeroed>() -> T {
    // SAFETY: `Zeroed` promises all-zero bytes are a valid `T`.
    unsafe { std::mem::zeroed() }
}

/// The immediate data / invalidated rkey word of a completion (a union of two `u32`s).
pub(crate) fn wc_imm(wc: &ffi::ibv_wc) -> u32 {
    // SAFETY: both members of the union are `u32`; any bits are a valid `u32`.
    unsafe { wc.imm_data_invalidated_rkey_union.imm_data }
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Map a verbs return code (0, a positive errno, or -1 with errno set) to a result.
fn check(rc: c_int) -> Result<()> {
    match rc {
        0 => Ok(()),
        -1 => Err(err_from_errno(errno())),
        e if e < 0 => Err(err_from_errno(-e)),
        e => Err(err_from_errno(e)),
    }
}

/// `ENOMEM` from a post is a full queue: `Exhausted` in the RNIC-PI contract.
pub(crate) fn err_from_errno(e: i32) -> VerbsError {
    match e {
        libc::ENOMEM => VerbsError::Exhausted,
        libc::ENODEV | libc::ENOSYS => VerbsError::Unsupported,
        e => VerbsError::from_errno(e),
    }
}

fn nonnull<T>(p: *mut T) -> Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| err_from_errno(errno()))
}

fn set_nonblocking(fd: RawFd) -> Result<()> {
    // SAFETY: fcntl on a descriptor we were given by the library; it only changes flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(err_from_errno(errno()));
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(err_from_errno(errno()));
    }
    Ok(())
}

/// A device libibverbs lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub name: String,
    pub iwarp: bool,
}

/// The devices libibverbs lists (none when the library is absent).
pub fn list_devices() -> Vec<DeviceInfo> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out pointer; a NULL result means no list.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until it is freed below.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: `dev` is a listed device; the name is a NUL-terminated string it owns.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
        // SAFETY: `dev` points to a live `ibv_device` while the list exists.
        let transport = unsafe { (*dev).transport_type };
        out.push(DeviceInfo {
            name: name.to_string_lossy().into_owned(),
            iwarp: transport == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP,
        });
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ffi::ibv_free_device_list(list) };
    out
}

/// An open device (`ibv_context`).
pub struct Context {
    ctx: NonNull<ffi::ibv_context>,
    pub info: DeviceInfo,
}

// SAFETY: an ibv_context may be used from any thread (libibverbs locks what it shares).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Open the device libibverbs calls `name`.
    pub fn open(name: &str) -> Result<Context> {
        let mut n: c_int = 0;
        // SAFETY: as in `list_devices`.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(VerbsError::NoSuchResource);
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: as in `list_devices`.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            // SAFETY: as in `list_devices`.
            let dn = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) };
            if dn.to_bytes() == name.as_bytes() {
                // SAFETY: as in `list_devices`.
                let iwarp = unsafe { (*dev).transport_type }
                    == ffi::ibv_transport_type::IBV_TRANSPORT_IWARP;
                // SAFETY: `dev` is a listed device; opening it before freeing the list is
                // what the API asks.
                let ctx = unsafe { ffi::ibv_open_device(dev) };
                found = Some((ctx, iwarp));
                break;
            }
        }
        // SAFETY: freed once; an opened context stays valid after the list is freed.
        unsafe { ffi::ibv_free_device_list(list) };
        let (ctx, iwarp) = found.ok_or(VerbsError::NoSuchResource)?;
        Ok(Context {
            ctx: nonnull(ctx)?,
            info: DeviceInfo {
                name: name.to_string(),
                iwarp,
            },
        })
    }

    pub fn query_device(&self) -> Result<ffi::ibv_device_attr> {
        let mut attr: ffi::ibv_device_attr = zeroed();
        // SAFETY: live context, valid out pointer.
        check(unsafe { ffi::ibv_query_device(self.ctx.as_ptr(), &mut attr) })?;
        Ok(attr)
    }

    pub fn query_port(&self, port: u8) -> Result<ffi::ibv_port_attr> {
        let mut attr: ffi::ibv_port_attr = zeroed();
        // SAFETY: live context, valid out pointer of the full (non-compat) size.
        check(unsafe { ffi::ibv_query_port(self.ctx.as_ptr(), port, &mut attr) })?;
        Ok(attr)
    }

    pub fn query_gid(&self, port: u8, index: i32) -> Result<[u8; 16]> {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: live context, valid out pointer.
        check(unsafe { ffi::ibv_query_gid(self.ctx.as_ptr(), port, index, &mut gid) })?;
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(unsafe { gid.raw })
    }

    /// The asynchronous event descriptor, made non-blocking.
    pub fn async_fd(&self) -> Result<RawFd> {
        // SAFETY: live context; reading a plain field.
        let fd = unsafe { (*self.ctx.as_ptr()).async_fd };
        set_nonblocking(fd)?;
        Ok(fd)
    }

    /// Take (and acknowledge) one asynchronous event; `None` when none is pending.
    pub fn get_async_event(&self) -> Option<AsyncEvent> {
        let mut ev = std::mem::MaybeUninit::<ffi::ibv_async_event>::zeroed();
        // SAFETY: live context, valid out pointer; the descriptor is non-blocking.
        if unsafe { ffi::ibv_get_async_event(self.ctx.as_ptr(), ev.as_mut_ptr()) } != 0 {
            return None;
        }
        let p = ev.as_mut_ptr();
        // SAFETY: the library filled the event. The type is read as a plain integer
        // (the Rust enum of the bindings has no value for types newer than it).
        let kind = unsafe { ptr::addr_of!((*p).event_type).cast::<u32>().read() };
        // SAFETY: the union member matching the event type is the one the library set;
        // the objects it names stay alive until the event is acknowledged below.
        let element = unsafe {
            match kind {
                // CQ error
                0 => AsyncElement::Cq((*(*p).element.cq).cq_context as usize),
                // QP events (fatal, req, access, comm est, sq drained, path mig, last wqe)
                1..=7 | 16 => AsyncElement::Qp((*(*p).element.qp).qp_num),
                // SRQ error and limit
                14 | 15 => AsyncElement::Srq((*(*p).element.srq).srq_context as usize),
                19 => AsyncElement::None, // WQ fatal: no WQs here
                _ => AsyncElement::Port((*p).element.port_num as u8),
            }
        };
        // SAFETY: the event came from ibv_get_async_event and is acknowledged once.
        unsafe { ffi::ibv_ack_async_event(p) };
        Some(AsyncEvent { kind, element })
    }

    fn raw(&self) -> *mut ffi::ibv_context {
        self.ctx.as_ptr()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object of the context holds an `Arc` of its owner and is gone.
        unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// What an asynchronous event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncElement {
    /// A CQ, by its `cq_context` key.
    Cq(usize),
    /// A QP, by number.
    Qp(u32),
    /// An SRQ, by its `srq_context` key.
    Srq(usize),
    Port(u8),
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// An `IBV_EVENT_*` value.
    pub kind: u32,
    pub element: AsyncElement,
}

/// A completion channel (`ibv_comp_channel`).
pub struct CompChannel(NonNull<ffi::ibv_comp_channel>);
// SAFETY: used from the event thread and creators; libibverbs serialises through the fd.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub fn new(ctx: &Context) -> Result<CompChannel> {
        // SAFETY: live context.
        let ch = nonnull(unsafe { ffi::ibv_create_comp_channel(ctx.raw()) })?;
        let chan = CompChannel(ch);
        set_nonblocking(chan.fd())?;
        Ok(chan)
    }
    pub fn fd(&self) -> RawFd {
        // SAFETY: live channel; plain field.
        unsafe { (*self.0.as_ptr()).fd }
    }
    /// Take (and acknowledge) one completion event: the CQ's `cq_context` key.
    pub fn get_cq_event(&self) -> Option<usize> {
        let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
        let mut cq_ctx: *mut c_void = ptr::null_mut();
        // SAFETY: live channel, valid out pointers; the fd is non-blocking.
        if unsafe { ffi::ibv_get_cq_event(self.0.as_ptr(), &mut cq, &mut cq_ctx) } != 0 {
            return None;
        }
        // SAFETY: the CQ is alive until its events are acknowledged (ibv_destroy_cq waits).
        unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        Some(cq_ctx as usize)
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: the CQs on the channel are gone (they hold the device's `Arc`).
        unsafe { ffi::ibv_destroy_comp_channel(self.0.as_ptr()) };
    }
}

/// A protection domain.
pub struct Pd(NonNull<ffi::ibv_pd>);
// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(ctx: &Context) -> Result<Pd> {
        // SAFETY: live context.
        Ok(Pd(nonnull(unsafe { ffi::ibv_alloc_pd(ctx.raw()) })?))
    }

    /// Register `[addr, addr+len)` with `access` (`IBV_ACCESS_*` bits).
    ///
    /// # Safety
    ///
    /// The memory must stay mapped while the registration exists.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: u32) -> Result<Mr> {
        // SAFETY: live PD; the caller keeps the range mapped.
        let mr = unsafe { ffi::ibv_reg_mr(self.0.as_ptr(), addr.cast(), len, access as c_int) };
        Ok(Mr(nonnull(mr)?))
    }

    /// A memory window of type 2 (`EOPNOTSUPP` → `Unsupported` where the device's
    /// provider has none, e.g. siw).
    pub fn alloc_mw(&self) -> Result<Mw> {
        // SAFETY: live PD; the inline verb calls through the context's ops table and fails
        // with errno set when the provider does not offer windows.
        let mw = unsafe { ffi::ibv_alloc_mw(self.0.as_ptr(), ffi::ibv_mw_type::IBV_MW_TYPE_2) };
        Ok(Mw(NonNull::new(mw).ok_or_else(|| match errno() {
            libc::EOPNOTSUPP | libc::ENOSYS => VerbsError::Unsupported,
            e => err_from_errno(e),
        })?))
    }

    /// An address handle for UD Sends to `attr`'s destination.
    pub fn create_ah(&self, attr: &mut ffi::ibv_ah_attr) -> Result<Ah> {
        // SAFETY: live PD; `attr` is a valid attribute struct the call only reads.
        Ok(Ah(nonnull(unsafe {
            ffi::ibv_create_ah(self.0.as_ptr(), attr)
        })?))
    }
}

/// An address handle.
pub struct Ah(NonNull<ffi::ibv_ah>);
// SAFETY: verbs address handles may be used and destroyed from any thread.
unsafe impl Send for Ah {}
// SAFETY: as above (posting only reads it).
unsafe impl Sync for Ah {}

impl Ah {
    pub fn as_ptr(&self) -> *mut ffi::ibv_ah {
        self.0.as_ptr()
    }
}

impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: destroyed once; no Send naming it is being posted (the owner holds an
        // `Arc` of it across each post).
        unsafe { ffi::ibv_destroy_ah(self.0.as_ptr()) };
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: its MRs, QPs and SRQs are gone (the uAL drops children first; ours hold
        // an `Arc` of the PD).
        unsafe { ffi::ibv_dealloc_pd(self.0.as_ptr()) };
    }
}

/// A memory registration.
pub struct Mr(NonNull<ffi::ibv_mr>);
// SAFETY: verbs objects may be used from any thread; lkey/rkey are immutable.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    pub fn lkey(&self) -> u32 {
        // SAFETY: live MR; immutable field.
        unsafe { (*self.0.as_ptr()).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.0.as_ptr()).rkey }
    }
}

impl Mr {
    /// The registration, for a window bind's `bind_info.mr` (valid while `self` lives).
    pub(crate) fn raw(&self) -> *mut ffi::ibv_mr {
        self.0.as_ptr()
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: deregistered once.
        unsafe { ffi::ibv_dereg_mr(self.0.as_ptr()) };
    }
}

/// A memory window (type 2).
pub struct Mw(NonNull<ffi::ibv_mw>);
// SAFETY: verbs objects may be used from any thread; the one field written after
// allocation (`rkey`, see `set_rkey`) is written under the owner's lock.
unsafe impl Send for Mw {}
// SAFETY: as above.
unsafe impl Sync for Mw {}

impl Mw {
    /// The key libibverbs holds for the window.
    pub fn rkey(&self) -> u32 {
        // SAFETY: live window; plain field (written only by `set_rkey`, under the owner's
        // lock).
        unsafe { ptr::addr_of!((*self.0.as_ptr()).rkey).read() }
    }
    /// Record the window's current key where the device's provider reads it when a bind
    /// is posted (rxe hands `mw->rkey` to the kernel, which refuses a bind naming any key
    /// but the current one). The caller serialises this with posting binds of the window.
    pub(crate) fn set_rkey(&self, rkey: u32) {
        // SAFETY: live window; libibverbs reads this field only while a bind of the window
        // is posted, which the caller does not do concurrently.
        unsafe { ptr::addr_of_mut!((*self.0.as_ptr()).rkey).write(rkey) }
    }
    /// The window, for a bind's `bind_mw.mw` (valid while `self` lives).
    pub(crate) fn raw(&self) -> *mut ffi::ibv_mw {
        self.0.as_ptr()
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: deallocated once; a window exists only where the provider has both
        // alloc_mw and dealloc_mw in its ops table.
        unsafe { ffi::ibv_dealloc_mw(self.0.as_ptr()) };
    }
}

/// A completion queue.
pub struct Cq(NonNull<ffi::ibv_cq>);
// SAFETY: verbs CQs may be polled and armed from any thread (the provider locks).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// A CQ of at least `depth` entries whose events come to `chan` tagged with `key`.
    pub fn new(ctx: &Context, depth: u32, chan: &CompChannel, key: usize) -> Result<Cq> {
        // SAFETY: live context and channel; `key` is an opaque tag, never dereferenced.
        let cq = unsafe {
            ffi::ibv_create_cq(
                ctx.raw(),
                depth as c_int,
                key as *mut c_void,
                chan.0.as_ptr(),
                0,
            )
        };
        Ok(Cq(nonnull(cq)?))
    }
    pub fn depth(&self) -> u32 {
        // SAFETY: live CQ; plain field.
        unsafe { (*self.0.as_ptr()).cqe as u32 }
    }
    /// Poll into `wc`; returns how many were filled (errors count as none).
    pub fn poll(&self, wc: &mut [ffi::ibv_wc]) -> usize {
        let n = wc.len().min(i32::MAX as usize) as i32;
        // SAFETY: live CQ; `wc` has room for `n` entries.
        let got = unsafe { ffi::ibv_poll_cq(self.0.as_ptr(), n, wc.as_mut_ptr()) };
        got.max(0) as usize
    }
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        check(unsafe { ffi::ibv_req_notify_cq(self.0.as_ptr(), solicited_only as c_int) })
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: the QPs using it are gone (they hold its `Arc`); destroy waits for the
        // event thread's acknowledgements.
        unsafe { ffi::ibv_destroy_cq(self.0.as_ptr()) };
    }
}

/// A shared receive queue.
pub struct Srq(NonNull<ffi::ibv_srq>);
// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    pub fn new(
        pd: &Pd,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
        key: usize,
    ) -> Result<(Srq, u32, u32)> {
        let mut init: ffi::ibv_srq_init_attr = zeroed();
        init.srq_context = key as *mut c_void;
        init.attr.max_wr = max_wr;
        init.attr.max_sge = max_sge;
        init.attr.srq_limit = limit;
        // SAFETY: live PD, valid attributes; the library writes back the granted sizes.
        let srq = nonnull(unsafe { ffi::ibv_create_srq(pd.0.as_ptr(), &mut init) })?;
        Ok((Srq(srq), init.attr.max_wr, init.attr.max_sge))
    }
    pub fn arm(&self, limit: u32) -> Result<()> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: live SRQ, valid attributes.
        check(unsafe {
            ffi::ibv_modify_srq(
                self.0.as_ptr(),
                &mut attr,
                ffi::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as c_int,
            )
        })
    }
    /// Post the chain starting at `wr` (its pointers valid for the call).
    pub fn post_recv(&self, wr: &mut ffi::ibv_recv_wr) -> Result<()> {
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: live SRQ; the chain and its SGE lists are valid for the call.
        check(unsafe { ffi::ibv_post_srq_recv(self.0.as_ptr(), wr, &mut bad) })
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: the QPs using it are gone (they hold its `Arc`).
        unsafe { ffi::ibv_destroy_srq(self.0.as_ptr()) };
    }
}

/// A queue pair.
pub struct Qp(NonNull<ffi::ibv_qp>);
// SAFETY: verbs QPs may be posted to and modified from any thread (the provider locks).
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

/// What a QP is created with.
pub struct QpCreate<'a> {
    pub qp_type: u32,
    pub send_cq: &'a Cq,
    pub recv_cq: &'a Cq,
    pub srq: Option<&'a Srq>,
    pub caps: rnicpi::QpCaps,
}

impl Qp {
    /// Create; returns the QP with the capabilities the device granted.
    pub fn new(pd: &Pd, c: QpCreate<'_>) -> Result<(Qp, rnicpi::QpCaps)> {
        let mut init: ffi::ibv_qp_init_attr = zeroed();
        init.send_cq = c.send_cq.0.as_ptr();
        init.recv_cq = c.recv_cq.0.as_ptr();
        init.srq = c.srq.map_or(ptr::null_mut(), |s| s.0.as_ptr());
        init.qp_type = c.qp_type;
        init.cap.max_send_wr = c.caps.max_send_wr;
        init.cap.max_recv_wr = if c.srq.is_some() {
            0
        } else {
            c.caps.max_recv_wr
        };
        init.cap.max_send_sge = c.caps.max_send_sge;
        init.cap.max_recv_sge = if c.srq.is_some() {
            0
        } else {
            c.caps.max_recv_sge
        };
        init.cap.max_inline_data = c.caps.max_inline;
        // SAFETY: live PD and CQs/SRQ of the same context; the library writes back the
        // granted capabilities.
        let qp = nonnull(unsafe { ffi::ibv_create_qp(pd.0.as_ptr(), &mut init) })?;
        let caps = rnicpi::QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline: init.cap.max_inline_data,
        };
        Ok((Qp(qp), caps))
    }
    pub fn qp_num(&self) -> u32 {
        // SAFETY: live QP; immutable field.
        unsafe { (*self.0.as_ptr()).qp_num }
    }
    /// Post the chain starting at `wr` (its pointers valid for the call).
    pub fn post_send(&self, wr: &mut ffi::ibv_send_wr) -> Result<()> {
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the chain, its SGE lists and inline bytes are valid for the
        // call (inline data is copied before it returns).
        check(unsafe { ffi::ibv_post_send(self.0.as_ptr(), wr, &mut bad) })
    }
    pub fn post_recv(&self, wr: &mut ffi::ibv_recv_wr) -> Result<()> {
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: live QP; the chain and its SGE lists are valid for the call.
        check(unsafe { ffi::ibv_post_recv(self.0.as_ptr(), wr, &mut bad) })
    }
    pub fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: u32) -> Result<()> {
        // SAFETY: live QP, valid attributes.
        check(unsafe { ffi::ibv_modify_qp(self.0.as_ptr(), attr, mask as c_int) })
    }
    /// The current state (an `IBV_QPS_*` value).
    pub fn query_state(&self) -> Result<u32> {
        let mut attr: ffi::ibv_qp_attr = zeroed();
        let mut init: ffi::ibv_qp_init_attr = zeroed();
        // SAFETY: live QP, valid out pointers.
        check(unsafe {
            ffi::ibv_query_qp(
                self.0.as_ptr(),
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
                &mut init,
            )
        })?;
        Ok(attr.qp_state)
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: destroyed once; destroy waits for acknowledged async events.
        unsafe { ffi::ibv_destroy_qp(self.0.as_ptr()) };
    }
}

// ---------------------------------------------------------------------------------------
// librdmacm

/// `RDMA_PS_TCP`.
const PS_TCP: u32 = ffi::rdma_port_space::RDMA_PS_TCP;

fn to_sockaddr(sa: SocketAddr) -> libc::sockaddr_storage {
    let mut ss: libc::sockaddr_storage = zeroed();
    match sa {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
        }
    }
    ss
}

/// # Safety
///
/// `sa` points to a socket address of its family's full size (or is NULL).
unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's promise.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let sin = &*sa.cast::<libc::sockaddr_in>();
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                    u16::from_be(sin.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                    u16::from_be(sin6.sin6_port),
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// An rdma_cm event channel.
pub struct EventChannel(NonNull<ffi::rdma_event_channel>);
// SAFETY: librdmacm calls are thread-safe; the channel is an fd.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

/// One rdma_cm event, copied out of the library (and acknowledged).
#[derive(Debug)]
pub struct CmEvent {
    /// An `RDMA_CM_EVENT_*` value.
    pub kind: u32,
    pub status: i32,
    /// The id the event is about (its address: a key).
    pub id: usize,
    /// For a connect request: the listening id's key and the new id (ours to destroy).
    pub listen_id: usize,
    pub new_id: Option<CmId>,
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

impl EventChannel {
    pub fn new() -> Result<EventChannel> {
        // SAFETY: no arguments; NULL (errno set) when librdmacm or its device is absent.
        let ch = nonnull(unsafe { ffi::rdma_create_event_channel() })?;
        let chan = EventChannel(ch);
        set_nonblocking(chan.fd())?;
        Ok(chan)
    }
    pub fn fd(&self) -> RawFd {
        // SAFETY: live channel; plain field.
        unsafe { (*self.0.as_ptr()).fd }
    }
    /// Take (copy and acknowledge) one event; `None` when none is pending.
    pub fn get_event(&self) -> Option<CmEvent> {
        let mut ev: *mut ffi::rdma_cm_event = ptr::null_mut();
        // SAFETY: live channel; valid out pointer; the fd is non-blocking.
        if unsafe { ffi::rdma_get_cm_event(self.0.as_ptr(), &mut ev) } != 0 || ev.is_null() {
            return None;
        }
        // SAFETY: the event is valid until acknowledged; its private data pointer covers
        // private_data_len bytes. For a connect request `id` is a new id, ours from now on.
        let out = unsafe {
            let e = &*ev;
            let kind = e.event;
            let conn = &e.param.conn;
            let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    conn.private_data_len as usize,
                )
                .to_vec()
            };
            let request = kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST;
            CmEvent {
                kind,
                status: e.status,
                id: e.id as usize,
                listen_id: e.listen_id as usize,
                new_id: if request {
                    NonNull::new(e.id).map(CmId)
                } else {
                    None
                },
                private_data,
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
            }
        };
        // SAFETY: acknowledged once, after copying what we need.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        Some(out)
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel is destroyed (they live in the device's tables,
        // which go first).
        unsafe { ffi::rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// An rdma_cm identifier (`RDMA_PS_TCP`); destroyed on drop.
#[derive(Debug)]
pub struct CmId(NonNull<ffi::rdma_cm_id>);
// SAFETY: librdmacm calls are thread-safe.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

/// What `rdma_connect` / `rdma_accept` carry.
pub struct CmParam<'a> {
    pub qp_num: u32,
    pub private_data: &'a [u8],
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub srq: bool,
}

impl CmParam<'_> {
    fn raw(&self) -> ffi::rdma_conn_param {
        let mut p: ffi::rdma_conn_param = zeroed();
        p.private_data = if self.private_data.is_empty() {
            ptr::null()
        } else {
            self.private_data.as_ptr().cast()
        };
        p.private_data_len = self.private_data.len().min(255) as u8;
        p.responder_resources = self.responder_resources;
        p.initiator_depth = self.initiator_depth;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        p.srq = self.srq as u8;
        p.qp_num = self.qp_num;
        p
    }
}

impl CmId {
    pub fn new(chan: &EventChannel) -> Result<CmId> {
        let mut id: *mut ffi::rdma_cm_id = ptr::null_mut();
        // SAFETY: live channel; valid out pointer.
        check(unsafe { ffi::rdma_create_id(chan.0.as_ptr(), &mut id, ptr::null_mut(), PS_TCP) })?;
        Ok(CmId(nonnull(id)?))
    }
    /// The id's address: the key its events carry.
    pub fn key(&self) -> usize {
        self.0.as_ptr() as usize
    }
    pub fn resolve_addr(&self, dst: SocketAddr, timeout_ms: i32) -> Result<()> {
        let mut ss = to_sockaddr(dst);
        // SAFETY: live id; the address is valid for the call (the library copies it).
        check(unsafe {
            ffi::rdma_resolve_addr(
                self.0.as_ptr(),
                ptr::null_mut(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
                timeout_ms,
            )
        })
    }
    pub fn resolve_route(&self, timeout_ms: i32) -> Result<()> {
        // SAFETY: live id.
        check(unsafe { ffi::rdma_resolve_route(self.0.as_ptr(), timeout_ms) })
    }
    pub fn bind_addr(&self, addr: SocketAddr) -> Result<()> {
        let mut ss = to_sockaddr(addr);
        // SAFETY: live id; the address is valid for the call.
        check(unsafe {
            ffi::rdma_bind_addr(
                self.0.as_ptr(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
            )
        })
    }
    pub fn listen(&self, backlog: i32) -> Result<()> {
        // SAFETY: live id.
        check(unsafe { ffi::rdma_listen(self.0.as_ptr(), backlog) })
    }
    /// The attributes (and mask) the connection manager wants for moving a QP to `state`.
    pub fn init_qp_attr(&self, state: u32) -> Result<(ffi::ibv_qp_attr, u32)> {
        let mut attr: ffi::ibv_qp_attr = zeroed();
        attr.qp_state = state;
        let mut mask: c_int = 0;
        // SAFETY: live id, valid out pointers.
        check(unsafe { ffi::rdma_init_qp_attr(self.0.as_ptr(), &mut attr, &mut mask) })?;
        Ok((attr, mask as u32))
    }
    pub fn connect(&self, p: &CmParam<'_>) -> Result<()> {
        let mut raw = p.raw();
        // SAFETY: live id; the parameters (and private data) are valid for the call.
        check(unsafe { ffi::rdma_connect(self.0.as_ptr(), &mut raw) })
    }
    pub fn accept(&self, p: &CmParam<'_>) -> Result<()> {
        let mut raw = p.raw();
        // SAFETY: as above.
        check(unsafe { ffi::rdma_accept(self.0.as_ptr(), &mut raw) })
    }
    pub fn establish(&self) -> Result<()> {
        // SAFETY: live id (without an rdma_cm QP, as rdma_establish requires).
        check(unsafe { ffi::rdma_establish(self.0.as_ptr()) })
    }
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let len = private_data.len().min(255) as u8;
        let p = if len == 0 {
            ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        // SAFETY: live id; the private data is valid for the call.
        check(unsafe { ffi::rdma_reject(self.0.as_ptr(), p, len) })
    }
    pub fn disconnect(&self) -> Result<()> {
        // SAFETY: live id (without an rdma_cm QP: librdmacm modifies none).
        check(unsafe { ffi::rdma_disconnect(self.0.as_ptr()) })
    }
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: live id; the route's source address is a full sockaddr_storage.
        unsafe { from_sockaddr(ffi::rdma_get_local_addr(&*self.0.as_ptr())) }
    }
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above, for the destination.
        unsafe { from_sockaddr(ffi::rdma_get_peer_addr(&*self.0.as_ptr())) }
    }
    /// The name of the device the id is bound to (after address resolution or a request).
    pub fn device_name(&self) -> Option<String> {
        // SAFETY: live id; `verbs` is NULL or a context librdmacm keeps open while the id
        // exists, whose device has a NUL-terminated name.
        unsafe {
            let verbs = (*self.0.as_ptr()).verbs;
            if verbs.is_null() || (*verbs).device.is_null() {
                return None;
            }
            let name = ffi::ibv_get_device_name((*verbs).device);
            (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy().into_owned())
        }
    }
    /// The port the id is bound to.
    pub fn port_num(&self) -> u8 {
        // SAFETY: live id; plain field.
        unsafe { (*self.0.as_ptr()).port_num }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: destroyed once; its events are acknowledged as soon as they are read.
        unsafe { ffi::rdma_destroy_id(self.0.as_ptr()) };
    }
}

/// `poll(2)` on `fds` for input; returns which are readable.
pub fn poll_in(fds: &[RawFd], timeout_ms: i32) -> Vec<bool> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `p` is a valid array of `p.len()` pollfds.
    let n = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, timeout_ms) };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    p.iter().map(|x| x.revents != 0).collect()
}

/// An eventfd to wake the event thread.
pub struct Wake(RawFd);

impl Wake {
    pub fn new() -> Result<Wake> {
        // SAFETY: plain syscall.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(err_from_errno(errno()));
        }
        Ok(Wake(fd))
    }
    pub fn fd(&self) -> RawFd {
        self.0
    }
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.0, (&one as *const u64).cast(), 8) };
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        // SAFETY: our descriptor, closed once.
        unsafe { libc::close(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;

    /// dlopen `soname` and look up each of `symbols`; the missing ones.
    fn missing(soname: &str, symbols: &[&str]) -> std::result::Result<Vec<String>, String> {
        let so = CString::new(soname).unwrap();
        // SAFETY: dlopen of a system library by soname; its constructors are rdma-core's.
        let h = unsafe { libc::dlopen(so.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror returns a NUL-terminated message or NULL.
            let e = unsafe { libc::dlerror() };
            let msg = if e.is_null() {
                String::new()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(format!("dlopen {soname}: {msg}"));
        }
        let mut out = Vec::new();
        for s in symbols {
            let c = CString::new(*s).unwrap();
            // SAFETY: live handle, NUL-terminated name.
            if unsafe { libc::dlsym(h, c.as_ptr()) }.is_null() {
                out.push(s.to_string());
            }
        }
        // SAFETY: the handle from dlopen above.
        unsafe { libc::dlclose(h) };
        Ok(out)
    }

    fn installed(soname: &str) -> bool {
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/lib/x86_64-linux-gnu",
        ]
        .iter()
        .any(|d| std::path::Path::new(d).join(soname).exists())
    }

    #[test]
    fn every_symbol_resolves_in_the_installed_libraries() {
        for (so, syms) in [
            (IBVERBS_SONAME, IBVERBS_SYMBOLS),
            (RDMACM_SONAME, RDMACM_SYMBOLS),
        ] {
            if !installed(so) {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "{so} is not installed (scripts/test.sh installs libibverbs1 librdmacm1)"
                );
                eprintln!("skipped: {so} is not installed here");
                continue;
            }
            let missing = missing(so, syms).unwrap();
            assert!(missing.is_empty(), "{so} lacks {missing:?}");
        }
    }

    #[test]
    fn sockaddr_round_trip() {
        for s in ["10.77.0.11:7471", "[fe80::1]:1", "0.0.0.0:0"] {
            let sa: SocketAddr = s.parse().unwrap();
            let ss = to_sockaddr(sa);
            // SAFETY: `ss` holds a full address of its family.
            let back = unsafe { from_sockaddr((&ss as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(sa));
        }
    }
}
