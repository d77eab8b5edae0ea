// topk (cpu::topk is the specification): one block of TOPK_THREADS per row.
// Radix select over the order-preserving key image finds the k-th key T in four 8-bit passes;
// each warp counts into its own histogram (no contention between warps), and the 32 histograms
// are summed per bin. The block then takes every position with key > T and, in position order,
// the first positions with key == T until it has k; a bitonic sort in shared memory orders them
// (key descending, position ascending), and the page table turns positions into slots. -1 pads
// rows shorter than k. The selection buffers reuse the histograms' shared memory.
#define TOPK_THREADS 1024
#define TOPK_WARPS (TOPK_THREADS / 32)
#define TOPK_MAX 2048

__device__ __forceinline__ u32 tkv_order_key(float x) {
    u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ bool tkv_before(u32 ka, int pa, u32 kb, int pb) {
    return ka > kb || (ka == kb && pa < pb);
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk(
    const float* __restrict__ logits, int stride, const int* __restrict__ ctx_lens,
    const int* __restrict__ page_table, int pt_stride, int k, int* __restrict__ out) {
    // 32 warp histograms of 256 bins (32 KB); after the select, the selection (16 KB) lives here.
    __shared__ u32 smem[TOPK_WARPS * 256];
    __shared__ u32 total[256];
    __shared__ u32 warp_tot[TOPK_WARPS];
    __shared__ u32 s_bin, s_above, s_count;
    u32* hist = smem;
    u32* sel_key = smem;
    int* sel_pos = reinterpret_cast<int*>(smem + TOPK_MAX);
    int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* lr = logits + (size_t)row * stride;
    int len = ctx_lens[row];

    u32 thresh = 0;  // with len <= k every key (all > 0) is above the threshold
    int need_eq = 0;
    if (len > k) {
        u32 prefix = 0, mask = 0;
        int kk = k;
        u32* my = hist + warp * 256;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < TOPK_WARPS * 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int i = tid; i < len; i += blockDim.x) {
                u32 key = tkv_order_key(lr[i]);
                if ((key & mask) == prefix) atomicAdd(&my[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            for (int b = tid; b < 256; b += blockDim.x) {
                u32 s = 0;
#pragma unroll 8
                for (int w = 0; w < TOPK_WARPS; w++) s += hist[w * 256 + b];
                total[b] = s;
            }
            __syncthreads();
            if (warp == 0) {
                // Bins from the top, 8 per lane: find the bin where the running count reaches kk.
                u32 c[8];
                u32 mine = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    c[j] = total[255 - (lane * 8 + j)];
                    mine += c[j];
                }
                u32 incl = mine;
#pragma unroll
                for (int off = 1; off < 32; off <<= 1) {
                    u32 o = __shfl_up_sync(TKV_FULL, incl, off);
                    if (lane >= off) incl += o;
                }
                u32 before = incl - mine;
                bool here = before < (u32)kk && incl >= (u32)kk;
                if (here) {
                    u32 cum = before;
                    for (int j = 0; j < 8; j++) {
                        if (cum + c[j] >= (u32)kk) {
                            s_bin = 255u - (u32)(lane * 8 + j);
                            s_above = cum;
                            break;
                        }
                        cum += c[j];
                    }
                }
            }
            __syncthreads();
            prefix |= s_bin << shift;
            mask |= 255u << shift;
            kk -= (int)s_above;
            __syncthreads();
        }
        thresh = prefix;
        need_eq = kk;
    }

    if (tid == 0) s_count = 0;
    __syncthreads();
    // Every key above the threshold, in any order (the sort orders them). Each warp walks its own
    // contiguous chunk of positions, counting the keys equal to the threshold as it goes.
    int chunk = (len + TOPK_WARPS - 1) / TOPK_WARPS;
    int lo = min(warp * chunk, len), hi = min(lo + chunk, len);
    u32 eq_count = 0;
    for (int base = lo; base < hi; base += 32) {
        int i = base + lane;
        u32 key = i < hi ? tkv_order_key(lr[i]) : 0u;
        if (i < hi && key > thresh) {
            u32 at = atomicAdd(&s_count, 1u);
            sel_key[at] = key;
            sel_pos[at] = i;
        }
        eq_count += __popc(__ballot_sync(TKV_FULL, i < hi && key == thresh));
    }
    if (lane == 0) warp_tot[warp] = eq_count;
    __syncthreads();
    // Keys equal to the threshold are taken in position order, up to need_eq: a warp's first
    // rank is the count of equal keys in the chunks before it.
    u32 rank = 0;
    for (int w = 0; w < warp; w++) rank += warp_tot[w];
    for (int base = lo; base < hi && rank < (u32)need_eq; base += 32) {
        int i = base + lane;
        u32 key = i < hi ? tkv_order_key(lr[i]) : 0u;
        bool eq = i < hi && key == thresh;
        u32 ball = __ballot_sync(TKV_FULL, eq);
        u32 r = rank + __popc(ball & ((1u << lane) - 1u));
        if (eq && r < (u32)need_eq) {
            u32 at = atomicAdd(&s_count, 1u);
            sel_key[at] = key;
            sel_pos[at] = i;
        }
        rank += __popc(ball);
    }
    __syncthreads();
    int count = (int)s_count;
    int n2 = 1;
    while (n2 < count) n2 <<= 1;
    for (int i = count + tid; i < n2; i += blockDim.x) {
        sel_key[i] = 0u;
        sel_pos[i] = 0x7fffffff;
    }
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1) {
        for (int st = size >> 1; st > 0; st >>= 1) {
            for (int i = tid; i < n2; i += blockDim.x) {
                int j = i ^ st;
                if (j > i) {
                    bool first = (i & size) == 0;
                    bool swap = first ? tkv_before(sel_key[j], sel_pos[j], sel_key[i], sel_pos[i])
                                      : tkv_before(sel_key[i], sel_pos[i], sel_key[j], sel_pos[j]);
                    if (swap) {
                        u32 tk = sel_key[i]; sel_key[i] = sel_key[j]; sel_key[j] = tk;
                        int tp = sel_pos[i]; sel_pos[i] = sel_pos[j]; sel_pos[j] = tp;
                    }
                }
            }
            __syncthreads();
        }
    }
    const int* pt = page_table + (size_t)row * pt_stride;
    for (int i = tid; i < k; i += blockDim.x) {
        int v = -1;
        if (i < count) {
            int p = sel_pos[i];
            v = pt[p / TKV_PAGE_TOKENS] * TKV_PAGE_TOKENS + p % TKV_PAGE_TOKENS;
        }
        out[(size_t)row * k + i] = v;
    }
}
