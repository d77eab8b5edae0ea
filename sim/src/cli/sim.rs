//! `tierkv sim`: one seed, a campaign of seeds, or a saved scenario.

use crate::campaign::{run_campaign, CampaignOptions};
use crate::report::Finding;
use crate::runner::{run, RunOptions, RunOutcome};
use crate::scenario::{Scenario, PROFILES};
use crate::shrink::shrink;
use crate::trace_out::chrome_trace;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    /// Run one seed and describe it.
    #[arg(long, conflicts_with_all = ["seeds", "replay"])]
    pub seed: Option<u64>,
    /// A range of seeds, `A..B` (B excluded). Default: 0..200.
    #[arg(long, value_parser = parse_range)]
    pub seeds: Option<(u64, u64)>,
    /// Worker threads (default: the machine's cores).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Run only shard I of N (`I/N`): seeds with seed % N == I.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<(u64, u64)>,
    /// Scenario profile: swarm (default), sessions (60+ concurrent tool-call sessions), needle,
    /// trace (a Mooncake trace replayed by timestamp), quick.
    #[arg(long, default_value = "swarm")]
    pub profile: String,
    /// Write the Chrome/Perfetto trace of the run (one seed) or of the first failure here.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Switch on a bug-zoo mutant (needs `--features mutants`).
    #[arg(long)]
    pub mutant: Option<String>,
    /// Replay a saved scenario (e.g. a shrunk reproduction).
    #[arg(long)]
    pub replay: Option<PathBuf>,
    /// The Mooncake trace for `--profile trace`.
    #[arg(
        long,
        default_value = "../shared/data/mooncake/conversation_trace.jsonl"
    )]
    pub mooncake: PathBuf,
    /// Do not shrink failures.
    #[arg(long)]
    pub no_shrink: bool,
    /// Wall-time budget for shrinking one failure, seconds.
    #[arg(long, default_value_t = 60)]
    pub shrink_secs: u64,
    /// Run the first seed twice and compare event-log hashes.
    #[arg(long)]
    pub check_determinism: bool,
    /// Keep going after the first failure.
    #[arg(long)]
    pub keep_going: bool,
    /// Print every seed's drawn configuration and outcome as the campaign goes.
    #[arg(long)]
    pub verbose: bool,
    /// Where the ops run: `cpu` (the kernels' CPU references) or `cuda` (a real GPU; needs
    /// `--features cuda`). The schedules are the same.
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub device: String,
    /// Where failure artifacts (traces, shrunk scenarios) go.
    #[arg(long, default_value = ".")]
    pub out_dir: PathBuf,
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
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

/// The one-line command that replays `sc`'s seed.
pub fn replay_command(sc: &Scenario) -> String {
    let features = if sc.mutant.is_some() {
        " --features mutants"
    } else {
        ""
    };
    format!(
        "cargo run --release -p tierkv-sim{features} -- sim --seed {} --profile {}{}",
        sc.seed,
        sc.profile,
        sc.mutant
            .as_ref()
            .map(|m| format!(" --mutant {m}"))
            .unwrap_or_default()
    )
}

fn write_trace(path: &Path, out: &RunOutcome, title: &str) {
    match std::fs::write(path, chrome_trace(&out.trace, &out.racing_ops, title)) {
        Ok(()) => println!(
            "  trace: {} ({} ops; open it in https://ui.perfetto.dev)",
            path.display(),
            out.trace.len()
        ),
        Err(e) => eprintln!("  could not write the trace {}: {e}", path.display()),
    }
}

fn print_finding(f: &Finding) {
    println!("  finding: {f}");
}

