// MegaMoE decode kernels, one launch a step (moe_decode_core.cuh holds their device code and settings).
// Launch order: moe_stage_x -> moe_fc1 -> moe_act -> moe_fc2 -> moe_combine, each after moe_stage_x launched with
// programmatic dependent launch where the host asks (moe_cuda.PDL): what a kernel does before grid_wait() (FC1's
// shared-expert items: the whole GEMV from the raw tokens; FC2: finding its expert and tokens, prefetching its
// weights) overlaps the previous kernel. Before grid_wait() nothing is written to global memory and nothing the
// previous two launches wrote is read (FC2 reads the routing, which finished before FC1 passed its wait).
#include "moe_decode_core.cuh"

// x16[n, :] = f16(x[n, :] * 2^-e(n)), xmult[n] = 2^e(n): one CTA per token.
extern "C" __global__ void __launch_bounds__(256)
moe_stage_x(const void* x, int H, u16* x16, float* xmult, void* scratch0, void* scratch1) {
  __shared__ float red[8];
  grid_wait();
  grid_launch_dependents();
  const int n = blockIdx.x;
  float m = 0.f;
  for (int k = threadIdx.x; k < H; k += 256) m = fmaxf(m, fabsf(load_act(x, (long)n * H + k)));
  float down, up;
  pow2_scale(block_max(m, red), down, up);
  for (int k = 2 * threadIdx.x; k < H; k += 512)
    *(u32*)(x16 + (long)n * H + k) =
        f32x2_to_f16x2(load_act(x, (long)n * H + k) * down, load_act(x, (long)n * H + k + 1) * down);
  if (threadIdx.x == 0) xmult[n] = up;
}

#define ACT_THREADS 512  // moe_act's CTA: K <= 4096 is four value pairs a thread

// One pair's activations: every load issued up front (addresses clamped inside the row, values masked after).
template <int SPL>
__device__ void act_row(const float* hp, long split, int K, float (&v)[8], float& m) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * (threadIdx.x + ACT_THREADS * i);
    act_pair<SPL>(hp, split, K, min(k, K - 2), v + 2 * i);
    if (k >= K) v[2 * i] = v[2 * i + 1] = 0.f;
    m = fmaxf(m, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
  }
}

// act16[p, :K] = f16(SiLU(gate) * up * 2^-e(p)), amult[p] = 2^e(p), gate / up summed over FC1's K splits of pair p
// (routed pairs p < T * topk: K = I, KSr splits; shared pairs: K = S, KSs splits; K <= 4096, splits 1, 2, 4 or 8).
// One CTA of 512 threads per pair; each thread keeps its (<= 4) value pairs in registers (with 256 threads and 8
// pairs a thread, T = 16 took 12 us: benchmarks/RESULTS.md, session 21).
extern "C" __global__ void __launch_bounds__(ACT_THREADS)
moe_act(const float* h, int routed_pairs, int KSr, int KSs, int P, int ROWS, int I, int S, u16* act16,
        float* amult, void* scratch0, void* scratch1) {
  __shared__ float red[ACT_THREADS / 32];
  grid_wait();
  grid_launch_dependents();  // after the wait: FC2 reads the routing before its own (see the top of the file)
  const int p = blockIdx.x;
  const int K = p < routed_pairs ? I : S, splits = p < routed_pairs ? KSr : KSs;
  const long split = (long)P * ROWS;
  const float* hp = h + (long)p * ROWS;
  float v[8];
  float m = 0.f;
  switch (splits) {
    case 1: act_row<1>(hp, split, K, v, m); break;
    case 2: act_row<2>(hp, split, K, v, m); break;
    case 4: act_row<4>(hp, split, K, v, m); break;
    default: act_row<8>(hp, split, K, v, m); break;
  }
  float down, up;
  pow2_scale(block_max(m, red), down, up);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = 2 * (threadIdx.x + ACT_THREADS * i);
    if (k < K) *(u32*)(act16 + (long)p * ROWS / 2 + k) = f32x2_to_f16x2(v[2 * i] * down, v[2 * i + 1] * down);
  }
  if (threadIdx.x == 0) amult[p] = up;
}

