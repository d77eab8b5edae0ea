//! The content oracle: every index-K row an `index_logits` op reads and every KV row a
//! `sparse_read` op reads is compared, byte for byte, with what the synthetic model says belongs
//! there — at the moment the simulated GPU runs the op. It knows each request's tokens (the runner
//! tells it the prompt and every generated token) and computes expected rows with the kernels' CPU
//! references on fresh inputs; it never looks at the engine's state. Every expected row is held,
//! once, to the specification's independent version (`tierkv_kernels::spec`) before it is used:
//! a bug in a reference, which the executor shares, shows up there (`reference_errors`).
//!
//! Rows of pages that a failed copy left garbage in are not compared (the engine must discard what
//! it computed from them; the digest oracle checks that it did).

use crate::fasthash::FastMap;
use std::collections::BTreeMap;
use std::sync::Arc;
use tierkv_engine::config::Config;
use tierkv_engine::cpu_device::Memory;
use tierkv_engine::device::{BufferId, BufferRole, Op, RowTags, SparseRead};
use tierkv_engine::layout::{
    index_k_page, kv_row, slot_offset, slot_page, BufferKind, IndexKDtype, KvDtype, LayerId,
    PageFormat, SlotId, PAGE_TOKENS,
};
use tierkv_engine::synth::{LnParams, Synth};
use tierkv_kernels::cpu::numerics::le_i32s;
use tierkv_kernels::cpu::sparse_read::row_hash;
use tierkv_kernels::cpu::store::{index_k_token, kv_token};
use tierkv_kernels::rope::Rope;
use tierkv_kernels::spec;

/// What the synthetic model says an index-K row is: its value bytes and (fp8) scale.
#[derive(Clone, Debug, PartialEq)]
pub struct IkRow {
    pub values: Vec<u8>,
    pub scale: Option<f32>,
}

pub struct ContentOracle {
    pub synth: Synth,
    pub ik_dtype: IndexKDtype,
    pub kv_dtype: KvDtype,
    pub ue8m0: bool,
    /// The model's RoPE frequencies, as the engine's rows use them.
    pub rope: Rope,
    ln: BTreeMap<u32, LnParams>,
    /// Known tokens of each request: prompt, then every generated token — the first
    /// `confirmed` of them emitted by the engine, the rest told by a `next_tokens` the device
    /// ran (an engine running one step ahead), until the engine emits them.
    pub tokens: BTreeMap<u64, Vec<u32>>,
    /// How many of each request's `tokens` are the prompt's or emitted by the engine.
    confirmed: BTreeMap<u64, usize>,
    ik_memo: FastMap<(u32, u32, u32), Arc<IkRow>>,
    kv_memo: FastMap<(u32, u32, u32), Arc<Vec<u8>>>,
    /// `row_hash` of each `kv_memo` row: a query's digest hashes every row it selects, and the
    /// same rows are selected query after query.
    kv_hash_memo: FastMap<(u32, u32, u32), u64>,
    /// Selections seen by `sparse_read`: (request, query position, global layer) → positions.
    pub selections: BTreeMap<(u64, u32, u32), Vec<u32>>,
    pub rows_checked: u64,
    /// Rows not compared again because their page was compared, unwritten since, against the same
    /// expected tokens.
    pub rows_cached: u64,
    /// For each (request, query position, global layer): whether the latest forward of that query
    /// read rows a failed copy left garbage in. Those rows are not compared — the engine must
    /// discard what it computed from them, and the runner checks that no output it emits comes
    /// from such a forward.
    pub tainted_reads: BTreeMap<(u64, u32, u32), bool>,
    layer_base: u32,
    /// Pages already compared: (buffer, page) → (write generation, hash of what was expected).
    /// A page read again, unwritten since and expected to hold the same tokens, holds the bytes
    /// that were compared — so comparing them again would prove nothing new.
    verified: FastMap<(BufferId, u64), (u64, u64)>,
    /// Expected values a reference computed that the specification's independent version
    /// disagrees with (this oracle's and the digest oracle's), for the runner to report.
    pub reference_errors: Vec<String>,
}

/// What the GPU knows about a page: which token rows a failed copy left garbage in (bit `t`),
/// and how many times the page has been written.
pub trait PageState {
    fn tainted_rows(&self, buf: BufferId, page: u64) -> u64;
    fn generation(&self, buf: BufferId, page: u64) -> u64;
}

