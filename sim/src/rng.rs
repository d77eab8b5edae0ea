//! The simulator's seeded generator (xoshiro256**). Every random choice of a run — its
//! configuration, workload, durations, schedule and faults — comes from generators derived from
//! the seed (the schedule's also from its index; the engine's page-refusal faults from its own
//! seeded generator; the oracles' samples from hashes), so the seed and the schedule reproduce
//! the run.

use tierkv_kernels::cpu::numerics::mix64;

#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            mix64(z)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }
    /// An independent generator for one purpose (so adding draws in one place does not shift
    /// every other decision of the run).
    pub fn fork(&mut self, purpose: u64) -> Rng {
        Rng::new(self.next_u64() ^ mix64(purpose))
    }
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}
