// MegaMoE prefill grouped GEMMs for sm_90a (H100 / H200): the routed NVFP4 experts (in the decode kernels' prepacked
// layout, moe_cuda.prepack_nvfp4: one copy serves both) and the MXFP8 shared expert, decoded in registers straight
// into the A operand of wgmma (bf16, A from registers, B = the tokens from shared memory). Layouts, tiling and
// numerics: m3c/backends/kernels/moe_prefill_cuda.py. No system headers (only ptx_common.cuh): builds with a bare
// nvcc (PyPI).
//
// A CTA owns ROWS = 64 WGS weight rows (warp w: a 16-row tile, tile_of) x BT tokens of one expert (or of the shared
// expert); its K loop runs in stages of 64 K (128 K in the ROUTED_FP8 build's routed tiles): the tokens (16-byte
// cp.async per 16 bytes of a row, zero-filled past the tile's end), the prepacked codes and scales of the stage go
// through a STAGES-deep cp.async ring, and each warpgroup issues four wgmma per stage, decoding step t + 1's A
// fragments while step t runs.
// ROUTED_FP8 = 1 builds the FP8 variant of the routed tiles: the NVFP4 codes times their E4M3 scale (and 2^-wexp)
// rounded to E4M3 by per-lane byte tables (as Blackwell's QMUL4 rounds), tokens and act in E4M3 with one float32
// scale a row (moe_pf_quant), wgmma m64nBTk32 e4m3 in stages of 128 K (the same bytes a stage as the bf16 build).
// The shared expert's tiles stay bf16 in both builds.
// Launch order: [moe_pf_quant x] -> moe_pf_fc1 -> [moe_pf_quant act] -> moe_pf_fc2 -> (Triton) combine.
#ifndef ROUTED_FP8
#define ROUTED_FP8 0
#endif
#ifndef WGS
#define WGS 4       // warpgroups per CTA (64 weight rows each)
#endif
#ifndef BT
#define BT 128      // tokens per CTA (the MMA's N): 64, 128 or 256
#endif
#if ROUTED_FP8 && BT != 128 && BT != 256
#error "ROUTED_FP8 builds take BT 128 or 256 (wgmma m64n128k32 / m64n256k32)"
#endif
#ifndef STAGES
#define STAGES 5    // cp.async ring depth (stages of 128 bytes a token row; prefetch distance STAGES - 2)
#endif
#ifndef PROMOTE
#define PROMOTE 0  // ROUTED_FP8: sum each 128-K stage's E4M3 products in a fresh accumulator, then add it in float32
#endif
#ifndef INFLIGHT
#define INFLIGHT 1  // wgmma groups a warpgroup leaves in flight after each step: 1 (2 A register sets) or 2, 3 (4 sets)
#endif
#if PROMOTE && BT != 128
#error "PROMOTE builds take BT 128 (a second accumulator of BT / 2 registers)"
#endif
#ifndef LUT
#define LUT 0       // ROUTED_FP8: the E4M3 product tables looked up by scale byte in a 2 KiB shared table, built once
                    // a CTA, instead of made from each scale in the loop (4 loads for ~48 instructions a stage; the
                    // host turns it on: moe_prefill_cuda.LUT)
#endif
#ifndef CTAS
#define CTAS 1      // CTAs an SM the registers are held to (__launch_bounds__; shared memory must fit them too)
#endif
#define NSETS (INFLIGHT == 1 ? 2 : 4)
#define THREADS (WGS * 128)
#define ROWS (WGS * 64)
#define TILES (ROWS / 16)
#define KST 64
#ifndef XPAD
#define XPAD 0      // bytes between the token chunks' core-matrix runs (64: the 8 lanes of a copy phase hit 8 bank groups)
#endif
#define XLBO (BT * 16 + XPAD)  // between K-adjacent core matrices of the token tile (one 16-byte chunk of all BT rows)
#define X_BYTES (8 * XLBO)
#define W_BYTES (TILES * 1024)  // codes of a stage: NVFP4 512 B a 16-row tile, MXFP8 1 KiB
#define S_BYTES (TILES * 256)   // scales of a stage: NVFP4 the tile's 256-K super-chunk (256 B), MXFP8 32 B
#define STAGE_BYTES (X_BYTES + W_BYTES + S_BYTES)
#define ACC (BT / 2)

