// The MegaMoE decode's combine (moe_decode_mma.cu): out[n, c] = sum_k y[0, n topk + k, c] (+ sum_s y[s, T topk + n,
// c] over the shared expert's KSs splits), in one fixed order, NaN for a token with a routed id outside [0, E) (what
// NaN router logits select: no CTA wrote its row). Used by the moe_combine launch and, with COMBINE, by FC2's last
// arriving CTA (combine_arrive), so both give bitwise the same output. ACT_BF16 and WARPS: set by the includer.
#pragma once

#include "ptx_common.cuh"

__device__ __forceinline__ void store_out(void* out, long i, float v) {
#if ACT_BF16
  ((u16*)out)[i] = bf16_bits(v);
#else
  ((float*)out)[i] = v;
#endif
}

// Whether token n's routed ids are all in [0, E).
__device__ __forceinline__ bool ids_valid(const long long* ids, int n, int topk, int E) {
  bool ok = true;
  for (int k = 0; k < topk; ++k) {  // no short-circuit: the id loads need not wait on each other
    const long long e = ids[n * topk + k];
    ok &= e >= 0 && e < E;
  }
  return ok;
}

// The routed experts token n picked: its distinct ids in [0, E) (an expert's CTAs count a token once, whatever
// its ids repeat).
__device__ __forceinline__ int experts_of(const long long* ids, int n, int topk, int E) {
  int count = 0;
  for (int k = 0; k < topk; ++k) {
    const long long e = ids[n * topk + k];
    bool first = e >= 0 && e < E;
    for (int j = 0; j < k; ++j) first &= ids[n * topk + j] != e;
    count += first;
  }
  return count;
}

// out[n, c] as above; each thread issues its column's loads 8 rows at a time before summing them in order (a load
// per add, one after the other, took 15.7 us at T = 16: benchmarks/RESULTS.md, session 21). `Load` reads y.
template <class Load>
__device__ __forceinline__ void combine_column(const float* y, bool valid, int n, int c, int T, int topk, int KSs,
                                               int P, int H, void* out, Load load) {
  float s = valid ? 0.f : __uint_as_float(0x7FC00000u);
  const int rows = (valid ? topk : 0) + KSs;  // routed rows n topk + k, then the shared splits' rows
  for (int r0 = 0; r0 < rows; r0 += 8) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int r = r0 + u, k = r - (valid ? topk : 0);
      const long row = k < 0 ? (long)n * topk + r : (long)k * P + T * topk + n;
      v[u] = r < rows ? load(y + row * H + c) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (r0 + u < rows) s += v[u];
  }
  store_out(out, (long)n * H + c, s);
}

// COMBINE (FC2, after a column group's y rows are stored; every thread of the CTA calls it): each of the group's
// tokens tok[0 .. cnt) arrives at its counter (token, the CTA's block of 32 WARPS output rows from row0). A token's
// rows of a block come from its routed experts' CTAs (experts_of) and the shared expert's `shared` splits;
// the CTA that arrives last sums them (combine_column, reading L2), one thread a row, and leaves the counter at zero
// for the next launch. fin / nfin: cnt + 1 ints of shared scratch.
__device__ __forceinline__ void combine_arrive(int row0, const int* tok, int cnt, const float* y,
                                               const long long* ids, int E, int T, int topk, int shared, int P,
                                               int H, void* out, int* ccount, int* fin, int* nfin) {
  const int R = 32 * WARPS;
  if (threadIdx.x == 0) *nfin = 0;
  __syncthreads();  // the group's y stores before the arrivals (their release), *nfin before the claims
  for (int c = threadIdx.x; c < cnt; c += blockDim.x) {
    const int n = tok[c];
    int* ctr = ccount + (long)n * (H / R) + row0 / R;
    if (arrive(ctr) == experts_of(ids, n, topk, E) + shared - 1) {
      *(volatile int*)ctr = 0;  // every contributor has arrived: zero for the next launch
      fin[atomicAdd(nfin, 1)] = n;
    }
  }
  __syncthreads();
  const int nf = *nfin;
  for (int f = 0; f < nf; ++f) {
    const int n = fin[f];
    combine_column(y, ids_valid(ids, n, topk, E), n, row0 + (int)threadIdx.x, T, topk, shared, P, H, out, ld_cg);
  }
}

// COMBINE without a shared expert: out[n, :] = NaN for the tokens no CTA contributes to (no routed id in range),
// which combine_arrive never reaches; one CTA calls it (after grid_wait()).
__device__ __forceinline__ void combine_orphans(const long long* ids, int E, int T, int topk, int H, void* out) {
  for (int n = 0; n < T; ++n) {
    if (experts_of(ids, n, topk, E)) continue;
    for (int c = threadIdx.x; c < H; c += blockDim.x) store_out(out, (long)n * H + c, __uint_as_float(0x7FC00000u));
  }
}
