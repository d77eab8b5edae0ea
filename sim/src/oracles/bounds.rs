//! The bounds oracle: the queue, its prompt tokens, the running batch and the loads in flight,
//! each within its configured limit, checked after every step from what the engine reports,
//! written here apart from the engine's checks. (The step's prefill budget and the admission
//! order are `reported.rs`'s; the output limit is checked by the runner at submission. The
//! tiers' pages in use are not checked: the engine's allocators are built with the configured
//! capacity and count their pages in use as capacity minus free, so that comparison could never
//! fail; whether the pages the engine holds are the right ones is the conservation audit's
//! question.)

use crate::report::{Finding, OracleKind};
use tierkv_engine::Config;

/// What the engine holds at one moment.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub queued: usize,
    pub queued_tokens: u64,
    pub running: usize,
    pub loads: usize,
    /// Of the queued, the requests the engine sent back from its running batch when its
    /// device's context was recreated, and their prompt tokens, as the runner saw them
    /// (`Output::Requeued`): they were admitted once and return without intake, so the
    /// queue's bounds hold for the rest, and they are at most a running batch (and, for a
    /// pair's prefill engine, its exports: `exports_max`).
    pub requeued: (usize, u64),
    /// How many exports a pair's prefill engine may send back to its queue with the running
    /// batch: each holds a device page at least, so at most the device tier's pages (0 for
    /// any other engine).
    pub exports_max: u64,
}

/// The first bound `held` breaks, as a finding.
pub fn check(cfg: &Config, held: &Held, time_ns: u64) -> Option<Finding> {
    let s = &cfg.scheduler;
    let bounds: [(&str, u64, u64, &str); 5] = [
        (
            "queued requests (besides the requeued)",
            held.queued.saturating_sub(held.requeued.0) as u64,
            s.queued_requests_max as u64,
            "scheduler.queued_requests_max",
        ),
        (
            "queued prompt tokens (besides the requeued)",
            held.queued_tokens.saturating_sub(held.requeued.1),
            s.pending_tokens_max,
            "scheduler.pending_tokens_max",
        ),
        (
            "requeued requests in the queue",
            held.requeued.0 as u64,
            s.running_requests_max as u64 + held.exports_max,
            if held.exports_max == 0 {
                "scheduler.running_requests_max"
            } else {
                "scheduler.running_requests_max + cache.device_pages (a prefill engine's exports)"
            },
        ),
        (
            "running requests",
            held.running as u64,
            s.running_requests_max as u64,
            "scheduler.running_requests_max",
        ),
        (
            "loads in flight (ring slots in use)",
            held.loads as u64,
            cfg.cache.load_slots as u64,
            "cache.load_slots",
        ),
    ];
    bounds
        .iter()
        .find(|b| b.1 > b.2)
        .map(|&(what, value, limit, key)| Finding {
            oracle: OracleKind::Bound,
            time_ns,
            message: format!("{value} {what}, over {key} = {limit}"),
        })
}
