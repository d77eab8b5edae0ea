//! The specification: independent versions of the kernels and of the byte formats they write,
//! from the design (docs/DESIGN.md §3–4), sharing no code with the CPU references or with the
//! layout module. f64 arithmetic where a reference fixes an f32 operation order, sorts where it
//! selects, byte loops where it copies; the fp8 (e4m3fn) and bf16 formats decoded and rounded
//! from their definitions; every byte offset and stride from [`format`](mod@format), written here from the
//! design's byte tables. It takes the references' argument structs, the dtype and host-order
//! enums (the names of the formats, which carry no size or offset) and the RoPE settings
//! (`RopeParams`, plain values), and nothing else of the crate. Nothing in
//! production calls it. The kernels' tests and the simulator's oracles hold the references, the
//! CUDA kernels and the engine's layout to it.
//!
//! **What a check accepts.** A reference computes a row in f32; this module computes the same
//! row in f64 together with a bound on the f32 computation's rounding error (the *running error
//! bound* of [`Pipeline`]). A stored fp8 or bf16 code is accepted exactly when it is the code
//! round-to-nearest-even gives some value within that bound of the f64 value: nearly always one
//! code, two only for a value within the bound of the midpoint between two codes. So truncation,
//! rounding away from zero and a code one step off are all refused (a test shows each), except
//! for values so close to a midpoint that the f32 computation could have landed on either side.
//! Where the op is a fixed sequence of exactly rounded IEEE f32 operations on exact inputs (the
//! fp8 KV row: a maximum, one division for the scale, one division per value) the specification
//! computes those operations itself and the bytes must be equal.

use crate::args;
use crate::cpu;
use crate::{IndexKDtype, KvDtype};
use half::bf16;

/// The byte formats of DESIGN §3, written out here apart from `layout.rs` so that a slip there
/// (an offset, a stride) is a disagreement here rather than a shared assumption.
///
/// - An index-K page holds 64 tokens. fp8: the 128 e4m3 codes of token `t` at `128t .. 128t+128`,
///   then the 64 tokens' f32 scales at `8192 + 4t` (8448 B in all). bf16: token `t`'s 128 values
///   at `256t`, two bytes each, little-endian (16384 B), no scale.
/// - An MLA KV row (one token). bf16: 576 values, two bytes each (1152 B). Packed fp8: 512 e4m3
///   latent codes, the four tiles' f32 scales at `512 + 4i`, the 64 RoPE values as bf16 at
///   `528 + 2r` (656 B). The foreign unpacked fp8 row: 576 codes (576 B). A slot `s` of a paged
///   KV buffer is row `s` (pages are 64 consecutive rows).
/// - A device pool holds one layer: page `p` at `p · page_bytes`. The host mirror holds every
///   layer of a kind: page `p` of layer `l` at `(l · pages + p) · page_bytes` when layer-first,
///   `(p · layers + l) · page_bytes` when page-first.
pub mod format {
    use crate::{HostLayout, IndexKDtype, KvDtype};

    pub const PAGE_TOKENS: usize = 64;
    /// Values of an index key and of a query head.
    pub const HEAD_DIM: usize = 128;

    /// Bytes of one index-K page.
    pub fn index_k_page_bytes(dtype: IndexKDtype) -> usize {
        match dtype {
            IndexKDtype::Fp8 => 64 * 128 + 64 * 4,
            IndexKDtype::Bf16 => 64 * 128 * 2,
        }
    }
    /// Where token `t`'s values start in an index-K page, and how many bytes they take.
    pub fn index_k_values(dtype: IndexKDtype, t: usize) -> (usize, usize) {
        match dtype {
            IndexKDtype::Fp8 => (128 * t, 128),
            IndexKDtype::Bf16 => (256 * t, 256),
        }
    }
    /// Where token `t`'s f32 scale is in an index-K page (fp8 only).
    pub fn index_k_scale(dtype: IndexKDtype, t: usize) -> Option<usize> {
        match dtype {
            IndexKDtype::Fp8 => Some(8192 + 4 * t),
            IndexKDtype::Bf16 => None,
        }
    }
    /// Which token an index-K page's byte `at` belongs to.
    pub fn index_k_token_of(dtype: IndexKDtype, at: usize) -> usize {
        match dtype {
            IndexKDtype::Fp8 if at >= 8192 => (at - 8192) / 4,
            IndexKDtype::Fp8 => at / 128,
            IndexKDtype::Bf16 => at / 256,
        }
    }
    /// Bytes of one KV row.
    pub fn kv_row_bytes(dtype: KvDtype) -> usize {
        match dtype {
            KvDtype::Bf16 => 576 * 2,
            KvDtype::Fp8Packed => 512 + 4 * 4 + 64 * 2,
            KvDtype::Fp8Unpacked => 576,
        }
    }
    /// Packed fp8 KV rows: where the tile scales and the RoPE values start.
    pub const KV_FP8_SCALES: usize = 512;
    pub const KV_FP8_ROPE: usize = 528;
    /// Bytes of one KV page.
    pub fn kv_page_bytes(dtype: KvDtype) -> usize {
        PAGE_TOKENS * kv_row_bytes(dtype)
    }

