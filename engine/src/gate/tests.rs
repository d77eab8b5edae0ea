use super::*;
use crate::cpu_device::InOrderDevice;

/// A layer's gate makes the compute stream wait for each of its loads' events, in order, once
/// (whichever pool is asked for first), before it hands out a proof for either pool.
#[test]
fn a_gate_waits_for_each_event_once_before_either_pool() {
    let mut dev = InOrderDevice::new();
    let events = [dev.new_event().unwrap(), dev.new_event().unwrap()];
    let want = [
        (StreamKind::Compute, events[0]),
        (StreamKind::Compute, events[1]),
    ];
    let mut gate = LayerGate::new(LayerId(3), &events, Mutants::none());
    let ik = gate.index_k(&mut dev).unwrap();
    assert_eq!((ik.kind(), ik.layer()), (BufferKind::IndexK, LayerId(3)));
    assert_eq!(dev.waits, want);
    let kv = gate.kv(&mut dev).unwrap();
    assert_eq!((kv.kind(), kv.layer()), (BufferKind::Kv, LayerId(3)));
    assert_eq!(dev.waits, want, "waited once");
    let mut gate = LayerGate::new(LayerId(0), &events, Mutants::none());
    gate.kv(&mut dev).unwrap();
    assert_eq!(dev.waits[2..], want, "the KV pool first");
}

/// With no load, nothing is waited for.
#[test]
fn a_gate_without_loads_waits_for_nothing() {
    let mut dev = InOrderDevice::new();
    let mut gate = LayerGate::new(LayerId(0), &[], Mutants::none());
    gate.index_k(&mut dev).unwrap();
    gate.kv(&mut dev).unwrap();
    assert!(dev.waits.is_empty());
}
