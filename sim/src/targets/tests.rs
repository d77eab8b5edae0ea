use super::*;

fn config() -> Vec<(&'static str, &'static str)> {
    vec![("ik", "fp8"), ("kv", "bf16"), ("ahead", "off")]
}

#[test]
fn combinations_pair_every_two_factors_and_start_at_the_fault() {
    let mut probes: BTreeMap<&'static str, u64> = [
        ("fault.copy_torn", 3),
        ("driver.refused_launch", 1),
        ("load.issued", 9),
    ]
    .into();
    let mut first: BTreeMap<&'static str, u64> = [
        ("fault.copy_torn", 17),
        ("driver.refused_launch", 40),
        ("load.issued", 2),
    ]
    .into();
    add_combinations(&config(), &mut probes, &mut first);
    let at = |name: &str| (probes.get(name).copied(), first.get(name).copied());
    assert_eq!(at("factor.ik=fp8"), (Some(1), Some(0)));
    // A fault's share is its probe's: no factor name of its own.
    assert_eq!(at("factor.fault=fault.copy_torn"), (None, None));
    assert_eq!(at("combo.ik=fp8+kv=bf16"), (Some(1), Some(0)));
    assert_eq!(
        at("combo.ik=fp8+fault=fault.copy_torn"),
        (Some(1), Some(17))
    );
    assert_eq!(
        at("combo.ahead=off+fault=driver.refused_launch"),
        (Some(1), Some(40))
    );
    // Two faults are one factor's values: no combination of them; no probe but a fault's is one.
    assert!(!probes.keys().any(|n| n.matches("fault=").count() > 1));
    assert!(!probes
        .keys()
        .any(|n| n.contains("load.issued") && *n != "load.issued"));
    // 3 configuration factors and 2 faults: 3 factor names, and 3 + 3·2 = 9 combinations.
    let count = |prefix: &str| probes.keys().filter(|n| n.starts_with(prefix)).count();
    assert_eq!(count(FACTOR_PREFIX), 3);
    assert_eq!(count(COMBO_PREFIX), 9);
}

#[test]
fn target_names_follow_the_grammar() {
    let probes = ["fault.copy_torn", "load.issued"];
    let side = |op, stream, write| Side { op, stream, write };
    let pair = pair_name(
        "device_kv",
        &side("page_copy", "decode load", true),
        &side("sparse_read", "compute", false),
    );
    assert_eq!(
        pair,
        "hb.device_kv.page_copy@decode_load:w>sparse_read@compute:r"
    );
    for good in [
        pair.as_str(),
        "hb.scratch_RoPE_table.host_write@host:w>copy@load:r",
        "factor.policy=write_back",
        "factor.fault=fault.copy_torn",
        "combo.ik=bf16+fault=fault.copy_torn",
        "combo.layout=page_first+ahead=on",
    ] {
        assert!(is_target(good, &probes), "{good}");
        assert!(is_target_name(good), "{good}");
    }
    let long = format!("hb.{}.copy@load:w>copy@load:r", "x".repeat(NAME_BYTES_MAX));
    for bad in [
        "hb.device_kv.mystery@compute:w>sparse_read@compute:r",
        "hb.device_kv.copy@compute:x>sparse_read@compute:r",
        "hb.device kv.copy@compute:w>sparse_read@compute:r",
        "hb.device_kv.copy@compute:w",
        "hb.device_kv.copy@elsewhere:w>sparse_read@compute:r",
        "hb.made_up_class.copy@load:w>sparse_read@compute:r",
        "factor.policy=write_sideways",
        "factor.fault=load.issued",
        "factor.fault=fault.never_heard_of",
        "combo.ik=bf16+ik=fp8",
        "combo.ik=bf16",
        "load.issued",
        long.as_str(),
    ] {
        assert!(!is_target(bad, &probes), "{bad}");
    }
}

