//! Layout bugs planted in the layout module (feature `mutants`), which every reference kernel
//! goes through and so agrees with: the specification, with byte formats of its own, refuses
//! what they write.

use crate::naive;
use half::bf16;
use tierkv_kernels::cpu;
use tierkv_kernels::layout::*;
use tierkv_kernels::mutants::{set, KernelMutant};

/// Switches a planted bug on for the closure's length.
fn planted<T>(m: KernelMutant, f: impl FnOnce() -> T) -> T {
    set(Some(m));
    let out = f();
    set(None);
    out
}

/// fp8 index-K pages written with the scales first: the references read them back as they
/// wrote them, and the specification refuses the store.
#[test]
fn scales_placed_first_are_refused() {
    let keys: Vec<bf16> = (0..3 * 128)
        .map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 17.0))
        .collect();
    let (gamma, beta) = (vec![1.0f32; 128], vec![0.0f32; 128]);
    let rope: Vec<f32> = (0..3)
        .flat_map(|_| [[1.0f32; 32], [0.0; 32]].concat())
        .collect();
    let slots = [0, 5, 70];
    let fmt = PageFormat::IndexK(IndexKDtype::Fp8);
    let before = vec![0x11u8; 2 * fmt.page_bytes() as usize];
    let a = tierkv_kernels::args::IndexKStore {
        dtype: IndexKDtype::Fp8,
        ue8m0: false,
        slots: (&slots[..]).into(),
    };
    let x = cpu::IndexKStoreInputs {
        keys: &keys,
        gamma: &gamma,
        beta: &beta,
        rope: &rope,
    };
    let store = |bug: Option<KernelMutant>| {
        let mut page = before.clone();
        let mut run = || cpu::index_k_store(&a, &x, &mut page, fmt.fingerprint()).unwrap();
        match bug {
            Some(m) => planted(m, &mut run),
            None => run(),
        }
        page
    };
    let clean = store(None);
    assert_eq!(naive::check_index_k_store(&a, &x, &before, &clean), Ok(()));
    let swapped = store(Some(KernelMutant::IndexKScalesFirst));
    assert_ne!(clean, swapped, "the planted layout moved the bytes");
    let verdict = naive::check_index_k_store(&a, &x, &before, &swapped);
    assert!(
        verdict.is_err(),
        "the specification took scales-first pages"
    );
}

/// A host mirror whose pages are placed in the other order: the references' copy through the
/// layout's views disagrees with the specification's placement.
#[test]
fn host_pages_in_the_other_order_are_refused() {
    for order in HostLayout::ALL {
        let l = Layout::new(LayoutParams {
            layers: 3,
            layer_base: 0,
            index_n_heads: 1,
            index_k_dtype: IndexKDtype::Fp8,
            kv_dtype: KvDtype::Fp8Packed,
            device_pages: 4,
            host_pages: 6,
            host_layout: order,
        })
        .unwrap();
        let kind = BufferKind::Kv;
        let dev: Vec<u8> = (0..l.device_layer_bytes(kind).0)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let runs = coalesce_runs(&[(PageId(1), PageId(4)), (PageId(2), PageId(0))]);
        let copy = |bug: bool| {
            let mut host = vec![0u8; l.host_bytes(kind).usize()];
            let mut run = || {
                let view = l.host_layer_view(kind, LayerId(1));
                cpu::page_copy(&dev, &l.device_layer_view(kind), &mut host, &view, &runs).unwrap()
            };
            if bug {
                planted(KernelMutant::HostOrderSwapped, &mut run)
            } else {
                run()
            }
            host
        };
        let mut want = vec![0u8; l.host_bytes(kind).usize()];
        let to = naive::format::Placement::Host {
            order,
            layers: 3,
            pages: 6,
            layer: 1,
        };
        let spec_runs: Vec<naive::Run> = runs
            .iter()
            .map(|r| naive::Run {
                src: r.src.0,
                dst: r.dst.0,
                count: r.count,
            })
            .collect();
        let pb = naive::format::kv_page_bytes(KvDtype::Fp8Packed);
        naive::page_copy(
            &dev,
            naive::format::Placement::Device,
            &mut want,
            to,
            pb,
            &spec_runs,
        );
        assert!(
            copy(false) == want,
            "{order:?}: the clean layout places pages as specified"
        );
        assert!(
            copy(true) != want,
            "{order:?}: the swapped order went unseen"
        );
    }
}
