// topk (cpu::topk is the specification): one block of TOPK_THREADS per row.
// Radix select over the order-preserving key image finds the k-th key T; the block then takes every
// position with key > T and, in position order, the first positions with key == T until it has k;
// a bitonic sort in shared memory orders them (key descending, position ascending), and the page
// table turns positions into slots. -1 pads rows shorter than k.
#define TOPK_THREADS 1024
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
    __shared__ u32 hist[256];
    __shared__ u32 sel_key[TOPK_MAX];
    __shared__ int sel_pos[TOPK_MAX];
    __shared__ u32 warp_tot[32];
    __shared__ u32 s_bin, s_above, s_count, s_eq_base;
    int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int nwarps = blockDim.x >> 5;
    const float* lr = logits + (size_t)row * stride;
    int len = ctx_lens[row];

    u32 thresh = 0;  // with len <= k every key (all > 0) is above the threshold
    int need_eq = 0;
    if (len > k) {
        u32 prefix = 0, mask = 0;
        int kk = k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int i = tid; i < len; i += blockDim.x) {
                u32 key = tkv_order_key(lr[i]);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 cum = 0;
                for (int b = 255; b >= 0; b--) {
                    if (cum + hist[b] >= (u32)kk) {
                        s_bin = (u32)b;
                        s_above = cum;
                        break;
                    }
                    cum += hist[b];
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

    if (tid == 0) {
        s_count = 0;
        s_eq_base = 0;
    }
    __syncthreads();
    for (int base = 0; base < len; base += blockDim.x) {
        int i = base + tid;
        u32 key = i < len ? tkv_order_key(lr[i]) : 0u;
        bool gt = i < len && key > thresh;
        bool eq = i < len && key == thresh;
        u32 ball = __ballot_sync(TKV_FULL, eq);
        if (lane == 0) warp_tot[warp] = __popc(ball);
        __syncthreads();
        int before = 0;
        for (int w = 0; w < warp; w++) before += warp_tot[w];
        int eq_rank = (int)s_eq_base + before + __popc(ball & ((1u << lane) - 1u));
        if (gt || (eq && eq_rank < need_eq)) {
            u32 at = atomicAdd(&s_count, 1u);
            sel_key[at] = key;
            sel_pos[at] = i;
        }
        __syncthreads();
        if (tid == 0) {
            u32 tot = 0;
            for (int w = 0; w < nwarps; w++) tot += warp_tot[w];
            s_eq_base += tot;
        }
        __syncthreads();
    }
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
