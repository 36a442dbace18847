//! DAT return codes: a major type (`DAT_RETURN_TYPE`) and a minor subtype
//! (`DAT_RETURN_SUBTYPE`), with the DAT values, so `Error::code` is the `DAT_RETURN` a C
//! consumer sees.

use krdma_itapi::Error as ItError;

/// The major error type (`DAT_RETURN_TYPE`, the value's bits 16..29).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Major {
    Abort = 0x0001_0000,
    ConnQualInUse = 0x0002_0000,
    InsufficientResources = 0x0003_0000,
    InternalError = 0x0004_0000,
    InvalidHandle = 0x0005_0000,
    InvalidParameter = 0x0006_0000,
    InvalidState = 0x0007_0000,
    LengthError = 0x0008_0000,
    ModelNotSupported = 0x0009_0000,
    ProviderNotFound = 0x000A_0000,
    PrivilegesViolation = 0x000B_0000,
    ProtectionViolation = 0x000C_0000,
    QueueEmpty = 0x000D_0000,
    QueueFull = 0x000E_0000,
    TimeoutExpired = 0x000F_0000,
    ProviderAlreadyRegistered = 0x0010_0000,
    ProviderInUse = 0x0011_0000,
    InvalidAddress = 0x0012_0000,
    InterruptedCall = 0x0013_0000,
    ConnQualUnavailable = 0x0014_0000,
    PortInUse = 0x0016_0000,
    CommNotSupported = 0x0017_0000,
    NotImplemented = 0x3FFF_0000,
}

/// The minor subtype (`DAT_RETURN_SUBTYPE`), in the header's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Minor {
    None = 0,
    Interrupted,
    ResourceMemory,
    ResourceDevice,
    ResourceTep,
    ResourceTevd,
    ResourceProtectionDomain,
    ResourceMemoryRegion,
    ResourceErrorHandler,
    ResourceCredits,
    ResourceSrq,
    HandleIa,
    HandleEp,
    HandleLmr,
    HandleRmr,
    HandlePz,
    HandlePsp,
    HandleRsp,
    HandleCr,
    HandleCno,
    HandleEvdCr,
    HandleEvdRequest,
    HandleEvdRecv,
    HandleEvdConn,
    HandleEvdAsync,
    HandleSrq,
    HandleCsp,
    Handle1,
    Handle2,
    Handle3,
    Handle4,
    Handle5,
    Handle6,
    Handle7,
    Handle8,
    Handle9,
    Handle10,
    Arg1,
    Arg2,
    Arg3,
    Arg4,
    Arg5,
    Arg6,
    Arg7,
    Arg8,
    Arg9,
    Arg10,
    EpUnconnected,
    EpActConnPending,
    EpPassConnPending,
    EpTentConnPending,
    EpConnected,
    EpDisconnected,
    EpReserved,
    EpComplPending,
    EpDiscPending,
    EpProviderControl,
    EpNotReady,
    EpRecvWatermark,
    EpPz,
    EpEvdRequest,
    EpEvdRecv,
    EpEvdConnect,
    EpUnconfigured,
    EpUnconfReserved,
    EpUnconfPassive,
    EpUnconfTentative,
    CnoInUse,
    CnoDead,
    EvdOpen,
    EvdEnabled,
    EvdDisabled,
    EvdWaitable,
    EvdUnwaitable,
    EvdInUse,
    EvdConfigNotify,
    EvdConfigSolicited,
    EvdConfigThreshold,
    EvdWaiter,
    EvdAsync,
    IaInUse,
    LmrInUse,
    LmrFree,
    PzInUse,
    PzFree,
    SrqOperational,
    SrqError,
    SrqInUse,
    SrqShutdown,
    PrivilegesRead,
    PrivilegesWrite,
    PrivilegesRdmaRead,
    PrivilegesRdmaWrite,
    ProtectionRead,
    ProtectionWrite,
    ProtectionRdmaRead,
    ProtectionRdmaWrite,
    AddressUnsupported,
    AddressUnreachable,
    AddressMalformed,
    NameNotRegistered,
    MajorNotFound,
    MinorNotFound,
    ThreadSafetyNotFound,
}

/// A DAT error: what failed (`major`) and, where DAT says, which part (`minor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("{major:?} {minor:?}")]
pub struct Error {
    pub major: Major,
    pub minor: Minor,
}

