//! The scheduler: it owns the request queue, the requests and the running set, and decides what
//! each step does with them — intake with admission control, admission into the running batch,
//! the batch itself (prefill chunks within a token budget, one token per decoding request), what
//! a forward's digests mean for each request, and what a step hands back ([`Output`]).
//!
//! It holds no pages and moves no bytes: admission asks the rest of the engine for a request's
//! cached prefix and pages through `Reserve`, and the cache controller's acknowledgements come
//! back as `LoadAck` effects that only the scheduler applies to its requests.

use crate::cache::NodeId;
use crate::config::{Config, PrefillIndexer, SchedulerConfig};
use crate::device::TokenAt;
use crate::error::EngineError;
use crate::exchange::{Grant, LoadAck, LoadId, Row};
use crate::layout::{PageId, PAGE_TOKENS};
use crate::mutants::Mutants;
use crate::probe::{self, Probe};
use crate::synth::{Synth, VOCAB};
use std::collections::{BTreeMap, VecDeque};

/// What a client submits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestSpec {
    pub prompt: Vec<u32>,
    pub max_new_tokens: u32,
}

/// Why intake refused a request. Over a limit the request is rejected, never queued unboundedly.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error("queue full: {queued} requests queued, scheduler.queued_requests_max = {limit}")]
    QueueFull { queued: u32, limit: u32 },
    #[error("too many pending tokens: {pending} queued + {prompt} new > scheduler.pending_tokens_max = {limit}")]
    PendingTokens {
        pending: u64,
        prompt: u64,
        limit: u64,
    },
    #[error("invalid request: {reason}")]
    Invalid { reason: String },
}

/// What the engine reports as it works (drained with `Engine::drain_outputs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    /// The per-layer digests of one query position (the stand-in for attention output).
    Digests {
        request: u64,
        position: u32,
        digests: Vec<u64>,
    },
    /// A generated token.
    Token {
        request: u64,
        index: u32,
        token: u32,
    },
    Finished {
        request: u64,
        generated: Vec<u32>,
    },
    Aborted {
        request: u64,
    },
    /// A load failed: the request recomputes its prefix (no output was emitted from the failed data).
    Recompute {
        request: u64,
        tokens: u32,
    },
    /// The device lost its memory (its context was recreated): the running request went back to
    /// the head of the queue, ahead of every queued one and in running order, and is admitted
    /// again to recompute its KV from its tokens. What it emitted stands; digests of positions
    /// it recomputes are emitted again, equal.
    Requeued {
        request: u64,
    },
    /// Prefill/decode: the request's KV could not be moved to the decode engine (each of `tries`
    /// sends reported a failed copy); it ends here, and no page of it is left on either side.
    TransferFailed {
        request: u64,
        tries: u32,
    },
    /// Prefill/decode: every layer of the request's last send arrived, but the decode side was
    /// not told the send was over by `pd::NOTIFICATION_DEADLINE_NS` after it was enqueued (its
    /// notification was lost, or late, or its layers slow), and that was its last try of
    /// `tries`; it ends here, and no page of it is left on either side.
    TransferTimedOut {
        request: u64,
        tries: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestState {
    Queued,
    Running,
}

/// One request inside the engine.
#[derive(Clone, Debug)]
pub struct Request {
    pub(crate) id: u64,
    pub(crate) prompt_len: usize,
    /// Prompt, then generated tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) max_new: u32,
    pub(crate) generated: u32,
    /// Positions whose KV and index-K are stored (or being loaded).
    pub(crate) computed: usize,
    /// The page table: `pages[i]` holds positions `64i .. 64i + 64`.
    pub(crate) pages: Vec<PageId>,
    /// Tree nodes this request locked (matched, or loaded for it).
    pub(crate) locked: Vec<NodeId>,
    /// `pages[owned_from..]` belong to the request (inserted or freed when it ends).
    pub(crate) owned_from: usize,
    /// The load this request's forward must wait for, until it is acknowledged.
    pub(crate) load: Option<LoadId>,
    pub(crate) state: RequestState,
}

impl Request {
    pub fn id(&self) -> u64 {
        self.id
    }
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    /// Prompt, then generated tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn generated(&self) -> u32 {
        self.generated
    }
    /// Positions whose KV and index-K are stored (or being loaded).
    pub fn computed(&self) -> usize {
        self.computed
    }
    /// The page table: `pages()[i]` holds positions `64i .. 64i + 64`.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }
    /// The load this request's forward waits for, until it is acknowledged.
    pub fn load(&self) -> Option<LoadId> {
        self.load
    }
    pub fn state(&self) -> RequestState {
        self.state
    }
    pub fn in_prefill(&self) -> bool {
        self.computed < self.prompt_len
    }
    pub fn finished(&self) -> bool {
        self.generated >= self.max_new
    }
    /// Finished, and the KV of every token before its last computed: a request requeued after
    /// it finished (a pair's export whose device memory was lost, `Scheduler::requeue_export`)
    /// recomputes it before it leaves the running set again.
    fn finished_with_kv(&self) -> bool {
        self.finished() && self.computed + 1 >= self.tokens.len()
    }
    /// Where a chunk of positions whose tokens are known ends: positions are computed in chunks
    /// up to the prompt's end, and after a requeue (`Scheduler::requeue_running`) up to the end
    /// of the tokens it had generated too, the last of which generates the next. A finished
    /// request back to recompute (`Scheduler::requeue_export`) stops before its last token, as
    /// it was when it finished.
    fn chunk_end(&self) -> usize {
        if self.finished() {
            self.tokens.len() - 1
        } else {
            self.prompt_len.max(self.tokens.len())
        }
    }
    /// Queued again to recompute its KV, holding no page or lock: returns the tree nodes it had
    /// locked and the device pages it owned, for the caller to unlock and free.
    fn back_to_queue(&mut self) -> (Vec<NodeId>, Vec<PageId>) {
        let pages = std::mem::take(&mut self.pages);
        let held = (
            std::mem::take(&mut self.locked),
            pages[self.owned_from..].to_vec(),
        );
        self.owned_from = 0;
        self.computed = 0;
        self.state = RequestState::Queued;
        held
    }
    /// The batch row that stores positions `from..to` and queries `queries`.
    fn row(&self, from: usize, to: usize, queries: Vec<u32>) -> Row {
        Row {
            request: self.id,
            from,
            to,
            queries,
            tokens: self.tokens[from..to].to_vec(),
            pages: self.pages.clone(),
            pending: None,
        }
    }
    /// Full prompt pages the prefix cache may serve: the last prompt token is always computed,
    /// because its query yields the first token.
    pub fn cacheable_pages(&self) -> usize {
        (self.prompt_len - 1) / PAGE_TOKENS as usize
    }
}

