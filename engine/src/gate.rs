//! The layer gate: the one accessor through which the model step reaches a layer's KV and index-K
//! buffers. Before the compute stream touches layer `l`, the gate makes it wait for layer `l`'s
//! event of every load the batch depends on. There is no other read path: the model step gets
//! pool buffers only from [`LayerGate::index_k`] and [`LayerGate::kv`] (a test in `tests/it`
//! checks that the pools' buffer accessor is named nowhere else).

use crate::device::{BufferId, Clock, Device, StreamKind};
use crate::engine::Engine;
use crate::layout::{BufferKind, LayerId};
use crate::mutants::Mutant;
use crate::transfer::Transfer;

pub(crate) struct LayerGate {
    layer: usize,
    loads: Vec<u64>,
    waited: bool,
}

impl LayerGate {
    /// The gate of local layer `layer` for a batch that depends on `loads`.
    pub(crate) fn new(layer: usize, loads: Vec<u64>) -> Self {
        LayerGate {
            layer,
            loads,
            waited: false,
        }
    }

    fn ensure<D: Device, C: Clock, T: Transfer>(&mut self, eng: &mut Engine<D, C, T>) {
        if self.waited {
            return;
        }
        self.waited = true;
        let layers = eng.layout.layers() as usize;
        for &load in &self.loads {
            let index = if eng.mutants.on(Mutant::GlobalLayerCounter) {
                // The bug: the counter is indexed by the global layer id; past the local range it
                // reads as "already loaded".
                self.layer + eng.cfg.model.layer_base as usize
            } else {
                self.layer
            };
            if index < layers {
                let ev = eng.load_layer_event(load, index);
                eng.dev.wait(StreamKind::Compute, ev);
            }
        }
    }

    /// The layer's index-K pool, after the wait.
    pub(crate) fn index_k<D: Device, C: Clock, T: Transfer>(
        &mut self,
        eng: &mut Engine<D, C, T>,
    ) -> BufferId {
        if !eng.mutants.on(Mutant::UngatedIndexKRead) {
            self.ensure(eng);
        }
        eng.pools
            .device_buffer(BufferKind::IndexK, LayerId(self.layer as u32))
    }

    /// The layer's KV pool, after the wait.
    pub(crate) fn kv<D: Device, C: Clock, T: Transfer>(
        &mut self,
        eng: &mut Engine<D, C, T>,
    ) -> BufferId {
        self.ensure(eng);
        eng.pools
            .device_buffer(BufferKind::Kv, LayerId(self.layer as u32))
    }
}
