//! The production device on CUDA (feature `cuda`): device buffers, pinned host buffers from
//! `cuMemHostAlloc` (portable, device-mapped — cudarc's `alloc_pinned` is write-combined and slow
//! for CPU reads), the compute, load and write streams, events, and the NVRTC kernels.
//!
//! [`CudaOps::run`] turns one engine `Op` into kernel launches and copies on a stream; the
//! production [`CudaDevice`] and the simulator's CUDA executor share it. Small metadata that an op
//! carries by value (slots, page tables, inputs) is uploaded with stream-ordered allocations that
//! are freed stream-ordered after the launch.
//!
//! Page transfers have two strategies ([`CopyStrategy`]): one `cuMemcpy2DAsync` per coalesced run
//! (pitched, so strided `page_first` mirrors need one call per run), or one gather kernel over
//! mapped host memory for all pages. `tierkv bench` measures both.

use super::ring::{CompletionRing, Ticket};
use crate::device::*;
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream};
use std::sync::Arc;
pub use tierkv_kernels::cuda::launch::LogitsKernel;
use tierkv_kernels::cuda::launch::{DevPtr, Kernels};

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

/// Pinned, portable, device-mapped host memory.
pub struct PinnedHost {
    pub host: *mut u8,
    pub dev: u64,
    pub bytes: usize,
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
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a live DEVICEMAP allocation.
        check(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) },
            "cuMemHostGetDevicePointer",
        )?;
        Ok(PinnedHost { host, dev, bytes })
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
            GpuMem::Device(s) => {
                use cudarc::driver::DevicePtr;
                let (p, _sync) = s.device_ptr(stream);
                DevPtr {
                    ptr: p,
                    bytes: s.len() as u64,
                }
            }
            GpuMem::Pinned(h) => DevPtr {
                ptr: h.dev,
                bytes: h.bytes as u64,
            },
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
}

fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain-old-data slices (f32, i32, u16) viewed as bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

impl CudaOps {
    pub fn new(strategy: CopyStrategy) -> Result<CudaOps, DeviceError> {
        let kernels = Kernels::global().map_err(kernel)?;
        Ok(CudaOps {
            ctx: kernels.ctx.clone(),
            kernels,
            strategy,
            logits: LogitsKernel::default(),
        })
    }

    /// Uploads `data` with a stream-ordered allocation (freed stream-ordered when dropped).
    fn upload(
        &self,
        s: &Arc<CudaStream>,
        data: &[u8],
    ) -> Result<(CudaSlice<u8>, DevPtr), DeviceError> {
        let slice = s.clone_htod(data).map_err(backend("upload"))?;
        let ptr = {
            use cudarc::driver::DevicePtr;
            let (p, _sync) = slice.device_ptr(s);
            p
        };
        Ok((
            slice,
            DevPtr {
                ptr,
                bytes: data.len().max(1) as u64,
            },
        ))
    }

