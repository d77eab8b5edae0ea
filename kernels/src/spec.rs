//! Independent versions of the kernels, written from their specification (docs/DESIGN.md §3–4)
//! without the CPU references' code: f64 arithmetic where the reference fixes an f32 operation
//! order, sorts where it selects, byte loops where it copies, the fp8 format decoded from its
//! definition. Nothing in production calls them. The kernels' tests (property tests and the CPU
//! instances of the conformance bodies) and the simulator's oracles hold the references to these,
//! so a bug in a reference cannot hide behind a comparison of the reference with itself.
//!
//! Whole-op checks (`check_index_k_store`, `check_kv_store`, `check_q_prep`, `topk`,
//! `sparse_read`, `page_copy`, `index_logits_f64`) serve the tests; row-level ones
//! (`check_index_k_row`, `check_kv_row`, `check_q_head`, `logits_f64`, `topk_order`, `digest`)
//! serve the oracles, which check every expected value they derive from a reference.

use crate::cpu;
use crate::layout::*;
use half::bf16;

/// The splitmix64 finalizer, from its published constants.
pub fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One e4m3 step at magnitude |v| (the spacing of codes around it).
pub fn e4m3_step(v: f64) -> f64 {
    let a = v.abs();
    if a < 2f64.powi(-6) {
        2f64.powi(-9)
    } else {
        // 2^(floor(log2 a) - 3), read off the exponent field (a is a normal f64 here).
        let exponent = ((a.to_bits() >> 52) & 0x7FF) as i64 - 1023;
        f64::from_bits(((exponent - 3 + 1023) as u64) << 52)
    }
}

/// LayerNorm (when `ln`) → NeoX RoPE on dims 0..64 → Hadamard 128 / √128, in f64.
pub fn pipeline_f64(
    key: &[bf16],
    gamma: &[f32],
    beta: &[f32],
    rope: &[f32],
    ln: bool,
) -> [f64; 128] {
    assert_eq!(key.len(), 128, "a 128-value row");
    let x: [f64; 128] = std::array::from_fn(|i| key[i].to_f32() as f64);
    let mut y = x;
    if ln {
        let mean = x.iter().sum::<f64>() / 128.0;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 128.0;
        let rstd = 1.0 / (var + 1e-6).sqrt();
        for i in 0..128 {
            y[i] = (x[i] - mean) * rstd * gamma[i] as f64 + beta[i] as f64;
        }
    }
    let r = y;
    for i in 0..32 {
        let (c, s) = (rope[i] as f64, rope[32 + i] as f64);
        y[i] = r[i] * c - r[i + 32] * s;
        y[i + 32] = r[i + 32] * c + r[i] * s;
    }
    hadamard_f64(&y)
}

