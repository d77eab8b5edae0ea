//! The production driver on CUDA (feature `cuda`): cudarc's driver calls below the runtime seam
//! ([`super::driver::Driver`]), and the NVRTC kernels behind each [`Launch`] record. Device
//! buffers come from `cuMemAlloc`, pinned host buffers from `cuMemHostAlloc` (portable,
//! device-mapped — cudarc's `alloc_pinned` is write-combined and slow for CPU reads), scratch
//! from the stream-ordered pool (`cuMemAllocAsync`). The compute, load and write streams are
//! the context's own.
//!
//! [`CudaDevice`] is the runtime ([`super::driven::DrivenDevice`]) over this driver: the one
//! production `Device` on a GPU.

pub use super::driven::CopyStrategy;
use super::driven::DrivenDevice;
use super::driver::{
    Copy2d, Driver, DrvEvent, DrvGraph, EventUse, HostCallback, Launch, Mem, MemTable, Ptr,
};
use crate::device::*;
use crate::layout::Bytes;
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;
use tierkv_kernels::cuda::launch::{
    DevPtr, IndexKStorePtrs, IndexLogitsPtrs, Kernels, KvStorePtrs, QPrepPtrs, SparseReadPtrs,
    TopKPtrs,
};
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

/// Pinned, portable, device-mapped host memory. Its host address is private: only `new` makes
/// one, so `slice` always describes a live allocation of `bytes` bytes.
pub struct PinnedHost {
    host: *mut u8,
    dev: u64,
    bytes: usize,
}

// SAFETY: the allocation is plain memory owned by this value; access is serialised by its owner.
unsafe impl Send for PinnedHost {}

/// An executable CUDA graph of the driver's context, and the `index_logits` kernel and launch
/// shape its launches were captured with.
struct GraphExec(sys::CUgraphExec, (LogitsKernel, LogitsTuning));

// SAFETY: a handle of the driver's context, used only by the driver that owns it, one call at a
// time.
unsafe impl Send for GraphExec {}

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

/// One allocation of the driver.
enum Alloc {
    /// `cuMemAlloc`, freed with `cuMemFree`.
    Device {
        ptr: sys::CUdeviceptr,
    },
    Pinned(PinnedHost),
    /// `cuMemAllocAsync`, freed with `cuMemFreeAsync` by the runtime.
    Async {
        ptr: sys::CUdeviceptr,
    },
    /// A server's memory ([`Driver::import`]): never freed here.
    Foreign {
        ptr: sys::CUdeviceptr,
        bytes: u64,
    },
}

/// cudarc's driver calls on one GPU: its context, three streams, the kernels, and every
/// allocation and event the runtime made.
pub struct CudaDriver {
    pub ctx: Arc<CudaContext>,
    /// The kernels; `None` for a driver made for copies only ([`CudaDriver::copies_on`]).
    pub kernels: Option<&'static Kernels>,
    /// Which `index_logits` kernel runs: the tensor cores by default (production); the
    /// simulator's CUDA executor sets [`LogitsKernel::Exact`], because its oracles compare
    /// digests bit for bit against the CPU reference. Set before the first launch: a graph
    /// keeps the kernel it was captured with, and launching one captured with another panics.
    pub logits: LogitsKernel,
    /// The tensor-core kernel's launch shape (set before the first launch, as `logits`).
    pub tuning: LogitsTuning,
    streams: [Arc<CudaStream>; 3],
    mems: MemTable<Alloc>,
    events: Vec<CudaEvent>,
    /// `copy_list` (`page_copy.cu`), compiled on the first batch large enough for it (a
    /// copies-only driver's when it is made): `None` before, `Some(Err(why))` where it could
    /// not be compiled or loaded (the batches then go to the copy engines; `copy_path` says
    /// why).
    copy_kernel: Option<Result<CudaFunction, String>>,
    /// Pinned staging for `copy_list`'s copy lists, used in turn (up to [`COPY_LISTS_MAX`] of
    /// [`KERNEL_SLICE_COPIES`] entries, made as needed), each with the event recorded after its
    /// upload: the host reuses one only after that event. An upload from pageable memory may
    /// be synchronous (CUDA's documentation allows the driver to wait), while one from pinned
    /// memory is queued and returns: the host can list the next batch while the GPU copies
    /// this one.
    lists: Vec<(PinnedHost, CudaEvent)>,
    next_list: usize,
    /// The executable graphs made from captures (`capture_end`), by `DrvGraph` id.
    graphs: MemTable<GraphExec>,
    /// Per stream: a capture is open, and a launch failed in it (a launcher's own check refused
    /// it before CUDA saw it, which leaves CUDA's capture valid).
    capturing: [bool; 3],
    capture_failed: [bool; 3],
}

/// The most copy lists staged at once: the host may run this many batches ahead of the GPU
/// before it waits for one (each holds [`KERNEL_SLICE_COPIES`] copies: 384 KiB of pinned
/// memory; a 1,000-block job of DeepSeek-V3.2's 61 layers is 13 batches).
const COPY_LISTS_MAX: usize = 32;

