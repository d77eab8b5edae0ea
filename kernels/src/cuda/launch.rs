//! Typed launchers of the CUDA kernels (feature `cuda`). Every source is compiled by NVRTC and
//! loaded once per device (context) per process; each launcher checks sizes, dtypes and fingerprints on the
//! host before it launches anything — the first half of the paired assertions whose second half is
//! the kernel's own bounds (the device checks the same on the simulated GPU).
//!
//! Buffers are passed as raw device addresses with their sizes ([`DevPtr`]), so the production
//! device can hand in any allocation it owns (device memory, or mapped pinned host memory).

use super::{
    compile, logits_mma_kernel, logits_wgmma_kernel, logits_wgmma_launch, topk_cluster, SOURCES,
    TOPK_BUCKET_WORDS, TOPK_KERNELS, TOPK_STAGED_MAX, TOPK_THREADS,
};
use crate::args;
use crate::error::{bad, KernelError, Result};
use crate::layout::{
    f32_bytes, i32_bytes, u32_bytes, u64_bytes, Bytes, IndexKDtype, KvDtype, LayoutFingerprint,
    PageFormat, INDEX_HEADS_MAX, INDEX_HEAD_DIM, PAGE_TOKENS, ROPE_DIM,
};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

mod guarded;

pub use super::DrawKind;
pub use guarded::{
    GuardFinding, GuardStatus, GuardedIndexKStore, GuardedIndexLogits, GuardedPageCopy, GuardedTopK,
};

/// Blocks per row of `sparse_read`: one per 128 ranks (16 at k = 2048), so that a few rows still
/// spread over the GPU (one block per row read 2,048 scattered KV rows with 8 warps).
pub fn sparse_read_shares(k: usize) -> u32 {
    k.div_ceil(128).clamp(1, 65_535) as u32
}

/// CUDA devices (ordinals) one process launches tierkv's kernels on.
pub const DEVICES_MAX: usize = 8;

/// A device address and the bytes behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevPtr {
    pub ptr: u64,
    pub bytes: Bytes,
}

impl DevPtr {
    /// The sub-range `[at, at + bytes)`; a range outside is a bug of the caller.
    pub fn offset(self, at: Bytes, bytes: Bytes) -> DevPtr {
        assert!(
            at + bytes <= self.bytes,
            "sub-range {at}+{bytes} outside {} B",
            self.bytes
        );
        DevPtr {
            ptr: self.ptr + at.0,
            bytes,
        }
    }
}

fn cuda(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::Cuda {
        op,
        detail: e.to_string(),
    }
}

fn need(op: &'static str, buffer: &'static str, p: DevPtr, bytes: Bytes) -> Result<()> {
    args::bind_at_least(op, (buffer, bytes), p.bytes)
}

fn paged(op: &'static str, format: PageFormat, p: DevPtr, fp: LayoutFingerprint) -> Result<u64> {
    if fp != format.fingerprint() {
        return Err(KernelError::LayoutMismatch {
            op,
            src: format.fingerprint(),
            dst: fp,
        });
    }
    if p.bytes.0 % format.page_bytes() != 0 {
        return Err(bad(
            op,
            "pool",
            format!("{} B is not a whole number of pages", p.bytes),
        ));
    }
    Ok(p.bytes.0 / format.page_bytes())
}

/// The KV dtype code `store.cu` and `sparse_read.cu` take. `fp8_unpacked` has none: the records'
/// `check` refuses it before a launcher asks.
fn kv_dtype_code(dtype: KvDtype) -> i32 {
    match dtype {
        KvDtype::Bf16 => 0,
        KvDtype::Fp8Packed => 1,
        KvDtype::Fp8Unpacked => unreachable!("the record's check refuses fp8_unpacked"),
    }
}

fn aligned(op: &'static str, buffer: &'static str, p: DevPtr, align: u64) -> Result<()> {
    if p.ptr % align != 0 {
        return Err(bad(
            op,
            buffer,
            format!("address {:#x} is not {align}-byte aligned", p.ptr),
        ));
    }
    Ok(())
}

/// Where the operands of an `index_k_store` ([`args::IndexKStore`]) lie on the device: its
/// inputs, the device copy of its slots, and the pool with its registered fingerprint.
#[derive(Clone, Copy, Debug)]
pub struct IndexKStorePtrs {
    pub keys: DevPtr,
    pub gamma: DevPtr,
    pub beta: DevPtr,
    pub rope: DevPtr,
    pub slots: DevPtr,
    pub dst: DevPtr,
    pub dst_fp: LayoutFingerprint,
}

/// Checks a launch of `a` on `p`: the record, every operand large enough and aligned for the
/// kernel's accesses (16 bytes for the keys, the RoPE rows and the pool, 4 for the rest), the
/// pool whole pages of the dtype's format, and every slot in it.
pub fn check_index_k_store(
    a: &args::IndexKStore,
    p: &IndexKStorePtrs,
) -> Result<CheckedIndexKStore> {
    a.check()?;
    let checked = p.bind(a.dtype, a.ue8m0, a.tokens())?;
    a.slots_in(checked.slots_max as u64)?;
    Ok(checked)
}

