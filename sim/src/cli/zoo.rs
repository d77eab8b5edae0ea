//! `tierkv zoo`: every mutant of the bug zoo through a seeded campaign, and the clean engine over
//! the same seeds. Prints, per mutant: caught or not, seeds to the first catch, wall time, which
//! oracle fired.

use super::error::CliError;
use crate::campaign::{run_campaign, CampaignError, CampaignOptions};
use crate::report::OracleKind;
use crate::scenario::PROFILES;
use std::time::Instant;
use tierkv_engine::mutants::Mutant;

#[derive(clap::Args, Debug, Clone)]
pub struct ZooArgs {
    /// Seeds per mutant, N: each runs seeds `0..N` (a count, not a range).
    #[arg(long, default_value_t = 100)]
    pub seeds: u64,
    /// Worker threads.
    #[arg(long)]
    pub jobs: Option<usize>,
    #[arg(long, default_value = "swarm")]
    pub profile: String,
    /// Only these mutants (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Skip the clean-engine run.
    #[arg(long)]
    pub no_clean: bool,
    /// `on`: the engine runs one step ahead in every seed (overlap scheduling: step n+1 is
    /// enqueued before the host waits for step n); `off`: in none, but for the mutants of the
    /// overlap (18, 28), which need it. Default: as each scenario draws it (half the seeds).
    #[arg(long, value_parser = ["on", "off"])]
    pub overlap: Option<String>,
}

/// One row of the zoo table.
#[derive(Clone, Debug)]
pub struct ZooRow {
    pub mutant: Option<Mutant>,
    pub caught: bool,
    /// Seeds run until the first catch (or all of them).
    pub seeds: u64,
    pub first_seed: Option<u64>,
    pub wall_s: f64,
    pub oracle: Option<OracleKind>,
    pub message: String,
}

/// Runs one mutant (or the clean engine, `None`) over seeds `0..seeds`.
pub fn zoo_row(
    mutant: Option<Mutant>,
    seeds: u64,
    jobs: usize,
    profile: &str,
    overlap: Option<bool>,
) -> Result<ZooRow, CampaignError> {
    let t = Instant::now();
    let opts = CampaignOptions {
        first: 0,
        end: seeds,
        jobs,
        shard: None,
        profile: profile.to_string(),
        mutant: mutant.map(|m| m.name().to_string()),
        progress: false,
        stop_at_first: mutant.is_some(),
        trace_records: None,
        cuda: false,
        schedules: 1,
        overlap,
        exhaustive: false,
        corpus: None,
        branches: 0,
        requests_max: None,
        cut_share: None,
    };
    let s = run_campaign(&opts, |_| {})?;
    let first = s.failures.first().cloned();
    Ok(ZooRow {
        mutant,
        caught: first.is_some(),
        seeds: first.as_ref().map_or(s.seeds_run, |f| f.seed + 1),
        first_seed: first.as_ref().map(|f| f.seed),
        wall_s: t.elapsed().as_secs_f64(),
        oracle: first.as_ref().map(|f| f.finding.oracle),
        message: first.map(|f| f.finding.message).unwrap_or_default(),
    })
}

/// The zoo's workers and mutants, every argument checked (the message names a bad one).
fn setup(args: &ZooArgs) -> Result<(usize, Vec<Mutant>), String> {
    // A trace profile needs a trace the zoo does not take.
    let profiles: Vec<&str> = PROFILES.iter().copied().filter(|&p| p != "trace").collect();
    if !profiles.contains(&args.profile.as_str()) {
        return Err(format!(
            "zoo --profile {}: the zoo runs one of {}",
            args.profile,
            profiles.join(", ")
        ));
    }
    if args.seeds == 0 {
        return Err("zoo --seeds 0: each mutant needs at least one seed".into());
    }
    let jobs = super::sim::worker_count(args.jobs)?;
    if !cfg!(feature = "mutants") {
        return Err("tierkv zoo needs the mutants: run the zoo's binary, cargo run --release -p tierkv-sim --features mutants --bin tierkv-zoo -- zoo".into());
    }
    if args.only.is_empty() {
        return Ok((jobs, Mutant::ALL.to_vec()));
    }
    let mutants = args
        .only
        .iter()
        .map(|n| {
            Mutant::parse(n).ok_or_else(|| {
                format!(
                    "unknown mutant `{n}`; mutants are: {}",
                    Mutant::ALL.map(|m| m.name()).join(", ")
                )
            })
        })
        .collect::<Result<Vec<Mutant>, String>>()?;
    Ok((jobs, mutants))
}

pub fn run_zoo(args: ZooArgs) -> i32 {
    let (jobs, mutants) = match setup(&args) {
        Ok(s) => s,
        Err(e) => return CliError::Arguments(e).report(),
    };
    let overlap = args.overlap.as_deref().map(|o| o == "on");
    println!(
        "{:<4} {:<28} {:<8} {:>6} {:>8}  {:<12} first finding",
        "#", "mutant", "caught", "seeds", "wall s", "oracle"
    );
    let mut missed = 0;
    for m in &mutants {
        // The prefill/decode mutants act only in a pair: they run under the `pd` profile.
        let profile = if m.is_pd() {
            "pd"
        } else {
            args.profile.as_str()
        };
        let r = match zoo_row(Some(*m), args.seeds, jobs, profile, overlap) {
            Ok(r) => r,
            Err(e) => return CliError::Resources(e.to_string()).report(),
        };
        if !r.caught {
            missed += 1;
        }
        let idx = Mutant::ALL.iter().position(|x| x == m).map_or(0, |i| i + 1);
        println!(
            "{:<4} {:<28} {:<8} {:>6} {:>8.2}  {:<12} {}",
            idx,
            m.name(),
            if r.caught { "yes" } else { "NO" },
            r.seeds,
            r.wall_s,
            r.oracle.map_or("-".to_string(), |o| o.to_string()),
            truncate(&r.message, 110)
        );
        // What it re-creates: an incident's link, or the mistake it plants; for an incident of
        // another serving stack, its mechanism too.
        match m.field_mechanism() {
            Some(how) => println!("{:<4} field: {} — {how}", "", m.incident()),
            None => println!("{:<4} {}", "", m.incident()),
        }
    }
    let mut clean_failures = 0;
    if !args.no_clean {
        let r = match zoo_row(None, args.seeds, jobs, &args.profile, overlap) {
            Ok(r) => r,
            Err(e) => return CliError::Resources(e.to_string()).report(),
        };
        clean_failures = if r.caught { 1 } else { 0 };
        println!(
            "{:<4} {:<28} {:<8} {:>6} {:>8.2}  {:<12} {}",
            "-",
            "clean engine",
            if r.caught { "FINDING" } else { "clean" },
            r.seeds,
            r.wall_s,
            r.oracle.map_or("-".to_string(), |o| o.to_string()),
            truncate(&r.message, 110)
        );
    }
    let clean = if args.no_clean {
        "not run (--no-clean)".to_string()
    } else {
        format!("{clean_failures} findings")
    };
    println!(
        "caught {}/{} mutants within {} seeds; clean engine: {clean}",
        mutants.len() - missed,
        mutants.len(),
        args.seeds,
    );
    if missed > 0 || clean_failures > 0 {
        1
    } else {
        0
    }
}

fn truncate(s: &str, n: usize) -> String {
    let s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}
