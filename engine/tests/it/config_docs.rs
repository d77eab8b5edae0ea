//! The configuration a user writes: every example in `examples/configs/` validates, every key
//! is documented (the emitted TOML of each preset reads back to the preset), and
//! `docs/CONFIG.md` lists exactly the keys the engine knows.

use std::path::Path;
use tierkv_engine::config::{Config, KEY_DOCS};

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

#[test]
fn every_example_config_validates() {
    let dir = repo().join("examples/configs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let c = Config::from_file(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert_eq!(
                Config::from_toml(&c.to_toml()).unwrap(),
                c,
                "{}",
                p.display()
            );
            n += 1;
        }
    }
    assert!(n >= 4, "found the examples in {}", dir.display());
}

#[test]
fn the_documented_toml_of_every_preset_reads_back() {
    for name in Config::PRESETS {
        let c = Config::preset(name).unwrap();
        let text = c.to_documented_toml();
        assert_eq!(Config::from_toml(&text).unwrap(), c, "{name}");
        // Every key line has its comment right above it.
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            if l.contains(" = ") {
                assert!(lines[i - 1].starts_with("# "), "{name}: `{l}` undocumented");
            }
        }
    }
}

#[test]
fn the_config_guide_lists_exactly_the_known_keys() {
    let guide = std::fs::read_to_string(repo().join("docs/CONFIG.md")).unwrap();
    let listed: Vec<&str> = guide
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|k| !k.contains('-') && *k != "sim")
        .collect();
    let known: Vec<&str> = KEY_DOCS.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        listed, known,
        "docs/CONFIG.md's key table and KEY_DOCS differ"
    );
    for (k, doc) in KEY_DOCS {
        assert!(
            guide.contains(doc.trim()),
            "{k}: docs/CONFIG.md has another text"
        );
    }
}

/// The ranges the documentation states are the limits the validation enforces.
#[test]
fn documented_ranges_are_the_enforced_limits() {
    use tierkv_engine::config::limits::*;
    let doc = |key: &str| {
        KEY_DOCS
            .iter()
            .find(|(k, _)| *k == key)
            .unwrap_or_else(|| panic!("{key} is documented"))
            .1
    };
    let stated = [
        ("model.layers", format!("1..={LAYERS_MAX}")),
        ("model.layer_base", format!("0..={LAYER_BASE_MAX}")),
        (
            "model.context_tokens_max",
            format!("1..={CONTEXT_TOKENS_MAX}"),
        ),
        ("cache.load_slots", format!("1..={LOAD_SLOTS_MAX}")),
        (
            "scheduler.queued_requests_max",
            format!("1..={QUEUED_REQUESTS_MAX}"),
        ),
        (
            "scheduler.pending_tokens_max",
            format!("1..=2^{}", PENDING_TOKENS_MAX.trailing_zeros()),
        ),
        (
            "scheduler.prefill_tokens_per_step_max",
            format!("1..={PREFILL_TOKENS_PER_STEP_MAX}"),
        ),
        (
            "scheduler.running_requests_max",
            format!("1..={RUNNING_REQUESTS_MAX}"),
        ),
        (
            "cache.device_pages",
            format!("{} TiB", DEVICE_BYTES_MAX >> 40),
        ),
        ("cache.host_tokens", format!("{} TiB", HOST_BYTES_MAX >> 40)),
    ];
    for (key, range) in stated {
        assert!(
            doc(key).contains(&range),
            "the documentation of {key} does not state {range}: {}",
            doc(key)
        );
    }
    assert!(PENDING_TOKENS_MAX.is_power_of_two());
}
