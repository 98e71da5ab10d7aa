// MSA sparse-attention decode for sm_89+: a CTA of WARPS warps per (query row, KV group, split), each warp one or
// more 64-key steps of the selected blocks; the group's HG <= 16 query heads are the MMA's M (one m16 tile), NVFP4 K
// and V decoded in registers straight into mma.sync m16n8k16 f16 fragments, online softmax in registers; the CTA's
// warps merged exactly through shared memory, the splits in a thread-block cluster (sm_90, <= 8 splits) or by the
// last CTA to arrive. Host side, layouts and numerics: m3c/backends/kernels/msa_attention_cuda.py. No system
// headers (only ptx_common.cuh). Compile-time settings: H (query heads), KVH (KV heads), BS (KV block size, a
// multiple of 64), TOPK, SPLIT (CTAs a row and group), WARPS (warps a CTA, <= 4: the merge's shared memory),
// LOADFENCE (see the step). D = 128 (64 code bytes + 8 E4M3 scale bytes a key and head).
#ifndef H
#define H 16
#endif
#ifndef KVH
#define KVH 1
#endif
#ifndef BS
#define BS 128
#endif
#ifndef TOPK
#define TOPK 16
#endif
#ifndef SPLIT
#define SPLIT 8
#endif
#ifndef WARPS
#define WARPS 4
#endif
#define D 128
#define HG (H / KVH)
#define STEPS (BS / 64)               // 64-key steps a block
#define UNITS (TOPK * STEPS)          // (selection entry, step) work units of a row and group
#define WORKERS (SPLIT * WARPS)       // warps over a row and group
#define PER ((UNITS + WORKERS - 1) / WORKERS)
#ifndef LOADFENCE
#define LOADFENCE (PER == 1)  // measured: -0.4..0.8 µs with one step a warp, slower with more (registers)
#endif
// Splits merged through distributed shared memory (a thread-block cluster of SPLIT CTAs, sm_90+), else by the
// last CTA to arrive through global memory (sm_89, and SPLIT > 8: above the portable cluster size).
#if SPLIT > 1 && SPLIT <= 8 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLUSTER 1
#define KCLUSTER __cluster_dims__(SPLIT, 1, 1)
#else
#define CLUSTER 0
#define KCLUSTER
#endif
#define OROW (D + 4)                  // shared O row stride (floats): lane (g, c)'s stores hit 32 distinct banks
static_assert(SPLIT * 32 <= WARPS * 16 * OROW, "the global merge stages every split's (m, l) in the shared O rows");
static_assert(BS % 64 == 0, "BS must be a multiple of 64 (64-key steps)");
static_assert(HG >= 1 && HG <= 16 && H % KVH == 0, "1..16 query heads a KV group");
static_assert(TOPK <= 32, "a selection row in one warp");
static_assert(WARPS >= 1 && WARPS <= 4, "1..4 warps a CTA (the merge's shared O is 8.25 KiB a warp)");

#include "ptx_common.cuh"

