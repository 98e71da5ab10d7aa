// BALANCE (moe_cuda.BALANCE_FC1): FC1 as one wave in which every CTA carries about the same weight bytes and every SM
// the plain grid's decode mix, and act summing each row block's partials however many CTAs shared it. Included by
// moe_decode_mma.cu after fc1_item's helpers.
//
// CTA c < Gs runs the shared expert's item c exactly as fc1_item does (row block c / KSs, K split c % KSs, before
// grid_wait(): no routing needed), then A routed units; the other G - Gs CTAs share the remaining routed units
// evenly (c U / G over them). A routed unit is 128 rows x a 256-K super-chunk of a touched expert (touched experts in
// expert order, row block major, K minor); A is the whole units that bring a shared CTA's bytes up to the mean (the
// shared item's MXFP8 bytes counted as 33 / 32 of a byte a weight against 9 / 16 for NVFP4). A routed row block's
// segments go to consecutive CTAs; the i-th writes its partial i (h[i, pair, row]) and the first writes their count
// to nseg, which moe_act reads. moe_cuda.balanced_segments is the host's twin of this arithmetic.
// History (benchmarks/RESULTS.md session 35): a first version spread every unit, the shared expert's first, evenly
// over the CTAs; FC1 measured 5-7 us slower at T = 1..4, with the loads alone nearly as fast, so the likely loss was
// SMs holding only NVFP4 CTAs (about twice the SASS instructions a byte of MXFP8). This one keeps each SM's mix.
#pragma once

// FC1_BAL_PARAMS / FC1_BAL_ARGS: what fc1_balanced and its segments take: moe_fc1's arguments (FC1_OWN_*), the
// probe's tl, nseg.
#define FC1_BAL_PARAMS FC1_OWN_PARAMS TL_PARAM int *nseg
#define FC1_BAL_ARGS FC1_OWN_ARGS TL_ARG, nseg

// The routed schedule, set once by thread 0 after the routing and read back volatile each segment (held in
// registers across the GEMVs, such values spilled into their loops): units a shared CTA takes (A), shared CTAs (Gs),
// the units left for the others (R) over Go CTAs, the CTA's next and end unit, a routed expert's row blocks.
struct Plan {
  int A, Gs, R, Go, u, u1, Rr;
};

// The first routed unit of CTA c (c <= Gs + Go: the end of the last).
__device__ __forceinline__ int plan_start(const volatile Plan* p, int c) {
  return c <= p->Gs ? c * p->A : p->Gs * p->A + (c - p->Gs) * p->R / p->Go;
}

// The CTA whose routed units hold unit u: the largest c with plan_start(c) <= u among CTAs that have any.
__device__ __forceinline__ int plan_owner(const volatile Plan* p, int u) {
  const int front = p->Gs * p->A;
  if (u < front) return u / p->A;
  return p->Gs + ((u - front + 1) * p->Go - 1) / p->R;  // (the largest d with d R / Go <= u - front)
}

// The CTA's next routed segment: its row block's partial ks of KS over the K range from its next unit to the block's
// end or the CTA's; false when the CTA's units are done.
__device__ __forceinline__ bool balanced_segment(Plan* plan, const u32* flags, int* pair, int* tok, int* cnt,
                                                 u32* masks, float* mult, FC1_BAL_PARAMS) {
  extern __shared__ __align__(16) u8 smem[];
  constexpr int cta = 32 * WARPS;
  const volatile Plan* v = plan;
  const int u = v->u, u1 = v->u1, Rr = v->Rr, per = H / 256;
  if (u >= u1) return false;
  const int q = u / per, base = q * per, end = min(base + per, u1), first = plan_owner(v, base);
  Block b;
  b.expert = nth_touched(flags, E, q / Rr);
  __builtin_assume(b.expert >= 0);  // (q / Rr < the touched count)
  b.row0 = q % Rr * cta;
  b.ks = (int)blockIdx.x - first;
  b.KS = plan_owner(v, base + per - 1) - first + 1;
  b.grp = -1;
  const int k0 = (u - base) * 256, Kc = (end - u) * 256;
  __syncthreads();  // every thread has read the plan, and the previous segment's epilogue pair / tok / xs / mult
  if (threadIdx.x == 0) {
    plan->u = end;  // (read after find_tokens' barriers)
    if (u == base) nseg[b.expert * Rr + q % Rr] = b.KS;
  }
  prefetch_first(b, rows, H, Kc, rcode, scode, k0);  // (as fc1_item: L2 fetches while the tokens stage)
  find_tokens(pair, tok, cnt, masks, ids, T, topk, b.expert);
  u16* xs = (u16*)smem;
#if TIMELINE  // (the probe: a CTA's first staging, the end of its last GEMV, its bytes as NVFP4-equivalent K)
  if ((int)blockIdx.x >= v->Gs && u == plan_start(v, blockIdx.x)) STAMP(1);
  if (threadIdx.x == 0) tl[7] += Kc;
#endif
  staged([&] { stage_rows(x16, xmult, tok, *cnt, H, k0, Kc, xs, mult); },
         [&](const auto& stage) {
           run_cols(b, rows, H, Kc, Cols{pair, tok, *cnt}, xs, mult, rcode, rscale, rrow, scode, sscale, nullptr,
                    h + (long)b.ks * P * ROWS, ROWS, stage, k0);
         });
  STAMP(2);
  return true;
}

