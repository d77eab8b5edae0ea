//! The determinism oracle: the same scenario run twice (same seed, same build) must produce the
//! same event-log hash — every enqueue, start, completion, record, wait, synchronisation and host
//! access of the simulated GPU, and every output of the engine, in order.

use crate::report::{Finding, OracleKind};
use crate::runner::{run, RunOptions};
use crate::scenario::Scenario;

/// A campaign reruns one seed in this many (by a hash of the seed, so that every shard of a
/// campaign split by `seed % N` reruns about the same share) and every failing seed.
pub const SAMPLE_EVERY: u64 = 16;

/// Whether a campaign reruns `seed`, whose run `failed` or not.
pub fn sampled(seed: u64, failed: bool) -> bool {
    failed || seed_hash(seed) % SAMPLE_EVERY == 0
}

/// The splitmix64 finalizer of the seed: its low bits do not follow the seed's.
fn seed_hash(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub fn check(sc: &Scenario, opts: &RunOptions) -> Option<Finding> {
    let first = run(sc, opts).log_hash;
    rerun(sc, opts, first)
}

/// Runs `sc` again, on a fresh thread (nothing the first run left in its thread's state, such as
/// the CPU device's RoPE rows or the probe counts, is there), and compares its event-log hash
/// with `first`, the first run's. If the system refuses the thread, the rerun runs on this one
/// (sharing its state: a weaker check, never a panic).
pub fn rerun(sc: &Scenario, opts: &RunOptions, first: u64) -> Option<Finding> {
    let again = std::thread::scope(|s| {
        match std::thread::Builder::new().spawn_scoped(s, || run(sc, opts).log_hash) {
            Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            Err(_) => run(sc, opts).log_hash,
        }
    });
    (again != first).then(|| Finding {
        oracle: OracleKind::Determinism,
        time_ns: 0,
        message: format!(
            "seed {} gave event-log hashes {first:#018x} and {again:#018x}",
            sc.seed
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hash sampling does not alias with `seed % N` shards: every shard of 16 and of 20 reruns
    /// about one seed in 16.
    #[test]
    fn every_shard_reruns_about_the_same_share() {
        for shards in [16u64, 20] {
            for index in 0..shards {
                let seeds = (0..100_000u64).filter(|s| s % shards == index);
                let (n, rerun) = seeds.fold((0u64, 0u64), |(n, r), s| {
                    (n + 1, r + sampled(s, false) as u64)
                });
                let share = rerun as f64 / n as f64;
                assert!(
                    (share - 1.0 / 16.0).abs() < 0.01,
                    "shard {index}/{shards}: {rerun} of {n} seeds rerun"
                );
            }
        }
        assert!(sampled(5, true), "a failing seed is always rerun");
    }
}
