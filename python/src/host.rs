//! `tierkv._core.HostTier`: the worker side's host chunks and copies, in host memory.
//!
//! The registered caches are arrays exporting `__array_interface__` (numpy arrays, CPU torch
//! tensors through `.numpy()`): two-dimensional, one-byte elements, rows of `page_bytes` at a
//! row stride of at least that, writable. The tier keeps a reference to each, so their memory
//! outlives it. Every address a job names is checked by the plan to be the start of a page of a
//! registered array before anything is copied; so no job can make this code touch memory
//! outside the arrays it was given and its own host buffers.
//!
//! Copies run on the calling thread (without the GIL) when a job is submitted; a job's result is
//! handed out by the next `get_finished`. Arrays in GPU memory (`__cuda_array_interface__`) are
//! refused: this build has no CUDA backend yet.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::time::Instant;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use tierkv_engine::offload::plan::{
    parse_format, CacheTensor, Group, Job, LayerRef, Plan, Registration,
};

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

/// The host tier of a worker: host chunks for each registered cache array, and the copies of
/// each job between them.
#[pyclass(module = "tierkv._core")]
pub struct HostTier {
    registration: Registration,
    /// The cache arrays, kept alive for the addresses registered from them.
    _arrays: Vec<Py<PyAny>>,
    host: Vec<HostBuffer>,
    finished: Vec<Finished>,
    pages: u64,
    runs: u64,
}

/// What `__array_interface__` says of a cache array: `(address, blocks, page_bytes, stride)`.
fn array_of(i: usize, array: &Bound<'_, PyAny>) -> PyResult<CacheTensor> {
    let refuse = |what: String| RegisterError::new_err(format!("cache tensor {i}: {what}"));
    let Ok(face) = array.getattr("__array_interface__") else {
        if array.hasattr("__cuda_array_interface__")? {
            return Err(refuse("it is in GPU memory, and this build of tierkv copies host memory only (no CUDA backend yet)".into()));
        }
        return Err(refuse(
            "it exports no __array_interface__ (give a numpy array or a CPU tensor's .numpy())"
                .into(),
        ));
    };
    let face = face
        .cast_into::<PyDict>()
        .map_err(|_| refuse("__array_interface__ is not a dict".into()))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        face.get_item(k)?
            .ok_or_else(|| refuse(format!("__array_interface__ has no {k:?}")))
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
        .map_err(|_| refuse("__array_interface__'s data is not (address, read_only)".into()))?;
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
    Ok(CacheTensor {
        base,
        blocks,
        page_bytes,
        stride,
    })
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
    #[new]
    fn new(
        caches: Vec<Bound<'_, PyAny>>,
        groups: Vec<(u64, Vec<(usize, u64)>)>,
        formats: Vec<String>,
        blocks_per_chunk: u64,
        chunks: u64,
    ) -> PyResult<Self> {
        let register =
            |e: tierkv_engine::offload::plan::RegisterError| RegisterError::new_err(e.to_string());
        let tensors = caches
            .iter()
            .enumerate()
            .map(|(i, a)| array_of(i, a))
            .collect::<PyResult<Vec<_>>>()?;
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
        let registration = Registration::new(tensors, groups, &formats, blocks_per_chunk, chunks)
            .map_err(register)?;
        let host = (0..registration.tensors().len())
            .map(|t| HostBuffer::new(registration.host_bytes(t), t))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(HostTier {
            registration,
            _arrays: caches.into_iter().map(Bound::unbind).collect(),
            host,
            finished: Vec::new(),
            pages: 0,
            runs: 0,
        })
    }

    /// Copies a job's device pages into host chunks (device → host). The arguments are vLLM's
    /// `DevicePointers` (`ptrs`, `sizes` as uint64 bytes, and the three per-group tuples) and the
    /// host chunk numbers (uint64 bytes). Raises `PlanError` (nothing copied) for a job outside
    /// the registration.
    #[allow(clippy::too_many_arguments)]
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
    ) -> PyResult<()> {
        self.transfer(
            py,
            true,
            job_id,
            ptrs,
            sizes,
            (group_blocks, group_refs, block_indices),
            chunks,
        )
    }

    /// The other way: host chunks into device pages (host → device).
    #[allow(clippy::too_many_arguments)]
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
    ) -> PyResult<()> {
        self.transfer(
            py,
            false,
            job_id,
            ptrs,
            sizes,
            (group_blocks, group_refs, block_indices),
            chunks,
        )
    }

    /// The jobs done since the last call, in submission order: `(job_id, success, bytes,
    /// seconds)`.
    fn get_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Returns when the named jobs are done (at once here: copies run at submission).
    fn wait(&self, job_ids: Vec<u64>) {
        let _ = job_ids;
    }

    /// The bytes of host chunk `chunk` of cache `tensor` (for tests and debugging).
    fn read_host<'py>(
        &self,
        py: Python<'py>,
        tensor: usize,
        chunk: u64,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        if tensor >= self.host.len() || chunk >= self.registration.chunks() {
            return Err(PlanError::new_err(format!(
                "read_host: chunk {chunk} of cache {tensor} does not exist ({} caches, {} chunks)",
                self.host.len(),
                self.registration.chunks()
            )));
        }
        let n = self.registration.chunk_bytes(tensor) as usize;
        let at = chunk as usize * n;
        // SAFETY: `at + n` is within the buffer (chunk < chunks, buffer = chunks * n).
        let bytes = unsafe { std::slice::from_raw_parts(self.host[tensor].ptr.add(at), n) };
        Ok(pyo3::types::PyBytes::new(py, bytes))
    }

    /// Host bytes held in all.
    #[getter]
    fn host_bytes(&self) -> u64 {
        self.host.iter().map(|b| b.len as u64).sum()
    }

    /// Page copies asked for, and the runs they were coalesced into, since construction.
    #[getter]
    fn copies(&self) -> (u64, u64) {
        (self.pages, self.runs)
    }
}

impl HostTier {
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        py: Python<'_>,
        store: bool,
        job_id: u64,
        ptrs: &[u8],
        sizes: &[u8],
        groups: (Vec<u64>, Vec<u64>, Vec<u64>),
        chunks: &[u8],
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
        let started = Instant::now();
        let host: Vec<(usize, usize)> = self.host.iter().map(|b| (b.ptr as usize, b.len)).collect();
        py.detach(|| copy(&plan, &host, store));
        self.pages += plan.pages;
        self.runs += plan.runs.len() as u64;
        self.finished
            .push((job_id, true, plan.bytes, started.elapsed().as_secs_f64()));
        Ok(())
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
