//! The engine: intake, the scheduler loop and request lifecycle, tying together the pools, the
//! prefix cache, the cache controller (`controller.rs`), the layer gate (`gate.rs`) and the model
//! step (`model.rs`). Generic over `Device`, `Clock` and `Transfer` (static dispatch); it never
//! names a concrete backend.
//!
//! One call of [`Engine::step`] is one scheduling iteration: acknowledge finished copies, admit
//! queued requests (issuing their loads), run one batch forward, hand back outputs, and cache the
//! pages of completed requests (issuing backups). Everything is deterministic given the device's
//! answers: iteration uses `BTreeMap`/`Vec`, ids are sequential.

use crate::cache::{NodeId, PageKey, PrefixCache};
use crate::config::{Config, PrefillIndexer, WritePolicy};
use crate::controller::{Backup, Load};
use crate::device::{
    BufferDesc, BufferId, BufferRole, Clock, Device, DeviceError, EventId, MemoryTier, Region,
};
use crate::layout::{pages_for_tokens, Bytes, Layout, LayoutFingerprint, PageId, PAGE_TOKENS};
use crate::metrics::Metrics;
use crate::mutants::{Mutant, Mutants};
use crate::pools::Pools;
use crate::scheduler::{Output, Rejection, Request, RequestSpec, RequestState};
use crate::synth::{Synth, VOCAB};
use crate::transfer::{PageRuns, Transfer, TransferError};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Query rows per indexer launch.
pub const QUERY_ROWS_PER_LAUNCH: usize = 64;

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("device: {0}")]
    Device(#[from] DeviceError),
    #[error("transfer: {0}")]
    Transfer(TransferError),
}

impl From<TransferError> for EngineError {
    fn from(e: TransferError) -> Self {
        match e {
            TransferError::Device(d) => EngineError::Device(d),
            other => EngineError::Transfer(other),
        }
    }
}

/// Options that are not configuration: the synthetic model's seed and the mutant (tests only).
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineOptions {
    pub seed: u64,
    pub mutants: Mutants,
}

/// What one step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Query rows computed.
    pub rows: usize,
    /// Requests admitted from the queue.
    pub admitted: usize,
    /// Nothing queued, running or in flight.
    pub idle: bool,
}

/// Step scratch buffers, sized once at start (the steady state does not allocate device memory).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scratch {
    pub q: BufferId,
    pub w: BufferId,
    pub logits: BufferId,
    pub topk: BufferId,
    pub digests: BufferId,
    pub readback: BufferId,
    /// Query rows one step may hold.
    pub rows_max: usize,
    /// Page-table entries per row.
    pub pt_stride: u32,
    /// Logits per row.
    pub out_stride: u32,
}

pub struct Engine<D: Device, C: Clock, T: Transfer = PageRuns> {
    pub cfg: Config,
    pub layout: Layout,
    pub dev: D,
    pub(crate) clock: C,
    pub(crate) transfer: T,
    pub synth: Synth,
    pub mutants: Mutants,
    pub(crate) pools: Pools,
    pub(crate) cache: PrefixCache,
    pub(crate) queue: VecDeque<u64>,
    pub(crate) requests: BTreeMap<u64, Request>,
    pub(crate) running: Vec<u64>,
    next_request: u64,
    pub(crate) loads: BTreeMap<u64, Load>,
    pub(crate) next_load: u64,
    pub(crate) ring: Vec<Option<u64>>,
    pub(crate) ring_events: Vec<Vec<EventId>>,
    pub(crate) ring_next: usize,
    pub(crate) backups: Vec<Backup>,
    /// Backups waiting for an ancestor's backup to be acknowledged (node and its generation).
    pub(crate) deferred_backups: Vec<(NodeId, u64)>,
    pub(crate) free_events: Vec<EventId>,
    pub(crate) step_done: EventId,
    pub(crate) scratch: Scratch,
    pub(crate) ln: Vec<(Arc<[f32]>, Arc<[f32]>)>,
    outputs: Vec<Output>,
    pub metrics: Metrics,
}

