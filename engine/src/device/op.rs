//! The ops a device runs, one type each, and everything an op states about itself: its name, the
//! paged formats it believes its buffers have, the byte ranges it reads and writes, the shape
//! checks that need no buffer, the oracles' row tags and the token rows it writes in full. All of
//! it is computed from the op's arguments alone, here, beside the op ([`OpSpec`]); [`Op`] is the
//! closed set, and [`Op::spec`] is its one dispatch. A backend that runs ops has one dispatch of
//! its own (the CPU references, the CUDA launchers).
//!
//! Small metadata (slots, page tables, context lengths) travels by value; bulk data lives in
//! buffers. Inputs that a model computes on the device (raw keys, queries, head weights, KV rows)
//! are drawn by the device itself from the synthetic model ([`Drawn`]: each row's token and
//! position travel, the values are made where they are used).

use super::{BufferId, BufferRole, DeviceError};
use crate::layout::{
    kv_row, slot_offset, slot_page, u32_count, u64_bytes, Bytes, LayoutFingerprint, PageFormat,
    PageId, PageRun, PagedView, SlotId, PAGE_TOKENS,
};
use std::sync::Arc;
pub use tierkv_kernels::args;
pub use tierkv_kernels::cpu::draw::TokenAt;
pub use tierkv_kernels::rope::Rope;
use tierkv_kernels::KernelError;

/// Model inputs an op's device draws itself (`tierkv_kernels::cpu::draw`, and `draw.cu` on
/// CUDA), as a model computes its keys, queries and KV rows on the device: the rows' tokens and
/// positions, of one global layer of the synthetic model of `seed`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drawn {
    pub seed: u64,
    pub layer: u32,
    /// Shared by the ops of every layer of a step.
    pub rows: Arc<[TokenAt]>,
    /// The tokens buffer that pending rows (`TokenAt::pending`) read their token from: the
    /// previous step's [`NextTokens`]. `None` when every row's token is known.
    pub tokens: Option<Region>,
}

impl Drawn {
    /// Declares the tokens the pending rows read.
    fn accesses(&self, out: &mut Vec<Access>) {
        if let Some(t) = self.tokens {
            read(out, t.range());
        }
    }

