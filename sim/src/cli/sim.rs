//! `tierkv sim`: one seed, a campaign of seeds, or a saved scenario.
//!
//! Every argument is checked before anything runs: a bad one is a usage error (exit code 2) that
//! names it. A run with findings exits 1; a clean one 0.

use super::error::{CliError, ScenarioFileError};
use crate::campaign::{run_campaign, CampaignOptions, SeedSet};
use crate::corpus::Corpus;
use crate::probes::SimProbe;
use crate::report::Finding;
use crate::runner::{mutants_of, run, RunOptions, RunOutcome};
use crate::scenario::{Scenario, PROFILES};
use crate::schedule::{explore_policy, Kind, Policy, Schedule, Source};
use crate::shard::ShardResult;
use crate::shrink::{shrink, shrink_schedule, shrink_under, Budget};
use crate::trace_out::chrome_trace;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tierkv_engine::probe::Probe;
use tierkv_engine::trace::TraceRecord;

pub use crate::campaign::{JOBS_MAX, SCHEDULES_MAX};

/// Seeds a campaign runs when `--seeds` is not given: about three minutes on two cores.
pub const DEFAULT_SEEDS: u64 = 150;

#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Run one seed and describe it.
    #[arg(long, conflicts_with_all = ["seeds", "replay"])]
    pub seed: Option<u64>,
    /// A range of seeds, `A..B` (B excluded). Default: 0..150.
    #[arg(long, value_parser = parse_range)]
    pub seeds: Option<(u64, u64)>,
    /// Worker threads, 1..=1024 (default: the machine's cores). A campaign's: not with
    /// `--seed` or `--replay`, which run on this thread.
    #[arg(long, conflicts_with_all = ["seed", "replay"])]
    pub jobs: Option<usize>,
    /// Run only shard I of N (`I/N`): seeds with seed % N == I.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<(u64, u64)>,
    /// Scenario profile: swarm (default), sessions (60+ concurrent tool-call sessions), needle,
    /// trace (a Mooncake trace replayed by timestamp), quick, production (DeepSeek-V3.2's shapes:
    /// 64 indexer heads, top-2048, 16K-128K contexts, one or two of its 61 layers), pd (a
    /// prefill/decode pair on two simulated GPUs joined by a KV link), vllm (the host tier of
    /// vLLM's offloading interface driven by a seeded vLLM-like server, or by a recorded call
    /// file with --calls; takes --seed, --seeds, --calls and --mutant
    /// store-without-event|load-without-event only).
    #[arg(long, default_value = "swarm")]
    pub profile: String,
    /// With `--profile vllm`: replay this recording of vLLM's calls (`record_calls` of
    /// `tierkv.vllm`, JSON lines) instead of drawing a server, each seed its own schedule and
    /// driver faults.
    #[arg(long)]
    pub calls: Option<PathBuf>,
    /// Write the Chrome/Perfetto trace of the run (one seed; with `--schedules`, of the last
    /// schedule run) or of the first failure here.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Switch on a bug-zoo mutant (in the `tierkv-zoo` binary, built with `--features mutants`;
    /// with `--profile vllm`, store-without-event or load-without-event, in any build).
    #[arg(long)]
    pub mutant: Option<String>,
    /// `on`: the engine runs one step ahead in every drawn seed (overlap scheduling: step n+1 is
    /// enqueued before the host waits for step n); `off`: in none. Default: as each scenario
    /// draws it (half the seeds; never under `pd`). Mutants of the overlap (zoo 18, 28) need it on.
    #[arg(long, value_parser = ["on", "off"], conflicts_with = "replay")]
    pub overlap: Option<String>,
    /// Cut each seed's drawn workload to N requests (its sessions and one-shots in the order
    /// they start, a session with its first turns), every other draw of the seed kept (a
    /// smaller, cheaper run of the same configuration, faults and schedule policy).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "replay")]
    pub requests_max: Option<u32>,
    /// Cut a share of the seeds (0 to 1; which ones, drawn from each seed) to 1 to 8
    /// requests, the others whole: a swarm over workload sizes too. A failure's replay command
    /// names its seed's cut.
    #[arg(long, value_parser = cut_share, conflicts_with_all = ["replay", "requests_max"])]
    pub cut_share: Option<f64>,
    /// Replay a saved scenario (e.g. a shrunk reproduction). `--mutant` replaces the file's.
    #[arg(long, conflicts_with_all = ["seeds", "shard", "profile", "jobs", "mooncake"])]
    pub replay: Option<PathBuf>,
    /// With `--seed`: also write the drawn scenario here (JSON), to edit and `--replay`.
    #[arg(long, requires = "seed")]
    pub save_scenario: Option<PathBuf>,
    /// The Mooncake trace for `--profile trace` (default: the built-in excerpt of the Mooncake
    /// conversation trace, `data/mooncake/`).
    #[arg(long)]
    pub mooncake: Option<PathBuf>,
    /// Do not shrink failures.
    #[arg(long)]
    pub no_shrink: bool,
    /// Wall-time budget for shrinking one failure, seconds.
    #[arg(long, default_value_t = 60, conflicts_with = "no_shrink")]
    pub shrink_secs: u64,
    /// Budget shrinking by runs instead of wall time (`--shrink-secs` is then unused), so that
    /// the shrunk case depends on the input alone, however loaded the machine is.
    #[arg(long, conflicts_with_all = ["shrink_secs", "no_shrink"])]
    pub shrink_runs: Option<u32>,
    /// Schedules to run per seed, 1..=4096: the scenario's own, then PCT of depth 1, 2 and 3 and
    /// a random walk in turn (PCT's change points spread over the first schedule's op starts).
    #[arg(long, default_value_t = 1)]
    pub schedules: u64,
    /// Replay a recorded schedule (the JSON a failure writes) on `--seed` or `--replay`.
    #[arg(long, conflicts_with_all = ["seeds", "shard", "schedules"])]
    pub schedule: Option<PathBuf>,
    /// Run the seed (or a campaign's first seed) twice and compare event-log hashes.
    #[arg(long)]
    pub check_determinism: bool,
    /// Hold every query row to the specification's logits and top-k, not a sampled one in four
    /// (slower; the digest of every query is checked either way).
    #[arg(long)]
    pub exhaustive: bool,
    /// Keep going after the first failure (a campaign's: not with `--seed` or `--replay`).
    #[arg(long, conflicts_with_all = ["seed", "replay"])]
    pub keep_going: bool,
    /// Print every seed's drawn configuration and outcome as the campaign goes (not with
    /// `--seed` or `--replay`, which print their one run's anyway).
    #[arg(long, conflicts_with_all = ["seed", "replay"])]
    pub verbose: bool,
    /// Print the coverage table: each probe's hits and the share of seeds that hit it; then
    /// the coverage targets' (watermark levels, happens-before pairs, combinations).
    #[arg(long)]
    pub coverage: bool,
    /// Where the ops run: `cpu` (the kernels' CPU references) or `cuda` (a real GPU; needs
    /// `--features cuda`). The schedules are the same.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Where failure artifacts (traces, shrunk scenarios, schedules) go.
    #[arg(long, default_value = "target/tierkv")]
    pub out_dir: PathBuf,
    /// Also write the campaign's result here as JSON (seeds, failures with replay commands,
    /// coverage, throughput, build id): one shard's result, for `tierkv campaign merge`.
    #[arg(long, conflicts_with_all = ["seed", "replay"])]
    pub json: Option<PathBuf>,
    /// A guided campaign: branch from the checkpoints of this corpus file (a new one when it does
    /// not exist), keep the checkpoints of rare probes the campaign reaches, and write the corpus
    /// back when it ends. `tierkv campaign merge-corpus` combines corpus files; with `--json`,
    /// the shard's result counts the branches, and a failing branch's replay line names the
    /// schedule file it writes to `--out-dir`.
    #[arg(long, conflicts_with_all = ["seed", "replay"])]
    pub corpus: Option<PathBuf>,
    /// With `--corpus`: how many runs branch from the corpus before each fresh seed.
    #[arg(
        long,
        default_value_t = 1,
        requires = "corpus",
        value_parser = clap::value_parser!(u32).range(0..=crate::campaign::BRANCHES_PER_SEED_MAX as i64)
    )]
    pub branches: u32,
}

