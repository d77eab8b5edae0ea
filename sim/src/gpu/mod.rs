//! The simulated GPU: the engine's `Device`, with real bytes, three streams and events, run by a
//! discrete-event executor in virtual time.
//!
//! What it guarantees is exactly what CUDA guarantees: ops of one stream run in order; across
//! streams only events order them (a wait waits for the event's most recent record at the time of
//! the wait call; an event never recorded is complete). Everything else is chosen: how long an op
//! that could start is held, whether a host query inside a jitter's window answers early or late,
//! when a load-stream callback runs and when a host blocked in `synchronize` resumes are the
//! schedule's decisions (see `schedule`); how long
//! an op runs (latency and bandwidth models, slow copies) and whether it fails, hangs or tears are
//! drawn with the scenario's rates for the call's identity (`timing.rs`). An op's data effect —
//! its reads and its writes — happens at its completion, so an op that a missing wait leaves
//! unordered really reads stale bytes in the schedules where it completes first.
//!
//! Checks made here: the race detector at every enqueue and host access; the layout check of
//! every op at enqueue (buffer descriptors never change after allocation, so it is not made
//! again when the op runs); the content oracle on the index-K rows an `index_logits` reads and
//! the KV rows a `sparse_read` reads, as the op runs (`oracles/content.rs` says what it skips);
//! the undeclared-write check around every op, and the undeclared-read probe on a sample of
//! them (CPU executor only).

mod exec;
mod streams;
mod timing;
mod trace;

use exec::{Executor, PageMarks};
use timing::*;
pub use trace::{entity_name, op_detail, Mark, Slice, TraceLog};

use crate::fasthash::FastMap;
use crate::oracles::content::ContentOracle;
use crate::probes::{self, SimProbe};
use crate::race::{join, Accessor, Race, RaceDetector, Vc, HOST};
use crate::report::{Finding, OracleKind};
use crate::schedule::{self, Decider, Hold, Kind, Source};
use crate::undeclared;
use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::rc::Rc;
use tierkv_engine::cpu_device::{
    run_index_logits_from_pages, run_op, run_sparse_read_hashed, Memory,
};
use tierkv_engine::device::*;
use tierkv_engine::layout::IndexKDtype;
use tierkv_engine::layout::{Bytes, PageId, PageRun};
use tierkv_kernels::cpu::{row_hash, KeyBlock, PageKeys};

