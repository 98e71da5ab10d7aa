// How an expert CTA of the MegaMoE decode (moe_decode_mma.cu) stages its tokens into shared memory as f16 MMA
// columns (row stride Kc + 4) with their power-of-two up-scales: from moe_stage_x's x16 (stage_rows), from FC1's
// folded act (stage_act, FOLD_ACT) or straight from the raw tokens (stage_direct). Macros from the including file:
// WARPS, ACT_BF16 (also moe_tokens.cuh's), FOLD_ACT, QUEUE. No system headers.
#pragma once

#include "ptx_common.cuh"
#include "moe_tokens.cuh"

// Every piece (r, p) of a rows x per grid, the CTA's threads blockDim apart, four a thread at a time: load(r, p) of
// all four is issued before any store(r, p, value), so four loads are in flight (the piece index is advanced
// incrementally: no division a piece).
template <class V, class Load, class Store>
__device__ __forceinline__ void for_pieces(int rows, int per, Load load, Store store) {
  const int total = rows * per, step = blockDim.x;
  int r = threadIdx.x / per, p = threadIdx.x - r * per;
  for (int i0 = threadIdx.x; i0 < total; i0 += 4 * step) {
    V v[4];
    int rr[4], pp[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      rr[u] = -1;
      if (i0 + u * step < total) {
        v[u] = load(r, p);
        rr[u] = r;
        pp[u] = p;
      }
      for (p += step; p >= per; p -= per) ++r;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (rr[u] >= 0) store(rr[u], pp[u], v[u]);
  }
}

// Copy rows src[rowof[c]][k0 : k0 + Kc] (f16, row stride ld) for the columns c < cnt into xs (row stride Kc + 4) and
// their up-scales into mult[c], in 16-byte pieces.
__device__ void stage_rows(const u16* src, const float* src_mult, const int* rowof, int cnt, long ld, int k0, int Kc,
                           u16* xs, float* mult) {
  for_pieces<uint4>(
      cnt, Kc / 8, [&](int c, int v) { return *(const uint4*)(src + rowof[c] * ld + k0 + 8 * v); },
      [&](int c, int v, uint4 d) {
        uint2* o = (uint2*)(xs + c * (Kc + 4) + 8 * v);
        o[0] = make_uint2(d.x, d.y);
        o[1] = make_uint2(d.z, d.w);
      });
  for (int i = threadIdx.x; i < cnt; i += blockDim.x) mult[i] = src_mult[rowof[i]];
  __syncthreads();
}

#if FOLD_ACT
#if QUEUE  // act written in the same launch (by other SMs): read through L2
#define ACT_LOAD4 load_act4_cg
#else
#define ACT_LOAD4 load_act4
#endif
// FC2's staging from FC1's folded act (bf16 / float32 values [pair, ld]), bitwise moe_act's act16 / amult staged by
// stage_rows: xs[c, :Kc] = f16(act[rowof[c], k0 : k0 + Kc] 2^-e(c)), mult[c] = 2^e(c) for the columns c < cnt, e
// from the largest magnitude of the whole row of K values (so the shared expert's K splits agree on it; NaN ignored,
// as block_max's fmaxf). `amax`: MAXT words of shared scratch.
__device__ void stage_act(const void* act, const int* rowof, int cnt, long ld, int K, int k0, int Kc, u16* xs,
                          float* mult, u32* amax) {
  for (int i = threadIdx.x; i < cnt; i += blockDim.x) amax[i] = 0u;
  __syncthreads();
  for_pieces<float4>(
      cnt, K / 4, [&](int c, int q) { return ACT_LOAD4(act, rowof[c] * ld + 4 * q); },
      [&](int c, int, float4 v) { atomicMax(amax + c, __float_as_uint(amax4(0.f, v))); });  // (floats >= 0)
  __syncthreads();
  for (int i = threadIdx.x; i < cnt; i += blockDim.x) {
    float down, up;
    pow2_scale(__uint_as_float(amax[i]), down, up);
    amax[i] = __float_as_uint(down);
    mult[i] = up;
  }
  __syncthreads();
  for_pieces<float4>(
      cnt, Kc / 4, [&](int c, int q) { return ACT_LOAD4(act, rowof[c] * ld + k0 + 4 * q); },
      [&](int c, int q, float4 v) {
        const float dn = __uint_as_float(amax[c]);
        *(uint2*)(xs + c * (Kc + 4) + 4 * q) = make_uint2(f32x2_to_f16x2(v.x * dn, v.y * dn),
                                                          f32x2_to_f16x2(v.z * dn, v.w * dn));
      });
  __syncthreads();
}
#endif

// Stage the tokens straight from x (FC1's shared-expert items, before grid_wait(); bitwise what moe_stage_x and
// moe_route_stage write: the max is exact, the scaling by 2^-e too): xs[c, :Kc] = f16(x[n0 + c, k0 : k0 + Kc]
// 2^-e), mult[c] = 2^e for the tokens c < cnt of a column group from token n0 (H % 128 == 0). `down` holds cnt
// floats of scratch.
__device__ void stage_direct(const void* x, int n0, int cnt, int H, int k0, int Kc, u16* xs, float* mult,
                             float* down) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  x = (const u8*)x + (long)n0 * H * (ACT_BF16 ? 2 : 4);
  for (int n = warp; n < cnt; n += WARPS) {  // a warp per token: its largest magnitude over all of H
    float m = 0.f;
#pragma unroll 4
    for (int k = 4 * lane; k < H; k += 128) {
      m = amax4(m, load_act4(x, (long)n * H + k));
    }
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) {
      float dn, up;
      pow2_scale(m, dn, up);
      down[n] = dn;
      mult[n] = up;
    }
  }
  __syncthreads();
  for_pieces<float4>(
      cnt, Kc / 4, [&](int n, int q) { return load_act4(x, (long)n * H + k0 + 4 * q); },
      [&](int n, int q, float4 v) {
        const float dn = down[n];
        *(uint2*)(xs + n * (Kc + 4) + 4 * q) = make_uint2(f32x2_to_f16x2(v.x * dn, v.y * dn),
                                                          f32x2_to_f16x2(v.z * dn, v.w * dn));
      });
  __syncthreads();
}