pub(crate) fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("`{s}` is not a range A..B"))?;
    let a: u64 = a.parse().map_err(|_| format!("`{a}` is not a seed"))?;
    let b: u64 = b.parse().map_err(|_| format!("`{b}` is not a seed"))?;
    if b <= a {
        return Err(format!("empty range {a}..{b}"));
    }
    Ok((a, b))
}

fn parse_shard(s: &str) -> Result<(u64, u64), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}` is not a shard I/N"))?;
    let i: u64 = i
        .parse()
        .map_err(|_| format!("`{i}` is not a shard index"))?;
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{n}` is not a shard count"))?;
    if n == 0 || i >= n {
        return Err(format!("shard {i}/{n}: need 0 <= I < N"));
    }
    Ok((i, n))
}

/// Where a run's scenario came from: it decides the replay command and whether to shrink.
#[derive(Clone, Debug)]
enum Origin {
    Seed,
    File(PathBuf),
}

/// `--cut-share`'s value: a share in [0, 1].
fn cut_share(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("{v:?} is not a share: give a number from 0 to 1")),
    }
}

/// The one-line command that replays `sc`'s seed (with `--overlap` when the scenario's engine
/// mode is not the one its seed draws, and `--requests-max` when its workload was cut).
pub fn replay_command(sc: &Scenario) -> String {
    let drawn = crate::scenario::draws_overlap(sc.seed, &sc.profile);
    format!(
        "cargo run --release -p tierkv-sim{} -- sim --seed {} --profile {}{}{}{}",
        features(sc),
        sc.seed,
        sc.profile,
        sc.mutant
            .as_ref()
            .map(|m| format!(" --mutant {m}"))
            .unwrap_or_default(),
        match (sc.overlap, drawn) {
            (true, false) => " --overlap on",
            (false, true) => " --overlap off",
            _ => "",
        },
        match sc.requests_max {
            0 => String::new(),
            n => format!(" --requests-max {n}"),
        }
    )
}

/// The command that replays a campaign's failing run: its seed, and the schedules up to the one
/// that failed (schedule `k` of a seed is drawn the same way each time).
pub fn failure_replay(sc: &Scenario, schedule: u64) -> String {
    let mut cmd = replay_command(sc);
    if crate::schedule::is_branch(schedule) {
        // A branch's decisions depend on the corpus it was taken from: only its recorded
        // schedule replays it.
        cmd += " --schedule FILE (a branch from the corpus, not replayable from its seed: \
                the report of a campaign's first failure writes FILE)";
    } else if schedule > 0 {
        cmd += &format!(" --schedules {}", schedule + 1);
    }
    cmd
}

/// The one-line command that replays `sc` from `file` (with its mutant, which may not be the
/// file's own when `--mutant` replaced it).
pub fn replay_file_command(sc: &Scenario, file: &Path) -> String {
    format!(
        "cargo run --release -p tierkv-sim{} -- sim --replay {}{}",
        features(sc),
        file.display(),
        sc.mutant
            .as_ref()
            .map(|m| format!(" --mutant {m}"))
            .unwrap_or_default()
    )
}

/// The cargo arguments that build the binary a scenario needs: the zoo's for a mutant.
fn features(sc: &Scenario) -> &'static str {
    if sc.mutant.is_some() {
        " --features mutants --bin tierkv-zoo"
    } else {
        ""
    }
}

fn write_trace(path: &Path, out: &RunOutcome, title: &str) -> Result<(), CliError> {
    write_artifact(
        path,
        &chrome_trace(&out.trace, &out.marks, &out.racing_ops, title),
    )
    .map_err(|e| {
        CliError::output(
            "--trace-out",
            path,
            format!("could not write the trace: {e}"),
        )
    })?;
    println!(
        "  trace: {} ({} ops; open it in https://ui.perfetto.dev)",
        path.display(),
        out.trace.len()
    );
    Ok(())
}

