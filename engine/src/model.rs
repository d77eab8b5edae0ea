//! The model step (DESIGN §5): for each layer, the gate; `index_k_store` for the new tokens; for
//! each query row `q_prep`, `index_logits` and `topk` with the configured `index_topk`; the KV
//! store; `sparse_read` of the selected rows into digests. The digests come back through pinned
//! host memory after one synchronisation per step; a request's output is its sequence of digests.
//!
//! The step owns its scratch buffers (sized by the layout module's `ScratchLayout`), the
//! indexer's LayerNorm parameters and the event that marks the end of a step. It reaches the
//! pools only through the layer gate's proofs, and every input vector comes from the synthetic
//! model, so the oracles can recompute any byte.

use crate::config::Config;
use crate::device::{
    args, call_recovering, call_recovering_since, BufferDesc, BufferId, BufferRole, Device,
    DeviceError, Drawn, EventId, EventState, IndexKStore, IndexLogits, KvStore, LinearCopy,
    MemoryTier, NextTokens, Op, QPrep, Region, RowTag, RowTags, SparseRead, StreamKind, TokenAt,
    TopK,
};
use crate::error::EngineError;
use crate::exchange::Row;
use crate::gate::LayerGate;
use crate::layout::{
    slot, u32_bytes, Bytes, IndexKDtype, KvDtype, LayerId, LayoutFingerprint, ScratchBuffer,
    ScratchLayout, PAGE_TOKENS,
};
use crate::mutants::Mutants;
use crate::pools::Pools;
use crate::probe::{self, Probe};
use crate::synth::{LnParams, Synth};
use std::sync::Arc;
use tierkv_kernels::cpu::numerics::le_u64s;
use tierkv_kernels::rope::Rope;

pub use crate::config::QUERY_ROWS_PER_LAUNCH;

/// The step scratch: one buffer per [`ScratchBuffer`], sized once at start (the steady state does
/// not allocate device memory).
#[derive(Clone, Debug)]
struct Scratch {
    layout: ScratchLayout,
    buffers: Vec<BufferId>,
}

impl Scratch {
    /// The step's buffers, and with `ahead` those of an engine that runs one step ahead.
    fn alloc<D: Device>(
        dev: &mut D,
        layout: ScratchLayout,
        ahead: bool,
    ) -> Result<Scratch, DeviceError> {
        let mut buffers = Vec::new();
        let extra: &[ScratchBuffer] = if ahead { &ScratchBuffer::AHEAD } else { &[] };
        for &b in ScratchBuffer::ALL.iter().chain(extra) {
            let bytes = layout.bytes(b);
            buffers.push(dev.alloc(BufferDesc {
                role: BufferRole::Scratch { name: b.name() },
                tier: match b {
                    ScratchBuffer::Readback | ScratchBuffer::ReadbackAhead => {
                        MemoryTier::PinnedHost
                    }
                    _ => MemoryTier::Device,
                },
                bytes,
                fingerprint: LayoutFingerprint::unpaged(bytes.0),
            })?);
        }
        Ok(Scratch { layout, buffers })
    }
    fn buffer(&self, b: ScratchBuffer) -> BufferId {
        *self
            .buffers
            .get(b as usize)
            .unwrap_or_else(|| panic!("scratch buffer {} not allocated", b.name()))
    }
    fn region(&self, b: ScratchBuffer, (offset, bytes): (Bytes, Bytes)) -> Region {
        Region {
            buffer: self.buffer(b),
            offset,
            bytes,
        }
    }
}

/// The model's shape and dtypes as the step uses them (the zoo's points already applied).
#[derive(Clone, Copy, Debug)]
struct Shape {
    layers: u32,
    layer_base: u32,
    heads: u32,
    topk: u32,
    pool_ik_dtype: IndexKDtype,
    store_ik_dtype: IndexKDtype,
    /// The scale format's rounding, for the index keys and the queries alike.
    ue8m0: bool,
    kv_dtype: KvDtype,
    /// The model's RoPE frequencies (YaRN-scaled when the context asks for it).
    rope: Rope,
}

