//! `tierkv._core`: the Python module. It binds two parts of tierkv-engine for a server's
//! offloading interface (vLLM's, through the Python package's `tierkv.vllm`):
//! - `index::PyOffloadIndex`: the host tier's index keyed by the server's block keys
//!   (`tierkv_engine::offload::OffloadIndex`), for the scheduler side;
//! - `host::HostTier`: host chunks of the registered caches and the copies of a job's plan
//!   (`tierkv_engine::offload::plan`), for the worker side: between host arrays, or (feature
//!   `cuda`) between GPU caches and pinned host chunks on the GPU's copy streams
//!   (`tierkv_engine::offload::transfer`).
//!
//! - `ops`: the indexer's kernels as array ops over DLPack arrays (`tierkv.ops`): the CPU
//!   references on host arrays, the CUDA kernels (feature `cuda`, `gpu`) on GPU arrays.
//!
//! Refusals are Python exceptions derived from `ValueError`: `OffloadError` (the index),
//! `RegisterError` (a registration), `PlanError` (a job), `OpError` (an op's arguments;
//! `DeviceIndexError`, an index entry refused on the GPU), and `HostMemoryError` (host memory
//! not allocated, a `MemoryError`). Each names what was wrong.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod dlpack;
#[cfg(feature = "cuda")]
mod gpu;
mod host;
mod index;
mod ops;

create_exception!(
    _core,
    OffloadError,
    PyValueError,
    "A call the offload index refused."
);
create_exception!(
    _core,
    RegisterError,
    PyValueError,
    "A registration of caches refused."
);
create_exception!(
    _core,
    PlanError,
    PyValueError,
    "A transfer job refused before any copy."
);
create_exception!(
    _core,
    OpError,
    PyValueError,
    "An op refused its arguments before running."
);
create_exception!(
    _core,
    DeviceIndexError,
    OpError,
    "An index entry a guard kernel refused on the GPU (reported after the op ran)."
);
create_exception!(
    _core,
    HostMemoryError,
    pyo3::exceptions::PyMemoryError,
    "The host tier's memory could not be allocated."
);

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // What this build can do: "host" copies between host arrays; "cuda" between GPU caches and
    // pinned host chunks.
    let mut backends = vec!["host"];
    if cfg!(feature = "cuda") {
        backends.push("cuda");
    }
    m.add("BACKENDS", backends)?;
    m.add("OffloadError", py.get_type::<OffloadError>())?;
    m.add("RegisterError", py.get_type::<RegisterError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("HostMemoryError", py.get_type::<HostMemoryError>())?;
    m.add("OpError", py.get_type::<OpError>())?;
    m.add("DeviceIndexError", py.get_type::<DeviceIndexError>())?;
    m.add_function(wrap_pyfunction!(ops::ops_index_k_store, m)?)?;
    m.add_function(wrap_pyfunction!(ops::ops_paged_mqa_logits, m)?)?;
    m.add_function(wrap_pyfunction!(ops::ops_topk, m)?)?;
    m.add_function(wrap_pyfunction!(ops::ops_copy_pages, m)?)?;
    m.add_function(wrap_pyfunction!(ops::ops_take_refusal, m)?)?;
    m.add("KEY_BYTES_MAX", tierkv_engine::offload::KEY_BYTES_MAX)?;
    m.add(
        "HOST_BYTES_MAX",
        tierkv_engine::offload::plan::HOST_BYTES_MAX,
    )?;
    m.add("FORMATS", tierkv_engine::offload::plan::format_names())?;
    m.add_class::<index::PyOffloadIndex>()?;
    m.add_class::<host::HostTier>()?;
    Ok(())
}
