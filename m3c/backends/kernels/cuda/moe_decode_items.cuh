// The MegaMoE decode's work items (moe_decode_mma.cu): which expert, rows, K split and column group a CTA of FC1 /
// FC2 works on (find_block), which tokens picked its expert (find_tokens), and the looping builds' walk over
// column groups (for_groups). Macros from the including file: WARPS, MAXT, TMAX, GROUPS, SHARED_GROUPS(T).
#pragma once

#include "ptx_common.cuh"

struct Block {   // what one CTA works on
  int expert;    // routed expert id, or -1 for the shared expert
  int row0;      // first weight row of the CTA (within the expert's rows)
  int ks, KS;    // K split index and count
  int grp;       // shared expert: its column group (tokens MAXT grp ..); routed: -1, every group in turn
};

#define SID_CAP 512  // routing ids a CTA keeps in shared memory for find_tokens (T * topk up to this; more: read again)

// Work item `item`: routed (expert slot x row block x KSr splits) items first, then shared (row block x KSs
// splits x column groups of MAXT of the T tokens, the groups innermost: the CTAs that read the same weights run
// side by side and share them through L2; ids not read). Returns false if the item's expert slot is unused (fewer
// experts touched than slots). A routed item also leaves the ids in `sid` (SID_CAP shorts; -1 where outside
// [0, E)) when T * topk <= SID_CAP, so find_tokens reads them from shared memory: its own reads of ids from global
// memory were ~2 us of an FC1 CTA's ~4 us before its staging at T = 16 (the CTA timeline, RESULTS.md session 37).
__device__ bool find_block(Block& b, int item, const long long* ids, int T, int topk, int E, int n_slots, int rows,
                           int srows, int KSr, int KSs, u32* flags, short* sid) {
  const int per = rows / (32 * WARPS), n_ids = T * topk;
  if (item >= n_slots * per * KSr) {
    item -= n_slots * per * KSr;
    const int groups = SHARED_GROUPS(T);
    b.expert = -1;
    b.KS = KSs;
    b.grp = item % groups;
    item /= groups;
    b.ks = item % KSs;
    b.row0 = (item / KSs) * 32 * WARPS;
    return b.row0 < srows;
  }
  const long long first = (int)threadIdx.x < n_ids ? ids[threadIdx.x] : -1;  // (issued before the barrier)
  b.grp = -1;
  b.KS = KSr;
  b.ks = item % KSr;
  item /= KSr;
  const int slot = item / per;
  b.row0 = (item % per) * 32 * WARPS;
  for (int i = threadIdx.x; i < (E + 31) / 32; i += blockDim.x) flags[i] = 0u;
  __syncthreads();
  for (int i = threadIdx.x; i < n_ids; i += blockDim.x) {
    const long long e = i == (int)threadIdx.x ? first : ids[i];
    const bool ok = e >= 0 && e < E;
    if (ok) atomicOr(&flags[e >> 5], 1u << (e & 31));
    if (n_ids <= SID_CAP) sid[i] = ok ? (short)e : (short)-1;
  }
  __syncthreads();
  int left = slot;
  b.expert = -2;
  for (int w = 0; w < (E + 31) / 32; ++w) {
    u32 f = flags[w];
    int c = __popc(f);
    if (left < c) {
      for (int k = 0; k < left; ++k) f &= f - 1u;
      b.expert = w * 32 + __ffs(f) - 1;
      break;
    }
    left -= c;
  }
  return b.expert >= 0;
}

// Grid position `idx` -> the find_block item, where the shared expert's `shared` items run first though find_block
// numbers them after the `routed` ones (FC1's grid; moe_experts' FC2 tickets).
__device__ __forceinline__ int shared_first(int idx, int shared, int routed) {
  return idx < shared ? routed + idx : idx - shared;
}

// A block's row of the per-expert counters (FOLD_ACT's act chunks, QUEUE's readiness): its routed expert, or E + its
// shared column group.
__device__ __forceinline__ int counter_row(const Block& b, int E) {
  return b.expert >= 0 ? b.expert : E + max(b.grp, 0);
}

// Token n's first slot k with ids[n topk + k] == expert, as n topk + k (-1: none); ids are find_block's kept
// shorts or the routing's long longs.
template <class Id>
__device__ __forceinline__ int slot_of(const Id* ids, int n, int topk, int expert) {
  for (int k = 0; k < topk; ++k)
    if (ids[n * topk + k] == expert) return n * topk + k;
  return -1;
}

