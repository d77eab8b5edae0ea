//! Schedules: the decisions the simulated GPU and the runner's clients leave open, kept apart
//! from the scenario.
//!
//! A scenario fixes the configuration, the workload, the timing and fault models (latencies,
//! bandwidths, fault rates) and the seeds of their generators. A schedule fixes the decisions
//! of six kinds ([`Kind`]) that the simulated GPU and the runner leave open:
//! - **hold**: every time an op could start on a stream (its stream is free and the waits
//!   before it are satisfied), how many quarter-steps of the scenario's jitter it is held back
//!   (0 = start now; up to `DELAY_MAX`), or (`BEHIND + j`) that it waits until the op running
//!   on stream `j` then ends (at once when none runs there);
//! - **query early**: the host queries an event whose record is the next entry of its stream,
//!   behind an op that has started and would end within one jitter: 1 = that op ends now and the
//!   query answers Done (the device was a little faster than drawn), 0 = Pending, as the clock
//!   says;
//! - **query late**: the host queries an event whose record completed within the last jitter and
//!   which nothing the host has seen orders it after: 1 = Pending (the host looked a little
//!   early), 0 = Done, as the clock says;
//! - **callback**: when the host callback of a load-stream record runs (if it has one), `d`
//!   elevenths of the scenario's largest callback delay after the record (`d` in
//!   0..=`DELAY_MAX`; only when that delay is not 0; one decision per load-stream record);
//! - **synchronize**: when the host blocked in `synchronize` on a record resumes: `d`
//!   quarter-jitters after the record completed (0 = at once);
//! - **arrival**: whether a request's arrival (a one-shot request, a client's retry or a
//!   session's next turn) or an abort that is due when the runner is about to step the engine
//!   reaches the engine before that step (0) or just after it (1: at the next step), as a
//!   message that lands in the engine's queue just after the engine drained it would. A
//!   deferred arrival or abort is delivered at the next step without another decision.
//!
//! Ops' data effects happen at their completion, so these decisions, with the drawn durations,
//! order one stream's effects against another's and against the host. Durations and faults are
//! not drawn in sequence: each is keyed by the identity of the call (its stream and its call
//! number there), so a schedule that reorders calls across streams keeps each call's duration
//! and fault. (A schedule that changes what the engine enqueues on a stream still changes which
//! call is which there. The runner's own draws — whether an abort happens and which request it
//! picks, when the operator asks for device memory back — are drawn in sequence, one set per
//! step; an abort of a request whose load is in flight, a fault of its own, is never deferred.)
//!
//! A schedule is drawn by a policy — a random walk, or PCT (Burckhardt et al., ASPLOS 2010) over
//! six entities: the three stream kinds (compute, load, write; a prefill/decode pair's two sides
//! share them), the host thread, the callback thread and the clients. PCT gives them a random
//! priority order, and each decision goes the way of the higher of the entities it is between:
//! - an op that could start on a stream is held behind every op running then on a stream of a
//!   kind that ranks above its own, that is, until the last of them ends (a hold decision
//!   `BEHIND + j`: behind stream `j`'s running op); an op of the highest kind, or one with no
//!   such op running, starts at once. The order is strict for the ops running when an op could
//!   start, and not preemptive: an op of a higher kind that becomes ready while a lower one runs
//!   starts beside it, as GPU streams run at once; a hung op (ended only by the watchdog) is
//!   not waited for (nor by a replayed hold that names it); the end waited for is the one drawn
//!   then (a query that has an op end early does not start the ops held behind it sooner); an
//!   op held but not started yet counts as running; and streams that become free at the same
//!   instant decide in stream order, so an op of a lower kind on an earlier stream may start
//!   beside an op of a higher kind readied at that instant;
//! - a query in a window answers as the higher of the host and the record's stream kind would
//!   have it (the stream ahead: Done early; the host ahead: Pending late);
//! - a synchronize returns at once when the host ranks above the stream kind of the record it
//!   waited for, and as late as it may (`DELAY_MAX` quarter-jitters) when that stream runs ahead;
//! - a load-stream record's callback runs with its record when the callback thread ranks above
//!   the host, and as late as it may (`DELAY_MAX`) when the host runs ahead;
//! - an arrival or abort is deferred when the host ranks above the clients.
//!
//! PCT's probability bound is for threads that interleave one step at a time; here ops run side
//! by side in virtual time and the host's waits are bounded, so it is a guide, not a guarantee.
//! At each of `depth - 1` change points, drawn independently and uniformly over the op
//! starts of schedule 0 (its hold decisions, or an estimate of them), the entity with the
//! highest priority drops to the lowest and the others move up. Change points count op starts,
//! not every decision, because the host's decisions vary far more between scenarios, with how
//! often clients are refused and retry. A schedule is recorded as the list of decisions of all
//! kinds in the order they were made. Replaying the list reproduces the run exactly; a
//! shortened or edited list is still a valid schedule (decisions past its end are 0: every op
//! starts as soon as it can, every query answers as the clock says, every callback runs with
//! its record, every synchronize returns at once, every arrival and abort lands before the
//! step), which is how a failing schedule shrinks on its own.

