//! The simulator's own coverage probes (the engine's are `tierkv_engine::probe::Probe`), and the
//! coverage report of a campaign: per probe, its hits and the seeds that hit it.
//!
//! Both sets count in the engine's thread-local table, so one `take` after a run returns them
//! together; `all_names` lists every probe, so a probe never hit still shows in the report.

use std::collections::BTreeMap;
use tierkv_engine::probe::{hit_named, Probe};

/// A state of the simulated GPU or of the run's driver that a campaign must reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimProbe {
    /// A stream reached a wait whose record had not completed: it blocked.
    WaitBlocked,
    /// An event was recorded again while a stream still waited for its previous record.
    RecordWhileAwaited,
    /// An op started while another stream's op was running.
    StreamsOverlap,
    /// A host query found an event still pending.
    QueryPending,
    /// The schedule ended the op before a queried record now: the query answered Done early.
    QueryAnsweredEarly,
    /// The schedule had the host query a just-passed record before it saw it: Pending late.
    QueryAnsweredLate,
    /// The schedule had the host resume from a synchronize later than the record it waited for.
    SyncReturnedLate,
    /// The schedule had an arrival or abort reach the engine after the step it was due before.
    ArrivalDeferred,
    /// A record completed carrying a failed copy or launch.
    RecordFailed,
    /// A PCT change point demoted the highest-priority entity.
    PctChangePoint,
    /// Fault: a copy failed (garbage written, its event reports failure).
    FaultCopyFailed,
    /// Fault: a copy ran slow.
    FaultCopySlow,
    /// Fault: a page copy was refused at enqueue.
    FaultEnqueueFailed,
    /// Fault: the first pinned-host allocation failed.
    FaultHostAllocFailed,
    /// Fault: a kernel launch failed (the step's work is lost).
    FaultKernelFailed,
    /// Fault: a failed launch or copy left its stream in error (sticky) until the engine
    /// recovered the device.
    FaultSticky,
    /// The engine recovered a device whose stream was in error.
    FaultStickyRecovered,
    /// The engine recovered a side in error for the whole context: the context was recreated
    /// and the side's device memory lost.
    FaultContextRecreated,
    /// Fault: a failed or hung op left its whole side in error (CUDA's context-wide sticky
    /// errors).
    FaultContextInError,
    /// A call (event creation, record, wait, enqueue) failed because its side was in error.
    FaultCallInError,
    /// Fault: a kernel's enqueue was refused with out-of-memory (the call alone failed).
    FaultLaunchRefused,
    /// Fault: an op hung, and the watchdog gave up on it.
    FaultHung,
    /// Fault: a page copy became visible in two chunks.
    FaultCopyTorn,
    /// Fault: the host learned of a completed record later than it completed.
    FaultCompletionLate,
    /// Fault: the host learned of a record's completion before that of an earlier record of
    /// another stream (completions observed out of order).
    FaultCompletionReordered,
    /// Fault: a buffer allocation at the engine's construction failed (any tier, not the first).
    FaultAllocFailed,
    /// Faults stopped while the engine still had requests (the liveness phase has work).
    FaultsStoppedWithWork,
    /// A session ended because its next turn would not fit the context.
    SessionReachedContext,
    /// A client retried after its request was refused by admission control.
    ClientRetried,
    /// The operator's request to hand back device memory freed pages.
    EvictedOnDemand,
    /// A prefill/decode transfer's layers went over the simulated link out of layer order.
    PdLayersReordered,
    /// A prefill/decode link lost the notification of a send (`notify_loss_rate`).
    PdNotificationLost,
    /// One step ahead: a store drew a pending token from tokens a failed step left stale.
    StaleTokensDrawn,
    /// The runtime over the simulated driver: a stream-ordered allocation reused a buffer an
    /// earlier op of its stream freed.
    DriverScratchReused,
    /// The runtime over the simulated driver: a staging ring wrapped (a region was written
    /// below the previous one).
    DriverStagingWrapped,
    /// The runtime over the simulated driver: an argument went by a pageable copy.
    DriverPageableCopy,
    /// The runtime over the simulated driver: a host callback was dropped because its side was
    /// in error.
    DriverCallbackDropped,
    /// The runtime over the simulated driver: a launch failed inside a stream capture, so the
    /// capture made no graph.
    DriverCaptureDropped,
    /// The simulated driver's own fault: a synchronous allocation (a RoPE table) met out-of-memory.
    DriverRefusedAlloc,
    /// The simulated driver's own fault: a stream-ordered allocation that had to grow its pool met out-of-memory.
    DriverRefusedAllocAsync,
    /// The simulated driver's own fault: an asynchronous copy was refused.
    DriverRefusedCopyAsync,
    /// The simulated driver's own fault: a pitched copy (a page run) was refused.
    DriverRefusedCopy2d,
    /// The simulated driver's own fault: a copy from pageable memory was refused.
    DriverRefusedCopyPageable,
    /// The simulated driver's own fault: a kernel launch was refused.
    DriverRefusedLaunch,
    /// The simulated driver's own fault: an event's creation met out-of-memory.
    DriverRefusedEventCreate,
    /// The simulated driver's own fault: an event record was refused.
    DriverRefusedEventRecord,
    /// The simulated driver's own fault: a stream's wait for an event was refused.
    DriverRefusedStreamWait,
    /// The simulated driver's own fault: a host callback was refused.
    DriverRefusedHostCallback,
}

