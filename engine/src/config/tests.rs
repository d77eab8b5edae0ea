use super::*;
use proptest::prelude::*;

#[test]
fn presets_validate_and_round_trip_through_toml() {
    for name in Config::PRESETS {
        let c = Config::preset(name).unwrap();
        let back = Config::from_toml(&c.to_toml()).unwrap();
        assert_eq!(back, c, "{name}");
    }
}

#[test]
fn preset_layouts_match_the_design() {
    let v32 = Config::preset("deepseek-v3.2").unwrap().layout().unwrap();
    assert_eq!(v32.token_bytes(crate::layout::BufferKind::IndexK).0, 132);
    assert_eq!(v32.page_bytes(crate::layout::BufferKind::IndexK).0, 8448);
    assert_eq!(v32.token_bytes(crate::layout::BufferKind::Kv).0, 656);
    let v4 = Config::preset("deepseek-v4-flash-bf16").unwrap();
    assert_eq!(v4.model.index_topk, 512);
    let l = v4.layout().unwrap();
    assert_eq!(l.token_bytes(crate::layout::BufferKind::IndexK).0, 256);
    assert_eq!(l.page_bytes(crate::layout::BufferKind::IndexK).0, 16384);
}

/// The presets carry the published model values: DeepSeek-V3.2-Exp's
/// `inference/config_671B_v3.2.json` (61 layers, 64 indexer heads of 128, top-2048, scale_fmt
/// ue8m0) and `inference/model.py`'s RoPE defaults (theta 10000, YaRN factor 40 over 4096 tokens,
/// beta_fast 32, beta_slow 1), YaRN on at its 128K context.
#[test]
fn presets_carry_the_published_model_values() {
    let c = Config::preset("deepseek-v3.2").unwrap();
    let m = &c.model;
    assert_eq!((m.layers, m.index_n_heads, m.index_head_dim), (61, 64, 128));
    assert_eq!(
        (m.index_topk, m.qk_rope_head_dim, m.kv_lora_rank),
        (2048, 64, 512)
    );
    assert_eq!(m.scale_fmt, ScaleFmt::Ue8m0);
    assert_eq!(
        c.rope(),
        tierkv_kernels::rope::RopeParams::deepseek_v32(131_072)
    );
    assert!(c.rope().yarn());
    assert!(c.unconfirmed("deepseek-v3.2").is_empty());
    // sim-small has YaRN by the servers' rule, and plain RoPE by the reference's (its context
    // is within the original 4096 tokens).
    let mut small = Config::preset("sim-small").unwrap();
    assert!(small.rope().yarn());
    small.model.rope_yarn = YarnRule::ContextAboveOriginal;
    assert!(!small.rope().yarn());
    let text = "preset = \"sim-small\"\n[model]\nrope_yarn = \"context_above_original\"\n";
    assert_eq!(Config::from_toml(text).unwrap(), small);
    // Every preset says where its values come from.
    for name in Config::PRESETS {
        assert!(Config::preset_source(name).is_some(), "{name}");
    }
}

/// What public material does not confirm, the preset says (and `check-config` prints); a file
/// that overrides a value no longer carries its note.
#[test]
fn unconfirmed_preset_values_are_listed_until_overridden() {
    let v4 = Config::preset("deepseek-v4-flash-bf16").unwrap();
    let keys: Vec<&str> = v4
        .unconfirmed("deepseek-v4-flash-bf16")
        .iter()
        .map(|u| u.0)
        .collect();
    for key in [
        "model.layers",
        "model.index_topk",
        "model.rope_factor",
        "model.scale_fmt",
    ] {
        assert!(keys.contains(&key), "{key} in {keys:?}");
    }
    let text = "preset = \"deepseek-v4-flash-bf16\"\n[model]\nlayers = 8\n";
    let c = Config::from_toml(text).unwrap();
    let notes = c.unconfirmed("deepseek-v4-flash-bf16");
    assert!(notes.iter().all(|u| u.0 != "model.layers"), "{notes:?}");
    assert_eq!(notes.len(), keys.len() - 1);
}

