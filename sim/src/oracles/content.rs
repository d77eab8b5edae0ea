//! The content oracle: every index-K row an `index_logits` op reads and every KV row a
//! `sparse_read` op reads is judged, at the moment the simulated GPU runs the op, against what
//! the synthetic model says belongs there — by the specification (`tierkv_kernels::spec`), never
//! by the kernel references the executor runs, and addressed through the specification's own
//! byte formats, never through the layout module the engine writes with. It knows each
//! request's tokens (the runner tells it the prompt and every generated token); it never looks
//! at the engine's state.
//!
//! - A KV row must be, byte for byte, the specification's row of its token ([`spec::kv_row`]:
//!   the input bits, or the packed fp8 row computed by the exactly rounded f32 operations the
//!   format defines).
//! - An index-K row must be one the specification accepts for its token, position and layer:
//!   the f64 pipeline's values rounded to nearest even within the f32 computation's error bound
//!   ([`spec::check_index_k_row`]). Each distinct row (by a hash of its bytes) is judged once.
//! - For a sample of the query rows (one in [`SAMPLE_EVERY`] by a hash of the seed, request,
//!   position and layer; every row under `--exhaustive`), the query's fp8 codes and folded head
//!   weights the op reads must be the specification's for the query's token
//!   ([`spec::check_q_head`]), and the specification's f64 logits of that query over every key
//!   it read are kept: the selection `sparse_read` then reads must be a top-k of them within
//!   the f32 logits' error bound ([`spec::check_topk_within`]). Every selection, sampled or not,
//!   must hold `min(index_topk, context)` distinct positions of the context — the *configured*
//!   `index_topk`.
//!
//! The digest oracle (`digest.rs`) then holds each emitted digest to the specification's
//! digest of the selection read, over the specification's KV rows.
//!
//! What it does not judge: rows of pages that a failed, refused, skipped or torn copy left
//! garbage in (the engine must discard what it computed from them; the runner checks that it
//! did), and queries that read such rows (no q or selection check); an index-K page judged
//! before, unwritten since and expected to hold the same tokens (write generations count the
//! writes ops declare: a stray write is the undeclared-write check's to see); page-table
//! entries below 0. The inputs of the ground truth are the synthetic model's (`Synth`, drawn by
//! `cpu::draw`, which the CPU executor also draws an op's inputs from); what is judged from them
//! is the specification's.

use crate::fasthash::{FastHasher, FastMap};
use crate::report::OracleKind;
use std::collections::BTreeMap;
use std::hash::Hasher;
use std::sync::Arc;
use tierkv_engine::config::Config;
use tierkv_engine::cpu_device::Memory;
use tierkv_engine::device::{BufferId, BufferRole, IndexLogits, Op, RowTags, SparseRead};
use tierkv_engine::layout::{BufferKind, IndexKDtype, KvDtype, LayerId};
use tierkv_engine::synth::{LnParams, Synth};
use tierkv_kernels::spec::{self, format};

/// One query row in this many (by a hash) has its logits recomputed by the specification.
pub const SAMPLE_EVERY: u64 = 4;

/// Which query rows are held to the specification's logits.
#[derive(Clone, Copy, Debug)]
pub struct Sampler {
    pub seed: u64,
    /// One row in `every` (1: every row, `--exhaustive`).
    pub every: u64,
}

impl Sampler {
    pub fn sampled(&self, request: u64, position: u32, layer: u32) -> bool {
        self.every <= 1
            || hash_words(&[self.seed, request, position as u64, layer as u64]) % self.every == 0
    }
}

fn hash_words(words: &[u64]) -> u64 {
    let mut h = FastHasher::default();
    for &w in words {
        h.write_u64(w);
    }
    // The multiply-and-rotate hasher leaves its low bits weak: fold the high ones in.
    let v = h.finish();
    v ^ (v >> 29) ^ (v >> 47)
}

fn hash_bytes(parts: &[&[u8]]) -> u64 {
    let mut h = FastHasher::default();
    for p in parts {
        h.write(p);
        h.write_u64(p.len() as u64);
    }
    h.finish()
}

