"""Fused QKV GEMM + per-head RMSNorm + partial RoPE + NVFP4 paged KV-insert (one Triton launch).

One program computes a [BLOCK_M tokens × one head] tile of ``x @ W_qkv^T`` with the head split in
three accumulators (first rotary half, second rotary half, the non-rotary rest), so RoPE pairs
sit in matching registers. The epilogue then, by head kind:
q / index-q: RMSNorm × weight, RoPE, store to the output; k / index-k: RMSNorm × weight, RoPE,
NVFP4-quantize and store codes + E4M3 scales at the token's cache slot; v: quantize and store.
The QKV tensor never reaches HBM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


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
def _gemm_head(x_ptr, w_ptr, rows_c, h, K, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
               R3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """Accumulators (rotary half 1, rotary half 2, rest) of x[rows] @ W[head h]^T in float32."""
    w_row0 = h * HEAD_DIM
    r1 = w_row0 + tl.arange(0, HALF)
    r2 = w_row0 + HALF + tl.arange(0, HALF)
    r3 = w_row0 + 2 * HALF + tl.arange(0, R3)
    a1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_M, R3], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows_c[:, None] * K + ks[None, :], mask=kmask[None, :], other=0.0)
        w1 = tl.load(w_ptr + r1[:, None] * K + ks[None, :], mask=kmask[None, :], other=0.0)
        w2 = tl.load(w_ptr + r2[:, None] * K + ks[None, :], mask=kmask[None, :], other=0.0)
        if UPCAST:  # Triton's CPU interpreter mis-multiplies bf16 dots; f32 gives the same exact products
            x = x.to(tl.float32)
            w1 = w1.to(tl.float32)
            w2 = w2.to(tl.float32)
        a1 = tl.dot(x, tl.trans(w1), a1)
        a2 = tl.dot(x, tl.trans(w2), a2)
        if REST > 0:
            w3 = tl.load(w_ptr + r3[:, None] * K + ks[None, :], mask=kmask[None, :], other=0.0)
            if UPCAST:
                w3 = w3.to(tl.float32)
            a3 = tl.dot(x, tl.trans(w3), a3)
    return a1, a2, a3


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
    """The fused op: one [BLOCK_M × head] tile of the projection and its epilogue; heads q, k, v, index-q, index-k."""
    R3: tl.constexpr = REST if REST > 0 else 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < T
    rows_c = tl.where(mask_m, rows, 0)
    h = tl.program_id(1)
    a1, a2, a3 = _gemm_head(x_ptr, w_ptr, rows_c, h, K, HEAD_DIM, HALF, REST, R3, BLOCK_M, BLOCK_K, UPCAST)
    _head_epilogue(a1, a2, a3, h, rows_c, mask_m, cos_ptr, sin_ptr, slot_ptr, qn_ptr, kn_ptr, iqn_ptr, ikn_ptr,
                   q_out_ptr, iq_out_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, ikd_ptr, iks_ptr, eps,
                   HQ, HKV, G, HAS_INDEX, HEAD_DIM, HALF, REST, R3, BLOCK_M)


@triton.jit
def qkv_gemm_kernel(x_ptr, w_ptr, out_ptr, T, K, N,
                    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """The same projection without the epilogue: x @ W^T stored to out [T, N] (baseline and unfused path)."""
    R3: tl.constexpr = REST if REST > 0 else 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < T
    rows_c = tl.where(mask_m, rows, 0)
    h = tl.program_id(1)
    a1, a2, a3 = _gemm_head(x_ptr, w_ptr, rows_c, h, K, HEAD_DIM, HALF, REST, R3, BLOCK_M, BLOCK_K, UPCAST)
    _store_rows(out_ptr, rows_c.to(tl.int64) * N + h * HEAD_DIM, a1, a2, a3, mask_m, HALF, REST, R3)


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
    """The unfused epilogue as its own kernel: reads the projection from HBM, then the same per-head work."""
    R3: tl.constexpr = REST if REST > 0 else 16
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


@dataclass(frozen=True)
class QKVShape:
    """The head layout of the concatenated projection (rows: q heads, k, v, index-q heads, index-k)."""

    num_q_heads: int
    num_kv_heads: int
    num_index_heads: int  # 0 on dense layers (no index projections)
    head_dim: int
    rotary_dim: int

    @property
    def half(self) -> int:
        """Width of one rotary half."""
        return self.rotary_dim // 2

    @property
    def rest(self) -> int:
        """Non-rotary tail width."""
        return self.head_dim - self.rotary_dim

    @property
    def num_heads(self) -> int:
        """Head tiles in the projection (the index key counts as one)."""
        index = self.num_index_heads + 1 if self.num_index_heads else 0
        return self.num_q_heads + 2 * self.num_kv_heads + index

    def supported(self) -> str | None:
        """Why the kernel cannot take this layout, or None when it can."""
        if self.half % 16 or (self.rest and self.rest % 16):
            return f"rotary halves ({self.half}) and the tail ({self.rest}) must be multiples of 16 (NVFP4 blocks)"
        for name, v in (("rotary half", self.half), ("tail", self.rest)):
            if v and v & (v - 1):
                return f"the {name} width {v} must be a power of two (Triton block shapes)"
        return None

    def constexprs(self, block_m: int, block_k: int) -> dict[str, Any]:
        """The fused kernel's compile-time constants."""
        return dict(HQ=self.num_q_heads, HKV=self.num_kv_heads, G=self.num_index_heads,
                    HAS_INDEX=self.num_index_heads > 0, HEAD_DIM=self.head_dim, HALF=self.half, REST=self.rest,
                    BLOCK_M=block_m, BLOCK_K=block_k, UPCAST=interpreting())


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pick_tiles(num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, num_stages) for a token count: small M tiles for decode."""
    if interpreting():
        return 16, 32, 4, 1
    if num_tokens <= 64:
        return 64, 128, 4, 4
    if num_tokens <= 1024:
        return 64, 64, 4, 4
    return 128, 64, 8, 3


def launch_fused(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 norms: tuple[torch.Tensor, ...], k_cache: Any, v_cache: Any, ik_cache: Any, shape: QKVShape,
                 eps: float, q_dtype: torch.dtype | None = None,
                 tiles: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the fused kernel through Triton's launcher; caches are NVFP4Tensor-like (data, scale) views.

    `norms` = (q_norm, k_norm, index_q_norm, index_k_norm) (the last two unused on dense layers).
    Returns q [T, HQ, D] and index-q [T, G, D] (None on dense layers).
    """
    t, k = x.shape
    bm, bk, warps, stages = tiles or pick_tiles(t)
    q_dtype = q_dtype or x.dtype
    q = torch.empty((t, shape.num_q_heads, shape.head_dim), dtype=q_dtype, device=x.device)
    has_index = shape.num_index_heads > 0
    iq = torch.empty((t, max(shape.num_index_heads, 1), shape.head_dim), dtype=q_dtype, device=x.device)
    ik = ik_cache if has_index else k_cache
    qn, kn, iqn, ikn = norms if has_index else (norms[0], norms[1], norms[0], norms[1])
    grid = (triton.cdiv(t, bm), shape.num_heads)
    qkv_norm_rope_kvinsert_kernel[grid](
        x, w, cos, sin, slot_mapping, qn, kn, iqn, ikn, q, iq,
        k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, ik.data, ik.scale,
        t, k, eps, **shape.constexprs(bm, bk), num_warps=warps, num_stages=stages, enable_fp_fusion=False,
    )
    return q, (iq if has_index else None)


