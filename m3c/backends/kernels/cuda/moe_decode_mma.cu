// MegaMoE decode (1 <= T <= 8 * NT tokens) for sm_90: NVFP4 routed experts + MXFP8 shared expert, weights streamed
// once from a prepacked layout, decoded in registers straight into mma.sync m16n8k16 f16 A fragments (weights are
// the MMA's M, the tokens its N). Layouts and numerics: m3c/backends/kernels/moe_cuda.py. No headers: builds with a
// bare nvcc (PyPI) or NVRTC. Compile-time settings: WARPS (warps per CTA), NT (8-token column tiles), ACT_BF16
// (activations bf16, else float32), DECODE (0: E2M1 -> f16 by byte lookups, 1: by lookups to E4M3 + cvt).
#ifndef WARPS
#define WARPS 4
#endif
#ifndef NT
#define NT 1
#endif
#ifndef ACT_BF16
#define ACT_BF16 1
#endif
#ifndef DECODE
#define DECODE 0
#endif
#define ROWT 2     // 16-row tiles per warp (they share the activation fragments)
#define MAXT (8 * NT)

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

__device__ __forceinline__ uint4 ld_stream4(const u8* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ uint2 ld_stream2(const u8* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 e4m3x2_lo(u32 v) {  // the two E4M3 bytes in v's low half -> f16x2 (exact)
  u32 r;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ u32 e4m3x2_hi(u32 v) {
  u32 r;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf16_round(float v) {
  u16 b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  return __uint_as_float(((u32)b) << 16);
}
__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float load_act(const void* x, long i) {
#if ACT_BF16
  return __uint_as_float(((u32)((const u16*)x)[i]) << 16);
#else
  return ((const float*)x)[i];
#endif
}

// One E4M3 scale byte (byte `i` of `w`) as the f16x2 pair (s, s).
__device__ __forceinline__ u32 scale_pair(u32 w, u32 i) { return e4m3x2_lo(prmt(w, 0u, i | (i << 4))); }

// Eight E2M1 codes (two rows x four K, see moe_cuda.prepack_nvfp4) -> the four f16x2 A registers, times the
// rows' scale pairs.
__device__ __forceinline__ void decode_nvfp4(u32 w, u32 sg, u32 sg8, u32* a) {
  u32 m = w & 0x77777777u;
#if DECODE == 0
  u32 oa = prmt(0x3E3C3800u, 0x46444240u, m);        // f16 high bytes of 0, .5, 1, 1.5 | 2, 3, 4, 6
  u32 ob = prmt(0x3E3C3800u, 0x46444240u, m >> 16);
  oa |= w & 0x80808080u;
  ob |= (w << 4) & 0x80808080u;
  a[0] = hmul2(prmt(oa, 0u, 0x1404u), sg);
  a[1] = hmul2(prmt(oa, 0u, 0x3424u), sg8);
  a[2] = hmul2(prmt(ob, 0u, 0x1404u), sg);
  a[3] = hmul2(prmt(ob, 0u, 0x3424u), sg8);
#else
  u32 oa = prmt(0x3C383000u, 0x4C484440u, m);        // E4M3 codes of 0, .5, 1, 1.5 | 2, 3, 4, 6
  u32 ob = prmt(0x3C383000u, 0x4C484440u, m >> 16);
  oa |= w & 0x80808080u;
  ob |= (w << 4) & 0x80808080u;
  a[0] = hmul2(e4m3x2_lo(oa), sg);
  a[1] = hmul2(e4m3x2_hi(oa), sg8);
  a[2] = hmul2(e4m3x2_lo(ob), sg);
  a[3] = hmul2(e4m3x2_hi(ob), sg8);
#endif
}

__device__ __forceinline__ float e8m0_float(u32 e) {
  return __uint_as_float(e == 0u ? 0x00400000u : (e == 255u ? 0x7FC00000u : e << 23));
}

struct Block {          // what one CTA works on
  int expert;           // routed expert id, or -1 for the shared expert
  int row0;             // first weight row of the CTA (within the expert's rows)
  int ks;               // K split index
};

// The CTA's work item: (routed expert slot | shared) x row block x K split. Returns false if the slot is unused.
__device__ bool find_block(Block& b, const int* ids, int n_ids, int E, int n_slots, int rows, int srows, int KS,
                           u32* flags) {
  int item = blockIdx.x;
  b.ks = item % KS;
  item /= KS;
  const int per = rows / (32 * WARPS);
  b.row0 = 0;
  if (item >= n_slots * per) {
    b.expert = -1;
    b.row0 = (item - n_slots * per) * 32 * WARPS;
    return b.row0 < srows;
  }
  const int slot = item / per;
  b.row0 = (item % per) * 32 * WARPS;
  for (int i = threadIdx.x; i < (E + 31) / 32; i += blockDim.x) flags[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < n_ids; i += blockDim.x) {
    int e = ids[i];
    if (e >= 0 && e < E) atomicOr(&flags[e >> 5], 1u << (e & 31));
  }
  __syncthreads();
  int left = slot;
  b.expert = -2;
  for (int w = 0; w < (E + 31) / 32; ++w) {
    u32 f = flags[w];
    int c = __popc(f);
    if (left < c) {
      for (int k = 0; k < left; ++k) f &= f - 1u;
      b.expert = w * 32 + __ffs(f) - 1;
      break;
    }
    left -= c;
  }
  return b.expert >= 0;
}

// Stage the CTA's activations [T, Kc] as f16 x 2^-e(token) into xs (row stride Kc + 4), 2^e in mult.
// act(n, k) is computed by `Src`.
template <class Src>
__device__ void stage(const Src& src, int T, int Kc, u16* xs, float* mult, float* amax) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int n = warp; n < T; n += WARPS) {
    float m = 0.f;
    for (int k = lane; k < Kc; k += 32) m = fmaxf(m, fabsf(src(n, k)));
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) amax[n] = m;
  }
  __syncthreads();
  for (int n = threadIdx.x; n < T; n += blockDim.x) {
    u32 bits = __float_as_uint(amax[n]);
    int e = (amax[n] > 0.f && amax[n] < 3.0e38f) ? (int)((bits >> 23) & 0xFF) - 127 - 14 : 0;
    e = max(-100, min(100, e));
    mult[n] = __uint_as_float((u32)(127 + e) << 23);
    amax[n] = __uint_as_float((u32)(127 - e) << 23);  // now the down-scale factor
  }
  __syncthreads();
  const int half = Kc / 2;
  for (int i = threadIdx.x; i < T * half; i += blockDim.x) {
    int n = i / half, k = (i - n * half) * 2;
    float d = amax[n];
    *(u32*)(xs + (long)n * (Kc + 4) + k) = f32x2_to_f16x2(src(n, k) * d, src(n, k + 1) * d);
  }
  __syncthreads();
}

// One super-chunk (256 K) of NVFP4 codes / scales for the warp's tiles: [tile][super-chunk][chunk][lane][16 B]
// codes, [tile][super-chunk][lane][8 B] scales.
__device__ __forceinline__ void load_nvfp4(uint4 (&cb)[ROWT][4], uint2 (&sb)[ROWT], const u8* code, const u8* scale,
                                           long tile_bytes, long tile_sbytes, int sc) {
#pragma unroll
  for (int t = 0; t < ROWT; ++t) {
#pragma unroll
    for (int c = 0; c < 4; ++c) cb[t][c] = ld_stream4(code + t * tile_bytes + (long)sc * 2048 + c * 512);
    sb[t] = ld_stream2(scale + t * tile_sbytes + (long)sc * 256);
  }
}

__device__ __forceinline__ void mma_nvfp4(const uint4 (&cb)[ROWT][4], const uint2 (&sb)[ROWT], int sc,
                                          const u16* const (&xrow)[NT], float (*acc)[NT][4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    u32 sg[ROWT], sg8[ROWT];
#pragma unroll
    for (int t = 0; t < ROWT; ++t) {
      u32 sw = c < 2 ? sb[t].x : sb[t].y;
      sg[t] = scale_pair(sw, (c & 1) * 2);
      sg8[t] = scale_pair(sw, (c & 1) * 2 + 1);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int k = (sc * 4 + c) * 64 + 4 * s;
      u32 b[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint2 v = *(const uint2*)(xrow[nt] + k);
        b[nt][0] = v.x;
        b[nt][1] = v.y;
      }
#pragma unroll
      for (int t = 0; t < ROWT; ++t) {
        u32 w = s == 0 ? cb[t][c].x : s == 1 ? cb[t][c].y : s == 2 ? cb[t][c].z : cb[t][c].w;
        u32 a[4];
        decode_nvfp4(w, sg[t], sg8[t], a);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma(acc[t][nt], a[0], a[1], a[2], a[3], b[nt][0], b[nt][1]);
      }
    }
  }
}

// acc[t][nt][4] += W[tile rows] . xs over this warp's K range (nsc super-chunks; two register buffers, the next
// super-chunk's bytes in flight while this one is decoded). code / scale point at the warp's first tile's lane data
// for this K split; tiles are tile_bytes / tile_sbytes apart.
__device__ void gemv_nvfp4(const u8* code, const u8* scale, long tile_bytes, long tile_sbytes, int nsc,
                           const u16* xs, int Kc, int T, float (*acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
  const u16* xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xrow[nt] = xs + (long)min(g + 8 * nt, T - 1) * (Kc + 4) + 16 * j;
  uint4 ca[ROWT][4], cb[ROWT][4];
  uint2 sa[ROWT], sb[ROWT];
  load_nvfp4(ca, sa, code, scale, tile_bytes, tile_sbytes, 0);
  for (int sc = 0; sc < nsc; sc += 2) {
    if (sc + 1 < nsc) load_nvfp4(cb, sb, code, scale, tile_bytes, tile_sbytes, sc + 1);
    mma_nvfp4(ca, sa, sc, xrow, acc);
    if (sc + 1 >= nsc) break;
    if (sc + 2 < nsc) load_nvfp4(ca, sa, code, scale, tile_bytes, tile_sbytes, sc + 2);
    mma_nvfp4(cb, sb, sc + 1, xrow, acc);
  }
}

// MXFP8: `scale` points at row g's E8M0 scales (natural layout, `srow` bytes a row) for this K split.
__device__ void gemv_mxfp8(const u8* code, const u8* scale, long tile_bytes, long tile_sbytes, int srow, int nsc,
                           const u16* xs, int Kc, int T, float (*acc)[NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
  const u16* xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xrow[nt] = xs + (long)min(g + 8 * nt, T - 1) * (Kc + 4) + 4 * j;
  for (int sc = 0; sc < nsc; ++sc) {
    uint4 cw[ROWT][4];
    uint2 sw[ROWT];  // .x: row g, .y: row g + 8
#pragma unroll
    for (int t = 0; t < ROWT; ++t) {
#pragma unroll
      for (int c = 0; c < 4; ++c) cw[t][c] = ld_stream4(code + t * tile_bytes + (long)sc * 2048 + c * 512);
      sw[t].x = *(const u32*)(scale + t * tile_sbytes + sc * 4);                 // row g: 4 groups of 32
      sw[t].y = *(const u32*)(scale + t * tile_sbytes + 8L * srow + sc * 4);     // row g + 8
    }
#pragma unroll
    for (int q = 0; q < 8; ++q) {           // 8 steps of 16 K: chunk q / 4, step q % 4
      const int k = sc * 128 + q * 16;
      u32 b[NT][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint2 v = *(const uint2*)(xrow[nt] + k);
        b[nt][0] = v.x;
        b[nt][1] = v.y;
      }
#pragma unroll
      for (int t = 0; t < ROWT; ++t) {
        const uint4 v = cw[t][q >> 1];
        u32 w0 = (q & 1) ? v.z : v.x, w1 = (q & 1) ? v.w : v.y;
        float sg = e8m0_float((sw[t].x >> (8 * (q >> 1))) & 0xFFu);   // step q's group: q / 2
        float sg8 = e8m0_float((sw[t].y >> (8 * (q >> 1))) & 0xFFu);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float d[4] = {0.f, 0.f, 0.f, 0.f};
          mma(d, e4m3x2_lo(w0), e4m3x2_hi(w0), e4m3x2_lo(w1), e4m3x2_hi(w1), b[nt][0], b[nt][1]);
          acc[t][nt][0] += sg * d[0];
          acc[t][nt][1] += sg * d[1];
          acc[t][nt][2] += sg8 * d[2];
          acc[t][nt][3] += sg8 * d[3];
        }
      }
    }
  }
}

struct XSrc {  // FC1's input: the tokens' activations
  const void* x; int H; int k0;
  __device__ float operator()(int n, int k) const { return load_act(x, (long)n * H + k0 + k); }
};
struct ActSrc {  // FC2's input: SiLU(gate) * up from FC1's K-split partial sums (pair row p of h, -1: zeros)
  const float* h; const int* pair; int KS; long split; int ROWS; int half;
  __device__ float operator()(int n, int k) const {
    int p = pair[n];
    if (p < 0) return 0.f;
    float gs = 0.f, us = 0.f;
    for (int s = 0; s < KS; ++s) {
      gs += h[s * split + (long)p * ROWS + k];
      us += h[s * split + (long)p * ROWS + half + k];
    }
#if ACT_BF16
    gs = bf16_round(gs);
    us = bf16_round(us);
    float sg = bf16_round(gs / (1.f + __expf(-gs)));
    return bf16_round(sg * us);
#else
    return gs / (1.f + expf(-gs)) * us;
#endif
  }
};

// Pair index (row of h / y) of token n for this block: routed -> n * topk + slot or -1, shared -> T * topk + n.
__device__ void find_pairs(int* pair, const int* ids, int T, int topk, int expert) {
  for (int n = threadIdx.x; n < T; n += blockDim.x) {
    int p = -1;
    if (expert < 0) {
      p = T * topk + n;
    } else {
      for (int k = 0; k < topk; ++k)
        if (ids[n * topk + k] == expert) { p = n * topk + k; break; }
    }
    pair[n] = p;
  }
  __syncthreads();
}

// Shared work of both GEMV launches once xs is staged: the warp's two row tiles, then out[p, row] = acc * 2^e *
// row factor * weight.
__device__ void run_tiles(const Block& b, int rows_total, int K, int Kc, int T, const u16* xs, const float* mult,
                          const int* pair, const u8* rcode, const u8* rscale, const float* rrow, const u8* scode,
                          const u8* sscale, const float* wts, float* out, long out_stride) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
  const int row = b.row0 + warp * 32;  // first row of the warp's tiles
  float acc[ROWT][NT][4];
#pragma unroll
  for (int t = 0; t < ROWT; ++t)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][nt][i] = 0.f;
  const long tile = (long)row / 16 + (b.expert >= 0 ? (long)b.expert * (rows_total / 16) : 0);
  if (b.expert >= 0) {  // prepacked codes (16 rows x K / 2 bytes a tile) and scales (K bytes a tile)
    const long tb = (long)K * 8, tsb = (long)K;
    const u8* c = rcode + tile * tb + (long)b.ks * Kc * 8 + lane * 16;
    const u8* s = rscale + tile * tsb + (long)b.ks * Kc + lane * 8;
    gemv_nvfp4(c, s, tb, tsb, Kc / 256, xs, Kc, T, acc);
  } else {              // prepacked codes (16 rows x K bytes a tile), scales in their natural [rows, K / 32] layout
    const long tb = (long)K * 16, tsb = (long)K * 16 / 32;
    const u8* c = scode + tile * tb + (long)b.ks * Kc * 16 + lane * 16;
    const u8* s = sscale + (long)(row + g) * (K / 32) + (long)b.ks * Kc / 32;
    gemv_mxfp8(c, s, tb, tsb, K / 32, Kc / 128, xs, Kc, T, acc);
  }
#pragma unroll
  for (int t = 0; t < ROWT; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row + 16 * t + g + (i >= 2 ? 8 : 0);
      const float f = b.expert >= 0 ? rrow[(long)b.expert * rows_total + r] : 1.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int n = 8 * nt + 2 * j + (i & 1);
        if (n < T) {
          const int p = pair[n];
          if (p >= 0) out[(long)p * out_stride + r] = acc[t][nt][i] * mult[n] * f * (wts ? wts[p] : 1.f);
        }
      }
    }
  }
}

