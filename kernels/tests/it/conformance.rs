//! GPU conformance: one test body per kernel, instantiated for the CPU reference and (feature
//! `cuda`, on a GPU machine) for CUDA. Fresh random inputs every run (the seed is printed),
//! outputs poisoned before every launch, fp8 and bf16, awkward sizes. Store, q_prep, page copy,
//! sparse read and top-k must match the CPU reference bit for bit; logits within 1e-5 relative
//! (the kernel uses the reference's operation order, so in practice they are bit-exact too and the
//! test reports how many are).

use crate::naive;
use half::bf16;
use tierkv_kernels::args;
use tierkv_kernels::cpu::{self, numerics::mix64};
use tierkv_kernels::layout::*;
use tierkv_kernels::rope::{Rope, RopeParams};
use tierkv_kernels::Result;

/// DeepSeek-V3.2's RoPE row of `position` (YaRN on, as at its 128K context).
fn rope_row(position: u32) -> [f32; 64] {
    Rope::new(&RopeParams::deepseek_v32(131_072)).row(position)
}

/// Where a kernel runs. Inputs and outputs are host byte buffers; a GPU backend moves them.
pub trait Backend {
    fn name(&self) -> &'static str;
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA instances ask
    /// Whether `index_logits` follows the reference's operation order (so the test expects it bit
    /// for bit where it can); otherwise it is held to DESIGN §4's 1e-5 of each logit's magnitude.
    fn logits_exact(&self) -> bool {
        true
    }
    fn index_k_store(
        &self,
        a: &args::IndexKStore,
        x: &cpu::IndexKStoreInputs,
        dst: &mut [u8],
        fp: LayoutFingerprint,
    ) -> Result<()>;
    fn kv_store(
        &self,
        a: &args::KvStore,
        rows: &[bf16],
        dst: &mut [u8],
        fp: LayoutFingerprint,
    ) -> Result<()>;
    fn q_prep(
        &self,
        a: &args::QPrep,
        x: &cpu::QPrepInputs,
        q_out: &mut [u8],
        w_out: &mut [f32],
    ) -> Result<()>;
    fn index_logits(
        &self,
        a: &args::IndexLogits,
        qw: (&[u8], &[f32]),
        k: &[u8],
        fp: LayoutFingerprint,
        out: &mut [f32],
    ) -> Result<()>;
    fn topk(&self, a: &args::TopK, logits: &[f32], out: &mut [i32]) -> Result<()>;
    fn sparse_read(
        &self,
        a: &args::SparseRead,
        slots: &[i32],
        kv: &[u8],
        fp: LayoutFingerprint,
        out: &mut [u64],
    ) -> Result<()>;
    fn page_copy(
        &self,
        src: &[u8],
        sv: &PagedView,
        dst: &mut [u8],
        dv: &PagedView,
        runs: &[PageRun],
    ) -> Result<()>;
}

pub struct Cpu;
impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn index_k_store(
        &self,
        a: &args::IndexKStore,
        x: &cpu::IndexKStoreInputs,
        dst: &mut [u8],
        fp: LayoutFingerprint,
    ) -> Result<()> {
        cpu::index_k_store(a, x, dst, fp)
    }
    fn kv_store(
        &self,
        a: &args::KvStore,
        rows: &[bf16],
        dst: &mut [u8],
        fp: LayoutFingerprint,
    ) -> Result<()> {
        cpu::kv_store(a, rows, dst, fp)
    }
    fn q_prep(
        &self,
        a: &args::QPrep,
        x: &cpu::QPrepInputs,
        q_out: &mut [u8],
        w_out: &mut [f32],
    ) -> Result<()> {
        cpu::q_prep(a, x, q_out, w_out)
    }
    fn index_logits(
        &self,
        a: &args::IndexLogits,
        (q, w): (&[u8], &[f32]),
        k: &[u8],
        fp: LayoutFingerprint,
        out: &mut [f32],
    ) -> Result<()> {
        cpu::index_logits(a, q, w, k, fp, out)
    }
    fn topk(&self, a: &args::TopK, logits: &[f32], out: &mut [i32]) -> Result<()> {
        cpu::topk(a, logits, out)
    }
    fn sparse_read(
        &self,
        a: &args::SparseRead,
        slots: &[i32],
        kv: &[u8],
        fp: LayoutFingerprint,
        out: &mut [u64],
    ) -> Result<()> {
        cpu::sparse_read(a, slots, kv, fp, out)
    }
    fn page_copy(
        &self,
        src: &[u8],
        sv: &PagedView,
        dst: &mut [u8],
        dv: &PagedView,
        runs: &[PageRun],
    ) -> Result<()> {
        cpu::page_copy(src, sv, dst, dv, runs)
    }
}

