//! The liveness oracle: the run reaches quiescence within its step budget, and after the faults
//! stop every request the client submitted finishes or is aborted by the client. (The queue's
//! bound is the bounds oracle's.)

use crate::report::{Finding, OracleKind};

/// The run went quiescent within its step budget.
pub fn within_steps(
    steps: u64,
    steps_max: u64,
    queued: usize,
    running: usize,
    unfinished_sessions: usize,
    time_ns: u64,
) -> Option<Finding> {
    (steps > steps_max).then(|| Finding {
        oracle: OracleKind::Liveness,
        time_ns,
        message: format!(
            "no quiescence after {steps} steps: {queued} queued, {running} running, {unfinished_sessions} sessions unfinished"
        ),
    })
}

/// Every submitted request ended (`open` are those that did not).
pub fn all_requests_ended(open: &[u64], time_ns: u64) -> Option<Finding> {
    open.first().map(|id| Finding {
        oracle: OracleKind::Liveness,
        time_ns,
        message: format!("request {id} never finished ({} requests open)", open.len()),
    })
}
