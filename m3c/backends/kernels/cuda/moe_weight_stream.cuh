// How a warp streams a 128-row CTA's weights for the MegaMoE decode (moe_decode_mma.cu): the NVFP4 (prepacked or
// natural layout) and MXFP8 tile streams, their decode into mma.sync m16n8k16 f16 A fragments, the double-buffered
// GEMV over a K range and the staging hook (EARLY). Macros from the including file: ROWT (16-row tiles a warp),
// DECODE, EARLY. No system headers.
#pragma once

#include "ptx_common.cuh"

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

// The B fragments (activations, f16 pairs) of one 16-K MMA step for each of the N 8-column tiles: xrow[nt] + k holds
// the lane's four K values (the layouts put them next to each other).
template <int N>
__device__ __forceinline__ void load_b(u32 (&b)[N][2], const u16* const (&xrow)[N], int k) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt) {
    const uint2 v = *(const uint2*)(xrow[nt] + k);
    b[nt][0] = v.x;
    b[nt][1] = v.y;
  }
}

// Row pointers into the staged activations for the lane's columns (columns past cnt read column cnt - 1; their
// results are never stored), offset by the lane's K position `k_lane`.
template <int N>
__device__ __forceinline__ void token_rows(const u16* (&xrow)[N], const u16* xs, int Kc, int cnt, int k_lane) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int nt = 0; nt < N; ++nt) xrow[nt] = xs + (long)min(g + 8 * nt, cnt - 1) * (Kc + 4) + k_lane;
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

template <int N>
__device__ __forceinline__ void mma_nvfp4(const uint4 (&cb)[ROWT][4], const uint2 (&sb)[ROWT], int sc,
                                          const u16* const (&xrow)[N], float (*acc)[N][4]) {
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
      u32 b[N][2];
      load_b<N>(b, xrow, k);
#pragma unroll
      for (int t = 0; t < ROWT; ++t) {
        u32 w = s == 0 ? cb[t][c].x : s == 1 ? cb[t][c].y : s == 2 ? cb[t][c].z : cb[t][c].w;
        u32 a[4];
        decode_nvfp4(w, sg[t], sg8[t], a);
#pragma unroll
        for (int nt = 0; nt < N; ++nt) mma(acc[t][nt], a[0], a[1], a[2], a[3], b[nt][0], b[nt][1]);
      }
    }
  }
}

struct Nvfp4Stream {  // a warp's NVFP4 tiles for one K split: the lane's codes / scales, tiles tile_bytes apart
  const u8* code;
  const u8* scale;
  long tile_bytes, tile_sbytes;
  static constexpr int k_lane = 16;  // lane j's scale group holds K 16 j .. 16 j + 15 of each 64-K chunk
  __device__ __forceinline__ void load(uint4 (&c)[ROWT][4], uint2 (&s)[ROWT], int sc) const {
    load_nvfp4(c, s, code, scale, tile_bytes, tile_sbytes, sc);
  }
  template <int N>
  __device__ __forceinline__ void mma(const uint4 (&c)[ROWT][4], const uint2 (&s)[ROWT], int sc,
                                      const u16* const (&xrow)[N], float (*acc)[N][4]) const {
    mma_nvfp4<N>(c, s, sc, xrow, acc);
  }
};

// The routed NVFP4 weights in their natural layout: lane (g, j) of a 16-row tile reads 16-byte pieces j and j + 4 of
// rows g and g + 8 in each 256-K super-chunk (128 bytes a row), i.e. K 32 j .. 32 j + 31 and 128 + 32 j ...; the
// MMA's K may be visited in any order, so MMA step (piece q, word w, half e) takes the lane's K 32 j + 128 q + 8 w +
// 4 e .. + 3 from both the weights (decode8's pairs 2e, 2e + 1) and the staged tokens (k_lane = 32 j). Scales: the
// two E4M3 bytes of a piece's two 16-K groups (a u16 per row and piece).
struct Nvfp4NaturalStream {
  const u8* code;   // row g's byte 16 j of this K split
  const u8* scale;  // row g's scale byte 2 j of this K split
  long row_bytes, row_sbytes;  // K / 2, K / 16
  static constexpr int k_lane = 32;
  __device__ __forceinline__ void load(uint4 (&c)[ROWT][4], uint2 (&s)[ROWT], int sc) const {
#pragma unroll
    for (int t = 0; t < ROWT; ++t) {
      u32 sw[4];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const long row = 16 * t + 8 * r;
          c[t][2 * r + q] = ld_stream4(code + row * row_bytes + (long)sc * 128 + 64 * q);
          sw[2 * r + q] = *(const u16*)(scale + row * row_sbytes + (long)sc * 16 + 8 * q);
        }
      s[t] = make_uint2(sw[0] | (sw[1] << 16), sw[2] | (sw[3] << 16));  // row g: pieces 0, 1 | row g + 8
    }
  }
  template <int N>
  __device__ __forceinline__ void mma(const uint4 (&c)[ROWT][4], const uint2 (&s)[ROWT], int sc,
                                      const u16* const (&xrow)[N], float (*acc)[N][4]) const {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        u32 pg[ROWT][4], pg8[ROWT][4], sg[ROWT], sg8[ROWT];
#pragma unroll
        for (int t = 0; t < ROWT; ++t) {
          const uint4 a = c[t][q], b8 = c[t][2 + q];
          decode8(w == 0 ? a.x : w == 1 ? a.y : w == 2 ? a.z : a.w, pg[t]);
          decode8(w == 0 ? b8.x : w == 1 ? b8.y : w == 2 ? b8.z : b8.w, pg8[t]);
          sg[t] = scale_pair(s[t].x, 2 * q + (w >> 1));   // row g, piece q, 16-K group w / 2
          sg8[t] = scale_pair(s[t].y, 2 * q + (w >> 1));  // row g + 8
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          u32 b[N][2];
          load_b<N>(b, xrow, sc * 256 + 128 * q + 8 * w + 4 * e);
#pragma unroll
          for (int t = 0; t < ROWT; ++t) {
            const u32 a0 = hmul2(pg[t][2 * e], sg[t]), a1 = hmul2(pg8[t][2 * e], sg8[t]);
            const u32 a2 = hmul2(pg[t][2 * e + 1], sg[t]), a3 = hmul2(pg8[t][2 * e + 1], sg8[t]);
#pragma unroll
            for (int nt = 0; nt < N; ++nt) ::mma(acc[t][nt], a0, a1, a2, a3, b[nt][0], b[nt][1]);
          }
        }
      }
    }
  }
};

