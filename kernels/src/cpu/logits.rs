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
use crate::args::{self, bind_exact};
use crate::error::{KernelError, Result};
use crate::layout::{
    f32_bytes, fp8_bytes, index_k_page, IndexKDtype, LayoutFingerprint, PageFormat, INDEX_HEAD_DIM,
    PAGE_TOKENS,
};
use crate::mutants::KernelMutant;

/// Binds `index_logits`' inputs and output to its record: fp8 queries `[rows][heads][128]`,
/// folded head weights `[rows][heads]` and logits `[rows][out_stride]`.
fn bind(a: &args::IndexLogits, q: &[u8], w: &[f32], out: usize) -> Result<()> {
    a.check()?;
    let [qo, wo, _, _, oo] = a.operands();
    bind_exact(args::IndexLogits::OP, qo, fp8_bytes(q.len() as u64))?;
    bind_exact(args::IndexLogits::OP, wo, f32_bytes(w.len() as u64))?;
    bind_exact(args::IndexLogits::OP, oo, f32_bytes(out as u64))
}

/// Decodes token `t` of an index-K page into f32 values; returns its key scale (1 for bf16).
pub fn decode_key(dtype: IndexKDtype, page: &[u8], t: u32, k: &mut [f32; 128]) -> f32 {
    let at = index_k_page::value_offset(dtype, t, 0);
    // The planted reader bug: token `t`'s values and scale read from `t` token rows in, as if
    // each row held its values and then its scale.
    if dtype == IndexKDtype::Fp8 && crate::mutants::on(KernelMutant::LogitsReadsInterleaved) {
        let at = t as usize * PageFormat::IndexK(dtype).token_bytes() as usize;
        for (d, kd) in k.iter_mut().enumerate() {
            *kd = e4m3_decode(page[at + d]);
        }
        return read_f32(page, at + INDEX_HEAD_DIM as usize);
    }
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

/// Tokens scored together: independent fused multiply-add chains, so the CPU can run them side by
/// side in SIMD lanes. Each chain is still the kernel's sequential chain over `d`, so the results
/// are bit-identical to scoring one token at a time. A chain's every step waits for the one
/// before (an FMA's latency is several cycles), so a context is scored `WIDE` keys at a time —
/// enough chains to keep the FMA units busy — and its tail `LANES` at a time.
const LANES: usize = 8;
/// A page's keys: [`KeyBlock`] holds one page, scored in one block.
pub const WIDE: usize = PAGE_TOKENS as usize;

/// `Σ_h w_h · relu(q_h · k_j)` in the kernel's order for up to `N` keys `kt[d][j]`.
#[inline(always)]
fn head_sum_block<const N: usize>(q: &[f32], w: &[f32], kt: &[[f32; N]; 128]) -> [f32; N] {
    let mut s = [0f32; N];
    for (h, wh) in w.iter().enumerate() {
        let qh = &q[h * 128..(h + 1) * 128];
        let mut dot = [0f32; N];
        for d in 0..128 {
            for j in 0..N {
                dot[j] = qh[d].mul_add(kt[d][j], dot[j]);
            }
        }
        for j in 0..N {
            let r = if dot[j] > 0.0 { dot[j] } else { 0.0 };
            s[j] = wh.mul_add(r, s[j]);
        }
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_sum_block_fma<const N: usize>(
    q: &[f32],
    w: &[f32],
    kt: &[[f32; N]; 128],
) -> [f32; N] {
    head_sum_block(q, w, kt)
}

fn block<const N: usize>(q: &[f32], w: &[f32], kt: &[[f32; N]; 128]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx2")
        {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { head_sum_block_fma(q, w, kt) };
        }
    }
    head_sum_block(q, w, kt)
}

/// `Σ_h w_h · relu(q_h · k_n)` for every key (`q` is `[heads][128]` in f32), into `out`.
/// `mul_add` is a correctly rounded fused multiply-add whether or not the hardware instruction is
/// used, so the result does not depend on the CPU.
pub fn scores(q: &[f32], w: &[f32], keys: &[[f32; 128]], out: &mut [f32]) {
    assert_eq!(keys.len(), out.len());
    scores_with(q, w, out, |n, k| *k = keys[n]);
}

/// [`scores`] of `out.len()` keys that `key(n, k)` writes into `k` one at a time, so a caller
/// holding its keys elsewhere (pages, a memo) does not gather them into one array first.
pub fn scores_with(
    q: &[f32],
    w: &[f32],
    out: &mut [f32],
    mut key: impl FnMut(usize, &mut [f32; 128]),
) {
    let wide = out.len() / WIDE * WIDE;
    scores_in_blocks::<WIDE>(q, w, &mut out[..wide], 0, &mut key);
    scores_in_blocks::<LANES>(q, w, &mut out[wide..], wide, &mut key);
}

/// `out[i]` is the score of key `first + i`, `N` keys per block.
fn scores_in_blocks<const N: usize>(
    q: &[f32],
    w: &[f32],
    out: &mut [f32],
    first: usize,
    key: &mut impl FnMut(usize, &mut [f32; 128]),
) {
    let mut kt = [[0f32; N]; 128];
    let mut k = [0f32; 128];
    for (c, oc) in out.chunks_mut(N).enumerate() {
        for j in 0..oc.len() {
            key(first + c * N + j, &mut k);
            for (lanes, &v) in kt.iter_mut().zip(&k) {
                lanes[j] = v;
            }
        }
        let s = block(q, w, &kt);
        oc.copy_from_slice(&s[..oc.len()]);
    }
}

/// `Σ_h w_h · relu(q_h · k)` for one key.
pub fn score(q: &[f32], w: &[f32], k: &[f32; 128]) -> f32 {
    let mut out = [0f32];
    scores(q, w, std::slice::from_ref(k), &mut out);
    out[0]
}

/// Logit of one key for one query row (`q` decoded to f32, `[heads][128]`).
pub fn logit(q: &[f32], w: &[f32], k: &[f32; 128], kscale: f32, dtype: IndexKDtype) -> f32 {
    apply_scale(score(q, w, k), kscale, dtype)
}

/// The key scale multiplies last (fp8 pages only).
pub fn apply_scale(s: f32, kscale: f32, dtype: IndexKDtype) -> f32 {
    match dtype {
        IndexKDtype::Fp8 => s * kscale,
        IndexKDtype::Bf16 => s,
    }
}

/// Decodes one row's fp8 queries to f32.
pub fn decode_q(q: &[u8]) -> Vec<f32> {
    q.iter().map(|&b| E4M3_DECODE[b as usize]).collect()
}

/// The page holding position `n` of row `r` through the row's page table `pt` (`pages` pages of
/// `pb` bytes in `k_buf`), or the out-of-range error naming the row.
fn key_page<'k>(
    k_buf: &'k [u8],
    pb: usize,
    pt: &[i32],
    n: usize,
    r: usize,
    pages: u64,
) -> Result<&'k [u8]> {
    let p = pt[n / PAGE_TOKENS as usize];
    if p < 0 || p as u64 >= pages {
        return Err(KernelError::OutOfRange {
            op: "index_logits",
            index: r,
            value: p as i64,
            limit: pages,
        });
    }
    Ok(&k_buf[p as usize * pb..(p as usize + 1) * pb])
}

