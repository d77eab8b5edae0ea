use super::*;
use crate::schedule::{branch_index, is_branch, Decider, Kind, Source};

fn probes(names: &[&'static str]) -> BTreeMap<&'static str, u64> {
    names.iter().map(|&n| (n, 1)).collect()
}

/// Every probe first hit at decision 1.
fn first_at_1(names: &[&'static str]) -> BTreeMap<&'static str, u64> {
    names.iter().map(|&n| (n, 1)).collect()
}

/// A corpus past its warm-up: `WARM_UP_RUNS` runs that hit probe "w" only.
fn warmed() -> Corpus {
    let mut c = Corpus::new("swarm");
    for _ in 0..WARM_UP_RUNS {
        let kept = c.observe(
            1,
            Policy::RandomWalk,
            &[0],
            &probes(&["w"]),
            &first_at_1(&["w"]),
            false,
        );
        assert_eq!(kept, 0, "nothing is kept during the warm-up");
    }
    c
}

/// After the warm-up a probe is kept at its first hit's prefix while it is rare, up to the
/// share; a common probe never; a failing run's probes are counted but never kept.
#[test]
fn rare_probes_keep_their_prefix() {
    let mut c = warmed();
    let walk = Policy::RandomWalk;
    let decisions = [1, 2, 3, 4, 5];
    let first: BTreeMap<&'static str, u64> = [("w", 1), ("b", 3)].into_iter().collect();
    assert_eq!(
        c.observe(7, walk, &decisions, &probes(&["w", "b"]), &first, false),
        1
    );
    let b = c.checkpoints.iter().find(|k| k.probe == "b").unwrap();
    assert_eq!(
        (b.seed, b.prefix.as_slice(), b.run_decisions),
        (7, &[1, 2, 3][..], 5)
    );
    // "b": 1 run of 21 (under 5%) kept again; 2 of 22 (over) not.
    assert_eq!(
        c.observe(8, walk, &decisions, &probes(&["b"]), &first, false),
        1
    );
    assert_eq!(
        c.observe(9, walk, &decisions, &probes(&["b"]), &first, false),
        0
    );
    assert_eq!(c.checkpoints.len(), 2);
    assert!(c.checkpoints.iter().all(|k| k.probe == "b"));
    let z = first_at_1(&["z"]);
    assert_eq!(c.observe(9, walk, &decisions, &probes(&["z"]), &z, true), 0);
    assert_eq!((c.seen["z"], c.seen["b"], c.runs), (1, 3, 24));
}

/// A run that reaches a kept checkpoint's probe at the same decision (a branch from it) adds
/// no checkpoint; up to `PER_PROBE_MAX` others of a rare probe are kept.
#[test]
fn a_checkpoint_is_kept_once_and_a_probe_at_most_per_probe_max_times() {
    let mut c = warmed();
    for _ in 0..80 {
        c.observe(
            1,
            Policy::RandomWalk,
            &[0],
            &probes(&["w"]),
            &first_at_1(&["w"]),
            false,
        );
    }
    let first = first_at_1(&["b"]);
    let b = probes(&["b"]);
    let walk = Policy::RandomWalk;
    assert_eq!(c.observe(7, walk, &[1, 2], &b, &first, false), 1);
    assert_eq!(
        c.observe(7, walk, &[1, 2], &b, &first, false),
        0,
        "the same checkpoint"
    );
    let kept: usize = (8..20)
        .map(|s| c.observe(s, walk, &[1, 2], &b, &first, false))
        .sum();
    assert_eq!(kept, PER_PROBE_MAX - 1, "{:?}", c.checkpoints);
}

/// The least-branched checkpoint first; of equals, the rarest probe's.
#[test]
fn pick_spreads_branches_rarest_first() {
    let mut c = warmed();
    let walk = Policy::RandomWalk;
    let both = ["r1", "r2"];
    c.observe(2, walk, &[0], &probes(&both), &first_at_1(&both), false);
    c.observe(3, walk, &[0], &probes(&["r2"]), &first_at_1(&["r2"]), false);
    // r1 hit once, r2 twice: r1's one checkpoint, then r2's two, then r1's again.
    let order: Vec<(String, u64)> = (0..4)
        .map(|_| c.pick().map(|k| (k.probe, k.seed)).unwrap())
        .collect();
    let want = [("r1", 2), ("r2", 2), ("r2", 3), ("r1", 2)];
    assert_eq!(order, want.map(|(p, s)| (p.to_string(), s)));
    assert!(Corpus::new("swarm").pick().is_none());
}

/// A branch replays its prefix, then draws as schedule `index` would from the start.
#[test]
fn a_branch_replays_its_prefix_then_draws() {
    let walk = Policy::RandomWalk;
    let index = branch_index(0);
    let mut own = Decider::new(
        3,
        Source::Draw {
            index,
            policy: walk,
        },
        0,
    );
    let drawn: Vec<u8> = (0..200).map(|_| own.point(Kind::Callback, 1)).collect();
    let prefix: Vec<u8> = (0..50).map(|i| (i % 11) as u8).collect();
    let source = Source::Branch {
        prefix: prefix.clone(),
        index,
        policy: walk,
    };
    let mut b = Decider::new(3, source, 0);
    let branched: Vec<u8> = (0..200).map(|_| b.point(Kind::Callback, 1)).collect();
    assert_eq!(branched[..50], prefix[..]);
    assert_eq!(branched[50..], drawn[..150]);
    assert!(is_branch(branch_index(u64::MAX)));
    assert!(!is_branch(crate::campaign::SCHEDULES_MAX - 1));
}

/// A corpus file round-trips; each bad field tried here is refused with what was wrong.
#[test]
fn corpus_files_are_checked() {
    let mut c = warmed();
    c.observe(
        5,
        Policy::RandomWalk,
        &[3, 4],
        &probes(&["a"]),
        &first_at_1(&["a"]),
        false,
    );
    assert_eq!(c.checkpoints.len(), 1);
    assert_eq!(Corpus::parse(&c.to_json()), Ok(c.clone()));
    let bad = |edit: &dyn Fn(&mut Corpus)| {
        let mut b = c.clone();
        edit(&mut b);
        Corpus::parse(&b.to_json()).unwrap_err()
    };
    assert_eq!(bad(&|b| b.format = 9), CorpusError::OtherFormat(9));
    let checkpoint = |e: CorpusError| matches!(e, CorpusError::Checkpoint { at: 0, .. });
    assert!(checkpoint(bad(&|b| b.checkpoints[0].prefix[0] = 200)));
    assert!(checkpoint(bad(&|b| b.checkpoints[0].probe = "q".into())));
    let deep = Policy::Pct {
        depth: 4_000_000_000,
        ops: 5,
    };
    assert!(checkpoint(bad(&|b| b.checkpoints[0].policy = deep)));
    let wide = Policy::Pct {
        depth: 2,
        ops: u64::MAX,
    };
    assert!(checkpoint(bad(&|b| b.checkpoints[0].policy = wide)));
    assert!(matches!(
        bad(&|b| b.runs = 0),
        CorpusError::SeenPastRuns { .. }
    ));
    let many = |b: &mut Corpus| {
        let k = b.checkpoints[0].clone();
        b.checkpoints = vec![k; CHECKPOINTS_MAX + 1];
    };
    assert_eq!(bad(&many), CorpusError::TooMany(CHECKPOINTS_MAX + 1));
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
    let mut x = warmed();
    x.observe(
        5,
        Policy::RandomWalk,
        &[3, 4],
        &probes(&["a"]),
        &first_at_1(&["a"]),
        false,
    );
    let mut y = x.clone();
    y.observe(
        6,
        Policy::RandomWalk,
        &[1],
        &probes(&["a", "b"]),
        &first_at_1(&["a", "b"]),
        false,
    );
    let mut m = x.clone();
    m.merge(&y).unwrap();
    assert_eq!(m.runs, 2 * WARM_UP_RUNS + 3);
    assert_eq!(m.seen["a"], 3);
    assert_eq!(m.checkpoints.len(), y.checkpoints.len());
}