use crate::probes::{self, SimProbe};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};

/// The longest timed delay a decision gives: a hold of `DELAY_MAX / 4` jitters, a callback or
/// a synchronize late by the whole of its bound (a hold behind a stream may wait longer).
pub const DELAY_MAX: u8 = 11;
/// A hold decision `BEHIND + j` holds an op until the op running on stream `j` ends.
pub const BEHIND: u8 = DELAY_MAX + 1;
/// The streams a hold may wait behind: both sides of the simulated GPU (`gpu::STREAMS`, which
/// asserts it is this).
pub const STREAMS: u8 = 6;
/// The largest decision: a hold behind the last stream.
pub const DECISION_MAX: u8 = BEHIND + STREAMS - 1;
/// Most decisions a schedule file may hold (a run starts fewer ops than its step limit allows).
pub const DECISIONS_MAX: usize = 1 << 24;
/// The schedule file format this build writes and replays. Format 2 added the host's decisions
/// (queries and callbacks) to the list, format 3 the synchronize and arrival decisions; a file
/// of another format would have its decisions land on other decision points (a format-1 file,
/// with no `format` field, holds op holds only). Hold decisions `BEHIND..=DECISION_MAX` came
/// later within format 3: every earlier file keeps its meaning, and a build from before them
/// refuses a file that holds one (`DecisionTooLarge`).
pub const FORMAT: u32 = 3;

/// What a decision is about (the module header says what each value means).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Hold,
    QueryEarly,
    QueryLate,
    Callback,
    Sync,
    Arrival,
}

/// How many kinds of decision there are.
pub const KINDS: usize = 6;
const _: () = assert!(
    Kind::Arrival as usize + 1 == KINDS,
    "KINDS counts the kinds up to the last, Arrival"
);

impl Kind {
    pub const ALL: [Kind; KINDS] = [
        Kind::Hold,
        Kind::QueryEarly,
        Kind::QueryLate,
        Kind::Callback,
        Kind::Sync,
        Kind::Arrival,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hold => "op holds",
            Kind::QueryEarly => "queries before a record",
            Kind::QueryLate => "queries after a record",
            Kind::Callback => "callbacks",
            Kind::Sync => "synchronizes",
            Kind::Arrival => "arrivals and aborts",
        }
    }
    /// What a decision of this kind other than 0 did, for the summary.
    pub fn taken(self) -> &'static str {
        match self {
            Kind::Hold => "held",
            Kind::QueryEarly => "answered Done early",
            Kind::QueryLate => "answered Pending late",
            Kind::Callback => "delayed",
            Kind::Sync => "returned late",
            Kind::Arrival => "after the step",
        }
    }
    /// The largest value of this kind (a replayed value above it counts as this).
    fn max(self) -> u8 {
        match self {
            Kind::Hold => DECISION_MAX,
            Kind::Callback | Kind::Sync => DELAY_MAX,
            Kind::QueryEarly | Kind::QueryLate | Kind::Arrival => 1,
        }
    }
}