    /// Where a tier keeps its pages: a device pool (one layer), or one layer of the host mirror.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Placement {
        Device,
        Host {
            order: HostLayout,
            layers: u32,
            pages: u32,
            layer: u32,
        },
    }

    /// Where page `page` of `placement` starts, for pages of `page_bytes`.
    pub fn page_at(placement: Placement, page_bytes: usize, page: u32) -> usize {
        let (page, pb) = (page as usize, page_bytes);
        match placement {
            Placement::Device => page * pb,
            Placement::Host {
                order: HostLayout::LayerFirst,
                pages,
                layer,
                ..
            } => (layer as usize * pages as usize + page) * pb,
            Placement::Host {
                order: HostLayout::PageFirst,
                layers,
                layer,
                ..
            } => (page * layers as usize + layer as usize) * pb,
        }
    }
}

use format::{HEAD_DIM, PAGE_TOKENS};

/// DeepSeek's rotary frequencies, from the formula of `precompute_freqs_cis` (DeepSeek-V3.2-Exp,
/// `inference/model.py`), apart from the `rope` module the engine builds its rows with:
/// frequency `i` of 32 is `θ^(-2i/64)`; when YaRN applies (under the servers' rule, whenever
/// its factor is above 1; under the reference's, when the longest sequence served is above the
/// length the model was trained at), it divides the low frequencies by `factor`, keeps the high
/// ones, and blends linearly between the dimension indices where a frequency turns `beta_fast` and
/// `beta_slow` times over the trained length (`64 · ln(L / (2π·rotations)) / (2 ln θ)`, floored
/// and ceiled, clamped to `0..=63`, 0.001 apart at least).
pub fn rope_inv_freq(p: &crate::rope::RopeParams) -> [f64; 32] {
    let plain: [f64; 32] = std::array::from_fn(|i| 1.0 / p.theta.powf(2.0 * i as f64 / 64.0));
    // A factor of 1 divides nothing: no YaRN under either rule.
    let yarn = p.factor > 1.0
        && match p.yarn_rule {
            crate::rope::YarnRule::Configured => true,
            crate::rope::YarnRule::ContextAboveOriginal => p.max_seq_len > p.original_seq_len,
        };
    if !yarn {
        return plain;
    }
    let turns_at = |rotations: f64| {
        64.0 * (p.original_seq_len as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * p.theta.ln())
    };
    let low = turns_at(p.beta_fast).floor().max(0.0);
    let mut high = turns_at(p.beta_slow).ceil().min(63.0);
    if low == high {
        high += 0.001;
    }
    std::array::from_fn(|i| {
        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
        plain[i] / p.factor * ramp + plain[i] * (1.0 - ramp)
    })
}

/// The RoPE row of `position` in f64: 32 cosines, then 32 sines, of `position · inv_freq[i]`.
pub fn rope_row(inv_freq: &[f64; 32], position: u32) -> [f64; 64] {
    std::array::from_fn(|j| {
        let angle = position as f64 * inv_freq[j % 32];
        if j < 32 {
            angle.cos()
        } else {
            angle.sin()
        }
    })
}

/// f32's unit roundoff, 2^-24: an exactly rounded f32 operation is off by at most this much of
/// its result.
pub const U32: f64 = 1.0 / 16_777_216.0;

/// The row pipelines' error bound, in units of [`U32`] times the magnitude `M` of
/// [`Pipeline::err`]. Counted from the f32 operations a value goes through: LayerNorm's mean
/// and variance (128-term sums in a warp's order: 4 in a lane, 5 butterfly levels, then the
/// square root and the division for `rstd`, about 12 roundings, each bounded by the running
/// magnitude), RoPE's two products and a sum (3) and its table's rounding to f32 (1), the
/// Hadamard's 7 butterfly levels and the 1/√128 (8): 24 in all, taken as 32.
pub const PIPELINE_ERROR_UNITS: f64 = 32.0;

/// The f64 value of a row pipeline and the bound on how far the f32 computation of it may be.
#[derive(Clone, Copy, Debug)]
pub struct Pipeline {
    pub values: [f64; 128],
    /// The same for every value: each Hadamard output sums every input once.
    pub err: f64,
}

impl Pipeline {
    pub fn amax(&self) -> f64 {
        self.values.iter().fold(0f64, |m, v| m.max(v.abs()))
    }
}