/// Admission's question to the rest of the engine.
pub(crate) trait Reserve {
    /// The cached prefix and the device pages of `r`, or `None` when the device tier cannot
    /// hold it now (nothing is then held for it). Loads of other requests acknowledged on the
    /// way are pushed to `acks`, whether or not the reservation succeeds.
    fn reserve(
        &mut self,
        r: &Request,
        acks: &mut Vec<LoadAck>,
    ) -> Result<Option<Grant>, EngineError>;
}

/// Counts of what a forward produced, for the metrics.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Recorded {
    pub generated_tokens: u64,
    pub prefill_tokens: u64,
}

/// The scheduler's limits, from the configuration.
#[derive(Clone, Debug)]
struct Limits {
    sched: SchedulerConfig,
    context_tokens_max: u32,
    prefill_indexer: PrefillIndexer,
}

pub struct Scheduler {
    limits: Limits,
    /// The zoo's switches (empty in production builds): mutant 13 drops admission control.
    mutants: Mutants,
    queue: VecDeque<u64>,
    requests: BTreeMap<u64, Request>,
    /// Aborted requests whose memory waits for their row in the step in flight ([`detach`]).
    ///
    /// [`detach`]: Scheduler::detach
    detached: BTreeMap<u64, Request>,
    running: Vec<u64>,
    /// Queued requests that came back from the running batch ([`requeue_running`]), not
    /// through intake: the queue's limits hold for the rest.
    ///
    /// [`requeue_running`]: Scheduler::requeue_running
    requeued: std::collections::BTreeSet<u64>,
    /// Queued requests that had finished and come back to recompute their KV
    /// ([`requeue_export`]): a prefill engine's exports, as many as its pages held, outside
    /// the queue's limits too.
    ///
    /// [`requeue_export`]: Scheduler::requeue_export
    requeued_exports: std::collections::BTreeSet<u64>,
    next_request: u64,
    /// Prompt tokens of the queued requests (the admission-control bound).
    queued_tokens: u64,
    outputs: Vec<Output>,
}