    /// Runs `op` on stream `s`; `mem(buf)` gives a buffer's address and description.
    pub fn run(
        &self,
        s: &Arc<CudaStream>,
        op: &Op,
        mem: &dyn Fn(BufferId) -> (DevPtr, BufferDesc),
    ) -> Result<(), DeviceError> {
        let region = |r: &Region| mem(r.buffer).0.offset(r.offset, r.bytes);
        let k = self.kernels;
        match op {
            Op::IndexKStore {
                dst,
                dtype,
                ue8m0,
                keys,
                gamma,
                beta,
                rope,
                slots,
                ..
            } => {
                let (_a, keys_d) = self.upload(s, bytes_of(keys))?;
                let (_b, g) = self.upload(s, bytes_of(gamma))?;
                let (_c, bt) = self.upload(s, bytes_of(beta))?;
                let (_d, r) = self.upload(s, bytes_of(rope))?;
                let (_e, sl) = self.upload(s, bytes_of(slots))?;
                let (dp, dd) = mem(*dst);
                k.index_k_store(
                    s,
                    *dtype,
                    *ue8m0,
                    keys_d,
                    g,
                    bt,
                    r,
                    slots,
                    sl,
                    dp,
                    dd.fingerprint,
                )
                .map_err(kernel)
            }
            Op::KvStore {
                dst,
                dtype,
                rows,
                slots,
                ..
            } => {
                let (_a, rows_d) = self.upload(s, bytes_of(rows))?;
                let (_b, sl) = self.upload(s, bytes_of(slots))?;
                let (dp, dd) = mem(*dst);
                k.kv_store(s, *dtype, rows_d, slots, sl, dp, dd.fingerprint)
                    .map_err(kernel)
            }
            Op::QPrep {
                heads,
                q,
                weights,
                rope,
                q_out,
                w_out,
            } => {
                let n = rope.len() / 64;
                let (_a, qd) = self.upload(s, bytes_of(q))?;
                let (_b, wd) = self.upload(s, bytes_of(weights))?;
                let (_c, rd) = self.upload(s, bytes_of(rope))?;
                k.q_prep(
                    s,
                    n,
                    *heads as usize,
                    qd,
                    wd,
                    rd,
                    region(q_out),
                    region(w_out),
                )
                .map_err(kernel)
            }
            Op::IndexLogits {
                dtype,
                heads,
                q,
                w,
                k: kb,
                page_table,
                pt_stride,
                context_lens,
                out,
                out_stride,
                ..
            } => {
                let (_a, pt) = self.upload(s, bytes_of(page_table))?;
                let (_b, lens) = self.upload(s, bytes_of(context_lens))?;
                let (kp, kd) = mem(*kb);
                k.index_logits_with(
                    self.logits,
                    s,
                    *dtype,
                    *heads as usize,
                    region(q),
                    region(w),
                    page_table,
                    *pt_stride as usize,
                    pt,
                    context_lens,
                    lens,
                    kp,
                    kd.fingerprint,
                    region(out),
                    *out_stride as usize,
                )
                .map_err(kernel)
            }
            Op::TopK {
                k: kk,
                logits,
                stride,
                context_lens,
                page_table,
                pt_stride,
                out,
            } => {
                let (_a, pt) = self.upload(s, bytes_of(page_table))?;
                let (_b, lens) = self.upload(s, bytes_of(context_lens))?;
                k.topk(
                    s,
                    *kk as usize,
                    region(logits),
                    *stride as usize,
                    context_lens,
                    lens,
                    page_table,
                    *pt_stride as usize,
                    pt,
                    region(out),
                )
                .map_err(kernel)
            }
            Op::SparseRead {
                dtype,
                k: kk,
                slots,
                kv,
                context_lens,
                out,
                ..
            } => {
                let (kvp, kvd) = mem(*kv);
                k.sparse_read(
                    s,
                    *dtype,
                    context_lens.len(),
                    *kk as usize,
                    region(slots),
                    kvp,
                    kvd.fingerprint,
                    region(out),
                )
                .map_err(kernel)
            }
            Op::PageCopy {
                src,
                src_view,
                dst,
                dst_view,
                runs,
            } => {
                let (sp, _) = mem(*src);
                let (dp, _) = mem(*dst);
                tierkv_kernels::cpu::check_page_copy(src_view, sp.bytes, dst_view, dp.bytes, runs)
                    .map_err(kernel)?;
                match self.strategy {
                    CopyStrategy::MemcpyRuns => {
                        for run in runs {
                            let so = src_view.page_range(run.src).start;
                            let d0 = dst_view.page_range(run.dst).start;
                            let copy = sys::CUDA_MEMCPY2D {
                                srcXInBytes: 0,
                                srcY: 0,
                                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                                srcHost: std::ptr::null(),
                                srcDevice: sp.ptr + so,
                                srcArray: std::ptr::null_mut(),
                                srcPitch: src_view.page_stride as usize,
                                dstXInBytes: 0,
                                dstY: 0,
                                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
                                dstHost: std::ptr::null_mut(),
                                dstDevice: dp.ptr + d0,
                                dstArray: std::ptr::null_mut(),
                                dstPitch: dst_view.page_stride as usize,
                                WidthInBytes: src_view.page_bytes() as usize,
                                Height: run.count as usize,
                            };
                            // SAFETY: both views and every run were checked to lie inside their
                            // buffers just above.
                            check(
                                unsafe { sys::cuMemcpy2DAsync_v2(&copy, s.cu_stream()) },
                                "cuMemcpy2DAsync",
                            )?;
                        }
                        Ok(())
                    }
                    CopyStrategy::Gather => {
                        let flat = tierkv_kernels::cuda::gather_pairs(runs);
                        let (_a, pd) = self.upload(s, bytes_of(&flat))?;
                        k.page_gather(s, sp, src_view, dp, dst_view, runs, pd)
                            .map_err(kernel)
                    }
                }
            }
            Op::Copy { src, dst } => {
                let (sp, dp) = (region(src), region(dst));
                // SAFETY: both regions were checked against their buffers by `check_op`.
                check(
                    unsafe {
                        sys::cuMemcpyAsync(dp.ptr, sp.ptr, src.bytes as usize, s.cu_stream())
                    },
                    "cuMemcpyAsync",
                )
            }
        }
    }
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
}

