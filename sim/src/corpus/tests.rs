use super::*;
use crate::schedule::{branch_index, is_branch};
use crate::schedule::{Decider, Kind, Source};

fn probes(names: &[&'static str]) -> BTreeMap<&'static str, u64> {
    names.iter().map(|&n| (n, 1)).collect()
}

/// A probe is kept at its first hit's prefix while it is rare; a common probe once; a failing
/// run's probes are counted but never kept.
#[test]
fn rare_probes_keep_their_prefix() {
    let mut c = Corpus::new("swarm");
    let walk = Policy::RandomWalk;
    let decisions = [1, 2, 3, 4, 5];
    let first: BTreeMap<&'static str, u64> = [("a", 2), ("b", 5)].into_iter().collect();
    assert_eq!(
        c.observe(7, walk, &decisions, &probes(&["a", "b"]), &first, false),
        2
    );
    let a = c.checkpoints.iter().find(|k| k.probe == "a").unwrap();
    assert_eq!((a.seed, a.prefix.as_slice()), (7, &[1, 2][..]));
    // "a" is now hit by every run counted: not rare, not kept again.
    for _ in 0..30 {
        c.observe(8, walk, &decisions, &probes(&["a"]), &first, false);
    }
    assert_eq!(c.checkpoints.iter().filter(|k| k.probe == "a").count(), 1);
    // "b" was hit by 1 run of 31: under 5%, kept again, up to PER_PROBE_MAX.
    for _ in 0..10 {
        c.observe(9, walk, &decisions, &probes(&["b"]), &first, false);
    }
    let b = c.checkpoints.iter().filter(|k| k.probe == "b").count();
    assert!((2..=PER_PROBE_MAX).contains(&b), "{b} checkpoints of b");
    assert_eq!(
        c.observe(9, walk, &decisions, &probes(&["z"]), &first, true),
        0
    );
    assert_eq!(c.seen["z"], 1);
    assert_eq!(c.runs, 42);
}

/// The least-branched checkpoint first, the rarest probe's among equals.
#[test]
fn pick_spreads_branches_rarest_first() {
    let mut c = Corpus::new("swarm");
    let walk = Policy::RandomWalk;
    let first = BTreeMap::new();
    c.observe(1, walk, &[], &probes(&["common", "rare"]), &first, false);
    for _ in 0..3 {
        c.observe(2, walk, &[], &probes(&["common"]), &first, false);
    }
    let order: Vec<String> = (0..4).map(|_| c.pick().unwrap().probe).collect();
    assert_eq!(order, ["rare", "common", "rare", "common"]);
    assert!(Corpus::new("swarm").pick().is_none());
}

/// A branch replays its prefix, then draws: its decisions after the prefix are those of the
/// same schedule drawn from the start only by chance.
#[test]
fn a_branch_replays_its_prefix_then_draws() {
    let walk = Policy::RandomWalk;
    let mut full = Decider::new(
        3,
        Source::Draw {
            index: 0,
            policy: walk,
        },
        0,
    );
    let drawn: Vec<u8> = (0..200).map(|_| full.point(Kind::Callback, 1)).collect();
    let prefix = drawn[..50].to_vec();
    let source = Source::Branch {
        prefix: prefix.clone(),
        index: branch_index(0),
        policy: walk,
    };
    let mut b = Decider::new(3, source, 0);
    let branched: Vec<u8> = (0..200).map(|_| b.point(Kind::Callback, 1)).collect();
    assert_eq!(branched[..50], prefix[..]);
    assert_ne!(branched[50..], drawn[50..]);
    assert!(is_branch(branch_index(u64::MAX)));
    assert!(!is_branch(crate::campaign::SCHEDULES_MAX - 1));
}

/// A corpus file round-trips; every bad field is refused with what was wrong.
#[test]
fn corpus_files_are_checked() {
    let mut c = Corpus::new("swarm");
    let first: BTreeMap<&'static str, u64> = [("a", 1)].into_iter().collect();
    c.observe(
        5,
        Policy::RandomWalk,
        &[3, 4],
        &probes(&["a"]),
        &first,
        false,
    );
    assert_eq!(Corpus::parse(&c.to_json()), Ok(c.clone()));
    let bad = |edit: &dyn Fn(&mut Corpus)| {
        let mut b = c.clone();
        edit(&mut b);
        Corpus::parse(&b.to_json()).unwrap_err()
    };
    assert_eq!(bad(&|b| b.format = 9), CorpusError::OtherFormat(9));
    assert!(matches!(
        bad(&|b| b.checkpoints[0].prefix[0] = 200),
        CorpusError::Checkpoint { at: 0, .. }
    ));
    assert!(matches!(
        bad(&|b| b.checkpoints[0].probe = "q".into()),
        CorpusError::Checkpoint { .. }
    ));
    assert!(matches!(
        bad(&|b| b.runs = 0),
        CorpusError::SeenPastRuns { .. }
    ));
    assert!(matches!(Corpus::parse("{"), Err(CorpusError::NotJson(_))));
    let mut other = Corpus::new("pd");
    assert!(matches!(
        other.merge(&c),
        Err(CorpusError::OtherProfile { .. })
    ));
}

/// Merging adds the counts and keeps each checkpoint once.
#[test]
fn merge_adds_counts_and_dedupes() {
    let first: BTreeMap<&'static str, u64> = [("a", 1)].into_iter().collect();
    let mut x = Corpus::new("swarm");
    x.observe(
        5,
        Policy::RandomWalk,
        &[3, 4],
        &probes(&["a"]),
        &first,
        false,
    );
    let mut y = x.clone();
    y.observe(
        6,
        Policy::RandomWalk,
        &[1],
        &probes(&["a", "b"]),
        &first,
        false,
    );
    let mut m = x.clone();
    m.merge(&y).unwrap();
    assert_eq!(m.runs, 3);
    assert_eq!(m.seen["a"], 3);
    assert_eq!(m.checkpoints.len(), y.checkpoints.len());
}
