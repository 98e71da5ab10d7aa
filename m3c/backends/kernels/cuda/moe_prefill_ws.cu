// MegaMoE prefill FC1 and FC2 for sm_90a, warp-specialized (routed NVFP4 experts, E4M3 tokens / act): the weights
// are wgmma's B and the tokens (act) its A, both from shared memory, so one decode of a weight tile serves all of its
// tile's rows and the MMA warps only issue MMAs. Host side and layouts: m3c/backends/kernels/moe_prefill_ws.py.
//
// A work item = 128 sorted pair rows of one expert (two consumer warpgroups of 64, wgmma m64n256k32 E4M3 x E4M3, 128
// float32 accumulators a thread) x 256 weight rows (FC1: the 128 gate and 128 up rows of 128 intermediate columns;
// FC2: 256 output rows), with one producer warpgroup. Per stage of 128 K the producer brings the A rows into the
// stage's A buffer (TBULK: one bulk copy from their tile image; else cp.async; either completes on the stage's `full`
// mbarrier), and decodes the weights' NVFP4 codes (each warp copies the codes and scales of its own 4 tiles through
// a RAW-deep cp.async ring) x their E4M3 scales x 2^-wexp into E4M3 (the product tables of wgmma_common.cuh) in
// registers, then stores them to the B buffer; consumers wait on `full`, issue 4 MMAs, and release the stage on
// `empty` when they are done. A CTA runs one item or (persistent grid) several; the ring runs on across items.
// The shared expert's items (TBULK; session 28): its weights pre-encoded to E4M3 in the B buffer's own layout, so the
// producer bulk-copies A and B a stage and decodes nothing (moe_prefill_ws.shared_image).
// FC1's B N order interleaves gate and up: MMA column 16 m + r holds gate column 8 m + r, 16 m + 8 + r its up column
// (r < 8), so a consumer lane holds the gate and up values of each of its columns (SiLU·up in registers).
#ifndef STAGES
#define STAGES 3  // A / B buffers (48 KiB each)
#endif
#ifndef RAW
#define RAW 3     // raw code / scale buffers (20 KiB each)
#endif
#ifndef LUT
#define LUT 0     // the product tables looked up by scale byte in a shared table built once a CTA (as moe_prefill_wgmma)
#endif
#ifndef TBULK
#define TBULK 0   // the tokens by one bulk copy a stage (one thread) from a tile image (see the kernel's comment)
#endif
#ifndef TMAJOR
#define TMAJOR 0  // work items tile-major (a tile's row blocks consecutive: its A rows stay in L2 across them), else
                  // row-block-major (an expert's tiles side by side: its weight rows stay in L2 across them)
#endif
#ifndef SKIP
#define SKIP 0    // timing probes only (wrong results): 1 = consumers issue no MMAs, 2 = the producer decodes nothing,
                  // 3 = both
#endif
#define BT 128
#define NR 256
#define KS 128
// K-adjacent core matrices (8 rows x 16 bytes) lie LBO_A / LBO_B apart: one 16-byte K chunk of every row, padded
// so that the 8 lanes of a 16-byte store phase (the producer's token copies: 4 rows x 2 chunks; its decoded rows:
// 2 rows x 4 chunks) hit 8 different bank groups. With TBULK A is unpadded: a stage of the tile image is its copy.
#define LBO_A (BT * 16 + (TBULK ? 0 : 64))
#define LBO_B (NR * 16 + 32)
#define A_BYTES (8 * LBO_A)
#define B_BYTES (8 * LBO_B)
#define RC_BYTES (16 * 1024)       // codes of a stage: 16 tiles x 1 KiB
#define RAW_BYTES (RC_BYTES + 16 * 256)  // + each tile's 256-K super-chunk of scales (256 B)
#define NP 128  // producer threads (fixed: the copies assume 4 tiles a warp; a second producer warpgroup would
                // cap every thread at 128 registers, and ptxas needs >= 154 for an m64n256 wgmma even where
                // setmaxnreg.inc gives the consumers more: "Insufficient registers (128) to compile instruction")
#define THREADS (256 + NP)

#include "ptx_common.cuh"
#include "wgmma_common.cuh"
#include "mbarrier.cuh"

template <int N>
__device__ __forceinline__ void wg_wait_acc(float (&d)[128]) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
  fence_regs(d);
}

