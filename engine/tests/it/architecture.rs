//! Architecture invariants checked mechanically (ARCHITECTURE.md): outside its production runtime
//! module the engine never names time, threads, tokio, cudarc, a random source, or a hash map
//! whose iteration order could leak into behaviour; cross-thread primitives come only from the
//! `sync` seam; byte sizes of the layouts are written only in the layout module.

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Code lines of a file: comments and the contents of string literals removed.
fn code_lines(text: &str) -> Vec<(usize, String)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let code = l.split("//").next().unwrap_or("");
            // Drop what is inside "..." (messages may quote sizes).
            let mut out = String::new();
            let mut in_str = false;
            let mut prev = ' ';
            for c in code.chars() {
                if c == '"' && prev != '\\' {
                    in_str = !in_str;
                    out.push('"');
                } else if !in_str {
                    out.push(c);
                }
                prev = c;
            }
            (i + 1, out)
        })
        .filter(|(_, l)| !l.trim().is_empty())
        .collect()
}

#[test]
fn engine_reaches_the_world_only_through_its_seams() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    files.sort();
    let forbidden = [
        "std::time",
        "Instant",
        "SystemTime",
        "std::thread",
        "tokio",
        "cudarc",
        "rand::",
        "getrandom",
        "thread_rng",
        "HashMap",
        "HashSet",
        "std::env",
    ];
    let sync_only = ["Mutex", "Condvar", "RwLock", "Atomic", "mpsc"];
    let mut bad = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if rel.starts_with("runtime/") || rel == "runtime.rs" {
            continue; // the production runtime owns the real clock, threads, tokio and CUDA
        }
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in code_lines(&text) {
            for w in forbidden {
                if line.contains(w) {
                    bad.push(format!("{rel}:{n}: names `{w}`: {}", line.trim()));
                }
            }
            if rel != "sync.rs" {
                for w in sync_only {
                    if line.contains(w) {
                        bad.push(format!(
                            "{rel}:{n}: `{w}` outside the sync seam: {}",
                            line.trim()
                        ));
                    }
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "architecture invariants broken:\n{}",
        bad.join("\n")
    );
    assert!(files.len() > 10, "found the sources");
}

#[test]
fn layout_byte_sizes_live_only_in_the_layout_module() {
    // The byte counts of DESIGN §3 (pages, rows, tokens): written in tierkv-kernels' layout.rs
    // and nowhere in the engine.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let sizes = ["8448", "16384", "656", "1152", "576", "132", "41984"];
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().to_string();
        if rel.contains("tests") {
            continue;
        }
        for (n, line) in code_lines(&std::fs::read_to_string(f).unwrap()) {
            for tok in line.split(|c: char| !c.is_ascii_alphanumeric() && c != '_') {
                if sizes.contains(&tok) {
                    bad.push(format!(
                        "{rel}:{n}: byte size {tok} written outside the layout module: {}",
                        line.trim()
                    ));
                }
            }
            // `size_of_val` views an existing slice as bytes; `size_of::<T>()` times a count is
            // a buffer size, which only the layout module computes.
            if line.contains("size_of::<") || line.contains("size_of(") {
                bad.push(format!("{rel}:{n}: size_of outside the layout module"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The `use crate::module` edges between the engine's top-level modules (a module's own
/// submodules count as the module).
fn module_edges(
    root: &Path,
    files: &[PathBuf],
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut edges: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for f in files {
        let rel = f
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let module = rel
            .split('/')
            .next()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        if module == "lib" || rel.contains("tests") {
            continue;
        }
        for (_, line) in code_lines(&std::fs::read_to_string(f).unwrap()) {
            for part in line.split("crate::").skip(1) {
                let target: String = part
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !target.is_empty() && target != module {
                    edges.entry(module.clone()).or_default().insert(target);
                }
            }
        }
    }
    edges
}

/// The owners of a step sit side by side: the model step, the scheduler and the cache
/// controller import none of each other; the types they exchange live in `exchange`.
#[test]
fn the_owners_import_none_of_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let edges = module_edges(&root, &files);
    let owners = ["model", "scheduler", "controller"];
    let mut bad = Vec::new();
    for a in owners {
        assert!(
            edges.contains_key(a),
            "found no imports of `{a}`: {edges:?}"
        );
        for b in owners {
            if edges[a].contains(b) {
                bad.push(format!("{a} imports crate::{b}"));
            }
        }
    }
    assert!(edges["scheduler"].contains("exchange"), "{edges:?}");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn engine_modules_have_no_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    files.sort();
    let edges = module_edges(&root, &files);
    assert!(
        edges.contains_key("engine"),
        "found the module edges: {edges:?}"
    );
    // Depth-first search for a back edge; report the cycle it closes.
    fn visit(
        m: &str,
        edges: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    for m in edges.keys() {
        if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
            panic!(
                "import cycle between engine modules: {}",
                cycle.join(" -> ")
            );
        }
    }
}

#[test]
fn only_the_engine_module_and_the_runtime_name_the_engine() {
    // The owners (scheduler, controller, model step, gate, pools, cache) know nothing of the
    // object that composes them: they take what they work on as arguments.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let mut bad = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if rel == "engine.rs"
            || rel == "engine/pair.rs"
            || rel == "engine/tests.rs"
            || rel == "lib.rs"
            || rel.starts_with("runtime/")
        {
            continue;
        }
        for (n, line) in code_lines(&std::fs::read_to_string(f).unwrap()) {
            let names_engine = line
                .split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|tok| tok == "Engine");
            if names_engine {
                bad.push(format!("{rel}:{n}: {}", line.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "modules naming `Engine`:\n{}",
        bad.join("\n")
    );
}

#[test]
fn only_devices_make_buffer_ids() {
    // A pool buffer reaches the model step only through the gate's proof (`Pools::gated`) and
    // the cache controller only as a `PoolSide`; a `BufferId` written by hand would go around
    // both, so outside the devices (and their module) the engine never constructs one.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let mut bad = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if rel.starts_with("device/") || rel == "cpu_device.rs" || rel.starts_with("runtime/") {
            continue;
        }
        for (n, line) in code_lines(&std::fs::read_to_string(f).unwrap()) {
            if line.contains("BufferId(") {
                bad.push(format!("{rel}:{n}: {}", line.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "buffer ids made outside the devices:\n{}",
        bad.join("\n")
    );
}
