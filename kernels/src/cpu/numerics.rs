//! The arithmetic every kernel shares, written so that a CUDA kernel compiled with `--fmad=false`
//! performs the *same* IEEE operations in the *same* order (DESIGN §4): sums that the GPU reduces
//! with a warp butterfly are reduced here with the same butterfly, products that the GPU fuses are
//! fused here with an explicit `mul_add`, and nothing else is fused anywhere.
//!
//! The lane convention of the CUDA kernels: one warp of 32 lanes owns one 128-value vector, lane
//! `l` holding values `4l .. 4l + 4`.

use half::bf16;

/// Lanes in a warp.
pub const WARP: usize = 32;
/// 1/√128 rounded to the nearest f32 (bits 0x3DB504F3); the CUDA sources spell the same bits.
pub const INV_SQRT_128: f32 = f32::from_bits(0x3DB5_04F3);
/// LayerNorm epsilon.
pub const LN_EPS: f32 = 1e-6;
/// The fp8 scale floor: scale = max(amax, AMAX_FLOOR) / 448.
pub const AMAX_FLOOR: f32 = 1e-4;
/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Sum of one value per lane by the xor butterfly (offsets 16, 8, 4, 2, 1) that
/// `__shfl_xor_sync` performs; every lane ends with this value.
pub fn warp_sum(mut v: [f32; WARP]) -> f32 {
    let mut off = WARP / 2;
    while off > 0 {
        let prev = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = prev[i] + prev[i ^ off];
        }
        off /= 2;
    }
    v[0]
}

/// Per-lane partial sums of a 128-vector: lane `l` adds its four values left to right.
fn lane_partials(x: &[f32; 128], f: impl Fn(f32) -> f32) -> [f32; WARP] {
    let mut p = [0f32; WARP];
    for (l, slot) in p.iter_mut().enumerate() {
        let b = 4 * l;
        *slot = ((f(x[b]) + f(x[b + 1])) + f(x[b + 2])) + f(x[b + 3]);
    }
    p
}

/// LayerNorm over 128 values (eps 1e-6), in the warp's reduction order:
/// `y = ((x - mean) * rstd) * gamma + beta`, `rstd = 1 / sqrt(var + eps)`.
pub fn layer_norm(x: &mut [f32; 128], gamma: &[f32], beta: &[f32]) {
    debug_assert_eq!(gamma.len(), 128);
    debug_assert_eq!(beta.len(), 128);
    let mean = warp_sum(lane_partials(x, |v| v)) * (1.0 / 128.0);
    let mut d = [0f32; 128];
    for i in 0..128 {
        d[i] = x[i] - mean;
    }
    let var = warp_sum(lane_partials(&d, |v| v * v)) * (1.0 / 128.0);
    let rstd = 1.0 / (var + LN_EPS).sqrt();
    for i in 0..128 {
        x[i] = ((d[i] * rstd) * gamma[i]) + beta[i];
    }
}

/// NeoX-style (half-split) RoPE on dims `0..64`: pair `(i, i + 32)` for `i < 32` rotates by the
/// position's angle `i`. `cos_sin` is that position's table row: 32 cosines, then 32 sines.
pub fn rope_neox(x: &mut [f32; 128], cos_sin: &[f32]) {
    debug_assert_eq!(cos_sin.len(), 64);
    // The zoo's planted reference bug rotates the other half (dims 64..128).
    let base = if crate::mutants::on(crate::mutants::KernelMutant::RopeWrongHalf) {
        64
    } else {
        0
    };
    for i in 0..32 {
        let (c, s) = (cos_sin[i], cos_sin[32 + i]);
        let (a, b) = (x[base + i], x[base + i + 32]);
        x[base + i] = a * c - b * s;
        x[base + i + 32] = b * c + a * s;
    }
}

/// Fast Walsh–Hadamard transform of 128 values, stages `h = 1, 2, …, 64`, pair `(i, i+h)` becoming
/// `(a + b, a - b)`, then scaled by 1/√128. Orthonormal, so dot products are preserved.
pub fn hadamard_128(x: &mut [f32; 128]) {
    let mut h = 1;
    while h < 128 {
        for i in 0..128 {
            if i & h == 0 {
                let (a, b) = (x[i], x[i + h]);
                x[i] = a + b;
                x[i + h] = a - b;
            }
        }
        h *= 2;
    }
    for v in x.iter_mut() {
        *v *= INV_SQRT_128;
    }
}

