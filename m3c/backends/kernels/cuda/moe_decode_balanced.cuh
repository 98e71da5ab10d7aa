// BALANCE (moe_cuda.BALANCE_FC1): FC1 as one wave of CTAs that each stream the same number of weight units, so every
// SM carries the same bytes and its streams end together (moe_decode_mma.cu's plain grid gives some SMs three long
// CTAs and one short one, and a CTA streams at most ~8-10 GB/s: benchmarks/RESULTS.md session 34), and act summing
// each row block's partials however many CTAs shared it. Included by moe_decode_mma.cu after fc1_item's helpers.
//
// Units: 128 weight rows x one super-chunk of K (the shared expert's MXFP8: 128 K, ~16.5 KB; a routed expert's NVFP4:
// 256 K, ~18 KB), numbered shared expert first (row block major, K minor), then each touched expert in expert order
// (the same). With U units and G CTAs (G <= U), CTA c streams units [c U / G, (c + 1) U / G): a segment per row
// block it meets, each a K range of that block. A row block's segments go to consecutive CTAs; the i-th of them
// writes the block's partial i (h[i, pair, row], as a K split's) and the first also writes their count to nseg, which
// moe_act reads. moe_cuda.balanced_segments is the host's twin of this arithmetic (tests, workspace bounds).
// Off (moe_cuda.BALANCE_FC1): on the H200 FC1 measured 5-7 us slower at T = 1..4 (benchmarks/RESULTS.md, session 35).
#pragma once

// The CTA whose range holds unit u: the largest c with c U / G <= u (32-bit: moe_cuda keeps U G < 2^31).
__device__ __forceinline__ int span_owner(int u, int U, int G) { return ((u + 1) * G - 1) / U; }

// FC1_BAL_PARAMS / FC1_BAL_ARGS: what fc1_balanced and its segments take.
#define FC1_BAL_PARAMS                                                                                           \
  const void *x, const u16 *x16, const float *xmult, int T, const long long *ids, int topk, int E, const u8 *rcode, \
      const u8 *rscale, const float *rrow, int rows, const u8 *scode, const u8 *sscale, int srows, int H, float *h, \
      int P, int ROWS, int *nseg
#define FC1_BAL_ARGS x, x16, xmult, T, ids, topk, E, rcode, rscale, rrow, rows, scode, sscale, srows, H, h, P, ROWS, nseg

// The schedule (balanced_segment reads it back volatile each segment: held in registers across the GEMVs, it
// spilled into their loops): units of the shared expert, all units, the grid, the CTA's next and end unit, a routed
// expert's row blocks.
struct Plan {
  int Us, U, G, u, u1, Rr;
};

// The CTA's next segment, of the shared expert (SH) or a routed one: its row block's partial ks of KS over the K
// range from its next unit to the block's end or the CTA's; false when the CTA's units of that kind are done.
template <bool SH>
__device__ __forceinline__ bool balanced_segment(Plan* plan, const u32* flags, int* pair, int* tok, int* cnt,
                                                 u32* masks, float* mult, float* down, FC1_BAL_PARAMS) {
  extern __shared__ __align__(16) u8 smem[];
  constexpr int cta = 32 * WARPS, sck = SH ? 128 : 256;
  const volatile Plan* v = plan;
  const int Us = v->Us, U = v->U, G = v->G, u = v->u, u1 = SH ? min(v->u1, Us) : v->u1, Rr = v->Rr;
  if (u >= u1) return false;
  const int per = H / sck, q = SH ? u / per : (u - Us) / per;  // the row block (the touched experts' in order)
  const int base = SH ? q * per : Us + q * per, end = min(base + per, u1), first = span_owner(base, U, G);
  Block b;
  b.expert = SH ? -1 : nth_touched(flags, E, q / Rr);
  __builtin_assume(SH || b.expert >= 0);  // (q / Rr < the touched count: a routed segment runs the NVFP4 stream)
  b.row0 = (SH ? q : q % Rr) * cta;
  b.ks = (int)blockIdx.x - first;
  b.KS = span_owner(base + per - 1, U, G) - first + 1;
  b.grp = SH ? 0 : -1;
  const int k0 = (u - base) * sck, Kc = (end - u) * sck;
  __syncthreads();  // every thread has read the plan, and the previous segment's epilogue pair / tok / xs / mult
  if (threadIdx.x == 0) {
    plan->u = end;  // (read after find_tokens' barriers)
    if (u == base) nseg[SH ? E * Rr + q : b.expert * Rr + q % Rr] = b.KS;
  }
  prefetch_first(b, SH ? srows : rows, H, Kc, rcode, scode, k0);  // (as fc1_item: L2 fetches while tokens stage)
  find_tokens(pair, tok, cnt, masks, ids, T, topk, b.expert);
  u16* xs = (u16*)smem;
  staged(
      [&] {
        if (SH) {
          stage_direct(x, 0, T, H, k0, Kc, xs, mult, down);
        } else {
          stage_rows(x16, xmult, tok, *cnt, H, k0, Kc, xs, mult);
        }
      },
      [&](const auto& stage) {
        run_cols(b, SH ? srows : rows, H, Kc, Cols{pair, tok, *cnt}, xs, mult, rcode, rscale, rrow, scode, sscale,
                 nullptr, h + (long)b.ks * P * ROWS, ROWS, stage, k0);
      });
  return true;
}

