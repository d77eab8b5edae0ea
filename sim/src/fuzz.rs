//! The simulator crate's fuzz bodies; each `fuzz/fuzz_targets/*.rs` is a one-line wrapper.
//!
//! - `sim_ops`: arbitrary bytes become a scenario — configuration knobs, GPU timing and faults,
//!   and a workload of sessions and one-shot requests — which the simulator runs on the clean
//!   engine. Any finding (race, layout, content, digest, conservation, liveness) or panic is a
//!   crash.
//! - `scenario`: bytes as a saved scenario file (`tierkv sim --replay FILE`). A malformed or
//!   invalid file must be refused with an error; a valid one small enough for a fuzz iteration
//!   runs on the clean engine, where any finding but liveness is a crash.
//! - `guided` (issue 33, item 5): bytes choose a swarm seed, a cut of its workload to 1 to
//!   [`GUIDED_REQUESTS_MAX`] requests and a prefix of its schedule's decisions (the rest drawn
//!   by the random walk). Any finding is a crash. After the run, each probe and target
//!   (`targets`: happens-before pairs, combinations, watermark levels) it reached is turned into
//!   code coverage ([`lighthouse`]), so libFuzzer keeps an input that reached a state no input
//!   before it reached (or reached it more often), and mutates it further. Whether this steers
//!   a campaign toward rare states sooner than the plain fuzz targets is not measured.
//! - `cli_numbers`: arbitrary numbers and strings in the numeric arguments of `tierkv sim` and
//!   `tierkv replay`, through the same parser and checks the binary runs before it starts work.
//!   A panic is a crash, and so is an accepted command whose campaign or replay breaks the rules
//!   the checks promise.

use crate::cli::replay::{prepare, ReplayArgs};
use crate::cli::sim::{check_args, parse_scenario, JOBS_MAX};
use crate::cli::{Cli, Command};
use crate::report::OracleKind;
use crate::runner::{run, RunOptions};
use crate::scenario::{draw, OneShot, Scenario, Session, Turn, PROFILES};
use crate::schedule::{Policy, Source, DECISIONS_MAX};
use arbitrary::{Arbitrary, Unstructured};
use clap::Parser;
use std::hash::Hasher;

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

/// The largest scenario the `scenario` target runs (a bigger valid one is only parsed and
/// checked): pools and mirror bytes, requests, steps.
const SCENARIO_RUN_BYTES_MAX: u64 = 64 << 20;
const SCENARIO_RUN_REQUESTS_MAX: usize = 48;
const SCENARIO_RUN_STEPS_MAX: u64 = 20_000;

/// The bytes of `sc`'s pools, mirror and scratch (a valid scenario's configuration has them).
fn footprint_bytes(sc: &Scenario) -> u64 {
    let cfg = sc.engine_config();
    let fp = cfg.footprint(cfg.model.index_topk);
    fp.expect("a valid scenario's configuration has a footprint")
        .total()
        .0
}

pub fn fuzz_scenario(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(sc) = parse_scenario(text) else {
        return;
    };
    if sc.mutant.is_some()
        || footprint_bytes(&sc) > SCENARIO_RUN_BYTES_MAX
        || sc.workload.requests() > SCENARIO_RUN_REQUESTS_MAX
        || sc.steps_max > SCENARIO_RUN_STEPS_MAX
    {
        return;
    }
    let out = run(&sc, &RunOptions::default());
    // A file may give too few steps for its workload: running out of them is the file's doing.
    if let Some(f) = out
        .findings
        .iter()
        .find(|f| f.oracle != OracleKind::Liveness)
    {
        panic!("finding on the clean engine: {f}\nscenario: {text}");
    }
}

/// The most requests a `guided` input keeps of its seed's workload (a fuzz iteration stays
/// short: a swarm seed cut to 8 costs about a fifth of a whole one, sim/CAMPAIGNS.md).
pub const GUIDED_REQUESTS_MAX: u32 = 8;
/// The largest configuration a `guided` input runs (pools and mirror): libFuzzer's default
/// memory limit is 2 GiB.
const GUIDED_RUN_BYTES_MAX: u64 = 256 << 20;

#[derive(Debug, Arbitrary)]
struct GuidedCase {
    seed: u32,
    requests: u8,
    decisions: Vec<u8>,
}

