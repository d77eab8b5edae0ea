//! The production device on CUDA (feature `cuda`): device buffers, pinned host buffers from
//! `cuMemHostAlloc` (portable, device-mapped — cudarc's `alloc_pinned` is write-combined and slow
//! for CPU reads), the compute, load and write streams, events, and the NVRTC kernels.
//!
//! [`CudaOps::run`] turns one engine `Op` into kernel launches and copies on a stream; the
//! production [`CudaDevice`] and the simulator's CUDA executor share it. Small metadata that an op
//! carries by value (slots, page tables, positions) is staged through a pinned ring per stream
//! (`staging.rs`) into stream-ordered allocations freed after the launch; the model's inputs are
//! drawn on the device from each row's token and position, and RoPE rows gathered from a table
//! of the model's rows.
//!
//! Page transfers have two strategies ([`CopyStrategy`]): one `cuMemcpy2DAsync` per coalesced run
//! (pitched, so strided `page_first` mirrors need one call per run), or one gather kernel over
//! mapped host memory for all pages. `tierkv bench` measures both.

use super::ring::{CompletionRing, Ticket};
use super::staging::{QueuedCopy, StagingRing};
use crate::device::*;
use crate::layout::{f32_bytes, u32_count, Bytes, PageRun, PagedView, ROPE_DIM};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream};
use std::sync::Arc;
use tierkv_kernels::cuda::launch::{DevPtr, DrawKind, IndexLogitsLaunch, Kernels};
pub use tierkv_kernels::cuda::launch::{LogitsKernel, LogitsTuning};

fn backend(what: &str) -> impl Fn(cudarc::driver::DriverError) -> DeviceError + '_ {
    move |e| DeviceError::Backend {
        detail: format!("{what}: {e}"),
    }
}

fn kernel(e: tierkv_kernels::KernelError) -> DeviceError {
    DeviceError::Kernel {
        op: "cuda",
        detail: e.to_string(),
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<(), DeviceError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Backend {
            detail: format!("{what}: {r:?}"),
        })
    }
}

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

/// Pinned, portable, device-mapped host memory. Its host address is private: only `new` makes
/// one, so `slice` always describes a live allocation of `bytes` bytes.
pub struct PinnedHost {
    host: *mut u8,
    dev: u64,
    bytes: usize,
}

// SAFETY: the allocation is plain memory owned by this value; access is serialised by its owner.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedHost, DeviceError> {
        ctx.bind_to_thread().map_err(backend("bind"))?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of `bytes` (at least 1).
        let host = unsafe { cudarc::driver::result::malloc_host(bytes.max(1), flags) }
            .map_err(backend("cuMemHostAlloc"))? as *mut u8;
        // SAFETY: `host` holds `bytes.max(1)` bytes; zeroed so that no page tail the device
        // never wrote reaches a reader uninitialised.
        unsafe { std::ptr::write_bytes(host, 0, bytes.max(1)) };
        // The value owns the allocation from here on: an error below frees it on drop.
        let mut pinned = PinnedHost {
            host,
            dev: 0,
            bytes,
        };
        // SAFETY: `host` is a live DEVICEMAP allocation.
        check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut pinned.dev, host as *mut _, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(pinned)
    }
    /// The allocation's address on the device (it is mapped).
    pub fn dev_ptr(&self) -> DevPtr {
        DevPtr {
            ptr: self.dev,
            bytes: Bytes(self.bytes as u64),
        }
    }
    pub fn len(&self) -> usize {
        self.bytes
    }
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }
    pub fn slice(&self) -> &[u8] {
        // SAFETY: `bytes` bytes live at `host` for as long as self.
        unsafe { std::slice::from_raw_parts(self.host, self.bytes) }
    }
    pub fn slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive on the host.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.bytes) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut _) };
    }
}

/// A buffer's memory on the GPU machine.
pub enum GpuMem {
    Device(CudaSlice<u8>),
    Pinned(PinnedHost),
}

impl GpuMem {
    pub fn dev_ptr(&self, stream: &CudaStream) -> DevPtr {
        match self {
            GpuMem::Device(s) => DevPtr {
                ptr: dev_addr(s, stream),
                bytes: Bytes(s.len() as u64),
            },
            GpuMem::Pinned(h) => h.dev_ptr(),
        }
    }
}