/// The fewest copies of one [`Driver::copy_batch_async`] that go to the copy kernel
/// (`copy_list`) rather than the copy engines: the engines cost about 1 us of host time per
/// copy (runs 81-82), the kernel one launch and one upload of 24 bytes per copy.
pub const KERNEL_COPIES_MIN: usize = 16;

/// The largest mean copy size of a batch the copy kernel takes: larger copies are few per byte,
/// and the copy engines move them at the link's rate without an SM.
pub const KERNEL_COPY_MEAN_BYTES_MAX: u64 = 1 << 20;

/// Copies per `copy_list` launch: a batch goes as slices of this many, so that the GPU starts on
/// the first while the host lists (and checks) the next.
pub const KERNEL_SLICE_COPIES: usize = 16_384;

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and newer). Asked once; cudarc's
/// loader panics on a symbol the driver lacks, so nothing calls it before this says yes.
fn batch_copies_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: an out-pointer to a local.
        let r = unsafe { sys::cuDriverGetVersion(&mut v) };
        r == sys::CUresult::CUDA_SUCCESS && v >= 13000
    })
}

/// Runs a [`HostCallback`] on CUDA's callback thread.
unsafe extern "C" fn run_callback(data: *mut std::ffi::c_void) {
    // SAFETY: `data` is the `Box<HostCallback>` leaked by `host_callback`, consumed once here.
    let cb = unsafe { Box::from_raw(data as *mut HostCallback) };
    cb();
}

impl CudaDriver {
    /// The driver on GPU `ordinal`, with its three streams.
    pub fn on(ordinal: usize) -> Result<CudaDriver, DeviceError> {
        let kernels = Kernels::on(ordinal).map_err(kernel)?;
        let ctx = kernels.ctx.clone();
        let mk = || ctx.new_stream().map_err(backend("cuStreamCreate"));
        let streams = [mk()?, mk()?, mk()?];
        Ok(CudaDriver {
            ctx,
            kernels: Some(kernels),
            logits: LogitsKernel::default(),
            tuning: LogitsTuning::default(),
            streams,
            mems: MemTable::default(),
            events: Vec::new(),
            copy_kernel: None,
            lists: Vec::new(),
            next_list: 0,
            graphs: MemTable::default(),
            capturing: [false; 3],
            capture_failed: [false; 3],
        })
    }

    /// A driver on GPU `ordinal`'s primary context (the one PyTorch uses) for copies only: its
    /// three streams, and of the kernels only `copy_list`, compiled and loaded now so that a
    /// server's first job does not wait for NVRTC (where it cannot be compiled, batches go to
    /// the copy engines); any other launch is refused. The host tier of a server's offloading
    /// runs on it (`crate::offload::transfer`).
    pub fn copies_on(ordinal: usize) -> Result<CudaDriver, DeviceError> {
        let mut d = CudaDriver::copies_only(ordinal)?;
        d.copy_kernel();
        Ok(d)
    }

    fn copies_only(ordinal: usize) -> Result<CudaDriver, DeviceError> {
        let ctx = CudaContext::new(ordinal).map_err(backend("cuDevicePrimaryCtxRetain"))?;
        let mk = || ctx.new_stream().map_err(backend("cuStreamCreate"));
        let streams = [mk()?, mk()?, mk()?];
        Ok(CudaDriver {
            ctx,
            kernels: None,
            logits: LogitsKernel::default(),
            tuning: LogitsTuning::default(),
            streams,
            mems: MemTable::default(),
            events: Vec::new(),
            copy_kernel: None,
            lists: Vec::new(),
            next_list: 0,
            graphs: MemTable::default(),
            capturing: [false; 3],
            capture_failed: [false; 3],
        })
    }

