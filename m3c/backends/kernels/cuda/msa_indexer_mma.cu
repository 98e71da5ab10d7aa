// MSA indexer decode scores for sm_89+: NVFP4 index keys (the paged cache's natural layout) decoded in registers
// straight into mma.sync m16n8k16 f16 A fragments (keys are the MMA's M, the (query row, index head) columns its N),
// block-max pooled per KV block: out[t, g, b] float32. Layout, numerics and launch:
// m3c/backends/kernels/msa_indexer_cuda.py. No system headers (only ptx_common.cuh): builds with a bare nvcc.
// Compile-time settings: WARPS (warps per CTA), BS (KV block size, a multiple of 16), NT (MMA column tiles per pass),
// Q_F32 (float32 queries, else bf16), MIN_CTAS. The index head dim is 128 (64 code bytes + 8 E4M3 scale bytes a key).
#ifndef WARPS
#define WARPS 4
#endif
#ifndef BS
#define BS 128
#endif
#ifndef NT
#define NT 1
#endif
#ifndef Q_F32
#define Q_F32 0  // index queries float32 (else bf16)
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1  // __launch_bounds__'s minimum CTAs per SM (> 1 caps the registers)
#endif
#define D 128
#define STEP_TILES (BS >= 64 ? 4 : BS / 16)  // 16-key MMA tiles a warp loads per step (64 keys, or one block)
#define STEP_KEYS (16 * STEP_TILES)
#define SPB (BS / STEP_KEYS)                  // steps per KV block
#define BTR 2                                  // block-table registers a lane holds: <= 64 blocks per warp
static_assert(BS % STEP_KEYS == 0, "BS must be 16, 32 or a multiple of 64");

#include "ptx_common.cuh"

__device__ __forceinline__ u32 ld_stream_u16(const u8* p) {
  u16 r;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ float f16_round(float v) {  // v rounded to f16 (as a float; +-inf past f16's range)
  u16 h;
  float r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return r;
}
__device__ __forceinline__ float scale_pow2(float v, int e) {  // v 2^e for |e| <= 163, as two normal factors
  const int e1 = e / 2, e2 = e - e / 2;
  return v * __uint_as_float((u32)(127 + e1) << 23) * __uint_as_float((u32)(127 + e2) << 23);
}
__device__ __forceinline__ float nan_max(float a, float b) {  // NaN if either is NaN (torch.amax's rule)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}


struct Step {            // one step's keys for this lane: STEP_TILES tiles x rows (g, g + 8)
  uint4 code[STEP_TILES][2];  // bytes 16 c .. 16 c + 15 of the key's 64 code bytes (c = lane % 4)
  u32 scale[STEP_TILES][2];   // scale bytes 2 c, 2 c + 1 (groups of the lane's 32 elements)
};

__device__ __forceinline__ void load_step(Step& s, const u8* kd, const u8* ks, long key0, int g, int c) {
#pragma unroll
  for (int t = 0; t < STEP_TILES; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long key = key0 + 16 * t + 8 * h + g;
      s.code[t][h] = ld_stream4(kd + key * (D / 2) + 16 * c);
      s.scale[t][h] = ld_stream_u16(ks + key * (D / 16) + 2 * c);
    }
  }
}

// acc[t][nt] = the tile's 16 keys . the columns (raw f32, before the columns' up-scales): 8 MMA steps of 16 K. Lane
// (g, c)'s K positions: step s = 2 j + e covers its 16-byte chunk's byte 2 s (A cols 2c, 2c+1 = elements 32 c + 4 s,
// + 1) and byte 2 s + 1 (A cols 2c + 8, 2c + 9 = elements 32 c + 4 s + 2, + 3); the staged query pairs bq use the
// same order (pair i = elements 32 c + 2 i, + 1), so the MMA's K is a permutation of the key's elements.
__device__ __forceinline__ void tile_scores(const Step& s, int t, const u32 (&bq)[NT][16], float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  const u32 s0[2] = {scale_pair(s.scale[t][0], 0), scale_pair(s.scale[t][0], 1)};
  const u32 s8[2] = {scale_pair(s.scale[t][1], 0), scale_pair(s.scale[t][1], 1)};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint4 c0 = s.code[t][0], c8 = s.code[t][1];
    const u32 w0 = j == 0 ? c0.x : j == 1 ? c0.y : j == 2 ? c0.z : c0.w;
    const u32 w8 = j == 0 ? c8.x : j == 1 ? c8.y : j == 2 ? c8.z : c8.w;
    u32 p[4], q[4];
    decode8(w0, p);
    decode8(w8, q);
    const u32 sg = s0[j >> 1], sg8 = s8[j >> 1];  // bytes 0..7: group 2c, 8..15: group 2c + 1
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const u32 a0 = hmul2(p[2 * e], sg), a1 = hmul2(q[2 * e], sg8);
      const u32 a2 = hmul2(p[2 * e + 1], sg), a3 = hmul2(q[2 * e + 1], sg8);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma(acc[nt], a0, a1, a2, a3, bq[nt][4 * j + 2 * e], bq[nt][4 * j + 2 * e + 1]);
    }
  }
}

