//! The runtime above the driver seam: a [`Device`] made of [`Driver`] calls. It is the same code
//! on cudarc in production ([`super::cuda::CudaDevice`]) and on any other driver.
//!
//! [`DrivenDevice::enqueue`] turns one engine `Op` into kernel launches and copies on a stream.
//! The arrays a kernel op carries (slots, page tables, context lengths, drawn rows and their
//! positions) are made once a step by the engine and shared by the ops of every layer; a
//! layer's LayerNorm parameters are made once a model and shared by that layer's ops of every
//! step. Each is uploaded once to a stream, kept there while the engine holds the array, and
//! freed on that stream at the next event record, recovery or drop once it holds it no more
//! (`SharedUpload`); an array an op borrows is uploaded for that op alone, and so are a gather
//! copy's page pairs. Every upload is staged through a pinned ring per stream (`staging.rs`)
//! into a stream-ordered allocation; an upload above a quarter of the ring is copied from
//! pageable memory instead. An op's drawn inputs and RoPE rows go into the start of its
//! stream's output allocation (stream-ordered, grown when an op needs more: the ops of a stream
//! run one after another, and an op's outputs are read by its own kernels alone). The model's
//! inputs are drawn on the device from each row's token and position (a step's pending rows
//! resolved from its tokens once, by the first op that draws them), and RoPE rows gathered from
//! a table of the model's rows (made again, after a context synchronisation, when a position
//! lies past it; only the rows it adds are computed). `check_op`'s verdict on the first layer's
//! op of a step is taken for the others (`device::memo`). Each event recorded on the load stream
//! also queues a host callback that signals the completion ring (`ring.rs`), which `query` reads
//! before it asks the driver — when the event's ring slot is free (its previous callback ran;
//! otherwise `query` asks the driver alone).
//!
//! With graphs on ([`DrivenDevice::set_graphs`]; the production CUDA device turns them on), the
//! launches of each kernel op of the compute stream are queued as one CUDA graph: captured from
//! the stream (after every upload, allocation and event of the op: a capture holds launches
//! only), made into an executable graph (the least recently used of the four kept per class, op
//! kind and launch count, updated in place when the class is full), and launched. An op equal to
//! one captured before (its record, and its launches' kinds, device arguments and RoPE table)
//! launches that graph again with no capture. Freeing an allocation forgets every graph that
//! names it, so no graph runs on memory freed since its capture.
//!
//! Page transfers have two strategies ([`CopyStrategy`]): one pitched copy per coalesced run, or
//! one gather kernel over mapped host memory for all pages. `tierkv bench` measures both.

use super::driver::{Copy2d, DrawKind, Driver, DrvEvent, DrvGraph, EventUse, Launch, Mem, Ptr};
use super::ring::{CompletionRing, Ticket};
use super::staging::{Copies, StagingRing};
use crate::config::limits::CONTEXT_TOKENS_MAX;
use crate::device::memo::Identity;
use crate::device::*;
use crate::layout::{f32_bytes, u32_count, Bytes, LayoutFingerprint, ROPE_DIM};
use std::sync::Arc;

/// How page runs move between tiers. The default is the gather kernel: on the H200 it moves a
/// scattered 128K-token layer at 88–92% of one large pinned copy, against 13–16% for one
/// `cuMemcpy2DAsync` per run (kernels/GPU.md, run 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CopyStrategy {
    /// One pitched `cuMemcpy2DAsync` per coalesced run.
    MemcpyRuns,
    /// One `page_gather` kernel launch for all pages (host side through its mapped address).
    #[default]
    Gather,
}

/// Bytes of each stream's staging ring in production (`DrivenDevice::over`). An argument larger
/// than a quarter of its ring is copied from pageable memory instead.
pub const STAGING_BYTES: usize = 64 << 20;
/// Staged regions start on multiples of this many bytes.
const STAGING_ALIGN_BYTES: usize = 256;
/// The fewest rows a RoPE table holds (it doubles past the largest position seen).
const ROPE_TABLE_ROWS_MIN: u32 = 8192;
// A table of the longest context holds `CONTEXT_TOKENS_MAX` rows: a power of two, so that
// doubling a smaller table reaches it and no further.
const _: () =
    assert!(CONTEXT_TOKENS_MAX.is_power_of_two() && ROPE_TABLE_ROWS_MIN <= CONTEXT_TOKENS_MAX);
/// Slots of the completion ring (events with larger ids are answered by the driver alone).
const RING_SLOTS: usize = 4096;

/// The pinned ring one stream's op arguments are staged through before their copy to the
/// device (a region is written again only after the copy out of it completed).
struct Staging {
    host: Mem,
    ring: StagingRing<DrvEvent>,
    /// Events of completed copies, for reuse.
    free: Vec<DrvEvent>,
    /// A copy out of the ring was queued but its event not recorded (the call failed): no
    /// region is known free until the stream has been synchronised.
    unknown: bool,
}

/// The staging ring asks the driver about its copies (`waits`: clean, it waits for them).
struct DriverCopies<'a, D> {
    driver: &'a mut D,
    waits: bool,
}

/// A copy that failed is over too: it reads the ring no more, so its region may be written.
impl<D: Driver> Copies<DrvEvent> for DriverCopies<'_, D> {
    fn done(&mut self, e: &DrvEvent) -> bool {
        !self.waits || self.driver.event_query(*e) != EventState::Pending
    }
    fn wait(&mut self, e: &DrvEvent) -> Result<(), DeviceError> {
        if !self.waits {
            return Ok(());
        }
        match self.driver.event_synchronize(*e) {
            EventState::Done | EventState::Failed => Ok(()),
            EventState::Pending => unreachable!("a synchronised event is not pending"),
        }
    }
}

/// RoPE rows `0..rows` of one model's frequencies, on the device.
struct RopeTable {
    rope: Rope,
    rows: u32,
    table: Mem,
    /// The table's rows on the host: a table made again for more positions computes only the
    /// rows it adds.
    host: Vec<f32>,
    /// The context was recreated since it was uploaded: the allocation stands, its bytes are
    /// lost, and the next launch that needs it uploads them again.
    lost: bool,
}

/// Timing of the compute stream (see [`DrivenDevice::set_timing`]): a pair of timing events
/// around every op and every wait, read back by `take_timing`.
#[derive(Default)]
struct ComputeTiming {
    /// Timing events no longer in use.
    free: Vec<DrvEvent>,
    /// (start, end, the op's kind or `None` for a wait), in stream order.
    marks: Vec<(DrvEvent, DrvEvent, Option<usize>)>,
    /// Host time inside `enqueue` per op kind since the last `take_timing`.
    enqueue_ns: [u64; Op::KINDS],
}

pub(crate) fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (f32, i32, u32, u64, u16, TokenAt) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Where each output of an op lies in its one stream-ordered allocation. Each starts on a
/// [`PACK_ALIGN_BYTES`] boundary (the kernels write their outputs 16 bytes at a time).
#[derive(Default)]
struct Pack {
    outs: u64,
}

/// Every output starts on a multiple of this.
const PACK_ALIGN_BYTES: u64 = 16;

/// A range of a pack: `(offset, bytes)`; an empty output still owns one byte.
#[derive(Clone, Copy, Debug)]
struct Packed(u64, u64);

