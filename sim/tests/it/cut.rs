//! `--requests-max` and `--cut-share`: a seed's workload cut to its sessions and one-shots that
//! start first, every other draw of the seed kept.

use tierkv_sim::scenario::{draw, Scenario};

/// Each kept request's start: its session's start for each turn, a one-shot's arrival.
fn arrivals(sc: &Scenario) -> Vec<u64> {
    let mut a: Vec<u64> = (sc.workload.sessions.iter())
        .flat_map(|s| std::iter::repeat_n(s.start_ns, s.turns.len()))
        .chain(sc.workload.oneshots.iter().map(|o| o.at_ns))
        .collect();
    a.sort_unstable();
    a
}

#[test]
fn a_cut_keeps_the_first_requests_and_every_other_draw() {
    for seed in 0..300 {
        let whole = draw(seed, "swarm", None);
        let all = arrivals(&whole);
        for n in [1u32, 3, 8, 10_000] {
            let mut cut = whole.clone();
            cut.keep_requests(n);
            let kept = arrivals(&cut);
            let want = (n as usize).min(all.len());
            assert_eq!(kept.len(), want, "seed {seed}, first {n}");
            // The earliest arrivals (ties may keep either of equals: the times are equal).
            assert_eq!(kept, all[..want], "seed {seed}, first {n}");
            // What is kept of each session is its first turns, unchanged.
            for s in &cut.workload.sessions {
                let from = (whole.workload.sessions.iter())
                    .find(|w| w.start_ns == s.start_ns && w.system_id == s.system_id)
                    .expect("a kept session was drawn");
                assert_eq!(s.turns[..], from.turns[..s.turns.len()], "seed {seed}");
                assert!(!s.turns.is_empty(), "seed {seed}: an empty session kept");
            }
            for o in &cut.workload.oneshots {
                assert!(whole.workload.oneshots.contains(o), "seed {seed}");
            }
            // Every other draw as it was.
            let mut back = cut.clone();
            back.workload = whole.workload.clone();
            back.steps_max = whole.steps_max;
            back.requests_max = 0;
            assert_eq!(back, whole, "seed {seed}, first {n}");
            assert_eq!(cut.requests_max, n);
            if let Err(e) = cut.validate() {
                panic!("seed {seed} cut to {n}: {e}");
            }
            let text = serde_json::to_string(&cut).expect("a scenario serialises");
            let read: Scenario = serde_json::from_str(&text).expect("it reads back");
            assert_eq!(read, cut);
        }
    }
}

#[test]
fn a_cut_seed_runs_from_the_command_line_and_names_its_cut() {
    let (code, out, err) = super::tierkv(&[
        "sim",
        "--seed",
        "4",
        "--requests-max",
        "2",
        "--profile",
        "swarm",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 requests (cut to at most 2)"), "{out}");
    assert!(out.contains("ok: no findings"), "{out}");
    let (code, _, err) = super::tierkv(&["sim", "--seed", "4", "--requests-max", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--requests-max"), "{err}");
}

#[test]
fn a_share_of_the_seeds_is_cut_to_one_to_eight_requests() {
    use tierkv_sim::scenario::{drawn_cut, CUT_REQUESTS_MAX};
    let cut = (0..2_000u64)
        .filter_map(|s| drawn_cut(s, 0.3))
        .collect::<Vec<_>>();
    assert!(
        (500..700).contains(&cut.len()),
        "{} of 2000 seeds cut",
        cut.len()
    );
    assert!(cut.iter().all(|n| (1..=CUT_REQUESTS_MAX).contains(n)));
    for n in 1..=CUT_REQUESTS_MAX {
        assert!(cut.contains(&n), "no seed cut to {n}");
    }
    assert!((0..200).all(|s| drawn_cut(s, 0.0).is_none() && drawn_cut(s, 1.0).is_some()));
}

/// A seed run with `--cut-share` is the run its printed cut replays: the same event-log hash.
#[test]
fn a_cut_share_seed_replays_from_its_request_count() {
    let seed = (0..100u64)
        .find(|&s| tierkv_sim::scenario::drawn_cut(s, 0.5).is_some())
        .expect("a cut seed");
    let n = tierkv_sim::scenario::drawn_cut(seed, 0.5).expect("cut");
    let hash = |extra: &[&str]| {
        let s = seed.to_string();
        let mut args = vec!["sim", "--seed", &s];
        args.extend_from_slice(extra);
        let (code, out, err) = super::tierkv(&args);
        assert_eq!(code, 0, "{out}{err}");
        let hash = out.lines().find_map(|l| l.split("event-log hash ").nth(1));
        hash.unwrap_or_else(|| panic!("no hash in {out}"))
            .to_string()
    };
    let n = n.to_string();
    assert_eq!(hash(&["--cut-share", "0.5"]), hash(&["--requests-max", &n]));
}