/// Where a row function's `token` argument carries its request's weights' version
/// (`ContentOracle::model_token`); the simulator's own constant, which reads the engine's
/// prefix keys too (the engine's `cache::MODEL_TAG_SHIFT`: a test holds the two equal).
pub const WEIGHTS_SHIFT: u32 = 16;

/// A tagged token (`ContentOracle::model_token`): the token, and the weights' version.
fn split(token: u32) -> (u32, u32) {
    (token & ((1 << WEIGHTS_SHIFT) - 1), token >> WEIGHTS_SHIFT)
}

/// What [`ContentOracle::model_token`] makes of a token that does not fit below the version.
pub const OUT_OF_VOCABULARY: u32 = u32::MAX;

/// A tagged token for a message: `17`, or `17 (weights 1)`.
fn show(token: u32) -> String {
    if token == OUT_OF_VOCABULARY {
        return "out of the vocabulary".to_string();
    }
    match split(token) {
        (t, 0) => t.to_string(),
        (t, v) => format!("{t} (weights {v})"),
    }
}

/// A finding of this oracle: which oracle it belongs to, and its message.
pub type Verdict = (OracleKind, String);

pub struct ContentOracle {
    /// The synthetic model's seed: its weights of version `v` are `Synth::with_weights(seed, v)`.
    seed: u64,
    /// The weights' version the engine computes with now (`set_weights`), and the version each
    /// request was submitted under (all its rows are that version's).
    weights: u32,
    request_weights: BTreeMap<u64, u32>,
    pub ik_dtype: IndexKDtype,
    pub kv_dtype: KvDtype,
    pub ue8m0: bool,
    /// The configured `index_topk` and indexer heads.
    topk: u32,
    heads: u32,
    /// The model's rotary frequencies, from the specification's own formula.
    inv_freq: [f64; 32],
    /// The indexer's LayerNorm parameters per (weights' version, global layer).
    ln: BTreeMap<(u32, u32), LnParams>,
    /// Known tokens of each request: prompt, then every generated token — the first
    /// `confirmed` of them emitted by the engine, the rest told by a `next_tokens` the device
    /// ran (an engine running one step ahead), until the engine emits them.
    pub tokens: BTreeMap<u64, Vec<u32>>,
    /// How many of each request's `tokens` are the prompt's or emitted by the engine.
    confirmed: BTreeMap<u64, usize>,
    /// Index-K rows the specification accepted: (token, position, layer) → the hashes of the
    /// bytes (values and scale) it accepted for it.
    ik_accepted: FastMap<(u32, u32, u32), Vec<u64>>,
    /// Query rows the specification accepted: (token, position, layer) → the hashes of the
    /// codes and weights it accepted.
    q_accepted: FastMap<(u32, u32, u32), Vec<u64>>,
    kv_memo: FastMap<(u32, u32, u32), Arc<Vec<u8>>>,
    /// `spec::row_hash` of each `kv_memo` row: a query's digest hashes every row it selects, and
    /// the same rows are selected query after query.
    kv_hash_memo: FastMap<(u32, u32, u32), u64>,
    /// Selections seen by `sparse_read`: (request, query position, global layer) → positions.
    pub selections: BTreeMap<(u64, u32, u32), Vec<u32>>,
    /// The sampled queries' logits, from the specification: (request, query position, global
    /// layer) → each context position's value and error bound; taken by the `sparse_read` that
    /// reads the query's selection.
    logits: BTreeMap<(u64, u32, u32), Vec<(f64, f64)>>,
    pub sampler: Sampler,
    pub rows_checked: u64,
    /// Rows not compared again because their page was compared, unwritten since, against the same
    /// expected tokens.
    pub rows_cached: u64,
    /// Query rows whose logits and selection were recomputed by the specification.
    pub queries_recomputed: u64,
    /// For each (request, query position, global layer): whether the latest forward of that query
    /// read rows that hold garbage (a failed copy's, or memory a recreated context lost). Those
    /// rows are not compared — the engine must discard what it computed from them, and the
    /// runner checks that no output it emits comes from such a forward.
    pub tainted_reads: BTreeMap<(u64, u32, u32), bool>,
    layer_base: u32,
    /// Pages already compared: (buffer, page) → (write generation, hash of what was expected).
    /// A page read again, unwritten since and expected to hold the same tokens, holds the bytes
    /// that were compared — so comparing them again would prove nothing new.
    verified: FastMap<(BufferId, u64), (u64, u64)>,
}

