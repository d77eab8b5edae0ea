//! The simulated driver: the production runtime (`tierkv_engine::runtime::driven`) runs on it
//! in a seed, so that what the runtime does below the `Device` trait — staging each op's
//! arguments through a pinned ring, stream-ordered scratch allocations, pageable copies, the
//! completion ring's host callbacks — runs under the simulator's schedules, faults and race
//! detector.
//!
//! Each driver call becomes a call of one side of the simulated GPU (`gpu/`):
//! - allocations are its buffers (a stream-ordered free returns the buffer to a pool that a
//!   later allocation on the same stream reuses, as CUDA's pool may without any event);
//! - pinned writes and reads are the host's accesses, which the race detector checks against
//!   the copies still queued from the same bytes;
//! - copies are linear copies on the stream; a pageable copy takes the host's bytes into a
//!   bounce buffer of the driver's own at once (as CUDA does before it returns; the race detector
//!   does not see that write) and copies from it on the stream;
//! - a kernel launch is the engine op it belongs to, rebuilt on the simulator's buffers, with
//!   every device argument declared as a read and its arrays (slots, page tables, context
//!   lengths, drawn rows) taken from their uploaded copies when it completes, so a kernel
//!   computes with what the uploads left on the device. The launches that draw the model's
//!   inputs, resolve pending tokens and gather RoPE rows are fused into the launch that consumes
//!   their output: the consumer declares their reads and writes, and its CPU reference computes
//!   what they compute (from the drawn rows it reads);
//! - events are the GPU's events; the runtime's own (staging copies, callbacks) are internal,
//!   so the record log counts only the engine's;
//! - a stream capture records each launch on the capturing stream as the op it would queue
//!   (fused launches as above); the graph it makes runs those ops, in order, at each of its
//!   launches, and a capture of the same op kinds updates it in place. Any other call on a
//!   capturing stream, a host wait, query or synchronous free during a capture, and a graph
//!   launched over an allocation that is not the one of its capture (an id reused is another
//!   allocation: each has a serial) are the runtime's errors, and panic;
//! - a host callback is an internal record on its stream, run by the driver at its next call
//!   once the record completed and its callback time came (`GpuOptions::completion_delay_ns`),
//!   and dropped when its side is in error or the record failed (CUDA does not run host
//!   functions after an error).
//!
//! Faults: once the engine is built, each call that CUDA can refuse fails by a draw of its own
//! (`GpuOptions::driver_fault_rate`, keyed by the call's kind, stream and number among the
//! calls of that kind on that stream; no draw on a side in error, whose calls meet its error):
//! allocations that take new memory from the device twenty times as often as the rest (a
//! stream-ordered one that grows its pool, `ALLOC_FAULT_FACTOR`) or forty times (a synchronous
//! one, `SYNC_ALLOC_FAULT_FACTOR`), with out-of-memory; event creations with out-of-memory and launches with out-of-resources (as
//! `Backend` errors); copies, pitched and pageable copies, event records, stream waits and host
//! callbacks refused with no CUDA error code (see `Call::cuda`). A launch also meets the
//! simulated GPU's draws at enqueue (a kernel's refused launch) and its faults as it runs; a
//! side in error refuses allocations on a stream, copies, launches, event records and waits,
//! pool trims, stream synchronisations and host callbacks. A pool trim gives the freed buffers
//! back to the device, where any stream's next growth takes them again without a fault. Not
//! modelled: a pitched copy is its rows as linear copies, which no copy fault of the simulated
//! GPU reaches (only page copies fail or tear as they run). Timing events measure between the
//! simulated completions of their records (`GpuKnobs::runtime_timing`).

use crate::gpu::{ArgField, LaunchArgs, SimSide};
use crate::probes::{self, SimProbe};
use std::collections::{BTreeMap, VecDeque};
use tierkv_engine::device::*;
use tierkv_engine::layout::{Bytes, LayoutFingerprint};
use tierkv_engine::runtime::driven::DrivenDevice;
use tierkv_engine::runtime::driver::{
    Copy2d, Driver, DrvEvent, DrvGraph, EventUse, HostCallback, Launch, Mem, MemTable, Ptr,
};

/// Race-detector cells of a staging ring: its regions start on 256-byte boundaries, so two
/// regions never share a cell. (The other buffers of the driver are one op's each: one cell.)
const DRIVER_CELL_BYTES: u64 = 256;

/// A stream-ordered allocation that grows its pool fails this many times as often as another
/// driver call (`GpuOptions::driver_fault_rate`): where a serving process meets out-of-memory
/// in practice.
const ALLOC_FAULT_FACTOR: f64 = 20.0;

/// A synchronous allocation after the engine's construction (a recreated context's buffers)
/// fails this many times as often as another driver call. Few are made, only after a
/// recreation: at twenty times, 4.6% of 2,000 default seeds met one (run 91); at forty, the
/// runtime's path for it is reached in more than the 5% of seeds issue 30 asks of an error path.
const SYNC_ALLOC_FAULT_FACTOR: f64 = 40.0;

/// What a driver allocation is on the simulated GPU.
#[derive(Clone, Copy, Debug)]
struct SimMem {
    buf: BufferId,
    /// A stream-ordered allocation: its buffer goes back to the pool when freed.
    pooled: bool,
    /// Where the allocation ends in its buffer: the buffer's bytes (at least the allocation's),
    /// but for an import, the end of the range imported (a copy past it is past what the server
    /// registered).
    cap: u64,
    /// Where the allocation starts in its buffer: 0, but for an import of part of an allocation
    /// ([`Driver::import`]).
    at: u64,
    /// Which allocation of the driver it is (its id may be reused after its free; this is not).
    serial: u64,
}

/// The launches of a graph: each kernel op as it was queued at its capture (its device
/// arguments and arrays as the capture saw them), and the allocations they name, each with its
/// serial.
#[derive(Clone, Debug, Default)]
struct SimGraph {
    nodes: Vec<(Op, LaunchArgs)>,
    mems: Vec<(Mem, u64)>,
}

