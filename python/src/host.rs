//! `tierkv._core.HostTier`: the worker side's host chunks and copies.
//!
//! The registered caches are arrays of one-byte elements, two-dimensional (`blocks` rows of
//! `page_bytes`, at a row stride of at least that), writable: numpy arrays (host memory; CPU
//! tensors through `.numpy()`) or, in a build with the `cuda` feature, CUDA torch tensors (GPU
//! memory), each read through its base class's own array interface. All caches of a tier are
//! in the same kind of memory. The tier keeps a reference to
//! each, so their memory outlives it. Every address a job names is checked by the plan to be
//! the start of a page of a registered array before anything is copied.
//!
//! Host memory: copies run on the calling thread (without the GIL) when a job is submitted, and
//! a job's result is handed out by the next `get_finished`. GPU memory: the engine's offload
//! transfers (`tierkv_engine::offload::transfer`) on cudarc's driver, in GPU order after the
//! caller's stream; `get_finished` reports the jobs whose copies completed.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use tierkv_engine::offload::plan::{
    parse_format, CacheTensor, Group, Job, LayerRef, Plan, Registration,
};

#[cfg(feature = "cuda")]
use tierkv_engine::offload::transfer::{TransferMutant, Transfers};
#[cfg(feature = "cuda")]
use tierkv_engine::runtime::cuda::CudaDriver;

use crate::{HostMemoryError, PlanError, RegisterError};

/// One tensor's host chunks: zeroed memory from the allocator, owned.
struct HostBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by one `HostTier`; `&mut self` methods are its only
// writers and pyo3 serialises access to a pyclass.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn new(len: u64, tensor: usize) -> PyResult<Self> {
        let fail = || {
            HostMemoryError::new_err(format!(
                "host tier: {len} bytes for cache tensor {tensor} could not be allocated"
            ))
        };
        let len = usize::try_from(len).map_err(|_| fail())?;
        if len == 0 {
            return Ok(HostBuffer {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len: 0,
            });
        }
        let layout = Layout::from_size_align(len, 64).map_err(|_| fail())?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(fail());
        }
        Ok(HostBuffer { ptr, len })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with this layout.
            unsafe {
                dealloc(
                    self.ptr,
                    Layout::from_size_align(self.len, 64).expect("valid at allocation"),
                )
            }
        }
    }
}

/// A job's result: `(job_id, success, bytes, seconds)`.
type Finished = (u64, bool, u64, f64);

/// Where a tier's host chunks are and who copies them.
enum Backend {
    /// Host caches: host buffers from the allocator, copied on the calling thread.
    Host(Vec<HostBuffer>),
    /// GPU caches: pinned host chunks and copies queued on the GPU (behind a mutex only because
    /// a pyclass must be `Sync`: pyo3 already serialises `&mut self` calls).
    #[cfg(feature = "cuda")]
    Cuda(Box<std::sync::Mutex<Transfers<CudaDriver>>>),
}

/// The host tier of a worker: host chunks for each registered cache array, and the copies of
/// each job between them.
#[pyclass(module = "tierkv._core")]
pub struct HostTier {
    registration: Registration,
    /// Declared before the arrays so that it drops first: the CUDA backend waits for its
    /// copies before the caches they touch may go.
    backend: Backend,
    /// The cache arrays, kept alive for the addresses registered from them.
    _arrays: Vec<Py<PyAny>>,
    /// Host backend: the jobs done and not yet handed out.
    finished: Vec<Finished>,
    pages: u64,
    runs: u64,
}

