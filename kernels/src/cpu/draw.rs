//! The synthetic model's inputs, drawn from a counter-based hash: the CPU reference of `draw.cu`.
//!
//! tierkv has no weights. The vectors a model would compute on the device from a token (its raw
//! index key, indexer queries, head weights and MLA KV row) are pure functions of (seed, token,
//! position, global layer), so the engine, the simulator's oracles and the tests can recompute
//! the exact bytes that belong in any slot, and the production device can draw them itself, where
//! they are used, instead of receiving them from the host. Both sides perform the same IEEE f32
//! operations in the same order (no fused multiply-add), so they agree bit for bit.
//!
//! Keys and queries share a per-token direction, so a query attends most to earlier occurrences
//! of its own token: needle workloads plant a token early and query it late.

use super::numerics::mix64;
use crate::layout::{INDEX_HEAD_DIM, KV_ROW_VALUES};
use half::bf16;

/// What a stream draws: its code, mixed into the stream's seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
pub enum Stream {
    /// A token's own part of its index key (per position).
    Key = 1,
    /// A token's shared direction, of its keys and queries alike.
    KeyShared = 2,
    /// One query head's own part (per position and head).
    Query = 3,
    /// A query's head weights.
    Weight = 4,
    /// An MLA KV row.
    Kv = 5,
    /// A layer's indexer LayerNorm parameters.
    Ln = 6,
    /// Generated workloads' tokens.
    Token = 0xA11,
}

/// The streams `draw.cu` draws, as C macros (the kernels write no code of their own).
pub const STREAM_DEFINES: [(&str, Stream); 5] = [
    ("TKV_DRAW_KEY", Stream::Key),
    ("TKV_DRAW_KEY_SHARED", Stream::KeyShared),
    ("TKV_DRAW_QUERY", Stream::Query),
    ("TKV_DRAW_WEIGHT", Stream::Weight),
    ("TKV_DRAW_KV", Stream::Kv),
];

/// The base of stream `what` of model `seed` at `(a, b, c)`.
pub fn stream(seed: u64, what: Stream, a: u64, b: u64, c: u64) -> u64 {
    mix64(mix64(mix64(mix64(seed ^ what as u64) ^ a) ^ b.wrapping_mul(0x9E37_79B9)) ^ c)
}

