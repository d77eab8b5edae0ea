//! The bounds oracle: every bound the engine promises, checked after every step from what the
//! engine reports and what the configuration says, written here apart from the engine's checks.
//! Admission control keeps the queue and its prompt tokens within their limits; the running
//! batch, the load ring, the pinned host pages and both tiers' pages stay within theirs.

use crate::report::{Finding, OracleKind};
use tierkv_engine::Config;

/// What the engine holds at one moment.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub queued: usize,
    pub queued_tokens: u64,
    pub running: usize,
    pub loads: usize,
    pub pinned_host_pages: usize,
    pub device_pages: usize,
    pub host_pages: usize,
}

/// The first bound `held` breaks, as a finding.
pub fn check(cfg: &Config, held: &Held, time_ns: u64) -> Option<Finding> {
    let s = &cfg.scheduler;
    let host_pages = cfg.host_pages() as u64;
    let bounds: [(&str, u64, u64, &str); 7] = [
        (
            "queued requests",
            held.queued as u64,
            s.queued_requests_max as u64,
            "scheduler.queued_requests_max",
        ),
        (
            "queued prompt tokens",
            held.queued_tokens,
            s.pending_tokens_max,
            "scheduler.pending_tokens_max",
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
        (
            "pinned host pages",
            held.pinned_host_pages as u64,
            host_pages,
            "the host tier's pages",
        ),
        (
            "device pages in use",
            held.device_pages as u64,
            cfg.cache.device_pages as u64,
            "cache.device_pages",
        ),
        (
            "host pages in use",
            held.host_pages as u64,
            host_pages,
            "the host tier's pages",
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
