//! The driver seam: exactly the CUDA driver calls the runtime ([`super::driven`]) makes, as a
//! trait. The runtime logic above it (staging ring, argument uploads, stream-ordered scratch
//! allocations, the event pool, the RoPE table, the completion ring and its host callbacks,
//! transfer strategies, recovery) is the same code whichever driver runs below it: cudarc's
//! ([`super::cuda::CudaDriver`], feature `cuda`) in production.
//!
//! A kernel launch is one [`Launch`] value: the engine op it belongs to, whose argument record
//! (`tierkv_kernels::args`: its scalars and the host copies of its arrays) the launcher checks
//! and reads, and a [`Ptr`] for every argument the kernel reads or writes on the device (the
//! uploaded copies of those arrays among them: the kernel reads those, not the host copies).

use crate::device::{
    BufferDesc, DeviceError, EventState, IndexKStore, IndexLogits, KvStore, NextTokens, PageCopy,
    QPrep, SparseRead, StreamKind, TopK,
};
use crate::layout::{Bytes, LayoutFingerprint};
use tierkv_kernels::cpu::draw::TokenAt;
pub use tierkv_kernels::cuda::DrawKind;

/// One allocation a driver made (device memory, pinned host memory, or a stream-ordered
/// allocation). Ids may be reused after the allocation is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mem(pub u32);

/// `bytes` bytes of allocation `mem`, from `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ptr {
    pub mem: Mem,
    pub offset: Bytes,
    pub bytes: Bytes,
}

impl Ptr {
    /// The whole of an allocation of `bytes` bytes.
    pub fn whole(mem: Mem, bytes: Bytes) -> Ptr {
        Ptr {
            mem,
            offset: Bytes(0),
            bytes,
        }
    }
    /// `bytes` bytes from `at` inside this range. Panics past its end (the runtime checked every
    /// region against its buffer before it asks).
    pub fn at(self, at: Bytes, bytes: Bytes) -> Ptr {
        assert!(
            at.0 + bytes.0 <= self.bytes.0,
            "range {}+{} past a pointer of {} bytes",
            at.0,
            bytes.0,
            self.bytes.0
        );
        Ptr {
            mem: self.mem,
            offset: Bytes(self.offset.0 + at.0),
            bytes,
        }
    }
}

/// A driver's allocations by [`Mem`] id; an id is reused after its allocation is freed.
#[derive(Debug)]
pub struct MemTable<T> {
    slots: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Default for MemTable<T> {
    fn default() -> Self {
        MemTable {
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> MemTable<T> {
    pub fn insert(&mut self, t: T) -> Mem {
        match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(t);
                Mem(id)
            }
            None => {
                self.slots.push(Some(t));
                Mem(self.slots.len() as u32 - 1)
            }
        }
    }
    /// The allocation `m`. Panics after its free (a runtime invariant).
    pub fn get(&self, m: Mem) -> &T {
        self.slots[m.0 as usize]
            .as_ref()
            .unwrap_or_else(|| panic!("allocation {} used after its free", m.0))
    }
    /// The allocation of id `m`, if it is live.
    pub fn try_get(&self, m: Mem) -> Option<&T> {
        self.slots.get(m.0 as usize).and_then(Option::as_ref)
    }
    pub fn get_mut(&mut self, m: Mem) -> &mut T {
        self.slots[m.0 as usize]
            .as_mut()
            .unwrap_or_else(|| panic!("allocation {} used after its free", m.0))
    }
    /// Removes `m`, whose id may then be reused. Panics if it was freed already.
    pub fn take(&mut self, m: Mem) -> T {
        let t = self.slots[m.0 as usize]
            .take()
            .unwrap_or_else(|| panic!("allocation {} freed twice", m.0));
        self.free.push(m.0);
        t
    }
    /// Every allocation still held, removed.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.free.clear();
        self.slots.drain(..).flatten()
    }
}

/// One event of a driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DrvEvent(pub u32);

/// What an event is for. CUDA makes timing events with timing on and the others without; a
/// simulated driver tells the engine's events from the runtime's own (its oracles count what
/// the engine recorded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventUse {
    /// One of the engine's events (`Device::new_event`).
    Engine,
    /// The runtime's: the end of a copy out of a staging ring.
    Staging,
    /// The runtime's: a timing mark of the compute stream.
    Timing,
    /// The host tier's (`crate::offload::transfer`): where a job may start on the server's
    /// stream, and where its copies end. The host synchronises on it, and the time between a
    /// job's start mark and its end can be measured.
    Transfer,
}

/// Runs on the driver's callback thread when a stream reaches it. It may make no driver call.
pub type HostCallback = Box<dyn FnOnce() + Send + 'static>;

