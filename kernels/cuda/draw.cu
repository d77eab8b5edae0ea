// The synthetic model's inputs, drawn on the device (cpu::draw is the specification). A model
// computes its keys, queries and KV rows on the device from a token; tierkv's stand-in draws
// them from a counter-based hash of (seed, token, position, global layer), so the host sends
// only each row's token and position. Every operation is one IEEE f32 operation in the CPU
// reference's order (the sources compile with --fmad=false); bf16 rounds to nearest even.
// The stream codes (TKV_DRAW_*) are defined by the prelude, from cpu::draw::Stream.

__device__ __forceinline__ u64 tkv_draw_stream(u64 seed, u64 what, u64 a, u64 b, u64 c) {
    return tkv_mix64(tkv_mix64(tkv_mix64(tkv_mix64(seed ^ what) ^ a) ^ (b * 0x9E3779B9ull)) ^ c);
}

// Element i of a stream: uniform in [-1, 1), a multiple of 2^-23.
__device__ __forceinline__ float tkv_draw_unit(u64 base, u64 i) {
    u64 v = tkv_mix64(base + i * 0xD1B54A32D192ED03ull);
    return (float)(v >> 40) / 8388608.0f - 1.0f;
}

// rows[r] = (token, position). One block per row, one thread per dimension (128).
extern "C" __global__ void draw_index_keys(u64 seed, unsigned layer, const uint2* __restrict__ rows,
                                           __nv_bfloat16* __restrict__ out) {
    uint2 t = rows[blockIdx.x];
    u64 d = threadIdx.x;
    u64 shared = tkv_draw_stream(seed, TKV_DRAW_KEY_SHARED, t.x, 0, layer);
    u64 own = tkv_draw_stream(seed, TKV_DRAW_KEY, t.x, t.y, layer);
    float v = 2.0f * tkv_draw_unit(shared, d) + 0.7f * tkv_draw_unit(own, d);
    out[(size_t)blockIdx.x * 128 + d] = __float2bfloat16_rn(v);
}

// Block (row, head), one thread per dimension: out[row][head][128].
extern "C" __global__ void draw_queries(u64 seed, unsigned layer, const uint2* __restrict__ rows,
                                        __nv_bfloat16* __restrict__ out) {
    uint2 t = rows[blockIdx.x];
    u64 h = blockIdx.y, d = threadIdx.x;
    u64 shared = tkv_draw_stream(seed, TKV_DRAW_KEY_SHARED, t.x, 0, layer);
    u64 own = tkv_draw_stream(seed, TKV_DRAW_QUERY, t.x, (u64)t.y ^ (h << 32), layer);
    float v = 1.5f * tkv_draw_unit(shared, d) + tkv_draw_unit(own, d);
    out[((size_t)blockIdx.x * gridDim.y + h) * 128 + d] = __float2bfloat16_rn(v);
}

// One block per row, one thread per head: out[row][heads].
extern "C" __global__ void draw_head_weights(u64 seed, unsigned layer,
                                             const uint2* __restrict__ rows,
                                             float* __restrict__ out) {
    uint2 t = rows[blockIdx.x];
    u64 s = tkv_draw_stream(seed, TKV_DRAW_WEIGHT, t.x, t.y, layer);
    out[(size_t)blockIdx.x * blockDim.x + threadIdx.x] =
        0.5f + 0.25f * (tkv_draw_unit(s, threadIdx.x) + 1.0f);
}

// One block per row: out[row][TKV_KV_ROW_VALUES].
extern "C" __global__ void draw_kv_rows(u64 seed, unsigned layer, const uint2* __restrict__ rows,
                                        __nv_bfloat16* __restrict__ out) {
    uint2 t = rows[blockIdx.x];
    u64 s = tkv_draw_stream(seed, TKV_DRAW_KV, t.x, t.y, layer);
    for (unsigned i = threadIdx.x; i < TKV_KV_ROW_VALUES; i += blockDim.x)
        out[(size_t)blockIdx.x * TKV_KV_ROW_VALUES + i] =
            __float2bfloat16_rn(3.0f * tkv_draw_unit(s, i));
}

// An engine running one step ahead draws rows whose token the previous step generates on the
// device: their token is TKV_PENDING_TOKEN | index into `tokens` (cpu::draw::resolve_pending).
// Rewrites the uploaded rows in place; the host checked every index against `tokens_len`.
extern "C" __global__ void draw_resolve_pending(uint2* __restrict__ rows, unsigned n,
                                                const unsigned* __restrict__ tokens,
                                                unsigned tokens_len) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned t = rows[i].x;
    if (t & TKV_PENDING_TOKEN) {
        unsigned at = t & ~TKV_PENDING_TOKEN;
        if (at >= tokens_len) __trap();
        rows[i].x = tokens[at];
    }
}

// The next token of each of a step's first `rows` query rows (cpu::draw::next_tokens): a fold
// of mix64 over the row's digests of every layer, laid out [layers][rows_max].
extern "C" __global__ void next_tokens(u64 seed, const u64* __restrict__ digests,
                                       unsigned layers, unsigned rows_max, unsigned rows,
                                       unsigned* __restrict__ out) {
    unsigned r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    u64 h = seed ^ (u64)TKV_NEXT_TOKEN_SALT;
    for (unsigned l = 0; l < layers; l++) h = tkv_mix64(h ^ digests[(size_t)l * rows_max + r]);
    out[r] = (unsigned)(h % (u64)TKV_VOCAB);
}