/// Timing and fault model of the simulated GPU.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// Where the scheduling decisions come from (`schedule`).
    pub schedule: Source,
    /// The op starts PCT spreads its change points over when its policy does not know them.
    pub ops_guess: u64,
    /// Host cost of one API call (launch overhead), ns.
    pub launch_ns: u64,
    /// Kernel time model: fixed cost plus bytes touched / rate.
    pub kernel_ns: u64,
    pub kernel_bytes_per_ns: f64,
    /// Copy time model (PCIe): latency plus bytes / bandwidth.
    pub copy_latency_ns: u64,
    pub copy_bytes_per_ns: f64,
    /// The scheduler's unit of hold (a hold decision `d` holds a ready op `d / 4` of it) and
    /// the width of a query's windows (`schedule::Kind::QueryEarly`, `QueryLate`), ns.
    pub jitter_ns: u64,
    /// Probability that a copy is slow, and how much slower.
    pub slow_copy_rate: f64,
    pub slow_copy_factor: u64,
    /// Probability that a copy fails (writes garbage, its next event reports `Failed`).
    pub failed_copy_rate: f64,
    /// Probability that a page copy is refused at enqueue (the backend's error, as a launch
    /// that fails before it is queued); the engine must treat it as a failed transfer.
    pub failed_enqueue_rate: f64,
    /// Probability that a kernel launch fails at run time: the kernel and the compute stream's
    /// work after it up to the stream's next record do not run (their outputs keep stale
    /// bytes), and that record reports the failure — a launch error as the host sees it at its
    /// next synchronisation. Without `sticky_faults` the error then clears by itself.
    pub failed_kernel_rate: f64,
    /// A failed launch or copy leaves its stream in error until the engine calls
    /// `Device::recover`: the stream skips every op (a skipped copy leaves its destination rows
    /// stale, so they count as garbage) and every record on it reports `Failed`. A per-stream,
    /// recoverable model of CUDA's sticky errors (in CUDA one poisons the whole context for
    /// good, which the production device reports as a failed `recover`: `recover_fails`).
    pub sticky_faults: bool,
    /// `Device::recover` fails (the device is lost): the engine must stop with a typed error.
    pub recover_fails: bool,
    /// A fault is sticky for the whole device, as CUDA's asynchronous errors are for a context:
    /// a failed launch or copy leaves every stream of its side in error, and every call (an
    /// event's creation, record or wait, an op's enqueue) fails with `DeviceError::InError`
    /// until `Device::recover`, which with `recreate_context` recreates the side's context (its
    /// device memory lost) and otherwise clears the error in place.
    pub context_faults: bool,
    /// Recovering a side in error for the whole context (`context_faults`, a hang) recreates
    /// its context, as CUDA must: every device buffer the side allocated holds garbage
    /// afterwards (its pages count as garbage for the content oracle), pinned host buffers keep
    /// their bytes, and `Device::context_generation` moves on. Off, the side keeps its memory
    /// (kinder than CUDA).
    pub recreate_context: bool,
    /// Probability that a kernel's enqueue is refused with out-of-memory: a failure of the call
    /// alone, nothing is enqueued and the device stays usable. (The production device reports a
    /// failed launch as `DeviceError::Kernel` instead, which the engine does not repeat: this
    /// models what a runtime with stream-ordered argument allocations would meet.)
    pub refused_launch_rate: f64,
    /// Probability that an op hangs: it does not finish until the device's watchdog gives up on
    /// it (`WATCHDOG_NS` after it started); then it has failed and its side is in error, as
    /// with `context_faults` (a hung kernel cannot be cancelled in place), whatever the other
    /// options say.
    pub hang_rate: f64,
    /// Probability that a page copy of two or more pages runs as two ops on its stream, the
    /// first half of its pages first: each half can fail or be skipped on its own, leaving the
    /// destination half written. (A read that could see the midpoint is unordered with the copy,
    /// which the race detector reports anyway.)
    pub torn_copy_rate: f64,
    /// The longest delay between a load-stream record's completion and its host callback, ns
    /// (0: at once). The production runtime queues a host callback after a record on the load
    /// stream (when the event's ring slot is free), which signals the completion ring; the
    /// simulated driver (`driver.rs`) runs it when the schedule's callback decision says, in
    /// order (CUDA runs a stream's callbacks in order) but late against the other streams'
    /// completions, which the host can observe first. A record whose slot's previous callback
    /// has not run gets no ticket: `query` asks the driver. `synchronize` stays exact, as
    /// `cuEventSynchronize` is; `query` answers by the clock except inside a jitter's windows,
    /// where the schedule decides (`schedule::Kind`). (Engines on the simulated GPU directly
    /// have no callbacks: the delay only orders the `observed` probe.)
    pub completion_delay_ns: u64,
    /// Probability that a call of the simulated driver (`driver.rs`) is refused by a fault of
    /// its own, once the engine is built (`SimGpu::arm_driver_faults`): allocations and event
    /// creations with out-of-memory, copies, launches, records, waits and host callbacks with
    /// the driver's error. An allocation that takes new memory from the device meets
    /// out-of-memory twenty times as often (a synchronous one forty times; `driver.rs`), at
    /// most one call in four. Each draw is
    /// keyed by the call's kind, its stream and its number among the calls of that kind on
    /// that stream.
    pub driver_fault_rate: f64,
    /// Fail the first pinned-host allocation (the runner retries the engine's construction).
    pub fail_first_host_alloc: bool,
    /// The buffer allocation, counted from 1, that fails with out-of-memory (pool, mirror or
    /// scratch; the runner retries the engine's construction); 0: none.
    pub fail_alloc_nth: u32,
    /// Record every op as a trace slice.
    pub trace: bool,
    /// Run the ops' data effects on a real GPU instead of the CPU references.
    pub cuda: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            schedule: Source::default(),
            ops_guess: 10_000,
            launch_ns: 3_000,
            kernel_ns: 4_000,
            kernel_bytes_per_ns: 2_000.0,
            copy_latency_ns: 8_000,
            copy_bytes_per_ns: 25.0,
            jitter_ns: 20_000,
            slow_copy_rate: 0.0,
            slow_copy_factor: 20,
            failed_copy_rate: 0.0,
            failed_enqueue_rate: 0.0,
            failed_kernel_rate: 0.0,
            sticky_faults: false,
            recover_fails: false,
            context_faults: false,
            recreate_context: true,
            refused_launch_rate: 0.0,
            hang_rate: 0.0,
            driver_fault_rate: 0.0,
            torn_copy_rate: 0.0,
            completion_delay_ns: 0,
            fail_first_host_alloc: false,
            fail_alloc_nth: 0,
            trace: false,
            cuda: false,
        }
    }
}

/// Streams of the simulated GPU: three per side. Side 0 is the engine's (a pair's prefill
/// engine), side 1 a prefill/decode pair's decode engine ([`SimSide`]): two GPUs of one executor,
/// one host, one race detector and one content oracle.
pub const STREAMS: usize = 6;
const _: () = assert!(
    STREAMS == schedule::STREAMS as usize,
    "a hold decision can name every stream"
);

/// How long the simulated device's watchdog lets an op run before it gives up on it
/// (`GpuOptions::hang_rate`), ns of virtual time: a second, far above any op the timing model
/// draws (a slow copy of a whole layer's pages takes milliseconds), so only a hung op meets it.
pub const WATCHDOG_NS: u64 = 1_000_000_000;

/// A stream's index: its side's three, then its kind.
pub fn stream_index(side: usize, kind: StreamKind) -> usize {
    side * 3 + kind.index()
}

