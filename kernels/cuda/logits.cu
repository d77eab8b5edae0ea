// index_logits (cpu::logits is the specification, operation for operation).
// grid (ceil(out_stride / 128), rows), 128 threads, dynamic shared = heads*129*4 bytes.
// One thread scores one position n of one row: it decodes its key into registers once, then runs
// the head loop against the row's queries held as f32 in shared memory (broadcast reads).
// dtype: 0 = fp8 pages (8448 B, scale at 8192 + 4t), 1 = bf16 pages (16384 B).
extern "C" __global__ void __launch_bounds__(128) index_logits(
    const u8* __restrict__ q, const float* __restrict__ w, const int* __restrict__ page_table,
    int pt_stride, const int* __restrict__ ctx_lens, int heads, int dtype,
    const u8* __restrict__ kbuf, float* __restrict__ out, int out_stride) {
    extern __shared__ float tkv_sm[];
    float* qs = tkv_sm;
    float* ws = tkv_sm + heads * 128;
    int row = blockIdx.y;
    const u8* qr = q + (size_t)row * heads * 128;
    for (int i = threadIdx.x; i < heads * 128; i += blockDim.x) qs[i] = tkv_e4m3_to_f32(qr[i]);
    for (int i = threadIdx.x; i < heads; i += blockDim.x) ws[i] = w[row * heads + i];
    __syncthreads();
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= out_stride) return;
    float* o = out + (size_t)row * out_stride + n;
    if (n >= ctx_lens[row]) {
        *o = __int_as_float(0xff800000);  // -inf
        return;
    }
    int page = page_table[(size_t)row * pt_stride + n / TKV_PAGE_TOKENS];
    int t = n % TKV_PAGE_TOKENS;
    float k[128];
    float kscale = 1.0f;
    if (dtype == 0) {
        const u8* pg = kbuf + (size_t)page * TKV_IK_FP8_PAGE_BYTES;
        const uint4* src = reinterpret_cast<const uint4*>(pg + t * TKV_IK_FP8_ROW_BYTES);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            uint4 r = src[j];
            u32 wds[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int c = 0; c < 4; c++)
#pragma unroll
                for (int b = 0; b < 4; b++)
                    k[16 * j + 4 * c + b] = tkv_e4m3_to_f32((u8)(wds[c] >> (8 * b)));
        }
        kscale = *reinterpret_cast<const float*>(pg + TKV_IK_FP8_SCALES + 4 * t);
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(kbuf + (size_t)page * TKV_IK_BF16_PAGE_BYTES + t * TKV_IK_BF16_ROW_BYTES);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            uint4 r = src[j];
            u32 wds[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int c = 0; c < 4; c++) {
                k[8 * j + 2 * c] = __uint_as_float(wds[c] << 16);
                k[8 * j + 2 * c + 1] = __uint_as_float(wds[c] & 0xFFFF0000u);
            }
        }
    }
    // Four heads at a time: four independent FMA chains per thread (each head's chain still runs
    // d = 0..127 in order, and the head sum still adds h = 0, 1, 2, ... in order), so the FMA
    // latency is hidden by the other chains instead of stalling the thread.
    float s = 0.0f;
    int h = 0;
    for (; h + 4 <= heads; h += 4) {
        const float4* q0 = reinterpret_cast<const float4*>(qs + (h + 0) * 128);
        const float4* q1 = reinterpret_cast<const float4*>(qs + (h + 1) * 128);
        const float4* q2 = reinterpret_cast<const float4*>(qs + (h + 2) * 128);
        const float4* q3 = reinterpret_cast<const float4*>(qs + (h + 3) * 128);
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma unroll
        for (int d4 = 0; d4 < 32; d4++) {
            float4 a = q0[d4], b = q1[d4], c = q2[d4], e = q3[d4];
            float k0 = k[4 * d4], k1 = k[4 * d4 + 1], k2 = k[4 * d4 + 2], k3 = k[4 * d4 + 3];
            d0 = fmaf(a.x, k0, d0); d1 = fmaf(b.x, k0, d1); d2 = fmaf(c.x, k0, d2); d3 = fmaf(e.x, k0, d3);
            d0 = fmaf(a.y, k1, d0); d1 = fmaf(b.y, k1, d1); d2 = fmaf(c.y, k1, d2); d3 = fmaf(e.y, k1, d3);
            d0 = fmaf(a.z, k2, d0); d1 = fmaf(b.z, k2, d1); d2 = fmaf(c.z, k2, d2); d3 = fmaf(e.z, k2, d3);
            d0 = fmaf(a.w, k3, d0); d1 = fmaf(b.w, k3, d1); d2 = fmaf(c.w, k3, d2); d3 = fmaf(e.w, k3, d3);
        }
        s = fmaf(ws[h + 0], d0 > 0.0f ? d0 : 0.0f, s);
        s = fmaf(ws[h + 1], d1 > 0.0f ? d1 : 0.0f, s);
        s = fmaf(ws[h + 2], d2 > 0.0f ? d2 : 0.0f, s);
        s = fmaf(ws[h + 3], d3 > 0.0f ? d3 : 0.0f, s);
    }
    for (; h < heads; h++) {
        const float4* qh = reinterpret_cast<const float4*>(qs + h * 128);
        float dot = 0.0f;
#pragma unroll
        for (int d4 = 0; d4 < 32; d4++) {
            float4 qq = qh[d4];
            dot = fmaf(qq.x, k[4 * d4], dot);
            dot = fmaf(qq.y, k[4 * d4 + 1], dot);
            dot = fmaf(qq.z, k[4 * d4 + 2], dot);
            dot = fmaf(qq.w, k[4 * d4 + 3], dot);
        }
        s = fmaf(ws[h], dot > 0.0f ? dot : 0.0f, s);
    }
    *o = dtype == 0 ? s * kscale : s;
}