// The lane's 32 query elements (32 c .. 32 c + 31 of one (row, head)) as float32, and the largest finite magnitude
// among them (NaN compares false).
__device__ __forceinline__ float load_query(const void* q, long off, bool ok, float (&x)[32]) {
  float m = 0.f;
#if Q_F32
  const uint4* src = (const uint4*)((const float*)q + off);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint4 v = ok ? src[i] : make_uint4(0u, 0u, 0u, 0u);
    x[4 * i] = __uint_as_float(v.x), x[4 * i + 1] = __uint_as_float(v.y);
    x[4 * i + 2] = __uint_as_float(v.z), x[4 * i + 3] = __uint_as_float(v.w);
  }
#else
  load_bf16x32((const u16*)q + off, ok, x);
#endif
#pragma unroll
  for (int i = 0; i < 32; ++i)
    if (fabsf(x[i]) <= 3.40282347e38f) m = fmaxf(m, fabsf(x[i]));  // finite only (NaN compares false)
  return m;
}

// Block-max index scores of one (request, chunk of KV blocks): out[t, g, b] for the request's rows t, index heads g
// and blocks b of the chunk (-inf where no key of b is visible to row t). Query columns n = (t - t_lo) * G + g, CPT a
// MMA tile (bf16: 8, one MMA column each; float32: 4, as two MMA columns 2m (hi) and 2m + 1 (lo), f16(q') and
// f16(q' - hi), summed after the MMA), NT tiles a pass (more columns: further passes over the keys). Warp w takes the
// chunk's blocks c_lo + w + WARPS i.
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_CTAS)
msa_index_scores(const void* q, const u8* kd, const u8* ks, const long long* pos, const int* qsl, const int* seq,
                 const int* bt, float* out, int stride_qt, int stride_qg, int stride_bt, int MB, int G, int chunk,
                 void* scratch0, void* scratch1) {
  constexpr int CPT = Q_F32 ? 4 : 8;  // query columns per MMA tile
  constexpr int EPL = Q_F32 ? 1 : 2;  // query columns per lane in the MMA result (lane columns 2c, 2c + 1)
  const int r = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int t_lo = qsl[r], ncols = (qsl[r + 1] - t_lo) * G;
  const int c_lo = blockIdx.y * chunk, c_hi = min(c_lo + chunk, MB);
  const int n_blk = (seq[r] + BS - 1) / BS;
  const int* bt_row = bt + (long)r * stride_bt;
  for (int col0 = 0; col0 < ncols; col0 += CPT * NT) {
    // Stage the lane's MMA column: its query column's elements 32 c .. 32 c + 31 as f16 times 2^-e (e from the
    // column's largest finite magnitude: f16's range never clips; +-inf / NaN stay what they are).
    u32 bq[NT][16];
    int e_b[NT];
    int pos_b[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = col0 + CPT * nt + (Q_F32 ? g >> 1 : g);
      const bool ok = n < ncols;
      const int t = t_lo + (ok ? n / G : 0), hd = ok ? n % G : 0;
      float x[32];
      float m = load_query(q, (long)t * stride_qt + (long)hd * stride_qg + 32 * c, ok, x);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      // 2^-e and 2^e as two normal factors each (float32 subnormal m: e down to -163)
      const int e = staging_exp(m);
      const int e1 = e / 2, e2 = e - e / 2;
      const float down1 = __uint_as_float((u32)(127 - e1) << 23), down2 = __uint_as_float((u32)(127 - e2) << 23);
      e_b[nt] = e;
      pos_b[nt] = ok ? (int)pos[t] : -1;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float a = x[2 * i] * down1 * down2, b = x[2 * i + 1] * down1 * down2;
#if Q_F32
        if (g & 1) {  // the lo column: what f16 left of the hi one (0 where hi is +-inf / NaN)
          const float ha = f16_round(a), hb = f16_round(b);
          a = fabsf(ha) < 65536.f ? a - ha : 0.f;
          b = fabsf(hb) < 65536.f ? b - hb : 0.f;
        }
#endif
        bq[nt][i] = f32x2_to_f16x2(a, b);
      }
    }
    // This lane's result columns (bf16: 2c, 2c + 1; float32: query column c, MMA columns 2c + 0 / 1) and their
    // positions and scale exponents (held by lanes 4 n, n the MMA column).
    int cpos[NT][EPL];
    int cexp[NT][EPL];
    int maxpos = -1;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        cpos[nt][e] = __shfl_sync(0xffffffffu, pos_b[nt], 4 * (2 * c + e));
        cexp[nt][e] = __shfl_sync(0xffffffffu, e_b[nt], 4 * (2 * c + e));
      }
      maxpos = max(maxpos, pos_b[nt]);
    }
    for (int o = 4; o < 32; o <<= 1) maxpos = max(maxpos, __shfl_xor_sync(0xffffffffu, maxpos, o));
    const int n_vis = maxpos >= 0 ? min(maxpos / BS + 1, n_blk) : 0;
    const int vis_hi = min(c_hi, n_vis);
    // Blocks no column sees: -inf, keys untouched.
    for (int i = threadIdx.x; i < (c_hi - max(c_lo, vis_hi)) * CPT * NT; i += WARPS * 32) {
      const int b = max(c_lo, vis_hi) + i / (CPT * NT), n = col0 + i % (CPT * NT);
      if (n < ncols) out[((long)t_lo * G + n) * MB + b] = __uint_as_float(0xFF800000u);
    }
    const int nb_w = vis_hi > c_lo + warp ? (vis_hi - c_lo - warp + WARPS - 1) / WARPS : 0;  // this warp's blocks
    if (nb_w == 0) continue;
    int btv[BTR];
