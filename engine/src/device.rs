//! The runtime traits: [`Clock`] and [`Device`], and the closed set of [`Op`]s a device runs.
//!
//! A `Device` owns buffers (device memory and pinned host memory, each tagged with its layout
//! fingerprint), three streams, and events. The engine enqueues ops on streams; ops on one stream
//! run in order, and across streams only events order them — exactly CUDA's contract, which the
//! simulator implements adversarially and the production device implements with CUDA itself.
//!
//! Every op declares the byte ranges it reads and writes ([`Op::accesses`]), computed from its
//! arguments alone. That declaration is what lets the simulator's race detector check every access
//! in every schedule; an op that reads device memory through indices produced by another kernel
//! (`SparseRead` reads rows named by `TopK`'s output) declares the whole set it may read.

use crate::layout::{
    kv_row, BufferKind, Bytes, IndexKDtype, KvDtype, LayerId, LayoutFingerprint, PageFormat,
    PageRun, PagedView, PAGE_TOKENS,
};
use half::bf16;
use std::fmt;
use std::sync::Arc;

/// Nanoseconds since an arbitrary origin: virtual in the simulator, monotonic in production.
pub trait Clock {
    fn now_ns(&self) -> u64;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferId(pub u32);
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub u32);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "buf{}", self.0)
    }
}
impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ev{}", self.0)
    }
}

/// The engine's three streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StreamKind {
    /// The model step: stores, indexer, sparse reads.
    Compute,
    /// Host → device load-back.
    Load,
    /// Device → host backup.
    Write,
}

impl StreamKind {
    pub const ALL: [StreamKind; 3] = [StreamKind::Compute, StreamKind::Load, StreamKind::Write];
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn name(self) -> &'static str {
        match self {
            StreamKind::Compute => "compute",
            StreamKind::Load => "load",
            StreamKind::Write => "write",
        }
    }
}

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryTier {
    Device,
    /// Page-locked host memory the host reads and writes directly and copies move to and from.
    PinnedHost,
}

/// What a buffer is for (reports name buffers by role).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferRole {
    /// One layer's device pool of `kind`.
    Pool { kind: BufferKind, layer: LayerId },
    /// The host mirror of `kind` (all layers).
    Mirror { kind: BufferKind },
    /// Step scratch (queries, logits, selections, digests, readback).
    Scratch { name: &'static str },
}

impl fmt::Display for BufferRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufferRole::Pool { kind, layer } => write!(f, "device {} layer {}", kind.name(), layer),
            BufferRole::Mirror { kind } => write!(f, "host {} mirror", kind.name()),
            BufferRole::Scratch { name } => write!(f, "scratch {name}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferDesc {
    pub role: BufferRole,
    pub tier: MemoryTier,
    pub bytes: Bytes,
    pub fingerprint: LayoutFingerprint,
}

/// The state of an event as the host sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventState {
    /// Work captured by the event has not finished.
    Pending,
    /// Everything captured by the event finished.
    Done,
    /// Everything captured finished, and at least one op between the previous record on that stream
    /// and this record failed (a failed copy; its destination holds unspecified bytes).
    Failed,
}

/// Conditions a caller handles. Invariant violations inside a device panic instead.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DeviceError {
    #[error("out of {tier:?} memory allocating {bytes} B for {role}")]
    OutOfMemory {
        role: BufferRole,
        tier: MemoryTier,
        bytes: u64,
    },
    #[error(
        "{op}: layout mismatch on {buffer} ({role}): op declares {declared}, buffer is {actual}"
    )]
    LayoutMismatch {
        op: &'static str,
        buffer: BufferId,
        role: BufferRole,
        declared: LayoutFingerprint,
        actual: LayoutFingerprint,
    },
    #[error("{op}: {buffer} ({role}) is {size} B, the op touches {start}..{end}")]
    OutOfBounds {
        op: &'static str,
        buffer: BufferId,
        role: BufferRole,
        start: u64,
        end: u64,
        size: u64,
    },
    #[error("{op}: {detail}")]
    Kernel { op: &'static str, detail: String },
    #[error("{op}: host access to {buffer} ({role}), which is not pinned host memory")]
    NotHostMemory {
        op: &'static str,
        buffer: BufferId,
        role: BufferRole,
    },
    #[error("device: {detail}")]
    Backend { detail: String },
}