// FC1 balanced (see the top of this file). nseg: a partial count per row block, routed expert e's at e (rows / 128)
// + block, the shared expert's after the E experts'.
__device__ void fc1_balanced(FC1_BAL_PARAMS) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32], masks[WARPS];
  __shared__ float mult[MAXT], down[MAXT];
  __shared__ int pair[TMAX], tok[TMAX], cnt;
  __shared__ Plan plan;
  constexpr int cta = 32 * WARPS;
  const int c = blockIdx.x, Gs = srows / cta * KSs;
  STAMP_EXIT(c);
  MARK(-4, 0, 0);  // (-4: a balanced CTA; slot 7 sums its K, the shared item's as NVFP4-equivalent 11 / 6 of it)
  grid_launch_dependents();  // moe_act waits for all of FC1
  if (c < Gs) {  // the shared expert's item c, as fc1_item's (its GEMV before grid_wait(), inside run_tiles' wait)
    Block b;
    b.expert = -1;
    b.row0 = c / KSs * cta;
    b.ks = c % KSs;
    b.KS = KSs;
    b.grp = 0;
    const int Kc = H / KSs;
    prefetch_first(b, srows, H, Kc, rcode, scode);
    find_tokens(pair, tok, &cnt, masks, ids, T, topk, -1);
    STAMP(1);
#if TIMELINE
    if (threadIdx.x == 0) tl[7] += Kc * 11 / 6;
#endif
    u16* xs = (u16*)smem;
    staged([&] { stage_direct(x, 0, T, H, b.ks * Kc, Kc, xs, mult, down); },
           [&](const auto& stage) {
             run_cols(b, srows, H, Kc, Cols{pair, tok, cnt}, xs, mult, rcode, rscale, rrow, scode, sscale, nullptr,
                      h + (long)b.ks * P * ROWS, ROWS, stage);
           });
    STAMP(2);
    if (threadIdx.x == 0 && b.ks == 0) nseg[E * (rows / cta) + c / KSs] = KSs;
  }
  grid_wait();
  touched_flags(flags, ids, T * topk, E);  // (its first barrier: the shared item's epilogue is done with pair / tok)
  if (threadIdx.x == 0) {
    int n = 0;
    for (int w = 0; w < (E + 31) / 32; ++w) n += __popc(flags[w]);
    // (moe_cuda launches more CTAs than shared items.) Whole units a shared CTA takes so its bytes reach the mean:
    // (Ur + Gs e) / G - e, e = the shared item's bytes in routed units ((H / KSs) x 33 / 32 over 256 x 9 / 16 a row)
    const int Ur = n * (rows / cta) * (H / 256), G = gridDim.x;
    const int A = max(0, (Ur * 4608 - (G - Gs) * (H / KSs) * 33) / (G * 4608)), R = Ur - Gs * A;
    plan = Plan{A, Gs, R, min(G - Gs, max(R, 1)), 0, 0, rows / cta};  // (Go <= R: no other CTA goes empty)
    const bool runs = c < Gs + plan.Go;  // (CTAs past the Go others: none left, when R < G - Gs)
    plan.u = runs ? plan_start(&plan, c) : Ur;
    plan.u1 = runs ? plan_start(&plan, c + 1) : Ur;
  }
  __syncthreads();
  while (balanced_segment(&plan, flags, pair, tok, &cnt, masks, mult, FC1_BAL_ARGS)) {
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
    for (int e = 0; e < 2; ++e) v[2 * i + e] = silu_mul(ga[e], ua[e]);
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
  const long long e = p < routed_pairs ? ids[p] : E;  // (the shared expert's counts follow the E experts')
  const int* cnts = p >= routed_pairs || (e >= 0 && e < E) ? nseg + e * Rr : nullptr;  // (an id of E: no row there)
  float v[8];
  float m = 0.f;
  act_row_n(h + (long)p * ROWS, (long)P * ROWS, K, cnts, v, m);
  act_store(v, m, K, p, ROWS, act16, amult, red);
}
