//! What the examples that drive a real device through the user half share: the result
//! type, an event sink that forwards to a channel, a registered buffer, test data.
#![allow(dead_code)]

use rnicpi::user::{UserMr, UserPd};
use rnicpi::{Access, Event, EventSink, Sge};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};

pub type Res<T> = Result<T, String>;

pub fn fail<T>(msg: impl Into<String>) -> Res<T> {
    Err(msg.into())
}

/// A sink that forwards events to a channel.
pub fn sink() -> (Arc<dyn EventSink>, Receiver<Event>) {
    let (tx, rx) = channel::<Event>();
    let tx = Mutex::new(tx);
    let s = move |ev: Event| {
        let _ = tx.lock().unwrap().send(ev);
    };
    (Arc::new(s), rx)
}

/// A registered buffer.
pub struct Buf {
    // Declared first: deregistered before the memory goes.
    pub mr: Box<dyn UserMr>,
    mem: Vec<u8>,
}

impl Buf {
    pub fn new(pd: &Arc<dyn UserPd>, len: usize, access: Access) -> Res<Buf> {
        let mut mem = vec![0u8; len];
        // SAFETY: `mem` lives in the same struct as its registration, which drops first
        // (fields drop in declaration order), and is never reallocated.
        let mr = unsafe { pd.reg_mr(mem.as_mut_ptr(), len, access) }
            .map_err(|e| format!("reg_mr: {e}"))?;
        Ok(Buf { mr, mem })
    }
    pub fn addr(&self, off: usize) -> u64 {
        self.mem.as_ptr() as u64 + off as u64
    }
    pub fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.addr(off),
            length: len as u32,
            lkey: self.mr.lkey(),
        }
    }
    /// Read what the device wrote (volatile: the compiler does not see the device).
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        (off..off + len)
            // SAFETY: in bounds of `mem`.
            .map(|i| unsafe { std::ptr::read_volatile(self.mem.as_ptr().add(i)) })
            .collect()
    }
    pub fn write(&mut self, off: usize, data: &[u8]) {
        self.mem[off..off + data.len()].copy_from_slice(data);
    }
}

/// Deterministic test data for `seed`.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
