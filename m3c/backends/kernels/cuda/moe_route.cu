// MegaMoE decode routing + token staging in ONE launch (1 <= T <= 8 * NT tokens), for sm_90: the float32 router
// GEMV split over many CTAs, the last CTA to arrive merges the partial sums in a fixed order and routes every token
// (sigmoid, + correction bias for the selection, stable top-k, weights), and T extra CTAs stage the tokens for the
// expert kernels of moe_decode_mma.cu (what its moe_stage_x does). Host side and numerics:
// m3c/backends/kernels/moe_cuda.py (route_stage). No system headers (only ptx_common.cuh): builds with a bare nvcc
// (PyPI).
// Compile-time settings: NT (8-token groups: T <= 8 NT; moe_cuda builds 1, 2 and 8), ACT_BF16 (tokens bf16, else
// float32), CH (float4 K chunks per lane: a CTA's K slice is 128 CH), KSPLIT (K slices: H = 128 CH KSPLIT), ESLOTS
// (experts per lane in the routing warps: E <= 32 ESLOTS). Dynamic shared memory: the merged logits, 8 NT x 32 ESLOTS
// floats (64 tokens of 256 experts: 64 KB, more than a static array may take).
//
// Grid: T staging CTAs, then ceil(E / 8) x KSPLIT GEMV CTAs (8 warps, one expert each, K slice ks of 128 CH).
// part[(ks T + t) E + e] = the slice's dot product (one per warp and token, a butterfly sum of its lanes; ks outer,
// so the merge's loads of one ks are contiguous across a warp's outputs);
// the CTA that arrives last at *counter (an acq_rel atomic after a barrier) sums each (t, e) over ks = 0, 1, ... in
// order (one thread per output), so the logits do not depend on arrival order, stores 0 to *counter (CUDA-graph
// replays find it zero), then one warp per token selects the top-k.
#ifndef NT
#define NT 1
#endif
#ifndef ACT_BF16
#define ACT_BF16 1
#endif
#ifndef CH
#define CH 2
#endif
#ifndef KSPLIT
#define KSPLIT 24
#endif
#ifndef ESLOTS
#define ESLOTS 2
#endif
#define MAXT (8 * NT)
#define MAXE (32 * ESLOTS)
#define MAXK 64
#define MQ (KSPLIT < 32 ? KSPLIT : 32)  // merge: partials of one output loaded at once
#define MO (48 / MQ > 1 ? 48 / MQ : 1)  // merge: outputs a thread sums per pass
#define THREADS 256
#define WARPS_R 8

#include "ptx_common.cuh"
#include "moe_tokens.cuh"

