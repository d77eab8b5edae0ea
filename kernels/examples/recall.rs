//! Needle recall of the indexer at long context, fp8 index-K versus bf16 index-K versus an f32
//! reference (DESIGN §1 incident 3). Writes the table of `kernels/RECALL.md`:
//!
//!     cargo run --release -p tierkv-kernels --example recall
//!
//! The workload isolates the precision of the stored keys. Keys are built directly in the
//! indexer's post-Hadamard space (what `index_k_store` quantizes; so RoPE, YaRN or not, plays no
//! part), then stored exactly as the store kernel stores them: fp8 e4m3 with one scale per token
//! (DeepSeek-V3.2's `ue8m0` power of two, or the exact fp32 `amax / 448`), or bf16, or kept in f32
//! for the reference. The query goes through `q_prep`'s quantization (fp8 per head, with the same
//! scale format as the keys; `ue8m0` beside bf16 keys, as the presets pair them) and its folded
//! weight `((w · heads^-½) · q_scale) · 128^-½`, and scores through the logits reference
//! `Σ_h w_h · relu(q_h · k)`.
//!
//! Every query head points along a direction u; the needle at position 7 is the key closest to u
//! (cosine 0.98). Among the
//! distractors, one in eight is *hard*: a cosine drawn uniformly from [0.98 − ε, 0.98) with
//! ε = 0.01, so in exact arithmetic the needle outranks every one of them. Their number grows
//! with the context (128 at 1K, 8192 at 64K), so once it exceeds k the needle survives the top-k
//! only if the stored keys keep score errors well below ε — which bf16 (8 significant bits,
//! relative error about 2⁻⁹ per value) does and fp8 e4m3 (4 significant bits, about 2⁻⁴ per value)
//! does not. The rest are easy distractors (cosine in [0, 0.5]).

use tierkv_kernels::cpu::logits::{apply_scale, scores};
use tierkv_kernels::cpu::numerics::{
    amax, bf16_bits, bf16_value, e4m3_decode, e4m3_encode, fp8_scale, mix64,
};
use tierkv_kernels::cpu::q_prep::{folded_weight, head_weight_scale};
use tierkv_kernels::layout::IndexKDtype;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    fn unit_vector(&mut self) -> [f64; 128] {
        let mut v = [0f64; 128];
        for x in v.iter_mut() {
            *x = self.normal();
        }
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.map(|x| x / n)
    }
}

/// `c·u + sqrt(1 − c²)·(component of r orthogonal to u)`, scaled to norm `mag`.
fn with_cosine(u: &[f64; 128], r: &[f64; 128], c: f64, mag: f64) -> [f32; 128] {
    let d: f64 = u.iter().zip(r).map(|(a, b)| a * b).sum();
    let mut o = [0f64; 128];
    for i in 0..128 {
        o[i] = r[i] - d * u[i];
    }
    let n = o.iter().map(|x| x * x).sum::<f64>().sqrt();
    let s = (1.0 - c * c).max(0.0).sqrt();
    let mut out = [0f32; 128];
    for i in 0..128 {
        out[i] = (mag * (c * u[i] + s * o[i] / n)) as f32;
    }
    out
}

#[derive(Clone, Copy)]
enum Store {
    F32,
    Bf16,
    /// fp8 e4m3 with one scale per token, a power of two under `ue8m0`.
    Fp8 {
        ue8m0: bool,
    },
}

/// Stores a key as the store kernel would and returns what the logits kernel reads back.
fn store(y: &[f32; 128], how: Store) -> ([f32; 128], f32) {
    match how {
        Store::F32 => (*y, 1.0),
        Store::Bf16 => (y.map(|v| bf16_value(bf16_bits(v))), 1.0),
        Store::Fp8 { ue8m0 } => {
            let scale = fp8_scale(amax(y), ue8m0);
            (y.map(|v| e4m3_decode(e4m3_encode(v / scale))), scale)
        }
    }
}

/// The measured variants: how keys are stored, and whether the query's scale is `ue8m0`.
const VARIANTS: [(Store, bool); 4] = [
    (Store::F32, false),
    (Store::Bf16, true),
    (Store::Fp8 { ue8m0: true }, true),
    (Store::Fp8 { ue8m0: false }, false),
];

