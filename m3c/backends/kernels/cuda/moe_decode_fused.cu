// The MegaMoE decode's FC1, act, FC2 and combine in ONE launch (moe_fused), after the routing launch
// (moe_route.cu) as a programmatic dependent launch. Device code and settings: moe_decode_core.cuh.
//
// Why: one launch a step (moe_decode_mma.cu) drains the GPU at each of four kernel boundaries and leaves FC2's
// weight stream idle until the last FC1 CTA is done. Here each CTA is one work item, in blockIdx order:
//   [shared FC1 | routed FC1 | shared FC2 | routed FC2]
// and the steps between meet through counters in global memory (`sync`, int32, zero at launch, zeroed again by the
// last CTA to finish, so CUDA-graph replays need nothing reset):
// - the last FC1 CTA of an expert slot (done1[slot], the shared expert's slot is n_slots) computes act for the
//   slot's (token, expert) pairs (as moe_act, bitwise) and then releases ready[slot];
// - an FC2 CTA finds its expert and tokens and asks L2 for its first weights, then waits for ready[slot];
// - the last FC2 CTA of an output row block (done2[block]: every routed slot and shared split, used or not) sums
//   that block of every token's output (as moe_combine, bitwise).
// A CTA waits only on CTAs of smaller blockIdx, which the hardware dispatched before it (CTAs are dispatched in
// blockIdx order, as single-pass scans with look-back rely on): every CTA it waits on is resident or done.
// Before grid_wait() (the routing launch finished): the shared expert's FC1 GEMV (it reads only x); nothing is
// written to global memory before it.
#include "moe_decode_core.cuh"

// act16[p, :K] = f16(SiLU(gate) * up * 2^-e(p)), amult[p] = 2^e(p) for the pairs p = pair[tok[c]], c < cnt (as
// moe_act: the same sums in the same order), by the whole CTA, one pair after another; `buf` holds K floats.
__device__ void act_pairs(const float* h, int KS, long split, int K, const Cols& cols, int ROWS, u16* act16,
                          float* amult, float* buf, float* red) {
  for (int c = 0; c < cols.cnt; ++c) {
    const int p = cols.pair[cols.tok[c]];
    const float* hp = h + (long)p * ROWS;
    float m = 0.f;
#pragma unroll 2
    for (int k = 2 * threadIdx.x; k < K; k += 2 * blockDim.x) {
      float v[2];
      switch (KS) {
        case 1: act_pair<1>(hp, split, K, k, v); break;
        case 2: act_pair<2>(hp, split, K, k, v); break;
        case 4: act_pair<4>(hp, split, K, k, v); break;
        default: act_pair<8>(hp, split, K, k, v); break;
      }
      buf[k] = v[0];
      buf[k + 1] = v[1];
      m = fmaxf(m, fmaxf(fabsf(v[0]), fabsf(v[1])));
    }
    float down, up;
    pow2_scale(block_max(m, red), down, up);  // its barriers also order buf's stores before the loads below
    for (int k = 2 * threadIdx.x; k < K; k += 2 * blockDim.x)
      *(u32*)(act16 + (long)p * ROWS / 2 + k) = f32x2_to_f16x2(buf[k] * down, buf[k + 1] * down);
    if (threadIdx.x == 0) amult[p] = up;
    __syncthreads();
  }
}

// One thread of the CTA arrives at *counter after the CTA's global stores (a barrier, then an acq_rel atomic); true
// in every thread of the CTA that arrived last of `expected`.
__device__ __forceinline__ bool arrive_last(int* counter, int expected, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) *flag = arrive(counter) == expected - 1;
  __syncthreads();
  return *flag;
}

