//! Errors: the IT-API status codes (`it_status_t`) as a typed enum.
//!
//! Every fallible call returns [`Result<T>`](Result), whose error is one of the standard's
//! `IT_ERR_*` codes. [`Error::code`] is the number the C interface returns, in the order
//! the standard numbers them (`IT_SUCCESS` is 0).

use rnicpi::VerbsError;

macro_rules! statuses {
    ($($variant:ident = $code:literal, $cname:literal, $msg:literal;)*) => {
        /// An IT-API error status (`IT_ERR_*`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum Error {
            $(#[doc = $msg] $variant = $code,)*
        }

        impl Error {
            /// Every status, in code order.
            pub const ALL: &'static [Error] = &[$(Error::$variant,)*];

            /// The `it_status_t` value.
            pub fn code(self) -> u32 {
                self as u32
            }

            /// The status for an `it_status_t` value (`None` for `IT_SUCCESS` and unknown values).
            pub fn from_code(code: u32) -> Option<Error> {
                match code {
                    $($code => Some(Error::$variant),)*
                    _ => None,
                }
            }

            /// The standard's C name (`IT_ERR_...`).
            pub fn c_name(self) -> &'static str {
                match self {
                    $(Error::$variant => $cname,)*
                }
            }

            fn message(self) -> &'static str {
                match self {
                    $(Error::$variant => $msg,)*
                }
            }
        }
    };
}

