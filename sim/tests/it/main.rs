//! The simulator's own tests: a fixed set of seeds (a longer campaign with
//! `TIERKV_SIM_SEEDS=N`), the CLI's behaviour on good and bad input.

mod bad_inputs;
mod corpus;
mod cut;
mod driver_faults;
mod independence;
mod loads;
mod offload;
mod shards;
mod targets;

use std::process::Command;
#[cfg(target_os = "linux")]
use std::time::{Duration, Instant};
use tierkv_sim::campaign::{run_campaign, CampaignOptions};

fn campaign(profile: &str, first: u64, end: u64) -> CampaignOptions {
    CampaignOptions {
        first,
        end,
        jobs: 2,
        shard: None,
        profile: profile.into(),
        mutant: None,
        progress: false,
        stop_at_first: false,
        trace_records: None,
        cuda: false,
        schedules: 1,
        overlap: None,
        exhaustive: false,
        corpus: None,
        branches: 0,
        requests_max: None,
        cut_share: None,
    }
}

/// The clean engine has no findings on a fixed set of seeds. `TIERKV_SIM_SEEDS=N` runs seeds
/// `0..N` instead (a long campaign; not part of the default test run).
#[test]
fn fixed_seeds_have_no_findings() {
    // Set and wrong is an error, not the default campaign run as if it were the one asked for.
    let n: u64 =
        match std::env::var("TIERKV_SIM_SEEDS") {
            Ok(v) => v.trim().parse().ok().filter(|&n| n > 0).unwrap_or_else(|| {
                panic!("TIERKV_SIM_SEEDS={v:?}: give a number of seeds, 1 or more")
            }),
            Err(std::env::VarError::NotPresent) => DEFAULT_TEST_SEEDS,
            Err(e) => panic!("TIERKV_SIM_SEEDS: {e}"),
        };
    let s = run_campaign(&campaign("swarm", 0, n), |_| {}).expect("the workers start");
    assert_eq!(s.seeds_run, n);
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    assert!(
        s.totals.loads > 0 && s.totals.backups > 0,
        "the seeds exercise loads and backups"
    );
    assert!(s.totals.digests_checked > 0 && s.totals.rows_checked > 0);
    assert!(
        s.totals.requeued > 0,
        "the seeds exercise a recreated context (running requests requeued)"
    );
    if n == DEFAULT_TEST_SEEDS {
        every_probe_is_hit(&s.coverage);
    }
}

/// Seeds that once failed the clean engine because of a mistake in the simulator's model, each
/// with what it was: they stay in the default tests (their scenario draws are fixed; their
/// schedules and timings may move with later changes, so a pass here is a floor, not a proof).
const REGRESSIONS: &[(&str, u64, &str)] = &[(
    "swarm",
    1050,
    "a hung run of a page copy (a linear copy, `copy per run`) left garbage its pages were not \
     marked as holding, so the engine's read before it learnt of the failure was a finding",
)];

#[test]
fn seeds_that_once_failed_have_no_findings() {
    for &(profile, seed, what) in REGRESSIONS {
        let s =
            run_campaign(&campaign(profile, seed, seed + 1), |_| {}).expect("the workers start");
        assert_eq!(s.seeds_run, 1);
        assert!(
            s.failures.is_empty(),
            "{profile} seed {seed} ({what}): {:#?}",
            s.failures
        );
    }
}

/// Seeds of the default test campaign: 25, the first `0..N` that reached every probe since the
/// fault draws were keyed (seed 24 is the first to hit `ahead.row_stale`; checked again at
/// `bcbe539`'s draws and at `5dcde38`'s, with the driver's own faults); every probe but `COLD`'s
/// since PCT's strict holds, and every probe again since the runtime uploads a step's arrays
/// once (its driver calls, and so the seeds' schedules, changed: `step.waited_for_load` is hit
/// again).
const DEFAULT_TEST_SEEDS: u64 = 25;

/// Probes the default test campaign does not reach yet, each with the reason. A probe listed here
/// that the campaign starts hitting fails the test too, so the list stays true.
const COLD: &[(&str, &str)] = &[];

/// The default test campaign reaches every coverage probe but the ones `COLD` lists.
fn every_probe_is_hit(c: &tierkv_sim::probes::Coverage) {
    let cold: Vec<&str> = c.below(f64::MIN_POSITIVE);
    for name in &cold {
        assert!(
            COLD.iter().any(|(n, _)| n == name),
            "probe {name} was never hit by the default test campaign:\n{}",
            c.table()
        );
    }
    for (name, why) in COLD {
        assert!(
            cold.contains(name),
            "probe {name} is now hit: take it out of COLD (it said: {why})"
        );
    }
}

