//! Shrinking: a failing scenario is made smaller — fewer sessions, one-shots and turns, fewer layers
//! and heads, shorter session prompts, shorter generations, faults that are not needed switched
//! off — keeping each step only if the run still fails with the same oracle (greedy, first
//! improvement over a fixed list of candidates). The result is the smallest failing scenario
//! found within the budget (`Budget::Runs` for a result that depends on the input alone),
//! printed as its configuration and workload and saved for `tierkv sim --replay`.
//!
//! A failure found under a schedule other than the scenario's own shrinks its schedule first
//! (`shrink_schedule`: fewer decisions, then held ops released), then the scenario under the
//! shrunk schedule.

use crate::report::OracleKind;
use crate::runner::{run, RunOptions};
use crate::scenario::Scenario;
use crate::schedule::Source;
use std::time::{Duration, Instant};

/// How long a shrink may go on: a number of runs (tests and anything that must give the same
/// result on a loaded machine), or wall time (an interactive user's `--shrink-secs`). A run
/// budget makes the shrunk case a function of the input alone; a wall budget does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    Runs(u32),
    Wall(Duration),
}

/// A budget being spent.
struct Meter {
    budget: Budget,
    start: Instant,
}

impl Meter {
    fn new(budget: Budget) -> Self {
        Meter {
            budget,
            start: Instant::now(),
        }
    }

    fn spent(&self, runs: u32) -> bool {
        match self.budget {
            Budget::Runs(max) => runs >= max,
            Budget::Wall(max) => self.start.elapsed() > max,
        }
    }
}

/// Half of a budget, for a shrink done in two stages.
impl Budget {
    pub fn half(self) -> Budget {
        match self {
            Budget::Runs(n) => Budget::Runs(n / 2),
            Budget::Wall(d) => Budget::Wall(d / 2),
        }
    }
}

pub struct Shrunk {
    pub scenario: Scenario,
    pub runs: u32,
    pub oracle: OracleKind,
}

fn fails_with(sc: &Scenario, opts: &RunOptions, oracle: OracleKind, runs: &mut u32) -> bool {
    *runs += 1;
    run(sc, opts).findings.first().map(|f| f.oracle) == Some(oracle)
}

/// Candidate reductions of a scenario, most aggressive first.
fn candidates(sc: &Scenario) -> Vec<Scenario> {
    let mut out = Vec::new();
    let w = &sc.workload;
    for (len, half) in [(w.sessions.len(), true), (w.oneshots.len(), false)] {
        if len == 0 {
            continue;
        }
        let mut keep_first = sc.clone();
        let mut keep_last = sc.clone();
        let h = len / 2;
        if half {
            keep_first.workload.sessions.truncate(h);
            keep_last.workload.sessions.drain(..len - h);
        } else {
            keep_first.workload.oneshots.truncate(h);
            keep_last.workload.oneshots.drain(..len - h);
        }
        out.push(keep_first);
        out.push(keep_last);
        for i in 0..len.min(24) {
            let mut one = sc.clone();
            if half {
                one.workload.sessions.remove(i);
            } else {
                one.workload.oneshots.remove(i);
            }
            out.push(one);
        }
    }
    for i in 0..w.sessions.len().min(24) {
        if w.sessions[i].turns.len() > 1 {
            let mut c = sc.clone();
            c.workload.sessions[i].turns.pop();
            out.push(c);
        }
    }
    let cfg = sc.engine_config();
    if cfg.model.layers > 1 {
        let mut c = sc.clone();
        let mut e = cfg.clone();
        e.model.layers = 1;
        c.config = e.to_toml();
        out.push(c);
        let mut c = sc.clone();
        let mut e = cfg.clone();
        e.model.layers -= 1;
        c.config = e.to_toml();
        out.push(c);
    }
    if cfg.model.index_n_heads > 1 {
        let mut c = sc.clone();
        let mut e = cfg.clone();
        e.model.index_n_heads = 1;
        c.config = e.to_toml();
        out.push(c);
    }
    if sc.abort_mid_load_rate > 0.0 {
        let mut c = sc.clone();
        c.abort_mid_load_rate = 0.0;
        out.push(c);
    }
    // Each fault that is on, switched off.
    type Off = fn(&mut Scenario);
    let faults: [(bool, Off); 13] = [
        (sc.abort_rate > 0.0, |c| c.abort_rate = 0.0),
        (sc.evict_rate > 0.0, |c| c.evict_rate = 0.0),
        (sc.gpu.slow_copy_rate > 0.0, |c| c.gpu.slow_copy_rate = 0.0),
        (sc.gpu.failed_copy_rate > 0.0, |c| {
            c.gpu.failed_copy_rate = 0.0
        }),
        (sc.gpu.failed_enqueue_rate > 0.0, |c| {
            c.gpu.failed_enqueue_rate = 0.0
        }),
        (sc.gpu.fail_first_host_alloc, |c| {
            c.gpu.fail_first_host_alloc = false
        }),
        (sc.gpu.failed_kernel_rate > 0.0, |c| {
            c.gpu.failed_kernel_rate = 0.0
        }),
        (sc.gpu.sticky_faults, |c| c.gpu.sticky_faults = false),
        (sc.gpu.torn_copy_rate > 0.0, |c| c.gpu.torn_copy_rate = 0.0),
        (sc.gpu.completion_delay_ns > 0, |c| {
            c.gpu.completion_delay_ns = 0
        }),
        (sc.gpu.fail_alloc_nth > 0, |c| c.gpu.fail_alloc_nth = 0),
        (sc.device_pages_refused_rate > 0.0, |c| {
            c.device_pages_refused_rate = 0.0
        }),
        (sc.host_pages_refused_rate > 0.0, |c| {
            c.host_pages_refused_rate = 0.0
        }),
    ];
    for (on, off) in faults {
        if on {
            let mut c = sc.clone();
            off(&mut c);
            out.push(c);
        }
    }
    let mut c = sc.clone();
    let mut changed = false;
    for s in &mut c.workload.sessions {
        for t in &mut s.turns {
            if t.append_tokens > 8 || t.generate > 1 {
                t.append_tokens = (t.append_tokens / 2).max(8);
                t.generate = (t.generate / 2).max(1);
                changed = true;
            }
        }
        if s.system_tokens > 64 {
            s.system_tokens /= 2;
            changed = true;
        }
    }
    for o in &mut c.workload.oneshots {
        if o.generate > 1 {
            o.generate = (o.generate / 2).max(1);
            changed = true;
        }
    }
    if changed {
        out.push(c);
    }
    out
}

