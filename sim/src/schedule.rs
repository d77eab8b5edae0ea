//! Schedules: the simulated GPU's scheduling decisions, kept apart from the scenario.
//!
//! A scenario fixes the configuration, the workload, the copy timings and the faults. A schedule
//! fixes what is left: in which order the ops that are ready at once take effect. Every time an
//! op could start on a stream (its stream is free and the waits before it are satisfied), the
//! scheduler makes one decision: how many quarter-steps of the scenario's jitter it holds the op
//! back (0 = start now). Ops' data effects happen at their completion, so these decisions are
//! what orders one stream's effects against another's and against the host.
//!
//! A schedule is drawn by a policy — a random walk, or PCT (Burckhardt et al.: `depth - 1`
//! priority change points spread uniformly over the run's op starts, stream priorities fixing
//! the order in between) — and recorded as the list of decisions, one per op start, in the
//! order the ops started. Replaying the list reproduces the run exactly; a shortened or edited
//! list is still a valid schedule (decisions past its end are 0), which is how a failing
//! schedule shrinks on its own.

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
    /// PCT of `depth`: streams in a random priority order hold their ops by priority (0, 4 or 8
    /// quarter-jitters, plus 0..=3); at `depth - 1` op starts drawn uniformly in `0..ops`, the
    /// highest-priority stream drops to the lowest. `ops` is the run's op-start count, measured
    /// by an earlier run of the same scenario; 0 when unknown (then estimated as `ops_guess`).
    Pct { depth: u32, ops: u64 },
}

/// A recorded schedule: what `--schedule` replays and a failing run writes next to its scenario.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// The scenario seed it was drawn for, and which schedule of that seed (0: the scenario's
    /// own; `--schedules N` explores 0..N).
    pub seed: u64,
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
}

impl Schedule {
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
pub struct Scheduler {
    source: Source,
    rng: Rng,
    /// PCT: stream priorities (0 = highest) and the remaining change points, ascending.
    priorities: [u8; 3],
    change_points: Vec<u64>,
    recorded: Vec<u8>,
}

impl Scheduler {
    /// `ops_guess` stands in for an unknown op count under PCT.
    pub fn new(seed: u64, source: Source, ops_guess: u64) -> Scheduler {
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
                let over = if ops > 0 { ops } else { ops_guess.max(1) };
                let mut v: Vec<u64> = (1..depth.max(1)).map(|_| rng.below(over)).collect();
                v.sort_unstable();
                v
            }
            _ => Vec::new(),
        };
        Scheduler {
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
                self.priorities[stream] * 4 + self.rng.below(4) as u8
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
mod tests {
    use super::*;

    fn draw(policy: Policy, index: u64, n: usize) -> Vec<u8> {
        let mut s = Scheduler::new(7, Source::Draw { index, policy }, 1000);
        (0..n).map(|i| s.decide(i % 3)).collect()
    }

    /// A replayed list gives back exactly its decisions, then zeros.
    #[test]
    fn replay_follows_the_list_then_zero() {
        let list = draw(Policy::RandomWalk, 3, 50);
        let mut r = Scheduler::new(7, Source::Replay(list.clone()), 0);
        let got: Vec<u8> = (0..60).map(|i| r.decide(i % 3)).collect();
        assert_eq!(&got[..50], &list[..]);
        assert!(got[50..].iter().all(|&d| d == 0));
        assert_eq!(r.recorded(), &got[..]);
    }

    /// Different schedule indices of one seed draw different schedules; one index, the same.
    #[test]
    fn indices_draw_independent_schedules() {
        assert_eq!(
            draw(Policy::RandomWalk, 1, 100),
            draw(Policy::RandomWalk, 1, 100)
        );
        assert_ne!(
            draw(Policy::RandomWalk, 1, 100),
            draw(Policy::RandomWalk, 2, 100)
        );
    }

    /// PCT of depth 1 never changes priorities: each stream keeps one priority band all run.
    /// Depth 3 changes them twice, within the op count it is given.
    #[test]
    fn pct_holds_streams_by_priority_with_depth_minus_one_changes() {
        let d = draw(Policy::Pct { depth: 1, ops: 90 }, 5, 90);
        for s in 0..3 {
            let bands: std::collections::BTreeSet<u8> =
                d.iter().skip(s).step_by(3).map(|x| x / 4).collect();
            assert_eq!(bands.len(), 1, "stream {s}: {d:?}");
        }
        let mut changes = 0;
        let mut s = Scheduler::new(
            9,
            Source::Draw {
                index: 2,
                policy: Policy::Pct { depth: 3, ops: 90 },
            },
            0,
        );
        let mut last = s.priorities;
        for i in 0..90 {
            s.decide(i % 3);
            if s.priorities != last {
                changes += 1;
                last = s.priorities;
            }
        }
        assert!(
            (1..=2).contains(&changes),
            "{changes} (two change points may coincide)"
        );
    }

    #[test]
    fn bad_schedules_are_typed_errors() {
        let mut s = Schedule {
            seed: 1,
            index: 0,
            policy: Policy::RandomWalk,
            decisions: vec![0, 3, DECISION_MAX + 1],
        };
        assert_eq!(
            s.validate(),
            Err(ScheduleError::DecisionTooLarge {
                at: 2,
                value: DECISION_MAX + 1
            })
        );
        s.decisions.pop();
        assert_eq!(s.validate(), Ok(()));
    }
}
