//! `tierkv.ops`: the indexer's kernels as array ops, on any DLPack array (torch tensors, numpy
//! arrays). Host arrays run the CPU references (`tierkv_kernels::cpu`); CUDA arrays (a build
//! with feature `cuda`) run the CUDA kernels' guarded launches (`tierkv_kernels::cuda::launch`).
//!
//! On the GPU an op runs on tierkv's own stream of the device, ordered after the caller's stream
//! (`stream`, torch's `current_stream().cuda_stream`) by an event recorded on it, and the
//! caller's stream is made to wait for the op's result by a second event: the caller sees the
//! op as if it had run on its stream, and no call after a device's first (which compiles the
//! kernels and allocates pinned memory) synchronises the device. The index arrays
//! (slots, block tables, context lengths, page numbers) stay on the GPU, so their entries are
//! checked there (guard kernels): an entry outside its pool is skipped (a row scored as empty,
//! a token not stored, a pair not copied) and recorded; the next op on that device, or
//! `take_refusal`, raises it as `DeviceIndexError`, the way CUDA reports an asynchronous error.
//! On the host every entry is checked before anything is written, and a bad one raises
//! `OpError` at once. Shapes, element types, alignment and the cache's page format are checked
//! on the host in both cases, before anything runs.

use pyo3::prelude::*;
use tierkv_kernels::args;
use tierkv_kernels::cpu;
use tierkv_kernels::layout::{
    IndexKDtype, PageFormat, INDEX_HEADS_MAX, INDEX_HEAD_DIM, PAGE_TOKENS, ROPE_DIM,
};

use crate::dlpack::{Arr, Device, Elem};
use crate::OpError;

/// A tensor's row length as the kernels' records hold it (`u32`), or an error naming it.
fn dim_u32(op: &str, tensor: &str, v: usize) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| {
        err(
            op,
            format!("`{tensor}` has rows of {v} entries, more than a kernel indexes"),
        )
    })
}

fn err(op: &str, detail: impl std::fmt::Display) -> PyErr {
    OpError::new_err(format!("tierkv.ops.{op}: {detail}"))
}

fn dtype(op: &str, name: &str) -> PyResult<IndexKDtype> {
    match name {
        "fp8" => Ok(IndexKDtype::Fp8),
        "bf16" => Ok(IndexKDtype::Bf16),
        other => Err(err(
            op,
            format!("dtype {other:?} is not \"fp8\" or \"bf16\""),
        )),
    }
}

/// Every array on one device; answers it.
fn one_device(op: &str, arrs: &[&Arr]) -> PyResult<Device> {
    let first = arrs[0].device;
    for a in arrs {
        if a.device != first {
            return Err(err(op, format!(
                "`{}` is on {:?} but `{}` is on {:?}; every array of one call must be on one device",
                a.name, a.device, arrs[0].name, first
            )));
        }
    }
    Ok(first)
}

/// `out`, the array an op writes, shares no byte with any array it reads.
fn apart(op: &str, out: &Arr, inputs: &[&Arr]) -> PyResult<()> {
    if let Some(a) = inputs.iter().find(|a| out.overlaps(a)) {
        return Err(err(
            op,
            format!(
            "`{}` shares memory with `{}`; the array an op writes must be apart from what it reads",
            out.name, a.name
        ),
        ));
    }
    Ok(())
}

/// The index-K cache: blocks of exactly one page of `dtype`'s format each (the sglang#37534
/// class, a bf16 cache behind an fp8 layout, is refused here); answers its pages.
fn index_k_cache(op: &str, cache: &Arr, dtype: IndexKDtype) -> PyResult<u64> {
    let page = PageFormat::IndexK(dtype).page_bytes();
    if cache.shape.is_empty() || cache.row_bytes() != page {
        return Err(err(op, format!(
            "`kv_cache` of shape {:?} has blocks of {} bytes, but a {dtype:?} index-K page is {page} \
             bytes ({PAGE_TOKENS} tokens): a cache of another dtype or layout",
            cache.shape,
            if cache.shape.is_empty() { 0 } else { cache.row_bytes() }
        )));
    }
    Ok(cache.shape[0] as u64)
}