impl Scheduler {
    pub(crate) fn new(cfg: &Config, mutants: Mutants) -> Scheduler {
        Scheduler {
            limits: Limits {
                sched: cfg.scheduler.clone(),
                context_tokens_max: cfg.model.context_tokens_max,
                prefill_indexer: cfg.model.prefill_indexer,
            },
            mutants,
            queue: VecDeque::new(),
            requests: BTreeMap::new(),
            detached: BTreeMap::new(),
            running: Vec::new(),
            requeued: Default::default(),
            requeued_exports: Default::default(),
            next_request: 0,
            queued_tokens: 0,
            outputs: Vec::new(),
        }
    }

    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }
    pub fn running_len(&self) -> usize {
        self.running.len()
    }
    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens
    }
    pub fn request(&self, id: u64) -> Option<&Request> {
        self.requests.get(&id)
    }
    /// Nothing queued or running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }
    pub(crate) fn emit(&mut self, o: Output) {
        self.outputs.push(o);
    }
    pub(crate) fn drain_outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    /// Why `spec` can never be served, if it cannot.
    fn invalid(&self, spec: &RequestSpec) -> Option<String> {
        let s = &self.limits.sched;
        if spec.prompt.is_empty() {
            return Some("empty prompt".into());
        }
        if spec.max_new_tokens == 0 || spec.max_new_tokens > s.output_tokens_max {
            return Some(format!(
                "max_new_tokens = {} outside 1..={} (scheduler.output_tokens_max)",
                spec.max_new_tokens, s.output_tokens_max
            ));
        }
        let total = spec.prompt.len() as u64 + spec.max_new_tokens as u64;
        if total > self.limits.context_tokens_max as u64 {
            return Some(format!(
                "prompt {} + max_new_tokens {} exceeds model.context_tokens_max = {}",
                spec.prompt.len(),
                spec.max_new_tokens,
                self.limits.context_tokens_max
            ));
        }
        if spec.prompt.len() as u64 > s.pending_tokens_max {
            return Some(format!(
                "a prompt of {} tokens can never fit scheduler.pending_tokens_max = {}",
                spec.prompt.len(),
                s.pending_tokens_max
            ));
        }
        let t = spec.prompt.iter().find(|&&t| t >= VOCAB)?;
        Some(format!("token {t} outside the vocabulary (< {VOCAB})"))
    }

    /// Over a limit of admission control, the rejection.
    fn over_limit(&self, prompt: u64) -> Option<Rejection> {
        let s = &self.limits.sched;
        if self.mutants.no_admission_control() {
            return None;
        }
        if self.queue.len() as u64 >= s.queued_requests_max as u64 {
            return Some(Rejection::QueueFull {
                queued: self.queue.len() as u32,
                limit: s.queued_requests_max,
            });
        }
        if self.queued_tokens + prompt > s.pending_tokens_max {
            return Some(Rejection::PendingTokens {
                pending: self.queued_tokens,
                prompt,
                limit: s.pending_tokens_max,
            });
        }
        None
    }

    /// Intake: queues `spec` as a new request, or rejects it with a typed reason.
    pub(crate) fn submit(&mut self, spec: RequestSpec) -> Result<u64, Rejection> {
        if let Some(reason) = self.invalid(&spec) {
            return Err(Rejection::Invalid { reason });
        }
        if let Some(r) = self.over_limit(spec.prompt.len() as u64) {
            return Err(r);
        }
        let id = self.next_request;
        self.next_request += 1;
        probe::hit_if(
            Probe::RequestFillsContext,
            spec.prompt.len() as u64 + spec.max_new_tokens as u64
                == self.limits.context_tokens_max as u64,
        );
        self.queued_tokens += spec.prompt.len() as u64;
        let r = Request {
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
        };
        let prev = self.requests.insert(id, r);
        assert!(prev.is_none(), "request id {id} handed out twice");
        self.queue.push_back(id);
        Ok(id)
    }

    /// Takes request `id` out, wherever it is (an abort).
    pub(crate) fn remove(&mut self, id: u64) -> Option<Request> {
        let req = self.requests.remove(&id)?;
        match req.state {
            RequestState::Queued => {
                self.queue.retain(|&q| q != id);
                self.queued_tokens -= req.prompt_len as u64;
                self.requeued.remove(&id);
                self.requeued_exports.remove(&id);
            }
            RequestState::Running => self.running.retain(|&r| r != id),
        }
        Some(req)
    }

    /// Moves queued requests into the running batch while `res` grants them pages (FIFO, head of
    /// line: a request that does not fit now blocks those behind it).
    pub(crate) fn admit(&mut self, res: &mut impl Reserve) -> Result<usize, EngineError> {
        let mut admitted = 0;
        let mut acks = Vec::new();
        // The queue position tried next: always the front, but for a mutant that passes over
        // a request that does not fit.
        let mut at = 0;
        while let Some(&id) = self.queue.get(at) {
            if self.running.len() >= self.limits.sched.running_requests_max as usize {
                probe::hit(Probe::AdmitRunningFull);
                break;
            }
            let reserved = res.reserve(&self.requests[&id], &mut acks);
            for ack in acks.drain(..) {
                self.load_acked(&ack);
            }
            let Some(grant) = reserved? else {
                probe::hit(Probe::AdmitNoPages);
                if self.mutants.admission_passes_blocked() {
                    at += 1;
                    continue;
                }
                break;
            };
            self.queue.remove(at);
            self.requeued.remove(&id);
            self.requeued_exports.remove(&id);
            let r = self.requests.get_mut(&id).expect("queued request exists");
            let whole = grant.cached == r.cacheable_pages();
            probe::hit_if(Probe::AdmitWholePromptCached, whole && grant.cached > 0);
            probe::hit_if(
                Probe::AdmitCachedToPageBoundary,
                whole && grant.cached > 0 && r.prompt_len % PAGE_TOKENS as usize == 0,
            );
            probe::hit_if(
                Probe::PageTableFull,
                grant.pages.len() == self.limits.context_tokens_max.div_ceil(PAGE_TOKENS) as usize,
            );
            self.queued_tokens -= r.prompt_len as u64;
            r.state = RequestState::Running;
            r.pages = grant.pages;
            r.locked = grant.locked;
            r.owned_from = grant.cached;
            r.computed = grant.cached * PAGE_TOKENS as usize;
            r.load = grant.load;
            self.running.push(id);
            admitted += 1;
        }
        Ok(admitted)
    }

    /// A request whose prompt another engine computed and whose KV was transferred in (the
    /// decode side of a prefill/decode pair): it joins the running set as it is. Its id is the
    /// prefill side's, which intake never hands out here (a decode engine takes no submissions).
    pub(crate) fn admit_transferred(&mut self, r: Request) {
        assert_eq!(
            r.state,
            RequestState::Running,
            "request {} joins the running set",
            r.id
        );
        let id = r.id;
        let prev = self.requests.insert(id, r);
        assert!(prev.is_none(), "request {id} transferred in twice");
        self.running.push(id);
    }

    /// Takes running request `id` out as it stands (the prefill side of a pair, for zoo mutant
    /// 14 only: an aborted prefill published anyway).
    pub(crate) fn take_running(&mut self, id: u64) -> Option<Request> {
        if self.requests.get(&id)?.state != RequestState::Running {
            return None;
        }
        self.running.retain(|&r| r != id);
        self.requests.remove(&id)
    }

    /// Applies a load's acknowledgement to its request: it no longer waits for the load; after a
    /// failed copy it drops the unloaded nodes and recomputes their tokens (an aborted request
    /// whose memory waits for its step in flight, [`detach`](Self::detach), only drops them).
    pub(crate) fn load_acked(&mut self, ack: &LoadAck) {
        if ack.orphaned {
            return; // its request was aborted; the controller released what the load held
        }
        let detached = self.detached.contains_key(&ack.request);
        let r = match self.requests.get_mut(&ack.request) {
            Some(r) => r,
            None => self.detached.get_mut(&ack.request).unwrap_or_else(|| {
                panic!(
                    "{} acknowledged for request {}, which is gone",
                    ack.load, ack.request
                )
            }),
        };
        assert_eq!(
            r.load,
            Some(ack.load),
            "request {} waited for another load",
            ack.request
        );
        r.load = None;
        if !ack.ok {
            // Nothing was published: the pages stay with the request, which recomputes them.
            let device_hits = r.owned_from - ack.nodes;
            r.locked.truncate(device_hits);
            r.owned_from = device_hits;
            r.computed = device_hits * PAGE_TOKENS as usize;
            let tokens = (ack.nodes * PAGE_TOKENS as usize) as u32;
            if !detached {
                self.emit(Output::Recompute {
                    request: ack.request,
                    tokens,
                });
            }
        }
    }

    /// Sends every running request back to the head of the queue, in running order, to recompute
    /// its KV (the device lost it): each holds no page, lock or load afterwards. Returns, per
    /// request, the tree nodes it had locked and the device pages it owned, for the caller to
    /// unlock and free. Its load, if any, must be acknowledged first.
    pub(crate) fn requeue_running(&mut self) -> Vec<(Vec<NodeId>, Vec<PageId>)> {
        let running = std::mem::take(&mut self.running);
        let mut held = Vec::with_capacity(running.len());
        for &id in running.iter().rev() {
            let r = self.requests.get_mut(&id).expect("running request exists");
            assert!(
                r.load.is_none(),
                "request {id} requeued with its load unacknowledged"
            );
            held.push(r.back_to_queue());
            self.queued_tokens += r.prompt_len as u64;
            self.queue.push_front(id);
            self.requeued.insert(id);
        }
        for &id in &running {
            probe::hit(Probe::RequestRequeued);
            self.outputs.push(Output::Requeued { request: id });
        }
        held
    }

    /// Sends a request taken out earlier (a prefill engine's export, whose KV the device lost)
    /// back to position `at` of the queue to recompute its KV; a finished one finishes again
    /// once that is computed, generating nothing (zoo mutant 14's exports may be unfinished).
    /// Returns the tree nodes it had locked and the device pages it owned, for the caller to
    /// unlock and free.
    pub(crate) fn requeue_export(
        &mut self,
        mut r: Request,
        at: usize,
    ) -> (Vec<NodeId>, Vec<PageId>) {
        let id = r.id;
        assert!(r.load.is_none(), "export {id} with a load");
        let held = r.back_to_queue();
        self.queued_tokens += r.prompt_len as u64;
        let prev = self.requests.insert(id, r);
        assert!(prev.is_none(), "export {id} requeued while held");
        self.queue.insert(at, id);
        self.requeued_exports.insert(id);
        probe::hit(Probe::RequestRequeued);
        self.outputs.push(Output::Requeued { request: id });
        held
    }

    /// Keeps an aborted running request (out of the running set) until its row in the step in
    /// flight is recorded: its load's acknowledgement still applies to it, and its memory goes
    /// back after ([`take_detached`](Self::take_detached)).
    pub(crate) fn detach(&mut self, r: Request) {
        assert!(
            !self.requests.contains_key(&r.id),
            "request {} detached while still held",
            r.id
        );
        let prev = self.detached.insert(r.id, r);
        assert!(prev.is_none(), "request detached twice");
    }

    /// The aborted requests [`detach`](Self::detach) kept, handed back.
    pub(crate) fn take_detached(&mut self) -> Vec<Request> {
        std::mem::take(&mut self.detached).into_values().collect()
    }

    /// The detached requests' ids.
    pub(crate) fn detached_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.detached.keys().copied()
    }

    /// The detached requests' own device pages.
    pub(crate) fn detached_pages(&self) -> usize {
        self.detached
            .values()
            .map(|r| r.pages.len() - r.owned_from)
            .sum()
    }

    /// The next batch: every decoding request contributes one token; prefilling requests take
    /// chunks of their prompt within the step's prefill budget, in admission order; at most
    /// `rows_max` query rows.
    ///
    /// With `ahead`, the rows of the step still in flight, the batch runs one step ahead: each
    /// request continues from where that step leaves it, and a token that step generates is
    /// pending (the device reads it from the tokens that step writes). A request whose row in
    /// that step reads a load still unacknowledged waits for the step's results (the row is
    /// discarded if the load failed); one whose load failed since that row was built continues
    /// from its recorded state (the row is stale: [`record_forward`](Self::record_forward)
    /// discards it).
    pub(crate) fn build_batch(&self, rows_max: usize, ahead: Option<&[Row]>) -> Vec<Row> {
        // Each in-flight row's request, with the index of its last query row in that step.
        let mut flying: BTreeMap<u64, (&Row, u32)> = BTreeMap::new();
        let mut qi = 0u32;
        for row in ahead.unwrap_or(&[]) {
            qi += row.queries.len() as u32;
            flying.insert(row.request, (row, qi - 1));
        }
        let mut rows = Vec::new();
        let mut budget = self.limits.sched.prefill_tokens_per_step_max as usize;
        let mut query_rows = 0usize;
        for &id in &self.running {
            let r = &self.requests[&id];
            // Where the request stands after the step in flight, if it has a row there.
            let (computed, generated, pending) = match flying.get(&id) {
                None => (r.computed, r.generated, None),
                Some(&(prev, _)) if prev.from != r.computed => {
                    probe::hit(Probe::AheadRowStale);
                    (r.computed, r.generated, None)
                }
                Some(_) if r.load.is_some() => {
                    probe::hit(Probe::AheadWaitsForLoad);
                    continue;
                }
                Some(&(prev, last_query)) => {
                    let last = *prev.queries.last().expect("a row has a query") as usize;
                    let generates =
                        last + 1 == r.tokens.len() && last + 1 >= r.prompt_len && !r.finished();
                    (
                        prev.to,
                        r.generated + generates as u32,
                        generates.then_some(last_query),
                    )
                }
            };
            let chunked = computed < r.prompt_len || computed + 1 < r.tokens.len();
            let row = if chunked {
                let known = r.chunk_end();
                let n = (known - computed).min(budget);
                probe::hit_if(Probe::BatchPrefillChunked, n < known - computed);
                probe::hit_if(Probe::BatchRecomputesGenerated, computed + n > r.prompt_len);
                if n == 0 {
                    continue;
                }
                let (from, to) = (computed, computed + n);
                let queries: Vec<u32> = match self.limits.prefill_indexer {
                    PrefillIndexer::EveryToken => (from as u32..to as u32).collect(),
                    PrefillIndexer::LastToken => vec![to as u32 - 1],
                };
                r.row(from, to, queries)
            } else if generated < r.max_new {
                let p = computed;
                match pending {
                    Some(index) => {
                        probe::hit(Probe::AheadPendingToken);
                        Row {
                            request: id,
                            from: p,
                            to: p + 1,
                            queries: vec![p as u32],
                            tokens: vec![TokenAt::pending(index, p as u32).token],
                            pages: r.pages.clone(),
                            pending: Some(index),
                        }
                    }
                    None => r.row(p, p + 1, vec![p as u32]),
                }
            } else {
                continue;
            };
            // The scratch holds a row per prefill token of the budget (every-token indexing) or
            // per running request, plus one per decode: a batch never runs out of rows.
            assert!(
                query_rows + row.queries.len() <= rows_max,
                "batch of {} query rows over the scratch's {rows_max}",
                query_rows + row.queries.len()
            );
            if chunked {
                budget = self.mutants.prefill_budget_left(budget, row.to - row.from);
            }
            query_rows += row.queries.len();
            rows.push(row);
        }
        let prefill = rows
            .iter()
            .filter(|r| r.to <= self.requests[&r.request].prompt_len);
        let prefill = prefill.count();
        probe::hit_if(Probe::BatchMixed, prefill > 0 && prefill < rows.len());
        rows
    }

    /// The loads a batch's forward must wait for, ascending and distinct.
    pub(crate) fn batch_loads(&self, rows: &[Row]) -> Vec<LoadId> {
        let mut loads: Vec<LoadId> = rows
            .iter()
            .filter_map(|r| self.requests[&r.request].load)
            .collect();
        loads.sort_unstable();
        loads.dedup();
        loads
    }

    /// After a forward: emits each row's digests and generated token (skipping the rows of
    /// `failed` requests, whose loads failed under them) and advances the requests.
    pub(crate) fn record_forward(
        &mut self,
        rows: &[Row],
        digests: &[Vec<u64>],
        failed: &[u64],
        synth: &Synth,
    ) -> Recorded {
        let mut counts = Recorded::default();
        let mut qi = 0usize;
        for row in rows {
            let row_digests = &digests[qi..qi + row.queries.len()];
            qi += row.queries.len();
            if failed.contains(&row.request) {
                probe::hit(Probe::LoadRecomputed);
                continue;
            }
            let Some(r) = self.requests.get(&row.request) else {
                // Aborted while its step was in flight (an engine running ahead; counted at the
                // abort): nothing of it is kept.
                continue;
            };
            if r.computed != row.from {
                // Built one step ahead on a row whose load failed since (the request went back
                // to recompute): stale, like the row it was built on.
                assert!(
                    r.computed < row.from,
                    "request {}: a row from position {} recorded at {}",
                    row.request,
                    row.from,
                    r.computed
                );
                probe::hit(Probe::AheadRowStale);
                continue;
            }
            assert!(
                r.tokens.len() > row.from,
                "request {}: the token at {} unknown when its row is recorded",
                row.request,
                row.from
            );
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
                let token = synth.next_token(row_digests.last().expect("digests"));
                r.tokens.push(token);
                r.generated += 1;
                counts.generated_tokens += 1;
                let index = r.generated - 1;
                probe::hit_if(
                    Probe::FinishAtOutputMax,
                    r.generated == self.limits.sched.output_tokens_max,
                );
                self.outputs.push(Output::Token {
                    request: row.request,
                    index,
                    token,
                });
            }
            // The prompt tokens of the row (a requeued request's chunk may run past its prompt).
            let prompt = self.requests[&row.request].prompt_len;
            counts.prefill_tokens += row.to.min(prompt).saturating_sub(row.from) as u64;
        }
        counts
    }

    /// Takes the first finished request (in running order) out of the running set.
    pub(crate) fn next_finished(&mut self) -> Option<Request> {
        let at = self
            .running
            .iter()
            .position(|id| self.requests[id].finished_with_kv())?;
        let id = self.running.remove(at);
        let r = self.requests.remove(&id).expect("finished request exists");
        assert!(
            r.load.is_none(),
            "request {id} finished with a load unacknowledged"
        );
        Some(r)
    }

    /// Device pages the running requests own (outside the prefix cache).
    pub(crate) fn owned_pages(&self) -> usize {
        self.running
            .iter()
            .map(|id| {
                let r = &self.requests[id];
                r.pages.len() - r.owned_from
            })
            .sum()
    }

    /// Checks the scheduler's bounds and bookkeeping; panics on the first broken one.
    pub(crate) fn check_invariants(&self) {
        let bounded = !self.mutants.no_admission_control();
        let s = &self.limits.sched;
        let requeued_tokens: u64 = self
            .requeued
            .iter()
            .chain(&self.requeued_exports)
            .map(|id| {
                let r = &self.requests[id];
                assert_eq!(
                    r.state,
                    RequestState::Queued,
                    "requeued request {id} queued"
                );
                r.prompt_len as u64
            })
            .sum();
        assert!(
            self.requeued.is_disjoint(&self.requeued_exports),
            "a request requeued both from the running set and as an export"
        );
        assert!(
            self.requeued.len() <= s.running_requests_max as usize,
            "more requests requeued than a running batch holds"
        );
        assert!(
            self.queue.len() - self.requeued.len() - self.requeued_exports.len()
                <= s.queued_requests_max as usize
                || !bounded,
            "queue over its limit"
        );
        assert!(
            self.queued_tokens - requeued_tokens <= s.pending_tokens_max || !bounded,
            "queued tokens over their limit"
        );
        let queued: u64 = self
            .queue
            .iter()
            .map(|id| {
                let r = &self.requests[id];
                assert_eq!(r.state, RequestState::Queued, "request {id} in the queue");
                r.prompt_len as u64
            })
            .sum();
        assert_eq!(
            queued, self.queued_tokens,
            "queued tokens = the queued prompts"
        );
        assert_eq!(
            self.queue.len() + self.running.len(),
            self.requests.len(),
            "every request is queued or running"
        );
        for id in &self.running {
            let r = &self.requests[id];
            assert_eq!(
                r.state,
                RequestState::Running,
                "request {id} in the running set"
            );
            assert!(
                r.owned_from <= r.pages.len(),
                "request {id} owns past its table"
            );
        }
    }
}

#[cfg(test)]
mod tests;