/// One kernel launch: the op (with its argument record) and the device pointers of every
/// argument.
#[derive(Clone, Copy, Debug)]
pub enum Launch<'a> {
    /// Replaces each pending row's token in `rows_dev` (the uploaded `rows`) by entry
    /// `pending_index` of `tokens` (`tokens_len` entries).
    ResolvePending {
        rows: &'a [TokenAt],
        rows_dev: Ptr,
        tokens: Ptr,
        tokens_len: u32,
    },
    /// Draws the synthetic model's `kind` inputs of `rows` rows (`rows_dev`) into `out`.
    Draw {
        kind: DrawKind,
        seed: u64,
        layer: u32,
        rows: usize,
        rows_dev: Ptr,
        out: Ptr,
    },
    /// Gathers the RoPE rows of `positions` (uploaded as `positions_dev`) from `table` (rows
    /// `0..table_rows`) into `out`.
    RopeRows {
        table: Ptr,
        table_rows: u32,
        positions: &'a [u32],
        positions_dev: Ptr,
        out: Ptr,
    },
    IndexKStore {
        op: &'a IndexKStore,
        keys: Ptr,
        gamma: Ptr,
        beta: Ptr,
        rope: Ptr,
        slots: Ptr,
        dst: Ptr,
        dst_fp: LayoutFingerprint,
    },
    KvStore {
        op: &'a KvStore,
        rows: Ptr,
        slots: Ptr,
        dst: Ptr,
        dst_fp: LayoutFingerprint,
    },
    QPrep {
        op: &'a QPrep,
        q: Ptr,
        w: Ptr,
        rope: Ptr,
        q_out: Ptr,
        w_out: Ptr,
    },
    IndexLogits {
        op: &'a IndexLogits,
        q: Ptr,
        w: Ptr,
        page_table: Ptr,
        context_lens: Ptr,
        k: Ptr,
        k_fp: LayoutFingerprint,
        out: Ptr,
    },
    TopK {
        op: &'a TopK,
        logits: Ptr,
        context_lens: Ptr,
        page_table: Ptr,
        out: Ptr,
    },
    SparseRead {
        op: &'a SparseRead,
        slots: Ptr,
        kv: Ptr,
        kv_fp: LayoutFingerprint,
        out: Ptr,
    },
    NextTokens {
        op: &'a NextTokens,
        digests: Ptr,
        out: Ptr,
    },
    /// Every page of `op`'s runs, as the (source, destination) pairs uploaded to `pairs`.
    PageGather {
        op: &'a PageCopy,
        src: Ptr,
        dst: Ptr,
        pairs: Ptr,
    },
}

impl Launch<'_> {
    /// Calls `f` with every device argument of the launch, in the order of its fields.
    pub fn for_each_ptr(&self, mut f: impl FnMut(Ptr)) {
        let ptrs: &[Ptr] = match *self {
            Launch::ResolvePending {
                rows_dev, tokens, ..
            } => &[rows_dev, tokens],
            Launch::Draw { rows_dev, out, .. } => &[rows_dev, out],
            Launch::RopeRows {
                table,
                positions_dev,
                out,
                ..
            } => &[table, positions_dev, out],
            Launch::IndexKStore {
                keys,
                gamma,
                beta,
                rope,
                slots,
                dst,
                ..
            } => &[keys, gamma, beta, rope, slots, dst],
            Launch::KvStore {
                rows, slots, dst, ..
            } => &[rows, slots, dst],
            Launch::QPrep {
                q,
                w,
                rope,
                q_out,
                w_out,
                ..
            } => &[q, w, rope, q_out, w_out],
            Launch::IndexLogits {
                q,
                w,
                page_table,
                context_lens,
                k,
                out,
                ..
            } => &[q, w, page_table, context_lens, k, out],
            Launch::TopK {
                logits,
                context_lens,
                page_table,
                out,
                ..
            } => &[logits, context_lens, page_table, out],
            Launch::SparseRead { slots, kv, out, .. } => &[slots, kv, out],
            Launch::NextTokens { digests, out, .. } => &[digests, out],
            Launch::PageGather {
                src, dst, pairs, ..
            } => &[src, dst, pairs],
        };
        ptrs.iter().copied().for_each(&mut f);
    }
}

/// A pitched copy of `height` rows of `width` bytes: row `i` from `src.offset + i·src_pitch` to
/// `dst.offset + i·dst_pitch` (`cuMemcpy2DAsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy2d {
    pub src: Ptr,
    pub src_pitch: u64,
    pub dst: Ptr,
    pub dst_pitch: u64,
    pub width: u64,
    pub height: u64,
}