#[cfg(feature = "cuda")]
fn dev(a: &Arr) -> tierkv_kernels::cuda::launch::DevPtr {
    tierkv_kernels::cuda::launch::DevPtr {
        ptr: a.ptr,
        bytes: tierkv_kernels::layout::Bytes(a.bytes()),
    }
}

#[cfg(not(feature = "cuda"))]
fn no_cuda(op: &str) -> PyErr {
    err(
        op,
        "this build of tierkv has no CUDA backend (tierkv.BACKENDS); pass host arrays or \
             install a build with feature `cuda`",
    )
}

/// `index_k_store`: each token's raw index key (`keys`, bf16 `[n][128]`) through LayerNorm
/// (`gamma`, `beta`, f32 `[128]`), RoPE (`rope`, f32 `[n][64]`: 32 cosines, 32 sines), the
/// Hadamard transform and fp8 (with its scale) or bf16, into slot `slot_mapping[i]` (int32
/// `[n]`; -1 skips the token) of `kv_cache` (blocks of one index-K page each).
#[pyfunction]
#[pyo3(signature = (keys, kv_cache, slot_mapping, gamma, beta, rope, dtype = "fp8", ue8m0 = false, stream = 0))]
#[allow(clippy::too_many_arguments)]
pub fn ops_index_k_store(
    keys: &Bound<'_, PyAny>,
    kv_cache: &Bound<'_, PyAny>,
    slot_mapping: &Bound<'_, PyAny>,
    gamma: &Bound<'_, PyAny>,
    beta: &Bound<'_, PyAny>,
    rope: &Bound<'_, PyAny>,
    dtype: &str,
    ue8m0: bool,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "index_k_store";
    let dt = self::dtype(OP, dtype)?;
    let keys = Arr::read(OP, "keys", keys, Elem::Bf16)?;
    let cache = Arr::read(OP, "kv_cache", kv_cache, Elem::Any)?;
    let slots = Arr::read(OP, "slot_mapping", slot_mapping, Elem::I32)?;
    let gamma = Arr::read(OP, "gamma", gamma, Elem::F32)?;
    let beta = Arr::read(OP, "beta", beta, Elem::F32)?;
    let rope = Arr::read(OP, "rope", rope, Elem::F32)?;
    let n = keys.dims(OP, 2)?[0];
    keys.expect_shape(OP, &[n, INDEX_HEAD_DIM as usize])?;
    slots.expect_shape(OP, &[n])?;
    gamma.expect_shape(OP, &[INDEX_HEAD_DIM as usize])?;
    beta.expect_shape(OP, &[INDEX_HEAD_DIM as usize])?;
    rope.expect_shape(OP, &[n, ROPE_DIM as usize])?;
    let pages = index_k_cache(OP, &cache, dt)?;
    apart(OP, &cache, &[&keys, &slots, &gamma, &beta, &rope])?;
    let a = StoreArgs {
        dt,
        ue8m0,
        keys,
        cache,
        slots,
        gamma,
        beta,
        rope,
        pages,
        n,
    };
    match one_device(
        OP,
        &[&a.keys, &a.cache, &a.slots, &a.gamma, &a.beta, &a.rope],
    )? {
        Device::Cpu => store_cpu(&a),
        Device::Cuda(ordinal) => store_cuda(&a, ordinal, stream),
    }
}

struct StoreArgs<'py> {
    dt: IndexKDtype,
    ue8m0: bool,
    keys: Arr<'py>,
    cache: Arr<'py>,
    slots: Arr<'py>,
    gamma: Arr<'py>,
    beta: Arr<'py>,
    rope: Arr<'py>,
    pages: u64,
    n: usize,
}