/// A capture in progress on one stream: its graph so far, and whether a launch failed in it
/// (CUDA invalidates such a capture: its end makes no graph).
#[derive(Default)]
struct Capture {
    graph: SimGraph,
    failed: bool,
}

/// The simulated address space of the driver's allocations: allocation `m` starts at
/// `(m + 1) << ADDRESS_SHIFT` (each is far smaller than 2⁴⁰ bytes).
const ADDRESS_SHIFT: u32 = 40;

/// A launch that the consumer of its output absorbs (see the module doc).
#[derive(Clone, Debug, Default)]
struct Fused {
    /// What it read.
    reads: Vec<Ptr>,
    /// For a draw: the uploaded rows it drew from.
    rows: Option<Ptr>,
    /// For a pending-token resolution of uploaded rows: the tokens region it read.
    tokens: Option<Ptr>,
}

/// A pageable copy's bounce buffer, free once its copy completed.
struct Bounce {
    buf: BufferId,
    cap: u64,
    done: EventId,
}

/// The driver calls that fail by faults of their own (`GpuOptions::driver_fault_rate`). The
/// other calls fail in CUDA only on invalid arguments or a context in error, which the
/// simulated GPU's sides model: host reads and writes of pinned memory are the host's own copies, frees and
/// pool trims give memory back, `bind` makes the context current, and synchronisations and
/// event queries report the context's error.
#[derive(Clone, Copy, Debug)]
enum Call {
    Alloc,
    AllocAsync,
    CopyAsync,
    Copy2d,
    CopyPageable,
    Launch,
    EventCreate,
    EventRecord,
    StreamWait,
    HostCallback,
}

/// The entity of a call that names no stream (an allocation, an event's creation): one past
/// the streams.
const NO_STREAM: usize = StreamKind::ALL.len();
/// Entities a side's calls are counted and keyed by: its streams, then `NO_STREAM`.
const CALL_ENTITIES: usize = NO_STREAM + 1;

impl Call {
    const COUNT: usize = Call::HostCallback as usize + 1;

    fn probe(self) -> SimProbe {
        match self {
            Call::Alloc => SimProbe::DriverRefusedAlloc,
            Call::AllocAsync => SimProbe::DriverRefusedAllocAsync,
            Call::CopyAsync => SimProbe::DriverRefusedCopyAsync,
            Call::Copy2d => SimProbe::DriverRefusedCopy2d,
            Call::CopyPageable => SimProbe::DriverRefusedCopyPageable,
            Call::Launch => SimProbe::DriverRefusedLaunch,
            Call::EventCreate => SimProbe::DriverRefusedEventCreate,
            Call::EventRecord => SimProbe::DriverRefusedEventRecord,
            Call::StreamWait => SimProbe::DriverRefusedStreamWait,
            Call::HostCallback => SimProbe::DriverRefusedHostCallback,
        }
    }

    /// The CUDA call, and the error CUDA documents for it that the refusal stands for, if
    /// any. Copies, records, waits and host callbacks have none but invalid arguments and a
    /// lost context: their refusals are drawn so that the runtime's error paths after them run.
    fn cuda(self) -> (&'static str, Option<&'static str>) {
        const OOM: Option<&str> = Some("CUDA_ERROR_OUT_OF_MEMORY");
        match self {
            Call::Alloc => ("cuMemAlloc", OOM),
            Call::AllocAsync => ("cuMemAllocAsync", OOM),
            Call::CopyAsync => ("cuMemcpyAsync", None),
            Call::Copy2d => ("cuMemcpy2DAsync", None),
            Call::CopyPageable => ("cuMemcpyHtoDAsync", None),
            Call::Launch => ("cuLaunchKernel", Some("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")),
            Call::EventCreate => ("cuEventCreate", OOM),
            Call::EventRecord => ("cuEventRecord", None),
            Call::StreamWait => ("cuStreamWaitEvent", None),
            Call::HostCallback => ("cuLaunchHostFunc", None),
        }
    }

    /// The driver's error for a refused call that is not an allocation.
    fn refusal(self) -> DeviceError {
        let detail = match self.cuda() {
            (call, Some(code)) => format!("{call}: {code} (injected)"),
            (call, None) => format!("{call}: refused (injected)"),
        };
        DeviceError::Backend { detail }
    }
}

/// A host callback waiting for its record.
struct Pending {
    rec: u64,
    /// The event whose record `rec` is, when the callback came right behind it.
    behind: Option<EventId>,
    /// The internal event recorded for it, if it has one of its own.
    event: Option<EventId>,
    cb: HostCallback,
}

pub struct SimDriver {
    pub(crate) side: SimSide,
    mems: MemTable<SimMem>,
    /// Freed stream-ordered buffers: (capacity, the stream that freed it) → buffers.
    pool: BTreeMap<(u64, usize), Vec<BufferId>>,
    /// Buffers a pool trim gave back to the device, by capacity.
    trimmed: BTreeMap<u64, Vec<BufferId>>,
    /// Driver events → the GPU's events.
    events: Vec<EventId>,
    /// Per driver event, whether it is a timing event (`EventUse::Timing`).
    timing: Vec<bool>,
    /// Internal events free for a callback or a synchronisation.
    spare_events: Vec<EventId>,
    /// Fused launches by the start of their output (allocation, offset).
    fused: BTreeMap<(Mem, u64), Fused>,
    bounces: Vec<Bounce>,
    callbacks: VecDeque<Pending>,
    /// Per pinned allocation, where the host last wrote it (a staging ring wraps below it).
    last_write: BTreeMap<Mem, u64>,
    /// Per stream, the event recorded last if nothing was queued on the stream since.
    last_record: [Option<EventId>; 3],
    /// Per event, the record behind which its latest callback ran.
    callback_ran: BTreeMap<EventId, u64>,
    /// Per call kind and stream (and one entry past the streams for calls of none), the calls
    /// made: each call's number keys its fault draw.
    calls: [[u64; CALL_ENTITIES]; Call::COUNT],
    /// Per stream, its capture in progress.
    captures: [Option<Capture>; StreamKind::ALL.len()],
    /// The executable graphs, by `DrvGraph` id.
    graphs: MemTable<SimGraph>,
    /// Allocations made so far (the next one's serial).
    serials: u64,
}