/// One index-K page's 64 keys decoded to f32 and transposed (`kt[d][t]`), with their scales (1
/// for bf16): the layout in which [`block_scores`] scores a whole page side by side.
#[derive(Clone)]
pub struct KeyBlock {
    pub kt: [[f32; WIDE]; 128],
    pub scales: [f32; WIDE],
}

impl KeyBlock {
    pub fn new() -> Box<KeyBlock> {
        Box::new(KeyBlock {
            kt: [[0.0; WIDE]; 128],
            scales: [0.0; WIDE],
        })
    }

    /// Decodes every token of `page`.
    pub fn decode(&mut self, dtype: IndexKDtype, page: &[u8]) {
        let mut k = [0f32; 128];
        for t in 0..PAGE_TOKENS {
            let scale = decode_key(dtype, page, t, &mut k);
            self.set(t as usize, &k, scale);
        }
    }

    /// Puts key `k` with `scale` at token `t`.
    pub fn set(&mut self, t: usize, k: &[f32; 128], scale: f32) {
        for (lanes, &v) in self.kt.iter_mut().zip(k) {
            lanes[t] = v;
        }
        self.scales[t] = scale;
    }
}

/// The unscaled score (`Σ_h w_h · relu(q_h · k_t)`) of each of a page's 64 keys, bit-identical to
/// [`scores`]: each key's chain is its own, whichever keys share the block.
pub fn block_scores(q: &[f32], w: &[f32], b: &KeyBlock) -> [f32; WIDE] {
    block(q, w, &b.kt)
}

