//! The production KV link of a prefill/decode pair on two GPUs: NCCL point-to-point send and
//! receive (feature `nccl`), the one place tierkv names NCCL.
//!
//! One process drives both engines, so the link holds a communicator of two ranks made by
//! `ncclCommInitAll` over the two devices: rank 0 the prefill GPU, rank 1 the decode GPU. A
//! transfer waits on the prefill device's write stream for the prefill engine's `after` event;
//! then, per layer, one NCCL group sends each page run of the layer's KV and index-K pools from
//! the prefill pools (on the prefill write stream) and receives it into the decode pools (on the
//! decode load stream), and the decode side records the layer's receive event after it. `sent`
//! is recorded on the prefill write stream after the last send. NCCL sends raw bytes: the pair's
//! handshake has already refused any two layouts that differ, and each layer's two sides are
//! checked again here.
//!
//! cudarc loads `libnccl.so` at first use; a machine where it cannot be found gets a typed error
//! from [`NcclLink::new`] instead of cudarc's panic.

use super::cuda::CudaDevice;
use crate::device::{call_recovering, Device, DeviceError, EventId, Op, StreamKind};
use crate::layout::{coalesce_runs, PageId};
use crate::pd::{check_layers, KvLink, LayerSend, LinkError};
use cudarc::nccl::{result, sys};

/// Two NCCL ranks in this process: the prefill GPU's and the decode GPU's.
pub struct NcclLink {
    comms: [sys::ncclComm_t; 2],
    /// The GPUs' ordinals, rank 0 then rank 1.
    pub ordinals: [usize; 2],
}

fn nccl(what: &'static str) -> impl Fn(result::NcclError) -> DeviceError {
    move |e| DeviceError::Backend {
        detail: format!("{what}: NCCL error {e:?}"),
    }
}

impl NcclLink {
    /// A communicator over the two devices' GPUs (which must differ).
    pub fn new(prefill: &CudaDevice, decode: &CudaDevice) -> Result<NcclLink, DeviceError> {
        let ordinals = [prefill.ordinal(), decode.ordinal()];
        if ordinals[0] == ordinals[1] {
            return Err(DeviceError::Backend {
                detail: format!(
                    "the NCCL link joins two GPUs; both engines are on GPU {}",
                    ordinals[0]
                ),
            });
        }
        // SAFETY: only tries to open the library, calls nothing in it.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Backend {
                detail: "NCCL (libnccl.so) was not found on the library path".into(),
            });
        }
        let mut comms = [std::ptr::null_mut(); 2];
        let devs = [ordinals[0] as i32, ordinals[1] as i32];
        // SAFETY: two communicator slots and two device ordinals, as `ncclCommInitAll` reads.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), 2, devs.as_ptr()) }
            .map_err(nccl("ncclCommInitAll"))?;
        Ok(NcclLink { comms, ordinals })
    }
}

impl Drop for NcclLink {
    fn drop(&mut self) {
        for c in self.comms {
            // SAFETY: made by `ncclCommInitAll`, destroyed once. An error here has nowhere to go.
            let _ = unsafe { result::comm_destroy(c) };
        }
    }
}

impl KvLink<CudaDevice> for NcclLink {
    fn send(
        &mut self,
        prefill: &mut CudaDevice,
        decode: &mut CudaDevice,
        after: EventId,
        pairs: &[(PageId, PageId)],
        layers: &[LayerSend],
        sent: EventId,
    ) -> Result<(), LinkError> {
        check_layers(layers)?;
        call_recovering(prefill, |d| d.wait(StreamKind::Write, after))?;
        let (ps, ds) = (
            prefill.stream(StreamKind::Write).cu_stream(),
            decode.stream(StreamKind::Load).cu_stream(),
        );
        let runs = coalesce_runs(pairs);
        for l in layers {
            if !pairs.is_empty() {
                result::group_start().map_err(nccl("ncclGroupStart"))?;
                for (src, dst) in [l.kv, l.index_k] {
                    let Op::PageCopy(c) = src.copy_to(dst, runs.clone()) else {
                        unreachable!("a pool side copies by PageCopy");
                    };
                    let (sp, dp) = (prefill.buffer_ptr(c.src), decode.buffer_ptr(c.dst));
                    for r in &c.runs {
                        // A run's pages are consecutive in a device pool (page stride = page
                        // bytes), so one message moves it.
                        let (s0, d0) = (c.src_view.page_range(r.src), c.dst_view.page_range(r.dst));
                        let bytes = (r.count as u64 * c.src_view.page_stride) as usize;
                        assert_eq!(
                            c.src_view.page_stride,
                            c.src_view.page_bytes(),
                            "device pool pages are packed"
                        );
                        // SAFETY: both ranges lie inside their pool buffers (checked by the
                        // views' page ranges); the streams belong to the ranks' devices.
                        unsafe {
                            result::send(
                                (sp.ptr + s0.start) as *const _,
                                bytes,
                                sys::ncclDataType_t::ncclUint8,
                                1,
                                self.comms[0],
                                ps as _,
                            )
                            .map_err(nccl("ncclSend"))?;
                            result::recv(
                                (dp.ptr + d0.start) as *mut _,
                                bytes,
                                sys::ncclDataType_t::ncclUint8,
                                0,
                                self.comms[1],
                                ds as _,
                            )
                            .map_err(nccl("ncclRecv"))?;
                        }
                    }
                }
                result::group_end().map_err(nccl("ncclGroupEnd"))?;
            }
            call_recovering(decode, |d| d.record(StreamKind::Load, l.received))?;
        }
        call_recovering(prefill, |d| d.record(StreamKind::Write, sent))?;
        Ok(())
    }
}

