//! The 70-line ratchet (TigerBeetle's tidy habit): no production function of the workspace grows
//! past `LINES_MAX` lines, counted from its `fn` line to its closing brace, both included. The
//! functions that were longer when the ratchet came in are listed in `LONGER`, each with the
//! length it had then: it may shrink, never grow; an entry whose function shrank is lowered to
//! its new length (the test says so), and one whose function is back within the limit (or gone)
//! must leave the list, so the list only ever shrinks.
//!
//! Production code is every `.rs` file under `engine/src`, `kernels/src` and `sim/src`, except
//! files named `tests.rs`, files under a `tests/` folder, and a file's `#[cfg(test)]` modules.
//! Functions are found by rustfmt's layout: a `fn` item whose body opens on its signature's last
//! line and closes with a `}` at the item's own indentation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The longest a production function may be, in lines.
const LINES_MAX: usize = 70;

/// How many functions `LONGER` may list: lowered as entries leave, never raised.
const LONGER_COUNT_MAX: usize = 46;

/// `(file under the workspace root, function name, its length: the one it had when the ratchet
/// came in, lowered each time it shrank)`. Where
/// a file has several functions of one name, the length is the longest of them, and each of
/// them may grow to it (a loophole: `runner.rs`'s short `step` could).
const LONGER: &[(&str, &str, usize)] = &[
    ("engine/src/cache.rs", "check_invariants", 117),
    ("engine/src/config.rs", "preset", 111),
    ("engine/src/config.rs", "validate_cache", 89),
    ("engine/src/config.rs", "validate_limits", 71),
    ("engine/src/config.rs", "validate_model", 74),
    ("engine/src/engine.rs", "step", 105),
    ("engine/src/engine/pair.rs", "start_transfers", 98),
    ("engine/src/metrics.rs", "render_prometheus", 85),
    ("engine/src/metrics.rs", "series", 155),
    ("engine/src/runtime/cuda.rs", "launch_kernels", 162),
    ("engine/src/runtime/nccl.rs", "measure", 108),
    ("engine/src/scheduler.rs", "build_batch", 90),
    ("engine/src/scheduler.rs", "record_forward", 75),
    ("engine/src/trace/cache_replay.rs", "request", 75),
    ("kernels/src/layout.rs", "fuzz_layout_copy", 71),
    ("kernels/src/spec.rs", "check_q_head", 73),
    ("sim/src/campaign.rs", "run_campaign", 71),
    ("sim/src/cli/bench.rs", "logits", 173),
    ("sim/src/cli/bench.rs", "store", 90),
    ("sim/src/cli/bench.rs", "topk", 79),
    ("sim/src/cli/replay_pd.rs", "compare_with", 105),
    ("sim/src/cli/sim.rs", "campaign", 73),
    ("sim/src/cli/sim.rs", "shrink_and_report", 73),
    ("sim/src/cli/sim.rs", "single", 76),
    ("sim/src/cli/zoo.rs", "run_zoo", 78),
    ("sim/src/driver.rs", "sim_op", 119),
    ("sim/src/gpu/mod.rs", "enqueue_with", 86),
    ("sim/src/gpu/streams.rs", "advance_stream", 94),
    ("sim/src/gpu/streams.rs", "complete", 99),
    ("sim/src/oracles/conservation.rs", "audit", 128),
    ("sim/src/oracles/content.rs", "check_index_k", 79),
    ("sim/src/oracles/content.rs", "check_kv", 99),
    ("sim/src/oracles/metrics.rs", "check", 92),
    ("sim/src/runner.rs", "start_engine", 120),
    ("sim/src/runner.rs", "step", 104),
    ("sim/src/scenario.rs", "add_production_shapes", 71),
    ("sim/src/scenario.rs", "draw", 78),
    ("sim/src/scenario.rs", "validate", 94),
    ("sim/src/shard.rs", "check", 124),
    ("sim/src/shard.rs", "merge", 112),
    ("sim/src/shrink.rs", "candidates", 125),
    ("sim/src/trace_out.rs", "chrome_trace", 106),
];

/// One function: where it is and how long it is.
#[derive(Debug)]
struct Function {
    file: String,
    name: String,
    line: usize,
    lines: usize,
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("a source folder") {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "tests") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            out.push(p);
        }
    }
}