/// LayerNorm (when `ln`) → NeoX RoPE on dims 0..64 → Hadamard 128 / √128, in f64, with the
/// bound on the f32 computation's error: `PIPELINE_ERROR_UNITS · U32 · M`, where `M` is
/// `Σ_j m_j / √128` over the magnitudes `m_j` each value carries into the Hadamard (LayerNorm's
/// `(|x_j| + Σ|x| / 128) · rstd · |γ_j| + |β_j|`, RoPE's `m_i|c| + m_{i+32}|s|`). `rope` is the
/// position's row, 32 cosines then 32 sines: exact ([`rope_row`]) or as a kernel was given them
/// (rounded to f32; the bound counts that rounding).
pub fn pipeline_f64(key: &[bf16], gamma: &[f32], beta: &[f32], rope: &[f64], ln: bool) -> Pipeline {
    assert_eq!(key.len(), HEAD_DIM, "a 128-value row");
    let x: [f64; 128] = std::array::from_fn(|i| key[i].to_f32() as f64);
    let mut y = x;
    let mut m: [f64; 128] = std::array::from_fn(|i| x[i].abs());
    if ln {
        let mean = x.iter().sum::<f64>() / 128.0;
        let mean_abs = x.iter().map(|v| v.abs()).sum::<f64>() / 128.0;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 128.0;
        let rstd = 1.0 / (var + 1e-6).sqrt();
        for i in 0..128 {
            y[i] = (x[i] - mean) * rstd * gamma[i] as f64 + beta[i] as f64;
            m[i] =
                (x[i].abs() + mean_abs) * rstd * (gamma[i] as f64).abs() + (beta[i] as f64).abs();
        }
    }
    let (r, rm) = (y, m);
    for i in 0..32 {
        let (c, s) = (rope[i], rope[32 + i]);
        y[i] = r[i] * c - r[i + 32] * s;
        y[i + 32] = r[i + 32] * c + r[i] * s;
        m[i] = rm[i] * c.abs() + rm[i + 32] * s.abs();
        m[i + 32] = rm[i + 32] * c.abs() + rm[i] * s.abs();
    }
    let magnitude = m.iter().sum::<f64>() / 128f64.sqrt();
    Pipeline {
        values: hadamard_f64(&y),
        err: PIPELINE_ERROR_UNITS * U32 * magnitude,
    }
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
    f32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// `2^e`, for `e` in f64's normal range, built from its bits.
const fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// The binade of a positive normal `a`: `floor(log2 a)`, read off its exponent field.
fn binade(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023
}

/// An e4m3fn code's value from the format's definition: sign, 4 exponent bits (bias 7), 3
/// mantissa bits, subnormals at exponent 0, NaN at `s.1111.111`, no infinities. A normal code is
/// `(1 + m/8) · 2^(e-7) = (8 + m) · 2^(e-10)`; a subnormal one `m · 2^-9`.
pub fn e4m3(code: u8) -> f64 {
    E4M3_VALUES[code as usize]
}

/// [`e4m3`] of every code, computed at compile time by [`e4m3_value`].
static E4M3_VALUES: [f64; 256] = {
    let mut t = [0f64; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = e4m3_value(c as u8);
        c += 1;
    }
    t
};

/// An e4m3fn code's value, computed from its fields.
const fn e4m3_value(code: u8) -> f64 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((code >> 3) & 0xF) as i32, (code & 0x7) as f64);
    if e == 0xF && m == 7.0 {
        return f64::NAN;
    }
    let mag = if e == 0 {
        m * pow2(-9)
    } else {
        (8.0 + m) * pow2(e - 10)
    };
    sign * mag
}

/// The largest finite e4m3fn magnitude (code 0x7E).
pub const E4M3_MAX: f64 = 448.0;

/// The e4m3fn code round-to-nearest-even gives `x`: the nearest finite code, a tie to the code
/// whose last mantissa bit is 0; magnitudes past 448 saturate to ±448 (CUDA's
/// `__NV_SATFINITE`); the sign is kept (a negative value that rounds to zero is -0); NaN is the
/// NaN code of its sign. Codes are spaced `2^-9` below `2^-6` (the subnormals) and by an eighth
/// of the binade above, so rounding is to the nearest multiple of that spacing, ties to an even
/// multiple (an even multiple is a code with mantissa bit 0, across a binade's top too).
pub fn e4m3_rne(x: f64) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    let spacing = if a < pow2(-6) {
        pow2(-9)
    } else {
        pow2(binade(a) - 3)
    };
    // Exact: a division and a multiplication by a power of two.
    let v = (a / spacing).round_ties_even() * spacing;
    let code = if v < pow2(-6) {
        (v / pow2(-9)) as u8
    } else if v >= E4M3_MAX {
        0x7E
    } else {
        let e = binade(v);
        let m = (v / pow2(e) - 1.0) * 8.0;
        (((e + 7) as u8) << 3) | m as u8
    };
    sign | code
}

