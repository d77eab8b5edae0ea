//! The runtime traits: [`Clock`] and [`Device`], and the closed set of [`Op`]s a device runs
//! (each op's definition, footprint and checks live in [`op`]).
//!
//! A `Device` owns buffers (device memory and pinned host memory, each tagged with its layout
//! fingerprint), three streams, and events. The engine enqueues ops on streams; ops on one stream
//! run in order, and across streams only events order them — exactly CUDA's contract, which the
//! simulator implements adversarially and the production device implements with CUDA itself.
//!
//! Every call that reaches a driver answers a `Result` (or, for `query` and `synchronize`, an
//! `EventState` that may be `Failed`): creating, recording and waiting on an event can fail on
//! a real GPU, and the engine must see that as an error, never as a panic.
//!
//! Every op declares the byte ranges it reads and writes ([`OpSpec::accesses`]), computed from its
//! arguments alone. That declaration is what lets the simulator's race detector check every declared
//! access of every op it runs; an op that reads device memory through indices produced by another kernel
//! (`SparseRead` reads rows named by `TopK`'s output) declares the whole set it may read.

pub mod memo;
pub mod op;

pub use op::*;

use crate::layout::{BufferKind, Bytes, LayerId, LayoutFingerprint};
use std::fmt;

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
    /// The host tier of a server's offloading (`crate::offload`): segment `segment` of the
    /// host chunks of the server's cache `cache`.
    OffloadHost { cache: u32, segment: u32 },
}

impl fmt::Display for BufferRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufferRole::Pool { kind, layer } => write!(f, "device {} layer {}", kind.name(), layer),
            BufferRole::Mirror { kind } => write!(f, "host {} mirror", kind.name()),
            BufferRole::Scratch { name } => write!(f, "scratch {name}"),
            BufferRole::OffloadHost { cache, segment } => {
                write!(f, "offload host tier of cache {cache}, segment {segment}")
            }
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
    /// A driver's own error (CUDA, NCCL), its message as the driver gave it, with the call.
    /// (`EngineError::Device` says "device: " before it.)
    #[error("{detail}")]
    Backend { detail: String },
    /// The device is in error since an asynchronous fault (CUDA's sticky errors: one poisons
    /// the whole context), and every call fails with this until [`Device::recover`].
    #[error("the device is in error since {cause}; calls fail until it is recovered")]
    InError { cause: DeviceFault },
}

/// The asynchronous fault that left a device in error ([`DeviceError::InError`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceFault {
    /// An op failed while it ran (a kernel's launch failure, a failed copy).
    Failed {
        op: &'static str,
        stream: StreamKind,
    },
    /// An op did not finish within the device's watchdog deadline, and was given up.
    Hung {
        op: &'static str,
        stream: StreamKind,
        after_ns: u64,
    },
}

impl fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceFault::Failed { op, stream } => {
                write!(f, "{op} failed on the {} stream", stream.name())
            }
            DeviceFault::Hung {
                op,
                stream,
                after_ns,
            } => write!(
                f,
                "{op} on the {} stream did not finish within {after_ns} ns",
                stream.name()
            ),
        }
    }
}

impl DeviceError {
    /// An error of the device itself, which a call made again after [`Device::recover`] may not
    /// meet (a failed driver call, memory the driver could not give now, a device in error); the
    /// rest refuse the call's arguments (a bug of the caller) and fail the same way again.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            DeviceError::Backend { .. }
                | DeviceError::OutOfMemory { .. }
                | DeviceError::InError { .. }
        )
    }
}

/// Calls a device `call` made again after a transient failure (`DeviceError::is_transient`),
/// up to this many calls in all; then its error stands. Repeating a call is safe: a call of the
/// simulated GPU has no effect when it fails; the runtime's enqueue (`runtime::driven`, the
/// production device and the device of most simulated seeds) may have queued part of its work
/// before it failed (argument uploads, launches that write only the op's own scratch, the
/// resolution of pending tokens in place in the step's shared upload of rows, which resolving
/// again leaves as it is, the first runs of a page copy, which it runs out before it returns),
/// and the repeat enqueues the same bytes to the same places again.
pub const CALL_TRIES_MAX: u32 = 8;

