// index_logits_mma: the tensor-core variant of index_logits. Same inputs, outputs and masking as
// logits.cu, but the dot products q_h . k_n run on the tensor cores (mma.sync m16n8k16, f32
// accumulate), so the result is within DESIGN §4's 1e-5 of the terms' magnitude
// (kscale . sum_h |w_h| . sum_d |q_hd k_d|), not bit-exact: the tensor core's summation order is
// not the CPU reference's. Production now uses logits_wgmma.cu (LogitsKernel::TensorCore); this
// kernel stays selectable (LogitsKernel::Mma) for comparison in `tierkv bench`. The simulator's
// bit-for-bit oracles use the exact kernel (CudaOps::logits).
//
// Exactness of the operands: every e4m3 value is exact in f16 and in bf16, so the fp8 queries and
// keys enter the tensor core unrounded (f16 for fp8 pages, bf16 for bf16 pages), and each product
// is exact in the f32 accumulator.
//
// Shape. One CTA scores whole pages (64 keys) of one row: grid (chunks, rows); CTA c of row r
// takes pages c, c + chunks, ... Warp w: head half hh = w & 1 (heads 32hh .. 32hh+31, padded with
// zero queries and zero weights past `heads`), key group kg = w >> 1 (NT n-tiles of 8 keys). The
// GEMM is S[h][n] = sum_d Q[h][d] K[n][d]: A = the warp's 32 queries (two m-tiles of 16 heads,
// held in registers for the whole CTA), B = 8 keys per n-tile, K = 128 in 8 k-steps of 16.
//
// The k index of a k-step is a permutation of d chosen so that every lane loads contiguous bytes:
// lane (g = lane >> 2, c = lane & 3) holds d in [32c, 32c + 32) of its key g, and in k-step s the
// mma's k indices 2c, 2c+1 are d = 32c + 4s + 0, 1 and 2c+8, 2c+9 are d = 32c + 4s + 2, 3. The
// A fragments use the same map, so the dot product is over the same pairs.
//
// Epilogue: relu, times w_h, summed over the lane's 4 heads, then over the 8 lanes of a column
// (xor 4, 8, 16); the two head halves meet in shared memory (double-buffered, one barrier per
// page); kscale multiplies last. The pages `ahead` strides ahead are prefetched into L2 with a
// bulk prefetch (no registers), so the register loads of a page find it in L2.
//
// Two kernels, one per page dtype: fp8 pages with KW = 2 key groups of NT = 4 n-tiles, bf16 pages
// with KW = 4 key groups of NT = 2 n-tiles (KW x NT x 8 = 64 keys = one page; 2 x KW warps).
// Other tilings, register pipelining, fp8 -> f16 by bit moves, the fp8 tensor cores (m16n8k32),
// sector-ordered lane loads and cp.async staging through shared memory were measured (GPU.md runs
// 4-9, at commits up to ce23485) and none was faster; they are no longer in the tree. The page
// sizes and offsets come from the layout prelude (TKV_IK_*).

template <int DT>
__device__ __forceinline__ void tkv_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (DT == 0) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ void tkv_prefetch_l2(const void* p, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

// The lane's 32 values of one row, as words in the lane's k order (A and B must agree): d in
// [32c, 32c + 32), one contiguous piece.
__device__ __forceinline__ void tkv_lane_fp8_row(const u8* rowp, int c, u32 (&o)[8]) {
    const uint4* p = reinterpret_cast<const uint4*>(rowp);
    uint4 r0 = p[2 * c];
    uint4 r1 = p[2 * c + 1];
    o[0] = r0.x; o[1] = r0.y; o[2] = r0.z; o[3] = r0.w;
    o[4] = r1.x; o[5] = r1.y; o[6] = r1.z; o[7] = r1.w;
}
__device__ __forceinline__ void tkv_lane_bf16_row(const u8* rowp, int c, u32 (&o)[16]) {
    const uint4* p = reinterpret_cast<const uint4*>(rowp);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 r = p[4 * c + i];
        o[4 * i] = r.x; o[4 * i + 1] = r.y; o[4 * i + 2] = r.z; o[4 * i + 3] = r.w;
    }
}

