//! The engine: the composition root that ties the owners together — the pools and the prefix
//! cache (the memory), the scheduler (requests), the cache controller (copies between tiers) and
//! the model step (the forward) — and routes what one owner's work means for another. Generic
//! over `Device`, `Clock` and `Transfer` (static dispatch); it never names a concrete backend.
//! Outside its submodule `pair.rs`, only the production runtime names it
//! (`engine/tests/it/architecture.rs`).
//!
//! One call of [`Engine::step`] is one scheduling iteration: acknowledge finished copies, admit
//! queued requests (issuing their loads), run one batch forward, hand back outputs, and cache the
//! pages of completed requests (issuing backups). Everything is deterministic given the device's
//! answers: iteration uses `BTreeMap`/`Vec`, ids are sequential.

use crate::cache::model_page_keys;
pub use crate::cache::page_keys;
use crate::cache::{NodeId, PrefixCache};
use crate::config::{Config, WritePolicy};
use crate::controller::{CacheController, Io};
use crate::device::{Clock, Device, DeviceTiming, EventId, EventState};
use crate::exchange::{Grant, LoadAck, Row};
use crate::layout::PageId;
use crate::layout::{pages_for_tokens, Layout, PAGE_TOKENS};
use crate::metrics::{Metrics, StepTimes};
use crate::model::ModelStep;
use crate::mutants::Mutants;
use crate::pd::Role;
pub use crate::pools::EngineFaults;
use crate::pools::Pools;
use crate::probe::{self, Probe};
use crate::scheduler::{Output, Request, RequestSpec, RequestState, Reserve, Scheduler};
use crate::synth::Synth;
use crate::transfer::{PageRuns, Transfer};

pub use crate::error::EngineError;

pub mod pair;
pub use crate::model::QUERY_ROWS_PER_LAUNCH;
pub use crate::scheduler::Rejection;

/// Options that are not configuration: the synthetic model's seed, the mutant (tests only) and
/// injected faults (the simulator only).
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineOptions {
    pub seed: u64,
    pub mutants: Mutants,
    /// Injected allocation faults (the simulator's; none by default).
    pub faults: EngineFaults,
    /// Run one step ahead: enqueue step n+1 before waiting for step n, with the tokens step n
    /// generates read on the device (see [`Engine::step`]). Not used by a prefill/decode pair.
    pub overlap: bool,
}

/// The step in flight of an engine that runs one step ahead.
#[derive(Debug)]
struct InFlight {
    rows: Vec<Row>,
    queries: usize,
    slot: crate::model::Slot,
    /// When the iteration that built it began, for the step latency.
    started_ns: u64,
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
    /// Where the step's host time went.
    pub host: StepTimes,
    /// What the device measured of the step's compute-stream work, if it times its work.
    pub device: Option<DeviceTiming>,
}

pub struct Engine<D: Device, C: Clock, T: Transfer = PageRuns> {
    cfg: Config,
    layout: Layout,
    pub dev: D,
    clock: C,
    transfer: T,
    pub synth: Synth,
    /// The model's seed (`EngineOptions::seed`): `synth` is its model under `weights`.
    synth_seed: u64,
    mutants: Mutants,
    pools: Pools,
    cache: PrefixCache,
    sched: Scheduler,
    ctl: CacheController,
    model: ModelStep,
    pub metrics: Metrics,
    /// Steps in a row whose work the device failed (`STEP_FAILURES_MAX`).
    steps_failed_in_a_row: u32,
    /// The engine's side of a prefill/decode pair (`pair::PdPair`); `None` alone.
    role: Option<Role>,
    /// Prefill side: requests whose prompt is computed, holding their pages and locks until
    /// their transfer to the decode side completed (`release_export`).
    exports: std::collections::BTreeMap<u64, Request>,
    /// Decode side: device pages allocated for transfers in flight (`reserve_import`), not yet
    /// handed to a request.
    import_held: usize,
    /// The step enqueued and not yet collected (running ahead only).
    in_flight: Option<InFlight>,
    /// The weights' version (`update_weights`), carried by every prefix key.
    weights: u32,
    /// The device's `context_generation` when the engine last dropped what the device held: a
    /// newer one means the device's memory was lost since ([`Engine::after_recreation`]).
    context_generation: u64,
}

/// A request whose prompt the prefill engine computed, as the decode engine admits it once its
/// KV arrived: its tokens (the prompt and what prefill generated), how far its KV is stored, and
/// the device pages the transfer filled (then the rest of its page table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transferred {
    pub id: u64,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub computed: usize,
    pub generated: u32,
    pub max_new: u32,
    pub pages: Vec<PageId>,
}