/// What the GPU knows about a page: which token rows hold garbage (bit `t`: a failed copy left
/// it, or the page's context was recreated since it was written), and how many times the page
/// has been written.
pub trait PageState {
    fn tainted_rows(&self, buf: BufferId, page: u64) -> u64;
    fn generation(&self, buf: BufferId, page: u64) -> u64;
}

impl ContentOracle {
    pub fn new(cfg: &Config, synth: Synth, sampler: Sampler) -> Self {
        ContentOracle {
            seed: synth.seed,
            weights: 0,
            request_weights: BTreeMap::new(),
            ik_dtype: cfg.model.index_k_dtype,
            kv_dtype: cfg.model.kv_dtype,
            // The configured format read here, not through `ScaleFmt::ue8m0`, the engine's own
            // reading of it (a flag the engine got wrong would otherwise be the oracle's too).
            ue8m0: cfg.model.scale_fmt == tierkv_engine::config::ScaleFmt::Ue8m0,
            topk: cfg.model.index_topk,
            heads: cfg.model.index_n_heads,
            // The configured RoPE fields read here, not through `Config::rope`, the engine's own
            // mapping of them (a field it mapped wrongly would otherwise be the oracle's too).
            inv_freq: spec::rope_inv_freq(&tierkv_kernels::rope::RopeParams {
                theta: cfg.model.rope_theta,
                factor: cfg.model.rope_factor,
                original_seq_len: cfg.model.rope_original_seq_len,
                beta_fast: cfg.model.rope_beta_fast,
                beta_slow: cfg.model.rope_beta_slow,
                max_seq_len: cfg.model.context_tokens_max,
                yarn_rule: cfg.model.rope_yarn,
            }),
            ln: BTreeMap::new(),
            tokens: BTreeMap::new(),
            confirmed: BTreeMap::new(),
            ik_accepted: FastMap::default(),
            q_accepted: FastMap::default(),
            kv_memo: FastMap::default(),
            kv_hash_memo: FastMap::default(),
            selections: BTreeMap::new(),
            logits: BTreeMap::new(),
            sampler,
            rows_checked: 0,
            rows_cached: 0,
            queries_recomputed: 0,
            tainted_reads: BTreeMap::new(),
            layer_base: cfg.model.layer_base,
            verified: FastMap::default(),
        }
    }

    pub fn token(&self, request: u64, position: u32) -> Option<u32> {
        self.tokens.get(&request)?.get(position as usize).copied()
    }

    /// The engine's weights change to version `version` (`Engine::update_weights`): requests
    /// submitted from now on are judged by that version's rows.
    pub fn set_weights(&mut self, version: u32) {
        assert!(
            version < (1 << (32 - WEIGHTS_SHIFT)) - 1,
            "weights version {version}: the runner updates to version 1"
        );
        self.weights = version;
    }

    /// The weights' version `request` was submitted under (0 for a request the oracle was
    /// never told of: it has no tokens either, and every look at its rows reports that).
    pub fn weights_of(&self, request: u64) -> u32 {
        self.request_weights.get(&request).copied().unwrap_or(0)
    }

    /// The synthetic model of the weights of version `version`.
    pub fn synth(&self, version: u32) -> Synth {
        Synth::with_weights(self.seed, version)
    }

    /// `token` of a request of weights `version`, as the row functions below take it: the
    /// version above the token id (`VOCAB` < 2^16), the token alone for version 0. A token
    /// that does not fit below the version (an engine's or a device's garbage) becomes
    /// [`OUT_OF_VOCABULARY`], whose rows no request holds: judged, it is a finding.
    pub fn model_token(token: u32, version: u32) -> u32 {
        if token >= 1 << WEIGHTS_SHIFT {
            return OUT_OF_VOCABULARY;
        }
        token | version << WEIGHTS_SHIFT
    }