/// The page keys of `tokens`' full pages.
pub fn page_keys(tokens: &[u32], pages: usize) -> Vec<PageKey> {
    (0..pages)
        .map(|i| {
            let mut k = [0u32; PAGE_TOKENS as usize];
            k.copy_from_slice(&tokens[i * PAGE_TOKENS as usize..(i + 1) * PAGE_TOKENS as usize]);
            k
        })
        .collect()
}

impl<D: Device, C: Clock> Engine<D, C, PageRuns> {
    /// An engine with the default transfer strategy (coalesced page runs).
    pub fn new(cfg: Config, dev: D, clock: C, opts: EngineOptions) -> Result<Self, EngineError> {
        let transfer = PageRuns {
            one_item_size: opts.mutants.on(Mutant::HostIndexKFromFp8Defaults)
                || opts.mutants.on(Mutant::HostKvRow576),
        };
        Engine::with_transfer(cfg, dev, clock, transfer, opts)
    }
}

impl<D: Device, C: Clock, T: Transfer> Engine<D, C, T> {
    pub fn with_transfer(
        cfg: Config,
        mut dev: D,
        clock: C,
        transfer: T,
        opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        cfg.validate()?;
        let layout = cfg.layout()?;
        let mutants = opts.mutants;
        // The host mirror is built from the same layout value as the device pool — except under
        // the mutants that re-create a mirror sized from defaults.
        let mut host_params = layout.params;
        if mutants.on(Mutant::HostIndexKFromFp8Defaults) {
            host_params.index_k_dtype = crate::layout::IndexKDtype::Fp8;
        }
        let mut host_layout =
            Layout::new(host_params).map_err(|_| crate::config::ConfigError::Overflow {
                field: "cache.host_ratio",
                what: "host mirror",
            })?;
        if mutants.on(Mutant::HostKvRow576)
            && layout.params.kv_dtype == crate::layout::KvDtype::Fp8Packed
        {
            host_layout = Layout::new(crate::layout::LayoutParams {
                kv_dtype: crate::layout::KvDtype::Fp8Unpacked,
                ..host_params
            })
            .expect("a smaller mirror of a valid layout fits");
        }
        let pools = Pools::new(&mut dev, layout, host_layout)?;

        let m = &cfg.model;
        let pt_stride = pages_for_tokens(m.context_tokens_max as u64) as u32;
        let out_stride = pt_stride * PAGE_TOKENS;
        let running = cfg.scheduler.running_requests_max as usize;
        let rows_max = match m.prefill_indexer {
            PrefillIndexer::EveryToken => {
                cfg.scheduler.prefill_tokens_per_step_max as usize + running
            }
            PrefillIndexer::LastToken => running,
        };
        let heads = m.index_n_heads as u64;
        let q_rows = QUERY_ROWS_PER_LAUNCH as u64;
        let topk = m.index_topk.max(512) as u64; // room for the 512 of mutant 9 as well
        let layers = m.layers as u64;
        let mut scratch = |name: &'static str, tier: MemoryTier, bytes: u64| {
            dev.alloc(BufferDesc {
                role: BufferRole::Scratch { name },
                tier,
                bytes: Bytes(bytes),
                fingerprint: LayoutFingerprint::unpaged(bytes),
            })
        };
        let scratch = Scratch {
            q: scratch("q", MemoryTier::Device, q_rows * heads * 128)?,
            w: scratch("w", MemoryTier::Device, q_rows * heads * 4)?,
            logits: scratch("logits", MemoryTier::Device, q_rows * out_stride as u64 * 4)?,
            topk: scratch("topk", MemoryTier::Device, rows_max as u64 * topk * 4)?,
            digests: scratch("digests", MemoryTier::Device, layers * rows_max as u64 * 8)?,
            readback: scratch(
                "readback",
                MemoryTier::PinnedHost,
                layers * rows_max as u64 * 8,
            )?,
            rows_max,
            pt_stride,
            out_stride,
        };
        let ring_events = (0..cfg.cache.load_slots)
            .map(|_| (0..m.layers).map(|_| dev.new_event()).collect())
            .collect();
        let step_done = dev.new_event();
        let synth = Synth::new(opts.seed);
        let ln = (0..m.layers)
            .map(|l| synth.ln_params(m.layer_base + l))
            .collect();
        let mut cache = PrefixCache::new();
        cache.ignore_pins = mutants.on(Mutant::EvictionIgnoresLoadPins);
        let metrics = Metrics {
            device_pages_total: layout.device_pages() as u64,
            host_tokens_capacity: pools.host.layout.host_tokens().0,
            ..Metrics::default()
        };
        Ok(Engine {
            layout,
            dev,
            clock,
            transfer,
            synth,
            mutants,
            pools,
            cache,
            queue: VecDeque::new(),
            requests: BTreeMap::new(),
            running: Vec::new(),
            next_request: 0,
            loads: BTreeMap::new(),
            next_load: 0,
            ring: vec![None; cfg.cache.load_slots as usize],
            ring_events,
            ring_next: 0,
            backups: Vec::new(),
            deferred_backups: Vec::new(),
            free_events: Vec::new(),
            step_done,
            scratch,
            ln,
            outputs: Vec::new(),
            metrics,
            cfg,
        })
    }

    pub fn clock(&self) -> &C {
        &self.clock
    }
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }
    pub fn running_len(&self) -> usize {
        self.running.len()
    }
    pub fn request(&self, id: u64) -> Option<&Request> {
        self.requests.get(&id)
    }
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }
    pub fn pools(&self) -> &Pools {
        &self.pools
    }
    /// Nothing queued, running, loading or backing up.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty()
            && self.running.is_empty()
            && self.loads.is_empty()
            && self.backups.is_empty()
    }
    pub fn drain_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }
    pub(crate) fn emit(&mut self, o: Output) {
        self.outputs.push(o);
    }

    /// Intake with admission control: a typed rejection over the limits, never an unbounded queue.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<u64, Rejection> {
        let s = &self.cfg.scheduler;
        let invalid = |reason: String| Rejection::Invalid { reason };
        let check = || -> Result<(), Rejection> {
            if spec.prompt.is_empty() {
                return Err(invalid("empty prompt".into()));
            }
            if spec.max_new_tokens == 0 || spec.max_new_tokens > s.output_tokens_max {
                return Err(invalid(format!(
                    "max_new_tokens = {} outside 1..={} (scheduler.output_tokens_max)",
                    spec.max_new_tokens, s.output_tokens_max
                )));
            }
            let total = spec.prompt.len() as u64 + spec.max_new_tokens as u64;
            if total > self.cfg.model.context_tokens_max as u64 {
                return Err(invalid(format!(
                    "prompt {} + max_new_tokens {} exceeds model.context_tokens_max = {}",
                    spec.prompt.len(),
                    spec.max_new_tokens,
                    self.cfg.model.context_tokens_max
                )));
            }
            if spec.prompt.len() as u64 > s.pending_tokens_max {
                return Err(invalid(format!(
                    "a prompt of {} tokens can never fit scheduler.pending_tokens_max = {}",
                    spec.prompt.len(),
                    s.pending_tokens_max
                )));
            }
            if let Some(t) = spec.prompt.iter().find(|&&t| t >= VOCAB) {
                return Err(invalid(format!(
                    "token {t} outside the vocabulary (< {VOCAB})"
                )));
            }
            Ok(())
        };
        if let Err(e) = check() {
            self.metrics.rejected_invalid += 1;
            return Err(e);
        }
        if !self.mutants.on(Mutant::NoAdmissionControl) {
            if self.queue.len() as u64 >= s.queued_requests_max as u64 {
                self.metrics.rejected_queue_full += 1;
                return Err(Rejection::QueueFull {
                    queued: self.queue.len() as u32,
                    limit: s.queued_requests_max,
                });
            }
            if self.metrics.queued_tokens + spec.prompt.len() as u64 > s.pending_tokens_max {
                self.metrics.rejected_pending_tokens += 1;
                return Err(Rejection::PendingTokens {
                    pending: self.metrics.queued_tokens,
                    prompt: spec.prompt.len() as u64,
                    limit: s.pending_tokens_max,
                });
            }
        }
        let id = self.next_request;
        self.next_request += 1;
        let now = self.clock.now_ns();
        self.metrics.queued_tokens += spec.prompt.len() as u64;
        self.requests.insert(
            id,
            Request {
                id,
                prompt_len: spec.prompt.len(),
                tokens: spec.prompt,
                max_new: spec.max_new_tokens,
                generated: 0,
                computed: 0,
                pages: Vec::new(),
                locked: Vec::new(),
                owned_from: 0,
                load: None,
                state: RequestState::Queued,
                submitted_ns: now,
                first_token_ns: None,
            },
        );
        self.queue.push_back(id);
        self.metrics.requests_submitted += 1;
        self.refresh_gauges();
        Ok(id)
    }

    /// Aborts a request wherever it is. Between steps the compute stream is idle, so a running
    /// request's own pages are free at once; pages of an in-flight load are freed only when the
    /// load's finish event says the copy is over.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(req) = self.requests.remove(&id) else {
            return false;
        };
        match req.state {
            RequestState::Queued => {
                self.queue.retain(|&q| q != id);
                self.metrics.queued_tokens -= req.prompt_len as u64;
            }
            RequestState::Running => {
                self.running.retain(|&r| r != id);
                let loaded: Vec<NodeId> = match req.load.and_then(|l| self.loads.get_mut(&l)) {
                    Some(load) => {
                        load.orphaned = true;
                        if self.mutants.on(Mutant::WriteOnLoadingPage) {
                            // The bug: the load's pages go back before its finish event.
                            self.pools.device.pages.free(&load.dev_pages);
                            load.pages_freed_early = true;
                        }
                        load.nodes.clone()
                    }
                    None => Vec::new(),
                };
                // Unlock what the request locked, except nodes of its in-flight load (the load
                // keeps them until its ack).
                let unlock: Vec<NodeId> = req
                    .locked
                    .iter()
                    .copied()
                    .filter(|n| !loaded.contains(n))
                    .collect();
                self.cache.unlock(&unlock);
                self.pools.device.pages.free(&req.pages[req.owned_from..]);
            }
        }
        self.metrics.requests_aborted += 1;
        self.emit(Output::Aborted { request: id });
        self.refresh_gauges();
        true
    }

    /// One scheduling iteration; see the module comment.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        let t0 = self.clock.now_ns();
        self.poll_backups(false);
        self.retry_deferred_backups()?;
        self.poll_loads()?;
        let admitted = self.admit()?;
        let rows = self.build_batch();
        let mut report = StepReport {
            rows: rows.iter().map(|r| r.queries.len()).sum(),
            admitted,
            idle: false,
        };
        if rows.is_empty() {
            // Nothing to compute: wait for the oldest copy in flight so the next step can progress.
            if !self.backups.is_empty() {
                self.poll_backups(true);
            } else if let Some(&id) = self.loads.keys().next() {
                let fin = self.load_finish_event(id);
                self.dev.synchronize(fin);
                self.ack_load(id)?;
            }
            report.idle = self.is_idle();
            self.refresh_gauges();
            return Ok(report);
        }
        let digests = self.forward(&rows)?;
        self.finish_step(&rows, digests)?;
        self.metrics.steps += 1;
        self.metrics
            .step_latency
            .observe(self.clock.now_ns().saturating_sub(t0));
        self.refresh_gauges();
        report.idle = self.is_idle();
        Ok(report)
    }

    /// Evicts up to `pages` device pages from the prefix cache now (unlocked nodes only, the write
    /// policy respected), e.g. to hand memory back. Returns how many were freed at once.
    pub fn evict_device(&mut self, pages: usize) -> Result<usize, EngineError> {
        let ev = self.cache.evict_device(pages, self.cfg.cache.write_policy);
        self.pools.device.pages.free(&ev.freed);
        for node in ev.write_back {
            if !self.issue_backup(node)? {
                self.cache.cancel_write_back(node);
            }
        }
        self.refresh_gauges();
        Ok(ev.freed.len())
    }

    /// Device pages for a request, evicting from the device tier as needed.
    fn alloc_device(&mut self, n: usize) -> Result<Option<Vec<PageId>>, EngineError> {
        if let Some(p) = self.pools.device.pages.alloc(n) {
            return Ok(Some(p));
        }
        let deficit = n - self.pools.device.pages.free_count() as usize;
        let ev = self
            .cache
            .evict_device(deficit, self.cfg.cache.write_policy);
        self.pools.device.pages.free(&ev.freed);
        for node in ev.write_back {
            if !self.issue_backup(node)? {
                self.cache.cancel_write_back(node);
            }
        }
        Ok(self.pools.device.pages.alloc(n))
    }

    /// Moves queued requests into the running batch while pages allow (FIFO, head of line).
    fn admit(&mut self) -> Result<usize, EngineError> {
        let mut admitted = 0;
        while let Some(&id) = self.queue.front() {
            if self.running.len() >= self.cfg.scheduler.running_requests_max as usize {
                break;
            }
            let (prompt_len, total, keys) = {
                let r = &self.requests[&id];
                // Always compute at least the last prompt token: its query yields the first token.
                let cacheable = (r.prompt_len - 1) / PAGE_TOKENS as usize;
                let total = pages_for_tokens((r.prompt_len + r.max_new as usize) as u64) as usize;
                (r.prompt_len, total, page_keys(&r.tokens, cacheable))
            };
            let m = self.cache.match_prefix(&keys);
            self.cache.lock(&m.nodes);
            self.cache.pin_host(&m.nodes[m.device..]);
            let need = total - m.device;
            let Some(pages) = self.alloc_device(need)? else {
                self.cache.unpin(&m.nodes[m.device..]);
                self.cache.unlock(&m.nodes);
                break;
            };
            self.queue.pop_front();
            self.cache.touch(&m.nodes);
            self.metrics.queued_tokens -= prompt_len as u64;
            self.metrics.prefix_pages_queried += keys.len() as u64;
            self.metrics.prefix_pages_device_hit += m.device as u64;
            self.metrics.prefix_pages_host_hit += m.host as u64;
            let mut table: Vec<PageId> = m.nodes[..m.device]
                .iter()
                .map(|&n| self.cache.node(n).device.expect("resident"))
                .collect();
            table.extend_from_slice(&pages);
            {
                let r = self.requests.get_mut(&id).expect("queued request exists");
                r.state = RequestState::Running;
                r.pages = table;
                r.locked = m.nodes.clone();
                r.owned_from = m.device + m.host;
                r.computed = (m.device + m.host) * PAGE_TOKENS as usize;
            }
            if m.host > 0 {
                let nodes = m.nodes[m.device..].to_vec();
                let dev_pages = pages[..m.host].to_vec();
                let load = self.issue_load(id, nodes, dev_pages)?;
                self.requests.get_mut(&id).expect("running").load = Some(load);
            }
            if self.cfg.cache.write_policy == WritePolicy::WriteThroughSelective && m.device > 0 {
                let last = m.nodes[m.device - 1];
                if self.cache.node(last).hits >= 2 && self.cache.node(last).host.is_none() {
                    self.issue_backup(last)?;
                }
            }
            self.running.push(id);
            admitted += 1;
        }
        Ok(admitted)
    }

    /// The next batch: every decoding request contributes one token; prefilling requests take
    /// chunks of their prompt within the step's prefill budget, in admission order.
    fn build_batch(&self) -> Vec<crate::model::Row> {
        let mut rows = Vec::new();
        let mut budget = self.cfg.scheduler.prefill_tokens_per_step_max as usize;
        let mut query_rows = 0usize;
        for &id in &self.running {
            let r = &self.requests[&id];
            if r.in_prefill() {
                let n = (r.prompt_len - r.computed).min(budget);
                if n == 0 {
                    continue;
                }
                let from = r.computed;
                let to = from + n;
                let queries: Vec<u32> = match self.cfg.model.prefill_indexer {
                    PrefillIndexer::EveryToken => (from as u32..to as u32).collect(),
                    PrefillIndexer::LastToken => vec![to as u32 - 1],
                };
                if query_rows + queries.len() > self.scratch.rows_max {
                    continue;
                }
                budget -= n;
                query_rows += queries.len();
                rows.push(crate::model::Row {
                    request: id,
                    from,
                    to,
                    queries,
                });
            } else if !r.finished() {
                if query_rows + 1 > self.scratch.rows_max {
                    continue;
                }
                query_rows += 1;
                let p = r.computed;
                rows.push(crate::model::Row {
                    request: id,
                    from: p,
                    to: p + 1,
                    queries: vec![p as u32],
                });
            }
        }
        rows
    }

    /// After the forward: acknowledge the loads it consumed, emit digests and tokens (discarding
    /// rows that read a failed load), and complete finished requests.
    fn finish_step(
        &mut self,
        rows: &[crate::model::Row],
        digests: Vec<Vec<u64>>,
    ) -> Result<(), EngineError> {
        let mut failed: Vec<u64> = Vec::new();
        for row in rows {
            if let Some(load) = self.requests[&row.request].load {
                if self.ack_load(load)? == Some(false) {
                    failed.push(row.request);
                }
            }
        }
        let mut qi = 0usize;
        let now = self.clock.now_ns();
        for row in rows {
            let n = row.queries.len();
            let row_digests = &digests[qi..qi + n];
            qi += n;
            if failed.contains(&row.request) {
                continue;
            }
            for (&pos, d) in row.queries.iter().zip(row_digests) {
                self.outputs.push(Output::Digests {
                    request: row.request,
                    position: pos,
                    digests: d.clone(),
                });
            }
            let r = self.requests.get_mut(&row.request).expect("running");
            r.computed = row.to;
            let last = *row.queries.last().expect("a row has a query");
            if last as usize + 1 == r.tokens.len()
                && last as usize + 1 >= r.prompt_len
                && !r.finished()
            {
                let token = self.synth.next_token(row_digests.last().expect("digests"));
                r.tokens.push(token);
                r.generated += 1;
                if r.first_token_ns.is_none() {
                    r.first_token_ns = Some(now);
                }
                let index = r.generated - 1;
                self.metrics.generated_tokens += 1;
                self.outputs.push(Output::Token {
                    request: row.request,
                    index,
                    token,
                });
            }
            if row.to <= self.requests[&row.request].prompt_len {
                self.metrics.prefill_tokens += (row.to - row.from) as u64;
            }
        }
        let done: Vec<u64> = self
            .running
            .iter()
            .copied()
            .filter(|id| self.requests[id].finished())
            .collect();
        for id in done {
            self.complete(id)?;
        }
        Ok(())
    }

    /// A finished request: its full pages go into the prefix cache (backed up under
    /// write-through), the rest are freed, its locks released.
    fn complete(&mut self, id: u64) -> Result<(), EngineError> {
        let r = self.requests.remove(&id).expect("finished request exists");
        self.running.retain(|&x| x != id);
        assert!(
            r.load.is_none(),
            "request {id} finished with a load unacknowledged"
        );
        let full = r.computed / PAGE_TOKENS as usize;
        let keys = page_keys(&r.tokens, full);
        let ins = self.cache.insert(&keys, &r.pages[..full]);
        self.pools.device.pages.free(&ins.duplicates);
        self.pools
            .device
            .pages
            .free(&r.pages[full.max(r.owned_from)..]);
        self.cache.unlock(&r.locked);
        if self.cfg.cache.write_policy == WritePolicy::WriteThrough {
            if let Some(&last) = ins.nodes.last() {
                self.issue_backup(last)?;
            }
        }
        self.metrics.requests_finished += 1;
        let generated = r.tokens[r.prompt_len..].to_vec();
        self.outputs.push(Output::Finished {
            request: id,
            generated,
        });
        Ok(())
    }

    pub(crate) fn refresh_gauges(&mut self) {
        self.metrics.queue_depth = self.queue.len() as u64;
        self.metrics.running_requests = self.running.len() as u64;
        self.metrics.device_pages_used = self.pools.device.pages.used_count() as u64;
        self.metrics.host_tokens_used =
            self.pools.host.pages.used_count() as u64 * PAGE_TOKENS as u64;
    }

    /// Checks the engine's invariants (the prefix cache's, and page conservation across the tree,
    /// the requests and the loads in flight); panics on the first broken one.
    pub fn check_invariants(&self) {
        self.cache.check_invariants();
        let mut owned = 0usize;
        for &id in &self.running {
            let r = &self.requests[&id];
            owned += r.pages.len() - r.owned_from;
        }
        let loading: usize = self
            .loads
            .values()
            .filter(|l| !l.pages_freed_early && !l.published_early)
            .map(|l| l.dev_pages.len())
            .sum();
        let tree = self.cache.device_pages().len();
        assert_eq!(
            self.pools.device.pages.used_count() as usize,
            tree + owned + loading,
            "device pages in use = tree {tree} + requests {owned} + loading {loading}"
        );
        let host_tree = self.cache.host_pages().len();
        assert_eq!(
            self.pools.host.pages.used_count() as usize,
            host_tree,
            "host pages in use = pages held by the tree"
        );
        assert!(
            self.queue.len() <= self.cfg.scheduler.queued_requests_max as usize
                || self.mutants.on(Mutant::NoAdmissionControl),
            "queue over its limit"
        );
    }

    /// At quiescence every page, pin and lock is accounted for: nothing is locked or pinned, and
    /// the pools hold exactly what the tree holds. `Err` names what leaked.
    pub fn check_quiescent(&self) -> Result<(), String> {
        if !self.is_idle() {
            return Err(format!(
                "not idle: {} queued, {} running, {} loads, {} backups",
                self.queue.len(),
                self.running.len(),
                self.loads.len(),
                self.backups.len()
            ));
        }
        let locked = self.cache.locked_nodes();
        if locked > 0 {
            return Err(format!("{locked} tree nodes still locked"));
        }
        let pinned = self.cache.pinned_nodes();
        if pinned > 0 {
            return Err(format!("{pinned} tree nodes still pinned"));
        }
        let used = self.pools.device.pages.used_count() as usize;
        let tree = self.cache.device_pages().len();
        if used != tree {
            return Err(format!("{used} device pages in use, the tree holds {tree}"));
        }
        let hused = self.pools.host.pages.used_count() as usize;
        let htree = self.cache.host_pages().len();
        if hused != htree {
            return Err(format!("{hused} host pages in use, the tree holds {htree}"));
        }
        Ok(())
    }

    pub(crate) fn take_event(&mut self) -> EventId {
        self.free_events
            .pop()
            .unwrap_or_else(|| self.dev.new_event())
    }

    pub(crate) fn region(&self, buffer: BufferId, offset: u64, bytes: u64) -> Region {
        Region {
            buffer,
            offset,
            bytes,
        }
    }
}
