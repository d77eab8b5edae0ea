// topk (cpu::topk is the specification): each row's k best positions, best first (key descending,
// position ascending), as slots through the row's page table; -1 past the context. A guarded launch
// (launch/guarded.rs: lengths on the device, unchecked by the host) passes its status record, and
// a row whose length is outside 0..=len_max is then taken as empty and reported; other launches
// pass a null status (the host checked the lengths, or guard_rows did on the device). Every
// thread reads its row's length itself: the lengths must not be written while the kernel runs.
//
// A cluster of C CTAs (C = 1, 2, 4 or 8: one kernel per size, topk_c1 .. topk_c8, the launcher
// picks) owns a row. CTA r owns the positions [r * chunk, (r + 1) * chunk) and, when they fit its
// dynamic shared memory (`cap` keys), keeps their order-preserving keys there, so the row is read
// from global memory once; otherwise (rows longer than the cluster can hold) each pass reads it
// again. The steps:
// 1. A floor under the k-th key T: the keys of g consecutive threads form a group, and with at
//    least k nonempty groups the least group maximum is at most T (k distinct keys are at least
//    it); else the least key. Only keys from the floor up are candidates (about a fifth of a
//    row of random logits with k = 2048 of 64K), and they share the maximum's bits above the
//    highest bit where floor and maximum differ: the radix select starts below those bits.
// 2. Radix select, 11 bits a pass: each CTA counts its candidates into a shared histogram; after
//    a cluster barrier every CTA sums the cluster's histograms through distributed shared memory
//    (double-buffered, so one barrier a pass) and finds the same bin, the one where the count
//    from the top reaches the number still needed. It stops when that bin holds exactly the
//    number still needed, or when every bit is fixed (the class is then the keys equal to T).
// 2'. The first pass places each candidate by value instead (when the top and the floor are
//     finite and differ): bin = (x - floor) * (TOPK_BINS / (top - floor)), rounded down, each
//     operation one IEEE operation, so a larger x never lands in a lower bin. Logits spread over an
//     octave boundary (say 0.3 to 15) leave 11-bit digits of the bits only 8 bins an octave, and
//     the bins near the threshold too full for 3a; bins by value stay small there. When a bin
//     from the threshold up still holds more than TOPK_BUCKET_MAX keys: if a few keys far above
//     the rest squeezed it into the lowest bins (an outlier), a second pass bins by value up to
//     the largest of the rest, its top bin taking those few (2''); otherwise (heavy ties) the
//     radix select of 2 runs from its start, and the pass by value was spent (4 to 8 us of a
//     64K row, GPU.md runs 54-55).
// The selection is ordered by one u64 per position, key high and ~position low: descending
// order is the specification's. Then one of two ways:
// 3a. Buckets (after a pass by value or the first radix pass, when no bin from the threshold bin
//     up holds more than TOPK_BUCKET_MAX keys: random logits): every key from the threshold bin
//     up goes to CTA 0's buffer, at its bin's first index (bins are laid out from the top by
//     their counts), plus the keys of its bin in the CTAs before its own (known from the
//     histograms), plus its CTA's keys of the bin placed before it (a local shared-memory
//     atomic); CTA 0 puts each key at its bin's first index plus the number of keys of its bin
//     above it, dropping those past k (the threshold bin's lowest). No further pass, no count, no
//     sort.
// 3b. Otherwise (heavy ties, one value everywhere): the passes go on until the class is
//     resolved; each CTA counts, warp by warp in position order (ballots), its keys above the
//     class and in it; the counts go round the cluster; each CTA writes its selected pairs into
//     CTA 0's buffer, taking the class in position order up to the number needed; CTA 0 sorts
//     them by a bitonic network (registers and shuffles for strides up to 32, shared memory
//     above) and writes the slots.
#define TOPK_THREADS TKV_TOPK_THREADS
#define TOPK_WARPS (TOPK_THREADS / 32)
#define TOPK_MAX TKV_TOPK_MAX
#define TOPK_DIGIT TKV_TOPK_DIGIT
#define TOPK_BINS (1 << TOPK_DIGIT)
#define TOPK_BUCKET_MAX TKV_TOPK_BUCKET_MAX
#define TOPK_FEW 16  // 2'': keys far above the rest that a second pass by value sets aside
#define TOPK_SQUEEZED 8  // 2'': a threshold (and the rest's top) within the lowest 8 bins of 2048