impl IndexKStorePtrs {
    /// Every check of [`check_index_k_store`] on `n` tokens but the slots' range (which the
    /// guarded launch leaves to the device, `guard.cu`).
    fn bind(&self, dtype: IndexKDtype, ue8m0: bool, n: usize) -> Result<CheckedIndexKStore> {
        const OP: &str = args::IndexKStore::OP;
        args::IndexKStore::check_tokens(n)?;
        let [keys, gamma, beta, rope, slots] = args::IndexKStore::operands_of(n);
        // The kernel reads keys and rope rows and writes page rows 16 bytes at a time (a
        // misaligned access would be a sticky CUDA error, poisoning the context).
        for (operand, p, align) in [
            (keys, self.keys, 16u64),
            (gamma, self.gamma, 4),
            (beta, self.beta, 4),
            (rope, self.rope, 16),
            (slots, self.slots, 4),
        ] {
            args::bind_at_least(OP, operand, p.bytes)?;
            aligned(OP, operand.0, p, align)?;
        }
        aligned(OP, "dst", self.dst, 16)?;
        let pages = paged(OP, PageFormat::IndexK(dtype), self.dst, self.dst_fp)?;
        let slots_max = pages * PAGE_TOKENS as u64;
        Ok(CheckedIndexKStore {
            dtype,
            ue8m0,
            keys: self.keys.ptr,
            gamma: self.gamma.ptr,
            beta: self.beta.ptr,
            rope: self.rope.ptr,
            slots_dev: self.slots.ptr,
            dst: self.dst.ptr,
            n: n as u32,
            // Slots are i32, so a larger pool only ever sees slots below i32::MAX.
            slots_max: slots_max.min(u32::MAX as u64) as u32,
        })
    }
}

/// An `index_k_store` launch whose sizes, alignment and every slot were checked on the host:
/// only [`check_index_k_store`] makes one, and [`Kernels::index_k_store_checked`] launches
/// it without walking the slots again (the kernel traps on a slot outside the pool, the device
/// half of the check). Its addresses must stay allocated while it is launched, as a
/// [`DevPtr`]'s must.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckedIndexKStore {
    dtype: IndexKDtype,
    ue8m0: bool,
    keys: u64,
    gamma: u64,
    beta: u64,
    rope: u64,
    slots_dev: u64,
    dst: u64,
    n: u32,
    slots_max: u32,
}

impl CheckedIndexKStore {
    pub fn tokens(&self) -> usize {
        self.n as usize
    }
}

/// Where the operands of a `topk` ([`args::TopK`]) lie on the device: the logits, the device
/// copies of the record's context lengths and page tables, and the selection.
#[derive(Clone, Copy, Debug)]
pub struct TopKPtrs {
    pub logits: DevPtr,
    pub context_lens: DevPtr,
    pub page_table: DevPtr,
    pub out: DevPtr,
}

/// Where the operands of a `kv_store` ([`args::KvStore`]) lie on the device: the rows, the
/// device copy of the record's slots, and the pool with its registered fingerprint.
#[derive(Clone, Copy, Debug)]
pub struct KvStorePtrs {
    pub rows: DevPtr,
    pub slots: DevPtr,
    pub dst: DevPtr,
    pub dst_fp: LayoutFingerprint,
}

/// Where the operands of a `q_prep` ([`args::QPrep`]) lie on the device, in the order of
/// [`args::QPrep::operands`].
#[derive(Clone, Copy, Debug)]
pub struct QPrepPtrs {
    pub q: DevPtr,
    pub w: DevPtr,
    pub rope: DevPtr,
    pub q_out: DevPtr,
    pub w_out: DevPtr,
}

/// Where the operands of a `sparse_read` ([`args::SparseRead`]) lie on the device: the
/// selection, the pool with its registered fingerprint, and the digests.
#[derive(Clone, Copy, Debug)]
pub struct SparseReadPtrs {
    pub slots: DevPtr,
    pub kv: DevPtr,
    pub kv_fp: LayoutFingerprint,
    pub out: DevPtr,
}

/// Which `index_logits` kernel runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogitsKernel {
    /// The CPU reference's operation order on CUDA-core fp32 FMAs: bit-exact, compute-bound.
    /// `tierkv sim --device cuda` uses it, so that a seed computes on the GPU exactly what it
    /// computes on the CPU executor (the same selections, digests and tokens).
    Exact,
    /// Tensor cores, Hopper's warpgroup MMA (`wgmma` f16/bf16, f32 accumulate, pages copied into
    /// a shared-memory ring by a producer warp; `logits_wgmma.cu`, sm_90a): within DESIGN §4's
    /// 1e-5 of the terms' magnitude, not bit-exact. The production default.
    #[default]
    TensorCore,
    /// The previous tensor-core kernel (`mma.sync` f16/bf16, f32 accumulate; `logits_mma.cu`),
    /// within the same bound: kept for comparison (`tierkv bench`).
    Mma,
}

