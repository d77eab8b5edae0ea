// Shared by every tierkv kernel; the launcher prepends this file to each .cu source before NVRTC
// compiles it (the GPU machine runs staged binaries without the source tree, so nothing is
// #included from disk). Compiled with --fmad=false --prec-div=true --prec-sqrt=true --ftz=false:
// every fused multiply-add is written explicitly (fmaf) and matched by mul_add in the CPU
// reference; every other operation is one IEEE operation, in the CPU reference's order.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define TKV_PAGE_TOKENS 64
#define TKV_FULL 0xffffffffu

// 1/sqrt(128), the nearest float (bits 0x3DB504F3), as in cpu::numerics::INV_SQRT_128.
__device__ __forceinline__ float tkv_inv_sqrt_128() { return __int_as_float(0x3DB504F3); }

// Xor butterfly over the warp, offsets 16, 8, 4, 2, 1 (cpu::numerics::warp_sum).
__device__ __forceinline__ float tkv_warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = v + __shfl_xor_sync(TKV_FULL, v, off);
    return v;
}
__device__ __forceinline__ float tkv_warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(TKV_FULL, v, off));
    return v;
}

// Lane l holds values 4l..4l+3 of a 128-vector.
__device__ __forceinline__ void tkv_load_bf16x4(const __nv_bfloat16* p, float v[4]) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&raw.x);
    __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&raw.y);
    v[0] = __low2float(a); v[1] = __high2float(a);
    v[2] = __low2float(b); v[3] = __high2float(b);
}

// NeoX RoPE on dims 0..64: pair (i, i+32); lanes 0..7 hold i, lanes 8..15 hold i+32.
// cs is the token's row: 32 cosines then 32 sines.
__device__ __forceinline__ void tkv_rope(float v[4], const float* cs, int lane) {
    float o[4];
#pragma unroll
    for (int j = 0; j < 4; j++) o[j] = __shfl_xor_sync(TKV_FULL, v[j], 8);
    if (lane < 8) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int i = 4 * lane + j;
            float c = cs[i], s = cs[32 + i];
            v[j] = v[j] * c - o[j] * s;   // a*c - b*s
        }
    } else if (lane < 16) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int i = 4 * (lane - 8) + j;
            float c = cs[i], s = cs[32 + i];
            v[j] = v[j] * c + o[j] * s;   // b*c + a*s
        }
    }
}

// Walsh-Hadamard over the warp's 128 values, stages h = 1..64, then * 1/sqrt(128).
__device__ __forceinline__ void tkv_hadamard(float v[4], int lane) {
    float a, b;
    a = v[0]; b = v[1]; v[0] = a + b; v[1] = a - b;   // h = 1
    a = v[2]; b = v[3]; v[2] = a + b; v[3] = a - b;
    a = v[0]; b = v[2]; v[0] = a + b; v[2] = a - b;   // h = 2
    a = v[1]; b = v[3]; v[1] = a + b; v[3] = a - b;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {                // h = 4m
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float o = __shfl_xor_sync(TKV_FULL, v[j], m);
            v[j] = (lane & m) ? (o - v[j]) : (v[j] + o);
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = v[j] * tkv_inv_sqrt_128();
}

__device__ __forceinline__ float tkv_ue8m0_round_up(float s) {
    u32 b = __float_as_uint(s);
    if ((b & 0x007FFFFFu) == 0) return s;
    return __uint_as_float((b & 0xFF800000u) + 0x00800000u);
}

// max(amax, 1e-4) / 448, optionally rounded up to a power of two.
__device__ __forceinline__ float tkv_fp8_scale(float amax, bool ue8m0) {
    float s = fmaxf(amax, 1e-4f) / 448.0f;
    return ue8m0 ? tkv_ue8m0_round_up(s) : s;
}

__device__ __forceinline__ u8 tkv_e4m3(float x) {
    return (u8)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// Four e4m3 codes of v/scale, packed little-endian.
__device__ __forceinline__ u32 tkv_quant4(const float v[4], float scale) {
    return (u32)tkv_e4m3(v[0] / scale) | ((u32)tkv_e4m3(v[1] / scale) << 8) |
           ((u32)tkv_e4m3(v[2] / scale) << 16) | ((u32)tkv_e4m3(v[3] / scale) << 24);
}

__device__ __forceinline__ float tkv_e4m3_to_f32(u8 c) {
    __nv_fp8_e4m3 f;
    f.__x = c;
    return float(f);
}

__device__ __forceinline__ u64 tkv_mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Two e4m3 codes (the low 16 bits of `two`) as f16x2 or bf16x2, exactly: every e4m3 value is
// an f16 and a bf16 value (the tensor-core logits kernels feed fp8 operands through these).
__device__ __forceinline__ u32 tkv_e4m3x2_to_f16x2(u32 two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xFFFFu), __NV_E4M3);
    return (u32)h.x | ((u32)h.y << 16);
}

__device__ __forceinline__ u32 tkv_e4m3x2_to_bf16x2(u32 two) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xFFFFu), __NV_E4M3);
    __half2 hh = *reinterpret_cast<__half2*>(&h);
    float2 f = __half22float2(hh);  // exact
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);  // exact: e4m3 values are bf16 values
    return *reinterpret_cast<u32*>(&b);
}

// A guarded launch's report of the first entry it refused (guard.cu's header: the status record
// in mapped pinned host memory, and the claim word in device memory that the first reporter
// takes). The guard kernels and top-k's row-length check call it.
static __device__ void guard_report(u64* status, u64* claim, int what, long long index,
                                    long long value, u64 limit) {
    if (atomicCAS(claim, 0ull, 1ull) != 0ull) return;
    status[1] = (u64)index;
    status[2] = (u64)value;
    status[3] = limit;
    __threadfence_system();
    *reinterpret_cast<volatile u64*>(&status[0]) = (u64)what;
}