pub fn fuzz_guided(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(case) = GuidedCase::arbitrary(&mut u) else {
        return;
    };
    let mut sc = draw(case.seed as u64, "swarm", None);
    if footprint_bytes(&sc) > GUIDED_RUN_BYTES_MAX {
        return;
    }
    sc.keep_requests(1 + case.requests as u32 % GUIDED_REQUESTS_MAX);
    let mut prefix = case.decisions;
    prefix.truncate(DECISIONS_MAX);
    let opts = RunOptions {
        schedule: Some(Source::Branch {
            prefix,
            index: 0,
            policy: Policy::RandomWalk,
        }),
        ..RunOptions::default()
    };
    let out = run(&sc, &opts);
    if let Some(f) = out.findings.first() {
        panic!(
            "finding on the clean engine: {f}\nscenario: {}",
            sc.summary()
        );
    }
    for name in out.probes.keys() {
        // SipHash with its fixed keys: the same slot for a name in every process.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write(name.as_bytes());
        lighthouse((h.finish() % LIGHTHOUSE_SLOTS as u64) as u16);
    }
}

/// The slots of [`lighthouse`]. The default profile reaches about 700 probe and target names
/// (run 101 of kernels/GPU.md); under a uniform hash about 29 of them share a slot with another
/// (an estimate, not counted), and a state whose slot another state already lit gives
/// libFuzzer nothing new but a higher hit count.
pub const LIGHTHOUSE_SLOTS: u16 = 8192;

