// MegaMoE decode (1 <= T <= TMAX tokens) for sm_90: NVFP4 routed experts + MXFP8 shared expert, weights streamed
// once from a prepacked layout, decoded in registers straight into mma.sync m16n8k16 f16 A fragments (weights are
// the MMA's M, the tokens its N). Layouts and numerics: m3c/backends/kernels/moe_cuda.py. The work items:
// moe_decode_items.cuh; the weight streams and the GEMV: moe_weight_stream.cuh; the token staging:
// moe_decode_stage.cuh; the combine: moe_decode_combine.cuh.
// No system headers (only ptx_common.cuh and those): builds with a bare nvcc (PyPI). Compile-time settings: WARPS (warps per CTA), NT (the most
// 8-column MMA tiles a CTA runs at once: a CTA runs one when at most 8 tokens picked its expert; more than 8 NT run
// as column groups of 8 NT, one after another (routed) or as more CTAs (shared expert)), TMAX (tokens), ACT_BF16
// (activations bf16, else float32), DECODE (0: E2M1 -> f16 by byte lookups, 1: by lookups to E4M3 + cvt, 2: the loads
// alone, a benchmark probe), NATURAL (1: routed NVFP4 codes / scales read in their natural [E, rows, K / 2] /
// [E, rows, K / 16] layout, decoded by ptx_common's decode8; the shared MXFP8 expert stays prepacked), EARLY (1: each
// warp issues its first super-chunk's weight loads before its CTA stages the tokens: staged()), FOLD_ACT (1: no
// moe_act launch: FC1's CTAs that finish an act chunk's last partial compute it, FC2 stages from it: act_tail(),
// stage_act()), FOLD_COMBINE (1: no moe_combine launch: FC2's last CTA of each row block sums it: combine_tail()),
// PREFETCH_FC2 (n > 0: FC1's CTAs ask L2 for FC2's first n super-chunks once their GEMV is done: prefetch_fc2()),
// TIMELINE (1, a benchmark probe: FC1 and FC2 take one more argument, tl, and each CTA's thread 0 writes 8 words
// tl[blockIdx.x][:] = the %globaltimer at entry, before the staging, after the GEMV's stores, at exit; its SM, expert
// (-1 shared, -2 an unused slot), K split and K range: stamp(), mark()), TL_AT (where the second stamp goes: 0 before
// the staging, 1 after FC1's routed wait, 2 after find_block: STAMP_PRE).
// Launch order: moe_stage_x -> moe_fc1 -> moe_act -> moe_fc2 -> moe_combine (FOLD_ACT / FOLD_COMBINE: without
// moe_act / moe_combine), each after moe_stage_x launched with
// programmatic dependent launch where the host asks (moe_cuda.PDL): what a kernel does before grid_wait() (FC1's
// shared-expert items: the whole GEMV from the raw tokens; FC2: finding its expert and tokens, prefetching its
// weights, with EARLY also loading its first super-chunk, though ptxas keeps those loads before the wait only in the
// shared expert's path) overlaps the previous kernel. Before grid_wait() nothing is written to global memory, and
// of what earlier launches wrote only the routing is read, by FC2: its predecessor (moe_act, or FC1 with FOLD_ACT)
// releases FC2's launch only in CTAs past their own wait, when the routing launch has finished (FOLD_ACT's FC1 once
// released it at its start: FC2's first CTAs read the previous call's routing at T = 1).
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
#ifndef NATURAL
#define NATURAL 0  // 1: the routed NVFP4 experts in the checkpoint's own layout (no prepacked copy)
#endif
#ifndef EARLY
#define EARLY 0    // 1: each warp issues its first super-chunk's weight loads before the CTA stages its tokens
#endif
#ifndef FOLD_ACT
#define FOLD_ACT 0  // 1: act computed at the end of FC1 (act_tail) and staged by FC2 (stage_act): no moe_act launch
#endif
#ifndef FOLD_COMBINE
#define FOLD_COMBINE 0  // 1: the combine done by FC2's last CTA of each row block (combine_tail): no moe_combine launch
#endif
#ifndef PREFETCH_FC2
#define PREFETCH_FC2 0  // n > 0: each FC1 CTA asks L2 for the first n super-chunks of the FC2 items it stands for
#endif
#ifndef TIMELINE
#define TIMELINE 0
#endif
#ifndef TL_AT
#define TL_AT 0  // the TIMELINE probe's slot 1: 0 before the staging, 1 after FC1's routed wait, 2 after find_block
#endif
#define STAMP_PRE(at) \
  if (TL_AT == (at)) STAMP(1)
