//! The rare targets of a campaign, each with the reason it is rare where one is known
//! (`tierkv campaign merge --rare`; issue 33 asks that every target a campaign of the default
//! profile, `swarm`, can reach be reached in at least 5% of its runs, or be listed with its
//! reason).
//!
//! A target is rare when fewer than [`RARE_SHARE`] of the campaign's runs reached it, never
//! included: every probe the campaign can reach (`Coverage::names`), every configuration value
//! (`FACTOR_VALUES`), every combination of two values some run had (configuration values
//! drawn, fault kinds met), every happens-before pair the campaign saw at all (an access pair
//! never seen has no name to list: the pairs' table marks the orders never seen), and every
//! watermark level up to the highest one reached (level 0 of a watermark never reached). The
//! reasons are of three kinds:
//!
//! - **From the counts**: a combination whose two values' own shares multiply to under 5%
//!   (within two standard deviations of that product over the campaign's runs) and that met as
//!   often as that product, within the same two standard deviations (`short_of_independent` is
//!   false): its values meet about as often as independent values would; a watermark level
//!   above the highest level that is not rare (each level asks twice the quantity of the one
//!   below).
//! - **Read from the code**, in [`KNOWN`]: what the code requires before the target can be
//!   reached, or why no run of any profile can reach it. Each names the code it was read from.
//! - **None known**: listed first, as such. These are the targets a guided campaign
//!   (`sim --corpus`) should reach more often, or the simulator's draws should favour.

use super::{combinations, one_stream, short_of_independent, two_sigma, Table, COMBO_PREFIX};
use super::{Watermark, FACTOR_PREFIX, FACTOR_VALUES, MARK_LEVELS, PAIR_PREFIX};

/// The share of runs below which a target is rare.
pub const RARE_SHARE: f64 = 0.05;

/// A reason read from the code, for a target or a class of targets.
pub struct Known {
    /// A target's name, or a prefix ending in `*`. A combination's name matches in either
    /// order of its two values.
    pub pattern: &'static str,
    /// A happens-before pair matches only when its two sides are on different streams.
    pub across_streams: bool,
    /// No run of any profile can reach the target (it is listed apart from the rare ones).
    pub unreachable: bool,
    pub why: &'static str,
}

/// Reasons read from the code. The first entry that matches a name gives its reason.
pub const KNOWN: &[Known] = &[
    Known {
        pattern: "factor.kv=fp8_unpacked",
        across_streams: false,
        unreachable: true,
        why: "a foreign row layout that no kernel stores or reads (kernels/src/args.rs, \
              `check_stored`): the simulator draws the KV pool as bf16 or packed fp8 only \
              (sim/src/scenario.rs, `draw_dtypes`)",
    },
    Known {
        pattern: "step.waited_for_load",
        across_streams: false,
        unreachable: false,
        why: "a step waits for a load only when it has no rows to compute, no step is in flight \
              (one step ahead), no backup is in flight and a load is (engine/src/engine.rs, \
              `step` and `wait_for_copies`: with a backup in flight it waits for that instead, \
              step.waited_for_backup)",
    },
    Known {
        pattern: "hb.device_kv.copy@load:w>copy@write:r",
        across_streams: false,
        unreachable: false,
        why: "a node a load made resident is backed up again only once the host tier has \
              dropped its host copy while the device kept the page (engine/src/cache.rs: \
              `evict_host` takes a resident node's host copy, and `needs_backup` stops at the \
              first node with one): a load, then a host-tier eviction of that node, then a \
              backup of its prefix (read at the level of nodes; the race detector pairs \
              accesses to one cell of the page)",
    },
    Known {
        pattern: "hb.device_index_k.copy@load:w>copy@write:r",
        across_streams: false,
        unreachable: false,
        why: "the index-K half of hb.device_kv.copy@load:w>copy@write:r, with the same \
              reason (engine/src/cache.rs, `evict_host` and `needs_backup`: a page's KV and \
              index-K move together)",
    },
    Known {
        pattern: "hb.scratch_digests.next_tokens@compute:r>sparse_read@compute:w",
        across_streams: false,
        unreachable: false,
        why: "running ahead, a step reads its digests by next_tokens and then by the copy to \
              pinned memory, both of the whole buffer, on the compute stream \
              (engine/src/model.rs, `end_step`); the race detector keeps one read per stream \
              and cell (sim/src/race.rs), so the copy's read replaces next_tokens' read, and \
              the next sparse_read write is paired with next_tokens' read only when that copy \
              was not enqueued after it",
    },
    Known {
        pattern: "hb.scratch_stream_ordered.*",
        across_streams: true,
        unreachable: false,
        why: "stream-ordered memory changes stream only through a pool trim: the simulated \
              driver gives a freed buffer back to allocations of the stream that freed it, and \
              a trimmed one to any stream (sim/src/driver.rs, `alloc_async`), and the runtime \
              trims the pool only after a stream-ordered allocation was refused \
              (engine/src/runtime/driven.rs, `scratch_alloc`; see runtime.pool_trimmed and \
              driver.refused_alloc_async)",
    },
];

