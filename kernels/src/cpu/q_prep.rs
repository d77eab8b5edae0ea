//! `q_prep`: the indexer queries' RoPE + Hadamard, per-(token, head) fp8 quantization, and the
//! q-scale folded into the head weights.
//!
//! As in DeepSeek-V3.2-Exp's `Indexer.forward` (`inference/model.py`): the query's scale is
//! `max(amax, 1e-4) / 448`, rounded up to a power of two when the model's scale format is `ue8m0`
//! (the reference quantizes q and k with the same `act_quant(.., scale_fmt)`), and the weight the
//! logits kernel multiplies each head's `relu(q · k)` by is
//!
//! `w_out = ((w · heads^-½) · q_scale) · 128^-½`
//!
//! in that order: `weights_proj(x) · n_heads^-0.5`, times `q_scale`, times the indexer's
//! `softmax_scale = index_head_dim^-0.5`. `heads` is the model's indexer head count
//! (`index_n_heads`): a launch always holds every head of its tokens.

use super::numerics::*;
use crate::args::{self, bind_exact};
use crate::error::Result;
use crate::layout::{bf16_bytes, f32_bytes, fp8_bytes};
use half::bf16;

/// The inputs of `q_prep` for `n` query tokens, bound to its record by [`q_prep`].
#[derive(Clone, Copy, Debug)]
pub struct QPrepInputs<'a> {
    /// Raw queries, `[n][heads][128]`.
    pub q: &'a [bf16],
    /// Raw head weights, `[n][heads]`.
    pub weights: &'a [f32],
    /// Each token's RoPE row, `[n][64]`.
    pub rope: &'a [f32],
}

/// `heads^-½` rounded once to f32: the reference's `n_heads ** -0.5` (a double, which torch
/// rounds to the f32 of the weights it multiplies). The CUDA launcher passes the same value.
pub fn head_weight_scale(heads: usize) -> f32 {
    (heads as f64).powf(-0.5) as f32
}

/// The folded weight of one head: `((w · head_scale) · q_scale) · 128^-½`, three f32 products in
/// the reference's order (`128^-½` is `INV_SQRT_128`, the nearest f32).
pub fn folded_weight(w: f32, head_scale: f32, q_scale: f32) -> f32 {
    ((w * head_scale) * q_scale) * INV_SQRT_128
}

/// One head of one token: writes 128 e4m3 codes and returns the folded weight. `head_scale` is
/// `head_weight_scale(heads)`.
pub fn q_prep_head(
    q: &[bf16],
    w: f32,
    rope_row: &[f32],
    ue8m0: bool,
    head_scale: f32,
    out: &mut [u8],
) -> f32 {
    let mut x = [0f32; 128];
    for (d, v) in q.iter().enumerate() {
        x[d] = v.to_f32();
    }
    rope_neox(&mut x, rope_row);
    hadamard_128(&mut x);
    let scale = fp8_scale(amax(&x), ue8m0);
    quantize_e4m3(&x, scale, out);
    folded_weight(w, head_scale, scale)
}

/// The CPU reference of `q_prep`: `q_out` is `[n][heads][128]` e4m3 codes, `w_out` `[n][heads]`.
pub fn q_prep(a: &args::QPrep, x: &QPrepInputs, q_out: &mut [u8], w_out: &mut [f32]) -> Result<()> {
    const OP: &str = args::QPrep::OP;
    a.check()?;
    let [qo, wo, ro, qoo, woo] = a.operands();
    bind_exact(OP, qo, bf16_bytes(x.q.len() as u64))?;
    bind_exact(OP, wo, f32_bytes(x.weights.len() as u64))?;
    bind_exact(OP, ro, f32_bytes(x.rope.len() as u64))?;
    bind_exact(OP, qoo, fp8_bytes(q_out.len() as u64))?;
    bind_exact(OP, woo, f32_bytes(w_out.len() as u64))?;
    let (n, h) = (a.rows as usize, a.heads as usize);
    let head_scale = head_weight_scale(h);
    for t in 0..n {
        let rope = &x.rope[t * 64..(t + 1) * 64];
        for hd in 0..h {
            let i = t * h + hd;
            w_out[i] = q_prep_head(
                &x.q[i * 128..(i + 1) * 128],
                x.weights[i],
                rope,
                a.ue8m0,
                head_scale,
                &mut q_out[i * 128..(i + 1) * 128],
            );
        }
    }
    Ok(())
}
