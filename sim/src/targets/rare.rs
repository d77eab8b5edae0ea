//! The rare targets of a campaign, each with the reason it is rare where one is known
//! (`tierkv campaign merge --rare`; issue 33 asks that every target a default campaign can reach
//! be reached in at least 5% of its runs, or be listed with its reason).
//!
//! A target is rare when fewer than [`RARE_SHARE`] of the campaign's runs reached it, never
//! included: every probe the campaign can reach (`Coverage::names`), every configuration value
//! ([`FACTOR_VALUES`]), every combination of two values some run drew (or fault kinds some run
//! met), every happens-before pair the campaign saw at all (an access pair never seen has no
//! name to list: the pairs' table marks the orders never seen), and every watermark level up to
//! the highest one reached. The reasons are of three kinds:
//!
//! - **Derived from the counts**: a combination whose two values' own shares multiply to under
//!   5% (independent draws meet that rarely), or that met at least half as often as that
//!   product; a watermark level above one reached more often (each level asks twice the
//!   quantity of the one below).
//! - **Read from the code**, one per target or class of targets, in [`KNOWN`]: what the code
//!   requires before the target can be reached. Each names the code it was read from.
//! - **None known**: listed as such. These are the targets a guided campaign (`sim --corpus`)
//!   should reach more often, or the simulator's draws should favour.

use super::{combinations, Table, COMBO_PREFIX, FACTOR_PREFIX, FACTOR_VALUES, MARK_PREFIX};
use super::{Watermark, MARK_LEVELS, PAIR_PREFIX};

/// The share of runs below which a target is rare.
pub const RARE_SHARE: f64 = 0.05;

/// Why a target is rare.
#[derive(Clone, Debug, PartialEq)]
pub enum Why {
    /// A combination of two values drawn apart: their own shares (percent) multiply to under
    /// 5%, or the combination met at least half as often as that product.
    Independent { a: f64, b: f64 },
    /// A watermark level; the level below it was reached in this share (percent) of the runs.
    Tail { below: f64 },
    /// A reason read from the code ([`KNOWN`]).
    Known(&'static str),
    /// No reason known.
    Unknown,
}

/// Reasons read from the code: a target's name, or a prefix ending in `*`, and the reason.
/// The first entry that matches a name gives its reason.
pub const KNOWN: &[(&str, &str)] = &[
    (
        "factor.kv=fp8_unpacked",
        "a foreign row layout that no kernel stores or reads (kernels/src/args.rs, \
         `check_stored`): the simulator draws the KV pool as bf16 or packed fp8 only \
         (sim/src/scenario.rs, `draw_dtypes`)",
    ),
    (
        "step.waited_for_load",
        "a step waits for a load only when it has no rows to compute, no step is in flight \
         (one step ahead), no backup is in flight and a load is (engine/src/engine.rs, \
         `step` and `wait_for_copies`: with a backup in flight it waits for that instead, \
         step.waited_for_backup)",
    ),
    (
        "hb.device_kv.copy@load:w>copy@write:r",
        "a page a load wrote is read by a backup only once the host tier has dropped that \
         page's host copy while the device kept it (engine/src/cache.rs: `evict_host` takes a \
         resident node's host copy, and `needs_backup` then backs the node up again): a load, \
         then a host-tier eviction of that very page, then a backup of its prefix",
    ),
    (
        "hb.device_index_k.copy@load:w>copy@write:r",
        "the index-K half of hb.device_kv.copy@load:w>copy@write:r, whose reason is the same \
         (a load's page, its host copy evicted, backed up again)",
    ),
    (
        "hb.scratch_digests.next_tokens@compute:r>sparse_read@compute:w",
        "running ahead, a step reads its digests by next_tokens and then by the copy to pinned \
         memory, both of the whole buffer, in that order (engine/src/model.rs, `end_step`); \
         the next step's sparse_read write follows next_tokens' read directly only when that \
         copy did not run after it (its enqueue refused, or the step abandoned between the \
         two)",
    ),
    (
        "combo.policy=selective+fault=fault.host_pages_refused",
        "the refusal is drawn at each allocation of host pages (engine/src/pools.rs, `inject`), \
         and selective write-through allocates them for a backup only when a prefix was hit \
         often enough (engine/src/controller.rs, admission's `WriteThroughSelective` branch), \
         where write-through backs up every finished request's pages (engine/src/engine.rs, \
         `complete`) (read from the code; the allocations per policy are not counted)",
    ),
    (
        "hb.scratch_stream_ordered.*",
        "stream-ordered scratch memory: the simulated driver's pool gives a freed buffer back to \
         the next allocation of the same stream and power-of-two size (sim/src/driver.rs, \
         `alloc_async`), so two ops of different kinds meet on its bytes only when their \
         arguments or outputs round to one size; it passes to another stream only after a pool \
         trim, which the runtime makes when a stream-ordered allocation was refused \
         (engine/src/runtime/driven.rs, `scratch_alloc`; see driver.refused_alloc_async)",
    ),
];

/// One rare target: its name, the share of runs (percent) that reached it, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Rare {
    pub name: String,
    pub share: f64,
    pub why: Why,
}