/// The kernels and copy strategy, shared by the production device and the simulator's executor.
pub struct CudaOps {
    pub ctx: Arc<CudaContext>,
    pub kernels: &'static Kernels,
    pub strategy: CopyStrategy,
    /// Which `index_logits` kernel runs: the tensor cores by default (production); the
    /// simulator's executor sets [`LogitsKernel::Exact`], because its oracles compare digests bit
    /// for bit against the CPU reference.
    pub logits: LogitsKernel,
    /// The tensor-core kernel's launch shape.
    pub tuning: LogitsTuning,
    /// The model's RoPE rows on the device, grown to the largest position seen.
    rope: std::cell::RefCell<Option<RopeTable>>,
    /// Per stream, the pinned ring its ops' arguments are staged through.
    staging: std::cell::RefCell<std::collections::BTreeMap<usize, Staging>>,
}

/// The pinned ring one stream's op arguments are staged through before their copy to the
/// device (`staging.rs` keeps its regions: a region is written again only after the copy out
/// of it completed).
struct Staging {
    host: PinnedHost,
    ring: StagingRing<CudaEvent>,
    /// Events of completed copies, for reuse.
    free: Vec<CudaEvent>,
}

/// Bytes of each stream's staging ring. An argument larger than a quarter of it is copied
/// from pageable memory instead.
const STAGING_BYTES: usize = 64 << 20;
/// Staged regions start on multiples of this many bytes.
const STAGING_ALIGN_BYTES: usize = 256;

impl QueuedCopy for CudaEvent {
    fn done(&self) -> bool {
        self.is_complete()
    }
    fn wait(&self) -> Result<(), DeviceError> {
        self.synchronize().map_err(backend("staging wait"))
    }
}

impl Staging {
    fn new(ctx: &Arc<CudaContext>) -> Result<Staging, DeviceError> {
        Ok(Staging {
            host: PinnedHost::new(ctx, STAGING_BYTES)?,
            ring: StagingRing::new(STAGING_BYTES, STAGING_ALIGN_BYTES),
            free: Vec::new(),
        })
    }
}

impl Drop for Staging {
    /// The pinned ring is freed only after every copy out of it completed.
    fn drop(&mut self) {
        for ev in self.ring.drain() {
            let _ = ev.synchronize();
        }
    }
}

/// RoPE rows `0..rows` of one model's frequencies, on the device.
struct RopeTable {
    rope: Rope,
    rows: u32,
    table: CudaSlice<u8>,
}

/// The fewest rows a RoPE table holds (it doubles past the largest position seen).
const ROPE_TABLE_ROWS_MIN: u32 = 8192;

fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (f32, i32, u16) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// Where an op's buffers are: a buffer's device address and its description.
pub type Resolve<'a> = &'a dyn Fn(BufferId) -> (DevPtr, BufferDesc);

/// Uploaded metadata: the device copy lives until this is dropped (stream-ordered free).
type Upload = (CudaSlice<u8>, DevPtr);

impl CudaOps {
    pub fn new(strategy: CopyStrategy) -> Result<CudaOps, DeviceError> {
        CudaOps::on(0, strategy)
    }

    /// The kernels and copies on device `ordinal`.
    pub fn on(ordinal: usize, strategy: CopyStrategy) -> Result<CudaOps, DeviceError> {
        let kernels = Kernels::on(ordinal).map_err(kernel)?;
        Ok(CudaOps {
            ctx: kernels.ctx.clone(),
            kernels,
            strategy,
            logits: LogitsKernel::default(),
            tuning: LogitsTuning::default(),
            rope: std::cell::RefCell::new(None),
            staging: std::cell::RefCell::new(std::collections::BTreeMap::new()),
        })
    }

