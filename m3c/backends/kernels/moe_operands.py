"""Operands of the MegaMoE tensor-core tiles: stored weights (NVFP4, MXFP8, bf16) decoded in registers, activation
tiles, the per-row factor of the accumulator, and the tiles' a @ b^T dot.

Shared by the grouped-GEMM tiles (:mod:`m3c.backends.kernels.moe_prefill`) and the weight-stationary decode
tiles (:mod:`m3c.backends.kernels.moe_swap`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import TWO_120, e2m1_tiny, e4m3_big, e4m3_tiny, e8m0_to_f32


@triton.jit
def nvfp4_bytes(d_ptr, s_ptr, rows, k0, K: tl.constexpr, BK: tl.constexpr):
    """The packed codes [BN, BK/2] (uint8) and E4M3 scale bytes [BN, BK/16] of rows × columns [k0, k0 + BK)."""
    codes = tl.load(d_ptr + rows[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :])
    sb = tl.load(s_ptr + rows[:, None] * (K // 16) + (k0 // 16 + tl.arange(0, BK // 16))[None, :])
    return codes, sb


@triton.jit
def w_tile(d_ptr, s_ptr, rows, k0, K: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           DOT_F32: tl.constexpr):
    """Weight rows `rows` (int64 [BN]) × columns k0..k0+BK as the dot operand [BN, BK].

    FMT 2 (NVFP4) comes × 2^-7 and without its per-row tensor scale (``row_factor(..., 128.0)``); FMT 1 (MXFP8)
    and FMT 0 (bf16) are exact values. bf16 dots get bf16 (exact for NVFP4 and MXFP8 products).
    """
    if FMT == 2:
        b, sb = nvfp4_bytes(d_ptr, s_ptr, rows, k0, K, BK)
        b = b.to(tl.int32)
        sc = e4m3_big(sb.to(tl.int32))[:, :, None]
        lo = tl.reshape(tl.reshape(e2m1_tiny(b, 0), [BN, BK // 16, 8]) * sc, [BN, BK // 2])
        hi = tl.reshape(tl.reshape(e2m1_tiny(b, 4), [BN, BK // 16, 8]) * sc, [BN, BK // 2])
        w = tl.reshape(tl.join(lo, hi), [BN, BK])  # element 2i: low nibble, 2i + 1: high nibble
    elif FMT == 1:
        b = tl.load(d_ptr + rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :]).to(tl.int32)
        v = e4m3_tiny(b) * TWO_120
        sb = tl.load(s_ptr + rows[:, None] * (K // 32) + (k0 // 32 + tl.arange(0, BK // 32))[None, :])
        s = e8m0_to_f32(sb.to(tl.int32))
        w = tl.reshape(tl.reshape(v, [BN, BK // 32, 32]) * s[:, :, None], [BN, BK])
    else:
        w = tl.load(d_ptr + rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
    return dot_operand(w, DOT_F32)


@triton.jit
def dot_operand(v, DOT_F32: tl.constexpr):
    """v in the dots' operand dtype: float32 (IEEE dots) or bf16 (tensor-core dots)."""
    if DOT_F32:
        out = v.to(tl.float32)
    else:
        out = v.to(tl.bfloat16)
    return out


@triton.jit
def dot_nt(a, b, acc, DOT_F32: tl.constexpr):
    """acc + a @ b^T (a [M, k], b [N, k]; IEEE float32 products for float32 operands)."""
    if DOT_F32:
        res = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        res = tl.dot(a, tl.trans(b), acc)
    return res


@triton.jit
def a_tile(row_ptrs, cols, valid, DOT_F32: tl.constexpr):
    """Activation rows (pointers [BM, 1]) × columns `cols` as a dot operand (float32 or bf16); 0 on invalid rows."""
    return dot_operand(tl.load(row_ptrs + cols[None, :], mask=valid[:, None], other=0.0), DOT_F32)


@triton.jit
def row_factor(g_ptr, rows, FMT: tl.constexpr, UNDO: tl.constexpr):
    """Per weight row factor [BN] of an accumulator: NVFP4's per-row tensor scale × UNDO (the power of two its
    decode left out), 1 for MXFP8 and bf16 rows."""
    if FMT == 2:
        return tl.load(g_ptr + rows) * UNDO
    return tl.full(rows.shape, 1.0, tl.float32)
