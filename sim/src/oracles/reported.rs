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
//! - Admission is FIFO with head-of-line blocking: the requests a step admits are the oldest
//!   queued ones, in the order the clients submitted them (the runner keeps that order itself).
//! - A step computes at most `scheduler.prefill_tokens_per_step_max` prompt tokens: counted from
//!   the KV rows the device was asked to store, whose positions fall in their request's prompt.

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

/// The requests a step admitted (`left`, any order), against the queue in submission order as
/// the runner kept it (`queue`): they must be its first `left.len()`.
pub fn admitted_in_order(
    queue: &std::collections::VecDeque<u64>,
    left: &[u64],
    time_ns: u64,
) -> Option<Finding> {
    let oldest: Vec<u64> = queue.iter().copied().take(left.len()).collect();
    let mut got = left.to_vec();
    got.sort_by_key(|id| queue.iter().position(|q| q == id).unwrap_or(usize::MAX));
    (got != oldest).then(|| Finding {
        oracle: OracleKind::Bound,
        time_ns,
        message: format!(
            "admission is FIFO with head-of-line blocking: the step admitted requests {got:?}, the \
             oldest queued were {oldest:?} (queue in submission order: {:?})",
            queue.iter().take(12).collect::<Vec<_>>()
        ),
    })
}

/// The `/metrics` gauges of the queue and the running set after a step, against the runner's
/// own counts: the requests it submitted that were neither admitted nor aborted (and their
/// prompt tokens), and those admitted that have not ended.
pub fn gauges(exported: [u64; 3], recount: [u64; 3], time_ns: u64) -> Option<Finding> {
    const NAMES: [&str; 3] = ["queue_depth", "queued_tokens", "running_requests"];
    (0..3)
        .find(|&i| exported[i] != recount[i])
        .map(|i| Finding {
            oracle: OracleKind::Metrics,
            time_ns,
            message: format!(
                "the engine exports {} = {}; the clients' requests recounted give {}",
                NAMES[i], exported[i], recount[i]
            ),
        })
}

/// The prompt tokens one step computed (`prefill` distinct (request, position) pairs), against
/// the configured budget.
pub fn prefill_budget(prefill: u64, budget: u32, time_ns: u64) -> Option<Finding> {
    (prefill > budget as u64).then(|| Finding {
        oracle: OracleKind::Bound,
        time_ns,
        message: format!(
            "a step computed {prefill} prompt tokens, over scheduler.prefill_tokens_per_step_max = {budget}"
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
        let queue: std::collections::VecDeque<u64> = [4, 2, 9].into();
        assert!(admitted_in_order(&queue, &[2, 4], 0).is_none());
        assert!(admitted_in_order(&queue, &[], 0).is_none());
        assert!(
            admitted_in_order(&queue, &[4, 9], 0).is_some(),
            "2 passed over"
        );
        assert!(admitted_in_order(&queue, &[7], 0).is_some(), "not queued");
        assert!(gauges([1, 2, 3], [1, 2, 3], 0).is_none());
        assert!(gauges([1, 2, 3], [1, 2, 4], 0).is_some());
        assert!(prefill_budget(512, 512, 0).is_none());
        assert!(prefill_budget(513, 512, 0).is_some());
    }
}