pub(crate) struct ModelStep {
    shape: Shape,
    scratch: Scratch,
    ln: Vec<LnParams>,
    /// The event each step records at its end: one, or (running one step ahead) one per
    /// readback slot, so that the host waits for the older step while the newer one runs.
    step_done: Vec<EventId>,
    /// The slot of the step enqueued last.
    last: usize,
    mutants: Mutants,
}

/// Where a step's digests come back and which event ends it: slot 0 (`Readback`), or slot 1
/// (`ReadbackAhead`) for every other step of an engine that runs one step ahead.
pub(crate) type Slot = usize;

/// One query row of the batch.
struct Query {
    request: u64,
    position: u32,
    token: u32,
}

/// A batch made concrete: what to store, where, and which rows to query. Its arrays are made
/// once a step and shared by the ops of every layer (the runtime uploads each once).
struct Batch {
    /// The tokens buffer, when a row's token is pending (the previous step generates it).
    tokens: Option<Region>,
    /// Each new token's (token, position), its slot and its (request, position).
    store_rows: Arc<[TokenAt]>,
    slots: Arc<[i32]>,
    store_tags: Arc<[RowTag]>,
    queries: Vec<Query>,
    /// The query rows in launches of at most `QUERY_ROWS_PER_LAUNCH`.
    chunks: Vec<Chunk>,
    /// The device's context generation when the step began: once a recovery within the step
    /// recreated the context, the rest of the step is not enqueued ([`enqueue`]).
    generation: u64,
}

/// One launch's query rows (`base..base + rows`) and their arrays.
struct Chunk {
    base: usize,
    rows: u32,
    /// Each row's page-table row, `pt_stride` entries each.
    page_table: Arc<[i32]>,
    context_lens: Arc<[i32]>,
    /// Each row's (token, position), for the device to draw its inputs.
    inputs: Arc<[TokenAt]>,
    tags: Arc<[RowTag]>,
}

impl Batch {
    /// The new tokens' rows of global layer `layer`, for the device to draw.
    fn drawn_store(&self, synth: &Synth, layer: u32) -> Drawn {
        Drawn {
            seed: synth.seed,
            layer,
            tokens: self.tokens,
            rows: self.store_rows.clone(),
        }
    }

    fn store_tags(&self, layer_global: u32) -> RowTags {
        RowTags {
            layer_global,
            rows: self.store_tags.clone(),
        }
    }
}

impl Chunk {
    /// The query rows (each with its page-table row) in launches of at most
    /// `QUERY_ROWS_PER_LAUNCH`.
    fn of(queries: &[Query], tables: &[Vec<i32>]) -> Vec<Chunk> {
        let launch = QUERY_ROWS_PER_LAUNCH as usize;
        queries
            .chunks(launch)
            .zip(tables.chunks(launch))
            .enumerate()
            .map(|(i, (chunk, tables))| Chunk {
                base: i * launch,
                rows: chunk.len() as u32,
                page_table: tables.concat().into(),
                context_lens: chunk.iter().map(|c| c.position as i32 + 1).collect(),
                inputs: chunk
                    .iter()
                    .map(|c| TokenAt {
                        token: c.token,
                        position: c.position,
                    })
                    .collect(),
                tags: chunk
                    .iter()
                    .map(|c| RowTag {
                        request: c.request,
                        position: c.position,
                    })
                    .collect(),
            })
            .collect()
    }

    /// The oracles' view of the launch: whose query, at which position, in layer `layer_global`.
    fn tags(&self, layer_global: u32) -> RowTags {
        RowTags {
            layer_global,
            rows: self.tags.clone(),
        }
    }

    /// The inputs the launch draws: each row's token (pending when the previous step generates
    /// it) and position, of layer `layer_global`.
    fn inputs(&self, synth: &Synth, batch: &Batch, layer_global: u32) -> Drawn {
        Drawn {
            seed: synth.seed,
            layer: layer_global,
            tokens: batch.tokens,
            rows: self.inputs.clone(),
        }
    }
}

