//! Guided campaigns (`--corpus`): a campaign grows its corpus and branches from it, and a branch
//! replays its checkpoint's prefix to the state the checkpoint was kept for.

use std::sync::{Arc, Mutex};
use tierkv_sim::campaign::{run_campaign, CampaignOptions};
use tierkv_sim::corpus::Corpus;
use tierkv_sim::runner::{run, RunOptions};
use tierkv_sim::schedule::{branch_index, Source};

#[test]
fn a_guided_campaign_grows_its_corpus_and_its_branches_reach_their_checkpoints() {
    let corpus = Arc::new(Mutex::new(Corpus::new("quick")));
    let opts = CampaignOptions {
        jobs: 1,
        corpus: Some(corpus.clone()),
        branches: 2,
        ..super::campaign("quick", 0, 26)
    };
    let s = run_campaign(&opts, |_| {}).expect("the workers start");
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    // One worker: the corpus keeps nothing in its warm-up (20 runs), so the first seeds find it
    // empty; the last ones branch twice each once it holds a checkpoint.
    assert_eq!(s.seeds_run, 26);
    assert!((2..=10).contains(&s.branches), "{} branches", s.branches);
    assert_eq!(s.runs, s.seeds_run + s.branches);
    let c = corpus.lock().expect("the corpus");
    assert_eq!(c.runs, s.runs, "every run is counted into the corpus");
    assert!(
        !c.checkpoints.is_empty(),
        "past the warm-up, rare probes are kept"
    );
    assert_eq!(
        c.checkpoints.iter().map(|k| k.branched).sum::<u64>(),
        s.branches
    );
    // A branch replays the prefix, and so reaches the probe at the same decision.
    let cp = c
        .checkpoints
        .iter()
        .max_by_key(|k| k.prefix.len())
        .expect("a checkpoint");
    assert!(!cp.prefix.is_empty(), "{cp:?}");
    let branch = RunOptions {
        schedule: Some(Source::Branch {
            prefix: cp.prefix.clone(),
            index: branch_index(99),
            policy: cp.policy,
        }),
        ..RunOptions::default()
    };
    let out = run(&opts.scenario(cp.seed), &branch);
    assert!(!out.failed(), "{:?}", out.findings);
    assert_eq!(out.decisions[..cp.prefix.len()], cp.prefix[..]);
    let probe = cp.probe.as_str();
    assert_eq!(
        out.first_hits.get(probe).copied(),
        Some(cp.prefix.len() as u64),
        "{probe} first hit elsewhere"
    );
}