/// Shrinks `sc`, which fails with `oracle`, within `budget`.
pub fn shrink(sc: &Scenario, oracle: OracleKind, budget: Budget) -> Shrunk {
    shrink_under(sc, &RunOptions::default(), oracle, budget)
}

/// Shrinks `sc`, which fails with `oracle` when run with `opts` (its schedule fixed there: as
/// the scenario shrinks, each recorded decision applies to whichever decision point comes at
/// its place).
pub fn shrink_under(
    sc: &Scenario,
    opts: &RunOptions,
    oracle: OracleKind,
    budget: Budget,
) -> Shrunk {
    let meter = Meter::new(budget);
    let mut best = sc.clone();
    let mut runs = 0;
    'outer: loop {
        for c in candidates(&best) {
            if meter.spent(runs) {
                break 'outer;
            }
            if fails_with(&c, opts, oracle, &mut runs) {
                best = c;
                continue 'outer;
            }
        }
        break;
    }
    Shrunk {
        scenario: best,
        runs,
        oracle,
    }
}

/// Shrinks the schedule `decisions` under which `sc` fails with `oracle`, within `budget`
/// (`shrink_decisions`, each candidate run on `sc`). Returns the smallest failing list and the
/// runs it took.
pub fn shrink_schedule(
    sc: &Scenario,
    base: &RunOptions,
    decisions: &[u8],
    oracle: OracleKind,
    budget: Budget,
) -> (Vec<u8>, u32) {
    let mut runs = 0;
    let best = shrink_decisions(decisions, budget, |d| {
        let opts = RunOptions {
            schedule: Some(Source::Replay(d.to_vec())),
            ..base.clone()
        };
        fails_with(sc, &opts, oracle, &mut runs)
    });
    (best, runs)
}

/// Shrinks a list of schedule decisions under which `fails` holds, within `budget` (counted
/// in calls of `fails`): shorter lists first (decisions past the end are 0: every op starts as
/// soon as it can, every query answers as the clock says), then runs of decisions set to 0,
/// halving the run length down to single decisions. Returns the smallest list found.
pub fn shrink_decisions(
    decisions: &[u8],
    budget: Budget,
    mut fails: impl FnMut(&[u8]) -> bool,
) -> Vec<u8> {
    let meter = Meter::new(budget);
    let mut best = decisions.to_vec();
    let mut runs = 0;
    let mut fails = |d: &[u8], runs: &mut u32| {
        *runs += 1;
        fails(d)
    };
    // Shorter: keep the first half, quarter, ... while it still fails.
    let mut keep = best.len() / 2;
    while keep > 0 && !meter.spent(runs) {
        if fails(&best[..keep], &mut runs) {
            best.truncate(keep);
            keep = best.len() / 2;
        } else {
            break;
        }
    }
    // Runs of decisions set to 0, coarse to fine (ddmin's complement step, on a list).
    let mut chunk = best.len().max(1).next_power_of_two() / 2;
    while chunk >= 1 && !meter.spent(runs) {
        let mut at = 0;
        while at < best.len() && !meter.spent(runs) {
            let end = (at + chunk).min(best.len());
            if best[at..end].iter().any(|&d| d != 0) {
                let mut c = best.clone();
                c[at..end].iter_mut().for_each(|d| *d = 0);
                if fails(&c, &mut runs) {
                    best = c;
                }
            }
            at = end;
        }
        chunk /= 2;
    }
    while best.last() == Some(&0) {
        best.pop();
    }
    best
}
