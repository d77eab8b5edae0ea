//! Prints `seed hash findings` for a seed range of a profile (refactor baseline).
use tierkv_sim::campaign::CampaignOptions;
use tierkv_sim::runner::{run, RunOptions};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let profile = a.get(1).cloned().unwrap_or("swarm".into());
    let first: u64 = a.get(2).map_or(0, |s| s.parse().unwrap());
    let end: u64 = a.get(3).map_or(300, |s| s.parse().unwrap());
    let jobs = 2u64;
    let copts = CampaignOptions {
        first,
        end,
        jobs: 1,
        shard: None,
        profile: profile.clone(),
        mutant: None,
        progress: false,
        stop_at_first: false,
        trace_records: None,
        cuda: false,
    };
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for j in 0..jobs {
            let copts = &copts;
            let results = &results;
            s.spawn(move || {
                let mut seed = first + j;
                while seed < end {
                    let sc = copts.scenario(seed);
                    let out = run(&sc, &RunOptions::default());
                    results
                        .lock()
                        .unwrap()
                        .push((seed, out.log_hash, out.findings.len()));
                    seed += jobs;
                }
            });
        }
    });
    let mut r = results.into_inner().unwrap();
    r.sort();
    for (s, h, f) in r {
        println!("{profile} {s} {h:#018x} {f}");
    }
}
