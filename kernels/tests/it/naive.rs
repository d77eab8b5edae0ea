//! Independent versions of the kernels, written from their specification (DESIGN §3–4) without
//! the CPU references' code: f64 arithmetic where the reference fixes an f32 operation order,
//! sorts where it selects, byte loops where it copies. The property tests (`reference.rs`) and
//! the CPU instances of the conformance bodies (`conformance.rs`) hold the references to these,
//! so a bug in a reference cannot hide behind a comparison of the reference with itself.

use half::bf16;
use tierkv_kernels::cpu::{self, numerics::e4m3_decode};
use tierkv_kernels::layout::*;

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
        2f64.powi(a.log2().floor() as i32 - 3)
    }
}

/// LayerNorm (when `ln`) → NeoX RoPE on dims 0..64 → Hadamard 128 / √128, in f64.
pub fn pipeline_f64(key: &[bf16], gamma: &[f32], beta: &[f32], rope: &[f32], ln: bool) -> Vec<f64> {
    let x: Vec<f64> = key.iter().map(|v| v.to_f32() as f64).collect();
    let mut y = x.clone();
    if ln {
        let mean = x.iter().sum::<f64>() / 128.0;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 128.0;
        let rstd = 1.0 / (var + 1e-6).sqrt();
        for i in 0..128 {
            y[i] = (x[i] - mean) * rstd * gamma[i] as f64 + beta[i] as f64;
        }
    }
    let r = y.clone();
    for i in 0..32 {
        let (c, s) = (rope[i] as f64, rope[32 + i] as f64);
        y[i] = r[i] * c - r[i + 32] * s;
        y[i + 32] = r[i + 32] * c + r[i] * s;
    }
    // Hadamard by its matrix definition: H[i][j] = (-1)^popcount(i & j) / sqrt(128).
    (0..128usize)
        .map(|i| {
            (0..128usize)
                .map(|j| {
                    if (i & j).count_ones() % 2 == 0 {
                        y[j]
                    } else {
                        -y[j]
                    }
                })
                .sum::<f64>()
                / 128f64.sqrt()
        })
        .collect()
}

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// A value of fp8 codes × `scale` against its f64 value: within one e4m3 step (plus a hair of
/// the row's largest value for the f32 rounding before quantisation).
fn close_fp8(code: u8, scale: f64, want: f64, amax: f64) -> bool {
    let v = e4m3_decode(code) as f64 * scale;
    (v - want).abs() <= e4m3_step(want / scale) * scale + 1e-5 * amax
}

/// The fp8 scale of a row with largest magnitude `amax`: `max(amax, 1e-4) / 448`, rounded up to
/// a power of two under `ue8m0`.
fn check_scale(scale: f64, amax: f64, ue8m0: bool) -> Result<(), String> {
    let exact = amax.max(1e-4) / 448.0;
    let ok = if ue8m0 {
        scale >= exact * (1.0 - 1e-6)
            && scale < 2.0 * exact * (1.0 + 1e-6)
            && (scale as f32).to_bits() & 0x7F_FFFF == 0
    } else {
        (scale - exact).abs() <= 1e-5 * exact
    };
    ok.then_some(())
        .ok_or(format!("scale {scale:e} for amax {amax:e} (ue8m0 {ue8m0})"))
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
        let want = pipeline_f64(
            &a.keys[i * 128..(i + 1) * 128],
            a.gamma,
            a.beta,
            &a.rope[i * 64..(i + 1) * 64],
            true,
        );
        let amax = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        let page = &after[(s as usize / 64) * pb..][..pb];
        let t = s as u32 % 64;
        match a.dtype {
            IndexKDtype::Fp8 => {
                let scale = f32_at(page, index_k_page::scale_offset(a.dtype, t).unwrap()) as f64;
                check_scale(scale, amax, a.ue8m0).map_err(|e| format!("slot {s}: {e}"))?;
                for d in 0..128u32 {
                    let code = page[index_k_page::value_offset(a.dtype, t, d)];
                    if !close_fp8(code, scale, want[d as usize], amax) {
                        return Err(format!(
                            "slot {s} dim {d}: code {code:#04x} for {}",
                            want[d as usize]
                        ));
                    }
                }
            }
            IndexKDtype::Bf16 => {
                for d in 0..128u32 {
                    let at = index_k_page::value_offset(a.dtype, t, d);
                    let v = bf16::from_bits(u16::from_le_bytes([page[at], page[at + 1]])).to_f32()
                        as f64;
                    let w = want[d as usize];
                    if (v - w).abs() > w.abs() * 2f64.powi(-8) + 1e-5 {
                        return Err(format!("slot {s} dim {d}: {v} vs {w}"));
                    }
                }
            }
        }
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
        match a.dtype {
            KvDtype::Bf16 => {
                let bits: Vec<u8> = row.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
                if bits != out {
                    return Err(format!("slot {s}: bf16 row differs from its input"));
                }
            }
            _ => {
                for tile in 0..4 {
                    let vals: Vec<f64> = row[tile * 128..(tile + 1) * 128]
                        .iter()
                        .map(|v| v.to_f32() as f64)
                        .collect();
                    let amax = vals.iter().fold(0f64, |m, v| m.max(v.abs()));
                    let scale = f32_at(out, 512 + 4 * tile) as f64;
                    check_scale(scale, amax, false)
                        .map_err(|e| format!("slot {s} tile {tile}: {e}"))?;
                    for (j, &w) in vals.iter().enumerate() {
                        if !close_fp8(out[tile * 128 + j], scale, w, amax) {
                            return Err(format!("slot {s} latent {}: {w}", tile * 128 + j));
                        }
                    }
                }
                for r in 0..64 {
                    let at = 528 + 2 * r;
                    if u16::from_le_bytes([out[at], out[at + 1]]) != row[512 + r].to_bits() {
                        return Err(format!("slot {s} rope {r}"));
                    }
                }
            }
        }
    }
    untouched(before, after, |i| Some(i / tb), a.slots)
}