    /// The token of `request` at `position`, tagged with the request's weights' version.
    fn token_of_model(&self, request: u64, position: u32) -> Option<u32> {
        let t = self.token(request, position)?;
        Some(Self::model_token(t, self.weights_of(request)))
    }

    /// A request's prompt: its first confirmed tokens. It is judged under the current weights.
    pub fn prompt(&mut self, request: u64, prompt: Vec<u32>) {
        self.confirmed.insert(request, prompt.len());
        self.tokens.insert(request, prompt);
        self.request_weights.insert(request, self.weights);
    }

    /// `request` ended: what was kept for its queries goes.
    pub fn forget(&mut self, request: u64) {
        let range = (request, 0, 0)..(request + 1, 0, 0);
        let keys: Vec<_> = self.logits.range(range.clone()).map(|(k, _)| *k).collect();
        for k in keys {
            self.logits.remove(&k);
        }
        let keys: Vec<_> = self.selections.range(range).map(|(k, _)| *k).collect();
        for k in keys {
            self.selections.remove(&k);
        }
    }

    /// How many of `request`'s tokens are confirmed (its prompt and what the engine emitted).
    pub fn confirmed(&self, request: u64) -> usize {
        self.confirmed.get(&request).copied().unwrap_or(0)
    }

    /// The engine emitted `request`'s next token: it is confirmed. A provisional token at its
    /// position that differs is replaced, with every provisional token after it (they were
    /// drawn from it). Returns the index the token took.
    pub fn confirm(&mut self, request: u64, token: u32) -> Option<usize> {
        let n = self.confirmed.get_mut(&request)?;
        let t = self
            .tokens
            .get_mut(&request)
            .expect("a confirmed request has tokens");
        if t.get(*n) != Some(&token) {
            t.truncate(*n);
            t.push(token);
        }
        *n += 1;
        Some(*n - 1)
    }

    /// A `next_tokens` the device ran says `request`'s token at `position` is `token`: known
    /// provisionally (a confirmed token is left as it is; one out of reach is ignored). A
    /// provisional token it replaces is dropped with those after it.
    pub fn generated(&mut self, request: u64, position: u32, token: u32) {
        let n = self.confirmed(request);
        let Some(t) = self.tokens.get_mut(&request) else {
            return;
        };
        let p = position as usize;
        if p < n || p > t.len() {
            return;
        }
        if t.get(p) != Some(&token) {
            t.truncate(p);
            t.push(token);
        }
    }

    /// Whether the specification accepts `values` and `scale` as the index-K row of `token` at
    /// `position` in global `layer` (each distinct row judged once).
    fn ik_ok(
        &mut self,
        token: u32,
        position: u32,
        layer: u32,
        values: &[u8],
        scale: Option<&[u8]>,
    ) -> Result<(), String> {
        let h = hash_bytes(&[values, scale.unwrap_or(&[])]);
        let key = (token, position, layer);
        if self.ik_accepted.get(&key).is_some_and(|v| v.contains(&h)) {
            return Ok(());
        }
        let (token, version) = split(token);
        let synth = self.synth(version);
        let (g, b) = self
            .ln
            .entry((version, layer))
            .or_insert_with(|| synth.ln_params(layer))
            .clone();
        let k = synth.index_key(token, position, layer);
        let rope = spec::rope_row(&self.inv_freq, position);
        let scale = scale.map(|s| f32::from_le_bytes(s.try_into().expect("4 bytes")));
        spec::check_index_k_row(self.ik_dtype, self.ue8m0, &k, &g, &b, &rope, values, scale)?;
        self.ik_accepted.entry(key).or_default().push(h);
        Ok(())
    }

