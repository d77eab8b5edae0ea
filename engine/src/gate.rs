//! The layer gate: the one way the model step reaches a layer's KV and index-K buffers. Before
//! the compute stream touches layer `l`, the gate makes it wait for layer `l`'s event of every
//! load the batch depends on, and only then hands out a [`Gated`] value: the proof that the pools
//! ask for ([`crate::pools::Pools::gated`]). `Gated` has private fields, no constructor outside
//! this module, is neither `Clone` nor `Copy`, and borrows its gate, so a proof cannot be made
//! without the waits nor outlive the layer it was made for.
//!
//! What the types cannot stop is a pool buffer id written by hand (`BufferId(n)`): outside the
//! devices, the engine never constructs one (a test in `engine/tests/it/architecture.rs` checks),
//! so the pools' `gated` and the controller's `PoolSide`s are the only sources of pool buffers.

use crate::device::{call_recovering, Device, DeviceError, EventId, StreamKind};
use crate::layout::{BufferKind, LayerId};
use crate::mutants::Mutants;
use std::marker::PhantomData;

/// Proof that the compute stream waits for every load of one layer before the work that follows;
/// only [`LayerGate`] makes one, and it lives no longer than its gate.
#[derive(Debug)]
pub struct Gated<'g> {
    kind: BufferKind,
    layer: LayerId,
    _gate: PhantomData<&'g ()>,
}

impl Gated<'_> {
    pub fn kind(&self) -> BufferKind {
        self.kind
    }
    pub fn layer(&self) -> LayerId {
        self.layer
    }
}

/// The gate of one local layer for one batch.
pub(crate) struct LayerGate<'a> {
    layer: LayerId,
    /// The layer's event of every load the batch depends on.
    events: &'a [EventId],
    mutants: Mutants,
    waited: bool,
}

impl<'a> LayerGate<'a> {
    /// The gate of local layer `layer` for a batch whose loads record `events` for it.
    pub(crate) fn new(layer: LayerId, events: &'a [EventId], mutants: Mutants) -> Self {
        LayerGate {
            layer,
            events,
            mutants,
            waited: false,
        }
    }

    /// The compute stream waits for every event (once per gate; a failed wait leaves the gate
    /// closed).
    fn ensure<D: Device>(&mut self, dev: &mut D) -> Result<(), DeviceError> {
        if self.waited {
            return Ok(());
        }
        for &ev in self.events {
            call_recovering(dev, |d| d.wait(StreamKind::Compute, ev))?;
        }
        self.waited = true;
        Ok(())
    }

    fn gated(&self, kind: BufferKind) -> Gated<'_> {
        Gated {
            kind,
            layer: self.layer,
            _gate: PhantomData,
        }
    }

    /// The layer's index-K pool, after the wait.
    pub(crate) fn index_k<D: Device>(&mut self, dev: &mut D) -> Result<Gated<'_>, DeviceError> {
        if !self.mutants.index_k_read_ungated() {
            self.ensure(dev)?;
        }
        Ok(self.gated(BufferKind::IndexK))
    }

    /// The layer's KV pool, after the wait.
    pub(crate) fn kv<D: Device>(&mut self, dev: &mut D) -> Result<Gated<'_>, DeviceError> {
        self.ensure(dev)?;
        Ok(self.gated(BufferKind::Kv))
    }
}

#[cfg(test)]
mod tests;