#ifndef ACQUIRE_LAST
#define ACQUIRE_LAST 0  // 1: the folds' arrivals release only; the last CTA of a counter alone fences (last_to_arrive)
#endif
#ifndef QUEUE
#define QUEUE 0  // 1: moe_experts, FC1's and FC2's items in one persistent launch (moe_decode_queue.cuh)
#endif
#define ROWT 2     // 16-row tiles per warp (they share the activation fragments)
// FC1 / FC2 launch bounds: at NT 1 both ask for 16 warps an SM (4 CTAs at WARPS 4; 128 registers: left to itself,
// ptxas gives FC2 129 and NATURAL's decode 130, i.e. 3 CTAs an SM); at NT 2 FC2 takes 168 (4 CTAs an SM forced: 31
// spilled words, and T = 16 measured the same, benchmarks/RESULTS.md session 21)
#if NT == 1
#define FC_BOUNDS __launch_bounds__(WARPS * 32, 16 / WARPS)
#else
#define FC_BOUNDS __launch_bounds__(WARPS * 32)
#endif
#ifdef FC1_MIN_CTAS  // FC1 CTAs an SM the compiler must fit (registers <= 64K / (32 WARPS FC1_MIN_CTAS))
#define FC1_BOUNDS __launch_bounds__(WARPS * 32, FC1_MIN_CTAS)
#else
#define FC1_BOUNDS FC_BOUNDS
#endif
#define MAXT (8 * NT)  // MMA columns a CTA runs at once (one column group)
#ifndef TMAX
#define TMAX MAXT  // tokens a launch takes (moe_cuda: 8 NT, or more for the looping builds); find_tokens compacts
#endif             // them 32 a warp
#define GROUPS ((TMAX + MAXT - 1) / MAXT)  // column groups a CTA may run (1: the loop over them is straight code)
static_assert(TMAX <= 32 * WARPS, "find_tokens compacts 32 tokens a warp");
static_assert(16 % WARPS == 0 && WARPS <= 4, "the launch bounds count 16 warps an SM");
static_assert(PREFETCH_FC2 == 0 || GROUPS == 1, "PREFETCH_FC2: the builds of one column group only");
static_assert(QUEUE == 0 || (GROUPS == 1 && FOLD_ACT && FOLD_COMBINE && !PREFETCH_FC2),
              "QUEUE: the folded builds of one column group");
// The shared expert's column groups for T tokens (a CTA each; moe_cuda's grids count them the same way).
#define SHARED_GROUPS(T) (GROUPS == 1 ? 1 : ((T) + MAXT - 1) / MAXT)

#include "ptx_common.cuh"
#include "moe_tokens.cuh"
#include "moe_decode_items.cuh"
#include "moe_weight_stream.cuh"
#include "moe_decode_combine.cuh"
#include "moe_decode_stage.cuh"

#include "moe_decode_timeline.cuh"

__device__ float block_max(float v, float* red) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = 0.f;
  for (int w = 0; w < (int)(blockDim.x >> 5); ++w) v = fmaxf(v, red[w]);
  __syncthreads();
  return v;
}

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

// SiLU(gate) * up of pair row hp at columns k, k + 1 (k < K), gate / up summed over SPL K splits (read through L2:
// with FOLD_ACT other CTAs of the same launch wrote them).
template <int SPL>
__device__ __forceinline__ void act_pair(const float* hp, long split, int K, int k, float* v) {
  float2 gv[SPL], uv[SPL];
#pragma unroll
  for (int s = 0; s < SPL; ++s) {
    gv[s] = __ldcg((const float2*)(hp + s * split + k));
    uv[s] = __ldcg((const float2*)(hp + s * split + K + k));
  }
  float gs[2] = {0.f, 0.f}, us[2] = {0.f, 0.f};
#pragma unroll
  for (int s = 0; s < SPL; ++s) {
    gs[0] += gv[s].x;
    gs[1] += gv[s].y;
    us[0] += uv[s].x;
    us[1] += uv[s].y;
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#if ACT_BF16  // the reference's bf16 model rounds gate, up, SiLU(gate) and the product to bf16
    v[e] = silu_mul_bf16(gs[e], us[e]);
#else
    v[e] = gs[e] / (1.f + expf(-gs[e])) * us[e];
#endif
  }
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
// (routed pairs p < T * topk: K = I, KSr splits; shared pairs: K = S, KSs splits; K <= 4096, splits 1, 2, 3, 4, 6 or 8).
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
    case 3: act_row<3>(hp, split, K, v, m); break;
    case 4: act_row<4>(hp, split, K, v, m); break;
    case 6: act_row<6>(hp, split, K, v, m); break;
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

// Ask L2 for the first super-chunk of the warp's code bytes (both tiles) before the staging (and, in FC2, before
// grid_wait()), so the weight stream's first latency overlaps it. (The CTA's whole K range by
// cp.async.bulk.prefetch.L2 measured 5-25% slower on the H200: benchmarks/RESULTS.md, session 18.)
__device__ __forceinline__ void prefetch_first(const Block& b, int rows_total, int K, int Kc, const u8* rcode,
                                               const u8* scode) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if NATURAL
  if (b.expert >= 0) {  // the first super-chunk (128 bytes) of each of the warp's 32 rows
    const long row = (long)b.expert * rows_total + b.row0 + warp * 32 + lane;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(rcode + row * (K / 2) + (long)b.ks * Kc / 2));
    return;
  }