__device__ __forceinline__ u32 tkv_order_key(float x) {
    u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float whose order-preserving key is `key` (tkv_order_key's inverse).
__device__ __forceinline__ float tkv_key_float(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// The first pass's bins by value (2'): keys from the floor up, placed by (x - cf) * scale.
// Every step is monotone (IEEE subtraction and multiplication round monotonically, conversion
// truncates), so a key in a higher bin is a larger key.
struct TopkLinear {
    float cf, scale;
    // Usable when the floor and the range are finite and the range is wide enough to scale (a
    // NaN or an infinity among the candidates makes the top or the floor infinite or NaN).
    static __device__ __forceinline__ TopkLinear of(u32 top, u32 cut, bool* usable) {
        const float cf = tkv_key_float(cut), range = __fsub_rn(tkv_key_float(top), cf);
        const TopkLinear lin{cf, __fdiv_rn((float)TOPK_BINS, range)};
        *usable = isfinite(cf) && isfinite(range) && range > 0.0f && isfinite(lin.scale);
        return lin;
    }
    // The clamp: the top itself maps to TOPK_BINS, or just below or above it after rounding.
    __device__ __forceinline__ u32 bin(u32 key) const {
        const float d = __fsub_rn(tkv_key_float(key), cf);
        return min(__float2uint_rz(__fmul_rn(d, scale)), (u32)(TOPK_BINS - 1));
    }
};

// The key's bits from bit s up (s = 32: none).
__device__ __forceinline__ u32 topk_high(u32 key, int s) { return s >= 32 ? 0u : key >> s; }

// The cluster of C CTAs: its rank, barrier and distributed shared memory (C = 1: the CTA alone).
template <int C>
struct TopkCluster {
    static __device__ __forceinline__ u32 rank() {
        if constexpr (C == 1) {
            return 0;
        } else {
            u32 r;
            asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
            return r;
        }
    }
    // Every thread of every CTA arrives; what each wrote before is visible to all after.
    static __device__ __forceinline__ void sync() {
        if constexpr (C == 1) {
            __syncthreads();
        } else {
            asm volatile(
                "barrier.cluster.arrive.release.aligned;\n\t"
                "barrier.cluster.wait.acquire.aligned;" ::: "memory");
        }
    }
    // The shared-memory address of `p` (this CTA's variable) in CTA r.
    static __device__ __forceinline__ u32 map(const void* p, u32 r) {
        u32 a = (u32)__cvta_generic_to_shared(p);
        if constexpr (C == 1) {
            return a;
        } else {
            u32 m;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(r));
            return m;
        }
    }
    static __device__ __forceinline__ u32 ld(u32 addr) {
        u32 v;
        if constexpr (C == 1) {
            asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
        } else {
            asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
        }
        return v;
    }
    static __device__ __forceinline__ void st64(u32 addr, u64 v) {
        if constexpr (C == 1) {
            asm volatile("st.shared.u64 [%0], %1;" ::"r"(addr), "l"(v) : "memory");
        } else {
            asm volatile("st.shared::cluster.u64 [%0], %1;" ::"r"(addr), "l"(v) : "memory");
        }
    }
};

// The bin of the cluster's summed histogram `h` (nbins bins) where the count from the top reaches
// kk: res = {bin, keys in the bins above it, keys in it, most keys in one bin from it up, the bin
// where the count reaches TOPK_FEW + 1 (when one does)}. Two bins per thread, from the top. With
// `bstart` (a pass that may lay out the buckets: by value, or the first radix pass), for every
// bin, the first index of this CTA's keys in it, counted from the top (the bin's own first index
// in CTA 0, whose keys come first), goes to bstart and the cluster's count of keys in it to
// bcount.
template <int C>
__device__ __forceinline__ void topk_find(const u32* h, u32 nbins, u32 kk, u32* warp_tot,
                                          u32* res, u32* bstart, u32* bcount) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 i0 = 2 * tid, i1 = 2 * tid + 1;
    u32 v0[C], v1[C];
#pragma unroll
    for (int r = 0; r < C; r++) {
        v0[r] = i0 < nbins ? TopkCluster<C>::ld(TopkCluster<C>::map(h + (nbins - 1 - i0), r)) : 0u;
        v1[r] = i1 < nbins ? TopkCluster<C>::ld(TopkCluster<C>::map(h + (nbins - 1 - i1), r)) : 0u;
    }
    u32 c0 = 0, c1 = 0;
#pragma unroll
    for (int r = 0; r < C; r++) {
        c0 += v0[r];
        c1 += v1[r];
    }
    const u32 mine = c0 + c1;
    u32 incl = mine;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        u32 o = __shfl_up_sync(TKV_FULL, incl, off);
        if (lane >= off) incl += o;
    }
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    const u32 before = __reduce_add_sync(TKV_FULL, lane < warp ? warp_tot[lane] : 0u) + incl - mine;
    if (bstart != nullptr) {
        const u32 rank = TopkCluster<C>::rank();
        u32 p0 = 0, p1 = 0;  // the CTAs before this one: their keys in each bin
#pragma unroll
        for (int r = 0; r < C; r++) {
            if ((u32)r < rank) {
                p0 += v0[r];
                p1 += v1[r];
            }
        }
        if (i0 < nbins) {
            bstart[nbins - 1 - i0] = before + p0;
            bcount[nbins - 1 - i0] = c0;
        }
        if (i1 < nbins) {
            bstart[nbins - 1 - i1] = before + c0 + p1;
            bcount[nbins - 1 - i1] = c1;
        }
    }
    // Bins from the found one up are those whose keys before them number fewer than kk.
    u32 big = max(before < kk ? c0 : 0u, before + c0 < kk ? c1 : 0u);
    big = __reduce_max_sync(TKV_FULL, big);
    constexpr u32 few = TOPK_FEW + 1;
    if (before < few && before + mine >= few)
        res[4] = before + c0 >= few ? nbins - 1 - i0 : nbins - 1 - i1;
    if (before < kk && before + mine >= kk) {
        if (before + c0 >= kk) {
            res[0] = nbins - 1 - i0;
            res[1] = before;
            res[2] = c0;
        } else {
            res[0] = nbins - 1 - i1;
            res[1] = before + c0;
            res[2] = c1;
        }
    }
    __syncthreads();  // every warp has read warp_tot
    if (lane == 0) warp_tot[warp] = big;
    __syncthreads();
    if (warp == 0) {
        const u32 b = __reduce_max_sync(TKV_FULL, warp_tot[lane]);
        if (lane == 0) res[3] = b;
    }
    __syncthreads();
}