/// Launch choices of the tensor-core logits kernels, held by whoever launches them (`tierkv
/// bench` sweeps them; kernels/GPU.md has the measurements behind the defaults): the CTAs one
/// launch aims for (each CTA loops over a row's pages with a stride; 0 = the kernel's own
/// default: [`super::WGMMA_CTAS_PER_SM`] per multiprocessor for the wgmma kernel, one wave;
/// [`MMA_CTAS_PER_SM`] per multiprocessor for the `mma.sync` kernel, 2112 on an H200), and,
/// for the `mma.sync` kernel only, how many strides ahead pages are prefetched into L2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogitsTuning {
    pub ctas: usize,
    pub ahead: usize,
}

impl Default for LogitsTuning {
    fn default() -> Self {
        LogitsTuning { ctas: 0, ahead: 2 }
    }
}

/// CTAs per multiprocessor the `mma.sync` logits kernel launches by default (runs 5–10: 2112
/// CTAs on the H200's 132 multiprocessors beat 1056 and matched 4224).
pub const MMA_CTAS_PER_SM: usize = 16;

/// Where the operands of an `index_logits` ([`args::IndexLogits`]) lie on the device: the
/// queries and weights, the device copies of the record's page tables and context lengths, the
/// pool with its registered fingerprint, and the logits.
#[derive(Clone, Copy, Debug)]
pub struct IndexLogitsPtrs {
    pub q: DevPtr,
    pub w: DevPtr,
    pub page_table: DevPtr,
    pub context_lens: DevPtr,
    pub k: DevPtr,
    pub k_fp: LayoutFingerprint,
    pub out: DevPtr,
}

/// Checks a launch of `a` on `p`: the record, every operand large enough, and every page a
/// row's context names inside the pool (see [`CheckedIndexLogits`]).
pub fn check_index_logits(
    a: &args::IndexLogits,
    p: &IndexLogitsPtrs,
) -> Result<CheckedIndexLogits> {
    a.check()?;
    let (checked, pages) = p.bind(a.dtype, a.heads, a.rows(), a.pt_stride, a.out_stride)?;
    a.pages_in(pages)?;
    Ok(checked)
}

impl IndexLogitsPtrs {
    /// Every check of [`check_index_logits`] on `rows` rows but the walk of the host page table
    /// and context lengths; also answers the pool's pages.
    fn bind(
        &self,
        dtype: IndexKDtype,
        heads: u32,
        rows: usize,
        pt_stride: u32,
        out_stride: u32,
    ) -> Result<(CheckedIndexLogits, u64)> {
        const OP: &str = args::IndexLogits::OP;
        args::check_heads(OP, heads)?;
        args::check_strides(OP, out_stride, pt_stride)?;
        let [q, w, pt, lens, out] =
            args::IndexLogits::operands_of(rows, heads, pt_stride, out_stride);
        for (operand, p) in [
            (q, self.q),
            (w, self.w),
            (pt, self.page_table),
            (lens, self.context_lens),
            (out, self.out),
        ] {
            args::bind_at_least(OP, operand, p.bytes)?;
        }
        let pages = paged(OP, PageFormat::IndexK(dtype), self.k, self.k_fp)?;
        let checked = CheckedIndexLogits {
            dtype,
            heads: heads as usize,
            q: self.q,
            w: self.w,
            pt_dev: self.page_table,
            pt_stride: pt_stride as usize,
            lens_dev: self.context_lens,
            k: self.k,
            out: self.out,
            out_stride: out_stride as usize,
            rows,
        };
        Ok((checked, pages))
    }
}

/// An `index_logits` launch whose sizes, context lengths and every page its rows name were
/// checked on the host: only [`check_index_logits`] makes one, and
/// [`Kernels::index_logits_checked`] launches it without walking the page table again. The
/// logits kernels do not bounds-check pages themselves, so relaunching one is sound only while
/// the device's page table and context lengths hold what was checked and its addresses stay
/// allocated, as a [`DevPtr`]'s must (which is why that launcher is `unsafe`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckedIndexLogits {
    dtype: IndexKDtype,
    heads: usize,
    q: DevPtr,
    w: DevPtr,
    pt_dev: DevPtr,
    pt_stride: usize,
    lens_dev: DevPtr,
    k: DevPtr,
    out: DevPtr,
    out_stride: usize,
    rows: usize,
}

impl CheckedIndexLogits {
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// The top-k launch shape, held by whoever launches it: CTAs per row (a thread-block cluster of
/// 1, 2, 4 or 8), or `None` for [`super::topk_cluster`]'s choice. `tierkv bench` sweeps it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TopKTuning {
    pub cluster: Option<u32>,
}

/// The compiled kernels, loaded into one context.
pub struct Kernels {
    pub ctx: Arc<CudaContext>,
    funcs: BTreeMap<&'static str, CudaFunction>,
    /// The device's multiprocessors (the top-k launch shape depends on them).
    sms: usize,
}