/// A cache array's interface, and whether it is in GPU memory. Only a numpy array (host
/// memory) or, in the CUDA build, a torch tensor (GPU memory) is taken, and its interface is
/// read through the base class's own descriptor: an object cannot name memory it does not hold,
/// so the reference the tier keeps to it keeps that memory alive.
fn interface_of<'py>(i: usize, array: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, bool)> {
    let py = array.py();
    let refuse = |what: String| RegisterError::new_err(format!("cache tensor {i}: {what}"));
    let ndarray = py.import("numpy")?.getattr("ndarray")?;
    if array.is_instance(&ndarray)? {
        let face = ndarray
            .getattr("__array_interface__")?
            .call_method1("__get__", (array, &ndarray))
            .map_err(|e| refuse(format!("its array interface: {e}")))?;
        return Ok((face, false));
    }
    if cfg!(feature = "cuda") {
        if let Ok(torch) = py.import("torch") {
            let tensor = torch.getattr("Tensor")?;
            if array.is_instance(&tensor)? {
                let face = tensor
                    .getattr("__cuda_array_interface__")?
                    .call_method1("__get__", (array, &tensor))
                    .map_err(|e| refuse(format!("its CUDA array interface: {e}")))?;
                return Ok((face, true));
            }
        }
    } else if array.hasattr("__cuda_array_interface__").unwrap_or(false) {
        return Err(refuse(
            "it is in GPU memory, and this build of tierkv has no CUDA backend (build the wheel \
             with --features cuda)"
                .into(),
        ));
    }
    Err(refuse(format!(
        "a {} is not a cache array: give a numpy array (a CPU tensor's .numpy()){}",
        array.get_type().name()?,
        if cfg!(feature = "cuda") {
            " or a CUDA torch tensor"
        } else {
            ""
        }
    )))
}

/// What a cache array's interface says of it, and whether it is in GPU memory.
fn array_of(i: usize, array: &Bound<'_, PyAny>) -> PyResult<(CacheTensor, bool)> {
    let refuse = |what: String| RegisterError::new_err(format!("cache tensor {i}: {what}"));
    let (face, gpu) = interface_of(i, array)?;
    let face = face
        .cast_into::<PyDict>()
        .map_err(|_| refuse("its array interface is not a dict".into()))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        face.get_item(k)?
            .ok_or_else(|| refuse(format!("its array interface has no {k:?}")))
    };
    let typestr: String = get("typestr")?.extract()?;
    if !matches!(typestr.as_str(), "|i1" | "|u1") {
        return Err(refuse(format!(
            "elements of type {typestr}, expected one-byte integers (int8 or uint8)"
        )));
    }
    let shape: Vec<u64> = get("shape")?.extract()?;
    let [blocks, page_bytes] = shape[..] else {
        return Err(refuse(format!(
            "shape {shape:?}, expected (blocks, page_bytes)"
        )));
    };
    let data = get("data")?;
    let data = data
        .cast::<PyTuple>()
        .map_err(|_| refuse("its array interface's data is not (address, read_only)".into()))?;
    let (base, read_only): (u64, bool) = data.extract()?;
    if read_only {
        return Err(refuse("it is read-only, and loads write into it".into()));
    }
    let stride = match face.get_item("strides")? {
        Some(s) if !s.is_none() => {
            let strides: Vec<i64> = s.extract()?;
            match strides[..] {
                [row, 1] if row >= 0 => row as u64,
                _ => {
                    return Err(refuse(format!(
                        "strides {strides:?}, expected rows of contiguous bytes"
                    )))
                }
            }
        }
        _ => page_bytes,
    };
    Ok((
        CacheTensor {
            base,
            blocks,
            page_bytes,
            stride,
        },
        gpu,
    ))
}

