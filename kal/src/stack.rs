//! The default set of providers a kAL starts with (daemon and embedded mode alike).

use crate::services::HostServices;
use crate::Kal;
use rnicpi::Result;
use std::sync::Arc;

/// Provider options shared by `krdmad` and embedded mode (environment: `KRDMA_SIW_NETDEV`,
/// `KRDMA_SIW_CRC=required`).
#[derive(Debug, Clone, Default)]
pub struct StackOptions {
    /// Interface siw0 binds to (`None` = every host address).
    pub siw_netdev: Option<String>,
    /// Require MPA CRC on siw connections.
    pub siw_crc_required: bool,
}

impl StackOptions {
    pub fn from_env() -> Self {
        StackOptions {
            siw_netdev: std::env::var("KRDMA_SIW_NETDEV")
                .ok()
                .filter(|s| !s.is_empty()),
            siw_crc_required: std::env::var("KRDMA_SIW_CRC")
                .map(|v| v == "required")
                .unwrap_or(false),
        }
    }
}

/// Register the default devices (siw0) with `kal`.
pub fn start_default(kal: &Kal, opts: &StackOptions) -> Result<()> {
    let services = Arc::new(HostServices);
    let siw = siw::SiwDevice::new(
        siw::SiwConfig {
            name: "siw0".into(),
            netdev: opts.siw_netdev.clone(),
            crc_required: opts.siw_crc_required,
        },
        services,
    );
    kal.register(siw)?;
    Ok(())
}