    /// `copies` on the copy engines: one `cuMemcpyBatchAsync` per 4,096 (copy by copy where
    /// the driver has no batch call or refuses one).
    fn copy_by_engines(&mut self, s: StreamKind, copies: &[(Ptr, Ptr)]) -> Result<(), DeviceError> {
        const BATCH: usize = 4096;
        if !batch_copies_available() {
            return copies
                .iter()
                .try_for_each(|&(d, sp)| self.copy_async(s, d, sp));
        }
        let stream = self.streams[s.index()].cu_stream();
        for part in copies.chunks(BATCH) {
            let mut dsts: Vec<sys::CUdeviceptr> = Vec::with_capacity(part.len());
            let mut srcs: Vec<sys::CUdeviceptr> = Vec::with_capacity(part.len());
            let mut sizes: Vec<usize> = Vec::with_capacity(part.len());
            for &(dst, src) in part {
                assert_eq!(
                    src.bytes, dst.bytes,
                    "a copy between ranges of different sizes"
                );
                dsts.push(self.dev_ptr(dst).ptr);
                srcs.push(self.dev_ptr(src).ptr);
                sizes.push(src.bytes.usize());
            }
            // Location hints apply to managed memory only; these ranges are device and pinned
            // host memory, so the hints are ignored.
            let hint = sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            };
            let mut attrs = [sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: hint,
                dstLocHint: hint,
                flags: 0,
            }];
            let mut attr_at = [0usize];
            // SAFETY: every range lies inside a live allocation (the caller checked them); the
            // arrays outlive the call, which reads them before it returns.
            let r = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    part.len(),
                    attrs.as_mut_ptr(),
                    attr_at.as_mut_ptr(),
                    1,
                    stream,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                for &(dst, src) in part {
                    self.copy_async(s, dst, src)?;
                }
            }
        }
        Ok(())
    }

    /// The next pinned copy-list buffer, free to write: the oldest one when its last upload is
    /// done; else a new one, while there are fewer than [`COPY_LISTS_MAX`]; else the oldest,
    /// once its upload is done. An upload waits behind everything queued before it on its
    /// stream (for a host-tier job, the caller's stream reaching the job's point): waiting for
    /// one would hold the host to the GPU's progress, so the pool grows instead.
    fn copy_list_staging(&mut self, bytes: usize) -> Result<usize, DeviceError> {
        let capacity = crate::layout::u64_bytes(3 * KERNEL_SLICE_COPIES as u64).usize();
        assert!(bytes <= capacity, "a copy list longer than a slice");
        let i = self.next_list;
        // An event never recorded is complete.
        let free = match self.lists.get(i) {
            Some((_, uploaded)) => uploaded
                .try_is_complete()
                .map_err(backend("cuEventQuery (a copy list)"))?,
            None => false,
        };
        if !free && self.lists.len() < COPY_LISTS_MAX {
            let event = self
                .ctx
                .new_event(None)
                .map_err(backend("cuEventCreate (a copy list)"))?;
            let list = (PinnedHost::new(&self.ctx, capacity)?, event);
            // Before the oldest, which stays next in turn.
            self.lists.insert(i, list);
            self.next_list = (i + 1) % self.lists.len();
            return Ok(i);
        }
        self.next_list = (i + 1) % self.lists.len();
        if !free {
            self.lists[i]
                .1
                .synchronize()
                .map_err(backend("cuEventSynchronize (a copy list)"))?;
        }
        Ok(i)
    }

    /// `copy_list`, compiled and loaded into this driver's context on first use.
    fn copy_kernel(&mut self) -> Option<&CudaFunction> {
        if self.copy_kernel.is_none() {
            let src = tierkv_kernels::cuda::SOURCES
                .iter()
                .find(|s| s.file == "page_copy.cu")
                .expect("page_copy.cu is a kernel source");
            let loaded = tierkv_kernels::cuda::compile(src)
                .map_err(|e| format!("page_copy.cu did not compile: {e}"))
                .and_then(|ptx| {
                    (self.ctx.load_module(ptx))
                        .map_err(|e| format!("page_copy.cu's module did not load: {e:?}"))
                })
                .and_then(|m| {
                    m.load_function("copy_list")
                        .map_err(|e| format!("copy_list did not load: {e:?}"))
                });
            self.copy_kernel = Some(loaded);
        }
        self.copy_kernel.as_ref().and_then(|f| f.as_ref().ok())
    }

    /// How this driver moves a batch of copies that suits the copy kernel: `Ok(())` by
    /// `copy_list`, or `Err(why)` by the copy engines because the kernel could not be compiled
    /// or loaded. Compiles it if that was not tried yet.
    pub fn copy_path(&mut self) -> Result<(), String> {
        self.copy_kernel();
        match &self.copy_kernel {
            Some(Ok(_)) => Ok(()),
            Some(Err(why)) => Err(why.clone()),
            None => unreachable!("copy_kernel sets it"),
        }
    }

    /// `copies` as one `copy_list` launch on `s`, where every range is 16-byte aligned, the mean
    /// copy is at most [`KERNEL_COPY_MEAN_BYTES_MAX`], no destination overlaps another range of
    /// the batch (the kernel runs the copies in any order) and the kernel is available; `false`
    /// (nothing queued) otherwise.
    fn copy_by_kernel(
        &mut self,
        s: StreamKind,
        copies: &[(Ptr, Ptr)],
    ) -> Result<bool, DeviceError> {
        let mut desc: Vec<u64> = Vec::with_capacity(3 * copies.len());
        for &(dst, src) in copies {
            assert_eq!(
                src.bytes, dst.bytes,
                "a copy between ranges of different sizes"
            );
            let (d, sp, b) = (self.dev_ptr(dst).ptr, self.dev_ptr(src).ptr, src.bytes.0);
            if (d | sp | b) % 16 != 0 {
                return Ok(false);
            }
            desc.extend([d, sp, b]);
        }
        let total: u64 = desc.chunks_exact(3).map(|c| c[2]).sum();
        if total / copies.len() as u64 > KERNEL_COPY_MEAN_BYTES_MAX
            || copies.len() > i32::MAX as usize
            || !super::driver::destinations_apart(&desc)
        {
            return Ok(false);
        }
        let Some(f) = self.copy_kernel().cloned() else {
            return Ok(false);
        };
        let stream = self.streams[s.index()].clone();
        let bytes = crate::layout::u64_bytes(desc.len() as u64).usize();
        // SAFETY: stream-ordered: the upload below fills it before the kernel reads it.
        let table =
            unsafe { stream.alloc::<u64>(desc.len()) }.map_err(backend("cuMemAllocAsync"))?;
        let (at, _sync) = cudarc::driver::DevicePtr::device_ptr(&table, &stream);
        let list = self.copy_list_staging(bytes)?;
        let (pinned, uploaded) = &mut self.lists[list];
        pinned.slice_mut()[..bytes].copy_from_slice(super::driven::bytes_of(&desc));
        // SAFETY: `bytes` bytes of pinned memory that no queued upload still reads (its event
        // completed); `at` holds `bytes`.
        check(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(at, pinned.host as *const _, bytes, stream.cu_stream())
            },
            "cuMemcpyHtoDAsync (the copy list)",
        )?;
        if let Err(e) = uploaded.record(&stream) {
            // The buffer's event still holds an older record: wait for the upload queued just
            // now before the buffer can be handed out again.
            let _ = stream.synchronize();
            return Err(backend("cuEventRecord (the copy list)")(e));
        }
        let n = copies.len() as i32;
        let mut b = stream.launch_builder(&f);
        b.arg(&at).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (copies.len().min(65_535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every range lies inside a live allocation (the caller checked them) and is
        // 16-byte aligned; the list is in `table`, freed on this stream after the kernel.
        unsafe { b.launch(cfg) }.map_err(backend("copy_list launch"))?;
        Ok(true)
    }

    /// The kernels, or a refusal on a driver made for copies only.
    fn kernels(&self) -> Result<&'static Kernels, DeviceError> {
        self.kernels.ok_or_else(|| DeviceError::Backend {
            detail: "a kernel launch on a driver made for copies only".into(),
        })
    }

    pub fn stream(&self, k: StreamKind) -> &Arc<CudaStream> {
        &self.streams[k.index()]
    }

    /// An allocation's device address (pinned host memory is mapped).
    fn base(&self, m: Mem) -> u64 {
        match self.mems.get(m) {
            Alloc::Device { ptr } | Alloc::Async { ptr } | Alloc::Foreign { ptr, .. } => *ptr,
            Alloc::Pinned(h) => h.dev,
        }
    }

    /// A range's device address and size, for the launchers.
    pub fn dev_ptr(&self, p: Ptr) -> DevPtr {
        if let Alloc::Foreign { bytes, .. } = self.mems.get(p.mem) {
            assert!(
                p.offset.0 + p.bytes.0 <= *bytes,
                "a range past the {bytes} bytes imported"
            );
        }
        DevPtr {
            ptr: self.base(p.mem) + p.offset.0,
            bytes: p.bytes,
        }
    }

    fn pinned(&mut self, m: Mem) -> &mut PinnedHost {
        match self.mems.get_mut(m) {
            Alloc::Pinned(h) => h,
            _ => panic!("allocation {} is not pinned host memory", m.0),
        }
    }

    /// Copies `data` into device memory at `dst` and waits for it (the simulator's CUDA
    /// executor moves its bytes in and out of its mirrors with these two).
    pub fn upload_sync(&mut self, dst: Ptr, data: &[u8]) -> Result<(), DeviceError> {
        let to = self.dev_ptr(dst).ptr;
        // SAFETY: the range lies inside the allocation; synchronous copy.
        unsafe { cudarc::driver::result::memcpy_htod_sync(to, data) }
            .map_err(backend("cuMemcpyHtoD"))
    }

    /// Copies device memory at `src` into `out` and waits for it.
    pub fn download_sync(&mut self, src: Ptr, out: &mut [u8]) -> Result<(), DeviceError> {
        let from = self.dev_ptr(src).ptr;
        // SAFETY: the range lies inside the allocation; synchronous copy.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(out, from) }
            .map_err(backend("cuMemcpyDtoH"))
    }
}

