//! Prints `profile seed event-log-hash findings` for every seed of a range, in seed order: the
//! evidence a refactor that must preserve behaviour compares before and after (the hash covers
//! every device call, op timing and engine output of the run).
//!
//! `cargo run --release -p tierkv-sim --example hashes -- [PROFILE [FIRST [END [JOBS [MUTANT]]]]]`
//! (defaults: swarm 0 300 2, the clean engine; a mutant needs `--features mutants`).

use std::process::ExitCode;
use tierkv_sim::campaign::CampaignOptions;
use tierkv_sim::runner::{run, RunOptions};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, default: T) -> Result<T, String> {
    match args.get(i) {
        None => Ok(default),
        Some(s) => s
            .parse()
            .map_err(|_| format!("argument {i}: `{s}` is not a number")),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let profile = args.get(1).cloned().unwrap_or_else(|| "swarm".into());
    let parsed = (|| {
        Ok::<_, String>((
            arg(&args, 2, 0u64)?,
            arg(&args, 3, 300u64)?,
            arg(&args, 4, 2u64)?,
        ))
    })();
    let (first, end, jobs) = match parsed {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}\nusage: hashes [PROFILE [FIRST [END [JOBS [MUTANT]]]]]");
            return ExitCode::from(2);
        }
    };
    let copts = CampaignOptions {
        first,
        end,
        jobs: 1,
        shard: None,
        profile: profile.clone(),
        mutant: args.get(5).cloned(),
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
    };
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for j in 0..jobs.max(1) {
            let (copts, results) = (&copts, &results);
            s.spawn(move || {
                let mut seed = first + j;
                while seed < end {
                    let out = run(&copts.scenario(seed), &RunOptions::default());
                    let row = (seed, out.log_hash, out.findings.len());
                    results.lock().expect("results").push(row);
                    seed += jobs.max(1);
                }
            });
        }
    });
    let mut rows = results.into_inner().expect("results");
    rows.sort();
    for (seed, hash, findings) in rows {
        let label = args
            .get(5)
            .map_or(profile.clone(), |m| format!("{profile}/{m}"));
        println!("{label} {seed} {hash:#018x} {findings}");
    }
    ExitCode::SUCCESS
}