/// The throughput of NCCL's send/receive and of `cuMemcpyPeerAsync` between the two GPUs, on
/// one buffer of `bytes` each way, timed by the host around each (after a warm-up): bytes per
/// second of each.
pub fn measure(
    link: &NcclLink,
    prefill: &CudaDevice,
    decode: &CudaDevice,
    bytes: usize,
) -> Result<(f64, f64), DeviceError> {
    let backend = |what: &'static str| {
        move |e: cudarc::driver::DriverError| DeviceError::Backend {
            detail: format!("{what}: {e}"),
        }
    };
    let (ps, ds) = (
        prefill.stream(StreamKind::Write),
        decode.stream(StreamKind::Load),
    );
    // Plain `cuMemAlloc` buffers: memory of a stream-ordered pool is not reachable by a peer
    // copy through `cuCtxEnablePeerAccess` (the driver would stage the copy through the host).
    let alloc = |dev: &CudaDevice| -> Result<u64, DeviceError> {
        dev.driver
            .ctx
            .bind_to_thread()
            .map_err(backend("cuCtxSetCurrent"))?;
        // SAFETY: a fresh allocation in the bound context, freed below.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(backend("cuMemAlloc"))
    };
    let (sp, dp) = (alloc(prefill)?, alloc(decode)?);
    let sync = |what| -> Result<(), DeviceError> {
        ps.synchronize().map_err(backend(what))?;
        ds.synchronize().map_err(backend(what))
    };
    let nccl_once = || -> Result<(), DeviceError> {
        result::group_start().map_err(nccl("ncclGroupStart"))?;
        // SAFETY: `bytes` bytes at both addresses, allocated above on the ranks' devices.
        unsafe {
            result::send(
                sp as *const _,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                1,
                link.comms[0],
                ps.cu_stream() as _,
            )
            .map_err(nccl("ncclSend"))?;
            result::recv(
                dp as *mut _,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                0,
                link.comms[1],
                ds.cu_stream() as _,
            )
            .map_err(nccl("ncclRecv"))?;
        }
        result::group_end().map_err(nccl("ncclGroupEnd"))?;
        Ok(())
    };
    // The ceiling: a peer copy with peer access enabled both ways (without it the driver stages
    // the copy through the host). Already enabled is fine.
    for (from, to) in [(prefill, decode), (decode, prefill)] {
        from.driver
            .ctx
            .bind_to_thread()
            .map_err(backend("cuCtxSetCurrent"))?;
        // SAFETY: two live contexts; enabling access maps nothing the link touches.
        let r = unsafe { cudarc::driver::sys::cuCtxEnablePeerAccess(to.driver.ctx.cu_ctx(), 0) };
        use cudarc::driver::sys::CUresult;
        if r != CUresult::CUDA_SUCCESS && r != CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Err(DeviceError::Backend {
                detail: format!("cuCtxEnablePeerAccess: {r:?}"),
            });
        }
    }
    let peer_once = || -> Result<(), DeviceError> {
        // SAFETY: `bytes` bytes at both addresses, each in its device's context.
        unsafe {
            cudarc::driver::result::memcpy_peer_async(
                decode.driver.ctx.cu_ctx(),
                dp,
                prefill.driver.ctx.cu_ctx(),
                sp,
                bytes,
                ds.cu_stream(),
            )
        }
        .map_err(backend("cuMemcpyPeerAsync"))
    };
    const REPEAT: u32 = 5;
    let timed = |f: &dyn Fn() -> Result<(), DeviceError>| -> Result<f64, DeviceError> {
        f()?;
        sync("warm-up")?;
        let t = std::time::Instant::now();
        for _ in 0..REPEAT {
            f()?;
        }
        sync("timed")?;
        Ok(bytes as f64 * REPEAT as f64 / t.elapsed().as_secs_f64())
    };
    let measured = timed(&nccl_once).and_then(|n| Ok((n, timed(&peer_once)?)));
    for (dev, ptr) in [(prefill, sp), (decode, dp)] {
        dev.driver
            .ctx
            .bind_to_thread()
            .map_err(backend("cuCtxSetCurrent"))?;
        // SAFETY: allocated above in this context, every copy on it synchronised.
        unsafe { cudarc::driver::result::free_sync(ptr) }.map_err(backend("cuMemFree"))?;
    }
    measured
}
