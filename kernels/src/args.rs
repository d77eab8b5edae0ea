//! One argument record per kernel op: the scalars and the host-side index arrays (slots, page
//! tables, context lengths) that say what a launch does, and the one [`check`](TopK::check) of
//! the contract between them.
//!
//! The engine's op carries its record, the CPU reference reads it, the CUDA launcher reads it and
//! the simulator reads it: a record never changes shape on its way to a kernel. What differs
//! between backends is only how each names the buffers an op reads and writes (a region of a
//! simulated buffer, a slice in memory, a device address). Each record answers the bytes every
//! such operand must hold ([`TopK::operands`]): the engine's regions must hold exactly that, a
//! slice must be exactly that long, a device allocation at least that large. Each backend binds
//! its operands to those sizes with [`bind_exact`] or [`bind_at_least`]; none restates a size.
//!
//! Index arrays are `Cow` slices: the engine's op owns them, a launch borrows them.

use crate::error::{bad, KernelError, Result};
use crate::layout::{
    bf16_bytes, f32_bytes, fp8_bytes, i32_bytes, u32_bytes, u64_bytes, Bytes, IndexKDtype, KvDtype,
    INDEX_HEADS_MAX, INDEX_HEAD_DIM, INDEX_TOPK_MAX, KV_ROW_VALUES, PAGE_TOKENS, ROPE_DIM,
};
use std::borrow::Cow;

/// An operand's name and the bytes it must hold.
pub type Operand = (&'static str, Bytes);

/// `found` must be exactly `needed` bytes: an op's own region or slice.
pub fn bind_exact(op: &'static str, (name, needed): Operand, found: Bytes) -> Result<()> {
    if found != needed {
        return Err(size_error(op, name, needed, found));
    }
    Ok(())
}

/// `found` must hold at least `needed` bytes: an allocation the op uses the front of.
pub fn bind_at_least(op: &'static str, (name, needed): Operand, found: Bytes) -> Result<()> {
    if found < needed {
        return Err(size_error(op, name, needed, found));
    }
    Ok(())
}

fn size_error(op: &'static str, buffer: &'static str, needed: Bytes, found: Bytes) -> KernelError {
    KernelError::BufferSize {
        op,
        buffer,
        needed: needed.0,
        found: found.0,
    }
}

/// `top-k`'s `k`: the configured `index_topk`, within what the kernels select.
pub fn check_k(op: &'static str, k: u32) -> Result<()> {
    if k == 0 || k > INDEX_TOPK_MAX {
        return Err(bad(op, "k", format!("{k} is outside 1..={INDEX_TOPK_MAX}")));
    }
    Ok(())
}

/// The model's indexer heads, within what the kernels hold.
pub fn check_heads(op: &'static str, heads: u32) -> Result<()> {
    if heads == 0 || heads > INDEX_HEADS_MAX {
        return Err(bad(
            op,
            "heads",
            format!("{heads} is outside 1..={INDEX_HEADS_MAX}"),
        ));
    }
    Ok(())
}

/// A stored KV format: `fp8_unpacked` is a foreign layout tierkv reads but never writes.
fn check_stored(op: &'static str, dtype: KvDtype) -> Result<()> {
    if dtype == KvDtype::Fp8Unpacked {
        return Err(bad(
            op,
            "dtype",
            "fp8_unpacked rows are a foreign format tierkv does not store",
        ));
    }
    Ok(())
}

/// Row strides fit an `i32`, the kernels' index type.
pub fn check_strides(op: &'static str, stride: u32, pt_stride: u32) -> Result<()> {
    if stride > i32::MAX as u32 || pt_stride > i32::MAX as u32 {
        return Err(bad(op, "stride", "a row stride above i32::MAX"));
    }
    Ok(())
}

/// Rows of page tables and context lengths: `rows × pt_stride` entries, and each context within
/// its table and its output row of `stride` positions.
fn check_rows(
    op: &'static str,
    page_table: &[i32],
    pt_stride: u32,
    context_lens: &[i32],
    stride: u32,
) -> Result<()> {
    check_strides(op, stride, pt_stride)?;
    let rows = context_lens.len() as u64;
    if page_table.len() as u64 != rows * pt_stride as u64 {
        return Err(bad(
            op,
            "page_table",
            format!(
                "{} entries, expected {rows} rows x {pt_stride}",
                page_table.len()
            ),
        ));
    }
    let cap = (pt_stride as u64 * PAGE_TOKENS as u64).min(stride as u64);
    for (r, &len) in context_lens.iter().enumerate() {
        if len < 0 || len as u64 > cap {
            return Err(KernelError::OutOfRange {
                op,
                index: r,
                value: len as i64,
                limit: cap,
            });
        }
    }
    Ok(())
}

/// Every slot lies in `0..limit`.
pub(crate) fn slots_in(op: &'static str, slots: &[i32], limit: u64) -> Result<()> {
    // A fold without an early exit compiles to SIMD: a negative slot is above any limit as a
    // u32. Only a list that fails is walked again, for the first entry outside.
    let max = slots.iter().fold(0u32, |m, &s| m.max(s as u32));
    if (max as u64) < limit {
        return Ok(());
    }
    for (i, &s) in slots.iter().enumerate() {
        if s < 0 || s as u64 >= limit {
            return Err(KernelError::OutOfRange {
                op,
                index: i,
                value: s as i64,
                limit,
            });
        }
    }
    unreachable!("{op}: the largest slot {max} is outside {limit}, so one entry is")
}

/// Every page a row's context covers lies in `0..pages`.
fn pages_in(
    op: &'static str,
    page_table: &[i32],
    pt_stride: u32,
    context_lens: &[i32],
    pages: u64,
) -> Result<()> {
    for (r, &len) in context_lens.iter().enumerate() {
        let used = (len.max(0) as u32).div_ceil(PAGE_TOKENS) as usize;
        let at = r * pt_stride as usize;
        slots_in(op, &page_table[at..at + used], pages)?;
    }
    Ok(())
}

/// `index_k_store` of `slots.len()` tokens into one layer's index-K pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexKStore<'a> {
    /// The format the kernel writes; it must be the pool's (a store that writes fp8 rows into a
    /// bf16 pool is the incident this record's dtype exists for).
    pub dtype: IndexKDtype,
    /// Round fp8 scales up to powers of two (the model's `scale_fmt = "ue8m0"`).
    pub ue8m0: bool,
    /// Each token's destination slot.
    pub slots: Cow<'a, [i32]>,
}

