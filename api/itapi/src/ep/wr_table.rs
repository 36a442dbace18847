//! Outstanding work requests of one queue. A request's `wr_id` names its slot here; the
//! slot holds what the completion event needs (cookie, kind, flags, length).

use super::post::DtoFlags;
use crate::event::DtoKind;

/// Which table a `wr_id` points into (its upper 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Queue {
    Send = 0,
    Recv = 1,
    Srq = 2,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct WrInfo {
    pub cookie: u64,
    pub kind: DtoKind,
    pub flags: DtoFlags,
    /// Bytes the request moves (reported for non-receive completions).
    pub length: u32,
}

#[derive(Debug, Default)]
pub(crate) struct WrTable {
    slots: Vec<Option<WrInfo>>,
    free: Vec<u32>,
}

impl WrTable {
    /// Store `info`; returns the `wr_id` for `queue`.
    pub fn insert(&mut self, queue: Queue, info: WrInfo) -> u64 {
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(info);
                s
            }
            None => {
                self.slots.push(Some(info));
                (self.slots.len() - 1) as u32
            }
        };
        (u64::from(queue as u32) << 32) | u64::from(slot)
    }

    /// Take the request `wr_id` names (`None` when it names nothing).
    pub fn remove(&mut self, wr_id: u64) -> Option<WrInfo> {
        let slot = wr_id as u32;
        let info = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        Some(info)
    }

    /// Requests outstanding.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

/// The table a completion's `wr_id` names.
pub(crate) fn queue_of(wr_id: u64) -> Option<Queue> {
    match wr_id >> 32 {
        0 => Some(Queue::Send),
        1 => Some(Queue::Recv),
        2 => Some(Queue::Srq),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(cookie: u64) -> WrInfo {
        WrInfo {
            cookie,
            kind: DtoKind::Send,
            flags: DtoFlags::empty(),
            length: 0,
        }
    }

    #[test]
    fn itapi_wr_slots_are_reused_and_tagged() {
        let mut t = WrTable::default();
        let a = t.insert(Queue::Recv, info(1));
        let b = t.insert(Queue::Recv, info(2));
        assert_eq!(queue_of(a), Some(Queue::Recv));
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(a).unwrap().cookie, 1);
        assert!(t.remove(a).is_none(), "a slot completes once");
        let c = t.insert(Queue::Srq, info(3));
        assert_eq!(c as u32, a as u32, "freed slot reused");
        assert_eq!(queue_of(c), Some(Queue::Srq));
        assert_eq!(t.remove(b).unwrap().cookie, 2);
        assert!(t.remove(99).is_none());
        assert_eq!(queue_of(7 << 32), None);
    }
}