/// `q_prep` as specified: each (token, head) query through RoPE and Hadamard in f64, fp8 with
/// scale `amax / 448`, and that scale folded into the head weight.
pub fn check_q_prep(a: &cpu::QPrepArgs, q_out: &[u8], w_out: &[f32]) -> Result<(), String> {
    for t in 0..a.rope.len() / 64 {
        for h in 0..a.heads {
            let i = t * a.heads + h;
            let want = pipeline_f64(
                &a.q[i * 128..(i + 1) * 128],
                &[],
                &[],
                &a.rope[t * 64..(t + 1) * 64],
                false,
            );
            let amax = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            let scale = amax.max(1e-4) / 448.0;
            let w = a.weights[i] as f64 * scale;
            if (w_out[i] as f64 - w).abs() > 1e-5 * w.abs() + 1e-12 {
                return Err(format!("token {t} head {h}: weight {} vs {w}", w_out[i]));
            }
            for d in 0..128 {
                if !close_fp8(q_out[i * 128 + d], scale, want[d], amax) {
                    return Err(format!("token {t} head {h} dim {d}: code vs {}", want[d]));
                }
            }
        }
    }
    Ok(())
}

/// `topk` by sorting: the `k` highest logits of each row's context (ties to the lower position,
/// `-inf` last), as slots through the row's page table, `-1` padding.
pub fn topk(a: &cpu::TopKArgs) -> Vec<i32> {
    let mut out = Vec::new();
    for (r, &len) in a.context_lens.iter().enumerate() {
        let row = &a.logits[r * a.stride..][..len as usize];
        let mut order: Vec<usize> = (0..row.len()).collect();
        // Descending by value, +0 above -0; equal values by ascending position.
        order.sort_by(|&x, &y| {
            row[y]
                .partial_cmp(&row[x])
                .unwrap()
                .then(row[x].is_sign_negative().cmp(&row[y].is_sign_negative()))
                .then(x.cmp(&y))
        });
        let pt = &a.page_table[r * a.pt_stride..];
        for i in 0..a.k {
            out.push(
                order
                    .get(i)
                    .map_or(-1, |&n| pt[n / 64] * 64 + (n % 64) as i32),
            );
        }
    }
    out
}

/// `sparse_read` from the digest's definition: per selected row, the wrapping sum over its
/// 8-byte words of `mix(word ^ (j+1)·φ)`; per row of selections, the wrapping sum over ranks of
/// `mix(row_hash ^ (i+1)·ψ)`, padding skipped.
pub fn sparse_read(a: &cpu::SparseReadArgs, kv: &[u8], rows: usize) -> Vec<u64> {
    const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
    const PSI: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let tb = PageFormat::Kv(a.dtype).token_bytes() as usize;
    (0..rows)
        .map(|r| {
            let mut acc = 0u64;
            for (i, &s) in a.slots[r * a.k..(r + 1) * a.k].iter().enumerate() {
                if s < 0 {
                    continue;
                }
                let mut h = 0u64;
                for (j, w) in kv[s as usize * tb..][..tb].chunks(8).enumerate() {
                    let w = u64::from_le_bytes(w.try_into().unwrap());
                    h = h.wrapping_add(splitmix(w ^ (j as u64 + 1).wrapping_mul(PHI)));
                }
                acc = acc.wrapping_add(splitmix(h ^ (i as u64 + 1).wrapping_mul(PSI)));
            }
            acc
        })
        .collect()
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
    let mut k = [0f64; 128];
    match dtype {
        IndexKDtype::Fp8 => {
            for (d, kd) in k.iter_mut().enumerate() {
                *kd = E4M3.with(|table| table[page[t * 128 + d] as usize]);
            }
            (k, f32_at(page, 8192 + 4 * t) as f64)
        }
        IndexKDtype::Bf16 => {
            for (d, kd) in k.iter_mut().enumerate() {
                let at = (t * 128 + d) * 2;
                let bits = u16::from_le_bytes([page[at], page[at + 1]]) as u32;
                *kd = f32::from_bits(bits << 16) as f64;
            }
            (k, 1.0)
        }
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
        let q: Vec<f64> = a.q[r * a.heads * 128..][..a.heads * 128]
            .iter()
            .map(|&c| e4m3(c))
            .collect();
        for n in 0..a.context_lens[r] as usize {
            let page = a.page_table[r * a.pt_stride + n / 64] as usize;
            let (k, ks) = key_f64(a.dtype, &pool[page * pb..][..pb], n % 64);
            let (mut s, mut m) = (0f64, 0f64);
            for h in 0..a.heads {
                let q = &q[h * 128..][..128];
                let w = a.weights[r * a.heads + h] as f64;
                let terms = (0..128).map(|d| q[d] * k[d]);
                let (dot, abs) = terms.fold((0f64, 0f64), |(x, y), t| (x + t, y + t.abs()));
                s += w * dot.max(0.0);
                m += w.abs() * abs;
            }
            value[r * a.out_stride + n] = ks * s;
            magnitude[r * a.out_stride + n] = ks.abs() * m;
        }
    }
    (value, magnitude)
}
