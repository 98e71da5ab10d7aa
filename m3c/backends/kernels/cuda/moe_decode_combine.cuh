// The combine of the MegaMoE decode (moe_decode_mma.cu): each token's output row summed from FC2's partial rows in
// a fixed order (combine_at, used by the moe_combine launch and, with FOLD_COMBINE, by FC2's last CTA of each row
// block: combine_tail). Macros from the including file: WARPS, ACT_BF16, FOLD_COMBINE, SHARED_GROUPS(T).
#pragma once

#include "ptx_common.cuh"

// Whether every routed id of token n lies in [0, E): an id outside (what NaN router logits select) had no CTA write
// its row, so the token's output is NaN.
__device__ __forceinline__ bool ids_valid(const long long* ids, int n, int topk, int E) {
  bool valid = true;
  for (int k = 0; k < topk; ++k) {  // no short-circuit: the id loads need not wait on each other
    const long long e = ids[n * topk + k];
    valid &= e >= 0 && e < E;
  }
  return valid;
}

// out[n, c] = sum_k y[0, n * topk + k, c] (+ sum_s y[s, T * topk + n, c] over the shared expert's KSs splits), in
// that order (NaN if not `valid`). The loads go 8 rows at a time before summing them in order (a load per add, one
// after the other, took 15.7 us at T = 16: benchmarks/RESULTS.md, session 21), through L2 (FOLD_COMBINE: other CTAs
// of the same launch wrote y).
__device__ __forceinline__ void combine_at(const float* y, bool valid, int n, int c, int T, int topk, int KSs, int P,
                                           int H, void* out) {
  float s = valid ? 0.f : __uint_as_float(0x7FC00000u);
  const int rows = (valid ? topk : 0) + KSs;  // routed rows n topk + k, then the shared splits' rows
  for (int r0 = 0; r0 < rows; r0 += 8) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int r = r0 + u, k = r - (valid ? topk : 0);
      const long row = k < 0 ? (long)n * topk + r : (long)k * P + T * topk + n;
      v[u] = r < rows ? __ldcg(y + row * H + c) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (r0 + u < rows) s += v[u];
  }
#if ACT_BF16
  ((u16*)out)[(long)n * H + c] = bf16_bits(s);
#else
  ((float*)out)[(long)n * H + c] = s;
#endif
}

#if FOLD_COMBINE
// FC2's combine (FOLD_COMBINE: no moe_combine launch). Every FC2 CTA of row block row0 (each routed slot's, used or
// not, and each shared split's and column group's) arrives at the block's counter; the last one computes
// out[n, row0 .. row0 + 32 WARPS) for every token n as moe_combine does (combine_at: the same sums in the same
// order, bitwise its output).
__device__ void combine_tail(int row0, const float* y, const long long* ids, int E, int T, int topk, int n_slots,
                             int KSs, int S, int P, int H, void* out, int* done, int* flag) {
  const int shared = S > 0 ? KSs : 0;
  if (!last_to_arrive<ACQUIRE_LAST>(done + row0 / (32 * WARPS), n_slots + shared * SHARED_GROUPS(T), flag)) return;
  for (int i = threadIdx.x; i < T * 32 * WARPS; i += blockDim.x) {
    const int n = i / (32 * WARPS), c = row0 + (i - n * 32 * WARPS);
    combine_at(y, ids_valid(ids, n, topk, E), n, c, T, topk, shared, P, H, out);
  }
}
#endif
