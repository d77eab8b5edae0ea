//! `tierkv bench --cache`: the prefix cache's logic over a whole trace, on one core (no GPU, no
//! bytes): each request's match, locks, device eviction, load, insertion and write-through backup
//! (`tierkv_engine::trace::cache_replay`). The timed part is the cache's; the page keys (the
//! trace's tokens) are made per request outside it and reported apart.

use std::path::PathBuf;
use std::time::{Duration, Instant};
use tierkv_engine::synth::Synth;
use tierkv_engine::trace::cache_replay::{
    full_pages, prompt_page_keys, CacheReplay, CacheReplayError,
};
use tierkv_engine::trace::{read_trace, TraceRecord};

/// The device tier of the bench unless `--device-pages` says otherwise (1 GiB of 64 KiB pages).
pub const DEVICE_PAGES_DEFAULT: u32 = 16_384;
/// The most device pages the bench takes (a request's page keys take 256 bytes a page).
pub const DEVICE_PAGES_MAX: u32 = 1 << 20;
/// The most host pages the bench takes, and gives the write-through tier by default (it needs
/// one per distinct page of the trace, at most the trace's full pages, to evict nothing).
pub const HOST_PAGES_MAX: u32 = 1 << 22;
/// The most full pages a trace may hold: the tree keeps up to one node of about 400 bytes per
/// page, so the bench stays under about 2 GiB. (The Mooncake conversation trace has 2.26 M.)
pub const TRACE_PAGES_MAX: u64 = 1 << 22;

/// What the bench is asked to do.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The trace; `None` is the built-in excerpt.
    pub trace: Option<PathBuf>,
    pub device_pages: u32,
    /// The host tier; `None` is as large as the trace's full pages (nothing evicted).
    pub host_pages: Option<u32>,
}

/// What the bench measured.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub requests: usize,
    pub pages: u64,
    pub device_hits: u64,
    pub host_hits: u64,
    pub evictions: u64,
    pub evicted: u64,
    pub host_pages: u32,
    pub host_evicted: u64,
    pub backups_skipped: u64,
    /// Time in the cache's logic (the timed part).
    pub cache: Duration,
    /// Time making the requests' page keys.
    pub keys: Duration,
    /// The process's CPU time over both (user + system).
    pub cpu_s: f64,
}

fn self_cpu_s() -> f64 {
    super::bench_campaign::cpu_s(libc::RUSAGE_SELF)
}

/// Replays `recs` through the cache with a device tier of `device_pages` and a host tier of
/// `host_pages` (default: as large as the trace).
pub fn measure(
    recs: &[TraceRecord],
    device_pages: u32,
    host_pages: Option<u32>,
) -> Result<Measured, String> {
    if !(1..=DEVICE_PAGES_MAX).contains(&device_pages) {
        return Err(format!(
            "--device-pages {device_pages}: give 1..={DEVICE_PAGES_MAX}"
        ));
    }
    if let Some(h) = host_pages {
        if !(1..=HOST_PAGES_MAX).contains(&h) {
            return Err(format!("--host-pages {h}: give 1..={HOST_PAGES_MAX}"));
        }
    }
    // A request longer than the device tier is refused before its keys are made (a record may
    // claim four billion tokens).
    if let Some(r) = recs.iter().find(|r| full_pages(r) > device_pages as usize) {
        let e = CacheReplayError::RequestTooLarge {
            pages: full_pages(r),
            device_pages,
        };
        return Err(format!("line {}: {e}", r.line));
    }
    let pages: u64 = recs.iter().map(|r| full_pages(r) as u64).sum();
    if pages > TRACE_PAGES_MAX {
        return Err(format!(
            "the trace holds {pages} full pages; the bench replays at most {TRACE_PAGES_MAX} \
             (its tree keeps a node of about 400 bytes per page): give a shorter trace"
        ));
    }
    let host_pages = host_pages.unwrap_or(pages.clamp(1, HOST_PAGES_MAX as u64) as u32);
    let synth = Synth::new(0);
    let mut replay = CacheReplay::new(device_pages, host_pages);
    let mut m = Measured {
        requests: recs.len(),
        pages,
        host_pages,
        ..Measured::default()
    };
    let cpu0 = self_cpu_s();
    for r in recs {
        let t0 = Instant::now();
        let keys = prompt_page_keys(r, &synth);
        let t1 = Instant::now();
        let h = replay
            .request(&keys)
            .map_err(|e| format!("line {}: {e}", r.line))?;
        m.cache += t1.elapsed();
        m.keys += t1 - t0;
        m.device_hits += h.device;
        m.host_hits += h.host;
    }
    m.cpu_s = self_cpu_s() - cpu0;
    m.evictions = replay.evictions;
    m.evicted = replay.evicted;
    m.host_evicted = replay.host_evicted;
    m.backups_skipped = replay.backups_skipped;
    replay.cache().check_invariants();
    Ok(m)
}

/// The report of one measurement.
pub fn report(trace: &str, device_pages: u32, m: &Measured) -> String {
    let rate = |h: u64| h as f64 / m.pages.max(1) as f64;
    let s = |d: Duration| d.as_secs_f64();
    format!(
        "tierkv bench --cache: {trace}\n\
         \x20 {} requests, {} full pages; device tier {device_pages} pages, write-through host \
         tier {} pages\n\
         \x20 page hits {:.4} (device {:.4}, host {:.4}); {} device pages evicted in {} calls; \
         {} host pages evicted, {} backups skipped for want of host room\n\
         \x20 cache logic {:.3} s ({:.1} us per request, {:.2} M pages/s) <- the timed part\n\
         \x20 page keys   {:.3} s (the prompts' tokens, made outside the timed part)\n\
         \x20 process CPU {:.3} s over both, on one thread\n",
        m.requests,
        m.pages,
        m.host_pages,
        rate(m.device_hits + m.host_hits),
        rate(m.device_hits),
        rate(m.host_hits),
        m.evicted,
        m.evictions,
        m.host_evicted,
        m.backups_skipped,
        s(m.cache),
        s(m.cache) * 1e6 / m.requests.max(1) as f64,
        m.pages as f64 / s(m.cache).max(1e-9) / 1e6,
        s(m.keys),
        m.cpu_s,
    )
}

/// `tierkv bench --cache`.
pub fn run(plan: &Plan) -> Result<String, String> {
    let (recs, name) = match &plan.trace {
        Some(p) => (
            read_trace(p).map_err(|e| e.to_string())?,
            p.display().to_string(),
        ),
        None => (
            super::data::mooncake_excerpt().map_err(|e| e.to_string())?,
            super::data::MOONCAKE_EXCERPT_NAME.to_string(),
        ),
    };
    let m = measure(&recs, plan.device_pages, plan.host_pages)?;
    Ok(report(&name, plan.device_pages, &m))
}