/// The CUDA driver calls of the runtime. Every call may fail; an asynchronous error (a kernel
/// that faulted) is sticky in CUDA: every later call of the context fails with it.
pub trait Driver {
    /// Makes the driver's context current on the calling thread.
    fn bind(&mut self) -> Result<(), DeviceError>;
    /// A zeroed allocation of `desc.bytes` (at least 1) bytes in `desc.tier`, made
    /// synchronously: device memory, or pinned, device-mapped host memory. The role and
    /// fingerprint name what it holds (errors say it; a simulated driver checks ops with them).
    fn alloc(&mut self, desc: &BufferDesc) -> Result<Mem, DeviceError>;
    /// Frees an allocation of [`Driver::alloc`]. The caller made sure no queued work uses it.
    fn free(&mut self, mem: Mem) -> Result<(), DeviceError>;
    /// A stream-ordered device allocation (`cuMemAllocAsync`): usable by work queued on `s`
    /// after this call; uninitialised.
    fn alloc_async(&mut self, s: StreamKind, bytes: u64) -> Result<Mem, DeviceError>;
    /// Gives back to the device the memory of the stream-ordered pool that no allocation holds
    /// (`cuMemPoolTrimTo` on the device's current pool, keeping nothing); after a context
    /// synchronisation, that is all of it that was freed. (With CUDA's default release
    /// threshold of 0 the synchronisation already gives it back: the trim is for a pool whose
    /// threshold was raised.)
    fn trim_pool(&mut self) -> Result<(), DeviceError>;
    /// A stream-ordered free (`cuMemFreeAsync`): the memory may be reused by work ordered after
    /// this point of `s`, so every reader on another stream must be ordered before it.
    fn free_async(&mut self, s: StreamKind, mem: Mem) -> Result<(), DeviceError>;
    /// Writes pinned host memory from the host (no stream: the caller orders it).
    fn write_pinned(&mut self, mem: Mem, at: Bytes, data: &[u8]) -> Result<(), DeviceError>;
    /// Reads pinned host memory on the host.
    fn read_pinned(&mut self, mem: Mem, at: Bytes, out: &mut [u8]) -> Result<(), DeviceError>;
    /// Queues a copy of `src.bytes` bytes from `src` to `dst` on `s` (`cuMemcpyAsync`; either
    /// side may be device or pinned host memory).
    fn copy_async(&mut self, s: StreamKind, dst: Ptr, src: Ptr) -> Result<(), DeviceError>;
    /// Queues `copies` (`(dst, src)` each) on `s`, as one batch where the driver has one (the
    /// CUDA driver: its copy kernel for a slice whose destinations overlap no other range of
    /// it, where order cannot matter, otherwise `cuMemcpyBatchAsync` where the driver has it;
    /// the simulated driver: each in order, as a [`Driver::copy_async`]).
    fn copy_batch_async(&mut self, s: StreamKind, copies: &[(Ptr, Ptr)])
        -> Result<(), DeviceError>;
    /// Queues a pitched copy on `s` (`cuMemcpy2DAsync`).
    fn copy_2d_async(&mut self, s: StreamKind, c: &Copy2d) -> Result<(), DeviceError>;
    /// Copies `data` from pageable host memory to `dst` on `s` (`cuMemcpyHtoDAsync` from
    /// pageable memory): the driver takes the bytes before it returns, so `data` may be reused
    /// at once; the copy to the device is ordered on `s`.
    fn copy_pageable(&mut self, s: StreamKind, dst: Ptr, data: &[u8]) -> Result<(), DeviceError>;
    /// Queues a kernel on `s`. The launcher checks the record first and refuses what its kernel
    /// cannot hold.
    fn launch(&mut self, s: StreamKind, l: &Launch<'_>) -> Result<(), DeviceError>;
    /// A new event; timing events can be measured against each other.
    fn event_create(&mut self, purpose: EventUse) -> Result<DrvEvent, DeviceError>;
    /// Captures the work queued on `s` so far in `e`.
    fn event_record(&mut self, s: StreamKind, e: DrvEvent) -> Result<(), DeviceError>;
    /// Whether `e`'s work completed, without blocking.
    fn event_query(&mut self, e: DrvEvent) -> EventState;
    /// Blocks until `e`'s work completed.
    fn event_synchronize(&mut self, e: DrvEvent) -> EventState;
    /// Nanoseconds between two completed timing events, `None` if either is not complete.
    fn event_elapsed_ns(&mut self, start: DrvEvent, end: DrvEvent) -> Option<u64>;
    /// Work queued on `s` after this call waits for `e`'s work (as recorded now).
    fn stream_wait(&mut self, s: StreamKind, e: DrvEvent) -> Result<(), DeviceError>;
    /// Blocks until everything queued on `s` completed.
    fn stream_synchronize(&mut self, s: StreamKind) -> Result<(), DeviceError>;
    /// Blocks until everything queued on every stream completed.
    fn context_synchronize(&mut self) -> Result<(), DeviceError>;
    /// Brings the context back into use after a fault (`Device::recover`). CUDA cannot clear a
    /// context's asynchronous error in place: a driver that can recreates the context, with
    /// every allocation made again at the same address (the device bytes lost, pinned host
    /// memory kept) and every event and stream valid, and bumps its
    /// [`Driver::context_generation`]. The simulated driver does; the production driver does
    /// not (it synchronises the context and fails if it is lost, and the engine stops): no way
    /// tried gave a working context in the same process (kernels/GPU.md, runs 87-88), so the
    /// process must be restarted.
    fn recover(&mut self) -> Result<(), DeviceError>;
    /// How many times `recover` recreated the context.
    fn context_generation(&self) -> u64;
    /// Queues `cb` on `s`: it runs on the callback thread once the work before it completed.
    /// On an error the callback never runs (it is dropped). CUDA does not run it either when
    /// the context is in error by then.
    fn host_callback(&mut self, s: StreamKind, cb: HostCallback) -> Result<(), DeviceError>;
    /// Device memory this driver did not allocate — a server's cache, `bytes` bytes at device
    /// address `base` in this driver's context — as an allocation copies may read and write.
    /// [`Driver::free`] forgets it without freeing it; the caller keeps the memory alive while
    /// work that uses it is queued. A driver that cannot reach a server's memory refuses; the
    /// simulated driver takes a simulated address of its own allocations.
    fn import(&mut self, base: u64, bytes: u64) -> Result<Mem, DeviceError>;
    /// Captures in `e` the work queued so far on a stream this driver did not create (a
    /// server's compute stream, by its `CUstream` handle; 0 is the legacy default stream). A
    /// driver without a server's streams refuses.
    fn event_record_foreign(&mut self, stream: u64, e: DrvEvent) -> Result<(), DeviceError>;
    /// The host learned from a host callback (the completion ring), not from a driver call,
    /// that `e`'s latest record completed. CUDA has no such call and the production driver does
    /// nothing; a simulated driver orders the host after the record's work here, as the ring's
    /// acquire does.
    fn observed_by_callback(&mut self, e: DrvEvent);

    /// Starts capturing stream `s` (CUDA's stream capture): until [`Driver::capture_end`], each
    /// launch on `s` is recorded as a node of a graph, in order, and runs only when the graph is
    /// launched. While a capture is open the runtime makes no other call on `s` and waits for
    /// nothing on the host (no event query or synchronisation): CUDA refuses some of those
    /// calls during a capture, and would record the others into the graph.
    fn capture_begin(&mut self, s: StreamKind) -> Result<(), DeviceError>;
    /// Ends the capture of `s` and returns an executable graph of its launches: `into` (a graph
    /// of this driver) updated in place to them, when its nodes match them one for one and the
    /// driver can update it; else a new graph (and `into` stays as it was). A capture a launch
    /// failed in, or one the driver could not make a graph of, is dropped: the call fails, and
    /// none of its launches will run.
    fn capture_end(
        &mut self,
        s: StreamKind,
        into: Option<DrvGraph>,
    ) -> Result<DrvGraph, DeviceError>;
    /// Queues graph `g`'s launches on `s`, in the order they were captured, with the arguments
    /// of its latest capture: the buffers they name must still be allocated when they run.
    fn graph_launch(&mut self, s: StreamKind, g: DrvGraph) -> Result<(), DeviceError>;
    /// Destroys graph `g` (launches of it already queued still run).
    fn graph_destroy(&mut self, g: DrvGraph);
}

/// One executable graph of a driver ([`Driver::capture_end`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DrvGraph(pub u32);

/// Whether no destination range of a copy list (`[dst, src, bytes]` triples) overlaps any other
/// range of it, source or destination: then its copies may run in any order.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn destinations_apart(desc: &[u64]) -> bool {
    let mut ranges: Vec<(u64, u64, bool)> = desc
        .chunks_exact(3)
        .flat_map(|c| [(c[0], c[0] + c[2], true), (c[1], c[1] + c[2], false)])
        .filter(|r| r.1 > r.0)
        .collect();
    ranges.sort_unstable();
    let (mut end, mut has_dst) = (0u64, false);
    for (i, &(lo, hi, dst)) in ranges.iter().enumerate() {
        if i > 0 && lo < end {
            if dst || has_dst {
                return false;
            }
            end = end.max(hi);
        } else {
            (end, has_dst) = (hi, dst);
        }
    }
    true
}

#[cfg(test)]
mod tests;
