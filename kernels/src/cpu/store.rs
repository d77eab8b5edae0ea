//! `index_k_store` and `kv_store`: turn new tokens' vectors into cache rows and scatter them into
//! paged slots.

use super::numerics::*;
use crate::args::{self, bind_exact};
use crate::error::{bad, KernelError, Result};
use crate::layout::{
    bf16_bytes, f32_bytes, index_k_page, kv_row, IndexKDtype, KvDtype, LayoutFingerprint,
    PageFormat, KV_LORA_RANK, KV_ROW_VALUES, PAGE_TOKENS, QUANT_BLOCK, ROPE_DIM,
};
use half::bf16;

/// The inputs of `index_k_store` for `n` tokens, bound to its record by [`index_k_store`].
#[derive(Clone, Copy, Debug)]
pub struct IndexKStoreInputs<'a> {
    /// Raw index keys, `[n][128]`.
    pub keys: &'a [bf16],
    /// LayerNorm weight and bias, 128 each.
    pub gamma: &'a [f32],
    pub beta: &'a [f32],
    /// Each token's RoPE row (32 cosines, 32 sines at its position), `[n][64]`.
    pub rope: &'a [f32],
}

/// One token's index-K row: LayerNorm → RoPE → Hadamard → fp8 (values + scale) or bf16.
/// `values` receives `index_k_page::values_bytes(dtype)` bytes; the fp8 scale is returned.
pub fn index_k_token(
    dtype: IndexKDtype,
    ue8m0: bool,
    key: &[bf16],
    gamma: &[f32],
    beta: &[f32],
    rope_row: &[f32],
    values: &mut [u8],
) -> Option<f32> {
    let mut x = [0f32; 128];
    for (d, v) in key.iter().enumerate() {
        x[d] = v.to_f32();
    }
    layer_norm(&mut x, gamma, beta);
    rope_neox(&mut x, rope_row);
    hadamard_128(&mut x);
    match dtype {
        IndexKDtype::Fp8 => {
            let scale = fp8_scale(amax(&x), ue8m0);
            quantize_e4m3(&x, scale, &mut values[..128]);
            Some(scale)
        }
        IndexKDtype::Bf16 => {
            for (d, v) in x.iter().enumerate() {
                write_u16(values, 2 * d, bf16_bits(*v));
            }
            None
        }
    }
}

/// Checks that `dst` is a whole number of pages of `format` and that its fingerprint says so.
pub(crate) fn check_paged_dst(
    op: &'static str,
    format: PageFormat,
    dst_len: usize,
    dst_fp: LayoutFingerprint,
) -> Result<u64> {
    let want = format.fingerprint();
    if dst_fp != want {
        return Err(KernelError::LayoutMismatch {
            op,
            src: want,
            dst: dst_fp,
        });
    }
    let pb = format.page_bytes() as usize;
    if dst_len % pb != 0 {
        return Err(bad(
            op,
            "dst",
            format!("{dst_len} B is not a whole number of {pb} B pages"),
        ));
    }
    Ok((dst_len / pb) as u64 * PAGE_TOKENS as u64)
}

pub(crate) fn check_slot(op: &'static str, index: usize, slot: i32, slots: u64) -> Result<u32> {
    if slot < 0 || slot as u64 >= slots {
        return Err(KernelError::OutOfRange {
            op,
            index,
            value: slot as i64,
            limit: slots,
        });
    }
    Ok(slot as u32)
}

