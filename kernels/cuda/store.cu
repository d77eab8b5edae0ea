// index_k_store and kv_store (cpu::store is the specification).

// One warp per token: LayerNorm -> RoPE -> Hadamard -> fp8 (+scale) or bf16 -> its slot.
// dtype: 0 = fp8 (8448 B pages), 1 = bf16 (16384 B pages).
extern "C" __global__ void index_k_store(const __nv_bfloat16* __restrict__ keys,
                                         const float* __restrict__ gamma,
                                         const float* __restrict__ beta,
                                         const float* __restrict__ rope,
                                         const int* __restrict__ slots, int n, int dtype,
                                         int ue8m0, u8* __restrict__ dst) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n) return;
    float v[4];
    tkv_load_bf16x4(keys + (size_t)warp * 128 + 4 * lane, v);
    // LayerNorm, in cpu::numerics::layer_norm's order.
    float mean = tkv_warp_sum(((v[0] + v[1]) + v[2]) + v[3]) * (1.0f / 128.0f);
    float d[4];
#pragma unroll
    for (int j = 0; j < 4; j++) d[j] = v[j] - mean;
    float var = tkv_warp_sum(((d[0] * d[0] + d[1] * d[1]) + d[2] * d[2]) + d[3] * d[3]) *
                (1.0f / 128.0f);
    float rstd = 1.0f / sqrtf(var + 1e-6f);
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = ((d[j] * rstd) * gamma[4 * lane + j]) + beta[4 * lane + j];
    tkv_rope(v, rope + (size_t)warp * 64, lane);
    tkv_hadamard(v, lane);
    int slot = slots[warp];
    int page = slot / TKV_PAGE_TOKENS, t = slot % TKV_PAGE_TOKENS;
    if (dtype == 0) {
        float amax = fabsf(v[0]);
#pragma unroll
        for (int j = 1; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
        amax = tkv_warp_max(amax);
        float scale = tkv_fp8_scale(amax, ue8m0 != 0);
        u8* pg = dst + (size_t)page * TKV_IK_FP8_PAGE_BYTES;
        *reinterpret_cast<u32*>(pg + t * TKV_IK_FP8_ROW_BYTES + 4 * lane) = tkv_quant4(v, scale);
        if (lane == 0) *reinterpret_cast<float*>(pg + TKV_IK_FP8_SCALES + 4 * t) = scale;
    } else {
        __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]);
        __nv_bfloat162 b = __floats2bfloat162_rn(v[2], v[3]);
        uint2 raw;
        raw.x = *reinterpret_cast<u32*>(&a);
        raw.y = *reinterpret_cast<u32*>(&b);
        u8* pg = dst + (size_t)page * TKV_IK_BF16_PAGE_BYTES;
        *reinterpret_cast<uint2*>(pg + t * TKV_IK_BF16_ROW_BYTES + 4 * lane * 2) = raw;
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
