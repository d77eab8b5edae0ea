//! The simulated GPU: the engine's `Device`, with real bytes, three streams and events, run by a
//! discrete-event executor in virtual time.
//!
//! What it guarantees is exactly what CUDA guarantees: ops of one stream run in order; across
//! streams only events order them (a wait waits for the event's most recent record at the time of
//! the wait call; an event never recorded is complete). Everything else is chosen: how long an op
//! that could start is held is the schedule's decision (see `schedule`); how long it runs
//! (latency and bandwidth models, slow copies) and whether a copy or a kernel launch fails are
//! drawn from the GPU's seeded generator with the scenario's rates, in the order ops are
//! enqueued and records complete (so they move with the schedule). An op's data effect — its reads and its writes —
//! happens at its completion, so an op that a missing wait leaves unordered really reads stale
//! bytes in the schedules where it completes first.
//!
//! Checks made here: the race detector at every enqueue and host access; the layout check of
//! every op at enqueue (buffer descriptors never change after allocation, so it is not made
//! again when the op runs); the content oracle on the index-K rows an `index_logits` reads and
//! the KV rows a `sparse_read` reads, as the op runs (`oracles/content.rs` says what it skips);
//! the undeclared-write check around every op, and the undeclared-read probe on a sample of
//! them (CPU executor only).

use crate::fasthash::FastMap;
use crate::oracles::content::ContentOracle;
use crate::probes::{self, SimProbe};
use crate::race::{join, Accessor, Race, RaceDetector, Vc, HOST};
use crate::report::{Finding, OracleKind};
use crate::schedule::{Decider, Kind, Source, DECISION_MAX};
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
    /// The op-start count PCT spreads its change points over when its policy does not know it.
    pub ops_guess: u64,
    /// Host cost of one API call (launch overhead), ns.
    pub launch_ns: u64,
    /// Kernel time model: fixed cost plus bytes touched / rate.
    pub kernel_ns: u64,
    pub kernel_bytes_per_ns: f64,
    /// Copy time model (PCIe): latency plus bytes / bandwidth.
    pub copy_latency_ns: u64,
    pub copy_bytes_per_ns: f64,
    /// The scheduler's unit of hold: a decision `d` holds a ready op `d / 4` of it, ns.
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
    /// until `Device::recover` (kinder than CUDA in one way: recovering keeps the memory, where
    /// CUDA must recreate the context).
    pub context_faults: bool,
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
    /// stream (when the event's ring slot is free), which signals the completion ring; the simulated driver (`driver.rs`) runs
    /// it at the drawn time, in order (CUDA runs a stream's callbacks in order) but late
    /// against the other streams' completions, which the host can observe first. A record whose
    /// slot's previous callback has not run gets no ticket: `query` asks the driver, and
    /// `query` and `synchronize` stay exact, as `cuEventQuery` is. (Engines on the simulated GPU
    /// directly have no callbacks: the delay only orders the `observed` probe.)
    pub completion_delay_ns: u64,
    /// Probability that a call of the simulated driver (`driver.rs`) is refused by a fault of
    /// its own, once the engine is built (`SimGpu::arm_driver_faults`): allocations and event
    /// creations with out-of-memory, copies, launches, records, waits and host callbacks with
    /// the driver's error. An allocation that takes new memory from the device meets
    /// out-of-memory twenty times as often (`driver.rs`), at most one call in four. Each draw is
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

/// How long the simulated device's watchdog lets an op run before it gives up on it
/// (`GpuOptions::hang_rate`), ns of virtual time: a second, far above any op the timing model
/// draws (a slow copy of a whole layer's pages takes milliseconds), so only a hung op meets it.
pub const WATCHDOG_NS: u64 = 1_000_000_000;

/// What each keyed draw decides (`SimGpu::keyed`).
const KEY_COPY_FAILS: u64 = 1;
const KEY_KERNEL_FAILS: u64 = 2;
const KEY_HANGS: u64 = 3;
const KEY_LAUNCH_REFUSED: u64 = 4;
const KEY_TORN: u64 = 5;
const KEY_ENQUEUE_REFUSED: u64 = 6;
const KEY_DURATION: u64 = 7;
const KEY_SLOW: u64 = 8;
const KEY_GARBAGE: u64 = 9;
/// Driver calls' own faults: this plus the call's kind (`driver.rs`).
const KEY_DRIVER_CALL: u64 = 0x100;

/// A stream's index: its side's three, then its kind.
pub fn stream_index(side: usize, kind: StreamKind) -> usize {
    side * 3 + kind.index()
}

/// One op as the trace shows it.
#[derive(Clone, Debug)]
pub struct Slice {
    pub op_id: u64,
    /// The stream's index (`stream_index`).
    pub stream: usize,
    pub name: &'static str,
    pub start_ns: u64,
    pub end_ns: u64,
    pub detail: String,
    pub failed: bool,
    /// It did not run: a failed launch's stream skipped it.
    pub skipped: bool,
}

/// What the trace shows besides ops: event records and the waits they release (joined by flow
/// arrows), and the host's device calls.
#[derive(Clone, Debug)]
pub enum Mark {
    /// Record `rec` completed on `stream` at `at`.
    Record { stream: usize, rec: u64, at: u64 },
    /// A wait on `stream` for record `rec` was released at `at`.
    Wait { stream: usize, rec: u64, at: u64 },
    /// The host's call `what`, blocking from `start` to `end`; `rec`: the record it waited for.
    Host {
        what: &'static str,
        start: u64,
        end: u64,
        rec: Option<u64>,
    },
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
    /// (`SimGpu::keyed`), and those of the ops it pushes.
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
    /// Token rows (bit `t` of a page's mask) that a failed copy left garbage in.
    tainted: crate::fasthash::FastMap<(BufferId, u64), u64>,
    /// Tokens buffers whose last `next_tokens` was skipped (a failed step): what they hold is
    /// not the tokens of any step.
    stale_tokens: std::collections::BTreeSet<BufferId>,
    /// Writes per paged-buffer page (the content oracle's cache key).
    page_gen: crate::fasthash::FastMap<(BufferId, u64), u64>,
    sched: Decider,
    pub findings: Vec<Finding>,
    pub races: Vec<Race>,
    pub content: Option<Rc<RefCell<ContentOracle>>>,
    /// The engine runs one step ahead: a skipped store's rows count as garbage (the step built
    /// on a failed one reads them before the engine discards it). In order, no step may read
    /// them before the rerun rewrites them, so a read is still compared, and a finding.
    pub ahead: bool,
    pub trace: Vec<Slice>,
    /// Records, waits and host calls, for the trace (`GpuOptions::trace`).
    pub marks: Vec<Mark>,
    /// Op ids involved in the first race (marked in the trace).
    pub racing_ops: Vec<u64>,
    pub stats: GpuStats,
    pub record_log: RecordLog,
    /// The tokens whose KV rows side 0 was asked to store since the runner last took them
    /// (request, position): what a step computed, for the per-step promises.
    pub stored: Vec<(u64, u32)>,
    /// The device pages side 0's load stream was asked to fill from the host since the runner
    /// last took them: the loads a step issued, for the prefix-hit recount (`oracles::policy`).
    pub loaded: Vec<u32>,
    /// The device pages side 0's KV stores wrote since the runner last took them, with the
    /// request each row belongs to: the page-ownership check's input.
    pub stored_pages: Vec<(u64, u32)>,
    log_hash: u64,
    host_allocs: u32,
    allocs: u32,
    /// Ops of each kind whose reads were probed (`undeclared::ReadProbe`).
    read_probes: BTreeMap<&'static str, u32>,
    /// The undeclared-write check's copies of the bytes an op must leave alone, reused from op to
    /// op (as large as the largest buffer a whole-buffer check copied).
    shadow_arena: Vec<u8>,
    exec: Executor,
    /// Per side, the fault that left the whole side in error (`GpuOptions::context_faults`,
    /// a hang), until the engine recovers it.
    in_error: [Option<DeviceFault>; 2],
    /// The seed of the keyed fault draws.
    fault_key: u64,
    /// The simulated driver's own faults are drawn (`arm_driver_faults`).
    driver_armed: bool,
}