impl SimDriver {
    pub fn new(side: SimSide) -> SimDriver {
        SimDriver {
            side,
            mems: MemTable::default(),
            pool: BTreeMap::new(),
            trimmed: BTreeMap::new(),
            events: Vec::new(),
            timing: Vec::new(),
            spare_events: Vec::new(),
            fused: BTreeMap::new(),
            bounces: Vec::new(),
            callbacks: VecDeque::new(),
            last_write: BTreeMap::new(),
            last_record: [None; 3],
            callback_ran: BTreeMap::new(),
            calls: [[0; CALL_ENTITIES]; Call::COUNT],
            captures: std::array::from_fn(|_| None),
            graphs: MemTable::default(),
            serials: 0,
        }
    }

    /// The next allocation's serial.
    fn serial(&mut self) -> u64 {
        self.serials += 1;
        self.serials
    }

    /// Panics when `what`, a call CUDA refuses during a capture or would record into its graph,
    /// comes while stream `s` (`None`: any stream) captures: the runtime makes only launches on
    /// a capturing stream and waits for nothing meanwhile (`Driver::capture_begin`).
    fn outside_capture(&self, what: &str, s: Option<StreamKind>) {
        let open = |i: usize| self.captures[i].is_some();
        let during = match s {
            Some(s) => open(s.index()),
            None => (0..self.captures.len()).any(open),
        };
        assert!(!during, "the runtime called {what} during a stream capture");
    }

    /// Whether this call (of kind `call`, on stream `s` or none) fails by a fault of its own
    /// (`GpuOptions::driver_fault_rate`, times `factor`).
    /// A side in error draws nothing: the call meets the context's error instead, as in CUDA.
    fn refused(&mut self, call: Call, s: Option<StreamKind>, factor: f64) -> bool {
        let e = s.map_or(NO_STREAM, StreamKind::index);
        let n = self.calls[call as usize][e];
        self.calls[call as usize][e] += 1;
        let entity = self.side.side * CALL_ENTITIES + e;
        let mut g = self.side.at();
        if g.side_in_error() {
            return false;
        }
        let refused = g.driver_refuses(call as u64, entity, n, factor);
        probes::hit_if(call.probe(), refused)
    }

    /// A linear copy on `s` (no fault of its own drawn).
    fn linear(&mut self, s: StreamKind, dst: Ptr, src: Ptr) -> Result<(), DeviceError> {
        self.deliver();
        self.last_record[s.index()] = None;
        let op = Op::Copy(LinearCopy {
            src: self.region(src),
            dst: self.region(dst),
        });
        self.side.at().enqueue(s, op)
    }

    fn mem(&self, m: Mem) -> SimMem {
        *self.mems.get(m)
    }

    /// The device address of allocation `mem` in the simulated address space (what a server's
    /// tensor would report as its data pointer), for [`Driver::import`].
    pub fn address(&self, mem: Mem) -> u64 {
        let m = self.mem(mem);
        ((u64::from(mem.0) + 1) << ADDRESS_SHIFT) + m.at
    }

    /// The simulator's bytes of a range.
    fn range(&self, p: Ptr) -> ByteRange {
        let m = self.mem(p.mem);
        let p = Ptr {
            offset: Bytes(p.offset.0 + m.at),
            ..p
        };
        assert!(
            p.offset.0 + p.bytes.0 <= m.cap,
            "range {}+{} past allocation {} of {} bytes",
            p.offset.0,
            p.bytes.0,
            p.mem.0,
            m.cap
        );
        ByteRange::new(m.buf, p.offset, p.bytes)
    }

    /// The simulator's region of a range, held to its allocation as [`SimDriver::range`] holds it.
    fn region(&self, p: Ptr) -> Region {
        let r = self.range(p);
        Region {
            buffer: r.buffer,
            offset: r.start,
            bytes: p.bytes,
        }
    }

    fn buffer(&self, p: Ptr) -> BufferId {
        self.mem(p.mem).buf
    }