/// Makes a device call (an event's creation, record or wait, an op's enqueue) and calls again
/// after a transient failure, up to [`CALL_TRIES_MAX`] calls. A device in error
/// (`DeviceError::InError`) is recovered first; the other transient errors (memory the driver
/// could not give now, a failed driver call) are met by the call alone, and recovering would
/// clear stream errors the engine has not yet handled. An error of `recover` itself stops it:
/// the device is lost.
pub fn call_recovering<D: Device + ?Sized, R>(
    dev: &mut D,
    call: impl FnMut(&mut D) -> Result<R, DeviceError>,
) -> Result<R, DeviceError> {
    let made = call_loop(dev, None, call)?;
    Ok(made.expect("a call not bound to a context generation is always made"))
}

/// [`call_recovering`] for a call that reads what the device held at context generation
/// `since` (an op of a step that began then): it is not made while the generation differs, nor
/// again after a recovery that recreated the context — what it would read is lost. `None`
/// answers that it was not made.
pub fn call_recovering_since<D: Device + ?Sized, R>(
    dev: &mut D,
    since: u64,
    call: impl FnMut(&mut D) -> Result<R, DeviceError>,
) -> Result<Option<R>, DeviceError> {
    call_loop(dev, Some(since), call)
}

fn call_loop<D: Device + ?Sized, R>(
    dev: &mut D,
    since: Option<u64>,
    mut call: impl FnMut(&mut D) -> Result<R, DeviceError>,
) -> Result<Option<R>, DeviceError> {
    let lost = |dev: &D| since.is_some_and(|g| dev.context_generation() != g);
    let mut tries = 1;
    loop {
        if lost(dev) {
            return Ok(None);
        }
        match call(dev) {
            Err(e) if e.is_transient() && tries < CALL_TRIES_MAX => {
                if matches!(e, DeviceError::InError { .. }) {
                    dev.recover()?;
                }
                if lost(dev) {
                    return Ok(None);
                }
                crate::probe::hit(crate::probe::Probe::DeviceCallRepeated);
                tries += 1;
            }
            r => return r.map(Some),
        }
    }
}

/// A device: buffers, three streams, events, ops. See the module comment for the contract.
pub trait Device {
    /// Allocates a buffer. Device buffers start with unspecified contents (the simulator fills them
    /// with poison); pinned host buffers too.
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError>;
    fn desc(&self, buf: BufferId) -> BufferDesc;
    /// A fresh event, never recorded (querying it answers `Done`, as CUDA does).
    ///
    /// Every call below that answers a `Result` has no effect when it fails: nothing is
    /// created, recorded, waited for or enqueued — but for `enqueue` on a runtime whose op is
    /// several driver calls (`runtime::driven`): the part it queued before the failing call
    /// writes only the op's own scratch, the runtime's uploads of the op's arrays (kept for the
    /// step's other ops: a drawn row's pending token resolved in place there, as every layer's
    /// op resolves it), or (runs of a page copy) the op's destination, and then it has completed
    /// when the call returns. Nothing a failed call queued writes the op's destination
    /// afterwards.
    fn new_event(&mut self) -> Result<EventId, DeviceError>;
    /// Captures all work enqueued on `stream` so far.
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError>;
    /// Later work on `stream` waits for the event's most recent capture.
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError>;
    /// Host query, non-blocking. Answering `Done` or `Failed` orders the host after the capture.
    fn query(&mut self, ev: EventId) -> EventState;
    /// Host blocks until the capture finished; orders the host after it. A driver error while
    /// waiting answers `Failed`: the captured work cannot be trusted.
    fn synchronize(&mut self, ev: EventId) -> EventState;
    /// Enqueues `op` on `stream`. Refuses (typed error) an op whose declared formats or ranges do
    /// not fit its buffers; nothing is enqueued then.
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError>;
    /// Host reads pinned host memory.
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError>;
    /// Host writes pinned host memory.
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError>;
    /// The host saw a failed event: clears the device's error so that later work runs. A fault
    /// may be sticky: after it the faulted stream skips its work, and its records report
    /// `Failed`, until this is called (the simulator's per-stream, recoverable model). A fault
    /// sticky for the whole device (a CUDA context's asynchronous error) cannot be cleared in
    /// place: recovering recreates the device's context, which loses what device memory held
    /// (every `BufferId` stays valid, its device bytes are undefined; pinned host buffers keep
    /// theirs) and bumps [`Device::context_generation`]. An error here means the device cannot
    /// go on, and the engine stops with it.
    fn recover(&mut self) -> Result<(), DeviceError>;
    /// How many times [`Device::recover`] recreated this device's context. Device memory
    /// written before a recreation holds garbage after it, and work in flight across it may
    /// still answer `Done` (it completed before the fault, or ran in the new context on lost
    /// bytes): an engine that sees the number move trusts no copy or step in flight across it
    /// and drops what it kept on the device.
    fn context_generation(&self) -> u64;
    /// What the device measured of its compute stream since the last call, for work the host
    /// has already waited for. A device that does not time its work (the CPU and simulated
    /// devices, and CUDA unless `CudaDevice::set_timing` turned it on) answers `None`.
    fn take_timing(&mut self) -> Option<DeviceTiming> {
        None
    }
}