// 2'. The first pass by value over this CTA's `my` keys (`key_at`) into the histogram `h`:
// whether it resolved the selection into buckets (3a), every bin from the threshold bin up
// holding at most TOPK_BUCKET_MAX keys; topk_find's results are in `res` either way.
template <int C, typename KeyAt>
__device__ __forceinline__ bool topk_value_pass(const TopkLinear& lin, u32 cut, int my,
                                                KeyAt key_at, u32* h, u32 kk, u32* w_a,
                                                u32* res, u32* bstart, u32* bcount) {
    const int tid = threadIdx.x;
    for (u32 b = tid; b < TOPK_BINS; b += TOPK_THREADS) h[b] = 0;
    __syncthreads();
    for (int i = tid; i < my; i += TOPK_THREADS) {
        const u32 key = key_at(i);
        if (key >= cut) atomicAdd(&h[lin.bin(key)], 1u);
    }
    TopkCluster<C>::sync();
    topk_find<C>(h, TOPK_BINS, kk, w_a, res, bstart, bcount);
    return res[3] <= TOPK_BUCKET_MAX;
}

// The largest `v` of the cluster's threads (`w`: a word per warp; `slot`: this CTA's word, which
// the other CTAs read after the cluster barrier here; nothing may write it again before another).
template <int C>
__device__ __forceinline__ u32 topk_cluster_max(u32 v, u32* w, u32* slot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = __reduce_max_sync(TKV_FULL, v);
    if (lane == 0) w[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const u32 b = __reduce_max_sync(TKV_FULL, w[lane]);
        if (lane == 0) *slot = b;
    }
    TopkCluster<C>::sync();
    u32 x[C];
#pragma unroll
    for (int r = 0; r < C; r++) x[r] = TopkCluster<C>::ld(TopkCluster<C>::map(slot, r));
    u32 m = 0;
#pragma unroll
    for (int r = 0; r < C; r++) m = max(m, x[r]);
    return m;
}

