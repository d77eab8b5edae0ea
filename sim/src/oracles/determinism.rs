//! The determinism oracle: the same scenario run twice (same seed, same build) must produce the
//! same event-log hash — every enqueue, start, completion, record, wait, synchronisation and host
//! access of the simulated GPU, and every output of the engine, in order.

use crate::report::{Finding, OracleKind};
use crate::runner::{run, RunOptions};
use crate::scenario::Scenario;

pub fn check(sc: &Scenario, opts: &RunOptions) -> Option<Finding> {
    let (a, b) = (run(sc, opts), run(sc, opts));
    (a.log_hash != b.log_hash).then(|| Finding {
        oracle: OracleKind::Determinism,
        time_ns: 0,
        message: format!(
            "seed {} gave event-log hashes {:#018x} and {:#018x}",
            sc.seed, a.log_hash, b.log_hash
        ),
    })
}
