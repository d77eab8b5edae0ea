//! One argument record per kernel op: the scalars and the host-side index arrays (slots, page
//! tables, context lengths) that say what a launch does, and the one [`check`](TopK::check) of
//! the contract between them (scalar ranges, array lengths, context lengths within their tables
//! and rows; the ranges of slots and pages in a pool, which need the pool, are `slots_in` and
//! `pages_in`).
//!
//! The engine's op carries its record, the CPU reference reads it, the CUDA launcher reads it and
//! the simulator reads it: a record never changes shape on its way to a kernel. What differs
//! between backends is how each names the buffers an op reads and writes (a region of a
//! simulated buffer, a slice in memory, a device address). Each record answers the bytes every
//! such operand must hold ([`TopK::operands`]; the paged pools an op reads or writes are not
//! operands: their format and size are checked against their layout fingerprints). The engine's
//! regions must hold exactly that, a slice must be exactly that long, a device allocation at
//! least that large: each backend binds its operands to those sizes with [`bind_exact`] or
//! [`bind_at_least`]. Operands are answered in a fixed order, which each record's
//! `operands` doc states and its callers destructure.
//!
//! The guarded launches (`cuda::launch::guarded`), whose index arrays only the device holds,
//! build no record: they use the count-keyed halves (`operands_of`, [`check_k`],
//! [`check_heads`], [`check_strides`]) and check the arrays on the device.
//!
//! Index arrays are [`Array`]s: a launch borrows them; the engine's ops share them, so that the
//! ops of every layer of a step name one array (the runtime uploads it once a step).
//!
//! ```
//! use tierkv_kernels::args;
//! // Two rows of 64 logits, one page each, their 8 best positions as slots.
//! let a = args::TopK {
//!     k: 8,
//!     stride: 64,
//!     context_lens: vec![64, 10].into(),
//!     page_table: vec![3, 5].into(),
//!     pt_stride: 1,
//! };
//! a.check().unwrap();
//! let logits: Vec<f32> = (0..128).map(|i| i as f32).collect();
//! let mut out = vec![0i32; 16];
//! tierkv_kernels::cpu::topk(&a, &logits, &mut out).unwrap();
//! assert_eq!(&out[..2], &[3 * 64 + 63, 3 * 64 + 62]);
//! assert_eq!(&out[8..10], &[5 * 64 + 9, 5 * 64 + 8]);
//! // A context longer than its row is refused, naming the row and its limit.
//! let long = args::TopK { context_lens: vec![64, 65].into(), ..a };
//! let e = long.check().unwrap_err().to_string();
//! assert!(e.contains("`context_lens`: row 1: 65"), "{e}");
//! ```

use crate::error::{bad, KernelError, Result};
use crate::layout::{
    bf16_bytes, f32_bytes, fp8_bytes, i32_bytes, u32_bytes, u64_bytes, Bytes, IndexKDtype, KvDtype,
    INDEX_HEADS_MAX, INDEX_HEAD_DIM, INDEX_TOPK_MAX, KV_ROW_VALUES, PAGE_TOKENS, ROPE_DIM,
};
use std::sync::Arc;

/// An index array of a record: borrowed (a launch's view), or shared (the engine's ops: cloning
/// shares it, and [`Array::shared`] answers its identity, by which the runtime uploads one
/// array once however many ops name it).
#[derive(Clone, Debug)]
pub enum Array<'a, T> {
    Borrowed(&'a [T]),
    Shared(Arc<[T]>),
}

impl<T> std::ops::Deref for Array<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Array::Borrowed(s) => s,
            Array::Shared(a) => a,
        }
    }
}

impl<T: Clone> Array<'_, T> {
    /// The elements to change in place: a borrowed or still shared array is copied first, so
    /// that no other holder sees the change (a copy is a new identity).
    pub fn to_mut(&mut self) -> &mut [T] {
        if let Array::Borrowed(s) = self {
            *self = Array::Shared(s.to_vec().into());
        }
        match self {
            Array::Shared(a) => Arc::make_mut(a),
            Array::Borrowed(_) => unreachable!("made shared above"),
        }
    }
}

impl<T> Array<'_, T> {
    /// The shared allocation, whose identity names the array while any holder keeps it.
    pub fn shared(&self) -> Option<&Arc<[T]>> {
        match self {
            Array::Shared(a) => Some(a),
            Array::Borrowed(_) => None,
        }
    }
}

