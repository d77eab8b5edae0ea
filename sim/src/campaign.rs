//! Campaigns: many seeds over worker threads (`--jobs`), a slice of them per machine (`--shard`),
//! a progress bar, and a summary with the throughput figures. Each seed's run is deterministic and
//! independent, so the workers share nothing but a counter, a results channel and, in a guided
//! campaign (`--corpus`), the corpus it branches from (`corpus`). A guided campaign with more
//! than one worker is not reproducible as a whole: which checkpoints it keeps and which it
//! branches from depend on the order its runs end (each run still replays from its recorded
//! decisions).

use crate::corpus::Corpus;
use crate::oracles::determinism;
use crate::probes::Coverage;
use crate::report::{Finding, OracleKind};
use crate::runner::{run, RunOptions, RunOutcome, RunStats};
use crate::scenario::{draw, Scenario};
use crate::schedule::{explore_policy, Kind, Policy, Source};
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tierkv_engine::trace::TraceRecord;

/// The most worker threads a campaign takes.
pub const JOBS_MAX: usize = 1024;

/// The most schedules a campaign explores per seed.
pub const SCHEDULES_MAX: u64 = 4096;

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
    /// Whether the engine runs one step ahead in every seed (`--overlap on|off`); `None`: as
    /// each scenario draws it (half the seeds; never under `pd`).
    pub overlap: Option<bool>,
    /// Hold every query row to the specification's logits (`--exhaustive`).
    pub exhaustive: bool,
    /// The corpus the campaign branches from and grows (`--corpus`; `corpus`), shared by its
    /// workers.
    pub corpus: Option<Arc<Mutex<Corpus>>>,
    /// Runs branched from the corpus before each fresh seed (`--branches`), at most
    /// [`BRANCHES_PER_SEED_MAX`].
    pub branches: u32,
    /// Cut each seed's workload to this many requests (`--requests-max`;
    /// [`Scenario::keep_requests`]).
    pub requests_max: Option<u32>,
    /// Cut this share of the seeds to a few requests (`--cut-share`;
    /// [`crate::scenario::drawn_cut`]).
    pub cut_share: Option<f64>,
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
        let cut = (self.requests_max).or_else(|| crate::scenario::drawn_cut(seed, self.cut_share?));
        if let Some(n) = cut {
            sc.keep_requests(n);
        }
        if let Some(on) = self.overlap {
            sc.overlap = on && sc.profile != "pd";
        }
        // A mutant of the overlap itself needs the engine ahead (`Scenario::validate` refuses
        // it otherwise, under `pd` too).
        let needs = self
            .mutant
            .as_deref()
            .and_then(tierkv_engine::mutants::Mutant::parse)
            .is_some_and(|m| m.needs_overlap());
        if needs && sc.profile != "pd" {
            sc.overlap = true;
        }
        sc
    }
}

/// One failing run of a campaign: its seed, the schedule it ran under and its first finding.
#[derive(Clone, Debug, PartialEq)]
pub struct CampaignFailure {
    pub seed: u64,
    /// Which schedule of the seed (0: the scenario's own; `--schedules`).
    pub schedule: u64,
    /// The policy that drew that schedule (`None`: the scenario's own).
    pub policy: Option<Policy>,
    pub finding: Finding,
    /// A branch's decisions, the only way to replay it (a corpus checkpoint's prefix and what
    /// the run drew after it; `--json` writes them as a schedule file); empty for a seed's own
    /// schedules, which replay from the seed.
    pub decisions: Vec<u8>,
}

