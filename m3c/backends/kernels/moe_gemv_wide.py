"""MegaMoE "wide" GEMV tiles: one token row per tile, NVFP4 routed weights streamed in 16-byte loads.

Why: the default GEMV tiles (:mod:`m3c.backends.kernels.moe_prefill`, ``Tiles.gemv``) read 8 bytes of codes per
thread and K step (a [BN, G, 2] word tile: Triton vectorizes only along the size-2 word axis) with one step
prefetched: ~1–2 KB in flight per program, 4 programs per SM (120 registers), ~8 KB per SM. On the H200 they
ran at ~20% of read bandwidth at T = 1 (177 µs for 36.6 µs of bytes), latency-bound: the loads, not the
arithmetic (~7 instructions per weight, an issue floor near 60 µs), set the time. Little's law for 4.28 TB/s
at ~1 µs of DRAM latency wants ~32 KB in flight per SM.

Design (``Tiles.wide_bk`` = WBK > 0, BM = 1, NVFP4 routed weights; the shared expert keeps the default
tiles): a K step covers WBK weights of BN rows as a flat [BN, WBK/8] tile of 32-bit words — contiguous along
the row, so each thread loads 16 bytes (4 words) per load —, with the next step's words and scale bytes
loaded before the current step is decoded. At BN = 16, WBK = 512, 4 warps: 32 bytes per thread and matrix
per step (FC1 streams gate and up: 64), 16 KB per program in flight with the prefetch. The math per word
(8 weights): each nibble decoded to its plain value (``e2m1_nibble_tiny`` × 2^126: 4 ops, exact), one FMA
with its activation, the 8-product sum times the word's E4M3 scale (one multiply per 8 weights); partial
sums stay per word ([BN, WBK/8] float32) and are reduced over the row once, at the end, then times the
per-row tensor scale. The activation values a thread needs (its own words' 8 columns) are loaded as 16
bytes per word, broadcast over the tile's rows (L1 hits). Rounding: float32 products and sums in a
different order than the reference's dequantize-then-matmul (a few ulps).

Not measured on a GPU yet (offline sm_90a SASS only): ``bench_moe_gemv_tiles.py`` times it against the
default tiles; it is not the default until it wins there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import e2m1_nibble_tiny, e4m3_value, to_stored

TWO_126 = tl.constexpr(8.507059173023462e37)
"""2^126: a nibble decoded by ``e2m1_nibble_tiny`` (value × 2^-126) times this is its plain value, exactly."""


@triton.jit
def _wide_load(wp, s_ptr, rows, k0, K: tl.constexpr, W: tl.constexpr):
    """Codes of rows [BN] × columns [k0, k0 + 8W) as int32 words [BN, W] and each word's scale byte [BN, W]."""
    w = tl.arange(0, W)
    words = tl.load(wp + rows[:, None] * (K // 8) + (k0 // 8 + w)[None, :])
    sb = tl.load(s_ptr + rows[:, None] * (K // 16) + (k0 // 16 + w // 2)[None, :])
    return words, sb


@triton.jit
def _wide_x(x_row, rows, k0, W: tl.constexpr):
    """Activations x[k0 + 8w + k] as 8 float32 [BN, W] tensors (k = 0..7), broadcast over the tile's rows.

    bf16: loaded as 4 int32 pairs per word, each pair in the same [BN, W] shape as the code words, so Triton gives
    them the words' register layout (no layout conversion in the FMA chain); a pair's low half is column 2j,
    its high half column 2j + 1 (bf16 -> float32 is a shift or a mask)."""
    out = ()
    if x_row.dtype.element_ty == tl.bfloat16:
        xw = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
        base = xw + (k0 // 2 + 4 * tl.arange(0, W))[None, :] + 0 * rows[:, None]
        for j in tl.static_range(4):
            v = tl.load(base + j)
            lo, hi = (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)
            out = out + (lo, hi)  # noqa: RUF005 (Triton's compiler has no starred tuples)
    else:  # float32 activations: one load per column
        base = x_row + (k0 + 8 * tl.arange(0, W))[None, :] + 0 * rows[:, None]
        for k in tl.static_range(8):
            out = out + (tl.load(base + k).to(tl.float32),)  # noqa: RUF005
    return out


@triton.jit
def _wide_partial(words, sb, xs):
    """Per word: sum_k value(nibble k) · x_k, times the word's E4M3 scale -> float32 [BN, W]."""
    acc = (e2m1_nibble_tiny(words, 0) * TWO_126) * xs[0]
    for k in tl.static_range(1, 8):
        acc = tl.fma(e2m1_nibble_tiny(words, k) * TWO_126, xs[k], acc)
    return acc * e4m3_value(sb.to(tl.int32))


@triton.jit
def _wide_checks(BM: tl.constexpr, K: tl.constexpr, WBK: tl.constexpr, N: tl.constexpr, BN: tl.constexpr):
    """Compile-time checks: one row per tile, unmasked loads along K and N, 16-byte word groups."""
    tl.static_assert(BM == 1)
    tl.static_assert(K % WBK == 0)
    tl.static_assert(N % BN == 0)
    tl.static_assert(WBK % 32 == 0)


@triton.jit
def fc1_wide(x_row, ok, wd_ptr, ws_ptr, wg_ptr, row0, n0, out_ptr, orow, H: tl.constexpr, N: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, WBK: tl.constexpr):
    """out[orow, n0:n0+BN] = SiLU(x·gateᵀ) · (x·upᵀ) for one token row (pointer x_row; ok: int32 validity) over
    the gate rows row0 + n0 + [0, BN) and the up rows N further, NVFP4 (per-row tensor scales at wg_ptr)."""
    _wide_checks(BM, H, WBK, N, BN)
    W: tl.constexpr = WBK // 8
    rg = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    ru = rg + N
    wp = wd_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc_g = tl.zeros([BN, W], dtype=tl.float32)
    acc_u = tl.zeros([BN, W], dtype=tl.float32)
    gd, gs = _wide_load(wp, ws_ptr, rg, 0, H, W)
    ud, us = _wide_load(wp, ws_ptr, ru, 0, H, W)
    for k0 in range(0, H, WBK):  # the next step's bytes load while this one is decoded (the last re-loads its own)
        kn = tl.minimum(k0 + WBK, H - WBK)
        gd_n, gs_n = _wide_load(wp, ws_ptr, rg, kn, H, W)
        ud_n, us_n = _wide_load(wp, ws_ptr, ru, kn, H, W)
        xs = _wide_x(x_row, rg, k0, W)
        acc_g += _wide_partial(gd, gs, xs)
        acc_u += _wide_partial(ud, us, xs)
        gd, gs, ud, us = gd_n, gs_n, ud_n, us_n
    gv = tl.sum(acc_g, axis=1) * tl.load(wg_ptr + rg)
    uv = tl.sum(acc_u, axis=1) * tl.load(wg_ptr + ru)
    cols = n0 + tl.arange(0, BN)
    tl.store(out_ptr + orow.to(tl.int64) * N + cols, to_stored(gv * tl.sigmoid(gv) * uv, out_ptr.dtype.element_ty),
             mask=cols * 0 + ok > 0)


@triton.jit
def fc2_wide(a_row, ok, wd_ptr, ws_ptr, wg_ptr, row0, n0, wt, y_ptr, yrow, K: tl.constexpr, H: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, WBK: tl.constexpr):
    """y[yrow, n0:n0+BN] = (a·W2ᵀ) · wt for one activation row (pointer a_row) over rows row0 + n0 + [0, BN)."""
    _wide_checks(BM, K, WBK, H, BN)
    W: tl.constexpr = WBK // 8
    rw = (row0 + n0 + tl.arange(0, BN)).to(tl.int64)
    wp = wd_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros([BN, W], dtype=tl.float32)
    wd, ws = _wide_load(wp, ws_ptr, rw, 0, K, W)
    for k0 in range(0, K, WBK):
        wd_n, ws_n = _wide_load(wp, ws_ptr, rw, tl.minimum(k0 + WBK, K - WBK), K, W)
        acc += _wide_partial(wd, ws, _wide_x(a_row, rw, k0, W))
        wd, ws = wd_n, ws_n
    v = tl.sum(acc, axis=1) * tl.load(wg_ptr + rw) * wt
    cols = n0 + tl.arange(0, BN)
    tl.store(y_ptr + yrow.to(tl.int64) * H + cols, to_stored(v, y_ptr.dtype.element_ty), mask=cols * 0 + ok > 0)