statuses! {
    Abort = 1, "IT_ERR_ABORT", "the operation was aborted";
    Access = 2, "IT_ERR_ACCESS", "access denied";
    Address = 3, "IT_ERR_ADDRESS", "address error";
    AevdNotAllowed = 4, "IT_ERR_AEVD_NOT_ALLOWED", "an aggregate EVD is not allowed here";
    AsyncAffEvdExists = 5, "IT_ERR_ASYNC_AFF_EVD_EXISTS", "the IA already has an affiliated async EVD";
    AsyncUnaffEvdExists = 6, "IT_ERR_ASYNC_UNAFF_EVD_EXISTS", "the IA already has an unaffiliated async EVD";
    CallbackExists = 7, "IT_ERR_CALLBACK_EXISTS", "a callback is already attached";
    CannotReset = 8, "IT_ERR_CANNOT_RESET", "the endpoint cannot be reset";
    ConnQualBusy = 9, "IT_ERR_CONN_QUAL_BUSY", "the connection qualifier is in use";
    EpBusy = 10, "IT_ERR_EP_BUSY", "the endpoint is in use";
    EpTimewait = 11, "IT_ERR_EP_TIMEWAIT", "the endpoint is in time-wait";
    EvdBusy = 12, "IT_ERR_EVD_BUSY", "the EVD is in use";
    EvdWait = 13, "IT_ERR_EVD_WAIT", "a waiter is blocked on the EVD";
    EvdQueueFull = 14, "IT_ERR_EVD_QUEUE_FULL", "the EVD queue is full";
    Fault = 15, "IT_ERR_FAULT", "memory is not accessible";
    HardHiWatermark = 16, "IT_ERR_HARD_HI_WATERMARK", "hard high watermark reached";
    IaCatastrophe = 17, "IT_ERR_IA_CATASTROPHE", "the interface adapter has failed";
    Interrupt = 18, "IT_ERR_INTERRUPT", "interrupted";
    InvalidAddrMode = 19, "IT_ERR_INVALID_ADDR_MODE", "invalid addressing mode";
    InvalidAddress = 20, "IT_ERR_INVALID_ADDRESS", "invalid address";
    InvalidAevd = 21, "IT_ERR_INVALID_AEVD", "invalid aggregate EVD";
    InvalidAh = 22, "IT_ERR_INVALID_AH", "invalid address handle";
    InvalidAtimeout = 23, "IT_ERR_INVALID_ATIMEOUT", "invalid ack timeout";
    InvalidAtomicOp = 24, "IT_ERR_INVALID_ATOMIC_OP", "invalid atomic operation";
    InvalidCmRetry = 25, "IT_ERR_INVALID_CM_RETRY", "invalid CM retry count";
    InvalidCnEstFlags = 26, "IT_ERR_INVALID_CN_EST_FLAGS", "invalid connection establishment flags";
    InvalidCnEstId = 27, "IT_ERR_INVALID_CN_EST_ID", "invalid (or expired) connection request id";
    InvalidConnEvd = 28, "IT_ERR_INVALID_CONN_EVD", "invalid connection EVD";
    InvalidConnQual = 29, "IT_ERR_INVALID_CONN_QUAL", "invalid connection qualifier";
    InvalidConversion = 30, "IT_ERR_INVALID_CONVERSION", "invalid address conversion";
    InvalidDtoFlags = 31, "IT_ERR_INVALID_DTO_FLAGS", "invalid DTO flags";
    InvalidEp = 32, "IT_ERR_INVALID_EP", "invalid endpoint";
    InvalidEpAttr = 33, "IT_ERR_INVALID_EP_ATTR", "invalid endpoint attributes";
    InvalidEpKey = 34, "IT_ERR_INVALID_EP_KEY", "invalid endpoint key";
    InvalidEpState = 35, "IT_ERR_INVALID_EP_STATE", "the endpoint is in the wrong state";
    InvalidEpType = 36, "IT_ERR_INVALID_EP_TYPE", "invalid endpoint type";
    InvalidEvd = 37, "IT_ERR_INVALID_EVD", "invalid EVD";
    InvalidEvdState = 38, "IT_ERR_INVALID_EVD_STATE", "the EVD is in the wrong state";
    InvalidEvdType = 39, "IT_ERR_INVALID_EVD_TYPE", "the EVD serves another event stream";
    InvalidFlags = 40, "IT_ERR_INVALID_FLAGS", "invalid flags";
    InvalidHandle = 41, "IT_ERR_INVALID_HANDLE", "invalid handle";
    InvalidIa = 42, "IT_ERR_INVALID_IA", "invalid interface adapter";
    InvalidIobl = 43, "IT_ERR_INVALID_IOBL", "invalid I/O buffer list";
    InvalidLength = 44, "IT_ERR_INVALID_LENGTH", "invalid length";
    InvalidListen = 45, "IT_ERR_INVALID_LISTEN", "invalid listen handle";
    InvalidLmr = 46, "IT_ERR_INVALID_LMR", "invalid LMR";
    InvalidLtimeout = 47, "IT_ERR_INVALID_LTIMEOUT", "invalid local timeout";
    InvalidMajorVersion = 48, "IT_ERR_INVALID_MAJOR_VERSION", "unsupported major version";
    InvalidMask = 49, "IT_ERR_INVALID_MASK", "invalid parameter mask";
    InvalidMinorVersion = 50, "IT_ERR_INVALID_MINOR_VERSION", "unsupported minor version";
    InvalidName = 51, "IT_ERR_INVALID_NAME", "no interface of that name";
    InvalidNetaddr = 52, "IT_ERR_INVALID_NETADDR", "invalid network address";
    InvalidNumSegments = 53, "IT_ERR_INVALID_NUM_SEGMENTS", "invalid number of segments";
    InvalidPdataLength = 54, "IT_ERR_INVALID_PDATA_LENGTH", "private data too long";
    InvalidPrivs = 55, "IT_ERR_INVALID_PRIVS", "invalid memory privileges";
    InvalidPz = 56, "IT_ERR_INVALID_PZ", "invalid protection zone";
    InvalidQueueSize = 57, "IT_ERR_INVALID_QUEUE_SIZE", "invalid queue size";
    InvalidRecvDto = 58, "IT_ERR_INVALID_RECV_DTO", "invalid receive DTO count";
    InvalidRecvEvd = 59, "IT_ERR_INVALID_RECV_EVD", "invalid receive EVD";
    InvalidRecvEvdState = 60, "IT_ERR_INVALID_RECV_EVD_STATE", "the receive EVD is in the wrong state";
    InvalidReqEvd = 61, "IT_ERR_INVALID_REQ_EVD", "invalid request EVD";
    InvalidReqEvdState = 62, "IT_ERR_INVALID_REQ_EVD_STATE", "the request EVD is in the wrong state";
    InvalidRetry = 63, "IT_ERR_INVALID_RETRY", "invalid retry count";
    InvalidRmr = 64, "IT_ERR_INVALID_RMR", "invalid RMR";
    InvalidRnrRetry = 65, "IT_ERR_INVALID_RNR_RETRY", "invalid RNR retry count";
    InvalidRmrType = 66, "IT_ERR_INVALID_RMR_TYPE", "unsupported RMR type";
    InvalidRtimeout = 67, "IT_ERR_INVALID_RTIMEOUT", "invalid remote timeout";
    InvalidSoftEvd = 68, "IT_ERR_INVALID_SOFT_EVD", "invalid software EVD";
    InvalidSourcePath = 69, "IT_ERR_INVALID_SOURCE_PATH", "invalid source path";
    InvalidSpigot = 70, "IT_ERR_INVALID_SPIGOT", "invalid spigot";
    InvalidSrq = 71, "IT_ERR_INVALID_SRQ", "invalid shared receive queue";
    InvalidSrqSize = 72, "IT_ERR_INVALID_SRQ_SIZE", "invalid shared receive queue size";
    InvalidThreshold = 73, "IT_ERR_INVALID_THRESHOLD", "invalid threshold";
    InvalidUdStatus = 74, "IT_ERR_INVALID_UD_STATUS", "invalid UD status";
    InvalidUdSvc = 75, "IT_ERR_INVALID_UD_SVC", "invalid UD service";
    InvalidUdSvcReqId = 76, "IT_ERR_INVALID_UD_SVC_REQ_ID", "invalid UD service request id";
    InvalidWatermark = 77, "IT_ERR_INVALID_WATERMARK", "invalid watermark";
    LmrBusy = 78, "IT_ERR_LMR_BUSY", "the LMR is in use";
    MismatchFd = 79, "IT_ERR_MISMATCH_FD", "file descriptor mismatch";
    NoContext = 80, "IT_ERR_NO_CONTEXT", "no consumer context is set";
    NoPermission = 81, "IT_ERR_NO_PERMISSION", "permission denied";
    OpNotSupported = 82, "IT_ERR_OP_NOT_SUPPORTED", "operation not supported";
    PayloadSize = 83, "IT_ERR_PAYLOAD_SIZE", "payload too large";
    PdataNotSupported = 84, "IT_ERR_PDATA_NOT_SUPPORTED", "private data not supported here";
    PrivOpsUnavailable = 85, "IT_ERR_PRIV_OPS_UNAVAILABLE", "privileged operations unavailable";
    PzBusy = 86, "IT_ERR_PZ_BUSY", "the protection zone is in use";
    QueueEmpty = 87, "IT_ERR_QUEUE_EMPTY", "no event is queued";
    Range = 88, "IT_ERR_RANGE", "out of range";
    Resources = 89, "IT_ERR_RESOURCES", "out of resources";
    ResourceIrd = 90, "IT_ERR_RESOURCE_IRD", "IRD beyond the device's limit";
    ResourceLmrLength = 91, "IT_ERR_RESOURCE_LMR_LENGTH", "LMR length beyond the device's limit";
    ResourceOrd = 92, "IT_ERR_RESOURCE_ORD", "ORD beyond the device's limit";
    ResourceQueueSize = 93, "IT_ERR_RESOURCE_QUEUE_SIZE", "queue size beyond the device's limit";
    ResourceRecvDto = 94, "IT_ERR_RESOURCE_RECV_DTO", "receive DTOs beyond the device's limit";
    ResourceReqDto = 95, "IT_ERR_RESOURCE_REQ_DTO", "request DTOs beyond the device's limit";
    ResourceRrseg = 96, "IT_ERR_RESOURCE_RRSEG", "RDMA read segments beyond the device's limit";
    ResourceRseg = 97, "IT_ERR_RESOURCE_RSEG", "receive segments beyond the device's limit";
    ResourceRwseg = 98, "IT_ERR_RESOURCE_RWSEG", "RDMA write segments beyond the device's limit";
    ResourceSseg = 99, "IT_ERR_RESOURCE_SSEG", "send segments beyond the device's limit";
    SoftHiWatermark = 100, "IT_ERR_SOFT_HI_WATERMARK", "soft high watermark reached";
    SrqBusy = 101, "IT_ERR_SRQ_BUSY", "the shared receive queue is in use";
    SrqLowWatermark = 102, "IT_ERR_SRQ_LOW_WATERMARK", "shared receive queue low watermark";
    SrqNotSupported = 103, "IT_ERR_SRQ_NOT_SUPPORTED", "shared receive queues not supported";
    TimeoutExpired = 104, "IT_ERR_TIMEOUT_EXPIRED", "the timeout expired";
    TooManyPosts = 105, "IT_ERR_TOO_MANY_POSTS", "the work queue is full";
    WaiterLimit = 106, "IT_ERR_WAITER_LIMIT", "the EVD already has a waiter";
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message(), self.c_name())
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Mapping of uAL (verbs) errors onto IT-API statuses.
pub(crate) trait FromVerbs<T> {
    /// Map a verbs error; `invalid` is the status for `VerbsError::Invalid`, which means
    /// something different for each call (a bad length, bad attributes, …).
    fn it(self, invalid: Error) -> Result<T>;
}