#[derive(Clone, Debug, Default)]
pub struct CampaignSummary {
    pub seeds_run: u64,
    /// Every failing run, in seed order once the campaign ends.
    pub failures: Vec<CampaignFailure>,
    pub by_oracle: BTreeMap<OracleKind, u64>,
    /// The campaign's wall time, start to end.
    pub wall: Duration,
    /// Worker threads.
    pub jobs: usize,
    /// The workers' CPU time (each worker thread's own clock): every run, determinism reruns
    /// included. A worker waiting for a CPU does not count, so the busy share it gives is true
    /// on a loaded machine too.
    pub worker: Duration,
    pub totals: RunStats,
    /// The first failing seed in seed order, if any.
    pub first_failure: Option<u64>,
    pub coverage: Coverage,
    /// Seeds run twice for the determinism oracle.
    pub reruns: u64,
    /// Runs in all: seeds times the schedules each ran (a failing seed stops at its failure),
    /// and the branches from the corpus.
    pub runs: u64,
    /// Of those, the runs branched from the corpus (`--corpus`).
    pub branches: u64,
    /// The first failure's schedule: index, the policy that drew it (`None`: the scenario's
    /// own) and decisions (the schedule to replay it under).
    pub first_failure_schedule: Option<(u64, Option<Policy>, Vec<u8>)>,
    /// Each seed's event-log hash under its own schedule (schedule 0): what `campaign merge`
    /// compares when a seed ran on more than one machine.
    pub log_hashes: BTreeMap<u64, u64>,
    /// The signal that stopped the campaign early (see [`catch_interrupts`]): the summary then
    /// holds only the runs that ended before it.
    pub interrupted: Option<i32>,
    /// The workers' CPU time up to the first failing run's verdict: every run whose result
    /// reached the campaign before it, in full (its determinism rerun included: work the
    /// campaign did before the catch), and the failing run to its verdict (from drawing its
    /// scenario, or for schedules after the first from the run's start, to the end of the run
    /// that failed, or of its rerun when only the rerun failed; not what the command does after
    /// the campaign). Exact with one worker; with more, runs in flight on other workers are left
    /// out and runs that ended while the failing one was rerun may be counted. `None` when no
    /// run failed.
    pub cpu_to_first_failure: Option<Duration>,
    /// The CPU time of the runs counted so far, while no run has failed.
    pub(crate) cpu_before_failure: Duration,
}

/// The most runs a guided campaign branches from its corpus before each fresh seed.
pub const BRANCHES_PER_SEED_MAX: u32 = 64;

/// How a campaign's summary starts the line of [`CampaignSummary::cpu_to_first_failure`]
/// (`bench --catch` reads it).
pub const FIRST_FAILURE_AFTER: &str = "first failure after ";

impl CampaignSummary {
    /// Counts a run that ended, with its CPU time.
    fn add_timed(&mut self, o: &RunOutcome, t: RunCpu) {
        self.add(o);
        self.worker += t.total;
        if self.cpu_to_first_failure.is_none() {
            let failed = o.failed();
            self.cpu_before_failure += if failed { t.to_verdict } else { t.total };
            if failed {
                self.cpu_to_first_failure = Some(self.cpu_before_failure);
            }
        }
    }

    fn add(&mut self, o: &RunOutcome) {
        self.runs += 1;
        self.branches += crate::schedule::is_branch(o.schedule) as u64;
        self.seeds_run += (o.schedule == 0) as u64;
        self.reruns += o.rerun as u64;
        if o.schedule == 0 {
            self.log_hashes.insert(o.seed, o.log_hash);
        }
        self.coverage.add(&o.probes);
        self.totals.add(&o.stats);
        if let Some(f) = o.findings.first() {
            *self.by_oracle.entry(f.oracle).or_default() += 1;
            self.failures.push(CampaignFailure {
                seed: o.seed,
                schedule: o.schedule,
                policy: o.policy,
                finding: f.clone(),
                decisions: if crate::schedule::is_branch(o.schedule) {
                    o.decisions.clone()
                } else {
                    Vec::new()
                },
            });
            if self.first_failure.is_none_or(|x| o.seed < x) {
                self.first_failure = Some(o.seed);
                self.first_failure_schedule = Some((o.schedule, o.policy, o.decisions.clone()));
            }
        }
    }

    /// KV and index-K rows that ops read and the content oracle verified: compared, or known
    /// unchanged since they were compared.
    pub fn checked_reads(&self) -> u64 {
        self.totals.rows_checked + self.totals.rows_cached
    }

    pub fn print(&self, profile: &str) {
        println!("== tierkv sim summary (profile {profile})");
        if let Some(sig) = self.interrupted {
            println!(
                "INTERRUPTED by signal {sig}: the {} seeds that ended before it, not the whole campaign",
                self.seeds_run
            );
        }
        self.print_counts();
        if let Some(line) = self.first_failure_line() {
            println!("{line}");
        }
        self.print_throughput(self.wall.as_secs_f64(), None);
        self.print_checks();
    }

    /// The line that gives [`CampaignSummary::cpu_to_first_failure`], if a run failed.
    pub fn first_failure_line(&self) -> Option<String> {
        let cpu = self.cpu_to_first_failure?;
        Some(format!(
            "{FIRST_FAILURE_AFTER}{:.3} CPU-seconds of runs (the workers' time: each run counted before the failing one in full, the failing one to its verdict{})",
            cpu.as_secs_f64(),
            if self.jobs > 1 {
                "; with several workers, in the order results arrived: approximate"
            } else {
                ""
            }
        ))
    }