/// A byte range of one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteRange {
    pub buffer: BufferId,
    pub start: u64,
    pub end: u64,
}

/// One declared access of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    pub range: ByteRange,
    pub write: bool,
}

/// What a read or write of a row means for the oracles: which request's context it belongs to.
/// The engine attaches these to ops; devices that do not check content ignore them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowTags {
    /// Global id of the layer the op works on.
    pub layer_global: u32,
    /// One tag per row (query row, or stored token).
    pub rows: Vec<RowTag>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTag {
    pub request: u64,
    /// The query position (reads) or the stored token's position (stores).
    pub position: u32,
}

/// A region of a scratch buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub buffer: BufferId,
    pub offset: u64,
    pub bytes: u64,
}

impl Region {
    pub fn range(&self) -> ByteRange {
        ByteRange {
            buffer: self.buffer,
            start: self.offset,
            end: self.offset + self.bytes,
        }
    }
}

/// Every operation a device runs. Small metadata (slots, page tables, context lengths) travels by
/// value; bulk data lives in buffers. Inputs that the model would produce on the device (raw keys,
/// queries, KV rows — here from the synthetic model) travel by value too.
#[derive(Clone, Debug)]
pub enum Op {
    /// `index_k_store` into one layer's index-K pool.
    IndexKStore {
        dst: BufferId,
        dtype: IndexKDtype,
        ue8m0: bool,
        keys: Vec<bf16>,
        gamma: Arc<[f32]>,
        beta: Arc<[f32]>,
        rope: Vec<f32>,
        slots: Vec<i32>,
        tags: RowTags,
    },
    /// `kv_store` into one layer's KV pool.
    KvStore {
        dst: BufferId,
        dtype: KvDtype,
        rows: Vec<bf16>,
        slots: Vec<i32>,
        tags: RowTags,
    },
    /// `q_prep` for `rope.len() / 64` query rows.
    QPrep {
        heads: u32,
        q: Vec<bf16>,
        weights: Vec<f32>,
        rope: Vec<f32>,
        q_out: Region,
        w_out: Region,
    },
    /// `index_logits` over one layer's index-K pool.
    IndexLogits {
        dtype: IndexKDtype,
        heads: u32,
        q: Region,
        w: Region,
        k: BufferId,
        page_table: Vec<i32>,
        pt_stride: u32,
        context_lens: Vec<i32>,
        out: Region,
        out_stride: u32,
        tags: RowTags,
    },
    /// `topk` with the configured `index_topk`.
    TopK {
        k: u32,
        logits: Region,
        stride: u32,
        context_lens: Vec<i32>,
        page_table: Vec<i32>,
        pt_stride: u32,
        out: Region,
    },
    /// `sparse_read` of one layer's KV pool through `TopK`'s selection.
    SparseRead {
        dtype: KvDtype,
        k: u32,
        slots: Region,
        kv: BufferId,
        /// Each row's page table and context length: the rows the selection may name, declared as
        /// this op's read set (the selection itself is device data).
        page_table: Vec<i32>,
        pt_stride: u32,
        context_lens: Vec<i32>,
        out: Region,
        tags: RowTags,
    },
    /// Whole pages between two paged views (device pool ↔ host mirror).
    PageCopy {
        src: BufferId,
        src_view: PagedView,
        dst: BufferId,
        dst_view: PagedView,
        runs: Vec<PageRun>,
    },
    /// A linear copy (e.g. digests to the pinned readback buffer).
    Copy { src: Region, dst: Region },
}

