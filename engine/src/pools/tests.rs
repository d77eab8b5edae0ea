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
