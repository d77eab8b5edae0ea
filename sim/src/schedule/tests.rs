//! The decider: replay, independent schedule indices, PCT, bad schedules.

use super::*;

fn draw(policy: Policy, index: u64, n: usize) -> Vec<u8> {
    let mut s = Decider::new(7, Source::Draw { index, policy }, 1000);
    (0..n).map(|i| s.decide(i % 3, &[])).collect()
}

/// A replayed list gives back exactly its decisions, then zeros.
#[test]
fn replay_follows_the_list_then_zero() {
    let list = draw(Policy::RandomWalk, 3, 50);
    let mut r = Decider::new(7, Source::Replay(list.clone()), 0);
    let got: Vec<u8> = (0..60).map(|i| r.decide(i % 3, &[])).collect();
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

/// PCT holds an op behind the running op, of those on stream kinds ranked above its own, that
/// ends last; an op of the top kind, or with no such op running, starts at once. Depth 1 never
/// changes the order; depth 3 changes it twice, within the op count it is given.
#[test]
fn pct_holds_an_op_behind_the_higher_ranked_streams_running() {
    for index in 0..12 {
        let policy = Policy::Pct { depth: 1, ops: 90 };
        let mut s = Decider::new(5, Source::Draw { index, policy }, 0);
        let mut kinds = [0usize, 1, 2];
        kinds.sort_by_key(|&k| s.priorities[k]);
        let [top, second, third] = kinds;
        for _ in 0..5 {
            // Every other stream of both sides running; stream 5 ends last.
            let others = |me: usize| -> Vec<(usize, u64)> {
                (0..6)
                    .filter(|&j| j != me)
                    .map(|j| (j, 100 + j as u64))
                    .collect()
            };
            assert_eq!(s.decide(top, &others(top)), 0, "schedule {index}");
            assert_eq!(s.decide(top + 3, &others(top + 3)), 0, "schedule {index}");
            // Behind the top kind's later stream (its decode side's).
            assert_eq!(
                s.decide(second, &others(second)),
                BEHIND + top as u8 + 3,
                "schedule {index}"
            );
            let last = top.max(second) + 3;
            assert_eq!(s.decide(third, &others(third)), BEHIND + last as u8);
            // Only its own kind's other side running: not held; no stream running: not held.
            assert_eq!(s.decide(third, &[(third + 3, 500)]), 0);
            assert_eq!(s.decide(third, &[]), 0);
            // Of two higher streams, the one whose op ends last.
            assert_eq!(
                s.decide(third, &[(top, 900), (second, 400)]),
                BEHIND + top as u8
            );
        }
    }
    let policy = Policy::Pct { depth: 3, ops: 90 };
    let mut s = Decider::new(9, Source::Draw { index: 2, policy }, 0);
    assert_eq!(s.change_points.len(), 2);
    assert!(s.change_points.iter().all(|&c| (1..90).contains(&c)));
    for i in 0..90 {
        s.decide(i % 3, &[]);
        let mut p = s.priorities;
        p.sort_unstable();
        assert_eq!(p, [0, 1, 2, 3, 4, 5], "priorities stay a permutation");
    }
    assert!(s.change_points.is_empty(), "both change points fired");
}

/// A hold decision is quarter-jitters up to `DELAY_MAX` and a stream to wait behind above it.
#[test]
fn hold_decisions_name_quarters_or_a_stream() {
    assert_eq!(hold(0), Hold::Quarters(0));
    assert_eq!(hold(DELAY_MAX), Hold::Quarters(DELAY_MAX));
    assert_eq!(hold(BEHIND), Hold::Behind(0));
    assert_eq!(hold(DECISION_MAX), Hold::Behind(STREAMS as usize - 1));
    // Replayed as recorded; past the largest, the largest.
    let mut r = Decider::new(7, Source::Replay(vec![BEHIND + 2, 200]), 0);
    assert_eq!(r.decide(0, &[]), BEHIND + 2);
    assert_eq!(r.decide(1, &[]), DECISION_MAX);
}

/// A replayed host decision above its kind's largest value counts as that value; every
/// decision's kind is recorded and counted.
#[test]
fn replayed_host_decisions_are_clamped_and_counted() {
    let mut r = Decider::new(7, Source::Replay(vec![9, 9, 0, 15, 13, 5]), 0);
    assert_eq!(r.point(Kind::Hold, 0), 9);
    assert_eq!(r.point(Kind::QueryEarly, 1), 1);
    assert_eq!(r.point(Kind::QueryLate, 1), 0);
    assert_eq!(r.point(Kind::Callback, 1), DELAY_MAX);
    assert_eq!(r.point(Kind::Sync, 1), DELAY_MAX);
    assert_eq!(r.point(Kind::Arrival, 0), 1);
    assert_eq!(
        r.point(Kind::QueryLate, 2),
        0,
        "past the end: the clock's answer"
    );
    assert_eq!(r.recorded(), &[9, 1, 0, 11, 11, 1, 0]);
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
/// behind them); a synchronize returns at once or as late as it may by the host's rank against
/// the stream kind waited for, and a callback by the callback thread's against the host's, the
/// same all run; the random walk defers some arrivals and not others.
#[test]
fn pct_orders_the_clients_and_the_host() {
    let (mut deferred, mut on_time, mut late_syncs, mut late_callbacks) = (0, 0, 0, 0);
    for index in 0..24 {
        let policy = Policy::Pct { depth: 1, ops: 90 };
        let mut s = Decider::new(13, Source::Draw { index, policy }, 0);
        let a = s.point(Kind::Arrival, 0);
        let sync: Vec<u8> = (0..3).map(|k| s.point(Kind::Sync, k)).collect();
        let callback = s.point(Kind::Callback, 1);
        assert!([0, DELAY_MAX].contains(&callback), "{callback}");
        for (k, &d) in sync.iter().enumerate() {
            let host_ahead = s.priorities[HOST] < s.priorities[k];
            assert_eq!(d, (!host_ahead) as u8 * DELAY_MAX, "schedule {index}");
        }
        for _ in 0..20 {
            assert_eq!(s.point(Kind::Arrival, 0), a, "schedule {index}");
            for (k, &d) in sync.iter().enumerate() {
                assert_eq!(s.point(Kind::Sync, k + 3), d, "a pair's side shares it");
            }
            assert_eq!(s.point(Kind::Callback, 4), callback);
        }
        if a == 1 {
            deferred += 1;
        } else {
            on_time += 1;
        }
        late_syncs += sync.iter().filter(|&&d| d > 0).count();
        late_callbacks += (callback > 0) as usize;
    }
    assert!(deferred > 0 && on_time > 0, "{deferred} {on_time}");
    assert!((1..72).contains(&late_syncs), "{late_syncs}");
    assert!((1..24).contains(&late_callbacks), "{late_callbacks}");
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
        s.decide(i % 3, &[]);
    }
    s.point(Kind::Arrival, 0);
    assert!(s.change_points.is_empty(), "within 10 op starts");
    assert_ne!(s.priorities, before);
}

/// The random walk draws every kind within its own range: callbacks and synchronizes up to
/// `DELAY_MAX`, holds in quarter-jitters only (never behind a stream).
#[test]
fn the_random_walk_stays_within_each_kind() {
    let walk = Source::Draw {
        index: 3,
        policy: Policy::RandomWalk,
    };
    let mut w = Decider::new(17, walk, 0);
    let mut seen = [0u8; KINDS];
    for _ in 0..500 {
        for k in Kind::ALL {
            let d = match k {
                Kind::Hold => w.decide(1, &[(0, 50)]),
                k => w.point(k, 1),
            };
            seen[k as usize] = seen[k as usize].max(d);
        }
    }
    assert_eq!(seen, [4, 1, 1, DELAY_MAX, 4, 1], "the largest of each kind");
}