// d[0..128) += A (64 tokens x 32 K, E4M3, shared memory) . B (32 K x 256 weight rows, E4M3, shared memory).
__device__ __forceinline__ void wgmma8_ss_n256(float (&d)[128], unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
      D128_TEXT
      "}, %128, %129, 1, 1, 1;\n}\n"
      : D128_OUT(d)
      : "l"(da), "l"(db));
}

// Tile r of the routed work (each expert's tiles of BT sorted pairs, in expert order): its expert, first sorted pair
// and pair count (offs: the E + 1 expert row offsets); false past the last tile.
__device__ __forceinline__ bool find_tile(const int* offs, int E, int r, int& expert, int& p0, int& count) {
  int base = 0;
  for (int e = 0; e < E; ++e) {
    const int lo = offs[e], hi = offs[e + 1], nt = (hi - lo + BT - 1) / BT;
    if (r < base + nt) {
      expert = e;
      p0 = lo + (r - base) * BT;
      count = min(BT, hi - p0);
      return true;
    }
    base += nt;
  }
  return false;
}

#ifndef MAXE
#define MAXE 1024  // the most experts the GEMM kernels take (moe_prefill_ws.MAX_EXPERTS; their tile table's size)
#endif

// tbase[e] = expert e's first routed tile (each expert's tiles of BT sorted pairs, in expert order), tbase[E] = the
// routed tiles in all, for E <= MAXE experts (offs: their E + 1 pair offsets), THREADS experts a pass. All THREADS
// threads call it (it holds __syncthreads); tbase is ready after the caller's next __syncthreads.
__device__ __forceinline__ void tile_table(const int* offs, int E, int* tbase, int* wsum, int tid) {
  const int lane = tid & 31, w = tid >> 5;
  const int ne = min(E, MAXE);
  int carry = 0;  // the tiles of the passes before
  for (int e0 = 0; e0 < ne; e0 += THREADS) {
    const int e = e0 + tid;
    int v = e < ne ? (offs[e + 1] - offs[e] + BT - 1) / BT : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {  // inclusive scan over the warp
      const int u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += u;
    }
    if (lane == 31) wsum[w] = v;
    __syncthreads();
    for (int i = 0; i < w; ++i) v += wsum[i];
    if (e < ne) tbase[e + 1] = carry + v;
    for (int i = 0; i < THREADS / 32; ++i) carry += wsum[i];  // + this pass's total
    __syncthreads();  // (wsum is rewritten by the next pass)
  }
  if (tid == 0) tbase[0] = 0;
}