#include "ptx_common.cuh"
#include "wgmma_common.cuh"


__device__ __forceinline__ u32 hmul2_bf16(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 f16x2_to_bf16x2(u32 v) {  // exact for E4M3-range values
  u32 r;
  asm("{ .reg .b16 lo, hi; .reg .f32 fl, fh; mov.b32 {lo, hi}, %1; cvt.f32.f16 fl, lo; cvt.f32.f16 fh, hi; "
      "cvt.rn.bf16x2.f32 %0, fh, fl; }"
      : "=r"(r)
      : "r"(v));
  return r;
}
// One lane's NVFP4 word of a 16-K step in moe_cuda's prepacked layout (magnitudes: nibble i = rows g, g + 8 at the
// lane's K e = 0, 1 for i < 4 (i = 2 h + e), e = 2, 3 above; signs at bits 8 i + 7 / 8 i + 3) -> the four bf16x2 A
// registers times the rows' scale pairs: magnitudes by byte lookups (bf16 high and low bytes of 0, .5, 1, 1.5 | 2,
// 3, 4, 6), the sign bits OR-ed into the high bytes, the bytes paired. Exact (<= 6 significant bits).
__device__ __forceinline__ void nvfp4_frag(u32 w, u32 sg, u32 sg8, u32 (&a)[4]) {
  const u32 m = w & 0x77777777u, m16 = m >> 16;
  const u32 hl = prmt(0x3F3F3F00u, 0x40404040u, m) | (w & 0x80808080u);
  const u32 hh = prmt(0x3F3F3F00u, 0x40404040u, m16) | ((w << 4) & 0x80808080u);
  const u32 ll = prmt(0xC0800000u, 0xC0804000u, m), lh = prmt(0xC0800000u, 0xC0804000u, m16);
  a[0] = hmul2_bf16(prmt(ll, hl, 0x5140u), sg);   // row g, K e = 0, 1 (slots 2j, 2j + 1)
  a[1] = hmul2_bf16(prmt(ll, hl, 0x7362u), sg8);  // row g + 8
  a[2] = hmul2_bf16(prmt(lh, hh, 0x5140u), sg);   // row g, K e = 2, 3 (slots 2j + 8, 2j + 9)
  a[3] = hmul2_bf16(prmt(lh, hh, 0x7362u), sg8);
}
// One lane's MXFP8 bytes of a 16-K step (v.x: row g at K 2j, 2j + 1, 2j + 8, 2j + 9; v.y: row g + 8) -> the four
// bf16x2 A registers times the rows' E8M0 pairs.
__device__ __forceinline__ void mxfp8_frag(uint2 v, u32 sg, u32 sg8, u32 (&a)[4]) {
  a[0] = hmul2_bf16(f16x2_to_bf16x2(e4m3x2_lo(v.x)), sg);
  a[2] = hmul2_bf16(f16x2_to_bf16x2(e4m3x2_hi(v.x)), sg);
  a[1] = hmul2_bf16(f16x2_to_bf16x2(e4m3x2_lo(v.y)), sg8);
  a[3] = hmul2_bf16(f16x2_to_bf16x2(e4m3x2_hi(v.y)), sg8);
}
__device__ __forceinline__ u32 e8m0_pair(u32 e) {  // 2^(e - 127) as a bf16 pair (e = 0: the subnormal 2^-127)
  const u32 b = e == 0u ? 0x0040u : (e == 255u ? 0x7FC0u : e << 7);
  return b | (b << 16);
}

// d[0..32) += A (the warpgroup's 64 rows x 16 K, bf16 registers) . B (16 K x 64 tokens, shared memory).
__device__ __forceinline__ void wgmma_n64(float (&d)[32], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}


// d[0..64) += A (the warpgroup's 64 rows x 16 K, bf16 registers) . B (16 K x 128 tokens, shared memory).
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      D64_TEXT
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
      : D64_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// d[0..128) += A (the warpgroup's 64 rows x 16 K, bf16 registers) . B (16 K x 256 tokens, shared memory).
__device__ __forceinline__ void wgmma_n256(float (&d)[128], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      D128_TEXT
      "}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n}\n"
      : D128_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}


// d[0..64) += A (the warpgroup's 64 rows x 32 K, E4M3 registers) . B (32 K x 128 tokens, E4M3 in shared memory).
// `acc` = 0: d = A . B (d's old values ignored).
__device__ __forceinline__ void wgmma8_n128(float (&d)[64], const u32 (&a)[4], unsigned long long desc, int acc = 1) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      D64_TEXT
      "}, {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
      : D64_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

// d[0..128) += A (64 rows x 32 K, E4M3 registers) . B (32 K x 256 tokens, E4M3 in shared memory).
__device__ __forceinline__ void wgmma8_n256(float (&d)[128], const u32 (&a)[4], unsigned long long desc) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
      D128_TEXT
      "}, {%128,%129,%130,%131}, %132, 1, 1, 1;\n}\n"
      : D128_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#if ROUTED_FP8
// The routed E4M3 step of a BT-token tile on d[0 .. BT / 2); BT 256 with at most 128 tokens (`half`): the first
// 128 columns only (an m64n128k32 on d[0 .. 64): the accumulator's columns 8 i .. 8 i + 7 are its registers 4 i ..).
__device__ __forceinline__ void wgmma8_tile(float (&d)[BT / 2], const u32 (&a)[4], unsigned long long desc,
                                            bool half) {
#if BT == 256
  if (half)
    wgmma8_n128(*(float(*)[64])d, a, desc);
  else
    wgmma8_n256(d, a, desc);
#else
  wgmma8_n128(d, a, desc);
#endif
}
#endif

#if BT == 256
#define WGMMA wgmma_n256
#elif BT == 128
#define WGMMA wgmma_n128
#else
#define WGMMA wgmma_n64
#endif
// The bf16 step of a BT-token tile; BT 256 with at most 128 tokens (`half`): the first 128 columns only.
__device__ __forceinline__ void wgmma_tile(float (&d)[BT / 2], const u32 (&a)[4], unsigned long long desc, bool half) {
#if BT == 256
  if (half) {
    wgmma_n128(*(float(*)[64])d, a, desc);
    return;
  }
#endif
  WGMMA(d, a, desc);
}

struct Work {
  int kind;    // 0: nothing (a spare CTA), 1: shared expert, 2: routed expert
  int expert;  // routed expert id
  int p0;      // first row (sorted pair for routed, token for shared)
  int count;   // rows in this tile (<= BT)
};

// Tiles 0 .. n_sh - 1: the shared expert's tokens; then each routed expert e owns ceil(count_e / BT) tiles in
// expert order (offs: the E + 1 expert row offsets of the sorted pairs); CTAs past the last tile get kind 0.
__device__ Work find_work(const int* offs, int E, int n_sh, int T) {
  Work w;
  w.kind = 0;
  w.expert = -1;
  w.p0 = 0;
  w.count = 0;
  const int bx = blockIdx.x;
  if (bx < n_sh) {
    w.kind = 1;
    w.p0 = bx * BT;
    w.count = min(BT, T - w.p0);
    return w;
  }
  int r = bx - n_sh, base = 0;
  for (int e = 0; e < E; ++e) {
    const int lo = offs[e], hi = offs[e + 1];
    const int nt = (hi - lo + BT - 1) / BT;
    if (r < base + nt) {
      w.kind = 2;
      w.expert = e;
      w.p0 = lo + (r - base) * BT;
      w.count = min(BT, hi - w.p0);
      return w;
    }
    base += nt;
  }
  return w;
}

// Global 16-row tile of the CTA's tile t: the first TILES / 2 from tile0, the rest from tile1 (FC1: gate rows, then
// the up rows of the same columns; FC2: one run, tile1 = tile0 + TILES / 2).
__device__ __forceinline__ long tile_of(int t, long tile0, long tile1) {
  return t < TILES / 2 ? tile0 + t : tile1 + (t - TILES / 2);
}

// Mainloop modes: the routed NVFP4 tiles in bf16 (NV_BF16) or E4M3 (NV_E4M3, the ROUTED_FP8 build), the MXFP8
// shared expert's in bf16 (MX_BF16).
enum { NV_BF16 = 0, MX_BF16 = 1, NV_E4M3 = 2 };

// acc[0 .. ACC) = (this warpgroup's 64 rows of W) . (the tile's tokens)^T over K. `src` + xoff[n] (bytes) is token
// n's row (xoff[n] < 0: a row past the tile, read as zeros; bf16, or E4M3 for NV_E4M3); `code` / `scale`: the
// prepacked weights (routed NVFP4: moe_cuda's layout, K in its MMA order; shared MXFP8: moe_prefill_cuda's), whose
// 16-row tiles tile_of(t, tile0, tile1) the CTA's warps t own. A stage is 128 bytes of every token row: 64 K (bf16)
// or 128 K (E4M3); `wdec` (NV_E4M3): the f16x2 pair 2^-wexp that keeps the E4M3 products in range.
template <int MODE>
__device__ __forceinline__ void mainloop(u8* smem, const u8* src, const long long* xoff, const u8* code,
                                         const u8* scale, long tile0, long tile1, int K, u32 wdec, int count,
                                         float (&acc)[ACC]) {
  constexpr bool MX = MODE == MX_BF16, F8 = MODE == NV_E4M3;
  constexpr int CB = MODE == NV_BF16 ? 512 : 1024;  // code bytes of a tile-stage
  constexpr int SB = MX ? 32 : 256;    // scale bytes copied a tile-stage (NVFP4: the stage's whole super-chunk)
  constexpr int KS = F8 ? 2 * KST : KST;  // K a stage
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
  const int nst = K / KS;
  const long tstride = (long)nst * CB, sstride = MX ? (long)nst * SB : (long)K;
  const bool half = BT == 256 && count <= 128;  // MMAs (and token copies) of the first 128 columns only
  const u32 base = smem_u32(smem);
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i] = 0.f;
  __shared__ uint2 lut[ROUTED_FP8 && LUT ? 256 : 1];
  if (F8 && LUT) e4m3_lut_fill(lut, wdec, tid, THREADS);  // (the first stage's __syncthreads orders it)

  // This thread's copies, the same in every stage (only the K offset moves): 16-byte token chunks i = tid + THREADS q
  // (token n = (i / 2) % BT, chunk 2m + i % 2 with m = i / (2 BT): two neighbouring lanes read the two halves of one
  // 32-byte sector in one instruction), code chunk(s), one scale chunk.
  constexpr int XN = (BT * 8 + THREADS - 1) / THREADS, CN = CB / 512;
  const u8* xsrc[XN];
  u32 xdst[XN];
  int xok[XN];  // 0: no copy, 1: zero-fill (a row past the tile), 2: copy
#pragma unroll
  for (int q = 0; q < XN; ++q) {
    const int i = tid + q * THREADS, n = (i / 2) % BT, kc = 2 * (i / (2 * BT)) + (i & 1);
    const long long o = i < BT * 8 ? xoff[n] : -1;
    xsrc[q] = src + (o < 0 ? 0 : o) + 16 * kc;
    xdst[q] = kc * XLBO + (n / 8) * 128 + (n % 8) * 16;
    xok[q] = i >= BT * 8 || (half && n >= 128) ? 0 : o >= 0 ? 2 : 1;
  }
  const u8* csrc[CN];
  u32 cdst[CN];
#pragma unroll
  for (int q = 0; q < CN; ++q) {
    const int i = tid + q * THREADS, t = i / (CB / 16), c = i % (CB / 16);
    csrc[q] = code + tile_of(t, tile0, tile1) * tstride + c * 16;
    cdst[q] = X_BYTES + t * CB + c * 16;
  }
  const bool sok = tid < TILES * (SB / 16);
  const u8* ssrc = scale + tile_of(tid / (SB / 16), tile0, tile1) * sstride + (tid % (SB / 16)) * 16;
  const u32 sdst = X_BYTES + W_BYTES + (tid / (SB / 16)) * SB + (tid % (SB / 16)) * 16;

  auto issue = [&](int s) {
    if (s < nst) {
      const u32 b = base + (s % STAGES) * STAGE_BYTES;
#pragma unroll
      for (int q = 0; q < XN; ++q)
        if (xok[q]) cp16(b + xdst[q], xsrc[q] + s * 128, xok[q] == 2);
#pragma unroll
      for (int q = 0; q < CN; ++q) cp16(b + cdst[q], csrc[q] + (long)s * CB, true);
      const long so = MX ? (long)s * SB : (long)(s >> (F8 ? 1 : 2)) * SB;
      if (sok) cp16(b + sdst, ssrc + so, true);
    }
    cp_commit();  // (an empty group past the end keeps the wait counts uniform)
  };

  // Prefetch distance STAGES - 2: stage s refills the buffer of stage s - 2, whose MMAs are complete (each step
  // waits for the one before it), so a warpgroup's last MMA of a stage stays in flight across the barrier.
#pragma unroll 1
  for (int s = 0; s < STAGES - 2; ++s) issue(s);
  u32 a[NSETS][4];
#if ROUTED_FP8 && PROMOTE
  float part[ACC];  // (the stage's partial sums; NV_E4M3 only)
#endif
#pragma unroll 1
  for (int s = 0; s < nst; ++s) {
    cp_wait<STAGES - 3>();
    fence_async_smem();
    __syncthreads();  // stage s landed for every thread; every warpgroup is past stage s - 2's MMAs
    issue(s + STAGES - 2);
    const int buf = s % STAGES;
    const u32 xb = base + buf * STAGE_BYTES;
    const u8* wb = smem + buf * STAGE_BYTES + X_BYTES + warp * CB;
    const u8* sb = smem + buf * STAGE_BYTES + X_BYTES + W_BYTES + warp * SB;
    if (MODE == NV_BF16) {
      const uint4 cw = *(const uint4*)(wb + lane * 16);
      // the lane's scale group (4 c + j) of rows g, g + 8 for this stage (chunk c = s % 4 of its super-chunk)
      const u32 bs = f16x2_to_bf16x2(e4m3x2_lo(*(const u16*)(sb + lane * 8 + (s & 3) * 2)));
      const u32 sg = prmt(bs, 0u, 0x1010u), sg8 = prmt(bs, 0u, 0x3232u);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        nvfp4_frag(t == 0 ? cw.x : t == 1 ? cw.y : t == 2 ? cw.z : cw.w, sg, sg8, a[t % NSETS]);
        wg_fence();
        wgmma_tile(acc, a[t % NSETS], smem_desc(xb + 2 * t * XLBO, XLBO, 128), half);
        wg_commit();
        // step t - INFLIGHT done (this stage's or the last one's): its A registers may be rewritten
        wg_wait<INFLIGHT>(a[(t + NSETS - INFLIGHT) % NSETS]);
      }
    } else if (MODE == NV_E4M3) {
#if ROUTED_FP8
      // two 64-K chunks (c = 2 (s % 2), c + 1 of the super-chunk); k32 step t: words 2 (t % 2), 2 (t % 2) + 1 of
      // chunk t / 2 (the bf16 steps' K 4 j + e at MMA slots 4 j + e and 16 + 4 j + e: fp8_pos)
      const uint4 c0 = *(const uint4*)(wb + lane * 16), c1 = *(const uint4*)(wb + 512 + lane * 16);
      const u32 sw = *(const u32*)(sb + lane * 8 + (s & 1) * 4);
      u32 tg[2][2], tg8[2][2];
      e4m3_stage_tables<LUT>(lut, sw, wdec, tg, tg8);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const u32 w0 = t == 0 ? c0.x : t == 1 ? c0.z : t == 2 ? c1.x : c1.z;
        const u32 w1 = t == 0 ? c0.y : t == 1 ? c0.w : t == 2 ? c1.y : c1.w;
        nvfp4_e4m3(w0, tg[t >> 1], tg8[t >> 1], a[t % NSETS][0], a[t % NSETS][1]);
        nvfp4_e4m3(w1, tg[t >> 1], tg8[t >> 1], a[t % NSETS][2], a[t % NSETS][3]);
        wg_fence();
#if PROMOTE
        wgmma8_n128(part, a[t % NSETS], smem_desc(xb + 2 * t * XLBO, XLBO, 128), t);
#else
        wgmma8_tile(acc, a[t % NSETS], smem_desc(xb + 2 * t * XLBO, XLBO, 128), half);
#endif
        wg_commit();
        wg_wait<INFLIGHT>(a[(t + NSETS - INFLIGHT) % NSETS]);
      }
#if PROMOTE
#pragma unroll
      for (int i = 0; i < NSETS; ++i) wg_wait<0>(a[i]);
      fence_regs(part);
#pragma unroll
      for (int i = 0; i < ACC; ++i) acc[i] += part[i];
#endif
#endif
    } else {
      const uint4 c0 = *(const uint4*)(wb + lane * 32), c1 = *(const uint4*)(wb + lane * 32 + 16);
      const u32 e0 = sb[2 * g], e1 = sb[2 * g + 1], e80 = sb[2 * (g + 8)], e81 = sb[2 * (g + 8) + 1];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint2 v = t == 0 ? make_uint2(c0.x, c0.y) : t == 1 ? make_uint2(c0.z, c0.w)
                      : t == 2 ? make_uint2(c1.x, c1.y) : make_uint2(c1.z, c1.w);
        mxfp8_frag(v, e8m0_pair(t < 2 ? e0 : e1), e8m0_pair(t < 2 ? e80 : e81), a[t % NSETS]);
        wg_fence();
        wgmma_tile(acc, a[t % NSETS], smem_desc(xb + 2 * t * XLBO, XLBO, 128), half);
        wg_commit();
        wg_wait<INFLIGHT>(a[(t + NSETS - INFLIGHT) % NSETS]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NSETS; ++i) wg_wait<0>(a[i]);  // every set stays live until its MMA is done
  fence_regs(acc);
  cp_wait<0>();
}

