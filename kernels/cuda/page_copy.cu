// page_gather: the kernel strategy of page_copy (cpu::page_copy is the specification). One block
// per (src page, dst page) pair copies a whole page row in 16-byte vectors. Either side may be
// device memory or mapped pinned host memory (its device pointer), which is what lets one kernel
// gather scattered host pages in a single launch instead of one cuMemcpyAsync per run. A pair
// whose source page is negative is skipped (guard_pairs writes (-1, -1) for a refused pair).
extern "C" __global__ void page_gather(const u8* __restrict__ src, u64 src_base, u64 src_stride,
                                       u8* __restrict__ dst, u64 dst_base, u64 dst_stride,
                                       const int* __restrict__ pairs, int n, u64 page_bytes) {
    int p = blockIdx.x;
    if (p >= n || pairs[2 * p] < 0) return;
    const uint4* s = reinterpret_cast<const uint4*>(src + src_base + (u64)pairs[2 * p] * src_stride);
    uint4* d = reinterpret_cast<uint4*>(dst + dst_base + (u64)pairs[2 * p + 1] * dst_stride);
    u64 vecs = page_bytes / 16;
    for (u64 i = threadIdx.x; i < vecs; i += blockDim.x) d[i] = s[i];
}
