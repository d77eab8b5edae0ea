//! `tierkv-zoo bench --catch`: how soon a campaign finds each bug of the zoo, in CPU-seconds and
//! seeds, for this build and, with `--baseline BIN`, another `tierkv-zoo` binary in the same run
//! (the measure of issue "find bugs sooner per CPU-second": a change to the simulator that runs
//! seeds faster but finds bugs later is no gain).
//!
//! Each campaign is one child process, `BIN sim --mutant M --seeds A..B --jobs 1 --no-shrink`
//! (under the `pd` profile for the prefill/decode mutants, as the zoo runs them), which stops at
//! its first failure. The figure of a catch is the CPU time the campaign counts up to its first
//! failing run's verdict (its `first failure after X CPU-seconds` line, on its one worker
//! thread: every seed before the failing one in full, with the one in 16 that a campaign runs
//! twice to check determinism, and the failing seed to its verdict): what a campaign spends to
//! find the bug, without what it does after (the determinism rerun every failing seed gets, the
//! rerun that prints the report and the traced run that writes its trace). A build that does not
//! print that line (one from before it) is measured by the kernel's count of the whole child
//! (`wait4`), an upper bound of its time to catch; the report says how many campaigns were
//! measured each way, and warns when a comparison mixes them. The seed of the catch is read from
//! the campaign's `FAIL seed N` line. A campaign that catches nothing within its seeds counts its
//! whole CPU time (`wait4`), marked `>` (a lower bound of the time to catch). A campaign that
//! never ends holds the bench: it sets no time limit of its own.
//!
//! Repeat `r` runs the seeds `A + r·W .. A + (r+1)·W` (`W` = the width of `--seeds`), so each
//! repeat samples how soon a campaign catches a mutant on seeds no other repeat runs, not the
//! same seeds timed again. Campaigns run `--jobs` at a time, alternating the builds, so both meet the same
//! machine load. The report gives per mutant the median over the repeats; over the zoo, the
//! geometric mean and the median of those medians, the geometric mean over the slowest quarter
//! (by the baseline's time, or this build's without one), and the geometric mean of each repeat
//! alone (the spread). The mutants of the host tier for vLLM (`--profile vllm`) are not in it:
//! that profile takes other flags, and its whole 100-seed campaign takes about 2 s.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// One zoo mutant to catch: its name and the profile it runs under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub name: String,
    pub profile: String,
}

pub struct Plan {
    pub targets: Vec<Target>,
    /// The seeds of repeat 0, `first..first + width`.
    pub first: u64,
    pub width: u64,
    pub repeat: usize,
    /// Campaigns run at once (each on one worker thread).
    pub jobs: usize,
    /// Where the campaigns write their failure artifacts and their stderr.
    pub out_dir: PathBuf,
    /// `--guided`: the corpus file and the profile it holds.
    pub guided: Option<(PathBuf, String)>,
    /// `--with`: the sim flags of the configuration measured against plain campaigns.
    pub with: Option<Vec<String>>,
}

impl Plan {
    fn seeds(&self, repeat: usize) -> (u64, u64) {
        let a = self.first + repeat as u64 * self.width;
        (a, a + self.width)
    }
}

/// One configuration the bench measures: a binary and, for a guided campaign, the corpus file
/// each campaign starts from a copy of and the profile it holds (its mutants of another profile
/// run plain).
#[derive(Clone, Debug)]
pub struct Config {
    pub bin: PathBuf,
    /// How the report names it.
    pub name: String,
    pub corpus: Option<(PathBuf, String)>,
    /// Sim flags each campaign of it is given besides the bench's own (`--with`).
    pub args: Vec<String>,
}

impl Config {
    pub fn plain(bin: PathBuf, name: String) -> Config {
        Config {
            bin,
            name,
            corpus: None,
            args: Vec::new(),
        }
    }
}

