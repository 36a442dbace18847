//! The device's receive side: datagrams from the RoCEv2 socket, verified and handed to
//! their QP (or the CM) — by the receive thread, or, while a consumer polls a CQ of one of
//! the device's QPs in embedded mode, by that consumer's thread ([`rnicpi::progress`]).
//!
//! Whoever holds the receive slots' lock receives (up to a batch of datagrams with one
//! `recvmmsg`, never waiting) and delivers, so one QP's packets reach its engine in the
//! order the socket had them whoever receives. The receive thread sleeps in `poll`
//! without the lock. A polling consumer only tries it (never waits), and its attempt
//! marks the device driven ([`Driven`]). Once the thread sees that, it parks until the
//! consumers stop (one arms its CQ to sleep, or none has polled for the window): a thread
//! woken for every packet would only find it gone, and on two cores it takes the CPU the
//! consumers need.
//!
//! A consumer's delivery while the thread is parked leaves the positive acknowledgements
//! it produced queued on their QPs ([`crate::qp::RxeQp::with_state`]): they go with the
//! QP's next datagrams, or are sent here at the next poll of any consumer of the device,
//! when one arms its CQ, or when the receive thread takes the socket back ([`HeldAcks`]).
//!
//! The kAL's doorbell thread that has just sent small datagrams to this host takes them
//! off the socket itself ([`Receiver::receive_here`]): the kernel queued them within its
//! send, and kernel rxe, too, receives them in the sending context.

use crate::device::{deliver, Shared};
use crate::net::{Net, RxBatch, RxDrop, RX_BATCH};
use crate::qp::RxeQp;
use parking_lot::Mutex;
use rnicpi::{Driven, Progress};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How long the receive thread keeps looking for more after a data-bearing datagram
/// before it sleeps again (a bulk transfer then costs no wake-up per packet).
const RX_SPIN: Duration = Duration::from_micros(50);
/// Datagrams at least this large carry data of a transfer; after smaller ones (ACKs,
/// ping-pong messages) the thread sleeps at once: on two cores a spinning thread delays
/// the consumers more than a wake-up costs.
pub(crate) const RX_SPIN_AFTER: usize = 1024;
/// Batches [`Receiver::receive_here`] takes at most: the messages a doorbell sent, then
/// what their delivery sent back (acknowledgements, a Read's response).
const HERE_ROUNDS: usize = 4;

/// The device's socket and whoever is receiving from it.
pub(crate) struct Receiver {
    net: Arc<Net>,
    /// The receive slots: whoever holds them receives.
    batch: Mutex<RxBatch>,
    driven: Driven,
    /// The receive thread is parked for polling consumers (or about to look whether it
    /// must): only then may a consumer's delivery hold acknowledgements back, since the
    /// thread sends them when it next takes the slots — before it sleeps on the socket.
    parked: AtomicBool,
    /// The device it delivers to (set once the device is assembled).
    dev: OnceLock<Weak<Shared>>,
}

/// The QPs of a device holding acknowledgements back for a polling consumer's next call
/// ([`crate::qp::RxeQp::with_state`]).
#[derive(Default)]
pub(crate) struct HeldAcks {
    qps: Mutex<Vec<Weak<RxeQp>>>,
    /// Whether `qps` may be non-empty, read without its lock on every poll.
    any: AtomicBool,
}

impl HeldAcks {
    /// `qp` holds an acknowledgement back: it is sent at the next [`HeldAcks::send`]
    /// unless the QP sends it first with other datagrams.
    pub(crate) fn hold(&self, qp: &Arc<RxeQp>) {
        let mut qps = self.qps.lock();
        if !qps
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(qp)))
        {
            qps.push(Arc::downgrade(qp));
        }
        self.any.store(true, Ordering::Release);
    }

    /// Send every acknowledgement held back: at each consumer's poll and arming, and by
    /// the receive thread before it waits on the socket, so one is never held longer than
    /// a datagram to the device waits for its receiving. Whether any QP held one.
    pub(crate) fn send(&self) -> bool {
        if !self.any.swap(false, Ordering::AcqRel) {
            return false;
        }
        let qps = std::mem::take(&mut *self.qps.lock());
        for qp in qps.iter().filter_map(Weak::upgrade) {
            qp.release_held();
        }
        true
    }
}

impl Receiver {
    pub(crate) fn new(net: Arc<Net>) -> Receiver {
        Receiver {
            net,
            batch: Mutex::new(RxBatch::default()),
            driven: Driven::default(),
            parked: AtomicBool::new(false),
            dev: OnceLock::new(),
        }
    }

    pub(crate) fn attach(&self, dev: &Arc<Shared>) {
        let _ = self.dev.set(Arc::downgrade(dev));
    }

