//! `tierkv bench --campaign`: the simulator's speed on the default profile, measured the same way
//! for this build and, with `--baseline BIN`, for another `tierkv` binary in the same run (an
//! earlier build: the figures of a change are measured against what it replaced, on the same
//! machine at the same time).
//!
//! Each build runs `sim --seeds A..B --jobs J --coverage --keep-going --no-shrink` as a child
//! process. Its wall time is timed here and its CPU time taken from the kernel's accounting of
//! the child (`getrusage`), so neither depends on what the build reports about itself; the
//! counts (seeds, ops, checked reads) and the coverage table are read from its summary, whose
//! lines every build since the coverage table has printed. Checked reads are the KV and index-K
//! rows the content oracle compared (those ops read, and those the end-of-run conservation
//! audit compared) or knew unchanged since compared. A probe's reach is the share of seeds that hit it: a faster build that reaches
//! fewer probes, or reaches them in fewer seeds, is a blinder one, and the report says so: every
//! probe whose share fell, and over the probes both builds hit, the seeds that hit each per
//! CPU-second, this build over the baseline (reach per second: what a swarm sized for speed must
//! not lose). Both builds run the same seeds, and a change that leaves a seed's run as it was
//! leaves its probes as they were, so any fall is a change in what the seeds do.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// What one build's campaign did, measured from outside.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub seeds: u64,
    pub failures: u64,
    pub ops: u64,
    pub checked_reads: u64,
    pub wall_s: f64,
    pub cpu_s: f64,
    /// Probe → share of seeds that hit it.
    pub reach: BTreeMap<String, f64>,
}

/// The campaign's arguments for `sim`.
pub struct Plan {
    pub first: u64,
    pub end: u64,
    pub jobs: usize,
    pub profile: String,
}

/// CPU time (user + system), seconds, of `who`: `libc::RUSAGE_SELF` (this process) or
/// `libc::RUSAGE_CHILDREN` (its waited-for children).
pub fn cpu_s(who: libc::c_int) -> f64 {
    // SAFETY: `rusage` is plain integers, for which all-zero bytes are a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one `rusage` we own; the callers pass a valid target.
    let rc = unsafe { libc::getrusage(who, &mut u) };
    assert_eq!(rc, 0, "getrusage({who}) failed");
    rusage_cpu_s(&u)
}

