//! The CUDA versions of the kernels: their sources (embedded, because the GPU machine runs staged
//! binaries without the source tree), NVRTC compilation for `sm_90` (`sm_90a` for the one source
//! that uses wgmma), and — with the `cuda`
//! feature — typed launchers (the `launch` module) that check sizes and fingerprints before any launch.
//!
//! NVRTC is loaded dynamically, so this module builds everywhere and CI (no GPU) can still compile
//! every kernel to PTX; without the `cuda` feature `launch` is a stand-in (`absent.rs`) whose
//! entry points (`Kernels::global`, `Kernels::on`) answer [`KernelError::BuiltWithoutCuda`].

use crate::error::{KernelError, Result};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::path::PathBuf;

#[cfg(feature = "cuda")]
pub mod launch;
#[cfg(not(feature = "cuda"))]
#[path = "absent.rs"]
pub mod launch;

/// Which of the synthetic model's inputs `Kernels::draw` draws (`cpu::draw`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrawKind {
    /// Raw index keys, `[rows][128]` bf16.
    IndexKeys,
    /// Raw indexer queries, `[rows][heads][128]` bf16.
    Queries { heads: u32 },
    /// Head weights, `[rows][heads]` f32.
    HeadWeights { heads: u32 },
    /// MLA KV rows, `[rows][576]` bf16.
    KvRows,
}

impl DrawKind {
    /// The bytes `rows` rows of this kind take.
    pub fn bytes(self, rows: u64) -> crate::layout::Bytes {
        match self {
            DrawKind::IndexKeys => {
                crate::layout::bf16_bytes(rows * crate::layout::INDEX_HEAD_DIM as u64)
            }
            DrawKind::Queries { heads } => {
                crate::layout::bf16_bytes(rows * (heads * crate::layout::INDEX_HEAD_DIM) as u64)
            }
            DrawKind::HeadWeights { heads } => crate::layout::f32_bytes(rows * heads as u64),
            DrawKind::KvRows => {
                crate::layout::bf16_bytes(rows * crate::layout::KV_ROW_VALUES as u64)
            }
        }
    }
}

/// Prepended to every source before compilation.
pub const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One `.cu` file and the kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub file: &'static str,
    pub text: &'static str,
    pub kernels: &'static [&'static str],
    /// The NVRTC target: [`ARCH`], or [`ARCH_WGMMA`] for a source that needs the architecture-
    /// specific instructions of Hopper (wgmma).
    pub arch: &'static str,
}