    /// An internal event (reused once its callback ran or its wait returned).
    fn spare_event(&mut self) -> Result<EventId, DeviceError> {
        match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => self.side.at().new_internal_event(),
        }
    }

    /// Runs the host callbacks whose time came, in order; drops them all when the side is in
    /// error.
    fn deliver(&mut self) {
        while let Some(p) = self.callbacks.front() {
            let mut g = self.side.at();
            let due = if g.side_in_error() {
                Some(false)
            } else {
                g.callback_due(p.rec)
            };
            drop(g);
            let Some(runs) = due else {
                return;
            };
            let p = self.callbacks.pop_front().expect("front");
            if runs {
                (p.cb)();
                if let Some(ev) = p.behind {
                    self.callback_ran.insert(ev, p.rec);
                }
            } else {
                probes::hit(SimProbe::DriverCallbackDropped);
            }
            self.spare_events.extend(p.event);
        }
    }

    /// `p` and every range a fused launch behind it read (into `a.reads`) or wrote (`p` itself,
    /// or rows it resolved in place: into `a.writes`).
    fn reads_behind(&self, p: Ptr, a: &mut LaunchArgs) {
        a.reads.push(self.range(p));
        if let Some(f) = self.fused.get(&(p.mem, p.offset.0)) {
            a.writes.push(self.range(p));
            for &r in &f.reads {
                self.reads_behind(r, a);
            }
        }
    }

    /// The drawn rows `d` of an op whose draw wrote `out`: its pending rows read the tokens on
    /// the simulator's buffers, and its rows are taken from their upload at completion.
    fn redraw(&self, d: &mut Drawn, out: Ptr, a: &mut LaunchArgs) {
        let rows = self.fused[&(out.mem, out.offset.0)]
            .rows
            .expect("a draw's output");
        let tokens = self
            .fused
            .get(&(rows.mem, rows.offset.0))
            .and_then(|f| f.tokens);
        assert_eq!(d.tokens.is_some(), tokens.is_some(), "pending rows lost");
        d.tokens = tokens.map(|t| self.region(t));
        a.patches.push((ArgField::Rows, self.range(rows)));
    }

    /// A page table and context lengths taken from their uploads at completion.
    fn tables(&self, page_table: Ptr, context_lens: Ptr, a: &mut LaunchArgs) {
        for p in [page_table, context_lens] {
            self.reads_behind(p, a);
        }
        a.patches
            .push((ArgField::PageTable, self.range(page_table)));
        a.patches
            .push((ArgField::ContextLens, self.range(context_lens)));
    }

    /// Queues `op` on `s`, or records it as the next node of the stream's capture.
    fn queue_or_capture(
        &mut self,
        s: StreamKind,
        op: Op,
        args: LaunchArgs,
    ) -> Result<(), DeviceError> {
        match self.captures[s.index()].as_mut() {
            Some(c) => {
                c.graph.nodes.push((op, args));
                Ok(())
            }
            None => self.side.at().enqueue_with(s, op, Some(Box::new(args))),
        }
    }

    /// A launch on `s`: queued, or recorded into the stream's capture. A launch fused into its
    /// consumer (a draw, a pending-token resolution, a RoPE gather) is bookkeeping of the host
    /// either way, read when its consumer is launched or captured.
    fn launch_or_capture(&mut self, s: StreamKind, l: &Launch<'_>) -> Result<(), DeviceError> {
        if self.refused(Call::Launch, Some(s), 1.0) {
            return Err(Call::Launch.refusal());
        }
        if self.captures[s.index()].is_none() {
            self.last_record[s.index()] = None;
        }
        let r = match *l {
            Launch::ResolvePending {
                rows_dev, tokens, ..
            } => {
                self.side.at().refuse(28)?;
                let f = self
                    .fused
                    .entry((rows_dev.mem, rows_dev.offset.0))
                    .or_default();
                // The layers of a step resolve one shared upload of rows: each declares the
                // tokens read once.
                f.tokens = Some(tokens);
                if !f.reads.contains(&tokens) {
                    f.reads.push(tokens);
                }
                Ok(())
            }
            Launch::Draw { rows_dev, out, .. } => {
                self.side.at().refuse(28)?;
                let f = Fused {
                    reads: vec![rows_dev],
                    rows: Some(rows_dev),
                    tokens: None,
                };
                self.fused.insert((out.mem, out.offset.0), f);
                Ok(())
            }
            Launch::RopeRows {
                table,
                positions_dev,
                out,
                ..
            } => {
                self.side.at().refuse(28)?;
                let f = Fused {
                    reads: vec![table, positions_dev],
                    rows: None,
                    tokens: None,
                };
                self.fused.insert((out.mem, out.offset.0), f);
                Ok(())
            }
            _ => {
                let (op, args) = self.sim_op(l);
                self.queue_or_capture(s, op, args)
            }
        };
        if r.is_ok() && self.captures[s.index()].is_some() {
            let mut mems = Vec::with_capacity(6);
            l.for_each_ptr(|p| mems.push((p.mem, self.mem(p.mem).serial)));
            let c = self.captures[s.index()].as_mut().expect("capturing");
            c.graph.mems.extend(mems);
        }
        r
    }

    /// Blocks until everything queued on `s` completed: an internal record, synchronised.
    fn sync_stream(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        let e = self.spare_event()?;
        let mut g = self.side.at();
        let recorded = g.record(s, e);
        let state = recorded.map(|()| g.synchronize(e));
        drop(g);
        self.spare_events.push(e);
        let state = state?;
        self.deliver();
        // A failure the stream carries is the engine's to see at its next record: the
        // synchronisation itself completed, unless the side is in error (then it fails, as
        // CUDA's does with the context's sticky error).
        debug_assert_ne!(state, EventState::Pending);
        match state {
            EventState::Failed => self.side.at().refuse(30),
            _ => Ok(()),
        }
    }

    /// The op a launch belongs to, on the simulator's buffers, with its device arguments (its
    /// arrays its own: see [`detached`]).
    fn sim_op(&self, l: &Launch<'_>) -> (Op, LaunchArgs) {
        let mut a = LaunchArgs::default();
        let op = match *l {
            Launch::ResolvePending { .. } | Launch::Draw { .. } | Launch::RopeRows { .. } => {
                unreachable!("fused launches are not ops")
            }
            Launch::IndexKStore {
                op,
                keys,
                gamma,
                beta,
                rope,
                slots,
                dst,
                ..
            } => {
                let mut o = op.clone();
                o.dst = self.buffer(dst);
                self.redraw(&mut o.keys, keys, &mut a);
                for p in [keys, gamma, beta, rope, slots] {
                    self.reads_behind(p, &mut a);
                }
                a.patches.push((ArgField::Slots, self.range(slots)));
                Op::IndexKStore(o)
            }
            Launch::KvStore {
                op,
                rows,
                slots,
                dst,
                ..
            } => {
                let mut o = op.clone();
                o.dst = self.buffer(dst);
                self.redraw(&mut o.rows, rows, &mut a);
                for p in [rows, slots] {
                    self.reads_behind(p, &mut a);
                }
                a.patches.push((ArgField::Slots, self.range(slots)));
                Op::KvStore(o)
            }
            Launch::QPrep {
                op,
                q,
                w,
                rope,
                q_out,
                w_out,
            } => {
                let mut o = op.clone();
                o.q_out = self.region(q_out);
                o.w_out = self.region(w_out);
                self.redraw(&mut o.inputs, q, &mut a);
                for p in [q, w, rope] {
                    self.reads_behind(p, &mut a);
                }
                Op::QPrep(o)
            }
            Launch::IndexLogits {
                op,
                q,
                w,
                page_table,
                context_lens,
                k,
                out,
                ..
            } => {
                let mut o = op.clone();
                o.q = self.region(q);
                o.w = self.region(w);
                o.k = self.buffer(k);
                o.out = self.region(out);
                self.tables(page_table, context_lens, &mut a);
                Op::IndexLogits(o)
            }
            Launch::TopK {
                op,
                logits,
                context_lens,
                page_table,
                out,
            } => {
                let mut o = op.clone();
                o.logits = self.region(logits);
                o.out = self.region(out);
                self.tables(page_table, context_lens, &mut a);
                Op::TopK(o)
            }
            Launch::SparseRead {
                op, slots, kv, out, ..
            } => {
                let mut o = op.clone();
                o.slots = self.region(slots);
                o.kv = self.buffer(kv);
                o.out = self.region(out);
                Op::SparseRead(o)
            }
            Launch::NextTokens { op, digests, out } => {
                let mut o = op.clone();
                o.digests = self.region(digests);
                o.out = self.region(out);
                Op::NextTokens(o)
            }
            Launch::PageGather {
                op,
                src,
                dst,
                pairs,
            } => {
                let mut o = op.clone();
                o.src = self.buffer(src);
                o.dst = self.buffer(dst);
                self.reads_behind(pairs, &mut a);
                Op::PageCopy(o)
            }
        };
        (detached(op), a)
    }
}