/// Prefill/decode pairs (the `pd` profile): no findings, and the pair's transfers happen —
/// every request crosses the link, some transfers fail and are sent again, layers go out of
/// order, and a side's context is recreated under transfers in flight, its exports
/// recomputed.
#[test]
fn pd_pairs_have_no_findings() {
    let s = run_campaign(&campaign("pd", 0, 6), |_| {}).expect("the workers start");
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    assert!(s.totals.finished > 0 && s.totals.digests_checked > 0);
    for probe in [
        "pd.admitted",
        "pd.layers_reordered",
        "pd.transfer_failed",
        "pd.decode_full",
        "pd.context_recreated",
        "pd.export_requeued",
    ] {
        assert!(
            s.coverage
                .probes
                .get(probe)
                .is_some_and(|&(hits, _)| hits > 0),
            "probe {probe} never hit:\n{}",
            s.coverage.table()
        );
    }
}

/// The production model's shapes (64 indexer heads, top-2048, contexts of 16K to 128K tokens,
/// a layer range of the 61 layers), with a load-back in some seeds.
#[test]
fn production_shapes_have_no_findings() {
    let s = run_campaign(&campaign("production", 0, 3), |_| {}).expect("the workers start");
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    assert_eq!(s.totals.finished, 12);
}

/// 60+ concurrent tool-call sessions sharing a system prompt.
#[test]
fn sixty_concurrent_sessions_have_no_findings() {
    let s = run_campaign(&campaign("sessions", 0, 2), |_| {}).expect("the workers start");
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    assert!(s.totals.finished >= 60);
}

/// Arrivals the schedule defers past a step reach the engine once, at the next step: the
/// runner's ledger (`Ends` in `runner.rs`) panics on an arrival delivered twice, or on one that
/// never ended when a run ends with nothing left to arrive. These runs under explored schedules
/// defer one-shots, and end so.
#[test]
fn deferred_arrivals_are_delivered_exactly_once() {
    let opts = CampaignOptions {
        schedules: 3,
        ..campaign("swarm", 0, 4)
    };
    let s = run_campaign(&opts, |_| {}).expect("the workers start");
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    assert!(
        s.totals.oneshots_deferred > 0,
        "the explored schedules deferred no one-shot"
    );
    assert!(
        s.totals.arrivals_checked > 0,
        "no run ended with nothing left to arrive, where the ledger is checked"
    );
}

#[test]
fn needle_workloads_have_no_findings() {
    let s = run_campaign(&campaign("needle", 0, 4), |_| {}).expect("the workers start");
    assert!(s.failures.is_empty(), "failures: {:#?}", s.failures);
    // ... and they ran: requests finished, their reads and digests were judged, and some of
    // their queries were held to the specification's logits.
    let t = &s.totals;
    assert_eq!(s.seeds_run, 4);
    assert!(t.finished >= 16, "{} requests finished", t.finished);
    assert!(t.digests_checked > 0 && t.rows_checked > 0, "{t:?}");
    assert!(t.queries_recomputed > 0, "{t:?}");
}

#[test]
fn shards_partition_the_seeds() {
    let mut all = Vec::new();
    for i in 0..3 {
        let mut o = campaign("quick", 0, 20);
        o.shard = Some((i, 3));
        all.extend(o.seeds().iter());
    }
    all.sort();
    assert_eq!(all, (0..20).collect::<Vec<_>>());
    // Counted, not listed: the largest ranges and shards cost nothing to describe.
    let big = tierkv_sim::campaign::SeedSet::new(0, u64::MAX, Some((7, 1_000_000_000_000)));
    assert_eq!(big.len(), 18_446_745);
    assert_eq!(big.nth(1), Some(1_000_000_000_007));
    assert_eq!(
        tierkv_sim::campaign::SeedSet::new(0, 1, Some((1, 2))).len(),
        0
    );
    assert_eq!(
        tierkv_sim::campaign::SeedSet::new(5, 6, Some((1, 2))).first(),
        Some(5)
    );
}

