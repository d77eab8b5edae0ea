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
