//! Guarded launches: the kernels on index arrays that stay on the device.
//!
//! The checked launchers walk a host copy of every slot, page-table entry and context length
//! before they launch. A caller whose index arrays live only on the GPU (a torch op: vLLM's slot
//! mapping, DeepGEMM-style block tables) would have to copy them back and synchronise its stream
//! for that. A guarded launch instead checks on the host everything the host knows (sizes,
//! dtypes, alignment, the pool's format) and runs a guard kernel (`guard.cu`) on the launch's
//! stream before the work kernel: it writes a copy of the index array in which every entry the
//! work kernel must not follow is replaced by one the kernel skips (a slot or page pair of -1, a
//! row's length of 0), and records the first replaced entry in a [`GuardStatus`] (mapped pinned
//! host memory). A top-k over positions has no guard kernel: its only index array is the rows'
//! lengths, which the top-k kernel itself checks (given the status record) before it reads a
//! row. No kernel reads or writes outside its buffers, whatever the arrays hold (as long as
//! nothing writes them while the launch runs: top-k's kernel reads a row's length in every
//! thread, where a guard kernel reads each entry once); the
//! refusal reaches the host later, when it reads the status ([`GuardStatus::take`]), the way a
//! CUDA launch's asynchronous error does.
//!
//! The guard kernels' output arrays belong to the [`GuardStatus`] and are reused by every launch
//! on its one stream: each launch's work kernel reads them before the next launch's guard
//! kernel writes them (stream order). A larger one replaces them; the old is kept as long as the
//! status lives (for the Python module's static status, the process), because a CUDA graph
//! captured over earlier launches still names it. An array never grows while its stream is
//! being captured ([`crate::KernelError::GrowsInCapture`]): that would put an allocation into
//! the caller's graph.

use super::{aligned, bad, cuda, need, CheckedIndexLogits, IndexKStorePtrs, IndexLogitsPtrs};
use super::{i32_bytes, DevPtr, Kernels, LogitsKernel, LogitsTuning};
use crate::args;
use crate::cuda::{
    topk_cluster, GuardRefusal, TOPK_BUCKET_WORDS, TOPK_KERNELS, TOPK_STAGED_MAX, TOPK_THREADS,
};
use crate::error::Result;
use crate::layout::{IndexKDtype, LayoutFingerprint, PAGE_TOKENS};
use cudarc::driver::sys::{CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE};
use cudarc::driver::PushKernelArg;
use cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use std::sync::Arc;

/// Words of a status record: what, index, value, limit (`guard.cu`).
const STATUS_WORDS: usize = 4;

/// Threads of a guard kernel's block.
const GUARD_THREADS: u32 = 256;

/// Where the guard kernels (and top-k over positions) record the first entry they refused: four words of mapped pinned host
/// memory (`cuMemHostAlloc`, portable and mapped), read by the host without synchronising, and a
/// claim word in device memory (the first reporter's atomic).
///
/// It also holds the guard kernels' output arrays and the positions' page table, reused by every
/// launch: all of them run on the one stream it was made for, so each launch's work kernel has
/// read them before the next launch's guard kernel writes them.
pub struct GuardStatus {
    host: *mut u64,
    device: u64,
    claim: CudaSlice<u64>,
    claim_ptr: u64,
    /// The stream every guarded launch with this status runs on.
    stream: Arc<CudaStream>,
    /// The guard kernels' outputs (a launch uses at most one), grown to a power of two.
    scratch: Option<CudaSlice<i32>>,
    /// `identity[i] = i`: the page table of a top-k over positions, grown to a power of two.
    identity: Option<CudaSlice<i32>>,
    /// The arrays `scratch` and `identity` outgrew, kept until the status is dropped: a CUDA
    /// graph captured over guarded launches holds their addresses, and its replays may come
    /// after a larger launch grew the array. Each growth at least doubles, so these hold less
    /// than the live arrays do.
    retired: Vec<CudaSlice<i32>>,
    /// Keeps the context (and so the allocation) alive.
    _ctx: Arc<CudaContext>,
}

// SAFETY: the record is plain words in pinned memory, read and written with volatile accesses;
// the kernels write it through `device`, the host through `host`.
unsafe impl Send for GuardStatus {}
unsafe impl Sync for GuardStatus {}

