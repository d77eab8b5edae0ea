//! The specification's own tests: its number formats against third-party implementations, and
//! its checks refusing every rounding that is not round-to-nearest-even.

use super::*;

/// A small deterministic generator (splitmix64 over a counter).
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix(self.0)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
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

/// The specification's e4m3 rounding is the `float8` crate's (an implementation of the format
/// apart from this crate's), over values spread across every binade, their midpoints and past
/// the largest code.
#[test]
fn e4m3_rounding_is_the_float8_crates() {
    let mut g = Gen(7);
    let mut values: Vec<f64> = (0..=0x7Eu8)
        .flat_map(|c| {
            let v = e4m3(c);
            let next = if c < 0x7E { e4m3(c + 1) } else { 480.0 };
            [
                v,
                (v + next) / 2.0,
                v + (next - v) * 0.25,
                v + (next - v) * 0.75,
            ]
        })
        .collect();
    values.extend((0..20_000).map(|_| g.unit() * 2f64.powi((g.next() % 26) as i32 - 14)));
    values.extend([500.0, 1e6, 464.0, 463.99]);
    for v in values {
        for x in [v, -v] {
            let want = float8::F8E4M3::from_f64(x).to_bits();
            assert_eq!(e4m3_rne(x), want, "{x}");
        }
    }
}

/// The specification's bf16 rounding is the `half` crate's.
#[test]
fn bf16_rounding_is_the_half_crates() {
    let mut g = Gen(11);
    for _ in 0..50_000 {
        let x = (g.unit() * 2f64.powi((g.next() % 60) as i32 - 30)) as f32 as f64;
        assert_eq!(bf16_rne(x), bf16::from_f64(x).to_bits(), "{x}");
    }
    // Ties to even: the midpoint above an even code rounds down to it, above an odd one up.
    let mid = |bits: u16| (bf16_of(bits) + bf16_of(bits + 1)) / 2.0;
    assert_eq!(bf16_rne(mid(0x3F80)), 0x3F80);
    assert_eq!(bf16_rne(mid(0x3F81)), 0x3F82);
}

/// A row of keys, LayerNorm parameters and a RoPE row, drawn.
fn inputs(g: &mut Gen) -> (Vec<bf16>, Vec<f32>, Vec<f32>, Vec<f64>) {
    let key: Vec<bf16> = (0..128).map(|_| bf16::from_f64(g.unit() * 3.0)).collect();
    let gamma: Vec<f32> = (0..128).map(|_| (1.0 + 0.5 * g.unit()) as f32).collect();
    let beta: Vec<f32> = (0..128).map(|_| (0.2 * g.unit()) as f32).collect();
    let angle: Vec<f64> = (0..32).map(|_| g.unit() * 3.0).collect();
    let rope: Vec<f64> = angle
        .iter()
        .map(|a| a.cos())
        .chain(angle.iter().map(|a| a.sin()))
        .collect();
    (key, gamma, beta, rope)
}

/// The codes a rounding of `x` (value ÷ scale) gives, by mode.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Nearest,
    TowardZero,
    AwayFromZero,
    OneCodeOff,
}