/// The normalised Hadamard transform of 128 values in f64, by Sylvester's recursion
/// `H_2n = [[H_n, H_n], [H_n, -H_n]]` (the test below holds it to the matrix definition).
pub fn hadamard_f64(x: &[f64]) -> [f64; 128] {
    let mut y: [f64; 128] = x.try_into().expect("a 128-value transform");
    let mut half = 1;
    while half < 128 {
        for block in y.chunks_mut(2 * half) {
            let (lo, hi) = block.split_at_mut(half);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        half *= 2;
    }
    let norm = 128f64.sqrt();
    for v in &mut y {
        *v /= norm;
    }
    y
}

pub fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// A value of fp8 codes × `scale` against its f64 value: within one e4m3 step (plus a hair of
/// the row's largest value for the f32 rounding before quantisation).
pub fn close_fp8(code: u8, scale: f64, want: f64, amax: f64) -> bool {
    let v = E4M3.with(|t| t[code as usize]) * scale;
    (v - want).abs() <= e4m3_step(want / scale) * scale + 1e-5 * amax
}

/// The fp8 scale of a row with largest magnitude `amax`: `max(amax, 1e-4) / 448`, rounded up to
/// a power of two under `ue8m0`.
pub fn check_scale(scale: f64, amax: f64, ue8m0: bool) -> Result<(), String> {
    let exact = amax.max(1e-4) / 448.0;
    let ok = if ue8m0 {
        scale >= exact * (1.0 - 1e-6)
            && scale < 2.0 * exact * (1.0 + 1e-6)
            && (scale as f32).to_bits() & 0x7F_FFFF == 0
    } else {
        (scale - exact).abs() <= 1e-5 * exact
    };
    ok.then_some(())
        .ok_or_else(|| format!("scale {scale:e} for amax {amax:e} (ue8m0 {ue8m0})"))
}

/// One index-K row as specified: the f64 pipeline of `key` (LayerNorm with `gamma`/`beta`, NeoX
/// RoPE with `rope`, Hadamard); fp8 `values` within one e4m3 step of it at the specified `scale`,
/// or bf16 `values` (little-endian) rounded from it.
#[allow(clippy::too_many_arguments)]
pub fn check_index_k_row(
    dtype: IndexKDtype,
    ue8m0: bool,
    key: &[bf16],
    gamma: &[f32],
    beta: &[f32],
    rope: &[f32],
    values: &[u8],
    scale: Option<f32>,
) -> Result<(), String> {
    let want = pipeline_f64(key, gamma, beta, rope, true);
    let amax = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    match dtype {
        IndexKDtype::Fp8 => {
            let scale = scale.ok_or("an fp8 row without a scale")? as f64;
            check_scale(scale, amax, ue8m0)?;
            for d in 0..128 {
                if !close_fp8(values[d], scale, want[d], amax) {
                    return Err(format!("dim {d}: code {:#04x} for {}", values[d], want[d]));
                }
            }
        }
        IndexKDtype::Bf16 => {
            for d in 0..128 {
                let bits = u16::from_le_bytes([values[2 * d], values[2 * d + 1]]);
                let v = bf16::from_bits(bits).to_f32() as f64;
                let w = want[d];
                if (v - w).abs() > w.abs() * 2f64.powi(-8) + 1e-5 {
                    return Err(format!("dim {d}: {v} vs {w}"));
                }
            }
        }
    }
    Ok(())
}

/// One KV row as specified: bf16 rows are the input bits; packed fp8 rows hold four tiles of 128
/// latent values, each within one e4m3 step at an `amax / 448` scale, then the 64 RoPE values as
/// bf16 bits.
pub fn check_kv_row(dtype: KvDtype, row: &[bf16], out: &[u8]) -> Result<(), String> {
    match dtype {
        KvDtype::Bf16 => {
            let same = out.len() == 2 * row.len()
                && row
                    .iter()
                    .zip(out.chunks_exact(2))
                    .all(|(v, b)| v.to_bits().to_le_bytes() == *b);
            if !same {
                return Err("the bf16 row differs from its input".into());
            }
        }
        _ => {
            for tile in 0..4 {
                let vals: [f64; 128] = std::array::from_fn(|j| row[tile * 128 + j].to_f32() as f64);
                let amax = vals.iter().fold(0f64, |m, v| m.max(v.abs()));
                let scale = f32_at(out, 512 + 4 * tile) as f64;
                check_scale(scale, amax, false).map_err(|e| format!("tile {tile}: {e}"))?;
                for (j, &w) in vals.iter().enumerate() {
                    if !close_fp8(out[tile * 128 + j], scale, w, amax) {
                        return Err(format!("latent {}: {w}", tile * 128 + j));
                    }
                }
            }
            for r in 0..64 {
                let at = 528 + 2 * r;
                if u16::from_le_bytes([out[at], out[at + 1]]) != row[512 + r].to_bits() {
                    return Err(format!("rope {r}"));
                }
            }
        }
    }
    Ok(())
}

/// The fp8 scales a query head of largest magnitude `amax` (computed in f64) may carry: its
/// `max(amax, 1e-4) / 448`, or under `ue8m0` that rounded up to a power of two. Where the exact
/// scale is within a hair (1e-6) of a power of two, the f32 pipeline's `amax` may round to either
/// side of it, so both powers are allowed.
fn q_scales(amax: f64, ue8m0: bool) -> Vec<f64> {
    let exact = amax.max(1e-4) / 448.0;
    if !ue8m0 {
        return vec![exact];
    }
    let up = 2f64.powf(exact.log2().ceil());
    let mut out = vec![up];
    if up / exact < 1.0 + 1e-6 {
        out.push(2.0 * up);
    }
    if exact / (up / 2.0) < 1.0 + 1e-6 {
        out.push(up / 2.0);
    }
    out
}

/// One query head as specified: through RoPE and Hadamard in f64; fp8 `codes` within one step at
/// the head's scale (`amax / 448`, rounded up to a power of two under `ue8m0`); and the folded
/// weight DeepSeek-V3.2-Exp's `Indexer.forward` computes, `w · heads^-½ · q_scale ·
/// index_head_dim^-½` with `index_head_dim` 128, in `w_out`. `heads` is the model's indexer head
/// count.
#[allow(clippy::too_many_arguments)]
pub fn check_q_head(
    q: &[bf16],
    w: f32,
    rope: &[f32],
    heads: usize,
    ue8m0: bool,
    codes: &[u8],
    w_out: f32,
) -> Result<(), String> {
    let want = pipeline_f64(q, &[], &[], rope, false);
    let amax = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let constant = 1.0 / (heads as f64).sqrt() / 128f64.sqrt();
    let mut why = String::new();
    for scale in q_scales(amax, ue8m0) {
        let fw = w as f64 * constant * scale;
        if (w_out as f64 - fw).abs() > 1e-5 * fw.abs() + 1e-12 {
            why = format!("weight {w_out} vs {fw} (scale {scale:e}, ue8m0 {ue8m0})");
            continue;
        }
        match (0..128).find(|&d| !close_fp8(codes[d], scale, want[d], amax)) {
            None => return Ok(()),
            Some(d) => {
                why = format!("dim {d}: code {:#04x} for {}", codes[d], want[d]);
            }
        }
    }
    Err(why)
}

/// Bytes outside the rows of `slots` are what they were.
fn untouched(
    before: &[u8],
    after: &[u8],
    row_of: impl Fn(usize) -> Option<usize>,
    slots: &[i32],
) -> Result<(), String> {
    for (i, (a, b)) in before.iter().zip(after).enumerate() {
        if a != b && !row_of(i).is_some_and(|s| slots.contains(&(s as i32))) {
            return Err(format!("byte {i} outside the stored rows changed"));
        }
    }
    Ok(())
}

/// `index_k_store` as specified: each slot's row holds the f64 pipeline's values (fp8 within a
/// step, with its scale; bf16 rounded), and nothing else changed.
pub fn check_index_k_store(
    a: &cpu::IndexKStoreArgs,
    before: &[u8],
    after: &[u8],
) -> Result<(), String> {
    let fmt = PageFormat::IndexK(a.dtype);
    let pb = fmt.page_bytes() as usize;
    for (i, &s) in a.slots.iter().enumerate() {
        let page = &after[(s as usize / 64) * pb..][..pb];
        let t = s as u32 % 64;
        let values: Vec<u8> = match a.dtype {
            IndexKDtype::Fp8 => (0..128)
                .map(|d| page[index_k_page::value_offset(a.dtype, t, d)])
                .collect(),
            IndexKDtype::Bf16 => {
                let at = index_k_page::value_offset(a.dtype, t, 0);
                page[at..at + 256].to_vec()
            }
        };
        let scale = index_k_page::scale_offset(a.dtype, t).map(|off| f32_at(page, off));
        check_index_k_row(
            a.dtype,
            a.ue8m0,
            &a.keys[i * 128..(i + 1) * 128],
            a.gamma,
            a.beta,
            &a.rope[i * 64..(i + 1) * 64],
            &values,
            scale,
        )
        .map_err(|e| format!("slot {s}: {e}"))?;
    }
    // fp8 pages keep values and scales in separate regions of the page: map bytes to tokens.
    let row_of = |i: usize| {
        let (page, off) = (i / pb, i % pb);
        let t = match a.dtype {
            IndexKDtype::Fp8 if off >= 64 * 128 => (off - 64 * 128) / 4,
            IndexKDtype::Fp8 => off / 128,
            IndexKDtype::Bf16 => off / 256,
        };
        Some(page * 64 + t)
    };
    untouched(before, after, row_of, a.slots)
}

/// `kv_store` as specified: bf16 rows are the input bits; packed fp8 rows hold four tiles of 128
/// latent values with `amax / 448` scales, then the 64 RoPE values as bf16 bits.
pub fn check_kv_store(a: &cpu::KvStoreArgs, before: &[u8], after: &[u8]) -> Result<(), String> {
    let tb = PageFormat::Kv(a.dtype).token_bytes() as usize;
    for (i, &s) in a.slots.iter().enumerate() {
        let row = &a.rows[i * 576..(i + 1) * 576];
        let out = &after[s as usize * tb..][..tb];
        check_kv_row(a.dtype, row, out).map_err(|e| format!("slot {s}: {e}"))?;
    }
    untouched(before, after, |i| Some(i / tb), a.slots)
}

/// `q_prep` as specified: each (token, head) query through RoPE and Hadamard in f64, fp8 with
/// scale `amax / 448` (a power of two under `ue8m0`), and the folded head weight
/// `w · heads^-½ · q_scale · 128^-½`.
pub fn check_q_prep(a: &cpu::QPrepArgs, q_out: &[u8], w_out: &[f32]) -> Result<(), String> {
    for t in 0..a.rope.len() / 64 {
        for h in 0..a.heads {
            let i = t * a.heads + h;
            check_q_head(
                &a.q[i * 128..(i + 1) * 128],
                a.weights[i],
                &a.rope[t * 64..(t + 1) * 64],
                a.heads,
                a.ue8m0,
                &q_out[i * 128..(i + 1) * 128],
                w_out[i],
            )
            .map_err(|e| format!("token {t} head {h}: {e}"))?;
        }
    }
    Ok(())
}

/// `topk` by sorting: the `k` highest logits of each row's context (ties to the lower position,
/// `-inf` last), as slots through the row's page table, `-1` padding.
pub fn topk(a: &cpu::TopKArgs) -> Vec<i32> {
    let mut out = Vec::new();
    for (r, &len) in a.context_lens.iter().enumerate() {
        let order = topk_order(&a.logits[r * a.stride..][..len as usize], a.k);
        let pt = &a.page_table[r * a.pt_stride..];
        for i in 0..a.k {
            out.push(
                order
                    .get(i)
                    .map_or(-1, |&n| pt[n as usize / 64] * 64 + (n % 64) as i32),
            );
        }
    }
    out
}

/// The positions of the `k` highest `scores` in the specified order: descending by value, +0
/// above -0, equal values by ascending position, `-inf` last.
pub fn topk_order(scores: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&x, &y| {
        scores[y]
            .partial_cmp(&scores[x])
            .expect("no NaN logit")
            .then(
                scores[x]
                    .is_sign_negative()
                    .cmp(&scores[y].is_sign_negative()),
            )
            .then(x.cmp(&y))
    });
    order.into_iter().take(k).map(|n| n as u32).collect()
}