/// How many decisions of each kind a run made, and how many of them were not 0 (`Kind::ALL`
/// order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub made: [u64; KINDS],
    pub taken: [u64; KINDS],
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, k) in Kind::ALL.into_iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(
                f,
                "{} {} ({} {})",
                self.made[i],
                k.name(),
                self.taken[i],
                k.taken()
            )?;
        }
        Ok(())
    }
}

/// The schedule index of a campaign's first branch: branches are schedules
/// `BRANCH_FIRST..BRANCH_FIRST + BRANCHES_MAX` of their seeds (`corpus`), apart from the schedules
/// `--schedules` draws (`0..campaign::SCHEDULES_MAX`). The index keys the generator of the
/// decisions drawn after the prefix.
pub const BRANCH_FIRST: u64 = crate::campaign::SCHEDULES_MAX;
/// How many branch indices there are (a campaign's `n`-th branch takes index `n` modulo it).
pub const BRANCHES_MAX: u64 = 1 << 32;

/// The schedule index of a campaign's `n`-th branch.
pub fn branch_index(n: u64) -> u64 {
    BRANCH_FIRST + n % BRANCHES_MAX
}

/// Whether schedule `index` of a seed is a branch from a corpus.
pub fn is_branch(index: u64) -> bool {
    (BRANCH_FIRST..BRANCH_FIRST + BRANCHES_MAX).contains(&index)
}

/// How a schedule is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Policy {
    /// Each hold, and each synchronize's lateness, uniform in 0..=4 (up to one jitter); each
    /// query in a window answered against the clock, and each arrival or abort deferred, with
    /// probability 1/4; each callback delay uniform in 0..=`DELAY_MAX`.
    RandomWalk,
    /// PCT of `depth` over the six entities (the module header): when the run has started a
    /// number of ops drawn uniformly in `1..ops`, `depth - 1` times, the entity with the highest
    /// priority drops to the lowest and the others move up. `ops` is schedule 0's op starts (its
    /// hold decisions), measured by an earlier run of the same scenario (`--schedules`); 0 when
    /// unknown, then estimated from the workload (`GpuOptions::ops_guess`), so some change
    /// points may fall past the run's end.
    Pct { depth: u32, ops: u64 },
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Policy::RandomWalk => write!(f, "random walk"),
            Policy::Pct { depth, ops: 0 } => write!(f, "pct d={depth} over estimated op starts"),
            Policy::Pct { depth, ops } => write!(f, "pct d={depth} over {ops} op starts"),
        }
    }
}

/// A recorded schedule: what `--schedule` replays and a failing run writes next to its scenario.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// The file format (`FORMAT`); files written before it had one are format 1.
    #[serde(default = "format_1")]
    pub format: u32,
    /// The scenario seed it was drawn for, and which schedule of that seed (0: the scenario's
    /// own; `--schedules N` explores 0..N).
    pub seed: u64,
    /// The fingerprint of the scenario it was recorded on (`fingerprint`): its decisions belong
    /// to that scenario's decision points.
    pub scenario: u64,
    pub index: u64,
    /// The policy that drew it (informative: a replay follows `decisions` only).
    pub policy: Policy,
    /// Every decision, of every kind, in the order the run made them.
    pub decisions: Vec<u8>,
}

fn format_1() -> u32 {
    1
}

/// A schedule that cannot be replayed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
    #[error(
        "schedule file format {format} is not this build's ({FORMAT}): its decisions would land \
         on other decision points (a format-1 file, with no `format` field, holds op holds \
         only); record the schedule again with this build"
    )]
    OtherFormat { format: u32 },
    #[error("schedule decision {at} is {value}, over the largest decision {DECISION_MAX}")]
    DecisionTooLarge { at: usize, value: u8 },
    #[error("schedule has {len} decisions, over the limit of {DECISIONS_MAX}")]
    TooLong { len: usize },
    #[error("schedule is for seed {schedule}, the scenario is seed {scenario}")]
    OtherSeed { schedule: u64, scenario: u64 },
    #[error(
        "schedule was recorded on another scenario of seed {seed} (fingerprint {schedule:#018x}, \
         this one is {scenario:#018x}): another profile, or an edited scenario file"
    )]
    OtherScenario {
        seed: u64,
        schedule: u64,
        scenario: u64,
    },
    /// The schedule's index or policy is none a campaign draws (the replay follows the
    /// decisions alone, but it prints them as the schedule's).
    #[error("schedule {field}: {why}")]
    Described { field: &'static str, why: String },
}