__device__ __forceinline__ float ex2(float x) {  // 2^x (ex2.approx: the softmax's exponentials)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float ld_l2(const float* p) {
  float r;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void cluster_sync() {  // every thread of every CTA of the cluster; orders smem
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_addr(const float* p, u32 rank) {  // p in CTA `rank`'s shared memory
  u32 a, r;
  asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(a) : "l"(p));
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_cluster(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
#define NEG_INF __uint_as_float(0xFF800000u)
// A merge's reference max: the parts' max, or 0 where every part is empty (-inf), so that their weights
// ex2(m - ref) are 0, not NaN.
__device__ __forceinline__ float merge_ref(float mall) { return mall == NEG_INF ? 0.f : mall; }
// The merged row's value acc / l as bf16 (0 where l = 0: a row without a visible key).
__device__ __forceinline__ void store_merged(u16* dst, float acc, float l) {
  *dst = bf16_bits(acc * (l > 0.f ? 1.f / l : 0.f));
}
__device__ __forceinline__ float pow2f(int e) { return __uint_as_float((u32)(127 + e) << 23); }  // |e| <= 126


// Two keys' 8-nibble words a (key A) and b (key B), bytes lo and lo + 1 of each (sel 0x5140: bytes 0, 1; 0x7362:
// bytes 2, 3) -> one word whose nibbles alternate A, B: A0 B0 A1 B1 A2 B2 A3 B3 (element order within the bytes).
__device__ __forceinline__ u32 interleave(u32 a, u32 b, u32 sel) {
  const u32 x = prmt(a, b, sel);  // bytes A0A1, B0B1, A2A3, B2B3 (nibble pairs)
  const u32 lo4 = x & 0x0F0F0F0Fu, hi4 = (x >> 4) & 0x0F0F0F0Fu;
  return prmt(lo4, hi4, 0x6240u) | (prmt(lo4, hi4, 0x7351u) << 4);
}

// V's B fragments for one k16 step: keys A, B (MMA K rows 2c, 2c + 1) or keys 2c + 8, 2c + 9; the lane's 16 dims
// 16 g .. 16 g + 15 (8 code bytes of each key: va, vb) -> out[jd] = (A's dim 16 g + jd, B's) times their scales.
__device__ __forceinline__ void v_pairs(uint2 va, uint2 vb, u32 sab, u32 (&out)[16]) {
  const u32 words[4] = {interleave(va.x, vb.x, 0x5140u), interleave(va.x, vb.x, 0x7362u),
                        interleave(va.y, vb.y, 0x5140u), interleave(va.y, vb.y, 0x7362u)};
  const u32 sp = e4m3x2_lo(sab);  // (scale A, scale B)
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    u32 p[4];
    decode8(words[w], p);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[4 * w + i] = hmul2(p[i], sp);
  }
}

// Attention of one query row t over its KV group kg's selected blocks: warp w of split sp takes the work units
// (entry u / STEPS, step u % STEPS) for u = sp WARPS + w + WORKERS i. The CTA's warps are merged through shared
// memory; out[t, kg HG + h, :] for h < HG (SPLIT == 1), else the split's (unnormalized O, m, l) merged exactly with
// the others' in the cluster or, through ws / ml, by the last split to arrive. Scores in the log2 domain:
// s = q . k * 2^e(h) * scale * log2(e).
extern "C" __global__ void __launch_bounds__(32 * WARPS) KCLUSTER
msa_attn_decode(const u16* q, const u8* kd, const u8* ks, const u8* vd, const u8* vs, const long long* sel,
                const long long* pos, const int* qsl, const int* seq, const int* bt, u16* out, float* ws, float* ml,
                unsigned int* cnt, int n_req, int bt_stride, float scale, void* scratch0, void* scratch1) {
  __shared__ float so[WARPS][16 * OROW];  // each warp's O rows (dim d at d + d / 32: conflict-free stores)
  __shared__ float sml[WARPS][32];        // each warp's m (0..15) and l (16..31) per head row
  __shared__ unsigned int s_old;
  __shared__ float cl_o[CLUSTER ? 16 * D : 1];  // this CTA's merged (O, m, l): read by the cluster's merge
  __shared__ float cl_ml[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int sp = blockIdx.x % SPLIT, tile = blockIdx.x / SPLIT, t = tile / KVH, kg = tile % KVH;
  // The row's request: how many requests end at or before t.
  int r = 0;
  for (int r0 = 0; r0 < n_req; r0 += 32) {
    const bool ends = r0 + lane < n_req && qsl[r0 + lane + 1] <= t;
    r += __popc(__ballot_sync(0xffffffffu, ends));
  }
  const bool pad = r >= n_req;  // a row past query_start_loc[R] (a padded batch): no visible key, zeros out
  r = pad ? n_req - 1 : r;
  const long long p_t = pos[t];
  const int s_len = seq[r];
  const long long last = pad ? -1 : min(p_t, (long long)s_len - 1);  // last visible key
  const int n_blocks = (s_len + BS - 1) / BS;
  // The selection row: lane i holds entry i; duplicates count once (only the first is kept).
  long long sel_v = lane < TOPK ? sel[(long)tile * TOPK + lane] : -2 - lane;
  const u32 same = __match_any_sync(0xffffffffu, sel_v);
  const bool keep = lane < TOPK && sel_v >= 0 && sel_v < n_blocks && sel_v * BS <= last &&
                    (same & ((1u << lane) - 1u)) == 0u;
  const u32 kept = __ballot_sync(0xffffffffu, keep);
  // Q: heads g, g + 8 of the group (rows past HG zero), dims 32 c .. 32 c + 31 as f16 x 2^-e(head).
  u32 qa[8][4];
  float fr[2];  // per row (head g, g + 8): 2^e * scale * log2(e)
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int h = g + 8 * hh;
    const bool ok = h < HG;
    float x[32];
    float m = 0.f;
    load_bf16x32(q + ((long)t * H + kg * HG + (ok ? h : 0)) * D + 32 * c, ok, x);
#pragma unroll
    for (int i = 0; i < 32; ++i) m = fmaxf(m, fabsf(x[i]));  // bf16 q: finite inputs (the model's)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const int e = max(-126, min(126, staging_exp(m)));
    const float down = pow2f(-e);
    fr[hh] = pow2f(e) * scale * 1.4426950408889634f;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      qa[s][hh] = f32x2_to_f16x2(x[4 * s] * down, x[4 * s + 1] * down);          // a0 / a1: dims 32c + 4s, + 1
      qa[s][2 + hh] = f32x2_to_f16x2(x[4 * s + 2] * down, x[4 * s + 3] * down);  // a2 / a3: + 2, + 3
    }
  }
  float o[16][4];
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float mrow[2] = {NEG_INF, NEG_INF}, lrow[2] = {0.f, 0.f};
  const int* bt_row = bt + (long)r * bt_stride;
  const int me = sp * WARPS + wid;
  for (int i = 0; i < PER; ++i) {
    const int u = me + WORKERS * i;
    if (u >= UNITS) break;
    const int idx = u / STEPS, st = u % STEPS;
    if (!((kept >> idx) & 1u)) continue;
    const long long b = __shfl_sync(0xffffffffu, sel_v, idx);
    const long long first = b * BS + st * 64;
    if (first > last) continue;
    const long phys = bt_row[b];
    {
      const long row0 = (phys * BS + st * 64) * KVH + kg;  // cache row of the step's key 0
      // S = Q . K^T over the step's 64 keys: 8 n8 tiles (keys 8 j + g for this lane's B column).
      // V for the whole step first (its addresses do not depend on P): one DRAM round trip per step, not two.
      // k16 step kk, keys 16 kk + 2c (+1) and + 8 (+9); keys past `last` read as zeros (the cache may hold NaN).
      uint2 v[4][4];
      u32 vsc[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) {
          const int key = 16 * kk + 2 * c + (q4 & 1) + 8 * (q4 >> 1);
          const long vrow = row0 + (long)key * KVH;
          const bool vis = first + key <= last;
          v[kk][q4] = vis ? ld_stream2(vd + vrow * (D / 2) + 8 * g) : make_uint2(0u, 0u);
          vsc[kk][q4] = vis ? (u32)vs[vrow * (D / 16) + g] : 0u;
        }
      }
      float s[8][4];
#if LOADFENCE
      uint4 kcs[8];
      u32 kscs[8];
      u32 z = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const long krow = row0 + (long)(8 * j + g) * KVH;
        kcs[j] = ld_stream4(kd + krow * (D / 2) + 16 * c);
        kscs[j] = *(const u16*)(ks + krow * (D / 16) + 2 * c);
      }
      // A branch on every loaded word (never taken: n_req > 0) keeps ptxas from sinking any of the step's loads
      // past the first MMA: the step waits for one DRAM round trip, not one per late load.
#pragma unroll
      for (int j = 0; j < 8; ++j) z ^= kcs[j].x ^ kcs[j].y ^ kcs[j].z ^ kcs[j].w ^ kscs[j];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) z ^= v[kk][q4].x ^ v[kk][q4].y ^ vsc[kk][q4];
      if (n_req < 0) out[0] = (u16)z;
#endif
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#if LOADFENCE
        const uint4 kc = kcs[j];
        const u32 ksc = kscs[j];
#else
        const long krow = row0 + (long)(8 * j + g) * KVH;
        const uint4 kc = ld_stream4(kd + krow * (D / 2) + 16 * c);
        const u32 ksc = *(const u16*)(ks + krow * (D / 16) + 2 * c);
#endif
        const u32 s0 = scale_pair(ksc, 0), s1 = scale_pair(ksc, 1);
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        const u32 kw[4] = {kc.x, kc.y, kc.z, kc.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          u32 p[4];
          decode8(kw[w], p);
          const u32 sc = w < 2 ? s0 : s1;
#pragma unroll
          for (int e = 0; e < 2; ++e)
            mma(s[j], qa[2 * w + e][0], qa[2 * w + e][1], qa[2 * w + e][2], qa[2 * w + e][3], hmul2(p[2 * e], sc),
                hmul2(p[2 * e + 1], sc));
        }
      }
      // Mask the keys past `last`, scale, online softmax per row (head g: s[.][0..1], head g + 8: s[.][2..3]).
      float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const long long kp = first + 8 * j + 2 * c + (k & 1);
          s[j][k] = kp <= last ? s[j][k] * fr[k >> 1] : NEG_INF;
          mx[k >> 1] = fmaxf(mx[k >> 1], s[j][k]);
        }
      }
      float alpha[2], mnew[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        mnew[hh] = fmaxf(mrow[hh], mx[hh]);  // > -inf: the step has a visible key
        alpha[hh] = ex2(mrow[hh] - mnew[hh]);  // 0 on the first step (-inf)
        mrow[hh] = mnew[hh];
        lrow[hh] *= alpha[hh];
      }