    /// The RoPE rows of `d`'s positions gathered on stream `s` from the device's table of
    /// `rope`'s rows (made, or doubled, on the host when a position lies past it: the host
    /// computes each position's row once), into a stream-ordered allocation.
    fn rope_rows(
        &self,
        s: &Arc<CudaStream>,
        rope: &Rope,
        d: &Drawn,
    ) -> Result<Upload, DeviceError> {
        let positions = d.positions();
        let max = positions.iter().copied().max().unwrap_or(0);
        let mut cache = self.rope.borrow_mut();
        if !cache
            .as_ref()
            .is_some_and(|t| t.rope == *rope && max < t.rows)
        {
            let rows = max
                .checked_add(1)
                .and_then(u32::checked_next_power_of_two)
                .ok_or_else(|| DeviceError::Kernel {
                    op: "rope_rows",
                    detail: format!("RoPE position {max} past any table"),
                })?
                .max(ROPE_TABLE_ROWS_MIN);
            let host = rope.rows(0..rows);
            let table = s.clone_htod(bytes_of(&host)).map_err(backend("upload"))?;
            // The old table may still be read by work queued on any stream: it is freed after.
            self.ctx
                .synchronize()
                .map_err(backend("cuCtxSynchronize"))?;
            *cache = Some(RopeTable {
                rope: *rope,
                rows,
                table,
            });
        }
        let t = cache.as_ref().expect("made above");
        let table = DevPtr {
            ptr: dev_addr(&t.table, s),
            bytes: Bytes(t.table.len() as u64),
        };
        let (_p, positions_dev) = self.upload(s, bytes_of(&positions))?;
        let bytes = f32_bytes(positions.len() as u64 * ROPE_DIM as u64).max(Bytes(1));
        // SAFETY: the gather below writes every byte before any op reads them.
        let out = unsafe { s.alloc::<u8>(bytes.usize()) }.map_err(backend("rope rows"))?;
        let dp = DevPtr {
            ptr: dev_addr(&out, s),
            bytes,
        };
        self.kernels
            .rope_rows(s, table, t.rows, &positions, positions_dev, dp)
            .map_err(kernel)?;
        Ok((out, dp))
    }