impl Schedule {
    /// Whether the schedule is well-formed and belongs to the scenario of `seed` whose
    /// fingerprint is `fingerprint` (`Scenario::fingerprint`).
    pub fn check_for(&self, seed: u64, fingerprint: u64) -> Result<(), ScheduleError> {
        self.validate()?;
        if self.seed != seed {
            return Err(ScheduleError::OtherSeed {
                schedule: self.seed,
                scenario: seed,
            });
        }
        if self.scenario != fingerprint {
            return Err(ScheduleError::OtherScenario {
                seed,
                schedule: self.scenario,
                scenario: fingerprint,
            });
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ScheduleError> {
        if self.format != FORMAT {
            return Err(ScheduleError::OtherFormat {
                format: self.format,
            });
        }
        if self.decisions.len() > DECISIONS_MAX {
            return Err(ScheduleError::TooLong {
                len: self.decisions.len(),
            });
        }
        if let Some(at) = self.decisions.iter().position(|&d| d > DECISION_MAX) {
            return Err(ScheduleError::DecisionTooLarge {
                at,
                value: self.decisions[at],
            });
        }
        Ok(())
    }

    /// The index and the policy as a campaign draws them: an index under `SCHEDULES_MAX` (or a
    /// branch's, [`is_branch`]), a PCT
    /// depth in `1..=depth_max` (the scenario's limit, which the caller passes: this module
    /// imports nothing of the scenario) over no more op starts than a schedule may hold
    /// decisions.
    pub fn check_described(&self, depth_max: u32) -> Result<(), ScheduleError> {
        let described = |field, why: String| Err(ScheduleError::Described { field, why });
        if self.index >= crate::campaign::SCHEDULES_MAX && !is_branch(self.index) {
            return described(
                "index",
                format!(
                    "{} (a seed has schedules 0..{}, and branches from a corpus {}..{})",
                    self.index,
                    crate::campaign::SCHEDULES_MAX,
                    BRANCH_FIRST,
                    BRANCH_FIRST + BRANCHES_MAX
                ),
            );
        }
        match self.policy {
            Policy::Pct { depth, .. } if !(1..=depth_max).contains(&depth) => described(
                "policy",
                format!("PCT depth {depth} (a campaign draws 1..={depth_max})"),
            ),
            Policy::Pct { ops, .. } if ops > DECISIONS_MAX as u64 => described(
                "policy",
                format!(
                    "PCT over {ops} op starts, more than a schedule's {DECISIONS_MAX} decisions"
                ),
            ),
            _ => Ok(()),
        }
    }
}

/// Where the decisions of a run come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// Drawn by a policy from schedule `index` of the seed.
    Draw { index: u64, policy: Policy },
    /// Replayed from a recorded list.
    Replay(Vec<u8>),
    /// A branch from a checkpoint (`corpus`): the decisions of `prefix` replayed, then drawn by
    /// `policy` as schedule `index` of the seed would draw them (its generator, its PCT change
    /// points), so the run reaches the checkpoint's state and leaves it another way.
    Branch {
        prefix: Vec<u8>,
        index: u64,
        policy: Policy,
    },
}

impl Default for Source {
    fn default() -> Self {
        Source::Draw {
            index: 0,
            policy: Policy::RandomWalk,
        }
    }
}

/// The entities PCT orders: the three stream kinds, then the host, the callback thread and the
/// clients.
const ENTITIES: usize = 6;
const HOST: usize = 3;
const CALLBACKS: usize = 4;
const CLIENTS: usize = 5;

/// The scheduler inside the simulated GPU: makes (or replays) each decision and records it.
#[derive(Clone, Debug)]
pub struct Decider {
    source: Source,
    rng: Rng,
    /// PCT: the entities' priorities (0 = highest; `ENTITIES` order) and the remaining change
    /// points (op-start counts), ascending.
    priorities: [u8; ENTITIES],
    change_points: Vec<u64>,
    recorded: Vec<u8>,
    /// The kind of each recorded decision.
    kinds: Vec<Kind>,
    counts: Counts,
}

impl Decider {
    /// `ops_guess` stands in for an unknown op-start count under PCT.
    pub fn new(seed: u64, source: Source, ops_guess: u64) -> Decider {
        let index = match source {
            Source::Draw { index, .. } | Source::Branch { index, .. } => index,
            Source::Replay(_) => 0,
        };
        let mut rng = Rng::new(seed ^ 0x5C4E_D000 ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut priorities = [0u8, 1, 2, 3, 4, 5];
        for i in (1..ENTITIES).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            priorities.swap(i, j);
        }
        let change_points = match source {
            Source::Draw {
                policy: Policy::Pct { depth, ops },
                ..
            }
            | Source::Branch {
                policy: Policy::Pct { depth, ops },
                ..
            } => {
                let over = if ops > 0 { ops } else { ops_guess }.max(2);
                let mut v: Vec<u64> = (1..depth.max(1)).map(|_| rng.range(1, over - 1)).collect();
                v.sort_unstable();
                v
            }
            _ => Vec::new(),
        };
        Decider {
            source,
            rng,
            priorities,
            change_points,
            recorded: Vec::new(),
            kinds: Vec::new(),
            counts: Counts::default(),
        }
    }