/// Reads a bytes object of native-endian `u64`s (numpy's `astype(np.uint64).tobytes()`).
fn words(what: &str, bytes: &[u8]) -> PyResult<Vec<u64>> {
    if bytes.len() % 8 != 0 {
        return Err(PlanError::new_err(format!(
            "{what}: {} bytes is not a whole number of uint64 values",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

#[pymethods]
impl HostTier {
    /// `caches`: the cache arrays; `groups`: per KV group, `(tokens_per_block, [(cache index,
    /// bytes copied per page), ...])` one pair per layer; `formats`: the page formats the model's
    /// layers use (`tierkv._core.FORMATS`); `chunks` host chunks of `blocks_per_chunk` blocks.
    /// GPU caches: `device` is their GPU's ordinal (default 0); `mutant` plants a mistake for
    /// the tests that show a check matters (`"store-without-event"`: stores do not wait for the
    /// caller's stream).
    #[new]
    #[pyo3(signature = (caches, groups, formats, blocks_per_chunk, chunks, device = 0, mutant = None))]
    fn new(
        caches: Vec<Bound<'_, PyAny>>,
        groups: Vec<(u64, Vec<(usize, u64)>)>,
        formats: Vec<String>,
        blocks_per_chunk: u64,
        chunks: u64,
        device: usize,
        mutant: Option<&str>,
    ) -> PyResult<Self> {
        let register =
            |e: tierkv_engine::offload::plan::RegisterError| RegisterError::new_err(e.to_string());
        let arrays = caches
            .iter()
            .enumerate()
            .map(|(i, a)| array_of(i, a))
            .collect::<PyResult<Vec<_>>>()?;
        let gpu = arrays.first().is_some_and(|a| a.1);
        if let Some(i) = arrays.iter().position(|a| a.1 != gpu) {
            return Err(RegisterError::new_err(format!(
                "cache tensor {i}: in {} memory, cache tensor 0 in {}: a tier's caches are all \
                 in one kind of memory",
                if gpu { "host" } else { "GPU" },
                if gpu { "GPU" } else { "host" },
            )));
        }
        let groups = groups
            .into_iter()
            .map(|(tokens_per_block, refs)| Group {
                tokens_per_block,
                refs: refs
                    .into_iter()
                    .map(|(tensor, ref_bytes)| LayerRef { tensor, ref_bytes })
                    .collect(),
            })
            .collect();
        let formats = formats
            .iter()
            .map(|f| parse_format(f))
            .collect::<Result<Vec<_>, _>>()
            .map_err(register)?;
        let tensors = arrays.into_iter().map(|a| a.0).collect();
        let registration = Registration::new(tensors, groups, &formats, blocks_per_chunk, chunks)
            .map_err(register)?;
        let backend = backend(&registration, gpu, device, mutant)?;
        Ok(HostTier {
            registration,
            backend,
            _arrays: caches.into_iter().map(Bound::unbind).collect(),
            finished: Vec::new(),
            pages: 0,
            runs: 0,
        })
    }

    /// Copies a job's device pages into host chunks (device → host). The arguments are vLLM's
    /// `DevicePointers` (`ptrs`, `sizes` as uint64 bytes, and the three per-group lists), the
    /// host chunk numbers (uint64 bytes), and for GPU caches the caller's stream (its
    /// `CUstream` handle, PyTorch's `torch.cuda.current_stream().cuda_stream`): the copies start
    /// after the work queued on it so far. Raises `PlanError` (nothing copied) for a job outside
    /// the registration, `RuntimeError` when the GPU refused a call (the job is then reported
    /// failed by `get_finished`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (job_id, ptrs, sizes, group_blocks, group_refs, block_indices, chunks, stream = 0))]
    fn store(
        &mut self,
        py: Python<'_>,
        job_id: u64,
        ptrs: &[u8],
        sizes: &[u8],
        group_blocks: Vec<u64>,
        group_refs: Vec<u64>,
        block_indices: Vec<u64>,
        chunks: &[u8],
        stream: u64,
    ) -> PyResult<()> {
        let groups = (group_blocks, group_refs, block_indices);
        self.transfer(py, true, job_id, (ptrs, sizes, chunks), groups, stream)
    }

    /// The other way: host chunks into device pages (host → device), after the work queued so
    /// far on `stream`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (job_id, ptrs, sizes, group_blocks, group_refs, block_indices, chunks, stream = 0))]
    fn load(
        &mut self,
        py: Python<'_>,
        job_id: u64,
        ptrs: &[u8],
        sizes: &[u8],
        group_blocks: Vec<u64>,
        group_refs: Vec<u64>,
        block_indices: Vec<u64>,
        chunks: &[u8],
        stream: u64,
    ) -> PyResult<()> {
        let groups = (group_blocks, group_refs, block_indices);
        self.transfer(py, false, job_id, (ptrs, sizes, chunks), groups, stream)
    }

    /// The jobs done since the last call: `(job_id, success, bytes, seconds)`, stores and loads
    /// each in submission order.
    fn get_finished(&mut self) -> Vec<Finished> {
        match &mut self.backend {
            Backend::Host(_) => std::mem::take(&mut self.finished),
            #[cfg(feature = "cuda")]
            Backend::Cuda(t) => lock(t).finished(),
        }
    }

    /// Returns when the named jobs are done (at once for host caches: copies run at
    /// submission).
    fn wait(&mut self, py: Python<'_>, job_ids: Vec<u64>) {
        match &mut self.backend {
            Backend::Host(_) => {}
            #[cfg(feature = "cuda")]
            Backend::Cuda(t) => py.detach(|| lock(t).wait(&job_ids)),
        }
        let _ = (py, job_ids);
    }

    /// The bytes of host chunk `chunk` of cache `tensor` (for tests and debugging; with GPU
    /// caches, wait for the jobs writing it first).
    fn read_host<'py>(
        &mut self,
        py: Python<'py>,
        tensor: usize,
        chunk: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if tensor >= self.registration.tensors().len() || chunk >= self.registration.chunks() {
            return Err(PlanError::new_err(format!(
                "read_host: chunk {chunk} of cache {tensor} does not exist ({} caches, {} chunks)",
                self.registration.tensors().len(),
                self.registration.chunks()
            )));
        }
        let n = self.registration.chunk_bytes(tensor) as usize;
        match &mut self.backend {
            Backend::Host(host) => {
                let at = chunk as usize * n;
                // SAFETY: `at + n` is within the buffer (chunk < chunks, buffer = chunks * n).
                let bytes = unsafe { std::slice::from_raw_parts(host[tensor].ptr.add(at), n) };
                Ok(PyBytes::new(py, bytes))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(t) => {
                let bytes = lock(t).read_host(tensor, chunk).map_err(device_error)?;
                Ok(PyBytes::new(py, &bytes))
            }
        }
    }

    /// Host bytes held in all.
    #[getter]
    fn host_bytes(&self) -> u64 {
        match &self.backend {
            Backend::Host(host) => host.iter().map(|b| b.len as u64).sum(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(t) => lock(t).host_bytes(),
        }
    }

    /// `"host"` or `"cuda"`: where the caches are and who copies.
    #[getter]
    fn backend(&self) -> &'static str {
        match &self.backend {
            Backend::Host(_) => "host",
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => "cuda",
        }
    }

    /// Page copies asked for, and the runs they were coalesced into, since construction.
    /// How a batch of small scattered copies moves: "kernel" (one `copy_list` launch),
    /// "copy engines: WHY" where that kernel could not be compiled or loaded, or "host" (CPU
    /// caches, no GPU).
    #[getter]
    fn copy_path(&self) -> String {
        match &self.backend {
            Backend::Host(_) => "host".into(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(t) => match lock(t).driver().copy_path() {
                Ok(()) => "kernel".into(),
                Err(why) => format!("copy engines: {why}"),
            },
        }
    }

    #[getter]
    fn copies(&self) -> (u64, u64) {
        (self.pages, self.runs)
    }
}

/// The backend for a checked registration.
fn backend(
    registration: &Registration,
    gpu: bool,
    device: usize,
    mutant: Option<&str>,
) -> PyResult<Backend> {
    let mutant = match mutant {
        None => None,
        Some("store-without-event") => Some(()),
        Some(other) => {
            return Err(RegisterError::new_err(format!(
                "unknown mutant {other:?} (known: store-without-event)"
            )))
        }
    };
    if !gpu {
        if mutant.is_some() {
            return Err(RegisterError::new_err(
                "mutant store-without-event needs GPU caches",
            ));
        }
        let host = (0..registration.tensors().len())
            .map(|t| HostBuffer::new(registration.host_bytes(t), t))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(Backend::Host(host));
    }
    #[cfg(feature = "cuda")]
    {
        let driver = CudaDriver::copies_on(device).map_err(device_error)?;
        let mut t = Transfers::new(driver, registration.clone()).map_err(device_error)?;
        t.plant(mutant.map(|()| TransferMutant::StoreWithoutEvent));
        Ok(Backend::Cuda(Box::new(std::sync::Mutex::new(t))))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        unreachable!("GPU caches are refused by array_of without the cuda feature")
    }
}

/// The transfers. A lock poisoned by a panic (a tierkv bug, already raised to Python as
/// `PanicException`) is taken over as it is.
#[cfg(feature = "cuda")]
fn lock(
    t: &std::sync::Mutex<Transfers<CudaDriver>>,
) -> std::sync::MutexGuard<'_, Transfers<CudaDriver>> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(feature = "cuda")]
fn device_error(e: tierkv_engine::device::DeviceError) -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(format!("tierkv host tier: {e}"))
}

impl HostTier {
    fn transfer(
        &mut self,
        py: Python<'_>,
        store: bool,
        job_id: u64,
        (ptrs, sizes, chunks): (&[u8], &[u8], &[u8]),
        groups: (Vec<u64>, Vec<u64>, Vec<u64>),
        stream: u64,
    ) -> PyResult<()> {
        let (ptrs, sizes, chunks) = (
            words("ptrs", ptrs)?,
            words("sizes", sizes)?,
            words("chunks", chunks)?,
        );
        let job = Job {
            ptrs: &ptrs,
            sizes: &sizes,
            group_blocks: &groups.0,
            group_refs: &groups.1,
            block_indices: &groups.2,
            chunks: &chunks,
        };
        let plan = self
            .registration
            .plan(&job)
            .map_err(|e| PlanError::new_err(format!("job {job_id}: {e}")))?;
        self.pages += plan.pages;
        self.runs += plan.runs.len() as u64;
        match &mut self.backend {
            Backend::Host(host) => {
                let started = Instant::now();
                let host: Vec<(usize, usize)> =
                    host.iter().map(|b| (b.ptr as usize, b.len)).collect();
                py.detach(|| copy(&plan, &host, store));
                self.finished
                    .push((job_id, true, plan.bytes, started.elapsed().as_secs_f64()));
                let _ = stream;
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(t) => lock(t)
                .submit(store, job_id, &plan, stream)
                .map_err(device_error),
        }
    }
}

/// Runs a checked plan's copies. `host[t]` is tensor `t`'s host buffer as (address, length).
fn copy(plan: &Plan, host: &[(usize, usize)], store: bool) {
    for run in &plan.runs {
        let (base, len) = host[run.tensor];
        assert!(
            run.host + run.bytes <= len as u64,
            "a planned run past its host buffer"
        );
        let host_at = (base + run.host as usize) as *mut u8;
        let device_at = run.device as usize as *mut u8;
        // SAFETY: the plan checked that each run's device range is inside a registered array
        // (kept alive by the tier), and the host range is inside the tier's own buffer (asserted
        // above). The two never overlap: one is the tier's allocation, the other the caller's.
        unsafe {
            if store {
                std::ptr::copy_nonoverlapping(device_at, host_at, run.bytes as usize);
            } else {
                std::ptr::copy_nonoverlapping(host_at, device_at, run.bytes as usize);
            }
        }
    }
}
