//! `sparse_read`: the consumer of the indexer's selection. It reads every selected MLA KV row and
//! reduces them to a 64-bit digest — the stand-in for sparse attention, so that the rows sparse
//! attention would read are read, and checked, too.
//!
//! The digest is integer arithmetic with wrapping adds only, so any reduction order gives the same
//! bits: `row_hash = Σ_j mix64(word_j ^ (j+1)·φ)` over the row's little-endian 8-byte words, and
//! `digest = Σ_i mix64(row_hash_i ^ (i+1)·ψ)` over selection ranks `i` whose slot is not `-1`.

use super::numerics::mix64;
use super::store::{check_paged_dst, check_slot};
use crate::args::{self, bind_exact};
use crate::error::Result;
use crate::layout::{i32_bytes, kv_row, u64_bytes, LayoutFingerprint, PageFormat};

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
const PSI: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// Hash of one KV row's bytes (its length is a multiple of 8 for both KV formats).
pub fn row_hash(row: &[u8]) -> u64 {
    debug_assert_eq!(row.len() % 8, 0);
    row.chunks_exact(8).enumerate().fold(0u64, |acc, (j, w)| {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        acc.wrapping_add(mix64(w ^ (j as u64 + 1).wrapping_mul(PHI)))
    })
}

/// The contribution of the row at selection rank `i`.
pub fn rank_term(i: usize, row_hash: u64) -> u64 {
    mix64(row_hash ^ (i as u64 + 1).wrapping_mul(PSI))
}

/// Digest of a selection given each rank's row (None for padding).
pub fn digest<'a>(rows: impl IntoIterator<Item = Option<&'a [u8]>>) -> u64 {
    rows.into_iter()
        .enumerate()
        .fold(0u64, |acc, (i, r)| match r {
            Some(r) => acc.wrapping_add(rank_term(i, row_hash(r))),
            None => acc,
        })
}

/// The CPU reference of `sparse_read`: `out` is one digest per row.
pub fn sparse_read(
    a: &args::SparseRead,
    slots: &[i32],
    kv: &[u8],
    kv_fp: LayoutFingerprint,
    out: &mut [u64],
) -> Result<()> {
    sparse_read_hashed(a, slots, kv, kv_fp, out, &mut |_, row| row_hash(row))
}

/// `sparse_read` with each selected row's [`row_hash`] taken from `hash(offset, row)`, where
/// `offset` is the row's byte offset in `kv`: a caller that memoizes row hashes (the simulator's
/// executor, which sees the same rows selected query after query) must return exactly
/// `row_hash(row)`.
pub fn sparse_read_hashed(
    a: &args::SparseRead,
    selection: &[i32],
    kv: &[u8],
    kv_fp: LayoutFingerprint,
    out: &mut [u64],
    hash: &mut dyn FnMut(usize, &[u8]) -> u64,
) -> Result<()> {
    const OP: &str = args::SparseRead::OP;
    a.check()?;
    let [so, oo] = a.operands();
    bind_exact(OP, so, i32_bytes(selection.len() as u64))?;
    bind_exact(OP, oo, u64_bytes(out.len() as u64))?;
    let format = PageFormat::Kv(a.dtype);
    let slots = check_paged_dst(OP, format, kv.len(), kv_fp)?;
    let (k, tb) = (a.k as usize, format.token_bytes() as usize);
    for (r, o) in out.iter_mut().enumerate() {
        let sel = &selection[r * k..(r + 1) * k];
        let mut acc = 0u64;
        for (i, &s) in sel.iter().enumerate() {
            if s < 0 {
                continue;
            }
            let at = kv_row::slot_offset(a.dtype, check_slot(OP, i, s, slots)?);
            acc = acc.wrapping_add(rank_term(i, hash(at, &kv[at..at + tb])));
        }
        *o = acc;
    }
    Ok(())
}