// The epilogue of a page, for NT n-tiles of 8 keys and MT m-tiles of 16 heads: relu, times w_h,
// summed over the lane's heads and then over the 8 lanes of a column (xor 4, 8, 16); lanes g == 0
// write keys 2c, 2c + 1 of each n-tile into the warp's head-group row of `part`.
template <int MT, int NT>
__device__ __forceinline__ void tkv_head_sums(const float (&acc)[MT][NT][4],
                                              const float (&wt)[MT][2], float* part_row, int kg,
                                              int g, int c) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        float s0 = 0.0f, s1 = 0.0f;  // keys 2c, 2c + 1 of the n-tile
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            s0 += wt[mt][0] * fmaxf(acc[mt][nt][0], 0.0f) + wt[mt][1] * fmaxf(acc[mt][nt][2], 0.0f);
            s1 += wt[mt][0] * fmaxf(acc[mt][nt][1], 0.0f) + wt[mt][1] * fmaxf(acc[mt][nt][3], 0.0f);
        }
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) {
            s0 += __shfl_xor_sync(TKV_FULL, s0, off);
            s1 += __shfl_xor_sync(TKV_FULL, s1, off);
        }
        if (g == 0) {
            int key = (kg * NT + nt) * 8 + 2 * c;
            part_row[key] = s0;
            part_row[key + 1] = s1;
        }
    }
}

// Threads 0..63 write page p of the row: the HG head groups' sums (in group order), times the key
// scale on fp8 pages; -inf at and past the context length; nothing past out_stride.
template <int DT, int HG>
__device__ __forceinline__ void tkv_write_page(const float (*part)[64], const u8* kbuf,
                                               const int* pt, int p, int len, int out_stride,
                                               float* out_row) {
    if (threadIdx.x >= 64) return;
    int t = threadIdx.x;
    int n = p * 64 + t;
    if (n >= out_stride) return;
    float v = __int_as_float(0xff800000);  // -inf
    if (n < len) {
        v = part[0][t];
#pragma unroll
        for (int i = 1; i < HG; i++) v += part[i][t];
        if (DT == 0)
            v = v * *reinterpret_cast<const float*>(kbuf + (size_t)pt[p] * TKV_IK_FP8_PAGE_BYTES +
                                                  TKV_IK_FP8_SCALES + 4 * t);
    }
    out_row[n] = v;
}

