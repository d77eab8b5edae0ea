//! The digest and top-k oracles: every digest the engine emits is recomputed here from the
//! synthetic model alone — expected index-K rows, the query's `q_prep`, the logits over the whole
//! context, the top-k with the *configured* `index_topk`, and the digest of the expected KV rows of
//! that selection. When a digest differs, the selection the GPU actually read (recorded by the
//! content oracle) says whether the top-k itself went wrong.
//!
//! The recomputation uses the kernels' CPU references, which the executor shares; so each value
//! it derives is held to the specification's independent version (`tierkv_kernels::spec`): every
//! query head's `q_prep`, and for one query in [`SPEC_SAMPLE`] (by its context's hash, so a seed
//! always checks the same ones) the logits in f64, the top-k by sorting and the digest from its
//! definition. A disagreement is a reference bug, reported through the content oracle's
//! `reference_errors`.

use super::content::ContentOracle;
use crate::fasthash::FastMap;
use std::collections::BTreeMap;
use std::sync::Arc;
use tierkv_engine::layout::IndexKDtype;
use tierkv_kernels::cpu::logits::{apply_scale, block_scores, decode_q, KeyBlock, WIDE};
use tierkv_kernels::cpu::numerics::{bf16_value, e4m3_decode, mix64};
use tierkv_kernels::cpu::q_prep::{head_weight_scale, q_prep_head};
use tierkv_kernels::cpu::sparse_read::rank_term;
use tierkv_kernels::cpu::topk::topk_positions;
use tierkv_kernels::spec;

/// What the reference computed for one query, for `check_with_spec`.
struct SpecQuery<'a> {
    token: u32,
    position: u32,
    layer: u32,
    codes: &'a [u8],
    weights: &'a [f32],
    scores: &'a [f32],
    selection: &'a [u32],
    digest: u64,
}

/// One query (context) in this many has its logits, top-k and digest recomputed by the
/// specification's independent versions.
pub const SPEC_SAMPLE: u64 = 32;

/// A decoded index key and its fp8 scale (1 for bf16).
type Key = ([f32; 128], f32);

/// A request's keys in one layer: the token each position's key was made for, and the keys in
/// pages of 64, decoded and transposed, as `block_scores` scores them (a query scores its whole
/// context, and the next query of the request the same keys and one more).
#[derive(Default)]
struct Context {
    tokens: Vec<u32>,
    blocks: Vec<Box<KeyBlock>>,
}

impl Context {
    fn set(&mut self, n: usize, token: u32, key: &Key) {
        let b = n / WIDE;
        while self.blocks.len() <= b {
            self.blocks.push(KeyBlock::new());
        }
        self.blocks[b].set(n % WIDE, &key.0, key.1);
        match self.tokens.get_mut(n) {
            Some(t) => *t = token,
            None => {
                assert_eq!(
                    self.tokens.len(),
                    n,
                    "a context grows one position at a time"
                );
                self.tokens.push(token);
            }
        }
    }
}

/// A query's expected digest and the positions its top-k selects.
pub type Expected = (u64, Arc<Vec<u32>>);

/// Which oracle a digest mismatch belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    TopK(String),
    Digest(String),
}

pub struct DigestOracle {
    pub topk: u32,
    pub heads: u32,
    pub layers: u32,
    pub layer_base: u32,
    /// (hash of the context up to the query, global layer) → what it expects there.
    memo: FastMap<(u64, u32), Expected>,
    /// (token, position, layer) → the decoded key and its scale.
    keys: FastMap<(u32, u32, u32), Arc<Key>>,
    /// (request, global layer) → the keys of its positions so far, in key blocks: a query scores
    /// its whole context, 64 keys at a time. A cache: a request's entries are dropped when it
    /// ends ([`DigestOracle::forget`]; 33 KB per 64 positions and layer) and rebuilt from `keys`
    /// if it is queried again.
    contexts: FastMap<(u64, u32), Context>,
    prefix: BTreeMap<u64, Vec<u64>>,
    pub digests_checked: u64,
}

impl DigestOracle {
    pub fn new(cfg: &tierkv_engine::Config) -> Self {
        DigestOracle {
            topk: cfg.model.index_topk,
            heads: cfg.model.index_n_heads,
            layers: cfg.model.layers,
            layer_base: cfg.model.layer_base,
            memo: FastMap::default(),
            keys: FastMap::default(),
            contexts: FastMap::default(),
            prefix: BTreeMap::new(),
            digests_checked: 0,
        }
    }