#endif
  const long tile = (long)(b.row0 + warp * 32) / 16 + (b.expert >= 0 ? (long)b.expert * (rows_total / 16) : 0);
  const long tb = b.expert >= 0 ? (long)K * 8 : (long)K * 16;
  const u8* c = (b.expert >= 0 ? rcode : scode) + tile * tb + (long)b.ks * Kc * (b.expert >= 0 ? 8 : 16);
#pragma unroll
  for (int t = 0; t < ROWT; ++t)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + t * tb + lane * 64));  // 2 KB: the first super-chunk
}

// What a block's MMA columns are: column c < cnt is token tok[c], whose h / y row is pair[tok[c]].
struct Cols {
  const int* pair;
  const int* tok;
  int cnt;
};

// The warp's two row tiles over this block's K range with N 8-column tiles (cnt <= 8 N; stage() stages them into
// xs / mult, see gemv), then (after grid_wait(): FC1's shared-expert items reach it first here) out[p, row] = acc *
// 2^e * row factor * weight.
template <int N, class Stage>
__device__ __forceinline__ void run_tiles(const Block& b, int rows_total, int K, int Kc, const Cols& cols,
                                          const u16* xs, const float* mult, const u8* rcode, const u8* rscale,
                                          const float* rrow, const u8* scode, const u8* sscale, const float* wts,
                                          float* out, long out_stride, const Stage& stage) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, j = lane & 3;
  const int row = b.row0 + warp * 32;  // first row of the warp's tiles
  const int cnt = cols.cnt;
  float acc[ROWT][N][4];
#pragma unroll
  for (int t = 0; t < ROWT; ++t)
#pragma unroll
    for (int nt = 0; nt < N; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][nt][i] = 0.f;
  const long tile = (long)row / 16 + (b.expert >= 0 ? (long)b.expert * (rows_total / 16) : 0);
#if NATURAL  // (compiled only where it runs)
  if (b.expert >= 0) {  // natural codes [E, rows, K / 2] and scales [E, rows, K / 16]
    const long r0 = (long)b.expert * rows_total + row + g;
    const u8* c = rcode + r0 * (K / 2) + (long)b.ks * Kc / 2 + 16 * j;
    const u8* s = rscale + r0 * (K / 16) + (long)b.ks * Kc / 16 + 2 * j;
    gemv<N>(Nvfp4NaturalStream{c, s, K / 2, K / 16}, Kc / 256, xs, Kc, cnt, acc, stage);
  } else
#endif
  if (b.expert >= 0) {  // prepacked codes (16 rows x K / 2 bytes a tile) and scales (K bytes a tile)
    const long tb = (long)K * 8, tsb = (long)K;
    const u8* c = rcode + tile * tb + (long)b.ks * Kc * 8 + lane * 16;
    const u8* s = rscale + tile * tsb + (long)b.ks * Kc + lane * 8;
    gemv<N>(Nvfp4Stream{c, s, tb, tsb}, Kc / 256, xs, Kc, cnt, acc, stage);
  } else {              // prepacked codes (16 rows x K bytes a tile), scales in their natural [rows, K / 32] layout
    const long tb = (long)K * 16, tsb = (long)K * 16 / 32;
    const u8* c = scode + tile * tb + (long)b.ks * Kc * 16 + lane * 16;
    const u8* s = sscale + (long)(row + g) * (K / 32) + (long)b.ks * Kc / 32;
    gemv<N>(Mxfp8Stream{c, s, tb, tsb, K / 32}, Kc / 128, xs, Kc, cnt, acc, stage);
  }
  grid_wait();
  // every load before the first store: out might alias rrow / wts for the compiler, so each store ordered the next
  // load after it (a dependent L2 round trip an output element; moe_prefill_ws's FC2 lost ~30% to it, RESULTS.md
  // session 29; loading first cut the decode 2-4%, session 30). Bitwise the earlier order's output.
  float f[ROWT][4], w[N][2], m[N][2];
  int pr[N][2];
