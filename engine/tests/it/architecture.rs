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

#[test]
fn the_gate_is_the_only_way_to_a_pool_buffer() {
    // `Pools::device_buffer` hands out a layer's KV or index-K buffer; only the gate may call it
    // (the cache controller moves pages through `device_side`, never reads them).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap().to_string_lossy().to_string();
        if rel == "gate.rs" || rel == "pools.rs" {
            continue;
        }
        for (n, line) in code_lines(&std::fs::read_to_string(f).unwrap()) {
            assert!(
                !line.contains("device_buffer("),
                "{rel}:{n}: pool buffer taken outside the gate: {}",
                line.trim()
            );
        }
    }
}
