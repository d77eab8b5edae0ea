//! The bad-input corpus (`sim/tests/bad_inputs/*.case`): every case runs the `tierkv` binary under
//! a 1 GiB address-space limit and a CPU-time limit, and must end with its expected exit code and a
//! message holding its fragment — never a panic, a hang or a runaway allocation, and never an
//! echo of a huge input.
//!
//! A case file holds one `key: value` per line: `args` (split at spaces; `{dir}` is the corpus
//! folder, `{tmp}` a fresh scratch folder, which is also the working directory, `{fifo}` a FIFO
//! in it that nobody writes to, `{busy_port}` a loopback TCP port the test holds open), `exit`,
//! and `stderr` or `stdout` (a fragment the stream must contain).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// CPU seconds one case may spend (`ulimit -t`): a runaway computation is killed by this, which
/// does not depend on how loaded the machine is.
const CPU_SECONDS_MAX: u64 = 120;
/// Wall time after which a case counts as hung (blocked without spending CPU: a read from a FIFO
/// nobody closes). Far above what any case takes on a loaded 2-core machine, so that only a real
/// hang reaches it.
const HANG_LIMIT: Duration = Duration::from_secs(900);
/// Virtual memory of one case, KiB (`ulimit -v`).
const MEMORY_KIB: u64 = 1 << 20;
/// The longest stderr a bad input may produce.
const STDERR_MAX: usize = 4096;

struct Case {
    name: String,
    args: Vec<String>,
    exit: i32,
    stream: String,
    fragment: String,
}

fn parse(path: &Path, dir: &Path, tmp: &Path, busy_port: u16) -> Case {
    let text = std::fs::read_to_string(path).unwrap();
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}: ")))
            .map(str::to_string)
    };
    let subst = |s: &str| {
        s.replace("{dir}", &dir.display().to_string())
            .replace("{tmp}", &tmp.display().to_string())
            .replace("{fifo}", &tmp.join("fifo").display().to_string())
            .replace("{busy_port}", &busy_port.to_string())
    };
    let (stream, fragment) = match (field("stderr"), field("stdout")) {
        (Some(f), None) => ("stderr".to_string(), f),
        (None, Some(f)) => ("stdout".to_string(), f),
        _ => panic!("{}: give one of stderr or stdout", path.display()),
    };
    Case {
        name: path.file_stem().unwrap().to_string_lossy().into_owned(),
        args: field("args")
            .expect("args")
            .split_whitespace()
            .map(subst)
            .collect(),
        exit: field("exit").expect("exit").parse().expect("an exit code"),
        stream,
        fragment: subst(&fragment),
    }
}

/// Runs `case`; the problems it shows, if any.
fn check(case: &Case, tmp: &Path) -> Vec<String> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {MEMORY_KIB}; ulimit -t {CPU_SECONDS_MAX}; exec \"$0\" \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_tierkv"))
        .args(&case.args)
        .current_dir(tmp)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tierkv");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > HANG_LIMIT {
            let _ = child.kill();
            return vec![format!(
                "{}: hung, still running after {HANG_LIMIT:?}",
                case.name
            )];
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let mut problems = Vec::new();
    let code = out.status.code().unwrap_or(-1);
    if code != case.exit {
        problems.push(format!("exit code {code}, expected {}", case.exit));
    }
    let stream = if case.stream == "stderr" {
        &stderr
    } else {
        &stdout
    };
    if !stream.contains(&case.fragment) {
        problems.push(format!("{} lacks `{}`", case.stream, case.fragment));
    }
    if stderr.contains("panicked") {
        problems.push("it panicked".into());
    }
    if stderr.len() > STDERR_MAX {
        problems.push(format!("{} B of stderr", stderr.len()));
    }
    problems
        .into_iter()
        .map(|p| {
            format!(
                "{}: {p}\n    args: {}\n    stderr: {}",
                case.name,
                case.args.join(" "),
                stderr.chars().take(600).collect::<String>()
            )
        })
        .collect()
}

#[test]
fn every_bad_input_gets_a_clear_error() {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/bad_inputs"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "case"))
        .collect();
    files.sort();
    assert!(files.len() >= 40, "found the corpus in {}", dir.display());
    let mut failures = Vec::new();
    // Held until every case has run: the port a case gives as one in use.
    let busy = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("a loopback port");
    let busy_port = busy.local_addr().expect("its address").port();
    for f in &files {
        let tmp = std::env::temp_dir().join(format!(
            "tierkv-bad-input-{}-{}",
            std::process::id(),
            f.file_stem().unwrap().to_string_lossy()
        ));
        std::fs::create_dir_all(&tmp).unwrap();
        let case = parse(f, &dir, &tmp, busy_port);
        let fifo = tmp.join("fifo").display().to_string();
        if case.args.iter().any(|a| a.contains(&fifo)) {
            let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
            assert!(made.success(), "mkfifo {fifo}");
        }
        failures.extend(check(&case, &tmp));
        let _ = std::fs::remove_dir_all(&tmp);
    }
    assert!(
        failures.is_empty(),
        "{} of {} bad-input cases failed:\n{}",
        failures.len(),
        files.len(),
        failures.join("\n")
    );
}
