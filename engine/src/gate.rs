//! The layer gate: the one way the model step reaches a layer's KV and index-K buffers. Before
//! the compute stream touches layer `l`, the gate makes it wait for layer `l`'s event of every
//! load the batch depends on, and only then hands out a [`Gated`] value: the proof that the pools
//! ask for ([`crate::pools::Pools::gated`]). `Gated` has private fields and no constructor
//! outside this module, so no other read path can exist — the type system keeps the invariant
//! that every KV and index-K read waits for its layer's load.

use crate::device::{Device, DeviceError, EventId, StreamKind};
use crate::layout::{BufferKind, LayerId};
use crate::mutants::Mutants;

/// Proof that the compute stream waits for every load of layer `layer` before the work that
/// follows; only [`LayerGate`] makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gated {
    kind: BufferKind,
    layer: LayerId,
}

impl Gated {
    pub fn kind(&self) -> BufferKind {
        self.kind
    }
    pub fn layer(&self) -> LayerId {
        self.layer
    }
}

/// The gate of one local layer for one batch.
pub(crate) struct LayerGate<'a> {
    layer: usize,
    /// Per load the batch depends on: its event for each local layer.
    loads: &'a [Vec<EventId>],
    layer_base: u32,
    mutants: Mutants,
    waited: bool,
}

impl<'a> LayerGate<'a> {
    /// The gate of local layer `layer` for a batch that depends on `loads`.
    pub(crate) fn new(
        layer: usize,
        loads: &'a [Vec<EventId>],
        layer_base: u32,
        mutants: Mutants,
    ) -> Self {
        LayerGate {
            layer,
            loads,
            layer_base,
            mutants,
            waited: false,
        }
    }

    /// The compute stream waits for the layer's event of every load (once per gate).
    fn ensure<D: Device>(&mut self, dev: &mut D) -> Result<(), DeviceError> {
        if self.waited {
            return Ok(());
        }
        self.waited = true;
        for events in self.loads {
            // Past the local range the counter of mutant 7 reads as "already loaded".
            let index = self.mutants.gate_layer_index(self.layer, self.layer_base);
            if let Some(&ev) = events.get(index) {
                dev.wait(StreamKind::Compute, ev)?;
            }
        }
        Ok(())
    }

    fn gated(&self, kind: BufferKind) -> Gated {
        Gated {
            kind,
            layer: LayerId(self.layer as u32),
        }
    }

    /// The layer's index-K pool, after the wait.
    pub(crate) fn index_k<D: Device>(&mut self, dev: &mut D) -> Result<Gated, DeviceError> {
        if !self.mutants.index_k_read_ungated() {
            self.ensure(dev)?;
        }
        Ok(self.gated(BufferKind::IndexK))
    }

    /// The layer's KV pool, after the wait.
    pub(crate) fn kv<D: Device>(&mut self, dev: &mut D) -> Result<Gated, DeviceError> {
        self.ensure(dev)?;
        Ok(self.gated(BufferKind::Kv))
    }
}
