//! The simulated driver's own faults (`GpuOptions::driver_fault_rate`): every call kind that
//! CUDA can refuse by itself is refused in some of these runs, and the clean engine, on the
//! production runtime, recovers from all of them with no finding.

use std::collections::BTreeMap;
use tierkv_sim::runner::{run, RunOptions};
use tierkv_sim::scenario::{draw, limits::DRIVER_FAULT_RATE_MAX};

/// Swarm seeds `0..SEEDS`, each at the highest driver fault rate a scenario may ask for, half
/// of them moving pages by one pitched copy per run.
const SEEDS: u64 = 12;

#[test]
fn every_driver_call_kind_fails_and_the_engine_recovers() {
    let mut hits: BTreeMap<&'static str, u64> = BTreeMap::new();
    for seed in 0..SEEDS {
        let mut sc = draw(seed, "swarm", None);
        sc.gpu.driver_fault_rate = DRIVER_FAULT_RATE_MAX;
        sc.gpu.runtime_copy_runs = seed % 2 == 0;
        let out = run(&sc, &RunOptions::default());
        assert!(
            out.findings.is_empty(),
            "seed {seed}: {:?}",
            out.findings.first()
        );
        for (name, n) in out.probes {
            *hits.entry(name).or_default() += n;
        }
    }
    for probe in [
        "driver.refused_alloc",
        "driver.refused_alloc_async",
        "driver.refused_copy_async",
        "driver.refused_copy_2d",
        "driver.refused_copy_pageable",
        "driver.refused_launch",
        "driver.refused_event_create",
        "driver.refused_event_record",
        "driver.refused_stream_wait",
        "driver.refused_host_callback",
        "runtime.pool_trimmed",
        "runtime.partial_copy_drained",
        "device.call_repeated",
    ] {
        assert!(
            hits.get(probe).is_some_and(|&n| n > 0),
            "probe {probe} never hit in swarm seeds 0..{SEEDS}: {hits:?}"
        );
    }
}
