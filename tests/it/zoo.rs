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
        let r = zoo_row(Some(m), 100, 2, profile, None).expect("the workers start");
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
    let clean = zoo_row(None, worst, 2, "swarm", None).expect("the workers start");
    assert!(!clean.caught, "the clean engine failed: {}", clean.message);
    let clean = zoo_row(None, worst.min(12), 2, "pd", None).expect("the workers start");
    assert!(!clean.caught, "the clean pair failed: {}", clean.message);
}

/// Bugs planted in the kernels' CPU references and in the layout module (the simulator's
/// self-test): each is caught on the CPU by the first seed of the `quick` profile whose
/// configuration it applies to, by the oracle that exists for it. The rotation and the layout
/// bugs are shared by everything the engine and the executor run, so only the specification
/// (with its own arithmetic and byte formats) can see them.
#[test]
fn planted_reference_bugs_are_caught_on_the_cpu() {
    use tierkv_kernels::mutants::KernelMutant;
    use tierkv_sim::report::OracleKind;
    const PLANTED: &[(KernelMutant, u64, OracleKind)] = &[
        (KernelMutant::RopeWrongHalf, 0, OracleKind::Content),
        (
            KernelMutant::KvStoreWritesNextRow,
            0,
            OracleKind::Undeclared,
        ),
        (KernelMutant::LogitsReadsNextPage, 0, OracleKind::Undeclared),
        // Seed 1 is the first with fp8 index-K pages, which the bug moves.
        (KernelMutant::IndexKScalesFirst, 1, OracleKind::Content),
        // Seed 0 has three layers: the two orders differ.
        (KernelMutant::HostOrderSwapped, 0, OracleKind::Conservation),
        // fp8 pages again (seed 1): the logits of the keys read at the wrong bytes select
        // another top-k than the specification's.
        (KernelMutant::LogitsReadsInterleaved, 1, OracleKind::TopK),
    ];
    assert_eq!(
        PLANTED.len(),
        KernelMutant::ALL.len(),
        "every planted bug is tested"
    );
    for &(m, seed, oracle) in PLANTED {
        let mut sc = tierkv_sim::scenario::draw(seed, "quick", None);
        let clean = tierkv_sim::runner::run(&sc, &tierkv_sim::runner::RunOptions::default());
        assert!(
            !clean.failed(),
            "seed {seed} without {}: {:?}",
            m.name(),
            clean.findings
        );
        sc.mutant = Some(m.name().to_string());
        let out = tierkv_sim::runner::run(&sc, &tierkv_sim::runner::RunOptions::default());
        let f = out
            .findings
            .first()
            .unwrap_or_else(|| panic!("{} was not caught", m.name()));
        assert_eq!(f.oracle, oracle, "{}: {f}", m.name());
    }
}