    /// Seeds, failures by oracle, and what was checked.
    pub fn print_counts(&self) {
        let t = &self.totals;
        println!(
            "seeds run: {}{}   failures: {}{}",
            self.seeds_run,
            if self.branches > 0 {
                format!(
                    " ({} runs: schedules explored, {} branches from the corpus)",
                    self.runs, self.branches
                )
            } else if self.runs > self.seeds_run {
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
            "checked: {} requests finished, {} digests held to the specification's ({} queries held to the specification's logits), {} KV/index-K rows compared (+{} unchanged since compared), {} cache decisions held to the policy model, {} ops, {} loads, {} backups, {} failed copies, {} failed launches ({} steps run again), {} aborts",
            t.finished, t.digests_checked, t.queries_recomputed, t.rows_checked, t.rows_cached, t.policy_judged, t.ops, t.loads, t.backups, t.failed_copies, t.failed_kernels, t.steps_failed, t.aborted
        );
    }

    /// Work per wall second, and the workers' CPU time beside it. `wall_s`: the campaign's wall
    /// time. For merged shards, `shards` names their count and the worker time they held (each
    /// shard's wall times its workers): `wall_s` is then the longest shard's, the campaign's wall
    /// time when the shards ran at the same time, and the busy share is of the time they held.
    pub fn print_throughput(&self, wall_s: f64, shards: Option<(usize, f64)>) {
        let t = &self.totals;
        let wall = wall_s.max(1e-9);
        let worker_s = self.worker.as_secs_f64();
        match shards {
            Some((n, held_s)) => println!(
                "wall time: {wall_s:.1} s (the longest of {n} shards: the campaign's wall time if they ran at the same time); {worker_s:.1} CPU-seconds of work, {:.0}% of the {held_s:.1} worker-seconds the shards held ({} workers in all)",
                100.0 * worker_s / held_s.max(1e-9),
                self.jobs
            ),
            None => println!(
                "wall time: {wall_s:.1} s ({} worker{}; {worker_s:.1} CPU-seconds of work, {:.0}% of the workers' time on a CPU)",
                self.jobs,
                if self.jobs == 1 { "" } else { "s" },
                100.0 * worker_s / (wall * self.jobs.max(1) as f64)
            ),
        }
        println!(
            "throughput{}: {:.2} seeds/s, {:.0} ops/s, {:.0} checked reads/s, {:.1} MB copied/s; per CPU-second: {:.0} checked reads",
            if shards.is_some() {
                " (over the longest shard's wall time)"
            } else {
                ""
            },
            self.seeds_run as f64 / wall,
            t.ops as f64 / wall,
            self.checked_reads() as f64 / wall,
            t.copy_bytes as f64 / wall / 1e6,
            self.checked_reads() as f64 / worker_s.max(1e-9),
        );
        println!(
            "virtual GPU time: {:.3} s simulated ({:.3} s per wall second)",
            t.sim_ns as f64 * 1e-9,
            t.sim_ns as f64 * 1e-9 / wall
        );
    }

    /// Determinism reruns, failing seeds and the coverage lines (probes, then targets).
    pub fn print_checks(&self) {
        let names = self.coverage.names();
        let never = self.coverage.below(f64::MIN_POSITIVE);
        let rare = self.coverage.below(0.05);
        println!(
            "determinism: {} seed{} run twice (1 in {} and every failing seed), hashes compared",
            self.reruns,
            if self.reruns == 1 { "" } else { "s" },
            determinism::SAMPLE_EVERY
        );
        if self.failures.len() > 1 {
            let seeds: Vec<String> = self.failures.iter().map(|f| f.seed.to_string()).collect();
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
        println!(
            "{}",
            crate::targets::summary(&self.coverage.probes, self.coverage.seeds)
        );
    }
}

/// Runs a campaign; `on_done` sees every outcome (in completion order).
/// Campaigns of at most this many seeds run longest first ([`run_order`]); larger ones run in
/// seed order (drawing every scenario first would take seconds: about 30 µs a seed).
pub const ORDERED_SEEDS_MAX: u64 = 200_000;

/// The order a campaign's workers take its seeds in, or `None` for seed order: one worker, more
/// than [`ORDERED_SEEDS_MAX`] seeds, or a planted mutant (the zoo counts the seeds to its first
/// catch, and a campaign that stops at the first failure then reports the lowest failing seed).
/// Otherwise the scenarios that predict the most work come first ([`Scenario::work_estimate`];
/// ties by seed), so that a campaign does not end on one worker running a heavy seed alone
/// while the others idle. A seed's outcome depends on the seed alone, so the order changes no
/// result, only when each arrives.
/// Campaigns ordered by predicted work with more seeds than this say so before they start (it
/// takes a while).
const ORDERING_NOTICE_SEEDS: u64 = 20_000;

pub fn run_order(opts: &CampaignOptions, seeds: &SeedSet) -> Option<Vec<u64>> {
    ordered_work(opts, seeds).map(|o| o.into_iter().map(|(seed, _)| seed).collect())
}

/// [`run_order`]'s seeds, each with its predicted work.
fn ordered_work(opts: &CampaignOptions, seeds: &SeedSet) -> Option<Vec<(u64, u64)>> {
    if opts.jobs <= 1 || opts.mutant.is_some() || seeds.len() > ORDERED_SEEDS_MAX {
        return None;
    }
    let mut work: Vec<(u64, u64)> = Vec::with_capacity(seeds.len() as usize);
    for seed in seeds.iter() {
        // Drawing 200,000 scenarios takes minutes: a signal meanwhile leaves them unordered
        // (the campaign then returns at once).
        if interrupted().is_some() {
            return None;
        }
        work.push((seed, opts.scenario(seed).work_estimate()));
    }
    work.sort_by_key(|&(seed, w)| (std::cmp::Reverse(w), seed));
    Some(work)
}

/// A signal that asked the process to stop (SIGINT, SIGTERM): its number, 0 while none came.
static INTERRUPT: AtomicI32 = AtomicI32::new(0);

/// Makes SIGINT and SIGTERM stop a running campaign instead of the process: the campaign hands
/// out no more seeds and returns within [`POLL_INTERVAL`] with the runs that ended
/// ([`CampaignSummary::interrupted`]), so that the caller can print and write what finished. A
/// second signal of the same kind ends the process as usual; so does any signal after
/// [`release_interrupts`]. (Unix; elsewhere a no-op.)
pub fn catch_interrupts() {
    #[cfg(unix)]
    {
        extern "C" fn on_signal(sig: libc::c_int) {
            INTERRUPT.store(sig, Ordering::SeqCst);
            // SAFETY: `signal` is async-signal-safe; the next signal of this kind kills.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        for sig in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: installs a handler that only stores to an atomic and resets itself.
            unsafe {
                libc::signal(
                    sig,
                    on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
                );
            }
        }
    }
}

/// Gives SIGINT and SIGTERM back their default action (the process ends), once what a campaign
/// finished is safe. A signal caught before stays in [`interrupted`].
pub fn release_interrupts() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: restores a signal's default disposition.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
        }
    }
}