#pragma unroll
      for (int jd = 0; jd < 16; ++jd) {
        o[jd][0] *= alpha[0], o[jd][1] *= alpha[0], o[jd][2] *= alpha[1], o[jd][3] *= alpha[1];
      }
      u32 pa[4][4];  // P as the A fragments of 4 k16 steps (keys 16 kk .. 16 kk + 15)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float p[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          p[k] = ex2(s[j][k] - mnew[k >> 1]);  // 0 for masked keys
          lrow[k >> 1] += p[k];
        }
        pa[j >> 1][(j & 1) * 2] = f32x2_to_f16x2(p[0], p[1]);      // row g: a0 (even j) / a2 (odd j)
        pa[j >> 1][(j & 1) * 2 + 1] = f32x2_to_f16x2(p[2], p[3]);  // row g + 8: a1 / a3
      }
      // O += P . V: per k16 step, keys 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1); 16 n8 tiles of output dims,
      // tile jd's column g = dim 16 g + jd (V loaded above).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        u32 b0[16], b1[16];
        v_pairs(v[kk][0], v[kk][1], vsc[kk][0] | (vsc[kk][1] << 8), b0);
        v_pairs(v[kk][2], v[kk][3], vsc[kk][2] | (vsc[kk][3] << 8), b1);
#pragma unroll
        for (int jd = 0; jd < 16; ++jd) mma(o[jd], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0[jd], b1[jd]);
      }
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    lrow[hh] += __shfl_xor_sync(0xffffffffu, lrow[hh], 1);
    lrow[hh] += __shfl_xor_sync(0xffffffffu, lrow[hh], 2);
  }
  // Lane (g, c) holds O rows g (o[.][0..1]) and g + 8 (o[.][2..3]), dims 16 (2c + e) + jd.
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float* dst = so[wid] + (g + 8 * hh) * OROW;
#pragma unroll
    for (int jd = 0; jd < 16; ++jd)
