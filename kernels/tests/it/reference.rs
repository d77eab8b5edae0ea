//! Property tests of each CPU reference against the independent versions of `naive.rs`.

use crate::naive;
use half::bf16;
use proptest::prelude::*;
use tierkv_kernels::args;
use tierkv_kernels::cpu::numerics::{self, e4m3_decode, hadamard_128, read_f32};
use tierkv_kernels::cpu::{self, sparse_read, store, topk};
use tierkv_kernels::layout::*;
use tierkv_kernels::rope::{Rope, RopeParams};
use tierkv_kernels::KernelError;

/// DeepSeek-V3.2's RoPE row of `position` (YaRN on, as at its 128K context).
fn rope_row(position: u32) -> [f32; 64] {
    Rope::new(&RopeParams::deepseek_v32(131_072)).row(position)
}

/// A small deterministic generator for bulk test data (proptest draws the seeds).
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        numerics::mix64(self.0)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    fn vec_f32(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.unit() * scale).collect()
    }
    fn vec_bf16(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.unit() * scale))
            .collect()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn hadamard_preserves_dot_products(seed in any::<u64>(), scale in 0.01f32..100.0) {
        let mut g = Gen(seed);
        let x = g.vec_f32(128, scale);
        let y = g.vec_f32(128, scale);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| *p as f64 * *q as f64).sum::<f64>();
        let norm = (dot(&x, &x) * dot(&y, &y)).sqrt();
        let (mut hx, mut hy) = ([0f32; 128], [0f32; 128]);
        hx.copy_from_slice(&x);
        hy.copy_from_slice(&y);
        hadamard_128(&mut hx);
        hadamard_128(&mut hy);
        prop_assert!((dot(&hx, &hy) - dot(&x, &y)).abs() <= 1e-5 * norm);
    }

    #[test]
    fn index_k_store_matches_f64_pipeline(seed in any::<u64>(), fp8 in any::<bool>(),
                                          ue8m0 in any::<bool>(), n in 1usize..40) {
        let mut g = Gen(seed);
        let dtype = if fp8 { IndexKDtype::Fp8 } else { IndexKDtype::Bf16 };
        let pages = 3u32;
        let keys = g.vec_bf16(n * 128, 4.0);
        let gamma: Vec<f32> = (0..128).map(|_| 1.0 + 0.5 * g.unit()).collect();
        let beta = g.vec_f32(128, 0.2);
        let positions: Vec<u32> = (0..n).map(|_| g.below(70_000) as u32).collect();
        let rope: Vec<f32> = positions.iter().flat_map(|&p| rope_row(p)).collect();
        // Distinct random slots.
        let mut all: Vec<i32> = (0..(pages * 64) as i32).collect();
        for i in 0..all.len() { let j = g.below(all.len() as u64) as usize; all.swap(i, j); }
        let slots = &all[..n];
        let fmt = PageFormat::IndexK(dtype);
        let before = vec![0xA5u8; (pages as u64 * fmt.page_bytes()) as usize];
        let mut dst = before.clone();
        let a = args::IndexKStore { dtype, ue8m0, slots: slots.into() };
        let x = cpu::IndexKStoreInputs { keys: &keys, gamma: &gamma, beta: &beta, rope: &rope };
        cpu::index_k_store(&a, &x, &mut dst, fmt.fingerprint()).unwrap();
        // Each row the round-to-nearest-even codes of the f64 pipeline (within its f32 error
        // bound), its scale as specified, and nothing else written.
        prop_assert_eq!(naive::check_index_k_store(&a, &x, &before, &dst), Ok(()));
    }

    #[test]
    fn q_prep_folds_the_scale_into_the_weight(seed in any::<u64>(), n in 1usize..6, heads in 1usize..9,
                                              ue8m0 in any::<bool>()) {
        let mut g = Gen(seed);
        let q = g.vec_bf16(n * heads * 128, 3.0);
        let w = g.vec_f32(n * heads, 1.0);
        let rope: Vec<f32> = (0..n).flat_map(|_| rope_row(g.below(5000) as u32)).collect();
        let (mut qo, mut wo) = (vec![0u8; n * heads * 128], vec![0f32; n * heads]);
        let a = args::QPrep { rows: n as u32, heads: heads as u32, ue8m0 };
        let x = cpu::QPrepInputs { q: &q, weights: &w, rope: &rope };
        cpu::q_prep(&a, &x, &mut qo, &mut wo).unwrap();
        // The scale folded into each weight, each head's codes rounded to nearest even at it.
        prop_assert_eq!(naive::check_q_prep(&a, &x, &qo, &wo), Ok(()));
    }

    #[test]
    fn logits_match_f64_and_mask_the_tail(seed in any::<u64>(), fp8 in any::<bool>(), heads in 1usize..6,
                                          lens in prop::collection::vec(0usize..200, 1..4)) {
        let mut g = Gen(seed);
        let dtype = if fp8 { IndexKDtype::Fp8 } else { IndexKDtype::Bf16 };
        let fmt = PageFormat::IndexK(dtype);
        let pages = 12usize;
        let mut kbuf = vec![0u8; pages * fmt.page_bytes() as usize];
        // Fill every slot through the store kernel so pages hold well-formed rows.
        let keys = g.vec_bf16(pages * 64 * 128, 2.0);
        let rope: Vec<f32> = (0..pages * 64).flat_map(|p| rope_row(p as u32)).collect();
        let slots: Vec<i32> = (0..(pages * 64) as i32).collect();
        let ones = vec![1f32; 128];
        let zeros = vec![0f32; 128];
        let store = args::IndexKStore { dtype, ue8m0: false, slots: slots.into() };
        cpu::index_k_store(&store, &cpu::IndexKStoreInputs { keys: &keys, gamma: &ones, beta: &zeros, rope: &rope }, &mut kbuf, fmt.fingerprint()).unwrap();
        let rows = lens.len();
        let pt_stride = 4usize;
        let page_table: Vec<i32> = (0..rows * pt_stride).map(|_| g.below(pages as u64) as i32).collect();
        let q: Vec<u8> = (0..rows * heads * 128).map(|_| numerics::e4m3_encode(g.unit() * 300.0)).collect();
        let w = g.vec_f32(rows * heads, 1.0);
        let ctx: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let out_stride = 256;
        let mut out = vec![f32::NAN; rows * out_stride];
        let a = args::IndexLogits { dtype, heads: heads as u32, page_table: (&page_table[..]).into(), pt_stride: pt_stride as u32, context_lens: (&ctx[..]).into(), out_stride: out_stride as u32 };
        cpu::index_logits(&a, &q, &w, &kbuf, fmt.fingerprint(), &mut out).unwrap();
        // Bit for bit the kernel's order key by key: a page scored as one block of 64 keys equals
        // each key scored alone.
        let pb = fmt.page_bytes() as usize;
        for (r, &len) in lens.iter().enumerate() {
            let qf = cpu::logits::decode_q(&q[r * heads * 128..(r + 1) * heads * 128]);
            for n in 0..len {
                let p = page_table[r * pt_stride + n / 64] as usize;
                let mut k = [0f32; 128];
                let ks = cpu::logits::decode_key(dtype, &kbuf[p * pb..(p + 1) * pb], (n % 64) as u32, &mut k);
                let one = cpu::logits::logit(&qf, &w[r * heads..(r + 1) * heads], &k, ks, dtype);
                prop_assert_eq!(out[r * out_stride + n].to_bits(), one.to_bits(), "row {} position {}", r, n);
            }
        }
        let (want, mag) = naive::index_logits_f64(&a, (&q, &w), &kbuf);
        for (i, (&got, (&w, &m))) in out.iter().zip(want.iter().zip(&mag)).enumerate() {
            if w == f64::NEG_INFINITY {
                prop_assert_eq!(got, f32::NEG_INFINITY, "[{}]", i);
                continue;
            }
            prop_assert!((got as f64 - w).abs() <= 1e-5 * m + 1e-30, "[{}]: {} vs {}", i, got, w);
        }
    }

    #[test]
    fn topk_equals_a_sort(seed in any::<u64>(), k in 1usize..300, len in 0usize..400, ties in any::<bool>()) {
        let mut g = Gen(seed);
        let stride = 400usize;
        let mut logits: Vec<f32> = (0..stride).map(|_| g.unit()).collect();
        if ties { for v in logits.iter_mut() { *v = (*v * 4.0).round() / 4.0; } }
        for v in logits.iter_mut().skip(len) { *v = f32::NEG_INFINITY; }
        let page_table: Vec<i32> = (0..7).map(|_| g.below(1000) as i32).collect();
        let ctx = [len as i32];
        let mut out = vec![7777i32; k];
        let a = args::TopK { k: k as u32, stride: stride as u32, context_lens: (&ctx[..]).into(), page_table: (&page_table[..]).into(), pt_stride: 7 };
        cpu::topk(&a, &logits, &mut out).unwrap();
        prop_assert_eq!(out, naive::topk(&a, &logits));
    }

    #[test]
    fn page_copy_round_trips_bit_exactly(seed in any::<u64>(), page_first in any::<bool>(), bf16_ik in any::<bool>()) {
        let mut g = Gen(seed);
        let p = LayoutParams { layers: 3, layer_base: 0, index_n_heads: 2,
            index_k_dtype: if bf16_ik { IndexKDtype::Bf16 } else { IndexKDtype::Fp8 },
            kv_dtype: KvDtype::Fp8Packed, device_pages: 9, host_pages: 20,
            host_layout: if page_first { HostLayout::PageFirst } else { HostLayout::LayerFirst } };
        let l = Layout::new(p).unwrap();
        for kind in BufferKind::ALL {
            let dev_view = l.device_layer_view(kind);
            let dev: Vec<u8> = (0..l.device_layer_bytes(kind).0).map(|_| g.next() as u8).collect();
            let mut host = vec![0x5Au8; l.host_bytes(kind).0 as usize];
            let layer = LayerId(g.below(3) as u32);
            let host_view = l.host_layer_view(kind, layer);
            let pairs: Vec<(PageId, PageId)> = (0..6).map(|i| (PageId(i), PageId(19 - 2 * i))).collect();
            let runs = coalesce_runs(&pairs);
            cpu::page_copy(&dev, &dev_view, &mut host, &host_view, &runs).unwrap();
            let mut back = vec![0u8; dev.len()];
            let back_pairs: Vec<(PageId, PageId)> = pairs.iter().map(|&(d, h)| (h, d)).collect();
            cpu::page_copy(&host, &host_view, &mut back, &dev_view, &coalesce_runs(&back_pairs)).unwrap();
            let pb = l.page_bytes(kind).0 as usize;
            prop_assert_eq!(&back[..6 * pb], &dev[..6 * pb]);
            prop_assert!(back[6 * pb..].iter().all(|&b| b == 0));
        }
    }
}