// The tokens this block works on, compacted: pair[n] = the row of h / y of token n (routed: n * topk + slot or -1;
// shared: T * topk + n), tok[c] = the c-th token with a pair (in token order), *cnt their number. The MMA's columns
// are c < cnt, so a routed expert that 3 of 16 tokens picked runs one 8-column tile and stages 3 rows, not 16.
// `masks`: WARPS words of shared scratch; `sid`: the ids find_block kept (when T * topk <= SID_CAP).
__device__ void find_tokens(int* pair, int* tok, int* cnt, u32* masks, const long long* ids, int T, int topk,
                            int expert, const short* sid) {
  const bool kept = T * topk <= SID_CAP;
  for (int n = threadIdx.x; n < T; n += blockDim.x) {
    int p = -1;
    if (expert < 0) {
      p = T * topk + n;
    } else {
      p = kept ? slot_of(sid, n, topk, expert) : slot_of(ids, n, topk, expert);
    }
    pair[n] = p;
  }
  __syncthreads();
#if TMAX <= 32
  if (threadIdx.x < 32) {  // one warp compacts by ballot
    const int n = threadIdx.x;
    const bool has = n < T && pair[n] >= 0;
    const u32 mask = __ballot_sync(0xffffffffu, has);
    if (has) tok[__popc(mask & ((1u << n) - 1u))] = n;
    if (n == 0) *cnt = __popc(mask);
  }
#else
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n = threadIdx.x, warps = (T + 31) >> 5;
  const bool has = n < T && pair[n] >= 0;  // warp w compacts tokens 32 w .. 32 w + 31 by ballot
  const u32 mask = warp < warps ? __ballot_sync(0xffffffffu, has) : 0u;
  if (lane == 0) masks[warp] = mask;
  __syncthreads();
  if (warp < warps) {
    int base = 0;
    for (int w = 0; w < warp; ++w) base += __popc(masks[w]);
    if (has) tok[base + __popc(mask & ((1u << lane) - 1u))] = n;
    if (warp == warps - 1 && lane == 0) *cnt = base + __popc(mask);
  }
#endif
  __syncthreads();
}

// A block's column groups, MAXT columns each, over its compacted columns [c0, c1): routed blocks every group of their
// cnt columns in turn (more than one only when more than MAXT tokens picked the expert: each further group reads the
// CTA's weights again, from L2 where they still are), shared blocks their own group of the T tokens. The block and
// its range wait in shared memory, read back (volatile) at each group: with them in registers across the GEMV,
// offline sm_90a, FC2 at NT 2 took 221-243 registers instead of 168. Even so a loop over groups made the 8- and
// 16-token builds' FC1 spill (88 / 184 bytes) and those builds 2-4% slower (T = 4, 16 on the H200, session 23), so
// only the looping builds (GROUPS > 1: NT 1 for 9..NT1_MAX_TOKENS tokens, NT 2 above) loop (for_groups); the 8-token
// build runs its one group as before.
struct Groups {
  Block b;
  int c0, c1;
};

__device__ __forceinline__ void put_groups(Groups* gs, const Block& b, int cnt) {
  if (threadIdx.x == 0) {
    gs->b = b;
    gs->c0 = b.grp < 0 ? 0 : b.grp * MAXT;
    gs->c1 = b.grp < 0 ? cnt : min(cnt, gs->c0 + MAXT);
  }
  __syncthreads();
}

// Group i of the block (false past its last): the block and the group's first column / column count.
__device__ __forceinline__ bool get_group(const Groups* gs, int i, Block& b, int& c0, int& n) {
  const volatile Groups* v = gs;
  c0 = v->c0 + i * MAXT;
  n = min(MAXT, v->c1 - c0);
  b.expert = v->b.expert;
  b.row0 = v->b.row0;
  b.ks = v->b.ks;
  b.KS = v->b.KS;
  b.grp = v->b.grp;
  return n > 0;
}

// run(block, c0, n) for each column group of the block (cnt columns; the looping builds), through shared memory as
// above, with a barrier between groups (the next one overwrites the staged columns).
template <class Run>
__device__ __forceinline__ void for_groups(Groups* gs, const Block& b, int cnt, Run run) {
  put_groups(gs, b, cnt);
  Block g;
  int c0, n;
  for (int i = 0; get_group(gs, i, g, c0, n); ++i) {
    if (i) __syncthreads();
    run(g, c0, n);
  }
}