/// Failed steps in a row after which the engine stops retrying and reports the device broken.
pub const STEP_FAILURES_MAX: u32 = 64;

/// What the controller works on, borrowed field by field from the engine (so that other fields,
/// the scheduler's, stay free).
macro_rules! io {
    ($e:expr) => {
        Io {
            dev: &mut $e.dev,
            clock: &$e.clock,
            transfer: &mut $e.transfer,
            layout: &$e.layout,
            pools: &mut $e.pools,
            cache: &mut $e.cache,
            metrics: &mut $e.metrics,
            mutants: $e.mutants,
        }
    };
}

impl<D: Device, C: Clock> Engine<D, C, PageRuns> {
    /// An engine with the default transfer strategy (coalesced page runs).
    pub fn new(cfg: Config, dev: D, clock: C, opts: EngineOptions) -> Result<Self, EngineError> {
        Engine::with_transfer(cfg, dev, clock, PageRuns, opts)
    }
}

impl<D: Device, C: Clock, T: Transfer> Engine<D, C, T> {
    /// Builds every owner from one validated configuration. The device sees, in order: the pool
    /// buffers, the step scratch, the load ring's events and the step event.
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
        let mut pools = Pools::new(&mut dev, layout, mutants)?;
        pools.inject(opts.faults);
        let scratch = ModelStep::scratch_layout(&cfg, mutants)?;
        let scratch = ModelStep::alloc_scratch(&mut dev, scratch, opts.overlap)?;
        let c = &cfg.cache;
        let ctl = CacheController::new(&mut dev, c.write_policy, c.load_slots, layout.layers())?;
        let mut step_done = vec![dev.new_event()?];
        if opts.overlap {
            step_done.push(dev.new_event()?);
        }
        let synth = Synth::new(opts.seed);
        let context_generation = dev.context_generation();
        let metrics = Metrics {
            device_pages_total: layout.device_pages() as u64,
            host_tokens_capacity: pools.host_layout().host_tokens().0,
            ..Metrics::default()
        };
        Ok(Engine {
            layout,
            model: ModelStep::new(&cfg, scratch, step_done, synth, mutants),
            sched: Scheduler::new(&cfg, mutants),
            cache: PrefixCache::with_mutants(mutants),
            dev,
            clock,
            transfer,
            synth,
            synth_seed: opts.seed,
            mutants,
            pools,
            ctl,
            metrics,
            cfg,
            steps_failed_in_a_row: 0,
            role: None,
            exports: std::collections::BTreeMap::new(),
            import_held: 0,
            in_flight: None,
            weights: 0,
            context_generation,
        })
    }

    /// The model's weights change to version `version` (an RL trainer's update, a hot swap): the
    /// synthetic model of this engine's seed and that version (`Synth::with_weights`) computes
    /// from now on. The prefix cache keeps what it holds, but every prefix key carries the
    /// version (`cache::model_page_keys`), so KV computed under other weights is never matched
    /// again; it leaves the tiers by eviction. Refused unless the engine is idle but for backups
    /// in flight (they copy bytes, whatever computed them): nothing queued or running, no load,
    /// export or import.
    pub fn update_weights(&mut self, version: u32) -> Result<(), EngineError> {
        if version > crate::cache::WEIGHTS_VERSION_MAX {
            return Err(EngineError::WeightsVersion(version));
        }
        let (step_in_flight, requests) = (
            self.in_flight.is_some() as usize,
            self.sched.queue_len() + self.sched.running_len(),
        );
        let (loads, exports, imports) = (
            self.ctl.loads_in_flight(),
            self.exports.len(),
            self.import_held,
        );
        if step_in_flight + requests + loads + exports + imports > 0 {
            return Err(EngineError::NotIdle {
                step_in_flight,
                requests,
                loads,
                exports,
                imports,
            });
        }
        probe::hit(Probe::WeightsUpdated);
        self.weights = version;
        self.synth = Synth::with_weights(self.synth_seed, version);
        self.model.set_weights(&self.cfg, &self.synth);
        Ok(())
    }

    /// The weights' version (`update_weights`; 0 until the first update).
    pub fn weights(&self) -> u32 {
        self.weights
    }

    /// The page keys of a request's first `pages` full pages: its tokens under the current
    /// weights (mutant 42 leaves the weights out).
    fn prefix_keys(&self, tokens: &[u32], pages: usize) -> Vec<crate::cache::PageKey> {
        model_page_keys(tokens, pages, self.mutants.key_weights(self.weights))
    }

    /// Changes the injected allocation faults (the simulator stops them for its liveness phase).
    pub fn inject(&mut self, faults: EngineFaults) {
        self.pools.inject(faults);
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn clock(&self) -> &C {
        &self.clock
    }
    pub fn queue_len(&self) -> usize {
        self.sched.queue_len()
    }
    /// Prompt tokens of the queued requests (what `scheduler.pending_tokens_max` bounds).
    pub fn queued_tokens(&self) -> u64 {
        self.sched.queued_tokens()
    }
    /// Loads in flight: each holds one slot of the load ring.
    pub fn loads_in_flight(&self) -> usize {
        self.ctl.loads_in_flight()
    }
    pub fn running_len(&self) -> usize {
        self.sched.running_len()
    }
    pub fn request(&self, id: u64) -> Option<&Request> {
        self.sched.request(id)
    }
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }
    pub fn pools(&self) -> &Pools {
        &self.pools
    }
    /// Nothing queued, running, loading or backing up (nor, in a pair, held for a transfer), and
    /// no recreated context left for the next step to handle (its device tier to drop).
    pub fn is_idle(&self) -> bool {
        self.in_flight.is_none()
            && self.sched.is_idle()
            && self.ctl.is_idle()
            && self.exports.is_empty()
            && self.import_held == 0
            && !self.recreation_pending()
    }

    /// Makes this engine one side of a prefill/decode pair. A prefill engine holds each request
    /// whose prompt it computed (it runs them with one output token: the first) as an export
    /// instead of completing it; a decode engine takes requests only through `admit_transferred`.
    pub(crate) fn set_role(&mut self, role: Role) {
        assert!(
            !self.model.ahead(),
            "a prefill/decode pair's engines do not run ahead"
        );
        self.role = Some(role);
    }
    /// The compute stream's step event: everything a finished step wrote is before it.
    pub fn step_event(&self) -> EventId {
        self.model.step_done()
    }
    /// Prefill side: the request held for its transfer, if `id` is one.
    pub fn export(&self, id: u64) -> Option<&Request> {
        self.exports.get(&id)
    }
    /// Prefill side: the requests held for their transfers, by id.
    pub fn exports(&self) -> impl Iterator<Item = &Request> {
        self.exports.values()
    }
    /// Prefill side: the transfer of export `id` is over (its send completed, or it was given
    /// up): the request completes as any other — its full pages go into the prefix cache, the
    /// rest are freed. `false` when `id` is not held.
    pub fn release_export(&mut self, id: u64) -> Result<bool, EngineError> {
        let Some(r) = self.exports.remove(&id) else {
            return Ok(false);
        };
        self.complete(r)?;
        self.refresh_gauges();
        Ok(true)
    }
    /// Prefill side, after the device's context was recreated: export `id`, whose KV the decode
    /// side received before, is dropped: its pages are freed, not cached (they hold garbage).
    /// The caller has seen every copy that reads them end. `false` when `id` is not held.
    pub(crate) fn drop_export(&mut self, id: u64) -> bool {
        let Some(r) = self.exports.remove(&id) else {
            return false;
        };
        self.cache.unlock(&r.locked);
        self.pools.device_pages.free(&r.pages[r.owned_from..]);
        self.refresh_gauges();
        true
    }
    /// Prefill side, zoo mutant 14 only: takes running request `id` out as an export however
    /// much of its prompt is computed. `false` when it is not running or waits for a load.
    pub(crate) fn export_unfinished(&mut self, id: u64) -> bool {
        if self.sched.request(id).is_none_or(|r| r.load.is_some()) {
            return false;
        }
        match self.sched.take_running(id) {
            Some(mut r) => {
                // Published as if its prompt were computed up to the last token (which decode
                // then computes from KV that was never written).
                r.computed = r.computed.max(r.prompt_len - 1);
                self.exports.insert(id, r);
                true
            }
            None => false,
        }
    }
    /// Decode side: `pages` device pages for a transfer's KV, evicting from the prefix cache as
    /// needed; `None` (nothing held) when the device tier cannot make room now.
    pub fn reserve_import(&mut self, pages: usize) -> Result<Option<Vec<PageId>>, EngineError> {
        let after = self.model.step_done();
        let (ctl, mut io) = self.split();
        let got = ctl.alloc_device(&mut io, pages, after)?;
        if let Some(p) = &got {
            self.import_held += p.len();
        }
        self.refresh_gauges();
        Ok(got)
    }
    /// Decode side: device pages reserved for transfers in flight, not yet handed to a request.
    pub fn pages_held_for_transfers(&self) -> usize {
        self.import_held
    }
    /// Decode side: gives back the pages of a transfer that failed or was abandoned. The caller
    /// has seen every copy into them complete.
    pub fn cancel_import(&mut self, pages: &[PageId]) {
        assert!(
            pages.len() <= self.import_held,
            "cancelling pages never reserved"
        );
        self.import_held -= pages.len();
        self.pools.device_pages.free(pages);
        self.refresh_gauges();
    }
    /// Decode side: a transferred request joins the running set. The caller has seen every
    /// layer's receive complete; `t.pages` (the transfer's, then its own) are the request's
    /// page table, the first `t.pages.len()` of them reserved by `reserve_import`.
    pub fn admit_transferred(&mut self, t: Transferred) {
        assert!(
            t.pages.len() <= self.import_held,
            "admitting pages never reserved"
        );
        self.import_held -= t.pages.len();
        self.sched.admit_transferred(Request {
            id: t.id,
            prompt_len: t.prompt_len,
            tokens: t.tokens,
            max_new: t.max_new,
            generated: t.generated,
            computed: t.computed,
            pages: t.pages,
            locked: Vec::new(),
            owned_from: 0,
            load: None,
            state: RequestState::Running,
        });
        self.refresh_gauges();
    }
    pub fn drain_outputs(&mut self) -> Vec<Output> {
        self.sched.drain_outputs()
    }

    /// The controller and what it works on, borrowed for one call.
    fn split(&mut self) -> (&mut CacheController, Io<'_, D, C, T>) {
        (&mut self.ctl, io!(self))
    }

    /// Hands acknowledgements to the scheduler.
    fn apply(&mut self, acks: &[LoadAck]) {
        for ack in acks {
            self.sched.load_acked(ack);
        }
    }

    /// Intake with admission control: a typed rejection over the limits, never an unbounded queue.
    pub fn submit(&mut self, spec: RequestSpec) -> Result<u64, Rejection> {
        if self.role == Some(Role::Decode) {
            // Its requests come from its prefill engine, under that engine's ids.
            return Err(Rejection::Invalid {
                reason: "a decode engine takes requests only from its prefill engine".into(),
            });
        }
        let r = self.sched.submit(spec);
        match &r {
            Ok(_) => self.metrics.requests_submitted += 1,
            Err(Rejection::Invalid { .. }) => {
                self.metrics.rejected_invalid += 1;
                probe::hit(Probe::RejectInvalid);
            }
            Err(Rejection::QueueFull { .. }) => {
                self.metrics.rejected_queue_full += 1;
                probe::hit(Probe::RejectQueueFull);
            }
            Err(Rejection::PendingTokens { .. }) => {
                self.metrics.rejected_pending_tokens += 1;
                probe::hit(Probe::RejectPendingTokens);
            }
        }
        if r.is_ok() {
            probe::watermark(probe::Watermark::QueuedTokens, self.sched.queued_tokens());
            self.refresh_gauges();
        }
        r
    }

    /// Aborts a request wherever it is. Between steps the compute stream is idle, so a running
    /// request's own pages are free at once; pages of an in-flight load are freed only when the
    /// load's finish event says the copy is over. Running one step ahead, a request with a row
    /// in the step in flight keeps its pages, locks and load until that step is recorded.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(req) = self.sched.remove(id) else {
            return false;
        };
        probe::hit_if(Probe::AbortMidBackup, self.ctl.backups_in_flight() > 0);
        probe::watermark(
            probe::Watermark::LoadsInFlightAtAbort,
            self.ctl.loads_in_flight() as u64,
        );
        probe::hit_if(Probe::AbortQueued, req.state == RequestState::Queued);
        if req.state == RequestState::Running {
            probe::hit(Probe::AbortRunning);
            probe::hit_if(Probe::AbortMidLoad, req.load.is_some());
            let flying = self
                .in_flight
                .as_ref()
                .is_some_and(|f| f.rows.iter().any(|r| r.request == id));
            if probe::hit_if(Probe::AheadRowOfAborted, flying)
                && !self.mutants.abort_frees_in_flight_pages()
            {
                self.sched.detach(req);
            } else {
                self.release_aborted(req);
            }
        }
        self.metrics.requests_aborted += 1;
        self.sched.emit(Output::Aborted { request: id });
        self.refresh_gauges();
        true
    }

    /// An aborted running request's memory goes back: its load is orphaned (its pages freed at
    /// the load's finish event), its locks released, its own pages freed.
    fn release_aborted(&mut self, req: Request) {
        let loading: Vec<NodeId> = match req.load {
            Some(l) => self.ctl.orphan(l, &mut self.pools, self.mutants),
            None => Vec::new(),
        };
        // Unlock what the request locked, except nodes of its in-flight load (the load keeps
        // them until its ack).
        let unlock: Vec<NodeId> = req
            .locked
            .iter()
            .copied()
            .filter(|n| !loading.contains(n))
            .collect();
        self.cache.unlock(&unlock);
        self.pools.device_pages.free(&req.pages[req.owned_from..]);
    }

    /// One scheduling iteration; see the module comment. In order, it enqueues a step and
    /// waits for it. Running one step ahead (`EngineOptions::overlap`), it builds the batch from
    /// where the step in flight leaves each request (`Scheduler::build_batch` with its rows: a
    /// token that step generates is pending, read on the device), enqueues it with the other
    /// event slot, and only then waits for the step in flight and records it: the host schedules
    /// and enqueues while the device computes, and ordering is kept by the device's events
    /// alone. When that step failed, the step built on it is waited for and discarded too: both
    /// are rebuilt from the recorded state.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        let t0 = self.clock.now_ns();
        let admitted = self.before_step()?;
        if self.recreation_pending() {
            // Recreated by a recovery within admission: the device pages the batch would read
            // are lost. The next step drops them, before it admits.
            let mut report = StepReport {
                admitted,
                ..StepReport::default()
            };
            self.end_step(&mut report);
            return Ok(report);
        }
        let ahead = self.in_flight.as_ref().map(|f| f.rows.as_slice());
        let rows = self.sched.build_batch(self.model.rows_max(), ahead);
        let mut report = StepReport {
            rows: rows.iter().map(|r| r.queries.len()).sum(),
            admitted,
            idle: false,
            host: StepTimes::default(),
            device: None,
        };
        let t1 = self.clock.now_ns();
        report.host.schedule_ns = t1.saturating_sub(t0);
        if rows.is_empty() && self.in_flight.is_none() {
            self.wait_for_copies();
            self.device_lost()?;
            report.host.wait_ns = self.clock.now_ns().saturating_sub(t1);
            report.idle = self.is_idle();
            self.end_step(&mut report);
            return Ok(report);
        }
        let enqueued = if rows.is_empty() {
            None
        } else {
            probe::hit_if(Probe::AheadStep, self.in_flight.is_some());
            let slot = self.model.next_slot();
            let queries = self.enqueue_forward(&rows, slot)?;
            Some(InFlight {
                rows,
                queries,
                slot,
                started_ns: t0,
            })
        };
        let t2 = self.clock.now_ns();
        report.host.enqueue_ns = t2.saturating_sub(t1);
        // In order the step just enqueued is the one to record; ahead, the one before it.
        let to_record = if self.model.ahead() {
            std::mem::replace(&mut self.in_flight, enqueued)
        } else {
            enqueued
        };
        let Some(prev) = to_record else {
            // The first step of a run ahead: nothing to record yet.
            report.idle = self.is_idle();
            self.end_step(&mut report);
            return Ok(report);
        };
        let digests = self.model.collect(&mut self.dev, prev.queries, prev.slot)?;
        let t3 = self.clock.now_ns();
        report.host.wait_ns = t3.saturating_sub(t2);
        // The rows of requests aborted meanwhile were in that step alone (a step enqueued above
        // was built without them): their memory is free now.
        for req in self.sched.take_detached() {
            self.release_aborted(req);
        }
        // A context recreated while the step was enqueued or ran: what it read is not known to
        // be what was stored. It is dropped unrecorded; the next step drops the rest (the step
        // after it, if any, with what the device held) before it admits.
        if digests.is_some() && self.recreation_pending() {
            self.metrics.steps_discarded += 1;
            report.idle = self.is_idle();
            self.end_step(&mut report);
            return Ok(report);
        }
        let Some(digests) = digests else {
            if let Some(next) = self.in_flight.take() {
                probe::hit(Probe::AheadDiscarded);
                // Discarded whatever it reports; a failure of its own counts as one.
                let ev = self.model.slot_event(next.slot);
                if self.dev.synchronize(ev) == EventState::Failed {
                    self.metrics.steps_failed += 1;
                } else {
                    self.metrics.steps_discarded += 1;
                }
            }
            self.step_failed()?;
            report.idle = self.is_idle();
            self.end_step(&mut report);
            return Ok(report);
        };
        self.steps_failed_in_a_row = 0;
        self.finish_step(&prev.rows, &digests)?;
        self.device_lost()?;
        let t4 = self.clock.now_ns();
        report.host.finish_ns = t4.saturating_sub(t3);
        self.metrics.steps += 1;
        self.metrics
            .step_latency
            .observe(t4.saturating_sub(prev.started_ns));
        report.idle = self.is_idle();
        self.end_step(&mut report);
        Ok(report)
    }

    /// Every iteration's start: acknowledge finished copies, retry deferred backups, admit
    /// queued requests. Returns how many were admitted.
    fn before_step(&mut self) -> Result<usize, EngineError> {
        // A recreation since the last step's admission (by its failed step's recovery, its
        // acknowledgements', a completed request's backup, an eviction's) is handled before any
        // copy is acknowledged: a backup issued after it copied garbage.
        self.after_faults()?;
        let after = self.model.step_done();
        let acks = {
            let (ctl, mut io) = self.split();
            ctl.poll_backups(&mut io, false);
            ctl.retry_deferred_backups(&mut io, after)?;
            ctl.poll_loads(&mut io)
        };
        self.apply(&acks);
        self.after_faults()?;
        let admitted = self.admit()?;
        self.device_lost()?;
        Ok(admitted)
    }

    /// Enqueues the forward of `rows`, ended by the event of `slot`; returns its query rows.
    fn enqueue_forward(&mut self, rows: &[Row], slot: usize) -> Result<usize, EngineError> {
        let events = self.ctl.layer_events(&self.sched.batch_loads(rows));
        self.model
            .forward(&mut self.dev, &self.pools, &events, &self.synth, rows, slot)
    }

    /// The device failed a step's work: nothing of it is kept. The requests' state is as
    /// before the step (the batch is built again from it), loads stay unacked, and the next
    /// step rewrites the same rows. A device that fails step after step is broken: the caller
    /// hears of it.
    fn step_failed(&mut self) -> Result<(), EngineError> {
        self.metrics.steps_failed += 1;
        self.steps_failed_in_a_row += 1;
        // The fault is sticky until the device clears it: the rerun would fail too.
        self.dev.recover()?;
        probe::hit(Probe::DeviceRecovered);
        if self.steps_failed_in_a_row >= STEP_FAILURES_MAX {
            return Err(EngineError::Device(crate::device::DeviceError::Backend {
                detail: format!(
                    "the device failed {} steps in a row",
                    self.steps_failed_in_a_row
                ),
            }));
        }
        Ok(())
    }

    /// Every step's end: the device's timing of it, the time metrics and the gauges.
    fn end_step(&mut self, report: &mut StepReport) {
        report.device = self.dev.take_timing();
        self.metrics.step_host.add(&report.host);
        if let Some(d) = report.device {
            self.metrics.step_device.add(&d);
        }
        self.refresh_gauges();
    }

    /// A device that could not recover from a fault a copy reported stops the engine.
    fn device_lost(&mut self) -> Result<(), EngineError> {
        match self.ctl.take_lost() {
            Some(e) => Err(EngineError::Device(e)),
            None => Ok(()),
        }
    }

    /// Before a step admits (at its start, and after its copies are acknowledged): a device
    /// that could not recover from a fault stops the engine; one whose recovery recreated its
    /// context since the engine last looked is handled ([`Engine::after_recreation`]).
    /// Elsewhere the engine only notices a recreation ([`Engine::recreation_pending`]) and ends
    /// the step early, so every requeue comes before the step's admissions.
    fn after_faults(&mut self) -> Result<(), EngineError> {
        self.device_lost()?;
        self.after_recreation()?;
        Ok(())
    }

    /// Whether the device's context was recreated since the engine last dropped what the device
    /// held: nothing may read the device tier until the next step's start handles it.
    fn recreation_pending(&self) -> bool {
        self.dev.context_generation() != self.context_generation
    }

    /// When the device's context was recreated since the engine last looked (by any recovery:
    /// a failed step's, a copy's, a repeated call's), everything the device held is gone, and
    /// the engine drops what it kept there: the step in flight is discarded; every load and
    /// backup in flight is waited for and fails (a load's pages hold garbage now; a backup's
    /// copy may have read them after they went); every running
    /// request goes back to the head of the queue in running order, holding no page, to
    /// recompute its KV through admission (its prefix may hit the host tier, which is host
    /// memory and survives); the prefix cache drops every device page, keeping host copies.
    /// Afterwards the device tier is empty. A prefill/decode pair's engine does this only when
    /// the pair calls it (`PdPair::after_recreations`), after the pair ended its transfers
    /// (every import given back, the exports decode admitted dropped); the exports left go back
    /// to the queue behind the running requests, to recompute their KV. Until then the
    /// recreation stays pending, and the engine's steps end early.
    fn after_recreation(&mut self) -> Result<(), EngineError> {
        if self.role.is_some() && self.recreation_pending() {
            probe::hit(Probe::PdRecreationDeferred);
            return Ok(());
        }
        self.drop_device_tier()
    }

    /// [`Engine::after_recreation`]'s work, for a pair's engine called by the pair.
    pub(crate) fn drop_device_tier(&mut self) -> Result<(), EngineError> {
        if !self.recreation_pending() {
            return Ok(());
        }
        assert_eq!(self.import_held, 0, "imports held over a recreated context");
        self.context_generation = self.dev.context_generation();
        if self.mutants.recreation_keeps_device_tier() {
            return Ok(());
        }
        probe::hit(Probe::DeviceContextRecreated);
        self.metrics.context_recreations += 1;
        if let Some(f) = self.in_flight.take() {
            // Whatever it answers, it may have read what the device lost; a failure of its own
            // counts as one.
            let ev = self.model.slot_event(f.slot);
            if self.dev.synchronize(ev) == EventState::Failed {
                self.metrics.steps_failed += 1;
            } else {
                self.metrics.steps_discarded += 1;
            }
        }
        for req in self.sched.take_detached() {
            self.release_aborted(req);
        }
        let acks = {
            let (ctl, mut io) = self.split();
            ctl.fail_all(&mut io)
        };
        self.apply(&acks);
        let mut held = self.sched.requeue_running();
        let running = held.len();
        for (k, r) in std::mem::take(&mut self.exports).into_values().enumerate() {
            probe::hit(Probe::PdExportRequeued);
            held.push(self.sched.requeue_export(r, running + k));
        }
        for (locked, owned) in held {
            self.cache.unlock(&locked);
            self.pools.device_pages.free(&owned);
            self.metrics.requests_requeued += 1;
        }
        let freed = self.cache.forget_device();
        self.pools.device_pages.free(&freed);
        assert_eq!(
            self.pools.device_pages.used_count(),
            0,
            "device pages still in use after the device's memory was lost"
        );
        self.refresh_gauges();
        Ok(())
    }

    /// Nothing to compute: waits for the oldest copy in flight, so the next step can progress.
    fn wait_for_copies(&mut self) {
        let (ctl, mut io) = self.split();
        if ctl.has_backups() {
            probe::hit(Probe::StepWaitedForBackup);
            ctl.poll_backups(&mut io, true);
        } else if let Some(ack) = ctl.wait_oldest_load(&mut io) {
            probe::hit(Probe::StepWaitedForLoad);
            self.apply(&[ack]);
        }
    }

    /// Moves queued requests into the running batch while the device tier can hold them.
    fn admit(&mut self) -> Result<usize, EngineError> {
        let step_done = self.model.step_done();
        let weights = self.mutants.key_weights(self.weights);
        let mut res = Admission {
            ctl: &mut self.ctl,
            io: io!(self),
            step_done,
            weights,
        };
        self.sched.admit(&mut res)
    }

    /// Evicts up to `pages` device pages from the prefix cache now (unlocked nodes only, the write
    /// policy respected), e.g. to hand memory back. Returns how many were freed at once.
    pub fn evict_device(&mut self, pages: usize) -> Result<usize, EngineError> {
        let after = self.model.step_done();
        let (ctl, mut io) = self.split();
        let freed = ctl.evict_device(&mut io, pages, after)?;
        self.refresh_gauges();
        Ok(freed)
    }

    /// After the forward: acknowledge the loads it consumed, emit digests and tokens (discarding
    /// rows that read a failed load), and complete finished requests.
    fn finish_step(&mut self, rows: &[Row], digests: &[Vec<u64>]) -> Result<(), EngineError> {
        let mut failed: Vec<u64> = Vec::new();
        for row in rows {
            let Some(load) = self.sched.request(row.request).and_then(|r| r.load) else {
                continue;
            };
            let (ctl, mut io) = self.split();
            if let Some(ack) = ctl.ack(&mut io, load) {
                self.apply(&[ack]);
                if !ack.ok {
                    failed.push(row.request);
                }
            }
        }
        let done = self
            .sched
            .record_forward(rows, digests, &failed, &self.synth);
        self.metrics.generated_tokens += done.generated_tokens;
        self.metrics.prefill_tokens += done.prefill_tokens;
        while let Some(r) = self.sched.next_finished() {
            if self.role == Some(Role::Prefill) {
                self.exports.insert(r.id, r);
            } else {
                self.complete(r)?;
            }
        }
        Ok(())
    }

    /// A finished request: its full pages go into the prefix cache (backed up under
    /// write-through), the rest are freed, its locks released.
    fn complete(&mut self, r: Request) -> Result<(), EngineError> {
        let full = r.computed / PAGE_TOKENS as usize;
        let keys = self.prefix_keys(&r.tokens, full);
        let ins = self.cache.insert(&keys, &r.pages[..full]);
        probe::hit_if(Probe::FinishDuplicatePages, !ins.duplicates.is_empty());
        self.pools.device_pages.free(&ins.duplicates);
        self.pools
            .device_pages
            .free(&r.pages[full.max(r.owned_from)..]);
        self.cache.unlock(&r.locked);
        if self.cfg.cache.write_policy == WritePolicy::WriteThrough
            && self.mutants.write_through_backs_up()
        {
            if let Some(&last) = ins.nodes.last() {
                let after = self.model.step_done();
                let (ctl, mut io) = self.split();
                ctl.issue_backup(&mut io, last, after)?;
            }
        }
        self.metrics.requests_finished += 1;
        self.sched.emit(Output::Finished {
            request: r.id,
            generated: r.tokens[r.prompt_len..].to_vec(),
        });
        Ok(())
    }

    fn refresh_gauges(&mut self) {
        let m = &mut self.metrics;
        m.queue_depth = self.sched.queue_len() as u64;
        m.queued_tokens = self.sched.queued_tokens();
        m.running_requests = self.sched.running_len() as u64;
        m.device_pages_used = self.pools.device_pages.used_count() as u64;
        m.host_tokens_used = self.pools.host_pages.used_count() as u64 * PAGE_TOKENS as u64;
    }

    /// Checks the engine's invariants (each owner's, and page conservation across the tree, the
    /// requests and the loads in flight); panics on the first broken one.
    pub fn check_invariants(&self) {
        self.cache.check_invariants();
        self.ctl.check_invariants();
        self.sched.check_invariants();
        let owned = self.sched.owned_pages();
        let loading = self.ctl.loading_pages(self.mutants);
        let tree = self.cache.device_pages().len();
        let exported: usize = self
            .exports
            .values()
            .map(|r| r.pages.len() - r.owned_from)
            .sum();
        let held = self.import_held;
        let aborted = self.sched.detached_pages();
        let flying = |id| {
            self.in_flight
                .as_ref()
                .is_some_and(|f| f.rows.iter().any(|r| r.request == id))
        };
        for id in self.sched.detached_ids() {
            assert!(
                flying(id),
                "request {id} detached without a row in the step in flight"
            );
        }
        assert_eq!(
            self.pools.device_pages.used_count() as usize,
            tree + owned + loading + exported + held + aborted,
            "device pages in use = tree {tree} + requests {owned} + loading {loading} + \
             exported {exported} + held for transfers {held} + aborted in flight {aborted}"
        );
        assert_eq!(
            self.pools.host_pages.used_count() as usize,
            self.cache.host_pages().len(),
            "host pages in use = pages held by the tree"
        );
    }

    /// At quiescence every page, pin and lock is accounted for: nothing is locked or pinned, and
    /// the pools hold exactly what the tree holds. `Err` names what leaked.
    pub fn check_quiescent(&self) -> Result<(), String> {
        if !self.is_idle() {
            return Err(format!(
                "not idle: {} queued, {} running, {} loads, {} backups, {} exports, {} pages held for transfers",
                self.sched.queue_len(),
                self.sched.running_len(),
                self.ctl.loads_in_flight(),
                self.ctl.backups_in_flight(),
                self.exports.len(),
                self.import_held
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
        let used = self.pools.device_pages.used_count() as usize;
        let tree = self.cache.device_pages().len();
        if used != tree {
            return Err(format!("{used} device pages in use, the tree holds {tree}"));
        }
        let hused = self.pools.host_pages.used_count() as usize;
        let htree = self.cache.host_pages().len();
        if hused != htree {
            return Err(format!("{hused} host pages in use, the tree holds {htree}"));
        }
        Ok(())
    }
}

/// Admission's access to the memory, for the scheduler: the cache controller's reservation.
struct Admission<'a, D, C, T> {
    ctl: &'a mut CacheController,
    io: Io<'a, D, C, T>,
    step_done: EventId,
    /// The weights' version the prefix keys carry (`Engine::prefix_keys`).
    weights: u32,
}

impl<D: Device, C: Clock, T: Transfer> Reserve for Admission<'_, D, C, T> {
    fn reserve(
        &mut self,
        r: &Request,
        acks: &mut Vec<LoadAck>,
    ) -> Result<Option<Grant>, EngineError> {
        let keys = model_page_keys(&r.tokens, r.cacheable_pages(), self.weights);
        let total = pages_for_tokens((r.prompt_len + r.max_new as usize) as u64) as usize;
        self.ctl
            .reserve(&mut self.io, r.id, &keys, total, self.step_done, acks)
    }
}

#[cfg(test)]
mod tests;