extern "C" __global__ void FC1_BOUNDS  // FC1_MIN_CTAS holds NT = 2 to 4 CTAs an SM, as FC1
moe_fused(const void* x, const u16* x16, const float* xmult, int T, const long long* ids, const float* wts, int topk,
          int E, int n_slots, const u8* c13, const u8* s13, const float* g13, int rows, const u8* sc13,
          const u8* ss13, int srows, const u8* c2, const u8* s2, const float* g2, const u8* sc2, const u8* ss2, int H,
          int I, int S, int KSr, int KSs, int KS2s, float* h, u16* act16, float* amult, float* y, void* out, int P,
          int ROWS, int* sync, void* scratch0, void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32];
  __shared__ float mult[MAXT], down[MAXT], red[WARPS];
  __shared__ int pair[MAXT], tok[MAXT], rowof[MAXT], cnt, last;
  const int rpc = 32 * WARPS, hb = H / rpc;
  const int n1s = srows / rpc * KSs, n1r = n_slots * (rows / rpc) * KSr, n2s = S > 0 ? hb * KS2s : 0;
  int* done1 = sync + 1;  // sync[0]: CTAs finished
  int* ready = done1 + n_slots + 1;
  int* done2 = ready + n_slots + 1;
  const int id = blockIdx.x;
  const bool fc2 = id >= n1s + n1r;
  if (id >= n1s) grid_wait();  // all but the shared FC1 items read the routing
  // the item in find_block's order (routed items first, then shared) and its counters
  int item, slot, rb = 0;
  if (!fc2) {
    item = id < n1s ? n1r + id : id - n1s;
    slot = id < n1s ? n_slots : item / KSr / (rows / rpc);
  } else {
    const int i2 = id - n1s - n1r;
    item = i2 < n2s ? n_slots * hb + i2 : i2 - n2s;
    slot = i2 < n2s ? n_slots : item / hb;
    rb = i2 < n2s ? i2 / KS2s : item % hb;
  }
  Block b;
  const bool used = fc2 ? find_block(b, item, ids, T * topk, E, n_slots, H, S > 0 ? H : 0, 1, KS2s, flags)
                        : find_block(b, item, ids, T * topk, E, n_slots, rows, srows, KSr, KSs, flags);
  if (used) {
    const int K = fc2 ? (b.expert >= 0 ? I : S) : H, Kc = K / b.KS;
    const int rows_total = fc2 ? H : b.expert >= 0 ? rows : srows;
    const u8 *rc = fc2 ? c2 : c13, *rs = fc2 ? s2 : s13, *sc = fc2 ? sc2 : sc13, *ss = fc2 ? ss2 : ss13;
    prefetch_first(b, rows_total, K, Kc, rc, sc);
    find_tokens(pair, tok, &cnt, ids, T, topk, b.expert);
    u16* xs = (u16*)smem;
    if (fc2) {
      for (int c = threadIdx.x; c < cnt; c += blockDim.x) rowof[c] = pair[tok[c]];
      if (threadIdx.x == 0)
        while (!load_acquire(ready + slot)) __nanosleep(100);
      __syncthreads();
      stage_rows(act16, amult, rowof, cnt, ROWS / 2, b.ks * Kc, Kc, xs, mult);
    } else if (b.expert < 0) {  // every token: column c is token c
      stage_direct(x, T, H, b.ks * Kc, Kc, xs, mult, down);
    } else {
      stage_rows(x16, xmult, tok, cnt, H, b.ks * Kc, Kc, xs, mult);
    }
    run_cols(b, rows_total, K, Kc, Cols{pair, tok, cnt}, xs, mult, rc, rs, fc2 ? g2 : g13, sc, ss,
             fc2 && b.expert >= 0 ? wts : nullptr, fc2 ? y + (long)b.ks * P * H : h + (long)b.ks * P * ROWS,
             fc2 ? H : ROWS);
  }
  if (fc2) {  // every FC2 item of the row block arrives, used or not
    if (arrive_last(done2 + rb, n_slots + (S > 0 ? KS2s : 0), &last)) {
      for (int i = threadIdx.x; i < T * rpc; i += blockDim.x) {
        const int n = i / rpc, c = rb * rpc + i % rpc;
        store_act(out, (long)n * H + c, combine_sum(y, n, c, token_valid(ids, n, topk, E), T, topk,
                                                    S > 0 ? KS2s : 0, P, H));
      }
    }
  } else if (used) {
    const int expected = b.expert >= 0 ? rows / rpc * KSr : srows / rpc * KSs;
    if (arrive_last(done1 + slot, expected, &last)) {
      act_pairs(h, b.KS, (long)P * ROWS, b.expert >= 0 ? I : S, Cols{pair, tok, cnt}, ROWS, act16, amult,
                (float*)smem, red);
      __syncthreads();
      if (threadIdx.x == 0) store_release(ready + slot, 1);
    }
  }
  if (arrive_last(sync, gridDim.x, &last)) {  // every CTA is past its last use of the counters: zero them
    for (int i = threadIdx.x; i < 1 + 2 * (n_slots + 1) + hb; i += blockDim.x) sync[i] = 0;
  }
}
