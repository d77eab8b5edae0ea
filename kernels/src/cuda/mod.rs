//! The CUDA versions of the kernels: their sources (embedded, because the GPU machine runs staged
//! binaries without the source tree), NVRTC compilation for `sm_90`, and — with the `cuda`
//! feature — typed launchers (the `launch` module) that check sizes and fingerprints before any launch.
//!
//! NVRTC is loaded dynamically, so this module builds everywhere and CI (no GPU) can still compile
//! every kernel to PTX; without the `cuda` feature the launch entry points answer
//! [`KernelError::BuiltWithoutCuda`].

use crate::error::{KernelError, Result};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::path::PathBuf;

#[cfg(feature = "cuda")]
pub mod launch;

/// Prepended to every source before compilation.
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One `.cu` file and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub file: &'static str,
    pub text: &'static str,
    pub kernels: &'static [&'static str],
}

/// Every CUDA source of tierkv.
pub const SOURCES: &[Source] = &[
    Source {
        file: "store.cu",
        text: include_str!("../../cuda/store.cu"),
        kernels: &["index_k_store", "kv_store"],
    },
    Source {
        file: "q_prep.cu",
        text: include_str!("../../cuda/q_prep.cu"),
        kernels: &["q_prep"],
    },
    Source {
        file: "logits.cu",
        text: include_str!("../../cuda/logits.cu"),
        kernels: &["index_logits"],
    },
    Source {
        file: "logits_mma.cu",
        text: include_str!("../../cuda/logits_mma.cu"),
        kernels: &["index_logits_mma_fp8", "index_logits_mma_bf16"],
    },
    Source {
        file: "topk.cu",
        text: include_str!("../../cuda/topk.cu"),
        kernels: &["topk_c1", "topk_c2", "topk_c4", "topk_c8"],
    },
    Source {
        file: "sparse_read.cu",
        text: include_str!("../../cuda/sparse_read.cu"),
        kernels: &["sparse_read"],
    },
    Source {
        file: "page_copy.cu",
        text: include_str!("../../cuda/page_copy.cu"),
        kernels: &["page_gather"],
    },
];

/// The tensor-core logits kernel for one page dtype, and its threads per CTA (64 per key group:
/// `logits_mma.cu` explains the shape).
pub fn logits_mma_kernel(dtype: crate::layout::IndexKDtype) -> (&'static str, u32) {
    match dtype {
        crate::layout::IndexKDtype::Fp8 => ("index_logits_mma_fp8", 2 * 64),
        crate::layout::IndexKDtype::Bf16 => ("index_logits_mma_bf16", 4 * 64),
    }
}

/// Positions of a row that one top-k CTA keeps in shared memory (160 KB of keys; with the
/// buckets' 16 KB and the kernel's 34 KB of static shared memory, within sm_90's 227 KB per
/// CTA). A row longer than its cluster can hold is read from global memory on every pass instead.
pub const TOPK_STAGED_MAX: usize = 40_960;

/// Words of dynamic shared memory a top-k CTA holds after its keys: each first-pass bin's start
/// and fill (`topk.cu`: 2 x TOPK_BINS, 11-bit digits).
pub const TOPK_BUCKET_WORDS: usize = 2 * 2048;

/// The top-k kernel of each cluster size (CTAs per row; `topk.cu`).
pub const TOPK_KERNELS: [(u32, &str); 4] = [
    (1, "topk_c1"),
    (2, "topk_c2"),
    (4, "topk_c4"),
    (8, "topk_c8"),
];

/// The cluster size for `rows` top-k rows of at most `len_max` positions on a GPU of `sms`
/// multiprocessors: double it up to 4 while the rows' CTAs would not fill half the
/// multiprocessors, and up to 8 while a row's share would not fit one CTA's shared memory. (Run
/// 25 timed one 64K row at 39 us with 4 CTAs and 45 us with 8: past 4, the cluster's barriers
/// and remote reads cost more than the smaller shares save.)
pub fn topk_cluster(rows: usize, len_max: usize, sms: usize) -> u32 {
    let mut c = 1u32;
    while c < 8
        && ((c < 4 && rows * c as usize * 2 <= sms)
            || len_max.div_ceil(c as usize) > TOPK_STAGED_MAX)
    {
        c *= 2;
    }
    c
}