fn store_cpu(a: &StoreArgs) -> PyResult<()> {
    const OP: &str = "index_k_store";
    // SAFETY: host arrays, read under the GIL; the cache is the only one written, and it shares
    // no byte with the others (`apart`).
    let (keys, slots, gamma, beta, rope, dst) = unsafe {
        (
            a.keys.host::<half::bf16>(),
            a.slots.host::<i32>(),
            a.gamma.host::<f32>(),
            a.beta.host::<f32>(),
            a.rope.host::<f32>(),
            a.cache.host_bytes_mut(),
        )
    };
    let slots_max = a.pages * PAGE_TOKENS as u64;
    if let Some((i, s)) = slots
        .iter()
        .enumerate()
        .find(|(_, &s)| s != -1 && (s < 0 || s as u64 >= slots_max))
    {
        return Err(err(OP, format!(
            "slot {s} of token {i} is outside the pool's {slots_max} slots (and not -1); nothing was stored"
        )));
    }
    let keep: Vec<usize> = (0..a.n).filter(|&i| slots[i] != -1).collect();
    let (d, r) = (INDEX_HEAD_DIM as usize, ROPE_DIM as usize);
    let kept_keys: Vec<half::bf16> = keep
        .iter()
        .flat_map(|&i| keys[i * d..(i + 1) * d].iter().copied())
        .collect();
    let kept_rope: Vec<f32> = keep
        .iter()
        .flat_map(|&i| rope[i * r..(i + 1) * r].iter().copied())
        .collect();
    let kept_slots: Vec<i32> = keep.iter().map(|&i| slots[i]).collect();
    let record = args::IndexKStore {
        dtype: a.dt,
        ue8m0: a.ue8m0,
        slots: kept_slots.into(),
    };
    let x = cpu::store::IndexKStoreInputs {
        keys: &kept_keys,
        gamma,
        beta,
        rope: &kept_rope,
    };
    cpu::store::index_k_store(&record, &x, dst, PageFormat::IndexK(a.dt).fingerprint())
        .map_err(|e| err(OP, e))
}

#[cfg(feature = "cuda")]
fn store_cuda(a: &StoreArgs, ordinal: i32, stream: u64) -> PyResult<()> {
    use tierkv_kernels::cuda::launch::GuardedIndexKStore;
    let launch = GuardedIndexKStore {
        dtype: a.dt,
        ue8m0: a.ue8m0,
        keys: dev(&a.keys),
        gamma: dev(&a.gamma),
        beta: dev(&a.beta),
        rope: dev(&a.rope),
        slots: dev(&a.slots),
        n: a.n,
        dst: dev(&a.cache),
        dst_fp: PageFormat::IndexK(a.dt).fingerprint(),
    };
    crate::gpu::run("index_k_store", ordinal, stream, |k, s, g| {
        k.index_k_store_guarded(s, g, &launch)
    })
}

#[cfg(not(feature = "cuda"))]
fn store_cuda(_: &StoreArgs, _: i32, _: u64) -> PyResult<()> {
    Err(no_cuda("index_k_store"))
}

struct LogitsArgs<'py> {
    dt: IndexKDtype,
    heads: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rows: usize,
    q: Arr<'py>,
    cache: Arr<'py>,
    weights: Arr<'py>,
    lens: Arr<'py>,
    table: Arr<'py>,
    out: Arr<'py>,
}