/// Every CUDA source of tierkv.
pub const SOURCES: &[Source] = &[
    Source {
        file: "store.cu",
        text: include_str!("../../cuda/store.cu"),
        kernels: &["index_k_store", "kv_store"],
        arch: ARCH,
    },
    Source {
        file: "q_prep.cu",
        text: include_str!("../../cuda/q_prep.cu"),
        kernels: &["q_prep"],
        arch: ARCH,
    },
    Source {
        file: "logits.cu",
        text: include_str!("../../cuda/logits.cu"),
        kernels: &["index_logits"],
        arch: ARCH,
    },
    Source {
        file: "logits_mma.cu",
        text: include_str!("../../cuda/logits_mma.cu"),
        kernels: &["index_logits_mma_fp8", "index_logits_mma_bf16"],
        arch: ARCH,
    },
    Source {
        file: "logits_wgmma.cu",
        text: include_str!("../../cuda/logits_wgmma.cu"),
        kernels: &["index_logits_wgmma_fp8", "index_logits_wgmma_bf16"],
        arch: ARCH_WGMMA,
    },
    Source {
        file: "topk.cu",
        text: include_str!("../../cuda/topk.cu"),
        kernels: &["topk_c1", "topk_c2", "topk_c4", "topk_c8"],
        arch: ARCH,
    },
    Source {
        file: "sparse_read.cu",
        text: include_str!("../../cuda/sparse_read.cu"),
        kernels: &["sparse_read"],
        arch: ARCH,
    },
    Source {
        file: "page_copy.cu",
        text: include_str!("../../cuda/page_copy.cu"),
        kernels: &["page_gather", "copy_list"],
        arch: ARCH,
    },
    Source {
        file: "guard.cu",
        text: include_str!("../../cuda/guard.cu"),
        kernels: &["guard_slots", "guard_rows", "guard_pairs", "guard_iota"],
        arch: ARCH,
    },
    Source {
        file: "rope.cu",
        text: include_str!("../../cuda/rope.cu"),
        kernels: &["rope_rows"],
        arch: ARCH,
    },
    Source {
        file: "draw.cu",
        text: include_str!("../../cuda/draw.cu"),
        kernels: &[
            "draw_index_keys",
            "draw_queries",
            "draw_head_weights",
            "draw_kv_rows",
            "draw_resolve_pending",
            "next_tokens",
        ],
        arch: ARCH,
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

/// The shape of the wgmma logits kernel of one page dtype (`logits_wgmma.cu` explains it):
/// consumer warpgroups per CTA and ring stages per warpgroup, as the kernel is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgmmaShape {
    pub name: &'static str,
    /// Consumer warpgroups (128 threads each); one producer warp joins them.
    pub groups: u32,
    /// Pages in flight per consumer warpgroup (its ring of shared-memory stages).
    pub stages: u32,
    /// Bytes of one stage: one whole index-K page.
    pub page_bytes: u32,
}

impl WgmmaShape {
    /// Threads per CTA: the consumer warpgroups and the producer warp.
    pub fn threads(&self) -> u32 {
        128 * self.groups + 32
    }
    /// Dynamic shared memory per CTA (the kernel's `tkv_wg_smem_bytes`, which traps on less):
    /// 1 KB of alignment slack, the queries as B (2 x 8 KB, 128-byte swizzled) and as read
    /// (8 KB), the rings, and a full and an empty mbarrier per stage.
    pub fn smem_bytes(&self) -> u32 {
        1024 + 3 * 64 * 128
            + self.groups * self.stages * self.page_bytes
            + 16 * self.groups * self.stages
    }
}

/// The wgmma logits kernel of one page dtype: fp8 pages with 2 warpgroups of 5 stages, bf16
/// pages with 2 warpgroups of 2 stages (110 KB and 91 KB: two CTAs fit a multiprocessor either
/// way).
pub fn logits_wgmma_kernel(dtype: crate::layout::IndexKDtype) -> WgmmaShape {
    use crate::layout::{IndexKDtype, PageFormat};
    let page_bytes = PageFormat::IndexK(dtype).page_bytes() as u32;
    match dtype {
        IndexKDtype::Fp8 => WgmmaShape {
            name: "index_logits_wgmma_fp8",
            groups: 2,
            stages: 5,
            page_bytes,
        },
        IndexKDtype::Bf16 => WgmmaShape {
            name: "index_logits_wgmma_bf16",
            groups: 2,
            stages: 2,
            page_bytes,
        },
    }
}

/// CTAs of the wgmma logits kernel that one multiprocessor holds (its `__launch_bounds__`
/// minimum, and what its shared memory allows).
pub const WGMMA_CTAS_PER_SM: usize = 2;

/// The wgmma logits launch for `rows` rows of `out_stride` positions: grid `(chunks, rows)`,
/// where `chunks` = `ctas / rows` rounded down (so `ctas` resident CTAs are one wave; at least
/// 1, at most the row's pages), and `ctas` = 0 means [`WGMMA_CTAS_PER_SM`] per multiprocessor.
/// Returns (grid, threads, dynamic shared memory bytes).
pub fn logits_wgmma_launch(
    dtype: crate::layout::IndexKDtype,
    rows: usize,
    out_stride: usize,
    ctas: usize,
    sms: usize,
) -> ((u32, u32, u32), u32, u32) {
    let shape = logits_wgmma_kernel(dtype);
    let ctas = if ctas == 0 {
        WGMMA_CTAS_PER_SM * sms.max(1)
    } else {
        ctas
    };
    let out_pages = out_stride
        .div_ceil(crate::layout::PAGE_TOKENS as usize)
        .max(1);
    let chunks = (ctas / rows.max(1)).clamp(1, out_pages);
    (
        (chunks as u32, rows as u32, 1),
        shape.threads(),
        shape.smem_bytes(),
    )
}

/// Positions of a row that one top-k CTA keeps in shared memory (160 KB of keys; with the
/// buckets' 24 KB and the kernel's 34 KB of static shared memory, within sm_90's 227 KB per
/// CTA). A row longer than its cluster can hold is read from global memory on every pass instead.
pub const TOPK_STAGED_MAX: usize = 40_960;

/// Bits of the top-k radix select's digit (`topk.cu`'s `TOPK_DIGIT`, generated from this).
pub const TOPK_DIGIT_BITS: u32 = 11;

/// Threads of one top-k CTA (`topk.cu`'s `TOPK_THREADS`, generated from this, and the launch's
/// block size).
pub const TOPK_THREADS: u32 = 1024;

/// Words of dynamic shared memory a top-k CTA holds after its keys: for each first-pass bin, the
/// CTA's first index, its fill and the cluster's count (`topk.cu`: 3 x TOPK_BINS).
pub const TOPK_BUCKET_WORDS: usize = 3 << TOPK_DIGIT_BITS;

/// Keys past `k` that a top-k CTA's selection buffer holds: the largest threshold bucket it
/// gathers whole (`topk.cu`'s `TOPK_BUCKET_MAX`, generated from this).
pub const TOPK_BUCKET_MAX: usize = 64;

/// The top-k kernels' static shared memory, from the arrays `topk.cu` declares with the limits
/// above: the two histograms (`2 × 2^TOPK_DIGIT_BITS` u32), the selection buffer
/// (`INDEX_TOPK_MAX + TOPK_BUCKET_MAX` u64), three words per warp, and ten words of bounds, counts
/// and results; 16 bytes of alignment allowed for each of the eight arrays. The PTX NVRTC makes
/// is held to it (`topk_static_shared_memory_is_within_its_budget` in
/// `kernels/tests/it/nvrtc.rs`: 33,704 bytes at today's limits).
pub const TOPK_STATIC_SMEM_BYTES: usize = {
    let hist = 2 * (1usize << TOPK_DIGIT_BITS) * 4;
    let sel = (crate::layout::INDEX_TOPK_MAX as usize + TOPK_BUCKET_MAX) * 8;
    let warps = 3 * (TOPK_THREADS as usize / 32) * 4;
    hist + sel + warps + 10 * 4 + 8 * 16
};

// A CTA's dynamic and static shared memory within sm_90's 227 KB.
const _: () =
    assert!((TOPK_STAGED_MAX + TOPK_BUCKET_WORDS) * 4 + TOPK_STATIC_SMEM_BYTES <= 227 * 1024);

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

/// The architecture-specific Hopper target (wgmma): PTX for it loads only on a
/// compute capability 9.0 device.
pub const ARCH_WGMMA: &str = "sm_90a";

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
    compile_options_for(ARCH)
}

