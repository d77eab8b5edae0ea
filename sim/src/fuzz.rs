//! Fuzz body of the operation-sequence target (`fuzz/fuzz_targets/sim_ops.rs`): arbitrary bytes
//! become a scenario — configuration knobs, GPU timing and faults, and a workload of sessions and
//! one-shot requests — which the simulator runs on the clean engine. Any finding (race, layout,
//! content, digest, conservation, liveness) or panic is a crash.

use crate::runner::{run, RunOptions};
use crate::scenario::{draw, OneShot, Session, Turn};
use arbitrary::{Arbitrary, Unstructured};

/// A session's (start, system prompt) and its turns' (appended, generated, think) sizes.
type FuzzSession = (u8, u8, Vec<(u8, u8, u8)>);

#[derive(Debug, Arbitrary)]
struct FuzzCase {
    seed: u16,
    sessions: Vec<FuzzSession>,
    oneshots: Vec<(u16, u8, u8, u8)>,
    abort_rate: u8,
    mid_load_rate: u8,
    failed_copy_rate: u8,
}

pub fn fuzz_sim_ops(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(case) = FuzzCase::arbitrary(&mut u) else {
        return;
    };
    // The seed draws the configuration and GPU knobs; the bytes replace the workload and rates.
    let mut sc = draw(case.seed as u64, "quick", None);
    sc.abort_rate = case.abort_rate as f64 / 2550.0;
    sc.abort_mid_load_rate = case.mid_load_rate as f64 / 255.0;
    sc.gpu.failed_copy_rate = case.failed_copy_rate as f64 / 2550.0;
    sc.workload.sessions = case
        .sessions
        .iter()
        .take(12)
        .map(|&(start, sys, ref turns)| Session {
            start_ns: start as u64 * 20_000,
            system_id: 1000 + (sys % 2) as u64,
            system_tokens: 16 + (sys as u32 % 4) * 60,
            turns: turns
                .iter()
                .take(4)
                .map(|&(a, g, t)| Turn {
                    append_tokens: 1 + a as u32 % 100,
                    generate: 1 + g as u32 % 8,
                    think_ns: t as u64 * 10_000,
                })
                .collect(),
        })
        .collect();
    sc.workload.oneshots = case
        .oneshots
        .iter()
        .take(24)
        .map(|&(at, stream, n, g)| OneShot {
            at_ns: at as u64 * 1_000,
            segments: vec![
                (stream as u64 % 5, 64),
                (5000 + stream as u64, 1 + n as u32),
            ],
            generate: 1 + g as u32 % 4,
        })
        .collect();
    sc.steps_max = 2_000 + 400 * sc.workload.requests() as u64;
    let out = run(&sc, &RunOptions::default());
    if let Some(f) = out.findings.first() {
        panic!(
            "finding on the clean engine: {f}\nscenario: {}",
            serde_json::to_string(&sc).unwrap_or_default()
        );
    }
}
