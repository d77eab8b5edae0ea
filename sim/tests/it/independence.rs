//! The oracles that judge arithmetic and layout are independent of what they judge: read from
//! their sources, so that a later edit cannot quietly make them share the code under test.

use std::path::Path;

fn source(rel: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Lines of `text` (comments left out) holding any of `needles`.
fn uses(text: &str, needles: &[&str]) -> Vec<String> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .filter(|l| needles.iter().any(|n| l.contains(n)))
        .map(str::to_string)
        .collect()
}

/// The digest and content oracles take nothing from the kernels' CPU references (which the
/// executor runs) and no offset from the layout module (which the engine writes with): their
/// rows, logits, top-k judgement and digests come from the specification.
#[test]
fn the_oracles_share_no_code_with_the_references_or_the_layout() {
    for file in ["sim/src/oracles/digest.rs", "sim/src/oracles/content.rs"] {
        let found = uses(
            &source(file),
            &[
                "tierkv_kernels::cpu",
                "cpu::",
                "index_k_page::",
                "kv_row::",
                "slot_offset",
                "slot_page",
                "PagedView",
                "page_range",
                // The rotation the references apply (`rope::Rope`); its plain settings
                // (`rope::RopeParams`) are the specification's input too.
                "rope::Rope;",
                "rope::Rope,",
                "rope::Rope}",
                "rope::Rope::",
                "Rope::new(",
            ],
        );
        assert!(
            found.is_empty(),
            "{file} uses the code it checks:\n{}",
            found.join("\n")
        );
    }
}

/// The specification owns its byte formats and calls no reference: it may name the ops'
/// argument records (`args::TopK`, ...) and the references' input structs
/// (`cpu::IndexKStoreInputs`, ...), reading their fields, and call nothing of `args` or `cpu`
/// (the records' operand sizes come from the layout module) and nothing of the layout module.
#[test]
fn the_specification_owns_its_layout() {
    let text = source("kernels/src/spec.rs");
    let found = uses(
        &text,
        &[
            "use crate::layout",
            "crate::layout::",
            "index_k_page::",
            "kv_row::",
        ],
    );
    assert!(
        found.is_empty(),
        "spec.rs uses the layout module:\n{}",
        found.join("\n")
    );
    for module in ["cpu::", "args::"] {
        for line in uses(&text, &[module]) {
            let calls_a_function = line
                .split(module)
                .skip(1)
                .any(|rest| rest.starts_with(|c: char| c.is_ascii_lowercase()));
            assert!(!calls_a_function, "spec.rs calls {module}: {line}");
        }
    }
    let reads_sizes = uses(&text, &[".operands(", ".check("]);
    assert!(
        reads_sizes.is_empty(),
        "spec.rs asks a record for its sizes or its check:\n{}",
        reads_sizes.join("\n")
    );
}

/// The oracles that read the engine's prefix keys (conservation, policy) read the weights'
/// version in them with the simulator's own constant, never the engine's; the two must agree,
/// and both must leave every token id below them.
#[test]
fn the_weights_tag_is_the_simulators_own_and_agrees_with_the_engines() {
    use tierkv_sim::oracles::content::WEIGHTS_SHIFT;
    const {
        assert!(WEIGHTS_SHIFT == tierkv_engine::cache::MODEL_TAG_SHIFT);
        assert!(tierkv_engine::synth::VOCAB <= 1 << WEIGHTS_SHIFT);
    }
    for file in [
        "sim/src/oracles/conservation.rs",
        "sim/src/oracles/policy.rs",
        "sim/src/oracles/content.rs",
    ] {
        let found = uses(
            &source(file),
            &["MODEL_TAG_SHIFT", "cache::model_page_keys"],
        );
        assert!(
            found.is_empty(),
            "{file} uses the engine's key tag: {found:?}"
        );
    }
}

/// The schedule imports neither the scenario nor the simulated GPU (issue 30's `gpu → schedule
/// → scenario → gpu` cycle stays broken): the GPU asks it for decisions, a scenario names its
/// policy, and a schedule names its scenario by seed and fingerprint alone.
#[test]
fn the_schedule_imports_neither_the_scenario_nor_the_gpu() {
    let found = uses(
        &source("sim/src/schedule.rs"),
        &[
            "crate::scenario",
            "crate::gpu",
            "crate::driver",
            "crate::runner",
        ],
    );
    assert!(found.is_empty(), "sim/src/schedule.rs: {found:?}");
}