    /// Every pending row names an entry inside the tokens region.
    fn check(&self, op: &'static str) -> Result<(), DeviceError> {
        let entries = self.tokens.map_or(0, |t| u32_count(t.bytes));
        for (i, t) in self.rows.iter().enumerate() {
            if let Some(at) = t.pending_index() {
                if at as u64 >= entries {
                    return Err(bad(
                        op,
                        format!("row {i}: pending token {at} outside the {entries} drawn tokens"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Each row's position, in row order.
    pub fn positions(&self) -> Vec<u32> {
        self.rows.iter().map(|t| t.position).collect()
    }
}

/// A byte range of one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub buffer: BufferId,
    pub start: Bytes,
    pub end: Bytes,
}

impl ByteRange {
    /// `len` bytes of `buffer` from `start`. An end past `u64::MAX` is kept at `u64::MAX`,
    /// which no buffer reaches: `check_op` refuses such a region as out of bounds (a typed
    /// error naming the op), where an overflow would panic.
    pub fn new(buffer: BufferId, start: Bytes, len: Bytes) -> ByteRange {
        ByteRange {
            buffer,
            start,
            end: Bytes(start.0.saturating_add(len.0)),
        }
    }
    pub fn len(&self) -> Bytes {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }
    /// As an index range into the buffer's bytes in memory.
    pub fn span(&self) -> std::ops::Range<usize> {
        self.start.usize()..self.end.usize()
    }
}

/// One declared access of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub range: ByteRange,
    pub write: bool,
}

/// What a read or write of a row means for the oracles: which request's context it belongs to.
/// The engine attaches these to ops; devices that do not check content ignore them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowTags {
    /// Global id of the layer the op works on.
    pub layer_global: u32,
    /// One tag per row (query row, or stored token), shared by the ops of every layer of a
    /// step.
    pub rows: Arc<[RowTag]>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTag {
    pub request: u64,
    /// The query position (reads) or the stored token's position (stores).
    pub position: u32,
}

/// A region of a scratch buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub buffer: BufferId,
    pub offset: Bytes,
    pub bytes: Bytes,
}

impl Region {
    pub fn range(&self) -> ByteRange {
        ByteRange::new(self.buffer, self.offset, self.bytes)
    }
}

/// How a device times an op and which faults it may suffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    /// A kernel on the compute units.
    Kernel,
    /// Whole pages between a pool and the host mirror: a transfer that can fail in flight.
    PageCopy,
    /// A linear copy (digests to their pinned readback buffer).
    LinearCopy,
}

/// What every op states about itself, computed from its arguments alone.
pub trait OpSpec {
    /// The kernel or copy name reports use.
    fn name(&self) -> &'static str;
    fn class(&self) -> OpClass {
        OpClass::Kernel
    }
    /// The paged buffers this op touches and the format it believes each has; a device checks
    /// each against the buffer's registered fingerprint before running the op (paired with the
    /// checks the engine made when it built the op).
    fn formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        Vec::new()
    }
    /// Appends the byte ranges this op reads and writes.
    fn accesses(&self, out: &mut Vec<Access>);
    /// Shape checks that need no buffer: metadata lengths agree with each other.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Checks that need the buffers' sizes (`size(buf)`), beyond the declared ranges.
    fn check_buffers(&self, _size: &dyn Fn(BufferId) -> Bytes) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The oracles' view of the rows this op reads or writes.
    fn tags(&self) -> Option<&RowTags> {
        None
    }
    /// The token rows this op writes in full, per paged-buffer page: `(buffer, page, row mask)`
    /// with bit `t` for token row `t`. Whole pages for page copies, one row per slot for stores.
    fn full_rows(&self) -> Vec<(BufferId, u64, u64)> {
        Vec::new()
    }
    /// A short human description for traces and reports; `role` names buffers.
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String;
}

/// `index_k_store` into one layer's index-K pool.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexKStore {
    pub dst: BufferId,
    /// The dtype, the scale format and each token's slot.
    pub args: args::IndexKStore<'static>,
    /// The raw keys of the stored tokens, one row per slot.
    pub keys: Drawn,
    pub gamma: Arc<[f32]>,
    pub beta: Arc<[f32]>,
    /// The model's RoPE frequencies: each stored token is rotated by its position's row (the
    /// CPU device computes it, the CUDA device gathers it from its table of the model's rows).
    pub rope: Rope,
    pub tags: RowTags,
}

/// `kv_store` into one layer's KV pool.
#[derive(Clone, Debug, PartialEq)]
pub struct KvStore {
    pub dst: BufferId,
    /// The dtype and each token's slot.
    pub args: args::KvStore<'static>,
    /// The KV rows of the stored tokens, one per slot.
    pub rows: Drawn,
    pub tags: RowTags,
}

/// `q_prep` of `args.rows` query rows.
#[derive(Clone, Debug, PartialEq)]
pub struct QPrep {
    /// Rows, heads and the scale format (`ue8m0`: each head's fp8 scale rounded up to a power
    /// of two, the model's `scale_fmt = "ue8m0"`).
    pub args: args::QPrep,
    /// The query tokens, one per row: their raw queries (`heads × 128` each) and head weights
    /// are drawn.
    pub inputs: Drawn,
    /// The model's RoPE frequencies, for each query token's position.
    pub rope: Rope,
    pub q_out: Region,
    pub w_out: Region,
}

/// The token each of a step's query rows generates (`cpu::draw::next_tokens`), from the step's
/// digests into the tokens buffer, where the next step's pending rows read it: an engine that
/// runs one step ahead never waits for a token on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct NextTokens {
    /// The seed, the step's layers and rows, and the rows of the digests buffer.
    pub args: args::NextTokens,
    /// The step's whole digests buffer, `[layers][rows_max]` u64.
    pub digests: Region,
    /// One u32 per query row.
    pub out: Region,
    /// Each query row (its request and position): entry `i` is the token after row `i`.
    pub tags: RowTags,
}