/// The CPU time (user + system) a `rusage` counts, seconds.
pub(super) fn rusage_cpu_s(u: &libc::rusage) -> f64 {
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The child's stdout, read to its end or to `max` bytes: a binary that prints without end, or
/// whose output cannot be read, is killed rather than held (the caller still waits for it).
pub(super) fn read_stdout(child: &mut std::process::Child, max: u64) -> Vec<u8> {
    let mut stdout = Vec::new();
    let read = child
        .stdout
        .take()
        .expect("stdout is piped")
        .take(max)
        .read_to_end(&mut stdout);
    if read.is_err() || stdout.len() as u64 >= max {
        let _ = child.kill();
    }
    stdout
}

/// CPU time of the waited-for children of this process, seconds.
fn children_cpu_s() -> f64 {
    cpu_s(libc::RUSAGE_CHILDREN)
}

/// Makes the child `cmd` starts receive SIGTERM when the thread that starts it ends (Linux's
/// `PR_SET_PDEATHSIG` follows the parent thread). `measure` starts it on the bench's main thread
/// and blocks there until it ends, so a bench stopped by SIGTERM, SIGINT or SIGKILL leaves no
/// campaign running; the child writes what it finished, as any campaign does on SIGTERM.
/// Elsewhere than Linux the child outlives a killed bench.
pub(super) fn ends_with_this_process(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: between fork and exec the closure calls only async-signal-safe functions
        // (prctl, getppid, kill, getpid) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent may have ended before the prctl took hold: end now, as it asks.
                if libc::getppid() != parent {
                    libc::kill(libc::getpid(), libc::SIGTERM);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// The most a campaign's output may hold (its summary, coverage table and failures are tens of
/// kilobytes).
const SUMMARY_BYTES_MAX: u64 = 16 << 20;

/// Runs `bin`'s campaign and measures it.
pub fn measure(bin: &Path, plan: &Plan) -> Result<Measured, String> {
    let cpu0 = children_cpu_s();
    let t0 = Instant::now();
    let mut cmd = Command::new(bin);
    ends_with_this_process(&mut cmd);
    let mut child = cmd
        .args(["sim", "--profile", &plan.profile, "--seeds"])
        .arg(format!("{}..{}", plan.first, plan.end))
        .args(["--jobs", &plan.jobs.to_string()])
        .args(["--coverage", "--keep-going", "--no-shrink"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: could not run it: {e}", bin.display()))?;
    let stdout = read_stdout(&mut child, SUMMARY_BYTES_MAX);
    let status = child
        .wait()
        .map_err(|e| format!("{}: could not wait for it: {e}", bin.display()))?;
    let out = std::process::Output {
        status,
        stdout,
        stderr: Vec::new(),
    };
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu_s = children_cpu_s() - cpu0;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut m = parse_summary(&text).map_err(|e| {
        format!(
            "{}: did not print a tierkv sim summary (it ended with {}; {e})",
            bin.display(),
            out.status
        )
    })?;
    if !matches!(out.status.code(), Some(0) | Some(1)) {
        return Err(format!(
            "{}: the campaign ended with {}",
            bin.display(),
            out.status
        ));
    }
    m.wall_s = wall_s;
    m.cpu_s = cpu_s;
    Ok(m)
}

/// The number just before `unit` in `line` (`6734` in `..., 6734 ops, ...`).
fn number_before(line: &str, unit: &str) -> Option<u64> {
    let at = line.find(unit)?;
    line[..at]
        .split(|c: char| !c.is_ascii_digit())
        .rfind(|w| !w.is_empty())?
        .parse()
        .ok()
}

/// Reads a campaign summary's counts and coverage table.
pub fn parse_summary(text: &str) -> Result<Measured, String> {
    let mut m = Measured::default();
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .ok_or_else(|| format!("no `{prefix}` line in its summary"))
    };
    let seeds = line("seeds run:")?;
    m.seeds = seeds
        .trim_start_matches("seeds run:")
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .ok_or("no seed count")?;
    m.failures = seeds
        .split("failures:")
        .nth(1)
        .and_then(|w| w.split_whitespace().next()?.parse().ok())
        .ok_or("no failure count")?;
    let checked = line("checked:")?;
    m.ops = number_before(checked, " ops").ok_or("no op count")?;
    let compared = number_before(checked, " KV/index-K rows compared").ok_or("no rows compared")?;
    let unchanged = number_before(checked, " unchanged since compared").unwrap_or(0);
    m.checked_reads = compared + unchanged;
    let mut table = false;
    for l in text.lines() {
        if l.starts_with("probe ") {
            table = true;
            continue;
        }
        if !table {
            continue;
        }
        let w: Vec<&str> = l.split_whitespace().collect();
        match w.as_slice() {
            [name, _hits, pct, ..] if pct.ends_with('%') => {
                let share: f64 = pct
                    .trim_end_matches('%')
                    .parse()
                    .map_err(|_| format!("coverage line `{l}`"))?;
                m.reach.insert(name.to_string(), share / 100.0);
            }
            _ => break,
        }
    }
    if m.reach.is_empty() {
        return Err("no coverage table in its summary".into());
    }
    Ok(m)
}

fn row(name: &str, m: &Measured) -> String {
    let per = |x: f64, t: f64| x / t.max(1e-9);
    format!(
        "| {name} | {} | {} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0} | {:.0} | {} of {} |",
        m.seeds,
        m.failures,
        m.wall_s,
        m.cpu_s,
        per(m.seeds as f64, m.wall_s),
        per(m.ops as f64, m.wall_s),
        per(m.checked_reads as f64, m.wall_s),
        per(m.checked_reads as f64, m.cpu_s),
        m.reach.values().filter(|&&r| r >= 0.05).count(),
        m.reach.len(),
    )
}

/// The report: one row per build, the ratios, and every probe this build reaches in a smaller
/// share of seeds than the baseline (or not at all).
pub fn report(plan: &Plan, this: &Measured, base: Option<(&Path, &Measured)>) -> String {
    let mut s = format!(
        "campaign bench: profile {}, seeds {}..{}, {} worker{}\n\n",
        plan.profile,
        plan.first,
        plan.end,
        plan.jobs,
        if plan.jobs == 1 { "" } else { "s" }
    );
    s += "| build | seeds | failures | wall s | CPU s | seeds/s | ops/s | checked reads/s | checked reads per CPU-s | probes in >= 5% of seeds |\n";
    s += "|---|---|---|---|---|---|---|---|---|---|\n";
    s += &row("this build", this);
    s.push('\n');
    if let Some((bin, b)) = base {
        s += &row(&format!("baseline `{}`", bin.display()), b);
        s.push('\n');
        let ratio = |x: f64, y: f64| x / y.max(1e-12);
        s += &format!(
            "\nthis build / baseline: seeds/s {:.2}x, checked reads per CPU-second {:.2}x\n",
            ratio(
                this.seeds as f64 / this.wall_s.max(1e-9),
                b.seeds as f64 / b.wall_s.max(1e-9)
            ),
            ratio(
                this.checked_reads as f64 / this.cpu_s.max(1e-9),
                b.checked_reads as f64 / b.cpu_s.max(1e-9)
            ),
        );
        let lower: Vec<String> = b
            .reach
            .iter()
            .filter_map(|(p, &was)| {
                let now = this.reach.get(p).copied().unwrap_or(0.0);
                (now < was).then(|| format!("{p} {:.1}% (was {:.1}%)", now * 100.0, was * 100.0))
            })
            .collect();
        if lower.is_empty() {
            s += "probe reach: no probe is hit in a smaller share of seeds than in the baseline\n";
        } else {
            s += &format!(
                "probe reach: {} probes hit in a smaller share of seeds than in the baseline: {}\n",
                lower.len(),
                lower.join(", ")
            );
        }
        s += &reach_per_cpu_s(this, b);
        let new: Vec<&String> = this
            .reach
            .keys()
            .filter(|p| !b.reach.contains_key(*p))
            .collect();
        if !new.is_empty() {
            s += &format!(
                "probes the baseline does not have: {}\n",
                new.iter()
                    .map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    s
}

/// Reach per CPU-second: for each probe both builds hit, the seeds that hit it per CPU-second of
/// the campaign, this build's over the baseline's. A build that runs seeds faster but hits a
/// probe in fewer of them finds what that probe stands for sooner only if this ratio is above 1.
/// Probes the baseline hits and this build does not are counted apart (their ratio is 0).
fn reach_per_cpu_s(this: &Measured, b: &Measured) -> String {
    let rate = |m: &Measured, share: f64| share * m.seeds as f64 / m.cpu_s.max(1e-9);
    let mut ratios: Vec<(f64, &str)> = Vec::new();
    let mut lost = 0;
    for (p, &was) in &b.reach {
        let now = this.reach.get(p).copied().unwrap_or(0.0);
        if was > 0.0 && now > 0.0 {
            ratios.push((rate(this, now) / rate(b, was), p.as_str()));
        } else if was > 0.0 {
            lost += 1;
        }
    }
    if ratios.is_empty() {
        return String::new();
    }
    ratios.sort_by(|x, y| x.0.total_cmp(&y.0));
    let geo = (ratios.iter().map(|r| r.0.ln()).sum::<f64>() / ratios.len() as f64).exp();
    let (low, low_p) = ratios[0];
    let tied = ratios
        .iter()
        .filter(|r| (r.0 - low).abs() <= 1e-9 * low)
        .count()
        - 1;
    let tied = if tied + 1 == ratios.len() && tied > 0 {
        " and every other probe at the same ratio: the ratio of the builds' seeds per CPU-second when each probe is hit in the same share of seeds by both".to_string()
    } else if tied > 0 {
        format!(" and {tied} more at the same ratio")
    } else {
        String::new()
    };
    let lost = if lost > 0 {
        format!("; {lost} probes the baseline hits this build never hits (listed above)")
    } else {
        String::new()
    };
    format!(
        "probe reach per CPU-second (seeds that hit the probe per CPU-second), this build / baseline, over the {} probes both hit: geometric mean {geo:.2}x, lowest {low:.2}x ({low_p}{tied}){lost}\n",
        ratios.len()
    )
}

/// The machine's noise as far as repeated runs show it: the least and the most the ratio of
/// checked reads per CPU-second could be, taking any run of this build against any run of the
/// baseline (empty without repeats or a baseline).
fn noise(this: &[Measured], base: &[Measured]) -> String {
    if this.len() < 2 || base.is_empty() {
        return String::new();
    }
    let per = |m: &Measured| m.checked_reads as f64 / m.cpu_s.max(1e-9);
    let lo = |v: &[Measured]| v.iter().map(per).fold(f64::INFINITY, f64::min);
    let hi = |v: &[Measured]| v.iter().map(per).fold(0.0, f64::max);
    let overlap = lo(this) <= hi(base) && hi(this) >= lo(base);
    format!(
        "checked reads per CPU-second, this build / baseline, any run against any: {:.2}x to {:.2}x{}\n",
        lo(this) / hi(base).max(1e-12),
        hi(this) / lo(base).max(1e-12),
        if overlap {
            " (the two builds' runs overlap: a difference this small is within the machine's noise)"
        } else {
            ""
        }
    )
}

/// The run of `runs` whose CPU time is the median (the lower middle of an even count): a
/// machine's noise moves whole runs, so the report keeps one real run rather than mixing them.
fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by(|a, b| a.cpu_s.total_cmp(&b.cpu_s));
    runs.swap_remove((runs.len() - 1) / 2)
}

/// The whole bench: this build (the running executable) and the baseline, alternately,
/// `repeat` times each; the report holds each build's median run.
pub fn run(plan: &Plan, baseline: Option<&PathBuf>, repeat: usize) -> Result<String, String> {
    let me = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let (mut this, mut base) = (Vec::new(), Vec::new());
    for _ in 0..repeat.max(1) {
        this.push(measure(&me, plan)?);
        if let Some(b) = baseline {
            base.push(measure(b, plan)?);
        }
    }
    let spread = |runs: &[Measured]| {
        let cpu: Vec<String> = runs.iter().map(|m| format!("{:.1}", m.cpu_s)).collect();
        cpu.join(", ")
    };
    let mut notes = format!("CPU seconds of each run: this build {}", spread(&this));
    if !base.is_empty() {
        notes += &format!("; baseline {}", spread(&base));
    }
    notes += " (each row is the run of median CPU time)\n";
    notes += &noise(&this, &base);
    let this = median(this);
    let base = (!base.is_empty()).then(|| median(base));
    let mut out = report(
        plan,
        &this,
        baseline.map(|b| b.as_path()).zip(base.as_ref()),
    );
    out += &notes;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_of_either_format_is_read() {
        let old = "== tierkv sim summary (profile swarm)\nseeds run: 6   failures: 1   by oracle: race 1\nchecked: 72 requests finished, 1808 digests recomputed, 219961 KV/index-K rows compared (+552384 unchanged since compared), 6734 ops, 2 loads, 35 backups\nthroughput: 6.51 seeds/s\ncoverage: 2 of 2 probes hit\nprobe                                          hits    seeds\nload.issued                                   35494    78.9%\nabort.queued                                      0     0.0%  never\n";
        let m = parse_summary(old).unwrap();
        assert_eq!((m.seeds, m.failures, m.ops), (6, 1, 6734));
        assert_eq!(m.checked_reads, 219_961 + 552_384);
        assert_eq!(m.reach.len(), 2);
        assert!((m.reach["load.issued"] - 0.789).abs() < 1e-9);
        assert_eq!(m.reach["abort.queued"], 0.0);
        assert!(parse_summary("seeds run: 6   failures: 0\n").is_err());
    }

    #[test]
    fn the_noise_of_repeated_runs() {
        let m = |reads: u64, cpu_s: f64| Measured {
            checked_reads: reads,
            cpu_s,
            ..Measured::default()
        };
        // 100 and 120 reads/s against 90 and 110: overlapping, 100/110 to 120/90.
        let s = noise(&[m(100, 1.0), m(120, 1.0)], &[m(90, 1.0), m(110, 1.0)]);
        assert!(
            s.contains("0.91x to 1.33x (the two builds' runs overlap"),
            "{s}"
        );
        // Twice as fast in every run: apart.
        let s = noise(&[m(200, 1.0), m(210, 1.0)], &[m(90, 1.0), m(100, 1.0)]);
        assert!(s.contains("2.00x to 2.33x\n"), "{s}");
        assert_eq!(
            noise(&[m(1, 1.0)], &[m(1, 1.0)]),
            "",
            "one run each: no range"
        );
    }

    #[test]
    fn reach_per_cpu_second_against_the_baseline() {
        let m = |seeds: u64, cpu_s: f64, reach: &[(&str, f64)]| Measured {
            seeds,
            cpu_s,
            wall_s: cpu_s,
            reach: reach.iter().map(|(p, r)| (p.to_string(), *r)).collect(),
            ..Measured::default()
        };
        // Twice the seeds per CPU-second; probe a hit in the same share, probe b in half, probe
        // c no longer at all.
        let this = m(100, 50.0, &[("a", 0.5), ("b", 0.2), ("c", 0.0)]);
        let base = m(100, 100.0, &[("a", 0.5), ("b", 0.4), ("c", 0.1)]);
        let s = reach_per_cpu_s(&this, &base);
        assert!(
            s.contains("over the 2 probes both hit: geometric mean 1.41x, lowest 1.00x (b);"),
            "{s}"
        );
        assert!(
            s.contains("1 probes the baseline hits this build never hits"),
            "{s}"
        );
        let plan = Plan {
            first: 0,
            end: 100,
            jobs: 1,
            profile: "swarm".into(),
        };
        let r = report(&plan, &this, Some((Path::new("old"), &base)));
        assert!(r.contains("2 probes hit in a smaller share"), "{r}");
        assert!(r.contains("b 20.0% (was 40.0%), c 0.0% (was 10.0%)"), "{r}");
        assert!(r.contains("geometric mean 1.41x"), "{r}");
        // Equal shares at equal cost: every ratio 1, the tie said as such.
        let s = reach_per_cpu_s(&base, &base);
        assert!(
            s.contains("lowest 1.00x (a and every other probe at the same ratio:"),
            "{s}"
        );
        // One probe in twice the share, the other three as before: a tie of three.
        let mut more = base.clone();
        more.reach.insert("d".into(), 0.3);
        let mut more_this = more.clone();
        more_this.reach.insert("d".into(), 0.6);
        let s = reach_per_cpu_s(&more_this, &more);
        assert!(
            s.contains("lowest 1.00x (a and 2 more at the same ratio)"),
            "{s}"
        );
    }
}