// 2''. After a first pass by value with too full a bin: when its threshold bin res[0] and the bin
// res[4] where the count from the top reaches TOPK_FEW + 1 (there is one: a bin from the
// threshold up holds more than TOPK_BUCKET_MAX) are both among the lowest TOPK_SQUEEZED, the
// rest is squeezed under at most TOPK_FEW keys far above it (an outlier): bin again by value up
// to the largest of the rest, whose top bin takes those few (its clamp) with room for the rest's
// own top (run 60: setting aside up to TOPK_BUCKET_MAX, that bin overflowed). Whether it resolved
// the selection into buckets; `lin` and `buf` follow the pass when it ran. Anything else (ties;
// sinks a few tens of times the rest, whose threshold sits higher) is left to the radix passes:
// run 62 timed this step at 4 us on such rows, more than the radix pass it would replace.
template <int C, typename KeyAt>
__device__ __forceinline__ bool topk_second_value_pass(TopkLinear& lin, u32 cut, int my,
                                                       KeyAt key_at, u32 (*hist)[TOPK_BINS],
                                                       int& buf, u32 kk, u32* w_a, u32* res,
                                                       u32* bstart, u32* bcount, u32* slot) {
    const u32 u = res[4];
    if (res[0] >= TOPK_SQUEEZED || u >= TOPK_SQUEEZED) return false;
    u32 m = 0;
    for (int i = threadIdx.x; i < my; i += TOPK_THREADS) {
        const u32 key = key_at(i);
        if (key >= cut && lin.bin(key) <= u) m = max(m, key);
    }
    const u32 rest = topk_cluster_max<C>(m, w_a, slot);
    bool usable;
    const TopkLinear lin2 = TopkLinear::of(rest, cut, &usable);
    if (!usable) return false;
    const bool by_value =
        topk_value_pass<C>(lin2, cut, my, key_at, hist[buf], kk, w_a, res, bstart, bcount);
    buf ^= 1;
    lin = lin2;
    return by_value;
}

