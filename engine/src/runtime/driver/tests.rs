//! Unit tests of the driver seam's helpers.

use super::{destinations_apart, Mem, MemTable};

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

/// A table hands out ids from 0 up, reuses a freed id, answers each live id its allocation and
/// a freed one nothing, and drains what is still held.
#[test]
fn a_mem_table_reuses_freed_ids() {
    let mut t = MemTable::default();
    let ids: Vec<Mem> = ["a", "b", "c"].into_iter().map(|v| t.insert(v)).collect();
    assert_eq!(ids, [Mem(0), Mem(1), Mem(2)]);
    assert_eq!(t.take(Mem(1)), "b");
    assert_eq!(t.try_get(Mem(1)), None);
    assert_eq!(t.try_get(Mem(7)), None, "an id never handed out");
    assert_eq!(t.insert("d"), Mem(1), "the freed id again");
    assert_eq!(t.insert("e"), Mem(3));
    *t.get_mut(Mem(0)) = "a2";
    assert_eq!((*t.get(Mem(0)), t.try_get(Mem(1))), ("a2", Some(&"d")));
    let mut held: Vec<&str> = t.drain().collect();
    held.sort_unstable();
    assert_eq!(held, ["a2", "c", "d", "e"]);
    assert_eq!(t.insert("f"), Mem(0), "a drained table starts again");
}