def launch_unfused(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, norms: tuple[torch.Tensor, ...], k_cache: Any, v_cache: Any,
                   ik_cache: Any, shape: QKVShape, eps: float, q_dtype: torch.dtype | None = None,
                   tiles: tuple[int, int, int, int] | None = None,
                   qkv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same work as two launches (our GEMM, then the norm/RoPE/quantize/insert kernel): the baseline."""
    t = x.shape[0]
    bm, bk, warps, stages = tiles or pick_tiles(t)
    n = shape.num_heads * shape.head_dim
    qkv = torch.empty((t, n), dtype=qkv_dtype or x.dtype, device=x.device)
    launch_gemm(x, w, qkv, shape, (bm, bk, warps, stages))
    q_dtype = q_dtype or x.dtype
    q = torch.empty((t, shape.num_q_heads, shape.head_dim), dtype=q_dtype, device=x.device)
    has_index = shape.num_index_heads > 0
    iq = torch.empty((t, max(shape.num_index_heads, 1), shape.head_dim), dtype=q_dtype, device=x.device)
    ik = ik_cache if has_index else k_cache
    qn, kn, iqn, ikn = norms if has_index else (norms[0], norms[1], norms[0], norms[1])
    c = shape.constexprs(bm, bk)
    for key in ("BLOCK_K", "UPCAST"):
        c.pop(key)
    norm_rope_kvinsert_kernel[(triton.cdiv(t, bm), shape.num_heads)](
        qkv, cos, sin, slot_mapping, qn, kn, iqn, ikn, q, iq,
        k_cache.data, k_cache.scale, v_cache.data, v_cache.scale, ik.data, ik.scale,
        t, n, eps, **c, num_warps=4, enable_fp_fusion=False,
    )
    return q, (iq if has_index else None)


def launch_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, shape: QKVShape,
                tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The projection alone with the fused kernel's tiling (x @ W^T into out [T, N])."""
    t, k = x.shape
    bm, bk, warps, stages = tiles or pick_tiles(t)
    qkv_gemm_kernel[(triton.cdiv(t, bm), shape.num_heads)](
        x, w, out, t, k, out.shape[1], HEAD_DIM=shape.head_dim, HALF=shape.half, REST=shape.rest,
        BLOCK_M=bm, BLOCK_K=bk, UPCAST=interpreting(), num_warps=warps, num_stages=stages,
    )
    return out


def fused_spec(shape: QKVShape, tiles: tuple[int, int, int, int], act: str = "bf16", q_out: str = "bf16"):
    """The AOT KernelSpec of the fused kernel for one layout, tile choice and dtypes (Triton type names)."""
    from m3c.backends.triton_aot import KernelSpec

    bm, bk, warps, stages = tiles
    ptr = {"x_ptr": act, "w_ptr": act, "cos_ptr": "fp32", "sin_ptr": "fp32", "slot_ptr": "i64",
           "qn_ptr": "bf16", "kn_ptr": "bf16", "iqn_ptr": "bf16", "ikn_ptr": "bf16", "q_out_ptr": q_out,
           "iq_out_ptr": q_out, "kd_ptr": "u8", "ks_ptr": "fp8e4nv", "vd_ptr": "u8", "vs_ptr": "fp8e4nv",
           "ikd_ptr": "u8", "iks_ptr": "fp8e4nv"}
    types = {k: "*" + v for k, v in ptr.items()} | {"T": "i32", "K": "i32", "eps": "fp32"}
    consts = shape.constexprs(bm, bk) | {"UPCAST": False}
    return KernelSpec("qkv_norm_rope_kvinsert", qkv_norm_rope_kvinsert_kernel, types, consts, warps, stages,
                      divisible_16=(*ptr, "K"))


def fused_args(x, w, cos, sin, slot_mapping, norms, k_cache, v_cache, ik_cache, shape: QKVShape, eps: float,
               q: torch.Tensor, iq: torch.Tensor) -> tuple:
    """Runtime arguments of the fused kernel in signature order (for the cubin launcher)."""
    has_index = shape.num_index_heads > 0
    ik = ik_cache if has_index else k_cache
    qn, kn, iqn, ikn = norms if has_index else (norms[0], norms[1], norms[0], norms[1])
    return (x, w, cos, sin, slot_mapping, qn, kn, iqn, ikn, q, iq, k_cache.data, k_cache.scale, v_cache.data,
            v_cache.scale, ik.data, ik.scale, x.shape[0], x.shape[1], eps)