/// Where a launch of the simulated driver (`driver.rs`) takes its by-value arrays from on the
/// device, and what else it reads there: at its completion the op takes each array from its
/// range, so the kernel computes with what the uploads left there, as a CUDA kernel does.
#[derive(Clone, Debug, Default)]
pub struct LaunchArgs {
    /// Device ranges the kernel reads besides the op's own (uploaded arrays, the drawn inputs
    /// and RoPE rows of the launches fused into it).
    pub reads: Vec<ByteRange>,
    /// Device ranges the launches fused into it write (drawn inputs, RoPE rows, uploaded rows
    /// whose pending tokens they resolve): declared by the op, which runs right after them on
    /// their stream. Its CPU reference computes what they hold instead of reading them.
    pub writes: Vec<ByteRange>,
    /// The op's arrays, each read from a range at completion.
    pub patches: Vec<(ArgField, ByteRange)>,
}

/// An array of an op that a launch reads from the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgField {
    /// A store's slots (`i32`).
    Slots,
    /// `index_logits`' or `topk`'s page table (`i32`).
    PageTable,
    /// `index_logits`' or `topk`'s context lengths (`i32`).
    ContextLens,
    /// The drawn rows (token, position) of a store or `q_prep`.
    Rows,
}

#[derive(Clone, Debug)]
struct OpRec {
    id: u64,
    op: Op,
    /// A launch's device arguments (`None`: the op carries all its arguments).
    args: Option<Box<LaunchArgs>>,
    fail: bool,
    /// It hangs: it ends only when the watchdog gives up on it (`fail` too).
    hung: bool,
    duration: u64,
    enq_ns: u64,
    /// Its key on its stream (`push_op`): what its keyed draws are drawn for.
    key: u64,
}

#[derive(Clone, Debug)]
enum Entry {
    Op(Box<OpRec>),
    /// Waits for record `rec` (None: the event was never recorded, a no-op).
    Wait(Option<u64>),
    Record(u64),
}

#[derive(Clone, Debug, Default)]
struct StreamState {
    queue: VecDeque<Entry>,
    /// The op running now, with its start and end times.
    running: Option<(Box<OpRec>, u64, u64)>,
    /// When the stream finished its last entry.
    ready_at: u64,
    /// A failed op since the last record on this stream.
    failed_since_record: bool,
    /// A kernel launch failed since the last record: the stream's ops do not run until it.
    skipping: bool,
    /// A fault left the stream in error (`GpuOptions::sticky_faults`): it skips every op and
    /// fails every record until the engine recovers the device.
    sticky: bool,
    /// While `sticky`: the failed event by which the host saw it (a query or synchronize that
    /// answered `Failed`). An op enqueued on the stream after that, before `recover`, is a
    /// finding (`OracleKind::Recovery`).
    failure_seen: Option<EventId>,
    /// When the host callback of the stream's latest completed record runs (in order).
    last_seen: u64,
    /// Enqueue calls made for the stream: each call's number keys its fault draws
    /// (`FaultModel::keyed`), and those of the ops it pushes.
    calls: u64,
    /// Race-detector clock of the stream's enqueue point.
    vc: Vc,
    /// The last op and the last record this stream finished: both finish in enqueue order.
    last_op: Option<u64>,
    last_record: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
struct RecordState {
    /// The stream it was recorded on.
    stream: usize,
    /// A record of one of the engine's events (not of the runtime's own, `internal_events`):
    /// the record log counts it, and a failure it reports is one the host saw.
    counted: bool,
    done_at: Option<u64>,
    /// When its host callback runs (load-stream records, `completion_delay_ns`).
    seen_at: Option<u64>,
    failed: bool,
    vc: Vc,
}

/// What each stream's records reported, in order, and where page copies were refused: the
/// simulator's own count of the engine's transfers and steps (`oracles::metrics`).
#[derive(Clone, Debug, Default)]
pub struct RecordLog {
    /// Per stream, whether each completed record reported a failure.
    pub failed: [Vec<bool>; STREAMS],
    /// Per stream, how many records the host had made when each refusal happened.
    pub refused_after: [Vec<u64>; STREAMS],
    /// Per stream, records made by the host.
    pub made: [u64; STREAMS],
    /// Per stream, bytes the page copies the host asked for write (refused ones too).
    pub copy_bytes: [u64; STREAMS],
}

/// Counters of a run.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuStats {
    pub ops: u64,
    pub events: u64,
    pub copy_bytes: u64,
    pub failed_copies: u64,
    pub failed_kernels: u64,
}