impl Op {
    pub fn name(&self) -> &'static str {
        match self {
            Op::IndexKStore { .. } => "index_k_store",
            Op::KvStore { .. } => "kv_store",
            Op::QPrep { .. } => "q_prep",
            Op::IndexLogits { .. } => "index_logits",
            Op::TopK { .. } => "topk",
            Op::SparseRead { .. } => "sparse_read",
            Op::PageCopy { .. } => "page_copy",
            Op::Copy { .. } => "copy",
        }
    }

    /// The paged buffers this op touches and the format it believes each has; a device checks each
    /// against the buffer's registered fingerprint before running the op (paired with the checks
    /// the engine made when it built the op).
    pub fn declared_formats(&self) -> Vec<(BufferId, LayoutFingerprint)> {
        match self {
            Op::IndexKStore { dst, dtype, .. } => {
                vec![(*dst, PageFormat::IndexK(*dtype).fingerprint())]
            }
            Op::KvStore { dst, dtype, .. } => vec![(*dst, PageFormat::Kv(*dtype).fingerprint())],
            Op::IndexLogits { k, dtype, .. } => {
                vec![(*k, PageFormat::IndexK(*dtype).fingerprint())]
            }
            Op::SparseRead { kv, dtype, .. } => vec![(*kv, PageFormat::Kv(*dtype).fingerprint())],
            Op::PageCopy {
                src,
                src_view,
                dst,
                dst_view,
                ..
            } => vec![(*src, src_view.fingerprint), (*dst, dst_view.fingerprint)],
            Op::QPrep { .. } | Op::TopK { .. } | Op::Copy { .. } => Vec::new(),
        }
    }

    /// The byte ranges this op reads and writes, computed from its arguments.
    pub fn accesses(&self) -> Vec<Access> {
        let mut out = Vec::new();
        let rd = |out: &mut Vec<Access>, r: ByteRange| {
            out.push(Access {
                range: r,
                write: false,
            })
        };
        let wr = |out: &mut Vec<Access>, r: ByteRange| {
            out.push(Access {
                range: r,
                write: true,
            })
        };
        match self {
            Op::IndexKStore {
                dst, dtype, slots, ..
            } => {
                let fmt = PageFormat::IndexK(*dtype);
                for &s in slots {
                    // The token's values and (fp8) scale both live in its page: declare the page.
                    push_page(&mut out, *dst, fmt, s.max(0) as u32 / PAGE_TOKENS, true);
                }
            }
            Op::KvStore {
                dst, dtype, slots, ..
            } => {
                let tb = PageFormat::Kv(*dtype).token_bytes();
                for &s in slots {
                    let at = kv_row::slot_offset(*dtype, s.max(0) as u32) as u64;
                    wr(&mut out, range(*dst, at, tb));
                }
            }
            Op::QPrep { q_out, w_out, .. } => {
                wr(&mut out, q_out.range());
                wr(&mut out, w_out.range());
            }
            Op::IndexLogits {
                dtype,
                q,
                w,
                k,
                page_table,
                pt_stride,
                context_lens,
                out: o,
                ..
            } => {
                rd(&mut out, q.range());
                rd(&mut out, w.range());
                let fmt = PageFormat::IndexK(*dtype);
                for page in used_pages(page_table, *pt_stride, context_lens) {
                    push_page(&mut out, *k, fmt, page, false);
                }
                wr(&mut out, o.range());
            }
            Op::TopK { logits, out: o, .. } => {
                rd(&mut out, logits.range());
                wr(&mut out, o.range());
            }
            Op::SparseRead {
                dtype,
                slots,
                kv,
                page_table,
                pt_stride,
                context_lens,
                out: o,
                ..
            } => {
                rd(&mut out, slots.range());
                let fmt = PageFormat::Kv(*dtype);
                for page in used_pages(page_table, *pt_stride, context_lens) {
                    push_page(&mut out, *kv, fmt, page, false);
                }
                wr(&mut out, o.range());
            }
            Op::PageCopy {
                src,
                src_view,
                dst,
                dst_view,
                runs,
            } => {
                for run in runs {
                    for j in 0..run.count {
                        let s = src_view.page_range(crate::layout::PageId(run.src.0 + j));
                        let d = dst_view.page_range(crate::layout::PageId(run.dst.0 + j));
                        rd(
                            &mut out,
                            ByteRange {
                                buffer: *src,
                                start: s.start,
                                end: s.end,
                            },
                        );
                        wr(
                            &mut out,
                            ByteRange {
                                buffer: *dst,
                                start: d.start,
                                end: d.end,
                            },
                        );
                    }
                }
            }
            Op::Copy { src, dst } => {
                rd(&mut out, src.range());
                wr(&mut out, dst.range());
            }
        }
        out
    }

    /// Shape checks that need no buffer: metadata lengths agree with each other.
    pub fn check_shapes(&self) -> Result<(), DeviceError> {
        let bad = |detail: String| DeviceError::Kernel {
            op: self.name(),
            detail,
        };
        let rows_ok = |page_table: &[i32], pt_stride: u32, context_lens: &[i32]| {
            if page_table.len() != context_lens.len() * pt_stride as usize {
                return Err(bad(format!(
                    "page table has {} entries, expected {} rows x {pt_stride}",
                    page_table.len(),
                    context_lens.len()
                )));
            }
            for (r, &len) in context_lens.iter().enumerate() {
                if len < 0 || len as u64 > pt_stride as u64 * PAGE_TOKENS as u64 {
                    return Err(bad(format!(
                        "row {r}: context length {len} outside its page table of {pt_stride} pages"
                    )));
                }
            }
            Ok(())
        };
        match self {
            Op::IndexKStore {
                keys, rope, slots, ..
            } => {
                if keys.len() != slots.len() * 128 || rope.len() != slots.len() * 64 {
                    return Err(bad("keys/rope/slots lengths disagree".into()));
                }
            }
            Op::KvStore { rows, slots, .. } => {
                if rows.len() != slots.len() * crate::layout::KV_ROW_VALUES as usize {
                    return Err(bad("rows/slots lengths disagree".into()));
                }
            }
            Op::IndexLogits {
                page_table,
                pt_stride,
                context_lens,
                out_stride,
                ..
            } => {
                rows_ok(page_table, *pt_stride, context_lens)?;
                if context_lens.iter().any(|&l| l as u32 > *out_stride) {
                    return Err(bad("a context is longer than the output stride".into()));
                }
            }
            Op::TopK {
                page_table,
                pt_stride,
                context_lens,
                stride,
                ..
            } => {
                rows_ok(page_table, *pt_stride, context_lens)?;
                if context_lens.iter().any(|&l| l as u32 > *stride) {
                    return Err(bad("a context is longer than the logits stride".into()));
                }
            }
            Op::SparseRead {
                page_table,
                pt_stride,
                context_lens,
                ..
            } => rows_ok(page_table, *pt_stride, context_lens)?,
            Op::QPrep { .. } | Op::PageCopy { .. } | Op::Copy { .. } => {}
        }
        Ok(())
    }

    pub fn tags(&self) -> Option<&RowTags> {
        match self {
            Op::IndexKStore { tags, .. }
            | Op::KvStore { tags, .. }
            | Op::IndexLogits { tags, .. }
            | Op::SparseRead { tags, .. } => Some(tags),
            _ => None,
        }
    }
}

