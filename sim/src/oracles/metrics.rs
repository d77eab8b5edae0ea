//! The metrics oracle: at the end of a run, the engine's counters (what `/metrics` exports) agree
//! with what the simulated device and the clients saw, counted apart from the engine's
//! bookkeeping: loads, backups and their failures and bytes, steps, host-tier hits, requests
//! submitted, refused by kind, finished and aborted, tokens generated.
//!
//! What the device sees of them: each load records one event per layer on the load stream, and
//! nothing else records there; each backup records one event on the write stream; each step
//! records one event on the compute stream, which reports a failure exactly when the step's work
//! failed. A load failed when one of its records reported a failure or one of its copies was
//! refused at enqueue; a backup likewise (its record comes after its copies). Every page a load
//! moves is a host-tier hit of the prefix cache.
//!
//! Every series `/metrics` exports, and what holds it:
//! - `loads_total`, `load_failures_total`, `load_bytes_total`, `backups_total`,
//!   `backup_failures_total`, `backup_bytes_total`, `steps_total` (with failed and discarded
//!   steps), `steps_failed_total`, the host-tier hit rate's numerator, and the clients' counts
//!   (`requests_submitted_total`, `requests_rejected_total` by reason,
//!   `requests_finished_total`, `requests_aborted_total`, `generated_tokens_total`): here, at
//!   the end of a run.
//! - `prefix_pages_queried_total`: here, against the full prompt pages (all but the last token)
//!   of every request the runner saw admitted.
//! - `queue_depth`, `queued_tokens`, `running_requests`: after every step, against the runner's
//!   own count of the requests it submitted, saw admitted and saw end (`reported::gauges`).
//! - `prefix_hit_rate`'s numerators per tier (`prefix_pages_device_hit`,
//!   `prefix_pages_host_hit`): also after every step of a single engine without faults in
//!   which every admitted request could be seen (not one that finished within the step that
//!   admitted it), against each admitted request's cached pages (its first stored position)
//!   split into those the load stream filled for it and the rest (`policy.rs`).
//! - No oracle yet, and why: `steps_discarded_total` apart from the sum above (a discarded step records like any other);
//!   `loads_lost_total` and `backups_lost_total` (copies whose events reported no failure,
//!   dropped because the device's context was recreated before their acknowledgement: the
//!   device sees nothing of that; the content oracle and the conservation audit judge what the
//!   engine did with their pages), `context_recreations_total` and `requests_requeued_total`
//!   (the runner follows each requeue from `Output::Requeued`, and the gauges after every step
//!   hold the queue it moves them to, but nothing counts the recreations apart from the engine);
//!   `prefill_tokens_total` (a failed step's prompt tokens are stored again, so the stores
//!   over-count it); `device_kv_pages_used` and `host_tokens_used` (the allocators' own counts;
//!   the conservation audit judges the pages the prefix cache holds, not their number);
//!   `device_kv_pages_total` and `host_tokens_capacity` (the configuration); the latency
//!   histograms and the host and device step times (wall-clock and device-timer measurements,
//!   which a simulation does not have).

use crate::gpu::RecordLog;
use crate::report::{Finding, OracleKind};
use std::collections::BTreeSet;
use tierkv_engine::device::StreamKind;
use tierkv_engine::metrics::Metrics;

/// What the clients of a run saw: answers to submissions and outputs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Counted {
    pub submitted: u64,
    pub rejected_queue_full: u64,
    pub rejected_pending_tokens: u64,
    pub rejected_invalid: u64,
    pub finished: u64,
    pub aborted: u64,
    pub tokens: u64,
    /// Full prompt pages of the requests the runner saw admitted.
    pub prefix_pages_queried: u64,
}