    /// Whether the specification accepts `codes` and `weights` (every head) as the query of
    /// `token` at `position` in global `layer`.
    fn q_ok(
        &mut self,
        token: u32,
        position: u32,
        layer: u32,
        codes: &[u8],
        weights: &[u8],
    ) -> Result<(), String> {
        let h = hash_bytes(&[codes, weights]);
        let key = (token, position, layer);
        if self.q_accepted.get(&key).is_some_and(|v| v.contains(&h)) {
            return Ok(());
        }
        let heads = self.heads as usize;
        let (token, version) = split(token);
        let synth = self.synth(version);
        let q = synth.query(token, position, layer, self.heads);
        let w = synth.head_weights(token, position, layer, self.heads);
        let rope = spec::rope_row(&self.inv_freq, position);
        for hd in 0..heads {
            let w_out = f32::from_le_bytes(weights[4 * hd..4 * hd + 4].try_into().expect("4 B"));
            spec::check_q_head(
                &q[hd * 128..(hd + 1) * 128],
                w[hd],
                &rope,
                heads,
                self.ue8m0,
                &codes[hd * 128..(hd + 1) * 128],
                w_out,
            )
            .map_err(|e| format!("head {hd}: {e}"))?;
        }
        self.q_accepted.entry(key).or_default().push(h);
        Ok(())
    }

    /// The specification's KV row of `token` at `position` in global `layer`. Here and in the
    /// row checks, `token` is tagged with its weights' version ([`ContentOracle::model_token`]).
    pub fn kv_row(&mut self, token: u32, position: u32, layer: u32) -> Arc<Vec<u8>> {
        if let Some(r) = self.kv_memo.get(&(token, position, layer)) {
            return r.clone();
        }
        let (t, version) = split(token);
        let row = self.synth(version).kv_row(t, position, layer);
        let r = Arc::new(spec::kv_row(self.kv_dtype, &row));
        self.kv_memo.insert((token, position, layer), r.clone());
        r
    }

    /// `spec::row_hash` of the specification's KV row of `token` at `position` in `layer`.
    pub fn kv_row_hash(&mut self, token: u32, position: u32, layer: u32) -> u64 {
        if let Some(&h) = self.kv_hash_memo.get(&(token, position, layer)) {
            return h;
        }
        let h = spec::row_hash(&self.kv_row(token, position, layer));
        self.kv_hash_memo.insert((token, position, layer), h);
        h
    }

    /// A hash of the tokens expected at `first..last` of `request` in `layer`.
    fn expect_hash(&self, request: u64, first: u32, last: u32, layer: u32) -> Option<u64> {
        let toks = self.tokens.get(&request)?;
        if last as usize > toks.len() {
            return None;
        }
        let mut h = FastHasher::default();
        h.write_u64(((layer as u64) << 40) ^ ((first as u64) << 20) ^ last as u64);
        // Rows of the same tokens under other weights are other rows.
        h.write_u32(self.weights_of(request));
        for &t in &toks[first as usize..last as usize] {
            h.write_u32(t);
        }
        Some(h.finish())
    }

    /// Judges the rows `op` reads from `mem`; returns one finding per violated op (first row).
    pub fn check_reads(&mut self, op: &Op, mem: &Memory, pages: &dyn PageState) -> Vec<Verdict> {
        match op {
            Op::IndexLogits(o) => {
                if let Some(e) = self.check_tags(
                    op,
                    o.k,
                    BufferKind::IndexK,
                    &o.args.context_lens,
                    &o.tags,
                    mem,
                ) {
                    return vec![(OracleKind::Content, e)];
                }
                self.check_index_k(o, mem, pages)
            }
            Op::SparseRead(o) => {
                if let Some(e) =
                    self.check_tags(op, o.kv, BufferKind::Kv, &o.context_lens, &o.tags, mem)
                {
                    return vec![(OracleKind::Content, e)];
                }
                let sel: Vec<i32> = mem
                    .region(o.slots)
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
                    .collect();
                self.check_kv(o, &sel, mem, pages)
            }
            _ => Vec::new(),
        }
    }

