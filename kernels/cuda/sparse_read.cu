// sparse_read (cpu::sparse_read is the specification): one block per row, one warp per selected
// rank at a time. Wrapping 64-bit adds only, so the reduction order does not change the digest.
// dtype: 0 = bf16 rows (1152 B), 1 = packed fp8 rows (656 B).
extern "C" __global__ void sparse_read(const int* __restrict__ slots, int k, int dtype,
                                       const u8* __restrict__ kv, u64* __restrict__ out) {
    __shared__ u64 acc;
    if (threadIdx.x == 0) acc = 0;
    __syncthreads();
    int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    int tb = dtype == 0 ? TKV_KV_BF16_ROW_BYTES : TKV_KV_FP8_ROW_BYTES;
    int words = tb / 8;
    u64 local = 0;
    for (int i = warp; i < k; i += nwarps) {
        int s = slots[(size_t)row * k + i];
        if (s < 0) continue;
        const u64* r = reinterpret_cast<const u64*>(kv + (size_t)s * tb);
        u64 h = 0;
        for (int j = lane; j < words; j += 32)
            h += tkv_mix64(r[j] ^ ((u64)(j + 1) * 0x9E3779B97F4A7C15ull));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) h += __shfl_xor_sync(TKV_FULL, h, off);
        if (lane == 0) local += tkv_mix64(h ^ ((u64)(i + 1) * 0xC2B2AE3D27D4EB4Full));
    }
    if (lane == 0) atomicAdd(&acc, local);
    __syncthreads();
    if (threadIdx.x == 0) out[row] = acc;
}
