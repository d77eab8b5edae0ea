//! `tierkv sim --device cuda`: the simulated GPU decides *when* each op completes (the same seeded
//! schedules), and a real GPU performs it. Every simulator buffer has a mirror on the GPU (device
//! memory, or mapped pinned host memory for the host tier); before an op runs, the byte ranges it
//! declares are uploaded from the simulator's memory, the CUDA kernel or copy runs, and the ranges
//! it writes come back. The oracles keep checking the simulator's memory, which now holds what
//! the CUDA kernels wrote.

use cudarc::driver::CudaStream;
use std::sync::Arc;
use tierkv_engine::cpu_device::Memory;
use tierkv_engine::device::{BufferDesc, BufferId, ByteRange, DeviceError, MemoryTier, Op};
use tierkv_engine::runtime::cuda::{CopyStrategy, CudaOps, GpuMem, PinnedHost};
use tierkv_kernels::cuda::launch::DevPtr;

pub struct CudaExec {
    ops: CudaOps,
    stream: Arc<CudaStream>,
    mirrors: Vec<GpuMem>,
    descs: Vec<BufferDesc>,
    pub ops_run: u64,
}

fn backend(e: cudarc::driver::DriverError) -> DeviceError {
    DeviceError::Backend {
        detail: e.to_string(),
    }
}

impl CudaExec {
    pub fn new() -> Result<CudaExec, DeviceError> {
        let mut ops = CudaOps::new(CopyStrategy::Gather)?;
        // The exact kernel: a seed computes on the GPU exactly what the CPU executor computes.
        ops.logits = tierkv_engine::runtime::cuda::LogitsKernel::Exact;
        let stream = ops.ctx.new_stream().map_err(backend)?;
        ops.prepare_staging(&stream)?;
        Ok(CudaExec {
            ops,
            stream,
            mirrors: Vec::new(),
            descs: Vec::new(),
            ops_run: 0,
        })
    }

    fn ensure(&mut self, mem: &Memory) -> Result<(), DeviceError> {
        while self.mirrors.len() < mem.descs.len() {
            let d = mem.descs[self.mirrors.len()];
            let bytes = d.bytes.usize().max(1);
            let m = match d.tier {
                // Zeroed, so that a written range the kernel leaves partly alone never copies
                // uninitialised bytes back (compute-sanitizer's initcheck).
                MemoryTier::Device => {
                    GpuMem::Device(self.stream.alloc_zeros::<u8>(bytes).map_err(backend)?)
                }
                MemoryTier::PinnedHost => GpuMem::Pinned(PinnedHost::new(&self.ops.ctx, bytes)?),
            };
            self.mirrors.push(m);
            self.descs.push(d);
        }
        Ok(())
    }

    fn ptr(&self, b: BufferId) -> DevPtr {
        self.mirrors[b.0 as usize].dev_ptr(&self.stream)
    }

    /// Runs `op` on the GPU with the simulator's bytes in and out.
    pub fn run(&mut self, op: &Op, mem: &mut Memory) -> Result<(), DeviceError> {
        self.ensure(mem)?;
        let accesses = op.accesses();
        // In: every range the op reads or writes (a write may cover bytes the kernel leaves alone).
        for a in &accesses {
            self.upload(a.range, mem.range(a.range))?;
        }
        let descs = self.descs.clone();
        let ptrs: Vec<DevPtr> = (0..self.mirrors.len() as u32)
            .map(|b| self.ptr(BufferId(b)))
            .collect();
        self.ops.run(&self.stream, op, &|b| {
            (ptrs[b.0 as usize], descs[b.0 as usize])
        })?;
        self.stream.synchronize().map_err(backend)?;
        // Out: the ranges it writes.
        for a in accesses.iter().filter(|a| a.write) {
            self.download(a.range, mem.range_mut(a.range))?;
        }
        self.stream.synchronize().map_err(backend)?;
        self.ops_run += 1;
        Ok(())
    }

    /// Copies `src` into the mirror's range `r`. For device memory the copy is asynchronous and
    /// still reads `src` when this returns: the caller must synchronise the stream before `src`
    /// is dropped or written (`run` does, before it touches the simulator's memory again).
    fn upload(&mut self, r: ByteRange, src: &[u8]) -> Result<(), DeviceError> {
        match &mut self.mirrors[r.buffer.0 as usize] {
            GpuMem::Pinned(h) => h.slice_mut()[r.span()].copy_from_slice(src),
            GpuMem::Device(_) => {
                let dst = self.ptr(r.buffer).ptr + r.start.0;
                // SAFETY: the range is inside the mirror; `src` stays alive and unwritten until
                // the caller's synchronisation (see the function comment).
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream())
                }
                .map_err(backend)?;
            }
        }
        Ok(())
    }

    /// Copies the mirror's range `r` into `dst` (the caller synchronises before reading it).
    fn download(&self, r: ByteRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        match &self.mirrors[r.buffer.0 as usize] {
            GpuMem::Pinned(h) => dst.copy_from_slice(&h.slice()[r.span()]),
            GpuMem::Device(_) => {
                let src = self.ptr(r.buffer).ptr + r.start.0;
                // SAFETY: synchronous below; range inside the mirror.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream())
                }
                .map_err(backend)?;
            }
        }
        Ok(())
    }
}