/// `paged_mqa_logits`: `out[r][n]` = sum over heads of `weights[r][h]` x ReLU(`q[r][h]` . key n
/// of row r's context (x its fp8 scale)), for n < `context_lens[r]`, -inf past it; key n lives
/// in block `block_table[r][n / 64]` of `kv_cache`. `q` is fp8 `[rows][heads][128]` (or
/// DeepGEMM's `[batch][1][heads][128]`), `weights` f32 `[rows][heads]`, `out` f32
/// `[rows][out_stride]`. `kernel`: "tensor_core" (wgmma, the default), "mma" or "exact"
/// (bit-exact with the CPU reference).
#[pyfunction]
#[pyo3(signature = (q, kv_cache, weights, context_lens, block_table, out, dtype = "fp8", kernel = "tensor_core", stream = 0))]
#[allow(clippy::too_many_arguments)]
pub fn ops_paged_mqa_logits(
    q: &Bound<'_, PyAny>,
    kv_cache: &Bound<'_, PyAny>,
    weights: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
    block_table: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    dtype: &str,
    kernel: &str,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "paged_mqa_logits";
    let dt = self::dtype(OP, dtype)?;
    let q = Arr::read(OP, "q", q, Elem::Byte)?;
    let (rows, heads) = match q.shape.as_slice() {
        &[r, h, d] if d == INDEX_HEAD_DIM as usize => (r, h),
        &[b, 1, h, d] if d == INDEX_HEAD_DIM as usize => (b, h),
        &[_, next_n, _, _] if next_n != 1 => {
            return Err(err(OP, format!("`q` has next_n = {next_n}; only next_n = 1 is supported (pass one row per query token)")))
        }
        s => return Err(err(OP, format!("`q` has shape {s:?}, expected [rows, heads, {INDEX_HEAD_DIM}] or [batch, 1, heads, {INDEX_HEAD_DIM}]"))),
    };
    let a = LogitsArgs {
        dt,
        heads,
        rows,
        cache: Arr::read(OP, "kv_cache", kv_cache, Elem::Any)?,
        weights: Arr::read(OP, "weights", weights, Elem::F32)?,
        lens: Arr::read(OP, "context_lens", context_lens, Elem::I32)?,
        table: Arr::read(OP, "block_table", block_table, Elem::I32)?,
        out: Arr::read(OP, "out", out, Elem::F32)?,
        q,
    };
    a.weights.expect_shape(OP, &[rows, heads])?;
    a.lens.expect_shape(OP, &[rows])?;
    a.table.dims(OP, 2)?;
    a.out.dims(OP, 2)?;
    a.table.expect_shape(OP, &[rows, a.table.shape[1]])?;
    a.out.expect_shape(OP, &[rows, a.out.shape[1]])?;
    index_k_cache(OP, &a.cache, dt)?;
    apart(OP, &a.out, &[&a.q, &a.cache, &a.weights, &a.lens, &a.table])?;
    if heads == 0 || heads > INDEX_HEADS_MAX as usize {
        return Err(err(
            OP,
            format!("`q` has {heads} heads, outside 1..={INDEX_HEADS_MAX}"),
        ));
    }
    if !["tensor_core", "mma", "exact"].contains(&kernel) {
        return Err(err(
            OP,
            format!("kernel {kernel:?} is not \"tensor_core\", \"mma\" or \"exact\""),
        ));
    }
    match one_device(OP, &[&a.q, &a.cache, &a.weights, &a.lens, &a.table, &a.out])? {
        Device::Cpu => logits_cpu(&a),
        Device::Cuda(ordinal) => logits_cuda(&a, kernel, ordinal, stream),
    }
}

fn logits_cpu(a: &LogitsArgs) -> PyResult<()> {
    const OP: &str = "paged_mqa_logits";
    // SAFETY: host arrays, read under the GIL; `out` is the only one written, and it shares no
    // byte with the others (`apart`).
    let (q, w, pt, lens, out, k) = unsafe {
        (
            a.q.host::<u8>(),
            a.weights.host::<f32>(),
            a.table.host::<i32>(),
            a.lens.host::<i32>(),
            a.out.host_mut::<f32>(),
            a.cache.host_bytes(),
        )
    };
    let (pts, out_stride) = (a.table.shape[1], a.out.shape[1]);
    let len_max = out_stride.min(pts * PAGE_TOKENS as usize);
    rows_in_range(OP, lens, pt, pts, len_max, Some(a.cache.shape[0] as u64))?;
    let record = args::IndexLogits {
        dtype: a.dt,
        heads: a.heads as u32,
        page_table: pt.into(),
        pt_stride: dim_u32(OP, "block_table", pts)?,
        context_lens: lens.into(),
        out_stride: dim_u32(OP, "out", out_stride)?,
    };
    let fp = PageFormat::IndexK(a.dt).fingerprint();
    cpu::logits::index_logits(&record, q, w, k, fp, out).map_err(|e| err(OP, e))
}