#[test]
fn page_copy_refuses_mismatched_layouts() {
    // The incident: a bf16 index-K device pool behind a host mirror sized from fp8 defaults.
    let dev_fmt = PageFormat::IndexK(IndexKDtype::Bf16);
    let host_fmt = PageFormat::IndexK(IndexKDtype::Fp8);
    let dev_view = PagedView {
        base: 0,
        page_stride: dev_fmt.page_bytes(),
        pages: 4,
        fingerprint: dev_fmt.fingerprint(),
    };
    let host_view = PagedView {
        base: 0,
        page_stride: host_fmt.page_bytes(),
        pages: 4,
        fingerprint: host_fmt.fingerprint(),
    };
    let dev = vec![1u8; (4 * dev_fmt.page_bytes()) as usize];
    let mut host = vec![0u8; (4 * host_fmt.page_bytes()) as usize];
    let runs = [PageRun {
        src: PageId(0),
        dst: PageId(0),
        count: 2,
    }];
    let err = cpu::page_copy(&dev, &dev_view, &mut host, &host_view, &runs).unwrap_err();
    assert!(matches!(err, KernelError::LayoutMismatch { .. }), "{err}");
    assert!(
        host.iter().all(|&b| b == 0),
        "a refused copy writes nothing"
    );
    // A run past the end of a view is refused too.
    let runs = [PageRun {
        src: PageId(3),
        dst: PageId(0),
        count: 2,
    }];
    let err =
        cpu::page_copy(&dev, &dev_view, &mut vec![0u8; dev.len()], &dev_view, &runs).unwrap_err();
    assert!(matches!(err, KernelError::OutOfRange { .. }), "{err}");
}