fn print_finding(f: &Finding) {
    println!("  finding: {f}");
}

fn run_options(args: &SimArgs, trace: bool) -> RunOptions {
    RunOptions {
        trace,
        cuda: args.device == "cuda",
        schedule: None,
        exhaustive: args.exhaustive,
        progress: Some(crate::campaign::PROGRESS_EVERY),
    }
}

/// A run under a schedule other than its scenario's own: which schedule of the seed, the policy
/// that drew it, and the file it was replayed from (`--schedule`; `None`: drawn by this run, so
/// a failure writes it).
#[derive(Clone, Debug)]
struct Sched {
    index: u64,
    policy: Policy,
    file: Option<PathBuf>,
}

/// The most bytes a schedule file may hold (its decisions, written as JSON numbers).
const SCHEDULE_FILE_BYTES_MAX: u64 = 4 * crate::schedule::DECISIONS_MAX as u64 + 4096;

fn under(opts: RunOptions, decisions: &[u8]) -> RunOptions {
    RunOptions {
        schedule: Some(Source::Replay(decisions.to_vec())),
        ..opts
    }
}

/// Where a failing run's schedule is written: `--out-dir`, named by its seed and schedule.
fn schedule_file(args: &SimArgs, sc: &Scenario, s: &Sched) -> PathBuf {
    args.out_dir
        .join(format!("tierkv-seed-{}.schedule-{}.json", sc.seed, s.index))
}

/// Writes a schedule artifact.
fn write_schedule(file: &Path, sc: &Scenario, s: &Sched, decisions: &[u8]) -> Result<(), String> {
    let schedule = Schedule {
        format: crate::schedule::FORMAT,
        seed: sc.seed,
        scenario: sc.fingerprint(),
        index: s.index,
        policy: s.policy,
        decisions: decisions.to_vec(),
    };
    let text = serde_json::to_string(&schedule).expect("a schedule serialises");
    write_artifact(file, &text)
        .map_err(|e| format!("could not write the schedule {}: {e}", file.display()))
}

/// Reports one failure: replay command, trace, and (for a seed) a shrunk reproduction. An
/// artifact that cannot be written is reported instead of its replay line.
fn report_failure(
    sc: &Scenario,
    out: &RunOutcome,
    args: &SimArgs,
    origin: &Origin,
    sched: Option<&Sched>,
) {
    println!("FAIL seed {}", sc.seed);
    for f in out.findings.iter().take(3) {
        print_finding(f);
    }
    println!("  scenario: {}", sc.summary());
    let mut with_schedule = String::new();
    if let Some(Sched {
        file: Some(file), ..
    }) = sched
    {
        // Replayed from a file: that file is the schedule; it is not written over.
        with_schedule = format!(" --schedule {}", file.display());
    } else if let Some(s) = sched {
        let file = schedule_file(args, sc, s);
        match write_schedule(&file, sc, s, &out.decisions) {
            Ok(()) => {
                let which = if crate::schedule::is_branch(s.index) {
                    format!(
                        "branch {} from the corpus",
                        s.index - crate::schedule::BRANCH_FIRST
                    )
                } else {
                    format!("{} of the seed", s.index)
                };
                println!(
                    "  schedule: {which} ({}), {} decisions, written to {}",
                    s.policy,
                    out.decisions.len(),
                    file.display()
                );
                with_schedule = format!(" --schedule {}", file.display());
            }
            Err(e) => eprintln!("  {e}"),
        }
    }
    match origin {
        Origin::Seed => println!("  replay: {}{with_schedule}", replay_command(sc)),
        Origin::File(f) => println!("  replay: {}{with_schedule}", replay_file_command(sc, f)),
    }
    let topts = match sched {
        Some(_) => under(run_options(args, true), &out.decisions),
        None => run_options(args, true),
    };
    let traced = run(sc, &topts);
    let path = args.trace_out.clone().unwrap_or_else(|| {
        args.out_dir
            .join(format!("tierkv-seed-{}.trace.json", sc.seed))
    });
    if let Err(e) = write_trace(&path, &traced, &format!("tierkv seed {}", sc.seed)) {
        eprintln!("  {e}");
    }
    // A replayed file (scenario or schedule) is the reproduction already: it is neither shrunk
    // again nor overwritten.
    let replayed = sched.is_some_and(|s| s.file.is_some());
    if matches!(origin, Origin::Seed) && !replayed && !args.no_shrink {
        if let Err(e) = shrink_and_report(sc, out, args, sched) {
            eprintln!("  {e}");
        }
    }
}

