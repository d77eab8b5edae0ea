//! Campaign results as files, so that a campaign can spread over many machines on a scheduler
//! that already exists (a Kubernetes Indexed Job, a GitHub Actions matrix, a Slurm job array):
//! each machine runs `tierkv sim --shard I/N --json FILE`, and `tierkv campaign merge FILE...`
//! combines the files into one summary and one coverage table.
//!
//! A shard result holds what its campaign saw: the seeds run, every failure with its replay
//! command, the coverage counts, the totals and the timing, and the build that produced it.
//! Merging refuses files of different builds (a different source, features or profile would
//! make different seeds' outcomes incomparable) and of different campaigns (profile, mutant,
//! schedules, seed range, shard count); a shard missing is refused unless the merge is asked to
//! be partial. A file whose figures cannot be true is refused too (fewer runs than seeds, more
//! reruns than runs, no workers, a time past [`TIME_S_MAX`], a profile or mutant this build does
//! not know), and so is a merge whose sums would pass `u64::MAX`: every count is added with a
//! check, never wrapped. A shard given twice (run on two machines, or again) is a determinism check: every
//! seed both runs hold must have the same event-log hash, or the merge is refused; the first is
//! kept.

use crate::campaign::{CampaignFailure, CampaignOptions, CampaignSummary};
use crate::probes::all_names;
use crate::report::Finding;
use crate::runner::RunStats;
use crate::schedule::Policy;
use crate::targets;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The `format` field of a shard result.
pub const FORMAT: &str = "tierkv-shard-result";
/// The version of the format this build writes and reads.
pub const VERSION: u32 = 1;
/// The largest shard result file `merge` reads.
pub const FILE_BYTES_MAX: u64 = 64 << 20;
/// The most shards one campaign may be split into.
pub const SHARDS_MAX: u64 = 1 << 20;
/// The most entries a list of shard indices in a message shows.
pub const LIST_SHOWN_MAX: usize = 20;

/// `items`, comma-separated: the first [`LIST_SHOWN_MAX`] of them, and how many more.
pub fn shown_list(items: &[u64]) -> String {
    let mut list: Vec<String> = items
        .iter()
        .take(LIST_SHOWN_MAX)
        .map(u64::to_string)
        .collect();
    if items.len() > LIST_SHOWN_MAX {
        list.push(format!("and {} more", items.len() - LIST_SHOWN_MAX));
    }
    list.join(", ")
}

/// The longest wall or worker time a result may hold, seconds (about 31,700 years): far above
/// any real campaign, far below what `Duration` can hold.
pub const TIME_S_MAX: f64 = 1e12;

/// What produced a result: the same sources (a hash of every file that decides a seed's
/// outcome, made by the build script), features and profile give the same outcome per seed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Build {
    pub version: String,
    pub source: String,
    pub features: Vec<String>,
    pub profile: String,
}

impl Build {
    /// This binary's build.
    pub fn current() -> Build {
        let mut features = Vec::new();
        if cfg!(feature = "cuda") {
            features.push("cuda".to_string());
        }
        if cfg!(feature = "mutants") {
            features.push("mutants".to_string());
        }
        Build {
            version: env!("CARGO_PKG_VERSION").to_string(),
            source: env!("TIERKV_SOURCE_ID").to_string(),
            features,
            profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .to_string(),
        }
    }
}

impl std::fmt::Display for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tierkv {} source {} ({}, features: {})",
            self.version,
            self.source,
            self.profile,
            if self.features.is_empty() {
                "none".to_string()
            } else {
                self.features.join(", ")
            }
        )
    }
}

/// One failing run, with the command that replays it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailureRecord {
    pub seed: u64,
    pub schedule: u64,
    pub policy: Option<Policy>,
    pub finding: Finding,
    pub replay: String,
}

/// A probe's counts: hits, and the seeds that hit it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeCount {
    pub hits: u64,
    pub seeds: u64,
}

/// One campaign's (or one shard's) result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardResult {
    pub format: String,
    pub version: u32,
    pub build: Build,
    pub profile: String,
    pub mutant: Option<String>,
    pub schedules: u64,
    /// `--overlap`: every seed one step ahead (`Some(true)`), none (`Some(false)`), or as drawn.
    /// (Left out of the JSON when drawn, so that files from before it still read.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<bool>,
    /// `--requests-max`: each seed's workload cut to this many requests. (Left out of the JSON
    /// when not cut.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_max: Option<u32>,
    /// `--cut-share`: this share of the seeds cut to a few requests. (Left out of the JSON when
    /// none is.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_share: Option<f64>,
    /// The campaign's seed range, `first..end`.
    pub first: u64,
    pub end: u64,
    /// This shard, `index` of `count` (0 of 1: the whole range).
    pub shard_index: u64,
    pub shard_count: u64,
    pub seeds_run: u64,
    /// Runs in all: each seed's schedules (a failing seed stops at its failure) and the
    /// branches from the corpus.
    pub runs: u64,
    pub reruns: u64,
    /// A guided campaign (`--corpus`): the runs it branched from its corpus before each fresh
    /// seed (`--branches`). (Left out of the JSON when not guided.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guided: Option<u32>,
    /// Of `runs`, those branched from the corpus (left out when none).
    #[serde(default, skip_serializing_if = "crate::scenario::is_zero_u64")]
    pub branches: u64,
    pub failures: Vec<FailureRecord>,
    /// Every probe of the build, hit or not, and every target (`targets`: pairs, combinations,
    /// factors, watermark levels) the shard's runs reached; each with its hits and the runs
    /// (`seeds`: one a seed when each seed runs one schedule and nothing branches) that hit it.
    pub coverage: BTreeMap<String, ProbeCount>,
    pub totals: RunStats,
    pub wall_s: f64,
    /// The workers' CPU time, seconds (each worker thread's own clock).
    pub worker_s: f64,
    pub jobs: usize,
    /// A merged result's worker time held: each shard's wall time times its workers, summed
    /// (left out of one shard's own result, whose wall time times its workers it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_s: Option<f64>,
    /// Each seed's event-log hash under its own schedule: a shard run on two machines (or run
    /// again) must give the same hash for every seed, which `merge` checks.
    #[serde(default)]
    pub log_hashes: BTreeMap<u64, u64>,
    /// The shard was interrupted (SIGINT, SIGTERM): it holds the seeds that ended before, which
    /// `log_hashes` lists. `merge` takes it only with `--partial`. (Left out when false.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
}