pub struct SimGpu {
    pub mem: Memory,
    opts: GpuOptions,
    streams: [StreamState; STREAMS],
    /// The side whose streams the device calls address now (`SimSide` sets it per call).
    side: usize,
    /// Latest record of each event.
    events: Vec<Option<u64>>,
    /// Events the runtime over the simulated driver made for itself (staging copies, host
    /// callbacks, stream synchronisation), not the engine's.
    internal_events: std::collections::BTreeSet<EventId>,
    records: BTreeMap<u64, RecordState>,
    next_record: u64,
    heap: BinaryHeap<Reverse<(u64, u64, usize)>>,
    seq: u64,
    next_op: u64,
    host: Rc<Cell<u64>>,
    host_vc: Vc,
    host_actions: u64,
    race: RaceDetector,
    /// What the bytes hold beside the bytes: garbage rows, write generations, stale tokens
    /// (`exec.rs`).
    page_marks: PageMarks,
    sched: Decider,
    pub findings: Vec<Finding>,
    pub races: Vec<Race>,
    pub content: Option<Rc<RefCell<ContentOracle>>>,
    /// The engine runs one step ahead: a skipped store's rows count as garbage (the step built
    /// on a failed one reads them before the engine discards it). In order, no step may read
    /// them before the rerun rewrites them, so a read is still compared, and a finding.
    pub ahead: bool,
    /// The run's trace (`trace.rs`): slices and marks kept with `GpuOptions::trace`, the first
    /// race's ops always.
    pub trace: TraceLog,
    pub stats: GpuStats,
    pub record_log: RecordLog,
    /// What side 0 was asked to do since the runner last took it (the per-step oracles' input).
    pub asked: Asked,
    log_hash: u64,
    host_allocs: u32,
    allocs: u32,
    /// Ops of each kind whose reads were probed (`undeclared::ReadProbe`).
    read_probes: BTreeMap<&'static str, u32>,
    /// The undeclared-write check's copies of the bytes an op must leave alone, reused from op to
    /// op (as large as the largest buffer a whole-buffer check copied).
    shadow_arena: Vec<u8>,
    exec: Executor,
    /// Each side's context: in error or not, recreated how often, and whose buffers are whose.
    contexts: Contexts,
    /// The fault and timing model (`timing.rs`).
    faults: FaultModel,
}

/// What side 0 was asked to do since the runner last took it ([`SimGpu::asked`]): what a step
/// computed and loaded, for the per-step oracles.
#[derive(Debug, Default)]
pub struct Asked {
    /// The tokens whose KV rows were to be stored (request, position): the per-step promises.
    pub stored: Vec<(u64, u32)>,
    /// The device pages the load stream was to fill from the host: the loads a step issued, for
    /// the prefix-hit recount (`oracles::policy`).
    pub loaded: Vec<u32>,
    /// The device pages KV stores wrote, with the request each row belongs to: the
    /// page-ownership check's input.
    pub stored_pages: Vec<(u64, u32)>,
}

/// Each side's context ([`SimGpu::contexts`]).
#[derive(Debug, Default)]
struct Contexts {
    /// Per side, the fault that left the whole side in error (`GpuOptions::context_faults`,
    /// a hang), until the engine recovers it.
    in_error: [Option<DeviceFault>; 2],
    /// Per side, how many times recovering it recreated its context
    /// (`Device::context_generation`).
    generation: [u64; 2],
    /// The side each buffer was allocated by (a recreated context loses its own side's alone).
    buffer_side: Vec<u8>,
}

/// The engine's clock inside the simulation: the host's virtual time.
#[derive(Clone, Debug)]
pub struct SimClock(pub Rc<Cell<u64>>);

impl Clock for SimClock {
    fn now_ns(&self) -> u64 {
        self.0.get()
    }
}

impl SimGpu {
    /// A simulated GPU; with `opts.cuda`, its ops run on the machine's real GPU (an error when
    /// there is none, or the build has no CUDA).
    pub fn new(seed: u64, opts: GpuOptions) -> Result<SimGpu, DeviceError> {
        let sched = Decider::new(seed, opts.schedule.clone(), opts.ops_guess);
        let faults = FaultModel::new(seed, &opts);
        let cuda = opts.cuda;
        let mut g = SimGpu {
            mem: Memory::default(),
            opts,
            streams: Default::default(),
            side: 0,
            events: Vec::new(),
            internal_events: Default::default(),
            records: BTreeMap::new(),
            next_record: 0,
            heap: BinaryHeap::new(),
            seq: 0,
            next_op: 0,
            host: Rc::new(Cell::new(0)),
            host_vc: [0; crate::race::ENTITIES],
            host_actions: 0,
            race: RaceDetector::default(),
            page_marks: PageMarks::default(),
            sched,
            findings: Vec::new(),
            races: Vec::new(),
            content: None,
            ahead: false,
            trace: TraceLog::default(),
            stats: GpuStats::default(),
            record_log: RecordLog::default(),
            asked: Asked::default(),
            log_hash: 0xC0FF_EE00,
            host_allocs: 0,
            allocs: 0,
            read_probes: BTreeMap::new(),
            shadow_arena: Vec::new(),
            exec: Executor::Cpu(Box::default()),
            contexts: Contexts::default(),
            faults,
        };
        if cuda {
            g.exec = Executor::cuda()?;
        }
        Ok(g)
    }

    pub fn clock(&self) -> SimClock {
        SimClock(self.host.clone())
    }
    pub fn now(&self) -> u64 {
        self.host.get()
    }
    /// The hash of everything that happened, in order (the determinism oracle compares it).
    pub fn log_hash(&self) -> u64 {
        self.log_hash
    }

    fn log(&mut self, parts: &[u64]) {
        for &p in parts {
            self.log_hash = tierkv_kernels::cpu::numerics::mix64(self.log_hash ^ p);
        }
        self.stats.events += 1;
    }