impl NextTokens {
    /// Query rows of the step.
    pub fn rows(&self) -> usize {
        self.tags.rows.len()
    }
}

/// `index_logits` over one layer's index-K pool.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexLogits {
    /// The dtype, the heads, each row's page table and context length, the output stride.
    pub args: args::IndexLogits<'static>,
    pub q: Region,
    pub w: Region,
    pub k: BufferId,
    pub out: Region,
    pub tags: RowTags,
}

/// `topk` with the configured `index_topk`.
#[derive(Clone, Debug, PartialEq)]
pub struct TopK {
    /// `k`, the logits' stride, each row's context length and page table.
    pub args: args::TopK<'static>,
    pub logits: Region,
    pub out: Region,
}

/// `sparse_read` of one layer's KV pool through `TopK`'s selection.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseRead {
    /// The dtype, the rows and `k`.
    pub args: args::SparseRead,
    pub slots: Region,
    pub kv: BufferId,
    /// Each row's page table and context length: the rows the selection may name, declared as
    /// this op's read set (the selection itself is device data).
    pub page_table: Arc<[i32]>,
    pub pt_stride: u32,
    pub context_lens: Arc<[i32]>,
    pub out: Region,
    pub tags: RowTags,
}

/// Whole pages between two paged views (device pool ↔ host mirror).
#[derive(Clone, Debug, PartialEq)]
pub struct PageCopy {
    pub src: BufferId,
    pub src_view: PagedView,
    pub dst: BufferId,
    pub dst_view: PagedView,
    pub runs: Vec<PageRun>,
}

/// A linear copy (digests to the pinned readback buffer).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearCopy {
    pub src: Region,
    pub dst: Region,
}

/// Every operation a device runs.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    IndexKStore(IndexKStore),
    KvStore(KvStore),
    QPrep(QPrep),
    IndexLogits(IndexLogits),
    TopK(TopK),
    SparseRead(SparseRead),
    PageCopy(PageCopy),
    Copy(LinearCopy),
    NextTokens(NextTokens),
}

impl Op {
    /// How many kinds of op there are.
    pub const KINDS: usize = 9;

    /// Every op's name, in [`Op::kind`] order (each equal to its `OpSpec::name`: `check_op`
    /// asserts it at every enqueue in debug builds).
    pub const NAMES: [&'static str; Op::KINDS] = [
        "index_k_store",
        "kv_store",
        "q_prep",
        "index_logits",
        "topk",
        "sparse_read",
        "page_copy",
        "copy",
        "next_tokens",
    ];

    /// The op's index in [`Op::NAMES`].
    pub fn kind(&self) -> usize {
        match self {
            Op::IndexKStore(_) => 0,
            Op::KvStore(_) => 1,
            Op::QPrep(_) => 2,
            Op::IndexLogits(_) => 3,
            Op::TopK(_) => 4,
            Op::SparseRead(_) => 5,
            Op::PageCopy(_) => 6,
            Op::Copy(_) => 7,
            Op::NextTokens(_) => 8,
        }
    }

