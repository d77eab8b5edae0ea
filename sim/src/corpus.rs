//! The corpus of a guided campaign: checkpoints to branch from (`tierkv sim --corpus FILE`).
//!
//! A checkpoint is a seed and a prefix of one of its runs' schedules. A run is a function of its
//! scenario and its decisions, so replaying the prefix on the seed's scenario brings a run back
//! to the state it was in when it had made them; a branch replays it and draws the decisions
//! after it afresh (`schedule::Source::Branch`), so the run leaves that state another way.
//!
//! What is kept: after each run that did not fail, once the corpus has counted
//! [`WARM_UP_RUNS`] runs, for each probe the run hit while the probe was rare (hit by fewer than
//! [`RARE_SHARE`] of the runs counted), the prefix up to the probe's first hit in that run
//! (`probe::first_hits`), at most [`PER_PROBE_MAX`] checkpoints a probe, [`CHECKPOINTS_MAX`] and
//! [`PREFIX_DECISIONS_MAX`] decisions in all. A campaign with a corpus runs, before each fresh
//! seed, `--branches` runs that branch from the checkpoints branched least so far (of equals,
//! the one whose probe's count of runs times its run's decisions is least: rare and short
//! first, [`Corpus::pick`]), and counts every run it makes into the corpus.
//!
//! A checkpoint names its seed, not its scenario: under another mutant, `--overlap` or build the
//! seed's scenario may differ, and its prefix, still a valid schedule, may lead elsewhere.
//!
//! Measured on 8 mutants of the bug zoo (sim/CAMPAIGNS.md), a guided campaign was slower to a
//! catch than the plain one with probes alone in its corpus, and about as fast with the targets
//! in it (sooner for some mutants, later for the slowest): the zoo's slow mutants need a
//! scenario more than an interleaving, and a branch keeps its checkpoint's scenario. It is
//! opt-in.
//!
//! The probes include the targets of `targets` (happens-before pairs, combinations of a run's
//! factors, the levels of the engine's watermarks), so a rare one is kept as a probe is; a
//! combination of two configuration factors is reached at a run's start (an empty prefix: its
//! branches are fresh runs of the seed). Not done: a checkpoint's worth measured by what its
//! branches went on to find.
//!
//! The file is JSON, read and written whole; `campaign merge-corpus` combines files of one
//! profile. What would make a file unusable is refused when it is read ([`CorpusError`]).

use crate::schedule::{Policy, DECISIONS_MAX, DECISION_MAX};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The corpus file format this build reads and writes.
pub const FORMAT: u32 = 1;
/// A probe is rare while fewer than this share of the counted runs hit it.
pub const RARE_SHARE: f64 = 0.05;
/// The most checkpoints kept for one probe.
pub const PER_PROBE_MAX: usize = 4;
/// The most checkpoints a corpus holds (a probe's checkpoints beyond it are not kept).
pub const CHECKPOINTS_MAX: usize = 4096;
/// Runs a corpus counts before it keeps any checkpoint: until then no share of runs says which
/// probes are rare.
pub const WARM_UP_RUNS: u64 = 20;
/// The most decisions a corpus's prefixes hold together, so that the file it writes stays under
/// [`FILE_BYTES_MAX`] (a decision is at most three digits and a comma).
pub const PREFIX_DECISIONS_MAX: usize = 32 << 20;
/// The most bytes a corpus file may hold.
pub const FILE_BYTES_MAX: u64 = 256 << 20;

/// One checkpoint: the seed, and the decisions that brought its run to the first hit of `probe`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub seed: u64,
    /// The rare probe whose first hit the prefix reached.
    pub probe: String,
    /// The policy the run drew its schedule with: a branch draws the rest with it.
    pub policy: Policy,
    pub prefix: Vec<u8>,
    /// How many decisions the whole run made: what a branch from it is expected to cost.
    pub run_decisions: u64,
    /// How many runs branched from it so far.
    pub branched: u64,
}

/// A corpus: its checkpoints, and how many of the runs it counted hit each probe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Corpus {
    pub format: u32,
    /// The scenario profile its seeds are drawn under.
    pub profile: String,
    /// Runs counted.
    pub runs: u64,
    /// For each probe, how many of those runs hit it.
    pub seen: BTreeMap<String, u64>,
    pub checkpoints: Vec<Checkpoint>,
}