    /// The receive thread: sleep in `poll` (200 ms at a time, to notice the device's
    /// end), receive and deliver, again — parked while consumers drive.
    pub(crate) fn run(self: Arc<Self>) {
        let mut spin_until: Option<Instant> = None;
        // What the last sleep found readable (`None`: read as a poll does).
        let mut readable = None;
        let device = || {
            self.dev
                .get()
                .and_then(Weak::upgrade)
                .filter(|s| !s.stopped())
        };
        loop {
            // Parked, the thread does not hold the device up; it ends once the device has.
            if self.park() {
                if device().is_none() {
                    return;
                }
                (spin_until, readable) = (None, None);
                continue;
            }
            let Some(s) = device() else {
                return;
            };
            let mut batch = self.batch.lock();
            // Consumers hold acknowledgements back only while the thread is parked: once
            // it has the slots nothing stays held, before it sleeps on the socket.
            s.held.send();
            match self.net.recv_batch(&mut batch, readable.take()) {
                Ok(0) => {
                    drop(batch);
                    match spin_until {
                        Some(t) if Instant::now() < t => std::thread::yield_now(),
                        _ => {
                            spin_until = None;
                            readable = self.sleep(&s);
                        }
                    }
                }
                Ok(n) => {
                    let bulk = self.deliver_batch(&s, &batch, false).bulk;
                    drop(batch);
                    if bulk {
                        spin_until = Some(Instant::now() + RX_SPIN);
                    } else if spin_until.is_none() && n < RX_BATCH {
                        // The socket had no more: sleep at once (`poll` is level-triggered,
                        // what came meanwhile wakes it) rather than read it empty first.
                        readable = self.sleep(&s);
                    }
                }
                Err(e) => {
                    drop(batch);
                    tracing::warn!(error = %e, "rxe receive failed");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// Sleep on the socket ([`Net::wait_readable`]), counting the wake-ups a datagram made.
    fn sleep(&self, s: &Shared) -> Option<crate::net::Readable> {
        let readable = self.net.wait_readable();
        if readable.is_some() {
            s.counters.rx_thread_wakeups.fetch_add(1, Ordering::Relaxed);
        }
        readable
    }

    /// [`Driven::park_if_driven`], with [`Receiver::parked`] set around it.
    fn park(&self) -> bool {
        self.parked.store(true, Ordering::SeqCst);
        let parked = self.driven.park_if_driven();
        self.parked.store(false, Ordering::SeqCst);
        parked
    }

    /// A thread that has just sent small datagrams to this host, which the kernel queued
    /// on the receiving socket within the send, takes them and delivers them now rather
    /// than leave them for the receive thread: on two busy cores that thread's wake-up is
    /// the longest part of a one-way message through krdmad (docs/benchmarks.md). Called
    /// by the kAL's doorbell thread ([`rnicpi::ProviderQp::doorbell_on_thread`]) — never
    /// by a consumer's, which may hold locks of its own that a delivery's events need.
    /// Without waiting: not while consumers poll (they receive themselves) nor while
    /// another holds the slots, at most [`HERE_ROUNDS`] batches; nothing held back.
    pub(crate) fn receive_here(&self) {
        if self.driven.left().is_some() {
            return;
        }
        let Some(s) = self.dev.get().and_then(Weak::upgrade) else {
            return;
        };
        for _ in 0..HERE_ROUNDS {
            let before = Shared::sent_here();
            let Some(done) = self.try_receive(&s, false) else {
                return;
            };
            s.counters
                .rx_packets_here
                .fetch_add(done.count, Ordering::Relaxed);
            if Shared::sent_here() == before {
                return; // their delivery sent nothing more here
            }
        }
    }

    /// [`Net::hushed`]: the receive thread's sleep on the socket.
    pub(crate) fn hushed<R>(&self, f: impl FnOnce() -> R) -> R {
        self.net.hushed(f)
    }
}

/// What [`Receiver::deliver_batch`] handed over.
struct Delivered {
    count: u64,
    /// One of them carried data of a transfer (at least [`RX_SPIN_AFTER`] bytes).
    bulk: bool,
}

impl Receiver {
    /// Take what the socket holds now and deliver it, unless another holds the slots;
    /// `None` when nothing was taken. A `consumer`'s delivery holds acknowledgements back,
    /// only while the receive thread is parked (it sends them when it next takes the
    /// slots, before it sleeps on the socket).
    fn try_receive(&self, s: &Arc<Shared>, consumer: bool) -> Option<Delivered> {
        let mut batch = self.batch.try_lock()?;
        if !matches!(self.net.recv_batch(&mut batch, None), Ok(n) if n > 0) {
            return None;
        }
        let hold = consumer && self.parked.load(Ordering::SeqCst);
        Some(self.deliver_batch(s, &batch, hold))
    }

    /// Verify and deliver what `batch` holds, in order, counting what is dropped.
    fn deliver_batch(&self, s: &Arc<Shared>, batch: &RxBatch, polled: bool) -> Delivered {
        let mut done = Delivered {
            count: 0,
            bulk: false,
        };
        for d in self.net.datagrams(batch) {
            match d {
                Ok(d) => {
                    done.bulk |= d.roce.len() >= RX_SPIN_AFTER;
                    done.count += 1;
                    deliver(s, &d, polled);
                }
                Err(drop) => count_drop(s, drop),
            }
        }
        done
    }
}

fn count_drop(s: &Shared, drop: RxDrop) {
    let c = &s.counters;
    match drop {
        RxDrop::BadIcrc => s.count(&c.rx_bad_icrc),
        RxDrop::Malformed => s.count(&c.rx_malformed),
        RxDrop::NotOurs => {}
    }
}

/// A consumer polling a CQ of one of the device's QPs lends its thread: it receives what
/// the socket holds now, up to [`crate::net::RX_BATCH`] datagrams with one system call
/// (a burst of a transfer: a 64 KiB message at a 4096-byte MTU is 16), for whichever QPs
/// they are for.
impl Progress for Receiver {
    fn progress(&self) -> bool {
        self.driven.touch();
        let Some(s) = self.dev.get().and_then(Weak::upgrade) else {
            return false;
        };
        s.held.send();
        // The receive thread at it (it parks once it is done), or nothing there.
        let Some(done) = self.try_receive(&s, true) else {
            return false;
        };
        s.counters
            .rx_packets_polled
            .fetch_add(done.count, Ordering::Relaxed);
        if done.bulk {
            // Part of a transfer: the sender's window waits for these; one per QP (the
            // batch's last) goes now. Only a small message's waits for the next call.
            s.held.send();
        }
        done.count > 0
    }

    fn release(&self) {
        if let Some(s) = self.dev.get().and_then(Weak::upgrade) {
            s.held.send();
        }
        self.driven.release();
    }
}