    /// Moves the host's clock forward (idle time between arrivals), running the device meanwhile.
    pub fn advance_host_to(&mut self, t: u64) {
        if t > self.host.get() {
            self.host.set(t);
        }
        self.pump(self.host.get());
    }

    fn finding(&mut self, oracle: OracleKind, message: String) {
        self.findings.push(Finding {
            oracle,
            time_ns: self.host.get(),
            message,
        });
    }

    /// The decisions made so far: the run's schedule.
    pub fn take_schedule(&mut self) -> Vec<u8> {
        self.sched.take_recorded()
    }

    /// The kind of each decision of the run's schedule.
    pub fn take_decision_kinds(&mut self) -> Vec<Kind> {
        self.sched.take_kinds()
    }

    /// The host saw record `rec` (of event `ev`) complete at `now`, by a query or a
    /// synchronisation: it is ordered after the record, and a failure it reports is seen.
    fn host_saw(&mut self, rec: u64, ev: EventId, now: u64) -> EventState {
        let r = self.records[&rec];
        join(&mut self.host_vc, &r.vc);
        self.observed(rec, now);
        if !r.failed {
            return EventState::Done;
        }
        if r.counted {
            self.failure_seen(r.stream, ev);
        }
        EventState::Failed
    }

    /// Whether an arrival or abort due now reaches the engine after its next step (a schedule
    /// decision, `schedule::Kind::Arrival`) rather than before it.
    pub fn arrival_deferred(&mut self) -> bool {
        probes::hit_if(
            SimProbe::ArrivalDeferred,
            self.sched.point(Kind::Arrival, 0) != 0,
        )
    }

    /// How many decisions of each kind the run made so far.
    pub fn decision_counts(&self) -> crate::schedule::Counts {
        self.sched.counts()
    }

    fn host_access(
        &mut self,
        what: &'static str,
        buf: BufferId,
        offset: Bytes,
        len: usize,
        write: bool,
    ) {
        self.host_actions += 1;
        self.host_vc[HOST] += 1;
        let who = Accessor {
            entity: HOST,
            epoch: self.host_vc[HOST],
            id: self.host_actions,
            what: what.to_string(),
            op: what,
        };
        let vc = self.host_vc;
        let range = ByteRange::new(buf, offset, Bytes(len as u64));
        let races = self.race.access(range, write, &vc, &who);
        self.report_races(races);
    }

    /// What the engine asked of the current side: the tokens side 0 stores and the pages its
    /// load stream fills (the runner's per-step promises), and the bytes a page copy writes
    /// (the record log). Refused asks count too.
    pub(crate) fn note_asked(&mut self, stream: StreamKind, op: &Op) {
        let s = stream_index(self.side, stream);
        if let (Op::KvStore(o), 0) = (op, self.side) {
            self.asked
                .stored
                .extend(o.tags.rows.iter().map(|t| (t.request, t.position)));
            let page = tierkv_kernels::spec::format::PAGE_TOKENS as i32;
            self.asked.stored_pages.extend(
                o.tags
                    .rows
                    .iter()
                    .zip(o.args.slots.iter())
                    .filter(|(_, &slot)| slot >= 0)
                    .map(|(t, &slot)| (t.request, (slot / page) as u32)),
            );
        }
        if let (Op::PageCopy(c), StreamKind::Load, 0) = (op, stream, self.side) {
            self.asked.loaded.extend(
                c.runs
                    .iter()
                    .flat_map(|r| (0..r.count).map(move |i| r.dst.0 + i)),
            );
        }
        if op.spec().class() == OpClass::PageCopy {
            let written: u64 = op
                .accesses()
                .iter()
                .filter(|a| a.write)
                .map(|a| a.range.len().0)
                .sum();
            self.record_log.copy_bytes[s] += written;
        }
    }

    /// A page copy the device refused: the record log counts it, and the rows it should have
    /// written hold whatever was there before — not the bytes the engine asked for, so a read
    /// of them must never reach an output.
    pub(crate) fn note_refused(&mut self, stream: StreamKind, op: &Op) {
        let s = stream_index(self.side, stream);
        self.record_log.refused_after[s].push(self.record_log.made[s]);
        // `full_rows`: a refused run of a page copy (a linear copy) leaves its pages too.
        for (buf, page, rows) in self.full_rows(op) {
            self.page_marks.taint(buf, page, rows);
        }
    }

    /// A buffer whose race-detector cells are `cell` bytes (the simulated driver's staging rings
    /// and scratch: their regions are that finely aligned).
    pub(crate) fn alloc_cells(
        &mut self,
        desc: BufferDesc,
        cell: u64,
    ) -> Result<BufferId, DeviceError> {
        let id = self.alloc(desc)?;
        self.race
            .register(id, cell, crate::targets::buffer_class(&desc.role));
        Ok(id)
    }

    /// An event of the runtime's own (`internal_events`).
    pub(crate) fn new_internal_event(&mut self) -> Result<EventId, DeviceError> {
        let ev = self.new_event()?;
        self.internal_events.insert(ev);
        Ok(ev)
    }