#[cfg(feature = "cuda")]
fn logits_cuda(a: &LogitsArgs, kernel: &str, ordinal: i32, stream: u64) -> PyResult<()> {
    use tierkv_kernels::cuda::launch::{GuardedIndexLogits, LogitsKernel, LogitsTuning};
    const OP: &str = "paged_mqa_logits";
    let kind = match kernel {
        "tensor_core" => LogitsKernel::TensorCore,
        "mma" => LogitsKernel::Mma,
        "exact" => LogitsKernel::Exact,
        other => {
            return Err(err(
                OP,
                format!("kernel {other:?} is not \"tensor_core\", \"mma\" or \"exact\""),
            ))
        }
    };
    let launch = GuardedIndexLogits {
        dtype: a.dt,
        heads: a.heads as u32,
        rows: a.rows,
        q: dev(&a.q),
        w: dev(&a.weights),
        page_table: dev(&a.table),
        pt_stride: dim_u32(OP, "block_table", a.table.shape[1])?,
        context_lens: dev(&a.lens),
        k: dev(&a.cache),
        k_fp: PageFormat::IndexK(a.dt).fingerprint(),
        out: dev(&a.out),
        out_stride: dim_u32(OP, "out", a.out.shape[1])?,
    };
    crate::gpu::run(OP, ordinal, stream, |k, s, g| {
        k.index_logits_guarded(kind, LogitsTuning::default(), s, g, &launch)
    })
}

#[cfg(not(feature = "cuda"))]
fn logits_cuda(_: &LogitsArgs, _: &str, _: i32, _: u64) -> PyResult<()> {
    Err(no_cuda("paged_mqa_logits"))
}

/// `topk`: each row's `k = out.shape[1]` largest logits among its first `context_lens[r]`
/// (ties to the lower position), as positions, or as slots through `block_table` (slot =
/// `block_table[r][n / 64] * 64 + n % 64`), best first (a larger logit first, equal logits by
/// lower position), -1 past the selection.
#[pyfunction]
#[pyo3(signature = (logits, context_lens, out, block_table = None, stream = 0))]
pub fn ops_topk(
    logits: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    block_table: Option<&Bound<'_, PyAny>>,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "topk";
    let logits = Arr::read(OP, "logits", logits, Elem::F32)?;
    let lens = Arr::read(OP, "context_lens", context_lens, Elem::I32)?;
    let out = Arr::read(OP, "out", out, Elem::I32)?;
    let table = block_table
        .map(|t| Arr::read(OP, "block_table", t, Elem::I32))
        .transpose()?;
    let (rows, stride) = (logits.dims(OP, 2)?[0], logits.shape[1]);
    lens.expect_shape(OP, &[rows])?;
    let k = out.dims(OP, 2)?[1];
    out.expect_shape(OP, &[rows, k])?;
    if let Some(t) = &table {
        t.dims(OP, 2)?;
        t.expect_shape(OP, &[rows, t.shape[1]])?;
    }
    let mut all = vec![&logits, &lens, &out];
    all.extend(table.as_ref());
    apart(OP, &out, &all[..2])?;
    if let Some(t) = &table {
        apart(OP, &out, &[t])?;
    }
    let a = TopKArgs {
        rows,
        stride,
        k,
        logits: &logits,
        lens: &lens,
        out: &out,
        table: table.as_ref(),
    };
    match one_device(OP, &all)? {
        Device::Cpu => topk_cpu(&a),
        Device::Cuda(ordinal) => topk_cuda(&a, ordinal, stream),
    }
}

struct TopKArgs<'a, 'py> {
    rows: usize,
    stride: usize,
    k: usize,
    logits: &'a Arr<'py>,
    lens: &'a Arr<'py>,
    out: &'a Arr<'py>,
    table: Option<&'a Arr<'py>>,
}

fn topk_cpu(a: &TopKArgs) -> PyResult<()> {
    const OP: &str = "topk";
    // SAFETY: host arrays, read under the GIL; `out` is the only one written, and it shares no
    // byte with the others (`apart`).
    let (logits, lens, out) = unsafe {
        (
            a.logits.host::<f32>(),
            a.lens.host::<i32>(),
            a.out.host_mut::<i32>(),
        )
    };
    let identity: Vec<i32>;
    let (table, pt_stride) = match a.table {
        // SAFETY: as above.
        Some(t) => {
            let (table, pts) = (unsafe { t.host::<i32>() }, t.shape[1]);
            topk_table_in_range(table, pts, lens, a.stride)?;
            (table, pts)
        }
        None => {
            let pages = a.stride.div_ceil(PAGE_TOKENS as usize);
            identity = (0..a.rows).flat_map(|_| 0..pages as i32).collect();
            (identity.as_slice(), pages)
        }
    };
    rows_in_range(
        OP,
        lens,
        table,
        pt_stride,
        a.stride.min(pt_stride * PAGE_TOKENS as usize),
        None,
    )?;
    let record = args::TopK {
        k: dim_u32(OP, "out", a.k)?,
        stride: dim_u32(OP, "logits", a.stride)?,
        context_lens: lens.into(),
        page_table: table.into(),
        pt_stride: dim_u32(OP, "block_table", pt_stride)?,
    };
    cpu::topk::topk(&record, logits, out).map_err(|e| err(OP, e))
}

