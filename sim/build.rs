//! The build id of a campaign's results: a hash of every source that decides what a seed
//! computes (the engine, kernel and simulator crates, the embedded trace excerpt, the manifests
//! and the lock file), exported as `TIERKV_SOURCE_ID`. Two binaries built from the same sources
//! on different machines (the shards of a cluster campaign) share it; any change of a source
//! changes it, so `tierkv campaign merge` refuses to combine their results. The build's features
//! and profile are added at run time (`shard::build_id`).

use std::path::{Path, PathBuf};

/// What decides a seed's outcome, relative to the workspace root.
const SOURCES: &[&str] = &[
    "Cargo.toml",
    "Cargo.lock",
    "engine/Cargo.toml",
    "engine/src",
    "kernels/Cargo.toml",
    "kernels/build.rs",
    "kernels/src",
    "kernels/cuda",
    "sim/Cargo.toml",
    "sim/build.rs",
    "sim/src",
    "data/mooncake",
];

/// FNV-1a, 64 bits: stable across toolchains, unlike `std`'s hasher.
struct Fnv(u64);

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

fn files(at: &Path, out: &mut Vec<PathBuf>) {
    if at.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(at)
            .unwrap_or_else(|e| panic!("build id: cannot list {}: {e}", at.display()))
            .map(|e| e.expect("build id: a directory entry").path())
            .collect();
        entries.sort();
        for e in entries {
            files(&e, out);
        }
    } else if at.is_file() {
        out.push(at.to_path_buf());
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the simulator crate lies in the workspace")
        .to_path_buf();
    // Two hashes of different offsets: 128 bits, so that distinct sources never share an id.
    let mut a = Fnv(0xcbf2_9ce4_8422_2325);
    let mut b = Fnv(0x6c62_272e_07bb_0142);
    for source in SOURCES {
        let at = root.join(source);
        if at.exists() {
            println!("cargo::rerun-if-changed={}", at.display());
        }
        let mut found = Vec::new();
        files(&at, &mut found);
        for f in found {
            let name = f.strip_prefix(&root).expect("under the root");
            let text = std::fs::read(&f)
                .unwrap_or_else(|e| panic!("build id: cannot read {}: {e}", f.display()));
            for h in [&mut a, &mut b] {
                h.write(name.to_string_lossy().as_bytes());
                h.write(&[0]);
                h.write(&(text.len() as u64).to_le_bytes());
                h.write(&text);
            }
        }
    }
    println!("cargo::rustc-env=TIERKV_SOURCE_ID={:016x}{:016x}", a.0, b.0);
}