/// The name of the function a line declares, if it declares one (`fn name`, after any
/// visibility and qualifiers).
fn declared_fn(line: &str) -> Option<String> {
    let mut words = line.split_whitespace();
    loop {
        let w = words.next()?;
        match w {
            "fn" => {
                let name: String = words
                    .next()?
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                return (!name.is_empty()).then_some(name);
            }
            "pub" | "const" | "async" | "unsafe" | "extern" | "default" => {}
            w if w.starts_with("pub(") || w.starts_with('"') => {}
            _ => return None,
        }
    }
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// Every function of one file's production code.
fn functions(file: &str, text: &str) -> Vec<Function> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        // A test module: skip to its closing brace.
        if line.trim_start().starts_with("#[cfg(") && line.contains("test") {
            if let Some(next) = lines.get(i + 1) {
                if next.trim_start().starts_with("mod ") && next.trim_end().ends_with('{') {
                    let close = format!("{}}}", " ".repeat(indent(next)));
                    i += 2;
                    while i < lines.len() && lines[i].trim_end() != close {
                        i += 1;
                    }
                    i += 1;
                    continue;
                }
            }
        }
        if let Some(name) = declared_fn(line) {
            // The signature ends at the first line (from here) ending in `{` (a body), `{}` (an
            // empty one) or `;` (a declaration without one).
            let mut end = i;
            while end < lines.len() {
                let t = lines[end].trim_end();
                if t.ends_with('{') || t.ends_with("{}") || t.ends_with(';') {
                    break;
                }
                end += 1;
            }
            let body = end < lines.len() && !lines[end].trim_end().ends_with(';');
            if body {
                let close = format!("{}}}", " ".repeat(indent(line)));
                let mut last = end;
                // A one-line body (`fn f() {}`) ends on its own line.
                if !lines[end].trim_end().ends_with("{}") {
                    last += 1;
                    while last < lines.len() && lines[last].trim_end() != close {
                        last += 1;
                    }
                }
                assert!(
                    last < lines.len(),
                    "{file}:{}: found no closing brace of `fn {name}` at its indentation",
                    i + 1
                );
                out.push(Function {
                    file: file.to_string(),
                    name,
                    line: i + 1,
                    lines: last - i + 1,
                });
            }
        }
        i += 1;
    }
    out
}

fn workspace_functions() -> Vec<Function> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for krate in ["engine", "kernels", "sim", "python"] {
        rust_files(&root.join(krate).join("src"), &mut files);
    }
    files.sort();
    let mut out = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(root)
            .expect("under the root")
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(f).expect("a source file");
        out.extend(functions(&rel, &text));
    }
    out
}

#[test]
fn no_production_function_grows_past_70_lines() {
    let all = workspace_functions();
    assert!(
        all.len() > 1000,
        "found only {} functions: the scanner lost its way",
        all.len()
    );
    // The longest of each (file, name).
    let mut longest: BTreeMap<(&str, &str), &Function> = BTreeMap::new();
    for f in &all {
        let e = longest.entry((&f.file, &f.name)).or_insert(f);
        if f.lines > e.lines {
            *e = f;
        }
    }
    let listed: BTreeMap<(&str, &str), usize> = LONGER
        .iter()
        .map(|&(file, name, lines)| ((file, name), lines))
        .collect();
    assert_eq!(
        listed.len(),
        LONGER.len(),
        "an entry of LONGER is listed twice"
    );
    assert!(
        LONGER.len() <= LONGER_COUNT_MAX,
        "LONGER lists {} functions, more than the {LONGER_COUNT_MAX} it may: split the new one",
        LONGER.len()
    );
    let mut bad = Vec::new();
    for (&(file, name), f) in &longest {
        match listed.get(&(file, name)) {
            None if f.lines > LINES_MAX => bad.push(format!(
                "{file}:{}: `fn {name}` has {} lines (at most {LINES_MAX}): split it",
                f.line, f.lines
            )),
            Some(&was) if f.lines > was => bad.push(format!(
                "{file}:{}: `fn {name}` has {} lines, more than the {was} it had when the \
                 ratchet came in: it may only shrink",
                f.line, f.lines
            )),
            Some(&was) if f.lines > LINES_MAX && f.lines < was => bad.push(format!(
                "{file}:{}: `fn {name}` has {} lines, fewer than the {was} listed: lower its \
                 entry in LONGER to {} (the ratchet turns)",
                f.line, f.lines, f.lines
            )),
            Some(_) if f.lines <= LINES_MAX => bad.push(format!(
                "{file}:{}: `fn {name}` is within {LINES_MAX} lines now ({}): remove it from LONGER",
                f.line, f.lines
            )),
            _ => {}
        }
    }
    for &(file, name, _) in LONGER {
        if !longest.contains_key(&(file, name)) {
            bad.push(format!(
                "{file}: `fn {name}` is gone: remove it from LONGER"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The scanner finds a function's extent by rustfmt's layout, skips test modules and
/// declarations, and counts both ends.
#[test]
fn the_ratchet_measures_what_it_says() {
    let text = "\
pub(crate) fn short(a: u32) -> u32 {
    a + 1
}

impl X {
    pub async unsafe fn long(
        &self,
    ) {
        let x = 1;
        if x == 1 {
            g();
        }
    }
    fn empty() {}
}

trait T {
    fn declared(&self);
}

#[cfg(test)]
mod tests {
    fn in_a_test() {
        one();
    }
}
";
    let found: Vec<(String, usize, usize)> = functions("f.rs", text)
        .into_iter()
        .map(|f| (f.name, f.line, f.lines))
        .collect();
    assert_eq!(
        found,
        [
            ("short".to_string(), 1, 3),
            ("long".to_string(), 6, 8),
            ("empty".to_string(), 14, 1),
        ]
    );
}
