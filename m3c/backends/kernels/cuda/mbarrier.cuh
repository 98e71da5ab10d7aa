// mbarrier and bulk-copy (cp.async.bulk, SASS UBLKCP) helpers for kernels that stream into shared memory through
// a ring of stages: moe_prefill_ws.cu's producer / consumer warps, and benchmarks/probes/decode_ring.cu. Addresses
// are shared-memory offsets (u32: ptx_common.cuh's smem_u32). No system headers.
#pragma once

#include "ptx_common.cuh"

__device__ __forceinline__ void mbar_init(u32 a, u32 n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(n) : "memory");
}
// After a CTA's mbar_inits, before any other thread (or the bulk-copy unit) uses those barriers.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
// Arrive once this thread's earlier cp.async copies have landed (counted in the barrier's init count).
__device__ __forceinline__ void mbar_cp_arrive(u32 a) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(a) : "memory");
}
// One try: whether the barrier's phase of this parity has completed (try_wait may suspend the thread a while first).
__device__ __forceinline__ bool mbar_try_wait(u32 a, u32 parity) {
  u32 done;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(done) : "r"(a), "r"(parity) : "memory");
  return done;
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
  while (!mbar_try_wait(a, parity)) {
  }
}
// This thread's arrival, announcing `tx` bytes of bulk copies that complete on the barrier.
__device__ __forceinline__ void mbar_arrive_tx(u32 a, u32 tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(tx) : "memory");
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) from global to this CTA's shared memory, completing on `bar`.
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