    /// Uploads `data` into a stream-ordered allocation (freed stream-ordered when dropped),
    /// staged through the stream's pinned ring, so that the copy is queued without waiting.
    fn upload(&self, s: &Arc<CudaStream>, data: &[u8]) -> Result<Upload, DeviceError> {
        let n = data.len().max(1);
        if n > STAGING_BYTES / 4 {
            return self.upload_pageable(s, data);
        }
        let mut rings = self.staging.borrow_mut();
        let ring = match rings.entry(s.cu_stream() as usize) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(Staging::new(&self.ctx)?),
        };
        let at = ring.ring.reserve(n, &mut ring.free)?;
        ring.host.slice_mut()[at..at + data.len()].copy_from_slice(data);
        // SAFETY: the copy below writes all `n` bytes the caller may read (`data.len()`, at
        // least 1 when it is empty: the byte is never read then).
        let slice = unsafe { s.alloc::<u8>(n) }.map_err(backend("upload"))?;
        let ptr = dev_addr(&slice, s);
        // SAFETY: `n` bytes at `at` lie inside the pinned ring (reserved above), and the device
        // allocation holds `n` bytes.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    ptr,
                    ring.host.slice().as_ptr().add(at) as *const _,
                    n,
                    s.cu_stream(),
                )
            },
            "cuMemcpyHtoDAsync",
        )?;
        let ev = match ring.free.pop() {
            Some(ev) => ev,
            None => self.ctx.new_event(None).map_err(backend("cuEventCreate"))?,
        };
        ev.record(s).map_err(backend("cuEventRecord"))?;
        ring.ring.queued(at, at + n, ev);
        let bytes = Bytes(n as u64);
        Ok((slice, DevPtr { ptr, bytes }))
    }

    /// Makes stream `s`'s staging ring now (its pinned memory), rather than at its first op.
    pub fn prepare_staging(&self, s: &Arc<CudaStream>) -> Result<(), DeviceError> {
        let mut rings = self.staging.borrow_mut();
        if let std::collections::btree_map::Entry::Vacant(e) = rings.entry(s.cu_stream() as usize) {
            e.insert(Staging::new(&self.ctx)?);
        }
        Ok(())
    }

    /// Uploads `data` from pageable memory (the driver stages it, and may wait for the stream).
    fn upload_pageable(&self, s: &Arc<CudaStream>, data: &[u8]) -> Result<Upload, DeviceError> {
        let slice = s.clone_htod(data).map_err(backend("upload"))?;
        let ptr = dev_addr(&slice, s);
        let bytes = Bytes(data.len().max(1) as u64);
        Ok((slice, DevPtr { ptr, bytes }))
    }

    /// Draws the synthetic model's `kind` inputs of `d`'s rows on stream `s` into a
    /// stream-ordered allocation (freed stream-ordered when dropped): the host sends 8 bytes a
    /// row instead of the values.
    /// Pending rows take their token from the op's tokens region first, on the device.
    fn draw(
        &self,
        s: &Arc<CudaStream>,
        kind: DrawKind,
        d: &Drawn,
        mem: Resolve<'_>,
    ) -> Result<Upload, DeviceError> {
        let (_rows, rows) = self.upload(s, bytes_of(&d.rows))?;
        if let Some(t) = d.tokens {
            self.kernels
                .resolve_pending(s, &d.rows, rows, region(mem, &t), u32_count(t.bytes) as u32)
                .map_err(kernel)?;
        }
        let bytes = kind.bytes(d.rows.len() as u64).max(Bytes(1));
        // SAFETY: the draw kernel below writes every byte of its rows before any op reads them.
        let slice = unsafe { s.alloc::<u8>(bytes.usize()) }.map_err(backend("draw"))?;
        let ptr = dev_addr(&slice, s);
        let out = DevPtr { ptr, bytes };
        self.kernels
            .draw(s, kind, d.seed, d.layer, d.rows.len(), rows, out)
            .map_err(kernel)?;
        Ok((slice, out))
    }

    /// Runs `op` on stream `s`; `mem(buf)` gives a buffer's address and description. The one
    /// dispatch over the op set on CUDA.
    pub fn run(&self, s: &Arc<CudaStream>, op: &Op, mem: Resolve<'_>) -> Result<(), DeviceError> {
        match op {
            Op::IndexKStore(o) => self.index_k_store(s, o, mem),
            Op::KvStore(o) => self.kv_store(s, o, mem),
            Op::QPrep(o) => self.q_prep(s, o, mem),
            Op::IndexLogits(o) => self.index_logits(s, o, mem),
            Op::TopK(o) => self.topk(s, o, mem),
            Op::SparseRead(o) => self.sparse_read(s, o, mem),
            Op::PageCopy(o) => self.page_copy(s, o, mem),
            Op::NextTokens(o) => self
                .kernels
                .next_tokens(
                    s,
                    o.seed,
                    region(mem, &o.digests),
                    o.layers,
                    o.rows_max,
                    o.rows() as u32,
                    region(mem, &o.out),
                )
                .map_err(kernel),
            Op::Copy(o) => {
                let (sp, dp) = (region(mem, &o.src), region(mem, &o.dst));
                // SAFETY: both regions were checked against their buffers by `check_op`.
                check(
                    unsafe {
                        sys::cuMemcpyAsync(dp.ptr, sp.ptr, o.src.bytes.usize(), s.cu_stream())
                    },
                    "cuMemcpyAsync",
                )
            }
        }
    }

    fn index_k_store(
        &self,
        s: &Arc<CudaStream>,
        o: &IndexKStore,
        mem: Resolve<'_>,
    ) -> Result<(), DeviceError> {
        let (_a, keys) = self.draw(s, DrawKind::IndexKeys, &o.keys, mem)?;
        let (_b, g) = self.upload(s, bytes_of(&o.gamma))?;
        let (_c, bt) = self.upload(s, bytes_of(&o.beta))?;
        let (_d, r) = self.rope_rows(s, &o.rope, &o.keys)?;
        let (_e, sl) = self.upload(s, bytes_of(&o.slots))?;
        let (dp, dd) = mem(o.dst);
        self.kernels
            .index_k_store(
                s,
                o.dtype,
                o.ue8m0,
                keys,
                g,
                bt,
                r,
                &o.slots,
                sl,
                dp,
                dd.fingerprint,
            )
            .map_err(kernel)
    }

    fn kv_store(
        &self,
        s: &Arc<CudaStream>,
        o: &KvStore,
        mem: Resolve<'_>,
    ) -> Result<(), DeviceError> {
        let (_a, rows) = self.draw(s, DrawKind::KvRows, &o.rows, mem)?;
        let (_b, sl) = self.upload(s, bytes_of(&o.slots))?;
        let (dp, dd) = mem(o.dst);
        self.kernels
            .kv_store(s, o.dtype, rows, &o.slots, sl, dp, dd.fingerprint)
            .map_err(kernel)
    }

    fn q_prep(&self, s: &Arc<CudaStream>, o: &QPrep, mem: Resolve<'_>) -> Result<(), DeviceError> {
        let heads = o.heads;
        let (_a, q) = self.draw(s, DrawKind::Queries { heads }, &o.inputs, mem)?;
        let (_b, w) = self.draw(s, DrawKind::HeadWeights { heads }, &o.inputs, mem)?;
        let (_c, r) = self.rope_rows(s, &o.rope, &o.inputs)?;
        let (qo, wo) = (region(mem, &o.q_out), region(mem, &o.w_out));
        self.kernels
            .q_prep(s, o.rows(), o.heads as usize, o.ue8m0, q, w, r, qo, wo)
            .map_err(kernel)
    }

    fn index_logits(
        &self,
        s: &Arc<CudaStream>,
        o: &IndexLogits,
        mem: Resolve<'_>,
    ) -> Result<(), DeviceError> {
        let (_a, pt) = self.upload(s, bytes_of(&o.page_table))?;
        let (_b, lens) = self.upload(s, bytes_of(&o.context_lens))?;
        let (kp, kd) = mem(o.k);
        let a = IndexLogitsLaunch {
            dtype: o.dtype,
            heads: o.heads as usize,
            q: region(mem, &o.q),
            w: region(mem, &o.w),
            page_table: &o.page_table,
            pt_stride: o.pt_stride as usize,
            pt_dev: pt,
            context_lens: &o.context_lens,
            lens_dev: lens,
            k: kp,
            k_fp: kd.fingerprint,
            out: region(mem, &o.out),
            out_stride: o.out_stride as usize,
        };
        self.kernels
            .index_logits_with(self.logits, self.tuning, s, &a)
            .map_err(kernel)
    }

    fn topk(&self, s: &Arc<CudaStream>, o: &TopK, mem: Resolve<'_>) -> Result<(), DeviceError> {
        let (_a, pt) = self.upload(s, bytes_of(&o.page_table))?;
        let (_b, lens) = self.upload(s, bytes_of(&o.context_lens))?;
        self.kernels
            .topk(
                s,
                o.k as usize,
                region(mem, &o.logits),
                o.stride as usize,
                &o.context_lens,
                lens,
                &o.page_table,
                o.pt_stride as usize,
                pt,
                region(mem, &o.out),
            )
            .map_err(kernel)
    }

    fn sparse_read(
        &self,
        s: &Arc<CudaStream>,
        o: &SparseRead,
        mem: Resolve<'_>,
    ) -> Result<(), DeviceError> {
        let (kvp, kvd) = mem(o.kv);
        let rows = o.context_lens.len();
        let (sel, out) = (region(mem, &o.slots), region(mem, &o.out));
        self.kernels
            .sparse_read(
                s,
                o.dtype,
                rows,
                o.k as usize,
                sel,
                kvp,
                kvd.fingerprint,
                out,
            )
            .map_err(kernel)
    }

    fn page_copy(
        &self,
        s: &Arc<CudaStream>,
        o: &PageCopy,
        mem: Resolve<'_>,
    ) -> Result<(), DeviceError> {
        let (sp, _) = mem(o.src);
        let (dp, _) = mem(o.dst);
        let (sv, dv) = (&o.src_view, &o.dst_view);
        tierkv_kernels::cpu::check_page_copy(sv, sp.bytes.0, dv, dp.bytes.0, &o.runs)
            .map_err(kernel)?;
        match self.strategy {
            CopyStrategy::MemcpyRuns => memcpy_runs(s, sp, sv, dp, dv, &o.runs),
            CopyStrategy::Gather => {
                let flat = tierkv_kernels::cuda::gather_pairs(&o.runs);
                let (_a, pairs) = self.upload(s, bytes_of(&flat))?;
                self.kernels
                    .page_gather(s, sp, sv, dp, dv, &o.runs, pairs)
                    .map_err(kernel)
            }
        }
    }
}

