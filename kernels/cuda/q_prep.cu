// q_prep (cpu::q_prep is the specification): one warp per (token, head). ue8m0 rounds each head's
// scale up to a power of two; head_scale is heads^-1/2 rounded once on the host
// (cpu::q_prep::head_weight_scale), and the folded weight is ((w * head_scale) * scale) * 128^-1/2,
// three products in DeepSeek's order (cpu::q_prep::folded_weight).
extern "C" __global__ void q_prep(const __nv_bfloat16* __restrict__ q,
                                  const float* __restrict__ w, const float* __restrict__ rope,
                                  int n, int heads, int ue8m0, float head_scale,
                                  u8* __restrict__ q_out, float* __restrict__ w_out) {
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
    float scale = tkv_fp8_scale(amax, ue8m0 != 0);
    *reinterpret_cast<u32*>(q_out + (size_t)warp * 128 + 4 * lane) = tkv_quant4(v, scale);
    if (lane == 0) w_out[warp] = ((w[warp] * head_scale) * scale) * tkv_inv_sqrt_128();
}
