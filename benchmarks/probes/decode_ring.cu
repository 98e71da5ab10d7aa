// A benchmark probe (benchmarks/bench_decode_ring.py), not part of the compiler: does the MegaMoE decode's weight
// stream get faster when the weights land in shared memory by bulk copies from a producer warp, several stages
// ahead, instead of each warp's two register buffers? Both kernels run the decode's own math (moe_weight_stream.cuh:
// decode_nvfp4 + mma.sync, or DECODE 2's XOR of the loaded words) on the same prepacked NVFP4 rows, a 128-row block
// and one K split a CTA, T tokens (NT column tiles); so their outputs are bitwise equal and only the loading differs.
// - probe_regs: 4 warps, each the decode's gemv over its two 16-row tiles (register double buffer).
// - probe_bulk: 4 consumer warps and a producer warp. The producer's lane 0 fills a STAGES-deep ring, each stage one
//   256-K super-chunk of the CTA's 8 tiles (codes 2 KB + scales 256 B a tile: 16 bulk copies, full[s] with
//   expect_tx); each consumer waits full[s], reads its lanes' 16-byte words (LDS), runs the same math and releases
//   the stage (empty[s], one arrival a consumer warp) after its math, or with RELEASE_EARLY as soon as the words are
//   in its registers (so a 2-stage ring keeps a stage in flight during the math).
// Defines: DECODE (0 or 2), STAGES (probe_bulk's ring depth), RELEASE_EARLY, NT (8-token MMA column tiles: the
// decode's build for T <= 8 or T <= 16 tokens; the kernels take T).
#define ROWT 2
#ifndef DECODE
#define DECODE 0
#endif
#define EARLY 0
#define WARPS 4  // (moe_decode_stage.cuh: its stage_direct, unused here, reads these two)
#define ACT_BF16 1
#ifndef NT
#define NT 1
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef RELEASE_EARLY
#define RELEASE_EARLY 0
#endif
#include "../../m3c/backends/kernels/cuda/ptx_common.cuh"
#include "../../m3c/backends/kernels/cuda/moe_weight_stream.cuh"
#include "../../m3c/backends/kernels/cuda/mbarrier.cuh"
#include "../../m3c/backends/kernels/cuda/moe_decode_stage.cuh"

#define TILE_STAGE (2048 + 256)  // a tile's super-chunk in the ring: codes, then scales
#define STAGE_BYTES (8 * TILE_STAGE)

// The T tokens' K range [ks Kc, (ks + 1) Kc) as rows 0 .. T - 1 of xs (row stride Kc + 4) by the decode's own
// staging (moe_decode_stage.cuh's stage_rows: four 16-byte loads in flight a thread, a CTA barrier at its end),
// every token's scale 1.
__device__ const float kOnes[16] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
__device__ __forceinline__ void stage_tokens(const u16* x16, int K, int k0, int Kc, int T, u16* xs) {
  __shared__ int rowof[16];
  __shared__ float mult[16];
  if (threadIdx.x < 16) rowof[threadIdx.x] = threadIdx.x;
  __syncthreads();
  stage_rows(x16, kOnes, rowof, T, K, k0, Kc, xs, mult);
}

// Column 0 of each of the NT column tiles of the warp's two tiles' results, summed (lanes j = 0 hold them: rows g
// and g + 8), into h[ks][row]: every MMA's result reaches the output.
__device__ __forceinline__ void store_col0(const float (*acc)[NT][4], float* h, int tile0, int ks, int rows) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  if ((lane & 3) == 0)
#pragma unroll
    for (int t = 0; t < ROWT; ++t) {
      float lo = acc[t][0][0], hi = acc[t][0][2];
#pragma unroll
      for (int nt = 1; nt < NT; ++nt) {
        lo += acc[t][nt][0];
        hi += acc[t][nt][2];
      }
      h[(long)ks * rows + (tile0 + t) * 16 + g] = lo;
      h[(long)ks * rows + (tile0 + t) * 16 + g + 8] = hi;
    }
}

extern "C" __global__ void __launch_bounds__(128, 4)
probe_regs(const u8* codes, const u8* scales, const u16* x16, float* h, int rows, int K, int KS, int T, void* scratch0,
           void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  u16* xs = (u16*)smem;
  const int Kc = K / KS, ks = blockIdx.x % KS, block = blockIdx.x / KS, warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31, tile0 = block * 8 + warp * ROWT;
  stage_tokens(x16, K, ks * Kc, Kc, T, xs);  // (ends in a CTA barrier)
  const long tb = (long)K * 8, tsb = K;
  const Nvfp4Stream w{codes + tile0 * tb + (long)ks * Kc * 8 + lane * 16,
                      scales + tile0 * tsb + (long)ks * Kc + lane * 8, tb, tsb};
  float acc[ROWT][NT][4] = {};
  gemv<NT>(w, Kc / 256, xs, Kc, T, acc, NoStage{});
  store_col0(acc, h, tile0, ks, rows);
}

