//! The bug zoo's switches (DESIGN §7): each re-creates a real incident inside the engine, so the
//! simulator can prove it catches it. They exist only with the `mutants` feature, which production
//! builds never enable; without it [`Mutants::on`] is a constant `false` and every mutant branch
//! compiles away. Production code never names a mutant: it calls a named point of [`Mutants`]
//! (`Mutants::index_topk`, `Mutants::host_layout`, ...), which is the identity on the clean engine.

use crate::config::WritePolicy;
use crate::layout::{slot, IndexKDtype, KvDtype, Layout, PageId};

/// The `index_topk` of mutant 9, which ignores the configured one.
pub const HARDCODED_TOPK: u32 = 512;

/// A named re-creation of an incident. The doc comment of each variant cites it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mutant {
    /// 1. Host index-K layout taken from fp8 defaults (132 B/token) while the device pool is bf16
    ///    (256 B/token), and the copy uses one item size for both sides (DESIGN §1 incident 1).
    HostIndexKFromFp8Defaults,
    /// 2. A layer wait missing on the index-K read path (upstream sglang #22811).
    UngatedIndexKRead,
    /// 3. Index-K not mirrored on backup (upstream sglang #17085).
    IndexKNotMirrored,
    /// 4. Host MLA row sized 576 B (unpacked fp8) while the device packs 656 B (upstream #37534).
    HostKvRow576,
    /// 5. Re-entrant host eviction frees host pages an in-flight load still reads (upstream #27631).
    EvictionIgnoresLoadPins,
    /// 6. A loaded node published before its copy finished (upstream #8901).
    PublishBeforeCopy,
    /// 7. The layer counter indexed by global layer id while the engine serves a layer range that
    ///    starts above 0, as a pipeline stage does (upstream #39876).
    GlobalLayerCounter,
    /// 8. The page-indexed index-K buffer addressed by token slot (upstream #31218).
    IndexKAddressedBySlot,
    /// 9. `index_topk` read but ignored, 512 hard-coded (DESIGN §1 incident 3).
    TopkHardcoded512,
    /// 10. The store kernel writes the fp8 page layout whatever the pool dtype (DESIGN §1 incident 4).
    StoreIgnoresPoolDtype,
    /// 11. The ring of load slots reused before a slot's finish event.
    LoadSlotReusedEarly,
    /// 12. A new-token index-K write lands on a page with an outstanding host → device copy: an
    ///     aborted request's load pages go back to the allocator before the load's finish event.
    WriteOnLoadingPage,
    /// 13. No admission control: an unbounded request queue (fixed upstream by admission control).
    NoAdmissionControl,
    /// 14. Prefill/decode: a prefill aborted before its prompt was computed is still published to
    ///     decode, which generates from an incomplete KV cache (sglang #30233).
    PdPublishesAbortedPrefill,
    /// 15. Prefill/decode: the prefill side releases a request's pages when the send is issued,
    ///     not when it completed, so later requests overwrite KV still in flight and output
    ///     degrades request by request (sglang #23020).
    PdFreesBeforeSend,
    /// 16. Prefill/decode: the transfer assumes the other side's layer layout and lands each
    ///     layer's pages one layer off on the decode side (TensorRT-LLM #6507).
    PdLayerLayoutMismatch,
    /// 17. Prefill/decode: decode admits a request when its first layer's receive completed, and
    ///     reads the other layers before theirs did.
    PdAdmitsBeforeEveryLayer,
    /// 18. One step ahead: every step's digests come back through one pinned readback buffer,
    ///     so the step enqueued next overwrites the digests the host is still reading (the
    ///     double-buffered output of an overlap scheduler, single-buffered).
    OverlapOneReadback,
    /// 19. Policy: admission passes over a queued request that does not fit and admits the ones
    ///     behind it, where the documented policy is FIFO with head-of-line blocking (every
    ///     output stays correct; only the order of service changes).
    AdmissionPassesBlocked,
    /// 20. Policy: every prefilling request of a step takes the whole prefill budget
    ///     (`scheduler.prefill_tokens_per_step_max`) instead of sharing it, so a step computes
    ///     more prompt tokens than the configuration allows (every output stays correct).
    PrefillBudgetPerRequest,
    /// 21. Policy: device eviction takes the most recently used candidate first (the order of
    ///     the LRU list read from the wrong end).
    DeviceEvictsNewest,
    /// 22. Policy: host eviction takes the most recently used host copy first.
    HostEvictsNewest,
    /// 23. Policy: write-through never backs up a finished request's pages (the host tier stays
    ///     empty; every later hit is a device hit or a recompute).
    WriteThroughSkipsBackup,
    /// 24. Policy: selective write-through backs a prefix up on its first hit, not its second.
    SelectiveOnFirstHit,
    /// 25. Policy: write-back drops an evicted page that has no host copy instead of backing it
    ///     up first (write-through's eviction under the write-back policy).
    WriteBackDropsUnbacked,
    /// 26. Policy: the device prefix-hit counter counts the loaded pages too.
    DeviceHitCountsLoads,
    /// 27. Policy: the host prefix-hit counter counts requests that loaded, not pages.
    HostHitPerRequest,
    /// 28. Field (vllm-project/vllm#47282, a load overwrites blocks a running step still
    ///     reads): one step ahead, an aborted request's pages go back to the allocator at once
    ///     although the step in flight still reads them, so a load issued next may copy into
    ///     them while that step runs.
    AbortFreesPagesInFlight,
    /// 29. Field (sgl-project/sglang#30057, KV restored without its indexer pages):
    ///     a load from the host tier copies each layer's KV pages but not its index-K pages, so
    ///     the indexer scores the loaded prefix from whatever its device pages held before.
    LoadSkipsIndexK,
    /// 30. Field (deepseek-ai/FlashMLA#184, fp32 scales pushed through the ue8m0 path): the
    ///     index-K store rounds each token's fp8 scale up to a power of two whatever the model's
    ///     `scale_fmt`, so a model with fp32 scales stores keys its indexer's specification does
    ///     not hold.
    StoreScalesThroughUe8m0,
    /// 31. Runtime: a staging ring's region is written again without waiting for the copy
    ///     still queued out of it (a pinned slot rewritten before its upload ran).
    StagingReusedEarly,
    /// 32. Runtime (LMCache/LMCache#2916's review: staged on one stream, read on another): an
    ///     op's stream-ordered scratch is freed on another stream than the one whose kernels
    ///     read it, with no event, so that stream's next allocation reuses it while they run.
    ScratchFreedOnOtherStream,
    /// 33. Runtime: the completion callback of a load-stream event is queued on the compute
    ///     stream, so the completion ring acknowledges the load when the compute stream reaches
    ///     it, whether or not the load's copies ran.
    CallbackOnComputeStream,
    /// 34. Runtime: large arguments go through a pinned host buffer the runtime keeps for
    ///     speed, so their copy is asynchronous; the runtime still writes the buffer again for
    ///     the next large argument at once, as if the driver had taken the bytes before the
    ///     call returned (what it does for pageable memory), while the earlier copy from it is
    ///     still queued.
    PageableBufferReused,
    /// 35. Field (vllm-project/vllm#50558: received blocks matched to local ones by count, not
    ///     position), prefill/decode: the decode side reserves more pages than the prefill side
    ///     sends (room for the tokens it will generate), and the transfer fills the last of them
    ///     instead of the first, so the request's first pages are read as if they held the
    ///     prompt's KV.
    PdReceivesIntoLastPages,
    /// 36. Field (vllm-project/vllm#50576): the writer stores an fp8 index-K page
    ///     block-planar (every value, then every scale) and the reader reads it
    ///     token-interleaved (each token's values, then its scale): the same bytes a page, so
    ///     no size or layout-fingerprint check can fire. The reader is `index_logits`'s
    ///     reference (`Mutant::kernel`: the kernels' `LogitsReadsInterleaved`).
    IndexKReadInterleaved,
    /// 37. Field (vllm-project/vllm#55221: a cache's storage dtype handed on where its compute
    ///     dtype was meant): the sparse read of a packed-fp8 KV pool is handed the dtype its
    ///     rows are computed in (bf16), not the one they are stored in.
    SparseReadComputeDtype,
    /// 38. Field (LMCache/LMCache#4286: a load reported successful before its transfer ran):
    ///     a load's success is decided when it is issued, so a load whose copy failed in
    ///     flight or could not be enqueued is acknowledged as done and its pages published.
    LoadOkAtIssue,
    /// 39. Field (vllm-project/vllm#52234: a receive that fails open, a stale reference into
    ///     reused blocks; vllm#55900 defers a failed receive's report until the transfers
    ///     beside it finished), prefill/decode: a transfer is given up as soon as one of its
    ///     events answers `Failed` (or a copy of it was refused), and its pages go back (the
    ///     decode side's at once, the prefill side's when the request ends) while the other
    ///     layers' copies of that failed attempt still read and write them.
    PdRetryBeforeStaleCopies,
    /// 40. Field (kvcache-ai/Mooncake#850: an object evicted during a slow read, its lease
    ///     expired): a load holds its host copies from eviction by a lease of fixed length
    ///     ([`HOST_LEASE_NS`]) instead of until its copy ended, so the host tier may evict
    ///     and reuse a host page that a slow load still reads.
    HostLeaseExpires,
    /// 41. Field (vllm-project/vllm#50754, sgl-project/sglang#36108: the decode side waits
    ///     forever for a transfer notification that was lost), prefill/decode: the decode side
    ///     waits for a send's notification with no deadline.
    PdNoNotificationDeadline,
    /// 42. Field (vLLM's offloading spec, `vllm/v1/kv_offload/spec.py`: block hashes that
    ///     ignore the model's weights): prefix keys leave the weights' version out, so after a
    ///     weight update a request matches KV its prefix had under the old weights.
    PrefixKeysIgnoreWeights,
    /// 43. Runtime: after a fault sticky for the whole context (CUDA's asynchronous errors),
    ///     recovering recreates the context and its device memory is lost, but the engine keeps
    ///     its prefix cache's device pages and its running requests' KV as if they survived
    ///     (it acknowledges the new context generation and carries on).
    RecreationKeepsDeviceTier,
    /// 44. Runtime, prefill/decode: after a side's context was recreated, a transfer in flight
    ///     whose every receive event answered `Done` is admitted as arrived, though its copies
    ///     may have read the prefill side's memory after it was lost (the clean pair ends every
    ///     transfer in flight and sends it again).
    PdAdmitsAcrossRecreation,
    /// 45. Runtime: an event taken back into a pool while another stream still waits on it.
    ///     The controller puts a load's layer events into its pool of free events (the one its
    ///     backups record on the write stream) as soon as their records are queued, while they
    ///     stay the load ring slot's events. A backup issued before the compute stream's wait on
    ///     a layer is queued records that event again on the write stream, and CUDA's wait takes
    ///     the event's latest record: the compute stream then waits for the backup, not for the
    ///     load, and reads the layer while its copy may still run.
    LoadEventPooledAtIssue,
    /// 46. Runtime, CUDA graphs: a recovery frees the uploads and output allocations the
    ///     compute stream's graphs name, but keeps the graphs. When the step is run again, an
    ///     op equal to one captured before the fault names new allocations that took the freed
    ///     ones' ids and offsets, and replays the kept graph, which runs on the freed memory
    ///     (a graph replayed over buffers freed since its capture: the class of vLLM's and
    ///     PyTorch's CUDA-graph pools, where a captured graph keeps the addresses of its
    ///     capture).
    GraphsKeptOnRecovery,
}

