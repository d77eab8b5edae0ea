//! `index_logits`: paged decode logits of the lightning indexer over fp8 or bf16 index-K pages,
//!
//! `score[n] = kscale[n] · Σ_h w_h · relu(q_h · k_n)`
//!
//! in fp32. The order is the CUDA kernel's, so that both agree bit for bit: `q_h · k_n` is a chain of
//! fused multiply-adds over `d = 0..128`; the head sum is a chain of fused multiply-adds
//! `s = fma(w_h, relu(dot_h), s)` over `h = 0..heads`; the fp8 key scale multiplies last. Positions at
//! or past the row's context length score `-inf`.

use super::numerics::{e4m3_decode, read_f32, read_u16, E4M3_DECODE};
use super::store::check_paged_dst;
use crate::error::{bad, expect_len, KernelError, Result};
use crate::layout::{index_k_page, IndexKDtype, LayoutFingerprint, PageFormat, PAGE_TOKENS};

/// Arguments of `index_logits` for `rows` query rows.
#[derive(Clone, Copy, Debug)]
pub struct IndexLogitsArgs<'a> {
    pub dtype: IndexKDtype,
    pub heads: usize,
    /// fp8 queries from `q_prep`, `[rows][heads][128]`.
    pub q: &'a [u8],
    /// Folded head weights from `q_prep`, `[rows][heads]`.
    pub weights: &'a [f32],
    /// Each row's page table, `[rows][pt_stride]`: position `n` lives in page `pt[n / 64]`.
    pub page_table: &'a [i32],
    pub pt_stride: usize,
    /// Each row's context length (positions `0..len` are scored).
    pub context_lens: &'a [i32],
    /// Stride of an output row; at least every row's context length.
    pub out_stride: usize,
}

impl IndexLogitsArgs<'_> {
    pub fn rows(&self) -> usize {
        self.context_lens.len()
    }
    pub fn check(&self) -> Result<()> {
        const OP: &str = "index_logits";
        let r = self.rows();
        if self.heads == 0 {
            return Err(bad(OP, "heads", "must be at least 1"));
        }
        expect_len(OP, "q", self.q.len(), r * self.heads * 128)?;
        expect_len(OP, "weights", self.weights.len(), r * self.heads)?;
        expect_len(OP, "page_table", self.page_table.len(), r * self.pt_stride)?;
        for (i, &len) in self.context_lens.iter().enumerate() {
            let cap = (self.pt_stride * PAGE_TOKENS as usize).min(self.out_stride);
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

/// Decodes token `t` of an index-K page into f32 values; returns its key scale (1 for bf16).
pub fn decode_key(dtype: IndexKDtype, page: &[u8], t: u32, k: &mut [f32; 128]) -> f32 {
    let at = index_k_page::value_offset(dtype, t, 0);
    match dtype {
        IndexKDtype::Fp8 => {
            for (d, kd) in k.iter_mut().enumerate() {
                *kd = e4m3_decode(page[at + d]);
            }
            let off = index_k_page::scale_offset(dtype, t).expect("fp8 pages carry scales");
            read_f32(page, off)
        }
        IndexKDtype::Bf16 => {
            for (d, kd) in k.iter_mut().enumerate() {
                *kd = half::bf16::from_bits(read_u16(page, at + 2 * d)).to_f32();
            }
            1.0
        }
    }
}

/// `Σ_h w_h · relu(q_h · k)` in the kernel's order; `q` is `[heads][128]` in f32.
#[inline(always)]
fn head_sum(q: &[f32], w: &[f32], k: &[f32; 128]) -> f32 {
    let mut s = 0f32;
    for (h, wh) in w.iter().enumerate() {
        let qh = &q[h * 128..(h + 1) * 128];
        let mut dot = 0f32;
        for d in 0..128 {
            dot = qh[d].mul_add(k[d], dot);
        }
        let r = if dot > 0.0 { dot } else { 0.0 };
        s = wh.mul_add(r, s);
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn head_sum_fma(q: &[f32], w: &[f32], k: &[f32; 128]) -> f32 {
    head_sum(q, w, k)
}

/// `head_sum` with hardware FMA where the CPU has it (same results: `mul_add` is a correctly rounded
/// fused multiply-add either way; the hardware instruction is only faster than libm's).
pub fn score(q: &[f32], w: &[f32], k: &[f32; 128]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports FMA, checked just above.
            return unsafe { head_sum_fma(q, w, k) };
        }
    }
    head_sum(q, w, k)
}

/// Logit of one key for one query row (`q` decoded to f32, `[heads][128]`).
pub fn logit(q: &[f32], w: &[f32], k: &[f32; 128], kscale: f32, dtype: IndexKDtype) -> f32 {
    let s = score(q, w, k);
    match dtype {
        IndexKDtype::Fp8 => s * kscale,
        IndexKDtype::Bf16 => s,
    }
}

/// Decodes one row's fp8 queries to f32.
pub fn decode_q(q: &[u8]) -> Vec<f32> {
    q.iter().map(|&b| E4M3_DECODE[b as usize]).collect()
}

/// The CPU reference of `index_logits`; `out` is `[rows][out_stride]`.
pub fn index_logits(
    a: &IndexLogitsArgs,
    k_buf: &[u8],
    k_fp: LayoutFingerprint,
    out: &mut [f32],
) -> Result<()> {
    const OP: &str = "index_logits";
    a.check()?;
    let format = PageFormat::IndexK(a.dtype);
    let slots = check_paged_dst(OP, format, k_buf.len(), k_fp)?;
    let pages = slots / PAGE_TOKENS as u64;
    expect_len(OP, "out", out.len(), a.rows() * a.out_stride)?;
    let pb = format.page_bytes() as usize;
    let h = a.heads;
    let mut k = [0f32; 128];
    for r in 0..a.rows() {
        let q = decode_q(&a.q[r * h * 128..(r + 1) * h * 128]);
        let w = &a.weights[r * h..(r + 1) * h];
        let pt = &a.page_table[r * a.pt_stride..(r + 1) * a.pt_stride];
        let len = a.context_lens[r] as usize;
        let row = &mut out[r * a.out_stride..(r + 1) * a.out_stride];
        for (n, o) in row.iter_mut().enumerate().take(len) {
            let p = pt[n / PAGE_TOKENS as usize];
            if p < 0 || p as u64 >= pages {
                return Err(KernelError::OutOfRange {
                    op: OP,
                    index: r,
                    value: p as i64,
                    limit: pages,
                });
            }
            let page = &k_buf[p as usize * pb..(p as usize + 1) * pb];
            let kscale = decode_key(a.dtype, page, (n % PAGE_TOKENS as usize) as u32, &mut k);
            *o = logit(&q, w, &k, kscale, a.dtype);
        }
        for o in row.iter_mut().skip(len) {
            *o = f32::NEG_INFINITY;
        }
    }
    Ok(())
}