/// Shrinks a failing seed's scenario, writes it beside the trace and prints how to replay it.
/// Under a schedule of its own, the schedule shrinks first (half the budget), then the scenario
/// under the shrunk schedule.
fn shrink_and_report(
    sc: &Scenario,
    out: &RunOutcome,
    args: &SimArgs,
    sched: Option<&Sched>,
) -> Result<(), String> {
    let Some(oracle) = out.findings.first().map(|f| f.oracle) else {
        return Err("the failure did not happen again: nothing to shrink".into());
    };
    let budget = match args.shrink_runs {
        Some(runs) => Budget::Runs(runs),
        None => Budget::Wall(Duration::from_secs(args.shrink_secs)),
    };
    let (s, min, decisions) = match sched {
        None => {
            let s = shrink(sc, oracle, budget);
            let min = run(&s.scenario, &run_options(args, false));
            (s, min, None)
        }
        Some(_) => {
            let base = run_options(args, false);
            let (d, runs) = shrink_schedule(sc, &base, &out.decisions, oracle, budget.half());
            println!(
                "  schedule shrunk in {runs} runs from {} to {} decisions ({} not 0)",
                out.decisions.len(),
                d.len(),
                d.iter().filter(|&&x| x != 0).count()
            );
            let opts = under(run_options(args, false), &d);
            let s = shrink_under(sc, &opts, oracle, budget.half());
            let min = run(&s.scenario, &opts);
            (s, min, Some(d))
        }
    };
    println!(
        "  shrunk in {} runs to {} requests ({} sessions, {} one-shots), still failing with [{}]: {}",
        s.runs,
        s.scenario.workload.requests(),
        s.scenario.workload.sessions.len(),
        s.scenario.workload.oneshots.len(),
        s.oracle,
        min.findings.first().map(|f| f.message.as_str()).unwrap_or("(no longer fails)")
    );
    println!("  minimal scenario: {}", s.scenario.summary());
    println!(
        "  minimal workload: {}",
        serde_json::to_string(&s.scenario.workload).expect("json")
    );
    println!("  minimal configuration:\n{}", indent(&s.scenario.config));
    let file = args
        .out_dir
        .join(format!("tierkv-seed-{}.shrunk.json", sc.seed));
    let text = serde_json::to_string_pretty(&s.scenario).expect("a scenario serialises");
    write_artifact(&file, &text).map_err(|e| {
        format!(
            "could not write the shrunk scenario {}: {e}",
            file.display()
        )
    })?;
    let mut with_schedule = String::new();
    if let (Some(d), Some(sd)) = (&decisions, sched) {
        let sfile = args
            .out_dir
            .join(format!("tierkv-seed-{}.shrunk-schedule.json", sc.seed));
        write_schedule(&sfile, &s.scenario, sd, d)?;
        with_schedule = format!(" --schedule {}", sfile.display());
    }
    println!(
        "  replay the shrunk case: {}{with_schedule}",
        replay_file_command(&s.scenario, &file)
    );
    Ok(())
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The worker threads: `--jobs` (1..=1024) or the machine's cores.
pub fn worker_count(jobs: Option<usize>) -> Result<usize, String> {
    match jobs {
        Some(0) => Err("--jobs 0: a campaign needs at least one worker".into()),
        Some(j) if j > JOBS_MAX => Err(format!("--jobs {j}: at most {JOBS_MAX} workers")),
        Some(j) => Ok(j),
        None => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// `dir` exists and takes files (a probe file is written and removed).
/// Whether `dir` can take artifacts, checked without creating anything: it is a writable
/// directory, or the nearest folder above it that exists is one (the directory is made when
/// the first artifact is written).
pub fn check_output_dir(dir: &Path) -> Result<(), String> {
    let mut at = dir;
    loop {
        match std::fs::metadata(at) {
            Ok(m) if !m.is_dir() => {
                return Err(format!("{} is not a directory", at.display()));
            }
            Ok(m) if m.permissions().readonly() => {
                return Err(format!("{} is not writable", at.display()));
            }
            Ok(_) => return Ok(()),
            Err(_) => match at.parent() {
                Some(p) if !p.as_os_str().is_empty() => at = p,
                _ => return Ok(()), // a relative path under the working directory
            },
        }
    }
}

/// Whether `file` can be written, checked without touching it: its folder exists and is
/// writable, and it is not a directory.
pub fn check_output_file(file: &Path) -> Result<(), String> {
    if file.is_dir() {
        return Err(format!("{} is a directory", file.display()));
    }
    // A FIFO or a socket would block the write until a reader comes, past any signal.
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if let Ok(m) = std::fs::metadata(file) {
            let t = m.file_type();
            if t.is_fifo() || t.is_socket() {
                return Err(format!(
                    "{} is a FIFO or a socket: give a regular file",
                    file.display()
                ));
            }
        }
    }
    let parent = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() && !m.permissions().readonly() => Ok(()),
        Ok(m) if m.is_dir() => Err(format!("{} is not writable", parent.display())),
        Ok(_) => Err(format!("{} is not a directory", parent.display())),
        Err(e) => Err(format!("{}: {e}", parent.display())),
    }
}

/// Writes an artifact, making its folder first.
fn write_artifact(path: &Path, contents: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, contents)
}

/// The trace of `--profile trace`: `--mooncake FILE` or the built-in excerpt.
fn trace_records(args: &SimArgs) -> Result<Option<Vec<TraceRecord>>, CliError> {
    if args.profile != "trace" {
        return Ok(None);
    }
    let Some(p) = &args.mooncake else {
        let recs = super::data::mooncake_excerpt().expect("the built-in excerpt is a trace");
        crate::scenario::check_trace(&recs).expect("the built-in excerpt fits the clock");
        return Ok(Some(recs));
    };
    let recs =
        tierkv_engine::trace::read_trace(p).map_err(|e| CliError::trace("--mooncake", p, e))?;
    crate::scenario::check_trace(&recs).map_err(|e| CliError::input("--mooncake", p, e))?;
    Ok(Some(recs))
}

/// The checks `tierkv sim` makes before it runs anything (the `cli_numbers` fuzz target's
/// entry): the campaign the arguments describe, or the usage error.
pub fn check_args(args: &SimArgs) -> Result<CampaignOptions, CliError> {
    setup(args)
}

/// The `--mutant`, when it is one that acts only in a prefill/decode pair.
fn pd_mutant_of(args: &SimArgs) -> Option<tierkv_engine::mutants::Mutant> {
    args.mutant
        .as_deref()
        .and_then(tierkv_engine::mutants::Mutant::parse)
        .filter(|m| m.is_pd())
}

/// Every output the arguments name can be written (checked before anything runs), and no two
/// name the same file.
fn check_outputs(args: &SimArgs) -> Result<(), CliError> {
    check_output_dir(&args.out_dir).map_err(|e| CliError::Arguments(format!("--out-dir: {e}")))?;
    if let Some(p) = &args.trace_out {
        check_output_file(p)
            .map_err(|e| CliError::Arguments(format!("--trace-out {}: {e}", p.display())))?;
    }
    if let Some(p) = &args.save_scenario {
        check_output_file(p)
            .map_err(|e| CliError::Arguments(format!("--save-scenario {}: {e}", p.display())))?;
    }
    if let Some(p) = &args.json {
        check_output_file(p)
            .map_err(|e| CliError::Arguments(format!("--json {}: {e}", p.display())))?;
    }
    if let (Some(a), Some(b)) = (&args.save_scenario, &args.trace_out) {
        if a == b {
            return Err(CliError::Arguments(format!(
                "--save-scenario and --trace-out both name {}: give each its own file",
                a.display()
            )));
        }
    }
    Ok(())
}

