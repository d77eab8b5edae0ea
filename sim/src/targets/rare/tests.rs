use super::*;

/// The runs of the campaigns below: enough that 2% against 0% is more than chance.
const RUNS: u64 = 10_000;

/// A campaign's probe table from (name, percent of the runs that reached it).
fn table(entries: &[(&'static str, u64)]) -> Table {
    (entries.iter())
        .map(|&(n, pct)| (n, (pct * RUNS / 100 * 3, pct * RUNS / 100)))
        .collect()
}

/// A campaign of [`RUNS`] runs: two dtypes drawn half and half, one fault met in 4% of them
/// (each entry: a name and the percent of the runs that reached it).
fn campaign(more: &[(&'static str, u64)]) -> Table {
    let mut t = vec![
        ("abort.running", 50),
        ("step.waited_for_load", 2),
        ("driver.refused_alloc", 4),
        ("factor.ik=fp8", 50),
        ("factor.ik=bf16", 50),
        ("factor.kv=bf16", 50),
        ("factor.kv=fp8", 50),
        ("combo.ik=bf16+kv=fp8", 30),
    ];
    t.extend_from_slice(more);
    table(&t)
}

fn why_of(probes: &Table, name: &str) -> Option<Why> {
    let names = ["abort.running", "step.waited_for_load", "never.hit"];
    let r = rare(probes, RUNS, &names);
    r.into_iter().find(|r| r.name == name).map(|r| r.why)
}

#[test]
fn common_targets_are_not_listed_and_unexplained_ones_come_first() {
    let probes = campaign(&[]);
    let names = ["abort.running", "step.waited_for_load", "never.hit"];
    let r = rare(&probes, RUNS, &names);
    assert!(r.iter().all(|r| r.share_pct < 5.0), "{r:?}");
    assert_eq!(why_of(&probes, "abort.running"), None, "50% is not rare");
    assert_eq!(why_of(&probes, "combo.ik=bf16+kv=fp8"), None);
    assert_eq!(why_of(&probes, "never.hit"), Some(Why::Unknown));
    // Configuration values no run drew are rare (0%).
    assert_eq!(
        why_of(&probes, "factor.layout=page_first"),
        Some(Why::Unknown)
    );
    let first_known = r.iter().position(|r| r.why != Why::Unknown).expect("some");
    assert!(r[first_known..].iter().all(|r| r.why != Why::Unknown));
}

#[test]
fn a_combination_is_explained_only_near_a_product_under_5_percent() {
    let probes = campaign(&[
        // 50% × 4% = 2% if independent, met in 2%: explained.
        ("combo.ik=fp8+fault=driver.refused_alloc", 2),
        // 50% × 50% = 25% if independent, met in 1%: no reason.
        ("combo.ik=fp8+kv=bf16", 1),
        // Counted under the other order: 3% of 4% × 50%.
        ("combo.fault=driver.refused_alloc+kv=bf16", 3),
    ]);
    let explained = Some(Why::Independent {
        a_pct: 50.0,
        b_pct: 4.0,
    });
    assert_eq!(
        why_of(&probes, "combo.ik=fp8+fault=driver.refused_alloc"),
        explained
    );
    assert_eq!(
        why_of(&probes, "combo.ik=bf16+fault=driver.refused_alloc"),
        Some(Why::Unknown),
        "never met, against 2% if independent"
    );
    assert_eq!(why_of(&probes, "combo.ik=fp8+kv=bf16"), Some(Why::Unknown));
    assert_eq!(why_of(&probes, "combo.ik=bf16+kv=bf16"), Some(Why::Unknown));
    assert_eq!(
        why_of(&probes, "combo.kv=bf16+fault=driver.refused_alloc"),
        Some(Why::Independent {
            a_pct: 50.0,
            b_pct: 4.0
        }),
        "the other order counts"
    );
    let r = rare(&probes, RUNS, &[]);
    let share = |n: &str| r.iter().find(|r| r.name == n).map(|r| r.share_pct);
    assert_eq!(share("combo.kv=bf16+fault=driver.refused_alloc"), Some(3.0));
}

#[test]
fn a_watermark_level_is_explained_by_the_highest_common_level_below_it() {
    let w = Watermark::ALL[0];
    let probes = campaign(&[
        (w.level_name(0), 80),
        (w.level_name(1), 4),
        (w.level_name(2), 1),
    ]);
    let tail = Some(Why::Tail {
        level: w.level_name(0).to_string(),
        level_pct: 80.0,
    });
    assert_eq!(why_of(&probes, w.level_name(0)), None);
    assert_eq!(why_of(&probes, w.level_name(1)), tail);
    assert_eq!(
        why_of(&probes, w.level_name(2)),
        tail,
        "not level 1, itself rare"
    );
    assert_eq!(
        why_of(&probes, w.level_name(3)),
        None,
        "above the highest reached"
    );
    // A watermark whose every level is rare has no reason; one never reached lists level 0.
    let v = Watermark::ALL[1];
    let probes = campaign(&[(v.level_name(0), 3), (v.level_name(1), 1)]);
    assert_eq!(why_of(&probes, v.level_name(1)), Some(Why::Unknown));
    assert_eq!(why_of(&probes, w.level_name(0)), Some(Why::Unknown));
    assert_eq!(why_of(&probes, w.level_name(1)), None);
}

#[test]
fn known_reasons_match_their_targets_only() {
    let across = "hb.scratch_stream_ordered.q_prep@compute:r>copy@load:w";
    let within = "hb.scratch_stream_ordered.topk@compute:r>kv_store@compute:w";
    let pair = "hb.device_kv.copy@load:w>copy@write:r";
    let probes = campaign(&[(across, 1), (within, 1), (pair, 1)]);
    let k = |p: &str| {
        Some(Why::Known(
            KNOWN.iter().position(|k| k.pattern == p).unwrap(),
        ))
    };
    assert_eq!(
        why_of(&probes, "step.waited_for_load"),
        k("step.waited_for_load")
    );
    assert_eq!(
        why_of(&probes, "factor.kv=fp8_unpacked"),
        k("factor.kv=fp8_unpacked")
    );
    assert_eq!(why_of(&probes, across), k("hb.scratch_stream_ordered.*"));
    assert_eq!(
        why_of(&probes, within),
        Some(Why::Unknown),
        "one stream: not the trim"
    );
    assert_eq!(why_of(&probes, pair), k(pair));
}

#[test]
fn the_report_counts_each_kind_and_cites_each_reason_once() {
    let probes = campaign(&[
        ("combo.ik=fp8+fault=driver.refused_alloc", 2),
        ("hb.scratch_stream_ordered.q_prep@compute:r>copy@load:w", 1),
        ("hb.scratch_stream_ordered.topk@compute:r>copy@write:w", 1),
    ]);
    let r = rare(&probes, RUNS, &["step.waited_for_load", "never.hit"]);
    let text = report(&r, RUNS);
    assert!(
        text.starts_with(&format!(
            "rare targets, reached in fewer than 5% of the 10000 runs: {} targets; ",
            r.len()
        )),
        "{text}"
    );
    assert!(text.contains("  2.00%  combo.ik=fp8+fault=driver.refused_alloc  — its values met in 50.0% and 4.0% of the runs: 2.00% if they met independently"), "{text}");
    assert!(
        text.contains("  0.00%  never.hit  — NO REASON KNOWN"),
        "{text}"
    );
    assert!(text.contains("1 that no run can reach"), "{text}");
    // Footnotes are numbered in the order first cited, each printed once.
    assert_eq!(
        text.matches("hb.scratch_stream_ordered.* (across streams): ")
            .count(),
        1
    );
    let cites: Vec<usize> = (1..=3)
        .filter(|n| text.contains(&format!("({n}) ")))
        .collect();
    assert_eq!(cites, vec![1, 2, 3], "{text}");
    assert_eq!(
        report(&[], 0),
        "rare targets: none listed, the campaign ran no runs\n"
    );
}

/// Each reason read from the code names a target this build can make, and every file it cites
/// exists with every function it names in backquotes.
#[test]
fn every_known_reason_names_a_target_and_code_that_exist() {
    let probe_names = crate::probes::all_names();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for k in KNOWN {
        match k.pattern.strip_suffix('*') {
            Some(prefix) => assert!(prefix.starts_with(PAIR_PREFIX), "{}", k.pattern),
            None => assert!(
                probe_names.contains(&k.pattern)
                    || super::super::is_target(k.pattern, &probe_names),
                "{} is no target of this build",
                k.pattern
            ),
        }
        let files: Vec<String> = (k
            .why
            .split(|c: char| c.is_whitespace() || c == '(' || c == ','))
        .map(|w| w.trim_end_matches([':', ';', ')']))
        .filter(|w| w.ends_with(".rs") && w.contains('/'))
        .map(|w| std::fs::read_to_string(root.join(w)).unwrap_or_else(|e| panic!("{w}: {e}")))
        .collect();
        assert!(!files.is_empty(), "{} cites no file", k.pattern);
        for f in k.why.split('`').skip(1).step_by(2) {
            assert!(
                files.iter().any(|text| text.contains(&format!("fn {f}"))),
                "{}: no fn {f} in the files it cites",
                k.pattern
            );
        }
    }
}