/// Every row's context length within `0..=len_max` and, where `pages` is given, every block of
/// it in `0..pages`: the host half of `guard_rows`, with messages naming the argument.
fn rows_in_range(
    op: &str,
    lens: &[i32],
    table: &[i32],
    pts: usize,
    len_max: usize,
    pages: Option<u64>,
) -> PyResult<()> {
    for (r, &len) in lens.iter().enumerate() {
        if len < 0 || len as usize > len_max {
            return Err(err(
                op,
                format!(
                    "`context_lens` row {r} is {len}, outside 0..={len_max}; nothing was written"
                ),
            ));
        }
        let used = (len as usize).div_ceil(PAGE_TOKENS as usize);
        let Some(pages) = pages else { continue };
        if let Some(&p) = table[r * pts..r * pts + used]
            .iter()
            .find(|&&p| p < 0 || p as u64 >= pages)
        {
            return Err(err(op, format!(
                "`block_table` row {r} names block {p}, outside the cache's {pages} blocks; nothing was written"
            )));
        }
    }
    Ok(())
}

/// Every block-table entry a row's context uses maps its positions to slots that are int32 and
/// not negative: `0..=TOPK_TABLE_PAGE_MAX` (the GPU's guard refuses the same entries).
fn topk_table_in_range(table: &[i32], pts: usize, lens: &[i32], stride: usize) -> PyResult<()> {
    let cap = stride.min(pts * PAGE_TOKENS as usize);
    for (r, &len) in lens.iter().enumerate() {
        if len < 0 || len as usize > cap {
            continue; // cpu::topk refuses the length itself
        }
        let used = (len as usize).div_ceil(PAGE_TOKENS as usize);
        if let Some(&p) = table[r * pts..r * pts + used]
            .iter()
            .find(|&&p| p < 0 || p as u64 > TOPK_TABLE_PAGE_MAX)
        {
            return Err(err("topk", format!(
                "`block_table` row {r} names page {p}, outside 0..={TOPK_TABLE_PAGE_MAX} (its slots would not be int32)"
            )));
        }
    }
    Ok(())
}

/// The largest page a top-k's block table may name: its slots (`page * 64 + offset`) are int32.
pub const TOPK_TABLE_PAGE_MAX: u64 = (i32::MAX as u64 + 1) / PAGE_TOKENS as u64 - 1;

#[cfg(feature = "cuda")]
fn topk_cuda(a: &TopKArgs, ordinal: i32, stream: u64) -> PyResult<()> {
    use tierkv_kernels::cuda::launch::GuardedTopK;
    const OP: &str = "topk";
    let page_table = match a.table {
        Some(t) => Some((dev(t), dim_u32(OP, "block_table", t.shape[1])?)),
        None => None,
    };
    let launch = GuardedTopK {
        k: dim_u32(OP, "out", a.k)?,
        rows: a.rows,
        logits: dev(a.logits),
        stride: dim_u32(OP, "logits", a.stride)?,
        context_lens: dev(a.lens),
        page_table,
        out: dev(a.out),
    };
    crate::gpu::run("topk", ordinal, stream, |k, s, g| {
        k.topk_guarded(s, g, &launch)
    })
}

#[cfg(not(feature = "cuda"))]
fn topk_cuda(_: &TopKArgs, _: i32, _: u64) -> PyResult<()> {
    Err(no_cuda("topk"))
}

