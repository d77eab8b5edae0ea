//! The bookkeeping of a staging ring: which regions of a pinned host buffer hold op arguments
//! whose copy to the device may still be queued on a stream. The runtime (`driven.rs`) stages
//! every op's small arguments through one ring per stream (a copy from pageable memory may wait
//! for the stream's queued work; from pinned memory it is queued like a kernel). Kept apart from
//! the driver so that it is tested on its own.

use crate::device::DeviceError;
use std::collections::VecDeque;

/// Where the ring asks about a queued copy's completion (`E` names the copy).
pub(crate) trait Copies<E> {
    /// Whether the copy completed (non-blocking).
    fn done(&mut self, copy: &E) -> bool;
    /// Blocks until the copy completed.
    fn wait(&mut self, copy: &E) -> Result<(), DeviceError>;
}

/// Regions of a ring of `len` bytes and the copies out of them, for one stream.
pub(crate) struct StagingRing<E> {
    len: usize,
    /// Regions start on multiples of this.
    align: usize,
    head: usize,
    /// `[start, end)` of each region whose copy may be queued, and the copy, oldest first.
    in_flight: VecDeque<(usize, usize, E)>,
}

impl<E> StagingRing<E> {
    pub(crate) fn new(len: usize, align: usize) -> StagingRing<E> {
        assert!(
            align.is_power_of_two() && len % align == 0,
            "ring {len} B, align {align}"
        );
        StagingRing {
            len,
            align,
            head: 0,
            in_flight: VecDeque::new(),
        }
    }

    /// Reserves `n` bytes (1 to `len`) and returns where they start, after waiting for every
    /// queued copy out of them. The copies of one stream complete in the order they were
    /// queued, so waiting for the newest copy that overlaps the region waits for all older
    /// ones, wherever they lie (after a wrap the oldest may lie in the tail the ring skipped).
    /// Completed copies go to `retired`, for reuse.
    pub(crate) fn reserve(
        &mut self,
        n: usize,
        retired: &mut Vec<E>,
        copies: &mut impl Copies<E>,
    ) -> Result<usize, DeviceError> {
        assert!(
            n >= 1 && n <= self.len,
            "staged {n} B in a ring of {} B",
            self.len
        );
        self.retire_done(retired, copies);
        if self.head + n > self.len {
            self.head = 0;
        }
        let (start, end) = (self.head, self.head + n);
        let newest = self
            .in_flight
            .iter()
            .rposition(|(a, b, _)| *a < end && *b > start);
        if let Some(last) = newest {
            copies.wait(&self.in_flight[last].2)?;
            for _ in 0..=last {
                let (_, _, e) = self.in_flight.pop_front().expect("counted above");
                retired.push(e);
            }
        }
        self.head = end.next_multiple_of(self.align);
        Ok(start)
    }

    /// Records the copy out of `[start, end)`, queued after every earlier one.
    pub(crate) fn queued(&mut self, start: usize, end: usize, copy: E) {
        self.in_flight.push_back((start, end, copy));
    }

    /// Forgets every recorded copy (the caller saw the stream complete them all) and starts
    /// again at the ring's start.
    pub(crate) fn retire_all(&mut self, retired: &mut Vec<E>) {
        retired.extend(self.in_flight.drain(..).map(|(_, _, e)| e));
        self.head = 0;
    }

    /// Moves the completed copies at the front to `retired`.
    fn retire_done(&mut self, retired: &mut Vec<E>, copies: &mut impl Copies<E>) {
        while self
            .in_flight
            .front()
            .is_some_and(|(_, _, e)| copies.done(e))
        {
            let (_, _, e) = self.in_flight.pop_front().expect("front");
            retired.push(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A stream that has completed every copy below `done`; copies are named by their id.
    struct Fake {
        done: Rc<Cell<usize>>,
    }

    impl Copies<usize> for Fake {
        fn done(&mut self, id: &usize) -> bool {
            *id < self.done.get()
        }
        fn wait(&mut self, id: &usize) -> Result<(), DeviceError> {
            self.done.set(self.done.get().max(id + 1));
            Ok(())
        }
    }

    /// Regions handed out, with their copy's id, for the overlap check.
    struct Stage {
        ring: StagingRing<usize>,
        done: Rc<Cell<usize>>,
        regions: Vec<(usize, usize, usize)>,
    }

    impl Stage {
        fn new(len: usize) -> Stage {
            Stage {
                ring: StagingRing::new(len, 1),
                done: Rc::new(Cell::new(0)),
                regions: Vec::new(),
            }
        }
        /// Stages `n` bytes: the new region must not overlap any region whose copy is pending.
        fn stage(&mut self, n: usize) -> usize {
            let mut fake = Fake {
                done: self.done.clone(),
            };
            let start = self.ring.reserve(n, &mut Vec::new(), &mut fake).unwrap();
            let end = start + n;
            for &(a, b, id) in &self.regions {
                let pending = id >= self.done.get();
                assert!(
                    !(pending && a < end && b > start),
                    "[{start}, {end}) overwrites pending copy {id} of [{a}, {b})"
                );
            }
            let id = self.regions.len();
            self.regions.push((start, end, id));
            self.ring.queued(start, end, id);
            start
        }
    }

    /// The review's case: a wrap whose oldest pending copy lies in the skipped tail, with the
    /// stream stalled throughout.
    #[test]
    fn a_wrap_waits_for_the_copies_of_the_regions_it_reuses() {
        let mut s = Stage::new(64);
        for n in [16, 16, 16, 8, 7, 16, 16, 16, 4, 16] {
            s.stage(n);
        }
        assert!(s.done.get() > 0, "the ring reused memory without waiting");
    }

    /// A region that only touches a pending copy's region, after it or (wrapped) before it,
    /// does not wait for that copy: with the stream stalled, regions laid end to end in the
    /// ring are handed out at once.
    #[test]
    fn a_region_next_to_a_pending_copy_does_not_wait_for_it() {
        let mut s = Stage::new(64);
        for (n, start) in [(16, 0), (16, 16), (32, 32)] {
            assert_eq!(s.stage(n), start);
        }
        assert_eq!(
            s.done.get(),
            0,
            "a region waited for a copy it does not overlap"
        );
        // The first copy completes; a wrapped region ending where the second begins does not
        // wait for the second.
        s.done.set(1);
        assert_eq!(s.stage(16), 0);
        assert_eq!(
            s.done.get(),
            1,
            "a wrapped region waited for the copy after it"
        );
    }

    /// Random sizes and random progress of the stream: no region handed out overlaps a copy
    /// still pending.
    #[test]
    fn no_region_overlaps_a_pending_copy() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..200 {
            let mut s = Stage::new(256);
            for _ in 0..300 {
                s.stage(1 + next(100) as usize);
                if next(3) == 0 {
                    let done = s.done.get() + next(4) as usize;
                    s.done.set(done.min(s.regions.len()));
                }
            }
        }
    }
}
