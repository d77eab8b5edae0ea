//! Campaigns: many seeds over worker threads (`--jobs`), a slice of them per machine (`--shard`),
//! a progress bar, and a summary with the throughput figures. Each seed's run is deterministic and
//! independent, so the workers share nothing but a counter and a results channel.

use crate::oracles::determinism;
use crate::probes::Coverage;
use crate::report::{Finding, OracleKind};
use crate::runner::{run, RunOptions, RunOutcome, RunStats};
use crate::scenario::{draw, Scenario};
use crate::schedule::{explore_policy, Policy, Source};
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tierkv_engine::trace::TraceRecord;

#[derive(Clone, Debug)]
pub struct CampaignOptions {
    pub first: u64,
    pub end: u64,
    pub jobs: usize,
    /// (index, count): run only seeds with `seed % count == index`.
    pub shard: Option<(u64, u64)>,
    pub profile: String,
    pub mutant: Option<String>,
    pub progress: bool,
    /// Stop handing out seeds after the first failure.
    pub stop_at_first: bool,
    pub trace_records: Option<Vec<TraceRecord>>,
    /// Run the ops on the GPU (`--device cuda`).
    pub cuda: bool,
    /// Schedules per seed (`--schedules`): the scenario's own, then `schedule::explore_policy`'s.
    pub schedules: u64,
}

/// The seeds of a campaign: `first..end`, and of those only `seed % n == i` under a shard
/// `(i, n)`. Computed, never listed: a range of 2^64 seeds costs nothing until it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeedSet {
    /// The first seed of the set (`end` when it is empty).
    start: u64,
    end: u64,
    step: u64,
}

impl SeedSet {
    pub fn new(first: u64, end: u64, shard: Option<(u64, u64)>) -> SeedSet {
        let (i, n) = shard.unwrap_or((0, 1));
        assert!(n > 0 && i < n, "shard {i}/{n}");
        // The first seed >= `first` with seed % n == i.
        let off = ((i as u128 + n as u128 - (first % n) as u128) % n as u128) as u64;
        let start = match first.checked_add(off) {
            Some(s) if s < end => s,
            _ => end,
        };
        SeedSet {
            start,
            end,
            step: n,
        }
    }
    pub fn len(&self) -> u64 {
        if self.start >= self.end {
            0
        } else {
            (self.end - 1 - self.start) / self.step + 1
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The `k`-th seed of the set.
    pub fn nth(&self, k: u64) -> Option<u64> {
        (k < self.len()).then(|| self.start + k * self.step)
    }
    /// The first seed, if any.
    pub fn first(&self) -> Option<u64> {
        self.nth(0)
    }
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len()).map(|k| self.start + k * self.step)
    }
}

impl CampaignOptions {
    pub fn seeds(&self) -> SeedSet {
        SeedSet::new(self.first, self.end, self.shard)
    }
    pub fn scenario(&self, seed: u64) -> Scenario {
        let mut sc = draw(seed, &self.profile, self.trace_records.as_deref());
        sc.mutant = self.mutant.clone();
        sc
    }
}

#[derive(Clone, Debug, Default)]
pub struct CampaignSummary {
    pub seeds_run: u64,
    pub failures: Vec<(u64, Finding)>,
    pub by_oracle: BTreeMap<OracleKind, u64>,
    pub wall: Duration,
    pub totals: RunStats,
    /// The first failing seed in seed order, if any.
    pub first_failure: Option<u64>,
    pub coverage: Coverage,
    /// Seeds run twice for the determinism oracle.
    pub reruns: u64,
    /// Runs in all: seeds times the schedules each ran (a failing seed stops at its failure).
    pub runs: u64,
    /// The first failure's schedule: index, the policy that drew it (`None`: the scenario's
    /// own) and decisions (the schedule to replay it under).
    pub first_failure_schedule: Option<(u64, Option<Policy>, Vec<u8>)>,
}

impl CampaignSummary {
    fn add(&mut self, o: &RunOutcome) {
        self.runs += 1;
        self.seeds_run += (o.schedule == 0) as u64;
        self.reruns += o.rerun as u64;
        self.coverage.add(&o.probes);
        let t = &mut self.totals;
        let s = &o.stats;
        t.steps += s.steps;
        t.submitted += s.submitted;
        t.finished += s.finished;
        t.rejected += s.rejected;
        t.aborted += s.aborted;
        t.recomputed += s.recomputed;
        t.digests_checked += s.digests_checked;
        t.rows_checked += s.rows_checked;
        t.rows_cached += s.rows_cached;
        t.ops += s.ops;
        t.events += s.events;
        t.copy_bytes += s.copy_bytes;
        t.failed_copies += s.failed_copies;
        t.failed_kernels += s.failed_kernels;
        t.steps_failed += s.steps_failed;
        t.loads += s.loads;
        t.backups += s.backups;
        t.sim_ns += s.sim_ns;
        t.wall_ns += s.wall_ns;
        if let Some(f) = o.findings.first() {
            *self.by_oracle.entry(f.oracle).or_default() += 1;
            self.failures.push((o.seed, f.clone()));
            if self.first_failure.is_none_or(|x| o.seed < x) {
                self.first_failure = Some(o.seed);
                self.first_failure_schedule = Some((o.schedule, o.policy, o.decisions.clone()));
            }
        }
    }

