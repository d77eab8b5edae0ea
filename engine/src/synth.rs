//! The synthetic model. There are no weights: every vector is a pure function of
//! (seed, token id, position, global layer), drawn from a counter-based hash, so the engine, the
//! simulator's oracles and any test can recompute the exact bytes that belong in any slot.
//!
//! Keys and queries share a per-token direction, so a query attends most to earlier occurrences of
//! its own token: needle workloads plant a token early and query it late.

use half::bf16;
use std::sync::Arc;
use tierkv_kernels::cpu::numerics::mix64;
use tierkv_kernels::layout::{INDEX_HEAD_DIM, KV_ROW_VALUES};

/// A layer's indexer LayerNorm weight and bias (128 values each).
pub type LnParams = (Arc<[f32]>, Arc<[f32]>);

/// Token ids are below this.
pub const VOCAB: u32 = 50_000;

/// The model's identity: two engines with the same seed produce the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Synth {
    pub seed: u64,
}

const KEY: u64 = 1;
const KEY_SHARED: u64 = 2;
const QUERY: u64 = 3;
const WEIGHT: u64 = 4;
const KV: u64 = 5;
const LN: u64 = 6;

impl Synth {
    pub fn new(seed: u64) -> Self {
        Synth { seed }
    }

    fn stream(&self, what: u64, a: u64, b: u64, c: u64) -> u64 {
        mix64(mix64(mix64(mix64(self.seed ^ what) ^ a) ^ b.wrapping_mul(0x9E37_79B9)) ^ c)
    }

    /// Uniform in [-1, 1) from a stream and an element index.
    fn unit(base: u64, i: u64) -> f32 {
        let v = mix64(base.wrapping_add(i.wrapping_mul(0xD1B5_4A32_D192_ED03)));
        ((v >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }

    /// The raw index key of `token` at `position` in global layer `layer` (128 values).
    pub fn index_key(&self, token: u32, position: u32, layer: u32) -> Vec<bf16> {
        let mut out = Vec::with_capacity(INDEX_HEAD_DIM as usize);
        self.index_key_into(token, position, layer, &mut out);
        out
    }

    /// `index_key`, appended to `out` (a batch's keys in one buffer, no allocation per row).
    pub fn index_key_into(&self, token: u32, position: u32, layer: u32, out: &mut Vec<bf16>) {
        let shared = self.stream(KEY_SHARED, token as u64, 0, layer as u64);
        let own = self.stream(KEY, token as u64, position as u64, layer as u64);
        out.extend(
            (0..INDEX_HEAD_DIM as u64)
                .map(|d| bf16::from_f32(2.0 * Self::unit(shared, d) + 0.7 * Self::unit(own, d))),
        );
    }

    /// The raw indexer query of `token` at `position`, `heads × 128` values. Each head leans on
    /// the token's shared key direction, so queries find earlier occurrences of the same token.
    pub fn query(&self, token: u32, position: u32, layer: u32, heads: u32) -> Vec<bf16> {
        let shared = self.stream(KEY_SHARED, token as u64, 0, layer as u64);
        let mut out = Vec::with_capacity(heads as usize * 128);
        for h in 0..heads as u64 {
            let own = self.stream(
                QUERY,
                token as u64,
                position as u64 ^ (h << 32),
                layer as u64,
            );
            for d in 0..INDEX_HEAD_DIM as u64 {
                out.push(bf16::from_f32(
                    1.5 * Self::unit(shared, d) + Self::unit(own, d),
                ));
            }
        }
        out
    }

    /// Raw head weights of a query token (`heads` values, positive).
    pub fn head_weights(&self, token: u32, position: u32, layer: u32, heads: u32) -> Vec<f32> {
        let s = self.stream(WEIGHT, token as u64, position as u64, layer as u64);
        (0..heads as u64)
            .map(|h| 0.5 + 0.25 * (Self::unit(s, h) + 1.0))
            .collect()
    }

    /// The MLA KV row of `token` at `position` (576 values: 512 latent, 64 RoPE).
    pub fn kv_row(&self, token: u32, position: u32, layer: u32) -> Vec<bf16> {
        let mut out = Vec::with_capacity(KV_ROW_VALUES as usize);
        self.kv_row_into(token, position, layer, &mut out);
        out
    }

    /// `kv_row`, appended to `out` (a batch's rows in one buffer, no allocation per row).
    pub fn kv_row_into(&self, token: u32, position: u32, layer: u32, out: &mut Vec<bf16>) {
        let s = self.stream(KV, token as u64, position as u64, layer as u64);
        out.extend((0..KV_ROW_VALUES as u64).map(|i| bf16::from_f32(3.0 * Self::unit(s, i))));
    }

    /// The indexer's LayerNorm weight and bias for a layer.
    pub fn ln_params(&self, layer: u32) -> LnParams {
        let s = self.stream(LN, layer as u64, 0, 0);
        let gamma: Vec<f32> = (0..128).map(|i| 1.0 + 0.25 * Self::unit(s, i)).collect();
        let beta: Vec<f32> = (0..128).map(|i| 0.1 * Self::unit(s, 128 + i)).collect();
        (gamma.into(), beta.into())
    }

    /// The token generated from a position's per-layer digests.
    pub fn next_token(&self, digests: &[u64]) -> u32 {
        let h = digests
            .iter()
            .fold(self.seed ^ 0x7E57, |acc, d| mix64(acc ^ d));
        (h % VOCAB as u64) as u32
    }

    /// A deterministic token for generated workloads (prompts, tool outputs).
    pub fn token(&self, stream: u64, i: u64) -> u32 {
        (mix64(self.stream(0xA11, stream, i, 0)) % VOCAB as u64) as u32
    }
}