/// The first entry a guarded launch refused since the last [`GuardStatus::take`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardFinding {
    pub refusal: GuardRefusal,
    /// The entry's index in its array (a row for a page-table entry or a context length).
    pub index: i64,
    pub value: i64,
    /// The bound it broke: the entry must lie in `0..limit` (`0..=limit` for a context length).
    pub limit: u64,
}

impl std::fmt::Display for GuardFinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, index, value, limit) =
            (self.refusal.entry(), self.index, self.value, self.limit);
        match self.refusal {
            GuardRefusal::ContextLen => write!(
                f,
                "row {index}'s {what} {value} is outside 0..={limit}; the row was left empty"
            ),
            GuardRefusal::Page => write!(
                f,
                "row {index} names page {value}, outside the pool's {limit} pages; the row was \
                 left empty"
            ),
            GuardRefusal::Slot => write!(
                f,
                "{what} {value} of token {index} is outside the pool's {limit} slots (and not \
                 -1); the token was not stored"
            ),
            GuardRefusal::SrcPage | GuardRefusal::DstPage => write!(
                f,
                "{what} {value} of pair {index} is outside its pool's {limit} pages; the pair \
                 was not copied"
            ),
        }
    }
}

/// Refuses to grow `what` while `s` is being captured into a CUDA graph.
fn not_capturing(s: &CudaStream, op: &'static str, what: &'static str) -> Result<()> {
    let mut status = cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a live stream of this context; an out-pointer to a local.
    let r = unsafe { cudarc::driver::sys::cuStreamIsCapturing(s.cu_stream(), &mut status) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(crate::error::KernelError::Cuda {
            op,
            detail: format!("cuStreamIsCapturing: {r:?}"),
        });
    }
    if status == cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        Ok(())
    } else {
        Err(crate::error::KernelError::GrowsInCapture { op, what })
    }
}

impl GuardStatus {
    /// The record, its claim word allocated and cleared on `s` (the stream the guarded launches
    /// and [`GuardStatus::take`] use).
    pub fn new(ctx: &Arc<CudaContext>, s: &Arc<CudaStream>) -> Result<GuardStatus> {
        ctx.bind_to_thread().map_err(cuda("guard status"))?;
        let claim = s
            .alloc_zeros::<u64>(1)
            .map_err(cuda("guard status: claim word"))?;
        let claim_ptr = claim.device_ptr(s).0;
        let bytes = STATUS_WORDS * std::mem::size_of::<u64>();
        // SAFETY: a fresh allocation of `bytes`; zeroed before any kernel can see it.
        let host = unsafe {
            result::malloc_host(bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE)
        }
        .map_err(cuda("guard status: cuMemHostAlloc"))? as *mut u64;
        for i in 0..STATUS_WORDS {
            // SAFETY: inside the allocation.
            unsafe { host.add(i).write_volatile(0) };
        }
        let mut device = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP in this context.
        let got = unsafe {
            cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0)
        };
        if got != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            // SAFETY: allocated just now, not handed out.
            unsafe { result::free_host(host.cast()) }.ok();
            return Err(crate::error::KernelError::Cuda {
                op: "guard status: cuMemHostGetDevicePointer",
                detail: format!("{got:?}"),
            });
        }
        Ok(GuardStatus {
            host,
            device,
            claim,
            claim_ptr,
            stream: s.clone(),
            scratch: None,
            identity: None,
            retired: Vec::new(),
            _ctx: ctx.clone(),
        })
    }

    /// The stream the guarded launches with this status must use.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn on_its_stream(&self, s: &Arc<CudaStream>) {
        assert_eq!(
            s.cu_stream(),
            self.stream.cu_stream(),
            "a guarded launch on another stream than its guard status's"
        );
    }

    /// The guard kernel's output array of at least `n` entries.
    fn buffer(&mut self, op: &'static str, n: usize) -> Result<DevPtr> {
        let s = self.stream.clone();
        if self.scratch.as_ref().is_none_or(|b| b.len() < n.max(1)) {
            not_capturing(&s, op, "guard array")?;
            // The old array is kept (`retired`): a captured graph may still name it.
            self.retired.extend(self.scratch.take());
            // SAFETY: every entry a launch reads is written by its guard kernel first.
            self.scratch =
                Some(unsafe { s.alloc::<i32>(n.max(1).next_power_of_two()) }.map_err(cuda(op))?);
        }
        Ok(dev(self.scratch.as_ref().expect("allocated above"), &s))
    }

    fn word(&self, i: usize) -> u64 {
        assert!(i < STATUS_WORDS);
        // SAFETY: inside the allocation; volatile because the GPU writes it.
        unsafe { self.host.add(i).read_volatile() }
    }

    /// The first refusal recorded since the last call, if one is visible yet, and clears the
    /// record (its claim word on the status's stream, in order after the launches queued
    /// there). Without synchronising, a refusal of work still in flight may show up only at a
    /// later call; after the launch's stream was synchronised it is visible. A refusal by a
    /// launch queued before the clear, after the one recorded, is not recorded (its entry is
    /// still skipped).
    pub fn take(&mut self) -> Result<Option<GuardFinding>> {
        let code = self.word(0);
        if code == 0 {
            return Ok(None);
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let refusal = GuardRefusal::from_code(code)
            .unwrap_or_else(|| panic!("guard status: unknown refusal code {code}"));
        let finding = GuardFinding {
            refusal,
            index: self.word(1) as i64,
            value: self.word(2) as i64,
            limit: self.word(3),
        };
        for i in 0..STATUS_WORDS {
            // SAFETY: inside the allocation. Only the claim's holder writes the record, and the
            // claim stays taken until the memset below runs on the stream.
            unsafe { self.host.add(i).write_volatile(0) };
        }
        let s = self.stream.clone();
        s.memset_zeros(&mut self.claim)
            .map_err(cuda("guard status: clear the claim"))?;
        Ok(Some(finding))
    }
}