impl<T> FromVerbs<T> for std::result::Result<T, VerbsError> {
    fn it(self, invalid: Error) -> Result<T> {
        self.map_err(|e| from_verbs(e, invalid))
    }
}

pub(crate) fn from_verbs(e: VerbsError, invalid: Error) -> Error {
    match e {
        VerbsError::Invalid => invalid,
        VerbsError::NoSuchResource => Error::InvalidHandle,
        VerbsError::Exhausted | VerbsError::Busy | VerbsError::PinLimit | VerbsError::Quota => {
            Error::Resources
        }
        VerbsError::Unsupported => Error::OpNotSupported,
        VerbsError::Permission => Error::NoPermission,
        VerbsError::BadAddress => Error::Fault,
        VerbsError::BadState | VerbsError::ConnectionReset => Error::InvalidEpState,
        VerbsError::QueueFull => Error::TooManyPosts,
        VerbsError::TimedOut => Error::TimeoutExpired,
        VerbsError::Unreachable => Error::InvalidAddress,
        VerbsError::AddrInUse => Error::ConnQualBusy,
        VerbsError::Dead => Error::IaCatastrophe,
        VerbsError::NoDevice => Error::InvalidName,
        VerbsError::Refused | VerbsError::Io => Error::Abort,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn itapi_status_codes_follow_the_standard_numbering() {
        assert_eq!(Error::ALL.len(), 106);
        for (i, e) in Error::ALL.iter().enumerate() {
            assert_eq!(e.code() as usize, i + 1);
            assert_eq!(Error::from_code(e.code()), Some(*e));
        }
        assert_eq!(Error::Resources.code(), 89);
        assert_eq!(Error::SoftHiWatermark.code(), 100);
        assert_eq!(Error::from_code(0), None);
        assert!(Error::QueueEmpty.to_string().contains("IT_ERR_QUEUE_EMPTY"));
    }
}