#pragma unroll
  for (int t = 0; t < ROWT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      f[t][i] = b.expert >= 0 ? rrow[(long)b.expert * rows_total + row + 16 * t + g + (i >= 2 ? 8 : 0)] : 1.f;
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = 8 * nt + 2 * j + u;
      pr[nt][u] = c < cnt ? cols.pair[cols.tok[c]] : 0;
      w[nt][u] = wts && c < cnt ? wts[pr[nt][u]] : 1.f;
      m[nt][u] = c < cnt ? mult[c] : 0.f;  // (in registers too: the NT = 2 looping FC2 spilled without)
    }
#pragma unroll
  for (int t = 0; t < ROWT; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int nt = 0; nt < N; ++nt) {
        const int c = 8 * nt + 2 * j + (i & 1);
        if (c < cnt)
          out[(long)pr[nt][i & 1] * out_stride + row + 16 * t + g + (i >= 2 ? 8 : 0)] =
              acc[t][nt][i] * m[nt][i & 1] * f[t][i] * w[nt][i & 1];
      }
}

// run_tiles with the fewest 8-column tiles that hold the block's cnt columns (1 or NT).
template <class Stage>
__device__ __forceinline__ void run_cols(const Block& b, int rows_total, int K, int Kc, const Cols& cols,
                                         const u16* xs, const float* mult, const u8* rcode, const u8* rscale,
                                         const float* rrow, const u8* scode, const u8* sscale, const float* wts,
                                         float* out, long out_stride, const Stage& stage) {
#if NT > 1
  if (cols.cnt > 8) {
    run_tiles<NT>(b, rows_total, K, Kc, cols, xs, mult, rcode, rscale, rrow, scode, sscale, wts, out, out_stride,
                  stage);
    return;
  }
#endif
  run_tiles<1>(b, rows_total, K, Kc, cols, xs, mult, rcode, rscale, rrow, scode, sscale, wts, out, out_stride,
               stage);
}

#if FOLD_ACT
// FC1's act tail (FOLD_ACT): what a CTA needs after its GEMV, kept in shared memory across it (in registers it
// would cost the GEMV): the counter of its act chunk, the chunk's first column k0, K (I or S), FC1's K splits and
// its compacted columns [c0, c0 + n).
struct ActTail {
  int* counter;
  int k0, K, KS, c0, n;
#if QUEUE
  int* ready;  // the act-readiness counter of the chunk's expert or shared column group (wait_ready)
#endif
};

// Set by one thread before the staging (whose barrier publishes it). A block of rows [row0, row0 + 32 WARPS) of the
// gate rows [0, K) or the up rows [K, 2K) adds to act columns k0 = row0 mod K .. k0 + 32 WARPS - 1; that chunk's
// counter (routed expert e's chunks at e CHM, the shared expert's column group grp at (E + grp) CHM; CHM =
// max(I, S) / (32 WARPS)) expects the gate and the up block of every K split.
__device__ __forceinline__ void put_tail(ActTail* at, const Block& b, int K, int E, int chm, int* counters, int c0,
                                         int n, int* ready = nullptr) {
  if (threadIdx.x == 0) {
    const int k0 = b.row0 < K ? b.row0 : b.row0 - K, who = counter_row(b, E);
    at->counter = counters + (long)who * chm + k0 / (32 * WARPS);
#if QUEUE
    at->ready = ready + who;
#endif
    at->k0 = k0;
    at->K = K;
    at->KS = b.KS;
    at->c0 = c0;
    at->n = n;
  }
}

template <int SPL>
__device__ void act_chunk(const volatile ActTail* at, const int* pair, const int* tok, const float* h, long split,
                          int ROWS, void* act) {
  constexpr int PAIRS = 16 * WARPS;  // value pairs a chunk
  const int k0 = at->k0, K = at->K, c0 = at->c0, n = at->n;
  for (int i = threadIdx.x; i < n * PAIRS; i += blockDim.x) {
    const int c = i / PAIRS, k = k0 + 2 * (i - c * PAIRS);
    const int p = pair[tok[c0 + c]];
    float v[2];
    act_pair<SPL>(h + (long)p * ROWS, split, K, k, v);
#if ACT_BF16  // (v is a bf16 value already: exact)
    *(u32*)((u16*)act + (long)p * (ROWS / 2) + k) = (u32)bf16_bits(v[0]) | ((u32)bf16_bits(v[1]) << 16);
#else
    *(float2*)((float*)act + (long)p * (ROWS / 2) + k) = make_float2(v[0], v[1]);
#endif
  }
}