/// A device allocation's address, as stream `s` uses it.
fn dev_addr(slice: &CudaSlice<u8>, s: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = slice.device_ptr(s);
    p
}

/// A scratch region's device address.
fn region(mem: Resolve<'_>, r: &Region) -> DevPtr {
    mem(r.buffer).0.offset(r.offset, r.bytes)
}

/// One pitched `cuMemcpy2DAsync` per run of pages (the caller checked every run).
fn memcpy_runs(
    s: &CudaStream,
    sp: DevPtr,
    sv: &PagedView,
    dp: DevPtr,
    dv: &PagedView,
    runs: &[PageRun],
) -> Result<(), DeviceError> {
    for run in runs {
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: sp.ptr + sv.page_range(run.src).start,
            srcArray: std::ptr::null_mut(),
            srcPitch: sv.page_stride as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: std::ptr::null_mut(),
            dstDevice: dp.ptr + dv.page_range(run.dst).start,
            dstArray: std::ptr::null_mut(),
            dstPitch: dv.page_stride as usize,
            WidthInBytes: sv.page_bytes() as usize,
            Height: run.count as usize,
        };
        // SAFETY: both views and every run were checked to lie inside their buffers.
        check(
            unsafe { sys::cuMemcpy2DAsync_v2(&copy, s.cu_stream()) },
            "cuMemcpy2DAsync",
        )?;
    }
    Ok(())
}