// KW key groups x NT n-tiles x 8 keys = 64 keys = one page.
template <int DT, int KW, int NT>
__device__ __forceinline__ void tkv_index_logits_mma(
    const u8* __restrict__ q, const float* __restrict__ w, const int* __restrict__ page_table,
    int pt_stride, const int* __restrict__ ctx_lens, int heads, const u8* __restrict__ kbuf,
    float* __restrict__ out, int out_stride, int ahead) {
    static_assert(KW * NT * 8 == 64, "a CTA scores one page per iteration");
    if (blockDim.x != KW * 64) __trap();  // the launcher's thread count disagrees with the kernel
    constexpr int PAGE_BYTES = DT == 0 ? TKV_IK_FP8_PAGE_BYTES : TKV_IK_BF16_PAGE_BYTES;
    constexpr int KEY_BYTES = DT == 0 ? TKV_IK_FP8_ROW_BYTES : TKV_IK_BF16_ROW_BYTES;
    // u32 words a lane loads per n-tile: its 32 values of one key.
    constexpr int WORDS = DT == 0 ? 8 : 16;
    __shared__ float part[2][2][64];

    const int row = blockIdx.y;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int hh = warp & 1;
    const int kg = warp >> 1;
    const int g = lane >> 2;
    const int c = lane & 3;
    const int len = ctx_lens[row];
    const int out_pages = (out_stride + 63) / 64;
    const int live_pages = (len + 63) / 64;

    // The warp's queries as A fragments: m-tile mt, k-step s.
    u32 a[2][8][4];
    float wt[2][2];  // w of heads 32hh + 16mt + g (+8)
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int h = 32 * hh + 16 * mt + g + 8 * half;
            u32 qw[8];
            if (h < heads) {
                tkv_lane_fp8_row(q + ((size_t)row * heads + h) * 128, c, qw);
                wt[mt][half] = w[(size_t)row * heads + h];
            } else {
#pragma unroll
                for (int s = 0; s < 8; s++) qw[s] = 0u;
                wt[mt][half] = 0.0f;
            }
#pragma unroll
            for (int s = 0; s < 8; s++) {
                u32 lo, hi;
                if (DT == 0) {
                    lo = tkv_e4m3x2_to_f16x2(qw[s]);
                    hi = tkv_e4m3x2_to_f16x2(qw[s] >> 16);
                } else {
                    lo = tkv_e4m3x2_to_bf16x2(qw[s]);
                    hi = tkv_e4m3x2_to_bf16x2(qw[s] >> 16);
                }
                a[mt][s][half] = lo;       // reg 0 (row g) / reg 1 (row g+8): d + 0, 1
                a[mt][s][2 + half] = hi;   // reg 2 / reg 3: d + 2, 3
            }
        }
    }

    const int* pt = page_table + (size_t)row * pt_stride;
    const int stride = gridDim.x;
    if (threadIdx.x == 0) {
        for (int i = 0; i < ahead; i++) {
            int pf = blockIdx.x + i * stride;
            if (pf < live_pages) tkv_prefetch_l2(kbuf + (size_t)pt[pf] * PAGE_BYTES, PAGE_BYTES);
        }
    }
    int buf = 0;
    for (int p = blockIdx.x; p < out_pages; p += stride, buf ^= 1) {
        if (threadIdx.x == 0 && ahead > 0) {
            int pf = p + ahead * stride;
            if (pf < live_pages) tkv_prefetch_l2(kbuf + (size_t)pt[pf] * PAGE_BYTES, PAGE_BYTES);
        }
        if (p < live_pages) {
            // Lane (g, c)'s 32 values of key (kg * NT + nt) * 8 + g, for every n-tile of page p.
            const u8* page = kbuf + (size_t)pt[p] * PAGE_BYTES;
            u32 raw[NT][WORDS];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                int key = (kg * NT + nt) * 8 + g;
                if constexpr (DT == 0) tkv_lane_fp8_row(page + key * KEY_BYTES, c, raw[nt]);
                else tkv_lane_bf16_row(page + key * KEY_BYTES, c, raw[nt]);
            }
            float acc[2][NT][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0.0f;
#pragma unroll
            for (int s = 0; s < 8; s++) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    u32 b0, b1;
                    if (DT == 0) {
                        b0 = tkv_e4m3x2_to_f16x2(raw[nt][s]);
                        b1 = tkv_e4m3x2_to_f16x2(raw[nt][s] >> 16);
                    } else {
                        b0 = raw[nt][2 * s];      // bf16 d + 0, 1
                        b1 = raw[nt][2 * s + 1];  // bf16 d + 2, 3
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) tkv_mma<DT>(acc[mt][nt], a[mt][s], b0, b1);
                }
            }
            tkv_head_sums<2, NT>(acc, wt, part[buf][hh], kg, g, c);
        }
        __syncthreads();
        tkv_write_page<DT, 2>(part[buf], kbuf, pt, p, len, out_stride, out + (size_t)row * out_stride);
    }
}

#define TKV_LOGITS_MMA(NAME, DT, KW, NT)                                                     \
    extern "C" __global__ void __launch_bounds__(KW * 64) NAME(                              \
        const u8* __restrict__ q, const float* __restrict__ w,                               \
        const int* __restrict__ page_table, int pt_stride, const int* __restrict__ ctx_lens, \
        int heads, const u8* __restrict__ kbuf, float* __restrict__ out, int out_stride,     \
        int ahead) {                                                                         \
        tkv_index_logits_mma<DT, KW, NT>(q, w, page_table, pt_stride, ctx_lens, heads, kbuf, \
                                         out, out_stride, ahead);                            \
    }

TKV_LOGITS_MMA(index_logits_mma_fp8, 0, 2, 4)
TKV_LOGITS_MMA(index_logits_mma_bf16, 1, 4, 2)