// Position of K index n in moe_cuda's prepacked K order (within each 64-K chunk, MMA step s = n / 4 % 4 holds lane j =
// n / 16 % 4's K 4 s + e at slot 2 j + e % 2 + 8 (e / 2)): where FC1 stores act column n for FC2's routed tiles.
__device__ __forceinline__ int mma_pos(int n) {
  return (n & ~63) + 16 * ((n >> 2) & 3) + 2 * ((n >> 4) & 3) + (n & 1) + 8 * ((n >> 1) & 1);
}
// The E4M3 build's K order (fp8_pos, its own inverse): in each 64-K chunk K 16 j + 4 t + e sits at 16 t + 4 j + e
// (k32 step t / 2 holds bf16 steps t = 2 v, 2 v + 1 at slots 4 j + e, 16 + 4 j + e).
__device__ __forceinline__ int fp8_pos(int n) { return (n & ~63) + 16 * ((n >> 2) & 3) + 4 * ((n >> 4) & 3) + (n & 3); }

#if ROUTED_FP8
#define ROUTED NV_E4M3
#define ROUTED_ES 1
#define ACT_POS fp8_pos
#else
#define ROUTED NV_BF16
#define ROUTED_ES 2
#define ACT_POS mma_pos
#endif
__device__ __forceinline__ u32 pow2_f16x2(int e) { const u32 b = (u32)(15 + e) << 10; return b | (b << 16); }
__device__ __forceinline__ float pow2f(int e) { return __uint_as_float((u32)(127 + e) << 23); }