impl Drop for CudaDriver {
    /// Everything queued finishes before the allocations are freed.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let _ = self.ctx.synchronize();
        for g in self.graphs.drain() {
            // SAFETY: nothing queued uses it after the synchronisation.
            unsafe { sys::cuGraphExecDestroy(g.0) };
        }
        for a in self.mems.drain() {
            match a {
                // SAFETY: allocated by this driver in this context; no work is queued.
                Alloc::Device { ptr } | Alloc::Async { ptr } => unsafe {
                    let _ = cudarc::driver::result::free_sync(ptr);
                },
                Alloc::Pinned(h) => drop(h),
                Alloc::Foreign { .. } => {}
            }
        }
    }
}

impl Driver for CudaDriver {
    fn bind(&mut self) -> Result<(), DeviceError> {
        self.ctx
            .bind_to_thread()
            .map_err(backend("cuCtxSetCurrent"))
    }
    fn alloc(&mut self, desc: &BufferDesc) -> Result<Mem, DeviceError> {
        self.bind()?;
        let (tier, bytes) = (desc.tier, desc.bytes.0);
        let n = bytes.max(1) as usize;
        let oom = |_| DeviceError::OutOfMemory {
            role: desc.role,
            tier,
            bytes,
        };
        let a = match tier {
            // Zeroed at allocation: a whole page moves to the host mirror even where its tail
            // was never written, and no uninitialised byte may leave the device (the GPU
            // session runs compute-sanitizer's initcheck).
            MemoryTier::Device => {
                // SAFETY: a fresh allocation of `n` bytes, zeroed before anything reads it.
                let ptr = unsafe { cudarc::driver::result::malloc_sync(n) }.map_err(oom)?;
                // SAFETY: `n` bytes at `ptr`, allocated above.
                if let Err(e) = unsafe { cudarc::driver::result::memset_d8_sync(ptr, 0, n) } {
                    // SAFETY: allocated above, never used.
                    let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
                    return Err(backend("cuMemsetD8")(e));
                }
                Alloc::Device { ptr }
            }
            MemoryTier::PinnedHost => Alloc::Pinned(PinnedHost::new(&self.ctx, n)?),
        };
        Ok(self.mems.insert(a))
    }
    fn free(&mut self, mem: Mem) -> Result<(), DeviceError> {
        match self.mems.take(mem) {
            // SAFETY: the caller made sure no queued work uses it.
            Alloc::Device { ptr } | Alloc::Async { ptr } => {
                unsafe { cudarc::driver::result::free_sync(ptr) }.map_err(backend("cuMemFree"))
            }
            Alloc::Pinned(h) => {
                drop(h);
                Ok(())
            }
            Alloc::Foreign { .. } => Ok(()),
        }
    }
    fn alloc_async(&mut self, s: StreamKind, bytes: u64) -> Result<Mem, DeviceError> {
        let stream = self.streams[s.index()].cu_stream();
        // SAFETY: a stream-ordered allocation on a live stream; the runtime writes it (by a
        // copy or a kernel) before anything reads it.
        let ptr = unsafe { cudarc::driver::result::malloc_async(stream, bytes.max(1) as usize) }
            .map_err(|e| match e.0 {
                sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => DeviceError::OutOfMemory {
                    role: BufferRole::Scratch {
                        name: "stream-ordered",
                    },
                    tier: MemoryTier::Device,
                    bytes,
                },
                r => DeviceError::Backend {
                    detail: format!("cuMemAllocAsync: {r:?}"),
                },
            })?;
        Ok(self.mems.insert(Alloc::Async { ptr }))
    }
    fn trim_pool(&mut self) -> Result<(), DeviceError> {
        self.bind()?;
        use cudarc::driver::result::{device, mem_pool};
        // SAFETY: the context's device; the pool `cuMemAllocAsync` allocates from is its
        // current one.
        let pool = unsafe { device::get_mem_pool(self.ctx.cu_device()) }
            .map_err(backend("cuDeviceGetMemPool"))?;
        // SAFETY: a live pool; trimming releases only memory no allocation holds.
        unsafe { mem_pool::trim_to(pool, 0) }.map_err(backend("cuMemPoolTrimTo"))
    }
    fn free_async(&mut self, s: StreamKind, mem: Mem) -> Result<(), DeviceError> {
        let stream = self.streams[s.index()].cu_stream();
        match self.mems.take(mem) {
            // SAFETY: the runtime frees it on the stream of its last reader, after its work.
            Alloc::Async { ptr } => unsafe { cudarc::driver::result::free_async(ptr, stream) }
                .map_err(backend("cuMemFreeAsync")),
            _ => panic!("allocation {} is not stream-ordered", mem.0),
        }
    }
    fn write_pinned(&mut self, mem: Mem, at: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        let at = at.usize();
        self.pinned(mem).slice_mut()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read_pinned(&mut self, mem: Mem, at: Bytes, out: &mut [u8]) -> Result<(), DeviceError> {
        let at = at.usize();
        out.copy_from_slice(&self.pinned(mem).slice()[at..at + out.len()]);
        Ok(())
    }
    fn copy_async(&mut self, s: StreamKind, dst: Ptr, src: Ptr) -> Result<(), DeviceError> {
        assert_eq!(
            src.bytes, dst.bytes,
            "a copy between ranges of different sizes"
        );
        let (d, sp) = (self.dev_ptr(dst), self.dev_ptr(src));
        let stream = self.streams[s.index()].cu_stream();
        // SAFETY: both ranges lie inside live allocations (the runtime checked them).
        check(
            unsafe { sys::cuMemcpyAsync(d.ptr, sp.ptr, src.bytes.usize(), stream) },
            "cuMemcpyAsync",
        )
    }
    /// One `cuMemcpyBatchAsync` per 4,096 copies, each source read in stream order; a batch the
    /// driver refuses is queued copy by copy instead (the error of that is the call's).
    fn copy_batch_async(
        &mut self,
        s: StreamKind,
        copies: &[(Ptr, Ptr)],
    ) -> Result<(), DeviceError> {
        if copies.len() >= KERNEL_COPIES_MIN {
            // Slices in stream order, each by the kernel where it qualifies: the first slice's
            // copies start while the host still lists the next, and copies of different slices
            // stay in the list's order whatever the ranges.
            for part in copies.chunks(KERNEL_SLICE_COPIES) {
                if part.len() < KERNEL_COPIES_MIN || !self.copy_by_kernel(s, part)? {
                    self.copy_by_engines(s, part)?;
                }
            }
            return Ok(());
        }
        self.copy_by_engines(s, copies)
    }
    fn copy_2d_async(&mut self, s: StreamKind, c: &Copy2d) -> Result<(), DeviceError> {
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: self.dev_ptr(c.src).ptr,
            srcArray: std::ptr::null_mut(),
            srcPitch: c.src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: std::ptr::null_mut(),
            dstDevice: self.dev_ptr(c.dst).ptr,
            dstArray: std::ptr::null_mut(),
            dstPitch: c.dst_pitch as usize,
            WidthInBytes: c.width as usize,
            Height: c.height as usize,
        };
        let stream = self.streams[s.index()].cu_stream();
        // SAFETY: both ranges were checked to lie inside their buffers.
        check(
            unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) },
            "cuMemcpy2DAsync",
        )
    }
    fn copy_pageable(&mut self, s: StreamKind, dst: Ptr, data: &[u8]) -> Result<(), DeviceError> {
        assert!(
            data.len() as u64 <= dst.bytes.0,
            "a pageable copy past its destination"
        );
        let to = self.dev_ptr(dst).ptr;
        let stream = self.streams[s.index()].cu_stream();
        // SAFETY: the range lies inside a live allocation; from pageable memory the driver
        // stages `data` before it returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(to, data, stream) }
            .map_err(backend("cuMemcpyHtoDAsync"))
    }
    fn launch(&mut self, s: StreamKind, l: &Launch<'_>) -> Result<(), DeviceError> {
        let r = self.launch_kernels(s, l);
        if r.is_err() && self.capturing[s.index()] {
            self.capture_failed[s.index()] = true;
        }
        r
    }
    fn event_create(&mut self, purpose: EventUse) -> Result<DrvEvent, DeviceError> {
        let timing = matches!(purpose, EventUse::Timing | EventUse::Transfer);
        let flags = timing.then_some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let ev = self
            .ctx
            .new_event(flags)
            .map_err(backend("cuEventCreate"))?;
        self.events.push(ev);
        Ok(DrvEvent(self.events.len() as u32 - 1))
    }
    fn event_record(&mut self, s: StreamKind, e: DrvEvent) -> Result<(), DeviceError> {
        self.events[e.0 as usize]
            .record(&self.streams[s.index()])
            .map_err(backend("cuEventRecord"))
    }
    fn event_query(&mut self, e: DrvEvent) -> EventState {
        match self.events[e.0 as usize].try_is_complete() {
            Ok(true) => EventState::Done,
            Ok(false) => EventState::Pending,
            Err(_) => EventState::Failed,
        }
    }
    fn event_synchronize(&mut self, e: DrvEvent) -> EventState {
        match self.events[e.0 as usize].synchronize() {
            Ok(()) => EventState::Done,
            Err(_) => EventState::Failed,
        }
    }
    fn event_elapsed_ns(&mut self, start: DrvEvent, end: DrvEvent) -> Option<u64> {
        let (a, b) = (&self.events[start.0 as usize], &self.events[end.0 as usize]);
        a.elapsed_ms(b).ok().map(|ms| (ms as f64 * 1e6) as u64)
    }
    fn stream_wait(&mut self, s: StreamKind, e: DrvEvent) -> Result<(), DeviceError> {
        self.streams[s.index()]
            .wait(&self.events[e.0 as usize])
            .map_err(backend("cuStreamWaitEvent"))
    }
    fn stream_synchronize(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        self.streams[s.index()]
            .synchronize()
            .map_err(backend("cuStreamSynchronize"))
    }
    fn context_synchronize(&mut self) -> Result<(), DeviceError> {
        self.ctx.synchronize().map_err(backend("cuCtxSynchronize"))
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        // An error from asynchronous work is sticky in CUDA: the context is lost and every later
        // call fails with it, so nothing can be recovered in place. A context that still
        // synchronises had no such error (an event's failure was its own): go on. A lost
        // context is not recreated: after a `trap`, a primary-context reset (with or without a
        // release first) and `cuCtxCreate` each left the context refused
        // (`CUDA_ERROR_LAUNCH_FAILED`, then `CUDA_ERROR_INVALID_CONTEXT`; kernels/GPU.md, runs
        // 87-88). The engine stops with this error, and the process must be restarted.
        self.ctx
            .synchronize()
            .map_err(backend("the CUDA context did not survive a device fault"))
    }
    fn context_generation(&self) -> u64 {
        0 // never recreated: see `recover`
    }
    fn import(&mut self, base: u64, bytes: u64) -> Result<Mem, DeviceError> {
        self.bind()?;
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: out-pointers to locals; the driver only reads `base`.
        check(
            unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) },
            "cuMemGetAddressRange (is the server's memory on this driver's GPU?)",
        )?;
        if base + bytes > start + size as u64 {
            return Err(DeviceError::Backend {
                detail: format!(
                    "import: {bytes} bytes at {base:#x} run past the allocation holding it \
                     ({size} bytes at {start:#x})"
                ),
            });
        }
        Ok(self.mems.insert(Alloc::Foreign { ptr: base, bytes }))
    }
    fn event_record_foreign(&mut self, stream: u64, e: DrvEvent) -> Result<(), DeviceError> {
        self.bind()?;
        // 0, 1 and 2 are CUDA's special handles (the legacy default stream, CU_STREAM_LEGACY,
        // CU_STREAM_PER_THREAD); any other must be a stream of this driver's context.
        if stream > 2 {
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: an out-pointer to a local; the driver validates the handle.
            let r = unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) };
            if r != sys::CUresult::CUDA_SUCCESS || ctx != self.ctx.cu_ctx() {
                return Err(DeviceError::Backend {
                    detail: format!(
                        "stream {stream:#x} is not a stream of this GPU's primary context ({r:?})"
                    ),
                });
            }
        }
        let ev = self.events[e.0 as usize].cu_event();
        // SAFETY: `stream` is the caller's live CUstream of this context (0: the legacy default).
        check(
            unsafe { sys::cuEventRecord(ev, stream as sys::CUstream) },
            "cuEventRecord on the server's stream",
        )
    }
    fn host_callback(&mut self, s: StreamKind, cb: HostCallback) -> Result<(), DeviceError> {
        let data = Box::into_raw(Box::new(cb));
        let stream = self.streams[s.index()].cu_stream();
        // SAFETY: `run_callback` takes ownership of `data` when CUDA runs it.
        let r = unsafe { sys::cuLaunchHostFunc(stream, Some(run_callback), data as *mut _) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // SAFETY: the callback was not enqueued, so we still own `data`.
            drop(unsafe { Box::from_raw(data) });
        }
        check(r, "cuLaunchHostFunc")
    }
    /// CUDA has no such call: the ring's acquire in `runtime::ring` orders the host.
    fn observed_by_callback(&mut self, _e: DrvEvent) {}
    fn capture_begin(&mut self, s: StreamKind) -> Result<(), DeviceError> {
        let stream = self.streams[s.index()].cu_stream();
        // Thread-local: CUDA refuses this thread's potentially unsafe calls during the capture
        // (the runtime makes none), as the simulated driver does.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: a live stream of this context.
        check(
            unsafe { sys::cuStreamBeginCapture_v2(stream, mode) },
            "cuStreamBeginCapture",
        )?;
        self.capturing[s.index()] = true;
        self.capture_failed[s.index()] = false;
        Ok(())
    }
    fn capture_end(
        &mut self,
        s: StreamKind,
        into: Option<DrvGraph>,
    ) -> Result<DrvGraph, DeviceError> {
        let stream = self.streams[s.index()].cu_stream();
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        self.capturing[s.index()] = false;
        // SAFETY: the stream this driver began capturing; an invalidated capture returns an
        // error and no graph.
        check(
            unsafe { sys::cuStreamEndCapture(stream, &mut graph) },
            "cuStreamEndCapture",
        )?;
        let made = match self.capture_failed[s.index()] {
            true => Err(DeviceError::Backend {
                detail: "a launch failed during the stream capture: no graph made".into(),
            }),
            false => self.exec_of(graph, into),
        };
        // SAFETY: the graph the capture made; an executable graph keeps its own copy.
        unsafe { sys::cuGraphDestroy(graph) };
        made
    }
    fn graph_launch(&mut self, s: StreamKind, g: DrvGraph) -> Result<(), DeviceError> {
        let GraphExec(exec, made_with) = *self.graphs.get(Mem(g.0));
        assert_eq!(
            made_with,
            (self.logits, self.tuning),
            "the index_logits kernel changed after a graph was captured with the old one"
        );
        let stream = self.streams[s.index()].cu_stream();
        // SAFETY: an executable graph of this context on one of its streams.
        check(unsafe { sys::cuGraphLaunch(exec, stream) }, "cuGraphLaunch")
    }
    fn graph_destroy(&mut self, g: DrvGraph) {
        let exec = self.graphs.take(Mem(g.0)).0;
        // SAFETY: launches already queued keep their own reference (CUDA defers the release).
        unsafe { sys::cuGraphExecDestroy(exec) };
    }
}