/// The lease of mutant 40: how long a load's host copies are kept from eviction (simulated
/// nanoseconds from the load's issue).
pub const HOST_LEASE_NS: u64 = 20_000;

impl Mutant {
    pub const ALL: [Mutant; 46] = [
        Mutant::HostIndexKFromFp8Defaults,
        Mutant::UngatedIndexKRead,
        Mutant::IndexKNotMirrored,
        Mutant::HostKvRow576,
        Mutant::EvictionIgnoresLoadPins,
        Mutant::PublishBeforeCopy,
        Mutant::GlobalLayerCounter,
        Mutant::IndexKAddressedBySlot,
        Mutant::TopkHardcoded512,
        Mutant::StoreIgnoresPoolDtype,
        Mutant::LoadSlotReusedEarly,
        Mutant::WriteOnLoadingPage,
        Mutant::NoAdmissionControl,
        Mutant::PdPublishesAbortedPrefill,
        Mutant::PdFreesBeforeSend,
        Mutant::PdLayerLayoutMismatch,
        Mutant::PdAdmitsBeforeEveryLayer,
        Mutant::OverlapOneReadback,
        Mutant::AdmissionPassesBlocked,
        Mutant::PrefillBudgetPerRequest,
        Mutant::DeviceEvictsNewest,
        Mutant::HostEvictsNewest,
        Mutant::WriteThroughSkipsBackup,
        Mutant::SelectiveOnFirstHit,
        Mutant::WriteBackDropsUnbacked,
        Mutant::DeviceHitCountsLoads,
        Mutant::HostHitPerRequest,
        Mutant::AbortFreesPagesInFlight,
        Mutant::LoadSkipsIndexK,
        Mutant::StoreScalesThroughUe8m0,
        Mutant::StagingReusedEarly,
        Mutant::ScratchFreedOnOtherStream,
        Mutant::CallbackOnComputeStream,
        Mutant::PageableBufferReused,
        Mutant::PdReceivesIntoLastPages,
        Mutant::IndexKReadInterleaved,
        Mutant::SparseReadComputeDtype,
        Mutant::LoadOkAtIssue,
        Mutant::PdRetryBeforeStaleCopies,
        Mutant::HostLeaseExpires,
        Mutant::PdNoNotificationDeadline,
        Mutant::PrefixKeysIgnoreWeights,
        Mutant::RecreationKeepsDeviceTier,
        Mutant::PdAdmitsAcrossRecreation,
        Mutant::LoadEventPooledAtIssue,
        Mutant::GraphsKeptOnRecovery,
    ];
    /// The mutants of prefill/decode disaggregation: they act only in a prefill/decode pair, so
    /// the zoo runs them under the `pd` profile.
    pub fn is_pd(self) -> bool {
        matches!(
            self,
            Mutant::PdPublishesAbortedPrefill
                | Mutant::PdFreesBeforeSend
                | Mutant::PdLayerLayoutMismatch
                | Mutant::PdAdmitsBeforeEveryLayer
                | Mutant::PdReceivesIntoLastPages
                | Mutant::PdRetryBeforeStaleCopies
                | Mutant::PdNoNotificationDeadline
                | Mutant::PdAdmitsAcrossRecreation
        )
    }
    /// The mutants of the production runtime below the `Device` trait (`runtime::driven`): they
    /// act only where the engine runs on that runtime, which in the simulator is every drawn
    /// single-engine seed on the CPU executor (not a prefill/decode pair, not `--device cuda`,
    /// not a scenario whose `gpu.runtime_staging_bytes` is 0).
    pub fn is_runtime(self) -> bool {
        matches!(
            self,
            Mutant::StagingReusedEarly
                | Mutant::ScratchFreedOnOtherStream
                | Mutant::CallbackOnComputeStream
                | Mutant::PageableBufferReused
                | Mutant::GraphsKeptOnRecovery
        )
    }
    /// The mutants of an engine that runs one step ahead: the simulator switches the overlap
    /// on for them.
    pub fn needs_overlap(self) -> bool {
        matches!(
            self,
            Mutant::OverlapOneReadback | Mutant::AbortFreesPagesInFlight
        )
    }
    pub fn name(self) -> &'static str {
        match self {
            Mutant::HostIndexKFromFp8Defaults => "host-index-k-fp8-defaults",
            Mutant::UngatedIndexKRead => "ungated-index-k-read",
            Mutant::IndexKNotMirrored => "index-k-not-mirrored",
            Mutant::HostKvRow576 => "host-kv-row-576",
            Mutant::EvictionIgnoresLoadPins => "eviction-ignores-load-pins",
            Mutant::PublishBeforeCopy => "publish-before-copy",
            Mutant::GlobalLayerCounter => "global-layer-counter",
            Mutant::IndexKAddressedBySlot => "index-k-addressed-by-slot",
            Mutant::TopkHardcoded512 => "topk-hardcoded-512",
            Mutant::StoreIgnoresPoolDtype => "store-ignores-pool-dtype",
            Mutant::LoadSlotReusedEarly => "load-slot-reused-early",
            Mutant::WriteOnLoadingPage => "write-on-loading-page",
            Mutant::NoAdmissionControl => "no-admission-control",
            Mutant::PdPublishesAbortedPrefill => "pd-publishes-aborted-prefill",
            Mutant::PdFreesBeforeSend => "pd-frees-before-send",
            Mutant::PdLayerLayoutMismatch => "pd-layer-layout-mismatch",
            Mutant::PdAdmitsBeforeEveryLayer => "pd-admits-before-every-layer",
            Mutant::OverlapOneReadback => "overlap-one-readback",
            Mutant::AdmissionPassesBlocked => "admission-passes-blocked",
            Mutant::PrefillBudgetPerRequest => "prefill-budget-per-request",
            Mutant::DeviceEvictsNewest => "device-evicts-newest",
            Mutant::HostEvictsNewest => "host-evicts-newest",
            Mutant::WriteThroughSkipsBackup => "write-through-skips-backup",
            Mutant::SelectiveOnFirstHit => "selective-on-first-hit",
            Mutant::WriteBackDropsUnbacked => "write-back-drops-unbacked",
            Mutant::DeviceHitCountsLoads => "device-hit-counts-loads",
            Mutant::HostHitPerRequest => "host-hit-per-request",
            Mutant::AbortFreesPagesInFlight => "abort-frees-pages-in-flight",
            Mutant::LoadSkipsIndexK => "load-skips-index-k",
            Mutant::StoreScalesThroughUe8m0 => "store-scales-through-ue8m0",
            Mutant::StagingReusedEarly => "staging-reused-early",
            Mutant::ScratchFreedOnOtherStream => "scratch-freed-on-other-stream",
            Mutant::CallbackOnComputeStream => "callback-on-compute-stream",
            Mutant::PageableBufferReused => "pageable-buffer-reused",
            Mutant::PdReceivesIntoLastPages => "pd-receives-into-last-pages",
            Mutant::IndexKReadInterleaved => "index-k-read-interleaved",
            Mutant::SparseReadComputeDtype => "sparse-read-compute-dtype",
            Mutant::LoadOkAtIssue => "load-ok-at-issue",
            Mutant::PdRetryBeforeStaleCopies => "pd-retry-before-stale-copies",
            Mutant::HostLeaseExpires => "host-lease-expires",
            Mutant::PdNoNotificationDeadline => "pd-no-notification-deadline",
            Mutant::PrefixKeysIgnoreWeights => "prefix-keys-ignore-weights",
            Mutant::RecreationKeepsDeviceTier => "recreation-keeps-device-tier",
            Mutant::PdAdmitsAcrossRecreation => "pd-admits-across-recreation",
            Mutant::LoadEventPooledAtIssue => "load-event-pooled-at-issue",
            Mutant::GraphsKeptOnRecovery => "graphs-kept-on-recovery",
        }
    }
    pub fn incident(self) -> &'static str {
        match self {
            Mutant::HostIndexKFromFp8Defaults => "DESIGN §1.1 (bf16 index-K vs fp8 host mirror)",
            Mutant::UngatedIndexKRead => "sglang #22811",
            Mutant::IndexKNotMirrored => "sglang #17085",
            Mutant::HostKvRow576 => "sgl-project/sglang#37534",
            Mutant::EvictionIgnoresLoadPins => "#27631",
            Mutant::PublishBeforeCopy => "#8901",
            Mutant::GlobalLayerCounter => "#39876",
            Mutant::IndexKAddressedBySlot => "#31218",
            Mutant::TopkHardcoded512 => "DESIGN §1.3 (index_topk ignored)",
            Mutant::StoreIgnoresPoolDtype => "DESIGN §1.4 (store kernel ignores pool dtype)",
            Mutant::LoadSlotReusedEarly => "load ring reuse",
            Mutant::WriteOnLoadingPage => "write on a page being loaded",
            Mutant::NoAdmissionControl => "unbounded request queue",
            Mutant::PdPublishesAbortedPrefill => "sglang #30233",
            Mutant::PdFreesBeforeSend => "sglang #23020",
            Mutant::PdLayerLayoutMismatch => "TensorRT-LLM #6507",
            Mutant::PdAdmitsBeforeEveryLayer => "decode reads a layer before its receive",
            Mutant::OverlapOneReadback => "overlap scheduler's output buffer reused",
            Mutant::AdmissionPassesBlocked => "policy: admission order (FIFO, head of line)",
            Mutant::PrefillBudgetPerRequest => "policy: the step's prefill token budget",
            Mutant::DeviceEvictsNewest => "policy: device eviction order (LRU)",
            Mutant::HostEvictsNewest => "policy: host eviction order (LRU)",
            Mutant::WriteThroughSkipsBackup => "policy: write-through's trigger",
            Mutant::SelectiveOnFirstHit => "policy: selective write-through's trigger",
            Mutant::WriteBackDropsUnbacked => "policy: write-back's trigger",
            Mutant::DeviceHitCountsLoads => "policy: the device prefix-hit counter",
            Mutant::HostHitPerRequest => "policy: the host prefix-hit counter",
            Mutant::AbortFreesPagesInFlight => "vllm-project/vllm#47282",
            Mutant::LoadSkipsIndexK => "sgl-project/sglang#30057",
            Mutant::StoreScalesThroughUe8m0 => "deepseek-ai/FlashMLA#184",
            Mutant::StagingReusedEarly => "runtime: a staging slot rewritten before its upload ran",
            Mutant::ScratchFreedOnOtherStream => "LMCache/LMCache#2916 (review)",
            Mutant::CallbackOnComputeStream => "runtime: a callback acknowledges a load early",
            Mutant::PageableBufferReused => {
                "runtime: a pinned host buffer reused as if its copy were pageable"
            }
            Mutant::PdReceivesIntoLastPages => "vllm-project/vllm#50558",
            Mutant::IndexKReadInterleaved => "vllm-project/vllm#50576",
            Mutant::SparseReadComputeDtype => "vllm-project/vllm#55221",
            Mutant::LoadOkAtIssue => "LMCache/LMCache#4286",
            Mutant::PdRetryBeforeStaleCopies => "vllm-project/vllm#52234",
            Mutant::HostLeaseExpires => "kvcache-ai/Mooncake#850",
            Mutant::PdNoNotificationDeadline => "vllm-project/vllm#50754",
            Mutant::PrefixKeysIgnoreWeights => "vllm-project/vllm: vllm/v1/kv_offload/spec.py",
            Mutant::RecreationKeepsDeviceTier => {
                "runtime: device memory taken as kept across a context recreation"
            }
            Mutant::PdAdmitsAcrossRecreation => {
                "runtime: a transfer taken as arrived across its sender's recreated context"
            }
            Mutant::LoadEventPooledAtIssue => {
                "runtime: an event back in its pool while another stream still waits on it"
            }
            Mutant::GraphsKeptOnRecovery => {
                "runtime: CUDA graphs replayed over buffers freed since their capture"
            }
        }
    }
    /// The mechanism of an incident of another serving stack (the field zoo), in one line:
    /// `None` for the incidents tierkv was designed against, its policies and its runtime.
    /// Mutant 4 is both: planted with the seed incidents, it is also the field's sglang#37534.
    pub fn field_mechanism(self) -> Option<&'static str> {
        Some(match self {
            Mutant::HostKvRow576 => {
                "the host mirror's KV row sized from a constant (576 B), not the device's packed fp8 row (656 B)"
            }
            Mutant::AbortFreesPagesInFlight => {
                "an aborted request's pages freed while the step in flight still reads them; a load copies into them"
            }
            Mutant::LoadSkipsIndexK => {
                "a load restores the KV pages without their index-K pages"
            }
            Mutant::StoreScalesThroughUe8m0 => {
                "fp32 scales rounded to powers of two (the ue8m0 path) by the index-K store"
            }
            Mutant::PdReceivesIntoLastPages => {
                "the decode side holds more pages than were sent; the transfer fills the last ones, the first are read"
            }
            Mutant::IndexKReadInterleaved => {
                "index-K written block-planar, read token-interleaved: the same bytes, so no check fires"
            }
            Mutant::SparseReadComputeDtype => {
                "the sparse read of a packed-fp8 KV pool handed the compute dtype (bf16), not the storage one"
            }
            Mutant::LoadOkAtIssue => {
                "a load's success decided when it is issued: a failed copy's pages are published"
            }
            Mutant::PdRetryBeforeStaleCopies => {
                "a failed transfer given up at its first failure: its pages reused under its other copies"
            }
            Mutant::HostLeaseExpires => {
                "a load's host copies kept from eviction by a 20 us lease, not until the copy ended"
            }
            Mutant::PdNoNotificationDeadline => {
                "the decode side waits for a lost transfer notification with no deadline"
            }
            Mutant::PrefixKeysIgnoreWeights => {
                "prefix keys ignore the weights: after an update, KV of the old weights is matched"
            }
            _ => return None,
        })
    }
    /// The bug of the kernels' references this mutant plants (its mistake is in a kernel, not
    /// in the engine); the simulator switches it on for the run.
    pub fn kernel(self) -> Option<tierkv_kernels::mutants::KernelMutant> {
        match self {
            Mutant::IndexKReadInterleaved => {
                Some(tierkv_kernels::mutants::KernelMutant::LogitsReadsInterleaved)
            }
            _ => None,
        }
    }
    pub fn parse(s: &str) -> Option<Mutant> {
        Mutant::ALL.into_iter().find(|m| m.name() == s)
    }
}