#pragma unroll
      for (int e = 0; e < 2; ++e) dst[16 * (2 * c + e) + jd + c] = o[jd][2 * hh + e];  // d + d / 32, d / 32 = c
    if (c == 0) {
      sml[wid][g + 8 * hh] = mrow[hh];
      sml[wid][16 + g + 8 * hh] = lrow[hh];
    }
  }
  __syncthreads();
  // The CTA's merge (fixed warp order): thread i takes (head, dim) = (j / D, j % D) for j = i, i + 32 WARPS, ...
  const long part = (long)tile * SPLIT + sp;
  for (int j = threadIdx.x; j < HG * D; j += 32 * WARPS) {
    const int h = j / D, d = j % D;
    float mall = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mall = fmaxf(mall, sml[w][h]);
    const float mref = merge_ref(mall);
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float wt = ex2(sml[w][h] - mref);
      l += wt * sml[w][16 + h];
      acc += wt * so[w][h * OROW + d + d / 32];
    }
    if (SPLIT == 1) {
      store_merged(out + ((long)t * H + kg * HG + h) * D + d, acc, l);
    } else if (CLUSTER) {
      cl_o[h * D + d] = acc;
      if (d == 0) cl_ml[h] = mall, cl_ml[16 + h] = l;
    } else {
      ws[(part * 16 + h) * D + d] = acc;
      if (d == 0) {
        ml[part * 32 + h] = mall;
        ml[part * 32 + 16 + h] = l;
      }
    }
  }
  if (SPLIT == 1) return;