impl IndexKStore<'_> {
    pub const OP: &'static str = "index_k_store";
    pub fn tokens(&self) -> usize {
        self.slots.len()
    }
    pub fn check(&self) -> Result<()> {
        Self::check_tokens(self.tokens())
    }
    /// A launch of `n` tokens: four threads each, counted in an `i32`.
    pub fn check_tokens(n: usize) -> Result<()> {
        if n as u64 > (i32::MAX / 4) as u64 {
            return Err(bad(Self::OP, "slots", format!("{n} tokens in one launch")));
        }
        Ok(())
    }
    /// Raw keys `[n][128]` bf16, LayerNorm weight and bias (128 f32 each), RoPE rows `[n][64]`
    /// f32 and the slots (`[n]` i32, their device copy).
    pub fn operands(&self) -> [Operand; 5] {
        Self::operands_of(self.tokens())
    }
    /// [`Self::operands`] of `n` tokens whose slots only the device holds.
    pub fn operands_of(n: usize) -> [Operand; 5] {
        let n = n as u64;
        let d = INDEX_HEAD_DIM as u64;
        [
            ("keys", bf16_bytes(n * d)),
            ("gamma", f32_bytes(d)),
            ("beta", f32_bytes(d)),
            ("rope", f32_bytes(n * ROPE_DIM as u64)),
            ("slots", i32_bytes(n)),
        ]
    }
    /// Every slot lies in a pool of `slots` token rows.
    pub fn slots_in(&self, slots: u64) -> Result<()> {
        slots_in(Self::OP, &self.slots, slots)
    }
}

