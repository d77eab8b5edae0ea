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

/// A copy's destination side as the copy sees it: as it is on the clean engine; with mutant 4
/// (or 1), with the source's item size over the destination's own pages.
#[test]
fn a_copy_sees_its_destination_as_it_is_unless_a_mutant_trusts_the_source() {
    use crate::layout::{KvDtype, PageFormat};
    let side = |buffer, dtype: KvDtype, stride| PoolSide {
        buffer: BufferId(buffer),
        view: PagedView {
            base: 0,
            page_stride: stride,
            pages: 4,
            fingerprint: PageFormat::Kv(dtype).fingerprint(),
        },
    };
    let src = side(0, KvDtype::Fp8Packed, 1 << 16);
    let dst = side(1, KvDtype::Fp8Unpacked, 1 << 15);
    assert_eq!(dst.as_copied_from(&src, Mutants::none()), dst);
    #[cfg(feature = "mutants")]
    {
        use crate::mutants::Mutant;
        let trusted = dst.as_copied_from(&src, Mutants::only(Mutant::HostKvRow576));
        let want = PagedView {
            fingerprint: src.view.fingerprint,
            ..dst.view
        };
        assert_eq!((trusted.buffer, trusted.view), (dst.buffer, want));
    }
}