fn round(x: f64, mode: Mode) -> u8 {
    let sign = if x < 0.0 { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    let below = (0..=0x7Eu8)
        .rev()
        .find(|&c| e4m3(c) <= a)
        .expect("code 0 is 0");
    let code = match mode {
        Mode::Nearest => return e4m3_rne(x),
        Mode::TowardZero => below,
        Mode::AwayFromZero if e4m3(below) == a => below,
        Mode::AwayFromZero => below + 1,
        // One code further from zero, or nearer at the largest code.
        Mode::OneCodeOff => match e4m3_rne(a) {
            0x7E => 0x7D,
            c => c + 1,
        },
    };
    sign | code
}

/// An fp8 index-K row rounded to nearest even passes; truncated, rounded away from zero, or one
/// code off, it is refused. The same for every row drawn, and for both scale formats.
#[test]
fn only_round_to_nearest_even_passes() {
    let mut g = Gen(3);
    for i in 0..200 {
        let ue8m0 = i % 2 == 0;
        let (key, gamma, beta, rope) = inputs(&mut g);
        let p = pipeline_f64(&key, &gamma, &beta, &rope, true);
        let exact = p.amax().max(1e-4) / E4M3_MAX;
        let scale = if ue8m0 { pow2_up(exact) } else { exact } as f32;
        for mode in [
            Mode::Nearest,
            Mode::TowardZero,
            Mode::AwayFromZero,
            Mode::OneCodeOff,
        ] {
            let codes: Vec<u8> = p
                .values
                .iter()
                .map(|v| round(v / scale as f64, mode))
                .collect();
            let verdict = check_index_k_row(
                IndexKDtype::Fp8,
                ue8m0,
                &key,
                &gamma,
                &beta,
                &rope,
                &codes,
                Some(scale),
            );
            match mode {
                Mode::Nearest => assert_eq!(verdict, Ok(()), "row {i}"),
                _ => assert!(verdict.is_err(), "row {i}: {mode:?} passed"),
            }
        }
        // A single code one step off, anywhere in the row.
        let mut codes: Vec<u8> = p
            .values
            .iter()
            .map(|v| e4m3_rne(v / scale as f64))
            .collect();
        let d = (g.next() % 128) as usize;
        codes[d] = round(p.values[d] / scale as f64, Mode::OneCodeOff);
        assert!(
            check_index_k_row(
                IndexKDtype::Fp8,
                ue8m0,
                &key,
                &gamma,
                &beta,
                &rope,
                &codes,
                Some(scale)
            )
            .is_err(),
            "row {i}: dim {d} one code off passed"
        );
    }
}

/// Under `ue8m0` the scale is the power of two the exact one rounds up to: the power below it
/// and the one above are refused (away from a power of two, where the f32 amax cannot cross).
#[test]
fn ue8m0_scales_are_the_power_of_two_above() {
    let amax = 3.0 * 448.0 * 0.3;
    let err = 1e-6;
    let up = pow2_up(amax / E4M3_MAX);
    assert_eq!(check_scale(up, amax, err, true), Ok(()));
    assert!(check_scale(up / 2.0, amax, err, true).is_err());
    assert!(check_scale(up * 2.0, amax, err, true).is_err());
    // Within the bound of a power of two, both sides of it are possible.
    let amax = 448.0 * 0.5;
    assert_eq!(check_scale(0.5, amax, 1e-5, true), Ok(()));
    assert_eq!(check_scale(1.0, amax, 1e-5, true), Ok(()));
    assert!(check_scale(2.0, amax, 1e-5, true).is_err());
    // Not under ue8m0: the exact scale within two roundings, nothing a step away.
    let exact = 1.7 / E4M3_MAX;
    assert_eq!(check_scale(exact, 1.7, 0.0, false), Ok(()));
    assert!(check_scale(exact * (1.0 + 1e-5), 1.7, 0.0, false).is_err());
}

/// The packed fp8 KV row is exact: a code changed anywhere is refused.
#[test]
fn kv_rows_are_exact() {
    let mut g = Gen(5);
    let row: Vec<bf16> = (0..576).map(|_| bf16::from_f64(g.unit() * 2.0)).collect();
    for dtype in [KvDtype::Bf16, KvDtype::Fp8Packed] {
        let want = kv_row(dtype, &row);
        assert_eq!(want.len(), format::kv_row_bytes(dtype));
        assert_eq!(check_kv_row(dtype, &row, &want), Ok(()));
        for at in [0, 200, 511, 512, 530, want.len() - 1] {
            let mut bad = want.clone();
            bad[at] ^= 1;
            assert!(
                check_kv_row(dtype, &row, &bad).is_err(),
                "{dtype:?} byte {at}"
            );
        }
    }
}

/// A selection within the logits' bounds passes; one that drops a logit certainly above a
/// selected one, that has the wrong size, or that is out of order is refused.
#[test]
fn a_top_k_is_judged_within_the_bounds() {
    let scores = [(5.0, 0.1), (1.0, 0.1), (4.95, 0.1), (3.0, 0.1), (-1.0, 0.1)];
    assert_eq!(check_topk_within(&[0, 2, 3], &scores, 3), Ok(()));
    // 0 and 2 are within each other's bounds: either order.
    assert_eq!(check_topk_within(&[2, 0, 3], &scores, 3), Ok(()));
    assert!(
        check_topk_within(&[0, 2, 1], &scores, 3).is_err(),
        "3 dropped"
    );
    assert!(
        check_topk_within(&[0, 3, 2], &scores, 3).is_err(),
        "out of order"
    );
    assert!(check_topk_within(&[0, 2], &scores, 3).is_err(), "k ignored");
    assert!(check_topk_within(&[0, 0, 2], &scores, 3).is_err(), "twice");
    assert_eq!(
        check_topk_within(&[0, 2, 3, 1, 4], &scores, 9),
        Ok(()),
        "k past the context"
    );
}

/// The byte formats are the design's sizes.
#[test]
fn the_formats_are_the_designs() {
    assert_eq!(format::index_k_page_bytes(IndexKDtype::Fp8), 8448);
    assert_eq!(format::index_k_page_bytes(IndexKDtype::Bf16), 16384);
    assert_eq!(format::kv_row_bytes(KvDtype::Bf16), 1152);
    assert_eq!(format::kv_row_bytes(KvDtype::Fp8Packed), 656);
    assert_eq!(format::kv_row_bytes(KvDtype::Fp8Unpacked), 576);
    assert_eq!(format::index_k_scale(IndexKDtype::Fp8, 63), Some(8444));
    for t in 0..64 {
        let (at, len) = format::index_k_values(IndexKDtype::Fp8, t);
        assert_eq!(format::index_k_token_of(IndexKDtype::Fp8, at + len - 1), t);
        let s = format::index_k_scale(IndexKDtype::Fp8, t).unwrap();
        assert_eq!(format::index_k_token_of(IndexKDtype::Fp8, s + 3), t);
    }
}

/// The specification's frequencies are the engine's module's (two writings of DeepSeek's
/// formula), with YaRN and without, within f64 rounding.
#[test]
fn rope_frequencies_agree_with_the_rope_module() {
    for max in [2048, 4096, 4097, 131_072] {
        let p = crate::rope::RopeParams::deepseek_v32(max);
        let ours = rope_inv_freq(&p);
        let theirs = crate::rope::Rope::new(&p);
        for (i, (a, b)) in ours.iter().zip(theirs.inv_freq()).enumerate() {
            assert!(
                (a - b).abs() <= 1e-15 * b.abs(),
                "max {max} frequency {i}: {a} vs {b}"
            );
        }
    }
    // YaRN divides the lowest frequency by the factor and keeps the highest.
    let p = crate::rope::RopeParams::deepseek_v32(131_072);
    let f = rope_inv_freq(&p);
    assert_eq!(f[0], 1.0);
    assert!((f[31] - 10000f64.powf(-62.0 / 64.0) / 40.0).abs() < 1e-18);
}