#[test]
fn store_refuses_a_pool_of_another_dtype() {
    // DESIGN §1 incident 4: the store kernel must not write fp8 pages into a bf16 pool.
    let keys = vec![bf16::from_f32(1.0); 128];
    let rope = rope_row(3);
    let g = vec![1f32; 128];
    let a = args::IndexKStore {
        dtype: IndexKDtype::Fp8,
        ue8m0: false,
        slots: (&[0][..]).into(),
    };
    let x = cpu::IndexKStoreInputs {
        keys: &keys,
        gamma: &g,
        beta: &g,
        rope: &rope,
    };
    let bf16_pool = PageFormat::IndexK(IndexKDtype::Bf16);
    let mut dst = vec![0u8; bf16_pool.page_bytes() as usize];
    let err = cpu::index_k_store(&a, &x, &mut dst, bf16_pool.fingerprint()).unwrap_err();
    assert!(matches!(err, KernelError::LayoutMismatch { .. }), "{err}");
}

#[test]
fn sparse_read_digest_sees_every_selected_byte_and_nothing_else() {
    let mut g = Gen(7);
    for dtype in KvDtype::ALL {
        let fmt = PageFormat::Kv(dtype);
        let mut kv: Vec<u8> = (0..2 * fmt.page_bytes()).map(|_| g.next() as u8).collect();
        let slots = [5i32, 70, -1, 3];
        let a = args::SparseRead {
            dtype,
            rows: 1,
            k: 4,
        };
        let digest = |kv: &[u8]| {
            let mut o = [0u64];
            cpu::sparse_read(&a, &slots, kv, fmt.fingerprint(), &mut o).unwrap();
            o[0]
        };
        let base = digest(&kv);
        let tb = fmt.token_bytes() as usize;
        // The same digest from the rows gathered by hand.
        let rows: Vec<Option<&[u8]>> = slots
            .iter()
            .map(|&s| (s >= 0).then(|| &kv[s as usize * tb..(s as usize + 1) * tb]))
            .collect();
        assert_eq!(sparse_read::digest(rows), base);
        for &s in &[5usize, 70, 3] {
            for byte in [0, tb / 2, tb - 1] {
                kv[s * tb + byte] ^= 0x10;
                assert_ne!(digest(&kv), base, "{dtype:?} slot {s} byte {byte}");
                kv[s * tb + byte] ^= 0x10;
            }
        }
        kv[6 * tb] ^= 0xFF; // an unselected row
        assert_eq!(digest(&kv), base);
        // The order of selection matters (ranks are part of the digest).
        let swapped = [70i32, 5, -1, 3];
        let mut o = [0u64];
        cpu::sparse_read(&a, &swapped, &kv, fmt.fingerprint(), &mut o).unwrap();
        assert_ne!(o[0], base);
    }
    // The foreign fp8_unpacked format is refused, as on CUDA, not read.
    let fmt = PageFormat::Kv(KvDtype::Fp8Unpacked);
    let kv = vec![0u8; fmt.page_bytes() as usize];
    let unpacked = args::SparseRead {
        dtype: KvDtype::Fp8Unpacked,
        rows: 1,
        k: 1,
    };
    let err = cpu::sparse_read(&unpacked, &[0], &kv, fmt.fingerprint(), &mut [0u64]).unwrap_err();
    assert!(err.to_string().contains("fp8_unpacked"), "{err}");
}

#[test]
fn kv_store_packs_fp8_rows_as_designed() {
    let mut g = Gen(11);
    let row = g.vec_bf16(576, 5.0);
    let mut out = vec![0u8; 656];
    store::kv_token(KvDtype::Fp8Packed, &row, &mut out);
    // Byte for byte the specification's row (its own offsets and rounding).
    assert_eq!(naive::check_kv_row(KvDtype::Fp8Packed, &row, &out), Ok(()));
    for tile in 0..4 {
        let scale = read_f32(&out, kv_row::FP8_SCALES_OFFSET + 4 * tile) as f64;
        assert!(scale > 0.0 && e4m3_decode(out[tile * 128]).is_finite());
    }
    for r in 0..64 {
        assert_eq!(
            numerics::read_u16(&out, kv_row::FP8_ROPE_OFFSET + 2 * r),
            row[512 + r].to_bits()
        );
    }
    let _ = topk::order_key(0.0);
}