impl CudaDriver {
    /// Launches `l`'s kernels on `s`.
    fn launch_kernels(&mut self, s: StreamKind, l: &Launch<'_>) -> Result<(), DeviceError> {
        let st = &self.streams[s.index()];
        let k = self.kernels()?;
        let p = |x: Ptr| self.dev_ptr(x);
        match *l {
            Launch::ResolvePending {
                rows,
                rows_dev,
                tokens,
                tokens_len,
            } => k.resolve_pending(st, rows, p(rows_dev), p(tokens), tokens_len),
            Launch::Draw {
                kind,
                seed,
                layer,
                rows,
                rows_dev,
                out,
            } => k.draw(st, kind, seed, layer, rows, p(rows_dev), p(out)),
            Launch::RopeRows {
                table,
                table_rows,
                positions,
                positions_dev,
                out,
            } => k.rope_rows(
                st,
                p(table),
                table_rows,
                positions,
                p(positions_dev),
                p(out),
            ),
            Launch::IndexKStore {
                op,
                keys,
                gamma,
                beta,
                rope,
                slots,
                dst,
                dst_fp,
            } => k.index_k_store(
                st,
                &op.args,
                &IndexKStorePtrs {
                    keys: p(keys),
                    gamma: p(gamma),
                    beta: p(beta),
                    rope: p(rope),
                    slots: p(slots),
                    dst: p(dst),
                    dst_fp,
                },
            ),
            Launch::KvStore {
                op,
                rows,
                slots,
                dst,
                dst_fp,
            } => k.kv_store(
                st,
                &op.args,
                &KvStorePtrs {
                    rows: p(rows),
                    slots: p(slots),
                    dst: p(dst),
                    dst_fp,
                },
            ),
            Launch::QPrep {
                op,
                q,
                w,
                rope,
                q_out,
                w_out,
            } => k.q_prep(
                st,
                &op.args,
                &QPrepPtrs {
                    q: p(q),
                    w: p(w),
                    rope: p(rope),
                    q_out: p(q_out),
                    w_out: p(w_out),
                },
            ),
            Launch::IndexLogits {
                op,
                q,
                w,
                page_table,
                context_lens,
                k: keys,
                k_fp,
                out,
            } => {
                let ptrs = IndexLogitsPtrs {
                    q: p(q),
                    w: p(w),
                    page_table: p(page_table),
                    context_lens: p(context_lens),
                    k: p(keys),
                    k_fp,
                    out: p(out),
                };
                k.index_logits_with(self.logits, self.tuning, st, &op.args, &ptrs)
            }
            Launch::TopK {
                op,
                logits,
                context_lens,
                page_table,
                out,
            } => k.topk(
                st,
                &op.args,
                &TopKPtrs {
                    logits: p(logits),
                    context_lens: p(context_lens),
                    page_table: p(page_table),
                    out: p(out),
                },
            ),
            Launch::SparseRead {
                op,
                slots,
                kv,
                kv_fp,
                out,
            } => k.sparse_read(
                st,
                &op.args,
                &SparseReadPtrs {
                    slots: p(slots),
                    kv: p(kv),
                    kv_fp,
                    out: p(out),
                },
            ),
            Launch::NextTokens { op, digests, out } => {
                k.next_tokens(st, &op.args, p(digests), p(out))
            }
            Launch::PageGather {
                op,
                src,
                dst,
                pairs,
            } => k.page_gather(
                st,
                p(src),
                &op.src_view,
                p(dst),
                &op.dst_view,
                &op.runs,
                p(pairs),
            ),
        }
        .map_err(kernel)
    }