// The CTA that writes the last partial of its act chunk (last_to_arrive) computes the chunk: act[p, k0 .. k0 + 32
// WARPS) = SiLU(gate) * up (moe_act's act_pair: the splits summed in order, bf16-rounded as the reference) for the
// pairs p of its columns. The values go to FC2 unscaled (bf16 or float32 as the tokens): each FC2 CTA finds the
// row's f16 scale itself (stage_act), which no CTA here sees whole.
__device__ void act_tail(const ActTail* at, const int* pair, const int* tok, const float* h, long split, int ROWS,
                         void* act, int* flag) {
  const volatile ActTail* v = at;
  grid_launch_dependents();  // (every CTA has waited by now: see moe_fc1)
  if (!last_to_arrive<ACQUIRE_LAST>(v->counter, 2 * v->KS, flag)) return;
  switch (v->KS) {
    case 1: act_chunk<1>(v, pair, tok, h, split, ROWS, act); break;
    case 2: act_chunk<2>(v, pair, tok, h, split, ROWS, act); break;
    case 3: act_chunk<3>(v, pair, tok, h, split, ROWS, act); break;
    case 4: act_chunk<4>(v, pair, tok, h, split, ROWS, act); break;
    case 6: act_chunk<6>(v, pair, tok, h, split, ROWS, act); break;
    default: act_chunk<8>(v, pair, tok, h, split, ROWS, act); break;
  }
#if QUEUE  // the chunk is written: one more of its expert's chunks ready (release: the barrier orders the CTA's stores)
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // (as cooperative groups' grid sync: the other threads' stores, ordered by the barrier)
    release_add(v->ready);
  }
#endif
}
#endif

#if QUEUE
// FC2's wait for its act (moe_experts, instead of grid_wait()): thread 0 spins until every act chunk of the block's
// expert (I / (32 WARPS)) or shared column group (S / (32 WARPS)) is ready, then counts the block as consumed; the
// last of the group's FC2 blocks (H / (32 WARPS) routed, that times KSs shared) zeroes both counters for the next
// launch. An FC2 item is drawn only once every FC1 item is claimed by a running CTA (moe_decode_queue.cuh), and FC1
// items wait on nothing, so the spin ends (no cooperative launch needed).
__device__ void wait_ready(const Block& b, int E, int I, int S, int H, int KSs, int* ready, int* consumed) {
  if (threadIdx.x == 0) {
    const int who = counter_row(b, E);
    const int chunks = (b.expert >= 0 ? I : S) / (32 * WARPS), blocks = H / (32 * WARPS) * (b.expert >= 0 ? 1 : KSs);
    while (ld_relaxed(ready + who) < chunks) __nanosleep(64);
    fence_acq_rel_gpu();
    if (atomicAdd(consumed + who, 1) == blocks - 1) {
      *(volatile int*)(consumed + who) = 0;
      *(volatile int*)(ready + who) = 0;
    }
  }
  __syncthreads();
}
#endif

#if PREFETCH_FC2
// FC2's weights for the FC2 items this FC1 CTA stands for, asked of L2 once its GEMV is done (PREFETCH_FC2
// super-chunks of each warp's tiles, codes and scales), so FC2's first loads hit L2: HBM reads them while FC1's last
// CTAs finish and FC2 launches, when it would idle. FC1 item j1 of its expert's n1 (the shared expert: of a column
// group's) stands for FC2 items [j1 n2 / n1, (j1 + 1) n2 / n1) of the same expert's n2, so each FC2 item is asked
// for once (the shared expert's once a column group). `pb`: the CTA's block, kept in shared memory across the GEMV.
__device__ void prefetch_fc2(const Block* pb, int I, int S, int H, int KS2s, const u8* rcode2, const u8* rscale2,
                             const u8* scode2, const u8* sscale2) {
  const volatile Block* v = pb;
  const int expert = v->expert, cta = 32 * WARPS, KS2 = expert >= 0 ? 1 : KS2s, K = expert >= 0 ? I : S;
  const int n1 = 2 * K / cta * v->KS, j1 = v->row0 / cta * v->KS + v->ks, n2 = H / cta * KS2;
  for (int j2 = j1 * n2 / n1; j2 < (j1 + 1) * n2 / n1; ++j2)
    prefetch_block(expert, j2 / KS2 * cta, j2 % KS2, KS2, H, K, PREFETCH_FC2, rcode2, rscale2, scode2, sscale2);
}
#endif

