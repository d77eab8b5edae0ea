// index_k_store and kv_store (cpu::store is the specification).

// index_k_store: LayerNorm -> RoPE -> Hadamard -> fp8 (+scale) or bf16 -> the token's slot.
// dtype: 0 = fp8 (8448 B pages), 1 = bf16 (16384 B pages).
//
// Four lanes (a quad) per token, eight tokens per warp, blockDim.x / 4 per block (the launcher's
// choice, at most IKS_THREADS threads). The operations and
// their order are cpu::store's (the warp butterfly of cpu::numerics, written for this layout); only
// where each value lives differs. Lane q of a quad holds 32 of the 128 values as two runs of 16,
// dims o + 0..16 (run 0) and o + 32..48 (run 1), o = 64 * (q >> 1) + 16 * (q & 1); so a dim's index
// bits are b0..b3 = place in the run, b4 = q & 1, b5 = the run, b6 = q >> 1. Then:
// - RoPE's pairs (i, i + 32) differ in b5: both halves sit in one lane (lanes q = 0, 1);
// - Hadamard stages h = 1, 2, 4, 8 and 32 run inside a lane, h = 16 and h = 64 exchange with the
//   neighbour lane (xor 1, xor 2): 8 shuffles per token instead of 20 with a warp per token;
// - LayerNorm's sums reduce the 32 four-value partials by warp_sum's butterfly, offsets 16, 8, 4,
//   2, 1 = index bits b6 (xor 2), b5 (in lane), b4 (xor 1), b3, b2 (in lane).
// Each lane reads its 64 key bytes and its rope values with 16-byte loads and writes its row bytes
// with 16-byte stores. A slot of -1 marks a padding token (vLLM's slot mapping): the token is
// computed and not stored. Any other slot outside the pool traps: the launcher checked every slot
// on the host (or guard_slots replaced it by -1), so one here means the device copy of the slots
// is not the one checked.
#define IKS_THREADS 256

// Eight bf16 (one 16-byte load) to floats.
__device__ __forceinline__ void iks_unpack8(uint4 r, float* v) {
    const u32 w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
}

// ((x0 + x1) + x2) + x3 of f applied to four consecutive values: cpu::numerics' lane partial.
__device__ __forceinline__ float iks_part(const float* x) {
    return ((x[0] + x[1]) + x[2]) + x[3];
}
__device__ __forceinline__ float iks_part_sq(const float* x) {
    return ((x[0] * x[0] + x[1] * x[1]) + x[2] * x[2]) + x[3] * x[3];
}

// warp_sum over the 32 partials p[run][m] (m = index bits b3 b2) the quad holds.
__device__ __forceinline__ float iks_quad_sum(float p[2][4]) {
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int m = 0; m < 4; m++) p[c][m] = p[c][m] + __shfl_xor_sync(TKV_FULL, p[c][m], 2);  // b6
    float q[4];
#pragma unroll
    for (int m = 0; m < 4; m++) q[m] = p[0][m] + p[1][m];                                      // b5
#pragma unroll
    for (int m = 0; m < 4; m++) q[m] = q[m] + __shfl_xor_sync(TKV_FULL, q[m], 1);              // b4
    float r0 = q[0] + q[2], r1 = q[1] + q[3];                                                   // b3
    return r0 + r1;                                                                             // b2
}

// One Hadamard stage across lanes: the lane whose bit is clear keeps a + b, the other a - b
// (fma(v, -1, o) is o - v rounded once, the same IEEE result as the subtraction).
__device__ __forceinline__ void iks_had_xlane(float v[2][16], int mask, bool upper) {
    float sgn = upper ? -1.0f : 1.0f;
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int t = 0; t < 16; t++) {
            float o = __shfl_xor_sync(TKV_FULL, v[c][t], mask);
            v[c][t] = fmaf(v[c][t], sgn, o);
        }
}

