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

// copy_list: n copies of any sizes between device and mapped pinned host memory, one CTA per
// copy (a grid-stride loop over them). desc[3i] is copy i's destination address, desc[3i + 1] its
// source, desc[3i + 2] its bytes; every address and size is a multiple of 16 (the launcher
// checks, and falls back to the copy engines otherwise). The copies may run in any order: the
// launcher sends only copies whose destinations overlap nothing else of the list. Four 16-byte
// loads are in flight per thread, so a CTA keeps 16 KB of reads moving over PCIe.
extern "C" __global__ void copy_list(const u64* __restrict__ desc, int n) {
    for (u64 c = blockIdx.x; c < (u64)n; c += gridDim.x) {
        uint4* d = reinterpret_cast<uint4*>(desc[3 * c]);
        const uint4* s = reinterpret_cast<const uint4*>(desc[3 * c + 1]);
        const u64 vecs = desc[3 * c + 2] / 16;
        u64 i = threadIdx.x;
        for (; i + 3 * blockDim.x < vecs; i += 4 * blockDim.x) {
            uint4 a = s[i], b = s[i + blockDim.x], e = s[i + 2 * blockDim.x], f = s[i + 3 * blockDim.x];
            d[i] = a;
            d[i + blockDim.x] = b;
            d[i + 2 * blockDim.x] = e;
            d[i + 3 * blockDim.x] = f;
        }
        for (; i < vecs; i += blockDim.x) d[i] = s[i];
    }
}