impl ModelStep {
    /// The scratch layout of `cfg` (the zoo's `index_topk` point applied).
    pub(crate) fn scratch_layout(
        cfg: &Config,
        mutants: Mutants,
    ) -> Result<ScratchLayout, EngineError> {
        Ok(cfg.scratch_layout(mutants.index_topk(cfg.model.index_topk))?)
    }

    /// Allocates the scratch buffers.
    pub(crate) fn alloc_scratch<D: Device>(
        dev: &mut D,
        layout: ScratchLayout,
        ahead: bool,
    ) -> Result<ScratchHandle, DeviceError> {
        Scratch::alloc(dev, layout, ahead).map(ScratchHandle)
    }

    /// The indexer's LayerNorm parameters, a layer's each (the engine's unit tests check a
    /// weight update's).
    #[cfg(test)]
    pub(crate) fn ln(&self) -> &[LnParams] {
        &self.ln
    }

    /// New weights: the indexer's LayerNorm parameters of `synth`'s model.
    pub(crate) fn set_weights(&mut self, cfg: &Config, synth: &Synth) {
        let m = &cfg.model;
        self.ln = (0..m.layers)
            .map(|l| synth.ln_params(m.layer_base + l))
            .collect();
    }

    /// `step_done`: one event, or two for an engine that runs one step ahead.
    pub(crate) fn new(
        cfg: &Config,
        scratch: ScratchHandle,
        step_done: Vec<EventId>,
        synth: Synth,
        mutants: Mutants,
    ) -> ModelStep {
        assert!(matches!(step_done.len(), 1 | 2), "one or two step events");
        let m = &cfg.model;
        let ln = (0..m.layers)
            .map(|l| synth.ln_params(m.layer_base + l))
            .collect();
        ModelStep {
            shape: Shape {
                layers: m.layers,
                layer_base: m.layer_base,
                heads: m.index_n_heads,
                topk: mutants.index_topk(m.index_topk),
                pool_ik_dtype: m.index_k_dtype,
                store_ik_dtype: mutants.store_dtype(m.index_k_dtype),
                ue8m0: m.scale_fmt.ue8m0(),
                kv_dtype: m.kv_dtype,
                rope: Rope::new(&cfg.rope()),
            },
            scratch: scratch.0,
            ln,
            step_done,
            last: 0,
            mutants,
        }
    }

    /// The event of the step enqueued last: waiting for it waits for every step before.
    pub(crate) fn step_done(&self) -> EventId {
        self.step_done[self.last]
    }
    /// The event that ends the step of `slot`.
    pub(crate) fn slot_event(&self, slot: Slot) -> EventId {
        self.step_done[slot]
    }
    /// The slot the next step uses.
    pub(crate) fn next_slot(&self) -> Slot {
        (self.last + 1) % self.step_done.len()
    }
    /// Query rows one step may hold.
    pub(crate) fn rows_max(&self) -> usize {
        self.scratch.layout.rows_max() as usize
    }

    /// Enqueues one batch forward over the synthetic model `synth` and ends the step with the
    /// event of `slot` (see [`next_slot`](Self::next_slot)); returns the batch's query rows,
    /// whose digests [`collect`](Self::collect) reads. `load_events` are the events of the loads
    /// the batch waits for (per load, one per local layer). Rows with a pending token read it
    /// from the tokens the previous step generated on the device.
    pub(crate) fn forward<D: Device>(
        &mut self,
        dev: &mut D,
        pools: &Pools,
        load_events: &[Vec<EventId>],
        synth: &Synth,
        rows: &[Row],
        slot: Slot,
    ) -> Result<usize, EngineError> {
        assert!(slot < self.step_done.len(), "step slot {slot}");
        let mut batch = self.gather(rows);
        batch.generation = dev.context_generation();
        assert!(
            batch.queries.len() <= self.rows_max(),
            "batch over the scratch rows"
        );
        for l in 0..self.shape.layers as usize {
            // The loads' events this layer waits for (mutant 7 picks them by the global id).
            let index = self.mutants.gate_layer_index(l, self.shape.layer_base);
            let events: Vec<EventId> = load_events
                .iter()
                .filter_map(|e| e.get(index))
                .copied()
                .collect();
            let mut gate = LayerGate::new(LayerId(l as u32), &events, self.mutants);
            self.index_layer(dev, pools, synth, &mut gate, &batch, l)?;
            self.read_layer(dev, pools, synth, &mut gate, &batch, l)?;
        }
        self.end_step(dev, synth, &batch, slot)?;
        self.last = slot;
        Ok(batch.queries.len())
    }

