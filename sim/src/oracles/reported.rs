//! The reported-counts oracle: what the engine says about its own work, against the simulator's
//! recount of the same thing from the requests the engine holds and the memory it uses. The
//! runner recounts (it sees the engine between steps); the comparisons live here.
//!
//! - Queued requests and their prompt tokens equal the requests the engine holds queued, with
//!   the prompt lengths the clients sent.
//! - Loads in flight are at least the distinct loads the engine's requests wait for (an aborted
//!   request's load may still be in flight, so not equal).
//! - A step's admitted count equals the queued requests that left the queue during it: within a
//!   step, admission is the only way out of the queue (aborts come between steps).
//! - The pages `Engine::evict_device` says it freed at once are those that left the device
//!   tier, and no more than were asked for.

use crate::report::{Finding, OracleKind};

/// What the engine reported about its queue, against the recount.
pub fn queue(reported: (usize, u64), recount: (usize, u64), time_ns: u64) -> Option<Finding> {
    (reported != recount).then(|| Finding {
        oracle: OracleKind::Bound,
        time_ns,
        message: format!(
            "the engine reports {} queued requests and {} queued prompt tokens; the requests it has queued are {} with {} prompt tokens",
            reported.0, reported.1, recount.0, recount.1
        ),
    })
}

/// Loads in flight, against the loads the engine's requests wait for.
pub fn loads_in_flight(reported: usize, waited_for: usize, time_ns: u64) -> Option<Finding> {
    (reported < waited_for).then(|| Finding {
        oracle: OracleKind::Bound,
        time_ns,
        message: format!(
            "the engine reports {reported} loads in flight, but {waited_for} of its requests wait for a load"
        ),
    })
}

/// A step's admitted count, against the queued requests that left the queue during it.
pub fn admitted(reported: usize, left_queue: usize, time_ns: u64) -> Option<Finding> {
    (reported != left_queue).then(|| Finding {
        oracle: OracleKind::Metrics,
        time_ns,
        message: format!(
            "the step reports {reported} requests admitted; {left_queue} of the queued ones left the queue"
        ),
    })
}

/// `evict_device(asked)` said it freed `freed` pages; the device tier held `before` pages in use
/// before the call and `after` after it.
pub fn evicted(
    asked: usize,
    freed: usize,
    before: usize,
    after: usize,
    time_ns: u64,
) -> Option<Finding> {
    (freed > asked || before != after + freed).then(|| Finding {
        oracle: OracleKind::Metrics,
        time_ns,
        message: format!(
            "evict_device({asked}) reports {freed} pages freed; the device tier went from {before} to {after} pages used"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_report_is_held_to_its_recount() {
        assert!(queue((2, 100), (2, 100), 0).is_none());
        assert!(queue((2, 100), (2, 99), 0).is_some());
        assert!(loads_in_flight(2, 1, 0).is_none(), "an orphaned load too");
        assert!(loads_in_flight(0, 1, 0).is_some());
        assert!(admitted(3, 3, 0).is_none());
        assert!(admitted(0, 1, 0).is_some());
        assert!(evicted(10, 4, 20, 16, 0).is_none());
        assert!(
            evicted(10, 0, 20, 16, 0).is_some(),
            "freed pages unreported"
        );
        assert!(evicted(10, 4, 20, 20, 0).is_some(), "nothing left the tier");
        assert!(evicted(2, 4, 20, 16, 0).is_some(), "more than asked");
    }
}