    /// `request` ended: its contexts are not kept (they hold the most memory of this oracle).
    pub fn forget(&mut self, request: u64) {
        for layer in self.layer_base..self.layer_base + self.layers {
            self.contexts.remove(&(request, layer));
        }
    }

    /// Hash of tokens `0..=position` of `request` (content, so equal prefixes share a memo).
    fn prefix_hash(&mut self, c: &ContentOracle, request: u64, position: u32) -> u64 {
        let toks = &c.tokens[&request];
        let h = self.prefix.entry(request).or_default();
        while h.len() <= position as usize {
            let i = h.len();
            let prev = if i == 0 { 0x5EED } else { h[i - 1] };
            h.push(mix64(prev ^ ((toks[i] as u64) << 20) ^ i as u64));
        }
        h[position as usize]
    }

    fn key(&mut self, c: &mut ContentOracle, token: u32, pos: u32, layer: u32) -> Arc<Key> {
        if let Some(k) = self.keys.get(&(token, pos, layer)) {
            return k.clone();
        }
        let row = c.ik_row(token, pos, layer);
        let mut k = [0f32; 128];
        match c.ik_dtype {
            IndexKDtype::Fp8 => {
                for (d, kd) in k.iter_mut().enumerate() {
                    *kd = e4m3_decode(row.values[d]);
                }
            }
            IndexKDtype::Bf16 => {
                for (d, kd) in k.iter_mut().enumerate() {
                    *kd = bf16_value(u16::from_le_bytes([
                        row.values[2 * d],
                        row.values[2 * d + 1],
                    ]));
                }
            }
        }
        let v = Arc::new((k, row.scale.unwrap_or(1.0)));
        self.keys.insert((token, pos, layer), v.clone());
        v
    }

    /// The expected digest and selection of `request`'s query at `position` in global `layer`.
    pub fn expected(
        &mut self,
        c: &mut ContentOracle,
        request: u64,
        position: u32,
        layer: u32,
    ) -> Expected {
        let ph = self.prefix_hash(c, request, position);
        if let Some(v) = self.memo.get(&(ph, layer)) {
            return v.clone();
        }
        // Borrowed out of the content oracle (which `key` and `kv_row` below need mutably) and
        // put back at the end: nothing between returns early.
        let toks = std::mem::take(c.tokens.get_mut(&request).expect("a known request"));
        let token = toks[position as usize];
        let synth = c.synth;
        let q = synth.query(token, position, layer, self.heads);
        let w = synth.head_weights(token, position, layer, self.heads);
        let rope = c.rope.row(position);
        let (ue8m0, heads) = (c.ue8m0, self.heads as usize);
        let head_scale = head_weight_scale(heads);
        let mut qf = Vec::with_capacity(self.heads as usize * 128);
        let mut wf = Vec::with_capacity(self.heads as usize);
        let mut qcodes = Vec::with_capacity(self.heads as usize * 128);
        for h in 0..self.heads as usize {
            let mut codes = [0u8; 128];
            let qh = &q[h * 128..(h + 1) * 128];
            let folded = q_prep_head(qh, w[h], &rope, ue8m0, head_scale, &mut codes);
            if let Err(e) = spec::check_q_head(qh, w[h], &rope, heads, ue8m0, &codes, folded) {
                c.reference_errors.push(format!(
                    "the q_prep reference's head {h} of token {token} at position {position}, layer {layer}, \
                     disagrees with the specification: {e}"
                ));
            }
            wf.push(folded);
            qf.extend(decode_q(&codes));
            qcodes.extend_from_slice(&codes);
        }
        let dtype = c.ik_dtype;
        let mut context = self.contexts.remove(&(request, layer)).unwrap_or_default();
        for n in 0..=position {
            let token = toks[n as usize];
            if context.tokens.get(n as usize) != Some(&token) {
                let key = self.key(c, token, n, layer);
                context.set(n as usize, token, &key);
            }
        }
        let len = position as usize + 1;
        assert!(
            context.tokens.len() >= len && context.blocks.len() * WIDE >= len,
            "request {request} layer {layer}: the context holds {} keys in {} blocks, the query \
             reads {len}",
            context.tokens.len(),
            context.blocks.len()
        );
        let mut scores = vec![0f32; len];
        for (block, out) in context.blocks.iter().zip(scores.chunks_mut(WIDE)) {
            let s = block_scores(&qf, &wf, block);
            for (t, o) in out.iter_mut().enumerate() {
                *o = apply_scale(s[t], block.scales[t], dtype);
            }
        }
        self.contexts.insert((request, layer), context);
        let sel = topk_positions(&scores, self.topk as usize);
        let digest = sel.iter().enumerate().fold(0u64, |acc, (i, &n)| {
            acc.wrapping_add(rank_term(i, c.kv_row_hash(toks[n as usize], n, layer)))
        });
        if ph % SPEC_SAMPLE == 0 {
            let query = SpecQuery {
                token,
                position,
                layer,
                codes: &qcodes,
                weights: &wf,
                scores: &scores,
                selection: &sel,
                digest,
            };
            self.check_with_spec(c, &toks, &query);
        }
        c.tokens.insert(request, toks);
        let v = (digest, Arc::new(sel));
        self.memo.insert((ph, layer), v.clone());
        v
    }