impl SimProbe {
    pub const ALL: &'static [SimProbe] = &[
        SimProbe::WaitBlocked,
        SimProbe::RecordWhileAwaited,
        SimProbe::StreamsOverlap,
        SimProbe::QueryPending,
        SimProbe::QueryAnsweredEarly,
        SimProbe::QueryAnsweredLate,
        SimProbe::SyncReturnedLate,
        SimProbe::ArrivalDeferred,
        SimProbe::RecordFailed,
        SimProbe::PctChangePoint,
        SimProbe::FaultCopyFailed,
        SimProbe::FaultCopySlow,
        SimProbe::FaultEnqueueFailed,
        SimProbe::FaultHostAllocFailed,
        SimProbe::FaultKernelFailed,
        SimProbe::FaultSticky,
        SimProbe::FaultStickyRecovered,
        SimProbe::FaultContextRecreated,
        SimProbe::FaultContextInError,
        SimProbe::FaultCallInError,
        SimProbe::FaultLaunchRefused,
        SimProbe::FaultHung,
        SimProbe::FaultCopyTorn,
        SimProbe::FaultCompletionLate,
        SimProbe::FaultCompletionReordered,
        SimProbe::FaultAllocFailed,
        SimProbe::FaultsStoppedWithWork,
        SimProbe::SessionReachedContext,
        SimProbe::ClientRetried,
        SimProbe::EvictedOnDemand,
        SimProbe::PdLayersReordered,
        SimProbe::PdNotificationLost,
        SimProbe::StaleTokensDrawn,
        SimProbe::DriverScratchReused,
        SimProbe::DriverStagingWrapped,
        SimProbe::DriverPageableCopy,
        SimProbe::DriverCallbackDropped,
        SimProbe::DriverCaptureDropped,
        SimProbe::DriverRefusedAlloc,
        SimProbe::DriverRefusedAllocAsync,
        SimProbe::DriverRefusedCopyAsync,
        SimProbe::DriverRefusedCopy2d,
        SimProbe::DriverRefusedCopyPageable,
        SimProbe::DriverRefusedLaunch,
        SimProbe::DriverRefusedEventCreate,
        SimProbe::DriverRefusedEventRecord,
        SimProbe::DriverRefusedStreamWait,
        SimProbe::DriverRefusedHostCallback,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SimProbe::WaitBlocked => "gpu.wait_blocked",
            SimProbe::RecordWhileAwaited => "gpu.record_while_awaited",
            SimProbe::StreamsOverlap => "gpu.streams_overlap",
            SimProbe::QueryPending => "gpu.query_pending",
            SimProbe::QueryAnsweredEarly => "sched.query_answered_early",
            SimProbe::QueryAnsweredLate => "sched.query_answered_late",
            SimProbe::SyncReturnedLate => "sched.sync_returned_late",
            SimProbe::ArrivalDeferred => "sched.arrival_deferred",
            SimProbe::RecordFailed => "gpu.record_reports_failure",
            SimProbe::PctChangePoint => "gpu.pct_change_point",
            SimProbe::FaultCopyFailed => "fault.copy_failed",
            SimProbe::FaultCopySlow => "fault.copy_slow",
            SimProbe::FaultEnqueueFailed => "fault.enqueue_failed",
            SimProbe::FaultHostAllocFailed => "fault.host_alloc_failed",
            SimProbe::FaultKernelFailed => "fault.kernel_failed",
            SimProbe::FaultSticky => "fault.sticky",
            SimProbe::FaultStickyRecovered => "fault.sticky_recovered",
            SimProbe::FaultContextRecreated => "fault.context_recreated",
            SimProbe::FaultContextInError => "fault.context_in_error",
            SimProbe::FaultCallInError => "fault.call_in_error",
            SimProbe::FaultLaunchRefused => "fault.launch_refused",
            SimProbe::FaultHung => "fault.hung",
            SimProbe::FaultCopyTorn => "fault.copy_torn",
            SimProbe::FaultCompletionLate => "fault.completion_late",
            SimProbe::FaultCompletionReordered => "fault.completion_reordered",
            SimProbe::FaultAllocFailed => "fault.alloc_failed",
            SimProbe::FaultsStoppedWithWork => "run.faults_stopped_with_work",
            SimProbe::SessionReachedContext => "run.session_reached_context",
            SimProbe::ClientRetried => "run.client_retried",
            SimProbe::EvictedOnDemand => "run.evicted_on_demand",
            SimProbe::PdLayersReordered => "pd.layers_reordered",
            SimProbe::PdNotificationLost => "pd.notification_lost",
            SimProbe::StaleTokensDrawn => "ahead.stale_tokens_drawn",
            SimProbe::DriverScratchReused => "driver.scratch_reused",
            SimProbe::DriverStagingWrapped => "driver.staging_wrapped",
            SimProbe::DriverPageableCopy => "driver.pageable_copy",
            SimProbe::DriverCallbackDropped => "driver.callback_dropped",
            SimProbe::DriverCaptureDropped => "driver.capture_dropped",
            SimProbe::DriverRefusedAlloc => "driver.refused_alloc",
            SimProbe::DriverRefusedAllocAsync => "driver.refused_alloc_async",
            SimProbe::DriverRefusedCopyAsync => "driver.refused_copy_async",
            SimProbe::DriverRefusedCopy2d => "driver.refused_copy_2d",
            SimProbe::DriverRefusedCopyPageable => "driver.refused_copy_pageable",
            SimProbe::DriverRefusedLaunch => "driver.refused_launch",
            SimProbe::DriverRefusedEventCreate => "driver.refused_event_create",
            SimProbe::DriverRefusedEventRecord => "driver.refused_event_record",
            SimProbe::DriverRefusedStreamWait => "driver.refused_stream_wait",
            SimProbe::DriverRefusedHostCallback => "driver.refused_host_callback",
        }
    }
}