/// Slots of the completion ring (events with larger ids are answered by `cuEventQuery` alone).
const RING_SLOTS: usize = 4096;

/// What the host callback carries: the ring and the ticket to signal.
struct Callback {
    ring: Arc<CompletionRing>,
    ticket: Ticket,
}

/// Runs on CUDA's callback thread when the load stream reaches it: no CUDA calls here.
unsafe extern "C" fn signal_ring(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `Box<Callback>` leaked by `record`, consumed exactly once here.
    let cb = unsafe { Box::from_raw(data as *mut Callback) };
    cb.ring.signal(cb.ticket, 0);
}

/// Timing of the compute stream (see [`CudaDevice::set_timing`]): a pair of timing events
/// around every op and every wait, read back by `take_timing`.
#[derive(Default)]
struct ComputeTiming {
    /// Timing events no longer in use.
    free: Vec<CudaEvent>,
    /// (start, end, the op's kind or `None` for a wait), in stream order.
    marks: Vec<(CudaEvent, CudaEvent, Option<usize>)>,
    /// Host time inside `enqueue` per op kind since the last `take_timing`.
    enqueue_ns: [u64; Op::KINDS],
}

/// The production `Device` on one GPU.
pub struct CudaDevice {
    pub ops: CudaOps,
    streams: [Arc<CudaStream>; 3],
    mem: Vec<GpuMem>,
    descs: Vec<BufferDesc>,
    events: Vec<CudaEvent>,
    /// Load-stream events also signal this ring from a host callback; `query` reads it.
    ring: Arc<CompletionRing>,
    tickets: std::collections::BTreeMap<EventId, Ticket>,
    /// `Some` while the compute stream is timed.
    timing: Option<ComputeTiming>,
}

impl CudaDevice {
    pub fn new(strategy: CopyStrategy) -> Result<CudaDevice, DeviceError> {
        CudaDevice::on(0, strategy)
    }