    /// Holds one query's reference logits, top-k and digest to the specification's versions.
    fn check_with_spec(&mut self, c: &mut ContentOracle, toks: &[u32], q: &SpecQuery) {
        let keys: Vec<([f64; 128], f64)> = (0..=q.position)
            .map(|n| {
                let row = c.ik_row(toks[n as usize], n, q.layer);
                spec::key_row_f64(c.ik_dtype, &row.values, row.scale)
            })
            .collect();
        let want = spec::logits_f64(q.codes, q.weights, &keys);
        let (token, position, layer) = (q.token, q.position, q.layer);
        let what = format!("token {token} at position {position}, layer {layer}");
        for (n, (&got, &(value, magnitude))) in q.scores.iter().zip(&want).enumerate() {
            if (got as f64 - value).abs() > 1e-5 * magnitude + 1e-30 {
                c.reference_errors.push(format!(
                    "the index_logits reference's logit {n} of the query of {what} is {got:e}, \
                     the specification's {value:e} (magnitude {magnitude:e})"
                ));
                return;
            }
        }
        if spec::topk_order(q.scores, self.topk as usize) != q.selection {
            c.reference_errors.push(format!(
                "the topk reference's selection for the query of {what} is not the specification's"
            ));
            return;
        }
        let rows: Vec<_> = q
            .selection
            .iter()
            .map(|&n| c.kv_row(toks[n as usize], n, layer))
            .collect();
        if spec::digest(rows.iter().map(|r| Some(r.as_slice()))) != q.digest {
            c.reference_errors.push(format!(
                "the sparse_read reference's digest for the query of {what} is not the specification's"
            ));
        }
    }

    /// Checks one emitted `Digests` output.
    pub fn check(
        &mut self,
        c: &mut ContentOracle,
        request: u64,
        position: u32,
        digests: &[u64],
    ) -> Option<Mismatch> {
        if digests.len() != self.layers as usize {
            return Some(Mismatch::Digest(format!(
                "request {request} position {position}: {} digests for {} layers",
                digests.len(),
                self.layers
            )));
        }
        for (l, &got) in digests.iter().enumerate() {
            let layer = self.layer_base + l as u32;
            let (want, sel) = self.expected(c, request, position, layer);
            self.digests_checked += 1;
            if got == want {
                continue;
            }
            if let Some(read) = c.selections.get(&(request, position, layer)) {
                if read.as_slice() != sel.as_slice() {
                    let i = read
                        .iter()
                        .zip(sel.iter())
                        .position(|(a, b)| a != b)
                        .unwrap_or(read.len().min(sel.len()));
                    return Some(Mismatch::TopK(format!(
                        "request {request} position {position} layer {layer}: the GPU read {} selected positions, \
                         the recomputation selects {} (index_topk = {}); first difference at rank {i}: {:?} vs {:?}",
                        read.len(),
                        sel.len(),
                        self.topk,
                        read.get(i),
                        sel.get(i)
                    )));
                }
            }
            return Some(Mismatch::Digest(format!(
                "request {request} position {position} layer {layer}: digest {got:#018x}, recomputed {want:#018x}"
            )));
        }
        None
    }
}
