// sm_90a helpers shared by the wgmma kernels (moe_prefill_wgmma.cu, moe_prefill_ws.cu): cp.async, the wgmma
// fences and waits, shared-memory matrix descriptors, the 64-accumulator asm operand lists, E4M3 conversions and the
// NVFP4 -> E4M3 product-table decode of moe_cuda's prepacked words.
#pragma once

#include "ptx_common.cuh"

__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {  // 16 bytes, zeros when !ok
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// cp.async's writes (generic proxy) made visible to wgmma's reads of shared memory (async proxy).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most N wgmma groups are pending; `a` (the A registers of the group that must be done) stays live
// until here.
template <int N>
__device__ __forceinline__ void wg_wait(u32 (&a)[4]) {
  asm volatile("wgmma.wait_group.sync.aligned %4;" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3]) : "n"(N)
               : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {  // the compiler keeps the accumulators in place
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major B tile without swizzle: core matrices of 8 tokens x 8 K (128
// contiguous bytes), LBO = the distance between K-adjacent core matrices, SBO = between token-adjacent ones.
__device__ __forceinline__ unsigned long long smem_desc(u32 addr, u32 lbo, u32 sbo) {
  return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32);
}

// The 64 accumulator operands of an m64n128 wgmma (asm template text, then the constraints).
#define D64_TEXT \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"              \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"    \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"    \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define D64_OUT(d)                                                                                      \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),        \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),  \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// ... of an m64n256 wgmma.
#define D128_TEXT D64_TEXT "," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define D128_OUT(d) D64_OUT(d), D64_OUT((d + 64))

// f16x2 -> two E4M3 bytes (round to nearest even, saturating to +-448) in the low 16 bits.
__device__ __forceinline__ u32 f16x2_to_e4m3x2(u32 v) {
  u32 r;
  asm("{ .reg .b16 d; cvt.rn.satfinite.e4m3x2.f16x2 d, %1; cvt.u32.u16 %0, d; }" : "=r"(r) : "r"(v));
  return r;
}
// Two float32 values -> two E4M3 bytes (lo in bits 0-7, hi in 8-15; rn, saturating) in the low 16 bits.
__device__ __forceinline__ u32 f32x2_to_e4m3x2(float lo, float hi) {
  u32 r;
  asm("{ .reg .b16 d; cvt.rn.satfinite.e4m3x2.f32 d, %1, %2; cvt.u32.u16 %0, d; }" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// A lane's two E4M3 product tables of a 64-K chunk: byte i of (lo, hi) = E4M3(magnitude i x s x 2^-wexp) for the
// E2M1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6; `sp` = the f16x2 pair (s of row g, s of row g + 8) already x 2^-wexp.
__device__ __forceinline__ void e4m3_tables(u32 sp, u32 (&tg)[2], u32 (&tg8)[2]) {
  const u32 s0 = prmt(sp, 0u, 0x1010u), s8 = prmt(sp, 0u, 0x3232u);
  // f16x2 magnitude pairs: (0, .5), (1, 1.5), (2, 3), (4, 6)
  const u32 m01 = 0x38000000u, m23 = 0x3E003C00u, m45 = 0x42004000u, m67 = 0x46004400u;
  tg[0] = prmt(f16x2_to_e4m3x2(hmul2(s0, m01)), f16x2_to_e4m3x2(hmul2(s0, m23)), 0x5410u);
  tg[1] = prmt(f16x2_to_e4m3x2(hmul2(s0, m45)), f16x2_to_e4m3x2(hmul2(s0, m67)), 0x5410u);
  tg8[0] = prmt(f16x2_to_e4m3x2(hmul2(s8, m01)), f16x2_to_e4m3x2(hmul2(s8, m23)), 0x5410u);
  tg8[1] = prmt(f16x2_to_e4m3x2(hmul2(s8, m45)), f16x2_to_e4m3x2(hmul2(s8, m67)), 0x5410u);
}
// The product table of one E4M3 scale byte b (x 2^-wexp: `wdec`), as e4m3_tables makes it: byte i of (x, y) =
// E4M3(magnitude i x b x 2^-wexp). A kernel keeps all 256 in shared memory and looks tables up by scale byte.
__device__ __forceinline__ uint2 e4m3_table_of(u32 b, u32 wdec) {
  u32 tg[2], tg8[2];
  e4m3_tables(hmul2(e4m3x2_lo(b * 0x0101u), wdec), tg, tg8);
  return make_uint2(tg[0], tg[1]);
}
// A CTA's lookup table: the product table of each of the 256 scale bytes, made by `n` threads (this one: `tid`).
// The caller orders these shared stores before the first lookup with a barrier.
__device__ __forceinline__ void e4m3_lut_fill(uint2* lut, u32 wdec, int tid, int n) {
  for (int i = tid; i < 256; i += n) lut[i] = e4m3_table_of(i, wdec);
}
// The four tables of a lane's scale word sw (bytes: rows g, g + 8 of one 64-K chunk, then of the next): looked up in
// the CTA's table (FROM_LUT; e4m3_lut_fill), else made from sw's halves; the same tables either way.
template <bool FROM_LUT>
__device__ __forceinline__ void e4m3_stage_tables(const uint2* lut, u32 sw, u32 wdec, u32 (&tg)[2][2],
                                                  u32 (&tg8)[2][2]) {
  if (FROM_LUT) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint2 q = lut[(sw >> (16 * c)) & 0xFFu], q8 = lut[(sw >> (16 * c + 8)) & 0xFFu];
      tg[c][0] = q.x, tg[c][1] = q.y, tg8[c][0] = q8.x, tg8[c][1] = q8.y;
    }
  } else {
    e4m3_tables(hmul2(e4m3x2_lo(sw), wdec), tg[0], tg8[0]);
    e4m3_tables(hmul2(e4m3x2_hi(sw), wdec), tg[1], tg8[1]);
  }
}
// One lane's NVFP4 word of a 16-K step (nvfp4_frag's packing) -> E4M3 x 4 of row g (K e = 0..3, nibbles 0, 1, 4, 5)
// and of row g + 8 (nibbles 2, 3, 6, 7): magnitudes looked up in the rows' product tables, sign bits moved to bit 7.
__device__ __forceinline__ void nvfp4_e4m3(u32 w, const u32 (&tg)[2], const u32 (&tg8)[2], u32& rg, u32& rg8) {
  // signs: row g's at w bits 7, 15 (bytes 0, 1) and 3, 11 (bytes 0, 1 of w << 4); row g + 8's at 23, 31 and 19, 27
  const u32 m = w & 0x77777777u, w4 = w << 4;
  rg = prmt(tg[0], tg[1], prmt(m, 0u, 0x0020u)) | (prmt(w, w4, 0x5410u) & 0x80808080u);
  rg8 = prmt(tg8[0], tg8[1], prmt(m, 0u, 0x0031u)) | (prmt(w, w4, 0x7632u) & 0x80808080u);
}