/// `op` with its own copy of every array the runtime uploads by the array's identity (slots,
/// page tables, context lengths, drawn rows, LayerNorm parameters): a launch only borrows the
/// engine's op, so the simulated op a launch queues must not keep the engine's arrays alive
/// either, or the runtime would free their uploads only once every op that reads them ran,
/// never while they are still queued as it does on CUDA.
fn detached(mut op: Op) -> Op {
    fn own<T: Clone>(a: &mut std::sync::Arc<[T]>) {
        *a = a.iter().cloned().collect();
    }
    fn own_arg(a: &mut args::Array<'static, i32>) {
        *a = a.to_vec().into();
    }
    match &mut op {
        Op::IndexKStore(o) => {
            own_arg(&mut o.args.slots);
            own(&mut o.keys.rows);
            own(&mut o.gamma);
            own(&mut o.beta);
        }
        Op::KvStore(o) => {
            own_arg(&mut o.args.slots);
            own(&mut o.rows.rows);
        }
        Op::QPrep(o) => own(&mut o.inputs.rows),
        Op::IndexLogits(o) => {
            own_arg(&mut o.args.page_table);
            own_arg(&mut o.args.context_lens);
        }
        Op::TopK(o) => {
            own_arg(&mut o.args.page_table);
            own_arg(&mut o.args.context_lens);
        }
        Op::SparseRead(_) | Op::PageCopy(_) | Op::NextTokens(_) | Op::Copy(_) => {}
    }
    op
}

