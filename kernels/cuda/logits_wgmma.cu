// index_logits_wgmma: the Hopper tensor-core variant of index_logits (sm_90a only: wgmma). Same
// inputs, outputs and masking as logits.cu and logits_mma.cu; within DESIGN §4's 1e-5 of the
// terms' magnitude (kscale . sum_h |w_h| . sum_d |q_hd k_d|), not bit-exact.
//
// Design (after DeepGEMM's sm90 paged MQA-logits kernel; written from scratch):
//
// - One CTA scores whole pages of one row: grid (chunks, rows); CTA c of row r takes pages c,
//   c + chunks, ... (its "items", in order). G consumer warpgroups and one producer warp:
//   blockDim = 128 G + 32. Item i goes to consumer warpgroup i % G.
// - The producer warp's lane 0 copies each live page whole (keys, and the fp8 scales behind
//   them: one contiguous TKV_IK_*_PAGE_BYTES) with one cp.async.bulk into a stage of its
//   warpgroup's ring of S stages, completing on the stage's "full" mbarrier (complete_tx). The
//   warp reads the page table 32 entries at a time (one per lane, then shuffles).
// - A consumer warpgroup waits "full", loads its lanes' pieces of the page from shared memory
//   into registers (and the fp8 key scales), fences the async proxy and arrives on the stage's
//   "empty" mbarrier (128 arrivals: the stage is free once every thread holds its values),
//   converts, and issues 8 x wgmma.mma_async m64n64k16 (f32 accumulate): A = the page's 64 keys from registers
//   (warp w of the warpgroup: keys 16w .. 16w + 15), B = the row's 64 queries (heads padded
//   with zeros) from shared memory, written once per CTA in the 128-byte-swizzled K-major
//   layout. D[key][head] is 32 f32 per thread.
// - Epilogue per thread: its two keys (16w + g, 16w + g + 8; g = lane >> 2) times its 16 heads
//   (8j + 2c + {0,1}; c = lane & 3): relu, times w_h and summed (fused multiply-adds), then
//   over the quad (xor 1, 2); kscale multiplies last (fp8 pages); -inf at and past the context
//   length; nothing past out_stride.
//
// Why not e4m3 wgmma for fp8 pages: Hopper's fp8 tensor-core accumulation keeps only ~14 bits
// of the aligned products (DeepSeek-V3 report §3.5.2; SageAttention measures an FP22
// accumulator), an error of order 1e-4 of the magnitude, ten times the bound. e4m3 is exact in
// f16, so fp8 keys are converted to f16 in registers (cvt.rn.f16x2.e4m3x2) and the queries
// written as f16: every product is exact and the f32 accumulation is the tensor core's f16 path
// (the one logits_mma.cu already uses within the bound). bf16 pages: the keys enter as they are,
// the queries as bf16 (e4m3 is exact in bf16).
//
// The k order: the dot product runs over d in any order, so the k index of each k-step is a
// permutation of d chosen so that each lane's loads are contiguous 16-byte pieces and a quarter
// warp's 16-byte loads hit distinct banks (rows are 128 or 256 bytes apart, so rows 2q and
// 2q + 1 of a quarter warp swap their two pieces). tkv_wg_dim is the one definition: in k-step
// s, the A fragment's k = 8 hi + 2c + j of lane (g, c) holds d = tkv_wg_dim(s, c, hi, j), and
// the queries are written to shared memory with the same map.
//
// Shared memory (dynamic; the launcher asks for tkv logits_wgmma_smem bytes, mod.rs):
//   [pad to 1024] | Q: 2 halves x 64 heads x 128 B (16 KB, 128B-swizzled) | the row's fp8
//   queries as read (8 KB) | ring: G x S stages of PAGE_BYTES | mbarriers: full[G][S], empty[G][S]
// The CTA stages the queries with 16-byte loads and syncs once; then the producer starts copying
// pages while the consumers write Q and the weights and sync among themselves (named barrier 1).
// Each half of Q holds k = 64 half .. 64 half + 63 (k-steps 4 half .. 4 half + 3): rows of 128 B,
// the 16-byte chunk x of row h stored at chunk x ^ (h & 7) — the hardware's SWIZZLE_128B, which
// is why Q is 1024-byte aligned. The descriptor of k-step s starts at half (s >> 2), byte
// 32 (s & 3) of the row (within the swizzle atom the hardware applies the XOR to the address).
//
// Run on the H200 since GPU.md run 31. The first version released a stage right after the
// loads with no proxy fence, and a later bulk copy overwrote a stage under a read (one key of a
// long bf16 row wrong, every run, at two CTAs per multiprocessor); the async-proxy fence before
// the release ended it (runs 33-37). The kernel trusts the launcher's check of every page id (it reads none on
// the device), and a bulk copy that faulted would leave a consumer spinning on its full
// barrier, not trapping. The conformance probes (`logits_probe_cuda`) run one page of
// structured inputs and print what a wrong logit paired: the key dim, the key row, the scale or
// the head; the 64K rows of `logits_tensor_core_cuda` at the default shape caught the race.

