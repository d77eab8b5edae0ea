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
    let mut first = 0;
    for s in 0..3 {
        let bands: std::collections::BTreeSet<u8> =
            d.iter().skip(s).step_by(3).map(|x| x / 4).collect();
        assert_eq!(bands.len(), 1, "stream {s}: {d:?}");
        // The highest stream kind's ops start as soon as they can.
        if bands.contains(&0) {
            assert!(
                d.iter().skip(s).step_by(3).all(|&x| x == 0),
                "stream {s}: {d:?}"
            );
            first += 1;
        }
    }
    assert_eq!(first, 1, "one stream kind ranks first: {d:?}");
    let policy = Policy::Pct { depth: 3, ops: 90 };
    let mut s = Decider::new(9, Source::Draw { index: 2, policy }, 0);
    assert_eq!(s.change_points.len(), 2);
    assert!(s.change_points.iter().all(|&c| (1..90).contains(&c)));
    for i in 0..90 {
        s.decide(i % 3);
        let mut p = s.priorities;
        p.sort_unstable();
        assert_eq!(p, [0, 1, 2, 3, 4, 5], "priorities stay a permutation");
    }
    assert!(s.change_points.is_empty(), "both change points fired");
}

/// A replayed host decision above its kind's largest value counts as that value; every
/// decision's kind is recorded and counted.
#[test]
fn replayed_host_decisions_are_clamped_and_counted() {
    let mut r = Decider::new(7, Source::Replay(vec![9, 9, 0, 11, 7, 5]), 0);
    assert_eq!(r.point(Kind::Hold, 0), 9);
    assert_eq!(r.point(Kind::QueryEarly, 1), 1);
    assert_eq!(r.point(Kind::QueryLate, 1), 0);
    assert_eq!(r.point(Kind::Callback, 1), 11);
    assert_eq!(r.point(Kind::Sync, 1), 7);
    assert_eq!(r.point(Kind::Arrival, 0), 1);
    assert_eq!(
        r.point(Kind::QueryLate, 2),
        0,
        "past the end: the clock's answer"
    );
    assert_eq!(r.recorded(), &[9, 1, 0, 11, 7, 1, 0]);
    let c = r.counts();
    assert_eq!(c.made, [1, 1, 2, 1, 1, 1]);
    assert_eq!(c.taken, [1, 1, 0, 1, 1, 1]);
    assert_eq!(
        r.take_kinds(),
        [
            Kind::Hold,
            Kind::QueryEarly,
            Kind::QueryLate,
            Kind::Callback,
            Kind::Sync,
            Kind::Arrival,
            Kind::QueryLate
        ]
    );
}

/// PCT of depth 1 answers every query in a window by one fixed order of the host and the
/// record's stream kind: the early and late answers of one stream kind are never both taken,
/// and they do not change during the run.
#[test]
fn pct_answers_queries_by_the_host_and_stream_priorities() {
    for index in 0..12 {
        let policy = Policy::Pct { depth: 1, ops: 90 };
        let mut s = Decider::new(11, Source::Draw { index, policy }, 0);
        for stream in 0..3 {
            let e = s.point(Kind::QueryEarly, stream);
            let l = s.point(Kind::QueryLate, stream);
            assert_eq!(
                e + l,
                1,
                "schedule {index}, stream {stream}: one of host and stream leads"
            );
            for _ in 0..10 {
                assert_eq!(
                    s.point(Kind::QueryEarly, stream + 3),
                    e,
                    "a pair's side shares it"
                );
                assert_eq!(s.point(Kind::QueryLate, stream), l);
            }
        }
    }
}

#[test]
fn bad_schedules_are_typed_errors() {
    let mut s = Schedule {
        format: FORMAT,
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
    // A file written before the host's decisions has no `format`: format 1, refused.
    let old: Schedule = serde_json::from_str(
        r#"{"seed":1,"scenario":0,"index":0,"policy":"random_walk","decisions":[0,3]}"#,
    )
    .expect("a format-1 file parses");
    assert_eq!(
        old.validate(),
        Err(ScheduleError::OtherFormat { format: 1 })
    );
}

/// A schedule replays only on the scenario it was recorded on: same seed, same fingerprint.
#[test]
fn a_schedule_belongs_to_its_scenario() {
    let sc = crate::scenario::draw(3, "swarm", None);
    let mut s = Schedule {
        format: FORMAT,
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

/// PCT of depth 1 defers every arrival or abort or none (the host ahead of the clients, or
/// behind them), and a synchronize returns late by the host's rank, the same all run; the
/// random walk defers some and not others.
#[test]
fn pct_orders_the_clients_and_the_host() {
    let (mut deferred, mut on_time) = (0, 0);
    for index in 0..24 {
        let policy = Policy::Pct { depth: 1, ops: 90 };
        let mut s = Decider::new(13, Source::Draw { index, policy }, 0);
        let a = s.point(Kind::Arrival, 0);
        let sync = s.point(Kind::Sync, 1);
        for _ in 0..20 {
            assert_eq!(s.point(Kind::Arrival, 0), a, "schedule {index}");
            assert_eq!(s.point(Kind::Sync, 2), sync, "schedule {index}");
        }
        if a == 1 {
            deferred += 1;
        } else {
            on_time += 1;
        }
    }
    assert!(deferred > 0 && on_time > 0, "{deferred} {on_time}");
    let walk = Source::Draw {
        index: 1,
        policy: Policy::RandomWalk,
    };
    let mut w = Decider::new(13, walk, 0);
    let taken: u32 = (0..200).map(|_| w.point(Kind::Arrival, 0) as u32).sum();
    assert!((20..100).contains(&taken), "about 1 in 4 deferred: {taken}");
}

/// PCT's change points count op starts: decisions of other kinds, however many, move none,
/// and the op starts reach it.
#[test]
fn pct_change_points_count_op_starts_only() {
    let policy = Policy::Pct { depth: 2, ops: 10 };
    let mut s = Decider::new(5, Source::Draw { index: 1, policy }, 0);
    let before = s.priorities;
    assert_eq!(s.change_points.len(), 1);
    for _ in 0..1000 {
        s.point(Kind::Arrival, 0);
        s.point(Kind::Sync, 1);
        s.point(Kind::QueryLate, 2);
    }
    assert_eq!(s.priorities, before, "no op started");
    assert_eq!(s.change_points.len(), 1);
    for i in 0..10 {
        s.decide(i % 3);
    }
    s.point(Kind::Arrival, 0);
    assert!(s.change_points.is_empty(), "within 10 op starts");
    assert_ne!(s.priorities, before);
}