extern "C" __global__ void __launch_bounds__(IKS_THREADS, 3) index_k_store(
    const __nv_bfloat16* __restrict__ keys, const float* __restrict__ gamma,
    const float* __restrict__ beta, const float* __restrict__ rope, const int* __restrict__ slots,
    int n, int dtype, int ue8m0, u32 slots_max, u8* __restrict__ dst) {
    __shared__ __align__(16) float s_gamma[128];
    __shared__ __align__(16) float s_beta[128];
    const int tid = threadIdx.x;
    for (int i = tid; i < 256; i += blockDim.x) {
        if (i < 128) s_gamma[i] = gamma[i];
        else s_beta[i - 128] = beta[i - 128];
    }
    __syncthreads();
    const int gtid = blockIdx.x * blockDim.x + tid;
    if (((gtid & ~31) >> 2) >= n) return;  // the warp's first token is past the end
    const int q = tid & 3, h = q & 1, u = q >> 1;
    const int tok_raw = gtid >> 2;
    const bool live = tok_raw < n;
    const int tok = live ? tok_raw : n - 1;  // a tail quad computes a copy and stores nothing
    const int o = 64 * u + 16 * h;

    // Every load first: 64 key bytes per lane, and the 32 cosines and sines of the RoPE pairs
    // the lane holds (lanes q = 0, 1).
    const uint4* kp = reinterpret_cast<const uint4*>(keys + (size_t)tok * 128 + o);
    uint4 k00 = kp[0], k01 = kp[1], k10 = kp[4], k11 = kp[5];
    float cs[16], sn[16];
    if (u == 0) {
        const float4* rp = reinterpret_cast<const float4*>(rope + (size_t)tok * 64 + 16 * h);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float4 c = rp[j], s = rp[8 + j];
            cs[4 * j] = c.x; cs[4 * j + 1] = c.y; cs[4 * j + 2] = c.z; cs[4 * j + 3] = c.w;
            sn[4 * j] = s.x; sn[4 * j + 1] = s.y; sn[4 * j + 2] = s.z; sn[4 * j + 3] = s.w;
        }
    }
    const int slot = slots[tok];

    float v[2][16];
    iks_unpack8(k00, &v[0][0]);
    iks_unpack8(k01, &v[0][8]);
    iks_unpack8(k10, &v[1][0]);
    iks_unpack8(k11, &v[1][8]);

    // LayerNorm, in cpu::numerics::layer_norm's order.
    float p[2][4];
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int m = 0; m < 4; m++) p[c][m] = iks_part(&v[c][4 * m]);
    const float mean = iks_quad_sum(p) * (1.0f / 128.0f);
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int t = 0; t < 16; t++) v[c][t] = v[c][t] - mean;
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int m = 0; m < 4; m++) p[c][m] = iks_part_sq(&v[c][4 * m]);
    const float var = iks_quad_sum(p) * (1.0f / 128.0f);
    const float rstd = 1.0f / sqrtf(var + 1e-6f);
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const float4* g4 = reinterpret_cast<const float4*>(s_gamma + o + 32 * c);
        const float4* b4 = reinterpret_cast<const float4*>(s_beta + o + 32 * c);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float4 g = g4[j], b = b4[j];
            float* x = &v[c][4 * j];
            x[0] = ((x[0] * rstd) * g.x) + b.x;
            x[1] = ((x[1] * rstd) * g.y) + b.y;
            x[2] = ((x[2] * rstd) * g.z) + b.z;
            x[3] = ((x[3] * rstd) * g.w) + b.w;
        }
    }

    // NeoX RoPE on dims 0..64: pair (i, i + 32) = (v[0][t], v[1][t]), i = 16h + t.
    if (u == 0) {
#pragma unroll
        for (int t = 0; t < 16; t++) {
            float a = v[0][t], b = v[1][t];
            v[0][t] = a * cs[t] - b * sn[t];
            v[1][t] = b * cs[t] + a * sn[t];
        }
    }

    // Walsh-Hadamard, stages h = 1, 2, 4, 8 (in the run), 16 (xor 1), 32 (across runs), 64 (xor 2).
#pragma unroll
    for (int hb = 1; hb < 16; hb <<= 1)
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int t = 0; t < 16; t++)
                if ((t & hb) == 0) {
                    float a = v[c][t], b = v[c][t + hb];
                    v[c][t] = a + b;
                    v[c][t + hb] = a - b;
                }
    iks_had_xlane(v, 1, h != 0);
#pragma unroll
    for (int t = 0; t < 16; t++) {
        float a = v[0][t], b = v[1][t];
        v[0][t] = a + b;
        v[1][t] = a - b;
    }
    iks_had_xlane(v, 2, u != 0);
#pragma unroll
    for (int c = 0; c < 2; c++)
