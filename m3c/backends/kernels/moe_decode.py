"""MegaMoE decode (T <= 64 tokens): NVFP4 routed experts + MXFP8 / bf16 shared expert in ONE persistent launch.

Semantics: ``out[t] = sum_j w[t, j] · FC2_e(SiLU(FC1g_e(x_t)) · FC1u_e(x_t)) + FC2_s(SiLU(FC1g_s(x_t)) · FC1u_s(x_t))``
with ``e = topk_ids[t, j]``, exactly ``m3c.model_defs.layers.MoE.forward`` after routing (FC1 rows are
gate then up; ``w`` are the routing weights, float32). Routed weights are NVFP4 ``[E, N, K/2]`` codes,
E4M3 per-16 scales ``[E, N, K/16]`` and float32 per-row tensor scales ``[E, N, 1]``; the shared
expert's are MXFP8 (E4M3 + E8M0 per-32) or bf16. Activations are bf16 (bf16 tensor-core dots,
float32 accumulation) or float32 (IEEE FMA dots: same sums as the float32 reference up to order).

Byte floor (what must cross HBM once per step): every TOUCHED expert's NVFP4 weights, 3·H·I·0.5625 B
each (15.9 MB at H = 6144, I = 1536: 8 experts at T = 1 are 127 MB = 29.7 µs at 4.28 TB/s), plus the
shared expert (3·H·S·1.03 B for MXFP8: 29.2 MB = 6.8 µs). Activations, routing and the float32
partials (T·(k+1)·H·4 B, L2-resident) are small beside. FLOPs (2·3·H·I per (token, expert)) are
far below the tensor-core roof at T <= 64: the kernel is memory- and dequant-bound.

Design — one persistent launch, work items taken from an atomic ticket counter, in this order:
  1. shared FC1 items (one per BN1 rows of S), 2. routed FC1 items (touched-expert slot × BN1 rows of
  I, slot-major), 3. shared FC2 items (one per BN2 rows of H), 4. routed FC2 items (slot × BN2 rows).
The item count is computed on the device from ``num_active`` (untouched experts cost nothing, not even
a ticket). An FC1 item streams its BN1 gate rows and BN1 up rows once over all of K = H for ALL the
expert's tokens (one M tile of MB = bucket(T) columns: the weight tile is the MMA's A operand, the
gathered tokens its B operand, so T = 1 wastes no weight bytes), dequantizing NVFP4 in registers
(E2M1 nibble bits placed into a float32 = value·2^-126, times the E4M3 scale decoded as scale·2^119:
exact, and exact in bf16 too; low nibbles meet the even K columns of x, high nibbles the odd ones, so
no interleave), then applies the per-row tensor scale (·2^7) and SiLU(gate)·up in float32 and writes
the activation row block (bf16 / float32) to a small workspace. An FC2 item of slot i first waits on
slot i's FC1 counter (all FC1 items are ticketed before any FC2 item and FC1 items never wait, so
the wait cannot deadlock, whatever the grid size or residency), streams its BN2 rows of W2 over
K = I, multiplies by the routing weight and writes one float32 partial row per (token, slot) — no
atomics on data. A per-H-tile counter elects the last FC2 item of that tile, which sums the tile's
partials in a fixed order (slots 0..k-1, then the shared expert) and writes ``out``: deterministic.
The last program to exit zeroes every counter, so the workspace is ready for the next launch (CUDA
graph replays included). Under Triton's interpreter programs run one after another: program 0 takes
every ticket in order, so each wait is already satisfied when reached.

Constexprs depend only on layout facts (H, I, S, k, formats, activation dtype) and the token bucket
MB ∈ {16, 32, 64}: :func:`decode_specs` lists every specialization the launcher can produce.

Limits (estimated before measuring; on the H200 it took 236 µs at T = 1 vs the 30 µs floor and lost to
the grouped-GEMM kernels at every T, so megamoe() no longer picks it by default — benchmarks/RESULTS.md): Triton pipelines the packed weight bytes through cp.async
(num_stages - 1 K steps ahead, ~24 KB in flight per SM at 2 programs/SM). The in-register dequant
costs ~4 integer + 1.5 float ops per weight (226 M weights at T = 1), i.e. ~40 µs of INT32 issue on
132 SMs: at T = 1 the kernel is likely dequant-issue-bound rather than at the 30 µs byte floor. The
next step would be packed bf16x2 decoding (``prmt`` + shift/LOP3 to two bf16 lanes, ``mul.bf16x2`` by
the scale), ~2 ops per weight, via inline PTX with this float path kept for the interpreter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import e2m1_tiny, e4m3_big, e4m3_to_f32, e8m0_to_f32
from m3c.backends.kernels.host import interpreting, num_sms
from m3c.backends.kernels.moe_prefill import nvfp4_row_scales
from m3c.backends.kernels.moe_routing import ExpertSegments
from m3c.backends.triton_aot import KernelSpec, Runner, jit_run
from m3c.errors import ShapeError
from m3c.model_defs import quant

MAX_DECODE_TOKENS = 64
PROGRAMS_PER_SM = 3  # persistent grid; programs that never become resident only take one (empty) ticket
SHARED_FMTS = {"none": 0, "mxfp8": 1, "bf16": 2}


# ---------------------------------------------------------------------------------------------- device code


@triton.jit
def _nvfp4_tile(w_ptr, s_ptr, rows, k0, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """Rows `rows` [R] × K columns [k0, k0+BK) of an NVFP4 matrix as (even, odd) column halves [R, BK/2], value·2^-7."""
    kb = tl.arange(0, BK // 2)
    b = tl.load(w_ptr + rows[:, None] * (K // 2) + (k0 // 2 + kb)[None, :]).to(tl.int32)
    sb = tl.load(s_ptr + rows[:, None] * (K // 16) + (k0 // 16 + tl.arange(0, BK // 16))[None, :]).to(tl.int32)
    sc = e4m3_big(sb)[:, :, None]
    lo = tl.reshape(tl.reshape(e2m1_tiny(b, 0), [R, BK // 16, 8]) * sc, [R, BK // 2])
    hi = tl.reshape(tl.reshape(e2m1_tiny(b, 4), [R, BK // 16, 8]) * sc, [R, BK // 2])
    if not F32:  # e2m1 × e4m3 has <= 6 significant bits: exact in bf16
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _shared_tile(w_ptr, s_ptr, rows, k0, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, FMT: tl.constexpr,
                 F32: tl.constexpr, NATIVE: tl.constexpr):
    """Rows [R] × columns [k0, k0+BK) of the shared expert's MXFP8 (FMT 1) or bf16 (FMT 2) matrix."""
    kk = tl.arange(0, BK)
    offs = rows[:, None] * K + (k0 + kk)[None, :]
    if FMT == 1:
        b = tl.load(w_ptr + offs)
        if NATIVE:
            v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:  # the interpreter's float8 conversions are not trusted: decode the bits
            v = e4m3_to_f32(b.to(tl.int32))
        sb = tl.load(s_ptr + rows[:, None] * (K // 32) + (k0 // 32 + tl.arange(0, BK // 32))[None, :]).to(tl.int32)
        v = tl.reshape(tl.reshape(v, [R, BK // 32, 32]) * e8m0_to_f32(sb)[:, :, None], [R, BK])
        if not F32:
            v = v.to(tl.bfloat16)  # rounds like the reference's dequantized(...).to(bf16)
    else:
        v = tl.load(w_ptr + offs)
        if F32:
            v = v.to(tl.float32)
    return v


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr):
    """acc += a @ b (IEEE float32 products for float32 operands, tensor-core bf16 otherwise)."""
    if F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _load_cols(ptr, rowoff, ok, k0, STEP: tl.constexpr, PH: tl.constexpr, BKX: tl.constexpr, F32: tl.constexpr):
    """x-like operand [BKX, MB]: columns k0 + STEP·c + PH (c < BKX) of rows at offsets `rowoff` [MB]."""
    c = tl.arange(0, BKX)
    v = tl.load(ptr + rowoff[None, :] + (k0 + STEP * c + PH)[:, None], mask=ok[None, :], other=0.0,
                cache_modifier=".cg")
    if F32:
        v = v.to(tl.float32)
    return v


@triton.jit
def _silu_mul_store(g, u, act_ptr, rowoff, ok, cols):
    """act[rows, cols] = SiLU(g) · u ([BN, MB] float32 tiles, stored transposed into row-major act)."""
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + rowoff[None, :] + cols[:, None], a.to(act_ptr.dtype.element_ty), mask=ok[None, :])


@triton.jit
def _wait_at_least(ptr, target):
    """Spin until the int32 counter at `ptr` reaches `target` (acquire)."""
    seen = tl.atomic_add(ptr, 0)
    while seen < target:
        seen = tl.atomic_add(ptr, 0)


@triton.jit
def _shared_fc1(x_ptr, sw1_ptr, sw1s_ptr, sact_ptr, done_ptr, tile, m, tok_ok, H: tl.constexpr, S: tl.constexpr,
                MB: tl.constexpr, BN1: tl.constexpr, BKS: tl.constexpr, SHARED: tl.constexpr, F32: tl.constexpr,
                NATIVE: tl.constexpr):
    """Shared FC1 item: sact[t, rows] = SiLU(x W_gate^T) · (x W_up^T) for all tokens, BN1 rows of S."""
    if SHARED != 0:
        n = tile * BN1 + tl.arange(0, BN1)
        acc_g = tl.zeros([BN1, MB], tl.float32)
        acc_u = tl.zeros([BN1, MB], tl.float32)
        for k0 in range(0, H, BKS):
            xk = _load_cols(x_ptr, m * H, tok_ok, k0, 1, 0, BKS, F32)
            acc_g = _mma(_shared_tile(sw1_ptr, sw1s_ptr, n, k0, H, BN1, BKS, SHARED, F32, NATIVE), xk, acc_g, F32)
            acc_u = _mma(_shared_tile(sw1_ptr, sw1s_ptr, S + n, k0, H, BN1, BKS, SHARED, F32, NATIVE), xk, acc_u, F32)
        _silu_mul_store(acc_g, acc_u, sact_ptr, m * S, tok_ok, n)
        tl.debug_barrier()
        tl.atomic_add(done_ptr, 1)


@triton.jit
def _shared_fc2(sw2_ptr, sw2s_ptr, sact_ptr, part_ptr, sh1_ptr, tile, T, m, tok_ok, H: tl.constexpr, S: tl.constexpr,
                TOPK: tl.constexpr, MB: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BKS: tl.constexpr,
                SHARED: tl.constexpr, F32: tl.constexpr, NATIVE: tl.constexpr):
    """Shared FC2 item (after every shared FC1 item): part[T·k + t, rows] = sact[t] W_down^T, BN2 rows of H."""
    if SHARED != 0:
        n = tile * BN2 + tl.arange(0, BN2)
        _wait_at_least(sh1_ptr, S // BN1)
        tl.debug_barrier()
        acc = tl.zeros([BN2, MB], tl.float32)
        for k0 in range(0, S, BKS):
            ak = _load_cols(sact_ptr, m * S, tok_ok, k0, 1, 0, BKS, F32)
            acc = _mma(_shared_tile(sw2_ptr, sw2s_ptr, n, k0, S, BN2, BKS, SHARED, F32, NATIVE), ak, acc, F32)
        prow = T * TOPK + m
        tl.store(part_ptr + prow[None, :].to(tl.int64) * H + n[:, None], acc, mask=tok_ok[None, :])


@triton.jit
def megamoe_decode_kernel(
    x_ptr, w1_ptr, w1s_ptr, w1g_ptr, w2_ptr, w2s_ptr, w2g_ptr,
    sw1_ptr, sw1s_ptr, sw2_ptr, sw2s_ptr,
    topw_ptr, pairs_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, num_active_ptr,
    act_ptr, sact_ptr, part_ptr, cnt_ptr, out_ptr,
    T, A,
    H: tl.constexpr, INTER: tl.constexpr, S: tl.constexpr, TOPK: tl.constexpr, MB: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, BKS: tl.constexpr,
    SHARED: tl.constexpr, F32: tl.constexpr, NATIVE: tl.constexpr,
):
    """The whole MoE of T <= MB tokens; see the module docstring for the work items and counters."""
    N1T: tl.constexpr = INTER // BN1
    N2T: tl.constexpr = H // BN2
    NS1: tl.constexpr = (S // BN1) if SHARED != 0 else 0
    NS2: tl.constexpr = N2T if SHARED != 0 else 0
    HAS_SH: tl.constexpr = 1 if SHARED != 0 else 0
    FC2_CNT: tl.constexpr = 2  # counters: [ticket, exits, FC2 per H tile ×N2T, shared FC1, FC1 per slot ×A]
    SH1_CNT: tl.constexpr = 2 + N2T
    FC1_CNT: tl.constexpr = 3 + N2T
    na = tl.load(num_active_ptr)
    e1 = NS1 + na * N1T
    s2 = e1 + NS2
    total = s2 + na * N2T
    m = tl.arange(0, MB)
    tok_ok = m < T
    tk = tl.atomic_add(cnt_ptr, 1)
    while tk < total:
        if tk < e1:  # ---------------------------------------------------------------- FC1 (+ SiLU·mul)
            if tk < NS1:
                _shared_fc1(x_ptr, sw1_ptr, sw1s_ptr, sact_ptr, cnt_ptr + SH1_CNT, tk, m, tok_ok, H, S, MB, BN1, BKS,
                            SHARED, F32, NATIVE)
            else:
                u = tk - NS1
                slot = u // N1T
                n = (u % N1T) * BN1 + tl.arange(0, BN1)
                e = tl.load(slot_expert_ptr + slot).to(tl.int64)
                start = tl.load(slot_start_ptr + slot)
                rows_ok = m < tl.load(slot_count_ptr + slot)
                pair = tl.load(pairs_ptr + start + m, mask=rows_ok, other=0)
                xoff = (pair // TOPK).to(tl.int64) * H
                acc_g = tl.zeros([BN1, MB], tl.float32)
                acc_u = tl.zeros([BN1, MB], tl.float32)
                rg = e * (2 * INTER) + n
                ru = rg + INTER
                for k0 in range(0, H, BK1):
                    xe = _load_cols(x_ptr, xoff, rows_ok, k0, 2, 0, BK1 // 2, F32)
                    xo = _load_cols(x_ptr, xoff, rows_ok, k0, 2, 1, BK1 // 2, F32)
                    lo, hi = _nvfp4_tile(w1_ptr, w1s_ptr, rg, k0, H, BN1, BK1, F32)
                    acc_g = _mma(hi, xo, _mma(lo, xe, acc_g, F32), F32)
                    lo, hi = _nvfp4_tile(w1_ptr, w1s_ptr, ru, k0, H, BN1, BK1, F32)
                    acc_u = _mma(hi, xo, _mma(lo, xe, acc_u, F32), F32)
                acc_g = acc_g * (tl.load(w1g_ptr + rg) * 128.0)[:, None]  # undo 2^-7, per-row tensor scale
                acc_u = acc_u * (tl.load(w1g_ptr + ru) * 128.0)[:, None]
                _silu_mul_store(acc_g, acc_u, act_ptr, (start + m).to(tl.int64) * INTER, rows_ok, n)
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr + FC1_CNT + slot, 1)
        else:  # ----------------------------------------------------------------------- FC2 (+ combine)
            if tk < s2:
                tile = tk - e1
                _shared_fc2(sw2_ptr, sw2s_ptr, sact_ptr, part_ptr, cnt_ptr + SH1_CNT, tile, T, m, tok_ok, H, S, TOPK,
                            MB, BN1, BN2, BKS, SHARED, F32, NATIVE)
            else:
                u = tk - s2
                slot = u // N2T
                tile = u % N2T
                n = tile * BN2 + tl.arange(0, BN2)
                e = tl.load(slot_expert_ptr + slot).to(tl.int64)
                start = tl.load(slot_start_ptr + slot)
                rows_ok = m < tl.load(slot_count_ptr + slot)
                pair = tl.load(pairs_ptr + start + m, mask=rows_ok, other=0)
                _wait_at_least(cnt_ptr + FC1_CNT + slot, N1T)
                tl.debug_barrier()
                aoff = (start + m).to(tl.int64) * INTER
                r2 = e * H + n
                acc = tl.zeros([BN2, MB], tl.float32)
                for k0 in range(0, INTER, BK2):
                    ae = _load_cols(act_ptr, aoff, rows_ok, k0, 2, 0, BK2 // 2, F32)
                    ao = _load_cols(act_ptr, aoff, rows_ok, k0, 2, 1, BK2 // 2, F32)
                    lo, hi = _nvfp4_tile(w2_ptr, w2s_ptr, r2, k0, INTER, BN2, BK2, F32)
                    acc = _mma(hi, ao, _mma(lo, ae, acc, F32), F32)
                wt = tl.load(topw_ptr + pair, mask=rows_ok, other=0.0)
                acc = acc * (tl.load(w2g_ptr + r2) * 128.0)[:, None] * wt[None, :]
                tl.store(part_ptr + pair[None, :].to(tl.int64) * H + n[:, None], acc, mask=rows_ok[None, :])
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + FC2_CNT + tile, 1)
            if done == na + HAS_SH - 1:  # the tile's last FC2 item: fixed-order combine
                tl.debug_barrier()
                nc = tile * BN2 + tl.arange(0, BN2)
                res = tl.zeros([MB, BN2], tl.float32)
                for j in tl.static_range(TOPK):
                    res += tl.load(part_ptr + (m * TOPK + j)[:, None].to(tl.int64) * H + nc[None, :],
                                   mask=tok_ok[:, None], other=0.0, cache_modifier=".cg")
                if SHARED != 0:
                    res += tl.load(part_ptr + (T * TOPK + m)[:, None].to(tl.int64) * H + nc[None, :],
                                   mask=tok_ok[:, None], other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m[:, None] * H + nc[None, :], res.to(out_ptr.dtype.element_ty),
                         mask=tok_ok[:, None])
        tk = tl.atomic_add(cnt_ptr, 1)
    tl.debug_barrier()
    gone = tl.atomic_add(cnt_ptr + 1, 1)
    if gone == tl.num_programs(0) - 1:  # last one out: zero every counter for the next launch
        n_cnt = FC1_CNT + A
        z = tl.arange(0, 128)
        for c0 in range(0, n_cnt, 128):
            tl.store(cnt_ptr + c0 + z, tl.zeros([128], tl.int32), mask=c0 + z < n_cnt)


# ---------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class DecodeTiles:
    """Tile sizes of the decode kernel: FC1 rows / K step, FC2 rows / K step, warps, stages, shared K step.

    Defaults compile for sm_90a to 186 registers with 4 warps (no spills; 2 programs per SM) and 34 KB
    of shared memory: Triton pipelines the weight bytes through cp.async, num_stages - 1 K steps ahead.
    8 warps or K steps of 256 reach 255 registers (and spill).
    """

    bn1: int = 32
    bk1: int = 128
    bn2: int = 64
    bk2: int = 128
    num_warps: int = 4
    num_stages: int = 4
    bks: int = 64  # K step of the shared expert's (MXFP8 / bf16) tiles


def _largest_dividing(k: int, options: tuple[int, ...]) -> int:
    for o in options:
        if k % o == 0:
            return o
    raise ShapeError(f"dimension {k} is not a multiple of {options[-1]}; pad it")


def default_tiles(hidden: int, inter: int, shared_inter: int, mb: int = 16, act_dtype: str = "bf16") -> DecodeTiles:
    """Tiles for a layout and token bucket that divide H, I and S (multiples of 64) and compile for sm_90a
    without spills in bf16 (186-249 registers, 4 warps); the 64-token bucket halves the FC tiles' rows, and
    float32 activations (IEEE dots, a correctness path) take K steps of 64 (they still spill a little)."""
    s = shared_inter or inter
    f32 = act_dtype == "fp32"
    r1, r2 = ((16,), (32, 16)) if mb >= 64 else ((32, 16), (64, 32, 16))
    k1 = (64,) if f32 else (128, 64)
    return DecodeTiles(bn1=min(_largest_dividing(inter, r1), _largest_dividing(s, r1)),
                       bk1=_largest_dividing(hidden, k1), bn2=_largest_dividing(hidden, r2),
                       bk2=_largest_dividing(inter, k1), num_stages=2 if f32 else 4,
                       bks=min(_largest_dividing(hidden, (32,) if f32 else (64, 32)),
                               _largest_dividing(s, (32,) if f32 else (64, 32))))


def token_bucket(t: int) -> int:
    """MB: the token tile (a power of two >= 16 covering t)."""
    return max(16, triton.next_power_of_2(max(t, 1)))


def _shared_types(shared_fmt: str) -> tuple[str, str]:
    return ("*bf16", "*u8") if shared_fmt == "bf16" else ("*u8", "*u8")


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def _spec(hidden: int, inter: int, shared_inter: int, top_k: int, mb: int, act_dtype: str, shared_fmt: str,
          tiles: DecodeTiles, native: bool) -> KernelSpec:
    act = {"bf16": "*bf16", "fp32": "*fp32"}[act_dtype]
    sw, ss = _shared_types(shared_fmt)
    types = {"x_ptr": act, "w1_ptr": "*u8", "w1s_ptr": "*u8", "w1g_ptr": "*fp32", "w2_ptr": "*u8", "w2s_ptr": "*u8",
             "w2g_ptr": "*fp32", "sw1_ptr": sw, "sw1s_ptr": ss, "sw2_ptr": sw, "sw2s_ptr": ss, "topw_ptr": "*fp32",
             "pairs_ptr": "*i32", "slot_expert_ptr": "*i32", "slot_start_ptr": "*i32", "slot_count_ptr": "*i32",
             "num_active_ptr": "*i32", "act_ptr": act, "sact_ptr": act, "part_ptr": "*fp32", "cnt_ptr": "*i32",
             "out_ptr": act, "T": "i32", "A": "i32"}
    consts = dict(H=hidden, INTER=inter, S=shared_inter if shared_fmt != "none" else 0, TOPK=top_k, MB=mb,
                  BN1=tiles.bn1, BK1=tiles.bk1, BN2=tiles.bn2, BK2=tiles.bk2, BKS=tiles.bks, SHARED=SHARED_FMTS[shared_fmt],
                  F32=act_dtype == "fp32" or not native, NATIVE=native)
    return KernelSpec("megamoe_decode", megamoe_decode_kernel, types, consts, tiles.num_warps, tiles.num_stages,
                      divisible_16=("w1_ptr", "w1s_ptr", "w2_ptr", "w2s_ptr", "act_ptr", "part_ptr"))


def decode_specs(hidden: int, inter: int, experts: int, top_k: int, shared_inter: int, act_dtype: str,
                 shared_fmt: str, tiles: DecodeTiles | None = None) -> list[KernelSpec]:
    """Every KernelSpec :func:`moe_decode` can launch for this layout (one per token bucket MB = 16, 32, 64).

    ``act_dtype`` "bf16" | "fp32"; ``shared_fmt`` "mxfp8" | "bf16" | "none". GPU settings (native FP8).
    """
    del experts  # the expert count only sizes buffers
    return [_spec(hidden, inter, shared_inter, top_k, mb, act_dtype, shared_fmt,
                  tiles or default_tiles(hidden, inter, shared_inter, mb, act_dtype), True) for mb in (16, 32, 64)]


@dataclass
class DecodeWorkspace:
    """Scratch of one decode launch shape: activations, float32 partials and the (self-resetting) counters."""

    act: torch.Tensor
    sact: torch.Tensor
    part: torch.Tensor
    counters: torch.Tensor

    @staticmethod
    def create(t: int, hidden: int, inter: int, shared_inter: int, experts: int, top_k: int, dtype: torch.dtype,
               device: torch.device | str) -> DecodeWorkspace:
        """Allocate for t tokens (counters zeroed; the kernel re-zeroes them after every launch)."""
        n2t = hidden // 16  # FC2 tiles have >= 16 rows
        return DecodeWorkspace(
            act=torch.empty((t * top_k, inter), dtype=dtype, device=device),
            sact=torch.empty((t, max(shared_inter, 1)), dtype=dtype, device=device),
            part=torch.empty((t * top_k + t, hidden), dtype=torch.float32, device=device),
            counters=torch.zeros(3 + n2t + experts, dtype=torch.int32, device=device))


def shared_format(w: Any) -> str:
    """"mxfp8", "bf16" or "none" for a shared-expert weight (MXFP8Tensor, bf16 tensor or None)."""
    if w is None:
        return "none"
    if isinstance(w, quant.MXFP8Tensor):
        return "mxfp8"
    if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16:
        return "bf16"
    raise ShapeError(f"shared expert weight {type(w).__name__} {getattr(w, 'dtype', '')}: expected an MXFP8Tensor "
                     "or a bf16 tensor")


def _check_nvfp4(w: Any, e: int | None, n: int | None, k: int | None, name: str) -> tuple[int, int, int]:
    if not isinstance(w, quant.NVFP4Tensor) or w.data.dtype != torch.uint8 or w.data.dim() != 3:
        raise ShapeError(f"{name}: expected an NVFP4Tensor with uint8 data [E, N, K/2], got {type(w).__name__}")
    we, wn, wk = w.data.shape[0], w.data.shape[1], w.data.shape[2] * 2
    if (e is not None and we != e) or (n is not None and wn != n) or (k is not None and wk != k):
        raise ShapeError(f"{name}: logical shape [{we}, {wn}, {wk}] does not match the expected [{e}, {n}, {k}]")
    if tuple(w.scale.shape) != (we, wn, wk // 16) or w.scale.element_size() != 1:
        raise ShapeError(f"{name}: scale {tuple(w.scale.shape)} {w.scale.dtype}: expected float8_e4m3fn "
                         f"[{we}, {wn}, {wk // 16}]")
    if w.global_scale is None or w.global_scale.numel() not in (1, we, we * wn):
        raise ShapeError(f"{name}: global_scale must hold 1, E or E·N float32 values (per-row [E, N, 1] stored)")
    return we, wn, wk


def _shared_args(w: Any, fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "mxfp8":
        return w.data.view(torch.uint8), w.scale
    if fmt == "bf16":
        return w, torch.empty(16, dtype=torch.uint8, device=x.device)
    dummy = torch.empty(16, dtype=torch.uint8, device=x.device)
    return dummy, dummy


def moe_decode(x: torch.Tensor, seg: ExpertSegments, topk_weights: torch.Tensor, w13: quant.NVFP4Tensor,
               w2: quant.NVFP4Tensor, shared_w13: Any = None, shared_w2: Any = None, *, runner: Runner = jit_run,
               out: torch.Tensor | None = None, workspace: DecodeWorkspace | None = None,
               tiles: DecodeTiles | None = None, programs: int | None = None) -> torch.Tensor:
    """MoE output [T, H] (x's dtype) for T <= 64 tokens routed by `seg` / `topk_weights`, in one launch.

    ``w13`` NVFP4 [E, 2I, H] (gate rows then up), ``w2`` NVFP4 [E, H, I]; shared weights MXFP8Tensor or bf16
    ([2S, H], [H, S]) or None. ``workspace`` (from :meth:`DecodeWorkspace.create`) may be kept across calls
    of the same T (its counters reset themselves); ``programs`` overrides the persistent grid size.
    """
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ShapeError(f"x {tuple(x.shape)} {x.dtype}: expected bf16 / float32 [T, H]")
    t, h = x.shape
    if not 1 <= t <= MAX_DECODE_TOKENS:
        raise ShapeError(f"moe_decode takes 1..{MAX_DECODE_TOKENS} tokens, got {t}; use the prefill path")
    e, n1, _ = _check_nvfp4(w13, None, None, h, "w13")
    inter = n1 // 2
    _check_nvfp4(w2, e, h, inter, "w2")
    top_k = topk_weights.shape[1]
    if tuple(topk_weights.shape) != (t, top_k) or topk_weights.dtype != torch.float32:
        raise ShapeError(f"topk_weights {tuple(topk_weights.shape)} {topk_weights.dtype}: expected float32 [{t}, k]")
    if seg.sorted_pairs.numel() != t * top_k or seg.max_active != min(e, t * top_k):
        raise ShapeError(f"expert segments are for {seg.sorted_pairs.numel()} pairs / {seg.max_active} slots, "
                         f"expected {t * top_k} / {min(e, t * top_k)}: build them from this batch's topk_ids")
    fmt = shared_format(shared_w13)
    if shared_format(shared_w2) != fmt:
        raise ShapeError("shared_w13 and shared_w2 must both be given in the same format (or both None)")
    s = 0
    if fmt != "none":
        s = shared_w13.shape[0] // 2
        if tuple(shared_w13.shape) != (2 * s, h) or tuple(shared_w2.shape) != (h, s):
            raise ShapeError(f"shared weights {tuple(shared_w13.shape)}, {tuple(shared_w2.shape)}: expected "
                             f"[2S, {h}] and [{h}, S]")
    act_dtype = "fp32" if x.dtype == torch.float32 else "bf16"
    tiles = tiles or default_tiles(h, inter, s, token_bucket(t), act_dtype)
    if h % tiles.bk1 or h % tiles.bn2 or h % tiles.bks or inter % tiles.bn1 or inter % tiles.bk2 \
            or (s and (s % tiles.bn1 or s % tiles.bks)):
        raise ShapeError(f"H={h}, I={inter}, S={s} are not multiples of the tiles {tiles}; pad them to 64")
    spec = _spec(h, inter, s, top_k, token_bucket(t), act_dtype, fmt, tiles, not interpreting())
    ws = workspace or DecodeWorkspace.create(t, h, inter, s, e, top_k, x.dtype, x.device)
    if ws.part.shape != (t * top_k + t, h) or ws.counters.numel() < 3 + h // tiles.bn2 + e:
        raise ShapeError(f"workspace was made for another shape (part {tuple(ws.part.shape)}); create one for T={t}")
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (t, h) or out.dtype != x.dtype or not out.is_contiguous():
        raise ShapeError(f"out {tuple(out.shape)} {out.dtype}: expected contiguous {x.dtype} [{t}, {h}]")
    sw1, sw1s = _shared_args(shared_w13, fmt, x)
    sw2, sw2s = _shared_args(shared_w2, fmt, x)
    n_items = (s // tiles.bn1 + h // tiles.bn2 if s else 0) + seg.max_active * (inter // tiles.bn1 + h // tiles.bn2)
    grid = (max(1, min(programs or PROGRAMS_PER_SM * num_sms(x.device, cpu_default=2), n_items)),)
    g13 = nvfp4_row_scales(w13, tuple(w13.data.shape[:2]), "w13")  # [E, N, 1]: the kernel reads it as [E, N]
    g2 = nvfp4_row_scales(w2, tuple(w2.data.shape[:2]), "w2")
    args = [x.contiguous(), w13.data, w13.scale.view(torch.uint8), g13, w2.data, w2.scale.view(torch.uint8), g2,
            sw1, sw1s, sw2, sw2s,
            topk_weights.contiguous(), seg.sorted_pairs, seg.slot_expert, seg.slot_start, seg.slot_count,
            seg.num_active, ws.act, ws.sact, ws.part, ws.counters, out, t, seg.max_active]
    runner(spec, grid, args)
    return out