/// [`compile_options`] for the target `arch`.
pub fn compile_options_for(arch: &'static str) -> CompileOptions {
    CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(false),
        arch: Some(arch),
        include_paths: cuda_include_dir()
            .map(|p| vec![p.to_string_lossy().into_owned()])
            .unwrap_or_default(),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    }
}

/// What a guard kernel (`guard.cu`) refused: the code it writes into word 0 of its status record
/// (`TKV_GUARD_*` in the kernels, generated from this enum by [`layout_prelude`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum GuardRefusal {
    /// A slot outside the pool that is not -1.
    Slot = 1,
    /// A row's context length outside `0..=` the row's capacity.
    ContextLen = 2,
    /// A page-table entry a row's context uses, outside the pool.
    Page = 3,
    /// A source page number outside the source pool.
    SrcPage = 4,
    /// A destination page number outside the destination pool.
    DstPage = 5,
}

impl GuardRefusal {
    pub const ALL: [GuardRefusal; 5] = [
        GuardRefusal::Slot,
        GuardRefusal::ContextLen,
        GuardRefusal::Page,
        GuardRefusal::SrcPage,
        GuardRefusal::DstPage,
    ];

    pub fn from_code(code: u64) -> Option<GuardRefusal> {
        GuardRefusal::ALL.into_iter().find(|g| *g as u64 == code)
    }

    fn define(self) -> &'static str {
        match self {
            GuardRefusal::Slot => "TKV_GUARD_SLOT",
            GuardRefusal::ContextLen => "TKV_GUARD_CONTEXT_LEN",
            GuardRefusal::Page => "TKV_GUARD_PAGE",
            GuardRefusal::SrcPage => "TKV_GUARD_SRC_PAGE",
            GuardRefusal::DstPage => "TKV_GUARD_DST_PAGE",
        }
    }

    /// The entry a refusal names, in words.
    pub fn entry(self) -> &'static str {
        match self {
            GuardRefusal::Slot => "slot",
            GuardRefusal::ContextLen => "context length",
            GuardRefusal::Page => "page-table entry",
            GuardRefusal::SrcPage => "source page",
            GuardRefusal::DstPage => "destination page",
        }
    }
}