fn range(buffer: BufferId, start: u64, bytes: u64) -> ByteRange {
    ByteRange {
        buffer,
        start,
        end: start + bytes,
    }
}

fn push_page(out: &mut Vec<Access>, buf: BufferId, fmt: PageFormat, page: u32, write: bool) {
    let pb = fmt.page_bytes();
    let start = page as u64 * pb;
    // Pages of one op are often repeated (many tokens per page): merge with the previous access.
    if let Some(last) = out.last() {
        if last.range.buffer == buf && last.write == write && last.range.start == start {
            return;
        }
    }
    out.push(Access {
        range: range(buf, start, pb),
        write,
    });
}

/// The distinct pages the rows' contexts cover, in first-use order. Negative entries (never valid)
/// are declared as page 0's neighbourhood would be wrong; they are skipped here and refused by the
/// kernel's bounds check when the op runs.
pub fn used_pages(page_table: &[i32], pt_stride: u32, context_lens: &[i32]) -> Vec<u32> {
    let mut pages: Vec<u32> = Vec::new();
    for (r, &len) in context_lens.iter().enumerate() {
        let n = (len.max(0) as u32).div_ceil(PAGE_TOKENS) as usize;
        let row = &page_table[r * pt_stride as usize..][..n.min(pt_stride as usize)];
        for &p in row {
            if p >= 0 {
                pages.push(p as u32);
            }
        }
    }
    pages.sort_unstable();
    pages.dedup();
    pages
}