    /// The latest record of `ev`.
    pub(crate) fn latest_record(&self, ev: EventId) -> Option<u64> {
        self.events[ev.0 as usize]
    }

    /// When `ev`'s latest record completed, on the device's clock, if it did by the host's
    /// time and did not fail (a timing event's reading; the runtime reads a pair after it saw
    /// the pair's end complete, which ran the device up to the host's time).
    pub(crate) fn record_done_at(&self, ev: EventId) -> Option<u64> {
        let r = self.records[&self.events[ev.0 as usize]?];
        r.done_at.filter(|&at| at <= self.host.get() && !r.failed)
    }

    /// Whether the host callback behind record `rec` runs by the host's time (the device runs
    /// up to it first): `Some(true)` it does, `Some(false)` it never will (the record failed:
    /// CUDA does not run host functions after an error), `None` not yet.
    pub(crate) fn callback_due(&mut self, rec: u64) -> Option<bool> {
        let now = self.host.get();
        self.pump(now);
        let r = self.records[&rec];
        let due = r.seen_at.is_some_and(|t| t <= now);
        probes::hit_if(SimProbe::FaultCompletionLate, !due && r.done_at.is_some());
        due.then_some(!r.failed)
    }

    /// The host learned from a completion callback that record `rec` completed: it is ordered
    /// after that record's work from now on.
    pub(crate) fn observe_record(&mut self, rec: u64) {
        let r = self.records[&rec];
        assert!(
            r.done_at.is_some(),
            "a callback ran before record {rec} completed"
        );
        join(&mut self.host_vc, &r.vc);
        self.log(&[24, rec]);
    }

    /// Whether `ev`'s latest record completed by the host's time, without the host observing it
    /// (the driver's own bookkeeping: no ordering, no host time).
    pub(crate) fn record_done(&mut self, ev: EventId) -> bool {
        let now = self.host.get();
        self.pump(now);
        match self.events[ev.0 as usize] {
            None => true,
            Some(rec) => self.records[&rec].done_at.is_some_and(|t| t <= now),
        }
    }

    /// Writes the driver's own host memory (a pageable copy's bounce buffer): no host access the
    /// race detector sees, as the CUDA driver's staging of a pageable copy is not the
    /// application's.
    pub(crate) fn write_untracked(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) {
        self.mem
            .range_mut(ByteRange::new(buf, offset, Bytes(data.len() as u64)))
            .copy_from_slice(data);
        self.log(&[25, buf.0 as u64, offset.0]);
    }

    /// The fault that left the current side in error, if it is.
    fn side_fault(&self) -> Option<DeviceFault> {
        self.contexts.in_error[self.side]
    }

    /// Whether the current side is in error (its calls fail, CUDA drops its callbacks).
    pub(crate) fn side_in_error(&self) -> bool {
        self.contexts.in_error[self.side].is_some()
    }

    /// Whether any token row of this page holds bytes from a failed copy.
    pub fn is_tainted(&self, b: BufferId, page: PageId) -> bool {
        self.page_marks.any_tainted(b, page.0 as u64)
    }
}