/// One campaign's outcome.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Catch {
    /// Seeds run up to and including the first failing one; `None`: none failed. For a guided
    /// campaign, whose failing run may branch from a checkpoint of any seed, the fresh seeds it
    /// ran (its `seeds run: N` line).
    pub seeds: Option<u64>,
    /// CPU-seconds to the catch (see the module's doc), or the whole campaign's when nothing
    /// was caught.
    pub cpu_s: f64,
    /// Whether `cpu_s` is the campaign's own count to the verdict (`false`: the whole child's,
    /// an upper bound of a catch's time).
    pub exact: bool,
}

/// What a campaign printed that says where it caught the mutant: the `FAIL seed N` line.
pub fn caught_at(stdout: &str) -> Option<u64> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("FAIL seed ")?.trim().parse().ok())
}

/// The fresh seeds a campaign ran, from its summary's `seeds run: N` line.
pub fn seeds_run(stdout: &str) -> Option<u64> {
    stdout.lines().find_map(|l| {
        l.strip_prefix("seeds run: ")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The CPU-seconds to the first failure a campaign counted itself (its `first failure after X
/// CPU-seconds` line), where the build prints it.
pub fn cpu_to_catch(stdout: &str) -> Option<f64> {
    stdout.lines().find_map(|l| {
        let s: f64 = l
            .strip_prefix(crate::campaign::FIRST_FAILURE_AFTER)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        (s.is_finite() && s >= 0.0).then_some(s)
    })
}

/// The most a campaign's stdout may hold here (a summary and one failure: tens of kilobytes).
const STDOUT_BYTES_MAX: u64 = 4 << 20;

/// Runs one campaign of configuration `build` and measures it; its artifacts, its copy of the
/// corpus and its stderr go to a folder of its own under `out_dir`.
fn campaign(
    (build, config): (usize, &Config),
    t: &Target,
    seeds: (u64, u64),
    out_dir: &Path,
) -> Result<Catch, String> {
    let bin = config.bin.as_path();
    let dir = out_dir.join(format!("build{build}-{}-{}", t.name, seeds.0));
    let corpus_args = prepare(config, t, &dir)?;
    let guided = !corpus_args.is_empty();
    let stderr_path = dir.join("stderr");
    let stderr = std::fs::File::create(&stderr_path)
        .map_err(|e| format!("{}: {e}", stderr_path.display()))?;
    let range = format!("{}..{}", seeds.0, seeds.1);
    let args = [
        "sim",
        "--profile",
        &t.profile,
        "--mutant",
        &t.name,
        "--seeds",
        &range,
        "--jobs",
        "1",
        "--no-shrink",
        "--out-dir",
    ];
    let mut child = spawn(bin, (&args, &dir), &corpus_args, config, stderr)?;
    let stdout = super::bench_campaign::read_stdout(&mut child, STDOUT_BYTES_MAX);
    let (code, cpu_s) = wait_measured(child.id())?;
    let text = String::from_utf8_lossy(&stdout);
    let extra = config.args.join(" ");
    let what = || {
        format!(
            "{} {} {} {extra}",
            bin.display(),
            args.join(" "),
            dir.display()
        )
    };
    match (code, caught_at(&text)) {
        (Some(1), Some(seed)) if (seeds.0..seeds.1).contains(&seed) || guided => {
            let own = cpu_to_catch(&text);
            let seeds_to_catch = match guided {
                true => {
                    seeds_run(&text).ok_or_else(|| format!("{}: no `seeds run` line", what()))?
                }
                false => seed - seeds.0 + 1,
            };
            Ok(Catch {
                seeds: Some(seeds_to_catch),
                cpu_s: own.unwrap_or(cpu_s),
                exact: own.is_some(),
            })
        }
        (Some(0), None) => Ok(Catch {
            seeds: None,
            cpu_s,
            exact: false,
        }),
        _ => Err(no_outcome(&what(), code, &stderr_path)),
    }
}

/// Starts `bin` with `args` and the folder `dir` after them, then `corpus_args` and `config`'s
/// own flags, its stdout piped and its stderr to `stderr`, ended with this process.
fn spawn(
    bin: &Path,
    (args, dir): (&[&str], &Path),
    corpus_args: &[String],
    config: &Config,
    stderr: std::fs::File,
) -> Result<std::process::Child, String> {
    let mut cmd = Command::new(bin);
    super::bench_campaign::ends_with_this_process(&mut cmd);
    cmd.args(args)
        .arg(dir)
        .args(corpus_args)
        .args(&config.args)
        .stdin(Stdio::null())
        .stderr(stderr)
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: could not run it: {e}", bin.display()))
}

/// Why a campaign `what` that ended with `code` has no outcome: the last line of its stderr.
fn no_outcome(what: &str, code: Option<i32>, stderr_path: &Path) -> String {
    let err = std::fs::read_to_string(stderr_path).unwrap_or_default();
    let last = err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    format!(
        "{what}: ended with {} and no caught seed in its output{}",
        code.map_or("a signal".to_string(), |c| format!("exit {c}")),
        if last.is_empty() {
            String::new()
        } else {
            format!(": {last}")
        }
    )
}

/// Makes a campaign's folder `dir`, and returns the corpus arguments of a campaign of `t`: for
/// a guided configuration a fresh copy of its corpus in `dir`; none for a plain one or a
/// mutant of another profile than the corpus's.
fn prepare(config: &Config, t: &Target, dir: &Path) -> Result<Vec<String>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let Some((file, _)) = config.corpus.as_ref().filter(|(_, p)| *p == t.profile) else {
        return Ok(Vec::new());
    };
    let copy = dir.join("corpus.json");
    std::fs::copy(file, &copy).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(vec!["--corpus".to_string(), copy.display().to_string()])
}

/// Waits for child `pid` and takes its exit code (`None`: a signal ended it) and CPU seconds
/// (user + system) from the kernel.
fn wait_measured(pid: u32) -> Result<(Option<i32>, f64), String> {
    let mut status: libc::c_int = 0;
    // SAFETY: `rusage` is plain integers, for which all-zero bytes are a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4 writes one status and one `rusage` we own; `pid` is our own child,
        // not waited for elsewhere (its `Child` is dropped without a wait).
        let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut u) };
        if rc == pid as libc::pid_t {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("waiting for campaign process {pid}: {e}"));
        }
    }
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Ok((code, super::bench_campaign::rusage_cpu_s(&u)))
}

