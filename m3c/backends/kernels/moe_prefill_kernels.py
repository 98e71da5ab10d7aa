"""The Triton device code of the MegaMoE prefill's grouped GEMMs (:mod:`m3c.backends.kernels.moe_prefill`: its
design, numerics and tilings; the host side that picks a tiling and launches these kernels is there): the FC1
and FC2 tile / GEMV bodies with the weights decoded in the K loop, and the deterministic combine."""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import (
    TWO_120,
    e2m1_nibble_tiny,
    e4m3_big,
    e4m3_tiny,
    e8m0_to_f32,
    to_stored,
)
from m3c.backends.kernels.moe_operands import a_tile, dot_nt, row_factor, w_tile
from m3c.backends.kernels.moe_swap import fc1_swap, fc2_swap


@triton.jit
def _fc1_tile(x_ptr, tok, valid, wd_ptr, ws_ptr, wg_ptr, row0, n0, out_ptr, out_rows, H: tl.constexpr,
              N: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              DOT_F32: tl.constexpr):
    """out[out_rows, n0:n0+BN] = silu(x[tok] @ Wg^T) * (x[tok] @ Wu^T) with gate rows row0 + n, up rows row0 + N + n."""
    rg = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    ru = rg + N
    xrow = x_ptr + tok.to(tl.int64)[:, None] * H
    kk = tl.arange(0, BK)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        xt = a_tile(xrow, k0 + kk, valid, DOT_F32)
        wg = w_tile(wd_ptr, ws_ptr, rg, k0, H, FMT, BN, BK, DOT_F32)
        acc_g = dot_nt(xt, wg, acc_g, DOT_F32)
        wu = w_tile(wd_ptr, ws_ptr, ru, k0, H, FMT, BN, BK, DOT_F32)
        acc_u = dot_nt(xt, wu, acc_u, DOT_F32)
    g = acc_g * row_factor(wg_ptr, rg, FMT, 128.0)[None, :]
    u = acc_u * row_factor(wg_ptr, ru, FMT, 128.0)[None, :]
    a = g * tl.sigmoid(g) * u
    cols = n0 + tl.arange(0, BN)
    ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(ptrs, to_stored(a, out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _fc2_tile(a_ptr, arows, valid, wd_ptr, ws_ptr, wg_ptr, row0, n0, wt, y_ptr, yrows, K: tl.constexpr,
              H: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              DOT_F32: tl.constexpr):
    """y[yrows, n0:n0+BN] = (act[arows] @ W[row0 + n]^T) * wt (wt: per-row routing weight, float32 [BM])."""
    rw = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    arow = a_ptr + arows.to(tl.int64)[:, None] * K
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        at = a_tile(arow, k0 + kk, valid, DOT_F32)
        w = w_tile(wd_ptr, ws_ptr, rw, k0, K, FMT, BN, BK, DOT_F32)
        acc = dot_nt(at, w, acc, DOT_F32)
    acc = acc * row_factor(wg_ptr, rw, FMT, 128.0)[None, :] * wt[:, None]
    cols = n0 + tl.arange(0, BN)
    ptrs = y_ptr + yrows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(ptrs, to_stored(acc, y_ptr.dtype.element_ty), mask=valid[:, None])


# GEMV tiles (few rows per expert): CUDA-core FMAs over weights decoded once per program, no tensor cores.


@triton.jit
def _lane(v, i: tl.constexpr):
    """Element i of a small vector as a scalar."""
    return tl.sum(tl.where(tl.arange(0, v.shape[0]) == i, v, 0), axis=0)


@triton.jit
def _gemv_load(d_ptr, s_ptr, rows, k0, K: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr):
    """The raw weight bytes of rows `rows` [BN] × columns [k0, k0 + 16·G): (data, scale bytes), for `_gemv_w`.

    Loaded one K step ahead of their use (PIPE <= 1: step k + 1's bytes are in flight while step k is decoded)
    or by Triton's pipeliner through shared memory (PIPE > 1).
    """
    g = tl.arange(0, G)[None, :, None, None]
    h = tl.arange(0, 2)[None, None, :, None]
    r4 = rows[:, None, None, None]
    if FMT == 2:  # [BN, G, 2, 1] 32-bit words of 8 codes, [BN, G] E4M3 scale bytes
        wp = d_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        data = tl.load(wp + r4 * (K // 8) + (k0 // 8 + g * 2 + h))
        sb = tl.load(s_ptr + rows[:, None] * (K // 16) + (k0 // 16 + tl.arange(0, G))[None, :])
    else:  # [BN, G, 2, 8] bytes or bf16 values, [BN, G] E8M0 scale bytes (MXFP8; a dummy for bf16)
        p = tl.arange(0, 8)[None, None, None, :]
        data = tl.load(d_ptr + r4 * K + (k0 + g * 16 + h * 8 + p))
        if FMT == 1:
            sb = tl.load(s_ptr + rows[:, None] * (K // 32) + ((k0 // 16 + tl.arange(0, G)) // 2)[None, :])
        else:
            sb = tl.zeros([rows.shape[0], G], dtype=tl.int32)
    return data, sb


@triton.jit
def _gemv_w(data, sb, FMT: tl.constexpr):
    """`_gemv_load`'s bytes as float32 weights [BN, G, 2, 8] (column 16g + 8h + p at [:, g, h, p]).

    NVFP4 (FMT 2) comes × 2^-7 and without its per-row scale (see ``row_factor``): each 32-bit word of codes
    (8 nibbles, column order) is decoded with constant shifts, no byte extraction; MXFP8 (1) and bf16 (0)
    are exact values.
    """
    if FMT == 2:
        p = tl.arange(0, 8)[None, None, None, :]
        sc = e4m3_big(sb.to(tl.int32))[:, :, None, None]
        out = e2m1_nibble_tiny(data, p) * sc  # value × 2^-126 × scale × 2^119
    elif FMT == 1:
        sc = e8m0_to_f32(sb.to(tl.int32))[:, :, None, None]
        out = e4m3_tiny(data.to(tl.int32)) * TWO_120 * sc
    else:
        out = data.to(tl.float32)
    return out


@triton.jit
def _x_tile(row_ptr, k0, G: tl.constexpr):
    """One activation row's columns [k0, k0 + 16·G) as float32 [G, 2, 8], laid out as `_gemv_w`'s columns."""
    g = tl.arange(0, G)[:, None, None]
    h = tl.arange(0, 2)[None, :, None]
    p = tl.arange(0, 8)[None, None, :]
    return tl.load(row_ptr + k0 + g * 16 + h * 8 + p).to(tl.float32)


@triton.jit
def _row_ptr(base, rows, ok, i: tl.constexpr, stride: tl.constexpr):
    """(pointer to row rows[i] of a [*, stride] matrix, or to row 0 when that row is not valid; its validity as
    an int32 scalar: Triton's interpreter rejects store masks built from scalar booleans)."""
    v = _lane(ok, i)
    return base + tl.where(v > 0, _lane(rows, i), 0).to(tl.int64) * stride, v


@triton.jit
def _row_ptrs(base, rows, valid, BM: tl.constexpr, stride: tl.constexpr):
    """`_row_ptr` of a tile's rows 0..3 (rows past BM repeat row 1 or 0 and are never used): 4 pointers, 4 flags.

    Rows past the tile's end read row 0 of the matrix and store nothing.
    """
    ok = valid.to(tl.int32)
    p0, v0 = _row_ptr(base, rows, ok, 0, stride)
    p1, v1 = _row_ptr(base, rows, ok, 1 % BM, stride)
    p2, v2 = _row_ptr(base, rows, ok, 2 % BM, stride)
    p3, v3 = _row_ptr(base, rows, ok, 3 % BM, stride)
    return p0, p1, p2, p3, v0, v1, v2, v3


@triton.jit
def _fma_rows(acc, w, x):
    """acc + w · x elementwise (one FMA per weight: weights [BN, G, 2, 8], one row's x [G, 2, 8]); reduced at the end."""
    return acc + w * x[None, :, :, :]


@triton.jit
def _fc1_rows_step(g0, u0, g1, u1, g2, u2, g3, u3, wg, wu, x0, x1, x2, x3, k0, BM: tl.constexpr, G: tl.constexpr):
    """One K step of `_fc1_gemv`: decoded gate / up weights FMA'd with each of the tile's BM rows."""
    xt = _x_tile(x0, k0, G)
    g0 = _fma_rows(g0, wg, xt)
    u0 = _fma_rows(u0, wu, xt)
    if BM > 1:
        xt = _x_tile(x1, k0, G)
        g1 = _fma_rows(g1, wg, xt)
        u1 = _fma_rows(u1, wu, xt)
    if BM > 2:
        xt = _x_tile(x2, k0, G)
        g2 = _fma_rows(g2, wg, xt)
        u2 = _fma_rows(u2, wu, xt)
        xt = _x_tile(x3, k0, G)
        g3 = _fma_rows(g3, wg, xt)
        u3 = _fma_rows(u3, wu, xt)
    return g0, u0, g1, u1, g2, u2, g3, u3


@triton.jit
def _fc2_rows_step(c0, c1, c2, c3, w, a0, a1, a2, a3, k0, BM: tl.constexpr, G: tl.constexpr):
    """One K step of `_fc2_gemv`: decoded weights FMA'd with each of the tile's BM rows."""
    c0 = _fma_rows(c0, w, _x_tile(a0, k0, G))
    if BM > 1:
        c1 = _fma_rows(c1, w, _x_tile(a1, k0, G))
    if BM > 2:
        c2 = _fma_rows(c2, w, _x_tile(a2, k0, G))
        c3 = _fma_rows(c3, w, _x_tile(a3, k0, G))
    return c0, c1, c2, c3


@triton.jit
def _gemv_fits(BM: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, N: tl.constexpr, BN: tl.constexpr):
    """Compile-time checks of a GEMV tile: rows 0..3 only (the host allows 1, 2, 4), loads unmasked along K, N."""
    tl.static_assert(BM <= 4)
    tl.static_assert(K % BK == 0)
    tl.static_assert(N % BN == 0)


@triton.jit
def _fc1_gemv(x_ptr, tok, valid, wd_ptr, ws_ptr, wg_ptr, row0, n0, out_ptr, out_rows, H: tl.constexpr,
              N: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              PIPE: tl.constexpr):
    """`_fc1_tile` for BM <= 4 rows: each weight tile decoded once, FMAs for every row (no tensor cores)."""
    _gemv_fits(BM, H, BK, N, BN)
    G: tl.constexpr = BK // 16
    rg = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    ru = rg + N
    x0, x1, x2, x3, ok0, ok1, ok2, ok3 = _row_ptrs(x_ptr, tok, valid, BM, H)
    g0 = tl.zeros([BN, G, 2, 8], dtype=tl.float32)
    u0, g1, u1, g2, u2, g3, u3 = g0, g0, g0, g0, g0, g0, g0
    if PIPE > 1:  # Triton's pipeliner: PIPE - 1 steps of bytes in flight through shared memory (cp.async)
        for k0 in tl.range(0, H, BK, num_stages=PIPE):
            gd, gs = _gemv_load(wd_ptr, ws_ptr, rg, k0, H, FMT, G)
            ud, us = _gemv_load(wd_ptr, ws_ptr, ru, k0, H, FMT, G)
            g0, u0, g1, u1, g2, u2, g3, u3 = _fc1_rows_step(g0, u0, g1, u1, g2, u2, g3, u3, _gemv_w(gd, gs, FMT),
                                                            _gemv_w(ud, us, FMT), x0, x1, x2, x3, k0, BM, G)
    else:  # the next step's bytes in flight in registers (the last step re-loads the last: harmless)
        gd, gs = _gemv_load(wd_ptr, ws_ptr, rg, 0, H, FMT, G)
        ud, us = _gemv_load(wd_ptr, ws_ptr, ru, 0, H, FMT, G)
        for k0 in range(0, H, BK):
            kn = tl.minimum(k0 + BK, H - BK)
            gd_n, gs_n = _gemv_load(wd_ptr, ws_ptr, rg, kn, H, FMT, G)
            ud_n, us_n = _gemv_load(wd_ptr, ws_ptr, ru, kn, H, FMT, G)
            g0, u0, g1, u1, g2, u2, g3, u3 = _fc1_rows_step(g0, u0, g1, u1, g2, u2, g3, u3, _gemv_w(gd, gs, FMT),
                                                            _gemv_w(ud, us, FMT), x0, x1, x2, x3, k0, BM, G)
            gd, gs, ud, us = gd_n, gs_n, ud_n, us_n
    mg = row_factor(wg_ptr, rg, FMT, 128.0)
    mu = row_factor(wg_ptr, ru, FMT, 128.0)
    cols = n0 + tl.arange(0, BN)
    _silu_mul_row(g0, u0, mg, mu, out_ptr, _lane(out_rows, 0), ok0, cols, N)
    if BM > 1:
        _silu_mul_row(g1, u1, mg, mu, out_ptr, _lane(out_rows, 1 % BM), ok1, cols, N)
    if BM > 2:
        _silu_mul_row(g2, u2, mg, mu, out_ptr, _lane(out_rows, 2 % BM), ok2, cols, N)
        _silu_mul_row(g3, u3, mg, mu, out_ptr, _lane(out_rows, 3 % BM), ok3, cols, N)


@triton.jit
def _row_sum(acc):
    """[BN, G, 2, 8] FMA accumulators -> [BN] row sums."""
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _silu_mul_row(g, u, mg, mu, out_ptr, orow, ok, cols, N: tl.constexpr):
    """out[orow, cols] = SiLU(rowsum(g) · mg) · rowsum(u) · mu for FMA accumulators g, u [BN, G, 2, 8]."""
    gv = _row_sum(g) * mg
    uv = _row_sum(u) * mu
    a = gv * tl.sigmoid(gv) * uv
    tl.store(out_ptr + orow.to(tl.int64) * N + cols, to_stored(a, out_ptr.dtype.element_ty), mask=cols * 0 + ok > 0)


@triton.jit
def _fc2_gemv(a_ptr, arows, valid, wd_ptr, ws_ptr, wg_ptr, row0, n0, wt, y_ptr, yrows, K: tl.constexpr,
              H: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              PIPE: tl.constexpr):
    """`_fc2_tile` for BM <= 4 rows: each weight tile decoded once, FMAs for every row (no tensor cores)."""
    _gemv_fits(BM, K, BK, H, BN)
    G: tl.constexpr = BK // 16
    rw = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    a0, a1, a2, a3, ok0, ok1, ok2, ok3 = _row_ptrs(a_ptr, arows, valid, BM, K)
    c0 = tl.zeros([BN, G, 2, 8], dtype=tl.float32)
    c1, c2, c3 = c0, c0, c0
    if PIPE > 1:  # Triton's pipeliner: PIPE - 1 steps of bytes in flight through shared memory (cp.async)
        for k0 in tl.range(0, K, BK, num_stages=PIPE):
            wd, ws = _gemv_load(wd_ptr, ws_ptr, rw, k0, K, FMT, G)
            c0, c1, c2, c3 = _fc2_rows_step(c0, c1, c2, c3, _gemv_w(wd, ws, FMT), a0, a1, a2, a3, k0, BM, G)
    else:  # the next step's bytes in flight in registers (the last step re-loads the last: harmless)
        wd, ws = _gemv_load(wd_ptr, ws_ptr, rw, 0, K, FMT, G)
        for k0 in range(0, K, BK):
            wd_n, ws_n = _gemv_load(wd_ptr, ws_ptr, rw, tl.minimum(k0 + BK, K - BK), K, FMT, G)
            c0, c1, c2, c3 = _fc2_rows_step(c0, c1, c2, c3, _gemv_w(wd, ws, FMT), a0, a1, a2, a3, k0, BM, G)
            wd, ws = wd_n, ws_n
    m = row_factor(wg_ptr, rw, FMT, 128.0)
    cols = n0 + tl.arange(0, BN)
    _scaled_row(c0, m, _lane(wt, 0), y_ptr, _lane(yrows, 0), ok0, cols, H)
    if BM > 1:
        _scaled_row(c1, m, _lane(wt, 1 % BM), y_ptr, _lane(yrows, 1 % BM), ok1, cols, H)
    if BM > 2:
        _scaled_row(c2, m, _lane(wt, 2 % BM), y_ptr, _lane(yrows, 2 % BM), ok2, cols, H)
        _scaled_row(c3, m, _lane(wt, 3 % BM), y_ptr, _lane(yrows, 3 % BM), ok3, cols, H)


@triton.jit
def _scaled_row(c, m, w, y_ptr, yrow, ok, cols, H: tl.constexpr):
    """y[yrow, cols] = rowsum(c) · m · w for FMA accumulators c [BN, G, 2, 8]."""
    v = _row_sum(c) * m * w
    tl.store(y_ptr + yrow.to(tl.int64) * H + cols, to_stored(v, y_ptr.dtype.element_ty), mask=cols * 0 + ok > 0)


@triton.jit
def _routed_rows(pid_r, offs_ptr, E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr):
    """(expert, first sorted row, end of the expert's rows) of routed tile pid_r; expert == E: no such tile.

    The tile table is derived here from the expert row offsets (E + 1 int32 values, L2-resident): expert e
    owns ceil(count_e / BM) consecutive tiles, so no separate launch builds it.
    """
    ev = tl.arange(0, EP)
    lo_e = tl.load(offs_ptr + ev, mask=ev < E, other=0)
    hi_e = tl.load(offs_ptr + ev + 1, mask=ev < E, other=0)
    tend = tl.cumsum((hi_e - lo_e + BM - 1) // BM, 0)
    tend = tl.where(ev < E, tend, 2147483647)
    e = tl.sum((tend <= pid_r).to(tl.int32), axis=0)
    tstart = tl.sum(tl.where(ev == e - 1, tend, 0), axis=0)  # 0 for e == 0
    lo = tl.sum(tl.where(ev == e, lo_e, 0), axis=0)
    hi = tl.sum(tl.where(ev == e, hi_e, 0), axis=0)
    return e, lo + (pid_r - tstart) * BM, hi


@triton.jit
def moe_fc1_kernel(x_ptr, order_ptr, offs_ptr, wd_ptr, ws_ptr, wg_ptr, sd_ptr, ss_ptr, act_ptr, sact_ptr,
                   T, n_sh,
                   H: tl.constexpr, INTER: tl.constexpr, S: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr,
                   EP: tl.constexpr, FMT: tl.constexpr, SFMT: tl.constexpr, HAS_SHARED: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, GEMV: tl.constexpr,
                   PIPE: tl.constexpr, SWAP: tl.constexpr):
    """FC1 + SiLU·up of one row tile × BN intermediate columns: shared tiles first, then routed tiles (SWAP: the
    weight-stationary tiles of :mod:`m3c.backends.kernels.moe_swap`, GEMV: CUDA-core tiles, else grouped GEMM)."""
    pid_m = tl.program_id(0)
    n0 = tl.program_id(1) * BN
    m = tl.arange(0, BM)
    if HAS_SHARED:  # noqa: SIM102 (a constexpr guard: the shared path is not compiled without it)
        if (pid_m < n_sh) & (n0 < S):
            tok = pid_m * BM + m
            if SWAP:
                fc1_swap(x_ptr, tok, tok < T, sd_ptr, ss_ptr, ss_ptr, 0, n0, sact_ptr, tok, H, S, SFMT, BM, BN, BK, DOT_F32,
                         PIPE)
            elif GEMV:
                _fc1_gemv(x_ptr, tok, tok < T, sd_ptr, ss_ptr, ss_ptr, 0, n0, sact_ptr, tok, H, S, SFMT, BM, BN, BK, PIPE)
            else:
                _fc1_tile(x_ptr, tok, tok < T, sd_ptr, ss_ptr, ss_ptr, 0, n0, sact_ptr, tok, H, S, SFMT, BM, BN, BK,
                          DOT_F32)
    if pid_m >= n_sh:
        e, p0, hi = _routed_rows(pid_m - n_sh, offs_ptr, E, EP, BM)
        if (e < E) & (n0 < INTER):
            p = p0 + m
            valid = p < hi
            pair = tl.load(order_ptr + p, mask=valid, other=0)
            tok = (pair // TOPK).to(tl.int32)
            if SWAP:
                fc1_swap(x_ptr, tok, valid, wd_ptr, ws_ptr, wg_ptr, e.to(tl.int64) * (2 * INTER), n0, act_ptr, p, H,
                         INTER, FMT, BM, BN, BK, DOT_F32, PIPE)
            elif GEMV:
                _fc1_gemv(x_ptr, tok, valid, wd_ptr, ws_ptr, wg_ptr, e.to(tl.int64) * (2 * INTER), n0, act_ptr, p, H,
                          INTER, FMT, BM, BN, BK, PIPE)
            else:
                _fc1_tile(x_ptr, tok, valid, wd_ptr, ws_ptr, wg_ptr, e.to(tl.int64) * (2 * INTER), n0, act_ptr, p, H,
                          INTER, FMT, BM, BN, BK, DOT_F32)


@triton.jit
def moe_fc2_kernel(act_ptr, sact_ptr, order_ptr, wts_ptr, offs_ptr, wd_ptr, ws_ptr, wg_ptr, sd_ptr, ss_ptr,
                   y_ptr, T, n_sh,
                   H: tl.constexpr, INTER: tl.constexpr, S: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr,
                   EP: tl.constexpr, FMT: tl.constexpr, SFMT: tl.constexpr, HAS_SHARED: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, GEMV: tl.constexpr,
                   PIPE: tl.constexpr, SWAP: tl.constexpr):
    """FC2 × routing weight of one row tile × BN hidden columns into y [T, TOPK + HAS_SHARED, H] (SWAP, GEMV: as FC1)."""
    SLOTS: tl.constexpr = TOPK + HAS_SHARED
    pid_m = tl.program_id(0)
    n0 = tl.program_id(1) * BN
    m = tl.arange(0, BM)
    if HAS_SHARED:  # noqa: SIM102 (a constexpr guard: the shared path is not compiled without it)
        if pid_m < n_sh:
            tok = pid_m * BM + m
            one = tl.full([BM], 1.0, tl.float32)
            if SWAP:
                fc2_swap(sact_ptr, tok, tok < T, sd_ptr, ss_ptr, ss_ptr, 0, n0, one, y_ptr, tok * SLOTS + TOPK, S, H,
                         SFMT, BM, BN, BK, DOT_F32, PIPE)
            elif GEMV:
                _fc2_gemv(sact_ptr, tok, tok < T, sd_ptr, ss_ptr, ss_ptr, 0, n0, one, y_ptr, tok * SLOTS + TOPK, S, H,
                          SFMT, BM, BN, BK, PIPE)
            else:
                _fc2_tile(sact_ptr, tok, tok < T, sd_ptr, ss_ptr, ss_ptr, 0, n0, one, y_ptr, tok * SLOTS + TOPK, S, H,
                          SFMT, BM, BN, BK, DOT_F32)
    if pid_m >= n_sh:
        e, p0, hi = _routed_rows(pid_m - n_sh, offs_ptr, E, EP, BM)
        if e < E:
            p = p0 + m
            valid = p < hi
            pair = tl.load(order_ptr + p, mask=valid, other=0).to(tl.int32)
            wt = tl.load(wts_ptr + pair, mask=valid, other=0.0)
            yrows = (pair // TOPK) * SLOTS + pair % TOPK
            if SWAP:
                fc2_swap(act_ptr, p, valid, wd_ptr, ws_ptr, wg_ptr, e.to(tl.int64) * H, n0, wt, y_ptr, yrows, INTER, H,
                         FMT, BM, BN, BK, DOT_F32, PIPE)
            elif GEMV:
                _fc2_gemv(act_ptr, p, valid, wd_ptr, ws_ptr, wg_ptr, e.to(tl.int64) * H, n0, wt, y_ptr, yrows, INTER, H,
                          FMT, BM, BN, BK, PIPE)
            else:
                _fc2_tile(act_ptr, p, valid, wd_ptr, ws_ptr, wg_ptr, e.to(tl.int64) * H, n0, wt, y_ptr, yrows, INTER, H,
                          FMT, BM, BN, BK, DOT_F32)


@triton.jit
def moe_combine_kernel(y_ptr, ids_ptr, out_ptr, T, H: tl.constexpr, TOPK: tl.constexpr, E: tl.constexpr,
                       HAS_SHARED: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """out[t] = sum_j y[t, j] (+ y[t, TOPK] shared) in a fixed order; slots whose id is not in [0, E) are skipped."""
    SLOTS: tl.constexpr = TOPK + HAS_SHARED
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = rows < T
    r64 = rows.to(tl.int64)
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        use = ok
        if j < TOPK:
            e = tl.load(ids_ptr + r64 * TOPK + j, mask=ok, other=-1)
            use = ok & (e >= 0) & (e < E)
        v = tl.load(y_ptr + (r64 * SLOTS + j)[:, None] * H + cols[None, :], mask=use[:, None], other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + r64[:, None] * H + cols[None, :], to_stored(acc, out_ptr.dtype.element_ty), mask=ok[:, None])