    /// The device on GPU `ordinal` (a prefill/decode pair puts each engine on its own).
    pub fn on(ordinal: usize, strategy: CopyStrategy) -> Result<CudaDevice, DeviceError> {
        let ops = CudaOps::on(ordinal, strategy)?;
        let mk = || ops.ctx.new_stream().map_err(backend("cuStreamCreate"));
        let streams = [mk()?, mk()?, mk()?];
        for s in &streams {
            ops.prepare_staging(s)?;
        }
        Ok(CudaDevice {
            ops,
            streams,
            mem: Vec::new(),
            descs: Vec::new(),
            events: Vec::new(),
            ring: Arc::new(CompletionRing::new(RING_SLOTS)),
            tickets: std::collections::BTreeMap::new(),
            timing: None,
        })
    }
    /// Times every op and every wait of the compute stream (two timing events each: several
    /// microseconds of host time per op; kernels/GPU.md runs 39 and 45 measured 0.2–0.9 ms per
    /// 4-layer step), so that `take_timing` answers.
    pub fn set_timing(&mut self, on: bool) {
        self.timing = on.then(ComputeTiming::default);
    }
    /// Records a timing event on the compute stream.
    fn mark(&mut self) -> Result<CudaEvent, DeviceError> {
        let t = self.timing.as_mut().expect("timing on");
        let ev = match t.free.pop() {
            Some(ev) => ev,
            None => self
                .ops
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(backend("cuEventCreate"))?,
        };
        ev.record(&self.streams[StreamKind::Compute.index()])
            .map_err(backend("cuEventRecord"))?;
        Ok(ev)
    }
    /// Runs `f` between two timing events when the compute stream is timed.
    fn timed<R>(
        &mut self,
        stream: StreamKind,
        kind: Option<usize>,
        f: impl FnOnce(&mut Self) -> Result<R, DeviceError>,
    ) -> Result<R, DeviceError> {
        if stream != StreamKind::Compute || self.timing.is_none() {
            return f(self);
        }
        let start = self.mark()?;
        let r = f(self);
        let end = self.mark()?;
        let t = self.timing.as_mut().expect("timing on");
        t.marks.push((start, end, kind));
        r
    }
    pub fn stream(&self, k: StreamKind) -> &Arc<CudaStream> {
        &self.streams[k.index()]
    }
    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ops.ctx.ordinal()
    }
    /// A buffer's device address (for the NCCL link, which moves pool pages between devices).
    #[cfg(feature = "nccl")]
    pub(crate) fn buffer_ptr(&self, b: BufferId) -> DevPtr {
        self.resolve(b).0
    }
    fn resolve(&self, b: BufferId) -> (DevPtr, BufferDesc) {
        (
            self.mem[b.0 as usize].dev_ptr(&self.streams[0]),
            self.descs[b.0 as usize],
        )
    }
    /// Total bytes allocated per tier.
    pub fn allocated(&self, tier: MemoryTier) -> u64 {
        self.descs
            .iter()
            .filter(|d| d.tier == tier)
            .map(|d| d.bytes.0)
            .sum()
    }
    /// Makes this device's context current on the calling thread: the raw driver calls (page
    /// copies, host callbacks) act on the current context, and a pair drives two GPUs from one
    /// thread.
    fn bind(&self) -> Result<(), DeviceError> {
        self.ops
            .ctx
            .bind_to_thread()
            .map_err(backend("cuCtxSetCurrent"))
    }
    pub fn synchronize_all(&self) -> Result<(), DeviceError> {
        for s in &self.streams {
            s.synchronize().map_err(backend("cuStreamSynchronize"))?;
        }
        Ok(())
    }
}

impl Drop for CudaDevice {
    /// Work still queued on any stream may use the buffers: it finishes before they are freed
    /// (cudarc's event tracking is off on tierkv's contexts, `Kernels::on`, and a buffer is
    /// freed on the stream it was allocated on, not on the streams that used it).
    fn drop(&mut self) {
        let _ = self.bind();
        let _ = self.synchronize_all();
    }
}