// Bytes of one half of Q in shared memory: 64 heads x 128 bytes (64 f16 or bf16 values).
#define TKV_WG_Q_HALF (64 * 128)

// The k-step map (see the header): fp8 pages, lane c holds d in [32c, 32c + 32) (two 16-byte
// pieces); bf16 pages, lane c holds the 16-byte pieces c, c + 4, c + 8, c + 12 (8 d each).
template <int DT>
__device__ __forceinline__ int tkv_wg_dim(int s, int c, int hi, int j) {
    if (DT == 0) return 32 * c + 4 * s + 2 * hi + j;
    return 8 * (c + 4 * (s >> 1)) + 4 * (s & 1) + 2 * hi + j;
}

__device__ __forceinline__ u32 tkv_smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void tkv_mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void tkv_mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

__device__ __forceinline__ void tkv_mbar_arrive(u32 bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
                 : "memory");
}

__device__ __forceinline__ void tkv_mbar_arrive_tx(u32 bar, u32 bytes) {
    asm volatile(
        "{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
        "r"(bytes)
        : "memory");
}

// One contiguous global range into shared memory, completing `bytes` on the mbarrier.
__device__ __forceinline__ void tkv_bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// The wgmma shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes
// apart (SBO), leading offset unused by this layout (1, as CUTLASS encodes it), base offset 0.
__device__ __forceinline__ u64 tkv_wg_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}