    /// The batch's new tokens, their slots and RoPE rows, and its query rows with page tables.
    fn gather(&self, rows: &[Row]) -> Batch {
        let pending = rows.iter().any(|r| r.pending.is_some());
        assert!(
            !pending || self.ahead(),
            "a pending token in an engine that does not run ahead"
        );
        let (mut store_rows, mut slots, mut store_tags) = (Vec::new(), Vec::new(), Vec::new());
        let (mut queries, mut tables) = (Vec::new(), Vec::new());
        let pt_stride = self.scratch.layout.pt_stride() as usize;
        for row in rows {
            for pos in row.from..row.to {
                let page = row.pages[pos / PAGE_TOKENS as usize];
                slots.push(slot(page, pos as u32 % PAGE_TOKENS).kernel());
                store_rows.push(TokenAt {
                    token: row.token(pos),
                    position: pos as u32,
                });
                store_tags.push(RowTag {
                    request: row.request,
                    position: pos as u32,
                });
            }
            let mut table = vec![-1i32; pt_stride];
            for (e, &p) in table.iter_mut().zip(&row.pages) {
                *e = self.mutants.page_table_entry(p);
            }
            for &q in &row.queries {
                queries.push(Query {
                    request: row.request,
                    position: q,
                    token: row.token(q as usize),
                });
                tables.push(table.clone());
            }
        }
        let chunks = Chunk::of(&queries, &tables);
        Batch {
            tokens: pending.then(|| self.tokens_region()),
            store_rows: store_rows.into(),
            slots: slots.into(),
            store_tags: store_tags.into(),
            queries,
            chunks,
            generation: 0,
        }
    }

    /// Layer `l`'s index-K store and, for every launch of query rows, `q_prep`, `index_logits`
    /// and `topk` into the step's selections.
    fn index_layer<D: Device>(
        &self,
        dev: &mut D,
        pools: &Pools,
        synth: &Synth,
        gate: &mut LayerGate<'_>,
        batch: &Batch,
        l: usize,
    ) -> Result<(), EngineError> {
        let lg = self.shape.layer_base + l as u32;
        let ik = pools.gated(&gate.index_k(dev)?);
        let (gamma, beta) = self.ln[l].clone();
        let store = IndexKStore {
            dst: ik,
            args: args::IndexKStore {
                dtype: self.shape.store_ik_dtype,
                ue8m0: self.mutants.store_ue8m0(self.shape.ue8m0),
                slots: batch.slots.clone().into(),
            },
            keys: batch.drawn_store(synth, lg),
            gamma,
            beta,
            rope: self.shape.rope,
            tags: batch.store_tags(lg),
        };
        enqueue(dev, batch.generation, Op::IndexKStore(store))?;
        for chunk in &batch.chunks {
            self.indexer_launch(dev, synth, ik, batch, chunk, lg)?;
        }
        Ok(())
    }