/// The signal that interrupted this process's campaign, if one came.
pub fn interrupted() -> Option<i32> {
    match INTERRUPT.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// What the workers of one campaign share: the options, the seeds and their order, the next
/// seed to hand out, and whether to stop handing them out.
struct Shared {
    opts: CampaignOptions,
    seeds: SeedSet,
    order: Option<Vec<u64>>,
    next: AtomicU64,
    /// Runs branched from the corpus so far.
    branched: AtomicU64,
    stop: AtomicBool,
    /// Opened once every worker is started (or one could not be): no seed runs before, so a
    /// campaign refused for its `--jobs` has run nothing.
    gate: (Mutex<bool>, Condvar),
}

impl Shared {
    fn new(opts: &CampaignOptions, seeds: SeedSet, order: Option<Vec<u64>>) -> Arc<Shared> {
        Arc::new(Shared {
            opts: opts.clone(),
            seeds,
            order,
            next: AtomicU64::new(0),
            branched: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            gate: (Mutex::new(false), Condvar::new()),
        })
    }

    fn open_gate(&self) {
        *self.gate.0.lock().expect("the gate's lock") = true;
        self.gate.1.notify_all();
    }

    /// The next seed a worker takes, `None` once none is left or the campaign stops.
    fn next_seed(&self) -> Option<u64> {
        if self.stop.load(Ordering::Relaxed) {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        match &self.order {
            Some(order) => order.get(i as usize).copied(),
            None => self.seeds.nth(i),
        }
    }
}

/// One worker: takes seeds until none is left or the campaign stops, runs each (and its other
/// schedules) and sends every outcome with the CPU time it took on this thread.
fn worker(sh: &Shared, tx: mpsc::Sender<(RunOutcome, RunCpu)>) {
    let opts = &sh.opts;
    drop(
        sh.gate
            .1
            .wait_while(sh.gate.0.lock().expect("the gate's lock"), |open| !*open)
            .expect("the gate's lock"),
    );
    while let Some(seed) = sh.next_seed() {
        if !branches(sh, &tx) {
            return;
        }
        let began = thread_cpu();
        let sc = opts.scenario(seed);
        let ropts = RunOptions {
            cuda: opts.cuda,
            exhaustive: opts.exhaustive,
            ..RunOptions::default()
        };
        let mut out = run(&sc, &ropts);
        let mut to_verdict = thread_cpu().saturating_sub(began);
        observe(opts, &out, sc.gpu.schedule_policy());
        if determinism::sampled(seed, out.failed()) {
            let first_failed = out.failed();
            out.rerun = true;
            out.findings
                .extend(determinism::rerun(&sc, &ropts, out.log_hash));
            if !first_failed {
                to_verdict = thread_cpu().saturating_sub(began); // only the rerun failed
            }
        }
        // More schedules of the same scenario, PCT over schedule 0's op starts.
        let ops = out.decision_counts.made[Kind::Hold as usize];
        let mut failed = out.failed();
        let total = thread_cpu().saturating_sub(began);
        if tx.send((out, RunCpu { total, to_verdict })).is_err() {
            return;
        }
        for index in 1..opts.schedules {
            if failed || sh.stop.load(Ordering::Relaxed) {
                break;
            }
            let policy = explore_policy(index, sc.gpu.schedule_policy(), ops);
            let source = Source::Draw { index, policy };
            match run_schedule(opts, &sc, (source, index, policy), &tx) {
                Some(f) => failed = f,
                None => return,
            }
        }
    }
}

/// Runs `sc` under one schedule other than its own (`source`, sent as schedule `index` drawn
/// by `policy`), counts it into the corpus and sends it; a failing run is run again from its
/// recorded decisions (the same schedule, the same log). Whether it failed; `None` when the
/// campaign's receiver has gone.
fn run_schedule(
    opts: &CampaignOptions,
    sc: &Scenario,
    (source, index, policy): (Source, u64, Policy),
    tx: &mpsc::Sender<(RunOutcome, RunCpu)>,
) -> Option<bool> {
    let ropts = RunOptions {
        cuda: opts.cuda,
        exhaustive: opts.exhaustive,
        schedule: Some(source),
        ..RunOptions::default()
    };
    let began = thread_cpu();
    let mut out = run(sc, &ropts);
    let to_verdict = thread_cpu().saturating_sub(began);
    observe(opts, &out, policy);
    out.schedule = index;
    out.policy = Some(policy);
    let failed = out.failed();
    if failed {
        out.rerun = true;
        let again = RunOptions {
            schedule: Some(Source::Replay(out.decisions.clone())),
            ..ropts
        };
        out.findings
            .extend(determinism::rerun(sc, &again, out.log_hash));
    }
    let total = thread_cpu().saturating_sub(began);
    tx.send((out, RunCpu { total, to_verdict })).ok()?;
    Some(failed)
}

/// The runs a worker branches from the corpus before its next fresh seed (`--branches`; none
/// while the corpus is empty), each schedule `schedule::branch_index(n)` of its checkpoint's seed,
/// its `n` the campaign's count of branches. `false` when the campaign stopped or its receiver
/// has gone.
fn branches(sh: &Shared, tx: &mpsc::Sender<(RunOutcome, RunCpu)>) -> bool {
    let opts = &sh.opts;
    for _ in 0..opts.branches {
        if sh.stop.load(Ordering::Relaxed) {
            return false;
        }
        let picked = opts.corpus.as_ref().and_then(|c| lock(c).pick());
        let Some(cp) = picked else { break };
        let index = crate::schedule::branch_index(sh.branched.fetch_add(1, Ordering::Relaxed));
        let source = Source::Branch {
            prefix: cp.prefix,
            index,
            policy: cp.policy,
        };
        let sc = opts.scenario(cp.seed);
        if run_schedule(opts, &sc, (source, index, cp.policy), tx).is_none() {
            return false;
        }
    }
    true
}

/// The corpus's lock, taken even when poisoned: a worker panics under it only on a broken
/// invariant (which its panic reports), and leaves at most that one run counted in part.
fn lock(c: &Mutex<Corpus>) -> std::sync::MutexGuard<'_, Corpus> {
    c.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Counts a run into the campaign's corpus, if it has one (`Corpus::observe`).
fn observe(opts: &CampaignOptions, out: &RunOutcome, policy: Policy) {
    if let Some(c) = &opts.corpus {
        lock(c).observe(
            out.seed,
            policy,
            &out.decisions,
            &out.probes,
            &out.first_hits,
            out.failed(),
        );
    }
}

/// A run's CPU time on its worker thread: in all (with its determinism rerun), and up to its
/// verdict (to the end of its first run, or of its rerun when only the rerun failed).
#[derive(Clone, Copy, Debug)]
struct RunCpu {
    total: Duration,
    to_verdict: Duration,
}

/// This thread's CPU time so far (`CLOCK_THREAD_CPUTIME_ID`; elsewhere than Unix, zero).
fn thread_cpu() -> Duration {
    #[cfg(unix)]
    {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec into `t`.
        let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0;
        assert!(ok, "CLOCK_THREAD_CPUTIME_ID is always there on Linux");
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }
    #[cfg(not(unix))]
    Duration::ZERO
}

/// Each worker thread's stack, in bytes: named, so that whether `--jobs` threads fit a memory
/// limit does not depend on `RUST_MIN_STACK`.
pub const WORKER_STACK_BYTES: usize = 2 << 20;

/// Starts `jobs` workers held at the gate; if the operating system refuses one, stops and
/// joins those started and answers why (none has run a seed).
fn start_workers(
    shared: &Arc<Shared>,
    tx: &mpsc::Sender<(RunOutcome, RunCpu)>,
    jobs: usize,
) -> Result<Vec<std::thread::JoinHandle<()>>, CampaignError> {
    if let Some(limit) = address_space_limit() {
        let need = (jobs as u64).saturating_mul(WORKER_STACK_BYTES as u64);
        if need > limit / 2 {
            return Err(CampaignError::AddressSpace { jobs, need, limit });
        }
    }
    let mut workers = Vec::with_capacity(jobs);
    for n in 0..jobs {
        let (sh, tx) = (Arc::clone(shared), tx.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("tierkv-worker-{n}"))
            .stack_size(WORKER_STACK_BYTES)
            .spawn(move || worker(&sh, tx));
        match spawned {
            Ok(w) => workers.push(w),
            Err(source) => {
                shared.stop.store(true, Ordering::Relaxed);
                shared.open_gate();
                for w in workers {
                    if let Err(panic) = w.join() {
                        std::panic::resume_unwind(panic);
                    }
                }
                return Err(CampaignError::Spawn {
                    started: n,
                    jobs,
                    source,
                });
            }
        }
    }
    Ok(workers)
}

/// The address-space limit (`ulimit -v`) in bytes, when one is set.
pub(crate) fn address_space_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into `r`.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut r) } == 0;
        (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
    }
    #[cfg(not(unix))]
    None
}

