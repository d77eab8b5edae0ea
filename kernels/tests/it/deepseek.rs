//! DeepSeek's indexer semantics by hand-checked vectors: the YaRN frequencies and angles of
//! `precompute_freqs_cis`, the `ue8m0` scale of a query head, and the constant of the folded head
//! weight (DeepSeek-V3.2-Exp `inference/model.py`: `precompute_freqs_cis`, `Indexer.forward`;
//! `inference/kernel.py`: `act_quant`).
//!
//! The literals were computed apart from this crate: by hand where the arithmetic is short (noted
//! at each), and otherwise with python3's f64 `math` module from the published formula —
//!
//! ```text
//! corr(r) = 64 * ln(4096 / (r * 2π)) / (2 * ln 10000)      # find_correction_dim
//! low = floor(corr(32)) = floor(10.472) = 10
//! high = ceil(corr(1)) = ceil(22.513) = 23
//! ramp(i) = clamp((i - low) / (high - low), 0, 1)
//! f(i) = 10000^(-2i/64) * (ramp(i) / 40 + 1 - ramp(i))      # freqs/factor*(1-smooth) + freqs*smooth
//! ```
//!
//! — and `math.cos`/`math.sin` of `position * f(i)`.

use half::bf16;
use tierkv_kernels::cpu::numerics::{fp8_scale, INV_SQRT_128};
use tierkv_kernels::cpu::q_prep::{folded_weight, head_weight_scale};
use tierkv_kernels::cpu::{self};
use tierkv_kernels::rope::{Rope, RopeParams, YarnRule, ROPE_THETA};
use tierkv_kernels::spec;

fn close(got: f64, want: f64, rel: f64) -> bool {
    (got - want).abs() <= rel * want.abs()
}

/// DeepSeek-V3.2 at a 128K context: 21 of the 32 frequencies are YaRN-scaled.
#[test]
fn yarn_frequencies_are_deepseeks() {
    let rope = Rope::new(&RopeParams::deepseek_v32(131_072));
    let plain = Rope::plain(ROPE_THETA);
    let f = rope.inv_freq();
    let cases = [
        // i <= low = 10: ramp 0, the frequency is kept.
        (0, 1.0),
        (10, 0.05623413251903491), // 10000^(-20/64)
        // ramp 1/13: 10000^(-22/64) * (1/13/40 + 12/13) = 0.0421696503... * 481/520.
        (11, 0.03900692656714386),
        // ramp 6/13: 0.01 * (6/13/40 + 7/13) = 0.01 * 286/520 = 0.0055 (by hand).
        (16, 0.0055),
        // ramp 12/13: 10000^(-44/64) * (12/13/40 + 1/13).
        (22, 0.0001778279410038922),
        // i >= high = 23: ramp 1, the frequency divided by 40.
        (23, 3.33380358040831e-05),
        (31, 3.3338035804083097e-06),
    ];
    for (i, want) in cases {
        assert!(
            close(f[i], want, 1e-14),
            "frequency {i}: {} vs {want}",
            f[i]
        );
    }
    let changed = (0..32)
        .filter(|&i| !close(f[i], plain.inv_freq()[i], 1e-15))
        .count();
    assert_eq!(changed, 21, "frequencies 11..=31 are scaled");
}

/// The reference applies YaRN only when the longest sequence exceeds `original_seq_len`: at 4096
/// tokens or fewer the frequencies are plain RoPE's. The servers' rule (the default) applies it
/// at every length, with the same frequencies.
#[test]
fn yarn_is_off_up_to_the_original_length_by_the_reference_rule_only() {
    let reference = |max| RopeParams {
        yarn_rule: YarnRule::ContextAboveOriginal,
        ..RopeParams::deepseek_v32(max)
    };
    let long = Rope::new(&RopeParams::deepseek_v32(131_072));
    for max in [1, 2048, 4096] {
        let rope = Rope::new(&reference(max));
        assert_eq!(rope, Rope::plain(ROPE_THETA), "max_seq_len {max}");
        let servers = Rope::new(&RopeParams::deepseek_v32(max));
        assert_eq!(servers, long, "max_seq_len {max}");
    }
    assert!(!reference(4096).yarn());
    assert!(reference(4097).yarn());
    assert!(RopeParams::deepseek_v32(1).yarn());
    let no_factor = RopeParams {
        factor: 1.0,
        ..RopeParams::deepseek_v32(131_072)
    };
    assert!(!no_factor.yarn());
}

/// Rows: 32 cosines then 32 sines of `position * f(i)`, each rounded once to f32.
#[test]
fn yarn_rows_are_the_angles_cosines_and_sines() {
    let rope = Rope::new(&RopeParams::deepseek_v32(131_072));
    let cases = [
        // (position, i, cos, sin)
        (1, 0, 0.5403023058681398, 0.8414709848078965), // angle 1
        (1000, 16, 0.70866977429126, -0.7055403255703919), // angle 5.5
        (1000, 31, 0.9999944428819906, 0.003333797404959383),
        (100_000, 0, -0.9993608074382124, 0.03574879797201651),
        (100_000, 16, -0.9756160821571205, -0.219484077409708), // angle 550
        (100_000, 31, 0.9449415590350292, 0.3272391327583676),  // angle 0.3333803...
    ];
    for (p, i, c, s) in cases {
        let row = rope.row(p);
        // One f32 rounding of the f64 value: within half an f32 ulp (2^-25 relative, below 1).
        assert!(
            (row[i] as f64 - c).abs() <= 2f64.powi(-24),
            "cos {p},{i}: {} vs {c}",
            row[i]
        );
        assert!(
            (row[32 + i] as f64 - s).abs() <= 2f64.powi(-24),
            "sin {p},{i}: {} vs {s}",
            row[32 + i]
        );
    }
    // Position 0 is the identity rotation whatever the frequencies.
    let row0 = rope.row(0);
    assert!(row0[..32].iter().all(|&c| c == 1.0) && row0[32..].iter().all(|&s| s == 0.0));
}

