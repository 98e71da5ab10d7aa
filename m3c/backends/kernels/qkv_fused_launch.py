"""Host side of the fused QKV + norm + RoPE + NVFP4 KV-insert kernel: layout, prepacking, tiles, launches.

`launch_fused` runs through Triton's launcher (tests, benchmarks, the JIT path); `fused_spec` /
`fused_args` describe the same kernel for offline compilation and the CUDA-driver launcher.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton

from m3c.backends.kernels.host import interpreting, persistent
from m3c.backends.kernels.qkv_fused import (
    norm_rope_kvinsert_kernel,
    qkv_gemm_kernel,
    qkv_norm_rope_kvinsert_kernel,
    qkv_norm_rope_kvinsert_splitk_kernel,
)

Tiles = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_K, num_warps, num_stages, SPLIT (1 = no split-K)


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
        if self.rest not in (0, self.rotary_dim):
            return f"rotary_dim {self.rotary_dim} must be head_dim or head_dim/2 (head_dim {self.head_dim})"
        if self.half % 16:
            return f"the rotary half ({self.half}) must be a multiple of 16 (one NVFP4 block)"
        if self.head_dim & (self.head_dim - 1):
            return f"head_dim {self.head_dim} must be a power of two (Triton block shapes)"
        return None

    def constexprs(self, block_m: int, block_k: int) -> dict[str, Any]:
        """The fused kernels' compile-time constants."""
        return dict(HQ=self.num_q_heads, HKV=self.num_kv_heads, G=self.num_index_heads,
                    HAS_INDEX=self.num_index_heads > 0, HEAD_DIM=self.head_dim, HALF=self.half, REST=self.rest,
                    BLOCK_M=block_m, BLOCK_K=block_k, UPCAST=interpreting())


def prepack_weight(w: torch.Tensor, shape: QKVShape) -> torch.Tensor:
    """Reorder each head's rotary rows so pair (i, i + rotary_dim/2) becomes adjacent rows 2i, 2i+1."""
    d, half = shape.head_dim, shape.half
    perm = torch.arange(d)
    perm[: 2 * half] = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)
    idx = (torch.arange(shape.num_heads)[:, None] * d + perm[None, :]).reshape(-1).to(w.device)
    return w.index_select(0, idx).contiguous()


PHASES: dict[str, tuple[int | None, Tiles]] = {
    "decode": (64, (16, 128, 4, 4, 4)),
    "mid": (1024, (64, 64, 4, 4, 1)),
    "prefill": (None, (128, 64, 8, 3, 1)),
}
"""The one tile table (BLOCK_M, BLOCK_K, warps, stages, split-K) by token count: phase -> (largest T, tiles).
From benchmarks/RESULTS.md run 2 (m3.1-small, fastest measured): BM 16 with split-K 4 at 16 and 64 tokens,
64×64 at 512, 128×64 with 8 warps at 8192. The lowering compiles every phase; launches pick by
:func:`tile_phase`."""


def tile_phase(num_tokens: int) -> str:
    """The phase of :data:`PHASES` whose token range holds `num_tokens`."""
    for name, (limit, _) in PHASES.items():
        if limit is None or num_tokens <= limit:
            return name
    raise AssertionError("PHASES ends with an unbounded phase")


def pick_tiles(num_tokens: int) -> Tiles:
    """Tile choice by token count (:data:`PHASES`); small tiles in Triton's interpreter (CPU tests)."""
    if interpreting():
        return (16, 32, 4, 1, 2) if num_tokens <= 16 else (16, 32, 4, 1, 1)
    return PHASES[tile_phase(num_tokens)][1]


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A persistent float32 partial-sum buffer and zeroed int32 counters (reused, so CUDA-graph safe)."""
    return persistent(("qkv_fused", str(device), floats, tiles),
                      lambda: (torch.empty(floats, dtype=torch.float32, device=device),
                               torch.zeros(tiles, dtype=torch.int32, device=device)))


def make_outputs(x: torch.Tensor, shape: QKVShape,
                 q_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty q [T, HQ, D] and index-q [T, max(G, 1), D] outputs for the fused kernel."""
    t = x.shape[0]
    q_dtype = q_dtype or x.dtype
    q = torch.empty((t, shape.num_q_heads, shape.head_dim), dtype=q_dtype, device=x.device)
    iq = torch.empty((t, max(shape.num_index_heads, 1), shape.head_dim), dtype=q_dtype, device=x.device)
    return q, iq


def fused_args(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
               norms: tuple[torch.Tensor, ...], k_cache: Any, v_cache: Any, ik_cache: Any, shape: QKVShape,
               eps: float, q: torch.Tensor, iq: torch.Tensor) -> tuple:
    """Runtime arguments of the (non-split) fused kernel in signature order."""
    has_index = shape.num_index_heads > 0
    ik = ik_cache if has_index else k_cache
    qn, kn, iqn, ikn = norms if has_index else (norms[0], norms[1], norms[0], norms[1])
    return (x, w, cos, sin, slot_mapping, qn, kn, iqn, ikn, q, iq, k_cache.data, k_cache.scale, v_cache.data,
            v_cache.scale, ik.data, ik.scale)


