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

/// Each fault seed draws its own refusals on each tier, and the two tiers of one seed draw
/// apart: seeds that differ only in the bits of a tier's salt must not collapse into one
/// sequence (a campaign's seeds would then explore fewer fault patterns than they claim). (A
/// tier of one seed may draw as the other tier of another seed: the salts are xored in.)
#[test]
fn every_fault_seed_draws_its_own_refusals_on_each_tier() {
    let mut dev = crate::cpu_device::InOrderDevice::new();
    let layout = crate::Config::preset("sim-small")
        .expect("preset")
        .layout()
        .expect("a layout");
    let mut pools = Pools::new(&mut dev, layout, Mutants::none()).expect("pools");
    // 64 one-page allocations, freed at once: which were refused.
    let pattern = |a: &mut PageAllocator| -> u64 {
        (0..64).fold(0u64, |bits, i| match a.alloc(1) {
            Some(p) => {
                a.free(&p);
                bits
            }
            None => bits | 1 << i,
        })
    };
    let seeds = [0u64, 1, 4, 5, 0x10, 0x40, 0x80, 0xD0, 0xD5, 0x1_0000];
    let mut seen = std::collections::BTreeMap::new();
    for seed in seeds {
        pools.inject(EngineFaults {
            seed,
            device_pages_refused_rate: 0.5,
            host_pages_refused_rate: 0.5,
        });
        let (d, h) = (
            pattern(&mut pools.device_pages),
            pattern(&mut pools.host_pages),
        );
        assert_ne!(d, h, "seed {seed:#x}: both tiers drew the same refusals");
        for (tier, bits) in [("device", d), ("host", h)] {
            if let Some(other) = seen.insert((tier, bits), seed) {
                panic!("the {tier} tier of seed {seed:#x} drew as that of seed {other:#x}");
            }
        }
    }
}
