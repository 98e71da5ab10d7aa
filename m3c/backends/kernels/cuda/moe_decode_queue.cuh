// moe_experts (QUEUE): the MegaMoE decode's FC1 and FC2 items in ONE persistent launch, for the folded builds
// (moe_decode_mma.cu, included at its end; its arguments: moe_fc1's, FC1_OWN_PARAMS, then FC2's own). Its CTAs (as
// many as are resident at once) claim items from counters, so an FC2 item waits only for its own expert's act
// (wait_ready), not for the whole of FC1: FC2 streams while FC1's last CTAs drain (benchmarks/RESULTS.md session 33:
// T = 1 lost 16 us to ramps and drains inside the two launches).
// - FC1's items come from two pools, the shared expert's [0, s1) and the routed experts' [s1, n1) (moe_fc1's grid
//   order), and a CTA's first claim is from the pool of ITS block's kind in moe_fc1's grid (block b < s1: shared).
//   The block scheduler spreads consecutive blocks over the SMs, so every SM gets moe_fc1's mix (at T = 1 three
//   routed items and one shared); one ticket counter for all of FC1 gave some SMs four routed items (885 KB) and
//   others four shared (541 KB), and an SM streams at most ~1/132 of HBM: QUEUE ran 72.5 us against 58.8
//   (benchmarks/RESULTS.md session 34).
// - FC2's items, shared expert's first, then the end tickets come from the ticket counter queue[0].
// Deadlock-free without a cooperative launch: a CTA takes an FC2 ticket only once it has seen both FC1 pools empty
// (every FC1 item claimed by a running CTA, and FC1 items wait on nothing), so every FC2 wait ends. Each CTA takes one
// end ticket; the one taking the last zeroes the three counters for the next launch (graph replays need no reset):
// every CTA fences once after its last pool operation, before any ticket (a release pattern with its ticket atomics),
// and the zeroing CTA fences after its end ticket (acquire), so every pool operation comes before the zeroing.
#pragma once

#if TIMELINE  // (the probe: FC2's items stamp rows n1 .. n1 + n2 - 1)
#define TL_ARG2 , tl + (long)n1 * 8
#else
#define TL_ARG2
#endif

// An item from a pool of `size` items numbered from `base` (an FC1 pool), or -1 if it is empty.
__device__ __forceinline__ int claim(int* pool, int size, int base) {
  const int i = atomicAdd(pool, 1);
  return i < size ? base + i : -1;
}

extern "C" __global__ void FC_BOUNDS
moe_experts(FC1_OWN_PARAMS const float* wts, const u8* rcode2, const u8* rscale2, const float* rrow2,
            const u8* scode2, const u8* sscale2, int I, int S, int KS2s, float* y, void* out, int* done, int* queue,
            int n1, int n2, TL_PARAM void* scratch0, void* scratch1) {
  __shared__ int ticket, first, fc1_left;  // (thread 0's: in shared memory, not held in registers across the items)
  // queue[0]: FC2's ticket counter, then the shared and the routed FC1 pools; ready [E + 1]: act chunks ready,
  // consumed [E + 1]: FC2 blocks past their wait; each 128 bytes (32 ints) after the previous, so the spinning loads
  // do not share a line with the atomics
  int *pool_s = queue + 32, *pool_r = queue + 64, *ready = queue + 96;
  int* consumed = ready + ((E + 1 + 31) & ~31);
  const int shared2 = S > 0 ? H / (32 * WARPS) * KS2s * SHARED_GROUPS(T) : 0, routed2 = n2 - shared2;
  if (threadIdx.x == 0) first = fc1_left = 1;
  for (;;) {
    if (threadIdx.x == 0) {
      const int s1 = srows / (32 * WARPS) * KSs * SHARED_GROUPS(T), r1 = n1 - s1;
      int t = -1;
      if (first) {  // the pool of this block's kind in moe_fc1's grid
        first = 0;
        if ((int)blockIdx.x < s1) t = claim(pool_s, s1, 0);
        else if ((int)blockIdx.x < n1) t = claim(pool_r, r1, s1);
      }
      if (t < 0 && fc1_left) {  // (two loads at once: a claim only where one may be left)
        const int cs = ld_relaxed(pool_s), cr = ld_relaxed(pool_r);
        if (cr < r1) t = claim(pool_r, r1, s1);
        if (t < 0 && cs < s1) t = claim(pool_s, s1, 0);
        fc1_left = t >= 0;  // (a failed claim: that pool is empty; the other was seen empty or failed too)
        // no pool operation after this: they all come before its FC2 and end tickets (release; the zeroing acquires)
        if (!fc1_left) fence_acq_rel_gpu();
      }
      ticket = t >= 0 ? t : n1 + atomicAdd(queue, 1);
    }
    __syncthreads();
    const int t = ticket;
    __syncthreads();  // (read by every thread before thread 0 draws again)
    if (t >= n1 + n2) {
      if (threadIdx.x == 0 && t == n1 + n2 + (int)gridDim.x - 1) {
        fence_acq_rel_gpu();  // (every CTA's pool operations, released before its end ticket, before these stores)
        *(volatile int*)queue = 0;
        *(volatile int*)pool_s = 0;
        *(volatile int*)pool_r = 0;
      }
      return;
    }
    if (t < n1) {
      fc1_item(t, FC1_ARGS, ready);
    } else {
      fc2_item(shared_first(t - n1, shared2, routed2), act, T, ids, wts, topk, E, n_slots, rcode2, rscale2, rrow2,
               scode2, sscale2, I, S, H, KS2s, P, ROWS, y, out, done TL_ARG2, ready, consumed);
    }
  }
}