impl Pack {
    fn out(&mut self, bytes: Bytes) -> Packed {
        let at = self.outs.next_multiple_of(PACK_ALIGN_BYTES);
        let n = bytes.0.max(1);
        self.outs = at + n;
        Packed(at, n)
    }
}

/// An array the ops of a step share (slots, page tables, context lengths, drawn rows and their
/// positions; a layer's LayerNorm parameters, shared by that layer's ops of every step),
/// uploaded once to a stream. It stays on the device while a holder of the array may still
/// enqueue an op that names it (the engine, or a kept graph's op: at most [`CLASS_GRAPHS_MAX`]
/// a class); once none holds it, it is freed on its stream (at the next event record, recovery
/// or drop), after every op that read it. Its identity's weak reference
/// keeps the array's address from being reused meanwhile.
struct SharedUpload {
    stream: StreamKind,
    array: Identity,
    /// What of the array was uploaded.
    what: Derived,
    ptr: Ptr,
    /// Drawn rows: the tokens region their pending rows were resolved from, in place in this
    /// upload (by the first op that named them; the others find none pending).
    resolved: Option<Ptr>,
}

/// What of a shared array an upload holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Derived {
    /// Its bytes.
    Bytes,
    /// Drawn rows' positions, one u32 a row.
    Positions,
}

/// Graphs of the compute stream's ops kept for replay, at most this many per [`GraphClass`].
const CLASS_GRAPHS_MAX: usize = 4;

/// What a graph can be updated to a capture of: an op kind and its launch count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphClass {
    kind: usize,
    launches: usize,
}

/// The compute stream's ops as CUDA graphs ([`DrivenDevice::set_graphs`]): each op's launches
/// are captured into a graph and the graph launched, and an op equal to one captured before
/// (its record, and the kinds, device arguments and RoPE table of its launches) launches that
/// graph again without a capture.
#[derive(Default)]
struct Graphs {
    on: bool,
    slots: Vec<GraphSlot>,
    /// Uses so far (which slot of a class was used least recently).
    clock: u64,
    /// Inside `recover` (zoo mutant 46 keeps the graphs there).
    recovering: bool,
    /// The words of the op being submitted ([`launch_words`]; kept to spare an allocation).
    words: Vec<u64>,
    /// Kernel launches of compute-stream ops since the last `take_timing`, and of them those
    /// queued from graphs.
    launches: u64,
    from_graphs: u64,
}

impl Graphs {
    /// The slot whose graph a capture of `class` is made into: the least recently used of the
    /// class when it holds [`CLASS_GRAPHS_MAX`] (`None`: a new graph).
    fn victim(&self, class: GraphClass) -> Option<usize> {
        let of_class = || {
            self.slots
                .iter()
                .enumerate()
                .filter(|(_, g)| g.class == class)
        };
        match of_class().count() >= CLASS_GRAPHS_MAX {
            true => of_class().min_by_key(|(_, g)| g.used).map(|(i, _)| i),
            false => None,
        }
    }
}

/// A graph and the op it holds the launches of.
struct GraphSlot {
    graph: DrvGraph,
    /// A graph is updated only to a capture of its class.
    class: GraphClass,
    /// The op, held: the arrays it names stay allocated, and so do their uploads, which its
    /// graph's launches name, while the slot is kept.
    op: Op,
    /// What the launches add to the op ([`launch_words`]).
    words: Vec<u64>,
    /// The allocations its launches name: freeing one forgets the slot.
    mems: Vec<Mem>,
    used: u64,
}