/// `copy_pages`: block `src_pages[i]` of `src` to block `dst_pages[i]` of `dst` (int32 `[n]`
/// each), whole blocks of equal bytes: a gather (`dst_pages` = 0..n), a scatter (`src_pages` =
/// 0..n) or both. Pairs run in order on the host; on the GPU they run at once, so a block both
/// written and read by one call is undefined there.
#[pyfunction]
#[pyo3(signature = (src, dst, src_pages, dst_pages, stream = 0))]
pub fn ops_copy_pages(
    src: &Bound<'_, PyAny>,
    dst: &Bound<'_, PyAny>,
    src_pages: &Bound<'_, PyAny>,
    dst_pages: &Bound<'_, PyAny>,
    stream: u64,
) -> PyResult<()> {
    const OP: &str = "copy_pages";
    let src = Arr::read(OP, "src", src, Elem::Any)?;
    let dst = Arr::read(OP, "dst", dst, Elem::Any)?;
    let sp = Arr::read(OP, "src_pages", src_pages, Elem::I32)?;
    let dp = Arr::read(OP, "dst_pages", dst_pages, Elem::I32)?;
    if src.shape.is_empty() || dst.shape.is_empty() || src.row_bytes() != dst.row_bytes() {
        return Err(err(
            OP,
            format!(
                "`src` {:?} and `dst` {:?} must have blocks (first dimension) of equal bytes",
                src.shape, dst.shape
            ),
        ));
    }
    let n = sp.dims(OP, 1)?[0];
    dp.expect_shape(OP, &[n])?;
    match one_device(OP, &[&src, &dst, &sp, &dp])? {
        Device::Cpu => copy_cpu(&src, &dst, &sp, &dp),
        Device::Cuda(ordinal) => copy_cuda(&src, &dst, &sp, &dp, ordinal, stream),
    }
}

fn copy_cpu(src: &Arr, dst: &Arr, sp: &Arr, dp: &Arr) -> PyResult<()> {
    const OP: &str = "copy_pages";
    // SAFETY: host arrays, read under the GIL.
    let (sp, dp) = unsafe { (sp.host::<i32>(), dp.host::<i32>()) };
    let (sn, dn, pb) = (src.shape[0], dst.shape[0], src.row_bytes() as usize);
    for (i, (&s, &d)) in sp.iter().zip(dp).enumerate() {
        for (what, page, pages) in [("source", s, sn), ("destination", d, dn)] {
            if page < 0 || page as usize >= pages {
                return Err(err(OP, format!(
                    "{what} page {page} of pair {i} is outside its array's {pages} blocks; nothing was copied"
                )));
            }
        }
    }
    for (&s, &d) in sp.iter().zip(dp) {
        // SAFETY: both blocks lie inside their arrays (checked above); `copy` allows the two
        // arrays to be one.
        unsafe {
            std::ptr::copy(
                (src.ptr as *const u8).add(s as usize * pb),
                (dst.ptr as *mut u8).add(d as usize * pb),
                pb,
            )
        };
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn copy_cuda(src: &Arr, dst: &Arr, sp: &Arr, dp: &Arr, ordinal: i32, stream: u64) -> PyResult<()> {
    use tierkv_kernels::cuda::launch::GuardedPageCopy;
    let launch = GuardedPageCopy {
        src: dev(src),
        dst: dev(dst),
        page_bytes: src.row_bytes(),
        src_pages: dev(sp),
        dst_pages: dev(dp),
        n: sp.shape[0],
    };
    crate::gpu::run("copy_pages", ordinal, stream, |k, s, g| {
        k.page_copy_guarded(s, g, &launch)
    })
}

#[cfg(not(feature = "cuda"))]
fn copy_cuda(_: &Arr, _: &Arr, _: &Arr, _: &Arr, _: i32, _: u64) -> PyResult<()> {
    Err(no_cuda("copy_pages"))
}

/// The first index entry a guard kernel refused on CUDA device `device` since the last call,
/// as a message (None: none seen). Synchronise the caller's stream first to see every op's.
#[pyfunction]
pub fn ops_take_refusal(device: i32) -> PyResult<Option<String>> {
    #[cfg(feature = "cuda")]
    return crate::gpu::take(device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Ok(None)
    }
}