// act[p, n] = SiLU(gate) * up (bf16, rounded as the reference's bf16 model) for the tile's rows p and the CTA's
// ROWS / 2 intermediate columns n: warps 0 .. TILES / 2 - 1 hold the gate rows, the others the up rows of the same
// columns, which reach the gate warps through shared memory. Routed act columns are stored in the routed build's K
// order (ACT_POS), the order FC2's routed tiles read; routed tiles read the tokens from xq, x in that order (bf16, or
// E4M3 with the row scales xs and the weights' extra 2^wexp in the ROUTED_FP8 build).
extern "C" __global__ void __launch_bounds__(THREADS, CTAS)
moe_pf_fc1(const u16* x, const u8* xq, const float* xs, const int* order, const int* offs, const u8* rcode,
           const u8* rscale, const float* rrow, const u8* scode, const u8* sscale, u16* act, u16* sact, int T,
           int n_sh, int H, int I, int S, int E, int topk, int wexp, void* scratch0, void* scratch1) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ long long xoff[BT];
  __shared__ float csc[BT];
  const Work w = find_work(offs, E, n_sh, T);
  const int rb = blockIdx.y, N = w.kind == 1 ? S : I;
  if (w.kind == 0 || (rb + 1) * (ROWS / 2) > N) return;
  for (int n = threadIdx.x; n < BT; n += THREADS) {
    long long o = -1;
    float f = 1.f;
    if (n < w.count) {
      const int tok = w.kind == 1 ? w.p0 + n : order[w.p0 + n] / topk;
      o = (long long)tok * H * (w.kind == 1 ? 2 : ROUTED_ES);
      if (ROUTED_FP8 && w.kind == 2) f = xs[tok] * pow2f(wexp);
    }
    xoff[n] = o;
    csc[n] = f;
  }
  __syncthreads();
  float acc[ACC];
  const long g0 = (long)rb * (TILES / 2), u0 = N / 16 + g0;
  if (w.kind == 2) {
    const long e0 = (long)w.expert * (2 * I / 16);
    mainloop<ROUTED>(smem, xq, xoff, rcode, rscale, e0 + g0, e0 + u0, H, pow2_f16x2(-wexp), w.count, acc);
  } else {
    mainloop<MX_BF16>(smem, (const u8*)x, xoff, scode, sscale, g0, u0, H, 0u, w.count, acc);
  }
  __syncthreads();  // every warpgroup's MMAs are done: the stage buffers hold the up values now
  constexpr int LD = BT + 4;
  float* upv = (float*)smem;  // [ROWS / 2][LD]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const bool is_up = warp >= TILES / 2;
  const int r = (warp % (TILES / 2)) * 16 + g;  // the lane's rows r, r + 8 of the CTA's column block
  const int n = rb * (ROWS / 2) + r;
  const float* rs = w.kind == 2 ? rrow + (long)w.expert * 2 * I + (is_up ? I : 0) : nullptr;
  const float f0 = rs ? rs[n] : 1.f, f8 = rs ? rs[n + 8] : 1.f;
  if (is_up) {
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float cs = csc[8 * i + 2 * c + u];
        upv[r * LD + 8 * i + 2 * c + u] = acc[4 * i + u] * f0 * cs;
        upv[(r + 8) * LD + 8 * i + 2 * c + u] = acc[4 * i + 2 + u] * f8 * cs;
      }
  }
  __syncthreads();
  if (is_up) return;
  u16* out = w.kind == 2 ? act : sact;
  const int c0 = w.kind == 2 ? ACT_POS(n) : n, c8 = w.kind == 2 ? ACT_POS(n + 8) : n + 8;