    /// The oracle relies on the engine's row tags: they must cover every row, and the pool read
    /// must be the pool of the tagged layer.
    fn check_tags(
        &self,
        op: &Op,
        buf: BufferId,
        kind: BufferKind,
        context_lens: &[i32],
        tags: &RowTags,
        mem: &Memory,
    ) -> Option<String> {
        if tags.rows.len() != context_lens.len() {
            return Some(format!(
                "{} carries {} row tags for {} rows",
                op.name(),
                tags.rows.len(),
                context_lens.len()
            ));
        }
        let want = BufferRole::Pool {
            kind,
            layer: LayerId(tags.layer_global.wrapping_sub(self.layer_base)),
        };
        let role = mem.desc(buf).role;
        (role != want).then(|| {
            format!(
                "{} for global layer {} reads {role}, not the {want}",
                op.name(),
                tags.layer_global
            )
        })
    }

    fn check_index_k(
        &mut self,
        o: &IndexLogits,
        mem: &Memory,
        pages: &dyn PageState,
    ) -> Vec<Verdict> {
        let dtype = self.ik_dtype;
        let pb = format::index_k_page_bytes(dtype);
        let (buf, a, layer) = (mem.bytes(o.k), &o.args, o.tags.layer_global);
        let content = |m: String| vec![(OracleKind::Content, m)];
        for (r, tag) in o.tags.rows.iter().enumerate() {
            let ctx = a.context_lens[r] as u32;
            let pt = &a.page_table[r * a.pt_stride as usize..][..ctx.div_ceil(64) as usize];
            let mut tainted_read = false;
            for (j, &page) in pt.iter().enumerate() {
                let j = j as u32;
                if page < 0 {
                    continue;
                }
                let (first, last) = (j * 64, ((j + 1) * 64).min(ctx));
                // `None` when a row's token is unknown: only a row with garbage may be so.
                let want_hash = self.expect_hash(tag.request, first, last, layer);
                let rows_used = if last - first == 64 {
                    u64::MAX
                } else {
                    (1u64 << (last - first)) - 1
                };
                let bad_rows = pages.tainted_rows(o.k, page as u64) & rows_used;
                tainted_read |= bad_rows != 0;
                // A page compared before, unwritten since and expected to hold the same tokens
                // holds the very bytes that were compared: nothing new to learn from them.
                let gen = pages.generation(o.k, page as u64);
                if bad_rows == 0
                    && want_hash
                        .is_some_and(|h| self.verified.get(&(o.k, page as u64)) == Some(&(gen, h)))
                {
                    self.rows_cached += (last - first) as u64;
                    continue;
                }
                let bytes =
                    &buf[format::page_at(format::Placement::Device, pb, page as u32)..][..pb];
                for n in first..last {
                    let t = (n % 64) as usize;
                    if bad_rows & (1u64 << t) != 0 {
                        continue;
                    }
                    let Some(token) = self.token_of_model(tag.request, n) else {
                        return content(format!(
                            "request {} reads index-K position {n}, past its known tokens",
                            tag.request
                        ));
                    };
                    self.rows_checked += 1;
                    let (at, len) = format::index_k_values(dtype, t);
                    let scale = format::index_k_scale(dtype, t).map(|s| &bytes[s..s + 4]);
                    if let Err(e) = self.ik_ok(token, n, layer, &bytes[at..at + len], scale) {
                        return content(format!(
                            "index-K read of request {} position {n} (page {page}, token {t}) in layer {layer}, \
                             query position {}: not the specification's row of token {}: {e}",
                            tag.request,
                            tag.position,
                            show(token)
                        ));
                    }
                }
                if let (0, Some(h)) = (bad_rows, want_hash) {
                    self.verified.insert((o.k, page as u64), (gen, h));
                }
            }
            self.tainted_reads
                .insert((tag.request, tag.position, layer), tainted_read);
            if !tainted_read && self.sampler.sampled(tag.request, tag.position, layer) {
                if let Err(v) = self.recompute_query(o, r, mem) {
                    return vec![v];
                }
            }
        }
        Vec::new()
    }