/// `page_bytes`: the bytes one page moves between the tiers (every layer, KV and index-K).
pub fn check(
    m: &Metrics,
    log: &RecordLog,
    clients: &Counted,
    layers: u32,
    page_bytes: u64,
    time_ns: u64,
) -> Option<Finding> {
    let (load, write, compute) = (
        StreamKind::Load.index(),
        StreamKind::Write.index(),
        StreamKind::Compute.index(),
    );
    let layers = layers.max(1) as u64;
    let loads = log.failed[load].len() as u64 / layers;
    let mut failed_loads: BTreeSet<u64> = log.failed[load]
        .iter()
        .enumerate()
        .filter(|(_, &f)| f)
        .map(|(i, _)| i as u64 / layers)
        .collect();
    failed_loads.extend(log.refused_after[load].iter().map(|&made| made / layers));
    let steps_failed = log.failed[compute].iter().filter(|&&f| f).count() as u64;
    let mut failed_backups: BTreeSet<u64> = log.failed[write]
        .iter()
        .enumerate()
        .filter(|(_, &f)| f)
        .map(|(i, _)| i as u64)
        .collect();
    failed_backups.extend(log.refused_after[write].iter().copied());
    let checks = [
        ("loads", m.loads, loads),
        ("load_failures", m.load_failures, failed_loads.len() as u64),
        ("load_bytes", m.load_bytes, log.copy_bytes[load]),
        (
            "prefix_pages_host_hit (in bytes loaded)",
            m.prefix_pages_host_hit * page_bytes,
            log.copy_bytes[load],
        ),
        ("backups", m.backups, log.failed[write].len() as u64),
        (
            "backup_failures",
            m.backup_failures,
            failed_backups.len() as u64,
        ),
        ("backup_bytes", m.backup_bytes, log.copy_bytes[write]),
        (
            "requests_submitted",
            m.requests_submitted,
            clients.submitted,
        ),
        (
            "rejected_queue_full",
            m.rejected_queue_full,
            clients.rejected_queue_full,
        ),
        (
            "rejected_pending_tokens",
            m.rejected_pending_tokens,
            clients.rejected_pending_tokens,
        ),
        (
            "rejected_invalid",
            m.rejected_invalid,
            clients.rejected_invalid,
        ),
        ("requests_finished", m.requests_finished, clients.finished),
        ("requests_aborted", m.requests_aborted, clients.aborted),
        ("generated_tokens", m.generated_tokens, clients.tokens),
        (
            "prefix_pages_queried",
            m.prefix_pages_queried,
            clients.prefix_pages_queried,
        ),
        ("steps_failed", m.steps_failed, steps_failed),
        (
            "steps (with the failed and discarded ones)",
            m.steps + m.steps_failed + m.steps_discarded,
            log.failed[compute].len() as u64,
        ),
    ];
    checks
        .into_iter()
        .find(|(_, engine, device)| engine != device)
        .map(|(name, engine, device)| Finding {
            oracle: OracleKind::Metrics,
            time_ns,
            message: format!(
                "the engine counts {engine} {name}, the simulated device saw {device}"
            ),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two loads of two layers (the second failed at its second layer, the first refused a copy
    /// before its first record), one backup, three steps of which one failed.
    #[test]
    fn counters_are_held_to_what_the_device_saw() {
        let log = RecordLog {
            failed: [
                vec![false, true, false],
                vec![false, false, false, true],
                vec![false],
                vec![],
                vec![],
                vec![],
            ],
            refused_after: [vec![], vec![0], vec![], vec![], vec![], vec![]],
            made: [3, 4, 1, 0, 0, 0],
            copy_bytes: [0, 400, 100, 0, 0, 0],
        };
        let mut m = Metrics {
            loads: 2,
            load_failures: 2,
            load_bytes: 400,
            prefix_pages_host_hit: 4,
            backups: 1,
            backup_bytes: 100,
            steps: 2,
            steps_failed: 1,
            ..Metrics::default()
        };
        let clients = Counted::default();
        assert!(check(&m, &log, &clients, 2, 100, 0).is_none());
        m.load_failures = 1;
        let f = check(&m, &log, &clients, 2, 100, 0).expect("a wrong counter");
        assert!(f.message.contains("1 load_failures"), "{f}");
        m.load_failures = 2;
        m.steps = 3;
        assert!(check(&m, &log, &clients, 2, 100, 0).is_some());
    }
}