/// `sparse_read` from the digest's definition: per selected row, the wrapping sum over its
/// 8-byte words of `mix(word ^ (j+1)·φ)`; per row of selections, the wrapping sum over ranks of
/// `mix(row_hash ^ (i+1)·ψ)`, padding skipped.
pub fn sparse_read(a: &cpu::SparseReadArgs, kv: &[u8], rows: usize) -> Vec<u64> {
    let tb = PageFormat::Kv(a.dtype).token_bytes() as usize;
    (0..rows)
        .map(|r| {
            digest(
                a.slots[r * a.k..(r + 1) * a.k]
                    .iter()
                    .map(|&s| (s >= 0).then(|| &kv[s as usize * tb..][..tb])),
            )
        })
        .collect()
}

/// The digest of a selection from its definition: per row (in rank order; `None` is padding),
/// the wrapping sum over its 8-byte words of `mix(word ^ (j+1)·φ)`; then the wrapping sum over
/// ranks of `mix(row_hash ^ (i+1)·ψ)`, padding skipped; `mix` the splitmix64 finalizer.
pub fn digest<'a>(rows: impl IntoIterator<Item = Option<&'a [u8]>>) -> u64 {
    const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
    const PSI: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let mut acc = 0u64;
    for (i, row) in rows.into_iter().enumerate() {
        let Some(row) = row else {
            continue;
        };
        let mut h = 0u64;
        for (j, w) in row.chunks(8).enumerate() {
            let w = u64::from_le_bytes(w.try_into().expect("rows are whole words"));
            h = h.wrapping_add(splitmix(w ^ (j as u64 + 1).wrapping_mul(PHI)));
        }
        acc = acc.wrapping_add(splitmix(h ^ (i as u64 + 1).wrapping_mul(PSI)));
    }
    acc
}

