// Helpers shared by the CUDA C++ kernels of this directory (included by each .cu; no system headers): integer
// types, shared-memory addresses (smem_u32), streaming loads, byte permutes, f16 / E4M3 / bf16 conversions, the
// mma.sync m16n8k16 f16 -> f32 MMA and the natural-order NVFP4 decode (decode8).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// Programmatic dependent launch (sm_90+; launchers set CudaKernelSpec.pdl): grid_wait() returns once the previous
// grid on the stream has finished and its writes are visible (at once when the launch was not programmatic), so a
// kernel reads its predecessor's outputs, and writes anything, only after it; grid_launch_dependents() lets the next
// grid start launching (its CTAs run their own prologue, then wait in grid_wait()).
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ int arrive(int* counter) {  // atomicAdd(counter, 1), acq_rel at GPU scope
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// A spin's load (GPU scope, relaxed): no L1 invalidation each turn, unlike ld.acquire's CCTL.IVALL (QUEUE timed the
// same either way, benchmarks/RESULTS.md session 34; this is the usual form of a spin). End the spin with
// fence_acq_rel_gpu.
__device__ __forceinline__ int ld_relaxed(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// After a relaxed load or a release atomic saw a release: orders the thread's later loads after it (the fence
// form of an acquire; also a release fence).
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ void release_add(int* p) {  // *p += 1 after the thread's earlier stores (GPU scope)
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(p) : "memory");
}

__device__ __forceinline__ int arrive_release(int* counter) {  // atomicAdd(counter, 1), release at GPU scope
  int old;
  asm volatile("atom.release.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// Whether this CTA is the last of `expect` to arrive at *counter (the same answer in every thread; every thread must
// call it): a barrier, then one thread's atomic (release: cumulative over the CTA's stores the barrier ordered
// before it; acquire: the other CTAs' stores before the last CTA's loads, which must read L2: ld.cg). ACQ_LAST: the
// atomic is a release only and the last CTA alone fences (fence_acq_rel_gpu), so only it invalidates its SM's L1
// (the acq_rel atomic's CCTL.IVALL: in every arriving CTA otherwise; timed no faster, session 34). The last CTA
// stores 0 to *counter (the next launch, or a CUDA-graph replay, finds it zero). `flag`: an int of shared memory.
template <bool ACQ_LAST = false>
__device__ __forceinline__ bool last_to_arrive(int* counter, int expect, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const int last = (ACQ_LAST ? arrive_release(counter) : arrive(counter)) == expect - 1;
    if (last) {
      if (ACQ_LAST) fence_acq_rel_gpu();
      *(volatile int*)counter = 0;
    }
    *flag = last;
  }
  __syncthreads();
  return *flag;
}

// A shared-memory pointer as the 32-bit shared-window address the mbarrier, bulk-copy and wgmma operands take.
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ uint4 ld_stream4(const u8* p) {  // 16 bytes read once: no L1 allocation
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 e4m3x2_lo(u32 v) {  // the two E4M3 bytes in v's low half -> f16x2 (exact)
  u32 r;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ u32 e4m3x2_hi(u32 v) {  // ... in v's high half
  u32 r;
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %1; cvt.rn.f16x2.e4m3x2 %0, h; }" : "=r"(r) : "r"(v));
  return r;
}
__device__ __forceinline__ u16 bf16_bits(float v) {  // round to nearest even
  u16 b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
  return b;
}
__device__ __forceinline__ float bf16_round(float v) { return __uint_as_float(((u32)bf16_bits(v)) << 16); }
// SiLU(gate) * up as the reference's bf16 model computes it: gate, up, SiLU(gate) and the product rounded to bf16.
__device__ __forceinline__ float silu_mul_bf16(float gate, float up) {
  const float g = bf16_round(gate), u = bf16_round(up);
  return bf16_round(bf16_round(g / (1.f + __expf(-g))) * u);
}
__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// d += A (16 x 16, row) . B (16 x 8, col), f16 inputs, f32 accumulators (the lane's fragments).
__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// One E4M3 scale byte (byte `i` of `w`) as the f16x2 pair (s, s).
__device__ __forceinline__ u32 scale_pair(u32 w, u32 i) { return e4m3x2_lo(prmt(w, 0u, i | (i << 4))); }

// Eight E2M1 codes in their natural packing (nibble i of w = element i) -> four f16x2 pairs p[i] = (element 2i,
// element 2i + 1): magnitudes by one byte lookup each (f16 high bytes of 0, .5, 1, 1.5 | 2, 3, 4, 6), the sign bits
// gathered to each byte's bit 7 (even elements' from w << 4, odd elements' from w), then spread to 16-bit halves.
__device__ __forceinline__ void decode8(u32 w, u32* p) {
  const u32 m = w & 0x77777777u;
  u32 oa = prmt(0x3E3C3800u, 0x46444240u, m);
  u32 ob = prmt(0x3E3C3800u, 0x46444240u, m >> 16);
  const u32 w4 = w << 4;
  oa |= prmt(w4, w, 0x5140u) & 0x80808080u;
  ob |= prmt(w4, w, 0x7362u) & 0x80808080u;
  p[0] = prmt(oa, 0u, 0x1404u);
  p[1] = prmt(oa, 0u, 0x3424u);
  p[2] = prmt(ob, 0u, 0x1404u);
  p[3] = prmt(ob, 0u, 0x3424u);
}

__device__ __forceinline__ uint2 ld_stream2(const u8* p) {  // 8 bytes read once: no L1 allocation
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// 32 consecutive bf16 values (16-byte aligned) as floats, zeros where !ok.
__device__ __forceinline__ void load_bf16x32(const u16* src, bool ok, float (&x)[32]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 v = ok ? ((const uint4*)src)[i] : make_uint4(0u, 0u, 0u, 0u);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
      x[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    }
  }
}

// The exponent e with m * 2^-e in [2^14, 2^15) (f16 staging that never clips) for m > 0, float32 subnormals
// included (e down to -163); 0 for m = 0.
__device__ __forceinline__ int staging_exp(float m) {
  const u32 bits = __float_as_uint(m);
  return m > 0.f ? ((bits >> 23) & 0xFF ? (int)((bits >> 23) & 0xFF) - 127 : -149 + 31 - __clz(bits)) - 14 : 0;
}
