//! Unit tests of the driver seam's helpers.

use super::destinations_apart;

#[test]
fn only_lists_whose_destinations_overlap_nothing_may_run_in_any_order() {
    // [dst, src, bytes] triples.
    assert!(destinations_apart(&[0, 1000, 16, 16, 1016, 16]));
    // Two sources may overlap (both only read).
    assert!(destinations_apart(&[0, 1000, 32, 100, 1016, 32]));
    // Two destinations overlap.
    assert!(!destinations_apart(&[0, 1000, 32, 16, 2000, 32]));
    // A destination overlaps another copy's source (order would matter).
    assert!(!destinations_apart(&[0, 1000, 32, 2000, 16, 32]));
    // A copy onto its own source.
    assert!(!destinations_apart(&[0, 16, 32]));
    // Adjacent ranges touch but do not overlap; empty copies are ignored.
    assert!(destinations_apart(&[0, 100, 16, 16, 116, 16, 5, 5, 0]));
}