impl ContentOracle {
    pub fn new(cfg: &Config, synth: Synth) -> Self {
        ContentOracle {
            synth,
            ik_dtype: cfg.model.index_k_dtype,
            kv_dtype: cfg.model.kv_dtype,
            ue8m0: cfg.model.scale_fmt.ue8m0(),
            rope: Rope::new(&cfg.rope()),
            ln: BTreeMap::new(),
            tokens: BTreeMap::new(),
            confirmed: BTreeMap::new(),
            ik_memo: FastMap::default(),
            kv_memo: FastMap::default(),
            kv_hash_memo: FastMap::default(),
            selections: BTreeMap::new(),
            rows_checked: 0,
            rows_cached: 0,
            tainted_reads: BTreeMap::new(),
            layer_base: cfg.model.layer_base,
            verified: FastMap::default(),
            reference_errors: Vec::new(),
        }
    }

    pub fn token(&self, request: u64, position: u32) -> Option<u32> {
        self.tokens.get(&request)?.get(position as usize).copied()
    }

    /// A request's prompt: its first confirmed tokens.
    pub fn prompt(&mut self, request: u64, prompt: Vec<u32>) {
        self.confirmed.insert(request, prompt.len());
        self.tokens.insert(request, prompt);
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

    /// The expected index-K row of `token` at `position` in global layer `layer`.
    pub fn ik_row(&mut self, token: u32, position: u32, layer: u32) -> Arc<IkRow> {
        if let Some(r) = self.ik_memo.get(&(token, position, layer)) {
            return r.clone();
        }
        let synth = self.synth;
        let (g, b) = self
            .ln
            .entry(layer)
            .or_insert_with(|| synth.ln_params(layer))
            .clone();
        let key = synth.index_key(token, position, layer);
        let mut values = vec![0u8; index_k_page::values_bytes(self.ik_dtype)];
        let rope = self.rope.row(position);
        let scale = index_k_token(self.ik_dtype, self.ue8m0, &key, &g, &b, &rope, &mut values);
        let spec = spec::check_index_k_row(
            self.ik_dtype,
            self.ue8m0,
            &key,
            &g,
            &b,
            &rope,
            &values,
            scale,
        );
        if let Err(e) = spec {
            self.reference_errors.push(format!(
                "the index_k_store reference's row for token {token} at position {position}, layer {layer}, \
                 disagrees with the specification: {e}"
            ));
        }
        let r = Arc::new(IkRow { values, scale });
        self.ik_memo.insert((token, position, layer), r.clone());
        r
    }

    /// The expected KV row bytes of `token` at `position` in global layer `layer`.
    pub fn kv_row(&mut self, token: u32, position: u32, layer: u32) -> Arc<Vec<u8>> {
        if let Some(r) = self.kv_memo.get(&(token, position, layer)) {
            return r.clone();
        }
        let row = self.synth.kv_row(token, position, layer);
        let mut out = vec![0u8; PageFormat::Kv(self.kv_dtype).token_bytes() as usize];
        kv_token(self.kv_dtype, &row, &mut out);
        if let Err(e) = spec::check_kv_row(self.kv_dtype, &row, &out) {
            self.reference_errors.push(format!(
                "the kv_store reference's row for token {token} at position {position}, layer {layer}, \
                 disagrees with the specification: {e}"
            ));
        }
        let r = Arc::new(out);
        self.kv_memo.insert((token, position, layer), r.clone());
        r
    }

    /// `sparse_read::row_hash` of the expected KV row of `token` at `position` in global `layer`.
    pub fn kv_row_hash(&mut self, token: u32, position: u32, layer: u32) -> u64 {
        if let Some(&h) = self.kv_hash_memo.get(&(token, position, layer)) {
            return h;
        }
        let h = row_hash(&self.kv_row(token, position, layer));
        self.kv_hash_memo.insert((token, position, layer), h);
        h
    }

    /// A hash of the tokens expected at `first..last` of `request` in `layer`.
    fn expect_hash(&self, request: u64, first: u32, last: u32, layer: u32) -> Option<u64> {
        let toks = self.tokens.get(&request)?;
        if last as usize > toks.len() {
            return None;
        }
        let mut h = tierkv_kernels::cpu::numerics::mix64(
            ((layer as u64) << 40) ^ ((first as u64) << 20) ^ last as u64,
        );
        for &t in &toks[first as usize..last as usize] {
            h = tierkv_kernels::cpu::numerics::mix64(h ^ t as u64);
        }
        Some(h)
    }

    /// Checks the rows `op` reads from `mem`; returns one message per violated op (first row).
    pub fn check_reads(&mut self, op: &Op, mem: &Memory, pages: &dyn PageState) -> Vec<String> {
        match op {
            Op::IndexLogits(o) => {
                if let Some(e) =
                    self.check_tags(op, o.k, BufferKind::IndexK, &o.context_lens, &o.tags, mem)
                {
                    return vec![e];
                }
                self.check_index_k(
                    o.k,
                    &o.page_table,
                    o.pt_stride,
                    &o.context_lens,
                    &o.tags,
                    mem,
                    pages,
                )
            }
            Op::SparseRead(o) => {
                if let Some(e) =
                    self.check_tags(op, o.kv, BufferKind::Kv, &o.context_lens, &o.tags, mem)
                {
                    return vec![e];
                }
                let sel = le_i32s(mem.region(o.slots));
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

    #[allow(clippy::too_many_arguments)]
    fn check_index_k(
        &mut self,
        k: BufferId,
        page_table: &[i32],
        pt_stride: u32,
        context_lens: &[i32],
        tags: &RowTags,
        mem: &Memory,
        pages: &dyn PageState,
    ) -> Vec<String> {
        let dtype = self.ik_dtype;
        let pb = PageFormat::IndexK(dtype).page_bytes() as usize;
        let buf = mem.bytes(k);
        let layer = tags.layer_global;
        for (r, tag) in tags.rows.iter().enumerate() {
            let ctx = context_lens[r] as u32;
            let mut tainted_read = false;
            for j in 0..ctx.div_ceil(PAGE_TOKENS) {
                let page = page_table[r * pt_stride as usize + j as usize];
                if page < 0 {
                    continue;
                }
                let (first, last) = (j * PAGE_TOKENS, ((j + 1) * PAGE_TOKENS).min(ctx));
                // `None` when a row's token is unknown: only a row with garbage may be so.
                let want_hash = self.expect_hash(tag.request, first, last, layer);
                let rows_used = if last - first == 64 {
                    u64::MAX
                } else {
                    (1u64 << (last - first)) - 1
                };
                let bad_rows = pages.tainted_rows(k, page as u64) & rows_used;
                tainted_read |= bad_rows != 0;
                // A page compared before, unwritten since and expected to hold the same tokens
                // holds the very bytes that were compared: nothing new to learn from them.
                let gen = pages.generation(k, page as u64);
                if bad_rows == 0
                    && want_hash
                        .is_some_and(|h| self.verified.get(&(k, page as u64)) == Some(&(gen, h)))
                {
                    self.rows_cached += (last - first) as u64;
                    continue;
                }
                for n in first..last {
                    let t = n % PAGE_TOKENS;
                    if bad_rows & (1u64 << t) != 0 {
                        continue;
                    }
                    let Some(token) = self.token(tag.request, n) else {
                        return vec![format!(
                            "request {} reads index-K position {n}, past its known tokens",
                            tag.request
                        )];
                    };
                    self.rows_checked += 1;
                    let want = self.ik_row(token, n, layer);
                    let at = page as usize * pb + index_k_page::value_offset(dtype, t, 0);
                    let got = &buf[at..at + want.values.len()];
                    if got != want.values.as_slice() {
                        let i = got
                            .iter()
                            .zip(want.values.iter())
                            .position(|(a, b)| a != b)
                            .unwrap_or(0);
                        return vec![format!(
                            "index-K read of request {} position {n} (page {page}, token {t}) in layer {layer}: \
                             value byte {i} is {:#04x}, the synthetic model says {:#04x} (query position {})",
                            tag.request, got[i], want.values[i], tag.position
                        )];
                    }
                    if let (Some(off), Some(scale)) =
                        (index_k_page::scale_offset(dtype, t), want.scale)
                    {
                        let at = page as usize * pb + off;
                        let got = f32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
                        if got.to_bits() != scale.to_bits() {
                            return vec![format!(
                                "index-K read of request {} position {n} (page {page}) in layer {layer}: \
                                 scale is {got:e}, the synthetic model says {scale:e}",
                                tag.request
                            )];
                        }
                    }
                }
                if let (0, Some(h)) = (bad_rows, want_hash) {
                    self.verified.insert((k, page as u64), (gen, h));
                }
            }
            self.tainted_reads
                .insert((tag.request, tag.position, layer), tainted_read);
        }
        Vec::new()
    }

    fn check_kv(
        &mut self,
        op: &SparseRead,
        sel: &[i32],
        mem: &Memory,
        pages: &dyn PageState,
    ) -> Vec<String> {
        let SparseRead {
            kv,
            k,
            ref page_table,
            pt_stride,
            ref context_lens,
            ref tags,
            ..
        } = *op;
        let dtype = self.kv_dtype;
        let tb = PageFormat::Kv(dtype).token_bytes() as usize;
        let buf = mem.bytes(kv);
        let layer = tags.layer_global;
        for (r, tag) in tags.rows.iter().enumerate() {
            let ctx = context_lens[r] as u32;
            let pt = &page_table[r * pt_stride as usize..][..ctx.div_ceil(PAGE_TOKENS) as usize];
            let mut positions = Vec::new();
            let mut tainted_read = false;
            for i in 0..k as usize {
                let s = sel[r * k as usize + i];
                if s < 0 {
                    continue;
                }
                let slot = SlotId(s as u32);
                let (page, t) = (slot_page(slot).0 as i32, slot_offset(slot));
                let Some(j) = pt.iter().position(|&p| p == page) else {
                    return vec![format!(
                        "request {} (query position {}) layer {layer}: selected slot {s} is in page {page}, \
                         which is not in the row's page table",
                        tag.request, tag.position
                    )];
                };
                let n = j as u32 * PAGE_TOKENS + t;
                if n >= ctx {
                    return vec![format!(
                        "request {} (query position {}) layer {layer}: selected position {n} is past the context ({ctx})",
                        tag.request, tag.position
                    )];
                }
                positions.push(n);
                if pages.tainted_rows(kv, page as u64) & (1u64 << t) != 0 {
                    tainted_read = true;
                    continue;
                }
                let Some(token) = self.token(tag.request, n) else {
                    return vec![format!(
                        "request {} reads KV position {n}, past its known tokens",
                        tag.request
                    )];
                };
                let want = self.kv_row(token, n, layer);
                let at = kv_row::slot_offset(dtype, s as u32);
                let got = &buf[at..at + tb];
                self.rows_checked += 1;
                if got != want.as_slice() {
                    let b = got
                        .iter()
                        .zip(want.iter())
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    return vec![format!(
                        "KV read of request {} position {n} (slot {s}) in layer {layer}: byte {b} is {:#04x}, \
                         the synthetic model says {:#04x} (query position {})",
                        tag.request, got[b], want[b], tag.position
                    )];
                }
            }
            self.selections
                .insert((tag.request, tag.position, layer), positions);
            *self
                .tainted_reads
                .entry((tag.request, tag.position, layer))
                .or_default() |= tainted_read;
        }
        Vec::new()
    }
}

impl ContentOracle {
    /// Compares one whole page of `kind` — tokens `tokens` at positions `first..first + PAGE_TOKENS` of
    /// global layer `layer` — with the bytes of `page` in `view` of buffer `buf`. The message
    /// names the first row that differs.
    #[allow(clippy::too_many_arguments)]
    pub fn audit_page(
        &mut self,
        mem: &Memory,
        kind: BufferKind,
        buf: BufferId,
        view: tierkv_engine::layout::PagedView,
        page: tierkv_engine::layout::PageId,
        tokens: &[u32],
        first: u32,
        layer: u32,
    ) -> Option<String> {
        let at = view.page_range(page);
        let bytes = &mem.bytes(buf)[at.start as usize..at.end as usize];
        for (t, &token) in tokens.iter().enumerate() {
            let (t, n) = (t as u32, first + t as u32);
            self.rows_checked += 1;
            let differs = match kind {
                BufferKind::Kv => {
                    let want = self.kv_row(token, n, layer);
                    let off = kv_row::slot_offset(self.kv_dtype, t);
                    bytes[off..off + want.len()] != want[..]
                }
                BufferKind::IndexK => {
                    let dtype = self.ik_dtype;
                    let want = self.ik_row(token, n, layer);
                    let off = index_k_page::value_offset(dtype, t, 0);
                    let values = bytes[off..off + want.values.len()] != want.values[..];
                    let scale = match (index_k_page::scale_offset(dtype, t), want.scale) {
                        (Some(off), Some(s)) => bytes[off..off + 4] != s.to_le_bytes(),
                        (None, None) => false,
                        (off, s) => panic!(
                            "index-K page format and expected row disagree on the scale ({off:?}, {s:?})"
                        ),
                    };
                    values || scale
                }
            };
            if differs {
                return Some(format!(
                    "{} row of position {n} (row {t} of the page) in layer {layer} differs from the synthetic model",
                    match kind {
                        BufferKind::Kv => "KV",
                        BufferKind::IndexK => "index-K",
                    }
                ));
            }
        }
        None
    }
}