/// `DAT_CLASS_ERROR`: the bit every error return carries.
pub const CLASS_ERROR: u32 = 0x8000_0000;

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub const fn new(major: Major, minor: Minor) -> Error {
        Error { major, minor }
    }

    pub const fn of(major: Major) -> Error {
        Error::new(major, Minor::None)
    }

    /// The `DAT_RETURN` value: `DAT_CLASS_ERROR | major | minor`, except an empty queue
    /// and an expired timeout, which are plain `DAT_QUEUE_EMPTY` / `DAT_TIMEOUT_EXPIRED`
    /// (consumers compare with `==`: dtest's polling loop is
    /// `while (dat_evd_dequeue(..) == DAT_QUEUE_EMPTY)`).
    pub fn code(self) -> u32 {
        match self.major {
            Major::QueueEmpty | Major::TimeoutExpired => self.major as u32,
            _ => CLASS_ERROR | self.major as u32 | self.minor as u32,
        }
    }

    pub fn handle(minor: Minor) -> Error {
        Error::new(Major::InvalidHandle, minor)
    }

    pub fn arg(n: u32) -> Error {
        let minor = match n {
            1 => Minor::Arg1,
            2 => Minor::Arg2,
            3 => Minor::Arg3,
            4 => Minor::Arg4,
            5 => Minor::Arg5,
            6 => Minor::Arg6,
            7 => Minor::Arg7,
            8 => Minor::Arg8,
            9 => Minor::Arg9,
            _ => Minor::Arg10,
        };
        Error::new(Major::InvalidParameter, minor)
    }

    pub fn state(minor: Minor) -> Error {
        Error::new(Major::InvalidState, minor)
    }

    pub fn not_implemented() -> Error {
        Error::of(Major::NotImplemented)
    }
}

/// The common core reports in IT-API's terms; this is their DAT reading.
impl From<ItError> for Error {
    fn from(e: ItError) -> Error {
        use ItError as I;
        use Major as M;
        match e {
            I::QueueEmpty => Error::of(M::QueueEmpty),
            I::TimeoutExpired => Error::of(M::TimeoutExpired),
            I::EvdQueueFull => Error::of(M::QueueFull),
            I::WaiterLimit => Error::state(Minor::EvdWaiter),
            I::Interrupt => Error::new(M::InterruptedCall, Minor::None),
            I::IaCatastrophe | I::Abort => Error::of(M::Abort),
            I::ConnQualBusy | I::InvalidConnQual => Error::of(M::ConnQualInUse),
            I::InvalidPdataLength | I::PayloadSize | I::InvalidLength => Error::of(M::LengthError),
            I::InvalidNumSegments => Error::arg(2),
            I::Range | I::InvalidLmr => Error::new(M::ProtectionViolation, Minor::None),
            I::InvalidPrivs | I::NoPermission | I::Access => {
                Error::new(M::PrivilegesViolation, Minor::None)
            }
            I::InvalidEpState => Error::state(Minor::EpNotReady),
            I::EpBusy => Error::state(Minor::EpNotReady),
            I::PzBusy => Error::state(Minor::PzInUse),
            I::LmrBusy => Error::state(Minor::LmrInUse),
            I::EvdBusy => Error::state(Minor::EvdInUse),
            I::SrqBusy => Error::state(Minor::SrqInUse),
            I::InvalidAddress | I::InvalidNetaddr | I::Address => {
                Error::new(M::InvalidAddress, Minor::AddressUnreachable)
            }
            I::InvalidCnEstId => Error::handle(Minor::HandleCr),
            I::InvalidEp => Error::handle(Minor::HandleEp),
            I::InvalidPz => Error::handle(Minor::HandlePz),
            I::InvalidRmr => Error::handle(Minor::HandleRmr),
            I::InvalidSrq => Error::handle(Minor::HandleSrq),
            I::InvalidIa => Error::handle(Minor::HandleIa),
            I::InvalidEvd | I::InvalidAevd => Error::of(M::InvalidHandle),
            I::InvalidThreshold | I::InvalidQueueSize => Error::arg(3),
            I::OpNotSupported | I::SrqNotSupported | I::PdataNotSupported => {
                Error::not_implemented()
            }
            I::Resources | I::ResourceQueueSize | I::ResourceLmrLength => {
                Error::new(M::InsufficientResources, Minor::ResourceMemory)
            }
            I::ResourceIrd | I::ResourceOrd => {
                Error::new(M::InsufficientResources, Minor::ResourceCredits)
            }
            I::ResourceRecvDto
            | I::ResourceReqDto
            | I::ResourceRrseg
            | I::ResourceRseg
            | I::ResourceRwseg
            | I::ResourceSseg
            | I::TooManyPosts => Error::new(M::InsufficientResources, Minor::ResourceTep),
            I::Fault => Error::arg(1),
            _ => Error::of(M::InternalError),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dapl_error_codes_have_the_dat_values() {
        assert_eq!(Error::of(Major::QueueEmpty).code(), 0x000D_0000);
        assert_eq!(Error::of(Major::InvalidState).code(), 0x8007_0000);
        assert_eq!(Error::handle(Minor::HandleEp).code(), 0x8005_0000 | 12);
        assert_eq!(Error::arg(1).code(), 0x8006_0000 | 37);
        assert_eq!(Minor::EpUnconnected as u32, 47);
        assert_eq!(Minor::NameNotRegistered as u32, 100);
        assert_eq!(Minor::EvdWaiter as u32, 78);
        assert_eq!(Minor::ThreadSafetyNotFound as u32, 103);
    }
}
