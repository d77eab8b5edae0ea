//! The model step (DESIGN §5): for each layer, the gate; `index_k_store` for the new tokens; for
//! each query row `q_prep`, `index_logits` and `topk` with the configured `index_topk`; the KV
//! store; `sparse_read` of the selected rows into digests. The digests come back through pinned
//! host memory after one synchronisation per step; a request's output is its sequence of digests.
//!
//! Every input vector comes from the synthetic model, so the oracles can recompute any byte.

use crate::device::{Clock, Device, Op, RowTag, RowTags, StreamKind};
use crate::engine::{Engine, EngineError, QUERY_ROWS_PER_LAUNCH};
use crate::gate::LayerGate;
use crate::layout::{IndexKDtype, PAGE_TOKENS};
use crate::mutants::Mutant;
use crate::transfer::Transfer;
use tierkv_kernels::rope::rope_row;

/// One request's part of a batch: store positions `from..to`, run the indexer at `queries`.
#[derive(Clone, Debug)]
pub struct Row {
    pub request: u64,
    pub from: usize,
    pub to: usize,
    pub queries: Vec<u32>,
}

struct Query {
    request: u64,
    position: u32,
    token: u32,
}

/// The oracles' view of a launch over query rows: whose query, at which position, in which layer.
fn query_tags(layer_global: u32, chunk: &[Query]) -> RowTags {
    RowTags {
        layer_global,
        rows: chunk
            .iter()
            .map(|c| RowTag {
                request: c.request,
                position: c.position,
            })
            .collect(),
    }
}

impl<D: Device, C: Clock, T: Transfer> Engine<D, C, T> {
    /// A request's page table row for the indexer kernels: page ids padded with -1.
    fn page_table_row(&self, request: u64) -> Vec<i32> {
        let r = &self.requests[&request];
        let mut row = vec![-1i32; self.scratch.pt_stride as usize];
        for (i, p) in r.pages.iter().enumerate().take(row.len()) {
            row[i] = if self.mutants.on(Mutant::IndexKAddressedBySlot) {
                // The bug: the page-indexed buffer is addressed with the page's first token slot.
                (p.0 * PAGE_TOKENS) as i32
            } else {
                p.0 as i32
            };
        }
        row
    }