/// How often the campaign's main thread looks for an interrupt and a due progress line while
/// no run ends.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Why a campaign could not run.
#[derive(Debug, thiserror::Error)]
pub enum CampaignError {
    /// The operating system refused a worker thread (its stack, `WORKER_STACK_BYTES`, could
    /// not be had: too many `--jobs` for the memory or thread limit). The workers already
    /// started were stopped before any ran a seed of the campaign.
    #[error(
        "started {started} of {jobs} worker threads, and the system refused the next ({source}); \
         run with fewer --jobs"
    )]
    Spawn {
        started: usize,
        jobs: usize,
        source: std::io::Error,
    },
    /// The workers' stacks alone would take more than half of the address-space limit: refused
    /// before any worker starts (past it, the threads' stacks and their allocators' arenas leave
    /// the process no room, and an allocation aborts it where a refused thread would not).
    #[error(
        "{jobs} worker threads' stacks ({need} B) would take more than half of the address-space \
         limit (ulimit -v: {limit} B); run with fewer --jobs"
    )]
    AddressSpace { jobs: usize, need: u64, limit: u64 },
}

/// Runs the campaign `opts` describes on `opts.jobs` worker threads, calling `on_done` with
/// each run as it ends.
pub fn run_campaign(
    opts: &CampaignOptions,
    mut on_done: impl FnMut(&RunOutcome),
) -> Result<CampaignSummary, CampaignError> {
    let seeds = opts.seeds();
    let total = seeds.len();
    let mut progress = Progress::new(opts.progress, total);
    let big = seeds.len() > ORDERING_NOTICE_SEEDS && seeds.len() <= ORDERED_SEEDS_MAX;
    if opts.progress && big && opts.jobs > 1 && opts.mutant.is_none() {
        eprintln!(
            "ordering {} seeds by predicted work (each scenario is drawn first)...",
            seeds.len()
        );
    }
    let ordered = ordered_work(opts, &seeds);
    // Each seed's predicted work, for the time left: the heaviest seeds run first, so the
    // rate of the first seeds says little about the rest.
    progress.set_work(ordered.as_ref().map(|o| o.iter().copied().collect()));
    let order = ordered.map(|o| o.into_iter().map(|(seed, _)| seed).collect());
    let start = Instant::now();
    let mut summary = CampaignSummary {
        jobs: opts.jobs.max(1),
        ..CampaignSummary::default()
    };
    summary.coverage.pd = opts.profile == "pd";
    let shared = Shared::new(opts, seeds, order);
    let (tx, rx) = mpsc::channel::<(RunOutcome, RunCpu)>();
    let jobs = (opts.jobs.max(1) as u64).min(total.max(1)) as usize;
    let workers = start_workers(&shared, &tx, jobs)?;
    shared.open_gate();
    drop(tx);
    loop {
        match rx.recv_timeout(POLL_INTERVAL) {
            Ok((out, took)) => {
                summary.add_timed(&out, took);
                if out.failed() && opts.stop_at_first {
                    shared.stop.store(true, Ordering::Relaxed);
                }
                progress.done(out.seed, out.schedule);
                progress.suspend(|| on_done(&out));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let Some(sig) = interrupted() {
            // Return now with what ended: a run in flight may take minutes, and a cluster's
            // grace period after SIGTERM is short. The workers stop at their next seed. Runs
            // that ended and wait in the channel count.
            shared.stop.store(true, Ordering::Relaxed);
            for (out, took) in rx.try_iter() {
                summary.add_timed(&out, took);
                progress.done(out.seed, out.schedule);
                progress.suspend(|| on_done(&out));
            }
            summary.interrupted = Some(sig);
            break;
        }
        progress.update(&summary, start);
    }
    if summary.interrupted.is_none() {
        for w in workers {
            if let Err(panic) = w.join() {
                std::panic::resume_unwind(panic);
            }
        }
    }
    progress.finish(&summary, start);
    summary.wall = start.elapsed();
    summary.failures.sort_by_key(|f| (f.seed, f.schedule));
    Ok(summary)
}

/// A campaign's progress on stderr: a bar on a terminal; elsewhere (a CI log, a file) a plain
/// line every `PROGRESS_EVERY`, whether or not a seed ended, and one at the end, never a redrawn
/// line. The time left is extrapolated from the predicted work of the seeds done and left
/// (`Scenario::work_estimate`) when the campaign is ordered by it, else from the seeds.
struct Progress {
    mode: Mode,
    total: u64,
    /// Each seed's predicted work (an ordered campaign), the sum, and the sum of those done.
    work: Option<BTreeMap<u64, u64>>,
    work_total: u64,
    work_done: u64,
}

enum Mode {
    Off,
    Bar(ProgressBar),
    /// The last line's time, and the seeds it reported (not printed twice).
    Lines {
        last: Instant,
        printed: Option<u64>,
    },
}

/// How often a plain progress line is printed: a campaign's, a single run's, a replay's.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(30);

impl Progress {
    fn new(on: bool, total: u64) -> Progress {
        let mode = if !on {
            Mode::Off
        } else if !std::io::stderr().is_terminal() {
            Mode::Lines {
                last: Instant::now(),
                printed: None,
            }
        } else {
            let bar = ProgressBar::new(total);
            let style = ProgressStyle::with_template(
                "[{elapsed_precise}] {bar:30} {pos}/{len} seeds, {msg}",
            )
            .expect("a valid progress template");
            bar.set_style(style);
            bar.set_message("0 failures");
            Mode::Bar(bar)
        };
        Progress {
            mode,
            total,
            work: None,
            work_total: 0,
            work_done: 0,
        }
    }

    fn set_work(&mut self, work: Option<BTreeMap<u64, u64>>) {
        self.work_total = work.as_ref().map_or(0, |w| w.values().sum());
        self.work = work;
    }

    /// A run ended (its seed's work counts once, with its first schedule).
    fn done(&mut self, seed: u64, schedule: u64) {
        if schedule == 0 {
            self.work_done += self
                .work
                .as_ref()
                .and_then(|w| w.get(&seed))
                .copied()
                .unwrap_or(0);
        }
    }

    /// The share of the campaign done: by predicted work when known, else by seeds.
    fn fraction(&self, s: &CampaignSummary) -> f64 {
        if self.work.is_some() && self.work_total > 0 {
            self.work_done as f64 / self.work_total as f64
        } else {
            s.seeds_run as f64 / self.total.max(1) as f64
        }
    }

    /// Runs `f` (which may print) with the bar out of the way.
    fn suspend(&self, f: impl FnOnce()) {
        match &self.mode {
            Mode::Bar(bar) => bar.suspend(f),
            _ => f(),
        }
    }

    fn update(&mut self, s: &CampaignSummary, start: Instant) {
        let fraction = self.fraction(s);
        let total = self.total;
        match &mut self.mode {
            Mode::Off => {}
            Mode::Bar(bar) => {
                bar.set_position(s.seeds_run);
                bar.set_message(format!(
                    "{} failures, {:.1} seeds/s, {}",
                    s.failures.len(),
                    s.seeds_run as f64 / start.elapsed().as_secs_f64().max(1e-9),
                    time_left(s.seeds_run, total, fraction, start)
                ));
            }
            Mode::Lines { last, printed } => {
                if last.elapsed() >= PROGRESS_EVERY {
                    *last = Instant::now();
                    *printed = Some(s.seeds_run);
                    eprintln!("{}", progress_line(s, total, fraction, start));
                }
            }
        }
    }

    fn finish(&mut self, s: &CampaignSummary, start: Instant) {
        let fraction = self.fraction(s);
        match &self.mode {
            Mode::Off => {}
            Mode::Bar(bar) => bar.finish_and_clear(),
            Mode::Lines { printed, .. } => {
                if *printed != Some(s.seeds_run) {
                    eprintln!("{}", progress_line(s, self.total, fraction, start));
                }
            }
        }
    }
}

/// `about 31 s left`, from the share of the campaign done so far.
fn time_left(seeds_run: u64, total: u64, fraction: f64, start: Instant) -> String {
    if seeds_run >= total {
        "done".to_string()
    } else if seeds_run == 0 || fraction <= 0.0 {
        "time left unknown".to_string()
    } else {
        let elapsed = start.elapsed().as_secs_f64();
        format!(
            "about {} left",
            duration(elapsed * (1.0 - fraction).max(0.0) / fraction)
        )
    }
}

/// `progress: 120/150 seeds (80%), 0 failures, 1.0 seeds/s, 2 min 3 s elapsed, about 31 s left`.
fn progress_line(s: &CampaignSummary, total: u64, fraction: f64, start: Instant) -> String {
    let elapsed = start.elapsed().as_secs_f64();
    let rate = s.seeds_run as f64 / elapsed.max(1e-9);
    format!(
        "progress: {}/{total} seeds ({:.0}%), {} failures, {rate:.1} seeds/s, {} elapsed, {}",
        s.seeds_run,
        100.0 * s.seeds_run as f64 / total.max(1) as f64,
        s.failures.len(),
        duration(elapsed),
        time_left(s.seeds_run, total, fraction, start)
    )
}

/// `45 s`, `2 min 3 s`, `1 h 4 min`.
fn duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(jobs: usize, first: u64, end: u64, shard: Option<(u64, u64)>) -> CampaignOptions {
        CampaignOptions {
            first,
            end,
            jobs,
            shard,
            profile: "swarm".into(),
            mutant: None,
            progress: false,
            stop_at_first: false,
            trace_records: None,
            cuda: false,
            schedules: 1,
            overlap: None,
            exhaustive: false,
            corpus: None,
            branches: 0,
            requests_max: None,
            cut_share: None,
        }
    }

    /// Several workers take every seed of the set once, the heaviest estimates first; one worker,
    /// a planted mutant or a set too large to draw up front takes them in seed order.
    #[test]
    fn workers_take_the_heaviest_seeds_first() {
        let opts = options(4, 0, 90, Some((1, 3)));
        let seeds = opts.seeds();
        let order = run_order(&opts, &seeds).expect("4 workers, 30 seeds: ordered");
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, seeds.iter().collect::<Vec<_>>());
        let work: Vec<u64> = order
            .iter()
            .map(|&s| opts.scenario(s).work_estimate())
            .collect();
        assert!(work.windows(2).all(|w| w[0] >= w[1]), "{work:?}");
        assert!(
            work[0] > work[work.len() - 1],
            "the estimates tell seeds apart"
        );
        assert_eq!(run_order(&options(1, 0, 90, None), &seeds), None);
        let mutant = CampaignOptions {
            mutant: Some("topk-hardcoded-512".into()),
            ..options(4, 0, 90, None)
        };
        assert_eq!(run_order(&mutant, &mutant.seeds()), None);
        let huge = options(4, 0, u64::MAX, None);
        assert_eq!(run_order(&huge, &huge.seeds()), None);
    }
}
