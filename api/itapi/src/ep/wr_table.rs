//! Outstanding work requests of one queue. A request's `wr_id` names its slot here; the
//! slot holds what the completion event needs (cookie, kind, flags, length).
//!
//! A send-queue request posted without a completion (`DtoFlags::COMPLETION`) goes to the
//! engine unsignaled, as in verbs: it writes no completion for it when it succeeds. The
//! send queue completes in order, so the table keeps its slots in post order and a later
//! completion retires the silent requests before it ([`WrTable::retire_through`]); a
//! failed or flushed request is completed by the engine whether signaled or not.

use super::post::DtoFlags;
use crate::event::DtoKind;
use std::collections::VecDeque;

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
    /// Posted signaled: the engine writes a completion for it whatever its outcome.
    pub signaled: bool,
}

#[derive(Debug, Default)]
pub(crate) struct WrTable {
    slots: Vec<Option<WrInfo>>,
    free: Vec<u32>,
    /// Send queue: outstanding slots in post order.
    order: VecDeque<u32>,
    /// Outstanding requests whose completion the engine will write.
    signaled: usize,
    /// Unsignaled requests posted since the last signaled one.
    silent_run: usize,
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
        if queue == Queue::Send {
            self.order.push_back(slot);
        }
        if info.signaled {
            self.signaled += 1;
            self.silent_run = 0;
        } else {
            self.silent_run += 1;
        }
        (u64::from(queue as u32) << 32) | u64::from(slot)
    }

    /// Whether a request the consumer wants no completion for must still be signaled:
    /// after `limit - 1` silent ones in a row, so the table (and the engine's send
    /// queue, which verbs frees only by later completions) never fills with requests
    /// nothing will retire.
    pub fn must_signal(&self, limit: usize) -> bool {
        self.silent_run + 1 >= limit.max(1)
    }

    /// Empty `slot` and give it back (its place in `order` is the caller's business).
    fn take(&mut self, slot: u32) -> Option<WrInfo> {
        let info = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        if info.signaled {
            self.signaled -= 1;
        }
        Some(info)
    }

    /// Take the request `wr_id` names (`None` when it names nothing).
    pub fn remove(&mut self, wr_id: u64) -> Option<WrInfo> {
        let slot = wr_id as u32;
        let info = self.take(slot)?;
        // A failed post is the newest request: look from the back.
        if let Some(i) = self.order.iter().rposition(|&s| s == slot) {
            self.order.remove(i);
        }
        Some(info)
    }

    /// A send-queue completion for `wr_id`: take its request, and retire the unsignaled
    /// requests posted before it (they completed, silently, before it did).
    pub fn retire_through(&mut self, wr_id: u64) -> Option<WrInfo> {
        let slot = wr_id as u32;
        self.slots.get(slot as usize)?.as_ref()?;
        while let Some(&front) = self.order.front() {
            if front == slot {
                self.order.pop_front();
                return self.take(slot);
            }
            if self.slots[front as usize].is_some_and(|i| i.signaled) {
                break; // its own completion is still to come: not ours to retire
            }
            self.order.pop_front();
            self.take(front);
        }
        self.remove(wr_id)
    }

    /// Requests outstanding (silent ones included until a later completion retires them).
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Outstanding requests the engine will still write a completion for.
    pub fn awaited(&self) -> usize {
        self.signaled
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
            signaled: true,
        }
    }

    fn silent(cookie: u64) -> WrInfo {
        WrInfo {
            signaled: false,
            ..info(cookie)
        }
    }

    #[test]
    fn itapi_a_completion_retires_the_silent_requests_before_it() {
        let mut t = WrTable::default();
        let a = t.insert(Queue::Send, silent(1));
        let b = t.insert(Queue::Send, silent(2));
        let c = t.insert(Queue::Send, info(3));
        let d = t.insert(Queue::Send, silent(4));
        assert_eq!((t.len(), t.awaited()), (4, 1));
        assert_eq!(t.retire_through(c).unwrap().cookie, 3);
        assert_eq!((t.len(), t.awaited()), (1, 0), "a and b went with c");
        assert!(t.remove(a).is_none() && t.remove(b).is_none());
        // A flushed silent request is completed by the engine: it retires alone.
        assert_eq!(t.retire_through(d).unwrap().cookie, 4);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn itapi_a_signaled_request_is_never_retired_by_another() {
        let mut t = WrTable::default();
        let a = t.insert(Queue::Send, info(1));
        let b = t.insert(Queue::Send, silent(2));
        let c = t.insert(Queue::Send, info(3));
        // Out of order (not on RC, but the table must not lose `a`'s completion).
        assert_eq!(t.retire_through(c).unwrap().cookie, 3);
        assert_eq!(t.retire_through(a).unwrap().cookie, 1);
        assert_eq!(t.retire_through(b).unwrap().cookie, 2);
        assert_eq!((t.len(), t.awaited()), (0, 0));
    }

    #[test]
    fn itapi_silent_runs_are_bounded() {
        let mut t = WrTable::default();
        let mut signaled = 0;
        for i in 0..100 {
            let sig = t.must_signal(8);
            signaled += sig as u32;
            t.insert(
                Queue::Send,
                WrInfo {
                    signaled: sig,
                    ..info(i)
                },
            );
        }
        assert_eq!(signaled, 12, "one in eight");
        assert!(t.must_signal(1), "a depth of one signals everything");
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