template <int C>
__device__ __forceinline__ void topk_row(const float* __restrict__ logits, int stride,
                                         const int* __restrict__ ctx_lens,
                                         const int* __restrict__ page_table, int pt_stride, int k,
                                         int* __restrict__ out, int cap, int len_max, u64* status,
                                         u64* claim) {
    typedef TopkCluster<C> Cl;
    extern __shared__ __align__(16) u32 t_keys[];
    __shared__ u32 hist[2][TOPK_BINS];
    __shared__ __align__(16) u64 sel[TOPK_MAX + TOPK_BUCKET_MAX];
    __shared__ u32 w_a[TOPK_WARPS], w_b[TOPK_WARPS], w_c[TOPK_WARPS];
    __shared__ u32 bound[3];   // this CTA's largest key, least group maximum, least key
    __shared__ u32 counts[2];  // this CTA's keys above the class, and in it
    __shared__ u32 res[5];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const u32 rank = Cl::rank();
    const int row = blockIdx.x / C;
    // A guarded launch (status not null: its lengths are on the device and unchecked) takes a
    // row whose length is outside 0..=len_max as empty, and reports it (guard_rows' rule).
    int len = ctx_lens[row];
    if (status != nullptr && (len < 0 || len > len_max)) {
        if (rank == 0 && tid == 0)
            guard_report(status, claim, TKV_GUARD_CONTEXT_LEN, row, len, (u64)len_max);
        len = 0;
    }
    const float* lr = logits + (size_t)row * stride;
    const int chunk = (len + C - 1) / C;
    const int lo = min((int)rank * chunk, len);
    const int my = min(lo + chunk, len) - lo;
    const bool staged = chunk <= cap;
    const bool take_all = len <= k;  // every position is selected (uniform over the cluster)
    auto key_at = [&](int i) -> u32 { return staged ? t_keys[i] : tkv_order_key(lr[lo + i]); };
    // After the staged keys, for each bin of the pass that lays out the buckets: the first index
    // of this CTA's keys in it in the ordered selection, this CTA's keys gathered into it so far,
    // and the cluster's count of keys in it.
    u32* bstart = t_keys + cap;
    u32* bfill = bstart + TOPK_BINS;
    u32* bcount = bfill + TOPK_BINS;
    for (int b = tid; b < TOPK_BINS; b += TOPK_THREADS) bfill[b] = 0;  // before the first barrier

    // 1. Keys into shared memory, and a floor under T: groups of g consecutive threads (g the
    // largest power of two up to 32 that still makes k nonempty groups over the cluster).
    int held[C];
#pragma unroll
    for (int r = 0; r < C; r++) held[r] = min(max(len - r * chunk, 0), min(chunk, TOPK_THREADS));
    int g = 0;
    for (int lg = 5; lg >= 0 && g == 0; lg--) {
        int groups = 0;
#pragma unroll
        for (int r = 0; r < C; r++) groups += (held[r] + (1 << lg) - 1) >> lg;
        if (groups >= k) g = 1 << lg;
    }
    u32 tmax = 0, kmin = 0xFFFFFFFFu;
    // Unrolled so that a thread's loads are in flight together (16 per thread: one 64K row over
    // four CTAs).
#pragma unroll 16
    for (int i = tid; i < my; i += TOPK_THREADS) {
        const u32 key = tkv_order_key(lr[lo + i]);
        if (staged) t_keys[i] = key;
        tmax = max(tmax, key);
        kmin = min(kmin, key);
    }
    {
        u32 gmax = tmax;  // keys are never below 0, so empty threads change no maximum
        for (int off = 1; off < g; off <<= 1) gmax = max(gmax, __shfl_xor_sync(TKV_FULL, gmax, off));
        const bool counted = g > 0 && (tid & ~(g - 1)) < my;  // the group holds a position
        const u32 a = __reduce_max_sync(TKV_FULL, tmax);
        const u32 b = __reduce_min_sync(TKV_FULL, counted ? gmax : 0xFFFFFFFFu);
        const u32 c = __reduce_min_sync(TKV_FULL, kmin);
        if (lane == 0) {
            w_a[warp] = a;
            w_b[warp] = b;
            w_c[warp] = c;
        }
        __syncthreads();
        if (warp == 0) {
            const u32 ra = __reduce_max_sync(TKV_FULL, w_a[lane]);
            const u32 rb = __reduce_min_sync(TKV_FULL, w_b[lane]);
            const u32 rc = __reduce_min_sync(TKV_FULL, w_c[lane]);
            if (lane == 0) {
                bound[0] = ra;
                bound[1] = rb;
                bound[2] = rc;
            }
        }
    }
    Cl::sync();
    u32 top = 0, gfloor = 0xFFFFFFFFu, kfloor = 0xFFFFFFFFu;
    {
        u32 b[3][C];
#pragma unroll
        for (int r = 0; r < C; r++)
#pragma unroll
            for (int j = 0; j < 3; j++) b[j][r] = Cl::ld(Cl::map(&bound[j], r));
#pragma unroll
        for (int r = 0; r < C; r++) {
            top = max(top, b[0][r]);
            gfloor = min(gfloor, b[1][r]);
            kfloor = min(kfloor, b[2][r]);
        }
    }
    // Keys below the floor are never selected: every pass and the gather skip them.
    const u32 cut = g > 0 ? gfloor : kfloor;

    // 2. Radix select: after it, the selection is every key whose bits from s up exceed pre,
    // and the first kk positions (in position order) of the class of keys whose bits equal pre.
    int s = 32 - __clz(top ^ cut);
    u32 pre = topk_high(top, s);
    u32 kk = take_all ? 0u : (u32)k;
    int buf = 0;
    bool buckets = false;  // 3a: set after the first pass
    u32 gathered = 0;      // 3a: keys from the threshold bin up
    u32 mask = 0;          // 3a: the first pass's digit, bits [s, s + 11) at most
    bool first = true;
    // 2'. The first pass by value, when the range allows it.
    bool usable;
    TopkLinear lin = TopkLinear::of(top, cut, &usable);
    bool by_value = false;  // 3a's bins are lin's
    u32 vthr = 0;           // 3a by value: the threshold bin
    if (!take_all && usable) {
        by_value = topk_value_pass<C>(lin, cut, my, key_at, hist[buf], kk, w_a, res, bstart,
                                      bcount);
        buf ^= 1;
        // bound[0]'s last remote reads were before the first pass's cluster barrier.
        if (!by_value)
            by_value = topk_second_value_pass<C>(lin, cut, my, key_at, hist, buf, kk, w_a, res,
                                                 bstart, bcount, &bound[0]);
        if (by_value) {
            buckets = true;
            vthr = res[0];
            gathered = res[1] + res[2];
        }
    }
    while (!take_all && !buckets && s > 0) {
        const int nb = min(TOPK_DIGIT, s), s2 = s - nb;
        const u32 nbins = 1u << nb, bmask = nbins - 1;
        u32* h = hist[buf];
        // Every CTA finished reading this buffer (two passes ago) before the last barrier.
        for (u32 b = tid; b < nbins; b += TOPK_THREADS) h[b] = 0;
        __syncthreads();
        for (int i = tid; i < my; i += TOPK_THREADS) {
            const u32 key = key_at(i);
            if (key >= cut && topk_high(key, s) == pre) atomicAdd(&h[(key >> s2) & bmask], 1u);
        }
        Cl::sync();
        topk_find<C>(h, nbins, kk, w_a, res, first ? bstart : nullptr, bcount);
        const u32 bin = res[0], above = res[1], cnt = res[2];
        kk -= above;
        pre = (pre << nb) | bin;
        s = s2;
        buf ^= 1;
        if (first && res[3] <= TOPK_BUCKET_MAX) {
            buckets = true;
            gathered = above + cnt;
            mask = bmask;
            break;
        }
        first = false;
        if (cnt == kk) break;
    }
    const u32 dst0 = Cl::map(sel, 0);
    const int* pt = page_table + (size_t)row * pt_stride;
    int* o = out + (size_t)row * k;
    auto slot_of = [&](u64 e) {
        const u32 p = 0xFFFFFFFFu - (u32)e;
        return pt[p / TKV_PAGE_TOKENS] * TKV_PAGE_TOKENS + (int)(p % TKV_PAGE_TOKENS);
    };
    if (buckets) {
        // 3a. Every key from the threshold bin up (by value, or bits from s up at least pre) to
        // its bin.
        auto bucket = [&](u32 key) -> u32 { return by_value ? lin.bin(key) : (key >> s) & mask; };
        for (int i = tid; i < my; i += TOPK_THREADS) {
            const u32 key = key_at(i);
            if (key >= cut && (by_value ? lin.bin(key) >= vthr : topk_high(key, s) >= pre)) {
                const u32 b = bucket(key);
                const u32 at = bstart[b] + atomicAdd(&bfill[b], 1u);
                Cl::st64(dst0 + 8u * at, ((u64)key << 32) | (u64)(0xFFFFFFFFu - (u32)(lo + i)));
            }
        }
        Cl::sync();
        if (rank != 0) return;
        for (u32 i = tid; i < gathered; i += TOPK_THREADS) {
            const u64 e = sel[i];
            const u32 b = bucket((u32)(e >> 32));
            const u32 b0 = bstart[b], b1 = b0 + bcount[b];
            u32 at = b0;
            for (u32 j = b0; j < b1; j++) at += sel[j] > e;
            if (at < (u32)k) o[at] = slot_of(e);
        }
        return;
    }

    // 3b. Gather into CTA 0's buffer. Warp w scans positions [w * span, (w + 1) * span) of this
    // CTA's part, so ballots count in position order.
    const int span = ((my + TOPK_THREADS - 1) / TOPK_THREADS) * 32;
    const int wlo = min(warp * span, my), whi = min(wlo + span, my);
    u32 na = 0, ne = 0;
    for (int base = wlo; base < whi; base += 32) {
        const int i = base + lane;
        const bool v = i < whi;
        const u32 key = v ? key_at(i) : 0u;
        const u32 hk = topk_high(key, s);
        na += __popc(__ballot_sync(TKV_FULL, v && (take_all || hk > pre)));
        ne += __popc(__ballot_sync(TKV_FULL, v && !take_all && hk == pre && key >= cut));
    }
    if (lane == 0) {
        w_a[warp] = na;
        w_b[warp] = ne;
    }
    __syncthreads();
    const u32 wa_before = __reduce_add_sync(TKV_FULL, lane < warp ? w_a[lane] : 0u);
    const u32 wb_before = __reduce_add_sync(TKV_FULL, lane < warp ? w_b[lane] : 0u);
    if (warp == 0) {
        const u32 ta = __reduce_add_sync(TKV_FULL, w_a[lane]);
        const u32 tb = __reduce_add_sync(TKV_FULL, w_b[lane]);
        if (lane == 0) {
            counts[0] = ta;
            counts[1] = tb;
        }
    }
    Cl::sync();
    u32 a_before = 0, a_total = 0, e_before = 0;
    u32 cas[C], ces[C];
#pragma unroll
    for (int r = 0; r < C; r++) {
        cas[r] = Cl::ld(Cl::map(&counts[0], r));
        ces[r] = Cl::ld(Cl::map(&counts[1], r));
    }
#pragma unroll
    for (int r = 0; r < C; r++) {
        const u32 ca = cas[r], ce = ces[r];
        a_total += ca;
        if ((u32)r < rank) {
            a_before += ca;
            e_before += ce;
        }
    }
    const u32 lt = (1u << lane) - 1u;
    u32 ra = a_before + wa_before, re = e_before + wb_before;
    // The warp stops once it has written its keys above the class and its share of the class.
    const u32 a_end = ra + na, e_end = min(re + ne, kk);
    for (int base = wlo; base < whi && (ra < a_end || re < e_end); base += 32) {
        const int i = base + lane;
        const bool v = i < whi;
        const u32 key = v ? key_at(i) : 0u;
        const u32 hk = topk_high(key, s);
        const bool ab = v && (take_all || hk > pre);
        const bool eq = v && !take_all && hk == pre && key >= cut;
        const u32 ba = __ballot_sync(TKV_FULL, ab), be = __ballot_sync(TKV_FULL, eq);
        const u64 pair = ((u64)key << 32) | (u64)(0xFFFFFFFFu - (u32)(lo + i));
        if (ab) Cl::st64(dst0 + 8u * (ra + __popc(ba & lt)), pair);
        if (eq) {
            const u32 r = re + __popc(be & lt);
            if (r < kk) Cl::st64(dst0 + 8u * (a_total + r), pair);
        }
        ra += __popc(ba);
        re += __popc(be);
    }
    Cl::sync();
    if (rank != 0) return;

    // 4b. Sort (descending) and write. Warp w holds elements 64w + lane and 64w + 32 + lane.
    const int nsel = take_all ? len : k;
    int n2 = 64;
    while (n2 < nsel) n2 <<= 1;
    for (int i = nsel + tid; i < n2; i += TOPK_THREADS) sel[i] = 0;  // sorts last
    __syncthreads();
    const bool act = warp < (n2 >> 6);
    const int i0 = 64 * warp + lane, i1 = i0 + 32;
    u64 e0 = act ? sel[i0] : 0, e1 = act ? sel[i1] : 0;
    for (int size = 2; size <= n2; size <<= 1) {
        if (size >= 128) {
            // Strides of 64 and more cross warps: through shared memory. Each thread writes and
            // reads back only its own two elements, so those need no barrier of their own.
            if (act) {
                sel[i0] = e0;
                sel[i1] = e1;
            }
            __syncthreads();
            for (int st = size >> 1; st >= 64; st >>= 1) {
                if (tid < (n2 >> 1)) {
                    const int i = ((tid & ~(st - 1)) << 1) | (tid & (st - 1)), j = i + st;
                    const u64 x = sel[i], y = sel[j];
                    if (((i & size) == 0) ? x < y : x > y) {
                        sel[i] = y;
                        sel[j] = x;
                    }
                }
                __syncthreads();
            }
            if (act) {
                e0 = sel[i0];
                e1 = sel[i1];
            }
        }
        for (int st = min(size >> 1, 32); st > 0; st >>= 1) {
            if (st == 32) {
                const bool desc = (i0 & size) == 0;
                const u64 mx = max(e0, e1), mn = min(e0, e1);
                e0 = desc ? mx : mn;
                e1 = desc ? mn : mx;
            } else {
                // The lower index of a pair keeps the larger in a descending block.
                const u64 p0 = __shfl_xor_sync(TKV_FULL, e0, st);
                const u64 p1 = __shfl_xor_sync(TKV_FULL, e1, st);
                const bool up = (lane & st) != 0;
                e0 = (((i0 & size) == 0) != up) ? max(e0, p0) : min(e0, p0);
                e1 = (((i1 & size) == 0) != up) ? max(e1, p1) : min(e1, p1);
            }
        }
    }
    if (act) {
        const u64 e[2] = {e0, e1};
        const int idx[2] = {i0, i1};
#pragma unroll
        for (int j = 0; j < 2; j++) {
            if (idx[j] >= k) continue;
            o[idx[j]] = idx[j] < nsel ? slot_of(e[j]) : -1;
        }
    }
    for (int i = n2 + tid; i < k; i += TOPK_THREADS) o[i] = -1;
}

#define TOPK_KERNEL(name, C)                                                                  \
    extern "C" __global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(TOPK_THREADS, 1)  \
        name(const float* __restrict__ logits, int stride, const int* __restrict__ ctx_lens,  \
             const int* __restrict__ page_table, int pt_stride, int k, int* __restrict__ out, \
             int cap, int len_max, u64* status, u64* claim) {                                 \
        topk_row<C>(logits, stride, ctx_lens, page_table, pt_stride, k, out, cap, len_max,   \
                    status, claim);                                                           \
    }
TOPK_KERNEL(topk_c1, 1)
TOPK_KERNEL(topk_c2, 2)
TOPK_KERNEL(topk_c4, 4)
TOPK_KERNEL(topk_c8, 8)
