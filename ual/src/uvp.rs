//! Devices whose fast path runs in this process (`rnicpi::user`): the user verbs providers
//! the uAL knows, the devices it has opened through them, and the sinks that bring their
//! events into the context's dispatcher as if the kAL had queued them.

use crate::events::Dispatcher;
use rnicpi::user::{FastPath, UserDevice, UserProvider};
use rnicpi::{Event, EventSink, Result, VerbsError};
use std::collections::HashMap;
use std::sync::Arc;

/// The user verbs provider that calls itself `driver`.
fn provider(driver: &str) -> Option<&'static dyn UserProvider> {
    let known = [mlx::user_provider()];
    known.into_iter().find(|p| p.driver() == driver)
}

/// The devices of one context opened in this process, by kAL device number (`None`: a
/// device whose fast path is the kAL's, asked once).
#[derive(Default)]
pub struct Opened(parking_lot::Mutex<HashMap<u32, Option<Arc<dyn UserDevice>>>>);

impl Opened {
    /// Device `dev` opened through its uVP, or `None` when its fast path (which
    /// `fast_path` asks the kAL for) is the kAL's.
    pub fn get(
        &self,
        dev: u32,
        fast_path: impl FnOnce() -> Result<FastPath>,
    ) -> Result<Option<Arc<dyn UserDevice>>> {
        let mut map = self.0.lock();
        if let Some(d) = map.get(&dev) {
            return Ok(d.clone());
        }
        let FastPath::Consumer { driver, device } = fast_path()? else {
            map.insert(dev, None);
            return Ok(None);
        };
        let Some(p) = provider(&driver) else {
            tracing::warn!(
                driver,
                device,
                "no user verbs provider of that name in this process"
            );
            return Err(VerbsError::Unsupported);
        };
        let d = p.open(&device)?;
        tracing::info!(driver, device, dev, "device opened in this process");
        map.insert(dev, Some(d.clone()));
        Ok(Some(d))
    }
}

impl Opened {
    /// Forget the open devices without closing them (a fork child: they are the parent's).
    pub fn leak(&self) {
        std::mem::forget(std::mem::take(&mut *self.0.lock()));
    }
}

/// Delivers a uVP's events for one object to the context's dispatcher, under the
/// object's handle.
pub struct HandleSink {
    pub dispatcher: Arc<Dispatcher>,
    pub handle: u32,
}

impl EventSink for HandleSink {
    fn deliver(&self, mut ev: Event) {
        ev.handle = self.handle;
        self.dispatcher.dispatch(ev);
    }
}