// FC1: h[ks, p, r] = partial (over K split ks) of W13[e, r] . x[n] for every routed pair / shared row p.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_fc1(const void* x, int T, const int* ids, int topk, int E, int n_slots, const u8* rcode, const u8* rscale,
        const float* rrow, int rows, const u8* scode, const u8* sscale, int srows, int H, int KS, float* h, int P,
        int ROWS, void* scratch0, void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32];
  __shared__ float mult[MAXT], amax[MAXT];
  __shared__ int pair[MAXT];
  Block b;
  if (!find_block(b, ids, T * topk, E, n_slots, rows, srows, KS, flags)) return;
  find_pairs(pair, ids, T, topk, b.expert);
  const int Kc = H / KS;
  u16* xs = (u16*)smem;
  stage(XSrc{x, H, b.ks * Kc}, T, Kc, xs, mult, amax);
  run_tiles(b, b.expert >= 0 ? rows : srows, H, Kc, T, xs, mult, pair, rcode, rscale, rrow, scode, sscale, nullptr,
            h + (long)b.ks * P * ROWS, ROWS);
}

// FC2: y[p, r] = weight(p) * W2[e, r] . act(p), act = SiLU(gate) * up from FC1's partial sums.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_fc2(const float* h, int KS1, int T, const int* ids, const float* wts, int topk, int E, int n_slots,
        const u8* rcode, const u8* rscale, const float* rrow, const u8* scode, const u8* sscale, int I, int S, int H,
        int P, int ROWS, float* y,
        void* scratch0, void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32];
  __shared__ float mult[MAXT], amax[MAXT];
  __shared__ int pair[MAXT];
  Block b;
  if (!find_block(b, ids, T * topk, E, n_slots, H, S > 0 ? H : 0, 1, flags)) return;
  find_pairs(pair, ids, T, topk, b.expert);
  const int K = b.expert >= 0 ? I : S;
  u16* xs = (u16*)smem;
  stage(ActSrc{h, pair, KS1, (long)P * ROWS, ROWS, K}, T, K, xs, mult, amax);
  run_tiles(b, H, K, K, T, xs, mult, pair, rcode, rscale, rrow, scode, sscale, b.expert >= 0 ? wts : nullptr, y, H);
}

// out[n, :] = sum_k y[n * topk + k, :] (+ y[T * topk + n, :] with a shared expert), in order.
extern "C" __global__ void __launch_bounds__(256)
moe_combine(const float* y, int T, int topk, int shared, int H, void* out, void* scratch0, void* scratch1) {
  const int n = blockIdx.y;
  for (int c = blockIdx.x * 256 + threadIdx.x; c < H; c += gridDim.x * 256) {
    float s = 0.f;
    for (int k = 0; k < topk; ++k) s += y[(long)(n * topk + k) * H + c];
    if (shared) s += y[(long)(T * topk + n) * H + c];
#if ACT_BF16
    u16 bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(s));
    ((u16*)out)[(long)n * H + c] = bits;
#else
    ((float*)out)[(long)n * H + c] = s;
#endif
  }
}
