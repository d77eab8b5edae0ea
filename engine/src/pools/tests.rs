use super::*;

/// An allocator that refuses every allocation still gives zero pages (there is nothing to
/// refuse), and gives pages again once refusals stop.
#[test]
fn refusals_never_refuse_zero_pages() {
    let mut a = PageAllocator::new(4);
    a.refuse(7, 1.0, Probe::FaultHostPagesRefused);
    assert_eq!(a.alloc(0), Some(Vec::new()));
    assert_eq!(a.alloc(1), None);
    assert_eq!(a.free_count(), 4);
    a.refuse(7, 0.0, Probe::FaultHostPagesRefused);
    assert_eq!(a.alloc(1).map(|p| p.len()), Some(1));
    assert_eq!(a.alloc(4), None, "3 free");
}

/// A copy's destination side as the copy sees it (the mutants build): as it is on the clean
/// engine, even between pools of two formats; with mutant 4, with the source's item size over
/// the destination's own pages. The pools are mutant 4's: its host mirror unpacks the device's
/// packed fp8 KV rows.
#[cfg(feature = "mutants")]
#[test]
fn a_copy_sees_its_destination_as_it_is_unless_a_mutant_trusts_the_source() {
    use crate::layout::KvDtype;
    use crate::mutants::Mutant;
    let mut cfg = crate::Config::preset("sim-small").expect("preset");
    cfg.model.kv_dtype = KvDtype::Fp8Packed;
    let layout = cfg.layout().expect("a layout");
    let mutant = Mutants::only(Mutant::HostKvRow576);
    let mut dev = crate::cpu_device::InOrderDevice::new();
    let pools = Pools::new(&mut dev, layout, mutant).expect("pools");
    let (src, dst) = (
        pools.device_side(BufferKind::Kv, LayerId(0)),
        pools.host_side(BufferKind::Kv, LayerId(0)),
    );
    assert_ne!(src.view.fingerprint, dst.view.fingerprint, "two formats");
    assert_eq!(dst.as_copied_from(&src, Mutants::none()), dst);
    let trusted = dst.as_copied_from(&src, mutant);
    let want = PagedView {
        fingerprint: src.view.fingerprint,
        ..dst.view
    };
    assert_eq!((trusted.buffer, trusted.view), (dst.buffer, want));
}