    /// The op's statement about itself: the one dispatch over the op set.
    pub fn spec(&self) -> &dyn OpSpec {
        match self {
            Op::IndexKStore(o) => o,
            Op::KvStore(o) => o,
            Op::QPrep(o) => o,
            Op::IndexLogits(o) => o,
            Op::TopK(o) => o,
            Op::SparseRead(o) => o,
            Op::PageCopy(o) => o,
            Op::Copy(o) => o,
            Op::NextTokens(o) => o,
        }
    }
    pub fn name(&self) -> &'static str {
        self.spec().name()
    }
    /// The byte ranges this op reads and writes, computed from its arguments.
    pub fn accesses(&self) -> Vec<Access> {
        let mut out = Vec::new();
        self.spec().accesses(&mut out);
        out
    }
    pub fn tags(&self) -> Option<&RowTags> {
        self.spec().tags()
    }
    /// Bytes the op moves or touches (reads plus writes), the devices' time model.
    pub fn bytes_touched(&self) -> Bytes {
        self.accesses()
            .iter()
            .fold(Bytes::ZERO, |sum, a| sum + a.range.len())
    }
}

fn read(out: &mut Vec<Access>, range: ByteRange) {
    out.push(Access {
        range,
        write: false,
    });
}

fn write(out: &mut Vec<Access>, range: ByteRange) {
    out.push(Access { range, write: true });
}

fn bad(op: &'static str, detail: String) -> DeviceError {
    DeviceError::Kernel { op, detail }
}

/// Declares page `page` of a paged buffer. Pages of one op are often repeated (many tokens per
/// page): a repeat of the previous access is merged into it.
fn push_page(out: &mut Vec<Access>, buf: BufferId, fmt: PageFormat, page: u32, write: bool) {
    let pb = Bytes(fmt.page_bytes());
    let start = Bytes(page as u64 * pb.0);
    if let Some(last) = out.last() {
        if last.range.buffer == buf && last.write == write && last.range.start == start {
            return;
        }
    }
    out.push(Access {
        range: ByteRange::new(buf, start, pb),
        write,
    });
}

/// The distinct pages the rows' contexts cover, ascending. Negative entries (never valid) are
/// skipped here and refused by the kernel's bounds check when the op runs.
pub fn used_pages(page_table: &[i32], pt_stride: u32, context_lens: &[i32]) -> Vec<u32> {
    let rows = context_lens.iter().enumerate().map(|(r, &len)| {
        let n = (len.max(0) as u32).div_ceil(PAGE_TOKENS) as usize;
        &page_table[r * pt_stride as usize..][..n.min(pt_stride as usize)]
    });
    let (mut count, mut max) = (0usize, None);
    for &p in rows.clone().flatten().filter(|&&p| p >= 0) {
        count += 1;
        max = max.max(Some(p as u32));
    }
    let Some(max) = max else {
        return Vec::new();
    };
    let words = max as usize / 64 + 1;
    if words > count / 2 {
        // Few pages far apart: sorting them costs less than a bitmap up to the largest (the
        // bitmap is used only where it takes no more memory than the sort's list).
        let mut pages: Vec<u32> = rows
            .flatten()
            .filter(|&&p| p >= 0)
            .map(|&p| p as u32)
            .collect();
        pages.sort_unstable();
        pages.dedup();
        return pages;
    }
    // One bit a page up to the largest: ascending and distinct without a sort (the rows of a
    // step share their prefix's pages; the sort was about a fifth of a step's checks in a
    // perf profile of `host_cost` at 4 layers, bench/results/2026-12-06-host-profile.txt).
    let mut bits = vec![0u64; words];
    for &p in rows.flatten().filter(|&&p| p >= 0) {
        bits[p as usize / 64] |= 1 << (p % 64);
    }
    let mut pages = Vec::with_capacity(count.min(max as usize + 1));
    for (w, &word) in bits.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            pages.push(w as u32 * 64 + word.trailing_zeros());
            word &= word - 1;
        }
    }
    pages
}

/// A kernel's refusal of op `op` (its record's check at enqueue, or the reference or launcher
/// that ran it) as a device error. `DeviceError::Kernel` names the op; the kernel error's own
/// text starts with it too, and is not repeated.
pub(crate) fn kernel_refusal(op: &'static str) -> impl Fn(KernelError) -> DeviceError {
    move |e| {
        let text = e.to_string();
        let detail = text.strip_prefix(op).and_then(|t| t.strip_prefix(": "));
        bad(op, detail.unwrap_or(&text).to_string())
    }
}