fn tierkv(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        .args(args)
        .output()
        .expect("run tierkv");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_shows_the_layouts() {
    let (code, out, _) = tierkv(&["check-config", "--preset", "deepseek-v4-flash-bf16"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("index_k/bf16")
            && out.contains("256 B/token/layer")
            && out.contains("16384 B/page"),
        "{out}"
    );
    let (code, out, _) = tierkv(&["check-config", "--preset", "deepseek-v3.2"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("132 B/token/layer")
            && out.contains("8448 B/page")
            && out.contains("656 B/token/layer"),
        "{out}"
    );
    assert!(
        out.contains("YaRN factor 40") && out.contains("scale_fmt ue8m0"),
        "{out}"
    );
    assert!(!out.contains("unconfirmed"), "{out}");
}

/// A preset's values that public material does not confirm are printed as such.
#[test]
fn check_config_names_unconfirmed_preset_values() {
    let (code, out, _) = tierkv(&["check-config", "--preset", "deepseek-v4-flash-bf16"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("unconfirmed: model.layers = 43")
            && out.contains("unconfirmed: model.rope_theta"),
        "{out}"
    );
    let (code, out, _) = tierkv(&["check-config"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("YaRN factor 40 (rope_yarn configured; original_seq_len 4096, context 2048"),
        "{out}"
    );
}

#[test]
fn check_config_refuses_bad_input_with_exit_code_2() {
    let dir = std::env::temp_dir().join(format!("tierkv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.toml");
    std::fs::write(&f, "preset = \"sim-small\"\n[model]\nindex_topk = 0\n").unwrap();
    let (code, _, err) = tierkv(&["check-config", f.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("index_topk"), "{err}");
    let (code, _, err) = tierkv(&["check-config", "--preset", "nope"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown preset"), "{err}");
    let (code, _, _) = tierkv(&["sim", "--seeds", "5..2"]);
    assert_eq!(code, 2);
    let (code, _, err) = tierkv(&["sim", "--profile", "nope", "--seed", "1"]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn one_seed_runs_from_the_command_line() {
    let (code, out, err) = tierkv(&["sim", "--seed", "3", "--profile", "quick"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("ok: no findings") && out.contains("event-log hash"),
        "{out}"
    );
}

/// A device that cannot recover from a fault (a CUDA context with an asynchronous error is lost)
/// stops the engine with a typed error naming it: no panic, no endless retry.
#[test]
fn a_device_that_cannot_recover_stops_the_engine_with_a_typed_error() {
    use tierkv_engine::{Config, Engine, EngineError, EngineOptions, RequestSpec};
    let opts = tierkv_sim::gpu::GpuOptions {
        failed_kernel_rate: 1.0,
        sticky_faults: true,
        recover_fails: true,
        ..Default::default()
    };
    let gpu = tierkv_sim::gpu::SimGpu::new(3, opts).expect("a simulated GPU");
    let clock = gpu.clock();
    let cfg = Config::preset("sim-small").expect("preset");
    let mut e = Engine::new(cfg, gpu, clock, EngineOptions::default()).expect("an engine");
    let spec = RequestSpec {
        prompt: (0..100).collect(),
        max_new_tokens: 4,
    };
    e.submit(spec).expect("a valid request");
    let err = (0..10)
        .find_map(|_| e.step().err())
        .expect("the engine stops within a few steps");
    match err {
        EngineError::Device(d) => assert!(d.to_string().contains("did not survive"), "{d}"),
        other => panic!("not the device's error: {other}"),
    }
}

/// A build without CUDA refuses `--device cuda` with a typed error that says how to get it,
/// both in the library and on the command line (exit code 2), instead of panicking.
#[cfg(not(feature = "cuda"))]
#[test]
fn device_cuda_without_a_cuda_build_is_a_clear_error() {
    let opts = tierkv_sim::gpu::GpuOptions {
        cuda: true,
        ..Default::default()
    };
    let err = tierkv_sim::gpu::SimGpu::new(1, opts)
        .err()
        .expect("no CUDA executor");
    assert!(err.to_string().contains("--features cuda"), "{err}");
    let (code, _, err) = tierkv(&["sim", "--seed", "1", "--device", "cuda"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--features cuda"), "{err}");
}

/// Checking the arguments changes nothing on disk: a refused command leaves the `--trace-out`
/// file as it was and creates no `--out-dir`.
#[test]
fn refused_commands_leave_files_alone() {
    let dir = std::env::temp_dir().join(format!("tierkv-refused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keep = dir.join("keep.json");
    std::fs::write(&keep, "keep").unwrap();
    let out = dir.join("new/a/b");
    let (code, _, err) = tierkv(&[
        "sim",
        "--seeds",
        "0..1",
        "--jobs",
        "0",
        "--trace-out",
        keep.to_str().unwrap(),
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), "keep");
    assert!(
        !dir.join("new").exists(),
        "the refused command made --out-dir"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tierkv replay --pd` on the CPU: the built-in excerpt's first requests through a
/// prefill/decode pair and through one engine are equal, request by request (exit code 0), and
/// both roles' `/metrics` are printed; two GPUs without `--device cuda` is a usage error.
#[test]
fn replay_pd_equals_one_engine_on_the_cpu() {
    let out = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        // Small tiers (about 0.8 GB for the three engines), so that the memory check passes on
        // a small machine too.
        .args([
            "replay",
            "--pd",
            "--requests",
            "3",
            "--layers",
            "1",
            "--device-pages",
            "2048",
            "--host-ratio",
            "1.5",
        ])
        .output()
        .expect("runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("pair = single engine: 3 of 3 requests equal"),
        "{text}"
    );
    assert!(
        text.contains("# prefill engine /metrics") && text.contains("# decode engine /metrics"),
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        .args(["replay", "--pd", "--pd-gpus", "2", "--requests", "1"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("add --device cuda"));
}

/// A full device as stderr (an error that cannot even be told) exits with the documented 3, not
/// a panic report.
#[test]
fn an_unwritable_stderr_exits_3() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("no /dev/full here: skipped");
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        .args(["check-config", "/nonexistent/tierkv.toml"])
        .stderr(full)
        .output()
        .expect("run tierkv");
    assert_eq!(out.status.code(), Some(3), "{out:?}");
}

/// SIGTERM mid-campaign: the runs that ended are printed and written (`--json`, marked
/// interrupted), the process exits 143 at once, and `campaign merge` takes the result only with
/// `--partial`. The signal is sent once the process catches it (Linux's /proc says so), so
/// the outcome does not depend on timing.
#[cfg(target_os = "linux")]
#[test]
fn sigterm_keeps_the_finished_seeds() {
    let dir = std::env::temp_dir().join(format!("tierkv-sigterm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("shard.json");
    let child = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        .args(["sim", "--seeds", "0..1000", "--jobs", "2", "--json"])
        .arg(&json)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run tierkv");
    let status = format!("/proc/{}/status", child.id());
    let catches_term = || {
        let text = std::fs::read_to_string(&status).unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|mask| mask & (1 << (SIGTERM - 1)) != 0)
    };
    // The handler is installed before any seed runs; a process that never installs it is
    // caught by the harness's own time limit, not by a clock here.
    while !catches_term() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    let out = child.wait_with_output().expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(143), "{stdout}");
    assert!(stdout.contains("INTERRUPTED by signal 15"), "{stdout}");
    let text = std::fs::read_to_string(&json).expect("the result is written");
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(r["interrupted"], true);
    let merge = |partial: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_tierkv"));
        c.args(["campaign", "merge"]);
        if partial {
            c.arg("--partial");
        }
        c.arg(&json).output().expect("merge").status.code()
    };
    assert_eq!(
        merge(false),
        Some(2),
        "an interrupted shard needs --partial"
    );
    assert_eq!(merge(true), Some(0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// SIGTERM's number on Linux.
#[cfg(target_os = "linux")]
const SIGTERM: u32 = 15;

/// A top-k op on scratch buffers of `gpu`: one row of 64 positions, its top 8 (an op for the
/// fault tests to fail; its bytes do not matter).
fn one_row_topk(gpu: &mut tierkv_sim::gpu::SimGpu) -> tierkv_engine::device::Op {
    use tierkv_engine::device::{BufferDesc, BufferRole, Device, MemoryTier, Op, Region, TopK};
    use tierkv_engine::layout::{Bytes, LayoutFingerprint};
    let mut scratch = |bytes: u64| {
        let buffer = gpu
            .alloc(BufferDesc {
                role: BufferRole::Scratch { name: "test" },
                tier: MemoryTier::Device,
                bytes: Bytes(bytes),
                fingerprint: LayoutFingerprint::unpaged(bytes),
            })
            .expect("a scratch buffer");
        Region {
            buffer,
            offset: Bytes::ZERO,
            bytes: Bytes(bytes),
        }
    };
    let (logits, out) = (scratch(64 * 4), scratch(8 * 4));
    Op::TopK(TopK {
        args: tierkv_engine::device::args::TopK {
            k: 8,
            stride: 64,
            context_lens: vec![64].into(),
            page_table: vec![0].into(),
            pt_stride: 1,
        },
        logits,
        out,
    })
}

/// CUDA's faults at the `Device` seam: with `context_faults` a kernel that fails leaves its side
/// in error, and a hung one (`hang_rate`) fails when the watchdog gives up on it, one virtual
/// second after it started; then every call — event creation, record, wait, enqueue — fails
/// with `DeviceError::InError` naming the fault, until `recover`, after which calls succeed.
/// Recovering recreates the context: the device memory is lost (garbage), pinned host memory
/// keeps its bytes, and the context's generation moves on.
#[test]
fn a_fault_leaves_the_side_in_error_until_it_is_recovered() {
    use tierkv_engine::device::{Device, DeviceError, DeviceFault, EventState, StreamKind};
    use tierkv_sim::gpu::{GpuOptions, SimGpu, WATCHDOG_NS};
    for hang in [false, true] {
        let opts = GpuOptions {
            failed_kernel_rate: if hang { 0.0 } else { 1.0 },
            hang_rate: if hang { 1.0 } else { 0.0 },
            context_faults: !hang,
            ..Default::default()
        };
        let mut gpu = SimGpu::new(5, opts).expect("a simulated GPU");
        let clock = gpu.clock();
        let topk = one_row_topk(&mut gpu);
        let kept = |gpu: &mut SimGpu, tier| {
            use tierkv_engine::device::{BufferDesc, BufferRole};
            use tierkv_engine::layout::{Bytes, LayoutFingerprint};
            let b = gpu
                .alloc(BufferDesc {
                    role: BufferRole::Scratch { name: "kept" },
                    tier,
                    bytes: Bytes(64),
                    fingerprint: LayoutFingerprint::unpaged(64),
                })
                .expect("a buffer");
            gpu.mem.bufs[b.0 as usize] = (0..64).collect();
            b
        };
        use tierkv_engine::device::MemoryTier;
        let (dev, host) = (
            kept(&mut gpu, MemoryTier::Device),
            kept(&mut gpu, MemoryTier::PinnedHost),
        );
        let ev = gpu.new_event().expect("a device not in error");
        let start = tierkv_engine::device::Clock::now_ns(&clock);
        gpu.enqueue(StreamKind::Compute, topk.clone())
            .expect("enqueued");
        gpu.record(StreamKind::Compute, ev).expect("recorded");
        assert_eq!(gpu.synchronize(ev), EventState::Failed, "hang {hang}");
        let waited = tierkv_engine::device::Clock::now_ns(&clock) - start;
        assert_eq!(waited >= WATCHDOG_NS, hang, "waited {waited} ns");
        let in_error = |r: Result<(), DeviceError>| match r {
            Err(DeviceError::InError { cause }) => cause,
            other => panic!("expected InError, got {other:?}"),
        };
        let cause = in_error(gpu.new_event().map(|_| ()));
        match cause {
            DeviceFault::Failed { op, stream } => {
                assert!(!hang);
                assert_eq!((op, stream), ("topk", StreamKind::Compute));
            }
            DeviceFault::Hung {
                op,
                stream,
                after_ns,
            } => {
                assert!(hang);
                assert_eq!(
                    (op, stream, after_ns),
                    ("topk", StreamKind::Compute, WATCHDOG_NS)
                );
            }
        }
        assert_eq!(in_error(gpu.record(StreamKind::Load, ev)), cause);
        assert_eq!(in_error(gpu.wait(StreamKind::Write, ev)), cause);
        assert_eq!(
            in_error(gpu.enqueue(StreamKind::Compute, topk.clone())),
            cause
        );
        // Recovered, and with no more faults, the same work runs and its event completes.
        assert_eq!(gpu.context_generation(), 0);
        gpu.recover().expect("recovered");
        assert_eq!(gpu.context_generation(), 1, "hang {hang}: recreated");
        let pattern: Vec<u8> = (0..64).collect();
        assert_ne!(
            gpu.mem.bytes(dev),
            &pattern[..],
            "the device's bytes are lost"
        );
        assert_eq!(gpu.mem.bytes(host), &pattern[..], "the host's are kept");
        gpu.stop_faults();
        let ev2 = gpu.new_event().expect("calls succeed after recover");
        gpu.wait(StreamKind::Write, ev)
            .expect("a wait after recover");
        gpu.enqueue(StreamKind::Compute, topk.clone())
            .expect("an enqueue after recover");
        gpu.record(StreamKind::Compute, ev2)
            .expect("a record after recover");
        assert_eq!(gpu.synchronize(ev2), EventState::Done, "hang {hang}");
        assert!(gpu.findings.is_empty(), "{:?}", gpu.findings);
    }
}

/// Without `context_faults` a failed kernel leaves only its stream in error (the per-stream
/// sticky model): the device's calls are not refused, and the stream's later record fails
/// until `recover`.
#[test]
fn without_context_faults_a_fault_stays_on_its_stream() {
    use tierkv_engine::device::{Device, EventState, StreamKind};
    use tierkv_sim::gpu::{GpuOptions, SimGpu};
    let opts = GpuOptions {
        failed_kernel_rate: 1.0,
        sticky_faults: true,
        ..Default::default()
    };
    let mut gpu = SimGpu::new(5, opts).expect("a simulated GPU");
    let topk = one_row_topk(&mut gpu);
    let ev = gpu.new_event().expect("an event");
    gpu.enqueue(StreamKind::Compute, topk).expect("enqueued");
    gpu.record(StreamKind::Compute, ev).expect("recorded");
    assert_eq!(gpu.synchronize(ev), EventState::Failed);
    // The other streams' calls go on; the failed stream's next record still fails.
    let (load, compute) = (
        gpu.new_event().expect("an event"),
        gpu.new_event().expect("an event"),
    );
    gpu.record(StreamKind::Load, load)
        .expect("a record on another stream");
    gpu.record(StreamKind::Compute, compute)
        .expect("a record on the failed stream");
    assert_eq!(gpu.synchronize(load), EventState::Done);
    assert_eq!(gpu.synchronize(compute), EventState::Failed);
    gpu.recover().expect("recovered");
    assert_eq!(gpu.context_generation(), 0, "recovered in place");
    gpu.record(StreamKind::Compute, compute)
        .expect("a record after recover");
    assert_eq!(gpu.synchronize(compute), EventState::Done);
}

/// Every drawn scenario is one the simulator accepts: a campaign draws (and validates) all of its
/// seeds' scenarios before it runs the first, so one invalid draw stops it. Swarm seeds
/// `0..20_000` and the first 2,000 of each other profile that needs no trace file. (Before
/// this test, swarm seed 813 drew a host tier with no more whole pages than the device tier,
/// which stopped any campaign over it, and production seed 15 drew pools over the simulator's
/// memory limit of then, so that its saved scenario could not be replayed.)
#[test]
fn drawn_scenarios_are_valid_and_read_back_exactly() {
    for (profile, seeds) in [
        ("swarm", 20_000),
        ("sessions", 2_000),
        ("needle", 2_000),
        ("quick", 2_000),
        ("production", 2_000),
        ("pd", 2_000),
    ] {
        for seed in 0..seeds {
            let sc = tierkv_sim::scenario::draw(seed, profile, None);
            if let Err(e) = sc.validate() {
                panic!("{profile} seed {seed} drew an invalid scenario: {e}");
            }
            // A scenario file replays the scenario it was written from: every rate and every
            // other number reads back exactly, so the fingerprint a schedule names still
            // matches (serde_json's `float_roundtrip`; without it, sessions seed 24's
            // failed_kernel_rate read back one ulp off).
            if seed % 8 == 0 {
                let text = serde_json::to_string_pretty(&sc).expect("a scenario serialises");
                let back: tierkv_sim::scenario::Scenario =
                    serde_json::from_str(&text).expect("a scenario reads back");
                assert_eq!(
                    back.fingerprint(),
                    sc.fingerprint(),
                    "{profile} seed {seed} does not read back as written"
                );
            }
        }
    }
}

/// A scenario saved before `model.rope_yarn` existed replays with the rule it ran under (the
/// reference's), not the new default; one that names the key keeps it.
#[test]
fn a_scenario_without_the_yarn_rule_keeps_the_reference_one() {
    use tierkv_engine::config::YarnRule;
    use tierkv_sim::cli::sim::parse_scenario;
    let read_back = |sc: &tierkv_sim::scenario::Scenario| {
        let text = serde_json::to_string(sc).expect("a scenario serialises");
        let back = parse_scenario(&text).expect("a saved scenario reads back");
        back.engine_config().model.rope_yarn
    };
    let sc = tierkv_sim::scenario::draw(1, "swarm", None);
    assert_eq!(read_back(&sc), sc.engine_config().model.rope_yarn);
    let mut old = sc.clone();
    old.config = old
        .config
        .lines()
        .filter(|l| !l.starts_with("rope_yarn"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(read_back(&old), YarnRule::ContextAboveOriginal);
}

/// A simulated GPU replaying `decisions`, with `one_row_topk` enqueued on its compute stream
/// and an event recorded behind it.
fn one_row_topk_recorded(
    decisions: Vec<u8>,
) -> (tierkv_sim::gpu::SimGpu, tierkv_engine::device::EventId) {
    use tierkv_engine::device::{Device, StreamKind};
    let opts = tierkv_sim::gpu::GpuOptions {
        schedule: tierkv_sim::schedule::Source::Replay(decisions),
        ..Default::default()
    };
    let mut gpu = tierkv_sim::gpu::SimGpu::new(5, opts).expect("a simulated GPU");
    let topk = one_row_topk(&mut gpu);
    let ev = gpu.new_event().expect("an event");
    gpu.enqueue(StreamKind::Compute, topk).expect("enqueued");
    gpu.record(StreamKind::Compute, ev).expect("recorded");
    (gpu, ev)
}

/// A host blocked in `synchronize` resumes when the schedule says (`schedule::Kind::Sync`): `d`
/// quarter-jitters after the record completed; a synchronize that does not block makes no
/// decision.
#[test]
fn a_synchronize_returns_as_the_schedule_decides() {
    use tierkv_engine::device::{Clock, Device, EventState};
    use tierkv_sim::gpu::GpuOptions;
    use tierkv_sim::schedule::Kind;
    let sync = Kind::Sync as usize;
    let mut resumed = Vec::new();
    for d in [0u8, 3, 11] {
        // Decision 0 holds the op (0: it starts at once), decision 1 is the synchronize's.
        let (mut gpu, ev) = one_row_topk_recorded(vec![0, d]);
        let (clock, jitter) = (gpu.clock(), GpuOptions::default().jitter_ns);
        assert_eq!(gpu.synchronize(ev), EventState::Done);
        let c = gpu.decision_counts();
        assert_eq!(
            (c.made[sync], c.taken[sync]),
            (1, (d > 0) as u64),
            "d = {d}"
        );
        resumed.push((d, clock.now_ns(), jitter));
        // The record is done and the host past it: no block, no decision.
        assert_eq!(gpu.synchronize(ev), EventState::Done);
        assert_eq!(gpu.decision_counts().made[sync], 1, "d = {d}");
    }
    let (_, at_once, _) = resumed[0];
    for &(d, at, jitter) in &resumed[1..] {
        assert_eq!(at - at_once, d as u64 * jitter / 4, "d = {d}");
    }
}

/// A hold decision `BEHIND + j` (PCT's strict order) holds the op that could start until the op
/// running on stream `j` ends; hold 0 starts it beside that op.
#[test]
fn a_hold_behind_a_stream_waits_for_its_running_op() {
    use tierkv_engine::device::{Device, EventState, StreamKind};
    use tierkv_sim::schedule::BEHIND;
    let compute = StreamKind::Compute.index();
    for behind in [false, true] {
        let hold = if behind { BEHIND + compute as u8 } else { 0 };
        let opts = tierkv_sim::gpu::GpuOptions {
            schedule: tierkv_sim::schedule::Source::Replay(vec![0, hold]),
            trace: true,
            ..Default::default()
        };
        let mut gpu = tierkv_sim::gpu::SimGpu::new(5, opts).expect("a simulated GPU");
        let (a, b) = (one_row_topk(&mut gpu), one_row_topk(&mut gpu));
        let ev = gpu.new_event().expect("an event");
        gpu.enqueue(StreamKind::Compute, a).expect("enqueued");
        gpu.enqueue(StreamKind::Load, b).expect("enqueued");
        gpu.record(StreamKind::Load, ev).expect("recorded");
        assert_eq!(gpu.synchronize(ev), EventState::Done);
        let slice = |stream: usize| {
            let s = gpu.trace.slices.iter().find(|s| s.stream == stream);
            s.expect("the op ran").clone()
        };
        let (a, b) = (slice(compute), slice(StreamKind::Load.index()));
        assert!(
            b.start_ns < a.end_ns || behind,
            "hold 0: beside it, {a:?} {b:?}"
        );
        if behind {
            assert_eq!(b.start_ns, a.end_ns, "held behind it: {a:?} {b:?}");
        }
        assert_eq!(&gpu.take_schedule()[..2], &[0, hold]);
    }
}

/// The host's decisions (`schedule::Kind`): a query of a record that the running op before it
/// would pass within a jitter answers Done when the schedule says so (that op ends at once) and
/// Pending otherwise; a query just after a record passed answers Pending when the schedule says
/// so, and Done with no decision once a jitter has gone by; a record the host has seen is never
/// answered Pending again.
#[test]
fn queries_in_a_window_answer_as_the_schedule_decides() {
    use tierkv_engine::device::{Clock, Device, EventState};
    use tierkv_sim::schedule::Kind;
    let early = Kind::QueryEarly as usize;
    let late = Kind::QueryLate as usize;
    for (list, first) in [
        (vec![0, 1], EventState::Done),
        (vec![0, 0, 1], EventState::Pending),
        (vec![0, 0, 0], EventState::Pending),
    ] {
        let (mut gpu, ev) = one_row_topk_recorded(list.clone());
        let clock = gpu.clock();
        assert_eq!(gpu.query(ev), first, "{list:?}");
        let c = gpu.decision_counts();
        assert_eq!(
            (c.made[early], c.taken[early]),
            (1, list[1] as u64),
            "{list:?}"
        );
        if first == EventState::Done {
            // Seen: no later query is in a window.
            gpu.advance_host_to(clock.now_ns() + 1_000);
            assert_eq!(gpu.query(ev), EventState::Done);
            assert_eq!(gpu.decision_counts().made[late], 0);
            continue;
        }
        // The op (about 4 to 6 µs) has ended 10 µs on, within the 20 µs jitter.
        gpu.advance_host_to(clock.now_ns() + 10_000);
        let want = if list[2] == 1 {
            EventState::Pending
        } else {
            EventState::Done
        };
        assert_eq!(gpu.query(ev), want, "{list:?}");
        let c = gpu.decision_counts();
        assert_eq!(
            (c.made[late], c.taken[late]),
            (1, list[2] as u64),
            "{list:?}"
        );
        gpu.advance_host_to(clock.now_ns() + 20_000);
        assert_eq!(gpu.query(ev), EventState::Done, "{list:?}");
        assert_eq!(
            gpu.decision_counts().made[late],
            1,
            "no decision past the window"
        );
        assert_eq!(gpu.take_schedule(), list);
    }
}

/// The children of process `pid` (from /proc), with their states.
#[cfg(target_os = "linux")]
fn children_of(pid: u32) -> Vec<(u32, char)> {
    let mut kids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces, so read after the last ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (Some(state), Some(ppid)) = (f.next(), f.next()) else {
            continue;
        };
        if ppid.parse() == Ok(pid) {
            let id = head.split_whitespace().next().and_then(|p| p.parse().ok());
            kids.extend(id.map(|id| (id, state.chars().next().unwrap_or('?'))));
        }
    }
    kids
}

/// Whether process `pid` is still running (not gone, not a zombie awaiting its reaper).
#[cfg(target_os = "linux")]
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('Z'))
        })
        .is_some_and(|zombie| !zombie)
}

/// SIGTERM to `tierkv bench --campaign` ends the campaign it started too (issue: a stopped
/// bench left its child campaign running). The waits below only guard against a hang: the test
/// polls for what it needs and has no time budget of its own.
#[cfg(target_os = "linux")]
#[test]
fn a_stopped_campaign_bench_leaves_no_campaign_running() {
    const HANG: Duration = Duration::from_secs(600);
    let mut bench = Command::new(env!("CARGO_BIN_EXE_tierkv"))
        .args(["bench", "--campaign", "--seeds", "0..100000", "--jobs", "1"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run tierkv bench");
    let t = Instant::now();
    let child = loop {
        if let Some(&(pid, _)) = children_of(bench.id()).first() {
            break pid;
        }
        assert!(t.elapsed() < HANG, "the bench started no campaign");
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: sends a signal to the bench, a child of this process not yet waited for.
    assert_eq!(unsafe { libc::kill(bench.id() as i32, libc::SIGTERM) }, 0);
    let status = bench.wait().expect("the bench ends");
    assert_eq!(status.code(), None, "ended by the signal: {status:?}");
    let t = Instant::now();
    while running(child) {
        if t.elapsed() >= HANG {
            // SAFETY: sends a signal to a process this test's bench started; none is left behind.
            unsafe { libc::kill(child as i32, libc::SIGKILL) };
            panic!("campaign {child} still running {HANG:?} after the bench ended (killed now)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A single run's progress lines change nothing it does: the same event log with a line after
/// every engine step as without any.
#[test]
fn progress_lines_leave_the_run_as_it_was() {
    let sc = tierkv_sim::scenario::draw(3, "quick", None);
    let mut quiet = tierkv_sim::runner::run(&sc, &tierkv_sim::runner::RunOptions::default());
    let mut chatty = tierkv_sim::runner::run(
        &sc,
        &tierkv_sim::runner::RunOptions {
            progress: Some(std::time::Duration::ZERO),
            ..Default::default()
        },
    );
    assert!(quiet.stats.steps > 1, "the run stepped");
    assert_eq!(quiet.log_hash, chatty.log_hash);
    // Everything but the wall time it took.
    (quiet.stats.wall_ns, chatty.stats.wall_ns) = (0, 0);
    assert_eq!(quiet.stats, chatty.stats);
}
