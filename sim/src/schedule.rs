//! Schedules: the simulated GPU's scheduling decisions, kept apart from the scenario.
//!
//! A scenario fixes the configuration, the workload, the timing and fault models (latencies,
//! bandwidths, fault rates) and the seeds of their generators. A schedule fixes the holds: every
//! time an op could start on a stream (its stream is free and the waits before it are
//! satisfied), the scheduler makes one decision, how many quarter-steps of the scenario's jitter
//! it holds the op back (0 = start now). Ops' data effects happen at their completion, so the
//! holds, with the drawn durations, order one stream's effects against another's and against
//! the host. Durations and faults are drawn from the GPU's generator in the order ops are
//! enqueued and records complete, so a different schedule, which changes what the engine
//! enqueues and when, also moves which op draws which duration and fault: two schedules of one
//! scenario are two fault sequences, not one.
//!
//! A schedule is drawn by a policy — a random walk, or holds after PCT (Burckhardt et al.): the
//! three stream kinds (compute, load, write; a prefill/decode pair's two sides share them) get a
//! random priority order, and an op that could start is held `4 · priority + U{0..3}`
//! quarter-jitters, so a lower kind's ops start later, but not strictly after; at each of
//! `depth - 1` change points, drawn independently and uniformly over the op starts of schedule 0
//! (or an estimate of them), the kind with the highest priority drops to the lowest and the
//! others move up. Priorities are holds, not a strict order, so PCT's probability bound is a
//! guide rather than a guarantee. A schedule is recorded as the list of decisions, one per op
//! start, in the order the ops started. Replaying the list reproduces the run exactly; a
//! shortened or edited list is still a valid schedule (decisions past its end are 0), which is
//! how a failing schedule shrinks on its own.

use crate::probes::{self, SimProbe};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};

/// The largest decision: a hold of `DECISION_MAX / 4` jitters.
pub const DECISION_MAX: u8 = 11;
/// Most decisions a schedule file may hold (a run starts fewer ops than its step limit allows).
pub const DECISIONS_MAX: usize = 1 << 24;

/// How a schedule is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Policy {
    /// Each decision uniform in 0..=4: a hold of up to one jitter.
    RandomWalk,
    /// PCT-like holds of `depth`: the stream kinds in a random priority order hold their ops by
    /// priority (0, 4 or 8 quarter-jitters, plus 0..=3); at `depth - 1` op starts drawn
    /// uniformly in `1..ops`, the kind with the highest priority drops to the lowest and the
    /// others move up. `ops` is schedule 0's op-start count,
    /// measured by an earlier run of the same scenario (`--schedules`); 0 when unknown, then
    /// estimated from the workload (`GpuOptions::ops_guess`), so some change points may fall
    /// past the run's end.
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
    /// The scenario seed it was drawn for, and which schedule of that seed (0: the scenario's
    /// own; `--schedules N` explores 0..N).
    pub seed: u64,
    /// The fingerprint of the scenario it was recorded on (`fingerprint`): its decisions belong
    /// to that scenario's op starts.
    pub scenario: u64,
    pub index: u64,
    /// The policy that drew it (informative: a replay follows `decisions` only).
    pub policy: Policy,
    /// One decision per op start, in start order.
    pub decisions: Vec<u8>,
}

/// A schedule that cannot be replayed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScheduleError {
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
        if self.decisions.len() > DECISIONS_MAX {
            return Err(ScheduleError::TooLong {
                len: self.decisions.len(),
            });
        }
        match self.decisions.iter().position(|&d| d > DECISION_MAX) {
            Some(at) => Err(ScheduleError::DecisionTooLarge {
                at,
                value: self.decisions[at],
            }),
            None => Ok(()),
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
}

impl Default for Source {
    fn default() -> Self {
        Source::Draw {
            index: 0,
            policy: Policy::RandomWalk,
        }
    }
}

/// The scheduler inside the simulated GPU: makes (or replays) each decision and records it.
#[derive(Clone, Debug)]
pub struct Decider {
    source: Source,
    rng: Rng,
    /// PCT: stream priorities (0 = highest) and the remaining change points, ascending.
    priorities: [u8; 3],
    change_points: Vec<u64>,
    recorded: Vec<u8>,
}

impl Decider {
    /// `ops_guess` stands in for an unknown op count under PCT.
    pub fn new(seed: u64, source: Source, ops_guess: u64) -> Decider {
        let index = match source {
            Source::Draw { index, .. } => index,
            Source::Replay(_) => 0,
        };
        let mut rng = Rng::new(seed ^ 0x5C4E_D000 ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut priorities = [0u8, 1, 2];
        for i in (1..3).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            priorities.swap(i, j);
        }
        let change_points = match source {
            Source::Draw {
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
        }
    }

    /// The decision for the op about to start on `stream`: quarter-jitters to hold it.
    pub fn decide(&mut self, stream: usize) -> u8 {
        let at = self.recorded.len();
        let d = match &self.source {
            Source::Replay(list) => match list.get(at) {
                Some(&d) => d,
                None => 0,
            },
            Source::Draw {
                policy: Policy::RandomWalk,
                ..
            } => self.rng.below(5) as u8,
            Source::Draw {
                policy: Policy::Pct { .. },
                ..
            } => {
                while self
                    .change_points
                    .first()
                    .is_some_and(|&cp| cp <= at as u64)
                {
                    probes::hit(SimProbe::PctChangePoint);
                    self.change_points.remove(0);
                    let top = (0..3)
                        .min_by_key(|&s| self.priorities[s])
                        .expect("3 streams");
                    for p in self.priorities.iter_mut() {
                        *p = p.saturating_sub(1);
                    }
                    self.priorities[top] = 2;
                }
                // A pair's decode streams share the priorities of their kinds.
                self.priorities[stream % 3] * 4 + self.rng.below(4) as u8
            }
        };
        assert!(d <= DECISION_MAX, "decision {d} over {DECISION_MAX}");
        self.recorded.push(d);
        d
    }

    /// The decisions made so far, in op-start order.
    pub fn recorded(&self) -> &[u8] {
        &self.recorded
    }

    pub fn take_recorded(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.recorded)
    }
}

/// The policy of schedule `index` when `--schedules` explores a scenario: schedule 0 is the
/// scenario's own; then PCT of depth 1, 2, 3 and a random walk in turn, PCT over `ops` (the op
/// starts of schedule 0).
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