/// Equal contents. Two views of one allocation are equal without reading it (`T: Eq`, so
/// every element equals itself): the layers of a step share their arrays, and comparing an op
/// with the one its graph was captured for (`runtime::driven`) meets the same arrays.
impl<T: Eq> PartialEq for Array<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        let (a, b): (&[T], &[T]) = (self, other);
        std::ptr::eq(a, b) || a == b
    }
}

impl<T: Eq> Eq for Array<'_, T> {}

impl<T> From<Vec<T>> for Array<'_, T> {
    fn from(v: Vec<T>) -> Self {
        Array::Shared(v.into())
    }
}

impl<T> From<Arc<[T]>> for Array<'_, T> {
    fn from(a: Arc<[T]>) -> Self {
        Array::Shared(a)
    }
}

impl<'a, T> From<&'a [T]> for Array<'a, T> {
    fn from(s: &'a [T]) -> Self {
        Array::Borrowed(s)
    }
}

/// An operand's name and the bytes it must hold.
pub type Operand = (&'static str, Bytes);

/// `found` must be exactly `needed` bytes: an op's own region or slice.
pub fn bind_exact(op: &'static str, (buffer, needed): Operand, found: Bytes) -> Result<()> {
    if found != needed {
        return Err(KernelError::BufferSize {
            op,
            buffer,
            needed: needed.0,
            found: found.0,
        });
    }
    Ok(())
}

/// `found` must hold at least `needed` bytes: an allocation the op uses the front of.
pub fn bind_at_least(op: &'static str, (buffer, needed): Operand, found: Bytes) -> Result<()> {
    if found < needed {
        return Err(KernelError::BufferTooSmall {
            op,
            buffer,
            needed: needed.0,
            found: found.0,
        });
    }
    Ok(())
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

/// A format of tierkv's device pools: `fp8_unpacked` is a foreign row layout (576 bytes) that
/// no kernel stores or reads; tierkv only describes it (`layout.rs`).
fn check_stored(op: &'static str, dtype: KvDtype) -> Result<()> {
    if dtype == KvDtype::Fp8Unpacked {
        return Err(bad(
            op,
            "dtype",
            "fp8_unpacked is a foreign row layout no kernel stores or reads",
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
/// its table and its row of `stride` positions (for rows with no other row, `stride` =
/// `pt_stride × 64`).
pub fn check_rows(
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
    let table = pt_stride as u64 * PAGE_TOKENS as u64;
    let cap = table.min(stride as u64);
    match context_lens
        .iter()
        .position(|&len| len < 0 || len as u64 > cap)
    {
        Some(r) => Err(bad(
            op,
            "context_lens",
            format!(
                "row {r}: {} is outside 0..={cap} (its page table holds {table} positions, \
                 its row {stride})",
                context_lens[r]
            ),
        )),
        None => Ok(()),
    }
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
        let used = ((len.max(0) as u32).div_ceil(PAGE_TOKENS)).min(pt_stride) as usize;
        let at = r * pt_stride as usize;
        // A record its `check` would refuse (a table too short) is refused here too.
        let Some(row) = page_table.get(at..at + used) else {
            let n = page_table.len();
            return Err(bad(
                op,
                "page_table",
                format!("row {r} is past its {n} entries"),
            ));
        };
        slots_in(op, row, pages)?;
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
    pub slots: Array<'a, i32>,
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
    pub slots: Array<'a, i32>,
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
    pub page_table: Array<'a, i32>,
    pub pt_stride: u32,
    /// Each row's context length: positions `0..len` are scored.
    pub context_lens: Array<'a, i32>,
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
    pub context_lens: Array<'a, i32>,
    /// `[rows][pt_stride]` page tables mapping positions to slots.
    pub page_table: Array<'a, i32>,
    pub pt_stride: u32,
}

impl TopK<'_> {
    pub const OP: &'static str = "topk";
    pub fn rows(&self) -> usize {
        self.context_lens.len()
    }
    /// `k` within what the kernels select, the page tables `rows × pt_stride` entries, every
    /// context within its table and its logits row of `stride` positions. The logits' and the
    /// selection's sizes follow from these ([`Self::operands`]), and each backend binds its
    /// buffers to them: an op whose `k` and selection disagreed would write past its selection
    /// or leave part of it stale.
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

#[cfg(test)]
mod tests;