    /// `graph` as an executable graph: `into` updated to it when CUDA can (the same nodes, one
    /// for one), else a new one.
    fn exec_of(
        &mut self,
        graph: sys::CUgraph,
        into: Option<DrvGraph>,
    ) -> Result<DrvGraph, DeviceError> {
        if let Some(g) = into {
            let exec = self.graphs.get(Mem(g.0)).0;
            // SAFETY: a zeroed out-structure the driver fills.
            let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
            // SAFETY: an executable graph and a complete graph of this context.
            let r = unsafe { sys::cuGraphExecUpdate_v2(exec, graph, &mut info) };
            if r == sys::CUresult::CUDA_SUCCESS {
                self.graphs.get_mut(Mem(g.0)).1 = (self.logits, self.tuning);
                return Ok(g);
            }
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: a complete graph of this context.
        check(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "cuGraphInstantiate",
        )?;
        let made_with = (self.logits, self.tuning);
        Ok(DrvGraph(self.graphs.insert(GraphExec(exec, made_with)).0))
    }
}

/// The production `Device` on one GPU: the runtime over cudarc's driver.
pub type CudaDevice = DrivenDevice<CudaDriver>;

impl DrivenDevice<CudaDriver> {
    pub fn new(strategy: CopyStrategy) -> Result<CudaDevice, DeviceError> {
        CudaDevice::on(0, strategy)
    }

