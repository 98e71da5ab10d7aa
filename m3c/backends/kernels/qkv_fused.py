"""Fused QKV GEMM + per-head RMSNorm + partial RoPE + NVFP4 paged KV-insert: the Triton device code.

One program computes a [BLOCK_M tokens × one head] tile of ``x @ W_qkv^T`` (one tensor-core dot of
width head_dim). The weight rows are prepacked so each RoPE pair (i, i + rotary_dim/2) sits in
adjacent columns; the epilogue splits the accumulator into (first rotary half, second rotary
half, non-rotary tail) with register reshapes, then by head kind: q / index-q: RMSNorm × weight,
RoPE, store; k / index-k: RMSNorm × weight, RoPE, NVFP4-quantize, store codes + E4M3 scales at
the token's cache slot; v: quantize and store. The QKV tensor never reaches HBM. Programs are
ordered head-fastest so the heads of one token tile run together and share its activations in L2.
A split-K variant serves decode (few tokens): partial sums go to a small workspace and the last
program of each head (an atomic counter) reduces them in a fixed order and runs the epilogue.
Host-side launchers and prepacking live in :mod:`m3c.backends.kernels.qkv_fused_launch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3c.backends.kernels.split_merge import last_to_arrive


@triton.jit
def _e4m3_rne(v):
    """Round non-negative float32 v (<= 448) to the nearest E4M3 value, ties to even, exactly (as float32).

    Done in integer arithmetic so the result does not depend on the conversion instruction (Triton's
    CPU interpreter rounds float32 -> fp8 wrongly when the mantissa carries into the exponent).
    """
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # keep 3 mantissa bits
    sub = (v * 512.0 + 12582912.0) - 12582912.0  # round to a multiple of 2^-9 (E4M3 subnormal step)
    return tl.where(v < 0.015625, sub * 0.001953125, normal)


@triton.jit
def _nvfp4_store(a, data_ptr, scale_ptr, row_off, col0, BLOCK_M: tl.constexpr, W: tl.constexpr, mask_m):
    """Quantize a [BLOCK_M, W] tile (W % 16 == 0) to NVFP4 and store it at byte/scale columns col0/2, col0/16."""
    blocks = tl.reshape(a, [BLOCK_M, W // 16, 16])
    amax = tl.max(tl.abs(blocks), axis=2)
    target = tl.minimum(tl.math.div_rn(amax, 6.0), 448.0)
    scale = _e4m3_rne(target)
    scale8 = scale.to(tl.float8e4nv)
    safe = tl.where(scale == 0.0, 1.0, scale)
    v = tl.math.div_rn(blocks, safe[:, :, None])
    v = tl.where(scale[:, :, None] == 0.0, v * 0.0, v)
    mag = tl.abs(v)
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    code = code | (sign << 3)
    pairs = tl.reshape(code, [BLOCK_M, W // 2, 2])
    lo, hi = tl.split(pairs)
    packed = (lo | (hi << 4)).to(tl.uint8)
    cols = col0 // 2 + tl.arange(0, W // 2)
    tl.store(data_ptr + row_off[:, None] // 2 + cols[None, :], packed, mask=mask_m[:, None])
    scols = col0 // 16 + tl.arange(0, W // 16)
    tl.store(scale_ptr + row_off[:, None] // 16 + scols[None, :], scale8, mask=mask_m[:, None])


@triton.jit
def _rms_rope(a1, a2, a3, w_ptr, c, s, eps, HALF: tl.constexpr, REST: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Per-row RMSNorm × weight over the whole head, then neox RoPE on the (a1, a2) halves."""
    ss = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
    if REST > 0:
        ss += tl.sum(a3 * a3, axis=1)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(ss, HEAD_DIM) + eps))
    w1 = tl.load(w_ptr + tl.arange(0, HALF)).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + tl.arange(0, HALF)).to(tl.float32)
    n1 = a1 * inv[:, None] * w1[None, :]
    n2 = a2 * inv[:, None] * w2[None, :]
    if REST > 0:
        w3 = tl.load(w_ptr + 2 * HALF + tl.arange(0, REST)).to(tl.float32)
        a3 = a3 * inv[:, None] * w3[None, :]
    return n1 * c - n2 * s, n2 * c + n1 * s, a3