/// Element `i` of a stream: uniform in [-1, 1), a multiple of 2^-23 (every step exact in f32).
pub fn unit(base: u64, i: u64) -> f32 {
    let v = mix64(base.wrapping_add(i.wrapping_mul(0xD1B5_4A32_D192_ED03)));
    ((v >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// Token ids are below this.
pub const VOCAB: u32 = 50_000;

/// A drawn row's token with this bit set is not known to the host yet: the device reads it
/// from a tokens buffer, at the index in the low bits ([`next_tokens`] wrote it there from the
/// previous step's digests). An engine that runs one step ahead builds its rows this way.
pub const PENDING_TOKEN: u32 = 1 << 31;
const _: () = assert!(VOCAB < PENDING_TOKEN, "a token id must not read as pending");

/// A row the device draws: a token at a position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct TokenAt {
    pub token: u32,
    pub position: u32,
}

impl TokenAt {
    /// The row whose token is entry `index` of the device's tokens buffer.
    pub fn pending(index: u32, position: u32) -> TokenAt {
        assert!(index < PENDING_TOKEN, "pending token index {index}");
        TokenAt {
            token: PENDING_TOKEN | index,
            position,
        }
    }
    /// The tokens-buffer index of a pending row, `None` for a known token.
    pub fn pending_index(&self) -> Option<u32> {
        (self.token & PENDING_TOKEN != 0).then_some(self.token & !PENDING_TOKEN)
    }
}

/// Mixed into the model's seed before a row's digests are folded into its next token.
pub const NEXT_TOKEN_SALT: u64 = 0x7E57;

/// The token a model generates after a query row whose per-layer digests are `digests` (in
/// layer order): the synthetic model's sampling, a hash of everything the row read.
pub fn next_token(seed: u64, digests: impl IntoIterator<Item = u64>) -> u32 {
    let h = digests
        .into_iter()
        .fold(seed ^ NEXT_TOKEN_SALT, |acc, d| mix64(acc ^ d));
    (h % VOCAB as u64) as u32
}

/// The next token of each of a step's first `rows` query rows, from the step's digests laid
/// out `[layers][rows_max]` (`ScratchLayout::digest_index`): the CPU reference of
/// `draw.cu`'s `next_tokens`.
pub fn next_tokens(a: &crate::args::NextTokens, digests: &[u64]) -> crate::Result<Vec<u32>> {
    a.check()?;
    let found = crate::layout::u64_bytes(digests.len() as u64);
    crate::args::bind_exact(crate::args::NextTokens::OP, a.operands()[0], found)?;
    let (layers, rows_max) = (a.layers as usize, a.rows_max as usize);
    Ok((0..a.rows as usize)
        .map(|r| next_token(a.seed, (0..layers).map(|l| digests[l * rows_max + r])))
        .collect())
}

/// `rows` with every pending token replaced by its entry of `tokens`; an index past `tokens`
/// is refused (the CUDA device checks the same before its launch).
pub fn resolve_pending(rows: &[TokenAt], tokens: &[u32]) -> crate::Result<Vec<TokenAt>> {
    rows.iter()
        .enumerate()
        .map(|(i, t)| match t.pending_index() {
            None => Ok(*t),
            Some(at) => match tokens.get(at as usize) {
                Some(&token) => Ok(TokenAt {
                    token,
                    position: t.position,
                }),
                None => Err(crate::KernelError::OutOfRange {
                    op: "draw",
                    index: i,
                    value: at as i64,
                    limit: tokens.len() as u64,
                }),
            },
        })
        .collect()
}

/// Rows of one global layer of the model of `seed`.
#[derive(Clone, Copy, Debug)]
pub struct DrawArgs<'a> {
    pub seed: u64,
    pub layer: u32,
    pub rows: &'a [TokenAt],
}

/// The raw index key of `token` at `position` in global layer `layer` (128 values), appended.
pub fn index_key_into(seed: u64, t: TokenAt, layer: u32, out: &mut Vec<bf16>) {
    let shared = stream(seed, Stream::KeyShared, t.token as u64, 0, layer as u64);
    let own = stream(
        seed,
        Stream::Key,
        t.token as u64,
        t.position as u64,
        layer as u64,
    );
    out.extend(
        (0..INDEX_HEAD_DIM as u64)
            .map(|d| bf16::from_f32(2.0 * unit(shared, d) + 0.7 * unit(own, d))),
    );
}

/// The raw indexer query of a token, `heads × 128` values, appended. Each head leans on the
/// token's shared key direction, so queries find earlier occurrences of the same token.
pub fn query_into(seed: u64, t: TokenAt, layer: u32, heads: u32, out: &mut Vec<bf16>) {
    let shared = stream(seed, Stream::KeyShared, t.token as u64, 0, layer as u64);
    for h in 0..heads as u64 {
        let own = stream(
            seed,
            Stream::Query,
            t.token as u64,
            t.position as u64 ^ (h << 32),
            layer as u64,
        );
        out.extend(
            (0..INDEX_HEAD_DIM as u64)
                .map(|d| bf16::from_f32(1.5 * unit(shared, d) + unit(own, d))),
        );
    }
}

/// A query token's raw head weights (`heads` values, in [0.5, 1)), appended.
pub fn head_weights_into(seed: u64, t: TokenAt, layer: u32, heads: u32, out: &mut Vec<f32>) {
    let s = stream(
        seed,
        Stream::Weight,
        t.token as u64,
        t.position as u64,
        layer as u64,
    );
    out.extend((0..heads as u64).map(|h| 0.5 + 0.25 * (unit(s, h) + 1.0)));
}

/// The MLA KV row of a token (576 values: 512 latent, 64 RoPE), appended.
pub fn kv_row_into(seed: u64, t: TokenAt, layer: u32, out: &mut Vec<bf16>) {
    let s = stream(
        seed,
        Stream::Kv,
        t.token as u64,
        t.position as u64,
        layer as u64,
    );
    out.extend((0..KV_ROW_VALUES as u64).map(|i| bf16::from_f32(3.0 * unit(s, i))));
}

/// Every row's index key, `[rows][128]`.
pub fn index_keys(a: &DrawArgs) -> Vec<bf16> {
    let mut out = Vec::with_capacity(a.rows.len() * INDEX_HEAD_DIM as usize);
    for &t in a.rows {
        index_key_into(a.seed, t, a.layer, &mut out);
    }
    out
}

/// Every row's queries, `[rows][heads][128]`.
pub fn queries(a: &DrawArgs, heads: u32) -> Vec<bf16> {
    let mut out = Vec::with_capacity(a.rows.len() * (heads * INDEX_HEAD_DIM) as usize);
    for &t in a.rows {
        query_into(a.seed, t, a.layer, heads, &mut out);
    }
    out
}

/// Every row's head weights, `[rows][heads]`.
pub fn head_weights(a: &DrawArgs, heads: u32) -> Vec<f32> {
    let mut out = Vec::with_capacity(a.rows.len() * heads as usize);
    for &t in a.rows {
        head_weights_into(a.seed, t, a.layer, heads, &mut out);
    }
    out
}

/// Every row's MLA KV row, `[rows][576]`.
pub fn kv_rows(a: &DrawArgs) -> Vec<bf16> {
    let mut out = Vec::with_capacity(a.rows.len() * KV_ROW_VALUES as usize);
    for &t in a.rows {
        kv_row_into(a.seed, t, a.layer, &mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_tokens_fold_each_rows_layers_in_order() {
        // Hand-checked: two layers of two rows of a step of three.
        let d = [10u64, 11, 12, 20, 21, 22];
        let nt = |rows_max, rows| crate::args::NextTokens {
            seed: 9,
            layers: 2,
            rows_max,
            rows,
        };
        let got = next_tokens(&nt(3, 2), &d).unwrap();
        let want = |a: u64, b: u64| (mix64(mix64(9 ^ 0x7E57 ^ a) ^ b) % VOCAB as u64) as u32;
        assert_eq!(got, vec![want(10, 20), want(11, 21)]);
        assert!(next_tokens(&nt(3, 4), &d).is_err(), "rows past the step");
        assert!(next_tokens(&nt(3, 1), &d[..5]).is_err(), "short digests");
    }

    #[test]
    fn pending_rows_resolve_from_the_tokens() {
        let rows = [
            TokenAt {
                token: 5,
                position: 1,
            },
            TokenAt::pending(1, 2),
        ];
        assert_eq!(rows[1].pending_index(), Some(1));
        assert_eq!(rows[0].pending_index(), None);
        let got = resolve_pending(&rows, &[7, 8]).unwrap();
        assert_eq!(got[0], rows[0]);
        assert_eq!(
            got[1],
            TokenAt {
                token: 8,
                position: 2
            }
        );
        assert!(matches!(
            resolve_pending(&rows, &[7]),
            Err(crate::KernelError::OutOfRange { index: 1, .. })
        ));
    }

    #[test]
    fn unit_is_in_range_and_on_the_grid() {
        for i in 0..10_000u64 {
            let u = unit(0x1234_5678, i);
            assert!((-1.0..1.0).contains(&u), "{u}");
            assert_eq!((u * (1u64 << 23) as f32).fract(), 0.0, "{u}");
        }
    }

    /// Hand-checked values: the stream and element functions as written in `draw.cu`, evaluated
    /// here once from their definitions (so a change to either side's constants shows).
    #[test]
    fn draws_are_pinned() {
        let t = TokenAt {
            token: 7,
            position: 3,
        };
        let mut k = Vec::new();
        index_key_into(42, t, 1, &mut k);
        // b = 0: the third mix takes the second as it is.
        let shared = mix64(mix64(mix64(mix64(42 ^ 2) ^ 7)) ^ 1);
        let own = mix64(mix64(mix64(mix64(42 ^ 1) ^ 7) ^ 3u64.wrapping_mul(0x9E37_79B9)) ^ 1);
        let v = |b: u64, i: u64| {
            ((mix64(b.wrapping_add(i.wrapping_mul(0xD1B5_4A32_D192_ED03))) >> 40) as f64
                / 8_388_608.0)
                - 1.0
        };
        for d in [0u64, 5, 127] {
            let want = 2.0 * v(shared, d) as f32 + 0.7f32 * v(own, d) as f32;
            assert_eq!(k[d as usize], bf16::from_f32(want), "dim {d}");
        }
        let mut w = Vec::new();
        head_weights_into(42, t, 1, 4, &mut w);
        assert!(w.iter().all(|x| (0.5..1.0).contains(x)), "{w:?}");
    }
}
