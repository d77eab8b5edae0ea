//! `q_prep`: the indexer queries' RoPE + Hadamard, per-(token, head) fp8 quantization, and the
//! q-scale folded into the head weights.

use super::numerics::*;
use crate::error::{expect_len, Result};
use crate::layout::{INDEX_HEAD_DIM, ROPE_DIM};
use half::bf16;

/// Arguments of `q_prep` for `n` query tokens of `heads` heads.
#[derive(Clone, Copy, Debug)]
pub struct QPrepArgs<'a> {
    pub heads: usize,
    /// Raw queries, `[n][heads][128]`.
    pub q: &'a [bf16],
    /// Raw head weights, `[n][heads]`.
    pub weights: &'a [f32],
    /// Each token's RoPE row, `[n][64]`.
    pub rope: &'a [f32],
}

impl QPrepArgs<'_> {
    pub fn tokens(&self) -> usize {
        self.rope.len() / ROPE_DIM as usize
    }
    pub fn check(&self) -> Result<()> {
        const OP: &str = "q_prep";
        let n = self.tokens();
        expect_len(OP, "rope", self.rope.len(), n * ROPE_DIM as usize)?;
        expect_len(
            OP,
            "q",
            self.q.len(),
            n * self.heads * INDEX_HEAD_DIM as usize,
        )?;
        expect_len(OP, "weights", self.weights.len(), n * self.heads)?;
        Ok(())
    }
}

/// One head of one token: writes 128 e4m3 codes and returns the folded weight `w * q_scale`.
pub fn q_prep_head(q: &[bf16], w: f32, rope_row: &[f32], out: &mut [u8]) -> f32 {
    let mut x = [0f32; 128];
    for (d, v) in q.iter().enumerate() {
        x[d] = v.to_f32();
    }
    rope_neox(&mut x, rope_row);
    hadamard_128(&mut x);
    let scale = fp8_scale(amax(&x), false);
    quantize_e4m3(&x, scale, out);
    w * scale
}

/// The CPU reference of `q_prep`: `q_out` is `[n][heads][128]` e4m3 codes, `w_out` `[n][heads]`.
pub fn q_prep(a: &QPrepArgs, q_out: &mut [u8], w_out: &mut [f32]) -> Result<()> {
    a.check()?;
    let (n, h) = (a.tokens(), a.heads);
    expect_len("q_prep", "q_out", q_out.len(), n * h * 128)?;
    expect_len("q_prep", "w_out", w_out.len(), n * h)?;
    for t in 0..n {
        let rope = &a.rope[t * 64..(t + 1) * 64];
        for hd in 0..h {
            let i = t * h + hd;
            w_out[i] = q_prep_head(
                &a.q[i * 128..(i + 1) * 128],
                a.weights[i],
                rope,
                &mut q_out[i * 128..(i + 1) * 128],
            );
        }
    }
    Ok(())
}
