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