    /// Runs one batch forward and returns, per query row (in row order), the digest of each layer.
    pub(crate) fn forward(&mut self, rows: &[Row]) -> Result<Vec<Vec<u64>>, EngineError> {
        let layers = self.layout.layers() as usize;
        let layer_base = self.cfg.model.layer_base;
        let heads = self.cfg.model.index_n_heads;
        let topk = if self.mutants.on(Mutant::TopkHardcoded512) {
            512
        } else {
            self.cfg.model.index_topk
        };
        let pool_ik_dtype = self.cfg.model.index_k_dtype;
        let store_ik_dtype = if self.mutants.on(Mutant::StoreIgnoresPoolDtype) {
            IndexKDtype::Fp8
        } else {
            pool_ik_dtype
        };
        let kv_dtype = self.cfg.model.kv_dtype;
        let (pt_stride, out_stride, rows_max) = (
            self.scratch.pt_stride,
            self.scratch.out_stride,
            self.scratch.rows_max,
        );

        let mut loads: Vec<u64> = rows
            .iter()
            .filter_map(|r| self.requests[&r.request].load)
            .collect();
        loads.sort_unstable();
        loads.dedup();

        // New tokens to store, and query rows.
        let mut store_tokens: Vec<(u64, u32, u32)> = Vec::new();
        let mut slots: Vec<i32> = Vec::new();
        let mut queries: Vec<Query> = Vec::new();
        for row in rows {
            let r = &self.requests[&row.request];
            for pos in row.from..row.to {
                let page = r.pages[pos / PAGE_TOKENS as usize];
                slots.push((page.0 * PAGE_TOKENS + pos as u32 % PAGE_TOKENS) as i32);
                store_tokens.push((row.request, pos as u32, r.tokens[pos]));
            }
            for &q in &row.queries {
                queries.push(Query {
                    request: row.request,
                    position: q,
                    token: r.tokens[q as usize],
                });
            }
        }
        assert!(queries.len() <= rows_max, "batch over the scratch rows");
        let store_rope: Vec<f32> = store_tokens.iter().flat_map(|t| rope_row(t.1)).collect();
        let query_rope: Vec<Vec<f32>> = queries
            .iter()
            .map(|q| rope_row(q.position).to_vec())
            .collect();
        let pts: Vec<Vec<i32>> = queries
            .iter()
            .map(|q| self.page_table_row(q.request))
            .collect();
        let store_tags = |layer_global| RowTags {
            layer_global,
            rows: store_tokens
                .iter()
                .map(|t| RowTag {
                    request: t.0,
                    position: t.1,
                })
                .collect(),
        };
        let scratch = self.scratch;
        let q_rows = QUERY_ROWS_PER_LAUNCH;

        for l in 0..layers {
            let lg = layer_base + l as u32;
            let mut gate = LayerGate::new(l, loads.clone());
            let ik = gate.index_k(self);
            let (gamma, beta) = self.ln[l].clone();
            let keys = store_tokens
                .iter()
                .flat_map(|t| self.synth.index_key(t.2, t.1, lg))
                .collect();
            self.dev.enqueue(
                StreamKind::Compute,
                Op::IndexKStore {
                    dst: ik,
                    dtype: store_ik_dtype,
                    ue8m0: self.cfg.model.index_k_ue8m0,
                    keys,
                    gamma,
                    beta,
                    rope: store_rope.clone(),
                    slots: slots.clone(),
                    tags: store_tags(lg),
                },
            )?;
            for (ci, chunk) in queries.chunks(q_rows).enumerate() {
                let n = chunk.len() as u64;
                let base = ci * q_rows;
                let q = chunk
                    .iter()
                    .flat_map(|c| self.synth.query(c.token, c.position, lg, heads))
                    .collect();
                let weights = chunk
                    .iter()
                    .flat_map(|c| self.synth.head_weights(c.token, c.position, lg, heads))
                    .collect();
                let rope = query_rope[base..base + chunk.len()].concat();
                let q_region = self.region(scratch.q, 0, n * heads as u64 * 128);
                let w_region = self.region(scratch.w, 0, n * heads as u64 * 4);
                self.dev.enqueue(
                    StreamKind::Compute,
                    Op::QPrep {
                        heads,
                        q,
                        weights,
                        rope,
                        q_out: q_region,
                        w_out: w_region,
                    },
                )?;
                let page_table = pts[base..base + chunk.len()].concat();
                let context_lens: Vec<i32> = chunk.iter().map(|c| c.position as i32 + 1).collect();
                let tags = query_tags(lg, chunk);
                let logits = self.region(scratch.logits, 0, n * out_stride as u64 * 4);
                self.dev.enqueue(
                    StreamKind::Compute,
                    Op::IndexLogits {
                        dtype: pool_ik_dtype,
                        heads,
                        q: q_region,
                        w: w_region,
                        k: ik,
                        page_table: page_table.clone(),
                        pt_stride,
                        context_lens: context_lens.clone(),
                        out: logits,
                        out_stride,
                        tags,
                    },
                )?;
                let sel = self.region(
                    scratch.topk,
                    base as u64 * topk as u64 * 4,
                    n * topk as u64 * 4,
                );
                self.dev.enqueue(
                    StreamKind::Compute,
                    Op::TopK {
                        k: topk,
                        logits,
                        stride: out_stride,
                        context_lens,
                        page_table,
                        pt_stride,
                        out: sel,
                    },
                )?;
            }
            let kv = gate.kv(self);
            let kv_rows = store_tokens
                .iter()
                .flat_map(|t| self.synth.kv_row(t.2, t.1, lg))
                .collect();
            self.dev.enqueue(
                StreamKind::Compute,
                Op::KvStore {
                    dst: kv,
                    dtype: kv_dtype,
                    rows: kv_rows,
                    slots: slots.clone(),
                    tags: store_tags(lg),
                },
            )?;
            for (ci, chunk) in queries.chunks(q_rows).enumerate() {
                let n = chunk.len() as u64;
                let base = ci * q_rows;
                let sel = self.region(
                    scratch.topk,
                    base as u64 * topk as u64 * 4,
                    n * topk as u64 * 4,
                );
                let out = self.region(scratch.digests, (l * rows_max + base) as u64 * 8, n * 8);
                self.dev.enqueue(
                    StreamKind::Compute,
                    Op::SparseRead {
                        dtype: kv_dtype,
                        k: topk,
                        slots: sel,
                        kv,
                        page_table: pts[base..base + chunk.len()].concat(),
                        pt_stride,
                        context_lens: chunk.iter().map(|c| c.position as i32 + 1).collect(),
                        out,
                        tags: query_tags(lg, chunk),
                    },
                )?;
            }
        }
        let bytes = (layers * rows_max) as u64 * 8;
        let src = self.region(scratch.digests, 0, bytes);
        let dst = self.region(scratch.readback, 0, bytes);
        self.dev
            .enqueue(StreamKind::Compute, Op::Copy { src, dst })?;
        self.dev.record(StreamKind::Compute, self.step_done);
        self.dev.synchronize(self.step_done);
        let mut raw = vec![0u8; bytes as usize];
        self.dev.host_read(scratch.readback, 0, &mut raw)?;
        let all: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        Ok((0..queries.len())
            .map(|qi| (0..layers).map(|l| all[l * rows_max + qi]).collect())
            .collect())
    }
}