/// The byte sizes and offsets the kernels address, as C macros generated from the layout module
/// (the one place that computes them), so no `.cu` file writes a layout number of its own; and
/// the synthetic model's stream codes (`cpu::draw::Stream`), which `draw.cu` draws from.
pub fn layout_prelude() -> String {
    use crate::layout::{index_k_page, kv_row, IndexKDtype, KvDtype, PageFormat};
    let ik = |d| PageFormat::IndexK(d);
    let defs: [(&str, u64); 11] = [
        ("TKV_KV_ROW_VALUES", crate::layout::KV_ROW_VALUES as u64),
        ("TKV_ROPE_DIM", crate::layout::ROPE_DIM as u64),
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
    // The top-k kernel's limits: the largest `k` it selects and the bucket it gathers (its
    // selection buffer is sized by them), its digit and its block size, so that raising a Rust
    // limit cannot build a kernel whose buffers are smaller than what its launcher accepts (and
    // `TOPK_STATIC_SMEM_BYTES` follows them).
    let topk = [
        ("TKV_TOPK_MAX", crate::layout::INDEX_TOPK_MAX as u64),
        ("TKV_TOPK_DIGIT", TOPK_DIGIT_BITS as u64),
        ("TKV_TOPK_THREADS", TOPK_THREADS as u64),
        ("TKV_TOPK_BUCKET_MAX", TOPK_BUCKET_MAX as u64),
    ];
    let draw = [
        ("TKV_PENDING_TOKEN", crate::cpu::draw::PENDING_TOKEN as u64),
        ("TKV_VOCAB", crate::cpu::draw::VOCAB as u64),
        ("TKV_NEXT_TOKEN_SALT", crate::cpu::draw::NEXT_TOKEN_SALT),
    ];
    let guard = GuardRefusal::ALL.map(|g| (g.define(), g as u64));
    let layout = defs
        .iter()
        .chain(&topk)
        .chain(&draw)
        .chain(&guard)
        .map(|(name, v)| format!("#define {name} {v}\n"));
    let streams = crate::cpu::draw::STREAM_DEFINES
        .iter()
        .map(|(name, s)| format!("#define {name} {}ull\n", *s as u64));
    layout.chain(streams).collect()
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
    cudarc::nvrtc::compile_ptx_with_opts(full_source(src), compile_options_for(src.arch)).map_err(
        |e| {
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
        },
    )
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

    /// The top-k kernel's limits are the Rust constants: `topk.cu` defines them from the
    /// generated prelude and writes no number of its own for them.
    #[test]
    fn topk_limits_are_generated_from_the_rust_constants() {
        let prelude = layout_prelude();
        for line in [
            format!("#define TKV_TOPK_MAX {}\n", crate::layout::INDEX_TOPK_MAX),
            format!("#define TKV_TOPK_DIGIT {TOPK_DIGIT_BITS}\n"),
            format!("#define TKV_TOPK_THREADS {TOPK_THREADS}\n"),
            format!("#define TKV_TOPK_BUCKET_MAX {TOPK_BUCKET_MAX}\n"),
        ] {
            assert!(prelude.contains(&line), "{line} missing from\n{prelude}");
        }
        let topk = SOURCES
            .iter()
            .find(|s| s.file == "topk.cu")
            .expect("topk.cu");
        for (name, from) in [
            ("TOPK_MAX", "TKV_TOPK_MAX"),
            ("TOPK_DIGIT", "TKV_TOPK_DIGIT"),
            ("TOPK_THREADS", "TKV_TOPK_THREADS"),
            ("TOPK_BUCKET_MAX", "TKV_TOPK_BUCKET_MAX"),
        ] {
            let def = format!("#define {name} ");
            let lines: Vec<&str> = topk.text.lines().filter(|l| l.starts_with(&def)).collect();
            assert_eq!(lines, [format!("{def}{from}")], "topk.cu's {name}");
        }
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
        // The digit reaches topk.cu from TOPK_DIGIT_BITS (the generated prelude).
        assert!(src.text.contains("#define TOPK_DIGIT TKV_TOPK_DIGIT\n"));
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

    /// The wgmma logits kernel of each dtype is compiled for sm_90a and defined with the warpgroups
    /// and stages the launcher sizes it by, and the launcher's shared memory is the kernel's
    /// formula (`tkv_wg_smem_bytes`, which traps on less).
    #[test]
    fn logits_wgmma_kernels_are_compiled_with_their_shapes() {
        use crate::layout::{IndexKDtype, PageFormat};
        let src = SOURCES
            .iter()
            .find(|s| s.file == "logits_wgmma.cu")
            .unwrap();
        assert_eq!(src.arch, ARCH_WGMMA);
        assert_eq!(ARCH_WGMMA, "sm_90a");
        assert!(SOURCES
            .iter()
            .all(|s| s.file == "logits_wgmma.cu" || s.arch == ARCH));
        assert!(src
            .text
            .contains("return 1024 + 3 * TKV_WG_Q_HALF + G * S * PAGE_BYTES + 16 * G * S;"));
        assert!(src.text.contains("#define TKV_WG_Q_HALF (64 * 128)"));
        assert!(src.text.contains("__launch_bounds__(128 * G + 32, 2)"));
        for (dt, dtype) in IndexKDtype::ALL.into_iter().enumerate() {
            let shape = logits_wgmma_kernel(dtype);
            assert!(
                src.kernels.contains(&shape.name),
                "{} not loaded",
                shape.name
            );
            let def = format!("TKV_LOGITS_WGMMA({}, {dt}, ", shape.name);
            let at = src
                .text
                .find(&def)
                .unwrap_or_else(|| panic!("{} not defined", shape.name));
            let args: Vec<u32> = src.text[at + def.len()..]
                .split(')')
                .next()
                .unwrap()
                .split(',')
                .map(|a| a.trim().parse().unwrap())
                .collect();
            assert_eq!(args, [shape.groups, shape.stages], "{}", shape.name);
            let page = PageFormat::IndexK(dtype).page_bytes() as u32;
            assert_eq!(shape.page_bytes, page);
            assert_eq!(shape.threads(), 128 * shape.groups + 32);
            assert_eq!(
                shape.smem_bytes(),
                1024 + 24_576 + shape.groups * shape.stages * (page + 16)
            );
            // Two CTAs per multiprocessor: 228 KB of shared memory, 1 KB reserved per CTA and
            // the kernel's 1 KB of static shared memory (the head weights, padded by the
            // 1024-byte alignment of the dynamic array).
            assert!(
                WGMMA_CTAS_PER_SM as u32 * (shape.smem_bytes() + 2048) <= 228 * 1024,
                "{}: {} B",
                shape.name,
                shape.smem_bytes()
            );
        }
        assert_eq!(logits_wgmma_kernel(IndexKDtype::Fp8).smem_bytes(), 110_240);
        assert_eq!(logits_wgmma_kernel(IndexKDtype::Bf16).smem_bytes(), 91_200);
    }

    /// The wgmma launch: one wave of resident CTAs split evenly between the rows, at least one
    /// CTA per row and at most one per output page.
    #[test]
    fn logits_wgmma_launch_shapes() {
        use crate::layout::IndexKDtype::{Bf16, Fp8};
        // 64 x 64K on 132 multiprocessors: 264 resident CTAs, 4 per row (256).
        assert_eq!(
            logits_wgmma_launch(Fp8, 64, 65_536, 0, 132),
            ((4, 64, 1), 288, 110_240)
        );
        assert_eq!(
            logits_wgmma_launch(Bf16, 64, 65_536, 0, 132),
            ((4, 64, 1), 288, 91_200)
        );
        // The decode shapes: 1 x 64K, 8 x 8K.
        assert_eq!(logits_wgmma_launch(Fp8, 1, 65_536, 0, 132).0, (264, 1, 1));
        assert_eq!(logits_wgmma_launch(Fp8, 8, 8192, 0, 132).0, (33, 8, 1));
        // More rows than CTAs: one CTA per row. Short rows: no more CTAs than pages.
        assert_eq!(logits_wgmma_launch(Fp8, 1000, 4096, 0, 132).0, (1, 1000, 1));
        assert_eq!(logits_wgmma_launch(Fp8, 1, 65, 0, 132).0, (2, 1, 1));
        assert_eq!(logits_wgmma_launch(Fp8, 2, 1, 0, 132).0, (1, 2, 1));
        // An explicit CTA count; an empty output still launches one page's CTA per row.
        assert_eq!(logits_wgmma_launch(Bf16, 3, 65_536, 1, 132).0, (1, 3, 1));
        assert_eq!(logits_wgmma_launch(Bf16, 3, 65_536, 100, 132).0, (33, 3, 1));
        assert_eq!(logits_wgmma_launch(Bf16, 2, 0, 0, 132).0, (1, 2, 1));
    }
}
