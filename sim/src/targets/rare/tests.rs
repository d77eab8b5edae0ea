use super::*;

/// A campaign of 100 runs: (name, seeds that reached it).
fn table(entries: &[(&'static str, u64)]) -> Table {
    entries.iter().map(|&(n, s)| (n, (s * 3, s))).collect()
}

fn why_of<'a>(rare: &'a [Rare], name: &str) -> Option<&'a Why> {
    rare.iter().find(|r| r.name == name).map(|r| &r.why)
}

#[test]
fn each_rare_target_gets_the_reason_its_kind_gives_and_common_ones_are_not_listed() {
    let w = Watermark::ALL[0];
    let probes = table(&[
        ("abort.running", 50),
        ("step.waited_for_load", 2),
        ("driver.refused_alloc", 4),
        ("factor.ik=fp8", 50),
        ("factor.ik=bf16", 50),
        ("factor.kv=bf16", 50),
        ("factor.kv=fp8", 50),
        // 50% × 4% = 2% if independent: rare by construction.
        ("combo.ik=fp8+fault=driver.refused_alloc", 2),
        // 50% × 50% = 25% if independent, met in 1%: no reason.
        ("combo.ik=fp8+kv=bf16", 1),
        ("combo.ik=bf16+kv=fp8", 30),
        (w.level_name(0), 80),
        (w.level_name(1), 3),
        ("hb.scratch_stream_ordered.topk@compute:r>copy@load:w", 1),
        ("hb.device_kv.copy@load:w>copy@write:r", 1),
    ]);
    let names = ["abort.running", "step.waited_for_load", "never.hit"];
    let rare = rare(&probes, 100, &names);
    let get = |n: &str| why_of(&rare, n).cloned();
    assert_eq!(get("abort.running"), None, "50% is not rare");
    assert_eq!(get("combo.ik=bf16+kv=fp8"), None);
    assert_eq!(get(w.level_name(0)), None);
    assert!(matches!(get("step.waited_for_load"), Some(Why::Known(_))));
    assert!(matches!(get("factor.kv=fp8_unpacked"), Some(Why::Known(_))));
    assert_eq!(get("never.hit"), Some(Why::Unknown));
    assert_eq!(
        get("combo.ik=fp8+fault=driver.refused_alloc"),
        Some(Why::Independent { a: 50.0, b: 4.0 })
    );
    assert_eq!(get("combo.ik=fp8+kv=bf16"), Some(Why::Unknown));
    // Combinations of drawn values never met are listed too: 0% against 25% or 2%.
    assert_eq!(get("combo.ik=bf16+kv=bf16"), Some(Why::Unknown));
    assert_eq!(
        get("combo.kv=fp8+fault=driver.refused_alloc"),
        Some(Why::Independent { a: 50.0, b: 4.0 })
    );
    assert_eq!(get(w.level_name(1)), Some(Why::Tail { below: 80.0 }));
    assert!(matches!(
        get("hb.scratch_stream_ordered.topk@compute:r>copy@load:w"),
        Some(Why::Known(_))
    ));
    assert!(matches!(
        get("hb.device_kv.copy@load:w>copy@write:r"),
        Some(Why::Known(_))
    ));
    assert_eq!(
        get("hb.device_kv.copy@load:w>copy@load:w"),
        None,
        "a pair never seen has no name"
    );
    // Configuration values no run drew are rare (0%); the levels above the highest reached
    // are not listed.
    assert_eq!(get("factor.layout=page_first"), Some(Why::Unknown));
    assert_eq!(get(w.level_name(2)), None);
    let shares: Vec<f64> = rare.iter().map(|r| r.share).collect();
    assert!(shares.iter().all(|&s| s < 5.0), "{shares:?}");
    let text = report(&rare);
    assert!(text.starts_with(&format!(
        "rare targets (reached in fewer than 5% of the runs): {}: 4 combinations",
        rare.len()
    )));
    assert!(text.contains("  2.00%  combo.ik=fp8+fault=driver.refused_alloc  — two values drawn apart: 50.0% and 4.0%, 2.00% if independent"), "{text}");
    assert!(text.contains("NO REASON KNOWN"));
    assert!(
        text.contains("step.waited_for_load  — reason (2) below"),
        "{text}"
    );
    assert_eq!(
        text.matches("(7) hb.scratch_stream_ordered.*: stream-ordered")
            .count(),
        1
    );
}

#[test]
fn every_known_reason_names_a_target_this_build_can_make() {
    let probe_names = crate::probes::all_names();
    for (pattern, why) in KNOWN {
        assert!(!why.is_empty());
        if let Some(prefix) = pattern.strip_suffix('*') {
            assert!(prefix.starts_with(PAIR_PREFIX), "{pattern}");
            continue;
        }
        assert!(
            probe_names.contains(pattern) || super::super::is_target(pattern, &probe_names),
            "{pattern} is no target of this build"
        );
    }
}
