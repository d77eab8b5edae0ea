//! `topk`: the `k` best positions of each logits row, for any `k` in `1..=2048` — the configured
//! `index_topk`, never a constant (DESIGN §1 incident 3) — returned as slots `page*64 + offset`
//! through the row's page table, best first, `-1` padding when the context is shorter than `k`.
//!
//! The order is total, so CPU and CUDA agree exactly: a larger score first, compared on the
//! order-preserving integer image of the fp32 bits (so `-0.0` ranks just below `+0.0`), and between
//! equal scores the lower position first.

use crate::args::{self, bind_exact};
use crate::error::Result;
use crate::layout::{f32_bytes, i32_bytes, kernel_slot, PAGE_TOKENS};

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

/// The CPU reference of `topk`: `logits` is `[rows][stride]`, `out` is `[rows][k]` slots.
pub fn topk(a: &args::TopK, logits: &[f32], out: &mut [i32]) -> Result<()> {
    a.check()?;
    let [lo, _, _, oo] = a.operands();
    bind_exact(args::TopK::OP, lo, f32_bytes(logits.len() as u64))?;
    bind_exact(args::TopK::OP, oo, i32_bytes(out.len() as u64))?;
    let (k, stride, pt_stride) = (a.k as usize, a.stride as usize, a.pt_stride as usize);
    for r in 0..a.rows() {
        let len = a.context_lens[r] as usize;
        let row = &logits[r * stride..r * stride + len];
        let pt = &a.page_table[r * pt_stride..(r + 1) * pt_stride];
        let o = &mut out[r * k..(r + 1) * k];
        let best = topk_positions(row, k);
        for (i, slot) in o.iter_mut().enumerate() {
            *slot = match best.get(i) {
                Some(&n) => kernel_slot(pt[n as usize / PAGE_TOKENS as usize], n % PAGE_TOKENS),
                None => -1,
            };
        }
    }
    Ok(())
}