/// Largest magnitude (order-independent: max is exact).
pub fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Rounds a positive fp32 scale up to a power of two (`ue8m0` scales): keep the exponent if the
/// mantissa is zero, else add one to it and clear the mantissa.
pub fn ue8m0_round_up(scale: f32) -> f32 {
    let bits = scale.to_bits();
    if bits & 0x007F_FFFF == 0 {
        scale
    } else {
        f32::from_bits((bits & 0xFF80_0000) + 0x0080_0000)
    }
}

/// The per-vector fp8 scale: `max(amax, 1e-4) / 448`, optionally rounded up to a power of two.
pub fn fp8_scale(amax: f32, ue8m0: bool) -> f32 {
    let s = amax.max(AMAX_FLOOR) / E4M3_MAX;
    if ue8m0 {
        ue8m0_round_up(s)
    } else {
        s
    }
}

/// e4m3fn encode: round to nearest even, saturate to ±448 (CUDA's `__NV_SATFINITE`), NaN to the
/// NaN code of its sign. Bit arithmetic on the f32 (the hot loop of every simulated store); equal
/// to the `float8` crate's conversion for every f32 (a kernels test: a stride of all bit patterns
/// by default, all 2^32 with `TIERKV_EXHAUSTIVE=1`).
///
/// Written without branches (all three cases are computed and one is selected), so that a loop
/// over a row, [`quantize_e4m3`], compiles to SIMD.
#[inline(always)]
pub fn e4m3_encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let a = bits & 0x7FFF_FFFF;
    // Below the smallest normal (2^-6) codes are multiples of 2^-9: scale (exactly, by a power
    // of two) and round to an integer, to nearest even, by adding and removing 2^23. Code 8 is
    // the smallest normal, so rounding up into it needs no special case. (For larger `a` this
    // value is not used; the clamp keeps its conversion in range.)
    let q = (f32::from_bits(a) * 512.0).min(16.0);
    let small = ((q + 8_388_608.0) - 8_388_608.0) as i32 as u32;
    // Normal: keep 3 of the 23 mantissa bits, to nearest even (a carry moves into the exponent),
    // rebias the exponent from 127 to 7, saturate at 448 (0x7E). (Not used below 2^-6, where
    // the subtraction wraps.)
    let rounded = (a + 0x7_FFFF + ((a >> 20) & 1)) >> 20;
    let normal = rounded.wrapping_sub((127 - 7) << 3).min(0x7E);
    let code = if a > 0x7F80_0000 {
        0x7F // NaN
    } else if a < 0x3C80_0000 {
        small
    } else {
        normal
    };
    (sign | code) as u8
}

/// e4m3fn decode of all 256 codes, computed at compile time by the `float8` crate.
pub static E4M3_DECODE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = float8::F8E4M3::from_bits(i as u8).to_f32();
        i += 1;
    }
    t
};

/// e4m3fn encode by the `float8` crate (through f64): the reference `e4m3_encode` is tested
/// against.
pub fn e4m3_encode_float8(x: f32) -> u8 {
    float8::F8E4M3::from_f32(x).to_bits()
}

pub fn e4m3_decode(b: u8) -> f32 {
    E4M3_DECODE[b as usize]
}

/// Quantizes `x` to e4m3 with `scale`: `code = e4m3(x / scale)` (a division per value, as the
/// kernels do, not a multiplication by the reciprocal).
pub fn quantize_e4m3(x: &[f32], scale: f32, out: &mut [u8]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o = e4m3_encode(v / scale);
    }
}

pub fn bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
pub fn bf16_value(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// SplitMix64's finaliser: the mixing step of every digest.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reads little-endian scalars out of byte slices.
pub fn read_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub fn write_f32(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub fn read_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
pub fn write_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// Little-endian `f32`s of a byte buffer (kernel outputs as the host reads them back).
pub fn le_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
/// Little-endian `i32`s of a byte buffer.
pub fn le_i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
/// Little-endian `u32`s of a byte buffer.
pub fn le_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
/// Little-endian `u64`s of a byte buffer.
pub fn le_u64s(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}
