//! Every mutant of the bug zoo is caught within 100 seeds, and the clean engine has no findings on
//! the seeds that caught them.

use tierkv_engine::mutants::Mutant;
use tierkv_sim::cli::zoo::zoo_row;

#[test]
fn every_mutant_is_caught_within_100_seeds() {
    let mut worst = 0;
    for m in Mutant::ALL {
        let r = zoo_row(Some(m), 100, 2, "swarm");
        assert!(
            r.caught,
            "mutant {} was not caught within 100 seeds",
            m.name()
        );
        worst = worst.max(r.seeds);
        eprintln!(
            "{:<28} caught after {:>3} seeds by [{}]",
            m.name(),
            r.seeds,
            r.oracle.unwrap()
        );
    }
    let clean = zoo_row(None, worst, 2, "swarm");
    assert!(!clean.caught, "the clean engine failed: {}", clean.message);
}