/// Time the compute stream spent, in nanoseconds of the device's own clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceTiming {
    /// Running ops (kernels and the copies of their small arguments), each from its start to its
    /// end.
    pub busy_ns: u64,
    /// Waiting at a wait for another stream's event (the step's loads): transfer time the
    /// device could not hide.
    pub stalled_ns: u64,
    /// `busy_ns` per op kind (`Op::NAMES` order).
    pub busy_by_op_ns: [u64; op::Op::KINDS],
    /// Host time inside `enqueue` of the compute stream, per op kind (`Op::NAMES` order):
    /// the launchers' checks, argument uploads and launches.
    pub enqueue_ns: [u64; op::Op::KINDS],
    /// Kernel launches of the compute stream's ops queued, and how many of them were queued
    /// from graphs (captured for the op, or replayed), not launched one by one.
    pub launches: u64,
    pub launches_from_graphs: u64,
}

impl DeviceTiming {
    /// Adds another step's timing (the engine's running totals).
    pub fn add(&mut self, o: &DeviceTiming) {
        self.busy_ns += o.busy_ns;
        self.stalled_ns += o.stalled_ns;
        for (sum, ns) in self.busy_by_op_ns.iter_mut().zip(o.busy_by_op_ns) {
            *sum += ns;
        }
        for (sum, ns) in self.enqueue_ns.iter_mut().zip(o.enqueue_ns) {
            *sum += ns;
        }
        self.launches += o.launches;
        self.launches_from_graphs += o.launches_from_graphs;
    }
}

/// The check every device makes before the host reads or writes `len` bytes at `offset` of a
/// buffer: it must be pinned host memory and the range must lie inside it.
pub fn check_host_access(
    op: &'static str,
    buf: BufferId,
    desc: BufferDesc,
    offset: Bytes,
    len: usize,
) -> Result<(), DeviceError> {
    if desc.tier != MemoryTier::PinnedHost {
        return Err(DeviceError::NotHostMemory {
            op,
            buffer: buf,
            role: desc.role,
        });
    }
    let end = offset.0.saturating_add(len as u64);
    if end > desc.bytes.0 {
        return Err(DeviceError::OutOfBounds {
            op,
            buffer: buf,
            role: desc.role,
            start: offset.0,
            end,
            size: desc.bytes.0,
        });
    }
    Ok(())
}

/// The checks every device makes before an op may run: its shapes agree, its declared formats
/// equal the buffers' registered fingerprints, and every declared range lies inside its buffer.
pub fn check_op(op: &Op, desc: impl Fn(BufferId) -> BufferDesc) -> Result<(), DeviceError> {
    let spec = op.spec();
    debug_assert_eq!(Op::NAMES[op.kind()], spec.name(), "Op::NAMES out of order");
    spec.check_shapes()?;
    spec.check_buffers(&|b| desc(b).bytes)?;
    for (buf, declared) in spec.formats() {
        let d = desc(buf);
        if d.fingerprint != declared {
            return Err(DeviceError::LayoutMismatch {
                op: spec.name(),
                buffer: buf,
                role: d.role,
                declared,
                actual: d.fingerprint,
            });
        }
    }
    // An op's accesses come buffer by buffer (a page table's pages one after another): the
    // buffer of the access before is looked up once.
    let mut last: Option<(BufferId, BufferDesc)> = None;
    for a in op.accesses() {
        let d = match last {
            Some((b, d)) if b == a.range.buffer => d,
            _ => {
                let d = desc(a.range.buffer);
                last = Some((a.range.buffer, d));
                d
            }
        };
        if a.range.end > d.bytes || a.range.start > a.range.end {
            return Err(DeviceError::OutOfBounds {
                op: spec.name(),
                buffer: a.range.buffer,
                role: d.role,
                start: a.range.start.0,
                end: a.range.end.0,
                size: d.bytes.0,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