/// Two runs of one shard (files `a` and `b`): every seed both ran gave the same event log, and
/// the same failure under its own schedule or none; two complete runs without failures hold
/// the same counts. Answers how many seeds both ran.
fn compare_runs(
    (a, ra): (&PathBuf, &ShardResult),
    (b, rb): (&PathBuf, &ShardResult),
) -> Result<u64, MergeError> {
    let common: Vec<(u64, u64, u64)> = ra
        .log_hashes
        .iter()
        .filter_map(|(&seed, &h)| rb.log_hashes.get(&seed).map(|&h2| (seed, h, h2)))
        .collect();
    let differ: Vec<_> = common.iter().filter(|(_, h, h2)| h != h2).collect();
    if let Some(&&(seed, hash_a, hash_b)) = differ.first() {
        return Err(MergeError::Nondeterministic {
            index: rb.shard_index,
            count: rb.shard_count,
            a: a.clone(),
            b: b.clone(),
            seed,
            hash_a,
            hash_b,
            more: match differ.len() {
                1 => String::new(),
                n => format!(" (and {} more seeds)", n - 1),
            },
        });
    }
    let own_failure = |r: &ShardResult, seed: u64| {
        r.failures
            .iter()
            .find(|f| f.seed == seed && f.schedule == 0)
            .map(|f| f.finding.oracle)
    };
    let disagree = |what: String| MergeError::Disagree {
        index: rb.shard_index,
        count: rb.shard_count,
        a: a.clone(),
        b: b.clone(),
        what,
    };
    for &(seed, _, _) in &common {
        let (fa, fb) = (own_failure(ra, seed), own_failure(rb, seed));
        if fa != fb {
            return Err(disagree(format!(
                "seed {seed} failed in one ({fa:?} against {fb:?}) with the same event log"
            )));
        }
    }
    let complete = |r: &ShardResult| !r.interrupted && r.failures.is_empty();
    if complete(ra) && complete(rb) {
        let counts = |r: &ShardResult| {
            let mut t = r.totals;
            t.wall_ns = 0;
            (r.seeds_run, r.runs, t, r.coverage.clone())
        };
        if counts(ra) != counts(rb) {
            return Err(disagree(
                "both ran every seed without a failure, yet their counts (seeds, runs, totals or \
                 coverage) differ"
                    .into(),
            ));
        }
    }
    Ok(common.len() as u64)
}

/// Whether `replay` is a line a person may paste to replay `seed`: a `sim --seed SEED` command
/// (as `tierkv sim` writes it), with no control character and no shell metacharacter.
fn replay_line_of(replay: &str, seed: u64) -> bool {
    let seeded = replay
        .split(" sim --seed ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .is_some_and(|s| s == seed.to_string());
    seeded
        && !replay
            .chars()
            .any(|c| c.is_control() || ";|&$`<>()\\'\"*?!{}".contains(c))
}

/// Why shard results could not be read or merged. Each names the file and the value at fault.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum MergeError {
    #[error("no shard result to merge")]
    Empty,
    #[error("{file}: {why}")]
    Unreadable { file: PathBuf, why: String },
    #[error("{file}: larger than {FILE_BYTES_MAX} bytes: not a shard result")]
    TooLarge { file: PathBuf },
    #[error("{file}: not a shard result: {why}")]
    NotAResult { file: PathBuf, why: String },
    #[error("{file}: format version {found}; this build reads version {VERSION}")]
    Version { file: PathBuf, found: u32 },
    #[error("{file}: shard {index}/{count} is not a shard (need 0 <= I < N <= {SHARDS_MAX})")]
    BadShard {
        file: PathBuf,
        index: u64,
        count: u64,
    },
    #[error("{file}: unknown probe `{probe}` (a result of another build?)")]
    UnknownProbe { file: PathBuf, probe: String },
    #[error("{file}: inconsistent {what}: {why}")]
    Inconsistent {
        file: PathBuf,
        what: &'static str,
        why: String,
    },
    #[error(
        "{file} comes from another build than {first}:\n  {file}: {build_file}\n  {first}: {build_first}\nrun every shard with the same sources, features and profile (`tierkv --version` names a binary's)"
    )]
    OtherBuild {
        file: PathBuf,
        first: PathBuf,
        build_file: String,
        build_first: String,
    },
    #[error("{file} is of another campaign than {first}: {field} {value_file} vs {value_first}")]
    OtherCampaign {
        file: PathBuf,
        first: PathBuf,
        field: &'static str,
        value_file: String,
        value_first: String,
    },
    #[error(
        "shard {index}/{count} ran twice ({a} and {b}) and its seeds' event-log hashes differ: \
         seed {seed} gave {hash_a:#018x} and {hash_b:#018x}{more}: the simulator is not \
         deterministic across these runs (replay the seed on each machine with \
         `tierkv sim --seed {seed} --check-determinism`)"
    )]
    Nondeterministic {
        index: u64,
        count: u64,
        a: PathBuf,
        b: PathBuf,
        seed: u64,
        hash_a: u64,
        hash_b: u64,
        more: String,
    },
    #[error(
        "shard {index}/{count} ran twice ({a} and {b}) and the two results disagree: {what} \
         (a file edited by hand or corrupted?)"
    )]
    Disagree {
        index: u64,
        count: u64,
        a: PathBuf,
        b: PathBuf,
        what: String,
    },
    #[error(
        "the merged {what} overflows a 64-bit count: these results cannot all be true \
         (a file edited by hand or corrupted?)"
    )]
    Overflow { what: &'static str },
    #[error(
        "{file}: shard {index} was interrupted after {seeds_run} seeds; `--partial` merges what \
         it finished"
    )]
    Interrupted {
        file: PathBuf,
        index: u64,
        seeds_run: u64,
    },
    #[error(
        "{missing} of {count} shards missing (index {list}); `--partial` merges the {} present", count - missing
    )]
    Missing {
        missing: u64,
        count: u64,
        list: String,
    },
}

impl ShardResult {
    /// The result of a campaign that ran with `opts`. `replay` gives the command that replays a
    /// failing seed (the CLI's).
    pub fn of(
        opts: &CampaignOptions,
        s: &CampaignSummary,
        replay: impl Fn(&CampaignFailure) -> String,
    ) -> ShardResult {
        let (shard_index, shard_count) = opts.shard.unwrap_or((0, 1));
        let mut coverage: BTreeMap<String, ProbeCount> = all_names()
            .into_iter()
            .map(|name| {
                let (hits, seeds) = s.coverage.probes.get(name).copied().unwrap_or((0, 0));
                (name.to_string(), ProbeCount { hits, seeds })
            })
            .collect();
        // The targets the campaign reached (`targets`): their universe is not listed.
        for (name, &(hits, seeds)) in &s.coverage.probes {
            if targets::is_target_name(name) {
                coverage.insert(name.to_string(), ProbeCount { hits, seeds });
            }
        }
        ShardResult {
            format: FORMAT.to_string(),
            version: VERSION,
            build: Build::current(),
            profile: opts.profile.clone(),
            mutant: opts.mutant.clone(),
            schedules: opts.schedules,
            overlap: opts.overlap,
            requests_max: opts.requests_max,
            cut_share: opts.cut_share,
            first: opts.first,
            end: opts.end,
            shard_index,
            shard_count,
            seeds_run: s.seeds_run,
            runs: s.runs,
            reruns: s.reruns,
            guided: opts.corpus.is_some().then_some(opts.branches),
            branches: s.branches,
            failures: s
                .failures
                .iter()
                .map(|f| FailureRecord {
                    seed: f.seed,
                    schedule: f.schedule,
                    policy: f.policy,
                    finding: f.finding.clone(),
                    replay: replay(f),
                })
                .collect(),
            coverage,
            totals: s.totals,
            wall_s: s.wall.as_secs_f64(),
            worker_s: s.worker.as_secs_f64(),
            jobs: s.jobs,
            held_s: None,
            log_hashes: s.log_hashes.clone(),
            interrupted: s.interrupted.is_some(),
        }
    }