/// What performs an op's data effect when the simulation says it completes.
enum Executor {
    /// The kernels' CPU references on the simulator's memory, with what they can keep from op to
    /// op.
    Cpu(Box<Kept>),
    /// The CUDA kernels and copies on a real GPU, through mirrors of the simulator's buffers.
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda_exec::CudaExec>),
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
            tainted: Default::default(),
            stale_tokens: Default::default(),
            page_gen: Default::default(),
            sched,
            findings: Vec::new(),
            races: Vec::new(),
            content: None,
            ahead: false,
            trace: Vec::new(),
            marks: Vec::new(),
            racing_ops: Vec::new(),
            stats: GpuStats::default(),
            record_log: RecordLog::default(),
            stored: Vec::new(),
            loaded: Vec::new(),
            stored_pages: Vec::new(),
            log_hash: 0xC0FF_EE00,
            host_allocs: 0,
            allocs: 0,
            read_probes: BTreeMap::new(),
            shadow_arena: Vec::new(),
            exec: Executor::Cpu(Box::default()),
            in_error: [None; 2],
            fault_key: tierkv_kernels::cpu::numerics::mix64(seed ^ 0xFA17_0000),
            driver_armed: false,
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
    /// A uniform draw in [0, 1) for deciding `what` about the call numbered `n` on stream `s`:
    /// keyed by the call's identity rather than taken in sequence, so that a schedule which
    /// reorders calls across streams draws the same fault for the same call.
    fn keyed(&self, what: u64, s: usize, n: u64) -> f64 {
        (self.keyed_bits(what, s, n) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn keyed_bits(&self, what: u64, s: usize, n: u64) -> u64 {
        use tierkv_kernels::cpu::numerics::mix64;
        mix64(mix64(mix64(self.fault_key ^ what) ^ s as u64) ^ n)
    }
    /// A keyed draw uniform in `0..=max`.
    fn keyed_below(&self, what: u64, s: usize, n: u64, max: u64) -> u64 {
        ((self.keyed(what, s, n) * (max + 1) as f64) as u64).min(max)
    }

    /// The calls of a side in error fail (`GpuOptions::context_faults`, a hang). The device
    /// first runs up to the host's time, so a fault that happened by now is seen.
    fn refuse_in_error(&mut self, what: u64) -> Result<(), DeviceError> {
        if self.opts.context_faults || self.opts.hang_rate > 0.0 {
            let now = self.host.get();
            self.pump(now);
        }
        match self.in_error[self.side] {
            Some(cause) => {
                probes::hit(SimProbe::FaultCallInError);
                self.log(&[16, self.side as u64, what]);
                Err(DeviceError::InError { cause })
            }
            None => Ok(()),
        }
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

    fn mark(&mut self, m: Mark) {
        if self.opts.trace {
            self.marks.push(m);
        }
    }

    /// The host saw `ev`, recorded on stream `s`, fail: while the stream stays in error, later
    /// work on it is work the engine knows will not run.
    fn failure_seen(&mut self, s: usize, ev: EventId) {
        let st = &mut self.streams[s];
        if st.sticky && st.failure_seen.is_none() {
            st.failure_seen = Some(ev);
        }
    }

    fn finding(&mut self, oracle: OracleKind, message: String) {
        self.findings.push(Finding {
            oracle,
            time_ns: self.host.get(),
            message,
        });
    }

    fn describe(&self, b: BufferId) -> String {
        format!("{b} ({})", self.mem.desc(b).role)
    }

    /// Slices for the ops still queued or running when the run ended (with `GpuOptions::trace`):
    /// an op the host enqueued but did not wait for — a step enqueued ahead, the later op of a
    /// race found at enqueue — shows in the trace, at its enqueue time, marked as not run.
    pub fn unrun_slices(&self) -> Vec<Slice> {
        if !self.opts.trace {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (s, st) in self.streams.iter().enumerate() {
            let running = st.running.iter().map(|(rec, _, _)| rec.as_ref());
            let queued = st.queue.iter().filter_map(|e| match e {
                Entry::Op(rec) => Some(rec.as_ref()),
                _ => None,
            });
            for rec in running.chain(queued) {
                out.push(Slice {
                    op_id: rec.id,
                    stream: s,
                    name: rec.op.name(),
                    start_ns: rec.enq_ns,
                    end_ns: rec.enq_ns,
                    detail: format!(
                        "not run when the run ended; {}",
                        op_detail(&rec.op, &self.mem)
                    ),
                    failed: false,
                    skipped: true,
                });
            }
        }
        out
    }

    fn report_races(&mut self, races: Vec<Race>) {
        for r in races {
            if self.races.len() < 16 {
                if self.racing_ops.is_empty() {
                    self.racing_ops = vec![r.earlier.id, r.later.id];
                }
                let role = self.mem.desc(r.buffer).role;
                let cb = self.race.cell_bytes(r.buffer);
                let unit = match role {
                    BufferRole::Pool { .. } | BufferRole::Mirror { .. } => {
                        format!("page {}", r.cell)
                    }
                    BufferRole::Scratch { .. } => {
                        format!("bytes {}..{}", r.cell * cb, (r.cell + 1) * cb)
                    }
                };
                let who = |write: bool, a: &Accessor| {
                    format!(
                        "{} {} by {} (on {})",
                        if write { "write" } else { "read" },
                        a.what,
                        if a.entity == HOST {
                            "host".to_string()
                        } else {
                            format!("op {}", a.id)
                        },
                        entity_name(a.entity)
                    )
                };
                let msg = format!(
                    "data race on {} {unit}: {} is not ordered after {}",
                    self.describe(r.buffer),
                    who(r.later_write, &r.later),
                    who(r.earlier_write, &r.earlier)
                );
                self.finding(OracleKind::Race, msg);
            }
            self.races.push(r);
        }
    }

    /// The op's duration, whether it fails, and whether it hangs (then it fails too, and lasts
    /// until the watchdog). `s` and `n`: its stream and its key there (`push_op`).
    fn duration(&mut self, op: &Op, s: usize, n: u64) -> (u64, bool, bool) {
        let bytes = op.bytes_touched().0;
        if self.opts.hang_rate > 0.0 && self.keyed(KEY_HANGS, s, n) < self.opts.hang_rate {
            probes::hit(SimProbe::FaultHung);
            return (WATCHDOG_NS, true, true);
        }
        let (d, fail) = match op.spec().class() {
            OpClass::PageCopy | OpClass::LinearCopy => {
                let base = self.opts.copy_latency_ns
                    + (bytes as f64 / 2.0 / self.opts.copy_bytes_per_ns) as u64;
                let mut d = base + self.keyed_below(KEY_DURATION, s, n, base / 4);
                if self.opts.slow_copy_rate > 0.0
                    && self.keyed(KEY_SLOW, s, n) < self.opts.slow_copy_rate
                {
                    probes::hit(SimProbe::FaultCopySlow);
                    d *= self.opts.slow_copy_factor;
                }
                let fail = op.spec().class() == OpClass::PageCopy
                    && self.opts.failed_copy_rate > 0.0
                    && self.keyed(KEY_COPY_FAILS, s, n) < self.opts.failed_copy_rate;
                probes::hit_if(SimProbe::FaultCopyFailed, fail);
                (d, fail)
            }
            OpClass::Kernel => {
                let base =
                    self.opts.kernel_ns + (bytes as f64 / self.opts.kernel_bytes_per_ns) as u64;
                let d = base + self.keyed_below(KEY_DURATION, s, n, base / 2);
                let fail = self.opts.failed_kernel_rate > 0.0
                    && self.keyed(KEY_KERNEL_FAILS, s, n) < self.opts.failed_kernel_rate;
                (d, fail)
            }
        };
        (d, fail, false)
    }

    /// How long the op that could start on `stream` now is held: the schedule's decision.
    fn start_delay(&mut self, stream: usize) -> u64 {
        self.sched.decide(stream) as u64 * self.opts.jitter_ns / 4
    }

    /// The decisions made so far: the run's schedule.
    pub fn take_schedule(&mut self) -> Vec<u8> {
        self.sched.take_recorded()
    }

    /// The kind of each decision of the run's schedule.
    pub fn take_decision_kinds(&mut self) -> Vec<Kind> {
        self.sched.take_kinds()
    }

    /// How many decisions of each kind the run made so far.
    pub fn decision_counts(&self) -> crate::schedule::Counts {
        self.sched.counts()
    }

    /// Runs the stream's queue from time `t` as far as it can go without waiting for time.
    fn advance_stream(&mut self, s: usize, t: u64) {
        loop {
            if self.streams[s].running.is_some() {
                return;
            }
            let t = t.max(self.streams[s].ready_at);
            let Some(head) = self.streams[s].queue.front() else {
                return;
            };
            match head {
                Entry::Record(rec) => {
                    let rec = *rec;
                    self.streams[s].queue.pop_front();
                    // A failure is the engine's to see at its next record: a record of the
                    // runtime's own (a staging copy's, a callback's) reports it too but neither
                    // clears it nor ends the skipping of the failed step's work.
                    let counted = self.records[&rec].counted;
                    let failed = self.streams[s].failed_since_record || self.streams[s].sticky;
                    if counted {
                        self.streams[s].failed_since_record = false;
                        self.streams[s].skipping = false;
                    }
                    let seen = self.seen_at(s, t);
                    let r = self.records.get_mut(&rec).expect("record exists");
                    assert_eq!(r.stream, s, "record {rec} completes on another stream");
                    assert!(r.done_at.is_none(), "record {rec} completed twice");
                    r.done_at = Some(t);
                    r.seen_at = Some(seen);
                    let last = self.streams[s].last_record.replace(rec);
                    assert!(last < Some(rec), "records of one stream complete in order");
                    r.failed = failed;
                    if r.counted {
                        self.record_log.failed[s].push(failed);
                    }
                    probes::hit_if(SimProbe::RecordFailed, failed);
                    self.mark(Mark::Record {
                        stream: s,
                        rec,
                        at: t,
                    });
                    self.streams[s].ready_at = t;
                    self.log(&[1, s as u64, rec, t]);
                    // A completed record may release waits on other streams.
                    for o in 0..STREAMS {
                        if o != s {
                            self.advance_stream(o, t);
                        }
                    }
                }
                Entry::Wait(target) => {
                    let target = *target;
                    let done = match target {
                        None => Some(t),
                        Some(rec) => self.records[&rec].done_at,
                    };
                    match done {
                        Some(at) => {
                            self.streams[s].queue.pop_front();
                            self.streams[s].ready_at = t.max(at);
                            if let Some(rec) = target {
                                self.mark(Mark::Wait {
                                    stream: s,
                                    rec,
                                    at: t.max(at),
                                });
                            }
                        }
                        None => {
                            probes::hit(SimProbe::WaitBlocked);
                            return;
                        }
                    }
                }
                Entry::Op(_) => {
                    let Some(Entry::Op(rec)) = self.streams[s].queue.pop_front() else {
                        unreachable!()
                    };
                    let start = t.max(rec.enq_ns) + self.start_delay(s);
                    let end = start + rec.duration;
                    probes::hit_if(
                        SimProbe::StreamsOverlap,
                        self.streams
                            .iter()
                            .any(|o| o.running.as_ref().is_some_and(|r| r.2 > start)),
                    );
                    self.seq += 1;
                    self.heap.push(Reverse((end, self.seq, s)));
                    self.log(&[2, s as u64, rec.id, start]);
                    self.streams[s].running = Some((rec, start, end));
                    return;
                }
            }
        }
    }

    /// Processes device completions up to time `until`.
    fn pump(&mut self, until: u64) {
        while let Some(&Reverse((t, _, s))) = self.heap.peek() {
            if t > until {
                break;
            }
            self.heap.pop();
            self.complete(s, t);
        }
    }

    /// When the host callback of a record of stream `s` completed at `t` runs: at once, or, for
    /// load-stream records, after a delay the schedule decides (a callback decision, in twelfths
    /// of `completion_delay_ns`), never before the stream's previous callback.
    fn seen_at(&mut self, s: usize, t: u64) -> u64 {
        let max = self.opts.completion_delay_ns;
        if max == 0 || s % 3 != StreamKind::Load.index() {
            return t;
        }
        let d = self.sched.point(Kind::Callback, s) as u64;
        let at = (t + max / DECISION_MAX as u64 * d).max(self.streams[s].last_seen);
        self.streams[s].last_seen = at;
        at
    }

    /// A query of record `rec` at `now` in the window before it (the record is the next entry
    /// of its stream, behind an op that started and would end within one jitter): the schedule
    /// decides whether that op ends now, so that the query answers Done.
    /// Returns whether it did.
    fn query_early(&mut self, rec: u64, now: u64) -> bool {
        let r = self.records[&rec];
        if r.done_at.is_some() {
            return false;
        }
        let s = r.stream;
        let st = &self.streams[s];
        let Some((start, end)) = st.running.as_ref().map(|(_, a, b)| (*a, *b)) else {
            return false;
        };
        let next = matches!(st.queue.front(), Some(Entry::Record(x)) if *x == rec);
        if !next || start > now || end <= now || end - now > self.opts.jitter_ns {
            return false;
        }
        if self.sched.point(Kind::QueryEarly, s) == 0 {
            return false;
        }
        probes::hit(SimProbe::QueryAnsweredEarly);
        // The op ends now: its queue entry goes, and it completes as if it had been drawn this
        // long. (The heap holds at most one entry per stream, its running op's.)
        self.heap.retain(|Reverse((_, _, o))| *o != s);
        if let Some(run) = self.streams[s].running.as_mut() {
            run.2 = now;
        }
        self.log(&[17, s as u64, rec, now]);
        self.complete(s, now);
        self.pump(now);
        assert_eq!(
            self.records[&rec].done_at,
            Some(now),
            "record {rec} is passed once the op before it ends"
        );
        true
    }

    /// A query of record `rec`, completed at `at`, at `now` in the window after it (within one
    /// jitter, and nothing the host has seen orders the host after it): whether the schedule
    /// has the host look before it is passed (answer Pending).
    fn query_late(&mut self, rec: u64, at: u64, now: u64) -> bool {
        let r = self.records[&rec];
        let seen = (0..crate::race::ENTITIES).all(|e| r.vc[e] <= self.host_vc[e]);
        if seen || now - at >= self.opts.jitter_ns {
            return false;
        }
        self.sched.point(Kind::QueryLate, r.stream) != 0
    }

    /// The host observed record `rec` of another stream complete at `now`: a load-stream record
    /// that completed no later but whose callback has not run yet means completions reach the
    /// host out of order. (Only the latest records are looked at: a probe, not an oracle.)
    fn observed(&mut self, rec: u64, now: u64) {
        const RECENT_RECORDS: usize = 64;
        let r = self.records[&rec];
        let load = r.stream - r.stream % 3 + StreamKind::Load.index();
        let Some(done) = r.done_at.filter(|_| r.stream != load) else {
            return;
        };
        let late = self.streams[load].last_seen > now
            && self.records.values().rev().take(RECENT_RECORDS).any(|o| {
                o.stream == load
                    && o.done_at.is_some_and(|d| d <= done)
                    && o.seen_at.is_some_and(|c| c > now)
            });
        probes::hit_if(SimProbe::FaultCompletionReordered, late);
    }

    /// Runs the device until record `rec` is complete (the host blocks meanwhile).
    fn run_until_record(&mut self, rec: u64) -> u64 {
        loop {
            if let Some(at) = self.records[&rec].done_at {
                return at;
            }
            let Some(Reverse((t, _, s))) = self.heap.pop() else {
                panic!("deadlock: the host waits for record {rec}, which no stream will reach");
            };
            self.complete(s, t);
        }
    }

    /// The op running on stream `s` ends at `t` (the executor's queue entry for it): its reads
    /// and writes happen now.
    fn complete(&mut self, s: usize, t: u64) {
        let (mut rec, start, end) = self.streams[s].running.take().expect("a running op");
        // Paired with the start in `advance_stream`: the queue holds the op's own end time, and
        // the stream finishes its ops in the order they were enqueued.
        assert_eq!(
            end, t,
            "op {} ends at {end}, its queue entry says {t}",
            rec.id
        );
        assert!(start <= end, "op {} ends before it starts", rec.id);
        let last = self.streams[s].last_op.replace(rec.id);
        assert!(
            last < Some(rec.id),
            "ops of one stream finish in enqueue order"
        );
        self.stats.ops += 1;
        self.log(&[3, s as u64, rec.id, end]);
        if rec.fail && rec.op.spec().class() == OpClass::Kernel && !self.streams[s].sticky {
            probes::hit(SimProbe::FaultKernelFailed);
            self.stats.failed_kernels += 1;
            self.streams[s].failed_since_record = true;
            self.streams[s].skipping = true;
        }
        // A failed launch, and the work after it that its stream skips until the next record;
        // or a stream in error, which skips everything until the engine recovers the device.
        let skipped = self.streams[s].skipping || self.streams[s].sticky;
        if skipped {
            self.log(&[13, s as u64, rec.id]);
            self.streams[s].failed_since_record = true;
            // Work after a skipped op reads what it should have written: the stream skips on
            // to its next record even when the engine recovers the device in between (it may,
            // when a call fails in the middle of a step).
            self.streams[s].skipping = true;
            // Tokens a skipped `next_tokens` should have written are stale.
            if let Op::NextTokens(o) = &rec.op {
                self.stale_tokens.insert(o.out.buffer);
            }
            // What a skipped copy should have written holds whatever was there: garbage; and
            // so does a skipped store's, for an engine running ahead (`ahead`).
            let pages_copied = rec.op.spec().class() == OpClass::PageCopy
                || matches!(&rec.op, Op::Copy(c) if self.mem.desc(c.dst.buffer).fingerprint.is_paged());
            if pages_copied || self.ahead {
                for (buf, page, rows) in self.full_rows(&rec.op) {
                    *self.tainted.entry((buf, page)).or_default() |= rows;
                }
            }
        } else {
            if let Some(args) = rec.args.take() {
                self.patch(&mut rec.op, &args);
                rec.args = Some(args);
            }
            self.check_content(&rec, end);
            if rec.fail {
                self.fail_copy(s, &rec);
            } else {
                self.perform(&rec);
            }
        }
        if rec.fail && (rec.hung || self.opts.context_faults) {
            // The whole side is in error: its streams skip their work and every call fails.
            let side = s / 3;
            if self.in_error[side].is_none() {
                let stream = StreamKind::ALL[s % 3];
                let op = rec.op.name();
                self.in_error[side] = Some(if rec.hung {
                    DeviceFault::Hung {
                        op,
                        stream,
                        after_ns: WATCHDOG_NS,
                    }
                } else {
                    DeviceFault::Failed { op, stream }
                });
                probes::hit(SimProbe::FaultContextInError);
                self.log(&[17, s as u64, rec.id]);
            }
            for st in &mut self.streams[side * 3..side * 3 + 3] {
                st.sticky = true;
            }
        } else if rec.fail && self.opts.sticky_faults && !self.streams[s].sticky {
            probes::hit(SimProbe::FaultSticky);
            self.streams[s].sticky = true;
            self.log(&[14, s as u64, rec.id]);
        }
        if self.opts.trace {
            self.trace.push(Slice {
                op_id: rec.id,
                stream: s,
                name: rec.op.name(),
                start_ns: start,
                end_ns: end,
                detail: op_detail(&rec.op, &self.mem),
                failed: rec.fail,
                skipped,
            });
        }
        self.streams[s].ready_at = end;
        self.advance_stream(s, end);
    }

    /// A launch's arrays as its kernel reads them: from their device ranges, now.
    fn patch(&self, op: &mut Op, args: &LaunchArgs) {
        for &(field, range) in &args.patches {
            let bytes = self.mem.range(range);
            let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
            let ints = match (field, &mut *op) {
                (ArgField::Slots, Op::IndexKStore(o)) => &mut o.slots,
                (ArgField::Slots, Op::KvStore(o)) => &mut o.slots,
                (ArgField::PageTable, Op::IndexLogits(o)) => &mut o.page_table,
                (ArgField::PageTable, Op::TopK(o)) => &mut o.page_table,
                (ArgField::ContextLens, Op::IndexLogits(o)) => &mut o.context_lens,
                (ArgField::ContextLens, Op::TopK(o)) => &mut o.context_lens,
                (ArgField::Rows, o) => {
                    let rows = match o {
                        Op::IndexKStore(o) => &mut o.keys.rows,
                        Op::KvStore(o) => &mut o.rows.rows,
                        Op::QPrep(o) => &mut o.inputs.rows,
                        o => panic!("{} has no drawn rows", o.name()),
                    };
                    assert!(bytes.len() >= 8 * rows.len(), "rows past their upload");
                    for (i, r) in rows.iter_mut().enumerate() {
                        r.token = word(2 * i);
                        r.position = word(2 * i + 1);
                    }
                    continue;
                }
                (f, o) => panic!("{} has no {f:?}", o.name()),
            };
            assert!(bytes.len() >= 4 * ints.len(), "{field:?} past its upload");
            for (i, x) in ints.iter_mut().enumerate() {
                *x = word(i) as i32;
            }
        }
    }

    /// The content oracle on every row the op reads, in the memory it reads them from.
    fn check_content(&mut self, rec: &OpRec, end: u64) {
        let Some(c) = self.content.clone() else {
            return;
        };
        let view = PageView {
            tainted: &self.tainted,
            gen: &self.page_gen,
        };
        let found = c.borrow_mut().check_reads(&rec.op, &self.mem, &view);
        for (oracle, msg) in found {
            self.finding(
                oracle,
                format!("op {} ({}) at {} ns: {msg}", rec.id, rec.op.name(), end),
            );
        }
    }

    /// A failed copy leaves garbage where it was writing, taints the rows it would have
    /// written, and marks its stream so the next record reports the failure.
    fn fail_copy(&mut self, s: usize, rec: &OpRec) {
        self.stats.failed_copies += 1;
        self.streams[s].failed_since_record = true;
        for (j, a) in rec
            .op
            .accesses()
            .into_iter()
            .filter(|a| a.write)
            .enumerate()
        {
            let garbage = self.keyed_bits(KEY_GARBAGE, s, rec.key.wrapping_mul(64) ^ j as u64);
            for (i, b) in self.mem.range_mut(a.range).iter_mut().enumerate() {
                *b = (garbage >> ((i % 8) * 8)) as u8 ^ i as u8;
            }
            self.bump_generations(a.range);
        }
        for (buf, page, rows) in rec.op.spec().full_rows() {
            *self.tainted.entry((buf, page)).or_default() |= rows;
        }
    }

    /// The op's data effect, by the executor; rows it writes in full hold good bytes again.
    /// Bytes it changed outside its declared writes are a finding.
    fn perform(&mut self, rec: &OpRec) {
        let shadows = undeclared::before(&rec.op, rec.id, &self.mem, &mut self.shadow_arena);
        // Undeclared reads are probed by running the CPU reference twice.
        let probed = self.read_probes.entry(rec.op.name()).or_default();
        let reads = match self.exec {
            Executor::Cpu(_) if undeclared::ReadProbe::sampled(rec.id, *probed) => {
                let p = undeclared::ReadProbe::before(&rec.op, &self.mem);
                *probed += p.is_some() as u32;
                p
            }
            _ => None,
        };
        if let Err(e) = self.exec.run(&rec.op, &mut self.mem) {
            self.finding(
                OracleKind::Layout,
                format!("op {} ({}) failed to run: {e}", rec.id, rec.op.name()),
            );
        }
        let stray = reads.and_then(|p| {
            p.after(&rec.op, &mut self.mem, |op, mem| {
                // The first run's error, if any, was reported above.
                let _ = run_op(op, mem);
            })
        });
        if let Some(stray) = stray {
            let changed: Vec<String> = stray.changed.iter().map(|&b| self.describe(b)).collect();
            let msg = format!(
                "op {} ({} {}) reads bytes it did not declare: run again with the bytes beside its declared reads changed (in {}), it wrote byte {} of {} differently",
                rec.id,
                rec.op.name(),
                op_detail(&rec.op, &self.mem),
                changed.join(", "),
                stray.output.1,
                self.describe(stray.output.0)
            );
            self.finding(OracleKind::Undeclared, msg);
        }
        if let Some(stray) = undeclared::after(&shadows, &self.mem, &self.shadow_arena) {
            let msg = format!(
                "op {} ({} {}) changed bytes {}..{} of {}, which it did not declare it writes",
                rec.id,
                rec.op.name(),
                op_detail(&rec.op, &self.mem),
                stray.bytes.start,
                stray.bytes.end,
                self.describe(stray.buffer)
            );
            self.finding(OracleKind::Undeclared, msg);
        }
        let writes: Vec<ByteRange> = rec
            .op
            .accesses()
            .into_iter()
            .filter(|a| a.write)
            .map(|a| a.range)
            .collect();
        for &r in &writes {
            self.bump_generations(r);
        }
        for (buf, page, rows) in self.full_rows(&rec.op) {
            if let Some(m) = self.tainted.get_mut(&(buf, page)) {
                *m &= !rows;
                if *m == 0 {
                    self.tainted.remove(&(buf, page));
                }
            }
        }
        self.pending_tokens(&rec.op);
        if let Op::PageCopy(_) = rec.op {
            self.stats.copy_bytes += writes.iter().map(|r| r.len().0).sum::<u64>();
        }
    }

    /// An engine running one step ahead: a `next_tokens` that ran makes its tokens data and
    /// tells the content oracle the tokens its rows generated (provisionally: the engine
    /// confirms each when it emits it); a store that drew a pending row from tokens that a
    /// skipped `next_tokens` left stale wrote garbage there, like a failed copy (the engine must
    /// discard the step, as it discards the failed one before it).
    fn pending_tokens(&mut self, op: &Op) {
        let drawn = match op {
            Op::NextTokens(o) => {
                self.stale_tokens.remove(&o.out.buffer);
                if let Some(c) = &self.content {
                    let got = tierkv_kernels::cpu::numerics::le_u32s(self.mem.region(o.out));
                    let mut c = c.borrow_mut();
                    for (tag, &token) in o.tags.rows.iter().zip(&got) {
                        c.generated(tag.request, tag.position + 1, token);
                    }
                }
                return;
            }
            Op::IndexKStore(o) => &o.keys,
            Op::KvStore(o) => &o.rows,
            _ => return,
        };
        let Some(t) = drawn.tokens else {
            return;
        };
        if !self.stale_tokens.contains(&t.buffer) {
            return;
        }
        probes::hit(SimProbe::StaleTokensDrawn);
        // A store's full rows are one per slot, in the drawn rows' order.
        for (row, (buf, page, bit)) in drawn.rows.iter().zip(op.spec().full_rows()) {
            if row.pending_index().is_some() {
                *self.tainted.entry((buf, page)).or_default() |= bit;
            }
        }
    }

    /// The token rows `op` writes whole, per page (`OpSpec::full_rows`); a linear copy into a
    /// paged buffer (a pitched copy's row of the runtime's `CopyStrategy::MemcpyRuns`) writes
    /// the pages it covers whole.
    fn full_rows(&self, op: &Op) -> Vec<(BufferId, u64, u64)> {
        let Op::Copy(c) = op else {
            return op.spec().full_rows();
        };
        let desc = self.mem.desc(c.dst.buffer);
        if !desc.fingerprint.is_paged() {
            return Vec::new();
        }
        let pb = desc.fingerprint.page_bytes.max(1);
        let (start, end) = (c.dst.offset.0, c.dst.offset.0 + c.dst.bytes.0);
        (start.div_ceil(pb)..end / pb)
            .map(|p| (c.dst.buffer, p, u64::MAX))
            .collect()
    }

    /// Every paged-buffer page an op writes gets a new write generation (the content oracle's
    /// cache key).
    fn bump_generations(&mut self, r: ByteRange) {
        let desc = self.mem.desc(r.buffer);
        if !desc.fingerprint.is_paged() {
            return;
        }
        let pb = desc.fingerprint.page_bytes.max(1);
        for p in r.start.0 / pb..r.end.0.div_ceil(pb) {
            *self.page_gen.entry((r.buffer, p)).or_default() += 1;
        }
    }

    fn host_access(&mut self, what: &str, buf: BufferId, offset: Bytes, len: usize, write: bool) {
        self.host_actions += 1;
        self.host_vc[HOST] += 1;
        let who = Accessor {
            entity: HOST,
            epoch: self.host_vc[HOST],
            id: self.host_actions,
            what: what.to_string(),
        };
        let vc = self.host_vc;
        let range = ByteRange::new(buf, offset, Bytes(len as u64));
        let races = self.race.access(range, write, &vc, &who);
        self.report_races(races);
    }

    /// Faults stop (the liveness phase of a run): no more slow, torn or failed copies, failed
    /// or refused launches, hangs or late completions. A stream or side already in error stays
    /// so until the engine recovers the device.
    pub fn stop_faults(&mut self) {
        self.opts.slow_copy_rate = 0.0;
        self.opts.failed_copy_rate = 0.0;
        self.opts.failed_enqueue_rate = 0.0;
        self.opts.failed_kernel_rate = 0.0;
        self.opts.torn_copy_rate = 0.0;
        self.opts.completion_delay_ns = 0;
        self.opts.refused_launch_rate = 0.0;
        self.opts.hang_rate = 0.0;
        self.opts.driver_fault_rate = 0.0;
    }

    /// Queues op `op` on stream `s`: its id, its happens-before clock and the race check of its
    /// accesses, its duration and fate.
    /// Pushes `op` onto stream `s`; `key` numbers it for its keyed fault draws.
    fn push_op(&mut self, s: usize, op: Op, key: u64, args: Option<Box<LaunchArgs>>) {
        let id = self.next_op;
        self.next_op += 1;
        // Happens-before: the op follows everything its stream and the host know of.
        let mut vc = self.streams[s].vc;
        join(&mut vc, &self.host_vc);
        vc[s] += 1;
        self.streams[s].vc = vc;
        let who_what = format!("{} {}", op.name(), op_detail(&op, &self.mem));
        let launch_reads = args.iter().flat_map(|a| &a.reads).map(|&range| Access {
            range,
            write: false,
        });
        let launch_writes = args
            .iter()
            .flat_map(|a| &a.writes)
            .map(|&range| Access { range, write: true });
        for a in launch_writes.chain(op.accesses()).chain(launch_reads) {
            let who = Accessor {
                entity: s,
                epoch: vc[s],
                id,
                what: who_what.clone(),
            };
            let races = self.race.access(a.range, a.write, &vc, &who);
            if !races.is_empty() {
                self.report_races(races);
            }
        }
        let (duration, fail, hung) = self.duration(&op, s, key);
        self.log(&[9, s as u64, id, duration, fail as u64]);
        let now = self.host.get();
        self.streams[s].queue.push_back(Entry::Op(Box::new(OpRec {
            id,
            op,
            args,
            fail,
            hung,
            duration,
            enq_ns: now,
            key,
        })));
        self.pump(now);
        self.advance_stream(s, now);
    }

    /// A torn copy (`torn_copy_rate`): the op as two page copies, the first half of its pages
    /// first. `None`: the op stays whole.
    fn tear(&mut self, op: &Op, s: usize, n: u64) -> Option<(Op, Op)> {
        let Op::PageCopy(c) = op else {
            return None;
        };
        let pages: u32 = c.runs.iter().map(|r| r.count).sum();
        if pages < 2
            || self.opts.torn_copy_rate <= 0.0
            || self.keyed(KEY_TORN, s, n) >= self.opts.torn_copy_rate
        {
            return None;
        }
        probes::hit(SimProbe::FaultCopyTorn);
        let (mut first, mut second) = (Vec::new(), Vec::new());
        let mut left = pages / 2;
        for r in &c.runs {
            let take = r.count.min(left);
            left -= take;
            if take > 0 {
                first.push(PageRun { count: take, ..*r });
            }
            if take < r.count {
                second.push(PageRun {
                    src: PageId(r.src.0 + take),
                    dst: PageId(r.dst.0 + take),
                    count: r.count - take,
                });
            }
        }
        let half = |runs| Op::PageCopy(PageCopy { runs, ..c.clone() });
        Some((half(first), half(second)))
    }

    /// Whether any stream still has work.
    pub fn busy(&self) -> bool {
        self.streams
            .iter()
            .any(|s| s.running.is_some() || !s.queue.is_empty())
    }

    /// Runs the device until every stream is idle (end of a run).
    pub fn drain(&mut self) {
        while let Some(Reverse((t, _, s))) = self.heap.pop() {
            self.complete(s, t);
        }
        // Nothing runs and nothing can start: a stream with work left waits for a record that
        // no stream will reach.
        for (i, st) in self.streams.iter().enumerate() {
            assert!(
                st.running.is_none(),
                "{} stream runs an op after the drain",
                entity_name(i)
            );
            assert!(
                st.queue.is_empty(),
                "deadlock: the {} stream waits forever ({} entries left)",
                entity_name(i),
                st.queue.len()
            );
        }
    }

    /// What the engine asked of the current side: the tokens side 0 stores and the pages its
    /// load stream fills (the runner's per-step promises), and the bytes a page copy writes
    /// (the record log). Refused asks count too.
    pub(crate) fn note_asked(&mut self, stream: StreamKind, op: &Op) {
        let s = stream_index(self.side, stream);
        if let (Op::KvStore(o), 0) = (op, self.side) {
            self.stored
                .extend(o.tags.rows.iter().map(|t| (t.request, t.position)));
            let page = tierkv_kernels::spec::format::PAGE_TOKENS as i32;
            self.stored_pages.extend(
                o.tags
                    .rows
                    .iter()
                    .zip(&o.slots)
                    .filter(|(_, &slot)| slot >= 0)
                    .map(|(t, &slot)| (t.request, (slot / page) as u32)),
            );
        }
        if let (Op::PageCopy(c), StreamKind::Load, 0) = (op, stream, self.side) {
            self.loaded.extend(
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
        for (buf, page, rows) in op.spec().full_rows() {
            *self.tainted.entry((buf, page)).or_default() |= rows;
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
        self.race.register(id, cell);
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

    /// Whether the current side is in error (its calls fail, CUDA drops its callbacks).
    pub(crate) fn side_in_error(&self) -> bool {
        self.in_error[self.side].is_some()
    }

    /// Fails a call of a side in error (`what` numbers the call kind in the log).
    pub(crate) fn refuse(&mut self, what: u64) -> Result<(), DeviceError> {
        self.refuse_in_error(what)
    }

    /// The simulated driver's calls may fail by faults of their own from now on (the engine is
    /// built: its construction meets the allocation faults of `fail_alloc_nth` alone).
    pub fn arm_driver_faults(&mut self) {
        self.driver_armed = true;
    }

    /// Whether the simulated driver's call number `n` of kind `call` by entity `e` (the
    /// driver's own numbering of a side's streams and its calls of no stream) is refused by a fault of its own
    /// (`GpuOptions::driver_fault_rate`, times `factor`, at most one call in four: the engine
    /// repeats a refused call a few times, and a call refused every time would stop it).
    /// Logged when it is.
    pub(crate) fn driver_refuses(&mut self, call: u64, e: usize, n: u64, factor: f64) -> bool {
        let rate = (self.opts.driver_fault_rate * factor).min(0.25);
        let refused =
            self.driver_armed && rate > 0.0 && self.keyed(KEY_DRIVER_CALL + call, e, n) < rate;
        if refused {
            self.log(&[31, call, e as u64, n]);
        }
        refused
    }

    /// Whether any token row of this page holds bytes from a failed copy.
    pub fn is_tainted(&self, b: BufferId, page: PageId) -> bool {
        self.tainted.contains_key(&(b, page.0 as u64))
    }
}

impl Executor {
    #[cfg(feature = "cuda")]
    fn cuda() -> Result<Executor, DeviceError> {
        Ok(Executor::Cuda(Box::new(crate::cuda_exec::CudaExec::new()?)))
    }
    #[cfg(not(feature = "cuda"))]
    fn cuda() -> Result<Executor, DeviceError> {
        Err(DeviceError::Backend {
            detail: "--device cuda needs a build with `--features cuda`".into(),
        })
    }
    fn run(&mut self, op: &Op, mem: &mut Memory) -> Result<(), DeviceError> {
        match self {
            Executor::Cpu(kept) => match op {
                Op::SparseRead(o) => {
                    let buffer = o.kv;
                    let hashes = &mut kept.row_hashes;
                    run_sparse_read_hashed(o, mem, &mut |at, row| hashes.get(buffer, at, row))
                }
                Op::IndexLogits(o) => run_index_logits_from_pages(
                    o,
                    mem,
                    &mut DecodedPages {
                        buffer: o.k,
                        kept: &mut kept.pages,
                    },
                ),
                _ => run_op(op, mem),
            },
            #[cfg(feature = "cuda")]
            Executor::Cuda(c) => c.run(op, mem),
        }
    }
}

/// What the CPU executor keeps from op to op, each entry with the bytes it was computed from and
/// used only while they are unchanged: compared byte for byte rather than trusted to the write
/// generations, so that no write the simulator did not account for can leave a stale entry. At
/// most one entry per row or page of the pools read.
#[derive(Default)]
struct Kept {
    row_hashes: RowHashes,
    pages: KeptPages,
}

/// (buffer, page index) → the page as it was decoded.
type KeptPages = FastMap<(BufferId, usize), KeptPage>;

/// An index-K page's bytes, the dtype they were decoded as, and its keys.
struct KeptPage {
    bytes: Box<[u8]>,
    dtype: IndexKDtype,
    keys: Box<KeyBlock>,
}

/// A logits op's pages, decoded once and kept while their bytes stay the same (a query reads
/// the pages the previous one did).
struct DecodedPages<'a> {
    buffer: BufferId,
    kept: &'a mut KeptPages,
}

impl PageKeys for DecodedPages<'_> {
    fn page(&mut self, dtype: IndexKDtype, index: usize, bytes: &[u8]) -> &KeyBlock {
        let e = self
            .kept
            .entry((self.buffer, index))
            .or_insert_with(|| KeptPage {
                bytes: Box::from(&[][..]),
                dtype,
                keys: KeyBlock::new(),
            });
        if *e.bytes != *bytes || e.dtype != dtype {
            if e.bytes.len() == bytes.len() {
                e.bytes.copy_from_slice(bytes);
            } else {
                e.bytes = bytes.into();
            }
            e.dtype = dtype;
            e.keys.decode(dtype, bytes);
        }
        &e.keys
    }
}

/// The `row_hash` of every KV row a `sparse_read` hashed, by where it lies (a query selects the
/// rows the previous one did, give or take a few).
#[derive(Default)]
struct RowHashes {
    /// (buffer, byte offset) → the row's bytes and their hash.
    rows: FastMap<(BufferId, usize), KeptRow>,
}

type KeptRow = (Box<[u8]>, u64);

impl RowHashes {
    fn get(&mut self, buffer: BufferId, at: usize, row: &[u8]) -> u64 {
        match self.rows.get_mut(&(buffer, at)) {
            Some((bytes, h)) if **bytes == *row => *h,
            Some((bytes, h)) if bytes.len() == row.len() => {
                bytes.copy_from_slice(row);
                *h = row_hash(row);
                *h
            }
            _ => {
                let h = row_hash(row);
                self.rows.insert((buffer, at), (row.into(), h));
                h
            }
        }
    }
}

struct PageView<'a> {
    tainted: &'a crate::fasthash::FastMap<(BufferId, u64), u64>,
    gen: &'a crate::fasthash::FastMap<(BufferId, u64), u64>,
}

impl crate::oracles::content::PageState for PageView<'_> {
    fn tainted_rows(&self, buf: BufferId, page: u64) -> u64 {
        self.tainted.get(&(buf, page)).copied().unwrap_or(0)
    }
    fn generation(&self, buf: BufferId, page: u64) -> u64 {
        self.gen.get(&(buf, page)).copied().unwrap_or(0)
    }
}

/// A stream's or the host's name in reports (side 1's streams are a pair's decode engine's).
pub fn entity_name(e: usize) -> &'static str {
    const NAMES: [&str; STREAMS] = [
        "compute",
        "load",
        "write",
        "decode compute",
        "decode load",
        "decode write",
    ];
    if e == HOST {
        "host"
    } else {
        NAMES[e]
    }
}

/// A short human description of an op for traces and reports.
pub fn op_detail(op: &Op, mem: &Memory) -> String {
    op.spec().detail(&|b| mem.desc(b).role)
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
        let cell = if desc.fingerprint.is_paged() {
            desc.fingerprint.page_bytes
        } else {
            4096
        };
        self.race.register(id, cell);
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
                    Some(at) if at <= now => {
                        join(&mut self.host_vc, &r.vc);
                        self.observed(rec, now);
                        if r.failed {
                            if r.counted {
                                self.failure_seen(r.stream, ev);
                            }
                            EventState::Failed
                        } else {
                            EventState::Done
                        }
                    }
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
                    self.host.set(at);
                }
                let r = self.records[&rec];
                join(&mut self.host_vc, &r.vc);
                let now = self.host.get();
                self.observed(rec, now);
                if r.failed {
                    if r.counted {
                        self.failure_seen(r.stream, ev);
                    }
                    EventState::Failed
                } else {
                    EventState::Done
                }
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
        if self.opts.context_faults || self.opts.hang_rate > 0.0 {
            let now = self.host.get();
            self.pump(now);
        }
        // A side in error refuses the op below: the recovery oracle judges the per-stream model.
        if let (Some(ev), None) = (self.streams[s].failure_seen, self.in_error[self.side]) {
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
        if class == OpClass::Kernel
            && self.opts.refused_launch_rate > 0.0
            && self.keyed(KEY_LAUNCH_REFUSED, s, n) < self.opts.refused_launch_rate
        {
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
        if in_error
            || (class == OpClass::PageCopy
                && self.opts.failed_enqueue_rate > 0.0
                && self.keyed(KEY_ENQUEUE_REFUSED, s, n) < self.opts.failed_enqueue_rate)
        {
            probes::hit_if(SimProbe::FaultEnqueueFailed, !in_error);
            self.log(&[12, s as u64]);
            if !launch {
                self.note_refused(stream, &op);
            }
            if let (true, Some(cause)) = (in_error, self.in_error[self.side]) {
                return Err(DeviceError::InError { cause });
            }
            return Err(DeviceError::Backend {
                detail: format!("injected: {} refused at enqueue", op.name()),
            });
        }
        // Each op's fault draws are keyed by its enqueue call's number and its half (a torn
        // copy's two ops), so a torn copy does not move the draws of the ops after it.
        match self.tear(&op, s, n) {
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
        let mut was = self.in_error[self.side].take().is_some();
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use tierkv_engine::layout::PageFormat;

    /// What the executor keeps is used only while its bytes are unchanged: a row or page whose
    /// bytes changed is hashed or decoded again, whoever changed them.
    #[test]
    fn kept_entries_follow_the_bytes() {
        let mut kept = Kept::default();
        let b = BufferId(7);
        let mut row = vec![3u8; 64];
        let h = kept.row_hashes.get(b, 128, &row);
        assert_eq!(h, row_hash(&row));
        row[5] = 4;
        assert_eq!(kept.row_hashes.get(b, 128, &row), row_hash(&row));
        assert_ne!(kept.row_hashes.get(b, 128, &row), h);

        let dtype = IndexKDtype::Bf16;
        let mut page = vec![0u8; PageFormat::IndexK(dtype).page_bytes() as usize];
        page[0..2].copy_from_slice(&half::bf16::from_f32(1.5).to_bits().to_le_bytes());
        let mut pages = DecodedPages {
            buffer: b,
            kept: &mut kept.pages,
        };
        assert_eq!(pages.page(dtype, 2, &page).kt[0][0], 1.5);
        page[0..2].copy_from_slice(&half::bf16::from_f32(-2.0).to_bits().to_le_bytes());
        assert_eq!(pages.page(dtype, 2, &page).kt[0][0], -2.0);
        // Another page and another buffer are entries of their own.
        assert_eq!(pages.page(dtype, 3, &vec![0u8; page.len()]).kt[0][0], 0.0);
        assert_eq!(pages.page(dtype, 2, &page).kt[0][0], -2.0);
        let mut other = DecodedPages {
            buffer: BufferId(8),
            kept: &mut kept.pages,
        };
        assert_eq!(other.page(dtype, 2, &vec![0u8; page.len()]).kt[0][0], 0.0);
        assert_eq!(kept.pages.len(), 3);
    }

    /// The executor's kept paths write `run_op`'s very bytes, op after op, while the pools'
    /// bytes change under them (a few bytes, a whole page) and across both index-K dtypes.
    #[test]
    fn kept_paths_equal_the_reference() {
        use tierkv_engine::layout::{BufferKind, KvDtype, LayerId, LayoutFingerprint};
        let mut rng = crate::rng::Rng::new(0x5EED);
        // Small bytes: finite fp8 and bf16 values and f32 scales.
        let fill = |rng: &mut crate::rng::Rng, b: &mut [u8]| {
            b.iter_mut().for_each(|x| *x = rng.below(0x38) as u8)
        };
        let pool = |mem: &mut Memory, kind, format: PageFormat, pages: u64| {
            mem.alloc(BufferDesc {
                role: BufferRole::Pool {
                    kind,
                    layer: LayerId(0),
                },
                tier: MemoryTier::Device,
                bytes: Bytes(pages * format.page_bytes()),
                fingerprint: format.fingerprint(),
            })
        };
        let scratch = |mem: &mut Memory, bytes: u64| {
            let buffer = mem.alloc(BufferDesc {
                role: BufferRole::Scratch { name: "test" },
                tier: MemoryTier::Device,
                bytes: Bytes(bytes),
                fingerprint: LayoutFingerprint::unpaged(bytes),
            });
            Region {
                buffer,
                offset: Bytes::ZERO,
                bytes: Bytes(bytes),
            }
        };
        let tags = RowTags {
            layer_global: 0,
            rows: vec![
                RowTag {
                    request: 0,
                    position: 0
                };
                2
            ],
        };
        for dtype in [IndexKDtype::Fp8, IndexKDtype::Bf16] {
            let (heads, pages, pt_stride) = (3u32, 6u64, 5u32);
            let mut mem = Memory::default();
            let ik = pool(
                &mut mem,
                BufferKind::IndexK,
                PageFormat::IndexK(dtype),
                pages,
            );
            let kv_format = PageFormat::Kv(KvDtype::Fp8Packed);
            let kv = pool(&mut mem, BufferKind::Kv, kv_format, pages);
            let (q, w) = (scratch(&mut mem, 2 * 3 * 128), scratch(&mut mem, 2 * 3 * 4));
            let (out, sel, digests) = (
                scratch(&mut mem, 2 * 320 * 4),
                scratch(&mut mem, 2 * 16 * 4),
                scratch(&mut mem, 2 * 8),
            );
            for b in [ik, kv, q.buffer, w.buffer] {
                fill(&mut rng, &mut mem.bufs[b.0 as usize]);
            }
            let slots: Vec<u8> = (0..32)
                .flat_map(|_| (rng.below(pages * 64) as i32).to_le_bytes())
                .collect();
            mem.bufs[sel.buffer.0 as usize].copy_from_slice(&slots);
            let page_table: Vec<i32> = (0..2 * pt_stride)
                .map(|_| rng.below(pages) as i32)
                .collect();
            let logits = Op::IndexLogits(IndexLogits {
                dtype,
                heads,
                q,
                w,
                k: ik,
                page_table: page_table.clone(),
                pt_stride,
                context_lens: vec![100, 300],
                out,
                out_stride: 320,
                tags: tags.clone(),
            });
            let read = Op::SparseRead(SparseRead {
                dtype: KvDtype::Fp8Packed,
                k: 16,
                slots: sel,
                kv,
                page_table,
                pt_stride,
                context_lens: vec![100, 300],
                out: digests,
                tags: tags.clone(),
            });
            let mut exec = Executor::Cpu(Box::default());
            let mut reference = Memory {
                bufs: mem.bufs.clone(),
                descs: mem.descs.clone(),
            };
            for round in 0..4 {
                match round {
                    1 => {
                        // A few bytes of a page and of a row the ops read.
                        for b in [ik, kv] {
                            let at = rng.below(mem.bufs[b.0 as usize].len() as u64) as usize;
                            mem.bufs[b.0 as usize][at] ^= 0x11;
                            reference.bufs[b.0 as usize][at] ^= 0x11;
                        }
                    }
                    2 => {
                        let n = mem.bufs[ik.0 as usize].len();
                        fill(&mut rng, &mut mem.bufs[ik.0 as usize][..n / 2]);
                        reference.bufs[ik.0 as usize] = mem.bufs[ik.0 as usize].clone();
                    }
                    _ => {}
                }
                for op in [&logits, &read] {
                    exec.run(op, &mut mem).expect("the kept path runs");
                    run_op(op, &mut reference).expect("the reference runs");
                }
                for r in [out, digests] {
                    assert_eq!(
                        mem.region(r),
                        reference.region(r),
                        "{dtype:?} round {round}: the kept path wrote other bytes"
                    );
                }
            }
        }
    }
}