#[test]
fn the_table_names_pairs_seen_in_one_order_and_combinations_never_seen() {
    let n = |s: &str| intern(s);
    let probes: BTreeMap<&'static str, (u64, u64)> = [
        (
            n("hb.device_kv.page_copy@load:w>sparse_read@compute:r"),
            (4, 4),
        ),
        (
            n("hb.device_kv.sparse_read@compute:r>page_copy@load:w"),
            (1, 1),
        ),
        (n("hb.mirror_kv.page_copy@write:w>page_copy@load:r"), (2, 2)),
        (n("factor.ik=fp8"), (5, 5)),
        (n("factor.ik=bf16"), (5, 5)),
        (n("factor.ahead=on"), (2, 2)),
        (n("combo.ik=fp8+ahead=on"), (2, 2)),
    ]
    .into();
    let t = summary(&probes, 10) + "\n" + &table(&probes, 10);
    assert!(
        t.contains("2 happens-before pairs of accesses, 1 seen in one order only (1 of them across streams)"),
        "{t}"
    );
    let line = |needle: &str| {
        t.lines()
            .find(|l| l.contains(needle))
            .unwrap_or("")
            .to_string()
    };
    assert!(
        line("mirror_kv").ends_with("one order, across streams"),
        "{t}"
    );
    assert!(!line("device_kv").contains("one order"), "{t}");
    // ik=bf16 with ahead=on: never, where independence gives 10%.
    let never = t
        .lines()
        .find(|l| l.contains("ik=bf16") && l.contains("ahead=on"))
        .unwrap_or("");
    assert!(
        never.contains("0.0%") && never.contains("10.0%") && never.ends_with("never"),
        "{t}"
    );
    // ik=fp8 with ahead=on: 20% seen, 10% if independent.
    let seen = t
        .lines()
        .find(|l| l.contains("ik=fp8") && l.contains("ahead=on"))
        .unwrap_or("");
    assert!(seen.contains("20.0%") && seen.contains("10.0%"), "{t}");
}

#[test]
fn a_side_paired_with_itself_is_not_a_missing_order() {
    let probes: BTreeMap<&'static str, (u64, u64)> = [(
        intern("hb.device_kv.kv_store@compute:w>kv_store@compute:w"),
        (3, 3),
    )]
    .into();
    let t = summary(&probes, 3) + "\n" + &table(&probes, 3);
    assert!(
        t.contains("1 happens-before pairs of accesses, 0 seen in one order only (0 of them across streams)"),
        "{t}"
    );
    assert!(t.lines().any(|l| l.ends_with("(itself)")), "{t}");
}

#[test]
fn watermark_levels_are_targets_and_reported_by_level() {
    let probes = ["load.issued"];
    assert!(is_target("mark.load.ring_held>=2^2", &probes));
    assert!(is_target_name("mark.load.ring_held>=2^2"));
    for bad in [
        "mark.load.ring_held>=3",
        "mark.load.ring_held>=2^-1",
        "mark.load.nothing>=2^2",
        "mark.load.ring_held>=2^24",
    ] {
        assert!(!is_target(bad, &probes), "{bad}");
    }
    let t: BTreeMap<&'static str, (u64, u64)> = [
        (intern("mark.load.ring_held>=2^0"), (9, 4)),
        (intern("mark.load.ring_held>=2^1"), (3, 1)),
    ]
    .into();
    let report = summary(&t, 8) + "\n" + &table(&t, 8);
    assert!(
        report.contains("watermark load.ring_held: >=1 50.0%, >=2 12.5%"),
        "{report}"
    );
    assert!(report.contains("load.ring_held >=2"), "{report}");
    assert!(report.contains("abort.loads_in_flight 0"), "{report}");
}

#[test]
fn a_configurations_factors_name_its_values() {
    let mut cfg = Config::preset("sim-small").expect("preset");
    // sim-small: a bf16 index-K, an fp8 KV, a page-first mirror, write-through.
    assert_eq!(
        config_factors(&cfg, false),
        [
            ("ik", "bf16"),
            ("kv", "fp8"),
            ("layout", "page_first"),
            ("policy", "write_through"),
            ("ahead", "off"),
        ]
    );
    cfg.model.index_k_dtype = IndexKDtype::Fp8;
    cfg.model.kv_dtype = KvDtype::Bf16;
    cfg.cache.host_layout = HostLayout::LayerFirst;
    cfg.cache.write_policy = WritePolicy::WriteBack;
    assert_eq!(
        config_factors(&cfg, true),
        [
            ("ik", "fp8"),
            ("kv", "bf16"),
            ("layout", "layer_first"),
            ("policy", "write_back"),
            ("ahead", "on"),
        ]
    );
}
