// Token loads, row maxima and f16 staging scales shared by the MoE decode kernels (moe_decode_mma.cu,
// moe_route.cu): ACT_BF16 (set by the including file) says whether the tokens are bf16 (else float32).
#pragma once

#include "ptx_common.cuh"

__device__ __forceinline__ float load_act(const void* x, long i) {
#if ACT_BF16
  return __uint_as_float(((u32)((const u16*)x)[i]) << 16);
#else
  return ((const float*)x)[i];
#endif
}

// load_act4 through L2 (ld.global.cg: values another SM wrote in the same launch).
__device__ __forceinline__ float4 load_act4_cg(const void* x, long i) {
#if ACT_BF16
  const uint2 v = __ldcg((const uint2*)((const u16*)x + i));
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xFFFF0000u));
#else
  return __ldcg((const float4*)((const float*)x + i));
#endif
}

// Four consecutive token values x[i .. i + 3] (i % 4 == 0) as floats.
__device__ __forceinline__ float4 load_act4(const void* x, long i) {
#if ACT_BF16
  uint2 v = *(const uint2*)((const u16*)x + i);
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xFFFF0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xFFFF0000u));
#else
  return *(const float4*)((const float*)x + i);
#endif
}

// max(m, |v.x|, |v.y|, |v.z|, |v.w|): a step of a row's largest magnitude (exact in any order; NaN ignored).
__device__ __forceinline__ float amax4(float m, float4 v) {
  return fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
}

// Down-scale 2^-e and up-scale 2^e (as floats) for a row whose largest magnitude is amax: amax * 2^-e lands in
// [2^14, 2^15), inside f16's normal range (0 / inf / NaN rows: e = 0).
__device__ __forceinline__ void pow2_scale(float amax, float& down, float& up) {
  u32 bits = __float_as_uint(amax);
  int e = (amax > 0.f && amax < 3.0e38f) ? (int)((bits >> 23) & 0xFF) - 127 - 14 : 0;
  e = max(-126, min(126, e));  // both 2^e and 2^-e stay normal floats
  up = __uint_as_float((u32)(127 + e) << 23);
  down = __uint_as_float((u32)(127 - e) << 23);
}