/// Reports one failure: replay command, trace, shrunk reproduction.
pub fn report_failure(sc: &Scenario, out: &RunOutcome, args: &SimArgs) {
    println!("FAIL seed {}", sc.seed);
    for f in out.findings.iter().take(3) {
        print_finding(f);
    }
    println!("  scenario: {}", sc.summary());
    println!("  replay: {}", replay_command(sc));
    let traced = run(
        sc,
        &RunOptions {
            trace: true,
            cuda: args.device == "cuda",
        },
    );
    let path = args.trace_out.clone().unwrap_or_else(|| {
        args.out_dir
            .join(format!("tierkv-seed-{}.trace.json", sc.seed))
    });
    write_trace(&path, &traced, &format!("tierkv seed {}", sc.seed));
    if !args.no_shrink {
        let oracle = out.findings[0].oracle;
        let s = shrink(sc, oracle, Duration::from_secs(args.shrink_secs));
        let file = args
            .out_dir
            .join(format!("tierkv-seed-{}.shrunk.json", sc.seed));
        let _ = std::fs::write(
            &file,
            serde_json::to_string_pretty(&s.scenario).expect("json"),
        );
        let min = run(
            &s.scenario,
            &RunOptions {
                trace: false,
                cuda: args.device == "cuda",
            },
        );
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
        println!(
            "  replay the minimal case: cargo run --release -p tierkv-sim{} -- sim --replay {}",
            if sc.mutant.is_some() {
                " --features mutants"
            } else {
                ""
            },
            file.display()
        );
    }
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn run_sim(args: SimArgs) -> i32 {
    if !PROFILES.contains(&args.profile.as_str()) {
        eprintln!(
            "unknown profile `{}`; profiles are: {}",
            args.profile,
            PROFILES.join(", ")
        );
        return 2;
    }
    let trace_records = if args.profile == "trace" {
        match tierkv_engine::trace::read_trace(&args.mooncake) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("--profile trace: {e}");
                return 2;
            }
        }
    } else {
        None
    };
    if let Some(file) = &args.replay {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{}: {e}", file.display());
                return 2;
            }
        };
        let sc: Scenario = match serde_json::from_str(&text) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{}: not a scenario: {e}", file.display());
                return 2;
            }
        };
        if let Err(e) = tierkv_engine::Config::from_toml(&sc.config) {
            eprintln!("{}: its configuration is invalid: {e}", file.display());
            return 2;
        }
        return single(&sc, &args);
    }
    let copts = CampaignOptions {
        first: args.seeds.map_or(0, |r| r.0),
        end: args.seeds.map_or(200, |r| r.1),
        jobs: args
            .jobs
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        shard: args.shard,
        profile: args.profile.clone(),
        mutant: args.mutant.clone(),
        progress: true,
        stop_at_first: !args.keep_going,
        trace_records,
        cuda: args.device == "cuda",
    };
    if args.device == "cuda" && !cfg!(feature = "cuda") {
        eprintln!("--device cuda needs a build with `--features cuda`");
        return 2;
    }
    #[cfg(feature = "cuda")]
    if args.device == "cuda" {
        // Every seed builds its executor on the process's one CUDA context: find out now, with a
        // clear message, whether there is one.
        if let Err(e) = tierkv_kernels::cuda::launch::Kernels::global() {
            eprintln!("--device cuda: no usable CUDA device: {e}");
            return 2;
        }
    }
    if let Some(seed) = args.seed {
        return single(&copts.scenario(seed), &args);
    }
    if args.check_determinism {
        let sc = copts.scenario(copts.first);
        let opts = RunOptions {
            trace: false,
            cuda: args.device == "cuda",
        };
        if let Some(f) = crate::oracles::determinism::check(&sc, &opts) {
            println!("FAIL {f}");
            return 1;
        }
        println!(
            "determinism: seed {} ran twice with the same event-log hash",
            sc.seed
        );
    }
    let summary = run_campaign(&copts, |out| {
        if args.verbose {
            let sc = copts.scenario(out.seed);
            let verdict = out
                .findings
                .first()
                .map_or("ok".to_string(), |f| format!("FAIL [{}]", f.oracle));
            eprintln!("\rseed {}: {} -> {verdict}", out.seed, sc.summary());
        }
    });
    summary.print(&args.profile);
    if let Some(seed) = summary.first_failure {
        let sc = copts.scenario(seed);
        let out = run(
            &sc,
            &RunOptions {
                trace: false,
                cuda: args.device == "cuda",
            },
        );
        report_failure(&sc, &out, &args);
        return 1;
    }
    0
}

fn single(sc: &Scenario, args: &SimArgs) -> i32 {
    println!("seed {}: {}", sc.seed, sc.summary());
    let out = run(
        sc,
        &RunOptions {
            trace: args.trace_out.is_some(),
            cuda: args.device == "cuda",
        },
    );
    let s = &out.stats;
    println!(
        "{} steps, {} requests submitted, {} finished, {} rejected, {} aborted, {} recomputed; {} loads, {} backups, {} failed copies",
        s.steps, s.submitted, s.finished, s.rejected, s.aborted, s.recomputed, s.loads, s.backups, s.failed_copies
    );
    println!(
        "{} digests recomputed, {} rows compared, {} ops, {} events; simulated {:.3} ms in {:.1} ms (sim/wall {:.2}x); event-log hash {:#018x}",
        s.digests_checked,
        s.rows_checked,
        s.ops,
        s.events,
        s.sim_ns as f64 / 1e6,
        s.wall_ns as f64 / 1e6,
        s.sim_ns as f64 / s.wall_ns.max(1) as f64,
        out.log_hash
    );
    if let Some(p) = &args.trace_out {
        write_trace(p, &out, &format!("tierkv seed {}", sc.seed));
    }
    if out.failed() {
        report_failure(sc, &out, args);
        return 1;
    }
    println!("ok: no findings");
    0
}