#pragma unroll
  for (int i = 0; i < BT / 8; ++i) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int col = 8 * i + 2 * c + u;
      if (col < w.count) {
        const float cs = csc[col];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float v = silu_mul_bf16(acc[4 * i + 2 * h + u] * (h ? f8 : f0) * cs, upv[(r + 8 * h) * LD + col]);
          out[(long)(w.p0 + col) * N + (h ? c8 : c0)] = bf16_bits(v);
        }
      }
    }
  }
}

// y[token * slots + slot, h] = (act[p] . W2[e, h]) * rrow[e, h] * wts[pair] for the tile's sorted pairs p (pair =
// order[p] = token * topk + slot); shared tiles: y[token * slots + topk, h] = sact[token] . Ws2[h]. Routed tiles
// read act (bf16), or in the ROUTED_FP8 build its E4M3 rows with their scales as (moe_pf_quant).
extern "C" __global__ void __launch_bounds__(THREADS, CTAS)
moe_pf_fc2(const u8* act, const u16* sact, const float* as, const int* order, const float* wts, const int* offs,
           const u8* rcode, const u8* rscale, const float* rrow, const u8* scode, const u8* sscale, u16* y, int T,
           int n_sh, int H, int I, int S, int E, int topk, int slots, int wexp, void* scratch0, void* scratch1) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ long long xoff[BT];
  __shared__ long long yrow[BT];
  __shared__ float ywt[BT];
  const Work w = find_work(offs, E, n_sh, T);
  const int rb = blockIdx.y, K = w.kind == 1 ? S : I;
  if (w.kind == 0 || (rb + 1) * ROWS > H) return;
  for (int n = threadIdx.x; n < BT; n += THREADS) {
    long long o = -1, yr = 0;
    float wt = 0.f;
    if (n < w.count) {
      o = (long long)(w.p0 + n) * K * (w.kind == 1 ? 2 : ROUTED_ES);
      if (w.kind == 2) {
        const int pair = order[w.p0 + n];
        yr = (long long)(pair / topk) * slots + pair % topk;
        wt = wts[pair];
        if (ROUTED_FP8) wt *= as[w.p0 + n] * pow2f(wexp);
      } else {
        yr = (long long)(w.p0 + n) * slots + topk;
        wt = 1.f;
      }
    }
    xoff[n] = o;
    yrow[n] = yr;
    ywt[n] = wt;
  }
  __syncthreads();
  float acc[ACC];
  const long t0 = (long)rb * TILES + (w.kind == 2 ? (long)w.expert * (H / 16) : 0);
  if (w.kind == 2)
    mainloop<ROUTED>(smem, act, xoff, rcode, rscale, t0, t0 + TILES / 2, I, pow2_f16x2(-wexp), w.count, acc);
  else
    mainloop<MX_BF16>(smem, (const u8*)sact, xoff, scode, sscale, t0, t0 + TILES / 2, S, 0u, w.count, acc);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int h = rb * ROWS + warp * 16 + g;
  float f = 1.f, f8 = 1.f;
  if (w.kind == 2) {
    f = rrow[(long)w.expert * H + h];
    f8 = rrow[(long)w.expert * H + h + 8];
  }