#pragma unroll
        for (int t = 0; t < 16; t++) v[c][t] = v[c][t] * tkv_inv_sqrt_128();

    if (slot != -1 && (u32)slot >= slots_max) __trap();
    const bool put = live && slot != -1;
    const int page = slot / TKV_PAGE_TOKENS, t = slot % TKV_PAGE_TOKENS;
    if (dtype == 0) {
        float amax = 0.0f;
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int j = 0; j < 16; j++) amax = fmaxf(amax, fabsf(v[c][j]));
        amax = fmaxf(amax, __shfl_xor_sync(TKV_FULL, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(TKV_FULL, amax, 2));
        const float scale = tkv_fp8_scale(amax, ue8m0 != 0);
        // A ue8m0 scale is a power of two, so x * (1 / scale) is x / scale exactly (both are the
        // one rounding of the same real number); otherwise divide, as the reference does.
        const float inv = 1.0f / scale;
        u8* pg = dst + (size_t)page * TKV_IK_FP8_PAGE_BYTES;
        if (put) {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                u32 w[4];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float* x = &v[c][4 * j];
                    float2 lo, hi;
                    if (ue8m0) {
                        lo = make_float2(x[0] * inv, x[1] * inv);
                        hi = make_float2(x[2] * inv, x[3] * inv);
                    } else {
                        lo = make_float2(x[0] / scale, x[1] / scale);
                        hi = make_float2(x[2] / scale, x[3] / scale);
                    }
                    w[j] = (u32)__nv_cvt_float2_to_fp8x2(lo, __NV_SATFINITE, __NV_E4M3) |
                           ((u32)__nv_cvt_float2_to_fp8x2(hi, __NV_SATFINITE, __NV_E4M3) << 16);
                }
                *reinterpret_cast<uint4*>(pg + t * TKV_IK_FP8_ROW_BYTES + o + 32 * c) =
                    make_uint4(w[0], w[1], w[2], w[3]);
            }
            if (q == 0) *reinterpret_cast<float*>(pg + TKV_IK_FP8_SCALES + 4 * t) = scale;
        }
    } else if (put) {
        u8* row = dst + (size_t)page * TKV_IK_BF16_PAGE_BYTES + t * TKV_IK_BF16_ROW_BYTES;
#pragma unroll
        for (int c = 0; c < 2; c++) {
            u32 w[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                __nv_bfloat162 b2 = __floats2bfloat162_rn(v[c][2 * j], v[c][2 * j + 1]);
                w[j] = *reinterpret_cast<u32*>(&b2);
            }
            uint4* out = reinterpret_cast<uint4*>(row + 2 * (o + 32 * c));
            out[0] = make_uint4(w[0], w[1], w[2], w[3]);
            out[1] = make_uint4(w[4], w[5], w[6], w[7]);
        }
    }
}

// One block of 128 threads per token. dtype: 0 = bf16 rows (1152 B), 1 = packed fp8 (656 B).
extern "C" __global__ void kv_store(const __nv_bfloat16* __restrict__ rows,
                                    const int* __restrict__ slots, int n, int dtype,
                                    u8* __restrict__ dst) {
    int tok = blockIdx.x;
    if (tok >= n) return;
    const __nv_bfloat16* row = rows + (size_t)tok * TKV_KV_ROW_VALUES;
    size_t slot = (size_t)slots[tok];
    if (dtype == 0) {
        const u16* src = reinterpret_cast<const u16*>(row);
        u16* out = reinterpret_cast<u16*>(dst + slot * TKV_KV_BF16_ROW_BYTES);
        for (int i = threadIdx.x; i < TKV_KV_ROW_VALUES; i += blockDim.x) out[i] = src[i];
        return;
    }
    u8* out = dst + slot * TKV_KV_FP8_ROW_BYTES;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;  // warp = latent tile 0..3
    float v[4];
    tkv_load_bf16x4(row + warp * 128 + 4 * lane, v);
    float amax = fabsf(v[0]);
#pragma unroll
    for (int j = 1; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
    amax = tkv_warp_max(amax);
    float scale = tkv_fp8_scale(amax, false);
    *reinterpret_cast<u32*>(out + warp * 128 + 4 * lane) = tkv_quant4(v, scale);
    if (lane == 0) *reinterpret_cast<float*>(out + TKV_KV_FP8_SCALES + 4 * warp) = scale;
    if (threadIdx.x < 64)
        reinterpret_cast<u16*>(out + TKV_KV_FP8_ROPE)[threadIdx.x] =
            reinterpret_cast<const u16*>(row + 512)[threadIdx.x];
}