/// A query head whose largest value after RoPE and Hadamard is known: at position 0 (no rotation)
/// the Hadamard transform spreads `8·e_0` into 128 values of `8/√128 = 0.70710677` (the f32
/// butterfly adds exact zeros, then multiplies by `INV_SQRT_128`; times 8 is exact).
fn spike_head() -> Vec<bf16> {
    let mut q = vec![bf16::from_f32(0.0); 128];
    q[0] = bf16::from_f32(8.0);
    q
}

/// `ue8m0`: the scale `amax / 448 = 0.0015783634` rounds up to `2^-9` (log2 of it is -9.31), as
/// the reference's `act_quant` with `scale_fmt = "ue8m0"` does for q as well as for k; the values
/// `0.70710677 / 2^-9 = 362.04` encode as 352 (e4m3 steps of 32 above 256; code 0x7B). Without
/// it the scale is the exact `amax / 448` and the values encode as 448 (0x7E).
#[test]
fn ue8m0_rounds_the_query_scale_up_to_a_power_of_two() {
    let amax = 8.0 * INV_SQRT_128;
    assert_eq!(fp8_scale(amax, true), 2f32.powi(-9));
    assert_eq!(
        fp8_scale(2f32.powi(-5) * 448.0, true),
        2f32.powi(-5),
        "a power of two stays"
    );
    let q: Vec<bf16> = (0..64).flat_map(|_| spike_head()).collect();
    let w = vec![1f32; 64];
    let rope = Rope::new(&RopeParams::deepseek_v32(131_072)).row(0);
    for (ue8m0, code, scale) in [(true, 0x7B, 2f32.powi(-9)), (false, 0x7E, amax / 448.0)] {
        let a = tierkv_kernels::args::QPrep {
            rows: 1,
            heads: 64,
            ue8m0,
        };
        let x = cpu::QPrepInputs {
            q: &q,
            weights: &w,
            rope: &rope,
        };
        let (mut codes, mut folded) = (vec![0u8; 64 * 128], vec![0f32; 64]);
        cpu::q_prep(&a, &x, &mut codes, &mut folded).unwrap();
        assert!(codes.iter().all(|&c| c == code), "ue8m0 {ue8m0}: codes");
        // 64^-½ = 0.125 exactly, so the folded weight is ((1 · 0.125) · scale) · 128^-½.
        let want = ((0.125 * scale) * INV_SQRT_128).to_bits();
        assert!(folded.iter().all(|f| f.to_bits() == want), "ue8m0 {ue8m0}");
        assert_eq!(spec::check_q_prep(&a, &x, &codes, &folded), Ok(()));
    }
}

/// The folded weight carries DeepSeek's `n_heads^-½ · index_head_dim^-½`: for 64 heads
/// `1/√8192 = 0.011048543456039806` (the logits are that much smaller than `w · q_scale` alone
/// makes them, a factor of 90.5). Under ue8m0 the reference's three products are exact but the
/// last, so tierkv's weight is the reference's bit for bit: `2^-12 · f32(128^-½)` for the spike
/// head above.
#[test]
fn the_folded_weight_carries_deepseeks_constant() {
    assert_eq!(head_weight_scale(64), 0.125);
    assert_eq!(head_weight_scale(1), 1.0);
    assert_eq!(head_weight_scale(2), std::f32::consts::FRAC_1_SQRT_2);
    assert_eq!(INV_SQRT_128.to_bits(), 0x3DB5_04F3, "f32(128^-½)");
    let c = folded_weight(1.0, head_weight_scale(64), 1.0) as f64;
    assert!(close(c, 0.011048543456039806, 2e-7), "{c}");
    assert!(close(1.0 / c, 90.50966799187809, 2e-7), "{c}");
    let ue8m0 = folded_weight(1.0, head_weight_scale(64), 2f32.powi(-9));
    assert_eq!(ue8m0, INV_SQRT_128 / 4096.0);
    assert!(close(ue8m0 as f64, 2.157918607e-5, 1e-9), "{ue8m0}");
    // The specification holds a weight without the constant to be wrong.
    let rope = Rope::new(&RopeParams::deepseek_v32(131_072)).row(0);
    let mut codes = [0u8; 128];
    let folded = cpu::q_prep::q_prep_head(
        &spike_head(),
        1.0,
        &rope,
        true,
        head_weight_scale(64),
        &mut codes,
    );
    assert_eq!(
        spec::check_q_head(
            &spike_head(),
            1.0,
            &spec::f64s(&rope),
            64,
            true,
            &codes,
            folded
        ),
        Ok(())
    );
    let bare = 2f32.powi(-9);
    assert!(spec::check_q_head(
        &spike_head(),
        1.0,
        &spec::f64s(&rope),
        64,
        true,
        &codes,
        bare
    )
    .is_err());
}
