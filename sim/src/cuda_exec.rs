//! `tierkv sim --device cuda`: the simulated GPU decides *when* each op completes (the same seeded
//! schedules), and a real GPU performs it. Every simulator buffer has a mirror on the GPU (device
//! memory, or mapped pinned host memory for the host tier); before an op runs, the byte ranges it
//! declares are uploaded from the simulator's memory, the CUDA kernel or copy runs, and the ranges
//! it writes come back. The oracles keep checking the simulator's memory, which now holds what
//! the CUDA kernels wrote. The op runs through the production runtime (`CudaDevice`: staging
//! ring, stream-ordered uploads, the launch records), on its compute stream.

use tierkv_engine::cpu_device::Memory;
use tierkv_engine::device::{ByteRange, Device, DeviceError, Op, StreamKind};
use tierkv_engine::layout::Bytes;
use tierkv_engine::runtime::cuda::{CopyStrategy, CudaDevice, LogitsKernel};
use tierkv_engine::runtime::driver::Ptr;

/// The production runtime on GPU 0, holding one mirror per simulator buffer (the same ids).
pub struct CudaExec {
    dev: CudaDevice,
    pub ops_run: u64,
}

impl CudaExec {
    pub fn new() -> Result<CudaExec, DeviceError> {
        let mut dev = CudaDevice::new(CopyStrategy::Gather)?;
        // The exact kernel: a seed computes on the GPU exactly what the CPU executor computes.
        dev.driver.logits = LogitsKernel::Exact;
        Ok(CudaExec { dev, ops_run: 0 })
    }

    /// Mirrors every simulator buffer not yet mirrored, in order, so that buffer ids agree.
    /// Zeroed at allocation, so that a written range the kernel leaves partly alone never
    /// copies uninitialised bytes back (compute-sanitizer's initcheck).
    fn ensure(&mut self, mem: &Memory) -> Result<(), DeviceError> {
        while self.dev.buffers() < mem.descs.len() {
            let d = mem.descs[self.dev.buffers()];
            self.dev.alloc(d)?;
        }
        Ok(())
    }

    /// Runs `op` on the GPU's compute stream with the simulator's bytes in and out.
    pub fn run(&mut self, op: &Op, mem: &mut Memory) -> Result<(), DeviceError> {
        self.ensure(mem)?;
        let accesses = op.accesses();
        // In: every range the op reads or writes (a write may cover bytes the kernel leaves alone).
        for a in &accesses {
            self.upload(a.range, mem.range(a.range))?;
        }
        self.dev.enqueue(StreamKind::Compute, op.clone())?;
        self.dev.synchronize_all()?;
        // Out: the ranges it writes.
        for a in accesses.iter().filter(|a| a.write) {
            self.download(a.range, mem.range_mut(a.range))?;
        }
        self.ops_run += 1;
        Ok(())
    }

    fn ptr(&self, r: ByteRange) -> Ptr {
        self.dev
            .buffer(r.buffer)
            .at(r.start, Bytes(r.end.0 - r.start.0))
    }

    /// Copies `src` into the mirror's range `r` (synchronously).
    fn upload(&mut self, r: ByteRange, src: &[u8]) -> Result<(), DeviceError> {
        match self.dev.desc(r.buffer).tier {
            tierkv_engine::device::MemoryTier::PinnedHost => {
                self.dev.host_write(r.buffer, r.start, src)
            }
            tierkv_engine::device::MemoryTier::Device => {
                let p = self.ptr(r);
                self.dev.driver.upload_sync(p, src)
            }
        }
    }

    /// Copies the mirror's range `r` into `dst` (synchronously).
    fn download(&mut self, r: ByteRange, dst: &mut [u8]) -> Result<(), DeviceError> {
        match self.dev.desc(r.buffer).tier {
            tierkv_engine::device::MemoryTier::PinnedHost => {
                self.dev.host_read(r.buffer, r.start, dst)
            }
            tierkv_engine::device::MemoryTier::Device => {
                let p = self.ptr(r);
                self.dev.driver.download_sync(p, dst)
            }
        }
    }
}