/// Where [`index_logits_from_pages`] gets each page's decoded keys.
pub trait PageKeys {
    /// The keys of page `index`, whose bytes are `bytes`.
    fn page(&mut self, dtype: IndexKDtype, index: usize, bytes: &[u8]) -> &KeyBlock;
}

/// Decodes every page it is asked for: the reference's own.
pub struct DecodeEach(Box<KeyBlock>);

impl Default for DecodeEach {
    fn default() -> Self {
        DecodeEach(KeyBlock::new())
    }
}

impl PageKeys for DecodeEach {
    fn page(&mut self, dtype: IndexKDtype, _: usize, bytes: &[u8]) -> &KeyBlock {
        self.0.decode(dtype, bytes);
        &self.0
    }
}

/// The CPU reference of `index_logits`; `out` is `[rows][out_stride]`.
pub fn index_logits(
    a: &args::IndexLogits,
    q: &[u8],
    w: &[f32],
    k_buf: &[u8],
    k_fp: LayoutFingerprint,
    out: &mut [f32],
) -> Result<()> {
    index_logits_from_pages(a, (q, w), k_buf, k_fp, out, &mut DecodeEach::default())
}

/// `index_logits` with each page's keys from `keys`, which may keep decoded pages (the simulator's
/// executor does, checking that their bytes are unchanged); the result is the same bits.
///
/// `inputs` are the fp8 queries `[rows][heads][128]` and folded head weights `[rows][heads]`.
pub fn index_logits_from_pages(
    a: &args::IndexLogits,
    (q_all, w_all): (&[u8], &[f32]),
    k_buf: &[u8],
    k_fp: LayoutFingerprint,
    out: &mut [f32],
    keys: &mut dyn PageKeys,
) -> Result<()> {
    const OP: &str = args::IndexLogits::OP;
    bind(a, q_all, w_all, out.len())?;
    let format = PageFormat::IndexK(a.dtype);
    let slots = check_paged_dst(OP, format, k_buf.len(), k_fp)?;
    let pages = slots / PAGE_TOKENS as u64;
    let pb = format.page_bytes() as usize;
    let (h, pt_stride, out_stride) = (
        a.heads as usize,
        a.pt_stride as usize,
        a.out_stride as usize,
    );
    let pt_tokens = PAGE_TOKENS as usize;
    for r in 0..a.rows() {
        let q = decode_q(&q_all[r * h * 128..(r + 1) * h * 128]);
        let w = &w_all[r * h..(r + 1) * h];
        let pt = &a.page_table[r * pt_stride..(r + 1) * pt_stride];
        let len = a.context_lens[r] as usize;
        let row = &mut out[r * out_stride..(r + 1) * out_stride];
        // Every page is checked first, so no row is half written when one is out of range.
        for j in 0..len.div_ceil(pt_tokens) {
            key_page(k_buf, pb, pt, j * pt_tokens, r, pages)?;
        }
        for j in 0..len.div_ceil(pt_tokens) {
            let p = pt[j] as usize;
            let b = keys.page(a.dtype, p, &k_buf[p * pb..(p + 1) * pb]);
            let s = block_scores(&q, w, b);
            let used = (len - j * pt_tokens).min(pt_tokens);
            for t in 0..used {
                row[j * pt_tokens + t] = apply_scale(s[t], b.scales[t], a.dtype);
            }
        }
        if crate::mutants::on(crate::mutants::KernelMutant::LogitsReadsNextPage) && len > 0 {
            // The last key read from the page after its own.
            let n = len - 1;
            let p = pt[n / pt_tokens] as usize + 1;
            if p < pages as usize {
                let b = keys.page(a.dtype, p, &k_buf[p * pb..(p + 1) * pb]);
                let t = n % pt_tokens;
                row[n] = apply_scale(block_scores(&q, w, b)[t], b.scales[t], a.dtype);
            }
        }
        for o in row.iter_mut().skip(len) {
            *o = f32::NEG_INFINITY;
        }
    }
    Ok(())
}