    /// The device on GPU `ordinal` (a prefill/decode pair puts each engine on its own), with
    /// the compute stream's ops launched from CUDA graphs (`DrivenDevice::set_graphs`). On an
    /// H100 (kernels/GPU.md runs 95 and 96): a launch costs 2.4 µs of host time, a captured one
    /// about 1 µs, and a graph's update and launch 2–3 µs more; a kernel launched alone 2.4 µs
    /// of device time, one from a graph 0.9 µs. At 61 layers graphs took the host's enqueue from
    /// 11.3–11.6 to 4.1–4.5 ms a step (the host then waits for the device instead; runs 96 and
    /// 97); at 4 layers the step did not get shorter (run 96).
    pub fn on(ordinal: usize, strategy: CopyStrategy) -> Result<CudaDevice, DeviceError> {
        let mut dev = DrivenDevice::over(CudaDriver::on(ordinal)?, strategy)?;
        dev.set_graphs(true);
        Ok(dev)
    }

    pub fn stream(&self, k: StreamKind) -> &Arc<CudaStream> {
        self.driver.stream(k)
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.driver.ctx.ordinal()
    }

    /// A buffer's device address (for the NCCL link, which moves pool pages between devices).
    pub fn buffer_ptr(&self, b: BufferId) -> DevPtr {
        self.driver.dev_ptr(self.buffer(b))
    }
}