/// Everything the arguments ask for, checked.
fn setup(args: &SimArgs) -> Result<CampaignOptions, CliError> {
    if !PROFILES.contains(&args.profile.as_str()) {
        return Err(CliError::Arguments(format!(
            "unknown profile `{}`; profiles are: {}, vllm",
            args.profile,
            PROFILES.join(", ")
        )));
    }
    if args.device == "cuda" {
        // Every seed builds its executor on the process's one CUDA context: find out now, with
        // a clear message, whether there is one.
        super::cuda_kernels("--device cuda", 0)?;
    }
    // Flags that would do nothing here are refused, not ignored.
    check_single_run_flags(args)?;
    if args.overlap.as_deref() == Some("on") && args.profile == "pd" {
        return Err(CliError::Arguments(
            "--overlap on: a prefill/decode pair never runs one step ahead (the `pd` profile \
             draws no overlap); drop --overlap, or choose another profile"
                .into(),
        ));
    }
    if let Some(m) = pd_mutant_of(args) {
        // A replayed scenario carries its own profile: checked when it is read.
        if args.profile != "pd" && args.replay.is_none() {
            return Err(CliError::Arguments(format!(
                "--mutant {}: acts only in a prefill/decode pair, which only `--profile pd` \
                 builds; add --profile pd",
                m.name()
            )));
        }
    }
    mutants_of(args.mutant.as_deref()).map_err(CliError::Arguments)?;
    check_outputs(args)?;
    if args.mooncake.is_some() && args.profile != "trace" {
        return Err(CliError::Arguments(
            "--mooncake gives the trace of `--profile trace`; add it, or drop --mooncake".into(),
        ));
    }
    check_schedules(args)?;
    let (first, end) = args.seeds.unwrap_or((0, DEFAULT_SEEDS));
    let seeds = SeedSet::new(first, end, args.shard);
    if seeds.is_empty() && args.seed.is_none() && args.replay.is_none() {
        let (i, n) = args.shard.unwrap_or((0, 1));
        return Err(CliError::Arguments(format!(
            "no seed to run: seeds {first}..{end} hold none with seed % {n} == {i}"
        )));
    }
    Ok(CampaignOptions {
        first,
        end,
        jobs: worker_count(args.jobs).map_err(CliError::Arguments)?,
        shard: args.shard,
        profile: args.profile.clone(),
        mutant: args.mutant.clone(),
        progress: true,
        stop_at_first: !args.keep_going,
        trace_records: trace_records(args)?,
        cuda: args.device == "cuda",
        schedules: args.schedules,
        overlap: args.overlap.as_deref().map(|o| o == "on"),
        exhaustive: args.exhaustive,
        corpus: read_corpus(args)?,
        branches: args.branches,
        requests_max: args.requests_max,
        cut_share: args.cut_share,
    })
}

/// `--schedules`' count, and `--schedule` only with one scenario.
fn check_schedules(args: &SimArgs) -> Result<(), CliError> {
    if args.schedules == 0 || args.schedules > SCHEDULES_MAX {
        return Err(CliError::Arguments(format!(
            "--schedules {}: give 1..={SCHEDULES_MAX} schedules per seed",
            args.schedules
        )));
    }
    if args.schedule.is_some() && args.seed.is_none() && args.replay.is_none() {
        return Err(CliError::Arguments(
            "--schedule replays a schedule of one scenario: add --seed or --replay".into(),
        ));
    }
    Ok(())
}

/// The flags of a campaign refused with one run (`--seed`, `--replay`) and those of one run
/// refused with a campaign.
fn check_single_run_flags(args: &SimArgs) -> Result<(), CliError> {
    let single = args.seed.is_some() || args.replay.is_some();
    if args.coverage && single {
        return Err(CliError::Arguments(
            "--coverage prints a campaign's coverage table: give --seeds A..B, or drop --coverage"
                .into(),
        ));
    }
    if args.save_scenario.is_some() && args.seed.is_none() {
        return Err(CliError::Arguments(
            "--save-scenario writes the scenario of one seed: add --seed".into(),
        ));
    }
    if args.seed.is_some() && args.shard.is_some() {
        return Err(CliError::Arguments(
            "--shard selects seeds of a campaign, not of --seed".into(),
        ));
    }
    Ok(())
}

/// The corpus of `--corpus`, shared by the campaign's workers.
fn read_corpus(args: &SimArgs) -> Result<Option<Arc<Mutex<Corpus>>>, CliError> {
    let Some(file) = &args.corpus else {
        return Ok(None);
    };
    check_output_file(file)
        .map_err(|e| CliError::Arguments(format!("--corpus {}: {e}", file.display())))?;
    let c = Corpus::read_or_new(file, &args.profile)
        .map_err(|e| CliError::input("--corpus", file, e))?;
    Ok(Some(Arc::new(Mutex::new(c))))
}

/// Writes the campaign's result to `--json`, if asked: one shard's result.
fn write_json(
    copts: &CampaignOptions,
    summary: &crate::campaign::CampaignSummary,
    args: &SimArgs,
) -> Result<(), CliError> {
    let Some(file) = &args.json else {
        return Ok(());
    };
    // A branch replays only from its decisions: each failing branch's schedule is written
    // first, and its replay line names the file (or the result is not written).
    let mut branch_files = BTreeMap::new();
    for f in summary
        .failures
        .iter()
        .filter(|f| crate::schedule::is_branch(f.schedule))
    {
        let sc = copts.scenario(f.seed);
        let policy = f
            .policy
            .expect("a branch runs under a policy of its checkpoint");
        let sched = Sched {
            index: f.schedule,
            policy,
            file: None,
        };
        let path = schedule_file(args, &sc, &sched);
        write_schedule(&path, &sc, &sched, &f.decisions)
            .map_err(|e| CliError::output("--json", file, e))?;
        branch_files.insert((f.seed, f.schedule), path);
    }
    let result = ShardResult::of(copts, summary, |f| {
        let sc = copts.scenario(f.seed);
        match branch_files.get(&(f.seed, f.schedule)) {
            Some(path) => format!("{} --schedule {}", replay_command(&sc), path.display()),
            None => failure_replay(&sc, f.schedule),
        }
    });
    let text = serde_json::to_string_pretty(&result).expect("a shard result serialises");
    write_artifact(file, &text).map_err(|e| {
        CliError::output("--json", file, format!("could not write the result: {e}"))
    })?;
    println!("result: {}", file.display());
    Ok(())
}