/// The page list the `page_gather` kernel reads (its `pairs_dev`): every page of `runs` as a
/// (source page, destination page) pair, flattened.
pub fn gather_pairs(runs: &[crate::layout::PageRun]) -> Vec<i32> {
    runs.iter()
        .flat_map(|r| (0..r.count).flat_map(move |j| [(r.src.0 + j) as i32, (r.dst.0 + j) as i32]))
        .collect()
}

/// The target architecture: the H200 (Hopper, compute capability 9.0).
pub const ARCH: &str = "sm_90";

/// Where `cuda_bf16.h` and `cuda_fp8.h` are: `$CUDA_INCLUDE_DIR`, else `$CUDA_HOME/include`, else
/// `/usr/local/cuda/include` if it exists.
pub fn cuda_include_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("CUDA_INCLUDE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        let p = PathBuf::from(h).join("include");
        if p.exists() {
            return Some(p);
        }
    }
    let p = PathBuf::from("/usr/local/cuda/include");
    p.exists().then_some(p)
}

/// Whether the NVRTC library can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library under its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The NVRTC options every kernel is compiled with: exact IEEE division and square root, no
/// flush-to-zero, and no contraction of a multiply and an add into an FMA that the CPU reference
/// would not also perform (DESIGN §4).
pub fn compile_options() -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        arch: Some(ARCH),
        include_paths: cuda_include_dir()
            .map(|p| vec![p.to_string_lossy().into_owned()])
            .unwrap_or_default(),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    }
}

/// The byte sizes and offsets the kernels address, as C macros generated from the layout module
/// (the one place that computes them), so no `.cu` file writes a layout number of its own.
pub fn layout_prelude() -> String {
    use crate::layout::{index_k_page, kv_row, IndexKDtype, KvDtype, PageFormat};
    let ik = |d| PageFormat::IndexK(d);
    let defs: [(&str, u64); 10] = [
        ("TKV_KV_ROW_VALUES", crate::layout::KV_ROW_VALUES as u64),
        ("TKV_IK_FP8_PAGE_BYTES", ik(IndexKDtype::Fp8).page_bytes()),
        ("TKV_IK_BF16_PAGE_BYTES", ik(IndexKDtype::Bf16).page_bytes()),
        // One token's values: the stride of the value rows at the start of a page.
        (
            "TKV_IK_FP8_ROW_BYTES",
            index_k_page::value_offset(IndexKDtype::Fp8, 1, 0) as u64,
        ),
        (
            "TKV_IK_BF16_ROW_BYTES",
            index_k_page::value_offset(IndexKDtype::Bf16, 1, 0) as u64,
        ),
        ("TKV_IK_FP8_SCALES", index_k_page::FP8_SCALES_OFFSET as u64),
        (
            "TKV_KV_BF16_ROW_BYTES",
            PageFormat::Kv(KvDtype::Bf16).token_bytes(),
        ),
        (
            "TKV_KV_FP8_ROW_BYTES",
            PageFormat::Kv(KvDtype::Fp8Packed).token_bytes(),
        ),
        ("TKV_KV_FP8_SCALES", kv_row::FP8_SCALES_OFFSET as u64),
        ("TKV_KV_FP8_ROPE", kv_row::FP8_ROPE_OFFSET as u64),
    ];
    defs.iter()
        .map(|(name, v)| format!("#define {name} {v}\n"))
        .collect()
}

/// The full text NVRTC compiles for `src`.
pub fn full_source(src: &Source) -> String {
    format!(
        "{}{COMMON}\n#line 1 \"{}\"\n{}",
        layout_prelude(),
        src.file,
        src.text
    )
}

/// Compiles one source to PTX.
pub fn compile(src: &Source) -> Result<Ptx> {
    if !nvrtc_available() {
        return Err(KernelError::Compile {
            file: src.file,
            log: "the NVRTC library (libnvrtc.so) was not found on LD_LIBRARY_PATH".into(),
        });
    }
    cudarc::nvrtc::compile_ptx_with_opts(full_source(src), compile_options()).map_err(|e| {
        let log = match &e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => format!("{other:?}"),
        };
        KernelError::Compile {
            file: src.file,
            log,
        }
    })
}