/// Counts one hit of `p` on this thread.
pub fn hit(p: SimProbe) {
    hit_named(p.name());
}

/// Counts one hit of `p` when `cond` holds; returns `cond`.
pub fn hit_if(p: SimProbe, cond: bool) -> bool {
    if cond {
        hit(p);
    }
    cond
}

/// Every probe's name: the engine's, then the simulator's.
pub fn all_names() -> Vec<&'static str> {
    Probe::ALL
        .iter()
        .map(|p| p.name())
        .chain(SimProbe::ALL.iter().map(|p| p.name()))
        .collect()
}

/// A campaign's coverage: for each probe, its hits and the seeds that hit it.
#[derive(Clone, Debug, Default)]
pub struct Coverage {
    pub seeds: u64,
    /// Probe name → (hits, seeds that hit it at least once).
    pub probes: BTreeMap<&'static str, (u64, u64)>,
    /// A campaign of prefill/decode pairs: the `pd.` probes count (`names`).
    pub pd: bool,
}

impl Coverage {
    /// Adds one run's counts.
    pub fn add(&mut self, counts: &BTreeMap<&'static str, u64>) {
        self.seeds += 1;
        for (&name, &n) in counts {
            let e = self.probes.entry(name).or_default();
            e.0 += n;
            e.1 += (n > 0) as u64;
        }
    }

    /// The fraction of seeds that hit `name`.
    pub fn fraction(&self, name: &str) -> f64 {
        let seeds = self.probes.get(name).map_or(0, |e| e.1);
        seeds as f64 / self.seeds.max(1) as f64
    }

    /// The probes this campaign can reach: the prefill/decode probes (`pd.`) only in a campaign
    /// of pairs (`pd`), every other probe in every campaign.
    pub fn names(&self) -> Vec<&'static str> {
        all_names()
            .into_iter()
            .filter(|n| self.pd || !n.starts_with("pd."))
            .collect()
    }

    /// Probes below `fraction` of the seeds (never hit included), in report order.
    pub fn below(&self, fraction: f64) -> Vec<&'static str> {
        self.names()
            .into_iter()
            .filter(|n| self.fraction(n) < fraction)
            .collect()
    }

    /// The targets reached in fewer than 5% of the runs (`targets::rare`), each with the
    /// reason it is rare where one is known.
    pub fn rare(&self) -> String {
        use crate::targets::rare;
        rare::report(
            &rare::rare(&self.probes, self.seeds, &self.names()),
            self.seeds,
        )
    }

    /// The report: one line per probe, hits and the share of seeds, the cold ones marked; then
    /// the targets' (`targets::table`).
    pub fn table(&self) -> String {
        let mut out = format!("{:<40} {:>10} {:>8}\n", "probe", "hits", "seeds");
        for name in self.names() {
            let (hits, seeds) = self.probes.get(name).copied().unwrap_or((0, 0));
            let pct = 100.0 * seeds as f64 / self.seeds.max(1) as f64;
            let mark = if seeds == 0 {
                "  never"
            } else if pct < 5.0 {
                "  < 5%"
            } else {
                ""
            };
            out += &format!("{name:<40} {hits:>10} {pct:>7.1}%{mark}\n");
        }
        out + "\n" + &crate::targets::table(&self.probes, self.seeds)
    }
}