/// Writes the campaign's corpus back to `--corpus`, and says what it holds.
fn write_corpus(copts: &CampaignOptions, args: &SimArgs) -> Result<(), CliError> {
    let (Some(c), Some(file)) = (&copts.corpus, &args.corpus) else {
        return Ok(());
    };
    let c = c.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    write_artifact(file, &c.to_json()).map_err(|e| {
        CliError::output("--corpus", file, format!("could not write the corpus: {e}"))
    })?;
    let branched: u64 = c.checkpoints.iter().map(|k| k.branched).sum();
    println!(
        "corpus: {} checkpoints over {} runs counted ({} branches taken from it in all), written to {}",
        c.checkpoints.len(),
        c.runs,
        branched,
        file.display()
    );
    Ok(())
}

pub fn run_sim(args: SimArgs) -> i32 {
    sim(&args).unwrap_or_else(CliError::report)
}

/// `tierkv sim`: the exit code of what ran, or why nothing could.
fn sim(args: &SimArgs) -> Result<i32, CliError> {
    if args.calls.is_some() && args.profile != "vllm" {
        return Err(CliError::Arguments(
            "--calls: a recording of vLLM's calls replays under --profile vllm only".into(),
        ));
    }
    if args.profile == "vllm" {
        return run_vllm(args);
    }
    let copts = setup(args)?;
    if let Some(file) = &args.replay {
        let mut sc = read_scenario(file)?;
        if let Some(m) = pd_mutant_of(args).filter(|_| sc.profile != "pd") {
            return Err(CliError::Arguments(format!(
                "--mutant {}: acts only in a prefill/decode pair; {} is a scenario of profile \
                 `{}`, which builds none",
                m.name(),
                file.display(),
                sc.profile
            )));
        }
        if args.mutant.is_some() {
            sc.mutant = args.mutant.clone();
        }
        let schedule = recorded_schedule(args, &sc)?;
        return Ok(single(&sc, args, &Origin::File(file.clone()), schedule));
    }
    if let Some(seed) = args.seed {
        let sc = copts.scenario(seed);
        // Every argument is checked before anything is written or run.
        let schedule = recorded_schedule(args, &sc)?;
        if let Some(p) = &args.save_scenario {
            let text = serde_json::to_string_pretty(&sc).expect("a scenario serialises");
            std::fs::write(p, text).map_err(|e| CliError::output("--save-scenario", p, e))?;
            println!("scenario written to {}", p.display());
        }
        return Ok(single(&sc, args, &Origin::Seed, schedule));
    }
    campaign(&copts, args)
}

/// The largest scenario file `--replay` reads (a drawn scenario is tens of kilobytes).
const SCENARIO_FILE_BYTES_MAX: u64 = 16 << 20;

/// A saved scenario (a regular file of at most `SCENARIO_FILE_BYTES_MAX` bytes), checked field
/// by field.
fn read_scenario(file: &Path) -> Result<Scenario, CliError> {
    let text = tierkv_engine::input::read_text(file, SCENARIO_FILE_BYTES_MAX)
        .map_err(|e| CliError::input("--replay", file, e))?;
    parse_scenario(&text).map_err(|e| CliError::input("--replay", file, e))
}

/// A scenario file's text as `--replay` reads it: JSON, every field checked, a mutant only in a
/// build that has the bug zoo.
pub fn parse_scenario(text: &str) -> Result<Scenario, ScenarioFileError> {
    let mut sc: Scenario = serde_json::from_str(text).map_err(ScenarioFileError::NotJson)?;
    sc.keep_yarn_rule_of_its_time();
    sc.validate().map_err(ScenarioFileError::Invalid)?;
    mutants_of(sc.mutant.as_deref()).map_err(ScenarioFileError::Mutant)?;
    Ok(sc)
}

fn campaign(copts: &CampaignOptions, args: &SimArgs) -> Result<i32, CliError> {
    // From here until the results are written, SIGINT and SIGTERM end the campaign, not the
    // process (see `catch_interrupts`).
    crate::campaign::catch_interrupts();
    if args.check_determinism {
        let first = copts
            .seeds()
            .first()
            .expect("checked: the campaign has seeds");
        if let Some(code) = determinism(&copts.scenario(first), args) {
            return Ok(code);
        }
    }
    let summary = run_campaign(copts, |out| {
        if args.verbose {
            let sc = copts.scenario(out.seed);
            let verdict = out
                .findings
                .first()
                .map_or("ok".to_string(), |f| format!("FAIL [{}]", f.oracle));
            let schedule = match out.policy {
                Some(p) => format!(" (schedule {}: {p})", out.schedule),
                None => String::new(),
            };
            eprintln!("seed {}{schedule}: {} -> {verdict}", out.seed, sc.summary());
        }
    });
    let summary = summary.map_err(|e| CliError::Resources(e.to_string()))?;
    summary.print(&args.profile);
    if args.coverage {
        print!("{}", summary.coverage.table());
    }
    write_json(copts, &summary, args)?;
    write_corpus(copts, args)?;
    // What ended is printed and written: a signal from now on ends the process (the failure's
    // replay and shrinking can take minutes), and one that came after the last run ended still
    // sets the exit code.
    crate::campaign::release_interrupts();
    if let Some(sig) = summary.interrupted.or_else(crate::campaign::interrupted) {
        // Replaying a failure would outlast the grace period the signal gave.
        if let Some(f) = summary.failures.first() {
            println!(
                "FAIL seed {} {}\n  replay: {}",
                f.seed,
                f.finding,
                failure_replay(&copts.scenario(f.seed), f.schedule)
            );
        }
        return Ok(128 + sig);
    }
    if let Some(seed) = summary.first_failure {
        let sc = copts.scenario(seed);
        let (index, policy, decisions) = summary
            .first_failure_schedule
            .clone()
            .expect("a failure has its schedule");
        let (out, sched) = match policy {
            None => (run(&sc, &run_options(args, false)), None),
            Some(policy) => {
                let opts = under(run_options(args, false), &decisions);
                let sched = Sched {
                    index,
                    policy,
                    file: None,
                };
                (run(&sc, &opts), Some(sched))
            }
        };
        report_failure(&sc, &out, args, &Origin::Seed, sched.as_ref());
        return Ok(1);
    }
    Ok(0)
}