/// The exact value of every logit (in f64) and the scale of its rounding error: for position `n`
/// of row `r`, `value = kscale · Σ_h w_h · relu(q_h · k_n)` and
/// `magnitude = |kscale| · Σ_h |w_h| · Σ_d |q_hd · k_nd|`. DESIGN §4 allows a CUDA logits kernel
/// an error of 1e-5 relative: relative to `magnitude`, the standard error scale of a sum of
/// products, because the value itself can cancel to near zero (head weights have both signs).
/// Masked positions have value `-inf` and magnitude 0. Both outputs are `[rows][out_stride]`.
pub fn index_logits_f64(
    a: &args::IndexLogits,
    (q_all, w_all): (&[u8], &[f32]),
    k_buf: &[u8],
    k_fp: LayoutFingerprint,
) -> Result<(Vec<f64>, Vec<f64>)> {
    const OP: &str = args::IndexLogits::OP;
    let (h, pt_stride, out_stride) = (
        a.heads as usize,
        a.pt_stride as usize,
        a.out_stride as usize,
    );
    bind(a, q_all, w_all, a.rows() * out_stride)?;
    let format = PageFormat::IndexK(a.dtype);
    let slots = check_paged_dst(OP, format, k_buf.len(), k_fp)?;
    let pages = slots / PAGE_TOKENS as u64;
    let pb = format.page_bytes() as usize;
    let mut value = vec![f64::NEG_INFINITY; a.rows() * out_stride];
    let mut magnitude = vec![0f64; a.rows() * out_stride];
    let mut k = [0f32; 128];
    for r in 0..a.rows() {
        let q: Vec<f64> = decode_q(&q_all[r * h * 128..(r + 1) * h * 128])
            .into_iter()
            .map(f64::from)
            .collect();
        let w = &w_all[r * h..(r + 1) * h];
        let pt = &a.page_table[r * pt_stride..(r + 1) * pt_stride];
        for n in 0..a.context_lens[r] as usize {
            let page = key_page(k_buf, pb, pt, n, r, pages)?;
            let ks = decode_key(a.dtype, page, (n % PAGE_TOKENS as usize) as u32, &mut k);
            let ks = match a.dtype {
                IndexKDtype::Fp8 => f64::from(ks),
                IndexKDtype::Bf16 => 1.0,
            };
            let (mut s, mut m) = (0f64, 0f64);
            for (hi, &wh) in w.iter().enumerate() {
                let qh = &q[hi * 128..(hi + 1) * 128];
                let (mut dot, mut abs) = (0f64, 0f64);
                for d in 0..128 {
                    let t = qh[d] * f64::from(k[d]);
                    dot += t;
                    abs += t.abs();
                }
                s += f64::from(wh) * dot.max(0.0);
                m += f64::from(wh).abs() * abs;
            }
            value[r * out_stride + n] = ks * s;
            magnitude[r * out_stride + n] = ks.abs() * m;
        }
    }
    Ok((value, magnitude))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact f32 reference meets the bound the tensor-core kernel is held to.
    #[test]
    fn f32_reference_is_within_the_f64_bound() {
        let dtype = IndexKDtype::Fp8;
        let heads = 3;
        let mut page = vec![0u8; PageFormat::IndexK(dtype).page_bytes() as usize];
        let mut x = 0x1234_5678u32;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for t in 0..64u32 {
            for d in 0..128 {
                page[index_k_page::value_offset(dtype, t, d as u32)] = (rnd() % 0x7e) as u8;
            }
            let off = index_k_page::scale_offset(dtype, t).unwrap();
            page[off..off + 4].copy_from_slice(&0.01f32.to_le_bytes());
        }
        let q: Vec<u8> = (0..heads * 128)
            .map(|_| (rnd() % 0xfe) as u8 & 0xf7)
            .collect();
        let w = [0.5f32, -0.25, 0.125];
        let a = args::IndexLogits {
            dtype,
            heads,
            page_table: (&[0][..]).into(),
            pt_stride: 1,
            context_lens: (&[50][..]).into(),
            out_stride: 64,
        };
        let fp = PageFormat::IndexK(dtype).fingerprint();
        let mut out = vec![0f32; 64];
        index_logits(&a, &q, &w, &page, fp, &mut out).unwrap();
        let (v, m) = index_logits_f64(&a, (&q, &w), &page, fp).unwrap();
        for n in 0..64 {
            if n >= 50 {
                assert_eq!(out[n], f32::NEG_INFINITY);
                assert_eq!(v[n], f64::NEG_INFINITY);
                continue;
            }
            assert!(m[n] > 0.0);
            let err = (f64::from(out[n]) - v[n]).abs();
            assert!(
                err <= 1e-5 * m[n],
                "[{n}] {} vs {} (bound {})",
                out[n],
                v[n],
                m[n]
            );
        }
    }
}