// find_tile by the table (a binary search in shared memory, not E loads of offs).
__device__ __forceinline__ bool find_tile_in(const int* tbase, const int* offs, int E, int r, int& expert, int& p0,
                                             int& count) {
  if (r >= tbase[E]) return false;
  int lo = 0, hi = E - 1;  // the last expert whose first tile is <= r: r's (experts without tiles repeat a base)
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tbase[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  expert = lo;
  p0 = offs[lo] + (r - tbase[lo]) * BT;
  count = min(BT, offs[lo + 1] - p0);
  return true;
}

// What work item `item` is: its row block rb and tile ti (TMAJOR: ti = item / nrb, else rb = item / (ntiles +
// nsh)), and whether it runs (skip: a routed tile past the last, or FC1's row block past I (routed) / S (shared)). A
// shared item (TBULK, ti >= ntiles) has tokens p0 = (ti - ntiles) BT .. of T; a routed one its expert's pairs p0 ..
// p0 + count. ns: its stages (FC2's shared items: S / KS; else K / KS). The producer and the consumers both decide by
// this.
struct WsItem {
  int rb, ti, expert, p0, count, ns;
  bool shared, skip;
};
template <int FC2>
__device__ __forceinline__ WsItem ws_item(int item, int ntiles, int nsh, int nrb, const int* tbase, const int* offs,
                                          int E, int I, int S, int T, int nst) {
  WsItem w;
  const int ntt = ntiles + nsh;
  w.rb = TMAJOR ? item % nrb : item / ntt;
  w.ti = TMAJOR ? item / nrb : item % ntt;
  w.shared = TBULK && w.ti >= ntiles;
  w.expert = 0;
  w.ns = FC2 && w.shared ? S / KS : nst;
  if (w.shared) {
    w.p0 = (w.ti - ntiles) * BT;
    w.count = min(BT, T - w.p0);
    w.skip = !FC2 && w.rb * 128 >= S;
  } else {
    w.skip = (!FC2 && w.rb * 128 >= I) || !find_tile_in(tbase, offs, E, w.ti, w.expert, w.p0, w.count);
  }
  return w;
}

// The body of both kernels below. FC1 (FC2 = 0): act[p, c] = SiLU(gate) * up (bf16, as the reference's bf16 model
// rounds) for the tile's sorted pairs p and the CTA's 128 intermediate columns c (natural order); x: E4M3 tokens
// [T, H] (natural K order) with row scales xs; K = H. FC2: y[pair / topk * slots + pair % topk, h] = (act[p] .
// W2[e, h]) x rrow[e, h] x wts[pair] for the CTA's 256 output rows h; x: E4M3 act [T topk, I] in sorted-pair order
// with row scales xs (moe_pf_quant); K = I. With TBULK the A rows come from xt instead: tile r's stage s is the A
// buffer's image, 16 KiB at (r K / KS + s) 16 KiB: K chunk kc (16 bytes) of tile row n at kc 2048 + 16 n
// (moe_prefill_ws.token_image).
// Work items: (tile, row block) pairs in the order ws_item gives (ntiles: the grid's bound on routed tiles, items past
// the last are skipped; nsh: the shared expert's tiles, TBULK only). A CTA takes items blockIdx.x, + gridDim.x, ..:
// one each when the grid covers them all, several when it is persistent; the stage ring and its barrier phases run on
// across items, so the producer fills the next item's first stages while the consumers store the last one's results.
template <int FC2>
__device__ __forceinline__ void ws_gemm(const u8* xq, const float* xs, const int* order, const float* wts,
                                        const int* offs, const u8* rcode, const u8* rscale, const float* rrow,
                                        u16* out, const u8* xt, int H, int I, int E, int topk, int slots, int wexp,
                                        int ntiles, const u8* st, const float* sxs, const u8* sb, const float* srow,
                                        u16* sact, int T, int S, int nsh) {
  extern __shared__ __align__(128) u8 smem[];
  __shared__ __align__(8) unsigned long long bars[2 * STAGES];
  // tiles 0 .. ntiles - 1: the routed experts' (a bound: those past the last are skipped); with TBULK also ntiles ..
  // ntiles + nsh - 1: the shared expert's, 128 rows each (FC1: tokens, FC2: its act [T, S]) from their image st with
  // row scales sxs, B bulk-copied from its E4M3 image sb (rows scaled by srow); its K: FC1 H, FC2 S
  const int tid = threadIdx.x, K = FC2 ? I : H, nrb = FC2 ? H / 256 : max(I, nsh ? S : 0) / 128;
  const int items = (ntiles + nsh) * nrb;
  const float up2 = __uint_as_float((u32)(127 + wexp) << 23);
  // the sorted pair p's A row offset in xq (-1 past the tile's pairs)
  auto row_of = [&](int p0, int count, int n) -> long long {
    return n < count ? (FC2 ? (long long)(p0 + n) * I : (long long)(order[p0 + n] / topk) * H) : -1;
  };
  const u32 full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES;
  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) {
      // each producer thread: one cp.async arrival (TBULK: thread 0's expect_tx arrival instead) and one arrival
      mbar_init(full0 + 8 * i, TBULK ? NP + 1 : 2 * NP);
      mbar_init(empty0 + 8 * i, 8);    // the consumers' 8 warps
    }
    mbar_init_fence();
  }
  __shared__ int tbase[MAXE + 1], wsum[THREADS / 32];
  tile_table(offs, E, tbase, wsum, tid);
  const u32 wdec = ((u32)(15 - wexp) << 10) * 0x10001u;  // the f16x2 pair 2^-wexp
  __shared__ uint2 lut[LUT ? 256 : 1];
  if (LUT) e4m3_lut_fill(lut, wdec, tid, THREADS);
  __syncthreads();
  const u32 base = smem_u32(smem);
  const u32 abase = base, bbase = base + STAGES * A_BYTES, rbase = bbase + STAGES * B_BYTES;
  const int nst = K / KS;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, j = lane & 3;

  if (warp >= 8) {  // ---- producer warpgroup(s)
    const int pt = tid - 256, pw = warp - 8;
    int gs = 0;  // stages produced, over all items (the ring slot and barrier phase)
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      const WsItem it = ws_item<FC2>(item, ntiles, nsh, nrb, tbase, offs, E, I, S, T, nst);
      if (it.skip) continue;
      const int rb = it.rb, expert = it.expert, p0 = it.p0, count = it.count;
      const u8* xtile = xt + (long)it.ti * nst * A_BYTES;  // TBULK: this tile's image
      if (it.shared) {  // a shared-expert item: its A rows and E4M3 B by two bulk copies a stage
        const u8* aimg = st + (long)(it.ti - ntiles) * it.ns * A_BYTES;
        const u8* bimg = sb + (long)rb * it.ns * B_BYTES;
        for (int s = 0; s < it.ns; ++s, ++gs) {
          const int slot = gs % STAGES;
          mbar_wait(empty0 + 8 * slot, ((gs / STAGES) & 1) ^ 1);
          if (pt == 0) {
            mbar_arrive_tx(full0 + 8 * slot, A_BYTES + B_BYTES);
            bulk_g2s(abase + slot * A_BYTES, aimg + (long)s * A_BYTES, A_BYTES, full0 + 8 * slot);
            bulk_g2s(bbase + slot * B_BYTES, bimg + (long)s * B_BYTES, B_BYTES, full0 + 8 * slot);
          }
          mbar_arrive(full0 + 8 * slot);
        }
        continue;
      }
      // the CTA's 16 weight tiles of 16 rows: FC1 8 of gate rows and 8 of up rows, FC2 16 consecutive
      const long e0 = (long)expert * ((FC2 ? H : 2 * I) / 16), g0 = e0 + rb * (FC2 ? 16 : 8), u0 = e0 + I / 16 + rb * 8;
      const long tstride = (long)nst * 1024;
      auto tile_of = [&](int t) { return FC2 || t < 8 ? g0 + t : u0 + (t - 8); };
      // This thread's copies, the same each stage but for the K offset. Raw codes / scales: each warp copies those of
      // the 4 tiles it decodes (lane: code chunks lane, lane + 32 of each; the scale chunks of tiles 4 pw + lane / 16
      // + {0, 2}), so a warp-level sync suffices. Tokens: rows n0 = pt / 2 and n0 + 64, chunks 2 v + pt % 2 (v < 4;
      // chunk kc of token n at kc LBO_A + (n / 8) 128 + (n % 8) 16).
      const u8* cbase[4];
#pragma unroll
      for (int v = 0; v < 4; ++v)
        cbase[v] = rcode + tile_of(4 * pw + v) * tstride + lane * 16;
      const u8* sbase[2];
#pragma unroll
      for (int v = 0; v < 2; ++v)
        sbase[v] = rscale + tile_of(4 * pw + lane / 16 + 2 * v) * (long)K + (pt % 16) * 16;
      const u32 cd0 = 4 * pw * 1024 + lane * 16, sd0 = RC_BYTES + (4 * pw + lane / 16) * 256 + (pt % 16) * 16;
      const int n0 = pt / 2;
      const long long o0 = TBULK ? 0 : row_of(p0, count, n0), o1 = TBULK ? 0 : row_of(p0, count, n0 + 64);
      const u8* xrow0 = xq + (o0 < 0 ? 0 : o0) + 16 * (pt % 2);
      const u8* xrow1 = xq + (o1 < 0 ? 0 : o1) + 16 * (pt % 2);
      const u32 xd0 = (pt % 2) * LBO_A + (n0 / 8) * 128 + (n0 % 8) * 16;
      auto issue_raw = [&](int s) {
        if (s < nst) {
          const u32 rb_ = rbase + (s % RAW) * RAW_BYTES;
#pragma unroll
          for (int v = 0; v < 4; ++v)
#pragma unroll
            for (int h = 0; h < 2; ++h)  // tile 4 pw + v, chunk lane + 32 h
              cp16(rb_ + cd0 + v * 1024 + h * 512, cbase[v] + h * 512 + (long)s * 1024, true);
#pragma unroll
          for (int v = 0; v < 2; ++v)
            cp16(rb_ + sd0 + v * 512, sbase[v] + (long)(s >> 1) * 256, true);
        }
        cp_commit();
      };
      __syncwarp();  // (the warp's reads of the raw ring, last item's, are done)
      for (int s = 0; s < RAW - 1; ++s) issue_raw(s);
      for (int s = 0; s < nst; ++s, ++gs) {
        const int slot = gs % STAGES;
        cp_wait<RAW - 2>();
        __syncwarp();  // raw stage s landed for the warp's lanes (each warp reads only what it copied)
        mbar_wait(empty0 + 8 * slot, ((gs / STAGES) & 1) ^ 1);
        const u32 ab = abase + slot * A_BYTES;
        if (TBULK) {
          if (pt == 0) {
            mbar_arrive_tx(full0 + 8 * slot, A_BYTES);
            bulk_g2s(ab, xtile + (long)s * A_BYTES, A_BYTES, full0 + 8 * slot);
          }
        } else {
#pragma unroll
          for (int v = 0; v < 4; ++v) {  // chunk 2 v + pt % 2 of rows n0, n0 + 64 (8 rows of core matrices on)
            cp16(ab + xd0 + 2 * v * LBO_A, xrow0 + s * KS + 32 * v, o0 >= 0);
            cp16(ab + xd0 + 2 * v * LBO_A + 8 * 128, xrow1 + s * KS + 32 * v, o1 >= 0);
          }
          mbar_cp_arrive(full0 + 8 * slot);
        }
        issue_raw(s + RAW - 1);
        const u8* raw = smem + (rbase - base) + (s % RAW) * RAW_BYTES;
        u8* bsm = smem + (bbase - base) + slot * B_BYTES;
        constexpr int TW = SKIP >= 2 ? 0 : 16 / (NP / 32);  // tiles a producer warp decodes
        uint4 dr[TW > 0 ? TW : 1][2][2];  // [tile][chunk][row g / g + 8]: 16 E4M3 of the row's K chunk 4 c + j
#pragma unroll
        for (int tl = 0; tl < TW; ++tl) {
          const int t = TW * pw + tl;
          const uint4 c0 = *(const uint4*)(raw + t * 1024 + lane * 16);
          const uint4 c1 = *(const uint4*)(raw + t * 1024 + 512 + lane * 16);
          const u32 sw = *(const u32*)(raw + RC_BYTES + t * 256 + lane * 8 + (s & 1) * 4);
          u32 tg[2][2], tg8[2][2];
          e4m3_stage_tables<LUT>(lut, sw, wdec, tg, tg8);
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const uint4 w = c ? c1 : c0;
            uint4& r = dr[tl][c][0];
            uint4& r8 = dr[tl][c][1];
            nvfp4_e4m3(w.x, tg[c], tg8[c], r.x, r8.x);
            nvfp4_e4m3(w.y, tg[c], tg8[c], r.y, r8.y);
            nvfp4_e4m3(w.z, tg[c], tg8[c], r.z, r8.z);
            nvfp4_e4m3(w.w, tg[c], tg8[c], r.w, r8.w);
          }
        }
#pragma unroll
        for (int tl = 0; tl < TW; ++tl) {
          const int t = TW * pw + tl, up = t >= 8, tt = t & 7;
          // rows g, g + 8 of the tile -> MMA columns n, n + 16 (FC1: gate / up interleaved) or n, n + 8 (FC2)
          const int n = FC2 ? 16 * t + g : 32 * tt + 8 * up + g;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int kc = 4 * c + j;  // 16 K of the stage: 64 c + 16 j ..
            uint4* d = (uint4*)(bsm + kc * LBO_B + (n / 8) * 128 + (n % 8) * 16);
            d[0] = dr[tl][c][0];
            d[FC2 ? 8 : 16] = dr[tl][c][1];  // MMA column n + 8 / n + 16: one / two core matrices on
          }
        }
        fence_async_smem();  // the decoded B (generic writes) visible to the consumers' wgmma (async proxy)
        mbar_arrive(full0 + 8 * slot);
      }
    }
    cp_wait<0>();
    return;
  }

  // ---- consumer warpgroups 0, 1: rows 64 cw .. 64 cw + 63 of the tile (FC1: tokens, FC2: act rows)
  const int cw = warp >> 2;
  const int r = 16 * (warp & 3) + g;  // the lane's token rows r, r + 8 of its warpgroup's 64
  int gs = 0;  // stages consumed, over all items
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const WsItem it = ws_item<FC2>(item, ntiles, nsh, nrb, tbase, offs, E, I, S, T, nst);
    if (it.skip) continue;
    const int rb = it.rb, expert = it.expert, p0 = it.p0, count = it.count;
    const bool shr = it.shared;
    // the rows' scales (routed: x 2^wexp; FC2: x the routing weight) and FC2's y rows, loaded under the MMAs
    float csc[2] = {0.f, 0.f};
    int yrow[2] = {0, 0};  // (T slots < 2^31)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tk = 64 * cw + r + 8 * h;
      if (tk < count) {
        if (shr) {
          csc[h] = sxs[p0 + tk];
          if (FC2) yrow[h] = (p0 + tk) * slots + topk;  // the shared expert's slot
        } else {
          const int pair = order[p0 + tk], tok = pair / topk;
          csc[h] = FC2 ? xs[p0 + tk] * up2 * wts[pair] : xs[tok] * up2;
          yrow[h] = tok * slots + pair % topk;
        }
      }
    }
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int s = 0; s < it.ns; ++s, ++gs) {
      const int slot = gs % STAGES;
      mbar_wait(full0 + 8 * slot, (gs / STAGES) & 1);
      fence_async_smem();  // the A rows' cp.async writes (without TBULK), seen through the barrier, visible to wgmma
      wg_fence();
      const u32 ab = abase + slot * A_BYTES + cw * 1024, bb = bbase + slot * B_BYTES;
#pragma unroll
      for (int t = 0; t < (SKIP & 1 ? 0 : 4); ++t)
        wgmma8_ss_n256(acc, smem_desc(ab + 2 * t * LBO_A, LBO_A, 128), smem_desc(bb + 2 * t * LBO_B, LBO_B, 128));
      wg_commit();
      wg_wait_acc<1>(acc);  // stage s - 1's MMAs are done: release its buffers
      if (s > 0 && lane == 0) mbar_arrive(empty0 + 8 * ((gs - 1) % STAGES));
    }
    wg_wait_acc<0>(acc);
    if (lane == 0) mbar_arrive(empty0 + 8 * ((gs - 1) % STAGES));  // the item's last stage

    if (FC2) {  // accumulator 4 q + 2 h + u: token row r + 8 h, output row 8 q + 2 j + u of the CTA's 256
      const long h0 = (long)rb * 256;
      const float* fr = (shr ? srow : rrow + (long)expert * H) + h0;
      // the row scales first: every load before any store (out might alias fr for the compiler, so a load after a
      // store waited for it: 32 L2 round trips an item, a third of FC2's stall samples; RESULTS.md session 29)
#pragma unroll
      for (int q = 0; q < 32; ++q) {
        const float f0 = fr[8 * q + 2 * j], f1 = fr[8 * q + 2 * j + 1];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc[4 * q + 2 * h] *= f0;
          acc[4 * q + 2 * h + 1] *= f1;
        }
      }