/// Whether `code` is the e4m3fn code round-to-nearest-even gives some value within `slack` of
/// `x`. A zero's sign must be one such a value rounds to: a value of magnitude at most 2^-10 (half
/// the smallest subnormal, the tie going to the even zero) rounds to the zero of its sign.
pub fn e4m3_code_ok(code: u8, x: f64, slack: f64) -> bool {
    // The code of `x` itself is always one of them (and carries `x`'s sign at zero).
    if code == e4m3_rne(x) {
        return true;
    }
    let v = e4m3(code);
    if v.is_nan() {
        return false;
    }
    let (lo, hi) = (x - slack, x + slack);
    if v == 0.0 {
        let tie = 2f64.powi(-10);
        return if code & 0x80 != 0 {
            lo <= 0.0 && hi >= -tie
        } else {
            hi >= 0.0 && lo <= tie
        };
    }
    e4m3(e4m3_rne(lo)) <= v && v <= e4m3(e4m3_rne(hi))
}

/// A bf16 value from its bits (the upper half of an f32).
pub fn bf16_of(bits: u16) -> f64 {
    f32::from_bits((bits as u32) << 16) as f64
}

/// The bf16 bits round-to-nearest-even gives `x` (finite, below bf16's largest value): 8
/// significant bits, spacing `2^(e - 7)` in binade `e`, subnormal spacing below 2^-126.
pub fn bf16_rne(x: f64) -> u16 {
    let sign = if x.is_sign_negative() { 0x8000u16 } else { 0 };
    let a = x.abs();
    if a == 0.0 {
        return sign;
    }
    let spacing = pow2(binade(a).max(-126) - 7);
    // Exact: a division and a multiplication by a power of two.
    let v = (a / spacing).round_ties_even() * spacing;
    sign | ((v as f32).to_bits() >> 16) as u16
}

/// Whether bf16 `bits` are what round-to-nearest-even gives some value within `slack` of `x`.
pub fn bf16_code_ok(bits: u16, x: f64, slack: f64) -> bool {
    let v = bf16_of(bits);
    let (lo, hi) = (bf16_of(bf16_rne(x - slack)), bf16_of(bf16_rne(x + slack)));
    lo <= v && v <= hi
}

/// `v` rounded up to a power of two: itself when its mantissa is 0 (`v` positive and normal).
fn pow2_up(v: f64) -> f64 {
    let bits = v.to_bits();
    let mantissa = bits & ((1u64 << 52) - 1);
    if mantissa == 0 {
        v
    } else {
        f64::from_bits((bits & !((1u64 << 52) - 1)) + (1u64 << 52))
    }
}

fn is_pow2(v: f64) -> bool {
    v > 0.0 && v.to_bits() & ((1u64 << 52) - 1) == 0
}

/// The fp8 scale of a row whose largest magnitude is `amax ± err`: `max(amax, 1e-4) / 448`
/// computed in f32 (so within `err / 448` and two roundings of the exact one), or under `ue8m0`
/// that rounded up to a power of two (so one of the powers of two the interval rounds up to:
/// one, or two when the interval holds a power of two).
pub fn check_scale(scale: f64, amax: f64, err: f64, ue8m0: bool) -> Result<(), String> {
    let lo = (amax - err).max(1e-4) / E4M3_MAX * (1.0 - 2.0 * U32);
    let hi = (amax + err).max(1e-4) / E4M3_MAX * (1.0 + 2.0 * U32);
    let ok = if ue8m0 {
        is_pow2(scale) && pow2_up(lo) <= scale && scale <= pow2_up(hi)
    } else {
        lo <= scale && scale <= hi
    };
    ok.then_some(())
        .ok_or_else(|| format!("scale {scale:e} for amax {amax:e} ± {err:e} (ue8m0 {ue8m0})"))
}

/// fp8 `codes` of `values` (± `err`, from an f32 computation) divided by `scale` in f32:
/// each the round-to-nearest-even code of some value within the bound.
fn check_codes(codes: &[u8], values: &[f64], err: f64, scale: f64) -> Result<(), String> {
    for (d, (&code, &w)) in codes.iter().zip(values).enumerate() {
        let x = w / scale;
        let slack = err / scale + 2.0 * U32 * x.abs();
        if !e4m3_code_ok(code, x, slack) {
            return Err(format!(
                "dim {d}: code {code:#04x} ({}) for {x} (± {slack:e}; round-to-nearest-even gives {:#04x})",
                e4m3(code),
                e4m3_rne(x)
            ));
        }
    }
    Ok(())
}

