//! `topk`: the `k` best positions of each logits row, for any `k` in `1..=2048` — the configured
//! `index_topk`, never a constant (DESIGN §1 incident 3) — returned as slots `page*64 + offset`
//! through the row's page table, best first, `-1` padding when the context is shorter than `k`.
//!
//! The order is total, so CPU and CUDA agree exactly: a larger score first, compared on the
//! order-preserving integer image of the fp32 bits (so `-0.0` ranks just below `+0.0`), and between
//! equal scores the lower position first.

use crate::error::{bad, expect_len, KernelError, Result};
use crate::layout::{kernel_slot, INDEX_TOPK_MAX, PAGE_TOKENS};

/// The order-preserving integer image of an fp32: `a < b` as floats iff `key(a) < key(b)` (for
/// non-NaN values; `-0.0` sorts below `+0.0`).
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// Arguments of `topk` over `rows` logits rows.
#[derive(Clone, Copy, Debug)]
pub struct TopKArgs<'a> {
    pub k: usize,
    /// `[rows][stride]` logits.
    pub logits: &'a [f32],
    pub stride: usize,
    pub context_lens: &'a [i32],
    /// `[rows][pt_stride]` page tables mapping positions to slots.
    pub page_table: &'a [i32],
    pub pt_stride: usize,
}

impl TopKArgs<'_> {
    pub fn rows(&self) -> usize {
        self.context_lens.len()
    }
    pub fn check(&self) -> Result<()> {
        const OP: &str = "topk";
        if self.k == 0 || self.k > INDEX_TOPK_MAX as usize {
            return Err(bad(
                OP,
                "k",
                format!("{} is outside 1..={INDEX_TOPK_MAX}", self.k),
            ));
        }
        let r = self.rows();
        expect_len(OP, "logits", self.logits.len(), r * self.stride)?;
        expect_len(OP, "page_table", self.page_table.len(), r * self.pt_stride)?;
        for (i, &len) in self.context_lens.iter().enumerate() {
            let cap = self.stride.min(self.pt_stride * PAGE_TOKENS as usize);
            if len < 0 || len as usize > cap {
                return Err(KernelError::OutOfRange {
                    op: OP,
                    index: i,
                    value: len as i64,
                    limit: cap as u64,
                });
            }
        }
        Ok(())
    }
}

/// The best `min(k, scores.len())` positions of one row, best first (the specification's order).
pub fn topk_positions(scores: &[f32], k: usize) -> Vec<u32> {
    let mut keyed: Vec<(u32, u32)> = scores
        .iter()
        .enumerate()
        .map(|(n, &s)| (order_key(s), n as u32))
        .collect();
    let better = |a: &(u32, u32), b: &(u32, u32)| b.0.cmp(&a.0).then(a.1.cmp(&b.1));
    let take = k.min(keyed.len());
    if take < keyed.len() {
        keyed.select_nth_unstable_by(take, better);
        keyed.truncate(take);
    }
    keyed.sort_unstable_by(better);
    keyed.into_iter().map(|(_, n)| n).collect()
}

/// The CPU reference of `topk`: `out` is `[rows][k]` slots.
pub fn topk(a: &TopKArgs, out: &mut [i32]) -> Result<()> {
    a.check()?;
    expect_len("topk", "out", out.len(), a.rows() * a.k)?;
    for r in 0..a.rows() {
        let len = a.context_lens[r] as usize;
        let row = &a.logits[r * a.stride..r * a.stride + len];
        let pt = &a.page_table[r * a.pt_stride..(r + 1) * a.pt_stride];
        let o = &mut out[r * a.k..(r + 1) * a.k];
        let best = topk_positions(row, a.k);
        for (i, slot) in o.iter_mut().enumerate() {
            *slot = match best.get(i) {
                Some(&n) => kernel_slot(pt[n as usize / PAGE_TOKENS as usize], n % PAGE_TOKENS),
                None => -1,
            };
        }
    }
    Ok(())
}