fn main() {
    let contexts = [1024usize, 4096, 16384, 65536];
    let ks = [512usize, 2048];
    let trials: usize = match std::env::var("RECALL_TRIALS") {
        Ok(v) => match v.trim().parse() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!("RECALL_TRIALS={v:?}: give a number of trials, 1 or more");
                std::process::exit(2);
            }
        },
        Err(_) => 40,
    };
    let heads = 4;
    let eps = 0.01;
    let needle_pos = 7;
    println!("| context | k | hard distractors | recall f32 (q and k exact) | recall bf16 index-K (q ue8m0) | recall fp8 index-K (q, k ue8m0) | recall fp8 index-K (q, k fp32 scales) | needle rank, fp8 ue8m0 / fp32 (median) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &ctx in &contexts {
        for &k in &ks {
            let mut hits = [0usize; VARIANTS.len()];
            let mut fp8_ranks = [Vec::new(), Vec::new()];
            let mut hard_count = 0;
            for t in 0..trials {
                let mut r = Rng(mix64((ctx as u64) << 20 ^ (k as u64) << 8 ^ t as u64));
                let u = r.unit_vector();
                // Keys of equal norm: the score compares cosines with the query direction.
                let mut keys: Vec<[f32; 128]> = Vec::with_capacity(ctx);
                hard_count = 0;
                for n in 0..ctx {
                    let rnd = r.unit_vector();
                    let c = if n == needle_pos {
                        0.98
                    } else if r.unit() < 0.125 {
                        hard_count += 1;
                        0.98 - eps * r.unit().max(1e-9)
                    } else {
                        0.5 * r.unit()
                    };
                    keys.push(with_cosine(&u, &rnd, c, 8.0));
                }
                // The query: every head close to u. The stored-key variants get it through
                // q_prep's fp8 quantization (the scale folded into the head weight with DeepSeek's
                // constant), as the engine does; the f32 reference keeps it exact.
                let heads_q: Vec<[f32; 128]> = (0..heads)
                    .map(|_| {
                        let rnd = r.unit_vector();
                        with_cosine(&u, &rnd, 1.0, 6.0)
                    })
                    .collect();
                let q32: Vec<f32> = heads_q.iter().flatten().copied().collect();
                let w32 = vec![1f32; heads];
                let quantized = |ue8m0: bool| {
                    let mut q8 = Vec::with_capacity(heads * 128);
                    let mut w8 = Vec::with_capacity(heads);
                    for qh in &heads_q {
                        let s = fp8_scale(amax(qh), ue8m0);
                        q8.extend(qh.map(|v| e4m3_decode(e4m3_encode(v / s))));
                        w8.push(folded_weight(1.0, head_weight_scale(heads), s));
                    }
                    (q8, w8)
                };
                for (vi, &(how, q_ue8m0)) in VARIANTS.iter().enumerate() {
                    let (q, w) = match how {
                        Store::F32 => (q32.clone(), w32.clone()),
                        _ => quantized(q_ue8m0),
                    };
                    let stored: Vec<([f32; 128], f32)> =
                        keys.iter().map(|y| store(y, how)).collect();
                    let ks_: Vec<[f32; 128]> = stored.iter().map(|s| s.0).collect();
                    let mut sc = vec![0f32; ctx];
                    scores(&q, &w, &ks_, &mut sc);
                    let dtype = if matches!(how, Store::Fp8 { .. }) {
                        IndexKDtype::Fp8
                    } else {
                        IndexKDtype::Bf16
                    };
                    for (s, st) in sc.iter_mut().zip(&stored) {
                        *s = apply_scale(*s, st.1, dtype);
                    }
                    let needle = sc[needle_pos];
                    // Rank under the top-k kernel's order (ties to the lower position).
                    let rank = sc
                        .iter()
                        .enumerate()
                        .filter(|&(n, &s)| s > needle || (s == needle && n < needle_pos))
                        .count();
                    if rank < k {
                        hits[vi] += 1;
                    }
                    if let Store::Fp8 { ue8m0 } = how {
                        fp8_ranks[usize::from(!ue8m0)].push(rank);
                    }
                }
            }
            let median = |v: &mut Vec<usize>| {
                v.sort_unstable();
                v[v.len() / 2]
            };
            let (m_ue, m_fp32) = (median(&mut fp8_ranks[0]), median(&mut fp8_ranks[1]));
            let pct = |h: usize| format!("{:.2}", h as f64 / trials as f64);
            println!(
                "| {ctx} | {k} | {hard_count} | {} | {} | {} | {} | {m_ue} / {m_fp32} |",
                pct(hits[0]),
                pct(hits[1]),
                pct(hits[2]),
                pct(hits[3]),
            );
        }
    }
    println!("\n{trials} trials per row, {heads} heads, needle cosine 0.98, hard distractors in [0.98 - {eps}, 0.98).");
}