    pub fn print(&self, profile: &str) {
        let wall = self.wall.as_secs_f64().max(1e-9);
        let t = &self.totals;
        println!("== tierkv sim summary (profile {profile})");
        println!(
            "seeds run: {}{}   failures: {}{}",
            self.seeds_run,
            if self.runs > self.seeds_run {
                format!(" ({} runs: schedules explored)", self.runs)
            } else {
                String::new()
            },
            self.failures.len(),
            if self.by_oracle.is_empty() {
                String::new()
            } else {
                format!(
                    "   by oracle: {}",
                    self.by_oracle
                        .iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        println!(
            "checked: {} requests finished, {} digests recomputed, {} KV/index-K rows compared (+{} unchanged since compared), {} ops, {} loads, {} backups, {} failed copies, {} failed launches ({} steps run again), {} aborts",
            t.finished, t.digests_checked, t.rows_checked, t.rows_cached, t.ops, t.loads, t.backups, t.failed_copies, t.failed_kernels, t.steps_failed, t.aborted
        );
        println!(
            "throughput: {:.2} seeds/s, {:.0} events/s, {:.1} MB copied/s; simulated {:.3} s in {:.2} s of run time: sim/wall ratio {:.2}x",
            self.seeds_run as f64 / wall,
            t.events as f64 / wall,
            t.copy_bytes as f64 / wall / 1e6,
            t.sim_ns as f64 * 1e-9,
            t.wall_ns as f64 * 1e-9,
            t.sim_ns as f64 / t.wall_ns.max(1) as f64
        );
        let names = crate::probes::all_names();
        let never = self.coverage.below(f64::MIN_POSITIVE);
        let rare = self.coverage.below(0.05);
        println!(
            "determinism: {} seeds run twice (1 in {} and every failing seed), hashes compared",
            self.reruns,
            determinism::SAMPLE_EVERY
        );
        if self.failures.len() > 1 {
            let seeds: Vec<String> = self.failures.iter().map(|f| f.0.to_string()).collect();
            println!("failing seeds: {}", seeds.join(", "));
        }
        println!(
            "coverage: {} of {} probes hit; {} in fewer than 5% of seeds{}",
            names.len() - never.len(),
            names.len(),
            rare.len(),
            if never.is_empty() {
                String::new()
            } else {
                format!("; never: {}", never.join(", "))
            }
        );
    }
}

/// Runs a campaign; `on_done` sees every outcome (in completion order).
pub fn run_campaign(
    opts: &CampaignOptions,
    mut on_done: impl FnMut(&RunOutcome),
) -> CampaignSummary {
    let seeds = opts.seeds();
    let total = seeds.len();
    let next = AtomicU64::new(0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let start = Instant::now();
    let mut summary = CampaignSummary::default();
    // The progress line redraws itself: only on a terminal, never into a log.
    let progress = opts.progress && std::io::stderr().is_terminal();
    let (tx, rx) = mpsc::channel::<RunOutcome>();
    std::thread::scope(|scope| {
        for _ in 0..(opts.jobs.max(1) as u64).min(total.max(1)) {
            let tx = tx.clone();
            let (next, stop, seeds) = (&next, &stop, &seeds);
            scope.spawn(move || loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(seed) = seeds.nth(i) else {
                    return;
                };
                let sc = opts.scenario(seed);
                let ropts = RunOptions {
                    trace: false,
                    cuda: opts.cuda,
                    schedule: None,
                };
                let mut out = run(&sc, &ropts);
                if determinism::sampled(seed, out.failed()) {
                    out.rerun = true;
                    out.findings
                        .extend(determinism::rerun(&sc, &ropts, out.log_hash));
                }
                // More schedules of the same scenario, PCT over schedule 0's op starts.
                let ops = out.decisions.len() as u64;
                let mut failed = out.failed();
                if tx.send(out).is_err() {
                    return;
                }
                for index in 1..opts.schedules {
                    if failed {
                        break;
                    }
                    let policy = explore_policy(index, sc.gpu.schedule_policy(), ops);
                    let sopts = RunOptions {
                        schedule: Some(Source::Draw { index, policy }),
                        ..ropts.clone()
                    };
                    let mut out = run(&sc, &sopts);
                    out.schedule = index;
                    out.policy = Some(policy);
                    failed = out.failed();
                    if failed {
                        // Every failing run is run again: the same schedule, the same log.
                        out.rerun = true;
                        let again = RunOptions {
                            schedule: Some(Source::Replay(out.decisions.clone())),
                            ..ropts.clone()
                        };
                        out.findings
                            .extend(determinism::rerun(&sc, &again, out.log_hash));
                    }
                    if tx.send(out).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let mut last_draw = Instant::now() - Duration::from_secs(1);
        for out in rx {
            summary.add(&out);
            if out.failed() && opts.stop_at_first {
                stop.store(true, Ordering::Relaxed);
            }
            on_done(&out);
            if progress
                && (last_draw.elapsed() > Duration::from_millis(200) || summary.seeds_run == total)
            {
                last_draw = Instant::now();
                let width = 30;
                let done = (summary.seeds_run * width / total.max(1)) as usize;
                eprint!(
                    "\r[{}{}] {}/{} seeds, {} failures, {:.1} seeds/s ",
                    "=".repeat(done),
                    " ".repeat(width as usize - done),
                    summary.seeds_run,
                    total,
                    summary.failures.len(),
                    summary.seeds_run as f64 / start.elapsed().as_secs_f64().max(1e-9)
                );
                let _ = std::io::stderr().flush();
            }
        }
    });
    if progress {
        eprintln!();
    }
    summary.wall = start.elapsed();
    summary.failures.sort_by_key(|f| f.0);
    summary
}