// FC1: h[ks, p, r] = partial (over K split ks) of W13[e, r] . x[n] for every routed pair / shared row p. The shared
// expert's items come first in the grid and run their GEMV before grid_wait() (during the routing launch), staging
// the tokens from x themselves; the routed items wait first (they read the routing and its staged tokens) and stage
// only the tokens that picked their expert. With FOLD_ACT each CTA then arrives at its act chunk's counter, the last
// one computing the chunk (act_tail).
// FC1_PARAMS / FC1_ARGS: moe_fc1's arguments (fc1_item's after the item), as declared and as passed on; FC1_OWN_*:
// the same without the probe's tl (moe_experts takes FC1's, then FC2's, then tl).
#if FOLD_ACT
#define FC1_FOLD_PARAMS void *act, int *counters,
#define FC1_FOLD_ARGS , act, counters
#else
#define FC1_FOLD_PARAMS
#define FC1_FOLD_ARGS
#endif
#if PREFETCH_FC2  // (FC2's weights, split)
#define FC1_PF_PARAMS const u8 *rcode2, const u8 *rscale2, const u8 *scode2, const u8 *sscale2, int KS2s,
#define FC1_PF_ARGS , rcode2, rscale2, scode2, sscale2, KS2s
#else
#define FC1_PF_PARAMS
#define FC1_PF_ARGS
#endif
#define FC1_OWN_PARAMS                                                                                          \
  const void *x, const u16 *x16, const float *xmult, int T, const long long *ids, int topk, int E, int n_slots, \
      const u8 *rcode, const u8 *rscale, const float *rrow, int rows, const u8 *scode, const u8 *sscale,       \
      int srows, int H, int KSr, int KSs, float *h, int P, int ROWS, FC1_FOLD_PARAMS FC1_PF_PARAMS
#define FC1_OWN_ARGS                                                                                              \
  x, x16, xmult, T, ids, topk, E, n_slots, rcode, rscale, rrow, rows, scode, sscale, srows, H, KSr, KSs, h, P, ROWS \
      FC1_FOLD_ARGS FC1_PF_ARGS
#define FC1_PARAMS FC1_OWN_PARAMS TL_PARAM
#define FC1_ARGS FC1_OWN_ARGS TL_ARG

// FC1's grid item `idx` (moe_fc1: its CTA's blockIdx.x; moe_experts: a ticket). QUEUE: `ready`, the act-readiness
// counters (act_tail).
__device__ __forceinline__ void fc1_item(int idx, FC1_PARAMS int* ready = nullptr) {
  STAMP_EXIT(idx);
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32], masks[WARPS];
  __shared__ short sid[SID_CAP];
  __shared__ float mult[MAXT], down[MAXT];
  __shared__ int pair[TMAX], tok[TMAX], cnt;
  __shared__ Groups gs;
#if PREFETCH_FC2
  __shared__ Block pfb;
#endif
#if FOLD_ACT
  __shared__ ActTail tail;
  __shared__ int is_last;
  const int chm = max(rows, srows) / 2 / (32 * WARPS);
#endif
  const int shared_items = srows / (32 * WARPS) * KSs * SHARED_GROUPS(T);
  const int routed_items = n_slots * (rows / (32 * WARPS)) * KSr;
  const bool shared = idx < shared_items;
  const int item = shared_first(idx, shared_items, routed_items);
#if FOLD_ACT
  // FC2 follows at once and reads the routing before its grid_wait(), so it may launch only once the routing launch
  // has finished: each CTA releases it after a wait (the shared-expert items in act_tail, after their GEMV)
  if (!shared) {
    grid_wait();
    grid_launch_dependents();
  }
#else
  grid_launch_dependents();  // moe_act waits for all of FC1 (and FC2 launches only after act's wait)
  if (!shared) grid_wait();
#endif
  STAMP_PRE(1);
  Block b;
  const bool found = find_block(b, item, ids, T, topk, E, n_slots, rows, srows, KSr, KSs, flags, sid);
  MARK(b.expert, b.ks, H / b.KS);
  STAMP_PRE(2);
  if (!found) return;
  const int Kc = H / b.KS;
  prefetch_first(b, b.expert >= 0 ? rows : srows, H, Kc, rcode, scode);
  find_tokens(pair, tok, &cnt, masks, ids, T, topk, b.expert, sid);
  STAMP_PRE(0);
  u16* xs = (u16*)smem;
#if GROUPS == 1
#if FOLD_ACT
  put_tail(&tail, b, (b.expert >= 0 ? rows : srows) / 2, E, chm, counters, 0, cnt, ready);
#endif
#if PREFETCH_FC2
  if (threadIdx.x == 0) pfb = b;  // (the staging's barrier publishes it)
#endif
  staged(
      [&] {
        if (shared) {
          stage_direct(x, 0, T, H, b.ks * Kc, Kc, xs, mult, down);
        } else {
          stage_rows(x16, xmult, tok, cnt, H, b.ks * Kc, Kc, xs, mult);
        }
      },
      [&](const auto& stage) {
        run_cols(b, b.expert >= 0 ? rows : srows, H, Kc, Cols{pair, tok, cnt}, xs, mult, rcode, rscale, rrow, scode,
                 sscale, nullptr, h + (long)b.ks * P * ROWS, ROWS, stage);
      });
  STAMP(2);
#if PREFETCH_FC2
  prefetch_fc2(&pfb, rows / 2, srows / 2, H, KS2s, rcode2, rscale2, scode2, sscale2);
#endif
#if FOLD_ACT
  act_tail(&tail, pair, tok, h, (long)P * ROWS, ROWS, act, &is_last);