// FC1: h[ks, p, r] = partial (over K split ks) of W13[e, r] . x[n] for every routed pair / shared row p. The shared
// expert's items come first in the grid and run their GEMV before grid_wait() (during the routing launch), staging
// the tokens from x themselves; the routed items wait first (they read the routing and its staged tokens) and stage
// only the tokens that picked their expert.
extern "C" __global__ void FC1_BOUNDS
moe_fc1(const void* x, const u16* x16, const float* xmult, int T, const long long* ids, int topk, int E,
        int n_slots, const u8* rcode, const u8* rscale, const float* rrow, int rows, const u8* scode,
        const u8* sscale, int srows, int H, int KSr, int KSs, float* h, int P, int ROWS, void* scratch0,
        void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32];
  __shared__ float mult[MAXT], down[MAXT];
  __shared__ int pair[MAXT], tok[MAXT], cnt;
  grid_launch_dependents();  // moe_act waits for all of FC1
  const int shared_items = srows / (32 * WARPS) * KSs, routed_items = n_slots * (rows / (32 * WARPS)) * KSr;
  const bool shared = (int)blockIdx.x < shared_items;
  const int item = shared ? routed_items + blockIdx.x : blockIdx.x - shared_items;
  if (!shared) grid_wait();
  Block b;
  if (!find_block(b, item, ids, T * topk, E, n_slots, rows, srows, KSr, KSs, flags)) return;
  const int Kc = H / b.KS;
  prefetch_first(b, b.expert >= 0 ? rows : srows, H, Kc, rcode, scode);
  find_tokens(pair, tok, &cnt, ids, T, topk, b.expert);
  u16* xs = (u16*)smem;
  if (shared) {  // every token: column c is token c
    stage_direct(x, T, H, b.ks * Kc, Kc, xs, mult, down);
  } else {
    stage_rows(x16, xmult, tok, cnt, H, b.ks * Kc, Kc, xs, mult);
  }
  run_cols(b, b.expert >= 0 ? rows : srows, H, Kc, Cols{pair, tok, cnt}, xs, mult, rcode, rscale, rrow, scode,
           sscale, nullptr, h + (long)b.ks * P * ROWS, ROWS);
}

// FC2: y[ks, p, r] = weight(p) * W2[e, r] . act16(p) (partial over K split ks: routed KSr = 1, shared KSs). Before
// grid_wait(): its expert, tokens and the L2 prefetch (the routing finished before FC1 passed its wait).
extern "C" __global__ void FC_BOUNDS
moe_fc2(const u16* act16, const float* amult, int T, const long long* ids, const float* wts, int topk, int E,
        int n_slots, const u8* rcode, const u8* rscale, const float* rrow, const u8* scode, const u8* sscale, int I,
        int S, int H, int KSs, int P, int ROWS, float* y, void* scratch0, void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32];
  __shared__ float mult[MAXT];
  __shared__ int pair[MAXT], tok[MAXT], rowof[MAXT], cnt;
  Block b;
  if (!find_block(b, blockIdx.x, ids, T * topk, E, n_slots, H, S > 0 ? H : 0, 1, KSs, flags)) return;
  const int K = b.expert >= 0 ? I : S, Kc = K / b.KS;
  prefetch_first(b, H, K, Kc, rcode, scode);
  find_tokens(pair, tok, &cnt, ids, T, topk, b.expert);
  for (int c = threadIdx.x; c < cnt; c += blockDim.x) rowof[c] = pair[tok[c]];
  __syncthreads();
  grid_wait();
  grid_launch_dependents();
  u16* xs = (u16*)smem;
  stage_rows(act16, amult, rowof, cnt, ROWS / 2, b.ks * Kc, Kc, xs, mult);
  run_cols(b, H, K, Kc, Cols{pair, tok, cnt}, xs, mult, rcode, rscale, rrow, scode, sscale,
           b.expert >= 0 ? wts : nullptr, y + (long)b.ks * P * H, H);
}

// out[n, :] = sum_k y[0, n * topk + k, :] (+ sum_s y[s, T * topk + n, :] over the shared expert's KSs splits). A
// routed id outside [0, E) (what NaN router logits select) had no CTA write its row: the token's output is NaN.
// Each thread issues its column's loads 8 rows at a time before summing them in order (a load per add, one after the
// other, took 15.7 us at T = 16: benchmarks/RESULTS.md, session 21).
extern "C" __global__ void __launch_bounds__(256)
moe_combine(const float* y, const long long* ids, int E, int T, int topk, int KSs, int P, int H, void* out,
            void* scratch0, void* scratch1) {
  grid_wait();
  grid_launch_dependents();
  const int n = blockIdx.y;
  const bool valid = token_valid(ids, n, topk, E);
  for (int c = blockIdx.x * 256 + threadIdx.x; c < H; c += gridDim.x * 256) {
    store_act(out, (long)n * H + c, combine_sum(y, n, c, valid, T, topk, KSs, P, H));
  }
}