__device__ __forceinline__ void tkv_wg_fence_acc(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 keys x 64 heads, f32) = A (registers) x B (descriptor) when FIRST (D is only written:
// no instruction zeroes it first), else D += A x B.
template <int DT, bool FIRST>
__device__ __forceinline__ void tkv_wgmma(float (&d)[32], const u32 (&a)[4], u64 desc) {
#define TKV_WG_D                                                                                 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "                              \
    "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
#define TKV_WG_OPS(RW)                                                                        \
    : RW(d[0]), RW(d[1]), RW(d[2]), RW(d[3]), RW(d[4]), RW(d[5]), RW(d[6]), RW(d[7]),         \
      RW(d[8]), RW(d[9]), RW(d[10]), RW(d[11]), RW(d[12]), RW(d[13]), RW(d[14]), RW(d[15]),   \
      RW(d[16]), RW(d[17]), RW(d[18]), RW(d[19]), RW(d[20]), RW(d[21]), RW(d[22]), RW(d[23]), \
      RW(d[24]), RW(d[25]), RW(d[26]), RW(d[27]), RW(d[28]), RW(d[29]), RW(d[30]), RW(d[31])  \
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(FIRST ? 0 : 1)
#define TKV_WG_W(x) "=f"(x)
#define TKV_WG_RW(x) "+f"(x)
#define TKV_WG_P "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n wgmma.mma_async.sync.aligned.m64n64k16.f32."
    if (DT == 0 && FIRST) {
        asm volatile(TKV_WG_P "f16.f16 " TKV_WG_D TKV_WG_OPS(TKV_WG_W));
    } else if (DT == 0) {
        asm volatile(TKV_WG_P "f16.f16 " TKV_WG_D TKV_WG_OPS(TKV_WG_RW));
    } else if (FIRST) {
        asm volatile(TKV_WG_P "bf16.bf16 " TKV_WG_D TKV_WG_OPS(TKV_WG_W));
    } else {
        asm volatile(TKV_WG_P "bf16.bf16 " TKV_WG_D TKV_WG_OPS(TKV_WG_RW));
    }
#undef TKV_WG_D
#undef TKV_WG_OPS
#undef TKV_WG_W
#undef TKV_WG_RW
#undef TKV_WG_P
}

__device__ __forceinline__ void tkv_wg_uint4_words(uint4 v, u32* o) {
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}

// Lane (g, c)'s words of one key row, in the order of tkv_wg_dim: fp8, 8 words (word s = d
// 32c + 4s .. + 3); bf16, 16 words (word 4t + w = d 8 (c + 4t) + 2w, + 1). Odd rows load their
// pieces in swapped order (bank spread) and swap them back.
template <int DT>
__device__ __forceinline__ void tkv_wg_load_row(const u8* row, int c, bool odd, u32 (&o)[DT == 0 ? 8 : 16]) {
    const uint4* p = reinterpret_cast<const uint4*>(row);
    if (DT == 0) {
        uint4 x = p[2 * c + (odd ? 1 : 0)];
        uint4 y = p[2 * c + (odd ? 0 : 1)];
        uint4 lo = odd ? y : x, hi = odd ? x : y;
        tkv_wg_uint4_words(lo, o);
        tkv_wg_uint4_words(hi, o + 4);
    } else {
        uint4 v[4];
#pragma unroll
        for (int t = 0; t < 4; t++) v[t] = p[c + 4 * (t ^ (odd ? 1 : 0))];
#pragma unroll
        for (int t = 0; t < 4; t++) {
            uint4 u = odd ? v[t ^ 1] : v[t];
            tkv_wg_uint4_words(u, o + 4 * t);
        }
    }
}

// The query row of the CTA into shared memory as B (f16 for fp8 pages, bf16 for bf16 pages):
// head h, k-step s, k = 8 hi + 2c + j holds q[h][tkv_wg_dim(s, c, hi, j)], zeros past `heads`.
// `qraw` is the row's fp8 queries staged in shared memory (heads x 128 bytes). Run by the
// `threads` consumer threads (index `tid`).
template <int DT>
__device__ __forceinline__ void tkv_wg_write_q(u8* qs, const u8* qraw, int heads, int tid,
                                               int threads) {
    for (int i = tid; i < 64 * 8 * 4 * 2; i += threads) {
        int hi = i & 1, c = (i >> 1) & 3, s = (i >> 3) & 7, h = i >> 6;
        u32 v = 0;
        if (h < heads) {
            int d = tkv_wg_dim<DT>(s, c, hi, 0);  // even: the pair d, d + 1 is one u16
            u32 two = *reinterpret_cast<const u16*>(qraw + h * 128 + d);
            v = DT == 0 ? tkv_e4m3x2_to_f16x2(two) : tkv_e4m3x2_to_bf16x2(two);
        }
        int chunk = 2 * (s & 3) + hi;  // 16-byte chunk of the row (k = 16 (s & 3) + 8 hi ..)
        int off = (s >> 2) * TKV_WG_Q_HALF + h * 128 + ((chunk ^ (h & 7)) << 4) + 4 * c;
        *reinterpret_cast<u32*>(qs + off) = v;
    }
}

// Dynamic shared memory of a CTA (the launcher's logits_wgmma_smem must agree; the kernel traps
// otherwise).
template <int PAGE_BYTES, int G, int S>
__host__ __device__ constexpr u32 tkv_wg_smem_bytes() {
    return 1024 + 3 * TKV_WG_Q_HALF + G * S * PAGE_BYTES + 16 * G * S;
}

template <int DT, int G, int S>
__device__ __forceinline__ void tkv_index_logits_wgmma(
    const u8* __restrict__ q, const float* __restrict__ w, const int* __restrict__ page_table,
    int pt_stride, const int* __restrict__ ctx_lens, int heads, const u8* __restrict__ kbuf,
    float* __restrict__ out, int out_stride) {
    constexpr int PAGE_BYTES = DT == 0 ? TKV_IK_FP8_PAGE_BYTES : TKV_IK_BF16_PAGE_BYTES;
    constexpr int KEY_BYTES = DT == 0 ? TKV_IK_FP8_ROW_BYTES : TKV_IK_BF16_ROW_BYTES;
    static_assert(PAGE_BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");
    static_assert(KEY_BYTES == 128 * (DT == 0 ? 1 : 2), "a key row is 128 values");
    extern __shared__ __align__(1024) u8 tkv_wg_sm[];
    __shared__ float ws[64];  // the head weights, zeros past `heads`
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    // The launcher checks all of this; the kernel repeats it (more than 64 heads would overrun
    // the queries' 8 KB into the ring).
    if (blockDim.x != 128 * G + 32 || dyn < tkv_wg_smem_bytes<PAGE_BYTES, G, S>() || heads < 1 ||
        heads > 64)
        __trap();

    u8* base = tkv_wg_sm + ((1024 - (tkv_smem_u32(tkv_wg_sm) & 1023)) & 1023);
    u8* qs = base;
    u8* qraw = base + 2 * TKV_WG_Q_HALF;  // the row's fp8 queries, as read
    u8* ring = base + 3 * TKV_WG_Q_HALF;
    u64* bars = reinterpret_cast<u64*>(ring + G * S * PAGE_BYTES);
    // full[g][s] = bars[g * S + s], empty[g][s] = bars[G * S + g * S + s]
    const u32 bar0 = tkv_smem_u32(bars);

    const int row = blockIdx.y;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int len = ctx_lens[row];
    const int stride = gridDim.x;
    const int out_pages = (out_stride + 63) / 64;
    const int live_pages = (len + 63) / 64;
    const int first = blockIdx.x;
    const int n_items = first < out_pages ? (out_pages - first + stride - 1) / stride : 0;
    const int n_live = first < live_pages ? (live_pages - first + stride - 1) / stride : 0;

    if (threadIdx.x == 0) {
        for (int i = 0; i < G * S; i++) {
            tkv_mbar_init(bar0 + 8 * i, 1);                // full: the producer's arrive + bytes
            tkv_mbar_init(bar0 + 8 * (G * S + i), 128);    // empty: every consumer thread
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // The row's queries, 16 bytes a thread (all loads in flight at once), staged as they are.
    {
        const uint4* src = reinterpret_cast<const uint4*>(q + (size_t)row * heads * 128);
        for (int i = threadIdx.x; i < heads * 8; i += blockDim.x)
            reinterpret_cast<uint4*>(qraw)[i] = src[i];
    }
    __syncthreads();  // the barriers are initialised, the queries staged: the producer may start

    const int* pt = page_table + (size_t)row * pt_stride;
    if (warp == 4 * G) {
        // Producer warp.
        for (int b = 0; b < n_live; b += 32) {
            int mine = b + lane < n_live ? pt[first + (b + lane) * stride] : 0;
            int cnt = min(32, n_live - b);
            for (int j = 0; j < cnt; j++) {
                int page = __shfl_sync(TKV_FULL, mine, j);
                if (lane == 0) {
                    int it = b + j, g = it % G, l = it / G, st = l % S;
                    u32 full = bar0 + 8 * (g * S + st), empty = bar0 + 8 * (G * S + g * S + st);
                    tkv_mbar_wait(empty, ((l / S) & 1) ^ 1);
                    tkv_mbar_arrive_tx(full, PAGE_BYTES);
                    tkv_bulk_load(tkv_smem_u32(ring + (g * S + st) * PAGE_BYTES),
                                  kbuf + (size_t)page * PAGE_BYTES, PAGE_BYTES, full);
                }
                __syncwarp();
            }
        }
        return;
    }

    // Consumers: the queries as B and the head weights (while the first pages arrive), then
    // a barrier of the consumer threads only (named barrier 1; the producer is not in it).
    tkv_wg_write_q<DT>(qs, qraw, heads, threadIdx.x, 128 * G);
    for (int h = threadIdx.x; h < 64; h += 128 * G)
        ws[h] = h < heads ? w[(size_t)row * heads + h] : 0.0f;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // generic writes -> wgmma
    asm volatile("bar.sync 1, %0;\n" ::"r"(128 * G) : "memory");

    // Consumer warpgroup wg; warp wl of it holds keys 16 wl .. 16 wl + 15.
    const int wg = warp >> 2, wl = warp & 3;
    const int g = lane >> 2, c = lane & 3;
    const int r0 = 16 * wl + g;  // and r0 + 8
    const bool odd = g & 1;
    float* out_row = out + (size_t)row * out_stride;
    // The descriptor of k-step 0; k-step s's adds its byte offset / 16 to the start-address
    // field (bits 0-13, the address / 16: shared memory ends below 2^18, so no carry leaves it),
    // one add instead of rebuilding each descriptor from the address.
    const u64 q_desc = tkv_wg_desc(tkv_smem_u32(qs));
    // The weights of the thread's 16 heads (8j + 2c + e), held in registers for every page.
    float wr[16];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        wr[2 * j] = ws[8 * j + 2 * c];
        wr[2 * j + 1] = ws[8 * j + 2 * c + 1];
    }

    for (int l = 0;; l++) {
        int it = wg + l * G;
        if (it >= n_live) break;
        int p = first + it * stride;
        int st = l % S;
        tkv_mbar_wait(bar0 + 8 * (wg * S + st), (l / S) & 1);
        __syncwarp();  // the wait loop may leave the warp diverged; wgmma needs it converged
        const u8* page = ring + (wg * S + st) * PAGE_BYTES;
        constexpr int WORDS = DT == 0 ? 8 : 16;
        u32 k0[WORDS], k1[WORDS];
        tkv_wg_load_row<DT>(page + r0 * KEY_BYTES, c, odd, k0);
        tkv_wg_load_row<DT>(page + (r0 + 8) * KEY_BYTES, c, odd, k1);
        float sc0 = 1.0f, sc1 = 1.0f;
        if (DT == 0) {
            const float* scales = reinterpret_cast<const float*>(page + TKV_IK_FP8_SCALES);
            sc0 = scales[r0];
            sc1 = scales[r0 + 8];
        }
        // The stage is free once every thread holds its values — and its reads of the stage are
        // ordered before the producer's next bulk copy into it, an async-proxy write: the proxy
        // fence. Without the fence a copy overwrote a stage under a late read (GPU.md runs
        // 31-32: one key of a long bf16 row wrong, every run, at two CTAs per multiprocessor);
        // with it, released here, every run passed (GPU.md run 36: releasing only after the
        // wgmmas, as runs 33-35 did, was not needed).
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        tkv_mbar_arrive(bar0 + 8 * (G * S + wg * S + st));

        // A fragments of the 8 k-steps: reg 0 (key r0) / 1 (key r0 + 8): k 2c, 2c + 1 (hi 0);
        // reg 2 / 3: k 2c + 8, 2c + 9 (hi 1).
        u32 a[8][4];
#pragma unroll
        for (int s = 0; s < 8; s++) {
            if (DT == 0) {
                a[s][0] = tkv_e4m3x2_to_f16x2(k0[s]);
                a[s][1] = tkv_e4m3x2_to_f16x2(k1[s]);
                a[s][2] = tkv_e4m3x2_to_f16x2(k0[s] >> 16);
                a[s][3] = tkv_e4m3x2_to_f16x2(k1[s] >> 16);
            } else {
                // word 4t + w with t = s >> 1, w = 2 (s & 1) + hi
                int w0 = 4 * (s >> 1) + 2 * (s & 1);
                a[s][0] = k0[w0];
                a[s][1] = k1[w0];
                a[s][2] = k0[w0 + 1];
                a[s][3] = k1[w0 + 1];
            }
        }
        float acc[32];  // written by the first k-step's wgmma
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        tkv_wgmma<DT, true>(acc, a[0], q_desc);
#pragma unroll
        for (int s = 1; s < 8; s++)
            tkv_wgmma<DT, false>(acc, a[s],
                                 q_desc + (u64)(((s >> 2) * TKV_WG_Q_HALF + (s & 3) * 32) >> 4));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        tkv_wg_fence_acc(acc);

        // acc[i]: key r0 + 8 ((i >> 1) & 1), head 8 (i >> 2) + 2c + (i & 1).
        float v0 = 0.0f, v1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) {
            // One fused multiply-add a term (the sum is within the 1e-5 bound, not bit-exact).
            const float t = fmaxf(acc[i], 0.0f), wh = wr[2 * (i >> 2) + (i & 1)];
            if ((i >> 1) & 1) v1 = fmaf(wh, t, v1);
            else v0 = fmaf(wh, t, v0);
        }
        v0 += __shfl_xor_sync(TKV_FULL, v0, 1);
        v1 += __shfl_xor_sync(TKV_FULL, v1, 1);
        v0 += __shfl_xor_sync(TKV_FULL, v0, 2);
        v1 += __shfl_xor_sync(TKV_FULL, v1, 2);
        if (DT == 0) {
            v0 = v0 * sc0;
            v1 = v1 * sc1;
        }
        if (c < 2) {
            int r = r0 + 8 * c;
            int n = p * 64 + r;
            if (n < out_stride) out_row[n] = n < len ? (c == 0 ? v0 : v1) : __int_as_float(0xff800000);
        }
    }
    // Pages past the context: -inf (the producer loads none of them).
    const int t = threadIdx.x & 127;
    for (int it = n_live + ((wg - n_live % G) + G) % G; it < n_items; it += G) {
        int n = (first + it * stride) * 64 + t;
        if (t < 64 && n < out_stride) out_row[n] = __int_as_float(0xff800000);
    }
}

#define TKV_LOGITS_WGMMA(NAME, DT, G, S)                                                        \
    extern "C" __global__ void __launch_bounds__(128 * G + 32, 2) NAME(                         \
        const u8* __restrict__ q, const float* __restrict__ w,                                  \
        const int* __restrict__ page_table, int pt_stride, const int* __restrict__ ctx_lens,    \
        int heads, const u8* __restrict__ kbuf, float* __restrict__ out, int out_stride) {      \
        tkv_index_logits_wgmma<DT, G, S>(q, w, page_table, pt_stride, ctx_lens, heads, kbuf,    \
                                         out, out_stride);                                      \
    }

// (name, dtype, consumer warpgroups, stages per warpgroup): two CTAs per multiprocessor
// (110 KB and 91 KB of dynamic shared memory).
TKV_LOGITS_WGMMA(index_logits_wgmma_fp8, 0, 2, 5)
TKV_LOGITS_WGMMA(index_logits_wgmma_bf16, 1, 2, 2)