/// `page_copy` byte by byte through both views.
pub fn page_copy(src: &[u8], sv: &PagedView, dst: &mut [u8], dv: &PagedView, runs: &[PageRun]) {
    for run in runs {
        for j in 0..run.count {
            let s = sv.base + (run.src.0 + j) as u64 * sv.page_stride;
            let d = dv.base + (run.dst.0 + j) as u64 * dv.page_stride;
            for b in 0..sv.fingerprint.page_bytes {
                dst[(d + b) as usize] = src[(s + b) as usize];
            }
        }
    }
}

/// An e4m3fn code's value from the format's definition: sign, 4 exponent bits (bias 7), 3
/// mantissa bits, subnormals at exponent 0, NaN at `s.1111.111`, no infinities.
pub fn e4m3(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((code >> 3) & 0xF, code & 0x7);
    if e == 0xF && m == 0x7 {
        return f64::NAN;
    }
    let mag = if e == 0 {
        m as f64 / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
    };
    sign * mag
}

thread_local! {
    /// `e4m3` of every code, computed once.
    static E4M3: [f64; 256] = std::array::from_fn(|c| e4m3(c as u8));
}

/// Index key `t` of an index-K page as f64 values, and its scale (1 for bf16), from the page
/// format: fp8 values at `t·128 + d` and the f32 scale at `8192 + 4t`; bf16 values at
/// `(t·128 + d)·2`, little-endian.
fn key_f64(dtype: IndexKDtype, page: &[u8], t: usize) -> ([f64; 128], f64) {
    match dtype {
        IndexKDtype::Fp8 => key_row_f64(
            dtype,
            &page[t * 128..][..128],
            Some(f32_at(page, 8192 + 4 * t)),
        ),
        IndexKDtype::Bf16 => key_row_f64(dtype, &page[t * 256..][..256], None),
    }
}