/// A corpus file that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CorpusError {
    #[error("could not read it: {0}")]
    Read(String),
    #[error("not a corpus (JSON as `tierkv sim --corpus` writes it): {0}")]
    NotJson(String),
    #[error("corpus format {0} is not this build's ({FORMAT})")]
    OtherFormat(u32),
    #[error("it is a corpus of profile `{file}`, this campaign's profile is `{want}`")]
    OtherProfile { file: String, want: String },
    #[error("it holds {0} checkpoints, over the limit of {CHECKPOINTS_MAX}")]
    TooMany(usize),
    #[error("its prefixes hold {0} decisions, over the limit of {PREFIX_DECISIONS_MAX}")]
    TooManyDecisions(usize),
    #[error("checkpoint {at}: {why}")]
    Checkpoint { at: usize, why: String },
    #[error("probe `{probe}` was hit by {seen} runs of the {runs} counted")]
    SeenPastRuns { probe: String, seen: u64, runs: u64 },
    #[error("the merged counts overflow")]
    Overflow,
}

impl Corpus {
    pub fn new(profile: &str) -> Corpus {
        Corpus {
            format: FORMAT,
            profile: profile.to_string(),
            runs: 0,
            seen: BTreeMap::new(),
            checkpoints: Vec::new(),
        }
    }

    /// The corpus in `file` for a campaign of `profile`; a new one when the file does not exist.
    pub fn read_or_new(file: &Path, profile: &str) -> Result<Corpus, CorpusError> {
        if !file.exists() {
            return Ok(Corpus::new(profile));
        }
        let c = Corpus::read(file)?;
        if c.profile != profile {
            return Err(CorpusError::OtherProfile {
                file: c.profile,
                want: profile.to_string(),
            });
        }
        Ok(c)
    }

    /// The corpus in `file` (at most [`FILE_BYTES_MAX`] bytes), checked ([`Corpus::parse`]).
    pub fn read(file: &Path) -> Result<Corpus, CorpusError> {
        let text = tierkv_engine::input::read_text(file, FILE_BYTES_MAX)
            .map_err(|e| CorpusError::Read(e.to_string()))?;
        Corpus::parse(&text)
    }