    /// One launch of the indexer over `chunk` of layer `lg`.
    fn indexer_launch<D: Device>(
        &self,
        dev: &mut D,
        synth: &Synth,
        ik: BufferId,
        batch: &Batch,
        chunk: &Chunk,
        lg: u32,
    ) -> Result<(), DeviceError> {
        let (s, sh) = (&self.scratch, &self.shape);
        let n = chunk.rows;
        let q = s.region(ScratchBuffer::Queries, (Bytes::ZERO, s.layout.queries(n)));
        let w = s.region(ScratchBuffer::Weights, (Bytes::ZERO, s.layout.weights(n)));
        let prep = QPrep {
            args: args::QPrep {
                rows: n,
                heads: sh.heads,
                ue8m0: sh.ue8m0,
            },
            inputs: chunk.inputs(synth, batch, lg),
            rope: sh.rope,
            q_out: q,
            w_out: w,
        };
        enqueue(dev, batch.generation, Op::QPrep(prep))?;
        let logits = s.region(ScratchBuffer::Logits, (Bytes::ZERO, s.layout.logits(n)));
        let scores = IndexLogits {
            args: args::IndexLogits {
                dtype: sh.pool_ik_dtype,
                heads: sh.heads,
                page_table: chunk.page_table.clone().into(),
                pt_stride: s.layout.pt_stride(),
                context_lens: chunk.context_lens.clone().into(),
                out_stride: s.layout.out_stride(),
            },
            q,
            w,
            k: ik,
            out: logits,
            tags: chunk.tags(lg),
        };
        enqueue(dev, batch.generation, Op::IndexLogits(scores))?;
        for c in &batch.queries[chunk.base..][..n as usize] {
            let covered = c.position < sh.topk;
            probe::hit_if(Probe::TopkCoversContext, covered);
            probe::hit_if(Probe::TopkSelects, !covered);
        }
        let topk = TopK {
            args: args::TopK {
                k: sh.topk,
                stride: s.layout.out_stride(),
                context_lens: chunk.context_lens.clone().into(),
                page_table: chunk.page_table.clone().into(),
                pt_stride: s.layout.pt_stride(),
            },
            logits,
            out: s.region(
                ScratchBuffer::Selections,
                s.layout.selections(chunk.base as u32, n),
            ),
        };
        enqueue(dev, batch.generation, Op::TopK(topk))
    }

    /// Layer `l`'s KV store and, for every launch of query rows, the `sparse_read` of its
    /// selections into the layer's digests.
    fn read_layer<D: Device>(
        &self,
        dev: &mut D,
        pools: &Pools,
        synth: &Synth,
        gate: &mut LayerGate<'_>,
        batch: &Batch,
        l: usize,
    ) -> Result<(), EngineError> {
        let (s, sh) = (&self.scratch, &self.shape);
        let lg = sh.layer_base + l as u32;
        let kv = pools.gated(&gate.kv(dev)?);
        let store = KvStore {
            dst: kv,
            args: args::KvStore {
                dtype: sh.kv_dtype,
                slots: batch.slots.clone().into(),
            },
            rows: batch.drawn_store(synth, lg),
            tags: batch.store_tags(lg),
        };
        enqueue(dev, batch.generation, Op::KvStore(store))?;
        for chunk in &batch.chunks {
            let (base, n) = (chunk.base, chunk.rows);
            let read = SparseRead {
                args: args::SparseRead {
                    dtype: self.mutants.sparse_read_dtype(sh.kv_dtype),
                    rows: n,
                    k: sh.topk,
                },
                slots: s.region(
                    ScratchBuffer::Selections,
                    s.layout.selections(base as u32, n),
                ),
                kv,
                page_table: chunk.page_table.clone(),
                pt_stride: s.layout.pt_stride(),
                context_lens: chunk.context_lens.clone(),
                out: s.region(
                    ScratchBuffer::Digests,
                    s.layout.digests(l as u32, base as u32, n),
                ),
                tags: chunk.tags(lg),
            };
            enqueue(dev, batch.generation, Op::SparseRead(read))?;
        }
        Ok(())
    }

    /// Whether the engine runs one step ahead (two slots): the one place that says so.
    pub(crate) fn ahead(&self) -> bool {
        self.step_done.len() == 2
    }

    /// The whole tokens buffer.
    fn tokens_region(&self) -> Region {
        let s = &self.scratch;
        s.region(
            ScratchBuffer::Tokens,
            (Bytes::ZERO, s.layout.bytes(ScratchBuffer::Tokens)),
        )
    }

    /// The pinned buffer the digests of a step of `slot` come back to.
    fn readback(&self, slot: Slot) -> ScratchBuffer {
        if slot == 0 || self.mutants.overlap_one_readback() {
            ScratchBuffer::Readback
        } else {
            ScratchBuffer::ReadbackAhead
        }
    }