/// Runs `sc` twice; `Some(1)` when the event-log hashes differ.
fn determinism(sc: &Scenario, args: &SimArgs) -> Option<i32> {
    match crate::oracles::determinism::check(sc, &run_options(args, false)) {
        Some(f) => {
            println!("FAIL {f}");
            Some(1)
        }
        None => {
            println!(
                "determinism: seed {} ran twice with the same event-log hash",
                sc.seed
            );
            None
        }
    }
}

fn single(
    sc: &Scenario,
    args: &SimArgs,
    origin: &Origin,
    recorded: Option<(PathBuf, Schedule)>,
) -> i32 {
    println!("seed {}: {}", sc.seed, sc.summary());
    if args.check_determinism {
        if let Some(code) = determinism(sc, args) {
            return code;
        }
    }
    let traced = args.trace_out.is_some();
    // A recorded schedule, or the scenario's own.
    let (out, mut sched) = match recorded {
        Some((file, s)) => {
            let opts = under(run_options(args, traced), &s.decisions);
            println!(
                "schedule {} ({}) from {}, {} decisions:",
                s.index,
                s.policy,
                file.display(),
                s.decisions.len()
            );
            let sched = Sched {
                index: s.index,
                policy: s.policy,
                file: Some(file),
            };
            (run(sc, &opts), Some(sched))
        }
        None => {
            if args.schedules > 1 {
                println!("schedule 0 (the scenario's own):");
            }
            (run(sc, &run_options(args, traced)), None)
        }
    };
    print_run(&out);
    // `--schedules N`: the others, until one fails.
    let mut out = out;
    let ops = out.decision_counts.made[Kind::Hold as usize];
    for index in 1..args.schedules {
        if out.failed() {
            break;
        }
        let policy = explore_policy(index, sc.gpu.schedule_policy(), ops);
        let opts = RunOptions {
            schedule: Some(Source::Draw { index, policy }),
            ..run_options(args, traced)
        };
        out = run(sc, &opts);
        println!("schedule {index} ({policy}):");
        print_run(&out);
        sched = Some(Sched {
            index,
            policy,
            file: None,
        });
    }
    if out.failed() {
        report_failure(sc, &out, args, origin, sched.as_ref());
        return 1;
    }
    if let Some(p) = &args.trace_out {
        if let Err(e) = write_trace(p, &out, &format!("tierkv seed {}", sc.seed)) {
            return e.report();
        }
    }
    if args.schedules > 1 {
        println!("ok: no findings in {} schedules", args.schedules);
    } else {
        println!("ok: no findings");
    }
    0
}

/// `--schedule`'s file, read and checked against `sc` (`None` without the flag).
fn recorded_schedule(
    args: &SimArgs,
    sc: &Scenario,
) -> Result<Option<(PathBuf, Schedule)>, CliError> {
    match &args.schedule {
        Some(file) => Ok(Some((file.clone(), read_schedule(file, sc)?))),
        None => Ok(None),
    }
}

/// A recorded schedule for `sc`, checked: size, form, and that it was recorded on `sc`.
fn read_schedule(file: &Path, sc: &Scenario) -> Result<Schedule, CliError> {
    use tierkv_engine::input::{read_text, InputError};
    let fail = |e: String| CliError::input("--schedule", file, e);
    let text = read_text(file, SCHEDULE_FILE_BYTES_MAX).map_err(|e| match e {
        InputError::TooLarge { bytes_max } => {
            fail(format!("larger than {bytes_max} bytes: not a schedule"))
        }
        e => fail(e.to_string()),
    })?;
    let s: Schedule =
        serde_json::from_str(&text).map_err(|e| fail(format!("not a schedule: {e}")))?;
    s.check_described(crate::scenario::limits::PCT_DEPTH_MAX)
        .and_then(|()| s.check_for(sc.seed, sc.fingerprint()))
        .map_err(|e| fail(e.to_string()))?;
    Ok(s)
}

/// One run's figures.
fn print_run(out: &RunOutcome) {
    let s = &out.stats;
    println!(
        "{} steps, {} requests submitted, {} finished, {} rejected, {} aborted, {} recomputed; {} loads, {} backups, {} failed copies, {} failed launches ({} steps run again)",
        s.steps, s.submitted, s.finished, s.rejected, s.aborted, s.recomputed, s.loads, s.backups, s.failed_copies, s.failed_kernels, s.steps_failed
    );
    let hits = |name: &str| out.probes.get(name).copied().unwrap_or(0);
    println!(
        "faults: {} left a stream in error, {} device recoveries (after every failure seen), {} torn copy ops (each a layer's run of pages), {} completions seen late, page allocations refused {} device / {} host; {} evictions asked for that freed pages",
        hits(SimProbe::FaultSticky.name()),
        hits(Probe::DeviceRecovered.name()),
        hits(SimProbe::FaultCopyTorn.name()),
        hits(SimProbe::FaultCompletionLate.name()),
        hits(Probe::FaultDevicePagesRefused.name()),
        hits(Probe::FaultHostPagesRefused.name()),
        hits(SimProbe::EvictedOnDemand.name()),
    );
    println!("decisions: {}", out.decision_counts);
    println!(
        "{} digests held to the specification's ({} queries held to the specification's logits), {} rows compared, {} cache decisions held to the policy model, {} ops, {} events; simulated {:.3} ms in {:.1} ms; event-log hash {:#018x}",
        s.digests_checked,
        s.queries_recomputed,
        s.rows_checked,
        s.policy_judged,
        s.ops,
        s.events,
        s.sim_ns as f64 / 1e6,
        s.wall_ns as f64 / 1e6,
        out.log_hash
    );
}

