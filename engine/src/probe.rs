//! Coverage probes: named states that a simulation campaign must reach, counted where the code
//! reaches them (FoundationDB's `CODE_PROBE`, TigerBeetle's coverage marks).
//!
//! A probe answers "did any seed ever get here?": a load that failed, a host eviction that had to
//! step around a pinned node, a request whose prompt was cached to the last page. The simulator
//! reads the counts after each run (`take`) and a campaign reports, per probe, its hits and the
//! fraction of seeds that hit it (`tierkv sim --coverage`); a test fails when the default test
//! campaign leaves a probe cold. Probes never change what the code does.
//!
//! Counts live in a thread-local table keyed by the probe's name, so the engine's probes
//! ([`Probe`]) and the simulator's own (`tierkv-sim`'s `SimProbe`) share one table and one
//! report. A run of the simulator is one thread; in production the engine thread counts too, at
//! the cost of one table update per probe hit.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

thread_local! {
    static HITS: RefCell<BTreeMap<&'static str, u64>> = const { RefCell::new(BTreeMap::new()) };
    /// Where this thread's run is: a count its driver advances (the simulator: the schedule
    /// decisions its run has made); 0 where nothing advances it, as in production.
    static POSITION: Cell<u64> = const { Cell::new(0) };
    /// The position of each probe's first hit since the last `take`.
    static FIRST: RefCell<BTreeMap<&'static str, u64>> = const { RefCell::new(BTreeMap::new()) };
}

/// Counts one hit of the probe named `name` on this thread.
pub fn hit_named(name: &'static str) {
    let first = HITS.with(|h| {
        let mut h = h.borrow_mut();
        let n = h.entry(name).or_default();
        *n += 1;
        *n == 1
    });
    if first {
        FIRST.with(|f| f.borrow_mut().insert(name, POSITION.get()));
    }
}

/// Sets this thread's position (see [`first_hits`]).
pub fn set_position(at: u64) {
    POSITION.set(at);
}

/// The position this thread was at when each probe hit since the last `take` was first hit
/// (the simulator's count of schedule decisions made then: the prefix of its schedule that
/// reached the probe). Call before [`take`], which empties this table too.
pub fn first_hits() -> BTreeMap<&'static str, u64> {
    FIRST.with(|f| f.borrow().clone())
}

/// How many levels a watermark has: the powers of two from 1 to 2^23.
pub const MARK_LEVELS: usize = 24;

macro_rules! watermarks {
    ($( $(#[doc = $doc:literal])* $name:ident = $text:literal, )*) => {
        /// A numeric watermark: a quantity whose highest values a campaign should reach (issue
        /// 33's "numeric watermarks"). A value is counted as probes of its own, one for each
        /// power of two up to it (`mark.NAME>=2^0`, `>=2^1`, `>=2^2`, …, the highest `>=2^23`:
        /// [`MARK_LEVELS`] levels), so a campaign's coverage says how many seeds reached each
        /// level and a guided campaign's corpus keeps a run that reached a rare one, as it does
        /// a rare probe.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Watermark {
            $( $(#[doc = $doc])* $name, )*
        }

        impl Watermark {
            pub const ALL: &'static [Watermark] = &[$(Watermark::$name),*];

            pub fn name(self) -> &'static str {
                match self {
                    $(Watermark::$name => $text,)*
                }
            }

            /// The probe name of level `k` (values of at least 2^k).
            pub fn level_name(self, k: usize) -> &'static str {
                match self {
                    $(Watermark::$name => watermarks!(@levels $text)[k],)*
                }
            }
        }
    };
    (@levels $text:literal) => {
        watermarks!(@levels $text; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23)
    };
    (@levels $text:literal; $($k:literal)*) => {
        [$(concat!("mark.", $text, ">=2^", $k)),*]
    };
}

watermarks! {
    /// Loads in flight when a request was aborted.
    LoadsInFlightAtAbort = "abort.loads_in_flight",
    /// Slots of the load ring held by other loads when a load claimed one.
    LoadRingHeld = "load.ring_held",
    /// Prompt tokens queued once a request was accepted (`scheduler.pending_tokens_max` bounds
    /// them).
    QueuedTokens = "intake.queued_tokens",
    /// Host pages one eviction of the host tier dropped.
    HostPagesEvictedAtOnce = "host.pages_evicted_at_once",
    /// Host pages free when a backup needed more and evicted host copies to make room (an
    /// eviction that dropped nothing is not counted).
    HostPagesFreeAtEviction = "host.pages_free_at_eviction",
    /// Ops enqueued, on every stream, between an event's record and a wait on it (a stream's
    /// wait or the host's synchronize): how stale an event the engine still waits on.
    OpsFromRecordToWait = "runtime.ops_from_record_to_wait",
}

/// Counts `value` of `w`: a hit of each of its levels up to `value` (none for 0).
pub fn watermark(w: Watermark, value: u64) {
    let levels = (u64::BITS - value.leading_zeros()) as usize;
    for k in 0..levels.min(MARK_LEVELS) {
        hit_named(w.level_name(k));
    }
}

/// Counts one hit of `p` on this thread.
pub fn hit(p: Probe) {
    hit_named(p.name());
}

/// Counts one hit of `p` when `cond` holds; returns `cond`.
pub fn hit_if(p: Probe, cond: bool) -> bool {
    if cond {
        hit(p);
    }
    cond
}

/// This thread's counts since the last `take`, by probe name; the table starts empty again.
pub fn take() -> BTreeMap<&'static str, u64> {
    FIRST.with(|f| f.borrow_mut().clear());
    POSITION.set(0);
    HITS.with(|h| std::mem::take(&mut *h.borrow_mut()))
}

