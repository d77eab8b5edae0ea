//! Coverage targets beyond the named probes (issue 33, item 3 in part): happens-before pairs and
//! pairwise combinations of a run's configuration and faults. They count in the probes' table
//! under names of their own, so a campaign's coverage, its shard files and its corpus carry them
//! as they carry probes:
//!
//! - **Happens-before pairs** `hb.CLASS.A>B`: two accesses to one race-detector cell of a buffer
//!   of class `CLASS`, at least one a write, the later one (`B`) ordered after the earlier (`A`;
//!   a race is a finding instead). `A` and `B` are `OP@STREAM:r` or `:w`: the op's name (or the
//!   host's `host_read` / `host_write`) and the stream (or `host`) that made it. A pair is
//!   covered in both orders when both `hb.C.A>B` and `hb.C.B>A` were seen; the report marks the
//!   pairs seen in one order only: across streams, an interleaving the campaign has not yet
//!   tried (or one the engine's waits rule out); on one stream, the program's own order.
//! - **Combinations** `combo.F=V+G=W`: two factors of one run together (two fault kinds are
//!   values of one factor, and are not combined). The factors are the
//!   run's configuration (`ik`, the index-K dtype; `kv`, the KV dtype; `layout`, the host
//!   mirror's; `policy`, the write policy; `ahead`, whether the engine runs one step ahead) and
//!   `fault`, each fault kind the run met (every `fault.*` and `driver.refused_*` probe it hit).
//!   Each run also counts `factor.F=V` for each of its configuration's values (a fault kind's
//!   share is its probe's), so the report can set a combination's share beside the share it
//!   would have if its two values were drawn independently, and can name the configuration
//!   values no seed drew.
//!
//! A pair is counted once a run, at its first sight (the corpus's checkpoint prefix reaches it
//! there); a combination once a run, at the first hit of its fault (or at the run's start, for
//! two configuration factors).
//!
//! Names are interned (one leaked string per distinct name a process meets). They are made only
//! from the op, stream, buffer-class, factor and probe names of this build, and a shard file's
//! names are checked against that grammar ([`is_target`]) and counted ([`TARGETS_MAX`]) before
//! they are interned, so the set stays bounded.
//!
//! - **Watermarks** `mark.NAME>=2^K`: the levels (powers of two) a numeric quantity of the engine
//!   reached (`tierkv_engine::probe::Watermark`: loads in flight at an abort, load-ring slots
//!   held at a claim, prompt tokens queued at an accepted submit, host pages one eviction
//!   dropped, host pages free when a backup evicts the host tier, and the ops enqueued between
//!   an event's record and a wait on it, counted by the runtime). The engine counts them; the
//!   report gives each level's share of seeds.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use crate::race::ENTITIES;
use tierkv_engine::config::{Config, WritePolicy};
use tierkv_engine::device::{BufferRole, Op};
use tierkv_engine::probe::{Watermark, MARK_LEVELS};
use tierkv_kernels::layout::{BufferKind, HostLayout, IndexKDtype, KvDtype};

/// The prefix of a happens-before pair's name.
pub const PAIR_PREFIX: &str = "hb.";
/// The prefix of a combination's name.
pub const COMBO_PREFIX: &str = "combo.";
/// The prefix of a single factor's name.
pub const FACTOR_PREFIX: &str = "factor.";
/// The prefix of a watermark's levels (`tierkv_engine::probe::Watermark`).
pub const MARK_PREFIX: &str = "mark.";
/// The most targets a shard file may carry (run 101's 959 default seeds reached 165 pair names,
/// 356 combinations and 28 watermark levels).
pub const TARGETS_MAX: usize = 100_000;
/// The longest target name a shard file may carry.
pub const NAME_BYTES_MAX: usize = 200;

static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());

/// The one `&'static str` of `name` in this process (leaked at its first use).
pub fn intern(name: &str) -> &'static str {
    let mut names = NAMES
        .lock()
        .expect("the target names' lock is never poisoned");
    if let Some(&n) = names.get(name) {
        return n;
    }
    let n: &'static str = Box::leak(name.to_string().into_boxed_str());
    names.insert(n);
    n
}

