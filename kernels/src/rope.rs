//! RoPE rows: for a position, 32 cosines then 32 sines of the model's 32 rotary frequencies over
//! the 64 RoPE dims. Computed on the host in f64 and rounded once, then passed to the kernels as
//! data, so CPU and CUDA rotate by bit-identical angles (the GPU never evaluates a transcendental).
//!
//! The frequencies are DeepSeek's (DeepSeek-V3.2-Exp `inference/model.py`,
//! `precompute_freqs_cis`): the plain `theta^(-2i/64)`, blended with YaRN when
//! [`RopeParams::yarn`] says so: by default whenever a YaRN factor above 1 is configured, as
//! SGLang and vLLM apply it, or, under [`YarnRule::ContextAboveOriginal`], only when the longest
//! sequence served exceeds the length the model was pre-trained at, as the reference does.
//! Frequencies that rotate more
//! than `beta_fast` times over that length keep their value, those that rotate fewer than
//! `beta_slow` times are divided by `factor`, and a linear ramp over the dimension index joins the
//! two (the correction dims are `floor` of the fast one and `ceil` of the slow one, clamped to
//! `0..=63`). The reference evaluates this in f32 torch tensors (and rounds each position's angle
//! to f32 before its `cos`/`sin`); this module evaluates the same formula in f64, so at long
//! positions its angles are the exact ones where the reference's carry f32 rounding.
//!
//! YaRN's attention scale (`mscale`) is no business of this module: the reference applies it to
//! the MLA softmax scale only, never to the indexer (its `Indexer.softmax_scale` is
//! `index_head_dim^-0.5` whatever the RoPE), and tierkv computes no MLA attention.
//!
//! How the rows are applied (`cpu::numerics::rope_neox`, `tkv_rope`) is the NeoX, half-split
//! pairing `(i, i + 32)`. The first release of the reference (September 2025) rotated the
//! indexer's `q_pe`/`k_pe` with the interleaved pairing `(2i, 2i + 1)` of its MLA path. DeepSeek
//! corrected that in November 2025 (DeepSeek-V3.2-Exp commit 8631a81, known here from copies of the
//! corrected `model.py`): `Indexer.forward` calls `apply_rotary_emb(.., interleaved=False)` ("rope
//! in indexer is not interleaved"), which pairs dim `i` with dim `i + 32` at frequency `i` and
//! writes the real parts before the imaginary ones — the pairing used here. MLA keeps the
//! interleaved one; tierkv never rotates MLA's RoPE values (the KV row stores them as given).

use crate::layout::ROPE_DIM;

/// Rotary frequencies per row: one per pair of the 64 RoPE dims.
pub const ROPE_PAIRS: usize = ROPE_DIM as usize / 2;

/// RoPE's base in DeepSeek-V3.2 (`rope_theta`).
pub const ROPE_THETA: f64 = 10000.0;

/// A model's RoPE settings: the arguments of the reference's `precompute_freqs_cis`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// The base: frequency `i` is `theta^(-2i/64)` before YaRN.
    pub theta: f64,
    /// YaRN's `rope_factor`: the low frequencies are divided by it.
    pub factor: f64,
    /// The sequence length the model was pre-trained at (`original_seq_len`).
    pub original_seq_len: u32,
    /// Rotations over `original_seq_len` above which a frequency is kept (`beta_fast`).
    pub beta_fast: f64,
    /// Rotations over `original_seq_len` below which a frequency is divided (`beta_slow`).
    pub beta_slow: f64,
    /// The longest sequence served (the reference's `max_seq_len`): under
    /// [`YarnRule::ContextAboveOriginal`], YaRN applies only when it is above `original_seq_len`.
    pub max_seq_len: u32,
    /// When YaRN applies.
    pub yarn_rule: YarnRule,
}

/// When YaRN changes the frequencies (the configuration's `model.rope_yarn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum YarnRule {
    /// Whenever the model is configured with a YaRN factor above 1, whatever the context served:
    /// what SGLang and vLLM do for a DeepSeek model whose configuration carries `rope_scaling`
    /// (their rotary embedding is built from the scaling block alone).
    Configured,
    /// Only when the longest sequence served is above the length the model was pre-trained at:
    /// DeepSeek's reference `precompute_freqs_cis` (`if seqlen > args.original_seq_len`), with a
    /// factor above 1.
    ContextAboveOriginal,
}