def fused_launch(x: torch.Tensor, w_packed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, norms: tuple[torch.Tensor, ...], k_cache: Any, v_cache: Any,
                 ik_cache: Any, shape: QKVShape, eps: float, tiles: Tiles, q: torch.Tensor,
                 iq: torch.Tensor) -> tuple[tuple[int], tuple]:
    """(grid, runtime arguments in signature order) of one fused launch, split-K workspace included.

    The same for Triton's launcher and for the cubin launcher of a compiled program.
    """
    t, k = x.shape
    bm, _, _, _, split = tiles
    args = fused_args(x, w_packed, cos, sin, slot_mapping, norms, k_cache, v_cache, ik_cache, shape, eps, q, iq)
    n_tiles = triton.cdiv(t, bm) * shape.num_heads
    if split > 1:
        ws, cnt = _workspace(x.device, split * n_tiles * bm * shape.head_dim, n_tiles)
        return (n_tiles * split,), (*args, ws, cnt, t, k, eps)
    return (n_tiles,), (*args, t, k, eps)


def launch_fused(x: torch.Tensor, w_packed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, norms: tuple[torch.Tensor, ...], k_cache: Any, v_cache: Any,
                 ik_cache: Any, shape: QKVShape, eps: float, q_dtype: torch.dtype | None = None,
                 tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the fused op (one launch). `w_packed` comes from `prepack_weight`; caches are (data, scale) views.

    `norms` = (q_norm, k_norm, index_q_norm, index_k_norm) (the last two unused on dense layers).
    Returns q [T, HQ, D] and index-q [T, G, D] (None on dense layers).
    """
    bm, bk, warps, stages, split = tiles = tiles or pick_tiles(x.shape[0])
    q, iq = make_outputs(x, shape, q_dtype)
    grid, args = fused_launch(x, w_packed, cos, sin, slot_mapping, norms, k_cache, v_cache, ik_cache, shape, eps,
                              tiles, q, iq)
    consts = shape.constexprs(bm, bk)
    if split > 1:
        qkv_norm_rope_kvinsert_splitk_kernel[grid](*args, **consts, SPLIT=split, num_warps=warps,
                                                   num_stages=stages, enable_fp_fusion=False)
    else:
        qkv_norm_rope_kvinsert_kernel[grid](*args, **consts, num_warps=warps, num_stages=stages,
                                            enable_fp_fusion=False)
    return q, (iq if shape.num_index_heads else None)


def launch_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, shape: QKVShape,
                tiles: Tiles | None = None) -> torch.Tensor:
    """The projection alone with the fused kernel's tiling and order (x @ W^T into out [T, N], natural order)."""
    t, k = x.shape
    bm, bk, warps, stages, _ = tiles or pick_tiles(t)
    grid = (triton.cdiv(t, bm) * shape.num_heads,)
    qkv_gemm_kernel[grid](x, w, out, t, k, out.shape[1], NH=shape.num_heads, HEAD_DIM=shape.head_dim, BLOCK_M=bm,
                          BLOCK_K=bk, UPCAST=interpreting(), num_warps=warps, num_stages=stages)
    return out


def launch_unfused(x: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slot_mapping: torch.Tensor, norms: tuple[torch.Tensor, ...], k_cache: Any, v_cache: Any,
                   ik_cache: Any, shape: QKVShape, eps: float, q_dtype: torch.dtype | None = None,
                   tiles: Tiles | None = None,
                   qkv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same work as two launches (our GEMM into HBM, then norm/RoPE/quantize/insert): the baseline.

    Takes the natural (not prepacked) weight.
    """
    t = x.shape[0]
    bm = (tiles or pick_tiles(t))[0]
    qkv = torch.empty((t, shape.num_heads * shape.head_dim), dtype=qkv_dtype or x.dtype, device=x.device)
    launch_gemm(x, w, qkv, shape, tiles)
    q, iq = make_outputs(x, shape, q_dtype)
    args = fused_args(x, w, cos, sin, slot_mapping, norms, k_cache, v_cache, ik_cache, shape, eps, q, iq)[2:]
    consts = shape.constexprs(bm, 0)
    for key in ("BLOCK_K", "UPCAST"):
        consts.pop(key)
    norm_rope_kvinsert_kernel[(triton.cdiv(t, bm), shape.num_heads)](
        qkv, *args, t, qkv.shape[1], eps, **consts, num_warps=4, enable_fp_fusion=False)
    return q, (iq if shape.num_index_heads else None)


@functools.cache  # launches ask for the same few specs every step: build (and key) each once
def fused_spec(shape: QKVShape, tiles: Tiles, act: str = "bf16", q_out: str = "bf16"):
    """The AOT KernelSpec of the fused kernel (split-K variant when tiles[4] > 1) for one layout and dtypes."""
    from m3c.backends.triton_aot import KernelSpec

    bm, bk, warps, stages, split = tiles
    ptr = {"x_ptr": act, "w_ptr": act, "cos_ptr": "fp32", "sin_ptr": "fp32", "slot_ptr": "i64",
           "qn_ptr": "bf16", "kn_ptr": "bf16", "iqn_ptr": "bf16", "ikn_ptr": "bf16", "q_out_ptr": q_out,
           "iq_out_ptr": q_out, "kd_ptr": "u8", "ks_ptr": "fp8e4nv", "vd_ptr": "u8", "vs_ptr": "fp8e4nv",
           "ikd_ptr": "u8", "iks_ptr": "fp8e4nv"}
    consts = shape.constexprs(bm, bk) | {"UPCAST": False}
    fn = qkv_norm_rope_kvinsert_kernel
    if split > 1:
        ptr |= {"ws_ptr": "fp32", "cnt_ptr": "i32"}
        consts["SPLIT"] = split
        fn = qkv_norm_rope_kvinsert_splitk_kernel
    types = {k: "*" + v for k, v in ptr.items()} | {"T": "i32", "K": "i32", "eps": "fp32"}
    return KernelSpec("qkv_norm_rope_kvinsert", fn, types, consts, warps, stages, divisible_16=(*ptr, "K"))