__device__ __forceinline__ float4 ld_stream_f4(const float* p) {
  float4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
  return r;
}
// Through L2 (another CTA's stores). __ldcg, not a volatile asm: the compiler may issue a thread's loads at once.
__device__ __forceinline__ float ld_cg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ u32 redux_max(u32 v) {
  u32 r;
  asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ u32 redux_min(u32 v) {
  u32 r;
  asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
  return r;
}
// A float's order as an unsigned key: larger key = larger value; -0 == +0; every NaN above +inf (torch.sort puts
// NaN first in descending order). Keys of non-NaN values are >= 0x007FFFFF (-inf), so 0 means "no candidate".
__device__ __forceinline__ u32 order_key(float v) {
  u32 b = __float_as_uint(v);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;
  if ((b & 0x7FFFFFFFu) == 0u) return 0x80000000u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Stage token n (moe_stage_x of moe_decode_mma.cu, 4 values a thread a step; H % 128 == 0): x16[n, :] =
// f16(x[n, :] 2^-e), xmult[n] = 2^e (bitwise what moe_stage_x writes: the max is exact, the scaling too).
__device__ void stage_token(const void* x, int H, u16* x16, float* xmult, int n, float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long row = (long)n * H;
  float m = 0.f;
#pragma unroll 8
  for (int k = 4 * threadIdx.x; k < H; k += 4 * THREADS) {  // unrolled: the row's loads in flight together
    m = amax4(m, load_act4(x, row + k));
  }
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = 0.f;
  for (int w = 0; w < WARPS_R; ++w) m = fmaxf(m, red[w]);
  float down, up;
  pow2_scale(m, down, up);
  for (int k0 = 4 * threadIdx.x; k0 < H; k0 += 4 * 4 * THREADS) {  // 4 loads, then 4 stores (x16 may alias x
    float4 v[4];                                                   // as far as the compiler knows)
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (k0 + 4 * THREADS * u < H) v[u] = load_act4(x, row + k0 + 4 * THREADS * u);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (k0 + 4 * THREADS * u < H)
        *(uint2*)(x16 + row + k0 + 4 * THREADS * u) =
            make_uint2(f32x2_to_f16x2(v[u].x * down, v[u].y * down), f32x2_to_f16x2(v[u].z * down, v[u].w * down));
  }
  if (threadIdx.x == 0) xmult[n] = up;
}

// Top-k of token t's logits (shared memory) by one warp: lane l holds experts l + 32 i; k rounds of a warp max of
// the corrected scores' keys (redux), ties to the smallest expert index (a second redux). Writes ids / weights.
__device__ void route_token(const float* logit, const float* bias, int E, int topk, float scale, int norm,
                            long long* ids, float* wts, u32* sel_id, float* sel_s, int t) {
  const int lane = threadIdx.x & 31;
  u32 key[ESLOTS];
  float sc[ESLOTS];
#pragma unroll
  for (int i = 0; i < ESLOTS; ++i) {
    const int e = lane + 32 * i;
    key[i] = 0u;
    sc[i] = 0.f;
    if (e < E) {
      sc[i] = 1.0f / (1.0f + expf(-logit[t * E + e]));  // accurate exp, IEEE division: torch.sigmoid's float32
      key[i] = order_key(sc[i] + bias[e]);
    }
  }
  u32 best = 0u, bidx = 0xFFFFFFFFu;
  float bs = 0.f;
#pragma unroll
  for (int i = 0; i < ESLOTS; ++i)  // strictly greater: the first (smallest) index of equal keys wins in a lane
    if (key[i] > best) { best = key[i]; bidx = lane + 32 * i; bs = sc[i]; }
  for (int j = 0; j < topk; ++j) {
    const u32 m = redux_max(best);
    const u32 w = redux_min(best == m ? bidx : 0xFFFFFFFFu);
    if (bidx == w) {  // this lane owns the winner: record it, drop it, find the lane's next best
      sel_id[j] = w;
      sel_s[j] = bs;
      best = 0u;
      bidx = 0xFFFFFFFFu;
#pragma unroll
      for (int i = 0; i < ESLOTS; ++i) {
        if (lane + 32 * i == (int)w) key[i] = 0u;
        if (key[i] > best) { best = key[i]; bidx = lane + 32 * i; bs = sc[i]; }
      }
    }
  }
  __syncwarp();
  float den = 0.f;
  if (norm) {
    for (int j = 0; j < topk; ++j) den += sel_s[j];  // in slot order (the reference sums its own way: ~1 ulp)
    den += 1e-20f;
  }
  for (int j = lane; j < topk; j += 32) {
    const float s = sel_s[j];
    ids[(long)t * topk + j] = (long long)sel_id[j];
    wts[(long)t * topk + j] = (norm ? s / den : s) * scale;
  }
  __syncwarp();
}

extern "C" __global__ void __launch_bounds__(THREADS)
moe_route_stage(const void* x, const float* gate, const float* bias, int T, int H, int E, int topk,
                float scale, int norm, long long* ids, float* wts, float* logits, u16* x16, float* xmult,
                float* part, int* counter, void* scratch0, void* scratch1) {
  extern __shared__ __align__(16) float logit[];  // [MAXT * MAXE]
  __shared__ float red[WARPS_R];
  __shared__ u32 sel_id[WARPS_R][MAXK];
  __shared__ float sel_s[WARPS_R][MAXK];
  __shared__ int is_last;
  grid_wait();               // a no-op unless launched programmatically: x is complete past it
  grid_launch_dependents();  // moe_fc1's shared-expert items run meanwhile (they read x, so after the wait)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if ((int)blockIdx.x < T) {
    stage_token(x, H, x16, xmult, blockIdx.x, red);
    return;
  }
  // ---- GEMV slice: expert e = 8 g + warp, K in [ks 128 CH, (ks + 1) 128 CH)
  const int b = blockIdx.x - T, groups = (E + WARPS_R - 1) / WARPS_R;
  const int ks = b % KSPLIT, e = (b / KSPLIT) * WARPS_R + warp;
  if (e < E) {
    const long k0 = (long)ks * 128 * CH + 4 * lane;
    float4 g[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) g[c] = ld_stream_f4(gate + (long)e * H + k0 + 128 * c);
    // No branches on T: columns past T redo token T - 1 (L1 hits, results unused), so every load is issued up
    // front and the MAXT shuffle chains interleave (a branch per token serialized one L2 round trip per token).
    float acc[MAXT];
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
      const long row = (long)min(t, T - 1) * H;
      acc[t] = 0.f;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const float4 v = load_act4(x, row + k0 + 128 * c);
        acc[t] = fmaf(g[c].x, v.x, acc[t]);
        acc[t] = fmaf(g[c].y, v.y, acc[t]);
        acc[t] = fmaf(g[c].z, v.z, acc[t]);
        acc[t] = fmaf(g[c].w, v.w, acc[t]);
      }
    }
    float mine[(MAXT + 31) / 32];  // lane l keeps tokens l, l + 32
#pragma unroll
    for (int t = 0; t < MAXT; ++t) {
      float v = acc[t];
#pragma unroll
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == t % 32) mine[t / 32] = v;
    }
