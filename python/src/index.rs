//! `tierkv._core.OffloadIndex`: the engine's [`OffloadIndex`] with Python's types (keys are
//! `bytes`, chunk numbers `int`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tierkv_engine::config::WritePolicy;
use tierkv_engine::offload::{Lookup, OffloadIndex};

use crate::OffloadError;

fn refused(e: tierkv_engine::offload::OffloadError) -> PyErr {
    OffloadError::new_err(e.to_string())
}

/// The host tier's index: `chunks` host chunks keyed by the server's block keys.
///
/// `write_policy` is `"write_through"` (store every offered block) or
/// `"write_through_selective"` (store a block on its second offer); `events` keeps the
/// events `take_events` returns.
#[pyclass(module = "tierkv._core", name = "OffloadIndex")]
pub struct PyOffloadIndex {
    inner: OffloadIndex,
}

fn key_list<'a>(keys: &'a [Bound<'a, PyBytes>]) -> Vec<&'a [u8]> {
    keys.iter().map(|k| k.as_bytes()).collect()
}

fn bytes_list<'py>(py: Python<'py>, keys: &[Box<[u8]>]) -> Vec<Bound<'py, PyBytes>> {
    keys.iter().map(|k| PyBytes::new(py, k)).collect()
}

#[pymethods]
impl PyOffloadIndex {
    #[new]
    #[pyo3(signature = (chunks, write_policy = "write_through", events = false))]
    fn new(chunks: u64, write_policy: &str, events: bool) -> PyResult<Self> {
        let policy = WritePolicy::ALL
            .into_iter()
            .find(|p| p.name() == write_policy)
            .ok_or_else(|| {
                OffloadError::new_err(format!(
                "offload index: unknown write policy {write_policy:?}: expected write_through or \
                 write_through_selective"
            ))
            })?;
        Ok(PyOffloadIndex {
            inner: OffloadIndex::new(chunks, policy, events).map_err(refused)?,
        })
    }

    /// `"miss"`, `"hit"` (stored, loadable) or `"pending"` (its store not completed).
    fn lookup(&self, key: &Bound<'_, PyBytes>) -> &'static str {
        match self.inner.lookup(key.as_bytes()) {
            Lookup::Miss => "miss",
            Lookup::Hit => "hit",
            Lookup::Pending => "pending",
        }
    }

    /// Pins the keys' chunks for a load and returns them in order.
    fn prepare_load(&mut self, keys: Vec<Bound<'_, PyBytes>>) -> PyResult<Vec<u32>> {
        self.inner.prepare_load(&key_list(&keys)).map_err(refused)
    }

    fn complete_load(&mut self, keys: Vec<Bound<'_, PyBytes>>) -> PyResult<()> {
        self.inner.complete_load(&key_list(&keys)).map_err(refused)
    }

    /// `None` when not enough chunks can be freed; else `(keys to store, their chunks, evicted
    /// keys)`.
    #[allow(clippy::type_complexity)]
    fn prepare_store<'py>(
        &mut self,
        py: Python<'py>,
        keys: Vec<Bound<'py, PyBytes>>,
    ) -> PyResult<Option<(Vec<Bound<'py, PyBytes>>, Vec<u32>, Vec<Bound<'py, PyBytes>>)>> {
        let store = self
            .inner
            .prepare_store(&key_list(&keys))
            .map_err(refused)?;
        Ok(store.map(|s| {
            (
                bytes_list(py, &s.keys),
                s.chunks,
                bytes_list(py, &s.evicted),
            )
        }))
    }

    #[pyo3(signature = (keys, success = true))]
    fn complete_store(&mut self, keys: Vec<Bound<'_, PyBytes>>, success: bool) -> PyResult<()> {
        self.inner
            .complete_store(&key_list(&keys), success)
            .map_err(refused)
    }

    fn reset(&mut self) {
        self.inner.reset();
    }

    /// The events since the last call: `(keys, removed, store_failed)` each.
    fn take_events<'py>(&mut self, py: Python<'py>) -> Vec<(Vec<Bound<'py, PyBytes>>, bool, bool)> {
        let events = self.inner.take_events();
        events
            .into_iter()
            .map(|e| (bytes_list(py, &e.keys), e.removed, e.store_failed))
            .collect()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    #[getter]
    fn pending(&self) -> u32 {
        self.inner.pending()
    }

    #[getter]
    fn evictable(&self) -> usize {
        self.inner.evictable()
    }

    #[getter]
    fn free_chunks(&self) -> u64 {
        self.inner.free_chunks()
    }

    #[getter]
    fn write_policy(&self) -> &'static str {
        self.inner.policy().name()
    }

    /// Checks the index's internal structures against each other. A disagreement is a bug in
    /// tierkv: the call raises pyo3's `PanicException` naming it.
    fn check_invariants(&self) {
        self.inner.check_invariants();
    }
}