// mbar_wait with a bound: a protocol bug traps (the launch fails at once) instead of hanging the benchmark's call.
__device__ __forceinline__ void wait_or_trap(u32 a, u32 parity) {
  for (long spins = 0; !mbar_try_wait(a, parity); ++spins)
    if (spins > (1L << 24)) __trap();
}

// Dynamic shared memory: the ring (STAGES x STAGE_BYTES), then the T token rows (Kc + 4 f16 each).
extern "C" __global__ void __launch_bounds__(160)
probe_bulk(const u8* codes, const u8* scales, const u16* x16, float* h, int rows, int K, int KS, int T, void* scratch0,
           void* scratch1) {
  extern __shared__ __align__(16) u8 smem[];
  __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
  const int Kc = K / KS, ks = blockIdx.x % KS, block = blockIdx.x / KS, warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31, nsc = Kc / 256;
  u16* xs = (u16*)(smem + STAGES * STAGE_BYTES);
  const long tb = (long)K * 8, tsb = K;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), 4);
    }
    mbar_init_fence();
  }
  __syncthreads();
  // The producer's lane 0 issues the first STAGES stages (no wait), every thread stages the token, and after the
  // barrier the producer refills each stage as the consumers release it. (Its loop must not come before that
  // barrier: with the ring full it waits on consumers that wait in the barrier for it, session 38's first run.)
  auto issue = [&](int sc) {
    const int s = sc % STAGES;
    const u32 bar = smem_u32(&full[s]), dst = smem_u32(smem + s * STAGE_BYTES);
    mbar_arrive_tx(bar, STAGE_BYTES);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const long tile = block * 8 + t;
      bulk_g2s(dst + t * TILE_STAGE, codes + tile * tb + (long)ks * Kc * 8 + sc * 2048, 2048, bar);
      bulk_g2s(dst + t * TILE_STAGE + 2048, scales + tile * tsb + (long)ks * Kc + sc * 256, 256, bar);
    }
  };
  if (warp == 4 && lane == 0)
    for (int sc = 0; sc < min(STAGES, nsc); ++sc) issue(sc);
  stage_tokens(x16, K, ks * Kc, Kc, T, xs);  // (ends in a CTA barrier)
  if (warp == 4) {
    if (lane == 0)
      for (int sc = STAGES; sc < nsc; ++sc) {
        wait_or_trap(smem_u32(&empty[sc % STAGES]), (sc / STAGES - 1) & 1);
        issue(sc);
      }
    return;
  }
  const int tile0 = block * 8 + warp * ROWT;
  const Nvfp4Stream w{nullptr, nullptr, 0, 0};  // (its math reads the registers passed to it, not its pointers)
  const u16* xrow[NT];
  token_rows<NT>(xrow, xs, Kc, T, Nvfp4Stream::k_lane * (lane & 3));
  float acc[ROWT][NT][4] = {};
  for (int sc = 0; sc < nsc; ++sc) {
    const int s = sc % STAGES;
    wait_or_trap(smem_u32(&full[s]), (sc / STAGES) & 1);
    const u8* st = smem + s * STAGE_BYTES + warp * ROWT * TILE_STAGE;
    uint4 cb[ROWT][4];
    uint2 sb[ROWT];
#pragma unroll
    for (int t = 0; t < ROWT; ++t) {
#pragma unroll
      for (int c = 0; c < 4; ++c) cb[t][c] = *(const uint4*)(st + t * TILE_STAGE + c * 512 + lane * 16);
      sb[t] = *(const uint2*)(st + t * TILE_STAGE + 2048 + lane * 8);
    }
#if RELEASE_EARLY  // the stage released once its words are in registers (the arrive's release orders the reads)
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
    math<NT>(w, cb, sb, sc, xrow, acc);
#else  // released after the math
    math<NT>(w, cb, sb, sc, xrow, acc);
    __syncwarp();
    if (lane == 0) mbar_arrive(smem_u32(&empty[s]));
#endif
  }
  store_col0(acc, h, tile0, ks, rows);
}