    /// Row `r` of `o`, a sampled query: its codes and weights held to the specification, then
    /// the specification's logits of it over every key the row reads, kept for its selection.
    fn recompute_query(&mut self, o: &IndexLogits, r: usize, mem: &Memory) -> Result<(), Verdict> {
        let tag = o.tags.rows[r];
        let layer = o.tags.layer_global;
        let heads = o.args.heads as usize;
        let codes = &mem.region(o.q)[r * heads * 128..][..heads * 128];
        let weights = &mem.region(o.w)[r * heads * 4..][..heads * 4];
        let Some(token) = self.token_of_model(tag.request, tag.position) else {
            return Err((
                OracleKind::Content,
                format!(
                    "request {} queries position {}, past its known tokens",
                    tag.request, tag.position
                ),
            ));
        };
        if let Err(e) = self.q_ok(token, tag.position, layer, codes, weights) {
            return Err((
                OracleKind::Reference,
                format!(
                    "the query of request {} at position {} (token {}) in layer {layer} is not the \
                     specification's: {e}",
                    tag.request,
                    tag.position,
                    show(token)
                ),
            ));
        }
        let w: Vec<f32> = weights
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let ctx = o.args.context_lens[r] as usize;
        let pb = format::index_k_page_bytes(self.ik_dtype);
        let buf = mem.bytes(o.k);
        let mut scores = Vec::with_capacity(ctx);
        let mut keys = Vec::with_capacity(64);
        for (j, &page) in o.args.page_table[r * o.args.pt_stride as usize..][..ctx.div_ceil(64)]
            .iter()
            .enumerate()
        {
            let bytes = &buf[format::page_at(format::Placement::Device, pb, page as u32)..][..pb];
            keys.clear();
            keys.extend(
                (0..(ctx - 64 * j).min(64)).map(|t| spec::key_f64(self.ik_dtype, bytes, t)),
            );
            scores.extend(spec::logits_f64(codes, &w, &keys));
        }
        self.queries_recomputed += 1;
        self.logits
            .insert((tag.request, tag.position, layer), scores);
        Ok(())
    }

    fn check_kv(
        &mut self,
        op: &SparseRead,
        sel: &[i32],
        mem: &Memory,
        pages: &dyn PageState,
    ) -> Vec<Verdict> {
        let SparseRead {
            kv,
            args: tierkv_engine::device::args::SparseRead { k, .. },
            ref page_table,
            pt_stride,
            ref context_lens,
            ref tags,
            ..
        } = *op;
        let dtype = self.kv_dtype;
        let rb = format::kv_row_bytes(dtype);
        let buf = mem.bytes(kv);
        let layer = tags.layer_global;
        let content = |m: String| vec![(OracleKind::Content, m)];
        for (r, tag) in tags.rows.iter().enumerate() {
            let ctx = context_lens[r] as u32;
            let pt = &page_table[r * pt_stride as usize..][..ctx.div_ceil(64) as usize];
            let mut positions = Vec::new();
            let mut tainted_read = false;
            for i in 0..k as usize {
                let s = sel[r * k as usize + i];
                if s < 0 {
                    continue;
                }
                // A KV slot is row `s` of the pool: page `s / 64`, row `s % 64` of it.
                let (page, t) = (s / 64, (s % 64) as u32);
                let Some(j) = pt.iter().position(|&p| p == page) else {
                    return content(format!(
                        "request {} (query position {}) layer {layer}: selected slot {s} is in page {page}, \
                         which is not in the row's page table",
                        tag.request, tag.position
                    ));
                };
                let n = j as u32 * 64 + t;
                if n >= ctx {
                    return content(format!(
                        "request {} (query position {}) layer {layer}: selected position {n} is past the context ({ctx})",
                        tag.request, tag.position
                    ));
                }
                positions.push(n);
                if pages.tainted_rows(kv, page as u64) & (1u64 << t) != 0 {
                    tainted_read = true;
                    continue;
                }
                let Some(token) = self.token_of_model(tag.request, n) else {
                    return content(format!(
                        "request {} reads KV position {n}, past its known tokens",
                        tag.request
                    ));
                };
                let want = self.kv_row(token, n, layer);
                let got = &buf[s as usize * rb..][..rb];
                self.rows_checked += 1;
                if got != want.as_slice() {
                    let b = got
                        .iter()
                        .zip(want.iter())
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    return content(format!(
                        "KV read of request {} position {n} (slot {s}) in layer {layer}: byte {b} is {:#04x}, \
                         the specification's row of token {} says {:#04x} (query position {})",
                        tag.request,
                        got[b],
                        show(token),
                        want[b],
                        tag.position
                    ));
                }
            }
            let tainted = {
                let t = self
                    .tainted_reads
                    .entry((tag.request, tag.position, layer))
                    .or_default();
                *t |= tainted_read;
                *t
            };
            let logits = self.logits.remove(&(tag.request, tag.position, layer));
            if !tainted {
                if let Some(v) =
                    self.check_selection(tag.request, tag.position, layer, &positions, logits)
                {
                    return vec![v];
                }
            }
            self.selections
                .insert((tag.request, tag.position, layer), positions);
        }
        Vec::new()
    }