/// Every campaign's outcome: `[build][target][repeat]`.
pub type Outcomes = Vec<Vec<Vec<Catch>>>;

/// Runs every campaign of every configuration, `plan.jobs` at a time.
pub fn run_all(bins: &[Config], plan: &Plan) -> Result<Outcomes, String> {
    let mut tasks = Vec::new();
    for r in 0..plan.repeat {
        for t in 0..plan.targets.len() {
            for b in 0..bins.len() {
                tasks.push((b, t, r));
            }
        }
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Catch, String>>>> = Mutex::new(vec![None; tasks.len()]);
    std::thread::scope(|s| {
        for _ in 0..plan.jobs.clamp(1, tasks.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(b, t, r)) = tasks.get(i) else {
                    break;
                };
                let out = campaign(
                    (b, &bins[b]),
                    &plan.targets[t],
                    plan.seeds(r),
                    &plan.out_dir,
                );
                let failed = out.is_err();
                results.lock().expect("no worker panics holding it")[i] = Some(out);
                if failed {
                    // The others finish the campaign they run; none starts another.
                    next.store(tasks.len(), Ordering::Relaxed);
                }
            });
        }
    });
    let results = results.into_inner().expect("no worker panics holding it");
    let mut out = vec![vec![Vec::with_capacity(plan.repeat); plan.targets.len()]; bins.len()];
    for (&(b, t, _), r) in tasks.iter().zip(results) {
        match r {
            Some(Ok(c)) => out[b][t].push(c),
            Some(Err(e)) => return Err(e),
            None => {}
        }
    }
    if out.iter().flatten().any(|runs| runs.len() != plan.repeat) {
        return Err("a campaign failed to run, so the others were stopped".into());
    }
    Ok(out)
}

