// q_prep (cpu::q_prep is the specification): one warp per (token, head).
extern "C" __global__ void q_prep(const __nv_bfloat16* __restrict__ q,
                                  const float* __restrict__ w, const float* __restrict__ rope,
                                  int n, int heads, u8* __restrict__ q_out,
                                  float* __restrict__ w_out) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n * heads) return;
    int t = warp / heads;
    float v[4];
    tkv_load_bf16x4(q + (size_t)warp * 128 + 4 * lane, v);
    tkv_rope(v, rope + (size_t)t * 64, lane);
    tkv_hadamard(v, lane);
    float amax = fabsf(v[0]);
#pragma unroll
    for (int j = 1; j < 4; j++) amax = fmaxf(amax, fabsf(v[j]));
    amax = tkv_warp_max(amax);
    float scale = tkv_fp8_scale(amax, false);
    *reinterpret_cast<u32*>(q_out + (size_t)warp * 128 + 4 * lane) = tkv_quant4(v, scale);
    if (lane == 0) w_out[warp] = w[warp] * scale;
}