/// Runs one of [`LIGHTHOUSE_SLOTS`] functions of its own, chosen by `slot`: each is code of its
/// own, so libFuzzer's coverage counts which slots an input lit. Slots past the last are
/// ignored.
#[inline(never)]
pub fn lighthouse(slot: u16) {
    #[inline(never)]
    fn beam<const H: u16, const M: u16, const L: u16>() {
        std::hint::black_box((H, M, L));
    }
    macro_rules! beams {
        ($h:ident, $m:ident, $low:expr; $($n:literal)*) => {
            match $low { $($n => beam::<$h, $m, $n>(),)* _ => {} }
        };
    }
    #[inline(never)]
    fn low<const H: u16, const M: u16>(low: u16) {
        beams!(H, M, low; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
    macro_rules! lows {
        ($h:ident, $mid:expr, $low:expr; $($n:literal)*) => {
            match $mid { $($n => low::<$h, $n>($low),)* _ => {} }
        };
    }
    #[inline(never)]
    fn mid<const H: u16>(mid: u16, low: u16) {
        lows!(H, mid, low; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
    macro_rules! mids {
        ($high:expr, $mid:expr, $low:expr; $($n:literal)*) => {
            match $high { $($n => mid::<$n>($mid, $low),)* _ => {} }
        };
    }
    mids!(slot / 256, slot / 16 % 16, slot % 16;
        0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
}

/// A value for a numeric argument: a number of some type, or any string.
#[derive(Debug, Arbitrary)]
enum Num {
    Unsigned(u64),
    Small(u8),
    Signed(i64),
    Float(f64),
    Text(String),
}

impl Num {
    fn render(&self) -> String {
        match self {
            Num::Unsigned(v) => v.to_string(),
            Num::Small(v) => v.to_string(),
            Num::Signed(v) => v.to_string(),
            Num::Float(v) => v.to_string(),
            Num::Text(s) => s.clone(),
        }
    }
}

#[derive(Debug, Arbitrary)]
enum CliCase {
    Sim {
        seed: Option<Num>,
        seeds: Option<(Num, Num)>,
        jobs: Option<Num>,
        shard: Option<(Num, Num)>,
        shrink_secs: Option<Num>,
        profile: u8,
        mutant: Option<u8>,
        check_determinism: bool,
    },
    Replay {
        requests: Option<Num>,
        time_scale: Option<Num>,
        layers: Option<Num>,
        output_max: Option<Num>,
        device_pages: Option<Num>,
        host_ratio: Option<Num>,
        write_policy: u8,
    },
}

/// `--name=value` for each given value (the `=` keeps a value like `-1` from reading as a flag).
fn flags(argv: &mut Vec<String>, pairs: &[(&str, Option<String>)]) {
    for (name, value) in pairs {
        if let Some(v) = value {
            argv.push(format!("--{name}={v}"));
        }
    }
}

fn sim_argv(case: &CliCase, argv: &mut Vec<String>) {
    let CliCase::Sim {
        seed,
        seeds,
        jobs,
        shard,
        shrink_secs,
        profile,
        mutant,
        check_determinism,
    } = case
    else {
        return;
    };
    argv.push("sim".into());
    // An unknown profile and an unknown mutant are inputs too.
    let profile = PROFILES.get(*profile as usize).copied().unwrap_or("nope");
    let mutant = mutant.map(|m| {
        tierkv_engine::mutants::Mutant::ALL
            .get(m as usize)
            .map_or("nope", |m| m.name())
            .to_string()
    });
    // Artifacts go to the temporary directory, never where the fuzzer runs.
    let out_dir = std::env::temp_dir().join("tierkv-fuzz-cli");
    flags(
        argv,
        &[
            ("seed", seed.as_ref().map(Num::render)),
            (
                "seeds",
                seeds
                    .as_ref()
                    .map(|(a, b)| format!("{}..{}", a.render(), b.render())),
            ),
            ("jobs", jobs.as_ref().map(Num::render)),
            (
                "shard",
                shard
                    .as_ref()
                    .map(|(i, n)| format!("{}/{}", i.render(), n.render())),
            ),
            ("shrink-secs", shrink_secs.as_ref().map(Num::render)),
            ("profile", Some(profile.to_string())),
            ("mutant", mutant),
            ("out-dir", Some(out_dir.display().to_string())),
        ],
    );
    if *check_determinism {
        argv.push("--check-determinism".into());
    }
}

fn replay_argv(case: &CliCase, argv: &mut Vec<String>) {
    let CliCase::Replay {
        requests,
        time_scale,
        layers,
        output_max,
        device_pages,
        host_ratio,
        write_policy,
    } = case
    else {
        return;
    };
    argv.push("replay".into());
    let policy = ["write_through", "write_through_selective", "write_back"]
        [*write_policy as usize % 3]
        .to_string();
    flags(
        argv,
        &[
            ("requests", requests.as_ref().map(Num::render)),
            ("time-scale", time_scale.as_ref().map(Num::render)),
            ("layers", layers.as_ref().map(Num::render)),
            ("output-max", output_max.as_ref().map(Num::render)),
            ("device-pages", device_pages.as_ref().map(Num::render)),
            ("host-ratio", host_ratio.as_ref().map(Num::render)),
            ("write-policy", Some(policy)),
        ],
    );
}

pub fn fuzz_cli_numbers(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(case) = CliCase::arbitrary(&mut u) else {
        return;
    };
    let mut argv = vec!["tierkv".to_string()];
    sim_argv(&case, &mut argv);
    replay_argv(&case, &mut argv);
    let Ok(cli) = Cli::try_parse_from(&argv) else {
        return;
    };
    match cli.command {
        Command::Sim(args) => {
            let Ok(c) = check_args(&args) else {
                return;
            };
            assert!(
                (1..=JOBS_MAX).contains(&c.jobs),
                "{argv:?}: accepted with {} jobs",
                c.jobs
            );
            assert!(
                args.seed.is_some() || !c.seeds().is_empty(),
                "{argv:?}: accepted a campaign without seeds"
            );
        }
        Command::Replay(args) => check_replay(&args, &argv),
        _ => unreachable!("the fuzz target builds only sim and replay commands"),
    }
}

/// An accepted replay has a valid configuration and requests that fit it, in arrival order.
fn check_replay(args: &ReplayArgs, argv: &[String]) {
    let Ok((cfg, work)) = prepare(args) else {
        return;
    };
    assert!(
        cfg.validate().is_ok(),
        "{argv:?}: accepted an invalid configuration"
    );
    assert!(
        !work.is_empty() && work.len() <= args.requests,
        "{argv:?}: {} requests for --requests {}",
        work.len(),
        args.requests
    );
    let ctx = cfg.model.context_tokens_max as usize;
    for (i, (at, spec)) in work.iter().enumerate() {
        assert!(
            spec.prompt.len() + spec.max_new_tokens as usize <= ctx,
            "{argv:?}: request {i} does not fit the context"
        );
        assert!(
            i == 0 || work[i - 1].0 <= *at,
            "{argv:?}: request {i} arrives before the one before it"
        );
    }
}
