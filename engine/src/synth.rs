//! The synthetic model. There are no weights: every vector is a pure function of
//! (seed, token id, position, global layer), drawn from a counter-based hash, so the engine, the
//! simulator's oracles and any test can recompute the exact bytes that belong in any slot. The
//! draws themselves are `tierkv_kernels::cpu::draw`, whose CUDA twin lets the production device
//! draw a step's inputs where they are used (the ops carry only each row's token and position).

use half::bf16;
use std::sync::Arc;
use tierkv_kernels::cpu::draw::{self, Stream, TokenAt};
use tierkv_kernels::cpu::numerics::mix64;
use tierkv_kernels::layout::{INDEX_HEAD_DIM, KV_ROW_VALUES};

/// A layer's indexer LayerNorm weight and bias (128 values each).
pub type LnParams = (Arc<[f32]>, Arc<[f32]>);

pub use tierkv_kernels::cpu::draw::VOCAB;

/// The model's identity: two engines with the same seed produce the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Synth {
    pub seed: u64,
}

impl Synth {
    pub fn new(seed: u64) -> Self {
        Synth { seed }
    }

    /// The model of `seed` after `version` weight updates (`Engine::update_weights`): version 0
    /// is `Synth::new(seed)`; every other version draws every vector anew.
    pub fn with_weights(seed: u64, version: u32) -> Self {
        if version == 0 {
            return Synth::new(seed);
        }
        Synth::new(mix64(seed ^ mix64(0x5745_4947_4854_5300 ^ version as u64)))
    }

    fn stream(&self, what: Stream, a: u64, b: u64, c: u64) -> u64 {
        draw::stream(self.seed, what, a, b, c)
    }

    /// The raw index key of `token` at `position` in global layer `layer` (128 values).
    pub fn index_key(&self, token: u32, position: u32, layer: u32) -> Vec<bf16> {
        let mut out = Vec::with_capacity(INDEX_HEAD_DIM as usize);
        self.index_key_into(token, position, layer, &mut out);
        out
    }

    /// `index_key`, appended to `out`.
    pub fn index_key_into(&self, token: u32, position: u32, layer: u32, out: &mut Vec<bf16>) {
        draw::index_key_into(self.seed, TokenAt { token, position }, layer, out);
    }

    /// The raw indexer query of `token` at `position`, `heads × 128` values. Each head leans on
    /// the token's shared key direction, so queries find earlier occurrences of the same token.
    pub fn query(&self, token: u32, position: u32, layer: u32, heads: u32) -> Vec<bf16> {
        let mut out = Vec::with_capacity(heads as usize * INDEX_HEAD_DIM as usize);
        draw::query_into(
            self.seed,
            TokenAt { token, position },
            layer,
            heads,
            &mut out,
        );
        out
    }

    /// Raw head weights of a query token (`heads` values, positive).
    pub fn head_weights(&self, token: u32, position: u32, layer: u32, heads: u32) -> Vec<f32> {
        let mut out = Vec::with_capacity(heads as usize);
        draw::head_weights_into(
            self.seed,
            TokenAt { token, position },
            layer,
            heads,
            &mut out,
        );
        out
    }

    /// The MLA KV row of `token` at `position` (576 values: 512 latent, 64 RoPE).
    pub fn kv_row(&self, token: u32, position: u32, layer: u32) -> Vec<bf16> {
        let mut out = Vec::with_capacity(KV_ROW_VALUES as usize);
        self.kv_row_into(token, position, layer, &mut out);
        out
    }

    /// `kv_row`, appended to `out`.
    pub fn kv_row_into(&self, token: u32, position: u32, layer: u32, out: &mut Vec<bf16>) {
        draw::kv_row_into(self.seed, TokenAt { token, position }, layer, out);
    }

    /// The indexer's LayerNorm weight and bias for a layer.
    pub fn ln_params(&self, layer: u32) -> LnParams {
        let s = self.stream(Stream::Ln, layer as u64, 0, 0);
        let gamma: Vec<f32> = (0..128).map(|i| 1.0 + 0.25 * draw::unit(s, i)).collect();
        let beta: Vec<f32> = (0..128).map(|i| 0.1 * draw::unit(s, 128 + i)).collect();
        (gamma.into(), beta.into())
    }

    /// The token generated from a position's per-layer digests.
    pub fn next_token(&self, digests: &[u64]) -> u32 {
        draw::next_token(self.seed, digests.iter().copied())
    }

    /// A deterministic token for generated workloads (prompts, tool outputs).
    pub fn token(&self, stream: u64, i: u64) -> u32 {
        (mix64(self.stream(Stream::Token, stream, i, 0)) % VOCAB as u64) as u32
    }
}

#[cfg(test)]
mod tests;