#endif
#else
  if (shared) {  // its one column group (tokens MAXT grp ..), as straight code: the expert known to be the shared one
    Block g = b;
    g.expert = -1;
    const int c0 = g.grp * MAXT, n = min(MAXT, T - c0);
#if FOLD_ACT
    put_tail(&tail, g, srows / 2, E, chm, counters, c0, n);
#endif
    staged([&] { stage_direct(x, c0, n, H, g.ks * Kc, Kc, xs, mult, down); }, [&](const auto& stage) {
      run_cols(g, srows, H, Kc, Cols{pair, tok + c0, n}, xs, mult, rcode, rscale, rrow, scode, sscale, nullptr,
               h + (long)g.ks * P * ROWS, ROWS, stage);
    });
    STAMP(2);
#if FOLD_ACT
    act_tail(&tail, pair, tok, h, (long)P * ROWS, ROWS, act, &is_last);
#endif
    return;
  }
#if FOLD_ACT
  put_tail(&tail, b, rows / 2, E, chm, counters, 0, cnt);
#endif
  for_groups(&gs, b, cnt, [&](const Block& g, int c0, int n) {  // a routed expert's groups in turn
    __builtin_assume(g.expert >= 0);
    const int kc = H / g.KS;
    staged([&] { stage_rows(x16, xmult, tok + c0, n, H, g.ks * kc, kc, xs, mult); }, [&](const auto& stage) {
      run_cols(g, rows, H, kc, Cols{pair, tok + c0, n}, xs, mult, rcode, rscale, rrow, scode, sscale, nullptr,
               h + (long)g.ks * P * ROWS, ROWS, stage);
    });
  });
  STAMP(2);
#if FOLD_ACT
  act_tail(&tail, pair, tok, h, (long)P * ROWS, ROWS, act, &is_last);
#endif
#endif
}

extern "C" __global__ void FC1_BOUNDS moe_fc1(FC1_PARAMS void* scratch0, void* scratch1) {
  fc1_item(blockIdx.x, FC1_ARGS);
}

// FC2: y[ks, p, r] = weight(p) * W2[e, r] . act16(p) (partial over K split ks: routed KSr = 1, shared KSs; FOLD_ACT:
// act staged by stage_act). Before
// grid_wait(): its expert, tokens and the L2 prefetch (the routing finished before FC1 passed its wait); with EARLY
// the first super-chunk's weight loads come before the staging, which waits first (it reads act16; ptxas hoists
// the wait above the routed path's loads, so only the shared expert's are issued before it).
// FC2_PARAMS / FC2_ARGS: moe_fc2's arguments (fc2_item's after the item). FOLD_ACT: act, FC1's folded act values
// (bf16 / float32 as the tokens), unscaled; FOLD_COMBINE: out, the op's output, and done, a counter per row block
// (left at zero).
#if FOLD_ACT
#define FC2_ACT_PARAMS const void *act,
#define FC2_ACT_ARGS act
#else
#define FC2_ACT_PARAMS const u16 *act16, const float *amult,
#define FC2_ACT_ARGS act16, amult
#endif
#if FOLD_COMBINE
#define FC2_FOLD_PARAMS void *out, int *done,
#define FC2_FOLD_ARGS , out, done
#else
#define FC2_FOLD_PARAMS
#define FC2_FOLD_ARGS
#endif
#define FC2_PARAMS                                                                                              \
  FC2_ACT_PARAMS int T, const long long *ids, const float *wts, int topk, int E, int n_slots, const u8 *rcode, \
      const u8 *rscale, const float *rrow, const u8 *scode, const u8 *sscale, int I, int S, int H, int KSs,    \
      int P, int ROWS, float *y, FC2_FOLD_PARAMS TL_PARAM
#define FC2_ARGS                                                                                               \
  FC2_ACT_ARGS, T, ids, wts, topk, E, n_slots, rcode, rscale, rrow, scode, sscale, I, S, H, KSs, P, ROWS, y \
      FC2_FOLD_ARGS TL_ARG

