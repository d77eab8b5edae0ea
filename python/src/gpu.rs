//! The ops' per-device state (feature `cuda`): the loaded kernels (the device's primary context,
//! which torch uses too), tierkv's stream, the two events that order it after and before the
//! caller's stream, and the guard kernels' status record.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::CudaStream;
use pyo3::prelude::*;
use tierkv_kernels::cuda::launch::{GuardStatus, Kernels, DEVICES_MAX};

use crate::{DeviceIndexError, OpError};

struct Gpu {
    kernels: &'static Kernels,
    stream: Arc<CudaStream>,
    /// Recorded on the caller's stream; tierkv's stream waits for it.
    before: sys::CUevent,
    /// Recorded on tierkv's stream after the op; the caller's stream waits for it.
    after: sys::CUevent,
    /// The guard kernels' record. Its lock is held for a whole op: one op at a time per device
    /// (the events are re-recorded by each).
    status: Mutex<GuardStatus>,
}

// SAFETY: the events are driver handles used under `status`'s lock; the rest is Send + Sync.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

static GPUS: [OnceLock<Result<Gpu, String>>; DEVICES_MAX] =
    [const { OnceLock::new() }; DEVICES_MAX];

fn start(ordinal: usize) -> Result<Gpu, String> {
    let kernels = Kernels::on(ordinal).map_err(|e| e.to_string())?;
    let stream = kernels
        .ctx
        .new_stream()
        .map_err(|e| format!("new stream: {e}"))?;
    let status = GuardStatus::new(&kernels.ctx, &stream).map_err(|e| e.to_string())?;
    let event = || {
        cudarc::driver::result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("cuEventCreate: {e}"))
    };
    Ok(Gpu {
        kernels,
        stream,
        before: event()?,
        after: event()?,
        status: Mutex::new(status),
    })
}

fn gpu(op: &str, ordinal: i32) -> PyResult<&'static Gpu> {
    let slot = usize::try_from(ordinal)
        .ok()
        .and_then(|o| GPUS.get(o).map(|s| (o, s)));
    let Some((o, slot)) = slot else {
        return Err(OpError::new_err(format!(
            "tierkv.ops.{op}: CUDA device {ordinal} is outside the {DEVICES_MAX} devices tierkv serves"
        )));
    };
    slot.get_or_init(|| start(o))
        .as_ref()
        .map_err(|e| OpError::new_err(format!("tierkv.ops.{op}: CUDA device {ordinal}: {e}")))
}

fn check(r: sys::CUresult, op: &str, what: &str) -> PyResult<()> {
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(OpError::new_err(format!("tierkv.ops.{op}: {what}: {r:?}")));
    }
    Ok(())
}

/// Runs `work` on tierkv's stream of device `ordinal`, after everything queued so far on the
/// caller's stream `caller` (a `CUstream` of the device's primary context; 0 is the legacy
/// default stream), and makes `caller` wait for it. Refuses to run while a refusal of an
/// earlier op is pending.
pub fn run(
    op: &str,
    ordinal: i32,
    caller: u64,
    work: impl FnOnce(&Kernels, &Arc<CudaStream>, &mut GuardStatus) -> tierkv_kernels::Result<()>,
) -> PyResult<()> {
    let g = gpu(op, ordinal)?;
    let mut status = g.status.lock().unwrap_or_else(|p| p.into_inner());
    let fail = |e: &dyn std::fmt::Display| OpError::new_err(format!("tierkv.ops.{op}: {e}"));
    g.kernels.ctx.bind_to_thread().map_err(|e| fail(&e))?;
    if let Some(found) = status.take().map_err(|e| fail(&e))? {
        return Err(DeviceIndexError::new_err(format!(
            "tierkv.ops.{op}: not run: an earlier op on cuda:{ordinal} refused an index entry: {found}"
        )));
    }
    let caller = caller_stream(op, ordinal, g, caller)?;
    let ours = g.stream.cu_stream();
    // SAFETY: live events of this context; `caller` was checked (or is a special handle).
    unsafe {
        check(
            sys::cuEventRecord(g.before, caller),
            op,
            "cuEventRecord on the caller's stream",
        )?;
        check(
            sys::cuStreamWaitEvent(ours, g.before, 0),
            op,
            "cuStreamWaitEvent",
        )?;
    }
    // The caller's stream waits for whatever was queued, even when `work` failed part way (a
    // guard kernel may still read the caller's index arrays).
    let done = work(g.kernels, &g.stream, &mut status);
    // SAFETY: as above.
    unsafe {
        check(
            sys::cuEventRecord(g.after, ours),
            op,
            "cuEventRecord on tierkv's stream",
        )?;
        check(
            sys::cuStreamWaitEvent(caller, g.after, 0),
            op,
            "cuStreamWaitEvent on the caller's stream",
        )?;
    }
    done.map_err(|e| fail(&e))
}

/// The caller's stream handle, checked: 0, 1 and 2 are CUDA's special handles (the legacy
/// default stream, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD); any other must be a stream of the
/// device's primary context.
fn caller_stream(op: &str, ordinal: i32, g: &Gpu, caller: u64) -> PyResult<sys::CUstream> {
    let stream = caller as sys::CUstream;
    if caller > 2 {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the driver validates the handle.
        let r = unsafe { sys::cuStreamGetCtx(stream, &mut ctx) };
        if r != sys::CUresult::CUDA_SUCCESS || ctx != g.kernels.ctx.cu_ctx() {
            return Err(OpError::new_err(format!(
                "tierkv.ops.{op}: stream {caller:#x} is not a stream of cuda:{ordinal}'s primary context ({r:?})"
            )));
        }
    }
    Ok(stream)
}

/// The pending refusal of device `ordinal`, as a message, cleared.
pub fn take(ordinal: i32) -> PyResult<Option<String>> {
    let g = gpu("take_refusal", ordinal)?;
    let mut status = g.status.lock().unwrap_or_else(|p| p.into_inner());
    let fail =
        |e: &dyn std::fmt::Display| OpError::new_err(format!("tierkv.ops.take_refusal: {e}"));
    g.kernels.ctx.bind_to_thread().map_err(|e| fail(&e))?;
    let found = status.take().map_err(|e| fail(&e))?;
    Ok(found.map(|f| format!("cuda:{ordinal}: {f}")))
}