macro_rules! probes {
    ($( $(#[doc = $doc:literal])* $name:ident = $text:literal, )*) => {
        /// The engine's coverage probes. Each name is `area.what`, as reports print it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Probe {
            $( $(#[doc = $doc])* $name, )*
        }

        impl Probe {
            pub const ALL: &'static [Probe] = &[$(Probe::$name),*];

            pub fn name(self) -> &'static str {
                match self {
                    $(Probe::$name => $text,)*
                }
            }
        }
    };
}

probes! {
    /// Intake refused a request that can never be served (empty, too long, bad token).
    RejectInvalid = "intake.reject_invalid",
    /// Intake refused a request: the queue holds `queued_requests_max` requests.
    RejectQueueFull = "intake.reject_queue_full",
    /// Intake refused a request: its prompt would take the queued tokens over
    /// `pending_tokens_max` (a burst of long prompts).
    RejectPendingTokens = "intake.reject_pending_tokens",
    /// A request asks for exactly the context limit (prompt + generation = `context_tokens_max`).
    RequestFillsContext = "intake.request_fills_context",
    /// Admission stopped at `running_requests_max`.
    AdmitRunningFull = "admit.running_full",
    /// Admission stopped: the device tier could not make room for the queue's head.
    AdmitNoPages = "admit.no_device_pages",
    /// A request's cached prefix covers every page it can reuse (only its last partial page, or
    /// its last token, is computed).
    AdmitWholePromptCached = "admit.whole_prompt_cached",
    /// A fully cached prompt that ends exactly on a page boundary: its whole last page is
    /// recomputed.
    AdmitCachedToPageBoundary = "admit.cached_prompt_on_page_boundary",
    /// Part of a request's prefix is cached on the device only.
    AdmitDevicePrefix = "admit.device_prefix",
    /// Part of a request's prefix is on the host only: a load-back.
    AdmitHostPrefix = "admit.host_prefix",
    /// A request's page table is as wide as the context allows.
    PageTableFull = "admit.page_table_full",
    /// A prefill was cut to the step's prefill budget (chunked prefill).
    BatchPrefillChunked = "batch.prefill_chunked",
    /// A requeued request recomputed tokens it had generated, in a chunk like its prompt's.
    BatchRecomputesGenerated = "batch.recomputes_generated",
    /// A batch mixes prefill and decode rows.
    BatchMixed = "batch.mixed",
    /// A query's context is no longer than `index_topk`: the selection takes every token.
    TopkCoversContext = "indexer.topk_covers_context",
    /// A query's context is longer than `index_topk`: the selection really selects.
    TopkSelects = "indexer.topk_selects",
    /// A request generated `output_tokens_max` tokens.
    FinishAtOutputMax = "finish.at_output_max",
    /// A finished request's pages were already in the tree (another request inserted them).
    FinishDuplicatePages = "finish.duplicate_pages",
    /// A load-back (host → device) was issued.
    LoadIssued = "load.issued",
    /// A load's copy failed: nothing was published.
    LoadFailed = "load.failed",
    /// A load's copy could not even be enqueued.
    LoadEnqueueFailed = "load.enqueue_failed",
    /// A request recomputes the tokens of a failed load.
    LoadRecomputed = "load.recomputed",
    /// The load ring was full: a new load waited for the slot's previous load.
    LoadRingFull = "load.ring_full",
    /// A load whose request was aborted was acknowledged.
    LoadOrphanAcked = "load.orphan_acked",
    /// A step with nothing to compute waited for the oldest load.
    StepWaitedForLoad = "step.waited_for_load",
    /// A step with nothing to compute waited for the oldest backup.
    StepWaitedForBackup = "step.waited_for_backup",
    /// The device reported that a step's work failed.
    StepDeviceFailed = "step.device_failed",
    /// The engine cleared a device fault it had seen (a failed step, load or backup).
    DeviceRecovered = "device.recovered",
    /// Recovering the device recreated its context (`Device::context_generation` moved): the
    /// engine dropped the device tier and requeued its running requests.
    DeviceContextRecreated = "device.context_recreated",
    /// A step's context was recreated by a recovery while it was enqueued: the rest of its ops
    /// were not enqueued (they would read what the recreation lost).
    StepCutByRecreation = "step.cut_by_recreation",
    /// A running request went back to the head of the queue to recompute its KV (its context was
    /// recreated under it).
    RequestRequeued = "request.requeued",
    /// A device call (an event's creation, record or wait, an op's enqueue) failed transiently
    /// and was made again after recovering the device (`device::call_recovering`).
    DeviceCallRepeated = "device.call_repeated",
    /// A device took `check_op`'s verdict on an op from an op of the same key it checked
    /// before (`device::memo::CheckMemo`: another layer of the same step).
    DeviceCheckRemembered = "device.check_remembered",
    /// A page allocation was refused by an injected fault (`EngineFaults`), device tier.
    FaultDevicePagesRefused = "fault.device_pages_refused",
    /// A page allocation was refused by an injected fault, host tier.
    FaultHostPagesRefused = "fault.host_pages_refused",
    /// A backup (device → host) was issued.
    BackupIssued = "backup.issued",
    /// A backup's copy failed: the nodes stay device-only.
    BackupFailed = "backup.failed",
    /// A backup's copy could not be enqueued.
    BackupEnqueueFailed = "backup.enqueue_failed",
    /// A backup waited for an ancestor's backup in flight.
    BackupDeferred = "backup.deferred",
    /// A deferred backup was retried.
    BackupRetried = "backup.retried",
    /// The host tier could not make room for a backup: skipped.
    BackupHostFull = "backup.host_full",
    /// Selective write-through backed up a prefix on its second hit.
    BackupSelective = "backup.selective",
    /// Host pages were evicted to make room for a backup.
    HostEvicted = "host.evicted",
    /// The model's weights changed (`Engine::update_weights`).
    WeightsUpdated = "model.weights_updated",
    /// Host eviction stepped around a node whose host copy is pinned by a load in flight.
    HostEvictSkippedPinned = "host.evict_skipped_pinned",
    /// Device pages were evicted.
    DeviceEvicted = "device.evicted",
    /// A write-back eviction waits for its backup before the page is freed.
    DeviceWriteBackPending = "device.write_back_pending",
    /// A write-back eviction was cancelled (its backup could not be issued).
    DeviceWriteBackCancelled = "device.write_back_cancelled",
    /// After a cancelled write-back, device pages were dropped instead.
    DeviceWriteBackDropped = "device.write_back_dropped",
    /// A page copy of a host tier in page-first layout with a bf16 index-K.
    CopyPageFirstBf16 = "copy.page_first_bf16_index_k",
    /// A page copy of a host tier in layer-first layout.
    CopyLayerFirst = "copy.layer_first",
    /// A queued request was aborted.
    AbortQueued = "abort.queued",
    /// A running request was aborted.
    AbortRunning = "abort.running",
    /// A request was aborted while its load was in flight.
    AbortMidLoad = "abort.mid_load",
    /// A request was aborted while a backup was in flight.
    AbortMidBackup = "abort.mid_backup",
    /// Prefill/decode: a transferred request joined the decode engine.
    PdAdmitted = "pd.admitted",
    /// Prefill/decode: a transfer waited, the decode side full (running set or device pages).
    PdDecodeFull = "pd.decode_full",
    /// Prefill/decode: a transfer's events reported a failed copy; it is sent again.
    PdTransferFailed = "pd.transfer_failed",
    /// Prefill/decode: the link refused to enqueue a copy of a transfer.
    PdTransferRefused = "pd.transfer_refused",
    /// Prefill/decode: decode admitted a request whose send had not reported completion yet
    /// (the prefill side keeps its pages until it does).
    PdSendDraining = "pd.send_draining",
    /// Prefill/decode: a request was aborted after its prefill, before decode admitted it.
    PdAbortInTransfer = "pd.abort_in_transfer",
    /// Prefill/decode: every layer of a transfer arrived before the link's notification that
    /// the send was over (`KvLink::notified`); decode waits for it.
    PdNotificationAwaited = "pd.notification_awaited",
    /// Prefill/decode: a transfer's notification did not come by its deadline; it counts as
    /// failed.
    PdNotificationTimedOut = "pd.notification_timed_out",
    /// Prefill/decode: a side's context was recreated (its device memory lost); the pair
    /// dropped what its transfers held there (`PdPair::after_recreations`).
    PdContextRecreated = "pd.context_recreated",
    /// Prefill/decode: a prefill export lost its KV with its side's context and went back to
    /// the queue to recompute it.
    PdExportRequeued = "pd.export_requeued",
    /// Prefill/decode: an engine saw its context recreated before the pair handled it; it waits
    /// for the pair (`Engine::drop_device_tier`) and ends its step early.
    PdRecreationDeferred = "pd.recreation_deferred",
    /// One step ahead: a step was enqueued while the step before it was still in flight.
    AheadStep = "ahead.step",
    /// One step ahead: a row's token is pending (the step in flight generates it on the device).
    AheadPendingToken = "ahead.pending_token",
    /// One step ahead: a request whose row in flight reads a load waited for that step's results.
    AheadWaitsForLoad = "ahead.waits_for_load",
    /// One step ahead: a request was aborted with a row in flight; the row's results were dropped.
    AheadRowOfAborted = "ahead.row_of_aborted",
    /// One step ahead: a row built on a row whose load failed since was discarded (the request
    /// recomputes from its recorded state).
    AheadRowStale = "ahead.row_stale",
    /// One step ahead: the step before failed, so the step built on it was discarded as well.
    AheadDiscarded = "ahead.discarded",
    /// The runtime (`runtime::driven`): a stream-ordered allocation met out of memory, and was
    /// made again after a context synchronisation and a trim of the driver's pool.
    RuntimePoolTrimmed = "runtime.pool_trimmed",
    /// The runtime: an array the ops of a step shared was freed on its stream (nobody held it
    /// any more, or a recovery forgot every upload).
    RuntimeSharedRetired = "runtime.shared_retired",
    /// The runtime: a stream's output allocation was too small for an op's outputs and was
    /// replaced by a larger one.
    RuntimeOutputsGrown = "runtime.outputs_grown",
    /// The runtime: drawn rows whose pending tokens an earlier op of the step resolved in their
    /// shared upload were not resolved again.
    RuntimeResolvedOnce = "runtime.resolved_once",
    /// The runtime, graphs on: an op's launches were captured into a graph, which was launched.
    RuntimeGraphCaptured = "runtime.graph_captured",
    /// The runtime, graphs on: an op equal to one captured before launched that graph again.
    RuntimeGraphReplayed = "runtime.graph_replayed",
    /// The runtime, graphs on: a graph was destroyed because an allocation it names was freed.
    RuntimeGraphForgotten = "runtime.graph_forgotten",
    /// The runtime: a page copy failed after some of its runs were queued; the stream ran them
    /// out before the error returned, so nothing of the failed call is still queued.
    RuntimePartialCopyDrained = "runtime.partial_copy_drained",
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_take_resets() {
        let mut names: Vec<&str> = Probe::ALL.iter().map(|p| p.name()).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "two probes share a name");
        take();
        hit(Probe::LoadIssued);
        hit(Probe::LoadIssued);
        assert!(!hit_if(Probe::LoadFailed, false));
        let counts = take();
        assert_eq!(counts.get("load.issued"), Some(&2));
        assert_eq!(counts.get("load.failed"), None);
        assert!(take().is_empty());
    }

    #[test]
    fn a_watermark_hits_every_level_up_to_its_value() {
        take();
        watermark(Watermark::LoadRingHeld, 0);
        assert!(take().is_empty(), "0 reaches no level");
        watermark(Watermark::LoadRingHeld, 5);
        watermark(Watermark::LoadRingHeld, 1);
        let counts = take();
        assert_eq!(counts.get("mark.load.ring_held>=2^0"), Some(&2));
        assert_eq!(counts.get("mark.load.ring_held>=2^1"), Some(&1));
        assert_eq!(counts.get("mark.load.ring_held>=2^2"), Some(&1));
        assert_eq!(counts.get("mark.load.ring_held>=2^3"), None);
        for &w in Watermark::ALL {
            for k in 0..MARK_LEVELS {
                assert_eq!(w.level_name(k), format!("mark.{}>=2^{k}", w.name()));
            }
        }
        watermark(Watermark::QueuedTokens, u64::MAX);
        assert_eq!(take().len(), MARK_LEVELS, "at most 2^{}", MARK_LEVELS - 1);
    }

    /// `first_hits` holds the position each probe was at when first hit since the last
    /// `take`, and `take` empties it and the position.
    #[test]
    fn first_hits_keep_the_position_of_each_first_hit() {
        take();
        set_position(5);
        hit(Probe::LoadIssued);
        set_position(9);
        hit(Probe::LoadIssued);
        hit(Probe::LoadFailed);
        let first = first_hits();
        assert_eq!(first.get("load.issued"), Some(&5));
        assert_eq!(first.get("load.failed"), Some(&9));
        assert_eq!(first.len(), 2);
        take();
        assert!(first_hits().is_empty());
        hit(Probe::LoadFailed);
        assert_eq!(
            first_hits().get("load.failed"),
            Some(&0),
            "take resets the position"
        );
        take();
    }
}
