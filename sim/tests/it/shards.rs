//! Campaigns spread over processes: shard results merged equal the unsharded campaign's, merge
//! refuses what does not belong together, and the shipped cluster definitions (Kubernetes,
//! GitHub Actions, Slurm) run shard commands that agree with their shard counts.

use clap::Parser;
use serde_yaml::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use tierkv_sim::cli::{Cli, Command as Sub};
use tierkv_sim::shard::ShardResult;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tierkv-shards-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    dir
}

fn tierkv() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tierkv"))
}

/// `sim --profile quick --seeds SEEDS --jobs 1`: a small campaign on one worker.
fn quick(seeds: &str) -> [&str; 7] {
    ["sim", "--profile", "quick", "--seeds", seeds, "--jobs", "1"]
}

fn read(file: &Path) -> ShardResult {
    ShardResult::read(file).unwrap_or_else(|e| panic!("{e}"))
}

/// The fields that depend on the machine, not on the seeds: zeroed.
fn without_timing(mut r: ShardResult) -> ShardResult {
    r.wall_s = 0.0;
    r.worker_s = 0.0;
    r.jobs = 0;
    r.held_s = None;
    r.totals.wall_ns = 0;
    r
}

#[test]
fn shard_results_merged_equal_the_whole_campaign() {
    let dir = scratch("merge");
    let (seeds, n) = ("0..10", 3);
    // The shards as separate processes at once, as a cluster runs them.
    let children: Vec<_> = (0..n)
        .map(|i| {
            tierkv()
                .args(["sim", "--profile", "quick", "--seeds", seeds, "--jobs", "1"])
                .args([
                    "--shard",
                    &format!("{i}/{n}"),
                    "--keep-going",
                    "--no-shrink",
                ])
                .arg("--json")
                .arg(dir.join(format!("shard-{i}.json")))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start a shard")
        })
        .collect();
    for mut c in children {
        assert!(c.wait().expect("a shard ends").success(), "a clean shard");
    }
    let whole = dir.join("whole.json");
    let status = tierkv()
        .args(["sim", "--profile", "quick", "--seeds", seeds, "--jobs", "2"])
        .arg("--json")
        .arg(&whole)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("the whole campaign");
    assert!(status.success());
    let merged = dir.join("merged.json");
    let out = tierkv()
        .args(["campaign", "merge", "--coverage", "--rare", "--json"])
        .arg(&merged)
        .args((0..n).map(|i| dir.join(format!("shard-{i}.json"))))
        .output()
        .expect("merge");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("3 of 3 shards of seeds 0..10"), "{stdout}");
    assert!(stdout.contains("seeds run: 10"), "{stdout}");
    assert!(stdout.contains("probe "), "the coverage table: {stdout}");
    assert!(
        stdout.contains("happens-before pairs of accesses") && stdout.contains("if indep."),
        "the targets' table: {stdout}"
    );
    // Ten seeds leave many targets under 5% (combinations never met among them): the rare list
    // names each with its reason.
    let rare = (stdout.lines())
        .skip_while(|l| !l.starts_with("rare targets, reached in fewer than 5% of the 10 runs: "))
        .collect::<Vec<_>>();
    assert!(
        rare.len() > 1 && rare[1..].iter().any(|l| l.contains("%  combo.")),
        "the rare targets: {stdout}"
    );
    // Seeds are deterministic: the merged counts, coverage and totals are the whole campaign's.
    let (m, w) = (without_timing(read(&merged)), without_timing(read(&whole)));
    assert_eq!(m, w);
    assert_eq!(m.seeds_run, 10);
    // The targets (`targets`) travel in the shard files and merge as the probes do.
    assert!(
        m.coverage.keys().any(|n| n.starts_with("hb."))
            && m.coverage.contains_key("factor.ahead=off"),
        "{:?}",
        m.coverage.keys().collect::<Vec<_>>()
    );

    // Refused: a shard missing (unless --partial), another campaign, another
    // build, a file that is not a result.
    let shard = |i: usize| dir.join(format!("shard-{i}.json"));
    let merge = |files: &[PathBuf], extra: &[&str]| {
        let out = tierkv()
            .args(["campaign", "merge"])
            .args(extra)
            .args(files)
            .output()
            .expect("merge");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A shard given twice is a determinism check across the runs: equal logs merge once...
    let (code, out, _) = merge(&[shard(0), shard(1), shard(2), shard(0)], &[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("seeds ran in two runs of their shard"),
        "{out}"
    );
    assert!(out.contains("seeds run: 10"), "{out}");
    // ... and a seed whose log differs is refused.
    let mut twin = read(&shard(0));
    let seed = *twin.log_hashes.keys().next().expect("a seed's hash");
    twin.log_hashes.insert(seed, 1);
    let twin_file = dir.join("shard-0-elsewhere.json");
    std::fs::write(&twin_file, serde_json::to_string(&twin).unwrap()).unwrap();
    let (code, _, err) = merge(&[shard(0), shard(1), twin_file], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("event-log hashes differ"), "{err}");
    let (code, _, err) = merge(&[shard(0), shard(2)], &[]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("1 of 3 shards missing (index 1); `--partial` merges the 2 present"),
        "{err}"
    );
    let (code, out, _) = merge(&[shard(0), shard(2)], &["--partial"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains("PARTIAL: 1 of 3 shards missing (index 1)"),
        "{out}"
    );
    let (code, _, err) = merge(&[shard(0), whole.clone()], &[]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("another campaign") && err.contains("shard count 1 vs 3"),
        "{err}"
    );
    let mut other = read(&shard(1));
    other.build.source = "0".repeat(32);
    let other_file = dir.join("other-build.json");
    std::fs::write(&other_file, serde_json::to_string(&other).unwrap()).unwrap();
    let (code, _, err) = merge(&[shard(0), other_file, shard(2)], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("another build"), "{err}");
    let junk = dir.join("junk.json");
    std::fs::write(
        &junk,
        "{\"format\": \"tierkv-shard-result\", \"version\": 7}",
    )
    .unwrap();
    let (code, _, err) = merge(&[junk], &[]);
    assert_eq!(code, Some(2));
    assert!(err.contains("format version 7"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn yaml(rel: &str) -> Value {
    let text = std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// A shell command line as words: double quotes removed, `vars` substituted, `\` continuations
/// joined.
fn words(line: &str, vars: &[(&str, &str)]) -> Vec<String> {
    let mut s = line.replace("\\\n", " ");
    for (k, v) in vars {
        s = s.replace(k, v);
    }
    s.replace('"', "")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The `tierkv` command of `cmd` (from the word naming the binary on), parsed as the CLI does.
fn parse_tierkv(cmd: &[String], what: &str) -> Cli {
    let at = cmd
        .iter()
        .position(|w| w == "tierkv" || w.ends_with("/tierkv"))
        .unwrap_or_else(|| panic!("{what}: no tierkv command in {cmd:?}"));
    Cli::try_parse_from(&cmd[at..]).unwrap_or_else(|e| panic!("{what}: {cmd:?}: {e}"))
}

/// The shard of a parsed `tierkv sim` command, and whether it writes a result.
fn shard_of(cli: &Cli, what: &str) -> (u64, u64) {
    match &cli.command {
        Sub::Sim(a) => {
            assert!(
                a.json.is_some(),
                "{what}: each shard writes its result (--json)"
            );
            a.shard.unwrap_or_else(|| panic!("{what}: no --shard"))
        }
        other => panic!("{what}: not `tierkv sim`: {other:?}"),
    }
}

fn is_merge(cli: &Cli) -> bool {
    matches!(cli.command, Sub::Campaign(_))
}

#[test]
fn the_kubernetes_indexed_job_runs_one_shard_per_index() {
    let job = yaml("deploy/kubernetes/campaign-job.yaml");
    assert_eq!(job["kind"], "Job");
    let spec = &job["spec"];
    assert_eq!(spec["completionMode"], "Indexed");
    let n = spec["completions"].as_u64().expect("completions");
    let c = &spec["template"]["spec"]["containers"][0];
    let line = c["args"][0].as_str().expect("the shard command");
    for index in [0, n - 1] {
        let cmd = words(line, &[("$JOB_COMPLETION_INDEX", &index.to_string())]);
        let cli = parse_tierkv(&cmd, "campaign-job.yaml");
        assert_eq!(shard_of(&cli, "campaign-job.yaml"), (index, n));
    }
    let merge = yaml("deploy/kubernetes/merge-job.yaml");
    let line = merge["spec"]["template"]["spec"]["containers"][0]["args"][0]
        .as_str()
        .expect("the merge command");
    assert!(is_merge(&parse_tierkv(&words(line, &[]), "merge-job.yaml")));
    // Both jobs mount the claim that results-pvc.yaml makes.
    let pvc = yaml("deploy/kubernetes/results-pvc.yaml");
    for j in [&job, &merge] {
        let claim = &j["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"];
        assert_eq!(claim["claimName"], pvc["metadata"]["name"]);
    }
}

#[test]
fn the_github_actions_matrix_runs_every_shard_and_merges_them() {
    let wf = yaml(".github/workflows/nightly-campaign.yml");
    let jobs = &wf["jobs"];
    let matrix: Vec<u64> = jobs["shard"]["strategy"]["matrix"]["shard"]
        .as_sequence()
        .expect("a shard matrix")
        .iter()
        .map(|v| v.as_u64().expect("a shard index"))
        .collect();
    let n = matrix.len() as u64;
    assert_eq!(
        matrix,
        (0..n).collect::<Vec<_>>(),
        "indices 0..N, each once"
    );
    let run = jobs["shard"]["steps"]
        .as_sequence()
        .unwrap()
        .iter()
        .find_map(|s| s["run"].as_str().filter(|r| r.contains(" sim ")))
        .expect("the shard step");
    let line = run.lines().find(|l| l.contains(" sim ")).unwrap();
    let cmd = words(line, &[("${{ matrix.shard }}", "5")]);
    assert_eq!(
        shard_of(&parse_tierkv(&cmd, "workflow"), "workflow"),
        (5, n)
    );
    let needs: Vec<&str> = jobs["merge"]["needs"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(needs.contains(&"shard"), "the merge waits for every shard");
    assert_eq!(
        jobs["merge"]["if"], "always()",
        "it merges even when a shard found a bug"
    );
    let merge = jobs["merge"]["steps"]
        .as_sequence()
        .unwrap()
        .iter()
        .find_map(|s| s["run"].as_str().filter(|r| r.contains("campaign merge")))
        .expect("the merge step");
    let merge_line = merge
        .lines()
        .find(|l| l.contains("campaign merge"))
        .unwrap();
    let merge_cmd: Vec<String> = words(merge_line, &[])
        .into_iter()
        .take_while(|w| w != "|")
        .collect();
    assert!(is_merge(&parse_tierkv(&merge_cmd, "workflow merge")));
}

#[test]
fn the_slurm_job_array_runs_one_shard_per_task() {
    let dir = repo().join("deploy/slurm");
    for script in ["campaign.sbatch", "merge.sbatch", "submit.sh"] {
        let ok = Command::new("bash")
            .arg("-n")
            .arg(dir.join(script))
            .status()
            .map(|s| s.success());
        // Where bash is missing the syntax is not checked; elsewhere it must pass.
        assert!(ok.unwrap_or(true), "{script}: bash -n");
    }
    let text = std::fs::read_to_string(dir.join("campaign.sbatch")).unwrap();
    let array = text
        .lines()
        .find_map(|l| l.strip_prefix("#SBATCH --array="))
        .expect("#SBATCH --array");
    let (lo, hi) = array.split_once('-').expect("an index range");
    let (lo, hi): (u64, u64) = (lo.parse().unwrap(), hi.parse().unwrap());
    assert_eq!(lo, 0);
    let exec = &text[text.find("exec ").expect("the shard command")..];
    let vars = [
        ("$SLURM_ARRAY_TASK_ID", "7"),
        ("${SLURM_CPUS_PER_TASK:-16}", "16"),
        ("$results", "/results"),
        ("$tierkv", "tierkv"),
    ];
    let cmd = words(exec.trim_end(), &vars);
    assert_eq!(
        shard_of(&parse_tierkv(&cmd, "campaign.sbatch"), "campaign.sbatch"),
        (7, hi + 1)
    );
    let merge = std::fs::read_to_string(dir.join("merge.sbatch")).unwrap();
    let exec = &merge[merge.find("exec ").expect("the merge command")..];
    assert!(is_merge(&parse_tierkv(
        &words(exec.trim_end(), &vars),
        "merge.sbatch"
    )));
}

/// Guided shards (`--corpus` with `--json`): each grows its own corpus, its result counts the
/// runs that branched, and `campaign merge` adds them up.
#[test]
fn guided_shards_count_their_branches_and_merge() {
    let dir = scratch("guided");
    // 22 seeds a shard: past the corpus's warm-up of 20 runs, so each shard branches.
    for i in 0..2 {
        let status = tierkv()
            .args(quick("0..44"))
            .args(["--shard", &format!("{i}/2"), "--corpus"])
            .arg(dir.join(format!("corpus-{i}.json")))
            .arg("--json")
            .arg(dir.join(format!("shard-{i}.json")))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("a guided shard");
        assert!(status.success(), "a clean guided shard");
    }
    let shards: Vec<ShardResult> = (0..2)
        .map(|i| read(&dir.join(format!("shard-{i}.json"))))
        .collect();
    for r in &shards {
        assert_eq!(r.guided, Some(1));
        assert!(r.branches > 0, "a shard past its warm-up branches");
        assert_eq!(r.runs, r.seeds_run + r.branches);
    }
    let out = tierkv()
        .args(["campaign", "merge", "--json"])
        .arg(dir.join("merged.json"))
        .args((0..2).map(|i| dir.join(format!("shard-{i}.json"))))
        .output()
        .expect("merge");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let m = read(&dir.join("merged.json"));
    assert_eq!(m.branches, shards[0].branches + shards[1].branches);
    assert_eq!((m.seeds_run, m.guided), (44, Some(1)));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A failing branch is replayable only from its decisions: a guided shard's result names the
/// schedule file written for it, and that line replays the failure.
#[cfg(feature = "mutants")]
#[test]
fn a_failing_branch_in_a_shard_result_replays_from_its_schedule_file() {
    let dir = scratch("branch-fails");
    let corpus = dir.join("corpus.json");
    // A clean campaign grows the corpus past its warm-up.
    let status = tierkv()
        .args(quick("0..24"))
        .arg("--corpus")
        .arg(&corpus)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("the clean campaign");
    assert!(status.success());
    // A mutant the quick profile catches at once (top-k ignores index_topk: it failed each of
    // 8 quick seeds tried); the test needs one of its branches to fail, and finds one.
    let zoo = || Command::new(env!("CARGO_BIN_EXE_tierkv-zoo"));
    let result = dir.join("result.json");
    let out = zoo()
        .args(quick("100..102"))
        .args([
            "--mutant",
            "topk-hardcoded-512",
            "--keep-going",
            "--no-shrink",
        ])
        .arg("--corpus")
        .arg(&corpus)
        .arg("--json")
        .arg(&result)
        .arg("--out-dir")
        .arg(dir.join("out"))
        .output()
        .expect("the mutant's campaign");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let r = read(&result);
    let branch = r
        .failures
        .iter()
        .find(|f| tierkv_sim::schedule::is_branch(f.schedule))
        .unwrap_or_else(|| panic!("a failing branch among {:#?}", r.failures));
    assert!(
        r.branches > 0 && r.runs == r.seeds_run + r.branches,
        "{r:?}"
    );
    // `cargo run … -- sim --seed N … --schedule FILE`: its arguments, on the zoo binary.
    let (_, args) = branch
        .replay
        .split_once(" -- ")
        .unwrap_or_else(|| panic!("a cargo run line: {}", branch.replay));
    let file = args
        .split(" --schedule ")
        .nth(1)
        .expect("the replay names a schedule file");
    assert!(Path::new(file).is_file(), "{file} was written");
    let replay = zoo()
        .args(args.split(' '))
        .arg("--out-dir")
        .arg(dir.join("replay"))
        .output()
        .expect("the replay");
    let stdout = String::from_utf8_lossy(&replay.stdout);
    assert_eq!(replay.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(&format!("FAIL seed {}", branch.seed)),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