#if CLUSTER
  // Cluster merge: CTA `sp` merges heads sp, sp + SPLIT, ... from every CTA's shared memory (fixed order), then
  // a second cluster barrier keeps every CTA's shared memory alive until all of those reads are done.
  cluster_sync();
  for (int j = threadIdx.x; j < HG * D; j += 32 * WARPS) {
    const int h = j / D, d = j % D;
    if (h % SPLIT != sp) continue;
    float mk[SPLIT], lk[SPLIT], ok[SPLIT];
    float mall = NEG_INF;
#pragma unroll
    for (int k = 0; k < SPLIT; ++k) {
      mk[k] = ld_cluster(cluster_addr(cl_ml + h, k));
      lk[k] = ld_cluster(cluster_addr(cl_ml + 16 + h, k));
      ok[k] = ld_cluster(cluster_addr(cl_o + h * D + d, k));
      mall = fmaxf(mall, mk[k]);
    }
    const float mref = merge_ref(mall);
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int k = 0; k < SPLIT; ++k) {
      const float wt = ex2(mk[k] - mref);
      l += wt * lk[k];
      acc += wt * ok[k];
    }
    store_merged(out + ((long)t * H + kg * HG + h) * D + d, acc, l);
  }
  cluster_sync();
  return;
#endif
  // The last split of this (row, group) to arrive merges all of them in a fixed order. Release: the CTA's stores,
  // the barrier, then thread 0's acq_rel fence and atomic; acquire: the atomic, the fence, the barrier.
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();
    s_old = atomicAdd(cnt + tile, 1u);
    fence_acq_rel_gpu();
  }
  __syncthreads();
  if (s_old != SPLIT - 1) return;
  if (threadIdx.x == 0) cnt[tile] = 0u;
  // Every split's (m, l) into shared memory (one parallel round of L2 loads), then thread i merges dims
  // d = i % D (+ 32 WARPS ...) of every head with all of its loads unrolled: a few round trips, not one a value.
  float* sm2 = &so[0][0];  // reused: the CTA merge above is done (synced by the arrival barrier)
  for (int i = threadIdx.x; i < SPLIT * 32; i += 32 * WARPS) sm2[i] = ld_l2(ml + (long)tile * SPLIT * 32 + i);
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += 32 * WARPS) {
#pragma unroll
    for (int h = 0; h < HG; ++h) {
      float mall = NEG_INF;
#pragma unroll
      for (int k = 0; k < SPLIT; ++k) mall = fmaxf(mall, sm2[k * 32 + h]);
      const float mref = merge_ref(mall);
      float acc = 0.f, l = 0.f;
#pragma unroll
      for (int k = 0; k < SPLIT; ++k) {
        const float wt = ex2(sm2[k * 32 + h] - mref);
        l += wt * sm2[k * 32 + 16 + h];
        acc += wt * ld_l2(ws + (((long)tile * SPLIT + k) * 16 + h) * D + d);
      }
      store_merged(out + ((long)t * H + kg * HG + h) * D + d, acc, l);
    }
  }
}