/// The rare targets of a campaign of `runs` runs whose probe table is `probes`, the probes it
/// can reach being `probe_names`, in name order.
pub fn rare(probes: &Table, runs: u64, probe_names: &[&str]) -> Vec<Rare> {
    let share = |name: &str| {
        let mut n = seeds_of(probes, name);
        if let Some((a, b)) = name
            .strip_prefix(COMBO_PREFIX)
            .and_then(|r| r.split_once('+'))
        {
            n += seeds_of(probes, &format!("{COMBO_PREFIX}{b}+{a}"));
        }
        100.0 * n as f64 / runs.max(1) as f64
    };
    let mut names: Vec<String> = probe_names.iter().map(|n| n.to_string()).collect();
    for (f, values) in FACTOR_VALUES {
        names.extend(values.iter().map(|v| format!("{FACTOR_PREFIX}{f}={v}")));
    }
    names.extend(
        (probes.keys())
            .filter(|n| n.starts_with(PAIR_PREFIX))
            .map(|n| n.to_string()),
    );
    // Every combination of two drawn values, met or not, under the name its campaign counts
    // it by (either order: `combinations` adds both).
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
    names.sort();
    names.dedup();
    (names.into_iter())
        .filter_map(|name| {
            let s = share(&name);
            (s < 100.0 * RARE_SHARE).then(|| Rare {
                why: why(probes, runs, &name, s),
                share: s,
                name,
            })
        })
        .collect()
}

fn seeds_of(probes: &Table, name: &str) -> u64 {
    probes.get(name).map_or(0, |e| e.1)
}

/// Why `name`, reached in `share` percent of `runs`, is rare.
fn why(probes: &Table, runs: u64, name: &str, share: f64) -> Why {
    let pct = |n: &str| 100.0 * seeds_of(probes, n) as f64 / runs.max(1) as f64;
    if let Some(w) = known(name) {
        return Why::Known(w);
    }
    if let Some((a, b)) = name
        .strip_prefix(COMBO_PREFIX)
        .and_then(|r| r.split_once('+'))
    {
        // A configuration value's share is its factor name's, a fault kind's its probe's.
        let value = |v: &str| match v.strip_prefix("fault=") {
            Some(probe) => pct(probe),
            None => pct(&format!("{FACTOR_PREFIX}{v}")),
        };
        let (a, b) = (value(a), value(b));
        let independent = a * b / 100.0;
        if independent < 100.0 * RARE_SHARE || share >= independent / 2.0 {
            return Why::Independent { a, b };
        }
        return Why::Unknown;
    }
    if name.starts_with(MARK_PREFIX) {
        let below = Watermark::ALL.iter().find_map(|w| {
            let k = (1..MARK_LEVELS).find(|&k| w.level_name(k) == name)?;
            Some(pct(w.level_name(k - 1)))
        });
        return match below {
            Some(below) if below > share => Why::Tail { below },
            _ => Why::Unknown,
        };
    }
    Why::Unknown
}

/// The reason [`KNOWN`] gives `name`, if any.
fn known(name: &str) -> Option<&'static str> {
    KNOWN.iter().find_map(|&(pattern, why)| {
        let hit = match pattern.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == pattern,
        };
        hit.then_some(why)
    })
}

/// The report of [`rare`]: a count by kind of reason, one line a target, then the reasons read
/// from the code that the lines cite, each once.
pub fn report(rare: &[Rare]) -> String {
    let count = |f: fn(&Why) -> bool| rare.iter().filter(|r| f(&r.why)).count();
    let mut out = format!(
        "rare targets (reached in fewer than {:.0}% of the runs): {}: {} combinations of values \
         drawn apart, {} watermark levels above a more common one, {} with a reason read from \
         the code, {} with no reason known\n",
        100.0 * RARE_SHARE,
        rare.len(),
        count(|w| matches!(w, Why::Independent { .. })),
        count(|w| matches!(w, Why::Tail { .. })),
        count(|w| matches!(w, Why::Known(_))),
        count(|w| *w == Why::Unknown),
    );
    let mut cited = Vec::new();
    for r in rare {
        let why = match &r.why {
            Why::Independent { a, b } => format!(
                "two values drawn apart: {a:.1}% and {b:.1}%, {:.2}% if independent",
                a * b / 100.0
            ),
            Why::Tail { below } => {
                format!("a watermark level: the level below it in {below:.1}% of the runs")
            }
            Why::Known(w) => {
                let k = (KNOWN.iter().position(|(_, k)| k == w))
                    .expect("a known reason is one of KNOWN's");
                if !cited.contains(&k) {
                    cited.push(k);
                }
                format!("reason ({}) below", k + 1)
            }
            Why::Unknown => "NO REASON KNOWN".to_string(),
        };
        out += &format!("{:>6.2}%  {}  — {why}\n", r.share, r.name);
    }
    cited.sort();
    for k in cited {
        out += &format!("({}) {}: {}\n", k + 1, KNOWN[k].0, KNOWN[k].1);
    }
    out
}

#[cfg(test)]
mod tests;