impl YarnRule {
    /// The configuration's names of the rules, in declaration order.
    pub const NAMES: &'static [&'static str] = &["configured", "context_above_original"];
    pub fn name(self) -> &'static str {
        match self {
            YarnRule::Configured => "configured",
            YarnRule::ContextAboveOriginal => "context_above_original",
        }
    }
    /// The rule a configuration names.
    pub fn parse(s: &str) -> Option<Self> {
        [YarnRule::Configured, YarnRule::ContextAboveOriginal]
            .into_iter()
            .find(|v| v.name() == s)
    }
}

impl RopeParams {
    /// DeepSeek-V3.2's settings (the reference's `ModelArgs` defaults, which
    /// `config_671B_v3.2.json` does not override) for sequences of up to `max_seq_len` tokens,
    /// with YaRN applied as the servers apply it ([`YarnRule::Configured`]).
    pub const fn deepseek_v32(max_seq_len: u32) -> RopeParams {
        RopeParams {
            theta: ROPE_THETA,
            factor: 40.0,
            original_seq_len: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            max_seq_len,
            yarn_rule: YarnRule::Configured,
        }
    }

    /// Whether YaRN changes the frequencies, by [`RopeParams::yarn_rule`]; a factor of 1 means
    /// none under either rule.
    pub fn yarn(&self) -> bool {
        self.factor > 1.0
            && match self.yarn_rule {
                YarnRule::Configured => true,
                YarnRule::ContextAboveOriginal => self.max_seq_len > self.original_seq_len,
            }
    }
}

/// The 32 rotary frequencies of a model, from which every position's row is computed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    inv_freq: [f64; ROPE_PAIRS],
}

impl Rope {
    /// The frequencies of `p`, YaRN-blended when `p.yarn()`.
    pub fn new(p: &RopeParams) -> Rope {
        // The configuration validates these; anything else here is a caller's bug.
        assert!(
            p.theta.is_finite() && p.theta > 1.0,
            "RoPE theta {}",
            p.theta
        );
        assert!(
            p.factor.is_finite() && p.factor >= 1.0,
            "YaRN factor {}",
            p.factor
        );
        assert!(
            p.beta_slow > 0.0 && p.beta_fast > p.beta_slow && p.beta_fast.is_finite(),
            "YaRN betas {} and {}",
            p.beta_fast,
            p.beta_slow
        );
        let mut inv_freq = plain_inv_freq(p.theta);
        if p.yarn() {
            let (low, high) = correction_range(p);
            for (i, f) in inv_freq.iter_mut().enumerate() {
                // `ramp` is 0 up to `low` (keep), 1 from `high` on (divide), linear between; the
                // reference writes the blend with `smooth = 1 - ramp`.
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let smooth = 1.0 - ramp;
                *f = *f / p.factor * (1.0 - smooth) + *f * smooth;
            }
        }
        Rope { inv_freq }
    }

    /// Plain RoPE with base `theta` (no YaRN): what tests use when the frequencies do not matter.
    pub fn plain(theta: f64) -> Rope {
        Rope {
            inv_freq: plain_inv_freq(theta),
        }
    }

    /// Frequency `i` in radians per position.
    pub fn inv_freq(&self) -> &[f64; ROPE_PAIRS] {
        &self.inv_freq
    }

    /// The RoPE row of `position`: 32 cosines, then 32 sines.
    pub fn row(&self, position: u32) -> [f32; 64] {
        let mut row = [0f32; 64];
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = position as f64 * f;
            row[i] = angle.cos() as f32;
            row[ROPE_PAIRS + i] = angle.sin() as f32;
        }
        row
    }

    /// Rows for many positions, `[n][64]`.
    pub fn rows(&self, positions: impl IntoIterator<Item = u32>) -> Vec<f32> {
        positions.into_iter().flat_map(|p| self.row(p)).collect()
    }
}

/// `theta^(-2i/64)` for `i` in `0..32`.
fn plain_inv_freq(theta: f64) -> [f64; ROPE_PAIRS] {
    std::array::from_fn(|i| theta.powf(-(2.0 * i as f64) / ROPE_DIM as f64))
}

/// YaRN's correction range `(low, high)` of dimension indices: the reference's
/// `find_correction_range(beta_fast, beta_slow, 64, theta, original_seq_len)`, with its
/// `min == max` guard (`max += 0.001`) applied.
fn correction_range(p: &RopeParams) -> (f64, f64) {
    let dim = ROPE_DIM as f64;
    // The dimension index at which a frequency turns `rotations` times over the original length.
    let dim_at = |rotations: f64| {
        dim * (p.original_seq_len as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * p.theta.ln())
    };
    let low = dim_at(p.beta_fast).floor().max(0.0);
    let high = dim_at(p.beta_slow).ceil().min(dim - 1.0);
    if low == high {
        (low, high + 0.001)
    } else {
        (low, high)
    }
}
