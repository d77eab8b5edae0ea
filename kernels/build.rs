//! Tells the tests whether NVRTC is on this machine, so that the test that compiles every CUDA
//! source is reported as ignored, with its reason, where NVRTC is missing (instead of passing
//! without compiling anything). Under `TIERKV_REQUIRE_NVRTC=1` (CI) the test always runs, and
//! fails if NVRTC cannot be loaded.

use std::path::PathBuf;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(tierkv_nvrtc)");
    for var in ["LD_LIBRARY_PATH", "CUDA_HOME", "TIERKV_REQUIRE_NVRTC"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let required = std::env::var("TIERKV_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if required || nvrtc_present() {
        println!("cargo::rustc-cfg=tierkv_nvrtc");
    }
}

/// Whether a `libnvrtc.so*` lies where the dynamic loader will look for it.
fn nvrtc_present() -> bool {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(h).join("lib64"));
    }
    dirs.extend(
        [
            "/usr/local/cuda/lib64",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
        ]
        .map(PathBuf::from),
    );
    dirs.iter().any(|d| {
        std::fs::read_dir(d).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("libnvrtc.so"))
        })
    })
}