/// Without the `cuda` feature every launch answers this.
pub fn built_without_cuda(op: &'static str) -> KernelError {
    KernelError::BuiltWithoutCuda { op }
}

/// Whether this build can launch kernels on a GPU.
pub const ENABLED: bool = cfg!(feature = "cuda");

#[cfg(test)]
mod tests {
    use super::*;

    /// The `.cu` sources take every layout byte size from [`layout_prelude`]: none writes one
    /// of its own (outside comments).
    #[test]
    fn kernels_write_no_layout_byte_size() {
        let sizes = ["8448", "16384", "8192", "656", "1152", "528", "576", "132"];
        let mut bad = Vec::new();
        for (file, text) in SOURCES
            .iter()
            .map(|s| (s.file, s.text))
            .chain([("common.cuh", COMMON)])
        {
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for tok in code.split(|c: char| !c.is_ascii_alphanumeric() && c != '_') {
                    if sizes.contains(&tok) {
                        bad.push(format!("{file}:{}: {tok}: {}", n + 1, line.trim()));
                    }
                }
            }
        }
        assert!(
            bad.is_empty(),
            "layout sizes written in CUDA sources:\n{}",
            bad.join("\n")
        );
        let prelude = layout_prelude();
        assert!(
            prelude.contains("#define TKV_IK_FP8_PAGE_BYTES 8448\n"),
            "{prelude}"
        );
        assert!(
            prelude.contains("#define TKV_KV_FP8_ROW_BYTES 656\n"),
            "{prelude}"
        );
    }

    /// Two CTAs per row at batch 64, four at batch 1, and enough CTAs to hold a long row in
    /// shared memory.
    #[test]
    fn topk_cluster_fills_the_gpu_and_holds_the_row() {
        assert_eq!(topk_cluster(64, 65_536, 132), 2);
        assert_eq!(topk_cluster(1, 65_536, 132), 4);
        assert_eq!(topk_cluster(16, 4096, 132), 4);
        assert_eq!(topk_cluster(40, 4096, 132), 2);
        assert_eq!(topk_cluster(200, 4096, 132), 1);
        assert_eq!(topk_cluster(200, 65_536, 132), 2);
        assert_eq!(topk_cluster(200, 131_072, 132), 4);
        assert_eq!(topk_cluster(1, 200_000, 132), 8);
        assert_eq!(topk_cluster(200, 10_000_000, 132), 8);
        let src = SOURCES.iter().find(|s| s.file == "topk.cu").unwrap();
        assert!(src.text.contains("#define TOPK_DIGIT 11\n"));
        assert_eq!(TOPK_BUCKET_WORDS, 2 << 11);
        for (c, name) in TOPK_KERNELS {
            assert!(src.kernels.contains(&name), "{name} not loaded");
            assert!(
                src.text.contains(&format!("TOPK_KERNEL({name}, {c})")),
                "{name} is not the kernel of cluster size {c}"
            );
        }
    }

    #[test]
    fn gather_pairs_lists_every_page_of_every_run() {
        use crate::layout::{PageId, PageRun};
        let run = |s, d, count| PageRun {
            src: PageId(s),
            dst: PageId(d),
            count,
        };
        assert_eq!(
            gather_pairs(&[run(3, 7, 2), run(0, 1, 1), run(9, 9, 0)]),
            [3, 7, 4, 8, 0, 1]
        );
    }

    /// The tensor-core logits kernel of each dtype is compiled, defined with its dtype, and
    /// launched with the threads its key groups need (64 per group).
    #[test]
    fn logits_mma_kernels_are_compiled_with_their_shapes() {
        let src = SOURCES.iter().find(|s| s.file == "logits_mma.cu").unwrap();
        for (dt, dtype) in crate::layout::IndexKDtype::ALL.into_iter().enumerate() {
            let (name, threads) = logits_mma_kernel(dtype);
            assert!(src.kernels.contains(&name), "{name} not loaded");
            let def = format!("TKV_LOGITS_MMA({name}, {dt}, ");
            let at = src
                .text
                .find(&def)
                .unwrap_or_else(|| panic!("{name} not defined"));
            let kw: u32 = src.text[at + def.len()..]
                .split(',')
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            assert_eq!(threads, 64 * kw, "{name}");
        }
    }
}