/// A device: buffers, three streams, events, ops. See the module comment for the contract.
pub trait Device {
    /// Allocates a buffer. Device buffers start with unspecified contents (the simulator fills them
    /// with poison); pinned host buffers too.
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError>;
    fn desc(&self, buf: BufferId) -> BufferDesc;
    /// A fresh event, never recorded (querying it answers `Done`, as CUDA does).
    fn new_event(&mut self) -> EventId;
    /// Captures all work enqueued on `stream` so far.
    fn record(&mut self, stream: StreamKind, ev: EventId);
    /// Later work on `stream` waits for the event's most recent capture.
    fn wait(&mut self, stream: StreamKind, ev: EventId);
    /// Host query, non-blocking. Answering `Done` or `Failed` orders the host after the capture.
    fn query(&mut self, ev: EventId) -> EventState;
    /// Host blocks until the capture finished; orders the host after it.
    fn synchronize(&mut self, ev: EventId) -> EventState;
    /// Enqueues `op` on `stream`. Refuses (typed error) an op whose declared formats or ranges do
    /// not fit its buffers; nothing is enqueued then.
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError>;
    /// Host reads pinned host memory.
    fn host_read(&mut self, buf: BufferId, offset: u64, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Host writes pinned host memory.
    fn host_write(&mut self, buf: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError>;
}

/// The check every device makes before the host reads or writes `len` bytes at `offset` of a
/// buffer: it must be pinned host memory and the range must lie inside it.
pub fn check_host_access(
    op: &'static str,
    buf: BufferId,
    desc: BufferDesc,
    offset: u64,
    len: usize,
) -> Result<(), DeviceError> {
    if desc.tier != MemoryTier::PinnedHost {
        return Err(DeviceError::NotHostMemory {
            op,
            buffer: buf,
            role: desc.role,
        });
    }
    let end = offset.checked_add(len as u64).unwrap_or(u64::MAX);
    if end > desc.bytes.0 {
        return Err(DeviceError::OutOfBounds {
            op,
            buffer: buf,
            role: desc.role,
            start: offset,
            end,
            size: desc.bytes.0,
        });
    }
    Ok(())
}

/// The checks every device makes before an op may run: declared formats equal the buffers'
/// registered fingerprints, and every declared range lies inside its buffer.
pub fn check_op(op: &Op, desc: impl Fn(BufferId) -> BufferDesc) -> Result<(), DeviceError> {
    op.check_shapes()?;
    if let Op::PageCopy {
        src,
        src_view,
        dst,
        dst_view,
        runs,
    } = op
    {
        tierkv_kernels::cpu::check_page_copy(
            src_view,
            desc(*src).bytes.0,
            dst_view,
            desc(*dst).bytes.0,
            runs,
        )
        .map_err(|e| DeviceError::Kernel {
            op: "page_copy",
            detail: e.to_string(),
        })?;
    }
    for (buf, declared) in op.declared_formats() {
        let d = desc(buf);
        if d.fingerprint != declared {
            return Err(DeviceError::LayoutMismatch {
                op: op.name(),
                buffer: buf,
                role: d.role,
                declared,
                actual: d.fingerprint,
            });
        }
    }
    for a in op.accesses() {
        let d = desc(a.range.buffer);
        if a.range.end > d.bytes.0 || a.range.start > a.range.end {
            return Err(DeviceError::OutOfBounds {
                op: op.name(),
                buffer: a.range.buffer,
                role: d.role,
                start: a.range.start,
                end: a.range.end,
                size: d.bytes.0,
            });
        }
    }
    Ok(())
}