/// `index_logits` in f64 from the definition, `kscale[n] · Σ_h w_h · relu(q_h · k_n)`, with each
/// logit's error scale `|kscale| · Σ_h |w_h| · Σ_d |q_hd k_nd|`; `-inf` (and scale 0) at and past
/// each row's context length. Both `[rows][out_stride]`.
pub fn index_logits_f64(a: &cpu::IndexLogitsArgs, pool: &[u8]) -> (Vec<f64>, Vec<f64>) {
    let pb = PageFormat::IndexK(a.dtype).page_bytes() as usize;
    let rows = a.context_lens.len();
    let mut value = vec![f64::NEG_INFINITY; rows * a.out_stride];
    let mut magnitude = vec![0f64; rows * a.out_stride];
    for r in 0..rows {
        let keys: Vec<([f64; 128], f64)> = (0..a.context_lens[r] as usize)
            .map(|n| {
                let page = a.page_table[r * a.pt_stride + n / 64] as usize;
                key_f64(a.dtype, &pool[page * pb..][..pb], n % 64)
            })
            .collect();
        let q = &a.q[r * a.heads * 128..][..a.heads * 128];
        let w = &a.weights[r * a.heads..][..a.heads];
        for (n, (v, m)) in logits_f64(q, w, &keys).into_iter().enumerate() {
            value[r * a.out_stride + n] = v;
            magnitude[r * a.out_stride + n] = m;
        }
    }
    (value, magnitude)
}