fn geomean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (mut sum, mut n) = (0.0, 0);
    for x in xs {
        sum += x.max(1e-9).ln();
        n += 1;
    }
    if n == 0 {
        0.0
    } else {
        (sum / n as f64).exp()
    }
}

/// The median of `xs` (the mean of the middle two of an even count).
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => xs[n / 2],
        _ => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// One build's campaigns of one mutant, summed up: the median CPU time over the repeats, and
/// whether every repeat caught it.
fn per_mutant(runs: &[Catch]) -> (f64, bool) {
    (
        median(runs.iter().map(|c| c.cpu_s).collect()),
        runs.iter().all(|c| c.seeds.is_some()),
    )
}

fn cell(runs: &[Catch]) -> String {
    let each: Vec<String> = runs
        .iter()
        .map(|c| match c.seeds {
            Some(n) => format!("{n} seeds {:.1} s", c.cpu_s),
            None => format!("not caught >{:.1} s", c.cpu_s),
        })
        .collect();
    each.join("; ")
}

/// How the catches were measured: how many by the campaign's own count to the verdict, how
/// many by the whole child's CPU time (a build that does not count it), and a warning when
/// both kinds are compared.
fn measured(out: &Outcomes) -> String {
    let caught: Vec<&Catch> = out
        .iter()
        .flatten()
        .flatten()
        .filter(|c| c.seeds.is_some())
        .collect();
    let exact = caught.iter().filter(|c| c.exact).count();
    let whole = caught.len() - exact;
    let mut s = format!(
        "{exact} catch{} measured by the campaign's CPU time to the failing run's verdict, {whole} by the whole campaign's (the kernel's count, an upper bound: a build that does not count the first)",
        if exact == 1 { "" } else { "es" }
    );
    if exact > 0 && whole > 0 {
        s += "; WARNING: the two measures are compared here, which favours the exact one";
    }
    s
}

/// The report: a row per mutant, then the zoo's figures for each configuration and their
/// ratios.
pub fn report(plan: &Plan, bins: &[Config], out: &Outcomes) -> String {
    let (a, b) = (plan.seeds(0), plan.seeds(plan.repeat - 1));
    let mut s = format!(
        "catch bench: {} mutants, {} repeat{} (seeds {}..{} to {}..{}), {} campaign{} at once; CPU-seconds of each campaign, which ends at its first failure: {}\n\n",
        plan.targets.len(),
        plan.repeat,
        if plan.repeat == 1 { "" } else { "s" },
        a.0, a.1, b.0, b.1,
        plan.jobs,
        if plan.jobs == 1 { "" } else { "s" },
        measured(out),
    );
    let names: Vec<String> = bins.iter().map(|c| c.name.clone()).collect();
    s += "| mutant | profile |";
    for n in &names {
        s += &format!(" {n}: each repeat | median CPU s |");
    }
    s += "\n|---|---|";
    s += &"---|---|".repeat(bins.len());
    s.push('\n');
    for (t, target) in plan.targets.iter().enumerate() {
        s += &format!("| {} | {} |", target.name, target.profile);
        for build in out {
            let (m, all) = per_mutant(&build[t]);
            s += &format!(
                " {} | {}{m:.2} |",
                cell(&build[t]),
                if all { "" } else { ">" }
            );
        }
        s.push('\n');
    }
    s.push('\n');
    s += &summary(plan, &names, out);
    s
}