/// `--profile vllm`: the host tier of vLLM's offloading interface (`crate::offload`), seed by
/// seed on this thread. Exit 0 when no seed has a finding, 1 otherwise, 2 for bad arguments.
fn run_vllm(args: &SimArgs) -> Result<i32, CliError> {
    if let Some(flag) = vllm_unsupported(args) {
        return Err(CliError::Arguments(format!(
            "{flag}: --profile vllm takes --seed, --seeds, --calls and --mutant only (not built yet)"
        )));
    }
    let mutant = vllm_mutant(args)?;
    // A range, never a list: `--seeds 0..18446744073709551615` runs until stopped, as a
    // campaign of another profile would, without first holding every seed.
    let seeds = match (args.seed, args.seeds) {
        (Some(s), _) => s..=s,
        // `parse_range` refuses an empty range: `b > a`.
        (None, Some((a, b))) => a..=b - 1,
        (None, None) => 0..=149,
    };
    let calls = args
        .calls
        .as_deref()
        .map(crate::offload::replay::parse)
        .transpose()
        .map_err(|e| CliError::Input {
            flag: "--calls",
            detail: match e.line {
                0 => e.detail,
                line => format!("line {line}: {}", e.detail),
            },
            path: e.path,
        })?;
    let mut mutant_arg = args
        .mutant
        .as_ref()
        .map_or(String::new(), |m| format!(" --mutant {m}"));
    if let Some(p) = &args.calls {
        mutant_arg.push_str(&format!(" --calls {}", p.display()));
    }
    const SHOWN: u64 = 5;
    let mut total = crate::offload::Outcome::default();
    let mut failed = 0u64;
    for seed in seeds.clone() {
        let out = match &calls {
            Some(c) => crate::offload::replay::run(seed, c, mutant),
            None => crate::offload::run(seed, mutant),
        };
        total.divergences += out.divergences;
        total.stores += out.stores;
        total.loads += out.loads;
        total.hits += out.hits;
        total.failed_jobs += out.failed_jobs;
        total.refused_calls += out.refused_calls;
        if let Some(first) = out.findings.first() {
            failed += 1;
            if failed <= SHOWN {
                let mut line: String = first.chars().take(300).collect();
                if line.len() < first.len() {
                    line.push_str(" …");
                }
                println!("seed {seed}: {line} ({} findings)", out.findings.len());
                println!("  replay: tierkv sim --profile vllm --seed {seed}{mutant_arg}");
            }
        }
    }
    if failed > SHOWN {
        println!("({} more failing seeds not shown)", failed - SHOWN);
    }
    let count = seeds.end() - seeds.start() + 1;
    print_vllm_summary(&mutant_arg, count, failed, &total, calls.as_ref());
    Ok(i32::from(failed > 0))
}

/// `--mutant` under `--profile vllm`: one of this layer's planted races (an `Arguments` refusal
/// naming the known ones, for a name it does not know).
fn vllm_mutant(
    args: &SimArgs,
) -> Result<Option<tierkv_engine::offload::transfer::TransferMutant>, CliError> {
    let Some(name) = args.mutant.as_deref() else {
        return Ok(None);
    };
    match crate::offload::MUTANTS.iter().find(|(n, _)| *n == name) {
        Some(&(_, m)) => Ok(Some(m)),
        None => {
            let known: Vec<&str> = crate::offload::MUTANTS.iter().map(|m| m.0).collect();
            Err(CliError::Arguments(format!(
                "--mutant {name}: --profile vllm knows {}",
                known.join(", ")
            )))
        }
    }
}

/// The summary of a `--profile vllm` run.
fn print_vllm_summary(
    mutant_arg: &str,
    seeds: u64,
    failed: u64,
    total: &crate::offload::Outcome,
    calls: Option<&crate::offload::replay::Calls>,
) {
    println!(
        "== tierkv sim summary (profile vllm{})\nseeds run: {}   failures: {failed}\nchecked: {} stores, {} loads ({} hits), {} jobs failed by the driver's faults, {} of the server's own calls refused and retried{}",
        if mutant_arg.is_empty() { String::new() } else { format!(",{mutant_arg}") },
        seeds,
        total.stores,
        total.loads,
        total.hits,
        total.failed_jobs,
        total.refused_calls,
        match calls {
            Some(c) => format!("\nreplayed: {} recorded calls a seed; {} recorded answers the replay's own index did not give (after jobs the faults failed)", c.calls.len(), total.divergences),
            None => String::new(),
        },
    );
}

/// The first flag given that `--profile vllm` does not take.
fn vllm_unsupported(args: &SimArgs) -> Option<&'static str> {
    let given = [
        ("--shard", args.shard.is_some()),
        ("--replay", args.replay.is_some()),
        ("--schedule", args.schedule.is_some()),
        ("--schedules", args.schedules != 1),
        ("--trace-out", args.trace_out.is_some()),
        ("--save-scenario", args.save_scenario.is_some()),
        ("--mooncake", args.mooncake.is_some()),
        ("--overlap", args.overlap.is_some()),
        ("--requests-max", args.requests_max.is_some()),
        ("--cut-share", args.cut_share.is_some()),
        ("--check-determinism", args.check_determinism),
        ("--exhaustive", args.exhaustive),
        ("--coverage", args.coverage),
        ("--json", args.json.is_some()),
        ("--device", args.device != "cpu"),
        ("--jobs", args.jobs.is_some()),
        ("--no-shrink", args.no_shrink),
        ("--shrink-runs", args.shrink_runs.is_some()),
        ("--shrink-secs", args.shrink_secs != 60),
        ("--keep-going", args.keep_going),
        ("--verbose", args.verbose),
        (
            "--out-dir",
            args.out_dir != std::path::Path::new("target/tierkv"),
        ),
    ];
    given.iter().find(|f| f.1).map(|f| f.0)
}
