use super::*;
use std::collections::BTreeSet;

/// Every weights version up to the engine's limit draws a model of its own: no two versions
/// (and no version and the original) share an index key, so rows computed under one version
/// never pass for another's; and two seeds' models stay apart at every version.
#[test]
fn every_weights_version_draws_its_own_model() {
    let mut seen = BTreeSet::new();
    for version in 0..=crate::cache::WEIGHTS_VERSION_MAX {
        let key: Vec<u16> = Synth::with_weights(11, version)
            .index_key(5, 3, 1)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert!(
            seen.insert(key),
            "version {version} draws an earlier version's model"
        );
    }
    assert_eq!(Synth::with_weights(11, 0), Synth::new(11));
    // Two seeds' models stay apart at every version too.
    for version in 1..64 {
        let key = |seed| Synth::with_weights(seed, version).index_key(5, 3, 1);
        assert_ne!(key(8), key(11), "seeds 8 and 11 at version {version}");
    }
}

/// A KV row holds the 576 values of the draw.
#[test]
fn a_kv_row_is_the_draw() {
    let s = Synth::new(4);
    let row = s.kv_row(9, 70, 2);
    let mut want = Vec::new();
    draw::kv_row_into(
        4,
        TokenAt {
            token: 9,
            position: 70,
        },
        2,
        &mut want,
    );
    assert_eq!(row.len(), KV_ROW_VALUES as usize);
    assert_eq!(row, want);
}

/// An index key holds the 128 values of the draw, appended to what the buffer held.
#[test]
fn an_index_key_is_the_draw() {
    let s = Synth::new(4);
    let t = TokenAt {
        token: 9,
        position: 70,
    };
    let key = s.index_key(t.token, t.position, 2);
    let mut want = Vec::new();
    draw::index_key_into(4, t, 2, &mut want);
    assert_eq!(key.len(), INDEX_HEAD_DIM as usize);
    assert_eq!(key, want);
    let mut out = vec![bf16::ZERO];
    s.index_key_into(t.token, t.position, 2, &mut out);
    assert_eq!(out.len(), 1 + INDEX_HEAD_DIM as usize);
    assert_eq!(out[1..], key[..]);
}

/// A query holds `heads × 128` values, the draw's, and no two neighbouring heads are one.
#[test]
fn a_query_is_every_heads_draw() {
    let s = Synth::new(3);
    let t = TokenAt {
        token: 9,
        position: 40,
    };
    for heads in [1, 4, 64] {
        let q = s.query(t.token, t.position, 2, heads);
        assert_eq!(q.len(), heads as usize * INDEX_HEAD_DIM as usize);
        let mut want = Vec::new();
        draw::query_into(3, t, 2, heads, &mut want);
        assert_eq!(q, want, "{heads} heads");
        if heads > 1 {
            assert_ne!(
                q[..128],
                q[128..256],
                "{heads} heads: the first two are one head"
            );
        }
    }
}

/// A query token's head weights are one positive value a head, the draw's.
#[test]
fn head_weights_are_every_heads_draw() {
    let s = Synth::new(3);
    let t = TokenAt {
        token: 9,
        position: 40,
    };
    for heads in [1, 4, 64] {
        let w = s.head_weights(t.token, t.position, 2, heads);
        assert_eq!(w.len(), heads as usize);
        assert!(w.iter().all(|&x| x > 0.0), "{w:?}");
        let mut want = Vec::new();
        draw::head_weights_into(3, t, 2, heads, &mut want);
        assert_eq!(w, want, "{heads} heads");
    }
}

/// The LayerNorm weight and bias of a layer are 128 values each, drawn apart from one stream
/// of the layer: the weight `1 + 0.25 u` from its elements 0..128, the bias `0.1 u` from
/// elements 128..256 (so the weight in [0.75, 1.25), the bias in [-0.1, 0.1)). Pinned because
/// the engine, the CUDA device (which uploads them) and the oracles take them from here.
#[test]
fn layer_norm_weight_and_bias_are_drawn_apart() {
    let s = Synth::new(21);
    for layer in 0..8 {
        let (g, b) = s.ln_params(layer);
        let ln = draw::stream(21, Stream::Ln, layer as u64, 0, 0);
        let want_g: Vec<f32> = (0..128).map(|i| 1.0 + 0.25 * draw::unit(ln, i)).collect();
        let want_b: Vec<f32> = (0..128).map(|i| 0.1 * draw::unit(ln, 128 + i)).collect();
        assert_eq!(
            (&g[..], &b[..]),
            (&want_g[..], &want_b[..]),
            "layer {layer}"
        );
        assert!(
            g.iter().all(|x| (0.75..1.25).contains(x)),
            "layer {layer}: {g:?}"
        );
        assert!(
            b.iter().all(|x| (-0.1..0.1).contains(x)),
            "layer {layer}: {b:?}"
        );
    }
}
