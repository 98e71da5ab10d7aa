"""The Triton device code of the MSA indexer (:mod:`m3c.backends.kernels.msa_indexer`: its design, numerics, knobs
and the host side that builds the specs and launches these kernels): kernel 1 ``indexer_scores_kernel`` with its
dequant paths' helpers and inline PTX, kernel 2 ``topk_blocks_kernel`` with its packed-key top-k helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.fp_codes import TWO_120, e2m1_nibble_tiny, e2m1_tiny, e4m3_big, e4m3_value, pow2, slices8
from m3c.backends.kernels.msa_indexer_int8 import LUT_N0, LUT_N1, LUT_P0, LUT_P1, group_sums, q_int8_words
from m3c.backends.kernels.prefill_tiles import prefill_tile
from m3c.backends.kernels.split_merge import last_to_arrive

_TWO_126 = tl.constexpr(8.507059173023462e37)  # 2^126: e2m1_tiny × 2^126 = the E2M1 value
# E2M1 nibbles -> E4M3 bytes worth value × 2^-6, four packed bytes per instance (low / high nibbles).
_ASM_LO = tl.constexpr("{ .reg .b32 t; shl.b32 t, $1, 2; and.b32 t, t, 0x1C1C1C1C; "
           "shl.b32 $0, $1, 4; and.b32 $0, $0, 0x80808080; or.b32 $0, $0, t; }")
_ASM_HI = tl.constexpr("{ .reg .b32 t; and.b32 t, $1, 0x80808080; "
           "shr.b32 $0, $1, 2; and.b32 $0, $0, 0x1C1C1C1C; or.b32 $0, $0, t; }")
# E2M1 nibbles -> bf16 pairs: bytes 0,1 / 2,3 spread to 16-bit lanes (prmt), the nibble's bits placed as
# sign + exponent LSBs + mantissa MSB (value × 2^-126, e = 0 subnormal), times 2^126 (0x7E80) in bf16x2.
_ASM_BF16 = ("{ .reg .b32 z, c, t, a, b; mov.b32 z, 0; mov.b32 c, 0x7E807E80; "
             "prmt.b32 t, $2, z, 0x4140; and.b32 a, t, M1; shl.b32 a, a, S1; and.b32 b, t, M2; shl.b32 b, b, S2; "
             "or.b32 a, a, b; mul.rn.bf16x2 $0, a, c; "
             "prmt.b32 t, $2, z, 0x4342; and.b32 a, t, M1; shl.b32 a, a, S1; and.b32 b, t, M2; shl.b32 b, b, S2; "
             "or.b32 a, a, b; mul.rn.bf16x2 $1, a, c; }")
_ASM_BF16_LO = tl.constexpr(_ASM_BF16.replace("M1", "0x00070007").replace("S1", "6").replace("M2", "0x00080008")
                            .replace("S2", "12"))
_ASM_BF16_HI = tl.constexpr(_ASM_BF16.replace("M1", "0x00700070").replace("S1", "2").replace("M2", "0x00800080")
                            .replace("S2", "8"))


@triton.jit
def _e4m3_pow2(byte, BIAS: tl.constexpr):
    """E4M3 bytes (int32, 0..255) -> float32 value × 2^BIAS, exactly (NaN for 0x7F / 0xFF)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120 + BIAS) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub_unit = tl.full(byte.shape, (118 + BIAS) << 23, tl.int32).to(tl.float32, bitcast=True)  # 2^(BIAS - 9)
    mag = tl.where(e == 0, m.to(tl.float32) * sub_unit, normal)
    nan = tl.full(byte.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    mag = tl.where((byte & 0x7F) == 0x7F, nan, mag)
    return tl.where(byte >= 128, -mag, mag)


@triton.jit
def _round_e4m3(x):
    """float32 x (|x| < 448) rounded to the nearest E4M3 value (ties to even), as float32, exactly.

    Integer rounding of the mantissa to 3 bits for normals; subnormals (|x| < 2^-6, a 2^-9 grid) by
    the add-and-subtract trick at 1.5 × 2^14 (float32 adds round to nearest even everywhere).
    """
    bits = x.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    rnd = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000) | (bits & -2147483648)
    ax = tl.abs(x)
    sub = (ax + 24576.0) - 24576.0
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(ax < 0.015625, sub, rnd.to(tl.float32, bitcast=True))