// FC2's grid item `idx` (moe_fc2: its CTA's blockIdx.x; moe_experts: a ticket less FC1's items). QUEUE: `ready` /
// `consumed`, the act-readiness counters it waits on (wait_ready) instead of grid_wait().
__device__ __forceinline__ void fc2_item(int idx, FC2_PARAMS int* ready = nullptr, int* consumed = nullptr) {
  STAMP_EXIT(idx);
  extern __shared__ __align__(16) u8 smem[];
  __shared__ u32 flags[32], masks[WARPS];
  __shared__ short sid[SID_CAP];
  __shared__ float mult[MAXT];
  __shared__ int pair[TMAX], tok[TMAX], rowof[TMAX], cnt;
  __shared__ Groups gs;
#if FOLD_COMBINE
  __shared__ int row0, is_last;  // (in shared memory across the GEMV)
  auto combine = [&] { combine_tail(row0, y, ids, E, T, topk, n_slots, KSs, S, P, H, out, done, &is_last); };
#endif
#if FOLD_ACT
  __shared__ u32 amax[MAXT];
#endif
  // the columns' act rows [k0, k0 + kc) of K into xs / mult
  auto stage_cols = [&](const int* rows_of, int n, int k, int k0, int kc) {
#if FOLD_ACT
    stage_act(act, rows_of, n, ROWS / 2, k, k0, kc, (u16*)smem, mult, amax);
#else
    stage_rows(act16, amult, rows_of, n, ROWS / 2, k0, kc, (u16*)smem, mult);
#endif
  };
#if QUEUE  // (where moe_cuda.PDL launches moe_experts programmatically, e.g. bench_moe_ab --pdl fold=moe_experts: its
           // CTA may have run only shared-expert FC1 items, which read no routing)
  grid_wait();
#endif
  STAMP_PRE(1);
  Block b;
  const bool found = find_block(b, idx, ids, T, topk, E, n_slots, H, S > 0 ? H : 0, 1, KSs, flags, sid);
  MARK(b.expert, b.ks, (b.expert >= 0 ? I : S) / b.KS);
  STAMP_PRE(2);
#if FOLD_COMBINE
  if (threadIdx.x == 0) row0 = b.row0;
  if (!found && b.expert == -2) {  // an unused routed slot arrives too (what it adds: nothing)
    grid_wait();
    // b.row0, not row0: no barrier yet orders thread 0's store before the other warps read it (they read a stale
    // block, which the last arriver would then combine in place of its own)
    combine_tail(b.row0, y, ids, E, T, topk, n_slots, KSs, S, P, H, out, done, &is_last);
  }
#endif
  if (!found) return;
  const int K = b.expert >= 0 ? I : S, Kc = K / b.KS;
  prefetch_first(b, H, K, Kc, rcode, scode);
  find_tokens(pair, tok, &cnt, masks, ids, T, topk, b.expert, sid);
  for (int c = threadIdx.x; c < cnt; c += blockDim.x) rowof[c] = pair[tok[c]];
  __syncthreads();
  STAMP_PRE(0);
  u16* xs = (u16*)smem;
#if GROUPS == 1
  staged(
      [&] {
#if QUEUE
        wait_ready(b, E, I, S, H, KSs, ready, consumed);
        STAMP(1);  // (the probe: its staging starts after the wait, so the wait counts as before staging)
#else
        grid_wait();
        grid_launch_dependents();
#endif
        stage_cols(rowof, cnt, K, b.ks * Kc, Kc);
      },
      [&](const auto& stage) {
        run_cols(b, H, K, Kc, Cols{pair, tok, cnt}, xs, mult, rcode, rscale, rrow, scode, sscale,
                 b.expert >= 0 ? wts : nullptr, y + (long)b.ks * P * H, H, stage);
      });
#else
  for_groups(&gs, b, cnt, [&](const Block& g, int c0, int n) {
    const int k = g.expert >= 0 ? I : S, kc = k / g.KS;
    staged(
        [&] {
          grid_wait();  // the first group's: later ones return at once
          grid_launch_dependents();
          stage_cols(rowof + c0, n, k, g.ks * kc, kc);
        },
        [&](const auto& stage) {
          run_cols(g, H, k, kc, Cols{pair, tok + c0, n}, xs, mult, rcode, rscale, rrow, scode, sscale,
                   g.expert >= 0 ? wts : nullptr, y + (long)g.ks * P * H, H, stage);
        });
  });
#endif
  STAMP(2);
#if FOLD_COMBINE
  combine();
#endif
}

extern "C" __global__ void FC_BOUNDS moe_fc2(FC2_PARAMS void* scratch0, void* scratch1) {
  fc2_item(blockIdx.x, FC2_ARGS);
}

// out[n, :] = combine_at over every column, a CTA row per token (the launch FOLD_COMBINE folds into FC2).
extern "C" __global__ void __launch_bounds__(256)
moe_combine(const float* y, const long long* ids, int E, int T, int topk, int KSs, int P, int H, void* out,
            void* scratch0, void* scratch1) {
  grid_wait();
  grid_launch_dependents();
  const int n = blockIdx.y;
  const bool valid = ids_valid(ids, n, topk, E);
  for (int c = blockIdx.x * 256 + threadIdx.x; c < H; c += gridDim.x * 256)
    combine_at(y, valid, n, c, T, topk, KSs, P, H, out);
}

#if QUEUE
#include "moe_decode_queue.cuh"
#endif