/// Why a target is rare. Shares are percent of the campaign's runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Why {
    /// A combination whose values' own shares (`a_pct`, `b_pct`) multiply to under 5%, met
    /// about as often as that product (see the module's doc).
    Independent { a_pct: f64, b_pct: f64 },
    /// A watermark level above `level`, the highest one reached in at least 5% of the runs
    /// (`level_pct` of them).
    Tail { level: String, level_pct: f64 },
    /// The reason `KNOWN[i]` gives.
    Known(usize),
    /// No reason known.
    Unknown,
}

/// One rare target.
#[derive(Clone, Debug, PartialEq)]
pub struct Rare {
    /// The target's name, as the coverage table counts it.
    pub name: String,
    /// The runs that reached it, percent of the campaign's.
    pub share_pct: f64,
    pub why: Why,
}

/// The rare targets of a campaign of `runs` runs whose probe table is `probes`, the probes it
/// can reach being `probe_names`: the ones with no reason known first, each group in name
/// order (a watermark's levels in level order).
pub fn rare(probes: &Table, runs: u64, probe_names: &[&str]) -> Vec<Rare> {
    let mut names = candidates(probes, runs, probe_names);
    names.sort_by_key(|n| sort_key(n));
    names.dedup();
    let mut out: Vec<Rare> = (names.into_iter())
        .filter_map(|name| {
            let share_pct = pct(probes, runs, &name);
            (share_pct < 100.0 * RARE_SHARE).then(|| Rare {
                why: why(probes, runs, &name, share_pct),
                share_pct,
                name,
            })
        })
        .collect();
    out.sort_by_key(|r| r.why != Why::Unknown);
    out
}

/// Every target of the campaign that may be rare (see the module's doc).
fn candidates(probes: &Table, runs: u64, probe_names: &[&str]) -> Vec<String> {
    let mut names: Vec<String> = probe_names.iter().map(|n| n.to_string()).collect();
    for (f, values) in FACTOR_VALUES {
        names.extend(values.iter().map(|v| format!("{FACTOR_PREFIX}{f}={v}")));
    }
    names.extend(
        (probes.keys())
            .filter(|n| n.starts_with(PAIR_PREFIX))
            .map(|n| n.to_string()),
    );
    // Under the name its campaign counts it by (`pct` adds the other order).
    names.extend(
        (combinations(probes, runs).0.into_iter())
            .map(|c| format!("{COMBO_PREFIX}{}+{}", c.a, c.b)),
    );
    for w in Watermark::ALL {
        let top = (0..MARK_LEVELS)
            .rev()
            .find(|&k| seeds_of(probes, w.level_name(k)) > 0);
        names.extend((0..=top.unwrap_or(0)).map(|k| w.level_name(k).to_string()));
    }
    names
}

/// Names in order, a watermark's levels by their number (`>=2^7` before `>=2^10`).
fn sort_key(name: &str) -> (String, u32) {
    match name.rsplit_once(">=2^") {
        Some((head, k)) if name.starts_with(super::MARK_PREFIX) => {
            (head.to_string(), k.parse().unwrap_or(u32::MAX))
        }
        _ => (name.to_string(), 0),
    }
}

fn seeds_of(probes: &Table, name: &str) -> u64 {
    probes.get(name).map_or(0, |e| e.1)
}

/// The share (percent) of `runs` that reached `name`; a combination's in either order.
fn pct(probes: &Table, runs: u64, name: &str) -> f64 {
    let mut n = seeds_of(probes, name);
    if let Some((a, b)) = combo_values(name) {
        n += seeds_of(probes, &format!("{COMBO_PREFIX}{b}+{a}"));
    }
    100.0 * n as f64 / runs.max(1) as f64
}

/// A combination's two values (`F=V`).
fn combo_values(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix(COMBO_PREFIX)?.split_once('+')
}