impl CudaDevice {
    pub fn new(strategy: CopyStrategy) -> Result<CudaDevice, DeviceError> {
        let ops = CudaOps::new(strategy)?;
        let mk = || ops.ctx.new_stream().map_err(backend("cuStreamCreate"));
        let streams = [mk()?, mk()?, mk()?];
        Ok(CudaDevice {
            ops,
            streams,
            mem: Vec::new(),
            descs: Vec::new(),
            events: Vec::new(),
            ring: Arc::new(CompletionRing::new(RING_SLOTS)),
            tickets: std::collections::BTreeMap::new(),
        })
    }
    pub fn stream(&self, k: StreamKind) -> &Arc<CudaStream> {
        &self.streams[k.index()]
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
    pub fn synchronize_all(&self) -> Result<(), DeviceError> {
        for s in &self.streams {
            s.synchronize().map_err(backend("cuStreamSynchronize"))?;
        }
        Ok(())
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
            MemoryTier::Device => {
                // SAFETY: the buffer is written before it is read (pools by stores and loads,
                // scratch by the op producing it).
                GpuMem::Device(unsafe { self.streams[0].alloc::<u8>(bytes) }.map_err(oom)?)
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
    fn new_event(&mut self) -> EventId {
        let ev = self.ops.ctx.new_event(None).expect("cuEventCreate");
        self.events.push(ev);
        EventId(self.events.len() as u32 - 1)
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) {
        let s = &self.streams[stream.index()];
        self.events[ev.0 as usize].record(s).expect("cuEventRecord");
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
                // SAFETY: the callback was not enqueued, so we still own `cb`; the ticket is
                // completed here so the slot can be re-issued.
                let cb = unsafe { Box::from_raw(cb) };
                cb.ring.signal(cb.ticket, 0);
                self.tickets.remove(&ev);
            }
        } else {
            self.tickets.remove(&ev);
        }
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) {
        self.streams[stream.index()]
            .wait(&self.events[ev.0 as usize])
            .expect("cuStreamWaitEvent");
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
        check_op(&op, |b| self.descs[b.0 as usize])?;
        let s = self.streams[stream.index()].clone();
        self.ops.run(&s, &op, &|b| self.resolve(b))
    }
    fn host_read(&mut self, buf: BufferId, offset: u64, out: &mut [u8]) -> Result<(), DeviceError> {
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
        out.copy_from_slice(&h.slice()[offset as usize..offset as usize + out.len()]);
        Ok(())
    }
    fn host_write(&mut self, buf: BufferId, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
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
        h.slice_mut()[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
}
