//! The race detector's happens-before pairs (`targets`): an ordered conflicting access makes
//! one, a race or two reads make none, and a pair counts once a run.

use super::*;
use tierkv_engine::layout::Bytes;

fn who(entity: usize, epoch: u64, op: &'static str) -> Accessor {
    Accessor {
        entity,
        epoch,
        id: epoch,
        what: op.to_string(),
        op,
    }
}

fn pairs() -> Vec<&'static str> {
    (tierkv_engine::probe::take().into_keys())
        .filter(|n| n.starts_with("hb."))
        .collect()
}

#[test]
fn ordered_conflicts_make_pairs_and_races_and_reads_do_not() {
    let buf = BufferId(3);
    let range = ByteRange::new(buf, Bytes(0), Bytes(64));
    let mut d = RaceDetector::default();
    d.register(buf, 64, "device_kv");
    tierkv_engine::probe::take();
    // The load stream (1) writes; the compute stream (0) has seen it (its clock holds epoch 1).
    let mut vc: Vc = [0; ENTITIES];
    assert!(d
        .access(range, true, &vc, &who(1, 1, "page_copy"))
        .is_empty());
    vc[1] = 1;
    assert!(d
        .access(range, false, &vc, &who(0, 1, "sparse_read"))
        .is_empty());
    assert_eq!(
        pairs(),
        ["hb.device_kv.page_copy@load:w>sparse_read@compute:r"]
    );
    // Another read by the same stream: a read after a read is no pair; the write before it is
    // the same pair, already counted this run.
    assert!(d
        .access(range, false, &vc, &who(0, 2, "sparse_read"))
        .is_empty());
    assert!(pairs().is_empty());
    // The write stream (2) writes without having seen the reads: a race, and no pair.
    let unordered: Vc = [0; ENTITIES];
    let races = d.access(range, true, &unordered, &who(2, 1, "page_copy"));
    assert!(!races.is_empty());
    assert!(pairs().is_empty(), "a race is a finding, not a pair");
}