/// `kv_store` of `slots.len()` MLA rows into one layer's KV pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvStore<'a> {
    pub dtype: KvDtype,
    pub slots: Cow<'a, [i32]>,
}

impl KvStore<'_> {
    pub const OP: &'static str = "kv_store";
    pub fn tokens(&self) -> usize {
        self.slots.len()
    }
    pub fn check(&self) -> Result<()> {
        check_stored(Self::OP, self.dtype)?;
        let n = self.tokens() as u64;
        if n > i32::MAX as u64 {
            return Err(bad(Self::OP, "slots", format!("{n} tokens in one launch")));
        }
        Ok(())
    }
    /// The rows `[n][576]` bf16 (512 latent values, then 64 RoPE values) and the slots.
    pub fn operands(&self) -> [Operand; 2] {
        let n = self.tokens() as u64;
        [
            ("rows", bf16_bytes(n * KV_ROW_VALUES as u64)),
            ("slots", i32_bytes(n)),
        ]
    }
    pub fn slots_in(&self, slots: u64) -> Result<()> {
        slots_in(Self::OP, &self.slots, slots)
    }
}

/// `q_prep` of `rows` query tokens of `heads` indexer heads each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QPrep {
    pub rows: u32,
    /// The model's indexer heads (`index_n_heads`): a launch holds every head of its tokens.
    pub heads: u32,
    /// Round each head's scale up to a power of two.
    pub ue8m0: bool,
}

impl QPrep {
    pub const OP: &'static str = "q_prep";
    pub fn check(&self) -> Result<()> {
        check_heads(Self::OP, self.heads)?;
        if self.rows as u64 * self.heads as u64 > i32::MAX as u64 / INDEX_HEAD_DIM as u64 {
            return Err(bad(
                Self::OP,
                "rows",
                format!("{} rows in one launch", self.rows),
            ));
        }
        Ok(())
    }
    /// Raw queries `[n][heads][128]` bf16, raw head weights `[n][heads]` f32, RoPE rows
    /// `[n][64]` f32; out: fp8 queries `[n][heads][128]`, folded weights `[n][heads]` f32.
    pub fn operands(&self) -> [Operand; 5] {
        let nh = self.rows as u64 * self.heads as u64;
        let d = INDEX_HEAD_DIM as u64;
        [
            ("q", bf16_bytes(nh * d)),
            ("w", f32_bytes(nh)),
            ("rope", f32_bytes(self.rows as u64 * ROPE_DIM as u64)),
            ("q_out", fp8_bytes(nh * d)),
            ("w_out", f32_bytes(nh)),
        ]
    }
}

/// `index_logits` of `context_lens.len()` query rows over one layer's index-K pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexLogits<'a> {
    pub dtype: IndexKDtype,
    pub heads: u32,
    /// Each row's page table, `[rows][pt_stride]`: position `n` lives in page `pt[n / 64]`.
    pub page_table: Cow<'a, [i32]>,
    pub pt_stride: u32,
    /// Each row's context length: positions `0..len` are scored.
    pub context_lens: Cow<'a, [i32]>,
    /// Positions per output row, at least every row's context length.
    pub out_stride: u32,
}

impl IndexLogits<'_> {
    pub const OP: &'static str = "index_logits";
    pub fn rows(&self) -> usize {
        self.context_lens.len()
    }
    pub fn check(&self) -> Result<()> {
        check_heads(Self::OP, self.heads)?;
        check_rows(
            Self::OP,
            &self.page_table,
            self.pt_stride,
            &self.context_lens,
            self.out_stride,
        )
    }
    /// fp8 queries `[rows][heads][128]`, folded weights `[rows][heads]` f32, the page tables and
    /// context lengths (their device copies), and the logits `[rows][out_stride]` f32.
    pub fn operands(&self) -> [Operand; 5] {
        Self::operands_of(self.rows(), self.heads, self.pt_stride, self.out_stride)
    }
    /// [`Self::operands`] of `rows` rows whose tables only the device holds.
    pub fn operands_of(rows: usize, heads: u32, pt_stride: u32, out_stride: u32) -> [Operand; 5] {
        let rows = rows as u64;
        let rh = rows * heads as u64;
        [
            ("q", fp8_bytes(rh * INDEX_HEAD_DIM as u64)),
            ("w", f32_bytes(rh)),
            ("page_table", i32_bytes(rows * pt_stride as u64)),
            ("context_lens", i32_bytes(rows)),
            ("out", f32_bytes(rows * out_stride as u64)),
        ]
    }
    /// Every page a row's context covers lies in a pool of `pages` pages.
    pub fn pages_in(&self, pages: u64) -> Result<()> {
        pages_in(
            Self::OP,
            &self.page_table,
            self.pt_stride,
            &self.context_lens,
            pages,
        )
    }
}