/// The CPU reference of `index_k_store`: writes each token's row and scale into its slot of the
/// paged index-K buffer `dst` (one layer, `[page][8448 | 16384]`).
pub fn index_k_store(
    a: &args::IndexKStore,
    x: &IndexKStoreInputs,
    dst: &mut [u8],
    dst_fp: LayoutFingerprint,
) -> Result<()> {
    const OP: &str = args::IndexKStore::OP;
    a.check()?;
    let [ko, go, bo, ro, _] = a.operands();
    bind_exact(OP, ko, bf16_bytes(x.keys.len() as u64))?;
    bind_exact(OP, go, f32_bytes(x.gamma.len() as u64))?;
    bind_exact(OP, bo, f32_bytes(x.beta.len() as u64))?;
    bind_exact(OP, ro, f32_bytes(x.rope.len() as u64))?;
    let format = PageFormat::IndexK(a.dtype);
    let slots = check_paged_dst(OP, format, dst.len(), dst_fp)?;
    let pb = format.page_bytes() as usize;
    let vb = index_k_page::values_bytes(a.dtype);
    let mut values = [0u8; 256];
    for (i, &s) in a.slots.iter().enumerate() {
        let slot = check_slot(OP, i, s, slots)?;
        let (page, t) = ((slot / PAGE_TOKENS) as usize, slot % PAGE_TOKENS);
        let key = &x.keys[i * 128..(i + 1) * 128];
        let rope = &x.rope[i * 64..(i + 1) * 64];
        let scale = index_k_token(
            a.dtype,
            a.ue8m0,
            key,
            x.gamma,
            x.beta,
            rope,
            &mut values[..vb],
        );
        let page_bytes = &mut dst[page * pb..(page + 1) * pb];
        let at = index_k_page::value_offset(a.dtype, t, 0);
        page_bytes[at..at + vb].copy_from_slice(&values[..vb]);
        if let (Some(off), Some(scale)) = (index_k_page::scale_offset(a.dtype, t), scale) {
            write_f32(page_bytes, off, scale);
        }
    }
    Ok(())
}

/// One token's KV row bytes (`out` is the format's token bytes long). bf16: the 576 values as is.
/// Packed fp8: each 128-value latent tile quantized with its own scale, RoPE values kept in bf16.
pub fn kv_token(dtype: KvDtype, row: &[bf16], out: &mut [u8]) {
    match dtype {
        KvDtype::Fp8Unpacked => {
            panic!("kv_token: fp8_unpacked rows are never stored (kv_store refuses them)")
        }
        KvDtype::Bf16 => {
            for (v, x) in row.iter().enumerate() {
                write_u16(out, 2 * v, x.to_bits());
            }
        }
        KvDtype::Fp8Packed => {
            let q = QUANT_BLOCK as usize;
            for tile in 0..kv_row::FP8_TILES {
                let mut x = [0f32; 128];
                for (j, v) in row[tile * q..(tile + 1) * q].iter().enumerate() {
                    x[j] = v.to_f32();
                }
                let scale = fp8_scale(amax(&x), false);
                quantize_e4m3(&x, scale, &mut out[tile * q..(tile + 1) * q]);
                write_f32(out, kv_row::FP8_SCALES_OFFSET + 4 * tile, scale);
            }
            for r in 0..ROPE_DIM as usize {
                let v = row[KV_LORA_RANK as usize + r];
                write_u16(out, kv_row::FP8_ROPE_OFFSET + 2 * r, v.to_bits());
            }
        }
    }
}

/// The CPU reference of `kv_store`: writes each token's KV row (`rows` is `[n][576]`: 512 latent
/// values, then 64 RoPE values) into its slot of `dst` (one layer).
pub fn kv_store(
    a: &args::KvStore,
    rows: &[bf16],
    dst: &mut [u8],
    dst_fp: LayoutFingerprint,
) -> Result<()> {
    const OP: &str = args::KvStore::OP;
    a.check()?;
    bind_exact(OP, a.operands()[0], bf16_bytes(rows.len() as u64))?;
    let format = PageFormat::Kv(a.dtype);
    let slots = check_paged_dst(OP, format, dst.len(), dst_fp)?;
    let tb = format.token_bytes() as usize;
    let nv = KV_ROW_VALUES as usize;
    for (i, &s) in a.slots.iter().enumerate() {
        let at = kv_row::slot_offset(a.dtype, check_slot(OP, i, s, slots)?);
        kv_token(a.dtype, &rows[i * nv..(i + 1) * nv], &mut dst[at..at + tb]);
        if crate::mutants::on(crate::mutants::KernelMutant::KvStoreWritesNextRow)
            && at + 2 * tb <= dst.len()
        {
            dst.copy_within(at..at + tb, at + tb);
        }
    }
    Ok(())
}