/// Which mutant (if any) this engine runs with. Without the `mutants` feature this is an empty
/// value: every point below is a constant, and each mutant branch compiles away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutants {
    #[cfg(feature = "mutants")]
    active: Option<Mutant>,
}

impl Mutants {
    /// The clean engine.
    pub fn none() -> Self {
        Self::default()
    }
    /// An engine with one mutant switched on.
    #[cfg(feature = "mutants")]
    pub fn only(m: Mutant) -> Self {
        Mutants { active: Some(m) }
    }
    pub fn active(&self) -> Option<Mutant> {
        #[cfg(feature = "mutants")]
        return self.active;
        #[cfg(not(feature = "mutants"))]
        None
    }
    #[inline(always)]
    pub fn on(&self, m: Mutant) -> bool {
        #[cfg(feature = "mutants")]
        return self.active == Some(m);
        #[cfg(not(feature = "mutants"))]
        {
            let _ = m;
            false
        }
    }
}

/// The named points where mutants act. Each is the identity (or `false`) on the clean engine;
/// production code calls the point, never a mutant's name.
impl Mutants {
    /// Mutants 1 and 4: the layout the host mirror is built from. Clean: the device's layout.
    pub fn host_layout(&self, device: Layout) -> Layout {
        let mut p = device.params();
        if self.on(Mutant::HostIndexKFromFp8Defaults) {
            p.index_k_dtype = IndexKDtype::Fp8;
        }
        if self.on(Mutant::HostKvRow576) && p.kv_dtype == KvDtype::Fp8Packed {
            p.kv_dtype = KvDtype::Fp8Unpacked;
        }
        if p == device.params() {
            return device;
        }
        Layout::new(p).expect("a mirror with smaller rows than a valid layout fits")
    }
    /// Mutants 1 and 4: the copy trusts the source's item size for the destination too.
    pub fn copy_trusts_source_size(&self) -> bool {
        self.on(Mutant::HostIndexKFromFp8Defaults) || self.on(Mutant::HostKvRow576)
    }
    /// Mutant 28: an aborted request with a row in the step in flight frees its pages at once,
    /// not when that step is recorded.
    pub fn abort_frees_in_flight_pages(&self) -> bool {
        self.on(Mutant::AbortFreesPagesInFlight)
    }
    /// Mutant 31: whether the staging ring waits for the copy out of a region before writing it
    /// again. Clean: it does.
    pub fn staging_waits(&self) -> bool {
        !self.on(Mutant::StagingReusedEarly)
    }
    /// Mutant 32: the stream an op's stream-ordered scratch is freed on. Clean: `s`, the stream
    /// of the kernels that read it.
    pub fn scratch_free_stream(&self, s: crate::device::StreamKind) -> crate::device::StreamKind {
        use crate::device::StreamKind;
        match (self.on(Mutant::ScratchFreedOnOtherStream), s) {
            (false, s) => s,
            (true, StreamKind::Compute) => StreamKind::Write,
            (true, _) => StreamKind::Compute,
        }
    }
    /// Mutant 33: the stream a load-stream event's completion callback is queued on. Clean: `s`,
    /// the event's own stream.
    pub fn callback_stream(&self, s: crate::device::StreamKind) -> crate::device::StreamKind {
        if self.on(Mutant::CallbackOnComputeStream) {
            crate::device::StreamKind::Compute
        } else {
            s
        }
    }
    /// Mutant 34: large arguments are copied from a pinned host buffer the runtime reuses at
    /// once. Clean: `false`, a copy from pageable memory (the driver takes the bytes before
    /// it returns).
    pub fn pageable_is_pinned(&self) -> bool {
        self.on(Mutant::PageableBufferReused)
    }
    /// Mutant 35: the decode pages a transfer of `sent` pages fills, of the `reserved` pages
    /// (at least `sent`) the decode side holds for the request. Clean: the first `sent`.
    pub fn pd_received_pages<'a>(&self, reserved: &'a [PageId], sent: usize) -> &'a [PageId] {
        assert!(
            sent <= reserved.len(),
            "a transfer of {sent} pages into {} reserved",
            reserved.len()
        );
        if self.on(Mutant::PdReceivesIntoLastPages) {
            &reserved[reserved.len() - sent..]
        } else {
            &reserved[..sent]
        }
    }
    /// Mutant 37: the dtype a sparse read of a KV pool of `pool` is handed. Clean: `pool`.
    pub fn sparse_read_dtype(&self, pool: KvDtype) -> KvDtype {
        if self.on(Mutant::SparseReadComputeDtype) {
            KvDtype::Bf16
        } else {
            pool
        }
    }
    /// Mutant 43: a recreated context's loss of device memory is ignored.
    pub fn recreation_keeps_device_tier(&self) -> bool {
        self.on(Mutant::RecreationKeepsDeviceTier)
    }
    /// Mutant 38: whether a load is taken as successful whatever its copy did. Clean: `false`,
    /// success is read from the copy's events when the load is acknowledged.
    pub fn load_ok_at_issue(&self) -> bool {
        self.on(Mutant::LoadOkAtIssue)
    }
    /// Mutant 39: whether a failed transfer's decode pages go back as soon as one of its
    /// events answers `Failed`. Clean: `false`, only once none of its events is pending.
    pub fn pd_gives_up_at_first_failure(&self) -> bool {
        self.on(Mutant::PdRetryBeforeStaleCopies)
    }
    /// Mutant 40: how long after its issue a load keeps its host copies from eviction. Clean:
    /// `None`, until the load is acknowledged.
    pub fn host_lease_ns(&self) -> Option<u64> {
        self.on(Mutant::HostLeaseExpires).then_some(HOST_LEASE_NS)
    }
    /// Mutant 41: how long after a send the decode side waits for its notification. Clean:
    /// `deadline` (the pair's); the mutant: forever (`None`).
    pub fn pd_notification_deadline_ns(&self, deadline: u64) -> Option<u64> {
        (!self.on(Mutant::PdNoNotificationDeadline)).then_some(deadline)
    }
    /// Mutant 44: whether a transfer in flight over a recreated context is admitted when its
    /// receive events answered `Done`. Clean: `false`, every one ends and is sent again.
    pub fn pd_admits_across_recreation(&self) -> bool {
        self.on(Mutant::PdAdmitsAcrossRecreation)
    }
    /// Mutant 42: the weights' version the prefix keys carry. Clean: `version`.
    pub fn key_weights(&self, version: u32) -> u32 {
        if self.on(Mutant::PrefixKeysIgnoreWeights) {
            0
        } else {
            version
        }
    }
    /// Mutant 2: the index-K read path skips the layer's load wait.
    pub fn index_k_read_ungated(&self) -> bool {
        self.on(Mutant::UngatedIndexKRead)
    }
    /// Mutant 3: a backup copies the KV pages only.
    pub fn backup_skips_index_k(&self) -> bool {
        self.on(Mutant::IndexKNotMirrored)
    }
    /// Mutant 30: whether the index-K store rounds its scales to powers of two. Clean: as the
    /// model's `scale_fmt` says (`ue8m0`).
    pub fn store_ue8m0(&self, ue8m0: bool) -> bool {
        ue8m0 || self.on(Mutant::StoreScalesThroughUe8m0)
    }
    /// Mutant 29: a load skips the index-K pages.
    pub fn load_skips_index_k(&self) -> bool {
        self.on(Mutant::LoadSkipsIndexK)
    }
    /// Mutant 5: host eviction takes host copies that a load still reads.
    pub fn host_eviction_ignores_pins(&self) -> bool {
        self.on(Mutant::EvictionIgnoresLoadPins)
    }
    /// Mutant 6: a load publishes its pages when it is issued, not when its copy finished.
    pub fn load_publishes_at_issue(&self) -> bool {
        self.on(Mutant::PublishBeforeCopy)
    }
    /// Mutant 7: the layer whose load event the gate waits for (the global id instead of the
    /// local one). Clean: `local`.
    pub fn gate_layer_index(&self, local: usize, layer_base: u32) -> usize {
        if self.on(Mutant::GlobalLayerCounter) {
            local + layer_base as usize
        } else {
            local
        }
    }
    /// Mutant 8: the page-table entry the indexer kernels get for `page` (its first token slot
    /// instead of the page id). Clean: the page id.
    pub fn page_table_entry(&self, page: PageId) -> i32 {
        if self.on(Mutant::IndexKAddressedBySlot) {
            slot(page, 0).kernel()
        } else {
            page.0 as i32
        }
    }
    /// Mutant 9: the `index_topk` the model step uses. Clean: the configured one.
    pub fn index_topk(&self, configured: u32) -> u32 {
        if self.on(Mutant::TopkHardcoded512) {
            HARDCODED_TOPK
        } else {
            configured
        }
    }
    /// Mutant 10: the page format the store kernel writes. Clean: the pool's.
    pub fn store_dtype(&self, pool: IndexKDtype) -> IndexKDtype {
        if self.on(Mutant::StoreIgnoresPoolDtype) {
            IndexKDtype::Fp8
        } else {
            pool
        }
    }
    /// Mutant 11: a load slot is reused without waiting for its previous load's finish event.
    pub fn slot_reused_without_wait(&self) -> bool {
        self.on(Mutant::LoadSlotReusedEarly)
    }
    /// Mutant 45: a load's layer events go into the pool of free events once their records are
    /// queued.
    pub fn load_events_pooled_at_issue(&self) -> bool {
        self.on(Mutant::LoadEventPooledAtIssue)
    }
    /// Mutant 46: whether the graphs that name an allocation being freed are kept. Clean:
    /// never; the mutant keeps them when the free is a recovery's (`recovering`).
    pub fn graphs_kept(&self, recovering: bool) -> bool {
        recovering && self.on(Mutant::GraphsKeptOnRecovery)
    }
    /// Mutants 7 and 11: a load may be acknowledged before its copy finished (its layer waits
    /// were skipped, or its slot reclaimed without waiting). The clean engine never does.
    pub fn acks_may_precede_copy(&self) -> bool {
        self.on(Mutant::GlobalLayerCounter) || self.on(Mutant::LoadSlotReusedEarly)
    }
    /// Mutant 12: aborting a request frees its in-flight load's pages at once.
    pub fn abort_frees_load_pages(&self) -> bool {
        self.on(Mutant::WriteOnLoadingPage)
    }
    /// Mutant 19: admission passes over a request that does not fit.
    pub fn admission_passes_blocked(&self) -> bool {
        self.on(Mutant::AdmissionPassesBlocked)
    }
    /// Mutant 20: the prefill budget left for the next request of a step (clean: what is left
    /// after `used`).
    pub fn prefill_budget_left(&self, budget: usize, used: usize) -> usize {
        if self.on(Mutant::PrefillBudgetPerRequest) {
            budget
        } else {
            budget - used
        }
    }
    /// Mutant 21: device eviction reads its LRU order from the newest end.
    pub fn device_eviction_newest_first(&self) -> bool {
        self.on(Mutant::DeviceEvictsNewest)
    }
    /// Mutant 22: host eviction reads its LRU order from the newest end.
    pub fn host_eviction_newest_first(&self) -> bool {
        self.on(Mutant::HostEvictsNewest)
    }
    /// Mutant 23: whether write-through backs up a finished request's pages (clean: yes).
    pub fn write_through_backs_up(&self) -> bool {
        !self.on(Mutant::WriteThroughSkipsBackup)
    }
    /// Mutant 24: the hits at which selective write-through backs a prefix up (clean: 2).
    pub fn selective_hits(&self) -> u32 {
        if self.on(Mutant::SelectiveOnFirstHit) {
            1
        } else {
            2
        }
    }
    /// Mutant 25: the policy device eviction applies (clean: the configured one).
    pub fn eviction_policy(&self, policy: WritePolicy) -> WritePolicy {
        if self.on(Mutant::WriteBackDropsUnbacked) && policy == WritePolicy::WriteBack {
            WritePolicy::WriteThrough
        } else {
            policy
        }
    }
    /// Mutants 26 and 27: the device and host prefix-hit counts of an admission with `device`
    /// cached pages on the device and `host` loaded (clean: those numbers).
    pub fn prefix_hits(&self, device: usize, host: usize) -> (u64, u64) {
        let dev = if self.on(Mutant::DeviceHitCountsLoads) {
            device + host
        } else {
            device
        };
        let host = if self.on(Mutant::HostHitPerRequest) {
            (host > 0) as usize
        } else {
            host
        };
        (dev as u64, host as u64)
    }
    /// Mutant 13: intake queues whatever arrives.
    pub fn no_admission_control(&self) -> bool {
        self.on(Mutant::NoAdmissionControl)
    }
    /// Mutant 14: an aborted prefill is published to decode as if its prompt were computed.
    pub fn pd_publishes_aborted(&self) -> bool {
        self.on(Mutant::PdPublishesAbortedPrefill)
    }
    /// Mutant 15: the prefill side releases a request's pages when its send is issued.
    pub fn pd_frees_before_send(&self) -> bool {
        self.on(Mutant::PdFreesBeforeSend)
    }
    /// Mutant 16: the decode-side layer a transfer writes prefill's layer `local` to, of
    /// `layers`. Clean: `local`.
    pub fn pd_decode_layer(&self, local: usize, layers: usize) -> usize {
        if self.on(Mutant::PdLayerLayoutMismatch) {
            (local + 1) % layers
        } else {
            local
        }
    }
    /// Mutant 17: how many of a transfer's per-layer receive events decode waits for before it
    /// admits the request, of `layers`. Clean: all.
    pub fn pd_layers_awaited(&self, layers: usize) -> usize {
        if self.on(Mutant::PdAdmitsBeforeEveryLayer) {
            1
        } else {
            layers
        }
    }
    /// Mutant 18: every step reads its digests back through the first readback buffer.
    pub fn overlap_one_readback(&self) -> bool {
        self.on(Mutant::OverlapOneReadback)
    }
}

#[cfg(test)]
mod tests;
