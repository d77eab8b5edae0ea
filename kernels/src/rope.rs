//! RoPE rows: for a position, 32 cosines then 32 sines of the NeoX frequencies over 64 dims
//! (`theta = 10000`). Computed on the host in f64 and rounded once, then passed to the kernels as
//! data, so CPU and CUDA rotate by bit-identical angles (the GPU never evaluates a transcendental).

use crate::layout::ROPE_DIM;

pub const ROPE_THETA: f64 = 10000.0;

/// The RoPE row of `position`.
pub fn rope_row(position: u32) -> [f32; 64] {
    let half = (ROPE_DIM / 2) as usize;
    let mut row = [0f32; 64];
    for i in 0..half {
        let inv_freq = ROPE_THETA.powf(-(2.0 * i as f64) / ROPE_DIM as f64);
        let angle = position as f64 * inv_freq;
        row[i] = angle.cos() as f32;
        row[half + i] = angle.sin() as f32;
    }
    row
}

/// Rows for many positions, `[n][64]`.
pub fn rope_rows(positions: impl IntoIterator<Item = u32>) -> Vec<f32> {
    positions.into_iter().flat_map(rope_row).collect()
}
