// moe_experts (QUEUE): the MegaMoE decode's FC1 and FC2 items in ONE persistent launch, for the folded builds
// (moe_decode_mma.cu, included at its end). Its CTAs (as many as are resident at once) take tickets from a counter:
// tickets [0, n1) are moe_fc1's grid items in its order (the shared expert's first), [n1, n1 + n2) moe_fc2's with the
// shared expert's first too (FC1 finishes its act first). An FC2 item finds its block and tokens and asks L2 for its
// first weights, then waits only for its own expert's act (wait_ready), not for the whole of FC1: so FC2 streams
// while FC1's last CTAs drain (benchmarks/RESULTS.md session 33: T = 1 lost 16 us to ramps and drains inside the two
// launches, 0.9 us between them). Deadlock-free without a cooperative launch: tickets are drawn in increasing order
// by running CTAs, FC1 items wait on nothing, and every FC2 item waits only on FC1 items (smaller tickets, held by
// running CTAs). Every CTA draws one ticket past the last item; the one drawing the very last zeroes the counter for
// the next launch (so graph replays need no reset).
#pragma once

#if TIMELINE  // (the probe: FC2's items stamp rows n1 .. n1 + n2 - 1)
#define TL_ARG2 , tl + (long)n1 * 8
#else
#define TL_ARG2
#endif

extern "C" __global__ void FC_BOUNDS
moe_experts(const void* x, const u16* x16, const float* xmult, int T, const long long* ids, int topk, int E,
            int n_slots, const u8* rcode, const u8* rscale, const float* rrow, int rows, const u8* scode,
            const u8* sscale, int srows, int H, int KSr, int KSs, float* h, int P, int ROWS, void* act, int* counters,
            const float* wts, const u8* rcode2, const u8* rscale2, const float* rrow2, const u8* scode2,
            const u8* sscale2, int I, int S, int KS2s, float* y, void* out, int* done, int* queue, int n1, int n2,
            TL_PARAM void* scratch0, void* scratch1) {
  __shared__ int ticket;
  // queue[0]: the ticket counter; ready [E + 1]: act chunks ready, consumed [E + 1]: FC2 blocks past their wait; each
  // 128 bytes (32 ints) after the previous, so the spinning loads do not share a line with the tickets' atomics
  int* ready = queue + 32;
  int* consumed = ready + ((E + 1 + 31) & ~31);
  const int shared2 = S > 0 ? H / (32 * WARPS) * KS2s * SHARED_GROUPS(T) : 0, routed2 = n2 - shared2;
  for (;;) {
    if (threadIdx.x == 0) ticket = atomicAdd(queue, 1);
    __syncthreads();
    const int t = ticket;
    __syncthreads();  // (read by every thread before thread 0 draws again)
    if (t >= n1 + n2) {
      if (threadIdx.x == 0 && t == n1 + n2 + (int)gridDim.x - 1) *(volatile int*)queue = 0;
      return;
    }
    if (t < n1) {
      fc1_item(t, x, x16, xmult, T, ids, topk, E, n_slots, rcode, rscale, rrow, rows, scode, sscale, srows, H, KSr,
               KSs, h, P, ROWS, act, counters TL_ARG, ready);
    } else {
      fc2_item(shared_first(t - n1, shared2, routed2), act, T, ids, wts, topk, E, n_slots, rcode2, rscale2, rrow2,
               scode2, sscale2, I, S, H, KS2s, P, ROWS, y, out, done TL_ARG2, ready, consumed);
    }
  }
}