/// An op's region holds exactly the bytes its record's operand needs.
fn bind(op: &'static str, operand: args::Operand, r: &Region) -> Result<(), DeviceError> {
    args::bind_exact(op, operand, r.bytes).map_err(kernel_refusal(op))
}

/// One drawn input row per token of the record.
fn drawn_rows(op: &'static str, d: &Drawn, tokens: usize) -> Result<(), DeviceError> {
    if d.rows.len() != tokens {
        return Err(bad(
            op,
            format!("{} drawn rows for {tokens} tokens", d.rows.len()),
        ));
    }
    d.check(op)
}

/// One row per slot: `(buffer, page, bit of the token row)`.
fn slot_rows(dst: BufferId, slots: &[i32]) -> Vec<(BufferId, u64, u64)> {
    slots
        .iter()
        .map(|&s| {
            let s = SlotId(s.max(0) as u32);
            (dst, slot_page(s).0 as u64, 1u64 << slot_offset(s))
        })
        .collect()
}

impl OpSpec for IndexKStore {
    fn name(&self) -> &'static str {
        args::IndexKStore::OP
    }
    fn formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        vec![(self.dst, PageFormat::IndexK(self.args.dtype).fingerprint())]
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        self.keys.accesses(out);
        let fmt = PageFormat::IndexK(self.args.dtype);
        for &s in self.args.slots.iter() {
            // The token's values and (fp8) scale both live in its page: declare the page.
            push_page(
                out,
                self.dst,
                fmt,
                slot_page(SlotId(s.max(0) as u32)).0,
                true,
            );
        }
    }
    /// The record, and one drawn key row per slot.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        drawn_rows(op, &self.keys, self.args.tokens())
    }
    fn tags(&self) -> Option<&RowTags> {
        Some(&self.tags)
    }
    fn full_rows(&self) -> Vec<(BufferId, u64, u64)> {
        slot_rows(self.dst, &self.args.slots)
    }
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!("{} tokens into {}", self.args.tokens(), role(self.dst))
    }
}

impl OpSpec for KvStore {
    fn name(&self) -> &'static str {
        args::KvStore::OP
    }
    fn formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        vec![(self.dst, PageFormat::Kv(self.args.dtype).fingerprint())]
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        self.rows.accesses(out);
        let dtype = self.args.dtype;
        let tb = Bytes(PageFormat::Kv(dtype).token_bytes());
        for &s in self.args.slots.iter() {
            let at = Bytes(kv_row::slot_offset(dtype, s.max(0) as u32) as u64);
            write(out, ByteRange::new(self.dst, at, tb));
        }
    }
    /// The record, and one drawn KV row per slot.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        drawn_rows(op, &self.rows, self.args.tokens())
    }
    fn tags(&self) -> Option<&RowTags> {
        Some(&self.tags)
    }
    fn full_rows(&self) -> Vec<(BufferId, u64, u64)> {
        slot_rows(self.dst, &self.args.slots)
    }
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!("{} tokens into {}", self.args.tokens(), role(self.dst))
    }
}

impl QPrep {
    /// Query rows of the launch.
    pub fn rows(&self) -> usize {
        self.args.rows as usize
    }
}

impl OpSpec for QPrep {
    fn name(&self) -> &'static str {
        args::QPrep::OP
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        self.inputs.accesses(out);
        write(out, self.q_out.range());
        write(out, self.w_out.range());
    }
    /// The record, one drawn input row per query row, and the output regions exactly as large
    /// as the record's outputs.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        drawn_rows(op, &self.inputs, self.rows())?;
        let [_, _, _, q_out, w_out] = self.args.operands();
        bind(op, q_out, &self.q_out)?;
        bind(op, w_out, &self.w_out)
    }
    fn detail(&self, _role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!("{} rows x {} heads", self.rows(), self.args.heads)
    }
}

