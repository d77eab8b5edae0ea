//! The determinism oracle: the same scenario run twice (same seed, same build) must produce the
//! same event-log hash — every enqueue, start, completion, record, wait, synchronisation and host
//! access of the simulated GPU, and every output of the engine, in order.

use crate::report::{Finding, OracleKind};
use crate::runner::{run, RunOptions};
use crate::scenario::Scenario;

/// A campaign reruns every seed divisible by this (and every failing seed) and compares hashes.
pub const SAMPLE_EVERY: u64 = 16;

/// Whether a campaign reruns `seed`, whose run `failed` or not.
pub fn sampled(seed: u64, failed: bool) -> bool {
    failed || seed % SAMPLE_EVERY == 0
}

pub fn check(sc: &Scenario, opts: &RunOptions) -> Option<Finding> {
    let first = run(sc, opts).log_hash;
    rerun(sc, opts, first)
}

/// Runs `sc` again and compares its event-log hash with `first`, the first run's.
pub fn rerun(sc: &Scenario, opts: &RunOptions, first: u64) -> Option<Finding> {
    let again = run(sc, opts).log_hash;
    (again != first).then(|| Finding {
        oracle: OracleKind::Determinism,
        time_ns: 0,
        message: format!(
            "seed {} gave event-log hashes {first:#018x} and {again:#018x}",
            sc.seed
        ),
    })
}