    /// A query's selection: `min(index_topk, context)` distinct positions of its context (the
    /// query at position `p` sees `p + 1`), and, where the query was sampled, a top-k of the
    /// specification's logits within their bounds.
    fn check_selection(
        &self,
        request: u64,
        position: u32,
        layer: u32,
        selected: &[u32],
        logits: Option<Vec<(f64, f64)>>,
    ) -> Option<Verdict> {
        let context = position as usize + 1;
        let scores = match logits {
            Some(s) => s,
            // Not sampled: only what the selection's size and positions say.
            None => vec![(0.0, f64::INFINITY); context],
        };
        if scores.len() != context {
            return Some((
                OracleKind::TopK,
                format!(
                    "request {request} position {position} layer {layer}: the query scored {} keys; its context is {context}",
                    scores.len()
                ),
            ));
        }
        let bounded: Vec<(f64, f64)> = scores
            .iter()
            .map(|&(v, m)| (v, spec::LOGIT_ERROR_UNITS * spec::U32 * m))
            .collect();
        spec::check_topk_within(selected, &bounded, self.topk as usize)
            .err()
            .map(|e| {
                (
                    OracleKind::TopK,
                    format!(
                        "request {request} position {position} layer {layer}: the selection read is not a top-{} \
                         (index_topk) of the specification's logits: {e}",
                        self.topk
                    ),
                )
            })
    }
}

impl ContentOracle {
    /// Judges one whole page of `kind` — tokens `tokens` at positions `first..first + 64` of
    /// global layer `layer` — in buffer `buf`, page `page` placed as `placement` says (the
    /// specification's placement, not the engine's views). The tokens are tagged with the
    /// weights' version they were computed under ([`ContentOracle::model_token`]). The message
    /// names the first row that differs.
    #[allow(clippy::too_many_arguments)]
    pub fn audit_page(
        &mut self,
        mem: &Memory,
        kind: BufferKind,
        buf: BufferId,
        placement: format::Placement,
        page: u32,
        tokens: &[u32],
        first: u32,
        layer: u32,
    ) -> Option<String> {
        let pb = match kind {
            BufferKind::Kv => format::kv_page_bytes(self.kv_dtype),
            BufferKind::IndexK => format::index_k_page_bytes(self.ik_dtype),
        };
        let at = format::page_at(placement, pb, page);
        let bytes = &mem.bytes(buf)[at..at + pb];
        for (t, &token) in tokens.iter().enumerate() {
            let n = first + t as u32;
            self.rows_checked += 1;
            let differs = match kind {
                BufferKind::Kv => {
                    let want = self.kv_row(token, n, layer);
                    let rb = want.len();
                    (bytes[t * rb..(t + 1) * rb] != want[..])
                        .then(|| "not the specification's row".to_string())
                }
                BufferKind::IndexK => {
                    let dtype = self.ik_dtype;
                    let (v, len) = format::index_k_values(dtype, t);
                    let scale = format::index_k_scale(dtype, t).map(|s| &bytes[s..s + 4]);
                    self.ik_ok(token, n, layer, &bytes[v..v + len], scale).err()
                }
            };
            if let Some(why) = differs {
                return Some(format!(
                    "{} row of position {n} (row {t} of the page) in layer {layer} is not the specification's \
                     row of token {}: {why}",
                    kind.name(),
                    show(token)
                ));
            }
        }
        None
    }
}