impl Drop for GuardStatus {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`; the caller drops the status only after
        // the launches that write it (it lives as long as the ops that hold it).
        unsafe { result::free_host(self.host.cast()) }.ok();
    }
}

/// `lens` holds `rows` aligned `i32` row lengths.
fn context_lens_hold(op: &'static str, lens: DevPtr, rows: usize) -> Result<()> {
    need(op, "context_lens", lens, i32_bytes(rows as u64))?;
    aligned(op, "context_lens", lens, 4)
}

fn blocks(n: usize) -> u32 {
    (n as u32).div_ceil(GUARD_THREADS).max(1)
}

fn dev(slice: &CudaSlice<i32>, s: &Arc<CudaStream>) -> DevPtr {
    let (ptr, _sync) = slice.device_ptr(s);
    DevPtr {
        ptr,
        bytes: i32_bytes(slice.len() as u64),
    }
}

/// An `index_k_store` whose `n` slots (`i32`, on the device) are checked by `guard_slots`: a
/// slot of -1 is a padding token, computed and not stored.
#[derive(Clone, Copy, Debug)]
pub struct GuardedIndexKStore {
    pub dtype: IndexKDtype,
    pub ue8m0: bool,
    pub keys: DevPtr,
    pub gamma: DevPtr,
    pub beta: DevPtr,
    pub rope: DevPtr,
    pub slots: DevPtr,
    pub n: usize,
    pub dst: DevPtr,
    pub dst_fp: LayoutFingerprint,
}

/// An `index_logits` whose page table and context lengths (`i32`, on the device) are checked
/// by `guard_rows`: a refused row is scored as an empty context (every logit -inf).
#[derive(Clone, Copy, Debug)]
pub struct GuardedIndexLogits {
    pub dtype: IndexKDtype,
    pub heads: u32,
    pub rows: usize,
    pub q: DevPtr,
    pub w: DevPtr,
    pub page_table: DevPtr,
    pub pt_stride: u32,
    pub context_lens: DevPtr,
    pub k: DevPtr,
    pub k_fp: LayoutFingerprint,
    pub out: DevPtr,
    pub out_stride: u32,
}

/// A `topk` over `rows` rows whose context lengths (on the device) are checked by `guard_rows`
/// through a page table, and by the top-k kernel itself over positions (a refused row selects
/// nothing: -1 everywhere). `page_table` (with its stride) maps
/// positions to slots as in [`crate::args::TopK`]; `None` selects positions (an identity table,
/// made on the device).
#[derive(Clone, Copy, Debug)]
pub struct GuardedTopK {
    pub k: u32,
    pub rows: usize,
    pub logits: DevPtr,
    pub stride: u32,
    pub context_lens: DevPtr,
    pub page_table: Option<(DevPtr, u32)>,
    pub out: DevPtr,
}

/// A guarded top-k's page table (the caller's, or the shared identity row at a stride of 0),
/// the lengths its kernel reads, the longest length it may take, and the status record it
/// reports a bad length to (`None`: the lengths were checked by `guard_rows`).
struct TopKRows {
    table: DevPtr,
    lens: DevPtr,
    len_max: usize,
    status: Option<(u64, u64)>,
}

/// Whole pages from `src` to `dst` (`page_bytes` each, pages back to back from each pointer):
/// pair `i` copies page `src_pages_dev[i]` to page `dst_pages_dev[i]`, both checked by
/// `guard_pairs` (a refused pair is not copied). Either side may be mapped pinned host memory.
#[derive(Clone, Copy, Debug)]
pub struct GuardedPageCopy {
    pub src: DevPtr,
    pub dst: DevPtr,
    pub page_bytes: u64,
    pub src_pages: DevPtr,
    pub dst_pages: DevPtr,
    pub n: usize,
}

impl Kernels {
    fn guard_launch<'a>(
        &'a self,
        s: &'a Arc<CudaStream>,
        name: &'static str,
        grid: u32,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) -> Result<()> {
        let mut b = s.launch_builder(self.f(name));
        args(&mut b);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (GUARD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the callers checked every buffer the guard kernel reads or writes.
        unsafe { b.launch(cfg) }.map_err(cuda(name))?;
        Ok(())
    }

    /// `index_k_store` of a guarded launch (see the module's doc).
    pub fn index_k_store_guarded(
        &self,
        s: &Arc<CudaStream>,
        g: &mut GuardStatus,
        a: &GuardedIndexKStore,
    ) -> Result<()> {
        const OP: &str = args::IndexKStore::OP;
        let ptrs = IndexKStorePtrs {
            keys: a.keys,
            gamma: a.gamma,
            beta: a.beta,
            rope: a.rope,
            slots: a.slots,
            dst: a.dst,
            dst_fp: a.dst_fp,
        };
        let mut checked = ptrs.bind(a.dtype, a.ue8m0, a.n)?;
        if a.n == 0 {
            return Ok(());
        }
        g.on_its_stream(s);
        let out = g.buffer(OP, a.n)?.ptr;
        let (n32, slots_max) = (a.n as i32, checked.slots_max);
        self.guard_launch(s, "guard_slots", blocks(a.n), |b| {
            b.arg(&a.slots.ptr)
                .arg(&n32)
                .arg(&slots_max)
                .arg(&out)
                .arg(&g.device)
                .arg(&g.claim_ptr);
        })?;
        checked.slots_dev = out;
        self.index_k_store_checked(s, &checked)
    }

    /// `index_logits` of a guarded launch (see the module's doc).
    pub fn index_logits_guarded(
        &self,
        kind: LogitsKernel,
        tuning: LogitsTuning,
        s: &Arc<CudaStream>,
        g: &mut GuardStatus,
        a: &GuardedIndexLogits,
    ) -> Result<()> {
        const OP: &str = args::IndexLogits::OP;
        let ptrs = IndexLogitsPtrs {
            q: a.q,
            w: a.w,
            page_table: a.page_table,
            context_lens: a.context_lens,
            k: a.k,
            k_fp: a.k_fp,
            out: a.out,
        };
        let (mut checked, pages): (CheckedIndexLogits, u64) =
            ptrs.bind(a.dtype, a.heads, a.rows, a.pt_stride, a.out_stride)?;
        if a.rows == 0 || a.out_stride == 0 {
            return Ok(());
        }
        let len_max = (a.out_stride as usize).min(a.pt_stride as usize * PAGE_TOKENS as usize);
        let lens = self.guard_rows(
            s,
            g,
            OP,
            a.rows,
            a.page_table,
            a.pt_stride as usize,
            a.context_lens,
            len_max,
            pages,
        )?;
        checked.lens_dev = lens;
        // SAFETY: `guard_rows` left every row's length within its table and output row, and
        // every page the row uses inside the pool, in the array the kernel reads (in stream
        // order after the guard); the page table itself must not be written meanwhile, which
        // is the caller's contract for any launch on it.
        unsafe { self.index_logits_checked(kind, tuning, s, &checked) }
    }

    #[allow(clippy::too_many_arguments)]
    fn guard_rows(
        &self,
        s: &Arc<CudaStream>,
        g: &mut GuardStatus,
        op: &'static str,
        rows: usize,
        page_table: DevPtr,
        pt_stride: usize,
        lens: DevPtr,
        len_max: usize,
        pages: u64,
    ) -> Result<DevPtr> {
        context_lens_hold(op, lens, rows)?;
        aligned(op, "page_table", page_table, 4)?;
        if rows > i32::MAX as usize || len_max > i32::MAX as usize || pt_stride > i32::MAX as usize
        {
            return Err(bad(op, "rows", "a count above i32::MAX"));
        }
        let clean = g.buffer(op, rows)?;
        let out = clean.ptr;
        let (pts, r32, lm, pg) = (
            pt_stride as i32,
            rows as i32,
            len_max as i32,
            pages.min(u32::MAX as u64) as u32,
        );
        self.guard_launch(s, "guard_rows", rows as u32, |b| {
            b.arg(&page_table.ptr).arg(&pts).arg(&lens.ptr).arg(&r32);
            b.arg(&lm)
                .arg(&pg)
                .arg(&out)
                .arg(&g.device)
                .arg(&g.claim_ptr);
        })?;
        Ok(clean)
    }

    /// `topk` of a guarded launch (see the module's doc), in [`topk_cluster`]'s shape for rows
    /// as long as `stride` (the lengths are on the device).
    pub fn topk_guarded(
        &self,
        s: &Arc<CudaStream>,
        g: &mut GuardStatus,
        a: &GuardedTopK,
    ) -> Result<()> {
        const OP: &str = args::TopK::OP;
        let rows = a.rows;
        args::check_k(OP, a.k)?;
        let pt_stride = a.page_table.map_or(0, |(_, pts)| pts);
        args::check_strides(OP, a.stride, pt_stride)?;
        let [logits, _, pt_need, out] = args::TopK::operands_of(rows, a.k, a.stride, pt_stride);
        args::bind_at_least(OP, logits, a.logits.bytes)?;
        args::bind_at_least(OP, out, a.out.bytes)?;
        let (k, stride) = (a.k as usize, a.stride as usize);
        aligned(OP, "logits", a.logits, 4)?;
        aligned(OP, "out", a.out, 4)?;
        if rows == 0 {
            return Ok(());
        }
        g.on_its_stream(s);
        let rows_in = self.topk_rows(s, g, a, pt_need)?;
        let cluster = topk_cluster(rows, stride, self.sms);
        let Some(&(_, name)) = TOPK_KERNELS.iter().find(|(c, _)| *c == cluster) else {
            unreachable!("topk_cluster answers 1, 2, 4 or 8, not {cluster}")
        };
        if rows as u64 * cluster as u64 > i32::MAX as u64 {
            return Err(bad(OP, "rows", format!("{rows} rows in one launch")));
        }
        let cap = stride.div_ceil(cluster as usize).min(TOPK_STAGED_MAX);
        let (st, k32, pts, cap32) = (stride as i32, k as i32, pt_stride as i32, cap as i32);
        let TopKRows {
            table: pt,
            lens,
            len_max,
            status,
        } = rows_in;
        let len_max32 = len_max as i32;
        let (status_ptr, claim_ptr) = status.unwrap_or((0, 0));
        let lens_ptr = lens.ptr;
        let mut b = s.launch_builder(self.f(name));
        b.arg(&a.logits.ptr).arg(&st).arg(&lens_ptr).arg(&pt.ptr);
        b.arg(&pts).arg(&k32).arg(&a.out.ptr).arg(&cap32);
        b.arg(&len_max32).arg(&status_ptr).arg(&claim_ptr);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32 * cluster, 1, 1),
            block_dim: (TOPK_THREADS, 1, 1),
            shared_mem_bytes: i32_bytes((cap + TOPK_BUCKET_WORDS) as u64).0 as u32,
        };
        // SAFETY: sizes checked above; every row's length is within its logits row and table:
        // checked by `guard_rows` in stream order before this launch, or by the kernel itself
        // (a non-null status) before it reads the row.
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }

    /// What a guarded top-k's kernel reads its rows through. Over positions (the identity
    /// table, which holds no bad page), the caller's lengths and the status record: the kernel
    /// itself takes a row whose length is outside 0..=stride as empty and reports it, with no
    /// guard kernel before it. Through a caller's page table, the lengths `guard_rows` checked
    /// with the table's entries, and no status.
    fn topk_rows(
        &self,
        s: &Arc<CudaStream>,
        g: &mut GuardStatus,
        a: &GuardedTopK,
        pt_need: args::Operand,
    ) -> Result<TopKRows> {
        const OP: &str = args::TopK::OP;
        let stride = a.stride as usize;
        let Some((pt, pts)) = a.page_table else {
            context_lens_hold(OP, a.context_lens, a.rows)?;
            return Ok(TopKRows {
                table: self.positions_table(g, stride)?,
                lens: a.context_lens,
                len_max: stride,
                status: Some((g.device, g.claim_ptr)),
            });
        };
        args::bind_at_least(OP, pt_need, pt.bytes)?;
        let len_max = stride.min(pts as usize * PAGE_TOKENS as usize);
        // A table's entries are only mapped to slots, never dereferenced: any page whose slots
        // are int32 and not negative goes.
        let lens = self.guard_rows(
            s,
            g,
            OP,
            a.rows,
            pt,
            pts as usize,
            a.context_lens,
            len_max,
            (i32::MAX as u64 + 1) / PAGE_TOKENS as u64,
        )?;
        Ok(TopKRows {
            table: pt,
            lens,
            len_max,
            status: None,
        })
    }

    /// The page table of a top-k over positions: one identity row (page i is page i) that
    /// every row shares at a table stride of 0, made on the device.
    /// (Made once, and again only for a longer row.)
    fn positions_table(&self, g: &mut GuardStatus, stride: usize) -> Result<DevPtr> {
        let pages = stride.div_ceil(PAGE_TOKENS as usize).max(1);
        let s = g.stream.clone();
        if g.identity.as_ref().is_none_or(|t| t.len() < pages) {
            not_capturing(&s, "topk", "positions table")?;
            let len = pages.next_power_of_two();
            // A captured graph may still name the old one.
            g.retired.extend(g.identity.take());
            // SAFETY: every entry is written by guard_iota below, before any reader on `s`.
            let table = unsafe { s.alloc::<i32>(len) }.map_err(cuda("topk"))?;
            let (out, n) = (dev(&table, &s).ptr, len as i32);
            self.guard_launch(&s, "guard_iota", blocks(len), |b| {
                b.arg(&out).arg(&n);
            })?;
            g.identity = Some(table);
        }
        Ok(dev(g.identity.as_ref().expect("made above"), &s))
    }

    /// Whole pages of a guarded launch (see the module's doc), one CTA per pair.
    pub fn page_copy_guarded(
        &self,
        s: &Arc<CudaStream>,
        g: &mut GuardStatus,
        a: &GuardedPageCopy,
    ) -> Result<()> {
        const OP: &str = "page_copy";
        let pb = a.page_bytes;
        if pb == 0 || pb % 16 != 0 {
            return Err(bad(
                OP,
                "page_bytes",
                format!("{pb} is not a positive multiple of 16"),
            ));
        }
        for (name, p) in [("src", a.src), ("dst", a.dst)] {
            aligned(OP, name, p, 16)?;
        }
        for (name, p) in [("src_pages", a.src_pages), ("dst_pages", a.dst_pages)] {
            need(OP, name, p, i32_bytes(a.n as u64))?;
            aligned(OP, name, p, 4)?;
        }
        if a.n > i32::MAX as usize / 2 {
            return Err(bad(OP, "pages", format!("{} pairs in one launch", a.n)));
        }
        if a.n == 0 {
            return Ok(());
        }
        let pages = |p: DevPtr| (p.bytes.0 / pb).min(u32::MAX as u64) as u32;
        let (src_pages, dst_pages) = (pages(a.src), pages(a.dst));
        g.on_its_stream(s);
        let (out, n32) = (g.buffer(OP, 2 * a.n)?.ptr, a.n as i32);
        self.guard_launch(s, "guard_pairs", blocks(a.n), |b| {
            b.arg(&a.src_pages.ptr).arg(&a.dst_pages.ptr).arg(&n32);
            b.arg(&src_pages)
                .arg(&dst_pages)
                .arg(&out)
                .arg(&g.device)
                .arg(&g.claim_ptr);
        })?;
        let zero = 0u64;
        let mut b = s.launch_builder(self.f("page_gather"));
        b.arg(&a.src.ptr).arg(&zero).arg(&pb);
        b.arg(&a.dst.ptr).arg(&zero).arg(&pb);
        b.arg(&out).arg(&n32).arg(&pb);
        let cfg = LaunchConfig {
            grid_dim: (a.n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every pair is inside both buffers or (-1, -1), which the kernel skips
        // (`guard_pairs`, in stream order before this launch).
        unsafe { b.launch(cfg) }.map_err(cuda(OP))?;
        Ok(())
    }
}