/// Whether `name` is a target's name (a pair, a combination, a factor or a watermark's level),
/// not a probe's.
pub fn is_target_name(name: &str) -> bool {
    [PAIR_PREFIX, COMBO_PREFIX, FACTOR_PREFIX, MARK_PREFIX]
        .iter()
        .any(|p| name.starts_with(p))
}

/// The class of a buffer in pair names: its role without its layer or segment.
pub fn buffer_class(role: &BufferRole) -> &'static str {
    match role {
        BufferRole::Pool {
            kind: BufferKind::Kv,
            ..
        } => "device_kv",
        BufferRole::Pool {
            kind: BufferKind::IndexK,
            ..
        } => "device_index_k",
        BufferRole::Mirror {
            kind: BufferKind::Kv,
        } => "mirror_kv",
        BufferRole::Mirror {
            kind: BufferKind::IndexK,
        } => "mirror_index_k",
        BufferRole::Scratch { name } => intern(&format!("scratch_{}", word(name))),
        BufferRole::OffloadHost { .. } => "offload_host",
    }
}

/// `s` with every character other than ASCII letters, digits and `_` made `_`.
fn word(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// One side of a pair: who accessed, where, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Side {
    /// The op's name, or the host's action.
    pub op: &'static str,
    /// The stream's name (`gpu::entity_name`), or `host`.
    pub stream: &'static str,
    pub write: bool,
}

impl Side {
    fn name(&self) -> String {
        let rw = if self.write { 'w' } else { 'r' };
        format!("{}@{}:{rw}", self.op, word(self.stream))
    }
}

/// The name of the pair `earlier` then `later` on a buffer of `class`.
pub fn pair_name(class: &str, earlier: &Side, later: &Side) -> String {
    format!("{PAIR_PREFIX}{class}.{}>{}", earlier.name(), later.name())
}

/// A run's factors: its configuration's (see the module's doc), each value named by
/// `FACTOR_VALUES`.
pub fn config_factors(cfg: &Config, ahead: bool) -> Vec<(&'static str, &'static str)> {
    let ik = match cfg.model.index_k_dtype {
        IndexKDtype::Fp8 => 0,
        IndexKDtype::Bf16 => 1,
    };
    let kv = match cfg.model.kv_dtype {
        KvDtype::Bf16 => 0,
        KvDtype::Fp8Packed => 1,
        KvDtype::Fp8Unpacked => 2,
    };
    let layout = match cfg.cache.host_layout {
        HostLayout::LayerFirst => 0,
        HostLayout::PageFirst => 1,
    };
    let policy = match cfg.cache.write_policy {
        WritePolicy::WriteThrough => 0,
        WritePolicy::WriteThroughSelective => 1,
        WritePolicy::WriteBack => 2,
    };
    let ahead = if ahead { 0 } else { 1 };
    (FACTOR_VALUES.iter())
        .zip([ik, kv, layout, policy, ahead])
        .map(|(&(f, values), k)| (f, values[k]))
        .collect()
}

/// Whether the probe `name` is a fault kind (a `fault.*` or `driver.refused_*` probe).
pub fn is_fault(name: &str) -> bool {
    name.starts_with("fault.") || name.starts_with("driver.refused_")
}

/// Adds a run's factors and their pairwise combinations to its probe counts `probes` and first
/// hits `first` (see the module's doc): `config` its configuration's factors, its faults read
/// from `probes`.
pub fn add_combinations(
    config: &[(&'static str, &'static str)],
    probes: &mut BTreeMap<&'static str, u64>,
    first: &mut BTreeMap<&'static str, u64>,
) {
    // (factor, value, position of its first hit)
    let mut factors: Vec<(&str, &str, u64)> = config.iter().map(|&(f, v)| (f, v, 0)).collect();
    for (&name, &n) in probes.iter() {
        if n > 0 && is_fault(name) {
            let at = first.get(name).copied().unwrap_or(0);
            factors.push(("fault", name, at));
        }
    }
    let mut add = |name: String, at: u64| {
        let name = intern(&name);
        *probes.entry(name).or_default() += 1;
        first.entry(name).or_insert(at);
    };
    for (i, &(f, v, at)) in factors.iter().enumerate() {
        // A fault's own share is its probe's: no factor name of its own.
        if f != "fault" {
            add(format!("{FACTOR_PREFIX}{f}={v}"), at);
        }
        for &(g, w, at2) in &factors[i + 1..] {
            if g != f {
                add(format!("{COMBO_PREFIX}{f}={v}+{g}={w}"), at.max(at2));
            }
        }
    }
}