#pragma unroll
  for (int i = 0; i < BT / 8; ++i) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int col = 8 * i + 2 * c + u;
      if (col < w.count) {
        const long long r = yrow[col] * H;
        const float wt = ywt[col];
        y[r + h] = bf16_bits(acc[4 * i + u] * f * wt);
        y[r + h + 8] = bf16_bits(acc[4 * i + 2 + u] * f8 * wt);
      }
    }
  }
}

// Rows of bf16 [R, K] -> E4M3 [R, K] with one float32 scale a row (q = rn(v * 448 / amax), v ~= q * amax / 448; a
// row with amax <= 2^-100, all-zero included: zeros, scale 0), the columns taken in fp8_pos order when `permute`
// (the tokens for FC1's routed tiles; act where moe_prefill_ws wrote it in natural order for this FC2, or this FC1 wrote
// it for moe_prefill_ws's FC2: fp8_pos is its own inverse). One CTA (256 threads) a row; 16 outputs a thread and
// pass, K % 64 == 0.
extern "C" __global__ void __launch_bounds__(256)
moe_pf_quant(const u16* src, u8* dst, float* scale, int K, int permute, void* scratch0, void* scratch1) {
  __shared__ float red[8];
  const long row = blockIdx.x;
  const u16* s = src + row * K;
  float m = 0.f;
  for (int q0 = threadIdx.x * 16; q0 < K; q0 += 256 * 16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = permute ? fp8_pos(q0 + 4 * j) : q0 + 4 * j;  // 4 K-consecutive sources a run
      const uint2 v = *(const uint2*)(s + n);
      const u32 wv[2] = {v.x, v.y};
#pragma unroll
      for (int k = 0; k < 2; ++k)
        m = fmaxf(m, fmaxf(fabsf(__uint_as_float(wv[k] << 16)), fabsf(__uint_as_float(wv[k] & 0xFFFF0000u))));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) m = fmaxf(m, red[i]);
  const bool live = m > 0x1p-100f;  // (448 / m overflows below ~1e-36: such a row is stored as zeros)
  const float inv = live ? 448.f / m : 0.f;
  if (threadIdx.x == 0) scale[row] = live ? m / 448.f : 0.f;
  u8* d = dst + row * K;
  for (int q0 = threadIdx.x * 16; q0 < K; q0 += 256 * 16) {
    u32 out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = permute ? fp8_pos(q0 + 4 * j) : q0 + 4 * j;
      const uint2 v = *(const uint2*)(s + n);
      const u32 lo = f32x2_to_e4m3x2(__uint_as_float(v.x << 16) * inv, __uint_as_float(v.x & 0xFFFF0000u) * inv);
      const u32 hi = f32x2_to_e4m3x2(__uint_as_float(v.y << 16) * inv, __uint_as_float(v.y & 0xFFFF0000u) * inv);
      out[j] = lo | (hi << 16);
    }
    *(uint4*)(d + q0) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}
