//! `tierkv campaign merge`: the results of a campaign's shards, combined into one summary and
//! one coverage table (see `shard`); `campaign merge-corpus`: corpus files combined (`corpus`;
//! a file given twice is counted twice). Exit codes: 0 no failure (or the corpus written); 1
//! failures; 2 the inputs could not be read or do not belong together; 3 the merged result
//! could not be written.

use super::error::CliError;
use crate::corpus::Corpus;
use crate::shard::{merge, shown_list as missing_list, Merged, ShardResult, LIST_SHOWN_MAX};
use std::path::PathBuf;

#[derive(clap::Subcommand, Debug, Clone)]
pub enum CampaignCommand {
    /// Combine shard results (`tierkv sim --shard I/N --json FILE`) into one summary and one
    /// coverage table. Refuses results of different builds or campaigns, results whose figures
    /// cannot be true or whose sums overflow, and (unless --partial) a shard missing or held only
    /// by an interrupted run. A shard given twice (run on two machines) is merged once, after every seed
    /// both runs hold is found to have the same event-log hash; else it is refused.
    Merge(MergeArgs),
    /// Combine corpus files (`tierkv sim --corpus FILE`) of one profile into one: the runs and
    /// probe counts added, the checkpoints of each file kept while a probe has fewer than four
    /// and the corpus fewer than 4,096.
    MergeCorpus(MergeCorpusArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct MergeCorpusArgs {
    /// The corpus files.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Write the merged corpus here.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(clap::Args, Debug, Clone)]
pub struct MergeArgs {
    /// The shard results, one file per shard.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Merge even when shards are missing (the summary says which).
    #[arg(long)]
    pub partial: bool,
    /// Print the coverage table.
    #[arg(long)]
    pub coverage: bool,
    /// Print the targets reached in fewer than 5% of the runs, each with the reason it is rare
    /// where one is known.
    #[arg(long)]
    pub rare: bool,
    /// Write the merged result here (JSON, as one shard of one). Not with --partial.
    #[arg(long, conflicts_with = "partial")]
    pub json: Option<PathBuf>,
}

pub fn run_campaign_command(cmd: CampaignCommand) -> i32 {
    match cmd {
        CampaignCommand::Merge(args) => run_merge(&args),
        CampaignCommand::MergeCorpus(args) => merge_corpus(&args).unwrap_or_else(CliError::report),
    }
}

/// `campaign merge-corpus`: 0 when the merged corpus was written, else why not.
fn merge_corpus(args: &MergeCorpusArgs) -> Result<i32, CliError> {
    super::sim::check_output_file(&args.out)
        .map_err(|e| CliError::Arguments(format!("--out {}: {e}", args.out.display())))?;
    let mut merged: Option<Corpus> = None;
    for file in &args.files {
        let c = Corpus::read(file).map_err(|e| CliError::input("corpus", file, e))?;
        match &mut merged {
            None => merged = Some(c),
            Some(m) => m
                .merge(&c)
                .map_err(|e| CliError::input("corpus", file, e))?,
        }
    }
    let m = merged.expect("clap requires a file");
    std::fs::write(&args.out, m.to_json()).map_err(|e| {
        CliError::output(
            "--out",
            &args.out,
            format!("could not write the corpus: {e}"),
        )
    })?;
    println!(
        "merged {} corpus files: {} checkpoints over {} runs counted, written to {}",
        args.files.len(),
        m.checkpoints.len(),
        m.runs,
        args.out.display()
    );
    Ok(0)
}

fn run_merge(args: &MergeArgs) -> i32 {
    merge_files(args).unwrap_or_else(CliError::report)
}

/// `campaign merge`: the exit code of the merged campaign, or why the results were refused.
fn merge_files(args: &MergeArgs) -> Result<i32, CliError> {
    if let Some(p) = &args.json {
        super::sim::check_output_file(p)
            .map_err(|e| CliError::Arguments(format!("--json {}: {e}", p.display())))?;
    }
    let mut results = Vec::with_capacity(args.files.len());
    for file in &args.files {
        results.push((file.clone(), ShardResult::read(file)?));
    }
    let merged = merge(&results, args.partial)?;
    print_merged(&merged, results[0].1.shard_count, args);
    let r = &merged.result;
    if let Some(file) = &args.json {
        let text = serde_json::to_string_pretty(r).expect("a shard result serialises");
        std::fs::write(file, text).map_err(|e| {
            CliError::output(
                "--json",
                file,
                format!("could not write the merged result: {e}"),
            )
        })?;
        println!("merged result: {}", file.display());
    }
    Ok(i32::from(!r.failures.is_empty()))
}

/// Prints what a merge found: the campaign, what is missing or cut, the cross-run determinism
/// check, the summary and the first failures.
fn print_merged(merged: &Merged, count: u64, args: &MergeArgs) {
    let r = &merged.result;
    println!(
        "== tierkv campaign merge: {} of {count} shards of seeds {}..{} (profile {}{}{})",
        merged.shards,
        r.first,
        r.end,
        r.profile,
        r.mutant
            .as_ref()
            .map(|m| format!(", mutant {m}"))
            .unwrap_or_default(),
        if r.schedules > 1 {
            format!(", {} schedules per seed", r.schedules)
        } else {
            String::new()
        }
    );
    println!("build: {}", r.build);
    if !merged.missing.is_empty() {
        println!(
            "PARTIAL: {} of {} shards missing (index {}): this is not the whole campaign",
            merged.missing.len(),
            merged.shards + merged.missing.len() as u64,
            missing_list(&merged.missing)
        );
    }
    let cut: Vec<String> = merged
        .interrupted
        .iter()
        .take(LIST_SHOWN_MAX)
        .map(|(f, index, seeds)| format!("{index} after {seeds} seeds ({})", f.display()))
        .collect();
    if !cut.is_empty() {
        println!(
            "PARTIAL: interrupted shards hold only the seeds they finished: {}",
            cut.join("; ")
        );
    }
    if !merged.repeated.is_empty() {
        println!(
            "determinism across runs: {} seeds ran in two runs of their shard ({} file{} not counted again: {}); every event-log hash agrees",
            merged.cross_checked,
            merged.repeated.len(),
            if merged.repeated.len() == 1 { "" } else { "s" },
            merged
                .repeated
                .iter()
                .take(5)
                .map(|f| f.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let summary = r.summary();
    summary.print_counts();
    summary.print_throughput(r.wall_s, Some((merged.shards as usize, r.held_s())));
    summary.print_checks();
    if args.coverage {
        print!("{}", summary.coverage.table());
    }
    if args.rare {
        print!("{}", summary.coverage.rare());
    }
    print_failures(&r.failures);
}

/// The first 20 failures of a merged result, each with its replay line (checked by `merge` to be
/// a `sim --seed` command); a result file is input, so its text reaches the terminal with
/// control characters shown escaped, never raw.
fn print_failures(failures: &[crate::shard::FailureRecord]) {
    for f in failures.iter().take(20) {
        let shown: String = f
            .finding
            .to_string()
            .chars()
            .map(|c| match c.is_control() {
                true => c.escape_default().to_string(),
                false => c.to_string(),
            })
            .collect();
        println!("FAIL seed {} {shown}", f.seed);
        println!("  replay: {}", f.replay);
    }
    if failures.len() > 20 {
        println!("... and {} more failures", failures.len() - 20);
    }
}
