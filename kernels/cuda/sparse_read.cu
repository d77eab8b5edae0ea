// sparse_read (cpu::sparse_read is the specification): blockIdx.x is the row, blockIdx.y one of
// gridDim.y shares of its k ranks; within a block one warp per rank at a time. Wrapping 64-bit
// adds only, so neither the reduction order nor the split changes the digest: each block adds
// its share into out[row], which the launcher zeroes first.
// dtype: 0 = bf16 rows (1152 B), 1 = packed fp8 rows (656 B).
extern "C" __global__ void sparse_read(const int* __restrict__ slots, int k, int dtype,
                                       const u8* __restrict__ kv, u64* __restrict__ out) {
    __shared__ u64 acc;
    if (threadIdx.x == 0) acc = 0;
    __syncthreads();
    int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int nwarps = blockDim.x >> 5;
    int share = (k + gridDim.y - 1) / gridDim.y;
    int first = blockIdx.y * share, last = min(k, first + share);
    int tb = dtype == 0 ? TKV_KV_BF16_ROW_BYTES : TKV_KV_FP8_ROW_BYTES;
    int words = tb / 8;
    u64 local = 0;
    for (int i = first + warp; i < last; i += nwarps) {
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
    if (threadIdx.x == 0) atomicAdd(&out[row], acc);
}