    /// The worker time this result's runs held, seconds: its wall time times its workers, or
    /// for a merged result, that of each of its shards, summed (whether the shards ran at the
    /// same time or one after another).
    pub fn held_s(&self) -> f64 {
        self.held_s.unwrap_or(self.wall_s * self.jobs as f64)
    }

    /// Reads and checks one result file (bounded in size; every field checked).
    pub fn read(file: &Path) -> Result<ShardResult, MergeError> {
        use tierkv_engine::input::{read_text, InputError};
        let text = read_text(file, FILE_BYTES_MAX).map_err(|e| match e {
            InputError::TooLarge { .. } => MergeError::TooLarge {
                file: file.to_path_buf(),
            },
            e => MergeError::Unreadable {
                file: file.to_path_buf(),
                why: e.to_string(),
            },
        })?;
        Self::parse(&text, file)
    }

    /// A result from the JSON text of `file`, checked.
    pub fn parse(text: &str, file: &Path) -> Result<ShardResult, MergeError> {
        let here = || file.to_path_buf();
        // The format and version first, so that another version gets its own message.
        #[derive(Deserialize)]
        struct Head {
            format: String,
            version: u32,
        }
        let head: Head = serde_json::from_str(text).map_err(|e| MergeError::NotAResult {
            file: here(),
            why: e.to_string(),
        })?;
        if head.format != FORMAT {
            return Err(MergeError::NotAResult {
                file: here(),
                why: format!("format `{}`, not `{FORMAT}`", head.format),
            });
        }
        if head.version != VERSION {
            return Err(MergeError::Version {
                file: here(),
                found: head.version,
            });
        }
        let r: ShardResult = serde_json::from_str(text).map_err(|e| MergeError::NotAResult {
            file: here(),
            why: e.to_string(),
        })?;
        r.check(file)?;
        Ok(r)
    }

    /// The failures: each a run of this shard, none twice, no more than the runs, each with a
    /// replay line a person may paste.
    fn check_failures(&self, file: &Path) -> Result<(), MergeError> {
        let inconsistent = |what, why: String| MergeError::Inconsistent {
            file: file.to_path_buf(),
            what,
            why,
        };
        // A guided shard's branches run under schedules of their own, and from its corpus's
        // checkpoints: of any seed, the shard's or not.
        let branch =
            |f: &FailureRecord| self.guided.is_some() && crate::schedule::is_branch(f.schedule);
        let outside = self.failures.iter().find(|f| {
            !branch(f)
                && (f.seed < self.first
                    || f.seed >= self.end
                    || f.seed % self.shard_count != self.shard_index
                    || f.schedule >= self.schedules)
        });
        if let Some(f) = outside {
            return Err(inconsistent(
                "failures",
                format!(
                    "seed {} (schedule {}) is not a run of this shard",
                    f.seed, f.schedule
                ),
            ));
        }
        let distinct: std::collections::BTreeSet<(u64, u64)> =
            self.failures.iter().map(|f| (f.seed, f.schedule)).collect();
        if distinct.len() < self.failures.len() || self.failures.len() as u64 > self.runs {
            return Err(inconsistent(
                "failures",
                format!(
                    "{} failures, {} of them distinct runs, for {} runs",
                    self.failures.len(),
                    distinct.len(),
                    self.runs,
                ),
            ));
        }
        if let Some(f) = self
            .failures
            .iter()
            .find(|f| !replay_line_of(&f.replay, f.seed))
        {
            return Err(inconsistent(
                "failures",
                format!(
                    "seed {}'s replay line is not a `sim --seed {}` command: {:?}",
                    f.seed, f.seed, f.replay
                ),
            ));
        }
        Ok(())
    }

    /// Every coverage name is a probe of this build or a target in its grammar
    /// (`targets::is_target`), and the targets are at most `targets::TARGETS_MAX`.
    fn check_names(&self, file: &Path) -> Result<(), MergeError> {
        let names = all_names();
        let known = |p: &str| names.contains(&p) || targets::is_target(p, &names);
        if let Some(p) = self.coverage.keys().find(|p| !known(p)) {
            return Err(MergeError::UnknownProbe {
                file: file.to_path_buf(),
                probe: p.clone(),
            });
        }
        targets_within_bound(self, file)
    }

    /// The per-seed records against the counts: failures, log hashes, coverage, wall time and
    /// the replay lines (which `merge` prints for a person to paste). `seeds` is how many seeds
    /// the shard holds.
    fn check_records(&self, file: &Path, seeds: u64) -> Result<(), MergeError> {
        let inconsistent = |what, why: String| MergeError::Inconsistent {
            file: file.to_path_buf(),
            what,
            why,
        };
        self.check_failures(file)?;
        // A single shard's result (a merged one holds `held_s`) that was neither interrupted nor
        // stopped at a failure ran every seed of its shard.
        let complete = !self.interrupted && self.failures.is_empty() && self.held_s.is_none();
        if complete && self.seeds_run != seeds {
            return Err(inconsistent(
                "seeds",
                format!(
                    "{} seeds run of the shard's {seeds}, neither interrupted nor stopped at a \
                     failure",
                    self.seeds_run
                ),
            ));
        }
        if self.log_hashes.len() as u64 != self.seeds_run {
            return Err(inconsistent(
                "log hashes",
                format!(
                    "{} for {} seeds run (every seed run has one)",
                    self.log_hashes.len(),
                    self.seeds_run
                ),
            ));
        }
        if let Some((p, c)) = self.coverage.iter().find(|(_, c)| c.hits < c.seeds) {
            return Err(inconsistent(
                "coverage",
                format!("probe {p} hit {} times in {} seeds", c.hits, c.seeds),
            ));
        }
        if self.seeds_run > 0 && self.wall_s <= 0.0 {
            return Err(inconsistent(
                "times",
                format!(
                    "{} seeds run in {} s of wall time",
                    self.seeds_run, self.wall_s
                ),
            ));
        }
        Ok(())
    }