impl Device for SimGpu {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        self.allocs += 1;
        if self.opts.fail_alloc_nth == self.allocs {
            probes::hit(SimProbe::FaultAllocFailed);
            return Err(DeviceError::OutOfMemory {
                role: desc.role,
                tier: desc.tier,
                bytes: desc.bytes.0,
            });
        }
        if desc.tier == MemoryTier::PinnedHost {
            self.host_allocs += 1;
            if self.opts.fail_first_host_alloc && self.host_allocs == 1 {
                probes::hit(SimProbe::FaultHostAllocFailed);
                return Err(DeviceError::OutOfMemory {
                    role: desc.role,
                    tier: desc.tier,
                    bytes: desc.bytes.0,
                });
            }
        }
        let id = self.mem.alloc(desc);
        self.contexts.buffer_side.push(self.side as u8);
        let cell = if desc.fingerprint.is_paged() {
            desc.fingerprint.page_bytes
        } else {
            4096
        };
        self.race
            .register(id, cell, crate::targets::buffer_class(&desc.role));
        self.log(&[4, id.0 as u64, desc.bytes.0]);
        Ok(id)
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.mem.desc(buf)
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        self.refuse_in_error(21)?;
        self.events.push(None);
        Ok(EventId(self.events.len() as u32 - 1))
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        let s = stream_index(self.side, stream);
        assert!(
            (ev.0 as usize) < self.events.len(),
            "record of unknown {ev}"
        );
        self.refuse_in_error(22)?;
        if let Some(old) = self.events[ev.0 as usize] {
            let awaited = self.streams.iter().any(|st| {
                st.queue
                    .iter()
                    .any(|e| matches!(e, Entry::Wait(Some(r)) if *r == old))
            });
            probes::hit_if(SimProbe::RecordWhileAwaited, awaited);
        }
        let rec = self.next_record;
        self.next_record += 1;
        let counted = !self.internal_events.contains(&ev);
        self.records.insert(
            rec,
            RecordState {
                stream: s,
                counted,
                done_at: None,
                seen_at: None,
                failed: false,
                vc: self.streams[s].vc,
            },
        );
        self.events[ev.0 as usize] = Some(rec);
        if counted {
            self.record_log.made[s] += 1;
        }
        self.streams[s].queue.push_back(Entry::Record(rec));
        self.log(&[5, s as u64, ev.0 as u64, rec]);
        let now = self.host.get();
        self.advance_stream(s, now);
        Ok(())
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        let s = stream_index(self.side, stream);
        assert!((ev.0 as usize) < self.events.len(), "wait on unknown {ev}");
        self.refuse_in_error(23)?;
        let target = self.events[ev.0 as usize];
        if let Some(rec) = target {
            let vc = self.records[&rec].vc;
            join(&mut self.streams[s].vc, &vc);
        }
        self.streams[s].queue.push_back(Entry::Wait(target));
        self.log(&[6, s as u64, ev.0 as u64]);
        let now = self.host.get();
        self.advance_stream(s, now);
        Ok(())
    }
    fn query(&mut self, ev: EventId) -> EventState {
        // A query costs the host a little time, so an engine that spins on one lets the device
        // progress instead of hanging the simulation.
        self.host.set(self.host.get() + self.opts.launch_ns / 4);
        let now = self.host.get();
        self.pump(now);
        let state = match self.events[ev.0 as usize] {
            None => EventState::Done,
            Some(rec) => {
                let early = self.query_early(rec, now);
                let r = self.records[&rec];
                match r.done_at {
                    Some(at) if at <= now && !early && self.query_late(rec, at, now) => {
                        probes::hit(SimProbe::QueryAnsweredLate);
                        EventState::Pending
                    }
                    Some(at) if at <= now => self.host_saw(rec, ev, now),
                    _ => EventState::Pending,
                }
            }
        };
        probes::hit_if(SimProbe::QueryPending, state == EventState::Pending);
        if state != EventState::Pending {
            let rec = self.events[ev.0 as usize];
            self.mark(Mark::Host {
                what: "query: complete",
                start: now,
                end: now,
                rec,
            });
        }
        self.log(&[7, ev.0 as u64, state as u64]);
        state
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        let start = self.host.get();
        let target = self.events[ev.0 as usize];
        let state = match target {
            None => EventState::Done,
            Some(rec) => {
                let at = self.run_until_record(rec);
                if at > self.host.get() {
                    // The host blocked: when it resumes after the record is the schedule's.
                    let late = self.sched.point(Kind::Sync, self.records[&rec].stream) as u64;
                    probes::hit_if(SimProbe::SyncReturnedLate, late > 0);
                    self.host.set(at + late * self.opts.jitter_ns / 4);
                }
                let now = self.host.get();
                self.host_saw(rec, ev, now)
            }
        };
        let now = self.host.get();
        self.pump(now);
        self.log(&[8, ev.0 as u64, state as u64, now]);
        self.mark(Mark::Host {
            what: "synchronize",
            start,
            end: now,
            rec: target,
        });
        state
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        self.enqueue_with(stream, op, None)
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        check_host_access("host_read", buf, self.mem.desc(buf), offset, out.len())?;
        let now = self.host.get();
        self.pump(now);
        self.host_access("host_read", buf, offset, out.len(), false);
        out.copy_from_slice(
            self.mem
                .range(ByteRange::new(buf, offset, Bytes(out.len() as u64))),
        );
        self.log(&[10, buf.0 as u64, offset.0]);
        self.mark(Mark::Host {
            what: "host_read",
            start: now,
            end: now,
            rec: None,
        });
        Ok(())
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        check_host_access("host_write", buf, self.mem.desc(buf), offset, data.len())?;
        let now = self.host.get();
        self.pump(now);
        self.host_access("host_write", buf, offset, data.len(), true);
        self.mem
            .range_mut(ByteRange::new(buf, offset, Bytes(data.len() as u64)))
            .copy_from_slice(data);
        self.log(&[11, buf.0 as u64, offset.0]);
        self.mark(Mark::Host {
            what: "host_write",
            start: now,
            end: now,
            rec: None,
        });
        Ok(())
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.recover_side()
    }
    fn context_generation(&self) -> u64 {
        self.contexts.generation[self.side]
    }
}