    /// The hold decision for the op that could start on `stream`, with `running` the other
    /// streams' ops running then that may be waited for (each stream and its op's end): `d` in
    /// `0..=DELAY_MAX` quarter-jitters, or `BEHIND + j` (see [`hold`]).
    pub fn decide(&mut self, stream: usize, running: &[(usize, u64)]) -> u8 {
        self.make(Kind::Hold, stream, running)
    }

    /// A decision of `kind` about stream `stream` (for a callback, the stream whose record it
    /// follows; for a synchronize, the stream of the record waited for; ignored for an
    /// arrival): 0 is what the clock says. A hold made here waits behind no stream.
    pub fn point(&mut self, kind: Kind, stream: usize) -> u8 {
        self.make(kind, stream, &[])
    }

    fn make(&mut self, kind: Kind, stream: usize, running: &[(usize, u64)]) -> u8 {
        let at = self.recorded.len();
        let policy = match &self.source {
            Source::Replay(list) => Err(list.get(at).map_or(0, |&d| d.min(kind.max()))),
            // A checkpoint's prefix holds valid decisions, which this leaves as they are; a fuzz
            // input's bytes (`fuzz::fuzz_guided`) spread over every decision of the kind.
            Source::Branch { prefix, .. } if at < prefix.len() => {
                Err(prefix[at] % (kind.max() + 1))
            }
            Source::Draw { policy, .. } | Source::Branch { policy, .. } => Ok(*policy),
        };
        let d = match policy {
            Err(replayed) => replayed,
            Ok(Policy::RandomWalk) => match kind {
                Kind::Hold => self.rng.below(5) as u8,
                Kind::QueryEarly | Kind::QueryLate => (self.rng.below(4) == 0) as u8,
                Kind::Callback => self.rng.below(DELAY_MAX as u64 + 1) as u8,
                Kind::Sync => self.rng.below(5) as u8,
                Kind::Arrival => (self.rng.below(4) == 0) as u8,
            },
            Ok(Policy::Pct { .. }) => self.pct(kind, stream, running),
        };
        assert!(d <= kind.max(), "{kind:?} decision {d} over {}", kind.max());
        self.recorded.push(d);
        // Probes hit from here on were reached by the decisions so far (`probe::first_hits`).
        tierkv_engine::probe::set_position(self.recorded.len() as u64);
        self.kinds.push(kind);
        let k = kind as usize;
        self.counts.made[k] += 1;
        self.counts.taken[k] += (d != 0) as u64;
        d
    }