// One super-chunk (128 K) of MXFP8 codes ([tile][super-chunk][unit][lane][16 B]) and the E8M0 scales of rows g and
// g + 8 (natural layout: `scale` points at row g's scales for this K split, `srow` bytes a row).
__device__ __forceinline__ void load_mxfp8(uint4 (&cw)[ROWT][4], uint2 (&sw)[ROWT], const u8* code, const u8* scale,
                                           long tile_bytes, long tile_sbytes, int srow, int sc) {
#pragma unroll
  for (int t = 0; t < ROWT; ++t) {
#pragma unroll
    for (int c = 0; c < 4; ++c) cw[t][c] = ld_stream4(code + t * tile_bytes + (long)sc * 2048 + c * 512);
    sw[t].x = *(const u32*)(scale + t * tile_sbytes + sc * 4);              // row g: 4 groups of 32
    sw[t].y = *(const u32*)(scale + t * tile_sbytes + 8L * srow + sc * 4);  // row g + 8
  }
}

template <int N>
__device__ __forceinline__ void mma_mxfp8(const uint4 (&cw)[ROWT][4], const uint2 (&sw)[ROWT], int sc,
                                          const u16* const (&xrow)[N], float (*acc)[N][4]) {
#pragma unroll
  for (int q = 0; q < 8; ++q) {  // 8 steps of 16 K: step q lane j covers k = 16 q + 4 j + 0..3 (one E8M0 group)
    const int k = sc * 128 + q * 16;
    u32 b[N][2];
    load_b<N>(b, xrow, k);
#pragma unroll
    for (int t = 0; t < ROWT; ++t) {
      const uint4 v = cw[t][q >> 1];
      u32 w0 = (q & 1) ? v.z : v.x, w1 = (q & 1) ? v.w : v.y;
      float sg = e8m0_float((sw[t].x >> (8 * (q >> 1))) & 0xFFu);
      float sg8 = e8m0_float((sw[t].y >> (8 * (q >> 1))) & 0xFFu);
      u32 a0 = e4m3x2_lo(w0), a1 = e4m3x2_hi(w0), a2 = e4m3x2_lo(w1), a3 = e4m3x2_hi(w1);
#pragma unroll
      for (int nt = 0; nt < N; ++nt) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma(d, a0, a1, a2, a3, b[nt][0], b[nt][1]);
        acc[t][nt][0] += sg * d[0];
        acc[t][nt][1] += sg * d[1];
        acc[t][nt][2] += sg8 * d[2];
        acc[t][nt][3] += sg8 * d[3];
      }
    }
  }
}

struct Mxfp8Stream {  // a warp's MXFP8 tiles for one K split (scales: row g's, srow bytes a row)
  const u8* code;
  const u8* scale;
  long tile_bytes, tile_sbytes;
  int srow;
  static constexpr int k_lane = 4;  // lane j holds K 4 j .. 4 j + 3 of each 16-K step
  __device__ __forceinline__ void load(uint4 (&c)[ROWT][4], uint2 (&s)[ROWT], int sc) const {
    load_mxfp8(c, s, code, scale, tile_bytes, tile_sbytes, srow, sc);
  }
  template <int N>
  __device__ __forceinline__ void mma(const uint4 (&c)[ROWT][4], const uint2 (&s)[ROWT], int sc,
                                      const u16* const (&xrow)[N], float (*acc)[N][4]) const {
    mma_mxfp8<N>(c, s, sc, xrow, acc);
  }
};