    /// The campaign's schedules a seed, and the cut of its seeds' workloads: a request count of
    /// at least 1, a share in [0, 1], not both (the campaign's own flags refuse the same).
    fn check_options(
        &self,
        inconsistent: &dyn Fn(&'static str, String) -> MergeError,
    ) -> Result<(), MergeError> {
        if self.schedules == 0 || self.schedules > crate::campaign::SCHEDULES_MAX {
            return Err(inconsistent(
                "schedules",
                format!(
                    "{} schedules per seed (a campaign runs 1..={})",
                    self.schedules,
                    crate::campaign::SCHEDULES_MAX
                ),
            ));
        }
        if self.requests_max == Some(0) {
            return Err(inconsistent(
                "requests-max",
                "0 requests (at least 1)".into(),
            ));
        }
        if let Some(p) = self.cut_share.filter(|p| !(0.0..=1.0).contains(p)) {
            return Err(inconsistent(
                "cut-share",
                format!("{p} is not a share in [0, 1]"),
            ));
        }
        if self.requests_max.is_some() && self.cut_share.is_some() {
            return Err(inconsistent(
                "cut",
                "both --requests-max and --cut-share (a campaign takes one)".into(),
            ));
        }
        Ok(())
    }

    /// The runs against the seeds: every seed run ran its schedule 0 and at most `schedules`,
    /// the branches (a guided campaign's alone) beside them.
    fn check_runs(
        &self,
        inconsistent: &dyn Fn(&'static str, String) -> MergeError,
    ) -> Result<(), MergeError> {
        if self.guided.is_none() && self.branches > 0 {
            return Err(inconsistent(
                "branches",
                format!(
                    "{} runs branched from a corpus in a campaign without one",
                    self.branches
                ),
            ));
        }
        if self
            .guided
            .is_some_and(|b| b > crate::campaign::BRANCHES_PER_SEED_MAX)
        {
            return Err(inconsistent(
                "branches",
                format!(
                    "{:?} branches before each fresh seed (a campaign takes 0..={})",
                    self.guided,
                    crate::campaign::BRANCHES_PER_SEED_MAX
                ),
            ));
        }
        // Every seed run ran its schedule 0, and at most `schedules` schedules; the branches
        // are runs beside them; a determinism rerun repeats a run.
        let runs_max = self.seeds_run.saturating_mul(self.schedules);
        let own = self.runs.checked_sub(self.branches);
        if own.is_none_or(|own| own < self.seeds_run || own > runs_max) || self.reruns > self.runs {
            return Err(inconsistent(
                "runs",
                format!(
                    "{} runs ({} of them branches) and {} reruns for {} seeds of {} schedule{} \
                     (need seeds <= runs - branches <= seeds x schedules, reruns <= runs)",
                    self.runs,
                    self.branches,
                    self.reruns,
                    self.seeds_run,
                    self.schedules,
                    if self.schedules == 1 { "" } else { "s" }
                ),
            ));
        }
        Ok(())
    }

    fn check(&self, file: &Path) -> Result<(), MergeError> {
        let here = || file.to_path_buf();
        if self.shard_count == 0
            || self.shard_count > SHARDS_MAX
            || self.shard_index >= self.shard_count
        {
            return Err(MergeError::BadShard {
                file: here(),
                index: self.shard_index,
                count: self.shard_count,
            });
        }
        let inconsistent = |what, why: String| MergeError::Inconsistent {
            file: here(),
            what,
            why,
        };
        if !crate::scenario::PROFILES.contains(&self.profile.as_str()) {
            return Err(inconsistent(
                "profile",
                format!(
                    "`{}` is not one of {}",
                    self.profile,
                    crate::scenario::PROFILES.join(", ")
                ),
            ));
        }
        if let Some(m) = &self.mutant {
            let known = tierkv_engine::mutants::Mutant::parse(m).is_some()
                || tierkv_kernels::mutants::KernelMutant::parse(m).is_some();
            if !known {
                return Err(inconsistent(
                    "mutant",
                    format!("`{m}` is no mutant of this build (`tierkv-zoo zoo --list`)"),
                ));
            }
        }
        self.check_options(&inconsistent)?;
        self.check_names(file)?;
        let set = crate::campaign::SeedSet::new(
            self.first,
            self.end.max(self.first),
            Some((self.shard_index, self.shard_count)),
        );
        if self.end < self.first || self.seeds_run > set.len() {
            return Err(inconsistent(
                "seeds",
                format!(
                    "{} seeds run, the shard {}/{} of {}..{} holds {}",
                    self.seeds_run,
                    self.shard_index,
                    self.shard_count,
                    self.first,
                    self.end,
                    set.len()
                ),
            ));
        }
        self.check_runs(&inconsistent)?;
        // A probe's `seeds` counts the runs that hit it.
        if let Some((p, c)) = self.coverage.iter().find(|(_, c)| c.seeds > self.runs) {
            return Err(inconsistent(
                "coverage",
                format!("probe {p} hit in {} runs of {}", c.seeds, self.runs),
            ));
        }
        self.check_records(file, set.len())?;
        if self.log_hashes.len() as u64 > self.seeds_run {
            return Err(inconsistent(
                "log hashes",
                format!("{} for {} seeds run", self.log_hashes.len(), self.seeds_run),
            ));
        }
        if let Some(seed) = self
            .log_hashes
            .keys()
            .find(|&&s| s < self.first || s >= self.end || s % self.shard_count != self.shard_index)
        {
            return Err(inconsistent(
                "log hashes",
                format!("seed {seed} is not a seed of this shard"),
            ));
        }
        // One shard's workers, or (a merged result, which holds `held_s`) every shard's.
        let jobs_max = match self.held_s {
            None => crate::campaign::JOBS_MAX,
            Some(_) => crate::campaign::JOBS_MAX * SHARDS_MAX as usize,
        };
        if self.jobs == 0 || self.jobs > jobs_max {
            return Err(inconsistent(
                "jobs",
                format!("{} workers (a shard runs 1..={jobs_max})", self.jobs),
            ));
        }
        let time = |t: f64| t.is_finite() && (0.0..=TIME_S_MAX).contains(&t);
        if !(time(self.wall_s) && time(self.worker_s) && self.held_s.is_none_or(time)) {
            return Err(inconsistent(
                "times",
                format!(
                    "wall {} s, worker {} s{} (each must be a number of seconds in 0..={TIME_S_MAX:e})",
                    self.wall_s,
                    self.worker_s,
                    self.held_s
                        .map(|h| format!(", held {h} s"))
                        .unwrap_or_default()
                ),
            ));
        }
        // The workers cannot have run longer than they were held (a little slack for the
        // clocks' rounding).
        if self.worker_s > self.held_s() * 1.01 + 1.0 {
            return Err(inconsistent(
                "times",
                format!(
                    "{} CPU-seconds of work, but {} workers for {} s hold only {} s",
                    self.worker_s,
                    self.jobs,
                    self.wall_s,
                    self.held_s()
                ),
            ));
        }
        Ok(())
    }

    /// This result's campaign (build, options, seed range) as shard 0 of 1 with nothing run:
    /// where a merge adds its shards' counts.
    fn emptied(&self) -> ShardResult {
        ShardResult {
            shard_index: 0,
            shard_count: 1,
            seeds_run: 0,
            runs: 0,
            reruns: 0,
            branches: 0,
            failures: Vec::new(),
            coverage: BTreeMap::new(),
            totals: RunStats::default(),
            wall_s: 0.0,
            worker_s: 0.0,
            jobs: 0,
            log_hashes: BTreeMap::new(),
            interrupted: false,
            ..self.clone()
        }
    }

    /// The same run as a summary, to print.
    pub fn summary(&self) -> CampaignSummary {
        let mut s = CampaignSummary {
            seeds_run: self.seeds_run,
            runs: self.runs,
            reruns: self.reruns,
            branches: self.branches,
            totals: self.totals,
            wall: Duration::from_secs_f64(self.wall_s),
            worker: Duration::from_secs_f64(self.worker_s),
            jobs: self.jobs,
            ..CampaignSummary::default()
        };
        // As a campaign counts them: the runs (`Coverage::add`).
        s.coverage.seeds = self.runs;
        s.coverage.pd = self.profile == "pd";
        for name in all_names() {
            if let Some(c) = self.coverage.get(name) {
                s.coverage.probes.insert(name, (c.hits, c.seeds));
            }
        }
        // Targets' names were checked by `check` (`targets::is_target`): a bounded set.
        for (name, c) in &self.coverage {
            if targets::is_target_name(name) {
                s.coverage
                    .probes
                    .insert(targets::intern(name), (c.hits, c.seeds));
            }
        }
        for f in &self.failures {
            *s.by_oracle.entry(f.finding.oracle).or_default() += 1;
            s.failures.push(CampaignFailure {
                seed: f.seed,
                schedule: f.schedule,
                policy: f.policy,
                finding: f.finding.clone(),
                decisions: Vec::new(),
            });
        }
        s.failures.sort_by_key(|f| (f.seed, f.schedule));
        s.first_failure = s.failures.first().map(|f| f.seed);
        s
    }
}

/// Shard results combined.
#[derive(Clone, Debug)]
pub struct Merged {
    /// The combined result, as shard 0 of 1. With shards missing it is not the whole campaign's
    /// result: print it, never write it as one.
    pub result: ShardResult,
    /// Shards merged, and those missing (a partial merge).
    pub shards: u64,
    pub missing: Vec<u64>,
    /// Files of a shard already merged from another file (run twice): compared, not counted.
    pub repeated: Vec<PathBuf>,
    /// Seeds whose event-log hashes were compared between two runs of their shard (all equal).
    pub cross_checked: u64,
    /// Shards merged from an interrupted run (no complete one given): file, index, seeds run.
    pub interrupted: Vec<(PathBuf, u64, u64)>,
}

/// What two shards of one campaign must agree on: each field's name and its value in `r` and in
/// `first`.
fn campaign_fields(r: &ShardResult, first: &ShardResult) -> [(&'static str, String, String); 10] {
    [
        (
            "guided (--branches)",
            format!("{:?}", r.guided),
            format!("{:?}", first.guided),
        ),
        ("profile", r.profile.clone(), first.profile.clone()),
        (
            "overlap",
            format!("{:?}", r.overlap),
            format!("{:?}", first.overlap),
        ),
        (
            "cut-share",
            format!("{:?}", r.cut_share),
            format!("{:?}", first.cut_share),
        ),
        (
            "requests-max",
            format!("{:?}", r.requests_max),
            format!("{:?}", first.requests_max),
        ),
        (
            "mutant",
            format!("{:?}", r.mutant),
            format!("{:?}", first.mutant),
        ),
        (
            "schedules",
            r.schedules.to_string(),
            first.schedules.to_string(),
        ),
        (
            "seeds",
            format!("{}..{}", r.first, r.end),
            format!("{}..{}", first.first, first.end),
        ),
        (
            "shard count",
            r.shard_count.to_string(),
            first.shard_count.to_string(),
        ),
        (
            "format version",
            r.version.to_string(),
            first.version.to_string(),
        ),
    ]
}

/// Combines the results of one campaign's shards. `partial`: merge even when shards are missing.
pub fn merge(results: &[(PathBuf, ShardResult)], partial: bool) -> Result<Merged, MergeError> {
    let Some((first_file, first)) = results.first() else {
        return Err(MergeError::Empty);
    };
    let mut seen: BTreeMap<u64, (&PathBuf, &ShardResult)> = BTreeMap::new();
    let mut cross_checked = 0u64;
    let mut repeated: Vec<PathBuf> = Vec::new();
    for (file, r) in results {
        if r.build != first.build {
            return Err(MergeError::OtherBuild {
                file: file.clone(),
                first: first_file.clone(),
                build_file: r.build.to_string(),
                build_first: first.build.to_string(),
            });
        }
        let fields = campaign_fields(r, first);
        if let Some((field, value_file, value_first)) = fields.into_iter().find(|(_, a, b)| a != b)
        {
            return Err(MergeError::OtherCampaign {
                file: file.clone(),
                first: first_file.clone(),
                field,
                value_file,
                value_first,
            });
        }
        match seen.get(&r.shard_index) {
            None => {
                seen.insert(r.shard_index, (file, r));
            }
            // The same shard run twice (on two machines, or again after a preemption): every
            // seed both ran must have given the same event log. The first is kept.
            Some(&(a, ra)) => {
                cross_checked += compare_runs((a, ra), (file, r))?;
                // A complete run of the shard is kept over an interrupted one.
                if ra.interrupted && !r.interrupted {
                    repeated.push(a.clone());
                    seen.insert(r.shard_index, (file, r));
                } else {
                    repeated.push(file.clone());
                }
            }
        }
    }
    // A shard only an interrupted run holds is partial.
    let cut: Vec<(PathBuf, u64, u64)> = seen
        .values()
        .filter(|(_, r)| r.interrupted)
        .map(|(f, r)| ((*f).clone(), r.shard_index, r.seeds_run))
        .collect();
    if let (Some((file, index, seeds_run)), false) = (cut.first(), partial) {
        return Err(MergeError::Interrupted {
            file: file.clone(),
            index: *index,
            seeds_run: *seeds_run,
        });
    }
    let count = first.shard_count;
    let missing: Vec<u64> = if (seen.len() as u64) < count {
        (0..count).filter(|i| !seen.contains_key(i)).collect()
    } else {
        Vec::new()
    };
    if !missing.is_empty() && !partial {
        return Err(MergeError::Missing {
            missing: missing.len() as u64,
            count,
            list: shown_list(&missing),
        });
    }
    let mut m = first.emptied();
    // Every count is summed with a check: files can hold anything, and a wrapped total would
    // be printed as if it were true.
    let sum =
        |what: &'static str, a: u64, b: u64| a.checked_add(b).ok_or(MergeError::Overflow { what });
    let mut held_s = 0.0;
    for (_, r) in seen.values() {
        held_s += r.held_s();
        m.log_hashes.extend(&r.log_hashes);
        m.seeds_run = sum("seeds run", m.seeds_run, r.seeds_run)?;
        m.runs = sum("runs", m.runs, r.runs)?;
        m.reruns = sum("reruns", m.reruns, r.reruns)?;
        m.branches = sum("branches", m.branches, r.branches)?;
        m.failures.extend(r.failures.iter().cloned());
        for (name, c) in &r.coverage {
            let e = m.coverage.entry(name.clone()).or_default();
            e.hits = sum("probe hits", e.hits, c.hits)?;
            e.seeds = sum("probe seeds", e.seeds, c.seeds)?;
        }
        m.totals = m
            .totals
            .checked_add(&r.totals)
            .map_err(|what| MergeError::Overflow { what })?;
        m.wall_s = m.wall_s.max(r.wall_s);
        m.worker_s += r.worker_s;
        m.jobs = (m.jobs.checked_add(r.jobs)).ok_or(MergeError::Overflow { what: "jobs" })?;
    }
    sum("checked reads", m.totals.rows_checked, m.totals.rows_cached)?;
    targets_within_bound(&m, first_file)?;
    m.held_s = Some(held_s);
    m.interrupted = seen.values().any(|(_, r)| r.interrupted);
    m.failures.sort_by_key(|f| (f.seed, f.schedule));
    Ok(Merged {
        result: m,
        shards: seen.len() as u64,
        missing,
        repeated,
        cross_checked,
        interrupted: cut,
    })
}

/// `result` (one shard's, or the shards' merged) holds at most `targets::TARGETS_MAX` targets;
/// `file` names it (the first of a merge's).
fn targets_within_bound(result: &ShardResult, file: &Path) -> Result<(), MergeError> {
    let targets = result
        .coverage
        .keys()
        .filter(|n| targets::is_target_name(n));
    if targets.count() > targets::TARGETS_MAX {
        return Err(MergeError::Inconsistent {
            file: file.to_path_buf(),
            what: "coverage",
            why: format!("more than {} targets", targets::TARGETS_MAX),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::OracleKind;

    /// Shard `i` of 2 over seeds 0..10: 5 seeds, `fails` failing at `seed` under schedule 0.
    fn result(i: u64, fails: &[u64]) -> ShardResult {
        let mut coverage: BTreeMap<String, ProbeCount> = all_names()
            .into_iter()
            .map(|n| (n.to_string(), ProbeCount::default()))
            .collect();
        coverage.insert(
            "load.issued".into(),
            ProbeCount {
                hits: 10 + i,
                seeds: 2,
            },
        );
        ShardResult {
            format: FORMAT.into(),
            version: VERSION,
            build: Build::current(),
            profile: "swarm".into(),
            mutant: None,
            schedules: 1,
            overlap: None,
            requests_max: None,
            cut_share: None,
            first: 0,
            end: 10,
            shard_index: i,
            shard_count: 2,
            seeds_run: 5,
            runs: 5,
            reruns: 1,
            guided: None,
            branches: 0,
            failures: fails
                .iter()
                .map(|&seed| FailureRecord {
                    seed,
                    schedule: 0,
                    policy: None,
                    finding: Finding {
                        oracle: OracleKind::Race,
                        time_ns: 1,
                        message: "a race".into(),
                    },
                    replay: format!("tierkv sim --seed {seed}"),
                })
                .collect(),
            coverage,
            totals: RunStats {
                ops: 100,
                ..RunStats::default()
            },
            wall_s: 2.0 + i as f64,
            worker_s: 4.0,
            jobs: 2,
            held_s: None,
            log_hashes: (0..10).filter(|s| s % 2 == i).map(|s| (s, s * 7)).collect(),
            interrupted: false,
        }
    }

    #[test]
    fn records_that_cannot_be_true_are_refused() {
        let what = |mut r: ShardResult, edit: fn(&mut ShardResult)| {
            edit(&mut r);
            match ShardResult::parse(&serde_json::to_string(&r).unwrap(), Path::new("bad")) {
                Err(MergeError::Inconsistent { what, .. }) => what,
                other => panic!("not refused as inconsistent: {other:?}"),
            }
        };
        // A complete shard (not interrupted, no failure) that ran fewer seeds than it holds.
        assert_eq!(
            what(result(0, &[]), |r| {
                r.seeds_run = 4;
                r.runs = 4;
                r.log_hashes.pop_first();
            }),
            "seeds"
        );
        assert_eq!(what(result(1, &[3, 3]), |_| {}), "failures");
        assert_eq!(
            what(result(1, &[3]), |r| r.failures[0].replay =
                "rm -rf /".into()),
            "failures"
        );
        assert_eq!(
            what(result(1, &[3]), |r| r.failures[0].replay =
                "tierkv sim --seed 3; rm -rf /".into()),
            "failures"
        );
        assert_eq!(
            what(result(1, &[3]), |r| {
                r.log_hashes.clear();
            }),
            "log hashes"
        );
        assert_eq!(
            what(result(1, &[3]), |r| r
                .coverage
                .get_mut("load.issued")
                .unwrap()
                .hits = 1),
            "coverage"
        );
        assert_eq!(what(result(1, &[3]), |r| r.wall_s = 0.0), "times");
    }

    /// A guided shard: 3 of its 8 runs branched from the corpus, one of them (seed 3's) failed.
    fn guided(i: u64) -> ShardResult {
        let mut r = result(i, &[]);
        r.guided = Some(1);
        r.runs = 8;
        r.branches = 3;
        r.coverage.get_mut("load.issued").unwrap().seeds = 7;
        r
    }

    #[test]
    fn guided_shards_count_their_branches_and_merge_only_with_their_kind() {
        let branch = crate::schedule::branch_index(2);
        let failing = |mut r: ShardResult, seed: u64| {
            r.failures.push(FailureRecord {
                seed,
                schedule: branch,
                policy: Some(Policy::Pct { depth: 2, ops: 40 }),
                finding: Finding {
                    oracle: OracleKind::Race,
                    time_ns: 1,
                    message: "a race".into(),
                },
                replay: format!("tierkv sim --seed {seed} --schedule out/s.json"),
            });
            r
        };
        let read = |r: &ShardResult| {
            ShardResult::parse(&serde_json::to_string(r).unwrap(), Path::new("g"))
        };
        // A probe hit in more runs than seeds (7 of 8 runs, 5 seeds) and a branch's failure,
        // of a seed from the corpus that is not the shard's.
        let (a, b) = (failing(guided(1), 40), guided(0));
        assert_eq!(read(&a).as_ref(), Ok(&a));
        let m = merge(
            &[(PathBuf::from("a"), a.clone()), (PathBuf::from("b"), b)],
            false,
        )
        .expect("two guided shards merge");
        assert_eq!((m.result.runs, m.result.branches), (16, 6));
        assert_eq!(m.result.guided, Some(1));
        assert_eq!(m.result.failures.len(), 1);
        let s = m.result.summary();
        assert_eq!((s.branches, s.coverage.seeds), (6, 16));
        // Refused: a guided shard beside a plain one, or one of another `--branches`.
        let other = |edit: fn(&mut ShardResult)| {
            let mut r = guided(0);
            edit(&mut r);
            match merge(
                &[(PathBuf::from("a"), a.clone()), (PathBuf::from("b"), r)],
                false,
            ) {
                Err(MergeError::OtherCampaign { field, .. }) => field,
                other => panic!("merged: {other:?}"),
            }
        };
        assert_eq!(other(|r| r.guided = Some(2)), "guided (--branches)");
        assert_eq!(
            other(|r| {
                r.guided = None;
                r.runs = 5;
                r.branches = 0;
                r.coverage.get_mut("load.issued").unwrap().seeds = 2;
            }),
            "guided (--branches)"
        );
        // Refused as inconsistent: branches without a corpus, a branch's failure in a plain
        // shard, more branches than leave each seed its run, a probe hit in more runs than ran.
        let what = |r: ShardResult| match read(&r) {
            Err(MergeError::Inconsistent { what, .. }) => what,
            other => panic!("not refused as inconsistent: {other:?}"),
        };
        let mut r = guided(0);
        r.guided = None;
        assert_eq!(what(r), "branches");
        let r = failing(result(1, &[]), 3);
        assert_eq!(what(r), "failures");
        let mut r = guided(0);
        r.branches = 4;
        assert_eq!(what(r), "runs");
        let mut r = guided(0);
        r.branches = 9;
        assert_eq!(what(r), "runs");
        let mut r = guided(0);
        r.coverage.get_mut("load.issued").unwrap().seeds = 9;
        assert_eq!(what(r), "coverage");
        let mut r = guided(0);
        r.guided = Some(crate::campaign::BRANCHES_PER_SEED_MAX + 1);
        assert_eq!(what(r), "branches");
    }

    #[test]
    fn two_runs_of_a_shard_that_disagree_are_refused() {
        let twice = |a: ShardResult, b: ShardResult| {
            merge(&[(PathBuf::from("a"), a), (PathBuf::from("b"), b)], true)
        };
        let mut more = result(0, &[]);
        more.totals.ops += 1;
        assert!(matches!(
            twice(result(0, &[]), more),
            Err(MergeError::Disagree { index: 0, .. })
        ));
        // Seed 3 ran in both with the same event log; it failed in one only.
        assert!(matches!(
            twice(result(1, &[3]), result(1, &[])),
            Err(MergeError::Disagree { index: 1, .. })
        ));
        // The same run twice merges (as a determinism check).
        assert!(twice(result(1, &[3]), result(1, &[3])).is_ok());
    }

    #[test]
    fn merging_adds_counts_and_keeps_every_failure_in_seed_order() {
        let files = [
            (PathBuf::from("b"), result(1, &[7, 3])),
            (PathBuf::from("a"), result(0, &[4])),
        ];
        let m = merge(&files, false).expect("merge");
        let r = &m.result;
        assert_eq!((m.shards, m.missing.len()), (2, 0));
        assert_eq!((r.shard_index, r.shard_count), (0, 1));
        assert_eq!((r.seeds_run, r.runs, r.reruns), (10, 10, 2));
        assert_eq!(r.coverage["load.issued"], ProbeCount { hits: 21, seeds: 4 });
        assert_eq!(r.totals.ops, 200);
        assert_eq!((r.wall_s, r.worker_s, r.jobs), (3.0, 8.0, 4));
        // Walls of 2 s and 3 s on 2 workers each: 10 worker-seconds held, whatever their order,
        // kept when the merged result is merged again.
        assert_eq!(r.held_s(), 10.0);
        let again = merge(&[(PathBuf::from("m"), r.clone())], false).expect("merge again");
        assert_eq!(again.result.held_s(), 10.0);
        let seeds: Vec<u64> = r.failures.iter().map(|f| f.seed).collect();
        assert_eq!(seeds, [3, 4, 7]);
        let s = r.summary();
        assert_eq!(s.first_failure, Some(3));
        assert_eq!(s.by_oracle[&OracleKind::Race], 3);
        assert!((s.coverage.fraction("load.issued") - 0.4).abs() < 1e-12);
        // The merged result reads back as a result of its own.
        let text = serde_json::to_string(r).unwrap();
        assert_eq!(&ShardResult::parse(&text, Path::new("merged")).unwrap(), r);
    }

    #[test]
    fn a_result_that_does_not_add_up_is_refused() {
        let bad = |edit: fn(&mut ShardResult)| {
            let mut r = result(1, &[3]);
            edit(&mut r);
            ShardResult::parse(&serde_json::to_string(&r).unwrap(), Path::new("bad")).unwrap_err()
        };
        assert!(matches!(
            bad(|r| r.shard_index = 2),
            MergeError::BadShard { .. }
        ));
        assert!(matches!(
            bad(|r| r.failures[0].seed = 4),
            MergeError::Inconsistent {
                what: "failures",
                ..
            }
        ));
        assert!(matches!(
            bad(|r| r.seeds_run = 6),
            MergeError::Inconsistent { what: "seeds", .. }
        ));
        assert!(matches!(
            bad(|r| r.coverage.get_mut("load.issued").unwrap().seeds = 9),
            MergeError::Inconsistent {
                what: "coverage",
                ..
            }
        ));
        assert!(matches!(
            bad(|r| {
                r.coverage
                    .insert("no.such_probe".into(), ProbeCount::default());
            }),
            MergeError::UnknownProbe { .. }
        ));
        // Targets: a name in their grammar is taken, and is one of the summary's; one outside
        // it (an op this build has not) is refused.
        let pair = "hb.device_kv.page_copy@load:w>sparse_read@compute:r";
        let mut with_pair = result(0, &[]);
        with_pair
            .coverage
            .insert(pair.into(), ProbeCount { hits: 2, seeds: 2 });
        let text = serde_json::to_string(&with_pair).expect("serialise");
        let back = ShardResult::parse(&text, Path::new("x.json")).expect("a target is taken");
        assert_eq!(back.summary().coverage.probes.get(pair), Some(&(2, 2)));
        assert!(matches!(
            bad(|r| {
                r.coverage.insert(
                    "hb.device_kv.mystery@load:w>sparse_read@compute:r".into(),
                    ProbeCount::default(),
                );
            }),
            MergeError::UnknownProbe { .. }
        ));
        assert!(matches!(
            bad(|r| {
                for i in 0..=targets::TARGETS_MAX {
                    r.coverage.insert(
                        format!("hb.scratch_b{i}.copy@load:w>copy@write:r"),
                        ProbeCount::default(),
                    );
                }
            }),
            MergeError::Inconsistent {
                what: "coverage",
                ..
            }
        ));
        assert!(matches!(
            bad(|r| r.wall_s = -1.0),
            MergeError::Inconsistent { what: "times", .. }
        ));
        assert!(matches!(
            bad(|r| r.format = "other".into()),
            MergeError::NotAResult { .. }
        ));
        assert!(matches!(
            ShardResult::parse("[1, 2]", Path::new("list")).unwrap_err(),
            MergeError::NotAResult { .. }
        ));
        assert!(matches!(
            bad(|r| {
                r.log_hashes.insert(2, 0);
            }),
            MergeError::Inconsistent {
                what: "log hashes",
                ..
            }
        ));
        assert_eq!(merge(&[], false).unwrap_err(), MergeError::Empty);
        let what = |e: MergeError| match e {
            MergeError::Inconsistent { what, .. } => what,
            other => panic!("not an inconsistency: {other}"),
        };
        assert_eq!(what(bad(|r| r.wall_s = 1e300)), "times", "past Duration");
        assert_eq!(
            what(bad(|r| r.worker_s = 100.0)),
            "times",
            "busier than held"
        );
        assert_eq!(what(bad(|r| r.jobs = 0)), "jobs");
        assert_eq!(what(bad(|r| r.jobs = usize::MAX)), "jobs");
        assert_eq!(what(bad(|r| r.runs = 4)), "runs", "fewer runs than seeds");
        assert_eq!(
            what(bad(|r| r.runs = 6)),
            "runs",
            "more than one schedule each"
        );
        assert_eq!(what(bad(|r| r.reruns = 6)), "runs", "more reruns than runs");
        assert_eq!(what(bad(|r| r.schedules = 0)), "schedules");
        assert_eq!(what(bad(|r| r.profile = "nope".into())), "profile");
        assert_eq!(what(bad(|r| r.mutant = Some("nope".into()))), "mutant");
        assert_eq!(what(bad(|r| r.requests_max = Some(0))), "requests-max");
        assert_eq!(what(bad(|r| r.cut_share = Some(7.5))), "cut-share");
        assert_eq!(what(bad(|r| r.cut_share = Some(-1.0))), "cut-share");
        let both = |r: &mut ShardResult| {
            r.requests_max = Some(3);
            r.cut_share = Some(0.5);
        };
        assert_eq!(what(bad(both)), "cut");
        let mut zoo = result(1, &[3]);
        zoo.mutant = Some("ungated-index-k-read".into());
        let text = serde_json::to_string(&zoo).unwrap();
        assert!(
            ShardResult::parse(&text, Path::new("zoo")).is_ok(),
            "a known mutant"
        );
    }

    /// An interrupted shard merges only with `--partial`, and the merge says it is partial.
    #[test]
    fn an_interrupted_shard_merges_only_when_partial() {
        let mut cut = result(1, &[]);
        cut.interrupted = true;
        cut.seeds_run = 2;
        cut.runs = 2;
        cut.log_hashes.retain(|&s, _| s < 5);
        let files = [
            (PathBuf::from("a"), result(0, &[])),
            (PathBuf::from("b"), cut),
        ];
        assert!(matches!(
            merge(&files, false).unwrap_err(),
            MergeError::Interrupted {
                index: 1,
                seeds_run: 2,
                ..
            }
        ));
        let m = merge(&files, true).expect("a partial merge");
        assert!(m.result.interrupted && m.missing.is_empty());
        assert_eq!(m.result.seeds_run, 7);
        let text = serde_json::to_string(&result(0, &[])).unwrap();
        assert!(!text.contains("interrupted"), "left out when false");
        // Beside a complete run of the same shard, in either order, the complete one is kept
        // and the merge is whole.
        let whole = (PathBuf::from("c"), result(1, &[]));
        for files in [
            [files[0].clone(), files[1].clone(), whole.clone()],
            [files[0].clone(), whole.clone(), files[1].clone()],
        ] {
            let m = merge(&files, false).expect("the complete run stands in");
            assert!(!m.result.interrupted && m.interrupted.is_empty());
            assert_eq!(m.result.seeds_run, 10);
        }
    }

    /// Counts whose sum passes `u64::MAX` are refused, naming the count, never wrapped.
    #[test]
    fn a_merge_whose_sums_overflow_is_refused() {
        let big = |i: u64, edit: fn(&mut ShardResult)| {
            let mut r = result(i, &[]);
            edit(&mut r);
            (PathBuf::from(format!("{i}")), r)
        };
        let refused =
            |edit: fn(&mut ShardResult)| merge(&[big(0, edit), big(1, edit)], false).unwrap_err();
        assert_eq!(
            refused(|r| r.totals.ops = u64::MAX / 2 + 1),
            MergeError::Overflow { what: "ops" }
        );
        assert_eq!(
            refused(|r| r.coverage.get_mut("load.issued").unwrap().hits = u64::MAX),
            MergeError::Overflow { what: "probe hits" }
        );
        assert_eq!(
            refused(|r| {
                r.totals.rows_checked = u64::MAX / 3;
                r.totals.rows_cached = u64::MAX / 3;
            }),
            MergeError::Overflow {
                what: "checked reads"
            },
            "rows checked fit, and with the cached rows they do not"
        );
    }

    /// A shard run twice is merged once when every seed gave the same event log, and refused
    /// when one did not.
    #[test]
    fn a_shard_run_twice_is_a_determinism_check() {
        let files = [
            (PathBuf::from("a"), result(0, &[4])),
            (PathBuf::from("b"), result(1, &[])),
            (PathBuf::from("a-again"), result(0, &[4])),
        ];
        let m = merge(&files, false).expect("the same logs");
        assert_eq!((m.shards, m.cross_checked), (2, 5));
        assert_eq!(m.repeated, [PathBuf::from("a-again")]);
        assert_eq!(m.result.seeds_run, 10, "the second run is not counted");
        let mut other = result(0, &[4]);
        other.log_hashes.insert(6, 1);
        let files = [
            (PathBuf::from("a"), result(0, &[4])),
            (PathBuf::from("a-elsewhere"), other),
        ];
        match merge(&files, false).unwrap_err() {
            MergeError::Nondeterministic { seed, hash_b, .. } => assert_eq!((seed, hash_b), (6, 1)),
            e => panic!("{e}"),
        }
    }
}
