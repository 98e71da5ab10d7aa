"""MegaMoE decode tiles on the tensor cores, weight-stationary ("swap" tiles): weights are the MMA's M operand.

Why: at T <= 64 tokens an expert sees a handful of rows, so the tensor-core grouped-GEMM tiles (tokens as M)
waste most of each MMA, and the CUDA-core GEMV tiles spend ~8.5 SASS instructions per weight (Nsight Compute on
the H200 at T = 1: FC1 110 µs, FC2 52 µs, long-scoreboard stalls, 39-57% issue-busy) — far above the ~1 that
the 4.28 TB/s byte floor allows. Here a program owns BN weight rows (FC1: BN gate + BN up rows) × one tile of
BM <= 16.. tokens of one expert, so ``acc[BN, BM] += W[BN, BK] @ x[BM, BK]^T``: the tokens are the MMA's N
(padded to BM, 16: unused columns are free), every weight byte is read once per (expert, row tile), and the
same code serves T = 1 .. 64.

NVFP4 decode (bf16 dots, ~2.5 instructions per weight): four code bytes (8 weights of one 16-column scale
group) give two bf16x2 registers of low nibbles and two of high nibbles by constant shifts and masks — the
nibble's bits placed as sign + lowest exponent bits + top mantissa bit, so every code (E2M1 e = 0 on
subnormals too) reads as value × 2^-126 — then one ``mul.rn.bf16x2`` by the group's E4M3 scale × 2^117 makes
each weight value × scale × 2^-9, exactly (<= 6 significant bits; 2^-19 .. 6·448·2^-9 ≈ 5.25 in magnitude). The per-row
tensor scale × 2^9 is applied once to the accumulator. A register holds the nibbles 16 bits apart in the word
(columns 8j + {0, 4}, {2, 6} low; {1, 5}, {3, 7} high), so the K order inside each 8-column group is
permuted — the activation columns are loaded in the same order (``swap_cols``), which a dot does not notice.
The PTX takes four consecutive code bytes per call: each thread must hold >= 4 of a step's bytes, i.e.
bn · bk / 2 >= 4 · 32 · warps (``moe_prefill._check_tiles`` enforces it; the compile test checks the layout).
float32 activations and Triton's interpreter (no PTX) take the same values from float32 arithmetic and IEEE
dots, with the same permutation. MXFP8 / bf16 weights (the shared expert) use :func:`w_tile` (float32 decode,
element order).

Loads: ``PIPE`` = 0 keeps the next K step's bytes in flight in registers; n >= 1 hands the loop to Triton's
pipeliner (``num_stages = n``, cp.async through shared memory). Which is faster is measured
(``benchmarks/bench_moe_gemv_tiles.py``), not assumed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import e2m1_tiny, e4m3_big, to_stored
from m3c.backends.kernels.moe_operands import a_tile, dot_nt, nvfp4_bytes, row_factor, w_tile


def _bf16_pair_asm(eem_shift: int, sign_shift: int) -> str:
    """PTX for one bf16x2 output: the nibbles at bits p and p + 16 of $2 (p = 6 - eem_shift) as value × 2^-126,
    times the scale pair in $3 (a negative shift shifts right)."""
    def sh(dst: str, n: int) -> str:
        return f"shl.b32 {dst}, $2, {n}; " if n >= 0 else f"shr.b32 {dst}, $2, {-n}; "
    return (sh("a", eem_shift) + "and.b32 a, a, 0x01C001C0; " + sh("b", sign_shift)
            + "and.b32 b, b, 0x80008000; or.b32 a, a, b; ")


def _nvfp4_asm(shifts: tuple[tuple[int, int], tuple[int, int]]) -> str:
    lo, hi = shifts
    return ("{ .reg .b32 a, b; " + _bf16_pair_asm(*lo) + "mul.rn.bf16x2 $0, a, $3; "
            + _bf16_pair_asm(*hi) + "mul.rn.bf16x2 $1, a, $3; }")


# (eem shift, sign shift) of the two registers of each call: low nibbles at bits 0 / 16 and 8 / 24; high nibbles
# at bits 4 / 20 and 12 / 28. Element order per 4 bytes: low call (c0, c4, c2, c6), high call (c1, c5, c3, c7).
NVFP4_SHIFTS_LO = ((6, 12), (-2, 4))
NVFP4_SHIFTS_HI = ((2, 8), (-6, 0))
_ASM_LO = tl.constexpr(_nvfp4_asm(NVFP4_SHIFTS_LO))
_ASM_HI = tl.constexpr(_nvfp4_asm(NVFP4_SHIFTS_HI))


@triton.jit
def swap_cols(HB: tl.constexpr):
    """Weight column of element i of a step's low-nibble operand [.., HB] (the high one: + 1): 8j + 2·perm(r),
    i = 4j + r, perm = (0, 2, 1, 3) — the order the PTX decode leaves the nibbles in."""
    i = tl.arange(0, HB)
    r = i % 4
    return (i - r) * 2 + ((r % 2) * 2 + r // 2) * 2


@triton.jit
def _perm4(v, BN: tl.constexpr, HB: tl.constexpr):
    """Elements (4j, 4j + 1, 4j + 2, 4j + 3) -> (4j, 4j + 2, 4j + 1, 4j + 3) along the last dim of [BN, HB]."""
    return tl.reshape(tl.permute(tl.reshape(v, [BN, HB // 4, 2, 2]), (0, 1, 3, 2)), [BN, HB])


@triton.jit
def _nvfp4_halves(codes, sb, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
    """Decoded low / high-nibble operands [BN, BK/2] (value × scale × 2^-9, `swap_cols` order)."""
    HB: tl.constexpr = BK // 2
    f = e4m3_big(sb.to(tl.int32)) * 0.25  # the group scale × 2^117 (exact; NaN kept)
    if DOT_F32:  # float32 values, element order, then the PTX's permutation
        ci = codes.to(tl.int32)
        fb = tl.reshape(tl.broadcast_to(f[:, :, None], [BN, BK // 16, 8]), [BN, HB])
        lo = _perm4(e2m1_tiny(ci, 0) * fb, BN, HB)
        hi = _perm4(e2m1_tiny(ci, 4) * fb, BN, HB)
    else:
        bits = f.to(tl.int32, bitcast=True) >> 16  # bf16 bits (the low 16 float bits are zero)
        pair = (bits & 0xFFFF) | (bits << 16)
        pair = tl.reshape(tl.broadcast_to(pair[:, :, None], [BN, BK // 16, 8]), [BN, HB])
        lo = tl.inline_asm_elementwise(_ASM_LO, "=r,=r,r,r,r,r,r", [codes, pair], dtype=tl.bfloat16, is_pure=True,
                                       pack=4)
        hi = tl.inline_asm_elementwise(_ASM_HI, "=r,=r,r,r,r,r,r", [codes, pair], dtype=tl.bfloat16, is_pure=True,
                                       pack=4)
    return lo, hi


@triton.jit
def _nvfp4_step(codes, sb, xrow, valid, cols, acc, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + one K step: the decoded low / high nibbles against the activations at columns cols / cols + 1."""
    xl = a_tile(xrow, cols, valid, DOT_F32)
    xh = a_tile(xrow, cols + 1, valid, DOT_F32)
    lo, hi = _nvfp4_halves(codes, sb, BN, BK, DOT_F32)
    return dot_nt(hi, xh, dot_nt(lo, xl, acc, DOT_F32), DOT_F32)


