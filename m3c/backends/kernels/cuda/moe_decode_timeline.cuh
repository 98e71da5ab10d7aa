// The TIMELINE probe of the MegaMoE decode (moe_decode_mma.cu; a benchmark's, benchmarks/bench_moe_cta_timeline.py):
// with TIMELINE each FC1 / FC2 item's thread 0 writes 8 words of its row of tl: the %globaltimer at entry (slot 0),
// before its staging (1; QUEUE's FC2 items: after their readiness wait), after its GEMV's stores (2) and at exit
// (3), then its SM, expert (-1 shared, -2 an unused slot), K split and K range; without it the macros are empty.
// Macros from the including file: TIMELINE.
#pragma once

#include "ptx_common.cuh"

#if TIMELINE
typedef unsigned long long u64;
__device__ __forceinline__ void stamp(u64* tl, int slot) {  // thread 0: tl[slot] = %globaltimer (ns)
  if (threadIdx.x == 0) {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    tl[slot] = t;
  }
}
__device__ __forceinline__ void mark(u64* tl, int expert, int ks, int Kc) {  // what the CTA works on, where
  if (threadIdx.x == 0) {
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    tl[4] = sm;
    tl[5] = (u64)(long long)expert;
    tl[6] = ks;
    tl[7] = Kc;
  }
}
struct ExitStamp {  // stamps slot 3 on every way out of the kernel
  u64* tl;
  __device__ ~ExitStamp() { stamp(tl, 3); }
};
#define TL_PARAM u64* tl,  // (the last user argument)
#define TL_ARG , tl
#define STAMP(slot) stamp(tl, slot)
#define MARK(e, ks, kc) mark(tl, e, ks, kc)
#define STAMP_EXIT(row) tl += (long)(row) * 8; ExitStamp exit_stamp{tl}; stamp(tl, 0)  // the item's row of tl
#else
#define TL_PARAM
#define TL_ARG
#define STAMP(slot)
#define MARK(e, ks, kc)
#define STAMP_EXIT(row)
#endif