/// Whether `name` is a target this build can make: a pair of known ops and streams on a known
/// class (a scratch buffer's by a name of at most `SCRATCH_NAME_BYTES_MAX` word characters), a
/// factor or combination of known factors and values, or a watermark's level. Shard files'
/// names are checked with it before they are interned.
pub fn is_target(name: &str, probe_names: &[&str]) -> bool {
    if name.len() > NAME_BYTES_MAX {
        return false;
    }
    if let Some(rest) = name.strip_prefix(PAIR_PREFIX) {
        return is_pair(rest);
    }
    if let Some(rest) = name.strip_prefix(FACTOR_PREFIX) {
        return is_factor(rest, probe_names);
    }
    if name.starts_with(MARK_PREFIX) {
        return Watermark::ALL
            .iter()
            .any(|w| (0..MARK_LEVELS).any(|k| w.level_name(k) == name));
    }
    if let Some(rest) = name.strip_prefix(COMBO_PREFIX) {
        return rest.split_once('+').is_some_and(|(a, b)| {
            is_factor(a, probe_names) && is_factor(b, probe_names) && factor_of(a) != factor_of(b)
        });
    }
    false
}

/// The factor of `s`, a `F=V`.
fn factor_of(s: &str) -> &str {
    s.split_once('=').map_or("", |(f, _)| f)
}

/// Every configuration factor and its values (`fault` aside), in the order
/// [`config_factors`] gives them.
const FACTOR_VALUES: [(&str, &[&str]); 5] = [
    ("ik", &["fp8", "bf16"]),
    ("kv", &["bf16", "fp8", "fp8_unpacked"]),
    ("layout", &["layer_first", "page_first"]),
    ("policy", &["write_through", "selective", "write_back"]),
    ("ahead", &["on", "off"]),
];

fn is_factor(s: &str, probe_names: &[&str]) -> bool {
    let Some((f, v)) = s.split_once('=') else {
        return false;
    };
    if f == "fault" {
        return is_fault(v) && probe_names.contains(&v);
    }
    FACTOR_VALUES
        .iter()
        .any(|(g, values)| *g == f && values.contains(&v))
}

/// The host's actions a pair may hold, beside the ops (`Op::NAMES`).
pub const HOST_ACTIONS: [&str; 2] = ["host_read", "host_write"];

/// The classes a pair may name: the pools', the mirrors', the offload tier's, and a scratch
/// buffer's by its name (`buffer_class`), which the engine does not list.
const CLASSES: [&str; 5] = [
    "device_kv",
    "device_index_k",
    "mirror_kv",
    "mirror_index_k",
    "offload_host",
];
/// The longest scratch buffer name a pair's class may hold.
const SCRATCH_NAME_BYTES_MAX: usize = 40;