/// What a list of launches adds to the op they belong to: each launch's kind, its device
/// arguments (allocation, offset, bytes) and, for RoPE rows, the table's rows. The rest of a
/// launch (draw kinds, seeds, layers, rows, positions, tokens, fingerprints) follows from the
/// op's record and its buffers.
fn launch_words(ls: &[Launch<'_>], w: &mut Vec<u64>) {
    w.clear();
    for l in ls {
        let (kind, extra) = match *l {
            Launch::ResolvePending { .. } => (0, 0),
            Launch::Draw { .. } => (1, 0),
            Launch::RopeRows { table_rows, .. } => (2, table_rows as u64),
            Launch::IndexKStore { .. } => (3, 0),
            Launch::KvStore { .. } => (4, 0),
            Launch::QPrep { .. } => (5, 0),
            Launch::IndexLogits { .. } => (6, 0),
            Launch::TopK { .. } => (7, 0),
            Launch::SparseRead { .. } => (8, 0),
            Launch::NextTokens { .. } => (9, 0),
            Launch::PageGather { .. } => (10, 0),
        };
        w.extend([kind, extra]);
        l.for_each_ptr(|p| w.extend([p.mem.0 as u64, p.offset.0, p.bytes.0]));
    }
}

/// An op's outputs on the device (`None`: the op has none).
struct Staged {
    outs: Option<Ptr>,
}

impl Staged {
    fn out(&self, p: Packed) -> Ptr {
        self.outs
            .expect("planned outputs")
            .at(Bytes(p.0), Bytes(p.1))
    }
}

/// A resolution of drawn rows' pending tokens, in place in their upload at `rows_dev`, from the
/// tokens at `tokens`.
#[derive(Clone, Copy)]
struct Resolve {
    rows_dev: Ptr,
    tokens: Ptr,
}

/// A drawn input's rows and positions on the device, and where its outputs and RoPE rows lie
/// in its op's pack.
struct DrawPlan {
    rows: Ptr,
    outs: Vec<Packed>,
    positions: Option<Ptr>,
    rope_out: Option<Packed>,
    positions_host: Vec<u32>,
    /// The RoPE table and its rows, when the plan gathers RoPE rows.
    table: Option<(Ptr, u32)>,
}

/// The production `Device` logic over a driver.
pub struct DrivenDevice<D: Driver> {
    pub driver: D,
    pub strategy: CopyStrategy,
    /// The bug zoo's runtime mutants (none in production).
    pub mutants: crate::mutants::Mutants,
    /// Each buffer's allocation and description.
    buffers: Vec<(Mem, BufferDesc)>,
    events: Vec<DrvEvent>,
    /// Each event's last record: the ops enqueued (on every stream) before it, for the
    /// record-to-wait watermark (`None`: never recorded).
    recorded_at: Vec<Option<u64>>,
    /// Ops enqueued so far, on every stream.
    enqueued: u64,
    /// Per stream, the pinned ring its ops' arguments are staged through.
    staging: [Option<Staging>; StreamKind::ALL.len()],
    /// Bytes of each staging ring.
    staging_bytes: usize,
    /// The model's RoPE rows on the device, grown to the largest position seen.
    rope: Option<RopeTable>,
    /// Stream-ordered allocations of the op being enqueued, freed on its stream after it.
    scratch: Vec<Mem>,
    /// Per stream, the stream-ordered allocation every op's outputs on it are drawn into (from
    /// its start: the ops of a stream run one after another, and an op's outputs are read by
    /// its own kernels alone). It grows by a free and an allocation on its stream.
    outputs: [Option<Ptr>; StreamKind::ALL.len()],
    /// The shared index arrays on the device (a handful a step).
    shared: Vec<SharedUpload>,
    /// The compute stream's ops as graphs, when on.
    graphs: Graphs,
    /// The ops checked, by key: the other layers of a step take their verdict.
    checked: crate::device::memo::CheckMemo,
    /// Load-stream events also signal this ring from a host callback; `query` reads it.
    ring: Arc<CompletionRing>,
    tickets: std::collections::BTreeMap<EventId, Ticket>,
    /// `Some` while the compute stream is timed.
    timing: Option<ComputeTiming>,
    /// Mutant 34's pinned buffer per stream (allocation, bytes).
    #[cfg(feature = "mutants")]
    pinned_args: [Option<(Mem, Bytes)>; StreamKind::ALL.len()],
}

impl<D: Driver> DrivenDevice<D> {
    /// The device over `driver`, with every stream's staging ring ([`STAGING_BYTES`]) made now.
    pub fn over(driver: D, strategy: CopyStrategy) -> Result<DrivenDevice<D>, DeviceError> {
        DrivenDevice::with_staging(driver, strategy, STAGING_BYTES)
    }

    /// The device over `driver` with staging rings of `staging_bytes` (a multiple of 256, at
    /// least 1024; a simulated driver takes small ones, so that they wrap).
    pub fn with_staging(
        driver: D,
        strategy: CopyStrategy,
        staging_bytes: usize,
    ) -> Result<DrivenDevice<D>, DeviceError> {
        if staging_bytes < 1024 || staging_bytes % STAGING_ALIGN_BYTES != 0 {
            return Err(DeviceError::Backend {
                detail: format!(
                    "a staging ring of {staging_bytes} B: it takes a multiple of \
                     {STAGING_ALIGN_BYTES} B of at least 1024 B"
                ),
            });
        }
        let mut d = DrivenDevice {
            driver,
            strategy,
            mutants: crate::mutants::Mutants::none(),
            buffers: Vec::new(),
            events: Vec::new(),
            recorded_at: Vec::new(),
            enqueued: 0,
            staging: [None, None, None],
            staging_bytes,
            rope: None,
            scratch: Vec::new(),
            outputs: [None; StreamKind::ALL.len()],
            shared: Vec::new(),
            graphs: Graphs::default(),
            checked: Default::default(),
            ring: Arc::new(CompletionRing::new(RING_SLOTS)),
            tickets: std::collections::BTreeMap::new(),
            timing: None,
            #[cfg(feature = "mutants")]
            pinned_args: [None; StreamKind::ALL.len()],
        };
        for s in StreamKind::ALL {
            d.prepare_staging(s)?;
        }
        Ok(d)
    }

    /// Makes stream `s`'s staging ring (its pinned memory), if it has none.
    fn prepare_staging(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        if self.staging[s.index()].is_none() {
            let bytes = self.staging_bytes;
            let host = self.driver.alloc(&BufferDesc {
                role: BufferRole::Scratch {
                    name: "staging ring",
                },
                tier: MemoryTier::PinnedHost,
                bytes: Bytes(bytes as u64),
                fingerprint: LayoutFingerprint::unpaged(bytes as u64),
            })?;
            self.staging[s.index()] = Some(Staging {
                host,
                ring: StagingRing::new(bytes, STAGING_ALIGN_BYTES),
                free: Vec::new(),
                unknown: false,
            });
        }
        Ok(())
    }

    /// A buffer's allocation, whole.
    pub fn buffer(&self, b: BufferId) -> Ptr {
        let (mem, desc) = self.buffers[b.0 as usize];
        Ptr::whole(mem, desc.bytes.max(Bytes(1)))
    }

    /// How many buffers `alloc` made.
    pub fn buffers(&self) -> usize {
        self.buffers.len()
    }

    /// A region's bytes.
    fn region(&self, r: &Region) -> Ptr {
        self.buffer(r.buffer).at(r.offset, r.bytes)
    }

    /// Times every op and every wait of the compute stream (two timing events each: several
    /// microseconds of host time per op; kernels/GPU.md runs 39 and 45 measured 0.2–0.9 ms per
    /// 4-layer step), so that `take_timing` answers.
    pub fn set_timing(&mut self, on: bool) {
        self.timing = on.then(ComputeTiming::default);
    }

    /// Launches the compute stream's kernel ops from CUDA graphs (see `Graphs`), or one by
    /// one. Turning them off destroys the graphs kept.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs.on = on;
        if !on {
            for g in std::mem::take(&mut self.graphs.slots) {
                self.driver.graph_destroy(g.graph);
            }
        }
    }

    /// The rows of the device's RoPE table (0 before the first op or preparation that needs
    /// one).
    pub fn rope_rows(&self) -> u32 {
        self.rope.as_ref().map_or(0, |t| t.rows)
    }

    /// Makes the device's RoPE table of `rope` hold the rows of positions `0..positions` now,
    /// as a server computes its cos/sin cache when it loads the model, so that no step
    /// computes rows on the host or waits for the device to drain while the table grows (the
    /// first op past a table's rows does both). A later op past `positions` still grows it.
    /// More positions than `config::limits::CONTEXT_TOKENS_MAX` are refused, as any op's
    /// position past it is.
    pub fn prepare_rope(&mut self, rope: &Rope, positions: u32) -> Result<(), DeviceError> {
        match positions.checked_sub(1) {
            Some(max) => self.rope_table(StreamKind::Compute, rope, max).map(|_| ()),
            None => Ok(()),
        }
    }

    /// [`DrivenDevice::prepare_rope`] for a server of `cfg`: its model's RoPE, every position
    /// of its longest context (`model.context_tokens_max`).
    pub fn prepare_rope_for(&mut self, cfg: &crate::config::Config) -> Result<(), DeviceError> {
        let rope = Rope::new(&cfg.rope());
        self.prepare_rope(&rope, cfg.model.context_tokens_max)
    }

    /// Counts, for a wait on `ev`, the ops enqueued since its last record (nothing for an
    /// event never recorded).
    fn mark_wait(&self, ev: EventId) {
        if let Some(at) = self.recorded_at[ev.0 as usize] {
            let since = self.enqueued - at;
            crate::probe::watermark(crate::probe::Watermark::OpsFromRecordToWait, since);
        }
    }

    /// Forgets (and destroys) every graph whose launches name `mem`, which is being freed: a
    /// graph launched after its buffers' free would run on memory reused since.
    fn forget_graphs_of(&mut self, mem: Mem) {
        let named = self.graphs.slots.iter().any(|g| g.mems.contains(&mem));
        if !named || self.mutants.graphs_kept(self.graphs.recovering) {
            return;
        }
        let (gone, kept) = std::mem::take(&mut self.graphs.slots)
            .into_iter()
            .partition(|g| g.mems.contains(&mem));
        self.graphs.slots = kept;
        let gone: Vec<GraphSlot> = gone;
        for g in gone {
            crate::probe::hit(crate::probe::Probe::RuntimeGraphForgotten);
            self.driver.graph_destroy(g.graph);
        }
        debug_assert!(
            !self.graphs.slots.iter().any(|g| g.mems.contains(&mem)),
            "a graph still names allocation {mem:?} after its forgetting"
        );
    }

    /// Queues op `op`'s launches `ls` on `s`: from a graph on the compute stream when graphs
    /// are on (the graph of an equal op, launched again; else a capture of `ls`, made into the
    /// least recently used graph of its class when the class is full), else one by one. A
    /// launch or capture that fails queues nothing of a capture.
    fn submit(&mut self, s: StreamKind, op: &Op, ls: &[Launch<'_>]) -> Result<(), DeviceError> {
        if s == StreamKind::Compute {
            self.graphs.launches += ls.len() as u64;
        }
        if !self.graphs.on || s != StreamKind::Compute || ls.is_empty() {
            for l in ls {
                self.driver.launch(s, l)?;
            }
            return Ok(());
        }
        let mut words = std::mem::take(&mut self.graphs.words);
        launch_words(ls, &mut words);
        let class = GraphClass {
            kind: op.kind(),
            launches: ls.len(),
        };
        self.graphs.clock += 1;
        let clock = self.graphs.clock;
        let same = self
            .graphs
            .slots
            .iter_mut()
            .find(|g| g.class == class && g.words == words && g.op == *op);
        let graph = match same {
            Some(g) => {
                g.used = clock;
                self.graphs.words = words;
                crate::probe::hit(crate::probe::Probe::RuntimeGraphReplayed);
                g.graph
            }
            None => self.capture(s, op, ls, class, words)?,
        };
        self.driver.graph_launch(s, graph)?;
        self.graphs.from_graphs += ls.len() as u64;
        Ok(())
    }

    /// Captures `ls`, the launches of `op` (whose [`launch_words`] are `words`), into a graph
    /// of `class`, kept in a slot: a new one, or the class's least recently used one updated or
    /// replaced when the class is full. Nothing of a failed capture runs; a graph a failed
    /// update may have left part-updated is forgotten.
    fn capture(
        &mut self,
        s: StreamKind,
        op: &Op,
        ls: &[Launch<'_>],
        class: GraphClass,
        words: Vec<u64>,
    ) -> Result<DrvGraph, DeviceError> {
        let victim = self.graphs.victim(class);
        self.driver.capture_begin(s)?;
        for l in ls {
            if let Err(e) = self.driver.launch(s, l) {
                if let Ok(g) = self.driver.capture_end(s, None) {
                    self.driver.graph_destroy(g);
                }
                return Err(e);
            }
        }
        let into = victim.map(|i| self.graphs.slots[i].graph);
        let graph = match self.driver.capture_end(s, into) {
            Ok(g) => g,
            Err(e) => {
                if let Some(i) = victim {
                    let old = self.graphs.slots.swap_remove(i);
                    self.driver.graph_destroy(old.graph);
                }
                return Err(e);
            }
        };
        let mut mems = Vec::with_capacity(ls.len() * 4);
        ls.iter().for_each(|l| l.for_each_ptr(|p| mems.push(p.mem)));
        let slot = GraphSlot {
            graph,
            class,
            op: op.clone(),
            words,
            mems,
            used: self.graphs.clock,
        };
        match victim {
            Some(i) => {
                let old = std::mem::replace(&mut self.graphs.slots[i], slot);
                if old.graph != graph {
                    self.driver.graph_destroy(old.graph);
                }
                self.graphs.words = old.words;
            }
            None => self.graphs.slots.push(slot),
        }
        debug_assert!(
            self.graphs
                .slots
                .iter()
                .filter(|g| g.class == class)
                .count()
                <= CLASS_GRAPHS_MAX,
            "a class holds more graphs than its maximum"
        );
        crate::probe::hit(crate::probe::Probe::RuntimeGraphCaptured);
        Ok(graph)
    }

    /// Records a timing event on the compute stream.
    fn mark(&mut self) -> Result<DrvEvent, DeviceError> {
        let t = self.timing.as_mut().expect("timing on");
        let ev = match t.free.pop() {
            Some(ev) => ev,
            None => self.driver.event_create(EventUse::Timing)?,
        };
        if let Err(e) = self.driver.event_record(StreamKind::Compute, ev) {
            self.timing.as_mut().expect("timing on").free.push(ev);
            return Err(e);
        }
        Ok(ev)
    }

    /// Runs `f` between two timing events when the compute stream is timed. Timing is a
    /// measure, not part of the op: a mark the driver refuses leaves the op untimed, and only
    /// `f`'s own result is the call's (a failed `f` is not timed either).
    fn timed<R>(
        &mut self,
        stream: StreamKind,
        kind: Option<usize>,
        f: impl FnOnce(&mut Self) -> Result<R, DeviceError>,
    ) -> Result<R, DeviceError> {
        if stream != StreamKind::Compute || self.timing.is_none() {
            return f(self);
        }
        let start = self.mark();
        let r = f(self);
        let end = self.mark();
        let t = self.timing.as_mut().expect("timing on");
        match (start, end) {
            (Ok(start), Ok(end)) if r.is_ok() => t.marks.push((start, end, kind)),
            (start, end) => t.free.extend(start.into_iter().chain(end)),
        }
        r
    }

    /// Blocks until every stream's work completed.
    pub fn synchronize_all(&mut self) -> Result<(), DeviceError> {
        for s in StreamKind::ALL {
            self.driver.stream_synchronize(s)?;
        }
        Ok(())
    }

    /// A stream-ordered allocation on `s` of `bytes` (at least 1), freed after the op. When the
    /// pool cannot grow (out of memory), the memory freed on every stream is given back first:
    /// the context is synchronised (every stream-ordered free is reached), the pool trimmed,
    /// and the allocation made once more; its error then stands.
    fn scratch_alloc(&mut self, s: StreamKind, bytes: Bytes) -> Result<Ptr, DeviceError> {
        let bytes = bytes.max(Bytes(1));
        let mem = match self.driver.alloc_async(s, bytes.0) {
            Err(DeviceError::OutOfMemory { .. }) => {
                self.driver.context_synchronize()?;
                self.driver.trim_pool()?;
                crate::probe::hit(crate::probe::Probe::RuntimePoolTrimmed);
                self.driver.alloc_async(s, bytes.0)?
            }
            r => r?,
        };
        self.scratch.push(mem);
        Ok(Ptr::whole(mem, bytes))
    }

    /// Takes `p`'s allocation, the last one `scratch_alloc` made, out of the op's scratch: the
    /// runtime frees it later itself, not after the op.
    fn keep(&mut self, p: Ptr) {
        let mem = self.scratch.pop().expect("an allocation just made");
        assert_eq!(mem, p.mem, "the allocation kept is the last one made");
    }

    /// Uploads `data` into a stream-ordered allocation (freed after the op), staged through the
    /// stream's pinned ring, so that the copy is queued without waiting; above a quarter of the
    /// ring, from pageable memory.
    fn upload(&mut self, s: StreamKind, data: &[u8]) -> Result<Ptr, DeviceError> {
        let n = data.len().max(1);
        if n > self.staging_bytes / 4 {
            let dst = self.scratch_alloc(s, Bytes(n as u64))?;
            #[cfg(feature = "mutants")]
            if self.mutants.pageable_is_pinned() {
                self.copy_from_pinned(s, dst, data)?;
                return Ok(dst);
            }
            self.driver.copy_pageable(s, dst, data)?;
            return Ok(dst);
        }
        self.prepare_staging(s)?;
        if self.staging[s.index()]
            .as_ref()
            .is_some_and(|st| st.unknown)
        {
            self.driver.stream_synchronize(s)?;
            let staging = self.staging[s.index()].as_mut().expect("prepared above");
            staging.ring.retire_all(&mut staging.free);
            staging.unknown = false;
        }
        let staging = self.staging[s.index()].as_mut().expect("prepared above");
        let at = staging.ring.reserve(
            n,
            &mut staging.free,
            &mut DriverCopies {
                driver: &mut self.driver,
                waits: self.mutants.staging_waits(),
            },
        )?;
        let host = staging.host;
        self.driver.write_pinned(host, Bytes(at as u64), data)?;
        let dst = self.scratch_alloc(s, Bytes(n as u64))?;
        let src = Ptr {
            mem: host,
            offset: Bytes(at as u64),
            bytes: Bytes(n as u64),
        };
        self.driver.copy_async(s, dst, src)?;
        let staging = self.staging[s.index()].as_mut().expect("prepared above");
        let ev = match staging.free.pop() {
            Some(ev) => Ok(ev),
            None => self
                .driver
                .event_create(EventUse::Staging)
                .map_err(|e| (e, None)),
        };
        let recorded = ev.and_then(|ev| match self.driver.event_record(s, ev) {
            Ok(()) => Ok(ev),
            Err(e) => Err((e, Some(ev))),
        });
        let staging = self.staging[s.index()].as_mut().expect("prepared above");
        match recorded {
            Ok(ev) => staging.ring.queued(at, at + n, ev),
            Err((e, ev)) => {
                staging.free.extend(ev);
                staging.unknown = true;
                return Err(e);
            }
        }
        Ok(dst)
    }

    /// Mutant 34's copy: `data` written into the stream's pinned buffer (grown as needed; a
    /// buffer outgrown is kept, never freed) and copied asynchronously from it, with nothing
    /// that makes the next write wait for the copy.
    #[cfg(feature = "mutants")]
    fn copy_from_pinned(
        &mut self,
        s: StreamKind,
        dst: Ptr,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        let n = Bytes(data.len().max(1) as u64);
        let held = self.pinned_args[s.index()].filter(|&(_, cap)| cap >= n);
        let mem = match held {
            Some((mem, _)) => mem,
            None => {
                let cap = Bytes(n.0.next_power_of_two());
                let mem = self.driver.alloc(&BufferDesc {
                    role: BufferRole::Scratch {
                        name: "pinned argument buffer",
                    },
                    tier: MemoryTier::PinnedHost,
                    bytes: cap,
                    fingerprint: LayoutFingerprint::unpaged(cap.0),
                })?;
                self.pinned_args[s.index()] = Some((mem, cap));
                mem
            }
        };
        self.driver.write_pinned(mem, Bytes(0), data)?;
        let src = Ptr {
            mem,
            offset: Bytes(0),
            bytes: Bytes(data.len() as u64),
        };
        let to = dst.at(Bytes(0), Bytes(data.len() as u64));
        self.driver.copy_async(s, to, src)
    }

    /// Places the op's outputs at the start of its stream's output allocation (none for an op
    /// without), grown first when they do not fit: the old one freed on the stream, after every
    /// op that wrote it, and a new one of the next power of two of bytes made.
    fn stage(&mut self, s: StreamKind, p: &Pack) -> Result<Staged, DeviceError> {
        let n = Bytes(p.outs);
        if n.0 == 0 {
            return Ok(Staged { outs: None });
        }
        let held = self.outputs[s.index()].filter(|o| o.bytes >= n);
        let outs = match held {
            Some(o) => o,
            None => {
                if let Some(old) = self.outputs[s.index()].take() {
                    self.forget_graphs_of(old.mem);
                    self.driver.free_async(s, old.mem)?;
                }
                let o = self.scratch_alloc(s, Bytes(n.0.next_power_of_two()))?;
                // The allocation is the stream's now, not the op's.
                self.keep(o);
                crate::probe::hit(crate::probe::Probe::RuntimeOutputsGrown);
                self.outputs[s.index()] = Some(o);
                o
            }
        };
        Ok(Staged {
            outs: Some(outs.at(Bytes(0), n)),
        })
    }

    /// Frees every stream's output allocation on its stream (a free the driver refuses is the
    /// call's error; its memory goes with the context in error that refused it).
    fn retire_outputs(&mut self) -> Result<(), DeviceError> {
        let mut first = Ok(());
        for s in StreamKind::ALL {
            if let Some(o) = self.outputs[s.index()].take() {
                self.forget_graphs_of(o.mem);
                let r = self.driver.free_async(s, o.mem);
                if first.is_ok() {
                    first = r;
                }
            }
        }
        first
    }

    /// The device copy on `s` of an index array: the one uploaded already when the array is
    /// shared (and kept for the next op that names it), else uploaded now and freed after the
    /// op.
    fn shared_arg(&mut self, s: StreamKind, a: &args::Array<'_, i32>) -> Result<Ptr, DeviceError> {
        match a.shared() {
            Some(arc) => self.shared(s, arc),
            None => self.upload(s, bytes_of(a)),
        }
    }

    /// The device copy on `s` of the shared array `a`: the one uploaded already, else uploaded
    /// now and kept while `a` is held.
    fn shared<T: Copy + Send + Sync + 'static>(
        &mut self,
        s: StreamKind,
        a: &Arc<[T]>,
    ) -> Result<Ptr, DeviceError> {
        self.shared_as(s, a, Derived::Bytes, |a, d| d.upload(s, bytes_of(a)))
    }

    /// The device copy on `s` of `what` of the shared array `a`: the one uploaded already, else
    /// uploaded now by `upload` and kept while `a` is held.
    fn shared_as<T: Send + Sync + 'static>(
        &mut self,
        s: StreamKind,
        a: &Arc<[T]>,
        what: Derived,
        upload: impl FnOnce(&[T], &mut Self) -> Result<Ptr, DeviceError>,
    ) -> Result<Ptr, DeviceError> {
        let at = (Arc::as_ptr(a) as *const T as usize, a.len());
        let held = self.shared.iter();
        if let Some(u) = held
            .filter(|u| u.stream == s && u.what == what)
            .find(|u| u.array.at == at)
        {
            return Ok(u.ptr);
        }
        let ptr = upload(a, self)?;
        // The upload's allocation is the array's now, not the op's.
        self.keep(ptr);
        self.shared.push(SharedUpload {
            stream: s,
            array: Identity::of(a),
            what,
            ptr,
            resolved: None,
        });
        Ok(ptr)
    }

    /// Frees, each on its stream, the shared arrays no holder names any more (every op that
    /// read one was queued before this, on that stream). With `all`, every shared array (their
    /// bytes are not to be trusted after a recovery). Every one is forgotten; a free the driver
    /// refuses (only a context in error refuses one) is the call's error, and its memory goes
    /// with that context.
    fn retire_shared(&mut self, all: bool) -> Result<(), DeviceError> {
        let mut first = Ok(());
        let before = self.shared.len();
        let (gone, kept) = std::mem::take(&mut self.shared)
            .into_iter()
            .partition(|u| all || !u.array.alive());
        self.shared = kept;
        let gone: Vec<SharedUpload> = gone;
        assert_eq!(
            gone.len() + self.shared.len(),
            before,
            "every upload kept or freed"
        );
        for u in gone {
            crate::probe::hit(crate::probe::Probe::RuntimeSharedRetired);
            self.forget_graphs_of(u.ptr.mem);
            let r = self.driver.free_async(u.stream, u.ptr.mem);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// A new device allocation holding `data`, copied from pageable memory after a context
    /// synchronisation (freed again when the copy fails).
    fn upload_table(&mut self, s: StreamKind, data: &[u8]) -> Result<Mem, DeviceError> {
        let table = self.driver.alloc(&BufferDesc {
            role: BufferRole::Scratch { name: "RoPE table" },
            tier: MemoryTier::Device,
            bytes: Bytes(data.len() as u64),
            fingerprint: LayoutFingerprint::unpaged(data.len() as u64),
        })?;
        let copied = self
            .driver
            .copy_pageable(s, Ptr::whole(table, Bytes(data.len() as u64)), data)
            .and_then(|()| self.driver.context_synchronize());
        if let Err(e) = copied {
            // The copy's error is the one to report, whatever the cleanup meets.
            let _ = self.driver.free(table);
            return Err(e);
        }
        Ok(table)
    }

    /// Makes the device's RoPE table of `rope` hold row `max` (made, or doubled, on the host
    /// when it does not: the host computes each position's row once) and returns it with its
    /// rows. The old table may still be read by work queued on any stream: it is freed after a
    /// context synchronisation.
    fn rope_table(
        &mut self,
        s: StreamKind,
        rope: &Rope,
        max: u32,
    ) -> Result<(Ptr, u32), DeviceError> {
        if let Some(t) = self.rope.as_mut().filter(|t| t.lost) {
            let data = bytes_of(&t.host);
            let to = Ptr::whole(t.table, Bytes(data.len() as u64));
            self.driver
                .copy_pageable(s, to, data)
                .and_then(|()| self.driver.context_synchronize())?;
            t.lost = false;
        }
        if !self
            .rope
            .as_ref()
            .is_some_and(|t| t.rope == *rope && max < t.rows)
        {
            if max >= CONTEXT_TOKENS_MAX {
                return Err(DeviceError::Kernel {
                    op: "rope_rows",
                    detail: format!(
                        "RoPE position {max} past the longest context ({CONTEXT_TOKENS_MAX} tokens)"
                    ),
                });
            }
            // A power of two no larger than CONTEXT_TOKENS_MAX (itself one).
            let rows = (max + 1).next_power_of_two().max(ROPE_TABLE_ROWS_MIN);
            // The rows of the table it replaces, when it is the same model's, are kept.
            let mut host = match self.rope.as_mut().filter(|t| t.rope == *rope) {
                Some(t) => std::mem::take(&mut t.host),
                None => Vec::new(),
            };
            let had = (host.len() / ROPE_DIM as usize) as u32;
            host.extend(rope.rows(had..rows));
            let table = match self.upload_table(s, bytes_of(&host)) {
                Ok(table) => table,
                Err(e) => {
                    // The table it would have replaced keeps its rows.
                    if let Some(t) = self.rope.as_mut().filter(|t| t.rope == *rope) {
                        host.truncate(had as usize * ROPE_DIM as usize);
                        t.host = host;
                    }
                    return Err(e);
                }
            };
            let old = self.rope.replace(RopeTable {
                rope: *rope,
                rows,
                table,
                host,
                lost: false,
            });
            if let Some(old) = old {
                self.forget_graphs_of(old.table);
                self.driver.free(old.table)?;
            }
        }
        let t = self.rope.as_ref().expect("made above");
        let table = Ptr::whole(t.table, f32_bytes(t.rows as u64 * ROPE_DIM as u64));
        Ok((table, t.rows))
    }

    /// Uploads `d`'s rows (and for RoPE, their positions) to `s`, shared by the ops of every
    /// layer of the step, and plans the outputs of `kinds` drawn from them.
    fn plan_draws(
        &mut self,
        s: StreamKind,
        p: &mut Pack,
        d: &Drawn,
        kinds: &[DrawKind],
        rope: Option<&Rope>,
    ) -> Result<DrawPlan, DeviceError> {
        let rows = d.rows.len() as u64;
        let positions = rope.map(|_| d.positions());
        let (positions_dev, table) = match rope {
            Some(rope) => {
                let max = positions.iter().flatten().copied().max().unwrap_or(0);
                let table = self.rope_table(s, rope, max)?;
                let dev = self.shared_as(s, &d.rows, Derived::Positions, |r, dev| {
                    let p: Vec<u32> = r.iter().map(|t| t.position).collect();
                    dev.upload(s, bytes_of(&p))
                })?;
                (Some(dev), Some(table))
            }
            None => (None, None),
        };
        Ok(DrawPlan {
            rows: self.shared(s, &d.rows)?,
            outs: kinds.iter().map(|k| p.out(k.bytes(rows))).collect(),
            positions: positions_dev,
            rope_out: rope.map(|_| p.out(f32_bytes(rows * ROPE_DIM as u64))),
            positions_host: positions.unwrap_or_default(),
            table,
        })
    }

    /// The shared upload of drawn rows at `rows_dev`.
    fn rows_upload(&mut self, rows_dev: Ptr) -> &mut SharedUpload {
        self.shared
            .iter_mut()
            .find(|u| u.ptr == rows_dev && u.what == Derived::Bytes)
            .expect("drawn rows are uploaded shared")
    }

    /// Draws the synthetic model's inputs of `d`'s rows on stream `s` into the op's outputs (the
    /// host sends 8 bytes a row instead of the values; pending rows take their token from the
    /// op's tokens region first, on the device, in place in the rows' upload: the layers of a
    /// step share that upload, and only the first op that draws from it resolves the rows), and
    /// gathers their RoPE rows from `rope`
    /// (the table and its rows) when the plan has them.
    fn draw<'a>(
        &mut self,
        d: &'a Drawn,
        kinds: &[DrawKind],
        plan: &'a DrawPlan,
        st: &Staged,
        ls: &mut Vec<Launch<'a>>,
    ) -> Option<Resolve> {
        let rows_dev = plan.rows;
        let mut resolve = None;
        if let Some(t) = d.tokens {
            let tokens = self.region(&t);
            // The rows' upload resolved from these tokens already (by an earlier layer's op of
            // the step): nothing of it is pending any more. The resolution counts once its
            // launch is queued (`resolved`): a launch the driver refused resolved nothing, and
            // the op's next try launches it again.
            if self.rows_upload(rows_dev).resolved == Some(tokens) {
                crate::probe::hit(crate::probe::Probe::RuntimeResolvedOnce);
            } else {
                ls.push(Launch::ResolvePending {
                    rows: &d.rows,
                    rows_dev,
                    tokens,
                    tokens_len: u32_count(t.bytes) as u32,
                });
                resolve = Some(Resolve { rows_dev, tokens });
            }
        }
        for (&kind, &out) in kinds.iter().zip(&plan.outs) {
            ls.push(Launch::Draw {
                kind,
                seed: d.seed,
                layer: d.layer,
                rows: d.rows.len(),
                rows_dev,
                out: st.out(out),
            });
        }
        if let (Some((table, table_rows)), Some(pos), Some(out)) =
            (plan.table, plan.positions, plan.rope_out)
        {
            ls.push(Launch::RopeRows {
                table,
                table_rows,
                positions: &plan.positions_host,
                positions_dev: pos,
                out: st.out(out),
            });
        }
        resolve
    }

    /// Queues `ls`, the launches of `op`, and then counts the rows' resolution `r` done.
    fn submit_drawn(
        &mut self,
        s: StreamKind,
        op: &Op,
        ls: &[Launch<'_>],
        r: Option<Resolve>,
    ) -> Result<(), DeviceError> {
        self.submit(s, op, ls)?;
        if let Some(r) = r {
            self.rows_upload(r.rows_dev).resolved = Some(r.tokens);
        }
        Ok(())
    }

    /// Queues the launches of `op`, an op whose inputs are drawn on the device (the stores and
    /// `q_prep`), on `s`: the draws, their RoPE rows, then the op's kernel.
    fn run_drawn(&mut self, s: StreamKind, op: &Op) -> Result<(), DeviceError> {
        let mut p = Pack::default();
        match op {
            Op::IndexKStore(o) => {
                let kinds = [DrawKind::IndexKeys];
                let plan = self.plan_draws(s, &mut p, &o.keys, &kinds, Some(&o.rope))?;
                let (gamma, beta) = (self.shared(s, &o.gamma)?, self.shared(s, &o.beta)?);
                let slots = self.shared_arg(s, &o.args.slots)?;
                let st = self.stage(s, &p)?;
                let mut ls = Vec::with_capacity(4);
                let r = self.draw(&o.keys, &kinds, &plan, &st, &mut ls);
                ls.push(Launch::IndexKStore {
                    op: o,
                    keys: st.out(plan.outs[0]),
                    gamma,
                    beta,
                    rope: st.out(plan.rope_out.expect("planned")),
                    slots,
                    dst: self.buffer(o.dst),
                    dst_fp: self.desc(o.dst).fingerprint,
                });
                self.submit_drawn(s, op, &ls, r)
            }
            Op::KvStore(o) => {
                let kinds = [DrawKind::KvRows];
                let plan = self.plan_draws(s, &mut p, &o.rows, &kinds, None)?;
                let slots = self.shared_arg(s, &o.args.slots)?;
                let st = self.stage(s, &p)?;
                let mut ls = Vec::with_capacity(3);
                let r = self.draw(&o.rows, &kinds, &plan, &st, &mut ls);
                ls.push(Launch::KvStore {
                    op: o,
                    rows: st.out(plan.outs[0]),
                    slots,
                    dst: self.buffer(o.dst),
                    dst_fp: self.desc(o.dst).fingerprint,
                });
                self.submit_drawn(s, op, &ls, r)
            }
            Op::QPrep(o) => {
                let heads = o.args.heads;
                let kinds = [DrawKind::Queries { heads }, DrawKind::HeadWeights { heads }];
                let plan = self.plan_draws(s, &mut p, &o.inputs, &kinds, Some(&o.rope))?;
                let st = self.stage(s, &p)?;
                let mut ls = Vec::with_capacity(5);
                let r = self.draw(&o.inputs, &kinds, &plan, &st, &mut ls);
                ls.push(Launch::QPrep {
                    op: o,
                    q: st.out(plan.outs[0]),
                    w: st.out(plan.outs[1]),
                    rope: st.out(plan.rope_out.expect("planned")),
                    q_out: self.region(&o.q_out),
                    w_out: self.region(&o.w_out),
                });
                self.submit_drawn(s, op, &ls, r)
            }
            _ => unreachable!("not a drawn op: {}", op.name()),
        }
    }

    /// Queues `op`'s launches and copies on `s` (the op was checked). The one dispatch over the
    /// op set.
    fn run(&mut self, s: StreamKind, op: &Op) -> Result<(), DeviceError> {
        match op {
            Op::IndexKStore(_) | Op::KvStore(_) | Op::QPrep(_) => self.run_drawn(s, op),
            Op::IndexLogits(o) => {
                let page_table = self.shared_arg(s, &o.args.page_table)?;
                let context_lens = self.shared_arg(s, &o.args.context_lens)?;
                let l = Launch::IndexLogits {
                    op: o,
                    q: self.region(&o.q),
                    w: self.region(&o.w),
                    page_table,
                    context_lens,
                    k: self.buffer(o.k),
                    k_fp: self.desc(o.k).fingerprint,
                    out: self.region(&o.out),
                };
                self.submit(s, op, &[l])
            }
            Op::TopK(o) => {
                let page_table = self.shared_arg(s, &o.args.page_table)?;
                let context_lens = self.shared_arg(s, &o.args.context_lens)?;
                let l = Launch::TopK {
                    op: o,
                    logits: self.region(&o.logits),
                    context_lens,
                    page_table,
                    out: self.region(&o.out),
                };
                self.submit(s, op, &[l])
            }
            Op::SparseRead(o) => {
                let l = Launch::SparseRead {
                    op: o,
                    slots: self.region(&o.slots),
                    kv: self.buffer(o.kv),
                    kv_fp: self.desc(o.kv).fingerprint,
                    out: self.region(&o.out),
                };
                self.submit(s, op, &[l])
            }
            Op::PageCopy(o) => self.page_copy(s, op, o),
            Op::NextTokens(o) => {
                let l = Launch::NextTokens {
                    op: o,
                    digests: self.region(&o.digests),
                    out: self.region(&o.out),
                };
                self.submit(s, op, &[l])
            }
            Op::Copy(o) => {
                let (src, dst) = (self.region(&o.src), self.region(&o.dst));
                self.driver.copy_async(s, dst, src)
            }
        }
    }

    fn page_copy(&mut self, s: StreamKind, op: &Op, o: &PageCopy) -> Result<(), DeviceError> {
        let (src, dst) = (self.buffer(o.src), self.buffer(o.dst));
        let (sv, dv) = (&o.src_view, &o.dst_view);
        tierkv_kernels::cpu::check_page_copy(sv, src.bytes.0, dv, dst.bytes.0, &o.runs).map_err(
            |e| DeviceError::Kernel {
                op: "page_copy",
                detail: e.to_string(),
            },
        )?;
        match self.strategy {
            CopyStrategy::MemcpyRuns => {
                for (i, run) in o.runs.iter().enumerate() {
                    let (a, b) = (sv.page_range(run.src), dv.page_range(run.dst));
                    let rows = run.count as u64;
                    let width = sv.page_bytes();
                    // The last page's row ends at the page's bytes, not at the next stride.
                    let span = |stride: u64| Bytes((rows - 1) * stride + width);
                    let c = Copy2d {
                        src: src.at(Bytes(a.start), span(sv.page_stride)),
                        src_pitch: sv.page_stride,
                        dst: dst.at(Bytes(b.start), span(dv.page_stride)),
                        dst_pitch: dv.page_stride,
                        width,
                        height: rows,
                    };
                    if let Err(e) = self.driver.copy_2d_async(s, &c) {
                        // The runs queued before it would still write the destination after the
                        // caller reused it for something else (a failed load's pages are
                        // recomputed): they run out first. The copy's error is the one to
                        // report, whatever the synchronisation meets.
                        if i > 0 {
                            let _ = self.driver.stream_synchronize(s);
                            crate::probe::hit(crate::probe::Probe::RuntimePartialCopyDrained);
                        }
                        return Err(e);
                    }
                }
                Ok(())
            }
            CopyStrategy::Gather => {
                let flat = tierkv_kernels::cuda::gather_pairs(&o.runs);
                let pairs = self.upload(s, bytes_of(&flat))?;
                let l = Launch::PageGather {
                    op: o,
                    src,
                    dst,
                    pairs,
                };
                self.submit(s, op, &[l])
            }
        }
    }

    /// Frees the op's stream-ordered allocations on its stream, after everything it queued.
    fn free_scratch(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        let mut first = Ok(());
        let s = self.mutants.scratch_free_stream(s);
        for mem in std::mem::take(&mut self.scratch) {
            self.forget_graphs_of(mem);
            let r = self.driver.free_async(s, mem);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl<D: Driver> Drop for DrivenDevice<D> {
    /// Work still queued on any stream may use the buffers and the staging rings: it finishes
    /// before the driver frees them.
    fn drop(&mut self) {
        let _ = self.driver.bind();
        let _ = self.retire_shared(true);
        let _ = self.retire_outputs();
        let _ = self.synchronize_all();
    }
}

impl<D: Driver> Device for DrivenDevice<D> {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        let mem = self.driver.alloc(&desc)?;
        self.buffers.push((mem, desc));
        Ok(BufferId(self.buffers.len() as u32 - 1))
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.buffers[buf.0 as usize].1
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        let ev = self.driver.event_create(EventUse::Engine)?;
        self.events.push(ev);
        self.recorded_at.push(None);
        Ok(EventId(self.events.len() as u32 - 1))
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.driver.bind()?;
        // The arrays the engine dropped since the last record (a step ends with one) go now:
        // once a record, not once an op, as there are a few dozen uploads to look at.
        self.retire_shared(false)?;
        self.driver
            .event_record(stream, self.events[ev.0 as usize])?;
        self.recorded_at[ev.0 as usize] = Some(self.enqueued);
        // A slot whose previous callback has not run yet (late, or never: CUDA drops the
        // callbacks of a context in error) is not issued again: `query` asks the driver about
        // this record instead of blocking the host until that callback.
        let slot = ev.0 as usize;
        if stream == StreamKind::Load && slot < RING_SLOTS && self.ring.settled(slot) {
            let ticket = self.ring.issue(slot);
            let ring = self.ring.clone();
            let on = self.mutants.callback_stream(stream);
            let r = self
                .driver
                .host_callback(on, Box::new(move || ring.signal(ticket, 0)));
            if r.is_ok() {
                self.tickets.insert(ev, ticket);
            } else {
                // The event itself is recorded; only the host callback that would signal the
                // ring is missing. `query` then falls back to the driver's answer for this
                // event, which answers the same question more slowly, so the record still
                // succeeds. The ticket is completed here so the slot can be re-issued.
                self.ring.signal(ticket, 0);
                self.tickets.remove(&ev);
            }
        } else {
            self.tickets.remove(&ev);
        }
        Ok(())
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.mark_wait(ev);
        let e = self.events[ev.0 as usize];
        self.timed(stream, None, |d| d.driver.stream_wait(stream, e))
    }
    fn take_timing(&mut self) -> Option<DeviceTiming> {
        let mut t = self.timing.take()?;
        let mut out = DeviceTiming::default();
        let mut kept = Vec::new();
        for (start, end, kind) in t.marks.drain(..) {
            // Only work the host has waited for: a mark still pending stays for the next call.
            if self.driver.event_query(end) == EventState::Pending {
                kept.push((start, end, kind));
                continue;
            }
            let ns = self.driver.event_elapsed_ns(start, end).unwrap_or(0);
            match kind {
                None => out.stalled_ns += ns,
                Some(k) => {
                    out.busy_ns += ns;
                    out.busy_by_op_ns[k] += ns;
                }
            }
            t.free.push(start);
            t.free.push(end);
        }
        t.marks = kept;
        out.enqueue_ns = std::mem::take(&mut t.enqueue_ns);
        out.launches = std::mem::take(&mut self.graphs.launches);
        out.launches_from_graphs = std::mem::take(&mut self.graphs.from_graphs);
        self.timing = Some(t);
        Some(out)
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        let generation = self.driver.context_generation();
        self.driver.recover()?;
        // The callbacks queued before the fault may never run (CUDA drops them after an
        // error): their slots start again in a new ring. A late one signals the old ring, which
        // nobody reads.
        self.ring = Arc::new(CompletionRing::new(RING_SLOTS));
        self.tickets.clear();
        if self.driver.context_generation() != generation {
            // A recreated context lost the device's bytes: the RoPE table is uploaded again
            // into its allocation when next needed.
            if let Some(t) = self.rope.as_mut() {
                t.lost = true;
            }
        }
        // What a shared array's upload holds after a fault is not known: each is uploaded
        // again when next named. The output allocations are made again when next needed. The
        // graphs that name either go with them.
        self.graphs.recovering = true;
        let outputs = self.retire_outputs();
        let shared = self.retire_shared(true);
        self.graphs.recovering = false;
        shared.and(outputs)
    }
    fn context_generation(&self) -> u64 {
        self.driver.context_generation()
    }
    fn query(&mut self, ev: EventId) -> EventState {
        if let Some(&t) = self.tickets.get(&ev) {
            // The host callback ran: the load stream passed this event.
            if self.ring.poll(t).is_some() {
                self.driver.observed_by_callback(self.events[ev.0 as usize]);
                return EventState::Done;
            }
        }
        self.driver.event_query(self.events[ev.0 as usize])
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.mark_wait(ev);
        self.driver.event_synchronize(self.events[ev.0 as usize])
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        // Real time only while timed: the runtime names no clock otherwise.
        let t0 = self.timing.is_some().then(std::time::Instant::now);
        self.enqueued += 1;
        let buffers = &self.buffers;
        self.checked.check(&op, &|b| buffers[b.0 as usize].1)?;
        self.driver.bind()?;
        let r = self.timed(stream, Some(op.kind()), |d| {
            let r = d.run(stream, &op);
            let freed = d.free_scratch(stream);
            r.and(freed)
        });
        if let (StreamKind::Compute, Some(t), Some(t0)) = (stream, self.timing.as_mut(), t0) {
            t.enqueue_ns[op.kind()] += t0.elapsed().as_nanos() as u64;
        }
        r
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        let (mem, desc) = self.buffers[buf.0 as usize];
        check_host_access("host_read", buf, desc, offset, out.len())?;
        self.driver.read_pinned(mem, offset, out)
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        let (mem, desc) = self.buffers[buf.0 as usize];
        check_host_access("host_write", buf, desc, offset, data.len())?;
        self.driver.write_pinned(mem, offset, data)
    }
}
