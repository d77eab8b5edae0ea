//! A fast, deterministic hasher for the simulator's memo tables, whose keys are a few integers
//! (token, position, layer; buffer, page). std's default SipHash guards against hash flooding,
//! which keys the simulator makes itself cannot mount, at several times the cost per lookup; the
//! content and digest oracles look up a row for every row an op reads.
//!
//! The mixing is the multiply-and-rotate scheme of rustc's own `FxHasher`. Nothing iterates these
//! maps in an order that reaches a run's outcome.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-and-rotate hasher for small integer keys.
#[derive(Clone, Copy, Debug, Default)]
pub struct FastHasher(u64);

const MULTIPLIER: u64 = 0xf135_7aea_2e62_a9c5;

impl FastHasher {
    #[inline]
    fn add(&mut self, v: u64) {
        self.0 = self.0.wrapping_add(v).wrapping_mul(MULTIPLIER);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            self.add(u64::from_le_bytes(b));
        }
    }
    fn write_u8(&mut self, v: u8) {
        self.add(v as u64);
    }
    fn write_u16(&mut self, v: u16) {
        self.add(v as u64);
    }
    fn write_u32(&mut self, v: u32) {
        self.add(v as u64);
    }
    fn write_u64(&mut self, v: u64) {
        self.add(v);
    }
    fn write_usize(&mut self, v: usize) {
        self.add(v as u64);
    }
    fn finish(&self) -> u64 {
        // The multiply leaves the low bits weakest; the table indexes by them.
        self.0.rotate_left(26)
    }
}

/// A `HashMap` with [`FastHasher`].
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearby_keys_spread_over_a_table() {
        // Positions of one token in one layer: consecutive keys must not share their low bits.
        let mut low = std::collections::BTreeSet::new();
        for p in 0..1024u32 {
            let mut h = FastHasher::default();
            h.write_u32(7);
            h.write_u32(p);
            h.write_u32(3);
            low.insert(h.finish() & 1023);
        }
        assert!(
            low.len() > 600,
            "{} distinct low 10 bits of 1024",
            low.len()
        );
    }
}
