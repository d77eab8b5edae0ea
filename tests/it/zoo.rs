//! Every mutant of the bug zoo is caught within 100 seeds, and the clean engine has no findings on
//! the seeds that caught them.

use tierkv_engine::mutants::Mutant;
use tierkv_sim::cli::zoo::zoo_row;

#[test]
fn every_mutant_is_caught_within_100_seeds() {
    let mut worst = 0;
    for m in Mutant::ALL {
        // The prefill/decode mutants under the `pd` profile, the others under the default.
        let profile = if m.is_pd() { "pd" } else { "swarm" };
        let r = zoo_row(Some(m), 100, 2, profile, None);
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
    let clean = zoo_row(None, worst, 2, "swarm", None);
    assert!(!clean.caught, "the clean engine failed: {}", clean.message);
    let clean = zoo_row(None, worst.min(12), 2, "pd", None);
    assert!(!clean.caught, "the clean pair failed: {}", clean.message);
}

/// Bugs planted in the kernels' CPU references (the simulator's self-test): each is caught on the
/// CPU within a few seeds, by the oracle that exists for it.
#[test]
fn planted_reference_bugs_are_caught_on_the_cpu() {
    use tierkv_kernels::mutants::KernelMutant;
    use tierkv_sim::report::OracleKind;
    const PLANTED: &[(KernelMutant, OracleKind)] = &[
        (KernelMutant::RopeWrongHalf, OracleKind::Reference),
        (KernelMutant::KvStoreWritesNextRow, OracleKind::Undeclared),
        (KernelMutant::LogitsReadsNextPage, OracleKind::Undeclared),
    ];
    assert_eq!(
        PLANTED.len(),
        KernelMutant::ALL.len(),
        "every planted bug is tested"
    );
    for &(m, oracle) in PLANTED {
        let mut sc = tierkv_sim::scenario::draw(0, "quick", None);
        sc.mutant = Some(m.name().to_string());
        let out = tierkv_sim::runner::run(&sc, &tierkv_sim::runner::RunOptions::default());
        let f = out
            .findings
            .first()
            .unwrap_or_else(|| panic!("{} was not caught", m.name()));
        assert_eq!(f.oracle, oracle, "{}: {f}", m.name());
    }
}
