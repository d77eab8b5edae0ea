//! Every CUDA source compiles to PTX for sm_90 (sm_90a: the wgmma logits kernel) with NVRTC.
//! Where the build found no NVRTC (`kernels/build.rs`) the test is ignored, and `cargo test`
//! says so with the reason; under CI (`TIERKV_REQUIRE_NVRTC=1`, set by `.ci/run`) it always runs
//! and a missing NVRTC is a failure.

use tierkv_kernels::cuda::{compile, nvrtc_available, SOURCES};

/// Whether NVRTC loads; where it does not, the test says it skipped, and fails instead under
/// `TIERKV_REQUIRE_NVRTC=1`.
fn nvrtc_or_skip() -> bool {
    let required = std::env::var("TIERKV_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if !nvrtc_available() {
        assert!(
            !required,
            "TIERKV_REQUIRE_NVRTC=1 but libnvrtc could not be loaded: install \
             nvidia-cuda-nvrtc==13.0.88 and put its lib/ on LD_LIBRARY_PATH (.ci/run does)"
        );
        eprintln!("SKIPPED: NVRTC not found; set TIERKV_REQUIRE_NVRTC=1 to make this a failure");
        return false;
    }
    true
}

#[test]
#[cfg_attr(
    not(tierkv_nvrtc),
    ignore = "NVRTC (libnvrtc.so) was not on LD_LIBRARY_PATH when the tests were built; .ci/run installs it from pip"
)]
fn every_kernel_compiles_to_ptx() {
    if !nvrtc_or_skip() {
        return;
    }
    for src in SOURCES {
        let ptx = compile(src).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        for k in src.kernels {
            assert!(
                text.contains(&format!(".entry {k}(")),
                "{}: PTX has no entry {k}",
                src.file
            );
        }
        assert!(
            text.contains(&format!(".target {}\n", src.arch)),
            "{}: not built for {}",
            src.file,
            src.arch
        );
    }
}

/// Each top-k kernel's static shared memory, as its PTX declares it (every `.shared` variable of
/// the entry, laid out in declared order at its alignment), is within `TOPK_STATIC_SMEM_BYTES`,
/// the number the shared-memory budget of a top-k CTA is checked with. That number follows the
/// Rust limits the kernel's arrays are sized by (a raised limit raises both, and the budget's
/// `const` assertion then judges it); what fails here is a shared array `topk.cu` declares that
/// the formula does not count, beyond its 128 bytes of alignment allowance.
#[test]
#[cfg_attr(
    not(tierkv_nvrtc),
    ignore = "NVRTC (libnvrtc.so) was not on LD_LIBRARY_PATH when the tests were built; .ci/run installs it from pip"
)]
fn topk_static_shared_memory_is_within_its_budget() {
    use tierkv_kernels::cuda::{TOPK_KERNELS, TOPK_STATIC_SMEM_BYTES};
    if !nvrtc_or_skip() {
        return;
    }
    let src = SOURCES
        .iter()
        .find(|s| s.file == "topk.cu")
        .expect("topk.cu");
    let ptx = compile(src).unwrap_or_else(|e| panic!("{e}")).to_src();
    let declared = static_shared_bytes(&ptx);
    for (_, name) in TOPK_KERNELS {
        let bytes = declared
            .iter()
            .find(|(entry, _)| entry == name)
            .unwrap_or_else(|| panic!("PTX has no entry {name}"))
            .1;
        assert!(
            bytes > 0,
            "{name}: no static shared memory found in its PTX"
        );
        assert!(
            bytes <= TOPK_STATIC_SMEM_BYTES,
            "{name} declares {bytes} B of static shared memory, more than TOPK_STATIC_SMEM_BYTES = {TOPK_STATIC_SMEM_BYTES}"
        );
    }
}

/// Each PTX entry's static shared variables, in bytes, laid out in declared order at their
/// alignments: `(entry, bytes)`. Reads the declarations `.shared .align A .TYPE name[N];` (bytes `N` times the
/// type's width) and `.shared .align A .TYPE name;`; `.extern` (dynamic) ones are left out.
fn static_shared_bytes(ptx: &str) -> Vec<(String, usize)> {
    let mut out: Vec<(String, usize)> = Vec::new();
    for line in ptx.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            let name = rest.split('(').next().unwrap_or(rest).to_string();
            out.push((name, 0));
            continue;
        }
        let Some(decl) = line.strip_prefix(".shared ") else {
            continue;
        };
        let words: Vec<&str> = decl.trim_end_matches(';').split_whitespace().collect();
        let (align, ty, var) = match words.as_slice() {
            [".align", a, ty, var] => (a.parse::<usize>().expect("an alignment"), *ty, *var),
            other => panic!("an unexpected shared declaration: {other:?}"),
        };
        let width: usize = ty
            .trim_start_matches(|c: char| c == '.' || c.is_ascii_alphabetic())
            .parse::<usize>()
            .expect("a type width")
            / 8;
        let count = match var.split_once('[') {
            Some((_, n)) => n
                .trim_end_matches(']')
                .parse::<usize>()
                .expect("an array length"),
            None => 1,
        };
        let entry = out
            .last_mut()
            .expect("a shared declaration inside an entry");
        entry.1 = entry.1.next_multiple_of(align) + width * count;
    }
    out
}
