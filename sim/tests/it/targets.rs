//! Coverage targets (`tierkv_sim::targets`): a run counts the happens-before pairs its accesses
//! made, the combinations of its configuration and faults and the levels of the engine's
//! watermarks, under names a shard file may carry.

use tierkv_engine::config::Config;
use tierkv_sim::probes::all_names;
use tierkv_sim::runner::{run, RunOptions};
use tierkv_sim::targets::{self, config_factors, is_target, is_target_name};

#[test]
fn a_run_counts_its_pairs_and_the_combinations_of_its_factors() {
    let opts = super::campaign("swarm", 0, 1);
    let names = all_names();
    for seed in [0, 1, 3] {
        let sc = opts.scenario(seed);
        let out = run(&sc, &RunOptions::default());
        assert!(!out.failed(), "seed {seed}: {:?}", out.findings);
        let reached: Vec<&str> = out
            .probes
            .keys()
            .copied()
            .filter(|n| is_target_name(n))
            .collect();
        for n in &reached {
            assert!(
                is_target(n, &names),
                "seed {seed}: {n} is not in the grammar"
            );
            if !n.starts_with("mark.") {
                assert_eq!(out.probes[n], 1, "seed {seed}: {n} counts once a run");
            }
            assert!(
                out.first_hits.contains_key(n),
                "seed {seed}: {n} has no first hit"
            );
        }
        // Every decode step stores a KV row on the compute stream that its sparse read reads
        // after it, in stream order.
        let kv = "hb.device_kv.kv_store@compute:w>sparse_read@compute:r";
        assert!(reached.contains(&kv), "seed {seed}: {reached:?}");
        // Every accepted request queues its prompt's tokens: a watermark of at least 1.
        let queued = "mark.intake.queued_tokens>=2^0";
        assert!(reached.contains(&queued), "seed {seed}: {reached:?}");
        // The runtime counts the ops enqueued between an event's record and a wait on it:
        // these seeds wait on an event with ops enqueued after its record.
        let stale = "mark.runtime.ops_from_record_to_wait>=2^0";
        assert!(reached.contains(&stale), "seed {seed}: {reached:?}");
        // Free host pages are counted at an eviction that dropped host copies only (seed 3
        // meets refusals of host pages with enough free, which evict nothing).
        let free_at_eviction = reached
            .iter()
            .any(|n| n.starts_with("mark.host.pages_free_at_eviction"));
        assert!(
            !free_at_eviction || out.probes.contains_key("host.evicted"),
            "seed {seed}: free pages counted without an eviction"
        );
        // The configuration's factors, each once, and every two of them together.
        let cfg = Config::from_toml(&sc.config).expect("the scenario's configuration");
        let factors = config_factors(&cfg, sc.overlap);
        let faults: Vec<&str> = (out.probes.iter())
            .filter(|(n, &c)| c > 0 && targets::is_fault(n))
            .map(|(n, _)| *n)
            .collect();
        for (f, v) in &factors {
            assert!(
                reached.contains(&format!("factor.{f}={v}").as_str()),
                "seed {seed}: {f}"
            );
            for fault in &faults {
                let combo = format!("combo.{f}={v}+fault={fault}");
                assert!(reached.contains(&combo.as_str()), "seed {seed}: {combo}");
            }
        }
        let n = factors.len() + faults.len();
        let combos = reached.iter().filter(|r| r.starts_with("combo.")).count();
        let same_factor = faults.len() * faults.len().saturating_sub(1) / 2;
        assert_eq!(combos, n * (n - 1) / 2 - same_factor, "seed {seed}");
    }
}

#[test]
fn the_guided_fuzz_body_runs_its_inputs_on_the_clean_engine() {
    // Seed bytes, a cut, a schedule prefix: each a clean run (a finding panics).
    for input in [
        &[][..],
        &[7, 0, 0, 0, 3],
        &[1, 2, 3, 4, 255, 4, 4, 4, 1, 0, 2],
    ] {
        tierkv_sim::fuzz::fuzz_guided(input);
    }
}
