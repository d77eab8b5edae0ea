//! Snapshot tests of every error kind's text and exit code, each produced by the code that
//! refuses (where a test machine can reach it) rather than built by hand. Update a snapshot
//! after a deliberate change with `UPDATE_EXPECT=1 cargo test -p tierkv-sim --lib cli::error`.

use super::{CliError, ScenarioFileError};
use crate::cli::{Cli, Command};
use clap::Parser;
use expect_test::{expect, Expect};

/// The error's exit code and text, as the command line prints them.
fn check(e: &CliError, want: Expect) {
    want.assert_eq(&format!("exit {}: {e}", e.exit_code()));
}

fn sim_args(args: &[&str]) -> crate::cli::sim::SimArgs {
    match Cli::try_parse_from([&["tierkv", "sim"], args].concat()).expect("parses") {
        Cli {
            command: Command::Sim(a),
        } => a,
        _ => unreachable!("parsed as `sim`"),
    }
}

fn replay_args(args: &[&str]) -> crate::cli::replay::ReplayArgs {
    match Cli::try_parse_from([&["tierkv", "replay"], args].concat()).expect("parses") {
        Cli {
            command: Command::Replay(a),
        } => a,
        _ => unreachable!("parsed as `replay`"),
    }
}

fn sim_refusal(args: &[&str]) -> CliError {
    crate::cli::sim::check_args(&sim_args(args)).expect_err("refused")
}

#[test]
fn arguments() {
    check(
        &sim_refusal(&["--profile", "nope"]),
        expect!["exit 2: unknown profile `nope`; profiles are: swarm, sessions, needle, trace, quick, production, pd, vllm"],
    );
    check(
        &sim_refusal(&["--seed", "3", "--coverage"]),
        expect!["exit 2: --coverage prints a campaign's coverage table: give --seeds A..B, or drop --coverage"],
    );
    check(
        &sim_refusal(&["--jobs", "0"]),
        expect!["exit 2: --jobs 0: a campaign needs at least one worker"],
    );
    check(
        &crate::cli::replay::prepare(&replay_args(&["--requests", "0"])).expect_err("refused"),
        expect!["exit 2: --requests 0: nothing to replay"],
    );
}

#[test]
fn not_built() {
    let e = CliError::NotBuilt {
        flag: "--device cuda",
        feature: "cuda",
    };
    check(
        &e,
        expect!["exit 2: --device cuda needs a build with `--features cuda`"],
    );
    // Without CUDA in the build, the argument check is what answers it.
    if !cfg!(feature = "cuda") {
        let refused = sim_refusal(&["--device", "cuda"]);
        assert_eq!(refused.to_string(), e.to_string());
    }
}

#[test]
fn no_device() {
    // No test machine is known to lack a GPU in a CUDA build: the text is built here.
    check(
        &CliError::NoDevice {
            flag: "--device cuda",
            detail: "CUDA_ERROR_NO_DEVICE".into(),
        },
        expect!["exit 2: --device cuda: no usable CUDA device: CUDA_ERROR_NO_DEVICE"],
    );
}

#[test]
fn config() {
    let e = crate::cli::load_config(None, Some("no-such-preset")).expect_err("refused");
    check(
        &e,
        expect!["exit 2: unknown preset `no-such-preset`; presets are: deepseek-v3.2, deepseek-v4-flash-bf16, sim-small"],
    );
}

#[test]
fn input() {
    let file = std::path::Path::new("saved.json");
    let not_json = crate::cli::sim::parse_scenario("{").expect_err("refused");
    assert!(matches!(not_json, ScenarioFileError::NotJson(_)));
    check(
        &CliError::input("--replay", file, not_json),
        expect!["exit 2: --replay saved.json: not a scenario: EOF while parsing an object at line 1 column 1"],
    );
    let mut sc = crate::scenario::draw(0, "swarm", None);
    sc.abort_rate = 2.0;
    let text = serde_json::to_string(&sc).expect("serialises");
    let invalid = crate::cli::sim::parse_scenario(&text).expect_err("refused");
    assert!(matches!(invalid, ScenarioFileError::Invalid(_)));
    check(
        &CliError::input("--replay", file, invalid),
        expect!["exit 2: --replay saved.json: invalid scenario: `abort_rate` = 2: must be a probability in 0..=1"],
    );
}

#[test]
fn input_trace_names_its_path_once() {
    let real = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/bad_inputs/data/decreasing.jsonl");
    let e = tierkv_engine::trace::read_trace(&real).expect_err("refused");
    check(
        &CliError::trace("--trace", std::path::Path::new("decreasing.jsonl"), e),
        expect!["exit 2: --trace decreasing.jsonl: line 3: timestamp 20 ms is earlier than line 2's 50 ms (a trace lists its requests in arrival order)"],
    );
}

#[test]
fn resources() {
    let a = replay_args(&[]);
    let (cfg, _) = crate::cli::replay::prepare(&a).expect("the defaults replay");
    let e = crate::cli::replay::check_memory(&cfg, &a, Some((1 << 30, "the test's budget")))
        .expect_err("refused");
    check(
        &e,
        expect!["exit 2: the replay would hold 4.17 GB (4096 pages x 4 layers on the device tier (--device-pages, --layers) in host memory on the CPU device, a host mirror 4x as large (--host-ratio)), over 90% of the test's budget, 1.07 GB: lower --device-pages, --layers or --host-ratio"],
    );
}

#[test]
fn merge() {
    let e = CliError::from(crate::shard::merge(&[], false).expect_err("refused"));
    check(
        &e,
        expect!["exit 2: tierkv campaign merge: no shard result to merge"],
    );
}

#[test]
fn output() {
    let e = CliError::output(
        "--json",
        std::path::Path::new("/full/disk.json"),
        std::io::Error::from_raw_os_error(28),
    );
    check(
        &e,
        expect!["exit 3: --json /full/disk.json: No space left on device (os error 28)"],
    );
}