/// One index-K row as specified: the f64 pipeline of `key` (LayerNorm with `gamma`/`beta`, NeoX
/// RoPE with `rope`, Hadamard); fp8 `values` the round-to-nearest-even codes of it divided by
/// its `scale`, the scale as [`check_scale`] says; or bf16 `values` (little-endian) rounded to
/// nearest even from it.
#[allow(clippy::too_many_arguments)]
pub fn check_index_k_row(
    dtype: IndexKDtype,
    ue8m0: bool,
    key: &[bf16],
    gamma: &[f32],
    beta: &[f32],
    rope: &[f64],
    values: &[u8],
    scale: Option<f32>,
) -> Result<(), String> {
    let p = pipeline_f64(key, gamma, beta, rope, true);
    match dtype {
        IndexKDtype::Fp8 => {
            let scale = scale.ok_or("an fp8 row without a scale")? as f64;
            check_scale(scale, p.amax(), p.err, ue8m0)?;
            check_codes(&values[..HEAD_DIM], &p.values, p.err, scale)
        }
        IndexKDtype::Bf16 => {
            for d in 0..HEAD_DIM {
                let bits = u16::from_le_bytes([values[2 * d], values[2 * d + 1]]);
                let w = p.values[d];
                // The f32 value's bound, and the f32 rounding of it.
                let slack = p.err + U32 * w.abs();
                if !bf16_code_ok(bits, w, slack) {
                    return Err(format!(
                        "dim {d}: bf16 {} for {w} (± {slack:e}; round-to-nearest-even gives {})",
                        bf16_of(bits),
                        bf16_of(bf16_rne(w))
                    ));
                }
            }
            Ok(())
        }
    }
}