impl OpSpec for NextTokens {
    fn name(&self) -> &'static str {
        args::NextTokens::OP
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        let a = &self.args;
        for l in 0..a.layers as u64 {
            // Saturating, as `ByteRange::new`: a start past `u64::MAX` is out of bounds for
            // `check_op` to refuse, not an overflow.
            let rows_at = (l * a.rows_max as u64).saturating_mul(8);
            let at = Bytes(self.digests.offset.0.saturating_add(rows_at));
            read(
                out,
                ByteRange::new(self.digests.buffer, at, u64_bytes(a.rows as u64)),
            );
        }
        write(out, self.out.range());
    }
    /// The record, one tag per row, and the regions exactly as large as the record's operands.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        if self.rows() != self.args.rows as usize {
            return Err(bad(
                op,
                format!("{} row tags for {} rows", self.rows(), self.args.rows),
            ));
        }
        let [digests, out] = self.args.operands();
        bind(op, digests, &self.digests)?;
        bind(op, out, &self.out)
    }
    fn tags(&self) -> Option<&RowTags> {
        Some(&self.tags)
    }
    fn detail(&self, _role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!("{} rows x {} layers", self.args.rows, self.args.layers)
    }
}

impl OpSpec for IndexLogits {
    fn name(&self) -> &'static str {
        args::IndexLogits::OP
    }
    fn formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        vec![(self.k, PageFormat::IndexK(self.args.dtype).fingerprint())]
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        read(out, self.q.range());
        read(out, self.w.range());
        let fmt = PageFormat::IndexK(self.args.dtype);
        let a = &self.args;
        for page in used_pages(&a.page_table, a.pt_stride, &a.context_lens) {
            push_page(out, self.k, fmt, page, false);
        }
        write(out, self.out.range());
    }
    /// The record, and the query, weight and logits regions exactly as large as its operands.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        let [q, w, _, _, out] = self.args.operands();
        bind(op, q, &self.q)?;
        bind(op, w, &self.w)?;
        bind(op, out, &self.out)
    }
    fn tags(&self) -> Option<&RowTags> {
        Some(&self.tags)
    }
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!("{} rows over {}", self.args.rows(), role(self.k))
    }
}

impl OpSpec for TopK {
    fn name(&self) -> &'static str {
        args::TopK::OP
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        read(out, self.logits.range());
        write(out, self.out.range());
    }
    /// The record (its `k` included), and the logits and selection regions exactly as large as
    /// its operands: an op whose `k` and selection disagree would write past its selection or
    /// leave part of it stale.
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        let [logits, _, _, out] = self.args.operands();
        bind(op, logits, &self.logits)?;
        bind(op, out, &self.out)
    }
    fn detail(&self, _role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!("{} rows, k = {}", self.args.rows(), self.args.k)
    }
}

impl OpSpec for SparseRead {
    fn name(&self) -> &'static str {
        args::SparseRead::OP
    }
    fn formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        vec![(self.kv, PageFormat::Kv(self.args.dtype).fingerprint())]
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        read(out, self.slots.range());
        let fmt = PageFormat::Kv(self.args.dtype);
        for page in used_pages(&self.page_table, self.pt_stride, &self.context_lens) {
            push_page(out, self.kv, fmt, page, false);
        }
        write(out, self.out.range());
    }
    /// The record, its regions exactly as large as its operands, and the declared rows: one
    /// page table and context length per row, every context within its table (the kernel never
    /// sees these; they bound the pages the selection may name).
    fn check_shapes(&self) -> Result<(), DeviceError> {
        let op = self.name();
        self.args.check().map_err(kernel_refusal(op))?;
        let [slots, out] = self.args.operands();
        bind(op, slots, &self.slots)?;
        bind(op, out, &self.out)?;
        let rows = self.context_lens.len();
        if rows != self.args.rows as usize {
            return Err(bad(
                op,
                format!(
                    "{rows} declared context lengths for {} rows",
                    self.args.rows
                ),
            ));
        }
        let table = self.pt_stride.saturating_mul(PAGE_TOKENS);
        args::check_rows(
            op,
            &self.page_table,
            self.pt_stride,
            &self.context_lens,
            table,
        )
        .map_err(kernel_refusal(op))
    }
    fn tags(&self) -> Option<&RowTags> {
        Some(&self.tags)
    }
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!(
            "{} rows x top-{} of {}",
            self.args.rows,
            self.args.k,
            role(self.kv)
        )
    }
}

