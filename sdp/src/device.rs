//! The adapters SDP runs over, opened once per process: an IT-API interface adapter and a
//! protection zone per device name, shared by every SDP socket on it.

use krdma_itapi::{Ia, Pz, Target};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One opened adapter.
pub struct Device {
    pub ia: Ia,
    pub pz: Pz,
}

static DEVICES: Mutex<Option<HashMap<String, Arc<Device>>>> = Mutex::new(None);

impl Device {
    /// The adapter `name` (`siw0`, `rxe0`), opened on first use through the front door
    /// `target` (`None`: the one `KRDMA_DEVICE` selects).
    pub fn get(target: Option<&Target>, name: &str) -> Result<Arc<Device>, krdma_itapi::Error> {
        let mut g = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
        let map = g.get_or_insert_with(HashMap::new);
        let key = format!("{target:?}/{name}");
        if let Some(d) = map.get(&key) {
            return Ok(d.clone());
        }
        let ia = match target {
            Some(t) => Ia::open_on(t, name)?,
            None => Ia::open(name)?,
        };
        let pz = Pz::create(&ia)?;
        tracing::info!(device = name, transport = ?ia.transport(), "SDP adapter opened");
        let d = Arc::new(Device { ia, pz });
        map.insert(key, d.clone());
        Ok(d)
    }

    /// Forget every opened adapter without closing anything: for a `fork` child, whose
    /// copies of the parent's adapters have no threads behind them.
    pub fn forget_all() {
        if let Ok(mut g) = DEVICES.try_lock() {
            if let Some(m) = g.take() {
                std::mem::forget(m);
            }
        }
    }
}

/// An embedded kAL in this process (if one is started) runs only what SDP over `device`
/// needs: without rxe0 unless `device` is rxe0. An embedded rxe0 serves UDP port 4791 of
/// every address the host has (unless `KRDMA_RXE_ADDR` names one), which a program moved
/// onto SDP over siw0 would otherwise take from krdmad, the kernel's rxe and every other
/// such program. The preload library calls this before the program's first socket; it
/// returns false when the embedded kAL's options were already fixed.
#[cfg(feature = "embedded")]
pub fn configure_embedded_for(device: &str) -> bool {
    let mut opts = ual::embedded::StackOptions::from_env();
    if !device.starts_with("rxe") {
        opts.rxe_off = true;
    }
    ual::configure_embedded(opts)
}
