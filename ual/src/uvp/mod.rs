//! Devices whose fast path runs in this process (`rnicpi::user`): the user verbs providers
//! the uAL knows, the devices it has opened through them, and the sinks that bring their
//! events into the context's dispatcher as if the kAL had queued them.

use crate::events::Dispatcher;
use rnicpi::user::{FastPath, UserDevice, UserProvider};
use rnicpi::{Event, EventSink, Result, VerbsError};
use std::collections::HashMap;
use std::sync::Arc;

#[cfg(feature = "embedded")]
mod engine;

/// The user verbs provider that calls itself `driver`.
fn provider(driver: &str) -> Option<&'static dyn UserProvider> {
    let known = [
        mlx::user_provider(),
        #[cfg(feature = "embedded")]
        engine::user_provider(),
    ];
    known.into_iter().find(|p| p.driver() == driver)
}

/// The devices of one context opened in this process, by kAL device number (`None`: a
/// device whose fast path is the kAL's, asked once).
pub struct Opened {
    map: parking_lot::Mutex<HashMap<u32, Option<Arc<dyn UserDevice>>>>,
    /// Whether devices that offer both fast paths (`FastPath::Either`) are opened here.
    either_here: bool,
}

impl Opened {
    pub fn new(either_here: bool) -> Opened {
        Opened {
            map: Default::default(),
            either_here,
        }
    }

    /// Device `dev` opened through its uVP, or `None` when its fast path (which
    /// `fast_path` asks the kAL for) is the kAL's, or is either and this context takes
    /// the kAL's.
    pub fn get(
        &self,
        dev: u32,
        fast_path: impl FnOnce() -> Result<FastPath>,
    ) -> Result<Option<Arc<dyn UserDevice>>> {
        let mut map = self.map.lock();
        if let Some(d) = map.get(&dev) {
            return Ok(d.clone());
        }
        let (driver, device, either) = match fast_path()? {
            FastPath::Consumer { driver, device } => (driver, device, false),
            FastPath::Either { driver, device } if self.either_here => (driver, device, true),
            FastPath::Either { .. } | FastPath::Kal => {
                map.insert(dev, None);
                return Ok(None);
            }
        };
        let Some(p) = provider(&driver) else {
            if either {
                // This build has no such engine: the kAL's is as good.
                map.insert(dev, None);
                return Ok(None);
            }
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
    /// Device `dev`, if it has been opened in this process (nothing is opened here).
    pub fn opened(&self, dev: u32) -> Option<Arc<dyn UserDevice>> {
        self.map.lock().get(&dev).cloned().flatten()
    }

    /// Forget the open devices without closing them (a fork child: they are the parent's).
    pub fn leak(&self) {
        std::mem::forget(std::mem::take(&mut *self.map.lock()));
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