fn is_class(class: &str) -> bool {
    CLASSES.contains(&class)
        || class.strip_prefix("scratch_").is_some_and(|n| {
            (1..=SCRATCH_NAME_BYTES_MAX).contains(&n.len())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

fn is_pair(rest: &str) -> bool {
    let Some((class, sides)) = rest.split_once('.') else {
        return false;
    };
    let side = |s: &str| {
        let Some((op, rest)) = s.split_once('@') else {
            return false;
        };
        let Some((stream, rw)) = rest.split_once(':') else {
            return false;
        };
        (Op::NAMES.contains(&op) || HOST_ACTIONS.contains(&op))
            && (0..ENTITIES).any(|e| word(crate::gpu::entity_name(e)) == stream)
            && (rw == "r" || rw == "w")
    };
    is_class(class)
        && sides
            .split_once('>')
            .is_some_and(|(a, b)| side(a) && side(b))
}

/// A campaign's probe table (name → hits, seeds), as `probes::Coverage` holds it.
type Table = BTreeMap<&'static str, (u64, u64)>;

/// The pairs of a campaign: (class, its two sides in name order) → the seeds that saw the first
/// side before the second, and the second before the first.
fn pairs(probes: &Table) -> BTreeMap<(&str, &str, &str), (u64, u64)> {
    let mut pairs: BTreeMap<(&str, &str, &str), (u64, u64)> = BTreeMap::new();
    for (name, &(_, n)) in probes.range(PAIR_PREFIX..) {
        let Some(rest) = name.strip_prefix(PAIR_PREFIX) else {
            break;
        };
        let Some((class, (a, b))) = rest
            .split_once('.')
            .and_then(|(c, sides)| Some((c, sides.split_once('>')?)))
        else {
            continue;
        };
        if a <= b {
            pairs.entry((class, a, b)).or_default().0 += n;
        } else {
            pairs.entry((class, b, a)).or_default().1 += n;
        }
    }
    pairs
}

/// Whether a pair was seen in one order only. A side paired with itself (a kernel's write
/// after its own last write) has one order, and is not.
fn one_order_only((_, a, b): &(&str, &str, &str), &(x, y): &(u64, u64)) -> bool {
    a != b && (x == 0) != (y == 0)
}

/// Whether both sides of a pair are on one stream (or both the host's): their order is the
/// order the engine issued them in, not an interleaving of streams.
fn one_stream(a: &str, b: &str) -> bool {
    fn stream(side: &str) -> Option<&str> {
        side.split_once('@')?.1.split(':').next()
    }
    stream(a) == stream(b)
}

/// Whether a combination met in `share` percent of `runs` runs met less often than values of
/// its two values' shares meeting independently would (`independent` percent), by more than two
/// standard deviations of that share over `runs` runs: its values avoid each other, more than
/// chance explains.
fn short_of_independent(share: f64, independent: f64, runs: u64) -> bool {
    share < independent - two_sigma(independent, runs)
}

/// Two standard deviations (percent) of the share of `runs` runs that meet a target each run
/// meets with probability `p` percent.
fn two_sigma(p: f64, runs: u64) -> f64 {
    let q = p / 100.0;
    200.0 * (q * (1.0 - q) / runs.max(1) as f64).sqrt()
}

/// One combination of a campaign's report: its two factor values, the share of seeds that met
/// both, and the share independent draws of the two would give (percent).
struct Combination {
    a: String,
    b: String,
    share: f64,
    independent: f64,
}

/// Every combination of two values of different factors, over the configuration's values that
/// some seed drew and the fault kinds some seed met, with the values no seed drew.
fn combinations(probes: &Table, seeds: u64) -> (Vec<Combination>, Vec<String>) {
    let share = |n: u64| 100.0 * n as f64 / seeds.max(1) as f64;
    let seeds_of = |name: &str| probes.get(name).map_or(0, |e| e.1);
    // Each value with the seeds that had it: a configuration value's by its factor name, a
    // fault kind's by its probe.
    let mut values: Vec<(String, u64)> = Vec::new();
    let mut undrawn = Vec::new();
    for (f, vs) in FACTOR_VALUES {
        for v in vs {
            let n = seeds_of(&format!("{FACTOR_PREFIX}{f}={v}"));
            if n > 0 {
                values.push((format!("{f}={v}"), n));
            } else {
                undrawn.push(format!("{f}={v}"));
            }
        }
    }
    for (name, &(_, n)) in probes {
        if n > 0 && is_fault(name) {
            values.push((format!("fault={name}"), n));
        }
    }
    let mut rows = Vec::new();
    for (i, (a, fa)) in values.iter().enumerate() {
        for (b, fb) in values[i + 1..]
            .iter()
            .filter(|(b, _)| factor_of(a) != factor_of(b))
        {
            let both = seeds_of(&format!("{COMBO_PREFIX}{a}+{b}"))
                + seeds_of(&format!("{COMBO_PREFIX}{b}+{a}"));
            rows.push(Combination {
                a: a.clone(),
                b: b.clone(),
                share: share(both),
                independent: share(*fa) * share(*fb) / 100.0,
            });
        }
    }
    (rows, undrawn)
}

/// The targets' line of a campaign's summary: how many pairs it saw, how many combinations of
/// the factor values its seeds had it met, and each watermark's highest level.
pub fn summary(probes: &Table, seeds: u64) -> String {
    let p = pairs(probes);
    let one_order = p.iter().filter(|(k, v)| one_order_only(k, v));
    let across = one_order
        .clone()
        .filter(|((_, a, b), _)| !one_stream(a, b))
        .count();
    let one_order = one_order.count();
    let (c, undrawn) = combinations(probes, seeds);
    let highest: Vec<String> = (marks(probes).into_iter())
        .map(|(name, levels)| {
            let top = levels
                .last()
                .map_or("0".to_string(), |&(v, _)| format!(">={v}"));
            format!("{name} {top}")
        })
        .collect();
    format!(
        "targets: {} happens-before pairs of accesses, {one_order} seen in one order only \
         ({across} of them across streams); \
         {} combinations of two factor values, {} in fewer than 5% of seeds ({} never){}; \
         highest watermarks: {}",
        p.len(),
        c.len(),
        c.iter().filter(|r| r.share < 5.0).count(),
        c.iter().filter(|r| r.share == 0.0).count(),
        if undrawn.is_empty() {
            String::new()
        } else {
            format!("; values no seed drew: {}", undrawn.join(", "))
        },
        highest.join(", ")
    )
}

/// Each watermark's levels: (its name, for each level reached the level's value and the
/// seeds that reached it), in `Watermark::ALL` order.
fn marks(probes: &Table) -> Vec<(&'static str, Vec<(u64, u64)>)> {
    (Watermark::ALL.iter())
        .map(|&w| {
            let levels = (0..MARK_LEVELS)
                .filter_map(|k| Some((1u64 << k, probes.get(w.level_name(k))?.1)))
                .collect();
            (w.name(), levels)
        })
        .collect()
}

/// The report of a campaign's targets: its pairs by class (each pair's two orders, and the
/// share of seeds that saw each), then its combinations beside the share that independent
/// draws would give.
pub fn table(probes: &Table, seeds: u64) -> String {
    let share = |n: u64| 100.0 * n as f64 / seeds.max(1) as f64;
    let mut out = String::new();
    for (name, levels) in marks(probes) {
        let levels: Vec<String> = (levels.iter())
            .map(|&(v, n)| format!(">={v} {:.1}%", share(n)))
            .collect();
        out += &format!("watermark {name}: {}\n", levels.join(", "));
    }
    out += "happens-before pairs (A>B: the share of seeds where an access A came before a \
            conflicting access B, ordered)\n";
    out += &format!(
        "{:<24} {:<34} {:<34} {:>7} {:>7}\n",
        "class", "A", "B", "A>B", "B>A"
    );
    for (key @ (class, a, b), counts @ (ab, ba)) in &pairs(probes) {
        let mark = if a == b {
            "  (itself)"
        } else if one_order_only(key, counts) && one_stream(a, b) {
            "  one order (one stream)"
        } else if one_order_only(key, counts) {
            "  one order, across streams"
        } else if share(*ab) < 5.0 || share(*ba) < 5.0 {
            "  < 5%"
        } else {
            ""
        };
        let (ab, ba) = (share(*ab), share(*ba));
        out += &format!("{class:<24} {a:<34} {b:<34} {ab:>6.1}% {ba:>6.1}%{mark}\n");
    }
    out += "\ncombinations of two factor values (seeds: the share that had both; if indep.: \
            the product of the two values' shares)\n";
    out += &format!(
        "{:<36} {:<36} {:>7} {:>9}\n",
        "factor", "factor", "seeds", "if indep."
    );
    for c in combinations(probes, seeds).0 {
        let mark = if c.share == 0.0 {
            "  never"
        } else if short_of_independent(c.share, c.independent, seeds) {
            "  short of indep."
        } else if c.share < 5.0 {
            "  < 5%"
        } else {
            ""
        };
        let (a, b, got, ind) = (c.a, c.b, c.share, c.independent);
        out += &format!("{a:<36} {b:<36} {got:>6.1}% {ind:>8.1}%{mark}\n");
    }
    out
}

pub mod rare;

#[cfg(test)]
mod tests;
