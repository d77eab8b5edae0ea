// The device half of the guarded launches' argument checks (launch/guarded.rs). A caller that
// keeps its index arrays on the GPU (a torch op: slots, page tables, context lengths, page
// numbers) cannot have them walked on the host without synchronising its stream. So a guard
// kernel runs first on the launch's stream, writes a copy of the array in which every entry the
// work kernel must not follow is replaced by one it skips (a slot or page pair of -1, a row
// length of 0), and records the first entry it replaced in a status record of mapped pinned
// host memory, which the host reads without synchronising. The work kernel reads the copy.

// status (mapped pinned host memory)[0]: what was refused (0 = nothing; TKV_GUARD_*, generated
// from the Rust enum `GuardRefusal`), [1] the entry's index, [2] its value, [3] the limit it
// broke. claim (device memory, where atomics are always atomic; atomics on mapped host memory
// need the platform's PCIe atomics): 0 until the first reporter takes it and writes the record;
// the host clears it on its stream after reading a record. guard_report (common.cuh) writes it.

// Slots: -1 (a padding token) passes; any other entry outside 0..slots_max becomes -1.
extern "C" __global__ void guard_slots(const int* __restrict__ slots, int n, u32 slots_max,
                                       int* __restrict__ out, u64* status, u64* claim) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int s = slots[i];
    const bool ok = s == -1 || (u32)s < slots_max;
    out[i] = ok ? s : -1;
    if (!ok) guard_report(status, claim, TKV_GUARD_SLOT, i, s, slots_max);
}

// One block per row: a row whose length is outside 0..=len_max, or one of whose first
// ceil(len / 64) page-table entries is outside 0..pages, gets length 0 (the work kernels read
// no page of it and write their empty-row result). pages = 0xffffffff checks only for -1.
extern "C" __global__ void guard_rows(const int* __restrict__ page_table, int pt_stride,
                                      const int* __restrict__ lens, int rows, int len_max,
                                      u32 pages, int* __restrict__ lens_out, u64* status, u64* claim) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const int len = lens[row];
    const bool len_ok = len >= 0 && len <= len_max;
    const int used = len_ok ? (len + TKV_PAGE_TOKENS - 1) / TKV_PAGE_TOKENS : 0;
    const int* pt = page_table + (size_t)row * pt_stride;
    int bad = 0;
    for (int j = threadIdx.x; j < used; j += blockDim.x) {
        const int p = pt[j];
        if ((u32)p >= pages) {
            bad = 1;
            guard_report(status, claim, TKV_GUARD_PAGE, row, p, pages);
        }
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        if (!len_ok) guard_report(status, claim, TKV_GUARD_CONTEXT_LEN, row, len, (u64)len_max);
        lens_out[row] = len_ok && !bad ? len : 0;
    }
}

// Page pairs for page_gather: pair i is (src[i], dst[i]) when both lie in their pools, else
// (-1, -1), which page_gather skips.
extern "C" __global__ void guard_pairs(const int* __restrict__ src, const int* __restrict__ dst,
                                       int n, u32 src_pages, u32 dst_pages,
                                       int* __restrict__ pairs, u64* status, u64* claim) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int s = src[i], d = dst[i];
    const bool s_ok = (u32)s < src_pages, d_ok = (u32)d < dst_pages;
    pairs[2 * i] = s_ok && d_ok ? s : -1;
    pairs[2 * i + 1] = s_ok && d_ok ? d : -1;
    if (!s_ok) guard_report(status, claim, TKV_GUARD_SRC_PAGE, i, s, src_pages);
    else if (!d_ok) guard_report(status, claim, TKV_GUARD_DST_PAGE, i, d, dst_pages);
}

// out[i] = i for i < n: the identity page table of a top-k over positions (the row's page i is
// page i, so a selected slot is the position itself).
extern "C" __global__ void guard_iota(int* __restrict__ out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = i;
}