impl Device for CudaDevice {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        let bytes = desc.bytes.usize().max(1);
        let oom = |_| DeviceError::OutOfMemory {
            role: desc.role,
            tier: desc.tier,
            bytes: desc.bytes.0,
        };
        let m = match desc.tier {
            // Zeroed at allocation: a whole page moves to the host mirror even where its tail
            // was never written, and no uninitialised byte may leave the device (the GPU
            // session runs compute-sanitizer's initcheck).
            MemoryTier::Device => {
                GpuMem::Device(self.streams[0].alloc_zeros::<u8>(bytes).map_err(oom)?)
            }
            MemoryTier::PinnedHost => GpuMem::Pinned(PinnedHost::new(&self.ops.ctx, bytes)?),
        };
        self.streams[0]
            .synchronize()
            .map_err(backend("alloc sync"))?;
        self.mem.push(m);
        self.descs.push(desc);
        Ok(BufferId(self.mem.len() as u32 - 1))
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.descs[buf.0 as usize]
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        let ev = self
            .ops
            .ctx
            .new_event(None)
            .map_err(backend("cuEventCreate"))?;
        self.events.push(ev);
        Ok(EventId(self.events.len() as u32 - 1))
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.bind()?;
        let s = &self.streams[stream.index()];
        self.events[ev.0 as usize]
            .record(s)
            .map_err(backend("cuEventRecord"))?;
        if stream == StreamKind::Load && (ev.0 as usize) < RING_SLOTS {
            let ticket = self.ring.issue_after_previous(ev.0 as usize);
            let cb = Box::into_raw(Box::new(Callback {
                ring: self.ring.clone(),
                ticket,
            }));
            // SAFETY: `signal_ring` takes ownership of `cb` when CUDA runs it.
            let r =
                unsafe { sys::cuLaunchHostFunc(s.cu_stream(), Some(signal_ring), cb as *mut _) };
            if r == sys::CUresult::CUDA_SUCCESS {
                self.tickets.insert(ev, ticket);
            } else {
                // The event itself is recorded; only the host callback that would signal the
                // ring is missing. `query` then falls back to `cuEventQuery` for this event,
                // which answers the same question more slowly, so the record still succeeds.
                // SAFETY: the callback was not enqueued, so we still own `cb`; the ticket is
                // completed here so the slot can be re-issued.
                let cb = unsafe { Box::from_raw(cb) };
                cb.ring.signal(cb.ticket, 0);
                self.tickets.remove(&ev);
            }
        } else {
            self.tickets.remove(&ev);
        }
        Ok(())
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.timed(stream, None, |d| {
            d.streams[stream.index()]
                .wait(&d.events[ev.0 as usize])
                .map_err(backend("cuStreamWaitEvent"))
        })
    }
    fn take_timing(&mut self) -> Option<DeviceTiming> {
        let t = self.timing.as_mut()?;
        let mut out = DeviceTiming::default();
        let mut kept = Vec::new();
        for (start, end, kind) in t.marks.drain(..) {
            // Only work the host has waited for: a mark still pending stays for the next call.
            if !matches!(end.try_is_complete(), Ok(true)) {
                kept.push((start, end, kind));
                continue;
            }
            let ns = start
                .elapsed_ms(&end)
                .map_or(0, |ms| (ms as f64 * 1e6) as u64);
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
        Some(out)
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        // An error from asynchronous work is sticky in CUDA: the context is lost and every later
        // call fails with it, so nothing can be recovered in place. A context that still
        // synchronises had no such error (an event's failure was its own): go on.
        self.ops
            .ctx
            .synchronize()
            .map_err(backend("the CUDA context did not survive a device fault"))
    }
    fn query(&mut self, ev: EventId) -> EventState {
        if let Some(&t) = self.tickets.get(&ev) {
            // The host callback ran: the load stream passed this event.
            if self.ring.poll(t).is_some() {
                return EventState::Done;
            }
        }
        match self.events[ev.0 as usize].try_is_complete() {
            Ok(true) => EventState::Done,
            Ok(false) => EventState::Pending,
            Err(_) => EventState::Failed,
        }
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        match self.events[ev.0 as usize].synchronize() {
            Ok(()) => EventState::Done,
            Err(_) => EventState::Failed,
        }
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        let t0 = std::time::Instant::now();
        check_op(&op, |b| self.descs[b.0 as usize])?;
        self.bind()?;
        let r = self.timed(stream, Some(op.kind()), |d| {
            let s = d.streams[stream.index()].clone();
            d.ops.run(&s, &op, &|b| d.resolve(b))
        });
        if let (StreamKind::Compute, Some(t)) = (stream, self.timing.as_mut()) {
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
        check_host_access(
            "host_read",
            buf,
            self.descs[buf.0 as usize],
            offset,
            out.len(),
        )?;
        let GpuMem::Pinned(h) = &self.mem[buf.0 as usize] else {
            unreachable!("pinned host tier checked above");
        };
        let at = offset.usize();
        out.copy_from_slice(&h.slice()[at..at + out.len()]);
        Ok(())
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        check_host_access(
            "host_write",
            buf,
            self.descs[buf.0 as usize],
            offset,
            data.len(),
        )?;
        let GpuMem::Pinned(h) = &mut self.mem[buf.0 as usize] else {
            unreachable!("pinned host tier checked above");
        };
        let at = offset.usize();
        h.slice_mut()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
}