    /// A corpus file's text, checked: what would make it unusable is refused.
    pub fn parse(text: &str) -> Result<Corpus, CorpusError> {
        let c: Corpus =
            serde_json::from_str(text).map_err(|e| CorpusError::NotJson(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), CorpusError> {
        if self.format != FORMAT {
            return Err(CorpusError::OtherFormat(self.format));
        }
        if self.checkpoints.len() > CHECKPOINTS_MAX {
            return Err(CorpusError::TooMany(self.checkpoints.len()));
        }
        for (probe, &seen) in &self.seen {
            if seen > self.runs {
                return Err(CorpusError::SeenPastRuns {
                    probe: probe.clone(),
                    seen,
                    runs: self.runs,
                });
            }
        }
        let total: usize = self.checkpoints.iter().map(|c| c.prefix.len()).sum();
        if total > PREFIX_DECISIONS_MAX {
            return Err(CorpusError::TooManyDecisions(total));
        }
        for (at, c) in self.checkpoints.iter().enumerate() {
            let depth_max = crate::scenario::limits::PCT_DEPTH_MAX;
            let bad_policy = match c.policy {
                Policy::Pct { depth, ops }
                    if !(1..=depth_max).contains(&depth) || ops > DECISIONS_MAX as u64 =>
                {
                    Some((depth, ops))
                }
                _ => None,
            };
            let why = if let Some((depth, ops)) = bad_policy {
                format!(
                    "PCT of depth {depth} over {ops} op starts (a campaign draws depth \
                     1..={depth_max} over at most {DECISIONS_MAX})"
                )
            } else if c.prefix.len() > DECISIONS_MAX {
                format!("{} decisions, over {DECISIONS_MAX}", c.prefix.len())
            } else if let Some(d) = c.prefix.iter().find(|&&d| d > DECISION_MAX) {
                format!("decision {d}, over the largest {DECISION_MAX}")
            } else if !self.seen.contains_key(&c.probe) {
                format!("probe `{}` was never counted as hit", c.probe)
            } else {
                continue;
            };
            return Err(CorpusError::Checkpoint { at, why });
        }
        Ok(())
    }

    /// Counts a run that ended: its seed, the policy its schedule was drawn with, its decisions,
    /// the probes it hit (with their counts) and where each was first hit. Keeps checkpoints only
    /// for a run that did not fail. Returns how many it kept.
    pub fn observe(
        &mut self,
        seed: u64,
        policy: Policy,
        decisions: &[u8],
        probes: &BTreeMap<&'static str, u64>,
        first_hits: &BTreeMap<&'static str, u64>,
        failed: bool,
    ) -> usize {
        let mut kept = 0;
        for &probe in probes.keys() {
            let seen = self.seen.get(probe).copied().unwrap_or(0);
            let rare = self.runs >= WARM_UP_RUNS && (seen as f64) < RARE_SHARE * self.runs as f64;
            if failed || !rare {
                continue;
            }
            let at = *first_hits
                .get(probe)
                .expect("every probe hit has its first hit (probe::hit_named)")
                as usize;
            let at = at.min(decisions.len());
            let prefix = &decisions[..at];
            // (A branch that reaches its own checkpoint's probe at the same decision adds nothing.)
            if !self.has_room(seed, probe, prefix) {
                continue;
            }
            self.checkpoints.push(Checkpoint {
                seed,
                probe: probe.to_string(),
                policy,
                prefix: prefix.to_vec(),
                run_decisions: decisions.len() as u64,
                branched: 0,
            });
            kept += 1;
        }
        self.runs = self.runs.saturating_add(1);
        for &probe in probes.keys() {
            let n = self.seen.entry(probe.to_string()).or_default();
            *n = n.saturating_add(1);
        }
        kept
    }

    /// Whether a checkpoint of `probe` with `prefix` on `seed` may be added: none like it is
    /// held, its probe has fewer than [`PER_PROBE_MAX`], and the corpus stays within
    /// [`CHECKPOINTS_MAX`] and [`PREFIX_DECISIONS_MAX`].
    fn has_room(&self, seed: u64, probe: &str, prefix: &[u8]) -> bool {
        let (mut held, mut decisions) = (0, prefix.len());
        for k in &self.checkpoints {
            if k.seed == seed && k.probe == probe && k.prefix == prefix {
                return false;
            }
            held += (k.probe == probe) as usize;
            decisions += k.prefix.len();
        }
        held < PER_PROBE_MAX
            && self.checkpoints.len() < CHECKPOINTS_MAX
            && decisions <= PREFIX_DECISIONS_MAX
    }

    /// The checkpoint to branch from next: the one branched least, of those the one whose
    /// probe's count of runs that hit it times the decisions of its run is least (rare and
    /// cheap first), then the first kept. Counts the branch.
    pub fn pick(&mut self) -> Option<Checkpoint> {
        let seen = &self.seen;
        let at = (0..self.checkpoints.len()).min_by_key(|&i| {
            let c = &self.checkpoints[i];
            let rarity = seen.get(&c.probe).copied().unwrap_or(0);
            (c.branched, rarity.saturating_mul(c.run_decisions.max(1)), i)
        })?;
        self.checkpoints[at].branched = self.checkpoints[at].branched.saturating_add(1);
        Some(self.checkpoints[at].clone())
    }

    /// Adds `other`'s counts and checkpoints (those it holds that this one does not, while
    /// there is room: none like it held, under each limit).
    pub fn merge(&mut self, other: &Corpus) -> Result<(), CorpusError> {
        if other.profile != self.profile {
            return Err(CorpusError::OtherProfile {
                file: other.profile.clone(),
                want: self.profile.clone(),
            });
        }
        self.runs = self
            .runs
            .checked_add(other.runs)
            .ok_or(CorpusError::Overflow)?;
        for (probe, &n) in &other.seen {
            let s = self.seen.entry(probe.clone()).or_default();
            *s = s.checked_add(n).ok_or(CorpusError::Overflow)?;
        }
        for c in &other.checkpoints {
            if self.has_room(c.seed, &c.probe, &c.prefix) {
                self.checkpoints.push(c.clone());
            }
        }
        Ok(())
    }

    /// The corpus as its file holds it.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a corpus serialises")
    }
}

#[cfg(test)]
mod tests;