/// Why `name`, reached in `share_pct` percent of `runs`, is rare.
fn why(probes: &Table, runs: u64, name: &str, share_pct: f64) -> Why {
    if let Some(k) = known(name) {
        return Why::Known(k);
    }
    if let Some((a, b)) = combo_values(name) {
        // A configuration value's share is its factor name's, a fault kind's its probe's.
        let value = |v: &str| match v.strip_prefix("fault=") {
            Some(probe) => pct(probes, runs, probe),
            None => pct(probes, runs, &format!("{FACTOR_PREFIX}{v}")),
        };
        let (a_pct, b_pct) = (value(a), value(b));
        let independent = a_pct * b_pct / 100.0;
        let could_be_rare = independent - two_sigma(independent, runs) < 100.0 * RARE_SHARE;
        if could_be_rare && !short_of_independent(share_pct, independent, runs) {
            return Why::Independent { a_pct, b_pct };
        }
        return Why::Unknown;
    }
    let tail = Watermark::ALL.iter().find_map(|w| {
        let k = (1..MARK_LEVELS).find(|&k| w.level_name(k) == name)?;
        // Levels count cumulatively (a run that reached 2^k reached every level below).
        (0..k).rev().find_map(|j| {
            let level_pct = pct(probes, runs, w.level_name(j));
            (level_pct >= 100.0 * RARE_SHARE).then(|| Why::Tail {
                level: w.level_name(j).to_string(),
                level_pct,
            })
        })
    });
    tail.unwrap_or(Why::Unknown)
}

/// The index of the [`KNOWN`] entry that gives `name` its reason, if any.
fn known(name: &str) -> Option<usize> {
    let swapped = combo_values(name).map(|(a, b)| format!("{COMBO_PREFIX}{b}+{a}"));
    KNOWN.iter().position(|k| {
        let matches = |n: &str| match k.pattern.strip_suffix('*') {
            Some(prefix) => n.starts_with(prefix),
            None => n == k.pattern,
        };
        (matches(name) || swapped.as_deref().is_some_and(matches))
            && (!k.across_streams || across_streams(name))
    })
}

/// Whether `name` is a happens-before pair whose two sides are on different streams.
fn across_streams(name: &str) -> bool {
    let sides = (name.strip_prefix(PAIR_PREFIX))
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(_, sides)| sides.split_once('>'));
    sides.is_some_and(|(a, b)| !one_stream(a, b))
}

/// The report of [`rare`] over `runs` runs: a count by kind of reason, one line a target (those
/// with no reason known first), then the reasons read from the code that the lines cite, each
/// once, numbered in the order first cited.
pub fn report(rare: &[Rare], runs: u64) -> String {
    if runs == 0 {
        return "rare targets: none listed, the campaign ran no runs\n".to_string();
    }
    let count = |f: &dyn Fn(&Why) -> bool| rare.iter().filter(|r| f(&r.why)).count();
    let unreachable = |w: &Why| matches!(w, Why::Known(k) if KNOWN[*k].unreachable);
    let mut out = format!(
        "rare targets, reached in fewer than {:.0}% of the {runs} runs: {} targets; {} with no \
         reason known, {} combinations whose values' shares multiply to under 5%, {} watermark \
         levels above the highest common one, {} with a reason read from the code, {} that no \
         run can reach\n",
        100.0 * RARE_SHARE,
        rare.len(),
        count(&|w| *w == Why::Unknown),
        count(&|w| matches!(w, Why::Independent { .. })),
        count(&|w| matches!(w, Why::Tail { .. })),
        count(&|w| matches!(w, Why::Known(_)) && !unreachable(w)),
        count(&unreachable),
    );
    let mut cited: Vec<usize> = Vec::new();
    for r in rare {
        let why = match &r.why {
            Why::Independent { a_pct, b_pct } => format!(
                "its values met in {a_pct:.1}% and {b_pct:.1}% of the runs: {:.2}% if they \
                 met independently",
                a_pct * b_pct / 100.0
            ),
            Why::Tail { level, level_pct } => {
                format!("a watermark level above {level}, reached in {level_pct:.1}% of the runs")
            }
            Why::Known(k) => {
                if !cited.contains(k) {
                    cited.push(*k);
                }
                let n = 1 + cited.iter().position(|c| c == k).expect("cited");
                format!("reason ({n}) below")
            }
            Why::Unknown => "NO REASON KNOWN".to_string(),
        };
        out += &format!("{:>6.2}%  {}  — {why}\n", r.share_pct, r.name);
    }
    for (n, &k) in cited.iter().enumerate() {
        let k = &KNOWN[k];
        let scope = if k.across_streams {
            " (across streams)"
        } else {
            ""
        };
        out += &format!("({}) {}{scope}: {}\n", n + 1, k.pattern, k.why);
    }
    out
}

#[cfg(test)]
mod tests;