@triton.jit
def _block_diag(qh, HD: tl.constexpr, NG: tl.constexpr, M: tl.constexpr):
    """[M, HD] half-columns of q -> [HD, NG*M] block-diagonal: column h*M + m holds q[m] on group h's 8 rows."""
    qt = tl.trans(qh)  # [HD, M]
    grp = tl.arange(0, HD) // 8
    h = tl.arange(0, NG)
    bd = tl.where(grp[:, None, None] == h[None, :, None], qt[:, None, :], tl.zeros_like(qt)[:, None, :])
    return tl.reshape(bd, [HD, NG * M])


@triton.jit
def _nan_max(a, b):
    """max(a, b), NaN if either is NaN (as torch.amax)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pool_max(acc, M: tl.constexpr, NB: tl.constexpr, BL: tl.constexpr):
    """[M, NB*BL] scores -> [M, NB] maxima over runs of BL keys, NaN if any is NaN (as torch.amax): one
    max.NaN per score."""
    return tl.reduce(tl.reshape(acc, [M, NB, BL]), 2, _nan_max)


@triton.jit
def _block_max(acc, vis, M: tl.constexpr, NB: tl.constexpr, BL: tl.constexpr):
    """[M, NB*BL] scores -> [M, NB] maxima over runs of BL keys: invisible keys -inf, NaN if a visible one is NaN."""
    return _pool_max(tl.where(vis, acc, float("-inf")), M, NB, BL)


@triton.jit
def _fma_pair(q_row, q_off, pos, valid, out_row):
    """One (row, head) pair of the "fma" path: (q' = q · 2^S as 16 [1, NG] slices (element e of every group),
    2^(126 - S) as two factors, position, validity, score row)."""
    q_a = tl.load(q_row + q_off).to(tl.float32)  # elements 0..7 of each group
    q_b = tl.load(q_row + q_off + 8).to(tl.float32)  # elements 8..15
    amax = tl.maximum(tl.max(tl.abs(q_a)), tl.max(tl.abs(q_b)))
    # Biased exponent ef of max|q| (clamped: 1 for zero / subnormal rows, 254 for inf / NaN). S = 246 - ef
    # puts max|q · 2^S| in [2^119, 2^120), so a nonzero key nibble (>= 2^-127 as decoded) times q' is normal
    # for every |q| >= 2^-117 max|q|. Bounds: |nibble · q'| < 6 · 2^-126 · 2^120 = 6 · 2^-6, a group's 16
    # products < 1.5, times |scale| <= 448: < 672, summed over D/16 groups: < 42 · D (no overflow).
    ef = tl.minimum(tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, 1), 254)
    sh = 246 - ef  # S in [-8, 245]: q · 2^S = q · 2^s1 · 2^(S - s1), exact (q' normal or zero)
    s1 = tl.minimum(sh, 127)
    up1 = pow2(s1)
    up2 = pow2(sh - s1)
    dn = tl.minimum(ef - 120, 127)  # 2^(126 - S) = 2^(ef - 120) = 2^dn · 2^(ef - 120 - dn), dn >= -119
    return (slices8((q_a * up1 * up2)[None, :, :]) + slices8((q_b * up1 * up2)[None, :, :]), pow2(dn),
            pow2(ef - 120 - dn), pos, valid, out_row)


@triton.jit
def _fma_load(kw_ptr, ks_ptr, bt_row, b0, u, kk, g, w_off, vis_hi, D: tl.constexpr, BS: tl.constexpr,
              NBT: tl.constexpr, BL: tl.constexpr, NG: tl.constexpr, MASK: tl.constexpr):
    """The code words [FK, NG, 2] and scale bytes [FK, NG] of part u of the step starting at block b0. Keys of
    blocks at or past vis_hi read as zeros and are not loaded; MASK False (one block a step, b0 < vis_hi known):
    a scalar base address and unmasked loads."""
    blk = b0 + kk // BL
    ok = blk < vis_hi
    if NBT == 1:  # (part of) one block: a scalar table entry
        if MASK:
            phys = tl.load(bt_row + b0, mask=b0 < vis_hi, other=0)
        else:
            phys = tl.load(bt_row + b0)
    else:
        phys = tl.load(bt_row + blk, mask=ok, other=0)
    slot = phys.to(tl.int64) * BS + u * BL + kk % BL  # the key's slot in its block
    if MASK:
        words = tl.load(kw_ptr + slot[:, None, None] * (D // 8) + w_off, mask=ok[:, None, None], other=0)
        sbyte = tl.load(ks_ptr + slot[:, None] * NG + g[None, :], mask=ok[:, None], other=0)
    else:
        words = tl.load(kw_ptr + slot[:, None, None] * (D // 8) + w_off)
        sbyte = tl.load(ks_ptr + slot[:, None] * NG + g[None, :])
    return words, sbyte


@triton.jit
def _tile_finite(q_ptr, stride_qt, stride_qg, t0, t_hi, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """Whether every q element of the tile's R (row, head) pairs (rows t0.., before t_hi) is finite."""
    d = tl.arange(0, D)
    bad = 0
    for i in tl.static_range(R):
        tok = tl.minimum(t0 + i // G, t_hi - 1).to(tl.int64)
        q = tl.load(q_ptr + tok * stride_qt + (i % G) * stride_qg + d).to(tl.float32)
        bad += tl.sum(tl.where(tl.abs(q) < float("inf"), 0, 1))
    return bad == 0


@triton.jit
def _fma_tile(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo, vis_hi,
              G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NBT: tl.constexpr, FK: tl.constexpr, FS: tl.constexpr,
              R: tl.constexpr, I8: tl.constexpr, UPCAST: tl.constexpr):
    """The "fma" (I8 False) and "int8" (I8) decode paths over R (row, head) pairs: "int8" runs for tiles whose q is
    finite, the others take the float32 "fma" loop, whose IEEE products give the reference's ±inf / NaN scores."""
    if I8:
        if _tile_finite(q_ptr, stride_qt, stride_qg, t0, t_hi, G, D, R):
            _fma_loop(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo,
                      vis_hi, G, D, BS, NBT, FK, FS, R, True, UPCAST)
        else:
            _fma_loop(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo,
                      vis_hi, G, D, BS, NBT, FK, FS, R, False, UPCAST)
    else:
        _fma_loop(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo, vis_hi,
                  G, D, BS, NBT, FK, FS, R, False, UPCAST)


@triton.jit
def _fma_loop(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo, vis_hi,
              G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NBT: tl.constexpr, FK: tl.constexpr, FS: tl.constexpr,
              R: tl.constexpr, I8: tl.constexpr, UPCAST: tl.constexpr):
    """The "fma" (I8 False) and "int8" (I8; finite q only) loops: block-max scores of R = rows × G (row, head)
    pairs, one by one, over blocks [c_lo, vis_hi); steps of FK keys (NBT whole blocks, or a part of one) decoded
    once for all pairs. UPCAST: "int8" without its PTX (Triton's interpreter).

    Pair i = (token t0 + i // G, head i % G); pairs past t_hi compute on token t0 and store nothing.
    """
    NG: tl.constexpr = D // 16
    BL: tl.constexpr = FK if FK < BS else BS  # keys of one block in a step
    SUB: tl.constexpr = BS // BL  # steps per block (> 1: running maxima per pair)
    kw_ptr = kd_ptr.to(tl.pointer_type(tl.int32), bitcast=True)  # a key's D/2 code bytes as D/8 little-endian words
    g = tl.arange(0, NG)
    kk = tl.arange(0, FK)
    nb = tl.arange(0, NBT)
    q_off = g[:, None] * 16 + tl.arange(0, 8)[None, :]
    w_off = g[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    # per pair: (q' as 16 [1, NG] slices (element e of every group), 2^(126 - S) as two factors, position,
    # validity, score row)
    pairs = ()
    for i in tl.static_range(R):
        valid = t0 + i // G < t_hi
        tok = tl.where(valid, t0 + i // G, t0).to(tl.int64)
        q_row = q_ptr + tok * stride_qt + (i % G) * stride_qg
        pos = tl.where(valid, tl.load(pos_ptr + tok).to(tl.int32), -1)
        if I8:  # "int8": q split into int8 parts (msa_indexer_int8)
            qw, d1, d2 = q_int8_words(tl.load(q_row + g[:, None] * 16 + tl.arange(0, 16)[None, :]).to(tl.float32), NG)
            pairs = pairs + ((qw, d1, d2, pos, valid, out_ptr + (tok * G + i % G) * MB),)  # noqa: RUF005
        else:
            pairs = pairs + (_fma_pair(q_row, q_off, pos, valid, out_ptr + (tok * G + i % G) * MB),)  # noqa: RUF005
    zero = tl.minimum(c_lo, 0).to(tl.int32)  # 0 (a chunk's first block), which the compilers cannot fold (unless
    # chunk_blocks == 1 is specialized: tiny tables, where immediates cost only speed), so
    luts = (zero + LUT_P0, zero + LUT_P1, zero + LUT_N0, zero + LUT_N1)  # the "int8" tables stay in registers
    if FS == 0:  # register prefetch: a step's keys load while the step before computes (one step per block)
        tl.static_assert(SUB == 1, "register prefetch needs FK >= BS")
        words_n, sbyte_n = _fma_load(kw_ptr, ks_ptr, bt_row, c_lo, 0, kk, g, w_off, vis_hi, D, BS, NBT, BL, NG, True)
    for b0 in tl.range(c_lo, vis_hi, NBT, num_stages=FS + (FS == 0)):  # FS > 1: Triton's cp.async pipelining
        bests = ()  # per pair: [FK] scores (masked: -inf), maxima over the block's steps so far
        for u in tl.static_range(SUB):
            blk = b0 + kk // BL  # request-relative block of each key
            kpos = u * BL + kk % BL  # the key's slot in its block
            ok = blk < vis_hi
            if FS == 0:
                words = words_n
                sbyte = sbyte_n
                words_n, sbyte_n = _fma_load(kw_ptr, ks_ptr, bt_row, b0 + NBT, 0, kk, g, w_off, vis_hi, D, BS, NBT, BL,
                                             NG, True)
            else:  # (part of) one block: unmasked; several blocks: masked past vis_hi
                words, sbyte = _fma_load(kw_ptr, ks_ptr, bt_row, b0, u, kk, g, w_off, vis_hi, D, BS, NBT, BL, NG, NBT > 1)
            # word h of a group holds its elements 8h..8h+7, element 8h + k in nibble k (byte k // 2, low
            # nibble first)
            w0, w1 = tl.split(words)
            scale = e4m3_value(sbyte.to(tl.int32))  # the plain value (<= 448): see the bounds above
            key_pos = blk * BS + kpos
            if not I8:  # decoded once for all pairs, value × 2^-126, as 16 [FK, NG] slices
                vals = ()
                for k in tl.static_range(8):
                    vals = vals + (e2m1_nibble_tiny(w0, k),)  # noqa: RUF005 (Triton's compiler has no starred tuples)
                for k in tl.static_range(8):
                    vals = vals + (e2m1_nibble_tiny(w1, k),)  # noqa: RUF005
            step = ()
            for i in tl.static_range(R):
                if I8:
                    qw, d1, d2, pos, _, _ = pairs[i]
                    acc = tl.sum(group_sums(w0, w1, qw, luts, UPCAST).to(tl.float32) * scale, axis=1) * d1 * d2
                else:
                    qs, d1, d2, pos, _, _ = pairs[i]
                    part = vals[0] * qs[0]
                    for k in tl.static_range(1, 16):  # one FMA per key value
                        part = tl.fma(vals[k], qs[k], part)
                    acc = tl.sum(part * scale, axis=1) * d1 * d2
                acc = tl.where((key_pos <= pos) & ok, acc, float("-inf"))
                if u > 0:  # later parts of the same block: key by key, one pooling per block
                    acc = _nan_max(bests[i], acc)
                step = step + (acc,)  # noqa: RUF005 (Triton's compiler has no starred tuples)
            bests = step
        cols = b0 + nb
        for i in tl.static_range(R):
            valid = pairs[i][4]
            out_row = pairs[i][5]
            best = tl.reshape(_block_max(bests[i][None, :], True, 1, NBT, BL), [NBT])
            lim = tl.where(valid, vis_hi, 0)  # (a scalar bool in a store mask trips the interpreter)
            tl.store(out_row + cols, best, mask=cols < lim)


@triton.jit
def _step_phys(bt_row, s, jb, vis_hi):
    """Physical block of each key row of the step starting at request-relative block s (0 past vis_hi)."""
    blk = s + jb
    return tl.load(bt_row + blk, mask=blk < vis_hi, other=0).to(tl.int64)


@triton.jit
def _step_keys(kd_ptr, ks_ptr, phys, ok, j, hc, sc_cols, D: tl.constexpr, BS: tl.constexpr):
    """A step's packed codes [KEYS, D/2] and scale bytes [KEYS, D/16] (rows not ok: zeros, not loaded)."""
    slot = phys * BS + j % BS
    codes = tl.load(kd_ptr + slot[:, None] * (D // 2) + hc[None, :], mask=ok[:, None], other=0)
    sbyte = tl.load(ks_ptr + slot[:, None] * (D // 16) + sc_cols[None, :], mask=ok[:, None], other=0)
    return codes, sbyte


@triton.jit
def _mma_tile(q_ptr, kd_ptr, ks_ptr, bt_row, out_row, stride_qt, stride_qg, tok, mg, qpos, row_ok, c_lo, vis_hi,
              G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NBT: tl.constexpr, M: tl.constexpr,
              DEQ: tl.constexpr, UPCAST: tl.constexpr):
    """The MMA paths ("f32scale", "groupdot", "fp8"; prefill): block-max scores of the M-row tile over blocks
    [c_lo, vis_hi), NBT whole blocks a step."""
    KEYS: tl.constexpr = NBT * BS
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // 16
    hc = tl.arange(0, HD)
    sc_cols = tl.arange(0, D // 16)
    j = tl.arange(0, KEYS)
    jb = j // BS
    nb = tl.arange(0, NBT)
    q_off = tok * stride_qt + mg * stride_qg
    if DEQ == 0:  # q in element order (the keys are joined back into it)
        q_full = tl.load(q_ptr + q_off[:, None] + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:  # Triton's CPU interpreter mis-multiplies bf16 dots; f32 gives the same exact products
            q_full = q_full.to(tl.float32)
    else:  # even / odd columns, against the low / high nibbles
        q_even = tl.load(q_ptr + q_off[:, None] + 2 * hc[None, :], mask=row_ok[:, None], other=0.0)
        q_odd = tl.load(q_ptr + q_off[:, None] + 2 * hc[None, :] + 1, mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q_even = q_even.to(tl.float32)
            q_odd = q_odd.to(tl.float32)
    if DEQ == 2:  # FP8 q: a power-of-two scale per (row, head) puts the row max in [128, 256)
        amax = tl.maximum(tl.max(tl.abs(q_even.to(tl.float32)), axis=1), tl.max(tl.abs(q_odd.to(tl.float32)), axis=1))
        ef = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 255, 8), 254)
        q_up = ((261 - ef) << 23).to(tl.float32, bitcast=True)  # 2^(7 - E), E = ef - 127
        q_down = ((ef - 7) << 23).to(tl.float32, bitcast=True)  # 2^(E - 7)
        q_even = _round_e4m3(q_even.to(tl.float32) * q_up[:, None])
        q_odd = _round_e4m3(q_odd.to(tl.float32) * q_up[:, None])
    if DEQ != 0:  # block-diagonal q: one dot gives every scale group's partial score separately
        q_even = _block_diag(q_even, HD, NG, M)
        q_odd = _block_diag(q_odd, HD, NG, M)
    if DEQ == 2 and not UPCAST:
        q_even = q_even.to(tl.float8e4nv)  # exact: already on the E4M3 grid
        q_odd = q_odd.to(tl.float8e4nv)
    min_pos = tl.min(tl.where(row_ok, qpos, 2147483647))  # a step whose keys all lie at or before it needs no mask
    # Prefetch: a step's codes and scales are loaded one step ahead, its block-table entries two steps ahead,
    # so their latency hides behind the previous step's dequant and MMA (loads past vis_hi are masked off).
    phys_n = _step_phys(bt_row, c_lo + NBT, jb, vis_hi)
    codes, sbyte = _step_keys(kd_ptr, ks_ptr, _step_phys(bt_row, c_lo, jb, vis_hi), c_lo + jb < vis_hi, j, hc,
                              sc_cols, D, BS)
    for b0 in tl.range(c_lo, vis_hi, NBT, num_stages=1):
        blk = b0 + jb  # request-relative block of each key row
        ok = blk < vis_hi
        codes_n, sbyte_n = _step_keys(kd_ptr, ks_ptr, phys_n, blk + NBT < vis_hi, j, hc, sc_cols, D, BS)
        phys_n = _step_phys(bt_row, b0 + 2 * NBT, jb, vis_hi)
        if DEQ == 0:  # scale every key value in float32 (× 2^-7), keys in element order, one [M, KEYS] dot
            codes = codes.to(tl.int32)
            scale = e4m3_big(sbyte.to(tl.int32))
            k = tl.reshape(tl.join(e2m1_tiny(codes, 0), e2m1_tiny(codes, 4)), [KEYS, D // 16, 16])  # 2i, 2i + 1
            k = tl.reshape(k * scale[:, :, None], [KEYS, D])
            if q_full.dtype == tl.float32:
                acc = tl.dot(q_full, tl.trans(k), input_precision="ieee")
            else:  # e2m1 × e4m3 has <= 6 significant bits: exact in bf16 / fp16
                acc = tl.dot(q_full, tl.trans(k.to(q_full.dtype)))
        else:  # unscaled keys as the MMA M dim; the group scales multiply the [KEYS, NG*M] partials
            if DEQ == 1:
                scale = _e4m3_pow2(sbyte.to(tl.int32), 0)
                if q_even.dtype == tl.float32:  # interpreter / float32 q: the E2M1 values in float32
                    ci = codes.to(tl.int32)
                    k_lo = e2m1_tiny(ci, 0) * _TWO_126
                    k_hi = e2m1_tiny(ci, 4) * _TWO_126
                else:  # bf16 straight from the packed bytes (exact), ~2 instructions per value
                    k_lo = tl.inline_asm_elementwise(_ASM_BF16_LO, "=r,=r,r", [codes], dtype=tl.bfloat16,
                                                     is_pure=True, pack=4)
                    k_hi = tl.inline_asm_elementwise(_ASM_BF16_HI, "=r,=r,r", [codes], dtype=tl.bfloat16,
                                                     is_pure=True, pack=4)
            else:
                if UPCAST:  # the interpreter cannot run PTX: the same values (E2M1 × 2^-6) in float32
                    ci = codes.to(tl.int32)
                    k_lo = e2m1_tiny(ci, 0) * TWO_120  # e2m1_tiny × 2^120 = the E2M1 value × 2^-6 (its E4M3 bit shuffle)
                    k_hi = e2m1_tiny(ci, 4) * TWO_120
                else:  # E2M1 -> E4M3 bit shuffle, four packed keys per 2 integer ops
                    k_lo = tl.inline_asm_elementwise(_ASM_LO, "=r,r", [codes], dtype=tl.uint8, is_pure=True,
                                                     pack=4).to(tl.float8e4nv, bitcast=True)
                    k_hi = tl.inline_asm_elementwise(_ASM_HI, "=r,r", [codes], dtype=tl.uint8, is_pure=True,
                                                     pack=4).to(tl.float8e4nv, bitcast=True)
                scale = _e4m3_pow2(sbyte.to(tl.int32), 6)  # undoes the keys' 2^-6
            if k_lo.dtype == tl.float32:
                part = tl.dot(k_lo, q_even, input_precision="ieee")
                part = tl.dot(k_hi, q_odd, part, input_precision="ieee")
            else:
                part = tl.dot(k_lo, q_even)
                part = tl.dot(k_hi, q_odd, part)
            part = tl.reshape(part, [KEYS, NG, M]) * scale[:, :, None]
            acc = tl.trans(tl.sum(part, axis=1))
        if (b0 * BS + KEYS - 1 <= min_pos) & (b0 + NBT <= vis_hi):  # every key visible to every row
            best = _pool_max(acc, M, NBT, BS)
        else:
            key_pos = blk * BS + j % BS
            best = _block_max(acc, (key_pos[None, :] <= qpos[:, None]) & ok[None, :], M, NBT, BS)
        if DEQ == 0:  # the keys' 2^-7, undone on the block maxima (a positive power of two commutes with max)
            best = best * 128.0
        elif DEQ == 2:
            best = best * q_down[:, None]
        cols = b0 + nb
        tl.store(out_row[:, None] + cols[None, :], best, mask=row_ok[:, None] & (cols < vis_hi)[None, :])
        codes = codes_n
        sbyte = sbyte_n


@triton.jit
def indexer_scores_kernel(
    q_ptr, kd_ptr, ks_ptr, pos_ptr, qsl_ptr, seq_ptr, bt_ptr, out_ptr,
    stride_qt, stride_qg, stride_bt, MB, NR, chunk_blocks,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NBT: tl.constexpr, ROWS: tl.constexpr,
    M: tl.constexpr, FILL: tl.constexpr, PREFILL: tl.constexpr, RB: tl.constexpr, DEQ: tl.constexpr,
    UPCAST: tl.constexpr, FK: tl.constexpr, FS: tl.constexpr,
):
    """Block-max index scores of one (row tile, block chunk): out[t, g, b] float32 for the tile's rows t.

    PREFILL=False: program_id(0) is a request, whose rows are walked ROWS at a time (decode: one tile; "fma" loops over tiles of at most FMA_ROWS rows).
    PREFILL=True: program_id(0) is one ROWS-row tile of one request (found by ``prefill_tile``).
    FK: keys per step of the "fma" / "int8" paths (DEQ 3 / 4).
    """
    pid = tl.program_id(0)
    if PREFILL:
        r, t_lo, t_end = prefill_tile(pid, qsl_ptr, NR, ROWS, RB)
        t_hi = tl.where(r >= 0, tl.minimum(t_lo + ROWS, t_end), t_lo)
        r = tl.maximum(r, 0)
    else:
        r = pid
        t_lo = tl.load(qsl_ptr + r)
        t_hi = tl.load(qsl_ptr + r + 1)
    c_lo = tl.program_id(1) * chunk_blocks
    c_hi = tl.minimum(c_lo + chunk_blocks, MB)
    n_blk = tl.cdiv(tl.load(seq_ptr + r), BS)
    bt_row = bt_ptr + r * stride_bt
    m = tl.arange(0, M)
    mt = m // G
    mg = m % G
    nf = tl.arange(0, FILL)
    for t0 in range(t_lo, t_hi, ROWS):
        row_ok = (mt < ROWS) & (t0 + mt < t_hi)
        tok = tl.where(row_ok, t0 + mt, t0).to(tl.int64)
        qpos = tl.where(row_ok, tl.load(pos_ptr + tok).to(tl.int32), -1)
        out_row = out_ptr + (tok * G + mg) * MB
        max_pos = tl.max(qpos)
        n_vis = tl.where(max_pos >= 0, tl.minimum(max_pos // BS + 1, n_blk), 0)
        vis_hi = tl.minimum(c_hi, n_vis)
        if DEQ >= 3:  # CUDA cores ("fma", "int8"): the tile's (row, head) pairs one by one over each key step
            if ROWS == 1 or t_hi - t0 == 1:  # a single row (plain decode): no work for the tile's spare rows
                _fma_tile(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo,
                          vis_hi, G, D, BS, NBT, FK, FS, G, DEQ == 4, UPCAST)
            else:
                _fma_tile(q_ptr, kd_ptr, ks_ptr, pos_ptr, bt_row, out_ptr, stride_qt, stride_qg, MB, t0, t_hi, c_lo,
                          vis_hi, G, D, BS, NBT, FK, FS, ROWS * G, DEQ == 4, UPCAST)
        else:
            _mma_tile(q_ptr, kd_ptr, ks_ptr, bt_row, out_row, stride_qt, stride_qg, tok, mg, qpos, row_ok, c_lo,
                      vis_hi, G, D, BS, NBT, M, DEQ, UPCAST)
        ninf = tl.full([M, FILL], float("-inf"), tl.float32)
        for f0 in range(tl.maximum(c_lo, vis_hi), c_hi, FILL):  # no visible key: -inf, keys untouched
            cols = f0 + nf
            tl.store(out_row[:, None] + cols[None, :], ninf, mask=row_ok[:, None] & (cols < c_hi)[None, :])


@triton.jit
def _topk_keys(row, c0, n_scan, own, CH: tl.constexpr, BIG: tl.constexpr, NONE: tl.constexpr):
    """Packed int64 keys of blocks [c0, c0 + CH): order-preserving score bits << 32 | (BIG - index), so a
    larger key is a larger score, ties to the smaller index; NONE for blocks past n_scan, the own block,
    NaN and -inf scores (never candidates); -0.0 ties +0.0."""
    idx = c0 + tl.arange(0, CH)
    ok = (idx < n_scan) & (idx != own)
    s = tl.load(row + idx, mask=ok, other=float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)
    ok = ok & (s > float("-inf"))
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return tl.where(ok, (ordered << 32) | (BIG - idx).to(tl.int64), NONE)


@triton.jit
def _topk_fill(keys, slot, K: tl.constexpr, KO: tl.constexpr, NONE: tl.constexpr):
    """The K - 1 best of `keys` (unique packed keys) into slots 0..K-2 of a [KO] set, best first, NONE where they
    run out: one block-wide max-reduction per slot, stopping when the keys do."""
    top = tl.full([KO], NONE, tl.int64)
    best = tl.max(keys)
    filled = 0
    while (filled < K - 1) & (best > NONE):
        top = tl.where(slot == filled, best, top)
        keys = tl.where(keys == best, NONE, keys)
        best = tl.max(keys)
        filled += 1
    return top


@triton.jit
def _topk_rank_select(keys, slot, K: tl.constexpr, NONE: tl.constexpr):
    """What :func:`_topk_fill` returns for unique packed keys (NONE aside), in one pairwise pass instead of a chain of
    K - 1 block-wide reductions: each key's rank is how many keys beat it, and slot s takes the key of rank s."""
    rank = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
    keep = (keys > NONE) & (rank < K - 1)
    pick = (rank[None, :] == slot[:, None]) & keep[None, :]
    return tl.max(tl.where(pick, keys[None, :], NONE), axis=1)


@triton.jit
def topk_blocks_kernel(scores_ptr, pos_ptr, out_ptr, cand_ptr, cnt_ptr, MB, G: tl.constexpr, BS: tl.constexpr,
                       K: tl.constexpr, KO: tl.constexpr, CH: tl.constexpr, CAUSAL: tl.constexpr,
                       NSMAX: tl.constexpr, RANK_MERGE: tl.constexpr = False):
    """out[t, g, :K]: own block + top K-1 other blocks of scores[t, g, :] (ties -> smaller), ascending, -1 padded.

    CAUSAL: scan only blocks 0..own (kernel 1's scores are -inf past the own block); else all MB blocks.
    Grid (T·G, S), S <= NSMAX slices of a row: each program takes the top K-1 of its slice; with S > 1 each
    writes them to cand [T·G, NSMAX, KO] and the last to finish (cnt [T·G]: zero on entry and exit) merges
    the S·(K-1) candidates and writes the row (RANK_MERGE: by pairwise ranks, one pass; else K - 1 reductions).
    """
    NONE: tl.constexpr = -9223372036854775807  # below every packed key (a finite or +inf score)
    TOP: tl.constexpr = 9223372036854775807
    BIG: tl.constexpr = 2147483647  # "no block": sorts after every real index
    pid = tl.program_id(0)  # t * G + g
    sl = tl.program_id(1)
    n_sl = tl.num_programs(1)
    own = tl.load(pos_ptr + pid // G).to(tl.int64) // BS
    n_scan = tl.minimum(own + 1, MB) if CAUSAL else MB
    width = (n_scan + n_sl - 1) // n_sl
    lo = sl * width
    hi = tl.minimum(lo + width, n_scan)
    row = scores_ptr + pid.to(tl.int64) * MB
    slot = tl.arange(0, KO)
    is_set = slot < K - 1  # slots of the running top set; slot K - 1 is the own block's
    # The slice's first chunk: the set is empty, so its K - 1 best keys ARE the set.
    top = _topk_fill(_topk_keys(row, lo, hi, own, CH, BIG, NONE), slot, K, KO, NONE)
    for c0 in range(lo + CH, hi, CH):  # later chunks (slices wider than CH): replace the set's minimum
        keys = _topk_keys(row, c0, hi, own, CH, BIG, NONE)
        thr = tl.min(tl.where(is_set, top, TOP))
        best = tl.max(keys)
        while best > thr:  # the chunk's best beats the set's minimum: replace it
            victim = tl.min(tl.where(is_set & (top == thr), slot, KO))
            top = tl.where(slot == victim, best, top)
            keys = tl.where(keys == best, NONE, keys)
            thr = tl.min(tl.where(is_set, top, TOP))
            best = tl.max(keys)
    last = n_sl == 1  # a runtime i1 in both branches (not a Python bool: Triton merges if-branch types)
    if n_sl > 1:  # every slice's candidates to the workspace; the last slice to finish merges them
        cbase = cand_ptr + pid.to(tl.int64) * (NSMAX * KO)
        tl.store(cbase + sl * KO + slot, top)
        last = last_to_arrive(cnt_ptr, pid, n_sl)
        if last:
            c = tl.arange(0, NSMAX * KO)
            got = tl.load(cbase + c, mask=(c // KO < n_sl) & (c % KO < K - 1), other=NONE, cache_modifier=".cg")
            if RANK_MERGE:  # the slices' candidates are unique (each block is in one slice)
                top = _topk_rank_select(got, slot, K, NONE)
            else:
                top = _topk_fill(got, slot, K, KO, NONE)
            tl.store(cnt_ptr + pid, 0)
    if last:
        chosen = is_set & (top != NONE)
        cand = tl.where(chosen, BIG - (top & 0x7FFFFFFF), tl.where(slot == K - 1, own, BIG))
        before = (cand[None, :] < cand[:, None]) | ((cand[None, :] == cand[:, None]) & (slot[None, :] < slot[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(out_ptr + pid.to(tl.int64) * K + rank, tl.where(cand == BIG, -1, cand), mask=rank < K)