#pragma unroll
    for (int i = 0; i < BTR; ++i) {
      const int j = lane + 32 * i;
      btv[i] = j < nb_w ? bt_row[c_lo + warp + WARPS * j] : 0;
    }
    const int n_steps = nb_w * SPB;
    float bm[NT][EPL];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < EPL; ++e) bm[nt][e] = __uint_as_float(0xFF800000u);
    auto key0 = [&](int i) -> long {  // first key (cache row) of the warp's step i
      const int j = i / SPB;
      const int phys = __shfl_sync(0xffffffffu, j < 32 ? btv[0] : btv[1], j & 31);
      return (long)phys * BS + (i % SPB) * STEP_KEYS;
    };
    // One step: scores of its tiles, masked (key position > column position: -inf), pooled into bm; at a block's
    // last step the warp reduces bm over its rows and lanes 0..3 write the block's maxima.
    auto consume = [&](const Step& s, int i) {
      const int j = i / SPB, b = c_lo + warp + WARPS * j;
      const int kp0 = b * BS + (i % SPB) * STEP_KEYS + g;
#pragma unroll
      for (int t = 0; t < STEP_TILES; ++t) {
        float acc[NT][4];
        tile_scores(s, t, bq, acc);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < EPL; ++e) {
            const float v0 = Q_F32 ? acc[nt][0] + acc[nt][1] : acc[nt][e];      // key g
            const float v8 = Q_F32 ? acc[nt][2] + acc[nt][3] : acc[nt][2 + e];  // key g + 8
            const float lo = kp0 + 16 * t <= cpos[nt][e] ? v0 : __uint_as_float(0xFF800000u);
            const float hi = kp0 + 16 * t + 8 <= cpos[nt][e] ? v8 : __uint_as_float(0xFF800000u);
            bm[nt][e] = nan_max(bm[nt][e], nan_max(lo, hi));
          }
        }
      }
      if (i % SPB == SPB - 1) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < EPL; ++e) {
            float v = bm[nt][e];
            for (int o = 4; o < 32; o <<= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
            const int n = col0 + CPT * nt + EPL * c + e;
            if (g == 0 && n < ncols) out[((long)t_lo * G + n) * MB + b] = scale_pow2(v, cexp[nt][e]);
            bm[nt][e] = __uint_as_float(0xFF800000u);
          }
        }
      }
    };
    // Two register buffers: the next step's loads are in flight while one is decoded.
    Step sa, sb;
    load_step(sa, kd, ks, key0(0), g, c);
    for (int i = 0; i < n_steps; i += 2) {
      if (i + 1 < n_steps) load_step(sb, kd, ks, key0(i + 1), g, c);
      consume(sa, i);
      if (i + 1 >= n_steps) break;
      if (i + 2 < n_steps) load_step(sa, kd, ks, key0(i + 2), g, c);
      consume(sb, i + 1);
    }
  }
}