/// One KV row's bytes as specified. bf16: the input bits. Packed fp8, per tile of 128 latent
/// values: the scale `max(amax, 1e-4) / 448` as one f32 division (`amax` is exact: a maximum),
/// each code the round-to-nearest-even e4m3 of the value divided by the scale in f32; then the
/// 64 RoPE values' bf16 bits.
pub fn kv_row(dtype: KvDtype, row: &[bf16]) -> Vec<u8> {
    assert_eq!(row.len(), 576, "a 576-value KV row");
    let mut out = vec![0u8; format::kv_row_bytes(dtype)];
    match dtype {
        KvDtype::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(row) {
                o.copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        KvDtype::Fp8Packed => {
            for tile in 0..4 {
                let vals = &row[tile * 128..(tile + 1) * 128];
                let amax = vals.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                let scale = amax.max(1e-4) / 448.0;
                for (j, v) in vals.iter().enumerate() {
                    out[tile * 128 + j] = e4m3_rne((v.to_f32() / scale) as f64);
                }
                let at = format::KV_FP8_SCALES + 4 * tile;
                out[at..at + 4].copy_from_slice(&scale.to_le_bytes());
            }
            for r in 0..64 {
                let at = format::KV_FP8_ROPE + 2 * r;
                out[at..at + 2].copy_from_slice(&row[512 + r].to_bits().to_le_bytes());
            }
        }
        KvDtype::Fp8Unpacked => panic!("the unpacked fp8 KV row is never stored"),
    }
    out
}

/// One KV row as specified ([`kv_row`]): the bytes must be equal.
pub fn check_kv_row(dtype: KvDtype, row: &[bf16], out: &[u8]) -> Result<(), String> {
    let want = kv_row(dtype, row);
    match out.iter().zip(&want).position(|(a, b)| a != b) {
        _ if out.len() != want.len() => Err(format!(
            "a {} B row, the format's is {} B",
            out.len(),
            want.len()
        )),
        None => Ok(()),
        Some(b) => Err(format!(
            "byte {b} is {:#04x}, the specification's {:#04x}",
            out[b], want[b]
        )),
    }
}

/// One query head as specified: through RoPE and Hadamard in f64; fp8 `codes` the
/// round-to-nearest-even codes at the head's scale (`amax / 448` computed in f32, rounded up to
/// a power of two under `ue8m0`); and the folded weight DeepSeek-V3.2-Exp's `Indexer.forward`
/// computes, `w · heads^-½ · q_scale · index_head_dim^-½` with `index_head_dim` 128, in
/// `w_out` (four f32 roundings). `heads` is the model's indexer head count. The scale is not
/// stored: it is read back from the folded weight where `w` is not 0.
#[allow(clippy::too_many_arguments)]
pub fn check_q_head(
    q: &[bf16],
    w: f32,
    rope: &[f64],
    heads: usize,
    ue8m0: bool,
    codes: &[u8],
    w_out: f32,
) -> Result<(), String> {
    let p = pipeline_f64(q, &[], &[], rope, false);
    let amax = p.amax();
    let constant = 1.0 / (heads as f64).sqrt() / 128f64.sqrt();
    // The scales the kernel may have used, each with the relative uncertainty it carries into
    // the codes. With a weight, the one the folded weight carries (four f32 roundings), which
    // must be allowed; without, every allowed one.
    let mut candidates: Vec<(f64, f64)> = Vec::new();
    if w != 0.0 {
        let carried = w_out as f64 / (w as f64 * constant);
        let within = 5.0 * U32 * carried.abs();
        if ue8m0 {
            let pow2 = pow2_up(carried * (1.0 - 5.0 * U32));
            if (pow2 - carried).abs() <= within && check_scale(pow2, amax, p.err, true).is_ok() {
                candidates.push((pow2, 0.0));
            }
        } else if [carried - within, carried, carried + within]
            .iter()
            .any(|&s| check_scale(s, amax, p.err, false).is_ok())
        {
            candidates.push((carried, 5.0 * U32));
        }
        if candidates.is_empty() {
            return Err(format!(
                "the folded weight {w_out} carries scale {carried:e}: {}",
                check_scale(carried, amax, p.err, ue8m0).unwrap_err()
            ));
        }
    } else if w_out != 0.0 {
        return Err(format!("weight {w_out} for a head weight of 0"));
    } else if ue8m0 {
        let lo = pow2_up((amax - p.err).max(1e-4) / E4M3_MAX * (1.0 - 2.0 * U32));
        candidates.push((lo, 0.0));
        if check_scale(2.0 * lo, amax, p.err, true).is_ok() {
            candidates.push((2.0 * lo, 0.0));
        }
    } else {
        let nominal = amax.max(1e-4) / E4M3_MAX;
        candidates.push((nominal, p.err / amax.max(1e-4) + 3.0 * U32));
    }
    let mut why = String::new();
    for (scale, widen) in candidates {
        let bad = p
            .values
            .iter()
            .zip(codes)
            .enumerate()
            .find(|&(_, (&v, &code))| {
                let x = v / scale;
                !e4m3_code_ok(code, x, p.err / scale + (widen + 2.0 * U32) * x.abs())
            });
        match bad {
            None => return Ok(()),
            Some((d, (&v, &code))) => {
                why = format!(
                    "dim {d}: code {code:#04x} ({}) for {} at scale {scale:e} (round-to-nearest-even gives {:#04x})",
                    e4m3(code),
                    v / scale,
                    e4m3_rne(v / scale)
                )
            }
        }
    }
    Err(why)
}

/// A RoPE row as a kernel was given it, in f64.
pub fn f64s(row: &[f32]) -> Vec<f64> {
    row.iter().map(|&v| v as f64).collect()
}

/// Bytes outside the rows of `slots` are what they were.
fn untouched(
    before: &[u8],
    after: &[u8],
    row_of: impl Fn(usize) -> usize,
    slots: &[i32],
) -> Result<(), String> {
    for (i, (a, b)) in before.iter().zip(after).enumerate() {
        if a != b && !slots.contains(&(row_of(i) as i32)) {
            return Err(format!("byte {i} outside the stored rows changed"));
        }
    }
    Ok(())
}

/// `index_k_store` as specified: each slot's row, read through [`format`](mod@format), is the f64
/// pipeline's (fp8 codes and scale, or bf16, as [`check_index_k_row`] accepts), and nothing
/// else changed.
pub fn check_index_k_store(
    a: &args::IndexKStore,
    x: &cpu::IndexKStoreInputs,
    before: &[u8],
    after: &[u8],
) -> Result<(), String> {
    let pb = format::index_k_page_bytes(a.dtype);
    for (i, &s) in a.slots.iter().enumerate() {
        let (page, t) = (s as usize / PAGE_TOKENS, s as usize % PAGE_TOKENS);
        let page = &after[page * pb..][..pb];
        let (at, len) = format::index_k_values(a.dtype, t);
        let scale = format::index_k_scale(a.dtype, t).map(|off| f32_at(page, off));
        check_index_k_row(
            a.dtype,
            a.ue8m0,
            &x.keys[i * 128..(i + 1) * 128],
            x.gamma,
            x.beta,
            &f64s(&x.rope[i * 64..(i + 1) * 64]),
            &page[at..at + len],
            scale,
        )
        .map_err(|e| format!("slot {s}: {e}"))?;
    }
    let row_of = |i: usize| (i / pb) * PAGE_TOKENS + format::index_k_token_of(a.dtype, i % pb);
    untouched(before, after, row_of, &a.slots)
}

/// `kv_store` as specified: each slot's row is [`kv_row`]'s bytes, and nothing else changed.
pub fn check_kv_store(
    a: &args::KvStore,
    rows: &[bf16],
    before: &[u8],
    after: &[u8],
) -> Result<(), String> {
    let rb = format::kv_row_bytes(a.dtype);
    for (i, &s) in a.slots.iter().enumerate() {
        let row = &rows[i * 576..(i + 1) * 576];
        let out = &after[s as usize * rb..][..rb];
        check_kv_row(a.dtype, row, out).map_err(|e| format!("slot {s}: {e}"))?;
    }
    untouched(before, after, |i| i / rb, &a.slots)
}

/// `q_prep` as specified: each (token, head) query as [`check_q_head`] accepts.
pub fn check_q_prep(
    a: &args::QPrep,
    x: &cpu::QPrepInputs,
    q_out: &[u8],
    w_out: &[f32],
) -> Result<(), String> {
    let heads = a.heads as usize;
    for t in 0..a.rows as usize {
        for h in 0..heads {
            let i = t * heads + h;
            check_q_head(
                &x.q[i * 128..(i + 1) * 128],
                x.weights[i],
                &f64s(&x.rope[t * 64..(t + 1) * 64]),
                heads,
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
pub fn topk(a: &args::TopK, logits: &[f32]) -> Vec<i32> {
    let mut out = Vec::new();
    let k = a.k as usize;
    for (r, &len) in a.context_lens.iter().enumerate() {
        let order = topk_order(&logits[r * a.stride as usize..][..len as usize], k);
        let pt = &a.page_table[r * a.pt_stride as usize..];
        for i in 0..k {
            out.push(order.get(i).map_or(-1, |&n| {
                pt[n as usize / PAGE_TOKENS] * PAGE_TOKENS as i32
                    + (n as usize % PAGE_TOKENS) as i32
            }));
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

/// Whether `selection` (positions, in rank order) is a top-`k` of logits known only within
/// bounds: `scores[n] = (value, err)`, the f32 logit within `err` of `value`. It must select
/// `min(k, len)` distinct positions of the context, no unselected logit may be certainly above a
/// selected one, and each rank may not be certainly below the next. The message says which
/// condition failed first.
pub fn check_topk_within(selection: &[u32], scores: &[(f64, f64)], k: usize) -> Result<(), String> {
    let want = k.min(scores.len());
    if selection.len() != want {
        return Err(format!(
            "{} positions selected, top-{k} of a context of {} selects {want}",
            selection.len(),
            scores.len()
        ));
    }
    let mut chosen = vec![false; scores.len()];
    for (i, &n) in selection.iter().enumerate() {
        let n = n as usize;
        if n >= scores.len() || chosen[n] {
            return Err(format!(
                "rank {i}: position {n} is outside the context or selected twice"
            ));
        }
        chosen[n] = true;
    }
    for (i, w) in selection.windows(2).enumerate() {
        let ((a, ea), (b, eb)) = (scores[w[0] as usize], scores[w[1] as usize]);
        if a + ea < b - eb {
            return Err(format!(
                "rank {i} (position {}, logit {a:e} ± {ea:e}) is below rank {} (position {}, logit {b:e} ± {eb:e})",
                w[0],
                i + 1,
                w[1]
            ));
        }
    }
    let lowest = selection
        .iter()
        .map(|&n| scores[n as usize])
        .map(|(v, e)| v + e)
        .fold(f64::INFINITY, f64::min);
    if let Some((n, &(v, e))) = scores
        .iter()
        .enumerate()
        .find(|&(n, &(v, e))| !chosen[n] && v - e > lowest)
    {
        return Err(format!(
            "position {n} (logit {v:e} ± {e:e}) is not selected, yet above a selected logit (at most {lowest:e})"
        ));
    }
    Ok(())
}

/// `sparse_read` from the digest's definition, rows addressed through [`format`](mod@format).
pub fn sparse_read(a: &args::SparseRead, slots: &[i32], kv: &[u8]) -> Vec<u64> {
    let (rb, k) = (format::kv_row_bytes(a.dtype), a.k as usize);
    (0..a.rows as usize)
        .map(|r| {
            digest(
                slots[r * k..(r + 1) * k]
                    .iter()
                    .map(|&s| (s >= 0).then(|| &kv[s as usize * rb..][..rb])),
            )
        })
        .collect()
}

/// The splitmix64 finalizer, from its published constants.
pub fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The digest of a selection from its definition: per row (in rank order; `None` is padding),
/// the wrapping sum over its 8-byte words of `mix(word ^ (j+1)·φ)`; then the wrapping sum over
/// ranks of `mix(row_hash ^ (i+1)·ψ)`, padding skipped; `mix` the splitmix64 finalizer.
pub fn digest<'a>(rows: impl IntoIterator<Item = Option<&'a [u8]>>) -> u64 {
    digest_of(rows.into_iter().map(|r| r.map(row_hash)))
}

/// [`digest`] from each rank's [`row_hash`] (`None` is padding).
pub fn digest_of(row_hashes: impl IntoIterator<Item = Option<u64>>) -> u64 {
    let mut acc = 0u64;
    for (i, h) in row_hashes.into_iter().enumerate() {
        if let Some(h) = h {
            acc = acc.wrapping_add(splitmix(h ^ (i as u64 + 1).wrapping_mul(PSI)));
        }
    }
    acc
}

/// The golden-ratio and xxHash constants the digest mixes positions with (DESIGN §4).
const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
const PSI: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// A row's hash in the digest: the wrapping sum over its 8-byte little-endian words of
/// `mix(word ^ (j+1)·φ)`.
pub fn row_hash(row: &[u8]) -> u64 {
    let mut h = 0u64;
    for (j, w) in row.chunks(8).enumerate() {
        let w = u64::from_le_bytes(w.try_into().expect("rows are whole words"));
        h = h.wrapping_add(splitmix(w ^ (j as u64 + 1).wrapping_mul(PHI)));
    }
    h
}

/// A page run: `count` pages from source page `src` on, to destination page `dst` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub src: u32,
    pub dst: u32,
    pub count: u32,
}

/// `page_copy` page by page, each page placed by [`format::page_at`].
pub fn page_copy(
    src: &[u8],
    from: format::Placement,
    dst: &mut [u8],
    to: format::Placement,
    page_bytes: usize,
    runs: &[Run],
) {
    for run in runs {
        for j in 0..run.count {
            let s = format::page_at(from, page_bytes, run.src + j);
            let d = format::page_at(to, page_bytes, run.dst + j);
            dst[d..d + page_bytes].copy_from_slice(&src[s..s + page_bytes]);
        }
    }
}

/// Index key `t` of an index-K page as f64 values, and its scale (1 for bf16), through
/// [`format`](mod@format).
pub fn key_f64(dtype: IndexKDtype, page: &[u8], t: usize) -> ([f64; 128], f64) {
    let (at, len) = format::index_k_values(dtype, t);
    let scale = format::index_k_scale(dtype, t).map(|off| f32_at(page, off));
    key_row_f64(dtype, &page[at..at + len], scale)
}

/// `index_logits` in f64 from the definition, `kscale[n] · Σ_h w_h · relu(q_h · k_n)`, with each
/// logit's error scale `|kscale| · Σ_h |w_h| · Σ_d |q_hd k_nd|`; `-inf` (and scale 0) at and past
/// each row's context length. Both `[rows][out_stride]`.
pub fn index_logits_f64(
    a: &args::IndexLogits,
    (q_all, w_all): (&[u8], &[f32]),
    pool: &[u8],
) -> (Vec<f64>, Vec<f64>) {
    let pb = format::index_k_page_bytes(a.dtype);
    let rows = a.context_lens.len();
    let (heads, pt_stride, out_stride) = (
        a.heads as usize,
        a.pt_stride as usize,
        a.out_stride as usize,
    );
    let mut value = vec![f64::NEG_INFINITY; rows * out_stride];
    let mut magnitude = vec![0f64; rows * out_stride];
    for r in 0..rows {
        let keys: Vec<([f64; 128], f64)> = (0..a.context_lens[r] as usize)
            .map(|n| {
                let page = a.page_table[r * pt_stride + n / PAGE_TOKENS] as usize;
                key_f64(a.dtype, &pool[page * pb..][..pb], n % PAGE_TOKENS)
            })
            .collect();
        let q = &q_all[r * heads * 128..][..heads * 128];
        let w = &w_all[r * heads..][..heads];
        for (n, (v, m)) in logits_f64(q, w, &keys).into_iter().enumerate() {
            value[r * out_stride + n] = v;
            magnitude[r * out_stride + n] = m;
        }
    }
    (value, magnitude)
}

/// The error bound of an f32 logit, in units of [`U32`] times its magnitude (the second value
/// of [`logits_f64`]). Counted from the kernels' operation order: each head's 128-term dot
/// product as a chain of 128 fused multiply-adds (128 roundings, each bounded by the running
/// magnitude), its ReLU (exact), the weighted sum over at most 64 heads as another chain (64),
/// the key's scale (1): 193, taken as 256. The tensor-core kernels sum in another order and are
/// held to their own bound.
pub const LOGIT_ERROR_UNITS: f64 = 256.0;

/// The logits of one query from the definition, `kscale · Σ_h w_h · relu(q_h · k)` per key, in
/// f64, with each one's error scale `|kscale| · Σ_h |w_h| · Σ_d |q_hd k_d|`: `q_codes` are the
/// query's fp8 codes (heads × 128), `weights` its folded head weights, `keys` each key's values
/// and scale.
pub fn logits_f64(q_codes: &[u8], weights: &[f32], keys: &[([f64; 128], f64)]) -> Vec<(f64, f64)> {
    let q: Vec<f64> = q_codes.iter().map(|&c| e4m3(c)).collect();
    keys.iter()
        .map(|(k, ks)| {
            let (mut s, mut m) = (0f64, 0f64);
            for (h, &w) in weights.iter().enumerate() {
                let q = &q[h * 128..][..128];
                let (mut dot, mut abs) = (0f64, 0f64);
                for d in 0..128 {
                    let t = q[d] * k[d];
                    dot += t;
                    abs += t.abs();
                }
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
                *kd = e4m3(values[d]);
            }
            (k, scale.map_or(1.0, |s| s as f64))
        }
        IndexKDtype::Bf16 => {
            for (d, kd) in k.iter_mut().enumerate() {
                *kd = bf16_of(u16::from_le_bytes([values[2 * d], values[2 * d + 1]]));
            }
            (k, 1.0)
        }
    }
}

#[cfg(test)]
mod tests;