/// `topk` of `context_lens.len()` logits rows with the configured `index_topk`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopK<'a> {
    /// Positions per row: the configured `index_topk`, never a constant.
    pub k: u32,
    /// Positions per logits row.
    pub stride: u32,
    pub context_lens: Cow<'a, [i32]>,
    /// `[rows][pt_stride]` page tables mapping positions to slots.
    pub page_table: Cow<'a, [i32]>,
    pub pt_stride: u32,
}

impl TopK<'_> {
    pub const OP: &'static str = "topk";
    pub fn rows(&self) -> usize {
        self.context_lens.len()
    }
    /// Also `k` and the sizes of the logits and the selection: an op whose `k` and selection
    /// disagree would write past its selection or leave part of it stale.
    pub fn check(&self) -> Result<()> {
        check_k(Self::OP, self.k)?;
        check_rows(
            Self::OP,
            &self.page_table,
            self.pt_stride,
            &self.context_lens,
            self.stride,
        )
    }
    /// The logits `[rows][stride]` f32, the context lengths and page tables (their device
    /// copies) and the selection `[rows][k]` slots.
    pub fn operands(&self) -> [Operand; 4] {
        Self::operands_of(self.rows(), self.k, self.stride, self.pt_stride)
    }
    /// [`Self::operands`] of `rows` rows whose lengths and tables only the device holds.
    pub fn operands_of(rows: usize, k: u32, stride: u32, pt_stride: u32) -> [Operand; 4] {
        let rows = rows as u64;
        [
            ("logits", f32_bytes(rows * stride as u64)),
            ("context_lens", i32_bytes(rows)),
            ("page_table", i32_bytes(rows * pt_stride as u64)),
            ("out", i32_bytes(rows * k as u64)),
        ]
    }
}

/// `sparse_read` of `rows` selections of `k` slots from one layer's KV pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseRead {
    pub dtype: KvDtype,
    pub rows: u32,
    pub k: u32,
}

impl SparseRead {
    pub const OP: &'static str = "sparse_read";
    pub fn check(&self) -> Result<()> {
        check_k(Self::OP, self.k)?;
        check_stored(Self::OP, self.dtype)
    }
    /// The selection `[rows][k]` slots (`-1` padding) and one u64 digest per row.
    pub fn operands(&self) -> [Operand; 2] {
        let rows = self.rows as u64;
        [
            ("slots", i32_bytes(rows * self.k as u64)),
            ("out", u64_bytes(rows)),
        ]
    }
}

/// `next_tokens`: the token after each of a step's first `rows` query rows, from the step's
/// digests of every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NextTokens {
    pub seed: u64,
    pub layers: u32,
    /// Query rows the digests buffer holds per layer.
    pub rows_max: u32,
    pub rows: u32,
}

impl NextTokens {
    pub const OP: &'static str = "next_tokens";
    pub fn check(&self) -> Result<()> {
        if self.rows > self.rows_max {
            return Err(bad(
                Self::OP,
                "rows",
                format!("{} rows of a step of {}", self.rows, self.rows_max),
            ));
        }
        Ok(())
    }
    /// The digests `[layers][rows_max]` u64 and one u32 token per row.
    pub fn operands(&self) -> [Operand; 2] {
        [
            (
                "digests",
                u64_bytes(self.layers as u64 * self.rows_max as u64),
            ),
            ("out", u32_bytes(self.rows as u64)),
        ]
    }
}