impl Driver for SimDriver {
    fn bind(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn alloc(&mut self, desc: &BufferDesc) -> Result<Mem, DeviceError> {
        self.deliver();
        if self.refused(Call::Alloc, None, SYNC_ALLOC_FAULT_FACTOR) {
            return Err(DeviceError::OutOfMemory {
                role: desc.role,
                tier: desc.tier,
                bytes: desc.bytes.0,
            });
        }
        let cap = desc.bytes.0.max(1);
        // The runtime's own buffers: a staging ring's regions are its cells; anything else of
        // its own (the RoPE table) is used whole.
        let buf = match desc.role {
            BufferRole::Scratch { .. } if desc.tier == MemoryTier::PinnedHost => {
                self.side.at().alloc_cells(*desc, DRIVER_CELL_BYTES)?
            }
            // The host tier's chunks: two jobs' chunks never share a cell.
            BufferRole::OffloadHost { .. } => {
                self.side.at().alloc_cells(*desc, DRIVER_CELL_BYTES)?
            }
            BufferRole::Scratch { .. } if !desc.fingerprint.is_paged() => {
                self.side.at().alloc_cells(*desc, cap)?
            }
            _ => self.side.at().alloc(*desc)?,
        };
        let serial = self.serial();
        Ok(self.mems.insert(SimMem {
            buf,
            pooled: false,
            cap,
            at: 0,
            serial,
        }))
    }
    fn free(&mut self, mem: Mem) -> Result<(), DeviceError> {
        self.outside_capture("cuMemFree", None);
        let m = self.mems.take(mem);
        assert!(!m.pooled, "a stream-ordered allocation freed synchronously");
        Ok(())
    }
    fn alloc_async(&mut self, s: StreamKind, bytes: u64) -> Result<Mem, DeviceError> {
        self.outside_capture("cuMemAllocAsync", Some(s));
        self.deliver();
        self.side.at().refuse(25)?;
        let cap = bytes.max(1).next_power_of_two().max(DRIVER_CELL_BYTES);
        let key = (cap, s.index());
        let reused = self.pool.get_mut(&key).and_then(Vec::pop);
        // Memory a trim gave back is the device's again, free for any stream: the pool grows
        // by taking it, with no fault (nothing else took it in between, in this model).
        let reused = reused.or_else(|| self.trimmed.get_mut(&cap).and_then(Vec::pop));
        let buf = match reused {
            Some(b) => {
                probes::hit(SimProbe::DriverScratchReused);
                b
            }
            // The pool grows: the device may have no memory to give (other work on the GPU
            // holds it), more often than any other call fails.
            None if self.refused(Call::AllocAsync, Some(s), ALLOC_FAULT_FACTOR) => {
                return Err(DeviceError::OutOfMemory {
                    role: BufferRole::Scratch {
                        name: "stream-ordered",
                    },
                    tier: MemoryTier::Device,
                    bytes,
                });
            }
            None => self.side.at().alloc_cells(
                BufferDesc {
                    role: BufferRole::Scratch {
                        name: "stream-ordered",
                    },
                    tier: MemoryTier::Device,
                    bytes: Bytes(cap),
                    fingerprint: LayoutFingerprint::unpaged(cap),
                },
                // One op's arguments or outputs: used whole.
                cap,
            )?,
        };
        let serial = self.serial();
        Ok(self.mems.insert(SimMem {
            buf,
            pooled: true,
            cap,
            at: 0,
            serial,
        }))
    }
    fn trim_pool(&mut self) -> Result<(), DeviceError> {
        self.outside_capture("cuMemPoolTrimTo", None);
        self.deliver();
        self.side.at().refuse(32)?;
        // Every freed buffer goes back to the device, where the next growth of any stream may
        // take it: a trim before the work that read it completed is a race the detector sees.
        for ((cap, _), bufs) in std::mem::take(&mut self.pool) {
            self.trimmed.entry(cap).or_default().extend(bufs);
        }
        Ok(())
    }
    fn free_async(&mut self, s: StreamKind, mem: Mem) -> Result<(), DeviceError> {
        self.outside_capture("cuMemFreeAsync", Some(s));
        let m = self.mem(mem);
        assert!(m.pooled, "allocation {} is not stream-ordered", mem.0);
        // Accepted even on a side in error: its memory would go with a lost context in CUDA,
        // and a side recovered here keeps it, so refusing would leak it.
        self.mems.take(mem);
        let gone: Vec<_> = self
            .fused
            .range((mem, 0)..=(mem, u64::MAX))
            .map(|(&k, _)| k)
            .collect();
        for k in gone {
            self.fused.remove(&k);
        }
        self.pool.entry((m.cap, s.index())).or_default().push(m.buf);
        Ok(())
    }
    fn write_pinned(&mut self, mem: Mem, at: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        let buf = self.mem(mem).buf;
        let last = self.last_write.insert(mem, at.0);
        probes::hit_if(
            SimProbe::DriverStagingWrapped,
            last.is_some_and(|l| l > at.0),
        );
        self.side.at().host_write(buf, at, data)
    }
    fn read_pinned(&mut self, mem: Mem, at: Bytes, out: &mut [u8]) -> Result<(), DeviceError> {
        let buf = self.mem(mem).buf;
        self.side.at().host_read(buf, at, out)
    }
    fn copy_async(&mut self, s: StreamKind, dst: Ptr, src: Ptr) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpyAsync", Some(s));
        if self.refused(Call::CopyAsync, Some(s), 1.0) {
            return Err(Call::CopyAsync.refusal());
        }
        self.linear(s, dst, src)
    }
    fn copy_2d_async(&mut self, s: StreamKind, c: &Copy2d) -> Result<(), DeviceError> {
        self.outside_capture("cuMemcpy2DAsync", Some(s));
        if self.refused(Call::Copy2d, Some(s), 1.0) {
            return Err(Call::Copy2d.refusal());
        }
        // Its rows as linear copies. (A side that falls in error between two rows refuses the
        // rest: CUDA's pitched copy is one call, refused whole or queued whole.)
        for row in 0..c.height {
            let src = c.src.at(Bytes(row * c.src_pitch), Bytes(c.width));
            let dst = c.dst.at(Bytes(row * c.dst_pitch), Bytes(c.width));
            self.linear(s, dst, src)?;
        }
        Ok(())
    }
    fn copy_pageable(&mut self, s: StreamKind, dst: Ptr, data: &[u8]) -> Result<(), DeviceError> {
        self.outside_capture("a pageable cuMemcpyHtoDAsync", Some(s));
        self.deliver();
        self.side.at().refuse(27)?;
        if self.refused(Call::CopyPageable, Some(s), 1.0) {
            return Err(Call::CopyPageable.refusal());
        }
        self.last_record[s.index()] = None;
        probes::hit(SimProbe::DriverPageableCopy);
        let need = (data.len() as u64).max(1);
        // A bounce buffer whose copy completed (the host saw it: ordered after it).
        let mut free = None;
        for (i, b) in self.bounces.iter().enumerate() {
            if b.cap >= need && self.side.at().record_done(b.done) {
                free = Some(i);
                break;
            }
        }
        let (buf, cap, done) = match free {
            Some(i) => {
                let b = self.bounces.swap_remove(i);
                (b.buf, b.cap, b.done)
            }
            None => {
                let cap = need.next_power_of_two().max(DRIVER_CELL_BYTES);
                let buf = self.side.at().alloc_cells(
                    BufferDesc {
                        role: BufferRole::Scratch {
                            name: "pageable bounce",
                        },
                        tier: MemoryTier::PinnedHost,
                        bytes: Bytes(cap),
                        fingerprint: LayoutFingerprint::unpaged(cap),
                    },
                    cap,
                )?;
                let done = self.side.at().new_internal_event()?;
                (buf, cap, done)
            }
        };
        let mut g = self.side.at();
        g.write_untracked(buf, Bytes(0), data);
        let src = Region {
            buffer: buf,
            offset: Bytes(0),
            bytes: Bytes(data.len() as u64),
        };
        let mut to = self.region(dst);
        to.bytes = Bytes(data.len() as u64);
        g.enqueue(s, Op::Copy(LinearCopy { src, dst: to }))?;
        // A copy queued without its record (the side fell in error in between) may still read
        // the bounce buffer: it is not used again.
        g.record(s, done)?;
        drop(g);
        self.bounces.push(Bounce { buf, cap, done });
        Ok(())
    }
    fn launch(&mut self, s: StreamKind, l: &Launch<'_>) -> Result<(), DeviceError> {
        self.deliver();
        let r = self.launch_or_capture(s, l);
        if let (Err(_), Some(c)) = (&r, self.captures[s.index()].as_mut()) {
            c.failed = true;
        }
        r
    }
    fn capture_begin(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        self.outside_capture("cuStreamBeginCapture", Some(s));
        self.deliver();
        self.side.at().refuse(28)?;
        self.captures[s.index()] = Some(Capture::default());
        Ok(())
    }
    /// A graph whose every node is of the same op kind as the capture's, in order, is updated
    /// in place (CUDA updates an executable graph whose nodes match one for one).
    fn capture_end(
        &mut self,
        s: StreamKind,
        into: Option<DrvGraph>,
    ) -> Result<DrvGraph, DeviceError> {
        let c = self.captures[s.index()]
            .take()
            .expect("a capture ends on a capturing stream");
        // CUDA may refuse to make or update the graph (out of memory); the capture is gone.
        if c.failed || self.refused(Call::Launch, Some(s), 1.0) {
            probes::hit(SimProbe::DriverCaptureDropped);
            return Err(Call::Launch.refusal());
        }
        let kinds = |g: &SimGraph| g.nodes.iter().map(|(op, _)| op.kind()).collect::<Vec<_>>();
        if let Some(g) = into {
            let held = self.graphs.get_mut(Mem(g.0));
            if kinds(held) == kinds(&c.graph) {
                *held = c.graph;
                return Ok(g);
            }
        }
        Ok(DrvGraph(self.graphs.insert(c.graph).0))
    }
    /// Queues the graph's ops as they were captured. Every allocation they name must be the
    /// one of their capture: a graph launched over memory freed since (an id reused, or none)
    /// runs on whatever holds it now, and that is the runtime's error.
    fn graph_launch(&mut self, s: StreamKind, g: DrvGraph) -> Result<(), DeviceError> {
        self.outside_capture("cuGraphLaunch", Some(s));
        self.deliver();
        if self.refused(Call::Launch, Some(s), 1.0) {
            return Err(Call::Launch.refusal());
        }
        let graph = self.graphs.get(Mem(g.0)).clone();
        for &(m, serial) in &graph.mems {
            let now = self.mems.try_get(m).map(|x| x.serial);
            assert_eq!(
                now,
                Some(serial),
                "a graph launched over allocation {} freed since its capture",
                m.0
            );
        }
        self.last_record[s.index()] = None;
        for (op, args) in graph.nodes {
            self.side.at().enqueue_with(s, op, Some(Box::new(args)))?;
        }
        Ok(())
    }
    fn graph_destroy(&mut self, g: DrvGraph) {
        self.graphs.take(Mem(g.0));
    }
    fn event_create(&mut self, purpose: EventUse) -> Result<DrvEvent, DeviceError> {
        if self.refused(Call::EventCreate, None, 1.0) {
            return Err(Call::EventCreate.refusal());
        }
        let e = match purpose {
            EventUse::Engine => self.side.at().new_event()?,
            EventUse::Staging | EventUse::Timing | EventUse::Transfer => {
                self.side.at().new_internal_event()?
            }
        };
        self.events.push(e);
        self.timing.push(purpose == EventUse::Timing);
        Ok(DrvEvent(self.events.len() as u32 - 1))
    }
    fn event_record(&mut self, s: StreamKind, e: DrvEvent) -> Result<(), DeviceError> {
        self.outside_capture("cuEventRecord", Some(s));
        self.deliver();
        if self.refused(Call::EventRecord, Some(s), 1.0) {
            return Err(Call::EventRecord.refusal());
        }
        let ev = self.events[e.0 as usize];
        let r = self.side.at().record(s, ev);
        self.last_record[s.index()] = r.is_ok().then_some(ev);
        r
    }
    fn event_query(&mut self, e: DrvEvent) -> EventState {
        self.outside_capture("cuEventQuery", None);
        self.deliver();
        let ev = self.events[e.0 as usize];
        // A timing event is a measure the runtime reads, not a synchronisation the engine may
        // rely on: its answer does not order the host after the work (the race detector would
        // otherwise take a read the engine never waited for as ordered in timed seeds).
        if self.timing[e.0 as usize] {
            return match self.side.at().record_done(ev) {
                true => EventState::Done,
                false => EventState::Pending,
            };
        }
        self.side.at().query(ev)
    }
    fn event_synchronize(&mut self, e: DrvEvent) -> EventState {
        self.outside_capture("cuEventSynchronize", None);
        let ev = self.events[e.0 as usize];
        let state = self.side.at().synchronize(ev);
        self.deliver();
        state
    }
    fn event_elapsed_ns(&mut self, start: DrvEvent, end: DrvEvent) -> Option<u64> {
        self.outside_capture("cuEventElapsedTime", None);
        let g = self.side.at();
        let at = |e: DrvEvent| g.record_done_at(self.events[e.0 as usize]);
        Some(at(end)?.saturating_sub(at(start)?))
    }
    fn stream_wait(&mut self, s: StreamKind, e: DrvEvent) -> Result<(), DeviceError> {
        self.outside_capture("cuStreamWaitEvent", Some(s));
        self.deliver();
        if self.refused(Call::StreamWait, Some(s), 1.0) {
            return Err(Call::StreamWait.refusal());
        }
        self.last_record[s.index()] = None;
        let ev = self.events[e.0 as usize];
        self.side.at().wait(s, ev)
    }
    fn stream_synchronize(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        self.outside_capture("cuStreamSynchronize", None);
        self.sync_stream(s)
    }
    fn context_synchronize(&mut self) -> Result<(), DeviceError> {
        self.outside_capture("cuCtxSynchronize", None);
        let mut first = Ok(());
        for s in StreamKind::ALL {
            let r = self.sync_stream(s);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.outside_capture("a recovery", None);
        self.deliver();
        self.side.at().recover()
    }
    /// The side's: its recreation keeps every allocation, event and stream valid (the
    /// simulated GPU keeps them), so this driver has nothing of its own to make again.
    fn context_generation(&self) -> u64 {
        self.side.context_generation()
    }
    fn host_callback(&mut self, s: StreamKind, cb: HostCallback) -> Result<(), DeviceError> {
        self.outside_capture("cuLaunchHostFunc", Some(s));
        self.deliver();
        self.side.at().refuse(29)?;
        if self.refused(Call::HostCallback, Some(s), 1.0) {
            return Err(Call::HostCallback.refusal());
        }
        // Right behind a record, the callback runs with that record (and is dropped if it
        // fails); otherwise behind a record of its own.
        let behind = self.last_record[s.index()];
        let (rec, event) = match behind {
            Some(ev) => (self.side.at().latest_record(ev), None),
            None => {
                let event = self.spare_event()?;
                let mut g = self.side.at();
                g.record(s, event)?;
                (g.latest_record(event), Some(event))
            }
        };
        let rec = rec.expect("recorded above");
        self.callbacks.push_back(Pending {
            rec,
            behind,
            event,
            cb,
        });
        Ok(())
    }
    /// A simulated server's memory is an allocation of this driver, named by its simulated
    /// address ([`SimDriver::address`]); the import is an alias of the same buffer.
    fn import(&mut self, base: u64, bytes: u64) -> Result<Mem, DeviceError> {
        let id = (base >> ADDRESS_SHIFT).checked_sub(1);
        let at = base & ((1 << ADDRESS_SHIFT) - 1);
        let found = id
            .and_then(|id| u32::try_from(id).ok())
            .and_then(|id| self.mems.try_get(Mem(id)).copied());
        match found {
            Some(m) if m.at + at + bytes <= m.cap => {
                let serial = self.serial();
                Ok(self.mems.insert(SimMem {
                    buf: m.buf,
                    pooled: false,
                    cap: m.at + at + bytes,
                    at: m.at + at,
                    serial,
                }))
            }
            _ => Err(DeviceError::Backend {
                detail: format!(
                    "import: {bytes} bytes at {base:#x} are no allocation of this driver"
                ),
            }),
        }
    }
    /// The simulated server runs its kernels on the compute stream: any handle names it.
    fn event_record_foreign(&mut self, stream: u64, e: DrvEvent) -> Result<(), DeviceError> {
        let _ = stream;
        self.event_record(StreamKind::Compute, e)
    }
    /// Each copy as a [`Driver::copy_async`], in order: the CUDA driver's copy kernel runs a
    /// batch unordered only when no destination overlaps another range of it, where order
    /// cannot matter.
    fn copy_batch_async(
        &mut self,
        s: StreamKind,
        copies: &[(Ptr, Ptr)],
    ) -> Result<(), DeviceError> {
        for &(dst, src) in copies {
            self.copy_async(s, dst, src)?;
        }
        Ok(())
    }
    /// The host is ordered after `e`'s latest record if the callback that ran came behind that
    /// record; a callback queued anywhere else orders nothing (the runtime misplaced it).
    fn observed_by_callback(&mut self, e: DrvEvent) {
        let ev = self.events[e.0 as usize];
        let mut g = self.side.at();
        let latest = g.latest_record(ev);
        match self.callback_ran.get(&ev) {
            Some(&rec) if Some(rec) == latest => g.observe_record(rec),
            _ => {}
        }
    }
}

/// The engine's device in a run: a side of the simulated GPU directly, or the production runtime
/// over the simulated driver (`GpuKnobs::runtime_staging_bytes`).
pub enum SimDevice {
    Direct(SimSide),
    Runtime(Box<DrivenDevice<SimDriver>>),
}

impl SimDevice {
    fn dev(&mut self) -> &mut dyn Device {
        match self {
            SimDevice::Direct(d) => d,
            SimDevice::Runtime(d) => &mut **d,
        }
    }
}

impl Device for SimDevice {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        self.dev().alloc(desc)
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        match self {
            SimDevice::Direct(d) => d.desc(buf),
            SimDevice::Runtime(d) => d.desc(buf),
        }
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        self.dev().new_event()
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.dev().record(stream, ev)
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.dev().wait(stream, ev)
    }
    fn query(&mut self, ev: EventId) -> EventState {
        self.dev().query(ev)
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.dev().synchronize(ev)
    }
    /// The runtime may fail an op before any launch reaches the simulated GPU (an upload
    /// refused): what the engine asked is noted here, as the GPU notes it for a direct call.
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        let SimDevice::Runtime(d) = self else {
            return self.dev().enqueue(stream, op);
        };
        let noted =
            matches!(op, Op::PageCopy(_) | Op::KvStore(_)) && check_op(&op, |b| d.desc(b)).is_ok();
        // On the simulator's buffers (the runtime's buffer ids are its own).
        let kept = noted.then(|| {
            let mut op = op.clone();
            let sim = |b: BufferId| d.driver.mem(d.buffer(b).mem).buf;
            match &mut op {
                Op::PageCopy(c) => (c.src, c.dst) = (sim(c.src), sim(c.dst)),
                Op::KvStore(o) => o.dst = sim(o.dst),
                _ => unreachable!("only page copies and KV stores are noted"),
            }
            op
        });
        let r = d.enqueue(stream, op);
        if let Some(op) = kept {
            let mut g = d.driver.side.at();
            match op {
                Op::KvStore(_) if r.is_ok() => g.note_asked(stream, &op),
                Op::PageCopy(_) => {
                    g.note_asked(stream, &op);
                    if r.is_err() {
                        g.note_refused(stream, &op);
                    }
                }
                _ => {}
            }
        }
        r
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.dev().host_read(buf, offset, out)
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        self.dev().host_write(buf, offset, data)
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.dev().recover()
    }
    fn context_generation(&self) -> u64 {
        match self {
            SimDevice::Direct(d) => d.context_generation(),
            SimDevice::Runtime(d) => d.context_generation(),
        }
    }
    fn take_timing(&mut self) -> Option<DeviceTiming> {
        self.dev().take_timing()
    }
}

#[cfg(test)]
mod tests;
