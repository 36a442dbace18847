//! The error type of every verbs call.

/// Why a verb failed. Each variant maps onto one errno so the ioctl ABI can carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    #[error("invalid argument")]
    Invalid,
    #[error("no such resource (unknown or foreign handle)")]
    NoSuchResource,
    #[error("resource limit reached")]
    Exhausted,
    #[error("resource is still in use")]
    Busy,
    #[error("operation not supported by this device")]
    Unsupported,
    #[error("access denied")]
    Permission,
    #[error("memory range is not accessible")]
    BadAddress,
    #[error("operation not allowed in the current QP state")]
    BadState,
    #[error("queue is full")]
    QueueFull,
    #[error("connection refused or rejected by peer")]
    Refused,
    #[error("connection reset or aborted")]
    ConnectionReset,
    #[error("timed out")]
    TimedOut,
    #[error("address not available or unreachable")]
    Unreachable,
    #[error("address already in use")]
    AddrInUse,
    #[error("pinned-memory quota exceeded")]
    PinLimit,
    /// A per-user quota (contexts, objects, mappings, threads, connections) is reached.
    #[error("per-user quota exceeded")]
    Quota,
    #[error("the access layer is gone (daemon died)")]
    Dead,
    /// The device file is missing or not served by `krdmad` (a leftover mount point).
    #[error("no krdmad serves the device file (is krdmad running?)")]
    NoDevice,
    #[error("input/output error")]
    Io,
}

impl VerbsError {
    /// The errno this error travels as through the ioctl ABI.
    pub fn errno(self) -> i32 {
        use VerbsError::*;
        match self {
            Invalid => libc::EINVAL,
            NoSuchResource => libc::ENOENT,
            Exhausted => libc::ENOSPC,
            Busy => libc::EBUSY,
            Unsupported => libc::EOPNOTSUPP,
            Permission => libc::EACCES,
            BadAddress => libc::EFAULT,
            BadState => libc::EPROTO,
            QueueFull => libc::ENOMEM,
            Refused => libc::ECONNREFUSED,
            ConnectionReset => libc::ECONNRESET,
            TimedOut => libc::ETIMEDOUT,
            Unreachable => libc::ENETUNREACH,
            AddrInUse => libc::EADDRINUSE,
            PinLimit | Quota => libc::EDQUOT,
            Dead => libc::ENOTCONN,
            NoDevice => libc::ENODEV,
            Io => libc::EIO,
        }
    }

    /// The inverse of [`errno`](Self::errno); unknown numbers become `Io`.
    pub fn from_errno(e: i32) -> Self {
        use VerbsError::*;
        match e {
            libc::EINVAL => Invalid,
            libc::ENOENT => NoSuchResource,
            libc::ENOSPC => Exhausted,
            libc::EBUSY => Busy,
            libc::EOPNOTSUPP => Unsupported,
            libc::EACCES | libc::EPERM => Permission,
            libc::EFAULT => BadAddress,
            libc::EPROTO => BadState,
            libc::ENOMEM => QueueFull,
            libc::ECONNREFUSED => Refused,
            libc::ECONNRESET | libc::ECONNABORTED | libc::EPIPE => ConnectionReset,
            libc::ETIMEDOUT => TimedOut,
            libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EADDRNOTAVAIL => Unreachable,
            libc::EADDRINUSE => AddrInUse,
            libc::EDQUOT => Quota,
            libc::ENOTCONN => Dead,
            libc::ENODEV => NoDevice,
            _ => Io,
        }
    }
}

impl From<std::io::Error> for VerbsError {
    fn from(e: std::io::Error) -> Self {
        e.raw_os_error()
            .map(Self::from_errno)
            .unwrap_or(match e.kind() {
                std::io::ErrorKind::AddrInUse => VerbsError::AddrInUse,
                _ => VerbsError::Io,
            })
    }
}

pub type Result<T, E = VerbsError> = std::result::Result<T, E>;