impl Kernels {
    /// Compiles every source (once per process: see [`Kernels::global`]) and loads it.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        let mut funcs = BTreeMap::new();
        for src in SOURCES {
            let ptx = compile(src)?;
            let module = ctx.load_module(ptx).map_err(cuda("load_module"))?;
            for &k in src.kernels {
                funcs.insert(k, module.load_function(k).map_err(cuda("load_function"))?);
            }
        }
        // The top-k kernels keep up to TOPK_STAGED_MAX keys and their buckets in dynamic shared
        // memory, past the 48 KB a launch may ask for by default.
        for (_, name) in TOPK_KERNELS {
            funcs[name]
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    i32_bytes((TOPK_STAGED_MAX + TOPK_BUCKET_WORDS) as u64).0 as i32,
                )
                .map_err(cuda("topk: set_attribute"))?;
        }
        // The wgmma logits kernels hold their page rings in dynamic shared memory (91-110 KB).
        for dtype in IndexKDtype::ALL {
            let shape = logits_wgmma_kernel(dtype);
            funcs[shape.name]
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shape.smem_bytes() as i32,
                )
                .map_err(cuda("index_logits_wgmma: set_attribute"))?;
        }
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda("device attribute"))?;
        Ok(Kernels {
            ctx: ctx.clone(),
            funcs,
            sms: sms.max(1) as usize,
        })
    }

    /// The process-wide kernels on device 0 (compiled and loaded on first use).
    pub fn global() -> Result<&'static Kernels> {
        Kernels::on(0)
    }

    /// The process-wide kernels on device `ordinal` (each device its own context, compiled and
    /// loaded on first use): an engine on a second GPU launches there.
    pub fn on(ordinal: usize) -> Result<&'static Kernels> {
        static K: [OnceLock<std::result::Result<Kernels, KernelError>>; DEVICES_MAX] =
            [const { OnceLock::new() }; DEVICES_MAX];
        let Some(cell) = K.get(ordinal) else {
            return Err(KernelError::Cuda {
                op: "CudaContext::new",
                detail: format!("device {ordinal}: tierkv uses devices 0..{DEVICES_MAX}"),
            });
        };
        cell.get_or_init(|| {
            // cudarc loads the driver library lazily and panics when it is missing; a machine
            // without a GPU driver gets this error instead.
            // SAFETY: only tries to open the library (libloading), calls nothing in it.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(KernelError::Cuda {
                    op: "CudaContext::new",
                    detail: "the CUDA driver library (libcuda.so) was not found: this machine has \
                             no NVIDIA driver, or it is not on the library path"
                        .into(),
                });
            }
            let ctx = CudaContext::new(ordinal).map_err(cuda("CudaContext::new"))?;
            // tierkv orders its streams itself (events, waits): cudarc's own tracking would add
            // synchronisation the engine did not ask for and hide its ordering bugs.
            // SAFETY: every buffer tierkv launches on is ordered by the engine's events.
            unsafe { ctx.disable_event_tracking() };
            Kernels::load(&ctx)
        })
        .as_ref()
        .map_err(|e| e.clone())
    }

    fn f(&self, name: &'static str) -> &CudaFunction {
        &self.funcs[name]
    }

    /// `index_k_store` of the record `a` on the device operands `p`.
    pub fn index_k_store(
        &self,
        s: &CudaStream,
        a: &args::IndexKStore,
        p: &IndexKStorePtrs,
    ) -> Result<()> {
        self.index_k_store_checked(s, &check_index_k_store(a, p)?)
    }

    /// `index_k_store` of a launch checked before (see [`CheckedIndexKStore`]).
    pub fn index_k_store_checked(&self, s: &CudaStream, c: &CheckedIndexKStore) -> Result<()> {
        const OP: &str = "index_k_store";
        const TOKENS_PER_CTA: u32 = 64;
        if c.n == 0 {
            return Ok(());
        }
        let (n32, dt, ue) = (
            c.n as i32,
            (c.dtype == IndexKDtype::Bf16) as i32,
            c.ue8m0 as i32,
        );
        let mut b = s.launch_builder(self.f("index_k_store"));
        b.arg(&c.keys)
            .arg(&c.gamma)
            .arg(&c.beta)
            .arg(&c.rope)
            .arg(&c.slots_dev);
        b.arg(&n32).arg(&dt).arg(&ue).arg(&c.slots_max).arg(&c.dst);
        let cfg = LaunchConfig {
            // Four threads per token (store.cu's IKS_TOKENS tokens per CTA).
            grid_dim: (c.n.div_ceil(TOKENS_PER_CTA), 1, 1),
            block_dim: (4 * TOKENS_PER_CTA, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every pointer was checked against the sizes and alignment the kernel needs.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// `kv_store` of the record `a`: `rows` and `slots` (the device copy of `a.slots`) into the
    /// pool `dst`.
    pub fn kv_store(&self, s: &CudaStream, a: &args::KvStore, p: &KvStorePtrs) -> Result<()> {
        const OP: &str = args::KvStore::OP;
        a.check()?;
        let [rows, slots] = a.operands();
        args::bind_at_least(OP, rows, p.rows.bytes)?;
        args::bind_at_least(OP, slots, p.slots.bytes)?;
        let dt = kv_dtype_code(a.dtype);
        let pages = paged(OP, PageFormat::Kv(a.dtype), p.dst, p.dst_fp)?;
        a.slots_in(pages * PAGE_TOKENS as u64)?;
        let n = a.tokens();
        if n == 0 {
            return Ok(());
        }
        let n32 = n as i32;
        let mut b = s.launch_builder(self.f("kv_store"));
        b.arg(&p.rows.ptr)
            .arg(&p.slots.ptr)
            .arg(&n32)
            .arg(&dt)
            .arg(&p.dst.ptr);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes checked above.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// `q_prep` of the record `a` (its heads are the model's indexer heads: the folded weight's
    /// `heads^-½` is computed from it), each head's scale rounded up to a power of two under
    /// `ue8m0`.
    pub fn q_prep(&self, s: &CudaStream, a: &args::QPrep, p: &QPrepPtrs) -> Result<()> {
        const OP: &str = args::QPrep::OP;
        a.check()?;
        for (operand, ptr) in a
            .operands()
            .into_iter()
            .zip([p.q, p.w, p.rope, p.q_out, p.w_out])
        {
            args::bind_at_least(OP, operand, ptr.bytes)?;
        }
        let nh = a.rows as u64 * a.heads as u64;
        if nh == 0 {
            return Ok(());
        }
        let (n32, h32, ue) = (a.rows as i32, a.heads as i32, a.ue8m0 as i32);
        let head_scale = crate::cpu::q_prep::head_weight_scale(a.heads as usize);
        let mut b = s.launch_builder(self.f("q_prep"));
        b.arg(&p.q.ptr)
            .arg(&p.w.ptr)
            .arg(&p.rope.ptr)
            .arg(&n32)
            .arg(&h32)
            .arg(&ue)
            .arg(&head_scale)
            .arg(&p.q_out.ptr)
            .arg(&p.w_out.ptr);
        let cfg = LaunchConfig {
            grid_dim: ((nh as u32).div_ceil(4), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes checked above.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// `index_logits` with the chosen kernel and launch shape. The page table and context
    /// lengths are checked on the host (every page a row names must lie in the pool) before
    /// anything is launched.
    pub fn index_logits_with(
        &self,
        kind: LogitsKernel,
        tuning: LogitsTuning,
        s: &CudaStream,
        a: &args::IndexLogits,
        p: &IndexLogitsPtrs,
    ) -> Result<()> {
        let c = check_index_logits(a, p)?;
        // SAFETY: checked just now, against the host arrays the launch carries; that the
        // device arrays hold them is the caller's part, as it always was (`pt_dev`, `lens_dev`).
        unsafe { self.index_logits_checked(kind, tuning, s, &c) }
    }

    /// `index_logits` of a launch checked before, without walking its page table again.
    ///
    /// # Safety
    /// From this call until the kernel finished, the device page table and context lengths `c`
    /// names must equal the host arrays [`check_index_logits`] walked (no write to them
    /// may be queued on any stream meanwhile), and every buffer it names must stay allocated
    /// at its checked size: the kernels trust every page the table names.
    pub unsafe fn index_logits_checked(
        &self,
        kind: LogitsKernel,
        tuning: LogitsTuning,
        s: &CudaStream,
        c: &CheckedIndexLogits,
    ) -> Result<()> {
        if c.rows == 0 || c.out_stride == 0 {
            return Ok(());
        }
        match kind {
            LogitsKernel::TensorCore => self.logits_wgmma(tuning, s, c),
            LogitsKernel::Mma => self.logits_mma(tuning, s, c),
            LogitsKernel::Exact => self.logits_exact(s, c),
        }
    }

    fn logits_exact(&self, s: &CudaStream, a: &CheckedIndexLogits) -> Result<()> {
        let (pts, h32, os) = (a.pt_stride as i32, a.heads as i32, a.out_stride as i32);
        let dt = (a.dtype == IndexKDtype::Bf16) as i32;
        let mut b = s.launch_builder(self.f("index_logits"));
        b.arg(&a.q.ptr).arg(&a.w.ptr).arg(&a.pt_dev.ptr).arg(&pts);
        b.arg(&a.lens_dev.ptr).arg(&h32).arg(&dt);
        b.arg(&a.k.ptr).arg(&a.out.ptr).arg(&os);
        let cfg = LaunchConfig {
            grid_dim: ((a.out_stride as u32).div_ceil(128), a.rows() as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: f32_bytes(a.heads as u64 * (INDEX_HEAD_DIM as u64 + 1)).0 as u32,
        };
        // SAFETY: sizes and every page the rows name were checked when `a` was made
        // (`check_index_logits`), and still hold (`index_logits_checked`'s contract).
        unsafe { b.launch(cfg) }.map_err(cuda("index_logits"))?;
        Ok(())
    }

    fn logits_mma(
        &self,
        tuning: LogitsTuning,
        s: &CudaStream,
        a: &CheckedIndexLogits,
    ) -> Result<()> {
        const OP: &str = "index_logits";
        // The tensor-core kernels pad to two halves of 32 heads, load queries 16 bytes at a time
        // and copy pages in 16-byte chunks: a misaligned buffer would be a sticky CUDA error (it
        // poisons the context), so it is a typed error here.
        const _: () = assert!(INDEX_HEADS_MAX <= 64);
        for (name, p, align) in [
            ("q", a.q, 16u64),
            ("k", a.k, 16),
            ("w", a.w, 4),
            ("out", a.out, 4),
        ] {
            if p.ptr % align != 0 {
                return Err(bad(
                    OP,
                    name,
                    format!("address {:#x} is not {align}-byte aligned", p.ptr),
                ));
            }
        }
        let (name, threads) = logits_mma_kernel(a.dtype);
        let out_pages = a.out_stride.div_ceil(PAGE_TOKENS as usize);
        let ctas = match tuning.ctas {
            0 => MMA_CTAS_PER_SM * self.sms,
            n => n,
        };
        let chunks = ctas.div_ceil(a.rows()).clamp(1, out_pages);
        let ahead = tuning.ahead.min(16) as i32;
        let (pts, h32, os) = (a.pt_stride as i32, a.heads as i32, a.out_stride as i32);
        let mut b = s.launch_builder(self.f(name));
        b.arg(&a.q.ptr).arg(&a.w.ptr).arg(&a.pt_dev.ptr).arg(&pts);
        b.arg(&a.lens_dev.ptr).arg(&h32);
        b.arg(&a.k.ptr).arg(&a.out.ptr).arg(&os).arg(&ahead);
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, a.rows() as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes and every page the rows name were checked when `a` was made
        // (`check_index_logits`), and still hold (`index_logits_checked`'s contract).
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    fn logits_wgmma(
        &self,
        tuning: LogitsTuning,
        s: &CudaStream,
        a: &CheckedIndexLogits,
    ) -> Result<()> {
        const OP: &str = "index_logits";
        // The producer copies whole pages with cp.async.bulk (16-byte aligned source); the CTA
        // reads its queries 16 bytes at a time; the consumers read the weights and write the
        // logits as f32.
        for (name, p, align) in [
            ("q", a.q, 16u64),
            ("k", a.k, 16),
            ("w", a.w, 4),
            ("out", a.out, 4),
        ] {
            aligned(OP, name, p, align)?;
        }
        if a.rows() > u16::MAX as usize {
            return Err(bad(OP, "rows", format!("{} rows in one launch", a.rows())));
        }
        let shape = logits_wgmma_kernel(a.dtype);
        let (grid, threads, smem) =
            logits_wgmma_launch(a.dtype, a.rows(), a.out_stride, tuning.ctas, self.sms);
        let (pts, h32, os) = (a.pt_stride as i32, a.heads as i32, a.out_stride as i32);
        let mut b = s.launch_builder(self.f(shape.name));
        b.arg(&a.q.ptr).arg(&a.w.ptr).arg(&a.pt_dev.ptr).arg(&pts);
        b.arg(&a.lens_dev.ptr).arg(&h32);
        b.arg(&a.k.ptr).arg(&a.out.ptr).arg(&os);
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: sizes and every page the rows name were checked when `a` was made, and still
        // hold (`index_logits_checked`'s contract); the shared
        // memory is the kernel's own formula (it traps on less), allowed at load.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// `topk` with any `k` in 1..=`INDEX_TOPK_MAX`, in the launch shape [`super::topk_cluster`] picks.
    pub fn topk(&self, s: &CudaStream, a: &args::TopK, p: &TopKPtrs) -> Result<()> {
        self.topk_with(TopKTuning::default(), s, a, p)
    }

    /// `topk` in a chosen launch shape.
    pub fn topk_with(
        &self,
        tuning: TopKTuning,
        s: &CudaStream,
        a: &args::TopK,
        p: &TopKPtrs,
    ) -> Result<()> {
        const OP: &str = args::TopK::OP;
        a.check()?;
        for (operand, ptr) in
            a.operands()
                .into_iter()
                .zip([p.logits, p.context_lens, p.page_table, p.out])
        {
            args::bind_at_least(OP, operand, ptr.bytes)?;
        }
        let rows = a.rows();
        if rows == 0 {
            return Ok(());
        }
        let len_max = a
            .context_lens
            .iter()
            .map(|&l| l as usize)
            .max()
            .unwrap_or(0);
        let cluster = match tuning.cluster {
            None => topk_cluster(rows, len_max, self.sms),
            Some(c) => c,
        };
        let Some(&(_, name)) = TOPK_KERNELS.iter().find(|(c, _)| *c == cluster) else {
            return Err(bad(OP, "cluster", format!("{cluster} is not 1, 2, 4 or 8")));
        };
        if rows as u64 * cluster as u64 > i32::MAX as u64 {
            return Err(bad(OP, "rows", format!("{rows} rows in one launch")));
        }
        // Each CTA of a row's cluster stages its share of the row when it fits.
        let cap = len_max.div_ceil(cluster as usize).min(TOPK_STAGED_MAX);
        let (st, k32, pts, cap32) = (a.stride as i32, a.k as i32, a.pt_stride as i32, cap as i32);
        // The lengths were checked on the host (`a.check()`): no status record, no device check
        // (the kernel's length bound is then unused; the stride is passed).
        let (no_status, len_bound) = (0u64, st);
        let mut b = s.launch_builder(self.f(name));
        b.arg(&p.logits.ptr)
            .arg(&st)
            .arg(&p.context_lens.ptr)
            .arg(&p.page_table.ptr)
            .arg(&pts)
            .arg(&k32)
            .arg(&p.out.ptr)
            .arg(&cap32)
            .arg(&len_bound)
            .arg(&no_status)
            .arg(&no_status);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32 * cluster, 1, 1),
            block_dim: (TOPK_THREADS, 1, 1),
            shared_mem_bytes: i32_bytes((cap + TOPK_BUCKET_WORDS) as u64).0 as u32,
        };
        // SAFETY: sizes checked above; the kernel's cluster size is compiled in and
        // divides the grid.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// Gathers the RoPE rows of `positions` (on the device: `positions_dev`) from `table`, the
    /// model's rows of positions `0..table_rows` (row `p` is `Rope::row(p)`), into `out`,
    /// `[positions][64]` f32.
    pub fn rope_rows(
        &self,
        s: &CudaStream,
        table: DevPtr,
        table_rows: u32,
        positions: &[u32],
        positions_dev: DevPtr,
        out: DevPtr,
    ) -> Result<()> {
        const OP: &str = "rope_rows";
        let n = positions.len() as u64;
        need(
            OP,
            "table",
            table,
            f32_bytes(table_rows as u64 * ROPE_DIM as u64),
        )?;
        need(OP, "positions", positions_dev, i32_bytes(n))?;
        need(OP, "out", out, f32_bytes(n * ROPE_DIM as u64))?;
        if positions.iter().any(|&p| p >= table_rows) {
            return Err(bad(OP, "positions", "a position outside the table"));
        }
        if n == 0 {
            return Ok(());
        }
        if n > i32::MAX as u64 {
            return Err(bad(OP, "positions", "more than 2^31 - 1"));
        }
        let mut b = s.launch_builder(self.f("rope_rows"));
        b.arg(&table.ptr)
            .arg(&table_rows)
            .arg(&positions_dev.ptr)
            .arg(&out.ptr);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (ROPE_DIM, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes and positions checked above.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// Draws the synthetic model's `kind` inputs of `rows` rows (`rows_dev`: each row's token
    /// and position, `cpu::draw::TokenAt`) of global layer `layer` into `out`, bit for bit as
    /// `cpu::draw` draws them.
    #[allow(clippy::too_many_arguments)]
    pub fn draw(
        &self,
        s: &CudaStream,
        kind: DrawKind,
        seed: u64,
        layer: u32,
        rows: usize,
        rows_dev: DevPtr,
        out: DevPtr,
    ) -> Result<()> {
        const OP: &str = "draw";
        if let DrawKind::Queries { heads } | DrawKind::HeadWeights { heads } = kind {
            if heads == 0 || heads > INDEX_HEADS_MAX {
                return Err(bad(OP, "heads", format!("outside 1..={INDEX_HEADS_MAX}")));
            }
        }
        need(OP, "rows", rows_dev, i32_bytes(2 * rows as u64))?;
        need(OP, "out", out, kind.bytes(rows as u64))?;
        let (name, blocks, threads) = match kind {
            DrawKind::IndexKeys => ("draw_index_keys", (rows as u32, 1), INDEX_HEAD_DIM),
            DrawKind::KvRows => ("draw_kv_rows", (rows as u32, 1), 192),
            DrawKind::Queries { heads } => ("draw_queries", (rows as u32, heads), INDEX_HEAD_DIM),
            DrawKind::HeadWeights { heads } => ("draw_head_weights", (rows as u32, 1), heads),
        };
        if rows == 0 {
            return Ok(());
        }
        if rows > i32::MAX as usize {
            return Err(bad(OP, "rows", "more than 2^31 - 1"));
        }
        let mut b = s.launch_builder(self.f(name));
        b.arg(&seed).arg(&layer).arg(&rows_dev.ptr).arg(&out.ptr);
        let cfg = LaunchConfig {
            grid_dim: (blocks.0, blocks.1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes checked above; every kernel writes exactly `kind.bytes(rows)`.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// Replaces, in place on the device, the token of every pending row of `rows` (uploaded at
    /// `rows_dev`) by its entry of `tokens` (`tokens_len` u32s), as `cpu::draw::resolve_pending`
    /// does on the host; an index past `tokens` is refused here, before the launch.
    pub fn resolve_pending(
        &self,
        s: &CudaStream,
        rows: &[crate::cpu::draw::TokenAt],
        rows_dev: DevPtr,
        tokens: DevPtr,
        tokens_len: u32,
    ) -> Result<()> {
        const OP: &str = "draw";
        need(OP, "rows", rows_dev, i32_bytes(2 * rows.len() as u64))?;
        need(OP, "tokens", tokens, u32_bytes(tokens_len as u64))?;
        for (i, t) in rows.iter().enumerate() {
            if let Some(at) = t.pending_index() {
                if at >= tokens_len {
                    return Err(KernelError::OutOfRange {
                        op: OP,
                        index: i,
                        value: at as i64,
                        limit: tokens_len as u64,
                    });
                }
            }
        }
        if rows.is_empty() {
            return Ok(());
        }
        let n = u32::try_from(rows.len()).map_err(|_| bad(OP, "rows", "more than 2^32 - 1"))?;
        let mut b = s.launch_builder(self.f("draw_resolve_pending"));
        b.arg(&rows_dev.ptr)
            .arg(&n)
            .arg(&tokens.ptr)
            .arg(&tokens_len);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both buffers checked above, every pending index lies inside `tokens`.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// The next token of each of a step's first `a.rows` query rows into `out` (u32s), from the
    /// step's digests (`[layers][rows_max]` u64), bit for bit as `cpu::draw::next_tokens`.
    pub fn next_tokens(
        &self,
        s: &CudaStream,
        a: &args::NextTokens,
        digests: DevPtr,
        out: DevPtr,
    ) -> Result<()> {
        const OP: &str = args::NextTokens::OP;
        a.check()?;
        let [d, o] = a.operands();
        args::bind_at_least(OP, d, digests.bytes)?;
        args::bind_at_least(OP, o, out.bytes)?;
        if a.rows == 0 {
            return Ok(());
        }
        let mut b = s.launch_builder(self.f("next_tokens"));
        b.arg(&a.seed)
            .arg(&digests.ptr)
            .arg(&a.layers)
            .arg(&a.rows_max)
            .arg(&a.rows)
            .arg(&out.ptr);
        let cfg = LaunchConfig {
            grid_dim: (a.rows.div_ceil(128), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes checked above; the kernel reads `layers × rows_max` digests and writes
        // `rows` tokens.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// `sparse_read` of the record `a` (`a.rows` selections of `a.k` slots) from the pool `kv`.
    /// The selection is device data (from `topk`), so the pool is bounds-checked by the
    /// caller's declared page tables.
    pub fn sparse_read(
        &self,
        s: &CudaStream,
        a: &args::SparseRead,
        p: &SparseReadPtrs,
    ) -> Result<()> {
        const OP: &str = args::SparseRead::OP;
        a.check()?;
        let [slots, out] = a.operands();
        args::bind_at_least(OP, slots, p.slots.bytes)?;
        args::bind_at_least(OP, out, p.out.bytes)?;
        let dt = kv_dtype_code(a.dtype);
        paged(OP, PageFormat::Kv(a.dtype), p.kv, p.kv_fp)?;
        let rows = a.rows as usize;
        if rows == 0 {
            return Ok(());
        }
        // Each block adds its share of a row's ranks into the row's digest: zero them first.
        // SAFETY: `out` holds the rows' digests (checked above).
        let bytes = u64_bytes(rows as u64).usize();
        let zeroed =
            unsafe { cudarc::driver::sys::cuMemsetD8Async(p.out.ptr, 0, bytes, s.cu_stream()) };
        if zeroed != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(KernelError::Cuda {
                op: OP,
                detail: format!("cuMemsetD8Async: {zeroed:?}"),
            });
        }
        let k32 = a.k as i32;
        let mut b = s.launch_builder(self.f("sparse_read"));
        b.arg(&p.slots.ptr)
            .arg(&k32)
            .arg(&dt)
            .arg(&p.kv.ptr)
            .arg(&p.out.ptr);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, sparse_read_shares(a.k as usize), 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sizes checked above.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// `page_gather`: the whole pages of `runs` between two strided views, one CTA per page.
    /// `pairs_dev` holds [`super::gather_pairs`]`(runs)` on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn page_gather(
        &self,
        s: &CudaStream,
        src: DevPtr,
        src_view: &crate::layout::PagedView,
        dst: DevPtr,
        dst_view: &crate::layout::PagedView,
        runs: &[crate::layout::PageRun],
        pairs_dev: DevPtr,
    ) -> Result<()> {
        const OP: &str = "page_gather";
        crate::cpu::check_page_copy(src_view, src.bytes.0, dst_view, dst.bytes.0, runs)?;
        let pages: u64 = runs.iter().map(|r| r.count as u64).sum();
        need(OP, "pairs", pairs_dev, i32_bytes(pages * 2))?;
        for v in [src_view, dst_view] {
            if v.base % 16 != 0 || v.page_stride % 16 != 0 || v.page_bytes() % 16 != 0 {
                return Err(bad(OP, "view", "pages must be 16-byte aligned"));
            }
        }
        if pages == 0 {
            return Ok(());
        }
        let n = pages as i32;
        let pb = src_view.page_bytes();
        let mut b = s.launch_builder(self.f("page_gather"));
        b.arg(&src.ptr)
            .arg(&src_view.base)
            .arg(&src_view.page_stride);
        b.arg(&dst.ptr)
            .arg(&dst_view.base)
            .arg(&dst_view.page_stride);
        b.arg(&pairs_dev.ptr).arg(&n).arg(&pb);
        let cfg = LaunchConfig {
            grid_dim: (pages as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both views and every pair were checked above.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }
}