#pragma unroll
      for (int q = 0; q < 32; ++q) {
        const int c = 8 * q + 2 * j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int tk = 64 * cw + r + 8 * h;
          if (tk < count) {
            const float cs = csc[h];
            *(u32*)(out + (long long)yrow[h] * H + h0 + c) =
                (u32)bf16_bits(acc[4 * q + 2 * h] * cs) | ((u32)bf16_bits(acc[4 * q + 2 * h + 1] * cs) << 16);
          }
        }
      }
      continue;
    }
    const long col0 = (long)rb * 128;
    const int N = shr ? S : I;  // act's columns: the shared expert's act [T, S], or the routed [T topk, I]
    const float* fr = shr ? srow : rrow + (long)expert * 2 * I;
    u16* const o = shr ? sact : out;
#pragma unroll
    for (int m = 0; m < 16; ++m) {  // the row scales first (as FC2's)
      const int c = 8 * m + 2 * j;
      const float fg0 = fr[col0 + c], fg1 = fr[col0 + c + 1], fu0 = fr[N + col0 + c], fu1 = fr[N + col0 + c + 1];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc[8 * m + 2 * h] *= fg0;
        acc[8 * m + 2 * h + 1] *= fg1;
        acc[8 * m + 4 + 2 * h] *= fu0;
        acc[8 * m + 4 + 2 * h + 1] *= fu1;
      }
    }
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      const int c = 8 * m + 2 * j;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int tk = 64 * cw + r + 8 * h;
        if (tk < count) {
          const float cs = csc[h];
          const float v0 = silu_mul_bf16(acc[8 * m + 2 * h] * cs, acc[8 * m + 4 + 2 * h] * cs);
          const float v1 = silu_mul_bf16(acc[8 * m + 2 * h + 1] * cs, acc[8 * m + 4 + 2 * h + 1] * cs);
          *(u32*)(o + (long)(p0 + tk) * N + col0 + c) = (u32)bf16_bits(v0) | ((u32)bf16_bits(v1) << 16);
        }
      }
    }
  }
}

