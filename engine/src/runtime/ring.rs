//! The completion ring: slots that a completion-callback thread signals and the engine thread
//! polls (it never blocks on the ring: to wait, it synchronises on the event itself). The CUDA
//! device enqueues a host callback (`cuLaunchHostFunc`) after each event it records on the load
//! stream; CUDA runs the callback on its own thread when the stream
//! reaches it, and the callback publishes "done, with this status" into the event's slot. The
//! engine thread then learns that a layer of a load finished without a driver call.
//!
//! The protocol: the engine thread issues a ticket (slot, sequence) before the work; the callback
//! writes the status, then publishes the sequence with `Release`; the engine thread reads the
//! sequence with `Acquire` and only then the status. A slot is re-issued only after its previous
//! ticket completed (asserted). The loom models below check it — and check that the obvious
//! weaker ordering (`Relaxed`) is rejected.

use crate::sync::cell::UnsafeCell;
use crate::sync::{AtomicU64, Ordering};

/// One unit of signalled work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub slot: usize,
    pub seq: u64,
}

struct Slot {
    /// The latest sequence signalled complete (0: none yet).
    done: AtomicU64,
    /// The latest sequence issued (engine thread only, but atomic so `issue` can assert).
    issued: AtomicU64,
    /// The status of the latest completion; written by the callback before `done` publishes it.
    status: UnsafeCell<u32>,
}

pub struct CompletionRing {
    slots: Vec<Slot>,
}

// SAFETY: `status` is written only by the callback of the slot's current ticket, before `done`
// publishes it (Release), and read only after `done` is observed (Acquire); a slot is re-issued
// only after its ticket completed, so no write races a read.
unsafe impl Sync for CompletionRing {}
unsafe impl Send for CompletionRing {}

impl CompletionRing {
    pub fn new(slots: usize) -> Self {
        CompletionRing {
            slots: (0..slots)
                .map(|_| Slot {
                    done: AtomicU64::new(0),
                    issued: AtomicU64::new(0),
                    status: UnsafeCell::new(0),
                })
                .collect(),
        }
    }

    /// Engine thread: the next ticket of `slot`. Panics if the slot's previous ticket has not
    /// completed (reusing it early is the ring-reuse bug).
    pub fn issue(&self, slot: usize) -> Ticket {
        let s = &self.slots[slot];
        let prev = s.issued.load(Ordering::Relaxed);
        assert!(
            s.done.load(Ordering::Acquire) >= prev,
            "completion slot {slot} re-issued before ticket {prev} completed"
        );
        s.issued.store(prev + 1, Ordering::Relaxed);
        Ticket {
            slot,
            seq: prev + 1,
        }
    }

    /// Engine thread: whether `slot`'s latest ticket completed (or it has none), so that it may
    /// be issued again without waiting.
    pub fn settled(&self, slot: usize) -> bool {
        let s = &self.slots[slot];
        s.done.load(Ordering::Acquire) >= s.issued.load(Ordering::Relaxed)
    }

    /// Callback thread: the work behind `t` completed with `status`.
    pub fn signal(&self, t: Ticket, status: u32) {
        self.signal_with(t, status, Ordering::Release)
    }

    fn signal_with(&self, t: Ticket, status: u32, order: Ordering) {
        let s = &self.slots[t.slot];
        // SAFETY: see the `Sync` impl: only this ticket's callback writes now.
        s.status.with_mut(|p| unsafe { *p = status });
        s.done.store(t.seq, order);
    }

    /// Engine thread: the status once `t` completed.
    pub fn poll(&self, t: Ticket) -> Option<u32> {
        self.poll_with(t, Ordering::Acquire)
    }

    fn poll_with(&self, t: Ticket, order: Ordering) -> Option<u32> {
        let s = &self.slots[t.slot];
        if s.done.load(order) >= t.seq {
            // SAFETY: the completion of `t` was published; nobody writes until re-issue.
            Some(s.status.with(|p| unsafe { *p }))
        } else {
            None
        }
    }
}

#[cfg(all(test, not(tierkv_loom)))]
mod tests {
    use super::*;

    /// A slot with a ticket out is not settled, and polls nothing, until the ticket is
    /// signalled; then it polls the signalled status. Another slot is untouched, and a re-issue
    /// starts unsettled again.
    #[test]
    fn a_ticket_settles_its_slot_when_signalled() {
        let ring = CompletionRing::new(2);
        assert!(ring.settled(0), "a slot never issued");
        let t = ring.issue(0);
        assert!(!ring.settled(0));
        assert_eq!(ring.poll(t), None);
        assert!(ring.settled(1), "the other slot");
        ring.signal(t, 7);
        assert!(ring.settled(0));
        assert_eq!(ring.poll(t), Some(7));
        let again = ring.issue(0);
        assert!(!ring.settled(0));
        assert_eq!(ring.poll(again), None);
        ring.signal(again, 0);
        assert_eq!(ring.poll(again), Some(0));
    }
}

#[cfg(all(test, tierkv_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    /// The callback thread signals two layers of one load; the engine thread polls the first
    /// until it completed, then the second; statuses arrive intact, and the slot can then be
    /// re-issued.
    #[test]
    fn loom_ring_signals_are_seen_with_their_status() {
        loom::model(|| {
            let ring = Arc::new(CompletionRing::new(2));
            let (a, b) = (ring.issue(0), ring.issue(1));
            let r2 = ring.clone();
            let cb = thread::spawn(move || {
                r2.signal(a, 7);
                r2.signal(b, 9);
            });
            let first = loop {
                match ring.poll(a) {
                    Some(v) => break v,
                    None => thread::yield_now(),
                }
            };
            assert_eq!(first, 7);
            let second = ring.poll(b);
            assert!(second.is_none() || second == Some(9));
            cb.join().unwrap();
            assert_eq!(ring.poll(b), Some(9));
            let again = ring.issue(0);
            assert_eq!(again.seq, 2);
        });
    }

    /// The documented wrong ordering: publishing completion with `Relaxed` (and reading it with
    /// `Relaxed`) lets the engine thread see "done" without the status write — loom reports the
    /// unsynchronised access to the status cell. This test passes when loom rejects it.
    #[test]
    fn loom_relaxed_publication_is_rejected() {
        let rejected = std::panic::catch_unwind(|| {
            loom::model(|| {
                let ring = Arc::new(CompletionRing::new(1));
                let t = ring.issue(0);
                let r2 = ring.clone();
                let cb = thread::spawn(move || r2.signal_with(t, 5, Ordering::Relaxed));
                if let Some(v) = ring.poll_with(t, Ordering::Relaxed) {
                    assert_eq!(v, 5);
                }
                cb.join().unwrap();
            });
        });
        assert!(
            rejected.is_err(),
            "loom accepted a Relaxed publication of the status"
        );
    }
}