/// The logits of one query from the definition, `kscale · Σ_h w_h · relu(q_h · k)` per key, in
/// f64, with each one's error scale `|kscale| · Σ_h |w_h| · Σ_d |q_hd k_d|`: `q_codes` are the
/// query's fp8 codes (heads × 128), `weights` its folded head weights, `keys` each key's values
/// and scale.
pub fn logits_f64(q_codes: &[u8], weights: &[f32], keys: &[([f64; 128], f64)]) -> Vec<(f64, f64)> {
    let q: Vec<f64> = q_codes
        .iter()
        .map(|&c| E4M3.with(|t| t[c as usize]))
        .collect();
    keys.iter()
        .map(|(k, ks)| {
            let (mut s, mut m) = (0f64, 0f64);
            for (h, &w) in weights.iter().enumerate() {
                let q = &q[h * 128..][..128];
                let terms = (0..128).map(|d| q[d] * k[d]);
                let (dot, abs) = terms.fold((0f64, 0f64), |(x, y), t| (x + t, y + t.abs()));
                s += w as f64 * dot.max(0.0);
                m += (w as f64).abs() * abs;
            }
            (ks * s, ks.abs() * m)
        })
        .collect()
}

/// An index key's values and scale (1 for bf16) from its row bytes: 128 fp8 codes and the
/// scale, or 256 bytes of little-endian bf16.
pub fn key_row_f64(dtype: IndexKDtype, values: &[u8], scale: Option<f32>) -> ([f64; 128], f64) {
    let mut k = [0f64; 128];
    match dtype {
        IndexKDtype::Fp8 => {
            for (d, kd) in k.iter_mut().enumerate() {
                *kd = E4M3.with(|t| t[values[d] as usize]);
            }
            (k, scale.map_or(1.0, |s| s as f64))
        }
        IndexKDtype::Bf16 => {
            for (d, kd) in k.iter_mut().enumerate() {
                let bits = u16::from_le_bytes([values[2 * d], values[2 * d + 1]]) as u32;
                *kd = f32::from_bits(bits << 16) as f64;
            }
            (k, 1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One e4m3 step is the spacing of codes: 2^-9 below 2^-6, then 1/8 of the power of two.
    #[test]
    fn e4m3_steps_are_the_code_spacing() {
        assert_eq!(e4m3_step(0.001), 2f64.powi(-9));
        assert_eq!(e4m3_step(1.0), 0.125);
        assert_eq!(e4m3_step(-1.99), 0.125);
        assert_eq!(e4m3_step(2.0), 0.25);
        assert_eq!(e4m3_step(448.0), 32.0);
        assert_eq!(e4m3_step(2f64.powi(-6)), 2f64.powi(-9));
    }

    /// Sylvester's recursion is the matrix `H[i][j] = (-1)^popcount(i & j) / √128`.
    #[test]
    fn hadamard_is_its_matrix_definition() {
        let x: Vec<f64> = (0..128)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 7.0)
            .collect();
        let by_matrix: Vec<f64> = (0..128usize)
            .map(|i| {
                (0..128usize)
                    .map(|j| {
                        if (i & j).count_ones() % 2 == 0 {
                            x[j]
                        } else {
                            -x[j]
                        }
                    })
                    .sum::<f64>()
                    / 128f64.sqrt()
            })
            .collect();
        for (a, b) in hadamard_f64(&x).iter().zip(&by_matrix) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
    }
}