// One super-chunk's decode + MMA; DECODE 2 (a benchmark probe of the weight stream alone, wrong output: what the
// kernels' loads, staging and grids cost without their math) XORs the loaded words into one accumulator instead.
template <int N, class Stream>
__device__ __forceinline__ void math(const Stream& w, const uint4 (&c)[ROWT][4], const uint2 (&s)[ROWT], int sc,
                                     const u16* const (&xrow)[N], float (*acc)[N][4]) {
#if DECODE == 2
  u32 f = 0u;
#pragma unroll
  for (int t = 0; t < ROWT; ++t) {
#pragma unroll
    for (int q = 0; q < 4; ++q) f ^= c[t][q].x ^ c[t][q].y ^ c[t][q].z ^ c[t][q].w;
    f ^= s[t].x ^ s[t].y;
  }
  acc[0][0][0] += __uint_as_float(f & 0x007FFFFFu);
#else
  w.template mma<N>(c, s, sc, xrow, acc);
#endif
}

// acc[t][nt][4] += W[tile rows] . xs over this warp's K range of nsc super-chunks (64 code bytes a lane and tile
// each), two register buffers: the next super-chunk's loads are in flight while one is decoded. (A third buffer
// measured slower on the H200: 158 registers, 3 CTAs per SM; so did asking L2 for the super-chunk 4 ahead, 10-20%:
// benchmarks/RESULTS.md, session 21.) stage(): see staged().
template <int N, class Stream, class Stage>
__device__ void gemv(const Stream& w, int nsc, const u16* xs, int Kc, int cnt, float (*acc)[N][4],
                     const Stage& stage) {
  const u16* xrow[N];
  token_rows<N>(xrow, xs, Kc, cnt, Stream::k_lane * (threadIdx.x & 3));
  uint4 ca[ROWT][4], cb[ROWT][4];
  uint2 sa[ROWT], sb[ROWT];
  w.load(ca, sa, 0);
  stage();
  for (int sc = 0; sc < nsc; sc += 2) {
    if (sc + 1 < nsc) w.load(cb, sb, sc + 1);
    math<N>(w, ca, sa, sc, xrow, acc);
    if (sc + 1 >= nsc) break;
    if (sc + 2 < nsc) w.load(ca, sa, sc + 2);
    math<N>(w, cb, sb, sc + 1, xrow, acc);
  }
}

struct NoStage {
  __device__ __forceinline__ void operator()() const {}
};

// stage() (fills xs / mult, a CTA barrier at its end), then run(NoStage{}); with EARLY run(stage): gemv calls it once
// the first super-chunk's loads are issued, so their latency overlaps the staging.
template <class Stage, class Run>
__device__ __forceinline__ void staged(const Stage& stage, const Run& run) {
#if EARLY
  run(stage);
#else
  stage();
  run(NoStage{});
#endif
}

__device__ __forceinline__ void prefetch_l2(const u8* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Ask L2 for the first `nsc` super-chunks (codes and scales) of each warp's two tiles of one 32 WARPS-row block: rows
// row0 .. of expert `expert` (-1: the shared MXFP8 expert) of a weight with rows_total rows and K columns, K split
// ks of KS. The addresses are the streams' above (Nvfp4Stream / Nvfp4NaturalStream with NATURAL / Mxfp8Stream):
// 128-byte lines, at most one a lane a super-chunk.
__device__ void prefetch_block(int expert, int row0, int ks, int KS, int rows_total, int K, int nsc, const u8* rcode,
                               const u8* rscale, const u8* scode, const u8* sscale) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, Kc = K / KS;
  const int row = row0 + warp * 32;  // the warp's first row
  if (expert >= 0) {
    nsc = min(nsc, Kc / 256);
#if NATURAL  // a row a lane: 128 code bytes and 16 scale bytes a super-chunk
    const long r = (long)expert * rows_total + row + lane;
    for (int sc = 0; sc < nsc; ++sc) {
      prefetch_l2(rcode + r * (K / 2) + (long)ks * Kc / 2 + sc * 128);
      prefetch_l2(rscale + r * (K / 16) + (long)ks * Kc / 16 + sc * 16);
    }
#else  // prepacked: 2 KB of codes and 256 scale bytes a tile a super-chunk
    const long tile = (long)expert * (rows_total / 16) + row / 16;
    for (int sc = 0; sc < nsc; ++sc) {
      prefetch_l2(rcode + (tile + (lane >> 4)) * K * 8 + (long)ks * Kc * 8 + sc * 2048 + (lane & 15) * 128);
      if (lane < 4) prefetch_l2(rscale + (tile + (lane >> 1)) * K + (long)ks * Kc + sc * 256 + (lane & 1) * 128);
    }
#endif
  } else {  // prepacked MXFP8 codes (2 KB a tile a 128-K super-chunk); natural scales, K / 32 bytes a row
    nsc = min(nsc, Kc / 128);
    const long tile = row / 16;
    for (int sc = 0; sc < nsc; ++sc)
      prefetch_l2(scode + (tile + (lane >> 4)) * K * 16 + (long)ks * Kc * 16 + sc * 2048 + (lane & 15) * 128);
    if (nsc > 0) prefetch_l2(sscale + (long)(row + lane) * (K / 32) + (long)ks * Kc / 32);
  }
}