    /// Copies the step's digests to pinned memory and ends the step (the event of `slot`).
    /// Running ahead, the step first writes each query row's next token to the tokens buffer,
    /// where the next step's pending rows read it.
    fn end_step<D: Device>(
        &self,
        dev: &mut D,
        synth: &Synth,
        batch: &Batch,
        slot: Slot,
    ) -> Result<(), EngineError> {
        let s = &self.scratch;
        let bytes = s.layout.bytes(ScratchBuffer::Digests);
        if self.ahead() {
            let n = batch.queries.len() as u64;
            let next = NextTokens {
                args: args::NextTokens {
                    seed: synth.seed,
                    layers: self.shape.layers,
                    rows_max: s.layout.rows_max(),
                    rows: n as u32,
                },
                digests: s.region(ScratchBuffer::Digests, (Bytes::ZERO, bytes)),
                out: s.region(ScratchBuffer::Tokens, (Bytes::ZERO, u32_bytes(n))),
                tags: RowTags {
                    layer_global: self.shape.layer_base,
                    rows: batch
                        .queries
                        .iter()
                        .map(|q| RowTag {
                            request: q.request,
                            position: q.position,
                        })
                        .collect(),
                },
            };
            enqueue(dev, batch.generation, Op::NextTokens(next))?;
        }
        let copy = LinearCopy {
            src: s.region(ScratchBuffer::Digests, (Bytes::ZERO, bytes)),
            dst: s.region(self.readback(slot), (Bytes::ZERO, bytes)),
        };
        enqueue(dev, batch.generation, Op::Copy(copy))?;
        // The step's only record on the compute stream: a failure anywhere in the step's work
        // is reported by it (a device reports a failed op at its stream's next record), so no
        // other record may be placed on the compute stream inside a step.
        call_recovering(dev, |d| d.record(StreamKind::Compute, self.step_done[slot]))?;
        Ok(())
    }

    /// Waits for the step [`forward`](Self::forward) enqueued with `slot` and reads the digests
    /// of its `queries` rows back: per row, one digest per layer. `None` when the step's event
    /// reports a failure.
    pub(crate) fn collect<D: Device>(
        &self,
        dev: &mut D,
        queries: usize,
        slot: Slot,
    ) -> Result<Option<Vec<Vec<u64>>>, EngineError> {
        let s = &self.scratch;
        let bytes = s.layout.bytes(ScratchBuffer::Digests);
        if probe::hit_if(
            Probe::StepDeviceFailed,
            dev.synchronize(self.step_done[slot]) == EventState::Failed,
        ) {
            // The device could not run the step (a launch failed): its digests are not data.
            return Ok(None);
        }
        let mut raw = vec![0u8; bytes.usize()];
        dev.host_read(s.buffer(self.readback(slot)), Bytes::ZERO, &mut raw)?;
        let all = le_u64s(&raw);
        Ok(Some(
            (0..queries as u32)
                .map(|qi| {
                    (0..self.shape.layers)
                        .map(|l| all[s.layout.digest_index(l, qi)])
                        .collect()
                })
                .collect(),
        ))
    }
}

/// Enqueues `op` of a step that began at context generation `since` on the compute stream; a
/// transient failure is recovered and the op enqueued again (`call_recovering_since`; each try
/// takes its own copy of the op, since a device takes the op it is given). Once a recovery has
/// recreated the context (the generation moved), the op is not enqueued, neither before its
/// first try nor after the recovery that recreated it: what the step computed before (a
/// selection, a query) and the pages it reads are lost, an op reading them would read garbage
/// (on CUDA, a selection of garbage slots is an illegal address), and the engine discards the
/// step anyway. The step's end record is still made, so that its event tells when the device
/// got there.
fn enqueue<D: Device>(dev: &mut D, since: u64, op: Op) -> Result<(), DeviceError> {
    let made = call_recovering_since(dev, since, |d| d.enqueue(StreamKind::Compute, op.clone()))?;
    probe::hit_if(Probe::StepCutByRecreation, made.is_none());
    Ok(())
}

/// Scratch buffers allocated for a model step that is not built yet (the engine allocates them
/// before the controller's events, and builds the step after).
pub(crate) struct ScratchHandle(Scratch);