// sb / srow / sact (nsh > 0, TBULK only): the shared expert's E4M3 B image (moe_prefill_ws.shared_image: row block
// rb's stage s is the B buffer's image, B_BYTES at (rb K / KS + s) B_BYTES), its rows' float32 scales [2 S] (gate,
// then up) and its act [T, S] bf16; xt then holds its nsh tiles of 128 tokens after the routed ntiles.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_ws_fc1(const u8* xq, const float* xs, const int* order, const int* offs, const u8* rcode, const u8* rscale,
           const float* rrow, u16* act, const u8* xt, const u8* sb, const float* srow, u16* sact, int T, int H, int I,
           int S, int E, int topk, int wexp, int ntiles, int nsh, void* scratch0, void* scratch1) {
  ws_gemm<0>(xq, xs, order, nullptr, offs, rcode, rscale, rrow, act, xt, H, I, E, topk, 0, wexp, ntiles,
             xt + (long)ntiles * (H / KS) * A_BYTES, xs, sb, srow, sact, T, S, nsh);
}

// act8 / as: FC2's E4M3 act rows in sorted-pair order and their scales; y [T, slots, H] bf16 (slot = the pair's).
// st / sas / sb / srow (nsh > 0): the shared expert's E4M3 act [T, S] as a tile image (nsh tiles of 128 rows, K = S)
// and its rows' scales, its W2 [H, S] as the B image (moe_prefill_ws.shared_image: row block rb's stage s at (rb S /
// KS + s) B_BYTES) and its rows' float32 scales [H]: y[t, topk, h] (slot topk, the last).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
moe_ws_fc2(const u8* act8, const float* as, const int* order, const float* wts, const int* offs, const u8* rcode,
           const u8* rscale, const float* rrow, u16* y, const u8* xt, const u8* st, const float* sas, const u8* sb,
           const float* srow, int T, int H, int I, int S, int E, int topk, int slots, int wexp, int ntiles, int nsh,
           void* scratch0, void* scratch1) {
  ws_gemm<1>(act8, as, order, wts, offs, rcode, rscale, rrow, y, xt, H, I, E, topk, slots, wexp, ntiles, st, sas, sb,
             srow, nullptr, T, S, nsh);
}