/// The zoo's figures per build: geometric mean and median of the per-mutant medians, the
/// slowest quarter's geometric mean, each repeat's geometric mean, and against the baseline the
/// ratios and every mutant caught more than twice as late.
fn summary(plan: &Plan, names: &[String], out: &Outcomes) -> String {
    let medians: Vec<Vec<f64>> = out
        .iter()
        .map(|build| build.iter().map(|runs| per_mutant(runs).0).collect())
        .collect();
    // The slowest quarter by the baseline's time (the last build), or this build's alone.
    let by = medians.last().expect("one build at least");
    let mut order: Vec<usize> = (0..by.len()).collect();
    order.sort_by(|&x, &y| by[y].total_cmp(&by[x]));
    let slow: Vec<usize> = order[..by.len().div_ceil(4)].to_vec();
    let mut s = String::new();
    let mut figures = Vec::new();
    for (i, build) in out.iter().enumerate() {
        let m = &medians[i];
        let caught: usize = build.iter().flatten().filter(|c| c.seeds.is_some()).count();
        let geo = geomean(m.iter().copied());
        let slow_geo = geomean(slow.iter().map(|&t| m[t]));
        let per_repeat: Vec<String> = (0..plan.repeat)
            .map(|r| format!("{:.2}", geomean(build.iter().map(|runs| runs[r].cpu_s))))
            .collect();
        s += &format!(
            "{}: caught in {caught} of {} campaigns; CPU-seconds to the first catch, over the mutants' medians: geometric mean {geo:.2}, median {:.2}, slowest quarter ({} mutants) geometric mean {slow_geo:.2}; geometric mean of each repeat: {}\n",
            names[i],
            build.len() * plan.repeat,
            median(m.clone()),
            slow.len(),
            per_repeat.join(", "),
        );
        figures.push((geo, slow_geo));
    }
    if out.len() == 2 {
        let ((g0, s0), (g1, s1)) = (figures[0], figures[1]);
        s += &format!(
            "{} / {}: geometric mean {:.2}x, slowest quarter {:.2}x (above 1: the second catches sooner)\n",
            names[1],
            names[0],
            g1 / g0.max(1e-9),
            s1 / s0.max(1e-9)
        );
        let later: Vec<String> = plan
            .targets
            .iter()
            .enumerate()
            .filter(|&(t, _)| medians[0][t] > 2.0 * medians[1][t])
            .map(|(t, target)| {
                format!(
                    "{} ({:.2} s against {:.2} s)",
                    target.name, medians[0][t], medians[1][t]
                )
            })
            .collect();
        s += &if later.is_empty() {
            format!(
                "no mutant is caught more than twice as late as by {}\n",
                names[1]
            )
        } else {
            format!(
                "caught more than twice as late as by {}: {}\n",
                names[1],
                later.join(", ")
            )
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caught_seed_is_read_from_the_fail_line() {
        let out = "== tierkv sim summary (profile swarm)\nseeds run: 4   failures: 1\nFAIL seed 2\n  finding: [race] ...\n";
        assert_eq!(caught_at(out), Some(2));
        assert_eq!(caught_at("seeds run: 4   failures: 0\n"), None);
        assert_eq!(caught_at("FAIL seed x\n"), None);
        assert_eq!(seeds_run(out), Some(4));
        assert_eq!(
            seeds_run("seeds run: 3 (6 runs: schedules explored, 3 branches from the corpus)"),
            Some(3)
        );
        assert_eq!(seeds_run("FAIL seed 2\n"), None);
    }

    #[test]
    fn the_time_to_the_catch_is_read_from_the_campaigns_own_line() {
        let out = "seeds run: 3   failures: 1\nfirst failure after 1.729 CPU-seconds of runs (the workers' time ...)\nwall time: 3.3 s\n";
        assert_eq!(cpu_to_catch(out), Some(1.729));
        assert_eq!(cpu_to_catch("seeds run: 3   failures: 0\n"), None);
        assert_eq!(cpu_to_catch("first failure after x CPU-seconds\n"), None);
        assert_eq!(cpu_to_catch("first failure after NaN CPU-seconds\n"), None);
        assert_eq!(cpu_to_catch("first failure after inf CPU-seconds\n"), None);
        // The line a campaign prints is the line read.
        let summary = crate::campaign::CampaignSummary {
            cpu_to_first_failure: Some(std::time::Duration::from_millis(1500)),
            ..Default::default()
        };
        let line = summary.first_failure_line().expect("a failure's line");
        assert_eq!(cpu_to_catch(&format!("seeds run: 2\n{line}\n")), Some(1.5));
    }

    #[test]
    fn the_zoo_figures_and_the_ratios() {
        let plan = Plan {
            targets: ["a", "b", "c", "d"]
                .map(|n| Target {
                    name: n.into(),
                    profile: "swarm".into(),
                })
                .to_vec(),
            first: 0,
            width: 100,
            repeat: 3,
            jobs: 2,
            out_dir: PathBuf::from("x"),
            guided: None,
            with: None,
        };
        let c = |cpu_s: f64| Catch {
            seeds: Some(1),
            cpu_s,
            exact: true,
        };
        let runs = |x: [f64; 3]| x.map(c).to_vec();
        // This build: a, b, c as in the baseline halved; d four times as late, once not caught.
        let this = vec![
            runs([1.0, 2.0, 3.0]),
            runs([2.0, 2.0, 2.0]),
            runs([4.0, 4.0, 4.0]),
            vec![
                c(8.0),
                c(8.0),
                Catch {
                    seeds: None,
                    cpu_s: 8.0,
                    exact: false,
                },
            ],
        ];
        let base = vec![
            runs([4.0, 4.0, 4.0]),
            runs([4.0, 4.0, 4.0]),
            runs([8.0, 8.0, 8.0]),
            runs([2.0, 2.0, 2.0]),
        ];
        let bins = [
            Config::plain(PathBuf::from("me"), "this build".into()),
            Config::plain(PathBuf::from("old"), "baseline `old`".into()),
        ];
        let r = report(&plan, &bins, &vec![this, base.clone()]);
        assert!(r.contains("23 catches measured by the campaign's CPU time to the failing run's verdict, 0 by the whole campaign's"), "{r}");
        assert!(!r.contains("WARNING"), "{r}");
        let mut older = base;
        older[0][0].exact = false;
        let mixed = report(&plan, &bins, &vec![older.clone(), older]);
        assert!(mixed.contains("22 catches measured by the campaign's CPU time to the failing run's verdict, 2 by the whole campaign's"), "{mixed}");
        assert!(
            mixed.contains("WARNING: the two measures are compared here"),
            "{mixed}"
        );
        // Medians 2, 2, 4, 8 against 4, 4, 8, 2: geometric means 3.36 and 4.0; the slowest
        // quarter by the baseline is c (4 against 8).
        assert!(
            r.contains("this build: caught in 11 of 12 campaigns"),
            "{r}"
        );
        assert!(
            r.contains(
                "geometric mean 3.36, median 3.00, slowest quarter (1 mutants) geometric mean 4.00"
            ),
            "{r}"
        );
        assert!(
            r.contains(
                "geometric mean 4.00, median 4.00, slowest quarter (1 mutants) geometric mean 8.00"
            ),
            "{r}"
        );
        assert!(
            r.contains("baseline `old` / this build: geometric mean 1.19x, slowest quarter 2.00x"),
            "{r}"
        );
        assert!(
            r.contains("twice as late as by baseline `old`: d (8.00 s against 2.00 s)"),
            "{r}"
        );
        assert!(
            r.contains("| d | swarm | 1 seeds 8.0 s; 1 seeds 8.0 s; not caught >8.0 s | >8.00 |"),
            "{r}"
        );
        assert!(
            r.contains("geometric mean of each repeat: 2.83, 3.36, 3.72"),
            "{r}"
        );
    }
}