pub struct Gen(pub u64);
impl Gen {
    /// Fresh inputs: the seed is `TIERKV_TEST_SEED` when set (decimal or `0x` hex), otherwise
    /// drawn from the clock; it is printed either way, so a failure replays with the variable.
    pub fn fresh(label: &str) -> Gen {
        let seed = match std::env::var("TIERKV_TEST_SEED") {
            Ok(v) => {
                let v = v.trim();
                let parsed = match v.strip_prefix("0x") {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => v.parse(),
                };
                parsed.unwrap_or_else(|_| panic!("TIERKV_TEST_SEED={v} is not a u64"))
            }
            Err(_) => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64;
                mix64(t ^ label.len() as u64)
            }
        };
        eprintln!("{label}: seed {seed:#x} (replay with TIERKV_TEST_SEED={seed:#x})");
        Gen(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    pub fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(self.unit() * scale))
            .collect()
    }
    pub fn poison(&mut self, n: usize) -> Vec<u8> {
        let p = (self.next() as u8) | 0x81;
        vec![p; n]
    }
    /// `n` distinct slots among `slots`.
    pub fn slots(&mut self, n: usize, slots: usize) -> Vec<i32> {
        let mut all: Vec<i32> = (0..slots as i32).collect();
        for i in 0..n.min(slots) {
            let j = i + self.below((slots - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(n);
        all
    }
}

/// What a body holds a backend's outputs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Bit for bit the CPU reference (a GPU backend).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Reference,
    /// The independent versions of `naive.rs` (the CPU reference itself: comparing it with
    /// itself would prove nothing).
    Independent,
}

fn verdict(what: String, r: std::result::Result<(), String>) {
    if let Err(e) = r {
        panic!("{what}: {e}");
    }
}

pub fn store_body(b: &dyn Backend, expect: Expect) {
    let mut g = Gen::fresh("store");
    for dtype in IndexKDtype::ALL {
        // Both scale formats in every run: ue8m0 alternates from a random start.
        let flip = g.next() & 1 == 1;
        let mut sizes = vec![(1usize, 1usize), (63, 2), (1000, 20), (4099, 70)];
        if expect == Expect::Reference {
            // A GPU launch of many CTAs (the f64 check of the CPU instance would take minutes
            // in a debug build).
            sizes.push((70_001, 1200));
        }
        for (i, (n, pages)) in sizes.into_iter().enumerate() {
            let ue8m0 = (i % 2 == 1) ^ flip;
            let keys = g.bf16s(n * 128, 6.0);
            let gamma: Vec<f32> = (0..128).map(|_| 1.0 + 0.5 * g.unit()).collect();
            let beta: Vec<f32> = (0..128).map(|_| 0.3 * g.unit()).collect();
            let rope: Vec<f32> = (0..n)
                .flat_map(|_| rope_row(g.below(131_072) as u32))
                .collect();
            let slots = g.slots(n, pages * 64);
            let a = args::IndexKStore {
                dtype,
                ue8m0,
                slots: (&slots[..]).into(),
            };
            let x = cpu::IndexKStoreInputs {
                keys: &keys,
                gamma: &gamma,
                beta: &beta,
                rope: &rope,
            };
            let fmt = PageFormat::IndexK(dtype);
            let mut want = g.poison(pages * fmt.page_bytes() as usize);
            let before = want.clone();
            let mut got = want.clone();
            b.index_k_store(&a, &x, &mut got, fmt.fingerprint())
                .unwrap();
            let what = format!("{} index_k_store {dtype:?} n={n}", b.name());
            if expect == Expect::Independent {
                verdict(what, naive::check_index_k_store(&a, &x, &before, &got));
                continue;
            }
            cpu::index_k_store(&a, &x, &mut want, fmt.fingerprint()).unwrap();
            assert!(got == want, "{what}: {} bytes differ", diff(&got, &want));
        }
    }
    for dtype in KvDtype::ALL {
        for n in [1usize, 77, 1500] {
            let rows = g.bf16s(n * 576, 10.0);
            let pages = n.div_ceil(64) + 1;
            let slots = g.slots(n, pages * 64);
            let a = args::KvStore {
                dtype,
                slots: (&slots[..]).into(),
            };
            let fmt = PageFormat::Kv(dtype);
            let mut want = g.poison(pages * fmt.page_bytes() as usize);
            let before = want.clone();
            let mut got = want.clone();
            b.kv_store(&a, &rows, &mut got, fmt.fingerprint()).unwrap();
            let what = format!("{} kv_store {dtype:?} n={n}", b.name());
            if expect == Expect::Independent {
                verdict(what, naive::check_kv_store(&a, &rows, &before, &got));
                continue;
            }
            cpu::kv_store(&a, &rows, &mut want, fmt.fingerprint()).unwrap();
            assert!(got == want, "{what}: {} bytes differ", diff(&got, &want));
        }
    }
}

fn diff(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

pub fn q_prep_body(b: &dyn Backend, expect: Expect) {
    let mut g = Gen::fresh("q_prep");
    for (n, heads) in [(1usize, 1usize), (3, 64), (70, 17), (128, 64)] {
        let ue8m0 = g.next() & 1 == 1;
        let q = g.bf16s(n * heads * 128, 4.0);
        let w: Vec<f32> = (0..n * heads).map(|_| g.unit()).collect();
        let rope: Vec<f32> = (0..n)
            .flat_map(|_| rope_row(g.below(65_536) as u32))
            .collect();
        let a = args::QPrep {
            rows: n as u32,
            heads: heads as u32,
            ue8m0,
        };
        let x = cpu::QPrepInputs {
            q: &q,
            weights: &w,
            rope: &rope,
        };
        let (mut qw, mut ww) = (g.poison(n * heads * 128), vec![f32::NAN; n * heads]);
        let (mut qg, mut wg) = (qw.clone(), ww.clone());
        b.q_prep(&a, &x, &mut qg, &mut wg).unwrap();
        if expect == Expect::Independent {
            let what = format!("{} q_prep n={n} heads={heads} ue8m0={ue8m0}", b.name());
            verdict(what, naive::check_q_prep(&a, &x, &qg, &wg));
            continue;
        }
        cpu::q_prep(&a, &x, &mut qw, &mut ww).unwrap();
        assert!(
            qg == qw,
            "{} q_prep n={n} heads={heads} ue8m0={ue8m0}: q differs",
            b.name()
        );
        assert!(
            wg.iter().zip(&ww).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{} q_prep: weights differ",
            b.name()
        );
    }
}

/// A paged index-K buffer filled through the store kernel (CPU) with random keys.
fn filled_pool(g: &mut Gen, dtype: IndexKDtype, pages: usize) -> Vec<u8> {
    let n = pages * 64;
    let keys = g.bf16s(n * 128, 3.0);
    let ones = vec![1f32; 128];
    let zeros = vec![0f32; 128];
    let rope: Vec<f32> = (0..n).flat_map(|p| rope_row(p as u32)).collect();
    let slots: Vec<i32> = (0..n as i32).collect();
    let fmt = PageFormat::IndexK(dtype);
    let mut buf = vec![0u8; pages * fmt.page_bytes() as usize];
    cpu::index_k_store(
        &args::IndexKStore {
            dtype,
            ue8m0: false,
            slots: slots.into(),
        },
        &cpu::IndexKStoreInputs {
            keys: &keys,
            gamma: &ones,
            beta: &zeros,
            rope: &rope,
        },
        &mut buf,
        fmt.fingerprint(),
    )
    .unwrap();
    buf
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA instances run it
pub fn logits_body(b: &dyn Backend) {
    logits_body_with(b, b.logits_exact());
}

/// `exact`: expect bit-exactness where the reference allows it; otherwise the 1e-5 bound.
pub fn logits_body_with(b: &dyn Backend, exact: bool) {
    let mut g = Gen::fresh("logits");
    for dtype in IndexKDtype::ALL {
        // (context lengths, heads, query scale): the last case's queries are all e4m3 subnormals
        // (below 2^-6), so a kernel that flushed them would miss by its whole magnitude.
        for (lens, heads, qscale) in [
            (vec![1usize], 1usize, 440.0f32),
            (vec![63, 65, 1, 200], 64, 440.0),
            (vec![1000, 0, 999], 7, 440.0),
            (vec![130, 64, 129], 33, 440.0),
            (vec![65_536, 40_001], 64, 440.0),
            (vec![700, 129], 64, 0.015),
        ] {
            let rows = lens.len();
            let max = *lens.iter().max().unwrap();
            let pt_stride = max.div_ceil(64);
            let pages = pt_stride + 3;
            let pool = filled_pool(&mut g, dtype, pages);
            // Pages past a row's context are -1, as the engine leaves them: no kernel may read them.
            let page_table: Vec<i32> = (0..rows * pt_stride)
                .map(|i| {
                    if i % pt_stride < lens[i / pt_stride].div_ceil(64) {
                        g.below(pages as u64) as i32
                    } else {
                        -1
                    }
                })
                .collect();
            let q: Vec<u8> = (0..rows * heads * 128)
                .map(|_| cpu::numerics::e4m3_encode(g.unit() * qscale))
                .collect();
            let w: Vec<f32> = (0..rows * heads).map(|_| g.unit() * 0.01).collect();
            let ctx: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let out_stride = max + 5;
            let a = args::IndexLogits {
                dtype,
                heads: heads as u32,
                page_table: (&page_table[..]).into(),
                pt_stride: pt_stride as u32,
                context_lens: (&ctx[..]).into(),
                out_stride: out_stride as u32,
            };
            let fp = PageFormat::IndexK(dtype).fingerprint();
            let mut want = vec![f32::NAN; rows * out_stride];
            let mut got = vec![f32::NAN; rows * out_stride];
            cpu::index_logits(&a, &q, &w, &pool, fp, &mut want).unwrap();
            b.index_logits(&a, (&q, &w), &pool, fp, &mut got).unwrap();
            if !exact {
                let qw = (&q[..], &w[..]);
                check_logits_bound(b.name(), dtype, &lens, &a, qw, &pool, &got, &want);
                continue;
            }
            let mut exact = 0usize;
            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                if x.to_bits() == y.to_bits() {
                    exact += 1;
                    continue;
                }
                assert!(
                    y.is_finite() && (x - y).abs() <= 1e-5 * y.abs().max(1e-30),
                    "{} logits {dtype:?} [{i}]: {x} vs {y}",
                    b.name()
                );
            }
            eprintln!(
                "{} logits {dtype:?} lens {lens:?} heads {heads}: {exact}/{} bit-exact",
                b.name(),
                got.len()
            );
        }
    }
}

/// Structured logits probes, for first contact with a new tensor-core kernel: small integers that
/// every path computes exactly, laid out so a wrong logit names what the kernel paired. Each
/// probe reads back an index from the logits (as two base-16 digits 1..=16, exact in e4m3 and
/// bf16) and the test prints the first mismatches as "probe: output (row, key) read X, expected
/// Y", then fails if any.
/// - dims: row r's queries are one-hot at d = r; every key holds digit(d) at d: logit = the key
///   dim the kernel multiplied with query dim r.
/// - keys: queries one-hot at d = 0; key n holds digit(n) everywhere: logit = the key row the
///   kernel scored at output n.
/// - scales (fp8): keys all 1, key n's scale n + 1: logit = the scale applied at output n.
/// - heads: row r's query is head r (one-hot at d = 0), w_h = h + 1; keys all 1: logit = the
///   weight applied to head r.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the CUDA instances run it
pub fn logits_probe_body(b: &dyn Backend) {
    use tierkv_kernels::layout::index_k_page::{scale_offset, value_offset};
    let one = cpu::numerics::e4m3_encode(1.0);
    let mut bad = Vec::new();
    for dtype in IndexKDtype::ALL {
        let fmt = PageFormat::IndexK(dtype);
        // One page whose key (n, d) is value(n, d), scales scale(n).
        let page = |value: &dyn Fn(u32, u32) -> f32, scale: &dyn Fn(u32) -> f32| {
            let mut p = vec![0u8; fmt.page_bytes() as usize];
            for n in 0..64u32 {
                for d in 0..128u32 {
                    let v = value(n, d);
                    let at = value_offset(dtype, n, d);
                    match dtype {
                        IndexKDtype::Fp8 => p[at] = cpu::numerics::e4m3_encode(v),
                        IndexKDtype::Bf16 => p[at..at + 2]
                            .copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
                    }
                }
                if let Some(at) = scale_offset(dtype, n) {
                    p[at..at + 4].copy_from_slice(&scale(n).to_le_bytes());
                }
            }
            p
        };
        // Runs `rows` rows of 64 heads over the one page (context 64) and returns the logits.
        let run = |rows: usize, q: &[u8], w: &[f32], pool: &[u8]| {
            let page_table = vec![0i32; rows];
            let ctx = vec![64i32; rows];
            let a = args::IndexLogits {
                dtype,
                heads: 64,
                page_table: (&page_table[..]).into(),
                pt_stride: 1,
                context_lens: (&ctx[..]).into(),
                out_stride: 64,
            };
            let mut out = vec![f32::NAN; rows * 64];
            b.index_logits(&a, (q, w), pool, fmt.fingerprint(), &mut out)
                .unwrap();
            out
        };
        let digit = |x: u32, hi: bool| (if hi { x / 16 } else { x % 16 } + 1) as f32;
        let unit_scale = |_| 1.0f32;
        let mut check =
            |probe: &str, rows: usize, got: Vec<f32>, want: &dyn Fn(usize, usize) -> f32| {
                for (i, &x) in got.iter().enumerate() {
                    let (r, n) = (i / 64, i % 64);
                    if x != want(r, n) {
                        bad.push(format!(
                            "{dtype:?} {probe}: output (row {r}, key {n}) read {x}, expected {}",
                            want(r, n)
                        ));
                    }
                }
                assert_eq!(got.len(), rows * 64);
            };
        // dims: 128 rows, row r one-hot at d = r (every head), only head 0 weighted.
        for hi in [false, true] {
            let pool = page(&|_, d| digit(d, hi), &unit_scale);
            let q: Vec<u8> = (0..128 * 64 * 128)
                .map(|i| if i % 128 == i / (64 * 128) { one } else { 0 })
                .collect();
            let w: Vec<f32> = (0..128 * 64).map(|i| (i % 64 == 0) as u32 as f32).collect();
            let got = run(128, &q, &w, &pool);
            check(
                if hi {
                    "dims (d / 16 + 1)"
                } else {
                    "dims (d % 16 + 1)"
                },
                128,
                got,
                &|r, _| digit(r as u32, hi),
            );
        }
        // keys: one row, queries one-hot at d = 0, head 0 weighted.
        let q1: Vec<u8> = (0..64 * 128)
            .map(|i| if i % 128 == 0 { one } else { 0 })
            .collect();
        let w1: Vec<f32> = (0..64).map(|h| (h == 0) as u32 as f32).collect();
        for hi in [false, true] {
            let pool = page(&|n, _| digit(n, hi), &unit_scale);
            let got = run(1, &q1, &w1, &pool);
            check(
                if hi {
                    "keys (n / 16 + 1)"
                } else {
                    "keys (n % 16 + 1)"
                },
                1,
                got,
                &|_, n| digit(n as u32, hi),
            );
        }
        if dtype == IndexKDtype::Fp8 {
            let pool = page(&|_, _| 1.0, &|n| (n + 1) as f32);
            let got = run(1, &q1, &w1, &pool);
            check("scales (n + 1)", 1, got, &|_, n| (n + 1) as f32);
        }
        // heads: 64 rows, row r's only query is head r (one-hot at d = 0); w_h = h + 1.
        let pool = page(&|_, _| 1.0, &unit_scale);
        let q: Vec<u8> = (0..64 * 64 * 128)
            .map(|i| {
                let (r, h, d) = (i / (64 * 128), (i / 128) % 64, i % 128);
                if h == r && d == 0 {
                    one
                } else {
                    0
                }
            })
            .collect();
        let w: Vec<f32> = (0..64 * 64).map(|i| (i % 64 + 1) as f32).collect();
        let got = run(64, &q, &w, &pool);
        check("heads (h + 1)", 64, got, &|r, _| (r + 1) as f32);
    }
    for line in bad.iter().take(24) {
        eprintln!("{} probe: {line}", b.name());
    }
    assert!(
        bad.is_empty(),
        "{}: {} probe logits wrong",
        b.name(),
        bad.len()
    );
}

/// A logits kernel that is not bit-exact: every logit within 1e-5 of its magnitude of the exact
/// (f64) value, masked positions exactly `-inf`. Prints the worst error of the kernel and of the
/// exact f32 reference, both relative to the magnitude.
#[allow(clippy::too_many_arguments)]
fn check_logits_bound(
    name: &str,
    dtype: IndexKDtype,
    lens: &[usize],
    a: &args::IndexLogits,
    qw: (&[u8], &[f32]),
    pool: &[u8],
    got: &[f32],
    reference: &[f32],
) {
    let heads = a.heads as usize;
    let (value, magnitude) = naive::index_logits_f64(a, qw, pool);
    let (mut worst, mut worst_ref, mut exact, mut live) = (0f64, 0f64, 0usize, 0usize);
    let mut worst_at = None;
    for (i, ((&x, &r), (&v, &m))) in got
        .iter()
        .zip(reference)
        .zip(value.iter().zip(&magnitude))
        .enumerate()
    {
        if v == f64::NEG_INFINITY {
            assert!(
                x == f32::NEG_INFINITY,
                "{name} logits {dtype:?} [{i}]: {x}, not -inf"
            );
            continue;
        }
        assert!(
            x.is_finite(),
            "{name} logits {dtype:?} [{i}]: {x} at a live position (exact {v})"
        );
        exact += (x.to_bits() == r.to_bits()) as usize;
        live += 1;
        let err = (f64::from(x) - v).abs();
        // A zero magnitude means every term is zero: the logit must be zero too.
        let ratio = if m > 0.0 {
            err / m
        } else if err == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        if ratio > worst || worst_at.is_none() {
            worst = worst.max(ratio);
            worst_at = Some((i, x, v, r, m));
        }
        if m > 0.0 {
            worst_ref = worst_ref.max((f64::from(r) - v).abs() / m);
        }
    }
    eprintln!(
        "{name} logits {dtype:?} lens {lens:?} heads {heads}: worst error {worst:.2e} of the \
         magnitude (f32 reference {worst_ref:.2e}), {exact}/{live} equal to the reference"
    );
    if let Some((i, x, v, r, m)) = worst_at {
        assert!(
            worst <= 1e-5,
            "{name} logits {dtype:?} [{i}]: {x} vs exact {v} (f32 reference {r}): error \
             {worst:.2e} of the magnitude {m:e}, over the bound 1e-5"
        );
    }
}

/// What a top-k row holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scores {
    /// Uniform in ±50: distinct values, almost surely.
    Plain,
    /// Multiples of 0.5 in ±50: every value hundreds of times, so the k-th ties.
    Ties,
    /// One value everywhere: the whole row ties.
    Flat,
    /// Half the positions -inf (masked), the rest in ±1 with some ±0.0: signed zeros and
    /// infinities in the order.
    Masked,
    /// e^(±3): positive and spread over octaves, as the indexer's summed ReLU scores are (meant
    /// for the CUDA kernel's first pass by value).
    Spread,
    /// Plain with one position per row, inside its context, at 3e38: the range by value
    /// stretched and its bins too full (meant for the CUDA kernel's second pass by value, up
    /// to the largest of the rest).
    Outlier,
    /// e^(±1) with the first four positions 50 times larger, as attention sinks score: a range
    /// stretched less far, the threshold above the lowest bins (meant for the radix passes
    /// after the first pass by value, without a second, and the heavy-ties sort).
    Sink,
    /// 2^(±20): spread over 40 octaves, so bins by value are too full near the floor but the
    /// bits' digits are fine (meant for the fallback to the radix passes and their buckets).
    Octaves,
    /// 1, 2 or 3, with one position per row at 3e38: the second pass by value tried and too
    /// full as well, then the heavy-ties sort.
    CoarseOutlier,
    /// Sums of eight ReLUs (as the indexer's scores are) with the first four positions 50 times
    /// larger: the range stretched, the threshold above the lowest bins (meant for the CUDA
    /// kernel's radix passes after the first pass by value, without a second).
    SumSink,
    /// One value everywhere but one position per row at 3e38: the second pass by value's range
    /// is empty, so the radix passes take over.
    FlatOutlier,
    /// Within ±1e-38, subnormal mostly: a range by value too small to scale.
    Tiny,
    /// Within ±1e-35, a quarter subnormal and a quarter ±0.0: a range that scales, with
    /// subnormals and signed zeros among the candidates binned by value.
    Small,
    /// 0, 1 or 2: three values, so every bin holds hundreds of keys and the selection ends in
    /// the sort of the heavy-ties path, at any k.
    Coarse,
}

pub fn topk_body(b: &dyn Backend, expect: Expect) {
    let mut g = Gen::fresh("topk");
    use Scores::*;
    for (rows, len, k, scores) in [
        (1usize, 1usize, 1usize, Plain),
        (3, 100, 512, Plain),
        (5, 5000, 2048, Ties),
        (4, 3000, 37, Ties),
        (64, 65_536, 2048, Plain),
        (64, 65_536, 512, Ties),
        // Batch 1: the cluster's CTAs share one row.
        (1, 65_536, 2048, Plain),
        (1, 65_536, 2048, Ties),
        // k = len and k = len - 1 (every position, and all but one).
        (2, 2048, 2048, Plain),
        (2, 2049, 2048, Ties),
        (3, 20_000, 1, Ties),
        (2, 70_000, 100, Flat),
        (8, 20_000, 2048, Masked),
        // Longer than a cluster of 8 keeps in shared memory: read from global memory per pass.
        (1, 400_000, 2048, Plain),
        // The CUDA kernel's paths, by a model of its choice (the repository's
        // bench/results/2026-12-01-topk-path-model.txt; not checked here): Spread, buckets by
        // value; Outlier, a second pass by value, then its buckets; Octaves, the fallback to
        // the radix passes, then buckets of the bits; SumSink, the fallback, then buckets of the
        // bits or (at the edge, by the draw) the sort; Sink, the fallback, then the sort; CoarseOutlier, a second pass by value, then the heavy-ties sort;
        // FlatOutlier, no second pass (an empty range), then the heavy-ties sort; Tiny, no pass
        // by value (the range cannot scale); Small, buckets by value with subnormal and zero
        // candidates; Coarse, the heavy-ties sort at k = 37 and 2048 with clusters of 4.
        (1, 65_536, 2048, Spread),
        (64, 65_536, 512, Spread),
        (4, 9000, 1, Spread),
        (3, 30_000, 2048, Outlier),
        (2, 2000, 64, Outlier),
        // k below the keys a second pass sets aside.
        (2, 3000, 16, Outlier),
        (2, 3000, 2048, FlatOutlier),
        (2, 20_000, 2048, Sink),
        (1, 65_536, 2048, Sink),
        (3, 4000, 1500, Octaves),
        (2, 5000, 2048, CoarseOutlier),
        (1, 65_536, 2048, SumSink),
        (2, 20_000, 300, Tiny),
        (3, 3000, 300, Small),
        (4, 3000, 37, Coarse),
        (5, 5000, 2048, Coarse),
    ] {
        let stride = len + 3;
        let pt_stride = len.div_ceil(64);
        let flat = g.unit() * 50.0;
        let mut logits: Vec<f32> = (0..rows * stride)
            .map(|_| match scores {
                Plain => g.unit() * 50.0,
                Ties => (g.unit() * 100.0).round() / 2.0,
                Flat | FlatOutlier => flat,
                Masked => match g.below(16) {
                    0..=7 => f32::NEG_INFINITY,
                    8 => 0.0,
                    9 => -0.0,
                    _ => g.unit(),
                },
                Spread => (g.unit() * 3.0).exp(),
                Outlier => g.unit() * 50.0,
                Tiny => g.unit() * 1e-38,
                Small => match g.below(8) {
                    0 | 1 => g.unit() * 1e-39,
                    2 => 0.0,
                    3 => -0.0,
                    _ => g.unit() * 1e-35,
                },
                Coarse => g.below(3) as f32,
                CoarseOutlier => (g.below(3) + 1) as f32,
                Sink => g.unit().exp(),
                Octaves => 2f32.powf(g.unit() * 20.0),
                SumSink => (0..8)
                    .map(|_| g.unit().max(0.0) * (1.0 + 0.5 * g.unit()))
                    .sum(),
            })
            .collect();
        let page_table: Vec<i32> = (0..rows * pt_stride)
            .map(|_| g.below(1 << 20) as i32)
            .collect();
        let ctx: Vec<i32> = (0..rows)
            .map(|r| {
                if r % 3 == 1 {
                    (len / 2) as i32
                } else {
                    len as i32
                }
            })
            .collect();
        for (r, &len) in ctx.iter().enumerate() {
            let row = &mut logits[r * stride..(r + 1) * stride];
            match scores {
                Outlier | CoarseOutlier | FlatOutlier => row[g.below(len as u64) as usize] = 3e38,
                Sink | SumSink => row[..4].iter_mut().for_each(|x| *x *= 50.0),
                _ => {}
            }
        }
        let a = args::TopK {
            k: k as u32,
            stride: stride as u32,
            context_lens: (&ctx[..]).into(),
            page_table: (&page_table[..]).into(),
            pt_stride: pt_stride as u32,
        };
        let mut want = vec![i32::MIN; rows * k];
        let mut got = want.clone();
        match expect {
            Expect::Reference => cpu::topk(&a, &logits, &mut want).unwrap(),
            Expect::Independent => want = naive::topk(&a, &logits),
        }
        b.topk(&a, &logits, &mut got).unwrap();
        assert!(
            got == want,
            "{} topk rows {rows} len {len} k {k} {scores:?}: {} entries differ",
            b.name(),
            got.iter().zip(&want).filter(|(x, y)| x != y).count()
        );
    }
}

pub fn sparse_read_body(b: &dyn Backend, expect: Expect) {
    let mut g = Gen::fresh("sparse_read");
    for dtype in KvDtype::ALL {
        // k = 129: a last block with one rank (the CUDA kernel splits k over k/128 blocks).
        for (rows, k, pages) in [
            (1usize, 1usize, 1usize),
            (8, 2048, 40),
            (33, 100, 5),
            (3, 129, 5),
        ] {
            let fmt = PageFormat::Kv(dtype);
            let kv: Vec<u8> = (0..pages * fmt.page_bytes() as usize)
                .map(|_| g.next() as u8)
                .collect();
            let slots: Vec<i32> = (0..rows * k)
                .map(|_| {
                    if g.below(7) == 0 {
                        -1
                    } else {
                        g.below((pages * 64) as u64) as i32
                    }
                })
                .collect();
            let a = args::SparseRead {
                dtype,
                rows: rows as u32,
                k: k as u32,
            };
            let mut want = vec![0xDEAD_BEEFu64; rows];
            let mut got = want.clone();
            match expect {
                Expect::Reference => {
                    cpu::sparse_read(&a, &slots, &kv, fmt.fingerprint(), &mut want).unwrap()
                }
                Expect::Independent => want = naive::sparse_read(&a, &slots, &kv),
            }
            b.sparse_read(&a, &slots, &kv, fmt.fingerprint(), &mut got)
                .unwrap();
            assert_eq!(
                got,
                want,
                "{} sparse_read {dtype:?} rows {rows} k {k}",
                b.name()
            );
        }
    }
}

pub fn page_copy_body(b: &dyn Backend, expect: Expect) {
    let mut g = Gen::fresh("page_copy");
    for layout in HostLayout::ALL {
        for ik in IndexKDtype::ALL {
            let l = Layout::new(LayoutParams {
                layers: 3,
                layer_base: 0,
                index_n_heads: 1,
                index_k_dtype: ik,
                kv_dtype: KvDtype::Fp8Packed,
                device_pages: 40,
                host_pages: 90,
                host_layout: layout,
            })
            .unwrap();
            for kind in BufferKind::ALL {
                let dev: Vec<u8> = (0..l.device_layer_bytes(kind).0)
                    .map(|_| g.next() as u8)
                    .collect();
                let host_view = l.host_layer_view(kind, LayerId(1));
                let dev_view = l.device_layer_view(kind);
                let pairs: Vec<(PageId, PageId)> = g
                    .slots(37, 40)
                    .into_iter()
                    .zip(g.slots(37, 90))
                    .map(|(a, b)| (PageId(a as u32), PageId(b as u32)))
                    .collect();
                let runs = coalesce_runs(&pairs);
                let mut want = g.poison(l.host_bytes(kind).usize());
                let mut got = want.clone();
                match expect {
                    Expect::Reference => {
                        cpu::page_copy(&dev, &dev_view, &mut want, &host_view, &runs).unwrap()
                    }
                    Expect::Independent => {
                        // Placed by the specification's own formats, not by the views.
                        let to = naive::format::Placement::Host {
                            order: layout,
                            layers: 3,
                            pages: 90,
                            layer: 1,
                        };
                        let runs: Vec<naive::Run> = runs
                            .iter()
                            .map(|r| naive::Run {
                                src: r.src.0,
                                dst: r.dst.0,
                                count: r.count,
                            })
                            .collect();
                        let pb = match kind {
                            BufferKind::Kv => naive::format::kv_page_bytes(KvDtype::Fp8Packed),
                            BufferKind::IndexK => naive::format::index_k_page_bytes(ik),
                        };
                        naive::page_copy(
                            &dev,
                            naive::format::Placement::Device,
                            &mut want,
                            to,
                            pb,
                            &runs,
                        )
                    }
                }
                b.page_copy(&dev, &dev_view, &mut got, &host_view, &runs)
                    .unwrap();
                assert!(
                    got == want,
                    "{} page_copy {layout:?} {kind:?}: {} bytes differ",
                    b.name(),
                    diff(&got, &want)
                );
            }
        }
    }
}

// The CPU references, held to the independent versions of `naive.rs` on the same awkward
// sizes the GPU instances use.
#[test]
fn store_cpu() {
    store_body(&Cpu, Expect::Independent);
}
#[test]
fn q_prep_cpu() {
    q_prep_body(&Cpu, Expect::Independent);
}
/// The CPU reference held to the f64 bound the tensor-core kernel must meet.
#[test]
fn logits_cpu_within_bound() {
    logits_body_with(&Cpu, false);
}
/// The probes themselves, on the CPU reference.
#[test]
fn logits_probe_cpu() {
    logits_probe_body(&Cpu);
}
#[test]
fn topk_cpu() {
    topk_body(&Cpu, Expect::Independent);
}
#[test]
fn sparse_read_cpu() {
    sparse_read_body(&Cpu, Expect::Independent);
}
#[test]
fn page_copy_cpu() {
    page_copy_body(&Cpu, Expect::Independent);
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
    use std::sync::Arc;
    use tierkv_kernels::cuda::launch::{
        check_index_k_store, DevPtr, IndexKStorePtrs, IndexLogitsPtrs, Kernels, KvStorePtrs,
        LogitsKernel, LogitsTuning, QPrepPtrs, SparseReadPtrs, TopKPtrs, TopKTuning,
    };
    use tierkv_kernels::KernelError;

    pub struct Cuda {
        k: &'static Kernels,
        s: Arc<CudaStream>,
        logits: LogitsKernel,
        tuning: LogitsTuning,
        topk: TopKTuning,
    }

    fn bytes<T: Copy>(v: &[T]) -> &[u8] {
        // SAFETY: plain data viewed as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
    }
    fn bytes_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
        // SAFETY: plain data viewed as bytes.
        unsafe {
            std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v))
        }
    }

    impl Cuda {
        pub fn new() -> Cuda {
            let k = Kernels::global().expect("a CUDA GPU and NVRTC");
            Cuda {
                k,
                s: k.ctx.new_stream().unwrap(),
                logits: LogitsKernel::Exact,
                tuning: LogitsTuning::default(),
                topk: TopKTuning::default(),
            }
        }
        /// Top-k with `cluster` CTAs per row whatever the shape.
        pub fn topk_cluster(cluster: u32) -> Cuda {
            Cuda {
                topk: TopKTuning {
                    cluster: Some(cluster),
                },
                ..Cuda::new()
            }
        }
        /// Logits with the chosen kernel, launched with `tuning`.
        pub fn logits_with(logits: LogitsKernel, tuning: LogitsTuning) -> Cuda {
            Cuda {
                logits,
                tuning,
                ..Cuda::new()
            }
        }
        fn up(&self, data: &[u8]) -> (CudaSlice<u8>, DevPtr) {
            let d = if data.is_empty() {
                self.s.clone_htod(&[0u8]).unwrap()
            } else {
                self.s.clone_htod(data).unwrap()
            };
            let p = {
                let (p, _g) = d.device_ptr(&self.s);
                p
            };
            (
                d,
                DevPtr {
                    ptr: p,
                    bytes: Bytes(data.len() as u64),
                },
            )
        }
        fn down(&self, d: &CudaSlice<u8>, out: &mut [u8]) {
            self.s.memcpy_dtoh(d, out).unwrap();
            self.s.synchronize().unwrap();
        }
    }

    impl Backend for Cuda {
        fn name(&self) -> &'static str {
            match self.logits {
                LogitsKernel::Exact => "cuda",
                LogitsKernel::TensorCore => "cuda (tensor-core logits, wgmma)",
                LogitsKernel::Mma => "cuda (tensor-core logits, mma.sync)",
            }
        }
        fn logits_exact(&self) -> bool {
            self.logits == LogitsKernel::Exact
        }
        fn index_k_store(
            &self,
            a: &args::IndexKStore,
            x: &cpu::IndexKStoreInputs,
            dst: &mut [u8],
            fp: LayoutFingerprint,
        ) -> Result<()> {
            let (_k, kp) = self.up(bytes(x.keys));
            let (_g, gp) = self.up(bytes(x.gamma));
            let (_b, bp) = self.up(bytes(x.beta));
            let (_r, rp) = self.up(bytes(x.rope));
            let (_s, sp) = self.up(bytes(&a.slots));
            let (d, dp) = self.up(dst);
            let p = IndexKStorePtrs {
                keys: kp,
                gamma: gp,
                beta: bp,
                rope: rp,
                slots: sp,
                dst: dp,
                dst_fp: fp,
            };
            self.k.index_k_store(&self.s, a, &p)?;
            self.down(&d, dst);
            Ok(())
        }
        fn kv_store(
            &self,
            a: &args::KvStore,
            rows: &[bf16],
            dst: &mut [u8],
            fp: LayoutFingerprint,
        ) -> Result<()> {
            let (_r, rp) = self.up(bytes(rows));
            let (_s, sp) = self.up(bytes(&a.slots));
            let (d, dp) = self.up(dst);
            let p = KvStorePtrs {
                rows: rp,
                slots: sp,
                dst: dp,
                dst_fp: fp,
            };
            self.k.kv_store(&self.s, a, &p)?;
            self.down(&d, dst);
            Ok(())
        }
        fn q_prep(
            &self,
            a: &args::QPrep,
            x: &cpu::QPrepInputs,
            q_out: &mut [u8],
            w_out: &mut [f32],
        ) -> Result<()> {
            let (_q, qp) = self.up(bytes(x.q));
            let (_w, wp) = self.up(bytes(x.weights));
            let (_r, rp) = self.up(bytes(x.rope));
            let (qo, qop) = self.up(q_out);
            let (wo, wop) = self.up(bytes(w_out));
            let p = QPrepPtrs {
                q: qp,
                w: wp,
                rope: rp,
                q_out: qop,
                w_out: wop,
            };
            self.k.q_prep(&self.s, a, &p)?;
            self.down(&qo, q_out);
            self.down(&wo, bytes_mut(w_out));
            Ok(())
        }
        fn index_logits(
            &self,
            a: &args::IndexLogits,
            (q, w): (&[u8], &[f32]),
            k: &[u8],
            fp: LayoutFingerprint,
            out: &mut [f32],
        ) -> Result<()> {
            let (_q, qp) = self.up(q);
            let (_w, wp) = self.up(bytes(w));
            let (_p, pp) = self.up(bytes(&a.page_table));
            let (_l, lp) = self.up(bytes(&a.context_lens));
            let (_k, kp) = self.up(k);
            let (o, op) = self.up(bytes(out));
            let p = IndexLogitsPtrs {
                q: qp,
                w: wp,
                page_table: pp,
                context_lens: lp,
                k: kp,
                k_fp: fp,
                out: op,
            };
            self.k
                .index_logits_with(self.logits, self.tuning, &self.s, a, &p)?;
            self.down(&o, bytes_mut(out));
            Ok(())
        }
        fn topk(&self, a: &args::TopK, logits: &[f32], out: &mut [i32]) -> Result<()> {
            let (_x, xp) = self.up(bytes(logits));
            let (_l, lp) = self.up(bytes(&a.context_lens));
            let (_p, pp) = self.up(bytes(&a.page_table));
            let (o, op) = self.up(bytes(out));
            let p = TopKPtrs {
                logits: xp,
                context_lens: lp,
                page_table: pp,
                out: op,
            };
            self.k.topk_with(self.topk, &self.s, a, &p)?;
            self.down(&o, bytes_mut(out));
            Ok(())
        }
        fn sparse_read(
            &self,
            a: &args::SparseRead,
            slots: &[i32],
            kv: &[u8],
            fp: LayoutFingerprint,
            out: &mut [u64],
        ) -> Result<()> {
            let (_s, sp) = self.up(bytes(slots));
            let (_k, kp) = self.up(kv);
            let (o, op) = self.up(bytes(out));
            let p = SparseReadPtrs {
                slots: sp,
                kv: kp,
                kv_fp: fp,
                out: op,
            };
            self.k.sparse_read(&self.s, a, &p)?;
            self.down(&o, bytes_mut(out));
            Ok(())
        }
        fn page_copy(
            &self,
            src: &[u8],
            sv: &PagedView,
            dst: &mut [u8],
            dv: &PagedView,
            runs: &[PageRun],
        ) -> Result<()> {
            let flat = tierkv_kernels::cuda::gather_pairs(runs);
            let (_s, sp) = self.up(src);
            let (_p, pp) = self.up(bytes(&flat));
            let (d, dp) = self.up(dst);
            self.k.page_gather(&self.s, sp, sv, dp, dv, runs, pp)?;
            self.down(&d, dst);
            Ok(())
        }
    }

    #[test]
    fn store_cuda() {
        store_body(&Cuda::new(), Expect::Reference);
    }
    #[test]
    fn q_prep_cuda() {
        q_prep_body(&Cuda::new(), Expect::Reference);
    }
    #[test]
    fn logits_cuda() {
        logits_body(&Cuda::new());
    }
    /// The production tensor-core kernel (wgmma), at one CTA per row (so a CTA loops over every
    /// page and its rings turn over many times), three (pages strided between CTAs), the default
    /// launch shape (two CTAs per multiprocessor) and 2112 (more CTAs than pages on the short
    /// rows). Every shape is checked even when one fails, so the log shows them all.
    #[test]
    fn logits_tensor_core_cuda() {
        logits_shapes(
            LogitsKernel::TensorCore,
            &[
                LogitsTuning { ctas: 1, ahead: 0 },
                LogitsTuning { ctas: 3, ahead: 0 },
                LogitsTuning::default(),
                LogitsTuning {
                    ctas: 2112,
                    ahead: 0,
                },
            ],
        );
    }
    /// The previous tensor-core kernel (mma.sync), kept for comparison: one CTA per row, three
    /// (a far L2 prefetch), and its default launch shape.
    #[test]
    fn logits_mma_cuda() {
        logits_shapes(
            LogitsKernel::Mma,
            &[
                LogitsTuning { ctas: 1, ahead: 2 },
                LogitsTuning { ctas: 3, ahead: 16 },
                LogitsTuning::default(),
            ],
        );
    }
    fn logits_shapes(kind: LogitsKernel, shapes: &[LogitsTuning]) {
        let mut failed = Vec::new();
        for &tuning in shapes {
            eprintln!("{kind:?} launch shape: {tuning:?}");
            let run = std::panic::catch_unwind(|| logits_body(&Cuda::logits_with(kind, tuning)));
            if run.is_err() {
                failed.push(tuning);
            }
        }
        assert!(
            failed.is_empty(),
            "{kind:?} launch shapes failing the bound: {failed:?}"
        );
    }
    /// The structured probes (`logits_probe_body`) on both tensor-core kernels and the exact
    /// one: on a wrong logit they print what the kernel paired (key dim, key row, scale, head).
    /// Run it first on a new kernel: `kernels_it logits_probe -- --nocapture`.
    #[test]
    fn logits_probe_cuda() {
        let mut failed = Vec::new();
        for kind in [
            LogitsKernel::TensorCore,
            LogitsKernel::Mma,
            LogitsKernel::Exact,
        ] {
            let run = std::panic::catch_unwind(|| {
                logits_probe_body(&Cuda::logits_with(kind, LogitsTuning::default()))
            });
            if run.is_err() {
                failed.push(kind);
            }
        }
        assert!(failed.is_empty(), "probes failing: {failed:?}");
    }
    #[test]
    fn topk_cuda() {
        topk_body(&Cuda::new(), Expect::Reference);
    }
    /// Every cluster size on every shape (the default picks one per shape). Every size is
    /// checked even when one fails, so the log shows them all.
    #[test]
    fn topk_every_cluster_size_cuda() {
        let mut failed = Vec::new();
        for cluster in [1, 2, 4, 8] {
            eprintln!("CTAs per row: {cluster}");
            let run = std::panic::catch_unwind(|| {
                topk_body(&Cuda::topk_cluster(cluster), Expect::Reference)
            });
            if run.is_err() {
                failed.push(cluster);
            }
        }
        assert!(failed.is_empty(), "cluster sizes failing: {failed:?}");
    }
    /// The launchers answer bad input with typed errors before launching anything.
    #[test]
    fn launchers_refuse_bad_input_cuda() {
        let c = Cuda::new();
        let n = 70usize;
        let (_k, kp) = c.up(&vec![0u8; 2 * 128 * n + 16]);
        let (_g, gp) = c.up(&[0u8; 512]);
        let (_r, rp) = c.up(&vec![0u8; 4 * 64 * n]);
        let slots: Vec<i32> = (0..n as i32).collect();
        let (_s, sp) = c.up(bytes(&slots));
        let fmt = PageFormat::IndexK(IndexKDtype::Fp8);
        let (_d, dp) = c.up(&vec![0u8; 2 * fmt.page_bytes() as usize]);
        let good = args::IndexKStore {
            dtype: IndexKDtype::Fp8,
            ue8m0: false,
            slots: (&slots[..]).into(),
        };
        let ptrs = IndexKStorePtrs {
            keys: kp,
            gamma: gp,
            beta: gp,
            rope: rp,
            slots: sp,
            dst: dp,
            dst_fp: fmt.fingerprint(),
        };
        let checked = check_index_k_store(&good, &ptrs).unwrap();
        assert_eq!(checked.tokens(), n);
        // Keys 8 bytes off a 16-byte boundary.
        let skewed = IndexKStorePtrs {
            keys: kp.offset(Bytes(8), Bytes(2 * 128 * n as u64)),
            ..ptrs
        };
        let err = check_index_k_store(&good, &skewed).unwrap_err();
        assert!(
            matches!(err, KernelError::BadArgument { arg: "keys", .. }),
            "{err}"
        );
        // Slot 128 in a pool of 2 pages (128 slots), at entry 69.
        let mut far = slots.clone();
        far[69] = 128;
        let far_record = args::IndexKStore {
            slots: (&far[..]).into(),
            ..good.clone()
        };
        let err = check_index_k_store(&far_record, &ptrs).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::OutOfRange {
                    index: 69,
                    value: 128,
                    limit: 128,
                    ..
                }
            ),
            "{err}"
        );
        far[69] = -1;
        let far_record = args::IndexKStore {
            slots: (&far[..]).into(),
            ..good
        };
        let err = check_index_k_store(&far_record, &ptrs).unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::OutOfRange {
                    index: 69,
                    value: -1,
                    ..
                }
            ),
            "{err}"
        );
        // Top-k: a cluster size without a kernel, k outside 1..=2048.
        let lens = [64i32];
        let pt = [0i32];
        let (_l, lp) = c.up(bytes(&lens));
        let (_p, pp) = c.up(bytes(&pt));
        let (_x, xp) = c.up(&[0u8; 256]);
        let (_o, op) = c.up(&vec![0u8; 4 * 2048]);
        let record = args::TopK {
            k: 8,
            stride: 64,
            context_lens: (&lens[..]).into(),
            page_table: (&pt[..]).into(),
            pt_stride: 1,
        };
        let ptrs = TopKPtrs {
            logits: xp,
            context_lens: lp,
            page_table: pp,
            out: op,
        };
        let err =
            c.k.topk_with(TopKTuning { cluster: Some(3) }, &c.s, &record, &ptrs)
                .unwrap_err();
        assert!(
            matches!(err, KernelError::BadArgument { arg: "cluster", .. }),
            "{err}"
        );
        let k0 = args::TopK { k: 0, ..record };
        let err =
            c.k.topk_with(TopKTuning::default(), &c.s, &k0, &ptrs)
                .unwrap_err();
        assert!(
            matches!(err, KernelError::BadArgument { arg: "k", .. }),
            "{err}"
        );
    }
    #[test]
    fn sparse_read_cuda() {
        sparse_read_body(&Cuda::new(), Expect::Reference);
    }
    #[test]
    fn page_copy_cuda() {
        page_copy_body(&Cuda::new(), Expect::Reference);
    }
    /// `rope_rows` gathers each position's row of the model's table, equal to `Rope::row`; the
    /// launcher refuses a position past the table.
    #[test]
    fn rope_rows_cuda() {
        use tierkv_kernels::rope::{Rope, RopeParams};
        let c = Cuda::new();
        let mut g = Gen::fresh("rope rows");
        let rope = Rope::new(&RopeParams::deepseek_v32(163_840));
        let table_rows = 4096u32;
        let table = rope.rows(0..table_rows);
        let (_t, tp) = c.up(bytes(&table));
        let positions: Vec<u32> = (0..777)
            .map(|i| match i {
                0 => 0,
                1 => table_rows - 1,
                _ => g.below(table_rows as u64) as u32,
            })
            .collect();
        let (_p, pp) = c.up(bytes(&positions));
        let want = rope.rows(positions.iter().copied());
        // Poisoned first (a NaN pattern), so a row the kernel skips cannot pass.
        let mut got = vec![f32::from_bits(0x7FC0_A5A5); want.len()];
        let (d, dp) = c.up(bytes(&got));
        c.k.rope_rows(&c.s, tp, table_rows, &positions, pp, dp)
            .unwrap();
        c.down(&d, bytes_mut(&mut got));
        assert_eq!(diff(bytes(&got), bytes(&want)), 0);
        let e = c.k.rope_rows(&c.s, tp, table_rows, &[table_rows], pp, dp);
        assert!(e.is_err(), "a position past the table accepted");
    }

    /// `draw.cu` draws the synthetic model's inputs bit for bit as `cpu::draw` does: every
    /// kind, 1 and 64 heads, tokens and positions over their whole ranges (4,096 rows a kind).
    #[test]
    fn draw_cuda() {
        use tierkv_kernels::cpu::draw::{self, DrawArgs, TokenAt};
        use tierkv_kernels::cuda::launch::DrawKind;
        let c = Cuda::new();
        let mut g = Gen::fresh("draw");
        let rows: Vec<TokenAt> = (0..4096)
            .map(|i| TokenAt {
                token: if i % 7 == 0 {
                    u32::MAX - i
                } else {
                    g.below(50_000) as u32
                },
                position: if i % 5 == 0 {
                    u32::MAX - i
                } else {
                    g.below(1 << 20) as u32
                },
            })
            .collect();
        let (_rows, rp) = c.up(bytes(&rows));
        for (seed, layer) in [
            (0u64, 0u32),
            (0xDEAD_BEEF_0123_4567, 60),
            (u64::MAX, u32::MAX),
        ] {
            let a = DrawArgs {
                seed,
                layer,
                rows: &rows,
            };
            let want: [(DrawKind, Vec<u8>); 6] = [
                (DrawKind::IndexKeys, bytes(&draw::index_keys(&a)).to_vec()),
                (DrawKind::KvRows, bytes(&draw::kv_rows(&a)).to_vec()),
                (
                    DrawKind::Queries { heads: 1 },
                    bytes(&draw::queries(&a, 1)).to_vec(),
                ),
                (
                    DrawKind::Queries { heads: 64 },
                    bytes(&draw::queries(&a, 64)).to_vec(),
                ),
                (
                    DrawKind::HeadWeights { heads: 1 },
                    bytes(&draw::head_weights(&a, 1)).to_vec(),
                ),
                (
                    DrawKind::HeadWeights { heads: 64 },
                    bytes(&draw::head_weights(&a, 64)).to_vec(),
                ),
            ];
            for (kind, want) in want {
                assert_eq!(
                    kind.bytes(rows.len() as u64).usize(),
                    want.len(),
                    "{kind:?}"
                );
                let mut got = vec![0xA5u8; want.len()];
                let (d, dp) = c.up(&got);
                c.k.draw(&c.s, kind, seed, layer, rows.len(), rp, dp)
                    .unwrap();
                c.down(&d, &mut got);
                assert_eq!(
                    diff(&got, &want),
                    0,
                    "{kind:?}, seed {seed:#x}, layer {layer}"
                );
            }
        }
        let (d, dp) = c.up(&[0u8; 4]);
        let e =
            c.k.draw(&c.s, DrawKind::Queries { heads: 65 }, 0, 0, 0, rp, dp);
        assert!(e.is_err(), "65 heads accepted");
        let e = c.k.draw(&c.s, DrawKind::KvRows, 0, 0, 2, rp, dp);
        assert!(e.is_err(), "an output of 4 B accepted for two KV rows");
        drop(d);
    }

    /// `next_tokens` and `draw_resolve_pending` (an engine running one step ahead) agree with
    /// `cpu::draw` bit for bit: 1 and 61 layers, a step's first rows and all of them; an index
    /// past the tokens is refused before the launch.
    #[test]
    fn next_tokens_cuda() {
        use tierkv_kernels::cpu::draw::{self, TokenAt};
        let c = Cuda::new();
        let mut g = Gen::fresh("next_tokens");
        for (layers, rows_max, rows) in [(1u32, 1u32, 1u32), (61, 300, 300), (4, 1000, 37)] {
            let digests: Vec<u64> = (0..layers * rows_max).map(|_| g.below(u64::MAX)).collect();
            let seed = g.below(u64::MAX);
            let a = args::NextTokens {
                seed,
                layers,
                rows_max,
                rows,
            };
            let want = draw::next_tokens(&a, &digests).unwrap();
            let (_d, dp) = c.up(bytes(&digests));
            // Poisoned: every entry must be written.
            let mut got = vec![0xA5A5_A5A5u32; rows as usize];
            let (o, op) = c.up(bytes(&got));
            c.k.next_tokens(&c.s, &a, dp, op).unwrap();
            let mut raw = vec![0u8; got.len() * 4];
            c.down(&o, &mut raw);
            for (t, b) in got.iter_mut().zip(raw.chunks_exact(4)) {
                *t = u32::from_le_bytes(b.try_into().unwrap());
            }
            assert_eq!(got, want, "{layers} layers, {rows} of {rows_max} rows");
            // The same tokens resolve pending rows in place.
            let pending: Vec<TokenAt> = (0..2 * rows)
                .map(|i| {
                    if i % 2 == 0 {
                        TokenAt::pending(i / 2, i)
                    } else {
                        TokenAt {
                            token: i,
                            position: i,
                        }
                    }
                })
                .collect();
            let (r, rp) = c.up(bytes(&pending));
            c.k.resolve_pending(&c.s, &pending, rp, op, rows).unwrap();
            let mut raw = vec![0u8; pending.len() * 8];
            c.down(&r, &mut raw);
            let want = draw::resolve_pending(&pending, &want).unwrap();
            assert_eq!(raw, bytes(&want), "{rows} pending rows");
            let past = [TokenAt::pending(rows, 0)];
            let e = c.k.resolve_pending(&c.s, &past, rp, op, rows);
            assert!(e.is_err(), "a pending index past the tokens accepted");
        }
    }

    /// The GPU's e4m3 conversion (`__NV_SATFINITE`) agrees with the `float8` crate over 16.7M
    /// inputs, every rounding midpoint of the format included: each KV latent tile holds 448 (so
    /// its scale is exactly 1 and the codes are the conversion of the values themselves).
    #[test]
    fn fp8_conversion_matches_satfinite_on_the_gpu() {
        let c = Cuda::new();
        let mut g = Gen::fresh("fp8 conversion");
        // Midpoints between neighbouring codes (exact in bf16), and their neighbours.
        let mut specials: Vec<f32> = Vec::new();
        for code in 0..0x7Eu8 {
            let (a, b) = (
                cpu::numerics::e4m3_decode(code),
                cpu::numerics::e4m3_decode(code + 1),
            );
            let mid = (a + b) / 2.0;
            for v in [mid, -mid, a, -b, 450.0, -463.0, 464.0, 500.0] {
                specials.push(v);
            }
        }
        let mut mismatches = 0usize;
        for _ in 0..16 {
            let n = 2048usize;
            // amax = 448 exactly in every tile, so scale = 1 and codes = e4m3(value).
            let mut rows = Vec::with_capacity(n * 576);
            let mut sp = specials.iter().cycle();
            for _ in 0..n {
                for tile in 0..4 {
                    for j in 0..128 {
                        let v = if j == 0 {
                            448.0
                        } else if j < 32 {
                            sp.next().copied().unwrap_or(1.0).clamp(-448.0, 448.0)
                        } else {
                            g.unit() * 448.0 * (1.0 / (1u32 << (g.below(12) + tile)) as f32)
                        };
                        rows.push(bf16::from_f32(v));
                    }
                }
                rows.extend((0..64).map(|_| bf16::from_f32(g.unit())));
            }
            let slots: Vec<i32> = (0..n as i32).collect();
            let a = args::KvStore {
                dtype: KvDtype::Fp8Packed,
                slots: (&slots[..]).into(),
            };
            let fmt = PageFormat::Kv(KvDtype::Fp8Packed);
            let mut want = vec![0u8; (n / 64) * fmt.page_bytes() as usize];
            let mut got = want.clone();
            cpu::kv_store(&a, &rows, &mut want, fmt.fingerprint()).unwrap();
            c.kv_store(&a, &rows, &mut got, fmt.fingerprint()).unwrap();
            mismatches += diff(&got, &want);
        }
        assert_eq!(
            mismatches, 0,
            "e4m3 codes differ between float8 and __NV_SATFINITE"
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn without_cuda_the_entry_points_answer_a_typed_error() {
    use tierkv_kernels::cuda::launch::Kernels;
    use tierkv_kernels::KernelError;
    let e = Kernels::global().expect_err("no kernels without CUDA");
    assert_eq!(
        e,
        KernelError::BuiltWithoutCuda {
            op: "Kernels::global"
        }
    );
    assert!(e.to_string().contains("--features cuda"), "{e}");
    assert_eq!(
        Kernels::on(1).expect_err("no kernels without CUDA"),
        KernelError::BuiltWithoutCuda { op: "Kernels::on" }
    );
    const { assert!(!tierkv_kernels::cuda::ENABLED) };
}