// The tokens' tile image that TBULK's copies read: tile r's stage s, 16 KiB, holds K chunk kc (16 bytes, K s KS +
// 16 kc ..) of tile row n at kc 2048 + 16 n, from xq's row of the tile's n-th sorted pair; rows past the tile's pairs
// and tiles past the last are zero. Tiles ntiles .. gridDim.x - 1 (the shared expert's): 128 consecutive rows of xq
// each (T rows in all). CTA (r, y) writes stages y, y + gridDim.y, .. of tile r (one tile search a CTA). Threads
// take 16-byte chunks in write order (coalesced stores; the reads gather 16 bytes a row, from L2: xq is T H bytes).
extern "C" __global__ void __launch_bounds__(256)
moe_ws_image(const u8* xq, const int* order, const int* offs, u8* xt, int H, int E, int topk, int ntiles, int T,
             void* scratch0, void* scratch1) {
  __shared__ long long src[BT];
  const bool shr = (int)blockIdx.x >= ntiles;
  int expert, p0 = ((int)blockIdx.x - ntiles) * BT, count = min(BT, T - p0);
  if (!shr && !find_tile(offs, E, blockIdx.x, expert, p0, count)) count = 0;
  const int nst = H / KS;
  for (int n = threadIdx.x; n < BT; n += 256)
    src[n] = n >= count ? -1 : (long long)(shr ? p0 + n : order[p0 + n] / topk) * H;
  __syncthreads();
  constexpr int V = BT * KS / 16 / 256;
  for (int s = blockIdx.y; s < nst; s += gridDim.y) {
    uint4* dst = (uint4*)(xt + ((long)blockIdx.x * nst + s) * (BT * KS));
    uint4 v[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {  // all loads before any store (xq and xt could alias for the compiler)
      const int c = threadIdx.x + 256 * i;
      const long long o = src[c % BT];
      v[i] = o < 0 ? make_uint4(0, 0, 0, 0) : *(const uint4*)(xq + o + (long long)s * KS + 16 * (c / BT));
    }
#pragma unroll
    for (int i = 0; i < V; ++i) dst[threadIdx.x + 256 * i] = v[i];
  }
}