/// A configuration written before the RoPE and scale-format keys existed reads with
/// DeepSeek-V3.2's RoPE and fp32 scales.
#[test]
fn rope_and_scale_keys_default_to_deepseek_v32() {
    let mut text = Config::preset("sim-small").unwrap().to_toml();
    text = text
        .lines()
        .filter(|l| !l.starts_with("rope_") && !l.starts_with("scale_fmt"))
        .map(|l| format!("{l}\n"))
        .collect();
    let c = Config::from_toml(&text).unwrap();
    let m = &c.model;
    assert_eq!(m.scale_fmt, ScaleFmt::Fp32);
    let v32 = tierkv_kernels::rope::RopeParams::deepseek_v32(m.context_tokens_max);
    assert_eq!(c.rope(), v32);
    let json = r#"{"preset": "sim-small", "model": {"rope_beta_fast": 16, "rope_theta": 50000}}"#;
    let c = Config::from_json(json).unwrap();
    assert_eq!(
        (c.model.rope_beta_fast, c.model.rope_theta),
        (16.0, 50000.0)
    );
}

fn err_field(text: &str) -> String {
    match Config::from_toml(text) {
        Ok(_) => panic!("accepted: {text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn invalid_inputs_name_their_field() {
    let cases = [
        (
            "preset = \"sim-small\"\n[model]\nindex_topk = 0",
            "model.index_topk",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_topk = 4096",
            "model.index_topk",
        ),
        (
            "preset = \"sim-small\"\n[model]\npage_size = 32",
            "model.page_size",
        ),
        (
            "preset = \"sim-small\"\n[model]\npage_size = 0",
            "model.page_size",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_head_dim = 100",
            "model.index_head_dim",
        ),
        (
            "preset = \"sim-small\"\n[model]\nlayers = 0",
            "model.layers",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_n_heads = 0",
            "model.index_n_heads",
        ),
        (
            "preset = \"sim-small\"\n[model]\nkv_dtype = \"fp4\"",
            "model.kv_dtype",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_k_dtype = 7",
            "model.index_k_dtype",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_layout = \"diagonal\"",
            "cache.host_layout",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nwrite_policy = \"sometimes\"",
            "cache.write_policy",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_ratio = 1.0",
            "cache.host_ratio",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_tokens = 64",
            "cache.host_tokens",
        ),
        (
            "preset = \"sim-small\"\n[cache]\ndevice_pages = -3",
            "cache.device_pages",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_ratio = 2.0\nhost_tokens = 99999",
            "cache.host_tokens",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_topK = 5",
            "model.index_topK",
        ),
        (
            "preset = \"sim-small\"\n[scheduler]\nqueued_requests_max = 0",
            "scheduler.queued_requests_max",
        ),
        ("[model]\nlayers = 3", "model.index_n_heads"),
        (
            "preset = \"sim-small\"\n[model]\nscale_fmt = true",
            "model.scale_fmt",
        ),
        (
            "preset = \"sim-small\"\n[model]\nscale_fmt = \"e8m0\"",
            "model.scale_fmt",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_k_ue8m0 = true",
            "model.index_k_ue8m0",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_k_ue8m0 = true",
            "renamed: write model.scale_fmt = \"ue8m0\" (it now",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_k_ue8m0 = false",
            "renamed: write model.scale_fmt = \"fp32\" (the default)",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_theta = 1.0",
            "model.rope_theta",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_theta = \"big\"",
            "model.rope_theta",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_factor = 0.5",
            "model.rope_factor",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_beta_slow = 0.0",
            "model.rope_beta_slow",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_beta_fast = 1.0",
            "model.rope_beta_fast",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_original_seq_len = 0",
            "model.rope_original_seq_len",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_original_seq_len = 2000000",
            "model.rope_original_seq_len",
        ),
        ("preset = \"gpt-2\"", "gpt-2"),
        ("preset = \"sim-small\"\n[model\n", "TOML"),
        (
            "preset = \"deepseek-v3.2\"\n[cache]\ndevice_pages = 4294967295\nhost_ratio = 1.5",
            "cache.",
        ),
    ];
    for (text, field) in cases {
        let msg = err_field(text);
        assert!(
            msg.contains(field),
            "{text:?} gave {msg:?}, which does not name {field}"
        );
    }
}

/// Each bound of the configuration is refused by its own rule, not by a later check that happens
/// to name the same field (the message's rule is compared, not only the field).
#[test]
fn each_bound_is_refused_by_its_own_rule() {
    // 2^32 host pages of 64 tokens, and one page more.
    let host_tokens_over = ((u32::MAX as u64) + 2) * 64;
    let cases = [
        (
            "preset = \"sim-small\"\n[cache]\ndevice_pages = -3".to_string(),
            "must not be negative",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_ratio = 1e8".to_string(),
            "gives more than 2^32 host pages",
        ),
        (
            format!("preset = \"sim-small\"\n[cache]\nhost_tokens = {host_tokens_over}"),
            "gives more than 2^32 host pages",
        ),
        // Far fewer than 2^32 pages, but more pinned memory than the mirror's limit.
        (
            "preset = \"deepseek-v3.2\"\n[cache]\nhost_ratio = 1e5".to_string(),
            "pinned host memory of the mirror",
        ),
        // About 3 MB a page over 61 layers: 400,000 pages pass 1 TiB of device memory, while
        // the host mirror (1% larger) stays within its own limit.
        (
            "preset = \"deepseek-v3.2\"\n[cache]\ndevice_pages = 400000\nhost_ratio = 1.01"
                .to_string(),
            "device memory of the pools and the step scratch",
        ),
        // 2^25 pages of 64 tokens: 2^31 slots, one more than i32 numbers from 0.
        (
            "preset = \"sim-small\"\n[cache]\ndevice_pages = 33554432".to_string(),
            "within i32, the kernels' slot type",
        ),
        // One layer past the limit (a value over a limit, not only one equal to it, is refused).
        (
            format!(
                "preset = \"sim-small\"\n[model]\nlayers = {}",
                limits::LAYERS_MAX + 1
            ),
            "the limit",
        ),
    ];
    for (text, rule) in cases {
        let msg = err_field(&text);
        assert!(msg.contains(rule), "{text:?} gave {msg:?}, not {rule:?}");
    }
    // At a bound is within it; host tokens of 2^21 pages are far from 2^32 pages.
    for text in [
        format!(
            "preset = \"sim-small\"\n[cache]\nload_slots = {}",
            limits::LOAD_SLOTS_MAX
        ),
        format!(
            "preset = \"sim-small\"\n[scheduler]\nqueued_requests_max = {}",
            limits::QUEUED_REQUESTS_MAX
        ),
        "preset = \"sim-small\"\n[cache]\nhost_tokens = 134217728".to_string(),
    ] {
        let within = Config::from_toml(&text);
        assert!(within.is_ok(), "{text:?}: {within:?}");
    }
}

/// The readback buffer is the one part of the step's scratch in pinned host memory; every other
/// scratch buffer is on the device.
#[test]
fn the_footprint_puts_only_the_readback_buffer_on_the_host() {
    for name in Config::PRESETS {
        let c = Config::preset(name).unwrap();
        let topk = c.model.index_topk;
        let (layout, scratch) = (c.layout().unwrap(), c.scratch_layout(topk).unwrap());
        let fp = c.footprint(topk).unwrap();
        let on_device: u64 = ScratchBuffer::ALL
            .iter()
            .filter(|&&b| b != ScratchBuffer::Readback)
            .map(|&b| scratch.bytes(b).0)
            .sum();
        let readback = scratch.bytes(ScratchBuffer::Readback).0;
        assert!(readback > 0 && on_device > 0, "{name}");
        assert_eq!(
            fp.device.0,
            layout.device_total_bytes().0 + on_device,
            "{name}"
        );
        assert_eq!(fp.host.0, layout.host_total_bytes().0 + readback, "{name}");
    }
}

#[test]
fn json_is_accepted_too() {
    let c = Config::from_json(r#"{"preset": "sim-small", "model": {"index_topk": 7}}"#).unwrap();
    assert_eq!(c.model.index_topk, 7);
    let e =
        Config::from_json(r#"{"preset": "sim-small", "model": {"index_topk": 0}}"#).unwrap_err();
    assert!(e.to_string().contains("model.index_topk"));
}

fn arb_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(|n| serde_json::json!(n)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
        (-1e20f64..1e20).prop_map(|f| serde_json::json!(f)),
        prop::sample::select(vec![
            "fp8",
            "bf16",
            "fp8_packed",
            "layer_first",
            "page_first",
            "write_back",
            "write_through",
            "sim-small",
            "deepseek-v3.2",
            "fp32",
            "ue8m0",
            "x"
        ])
        .prop_map(|s| serde_json::json!(s)),
    ];
    leaf.prop_recursive(2, 24, 6, |inner| {
        prop::collection::btree_map(
            prop::sample::select(vec![
                "layers",
                "index_topk",
                "index_n_heads",
                "page_size",
                "index_head_dim",
                "kv_dtype",
                "index_k_dtype",
                "device_pages",
                "host_ratio",
                "host_tokens",
                "host_layout",
                "write_policy",
                "queued_requests_max",
                "context_tokens_max",
                "layer_base",
                "load_slots",
                "scale_fmt",
                "rope_theta",
                "rope_factor",
                "rope_original_seq_len",
                "rope_beta_fast",
                "rope_beta_slow",
            ])
            .prop_map(String::from),
            inner,
            0..6,
        )
        .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary documents never panic: they give a config that validates, or a typed error.
    #[test]
    fn arbitrary_documents_never_panic(model in arb_value(), cache in arb_value(), sched in arb_value(),
                                       preset in prop::option::of(prop::sample::select(Config::PRESETS.to_vec()))) {
        let mut top = serde_json::Map::new();
        if let Some(p) = preset { top.insert("preset".into(), serde_json::json!(p)); }
        top.insert("model".into(), model);
        top.insert("cache".into(), cache);
        top.insert("scheduler".into(), sched);
        if let Ok(c) = Config::from_value(&serde_json::Value::Object(top)) {
            prop_assert!(c.validate().is_ok());
        }
    }

    /// For every valid configuration the layout's parts add up to its wholes, and host and device
    /// pages are byte-identical.
    #[test]
    fn layout_parts_add_up(layers in 1u32..100, heads in 1u32..=64, topk in 1u32..=2048,
                           fp8_ik in any::<bool>(), fp8_kv in any::<bool>(), page_first in any::<bool>(),
                           device_pages in 1u32..100_000, ratio in 1.01f64..8.0) {
        use crate::layout::*;
        let mut c = Config::preset("sim-small").unwrap();
        c.model.layers = layers;
        c.model.index_n_heads = heads;
        c.model.index_topk = topk;
        c.model.index_k_dtype = if fp8_ik { IndexKDtype::Fp8 } else { IndexKDtype::Bf16 };
        c.model.kv_dtype = if fp8_kv { KvDtype::Fp8Packed } else { KvDtype::Bf16 };
        c.cache.host_layout = if page_first { HostLayout::PageFirst } else { HostLayout::LayerFirst };
        c.cache.device_pages = device_pages;
        c.model.context_tokens_max = 64.min(device_pages * 64);
        c.scheduler.output_tokens_max = 1;
        c.cache.host = HostCapacity::Ratio(ratio);
        if c.validate().is_err() { return Ok(()); }
        let l = c.layout().unwrap();
        let ik = l.page_bytes(BufferKind::IndexK).0;
        prop_assert_eq!(ik, if fp8_ik { 64 * 132 } else { 64 * 256 });
        for kind in BufferKind::ALL {
            prop_assert_eq!(l.page_bytes(kind).0, 64 * l.token_bytes(kind).0);
            prop_assert_eq!(l.device_layer_bytes(kind).0, device_pages as u64 * l.page_bytes(kind).0);
            prop_assert_eq!(l.device_bytes(kind).0, layers as u64 * l.device_layer_bytes(kind).0);
            prop_assert_eq!(l.host_bytes(kind).0, layers as u64 * l.host_pages() as u64 * l.page_bytes(kind).0);
            // Host and device pages are byte-identical: same fingerprint, same page bytes.
            let hv = l.host_layer_view(kind, LayerId(layers - 1));
            let dv = l.device_layer_view(kind);
            prop_assert_eq!(hv.fingerprint, dv.fingerprint);
            prop_assert!(hv.required_bytes() <= l.host_bytes(kind).0);
            prop_assert_eq!(dv.required_bytes(), l.device_layer_bytes(kind).0);
        }
        prop_assert_eq!(l.device_total_bytes().0, l.device_bytes(BufferKind::Kv).0 + l.device_bytes(BufferKind::IndexK).0);
        prop_assert!(l.host_tokens().0 > l.device_tokens().0);
    }
}

/// A host tier that rounds down to no more whole pages than the device tier is refused, by the
/// field that gave it (proptest's `layout_parts_add_up` found device_pages = 1, ratio = 1.01).
#[test]
fn a_host_tier_of_no_more_pages_than_the_device_is_refused() {
    for (host, field) in [
        (HostCapacity::Ratio(1.01), "cache.host_ratio"),
        (HostCapacity::Tokens(65), "cache.host_tokens"),
    ] {
        let mut c = Config::preset("sim-small").unwrap();
        c.cache.device_pages = 1;
        c.model.context_tokens_max = 64;
        c.scheduler.output_tokens_max = 1;
        c.cache.host = host;
        let e = c.validate().expect_err("one host page for one device page");
        assert!(e.to_string().contains(field), "{e}");
    }
}

/// The documentation's lines break at spaces, at most `width` characters each, and a line one
/// character too long for the next word breaks there.
#[test]
fn wrap_breaks_lines_at_the_width() {
    assert_eq!(wrap("aaa bbb ccc", 7), ["aaa bbb", "ccc"]);
    assert_eq!(wrap("aaa bbbb", 7), ["aaa", "bbbb"]);
    assert_eq!(
        wrap("aaaaaaaaa b", 7),
        ["aaaaaaaaa", "b"],
        "a long word keeps its line"
    );
    assert_eq!(wrap("", 7), [""]);
}

/// A value of the wrong type is named in the refusal by what it is.
#[test]
fn a_wrong_type_names_what_was_found() {
    for (text, found) in [
        ("preset = 3", "the number 3"),
        ("preset = true", "the boolean true"),
        ("preset = [1]", "an array"),
        ("preset = { a = 1 }", "a table"),
    ] {
        let e = Config::from_toml(text).expect_err(text).to_string();
        assert!(e.contains(&format!("found {found}")), "{text}: {e}");
    }
    let json: Value = serde_json::from_str(r#"{"preset": null}"#).expect("JSON");
    let e = Config::from_value(&json).expect_err("null").to_string();
    assert!(e.contains("found null"), "{e}");
    let json: Value = serde_json::from_str(r#""sim-small""#).expect("JSON");
    let e = Config::from_value(&json).expect_err("a string").to_string();
    assert!(e.contains(r#"found the string "sim-small""#), "{e}");
}

/// `ScaleFmt::ue8m0`, the flag the kernels take to round their scales up to powers of two,
/// holds for the ue8m0 format only.
#[test]
fn the_ue8m0_flag_is_the_ue8m0_formats_alone() {
    assert!(ScaleFmt::Ue8m0.ue8m0());
    assert!(!ScaleFmt::Fp32.ue8m0());
}

/// An original RoPE length at the context limit is a length the limit allows; one past it is
/// refused, naming the key.
#[test]
fn a_rope_original_length_at_the_context_limit_is_accepted() {
    let mut c = Config::preset("sim-small").unwrap();
    c.model.rope_original_seq_len = limits::CONTEXT_TOKENS_MAX;
    c.validate().expect("the limit itself");
    c.model.rope_original_seq_len = limits::CONTEXT_TOKENS_MAX + 1;
    let e = c.validate().expect_err("past the limit").to_string();
    assert!(e.contains("model.rope_original_seq_len"), "{e}");
}

/// A host footprint (the mirror and the readback buffer) of exactly `HOST_BYTES_MAX` is
/// accepted, and one page more is refused by that limit. The footprint lands on the limit
/// exactly for some running-batch size: the search finds one from the footprints of one and two
/// host pages, not from the layout's formulas.
#[test]
fn a_host_footprint_of_exactly_the_limit_is_accepted() {
    let mut cfg = Config::preset("sim-small").unwrap();
    cfg.model.prefill_indexer = PrefillIndexer::LastToken;
    cfg.model.index_k_dtype = IndexKDtype::Bf16;
    cfg.model.kv_dtype = KvDtype::Bf16;
    let host = |cfg: &Config, pages: u64| {
        let mut c = cfg.clone();
        c.cache.host = HostCapacity::Tokens(pages * PAGE_TOKENS as u64);
        c.footprint(c.model.index_topk).unwrap().host.0
    };
    let page = host(&cfg, 2) - host(&cfg, 1);
    let found = (1..=4096).find_map(|rows| {
        cfg.scheduler.running_requests_max = rows;
        let fixed = host(&cfg, 1) - page;
        let left = limits::HOST_BYTES_MAX - fixed;
        (left % page == 0).then_some(left / page)
    });
    let pages = found.expect("a running-batch size whose footprint lands on the limit");
    cfg.cache.host = HostCapacity::Tokens(pages * PAGE_TOKENS as u64);
    assert_eq!(
        cfg.footprint(cfg.model.index_topk).unwrap().host.0,
        limits::HOST_BYTES_MAX
    );
    cfg.validate().expect("exactly the limit");
    cfg.cache.host = HostCapacity::Tokens((pages + 1) * PAGE_TOKENS as u64);
    match cfg.validate() {
        Err(ConfigError::TooLarge { field, .. }) => assert_eq!(field, "cache.host_tokens"),
        r => panic!("one page past the limit: {r:?}"),
    }
}

/// `nan` and `inf` (TOML reads both as floats) are refused as not finite, named by their field,
/// in a section and in a nested array alike — not left to a range rule that would name another
/// fault or none (a `nan` passes every `<` check).
#[test]
fn non_finite_numbers_are_refused_by_their_own_rule() {
    for (text, field, value) in [
        (
            "preset = \"sim-small\"\n[model]\nrope_theta = nan",
            "model.rope_theta",
            "NaN",
        ),
        (
            "preset = \"sim-small\"\n[model]\nrope_factor = inf",
            "model.rope_factor",
            "inf",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_ratio = -inf",
            "cache.host_ratio",
            "-inf",
        ),
    ] {
        match Config::from_toml(text) {
            Err(ConfigError::NotFinite { field: f, value: v }) => {
                assert_eq!((f.as_str(), v.as_str()), (field, value), "{text}")
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}

/// Each key of the documented TOML has its own entry of `KEY_DOCS` right above it, word for
/// word (wrapped), not another key's.
#[test]
fn the_documented_toml_puts_each_keys_own_text_above_it() {
    let text = Config::preset("sim-small").unwrap().to_documented_toml();
    let lines: Vec<&str> = text.lines().collect();
    let mut section = String::new();
    let mut keys = 0;
    for (i, line) in lines.iter().enumerate() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = format!("{name}.");
        }
        let Some((key, _)) = line.split_once(" = ") else {
            continue;
        };
        let path = format!("{section}{key}");
        let doc = KEY_DOCS.iter().find(|(k, _)| *k == path).map(|(_, d)| *d);
        let doc = doc.unwrap_or_else(|| panic!("{path} has an entry"));
        let above: Vec<&str> = lines[..i]
            .iter()
            .rev()
            .take_while(|l| l.starts_with("# "))
            .map(|l| &l[2..])
            .collect();
        let above: Vec<&str> = above.into_iter().rev().collect();
        assert_eq!(
            above.join(" ").split_whitespace().collect::<Vec<_>>(),
            doc.split_whitespace().collect::<Vec<_>>(),
            "{path}"
        );
        keys += 1;
    }
    assert!(keys >= 20, "{keys} keys in the documented TOML");
}

/// The fuzz body reads its input as TOML after an even first byte and as JSON after an odd one.
#[test]
fn the_fuzz_body_picks_the_format_by_its_first_byte() {
    let toml = "preset = \"sim-small\"";
    let json = "{\"preset\": \"sim-small\"}";
    let input = |first: u8, text: &str| [&[first], text.as_bytes()].concat();
    assert!(fuzz_config(&input(0, toml)));
    assert!(fuzz_config(&input(254, toml)));
    assert!(fuzz_config(&input(1, json)));
    assert!(fuzz_config(&input(255, json)));
    assert!(!fuzz_config(&input(0, json)), "JSON is no TOML");
    assert!(!fuzz_config(&input(1, toml)), "TOML is no JSON");
    assert!(!fuzz_config(&[]));
}

/// A syntax error's message is the parser's, each line cut to 160 characters and marked: a
/// line of 300 characters is not echoed whole.
#[test]
fn a_syntax_errors_lines_are_clipped() {
    let long = format!(
        "preset = \"sim-small\"\n[model\nlayers = \"{}",
        "x".repeat(300)
    );
    for (text, format) in [
        (long.clone(), "TOML"),
        (format!("{{\"preset\": \"{}", "y".repeat(300)), "JSON"),
    ] {
        let parsed = match format {
            "TOML" => Config::from_toml(&text),
            _ => Config::from_json(&text),
        };
        match parsed {
            Err(ConfigError::Syntax { format: f, message }) => {
                assert_eq!(f, format);
                assert!(!message.is_empty());
                assert!(
                    message.lines().all(|l| l.chars().count() <= 161),
                    "{message}"
                );
            }
            other => panic!("{format}: {other:?}"),
        }
    }
    // The TOML parser echoes the offending line: cut, with the mark.
    match Config::from_toml(&format!("[{}", "z".repeat(300))) {
        Err(ConfigError::Syntax { message, .. }) => {
            assert!(message.contains("zzzz…"), "{message}");
            assert!(message.contains("unclosed table"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_footprint_totals_its_device_and_host_bytes() {
    let f = Footprint {
        device: Bytes(3 << 30),
        host: Bytes(5 << 20),
    };
    assert_eq!(f.total(), Bytes((3 << 30) + (5 << 20)));
    let huge = Footprint {
        device: Bytes(u64::MAX - 1),
        host: Bytes(2),
    };
    assert_eq!(huge.total(), Bytes(u64::MAX), "saturates");
}

/// A refusal names the first rule the value breaks, not a later check that happens to refuse
/// it too (the index head's block rule comes before its 128 rule; the host ratio's own rule
/// before the page count it gives).
#[test]
fn a_refusal_names_the_first_rule_its_value_breaks() {
    for (text, field, rule) in [
        (
            "preset = \"sim-small\"\n[model]\nindex_head_dim = 100",
            "model.index_head_dim",
            "must be a non-zero multiple of the 128-value quantization block",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_head_dim = 0",
            "model.index_head_dim",
            "must be a non-zero multiple of the 128-value quantization block",
        ),
        (
            "preset = \"sim-small\"\n[model]\nindex_head_dim = 256",
            "model.index_head_dim",
            "must be 128: the Hadamard transform",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_ratio = 1.0",
            "cache.host_ratio",
            "must be a finite number above 1",
        ),
        (
            "preset = \"sim-small\"\n[cache]\nhost_ratio = 0.5",
            "cache.host_ratio",
            "must be a finite number above 1",
        ),
    ] {
        match Config::from_toml(text) {
            Err(ConfigError::Invalid {
                field: f, rule: r, ..
            }) => {
                assert_eq!(f, field, "{text}");
                assert!(r.starts_with(rule), "{text}: {r}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}

/// The device tier's limit is inclusive: a configuration whose pools and scratch come to
/// exactly `limits::DEVICE_BYTES_MAX` is accepted, one page more is refused. (One layer of the
/// DeepSeek preset: 101,794,304 B of scratch and 50,432 B a page, so 21,799,846 pages are
/// 2^40 B exactly.)
#[test]
fn a_device_tier_of_exactly_the_limit_is_accepted() {
    let text = |pages: u32| {
        format!(
            "preset = \"deepseek-v3.2\"\n[model]\nlayers = 1\n[cache]\ndevice_pages = {pages}\nhost_ratio = 1.5"
        )
    };
    let at = Config::from_toml(&text(21_799_846)).expect("exactly the limit");
    let fp = at.footprint(at.model.index_topk).expect("a footprint");
    assert_eq!(fp.device.0, limits::DEVICE_BYTES_MAX);
    match Config::from_toml(&text(21_799_847)) {
        Err(ConfigError::TooLarge { field, .. }) => assert_eq!(field, "cache.device_pages"),
        other => panic!("one page over the limit: {other:?}"),
    }
}

/// A host tier of exactly 2^32 − 1 pages has a page count the engine can hold, so its refusal
/// is the mirror's size; one page more is refused for its count.
#[test]
fn a_host_tier_of_the_most_pages_is_refused_for_its_bytes_not_its_count() {
    let text = |t: u64| format!("preset = \"sim-small\"\n[cache]\nhost_tokens = {t}");
    let most = u32::MAX as u64 * 64;
    for t in [most, most + 63] {
        match Config::from_toml(&text(t)) {
            Err(ConfigError::TooLarge { field, why, .. }) => {
                assert_eq!(
                    (field, why),
                    ("cache.host_tokens", "pinned host memory of the mirror")
                )
            }
            other => panic!("{t}: {other:?}"),
        }
    }
    match Config::from_toml(&text(most + 64)) {
        Err(ConfigError::Invalid { field, rule, .. }) => {
            assert_eq!(
                (field, rule.as_str()),
                ("cache.host_tokens", "gives more than 2^32 host pages")
            )
        }
        other => panic!("{other:?}"),
    }
}

/// A configuration prints as its TOML.
#[test]
fn a_config_displays_as_its_toml() {
    let c = Config::from_toml("preset = \"sim-small\"").unwrap();
    assert_eq!(c.to_string(), c.to_toml());
    assert_eq!(Config::from_toml(&c.to_string()).unwrap(), c);
}

/// A `nan` or `inf` inside an array is named by its place, before the field's type is judged.
#[test]
fn a_non_finite_number_in_an_array_is_named_by_its_index() {
    match Config::from_toml("preset = \"sim-small\"\n[model]\nlayers = [1.0, nan]") {
        Err(ConfigError::NotFinite { field, value }) => {
            assert_eq!((field.as_str(), value.as_str()), ("model.layers[1]", "NaN"))
        }
        other => panic!("{other:?}"),
    }
}