@triton.jit
def _gemm_rows(xrow, valid, d_ptr, s_ptr, rows, acc, K: tl.constexpr, FMT: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, DOT_F32: tl.constexpr, PIPE: tl.constexpr):
    """acc [BN, BM] + W[rows] @ x[tile rows]^T over K (NVFP4 bytes prefetched a step ahead when PIPE = 0)."""
    if FMT == 2:
        cols = swap_cols(BK // 2)
        if PIPE == 0:
            codes, sb = nvfp4_bytes(d_ptr, s_ptr, rows, 0, K, BK)
            for k0 in range(0, K, BK):
                codes_n, sb_n = nvfp4_bytes(d_ptr, s_ptr, rows, tl.minimum(k0 + BK, K - BK), K, BK)
                acc = _nvfp4_step(codes, sb, xrow, valid, k0 + cols, acc, BN, BK, DOT_F32)
                codes = codes_n
                sb = sb_n
        else:
            for k0 in tl.range(0, K, BK, num_stages=PIPE):
                codes, sb = nvfp4_bytes(d_ptr, s_ptr, rows, k0, K, BK)
                acc = _nvfp4_step(codes, sb, xrow, valid, k0 + cols, acc, BN, BK, DOT_F32)
    else:
        kk = tl.arange(0, BK)
        NS: tl.constexpr = PIPE if PIPE > 1 else 1
        for k0 in tl.range(0, K, BK, num_stages=NS):
            acc = dot_nt(w_tile(d_ptr, s_ptr, rows, k0, K, FMT, BN, BK, DOT_F32), a_tile(xrow, k0 + kk, valid, DOT_F32),
                         acc, DOT_F32)
    return acc


@triton.jit
def fc1_swap(x_ptr, tok, valid, wd_ptr, ws_ptr, wg_ptr, row0, n0, out_ptr, out_rows, H: tl.constexpr,
             N: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             DOT_F32: tl.constexpr, PIPE: tl.constexpr):
    """out[out_rows[m], n0 + n] = SiLU(g) · u for the tile's token rows m (x[tok[m]]), g / u from gate rows
    row0 + n0 + n and up rows row0 + N + n0 + n."""
    rg = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    ru = rg + N
    xrow = x_ptr + tok.to(tl.int64)[:, None] * H
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    g = _gemm_rows(xrow, valid, wd_ptr, ws_ptr, rg, acc, H, FMT, BN, BK, DOT_F32, PIPE)
    u = _gemm_rows(xrow, valid, wd_ptr, ws_ptr, ru, acc, H, FMT, BN, BK, DOT_F32, PIPE)
    g = g * row_factor(wg_ptr, rg, FMT, 512.0)[:, None]
    u = u * row_factor(wg_ptr, ru, FMT, 512.0)[:, None]
    a = g * tl.sigmoid(g) * u
    cols = n0 + tl.arange(0, BN)
    ptrs = out_ptr + out_rows.to(tl.int64)[None, :] * N + cols[:, None]
    tl.store(ptrs, to_stored(a, out_ptr.dtype.element_ty), mask=valid[None, :])


@triton.jit
def fc2_swap(a_ptr, arows, valid, wd_ptr, ws_ptr, wg_ptr, row0, n0, wt, y_ptr, yrows, K: tl.constexpr,
             H: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             DOT_F32: tl.constexpr, PIPE: tl.constexpr):
    """y[yrows[m], n0 + n] = (act[arows[m]] @ W[row0 + n0 + n]^T) · wt[m] (wt: routing weight per token row)."""
    rw = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    arow = a_ptr + arows.to(tl.int64)[:, None] * K
    acc = _gemm_rows(arow, valid, wd_ptr, ws_ptr, rw, tl.zeros([BN, BM], dtype=tl.float32), K, FMT, BN, BK, DOT_F32,
                     PIPE)
    acc = acc * row_factor(wg_ptr, rw, FMT, 512.0)[:, None] * wt[None, :]
    cols = n0 + tl.arange(0, BN)
    ptrs = y_ptr + yrows.to(tl.int64)[None, :] * H + cols[:, None]
    tl.store(ptrs, to_stored(acc, y_ptr.dtype.element_ty), mask=valid[None, :])