// FC1 with the weight units balanced over the grid (see the top of this file); after grid_wait() (the unit count
// needs the routing): the CTA's shared-expert segments, then its routed ones. nseg: a count per row block, routed
// expert e's at e (rows / 128) + block, the shared expert's after the E experts'.
__device__ void fc1_balanced(FC1_BAL_PARAMS) {
  __shared__ u32 flags[32], masks[WARPS];
  __shared__ float mult[MAXT], down[MAXT];
  __shared__ int pair[TMAX], tok[TMAX], cnt;
  __shared__ Plan plan;
  grid_launch_dependents();  // moe_act waits for all of FC1
  grid_wait();
  constexpr int cta = 32 * WARPS;
  touched_flags(flags, ids, T * topk, E);
  if (threadIdx.x == 0) {
    const int c = blockIdx.x;
    int n = 0;
    for (int w = 0; w < (E + 31) / 32; ++w) n += __popc(flags[w]);
    const int Us = srows / cta * (H / 128), U = Us + n * (rows / cta) * (H / 256), G = min((int)gridDim.x, U);
    plan = Plan{Us, U, G, c < G ? c * U / G : U, c < G ? (c + 1) * U / G : U, rows / cta};
  }
  __syncthreads();
  while (balanced_segment<true>(&plan, flags, pair, tok, &cnt, masks, mult, down, FC1_BAL_ARGS)) {
  }
  while (balanced_segment<false>(&plan, flags, pair, tok, &cnt, masks, mult, down, FC1_BAL_ARGS)) {
  }
}

// act_row for BALANCE: pair row hp's gate / up partials, as many as their row blocks' counts cnts[block] say (an
// invalid routed id: one, never read), summed in partial order; then SiLU(gate) * up. The loads go out ACT_CHUNK
// partials at a time for all four value pairs of the thread at once (loads past a count add 0: exact), so a chunk
// costs one L2 latency (summed partial by partial, a load waiting on each, moe_act took ~10 us more at T = 1).
#define ACT_CHUNK 4
__device__ void act_row_n(const float* hp, long split, int K, const int* cnts, float (&v)[8], float& m) {
  int k[4], ng[4], nu[4], most = 1;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    k[i] = min(2 * (threadIdx.x + ACT_THREADS * i), K - 2);
    ng[i] = cnts ? cnts[k[i] / (32 * WARPS)] : 1;
    nu[i] = cnts ? cnts[(K + k[i]) / (32 * WARPS)] : 1;
    most = max(most, max(ng[i], nu[i]));
  }
  float2 gs[4], us[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) gs[i] = us[i] = make_float2(0.f, 0.f);
  for (int s0 = 0; s0 < most; s0 += ACT_CHUNK) {
    float2 g[4][ACT_CHUNK], u[4][ACT_CHUNK];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int s = 0; s < ACT_CHUNK; ++s) {
        const float* p = hp + (s0 + s) * split + k[i];
        g[i][s] = s0 + s < ng[i] ? __ldcg((const float2*)p) : make_float2(0.f, 0.f);
        u[i][s] = s0 + s < nu[i] ? __ldcg((const float2*)(p + K)) : make_float2(0.f, 0.f);
      }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int s = 0; s < ACT_CHUNK; ++s) {
        gs[i].x += g[i][s].x;
        gs[i].y += g[i][s].y;
        us[i].x += u[i][s].x;
        us[i].y += u[i][s].y;
      }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float ga[2] = {gs[i].x, gs[i].y}, ua[2] = {us[i].x, us[i].y};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#if ACT_BF16
      v[2 * i + e] = silu_mul_bf16(ga[e], ua[e]);
#else
      v[2 * i + e] = ga[e] / (1.f + expf(-ga[e])) * ua[e];
#endif
    }
    if (2 * (threadIdx.x + ACT_THREADS * i) >= K) v[2 * i] = v[2 * i + 1] = 0.f;
    m = fmaxf(m, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
  }
}

// moe_act for BALANCE: as moe_decode_mma.cu's, with each row block's partial count from nseg (FC1's) and the ids to
// find a routed pair's expert.
extern "C" __global__ void __launch_bounds__(ACT_THREADS)
moe_act(const float* h, int routed_pairs, int KSr, int KSs, int P, int ROWS, int I, int S, u16* act16,
        float* amult, const int* nseg, const long long* ids, int E, void* scratch0, void* scratch1) {
  __shared__ float red[ACT_THREADS / 32];
  grid_wait();
  grid_launch_dependents();  // after the wait: FC2 reads the routing before its own (see moe_decode_mma.cu's top)
  const int p = blockIdx.x, Rr = 2 * I / (32 * WARPS);
  const int K = p < routed_pairs ? I : S;
  const long long e = p < routed_pairs ? ids[p] : E;
  const int* cnts = e >= 0 && e <= E ? nseg + e * Rr : nullptr;
  float v[8];
  float m = 0.f;
  act_row_n(h + (long)p * ROWS, (long)P * ROWS, K, cnts, v, m);
  act_store(v, m, K, p, ROWS, act16, amult, red);
}