impl PageCopy {
    /// Pages moved.
    pub fn pages(&self) -> u64 {
        self.runs.iter().map(|r| r.count as u64).sum()
    }
    /// Every page of every run: (source page, destination page).
    fn pairs(&self) -> impl Iterator<Item = (PageId, PageId)> + '_ {
        self.runs
            .iter()
            .flat_map(|r| (0..r.count).map(move |j| (PageId(r.src.0 + j), PageId(r.dst.0 + j))))
    }
}

impl OpSpec for PageCopy {
    fn name(&self) -> &'static str {
        "page_copy"
    }
    fn class(&self) -> OpClass {
        OpClass::PageCopy
    }
    fn formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        vec![
            (self.src, self.src_view.fingerprint),
            (self.dst, self.dst_view.fingerprint),
        ]
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        for (s, d) in self.pairs() {
            let s = self.src_view.page_range(s);
            let d = self.dst_view.page_range(d);
            read(
                out,
                ByteRange {
                    buffer: self.src,
                    start: Bytes(s.start),
                    end: Bytes(s.end),
                },
            );
            write(
                out,
                ByteRange {
                    buffer: self.dst,
                    start: Bytes(d.start),
                    end: Bytes(d.end),
                },
            );
        }
    }
    fn check_buffers(&self, size: &dyn Fn(BufferId) -> Bytes) -> Result<(), DeviceError> {
        tierkv_kernels::cpu::check_page_copy(
            &self.src_view,
            size(self.src).0,
            &self.dst_view,
            size(self.dst).0,
            &self.runs,
        )
        .map_err(|e| bad(self.name(), e.to_string()))
    }
    fn full_rows(&self) -> Vec<(BufferId, u64, u64)> {
        let pb = self.dst_view.page_bytes();
        self.pairs()
            .map(|(_, d)| (self.dst, self.dst_view.page_range(d).start / pb, u64::MAX))
            .collect()
    }
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String {
        let first = self
            .runs
            .first()
            .map(|r| format!(" (first run {}→{} x{})", r.src, r.dst, r.count))
            .unwrap_or_default();
        format!(
            "{} → {}: {} pages in {} runs{first}",
            role(self.src),
            role(self.dst),
            self.pages(),
            self.runs.len()
        )
    }
}

impl OpSpec for LinearCopy {
    fn name(&self) -> &'static str {
        "copy"
    }
    fn class(&self) -> OpClass {
        OpClass::LinearCopy
    }
    fn accesses(&self, out: &mut Vec<Access>) {
        read(out, self.src.range());
        write(out, self.dst.range());
    }
    fn check_shapes(&self) -> Result<(), DeviceError> {
        if self.src.bytes != self.dst.bytes {
            return Err(bad(
                self.name(),
                format!("{} B from a {} B region", self.dst.bytes, self.src.bytes),
            ));
        }
        Ok(())
    }
    fn detail(&self, role: &dyn Fn(BufferId) -> BufferRole) -> String {
        format!(
            "{} → {} ({} B)",
            role(self.src.buffer),
            role(self.dst.buffer),
            self.src.bytes
        )
    }
}

#[cfg(test)]
mod tests;