@triton.jit
def _gemm_tile(x_ptr, w_ptr, rows_c, n0, k_lo, k_hi, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """float32 x[rows, k_lo:k_hi] @ W[n0:n0+BLOCK_N, k_lo:k_hi]^T."""
    rn = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_hi
        x = tl.load(x_ptr + rows_c[:, None].to(tl.int64) * K + ks[None, :], mask=kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + ks[None, :], mask=kmask[None, :], other=0.0)
        if UPCAST:  # Triton's CPU interpreter mis-multiplies bf16 dots; f32 gives the same exact products
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if x.dtype == tl.float32:  # a float32 graph keeps float32 products (no TF32 rounding)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _split_head(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr):
    """(rotary half 1, rotary half 2, tail) of a prepacked head accumulator [BLOCK_M, 2*HALF + REST].

    Prepacked column order: r0, r_HALF, r1, r_HALF+1, ... (pairs), then the tail (REST == 2*HALF or 0).
    """
    if REST > 0:
        both = tl.permute(tl.reshape(acc, [BLOCK_M, 2, 2 * HALF]), (0, 2, 1))
        rot, tail = tl.split(both)
    else:
        rot = acc
        tail = acc
    a1, a2 = tl.split(tl.reshape(rot, [BLOCK_M, HALF, 2]))
    return a1, a2, tail


@triton.jit
def _store_rows(ptr, base, a1, a2, a3, mask_m, HALF: tl.constexpr, REST: tl.constexpr, R3: tl.constexpr):
    """Store the three pieces of a head row-tile at element offsets base[:, None] + column."""
    c1 = tl.arange(0, HALF)
    ty = ptr.dtype.element_ty
    tl.store(ptr + base[:, None] + c1[None, :], a1.to(ty), mask=mask_m[:, None])
    tl.store(ptr + base[:, None] + HALF + c1[None, :], a2.to(ty), mask=mask_m[:, None])
    if REST > 0:
        c3 = 2 * HALF + tl.arange(0, R3)
        tl.store(ptr + base[:, None] + c3[None, :], a3.to(ty), mask=mask_m[:, None])


@triton.jit
def _nvfp4_store3(a1, a2, a3, d_ptr, s_ptr, row_off, mask_m, BLOCK_M: tl.constexpr, HALF: tl.constexpr,
                  REST: tl.constexpr):
    _nvfp4_store(a1, d_ptr, s_ptr, row_off, 0, BLOCK_M, HALF, mask_m)
    _nvfp4_store(a2, d_ptr, s_ptr, row_off, HALF, BLOCK_M, HALF, mask_m)
    if REST > 0:
        _nvfp4_store(a3, d_ptr, s_ptr, row_off, 2 * HALF, BLOCK_M, REST, mask_m)


@triton.jit
def _head_epilogue(a1, a2, a3, h, rows_c, mask_m, cos_ptr, sin_ptr, slot_ptr,
                   qn_ptr, kn_ptr, iqn_ptr, ikn_ptr, q_out_ptr, iq_out_ptr,
                   kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr, eps,
                   HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, HAS_INDEX: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, R3: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """By head kind: q / index-q → norm, RoPE, store; k / index-k → norm, RoPE, NVFP4 insert; v → NVFP4 insert."""
    hc = tl.arange(0, HALF)
    c = tl.load(cos_ptr + rows_c[:, None] * HALF + hc[None, :])
    s = tl.load(sin_ptr + rows_c[:, None] * HALF + hc[None, :])
    slots = tl.load(slot_ptr + rows_c).to(tl.int64)
    rows64 = rows_c.to(tl.int64)
    if h < HQ:
        o1, o2, o3 = _rms_rope(a1, a2, a3, qn_ptr, c, s, eps, HALF, REST, HEAD_DIM)
        _store_rows(q_out_ptr, (rows64 * HQ + h) * HEAD_DIM, o1, o2, o3, mask_m, HALF, REST, R3)
    elif h < HQ + HKV:
        o1, o2, o3 = _rms_rope(a1, a2, a3, kn_ptr, c, s, eps, HALF, REST, HEAD_DIM)
        _nvfp4_store3(o1, o2, o3, kd_ptr, ks_ptr, (slots * HKV + (h - HQ)) * HEAD_DIM, mask_m, BLOCK_M, HALF, REST)
    elif h < HQ + 2 * HKV:
        _nvfp4_store3(a1, a2, a3, vd_ptr, vs_ptr, (slots * HKV + (h - HQ - HKV)) * HEAD_DIM, mask_m, BLOCK_M,
                      HALF, REST)
    elif HAS_INDEX:
        if h < HQ + 2 * HKV + G:
            o1, o2, o3 = _rms_rope(a1, a2, a3, iqn_ptr, c, s, eps, HALF, REST, HEAD_DIM)
            _store_rows(iq_out_ptr, (rows64 * G + (h - HQ - 2 * HKV)) * HEAD_DIM, o1, o2, o3, mask_m, HALF, REST,
                        R3)
        else:
            o1, o2, o3 = _rms_rope(a1, a2, a3, ikn_ptr, c, s, eps, HALF, REST, HEAD_DIM)
            _nvfp4_store3(o1, o2, o3, ikd_ptr, iks_ptr, slots * HEAD_DIM, mask_m, BLOCK_M, HALF, REST)


@triton.jit
def _tile_rows(tile, NH: tl.constexpr, T, BLOCK_M: tl.constexpr):
    """(head, clamped token rows, row mask) of a program tile numbered head-fastest."""
    rows = (tile // NH) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < T
    return tile % NH, tl.where(mask_m, rows, 0), mask_m


@triton.jit
def qkv_norm_rope_kvinsert_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr,
    qn_ptr, kn_ptr, iqn_ptr, ikn_ptr,
    q_out_ptr, iq_out_ptr,
    kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr,
    T, K, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, HAS_INDEX: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    """The fused op for prefill: program = (token tile, head), head fastest; W prepacked (see _split_head)."""
    R3: tl.constexpr = REST if REST > 0 else 2 * HALF
    NH: tl.constexpr = HQ + 2 * HKV + ((G + 1) if HAS_INDEX else 0)
    h, rows_c, mask_m = _tile_rows(tl.program_id(0), NH, T, BLOCK_M)
    acc = _gemm_tile(x_ptr, w_ptr, rows_c, h * HEAD_DIM, 0, K, K, BLOCK_M, HEAD_DIM, BLOCK_K, UPCAST)
    a1, a2, a3 = _split_head(acc, BLOCK_M, HALF, REST)
    _head_epilogue(a1, a2, a3, h, rows_c, mask_m, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, iqn_ptr, ikn_ptr,
                   q_out_ptr, iq_out_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr, eps,
                   HQ, HKV, G, HAS_INDEX, HEAD_DIM, HALF, REST, R3, BLOCK_M)


@triton.jit
def qkv_norm_rope_kvinsert_splitk_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr,
    qn_ptr, kn_ptr, iqn_ptr, ikn_ptr,
    q_out_ptr, iq_out_ptr,
    kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr,
    ws_ptr, cnt_ptr,
    T, K, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, HAS_INDEX: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
):
    """The fused op for decode: program = (token tile, head, K slice); the last slice to finish reduces.

    ws is float32 [SPLIT, m_tiles * NH, BLOCK_M, HEAD_DIM]; cnt is int32 [m_tiles * NH], zero on entry
    and left zero on exit (so the launch can be replayed in a CUDA graph).
    """
    R3: tl.constexpr = REST if REST > 0 else 2 * HALF
    NH: tl.constexpr = HQ + 2 * HKV + ((G + 1) if HAS_INDEX else 0)
    pid = tl.program_id(0)
    sp = pid % SPLIT
    tile = pid // SPLIT
    h, rows_c, mask_m = _tile_rows(tile, NH, T, BLOCK_M)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = sp * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = _gemm_tile(x_ptr, w_ptr, rows_c, h * HEAD_DIM, k_lo, k_hi, K, BLOCK_M, HEAD_DIM, BLOCK_K, UPCAST)
    n_tiles = tl.num_programs(0) // SPLIT
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, HEAD_DIM)
    tile_off = r[:, None] * HEAD_DIM + c[None, :]
    tl.store(ws_ptr + (sp * n_tiles + tile).to(tl.int64) * (BLOCK_M * HEAD_DIM) + tile_off, acc)
    if last_to_arrive(cnt_ptr, tile, SPLIT):
        total = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for i in range(SPLIT):  # fixed order: the result does not depend on which slice finished last
            total += tl.load(ws_ptr + (i * n_tiles + tile).to(tl.int64) * (BLOCK_M * HEAD_DIM) + tile_off,
                             cache_modifier=".cg")
        tl.store(cnt_ptr + tile, 0)
        a1, a2, a3 = _split_head(total, BLOCK_M, HALF, REST)
        _head_epilogue(a1, a2, a3, h, rows_c, mask_m, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, iqn_ptr,
                       ikn_ptr, q_out_ptr, iq_out_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr, eps,
                       HQ, HKV, G, HAS_INDEX, HEAD_DIM, HALF, REST, R3, BLOCK_M)


@triton.jit
def qkv_gemm_kernel(x_ptr, w_ptr, out_ptr, T, K, N, NH: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """The projection alone, same tiling and order, natural column order: out [T, N] (baseline / unfused)."""
    h, rows_c, mask_m = _tile_rows(tl.program_id(0), NH, T, BLOCK_M)
    acc = _gemm_tile(x_ptr, w_ptr, rows_c, h * HEAD_DIM, 0, K, K, BLOCK_M, HEAD_DIM, BLOCK_K, UPCAST)
    cols = h * HEAD_DIM + tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + rows_c[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


@triton.jit
def norm_rope_kvinsert_kernel(
    qkv_ptr, cos_ptr, sin_ptr, slot_ptr,
    qn_ptr, kn_ptr, iqn_ptr, ikn_ptr,
    q_out_ptr, iq_out_ptr,
    kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr,
    T, N, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, HAS_INDEX: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The unfused epilogue as its own kernel: reads the projection (natural order) back from HBM."""
    R3: tl.constexpr = REST if REST > 0 else 2 * HALF
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < T
    rows_c = tl.where(mask_m, rows, 0)
    h = tl.program_id(1)
    base = rows_c.to(tl.int64)[:, None] * N + h * HEAD_DIM
    c1 = tl.arange(0, HALF)
    a1 = tl.load(qkv_ptr + base + c1[None, :]).to(tl.float32)
    a2 = tl.load(qkv_ptr + base + HALF + c1[None, :]).to(tl.float32)
    a3 = tl.load(qkv_ptr + base + 2 * HALF + tl.arange(0, R3)[None, :], mask=REST > 0, other=0.0).to(tl.float32)
    _head_epilogue(a1, a2, a3, h, rows_c, mask_m, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, iqn_ptr, ikn_ptr,
                   q_out_ptr, iq_out_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr, eps,
                   HQ, HKV, G, HAS_INDEX, HEAD_DIM, HALF, REST, R3, BLOCK_M)
