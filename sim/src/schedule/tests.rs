//! The decider: replay, independent schedule indices, PCT, bad schedules.

use super::*;

fn draw(policy: Policy, index: u64, n: usize) -> Vec<u8> {
    let mut s = Decider::new(7, Source::Draw { index, policy }, 1000);
    (0..n).map(|i| s.decide(i % 3)).collect()
}

/// A replayed list gives back exactly its decisions, then zeros.
#[test]
fn replay_follows_the_list_then_zero() {
    let list = draw(Policy::RandomWalk, 3, 50);
    let mut r = Decider::new(7, Source::Replay(list.clone()), 0);
    let got: Vec<u8> = (0..60).map(|i| r.decide(i % 3)).collect();
    assert_eq!(&got[..50], &list[..]);
    assert!(got[50..].iter().all(|&d| d == 0));
    assert_eq!(r.recorded(), &got[..]);
}

/// Different schedule indices of one seed draw different schedules; one index, the same.
#[test]
fn indices_draw_independent_schedules() {
    assert_eq!(
        draw(Policy::RandomWalk, 1, 100),
        draw(Policy::RandomWalk, 1, 100)
    );
    assert_ne!(
        draw(Policy::RandomWalk, 1, 100),
        draw(Policy::RandomWalk, 2, 100)
    );
}

/// PCT of depth 1 never changes priorities: each stream keeps one priority band all run.
/// Depth 3 has two change points, both within the op count it is given.
#[test]
fn pct_holds_streams_by_priority_with_depth_minus_one_changes() {
    let d = draw(Policy::Pct { depth: 1, ops: 90 }, 5, 90);
    for s in 0..3 {
        let bands: std::collections::BTreeSet<u8> =
            d.iter().skip(s).step_by(3).map(|x| x / 4).collect();
        assert_eq!(bands.len(), 1, "stream {s}: {d:?}");
    }
    let policy = Policy::Pct { depth: 3, ops: 90 };
    let mut s = Decider::new(9, Source::Draw { index: 2, policy }, 0);
    assert_eq!(s.change_points.len(), 2);
    assert!(s.change_points.iter().all(|&c| (1..90).contains(&c)));
    for i in 0..90 {
        s.decide(i % 3);
        let mut p = s.priorities;
        p.sort_unstable();
        assert_eq!(p, [0, 1, 2], "priorities stay a permutation");
    }
    assert!(s.change_points.is_empty(), "both change points fired");
}

#[test]
fn bad_schedules_are_typed_errors() {
    let mut s = Schedule {
        seed: 1,
        scenario: 0,
        index: 0,
        policy: Policy::RandomWalk,
        decisions: vec![0, 3, DECISION_MAX + 1],
    };
    assert_eq!(
        s.validate(),
        Err(ScheduleError::DecisionTooLarge {
            at: 2,
            value: DECISION_MAX + 1
        })
    );
    s.decisions.pop();
    assert_eq!(s.validate(), Ok(()));
}

/// A schedule replays only on the scenario it was recorded on: same seed, same fingerprint.
#[test]
fn a_schedule_belongs_to_its_scenario() {
    let sc = crate::scenario::draw(3, "swarm", None);
    let mut s = Schedule {
        seed: 3,
        scenario: sc.fingerprint(),
        index: 1,
        policy: Policy::RandomWalk,
        decisions: vec![1, 2],
    };
    assert_eq!(s.check_for(sc.seed, sc.fingerprint()), Ok(()));
    let mut mutated = sc.clone();
    mutated.mutant = Some("anything".into());
    assert_eq!(
        s.check_for(mutated.seed, mutated.fingerprint()),
        Ok(()),
        "the mutant is not the scenario"
    );
    let other = crate::scenario::draw(3, "quick", None);
    assert!(matches!(
        s.check_for(other.seed, other.fingerprint()),
        Err(ScheduleError::OtherScenario { .. })
    ));
    s.seed = 4;
    assert!(matches!(
        s.check_for(sc.seed, sc.fingerprint()),
        Err(ScheduleError::OtherSeed { .. })
    ));
}