#pragma unroll
    for (int q = 0; q < (MAXT + 31) / 32; ++q)
      if (lane + 32 * q < T) part[((long)ks * T + lane + 32 * q) * E + e] = mine[q];
  }
  // ---- arrive (ptx_common's last_to_arrive; the merge reads the other CTAs' partials with ld.cg): the last CTA
  // merges and routes
  if (!last_to_arrive(counter, groups * KSPLIT, &is_last)) return;
  // Merge: one thread per (t, e) output sums its KSPLIT partials in ks order, MO outputs a thread a pass, MQ partials
  // of each loaded at once (unconditional loads from clamped addresses: no predicate per load, all in flight); a
  // warp's loads of one ks are 128 contiguous bytes (with t E + e outer, each load took 32 sectors: T = 16 18 us).
  const int n = T * E;
  for (int base = 0; base < n; base += THREADS * MO) {
    if (base + (int)(threadIdx.x & ~31u) >= n) break;  // this warp's outputs are all past n (warp-uniform)
    float s[MO];
#pragma unroll
    for (int i = 0; i < MO; ++i) s[i] = 0.f;
#pragma unroll
    for (int q0 = 0; q0 < KSPLIT; q0 += MQ) {
      float v[MO][MQ];
#pragma unroll
      for (int i = 0; i < MO; ++i) {
        const float* src = part + min(base + i * THREADS + (int)threadIdx.x, n - 1);  // + ks n: ks's partial
        const bool live = i == 0 || base + i * THREADS + (int)(threadIdx.x & ~31u) < n;  // warp-uniform
#pragma unroll
        for (int q = 0; q < MQ; ++q) v[i][q] = live && q0 + q < KSPLIT ? ld_cg(src + (long)(q0 + q) * n) : 0.f;
      }
#pragma unroll
      for (int i = 0; i < MO; ++i)
#pragma unroll
        for (int q = 0; q < MQ; ++q)
          if (q0 + q < KSPLIT) s[i] += v[i][q];
    }
#pragma unroll
    for (int i = 0; i < MO; ++i) {
      const int o = base + i * THREADS + threadIdx.x;
      if (o < n) {
        logit[o] = s[i];
        logits[o] = s[i];
      }
    }
  }
  __syncthreads();
  for (int t = warp; t < T; t += WARPS_R) route_token(logit, bias, E, topk, scale, norm, ids, wts, sel_id[warp],
                                                     sel_s[warp], t);
}