    /// PCT's decision (the module header): the higher-ranked of the entities it is between has
    /// its way.
    fn pct(&mut self, kind: Kind, stream: usize, running: &[(usize, u64)]) -> u8 {
        // Change points count op starts (hold decisions made before this one).
        let starts = self.counts.made[Kind::Hold as usize];
        while self.change_points.first().is_some_and(|&cp| cp <= starts) {
            probes::hit(SimProbe::PctChangePoint);
            self.change_points.remove(0);
            let top = (0..ENTITIES)
                .min_by_key(|&e| self.priorities[e])
                .expect("entities");
            for p in self.priorities.iter_mut() {
                *p = p.saturating_sub(1);
            }
            self.priorities[top] = ENTITIES as u8 - 1;
        }
        // A pair's decode streams share the priorities of their kinds.
        let rank = |e: usize| self.priorities[e];
        let of = |s: usize| rank(s % 3);
        let ahead = |a: u8, b: u8| (a < b) as u8 * DELAY_MAX;
        match kind {
            // Behind the op, of those running on a higher-ranked stream kind, that ends last.
            Kind::Hold => running
                .iter()
                .filter(|&&(j, _)| of(j) < of(stream))
                .max_by_key(|&&(j, end)| (end, std::cmp::Reverse(j)))
                .map_or(0, |&(j, _)| {
                    assert!(j < STREAMS as usize, "stream {j} of {STREAMS}");
                    BEHIND + j as u8
                }),
            // The stream ahead of the host: its record is passed before the host looks.
            Kind::QueryEarly => (of(stream) < rank(HOST)) as u8,
            // The host ahead of the stream: it looks before the record is passed.
            Kind::QueryLate => (rank(HOST) < of(stream)) as u8,
            // The host ahead of the callback thread: it runs on before the callback does.
            Kind::Callback => ahead(rank(HOST), rank(CALLBACKS)),
            // The stream ahead of the host: it runs on before the host resumes.
            Kind::Sync => ahead(of(stream), rank(HOST)),
            // The host ahead of the clients: it drains its queue before they send.
            Kind::Arrival => (rank(HOST) < rank(CLIENTS)) as u8,
        }
    }

    /// The decisions made so far, in the order they were made.
    pub fn recorded(&self) -> &[u8] {
        &self.recorded
    }

    pub fn take_recorded(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.recorded)
    }

    /// The kind of each decision made so far, in the order made.
    pub fn take_kinds(&mut self) -> Vec<Kind> {
        std::mem::take(&mut self.kinds)
    }

    /// How many decisions of each kind were made so far.
    pub fn counts(&self) -> Counts {
        self.counts
    }
}

/// What a hold decision asks of the op that could start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Held this many quarter-jitters (0: it starts as soon as it can).
    Quarters(u8),
    /// Held until the op running on this stream when it could start ends (not held when none
    /// runs there).
    Behind(usize),
}

/// The meaning of hold decision `d` (at most `DECISION_MAX`, as `Decider` makes them).
pub fn hold(d: u8) -> Hold {
    assert!(d <= DECISION_MAX, "hold decision {d} over {DECISION_MAX}");
    match d.checked_sub(BEHIND) {
        Some(j) => Hold::Behind(j as usize),
        None => Hold::Quarters(d),
    }
}

/// The policy of schedule `index` when `--schedules` explores a scenario: schedule 0 is the
/// scenario's own; then PCT of depth 1, 2, 3 and a random walk in turn, PCT over `ops` (the
/// op starts of schedule 0).
pub fn explore_policy(index: u64, own: Policy, ops: u64) -> Policy {
    match index {
        0 => own,
        i => match i % 4 {
            1 => Policy::Pct { depth: 1, ops },
            2 => Policy::Pct { depth: 2, ops },
            3 => Policy::Pct { depth: 3, ops },
            _ => Policy::RandomWalk,
        },
    }
}

#[cfg(test)]
mod tests;