impl SimGpu {
    /// Queues `op` on `stream` of the current side; `args`: a launch's device arguments.
    pub(crate) fn enqueue_with(
        &mut self,
        stream: StreamKind,
        op: Op,
        args: Option<Box<LaunchArgs>>,
    ) -> Result<(), DeviceError> {
        let s = stream_index(self.side, stream);
        if let Err(e) = check_op(&op, |b| self.mem.desc(b)) {
            self.finding(
                OracleKind::Layout,
                format!(
                    "{} refused at enqueue on the {} stream: {e}",
                    op.name(),
                    entity_name(s)
                ),
            );
            return Err(e);
        }
        if self.opts.context_faults || self.faults.hangs() {
            let now = self.host.get();
            self.pump(now);
        }
        // A side in error refuses the op below: the recovery oracle judges the per-stream model.
        if let (Some(ev), None) = (self.streams[s].failure_seen, self.side_fault()) {
            self.finding(
                OracleKind::Recovery,
                format!(
                    "{} enqueued on the {} stream after the host saw it fail ({ev} answered \
                     Failed) and before it recovered the device: work on a failed stream \
                     never runs (Device::recover)",
                    op.name(),
                    entity_name(s)
                ),
            );
        }
        let n = self.streams[s].calls;
        self.streams[s].calls += 1;
        let class = op.spec().class();
        // A page copy a device in error refuses is a failed transfer (below); any other op is
        // refused here, before it counts as enqueued.
        if class != OpClass::PageCopy {
            self.refuse_in_error(18)?;
        }
        if class == OpClass::Kernel && self.faults.launch_refused(s, n) {
            probes::hit(SimProbe::FaultLaunchRefused);
            self.log(&[19, s as u64, n]);
            return Err(DeviceError::OutOfMemory {
                role: BufferRole::Scratch {
                    name: "stream-ordered op arguments",
                },
                tier: MemoryTier::Device,
                bytes: op.bytes_touched().0,
            });
        }
        self.host.set(self.host.get() + self.opts.launch_ns);
        // A launch of the simulated driver is the runtime's: the engine's device call that asked
        // for it is noted by `SimDevice` (it may fail before any launch).
        let launch = args.is_some();
        if !launch {
            self.note_asked(stream, &op);
        }
        let in_error = class == OpClass::PageCopy && self.refuse_in_error(20).is_err();
        if in_error || (class == OpClass::PageCopy && self.faults.enqueue_refused(s, n)) {
            probes::hit_if(SimProbe::FaultEnqueueFailed, !in_error);
            self.log(&[12, s as u64]);
            if !launch {
                self.note_refused(stream, &op);
            }
            if let (true, Some(cause)) = (in_error, self.side_fault()) {
                return Err(DeviceError::InError { cause });
            }
            return Err(DeviceError::Backend {
                detail: format!("injected: {} refused at enqueue", op.name()),
            });
        }
        // Each op's fault draws are keyed by its enqueue call's number and its half (a torn
        // copy's two ops), so a torn copy does not move the draws of the ops after it.
        match self.faults.tear(&op, s, n) {
            Some((first, second)) => {
                self.push_op(s, first, 2 * n, args.clone());
                self.push_op(s, second, 2 * n + 1, args);
            }
            None => self.push_op(s, op, 2 * n, args),
        }
        Ok(())
    }

    /// Recovers the current side (`Device::recover`).
    fn recover_side(&mut self) -> Result<(), DeviceError> {
        if self.opts.recover_fails {
            self.log(&[15, 2]);
            return Err(DeviceError::Backend {
                detail: "injected: the device did not survive a fault".into(),
            });
        }
        // Completions up to now happened with the error; what completes later runs again.
        let now = self.host.get();
        self.pump(now);
        // Each side is its own device: recovering one clears its streams alone. Work a stream
        // in error still holds was queued in the failed context: it never runs (the stream
        // skips to its next record, which reports the failure).
        let context_wide = self.contexts.in_error[self.side].take().is_some();
        if context_wide && self.opts.recreate_context {
            // CUDA cannot clear a context's error in place: the context is recreated, with the
            // same allocations, and what the device held is gone.
            self.lose_device_memory();
        }
        let mut was = context_wide;
        for st in &mut self.streams[self.side * 3..self.side * 3 + 3] {
            if st.sticky && (st.running.is_some() || !st.queue.is_empty()) {
                st.skipping = true;
                st.failed_since_record = true;
            }
            was |= std::mem::take(&mut st.sticky);
            st.failure_seen = None;
        }
        probes::hit_if(SimProbe::FaultStickyRecovered, was);
        self.log(&[15, was as u64]);
        Ok(())
    }
}

/// One side of a shared simulated GPU, as one engine's `Device`: side 0 (the single engine, or a
/// prefill/decode pair's prefill engine) or side 1 (a pair's decode engine). Both sides' buffers,
/// events and host are one executor's, so a transfer between them is a page copy on the decode
/// side's load stream that the race detector and the content oracle see like any other.
#[derive(Clone)]
pub struct SimSide {
    pub gpu: Rc<RefCell<SimGpu>>,
    pub side: usize,
}

impl SimSide {
    pub(crate) fn at(&self) -> std::cell::RefMut<'_, SimGpu> {
        let mut g = self.gpu.borrow_mut();
        g.side = self.side;
        g
    }
}

impl Device for SimSide {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        self.at().alloc(desc)
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.gpu.borrow().mem.desc(buf)
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        self.at().new_event()
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.at().record(stream, ev)
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.at().wait(stream, ev)
    }
    fn query(&mut self, ev: EventId) -> EventState {
        self.at().query(ev)
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.at().synchronize(ev)
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        self.at().enqueue(stream, op)
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.at().host_read(buf, offset, out)
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        self.at().host_write(buf, offset, data)
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.at().recover()
    }
    fn context_generation(&self) -> u64 {
        self.gpu.borrow().contexts.generation[self.side]
    }
}
